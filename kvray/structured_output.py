"""Structured outputs: grammars compiled once per constraint, one matcher per sequence, and
the per-step token bitmask the sampler applies.

The grammar engine is llguidance (Rust; PyPI ``llguidance``), behind this module's small
interface (:class:`GrammarCompiler`, :class:`Matcher`): JSON schemas, regexes, choices and
Lark/GBNF grammars all compile to one grammar format, masks are computed lazily per step
(no ahead-of-time automaton over the vocabulary, so a new schema costs milliseconds), the
wheel has no dependencies, and the mask of a batch is computed on Rust threads outside the
GIL — while the model's forward runs (see ``ModelRunner``).

A bitmask row holds one bit per token id (32 per int32, little-endian bits): 1 = allowed.
Rows of unconstrained sequences are all ones; :func:`kvray.kernels.sampling.apply_bitmask_`
applies it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from kvray.errors import InvalidRequestError
from kvray.sampling_params import (
    SCHEMA_DATA_KEYWORDS,
    ReasoningSpan,
    StructuredOutputsParams,
)
from kvray.tokenizer import load_tokenizer

_CACHE_SIZE = 256  # compiled grammars kept (LRU), per process
_compilers: dict[tuple, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(model_path: str, tokenizer_path: str | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...], tokenizer: Any = None) -> GrammarCompiler:
    """The process's compiler for this model's tokenizer: the engine (validating at
    admission) and an in-process worker share one, so the vocabulary is indexed once.
    ``tokenizer``: the Hugging Face tokenizer if the caller has it loaded."""
    key = (str(model_path), tokenizer_path, vocab_size, tuple(eos_token_ids))
    with _compilers_lock:
        if key not in _compilers:
            _compilers[key] = GrammarCompiler(
                tokenizer if tokenizer is not None else load_tokenizer(model_path,
                                                                       tokenizer_path),
                vocab_size, eos_token_ids)
        return _compilers[key]


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


class Matcher:
    """One sequence's position in its grammar: tokens go in, the next step's mask comes out."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept(self, token_ids: list[int]) -> bool:
        """Advance by ``token_ids``; False if one of them breaks the grammar (the matcher then
        allows only EOS: the sequence ends rather than run on unconstrained)."""
        return all(self._m.consume_token(tok) for tok in token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        self._m.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None

    @property
    def raw(self) -> Any:
        return self._m


class ReasoningGatedMatcher(Matcher):
    """A matcher whose grammar starts after the output's reasoning (a thinking model's
    ``<think>…</think>``, :class:`ReasoningSpan`): the reasoning is unconstrained, the
    grammar sees only the tokens after the closing marker. Before the first token, when the
    output may open a block, the opening token is allowed beside the grammar's first
    tokens (``allow_start``)."""

    def __init__(self, inner: Matcher, span: ReasoningSpan) -> None:
        super().__init__(inner.raw)
        self.span = span
        # "maybe": before the first token, the output may open a block; "reasoning";
        # "answer": the grammar applies.
        self.phase = "reasoning" if span.opened else (
            "maybe" if span.start_id is not None else "answer")
        self._history: list[tuple[str, bool]] = []  # per token: phase before it, to grammar
        self._tokens: list[int] = []

    @property
    def constrained(self) -> bool:
        """The next token's mask comes from the grammar (else every token is allowed)."""
        return self.phase != "reasoning"

    @property
    def allow_start(self) -> int | None:
        """A token to allow beside the grammar's mask (the opening marker), or None."""
        return self.span.start_id if self.phase == "maybe" else None

    def accept(self, token_ids: list[int]) -> bool:
        ok = True
        for tok in token_ids:
            before = self.phase
            to_grammar = False
            if before == "maybe" and tok == self.span.start_id:
                self.phase = "reasoning"
            elif before == "reasoning":
                end = self.span.end_ids
                if len(self._tokens) + 1 >= len(end) and \
                        [*self._tokens[len(self._tokens) + 1 - len(end):], tok] == list(end):
                    self.phase = "answer"
            else:
                self.phase, to_grammar = "answer", True
                ok = self._m.consume_token(tok) and ok
            self._history.append((before, to_grammar))
            self._tokens.append(tok)
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        undone = self._history[-num_tokens:]
        del self._history[-num_tokens:], self._tokens[-num_tokens:]
        grammar_tokens = sum(1 for _, to_grammar in undone if to_grammar)
        if grammar_tokens:
            self._m.rollback(grammar_tokens)
        self.phase = undone[0][0]

    @property
    def is_terminated(self) -> bool:
        return self.phase == "answer" and self._m.is_stopped()

    @property
    def error(self) -> str | None:
        return super().error if self.phase == "answer" else None


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` for one tokenizer and vocabulary, caching
    compiled grammars by their constraint; thread-safe."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]
                 ) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        eos = [t for t in eos_token_ids if t < vocab_size] or None
        # A tokenizer may hold more tokens than the model has logits (one built from a GGUF
        # adds its end-of-text token when the vocabulary lacks it): the masks then cover
        # the tokenizer's ids, and the sampler reads the first vocab_size bits of a row.
        mask_vocab = max(vocab_size, len(hf_tokenizer))
        # Building the token trie reads the whole vocabulary: ~1 s, once per process.
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=mask_vocab,
                                                      eos_token=eos)
        self.vocab_size = vocab_size
        self.bitmask_words = bitmask_width(mask_vocab)  # int32 words per mask row
        self.eos_token_ids = tuple(eos or ())
        self._executor = llguidance.LLExecutor()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def _grammar_text(self, params: StructuredOutputsParams) -> str:
        ll = self._ll.LLMatcher
        kind, text = params.kind, params.key()[1]
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.json
            if schema is True:
                schema = {}
            if isinstance(schema, dict):
                # llguidance's own options are the server's to set: a client's could make
                # the output something other than JSON ({"item_separator": ";"})
                schema = {k: v for k, v in _closed(schema).items() if k != "x-guidance"}
                if params.disable_any_whitespace:
                    schema["x-guidance"] = {"whitespace_flexible": False,
                                            "item_separator": ", ", "key_separator": ": "}
            return ll.grammar_from_json_schema(json.dumps(schema))
        if kind == "regex":
            return ll.grammar_from_regex(text)
        if kind == "choice":
            return ll.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in params.choice))
        grammar = params.grammar
        if not _GBNF_RULE.search(grammar):  # Lark (llguidance's own test misses "?start:")
            return ll.grammar_from_lark(grammar)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            lark = gbnf_to_lark(_literal_unicode_escapes(grammar))
        except Exception as err:  # the converter raises its own error types
            raise ValueError(f"cannot read the GBNF grammar: {err}") from None
        return ll.grammar_from_lark(lark)

    def compile(self, params: StructuredOutputsParams) -> Matcher:
        """A fresh matcher at the start of ``params``' grammar. An invalid constraint raises
        :class:`InvalidRequestError` naming ``params.field``."""
        key = params.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return Matcher(template.deep_copy())
        try:
            grammar = self._grammar_text(params)
            problem = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        except (ValueError, RuntimeError, TypeError) as err:
            problem = str(err)
        if problem:
            raise InvalidRequestError(
                f"{params.field}: invalid {params.kind.replace('_', ' ')} constraint: "
                f"{_first_lines(problem)}", params.field)
        template = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidRequestError(
                f"{params.field}: invalid {params.kind} constraint: "
                f"{_first_lines(template.get_error())}", params.field)
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return Matcher(template.deep_copy())

    def fill_bitmask(self, matchers: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Fill row ``i`` of ``bitmask`` (CPU, int32, contiguous, [B, W]) with the next-token
        mask of each ``(matcher, i)``; in parallel, without the GIL. A terminated or broken
        matcher allows EOS only; a matcher still in the output's reasoning leaves its row
        as it is (all ones: unconstrained)."""
        gated = [(m, row) for m, row in matchers if isinstance(m, ReasoningGatedMatcher)]
        if gated:
            matchers = [(m, row) for m, row in matchers
                        if not isinstance(m, ReasoningGatedMatcher) or m.constrained]
        if matchers:
            self._fill(matchers, bitmask)
        for m, row in gated:  # the opening marker stays allowed before the first token
            start = m.allow_start
            if start is not None:
                word = bitmask[row, start // 32]
                bitmask[row, start // 32] = int(_as_signed(int(word) | (1 << (start % 32))))

    def _fill(self, matchers: list[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and not bitmask.is_cuda
        width = bitmask.shape[1]
        assert width >= self.bitmask_words, "a mask row narrower than the tokenizer's ids"
        self._executor.unsafe_compute_mask_ptr(
            [(m.raw, row) for m, row in matchers], bitmask.data_ptr(), width * 4,
            bitmask.shape[0])


_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")


def _closed(schema: Any, close: bool = True) -> Any:
    """``schema`` with every object that lists its ``properties`` and says nothing about
    others closed to them (``additionalProperties: false``), as vLLM's default backend
    (xgrammar's strict mode) reads a schema: a model may not add keys the schema never
    named. Members of an ``allOf`` stay open (each names only part of the object)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SCHEMA_DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [_closed(item, close=False) for item in value]
        else:
            out[key] = _closed(value)
    named = schema.get("properties")
    if close and isinstance(named, dict) and not any(k in schema for k in _OPEN_KEYWORDS) \
            and set(schema.get("required") or ()) <= set(named) \
            and (schema.get("minProperties") or 0) <= len(named):
        out["additionalProperties"] = False  # (unless it needs keys it does not name)
    return out


_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)  # Lark has no "::="
_GBNF_ESCAPE = re.compile(r"\\\\|\\u([0-9A-Fa-f]{4})|\\U([0-9A-Fa-f]{8})")


def _literal_unicode_escapes(gbnf: str) -> str:
    """A GBNF grammar with its ``\\uXXXX`` / ``\\UXXXXXXXX`` escapes written out: ASCII
    as ``\\xNN``, the rest as the character itself (none is GBNF syntax). llguidance's
    converter drops their leading zeros, so ``"\\u0041bc"`` became U+41BC."""
    def spell(m: re.Match) -> str:
        digits = m.group(1) or m.group(2)
        if digits is None:  # an escaped backslash: the "u" after it is text
            return m.group(0)
        code = int(digits, 16)
        if code < 0x80:
            return f"\\x{code:02x}"
        if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            return m.group(0)  # not a character: the converter's error names it
        return chr(code)

    return _GBNF_ESCAPE.sub(spell, gbnf)


def _as_signed(word: int) -> int:
    """A 32-bit mask word as the int32 a tensor holds."""
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


def _first_lines(text: str, limit: int = 400) -> str:
    text = " ".join(line.strip() for line in str(text).strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
