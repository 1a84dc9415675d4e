"""CUDA graph support, the parts that run without a GPU: which batch sizes are captured,
how a batch is padded up to one, and the padded decode path itself, which on CPU runs the
same static buffers, pad rows and pad block eagerly (``capture=False``) and must give the
same tokens as the plain path. The capture and replay proper run in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from kvray.actors.cuda_graphs import capture_sizes, padded_size
from kvray.actors.kv_sizing import gpu_kv_budget, num_blocks_for_budget, profile_run
from kvray.actors.model_runner import ModelRunner
from kvray.config import CacheConfig
from tests.helpers.tiny_models import runner_facts

pytestmark = pytest.mark.parity


def test_default_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000)[-1] == 256  # larger batches run eagerly


def test_requested_capture_sizes_are_sorted_and_capped_at_max_num_seqs():
    assert capture_sizes(16, requested=[8, 1, 32, 8]) == [1, 8]
    assert capture_sizes(4, requested=[8]) == []


@pytest.mark.parametrize("rows,want", [(1, 1), (3, 4), (4, 4), (5, 8), (17, 24), (128, 128),
                                       (129, None)])
def test_a_batch_pads_up_to_the_next_captured_size(rows, want):
    assert padded_size(rows, capture_sizes(128)) == want


def test_gpu_kv_budget_leaves_room_for_weights_activations_and_other_memory():
    gib = 1 << 30
    assert gpu_kv_budget(80 * gib, 0.9, 16 * gib, 2 * gib, gib) == int(72 * gib) - 19 * gib
    cache = CacheConfig()
    assert num_blocks_for_budget(cache, gib // 4, 2 * gib) == 8
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_blocks_for_budget(cache, gib, gpu_kv_budget(8 * gib, 0.5, 4 * gib, gib, 0))
    with pytest.raises(ValueError, match=r"\(2\.00 GiB of tensors this process holds\)"):
        num_blocks_for_budget(cache, gib, -1, "2.00 GiB of tensors this process holds")


def _generate(model_dir, prompts, max_tokens, **kwargs):
    from kvray import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", block_size=16, max_num_seqs=6,
              num_gpu_blocks_override=24, **kwargs)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = runner_facts(llm)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], runner


@pytest.mark.parametrize("backend,sizes", [("auto", None), ("torch", None), ("auto", [2, 4])])
def test_padded_decode_batches_give_the_plain_paths_tokens(monkeypatch, tiny_model_dir,
                                                            backend, sizes):
    """Five requests finishing at different steps: decode batches of 5, 4, 3, 2, 1 rows are
    padded to 6, 4, 4, 2, 1 (or run eagerly past the largest size), the pad rows writing
    only to the pad block."""
    from tests.helpers.tiny_models import VOCAB_SIZE

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist()
               for n in (20, 7, 33, 12, 3)]
    max_tokens = [9, 3, 12, 5, 7]
    model = tiny_model_dir("llama_gqa")
    want, _ = _generate(model, prompts, max_tokens, attention_backend=backend)
    monkeypatch.setattr(ModelRunner, "_decode_graphs_wanted", lambda self: True)
    got, runner = _generate(model, prompts, max_tokens, attention_backend=backend,
                            cuda_graph_sizes=sizes)
    assert got == want
    graphs = runner.graphs
    assert graphs is not None and graphs.steps > 0 and graphs.padded_rows > 0
    # Graphs are captured on CUDA with the Triton kernels only (the PyTorch reference reads
    # sequence lengths on the host, which a graph would freeze); else the padded batch runs
    # eagerly.
    graph_safe = torch.cuda.is_available() and runner.attention_backend == "triton"
    assert graphs.captured == (graphs.sizes if graph_safe else [])
    assert graphs.sizes == (sizes or [1, 2, 4, 6])
    # the pad block lies past the blocks the block manager hands out
    assert graphs.pad_block == 24
    assert runner.kv_blocks == 25


def test_profile_run_leaves_the_engine_as_it_was(tiny_model_dir):
    """The profile run (what sizes the KV cache on CUDA) builds the scheduler's largest
    step, prompts longer than max_model_len split over sequences, on a scratch cache."""
    from kvray import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("qwen2_bias")), dtype="float32", max_model_len=40,
              max_num_seqs=3, max_num_batched_tokens=200, num_gpu_blocks_override=64)
    runner = llm.llm_engine.executor.worker.runner
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    states, caches = dict(runner.requests), [c.clone() for c in runner.cache.kv_caches]
    peak = profile_run(runner)
    if torch.cuda.is_available():
        assert peak > 0  # the activations' peak, from the allocator's statistics
    else:
        assert peak == 0  # no allocator statistics on CPU
    assert runner.requests == states
    assert all(torch.equal(a, b) for a, b in zip(caches, runner.cache.kv_caches, strict=True))
    again = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    llm.shutdown()
