// Paged decode attention's inner loops over an int8 KV cache, reading the codes in place (the
// one-pass loop of cpu_paged_attention.cpp calls them for head sizes 64 and 128).
//
// Scores in integers: each scaled query row rounded to int16 codes with a scale of its own
// (amax / 32767: 2^-16 of its largest element, a hundredth of the keys' own int8 step;
// kvray/kernels/kv_quant.py: round_query_rows is the reference), the keys' codes widened to
// int16 in registers and multiplied pairwise into int32 lanes (vpdpwssd with AVX-512 VNNI,
// vpmaddwd + add without it or with AVX2 only; a lane sums D / W products of at most
// 32767 * 127, far from overflowing), then one multiply by the two scales. The values: the
// fp32 loop (block_values_vec) reading the codes, each row's scale folded into its softmax
// weight (value_weights).
// Widening a block to an fp32 buffer and running the fp32 loops on it cost about three
// times the instructions per key, which bounded the loop rather than its reads: reading
// codes in place took the kernel to 0.66-0.70x of that time with AVX-512 VNNI, 0.86x in an
// AVX2 build (48 sequences x 200 tokens, 9 query / 3 KV heads of 64, 2-core AMX Xeon;
// with only the scores in integers 0.85-0.88x).
#pragma once

#include "kv_quant.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && (!defined(__AVX512F__) || defined(__AVX512BW__))
#define KVRAY_INT8_DOT 1
#include <immintrin.h>

namespace kvray {

// The largest int16 code of a query row (kv_quant.py: QUERY_CODE_MAX).
constexpr float kQueryCodeMax = 32767.f;

// int16 lanes multiplied pairwise into int32 lanes, as many int32 lanes as Vec has floats.
struct IntDot {
#ifdef __AVX512F__
  using I = __m512i;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const int16_t* p) { return _mm512_loadu_si512(p); }
  static I widen(const int8_t* p) {  // 32 codes
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static I dot(I acc, I a, I b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
  }
  static Vec::T to_float(I a) { return _mm512_cvtepi32_ps(a); }
#else
  using I = __m256i;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const int16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static I widen(const int8_t* p) {  // 16 codes
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static I dot(I acc, I a, I b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  static Vec::T to_float(I a) { return _mm256_cvtepi32_ps(a); }
#endif
  static constexpr int64_t kCodes = 2 * Vec::kWidth;  // int16 lanes of one I
};

// The scaled fp32 query rows as int16 codes qi[g * DK + d] and their scales qs[g], as
// round_query_rows: x * (1 / scale) rounded to nearest even.
template <int64_t DK>
inline void query_codes(const float* __restrict__ qf, int64_t G, int16_t* __restrict__ qi,
                        float* __restrict__ qs) {
  for (int64_t g = 0; g < G; ++g) {
    const float* x = qf + g * DK;
    float amax = 0.f;
    for (int64_t d = 0; d < DK; ++d) amax = std::max(amax, std::fabs(x[d]));
    const float scale = amax > 0.f ? amax / kQueryCodeMax : 1.f, inv = 1.f / scale;
    for (int64_t d = 0; d < DK; ++d)
      qi[g * DK + d] = static_cast<int16_t>(
          std::clamp(std::nearbyint(x[d] * inv), -kQueryCodeMax - 1.f, kQueryCodeMax));
    qs[g] = scale;
  }
}

// The integer dot products of one query row's codes with eight keys' codes (rows of RW
// bytes), as floats, to s[0..8).
template <int64_t DK>
inline void scores8_int8(const int16_t* __restrict__ qi, const int8_t* __restrict__ k,
                         int64_t RW, float* __restrict__ s) {
  using D = IntDot;
  D::I a0 = D::zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < DK; d += D::kCodes) {
    const D::I q = D::load(qi + d);
    a0 = D::dot(a0, q, D::widen(k + 0 * RW + d));
    a1 = D::dot(a1, q, D::widen(k + 1 * RW + d));
    a2 = D::dot(a2, q, D::widen(k + 2 * RW + d));
    a3 = D::dot(a3, q, D::widen(k + 3 * RW + d));
    a4 = D::dot(a4, q, D::widen(k + 4 * RW + d));
    a5 = D::dot(a5, q, D::widen(k + 5 * RW + d));
    a6 = D::dot(a6, q, D::widen(k + 6 * RW + d));
    a7 = D::dot(a7, q, D::widen(k + 7 * RW + d));
  }
  const auto f = [](D::I a) { return to8(D::to_float(a)); };
  _mm256_storeu_ps(s, sum8(f(a0), f(a1), f(a2), f(a3), f(a4), f(a5), f(a6), f(a7)));
}

// Scores of G query rows (int16 codes qi, scales qs) against the n_t keys of an int8 block,
// eight keys at a time, to s[g * stride + t]; ks: room for n_t floats (the keys' scales).
template <int64_t DK>
inline void block_scores_int8(const int16_t* __restrict__ qi, const float* __restrict__ qs,
                              const int8_t* __restrict__ kb, int64_t n_t, int64_t G,
                              float* __restrict__ ks, float* __restrict__ s, int64_t stride) {
  using D = IntDot;
  constexpr int64_t RW = DK + kScaleBytes;
  for (int64_t t = 0; t < n_t; ++t) ks[t] = row_scale(kb + t * RW, DK);
  const int64_t full = n_t / 8 * 8;
  for (int64_t t = 0; t < full; t += 8)
    for (int64_t g = 0; g < G; ++g)
      scores8_int8<DK>(qi + g * DK, kb + t * RW, RW, s + g * stride + t);
  for (int64_t t = full; t < n_t; ++t)  // the block's last 1-7 keys, one at a time
    for (int64_t g = 0; g < G; ++g) {
      D::I a = D::zero();
      for (int64_t d = 0; d < DK; d += D::kCodes)
        a = D::dot(a, D::load(qi + g * DK + d), D::widen(kb + t * RW + d));
      s[g * stride + t] = Vec::sum(D::to_float(a));
    }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = 0; t < n_t; ++t) s[g * stride + t] *= qs[g] * ks[t];
}

// w[g * stride + t] = p[g * stride + t] * the scale of value row t, for G query rows over the
// n_t rows of an int8 value block: the weights block_values_vec multiplies the codes by.
template <int64_t DK>
inline void value_weights(const float* __restrict__ p, const int8_t* __restrict__ vb,
                          int64_t n_t, int64_t G, int64_t stride, float* __restrict__ w) {
  constexpr int64_t RW = DK + kScaleBytes;
  for (int64_t t = 0; t < n_t; ++t) {
    const float sc = row_scale(vb + t * RW, DK);
    for (int64_t g = 0; g < G; ++g) w[g * stride + t] = p[g * stride + t] * sc;
  }
}

}  // namespace kvray
#endif
