// The quantized linears' large calls on Intel AMX (the tile matrix unit of Sapphire Rapids
// and later Xeons): amx_tiles takes the place of dot_tiles (quant_tiles.h) from kAmxRows x
// rows on, on CPUs with AMX-INT8 where Linux grants the tile registers.
//
// One tile multiply takes 16 x rows (A: their codes of one block, or half a block for groups
// of 16) against 16 weight rows, the tiles t and t + 1 of the blob (B), into 16 x 16 exact
// int32 sums (C): tdpbssd for S8 codes, tdpbsud (signed x, unsigned codes) for the nibble
// kinds. The blob's codes are not in B's layout (4 consecutive codes of each of 16 weight rows
// per 64-byte row; the nibble kinds packed), so each pair of tiles is unpacked once per call
// into a panel of B tiles in L1/L2, then every 16 x rows run over it. Each block's C is
// stored and scaled exactly as dot_tile's TwoTiles does it (the same fma per lane, the blocks
// and the mins in the same order), so a row's bits do not depend on which kernel computed
// it: greedy tokens stay the same whatever the batch.
//
// A block's sums have to leave the tile unit for their scales, so the float work per block
// (a load, convert, multiply and fma per x row and 16 weight rows; the mins' fma on top)
// bounds it, not the multiplies. Running the tile unit two steps ahead of that float work
// (four C buffers) measured the same.
#pragma once

#include "quant_tiles.h"

#if defined(__AVX2__) && defined(KVRAY_VNNI512) && defined(__AMX_TILE__) && \
    defined(__AMX_INT8__)
#define KVRAY_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

namespace {

// From how many x rows a call takes the tile unit. On a 2-core Xeon (Emerald Rapids), every
// linear of 6 layers of the built-in model's shapes against dot_tiles (two runs): Q4_1
// 1.27-1.46x at 16 rows, 1.55-1.63x at 32, 1.58-1.70x at 64; Q8_0 1.59-1.68x, 1.75-1.93x,
// 2.17-2.28x; Q6_K (groups of 16: twice the float work per code) 1.08-1.26x, 1.28-1.45x,
// 1.31-1.45x. Fewer rows than 16 pad the A tile and pay for 16.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxM = 16;  // x rows per A tile; calls pad x to a multiple of it

// Whether this process may use the tile registers: Linux grants them on request
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); KVRAY_AMX=0 turns the route off
// (benchmarks compare the two kernels with it).
inline bool amx_enabled() {
  static const bool ok = [] {
    const char* env = std::getenv("KVRAY_AMX");
    if (env != nullptr && env[0] == '0') return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: C (16 x rows x 16 weight rows, int32); tmm2, tmm3: A (16 x rows x KS codes);
// tmm4, tmm5: B (KS / 4 rows of 4 codes for each of 16 weight rows). Two of each: two steps
// in flight.
template <int KS>
inline void configure_tiles() {
  TileConfig c;
  for (int i : {0, 1}) c.rows[i] = kAmxM, c.colsb[i] = 64;
  for (int i : {2, 3}) c.rows[i] = kAmxM, c.colsb[i] = KS;
  for (int i : {4, 5}) c.rows[i] = KS / 4, c.colsb[i] = 64;
  // GCC does not see ldtilecfg read the struct and may drop stores to it as dead (it
  // dropped the column widths once): make them happen first
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// Tiles a and b's codes (8 weight rows each) as B tiles: [Kp / 4 rows][16 weight rows][4
// codes], a's rows in columns 0-7, b's in 8-15.
template <int KD>
void pack_pair(const uint8_t* a, const uint8_t* b, int64_t nb, uint8_t* out) {
  constexpr int64_t kBlockBytes = kTile * kBlock * code_bits(KD) / 8;
  for (int64_t blk = 0; blk < nb; ++blk, a += kBlockBytes, b += kBlockBytes, out += 512) {
    if constexpr (nibble_kind(KD)) {  // part p: codes 8p..8p+3 (lo) and 8p+4..8p+7 (hi)
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        __m512i lo, hi;
        unpack_pair<KD>(a, b, p, lo, hi);
        _mm512_store_si512(out + 128 * p, lo);
        _mm512_store_si512(out + 128 * p + 64, hi);
      }
    } else {  // part p: codes 4p..4p+3
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p)
        _mm512_store_si512(out + 64 * p, load_pair(a + 32 * p, b + 32 * p));
    }
  }
}

// One step's C (16 x rows x 16 weight rows) into buf: zeroed, then the products of x's codes
// [k, k + KS) with the panel's. (GCC's tile intrinsics paste their register numbers into
// the instruction's text, so the numbers are literals, one function per set.)
#define KVRAY_STEP_PRODUCT(NAME, C, A, B)                                             \
  template <int KD>                                                                   \
  inline void NAME(const int8_t* xq, int64_t ldx, const uint8_t* panel, int32_t* buf) { \
    _tile_zero(C);                                                                    \
    _tile_loadd(A, xq, ldx);                                                          \
    _tile_loadd(B, panel, 64);                                                        \
    if constexpr (nibble_kind(KD)) {                                                  \
      _tile_dpbsud(C, A, B);                                                          \
    } else {                                                                          \
      _tile_dpbssd(C, A, B);                                                          \
    }                                                                                 \
    _tile_stored(C, buf, 64);                                                         \
  }
KVRAY_STEP_PRODUCT(step_product0, 0, 2, 4)
KVRAY_STEP_PRODUCT(step_product1, 1, 3, 5)
#undef KVRAY_STEP_PRODUCT

// Tiles [t0, t1) of a segment against all M rows of x (padded with zero rows to a multiple
// of kAmxM): dot_tiles' result, bit for bit.
template <int KD, bool G16, int Form, bool Offset>
void amx_tiles(const SegView& s, const XView& x, int64_t M, int64_t t0, int64_t t1, float* y,
               int64_t ldy, const float* bias) {
  using L = TwoTiles;
  using F = __m512;
  constexpr int KS = G16 ? 16 : 32;  // codes per step: one scale each
  const int64_t steps = x.Kp / KS, per_group = G16 ? 1 : s.group / KS;
  thread_local std::vector<uint8_t> storage;
  storage.resize(static_cast<size_t>(x.Kp * 16 + 64));
  uint8_t* panel = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  alignas(64) int32_t cbuf[2][kAmxM * 16];
  configure_tiles<KS>();
  const F zero = L::set1(static_cast<float>(s.zero));
  for (int64_t t = t0; t < t1; t += 2) {
    const int64_t u = t + 1 < t1 ? t + 1 : t;  // a lone last tile pairs with itself
    pack_pair<KD>(s.codes + t * s.tile_bytes, s.codes + u * s.tile_bytes, x.nb, panel);
    const int64_t r0 = t * kTile;
    const int64_t valid = std::min<int64_t>(u == t ? kTile : 2 * kTile, s.rows - r0);
    for (int64_t m0 = 0; m0 < M; m0 += kAmxM) {
      GroupLanes<Form> scales[2], mins[2];
      for (int i = 0; i < 2; ++i) {
        scales[i] = tile_lanes<Form>(s, s.scales, s.super_scales, i ? u : t);
        mins[i] = tile_lanes<Form>(s, s.mins, s.super_mins, i ? u : t);
      }
      const XView xm = x.at(m0);
      F acc[kAmxM];
#pragma GCC unroll 16
      for (int m = 0; m < kAmxM; ++m) acc[m] = L::zero();
      F sv = L::zero();
      // a step's sums scaled into acc (TwoTiles' accumulate), then the group's offset term
      // where the step ends a group (its add_mins)
      auto finish = [&](const int32_t* c, int64_t step) {
        const int64_t b = step * KS / kBlock;
        if (step % per_group == 0) sv = L::next(scales);
#pragma GCC unroll 16
        for (int m = 0; m < kAmxM; ++m) {
          const __m512i sum = _mm512_load_si512(c + 16 * m);
          acc[m] = L::fmadd(L::cvt(sum), L::mul(sv, L::set1(xm.d[m * x.nb + b])), acc[m]);
        }
        if constexpr (Offset) {
          if ((step + 1) % per_group == 0) {
            const int64_t g = step / per_group;
            const F ov = offset_term<L>(s, mins, sv, zero);
#pragma GCC unroll 16
            for (int m = 0; m < kAmxM; ++m)
              acc[m] = L::fmadd(ov, L::set1(xm.gs[m * x.ng + g]), acc[m]);
          }
        }
      };
      int64_t step = 0;
      for (; step + 2 <= steps; step += 2) {
        step_product0<KD>(xm.q + step * KS, x.Kp, panel + step * KS * 16, cbuf[0]);
        step_product1<KD>(xm.q + (step + 1) * KS, x.Kp, panel + (step + 1) * KS * 16,
                                  cbuf[1]);
        finish(cbuf[0], step);
        finish(cbuf[1], step + 1);
      }
      if (step < steps) {
        step_product0<KD>(xm.q + step * KS, x.Kp, panel + step * KS * 16, cbuf[0]);
        finish(cbuf[0], step);
      }
      const F bv = bias != nullptr && valid == 2 * kTile ? L::loadu(bias + r0) : L::zero();
      const int64_t rows = std::min<int64_t>(kAmxM, M - m0);
#pragma GCC unroll 16
      for (int m = 0; m < kAmxM; ++m) {  // unrolled: acc stays in registers
        if (m >= rows) break;
        store_row<L>(y + (m0 + m) * ldy + r0, acc[m], bv, bias, r0, valid);
      }
    }
  }
  _tile_release();
}

}  // namespace
#endif  // KVRAY_AMX
