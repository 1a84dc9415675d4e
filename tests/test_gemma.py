"""Gemma 2 / 3 specifics beyond the parity suites (which check logits, generate and the
engine against transformers for both, tests/helpers/tiny_models.py): capped attention
scores equal an explicit reference over a paged cache with a sliding window; Gemma layers
keep the Python layer; unsupported variants are errors naming the config key."""

from __future__ import annotations

import pytest
import torch
import transformers

from kvray.kernels.attention import AttentionMetadata, attention, paged_batch
from kvray.models.spec import ModelSpec, UnsupportedModelError

pytestmark = pytest.mark.unit


def _reference(q, k, v, scale, cap, window):
    """One sequence, all of it new: [L, H, D] each, GQA by repeating k/v."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = torch.tanh(s / cap) * cap
    pos = torch.arange(q.shape[0])
    allowed = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.fixture(params=["torch", "cpu"])
def kernels(request) -> dict:
    """The attention kernels of a backend, as paged_batch takes them: none (the PyTorch
    paths) or the C++ ones, which take the cap."""
    if request.param == "torch":
        return {}
    cpu_ops = request.getfixturevalue("cpu_kernels")
    return dict(decode_kernel=cpu_ops.paged_decode, prefill_kernel=cpu_ops.paged_prefill,
                write_kernel=cpu_ops.write_kv, kernels_take_softcap=True)


@pytest.mark.parametrize("window", [4, 1000])
def test_capped_scores_over_a_paged_cache_equal_the_reference(window, kernels):
    g = torch.Generator().manual_seed(window)
    lengths, block, heads, kv_heads, dim = [13, 5, 22], 4, 4, 2, 16
    seqs = [(torch.randn(n, heads, dim, generator=g), torch.randn(n, kv_heads, dim, generator=g),
             torch.randn(n, kv_heads, dim, generator=g)) for n in lengths]
    want = [_reference(q, k, v, 0.3, 2.0, window) for q, k, v in seqs]
    cache = torch.zeros(2, kv_heads, 32, block, dim)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(lengths))]
    split = [n - 3 for n in lengths]  # a prefill chunk, then the last 3 tokens as another
    for phase in range(2):
        parts, rows = [], []
        for i, (q, k, v) in enumerate(seqs):
            lo, hi = (0, split[i]) if phase == 0 else (split[i], lengths[i])
            rows.append((list(range(hi - lo)), lo, tables[i]))
            parts.append((lo, hi, q[lo:hi], k[lo:hi], v[lo:hi]))
        _, meta, last = paged_batch(rows, block, lambda x: torch.tensor(x, dtype=torch.int64),
                                    **kernels)
        total = sum(hi - lo for lo, hi, *_ in parts)
        flat = [torch.empty(total, *t.shape[1:]) for t in parts[0][2:]]
        for (lo, hi, *tensors), end in zip(parts, last, strict=True):  # into batch order
            for dst, t in zip(flat, tensors, strict=True):
                dst[end - (hi - lo) + 1:end + 1] = t
        out = attention(*flat, meta, 0.3, window, cache, softcap=2.0)
        for i, ((lo, hi, *_), end) in enumerate(zip(parts, last, strict=True)):
            torch.testing.assert_close(out[end - (hi - lo) + 1:end + 1], want[i][lo:hi])
    # the dense path (no cache) too
    q, k, v = seqs[0]
    meta = AttentionMetadata.for_full_sequences([lengths[0]])
    torch.testing.assert_close(attention(q, k, v, meta, 0.3, window, None, softcap=2.0),
                               want[0])


def test_unsupported_gemma_variants_name_the_key():
    config = transformers.Gemma2Config(hidden_activation="relu", vocab_size=64,
                                       hidden_size=32, num_attention_heads=2, head_dim=16)
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'relu'"):
        ModelSpec.from_hf_config(config)
    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32,
                                           num_attention_heads=2, head_dim=16)
    config.rope_parameters = {"sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 1e4},
                              "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(UnsupportedModelError, match="rope_parameters.sliding_attention"):
        ModelSpec.from_hf_config(config)


def test_gemma_spec_reads_its_switches():
    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, num_attention_heads=2, head_dim=16, num_hidden_layers=6,
        query_pre_attn_scalar=24, sliding_window=16)
    spec = ModelSpec.from_hf_config(config)
    assert spec.gemma_norms and spec.qk_norm and spec.hidden_act == "gelu_pytorch_tanh"
    assert spec.attn_logit_softcap is None  # transformers' Gemma 3 never applies it
    assert spec.layer_windows == (16, 16, 16, 16, 16, None)  # 5 sliding, then 1 global
    assert spec.layer_rope(0) == (10000.0, None) and spec.layer_rope(5)[0] == 1000000.0


@pytest.mark.parametrize("config_cls", ["LlamaConfig", "MistralConfig", "Qwen2Config",
                                        "Qwen3Config"])
def test_a_config_without_architectures_is_its_familys_language_model(config_cls):
    """Regression: a config naming no architectures resolved to the family's classifier
    (a later entry of the same model_type), and loading asked for a score head."""
    config = getattr(transformers, config_cls)(vocab_size=64, hidden_size=32,
                                               num_attention_heads=2, num_hidden_layers=2)
    config.architectures = None
    spec = ModelSpec.from_hf_config(config)
    assert spec.architecture.endswith("ForCausalLM") and spec.head == "lm"
