"""GGUF block formats kept quantized: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K to
Q6_K become QuantTensors that dequantize exactly as the ``gguf`` package does, through every
split and fusion a loader applies; the test GGUF writer's quantized files read back as
written."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import quants as gguf_quants

from kvray.quant.blob import from_blob, to_blob
from kvray.quant.gguf_blocks import KEPT_QUANTIZED, gguf_type_bytes, to_quant_tensor
from kvray.quant.tensor import QuantKind, QuantTensor
from tests.helpers.tiny_gguf import (
    K_QUANTIZERS,
    Q4_K_M,
    dequantized_reference,
    quantize_q6_k,
    write_gguf,
)
from tests.helpers.tiny_models import VOCAB_SIZE, make_tiny_model

BLOCK_TYPES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
# type -> bytes per super-block of 256, and where its fp16 d (and dmin) sit in it
K_QUANTS = {T.Q2_K: 84, T.Q3_K: 110, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
K_SUPER_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
                  T.Q6_K: (208,)}


def _reference(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(gguf_quants.dequantize(raw, qtype).reshape(shape).copy())


def _converted(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> QuantTensor:
    qt = to_quant_tensor(raw, qtype, shape)
    assert qt is not None and qt.shape == shape
    return qt


def _assert_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal as fp32 values (Q4_0's d * 8 - 8 d gives +0 where gguf's d * 0 may give -0)."""
    assert not want.isnan().any()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item()}"


def _random_k_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes (all valid codes) with sane fp16 super-block scales of both signs."""
    raw = rng.integers(0, 256, (n, k // 256 * K_QUANTS[qtype]), dtype=np.uint8)
    blocks = raw.reshape(-1, K_QUANTS[qtype])
    for at in K_SUPER_SCALES[qtype]:
        d = rng.standard_normal((blocks.shape[0], 1)) * 1e-2
        blocks[:, at:at + 2] = d.astype(np.float16).view(np.uint8)
    return raw


def _real_looking(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Gaussian weights with a few large outliers, as trained matrices have."""
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w.reshape(-1)[rng.integers(0, w.size, max(1, w.size // 500))] *= 20
    return w


@pytest.mark.unit
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (33, 32), (5, 512)])
def test_block_types_convert_exactly(qtype, shape):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    raw = gguf_quants.quantize(_real_looking(*shape, rng), qtype)
    assert raw.dtype == np.uint8 and raw.shape[0] == shape[0]  # as GGUFReader gives them
    _assert_exact(_converted(raw, qtype, shape).dequantize(), _reference(raw, qtype, shape))


@pytest.mark.unit
@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (33, 256), (2, 1280)])
def test_k_quants_of_random_blocks_convert_exactly(qtype, shape):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    raw = _random_k_blocks(qtype, *shape, rng)
    _assert_exact(_converted(raw, qtype, shape).dequantize(), _reference(raw, qtype, shape))


def _k_quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    return K_QUANTIZERS.get(qtype.name, quantize_q6_k)(x)


@pytest.mark.unit
@pytest.mark.parametrize("qtype,tolerance", [(T.Q2_K, 0.5), (T.Q3_K, 0.3), (T.Q4_K, 0.1),
                                             (T.Q5_K, 0.05), (T.Q6_K, 0.03)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_k_quants_of_real_looking_weights_convert_exactly_and_approximate_them(qtype,
                                                                               tolerance):
    w = _real_looking(33, 512, np.random.default_rng(1))
    raw = _k_quantize(w, qtype)
    want = _reference(raw, qtype, w.shape)
    _assert_exact(_converted(raw, qtype, w.shape).dequantize(), want)
    rel = ((want - torch.from_numpy(w)).norm() / np.linalg.norm(w)).item()
    assert rel < tolerance  # the helper quantizer is sane


@pytest.mark.unit
def test_segments_use_the_documented_layouts_and_hold_about_the_file_bytes():
    rng = np.random.default_rng(2)
    w = _real_looking(3, 256, rng)
    layouts = {  # type -> kind, group, scale dtype, mins, zero, bytes held per 256 values
        T.Q8_0: (QuantKind.S8, 32, torch.float16, False, 0, 256 + 8 * 2),  # file: 272
        T.Q4_0: (QuantKind.U4, 32, torch.float16, False, 8, 128 + 8 * 2),  # file: 144
        T.Q4_1: (QuantKind.U4, 32, torch.float16, True, 0, 128 + 8 * 4),  # file: 160
        T.Q5_0: (QuantKind.U5, 32, torch.float16, False, 16, 160 + 8 * 2),  # file: 176
        T.Q5_1: (QuantKind.U5, 32, torch.float16, True, 0, 160 + 8 * 4),  # file: 192
        # two-level: 8-bit sub-block scales (and mins) times an fp16 per super-block
        T.Q4_K: (QuantKind.U4, 32, torch.uint8, True, 0, 128 + 8 + 8 + 2 + 2),  # file: 144
        T.Q5_K: (QuantKind.U5, 32, torch.uint8, True, 0, 160 + 8 + 8 + 2 + 2),  # file: 176
        T.Q6_K: (QuantKind.U6, 16, torch.int8, False, 32, 192 + 16 + 2),  # file: 210
        # 3- and 2-bit codes in U4's nibbles: bigger than their files
        T.Q3_K: (QuantKind.U4, 16, torch.int8, False, 4, 128 + 16 + 2),  # file: 110
        T.Q2_K: (QuantKind.U4, 16, torch.uint8, True, 0, 128 + 16 + 16 + 2 + 2),  # file: 84
    }
    for qtype, (kind, group, sdtype, has_min, zero, held) in layouts.items():
        raw = _k_quantize(w, qtype) if qtype in K_QUANTS else gguf_quants.quantize(w, qtype)
        qt = _converted(raw, qtype, w.shape)
        (seg,) = qt.segments
        assert (seg.kind, seg.group, seg.scales.dtype, seg.mins is not None, seg.zero) == (
            kind, group, sdtype, has_min, zero), qtype.name
        assert qt.source == f"GGUF {qtype.name}"
        assert qt.nbytes == held * w.size // 256  # no hidden copy
        assert qt.nbytes <= (2.0 if qtype in (T.Q2_K, T.Q3_K) else 1.03) * raw.nbytes
        # the blob adds its header and the alignment of each array, nothing per value
        assert to_blob(qt).numel() <= qt.nbytes + 64 + 128 + 5 * 64 + 8 * 512


@pytest.mark.unit
def test_q4_0_of_any_scale_converts_exactly_with_its_code_offset():
    rng = np.random.default_rng(3)
    raw = gguf_quants.quantize(_real_looking(2, 64, rng), T.Q4_0)
    raw[1, 0:2] = np.array([10000.0], dtype=np.float16).view(np.uint8)  # -8 d < -65504
    qt = _converted(raw, T.Q4_0, (2, 64))
    assert qt.segments[0].scales.dtype == torch.float16 and qt.segments[0].mins is None
    _assert_exact(qt.dequantize(), _reference(raw, T.Q4_0, (2, 64)))
    _assert_exact(qt.basic().dequantize(), _reference(raw, T.Q4_0, (2, 64)))


def _converted_any_type(qtype: T, shape: tuple[int, int], seed: int
                        ) -> tuple[QuantTensor, torch.Tensor]:
    """A random tensor of ``qtype`` as kvray converts it, and gguf's dequantized values."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        raw = _random_k_blocks(qtype, *shape, rng)
    else:
        raw = gguf_quants.quantize(_real_looking(*shape, rng), qtype)
    return _converted(raw, qtype, shape), _reference(raw, qtype, shape)


@pytest.mark.unit
@pytest.mark.parametrize("qtype", sorted(KEPT_QUANTIZED), ids=lambda t: t.name)
def test_narrow_permute_and_blob_keep_the_conversion_exact(qtype):
    shape = (33, 512)
    qt, want = _converted_any_type(qtype, shape, 4)
    _assert_exact(qt.narrow(0, 7, 19).dequantize(), want[7:26])
    _assert_exact(qt.narrow(1, 256, 256).dequantize(), want[:, 256:])
    _assert_exact(qt.narrow(1, 0, 256).narrow(0, 32, 1).dequantize(), want[32:, :256])
    perm = torch.randperm(shape[0], generator=torch.Generator().manual_seed(0))
    _assert_exact(qt.permute_rows(perm).dequantize(), want[perm])
    back = from_blob(to_blob(qt))
    _assert_exact(back.dequantize(), want)
    _assert_exact(qt.basic().dequantize(), want)  # the Triton kernels' layouts


@pytest.mark.unit
@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda t: t.name)
def test_a_k_quant_split_inside_a_super_block_multiplies_its_scales_out_exactly(qtype):
    shape = (9, 768)
    qt, want = _converted_any_type(qtype, shape, 6)
    whole = qt.narrow(1, 256, 512).segments[0]  # on super-block boundaries: still two-level
    assert whole.two_level and whole.nbytes == qt.segments[0].nbytes * 2 // 3
    for start, length in ((0, 384), (384, 384), (128, 640)):  # TP=2 of 768, an odd split
        part = qt.narrow(1, start, length)
        assert not part.segments[0].two_level
        _assert_exact(part.dequantize(), want[:, start:start + length])
        _assert_exact(from_blob(to_blob(part)).dequantize(),
                      want[:, start:start + length])


@pytest.mark.unit
def test_q4_k_m_fused_qkv_with_q6_k_values_dequantizes_to_the_concatenation():
    k = 512
    q_raw, k_raw = (_random_k_blocks(T.Q4_K, n, k, np.random.default_rng(n)) for n in (16, 8))
    v_raw = _random_k_blocks(T.Q6_K, 8, k, np.random.default_rng(5))
    pieces = [(q_raw, T.Q4_K, (16, k)), (k_raw, T.Q4_K, (8, k)), (v_raw, T.Q6_K, (8, k))]
    fused = QuantTensor.cat_rows([_converted(*p) for p in pieces])
    want = torch.cat([_reference(*p) for p in pieces])
    assert fused.kinds == (QuantKind.U4, QuantKind.U6)  # Q and K share one segment
    _assert_exact(fused.dequantize(), want)
    _assert_exact(fused.narrow(0, 12, 10).dequantize(), want[12:22])  # across the seam
    _assert_exact(fused.narrow(1, 0, 256).dequantize(), want[:, :256])
    _assert_exact(from_blob(to_blob(fused)).dequantize(), want)


@pytest.mark.unit
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS],
                         ids=lambda t: t.name)
def test_types_without_an_exact_kind_are_left_to_the_dequantizing_loader(qtype):
    assert qtype not in KEPT_QUANTIZED
    assert to_quant_tensor(np.zeros(4096, np.uint8), qtype, (4, 256)) is None


@pytest.mark.unit
def test_a_buffer_of_the_wrong_size_is_an_error_naming_the_type():
    raw = gguf_quants.quantize(np.ones((4, 64), np.float32), T.Q8_0)
    with pytest.raises(ValueError, match="Q8_0"):
        to_quant_tensor(raw, T.Q8_0, (4, 96))
    with pytest.raises(ValueError, match="Q4_K"):
        to_quant_tensor(np.zeros((1, 144), np.uint8), T.Q4_K, (1, 200))


@pytest.fixture(scope="module")
def kquant_model_dir(tmp_path_factory):
    """A tiny Llama whose matrices have K = 256 or 512, so K-quants apply."""
    return make_tiny_model("llama_gqa", tmp_path_factory.mktemp("kq") / "m", hidden_size=256,
                           intermediate_size=512)


@pytest.mark.unit
def test_written_gguf_holds_the_chosen_types_and_its_tensors_convert_exactly(
        kquant_model_dir, tiny_model_dir, tmp_path):
    path = write_gguf(kquant_model_dir, tmp_path / "m.gguf", quant=Q4_K_M)
    types = {}
    for t in GGUFReader(str(path)).tensors:
        types[t.name] = t.tensor_type
        shape = tuple(reversed(t.shape.tolist()))
        assert gguf_type_bytes(t.tensor_type, shape) == t.n_bytes
        if t.tensor_type in KEPT_QUANTIZED:
            _assert_exact(_converted(t.data, t.tensor_type, shape).dequantize(),
                          _reference(t.data, t.tensor_type, shape))
    assert types["blk.0.attn_norm.weight"] == T.F32
    assert types["blk.1.attn_q.weight"] == types["token_embd.weight"] == T.Q4_K
    assert types["blk.1.attn_v.weight"] == types["blk.2.ffn_down.weight"] == T.Q6_K
    assert types["output.weight"] == T.Q6_K
    # K = 64 cannot hold a super-block of 256: llama.cpp's fallback for Q4_K is Q5_0.
    small = GGUFReader(str(write_gguf(tiny_model_dir("qwen2_bias"), tmp_path / "s.gguf",
                                      quant={"*": "Q4_K"})))
    small_types = {t.name: t.tensor_type for t in small.tensors}
    assert small_types["blk.0.attn_q.weight"] == T.Q5_0
    assert small_types["blk.0.attn_q.bias"] == T.F32


@pytest.mark.parity
@pytest.mark.parametrize("quant", [{"*": "Q8_0"}, {"*": "Q4_0"}, {"*": "Q4_1"}, Q4_K_M],
                         ids=["Q8_0", "Q4_0", "Q4_1", "Q4_K_M"])
@torch.inference_mode()
def test_transformers_reads_our_quantized_gguf_as_the_dequantized_reference(
        quant, kquant_model_dir, tmp_path):
    """Independent check of the writer's block layouts and Q/K interleaving."""
    write_gguf(kquant_model_dir, tmp_path / "m.gguf", quant=quant)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    ids = torch.randint(3, VOCAB_SIZE, (1, 12), generator=torch.Generator().manual_seed(0))
    want = dequantized_reference(kquant_model_dir, quant)(ids).logits
    assert torch.allclose(theirs(ids).logits, want, atol=1e-4)
