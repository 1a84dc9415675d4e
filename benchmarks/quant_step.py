"""One decode step of a random Llama stack on kvray's GPU kernels, whole and cut into parts.

Per layer: residual + RMSNorm (straight to FP8 rows where the next weight multiplies them,
``triton_ops.rms_norm_fp8``) -> qkv -> rotary + KV-cache write (one kernel) -> paged decode
attention over ``shape.context`` cached tokens -> o -> residual + RMSNorm -> gate_up ->
SiLU-and-mul -> down; then the final norm and the LM head. :meth:`DecodeStep.step` runs it
with the real data flow; :meth:`DecodeStep.parts` runs each part alone over every layer
(inputs from fixed buffers), which is how ``gpu_quant_bench.py`` breaks the step's time
down. :meth:`DecodeStep.bytes_read` is what the step must read from memory (every weight
once, every sequence's K/V once), the numerator of its roofline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kvray.quant.tensor import QuantTensor

PARTS = ("norms", "qkv", "rotary + KV write", "attention", "o", "gate_up", "silu_and_mul",
         "down", "lm_head")
EPS = 1e-5


def linear(x: Any, w: torch.Tensor | QuantTensor) -> torch.Tensor:
    """x @ w^T through kvray's kernel for w's format (x may be FP8 rows for a quantized w)."""
    if isinstance(w, QuantTensor):
        from kvray.kernels.triton_quant import linear_quant

        return linear_quant(x, w)
    return F.linear(x, w)


def weight_bytes(w: torch.Tensor | QuantTensor) -> int:
    return w.nbytes if isinstance(w, QuantTensor) else w.numel() * w.element_size()


class DecodeStep:
    """The step's weights, per-layer KV caches and buffers for ``m`` sequences (``shape``:
    a ``gpu_quant_bench.Shape``)."""

    def __init__(self, layers: list[dict[str, Any]], lm_head: torch.Tensor, shape: Any,
                 m: int, caches: list[torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        from kvray.kernels.rotary import RotaryEmbedding
        from kvray.kernels.triton_quant import takes_fp8_rows

        self.layers, self.lm_head, self.shape, self.m = layers, lm_head, shape, m
        self.caches = caches
        ctx, bs = shape.context, shape.block_size
        blocks = -(-ctx // bs)
        self.tables = torch.arange(m * blocks, device=device, dtype=torch.int32).view(m, -1)
        self.lens = torch.full((m,), ctx, device=device, dtype=torch.int32)
        self.positions = torch.full((m,), ctx - 1, device=device, dtype=torch.int64)
        self.slots = (self.tables[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs)
        rotary = RotaryEmbedding(shape.head_dim, 500000.0, None, ctx + 1)
        self.cos, self.sin = (t.to(device) for t in rotary.tables(self.positions.cpu()))
        self.norm_w = torch.ones(shape.hidden, device=device, dtype=dtype)
        self.fp8 = {name: isinstance(w, QuantTensor) and takes_fp8_rows(w, device, dtype)
                    for name, w in layers[0].items()}
        n_qkv = shape.linears()["qkv"][0]

        def buf(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=device, dtype=dtype)

        self.x, self.residual = buf(m, shape.hidden), buf(m, shape.hidden)
        self.qkv_buf, self.attn_buf = buf(m, n_qkv), buf(m, shape.heads * shape.head_dim)
        self.gate_up_buf, self.act_buf = buf(m, 2 * shape.intermediate), buf(m, shape.intermediate)

    def bytes_read(self) -> int:
        """Every weight once (LM head included) and every sequence's cached K/V once."""
        weights = sum(weight_bytes(w) for layer in self.layers for w in layer.values())
        kv = sum(2 * self.m * self.shape.context * c.shape[1] * c.shape[-1] * c.element_size()
                 for c in self.caches)
        return weights + weight_bytes(self.lm_head) + kv

    def _norm(self, h: torch.Tensor, next_weight: str) -> Any:
        """residual += h, then its norm (as FP8 rows where ``next_weight`` takes them)."""
        from kvray.kernels import triton_ops

        if self.fp8[next_weight]:
            return triton_ops.rms_norm_fp8(h, self.norm_w, EPS, self.residual)
        return triton_ops.rms_norm(h, self.norm_w, EPS, self.residual)

    def _qkv_views(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = self.shape
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        q = qkv[:, :q_size].view(self.m, s.heads, s.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(self.m, s.kv_heads, s.head_dim)
        v = qkv[:, q_size + kv_size:].view(self.m, s.kv_heads, s.head_dim)
        return q, k, v

    def _write(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        from kvray.kernels.triton_attention import rotary_write_kv

        q, k, v = self._qkv_views(qkv)
        rotary_write_kv(q, k, v, self.positions, self.cos, self.sin, self.caches[layer],
                        self.slots)
        return q

    def _attend(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        from kvray.kernels.triton_attention import paged_decode

        out = paged_decode(q, self.caches[layer], self.tables, self.lens,
                           self.shape.head_dim ** -0.5, None)
        return out.view(self.m, -1)

    def _lm_head(self, h: torch.Tensor) -> torch.Tensor:
        from kvray.kernels import triton_ops

        return F.linear(triton_ops.rms_norm(h, self.norm_w, EPS, self.residual), self.lm_head)

    def step(self) -> torch.Tensor:
        """The whole decode step, logits out."""
        from kvray.kernels import triton_ops

        h = self.x
        for i, w in enumerate(self.layers):
            qkv = linear(self._norm(h, "qkv"), w["qkv"])
            h = linear(self._attend(self._write(qkv, i), i), w["o"])
            gate_up = linear(self._norm(h, "gate_up"), w["gate_up"])
            h = linear(triton_ops.silu_and_mul(gate_up), w["down"])
        return self._lm_head(h)

    def parts(self) -> dict[str, Callable[[], None]]:
        """name -> the part run over every layer on fixed inputs (see :data:`PARTS`)."""
        from kvray.kernels import triton_ops

        qkv_in, gate_up_in = self._norm(self.x, "qkv"), self._norm(self.x, "gate_up")
        q = self._qkv_views(self.qkv_buf)[0]

        def each(fn: Callable[[int, dict[str, Any]], Any]) -> Callable[[], None]:
            def run() -> None:
                for i, w in enumerate(self.layers):
                    fn(i, w)
            return run

        return {
            "norms": each(lambda i, w: (self._norm(self.x, "qkv"),
                                        self._norm(self.x, "gate_up"))),
            "qkv": each(lambda i, w: linear(qkv_in, w["qkv"])),
            "rotary + KV write": each(lambda i, w: self._write(self.qkv_buf, i)),
            "attention": each(lambda i, w: self._attend(q, i)),
            "o": each(lambda i, w: linear(self.attn_buf, w["o"])),
            "gate_up": each(lambda i, w: linear(gate_up_in, w["gate_up"])),
            "silu_and_mul": each(lambda i, w: triton_ops.silu_and_mul(self.gate_up_buf)),
            "down": each(lambda i, w: linear(self.act_buf, w["down"])),
            "lm_head": lambda: self._lm_head(self.x),
        }


def new_caches(shape: Any, m: int, device: torch.device, dtype: torch.dtype
               ) -> list[torch.Tensor]:
    """Random bf16 K/V of ``m`` sequences of ``shape.context`` tokens, one cache per layer
    (distinct memory: nothing stays in L2 from one layer to the next)."""
    blocks = m * -(-shape.context // shape.block_size)
    return [torch.randn(2, shape.kv_heads, blocks, shape.block_size, shape.head_dim,
                        device=device, dtype=dtype) for _ in range(shape.layers)]


def cuda_kernels(fn: Callable[[], Any]) -> int | None:
    """The CUDA kernels (and memcpy/memset) one eager ``fn()`` launches, by the profiler;
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
