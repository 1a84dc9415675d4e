"""`kvray serve` on a real local Ray cluster (loopback), exercised with the official `openai`
client and raw HTTP: completions, chat and responses, streaming, n, logprobs, stops, seeds, usage,
concurrency, client disconnects, metrics and every error case — through both front ends
(Ray Serve's, ``--ingress replica`` and ``--ingress process``)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from kvray import LLM, PoolingParams, SamplingParams
from tests.helpers.server import API_KEY, launch_server, openai_client
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("llama_gqa", tmp_path_factory.mktemp("serve") / "tiny-llama")


@pytest.fixture(scope="module", params=["serve", "replica", "process"])
def server(request, model_dir):
    """The server, once per front end: Ray Serve's (proxy -> ingress -> engine replica),
    ``--ingress replica`` (proxy -> the engine replica serving the app itself) and
    ``--ingress process`` (the OpenAI app and the engine in one process): every test of
    the API below holds for all three."""
    with launch_server(model_dir, ["--ingress", request.param]) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model_name(model_dir):
    return model_dir.name


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]


def test_greedy_completion_equals_offline_llm(client, model_name, model_dir):
    prompts = ["Hello world", "The capital of France is"]
    got = [client.completions.create(model=model_name, prompt=p, max_tokens=12, temperature=0)
           for p in prompts]
    llm = LLM(str(model_dir), dtype="float32", block_size=4, max_model_len=256)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.choices[0].text == w.outputs[0].text
        assert g.choices[0].finish_reason == w.outputs[0].finish_reason
        assert g.usage.prompt_tokens == len(w.prompt_token_ids)
        assert g.usage.completion_tokens == len(w.outputs[0].token_ids)
        assert g.usage.total_tokens == g.usage.prompt_tokens + g.usage.completion_tokens
    llm.shutdown()


def test_streaming_completion_concatenates_to_the_full_text(client, model_name):
    full = client.completions.create(model=model_name, prompt="Once upon a time",
                                     max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=model_name, prompt="Once upon a time",
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_and_not(client, model_name):
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10,
                                           temperature=0)
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=model_name, messages=messages,
                                            max_tokens=10, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == whole.choices[0].message.content


def test_n_logprobs_and_seed(client, model_name):
    out = client.completions.create(model=model_name, prompt="Hello", max_tokens=6, n=2,
                                    temperature=1.0, seed=11, logprobs=3)
    assert sorted(c.index for c in out.choices) == [0, 1]
    echoed = client.completions.create(model=model_name, prompt="Hello", max_tokens=3,
                                       echo=True, logprobs=1, temperature=0).choices[0]
    assert echoed.text.startswith("Hello")
    # the echoed prompt's tokens come first, the first one without a logprob (OpenAI's shape)
    assert "".join(echoed.logprobs.tokens) == echoed.text
    assert echoed.logprobs.text_offset[0] == 0 and echoed.logprobs.token_logprobs[0] is None
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 6 and len(lp.top_logprobs[0]) >= 3
    again = client.completions.create(model=model_name, prompt="Hello", max_tokens=6, n=2,
                                      temperature=1.0, seed=11, logprobs=3)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        logprobs=True, top_logprobs=2, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_stop_string_is_excluded(client, model_name):
    free = client.completions.create(model=model_name, prompt="Hello world", max_tokens=16,
                                     temperature=0).choices[0].text
    # A random model may emit invalid UTF-8 (shown as U+FFFD); stop on clean text.
    windows = [free[i:i + 3] for i in range(2, len(free) - 2) if "\ufffd" not in free[i:i + 3]]
    if not windows:
        pytest.skip(f"no clean text to stop on in {free!r}")
    stop = windows[0]
    out = client.completions.create(model=model_name, prompt="Hello world", max_tokens=16,
                                    temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == free[: free.index(stop)]


def test_32_concurrent_streams_each_get_their_own_greedy_text(server, client, model_name):
    prompts = [f"Request {i}" for i in range(32)]
    params = dict(model=model_name, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    # Reference: each prompt alone, not streamed. On this tiny model the 32 greedy texts all
    # differ, so a stream that got another request's tokens cannot match by chance.
    want = [client.completions.create(prompt=p, **params).choices[0] for p in prompts]
    assert len({w.text for w in want}) == len(prompts)

    async def one(aclient, prompt):
        stream = await aclient.completions.create(prompt=prompt, stream=True, **params)
        text, finish_reasons = "", []
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish_reasons += [choice.finish_reason] if choice.finish_reason else []
        return text, finish_reasons

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY)
        return await asyncio.gather(*(one(aclient, p) for p in prompts))

    got = asyncio.run(main())
    # Batched with 31 others, every stream still carries exactly its own prompt's greedy text
    # and ends once, by length (ignore_eos), like its unbatched reference.
    assert [text for text, _ in got] == [w.text for w in want]
    assert [reasons for _, reasons in got] == [[w.finish_reason] for w in want]
    assert all(w.finish_reason == "length" for w in want)


def _metric(server: str, name: str, text: str | None = None) -> float:
    """Sum of a metric's samples (in ``text``, else a fresh scrape); ``name`` may end with
    an open label filter."""
    if text is None:
        text = httpx.get(f"{server}/metrics").text
    head = re.escape(name) if "{" in name else re.escape(name) + r"\{"
    values = [float(m.group(1)) for m in re.finditer(rf"^{head}[^}}]*}} (\S+)$", text, re.M)]
    return sum(values)


def test_dropped_stream_frees_its_blocks(server, model_name):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    aborted = _metric(server, 'kvray:request_success_total{finished_reason="abort"')
    body = {"model": model_name, "prompt": "Tell me a long story", "max_tokens": 1000,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=headers,
                      timeout=30) as resp:
        lines = resp.iter_lines()
        next(lines)
        deadline = time.monotonic() + 10  # engine stats reach /metrics every 0.5 s
        while True:
            # One scrape: running and KV usage from the same engine stats (a second scrape
            # could already show the request finished: the tiny model is fast).
            scrape = httpx.get(f"{server}/metrics").text
            if _metric(server, "kvray:num_requests_running", scrape) >= 1:
                break
            assert time.monotonic() < deadline, "the streaming request never showed as running"
            next(lines)
            time.sleep(0.2)
        assert _metric(server, "kvray:kv_cache_usage_perc", scrape) > 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (_metric(server, "kvray:num_requests_running") == 0
                and _metric(server, "kvray:kv_cache_usage_perc") == 0):
            break
        time.sleep(0.5)
    assert _metric(server, "kvray:num_requests_running") == 0
    assert _metric(server, "kvray:kv_cache_usage_perc") == 0
    # it ended because the client left, not by running to max_tokens
    assert _metric(server, 'kvray:request_success_total{finished_reason="abort"') == aborted + 1


def test_a_client_gone_before_a_plain_response_aborts_its_request(server, model_name):
    """Regression: a non-streaming request whose client timed out ran to max_tokens under
    ``--ingress process`` (nothing read the disconnect); it is aborted, as a stream is."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    aborted = _metric(server, 'kvray:request_success_total{finished_reason="abort"')
    body = {"model": model_name, "prompt": "Tell me a long story", "max_tokens": 1000,
            "n": 4, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, headers=headers, timeout=0.3)
    deadline = time.monotonic() + 30  # Serve's metrics lag by seconds
    while time.monotonic() < deadline:
        if (_metric(server, "kvray:num_requests_running") == 0 and _metric(
                server, 'kvray:request_success_total{finished_reason="abort"') > aborted):
            break
        time.sleep(0.5)
    assert _metric(server, "kvray:num_requests_running") == 0
    assert _metric(server, 'kvray:request_success_total{finished_reason="abort"') > aborted


def test_metrics_have_vllm_names(server, client, model_name):
    client.completions.create(model=model_name, prompt="x", max_tokens=2)
    text = httpx.get(f"{server}/metrics").text
    for name in ("kvray:num_requests_running", "kvray:num_requests_waiting",
                 "kvray:num_requests_swapped", "kvray:kv_cache_usage_perc",
                 "kvray:prefix_cache_queries_total", "kvray:prefix_cache_hits_total",
                 "kvray:num_preemptions_total", "kvray:prompt_tokens_total",
                 "kvray:generation_tokens_total", "kvray:request_success_total",
                 "kvray:time_to_first_token_seconds", "kvray:inter_token_latency_seconds",
                 "kvray:e2e_request_latency_seconds", "kvray:request_queue_time_seconds",
                 "kvray:request_prompt_tokens", "kvray:request_generation_tokens",
                 "kvray:engine_step_seconds_total", "kvray:engine_decode_step_seconds_total",
                 "kvray:engine_decode_steps_total", "kvray:engine_decode_tokens_total"):
        assert name in text, name
    assert f'model_name="{model_name}"' in text


def test_metrics_carry_the_engines_step_times(server, client, model_name):
    before = _metric(server, "kvray:engine_decode_steps_total")
    client.completions.create(model=model_name, prompt="Count:", max_tokens=6,
                              extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10  # replicas publish their stats every 0.5 s
    while _metric(server, "kvray:engine_decode_steps_total") <= before:
        assert time.monotonic() < deadline, "no decode steps in /metrics"
        time.sleep(0.25)
    text = httpx.get(f"{server}/metrics").text
    steps = _metric(server, "kvray:engine_decode_steps_total", text)
    decode_s = _metric(server, "kvray:engine_decode_step_seconds_total", text)
    busy_s = _metric(server, "kvray:engine_step_seconds_total", text)
    assert 0 < decode_s < busy_s  # the prefill steps count as busy, not as decode
    assert decode_s / steps < 5.0  # seconds, not milliseconds
    assert _metric(server, "kvray:engine_decode_tokens_total", text) >= steps


def _post(server, path, json=None, content=None, key=API_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["content-type"] = "application/json"
    return httpx.post(f"{server}{path}", json=json, content=content, headers=headers,
                      timeout=30)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "x", "n": "two"}, "n"),
    ({"prompt": []}, "prompt"),
])
def test_bad_parameters_get_400_naming_the_parameter(server, model_name, body, param):
    resp = _post(server, "/v1/completions", {"model": model_name, **body})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["message"]
    assert "Traceback" not in resp.text


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "celsius"],
           "properties": {"city": {"enum": ["Paris", "Rome"]},
                          "celsius": {"type": "integer", "minimum": -20, "maximum": 45}}}


def test_response_format_json_schema_streamed_and_not(client, model_name):
    """Sampled at temperature 1 by a random-weight model: only the grammar makes it JSON."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    messages = [{"role": "user", "content": "Weather?"}]
    for seed in range(3):
        whole = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=60, temperature=1.0, seed=seed,
            response_format=fmt)
        jsonschema.validate(json.loads(whole.choices[0].message.content), WEATHER)
        stream = client.chat.completions.create(
            model=model_name, messages=messages, max_tokens=60, temperature=1.0, seed=seed,
            response_format=fmt, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == whole.choices[0].message.content


def test_vllm_structured_output_extras_on_completions(client, model_name):
    regex = {"structured_outputs": {"regex": "[a-z]{4}-[0-9]{2}"}}
    out = client.completions.create(model=model_name, prompt="Code:", max_tokens=20,
                                    temperature=1.0, seed=2, extra_body=regex)
    assert re.fullmatch("[a-z]{4}-[0-9]{2}", out.choices[0].text)
    out = client.completions.create(model=model_name, prompt="Pick:", max_tokens=20, n=3,
                                    temperature=1.0, seed=5,
                                    extra_body={"guided_choice": ["left", "right"]})
    assert {c.text for c in out.choices} <= {"left", "right"}


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_json": {"type": "integer", "minimum": "zero"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
])
def test_invalid_output_constraints_get_400_naming_the_field(server, model_name, body, param):
    resp = _post(server, "/v1/chat/completions",
                 {"model": model_name, "messages": [{"role": "user", "content": "x"}], **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_malformed_json_unknown_model_and_auth(server, model_name):
    resp = _post(server, "/v1/completions", content=b'{"prompt": ')
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    resp = _post(server, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    resp = _post(server, "/v1/completions", {"model": model_name, "prompt": "x"}, key=None)
    assert resp.status_code == 401
    resp = _post(server, "/v1/completions", {"model": model_name, "prompt": "x"}, key="bad")
    assert resp.status_code == 401
    assert httpx.get(f"{server}/health").status_code == 200  # health needs no key


def test_tokenize_detokenize_version(server, model_name):
    ids = _post(server, "/tokenize", {"model": model_name, "prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    text = _post(server, "/detokenize", {"model": model_name, "tokens": ids["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    assert httpx.get(f"{server}/version").json()["version"]


def test_beam_search_completions_equal_offline_beam_search(client, model_name, model_dir):
    from kvray import BeamSearchParams

    prompts = ["Hello world", "The capital of France is"]
    got = client.completions.create(model=model_name, prompt=prompts, max_tokens=6, n=2,
                                    extra_body={"use_beam_search": True, "best_of": 3,
                                                "length_penalty": 0.5})
    llm = LLM(str(model_dir), dtype="float32", block_size=4, max_model_len=256)
    want = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6,
                                                     length_penalty=0.5))
    llm.shutdown()
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == [s.text for w in want for s in w.sequences[:2]]
    assert got.usage.completion_tokens == sum(len(s.token_ids) for w in want
                                              for s in w.sequences[:2])
    streamed = list(client.completions.create(
        model=model_name, prompt=prompts[0], max_tokens=6, n=2, stream=True,
        extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5}))
    assert [c.choices[0].text for c in streamed] == texts[:2]
    for body, param in [({"best_of": 1, "n": 2, "use_beam_search": True}, "best_of"),
                        ({"best_of": 3}, "best_of"),
                        ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
                        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
                        ({"use_beam_search": True, "best_of": 11}, "best_of")]:
        resp = httpx.post(f"{client.base_url}completions",
                          json={"model": model_name, "prompt": "Hi", "max_tokens": 3, **body},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_embeddings_equal_offline_and_rerank_orders_by_them(client, server, model_name,
                                                            model_dir):
    texts = ["Hello world", "The capital of France is Paris."]
    got = client.embeddings.create(model=model_name, input=texts)  # base64 on the wire
    floats = client.embeddings.create(model=model_name, input=texts, encoding_format="float",
                                      dimensions=16)
    llm = LLM(str(model_dir), dtype="float32", block_size=4, max_model_len=256)
    want = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    cut = [o.outputs.embedding for o in llm.embed(texts, PoolingParams(dimensions=16),
                                                   use_tqdm=False)]
    llm.shutdown()
    for g, w in zip(got.data, want, strict=True):
        assert max(abs(a - b) for a, b in zip(g.embedding, w, strict=True)) < 1e-5
    for g, w in zip(floats.data, cut, strict=True):
        assert len(g.embedding) == 16
        assert max(abs(a - b) for a, b in zip(g.embedding, w, strict=True)) < 1e-5
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0
    resp = httpx.post(f"{server}/v1/rerank", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": model_name, "query": texts[0], "documents": texts},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    assert results[0]["index"] == 0 and abs(results[0]["relevance_score"] - 1) < 1e-5


# ---- /v1/responses (the stateless subset) ----------------------------------------------
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False,
                 "properties": {"city": {"type": "string", "maxLength": 12},
                                "sunny": {"type": "boolean"}},
                 "required": ["city", "sunny"]}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "additionalProperties": False,
                               "properties": {"city": {"type": "string", "maxLength": 12}},
                               "required": ["city"]}}


def test_responses_plain_equals_the_chat_completion(client, model_name):
    resp = client.responses.create(model=model_name, input="Hello there",
                                   instructions="Be brief.", max_output_tokens=12,
                                   temperature=0)
    chat = client.chat.completions.create(
        model=model_name, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello there"}])
    assert resp.object == "response" and resp.id.startswith("resp")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                           else "completed")
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.model == model_name and resp.store is False


def test_responses_streamed_events_rebuild_the_whole_response(client, model_name):
    kwargs = dict(model=model_name, max_output_tokens=10, temperature=0,
                  input=[{"role": "developer", "content": "Answer."},
                         {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert "response.output_item.done" in kinds and "response.content_part.added" in kinds


def test_responses_json_schema_output_validates(client, model_name):
    import jsonschema

    for seed in (0, 1):
        resp = client.responses.create(
            model=model_name, input="Weather in Paris as JSON", max_output_tokens=60,
            temperature=1.0, extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "weather",
                             "schema": ANSWER_SCHEMA, "strict": True}})
        assert resp.status == "completed"
        jsonschema.validate(json.loads(resp.output_text), ANSWER_SCHEMA)


def test_responses_function_tool_round_trip(client, model_name):
    first = client.responses.create(model=model_name, input="Weather in Paris?",
                                    tools=[WEATHER_TOOL], tool_choice="required",
                                    max_output_tokens=150, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    streamed = list(client.responses.create(model=model_name, input="Weather in Paris?",
                                            tools=[WEATHER_TOOL], tool_choice="required",
                                            max_output_tokens=150, temperature=0, stream=True))
    args = "".join(e.delta for e in streamed
                   if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [(i.name, i.arguments) for i in done if i.type == "function_call"] == [
        (calls[0].name, calls[0].arguments)]
    # the call and its result go back as input items; the model answers in text
    second = client.responses.create(
        model=model_name, tools=[WEATHER_TOOL], max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id,
                "name": calls[0].name, "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": json.dumps({"sunny": True})}],
        tool_choice="none")
    assert second.status in ("completed", "incomplete") and second.output_text is not None
    assert second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": []}, "input"),
])
def test_responses_errors_are_400s_naming_the_field(server, model_name, body, param):
    resp = httpx.post(f"{server}/v1/responses", json={"model": model_name, **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_the_engine_is_built_on_the_thread_that_steps_it(model_dir):
    """Its kernels' OpenMP team then is the only one in the process (a second one, the
    builder's, made every decode step sleep-and-wake its threads: ~2x slower in Serve)."""
    import threading

    from kvray.config import config_from_flat
    from kvray.engine.async_engine import AsyncLLM

    engine = AsyncLLM(config_from_flat(dict(model=str(model_dir), dtype="float32",
                                            block_size=4, max_model_len=256)))
    try:
        assert engine.built_on == engine._thread.ident != threading.get_ident()
    finally:
        engine.shutdown()
    with pytest.raises(Exception, match="max_model_len"):  # a build error reaches the caller
        AsyncLLM(config_from_flat(dict(model=str(model_dir), dtype="float32",
                                       max_model_len=10**9)))


def test_full_waiting_queue_gets_503_with_retry_after(model_dir):
    """In-process app over a real engine whose waiting limit is zero."""
    from fastapi.testclient import TestClient

    from kvray.config import config_from_flat
    from kvray.engine.async_engine import AsyncLLM
    from kvray.serve.openai_app import OpenAIServer

    engine = AsyncLLM(config_from_flat(dict(model=str(model_dir), dtype="float32",
                                            block_size=4, max_model_len=256, max_waiting=0)))
    try:
        app = OpenAIServer(engine, "m", 256).app
        resp = TestClient(app).post("/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        engine.shutdown()
