// Python bindings of kvray's CPU ops (one extension, several sources).
#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "Paged decode attention: q [B, Hq, D] against the paged KV cache -> [B, Hq, D]");
  m.def("linear_small_m", &linear_small_m,
        "x [M, K] @ w[N, K]^T (+ bias) reading w once for all M rows (fp32, small M)");
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, with an optional fused residual add");
  m.def("rotary_inplace", &rotary_inplace, "rotary embedding of x [T, H, D] in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] -> [T, I]");
  m.def("decode_layer", &decode_layer, "one decoder layer for a decode batch (fp32)");
}
