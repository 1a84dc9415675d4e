"""Build a model and fill it from a Hugging Face directory or a GGUF file.

Loading is local only: nothing is fetched from a model hub. Every checkpoint tensor
must land in a parameter and every parameter must be filled; otherwise the error
names the tensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvray.hardware import machine_dtype
from kvray.models.expert_placement import plan_placement
from kvray.models.expert_stats import expert_report
from kvray.models.layers import kv_heads_per_rank, split_evenly
from kvray.models.llama import STACKED_PARAMS, LlamaForCausalLM
from kvray.models.moe import MoEExperts, check_expert_split
from kvray.models.quantized import (
    CHECKPOINT_METHODS,
    QUANTIZATION_METHODS,
    assemble_quantized,
    quantize_online,
)
from kvray.models.spec import ModelSpec
from kvray.parallel import ParallelContext, pp_layer_range
from kvray.quant.tensor import QuantTensor
from kvray.tokenizer import check_model_path, load_tokenizer, transformers_errors

logger = logging.getLogger("kvray")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# One expert's tensor (Mixtral's w1/w3/w2 under block_sparse_moe or mlp, the Qwen MoEs'
# gate/up/down_proj), or transformers v5's fused stacks of every expert.
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                        r"(?:(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight"
                        r"|(gate_up_proj|down_proj))$")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up",
                "w2": "down", "down_proj": "down"}
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(ValueError):
    """Checkpoint tensors and model parameters do not match; the message names them."""


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device | str = "cpu",
                  log: bool = True) -> torch.dtype:
    """The dtype to run ``spec``'s model in on ``device``; ``auto`` is decided by
    :func:`kvray.hardware.choose_dtype` (fast on this CPU/GPU). With ``log``, one INFO line
    says what was chosen and why."""
    chosen, reason = machine_dtype(name, torch.device(device).type, spec.torch_dtype)
    if log:
        arrow = f"auto -> {chosen}" if name == "auto" else chosen
        logger.info("kvray: dtype %s (%s)", arrow, reason)
    return DTYPES[chosen]


def checkpoint_dtype(model_path: str | Path) -> str | None:
    """The dtype the checkpoint at ``model_path`` declares (None when it names none)."""
    return ModelSpec.from_hf_config(open_checkpoint(model_path).hf_config).torch_dtype


def load_hf_config(model_path: str | Path) -> Any:
    """Read ``config.json`` of a local Hugging Face model directory."""
    from transformers import AutoConfig

    path = check_model_path(model_path)
    with transformers_errors(path):
        return AutoConfig.from_pretrained(str(path), local_files_only=True)


def _shards(model_dir: Path, index_name: str, pattern: str) -> list[Path]:
    """A checkpoint's shard files: those its index names, else every ``pattern`` file."""
    index = model_dir / index_name
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise WeightLoadError(f"{index}: not a shard index ({err})") from None
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise WeightLoadError(f"{index} names shards that are missing: {missing[:3]}")
        return [model_dir / f for f in files]
    return sorted(model_dir.glob(pattern))


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every ``*.safetensors`` shard, via the index when present;
    a checkpoint without any (older ones saved by ``torch.save``) from its ``*.bin``
    shards, read with ``weights_only`` so a file cannot run code, as vLLM falls back."""
    model_dir = Path(model_dir)
    paths = _shards(model_dir, "model.safetensors.index.json", "*.safetensors")
    if not paths:
        yield from _iter_torch_bins(model_dir)
        return
    for path in paths:
        try:
            f = safe_open(str(path), framework="pt")
        except Exception as err:  # SafetensorError: a truncated or foreign file
            raise WeightLoadError(f"{path}: not a readable safetensors file "
                                  f"({str(err)[:200]})") from None
        with f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
        return torch.load(str(path), map_location="cpu", weights_only=True)


def _iter_torch_bins(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    paths = [p for p in _shards(model_dir, "pytorch_model.bin.index.json", "*.bin")
             if p.name != "training_args.bin"]
    if not paths:
        raise WeightLoadError(f"no *.safetensors or pytorch_model*.bin files in {model_dir}")
    for path in paths:
        try:
            state = _torch_load(path)
        except Exception as err:  # not a state dict, or one pickling more than tensors
            raise WeightLoadError(f"{path}: cannot read it as a PyTorch state dict "
                                  f"({str(err)[:200]})") from None
        if not isinstance(state, dict):
            raise WeightLoadError(f"{path}: holds a {type(state).__name__}, not a state dict")
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                yield name, tensor


def default_weight_loader(param: torch.nn.Parameter, loaded: torch.Tensor,
                          shard_id: Any = None) -> None:
    """Copy a replicated (unsharded) tensor, e.g. a norm weight."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint has shape {tuple(loaded.shape)}, "
                         f"model expects {tuple(param.shape)}")
    param.data.copy_(loaded)


def build_model(spec: ModelSpec, ctx: ParallelContext, dtype: torch.dtype,
                max_positions: int, device: torch.device | str = "cpu") -> LlamaForCausalLM:
    with torch.device(device):
        return LlamaForCausalLM(spec, ctx, dtype, max_positions).eval()


def load_weights(model: LlamaForCausalLM,
                 weights: Iterator[tuple[str, torch.Tensor | QuantTensor]]) -> None:
    """Copy each checkpoint tensor's shard into its parameter (a quantized tensor's shard is
    kept quantized: :mod:`kvray.models.quantized`); raise WeightLoadError naming
    unexpected, missing or mis-shaped tensors."""
    params = dict(model.named_parameters(remove_duplicate=False))
    start, end = model.model.start_layer, model.model.end_layer
    filled: set[str] = set()
    unexpected: list[str] = []
    base_only = model.spec.head == "embed"  # a *Model checkpoint may omit the "model."
    tied_head_skipped = False
    for name, tensor in _unfused(weights, model.spec):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if base_only and not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        m = _LAYER_RE.match(name)
        if m and not start <= int(m.group(1)) < end:
            continue  # another pipeline stage's layer
        target, shard_id = _target_param(name)
        if target == "lm_head.weight" and model.spec.tie_word_embeddings:
            # tied: the embeddings are the head (vLLM's rule); loading this one too would
            # overwrite them, the last tensor read winning
            if not tied_head_skipped:
                logger.info("%s: tie_word_embeddings is set; the checkpoint's %s is not "
                            "used (the embeddings are the LM head)", model.spec.architecture,
                            name)
                tied_head_skipped = True
            continue
        if target not in params:
            if _belongs_to_other_stage(target, model) or _adds_nothing(name, tensor,
                                                                       model.spec):
                continue
            unexpected.append(name)
            continue
        param = params[target]
        try:
            loader = getattr(param, "weight_loader", default_weight_loader)
            if isinstance(tensor, QuantTensor):
                if loader is default_weight_loader:  # a norm: nothing reads it quantized
                    tensor = tensor.dequantize()
                loader(param, tensor if isinstance(tensor, QuantTensor)
                       else tensor.to(param.dtype), shard_id)
            else:
                loader(param, tensor.to(param.dtype), shard_id)
        except (ValueError, RuntimeError) as err:  # RuntimeError: slice out of range
            raise WeightLoadError(
                f"tensor '{name}' of shape {tuple(tensor.shape)} does not fit parameter "
                f"'{target}' of shape {tuple(param.shape)}: {err}") from None
        filled.update(_filled_keys(target, shard_id, model.spec.num_experts))
    _check_complete(model, params, filled, unexpected)
    try:
        assemble_quantized(model)
    except ValueError as err:
        raise WeightLoadError(f"{model.spec.architecture}: {err}") from None


def _unfused(weights: Iterator[tuple[str, torch.Tensor | QuantTensor]], spec: ModelSpec
             ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """Phi-3's fused ``qkv_proj`` (q, k, v rows) and ``gate_up_proj`` (gate, up rows) as the
    separate tensors the parallel layers load: each is split along its own TP shards."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    for name, tensor in weights:
        if name.endswith(".self_attn.qkv_proj.weight") and tensor.shape[0] == q + 2 * kv:
            stem = name.removesuffix("qkv_proj.weight")
            for part, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                yield f"{stem}{part}_proj.weight", tensor.narrow(0, start, size)
        elif name.endswith(".mlp.gate_up_proj.weight") and ".experts." not in name \
                and tensor.shape[0] % 2 == 0:
            stem, half = name.removesuffix("gate_up_proj.weight"), tensor.shape[0] // 2
            yield f"{stem}gate_proj.weight", tensor.narrow(0, 0, half)
            yield f"{stem}up_proj.weight", tensor.narrow(0, half, half)
        else:
            yield name, tensor


def _target_param(name: str) -> tuple[str, Any]:
    m = _EXPERT_RE.match(name)
    if m:
        prefix, expert, part, stacked = m.groups()
        if stacked:  # [experts, 2 * inter, hidden] gate rows then up rows, or down's
            param = "w13_weight" if stacked == "gate_up_proj" else "w2_weight"
            return f"{prefix}.mlp.experts.{param}", "all." + stacked.removesuffix("_proj")
        part = _EXPERT_PART[part]
        param = "w2_weight" if part == "down" else "w13_weight"
        return f"{prefix}.mlp.experts.{param}", f"{expert}.{part}"
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
    for ckpt, (fused, shard_id) in STACKED_PARAMS.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{fused}."), shard_id
    return name, None


def _filled_keys(target: str, shard_id: Any, num_experts: int) -> list[str]:
    if shard_id is None:
        return [target]
    if isinstance(shard_id, str) and shard_id.startswith("all."):  # every expert at once
        return _expert_keys(target, num_experts)
    return [f"{target}#{shard_id}"]


def _expert_keys(param: str, num_experts: int) -> list[str]:
    """The completeness keys of a stacked expert parameter: one per expert and part."""
    parts = ("down",) if param.endswith("w2_weight") else ("gate", "up")
    return [f"{param}#{e}.{p}" for e in range(num_experts) for p in parts]


def _belongs_to_other_stage(name: str, model: LlamaForCausalLM) -> bool:
    return (name.startswith("model.embed_tokens.") and model.model.embed_tokens is None) or (
        (name.startswith("model.norm.") or name.startswith("lm_head.")) and model.lm_head is None
    ) or (name.startswith("score.") and model.score is None and model.spec.head == "classify")


def _expected_keys(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter]) -> set[str]:
    expected = set()
    for name in params:
        if name == "lm_head.weight" and model.spec.tie_word_embeddings:
            continue
        if name.endswith((".experts.w13_weight", ".experts.w2_weight")):
            expected.update(_expert_keys(name, model.spec.num_experts))
            continue
        fused = [(f, s) for f, s in STACKED_PARAMS.values() if f".{f}." in name]
        expected.update(f"{name}#{s}" for _, s in fused) if fused else expected.add(name)
    return expected


# activation / KV-cache scales of a quantized checkpoint: kvray computes its own per token
_SCALE_LEAVES = (".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point",
                 ".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale")


def _adds_nothing(name: str, tensor: torch.Tensor | QuantTensor, spec: ModelSpec) -> bool:
    """A tensor with no parameter to go to that the model does not need: activation / KV
    scales (a KV-cache-only compressed-tensors checkpoint's), a zero bias on a linear
    without one (AutoGPTQ writes one for every quantized linear; vLLM skips them too), or
    a Qwen2-MoE shared expert 0 wide (transformers saves its empty matrices and its gate)."""
    if name.endswith(_SCALE_LEAVES):
        return True
    if name.endswith(".bias") and isinstance(tensor, torch.Tensor) and not torch.any(tensor):
        return True
    return (".mlp.shared_expert" in name and spec.num_experts > 0
            and not spec.shared_expert_intermediate_size)


def _check_complete(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter],
                    filled: set[str], unexpected: list[str]) -> None:
    problems = []
    if unexpected:
        problems.append(f"unexpected tensors in checkpoint: {', '.join(unexpected[:10])}"
                        + (f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else ""))
    missing = sorted(_expected_keys(model, params) - filled)
    if missing:
        names = [_checkpoint_name(m) for m in missing]
        problems.append(f"tensors missing from checkpoint: {', '.join(names[:10])}"
                        + (f" (+{len(names) - 10} more)" if len(names) > 10 else ""))
    if problems:
        raise WeightLoadError(f"{model.spec.architecture}: " + "; ".join(problems))


def _checkpoint_name(key: str) -> str:
    if "#" not in key:
        return key
    name, shard = key.split("#")
    if ".experts.w" in name:  # "<layer>.mlp.experts.w13_weight#3.gate"
        expert, part = shard.split(".")
        return f"{name.rsplit('.', 1)[0]}.{expert}.{part}_proj.weight"
    for ckpt, (fused, shard_id) in STACKED_PARAMS.items():
        if f".{fused}." in name and str(shard_id) == shard:
            return name.replace(f".{fused}.", f".{ckpt}.")
    return key


class HFCheckpoint:
    """A local Hugging Face model directory opened for loading. A pre-quantized checkpoint
    (``quantization_config``: AWQ, GPTQ, FP8) yields its quantized weights as
    :class:`QuantTensor` (dense with ``keep_quantized=False``)."""

    def __init__(self, path: str | Path) -> None:
        from kvray.quant.hf_formats import checkpoint_quantization

        self.path = Path(path)
        self.hf_config = load_hf_config(self.path)
        self.scheme = checkpoint_quantization(self.hf_config, self.path)

    def iter_weights(self, keep_quantized: bool = True
                     ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        if self.scheme is None:
            return iter_safetensors(self.path)
        from kvray.quant.hf_formats import convert_prequantized

        weights = convert_prequantized(iter_safetensors(self.path), self.scheme)
        return weights if keep_quantized else _dequantized(weights)

    def load_tokenizer(self) -> Any:
        return load_tokenizer(self.path)


def _dequantized(weights: Iterator[tuple[str, torch.Tensor | QuantTensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        yield name, t.dequantize() if isinstance(t, QuantTensor) else t


def open_checkpoint(path: str | Path) -> Any:
    """Open a Hugging Face directory or a ``.gguf`` file (both expose ``hf_config``,
    ``iter_weights()`` and ``load_tokenizer()``)."""
    from kvray.models.gguf_loader import GGUFCheckpoint

    path = check_model_path(path)
    return GGUFCheckpoint(path) if path.suffix == ".gguf" else HFCheckpoint(path)


def resolve_quantization(requested: str | None, ckpt: Any, device: torch.device | str
                         ) -> str | None:
    """What loading does for ``quantization = requested`` on ``ckpt``: None (the weights as
    stored), ``"none"``, ``"int8"`` or ``"fp8"`` (quantize online). vLLM's names for a
    stored format (``awq``, ``gptq``, ``gguf``, ``compressed-tensors``, their ``_marlin``
    kernels; ``fp8`` on an FP8 checkpoint) mean "as stored" and must match the checkpoint:
    a ValueError naming both otherwise, as vLLM does."""
    stored = _stored_format(ckpt)
    if requested == "fp8" and stored in ("fp8", "compressed-tensors fp8"):
        return None
    if requested in CHECKPOINT_METHODS:
        if stored is None or not stored.startswith(requested.removesuffix("_marlin")):
            raise ValueError(f"quantization = {requested!r}, but the checkpoint at "
                             f"{ckpt.path} is {stored or 'not quantized'}; leave quantization "
                             "null to load it as it is stored")
        return None
    if requested not in (None, *QUANTIZATION_METHODS):
        raise ValueError(f"quantization = {requested!r}: use one of "
                         f"{', '.join(QUANTIZATION_METHODS + CHECKPOINT_METHODS)} or null "
                         "(as the checkpoint is)")
    if requested == "fp8" and torch.device(device).type != "cuda":
        raise ValueError("quantization = 'fp8' runs on CUDA GPUs (FP8 weights and GEMMs); "
                         "on CPU use 'int8'")
    return requested


def _stored_format(ckpt: Any) -> str | None:
    """The format of a checkpoint's weights by vLLM's quantization names: gguf, awq, gptq,
    fp8, compressed-tensors (``compressed-tensors fp8`` for its float format); None: dense."""
    if not isinstance(ckpt, HFCheckpoint):
        return "gguf"
    scheme = ckpt.scheme
    if scheme is None:
        return None
    if scheme.method == "compressed-tensors" and scheme.is_float:
        return "compressed-tensors fp8"
    return scheme.method


def resolve_max_model_len(requested: int | None, spec: ModelSpec) -> int:
    """The configured context length, bounded by what the model was trained for (with its
    rope scaling: :func:`kvray.kernels.rotary.max_context`)."""
    from kvray.kernels.rotary import max_context

    limit = max_context(spec.max_position_embeddings, spec.rope_scaling)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"max_model_len = {requested} exceeds the model's context of {limit} "
                         f"(max_position_embeddings {spec.max_position_embeddings} and its "
                         f"rope scaling); use a value <= {limit}")
    return requested


def check_parallel_layout(model_path: str | Path, tp: int, pp: int,
                          expert_parallel: bool = False) -> None:
    """ValueError naming the setting when ``tp`` x ``pp`` cannot split the model at
    ``model_path`` (the splits each worker makes of its shard), read from its config alone:
    found before a cluster reserves and starts tp x pp workers for nothing."""
    spec = ModelSpec.from_hf_config(open_checkpoint(model_path).hf_config)
    pp_layer_range(spec.num_layers, 0, pp)
    if tp == 1:
        return
    kv_heads_per_rank(spec.num_kv_heads, tp)
    split_evenly(spec.num_heads, tp, "num_attention_heads")
    if any(not spec.is_moe_layer(i) for i in range(spec.num_layers)):
        split_evenly(spec.intermediate_size, tp, "intermediate_size")
    split_evenly(spec.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size")
    if spec.num_experts:
        check_expert_split(spec.num_experts, spec.moe_intermediate_size, tp, expert_parallel)


def load_model(model_path: str | Path, dtype: str, ctx: ParallelContext | None = None,
               max_model_len: int | None = None, device: torch.device | str = "cpu",
               quantization: str | None = None,
               expert_loads: Mapping[int, Sequence[int]] | None = None
               ) -> tuple[LlamaForCausalLM, ModelSpec]:
    """Build this rank's shard of the model at ``model_path`` and load its weights.

    ``dtype`` is resolved here, once (logged by the replica's first rank only); read the
    result back from the model's parameters rather than resolving it again.
    ``quantization``: None keeps a quantized checkpoint's weights as they are stored (a
    GGUF's blocks, AWQ/GPTQ/FP8) and a dense one dense; ``"none"`` dequantizes them to
    ``dtype``; ``"int8"`` / ``"fp8"`` quantize a dense checkpoint's linears after loading.
    ``expert_loads``: each MoE layer's tokens per expert (``expert_placement``); under
    expert parallelism the experts go to the ranks balanced by them (ConfigError naming
    the setting when they do not fit the model)."""
    ckpt = open_checkpoint(model_path)
    quantization = resolve_quantization(quantization, ckpt, device)
    spec = ModelSpec.from_hf_config(ckpt.hf_config)
    max_len = resolve_max_model_len(max_model_len, spec)
    ctx = ctx or ParallelContext()
    if expert_loads is not None:
        moe_layers = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
        ctx = dataclasses.replace(ctx, expert_placement=plan_placement(
            expert_loads, moe_layers, spec.num_experts, ctx.tp_size))
    torch_dtype = resolve_dtype(dtype, spec, device, log=ctx.world_rank == 0)
    model = build_model(spec, ctx, torch_dtype, max_len, device)
    load_weights(model, ckpt.iter_weights(keep_quantized=quantization != "none"))
    if quantization in ("int8", "fp8") and not quantize_online(
            model, quantization, torch.device(device)) and ctx.world_rank == 0:
        logger.warning("quantization = %r: every linear of %s is already quantized as "
                       "stored (%s); it runs as it is", quantization, model_path,
                       _stored_format(ckpt))
    if spec.num_experts:
        _log_experts(model, spec, ctx)
    return model, spec


def _log_experts(model: LlamaForCausalLM, spec: ModelSpec, ctx: ParallelContext) -> None:
    """One line per rank: which experts it holds and their memory (the placement; every
    layer's is in the worker's start-up report)."""
    report = expert_report(model, None)
    if report is None:
        return
    layers = [m for m in model.modules() if isinstance(m, MoEExperts)]
    first = layers[0]
    if not report["expert_parallel"]:
        what = (f"all {spec.num_experts} experts, intermediate rows "
                f"{first.inter_start}..{first.inter_start + first.inter - 1} of "
                f"{first.full_inter}")
    elif ctx.expert_placement is None:
        what = f"experts {first.held[0]}..{first.held[-1]} whole (contiguous)"
    else:
        what = (f"{first.num_local} whole experts per layer placed by measured load "
                f"(layer {first.layer_idx}: {first.held})")
    logger.info("kvray: MoE rank %d (tp %d/%d, pp %d): %s, top-%d, %d MoE layers here, "
                "%.1f MiB of expert weights", ctx.world_rank, ctx.tp_rank, ctx.tp_size,
                ctx.pp_rank, what, spec.num_experts_per_tok, len(layers),
                report["expert_bytes"] / 2**20)
