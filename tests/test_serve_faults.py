"""Faults under a real `kvray serve` (loopback Ray cluster, worker actors): a killed worker,
a frozen worker (SIGSTOP), a killed engine replica. In every case each request in flight
ends within its bound, with an error event or finished, the client sees no internal
details, and the server recovers: the next request succeeds. Also: errors raised inside
the engine replica reach clients as plain OpenAI errors."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest
from test_serve import API_KEY, launch_server
from tiny_models import VOCAB_SIZE, make_tiny_model

WORKER_TIMEOUT_S = 5
DRAIN_TIMEOUT_S = 10
LONG_TOKENS = 30_000  # a request that outlasts the drain deadline (~10 ms a token at best)
CONTEXT = LONG_TOKENS + 64
FLAGS = ["--distributed-executor-backend", "ray", "--worker-timeout-s", str(WORKER_TIMEOUT_S),
         "--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--enable-docs",
         # (after test_serve's ENGINE_FLAGS: these win) room for the long request
         "--max-model-len", str(CONTEXT), "--num-gpu-blocks-override", "9000"]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LEAKS = re.compile(r"Traceback|File \"|pid=|actor_id|ActorID|\b\d{1,3}(\.\d{1,3}){3}\b|"
                   r"/tmp/|/work/|site-packages|\.py\b|ray::")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # Room for a request that cannot finish within the drain deadline however fast the
    # engine gets: 1,000 tokens used to outlast it and no longer do.
    model = make_tiny_model("llama_gqa", tmp_path_factory.mktemp("faults") / "tiny-llama",
                            max_position_embeddings=CONTEXT)
    with launch_server(model, FLAGS) as base:
        yield base, model.name


def _server_process(base: str) -> psutil.Process:
    port = base.rsplit(":", 1)[1]
    servers = [p for p in psutil.process_iter(["cmdline"])
               if "serve" in (p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])]
    assert len(servers) == 1, f"expected one kvray serve on port {port}"
    return servers[0]


def _ray_process(base: str, title: str) -> psutil.Process:
    """The one live process of the server at ``base`` whose title starts with ``title``
    (e.g. 'ray::_RankedWorker'): a descendant of that `kvray serve` (its Ray cluster)."""
    found = [p for p in _server_process(base).children(recursive=True)
             if " ".join(p.cmdline()).startswith(title) and p.status() != psutil.STATUS_ZOMBIE]
    assert len(found) == 1, f"expected one {title} process, found {len(found)}"
    return found[0]


@dataclass
class Stream:
    """One streaming completion consumed on its own thread."""

    base: str
    model: str
    max_tokens: int = 900
    chunks: int = 0
    errors: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    failure: str | None = None  # transport-level
    ended_at: float | None = None
    first_chunk: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Stream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body,
                              headers=HEADERS, timeout=120) as resp:
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        self.done = True
                        continue
                    assert not LEAKS.search(data), data
                    event = json.loads(data)
                    if "error" in event:
                        self.errors.append(event["error"])
                        continue
                    self.chunks += 1
                    self.first_chunk.set()
                    for c in event["choices"]:
                        self.finish_reason = c["finish_reason"] or self.finish_reason
        except Exception as err:  # the connection dropped: counted as a failure
            self.failure = repr(err)
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()

    def ended_cleanly(self) -> bool:
        """Finished, or ended with one OpenAI error event; then [DONE] either way."""
        if self.failure is not None or not self.done:
            return False
        if self.errors:
            err = self.errors[0]
            return err["code"] == 503 and err["type"] == "ServiceUnavailableError"
        return self.finish_reason == "length"


def _start_streams(base: str, model: str, count: int = 3) -> list[Stream]:
    streams = [Stream(base, model).start() for _ in range(count)]
    for s in streams:
        assert s.first_chunk.wait(60), "no first chunk in 60 s"
        assert s.failure is None and not s.errors, (s.failure, s.errors)
    return streams


def _wait_ended(streams: list[Stream], since: float, bound_s: float) -> list[float]:
    deadline = since + bound_s
    while time.monotonic() < deadline and any(s.ended_at is None for s in streams):
        time.sleep(0.1)
    assert all(s.ended_at is not None for s in streams), f"a stream outlived {bound_s} s"
    for s in streams:
        assert s.ended_cleanly(), (s.failure, s.errors, s.done, s.finish_reason)
    return [s.ended_at - since for s in streams]


def _recovers(base: str, model: str, bound_s: float, any_5xx: bool = False) -> float:
    """Seconds until a plain completion succeeds again (fails the test past ``bound_s``).
    Meanwhile the server answers 503 + Retry-After; with ``any_5xx`` any 5xx (Serve's
    proxy while no replica is up behind it), never with internal details."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < bound_s:
        try:
            resp = httpx.post(f"{base}/v1/completions", headers=HEADERS, timeout=60, json={
                "model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
            last = (resp.status_code, resp.text[:300])
            if resp.status_code == 200:
                return time.monotonic() - start
            assert (resp.status_code >= 500 if any_5xx else
                    resp.status_code == 503 and "retry-after" in resp.headers), last
            assert not LEAKS.search(resp.text), resp.text
        except httpx.HTTPError as err:
            last = repr(err)
        time.sleep(1)
    pytest.fail(f"the server did not recover in {bound_s} s; last answer: {last}")


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
    from test_http_fuzz import (
        EXPLICIT,
        POST_PATHS,
        Findings,
        _dumps,
        response_problems,
    )

    base, model = served
    findings = Findings()
    with httpx.Client(base_url=base, headers=HEADERS, timeout=60) as client:
        for path in POST_PATHS:
            for body in EXPLICIT:
                raw = _dumps({"model": model, **body})
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
    _recovers(base, model, bound_s=30)


def _fuzz_positive(op, model: str, findings) -> None:
    """A few schema-valid cases of one operation through the real server (max_tokens and n
    kept small, the served model name)."""
    from hypothesis import given
    from schemathesis import GenerationMode
    from test_http_fuzz import _keep_cheap, fuzz_settings, response_problems

    @fuzz_settings(8)
    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case):
        _keep_cheap(case.body)
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
        env = _ray_process(base, title).environ()
        for key, value in SERVE_ENV.items():
            assert env.get(key) == value, (title, key, env.get(key))


def test_a_killed_worker_fails_its_requests_and_the_server_recovers(served):
    killed_worker_fails_its_requests_and_the_server_recovers(*served)


def killed_worker_fails_its_requests_and_the_server_recovers(base: str, model: str) -> None:
    """Kill a worker under three streams: each ends within 30 s with a 503 event or
    finished, at least one with the error; a plain request succeeds within 120 s."""
    streams = _start_streams(base, model)
    worker = _ray_process(base, "ray::_RankedWorker")
    killed = time.monotonic()
    worker.kill()
    ended = _wait_ended(streams, killed, bound_s=30)
    recovered = _recovers(base, model, bound_s=120)
    print(f"\nkilled worker: streams ended after {max(ended):.1f} s, "
          f"server answering again after {recovered:.1f} s")
    assert any(s.errors for s in streams)


def test_a_frozen_worker_is_treated_as_dead_and_the_server_recovers(served):
    base, model = served
    streams = _start_streams(base, model)
    worker = _ray_process(base, "ray::_RankedWorker")
    frozen = time.monotonic()
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        # worker_timeout_s, then Ray's kill of a process that cannot answer (~5 s)
        ended = _wait_ended(streams, frozen, bound_s=WORKER_TIMEOUT_S + 25)
        recovered = _recovers(base, model, bound_s=120)
    finally:
        if worker.is_running():
            os.kill(worker.pid, signal.SIGCONT)
    print(f"\nfrozen worker: streams ended after {max(ended):.1f} s, "
          f"server answering again after {recovered:.1f} s")
    assert all(s.errors for s in streams)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


def test_a_killed_engine_replica_fails_its_requests_and_serve_replaces_it(served):
    base, model = served
    streams = _start_streams(base, model)
    replica = _ray_process(base, "ray::ServeReplica:kvray:LLMServer")
    killed = time.monotonic()
    replica.kill()
    ended = _wait_ended(streams, killed, bound_s=30)
    recovered = _recovers(base, model, bound_s=180)
    print(f"\nkilled engine replica: streams ended after {max(ended):.1f} s, "
          f"server answering again after {recovered:.1f} s")
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 200


def _prefix_queries(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("kvray:prefix_cache_queries_total{")]
    return sum(values)


def test_metrics_survive_the_death_of_the_stats_actor(served):
    """The engine replicas' stats reach /metrics through a small named actor; killed, it is
    restarted (or looked up again) and the gauges move again, never frozen."""
    base, model = served
    _recovers(base, model, bound_s=60)
    time.sleep(1.5)  # a report period or two
    before = _prefix_queries(base)
    _ray_process(base, "ray::StatsBoard").kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _recovers(base, model, bound_s=60)  # a request: its prompt is looked up
        if _prefix_queries(base) > before:
            return
        time.sleep(1)
    pytest.fail("engine gauges on /metrics stayed frozen after the stats actor died")


def sigterm_drains_then_aborts(base: str, model: str,
                               server: psutil.Process) -> httpx.Response:
    """With a short and a long stream running, SIGTERM ``server``: new requests get 503 +
    Retry-After, the short one finishes, the long one ends with a 503 error event at the
    drain deadline, the process exits 0. Returns the first refusal."""
    short = Stream(base, model, max_tokens=40).start()
    long = Stream(base, model, max_tokens=LONG_TOKENS).start()
    assert short.first_chunk.wait(60) and long.first_chunk.wait(60)
    start = time.monotonic()
    server.send_signal(signal.SIGTERM)
    refused = None
    while time.monotonic() - start < 30:  # the drain starts within moments (more if busy)
        resp = httpx.post(f"{base}/v1/completions", headers=HEADERS, timeout=10, json={
            "model": model, "prompt": "Hello", "max_tokens": 2})
        if resp.status_code == 503:
            refused = resp
            break
        time.sleep(0.2)
    assert refused is not None and refused.headers.get("retry-after"), "still admitting"
    _wait_ended([short], start, bound_s=DRAIN_TIMEOUT_S)
    assert short.finish_reason == "length" and not short.errors
    _wait_ended([long], start, bound_s=DRAIN_TIMEOUT_S + 20)
    assert long.errors and long.errors[0]["code"] == 503, "the long request was not aborted"
    assert server.wait(timeout=60) == 0
    return refused


def test_sigterm_drains_then_aborts_and_leaves_no_process(served):
    """Last in this module: it stops the server. A short request finishes; a long one is
    ended with an error at the drain deadline; new requests get 503 + Retry-After; the
    process exits 0 and every process of its Ray cluster is gone."""
    base, model = served
    server = _server_process(base)
    family = server.children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in family)
    sigterm_drains_then_aborts(base, model, server)
    left = processes_left(family)
    assert not left, left


def processes_left(family: list[psutil.Process]) -> list[str]:
    """The command lines (cut) of the processes in ``family`` still alive a second later."""
    time.sleep(1)
    return [" ".join(p.cmdline())[:80] for p in family
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
