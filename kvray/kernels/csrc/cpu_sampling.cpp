// Greedy picks over logits (built by kvray/kernels/cpu_ops.py).
//
// A greedy decode step needs each row's argmax and nothing else. PyTorch's CPU path first
// widened the bf16 logits to fp32 (a fresh 50 MB tensor at 256 rows x 49,152 tokens: ~13 ms
// of page faults) and its max reduction then took 6-8 ms more; this reads the logits once,
// in their own dtype, parallel over rows.
//
// Semantics are those of torch.argmax(dim=-1): the first index of the largest value, and a
// NaN counts as larger than anything (the first NaN wins). Comparisons here are explicit
// vector predicates and bit tests, so -ffast-math cannot drop the NaN handling.
#include "ops.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace {

inline bool is_nan_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return (u & 0x7fffffffu) > 0x7f800000u;
}

// Scalar argmax of v[from, n) given the best (value, index) so far; NaN handled by the
// caller (rows without one only).
template <typename T>
inline int64_t scan(const T* v, int64_t from, int64_t n, float best, int64_t at) {
  for (int64_t i = from; i < n; ++i) {
    const float x = static_cast<float>(v[i]);
    if (x > best) { best = x; at = i; }
  }
  return at;
}

template <typename T>
inline int64_t first_nan(const T* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (is_nan_bits(static_cast<float>(v[i]))) return i;
  return -1;
}

// After the vector body over v[0, i): merge its per-lane maxima (equal maxima: the lane
// holding the smaller index), then the scalar tail v[i, n) (a NaN there wins).
template <typename T>
inline int64_t finish(const float* vals, const int32_t* ids, int lanes, const T* v, int64_t i,
                      int64_t n) {
  float best = vals[0];
  int64_t at = ids[0];
  for (int l = 1; l < lanes; ++l)
    if (vals[l] > best || (vals[l] == best && ids[l] < at)) { best = vals[l]; at = ids[l]; }
  for (int64_t j = i; j < n; ++j)
    if (is_nan_bits(static_cast<float>(v[j]))) return j;
  return scan(v, i, n, best, at);
}

template <typename T>
int64_t argmax_row(const T* v, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    using V = kvray::Vec16;
    if (n >= 2 * V::kWidth) {
      // Per lane: the largest value seen and its first index (strict > keeps the first).
      __m512 mx = V::load(v);
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      __m512i cur = idx;
      const __m512i step = _mm512_set1_epi32(V::kWidth);
      __mmask16 nan = _mm512_cmp_ps_mask(mx, mx, _CMP_UNORD_Q);
      int64_t i = V::kWidth;
      for (; i + V::kWidth <= n; i += V::kWidth) {
        cur = _mm512_add_epi32(cur, step);
        const __m512 x = V::load(v + i);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(x, mx, _CMP_GT_OQ);
        mx = _mm512_mask_blend_ps(gt, mx, x);
        idx = _mm512_mask_blend_epi32(gt, idx, cur);
      }
      if (nan) return first_nan(v, n);
      alignas(64) float vals[16];
      alignas(64) int32_t ids[16];
      _mm512_store_ps(vals, mx);
      _mm512_store_si512(ids, idx);
      return finish(vals, ids, 16, v, i, n);
    }
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    using V = kvray::Vec8;
    if (n >= 2 * V::kWidth) {
      __m256 mx = V::load(v);
      __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      __m256i cur = idx;
      const __m256i step = _mm256_set1_epi32(V::kWidth);
      __m256 nan = _mm256_cmp_ps(mx, mx, _CMP_UNORD_Q);
      int64_t i = V::kWidth;
      for (; i + V::kWidth <= n; i += V::kWidth) {
        cur = _mm256_add_epi32(cur, step);
        const __m256 x = V::load(v + i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        const __m256 gt = _mm256_cmp_ps(x, mx, _CMP_GT_OQ);
        mx = _mm256_blendv_ps(mx, x, gt);
        idx = _mm256_blendv_epi8(idx, cur, _mm256_castps_si256(gt));
      }
      if (_mm256_movemask_ps(nan)) return first_nan(v, n);
      alignas(32) float vals[8];
      alignas(32) int32_t ids[8];
      _mm256_store_ps(vals, mx);
      _mm256_store_si256(reinterpret_cast<__m256i*>(ids), idx);
      return finish(vals, ids, 8, v, i, n);
    }
  }
#endif
  const int64_t nan_at = first_nan(v, n);
  if (nan_at >= 0) return nan_at;
  return scan(v, 1, n, static_cast<float>(v[0]), 0);
}

}  // namespace

at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "argmax_rows: x [B, V] with V > 0 and unit stride along V expected");
  TORCH_CHECK(x.size(1) < (int64_t{1} << 31), "argmax_rows: V must fit in int32");
  const int64_t B = x.size(0), V = x.size(1), stride = x.stride(0);
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const auto rows = [&](auto* xp) {
    // a row of the 49,152-token vocabulary is ~20 us: rows are the tasks
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) op[b] = argmax_row(xp + b * stride, V);
    });
  };
  switch (x.scalar_type()) {  // values compared as fp32: exact for these three dtypes
    case at::kFloat: rows(x.data_ptr<float>()); break;
    case at::kBFloat16: rows(x.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: rows(x.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "argmax_rows: fp32, bf16 or fp16 logits expected");
  }
  return out;
}
