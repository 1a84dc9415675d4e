"""Per-request sampling parameters, with vLLM's names and defaults.

Pure Python (no torch) so the protocol layer can validate requests cheaply. Every check
raises ``ValueError`` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import copy
import enum
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """What each :class:`~kvray.outputs.RequestOutput` of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far, every time
    DELTA = 1  # only what is new since the previous output: streams cost O(length) in all
    FINAL_ONLY = 2  # one output, when the request has finished


@dataclass(frozen=True)
class ReasoningSpan:
    """Where a thinking model's reasoning ends in its output: structured outputs constrain
    only the answer after it (set by the server's reasoning parser).

    Attributes:
        end_ids: the token ids of the closing marker (``</think>``).
        opened: the output starts inside the reasoning (the prompt opened the block).
        start_id: else, the one token of the opening marker the output may begin with
            (None: no reasoning unless ``opened``).
    """

    end_ids: tuple[int, ...]
    opened: bool = False
    start_id: int | None = None

    def __post_init__(self) -> None:
        _check(bool(self.end_ids) and all(isinstance(t, int) and t >= 0 for t in self.end_ids),
               "reasoning.end_ids", self.end_ids, "must be a non-empty tuple of token ids")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output's text (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
        json: a JSON schema (dict or JSON text) the output must validate against.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, in Lark or GBNF/EBNF syntax.
        json_object: any JSON object.
        disable_any_whitespace: JSON with single spaces after ``:`` and ``,`` only (the
            default, unlike vLLM's: small models otherwise may spend their whole token
            budget on whitespace); False allows any whitespace between tokens.
        field: the request field it came from, for error messages (set by the server).
        reasoning: where the output's reasoning ends, when the model thinks first: the
            constraint applies after it (set by the server's reasoning parser).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    field: str = "structured_outputs"
    reasoning: ReasoningSpan | None = None

    def __post_init__(self) -> None:
        given = [k for k in _CONSTRAINT_KINDS if self._gives(k)]
        if len(given) != 1:
            raise ValueError(f"{self.field}: give exactly one of json, regex, choice, grammar, "
                             f"json_object (got {', '.join(given) or 'none'})")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as err:
                raise ValueError(f"{self.field}: the JSON schema is not valid JSON: {err}") \
                    from None
        _check(self.json is None or isinstance(self.json, dict | bool), self.field, self.json,
               "a JSON schema must be an object")
        _check(self.regex is None or isinstance(self.regex, str), self.field, self.regex,
               "regex must be a string")
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()),
               self.field, self.grammar, "grammar must be a non-empty string")
        if self.choice is not None:
            _check(isinstance(self.choice, list) and self.choice
                   and all(isinstance(c, str) and c for c in self.choice), self.field,
                   self.choice, "choice must be a non-empty list of non-empty strings")

    def _gives(self, kind: str) -> bool:
        """Whether the field of ``kind`` holds a constraint (``json=False`` does: the schema
        nothing matches; ``json_object=False`` does not)."""
        value = getattr(self, kind)
        return value is not None and not (kind == "json_object" and value is False)

    @property
    def kind(self) -> str:
        return next(k for k in _CONSTRAINT_KINDS if self._gives(k))

    def key(self) -> tuple[str, str]:
        """(kind, text): the cache key of the compiled grammar. A schema's keys keep their
        order: JSON output follows it (a "reasoning" property before "answer" is a
        different constraint from the reverse)."""
        kind = self.kind
        value = {"json_object": True}.get(kind, getattr(self, kind))
        text = value if isinstance(value, str) else json.dumps(value)
        if kind in ("json", "json_object") and not self.disable_any_whitespace:
            kind += "+whitespace"
        return kind, text


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# keywords of a JSON schema whose values are data, not schemas: a schema walk leaves them
SCHEMA_DATA_KEYWORDS = ("const", "enum", "default", "examples")
POOLING_TYPES = ("last", "mean", "cls", "all")
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding or classification request: the prompt's hidden states pooled into one
    vector instead of text (prefill only; the one token the step samples is dropped).

    Attributes:
        task: ``embed`` (the pooled final hidden state), ``classify`` (the classification
            head's logits at the pooled position: a ``*ForSequenceClassification`` model),
            or per prompt token (vLLM's): ``token_embed`` (every final hidden state) and
            ``token_classify`` (the head's logits at every position: a reward model's).
        pooling_type: ``last`` token, ``mean`` over the prompt, the first (``cls``) or
            ``all`` (one row per token: the token tasks' own); None = the model's (its
            sentence-transformers pooling config, else ``last``).
        normalize: L2-normalise the embedding (each row of ``token_embed``); None = the
            model's choice.
        dimensions: keep the first ``dimensions`` values (Matryoshka), then normalise.
        activation: classify: the model's activation on the logits (a reranker's sigmoid,
            a classifier's softmax: vLLM's default); False: the raw logits.
        use_activation: vLLM's newer name for both: when set, it decides ``normalize``
            (embeddings) and ``activation`` (class scores).
    """

    task: str = "embed"
    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool = True
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        _check(self.task in POOLING_TASKS, "task", self.task,
               f"must be one of {', '.join(POOLING_TASKS)}")
        for name in ("normalize", "use_activation", "activation"):
            value = getattr(self, name)
            _check(isinstance(value, bool) or (value is None and name != "activation"),
                   name, value, "must be true or false")
        if self.use_activation is not None:  # (a frozen dataclass: set once, here)
            object.__setattr__(self, "normalize", bool(self.use_activation))
            object.__setattr__(self, "activation", bool(self.use_activation))
        _check(self.pooling_type is None or self.pooling_type in POOLING_TYPES,
               "pooling_type", self.pooling_type, f"must be one of {', '.join(POOLING_TYPES)}")
        per_token = self.task.startswith("token_")
        _check(self.pooling_type in (None, "all") if per_token
               else self.pooling_type != "all", "pooling_type", self.pooling_type,
               "all (one row per token) goes with the token tasks, and only with them")
        if per_token:
            object.__setattr__(self, "pooling_type", "all")
        _check(self.dimensions is None or (isinstance(self.dimensions, int)
                                           and not isinstance(self.dimensions, bool)
                                           and self.dimensions >= 1),
               "dimensions", self.dimensions, "must be a positive integer")
        _check(self.dimensions is None or self.task in ("embed", "token_embed"),
               "dimensions", self.dimensions, "only embeddings take dimensions (Matryoshka); "
               "class scores keep every class")


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    Attributes:
        n: number of output sequences for the prompt (they share the prompt's KV blocks).
        temperature: 0 means greedy; higher flattens the distribution.
        top_p / top_k / min_p: nucleus, top-k (-1 or 0 = off) and min-probability filters.
        repetition_penalty: > 1 discourages tokens seen in prompt or output (HF semantics).
        presence_penalty / frequency_penalty: OpenAI penalties over output tokens.
        logit_bias: token id -> bias added to its logit.
        seed: per-request seed; the same seed gives the same tokens whatever else runs
            (-1 means none, as in vLLM; another negative one means what its unsigned
            64-bit twin means, as in torch).
        stop: strings that end the output (not included in the text unless
            include_stop_str_in_output).
        stop_token_ids: token ids that end the output (included in token_ids, not the text).
        ignore_eos: keep generating past the EOS token.
        max_tokens / min_tokens: bounds on the number of generated tokens.
        logprobs: number of top log-probabilities to return per output token (None = none).
        prompt_logprobs: the same for each prompt token (None = none).
        skip_special_tokens: drop special tokens from the text.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        output_kind: cumulative, delta or final-only outputs (see RequestOutputKind).
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar
            (a dict is read as :class:`StructuredOutputsParams`' fields). A constrained
            request also ends at EOS once its grammar is complete, even with ignore_eos.
        pooling: an embedding / classification request (:class:`PoolingParams`): its
            output's ``pooled`` holds the vector; it generates nothing.
        bad_words: words never generated: the last token of each (as it tokenizes alone
            and after a space) is banned when the output ends with the tokens before it.
        allowed_token_ids: only these token ids may be generated.
        detokenize: False: no text (token ids only; no stop strings).
        truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as the
            context holds with room for one more).
        spaces_between_special_tokens: vLLM's name; kvray's fast tokenizers always decode
            as with True.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    pooling: PoolingParams | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    extra_args: dict[str, Any] | None = None  # carried for custom code; kvray reads none
    # Filled by the engine: the model's EOS ids (ignored when ignore_eos), and bad_words as
    # token id sequences.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if isinstance(self.stop_token_ids, str | int):
            raise ValueError(f"stop_token_ids = {self.stop_token_ids!r}: must be a list of "
                             "token ids")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        if self.seed == -1:  # vLLM's (and chat UIs') spelling of "no seed"
            self.seed = None
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs",
                     "seed"):  # whole numbers (numpy's too), None where the field allows it
            value = getattr(self, name)
            if value is None and name not in ("n", "top_k", "min_tokens"):
                continue
            # True / False count as 1 / 0 log-probs, as vLLM takes them (its own tests pass
            # prompt_logprobs=True); elsewhere a bool is a mistake
            _check(isinstance(value, numbers.Integral) and (
                not isinstance(value, bool) or name in ("logprobs", "prompt_logprobs")), name,
                value, "must be an integer")
            setattr(self, name, int(value))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, numbers.Real) and not isinstance(value, bool)
                   and math.isfinite(value), name, value, "must be a finite number")
        _check(all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
                   for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "must be a list of token ids")
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k == -1 or 1 <= self.top_k < 2**31, "top_k", self.top_k,
               "must be -1 (off) or in [1, 2^31)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty,
               "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               self.frequency_penalty, "must be in [-2, 2]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
               "must be in [0, 20]")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
               "prompt_logprobs", self.prompt_logprobs, "must be in [0, 20]")
        # a 64-bit seed, signed as OpenAI's and vLLM's APIs take it or unsigned as torch's
        _check(self.seed is None or -(2**63) <= self.seed < 2**64, "seed", self.seed,
               "must be a 64-bit integer, in [-2^63, 2^64)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(self.bad_words is None or (isinstance(self.bad_words, list) and all(
            isinstance(w, str) and w.strip() for w in self.bad_words)), "bad_words",
            self.bad_words, "must be a list of non-blank strings")
        _check(self.allowed_token_ids is None or (
            isinstance(self.allowed_token_ids, list | tuple) and len(self.allowed_token_ids) > 0
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
                    for t in self.allowed_token_ids)), "allowed_token_ids",
            self.allowed_token_ids, "must be a non-empty list of token ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        _check(not (self.stop and not self.detokenize), "stop", self.stop,
               "stop strings need detokenize=True (there is no text to search)")
        _check(self.truncate_prompt_tokens is None or (
            isinstance(self.truncate_prompt_tokens, numbers.Integral)
            and (self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1)),
            "truncate_prompt_tokens", self.truncate_prompt_tokens,
            "must be >= 1, or -1 (as many as the context holds)")
        for tok, bias in (self.logit_bias or {}).items():
            _check(isinstance(tok, int) and tok >= 0, "logit_bias", tok,
                   "keys must be token ids >= 0")
            _check(-100.0 <= bias <= 100.0, "logit_bias", bias, "values must be in [-100, 100]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def plain_greedy_after(self, num_output_tokens: int) -> bool:
        """Whether the next token, after ``num_output_tokens`` outputs, is the argmax of the
        raw logits with nothing else to compute: greedy, no penalty, bias or logprobs, and
        no stop id banned by ``min_tokens`` (a grammar is the runner's to check)."""
        return (self.is_greedy and self.logprobs is None
                and not self.logit_bias and not self.bad_words_token_ids
                and self.allowed_token_ids is None and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and (num_output_tokens >= self.min_tokens or not self.min_tokens_banned_ids))

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's): changing it leaves this one as it is."""
        return copy.deepcopy(self)

    def banned_after(self, output_token_ids: list[int]) -> list[int]:
        """Token ids the next token may not be after these outputs: the stop ids before
        ``min_tokens``, and each bad word's last token where the output ends with the
        tokens before it."""
        banned = sorted(self.min_tokens_banned_ids) \
            if len(output_token_ids) < self.min_tokens else []
        for word in self.bad_words_token_ids:
            head = len(word) - 1
            if head == 0 or (len(output_token_ids) >= head
                             and tuple(output_token_ids[-head:]) == word[:-1]):
                banned.append(word[-1])
        return banned

    @property
    def min_tokens_banned_ids(self) -> set[int]:
        """What may not come before ``min_tokens``: stop_token_ids and EOS, even under
        ignore_eos (vLLM's)."""
        return set(self.stop_token_ids) | set(self.eos_token_ids)

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that finish the sequence: stop_token_ids plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos or self.structured_outputs is not None:
            ids.update(self.eos_token_ids)
        return ids


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} = {value!r}: {rule}")
