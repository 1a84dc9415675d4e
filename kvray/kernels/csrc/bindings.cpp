// Python bindings of kvray's CPU ops (one extension, several sources).
#include <torch/extension.h>

#include "ops.h"

// Every op runs without the GIL (none touches a Python object): in a Serve replica the
// engine thread computes while the replica's own threads stream tokens; holding the GIL
// through a decoder layer would make them wait for it, and the next step for them.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode", &paged_decode, nogil(),
        "Paged decode attention: q [B, Hq, D] against the paged KV cache -> [B, Hq, D]");
  m.def("paged_decode_query_codes", &paged_decode_query_codes,
        "whether paged_decode rounds each scaled query row to int16 codes over this cache");
  m.def("paged_prefill", &paged_prefill, nogil(),
        "Paged prefill attention: new tokens q [T, Hq, D] against the paged KV cache");
  m.def("paged_prefill_supported", &paged_prefill_supported,
        "whether paged_prefill takes these q/cache dtypes and head size");
  m.def("linear_small_m", &linear_small_m, nogil(),
        "x [M, K] @ w[N, K]^T (+ bias) reading w once for all M rows (fp32, small M)");
  m.def("linear_tiled", &linear_tiled, nogil(),
        "x [M, K] @ w[N, K]^T (+ bias) as tiles the threads take one at a time (many rows)");
  m.def("pack_linear_weight", &pack_linear_weight, nogil(),
        "fp32 or bf16 w [N, K] packed once (in its dtype) for linear_packed");
  m.def("linear_packed", &linear_packed, nogil(),
        "x [M, K] @ w^T (+ bias) on a weight packed by pack_linear_weight");
  m.def("pack_gate_up_weight", &pack_gate_up_weight, nogil(),
        "fp32 or bf16 gate_up w [2I, K] packed once, gate and up rows paired, for "
        "linear_packed_gate_up");
  m.def("linear_packed_gate_up", &linear_packed_gate_up, nogil(),
        "x [M, K] @ w^T on a paired gate_up weight: [M, 2I], or silu(gate) * up [M, I]");
  m.def("vector_lanes", &vector_lanes, "fp32 lanes of this build's vector kernels");
  m.def("rms_norm", &rms_norm, nogil(), "RMSNorm of rows, with an optional fused residual add");
  m.def("rotary_inplace", &rotary_inplace, nogil(), "rotary embedding of x [T, H, D] in place");
  m.def("silu_and_mul", &silu_and_mul, nogil(), "silu(gate) * up of [T, 2I] -> [T, I]");
  m.def("write_kv", &write_kv, nogil(), "K/V of this step into their paged cache slots");
  m.def("argmax_rows", &argmax_rows, nogil(), "first index of each row's largest value");
  m.def("decode_layer", &decode_layer, nogil(),
        "one decoder layer for a decode batch (fp32 activations)");
  m.def("decode_layers", &decode_layers, nogil(),
        "decode_layer for each of a stage's layers in turn, in one call");
  m.def("decode_layer_lora", &decode_layer_lora, nogil(),
        "decode_layer with each row's LoRA adapter added to its linears' outputs");
  m.def("decode_layers_lora", &decode_layers_lora, nogil(),
        "decode_layers with each row's LoRA adapter added to its linears' outputs");
  m.def("decode_layer_moe", &decode_layer_moe, nogil(),
        "decode_layer whose MLP may be a MoE layer's (routing, experts, shared expert)");
  m.def("decode_layers_moe", &decode_layers_moe, nogil(),
        "decode_layers whose layers' MLPs may be MoE layers'");
  m.def("linear_q", &linear_q, nogil(),
        "x [M, K] @ W^T (+ bias) with W a quantized blob read in place");
  m.def("quant_dot", &quant_dot, "the integer dot product of linear_q's kernel: vnni512, vnni, avx2, none");
  m.def("quant_amx_rows", &quant_amx_rows,
        "from how many x rows linear_q runs on AMX tiles (0: never in this build or process)");
  m.def("embedding_q", &embedding_q, nogil(), "rows of a quantized blob, dequantized");
  m.def("lora_add", &lora_add, nogil(),
        "y += each row's LoRA delta (rows grouped by adapter slot), in place");
  m.def("dequantize_q", &dequantize_q, nogil(), "a quantized blob dequantized to fp32 [N, K]");
  m.def("moe_route", &moe_route, nogil(),
        "a MoE layer's routing: (top-k weights, expert ids, shared-expert gate) of x");
  m.def("moe_experts", &moe_experts, nogil(),
        "a MoE layer's routed experts (fp32 / bf16 stacked weights) for a few tokens");
  m.def("moe_experts_q", &moe_experts_q, nogil(),
        "a MoE layer's routed experts (a quantized blob per matrix) for a few tokens");
}
