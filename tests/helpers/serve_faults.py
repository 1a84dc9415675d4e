"""Fault tests' tools for a running `kvray serve`: find its processes, stream completions on
threads, wait for the streams to end and the server to recover, drain it with SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from tests.helpers.server import API_KEY

WORKER_TIMEOUT_S = 5
DRAIN_TIMEOUT_S = 10
LONG_TOKENS = 30_000  # a request that outlasts the drain deadline (~10 ms a token at best)
CONTEXT = LONG_TOKENS + 64
FLAGS = ["--distributed-executor-backend", "ray", "--worker-timeout-s", str(WORKER_TIMEOUT_S),
         "--drain-timeout-s", str(DRAIN_TIMEOUT_S), "--enable-docs",
         # (after ENGINE_FLAGS: these win) room for the long request
         "--max-model-len", str(CONTEXT), "--num-gpu-blocks-override", "9000"]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LEAKS = re.compile(r"Traceback|File \"|pid=|actor_id|ActorID|\b\d{1,3}(\.\d{1,3}){3}\b|"
                   r"/tmp/|/work/|site-packages|\.py\b|ray::")


def server_process(base: str) -> psutil.Process:
    port = base.rsplit(":", 1)[1]
    servers = [p for p in psutil.process_iter(["cmdline"])
               if "serve" in (p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])]
    assert len(servers) == 1, f"expected one kvray serve on port {port}"
    return servers[0]


def ray_process(base: str, title: str) -> psutil.Process:
    """The one live process of the server at ``base`` whose title starts with ``title``
    (e.g. 'ray::_RankedWorker'): a descendant of that `kvray serve` (its Ray cluster)."""
    found = [p for p in server_process(base).children(recursive=True)
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
    # Lines carrying internal details (a traceback, a path, an address...). Kept apart from
    # ``failure``: a leak must fail the test even where a cut stream is the expected end.
    leaks: list[str] = field(default_factory=list)
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
                    if LEAKS.search(line):  # any line, an error page's included
                        self.leaks.append(line)
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        self.done = True
                        continue
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
        """Finished, or ended with one OpenAI error event; then [DONE] either way; and
        nothing internal reached the client."""
        if self.failure is not None or not self.done or self.leaks:
            return False
        if self.errors:
            err = self.errors[0]
            return err["code"] == 503 and err["type"] == "ServiceUnavailableError"
        return self.finish_reason == "length"


def start_streams(base: str, model: str, count: int = 3) -> list[Stream]:
    streams = [Stream(base, model).start() for _ in range(count)]
    for s in streams:
        assert s.first_chunk.wait(60), "no first chunk in 60 s"
        assert s.failure is None and not s.errors and not s.leaks, (s.failure, s.errors,
                                                                    s.leaks)
    return streams


def wait_ended(streams: list[Stream], since: float, bound_s: float) -> list[float]:
    deadline = since + bound_s
    while time.monotonic() < deadline and any(s.ended_at is None for s in streams):
        time.sleep(0.1)
    assert all(s.ended_at is not None for s in streams), f"a stream outlived {bound_s} s"
    for s in streams:
        assert s.ended_cleanly(), (s.failure, s.errors, s.done, s.finish_reason, s.leaks)
    return [s.ended_at - since for s in streams]


def recovers(base: str, model: str, bound_s: float, any_5xx: bool = False) -> float:
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


def killed_worker_fails_its_requests_and_the_server_recovers(base: str, model: str) -> None:
    """Kill a worker under three streams: each ends within 30 s with a 503 event or
    finished, at least one with the error; a plain request succeeds within 120 s."""
    streams = start_streams(base, model)
    worker = ray_process(base, "ray::_RankedWorker")
    killed = time.monotonic()
    worker.kill()
    ended = wait_ended(streams, killed, bound_s=30)
    recovered = recovers(base, model, bound_s=120)
    print(f"\nkilled worker: streams ended after {max(ended):.1f} s, "
          f"server answering again after {recovered:.1f} s")
    assert any(s.errors for s in streams)


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
    wait_ended([short], start, bound_s=DRAIN_TIMEOUT_S)
    assert short.finish_reason == "length" and not short.errors
    wait_ended([long], start, bound_s=DRAIN_TIMEOUT_S + 20)
    assert long.errors and long.errors[0]["code"] == 503, "the long request was not aborted"
    assert server.wait(timeout=60) == 0
    return refused


def processes_left(family: list[psutil.Process]) -> list[str]:
    """The command lines (cut) of the processes in ``family`` still alive a second later."""
    time.sleep(1)
    return [" ".join(p.cmdline())[:80] for p in family
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
