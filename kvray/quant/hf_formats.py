"""Pre-quantized Hugging Face checkpoints (AWQ, GPTQ, FP8, compressed-tensors) read exactly
into :class:`~kvray.quant.tensor.QuantTensor`.

:func:`checkpoint_quantization` reads ``quantization_config`` into a :class:`QuantScheme`;
:func:`convert_prequantized` regroups the checkpoint's per-module tensors (``qweight``,
``qzeros``, ``scales``, ``g_idx``...; they may arrive in any order and across shards) into
one ``<module>.weight`` QuantTensor each, passing dense tensors through unchanged.

Integer formats all dequantize as ``w = s * (q - z)`` with unsigned codes ``q`` and zero
points ``z``; kvray stores them as (see ``kvray/quant/tensor.py``):

- 4 bits: ``U4`` codes ``q`` with ``min = -s * z``;
- 8 bits: ``S8`` codes ``q - 128`` with ``min = s * (128 - z)``, no mins when every
  ``z == 128`` (symmetric).

With fp16/bf16 scales (what AWQ, GPTQ and llm-compressor write) both products and their
sum are exact in fp32, so :meth:`QuantTensor.dequantize` equals the format's own
dequantization bit for bit. Per-group scales are repeated onto kvray's groups (a divisor of
the format's group), FP8 block scales onto every row of their block: exact too. GPTQ act
order (``g_idx``) sorts the columns so each group is contiguous and records the order in
``input_perm``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvray.quant.tensor import BLOCK, QuantKind, QuantSegment, QuantTensor, pack_u4, round_up

assert sys.byteorder == "little", "the unpacking below reads int32 words as their bytes"


class UnsupportedQuantizationError(ValueError):
    """``quantization_config`` names a method or an option kvray does not read; the
    message names the key and its value."""


class QuantizedCheckpointError(ValueError):
    """A quantized module's tensors are missing or inconsistent; the message names them."""


@dataclass(frozen=True)
class QuantScheme:
    """How a pre-quantized checkpoint stores its linear weights."""

    method: str  # "awq" | "gptq" | "fp8" | "compressed-tensors"
    fmt: str = ""  # compressed-tensors format: float-quantized | int-quantized | pack-quantized
    bits: int = 4
    group_size: int = -1  # -1: one group over the whole row (per output channel)
    sym: bool = True
    act_order: bool = False  # a g_idx tensor gives each input column's group
    zero_offset: int = 0  # added to stored zero points (GPTQ v1 stores zero - 1)
    weight_block: tuple[int, int] | None = None  # FP8 block scales: [rows, columns]

    @property
    def source(self) -> str:
        """A short name for logs and ``QuantTensor.source``: "GPTQ int4 g128 act-order"."""
        name = {"awq": "AWQ", "gptq": "GPTQ", "fp8": "FP8",
                "compressed-tensors": "compressed-tensors"}[self.method]
        if self.is_float:
            if self.weight_block:
                return f"{name} e4m3 block {self.weight_block[0]}x{self.weight_block[1]}"
            return f"{name} e4m3"
        group = "per-channel" if self.group_size <= 0 else f"g{self.group_size}"
        return f"{name} int{self.bits} {group}" + (" act-order" if self.act_order else "")

    @property
    def is_float(self) -> bool:
        return self.method == "fp8" or self.fmt == "float-quantized"


# ---- quantization_config -> QuantScheme ------------------------------------------------

# Older AutoGPTQ / AutoAWQ releases kept the settings beside config.json, not in it
SIDE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def checkpoint_quantization(hf_config: Any, folder: str | Path | None = None
                            ) -> QuantScheme | None:
    """The scheme of a checkpoint's ``quantization_config`` (None when it has none), or of
    a ``quantize_config.json`` / ``quant_config.json`` in ``folder`` when config.json has
    none (older AutoGPTQ / AutoAWQ checkpoints, as vLLM reads them).

    Raises UnsupportedQuantizationError naming the key and value kvray cannot read."""
    qc = hf_config.get("quantization_config") if isinstance(hf_config, Mapping) else \
        getattr(hf_config, "quantization_config", None)
    if qc is None and folder is not None:
        qc = _side_file_config(Path(folder))
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        qc = qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    parsers = {"awq": _awq_scheme, "gptq": _gptq_scheme, "fp8": _fp8_scheme,
               "compressed-tensors": _compressed_tensors_scheme}
    if method not in parsers:
        raise UnsupportedQuantizationError(
            f"quantization_config.quant_method = {qc.get('quant_method')!r}: kvray reads "
            f"{', '.join(parsers)} checkpoints")
    return parsers[method](qc)


def _side_file_config(folder: Path) -> dict[str, Any] | None:
    for name, method in SIDE_FILES.items():
        path = folder / name
        if not path.is_file():
            continue
        try:
            qc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise UnsupportedQuantizationError(f"{path}: cannot read it as JSON ({err})"
                                               ) from None
        if not isinstance(qc, dict):
            raise UnsupportedQuantizationError(f"{path}: not a JSON object")
        return {"quant_method": method, **qc}
    return None


def _unsupported(key: str, value: Any, allowed: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"quantization_config.{key} = {value!r} is not supported (kvray reads {allowed})")


def _group(key: str, value: Any) -> int:
    group = -1 if value is None else int(value)
    if group != -1 and (group <= 0 or (group != 16 and group % BLOCK)):
        raise _unsupported(key, value, "-1, 16 or a multiple of 32")
    return group


def _awq_scheme(qc: Mapping[str, Any]) -> QuantScheme:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _unsupported("version", qc.get("version"), "'gemm'")
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise _unsupported("bits", bits, "4")
    if not qc.get("zero_point", True):
        raise _unsupported("zero_point", qc.get("zero_point"), "true")
    key = "group_size" if "group_size" in qc else "q_group_size"
    return QuantScheme("awq", bits=4, group_size=_group(key, qc.get(key, 128)), sym=False)


def _gptq_scheme(qc: Mapping[str, Any]) -> QuantScheme:
    bits = qc.get("bits", 4)
    if bits not in (4, 8):
        raise _unsupported("bits", bits, "4 or 8")
    if qc.get("is_marlin_format"):
        raise _unsupported("is_marlin_format", True, "false")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise _unsupported("pack_dtype", qc.get("pack_dtype"), "int32")
    fmt_key = "checkpoint_format" if "checkpoint_format" in qc else "format"
    fmt = str(qc.get(fmt_key) or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported(fmt_key, qc.get(fmt_key), "'gptq' or 'gptq_v2'")
    group = _group("group_size", qc.get("group_size", 128))
    _check_dynamic(qc)
    return QuantScheme("gptq", bits=bits, group_size=group, sym=bool(qc.get("sym", True)),
                       act_order=bool(qc.get("desc_act", False)) and group != -1,
                       zero_offset=1 if fmt == "gptq" else 0)


def _check_dynamic(qc: Mapping[str, Any]) -> None:
    """GPTQModel's per-module overrides (``dynamic``): modules it leaves out (``-:``) are
    stored dense and load as such; an override of bits / group size / symmetry / act
    order for some modules is a second scheme, which kvray does not read."""
    for pattern, override in (qc.get("dynamic") or {}).items():
        if str(pattern).startswith("-:"):
            continue
        changed = {k: v for k, v in (override or {}).items()
                   if k in ("bits", "group_size", "sym", "desc_act") and v != qc.get(k)}
        if changed:
            raise _unsupported(f"dynamic[{pattern!r}]", changed,
                               "overrides that leave modules out ('-:' patterns) only: one "
                               "scheme for every quantized module")


def _fp8_scheme(qc: Mapping[str, Any]) -> QuantScheme:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _unsupported("fmt", qc.get("fmt"), "'e4m3'")
    block = qc.get("weight_block_size")
    if block is not None:
        if len(block) != 2 or block[1] % BLOCK:
            raise _unsupported("weight_block_size", block, "[rows, a multiple of 32]")
        block = (int(block[0]), int(block[1]))
    return QuantScheme("fp8", bits=8, weight_block=block)


def _compressed_tensors_scheme(qc: Mapping[str, Any]) -> QuantScheme | None:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _unsupported("quantization_status", status, "'compressed'")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise _unsupported("sparsity_config.format", sparsity.get("format"), "'dense'")
    if qc.get("transform_config"):  # rotations (QuIP, SpinQuant) applied around the linears
        raise _unsupported("transform_config", "(set)", "checkpoints without transforms")
    # groups that quantize weights (a KV-cache-only checkpoint has none: dense weights)
    groups = {name: g for name, g in (qc.get("config_groups") or {}).items()
              if g.get("targets", ["Linear"]) and g.get("weights")}
    if not groups:
        return None
    schemes = {_ct_group_scheme(name, g, qc.get("format")) for name, g in groups.items()}
    if len(schemes) != 1:
        raise UnsupportedQuantizationError(
            f"quantization_config.config_groups: {len(schemes)} different weight schemes "
            "(kvray reads checkpoints whose quantized linears share one scheme)")
    return schemes.pop()


def _ct_group_scheme(name: str, group: Mapping[str, Any], fmt: str | None) -> QuantScheme:
    key = f"config_groups.{name}.weights"
    w = group.get("weights") or {}
    fmt = group.get("format") or fmt
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    if fmt == "float-quantized":
        if (kind, bits) != ("float", 8):
            raise _unsupported(f"{key}.num_bits", bits, "8-bit floats for float-quantized")
        if strategy not in ("tensor", "channel", "block"):
            raise _unsupported(f"{key}.strategy", strategy, "tensor, channel or block")
        if not w.get("symmetric", True):
            raise _unsupported(f"{key}.symmetric", False, "true for float weights")
        block = w.get("block_structure") if strategy == "block" else None
        if block is not None and (len(block) != 2 or block[1] % BLOCK):
            raise _unsupported(f"{key}.block_structure", block, "[rows, a multiple of 32]")
        return QuantScheme("compressed-tensors", fmt, bits=8,
                           weight_block=None if block is None else (int(block[0]),
                                                                    int(block[1])))
    if fmt not in ("pack-quantized", "int-quantized"):
        raise _unsupported("format", fmt, "float-quantized, int-quantized, pack-quantized")
    if kind != "int" or bits not in ((4, 8) if fmt == "pack-quantized" else (8,)):
        raise _unsupported(f"{key}.num_bits", bits, f"int4/int8 ({fmt}: int8 only for "
                           "int-quantized)")
    if strategy not in ("tensor", "channel", "group"):
        raise _unsupported(f"{key}.strategy", strategy, "tensor, channel or group")
    gs = _group(f"{key}.group_size", w.get("group_size")) if strategy == "group" else -1
    return QuantScheme("compressed-tensors", fmt, bits=bits, group_size=gs,
                       sym=bool(w.get("symmetric", True)),
                       act_order=w.get("actorder") == "group" and gs != -1)


# ---- per-module tensors -> QuantTensor ---------------------------------------------------

_DROPPED = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale", "q_scale",
            "prob_scale")  # activation / attention scales: kvray computes its own


def convert_prequantized(weights: Iterator[tuple[str, torch.Tensor]], scheme: QuantScheme,
                         ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """Yield the checkpoint's tensors with each quantized module's tensors replaced by one
    ``<module>.weight`` QuantTensor, as soon as that module's last tensor arrives.

    Activation and KV scales (``input_scale``, ``k_scale``...) are dropped: kvray computes
    them per token. Raises QuantizedCheckpointError naming a module's missing tensor when
    the checkpoint ends before it is complete."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    dense_weights: dict[str, torch.dtype] = {}  # modules whose weight passed through dense
    converted = 0
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        role = _role(leaf, tensor, scheme)
        if role == "pass":
            if leaf == "weight":
                dense_weights[prefix] = tensor.dtype
            yield name, tensor
            continue
        if role == "check":
            _check_redundant(name, leaf, tensor, scheme)
            continue
        if role == "drop":
            continue
        parts = pending.setdefault(prefix, {})
        parts[leaf] = tensor
        if _required(scheme) <= parts.keys():
            del pending[prefix]
            try:
                quantized = _CONVERTERS[scheme.method, scheme.fmt](parts, scheme)
            except (ValueError, RuntimeError) as err:
                raise QuantizedCheckpointError(f"{prefix} ({scheme.source}): {err}") from None
            converted += 1
            yield f"{prefix}.weight", quantized
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = sorted(_required(scheme) - parts.keys())
        more = f"; {len(pending) - 1} more modules incomplete" if len(pending) > 1 else ""
        if missing[0] == "weight" and prefix in dense_weights:  # there, in the wrong dtype
            raise QuantizedCheckpointError(
                f"{scheme.source} checkpoint: '{prefix}.weight' is "
                f"{str(dense_weights[prefix]).removeprefix('torch.')}, not the format's "
                f"quantized dtype, but the module has {', '.join(sorted(parts))}{more}")
        raise QuantizedCheckpointError(
            f"{scheme.source} checkpoint: tensor '{prefix}.{missing[0]}' is missing (the "
            f"module has {', '.join(sorted(parts))}){more}")
    if not converted:  # vLLM refuses such a checkpoint too: its config contradicts it
        raise QuantizedCheckpointError(
            f"{scheme.source} checkpoint holds no quantized module: every weight is dense. "
            "Remove its quantization_config (or its quantize_config.json / "
            "quant_config.json) to load it as a dense checkpoint")


def _required(scheme: QuantScheme) -> frozenset[str]:
    if scheme.method in ("awq", "gptq"):
        return frozenset({"qweight", "qzeros", "scales"}
                         | ({"g_idx"} if scheme.act_order else set()))
    if scheme.method == "fp8":
        return frozenset({"weight", "weight_scale_inv" if scheme.weight_block
                          else "weight_scale"})
    names = {"weight_packed", "weight_shape"} if scheme.fmt == "pack-quantized" else {"weight"}
    if not scheme.sym:
        names.add("weight_zero_point")
    if scheme.act_order:
        names.add("weight_g_idx")
    return frozenset(names | {"weight_scale"})


def _role(leaf: str, tensor: torch.Tensor, scheme: QuantScheme) -> str:
    """"part" of a quantized module, "pass" through, "drop", or "check" (redundant: must
    carry no information, e.g. a trivial g_idx)."""
    if leaf in _DROPPED:
        return "drop"
    if leaf == "weight":
        quantized = (scheme.is_float and tensor.dtype == torch.float8_e4m3fn) or (
            scheme.fmt == "int-quantized" and tensor.dtype == torch.int8)
        return "part" if quantized else "pass"
    if leaf in _required(scheme):
        return "part"
    if leaf in ("g_idx", "weight_g_idx") or (leaf == "weight_zero_point" and scheme.sym):
        return "check"
    return "pass"


def _check_redundant(name: str, leaf: str, tensor: torch.Tensor, scheme: QuantScheme) -> None:
    if leaf == "weight_zero_point":  # a symmetric checkpoint's zero points: all zero
        packed = tensor.dtype == torch.int32  # packed along N, offset by half the range
        zp = _unpack_t(tensor.T, scheme.bits).to(torch.int32) - (1 << (scheme.bits - 1)) \
            if packed else tensor
        if torch.any(zp != 0):
            raise QuantizedCheckpointError(f"'{name}' holds non-zero zero points but the "
                                           "config says symmetric")
        return
    k = tensor.numel()
    groups = tensor.to(torch.int64)
    if torch.equal(groups, _trivial_groups(k, scheme.group_size)):
        return
    if bool(torch.all(groups[1:] >= groups[:-1])):  # in order: groups of another size
        sizes = torch.bincount(groups)
        raise QuantizedCheckpointError(
            f"'{name}' groups the input columns by {int(sizes.max())} but quantization_config "
            f"says group_size {scheme.group_size}")
    raise QuantizedCheckpointError(
        f"'{name}' reorders the input columns (act order) but quantization_config "
        "does not say so (desc_act / actorder)")


def _trivial_groups(k: int, group: int) -> torch.Tensor:
    return torch.arange(k) // (k if group <= 0 else group)


# ---- the converters ----------------------------------------------------------------------

def _check_words(words: torch.Tensor) -> None:
    """Packed codes come in int32 words (AWQ, GPTQ, compressed-tensors all write them so);
    any other dtype's bytes would be read as codes, silently wrong."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed codes are {words.dtype}, not int32 words: the tensor was "
                         "not written by a packer of this format")


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [R, W] -> uint8 codes [R, W * 32 / bits]; code i of a word sits at its
    bits [i * bits, (i + 1) * bits). Reads the words' bytes (little-endian), so a 7B model's
    codes unpack in seconds rather than minutes."""
    _check_words(words)
    # [R, 4 W]: byte j holds codes 2j and 2j + 1 (flatten: a size-1 dim may keep any stride)
    b = words.contiguous().flatten().view(torch.uint8).view(words.shape[0], -1)
    if bits == 8:
        return b
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(words.shape[0], -1)


def _unpack_t(words: torch.Tensor, bits: int, positions: Sequence[int] | None = None
              ) -> torch.Tensor:
    """int32 words [R, W] packed along W -> uint8 codes transposed, [W * 32 / bits, R]: row
    ``j * pack + c`` holds, for each r, the code at position ``positions[c]`` of word
    ``[r, j]`` (AWQ's interleaved order; sequential by default)."""
    _check_words(words)
    pack = 32 // bits
    positions = positions or range(pack)
    b = words.T.contiguous().flatten().view(torch.uint8).view(words.shape[1], -1, 4)
    if bits == 8:
        rows = [b[:, :, p] for p in positions]
    else:
        rows = [(b[:, :, p // 2] >> 4 * (p % 2)) & 0xF for p in positions]
    return torch.stack(rows, dim=1).reshape(-1, words.shape[0])


AWQ_POSITIONS = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of 8 at nibble AWQ_POSITIONS[c]


def _convert_awq(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantTensor:
    codes = _unpack_t(parts["qweight"], 4, AWQ_POSITIONS)  # [K, N / 8] -> [N, K]
    zeros = _unpack_t(parts["qzeros"], 4, AWQ_POSITIONS)  # [groups, N / 8] -> [N, groups]
    return _int_tensor(codes, parts["scales"].T, zeros, None, scheme)


def _convert_gptq(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantTensor:
    qweight = parts["qweight"]  # [K / pack, N], packed along K
    codes = _unpack(qweight.T, scheme.bits)  # [N, K]
    zeros = _unpack_t(parts["qzeros"], scheme.bits)[: qweight.shape[1]]  # [N, groups]
    zeros = zeros.to(torch.int32) + scheme.zero_offset
    return _int_tensor(codes, parts["scales"].T, zeros, parts.get("g_idx"), scheme)


def _convert_ct_int(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantTensor:
    half = 1 << (scheme.bits - 1)
    if scheme.fmt == "pack-quantized":
        n, k = (int(v) for v in parts["weight_shape"])
        codes = _unpack(parts["weight_packed"], scheme.bits)  # unsigned: q + half
        if codes.shape[0] != n or not k <= codes.shape[1] < k + 32 // scheme.bits:
            raise ValueError(f"weight_shape [{n}, {k}] does not match weight_packed "
                             f"{tuple(parts['weight_packed'].shape)} ({codes.shape[1]} "
                             f"codes of {scheme.bits} bits a row)")
        codes = codes[:, :k]
    else:
        codes = parts["weight"].view(torch.uint8) ^ 0x80  # int8 q -> q + 128
        n, k = codes.shape
    scales = _per_row(parts["weight_scale"], n)
    zp = parts.get("weight_zero_point")
    if zp is None:
        zeros = torch.full(scales.shape, half, dtype=torch.int32)
    elif zp.dtype == torch.int32 and zp.numel() > 1:  # packed along N, offset by half
        zeros = _unpack_t(zp.T, scheme.bits)[:n].to(torch.int32)
    else:
        zeros = _per_row(zp, n).to(torch.int32) + half
    return _int_tensor(codes, scales, zeros, parts.get("weight_g_idx"), scheme)


def _per_row(t: torch.Tensor, n: int) -> torch.Tensor:
    """A scale (or zero point) tensor as [n, groups]: one per tensor broadcast to rows."""
    return t.reshape(1, 1).expand(n, 1) if t.numel() == 1 else t.reshape(n, -1)


def _int_tensor(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                g_idx: torch.Tensor | None, scheme: QuantScheme) -> QuantTensor:
    """``w[n, k] = scales[n, g(k)] * (codes[n, k] - zeros[n, g(k)])`` with g from g_idx
    (or k // group) as a QuantTensor (see the module doc)."""
    n, k = codes.shape
    if scales.shape[0] != n or zeros.shape != scales.shape:
        raise ValueError(f"scales {tuple(scales.shape)} and zero points "
                         f"{tuple(zeros.shape)} for a [{n}, {k}] weight")
    col_group, perm = _trivial_groups(k, scheme.group_size), None
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), col_group):
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        codes, col_group = codes[:, perm], g_idx.to(torch.int64)[perm]
    groups = 1 if scheme.group_size <= 0 else -(-k // scheme.group_size)
    if scales.shape[1] != groups:
        raise ValueError(f"{scales.shape[1]} groups of scales for {k} columns in groups of "
                         f"{scheme.group_size if scheme.group_size > 0 else k}")
    if int(col_group[0]) < 0 or int(col_group[-1]) >= groups:
        raise ValueError(f"g_idx names groups {int(col_group[0])}..{int(col_group[-1])} "
                         f"but the scales have {groups}")
    group, chunk_group = _group_layout(col_group, k, scheme.group_size)
    s = scales.to(torch.float32)[:, chunk_group]
    z = zeros[:, chunk_group].to(torch.float32)
    if k % BLOCK:
        codes = torch.nn.functional.pad(codes, (0, round_up(k, BLOCK) - k))
    if scheme.bits == 4:
        seg = QuantSegment(QuantKind.U4, group, pack_u4(codes), s, -(s * z))
    else:  # unsigned q -> signed q - 128: flip the top bit
        mins = None if torch.all(z == 128) else s * (128 - z)
        seg = QuantSegment(QuantKind.S8, group, (codes ^ 0x80).view(torch.int8), s, mins)
    return QuantTensor((n, k), (seg,), scheme.source, perm)


def _group_layout(col_group: torch.Tensor, k: int, group: int) -> tuple[int, torch.Tensor]:
    """kvray's group size for columns grouped by ``col_group`` (sorted; each group
    contiguous, of ``group`` columns but the last) and each kvray group's source group."""
    k_padded = round_up(k, BLOCK)
    one_group = group <= 0 or group >= k
    size = k_padded if one_group else math.gcd(group, k_padded)
    pad = col_group[-1:].expand(k_padded - k)
    chunks = torch.cat([col_group, pad]).view(-1, size)
    if not torch.all(chunks == chunks[:, :1]):
        raise ValueError(f"g_idx groups are not {group} columns each")
    return size, chunks[:, 0]


def _convert_fp8(parts: dict[str, torch.Tensor], scheme: QuantScheme) -> QuantTensor:
    weight = parts["weight"]
    scale = parts.get("weight_scale_inv", parts.get("weight_scale")).to(torch.float32)
    n, k = weight.shape
    k_padded = round_up(k, BLOCK)
    if scale.numel() == 1 or scale.shape in ((n,), (n, 1)):  # per tensor, per channel
        group, scales = k_padded, scale.reshape(-1, 1).expand(n, 1)
    else:
        bn, bk = scheme.weight_block or (0, 0)
        if not bn or scale.shape != (-(-n // bn), -(-k // bk)):
            raise ValueError(f"weight scales of shape {tuple(scale.shape)} for a [{n}, {k}] "
                             f"weight with blocks {scheme.weight_block}")
        group = k_padded if scale.shape[1] == 1 else math.gcd(bk, k_padded)
        cols = torch.arange(0, k_padded, group) // bk
        scales = scale.repeat_interleave(bn, dim=0)[:n][:, cols]
    codes = torch.nn.functional.pad(weight.view(torch.uint8), (0, k_padded - k))
    seg = QuantSegment(QuantKind.F8, group, codes, scales.contiguous())
    return QuantTensor((n, k), (seg,), scheme.source)


_CONVERTERS = {
    ("awq", ""): _convert_awq,
    ("gptq", ""): _convert_gptq,
    ("fp8", ""): _convert_fp8,
    ("compressed-tensors", "float-quantized"): _convert_fp8,
    ("compressed-tensors", "int-quantized"): _convert_ct_int,
    ("compressed-tensors", "pack-quantized"): _convert_ct_int,
}
