"""The paged, continuously batched engine reproduces transformers' greedy `generate` token for
token (fp32) on every architecture, whatever the batching: prefix caching on and off, chunked
prefill with a small budget, and a cache so small that requests are preempted many times."""

from __future__ import annotations

import pytest
import torch

from kvray import LLM, SamplingParams
from tests.helpers.tiny_models import ARCHS, VOCAB_SIZE, load_hf

pytestmark = pytest.mark.parity

MAX_TOKENS = 10
LENGTHS = [1, 5, 17, 40, 3, 70, 9, 33, 120, 2, 64, 11] * 2  # 24 prompts


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in LENGTHS]
    prompts[13] = prompts[3] + prompts[13]  # shares a 40-token prefix with prompt 3
    prompts[20] = prompts[8][:100]  # a prefix of another prompt
    return prompts


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            hf = load_hf(tiny_model_dir(arch))
            with torch.inference_mode():
                cache[arch] = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS,
                                           do_sample=False, eos_token_id=None,
                                           pad_token_id=0)[0, len(p):].tolist()
                               for p in _prompts()]
        return cache[arch]

    return get


SETUPS = {
    "prefix_cache_tight_memory": dict(enable_prefix_caching=True, num_gpu_blocks_override=48),
    "no_prefix_cache": dict(enable_prefix_caching=False, num_gpu_blocks_override=400),
    # the next step scheduled while one runs: chunked prefill, preemption (draining the
    # steps in flight first), prefix hits
    "async_scheduling_tight_memory": dict(enable_prefix_caching=True,
                                          num_gpu_blocks_override=48, async_scheduling=True),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_tokens_equal_transformers(arch, setup, tiny_model_dir, expected):
    llm = LLM(str(tiny_model_dir(arch)), dtype="float32", block_size=4,
              max_num_batched_tokens=32, max_num_seqs=16, **SETUPS[setup])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected(arch)
    stats = llm.llm_engine.stats
    if setup.endswith("tight_memory"):
        assert stats.num_preemptions >= 5, "the tight cache should force preemptions"
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_hits == 0
    assert stats.kv_cache_usage == 0.0 and not llm.llm_engine.has_unfinished_requests()
