"""kvray's CPU ops: a small C++ extension built on first use.

- ``paged_decode`` / ``paged_prefill``: paged decode and prefill attention (optionally with
  Gemma 2's soft-capped scores). The PyTorch reference (``attention._decode``)
  must first gather each sequence's blocks into a contiguous tensor, which on CPU costs more
  memory traffic than the attention itself; the kernel reads K/V straight from the paged
  cache, one pass over K for the scores and one over V, parallel over (sequence, kv head).
- ``linear_small_m``: ``x @ w.T`` for the few rows of a decode step, reading each weight row
  once for all rows (MKL re-reads the weights per row at small M).
- ``linear_tiled``: ``x @ w.T`` for many rows (prefill chunks, mixed steps) as tiles that
  the threads take one at a time (a thread whose core another process borrows for a while
  no longer holds up the others at the end of a static split); fp32 tiles run a
  register-blocked kernel (AVX-512 or AVX2; x read in place, each tile packing its panels
  of weight rows), other dtypes a single-threaded sgemm.
- ``pack_linear_weight`` / ``linear_packed``: the tiled fp32 kernel on a weight packed once
  at load time (MKL's sgemm and ``linear_tiled`` repack the weight on every call), each
  panel prefetched from memory while the previous one is in use: past the small-M kernel's
  rows, decode batches and prefill chunks (AVX-512 and AVX2). A bf16 weight packs as bf16
  (half the bytes), widened exactly in registers: the same results as fp32 panels.
- ``rms_norm``, ``rotary_inplace``, ``silu_and_mul``: a decoder layer's elementwise work,
  one call each.
- ``moe_experts``: a MoE layer's routed experts for a few tokens in one call (dense or
  quantized), the linears' own kernels run over every active expert in one parallel pass;
  ``moe_route`` its routing (router linear, softmax, top-k, shared-expert gate) in one call.
- ``decode_layer`` (the extension's, used by :func:`kvray.models.llama.use_fused_decode_layer`):
  a whole decoder layer of a decode batch in one call, the kernels above back to back;
  ``decode_layers`` all of a pipeline stage's layers in one call (``decode_layer_moe`` /
  ``decode_layers_moe`` with MoE layers: ``moe_route`` and ``moe_experts`` inside).

The sources under ``csrc/`` are compiled with the system C++ compiler through
``torch.utils.cpp_extension`` the first time they are needed (cached under
``~/.cache/torch_extensions``); if that fails, kvray falls back to the PyTorch reference
paths and says so once. On a Ray cluster one node compiles each build and the others take
its binary (:mod:`kvray.kernels.build_cache`). Tests check every op against its reference.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from kvray.quant.tensor import gather_input

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("cpu_paged_attention.cpp", "cpu_paged_prefill.cpp", "cpu_linear.cpp",
            "cpu_fused.cpp", "cpu_layer.cpp", "cpu_sampling.cpp", "cpu_quant.cpp",
            "cpu_lora.cpp", "cpu_moe.cpp", "bindings.cpp")
_HEADERS = ("ops.h", "vec.h", "kv_quant.h", "decode_int8.h", "kernel_parts.h",
            "quant_format.h", "quant_tiles.h", "quant_amx.h")
_CFLAGS = ["-O3", "-fopenmp", "-ffast-math"]
# The instruction set the kernels are built for: this CPU's own by default. Tests set
# KVRAY_CPU_MARCH=haswell on AVX-512 machines to run the AVX2 code paths too.
MARCH_ENV = "KVRAY_CPU_MARCH"
# linear_small_m takes 1..32 rows; the engine uses it up to 16 with 8-lane (AVX2) kernels
# and up to 32 with 16-lane (AVX-512) ones: past those MKL catches up with it.
SMALL_M_MAX_ROWS = 16
SMALL_M_MAX_ROWS_AVX512 = 32

_lock = threading.Lock()
_state: dict[str, object] = {}


def load_ops():
    """The compiled extension, or None if it cannot be built here (logged once)."""
    if "ext" in _state:  # every op call asks: no lock once it is built
        return _state["ext"]
    with _lock:
        if "ext" not in _state:
            start = time.perf_counter()
            _state["ext"] = _build()
            _state["seconds"] = time.perf_counter() - start
        return _state["ext"]


def build_report() -> dict[str, object]:
    """How this process got the extension: ``source`` (``compiled`` here, ``cluster``: another
    node's binary, ``cache``: this machine's earlier build, ``unavailable``, or ``unused``)
    and the seconds it took."""
    if "ext" not in _state:
        return {"source": "unused", "seconds": 0.0}
    source = _state.get("source", "unavailable") if _state["ext"] is not None \
        else "unavailable"
    return {"source": source, "seconds": round(float(_state.get("seconds", 0.0)), 3)}


def _build():
    from kvray.kernels import build_cache

    try:
        from torch.utils.cpp_extension import load

        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        binary = build_dir / f"{build_dir.name}.so"
        with _build_dir_lock(build_dir):
            if not binary.exists() and (shared := build_cache.fetch_build(build_dir.name)):
                tmp = binary.with_suffix(".so.part")
                tmp.write_bytes(shared)
                tmp.rename(binary)
                logger.info("kvray: CPU kernels taken from the cluster's build (%s)",
                            build_dir.name)
                _state["source"] = "cluster"
                return _import_binary(build_dir.name, binary)
            _state["source"] = "cache" if binary.exists() else "compiled"
            try:
                ext = load(name=build_dir.name, sources=[str(_CSRC / s) for s in _SOURCES],
                           extra_cflags=[*_CFLAGS, f"-march={_march()}"],
                           extra_include_paths=[str(_CSRC)], extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), verbose=False)
            except Exception:
                build_cache.release_build(build_dir.name)
                raise
            build_cache.publish_build(build_dir.name, binary.read_bytes)
            return ext
    except Exception as err:  # a missing compiler must not stop the engine
        logger.warning("kvray: CPU kernels unavailable (%s); using the PyTorch reference "
                       "paths", err)
        return None


def _import_binary(name: str, path: Path):
    """The extension module in ``path`` (a binary built by another node of the cluster)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_directory() -> Path:
    """Where this build of the extension lives: torch's extension root (``TORCH_EXTENSIONS_DIR``
    or ``~/.cache/torch_extensions/py*_cpu``), one folder per build tag."""
    from torch.utils.cpp_extension import get_default_build_root

    # torch reads TORCH_EXTENSIONS_DIR in its own build-directory helper, not here
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"kvray_cpu_ops_{_build_tag()}"


@contextlib.contextmanager
def _build_dir_lock(build_dir: Path) -> Iterator[None]:
    """Serialise kvray's builds of one extension with an ``flock``, which the kernel drops
    when its holder dies. torch's own lock is a file that exists while a build runs: a build
    killed midway (Ctrl-C, a timeout) leaves it behind and every later start waits on it
    forever. Holding the flock, no live kvray process is building, so a torch lock file
    found then is stale and is removed."""
    with open(build_dir / "kvray.flock", "a") as f:  # closing the file drops the flock
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("kvray: removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def _march() -> str:
    """The -march the extension is built with (``native`` unless KVRAY_CPU_MARCH names
    another, e.g. ``haswell`` for AVX2 only)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+_-]*", march):
        raise ValueError(f"{MARCH_ENV}={march!r} is not a compiler -march value")
    return march


def _build_tag() -> str:
    """Part of the build name: built with -march=native, a binary must not be reused on a CPU
    with other instruction sets, nor after a source changed, nor under another torch or
    Python (the extension cache under ~/.cache/torch_extensions, and the cluster's, are
    keyed by name)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    digest = hashlib.sha1(flags.encode())
    digest.update(_march().encode())
    # a binary is only good for the torch and Python it was built against
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    for name in (*_SOURCES, *_HEADERS):
        digest.update((_CSRC / name).read_bytes())
    return digest.hexdigest()[:12]


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None,
                 softcap: float | None = None) -> torch.Tensor:
    """q: [B, Hq, D]; kv_cache: [2, Hk, num_blocks, block_size, D] -> [B, Hq, D]. With
    ``softcap`` (Gemma 2) each scaled score s becomes ``softcap * tanh(s / softcap)``."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.paged_decode(q.contiguous(), kv_cache, block_tables.contiguous(),
                            seq_lens.contiguous(), float(scale), sliding_window or -1,
                            float(softcap or 0.0))


def paged_decode_query_codes(kv_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether :func:`paged_decode` scores this cache with each scaled query row rounded to
    int16 codes (:func:`kvray.kernels.kv_quant.round_query_rows`): an int8 cache, head sizes
    64 and 128, on a build with AVX2. The rounding (2^-16 of the row's largest element) is
    far below the int8 keys' own; it lets the scores run as integer dot products."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return bool(ext.paged_decode_query_codes(kv_cache, int(head_dim)))


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                  scale: float, sliding_window: int | None, softcap: float | None = None
                  ) -> torch.Tensor:
    """q: [T, Hq, D], the new tokens of B sequences (sequence b's at
    ``query_start_loc[b]:query_start_loc[b + 1]``, the last of its ``seq_lens[b]``
    positions, their K/V already written), attended causally over the paged cache ->
    [T, Hq, D], scores capped as :func:`paged_decode`'s. Dtypes or head sizes the C++
    kernel does not take (fp16, a head size that is not a whole number of vectors, a build
    without AVX2) go through the PyTorch reference, one sequence at a time."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    # (windows of 2^22 tokens or more: the kernel compares distances as floats)
    if ext.paged_prefill_supported(q, kv_cache) and (sliding_window or 0) < 1 << 22:
        if q.stride(2) != 1 or q.stride(1) != q.shape[2]:  # other strides: a view of qkv
            q = q.contiguous()
        return ext.paged_prefill(q, kv_cache, block_tables.contiguous(),
                                 seq_lens.contiguous(), query_start_loc.contiguous(),
                                 float(scale), sliding_window or -1, float(softcap or 0.0))
    from kvray.kernels.attention import prefill_reference

    return prefill_reference(q, kv_cache, block_tables, seq_lens, query_start_loc,
                             max_query_len, scale, sliding_window, softcap)


def linear_small_m(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    """``F.linear`` for fp32 ``x`` of 1..32 rows (contiguous fp32 or bf16 weight)."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.linear_small_m(x.contiguous(), weight, bias)


def linear_tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    """``F.linear`` for 2-D ``x`` of many rows, in tiles the threads take one at a time."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.linear_tiled(x, weight, bias)


def expert_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` (no bias) for an MoE expert's rows: the small-M kernel for up to
    :func:`small_m_max_rows` rows, else the tiled one (fp32 ``x``, contiguous weight)."""
    if x.shape[0] <= small_m_max_rows():
        return linear_small_m(x, weight, None)
    return linear_tiled(x, weight, None)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                local_index: torch.Tensor, w13: torch.Tensor | list[torch.Tensor],
                w2: torch.Tensor | list[torch.Tensor],
                perms: list[torch.Tensor | None] | None = None) -> torch.Tensor:
    """A MoE layer's experts for a few tokens in one call: for x [T, H] routed to
    ``experts`` (global ids [T, k]) with ``weights`` [T, k], the sum over each token's
    experts held here (``local_index``: global id -> row of w13 / w2, -1 for none) of
    ``weight * down(silu(gate) * up)``, in x's dtype (fp32 inside). ``w13`` [local, 2I, H]
    and ``w2`` [local, H, I] stacked fp32 / bf16, or per local expert a quantized blob each
    (:func:`linear_q`'s), with ``perms`` their input permutations (w13's and w2's per
    expert, None for none). The products are :func:`linear_small_m`'s and
    :func:`linear_q`'s kernels: each expert's rows get the same values as through them."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    dtype = x.dtype
    x32 = x.float().contiguous()
    weights, experts = weights.float().contiguous(), experts.contiguous()
    if isinstance(w13, torch.Tensor):
        out = ext.moe_experts(x32, weights, experts, local_index, w13, w2)
    else:
        out = ext.moe_experts_q(x32, weights, experts, local_index, w13, w2, perms or [])
    return out if dtype == torch.float32 else out.to(dtype)


def moe_route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
              shared_gate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A MoE layer's routing of x [T, H] (1..32 rows) in one call: fp32 ``router`` [E, H]
    (with ``shared_gate`` one more row, Qwen2-MoE's shared-expert gate) -> (fp32 weights
    [T, top_k] of softmax over the E logits, renormalised over the k when asked; int64
    expert ids [T, top_k], largest first; the shared gate's sigmoid [T, 1] or None)."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    weights, experts, scale = ext.moe_route(x.float().contiguous(), router, top_k,
                                            renormalize, shared_gate)
    return weights, experts, scale if shared_gate else None


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] in ``linear_packed``'s layout (a 1-D tensor of about N x K), in its
    own dtype: fp32, or bf16 (the kernel widens it to fp32 exactly)."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.pack_linear_weight(weight)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for 2-D fp32 ``x`` on a weight packed by :func:`pack_linear_weight`."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.linear_packed(x, packed, out_features, bias)


def pack_gate_up_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 or bf16 gate_up weight [2I, K] (gate rows, then up rows) in
    ``linear_packed_gate_up``'s layout: each panel a vector of gate rows and the same rows
    of up. I must be a multiple of :func:`vector_lanes`."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.pack_gate_up_weight(weight)


def linear_packed_gate_up(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                          bias: torch.Tensor | None, silu_mul: bool = False) -> torch.Tensor:
    """``F.linear`` for 2-D fp32 ``x`` on a gate_up weight packed by
    :func:`pack_gate_up_weight` ([M, 2I] in the usual order), or with ``silu_mul`` the MLP's
    activation ``silu(gate) * up`` [M, I] computed from the accumulators: the same values as
    :func:`silu_and_mul` of the former, without writing and re-reading it."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.linear_packed_gate_up(x, packed, out_features, bias, silu_mul)


def vector_lanes() -> int:
    """fp32 lanes of the built kernels' vectors: 16 (AVX-512), 8 (AVX2), 1 (none) or 0 (no
    extension)."""
    ext = load_ops()
    return 0 if ext is None else int(ext.vector_lanes())


def quant_dot() -> str:
    """The integer dot product of the quantized linears' kernel: ``vnni512`` (AVX-512 VNNI,
    BW and VL; S8 codes two parts per instruction), ``vnni`` (AVX-VNNI), ``avx2``, ``none``
    (dequantized matmul) or ``""`` (no extension)."""
    ext = load_ops()
    return "" if ext is None else str(ext.quant_dot())


def quant_amx_rows() -> int:
    """From how many x rows the quantized linears run on AMX tiles (Intel Xeons from Sapphire
    Rapids); 0 where they never do (no AMX-INT8, ``KVRAY_AMX=0``, or no extension)."""
    ext = load_ops()
    return 0 if ext is None else int(ext.quant_amx_rows())


def small_m_max_rows() -> int:
    """Inputs of up to this many rows go through ``linear_small_m`` (and a decode batch of
    up to this many through the fused fp32 layer), by the built kernels' vector width."""
    return SMALL_M_MAX_ROWS_AVX512 if vector_lanes() >= 16 else SMALL_M_MAX_ROWS


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension; with ``residual``, ``residual += x`` in place first
    and the sum is normalised."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    res = None if residual is None else residual.view(-1, shape[-1])
    return ext.rms_norm(flat.contiguous(), weight, float(eps), res).view(shape)


def rotary_inplace(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (heads contiguous) in place by ``positions``; returns x."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    ext.rotary_inplace(x, positions, cos, sin)
    return x


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """:func:`kvray.kernels.attention.write_kv_cache` in one call: its two ``index_copy_``
    cost ~36 us each per layer of a 64-sequence decode step, ~2 ms of ~50."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    ext.write_kv(k, v, kv_cache, slot_mapping.contiguous())


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ([T, 2I] -> [T, I])."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.silu_and_mul(gate_up.contiguous())


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for 2-D fp32/bf16/fp16 ``x`` with unit stride along its rows,
    read once in its own dtype (no fp32 copy of bf16 logits)."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.argmax_rows(x)


def linear_q(x: torch.Tensor, blob: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for 2-D fp32 ``x`` on a quantized weight ``blob``
    (:func:`kvray.quant.blob.to_blob`; U4/U5/U6/S8 kinds) read in place: few rows
    with activations quantized per block of 32 to int8 (error at most half a step of each
    block's int8 grid times the weights' magnitudes), many rows on fp32 panels."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    if x.stride(-1) != 1:
        x = x.contiguous()
    return ext.linear_q(x, blob, bias)


def quantized_linear(x: torch.Tensor, blob: torch.Tensor, bias: torch.Tensor | None = None,
                     input_perm: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear_q` for ``x`` [..., K] of any float dtype: the columns taken in the
    blob's stored order (``input_perm``, GPTQ act-order), fp32 inside (a bf16 model's
    activations widened, the result rounded back to x's dtype)."""
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1])
    if input_perm is not None:
        x2 = gather_input(x2, input_perm)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    y = linear_q(x2, blob, None if bias is None else bias.float())
    if dtype != torch.float32:
        y = y.to(dtype)
    return y.view(*shape[:-1], y.shape[-1])


def embedding_q(blob: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape) of a quantized ``blob``, dequantized to fp32
    [*ids.shape, K] (quantized embeddings: the built-in GGUF's token_embd is Q8_0)."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.embedding_q(blob, ids)


def dequantize_q(blob: torch.Tensor) -> torch.Tensor:
    """A quantized ``blob`` as the fp32 matrix [N, K] it holds (every kind, F8 included)."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    return ext.dequantize_q(blob)


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             ranks: torch.Tensor, slice_starts: list[int], row_slots: torch.Tensor
             ) -> torch.Tensor:
    """:func:`kvray.kernels.lora.lora_add_reference` in one call: ``y`` += each row's
    adapter delta, in place."""
    ext = load_ops()
    assert ext is not None, "call load_ops() first and check it is available"
    if x.stride(-1) != 1:
        x = x.contiguous()
    return ext.lora_add(y, x, a, bt, ranks, slice_starts, row_slots)

