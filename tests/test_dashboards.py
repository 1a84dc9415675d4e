"""kvray's Grafana dashboards, Prometheus alerting rules and Grafana provisioning, each
checked by the real tool where one exists here.

* Structure of every dashboard in ``dashboards/`` (ids, layout, datasource variable, exprs).
* Every metric name the dashboards and the alert rules use exists in kvray's exposition
  (``ServerMetrics.render()``), and, in the live test, in a real ``kvray serve``'s /metrics.
* Live: a real Prometheus (Debian's ``prometheus`` package, fetched by
  :mod:`prometheus_tools` when missing) scrapes a real ``kvray serve`` (and its Ray node's
  metrics agent, for Ray Serve's HTTP series) every second under a short load; every panel
  query, template variables substituted, must return data, and the alert rules must load.
  The server runs a tiny mixture-of-experts model, so that the MoE panels have data too.
* ``promtool check rules`` / ``promtool test rules`` / ``promtool check config``.
* ``kvray grafana provision`` against a stand-in for Grafana's HTTP API: no Grafana server
  exists on these machines (its packages are not in Debian nor on PyPI), so a small local HTTP
  server answers the calls provisioning makes the way Grafana does, and records them.
* Bad fixtures: the checkers reject overlapping panels, unknown metrics and the rest.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import glob
import json
import os
import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvray.ops import grafana
from kvray.serve.metrics import ServerMetrics
from tests.helpers.lora import ATTN, make_lora_adapter
from tests.helpers.prometheus_tools import (
    CI_FIX,
    ToolsMissing,
    find_prometheus_tools,
    has_finite_value,
    metric_names,
    query,
    run_prometheus,
    wait_for_targets,
)
from tests.helpers.server import API_KEY, launch_server
from tests.helpers.skips import skip_or_fail_in_ci
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.serve

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
ALERTS = DASHBOARDS / "alerts.yml"
DS_VAR = ("${datasource}", "$datasource")
GRID_COLUMNS = 24
# Series the dashboards and rules use that kvray's own /metrics does not expose; the live
# test checks that a real Prometheus has each of them.
EXTERNAL_METRICS = {
    "up": "Prometheus' per-target scrape health",
    "ray_serve_num_http_requests_total": "Ray Serve's HTTP proxy counter (Ray metrics agent)",
}


# ---- loading and checking ------------------------------------------------------------------
def load_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def iter_panels(dashboard: dict):
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # a row's (collapsed) panels


def panel_targets(dashboard: dict):
    """(panel title, target) for every query target of every panel."""
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []):
            yield panel.get("title", "?"), target


def variable_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(variable, metric selector, label) of each ``label_values(selector, label)`` query."""
    out = []
    for var in dashboard["templating"]["list"]:
        if var.get("type") != "query":
            continue
        q = var.get("query")
        text = q.get("query", "") if isinstance(q, dict) else q or ""
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", text)
        out.append((var["name"], m.group(1) if m else text, m.group(2) if m else ""))
    return out


def _uses_ds_var(ds) -> bool:
    return isinstance(ds, dict) and ds.get("uid") in DS_VAR and ds.get("type") == "prometheus"


def dashboard_problems(dashboard: dict) -> list[str]:
    """What is wrong with a dashboard's structure (empty: nothing)."""
    problems = []
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", str(dashboard.get("uid") or "")):
        problems.append(f"bad or missing uid {dashboard.get('uid')!r}")
    if not isinstance(dashboard.get("schemaVersion"), int) or dashboard["schemaVersion"] < 36:
        problems.append(f"schemaVersion {dashboard.get('schemaVersion')!r} is not >= 36")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    ds = variables.get("datasource", {})
    if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        problems.append("no 'datasource' template variable of type prometheus")
    for name in ("model_name", "replica"):
        var = variables.get(name)
        if var is None or var.get("type") != "query":
            problems.append(f"no '{name}' query template variable")
        elif not _uses_ds_var(var.get("datasource")):
            problems.append(f"variable '{name}' does not use ${{datasource}}")
    for name, _selector, label in variable_queries(dashboard):
        if not label:
            problems.append(f"variable '{name}' query is not label_values(metric, label)")
    seen: dict[int, str] = {}
    rects = []
    for panel in iter_panels(dashboard):
        title = panel.get("title", "?")
        pid = panel.get("id")
        if not isinstance(pid, int):
            problems.append(f"panel '{title}' has no numeric id")
        elif pid in seen:
            problems.append(f"duplicate panel id {pid} ('{seen[pid]}' and '{title}')")
        else:
            seen[pid] = title
        g = panel.get("gridPos") or {}
        if not all(isinstance(g.get(k), int) for k in "xywh") or g["w"] < 1 or g["h"] < 1:
            problems.append(f"panel '{title}' has a bad gridPos {g}")
        else:
            if g["x"] < 0 or g["y"] < 0 or g["x"] + g["w"] > GRID_COLUMNS:
                problems.append(f"panel '{title}' lies outside the {GRID_COLUMNS}-column grid")
            rects.append((title, g))
        if panel.get("type") == "row":
            continue
        if not _uses_ds_var(panel.get("datasource")):
            problems.append(f"panel '{title}' datasource {panel.get('datasource')!r} does "
                            "not use ${datasource}")
        if not panel.get("targets"):
            problems.append(f"panel '{title}' has no targets")
        for target in panel.get("targets", []):
            ref = target.get("refId", "?")
            if not str(target.get("expr") or "").strip():
                problems.append(f"panel '{title}' target {ref} has no expr")
            if "datasource" in target and not _uses_ds_var(target["datasource"]):
                problems.append(f"panel '{title}' target {ref} datasource does not use "
                                "${datasource}")
    for i, (ta, a) in enumerate(rects):
        for tb, b in rects[i + 1:]:
            if (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
                    and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]):
                problems.append(f"panels '{ta}' and '{tb}' overlap")
    return problems


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and variable query."""
    out = [(f"panel '{title}'", t.get("expr", "")) for title, t in panel_targets(dashboard)]
    out += [(f"variable '{name}'", sel) for name, sel, _ in variable_queries(dashboard)]
    return out


def alert_exprs(rules: dict) -> list[tuple[str, str]]:
    return [(f"rule '{r.get('alert') or r.get('record')}'", r["expr"])
            for group in rules["groups"] for r in group["rules"]]


def unknown_metric_problems(exprs: list[tuple[str, str]], known: set[str]) -> list[str]:
    """Metric names used in ``exprs`` that are neither in ``known`` nor external."""
    return [f"{where}: unknown metric {name}" for where, expr in exprs
            for name in sorted(metric_names(expr)) if name not in known | set(EXTERNAL_METRICS)]


def exposition_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def substitute(expr: str, model: str, replica: str) -> str:
    """A dashboard expr as Grafana sends it: variables replaced (``.*`` = All)."""
    for var, value in (("model_name", model), ("replica", replica)):
        expr = expr.replace(f"${{{var}}}", value).replace(f"${var}", value)
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s")
    assert "$" not in expr, expr
    return expr


@pytest.fixture(scope="module")
def dashboards():
    found = load_dashboards()
    assert "kvray-overview.json" in found
    return found


@pytest.fixture(scope="module")
def rules():
    return yaml.safe_load(ALERTS.read_text())


@pytest.fixture(scope="module")
def exposed_names() -> set[str]:
    """Sample names of a kvray exposition with every series present."""
    metrics = ServerMetrics("m")
    metrics.observe_request(prompt_tokens=5, generation_tokens=3, finish_reason="length",
                            queue_time=0.01, ttft=0.1, e2e=0.3, itl=[0.05, 0.06])
    metrics.set_engine_stats("r0", {"num_running": 1, "num_waiting": 2, "num_swapped": 0,
                                    "kv_cache_usage": 0.5, "prefix_cache_queries": 10,
                                    "prefix_cache_hits": 4, "num_preemptions": 1,
                                    "num_swap_objects": 0, "lora_requests": {"a": 2},
                                    "kv_tier": {"hit_tokens": 8, "local_hit_tokens": 4,
                                                "fetched_bytes": 64, "offloaded_blocks": 2,
                                                "offloaded_bytes": 64, "fetch_failures": 0},
                                    "moe_expert_tokens": {0: [3, 1]}})
    return exposition_names(metrics.render().decode())


@pytest.fixture(scope="module")
def tools():
    try:
        return find_prometheus_tools()
    except ToolsMissing as err:
        skip_or_fail_in_ci(str(err), CI_FIX)


# ---- a. structure ---------------------------------------------------------------------------
def test_dashboards_are_well_formed(dashboards):
    for name, dashboard in dashboards.items():
        assert dashboard_problems(dashboard) == [], name
    uids = [d["uid"] for d in dashboards.values()]
    assert len(uids) == len(set(uids))
    assert dashboards["kvray-overview.json"]["uid"] == "kvray-overview"


def test_overview_covers_every_kvray_series(dashboards, exposed_names):
    used = {n for _, e in dashboard_exprs(dashboards["kvray-overview.json"])
            for n in metric_names(e)}
    families = {re.sub(r"_(bucket|sum|count|total|created)$", "", n) for n in exposed_names}
    shown = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    # *_total gauges keep their suffix as a family name: compare both spellings.
    missing = {f for f in families if f not in shown and f"{f}_total" not in used}
    assert missing == set()


# ---- b. metric names ------------------------------------------------------------------------
def test_metric_names_exist_in_the_kvray_exposition(dashboards, rules, exposed_names):
    assert "kvray:time_to_first_token_seconds_bucket" in exposed_names  # the fixture is full
    exprs = [e for d in dashboards.values() for e in dashboard_exprs(d)] + alert_exprs(rules)
    assert unknown_metric_problems(exprs, exposed_names) == []


def test_metric_name_extraction():
    assert metric_names('histogram_quantile(0.99, sum by (model_name, le) (rate('
                        'kvray:x_bucket{model_name=~"$model_name"}[$__rate_interval])))') == {
        "kvray:x_bucket"}
    assert metric_names('up{job="kvray"} == 0 or absent(kvray:a) offset 5m') == {
        "up", "kvray:a"}
    assert metric_names("a / on(x) group_left(y) b > 1e3 and bool c") == {"a", "b", "c"}


# ---- d. promtool ----------------------------------------------------------------------------
def test_promtool_checks_and_unit_tests_the_rules(tools):
    promtool = str(tools[1])
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"],
                 ["check", "config", "prometheus.example.yml"]):
        got = subprocess.run([promtool, *args], cwd=DASHBOARDS, capture_output=True,
                             text=True, timeout=60)
        assert got.returncode == 0, f"promtool {' '.join(args)}:\n{got.stdout}{got.stderr}"
    rules = yaml.safe_load(ALERTS.read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    assert names == {"KvrayEngineDown", "KvrayKVCacheFull", "KvrayWaitingQueueGrowing",
                     "KvrayTTFTHigh", "Kvray5xxRate"}
    tests = yaml.safe_load((DASHBOARDS / "alerts_test.yml").read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a["exp_alerts"]}
    silent = {a["alertname"] for t in tests for a in t["alert_rule_test"] if not a["exp_alerts"]}
    assert fired == names and silent == names  # each alert shown firing and not firing


def test_promtool_test_rules_bites(tools, tmp_path):
    """A rule whose threshold no longer matches its unit test fails `promtool test rules`."""
    text = ALERTS.read_text().replace("kvray:kv_cache_usage_perc > 0.95",
                                      "kvray:kv_cache_usage_perc > 0.98")
    (tmp_path / "alerts.yml").write_text(text)
    (tmp_path / "alerts_test.yml").write_text((DASHBOARDS / "alerts_test.yml").read_text())
    got = subprocess.run([str(tools[1]), "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert got.returncode != 0 and "KvrayKVCacheFull" in got.stdout + got.stderr



# One change per alert that its unit tests in alerts_test.yml must catch.
ALERT_MUTANTS = {
    "KvrayEngineDown": ('up{job="kvray"} == 0 or absent(kvray:num_requests_running)',
                        'up{job="kvray"} == 0'),
    "KvrayKVCacheFull": ("kvray:kv_cache_usage_perc > 0.95", "kvray:kv_cache_usage_perc > 0.98"),
    "KvrayWaitingQueueGrowing": ("kvray:num_requests_waiting > 5 and",
                                 "kvray:num_requests_waiting > 50 and"),
    "KvrayTTFTHigh": ("[5m]))) > 5", "[5m]))) > 10"),
    "Kvray5xxRate": ("> 0.05", "> 0.1"),
}


@pytest.mark.parametrize("alert", sorted(ALERT_MUTANTS))
def test_promtool_test_rules_bites_on_every_alert(tools, tmp_path, alert):
    """Each of the five alerts: a changed rule fails `promtool test rules`, naming it."""
    rules = yaml.safe_load(ALERTS.read_text())
    assert {r["alert"] for g in rules["groups"] for r in g["rules"]} == set(ALERT_MUTANTS)
    old, new = ALERT_MUTANTS[alert]
    text = ALERTS.read_text()
    assert text.count(old) == 1, old
    (tmp_path / "alerts.yml").write_text(text.replace(old, new))
    (tmp_path / "alerts_test.yml").write_text((DASHBOARDS / "alerts_test.yml").read_text())
    got = subprocess.run([str(tools[1]), "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert got.returncode != 0 and alert in got.stdout + got.stderr, got.stdout + got.stderr

# ---- c. live: real Prometheus scraping a real kvray serve ----------------------------------
def _ray_metrics_port(http_port: int, timeout: float = 60) -> int:
    """The metrics-export port of the private Ray cluster the `kvray serve` child listening
    on ``http_port`` started (Ray names the session folder after the starting pid)."""
    try:
        from ray._common.utils import get_default_ray_temp_dir
        ray_tmp = get_default_ray_temp_dir()
    except ImportError:
        ray_tmp = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray")
    serve = [p for p in psutil.Process().children()
             if "serve" in p.cmdline() and str(http_port) in p.cmdline()]
    assert len(serve) == 1, "cannot find the kvray serve process"
    pattern = os.path.join(ray_tmp, f"session_*_{serve[0].pid}", "metrics_export_port_*")
    deadline = time.monotonic() + timeout
    while not (files := glob.glob(pattern)):
        assert time.monotonic() < deadline, f"no Ray metrics port file {pattern}"
        time.sleep(0.5)
    return int(Path(files[0]).read_text().strip())


def _wait_for_series(prom: str, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not query(prom, name):
        assert time.monotonic() < deadline, f"Prometheus kept no sample of {name}"
        time.sleep(0.5)


def _load(base: str, model: str, requests: int = 36, extras: bool = True) -> None:
    """``requests`` completions, streamed and not, some with a shared prompt prefix; with
    ``extras`` also n-gram drafts to verify and one 4xx."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0,
                           timeout=120)
    shared = "The quick brown fox jumps over the lazy dog. " * 4

    def one(i: int) -> None:
        prompt = (shared if i % 2 else f"Request {i}: ") + f"tell me about {i}"
        if i % 3 == 0:
            chunks = list(client.completions.create(model=model, prompt=prompt,
                                                    max_tokens=12, stream=True))
            assert chunks
        else:
            out = client.completions.create(model=model, prompt=prompt, max_tokens=8 + i % 8)
            assert out.choices[0].text is not None

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        list(pool.map(one, range(requests)))
    for _ in range(2):  # a LoRA adapter's requests for the LoRA panels
        client.completions.create(model="adapter", prompt="tell me", max_tokens=6)
    if not extras:
        return
    repeats = " ".join(["one two three four"] * 6)  # n-gram drafts to verify
    for _ in range(3):
        client.completions.create(model=model, prompt=repeats, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):  # one 4xx for the HTTP-status panel
        client.completions.create(model=model, prompt="x", max_tokens=10**7)


@pytest.fixture(scope="module")
def live(tools, tmp_path_factory):
    """A real Prometheus scraping a real `kvray serve` (1 s) after a short load."""
    root = tmp_path_factory.mktemp("dash_live")
    # A mixture-of-experts model, so that the MoE panels have data too (a dense layer, 1,
    # among MoE layers 0 and 2); LoRA on the attention projections (not on MoE layers)
    model_dir = make_tiny_model("qwen2_moe_shared", root / "tiny-moe")
    adapter = make_lora_adapter(model_dir, root / "adapter", rank=8, targets=ATTN)
    # n-gram speculation on, so the speculative-decoding panel has series too; a LoRA
    # adapter for the LoRA panels; the KV tier for its panels
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
            "--lora-modules", f"adapter={adapter}", "--kv-offload-bytes", "67108864"]
    with launch_server(model_dir, spec) as base:
        http_port = int(base.rsplit(":", 1)[1])
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": "kvray", "metrics_path": "/metrics",
                 "static_configs": [{"targets": [f"127.0.0.1:{http_port}"]}]},
                {"job_name": "ray",
                 "static_configs": [{"targets": [f"127.0.0.1:{_ray_metrics_port(http_port)}"]}],
                 "metric_relabel_configs": [{"source_labels": ["__name__"],
                                             "regex": "ray_serve_.*", "action": "keep"}]},
            ]}
        with run_prometheus(tools[0], yaml.safe_dump(config), root / "prom") as prom:
            wait_for_targets(prom, {"kvray", "ray"})
            start = time.time()
            _load(base, model_dir.name)
            # The request histograms grow only during the load. If the scrapes failed
            # meanwhile (busy cores; a 1 s interval is also the scrape timeout), the first
            # sample Prometheus keeps already holds the totals and every rate() of them is
            # 0 (seen in CI). A few more requests after a kept sample make them grow.
            _wait_for_series(prom, "kvray:time_to_first_token_seconds_count")
            _load(base, model_dir.name, requests=4, extras=False)
            yield {"server": base, "prom": prom, "model": model_dir.name, "start": start - 5}


def _replica(prom: str) -> str:
    values = query(prom, "kvray:num_requests_running")
    assert values, "no kvray:num_requests_running in Prometheus"
    return values[0]["metric"]["replica"]


def test_live_every_panel_query_returns_data(live, dashboards):
    prom, model = live["prom"], live["model"]
    replica = _replica(prom)
    cases = []
    for dashboard in dashboards.values():
        for title, target in panel_targets(dashboard):
            for m, r in ((model, replica), (".*", ".*")):
                cases.append((title, substitute(target["expr"], m, r), target.get("instant")))
    # Ray's metrics agent exports every ~10 s: poll until each query has a number.
    deadline = time.monotonic() + 60
    while True:
        empty = []
        for title, expr, instant in cases:
            result = (query(prom, expr) if instant
                      else query(prom, expr, start=live["start"], end=time.time(), step=1))
            if not has_finite_value(result):
                empty.append(f"{title}: {expr}")
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert empty == []
    # ...and the filters filter: another model's name selects nothing.
    title, target = next(panel_targets(dashboards["kvray-overview.json"]))
    assert query(prom, substitute(target["expr"], "no-such-model", ".*")) == []


def test_live_moe_expert_tokens_cover_every_moe_layer_and_expert(live):
    """The MoE model's /metrics: one series per (MoE layer, expert), none for the dense
    layer; every token passes every MoE layer once (top-2), so the layers' sums agree."""
    text = httpx.get(f"{live['server']}/metrics", timeout=10).text
    sums: dict[str, int] = {}
    experts: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvray:moe_expert_tokens_total":
                layer = sample.labels["layer"]
                sums[layer] = sums.get(layer, 0) + int(sample.value)
                experts.setdefault(layer, set()).add(sample.labels["expert"])
    assert experts == {"0": {str(e) for e in range(6)}, "2": {str(e) for e in range(6)}}
    assert sums["0"] == sums["2"] > 0 and sums["0"] % 2 == 0


def test_live_template_variables_resolve(live, dashboards):
    prom, model = live["prom"], live["model"]
    for dashboard in dashboards.values():
        for name, selector, label in variable_queries(dashboard):
            resp = httpx.get(f"{prom}/api/v1/label/{label}/values", timeout=10, params={
                "match[]": substitute(selector, ".*", ".*")}).json()
            assert resp["status"] == "success" and resp["data"], name
            if name == "model_name":
                assert resp["data"] == [model]


def test_live_metric_names_exist_in_real_scrapes(live, dashboards, rules):
    text = httpx.get(f"{live['server']}/metrics", timeout=10).text  # no API key needed
    real = exposition_names(text)
    exprs = [e for d in dashboards.values() for e in dashboard_exprs(d)] + alert_exprs(rules)
    used = {n for _, e in exprs for n in metric_names(e)}
    assert {n for n in used if n.startswith("kvray:")} <= real
    for name in EXTERNAL_METRICS:  # scraped by the real Prometheus, not kvray's /metrics
        assert query(live["prom"], f"count({name})"), name


def test_live_alert_rules_load_and_stay_quiet(live):
    deadline = time.monotonic() + 20
    while True:
        groups = httpx.get(f"{live['prom']}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        if rules and all(not r.get("lastEvaluation", "0001").startswith("0001")
                         for r in rules.values()):
            break
        assert time.monotonic() < deadline
        time.sleep(1)
    assert len(rules) == 5
    assert set(rules) == {"KvrayEngineDown", "KvrayKVCacheFull", "KvrayWaitingQueueGrowing",
                          "KvrayTTFTHigh", "Kvray5xxRate"}
    for name, rule in rules.items():
        assert rule["health"] == "ok", (name, rule.get("lastError"))
    assert rules["KvrayEngineDown"]["state"] == "inactive"  # up == 1 and kvray series exist
    assert rules["KvrayKVCacheFull"]["state"] == "inactive"
    # A short load that all succeeded: no queue left, no 5xx.
    assert rules["KvrayWaitingQueueGrowing"]["state"] == "inactive"
    assert rules["Kvray5xxRate"]["state"] == "inactive"
    # p99 TTFT over 5 s can be real on a busy host: then the rule must show it, else stay quiet.
    ttft = rules["KvrayTTFTHigh"]
    assert ttft["state"] == "inactive" or query(live["prom"], ttft["query"]), ttft


# ---- e. provisioning against a Grafana API stand-in ----------------------------------------
class FakeGrafana:
    """Answers the Grafana HTTP API calls `kvray grafana provision` makes, as Grafana does,
    and records (method, path, body)."""

    def __init__(self, token: str = "glsa_test") -> None:
        self.token, self.calls = token, []
        self.folders: dict[str, dict] = {}
        self.datasources: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.calls.append((self.command, self.path, body))
                if self.headers.get("Authorization") != f"Bearer {fake.token}":
                    return self._answer(401, {"message": "Unauthorized"})
                self._answer(*fake.route(self.command, self.path, body))

            do_GET = do_POST = do_PUT = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def route(self, method: str, path: str, body) -> tuple[int, dict]:
        from urllib.parse import unquote

        parts = [unquote(p) for p in path.split("?")[0].strip("/").split("/")]
        if parts[:2] == ["api", "folders"]:
            if method == "POST":
                if body["uid"] in self.folders:
                    return 409, {"message": "a folder with the same uid already exists"}
                self.folders[body["uid"]] = {**body, "id": len(self.folders) + 1, "version": 1}
                return 200, self.folders[body["uid"]]
            folder = self.folders.get(parts[2])
            if folder is None:
                return 404, {"message": "folder not found"}
            if method == "PUT":
                folder.update(title=body["title"], version=folder["version"] + 1)
            return 200, folder
        if parts[:2] == ["api", "datasources"]:
            if method == "POST":
                if any(d["name"] == body["name"] for d in self.datasources.values()):
                    return 409, {"message": "data source with the same name already exists"}
                self.datasources[body["uid"]] = {**body, "id": len(self.datasources) + 1}
                return 200, {"message": "Datasource added",
                             "datasource": self.datasources[body["uid"]]}
            if parts[2] == "name":
                found = [d for d in self.datasources.values() if d["name"] == parts[3]]
                return (200, found[0]) if found else (404, {"message": "not found"})
            ds = self.datasources.get(parts[3])
            if ds is None:
                return 404, {"message": "Data source not found"}
            if method == "PUT":
                ds.update(body)
                return 200, {"message": "Datasource updated", "datasource": ds}
            return 200, ds
        if parts == ["api", "dashboards", "db"] and method == "POST":
            uid = body["dashboard"]["uid"]
            old = self.dashboards.get(uid)
            if old is not None and not body.get("overwrite"):
                return 412, {"status": "name-exists", "message": "dashboard exists"}
            version = old["version"] + 1 if old else 1
            self.dashboards[uid] = {**body, "version": version}
            return 200, {"status": "success", "uid": uid, "version": version,
                         "url": f"/d/{uid}/x", "id": 1}
        return 404, {"message": "Not found"}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvray")
    grafana.add_grafana_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_provision_creates_then_updates_without_duplicates(dashboards):
    with FakeGrafana() as fake:
        first = grafana.provision(fake.url, token=fake.token,
                                  prometheus_url="http://prom:9090", folder="kvray")
        assert [(m, p) for m, p, _ in fake.calls] == [
            ("GET", "/api/folders/kvray"), ("POST", "/api/folders"),
            ("GET", "/api/datasources/uid/kvray-prometheus"),
            ("GET", "/api/datasources/name/kvray%20Prometheus"), ("POST", "/api/datasources"),
            *[("POST", "/api/dashboards/db")] * len(dashboards)]
        assert fake.calls[1][2] == {"uid": "kvray", "title": "kvray"}
        ds = fake.calls[4][2]
        assert (ds["type"], ds["url"], ds["uid"], ds["access"]) == (
            "prometheus", "http://prom:9090", grafana.DATASOURCE_UID, "proxy")
        posted = [body for _, p, body in fake.calls if p == "/api/dashboards/db"]
        assert sorted(b["dashboard"]["uid"] for b in posted) == sorted(
            d["uid"] for d in dashboards.values())
        for body in posted:
            assert body["overwrite"] is True and body["folderUid"] == "kvray"
            assert body["dashboard"]["id"] is None
            ds_var = next(v for v in body["dashboard"]["templating"]["list"]
                          if v["name"] == "datasource")
            assert ds_var["current"]["value"] == grafana.DATASOURCE_UID
        assert first["folder"]["created"] and first["datasource"]["created"]

        fake.calls.clear()
        second = grafana.provision(fake.url, token=fake.token,
                                   prometheus_url="http://prom2:9090", folder="kvray")
        assert [(m, p) for m, p, _ in fake.calls] == [
            ("GET", "/api/folders/kvray"), ("PUT", "/api/folders/kvray"),
            ("GET", "/api/datasources/uid/kvray-prometheus"),
            ("PUT", "/api/datasources/uid/kvray-prometheus"),
            *[("POST", "/api/dashboards/db")] * len(dashboards)]
        assert fake.calls[1][2]["overwrite"] is True
        assert not second["folder"]["created"] and not second["datasource"]["created"]
        assert len(fake.folders) == 1 and len(fake.datasources) == 1
        assert len(fake.dashboards) == len(dashboards)
        assert fake.datasources["kvray-prometheus"]["url"] == "http://prom2:9090"
        assert all(d["version"] == 2 for d in fake.dashboards.values())


def test_provision_cli(tmp_path, monkeypatch, capsys):
    with FakeGrafana() as fake:
        monkeypatch.setenv(grafana.TOKEN_ENV, fake.token)
        assert _cli(["grafana", "provision", "--url", fake.url, "--folder", "LLM serving",
                     "--dashboards", str(DASHBOARDS)]) == 0
        assert "llm-serving" in fake.folders
        assert "kvray-overview" in capsys.readouterr().out
        monkeypatch.delenv(grafana.TOKEN_ENV)
        assert _cli(["grafana", "provision", "--url", fake.url]) == 1
        assert "HTTP 401" in capsys.readouterr().err
        (tmp_path / "empty").mkdir()
        assert _cli(["grafana", "provision", "--url", fake.url, "--token", fake.token,
                     "--dashboards", str(tmp_path / "empty")]) == 1
        assert "no *.json dashboards" in capsys.readouterr().err
    assert _cli(["grafana", "provision", "--url", fake.url, "--token", "t",
                 "--timeout", "2"]) == 1  # the stand-in is gone
    assert "cannot reach Grafana" in capsys.readouterr().err


def test_file_provisioning_matches_the_api_provisioning():
    ds = yaml.safe_load((DASHBOARDS / "provisioning" / "datasources.yml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert (source["type"], source["uid"], source["name"], source["access"]) == (
        "prometheus", grafana.DATASOURCE_UID, grafana.DATASOURCE_NAME, "proxy")
    prov = yaml.safe_load((DASHBOARDS / "provisioning" / "dashboards.yml").read_text())
    assert prov["apiVersion"] == 1
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    assert provider["folderUid"] == grafana.folder_uid(provider["folder"])


# ---- f. the checks bite ---------------------------------------------------------------------
def test_checks_reject_bad_dashboards(dashboards, exposed_names):
    good = dashboards["kvray-overview.json"]
    panels = [p for p in good["panels"] if p["type"] != "row"]

    bad = copy.deepcopy(good)
    victim = next(p for p in bad["panels"] if p["id"] == panels[1]["id"])
    victim["gridPos"] = dict(panels[0]["gridPos"])
    assert f"panels '{panels[0]['title']}' and '{panels[1]['title']}' overlap" in \
        dashboard_problems(bad)

    bad = copy.deepcopy(good)
    bad["panels"][-1]["id"] = bad["panels"][0]["id"]
    assert any(p.startswith("duplicate panel id") for p in dashboard_problems(bad))

    bad = copy.deepcopy(good)
    panel = next(p for p in bad["panels"] if p["type"] != "row")
    panel["datasource"] = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}
    panel["targets"][0]["expr"] = ""
    problems = dashboard_problems(bad)
    assert any("does not use ${datasource}" in p for p in problems)
    assert f"panel '{panel['title']}' target A has no expr" in problems

    bad = copy.deepcopy(good)
    panel = next(p for p in bad["panels"] if p["type"] != "row")
    panel["gridPos"]["x"] = 23
    assert f"panel '{panel['title']}' lies outside the 24-column grid" in \
        dashboard_problems(bad)

    bad = copy.deepcopy(good)
    panel = next(p for p in bad["panels"] if p["type"] != "row")
    panel["targets"][0]["expr"] = "rate(kvray:request_succes_total[5m])"
    assert unknown_metric_problems(dashboard_exprs(bad), exposed_names) == [
        f"panel '{panel['title']}': unknown metric kvray:request_succes_total"]

    rules = yaml.safe_load(ALERTS.read_text())
    rules["groups"][0]["rules"][1]["expr"] = "kvray:kv_cache_usage_percent > 0.95"
    assert unknown_metric_problems(alert_exprs(rules), exposed_names) == [
        "rule 'KvrayKVCacheFull': unknown metric kvray:kv_cache_usage_percent"]
