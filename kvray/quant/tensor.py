"""Quantized matrices as kvray holds them: :class:`QuantTensor` and its one-tensor blob.

Every quantized weight kvray loads — a GGUF block format, an AWQ/GPTQ int4 checkpoint,
an int8 weight quantized online — is converted at load time, exactly, into one of a few
*kinds* of row-major integer codes with per-group scales (and, for affine codes, mins):

    value[n, k] = scale[n, k // group] * (q[n, k] - zero) (+ min[n, k // group])

- ``U4``: unsigned 4-bit codes 0..15, two per byte. Within each block of 32 codes along K,
  byte j holds code j in its low nibble and code j + 16 in its high nibble (GGUF's Q4_0
  order, which unpacks into two 16-byte halves with one mask and one shift).
- ``U5`` / ``U6``: unsigned 5- and 6-bit codes (GGUF's Q5_0/Q5_1 and Q6_K), held here one
  per byte and packed by the blob into U4's nibbles plus one or two planes of high bits.
- ``S8``: signed 8-bit codes, one per byte.
- ``F8``: float8 e4m3fn codes (GPU FP8 checkpoints; a CPU run dequantizes them).

``zero`` is a code offset shared by a whole segment (16 for Q5_0, 32 for Q6_K; unsigned
kinds only), so that such formats need no stored mins. Scales (and mins) are fp32 or fp16
per group, or *two-level* as the K-quants store them: an 8-bit integer per group (``uint8``
or ``int8``) times an fp16 per ``super_group`` groups (``super_scales``, ``super_mins``),
whose product is exact in fp32 — a Q4_K or Q6_K matrix then takes about its file's bytes.

A matrix may hold several *segments* of rows in different kinds (a Q4_K_M GGUF stores a
fused QKV's V rows as Q6_K, the Q and K rows as Q4_K). ``group`` is 16 or a multiple of 32;
``K`` is padded to a multiple of 32 (``k_padded``) with zero codes, and the kernels pad the
activations with zeros, so padding never contributes.

:func:`kvray.quant.blob.to_blob` lays a matrix out as one contiguous
``uint8`` tensor: what the C++ kernels and the fused decode layer take as "the weight", one
tensor per linear. Rows are interleaved in tiles of 8 (:data:`TILE`) so that the kernels'
vector lanes are 8 weight rows: one broadcast of 4 activation codes meets 8 rows' codes,
and a row's dot product never needs a horizontal sum. The layout is specified in
:data:`kvray.quant.blob.BLOB_LAYOUT` and mirrored in ``kvray/kernels/csrc/cpu_quant.cpp``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

BLOCK = 32  # codes per activation block (and the K padding unit)
TILE = 8  # weight rows interleaved in the blob: one 8-lane vector holds one value per row

class QuantKind(enum.IntEnum):
    U4 = 1
    S8 = 2
    F8 = 3
    U5 = 4
    U6 = 5


UNSIGNED_BITS = {QuantKind.U4: 4, QuantKind.U5: 5, QuantKind.U6: 6}
# scale dtypes and their codes in the blob (kvray/quant/blob.py)
SCALE_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.uint8: 2, torch.int8: 3}
_SUB_DTYPES = (torch.uint8, torch.int8)  # two-level: an 8-bit integer per group


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class QuantSegment:
    """Rows of one kind: ``codes`` [rows, code bytes per row] (U4: two codes per byte; U5,
    U6: one code per byte; int8 for S8; uint8 holding float8 bits for F8), ``scales`` and
    ``mins`` [rows, k_padded // group] (fp32/fp16, or 8-bit integers times ``super_scales``
    / ``super_mins`` [rows, groups // super_group] fp16)."""

    kind: QuantKind
    group: int
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    zero: int = 0
    super_group: int = 0
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows = self.codes.shape[0]
        if self.group != 16 and self.group % BLOCK:
            raise ValueError(f"quantization group {self.group}: must be 16 or a multiple of 32")
        if self.scales.dtype not in SCALE_DTYPE_CODES:
            raise ValueError(f"scales must be fp32, fp16, uint8 or int8, not {self.scales.dtype}")
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
        if self.zero and (self.kind not in UNSIGNED_BITS or not 0 < self.zero <= 64):
            raise ValueError(f"code offset {self.zero}: only 1..64, on unsigned kinds")
        two_level = self.scales.dtype in _SUB_DTYPES
        if two_level != (self.super_group > 0):
            raise ValueError("8-bit scales need a super_group (and fp16 super_scales); "
                             "fp32/fp16 scales take none")
        if two_level:
            ns = -(-self.scales.shape[1] // self.super_group)  # the last one may be partial
            for name, sup, sub in (("super_scales", self.super_scales, self.scales),
                                   ("super_mins", self.super_mins, self.mins)):
                if (sup is None) != (sub is None):
                    raise ValueError(f"{name}: given with the 8-bit values, and only then")
                if sup is not None and (sup.dtype != torch.float16
                                        or tuple(sup.shape) != (rows, ns)):
                    raise ValueError(f"{name} must be fp16 [{rows}, {ns}]")
        elif self.super_scales is not None or self.super_mins is not None:
            raise ValueError("super_scales / super_mins without 8-bit scales")

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def k_padded(self) -> int:
        return self.codes.shape[1] * (2 if self.kind == QuantKind.U4 else 1)

    @property
    def two_level(self) -> bool:
        return self.super_group > 0

    def int_codes(self) -> torch.Tensor:
        """The codes as int32 [rows, k_padded] (U4: 0..15; U5, U6: 0..31, 0..63; S8:
        -128..127; F8: not ints), before ``zero`` is taken off."""
        if self.kind == QuantKind.U4:
            b = self.codes.view(torch.uint8).reshape(self.rows, -1, BLOCK // 2).to(torch.int32)
            return torch.cat([b & 0xF, b >> 4], dim=2).reshape(self.rows, self.k_padded)
        if self.kind in UNSIGNED_BITS:
            return self.codes.view(torch.uint8).to(torch.int32)
        if self.kind == QuantKind.S8:
            return self.codes.view(torch.int8).to(torch.int32)
        raise ValueError("F8 codes are floats")

    def _level(self, sub: torch.Tensor, sup: torch.Tensor | None) -> torch.Tensor:
        """Per-group fp32 values [rows, groups]: two-level ones multiplied out (exact)."""
        if sup is None:
            return sub.to(torch.float32)
        per = sup.to(torch.float32).repeat_interleave(self.super_group, dim=1)
        return sub.to(torch.float32) * per[:, : sub.shape[1]]

    def group_scales(self) -> torch.Tensor:
        return self._level(self.scales, self.super_scales)

    def group_mins(self) -> torch.Tensor | None:
        return None if self.mins is None else self._level(self.mins, self.super_mins)

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, k_padded]: the plain reference every kernel is tested against."""
        if self.kind == QuantKind.F8:
            q = self.codes.view(torch.float8_e4m3fn).to(torch.float32)
        else:
            q = (self.int_codes() - self.zero).to(torch.float32)
        w = q * self.group_scales().repeat_interleave(self.group, dim=1)
        mins = self.group_mins()
        if mins is not None:
            w = w + mins.repeat_interleave(self.group, dim=1)
        return w

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantSegment:
        """The segment with ``fn`` applied to each of its per-row tensors (a row selection,
        a move to another device)."""
        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)
        return replace(self, codes=fn(self.codes), scales=fn(self.scales), mins=opt(self.mins),
                       super_scales=opt(self.super_scales), super_mins=opt(self.super_mins))

    def narrow_rows(self, start: int, length: int) -> QuantSegment:
        return self.map_rows(lambda t: t.narrow(0, start, length))

    def one_level(self) -> QuantSegment:
        """The same values with fp32 scales and mins (two-level ones multiplied out)."""
        if not self.two_level:
            return self
        return replace(self, scales=self.group_scales(), mins=self.group_mins(),
                       super_group=0, super_scales=None, super_mins=None)

    def basic(self) -> QuantSegment:
        """The same values as U4, S8 or F8 codes with fp32/fp16 scales and no code offset
        (exact): what the Triton kernels read."""
        seg = self.one_level()
        if seg.kind == QuantKind.U4 and seg.zero and seg.mins is None:
            scales = seg.scales.to(torch.float32)  # - zero * scale: exact in fp32
            return replace(seg, scales=scales, mins=scales * -seg.zero, zero=0)
        if seg.kind in (QuantKind.U5, QuantKind.U6) or seg.zero:
            codes = (seg.int_codes() - seg.zero).to(torch.int8)  # within -64..63
            seg = replace(seg, kind=QuantKind.S8, codes=codes, zero=0)
        return seg

    def narrow_cols(self, start: int, length: int) -> QuantSegment:
        """Columns [start, start + length) of codes on group and block boundaries (and on
        super-group boundaries, else the scales are multiplied out to one level first)."""
        per_byte = 2 if self.kind == QuantKind.U4 else 1
        if self.group == self.k_padded and start % BLOCK == 0 and not self.two_level:
            # One scale per row (per-channel FP8, GPTQ group -1): any block boundary splits it.
            codes = self.codes.narrow(1, start // per_byte, round_up(length, BLOCK) // per_byte)
            return replace(self, group=round_up(length, BLOCK), codes=codes)
        unit = max(self.group, BLOCK)
        if start % unit or (length % unit and start + length != self.k_padded):
            raise ValueError(f"columns {start}..{start + length} do not fall on the "
                             f"quantization groups of {unit}")
        if self.two_level:
            span = self.group * self.super_group
            if start % span or (length % span and start + length != self.k_padded):
                return self.one_level().narrow_cols(start, length)
        g0, glen = start // self.group, -(-length // self.group)
        codes = self.codes.narrow(1, start // per_byte, round_up(length, BLOCK) // per_byte)
        sup = {}
        if self.two_level:
            s0, slen = g0 // self.super_group, -(-glen // self.super_group)
            sup = {"super_scales": self.super_scales.narrow(1, s0, slen),
                   "super_mins": None if self.super_mins is None
                   else self.super_mins.narrow(1, s0, slen)}
        return replace(self, codes=codes, scales=self.scales.narrow(1, g0, glen),
                       mins=None if self.mins is None else self.mins.narrow(1, g0, glen), **sup)

    @property
    def nbytes(self) -> int:
        """Bytes as the kernels hold the segment (U5 / U6 codes packed to 5 / 6 bits)."""
        bits = UNSIGNED_BITS.get(self.kind, 8)
        n = self.rows * self.k_padded * bits // 8
        for t in (self.scales, self.mins, self.super_scales, self.super_mins):
            if t is not None:
                n += t.numel() * t.element_size()
        return n

    def same_layout(self, other: QuantSegment) -> bool:
        """Whether ``other``'s rows can be stacked under this segment's (one kind, group,
        offset and scale layout)."""
        return (self.kind == other.kind and self.group == other.group
                and self.scales.dtype == other.scales.dtype and self.zero == other.zero
                and self.super_group == other.super_group
                and (self.mins is None) == (other.mins is None))

    @staticmethod
    def stack(parts: Sequence[QuantSegment]) -> QuantSegment:
        """Segments of one layout stacked by rows."""
        first = parts[0]

        def cat(name: str) -> torch.Tensor | None:
            ts = [getattr(p, name) for p in parts]
            return None if ts[0] is None else torch.cat(ts)
        return replace(first, codes=cat("codes"), scales=cat("scales"), mins=cat("mins"),
                       super_scales=cat("super_scales"), super_mins=cat("super_mins"))


@dataclass(frozen=True)
class QuantTensor:
    """A quantized matrix [N, K]: segments of rows stacked in order (see the module doc).
    What loaders hand to the layers' weight loaders in place of a dense tensor."""

    shape: tuple[int, int]
    segments: tuple[QuantSegment, ...]
    source: str = ""  # the checkpoint format, for logs ("GGUF Q4_1", "int8", "AWQ")
    # Columns stored in this order (GPTQ act-order): y = gather_input(x, input_perm) @
    # stored^T. Index K (one past x's columns) is a zero column: the padding of a TP shard's
    # runs of columns (see :meth:`narrow`), so a shard may store more columns than K.
    input_perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.shape
        if sum(s.rows for s in self.segments) != n:
            raise ValueError(f"segments hold {sum(s.rows for s in self.segments)} rows, not {n}")
        for s in self.segments:
            if s.k_padded != self.k_padded:
                raise ValueError(f"a segment holds {s.k_padded} codes per row for K = {k}")
        if self.input_perm is not None and self.input_perm.numel() < k:
            raise ValueError(f"an input permutation of {self.input_perm.numel()} columns "
                             f"for K = {k}")

    @property
    def stored_k(self) -> int:
        """Columns as stored: K, or more where a TP shard of an act-order matrix pads its
        runs (what the kernels read, from :func:`gather_input`'s activations)."""
        return self.shape[1] if self.input_perm is None else self.input_perm.numel()

    @property
    def k_padded(self) -> int:
        return round_up(self.stored_k, BLOCK)

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
        stored = torch.cat([s.dequantize()[:, : self.stored_k] for s in self.segments])
        return self._unpermute(stored).to(dtype)

    def _unpermute(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored columns [., stored_k] back in x's order [., K] (padding dropped)."""
        if self.input_perm is None:
            return stored
        k, perm = self.shape[1], self.input_perm.to(stored.device)
        dense = stored.new_empty(stored.shape[0], k)
        if perm.numel() == k:
            dense[:, perm] = stored
        else:  # a TP shard: its padding (index k) dropped
            real = perm < k
            dense[:, perm[real]] = stored[:, real]
        return dense

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
            if start < 0 or start + length > k:
                raise ValueError(f"columns {start}..{start + length} outside {k}")
            if self.input_perm is not None:
                return self._narrow_permuted_cols(start, length)
            if start + length != k and (start + length) % BLOCK:
                raise ValueError(f"columns {start}..{start + length} do not fall on the "
                                 f"quantization blocks of {BLOCK}")
            segs = tuple(s.narrow_cols(start, round_up(length, BLOCK)
                                       if start + length == k else length)
                         for s in self.segments)
            return replace(self, shape=(n, length), segments=segs)
        raise ValueError(f"dim {dim} of a matrix")

    def _narrow_permuted_cols(self, start: int, length: int) -> QuantTensor:
        """x's columns [start, start + length) of an act-order matrix (a row-parallel TP
        shard). Its stored columns are sorted by group, so the shard's fall in runs of any
        size, one per group; each run is padded to whole blocks of 32 that take its group's
        scale (and min), and the padding reads the zero column past x's (index
        ``length``): the same products exactly, for up to 31 more columns per group."""
        perm = self.input_perm.cpu().to(torch.int64)
        segs = [s.one_level() for s in self.segments]
        unit = math.gcd(*(s.group for s in segs))  # runs never cross any segment's group
        kept = torch.nonzero((perm >= start) & (perm < start + length)).flatten()
        chunk = kept // unit
        cols, new_perm, block_chunk, first = [], [], [], 0
        for c, run in zip(*torch.unique_consecutive(chunk, return_counts=True), strict=True):
            n_run = int(run)
            run_cols, first = kept[first:first + n_run], first + n_run
            pad = (-n_run) % BLOCK
            cols.append(torch.cat([run_cols, run_cols.new_full((pad,), -1)]))
            new_perm.append(torch.cat([perm[run_cols] - start, perm.new_full((pad,), length)]))
            block_chunk += [int(c)] * ((n_run + pad) // BLOCK)
        col_idx = torch.cat(cols)
        src = col_idx.clamp(min=0)
        block_col = torch.tensor(block_chunk, dtype=torch.int64) * unit  # a column of its group
        out = []
        for s in segs:
            dev = s.codes.device
            pads = (col_idx < 0).to(dev)
            if s.kind == QuantKind.U4:
                codes = pack_u4(s.int_codes()[:, src.to(dev)].masked_fill(pads, 0))
            else:  # one byte per code
                codes = s.codes[:, src.to(dev)].masked_fill(pads, 0)
            groups = (block_col // s.group).to(s.scales.device)
            out.append(replace(s, group=BLOCK, codes=codes, scales=s.scales[:, groups],
                               mins=None if s.mins is None else s.mins[:, groups]))
        return replace(self, shape=(self.shape[0], length), segments=tuple(out),
                       input_perm=torch.cat(new_perm).to(self.input_perm.device))

    @staticmethod
    def zeros(rows: int, k: int) -> QuantTensor:
        """``rows`` rows of zeros (padding: a vocab split unevenly over TP ranks)."""
        kp = round_up(k, BLOCK)
        seg = QuantSegment(QuantKind.S8, kp, torch.zeros(rows, kp, dtype=torch.int8),
                           torch.ones(rows, 1, dtype=torch.float16))
        return QuantTensor((rows, k), (seg,), "padding")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows ``ids`` [n] -> [n, K], dequantized (an embedding lookup's reference)."""
        out = torch.empty(ids.numel(), self.stored_k, dtype=torch.float32, device=ids.device)
        row0 = 0
        for s in self.segments:
            here = (ids >= row0) & (ids < row0 + s.rows)
            if here.any():
                local = ids[here] - row0
                part = s.map_rows(lambda t, local=local: t[local])
                out[here] = part.dequantize()[:, : self.stored_k].to(out.device)
            row0 += s.rows
        return self._unpermute(out)

    def to(self, device: torch.device | str) -> QuantTensor:
        """The same matrix with every tensor on ``device``."""
        segs = tuple(s.map_rows(lambda t: t.to(device)) for s in self.segments)
        perm = None if self.input_perm is None else self.input_perm.to(device)
        return replace(self, segments=segs, input_perm=perm)

    def basic(self) -> QuantTensor:
        """The same matrix in U4 / S8 / F8 segments with fp32/fp16 scales (exact; see
        :meth:`QuantSegment.basic`)."""
        return replace(self, segments=tuple(s.basic() for s in self.segments))

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
            if segs and segs[-1].same_layout(seg):
                segs[-1] = QuantSegment.stack([segs[-1], seg])
            else:
                segs.append(seg)
        sources = sorted({p.source for p in parts if p.source})
        return QuantTensor((sum(p.shape[0] for p in parts), k), tuple(segs), "+".join(sources),
                           perm)

    def permute_rows(self, perm: torch.Tensor) -> QuantTensor:
        """Rows reordered by ``perm`` (one segment only: GGUF's Q/K un-interleaving)."""
        if len(self.segments) != 1:
            raise ValueError("permuting the rows of a multi-segment matrix")
        return replace(self, segments=(self.segments[0].map_rows(lambda t: t[perm]),))


def gather_input(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x [M, K]'s columns in an act-order weight's stored order (``QuantTensor.input_perm``);
    index K reads zeros (the padding of a TP shard's runs of columns)."""
    if perm.numel() > x.shape[1]:
        x = torch.nn.functional.pad(x, (0, 1))
    return x.index_select(1, perm)


def pack_u4(codes: torch.Tensor) -> torch.Tensor:
    """int codes 0..15 [rows, k_padded] -> bytes [rows, k_padded / 2] in the U4 order."""
    rows, kp = codes.shape
    c = codes.to(torch.uint8).reshape(rows, kp // BLOCK, 2, BLOCK // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(rows, kp // 2)
