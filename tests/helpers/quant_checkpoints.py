"""Tiny pre-quantized Hugging Face checkpoints written the way AutoAWQ, AutoGPTQ and
llm-compressor write theirs, from random fp32 weights, with numpy only (no kvray code).

Each ``quantize_*`` returns the checkpoint tensors of one linear (names without the module
prefix) and the weight they stand for, dequantized in fp32 from the integer codes.
:func:`write_quantized_checkpoint` turns a tiny model directory into a quantized checkpoint
plus its dequantized fp32 twin.

Bit orders, as the formats define them:
- AWQ (GEMM): ``qweight`` int32 [K, N / 8], word j of row k holds output columns
  8j + [0, 2, 4, 6, 1, 3, 5, 7] at bits 0, 4, ..., 28; ``qzeros`` [K / G, N / 8] the same;
  ``scales`` fp16 [K / G, N]; ``w = s * (q - z)``.
- GPTQ: ``qweight`` int32 [K * bits / 32, N] packed along K (word r of column n holds rows
  r * pack + i at bits i * bits); ``qzeros`` [groups, N * bits / 32] packed along N, storing
  ``zero - 1`` (checkpoint_format "gptq", masked to the bit width) or ``zero`` ("gptq_v2");
  ``scales`` fp16 [groups, N]; ``g_idx`` int32 [K], each input column's group.
- compressed-tensors pack-quantized: ``weight_packed`` int32 [N, K * bits / 32] packed
  along K with codes offset by 2**(bits - 1); ``weight_zero_point`` (asymmetric) packed
  along N the same way; ``weight_scale`` [N, groups]; ``weight_shape`` [2].
- FP8: ``weight`` float8_e4m3fn with ``weight_scale`` (per tensor or per row) or
  ``weight_scale_inv`` (HF FineGrainedFP8, one per [128, 128] block).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _pack_words(values: np.ndarray, bits: int, order: tuple[int, ...] | None = None
                ) -> np.ndarray:
    """Pack unsigned ints along the last axis: word j holds values j * pack + order[i] at
    bits i * bits."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    v = values.astype(np.uint32)
    words = np.zeros((*v.shape[:-1], v.shape[-1] // pack), np.uint32)
    for i, src in enumerate(order):
        words |= v[..., src::pack] << np.uint32(bits * i)
    return words.view(np.int32)


def _groups(k: int, group: int) -> int:
    return 1 if group == -1 else math.ceil(k / group)


def quantize_awq(w: np.ndarray, group: int) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """AutoAWQ's asymmetric 4-bit quantization (zero points 0..15, fp16 scales)."""
    n, k = w.shape
    g = k if group == -1 else group
    wg = w.reshape(n, k // g, g)
    mx, mn = wg.max(-1), wg.min(-1)
    scales = (np.clip(mx - mn, 1e-5, None) / 15).astype(np.float16)
    s = scales.astype(np.float32)
    zeros = np.clip(-np.round(mn / s), 0, 15)
    q = np.clip(np.round(wg / s[..., None]) + zeros[..., None], 0, 15)
    deq = ((q - zeros[..., None]) * s[..., None]).reshape(n, k).astype(np.float32)
    tensors = {"qweight": _t(_pack_words(q.reshape(n, k).T, 4, AWQ_ORDER)),
               "qzeros": _t(_pack_words(zeros.T, 4, AWQ_ORDER)),
               "scales": _t(scales.T)}
    return tensors, deq


def quantize_gptq(w: np.ndarray, bits: int, group: int, sym: bool, desc_act: bool,
                  v2: bool = False, seed: int = 0) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """AutoGPTQ's quantizer (min/max per group, fp16 scales; act order: the columns in a
    random order, as the Hessian's diagonal would give them)."""
    n, k = w.shape
    maxq = 2 ** bits - 1
    g = k if group == -1 else group
    perm = np.random.default_rng(seed).permutation(k) if desc_act else np.arange(k)
    g_idx = np.argsort(perm) // g  # original column -> its group
    ngroups = _groups(k, group)
    scales = np.zeros((n, ngroups), np.float16)
    zeros = np.zeros((n, ngroups), np.float32)
    for gi in range(ngroups):
        x = w[:, perm[gi * g:(gi + 1) * g]]
        xmin, xmax = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
        if sym:
            xmax = np.maximum(-xmin, xmax)
            xmin = np.where(xmin < 0, -xmax, xmin)
        flat = (xmin == 0) & (xmax == 0)
        xmin, xmax = np.where(flat, -1, xmin), np.where(flat, 1, xmax)
        scales[:, gi] = (xmax - xmin) / maxq
        zeros[:, gi] = (maxq + 1) / 2 if sym else np.round(-xmin / scales[:, gi].astype(np.float32))
    s = scales.astype(np.float32)[:, g_idx]
    z = zeros[:, g_idx]
    q = np.clip(np.round(w / s) + z, 0, maxq)
    stored = zeros if v2 else (zeros.astype(np.int64) - 1) & maxq
    read = stored if v2 else stored + 1  # what a v1 reader takes as the zero point
    deq = ((q - read[:, g_idx]) * s).astype(np.float32)
    tensors = {"qweight": _t(_pack_cols(q.T, bits)),
               "qzeros": _t(_pack_words(stored.T, bits)),
               "scales": _t(scales.T), "g_idx": _t(g_idx.astype(np.int32))}
    return tensors, deq


def _pack_cols(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack along the first axis: word row r holds rows r * pack + i at bits i * bits."""
    return _pack_words(values.T, bits).T


def quantize_ct_packed(w: np.ndarray, bits: int, group: int, sym: bool
                       ) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """llm-compressor's int4/int8 weights (signed codes, bf16 scales) as compressed-tensors'
    pack-quantized format writes them."""
    n, k = w.shape
    g = k if group == -1 else group
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    wg = w.reshape(n, k // g, g)
    mx, mn = np.maximum(wg.max(-1), 0), np.minimum(wg.min(-1), 0)
    scales = np.maximum(mx, -mn) / ((qmax - qmin) / 2) if sym else (mx - mn) / (qmax - qmin)
    s_bf16 = torch.from_numpy(scales.astype(np.float32)).to(torch.bfloat16)
    s = s_bf16.to(torch.float32).numpy()
    zp = np.zeros_like(s) if sym else np.clip(np.round(qmin - mn / s), qmin, qmax)
    q = np.clip(np.round(wg / s[..., None]) + zp[..., None], qmin, qmax)
    deq = ((q - zp[..., None]) * s[..., None]).reshape(n, k).astype(np.float32)
    half = 2 ** (bits - 1)
    tensors = {"weight_packed": _t(_pack_words(q.reshape(n, k) + half, bits)),
               "weight_scale": s_bf16, "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if not sym:
        tensors["weight_zero_point"] = _t(_pack_cols(zp + half, bits))
    return tensors, deq


def quantize_fp8(w: np.ndarray, strategy: str, block: tuple[int, int] = (128, 128),
                 scale_name: str = "weight_scale") -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """e4m3 weights with fp32 scales per tensor, per row ("channel") or per block."""
    n, k = w.shape
    if strategy == "tensor":
        scale = np.array([np.abs(w).max() / FP8_MAX], np.float32)
        full = np.full((n, k), scale[0], np.float32)
    elif strategy == "channel":
        scale = (np.abs(w).max(1, keepdims=True) / FP8_MAX).astype(np.float32)
        full = np.repeat(scale, k, axis=1)
    else:
        bn, bk = block
        scale = np.zeros((math.ceil(n / bn), math.ceil(k / bk)), np.float32)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                scale[i, j] = np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max() / FP8_MAX
        full = np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]
    codes = torch.from_numpy((w / full).astype(np.float32)).to(torch.float8_e4m3fn)
    deq = codes.to(torch.float32).numpy() * full
    return {"weight": codes, scale_name: _t(scale)}, deq.astype(np.float32)


# ---- whole checkpoints --------------------------------------------------------------------

def quantization_config(method: str, bits: int = 4, group: int = 128, sym: bool = True,
                        desc_act: bool = False, v2: bool = False, strategy: str = "channel",
                        block: tuple[int, int] = (128, 128)) -> dict:
    """The ``quantization_config`` each tool writes into config.json."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
                "desc_act": desc_act, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    if method == "ct-fp8":
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                   "dynamic": False,
                   "block_structure": list(block) if strategy == "block" else None}
        fmt = "float-quantized"
    else:  # ct-int: pack-quantized
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
                   "strategy": "channel" if group == -1 else "group",
                   "group_size": None if group == -1 else group, "actorder": None}
        fmt = "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}


def quantize_linear(w: np.ndarray, method: str, **kw) -> tuple[dict[str, torch.Tensor],
                                                               np.ndarray]:
    """One linear's checkpoint tensors in ``method`` (see :func:`quantization_config`)."""
    if method == "awq":
        return quantize_awq(w, kw.get("group", 128))
    if method == "gptq":
        return quantize_gptq(w, kw.get("bits", 4), kw.get("group", 128), kw.get("sym", True),
                             kw.get("desc_act", False), kw.get("v2", False), kw.get("seed", 0))
    if method == "fp8":
        return quantize_fp8(w, "block", kw.get("block", (128, 128)), "weight_scale_inv")
    if method == "ct-fp8":
        return quantize_fp8(w, kw.get("strategy", "channel"), kw.get("block", (128, 128)))
    return quantize_ct_packed(w, kw.get("bits", 4), kw.get("group", 128), kw.get("sym", True))


def write_quantized_checkpoint(model_dir: str | Path, out_dir: str | Path, method: str,
                               shards: int = 2, **kw) -> tuple[Path, Path]:
    """Quantize every decoder linear of the tiny model at ``model_dir`` with ``method``
    ("awq", "gptq", "fp8", "ct-fp8", "ct-int"; options as :func:`quantization_config`) and
    write ``out_dir/quantized`` (its tensors spread over ``shards`` files so each module's
    pieces sit in different shards) and ``out_dir/dequantized`` (the same model in fp32,
    every quantized weight replaced by its dequantized value). Returns both directories."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    quant_dir, twin_dir = out_dir / "quantized", out_dir / "dequantized"
    dense = load_file(str(model_dir / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, t in dense.items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS:
            tensors, deq = quantize_linear(t.float().numpy(), method, **kw)
            quant.update({f"{prefix}.{leaf}": v for leaf, v in tensors.items()})
            twin[name] = _t(deq)
        else:
            quant[name] = twin[name] = t
    for d in (quant_dir, twin_dir):
        shutil.copytree(model_dir, d, ignore=shutil.ignore_patterns("*.safetensors",
                                                                     "*.index.json"))
    save_file(twin, str(twin_dir / "model.safetensors"))
    _save_sharded(quant, quant_dir, shards)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, **{
        key: v for key, v in kw.items() if key != "seed"})
    (quant_dir / "config.json").write_text(json.dumps(config, indent=2))
    return quant_dir, twin_dir


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(out / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
