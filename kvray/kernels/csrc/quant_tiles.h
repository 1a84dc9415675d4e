// The tile kernels of cpu_quant.cpp's linear layers on quantized weights (its header
// comment says how they compute): dot_tile takes one tile of 8 weight rows (OneTile) or,
// with 512-bit VNNI, two (TwoTiles) against up to 4 rows of quantized activations, and
// dot_tiles a range of tiles against all rows.
#pragma once

#ifdef __AVX2__
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_format.h"

namespace {

// A segment as the kernel reads it.
struct SegView {
  const uint8_t* codes;
  const uint8_t* scales;
  const uint8_t* mins;  // null without mins
  const uint8_t* super_scales;
  const uint8_t* super_mins;
  int64_t tile_bytes, scale_tile_bytes, super_tile_bytes, group, super_group, rows;
  int32_t zero;
  bool signed_sub;  // two-level scales as int8 (else uint8)
};
// x rows m0.. of the quantized activations.
struct XView {
  const int8_t* q;    // [., Kp] codes
  const float* d;     // [., nb] block scales dx
  const float* gs;    // [., ng] sums of quantized x per group of this segment's size (mins)
  const int32_t* c;   // [., Kp / 16] -128 x the sums of the codes per 16 (S8 with VNNI)
  // Rows 8 g .. 8 g + 7 interleaved per block for the S8 pair kernel (dot_pair_s8x8), null
  // where it does not run: row r's codes of block b at q8[((g nb + b) 8 + r) 32], its dx
  // and its block's start (c) at d8 / c8[(g nb + b) 8 + r]. One pointer and constant
  // offsets serve the 8 rows (8 row pointers spill the general registers).
  const int8_t* q8;
  const float* d8;
  const int32_t* c8;
  int64_t Kp, nb, ng;
  // rows from m; the interleaved ones stay with the call's first row (m = 0)
  XView at(int64_t m) const {
    return {q + m * Kp, d + m * nb, gs ? gs + m * ng : nullptr, c + m * (Kp / 16),
            nullptr, nullptr, nullptr, Kp, nb, ng};
  }
};

inline __m256 cvt_half8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A tile's scales (or mins), the 8 rows' values group after group (groups are read in order):
// fp32, fp16, or 8-bit integers times the fp16 of their super-group (exact in fp32).
template <int Form>
class GroupLanes {
 public:
  GroupLanes() = default;
  GroupLanes(const uint8_t* p, const uint8_t* super, int64_t super_group, bool sign)
      : p_(p), super_(super), super_group_(super_group), sign_(sign) {}
  __m256 next() {
    if constexpr (Form == kFormF32) {
      const __m256 v = _mm256_loadu_ps(reinterpret_cast<const float*>(p_));
      p_ += 32;
      return v;
    } else if constexpr (Form == kFormF16) {
      const __m256 v = cvt_half8(p_);
      p_ += 16;
      return v;
    } else {
      if (left_ == 0) {
        super_v_ = cvt_half8(super_);
        super_ += 16, left_ = super_group_;
      }
      --left_;
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p_));
      p_ += 8;
      const __m256i v = sign_ ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
      return _mm256_mul_ps(_mm256_cvtepi32_ps(v), super_v_);
    }
  }

 private:
  const uint8_t* p_ = nullptr;
  const uint8_t* super_ = nullptr;
  int64_t super_group_ = 0, left_ = 0;
  bool sign_ = false;
  __m256 super_v_ = _mm256_setzero_ps();
};

// v as it stands, in a register: keeps the compiler from regrouping a chain of integer adds
// into a tree over every product at once (measured: the 32 products of a block for 4 x rows
// then spill to the stack, and the kernel runs at half speed).
inline void keep(__m256i& v) { asm("" : "+x"(v)); }

// 4 activation codes in every 32-bit lane.
inline __m256i x4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Part p's codes of a nibble kind's block: codes 4 p .. 4 p + 3 of each row (lo) and
// 4 p + 16 .. (hi), their high bits (U5, U6) taken from the planes after the nibbles.
template <int KD>
inline void unpack_part(const uint8_t* block, int p, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(0xF);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * p));
  lo = _mm256_and_si256(v, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  // 16-bit shifts pull bits across bytes only into positions the masks drop
  if constexpr (KD == kU5) {
    const __m256i pl = _mm256_srli_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128)), p);
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(pl, _mm256_set1_epi8(1)), 4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(pl, _mm256_set1_epi8(0x10)));
  } else if constexpr (KD == kU6) {
    const __m256i three = _mm256_set1_epi8(3);
    const __m256i a = _mm256_srli_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128)), 2 * p);
    const __m256i b = _mm256_srli_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 160)), 2 * p);
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(a, three), 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(b, three), 4));
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 512-bit vectors for the S8 kind: two parts of a block per instruction
#define KVRAY_VNNI512 1
#endif
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define KVRAY_VNNI 1
// acc + the sums of each lane's 4 products u8 x s8, exact in int32 (one instruction).
inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

#ifdef KVRAY_VNNI
// S8 with VNNI: dpbusd multiplies unsigned by signed bytes, so the codes are flipped to
// unsigned (w ^ 0x80 = w + 128) against x's signed codes, which adds 128 x the sum of x's
// codes over the parts; each row's sums start without it (x.c: -128 x x's sums per 16
// codes), the same exact sums in int32. One xor per part, shared by the x rows, and x's
// 4 codes a broadcast operand of the dpbusd itself.
// The start of an x row's sums over parts [P0, P1) of block b (parts 0-3: codes 0-15).
template <int P0, int P1>
inline int32_t s8_start(const XView& x, int m, int64_t b) {
  const int32_t* c = x.c + m * (x.Kp / 16) + 2 * b;
  return (P0 < 4 ? c[0] : 0) + (P1 > 4 ? c[1] : 0);
}
// acc + dot4(u, the 4 signed bytes at p in every lane), read by the dpbusd's own broadcast
// where EVEX has one: GCC emits a separate vpbroadcastd for a set1 operand (measured 1.18x
// slower at 256 rows on an EPYC Zen 4).
inline __m256i dot4_bcast(__m256i acc, __m256i u, const void* p) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*static_cast<const int32_t*>(p)));
  return acc;
#else
  return dot4(acc, u, x4(static_cast<const int8_t*>(p)));
#endif
}
#endif
#ifdef KVRAY_VNNI512
inline __m512i dot4_bcast(__m512i acc, __m512i u, const void* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(u), "m"(*static_cast<const int32_t*>(p)));
  return acc;
}

// The 8 weight rows' sums of a 512-bit accumulator: lanes 0-7 (even parts) + 8-15 (odd).
inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// x codes for a pair of S8 parts: lanes 0-7 bytes 0-3 of p, lanes 8-15 bytes 4-7.
inline __m512i x4_pair(const int8_t* p) {
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_permutexvar_epi32(
      idx, _mm512_castsi128_si512(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Per x row m, the int32 dot products [8 weight rows] of one tile's parts [P0, P1) of block
// b (nibble kinds: parts of 64 codes; S8: of 32) with x's codes. With VNNI each part and x
// row is one or two dpbusd into int32; else AVX2's maddubs into int16 (exact: see the
// bounds below), widened by madd. Both give the same exact sums.
template <int MR, int KD, int P0, int P1>
inline void part_sums(const uint8_t* block, const XView& x, int64_t b, __m256i (&sum)[MR]) {
#ifdef KVRAY_VNNI
  // two chains per row (even / odd products), added at the end: half the latency
  if constexpr (nibble_kind(KD)) {
    __m256i other[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) sum[m] = other[m] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int p = P0; p < P1; ++p) {
      __m256i lo, hi;
      unpack_part<KD>(block, p, lo, hi);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const int8_t* xq = x.q + m * x.Kp + kBlock * b + 8 * p;
        sum[m] = dot4(sum[m], lo, x4(xq));
        other[m] = dot4(other[m], hi, x4(xq + 4));
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) sum[m] = _mm256_add_epi32(sum[m], other[m]);
  } else {
    // the codes flipped against x's signed codes (s8_start)
#ifdef KVRAY_VNNI512
    // two parts per dpbusd, one per 256-bit half, folded at the end (measured 1.1-1.3x
    // faster than 256 bits from 16 rows on an EPYC Zen 5; the nibble kinds, whose unpacking
    // doubles with the width, were slower); the start in the low half only
    __m512i acc[MR], other[MR];
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      acc[m] = _mm512_zextsi256_si512(_mm256_set1_epi32(s8_start<P0, P1>(x, m, b)));
      other[m] = _mm512_setzero_si512();
    }
#pragma GCC unroll 4
    for (int p = P0; p < P1; p += 2) {
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(block + 32 * p), flip);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        __m512i& s = (p - P0) % 4 ? other[m] : acc[m];
        s = _mm512_dpbusd_epi32(s, w, x4_pair(x.q + m * x.Kp + kBlock * b + 4 * p));
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) sum[m] = fold(_mm512_add_epi32(acc[m], other[m]));
#else
    __m256i other[MR];
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      sum[m] = _mm256_set1_epi32(s8_start<P0, P1>(x, m, b));
      other[m] = _mm256_setzero_si256();
    }
#pragma GCC unroll 8
    for (int p = P0; p < P1; ++p) {
      const __m256i w = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * p)), flip);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        __m256i& s = (p - P0) % 2 ? other[m] : sum[m];
        s = dot4_bcast(s, w, x.q + m * x.Kp + kBlock * b + 4 * p);
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) sum[m] = _mm256_add_epi32(sum[m], other[m]);
#endif
  }
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (nibble_kind(KD)) {
    // U4: maddubs of 15 x 127 pairs, |.| <= 3810 per int16 lane, 8 of them (one block) < 2^15,
    // widened once; U5 / U6 (codes up to 63): a part's two maddubs reach 4 x 63 x 127 < 2^15,
    // widened at once
    __m256i s16[MR];
#pragma GCC unroll 4
    for (int p = P0; p < P1; ++p) {
      __m256i lo, hi;
      unpack_part<KD>(block, p, lo, hi);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const int8_t* xq = x.q + m * x.Kp + kBlock * b + 8 * p;
        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x4(xq)),
                                           _mm256_maddubs_epi16(hi, x4(xq + 4)));
        if constexpr (KD == kU4) {
          s16[m] = p == P0 ? t : _mm256_add_epi16(s16[m], t);
          keep(s16[m]);
        } else {
          const __m256i t32 = _mm256_madd_epi16(t, ones);
          sum[m] = p == P0 ? t32 : _mm256_add_epi32(sum[m], t32);
          keep(sum[m]);
        }
      }
    }
    if constexpr (KD == kU4) {
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) sum[m] = _mm256_madd_epi16(s16[m], ones);
    }
  } else {
    // |w| * x pairs reach 2 x 128 x 127: each part's int16 sums widen to int32 at once
#pragma GCC unroll 8
    for (int p = P0; p < P1; ++p) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * p));
      const __m256i wa = _mm256_abs_epi8(w);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const int8_t* xq = x.q + m * x.Kp + kBlock * b + 4 * p;
        const __m256i t = _mm256_madd_epi16(
            _mm256_maddubs_epi16(wa, _mm256_sign_epi8(x4(xq), w)), ones);
        sum[m] = p == P0 ? t : _mm256_add_epi32(sum[m], t);
        keep(sum[m]);
      }
    }
  }
#endif
}

// How far ahead of the block in hand the codes are fetched into L1: the hardware prefetcher
// alone leaves a one-row pass at ~60 % of the read bandwidth (three streams: codes, scales,
// mins); 4 KiB ahead (a tile or two) measured 1.3-1.5x faster on an EPYC Zen 5.
constexpr int64_t kPrefetchBytes = 4096;

template <int64_t Bytes>
inline void prefetch_ahead(const uint8_t* block) {
#pragma GCC unroll 4
  for (int64_t i = 0; i < Bytes; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + i), _MM_HINT_T0);
}

// The vector width dot_tile runs at: one tile's 8 weight rows in 256-bit vectors, or (512-bit
// VNNI) tiles t and t + 1 as 16 rows in 512-bit ones. Each lane's operations are the same at
// both widths, so a row's bits do not depend on which one computed it.
struct OneTile {
  static constexpr int64_t kTiles = 1;
  using F = __m256;
  using I = __m256i;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  template <int Form>
  static F next(GroupLanes<Form>* g) { return g[0].next(); }
  template <int MR, int KD, int P0, int P1>
  static void sums(const uint8_t* const* blocks, const XView& x, int64_t b, I (&sum)[MR]) {
    part_sums<MR, KD, P0, P1>(blocks[0], x, b, sum);
  }
};

#ifdef KVRAY_VNNI512
// Two tiles at once (16 weight rows, one per 32-bit lane of a 512-bit vector): a part's 32
// bytes of tile t and of tile t + 1 joined in one vector, against 4 x codes broadcast to
// every lane. Per x row that is one dpbusd per 16 rows and part with no shuffle of x (the
// S8 pairs of parts above permute x's codes per row and part); the joins and the S8 flip
// are shared by the MR x rows (TwoTiles, below).
inline __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                             _mm256_castps_pd(hi), 1));
}
inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
}
// 4 activation codes in every 32-bit lane of a 512-bit vector.
inline __m512i x16(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// unpack_part for the same part of two tiles' blocks a and b.
template <int KD>
inline void unpack_pair(const uint8_t* a, const uint8_t* b, int p, __m512i& lo, __m512i& hi) {
  const __m512i mask = _mm512_set1_epi8(0xF);
  const __m512i v = load_pair(a + 32 * p, b + 32 * p);
  lo = _mm512_and_si512(v, mask);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  if constexpr (KD == kU5) {
    const __m512i pl = _mm512_srli_epi16(load_pair(a + 128, b + 128), p);
    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(pl, _mm512_set1_epi8(1)), 4));
    hi = _mm512_or_si512(hi, _mm512_and_si512(pl, _mm512_set1_epi8(0x10)));
  } else if constexpr (KD == kU6) {
    const __m512i three = _mm512_set1_epi8(3);
    const __m512i lo2 = _mm512_srli_epi16(load_pair(a + 128, b + 128), 2 * p);
    const __m512i hi2 = _mm512_srli_epi16(load_pair(a + 160, b + 160), 2 * p);
    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(lo2, three), 4));
    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(hi2, three), 4));
  }
}

// part_sums for the 16 rows of blocks a (tile t) and b (tile t + 1).
template <int MR, int KD, int P0, int P1>
inline void part_sums16(const uint8_t* a, const uint8_t* b, const XView& x, int64_t blk,
                        __m512i (&sum)[MR]) {
  __m512i other[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) sum[m] = other[m] = _mm512_setzero_si512();
  if constexpr (nibble_kind(KD)) {
#pragma GCC unroll 4
    for (int p = P0; p < P1; ++p) {
      __m512i lo, hi;
      unpack_pair<KD>(a, b, p, lo, hi);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const int8_t* xq = x.q + m * x.Kp + kBlock * blk + 8 * p;
        sum[m] = _mm512_dpbusd_epi32(sum[m], lo, x16(xq));
        other[m] = _mm512_dpbusd_epi32(other[m], hi, x16(xq + 4));
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) sum[m] = _mm512_add_epi32(sum[m], other[m]);
  } else {
    // the codes flipped against x's signed codes (s8_start)
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) sum[m] = _mm512_set1_epi32(s8_start<P0, P1>(x, m, blk));
#pragma GCC unroll 8
    for (int p = P0; p < P1; ++p) {
      const __m512i w = _mm512_xor_si512(load_pair(a + 32 * p, b + 32 * p), flip);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        __m512i& s = (p - P0) % 2 ? other[m] : sum[m];
        s = dot4_bcast(s, w, x.q + m * x.Kp + kBlock * blk + 4 * p);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) sum[m] = _mm512_add_epi32(sum[m], other[m]);
  }
}

struct TwoTiles {
  static constexpr int64_t kTiles = 2;
  using F = __m512;
  using I = __m512i;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  template <int Form>
  static F next(GroupLanes<Form>* g) {
    const __m256 lo = g[0].next();
    return join(lo, g[1].next());
  }
  template <int MR, int KD, int P0, int P1>
  static void sums(const uint8_t* const* blocks, const XView& x, int64_t b, I (&sum)[MR]) {
    part_sums16<MR, KD, P0, P1>(blocks[0], blocks[1], x, b, sum);
  }
};
#endif  // KVRAY_VNNI512

// Tile t's scales (p, super: the segment's scales and super-scales) or mins (its mins and
// super-mins) as GroupLanes; pointers to nothing where the segment has none.
template <int Form>
inline GroupLanes<Form> tile_lanes(const SegView& s, const uint8_t* p, const uint8_t* super,
                                   int64_t t) {
  return GroupLanes<Form>(p ? p + t * s.scale_tile_bytes : nullptr,
                          super ? super + t * s.super_tile_bytes : nullptr, s.super_group,
                          s.signed_sub);
}

// A group's offset term at width L: its mins (the next of each tile's `mins`), less zero
// (the code offset, in every lane) times its scales sv.
template <class L, int Form>
inline typename L::F offset_term(const SegView& s, GroupLanes<Form>* mins, typename L::F sv,
                                 typename L::F zero) {
  const typename L::F mv = s.mins ? L::template next<Form>(mins) : L::zero();
  return s.zero ? L::fnmadd(sv, zero, mv) : mv;
}

// One x row's L::kTiles tiles of results, acc (+ bv: the bias where all lanes are valid),
// into out = y's row at weight row r0; only the first `valid` lanes where the segment ends.
template <class L>
inline void store_row(float* out, typename L::F acc, typename L::F bv, const float* bias,
                      int64_t r0, int64_t valid) {
  constexpr int64_t kRows = kTile * L::kTiles;
  if (valid == kRows) {
    L::storeu(out, L::add(acc, bv));
    return;
  }
  float lanes[kRows];
  L::storeu(lanes, acc);
  for (int64_t i = 0; i < valid; ++i) out[i] = lanes[i] + (bias ? bias[r0 + i] : 0.f);
}

// L::kTiles tiles from t of a segment against MR (1..4) rows of x: y[m * ldy + 8 t + lane]
// (+ bias), the rows past the segment's end left out. Offset: mins and/or a code offset.
template <int MR, int KD, bool G16, int Form, bool Offset, class L>
void dot_tile(const SegView& s, const XView& x, int64_t t, float* y, int64_t ldy,
              const float* bias) {
  using F = typename L::F;
  constexpr int64_t kBlockBytes = kTile * kBlock * code_bits(KD) / 8, kRows = kTile * L::kTiles;
  constexpr int kParts = nibble_kind(KD) ? 4 : 8;
  const uint8_t* codes[L::kTiles];
  GroupLanes<Form> scales[L::kTiles], mins[L::kTiles];
  for (int64_t i = 0; i < L::kTiles; ++i) {
    codes[i] = s.codes + (t + i) * s.tile_bytes;
    scales[i] = tile_lanes<Form>(s, s.scales, s.super_scales, t + i);
    mins[i] = tile_lanes<Form>(s, s.mins, s.super_mins, t + i);
  }
  const F zero = L::set1(static_cast<float>(s.zero));
  auto offset = [&](F sv) { return offset_term<L>(s, mins, sv, zero); };
  F acc[MR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) acc[m] = L::zero();
  typename L::I sum[MR];
  // acc[m] += float(sum[m]) * sv * dx[m, b]
  auto accumulate = [&](F sv, int64_t b) {
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m)
      acc[m] = L::fmadd(L::cvt(sum[m]), L::mul(sv, L::set1(x.d[m * x.nb + b])), acc[m]);
  };
  // acc[m] += mv * gs[m, g]: a group's mins (and - zero * scale) times its sum of x
  auto add_mins = [&](F mv, int64_t g) {
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) acc[m] = L::fmadd(mv, L::set1(x.gs[m * x.ng + g]), acc[m]);
  };
  const uint8_t* blocks[L::kTiles];
  auto at_block = [&](int64_t b) {
    for (int64_t i = 0; i < L::kTiles; ++i) {
      blocks[i] = codes[i] + b * kBlockBytes;
      prefetch_ahead<kBlockBytes>(blocks[i]);
    }
  };
  if constexpr (G16) {  // a scale (and offset) per half block
    for (int64_t b = 0; b < x.nb; ++b) {
      at_block(b);
      L::template sums<MR, KD, 0, kParts / 2>(blocks, x, b, sum);
      const F s0 = L::next(scales);
      accumulate(s0, b);
      if constexpr (Offset) add_mins(offset(s0), 2 * b);
      L::template sums<MR, KD, kParts / 2, kParts>(blocks, x, b, sum);
      const F s1 = L::next(scales);
      accumulate(s1, b);
      if constexpr (Offset) add_mins(offset(s1), 2 * b + 1);
    }
  } else {
    const int64_t per_group = s.group / kBlock;
    for (int64_t g = 0, b = 0; b < x.nb; ++g) {
      const F sv = L::next(scales);
      for (const int64_t end = b + per_group; b < end; ++b) {
        at_block(b);
        L::template sums<MR, KD, 0, kParts>(blocks, x, b, sum);
        accumulate(sv, b);
      }
      if constexpr (Offset) add_mins(offset(sv), g);
    }
  }
  const int64_t r0 = t * kTile, valid = std::min<int64_t>(kRows, s.rows - r0);
  const F bv = bias != nullptr && valid == kRows ? L::loadu(bias + r0) : L::zero();
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) store_row<L>(y + m * ldy + r0, acc[m], bv, bias, r0, valid);
}

#ifdef KVRAY_VNNI512
// Tiles t and t + 1 of an S8 segment (no offset, groups of whole blocks) against the 8 x
// rows of interleaved group g8 (XView::q8): dot_tile's TwoTiles work for 8 rows at once, a
// part's load, join and flip shared by all of them, and the same operations per row and lane
// (the same bits). On an EPYC Zen 4 (benchmarks/quant_kernels.py shapes, 16-256 rows) with
// the flip, against 4 rows a pass with x + 128 and the correction dpbusd: Q8_0 ~1.3x (with
// the flat loop below), int8 (one scale per row) 1.23-1.26x faster.
template <int Form>
void dot_pair_s8x8(const SegView& s, const XView& x, int64_t g8, int64_t t, float* y,
                   int64_t ldy, const float* bias) {
  using L = TwoTiles;
  using F = L::F;
  constexpr int64_t kBlockBytes = kTile * kBlock, kRows = 2 * kTile;
  // One flat loop over the blocks with every pointer stepped: group and block loops nested
  // recomputed ~20 addresses from spilled registers per group, i.e. per block for Q8_0
  // (1.11-1.19x).
  const int64_t base = g8 * x.nb * kRowsX;  // the group's first (block, row) entry
  const int8_t* q = x.q8 + base * kBlock;
  const float* d = x.d8 + base;
  const int32_t* c = x.c8 + base;
  const uint8_t* wa = s.codes + t * s.tile_bytes;
  const uint8_t* wb = wa + s.tile_bytes;
  GroupLanes<Form> scales[2] = {tile_lanes<Form>(s, s.scales, s.super_scales, t),
                                tile_lanes<Form>(s, s.scales, s.super_scales, t + 1)};
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  F acc[kRowsX];
#pragma GCC unroll 8
  for (int m = 0; m < kRowsX; ++m) acc[m] = L::zero();
  const int64_t per_group = s.group / kBlock;
  F sv = L::zero();
  for (int64_t b = 0, left = 0; b < x.nb; ++b) {
    if (left == 0) sv = L::next(scales), left = per_group;
    --left;
    prefetch_ahead<kBlockBytes>(wa);
    prefetch_ahead<kBlockBytes>(wb);
    __m512i sum[kRowsX];
#pragma GCC unroll 8
    for (int m = 0; m < kRowsX; ++m) sum[m] = _mm512_set1_epi32(c[m]);
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512i w = _mm512_xor_si512(load_pair(wa + 32 * p, wb + 32 * p), flip);
#pragma GCC unroll 8
      for (int m = 0; m < kRowsX; ++m) sum[m] = dot4_bcast(sum[m], w, q + m * kBlock + 4 * p);
    }
#pragma GCC unroll 8
    for (int m = 0; m < kRowsX; ++m)
      acc[m] = L::fmadd(L::cvt(sum[m]), L::mul(sv, L::set1(d[m])), acc[m]);
    wa += kBlockBytes, wb += kBlockBytes, q += kRowsX * kBlock, c += kRowsX, d += kRowsX;
  }
  const int64_t r0 = t * kTile, valid = std::min<int64_t>(kRows, s.rows - r0);
  const F bv = bias != nullptr && valid == kRows ? L::loadu(bias + r0) : L::zero();
#pragma GCC unroll 8
  for (int m = 0; m < kRowsX; ++m) store_row<L>(y + m * ldy + r0, acc[m], bv, bias, r0, valid);
}
#endif

// From how many x rows in a call tiles are taken two at a time (512-bit VNNI). On an EPYC
// Zen 4 (benchmarks/quant_kernels.py, Q4_1 / Q8_0 shapes of the built-in model, two runs)
// against a tile at a time: 1.06-1.12x faster at 16 rows, 1.18-1.27x at 32, 1.21-1.31x at
// 256; at 8 rows 0.89-1.12x, at 1-4 slower (reading the weight bounds those calls, and one
// tile's stream at a time reads faster).
constexpr int64_t kPairRows = 16;
// S8 (no offset) from 8 x rows: dot_pair_s8x8 reads each pair of tiles once for 8 rows,
// the rest of the call's rows then take two tiles at a time too (those tiles are in L2):
// 1.12-1.35x faster than a tile at a time at 8-15 rows on an EPYC Zen 4.
constexpr int64_t kPairRowsS8 = 8;

// Tiles [a, e) against MR rows of x: two at a time where the CPU has 512-bit VNNI and the
// call has kPairRows rows or more.
template <int MR, int KD, bool G16, int Form, bool Offset>
inline void tile_run(const SegView& s, const XView& x, int64_t a, int64_t e, float* y,
                     int64_t ldy, const float* bias, bool pairs) {
  int64_t t = a;
#ifdef KVRAY_VNNI512
  if (pairs)
    for (; t + 2 <= e; t += 2)
      dot_tile<MR, KD, G16, Form, Offset, TwoTiles>(s, x, t, y, ldy, bias);
#endif
  for (; t < e; ++t) dot_tile<MR, KD, G16, Form, Offset, OneTile>(s, x, t, y, ldy, bias);
}

// Tiles [t0, t1) of a segment against all M rows of x: stretches of tiles small enough to
// stay in L2 while every pass of 4 x rows goes over them.
template <int KD, bool G16, int Form, bool Offset>
void dot_tiles(const SegView& s, const XView& x, int64_t M, int64_t t0, int64_t t1, float* y,
               int64_t ldy, const float* bias) {
  // the first kPrefetchBytes of this range, which no block's prefetch_ahead asks for
  const uint8_t* first = s.codes + t0 * s.tile_bytes;
  const int64_t head = std::min(kPrefetchBytes, (t1 - t0) * s.tile_bytes);
  for (int64_t i = 0; i < head; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(first + i), _MM_HINT_T0);
  const int64_t stretch = std::max<int64_t>(2, 65536 / s.tile_bytes / 2 * 2);
  const bool pairs = M >= kPairRows || x.q8 != nullptr;
  for (int64_t a = t0; a < t1; a += stretch) {
    const int64_t e = std::min(t1, a + stretch);
    int64_t m = 0;
#ifdef KVRAY_VNNI512
    if constexpr (KD == kS8 && !G16 && !Offset)
      if (x.q8)
        for (; m + 8 <= M; m += 8) {
          int64_t t = a;
          for (; t + 2 <= e; t += 2) dot_pair_s8x8<Form>(s, x, m / 8, t, y + m * ldy, ldy, bias);
          for (int64_t h = m; h < m + 8; h += 4)  // an odd last tile
            tile_run<4, KD, G16, Form, Offset>(s, x.at(h), t, e, y + h * ldy, ldy, bias, pairs);
        }
#endif
    for (; m + 4 <= M; m += 4)
      tile_run<4, KD, G16, Form, Offset>(s, x.at(m), a, e, y + m * ldy, ldy, bias, pairs);
    float* ym = y + m * ldy;
    const XView xm = x.at(m);
    switch (M - m) {
      case 3: tile_run<3, KD, G16, Form, Offset>(s, xm, a, e, ym, ldy, bias, pairs); break;
      case 2: tile_run<2, KD, G16, Form, Offset>(s, xm, a, e, ym, ldy, bias, pairs); break;
      case 1: tile_run<1, KD, G16, Form, Offset>(s, xm, a, e, ym, ldy, bias, pairs); break;
      default: break;
    }
  }
}

}  // namespace
#endif  // __AVX2__
