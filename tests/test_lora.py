"""Multi-LoRA: PEFT adapters give PEFT's greedy tokens in batches that mix adapters and the
base model (ranks 8 and 64, two architectures, the fused C++ decode layer and the PyTorch
reference path, preemption by recompute and swap, speculative decoding); adapters never
share KV; the scheduler keeps at most ``max_loras`` adapters running; a bad adapter is a
clear error naming the cause; the batched kernel matches its reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvray import LLM, LoRARequest, SamplingParams
from kvray.config import ConfigError, load_config
from kvray.errors import NotFoundError
from kvray.kernels.lora import lora_add_reference
from kvray.lora.adapter import load_adapter
from kvray.lora.layers import LoRABatch, LoRAWeights
from kvray.lora.request import LoRAError
from kvray.models.loader import open_checkpoint
from kvray.models.spec import ModelSpec
from kvray.scheduler.lora_slots import LoRASlots
from tests.helpers.lora import ATTN, make_lora_adapter, peft_greedy
from tests.helpers.tiny_models import VOCAB_SIZE

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(n: int = 8, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [5, 17, 40, 3, 9, 30, 22, 12, 7, 26][:n]
    prompts = [torch.randint(3, VOCAB_SIZE, (k,), generator=g).tolist() for k in lens]
    prompts[4] = list(prompts[2])  # the same prompt under another adapter: no shared KV
    return prompts


@pytest.fixture(scope="module")
def lora_setup(tiny_model_dir, tmp_path_factory):
    """Per architecture: the base model, three adapters (rank 8 on every projection; rank
    64 rsLoRA on q, v, down; rank 16 on attention only) and PEFT's tokens for a batch that
    mixes them with the base model."""
    root = tmp_path_factory.mktemp("lora")
    cache = {}

    def get(arch: str):
        if arch in cache:
            return cache[arch]
        base = tiny_model_dir(arch)
        adapters = {
            "r8": make_lora_adapter(base, root / arch / "r8", rank=8, seed=1),
            "r64": make_lora_adapter(base, root / arch / "r64", rank=64, seed=2,
                                     targets=["q_proj", "v_proj", "down_proj"], rslora=True),
            "attn": make_lora_adapter(base, root / arch / "attn", rank=16, seed=3,
                                      targets=ATTN, alpha=8),
        }
        prompts = _prompts()
        names = [None, "r8", "r64", None, "attn", "r8", "r64", "attn"]
        expected = [peft_greedy(base, adapters[n] if n else None, [p], MAX_TOKENS)[0]
                    for p, n in zip(prompts, names, strict=True)]
        cache[arch] = (base, adapters, prompts, names, expected)
        return cache[arch]

    return get


def _requests(adapters) -> dict:
    return {name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(sorted(adapters.items()))}


def _generate(llm: LLM, prompts, names, requests, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[requests[n] if n else None for n in names])
    return [list(o.outputs[0].token_ids) for o in outs]


# ---- parity with PEFT ---------------------------------------------------------------------
@pytest.mark.parity
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_qknorm_headdim"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mixed_adapter_batch_matches_peft(lora_setup, arch, backend):
    """One batch of three adapters and the base model: each request gets PEFT's tokens, on
    the C++ kernels (fused decode layer) and on the PyTorch reference path."""
    base, adapters, prompts, names, expected = lora_setup(arch)
    base_tokens = peft_greedy(base, None, prompts, MAX_TOKENS)
    # the adapters change the outputs (else the test could not fail)
    assert sum(e != b for e, b in zip(expected, base_tokens, strict=True)) >= 5
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=3,
              max_lora_rank=64, attention_backend=backend)
    try:
        assert _generate(llm, prompts, names, _requests(adapters)) == expected
    finally:
        llm.shutdown()


@pytest.mark.parity
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_adapters_survive_preemption(lora_setup, mode):
    """A cache too small for the batch preempts requests mid-generation (and evicts adapter
    slots: max_loras 2 of 3 adapters); each still ends with PEFT's tokens."""
    base, adapters, prompts, names, expected = lora_setup("llama_gqa")
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=2,
              max_lora_rank=64, num_gpu_blocks_override=24, max_num_seqs=8,
              preemption_mode=mode, swap_space=0.05)
    try:
        assert _generate(llm, prompts, names, _requests(adapters)) == expected
        assert llm.llm_engine.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()


@pytest.mark.parity
def test_adapters_with_ngram_speculation_match_peft(lora_setup):
    base, adapters, prompts, names, expected = lora_setup("llama_gqa")
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=3,
              max_lora_rank=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        assert _generate(llm, prompts, names, _requests(adapters)) == expected
    finally:
        llm.shutdown()


@pytest.mark.parity
def test_beam_search_runs_each_prompts_adapter(lora_setup):
    """``LLM.beam_search(lora_request=...)`` (vLLM's): one beam is greedy search, so each
    prompt's sequence is PEFT's greedy tokens under its own adapter."""
    from kvray.engine.beam_search import BeamSearchParams

    base, adapters, prompts, names, expected = lora_setup("llama_gqa")
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=3,
              max_lora_rank=64)
    try:
        requests = _requests(adapters)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts[:4]],
                               BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS,
                                                ignore_eos=True),
                               lora_request=[requests[n] if n else None for n in names[:4]])
        for p, out, want in zip(prompts, outs, expected, strict=False):
            assert out.sequences[0].token_ids == want
            assert out.sequences[0].tokens == p + want  # vLLM's field: prompt included
    finally:
        llm.shutdown()


@pytest.mark.parity
def test_adapter_output_does_not_depend_on_its_batch(lora_setup):
    """An int8-quantized base with adapters: a request's tokens are the same alone and in a
    batch of other adapters (and differ from the base model's)."""
    base, adapters, prompts, names, _ = lora_setup("llama_gqa")
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=3,
              max_lora_rank=64, quantization="int8")
    try:
        requests = _requests(adapters)
        mixed = _generate(llm, prompts, names, requests)
        alone = [_generate(llm, [p], [n], requests)[0] for p, n in zip(prompts, names,
                                                                        strict=True)]
        assert mixed == alone
        plain = _generate(llm, prompts, [None] * len(prompts), requests)
        assert sum(m != p for m, p in zip(mixed, plain, strict=True)) >= 4
    finally:
        llm.shutdown()


# ---- the engine's bookkeeping ---------------------------------------------------------------
@pytest.mark.engine
def test_prefix_cache_is_per_adapter(lora_setup):
    """The same prompt under two adapters and the base: no adapter reuses another's cached
    blocks (its tokens stay PEFT's), while a repeat under the same adapter hits."""
    base, adapters, prompts, _, _ = lora_setup("llama_gqa")
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=3,
              max_lora_rank=64, enable_prefix_caching=True)
    try:
        requests = _requests(adapters)
        prompt = prompts[2]  # 40 tokens: ten full blocks
        stats = llm.llm_engine.scheduler.kv.stats
        got = {}
        for name in (None, "r8", "attn"):
            hits = stats.hits
            got[name] = _generate(llm, [prompt], [name], requests)[0]
            assert stats.hits == hits, f"{name} reused another adapter's blocks"
        hits = stats.hits
        assert _generate(llm, [prompt], ["r8"], requests)[0] == got["r8"]
        assert stats.hits > hits
        assert got["r8"] == peft_greedy(base, adapters["r8"], [prompt], MAX_TOKENS)[0]
    finally:
        llm.shutdown()


@pytest.mark.engine
def test_a_lora_int_id_given_again_after_unloading_runs_the_new_adapter(lora_setup):
    """Regression: unloading adapter A and loading C under A's ``lora_int_id`` (a hot
    reload) ran A's weights, still in the workers' slot under that id, and could reuse A's
    cached blocks; the registry's own ids are never reused, so C gives PEFT's tokens."""
    base, adapters, prompts, _, _ = lora_setup("llama_gqa")
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=2,
              max_lora_rank=64, enable_prefix_caching=True)
    try:
        prompt = prompts[2]
        first = LoRARequest("first", 7, str(adapters["r8"]))
        assert _generate(llm, [prompt], ["a"], {"a": first})[0] == peft_greedy(
            base, adapters["r8"], [prompt], MAX_TOKENS)[0]
        with pytest.raises(LoRAError, match="lora_int_id 7 already names adapter 'first'"):
            llm.add_lora(LoRARequest("other", 7, str(adapters["attn"])))
        assert llm.remove_lora("first")
        again = LoRARequest("second", 7, str(adapters["attn"]))
        assert _generate(llm, [prompt], ["a"], {"a": again})[0] == peft_greedy(
            base, adapters["attn"], [prompt], MAX_TOKENS)[0]
    finally:
        llm.shutdown()


@pytest.mark.engine
def test_vllm_engine_and_request_names_for_adapters(lora_setup):
    """vLLM's spellings: ``LoRARequest(lora_local_path=...)``, ``RequestOutput.lora_request``
    (the adapter a request ran with), ``LLMEngine.add_lora`` / ``list_loras`` (ids) /
    ``remove_lora`` (by id)."""
    base, adapters, prompts, _, _ = lora_setup("llama_gqa")
    old_style = LoRARequest("old", 3, lora_local_path=str(adapters["r8"]))
    assert old_style.lora_path == old_style.path == str(adapters["r8"])
    assert (old_style.adapter_id, old_style.name) == (3, "old")
    with pytest.raises(LoRAError, match="lora_path"):
        LoRARequest("nowhere", 4)
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=2,
              max_lora_rank=64)
    try:
        engine = llm.llm_engine
        assert engine.add_lora(old_style) and engine.list_loras() == {3}
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY,
                            use_tqdm=False, lora_request=[old_style, None])
        assert outs[0].lora_request == old_style and outs[1].lora_request is None
        assert engine.remove_lora(3) and engine.list_loras() == set()
        assert not engine.remove_lora(3)
    finally:
        llm.shutdown()


@pytest.mark.engine
def test_unknown_and_unfit_adapters_are_refused_and_the_engine_goes_on(lora_setup, tmp_path):
    base, adapters, prompts, _, _ = lora_setup("llama_gqa")
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=2,
              max_lora_rank=16)
    try:
        engine = llm.llm_engine
        with pytest.raises(NotFoundError, match="does not exist"):
            engine.add_request("x", prompts[0], GREEDY, lora_request="nope")
        with pytest.raises(LoRAError, match="max_lora_rank"):
            llm.generate([prompts[0]], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("big", 9, str(adapters["r64"])))
        assert not engine.has_unfinished_requests()
        llm.add_lora(LoRARequest("r8", 1, str(adapters["r8"])))
        assert llm.list_loras() == ["r8"]
        out = _generate(llm, [prompts[0]], ["r8"], {"r8": "r8"})
        assert out == [peft_greedy(base, adapters["r8"], [prompts[0]], MAX_TOKENS)[0]]
        assert llm.remove_lora("r8") and not llm.remove_lora("r8")
        with pytest.raises(NotFoundError):
            engine.add_request("y", prompts[0], GREEDY, lora_request="r8")
    finally:
        llm.shutdown()


@pytest.mark.engine
def test_at_most_max_loras_adapters_run_at_once(lora_setup):
    """Six requests over three adapters with max_loras 2: no step runs three adapters, and
    every request finishes with its adapter's tokens."""
    base, adapters, prompts, _, _ = lora_setup("llama_gqa")
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=2,
              max_lora_rank=64)
    try:
        engine, requests = llm.llm_engine, _requests(adapters)
        names = ["r8", "r64", "attn", "attn", "r64", "r8"]
        for i, (p, n) in enumerate(zip(prompts, names, strict=False)):
            engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY,
                               lora_request=requests[n])
        seen = 0
        done = {}
        while engine.has_unfinished_requests():
            running = {r.lora_id for r in engine.scheduler.running}
            seen = max(seen, len(running))
            assert len(running) <= 2
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        assert seen == 2
        for i, n in enumerate(names):
            assert done[str(i)] == peft_greedy(base, adapters[n], [prompts[i]], MAX_TOKENS)[0]
    finally:
        llm.shutdown()


@pytest.mark.engine
def test_structured_outputs_hold_under_adapters(lora_setup):
    """A JSON-schema constraint on requests of two adapters and the base model in one
    batch: every output parses and validates."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"enum": [1, 22, 333]},
                                               "w": {"enum": ["ab", "cd"]}},
              "required": ["n", "w"], "additionalProperties": False}
    base, adapters, prompts, _, _ = lora_setup("llama_gqa")
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=3,
              max_lora_rank=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=100,
                                structured_outputs={"json": schema})
        requests = _requests(adapters)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params,
                            use_tqdm=False,
                            lora_request=[None, requests["r8"], requests["attn"]])
    finally:
        llm.shutdown()
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


# ---- adapter validation -------------------------------------------------------------------
def read_spec(path) -> ModelSpec:
    return ModelSpec.from_hf_config(open_checkpoint(path).hf_config)


def _copy_adapter(src, dst, edit_config=None, edit_tensors=None):
    dst.mkdir(parents=True)
    config = json.loads((src / "adapter_config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if edit_tensors:
        tensors = edit_tensors(tensors)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.mark.parity
def test_bad_adapters_name_the_cause(lora_setup, tiny_model_dir, tmp_path):
    base, adapters, _, _, _ = lora_setup("llama_gqa")
    spec = read_spec(base)
    src = adapters["r8"]

    def check(path, pattern, rank=64):
        with pytest.raises(LoRAError, match=pattern):
            load_adapter(LoRARequest("x", 1, str(path)), spec, rank)

    check(src, "exceeds max_lora_rank", rank=4)
    check(tmp_path / "missing", "not a directory")
    check(_copy_adapter(src, tmp_path / "dora", lambda c: c.update(use_dora=True)), "DoRA")
    check(_copy_adapter(src, tmp_path / "save", lambda c: c.update(
        modules_to_save=["lm_head"])), "modules_to_save")
    # options that change the forward pass are refused, not served as a plain LoRA
    for key, value, pattern in [("layer_replication", [[0, 2], [1, 2]], "layer replication"),
                                ("alora_invocation_tokens", [5, 6], "activated LoRA"),
                                ("use_qalora", True, "QA-LoRA"),
                                ("use_bdlora", {"lora_a_is_blockdiagonal": ["q_proj"]},
                                 "block-diagonal"),
                                ("arrow_config", {"top_k": 2}, "Arrow")]:
        check(_copy_adapter(src, tmp_path / key, lambda c, k=key, v=value: c.update({k: v})),
              pattern)

    # no lora_alpha saved: PEFT's default (8), not the rank
    plain = load_adapter(LoRARequest("x", 1, str(adapters["r64"])), spec, 64)
    unsaid = load_adapter(LoRARequest("x", 1, str(_copy_adapter(
        adapters["r64"], tmp_path / "no_alpha", lambda c: c.pop("lora_alpha")))), spec, 64)
    for key, slots in plain.weights.items():  # rsLoRA, r 64: alpha 16 -> 2.0, unsaid -> 1.0
        for index, (_, b) in slots.items():
            assert torch.allclose(unsaid.weights[key][index][1] * 2.0, b), key

    def wrong_shape(t):
        key = next(k for k in t if "q_proj.lora_A" in k)
        t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 8)
        return t
    check(_copy_adapter(src, tmp_path / "shape", edit_tensors=wrong_shape), "another base")

    def embed(t):
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
        return t
    check(_copy_adapter(src, tmp_path / "head", edit_tensors=embed), "not a LoRA weight")

    def extra_layer(t):
        t["base_model.model.model.layers.99.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 64)
        return t
    check(_copy_adapter(src, tmp_path / "layer", edit_tensors=extra_layer), "layer 99")

    def only_a(t):
        return {k: v for k, v in t.items() if "o_proj.lora_B" not in k}
    check(_copy_adapter(src, tmp_path / "half", edit_tensors=only_a), "no lora_B")
    bad_json = _copy_adapter(src, tmp_path / "json")
    (bad_json / "adapter_config.json").write_text("{oops")
    check(bad_json, "not valid JSON")
    moe = read_spec(tiny_model_dir("mixtral_moe"))

    def moe_mlp(t):
        return {"base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight":
                torch.zeros(8, moe.hidden_size),
                "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight":
                torch.zeros(moe.intermediate_size, 8)}
    path = _copy_adapter(src, tmp_path / "moe", edit_tensors=moe_mlp)
    with pytest.raises(LoRAError, match="mixture-of-experts"):
        load_adapter(LoRARequest("x", 1, str(path)), moe, 64)


@pytest.mark.parity
def test_registry_keeps_max_cpu_loras_and_pins_live_adapters(lora_setup, tmp_path):
    """Host copies beyond max_cpu_loras go, least recently used first, except an adapter a
    live request runs with; a dropped one is read again when needed; an adapter unloaded
    while in use stays until its last request ends."""
    from kvray.config import LoRAConfig
    from kvray.lora.manager import LoRARegistry

    base, adapters, _, _, _ = lora_setup("llama_gqa")
    registry = LoRARegistry(LoRAConfig(max_loras=1, max_cpu_loras=2, max_lora_rank=64),
                            read_spec(base))
    ids = {name: registry.register(name, str(path)).lora_int_id
           for name, path in sorted(adapters.items())}  # attn, r64, r8: attn dropped
    assert registry.adapter(ids["attn"]) is None and registry.adapter(ids["r8"]) is not None
    reads = registry.stats.num_reads
    assert registry.payload(ids["attn"])  # read again (r64, the coldest, goes)
    assert registry.stats.num_reads == reads + 1
    registry.retain(ids["attn"], "attn")  # a live request pins it
    registry.payload(ids["r64"])
    registry.payload(ids["r8"])
    assert registry.adapter(ids["attn"]) is not None
    assert registry.unregister("attn") and registry.names() == ["r64", "r8"]
    assert registry.payload(ids["attn"])  # its running request still gets it
    registry.release(ids["attn"])
    assert registry.adapter(ids["attn"]) is None
    with pytest.raises(NotFoundError):
        registry.resolve("attn")


@pytest.mark.unit
def test_lora_config_forms_and_errors():
    config = load_config(None, lora_modules=["a=/p/a", '{"name": "b", "path": "/p/b"}'])
    assert config.lora.lora_modules == {"a": "/p/a", "b": "/p/b"} and config.lora.enabled
    assert load_config(None, lora_modules="a=/x,b=/y").lora.lora_modules == {"a": "/x",
                                                                             "b": "/y"}
    assert not load_config(None).lora.enabled
    for value, pattern in ((["a"], "not name=path"), (["a=/x", "a=/y"], "given twice"),
                           (["bad name=/x"], "adapter name"), (["a= "], "empty path")):
        with pytest.raises(ConfigError, match=pattern):
            load_config(None, lora_modules=value)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        load_config(None, max_loras=8, max_cpu_loras=4)
    with pytest.raises(ConfigError, match="max_lora_rank"):
        load_config(None, max_lora_rank=0)


@pytest.mark.unit
def test_slots_evict_the_least_recently_used_idle_adapter():
    from collections import Counter

    slots = LoRASlots(2)
    assert slots.acquire(1, Counter({1: 1})) == (0, True)
    assert slots.acquire(2, Counter({1: 1, 2: 1})) == (1, True)
    assert slots.acquire(1, Counter({1: 2, 2: 1})) == (0, False)
    # 3 needs a slot: 2 is idle (1 still runs), so 2's slot goes
    assert slots.acquire(3, Counter({1: 1, 3: 1})) == (1, True)
    assert slots.slot(2) is None
    with pytest.raises(RuntimeError):
        slots.acquire(4, Counter({1: 1, 3: 1}))


# ---- the batched kernel -------------------------------------------------------------------
@pytest.mark.parity
@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32),
                                                (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.bfloat16)])
def test_cpu_lora_kernel_matches_reference(cpu_kernels, dtype, weight_dtype):
    """Slices of odd widths (blocks straddling them), ranks 0..16 per slot and slice, rows
    of no adapter, one row and many: the C++ kernel adds what the reference adds."""
    g = torch.Generator().manual_seed(0)
    sizes, slots, max_rank, k = [70, 40, 40], 4, 16, 96
    weights = LoRAWeights(LoRABatch(), sizes, k, slots, max_rank, weight_dtype,
                          torch.device("cpu"), lora_add_reference)
    for s in range(slots):
        for i, size in enumerate(sizes):
            r = [0, 4, 8, 16][(s + i) % 4]
            if r:
                weights.set(s, i, torch.randn(r, k, generator=g), torch.randn(size, r,
                                                                               generator=g))
    for rows in (1, 37, 300):
        x = torch.randn(rows, k, generator=g).to(dtype)
        y = torch.randn(rows, sum(sizes), generator=g).to(dtype)
        row_slots = torch.randint(-1, slots, (rows,), generator=g)
        want = lora_add_reference(y.clone(), x, weights.a, weights.bt, weights.ranks,
                                  weights.slice_starts, row_slots)
        got = cpu_kernels.lora_add(y.clone(), x, weights.a, weights.bt, weights.ranks,
                                   weights.slice_starts, row_slots)
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        untouched = row_slots < 0
        assert torch.equal(got[untouched], y[untouched])
