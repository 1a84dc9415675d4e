"""Rope scaling rules (kvray/kernels/rotary.py) against transformers' own
``ROPE_INIT_FUNCTIONS``: YaRN (with mscale / mscale_all_dim / no truncation), dynamic NTK
and LongRoPE, both branches of the position-dependent ones, and the cos/sin tables built
from them. Model-level parity (YaRN, LongRoPE short factors) runs in the parity suites."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvray.kernels.rotary import RotaryEmbedding, max_context, rope_frequencies
from kvray.models.spec import ModelSpec, UnsupportedModelError

pytestmark = pytest.mark.unit

HEAD_DIM = 32


def _config(max_positions: int, rope: dict) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM,
                                    max_position_embeddings=max_positions,
                                    rope_parameters={"rope_theta": 10000.0, **rope})


def _spec_scaling(config: transformers.LlamaConfig) -> tuple[float, dict]:
    spec = ModelSpec.from_hf_config(config)
    return spec.rope_theta, spec.rope_scaling


YARN = {
    "plain": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
               "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "untruncated": {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 300,
                    "truncate": False},
    "attention_factor": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8,
                         "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("case", list(YARN))
def test_yarn_equals_transformers(case):
    config = _config(2048, YARN[case])
    want, want_attention = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    theta, scaling = _spec_scaling(config)
    got = rope_frequencies(HEAD_DIM, theta, scaling, 2048, 2048)
    torch.testing.assert_close(got.inv_freq, want.float(), rtol=1e-6, atol=0)
    assert got.attention_factor == pytest.approx(want_attention, rel=1e-9)
    assert got.long_inv_freq is None


def test_dynamic_ntk_keeps_the_base_below_the_limit_and_scales_past_it():
    config = _config(1024, {"rope_type": "dynamic", "factor": 4.0})
    theta, scaling = _spec_scaling(config)
    got = rope_frequencies(HEAD_DIM, theta, scaling, 1024, 4096)
    base, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=1024)  # = no scaling
    long, attention = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=4096)
    torch.testing.assert_close(got.inv_freq, base.float(), rtol=1e-6, atol=0)
    plain = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    torch.testing.assert_close(got.inv_freq, plain)
    torch.testing.assert_close(got.long_inv_freq, long.float(), rtol=1e-6, atol=0)
    assert got.switch_at == 1024 and got.attention_factor == attention == 1.0
    assert max_context(1024, scaling) == 4096


def test_longrope_short_and_long_factors_and_attention_factor():
    short = [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)]
    long = [1.0 + 0.7 * i for i in range(HEAD_DIM // 2)]
    config = _config(8192, {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                            "original_max_position_embeddings": 2048})
    theta, scaling = _spec_scaling(config)
    got = rope_frequencies(HEAD_DIM, theta, scaling, 8192, 8192)
    want_short, attention = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    want_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=4000)
    torch.testing.assert_close(got.inv_freq, want_short.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got.long_inv_freq, want_long.float(), rtol=1e-6, atol=0)
    assert got.switch_at == 2048 and got.attention_factor == pytest.approx(attention)
    assert attention > 1.0  # sqrt(1 + log(4) / log(2048))


def test_tables_switch_per_position_and_carry_the_attention_factor():
    short = [1.0] * (HEAD_DIM // 2)
    long = [2.0] * (HEAD_DIM // 2)
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": 16, "factor": 4.0}
    rotary = RotaryEmbedding(HEAD_DIM, 10000.0, scaling, 64, 64)
    f = rotary.freqs
    positions = torch.arange(64, dtype=torch.float32)
    want = torch.cat([torch.outer(positions[:16], f.inv_freq),
                      torch.outer(positions[16:], f.long_inv_freq)])
    torch.testing.assert_close(rotary.cos, want.cos() * f.attention_factor)
    torch.testing.assert_close(rotary.sin, want.sin() * f.attention_factor)
    rotary._build(200)  # grown past the configured length: the long branch continues
    assert rotary.cos.shape[0] == 200
    torch.testing.assert_close(rotary.cos[:64], want.cos() * f.attention_factor)


def test_wrong_longrope_factor_count_and_unknown_types_are_named():
    with pytest.raises(ValueError, match="longrope: 3 factors for a rotary dim of 32"):
        rope_frequencies(HEAD_DIM, 1e4, {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                         "long_factor": [1.0] * 16,
                                         "original_max_position_embeddings": 8}, 64, 64)
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4)
    config.rope_parameters = {"rope_type": "mrope", "rope_theta": 1e4}
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'mrope'"):
        ModelSpec.from_hf_config(config)


def _phi3(partial: float) -> transformers.Phi3Config:
    n = int(32 * partial) // 2  # LongRoPE factors: one per rotated pair
    return transformers.Phi3Config(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
        intermediate_size=64, vocab_size=64, max_position_embeddings=4096,
        original_max_position_embeddings=1024, pad_token_id=0, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + i / 10 for i in range(n)],
            "long_factor": [1.0 + i for i in range(n)]})


def test_partial_rotary_turns_the_leading_dims_with_transformers_frequencies():
    """Phi-4-mini's partial_rotary_factor 0.75 of a 32-dim head: 24 dims turn with
    transformers' LongRoPE frequencies for 24 (both branches), the last 8 pass through."""
    config = _phi3(0.75)
    spec = ModelSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_dim, spec.rot_dim) == (32, 24, 24)
    want_short, attention = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    want_long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=4000)
    rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_scaling, 4096,
                             spec.max_position_embeddings, spec.rot_dim)
    torch.testing.assert_close(rotary.freqs.inv_freq, want_short.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(rotary.freqs.long_inv_freq, want_long.float(), rtol=1e-6,
                               atol=0)
    assert rotary.freqs.attention_factor == pytest.approx(attention)
    qk = torch.randn(5, 3, 32)
    positions = torch.tensor([0, 7, 1023, 1024, 3000])
    got = rotary.rotate_qk(positions, qk)
    assert torch.equal(got[..., 24:], qk[..., 24:])
    whole = RotaryEmbedding(24, spec.rope_theta, spec.rope_scaling, 4096,
                            spec.max_position_embeddings)
    torch.testing.assert_close(got[..., :24], whole.rotate_qk(positions, qk[..., :24]))


def test_partial_rotary_outside_phi3_or_of_odd_dims_is_an_error_naming_it():
    config = _config(2048, {"rope_type": "default", "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5 is supported "
                                                    "for the Phi-3 family only"):
        ModelSpec.from_hf_config(config)
    with pytest.raises(UnsupportedModelError, match="not a positive even number"):
        ModelSpec.from_hf_config(_phi3(0.3))  # 9.6 -> 9 dims
    assert ModelSpec.from_hf_config(_phi3(1.0)).rotary_dim == 0


def test_tables_grow_past_the_largest_position_given_by_the_host_or_read_from_the_device():
    """The fused kernels index the whole cos/sin tables: they grow past a step's largest
    position, whether the caller knows it on the host (``max_position``, the metadata's
    sequence lengths) or it is read from the positions, with the same values."""
    from kvray.kernels.attention import AttentionMetadata

    host = RotaryEmbedding(16, 10000.0, None, 8)
    read = RotaryEmbedding(16, 10000.0, None, 8)
    positions = torch.tensor([3, 40, 7])
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 1, 2, 3]), positions=positions,
                             seq_lens_list=[4, 41, 8])
    assert meta.max_position == 40
    cos_h, sin_h = host.tables(positions, meta.max_position)
    cos_r, sin_r = read.tables(positions)
    assert cos_h.shape[0] > 40 and torch.equal(cos_h, cos_r) and torch.equal(sin_h, sin_r)
    assert AttentionMetadata(query_start_loc=positions, positions=positions).max_position is None
