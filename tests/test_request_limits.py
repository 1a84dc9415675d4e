"""Every per-request limit of the HTTP API, at the boundary (accepted) and one past it
(400 naming the field), plus the inputs that are never valid (inf/NaN, lone surrogates,
non-text content parts, token ids outside the vocabulary), admission by sequences and the
per-request deadline. In process: the FastAPI app over a real engine and a tiny model."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from kvray.config import config_from_flat
from kvray.engine.async_engine import AsyncLLM
from kvray.serve.openai_app import OpenAIServer
from tests.helpers.tiny_models import VOCAB_SIZE

pytestmark = pytest.mark.serve

LIMITS = dict(max_request_bytes=4096, max_prompts_per_request=3, max_seqs_per_request=4,
              max_prompt_chars=50, max_messages=3, max_stop=2, max_stop_chars=8,
              max_stop_token_ids=2, max_logit_bias=2, max_logprobs=20)
ENGINE = dict(dtype="float32", block_size=4, max_model_len=256, num_gpu_blocks_override=256,
              scheduling_policy="priority")  # fcfs refuses any priority but 0


def _engine(model: str, **extra) -> AsyncLLM:
    return AsyncLLM(config_from_flat(dict(model=model, **ENGINE, **extra)))


@pytest.fixture(scope="module")
def client(tiny_async_llm):
    engine = tiny_async_llm(**ENGINE, **LIMITS)
    return TestClient(OpenAIServer(engine, "m", 256, limits=engine.config.server).app)


def _completion(**body):
    return {"model": "m", "prompt": "Hello", "max_tokens": 1, **body}


def _chat(**body):
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            **body}


def _assert_400(resp, param: str) -> None:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


# (endpoint, accepted body at the limit, rejected body past it, the field named)
BOUNDARIES = [
    ("/v1/completions", _completion(prompt=["a", "b", "c"]),
     _completion(prompt=["a", "b", "c", "d"]), "prompt"),
    ("/v1/completions", _completion(n=4), _completion(n=5), "n"),
    ("/v1/completions", _completion(n=2, prompt=["a", "b"]),
     _completion(n=3, prompt=["a", "b"]), "prompt"),
    ("/v1/completions", _completion(n=4), _completion(n=100000), "n"),
    ("/v1/completions", _completion(logprobs=20), _completion(logprobs=21), "logprobs"),
    ("/v1/chat/completions", _chat(logprobs=True, top_logprobs=20),
     _chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/completions", _completion(stop=["a", "b"]), _completion(stop=["a", "b", "c"]),
     "stop"),
    ("/v1/completions", _completion(stop="x" * 8), _completion(stop="x" * 9), "stop"),
    ("/v1/completions", _completion(stop_token_ids=[5, 6]),
     _completion(stop_token_ids=[5, 6, 7]), "stop_token_ids"),
    ("/v1/completions", _completion(stop_token_ids=[VOCAB_SIZE - 1]),
     _completion(stop_token_ids=[VOCAB_SIZE]), "stop_token_ids"),
    ("/v1/completions", _completion(stop_token_ids=[0]), _completion(stop_token_ids=[-1]),
     "stop_token_ids"),
    ("/v1/completions", _completion(logit_bias={"5": 1, "6": 2}),
     _completion(logit_bias={"5": 1, "6": 2, "7": 3}), "logit_bias"),
    ("/v1/completions", _completion(logit_bias={str(VOCAB_SIZE - 1): 100}),
     _completion(logit_bias={str(VOCAB_SIZE): 1}), "logit_bias"),
    ("/v1/completions", _completion(logit_bias={"5": -100}),
     _completion(logit_bias={"5": -100.5}), "logit_bias"),
    ("/v1/completions", _completion(logit_bias={"5": 1}), _completion(logit_bias={"x": 1}),
     "logit_bias"),
    ("/v1/completions", _completion(bad_words=["a", "b"]),
     _completion(bad_words=["a", "b", "c"]), "bad_words"),
    ("/v1/completions", _completion(bad_words=["x" * 8]), _completion(bad_words=["x" * 9]),
     "bad_words"),
    ("/v1/completions", _completion(prompt="y" * 50), _completion(prompt="y" * 51),
     "prompt"),
    ("/v1/completions", _completion(prompt=[VOCAB_SIZE - 1]),
     _completion(prompt=[VOCAB_SIZE]), "prompt"),
    ("/v1/completions", _completion(prompt=[[1, 2], [3]]), _completion(prompt=[[1], []]),
     "prompt"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "a"}] * 3),
     _chat(messages=[{"role": "user", "content": "a"}] * 4), "messages"),
    ("/v1/chat/completions",
     _chat(messages=[{"role": "system", "content": "s" * 25},
                     {"role": "user", "content": [{"type": "text", "text": "u" * 25}]}]),
     _chat(messages=[{"role": "system", "content": "s" * 25},
                     {"role": "user", "content": [{"type": "text", "text": "u" * 26}]}]),
     "messages"),
    ("/v1/completions", _completion(priority=2**31 - 1), _completion(priority=2**31),
     "priority"),
    ("/v1/completions", _completion(priority=-(2**31)), _completion(priority=-(2**31) - 1),
     "priority"),
    ("/v1/completions", _completion(prompt=[5], max_tokens=255),
     _completion(prompt=[5], max_tokens=256), "max_tokens"),
    ("/tokenize", {"model": "m", "prompt": "y" * 50}, {"model": "m", "prompt": "y" * 51},
     "prompt"),
    ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": "a"}] * 3},
     {"model": "m", "messages": [{"role": "user", "content": "a"}] * 4}, "messages"),
]


@pytest.mark.parametrize("path,ok,bad,param", BOUNDARIES,
                         ids=[f"{b[0]}:{b[3]}:{i}" for i, b in enumerate(BOUNDARIES)])
def test_limit_accepts_the_boundary_and_rejects_one_past_it(client, path, ok, bad, param):
    resp = client.post(path, json=ok)
    assert resp.status_code == 200, resp.text
    _assert_400(client.post(path, json=bad), param)


def test_request_body_size_limit_counts_bytes_with_and_without_content_length(client):
    base = json.dumps(_completion(user="")).encode()
    at_limit = json.dumps(_completion(user="u" * (4096 - len(base)))).encode()
    assert len(at_limit) == 4096
    resp = client.post("/v1/completions", content=at_limit,
                       headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    past = at_limit.replace(b'"user": "', b'"user": "u')
    resp = client.post("/v1/completions", content=past,
                       headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["param"] == "body"

    def chunks():  # no Content-Length: chunked transfer encoding
        yield past[:2000]
        yield past[2000:]

    resp = client.post("/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"})
    assert resp.status_code == 413


@pytest.mark.parametrize("raw,param", [
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"model": "m", "prompt": "x", "temperature": Infinity}', "temperature"),
    (b'{"model": "m", "prompt": "x", "top_p": -Infinity}', "top_p"),
    (b'{"model": "m", "prompt": "x", "presence_penalty": 1e999}', "presence_penalty"),
    (b'{"model": "m", "prompt": "x", "logit_bias": {"5": Infinity}}', "logit_bias.5"),
    (b'{"model": "m", "prompt": "x", "min_p": NaN}', "min_p"),
])
def test_inf_and_nan_are_never_numbers(client, raw, param):
    resp = client.post("/v1/completions", content=raw,
                       headers={"content-type": "application/json"})
    _assert_400(resp, param)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "m", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"model": "m", "prompt": ["ok", "\\udfff"]}', "prompt.1"),
    ("/v1/completions", '{"model": "m", "prompt": "x", "stop": ["\\ud83d"]}', "stop.0"),
    ("/v1/completions", '{"model": "m", "prompt": "x", "user": "\\ud800"}', "user"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/chat/completions",
     '{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages.0.content"),
    ("/v1/chat/completions",
     '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\ud800"}]}]}', "messages.0.content.0.text"),
    ("/tokenize", '{"model": "m", "prompt": "\\ud800"}', "prompt"),
])
def test_lone_surrogates_are_400s_naming_the_field(client, path, body, param):
    resp = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    _assert_400(resp, param)


def test_a_suffix_is_a_400_naming_it_not_silently_dropped(client):
    _assert_400(client.post("/v1/completions", json=_completion(suffix=" the end.")), "suffix")
    ok = client.post("/v1/completions", json=_completion(suffix=""))  # nothing to insert
    assert ok.status_code == 200, ok.text


def test_context_overflow_says_so_in_the_words_clients_match(client):
    """Regression: the message was kvray's own; clients (LiteLLM, agent frameworks) match
    vLLM's and OpenAI's "maximum context length" to trim a conversation. A prompt that
    leaves no room names the prompt (a chat's messages), else max_tokens."""
    for path, body, param in [
            ("/v1/completions", _completion(prompt=[5] * 300), "prompt"),
            ("/v1/chat/completions", _chat(max_tokens=300), "max_tokens"),
            ("/v1/completions", _completion(prompt=[5] * 100, max_tokens=200), "max_tokens")]:
        resp = client.post(path, json=body)
        _assert_400(resp, param)
        assert "maximum context length is 256 tokens" in resp.json()["error"]["message"]


def test_a_valid_surrogate_pair_is_accepted(client):
    body = '{"model": "m", "prompt": "smile \\ud83d\\ude42", "max_tokens": 1}'
    resp = client.post("/v1/completions", content=body.encode(),
                       headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("part,param", [
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, "messages.0.content.0.type"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
     "messages.0.content.0.type"),
    ({"text": "no type"}, "messages.0.content.0.type"),
    ({"type": "text", "text": 5}, "messages.0.content.0.text"),
    ({"type": "text"}, "messages.0.content.0.text"),
    ({"type": "refusal", "text": "no"}, "messages.0.content.0.refusal"),
    ({"type": "refusal", "refusal": "r" * 60}, "messages"),  # counted against the limit
    ({"type": ["text"], "text": "x"}, "messages.0.content.0.type"),
])
def test_non_text_content_parts_are_400s(client, part, param):
    body = _chat(messages=[{"role": "user", "content": [part]}])
    _assert_400(client.post("/v1/chat/completions", json=body), param)
    _assert_400(client.post("/tokenize", json={"model": "m", "messages": body["messages"]}),
                param)


def test_text_content_parts_are_joined_one_per_line(client):
    """vLLM's joining (regression: parts were concatenated); the Responses API's text
    parts and an assistant's refusal (sent back by the openai client) carry text too."""
    parts = [{"type": "text", "text": "Hello "}, {"type": "input_text", "text": "there"}]
    joined = client.post("/tokenize", json={"model": "m", "messages": [
        {"role": "user", "content": "Hello \nthere"}]}).json()["tokens"]
    got = client.post("/tokenize", json={"model": "m", "messages": [
        {"role": "user", "content": parts}]}).json()["tokens"]
    assert got == joined
    refused = [{"role": "user", "content": "Do it"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
               {"role": "user", "content": "Please"}]
    plain = [refused[0], {"role": "assistant", "content": "No."}, refused[2]]
    got, want = (client.post("/tokenize", json={"model": "m", "messages": m}).json()["tokens"]
                 for m in (refused, plain))
    assert got == want


def test_admission_counts_sequences_not_requests(tiny_model_dir):
    engine = _engine(str(tiny_model_dir("llama_gqa")), max_waiting=2)
    try:
        client = TestClient(OpenAIServer(engine, "m", 256, limits=engine.config.server).app)
        assert client.post("/v1/completions", json=_completion(n=2)).status_code == 200
        resp = client.post("/v1/completions", json=_completion(n=3))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert "max_waiting" in resp.json()["error"]["message"]
        assert engine.stats().num_waiting == 0 and engine.stats().num_running == 0
    finally:
        engine.shutdown()


def test_request_past_its_deadline_ends_with_an_error_and_frees_its_blocks(tiny_model_dir):
    engine = _engine(str(tiny_model_dir("llama_gqa")), request_timeout_s=0.05)
    try:
        client = TestClient(OpenAIServer(engine, "m", 256).app)
        body = _completion(max_tokens=250, ignore_eos=True, prompt="Once upon a time")
        resp = client.post("/v1/completions", json=body)
        assert resp.status_code == 408, resp.text
        assert "request_timeout_s" in resp.json()["error"]["message"]
        resp = client.post("/v1/completions", json={**body, "stream": True})
        events = [ln.removeprefix("data: ") for ln in resp.text.split("\n\n") if ln]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 408  # the stream ends with it
        kv = engine.engine.scheduler.kv
        for _ in range(100):
            if engine.stats().num_running == 0 and kv.pool.num_free == kv.num_blocks:
                break
            import time

            time.sleep(0.05)
        assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0
        assert kv.pool.num_free == kv.num_blocks
    finally:
        engine.shutdown()
