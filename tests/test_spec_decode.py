"""Speculative decoding: n-gram drafts, their verification by rejection sampling (the
target distribution kept exactly: a statistical test), greedy tokens identical to plain
decoding on the parity models, and the engine's bookkeeping (KV rolled back past rejected
drafts, limits, preemption, structured outputs, metrics)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kvray import LLM, SamplingParams
from kvray.actors.sampling_batch import sampling_batch
from kvray.kernels.sampling import SamplingBatch, SpecSpan, sample_speculative
from kvray.scheduler.ngram import NgramProposer
from tests.helpers.tiny_models import VOCAB_SIZE, load_hf, make_tiny_model, transformers_greedy

pytestmark = pytest.mark.parity

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}


# ---- n-gram prompt lookup ------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(3, 1, 3)
    assert p.propose("a", [1, 2, 3, 4, 1, 2]) == [3, 4, 1]  # suffix [1, 2]
    assert p.propose("a", [1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]  # grown: [1, 2, 3]
    assert p.propose("b", [5, 9, 5, 7, 5]) == [7, 5]  # the latest [5], not the first
    assert p.propose("c", [1, 2, 3]) == []
    assert p.propose("d", [7, 1, 2, 9, 1, 2], max_tokens=1) == [9]
    assert p.propose("d", [7, 1, 2, 9, 1, 2], max_tokens=0) == []


def test_ngram_matches_whole_tokens_only():
    """Token ids are 4-byte words: a byte-level match across two tokens must not count."""
    p = NgramProposer(2, 1, 1)
    assert p.propose("x", [0x0100, 0x0200, 0x01]) == []  # 0x01 only inside other words
    assert p.propose("y", [70000, 3, 70000]) == [3, 70000]


def test_ngram_state_follows_a_replaced_sequence():
    p = NgramProposer(2, 1, 2)
    assert p.propose("r", [1, 2, 1]) == [2, 1]
    assert p.propose("r", [4, 5]) == []  # shorter: the request restarted
    p.forget("r")
    assert p.propose("r", [4, 5, 4]) == [5, 4]


# ---- rejection sampling keeps the target distribution ---------------------------------------
def _spec_batch(rows: int, temperature: float) -> SamplingBatch:
    params = [SamplingParams(temperature=temperature)] * rows
    return sampling_batch(params, [None] * rows, [[]] * rows, [[]] * rows)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft", [0, 2, 5])  # likely, middling and impossible drafts
def test_rejection_sampling_emits_tokens_from_the_target_distribution(draft):
    """Two rows per span (one draft): the first emitted token must follow p0 whatever the
    draft, and after an accepted draft the bonus token must follow p1 (chi-square, 6
    tokens, 5 degrees of freedom: 20.5 is the 0.1 % critical value)."""
    p0 = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.10, 0.0])
    p1 = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.30, 0.30])
    spans_n = 6000
    logits = torch.stack([p0, p1] * spans_n).log()
    gen = torch.Generator().manual_seed(draft)
    spans = [SpecSpan(2 * i, [draft], False, None) for i in range(spans_n)]
    tokens, _, _ = sample_speculative(logits, _spec_batch(2 * spans_n, 1.0), spans, gen)
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=6).float()
    assert _chi2(first, p0) < 20.5
    bonus = [t[1] for t in tokens if len(t) == 2]
    assert all(t[0] == draft for t in tokens if len(t) == 2)
    if p0[draft] > 0.1:
        counts = torch.bincount(torch.tensor(bonus), minlength=6).float()
        assert _chi2(counts, p1) < 20.5
    else:
        assert len(bonus) < 0.2 * spans_n


def test_greedy_verification_accepts_exactly_the_argmax_prefix():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 2.0, 0.0]])
    spans = [SpecSpan(0, [1, 0, 1], True, None)]  # 1 ok, 0 ok, then 2 is the argmax
    tokens, rows, _ = sample_speculative(logits, _spec_batch(4, 0.0), spans)
    assert tokens == [[1, 0, 2]] and rows.tolist() == [0, 1, 2]
    spans = [SpecSpan(0, [1, 0, 2], True, None)]  # all accepted: a bonus from the last row
    assert sample_speculative(logits, _spec_batch(4, 0.0), spans)[0] == [[1, 0, 2, 1]]


# ---- the engine ------------------------------------------------------------------------------
def _repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase: the n-gram proposer has matches from the start."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        phrase = torch.randint(3, VOCAB_SIZE, (int(torch.randint(3, 7, (1,), generator=g)),),
                               generator=g).tolist()
        out.append(phrase * 4 + phrase[:2])
    return out


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_qknorm_headdim", "mistral"])
def test_greedy_tokens_with_ngram_drafts_equal_transformers(arch, tiny_model_dir):
    prompts = _repetitive_prompts(6)
    hf = load_hf(tiny_model_dir(arch))
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=14, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    llm = LLM(str(tiny_model_dir(arch)), dtype="float32", speculative_config=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.stats
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens


def test_limits_logprobs_seeds_and_n_hold_with_drafts(tiny_model_dir):
    """Drafts never push a request past max_tokens; each emitted token has its logprobs;
    a seeded request repeats itself; n sequences each draft on their own."""
    model = str(tiny_model_dir("llama_gqa"))
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(4, seed=1)]
    llm = LLM(model, dtype="float32", speculative_config=NGRAM)
    for max_tokens in (1, 2, 5, 11):
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                    ignore_eos=True, logprobs=2),
                            use_tqdm=False)
        for o in outs:
            seq = o.outputs[0]
            assert len(seq.token_ids) == max_tokens == len(seq.logprobs)
            assert all(t in lp and len(lp) >= 2 for t, lp in zip(seq.token_ids, seq.logprobs,
                                                               strict=True))
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, n=3)
    first = llm.generate(prompts[:2], sampled, use_tqdm=False)
    again = llm.generate(prompts[:2], sampled, use_tqdm=False)
    assert [[s.token_ids for s in o.outputs] for o in first] == \
        [[s.token_ids for s in o.outputs] for o in again]
    assert llm.llm_engine.stats.spec_decode_num_draft_tokens > 0
    llm.shutdown()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_drafts_through_preemption_keep_greedy_tokens(mode, tiny_model_dir):
    model = str(tiny_model_dir("llama_gqa"))
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(6, seed=2)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    roomy = LLM(model, dtype="float32")
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    roomy.shutdown()
    assert want == transformers_greedy(model, prompts, 30)
    tight = LLM(model, dtype="float32", block_size=4, num_gpu_blocks_override=40,
                preemption_mode=mode, speculative_config=NGRAM)
    outs = tight.generate(prompts, params, use_tqdm=False)
    stats = tight.llm_engine.stats
    tight.shutdown()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == want


def test_structured_outputs_with_drafts(tiny_model_dir):
    """Drafts the grammar refuses are masked out; greedy output equals plain decoding's and
    validates."""
    schema = {"type": "object", "additionalProperties": False, "required": ["xs"],
              "properties": {"xs": {"type": "array", "minItems": 6, "maxItems": 6,
                                    "items": {"enum": ["ab", "cd"]}}}}
    model = str(tiny_model_dir("llama_gqa"))
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured_outputs={"json": schema})
    prompts = ["ab cd ab cd ab cd", "hello"]
    plain = LLM(model, dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(model, dtype="float32", speculative_config=NGRAM)
    outs = llm.generate(prompts, params, use_tqdm=False)
    drafts = llm.llm_engine.stats.spec_decode_num_draft_tokens
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want and drafts > 0
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_disable_by_batch_size_turns_drafts_off_for_big_batches(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama_gqa")), dtype="float32",
              speculative_config={**NGRAM, "disable_by_batch_size": 3})
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(4, seed=3)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    assert llm.llm_engine.stats.spec_decode_num_draft_tokens == 0  # 4 running >= 3
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    assert llm.llm_engine.stats.spec_decode_num_draft_tokens > 0
    llm.shutdown()


def test_spec_decode_counters_are_exported_with_vllm_style_names():
    from kvray.serve.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.set_engine_stats("r0", {"spec_decode_num_draft_tokens": 12,
                                    "spec_decode_num_accepted_tokens": 7})
    text = metrics.render().decode()
    assert 'kvray:spec_decode_num_draft_tokens_total{model_name="m",replica="r0"} 12.0' in text
    assert 'kvray:spec_decode_num_accepted_tokens_total{model_name="m",replica="r0"} 7.0' \
        in text


# ---- draft model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_models(tmp_path_factory):
    """A draft with the target's own weights (every greedy draft is right) and a different,
    smaller one of the same family and tokenizer (most drafts are wrong)."""
    from tests.helpers.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("drafts")
    return {"other": make_tiny_model("llama_gqa", root / "other", seed=1,
                                     num_hidden_layers=1)}


@pytest.mark.parametrize("which", ["self", "other"])
def test_greedy_tokens_with_a_draft_model_equal_plain_decoding(which, tiny_model_dir,
                                                              draft_models):
    target = tiny_model_dir("llama_gqa")
    draft = target if which == "self" else draft_models["other"]
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()}
               for n in (5, 17, 33, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(str(target), dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()
    assert want == transformers_greedy(target, prompts, 32)  # plain decoding is greedy
    llm = LLM(str(target), dtype="float32", block_size=4, num_gpu_blocks_override=24,
              speculative_config={"model": str(draft), "num_speculative_tokens": 3})
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.stats
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert stats.spec_decode_num_draft_tokens > 0
    if which == "self":  # the target as its own draft: every draft is its argmax
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert stats.num_preemptions > 0  # the tight cache made requests recompute drafts too


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from tests.helpers.tiny_models import make_tiny_model

    other = make_tiny_model("llama_gqa", tmp_path / "big-vocab", vocab_size=VOCAB_SIZE + 64)
    with pytest.raises(Exception, match="speculative_config.model.*vocabulary"):
        LLM(str(tiny_model_dir("llama_gqa")), dtype="float32",
            speculative_config={"model": str(other)})


def _agree_but_at_near_ties(plain, got: list[list[int]], tie: float = 0.05) -> None:
    """Each sequence in ``got`` equals plain decoding's, or first differs where plain
    decoding's two best tokens were within ``tie`` in log-probability. On int8 activations
    a step that verifies drafts runs the prefill attention where plain decoding runs the
    decode kernel: their ulps apart can move an activation's int8 rounding, which shows
    only where the two best tokens nearly tie (as in llama.cpp and vLLM)."""
    for o, tokens in zip(plain, got, strict=True):
        seq = o.outputs[0]
        first = next((i for i, (a, b) in enumerate(zip(seq.token_ids, tokens, strict=True))
                      if a != b), None)
        if first is None:
            continue
        best = sorted((lp.logprob for lp in seq.logprobs[first].values()), reverse=True)
        assert best[0] - best[1] < tie, (first, seq.token_ids, tokens)


@pytest.mark.parametrize("weights", ["gguf Q4_1", "int8"])
def test_drafts_on_a_quantized_target_keep_its_greedy_tokens_and_grammar(weights,
                                                                        tiny_model_dir,
                                                                        tmp_path):
    """A quantized target (a Q4_1 GGUF read in place, or int8 quantized at load) verifies
    n-gram drafts: it accepts some, keeps plain decoding's greedy tokens, and JSON-schema
    outputs still validate."""
    from tests.helpers.tiny_gguf import write_gguf

    base = tiny_model_dir("llama_gqa")
    if weights == "int8":
        model, kw = str(base), dict(quantization="int8")
    else:
        model, kw = str(write_gguf(base, tmp_path / "m.gguf", quant={"*": "Q4_1"})), {}
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(6, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    schema = {"type": "object", "additionalProperties": False, "required": ["xs"],
              "properties": {"xs": {"type": "array", "minItems": 4, "maxItems": 4,
                                    "items": {"enum": ["ab", "cd"]}}}}
    constrained = SamplingParams(temperature=0.0, max_tokens=60, logprobs=2,
                                 structured_outputs={"json": schema})
    plain_llm = LLM(model, dtype="float32", **kw)
    plain = plain_llm.generate(prompts, params, use_tqdm=False)
    plain_json = plain_llm.generate(["ab cd ab cd", "hello"], constrained, use_tqdm=False)
    plain_llm.shutdown()
    llm = LLM(model, dtype="float32", speculative_config=NGRAM, **kw)
    drafted = llm.generate(prompts, params, use_tqdm=False)
    drafted_json = llm.generate(["ab cd ab cd", "hello"], constrained, use_tqdm=False)
    stats = llm.llm_engine.stats
    llm.shutdown()
    assert stats.spec_decode_num_accepted_tokens > 0
    _agree_but_at_near_ties(plain, [o.outputs[0].token_ids for o in drafted])
    _agree_but_at_near_ties(plain_json, [o.outputs[0].token_ids for o in drafted_json])
    for o in drafted_json:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_stop_strings_under_ngram_speculation_end_where_plain_decoding_ends(tiny_model_dir):
    """A speculative step accepts several tokens; a stop string the first of them completes
    ends the sequence there: token ids, text and finish reason equal plain decoding's (the
    accepted tokens after it were kept once). Repetitive outputs (a negative frequency
    penalty) make the n-gram drafts hit; the stops are pieces of the plain output."""
    path = str(tiny_model_dir("qwen3_moe"))
    prompts = [[114], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [40, 41, 40, 41, 40]]
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=-0.8)
    runs = {}
    for name, spec in (("plain", None), ("ngram", {
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})):
        llm = LLM(path, dtype="float32", block_size=4, speculative_config=spec)
        try:
            free = [o.outputs[0] for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], SamplingParams(**base),
                use_tqdm=False)]
            if name == "plain":  # stops: 2-6 characters from several places of each text
                stops = [[o.text[i:i + n]] for o in free for i, n in ((1, 4), (3, 2), (6, 6))
                         if o.text[i:i + n].strip()]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in stops],
                                [SamplingParams(**base, stop=s) for _ in prompts
                                 for s in stops], use_tqdm=False)
            runs[name] = [(o.outputs[0].token_ids, o.outputs[0].text,
                           o.outputs[0].finish_reason) for o in outs]
            drafts = llm.llm_engine.stats.spec_decode_num_accepted_tokens
        finally:
            llm.shutdown()
    assert drafts > 0, "the n-gram drafts were never accepted: the test proves nothing"
    assert sum(r[2] == "stop" for r in runs["plain"]) >= len(stops)
    assert runs["ngram"] == runs["plain"]


def test_a_stop_token_inside_accepted_drafts_ends_the_output_as_plain_decoding_does(
        tmp_path):
    """Regression: a stop token (or the length) accepted in the middle of a speculative
    step ended the sequence, but the engine applied every token the step sampled: the
    text before it came twice (' The The'), and logprobs and the cumulative logprob counted
    the drafts after it. Ids, text, logprobs and finish now equal plain decoding's. The
    prompt's repeats make the n-gram proposer draft the stop token and what follows it."""
    path = str(make_tiny_model("llama_gqa", tmp_path / "m", seed=1))
    prompt = [249, 188, 303, 116, 263, 76, 149, 76] * 3 + [333, 130, 243, 333, 130, 243, 333,
                                                           359, 243, 333]
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[243], logprobs=0),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)]
    runs = {}
    for name, spec in (("plain", None), ("ngram", {
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})):
        llm = LLM(path, dtype="float32", max_model_len=256, speculative_config=spec)
        try:
            outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params,
                                use_tqdm=False)
            runs[name] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                           len(c.logprobs), round(c.cumulative_logprob, 3))
                          for o in outs for c in o.outputs]
            drafts = llm.llm_engine.stats.spec_decode_num_accepted_tokens
        finally:
            llm.shutdown()
    assert drafts > 0, "the n-gram drafts were never accepted: the test proves nothing"
    assert runs["plain"][0][0] == [359, 243]  # the stop token, drafted with more after it
    assert all(r[4] == len(r[0]) for r in runs["ngram"])
    assert runs["ngram"] == runs["plain"]
