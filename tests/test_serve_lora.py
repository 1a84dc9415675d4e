"""LoRA adapters through ``kvray serve`` with the official ``openai`` client: adapters by
name, ``/v1/models`` with their parent, runtime load and unload under traffic (no request
lost or cut), the error cases (404 unknown adapter, 400 unfit adapter, 401 without the
key); and with two Serve replicas, requests for an adapter land on the replica that serves
it while a new adapter goes to the other, which takes it from the application's shared copy
instead of reading it again."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from kvray import LLM, LoRARequest, SamplingParams
from tests.helpers.lora import make_lora_adapter
from tests.helpers.server import API_KEY, launch_server, openai_client
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.serve

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"
TRAFFIC_TOKENS = 300  # long enough to be running while adapters come and go


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_lora")
    base = make_tiny_model("llama_gqa", root / "base")
    return {"base": base,
            "a": make_lora_adapter(base, root / "a", rank=8, seed=1),
            "b": make_lora_adapter(base, root / "b", rank=16, seed=2),
            "c": make_lora_adapter(base, root / "c", rank=8, seed=3, targets=["q_proj"]),
            "big": make_lora_adapter(base, root / "big", rank=64, seed=4)}


@pytest.fixture(scope="module")
def expected(models):
    """Offline greedy text of PROMPT per adapter (and the base model)."""
    llm = LLM(str(models["base"]), dtype="float32", block_size=4, enable_lora=True,
              max_loras=3, max_lora_rank=16)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    out = {"base": llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text}
    for i, name in enumerate(("a", "b", "c"), start=1):
        req = LoRARequest(name, i, str(models[name]))
        out[name] = llm.generate([PROMPT], params, use_tqdm=False,
                                 lora_request=req)[0].outputs[0].text
    llm.shutdown()
    assert len({out["base"], out["a"], out["b"]}) == 3  # the adapters change the text
    return out


def _flags(models, *extra):
    return ["--lora-modules", f"a={models['a']}", "--max-loras", "2", "--max-lora-rank",
            "16", "--enable-runtime-lora-updating", *extra]


def _complete(client, model: str, **kw) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                     temperature=0, **kw).choices[0].text


@pytest.fixture(scope="module", params=["process", "serve"])
def server(request, models):
    """The in-process front end (the engine's own registry) and Ray Serve's (the
    application's shared directory behind the ingress)."""
    with launch_server(models["base"], _flags(models, "--ingress", request.param)) as base:
        yield base


def test_models_lists_adapters_with_their_base(server, models):
    data = openai_client(server).models.list().data
    assert [(m.id, getattr(m, "parent", None)) for m in data] == [
        ("base", None), ("a", "base")]


def test_requests_choose_an_adapter_by_model(server, expected):
    client = openai_client(server)
    assert _complete(client, "base") == expected["base"]
    assert _complete(client, "a") == expected["a"]
    resp = client.completions.create(model="a", prompt=PROMPT, max_tokens=4)
    assert resp.model == "a"
    chat = client.chat.completions.create(model="a", max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "a" and chat.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="a", prompt=PROMPT, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert text == expected["a"]


def test_unknown_and_unfit_adapters_are_refused(server, models):
    client = openai_client(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _complete(client, "nope")
    load = f"{server}/v1/load_lora_adapter"
    r = httpx.post(load, json={"lora_name": "big", "lora_path": str(models["big"])},
                   headers=HEADERS)
    assert r.status_code == 400 and "max_lora_rank" in r.json()["error"]["message"]
    r = httpx.post(load, json={"lora_name": "x", "lora_path": str(models["base"])},
                   headers=HEADERS)
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
    r = httpx.post(load, json={"lora_name": "a", "lora_path": str(models["b"])},
                   headers=HEADERS)
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    assert httpx.post(load, json={"lora_name": "x"}, headers=HEADERS).status_code == 400
    r = httpx.post(load, json={"lora_name": "b", "lora_path": str(models["b"])})
    assert r.status_code == 401
    r = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "nope"},
                   headers=HEADERS)
    assert r.status_code == 404
    assert _complete(client, "a")  # still serving


def test_runtime_load_and_unload_under_traffic(server, models, expected):
    """Streams of adapter a and b run while c is loaded and b unloaded: every stream ends
    with all its tokens; afterwards c serves and b is gone (404)."""
    client = openai_client(server)
    load, unload = f"{server}/v1/load_lora_adapter", f"{server}/v1/unload_lora_adapter"
    r = httpx.post(load, json={"lora_name": "b", "lora_path": str(models["b"])},
                   headers=HEADERS)
    assert r.status_code == 200, r.text
    assert _complete(client, "b") == expected["b"]

    async def traffic() -> list[tuple[str, str, int]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY)

        async def one(model: str) -> tuple[str, str, int, float]:
            stream = await aclient.completions.create(
                model=model, prompt=PROMPT, max_tokens=TRAFFIC_TOKENS, temperature=0,
                stream=True, stream_options={"include_usage": True})
            text, usage = "", 0
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return model, text, usage, time.monotonic()

        async def admin() -> float:
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(headers=HEADERS) as http:
                r1 = await http.post(load, json={"lora_name": "c",
                                                 "lora_path": str(models["c"])})
                r2 = await http.post(unload, json={"lora_name": "b"})
            assert r1.status_code == 200 and r2.status_code == 200
            return time.monotonic()

        *streams, unloaded = await asyncio.gather(*(one(m) for m in ["a", "b"] * 4), admin())
        await aclient.close()
        return streams, unloaded

    streams, unloaded = asyncio.run(traffic())
    assert any(m == "b" and end > unloaded for m, _, _, end in streams), \
        "no stream of b was still running when b was unloaded"
    for model, text, tokens, _ in streams:
        assert tokens == TRAFFIC_TOKENS, f"a stream of {model} was cut"
        assert text.startswith(expected[model])
    assert _complete(client, "c") == expected["c"]
    with pytest.raises(openai.NotFoundError):
        _complete(client, "b")
    names = [m.id for m in client.models.list().data]
    assert names == ["base", "a", "c"]
    for _ in range(20):  # Serve: replicas sync with the directory, the board every 0.5 s
        metrics = httpx.get(f"{server}/metrics").text
        if re.search(r"kvray:lora_adapters_registered\{.*\} 2\.0", metrics):
            break
        time.sleep(0.5)
    assert re.search(r'kvray:lora_requests_total\{.*lora_name="a".*\} [1-9]', metrics)
    assert re.search(r"kvray:lora_adapters_registered\{.*\} 2\.0", metrics), metrics


def _per_replica(metrics: str, name: str, label: str = "") -> dict[str, float]:
    out = {}
    for m in re.finditer(rf'{name}\{{([^}}]*)\}} ([0-9.e+]+)', metrics):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if not label or labels.get("lora_name") == label:
            out[labels["replica"]] = float(m.group(2))
    return out


def test_two_replicas_route_by_adapter_and_share_one_copy(models, expected):
    """Requests for adapter a all run on one replica; adapter b, loaded at run time, goes
    to the other one (it serves fewer adapters), which takes b from the application's
    shared copy: no replica reads an adapter's files."""
    with launch_server(models["base"], _flags(models, "--num-replicas", "2")) as base:
        client = openai_client(server := base)
        # after each adapter's first request, time for the replica's note that it serves
        # the adapter to reach the routers (Serve pushes it through its controller)
        assert _complete(client, "a") == expected["a"]
        time.sleep(3)
        for _ in range(3):
            assert _complete(client, "a") == expected["a"]
        r = httpx.post(f"{server}/v1/load_lora_adapter", headers=HEADERS,
                       json={"lora_name": "b", "lora_path": str(models["b"])})
        assert r.status_code == 200, r.text
        assert _complete(client, "b") == expected["b"]
        time.sleep(3)
        for _ in range(3):
            assert _complete(client, "b") == expected["b"]
        metrics = ""
        for _ in range(40):  # the stats board refreshes every 0.5 s
            metrics = httpx.get(f"{server}/metrics").text
            a = _per_replica(metrics, "kvray:lora_requests_total", "a")
            b = _per_replica(metrics, "kvray:lora_requests_total", "b")
            if sum(a.values()) == 4 and sum(b.values()) == 4:
                break
            time.sleep(0.5)
        a = {k: v for k, v in _per_replica(metrics, "kvray:lora_requests_total", "a").items()
             if v}
        b = {k: v for k, v in _per_replica(metrics, "kvray:lora_requests_total", "b").items()
             if v}
        assert list(a.values()) == [4.0], a  # one replica took every request for a
        assert list(b.values()) == [4.0], b
        assert set(a) != set(b), "b should go to the replica that did not serve a"
        loads = _per_replica(metrics, "kvray:lora_loads_total")
        fetches = _per_replica(metrics, "kvray:lora_fetches_total")
        assert sum(loads.values()) == 0  # no replica read adapter files
        assert sum(fetches.values()) == 2
