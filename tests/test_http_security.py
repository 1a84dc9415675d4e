"""Access and lifecycle of the HTTP API, in process over a real engine: which routes the API
key protects, API docs off by default, /health telling the engine's real state, drain
(503 + Retry-After) and aborting what is in flight."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from kvray.config import ServerConfig, config_from_flat
from kvray.engine.async_engine import AsyncLLM
from kvray.serve.openai_app import OpenAIServer

pytestmark = pytest.mark.serve

KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def engine(tiny_async_llm):
    return tiny_async_llm(max_model_len=256, num_gpu_blocks_override=128)


def _client(engine, **limits) -> TestClient:
    server = OpenAIServer(engine, "m", 256, api_key="s3cret", limits=ServerConfig(**limits))
    return TestClient(server.app)


def test_every_route_but_the_probes_needs_the_key(engine):
    client = _client(engine)
    for path in ("/health", "/version", "/metrics"):
        assert client.get(path).status_code == 200, path
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("GET", "/nonexistent"),
                         ("GET", "/docs"), ("GET", "/openapi.json")]:
        resp = client.request(method, path, json={})
        assert resp.status_code == 401, (path, resp.status_code)
        assert resp.json()["error"]["type"] == "AuthenticationError"
    assert client.get("/v1/models", headers=KEY).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cre"}
                      ).status_code == 401
    locked = _client(engine, metrics_require_key=True)
    assert locked.get("/metrics").status_code == 401
    assert locked.get("/metrics", headers=KEY).status_code == 200


def test_browsers_may_call_the_api_as_cors_allows(engine):
    """vLLM's CORS defaults (any origin, method, header): a browser's preflight (no API
    key, by the standard) is answered, and responses — a 401 included — carry the header;
    the key still guards the routes. ``allowed_origins: []`` turns CORS off."""
    client = _client(engine)
    origin = {"Origin": "http://localhost:3000"}
    preflight = client.options("/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] in ("*", origin["Origin"])
    models = client.get("/v1/models", headers={**KEY, **origin})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"
    refused = client.get("/v1/models", headers=origin)
    assert refused.status_code == 401 and "access-control-allow-origin" in refused.headers
    limited = _client(engine, allowed_origins='["https://app.example"]')
    other = limited.options("/v1/models", headers={**origin,
                                                    "Access-Control-Request-Method": "GET"})
    assert other.status_code == 400  # an origin not allowed: starlette's refusal
    off = _client(engine, allowed_origins=[])
    assert "access-control-allow-origin" not in off.get("/v1/models",
                                                        headers={**KEY, **origin}).headers
    assert ServerConfig(allowed_methods="GET, POST").allowed_methods == ["GET", "POST"]


def test_api_docs_are_off_by_default_and_behind_the_key_when_on(engine):
    client = _client(engine)
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert client.get(path, headers=KEY).status_code == 404, path
    docs = _client(engine, enable_docs=True)
    assert docs.get("/openapi.json").status_code == 401
    schema = docs.get("/openapi.json", headers=KEY)
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    assert docs.get("/docs", headers=KEY).status_code == 200


def test_draining_refuses_new_requests_and_reports_unhealthy(engine):
    server = OpenAIServer(engine, "m", 256)
    client = TestClient(server.app)
    body = {"model": "m", "prompt": "Hello", "max_tokens": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    server.begin_drain()
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 503 and resp.headers["retry-after"]
    assert client.get("/health").status_code == 503
    assert client.get("/v1/models").status_code == 200  # reads still answer


def test_abort_all_ends_streams_in_flight_with_an_error_and_frees_them(engine):
    server = OpenAIServer(engine, "m", 256)
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 250,
            "ignore_eos": True, "stream": True}

    async def main():
        transport = httpx.ASGITransport(app=server.app)  # returns the body once complete
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            before = engine.stats().generation_tokens_total
            request = asyncio.create_task(client.post("/v1/completions", json=body))
            while engine.stats().generation_tokens_total < before + 3:  # streaming now
                await asyncio.sleep(0.002)
            await server.abort_all()
            resp = await request
        return [ln.removeprefix("data: ") for ln in resp.text.split("\n\n") if ln]

    events = asyncio.run(main())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "shut down" in error["message"]
    sched = engine.engine.scheduler
    for _ in range(100):  # the abort reaches the engine thread between steps
        if not engine.engine.has_unfinished_requests():
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not engine.engine.has_unfinished_requests()
    assert sched.kv.pool.num_free == sched.kv.num_blocks


def test_health_is_503_once_the_engine_loop_is_gone(tiny_model_dir):
    engine = AsyncLLM(config_from_flat(dict(model=str(tiny_model_dir("llama_gqa")),
                                            dtype="float32", block_size=4, max_model_len=64,
                                            num_gpu_blocks_override=32)))
    client = TestClient(OpenAIServer(engine, "m", 64).app)
    assert client.get("/health").status_code == 200
    engine.shutdown()
    resp = client.get("/health")
    assert resp.status_code == 503 and resp.json()["error"]["message"]
