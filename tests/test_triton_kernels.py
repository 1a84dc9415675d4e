"""The Triton attention kernels against the PyTorch reference, on CPU under Triton's
interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU, before anything
imports Triton): odd head dims, 1 and 6 query heads over 1-2 KV heads, block sizes 16 and
32, sliding windows, cached prefixes spanning blocks. Tiny shapes: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

from kvray.kernels import attention as ref
from kvray.kernels import triton_attention
from tests.helpers.skips import triton_or_skip

triton_or_skip()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cache(hk: int, dim: int, block_size: int, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, hk, num_blocks, block_size, dim, generator=g).to(DEVICE)


def _tables(seq_lens: list[int], block_size: int, num_blocks: int, seed: int
            ) -> torch.Tensor:
    """Each sequence's blocks: distinct physical blocks in a shuffled order."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    rows, used = [], 0
    for n in seq_lens:
        need = -(-n // block_size)
        rows.append(perm[used:used + need] + [0] * (width - need))
        used += need
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


@pytest.mark.parity
@pytest.mark.parametrize("hq,hk,dim,block_size,window", [
    (1, 1, 80, 16, None), (6, 2, 64, 16, None), (6, 1, 80, 32, None), (4, 2, 24, 16, 20),
])
def test_paged_decode_matches_reference(hq, hk, dim, block_size, window):
    seq_lens = [1, 17, 70, 33]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = _cache(hk, dim, block_size, num_blocks, seed=dim + hq)
    tables = _tables(seq_lens, block_size, num_blocks, seed=1)
    q = torch.randn(len(seq_lens), hq, dim, generator=torch.Generator().manual_seed(2))
    q = q.to(DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    got = triton_attention.paged_decode(q, cache, tables, lens, 0.125, window)
    want = torch.cat([ref._decode(q[i:i + 1], cache, tables[i:i + 1].long(), lens[i:i + 1],
                                  seq_lens[i], 0.125, window) for i in range(len(seq_lens))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parity
def test_decode_splits_cover_every_block_once():
    assert triton_attention.num_decode_splits(1, 8) == 1
    assert triton_attention.num_decode_splits(5, 8) == 4  # a power of two <= blocks
    assert triton_attention.num_decode_splits(64, 1024) == 1  # enough programs already


@pytest.mark.parity
@pytest.mark.parametrize("hq,hk,dim,block_size,window,block_m", [
    (1, 1, 80, 16, None, 8), (6, 2, 64, 32, None, 16), (6, 1, 24, 16, 7, 8),
    (2, 2, 80, 16, 30, 16),  # the tl.dot path (every tile dimension >= 16)
])
def test_paged_prefill_with_cached_prefixes_matches_reference(hq, hk, dim, block_size,
                                                                window, block_m):
    # (cached prefix, new tokens): none, within a block, spanning blocks, a 1-token chunk
    chunks = [(0, 5), (3, 20), (37, 9), (50, 1)]
    seq_lens = [c + n for c, n in chunks]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    cache = _cache(hk, dim, block_size, num_blocks, seed=7 + dim)
    tables = _tables(seq_lens, block_size, num_blocks, seed=3)
    starts = torch.tensor([0, *[n for _, n in chunks]]).cumsum(0).to(DEVICE)
    q = torch.randn(int(starts[-1]), hq, dim, generator=torch.Generator().manual_seed(4))
    q = q.to(DEVICE)
    lens = torch.tensor(seq_lens, device=DEVICE)
    got = triton_attention.paged_prefill(q, cache, tables, lens, starts,
                                         max(n for _, n in chunks), 0.2, window, block_m=block_m)
    want = torch.cat([ref._prefill_one(q[starts[b]:starts[b + 1]], cache, tables[b].long(),
                                       seq_lens[b], 0.2, window) for b in range(len(chunks))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parity
def test_write_kv_fills_the_same_slots_as_the_reference():
    hk, dim, block_size, num_blocks = 2, 80, 16, 6
    g = torch.Generator().manual_seed(5)
    k = torch.randn(7, hk, dim, generator=g).to(DEVICE)
    v = torch.randn(7, hk, dim, generator=g).to(DEVICE)
    slots = torch.tensor([0, 5, 16, 17, 40, 95, 63], device=DEVICE)
    got = torch.zeros(2, hk, num_blocks, block_size, dim, device=DEVICE)
    want = got.clone()
    triton_attention.write_kv(k, v, got, slots)
    ref.write_kv_cache(k, v, want, slots)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


MAX_TOKENS = 6


# GQA; MQA + llama3 rope + tied embeddings; qk-norm + head dim 24; Gemma 2's capped scores
# (in the kernels) and Phi-4-mini's partial rotary (in the fused rotary + KV write). The
# interpreter takes ~25 s per architecture.
@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama_gqa", "llama3_rope_tied", "qwen3_qknorm_headdim",
                                  "gemma2_softcap", "phi4_partial_rotary"])
def test_engine_with_triton_backend_gives_transformers_greedy_tokens(arch, tiny_model_dir,
                                                                     monkeypatch):
    """Chunked prefill over cached prefixes, preemption in a tight cache, decode: every
    attention call (capped scores too: never the reference) and every norm, rotary and
    SiLU-and-mul through the Triton kernels."""
    from kvray import LLM, SamplingParams
    from tests.helpers.tiny_models import VOCAB_SIZE, load_hf

    def no_reference(*args):
        raise AssertionError("capped scores fell back to the PyTorch reference")

    monkeypatch.setattr(ref, "softcapped_attention", no_reference)

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (30, 15, 14)]
    prompts.append(prompts[0][:20] + [9, 10])  # shares a cached block with the first
    hf = load_hf(tiny_model_dir(arch))
    with torch.inference_mode():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    llm = LLM(str(tiny_model_dir(arch)), dtype="float32", block_size=16,
              max_num_batched_tokens=24, max_num_seqs=8, num_gpu_blocks_override=5,
              attention_backend="triton")
    runner = llm.llm_engine.executor.worker.runner
    assert runner.attention_backend == "triton"
    from kvray.kernels import triton_ops

    assert getattr(runner.model.model.norm, "fused", triton_ops.rms_norm) is triton_ops.rms_norm
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.llm_engine.stats
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0


@pytest.mark.parity
def test_self_check_passes_where_the_kernels_work():
    """What the engine runs before trusting the kernels by default on CUDA."""
    triton_attention.self_check(DEVICE)


@pytest.mark.parity
def test_auto_backend_distrusts_kernels_that_fail_their_check(monkeypatch, caplog):
    from kvray.kernels.plan import triton_works

    def broken(device, dtype=torch.float32):
        raise RuntimeError("miscompiled")

    monkeypatch.setattr(triton_attention, "self_check", broken)
    assert triton_works(torch.device(DEVICE), torch.float32) is False
    assert "failed their check" in caplog.text and "miscompiled" in caplog.text
