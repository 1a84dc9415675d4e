"""Structured outputs: constraints parsed from every request field that carries one, compiled
once (invalid ones rejected naming the field), and enforced token by token — on the built-in
model for twenty JSON schemas sampled at temperature 1, regexes and choices, batched with
unconstrained requests that must not change, with n > 1, stop strings, logprobs, and through
preemption by recompute and by swap."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvray import LLM, SamplingParams
from kvray.errors import InvalidRequestError
from kvray.kernels.sampling import apply_bitmask_
from kvray.sampling_params import StructuredOutputsParams
from kvray.serve.protocol import ChatCompletionRequest, CompletionRequest
from kvray.structured_output import GrammarCompiler, bitmask_width
from tests.helpers.skips import builtin_model_or_skip
from tests.helpers.structured_schemas import SCHEMAS
from tests.helpers.tiny_models import VOCAB_SIZE, build_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]


# ---- parameters and the request fields that carry them ------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("kwargs", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []},
                                    {"choice": ["a", ""]}, {"json": "{not json"},
                                    {"json": [1]}, {"grammar": "  "}])
def test_malformed_constraints_name_the_field(kwargs):
    with pytest.raises(ValueError, match="^guided_x"):
        StructuredOutputsParams(**kwargs, field="guided_x")


@pytest.mark.unit
@pytest.mark.parametrize("body,kind,field", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "w", "schema": {"type": "integer"}}}},
     "json", "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", "b"], "backend": "auto"}}, "choice",
     "structured_outputs"),
    ({"guided_json": '{"type": "string"}'}, "json", "guided_json"),
    ({"guided_regex": "x+"}, "regex", "guided_regex"),
    ({"guided_choice": ["y", "n"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'start: "a"'}, "grammar", "guided_grammar"),
])
def test_every_request_field_maps_to_one_constraint(body, kind, field):
    for request in (ChatCompletionRequest(messages=MESSAGES, **body),
                    CompletionRequest(prompt="x", **body)):
        params = request.sampling_params(16, None).structured_outputs
        assert params.kind == kind and params.field == field
    plain = ChatCompletionRequest(messages=MESSAGES, response_format={"type": "text"})
    assert plain.sampling_params(16, None).structured_outputs is None


@pytest.mark.unit
@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
])
def test_conflicting_or_malformed_request_fields_are_400s_naming_them(body, param):
    with pytest.raises(InvalidRequestError) as err:
        ChatCompletionRequest(messages=MESSAGES, **body).sampling_params(16, None)
    assert err.value.param == param and str(err.value).startswith(param)


# ---- the compiler and the bitmask -----------------------------------------------------------
@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(build_tokenizer(), VOCAB_SIZE, (2,))


@pytest.mark.unit
@pytest.mark.parametrize("params", [
    StructuredOutputsParams(regex="a(b", field="guided_regex"),
    StructuredOutputsParams(json={"type": "nonsense"}, field="guided_regex"),
    StructuredOutputsParams(json={"type": "string", "pattern": "(("}, field="guided_regex"),
    StructuredOutputsParams(grammar="start: undefined_rule", field="guided_regex"),
])
def test_invalid_grammars_are_rejected_naming_the_field(compiler, params):
    with pytest.raises(InvalidRequestError, match="^guided_regex: invalid") as err:
        compiler.compile(params)
    assert err.value.param == "guided_regex"


def _allowed(bitmask: torch.Tensor, row: int) -> list[int]:
    return [t for t in range(VOCAB_SIZE) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1]


@pytest.mark.unit
def test_matchers_from_one_cached_grammar_keep_their_own_state(compiler):
    tok = build_tokenizer()
    params = StructuredOutputsParams(choice=["hello", "world"])
    first, second = compiler.compile(params), compiler.compile(params)
    assert first.accept(tok.encode("hello", add_special_tokens=False))
    assert first.is_terminated and not second.is_terminated
    bitmask = torch.zeros(3, bitmask_width(VOCAB_SIZE), dtype=torch.int32)
    compiler.fill_bitmask([(first, 0), (second, 2)], bitmask)
    assert _allowed(bitmask, 0) == [2]  # only EOS after a complete output
    assert _allowed(bitmask, 1) == []  # rows not asked for are left alone
    firsts = {tok.decode([t]) for t in _allowed(bitmask, 2)}
    assert firsts and all("hello".startswith(s) or "world".startswith(s) for s in firsts)
    assert not second.accept(tok.encode("x", add_special_tokens=False))  # breaks the grammar
    compiler.fill_bitmask([(second, 1)], bitmask)
    assert _allowed(bitmask, 1) == [2]  # a broken sequence may only end


def _walk(compiler, params: StructuredOutputsParams, seed: int, limit: int = 40) -> str:
    """A random walk over the grammar's masks (a random model at temperature one): the
    text of the tokens it takes until only EOS is left."""
    tok = build_tokenizer()
    matcher, rnd = compiler.compile(params), torch.Generator().manual_seed(seed)
    bitmask = torch.zeros(1, bitmask_width(VOCAB_SIZE), dtype=torch.int32)
    ids: list[int] = []
    for _ in range(limit):
        compiler.fill_bitmask([(matcher, 0)], bitmask)
        allowed = [t for t in _allowed(bitmask, 0) if t != 2]
        if not allowed:
            break
        ids.append(allowed[int(torch.randint(len(allowed), (1,), generator=rnd))])
        assert matcher.accept(ids[-1:])
    return tok.decode(ids)


@pytest.mark.unit
def test_gbnf_unicode_escapes_mean_their_characters(compiler):
    """Regression: llguidance's GBNF converter dropped the escapes' leading zeros, so
    ``"\u0041bc"`` became U+41BC and ``[\u00e9-\u00ff]`` an error about text the user never
    wrote; an escaped backslash before a ``u`` stays text."""
    cases = [('root ::= "\\u0041bc"', "^Abc$"), ('root ::= "x\\U0001F600"', "^x\U0001F600$"),
             ('root ::= [\\u00e9-\\u00ff] [\\u0030-\\u0039]', "^[\u00e9-\u00ff][0-9]$"),
             ('root ::= "a\\\\u0041"', "^a\\\\u0041$")]
    for grammar, want in cases:
        for seed in range(3):
            text = _walk(compiler, StructuredOutputsParams(grammar=grammar), seed)
            assert re.match(want, text), (grammar, text)


@pytest.mark.unit
def test_lark_rules_with_modifiers_are_lark_and_gbnf_is_told_by_its_rules(compiler):
    """Regression: llguidance took a Lark grammar starting ``?start:`` (vLLM's own SQL
    example) for GBNF and refused it; a GBNF grammar is one with ``::=`` rules."""
    lark = '?start: "SELECT " col\n?col: "a" | "b"'
    for seed in range(3):
        assert _walk(compiler, StructuredOutputsParams(grammar=lark), seed) in (
            "SELECT a", "SELECT b")
    gbnf = 'root ::= "start: " [xy]'  # Lark-looking text inside a GBNF literal
    assert _walk(compiler, StructuredOutputsParams(grammar=gbnf), 0) in ("start: x",
                                                                           "start: y")


@pytest.mark.unit
def test_objects_take_only_the_properties_their_schema_names(compiler):
    """vLLM's default backend (xgrammar, strict) never adds keys a schema does not name;
    kvray's grammar let a model add any (``{"a": 1, "b": 25}``). Objects that say
    otherwise (additionalProperties, patternProperties) and allOf members keep their rule."""
    from kvray.structured_output import _closed

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "$defs": {"D": {"properties": {"properties": {"type": "string"}}}},
              "allOf": [{"properties": {"a": {}}}],
              "anyOf": [{"properties": {"x": {}}, "additionalProperties": True}, {}]}
    closed = _closed(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert closed["$defs"]["D"]["properties"] == {"properties": {"type": "string"}}
    assert "additionalProperties" not in closed["allOf"][0]
    assert closed["anyOf"][0]["additionalProperties"] is True
    for needs_more in ({"properties": {"a": {}}, "required": ["a", "b"]},
                       {"properties": {"a": {}}, "minProperties": 2}):
        assert "additionalProperties" not in _closed(needs_more)
    params = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}}, disable_any_whitespace=False)
    for seed in range(6):
        text = _walk(compiler, params, seed, limit=60)
        if text.rstrip().endswith("}"):
            assert set(json.loads(text)) <= {"a"}, text


@pytest.mark.unit
def test_schemas_differing_only_in_key_order_compile_apart(compiler):
    """Regression: the grammar cache keyed schemas with sorted keys, so a schema asking for
    "reasoning" before "answer" reused the reverse order's grammar."""
    props = {"reasoning": {"const": "r"}, "answer": {"const": "a"}}
    first = {"type": "object", "properties": props, "required": ["reasoning", "answer"]}
    second = {**first, "properties": dict(reversed(props.items()))}
    for schema in (second, first):
        text = _walk(compiler, StructuredOutputsParams(json=schema), 0)
        assert list(json.loads(text)) == list(schema["properties"])


@pytest.mark.unit
def test_a_clients_llguidance_options_do_not_reach_the_grammar(compiler):
    """Regression: a schema's own ``x-guidance`` key went to llguidance, and
    ``{"item_separator": ";"}`` made the output something other than JSON."""
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3,
              "x-guidance": {"item_separator": ";"}}
    text = _walk(compiler, StructuredOutputsParams(json=schema), 1)
    assert len(json.loads(text)) >= 2
    with pytest.raises(InvalidRequestError, match="unsatisfiable|Unsatisfiable"):
        compiler.compile(StructuredOutputsParams(json=False))  # a schema, matching nothing


@pytest.mark.unit
def test_bitmask_sets_exactly_the_disallowed_logits_to_minus_inf():
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 70, generator=g) < 0.3
    words = torch.zeros(3, bitmask_width(70), dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    logits = torch.randn(3, 70, generator=g)
    want = logits.masked_fill(~allowed, float("-inf"))
    apply_bitmask_(logits, bitmask)
    assert torch.equal(logits, want)


# ---- the engine on the built-in model ---------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    builtin_model_or_skip()
    engine = LLM(dtype="float32", max_num_seqs=32)
    yield engine
    engine.shutdown()


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.mark.engine
def test_twenty_schemas_sampled_at_temperature_one_always_validate_and_greedy_neighbours_are_unchanged(llm):  # noqa: E501
    plain = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(plain, _greedy(), use_tqdm=False)]
    prompts = [f"Reply with JSON for this schema: {json.dumps(s)}\n" for s in SCHEMAS]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=150,
                             structured_outputs={"json": s}) for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(prompts + plain, params + [_greedy()] * len(plain), use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs, strict=False):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert [o.outputs[0].token_ids for o in outs[len(SCHEMAS):]] == alone


@pytest.mark.engine
def test_regex_choice_json_object_and_grammar_hold_at_temperature_one(llm):
    cases = [
        ({"regex": r"[A-Z][a-z]{2,6} [0-9]{1,3}"}, lambda t: re.fullmatch(
            r"[A-Z][a-z]{2,6} [0-9]{1,3}", t)),
        ({"regex": r"(yes|no), because [a-z ]{5,20}\."}, lambda t: re.fullmatch(
            r"(yes|no), because [a-z ]{5,20}\.", t)),
        ({"choice": ["Paris", "London", "Rome"]}, lambda t: t in {"Paris", "London", "Rome"}),
        ({"grammar": 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/'},
         lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    ]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=c)
              for c, _ in cases for s in range(3)]
    outs = llm.generate(["Answer:"] * len(params), params, use_tqdm=False)
    for i, out in enumerate(outs):
        check = cases[i // 3][1]
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), \
            (cases[i // 3][0], out.outputs[0].text)


@pytest.mark.engine
def test_json_object_gives_an_object(llm):
    """Any JSON object: unbounded keys and strings, so greedy with a JSON-minded prompt in
    the model's chat format (at temperature 1, or on a bare prompt, a 135M model may still be
    writing its first key or number at max_tokens)."""
    prompt = ("<|im_start|>user\nGive me a JSON object with a \"name\" string and an \"id\" "
              "number.<|im_end|>\n<|im_start|>assistant\n")
    out = llm.generate(prompt, SamplingParams(
        temperature=0.0, max_tokens=80, structured_outputs={"json_object": True}),
        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


@pytest.mark.engine
def test_n_sequences_stop_strings_and_logprobs_with_a_constraint(llm):
    choice = ["alpha", "beta", "gamma", "delta"]
    out = llm.generate("Pick one:", SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=8, logprobs=2,
        structured_outputs={"choice": choice}), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for seq in out.outputs:
        assert seq.text in choice
        assert len(seq.logprobs) == len(seq.token_ids)
        assert all(tok in step for tok, step in zip(seq.token_ids, seq.logprobs, strict=True))
    stopped = llm.generate("Code:", SamplingParams(
        temperature=0.0, max_tokens=30, stop=[","],
        structured_outputs={"regex": "[a-z]{3,6},[0-9]{2}"}), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[a-z]{3,6}", stopped.text) and stopped.finish_reason == "stop"


@pytest.mark.engine
def test_invalid_constraint_is_rejected_before_the_request_is_queued(llm):
    with pytest.raises(InvalidRequestError, match="^structured_outputs: invalid regex"):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "(unclosed"}),
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


LONG_ARRAY = {"type": "array", "minItems": 6, "maxItems": 6, "items": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 100, "maximum": 999}},
    "required": ["x"], "additionalProperties": False}}


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constraints_survive_preemption(mode):
    """A cache too small for all at once: requests are preempted mid-output, resume with
    their matchers rebuilt from the tokens so far, and give the tokens of a roomy run.
    On the built-in weights dequantized to fp32: with int8 activations (the GGUF read in
    place) a prefill and a decode step of the same token differ by ulps (attention, norms),
    which flip activation roundings, and this 135M model's digit choices are near-ties (prefill
    vs decode log-probs differ by ~0.03 on average), so exact tokens after a recompute
    would test those ties, not the matchers."""
    builtin_model_or_skip()
    prompts = [f"JSON list {i}:" for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=70,
                             structured_outputs={"json": LONG_ARRAY})] * len(prompts)
    roomy = LLM(dtype="float32", quantization="none")
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    roomy.shutdown()
    tight = LLM(dtype="float32", quantization="none", block_size=4, num_gpu_blocks_override=24,
                preemption_mode=mode, enable_prefix_caching=False)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stats.num_preemptions > 0
    tight.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), LONG_ARRAY)


@pytest.mark.unit
def test_a_tokenizer_with_more_ids_than_the_model_has_logits_still_constrains():
    """Regression: a tokenizer one id past the model's vocabulary (transformers adds a GGUF's
    end-of-text token when the vocabulary lacks it) made llguidance refuse the compiler, and
    a mask row sized by the model's vocabulary would be too narrow for the tokenizer's ids.
    The masks now cover the tokenizer; the sampler reads the model's first ids."""
    tok = build_tokenizer()
    tok.add_tokens(["<|extra|>"], special_tokens=True)
    assert len(tok) == VOCAB_SIZE + 1
    compiler = GrammarCompiler(tok, VOCAB_SIZE, (2,))
    assert compiler.bitmask_words == bitmask_width(VOCAB_SIZE + 1)
    matcher = compiler.compile(StructuredOutputsParams(regex="ab+", field="regex"))
    bitmask = torch.full((1, compiler.bitmask_words), -1, dtype=torch.int32)
    compiler.fill_bitmask([(matcher, 0)], bitmask)
    logits = torch.zeros(1, VOCAB_SIZE)
    apply_bitmask_(logits, bitmask)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).startswith("a") for t in allowed), \
        [tok.decode([t]) for t in allowed]
