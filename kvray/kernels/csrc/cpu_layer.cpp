// One Llama-family decoder layer for a decode batch, in one call (built by
// kvray/kernels/cpu_ops.py).
//
// At batch 1 the Python path spends ~0.2 ms per layer between its kernels (module calls,
// views, the K/V scatter's index_copy_, metadata): ~6 ms of a ~25 ms step on a 2-core AVX2
// EPYC. Here the same kernels run back to back with nothing between them: the fused norms,
// the small-M linear, in-place rotary, a direct K/V write and the paged decode attention.
// fp32 activations (the small-M kernel's input); weights fp32 or bf16 (a bf16 model's own,
// or the copies of an fp32 run of a bf16 checkpoint); the cache fp32, bf16 or fp16.
#include "ops.h"

#include <cstring>
#include <type_traits>

#include "kv_quant.h"

namespace {

at::Tensor opt(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? *t : at::Tensor();
}

// Write rows of K and V ([T, Hk, D] views with unit stride in D) into their cache slots,
// rounded to the cache's dtype when it is narrower than theirs, or quantized (int8 / fp8
// codes and a scale per row, kv_quant.h).
template <typename TS, typename TC>
void write_kv_impl(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv,
                   const at::Tensor& slots) {
  const int64_t T_ = k.size(0), Hk = k.size(1), D = k.size(2), W = kvray::row_width<TC>(D);
  const int64_t num_slots = kv.size(2) * kv.size(3);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const TS* kp = k.data_ptr<TS>();
  const TS* vp = v.data_ptr<TS>();
  TC* cache = kv.data_ptr<TC>();
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t s = sp[t];
    TORCH_CHECK(s >= 0 && s < num_slots, "write_kv: slot ", s, " outside the cache");
    for (int64_t h = 0; h < Hk; ++h) {
      const TS* src[2] = {kp + t * k.stride(0) + h * k.stride(1),
                          vp + t * v.stride(0) + h * v.stride(1)};
      for (int64_t which = 0; which < 2; ++which) {
        TC* dst = cache + ((which * Hk + h) * num_slots + s) * W;
        if constexpr (kvray::kQuantizedKV<TC>) {
          kvray::quantize_row(src[which], D, dst);
        } else if constexpr (std::is_same_v<TS, TC>) {
          std::memcpy(dst, src[which], D * sizeof(TC));
        } else {
          for (int64_t d = 0; d < D; ++d)
            dst[d] = static_cast<TC>(static_cast<float>(src[which][d]));
        }
      }
    }
  }
}

}  // namespace

void write_kv(at::Tensor k, at::Tensor v, at::Tensor kv, at::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 &&
              v.stride(2) == 1 && k.scalar_type() == v.scalar_type(),
              "write_kv: k and v [T, Hk, D] of one dtype, unit stride in D");
  const at::ScalarType cache_type = kv.scalar_type();
  const bool quantized = kvray::is_quantized_kv(cache_type);
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous() && kv.size(1) == k.size(1) &&
              kv.size(4) == k.size(2) + (quantized ? kvray::kScaleBytes : 0),
              "write_kv: paged cache [2, Hk, blocks, block_size, D] (D + 4 for int8/fp8: "
              "codes, then a scale)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
              slots.numel() == k.size(0), "write_kv: int64 slots [T]");
  if (quantized) {
    TORCH_CHECK(at::isFloatingType(k.scalar_type()), "write_kv: floating-point k/v");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
      if (cache_type == at::kChar) write_kv_impl<scalar_t, int8_t>(k, v, kv, slots);
      else if (cache_type == at::kFloat8_e4m3fn)
        write_kv_impl<scalar_t, c10::Float8_e4m3fn>(k, v, kv, slots);
      else write_kv_impl<scalar_t, c10::Float8_e5m2>(k, v, kv, slots);
    });
    return;
  }
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() || k.scalar_type() == at::kFloat,
              "write_kv: k/v of the cache's dtype or fp32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "write_kv", [&] {
    if (k.scalar_type() == kv.scalar_type()) write_kv_impl<scalar_t, scalar_t>(k, v, kv, slots);
    else write_kv_impl<float, scalar_t>(k, v, kv, slots);
  });
}

namespace {

// One linear's adapter slots in a decode_layer_lora call: a, bt, ranks and the slice
// starts (int64), as kvray/kernels/lora.py lays them out.
void add_lora(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& lora,
              int which, const at::Tensor& rows) {
  const at::Tensor& starts = lora[4 * which + 3];
  const int64_t* sp = starts.data_ptr<int64_t>();
  lora_add(y, x, lora[4 * which], lora[4 * which + 1], lora[4 * which + 2],
           std::vector<int64_t>(sp, sp + starts.numel()), rows);
}

std::tuple<at::Tensor, at::Tensor> decode_layer_impl(
    at::Tensor hidden, c10::optional<at::Tensor> residual_in, const std::vector<at::Tensor>& w,
    const std::vector<c10::optional<at::Tensor>>& bias, const std::vector<int64_t>& dims,
    double eps, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor kv, const at::Tensor& tables, const at::Tensor& seq_lens,
    const at::Tensor& slots, double scale, int64_t window,
    const std::vector<at::Tensor>* lora, const at::Tensor* lora_rows,
    const std::vector<at::Tensor>* moe = nullptr, const std::vector<int64_t>* moe_dims = nullptr) {
  // a MoE layer: moe_mlp's arguments in place of a dense MLP (no adapters)
  const bool sparse = moe != nullptr && !moe->empty();
  TORCH_CHECK(!sparse || (lora == nullptr && moe_dims != nullptr),
              "decode_layer: a MoE layer takes no adapters");
  TORCH_CHECK(lora == nullptr || (lora->size() == 16 && lora_rows != nullptr),
              "decode_layer_lora: [a, bt, ranks, slice starts] for qkv, o, gate_up and down "
              "and the rows' slots expected");
  TORCH_CHECK((w.size() == 8 && dims.size() == 3) || (w.size() == 12 && dims.size() == 9),
              "decode_layer: weights [in_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, "
              "down] and dims [Hq, Hk, D], or those with packed [qkv, o, gate_up, down] and "
              "[small-M rows, their N, gate_up paired] after them expected");
  TORCH_CHECK(bias.size() == 4, "decode_layer: biases [qkv, o, gate_up, down] expected");
  const bool quantized_kv = kvray::is_quantized_kv(kv.scalar_type());
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() &&
              (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == kv.scalar_type() ||
               (quantized_kv && (hidden.scalar_type() == at::kBFloat16 ||
                                 hidden.scalar_type() == at::kHalf))),
              "decode_layer: hidden [T, H], fp32 or of the cache's (model's) dtype");
  TORCH_CHECK(kv.is_contiguous() && kv.dim() == 5 &&
              (kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kBFloat16 ||
               kv.scalar_type() == at::kHalf || quantized_kv),
              "decode_layer: fp32/bf16/fp16/int8/fp8 paged cache [2, Hk, blocks, block_size, "
              "D (+ 4)]");
  // A bf16/fp16 model's layers run here on fp32 activations (its first layer gets the
  // embedding in the model's dtype): exact products with its weights, one rounding per
  // output instead of one per op, and K/V rounded to the cache's dtype as they are written.
  if (hidden.scalar_type() != at::kFloat) hidden = hidden.to(at::kFloat);
  const int64_t T = hidden.size(0), Hq = dims[0], Hk = dims[1], D = dims[2];
  TORCH_CHECK(kv.size(1) == Hk && kv.size(4) == D + (quantized_kv ? kvray::kScaleBytes : 0),
              "decode_layer: cache shape");
  const at::Tensor &in_norm = w[0], &q_norm = w[2], &k_norm = w[3], &post_norm = w[5],
                   &gate_up_w = w[6];
  const int64_t q_size = Hq * D, kv_size = Hk * D;
  // The packed weights for a batch past the small-M kernel's rows (where there are any).
  const bool packed = w.size() == 12 && T > dims[3];
  // A uint8 weight is a quantized blob (kvray/quant/blob.py), read in place by linear_q.
  const auto linear_base = [&](const at::Tensor& in, int which) {  // 0 qkv, 1 o, 3 down
    static constexpr int kPlain[] = {1, 4, 6, 7};
    if (w[kPlain[which]].scalar_type() == at::kByte)
      return linear_q(in, w[kPlain[which]], bias[which]);
    if (packed) return linear_packed(in, w[8 + which], dims[4 + which], bias[which]);
    return linear_small_m(in, w[kPlain[which]], opt(bias[which]));
  };
  const auto linear = [&](const at::Tensor& in, int which) {  // + the rows' adapters
    at::Tensor y = linear_base(in, which);
    if (lora != nullptr) add_lora(y, in, *lora, which, *lora_rows);
    return y;
  };

  // input norm (+ the previous layer's output added into the residual stream)
  at::Tensor residual = opt(residual_in), x;
  if (residual.defined()) {
    x = rms_norm(hidden, in_norm, eps, residual);
  } else {
    x = rms_norm(hidden, in_norm, eps, c10::nullopt);
    residual = hidden;
  }
  at::Tensor qkv = linear(x, 0);  // [T, q + 2 kv]
  at::Tensor v = qkv.slice(1, q_size + kv_size).view({T, Hk, D});
  at::Tensor q, k;
  if (!q_norm.defined() || q_norm.numel() == 0) {  // rotate q, k in place in the QKV output
    rotary_inplace(qkv.slice(1, 0, q_size + kv_size).view({T, Hq + Hk, D}), positions, cos,
                   sin);
    q = qkv.slice(1, 0, q_size).view({T, Hq, D}).contiguous();
    k = qkv.slice(1, q_size, q_size + kv_size).view({T, Hk, D});
  } else {  // per-head norms first (Qwen3)
    q = rms_norm(qkv.slice(1, 0, q_size).reshape({T * Hq, D}), q_norm, eps, c10::nullopt)
            .view({T, Hq, D});
    k = rms_norm(qkv.slice(1, q_size, q_size + kv_size).reshape({T * Hk, D}), k_norm, eps,
                 c10::nullopt).view({T, Hk, D});
    rotary_inplace(q, positions, cos, sin);
    rotary_inplace(k, positions, cos, sin);
  }
  write_kv(k, v, kv, slots);
  at::Tensor attn = paged_decode(q, kv, tables, seq_lens, scale, window, 0.0);
  at::Tensor o = linear(attn.view({T, q_size}), 1);

  x = rms_norm(o, post_norm, eps, residual);  // residual += o
  if (sparse) return {moe_mlp(x, *moe, *moe_dims), residual};
  at::Tensor act;
  if (lora != nullptr) {  // the adapters' delta goes in before the activation
    at::Tensor gate_up;
    if (gate_up_w.scalar_type() == at::kByte) gate_up = linear_q(x, gate_up_w, bias[2]);
    else if (packed && dims[8] != 0)
      gate_up = linear_packed_gate_up(x, w[10], dims[6], bias[2], false);
    else if (packed) gate_up = linear_packed(x, w[10], dims[6], bias[2]);
    else gate_up = linear_small_m(x, gate_up_w, opt(bias[2]));
    add_lora(gate_up, x, *lora, 2, *lora_rows);
    act = silu_and_mul(gate_up);
  } else if (gate_up_w.scalar_type() == at::kByte) {
    act = silu_and_mul(linear_q(x, gate_up_w, bias[2]));
  } else if (packed && dims[8] != 0) {  // paired: the activation from the GEMM's epilogue
    act = linear_packed_gate_up(x, w[10], dims[6], bias[2], true);
  } else {
    act = silu_and_mul(packed ? linear_packed(x, w[10], dims[6], bias[2])
                              : linear_small_m(x, gate_up_w, opt(bias[2])));
  }
  return {linear(act, 3), residual};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor hidden, c10::optional<at::Tensor> residual_in, std::vector<at::Tensor> w,
    std::vector<c10::optional<at::Tensor>> bias, std::vector<int64_t> dims, double eps,
    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor tables,
    at::Tensor seq_lens, at::Tensor slots, double scale, int64_t window) {
  return decode_layer_impl(hidden, residual_in, w, bias, dims, eps, positions, cos, sin, kv,
                           tables, seq_lens, slots, scale, window, nullptr, nullptr);
}

std::tuple<at::Tensor, at::Tensor> decode_layer_lora(
    at::Tensor hidden, c10::optional<at::Tensor> residual_in, std::vector<at::Tensor> w,
    std::vector<c10::optional<at::Tensor>> bias, std::vector<int64_t> dims, double eps,
    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor tables,
    at::Tensor seq_lens, at::Tensor slots, double scale, int64_t window,
    std::vector<at::Tensor> lora, at::Tensor lora_rows) {
  return decode_layer_impl(hidden, residual_in, w, bias, dims, eps, positions, cos, sin, kv,
                           tables, seq_lens, slots, scale, window, &lora, &lora_rows);
}

namespace {

std::tuple<at::Tensor, at::Tensor> decode_layers_impl(
    at::Tensor hidden, c10::optional<at::Tensor> residual,
    const std::vector<std::vector<at::Tensor>>& w,
    const std::vector<std::vector<c10::optional<at::Tensor>>>& bias,
    const std::vector<int64_t>& dims, double eps, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& kv,
    const at::Tensor& tables, const at::Tensor& seq_lens, const at::Tensor& slots,
    double scale, const std::vector<int64_t>& windows,
    const std::vector<std::vector<at::Tensor>>* lora, const at::Tensor* lora_rows,
    const std::vector<std::vector<at::Tensor>>* moe = nullptr,
    const std::vector<int64_t>* moe_dims = nullptr) {
  const size_t n = w.size();
  TORCH_CHECK(n > 0 && bias.size() == n && kv.size() == n && windows.size() == n &&
                  (moe == nullptr || moe->size() == n),
              "decode_layers: weights, biases, caches and windows (and MoE arguments) for each "
              "layer expected");
  c10::optional<at::Tensor> res = residual;
  for (size_t i = 0; i < n; ++i) {
    auto out = decode_layer_impl(hidden, res, w[i], bias[i], dims, eps, positions, cos, sin,
                                 kv[i], tables, seq_lens, slots, scale, windows[i],
                                 lora == nullptr ? nullptr : &(*lora)[i], lora_rows,
                                 moe == nullptr ? nullptr : &(*moe)[i], moe_dims);
    hidden = std::get<0>(out);
    res = std::get<1>(out);
  }
  return {hidden, *res};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layers(
    at::Tensor hidden, c10::optional<at::Tensor> residual, std::vector<std::vector<at::Tensor>> w,
    std::vector<std::vector<c10::optional<at::Tensor>>> bias, std::vector<int64_t> dims,
    double eps, at::Tensor positions, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv,
    at::Tensor tables, at::Tensor seq_lens, at::Tensor slots, double scale,
    std::vector<int64_t> windows) {
  return decode_layers_impl(hidden, residual, w, bias, dims, eps, positions, cos, sin, kv,
                            tables, seq_lens, slots, scale, windows, nullptr, nullptr);
}

std::tuple<at::Tensor, at::Tensor> decode_layers_lora(
    at::Tensor hidden, c10::optional<at::Tensor> residual, std::vector<std::vector<at::Tensor>> w,
    std::vector<std::vector<c10::optional<at::Tensor>>> bias, std::vector<int64_t> dims,
    double eps, at::Tensor positions, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv,
    at::Tensor tables, at::Tensor seq_lens, at::Tensor slots, double scale,
    std::vector<int64_t> windows, std::vector<std::vector<at::Tensor>> lora,
    at::Tensor lora_rows) {
  TORCH_CHECK(lora.size() == w.size(), "decode_layers_lora: adapter slots for each layer");
  return decode_layers_impl(hidden, residual, w, bias, dims, eps, positions, cos, sin, kv,
                            tables, seq_lens, slots, scale, windows, &lora, &lora_rows);
}

std::tuple<at::Tensor, at::Tensor> decode_layer_moe(
    at::Tensor hidden, c10::optional<at::Tensor> residual_in, std::vector<at::Tensor> w,
    std::vector<c10::optional<at::Tensor>> bias, std::vector<int64_t> dims, double eps,
    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor tables,
    at::Tensor seq_lens, at::Tensor slots, double scale, int64_t window,
    std::vector<at::Tensor> moe, std::vector<int64_t> moe_dims) {
  return decode_layer_impl(hidden, residual_in, w, bias, dims, eps, positions, cos, sin, kv,
                           tables, seq_lens, slots, scale, window, nullptr, nullptr, &moe,
                           &moe_dims);
}

std::tuple<at::Tensor, at::Tensor> decode_layers_moe(
    at::Tensor hidden, c10::optional<at::Tensor> residual, std::vector<std::vector<at::Tensor>> w,
    std::vector<std::vector<c10::optional<at::Tensor>>> bias, std::vector<int64_t> dims,
    double eps, at::Tensor positions, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv,
    at::Tensor tables, at::Tensor seq_lens, at::Tensor slots, double scale,
    std::vector<int64_t> windows, std::vector<std::vector<at::Tensor>> moe,
    std::vector<int64_t> moe_dims) {
  return decode_layers_impl(hidden, residual, w, bias, dims, eps, positions, cos, sin, kv,
                            tables, seq_lens, slots, scale, windows, nullptr, nullptr, &moe,
                            &moe_dims);
}
