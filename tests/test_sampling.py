"""The vectorised sampler against plain per-row references written here."""

from __future__ import annotations

import math

import pytest
import torch

from kvray.actors.sampling_batch import sampling_batch
from kvray.kernels.sampling import SamplingBatch, apply_penalties_and_bias, row_argmax, sample
from kvray.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

VOCAB = 32


def make_batch(params: list[SamplingParams], generators=None, prompts=None, outputs=None):
    n = len(params)
    return sampling_batch(
        params, generators or [None] * n, prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)])


def repeat(params: SamplingParams, n: int) -> SamplingBatch:
    return make_batch([params] * n)


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """Sample ``n`` independent tokens from one row of logits (one row per draw)."""
    gen = torch.Generator().manual_seed(seed)
    return sample(logits_row.expand(n, -1), repeat(params, n), gen).token_ids


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- references ---------------------------------------------------------------------------

def ref_nucleus(probs: list[float], top_p: float) -> set[int]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


def ref_processed_logits(logits: list[float], p: SamplingParams, prompt: list[int],
                         output: list[int], banned: list[int]) -> list[float]:
    out = list(logits)
    for tok, bias in (p.logit_bias or {}).items():
        if tok < len(out):  # out-of-vocab ids are ignored
            out[tok] += bias
    for tok in banned:
        out[tok] = -math.inf
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else \
            out[tok] * p.repetition_penalty
    for tok in set(output):
        count = output.count(tok)
        out[tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


# --- greedy ---------------------------------------------------------------------------------

def test_greedy_rows_take_argmax():
    logits = torch.randn(8, VOCAB, generator=gen(0))
    out = sample(logits, repeat(SamplingParams(temperature=0.0), 8))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_argmax_with_ties_nan_and_inf(dtype):
    """The faster reduction behind greedy picks gives argmax's index in every corner."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [nan, 1.0, 2.0, nan], [1.0, nan, 5.0, 5.0],
                      [-inf] * 4, [inf, 2.0, inf, 0.0], [0.0, -0.0, 0.0, -1.0]], dtype=dtype)
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    big = torch.randn(64, 49_152, generator=torch.Generator().manual_seed(0)).to(dtype)
    big[3, 100] = big[3, 7] = big[3].max() + 1  # a tie far apart
    assert torch.equal(row_argmax(big), big.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 16, 31, 32, 33, 1000, 49_153])
def test_row_argmax_kernel_agrees_with_argmax_on_every_row_shape(dtype, vocab):
    """The CPU kernel (vector body, lane merge, scalar tail) against ``argmax``: ties in
    different lanes and in the tail, a NaN in the body or only in the tail, all -inf rows,
    and a column slice (rows not contiguous with each other)."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab + 1, generator=g).to(dtype)
    x[1] = (x[1] * 2).round().clamp(-1, 1)  # many ties of the maximum
    x[2] = float("-inf")
    x[3, -1] = float("nan")  # in the tail (or the body, for short rows)
    x[4, vocab // 2] = float("nan")
    x[4, vocab // 3] = float("nan")
    x[5, :] = 0.0
    x[5, -1] = x[5, vocab // 2] = 1.0
    x[6, 0] = float("inf")
    x[6, -1] = float("inf")
    for view in (x, x[:, 1:], x[::2]):
        assert torch.equal(row_argmax(view), view.argmax(dim=-1)), view.shape


def test_greedy_sampling_of_bf16_logits_picks_what_fp32_picks():
    """Plain greedy rows are argmaxed in the logits' own dtype: the same tokens as the
    fp32 copy the other paths use (bf16 -> fp32 is exact)."""
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = sample(logits, repeat(SamplingParams(temperature=0.0), 16))
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1)) and out.logprobs is None


def test_mixed_batch_greedy_rows_argmax_random_rows_sample():
    logits = torch.zeros(64, VOCAB)
    logits[:, 5] = 0.5  # argmax, but a random row rarely picks it
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(64)]
    tokens = sample(logits, make_batch(params), gen(1)).token_ids
    assert tokens[1::2].tolist() == [5] * 32
    assert len(set(tokens[0::2].tolist())) > 5


def test_all_greedy_batch_draws_no_randomness():
    batch = make_batch([SamplingParams(temperature=0.0)] * 3, generators=[gen(7), None, None])
    assert batch.all_greedy
    default, seeded = gen(1), batch.generators[0]
    before = (default.get_state(), seeded.get_state())
    sample(torch.randn(3, VOCAB), batch, default)
    assert torch.equal(default.get_state(), before[0])
    assert torch.equal(seeded.get_state(), before[1])


# --- filters --------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(min_p=1.0, temperature=2.0)])
def test_filters_that_keep_one_token_give_argmax(params):
    logits = torch.randn(200, VOCAB, generator=gen(2))
    tokens = sample(logits, repeat(params, 200), gen(3)).token_ids
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_samples_only_among_the_k_largest():
    row = torch.randn(VOCAB, generator=gen(4))
    tokens = draw(row, SamplingParams(top_k=4, temperature=3.0), 4000)
    assert set(tokens.tolist()) == set(row.topk(4).indices.tolist())


def test_top_k_off_values_keep_every_token():
    # top_k = 8 and 100 are >= the vocabulary of 8; the top_k=2 row forces the top-k path.
    params = [SamplingParams(top_k=-1), SamplingParams(top_k=8), SamplingParams(top_k=100),
              SamplingParams(top_k=2)]
    n = 2000
    logits = torch.arange(8.0).expand(4 * n, -1) / 8
    tokens = sample(logits, make_batch(params * n), gen(5)).token_ids.view(n, 4)
    assert [set(tokens[:, j].tolist()) for j in range(4)] == [set(range(8))] * 3 + [{6, 7}]


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.75, 0.85, 0.95])
def test_top_p_keeps_exactly_the_nucleus(top_p):
    probs = [0.35, 0.25, 0.2, 0.1, 0.06, 0.04]
    tokens = draw(probs_logits(probs), SamplingParams(top_p=top_p), 6000)
    assert set(tokens.tolist()) == ref_nucleus(probs, top_p)


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = [0.4, 0.2, 0.15, 0.1, 0.08, 0.07]
    tokens = draw(probs_logits(probs), SamplingParams(min_p=0.3), 6000)
    assert set(tokens.tolist()) == {i for i, p in enumerate(probs) if p >= 0.3 * 0.4}


def test_min_p_applies_before_top_p_which_measures_what_is_left():
    """vLLM's order (regression: min-p ran last): min_p 0.3 leaves {0, 1, 2} renormalised
    to [4/9, 3/9, 2/9]; top_p 0.75 of that keeps {0, 1}. Top-p first kept {0, 1, 2}."""
    probs = [0.4, 0.3, 0.2, 0.1]
    tokens = draw(probs_logits(probs), SamplingParams(min_p=0.3, top_p=0.75), 6000)
    assert set(tokens.tolist()) == {0, 1}


def test_rows_with_different_filters_in_one_batch_each_obey_their_own():
    probs = [0.35, 0.25, 0.2, 0.1, 0.06, 0.04]
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(),
              SamplingParams(min_p=0.5)]
    n = 2000
    batch = make_batch(params * n)
    tokens = sample(probs_logits(probs).expand(4 * n, -1), batch, gen(6)).token_ids.view(n, 4)
    assert [set(tokens[:, j].tolist()) for j in range(4)] == [
        {0, 1}, {0, 1, 2}, set(range(6)), {0, 1, 2}]


def test_temperature_sampling_matches_softmax_of_scaled_logits():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature, n = 0.7, 20000
    tokens = draw(row, SamplingParams(temperature=temperature), n, seed=8)
    observed = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(row.double() / temperature, -1) * n
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 20.5  # 99.9% quantile of chi-square with 5 degrees of freedom


# --- logit processors -----------------------------------------------------------------------

def test_penalties_and_bias_match_reference_formulas():
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(logit_bias={3: 5.0, 9: -2.5, 10_000: 1.0}),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5,
                       logit_bias={1: 1.0}, min_tokens=6, stop_token_ids=[2, 6]),
        SamplingParams(),
    ]
    prompts = [[1, 2, 2, 7], [1, 2, 3], [4], [0, 1, 11], [5]]
    outputs = [[7, 8, 8], [2, 2, 2, 5, 9], [], [1, 1, 3, 6, 12], [5, 5]]
    logits = torch.randn(5, VOCAB, generator=gen(9))
    batch = make_batch(params, prompts=prompts, outputs=outputs)
    processed = apply_penalties_and_bias(logits, batch)
    for i, p in enumerate(params):
        expected = ref_processed_logits(logits[i].tolist(), p, prompts[i], outputs[i],
                                        batch.banned_token_ids[i])
        torch.testing.assert_close(processed[i], torch.tensor(expected))
    assert batch.banned_token_ids[3] == [2, 6]


def test_no_processors_returns_logits_untouched():
    logits = torch.randn(2, VOCAB)
    assert apply_penalties_and_bias(logits, repeat(SamplingParams(), 2)) is logits


def test_penalties_apply_before_greedy_argmax():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    batch = make_batch([params], prompts=[[3]])
    assert sample(logits, batch).token_ids.tolist() == [4]


def test_banned_ids_are_never_sampled():
    row = torch.zeros(VOCAB)
    row[[0, 7]] = 10.0  # the banned ids are by far the likeliest
    params = SamplingParams(min_tokens=3, stop_token_ids=[7], eos_token_ids=(0,))
    n = 2000
    batch = make_batch([params, SamplingParams(temperature=0.0, min_tokens=3,
                                               stop_token_ids=[0, 7])] * n)
    tokens = sample(row.expand(2 * n, -1), batch, gen(10)).token_ids
    assert not set(tokens.tolist()) & {0, 7}


def test_ids_are_only_banned_until_min_tokens_are_out():
    params = [SamplingParams(min_tokens=2, stop_token_ids=[4], eos_token_ids=(1,))] * 3
    batch = make_batch(params, outputs=[[], [9], [9, 9]])
    assert batch.banned_token_ids == [[1, 4], [1, 4], []]


def test_min_tokens_bans_eos_even_under_ignore_eos():
    """vLLM's: ignore_eos lets EOS through after min_tokens, never before (regression:
    EOS was free from the first token)."""
    params = SamplingParams(min_tokens=2, ignore_eos=True, eos_token_ids=(1,))
    assert params.banned_after([]) == [1] and params.banned_after([9, 9]) == []
    greedy = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, eos_token_ids=(1,))
    assert not greedy.plain_greedy_after(0) and greedy.plain_greedy_after(2)


# --- seeds ----------------------------------------------------------------------------------

def target_logits(step: int) -> torch.Tensor:
    """The seeded row's logits at ``step``, the same whatever batch it is in."""
    return torch.randn(VOCAB, generator=gen(1000 + step))


def run_seeded(position: int, batch_size: int, seed: int = 1234, steps: int = 20) -> list[int]:
    """Tokens of a seeded row over ``steps`` steps, placed at ``position`` among random rows."""
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(top_k=5, seed=77), SamplingParams(min_p=0.1, seed=78)]
    params = [others[i % len(others)] for i in range(batch_size - 1)]
    params.insert(position, target)
    generators = [gen(p.seed) if p.seed is not None else None for p in params]
    default, tokens = gen(555 + batch_size), []
    for step in range(steps):
        logits = torch.randn(batch_size, VOCAB, generator=default)
        logits[position] = target_logits(step)
        batch = sampling_batch(params, generators, [[]] * batch_size,
                                          [[] for _ in range(batch_size)])
        tokens.append(sample(logits, batch, default).token_ids[position].item())
    return tokens


def test_seeded_row_gives_same_tokens_alone_and_in_any_batch_position():
    alone = run_seeded(0, 1)
    assert len(set(alone)) > 3  # the row really samples
    for position in (0, 7, 16):
        assert run_seeded(position, 17) == alone


def test_different_seeds_give_different_tokens():
    assert run_seeded(3, 8, seed=1) != run_seeded(3, 8, seed=2)


def test_seeded_row_consumes_one_vocab_draw_per_step():
    seeded, reference = gen(42), gen(42)
    batch = make_batch([SamplingParams(seed=42), SamplingParams()], generators=[seeded, None])
    for _ in range(3):
        sample(torch.randn(2, VOCAB), batch)
        torch.empty(VOCAB).exponential_(generator=reference)
    assert torch.equal(seeded.get_state(), reference.get_state())


# --- logprobs -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_of_raw_logits_at_sampled_token_and_top_k(dtype):
    logits = (torch.randn(6, VOCAB, generator=gen(11)) * 3).to(dtype)
    params = [SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logit_bias={0: 50.0}), SamplingParams(logprobs=1),
              SamplingParams(top_k=2), SamplingParams(frequency_penalty=2.0),
              SamplingParams(min_p=0.2)]
    batch = make_batch(params, prompts=[[1, 2]] * 6, outputs=[[3]] * 6)
    out = sample(logits, batch, gen(12))
    raw = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    top = raw.topk(3, -1)
    assert out.top_token_ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(out.top_logprobs, top.values)
    # rank (vLLM's): how many tokens the raw distribution puts at or above the sampled one
    chosen = logits.float().gather(1, out.token_ids[:, None])
    assert out.ranks.tolist() == (logits.float() >= chosen).sum(-1).tolist()
    assert out.ranks[1] > 1  # the bias made greedy take a token the raw logits rank low


def test_rank_counts_the_tokens_tied_with_the_sampled_one():
    """vLLM counts ties (common in bf16 logits): 3 tokens tied at the top, the sampled one
    among them, rank 3 (regression: 1)."""
    row = torch.full((1, VOCAB), -5.0)
    row[0, [4, 9, 11]] = 2.0
    out = sample(row, make_batch([SamplingParams(temperature=0.0, logprobs=1)]), gen(1))
    assert out.token_ids.item() in (4, 9, 11) and out.ranks.tolist() == [3]


def test_no_logprobs_requested_skips_the_log_normaliser():
    out = sample(torch.randn(2, VOCAB), repeat(SamplingParams(), 2))
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None


def test_logprobs_zero_returns_only_the_sampled_token_logprob():
    out = sample(torch.randn(2, VOCAB), repeat(SamplingParams(logprobs=0), 2))
    assert out.top_token_ids is None and out.top_logprobs is None
    assert out.logprobs.shape == (2,) and out.logprobs.dtype == torch.float32


def test_input_logits_are_not_modified():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    params = SamplingParams(repetition_penalty=2.0, logit_bias={1: 3.0}, top_k=3, top_p=0.5)
    sample(logits, make_batch([params] * 2, outputs=[[1, 2]] * 2), gen(13))
    assert torch.equal(logits, before)


# --- batch construction ---------------------------------------------------------------------

def test_plain_greedy_batches_leave_their_columns_on_the_host():
    """Plain greedy rows (argmax of the raw logits) read no per-row column, so a batch of
    them copies none to the device; any row that processes logits (a penalty, a bias, a
    banned id, sampling) moves the batch as before."""
    def build(params: list[SamplingParams]) -> SamplingBatch:
        n = len(params)
        return sampling_batch(params, [None] * n, [[5, 6]] * n, [[7]] * n,
                                         device="meta")

    greedy = build([SamplingParams(temperature=0.0, logprobs=3)] * 2)
    assert greedy.plain_greedy and greedy.temperature.device.type == "cpu"
    for busy in (SamplingParams(temperature=0.0, repetition_penalty=1.2),
                 SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
                 SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[2]),
                 SamplingParams(temperature=0.7)):
        batch = build([SamplingParams(temperature=0.0), busy])
        assert not batch.plain_greedy and batch.temperature.device.type == "meta", busy
    logits = torch.randn(2, 11)
    out = sample(logits, sampling_batch(
        [SamplingParams(temperature=0.0, logprobs=2)] * 2, [None] * 2, [[1]] * 2, [[]] * 2))
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.top_token_ids.shape == (2, 2)


def test_from_params_builds_tensors_and_flags():
    plain = make_batch([SamplingParams(), SamplingParams(temperature=0.0)])
    assert not plain.all_greedy
    assert plain.no_top_k and plain.no_top_p and plain.no_min_p and plain.no_bias
    assert plain.no_penalties and plain.no_banned and plain.num_logprobs == 0
    assert plain.temperature.tolist() == [1.0, 0.0]

    params = [SamplingParams(top_k=5, logprobs=4, repetition_penalty=1.1, seed=3),
              SamplingParams(top_p=0.5, min_p=0.1, logprobs=2, presence_penalty=0.5,
                             logit_bias={1: 1.0}, temperature=1e-7)]
    busy = make_batch(params, generators=[gen(3), gen(4)])
    assert not (busy.no_top_k or busy.no_top_p or busy.no_min_p or busy.no_bias)
    assert not (busy.no_repetition_penalty or busy.no_presence_frequency or busy.no_penalties)
    assert busy.num_logprobs == 4
    assert busy.top_k.dtype == torch.int64 and busy.top_k.tolist() == [5, -1]
    assert busy.temperature.tolist() == [1.0, 0.0]  # is_greedy rows are stored as 0.0
    assert busy.seeded_random_rows == [0]  # the greedy seeded row draws nothing


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, ignore_eos=True, min_tokens=3),
    SamplingParams(temperature=0.0, min_tokens=3, eos_token_ids=(1,)),
    SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4], ignore_eos=True),
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
    SamplingParams(temperature=0.0, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, frequency_penalty=-0.5),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1, seed=3),
])
@pytest.mark.parametrize("num_outputs", [0, 2, 3, 5])
def test_the_runners_argmax_shortcut_is_taken_exactly_when_the_batch_is_plain_greedy(
        params, num_outputs):
    # The model runner skips building a SamplingBatch when every row is plain greedy after
    # its outputs so far: the shortcut must agree with the batch's own verdict.
    batch = make_batch([params], outputs=[[5] * num_outputs])
    want = batch.plain_greedy and not batch.need_logprobs
    assert params.plain_greedy_after(num_outputs) == want
