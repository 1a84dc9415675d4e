// Fused elementwise ops of a decoder layer (built by kvray/kernels/cpu_ops.py).
//
// In a decode step each of these is a handful of tiny PyTorch ops per layer (an RMSNorm is
// about eight), and on CPU their per-op dispatch costs more than the arithmetic. One pass
// over the rows here, fp32 math as the PyTorch references do; parallel over rows.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernel_parts.h"
#include "vec.h"

namespace {

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

// grain: rows per task, so a task handles at least ~16 K elements.
inline int64_t row_grain(int64_t row_len) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_len, 1));
}

// One row of rms_norm: residual += x first when given (rounded to the row's dtype, and
// the rounded sum normalised), then out = w * dtype(x * inv_rms). fp32 and bf16 rows run
// at the vector width of vec.h (same roundings, lane-wise partial sums of squares).
template <typename T>
void rms_norm_row(const T* xr, T* rr, const T* wp, T* orow, int64_t H, double eps) {
  int64_t i = 0;
  float ss = 0.f;
#ifdef __AVX2__
  using V = kvray::Vec;
  constexpr bool kVec = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
  typename V::T acc = V::zero();
  if constexpr (kVec) {
    if (rr) {
      for (; i + V::kWidth <= H; i += V::kWidth) {
        const auto sum = kvray::as_stored<V, T>(V::add(V::load(rr + i), V::load(xr + i)));
        V::store(rr + i, sum);
        acc = V::fma(sum, sum, acc);
      }
    } else {
      for (; i + V::kWidth <= H; i += V::kWidth) {
        const auto v = V::load(xr + i);
        acc = V::fma(v, v, acc);
      }
    }
    ss = V::sum(acc);
  }
#endif
  for (; i < H; ++i) {
    if (rr) rr[i] = static_cast<T>(f32(rr[i]) + f32(xr[i]));
    const float v = f32(rr ? rr[i] : xr[i]);
    ss += v * v;
  }
  const T* src = rr ? rr : xr;
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
  i = 0;
#ifdef __AVX2__
  if constexpr (kVec) {
    const auto vinv = V::set1(inv);
    for (; i + V::kWidth <= H; i += V::kWidth) {
      const auto normed = kvray::as_stored<V, T>(V::mul(V::load(src + i), vinv));
      V::store(orow + i, V::mul(V::load(wp + i), normed));
    }
  }
#endif
  for (; i < H; ++i) {
    const T normed = static_cast<T>(f32(src[i]) * inv);
    orow[i] = static_cast<T>(f32(wp[i]) * f32(normed));
  }
}

// silu(g) * u over one row of I, rounding the activation to the row's dtype first (as the
// PyTorch reference's two ops do). Vector code for fp32 and bf16 (within a few ulp).
template <typename T>
void silu_and_mul_row(const T* g, const T* u, T* o, int64_t I) {
  int64_t i = 0;
#ifdef __AVX2__
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    using V = kvray::Vec;
    for (; i + V::kWidth <= I; i += V::kWidth) {
      const auto act = kvray::as_stored<V, T>(kvray::silu<V>(V::load(g + i)));
      V::store(o + i, V::mul(act, V::load(u + i)));
    }
  }
#endif
  for (; i < I; ++i) {
    const float gv = f32(g[i]);
    const T act = static_cast<T>(gv / (1.f + std::exp(-gv)));
    o[i] = static_cast<T>(f32(act) * f32(u[i]));
  }
}

}  // namespace

void silu_and_mul_f32(const float* g, const float* u, float* o, int64_t I) {
  silu_and_mul_row(g, u, o, I);
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps,
                    c10::optional<at::Tensor> residual) {
  // Rows may be strided (a per-head view of a QKV output: one head per row), each row
  // itself contiguous; the output is contiguous.
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(1) == 1) &&
                  weight.numel() == x.size(1),
              "rms_norm: x [T, H] with contiguous rows and weight [H] expected");
  // fp32 activations of a bf16 model (its fused decode layers): the weight in x's dtype.
  if (weight.scalar_type() != x.scalar_type()) weight = weight.to(x.scalar_type());
  weight = weight.contiguous();
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == x.scalar_type(), "rms_norm: residual like x");
  const int64_t T = x.size(0), H = x.size(1), row_stride = x.stride(0);
  auto out = at::empty({T, H}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* rp = has_res ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(H), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        rms_norm_row(xp + t * row_stride, rp ? rp + t * H : nullptr, wp, op + t * H, H, eps);
    });
  });
  return out;
}

void rotary_inplace(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x [T, H, D] with contiguous heads expected");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(1) * 2 == x.size(2),
              "rotary: fp32 cos/sin [max_pos, D/2] expected");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
              positions.numel() == x.size(0), "rotary: int64 positions [T] expected");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t row_stride = x.stride(0), max_pos = cos.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "rotary: position beyond the cos/sin table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(H * D), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        // cos/sin rounded to x's dtype first, as the PyTorch reference does
        const float* c = cp + pp[t] * half;
        const float* s = sp + pp[t] * half;
        for (int64_t h = 0; h < H; ++h) {
          scalar_t* v = xp + t * row_stride + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float ci = f32(static_cast<scalar_t>(c[i]));
            const float si = f32(static_cast<scalar_t>(s[i]));
            const float x1 = f32(v[i]), x2 = f32(v[i + half]);
            v[i] = static_cast<scalar_t>(x1 * ci - x2 * si);
            v[i + half] = static_cast<scalar_t>(x2 * ci + x1 * si);
          }
        }
      }
    });
  });
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: contiguous [T, 2 * I] expected");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(),
      "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, row_grain(I), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        silu_and_mul_row(gp + t * 2 * I, gp + t * 2 * I + I, op + t * I, I);
    });
  });
  return out;
}
