"""Faults under a real `kvray serve` (loopback Ray cluster, worker actors): a killed worker,
a frozen worker (SIGSTOP), a killed engine replica. In every case each request in flight
ends within its bound, with an error event or finished, the client sees no internal
details, and the server recovers: the next request succeeds. Also: errors raised inside
the engine replica reach clients as plain OpenAI errors."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.helpers.hostile_requests import EXPLICIT, POST_PATHS, dumps, fuzz_settings, keep_cheap
from tests.helpers.http_checks import Findings, response_problems
from tests.helpers.serve_faults import (
    CONTEXT,
    FLAGS,
    HEADERS,
    LEAKS,
    WORKER_TIMEOUT_S,
    killed_worker_fails_its_requests_and_the_server_recovers,
    processes_left,
    ray_process,
    recovers,
    server_process,
    sigterm_drains_then_aborts,
    start_streams,
    wait_ended,
)
from tests.helpers.server import launch_server
from tests.helpers.tiny_models import VOCAB_SIZE, make_tiny_model

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # Room for a request that cannot finish within the drain deadline however fast the
    # engine gets: 1,000 tokens used to outlast it and no longer do.
    model = make_tiny_model("llama_gqa", tmp_path_factory.mktemp("faults") / "tiny-llama",
                            max_position_embeddings=CONTEXT)
    with launch_server(model, FLAGS) as base:
        yield base, model.name


@pytest.mark.parametrize("body,param", [
    ({"prompt": [VOCAB_SIZE + 5]}, "prompt"),
    ({"prompt": "x", "stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {str(VOCAB_SIZE + 1): 5}}, "logit_bias"),
    ({"prompt": [5] * (CONTEXT - 4), "max_tokens": 10}, "max_tokens"),
])
def test_errors_raised_in_the_engine_replica_reach_clients_without_internals(served, body,
                                                                              param):
    base, model = served
    for stream in (False, True):
        resp = httpx.post(f"{base}/v1/completions", headers=HEADERS, timeout=60,
                          json={"model": model, **body, "stream": stream})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
        assert not LEAKS.search(resp.text), resp.text


def test_hostile_requests_through_the_real_server(served):
    """The in-process fuzz cases (tests/test_http_fuzz.py) replayed through Ray Serve, where
    errors raised in the engine replica cross a process boundary, plus a short schemathesis
    pass over the served schema: no 5xx, no leak, OpenAI error JSON; the server still
    answers."""
    import schemathesis

    base, model = served
    findings = Findings()
    with httpx.Client(base_url=base, headers=HEADERS, timeout=60) as client:
        for path in POST_PATHS:
            for body in EXPLICIT:
                raw = dumps({"model": model, **body})
                resp = client.post(path, content=raw,
                                   headers={"content-type": "application/json"})
                problems = response_problems(resp.status_code,
                                             resp.headers.get("content-type", ""),
                                             resp.content, body, raw)
                if problems:
                    findings.add(path, resp.status_code, problems,
                                 raw.decode("utf-8", "replace")[:300], resp.text)
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=HEADERS)
    for result in schema.get_all_operations():
        op = result.ok()
        if op.body:
            _fuzz_positive(op, model, findings)
    assert not findings.by_key, findings.report()
    recovers(base, model, bound_s=30)


def _fuzz_positive(op, model: str, findings) -> None:
    """A few schema-valid cases of one operation through the real server (max_tokens and n
    kept small, the served model name)."""
    from hypothesis import given
    from schemathesis import GenerationMode

    @fuzz_settings(8)
    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case):
        keep_cheap(case.body)
        if isinstance(case.body, dict):
            case.body["model"] = model
        resp = case.call(headers=HEADERS, timeout=60)
        ctype = {k.lower(): v for k, v in resp.headers.items()}.get("content-type", [""])
        problems = response_problems(resp.status_code, ctype[0], resp.content, case.body,
                                     b"", cut_short=resp.stream_cut_short)
        if problems:
            findings.add(f"{op.method} {op.path}", resp.status_code, problems,
                         str(case.body)[:300], resp.content.decode("utf-8", "replace"))

    run()


def test_the_private_clusters_serve_processes_use_the_grpc_transport(served):
    """`kvray serve` sets SERVE_ENV for the Ray cluster it starts: Serve's proxy, the
    ingress and the engine replica all run with it (the fault tests below then run over
    that transport)."""
    from kvray.cli import SERVE_ENV

    base, _ = served
    for title in ("ray::ProxyActor", "ray::ServeReplica:kvray:OpenAIIngress",
                  "ray::ServeReplica:kvray:LLMServer"):
        env = ray_process(base, title).environ()
        for key, value in SERVE_ENV.items():
            assert env.get(key) == value, (title, key, env.get(key))


def test_a_killed_worker_fails_its_requests_and_the_server_recovers(served):
    killed_worker_fails_its_requests_and_the_server_recovers(*served)


def test_a_frozen_worker_is_treated_as_dead_and_the_server_recovers(served):
    base, model = served
    streams = start_streams(base, model)
    worker = ray_process(base, "ray::_RankedWorker")
    frozen = time.monotonic()
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        # worker_timeout_s, then Ray's kill of a process that cannot answer (~5 s)
        ended = wait_ended(streams, frozen, bound_s=WORKER_TIMEOUT_S + 25)
        recovered = recovers(base, model, bound_s=120)
    finally:
        if worker.is_running():
            os.kill(worker.pid, signal.SIGCONT)
    print(f"\nfrozen worker: streams ended after {max(ended):.1f} s, "
          f"server answering again after {recovered:.1f} s")
    assert all(s.errors for s in streams)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


def test_a_killed_engine_replica_fails_its_requests_and_serve_replaces_it(served):
    base, model = served
    streams = start_streams(base, model)
    replica = ray_process(base, "ray::ServeReplica:kvray:LLMServer")
    killed = time.monotonic()
    replica.kill()
    ended = wait_ended(streams, killed, bound_s=30)
    # Each request it held failed (a 503 event: wait_ended), none ran on to its end.
    assert all(s.errors and s.finish_reason is None for s in streams), [
        (s.errors, s.finish_reason, s.chunks) for s in streams]
    recovered = recovers(base, model, bound_s=180)
    print(f"\nkilled engine replica: streams ended after {max(ended):.1f} s, "
          f"server answering again after {recovered:.1f} s")
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 200
    # The answer came from a new replica process, the killed one stayed dead.
    assert not replica.is_running() or replica.status() == psutil.STATUS_ZOMBIE
    successor = ray_process(base, "ray::ServeReplica:kvray:LLMServer")
    assert successor.pid != replica.pid


def _prefix_queries(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kvray:prefix_cache_queries_total{")]
    return sum(values)


def test_metrics_survive_the_death_of_the_stats_actor(served):
    """The engine replicas' stats reach /metrics through a small named actor; killed, it is
    restarted (or looked up again) and the gauges move again, never frozen."""
    base, model = served
    recovers(base, model, bound_s=60)
    time.sleep(1.5)  # a report period or two
    before = _prefix_queries(base)
    ray_process(base, "ray::StatsBoard").kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        recovers(base, model, bound_s=60)  # a request: its prompt is looked up
        if _prefix_queries(base) > before:
            return
        time.sleep(1)
    pytest.fail("engine gauges on /metrics stayed frozen after the stats actor died")


def test_sigterm_drains_then_aborts_and_leaves_no_process(served):
    """Last in this module: it stops the server. A short request finishes; a long one is
    ended with an error at the drain deadline; new requests get 503 + Retry-After; the
    process exits 0 and every process of its Ray cluster is gone."""
    base, model = served
    server = server_process(base)
    family = server.children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in family)
    sigterm_drains_then_aborts(base, model, server)
    left = processes_left(family)
    assert not left, left


