"""The CUDA path on a real GPU: skipped without one (run by benchmarks/gpu_check.sh on a
lent machine). What cannot run on CPU: the Triton kernels compiled for the GPU in bf16,
the engine with CUDA graphs captured and replayed, NCCL-free TP=1 parity with transformers
on the GPU, pinned inputs, and the KV cache sized by the profile run against
gpu_memory_utilization."""

from __future__ import annotations

import pytest
import torch

from kvray import LLM, SamplingParams
from kvray.kernels import attention as ref
from kvray.kernels import triton_attention, triton_ops
from tests.helpers.tiny_models import VOCAB_SIZE, load_hf, runner_facts

pytestmark = pytest.mark.gpu

MAX_TOKENS = 12


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (int(n),), generator=g).tolist()
            for n in torch.randint(3, 60, (count,), generator=g)]


def _hf_greedy(model_dir, prompts: list[list[int]], dtype=torch.float32) -> list[list[int]]:
    hf = load_hf(model_dir).to("cuda", dtype)
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_TOKENS,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
                .tolist() for p in prompts]


def _kvray(model_dir, prompts, **kwargs):
    llm = LLM(str(model_dir), gpu_memory_utilization=0.3, max_num_seqs=16, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = runner_facts(llm)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], runner


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernels_match_reference_in_half_precision(dtype):
    triton_attention.self_check("cuda", dtype)
    triton_ops.self_check("cuda", dtype)


def test_paged_decode_on_long_contexts_matches_reference():
    """Many blocks per sequence: every split of the flash-decoding kernel has work."""
    g = torch.Generator().manual_seed(0)
    hq, hk, dim, bs, num_blocks = 32, 8, 128, 16, 1024
    cache = torch.randn(2, hk, num_blocks, bs, dim, generator=g).to("cuda", torch.bfloat16)
    lens = torch.tensor([4000, 1, 2500, 17], device="cuda")
    tables = torch.randperm(num_blocks, generator=g)[:4 * 250].view(4, 250).to("cuda")
    q = torch.randn(4, hq, dim, generator=g).to("cuda", torch.bfloat16)
    got = triton_attention.paged_decode(q, cache, tables, lens, dim ** -0.5, None)
    want = torch.cat([ref._decode(q[i:i + 1], cache, tables[i:i + 1], lens[i:i + 1],
                                  int(lens[i]), dim ** -0.5, None) for i in range(4)])
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3_qknorm_headdim", "llama3_rope_tied"])
def test_engine_on_gpu_gives_transformers_greedy_tokens_with_cuda_graphs(arch, tiny_model_dir):
    """fp32, default settings on CUDA: Triton attention and ops (after their self-check),
    decode steps replayed from CUDA graphs, inputs through pinned memory."""
    prompts = _prompts(10)
    want = _hf_greedy(tiny_model_dir(arch), prompts)
    got, runner = _kvray(tiny_model_dir(arch), prompts, dtype="float32")
    assert runner.attention_backend == "triton"
    assert runner.pin_memory
    assert runner.graphs is not None and runner.graphs.captured and runner.graphs.steps > 0
    assert got == want


@pytest.mark.parametrize("arch", ["mixtral_moe", "qwen2_moe_shared", "qwen3_moe"])
def test_moe_engine_on_gpu_gives_transformers_greedy_tokens(arch, tiny_model_dir):
    """fp32 on CUDA: every MoE layer's experts as the Triton fused-MoE kernel's two grouped
    GEMMs (IEEE fp32 dots), each family's routing, Qwen2-MoE's shared expert and dense
    layer: greedy tokens equal transformers' on the GPU."""
    prompts = _prompts(8, seed=3)
    want = _hf_greedy(tiny_model_dir(arch), prompts)
    got, runner = _kvray(tiny_model_dir(arch), prompts, dtype="float32")
    assert runner.attention_backend == "triton" and runner.fused_moe
    assert got == want


def test_cuda_graphs_give_the_eager_tokens(tiny_model_dir):
    """The same requests, replayed graphs vs eager, fp32: token for token; batch sizes past
    the largest captured one run eagerly in the same engine."""
    prompts = _prompts(24, seed=1)
    eager, runner = _kvray(tiny_model_dir("llama_gqa"), prompts, dtype="float32",
                           enforce_eager=True)
    assert runner.graphs is None
    graphs, runner = _kvray(tiny_model_dir("llama_gqa"), prompts, dtype="float32",
                            cuda_graph_sizes=[1, 2, 4, 8])
    assert runner.graphs.steps > 0
    assert graphs == eager


def test_bf16_greedy_tokens_are_argmax_or_near_ties_under_the_fp32_reference(tiny_model_dir):
    """bf16 tolerance: every token kvray picks greedily in bf16 has, under transformers'
    fp32 model fed the same prefix, a logit within 0.25 of the best one (bf16 rounding can
    swap near-ties, after which the sequences legitimately part)."""
    model_dir = tiny_model_dir("llama_gqa")
    prompts = _prompts(6, seed=2)
    got, _ = _kvray(model_dir, prompts, dtype="bfloat16")
    hf = load_hf(model_dir).to("cuda")
    with torch.inference_mode():
        for prompt, out in zip(prompts, got, strict=True):
            seq = torch.tensor([prompt + out], device="cuda")
            logits = hf(seq).logits[0, len(prompt) - 1:-1].float()
            chosen = logits.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
            assert (logits.max(dim=1).values - chosen).max().item() <= 0.25


def test_kv_cache_is_sized_by_the_profile_run_within_gpu_memory_utilization(tiny_model_dir):
    free, total = torch.cuda.mem_get_info()
    used_before = total - free
    llm = LLM(str(tiny_model_dir("llama_gqa")), dtype="float32", gpu_memory_utilization=0.2)
    blocks = llm.llm_engine.stats.num_blocks
    free_after, _ = torch.cuda.mem_get_info()
    llm.shutdown()
    assert blocks > 1000  # a tiny model leaves most of the budget to the KV cache
    # what kvray took stays inside its share (other tests' leftovers were there before)
    assert (total - free_after) - used_before <= 0.2 * total + (256 << 20)


def test_shutdown_gives_the_gpu_memory_back(tiny_model_dir):
    """Weights, KV cache and CUDA graphs are freed by shutdown(), so a second engine in the
    process gets its gpu_memory_utilization share (it once found the first one's 42 GiB
    still allocated and a negative KV budget)."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    llm = LLM(str(tiny_model_dir("llama_gqa")), dtype="float32", gpu_memory_utilization=0.1)
    assert torch.cuda.memory_allocated() - before > 1 << 30
    llm.shutdown()
    assert torch.cuda.memory_allocated() - before < 64 << 20


def test_lora_adapters_on_gpu_give_peft_tokens(tiny_model_dir, tmp_path):
    """A batch mixing two adapters and the base model on the GPU (the Triton LoRA kernels;
    decode batches with adapter rows run eagerly, the others from CUDA graphs): PEFT's
    greedy tokens (fp32)."""
    pytest.importorskip("peft", reason="peft (the reference) is not installed here")
    from kvray import LoRARequest
    from tests.helpers.lora import make_lora_adapter, peft_greedy

    base = tiny_model_dir("llama_gqa")
    adapters = {"a": make_lora_adapter(base, tmp_path / "a", rank=8, seed=1),
                "b": make_lora_adapter(base, tmp_path / "b", rank=32, seed=2,
                                       targets=["q_proj", "v_proj", "down_proj"])}
    prompts = _prompts(6, seed=4)
    names = [None, "a", "b", "a", None, "b"]
    want = [peft_greedy(base, adapters[n] if n else None, [p], MAX_TOKENS)[0]
            for p, n in zip(prompts, names, strict=True)]
    requests = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    llm = LLM(str(base), dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=16,
              enable_lora=True, max_loras=2, max_lora_rank=32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[requests[n] if n else None for n in names])
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
