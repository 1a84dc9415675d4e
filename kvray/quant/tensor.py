"""Quantized matrices as kvray holds them: :class:`QuantTensor` and its one-tensor blob.

Every quantized weight kvray loads — a GGUF block format, an AWQ/GPTQ int4 checkpoint,
an int8 weight quantized online — is converted at load time, exactly, into one of a few
*kinds* of row-major integer codes with per-group scales (and, for affine codes, mins):

    value[n, k] = scale[n, k // group] * q[n, k] (+ min[n, k // group])

- ``U4``: unsigned 4-bit codes 0..15, two per byte. Within each block of 32 codes along K,
  byte j holds code j in its low nibble and code j + 16 in its high nibble (GGUF's Q4_0
  order, which unpacks into two 16-byte halves with one mask and one shift).
- ``S8``: signed 8-bit codes, one per byte.
- ``F8``: float8 e4m3fn codes (GPU FP8 checkpoints; a CPU run dequantizes them).

A matrix may hold several *segments* of rows in different kinds (a Q4_K_M GGUF stores a
fused QKV's V rows as Q6_K, the Q and K rows as Q4_K). ``group`` is 16 or a multiple of 32;
``K`` is padded to a multiple of 32 (``k_padded``) with zero codes, and the kernels pad the
activations with zeros, so padding never contributes.

:meth:`QuantTensor.to_blob` lays a matrix out as one contiguous ``uint8`` tensor (a header,
a segment table, then each segment's codes, scales and mins at 64-byte-aligned offsets):
what the C++ kernels and the fused decode layer take as "the weight", one tensor per
linear. Rows are interleaved in tiles of 8 (:data:`TILE`) so that the kernels' vector lanes
are 8 weight rows: one broadcast of 4 activation codes meets 8 rows' codes, and a row's
dot product never needs a horizontal sum. The layout is specified in :data:`BLOB_LAYOUT`
and mirrored in ``kvray/kernels/csrc/cpu_quant.cpp``.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

BLOB_MAGIC = b"KVQ2"
HEADER_BYTES = 64
SEGMENT_BYTES = 64
ALIGN = 64
BLOCK = 32  # codes per activation block (and the K padding unit)
TILE = 8  # weight rows interleaved in the blob: one 8-lane vector holds one value per row

BLOB_LAYOUT = """
header (64 bytes, little-endian):
  [0:4]   magic b"KVQ2"
  [4:8]   int32 num_segments
  [8:16]  int64 N (rows)
  [16:24] int64 K (logical columns)
  [24:32] int64 k_padded (K rounded up to a multiple of 32)
  [32:64] zero
segment table at byte 64, num_segments entries of 64 bytes, in row order:
  [0:4]   int32 kind (1 = U4, 2 = S8, 3 = F8)
  [4:8]   int32 group (16 or a multiple of 32; divides k_padded)
  [8:12]  int32 scale dtype (0 = fp32, 1 = fp16)
  [12:16] int32 has_min (0/1)
  [16:24] int64 row0 (first row)
  [24:32] int64 rows
  [32:40] int64 codes offset (bytes from the blob's start; 64-aligned)
  [40:48] int64 scales offset
  [48:56] int64 mins offset (0 without mins)
  [56:64] zero
A segment's rows are stored in tiles of 8 (the last one padded with zero rows), each tile
as k_padded / 32 blocks of 32 columns:
codes, per tile and block: U4 4 x 32 bytes, byte 4 r + e of part j holding row r's code of
  column 8 j + e (low nibble) and 8 j + 4 + e (high nibble); S8 and F8 8 x 32 bytes, byte
  4 r + e of part c holding row r's code of column 4 c + e
scales, mins: per tile and group, the 8 rows' values of the scale dtype
"""
class QuantKind(enum.IntEnum):
    U4 = 1
    S8 = 2
    F8 = 3


_SCALE_DTYPES = {torch.float32: 0, torch.float16: 1}
_SCALE_FROM_CODE = {v: k for k, v in _SCALE_DTYPES.items()}


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class QuantSegment:
    """Rows of one kind: ``codes`` [rows, code bytes per row] uint8 (int8 for S8, uint8
    holding float8 bits for F8), ``scales`` and ``mins`` [rows, k_padded // group]."""

    kind: QuantKind
    group: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows = self.codes.shape[0]
        if self.group != 16 and self.group % BLOCK:
            raise ValueError(f"quantization group {self.group}: must be 16 or a multiple of 32")
        if self.scales.dtype not in _SCALE_DTYPES:
            raise ValueError(f"scales must be fp32 or fp16, not {self.scales.dtype}")
        if self.scales.dim() != 2 or self.scales.shape[0] != rows:
            raise ValueError(f"scales {tuple(self.scales.shape)} for {rows} rows")
        if self.mins is not None and (self.mins.shape != self.scales.shape
                                      or self.mins.dtype != self.scales.dtype):
            raise ValueError("mins must match the scales' shape and dtype")
        if self.k_padded % BLOCK or self.k_padded % self.group:
            raise ValueError(f"{self.k_padded} codes per row: not a multiple of 32 and of "
                             f"the group {self.group}")
        if self.scales.shape[1] * self.group != self.k_padded:
            raise ValueError(f"{self.scales.shape[1]} scales per row for {self.k_padded} codes "
                             f"in groups of {self.group}")

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def k_padded(self) -> int:
        return self.codes.shape[1] * (2 if self.kind == QuantKind.U4 else 1)

    def int_codes(self) -> torch.Tensor:
        """The codes as int32 [rows, k_padded] (U4: 0..15; S8: -128..127; F8: not ints)."""
        if self.kind == QuantKind.U4:
            b = self.codes.view(torch.uint8).reshape(self.rows, -1, BLOCK // 2).to(torch.int32)
            return torch.cat([b & 0xF, b >> 4], dim=2).reshape(self.rows, self.k_padded)
        if self.kind == QuantKind.S8:
            return self.codes.view(torch.int8).to(torch.int32)
        raise ValueError("F8 codes are floats")

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, k_padded]: the plain reference every kernel is tested against."""
        if self.kind == QuantKind.F8:
            q = self.codes.view(torch.float8_e4m3fn).to(torch.float32)
        else:
            q = self.int_codes().to(torch.float32)
        s = self.scales.to(torch.float32).repeat_interleave(self.group, dim=1)
        w = q * s
        if self.mins is not None:
            w = w + self.mins.to(torch.float32).repeat_interleave(self.group, dim=1)
        return w

    def narrow_rows(self, start: int, length: int) -> QuantSegment:
        mins = None if self.mins is None else self.mins.narrow(0, start, length)
        return replace(self, codes=self.codes.narrow(0, start, length),
                       scales=self.scales.narrow(0, start, length), mins=mins)

    def narrow_cols(self, start: int, length: int) -> QuantSegment:
        """Columns [start, start + length) of codes on group and block boundaries."""
        if self.group == self.k_padded and start % BLOCK == 0:
            # One scale per row (per-channel FP8, GPTQ group -1): any block boundary splits it.
            per_byte = 2 if self.kind == QuantKind.U4 else 1
            codes = self.codes.narrow(1, start // per_byte, round_up(length, BLOCK) // per_byte)
            return replace(self, group=round_up(length, BLOCK), codes=codes)
        unit = max(self.group, BLOCK)
        if start % unit or (length % unit and start + length != self.k_padded):
            raise ValueError(f"columns {start}..{start + length} do not fall on the "
                             f"quantization groups of {unit}")
        per_byte = 2 if self.kind == QuantKind.U4 else 1
        g0, glen = start // self.group, -(-length // self.group)
        mins = None if self.mins is None else self.mins.narrow(1, g0, glen)
        codes = self.codes.narrow(1, start // per_byte, round_up(length, BLOCK) // per_byte)
        return replace(self, codes=codes, scales=self.scales.narrow(1, g0, glen), mins=mins)

    @property
    def nbytes(self) -> int:
        n = self.codes.numel() * self.codes.element_size()
        n += self.scales.numel() * self.scales.element_size()
        return n if self.mins is None else n + self.mins.numel() * self.mins.element_size()


@dataclass(frozen=True)
class QuantTensor:
    """A quantized matrix [N, K]: segments of rows stacked in order (see the module doc).
    What loaders hand to the layers' weight loaders in place of a dense tensor."""

    shape: tuple[int, int]
    segments: tuple[QuantSegment, ...]
    source: str = ""  # the checkpoint format, for logs ("GGUF Q4_1", "int8", "AWQ")
    # Columns stored in this order (GPTQ act-order): y = x[:, input_perm] @ stored^T.
    input_perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        if sum(s.rows for s in self.segments) != n:
            raise ValueError(f"segments hold {sum(s.rows for s in self.segments)} rows, not {n}")
        for s in self.segments:
            if s.k_padded != round_up(k, BLOCK):
                raise ValueError(f"a segment holds {s.k_padded} codes per row for K = {k}")

    @property
    def k_padded(self) -> int:
        return round_up(self.shape[1], BLOCK)

    @property
    def dtype(self) -> torch.dtype:  # what a dense tensor's .dtype would say
        return torch.uint8

    def dim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def kinds(self) -> tuple[QuantKind, ...]:
        return tuple(s.kind for s in self.segments)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense matrix [N, K] (the reference; also the fallback where no kernel reads
        this kind)."""
        stored = torch.cat([s.dequantize()[:, : self.shape[1]] for s in self.segments])
        if self.input_perm is not None:
            dense = torch.empty_like(stored)
            dense[:, self.input_perm] = stored
            stored = dense
        return stored.to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> QuantTensor:
        """Rows (dim 0) or columns (dim 1, on group boundaries) like ``Tensor.narrow``."""
        n, k = self.shape
        if dim == 0:
            if start < 0 or start + length > n:
                raise ValueError(f"rows {start}..{start + length} outside {n}")
            out, row = [], 0
            for s in self.segments:
                lo, hi = max(start, row), min(start + length, row + s.rows)
                if lo < hi:
                    out.append(s.narrow_rows(lo - row, hi - lo))
                row += s.rows
            return replace(self, shape=(length, k), segments=tuple(out))
        if dim == 1:
            if start == 0 and length == k:  # no split (tensor_parallel_size 1)
                return self
            if self.input_perm is not None:
                raise ValueError("splitting the columns of an act-order (g_idx) weight: not "
                                 "supported; use tensor_parallel_size 1 for this checkpoint")
            if start < 0 or start + length > k:
                raise ValueError(f"columns {start}..{start + length} outside {k}")
            if start + length != k and (start + length) % BLOCK:
                raise ValueError(f"columns {start}..{start + length} do not fall on the "
                                 f"quantization blocks of {BLOCK}")
            segs = tuple(s.narrow_cols(start, round_up(length, BLOCK)
                                       if start + length == k else length)
                         for s in self.segments)
            return replace(self, shape=(n, length), segments=segs)
        raise ValueError(f"dim {dim} of a matrix")

    @staticmethod
    def zeros(rows: int, k: int) -> QuantTensor:
        """``rows`` rows of zeros (padding: a vocab split unevenly over TP ranks)."""
        kp = round_up(k, BLOCK)
        seg = QuantSegment(QuantKind.S8, kp, torch.zeros(rows, kp, dtype=torch.int8),
                           torch.ones(rows, 1, dtype=torch.float16))
        return QuantTensor((rows, k), (seg,), "padding")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``ids`` [n] -> [n, K], dequantized (an embedding lookup's reference)."""
        out = torch.empty(ids.numel(), self.shape[1], dtype=torch.float32, device=ids.device)
        row0 = 0
        for s in self.segments:
            here = (ids >= row0) & (ids < row0 + s.rows)
            if here.any():
                local = ids[here] - row0
                mins = None if s.mins is None else s.mins[local]
                part = replace(s, codes=s.codes[local], scales=s.scales[local], mins=mins)
                out[here] = part.dequantize()[:, : self.shape[1]].to(out.device)
            row0 += s.rows
        if self.input_perm is not None:
            dense = torch.empty_like(out)
            dense[:, self.input_perm] = out
            out = dense
        return out

    def to(self, device: torch.device | str) -> QuantTensor:
        """The same matrix with every tensor on ``device``."""
        segs = tuple(replace(s, codes=s.codes.to(device), scales=s.scales.to(device),
                             mins=None if s.mins is None else s.mins.to(device))
                     for s in self.segments)
        perm = None if self.input_perm is None else self.input_perm.to(device)
        return replace(self, segments=segs, input_perm=perm)

    @staticmethod
    def cat_rows(parts: Sequence[QuantTensor]) -> QuantTensor:
        """Stack matrices of one K by rows (the pieces of a fused QKV or gate_up)."""
        k, perm = parts[0].shape[1], parts[0].input_perm
        if any(p.shape[1] != k for p in parts):
            raise ValueError("pieces of different K")
        if any((p.input_perm is None) != (perm is None)
               or (perm is not None and not torch.equal(p.input_perm, perm)) for p in parts):
            raise ValueError("fused pieces with different act-order permutations")
        segs: list[QuantSegment] = []
        for seg in (s for p in parts for s in p.segments):
            prev = segs[-1] if segs else None
            if (prev is not None and prev.kind == seg.kind and prev.group == seg.group
                    and prev.scales.dtype == seg.scales.dtype
                    and (prev.mins is None) == (seg.mins is None)):
                mins = None if seg.mins is None else torch.cat([prev.mins, seg.mins])
                segs[-1] = QuantSegment(seg.kind, seg.group, torch.cat([prev.codes, seg.codes]),
                                        torch.cat([prev.scales, seg.scales]), mins)
            else:
                segs.append(seg)
        sources = sorted({p.source for p in parts if p.source})
        return QuantTensor((sum(p.shape[0] for p in parts), k), tuple(segs), "+".join(sources),
                           perm)

    def permute_rows(self, perm: torch.Tensor) -> QuantTensor:
        """Rows reordered by ``perm`` (one segment only: GGUF's Q/K un-interleaving)."""
        if len(self.segments) != 1:
            raise ValueError("permuting the rows of a multi-segment matrix")
        s = self.segments[0]
        mins = None if s.mins is None else s.mins[perm]
        seg = replace(s, codes=s.codes[perm], scales=s.scales[perm], mins=mins)
        return replace(self, segments=(seg,))

    # ---- the blob -------------------------------------------------------------------
    def to_blob(self) -> torch.Tensor:
        """One uint8 tensor holding the whole matrix (layout: :data:`BLOB_LAYOUT`)."""
        n, k = self.shape
        table, chunks, offset = [], [], round_up(HEADER_BYTES + SEGMENT_BYTES
                                                 * len(self.segments), ALIGN)
        row0 = 0
        for s in self.segments:
            arrays = [_tile_codes(s), _tile_rows(s.scales)]
            if s.mins is not None:
                arrays.append(_tile_rows(s.mins))
            offsets = []
            for a in arrays:
                offsets.append(offset)
                chunks.append((offset, a))
                offset = round_up(offset + a.numel(), ALIGN)
            mins_off = offsets[2] if s.mins is not None else 0
            table.append(struct.pack("<iiiiqqqqq8x", int(s.kind), s.group,
                                     _SCALE_DTYPES[s.scales.dtype], int(s.mins is not None),
                                     row0, s.rows, offsets[0], offsets[1], mins_off))
            row0 += s.rows
        blob = torch.zeros(offset, dtype=torch.uint8)
        head = struct.pack("<4siqqq32x", BLOB_MAGIC, len(self.segments), n, k, self.k_padded)
        meta = head + b"".join(table)
        blob[: len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        for off, a in chunks:
            blob[off: off + a.numel()] = a
        return blob

    @staticmethod
    def from_blob(blob: torch.Tensor, source: str = "") -> QuantTensor:
        """The matrix ``blob`` holds (its rows untiled: a copy): the inverse of
        :meth:`to_blob`."""
        if blob.dtype != torch.uint8 or blob.dim() != 1:
            raise ValueError("a quantized blob is a 1-D uint8 tensor")
        raw = bytes(blob[:HEADER_BYTES].cpu().numpy())
        magic, nseg, n, k, kp = struct.unpack("<4siqqq32x", raw)
        if magic != BLOB_MAGIC:
            raise ValueError("not a kvray quantized blob")
        table = bytes(blob[HEADER_BYTES: HEADER_BYTES + SEGMENT_BYTES * nseg].cpu().numpy())
        segs = []
        for i in range(nseg):
            kind, group, sdt, has_min, _row0, rows, c_off, s_off, m_off = struct.unpack(
                "<iiiiqqqqq8x", table[i * SEGMENT_BYTES:(i + 1) * SEGMENT_BYTES])
            kind = QuantKind(kind)
            tiles = -(-rows // TILE)
            width = kp // 2 if kind == QuantKind.U4 else kp
            codes = _untile_codes(kind, blob[c_off: c_off + tiles * TILE * width], rows, kp)
            sdtype = _SCALE_FROM_CODE[sdt]
            ng = kp // group
            nb = tiles * TILE * ng * torch.finfo(sdtype).bits // 8
            scales = _untile_rows(blob[s_off: s_off + nb].view(sdtype), rows, ng)
            mins = _untile_rows(blob[m_off: m_off + nb].view(sdtype), rows, ng) if has_min \
                else None
            segs.append(QuantSegment(kind, group, codes, scales, mins))
        return QuantTensor((n, k), tuple(segs), source)


def _tile_rows(values: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> bytes of [tiles, n, TILE]: per tile, the 8 rows' values side by side
    (padded with zero rows)."""
    rows, n = values.shape
    tiles = -(-rows // TILE)
    padded = values.new_zeros(tiles * TILE, n)
    padded[:rows] = values
    return padded.view(tiles, TILE, n).transpose(1, 2).contiguous().view(torch.uint8).view(-1)


def _untile_rows(data: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    tiles = -(-rows // TILE)
    return data.view(tiles, n, TILE).transpose(1, 2).reshape(tiles * TILE, n)[:rows].clone()


def _tile_codes(s: QuantSegment) -> torch.Tensor:
    """A segment's codes in the blob's order (:data:`BLOB_LAYOUT`): per tile of 8 rows and
    block of 32 columns, parts of 32 bytes holding 4 consecutive codes of each row."""
    kp, nb, tiles = s.k_padded, s.k_padded // BLOCK, -(-s.rows // TILE)
    if s.kind == QuantKind.U4:
        codes = s.int_codes().to(torch.uint8)
    else:
        codes = s.codes.contiguous().view(torch.uint8)
    padded = codes.new_zeros(tiles * TILE, kp)
    padded[: s.rows] = codes
    if s.kind == QuantKind.U4:  # [tile, row, block, part, nibble, e] -> [.., block, part, row, e]
        c = padded.view(tiles, TILE, nb, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        return (c[..., 0] | (c[..., 1] << 4)).contiguous().view(-1)
    return padded.view(tiles, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(-1)


def _untile_codes(kind: QuantKind, data: torch.Tensor, rows: int, kp: int) -> torch.Tensor:
    nb, tiles = kp // BLOCK, -(-rows // TILE)
    if kind == QuantKind.U4:
        b = data.view(tiles, nb, 4, TILE, 4)
        c = torch.stack([b & 0xF, b >> 4], dim=-1)  # [tile, block, part, row, e, nibble]
        c = c.permute(0, 3, 1, 2, 5, 4).reshape(tiles * TILE, kp)[:rows]
        return pack_u4(c)
    c = data.view(tiles, nb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, kp)
    c = c[:rows].contiguous()
    return c.view(torch.int8) if kind == QuantKind.S8 else c


def pack_u4(codes: torch.Tensor) -> torch.Tensor:
    """int codes 0..15 [rows, k_padded] -> bytes [rows, k_padded / 2] in the U4 order."""
    rows, kp = codes.shape
    c = codes.to(torch.uint8).reshape(rows, kp // BLOCK, 2, BLOCK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(rows, kp // 2)
