"""Tool-call parsers on outputs recorded from each supported family (Qwen2.5/Hermes's
``<tool_call>`` JSON, Llama 3.1's JSON with ``<|python_tag|>`` and ``;``-joined calls),
whole and streamed: every way of cutting the text into deltas must stream the same calls
(name first, then the arguments in pieces) and the same content as the whole-text parse."""

from __future__ import annotations

import json
import random

import pytest

from kvray.serve.tools import ToolCallStreamer, parse_tool_calls, pick_parser, required_schema

pytestmark = pytest.mark.unit

# (mode, parser, text, content, [(name, arguments)])
RECORDED = [
    # Qwen2.5-7B-Instruct, two parallel calls after a sentence
    ("auto", "hermes",
     'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris, \\"FR\\"", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": '
     '"calculator", "arguments": {"expression": "2 + {3}"}}\n</tool_call>',
     "I will check both.",
     [("get_weather", {"city": 'Paris, "FR"', "unit": "celsius"}),
      ("calculator", {"expression": "2 + {3}"})]),
    # Qwen3: a call only, unicode arguments, arguments before the name
    ("auto", "hermes",
     '<tool_call>\n{"arguments": {"query": "café ☕", "limit": 3}, "name": "search"}\n'
     '</tool_call>',
     None, [("search", {"query": "café ☕", "limit": 3})]),
    # Hermes-style truncated final call (stopped at </tool_call> as a stop string)
    ("auto", "hermes",
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n',
     None, [("get_time", {"tz": "UTC"})]),
    # plain answers: nothing parsed, the text stays content
    ("auto", "hermes", "4 < 5, and <tool is not a tag.", "4 < 5, and <tool is not a tag.", []),
    ("auto", "llama3_json", "The answer is 42.", "The answer is 42.", []),
    # Llama-3.1-8B-Instruct: built-in tool tag and two calls joined by ';'
    ("auto", "llama3_json",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": '
     '"calculator", "parameters": {"expression": "1+1", "terms": [1, 2, {"a": 3}]}}',
     None, [("get_weather", {"city": "Rome"}),
            ("calculator", {"expression": "1+1", "terms": [1, 2, {"a": 3}]})]),
    # Llama-3.2-3B-Instruct: a bare JSON call
    ("auto", "llama3_json", '{"name": "get_time", "parameters": {}}', None,
     [("get_time", {})]),
    # tool_choice="required": the constrained array
    ("required", "hermes",
     '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "calculator", '
     '"parameters": {"expression": "7*6"}}]',
     None, [("get_weather", {"city": "Oslo"}), ("calculator", {"expression": "7*6"})]),
    # a named function: the output is its arguments
    ("named", "hermes", '{"city": "Lima"}', None, [("get_weather", {"city": "Lima"})]),
    # tool_choice="none": even a perfect call is text
    ("none", "hermes", '<tool_call>{"name": "x", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "x", "arguments": {}}</tool_call>', []),
]


@pytest.mark.parametrize("mode,parser,text,content,calls", RECORDED)
def test_whole_text_parse(mode, parser, text, content, calls):
    got_content, got = parse_tool_calls(text, mode, parser, named="get_weather")
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("mode,parser,text,content,calls", RECORDED)
def test_streamed_deltas_rebuild_the_same_calls_whatever_the_cuts(mode, parser, text,
                                                                   content, calls):
    for seed in range(25):
        rnd = random.Random(seed)
        cuts, i = [], 0
        while i < len(text):
            n = rnd.randint(1, 9)
            cuts.append(text[i:i + n])
            i += n
        streamer = ToolCallStreamer(mode, parser, named="get_weather")
        deltas = [d for piece in cuts for d in streamer.feed(piece)] + streamer.finish()
        streamed_content = "".join(d.get("content", "") for d in deltas)
        rebuilt: dict[int, dict] = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                call = rebuilt.setdefault(tc["index"], {"args": ""})
                if "name" in tc["function"]:  # the first delta of a call: id, type, name
                    assert "name" not in call and tc["id"].startswith("call_")
                    assert tc["type"] == "function"
                    call["name"] = tc["function"]["name"]
                else:
                    assert "name" in call, "arguments before the call's header"
                call["args"] += tc["function"]["arguments"]
        got = [(c["name"], json.loads(c["args"])) for _, c in sorted(rebuilt.items())]
        assert got == calls
        assert streamer.made_calls == bool(calls)
        if calls:
            assert streamed_content.strip() == (content or "")
        else:
            assert streamed_content == text


def test_parser_is_picked_from_the_chat_template():
    assert pick_parser("auto", "{{ '<|python_tag|>' }} Environment: ipython") == "llama3_json"
    assert pick_parser("auto", "{{ '<tool_call>' }}") == "hermes"
    assert pick_parser("auto", None) == "hermes"
    assert pick_parser("llama3_json", "<tool_call>") == "llama3_json"


def test_required_schema_allows_only_the_tools_and_their_parameters():
    import jsonschema

    tools = [{"name": "a", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}, {"name": "b"}]
    schema = required_schema(tools, parallel=False)
    jsonschema.validate([{"name": "a", "parameters": {"x": 1}}], schema)
    jsonschema.validate([{"name": "b", "parameters": {}}], schema)
    for bad in ([], [{"name": "c", "parameters": {}}], [{"name": "a", "parameters": {}}],
                [{"name": "b", "parameters": {}}, {"name": "b", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate([{"name": "b", "parameters": {}}] * 2, required_schema(tools, True))


def test_offline_chat_passes_tools_to_the_template_and_required_calls_parse(tmp_path):
    """LLM.chat hands tools to the chat template (as vLLM's does); a required call is the
    structured-outputs constraint the server uses, and parses into valid calls."""
    import jsonschema

    from kvray import LLM, SamplingParams
    from tests.helpers.tiny_models import make_tiny_model

    model = make_tiny_model("llama_gqa", tmp_path / "tools-model")
    template = (
        "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text(template)  # transformers 5 reads this one
    tool = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}
    llm = LLM(str(model), dtype="float32")
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=60,
                            structured_outputs={"json": required_schema([tool], False)})
    out = llm.chat([{"role": "user", "content": "Weather in Rome?"}], params,
                   use_tqdm=False, tools=[{"type": "function", "function": tool}])[0]
    llm.shutdown()
    assert "get_weather" in out.prompt
    content, calls = parse_tool_calls(out.outputs[0].text, "required", "hermes")
    assert content is None and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), tool["parameters"])
