"""GGUF block formats converted, exactly, into :class:`~kvray.quant.tensor.QuantTensor`.

A GGUF tensor of ``N`` rows and ``K`` columns is ``N * K / block`` blocks of bytes, each
holding its own scale(s) next to its codes. kvray keeps the codes and moves the scales into
per-group arrays, so the kernels stream one layout whatever the file's type:

=======  ===========================================  ==========================================
GGUF     block (bytes)                                kvray segment
=======  ===========================================  ==========================================
Q8_0     fp16 d, 32 int8 q; ``d * q``                 S8, group 32, fp16 scale d
Q4_0     fp16 d, 16 B nibbles; ``d * (q - 8)``        U4, group 32, fp16 scale d, zero 8
Q4_1     fp16 d, fp16 m, 16 B nibbles; ``d * q + m``  U4, group 32, fp16 scale d, min m
Q5_0     fp16 d, 4 B 5th bits, 16 B nibbles;          U5, group 32, fp16 scale d, zero 16
         ``d * (q - 16)``
Q5_1     fp16 d, fp16 m, 4 B 5th bits, 16 B nibbles;  U5, group 32, fp16 scale d, min m
         ``d * q + m``
Q4_K     super-block of 256: fp16 d, fp16 dmin,       U4, group 32, two-level: uint8 scales
         12 B of 6-bit sc/m for 8 sub-blocks of 32,   ``sc_j`` x fp16 ``d``, uint8 mins ``m_j``
         128 B nibbles; ``d sc_j q - dmin m_j``       x fp16 ``-dmin`` per 8 groups
Q5_K     Q4_K's scales, 32 B 5th bits, 128 B          U5, group 32, two-level as Q4_K
         nibbles; ``d sc_j q - dmin m_j``
Q6_K     super-block of 256: 128 B low nibbles,       U6, group 16, zero 32, two-level: int8
         64 B high 2 bits, 16 int8 sc, fp16 d;        scales ``sc_j`` x fp16 ``d`` per 16 groups
         ``d sc_j (q - 32)``
Q3_K     super-block of 256: 32 B 3rd bits, 64 B      U4 (3-bit codes), group 16, zero 4, two-
         2-bit codes, 12 B of 6-bit sc, fp16 d;       level: int8 ``sc_j - 32`` x fp16 ``d``
         ``d (sc_j - 32) (q - 4)``
Q2_K     super-block of 256: 16 B of 4-bit sc/m,      U4 (2-bit codes), group 16, two-level:
         64 B 2-bit codes, fp16 d, fp16 dmin;         uint8 ``sc_j``, ``m_j`` x fp16 ``d``,
         ``d sc_j q - dmin m_j``                      ``-dmin``
=======  ===========================================  ==========================================

Each takes about its file's bytes (Q4_K 148 per 144, Q5_K 180 per 176; the others their own
size) except Q3_K and Q2_K, whose 3- and 2-bit codes take U4's 4 bits (146 per 110 and 164
per 84 bytes: still a third of bf16), whatever the row split over tensor-parallel ranks (a
split inside a K-quant super-block multiplies its scales out into fp32: exact, bigger).

Every conversion is exact: :meth:`QuantTensor.dequantize` equals ``gguf.quants.dequantize``
bit for bit in fp32 (products of an fp16 by a 6- or 8-bit integer fit fp32's mantissa, and
so do the sums). Other types (IQ*, TQ*, and the float types) have no exact kind here:
:func:`to_quant_tensor` returns None and the loader dequantizes them.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvray.quant.tensor import QuantKind, QuantSegment, QuantTensor


def _blocks(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
    """The tensor's bytes as [N * K / block, type_size] uint8 (a view where possible)."""
    n, k = shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"a {qtype.name} row of {k} values: not a whole number of blocks "
                         f"of {block}")
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if data.size != n * k // block * type_size:
        raise ValueError(f"{data.size} bytes for a {qtype.name} tensor of shape {shape}")
    return data.reshape(n * k // block, type_size)


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of every block, as a contiguous [num_blocks] float16 array."""
    return np.ascontiguousarray(blocks[:, at: at + 2]).view(np.float16).reshape(-1)


def _tensor(a: np.ndarray, n: int) -> torch.Tensor:
    """[n, -1] torch tensor; copied where ``a`` is still a view of the read-only file map."""
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a.reshape(n, -1))


def _q8_0(b: np.ndarray, n: int) -> QuantSegment:
    codes = _tensor(b[:, 2:], n).view(torch.int8)
    return QuantSegment(QuantKind.S8, 32, codes, _tensor(_f16(b, 0), n))


def _q4_0(b: np.ndarray, n: int) -> QuantSegment:
    return QuantSegment(QuantKind.U4, 32, _tensor(b[:, 2:], n), _tensor(_f16(b, 0), n), zero=8)


def _q4_1(b: np.ndarray, n: int) -> QuantSegment:
    return QuantSegment(QuantKind.U4, 32, _tensor(b[:, 4:], n), _tensor(_f16(b, 0), n),
                        _tensor(_f16(b, 2), n))


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes per super-block -> 6-bit (scales, mins) [num_blocks, 8] as uint8.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
    same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _q5(b: np.ndarray, n: int, with_min: bool) -> QuantSegment:
    """Q5_0 / Q5_1: code j = its nibble (byte j of 16: low nibble, j - 16: high) | bit j of
    the 32-bit ``qh`` << 4."""
    at = 4 if with_min else 2
    qh = np.ascontiguousarray(b[:, at: at + 4]).view("<u4").reshape(-1, 1)
    qs = b[:, at + 4:]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    codes = _tensor(nibbles | (high << 4), n)
    if with_min:
        return QuantSegment(QuantKind.U5, 32, codes, _tensor(_f16(b, 0), n),
                            _tensor(_f16(b, 2), n))
    return QuantSegment(QuantKind.U5, 32, codes, _tensor(_f16(b, 0), n), zero=16)


def _q5_0(b: np.ndarray, n: int) -> QuantSegment:
    return _q5(b, n, with_min=False)


def _q5_1(b: np.ndarray, n: int) -> QuantSegment:
    return _q5(b, n, with_min=True)


def _q4_k(b: np.ndarray, n: int) -> QuantSegment:
    sc, mn = _k_scales_mins(b[:, 4:16])
    # llama.cpp's order: 32 bytes hold sub-block 2i in their low nibbles and sub-block
    # 2i + 1 in their high nibbles. U4 wants code j | code j + 16 << 4 per sub-block.
    q = b[:, 16:].reshape(-1, 4, 2, 16)
    first, second = q[:, :, 0], q[:, :, 1]  # codes 0-15 and 16-31 of both sub-blocks
    codes = np.stack([(first & 0x0F) | (second << 4), (first >> 4) | (second & 0xF0)], axis=2)
    return QuantSegment(QuantKind.U4, 32, _tensor(codes, n), _tensor(sc, n), _tensor(mn, n),
                        super_group=8, super_scales=_tensor(_f16(b, 0), n),
                        super_mins=_tensor(-_f16(b, 2), n))  # fp16 negation: exact


def _bit_planes(plane: np.ndarray, count: int) -> np.ndarray:
    """[blocks, 32] bytes -> [blocks, count * 32]: bit i of byte l at i * 32 + l, as the
    K-quants spread their high bits (bit i belongs to the i-th run of 32 or 16 values)."""
    bits = plane[:, None, :] >> np.arange(count, dtype=np.uint8)[None, :, None]
    return (bits & 1).reshape(plane.shape[0], -1)


def _pack_u4(codes: np.ndarray) -> np.ndarray:
    """Codes 0..15, one per byte [blocks, 256] -> U4's packing (per block of 32: byte j =
    code j | code j + 16 << 4)."""
    c = codes.reshape(codes.shape[0], -1, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's [blocks, 64] bytes -> [blocks, 256] 2-bit codes: each half of 128
    values reads its 32 bytes four times, shifted by 0, 2, 4, 6."""
    q = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    return (q & 3).reshape(-1, 256)


def _q5_k(b: np.ndarray, n: int) -> QuantSegment:
    sc, mn = _k_scales_mins(b[:, 4:16])
    # 32 bytes of qs per pair of sub-blocks (low nibbles, then high), bit i of qh byte l
    # the 5th bit of value l of sub-block i
    qs = b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[None, None, :, None]
    codes = (qs & 0x0F).reshape(-1, 256) | (_bit_planes(b[:, 16:48], 8) << 4)
    return QuantSegment(QuantKind.U5, 32, _tensor(codes, n), _tensor(sc, n), _tensor(mn, n),
                        super_group=8, super_scales=_tensor(_f16(b, 0), n),
                        super_mins=_tensor(-_f16(b, 2), n))


def _q3_k(b: np.ndarray, n: int) -> QuantSegment:
    # code = 2 low bits | 3rd bit << 2 (llama.cpp subtracts 4 where the 3rd bit is clear)
    codes = _two_bit_codes(b[:, 32:96]) | (_bit_planes(b[:, :32], 8) << 2)
    packed = b[:, 96:108]
    low = np.concatenate([packed[:, :8] & 0x0F, packed[:, :8] >> 4], axis=1)
    high = (packed[:, 8:12, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)).transpose(0, 2, 1)
    sc = (low | ((high.reshape(-1, 16) & 3) << 4)).astype(np.int8) - np.int8(32)
    return QuantSegment(QuantKind.U4, 16, _tensor(_pack_u4(codes), n), _tensor(sc, n),
                        zero=4, super_group=16, super_scales=_tensor(_f16(b, 108), n))


def _q2_k(b: np.ndarray, n: int) -> QuantSegment:
    codes = _pack_u4(_two_bit_codes(b[:, 16:80]))
    return QuantSegment(QuantKind.U4, 16, _tensor(codes, n), _tensor(b[:, :16] & 0x0F, n),
                        _tensor(b[:, :16] >> 4, n), super_group=16,
                        super_scales=_tensor(_f16(b, 80), n),
                        super_mins=_tensor(-_f16(b, 82), n))


def _q6_k(b: np.ndarray, n: int) -> QuantSegment:
    # Each half of 128 values: ql's 64 bytes give values 0-63 (low nibbles) and 64-127
    # (high nibbles); qh's 32 bytes give the top 2 bits of values 32 t + j at bits 2 t,
    # laid out as Q2_K's and Q3_K's 2-bit codes.
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 256)
    codes = low | (_two_bit_codes(b[:, 128:192]) << 4)
    return QuantSegment(QuantKind.U6, 16, _tensor(codes, n),
                        _tensor(b[:, 192:208], n).view(torch.int8), zero=32, super_group=16,
                        super_scales=_tensor(_f16(b, 208), n))


_CONVERTERS = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
    GGMLQuantizationType.Q3_K: _q3_k,
    GGMLQuantizationType.Q2_K: _q2_k,
}
KEPT_QUANTIZED = frozenset(_CONVERTERS)  # the GGUF types kvray holds without dequantizing


def to_quant_tensor(raw: np.ndarray, qtype: GGMLQuantizationType,
                    shape: tuple[int, int]) -> QuantTensor | None:
    """A GGUF matrix kept quantized, or None where its type has no exact kvray kind.

    Args:
        raw: the tensor's bytes as ``GGUFReader``'s ``ReaderTensor.data`` gives them (uint8
            [N, bytes per row] for block types; any view of the same bytes is accepted).
        qtype: the tensor's ``tensor_type``.
        shape: (N, K) in Hugging Face order (rows, then the ``K`` values of a row), i.e. the
            reverse of GGUF's ``ReaderTensor.shape``.
    Returns:
        A one-segment :class:`QuantTensor` whose ``dequantize()`` equals
        ``gguf.quants.dequantize`` exactly, or None (IQ*, TQ*, float types...).
    """
    convert = _CONVERTERS.get(qtype)
    if convert is None:
        return None
    n, k = shape
    segment = convert(_blocks(raw, qtype, (n, k)), n)
    return QuantTensor((n, k), (segment,), f"GGUF {qtype.name}")


def gguf_type_bytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of ``shape`` takes in a GGUF file as ``qtype`` (for memory reports)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    numel = int(np.prod(shape))
    if numel % block:
        raise ValueError(f"{numel} values of {qtype.name}: not whole blocks of {block}")
    return numel // block * type_size
