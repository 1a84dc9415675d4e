"""Vectorised sampling for one engine step: logit processors, filters and a per-row-seeded draw.

Order (vLLM's): logit_bias -> banned ids -> repetition penalty -> presence/frequency penalties
-> greedy rows take the argmax | other rows: temperature -> min-p -> top-k -> top-p -> draw.

The draw is an exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` picks token i with
probability ``probs[i] / sum(probs)``, so no renormalisation or cumulative search is needed and
each row's randomness is one independent noise vector. A non-greedy row with its own generator
draws exactly one ``exponential_`` of size V from it per step, whatever else is in the batch, so a
seeded request gives the same tokens alone or batched. Greedy rows draw nothing: a request's
temperature never changes, so its generator still stays in step. Rows without a generator share
one batched draw from ``default_generator``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from kvray.kernels import cpu_ops

_GREEDY_EPS = 1e-5  # the same threshold as kvray.sampling_params.SamplingParams.is_greedy
_TENSOR_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty")


@dataclass
class SamplingBatch:
    """Per-row sampling state for one step; row i = i-th sequence that samples this step.

    The flags are derived at construction so the hot path skips work no row asks for. Deriving
    them reads the tensors, so build on CPU and move with ``to`` (``kvray.actors.sampling_batch``
    does this) to avoid a device sync. Token ids at or beyond the vocabulary (in ``logit_bias``,
    ``banned_token_ids`` or the token lists) are ignored; the engine rejects them at admission.
    """

    temperature: torch.Tensor  # [B] float32; < 1e-5 (0.0) means greedy for that row
    top_p: torch.Tensor  # [B] float32 in (0, 1]; 1.0 = off
    top_k: torch.Tensor  # [B] int64; <= 0 or >= vocab = off
    min_p: torch.Tensor  # [B] float32; 0.0 = off
    repetition_penalty: torch.Tensor  # [B] float32; 1.0 = off
    presence_penalty: torch.Tensor  # [B] float32; 0.0 = off
    frequency_penalty: torch.Tensor  # [B] float32; 0.0 = off
    generators: list[torch.Generator | None]  # per row; None = the shared default generator
    prompt_token_ids: list[list[int]]  # per row; used by repetition_penalty only
    output_token_ids: list[list[int]]  # per row, generated so far
    logit_bias: list[dict[int, float] | None]
    banned_token_ids: list[list[int]]  # per row ids set to -inf (stop/eos before min_tokens)
    num_logprobs: int  # most top logprobs any row asked for (0 = none)
    need_logprobs: bool = True  # False: no row wants logprobs, skip the log-normaliser
    # Structured outputs: [B, ceil(V / 32)] int32, bit set = token allowed (rows of
    # unconstrained sequences all ones); None = no row is constrained. Applied after the
    # penalties; a row left with no allowed token falls back to its EOS ids.
    token_bitmask: torch.Tensor | None = None
    eos_token_ids: list[tuple[int, ...]] = field(default_factory=list)  # per row, for that
    # per row: the only ids it may take (None: any); [] for the whole batch = none limited
    allowed_token_ids: list[list[int] | None] = field(default_factory=list)
    all_greedy: bool = field(init=False)
    no_top_k: bool = field(init=False)
    no_top_p: bool = field(init=False)
    no_min_p: bool = field(init=False)
    no_bias: bool = field(init=False)
    no_banned: bool = field(init=False)
    no_repetition_penalty: bool = field(init=False)
    no_presence_frequency: bool = field(init=False)
    no_penalties: bool = field(init=False)  # no repetition, presence or frequency penalty
    seeded_random_rows: list[int] = field(init=False)  # non-greedy rows with own generator

    def __post_init__(self) -> None:
        greedy = (self.temperature < _GREEDY_EPS).tolist()
        self.all_greedy = all(greedy)
        self.seeded_random_rows = [i for i, (gen, is_greedy) in
                                   enumerate(zip(self.generators, greedy, strict=True))
                                   if gen is not None and not is_greedy]
        self.no_top_k = not bool((self.top_k > 0).any())
        self.no_top_p = bool((self.top_p >= 1.0).all())
        self.no_min_p = bool((self.min_p <= 0.0).all())
        self.no_bias = not any(self.logit_bias)
        self.no_banned = not any(self.banned_token_ids) and not any(
            ids is not None for ids in self.allowed_token_ids)
        self.no_repetition_penalty = bool((self.repetition_penalty == 1.0).all())
        self.no_presence_frequency = bool(
            ((self.presence_penalty == 0.0) & (self.frequency_penalty == 0.0)).all())
        self.no_penalties = self.no_repetition_penalty and self.no_presence_frequency

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of its raw logits: no penalty, bias, banned id or
        grammar mask, so :func:`sample` and :func:`sample_speculative` read none of the
        per-row columns."""
        return (self.all_greedy and self.no_bias and self.no_banned and self.no_penalties
                and self.token_bitmask is None)

    def to(self, device: torch.device | str) -> SamplingBatch:
        """A copy with its tensors on ``device``; the flags are kept, not recomputed."""
        moved = copy.copy(self)
        for name in (*_TENSOR_FIELDS, "token_bitmask"):
            value = getattr(self, name)
            if value is not None:
                setattr(moved, name, value.to(device, non_blocking=True))
        return moved


@dataclass
class SamplerOutput:
    """What one step sampled. Log-probs are of the RAW model distribution (before processing)."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, of each sampled token; None if not needed
    top_token_ids: torch.Tensor | None  # [B, num_logprobs] int64; None if num_logprobs == 0
    top_logprobs: torch.Tensor | None  # [B, num_logprobs] float32
    # [B] int64, each sampled token's rank in the raw distribution (1 = the likeliest; ties
    # rank together); set with ``logprobs``
    ranks: torch.Tensor | None = None


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value (the first of equal ones; NaN counts as largest),
    like ``x.argmax(dim=-1)``. On CPU kvray's kernel reads the rows once in their own dtype
    (256 rows of a 49,152-token vocabulary in bf16: 0.6 ms, where widening to fp32 and
    ``max`` took 18); elsewhere ``max``'s reduction, ~3x faster than ``argmax``'s on CPU."""
    if x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1 \
            and x.dtype in _KERNEL_DTYPES and cpu_ops.load_ops() is not None:
        return cpu_ops.argmax_rows(x)
    return x.max(dim=-1).indices


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sample(logits: torch.Tensor, batch: SamplingBatch,
           default_generator: torch.Generator | None = None) -> SamplerOutput:
    """Pick one token per row of ``logits`` [B, V] (any float dtype; ``logits`` is not modified).

    ``default_generator`` serves rows without their own generator (None = torch's global one).
    """
    if batch.plain_greedy and not batch.need_logprobs:  # no fp32 copy of the logits
        return SamplerOutput(row_argmax(logits), None, None, None)
    raw = logits.float()
    logits = _processed(raw, batch)
    greedy_tokens = row_argmax(logits)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        probs = _filtered_probs(logits, batch)
        noise = _exponential_noise(probs, batch, default_generator)
        sampled = row_argmax(probs / noise)
        tokens = torch.where(batch.temperature < _GREEDY_EPS, greedy_tokens, sampled)
    if not batch.need_logprobs:
        return SamplerOutput(tokens, None, None, None)
    return _output(tokens, raw, batch.num_logprobs)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit in ``bitmask`` ([B, W] int32, on the
    logits' device) is 0."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


def _processed(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits the draw uses: penalties, bias, banned ids, then the grammar mask (``raw``
    itself is left as it is, for the logprobs)."""
    logits = apply_penalties_and_bias(raw, batch)
    if batch.token_bitmask is not None:
        logits = _apply_token_bitmask(logits if logits is not raw else raw.clone(), batch)
    return logits


def _apply_token_bitmask(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Disallowed tokens to -inf, in place. A row with nothing left (its grammar is complete
    but min_tokens bans EOS, say) may take its EOS ids rather than sample from nothing."""
    apply_bitmask_(logits, batch.token_bitmask)
    dead = torch.isneginf(logits).all(dim=-1).nonzero().flatten().tolist()
    for row in dead:
        ids = [t for t in batch.eos_token_ids[row] if t < logits.shape[1]]
        logits[row, ids] = 0.0
    return logits


def apply_penalties_and_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, banned ids, repetition then presence/frequency penalties, on float32 logits.

    Returns a new tensor, or ``logits`` itself when no row uses any of them.
    """
    if batch.no_bias and batch.no_banned and batch.no_penalties:
        return logits
    logits = logits.clone()
    if not batch.no_bias:
        rows, cols, values = _sparse_entries(
            [list((bias or {}).items()) for bias in batch.logit_bias], logits.shape[1],
            logits.device)
        logits.index_put_((rows, cols), torch.tensor(values, device=logits.device),
                          accumulate=True)
    if not batch.no_banned:
        rows, cols, _ = _sparse_entries(
            [[(tok, 0.0) for tok in ids] for ids in batch.banned_token_ids], logits.shape[1],
            logits.device)
        logits.index_put_((rows, cols), torch.tensor(float("-inf"), device=logits.device))
        for row, ids in enumerate(batch.allowed_token_ids):
            if ids is not None:  # everything else to -inf
                keep = torch.tensor([t for t in ids if t < logits.shape[1]],
                                    dtype=torch.int64, device=logits.device)
                kept = logits[row, keep]
                logits[row] = float("-inf")
                logits[row, keep] = kept
    if not batch.no_repetition_penalty:
        logits = _repetition_penalty(logits, batch)
    if not batch.no_presence_frequency:
        counts = _token_counts(batch.output_token_ids, logits.shape[1], logits.device)
        logits = (logits - batch.frequency_penalty.unsqueeze(1) * counts
                  - batch.presence_penalty.unsqueeze(1) * (counts > 0))
    return logits


def _sparse_entries(rows_of_pairs: list[list[tuple[int, float]]], vocab: int,
                    device: torch.device):
    """Flatten per-row (token, value) pairs into (row, col) index tensors and a value list."""
    rows, cols, values = [], [], []
    for row, pairs in enumerate(rows_of_pairs):
        for tok, value in pairs:
            if 0 <= tok < vocab:
                rows.append(row)
                cols.append(tok)
                values.append(float(value))
    def index(ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=device)

    return index(rows), index(cols), values


def _repetition_penalty(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """HF semantics: each id seen in prompt or output has logit/p if positive, logit*p if not."""
    seen_lists = [p + o for p, o in
                  zip(batch.prompt_token_ids, batch.output_token_ids, strict=True)]
    seen = _token_counts(seen_lists, logits.shape[1], logits.device) > 0
    penalty = batch.repetition_penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _token_counts(token_lists: list[list[int]], vocab: int,
                  device: torch.device) -> torch.Tensor:
    """[B, vocab] float32 occurrence counts, by one scatter_add over a padded id tensor."""
    width = max((len(ids) for ids in token_lists), default=0)
    # Padding (and any out-of-vocab id) lands in a spare column that is dropped.
    padded = torch.tensor([ids + [vocab] * (width - len(ids)) for ids in token_lists],
                          dtype=torch.int64).clamp_(0, vocab).to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, min-p, then top-k and top-p (vLLM's order: top-p measures the mass of
    what min-p left, renormalised); probs, masked tokens 0."""
    temperature = torch.where(batch.temperature < _GREEDY_EPS, 1.0, batch.temperature)
    logits = logits / temperature.unsqueeze(1)
    if not batch.no_min_p:
        probs = logits.softmax(dim=-1)
        threshold = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if not (batch.no_top_k and batch.no_top_p):
        logits = _top_k_top_p(logits, None if batch.no_top_k else batch.top_k,
                              None if batch.no_top_p else batch.top_p)
    return logits.softmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what top-k (ties with the k-th value kept) and then top-p drop.

    Top-p keeps the smallest set of most likely tokens whose probability sums to >= top_p: in
    ascending order, a token goes if the mass up to and including it is <= 1 - top_p.
    """
    vocab = logits.shape[1]
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
        kth_largest = ascending.gather(1, (vocab - k).unsqueeze(1))
        ascending = ascending.masked_fill(ascending < kth_largest, float("-inf"))
    if top_p is not None:
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = mass_below <= 1.0 - top_p.unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch,
                       default_generator: torch.Generator | None) -> torch.Tensor:
    """Exp(1) noise [B, V]: one draw per seeded non-greedy row, one shared draw for the rest."""
    noise = torch.empty_like(probs)
    if len(batch.seeded_random_rows) < probs.shape[0]:
        noise.exponential_(generator=default_generator)
    for row in batch.seeded_random_rows:
        noise[row].exponential_(generator=batch.generators[row])
    # A zero draw would make a masked token 0/0 = nan, which argmax would pick.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _output(tokens: torch.Tensor, raw_logits: torch.Tensor, num_logprobs: int) -> SamplerOutput:
    """Log-probs of the raw logits at the sampled tokens, and the top ``num_logprobs``."""
    log_norm = torch.logsumexp(raw_logits, dim=-1, keepdim=True)
    chosen = raw_logits.gather(1, tokens.unsqueeze(1))
    token_logprobs = (chosen - log_norm).squeeze(1)
    ranks = (raw_logits >= chosen).sum(dim=-1)  # vLLM's: ties with it count
    if num_logprobs == 0:
        return SamplerOutput(tokens, token_logprobs, None, None, ranks)
    top = raw_logits.topk(min(num_logprobs, raw_logits.shape[1]), dim=-1)
    return SamplerOutput(tokens, token_logprobs, top.indices, top.values - log_norm, ranks)


@dataclass
class SpecSpan:
    """One request's rows in a speculative step: ``len(drafts) + 1`` consecutive rows from
    ``first_row``; row j holds the target's logits after the request's tokens and
    ``drafts[:j]``."""

    first_row: int
    drafts: list[int]
    greedy: bool
    generator: torch.Generator | None


def sample_speculative(logits: torch.Tensor, batch: SamplingBatch, spans: list[SpecSpan],
                       default_generator: torch.Generator | None = None
                       ) -> tuple[list[list[int]], torch.Tensor, SamplerOutput | None]:
    """Verify each span's point-mass drafts against the target distribution (the logits
    processed as :func:`sample` processes them) and pick the tokens to emit: the accepted
    drafts, then one more token (a correction at the first rejection, else a bonus token
    from the last row).

    Greedy rows accept a draft iff it is the argmax: exactly the tokens of plain decoding.
    Sampled rows accept draft d with probability p(d) and on rejection draw from p with d
    removed (renormalised): standard rejection sampling with a deterministic proposal, so
    every emitted token follows the target distribution exactly. Returns (tokens per span,
    the row each emitted token came from as a tensor, and the logprobs output over all rows
    if any row wants them)."""
    # plain greedy rows are only argmaxed: the logits' own dtype gives the same picks
    raw = logits if batch.plain_greedy and not batch.need_logprobs else logits.float()
    processed = _processed(raw, batch)
    greedy_tokens = row_argmax(processed).tolist()
    probs = None
    if not batch.all_greedy:
        probs = _filtered_probs(processed, batch)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    out_tokens: list[list[int]] = []
    rows: list[int] = []
    for span in spans:
        gen = span.generator if span.generator is not None else default_generator
        emitted, span_rows = (_verify_greedy(span, greedy_tokens) if span.greedy
                              else _verify_sampled(span, probs, gen))
        out_tokens.append(emitted)
        rows.extend(span_rows)
    row_index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    lp = None
    if batch.need_logprobs:
        flat = torch.tensor([t for toks in out_tokens for t in toks], dtype=torch.int64,
                            device=logits.device)
        lp = _output(flat, raw[row_index], batch.num_logprobs)
    return out_tokens, row_index, lp


def _verify_greedy(span: SpecSpan, greedy_tokens: list[int]) -> tuple[list[int], list[int]]:
    """A greedy span's tokens (its drafts while each is the argmax, then the argmax) and
    the row each came from."""
    first, drafts = span.first_row, span.drafts
    emitted: list[int] = []
    rows: list[int] = []
    for j, d in enumerate(drafts):
        emitted.append(greedy_tokens[first + j])
        rows.append(first + j)
        if greedy_tokens[first + j] != d:
            return emitted, rows
    emitted.append(greedy_tokens[first + len(drafts)])
    rows.append(first + len(drafts))
    return emitted, rows


def _verify_sampled(span: SpecSpan, probs: torch.Tensor, gen: torch.Generator | None
                    ) -> tuple[list[int], list[int]]:
    """A sampled span's tokens by rejection sampling (see :func:`sample_speculative`) and
    the row each came from."""
    first, drafts = span.first_row, span.drafts
    k = len(drafts)
    draft_idx = torch.tensor(drafts, dtype=torch.int64, device=probs.device)
    p_draft = probs[first:first + k].gather(1, draft_idx[:, None])[:, 0] if k else \
        probs.new_empty(0)
    u = torch.rand(k, generator=gen, device=probs.device) if k else p_draft
    accept = (u < p_draft).tolist()
    j = accept.index(False) if False in accept else k
    row = probs[first + j]
    if j < k:  # rejected: the residual max(p - q, 0) of a point mass q at the draft
        row = row.clone()
        row[drafts[j]] = 0.0
    token = int(torch.multinomial(row, 1, generator=gen))
    return [*drafts[:j], token], [*range(first, first + j), first + j]
