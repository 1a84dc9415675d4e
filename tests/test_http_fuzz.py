"""Fuzz the OpenAI HTTP API in process (ASGI, a real tiny engine).

1. schemathesis over the app's own OpenAPI schema (positive and negative data);
2. hypothesis JSON bodies, hostile values mixed into valid requests, sent as raw bytes (NaN /
   Infinity / 1e999 literals, lone surrogates, broken UTF-8, non-objects) and with ``json=``;
3. afterwards the server still answers a plain request and the engine is idle, every KV block
   free.

Every response must be below 500, leak nothing of the server's insides (tracebacks, paths,
pids, addresses, actor ids), and every error must be OpenAI's error JSON. The fuzz tests
collect every distinct failure (deduplicated, smallest request kept) and fail once at the end
with the whole list.
"""

from __future__ import annotations

import inspect
import json
import time
import warnings
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import example, given
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import Failure

from kvray.serve.openai_app import OpenAIServer
from tests.helpers.hostile_requests import (
    CONTENT_PARTS,
    EXPLICIT,
    POST_PATHS,
    Raw,
    dumps,
    fuzz_settings,
    keep_cheap,
)
from tests.helpers.http_checks import Findings, response_problems

pytestmark = pytest.mark.serve

MODEL = "m"
MAX_LEN = 256


@pytest.fixture(scope="module")
def server(tiny_async_llm):
    engine = tiny_async_llm(max_model_len=MAX_LEN, num_gpu_blocks_override=256)
    kwargs = ({"enable_docs": True}
              if "enable_docs" in inspect.signature(OpenAIServer).parameters else {})
    return OpenAIServer(engine, MODEL, MAX_LEN, **kwargs)


class LikeUvicorn:
    """The app as an ASGI server runs it: an exception escaping it (Starlette re-raises one
    even after its handler sent the response) is logged, and becomes a bare 500 only when no
    response started. ``escaped`` keeps them (path, exception) for the report."""

    def __init__(self, app) -> None:
        self.app, self.escaped = app, []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:
            self.escaped.append((scope["path"], err))
            if not started:
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": b"Internal Server Error"})


@pytest.fixture(scope="module")
def app(server):
    wrapped = LikeUvicorn(server.app)
    yield wrapped
    if wrapped.escaped:  # not a client-visible failure, but each is a logged traceback
        kinds = sorted({f"{path}: {type(e).__name__}: {str(e)[:100]}"
                        for path, e in wrapped.escaped})
        warnings.warn(f"{len(wrapped.escaped)} exception(s) escaped the app after its "
                      f"response ({len(kinds)} kinds):\n" + "\n".join(kinds[:20]),
                      stacklevel=1)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


# ---- the response checks (tests.helpers.http_checks) --------------------------------------
def test_the_checker_catches_leaks_and_bad_errors():
    """The response checks themselves: they flag what they should, and not legitimate ids or
    the client's own input echoed back."""
    def problems(status, payload, body=None):
        content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return response_problems(status, "application/json", content, body, b"")

    def err(message, code=400):
        return {"error": {"message": message, "type": "BadRequestError", "param": None,
                          "code": code}}

    assert problems(400, err("bad")) == []
    assert problems(200, {"id": "cmpl-" + "ab12" * 8, "choices": [{"text": "10.0.0.1"}]}) == []
    assert problems(400, err("model '/tmp/x' does not exist"), {"model": "/tmp/x"}) == []
    for leak in ['Traceback (most recent call last)', 'File "/x/y.py", line 3', "pid=123",
                 "worker at 10.1.2.3 died", "/usr/lib/python3", "ActorID(" + "ab" * 16 + ")",
                 "object at 0x7f25d92e9590", "task " + "deadbeef" * 5]:
        assert problems(400, err(leak)), leak
    assert problems(500, err("x", 500)) and problems(400, {"detail": "x"})
    assert problems(404, err("x", 400))
    assert problems(400, {"error": {"message": "x", "type": "t", "param": None, "code": "400"}})
    assert problems(400, b"Internal Server Error")
    stream = b'data: {"error": {"message": "x", "type": "t", "param": null, "code": 500}}\n\n'
    assert response_problems(200, "text/event-stream", stream + b"data: [DONE]\n\n", None, b"")
    assert response_problems(200, "text/event-stream", b'data: {"id": 1}\n\n', None, b"")
    assert not response_problems(200, "text/event-stream", b"data: [DONE]\n\n", None, b"")


def _excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", "backslashreplace")
    return text if len(text) <= 300 else f"{text[:240]}...<{len(text)} bytes>"


# ---- 1. schemathesis over the app's own schema --------------------------------------------
# Built-in checks: not_a_server_error only. Left out, as they flag legitimate behaviour:
# status_code_conformance (every 400/404/413 is undocumented: FastAPI documents 200/422),
# content_type_conformance and response_schema_conformance (GET /health is an empty 200
# without a content type, documented as JSON; a streamed 200 is text/event-stream; the 200
# schemas are empty, so nothing else is checked), positive_data_acceptance (schema-valid
# requests get legitimate 400s: over the context, unknown model, out-of-vocab ids) and
# negative_data_rejection (pydantic's lax parsing accepts "1" and 2.0 for an int).
SCHEMATHESIS_CHECKS = [not_a_server_error]


def _fuzz_operation(op, mode: GenerationMode, count: int, findings: Findings) -> None:
    label = f"{op.method.upper()} {op.path}"

    @fuzz_settings(count)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        keep_cheap(case.body)
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and isinstance(
                case.body.get("model"), str):
            case.body["model"] = MODEL  # else most valid requests stop at the 404
        resp = case.call()
        sent = resp.request.body or b""
        sent = sent.encode() if isinstance(sent, str) else sent
        body = case.body if isinstance(case.body, dict | list) else None
        ctype = {k.lower(): v for k, v in resp.headers.items()}.get("content-type", [""])
        problems = response_problems(resp.status_code, ctype[0], resp.content, body, sent,
                                     cut_short=resp.stream_cut_short)
        try:
            case.validate_response(resp, checks=SCHEMATHESIS_CHECKS)
        except (Failure, BaseExceptionGroup) as err:
            members = getattr(err, "exceptions", [err])
            problems += [f"schemathesis {type(e).__name__}: {str(e)[:120]}" for e in members]
        if problems:
            findings.add(label, resp.status_code, problems, _excerpt(sent),
                         resp.content.decode("utf-8", "replace"))

    run()


def test_schemathesis_openapi(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    ops = [r.ok() for r in schema.get_all_operations()]
    labels = {f"{op.method.upper()} {op.path}" for op in ops}
    assert {f"POST {p}" for p in POST_PATHS} <= labels, labels
    findings = Findings()
    for op in ops:  # 30 examples per operation: 20 schema-valid, 10 invalid where it has a body
        _fuzz_operation(op, GenerationMode.POSITIVE, 20 if op.body else 30, findings)
        if op.body:
            _fuzz_operation(op, GenerationMode.NEGATIVE, 10, findings)
    assert not findings.by_key, findings.report()


# ---- 2. hypothesis bodies -----------------------------------------------------------------
RAW_LITERALS = [Raw(x) for x in ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E400",
                                 "-0", "1e-400", "0.0000000000000000000000000000001")]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12)

HOSTILE_SCALARS = [None, True, False, 0, -1, 1, 2, 10**30, -(10**30), 2**63, 2**64, 2**31,
                   -(2**63) - 1, 1e308, -1e308, 0.5, -0.5, 1.5, "", "x", "5", "1e999", "NaN",
                   "\ud800", "\udfff", "a\x00b", "\u202e\u0301", "🙂" * 10, "x" * 5000,
                   [], {}, [[]], [None], {"a": {"b": [1]}}, *RAW_LITERALS]
hostile = st.sampled_from(HOSTILE_SCALARS) | json_values | st.text(max_size=30)
hostile_str = st.sampled_from(["", "\ud800", "a\ud800b", "\udfff\ud800", "\x00", "x" * 100_000,
                               "m", "M", "m\x00", 5, None, ["m"], {"m": 1}]) | st.text(
    max_size=20)
int_lists = st.lists(st.sampled_from([-1, 0, 1, 5, 31999, 32000, 10**6, 2**31, 2**63, 10**30,
                                      1.5, "1", None, True, [1]]), max_size=6)

message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                           "content": hostile_str | st.sampled_from(CONTENT_PARTS)}),
    st.sampled_from([{"content": "hi"}, {"role": 1, "content": "x"},
                     {"role": None, "content": "x"}, {"role": ["user"], "content": "x"},
                     {"role": "\ud800", "content": "x"}, {"role": "", "content": "x"},
                     {"role": "user", "content": {"a": 1}}, {"role": "user"},
                     {"role": "user", "content": None}, {"role": "robot", "content": "x"},
                     {"role": "user", "content": "x", "name": "\ud800", "tool_calls": [1]},
                     "user", None, 5, []]),
    json_values)
messages = st.lists(message, max_size=4) | st.sampled_from(
    [[], [{"role": "user", "content": "hi"}] * 2000, "hi", None, {"role": "user"}])

stop = st.sampled_from(["\ud800", "", [""], [None], [1], ["x"] * 10_000, "x" * 100_000,
                        ["a", "\ud800"], ["e"] * 17, ["x" * 257], [[]], {"a": 1}]) | hostile
logit_bias = st.sampled_from([{"abc": 1}, {"1": 1e30}, {"-1": 5}, {"99999999999999999999": 1},
                              {"1": "x"}, {"1": Raw("NaN")}, {"1": Raw("Infinity")},
                              {"1.5": 1}, {"": 1}, {"\ud800": 1}, {"1": None}, {"1": [1]},
                              {str(i): 1 for i in range(2000)}, {"0x10": 1}, {" 1": 1},
                              {"1_0": 1}, {"٣": 1}, [1], "x"]) | st.dictionaries(
    st.text(max_size=5), hostile, max_size=3)

SAMPLING_FIELDS = {
    "model": hostile_str, "user": hostile_str, "stop": stop, "logit_bias": logit_bias,
    "n": st.sampled_from([0, -1, 2, 3, 257, 100_000, 10**30, "2", 2.0, 2.5, True, None,
                          Raw("NaN")]),
    "max_tokens": st.sampled_from([0, -1, 1, 255, 256, 2**63, 10**30, "5", 5.5, True, None,
                                   *RAW_LITERALS]),
    "temperature": hostile, "top_p": hostile, "top_k": hostile, "min_p": hostile,
    "repetition_penalty": hostile, "presence_penalty": hostile, "frequency_penalty": hostile,
    "seed": st.sampled_from([-1, 0, 2**63 - 1, 2**63, 2**64, 10**30, 1.5, "1"]) | hostile,
    "min_tokens": st.sampled_from([-1, 1, 300, 10**30]) | hostile,
    "stop_token_ids": int_lists | st.sampled_from([[1] * 10_000, [-1], "1", 1]) | hostile,
    "priority": st.sampled_from([10**30, -(10**30), 2**63, Raw("NaN")]) | hostile,
    "stream": st.sampled_from([True, "true", "yes", 1, 2, None]) | hostile,
    "stream_options": st.sampled_from([{"include_usage": True}, {"include_usage": "maybe"},
                                       "x", [], {"x": 1}]) | hostile,
    "ignore_eos": hostile, "skip_special_tokens": hostile,
    "include_stop_str_in_output": hostile, "response_format": json_values,
}
ENDPOINT_FIELDS: dict[str, dict[str, st.SearchStrategy]] = {
    "/v1/completions": {
        **SAMPLING_FIELDS,
        "prompt": hostile_str | int_lists | st.lists(int_lists, max_size=3) | st.sampled_from(
            [[], [[]], [""], ["a", "\ud800"], ["hi"] * 300, [[1, 2], "x"], [[1, 2]] * 257,
             {"p": 1}]),
        "logprobs": st.sampled_from([-1, 0, 5, 6, 21, 10**30, True]) | hostile,
        "echo": hostile, "suffix": hostile_str,
    },
    "/v1/chat/completions": {
        **SAMPLING_FIELDS, "messages": messages,
        "logprobs": hostile, "top_logprobs": st.sampled_from([-1, 0, 20, 21, 10**30]) | hostile,
        "max_completion_tokens": st.sampled_from([0, -1, 2, 10**30, None]) | hostile,
        "add_generation_prompt": hostile, "tools": json_values, "tool_choice": json_values,
    },
    "/v1/responses": {
        "model": hostile_str, "temperature": SAMPLING_FIELDS["temperature"],
        "top_p": SAMPLING_FIELDS["top_p"], "stream": SAMPLING_FIELDS["stream"],
        "input": hostile_str | messages | st.lists(json_values, max_size=3) | st.sampled_from(
            [[], [{"type": "function_call", "call_id": 1}], [{"type": "reasoning"}],
             [{"type": "function_call_output", "call_id": "c", "output": [{"x": 1}]}],
             [{"role": "developer", "content": [{"type": "input_text", "text": 5}]}]]),
        "instructions": hostile_str, "max_output_tokens": st.sampled_from(
            [0, -1, 2, 10**30, None]) | hostile, "tools": json_values,
        "tool_choice": json_values, "text": json_values | st.sampled_from(
            [{"format": {"type": "json_schema", "schema": 1}}, {"format": "x"},
             {"format": {"type": "json_schema", "schema": {"type": "nope"}}}]),
        "previous_response_id": hostile_str, "background": hostile, "metadata": json_values,
    },
    "/v1/embeddings": {
        "model": hostile_str, "priority": SAMPLING_FIELDS["priority"],
        "input": hostile_str | int_lists | st.lists(int_lists, max_size=3) | st.lists(
            hostile_str, max_size=3), "encoding_format": hostile_str,
        "dimensions": st.sampled_from([0, -1, 1, 10**30, "8", 2.5]) | hostile,
        "normalize": hostile, "user": hostile_str,
    },
    "/rerank": {"model": hostile_str, "query": hostile_str,
                "documents": st.lists(hostile_str | json_values, max_size=4) | hostile,
                "top_n": st.sampled_from([0, -1, 1, 10**30, "1"]) | hostile,
                "return_documents": hostile},
    "/score": {"model": hostile_str, "text_1": hostile_str | st.lists(hostile_str, max_size=3),
               "text_2": hostile_str | st.lists(hostile_str, max_size=3)},
    "/tokenize": {"model": hostile_str, "prompt": hostile_str, "messages": messages,
                  "add_special_tokens": hostile, "add_generation_prompt": hostile},
    "/detokenize": {"model": hostile_str,
                    "tokens": int_lists | st.sampled_from([[0] * 100_000, [], "1", None,
                                                           [[1]], {"0": 1}]) | hostile},
}
VALID = {
    "/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
    "/v1/embeddings": {"model": MODEL, "input": ["Hello", "world"]},
    "/rerank": {"model": MODEL, "query": "Hello", "documents": ["a", "b"]},
    "/score": {"model": MODEL, "text_1": "Hello", "text_2": ["a", "b"]},
    "/tokenize": {"model": MODEL, "prompt": "Hello"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
}


def _cheap(body: dict) -> dict:
    """Bound the generation work of a request the server might accept: sequences x tokens."""
    n = body.get("n", 1)
    n = n if isinstance(n, int) and 0 < n <= 256 else 1
    prompt = body.get("prompt")
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(
        prompt[0], int) else 1
    tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    tokens = tokens if isinstance(tokens, int) and tokens > 0 else MAX_LEN
    if n * num_prompts * min(tokens, MAX_LEN) > 1024:
        body["max_tokens"] = 2
        body.pop("max_completion_tokens", None)
    return body


@st.composite
def hostile_body(draw, path: str) -> dict:
    """A valid request with one to four fields replaced by hostile values; now and then one
    of its own fields dropped, or unknown fields added."""
    fields = ENDPOINT_FIELDS[path]
    body = dict(VALID[path])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4,
                              unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 7)) == 0:
        body.pop(draw(st.sampled_from(sorted(VALID[path]))), None)
    if draw(st.integers(0, 9)) == 0:
        body.update(draw(st.dictionaries(st.text(max_size=10), hostile, max_size=3)))
    return _cheap(body)


def _mangle(raw: bytes, how: str, where: int) -> bytes:
    cut = where % (len(raw) + 1)
    return {
        "as is": raw,
        "truncated": raw[:cut],
        "bad utf-8": raw[:cut] + b"\xff\xfe\xc0\x80" + raw[cut:],
        "bom": b"\xef\xbb\xbf" + raw,
        "duplicate key": raw[:-1] + b',"model":5,"model":"m"}' if raw.endswith(b"}") else raw,
        "nested": b'{"prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "not an object": raw.join([b"[", b"]"]),
        "trailing garbage": raw + b" }{ garbage",
    }[how]


request_bodies = st.one_of(
    # json=: only what httpx can encode (no NaN, no lone surrogates, no Raw)
    st.tuples(st.just("json"), st.none(), st.none(), st.just("")),
    st.tuples(st.just("raw"), st.sampled_from(["as is"] * 12 + ["truncated", "bad utf-8",
                                                               "bom", "duplicate key",
                                                               "nested", "not an object",
                                                               "trailing garbage"]),
              st.integers(0, 10**6),
              st.sampled_from(["application/json"] * 8
                              + ["text/plain", "", "application/json; charset=latin-1"])))


def _post(client, path: str, body: Any, mode: tuple) -> tuple[Any, bytes]:
    kind, how, where, ctype = mode
    if kind == "json":
        try:
            encoded = json.dumps(body, allow_nan=False, ensure_ascii=False).encode()
        except (TypeError, ValueError, UnicodeEncodeError):
            kind, how, where, ctype = "raw", "as is", 0, "application/json"
        else:
            return client.post(path, json=body), encoded
    raw = _mangle(dumps(body), how, where)
    headers = {"content-type": ctype} if ctype else {}
    return client.post(path, content=raw, headers=headers), raw


def _check(findings: Findings, path: str, resp, body: Any, raw: bytes) -> None:
    problems = response_problems(resp.status_code, resp.headers.get("content-type", ""),
                                 resp.content, body, raw)
    if problems:
        findings.add(path, resp.status_code, problems, _excerpt(raw), resp.text)


@pytest.mark.parametrize("path", POST_PATHS)
def test_hostile_json_bodies(client, path):
    findings = Findings()

    @fuzz_settings(150)
    @given(body=st.integers(0, 7).flatmap(lambda k: json_values if k == 0 else hostile_body(path)),
           mode=request_bodies)
    @example(body=None, mode=("raw", "as is", 0, "application/json"))
    @example(body=b"", mode=("raw", "as is", 0, "application/json"))
    @example(body={}, mode=("raw", "nested", 0, "application/json"))
    @example(body={"prompt": "x" * (9 << 20)}, mode=("raw", "as is", 0, "application/json"))
    def run(body, mode):
        if body == b"":  # no body at all
            resp = client.post(path, headers={"content-type": "application/json"})
            _check(findings, path, resp, None, b"")
            return
        resp, raw = _post(client, path, body, mode)
        _check(findings, path, resp, body, raw)

    for body in EXPLICIT:  # every brief case against every endpoint, as raw text
        full = {"model": MODEL, **body}
        resp, raw = _post(client, path, full, ("raw", "as is", 0, "application/json"))
        _check(findings, path, resp, full, raw)
    run()
    assert not findings.by_key, findings.report()


# ---- 3. the server is fine afterwards -----------------------------------------------------
def test_server_still_serves_and_engine_is_idle(client, server):
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello",
                                                 "max_tokens": 5, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"]
    engine = server.client
    kv = engine.engine.scheduler.kv
    deadline = time.monotonic() + 10
    while True:
        stats = engine.stats()
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if (idle and kv.pool.num_free == kv.num_blocks) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert not engine.engine.has_unfinished_requests()
    assert kv.pool.num_free == kv.num_blocks, f"{kv.num_blocks - kv.pool.num_free} blocks held"
    assert not kv.req_blocks
