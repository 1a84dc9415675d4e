"""Faults under `kvray serve --ingress replica` (the OpenAI app inside the model replica,
Ray Serve's proxy in front): a killed worker ends the streams with an error event and the
server recovers; a killed replica process cuts its streams (nothing outlives it to write
an error event: the price of the hop saved), Serve replaces it and the next request
succeeds; SIGTERM drains like the other front ends. The API itself is tested against this
front end in test_serve.py."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.helpers.serve_faults import (
    CONTEXT,
    FLAGS,
    HEADERS,
    killed_worker_fails_its_requests_and_the_server_recovers,
    processes_left,
    ray_process,
    recovers,
    server_process,
    sigterm_drains_then_aborts,
    start_streams,
)
from tests.helpers.server import launch_server
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = make_tiny_model("llama_gqa", tmp_path_factory.mktemp("replica") / "tiny-llama",
                            max_position_embeddings=CONTEXT)
    with launch_server(model, [*FLAGS, "--ingress", "replica"]) as base:
        yield base, model.name


def test_the_replica_serves_http_itself_with_no_separate_ingress(served):
    base, model = served
    server = server_process(base)
    titles = [" ".join(p.cmdline()) for p in server.children(recursive=True)]
    assert not [t for t in titles if "OpenAIIngress" in t], titles
    ray_process(base, "ray::ServeReplica:kvray:LLMServer")  # exactly one
    resp = httpx.post(f"{base}/v1/completions", headers=HEADERS, timeout=60, json={
        "model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert "kvray:num_requests_running" in metrics


def test_a_killed_worker_ends_the_streams_with_an_error_and_the_server_recovers(served):
    killed_worker_fails_its_requests_and_the_server_recovers(*served)


def test_a_killed_replica_cuts_its_streams_and_serve_replaces_it(served):
    base, model = served
    streams = start_streams(base, model)
    replica = ray_process(base, "ray::ServeReplica:kvray:LLMServer")
    killed = time.monotonic()
    replica.kill()
    deadline = killed + 30
    while time.monotonic() < deadline and any(s.ended_at is None for s in streams):
        time.sleep(0.1)
    assert all(s.ended_at is not None for s in streams), "a stream outlived 30 s"
    # Nothing internal reached the client, cut stream or not.
    assert not any(s.leaks for s in streams), [s.leaks for s in streams]
    # Cut (no [DONE]) or, had the replica's loop answered first, a 503 error event: never a
    # stream that claims to have finished, nor an internal error.
    assert all(s.failure is not None or s.errors for s in streams), [
        (s.failure, s.errors, s.done, s.finish_reason) for s in streams]
    assert all(e["code"] == 503 and e["type"] == "ServiceUnavailableError"
               for s in streams for e in s.errors), [s.errors for s in streams]
    recovered = recovers(base, model, bound_s=180, any_5xx=True)
    print(f"\nkilled replica: server answering again after {recovered:.1f} s")
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    successor = ray_process(base, "ray::ServeReplica:kvray:LLMServer")
    assert successor.pid != replica.pid


def test_sigterm_drains_then_aborts_and_leaves_no_process(served):
    """Last: it stops the server (see test_serve_faults)."""
    base, model = served
    server = server_process(base)
    family = server.children(recursive=True)
    sigterm_drains_then_aborts(base, model, server)
    left = processes_left(family)
    assert not left, left
