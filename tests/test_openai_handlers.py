"""The OpenAI handlers over delta outputs, in process (ASGI, a real engine): a streamed
response carries exactly the non-streamed one's text, logprobs and finish reasons, with
echo, stop strings (held back until safe, or kept with include_stop_str_in_output), n > 1
and several prompts."""

from __future__ import annotations

import itertools
import json

import pytest
from fastapi.testclient import TestClient

from kvray.serve.openai_app import OpenAIServer

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def server(tiny_async_llm):
    engine = tiny_async_llm(max_model_len=256, num_gpu_blocks_override=256)
    return OpenAIServer(engine, "m", 256)


@pytest.fixture(scope="module")
def client(server):
    return TestClient(server.app)


def _events(resp) -> list[dict]:
    lines = [ln.removeprefix("data: ") for ln in resp.text.split("\n\n") if ln]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _fold_completion_chunks(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: concatenated text and logprobs, and the finish reason."""
    folded: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            f = folded.setdefault(c["index"], {"text": "", "tokens": [], "offsets": [],
                                               "finish_reason": None})
            f["text"] += c["text"]
            if c["logprobs"]:
                f["tokens"] += c["logprobs"]["tokens"]
                f["offsets"] += c["logprobs"]["text_offset"]
            assert f["finish_reason"] is None, "a choice finished twice"
            f["finish_reason"] = c["finish_reason"]
    return folded


BODY = {"model": "m", "prompt": ["Hello world", "Once upon a"], "n": 2, "max_tokens": 24,
        "temperature": 1.0, "seed": 11, "stop": ["e", "o w"], "logprobs": 2, "echo": True}


@pytest.mark.parametrize("include_stop", [False, True])
def test_streamed_completion_equals_the_whole_response(client, include_stop):
    body = {**BODY, "include_stop_str_in_output": include_stop}
    whole = client.post("/v1/completions", json=body).json()
    streamed = _fold_completion_chunks(_events(client.post(
        "/v1/completions", json={**body, "stream": True})))
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        got = streamed[choice["index"]]
        assert got["text"] == choice["text"]
        assert got["tokens"] == choice["logprobs"]["tokens"]
        assert got["offsets"] == choice["logprobs"]["text_offset"]
        assert got["finish_reason"] == choice["finish_reason"]
        prompt = BODY["prompt"][choice["index"] // 2]
        assert choice["text"].startswith(prompt)  # echo
        completion = choice["text"][len(prompt):]
        if choice["finish_reason"] == "stop":
            assert completion.endswith(("e", "o w")) == include_stop
    assert any(c["finish_reason"] == "stop" for c in whole["choices"])


def test_streamed_chat_equals_the_whole_response(client):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi there"}], "n": 2,
            "max_tokens": 20, "temperature": 1.0, "seed": 5, "stop": ["a"], "logprobs": True,
            "top_logprobs": 1}
    whole = client.post("/v1/chat/completions", json=body).json()
    chunks = _events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    text = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    finish = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            text[c["index"]] += c["delta"].get("content", "")
            if c["logprobs"]:
                tokens[c["index"]] += [e["token"] for e in c["logprobs"]["content"]]
            if c["finish_reason"]:
                assert c["index"] not in finish
                finish[c["index"]] = c["finish_reason"]
    for choice in whole["choices"]:
        i = choice["index"]
        assert text[i] == choice["message"]["content"]
        assert tokens[i] == [e["token"] for e in choice["logprobs"]["content"]]
        assert finish[i] == choice["finish_reason"]
    assert whole["usage"]["completion_tokens"] == sum(len(t) for t in tokens.values())


def test_without_lora_other_models_and_the_adapter_routes_are_404(client):
    """LoRA off: a request naming another model is a 404, and the adapter routes do not
    exist (404), whatever the body."""
    resp = client.post("/v1/completions", json={"model": "adapter", "prompt": "x",
                                                "max_tokens": 2})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError"
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        resp = client.post(route, json={"lora_name": "a", "lora_path": "/x"})
        assert resp.status_code == 404
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["m"]



@pytest.mark.parametrize("log_requests", [True, False])
def test_each_finished_request_logs_one_line_unless_log_requests_is_off(
        tiny_async_llm, caplog, log_requests):
    from kvray.config import ServerConfig

    engine = tiny_async_llm(max_model_len=256, num_gpu_blocks_override=256)
    app = OpenAIServer(engine, "m", 256, limits=ServerConfig(log_requests=log_requests)).app
    with caplog.at_level("INFO", logger="kvray"), TestClient(app) as http:
        resp = http.post("/v1/completions", json={"model": "m", "prompt": "Hello",
                                                  "max_tokens": 3})
    assert resp.status_code == 200
    lines = [r.getMessage() for r in caplog.records if "generated tokens" in r.getMessage()]
    assert len(lines) == (1 if log_requests else 0), lines


def test_unset_sampling_fields_take_the_models_generation_config(tiny_async_llm, tmp_path):
    """A generation_config.json with temperature 0 and max_new_tokens 5: a chat request
    that sets neither is greedy and 5 tokens long (the explicit greedy request's text); a
    request's own temperature still wins, but not more tokens than a generation config the
    server was pointed at allows (vLLM's cap; the model's own file only sets a default)."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    engine = tiny_async_llm(max_model_len=256, num_gpu_blocks_override=256,
                            generation_config=str(tmp_path))
    http = TestClient(OpenAIServer(engine, "m", 256).app)
    body = {"model": "m", "messages": [{"role": "user", "content": "Once upon a"}]}
    first, second = (http.post("/v1/chat/completions", json=body).json() for _ in range(2))
    assert first["usage"]["completion_tokens"] == 5
    assert first["choices"][0]["finish_reason"] == "length"
    explicit = http.post("/v1/chat/completions", json={**body, "temperature": 0,
                                                        "max_tokens": 5}).json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"] \
        == explicit["choices"][0]["message"]
    longer = http.post("/v1/chat/completions", json={**body, "max_tokens": 9,
                                                      "ignore_eos": True}).json()
    assert longer["usage"]["completion_tokens"] == 5
    hot = http.post("/v1/chat/completions", json={**body, "temperature": 1.0, "seed": 3,
                                                   "max_tokens": 3, "ignore_eos": True}).json()
    assert hot["usage"]["completion_tokens"] == 3


def test_the_openai_client_retrieves_the_served_model_and_gets_a_404_for_others(client):
    """``client.models.retrieve`` (OpenAI's GET /v1/models/{model}) through the real
    ``openai`` client over the app."""
    import openai

    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client,
                        max_retries=0)
    card = oai.models.retrieve("m")
    assert (card.id, card.object, card.owned_by) == ("m", "model", "kvray")
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("org/other-model")
    assert "serves 'm'" in str(err.value)
    # Regression: the name was echoed, and a path parameter may carry anything (the HTTP
    # fuzzer's "ActorID(" read as a leak of Ray internals)
    hostile = client.get("/v1/models/ActorID(" + "x" * 5000)
    assert hostile.status_code == 404 and "ActorID" not in hostile.text


def test_echo_with_logprobs_covers_the_prompt_tokens_too(client, server):
    """Regression: echo + logprobs gave only the completion's tokens; as in OpenAI and
    vLLM the echoed prompt's tokens come first (the first one's logprob null), so the
    tokens and offsets cover the whole text."""
    body = {"model": "m", "prompt": "Hello world", "max_tokens": 4, "temperature": 0,
            "echo": True, "logprobs": 1}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
    # Regression: a prompt whose tokens' texts are longer than its text (one character
    # split over three byte tokens) made the completion's offsets go back (vLLM: a running
    # sum over prompt and completion tokens)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = server.tokenizer
    split = [tok.convert_tokens_to_ids(bytes_to_unicode()[b]) for b in "日".encode()]
    for stream in (False, True):
        resp = client.post("/v1/completions", json={**body, "stream": stream,
                                                    "prompt": split + tok.encode(" ok")})
        lps = [c["choices"][0]["logprobs"] for c in _events(resp) if c["choices"]] if stream \
            else [resp.json()["choices"][0]["logprobs"]]
        tokens = [t for lp in lps if lp for t in lp["tokens"]]
        offsets = [o for lp in lps if lp for o in lp["text_offset"]]
        assert offsets == list(itertools.accumulate(map(len, tokens), initial=0))[:-1]


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client):
    """Regression: ``echo`` with ``max_tokens: 0`` (OpenAI's way to score a prompt) was a
    400; as in OpenAI and vLLM it returns the prompt, with its tokens' logprobs, and no
    completion tokens — streamed or not."""
    body = {"model": "m", "prompt": "Hello world", "max_tokens": 0, "echo": True,
            "logprobs": 2}
    whole = client.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["text"] == "Hello world" and choice["finish_reason"] == "length"
    assert "".join(choice["logprobs"]["tokens"]) == "Hello world"
    assert choice["logprobs"]["token_logprobs"][0] is None
    assert whole.json()["usage"]["completion_tokens"] == 0
    streamed = _fold_completion_chunks(_events(client.post(
        "/v1/completions", json={**body, "stream": True})))[0]
    assert streamed["text"] == choice["text"]
    assert streamed["tokens"] == choice["logprobs"]["tokens"]
    assert streamed["finish_reason"] == "length"
    plain = client.post("/v1/completions", json={**body, "echo": False})
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "max_tokens"


def test_tool_choice_auto_over_no_tools_is_plain_chat(client):
    """Regression: ``tools: []`` with ``tool_choice: "auto"`` (agent frameworks send it
    before any tool is registered) was a 400; vLLM answers it as plain chat. A required
    or named call without tools stays a 400."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for extra in ({"tools": [], "tool_choice": "auto"}, {"tool_choice": "auto"}):
        resp = client.post("/v1/chat/completions", json={**body, **extra})
        assert resp.status_code == 200, resp.text
        assert not resp.json()["choices"][0]["message"].get("tool_calls")
    resp = client.post("/v1/chat/completions", json={**body, "tools": [],
                                                     "tool_choice": "required"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"


def test_parallel_tool_calls_false_keeps_one_call_under_auto(client):
    """OpenAI's promise for ``parallel_tool_calls: false``: at most one call, also when the
    model writes two under ``tool_choice: auto`` (here forced by a choice), streamed or
    not."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}
    two = ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>')
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
            "tools": [tool], "tool_choice": "auto", "guided_choice": [two]}
    both = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"]) for c in both["tool_calls"]] == [
        {"x": 1}, {"x": 2}]
    one = client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})
    calls = one.json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}]
    streamed = _events(client.post("/v1/chat/completions", json={
        **body, "parallel_tool_calls": False, "stream": True}))
    entries = [e for c in streamed for ch in c["choices"]
               for e in ch["delta"].get("tool_calls") or []]
    assert entries and {e["index"] for e in entries} == {0}
    arguments = "".join(e["function"].get("arguments") or "" for e in entries)
    assert json.loads(arguments) == {"x": 1}


def _response_events(resp) -> list[dict]:
    return [json.loads(block.split("data: ", 1)[1]) for block in resp.text.split("\n\n")
            if "data: " in block]


def test_responses_stream_opens_items_empty_and_an_empty_output_keeps_its_message(client):
    """OpenAI's event shapes: an item is added with no content (its part follows in
    content_part.added; the openai client's accumulator doubled it); an output with no
    text still has its (empty) message item streamed, as the non-streamed response has."""
    body = {"model": "m", "input": "Hi", "max_output_tokens": 5, "temperature": 0}
    events = _response_events(client.post("/v1/responses", json={**body, "stream": True}))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert added and all(e["item"]["content"] == [] for e in added
                         if e["item"]["type"] == "message")
    empty = {**body, "allowed_token_ids": [2]}  # EOS only: nothing generated
    whole = client.post("/v1/responses", json=empty).json()
    streamed = _response_events(client.post("/v1/responses", json={**empty, "stream": True}))
    final = streamed[-1]["response"]
    assert [i["type"] for i in final["output"]] == [i["type"] for i in whole["output"]] \
        == ["message"]
    assert final["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0][
        "text"] == ""


def test_responses_cut_by_max_output_tokens_mark_the_cut_item_incomplete(client):
    """OpenAI's shape: in an incomplete response the item the limit cut says so (it said
    completed), streamed and whole alike; usage counts the prefix-cache hits."""
    body = {"model": "m", "input": "Hello there, how are you doing today?",
            "max_output_tokens": 3, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/responses", json=body).json()
    assert whole["status"] == "incomplete" and whole["output"][-1]["status"] == "incomplete"
    events = _response_events(client.post("/v1/responses", json={**body, "stream": True}))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert done[-1]["status"] == final["output"][-1]["status"] == "incomplete"
    again = client.post("/v1/responses", json=body).json()  # the prompt is cached now
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > 0
    whole_ok = client.post("/v1/responses", json={**body, "max_output_tokens": 16,
                                                  "ignore_eos": False,
                                                  "allowed_token_ids": [2]}).json()
    assert whole_ok["status"] == "completed"
    assert all(i["status"] == "completed" for i in whole_ok["output"])


def test_prompt_tokens_details_report_prefix_cache_hits_when_enabled(tiny_async_llm):
    """vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens."""
    engine = tiny_async_llm(max_model_len=256, num_gpu_blocks_override=256,
                            enable_prompt_tokens_details=True)
    client = TestClient(OpenAIServer(engine, "m", 256, limits=engine.config.server).app)
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story " * 4}],
            "max_tokens": 2}
    first = client.post("/v1/chat/completions", json=body).json()["usage"]
    second = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert 0 < second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]
    chunks = _events(client.post("/v1/chat/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    plain = client.post("/v1/completions", json={"model": "m", "prompt": "Hi",
                                                 "max_tokens": 1}).json()["usage"]
    assert "prompt_tokens_details" in plain


def test_usage_has_no_prompt_tokens_details_by_default(client):
    resp = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1})
    assert "prompt_tokens_details" not in resp.json()["usage"]


@pytest.mark.parametrize("extra,param", [
    # named as a Responses body spells them (regression: chat paths, tools.0.function.name)
    ({"tools": [{"type": "function", "name": 5}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools.0.parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"]}, "top_logprobs"),
])
def test_responses_fields_it_cannot_honour_are_400s(client, extra, param):
    """Regression: these were ignored (200) although ignoring them changes the answer."""
    resp = client.post("/v1/responses", json={"model": "m", "input": "Hi",
                                              "max_output_tokens": 2, **extra})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_null_means_the_default_for_fields_that_hold_no_null(client):
    """Regression: clients that send unset fields as null got 400s for n, stream, echo,
    penalties, logprobs, parallel_tool_calls (OpenAI's "or null" fields)."""
    nulls = dict.fromkeys(["n", "stream", "presence_penalty", "frequency_penalty", "echo",
                           "min_tokens", "ignore_eos", "skip_special_tokens"])
    resp = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2,
                                                **nulls})
    assert resp.status_code == 200, resp.text
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            **dict.fromkeys(["logprobs", "parallel_tool_calls", "n", "stream",
                             "add_generation_prompt"])}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


@pytest.mark.parametrize("body,status,param", [
    ({"best_of": 1}, 200, None),  # best_of == n: OpenAI's default, nothing to do
    ({"best_of": 2}, 400, "best_of"),  # more than n: beam search only
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),  # was turned into 1.0
    ({"logprobs": 20}, 200, None),  # vLLM's cap (max_logprobs), not OpenAI's 5
    ({"truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
])
def test_completion_fields_vllm_accepts_or_refuses(client, body, status, param):
    resp = client.post("/v1/completions", json={"model": "m", "prompt": "Hi",
                                                "max_tokens": 2, **body})
    assert resp.status_code == status, resp.text
    if param:
        assert resp.json()["error"]["param"] == param


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client):
    """Regression: ``truncate_prompt_tokens`` was ignored (a long prompt got the
    context-length 400); the last k tokens are kept, -1 keeps what the context holds."""
    long_prompt = list(range(10, 310))  # 300 ids: more than the 256-token context
    body = {"model": "m", "prompt": long_prompt, "max_tokens": 1, "temperature": 0}
    assert client.post("/v1/completions", json=body).status_code == 400
    cut = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 20}).json()
    assert cut["usage"]["prompt_tokens"] == 20
    tail = client.post("/v1/completions", json={**body, "prompt": long_prompt[-20:]}).json()
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    whole = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == 255


def test_continue_final_message_leaves_the_assistant_message_open(client):
    """Regression: ``continue_final_message`` was ignored (the prefilled answer was
    closed, so the model started a new turn); the prompt now ends in its text."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! My name"}]
    open_ = client.post("/tokenize", json={"model": "m", "messages": messages,
                                           "add_generation_prompt": False,
                                           "continue_final_message": True}).json()["tokens"]
    closed = client.post("/tokenize", json={"model": "m", "messages": messages,
                                            "add_generation_prompt": False}).json()["tokens"]
    detok = client.post("/detokenize", json={"model": "m", "tokens": open_}).json()
    assert detok["prompt"].endswith("Hello! My name") and len(open_) < len(closed)
    body = {"model": "m", "messages": messages, "max_tokens": 3, "temperature": 0,
            "continue_final_message": True}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "continue_final_message"
    resp = client.post("/v1/chat/completions", json={**body, "add_generation_prompt": False})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == len(open_)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    """Regression: ``stream_options.continuous_usage_stats`` was ignored."""
    body = {"model": "m", "prompt": "Hi", "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _events(client.post("/v1/completions", json=body))
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts and counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and not chunks[-1]["choices"]


def test_continuous_usage_counts_the_choice_a_chunk_carries(client):
    """vLLM's: each chunk's usage is its prompt's tokens and its own choice's so far
    (regression: the running total of every prompt and choice)."""
    body = {"model": "m", "prompt": ["Hi", "Hello there friend"], "n": 2, "max_tokens": 4,
            "temperature": 1.0, "seed": 1, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    lengths = [client.post("/tokenize", json={"model": "m", "prompt": p}).json()["count"]
               for p in body["prompt"]]
    seen: dict[int, list[int]] = {}
    for chunk in _events(client.post("/v1/completions", json=body)):
        if chunk["choices"]:
            index = chunk["choices"][0]["index"]
            assert chunk["usage"]["prompt_tokens"] == lengths[index // 2]
            seen.setdefault(index, []).append(chunk["usage"]["completion_tokens"])
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(counts == sorted(counts) and counts[-1] == 4 for counts in seen.values())
    chat = _events(client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "stream": True, "stream_options": body["stream_options"]}))
    assert chat[0]["usage"]["completion_tokens"] == 0 < chat[0]["usage"]["prompt_tokens"]


def test_min_tokens_holds_back_stop_strings(client):
    """Regression: a stop string in the first tokens ended the output before min_tokens
    (stop token ids were held back, stop strings not)."""
    body = {"model": "m", "prompt": "Hi", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    free = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = free[1]  # the completion's second character
    short = client.post("/v1/completions", json={**body, "stop": [stop]}).json()
    assert short["usage"]["completion_tokens"] < 6
    held = client.post("/v1/completions", json={**body, "stop": [stop], "min_tokens": 6})
    assert held.json()["usage"]["completion_tokens"] >= 6


@pytest.mark.parametrize("model,status", [("/models/m", 200), ("/models/m/", 200),
                                          ("models/m.gguf", 200), ("/models/other", 404),
                                          ("other", 404)])
def test_a_path_to_the_served_model_names_it(client, model, status):
    """vLLM serves a model under the path it was given; kvray under its directory's name
    ("m" here), and takes a path ending in that name for it too."""
    resp = client.post("/v1/completions", json={"model": model, "prompt": "Hi",
                                                "max_tokens": 1})
    assert resp.status_code == status, resp.text


def test_stream_options_without_a_stream_are_refused(client):
    """As in vLLM: stream_options only make sense on a stream."""
    resp = client.post("/v1/completions", json={
        "model": "m", "prompt": "Hi", "max_tokens": 1,
        "stream_options": {"include_usage": True}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_options"


def test_prompt_logprobs_come_back_as_vllm_returns_them(client, server):
    """vLLM's ``prompt_logprobs``: per prompt token (null for the first) its id and the top
    k ids -> logprob, rank and decoded token; per choice on completions, on the response
    for chat; a 400 with stream (vLLM's rule). It was silently ignored."""
    body = {"model": "m", "prompt": "Hello world, again", "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2}
    resp = client.post("/v1/completions", json=body).json()
    tok = server.tokenizer
    for choice in resp["choices"]:
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == resp["usage"]["prompt_tokens"]
        for entry in plp[1:]:
            assert 2 <= len(entry) <= 3  # the prompt's own token, and the top 2
            ranks = sorted(e["rank"] for e in entry.values())
            assert ranks[:2] == [1, 2] and all(r >= 1 for r in ranks)
            for tid, e in entry.items():
                assert e["logprob"] <= 0.0 and e["decoded_token"] == tok.decode([int(tid)])
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "prompt_logprobs": 0}
    whole = client.post("/v1/chat/completions", json=chat).json()
    assert whole["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in whole["prompt_logprobs"][1:])
    assert len(whole["prompt_logprobs"]) == whole["usage"]["prompt_tokens"]
    streamed = client.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == \
        "prompt_logprobs"
    too_many = client.post("/v1/completions", json={**body, "prompt_logprobs": 10**6})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == \
        "prompt_logprobs"


def test_stop_reason_and_tokens_as_token_ids(client):
    """vLLM's choice fields: ``stop_reason`` names the stop string or token id that ended
    a choice (null at EOS or length); ``return_tokens_as_token_ids`` names logprobs' tokens
    ``token_id:<id>``."""
    first = client.post("/v1/completions", json={
        "model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}).json()["choices"][0]
    assert first["stop_reason"] is None and first["finish_reason"] == "length"
    body = {"model": "m", "prompt": "Hello", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    as_ids = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in as_ids["tokens"])
    greedy = [int(t.removeprefix("token_id:")) for t in as_ids["tokens"]]
    stopped = client.post("/v1/completions", json={
        **body, "stop_token_ids": [greedy[2]]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == greedy[2]
    chat = client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
        "temperature": 0, "logprobs": True, "top_logprobs": 2,
        "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert "stop_reason" in chat
    for item in chat["logprobs"]["content"]:
        assert item["token"].startswith("token_id:")
        assert item["bytes"] == list(item["token"].encode())
        assert all(t["token"].startswith("token_id:") for t in item["top_logprobs"])


def test_allowed_token_ids_and_bad_words_reach_the_engine(client):
    """vLLM's request extras: ``allowed_token_ids`` limits every generated token, and a
    malformed ``bad_words`` / out-of-vocabulary id is a 400 naming the field."""
    body = {"model": "m", "prompt": "Hello", "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
            "allowed_token_ids": [50, 60, 70]}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert {int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]} <= {
        50, 60, 70}
    for extra, param in [({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"bad_words": [""]}, "bad_words")]:
        resp = client.post("/v1/completions", json={**body, **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_ping_answers_as_health_does(client):
    for method in (client.get, client.post):  # vLLM's liveness probe, both verbs
        assert method("/ping").status_code == 200


def test_tokenize_returns_token_strings_when_asked(client, server):
    """vLLM's ``return_token_strs``: each id's token string beside the ids."""
    plain = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert "token_strs" not in plain
    body = client.post("/tokenize", json={"prompt": "Hello world",
                                          "return_token_strs": True}).json()
    assert body["token_strs"] == server.tokenizer.convert_ids_to_tokens(body["tokens"])


def test_chat_echo_starts_the_reply_with_the_assistants_last_message(client):
    """vLLM's chat ``echo``: with the conversation ending in an assistant message (to be
    continued), the reply's content starts with that message, streamed or not."""
    body = {"model": "m", "max_tokens": 4, "temperature": 0, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True,
            "messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello I am"}]}
    whole = client.post("/v1/chat/completions", json=body).json()
    text = whole["choices"][0]["message"]["content"]
    assert text.startswith("Hello I am") and len(text) > len("Hello I am")
    chunks = _events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
    assert streamed == text
    plain = client.post("/v1/chat/completions", json={**body, "echo": False}).json()
    assert plain["choices"][0]["message"]["content"] == text[len("Hello I am"):]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_priority_under_fcfs_is_a_400_naming_it(client, path, body):
    """vLLM refuses a priority the fcfs scheduler would silently ignore."""
    resp = client.post(path, json={"model": "m", "max_tokens": 1, "priority": 1, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "priority" and "priority scheduling is not enabled" in err["message"]
    assert client.post(path, json={"model": "m", "max_tokens": 1, "priority": 0,
                                   **body}).status_code == 200


# ---- how a conversation reaches the chat template (vLLM's rules) ----------------------------
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}"
                  "{{ m.content }}{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}"
                  "{% endif %}{% if m.reasoning_content %}(r:{{ m.reasoning_content }}){% endif %}"
                  "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}")
STRING_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def trusting(server):
    from kvray.config import ServerConfig

    return TestClient(OpenAIServer(server.client, "m", 256, limits=ServerConfig(
        trust_request_chat_template=True)).app)


def _rendered(client, **body) -> str:
    resp = client.post("/tokenize", json={"model": "m", "add_generation_prompt": False,
                                          **body})
    assert resp.status_code == 200, resp.text
    return client.post("/detokenize", json={"model": "m",
                                            "tokens": resp.json()["tokens"]}).json()["prompt"]


def test_a_request_template_needs_the_servers_trust(client, trusting):
    """Regression: a request's chat_template was ignored with a 200 (vLLM: a 400 unless
    --trust-request-chat-template)."""
    messages = [{"role": "user", "content": "Hi"}]
    for path, body in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
        resp = client.post(path, json={"model": "m", "messages": messages,
                                       "chat_template": STRING_TEMPLATE, **body})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "chat_template"
    assert _rendered(trusting, messages=messages, chat_template=STRING_TEMPLATE) == "<user>Hi"
    resp = trusting.post("/v1/chat/completions", json={
        "model": "m", "messages": messages, "chat_template": STRING_TEMPLATE, "max_tokens": 1})
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == len(
        trusting.post("/tokenize", json={"model": "m", "messages": messages,
                                         "chat_template": STRING_TEMPLATE}).json()["tokens"])


def test_a_template_that_loops_over_content_gets_parts_and_others_a_joined_string(trusting):
    """vLLM's content format auto-detection (Gemma 3, Llama 4 loop over the parts; a string
    content becomes one part there); other templates get the parts joined with newlines."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "input_text", "text": "b"}]},
                {"role": "assistant", "content": "c"}]
    assert _rendered(trusting, messages=messages, chat_template=PARTS_TEMPLATE) == \
        "<user>[a][b]<assistant>[c]"
    assert _rendered(trusting, messages=messages, chat_template=STRING_TEMPLATE) == \
        "<user>a\nb<assistant>c"


def test_earlier_reasoning_and_tools_reach_the_template_as_vllm_passes_them(trusting):
    """An assistant's reasoning (interleaved thinking) was dropped; tools lost their null
    description/parameters (templates tojson them); /tokenize ignored tools."""
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "reasoning_content": "why"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = _rendered(trusting, messages=messages, chat_template=PARTS_TEMPLATE, tools=tools)
    assert "(r:why)" in text
    assert json.loads(text[text.index("[{"):]) == [
        {"type": "function", "function": {"name": "f", "description": None,
                                          "parameters": None}}]


def test_tool_choice_none_keeps_the_tools_in_the_prompt_unless_the_server_excludes_them(
        server, trusting):
    """vLLM's default renders the tools under tool_choice none (regression: dropped)."""
    from kvray.config import ServerConfig

    excluding = TestClient(OpenAIServer(server.client, "m", 256, limits=ServerConfig(
        trust_request_chat_template=True, exclude_tools_when_tool_choice_none=True)).app)
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 40}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "tools": tools, "chat_template": PARTS_TEMPLATE}
    bare = {k: v for k, v in body.items() if k != "tools"}

    def prompt_tokens(client, **extra) -> int:
        resp = client.post("/v1/chat/completions", json={**body, **extra})
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]["prompt_tokens"]

    with_tools = prompt_tokens(trusting, tool_choice="auto")
    without = trusting.post("/v1/chat/completions", json=bare).json()["usage"]["prompt_tokens"]
    assert with_tools > without
    assert prompt_tokens(trusting, tool_choice="none") == with_tools
    assert prompt_tokens(excluding, tool_choice="none") == without


def test_return_token_ids_gives_prompt_and_output_ids_whole_and_streamed(client):
    """vLLM's return_token_ids (RL and agent clients read them): per choice the output ids
    (streamed: each chunk's new ones) and the prompt's (completions: per choice, with its
    first chunk; chat: top level, with the role chunk)."""
    base = {"model": "m", "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2,
            "ignore_eos": True, "return_token_ids": True}
    tokens = client.post("/tokenize", json={"model": "m", "prompt": "Hello"}).json()["tokens"]
    whole = client.post("/v1/completions", json={**base, "prompt": "Hello"}).json()
    for c in whole["choices"]:
        assert c["prompt_token_ids"] == tokens and len(c["token_ids"]) == 6
    chunks = _events(client.post("/v1/completions", json={**base, "prompt": "Hello",
                                                         "stream": True}))
    for c in whole["choices"]:
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == c["index"]]
        assert mine[0]["prompt_token_ids"] == tokens
        assert all("prompt_token_ids" not in m for m in mine[1:])
        assert sum((m["token_ids"] for m in mine), []) == c["token_ids"]
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.post("/v1/chat/completions", json={**base, "messages": messages}).json()
    prompt = client.post("/tokenize", json={"model": "m", "messages": messages}).json()
    assert chat["prompt_token_ids"] == prompt["tokens"]
    assert all(len(c["token_ids"]) == 6 for c in chat["choices"])
    chunks = _events(client.post("/v1/chat/completions", json={**base, "messages": messages,
                                                              "stream": True}))
    assert all(ch["prompt_token_ids"] == prompt["tokens"] for ch in chunks[:2])
    for c in chat["choices"]:
        ids = [i for ch in chunks[2:] for x in ch["choices"] if x["index"] == c["index"]
               for i in x["token_ids"]]
        assert ids == c["token_ids"]
    plain = client.post("/v1/completions", json={**base, "prompt": "Hello",
                                                 "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]
    beams = client.post("/v1/completions", json={**base, "prompt": "Hello", "seed": None,
                                                 "temperature": 0,
                                                 "use_beam_search": True}).json()
    assert all(c["prompt_token_ids"] == tokens and len(c["token_ids"]) == 6
               for c in beams["choices"])


def test_a_failure_formatting_a_streamed_chunk_ends_the_stream_with_an_error_event(
        client, monkeypatch):
    """Regression: an exception while turning an output into chunks escaped the SSE
    generator: the client got a cut chunked body, no error event and no [DONE]."""
    from kvray.serve.completions import CompletionHandler

    def broken(self, i, out):
        raise RuntimeError("formatting failed")

    monkeypatch.setattr(CompletionHandler, "delta_chunks", broken)
    resp = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 3,
                                                "stream": True})
    events = _events(resp)  # ends with [DONE]
    assert events[-1]["error"]["code"] == 500
    assert "formatting failed" not in resp.text  # internal details stay in the log
