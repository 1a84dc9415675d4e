"""Beam search above the engine, one token per step, as vLLM runs it.

Each step turns every live beam into one request, ``prompt + beam tokens`` with
``max_tokens=1`` and the top log-probabilities of the next token; the requests of all beams
(of all prompts) go to the engine together so that it batches them, and the prefix cache
gives each one the KV blocks of its prompt and of its beam's earlier tokens (only the
beam's newest token and the partial last block are computed again). :class:`BeamSearch` is
the search itself, whatever produces a step's log-probabilities; :func:`run_beam_searches`
drives it with a blocking step function (``LLM.beam_search``) and
:func:`beam_search_async` with an async ``generate`` (``AsyncLLM``'s, or the Serve graph's
client: the server's ``use_beam_search``).

The semantics are transformers' ``generate(num_beams=k, do_sample=False)`` (its beam
search since 4.50), which the parity tests check token for token:

- A step ranks every (beam, next token) pair by cumulative log-probability (raw
  log-softmax of the logits, no temperature). The best ``k`` pairs that do not end the
  sequence are the next beams, so ``k`` beams stay live however many end. A pair that ends
  it (an EOS token, unless ``ignore_eos``; any token of the step that reaches
  ``max_tokens``) becomes a finished hypothesis only if it ranks among the best ``k`` pairs
  of the step; the ``k`` best hypotheses are kept.
- A hypothesis scores ``cum_logprob / num_generated ** length_penalty``, where
  ``num_generated`` counts the generated tokens, the EOS included and the prompt not.
- The search ends after ``max_tokens`` steps, or once ``k`` hypotheses are kept and
  ``early_stopping`` is True, or once ``k`` are kept and the best live beam cannot beat the
  worst of them: its ``cum_logprob / L ** length_penalty`` is at most that score, with
  ``L`` the beams' current length, or ``max_tokens`` when ``early_stopping == "never"`` and
  ``length_penalty > 0`` (transformers' heuristics; a longer beam only loses log-probability,
  but a positive penalty divides by a larger length). Live beams left then are dropped.
- The result is the ``k`` hypotheses, best score first.

vLLM's ``LLM.beam_search`` differs: its length counts the prompt and leaves out the EOS;
every EOS among a beam's ``2k`` candidates finishes, ranked or not; it has no early
stopping (always ``max_tokens`` steps) and at the end ranks its live beams with the
finished ones. Both run the same steps above the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvray.outputs import RequestOutput
from kvray.sampling_params import RequestOutputKind, SamplingParams

_MAX_LOGPROBS = 20  # SamplingParams.logprobs' bound, which bounds the candidates per beam
MAX_BEAM_WIDTH = _MAX_LOGPROBS // 2  # each step asks for 2 x beam_width log-probabilities

GenerateFn = Callable[[str, Any, SamplingParams, int], AsyncIterator[RequestOutput]]
StepFn = Callable[[list[list[int]], list[SamplingParams]], list[Mapping[int, float]]]


@dataclass
class BeamSearchParams:
    """What to search for (vLLM's names, plus transformers' ``early_stopping``).

    Attributes:
        beam_width: live beams, and finished sequences returned (1 to 10).
        max_tokens: most tokens generated per sequence (>= 1).
        ignore_eos: EOS does not end a sequence; every sequence runs to ``max_tokens``.
        temperature: accepted as vLLM takes it (>= 0); beams are ranked by the model's raw
            log-probabilities whatever its value, as vLLM's engine reports them.
        length_penalty: a finished sequence scores ``cum_logprob / length **
            length_penalty``; > 0 favours longer sequences, < 0 shorter ones.
        early_stopping: True: stop once ``beam_width`` sequences finished; False: also stop
            once the best live beam, at its current length, cannot beat them; "never": the
            same, but a positive length penalty is judged at ``max_tokens``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        _check(_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
               "beam_width", self.beam_width,
               f"must be an integer in [1, {MAX_BEAM_WIDTH}] (each step asks the engine for "
               f"2 x beam_width log-probabilities, at most {_MAX_LOGPROBS})")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               self.max_tokens, "must be an integer >= 1")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos,
               "must be true or false")
        _check(_is_number(self.temperature) and self.temperature >= 0.0, "temperature",
               self.temperature, "must be a number >= 0")
        _check(_is_number(self.length_penalty), "length_penalty", self.length_penalty,
               "must be a finite number")
        _check(isinstance(self.early_stopping, bool) or self.early_stopping == "never",
               "early_stopping", self.early_stopping, 'must be true, false or "never"')


@dataclass
class BeamSearchSequence:
    """One finished sequence of a beam search."""

    token_ids: list[int]  # generated tokens only; the EOS that ended it included
    cum_logprob: float  # sum of the tokens' log-probabilities
    score: float  # cum_logprob / len(token_ids) ** length_penalty: the ranking key
    finish_reason: Literal["stop", "length"]  # EOS, or max_tokens reached
    stop_reason: int | None = None  # the EOS id that ended it
    text: str | None = None  # the tokens decoded, special tokens skipped (None: no tokenizer)
    tokens: list[int] = field(default_factory=list)  # vLLM's: the prompt's ids + token_ids


@dataclass
class BeamSearchOutput:
    """The result for one prompt: ``beam_width`` sequences, best score first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class _Beam:
    token_ids: list[int]
    cum_logprob: float


class BeamSearch:
    """The search state of one prompt: live beams, the best finished sequences and the
    step that advances them, fed the top log-probabilities of each beam's next token."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: Iterable[int], prompt: str | None = None,
                 max_model_len: int | None = None) -> None:
        """Raise ValueError (naming the field) if the prompt is empty or cannot grow by
        ``max_tokens`` within ``max_model_len``."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: beam search takes BeamSearchParams, not "
                             f"{type(params).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt: the prompt is empty; give at least one token")
        if max_model_len is not None and len(prompt_token_ids) + params.max_tokens \
                > max_model_len:
            raise ValueError(f"max_tokens = {params.max_tokens}: the prompt "
                             f"({len(prompt_token_ids)} tokens) + max_tokens exceeds "
                             f"max_model_len ({max_model_len})")
        self.params = params
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        k = params.beam_width
        # Enough candidates per beam for the step's k best pairs that do not end (a beam's
        # may sit behind all its EOS ids) and, as vLLM asks, at least 2k.
        self.num_logprobs = max(2 * k, k + len(self.eos_token_ids))
        if self.num_logprobs > _MAX_LOGPROBS:
            raise ValueError(f"beam_width = {k}: with {len(self.eos_token_ids)} EOS ids each "
                             f"step needs {self.num_logprobs} log-probabilities, more than "
                             f"{_MAX_LOGPROBS}; lower beam_width or set ignore_eos")
        self.beams = [_Beam([], 0.0)]
        self.finished: list[BeamSearchSequence] = []  # best first, at most beam_width
        self.num_generated = 0  # tokens in every live beam
        self.done = False

    def next_prompts(self) -> list[list[int]]:
        """The token ids whose next-token log-probabilities the next step needs, one per
        live beam, in :attr:`beams` order."""
        assert not self.done, "the search has ended"
        return [self.prompt_token_ids + beam.token_ids for beam in self.beams]

    def step_params(self) -> SamplingParams:
        """The request each beam's step runs: one greedy token and the top log-probs."""
        return SamplingParams(n=1, temperature=0.0, max_tokens=1, ignore_eos=True,
                              logprobs=self.num_logprobs,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def step(self, top_logprobs: Sequence[Mapping[int, float]]) -> None:
        """Advance by one token: ``top_logprobs[i]`` maps the likeliest next tokens of
        beam ``i`` (at least :attr:`num_logprobs` of them) to their log-probabilities."""
        assert not self.done, "the search has ended"
        assert len(top_logprobs) == len(self.beams), "one set of log-probs per live beam"
        k, length = self.params.beam_width, self.num_generated + 1
        # Best first; equal scores keep beam order, then the engine's token order.
        ranked = sorted(((beam.cum_logprob + lp, i, tok)
                         for i, beam in enumerate(self.beams)
                         for tok, lp in top_logprobs[i].items()), key=lambda c: -c[0])
        at_limit = length == self.params.max_tokens
        self._keep_finished([c for c in ranked[:k] if at_limit or c[2] in self.eos_token_ids],
                            length)
        live = (c for c in ranked if c[2] not in self.eos_token_ids)
        self.beams = [_Beam(self.beams[i].token_ids + [tok], cum)
                      for cum, i, tok in itertools.islice(live, k)]
        self.num_generated = length
        self.done = at_limit or not self.beams or self._cannot_improve()

    def _keep_finished(self, ended: list[tuple[float, int, int]], length: int) -> None:
        """Add the step's ranked pairs that end a sequence; keep the best ``beam_width``
        (earlier ones first among equal scores)."""
        penalty = length ** self.params.length_penalty
        new = []
        for cum, i, tok in ended:
            eos = tok in self.eos_token_ids
            new.append(BeamSearchSequence(self.beams[i].token_ids + [tok], cum, cum / penalty,
                                          "stop" if eos else "length", tok if eos else None))
        ranked = sorted(self.finished + new, key=lambda s: -s.score)
        self.finished = ranked[:self.params.beam_width]

    def _cannot_improve(self) -> bool:
        """Whether the search is over before ``max_tokens``: ``beam_width`` sequences
        finished and, unless early_stopping is True, the best live beam at its hoped-for
        length scores no better than the worst of them."""
        params = self.params
        if len(self.finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        hoped = params.max_tokens if params.early_stopping == "never" \
            and params.length_penalty > 0 else self.num_generated
        best = self.beams[0].cum_logprob / hoped ** params.length_penalty
        return best <= self.finished[-1].score

    def output(self, tokenizer: Any = None) -> BeamSearchOutput:
        """The finished sequences, best first, their text decoded if a tokenizer is given."""
        assert self.done, "the search has not ended"
        for seq in self.finished:
            seq.tokens = list(self.prompt_token_ids) + seq.token_ids
            if tokenizer is not None:
                seq.text = tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        return BeamSearchOutput(self.prompt, self.prompt_token_ids, list(self.finished))


def run_beam_searches(searches: Sequence[BeamSearch], run_step: StepFn) -> None:
    """Run ``searches`` to the end, one step for all of them at a time: ``run_step(prompts,
    params)`` returns the top log-probs of each prompt's next token, in order."""
    while live := [s for s in searches if not s.done]:
        prompts = [p for s in live for p in s.next_prompts()]
        params = [s.step_params() for s in live for _ in s.beams]
        top = run_step(prompts, params)
        assert len(top) == len(prompts), "one set of log-probs per prompt"
        at = 0
        for search in live:
            num_beams = len(search.beams)
            search.step(top[at:at + num_beams])
            at += num_beams


def top_logprobs_of(out: RequestOutput) -> Mapping[int, float]:
    """The top log-probs of a beam's step request (its one generated token)."""
    logprobs = out.outputs[0].logprobs if out.outputs else None
    if not logprobs:
        raise RuntimeError(f"beam search step {out.request_id!r} finished without "
                           "log-probabilities")
    return logprobs[0]


async def beam_search_async(generate: GenerateFn, prompt_ids: Sequence[int],
                            params: BeamSearchParams, request_id: str,
                            eos_token_ids: Iterable[int], *, prompt: str | None = None,
                            tokenizer: Any = None, priority: int = 0,
                            max_model_len: int | None = None) -> BeamSearchOutput:
    """Beam-search one prompt through ``generate(request_id, prompt, params, priority)``
    (``AsyncLLM.generate``'s signature): each step's beams run as concurrent requests
    ``{request_id}-beam{step}.{i}``. Cancel-safe: if the caller is cancelled, or a step
    request fails (its error is raised), the step's other requests are closed, which
    aborts them in the engine.

    Args:
        eos_token_ids: the ids that end a sequence (the engine's ``eos_token_ids``).
        prompt / tokenizer: the prompt text to report, the tokenizer to decode outputs.
        max_model_len: if given, a prompt that cannot grow by ``max_tokens`` raises
            ValueError before any request is made.
    """
    search = BeamSearch(prompt_ids, params, eos_token_ids, prompt, max_model_len)
    while not search.done:
        step = search.num_generated
        ids = [f"{request_id}-beam{step}.{i}" for i in range(len(search.beams))]
        outs = await _run_concurrently(
            [_final_output(generate, rid, {"prompt_token_ids": p}, search.step_params(),
                           priority) for rid, p in zip(ids, search.next_prompts(), strict=True)])
        search.step([top_logprobs_of(out) for out in outs])
    return search.output(tokenizer)


async def _run_concurrently(coros: list) -> list[Any]:
    """Await ``coros`` as tasks; if one fails or the caller is cancelled, cancel the rest
    and wait until they have cleaned up before raising."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _final_output(generate: GenerateFn, request_id: str, prompt: Any,
                        params: SamplingParams, priority: int) -> RequestOutput:
    """The request's last output; its stream closed (the request aborted unless it
    finished) however this ends."""
    stream = generate(request_id, prompt, params, priority)
    last = None
    try:
        async for out in stream:
            last = out
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
    if last is None or not last.finished:
        raise RuntimeError(f"beam search step {request_id!r} ended without a finished output")
    return last


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} = {value!r}: {rule}")
