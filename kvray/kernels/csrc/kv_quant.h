// The quantized paged KV cache's rows (kv_cache_dtype int8 / fp8; the layout and the
// PyTorch reference are in kvray/kernels/kv_quant.py): each (token, head) row of K or V is
// D one-byte codes then the 4 bytes of its fp32 scale, value = code * scale with
// scale = amax(|row|) / QMAX (1 for an all-zero row). Shared by write_kv (cpu_layer.cpp)
// and the paged decode and prefill kernels, which widen a block's rows into an fp32 buffer
// the size of a few KiB (L1) and run their fp32 code on it.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace kvray {

constexpr int64_t kScaleBytes = 4;

// Whether a cache of this dtype holds codes and per-row scales (int8, fp8 e4m3 / e5m2).
inline bool is_quantized_kv(c10::ScalarType t) {
  return t == c10::kChar || t == c10::kFloat8_e4m3fn || t == c10::kFloat8_e5m2;
}

// Cache element types holding codes and per-row scales.
template <typename T>
constexpr bool kQuantizedKV = std::is_same_v<T, int8_t> ||
                              std::is_same_v<T, c10::Float8_e4m3fn> ||
                              std::is_same_v<T, c10::Float8_e5m2>;

// The largest code: a row's largest |value| maps onto it.
template <typename T>
constexpr float kQmax = std::is_same_v<T, int8_t> ? 127.f
                        : std::is_same_v<T, c10::Float8_e4m3fn> ? 448.f : 57344.f;

// Elements of one cache row of head size D.
template <typename T>
constexpr int64_t row_width(int64_t D) {
  return kQuantizedKV<T> ? D + kScaleBytes : D;
}

template <typename T>
inline float row_scale(const T* row, int64_t D) {
  float s;
  std::memcpy(&s, reinterpret_cast<const char*>(row + D), sizeof(s));
  return s;
}

// One code widened to fp32, not yet scaled (fp8: c10's exact conversion).
template <typename T>
inline float code_to_float(T c) {
  return static_cast<float>(c);
}

#if defined(__AVX2__) && defined(__F16C__)
// Eight codes (8 bytes at p) as fp32 lanes times `s`. fp8 goes through fp16, whose
// conversion instruction is exact: e5m2 is the top byte of an fp16; e4m3's exponent and
// mantissa placed in an fp16 (bias 15, not 7) are the value times 2^-8, which the scale
// takes back (callers pass s * kFp8Rebias<T>).
template <typename T>
inline __m256 codes8(const T* p, __m256 s) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<T, int8_t>) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s);
  } else {
    const __m128i w = _mm_cvtepu8_epi16(b);
    __m128i h;
    if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
      h = _mm_slli_epi16(w, 8);
    } else {  // sign to bit 15, exponent and mantissa to bits 13..7
      h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                       _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7));
    }
    return _mm256_mul_ps(_mm256_cvtph_ps(h), s);
  }
}

template <typename T>
constexpr float kFp8Rebias = std::is_same_v<T, c10::Float8_e4m3fn> ? 256.f : 1.f;
#endif

// n rows of a block (row width D + 4) as fp32 values [n, D] in dst.
template <typename T>
inline void dequantize_rows(const T* __restrict__ src, int64_t n, int64_t D,
                            float* __restrict__ dst) {
  static_assert(kQuantizedKV<T>, "a quantized cache type");
  const int64_t width = D + kScaleBytes;
  for (int64_t t = 0; t < n; ++t) {
    const T* row = src + t * width;
    float* out = dst + t * D;
    const float s = row_scale(row, D);
    int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
    const __m256 sv = _mm256_set1_ps(s * kFp8Rebias<T>);
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(out + d, codes8(row + d, sv));
#endif
    for (; d < D; ++d) out[d] = code_to_float(row[d]) * s;
  }
}

// One row of D values (any type that converts to float) quantized into a cache row
// (D codes, then the scale). int8 codes round to nearest, ties to even (torch.round);
// fp8 codes are c10's round-to-nearest-even cast of the row over its scale.
template <typename T, typename TS>
inline void quantize_row(const TS* __restrict__ x, int64_t D, T* __restrict__ row) {
  static_assert(kQuantizedKV<T>, "a quantized cache type");
  constexpr float qmax = kQmax<T>;
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
  const float scale = amax > 0.f ? amax / qmax : 1.f;
  for (int64_t d = 0; d < D; ++d) {
    const float y = std::clamp(static_cast<float>(x[d]) / scale, -qmax, qmax);
    if constexpr (std::is_same_v<T, int8_t>) row[d] = static_cast<int8_t>(std::nearbyint(y));
    else row[d] = T(y);
  }
  std::memcpy(reinterpret_cast<char*>(row + D), &scale, sizeof(scale));
}

}  // namespace kvray
