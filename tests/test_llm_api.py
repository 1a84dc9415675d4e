"""The offline LLM API on a tiny fp32 Llama: prompt forms, ordering, sampling features,
logprobs against transformers, seeded reproducibility, n > 1, stops, chat and errors."""

from __future__ import annotations

import time

import pytest
import torch

from kvray import LLM, ConfigError, SamplingParams
from tests.helpers.tiny_models import VOCAB_SIZE, load_hf

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama_gqa")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=64,
               max_num_seqs=16, num_gpu_blocks_override=96)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


@torch.inference_mode()
def _greedy_reference(hf, prompt: list[int], max_tokens: int, *,
                      logit_bias: dict[int, float] | None = None, banned: tuple[int, ...] = (),
                      repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
                      presence_penalty: float = 0.0) -> list[int]:
    """Greedy tokens from transformers, recomputing the whole sequence each step, with the
    logit processors in vLLM's order: bias, banned ids, repetition (prompt and output), then
    frequency and presence (output only). No stop handling: callers cut the list."""
    out: list[int] = []
    for _ in range(max_tokens):
        logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        for tok, bias in (logit_bias or {}).items():
            logits[tok] += bias
        logits[list(banned)] = float("-inf")
        seen = sorted(set(prompt) | set(out))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition_penalty,
                                   logits[seen] * repetition_penalty)
        for tok in set(out):
            logits[tok] -= frequency_penalty * out.count(tok) + presence_penalty
        out.append(int(logits.argmax()))
    return out


def test_mixed_prompt_forms_come_back_in_input_order(llm, hf):
    tok = llm.get_tokenizer()
    prompts = ["The capital of France", {"prompt_token_ids": _ids(9, 0)}, "Hello world"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].prompt == "The capital of France"
    assert outs[0].prompt_token_ids == tok("The capital of France")["input_ids"]
    assert outs[1].prompt is None and outs[1].prompt_token_ids == _ids(9, 0)
    # Each output is its own prompt's whole greedy continuation: a swap of prompts, params or
    # outputs between requests would show here.
    for o, n in zip(outs, (3, 5, 7), strict=True):
        want = _greedy_reference(hf, o.prompt_token_ids, n)
        assert o.outputs[0].token_ids == want
        assert o.outputs[0].text == tok.decode(want, skip_special_tokens=True)
        assert o.finished and o.outputs[0].finish_reason == "length"


@torch.inference_mode()
def test_logprobs_equal_transformers_log_softmax(llm, hf):
    prompt = _ids(21, 1)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5,
                                      prompt_logprobs=3), use_tqdm=False)[0]
    comp = out.outputs[0]
    full = prompt + comp.token_ids
    ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
    tok_text = llm.get_tokenizer().decode
    for i, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[tok] - row[tok].item()) <= 1e-4
        top = row.topk(5)
        assert set(top.indices.tolist()) <= set(entry)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(),
                                          strict=True), 1):
            assert abs(entry[t] - v) <= 1e-4
            # vLLM's Logprob fields: the value, its rank, the token's own text
            assert abs(entry[t].logprob - v) <= 1e-4 and entry[t].rank == rank
            assert entry[t].decoded_token == tok_text([t])
    assert abs(comp.cumulative_logprob - sum(e[t] for t, e in zip(
        comp.token_ids, comp.logprobs, strict=True))) <= 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        row = ref[j - 1]
        got = out.prompt_logprobs[j][prompt[j]]
        assert abs(got - row[prompt[j]].item()) <= 1e-4
        assert got.rank == int((row > row[prompt[j]]).sum()) + 1
        assert got.decoded_token == tok_text([prompt[j]])
        assert len(out.prompt_logprobs[j]) >= 3


def test_prompt_logprobs_survive_chunked_prefill(model_dir, hf):
    small = LLM(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=8,
                num_gpu_blocks_override=64)
    prompt = _ids(30, 2)
    out = small.generate({"prompt_token_ids": prompt},
                         SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = [out.prompt_logprobs[j][prompt[j]] for j in range(1, 30)]
    want = [ref[j - 1, prompt[j]].item() for j in range(1, 30)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4


def test_a_negative_seed_is_its_unsigned_64_bit_twin_and_minus_one_is_none(llm):
    """Regression: a negative seed was a 400; OpenAI's and vLLM's APIs take any signed
    64-bit seed. It seeds as torch reads it (-2 as 2^64 - 2), but -1 means no seed, as
    vLLM reads it (chat UIs send it for "random"; it gave every request the same tokens)."""
    prompt = {"prompt_token_ids": _ids(6, 3)}
    outs = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=8, n=2),
                         use_tqdm=False)[0] for seed in (-2, 2**64 - 2)]
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in outs[1].outputs]
    assert SamplingParams(seed=-1).seed is None
    unseeded = {tuple(llm.generate(prompt, SamplingParams(temperature=1.0, seed=-1,
                                                          max_tokens=8),
                                   use_tqdm=False)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(unseeded) > 1
    for bad in (-(2**63) - 1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=bad)


def test_seeded_sampling_is_the_same_alone_and_in_a_large_mixed_batch(model_dir):
    tight = LLM(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=48,
                max_num_seqs=12, num_gpu_blocks_override=60)
    target = {"prompt_token_ids": _ids(13, 3)}
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = tight.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": _ids(5 + 7 * i, 100 + i)} for i in range(30)]
    other_params = [SamplingParams(temperature=[0.0, 1.0, 0.7][i % 3], max_tokens=20,
                                   seed=None if i % 2 else i, ignore_eos=True)
                    for i in range(30)]
    prompts = others[:11] + [target] + others[11:]
    params = other_params[:11] + [seeded] + other_params[11:]
    batch = tight.generate(prompts, params, use_tqdm=False)
    assert batch[11].outputs[0].token_ids == alone
    assert tight.llm_engine.stats.num_preemptions > 0, "the batch should also preempt"
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=24,
                                ignore_eos=True)
    assert tight.generate(target, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_sequences_share_the_prompt_blocks_and_differ(llm):
    prompt = {"prompt_token_ids": _ids(40, 4)}
    before = llm.llm_engine.stats.prefix_cache_hits
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8,
                                              ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.llm_engine.stats.prefix_cache_hits - before >= 2 * 36


def test_stop_token_ids_min_tokens_and_max_tokens(llm, hf):
    tok = llm.get_tokenizer()
    prompt_ids = _ids(8, 214)
    prompt = {"prompt_token_ids": prompt_ids}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert free.token_ids == _greedy_reference(hf, prompt_ids, 12)
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                              stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free.token_ids[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    assert out.outputs[0].text == tok.decode(free.token_ids[:first])
    # vLLM's include_stop_str_in_output also keeps a stop token's text
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                               stop_token_ids=[stop_tok],
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(free.token_ids[:first + 1])
    assert kept.text != out.outputs[0].text
    held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                               stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    # Until min_tokens the stop token and EOS are banned: greedy picks the next best instead,
    # for all 12 tokens, and the request ends by length. With this prompt the next best after
    # the stop token is EOS, so a missing EOS ban shows too.
    want = _greedy_reference(hf, prompt_ids, 12, banned=(stop_tok, tok.eos_token_id))
    assert stop_tok in free.token_ids and want != free.token_ids
    assert held.outputs[0].token_ids == want
    assert held.outputs[0].text == tok.decode(want, skip_special_tokens=True)
    assert held.outputs[0].finish_reason == "length"


def test_stop_string_ends_generation_and_is_not_in_the_text(llm):
    prompt = "Hello world"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    assert len(text) >= 6
    stop = text[3:6]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_chat_uses_the_template(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Hello"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]
    assert out.prompt_token_ids == list(want)
    assert len(llm.chat([conv, conv], SamplingParams(max_tokens=2), use_tqdm=False)) == 2


def test_chat_continues_the_final_message_when_asked(llm):
    """vLLM's ``LLM.chat(..., continue_final_message=True)``: the assistant's prefilled
    answer stays open (no end-of-turn after it), and it needs add_generation_prompt off."""
    conv = [{"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi! My name"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("Hi! My name")
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(conv, continue_final_message=True, use_tqdm=False)


PLAIN_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}>>"


def test_chat_takes_a_template_per_call(llm):
    """vLLM's ``LLM.chat(..., chat_template=)``: this call's prompt is that template's."""
    conv = [{"role": "user", "content": "Hello"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                   chat_template=PLAIN_TEMPLATE)[0]
    assert out.prompt == "[user]Hello>>"
    assert out.prompt_token_ids == llm.get_tokenizer().encode("[user]Hello>>",
                                                              add_special_tokens=False)
    default = llm.chat(conv, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert default.prompt.startswith("<|im_start|>user")  # the tokenizer's own, untouched


def test_a_configured_chat_template_file_replaces_the_tokenizers(model_dir, tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=32,
              chat_template=str(path))
    try:
        out = llm.chat([{"role": "user", "content": "Hi"}],
                       SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert out.prompt == "[user]Hi>>"


def test_default_sampling_params_come_from_the_generation_config(model_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.5, "top_k": 7}')
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=32,
              generation_config=str(tmp_path))
    try:
        params = llm.get_default_sampling_params()
    finally:
        llm.shutdown()
    assert (params.temperature, params.top_k, params.top_p) == (0.5, 7, 1.0)


def test_eos_ids_of_the_generation_config_end_a_sequence(model_dir, tmp_path):
    """Regression: generation_config.json's eos_token_id list (an instruct model's
    end-of-turn token) was ignored and generation ran to max_tokens (vLLM stops, with the
    id as stop_reason: it joins the request's stop ids; under ignore_eos min_tokens still
    bans it)."""
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 40]}')
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=32,
              generation_config=str(tmp_path))
    params = dict(temperature=0, max_tokens=4, logit_bias={40: 100.0})
    try:
        out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(**params),
                           use_tqdm=False)[0].outputs[0]
        ignored = llm.generate({"prompt_token_ids": [5, 6]},
                               SamplingParams(**params, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
        held = llm.generate({"prompt_token_ids": [5, 6]},
                            SamplingParams(**params, ignore_eos=True, min_tokens=2),
                            use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([40], "stop", 40)
    assert (ignored.token_ids, ignored.finish_reason) == ([40] * 4, "length")
    assert 40 not in held.token_ids[:2] and held.token_ids[2:] == [40, 40]


def test_a_stop_string_met_only_when_the_last_partial_character_is_flushed_reports_stop(llm):
    """The one token generated is the first byte of a character: its text (U+FFFD) waits
    for a next token that never comes, is flushed at the end and meets the stop string
    there; the text is cut and the finish reason says stop, not length."""
    partial = llm.get_tokenizer().encode("日", add_special_tokens=False)[0]
    params = dict(temperature=0, max_tokens=1, logit_bias={partial: 100.0})
    plain = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(**params),
                         use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == [partial] and plain.text == "\ufffd"
    out = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(**params, stop=["\ufffd"]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", "\ufffd")


def test_penalties_and_logit_bias_steer_greedy_output(llm, hf):
    tok = llm.get_tokenizer()
    prompt_ids = _ids(10, 21)
    prompt = {"prompt_token_ids": prompt_ids}
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                 logit_bias={42: 100.0}), use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [42] * 5
    # A bias of 5 (logits here are within about +-2) makes 42 win until the penalties on its
    # repeats outweigh it. With this prompt, dropping any one of the bias, the repetition
    # penalty on prompt tokens, the frequency or the presence penalty changes the 12 tokens,
    # so the comparison with the reference checks each of them.
    penalties = dict(logit_bias={42: 5.0}, frequency_penalty=0.5, presence_penalty=0.5,
                     repetition_penalty=1.5)
    rep = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              **penalties), use_tqdm=False)[0].outputs[0]
    want = _greedy_reference(hf, prompt_ids, 12, **penalties)
    assert 42 not in prompt_ids and want[0] == 42 and want != [42] * 12
    assert rep.token_ids == want
    assert rep.text == tok.decode(want, skip_special_tokens=True)


def test_max_tokens_past_the_context_stop_at_its_end(model_dir):
    """Regression: prompt + max_tokens over max_model_len raised for the whole batch; as in
    vLLM's offline engine a prompt that fits generates to the context's end ("length")."""
    small = LLM(str(model_dir), dtype="float32", block_size=4, max_model_len=64)
    try:
        out = small.generate([{"prompt_token_ids": [5] * 40}, "Hi"],
                             SamplingParams(max_tokens=100, ignore_eos=True),
                             use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 24
        assert out[0].outputs[0].finish_reason == "length"
        assert out[1].outputs[0].finish_reason == "length"
        assert len(out[1].prompt_token_ids) + len(out[1].outputs[0].token_ids) == 64
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            small.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    finally:
        small.shutdown()


def test_vllm_engine_arguments_that_ask_for_what_kvray_does_are_accepted(model_dir):
    """Scripts written for vLLM pass trust_remote_code, disable_log_stats, load_format...;
    those asking for what kvray does anyway are taken, the others are errors naming them."""
    from kvray.engine.llm import _vllm_engine_args

    taken = _vllm_engine_args(dict(trust_remote_code=True, disable_log_stats=True,
                                   load_format="auto", tokenizer_mode="auto", revision=None,
                                   task="generate", dtype="float32"))
    assert taken == {"log_stats": False, "dtype": "float32"}
    for key, value in [("load_format", "dummy"), ("revision", "v2"), ("cpu_offload_gb", 4),
                       ("tokenizer_mode", "mistral")]:
        with pytest.raises(ConfigError, match=f"{key} = "):
            _vllm_engine_args({key: value})
    with pytest.raises(ConfigError, match="unknown config key"):
        LLM(str(model_dir), not_a_key=1)
    # a format the model's files are not in: an error, as in vLLM (regression: taken)
    assert _vllm_engine_args(dict(model="m.gguf", load_format="gguf"))["model"] == "m.gguf"
    with pytest.raises(ConfigError, match=r"load_format = 'safetensors', but the model "
                                          r"\(m.gguf\) is a GGUF file"):
        _vllm_engine_args(dict(model="m.gguf", load_format="safetensors"))
    with pytest.raises(ConfigError, match="load_format = 'gguf'.* is not a GGUF file"):
        _vllm_engine_args(dict(model=str(model_dir), load_format="gguf"))


def test_sampling_params_refuse_values_of_the_wrong_type():
    """Regression: max_tokens=2.5, n=2.0, temperature=inf and stop_token_ids="abc" were
    taken (the first failed deep in the engine); numpy integers still are."""
    import numpy as np

    for bad in [dict(max_tokens=2.5), dict(n=2.0), dict(top_k=2.5), dict(temperature=float("inf")),
                dict(stop_token_ids="abc"), dict(stop_token_ids=[-1]), dict(n="2")]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    params = SamplingParams(seed=np.int64(3), max_tokens=np.int32(5))
    assert (params.seed, params.max_tokens) == (3, 5) and type(params.seed) is int
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=True)
    # vLLM takes a bool number of log-probs as 0 / 1 (its own tests pass True)
    params = SamplingParams(logprobs=True, prompt_logprobs=False)
    assert (params.logprobs, params.prompt_logprobs) == (1, 0)


def test_stop_reason_is_the_stop_token_and_none_at_eos(llm, model_dir):
    """vLLM's stop_reason: the matched stop string or stop token id, None when EOS ended
    the output (so a script can tell the two apart)."""
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100},
                                      stop_token_ids=[eos]), use_tqdm=False)[0].outputs[0]
    assert out.stop_reason == eos  # asked for by id: named


def test_chat_takes_text_parts_and_a_lora_request_as_vllm_does(llm):
    """OpenAI-style content parts are joined into the template's string, one per line as
    vLLM joins them; other part types are refused."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                          {"type": "text", "text": "lo"}]}]
    plain = [{"role": "user", "content": "Hel\nlo"}]
    params = SamplingParams(temperature=0, max_tokens=3)
    a = llm.chat(parts, params, use_tqdm=False)[0]
    b = llm.chat(plain, params, use_tqdm=False, lora_request=None)[0]
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].text == b.outputs[0].text
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="content.0.type: content part type 'image_url'"):
        llm.chat(image, params, use_tqdm=False)


def test_reset_prefix_cache_forgets_cached_prompts(llm):
    """vLLM's ``LLM.reset_prefix_cache``: a repeated prompt hits the cache before it and
    misses after it (a benchmark's rounds start cold); the outputs stay the same."""
    stats = llm.llm_engine.scheduler.kv.stats
    prompt = {"prompt_token_ids": list(range(20, 60))}
    params = SamplingParams(temperature=0, max_tokens=3)
    first = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    hits = stats.hits
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == first and again.outputs[0].finished()
    assert stats.hits > hits and again.num_cached_tokens >= 36  # vLLM's field
    assert llm.reset_prefix_cache()
    hits = stats.hits
    cold = llm.generate(prompt, params, use_tqdm=False)[0]
    assert cold.outputs[0].token_ids == first
    assert stats.hits == hits and cold.num_cached_tokens == 0


def test_invalid_requests_fail_before_queueing(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 1030}, SamplingParams(max_tokens=1),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [VOCAB_SIZE + 5]}, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_k"):  # would overflow int64 in the sampler
        SamplingParams(top_k=2**63)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate("a", SamplingParams(max_tokens=1), priority=[3], use_tqdm=False)  # vLLM's
    assert not engine.has_unfinished_requests()
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.llm_engine
    engine.add_request("x", {"prompt_token_ids": _ids(30, 8)},
                       SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.stats.kv_cache_usage > 0
    assert engine.abort_request("x") and not engine.abort_request("x")
    # gauges are truthful right away: no step follows an abort when nothing else runs
    assert engine.stats.kv_cache_usage == 0.0 and engine.stats.num_running == 0
    engine.step()
    assert engine.scheduler.kv.pool.num_free == engine.stats.num_blocks
    assert not engine.has_unfinished_requests()


def test_published_stats_are_a_consistent_copy_for_other_threads(llm):
    """Readers on other threads (the server's stats reporter) get the engine thread's copy
    after each update, never the live object it is changing: a regression test for
    /metrics showing a running request with an empty KV cache."""
    engine = llm.llm_engine
    assert engine.published_stats.num_blocks == engine.stats.num_blocks > 0
    engine.add_request("pub", {"prompt_token_ids": _ids(12, 9)},
                       SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    published = engine.published_stats
    assert published is not engine.stats and published == engine.stats
    assert published.num_running == 1 and published.kv_cache_usage > 0
    while engine.has_unfinished_requests():
        engine.step()
    assert published.num_running == 1  # the copy a reader holds never changes under it
    assert engine.published_stats.num_running == 0


def test_decode_step_time_counts_the_step_itself(llm):
    """The in-process executor runs a step inside ``submit_step``: the time must be taken
    before it (a regression test: benchmarks read ~0.1 ms per decode step and reported
    decode efficiency of 500,000 % of the matmul peak)."""
    engine = llm.llm_engine
    before_time, before_tokens = engine.stats.decode_time_s, engine.stats.decode_tokens
    before_steps, before_busy = engine.stats.num_decode_steps, engine.stats.step_time_s
    engine.add_request("timed", {"prompt_token_ids": _ids(12, 3)},
                       SamplingParams(max_tokens=6, ignore_eos=True))
    wall = 0.0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        wall += time.perf_counter() - start
    decode_time = engine.stats.decode_time_s - before_time
    assert engine.stats.decode_tokens - before_tokens == 5  # 6 tokens: 1 prefill, 5 decode
    assert 0.3 * wall < decode_time <= wall
    assert engine.stats.num_decode_steps - before_steps == 5
    busy = engine.stats.step_time_s - before_busy  # the prefill step too
    assert decode_time < busy <= wall


def test_request_metrics_are_filled(llm):
    out = llm.generate("Hi", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.queue_time >= 0 and m.time_to_first_token > 0


def test_prompt_logprobs_stay_exact_when_the_request_is_preempted(model_dir, hf):
    """A recomputed request reports its prompt logprobs once, in order, without gaps."""
    tight = LLM(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=8,
                num_gpu_blocks_override=20)
    first = {"prompt_token_ids": _ids(30, 20)}
    second = _ids(40, 21)
    outs = tight.generate(
        [first, {"prompt_token_ids": second}],
        [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0),
         SamplingParams(max_tokens=2, prompt_logprobs=0, temperature=0)], use_tqdm=False)
    assert tight.llm_engine.stats.num_preemptions > 0
    got = outs[1].prompt_logprobs
    assert len(got) == len(second) and got[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([second])).logits[0].float(), dim=-1)
    for j in range(1, len(second)):
        assert abs(got[j][second[j]] - ref[j - 1, second[j]].item()) <= 1e-4


def test_shutdown_frees_the_model_and_kv_cache_for_the_next_engine(model_dir):
    """shutdown() hands the weights, KV cache and graphs back at once (on CUDA the next
    engine's gpu_memory_utilization budget counts every tensor the process still holds),
    even while the caller keeps a reference to the runner; a second engine then works."""
    import gc
    import weakref

    first = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=32)
    runner = first.llm_engine.executor.worker.runner
    model, cache = weakref.ref(runner.model), weakref.ref(runner.cache.kv_caches[0])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = first.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    first.shutdown()
    gc.collect()
    assert runner.model is None and runner.cache is None
    assert model() is None and cache() is None
    second = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=32)
    got = second.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    second.shutdown()
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_shutdown_leaves_the_callers_process_group_alone(model_dir, tmp_path):
    """An in-process engine (TP = PP = 1) joins no process group, so it must not destroy
    one the user's program set up before building it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        llm = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=16)
        llm.shutdown()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_start_up_is_broken_down_by_part(llm):
    """Workers and weights, KV cache, the rest; per rank how the CPU kernels came (this
    machine's build cache, compiled, the cluster's, or not used)."""
    report = llm.llm_engine.startup
    assert report["total_s"] >= report["workers_s"] + report["kv_cache_s"] - 1e-3
    [rank] = report["ranks"]
    assert 0 < rank["load_s"] <= report["workers_s"]
    assert rank["kernels"]["source"] in ("cache", "compiled", "cluster", "unused",
                                         "unavailable")


def test_allowed_token_ids_detokenize_and_truncation(llm, hf):
    """vLLM's SamplingParams fields that kvray lacked: ``allowed_token_ids`` (greedy over
    those ids only), ``detokenize=False`` (ids, no text), ``truncate_prompt_tokens`` (the
    prompt's last k) and ``clone`` (bad_words: tests/test_builtin_model.py)."""
    prompt = _ids(15, 40)
    allowed = sorted(set(_ids(12, 41)))
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
        use_tqdm=False)[0].outputs[0].token_ids
    others = tuple(t for t in range(VOCAB_SIZE) if t not in allowed)
    assert got == _greedy_reference(hf, prompt, 6, banned=others)

    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0].outputs[0]
    params = plain.clone()
    params.stop_token_ids.append(5)
    assert plain.stop_token_ids == []  # clone: a deep copy
    quiet = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, detokenize=False),
        use_tqdm=False)[0].outputs[0]
    assert quiet.text == "" and quiet.token_ids == free.token_ids

    cut = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=5),
        use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-5:]
    assert cut.outputs[0].token_ids == _greedy_reference(hf, prompt[-5:], 4)

    for kwargs, field in [({"allowed_token_ids": []}, "allowed_token_ids"),
                          ({"bad_words": [" "]}, "bad_words"),
                          ({"stop": ["x"], "detokenize": False}, "stop"),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("hi", SamplingParams(allowed_token_ids=[VOCAB_SIZE + 5]), use_tqdm=False)


def test_bad_words_ban_a_words_last_token_after_the_rest():
    params = SamplingParams(min_tokens=2, stop_token_ids=[9])
    params.bad_words_token_ids = ((4,), (7, 8), (1, 2, 3))
    assert params.banned_after([]) == [9, 4]  # min_tokens holds the stop id back too
    assert params.banned_after([5, 7]) == [4, 8]
    assert params.banned_after([0, 1, 2]) == [4, 3]
    assert params.banned_after([2, 1]) == [4]


def test_chat_hands_templates_parts_when_asked(llm):
    """vLLM's ``chat_template_content_format``: ``openai`` gives the template a message's
    text parts (a string content becomes one part), ``auto`` / ``string`` one string."""
    parts_template = ("{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]"
                      "{% endfor %}{% endfor %}")
    plain_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    conv = [{"role": "user", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]
    params = SamplingParams(max_tokens=1)
    parts = llm.chat(conv, params, use_tqdm=False, chat_template=parts_template,
                     chat_template_content_format="openai", add_generation_prompt=False)[0]
    assert parts.prompt == "[hi][a][b]"
    joined = llm.chat(conv, params, use_tqdm=False, chat_template=plain_template,
                      add_generation_prompt=False)[0]
    assert joined.prompt == "<hi><a\nb>"  # parts one per line, as vLLM joins them
    detected = llm.chat(conv, params, use_tqdm=False, chat_template=parts_template,
                        add_generation_prompt=False)[0]  # auto: the template loops: parts
    assert detected.prompt == "[hi][a][b]"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(conv, params, chat_template_content_format="xml")


def test_chat_hands_templates_earlier_tool_call_arguments_as_objects(llm):
    """As vLLM's LLM.chat (and kvray's HTTP chat): OpenAI's JSON-text arguments become an
    object (regression: a tojson template encoded the text a second time)."""
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    conv = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function",
                 "function": {"name": "f", "arguments": '{"city": "Paris"}'}}]}]
    out = llm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                   add_generation_prompt=False)[0]
    assert out.prompt == '{"city": "Paris"}'


def test_a_vllm_style_script_builds_its_engine_from_cli_flags(model_dir):
    """vLLM's examples: ``EngineArgs.add_cli_args`` on a ``FlexibleArgumentParser`` (flags
    with - or _), ``LLM(**vars(args))`` with every unset flag None, and
    ``LLMEngine.from_engine_args`` stepped by hand."""
    from kvray import EngineArgs, LLMEngine
    from kvray.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--max-tokens", type=int, default=4)  # the script's own flag
    argv = ["--model", str(model_dir), "--dtype", "float32", "--block_size", "4",
            "--max-tokens", "3"]
    args = vars(parser.parse_args(argv))
    max_tokens = args.pop("max_tokens")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(**args)
    try:
        want = llm.generate({"prompt_token_ids": [5, 6, 7]}, params,
                            use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert len(want) == 3
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(argv)))
    try:
        assert engine.config.cache.block_size == 4
        engine.add_request("0", {"prompt_token_ids": [5, 6, 7]}, params)
        done = []
        while engine.has_unfinished_requests():
            done += [out for out in engine.step() if out.finished]
        assert [out.outputs[0].token_ids for out in done] == [want]
    finally:
        engine.shutdown()


def test_skip_tokenizer_init_runs_token_ids_without_a_tokenizer(model_dir, llm, tmp_path):
    """vLLM's skip_tokenizer_init: no tokenizer is loaded (a folder without tokenizer files
    runs), token-id prompts give the tokens a tokenizer-bearing engine gives with empty
    text, and whatever needs text is a ValueError naming it."""
    import shutil

    bare = tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns(
        "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt"))
    skipped = LLM(str(bare), skip_tokenizer_init=True, dtype="float32", block_size=4,
                  max_num_batched_tokens=64, max_num_seqs=16, num_gpu_blocks_override=96)
    try:
        assert skipped.llm_engine.tokenizer is None
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2,
                                prompt_logprobs=1, detokenize=True)
        prompts = [{"prompt_token_ids": _ids(n, seed=n)} for n in (5, 11)]
        got = skipped.generate(prompts, params, use_tqdm=False)
        want = llm.generate(prompts, params, use_tqdm=False)
        for g, w in zip(got, want, strict=True):
            assert g.outputs[0].text == "" and w.outputs[0].text != ""
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            step = g.outputs[0].logprobs[0]
            assert all(lp.decoded_token is None for lp in step.values())
            assert {t: lp.logprob for t, lp in step.items()} == pytest.approx(
                {t: lp.logprob for t, lp in w.outputs[0].logprobs[0].items()})
        with pytest.raises(ValueError, match="cannot pass text prompts when"):
            skipped.generate("abc", params, use_tqdm=False)
        for bad in (dict(stop=["x"]), dict(bad_words=["x"])):
            with pytest.raises(ValueError, match=f"{next(iter(bad))} needs the tokenizer"):
                skipped.generate(prompts, SamplingParams(max_tokens=2, **bad), use_tqdm=False)
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            skipped.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
        # the engine still serves the next request
        again = skipped.generate(prompts[:1], params, use_tqdm=False)
        assert again[0].outputs[0].token_ids == got[0].outputs[0].token_ids
    finally:
        skipped.shutdown()
    with pytest.raises(Exception, match="(?i)tokenizer"):
        LLM(str(bare), dtype="float32")
