"""PEFT LoRA adapters: read, checked against the base model, in the form the workers load.

An adapter directory holds ``adapter_config.json`` (rank, alpha, target modules, rsLoRA)
and ``adapter_model.safetensors`` (or ``.bin``) with ``...<module>.lora_A.weight`` [r, in]
and ``...lora_B.weight`` [out, r]. PEFT computes ``y = W x + B (A x) * scaling`` with
``scaling = alpha / r`` (``alpha / sqrt(r)`` under rsLoRA); kvray folds the scaling into B
once, here, and keys each pair by where it lands in kvray's fused layers: (layer,
``qkv_proj`` / ``o_proj`` / ``gate_up_proj`` / ``down_proj``, slice of the fused output).

Everything an adapter can get wrong is a :class:`LoRAError` naming the cause, raised before
any worker sees the adapter: the server answers 400 and keeps serving.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvray.lora.request import LoRAError, LoRARequest
from kvray.models.spec import ModelSpec

# HF projection -> (kvray's fused module, slice of its output): the slices of a fused module
# are its projections in order (q, k, v; gate, up).
_TARGETS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_FUSED_TARGETS = ("qkv_proj", "gate_up_proj")  # Phi-3's checkpoint names
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\."
    r"(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter, validated: ``weights[(layer, module)][slice] = (A [r, in], B [out, r])``
    in fp32 on the host, B already scaled. ``rank`` is the largest of its modules'."""

    name: str
    lora_id: int
    path: str
    rank: int
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = \
        field(repr=False)
    target_modules: tuple[str, ...] = ()

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for slices in self.weights.values()
                   for pair in slices.values() for t in pair)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    st, binary = path / "adapter_model.safetensors", path / "adapter_model.bin"
    try:
        if st.exists():
            from safetensors.torch import load_file
            return load_file(str(st))
        if binary.exists():
            return torch.load(str(binary), map_location="cpu", weights_only=True)
    except Exception as err:  # a corrupt or truncated file
        raise LoRAError(f"adapter {path}: cannot read its weights ({err})") from None
    raise LoRAError(f"adapter {path}: no adapter_model.safetensors or adapter_model.bin")


def _read_config(path: Path) -> dict:
    config_path = path / "adapter_config.json"
    if not path.is_dir():
        raise LoRAError(f"adapter path {str(path)!r} is not a directory")
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise LoRAError(f"adapter {path}: no adapter_config.json") from None
    except ValueError as err:
        raise LoRAError(f"adapter {path}: adapter_config.json is not valid JSON ({err})") \
            from None
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {path}: adapter_config.json must hold an object")
    return config


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's ``rank_pattern``/``alpha_pattern``: the value of the first key that matches
    the module's full name as a suffix pattern."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


# PEFT LoraConfig options that change what a trained adapter computes, which kvray does not
# implement: an adapter that sets one is refused rather than served as a plain LoRA.
# (Options that only shape initialisation or training — loftq, eva, corda, lora_ga, velora —
# leave the saved A and B meaning what they always mean.)
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "LoRA biases",
    "layer_replication": "layer replication (the base's layers stacked again)",
    "alora_invocation_tokens": "activated LoRA (applied only after its invocation tokens)",
    "use_qalora": "QA-LoRA (inputs pooled by group)", "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing between adapters", "monteclora_config": "MonteCLoRA",
    "kasa_config": "KaSA",
}


def _check_config(config: dict, path: Path) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"adapter {path}: peft_type {peft_type!r} is not supported (LORA only)")
    for key, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(key):
            raise LoRAError(f"adapter {path}: {what} ({key}: {config[key]!r}) is not "
                            "supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"adapter {path}: modules_to_save {config['modules_to_save']!r} "
                        "(fully trained modules) is not supported")
    if config.get("bias", "none") not in ("none", None):
        raise LoRAError(f"adapter {path}: bias {config['bias']!r} is not supported "
                        "(only 'none')")


def load_adapter(request: LoRARequest, spec: ModelSpec, max_lora_rank: int) -> LoRAAdapter:
    """Read ``request``'s adapter and check it against the base model ``spec``: supported
    options, known target modules, a rank of at most ``max_lora_rank``, every tensor of the
    shape the base layer takes. Raises :class:`LoRAError`."""
    path = Path(request.lora_path).expanduser()
    config = _read_config(path)
    _check_config(config, path)
    tensors = _read_tensors(path)
    alpha_default = float(config.get("lora_alpha", 8))  # PEFT's default when unsaid
    rslora = bool(config.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_embedding" in key or "lora_magnitude" in key:
            raise LoRAError(f"adapter {path}: {key}: embedding LoRA and DoRA are not supported")
        m = _KEY_RE.match(key)
        if m is None:
            raise LoRAError(f"adapter {path}: tensor {key!r} is not a LoRA weight of a "
                            "decoder layer's attention or MLP projection (supported targets: "
                            f"{', '.join(sorted(_TARGETS) + list(_FUSED_TARGETS))})")
        layer, block, proj, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if proj not in _TARGETS and proj not in _FUSED_TARGETS:
            raise LoRAError(f"adapter {path}: target module {proj!r} is not supported "
                            f"(supported: {', '.join(sorted(_TARGETS))})")
        if not 0 <= layer < spec.num_layers:
            raise LoRAError(f"adapter {path}: {key} names layer {layer}, but the base model "
                            f"has {spec.num_layers} layers (an adapter for another base?)")
        if block == "mlp" and spec.is_moe_layer(layer):
            raise LoRAError(f"adapter {path}: {key}: LoRA on mixture-of-experts layers is not "
                            "supported (target the attention projections)")
        pairs.setdefault((layer, proj), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"adapter {path}: holds no LoRA weights")
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    inter, hidden = spec.intermediate_size, spec.hidden_size
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter), "qkv_proj": (q + 2 * kv, hidden),
              "gate_up_proj": (2 * inter, hidden)}
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, proj), ab in sorted(pairs.items()):
        block = "mlp" if proj in _MLP_TARGETS else "self_attn"
        name = f"model.layers.{layer}.{block}.{proj}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {path}: {name} has lora_{'A' if 'A' in ab else 'B'} "
                            f"but no lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"].float(), ab["B"].float()
        out_size, in_size = shapes[proj]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or a.shape[1] != in_size \
                or b.shape[0] != out_size:
            raise LoRAError(
                f"adapter {path}: {name}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit the base layer ({out_size} x {in_size}, so A "
                f"[r, {in_size}] and B [{out_size}, r]): an adapter for another base model")
        if r < 1 or r > max_lora_rank:
            raise LoRAError(f"adapter {path}: rank {r} of {name} exceeds max_lora_rank "
                            f"({max_lora_rank}); raise max_lora_rank to serve it")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"adapter {path}: {name} holds NaN or infinite values")
        alpha = float(_pattern_value(config.get("alpha_pattern"), name, alpha_default))
        scaling = alpha / (math.sqrt(r) if rslora else r)
        b = b * scaling
        rank = max(rank, r)
        if proj in _FUSED_TARGETS:  # Phi-3: one A for all the slices, B split by rows
            sizes = [q, kv, kv] if proj == "qkv_proj" else [inter, inter]
            for i, part in enumerate(b.split(sizes)):
                weights.setdefault((layer, proj), {})[i] = (a, part.contiguous())
        else:
            module, index = _TARGETS[proj]
            weights.setdefault((layer, module), {})[index] = (a.contiguous(), b.contiguous())
    targets = tuple(sorted({proj for _, proj in pairs}))
    return LoRAAdapter(request.lora_name, request.lora_int_id, str(path), rank, weights,
                       targets)
