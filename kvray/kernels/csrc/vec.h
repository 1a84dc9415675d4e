// Vector traits shared by kvray's CPU kernels: fp32 lanes, loaded from fp32, bf16 or int8
// codes and stored back to fp32 or bf16. The build is -march=native: AVX-512 machines get 16
// lanes, AVX2 ones 8; without AVX2 there is no vector code (the kernels keep scalar loops for
// that).
//
// bf16 is the top half of an fp32: widening is exact. Narrowing rounds to nearest even and
// maps NaN to 0x7fc0, bit for bit what c10::BFloat16's constructor does (not the AVX-512
// BF16 instruction, which flushes denormals), so vector and scalar tails agree.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvray {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace kvray

#ifdef __AVX2__
#include <immintrin.h>

namespace kvray {

struct Vec8 {
  using T = __m256;
  static constexpr int kWidth = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float v) { return _mm256_set1_ps(v); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const int8_t* p) {  // int8 codes (an int8 KV cache's), exactly
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static T load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  // v rounded to the nearest bf16 (ties to even; NaN -> 0x7fc0), still as fp32 lanes.
  static T round_bf16(T v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
        _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan));
  }
  static void store(c10::BFloat16* p, T v) {
    const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T neg_abs(T v) { return _mm256_or_ps(v, _mm256_set1_ps(-0.f)); }
  // lane-wise: a where v < 0 (its sign bit set), else b
  static T select_negative(T v, T a, T b) { return _mm256_blendv_ps(b, a, v); }
  static float sum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // e^x within ~2 ulp for normal results: +inf past ln(FLT_MAX), 0 or a denormal far
  // below; the scale 2^n is applied as two halves so that neither overflows on its own.
  // (A caller dividing by an infinite result under -ffast-math may get NaN: see silu.)
  static T exp(T x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.f)), _mm256_set1_ps(89.f));
    const T n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    T r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    T p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const T s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const T s2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  }
};

#ifdef __AVX512F__
struct Vec16 {
  using T = __m512;
  static constexpr int kWidth = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float v) { return _mm512_set1_ps(v); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const int8_t* p) {  // as Vec8's
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static T load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T round_bf16(T v) {  // as Vec8::round_bf16
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb),
        _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc00000)));
  }
  static void store(c10::BFloat16* p, T v) {
    const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T neg_abs(T v) {
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v),
                                               _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  }
  static T select_negative(T v, T a, T b) {
    return _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(_mm512_castps_si512(v), _mm512_setzero_si512()), b, a);
  }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
  static T exp(T x) {  // as Vec8::exp
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
    const T n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    T r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    T p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i ni = _mm512_cvtps_epi32(n), half = _mm512_srai_epi32(ni, 1);
    const __m512i bias = _mm512_set1_epi32(127);
    const T s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, bias), 23));
    const T s2 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(ni, half), bias), 23));
    return _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
  }
};
using Vec = Vec16;
#else
using Vec = Vec8;
#endif

// Head sizes the vector decode loops take: whole chunks of four vectors.
template <int64_t DK>
constexpr bool kVectorHead = DK > 0 && DK % (4 * Vec::kWidth) == 0;

// The lanes of v summed pairwise down to 8 (one AVX2 register).
inline __m256 to8(Vec::T v) {
#ifdef __AVX512F__
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
  return v;
#endif
}

// The 8 horizontal sums of a0..a7, as one vector [sum(a0), ..., sum(a7)]: one combined
// reduction instead of one per vector.
inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                   __m256 a6, __m256 a7) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                       _mm256_permute2f128_ps(h0, h1, 0x31));
}

// silu(g) = g * sigmoid(g), sigmoid from t = e^-|g| in (0, 1]: 1 / (1 + t) for g >= 0,
// t / (1 + t) below. Nothing overflows, which matters: under -ffast-math the compiler may
// turn the division into a reciprocal estimate and a Newton step, which makes NaN of 1 / inf.
// One function for silu_and_mul and the GEMM's fused epilogue: the same values from both.
template <typename V>
inline typename V::T silu(typename V::T g) {
  const typename V::T one = V::set1(1.f), t = V::exp(V::neg_abs(g));
  return V::mul(g, V::div(V::select_negative(g, t, one), V::add(one, t)));
}

// Logit soft-capping (Gemma 2): cap * tanh(x / cap), lane-wise. tanh(|y|) = (1 - t) / (1 + t)
// from t = e^(-2|y|) in (0, 1], with y's sign: nothing overflows (see silu), and t stops at
// e^-87 (tanh is 1 in fp32 long before; a denormal would cost a microcode assist per lane).
template <typename V>
inline typename V::T softcap(typename V::T x, float cap) {
  const typename V::T y = V::mul(x, V::set1(1.f / cap)), one = V::set1(1.f);
  const typename V::T t = V::exp(V::max(V::add(V::neg_abs(y), V::neg_abs(y)), V::set1(-87.f)));
  const typename V::T mag = V::mul(V::set1(cap), V::div(V::sub(one, t), V::add(one, t)));
  return V::select_negative(y, V::sub(V::zero(), mag), mag);
}

// v as a T would hold it: rounded to bf16 for bf16, unchanged for fp32.
template <typename V, typename T>
inline typename V::T as_stored(typename V::T v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return V::round_bf16(v);
  else return v;
}

}  // namespace kvray
#endif  // __AVX2__
