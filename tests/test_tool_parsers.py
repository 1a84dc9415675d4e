"""Tool-call parsers on outputs recorded from each supported family (Qwen2.5/Hermes's
``<tool_call>`` JSON, Llama 3.1's JSON with ``<|python_tag|>`` and ``;``-joined calls,
Mistral's ``[TOOL_CALLS]`` in its array and ``name[ARGS]`` forms, Llama 3.2/4's pythonic
lists, Qwen3-Coder's ``<function=...>`` XML), whole and streamed: every way of cutting the
text into deltas must stream the same calls (name first, then the arguments in pieces) and
the same content as the whole-text parse."""

from __future__ import annotations

import json
import random
import re

import pytest

from kvray.serve.tools import (
    PARSERS,
    ToolCallStreamer,
    keeps_special_tokens,
    parse_tool_calls,
    pick_parser,
    required_schema,
)

pytestmark = pytest.mark.unit

# The request's tools (as ChatCompletionRequest.tool_dicts() gives them): qwen3_coder types
# its argument values by these schemas; the other formats carry JSON and ignore them.
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": props}}} for name, props in [
    ("get_weather", {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                     "days": {"type": "integer"}, "metric": {"type": "boolean"},
                     "hours": {"type": ["integer", "null"]}}),
    ("calculator", {"expression": {"type": "string"}}),
    ("search", {"query": {"type": "string"}, "limit": {"type": "integer"},
                "filters": {"type": "object"}, "langs": {"type": "array"},
                "min_score": {"type": "number"}}),
    ("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    ("get_time", {"tz": {"type": "string"}}),
]]
MISTRAL_ID, OPENAI_ID = re.compile(r"[A-Za-z0-9]{9}"), re.compile(r"call_[0-9a-f]{24}")
_SCANNED = ("mistral", "pythonic", "qwen3_coder")  # the formats read by one incremental scanner

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
] + [
    # --- mistral ---
    # Mistral-7B-Instruct-v0.3 (v3 tokenizer): the JSON array form, one call
    ("auto", "mistral",
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}]',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # Mixtral-8x22B-Instruct: two parallel calls, escaped quotes and brackets in strings
    ("auto", "mistral",
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "San Francisco, \\"CA\\"", '
     '"unit": "fahrenheit"}}, {"name": "calculator", "arguments": {"expression": '
     '"[2 + 3] * {4}"}}]',
     None, [("get_weather", {"city": 'San Francisco, "CA"', "unit": "fahrenheit"}),
            ("calculator", {"expression": "[2 + 3] * {4}"})]),
    # Mistral-Nemo: content first, unicode, nested objects, arguments before the name
    ("auto", "mistral",
     'Sure, let me look that up.[TOOL_CALLS][{"arguments": {"query": "café ☕ — naïve", '
     '"filters": {"langs": ["fr", "en"], "safe": true, "max": null}}, "name": "search"}]',
     "Sure, let me look that up.",
     [("search", {"query": "café ☕ — naïve",
                  "filters": {"langs": ["fr", "en"], "safe": True, "max": None}})]),
    # Mistral-Small-3.2 (v11+ tokenizer): name[ARGS]{...}, one tag per call
    ("auto", "mistral",
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]'
     'calculator[ARGS]{"expression": "12*7"}',
     None, [("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("calculator", {"expression": "12*7"})]),
    # Devstral: a sentence first; backslashes, quotes and braces inside nested arguments
    ("auto", "mistral",
     'I\'ll search for it.\n\n[TOOL_CALLS]search[ARGS]{"query": "\\"quoted\\" \\\\ '
     'text }", "filters": {"tags": ["a", "b"], "deep": {"x": [1, 2.5, {"y": "}"}]}}}',
     "I'll search for it.",
     [("search", {"query": '"quoted" \\ text }',
                  "filters": {"tags": ["a", "b"], "deep": {"x": [1, 2.5, {"y": "}"}]}}})]),
    # Magistral: the model's own call id before [ARGS]
    ("auto", "mistral", '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "Europe/Paris"}',
     None, [("get_time", {"tz": "Europe/Paris"})]),
    # the array form cut off before its "]" (max_tokens right after the last call)
    ("auto", "mistral",
     '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}, ',
     None, [("get_time", {"tz": "UTC"})]),
    # a call whose "name" is prose is dropped with its arguments; the others stand
    ("auto", "mistral",
     '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]not a name {"x": 1}[TOOL_CALLS]'
     'get_time[ARGS]{}',
     None, [("get_time", {"tz": "UTC"}), ("get_time", {})]),
    # plain answers with brackets, braces, and the tag itself as words
    ("auto", "mistral", 'The list [1, 2, 3] has {"a": 1} in it.',
     'The list [1, 2, 3] has {"a": 1} in it.', []),
    ("auto", "mistral", "Mistral marks calls with [TOOL_CALLS] before them.",
     "Mistral marks calls with [TOOL_CALLS] before them.", []),
    # tool_choice="required" and a named function under mistral: Mistral-shaped ids
    ("required", "mistral", '[{"name": "get_time", "parameters": {"tz": "UTC"}}]', None,
     [("get_time", {"tz": "UTC"})]),
    ("named", "mistral", '{"city": "Lima"}', None, [("get_weather", {"city": "Lima"})]),
    # --- pythonic ---
    # Llama-3.2-3B-Instruct: one call
    ("auto", "pythonic", '[get_weather(city="Paris", unit="celsius")]', None,
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    # two parallel calls; either quote, quotes and parentheses inside strings
    ("auto", "pythonic",
     '[get_weather(city=\'San Francisco, "CA"\', unit="fahrenheit"), '
     'calculator(expression="(2 + 3) * [4]")]',
     None, [("get_weather", {"city": 'San Francisco, "CA"', "unit": "fahrenheit"}),
            ("calculator", {"expression": "(2 + 3) * [4]"})]),
    # Llama-4-Scout: content, then the list between <|python_start|> and <|python_end|>
    ("auto", "pythonic",
     'Let me check the weather first.<|python_start|>[get_weather(city="Zürich ☀", days=3, '
     'metric=True, hours=None)]<|python_end|>',
     "Let me check the weather first.",
     [("get_weather", {"city": "Zürich ☀", "days": 3, "metric": True, "hours": None})]),
    # nested literals: dict, list, tuple (a JSON array), escapes, negative numbers
    ("auto", "pythonic",
     '[search(query="it\'s \\"quoted\\"", filters={"tags": ["a", "b"], "range": (1, 2.5), '
     '\'deep\': {\'flags\': [True, False, None]}}, limit=-5, min_score=1e-3)]',
     None, [("search", {"query": 'it\'s "quoted"',
                        "filters": {"tags": ["a", "b"], "range": [1, 2.5],
                                    "deep": {"flags": [True, False, None]}},
                        "limit": -5, "min_score": 0.001})]),
    # a triple-quoted multi-line value holding a parenthesis and a bracket
    ("auto", "pythonic",
     '[write_file(path="a.py", content="""print(\'a)b\')\nx = [1]\\tdone""")]',
     None, [("write_file", {"path": "a.py", "content": "print('a)b')\nx = [1]\tdone"})]),
    # a trailing comma, over several lines
    ("auto", "pythonic", '[\n  get_weather(city="Paris"),\n  get_time(tz="CET"),\n]', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    # no arguments; content after the list
    ("auto", "pythonic", '[get_time()]\nI will tell you once I know.',
     "I will tell you once I know.", [("get_time", {})]),
    # cut off before the closing "]" (untagged) and before <|python_end|> (tagged)
    ("auto", "pythonic", '[get_weather(city="Oslo"), get_time(tz="UTC")', None,
     [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "UTC"})]),
    ("auto", "pythonic", '<|python_start|>[get_time(tz="UTC")]', None,
     [("get_time", {"tz": "UTC"})]),
    # plain answers that start like a list but are none
    ("auto", "pythonic", "[1, 2, 3] are the first three.", "[1, 2, 3] are the first three.",
     []),
    ("auto", "pythonic", "[Note] get_weather(city) needs a city.",
     "[Note] get_weather(city) needs a city.", []),
    ("auto", "pythonic", "[see the docs](https://example.com/f(x)=1)",
     "[see the docs](https://example.com/f(x)=1)", []),
    ("auto", "pythonic", "  []", "  []", []),
    ("auto", "pythonic", "The sum is 4. [get_weather(city='Rome')] was not needed.",
     "The sum is 4. [get_weather(city='Rome')] was not needed.", []),
    # --- qwen3_coder ---
    # Qwen3-Coder-30B-A3B-Instruct: one call, values typed by the tool's schema
    ("auto", "qwen3_coder",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
     "</function>\n</tool_call>",
     None, [("get_weather", {"city": "Paris", "days": 3, "metric": True})]),
    # content first, two parallel calls
    ("auto", "qwen3_coder",
     "I'll check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
     "</parameter>\n<parameter=hours>\nnull\n</parameter>\n</function>\n</tool_call>\n"
     "<tool_call>\n<function=calculator>\n<parameter=expression>\n12 * (3 + 4)\n"
     "</parameter>\n</function>\n</tool_call>",
     "I'll check both.",
     [("get_weather", {"city": "Oslo", "hours": None}),
      ("calculator", {"expression": "12 * (3 + 4)"})]),
    # a multi-line code value with quotes, backslashes, angle brackets and unicode
    ("auto", "qwen3_coder",
     '<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/é.py\n</parameter>\n'
     '<parameter=content>\nif a < b and "x" != \'y\':\n    print("naïve \\\\ <b>")\n'
     '</parameter>\n</function>\n</tool_call>',
     None, [("write_file", {
         "path": "src/é.py",
         "content": 'if a < b and "x" != \'y\':\n    print("naïve \\\\ <b>")'})]),
    # nested object and array values, a number, and a parameter the schema does not know
    ("auto", "qwen3_coder",
     '<tool_call>\n<function=search>\n<parameter=query>\n"exact phrase"\n</parameter>\n'
     '<parameter=filters>\n{"tags": ["a", "b"], "nested": {"deep": [1, {"x": null}]}}\n'
     '</parameter>\n<parameter=langs>\n["fr", "en"]\n</parameter>\n<parameter=min_score>'
     '\n0.75\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>',
     None, [("search", {"query": '"exact phrase"',
                        "filters": {"tags": ["a", "b"], "nested": {"deep": [1, {"x": None}]}},
                        "langs": ["fr", "en"], "min_score": 0.75, "extra": "42"})]),
    # no <tool_call> wrapper, values not closed by </parameter>, text after the call
    ("auto", "qwen3_coder",
     "<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>\n"
     "Checking now.", "Checking now.", [("get_weather", {"city": "Rome", "days": 2})]),
    # cut off mid-value (max_tokens): the call closes with the parameters it completed
    ("auto", "qwen3_coder",
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
     "<parameter=unit>\ncels",
     None, [("get_weather", {"city": "Lima"})]),
    # plain answers with angle brackets, and with the tag itself as a word
    ("auto", "qwen3_coder", "Use a < b, <b>bold</b> and <param> freely.",
     "Use a < b, <b>bold</b> and <param> freely.", []),
    ("auto", "qwen3_coder", "Wrap each call in <tool_call> tags.",
     "Wrap each call in <tool_call> tags.", []),
]


def _typed(args: str):
    """JSON arguments with each number's type kept (3 and 3.0 differ)."""
    return json.loads(args, parse_float=lambda s: ("float", float(s)),
                      parse_int=lambda s: ("int", int(s)))


def _id_shape(parser: str) -> re.Pattern:
    return MISTRAL_ID if parser == "mistral" else OPENAI_ID


@pytest.mark.parametrize("mode,parser,text,content,calls", RECORDED)
def test_whole_text_parse(mode, parser, text, content, calls):
    got_content, got = parse_tool_calls(text, mode, parser, named="get_weather", tools=TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert [_typed(c.arguments) for c in got] == [_typed(json.dumps(a)) for _, a in calls]
    assert len({c.id for c in got}) == len(got)
    assert all(_id_shape(parser).fullmatch(c.id) for c in got)


def _cuts(text: str):
    """The text in one piece, a character at a time, and cut at 25 random sets of points."""
    yield [text]
    yield list(text)
    for seed in range(25):
        rnd = random.Random(seed)
        cuts, i = [], 0
        while i < len(text):
            n = rnd.randint(1, 9)
            cuts.append(text[i:i + n])
            i += n
        yield cuts


def _stream(mode, parser, cuts, tools=TOOLS):
    """(streamed content, {index: {"id", "name", "args"}}, streamer) of one stream, checking
    that each call's header (index, id, type, name) comes before its arguments."""
    streamer = ToolCallStreamer(mode, parser, named="get_weather", tools=tools)
    deltas = [d for piece in cuts for d in streamer.feed(piece)] + streamer.finish()
    rebuilt: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            call = rebuilt.setdefault(tc["index"], {"args": ""})
            if "name" in tc["function"]:  # the first delta of a call: id, type, name
                assert "name" not in call and _id_shape(parser).fullmatch(tc["id"])
                assert tc["type"] == "function"
                call["name"], call["id"] = tc["function"]["name"], tc["id"]
            else:
                assert "name" in call, "arguments before the call's header"
            call["args"] += tc["function"]["arguments"]
    return "".join(d.get("content", "") for d in deltas), rebuilt, streamer


@pytest.mark.parametrize("mode,parser,text,content,calls", RECORDED)
def test_streamed_deltas_rebuild_the_same_calls_whatever_the_cuts(mode, parser, text,
                                                                   content, calls):
    for cuts in _cuts(text):
        streamed_content, rebuilt, streamer = _stream(mode, parser, cuts)
        got = [(c["name"], json.loads(c["args"])) for _, c in sorted(rebuilt.items())]
        assert got == calls
        assert [_typed(c["args"]) for _, c in sorted(rebuilt.items())] == \
            [_typed(json.dumps(a)) for _, a in calls]
        assert len({c["id"] for c in rebuilt.values()}) == len(rebuilt)
        assert streamer.made_calls == bool(calls)
        if calls:
            assert streamed_content.strip() == (content or "")
        else:
            assert streamed_content == text


def test_mistral_keeps_the_models_own_call_id():
    text = '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_time' \
           '[ARGS]{"tz": "CET"}'
    _, calls = parse_tool_calls(text, "auto", "mistral")
    assert calls[0].id == "a1B2c3D4e" and MISTRAL_ID.fullmatch(calls[1].id)
    _, rebuilt, _ = _stream("auto", "mistral", list(text))
    assert rebuilt[0]["id"] == "a1B2c3D4e" and rebuilt[1]["id"] != "a1B2c3D4e"


def test_qwen3_coder_streams_each_parameter_as_one_json_member():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    streamer = ToolCallStreamer("auto", "qwen3_coder", tools=TOOLS)
    pieces = [tc["function"]["arguments"] for ch in text for d in streamer.feed(ch)
              for tc in d.get("tool_calls", []) if "name" not in tc["function"]]
    assert pieces == ['{"city": "Paris"', ', "days": 3', "}"]
    for n in range(1, len(pieces)):  # each prefix is valid JSON once closed
        json.loads("".join(pieces[:n]) + "}")
    _, calls = parse_tool_calls(text, "auto", "qwen3_coder", tools=TOOLS)
    assert calls[0].arguments == "".join(pieces)


def test_pythonic_holds_a_possible_list_and_sends_a_call_as_soon_as_it_is_known():
    streamer = ToolCallStreamer("auto", "pythonic")
    assert streamer.feed(" <|python_st") == []  # may be the tag
    assert streamer.feed("art|>[get_weather") == []  # may be a call's name
    header = streamer.feed("(city=")  # the name is known: a call
    assert header[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert streamer.feed('"Pa)ris"') == []  # the ")" is inside a string
    args = streamer.feed(', days=2)')
    assert args == [{"tool_calls": [{"index": 0, "function": {
        "arguments": '{"city": "Pa)ris", "days": 2}'}}]}]
    assert streamer.feed("]<|python_end|>") + streamer.finish() == []


def test_pythonic_arguments_are_read_never_run():
    text = "[get_time(tz=__import__('os').getcwd())]"
    assert parse_tool_calls(text, "auto", "pythonic") == (text, [])
    for bad in ("[get_time('UTC')]", "[get_time(**{'tz': 'UTC'})]", "[get_time(tz=f'{x}')]",
                "[get_time(tz={1, 2})]", "[get_time(tz=1e999)]", "[get_time(tz=b'x')]"):
        assert parse_tool_calls(bad, "auto", "pythonic") == (bad, []), bad


def test_qwen3_coder_types_values_by_the_tools_schema():
    props = {"n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
             "obj": {"type": "object"}, "arr": {"type": "array"}, "s": {"type": "string"},
             "maybe": {"type": ["integer", "null"]}, "either": {"anyOf": [
                 {"type": "boolean"}, {"type": "string"}]}, "untyped": {}}
    tool = {"name": "f", "parameters": {"type": "object", "properties": props}}
    cases = [("n", "42", 42), ("n", "-7", -7), ("n", "3.0", 3), ("n", "many", "many"),
             ("n", "2.5", "2.5"), ("x", "2.5", 2.5), ("x", "1e3", 1000.0), ("x", "4", 4),
             ("x", "nan", "nan"), ("ok", "True", True), ("ok", "false", False),
             ("ok", "yes", "yes"), ("obj", '{"a": [1, null]}', {"a": [1, None]}),
             ("obj", "{'a': (1, True)}", {"a": [1, True]}), ("obj", "[1]", "[1]"),
             ("arr", '["a", 1]', ["a", 1]), ("arr", "not json", "not json"),
             ("s", "007", "007"), ("s", "true", "true"), ("maybe", "null", None),
             ("maybe", "5", 5), ("either", "false", False), ("either", "no", "no"),
             ("untyped", "12", "12"), ("unknown", "12", "12"),
             ("s", "\n\nkept\n\n", "\n\nkept\n\n")]
    for tools in ([tool], [{"type": "function", "function": tool}]):  # bare or OpenAI's
        for key, text, want in cases:
            # the value goes between one newline each side, which are not part of it
            out = f"<function=f>\n<parameter={key}>\n{text}\n</parameter>\n</function>"
            _, calls = parse_tool_calls(out, "auto", "qwen3_coder", tools=tools)
            got = json.loads(calls[0].arguments)[key]
            assert (got, type(got)) == (want, type(want)), (key, text)
    _, calls = parse_tool_calls("<function=f>\n<parameter=n>\n42\n</parameter>\n</function>",
                                "auto", "qwen3_coder")  # no tools: every value a string
    assert json.loads(calls[0].arguments) == {"n": "42"}


def test_malformed_tools_and_parser_names_are_errors_naming_the_field():
    with pytest.raises(ValueError, match=r"tools\.1"):
        parse_tool_calls("<function=f>\n</function>", "auto", "qwen3_coder",
                         tools=[{"name": "f"}, "f"])
    with pytest.raises(ValueError, match="tool_call_parser"):
        pick_parser("mistral_v2", None)
    odd = [{"name": "f", "parameters": {"properties": "none"}}, {"function": 3}, {}]
    _, calls = parse_tool_calls("<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",
                                "auto", "qwen3_coder", tools=odd)
    assert json.loads(calls[0].arguments) == {"a": "1"}


# Excerpts of the chat templates each family ships (tokenizer_config.json / .jinja).
TEMPLATES = {
    "mistral": [  # Mistral-7B-Instruct-v0.3; Mistral-Small-3.2-24B-Instruct
        '{%- elif message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}{%- for tool_call in '
        'message.tool_calls %}{{- {"name": tool_call.function.name, "arguments": '
        'tool_call.function.arguments, "id": tool_call.id}|tojson }}',
        "{%- for tool in message['tool_calls'] %}{{- '[TOOL_CALLS]' + tool['function']['name']"
        " + '[ARGS]' + arguments }}{%- endfor %}",
    ],
    "qwen3_coder": [  # Qwen3-Coder-30B-A3B-Instruct (it also writes <tool_call>)
        "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- for args_name, "
        "args_value in tool_call.arguments|items %}{{- '<parameter=' + args_name + '>\\n' }}",
    ],
    "pythonic": [  # Llama-3.2 (vLLM's pythonic template); Llama-4-Scout
        "If you decide to invoke any of the function(s), you MUST put it in the format of "
        "[func_name1(params_name1=params_value1, params_name2=params_value2...), "
        "func_name2(params)]\nYou SHOULD NOT include any other text in the response.",
        "{%- if message.tool_calls %}{{- '<|python_start|>' }}{%- for tool_call in "
        "message.tool_calls %}{{- tool_call.function.name + '(' }}",
    ],
    "llama3_json": [  # Llama-3.1-8B-Instruct
        "{{- \"Environment: ipython\\n\" }}{%- if builtin_tools is defined %}{{- '<|python_tag|>'"
        " + tool_call.name + '.call(' }}",
    ],
    "hermes": [  # Qwen2.5-7B-Instruct; a template without tools
        "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}",
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    ],
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_parser_is_picked_from_the_chat_template(family):
    for template in TEMPLATES[family]:
        assert pick_parser("auto", template) == family, template


def test_a_named_parser_overrides_the_template():
    assert pick_parser("auto", None) == "hermes"
    assert pick_parser("llama3_json", "<tool_call>") == "llama3_json"
    for parser in PARSERS:
        assert pick_parser(parser, TEMPLATES["mistral"][0]) == parser
    assert [p for p in PARSERS if keeps_special_tokens(p)] == ["mistral"]


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


def test_required_schema_keeps_each_tools_refs_pointing_into_its_own_parameters():
    """Regression: a tool's parameters moved under the array of calls with its ``$ref``s
    unchanged: pydantic's ``#/$defs/X`` pointed at nothing (a 400), and a recursive ``#``
    at the array, so the arguments could nest whole calls."""
    import jsonschema

    pydantic_like = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}},
                     "required": ["loc"], "$defs": {"Loc": {
                         "type": "object", "properties": {"lat": {"type": "number"}},
                         "required": ["lat"], "additionalProperties": False}}}
    recursive = {"type": "object", "additionalProperties": False, "required": ["child"],
                 "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                "tag": {"const": {"$ref": "#"}}}}  # data, not a reference
    schema = required_schema([{"name": "a", "parameters": pydantic_like},
                              {"name": "b", "parameters": recursive}], parallel=True)
    jsonschema.validate([{"name": "a", "parameters": {"loc": {"lat": 1.5}}},
                         {"name": "b", "parameters": {"child": {"child": None}}}], schema)
    for bad in ([{"name": "a", "parameters": {"loc": {"lat": "x"}}}],
                [{"name": "b", "parameters": {"child": [{"name": "b", "parameters": {
                    "child": None}}]}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert schema["$defs"]["tool1"]["properties"]["tag"] == {"const": {"$ref": "#"}}


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


def _assert_stream_agrees_with_whole_parse(parser: str, text: str, rnd: random.Random):
    """The calls streamed with complete JSON arguments are the whole parse's, to the
    character; so is the content where there are calls, and all of it where there are none
    (a call cut off mid-arguments: whole, it is dropped; streamed, its JSON stays open)."""
    content, calls = parse_tool_calls(text, "auto", parser, tools=TOOLS)
    pieces, i = [], 0
    while i < len(text):
        n = rnd.randint(1, 6)
        pieces.append(text[i:i + n])
        i += n
    streamed, rebuilt, _ = _stream("auto", parser, pieces)
    complete = [(c["name"], c["args"]) for _, c in sorted(rebuilt.items())
                if _is_json(c["args"])]
    assert complete == [(c.name, c.arguments) for c in calls], text
    if calls:
        assert streamed.strip() == (content or ""), text
    else:
        assert content == text, text
        if not rebuilt:
            assert streamed == text, text


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


AUTO_SCANNED = [(r[1], r[2]) for r in RECORDED if r[0] == "auto" and r[1] in _SCANNED]


@pytest.mark.parametrize("parser,text", AUTO_SCANNED)
def test_an_output_cut_anywhere_streams_the_calls_its_whole_parse_finds(parser, text):
    """max_tokens may stop an output anywhere."""
    rnd = random.Random(len(text))
    for end in range(len(text) + 1):
        _assert_stream_agrees_with_whole_parse(parser, text[:end], rnd)


@pytest.mark.parametrize("parser", _SCANNED)
def test_garbled_outputs_stream_what_their_whole_parse_finds(parser):
    """Recorded outputs with random edits (markers of every format spliced in, characters
    dropped): never an error, and streaming agrees with the whole parse."""
    splices = list('[]{}()<>="\',:\\ \n') + [
        "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_start|>", "<|python_end|>",
        "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
        "</parameter>", "get_time(", "tz=", '"""', "True", "get_time"]
    texts = [text for _, text in AUTO_SCANNED]
    rnd = random.Random(parser)
    for _ in range(400):
        text = list(rnd.choice(texts))
        for _ in range(rnd.randint(1, 4)):
            at = rnd.randrange(len(text) + 1)
            text[at:at + rnd.randint(0, 3)] = rnd.choice(splices)
        _assert_stream_agrees_with_whole_parse(parser, "".join(text), rnd)


@pytest.mark.parametrize("parser,text", [
    ("hermes", "Use <tool_call> tags to call tools. Bye."),  # a tag in prose
    ("hermes", '<tool_call>{"answer": 42}</tool_call>'),  # an object naming no call
    ("hermes", 'Ok <tool_call>{"tool": "x"}</tool_call> then.'),
    ("llama3_json", '{"answer": 42}'),
])
def test_text_that_names_no_call_streams_as_the_content_it_is(parser, text):
    """Regressions: a hermes tag in prose swallowed the rest of the stream, and an object
    without a name opened an invisible call (finish "tool_calls", no call, no content);
    whole, such text is content, and streamed it now is too, however it is cut."""
    assert parse_tool_calls(text, "auto", parser) == (text, [])
    for cuts in _cuts(text):
        streamed, rebuilt, streamer = _stream("auto", parser, cuts)
        assert (streamed, rebuilt, streamer.made_calls) == (text, {}, False), cuts


@pytest.mark.parametrize("mode,parser,text,cuts", [
    # a close tag cut between deltas; text after the call then a name-like object
    ("auto", "hermes", '<tool_call>{"name":"get_time","arguments":{}}</tool_call>\nNow '
     '{"name": "search"} done.', [48, 54]),
    # the tag, then spaces in their own delta, then the call
    ("auto", "llama3_json", '<|python_tag|>\n{"name": "get_time", "parameters": {}}', [15]),
    # no arguments given: "{}", as the whole parse says, not ""
    ("auto", "hermes", '<tool_call>{"name": "get_time"}</tool_call>', []),
    ("auto", "llama3_json", '{"name": "get_time"}', []),
    ("required", "hermes", '[{"name": "get_time"}]', []),
    # arguments written as a JSON string: its text, as the whole parse reads it
    ("auto", "hermes", '<tool_call>{"name":"get_time","arguments":"{\\"tz\\": \\"UTC\\"}"}'
     '</tool_call>', [30, 40]),
    ("auto", "llama3_json", '{"name":"get_time","parameters":"{\\"tz\\": \\"UTC\\"}"}', [33]),
    # a nameless object before a call: the call is index 0
    ("auto", "hermes", '<tool_call>{"tool":"x"}</tool_call><tool_call>{"name":"get_time",'
     '"arguments":{"tz":"UTC"}}</tool_call>', [20]),
])
def test_streamed_calls_equal_the_whole_parse_at_awkward_cuts(mode, parser, text, cuts):
    _, calls = parse_tool_calls(text, mode, parser)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    _, rebuilt, _ = _stream(mode, parser, pieces)
    assert [(c["name"], json.loads(c["args"])) for _, c in sorted(rebuilt.items())] == \
        [(c.name, json.loads(c.arguments)) for c in calls]
    assert sorted(rebuilt) == list(range(len(calls)))


@pytest.mark.parametrize("mode,parser", [("auto", "hermes"), ("auto", "llama3_json"),
                                         ("required", "hermes")])
def test_deeply_nested_output_is_content_not_an_error(mode, parser):
    """Regression: a model repeating "[" until max_tokens made the whole parse raise
    RecursionError (a 500); it is now text that parses to no call."""
    text = ("<tool_call>" if parser == "hermes" and mode == "auto" else "") + "[" * 5000
    content, calls = parse_tool_calls(text, mode, parser)
    assert calls == [] and content == text


def test_a_hermes_output_cut_inside_its_close_tag_keeps_its_call():
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}} </tool_c',
                                      "auto", "hermes")
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", "{}")]


def test_the_config_accepts_every_parser():
    from typing import get_args

    from kvray.config import ServerConfig

    allowed = get_args(ServerConfig.model_fields["tool_call_parser"].annotation)
    assert set(allowed) == {"auto", *PARSERS}
