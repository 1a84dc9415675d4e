"""Tool calling through `kvray serve` on the built-in model with the official `openai`
client: forced calls (required, a named function) whose arguments validate against the
tool's schema, streamed as OpenAI streams them and not; tool_choice none; a tool's result
flowing back through the chat template; and the 400s of malformed tool requests."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.helpers.server import API_KEY, launch_server, openai_client
from tests.helpers.skips import builtin_model_or_skip

pytestmark = pytest.mark.serve

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"expression": {"type": "string",
                                                 "pattern": "^[0-9+*/() -]{1,20}$"}},
                   "required": ["expression"]}}}
TOOLS = [WEATHER, CALCULATOR]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 12*7?"}]


@pytest.fixture(scope="module")
def server():
    with launch_server(builtin_model_or_skip()) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for tc in choice.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                call["id"], call["name"] = tc.id, tc.function.name
            call["arguments"] += tc.function.arguments or ""
    return [calls[k] for k in sorted(calls)], finish


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_calls_validate_streamed_and_not(client, model, seed):
    kwargs = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                  temperature=1.0, seed=seed, max_tokens=120)
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)
    streamed, finish = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_a_named_function_is_called_with_valid_arguments(client, model):
    named = {"type": "function", "function": {"name": "calculator"}}
    for stream in (False, True):
        resp = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                              tool_choice=named, max_tokens=60, stream=stream)
        if stream:
            calls, finish = _streamed_calls(resp)
            assert [c["name"] for c in calls] == ["calculator"] and finish == "stop"
            jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["calculator"])
        else:
            calls = resp.choices[0].message.tool_calls
            assert [c.function.name for c in calls] == ["calculator"]
            _check_calls(calls)


def test_tool_choice_none_never_calls(client, model):
    for seed in range(3):
        resp = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                              tool_choice="none", temperature=1.0, seed=seed,
                                              max_tokens=40)
        assert not resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason in ("stop", "length")


def test_tool_results_flow_back_through_the_template(client, model):
    from kvray.tokenizer import load_tokenizer

    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=120)
    calls = first.choices[0].message.tool_calls

    def conversation(note: str) -> list[dict]:
        messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            c.model_dump() for c in calls]}]
        return messages + [{"role": "tool", "tool_call_id": c.id, "content": json.dumps(
            {"result": "18 C, sunny" if c.function.name == "get_weather" else 84}) + note}
            for c in calls]

    answer = client.chat.completions.create(model=model, messages=conversation(""),
                                            tools=TOOLS, max_tokens=30)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens
    # The tool results' text is in the prompt: with longer results the prompt is longer by
    # the added text's tokens, once per result (a template dropping them adds nothing).
    note = " and a light breeze from the west" * 4
    grown = client.chat.completions.create(model=model, messages=conversation(note),
                                           tools=TOOLS, max_tokens=1)
    added = len(calls) * len(load_tokenizer(builtin_model_or_skip())(note)["input_ids"])
    assert abs(grown.usage.prompt_tokens - answer.usage.prompt_tokens - added) <= len(calls), (
        grown.usage.prompt_tokens, answer.usage.prompt_tokens, added)


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "(("}}}}}], "tool_choice": "required"}, "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_malformed_tool_requests_are_400s_naming_the_field(server, model, body, param):
    resp = httpx.post(f"{server}/v1/chat/completions", timeout=30,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": model, "messages": ASK, "max_tokens": 5, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
