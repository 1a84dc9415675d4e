"""A :class:`~kvray.quant.tensor.QuantTensor` as one contiguous ``uint8`` tensor, the form
the C++ kernels and the fused decode layer take as "the weight" (one tensor per linear):
a header, a segment table, then each segment's codes, scales and mins at 64-byte-aligned
offsets. The layout is :data:`BLOB_LAYOUT`, mirrored in ``kvray/kernels/csrc/cpu_quant.cpp``.
"""

from __future__ import annotations

import struct

import torch

from kvray.quant.tensor import (
    BLOCK,
    SCALE_DTYPE_CODES,
    TILE,
    UNSIGNED_BITS,
    QuantKind,
    QuantSegment,
    QuantTensor,
    pack_u4,
    round_up,
)

BLOB_MAGIC = b"KVQ3"
HEADER_BYTES = 64
SEGMENT_BYTES = 128
ALIGN = 64
_SCALE_FROM_CODE = {v: k for k, v in SCALE_DTYPE_CODES.items()}

BLOB_LAYOUT = """
header (64 bytes, little-endian):
  [0:4]   magic b"KVQ3"
  [4:8]   int32 num_segments
  [8:16]  int64 N (rows)
  [16:24] int64 K (logical columns)
  [24:32] int64 k_padded (K rounded up to a multiple of 32)
  [32:64] zero
segment table at byte 64, num_segments entries of 128 bytes, in row order:
  [0:4]   int32 kind (1 = U4, 2 = S8, 3 = F8, 4 = U5, 5 = U6)
  [4:8]   int32 group (16 or a multiple of 32; divides k_padded)
  [8:12]  int32 scale dtype (0 = fp32, 1 = fp16, 2 = uint8 and 3 = int8 two-level)
  [12:16] int32 has_min (0/1; mins have the scales' dtype)
  [16:24] int64 row0 (first row)
  [24:32] int64 rows
  [32:40] int64 codes offset (bytes from the blob's start; 64-aligned)
  [40:48] int64 scales offset
  [48:56] int64 mins offset (0 without mins)
  [56:60] int32 zero (code offset, 0..64)
  [60:64] int32 super_group (groups per fp16 super-scale; 0 unless two-level)
  [64:72] int64 super-scales offset (0 unless two-level)
  [72:80] int64 super-mins offset (0 unless two-level with mins)
  [80:128] zero
A segment's rows are stored in tiles of 8 (the last one padded with zero rows), each tile
as k_padded / 32 blocks of 32 columns:
codes, per tile and block: U4 4 x 32 bytes, byte 4 r + e of part j holding row r's code of
  column 8 j + e (low nibble) and 8 j + 4 + e (high nibble); U5 and U6 the same nibbles
  followed by planes of 32 bytes whose byte 4 r + e holds the high bits of those codes: U5
  one plane, bit j the 5th bit of part j's low-nibble code, bit 4 + j of its high-nibble
  code; U6 two planes (low-nibble codes, then high-nibble codes), bits 2 j and 2 j + 1 the
  5th and 6th bits of part j's code; S8 and F8 8 x 32 bytes, byte 4 r + e of part c holding
  row r's code of column 4 c + e
scales, mins: per tile and group, the 8 rows' values of the scale dtype
super-scales, super-mins: per tile and super-group, the 8 rows' fp16 values
"""
_HEADER_FORMAT = "<4siqqq32x"
_SEGMENT_FORMAT = "<iiiiqqqqqiiqq48x"


def to_blob(qt: QuantTensor) -> torch.Tensor:
    """One uint8 tensor holding the whole matrix ``qt`` (layout: :data:`BLOB_LAYOUT`); K is
    the stored columns (an act-order TP shard's padded runs included: the kernels read the
    activations :func:`~kvray.quant.tensor.gather_input` made)."""
    n, k = qt.shape[0], qt.stored_k
    table, chunks, offset = [], [], round_up(HEADER_BYTES + SEGMENT_BYTES
                                             * len(qt.segments), ALIGN)
    row0 = 0
    for s in qt.segments:
        arrays = [_tile_codes(s), _tile_rows(s.scales),
                  None if s.mins is None else _tile_rows(s.mins),
                  None if s.super_scales is None else _tile_rows(s.super_scales),
                  None if s.super_mins is None else _tile_rows(s.super_mins)]
        offsets = []
        for a in arrays:
            if a is None:
                offsets.append(0)
                continue
            offsets.append(offset)
            chunks.append((offset, a))
            offset = round_up(offset + a.numel(), ALIGN)
        table.append(struct.pack(_SEGMENT_FORMAT, int(s.kind), s.group,
                                 SCALE_DTYPE_CODES[s.scales.dtype], int(s.mins is not None),
                                 row0, s.rows, offsets[0], offsets[1], offsets[2], s.zero,
                                 s.super_group, offsets[3], offsets[4]))
        row0 += s.rows
    blob = torch.zeros(offset, dtype=torch.uint8)
    head = struct.pack(_HEADER_FORMAT, BLOB_MAGIC, len(qt.segments), n, k, qt.k_padded)
    meta = head + b"".join(table)
    blob[: len(meta)] = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    for off, a in chunks:
        blob[off: off + a.numel()] = a
    return blob

def from_blob(blob: torch.Tensor, source: str = "") -> QuantTensor:
    """The matrix ``blob`` holds (its rows untiled: a copy): the inverse of
    :func:`to_blob`."""
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise ValueError("a quantized blob is a 1-D uint8 tensor")
    raw = bytes(blob[:HEADER_BYTES].cpu().numpy())
    magic, nseg, n, k, kp = struct.unpack(_HEADER_FORMAT, raw)
    if magic != BLOB_MAGIC:
        raise ValueError("not a kvray quantized blob")
    table = bytes(blob[HEADER_BYTES: HEADER_BYTES + SEGMENT_BYTES * nseg].cpu().numpy())
    segs = []
    for i in range(nseg):
        (kind, group, sdt, has_min, _row0, rows, c_off, s_off, m_off, zero, super_group,
         ss_off, sm_off) = struct.unpack(
            _SEGMENT_FORMAT, table[i * SEGMENT_BYTES:(i + 1) * SEGMENT_BYTES])
        kind = QuantKind(kind)
        tiles = -(-rows // TILE)
        codes = _untile_codes(kind, blob[c_off: c_off + tiles * TILE * _row_bytes(kind, kp)],
                              rows, kp)
        sdtype, ng = _SCALE_FROM_CODE[sdt], kp // group
        scales = _rows_at(blob, s_off, rows, ng, sdtype)
        mins = _rows_at(blob, m_off, rows, ng, sdtype) if has_min else None
        sup = smin = None
        if super_group:
            ns = -(-ng // super_group)
            sup = _rows_at(blob, ss_off, rows, ns, torch.float16)
            smin = _rows_at(blob, sm_off, rows, ns, torch.float16) if has_min else None
        segs.append(QuantSegment(kind, group, codes, scales, mins, zero, super_group, sup,
                                 smin))
    return QuantTensor((n, k), tuple(segs), source)


def _row_bytes(kind: QuantKind, kp: int) -> int:
    """Bytes of one row's codes in the blob."""
    return kp * UNSIGNED_BITS.get(kind, 8) // 8


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


def _rows_at(blob: torch.Tensor, offset: int, rows: int, n: int, dtype: torch.dtype
             ) -> torch.Tensor:
    """[rows, n] values of ``dtype`` tiled at ``offset`` of the blob."""
    size = -(-rows // TILE) * TILE * n * torch.empty(0, dtype=dtype).element_size()
    return _untile_rows(blob[offset: offset + size].view(dtype), rows, n)


def _tile_codes(s: QuantSegment) -> torch.Tensor:
    """A segment's codes in the blob's order (:data:`BLOB_LAYOUT`): per tile of 8 rows and
    block of 32 columns, parts of 32 bytes holding 4 consecutive codes of each row (U5 / U6:
    then their planes of high bits)."""
    kp, nb, tiles = s.k_padded, s.k_padded // BLOCK, -(-s.rows // TILE)
    if s.kind in UNSIGNED_BITS:
        codes = s.int_codes().to(torch.uint8)
    else:
        codes = s.codes.contiguous().view(torch.uint8)
    padded = codes.new_zeros(tiles * TILE, kp)
    padded[: s.rows] = codes
    if s.kind not in UNSIGNED_BITS:
        return padded.view(tiles, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(-1)
    # [tile, row, block, part, nibble, e] -> [tile, block, part, row, e, nibble]
    c = padded.view(tiles, TILE, nb, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = ((c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)).reshape(tiles, nb, 128)
    if s.kind == QuantKind.U4:
        return nibbles.contiguous().view(-1)
    high = (c >> 4).to(torch.int32)  # [tile, block, part, row, e, nibble]
    shift = torch.arange(4, dtype=torch.int32).view(1, 1, 4, 1, 1)
    if s.kind == QuantKind.U5:
        plane = ((high[..., 0] << shift) | (high[..., 1] << (shift + 4))).sum(2)
        planes = plane.reshape(tiles, nb, 32)
    else:
        planes = torch.cat([(high[..., j] << (2 * shift)).sum(2).reshape(tiles, nb, 32)
                            for j in (0, 1)], dim=2)
    return torch.cat([nibbles, planes.to(torch.uint8)], dim=2).contiguous().view(-1)


def _untile_codes(kind: QuantKind, data: torch.Tensor, rows: int, kp: int) -> torch.Tensor:
    nb, tiles = kp // BLOCK, -(-rows // TILE)
    if kind not in UNSIGNED_BITS:
        c = data.view(tiles, nb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, kp)
        c = c[:rows].contiguous()
        return c.view(torch.int8) if kind == QuantKind.S8 else c
    per_block = TILE * BLOCK * UNSIGNED_BITS[kind] // 8
    d = data.view(tiles, nb, per_block)
    b = d[..., :128].reshape(tiles, nb, 4, TILE, 4)
    c = torch.stack([b & 0xF, b >> 4], dim=-1).to(torch.int32)  # [tile, block, part, row, e, nib]
    shift = torch.arange(4, dtype=torch.int32).view(1, 1, 4, 1, 1)
    if kind == QuantKind.U5:
        plane = d[..., 128:160].reshape(tiles, nb, 1, TILE, 4).to(torch.int32)
        c[..., 0] |= ((plane >> shift) & 1) << 4
        c[..., 1] |= ((plane >> (shift + 4)) & 1) << 4
    elif kind == QuantKind.U6:
        for j in (0, 1):
            plane = d[..., 128 + 32 * j: 160 + 32 * j].reshape(tiles, nb, 1, TILE, 4)
            c[..., j] |= ((plane.to(torch.int32) >> (2 * shift)) & 3) << 4
    c = c.permute(0, 3, 1, 2, 5, 4).reshape(tiles * TILE, kp)[:rows]
    return pack_u4(c) if kind == QuantKind.U4 else c.to(torch.uint8).contiguous()
