"""Reasoning output (``reasoning_parser``): a thinking model's ``<think>…</think>`` split from
its answer exactly at the markers, whole and however the text is cut into deltas; the
prompt's end decides where the output starts (``enable_thinking: false`` through
``chat_template_kwargs`` closes the block); structured outputs constrain the answer only
(the engine's grammar waits for ``</think>``); and through the OpenAI app on a real engine
with a thinking chat template built for the tests, streamed equals whole equals the raw
output split at its first ``</think>``."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient

from kvray.config import ServerConfig
from kvray.sampling_params import ReasoningSpan, StructuredOutputsParams
from kvray.serve.reasoning import (
    ReasoningSplitter,
    prompt_state,
    split_reasoning,
    starts_in_reasoning,
)
from tests.helpers.tiny_models import VOCAB_SIZE, build_tokenizer, make_tiny_model

# (begins, output text, reasoning (None: no block), answer)
RECORDED = [
    # Qwen3-8B, thinking on: the output opens the block
    (None, "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\n2 + 2 = **4**.",
     "\nThe user asks for 2+2. That is 4.\n", "\n\n2 + 2 = **4**."),
    # Qwen3 2507 Thinking / DeepSeek-R1: the prompt opened it, the output only closes it
    (True, "Okay, so 3 < 5 and </thin is not a tag.\n</think>\n\nYes: 3 < 5.",
     "Okay, so 3 < 5 and </thin is not a tag.\n", "\n\nYes: 3 < 5."),
    # R1 distill that opens the block again itself, blank line first
    (True, "\n<think>\nHmm, 日本語 🙂.\n</think>\nAnswer", "\nHmm, 日本語 🙂.\n", "\nAnswer"),
    # Qwen3 without a block: all answer, even a later </think>
    (None, "Just an answer. </think> stays.", None, "Just an answer. </think> stays."),
    # cut off while thinking: all reasoning, no answer
    (True, "Let me think about <thi", "Let me think about <thi", ""),
    (None, "<think>still going", "still going", ""),
    # thinking turned off in the prompt: never reasoning
    (False, "<think>not a block</think>x", None, "<think>not a block</think>x"),
    # an empty block
    (None, "<think></think>{\"a\": 1}", "", "{\"a\": 1}"),
    # a second block stays in the answer
    (True, "a</think>b<think>c</think>d", "a", "b<think>c</think>d"),
    # only blanks
    (None, "  \n", None, "  \n"),
]


def _cuts(text: str, rng: random.Random) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@pytest.mark.unit
@pytest.mark.parametrize("case", range(len(RECORDED)))
def test_split_is_exact_at_the_markers_however_the_text_is_cut(case):
    begins, text, reasoning, answer = RECORDED[case]
    assert split_reasoning(text, begins) == (reasoning, answer)
    rng = random.Random(case)
    cuts = [[text[i:i + 1] for i in range(len(text))]] + [_cuts(text, rng) for _ in range(200)]
    for pieces in cuts:
        splitter = ReasoningSplitter(begins)
        got_r, got_a = "", ""
        for piece in pieces:
            r, a = splitter.feed(piece)
            got_r, got_a = got_r + r, got_a + a
        r, a = splitter.finish()
        assert (got_r + r, got_a + a) == (reasoning or "", answer), pieces


@pytest.mark.unit
def test_no_marker_text_leaks_while_it_may_still_be_a_marker():
    splitter = ReasoningSplitter(True)
    assert splitter.feed("so </thi") == ("so ", "")  # held: may become </think>
    assert splitter.feed("nk>ok") == ("", "ok")
    splitter = ReasoningSplitter(None)
    assert splitter.feed(" <thi") == ("", "")
    assert splitter.feed("s is text") == ("", " <this is text")


@pytest.mark.unit
@pytest.mark.parametrize(("tail", "parser", "begins"), [
    ("<|im_start|>assistant\n", "qwen3", None),
    ("<|im_start|>assistant\n", "deepseek_r1", True),
    ("<|im_start|>assistant\n<think>\n", "qwen3", True),
    ("<｜Assistant｜><think>\n", "deepseek_r1", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "qwen3", False),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "deepseek_r1", False),
])
def test_the_prompt_end_decides_where_the_output_starts(tail, parser, begins):
    assert starts_in_reasoning(parser, prompt_state(tail)) is begins


# ---- the engine's grammar waits for the end of the reasoning -------------------------------
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif think_in_prompt is defined and think_in_prompt %}<think>\n{% endif %}{% endif %}"
)


def _thinking_tokenizer():
    tok = build_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = THINKING_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """A tiny random Llama whose tokenizer has <think> / </think> as single tokens and a
    chat template that opens (think_in_prompt) or closes (enable_thinking false) a block."""
    path = make_tiny_model("llama_gqa", tmp_path_factory.mktemp("thinking"),
                           vocab_size=VOCAB_SIZE + 8)
    _thinking_tokenizer().save_pretrained(path)
    return path


def _mask_row(compiler, matcher) -> torch.Tensor:
    from kvray.structured_output import bitmask_width

    mask = torch.full((1, bitmask_width(compiler.vocab_size)), -1, dtype=torch.int32)
    compiler.fill_bitmask([(matcher, 0)], mask)
    return mask[0]


def _allowed(row: torch.Tensor, tok: int) -> bool:
    return bool((int(row[tok // 32]) >> (tok % 32)) & 1)


@pytest.mark.unit
def test_grammar_applies_after_the_reasoning_and_rolls_back_across_it(thinking_model):
    from kvray.structured_output import GrammarCompiler, ReasoningGatedMatcher, _as_signed

    tok = _thinking_tokenizer()
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    compiler = GrammarCompiler(tok, VOCAB_SIZE + 8, (tok.eos_token_id,))
    params = StructuredOutputsParams(regex="[0-9]+")
    plain = compiler.compile(params)
    digits = _mask_row(compiler, plain)
    letter = tok.encode("x", add_special_tokens=False)[0]
    assert not _allowed(digits, letter)

    # the output may open a block first: the grammar's tokens and <think>, nothing else
    gated = ReasoningGatedMatcher(compiler.compile(params), ReasoningSpan((end,), start_id=start))
    row = _mask_row(compiler, gated)
    assert _allowed(row, start) and not _allowed(row, letter)
    expected = digits.clone()
    expected[start // 32] = _as_signed(int(expected[start // 32]) | 1 << (start % 32))
    assert torch.equal(row, expected)
    assert gated.accept([start]) and gated.phase == "reasoning"
    assert torch.all(_mask_row(compiler, gated) == -1)  # reasoning: anything goes
    assert gated.accept([letter, letter, end]) and gated.phase == "answer"
    assert torch.equal(_mask_row(compiler, gated), digits)
    one = tok.encode("1", add_special_tokens=False)[0]
    assert gated.accept([one])
    gated.rollback(2)  # back across the end marker: reasoning again, the grammar unwound
    assert gated.phase == "reasoning" and torch.all(_mask_row(compiler, gated) == -1)
    assert gated.accept([end, one]) and gated.phase == "answer"
    assert not gated.accept([letter])  # a letter after the reasoning breaks the grammar

    # opened in the prompt: reasoning from the first token; no block possible: plain grammar
    opened = ReasoningGatedMatcher(compiler.compile(params), ReasoningSpan((end,), opened=True))
    assert opened.accept([letter, end]) and opened.phase == "answer"
    closed = ReasoningGatedMatcher(compiler.compile(params), ReasoningSpan((end,)))
    assert torch.equal(_mask_row(compiler, closed), digits)


# ---- through the OpenAI app on a real engine ---------------------------------------------
@pytest.fixture(scope="module")
def engine(thinking_model):
    from kvray.config import config_from_flat
    from kvray.engine.async_engine import AsyncLLM

    llm = AsyncLLM(config_from_flat({"model": str(thinking_model), "dtype": "float32",
                                     "block_size": 4, "max_model_len": 256,
                                     "num_gpu_blocks_override": 256}))
    yield llm
    llm.shutdown()


def _client(engine, parser: str) -> TestClient:
    from kvray.serve.openai_app import OpenAIServer

    return TestClient(OpenAIServer(engine, "m", 256,
                                   limits=ServerConfig(reasoning_parser=parser)).app)


@pytest.fixture(scope="module")
def clients(engine):
    return {p: _client(engine, p) for p in ("none", "qwen3", "deepseek_r1")}


def _events(resp) -> list[dict]:
    lines = [ln.removeprefix("data: ") for ln in resp.text.split("\n\n") if ln]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _streamed(client, body: dict) -> tuple[str | None, str | None]:
    resp = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    reasoning, content = None, None
    for chunk in _events(resp):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content")  # both names
            if delta.get("reasoning_content") is not None:
                reasoning = (reasoning or "") + delta["reasoning_content"]
            if delta.get("content"):
                content = (content or "") + delta["content"]
    return reasoning, content


def _body(tok, **extra) -> dict:
    end = tok.convert_tokens_to_ids("</think>")
    return {"messages": [{"role": "user", "content": "Is 3 < 5?"}], "max_tokens": 40,
            "temperature": 1.0, "seed": 7, "logit_bias": {str(end): 5.0}, **extra}


@pytest.mark.serve
@pytest.mark.parametrize("seed", [1, 7, 11])
def test_streamed_and_whole_split_the_raw_output_at_its_first_end_marker(clients, seed):
    tok = _thinking_tokenizer()
    body = {**_body(tok, chat_template_kwargs={"think_in_prompt": True}), "seed": seed}
    raw = clients["none"].post("/v1/chat/completions", json=body).json()
    text = raw["choices"][0]["message"]["content"]
    assert "reasoning_content" not in raw["choices"][0]["message"]
    assert "</think>" in text  # the bias makes the model close its block
    for parser in ("qwen3", "deepseek_r1"):
        whole = clients[parser].post("/v1/chat/completions", json=body).json()
        message = whole["choices"][0]["message"]
        reasoning, _, answer = text.partition("</think>")
        assert message["reasoning_content"] == message["reasoning"] == reasoning  # vLLM's
        assert message["content"] == (answer or None)
        streamed_reasoning, streamed_answer = _streamed(clients[parser], body)
        assert (streamed_reasoning or "", streamed_answer) == (reasoning, answer or None)
        assert whole["usage"] == raw["usage"]


@pytest.mark.serve
def test_enable_thinking_false_reaches_the_template_and_means_no_reasoning(clients):
    tok = _thinking_tokenizer()
    body = _body(tok, chat_template_kwargs={"enable_thinking": False})
    ids = clients["qwen3"].post("/tokenize", json={
        "messages": body["messages"], "chat_template_kwargs": {"enable_thinking": False}}
    ).json()["tokens"]
    assert tok.decode(ids[-6:]).endswith("<think>\n\n</think>\n\n")
    raw = clients["none"].post("/v1/chat/completions", json=body).json()
    for parser in ("qwen3", "deepseek_r1"):
        message = clients[parser].post("/v1/chat/completions", json=body).json()[
            "choices"][0]["message"]
        assert "reasoning_content" not in message
        assert message["content"] == raw["choices"][0]["message"]["content"]


@pytest.mark.serve
def test_include_reasoning_false_drops_the_reasoning_only(clients):
    tok = _thinking_tokenizer()
    body = _body(tok, chat_template_kwargs={"think_in_prompt": True})
    full = clients["qwen3"].post("/v1/chat/completions", json=body).json()
    cut = clients["qwen3"].post("/v1/chat/completions",
                                json={**body, "include_reasoning": False}).json()
    assert "reasoning_content" not in cut["choices"][0]["message"]
    assert cut["choices"][0]["message"]["content"] == full["choices"][0]["message"]["content"]
    reasoning, _ = _streamed(clients["qwen3"], {**body, "include_reasoning": False})
    assert reasoning is None


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"], "additionalProperties": False}


@pytest.mark.serve
@pytest.mark.parametrize("bias", [100.0, 4.0])
def test_structured_output_constrains_the_answer_after_free_reasoning(clients, bias):
    tok = _thinking_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    body = {**_body(tok, chat_template_kwargs={"think_in_prompt": True}),
            "logit_bias": {str(end): bias}, "max_tokens": 120,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "a", "schema": SCHEMA}}}
    answered_after_thought = 0
    for seed in (1, 2, 3, 4):
        message = clients["qwen3"].post("/v1/chat/completions", json={**body, "seed": seed}
                                        ).json()["choices"][0]["message"]
        if message["content"] is None:  # still thinking when max_tokens ran out
            assert bias < 100
            continue
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
        if bias == 100.0:
            assert message["reasoning_content"] == ""
        answered_after_thought += bool(message["reasoning_content"])
        reasoning, content = _streamed(clients["qwen3"], {**body, "seed": seed})
        assert (reasoning or "", content) == (message["reasoning_content"], message["content"])
    assert bias == 100.0 or answered_after_thought  # the free-reasoning path was taken


@pytest.mark.serve
@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
    {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
     "tool_choice": "required"},
])
def test_constrained_output_when_the_prompt_opens_no_block(clients, extra):
    """Regression: the output may still open a block, so the gate's mask lets <think> in;
    that bit was written on the mask thread outside inference mode and the engine step
    failed (a 503, every request in flight aborted)."""
    tok = _thinking_tokenizer()
    start = tok.convert_tokens_to_ids("<think>")
    for bias in (0.0, 100.0):  # the answer at once / a block opened by the output
        body = {**_body(tok), "logit_bias": {str(start): bias}, "max_tokens": 60, **extra}
        resp = clients["qwen3"].post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        message = resp.json()["choices"][0]["message"]
        if bias:
            assert message["reasoning_content"] is not None
        if message["content"] is not None and "tools" not in extra:
            json.loads(message["content"])


@pytest.mark.serve
@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tools": []}, "chat_template_kwargs.tools"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"not a name": 1}, "chat_template_kwargs.not a name"),
])
def test_chat_template_kwargs_the_server_sets_are_400s_naming_the_key(clients, kwargs, param):
    tok = _thinking_tokenizer()
    resp = clients["qwen3"].post("/v1/chat/completions",
                                 json=_body(tok, chat_template_kwargs=kwargs))
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == param


@pytest.mark.serve
def test_responses_carry_the_reasoning_as_a_reasoning_item(clients):
    tok = _thinking_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    body = {"input": "Is 3 < 5?", "max_output_tokens": 40, "temperature": 1.0, "seed": 7,
            "logit_bias": {str(end): 5.0}, "chat_template_kwargs": {"think_in_prompt": True}}
    chat = clients["qwen3"].post("/v1/chat/completions", json={
        **{k: v for k, v in body.items() if k not in ("input", "max_output_tokens")},
        "messages": [{"role": "user", "content": "Is 3 < 5?"}], "max_tokens": 40}).json()
    message = chat["choices"][0]["message"]
    whole = clients["qwen3"].post("/v1/responses", json=body).json()
    kinds = [item["type"] for item in whole["output"]]
    assert kinds[0] == "reasoning"
    assert whole["output"][0]["content"][0]["text"] == message["reasoning_content"]
    text = "".join(part["text"] for item in whole["output"] if item["type"] == "message"
                   for part in item["content"])
    assert text == (message["content"] or "")
    resp = clients["qwen3"].post("/v1/responses", json={**body, "stream": True})
    events = [json.loads(line.removeprefix("data: ")) for line in resp.text.split("\n")
              if line.startswith("data: ")]
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, answer) == (message["reasoning_content"], message["content"] or "")
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert [i["type"] for i in events[-1]["response"]["output"]] == kinds
