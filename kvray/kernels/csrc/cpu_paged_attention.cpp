// CPU paged decode attention for kvray (built by kvray/kernels/cpu_ops.py).
// Reads K/V straight from the paged cache [2, Hk, num_blocks, block_size, D], parallel over
// (sequence, kv head). q is the cache's dtype, or fp32 over a bf16/fp16 cache (the fused
// decode layer of a bf16 model keeps its activations in fp32); the output has q's dtype.
// An int8 / fp8 cache ([..., D + 4]: codes and a scale per row, kv_quant.h) takes fp32,
// bf16 or fp16 q; each block is widened to fp32 in L1 and read by the fp32 code, except an
// int8 cache with head sizes 64 and 128, whose codes the one-pass loop reads in place
// (decode_int8.h: integer scores against each query row rounded to int16 codes).
// Head sizes 64 and 128 over fp32 or bf16 caches (bf16 widened in registers) run vector code
// (vec.h: 16 lanes with AVX-512, 8 with AVX2) in one pass per item (decode_one_pass: each
// block's scores, then its values, under a running max), the next block prefetched while
// one is used: decode attention waits on memory. Other cases (fp16 caches, through a
// converted copy; other head sizes; builds without AVX2) take two passes (decode_impl: all
// K for the scores, a softmax, all V), blocks prefetched ~16 KiB ahead. AVX2 code with each
// bf16 block converted into a buffer, one block prefetched ahead, was 1.3x the plain loops
// in a 64-sequence bf16 decode step on a 2-core AMX Xeon (11.6-11.9 -> 8.7-9.4 ms of
// ~50 ms); the numbers for the current code are in benchmarks/RESULTS.md.
// A soft cap (Gemma 2's attn_logit_softcapping; 0: none) turns each scaled score s into
// cap * tanh(s / cap) before the softmax, on every path.
#include "ops.h"

#include <ATen/Parallel.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode_int8.h"
#include "kv_quant.h"
#include "vec.h"

// Whether decode reads a cache of T codes in place (decode_int8.h) for head size DK.
#ifdef KVRAY_INT8_DOT
template <typename T, int64_t DK>
constexpr bool kReadsCodes = std::is_same_v<T, int8_t> && kvray::kVectorHead<DK>;
#else
template <typename T, int64_t DK>
constexpr bool kReadsCodes = false;
#endif

static inline float to_f(float x) { return x; }
static inline float to_f(c10::Half x) { return static_cast<float>(x); }
static inline float to_f(c10::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;  // bf16 is the top half of an fp32
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Convert one block (n_t rows of D) to fp32 once, so each of the G query heads that share
// this KV head reads floats.
template <typename T, int64_t DK>
static inline void to_float_block(const T* __restrict__ src, int64_t n, int64_t D_,
                                  float* __restrict__ dst) {
  const int64_t total = n * (DK > 0 ? DK : D_);
  int64_t i = 0;
#ifdef __AVX2__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // widen 8 at a time: the top halves
    for (; i + 8 <= total; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(dst + i,
                       _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
  }
#endif
  for (; i < total; ++i) dst[i] = to_f(src[i]);
}

// How far ahead of its use each K/V block is prefetched. Decode attention waits on memory
// (blocks of 2-4 KiB scattered over the cache): on a 2-core AVX-512 Xeon, without software
// prefetch it ran 1.15-1.4x slower; 4 KiB ahead and 16 KiB ahead were about even.
constexpr int64_t kPrefetchAhead = 16384;

static inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// One block as fp32: an fp32 cache's own memory, else converted (a quantized cache's
// codes times their row's scale) into `buf`.
template <typename T, int64_t DK>
static inline const float* as_float_block(const T* src, int64_t n, int64_t D_, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (kvray::kQuantizedKV<T>) {
    kvray::dequantize_rows(src, n, DK > 0 ? DK : D_, buf);
    return buf;
  } else {
    to_float_block<T, DK>(src, n, D_, buf);
    return buf;
  }
}

// Scores of G query rows against one block's n_t keys (fp32 [n_t, D]), to s[g * stride + t].
template <int64_t DK>
static inline void block_scores(const float* __restrict__ qf, const float* __restrict__ kb,
                                int64_t n_t, int64_t G, int64_t D_, float* __restrict__ s,
                                int64_t stride) {
  const int64_t D = DK > 0 ? DK : D_;
  for (int64_t t = 0; t < n_t; ++t) {
    const float* k = kb + t * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];
      s[g * stride + t] = acc;
    }
  }
}

#ifdef __AVX2__
using kvray::sum8;
using kvray::to8;
using kvray::Vec;
using kvray::kVectorHead;

// K or V blocks the vector code reads in place: fp32, or bf16 widened in registers.
template <typename T>
constexpr bool kReadsInPlace = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// Scores of one query row (fp32) against eight keys of head size DK (T: fp32 or bf16), to
// s[0..8): eight accumulators (named: GCC keeps them in registers), one combined horizontal
// sum instead of one per key.
template <int64_t DK, typename T>
static inline void scores8(const float* __restrict__ qg, const T* __restrict__ k,
                           float* __restrict__ s) {
  constexpr int W = Vec::kWidth;
  Vec::T a0 = Vec::zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < DK; d += W) {
    const Vec::T q = Vec::load(qg + d);
    a0 = Vec::fma(q, Vec::load(k + 0 * DK + d), a0);
    a1 = Vec::fma(q, Vec::load(k + 1 * DK + d), a1);
    a2 = Vec::fma(q, Vec::load(k + 2 * DK + d), a2);
    a3 = Vec::fma(q, Vec::load(k + 3 * DK + d), a3);
    a4 = Vec::fma(q, Vec::load(k + 4 * DK + d), a4);
    a5 = Vec::fma(q, Vec::load(k + 5 * DK + d), a5);
    a6 = Vec::fma(q, Vec::load(k + 6 * DK + d), a6);
    a7 = Vec::fma(q, Vec::load(k + 7 * DK + d), a7);
  }
  _mm256_storeu_ps(s, sum8(to8(a0), to8(a1), to8(a2), to8(a3), to8(a4), to8(a5), to8(a6),
                           to8(a7)));
}

// Scores of G query rows (fp32) against n_t keys of head size DK (T: fp32 or bf16), eight
// keys at a time per query row. With 8 lanes the rows are the outer loop: with the keys
// outer, GCC hoists the eight keys' loads out of the rows' loop (64 vectors for a head of
// 64) and spills them to the stack, 64 stores per eight keys; rows outer re-read the block
// from L1 instead. On a 2-core Zen 3 EPYC (fp32, 30 layers' caches, 260 tokens per
// sequence, blocks shuffled, alternating in one process): 0.87x the time at 64 sequences
// (100 vs 115 ms, median of 9), 0.83-0.85x at 16; two earlier runs under other load
// 0.76-1.00x. AVX-512 keeps the keys outer (not measured there).
template <int64_t DK, typename T>
static inline void block_scores_vec(const float* __restrict__ qf, const T* __restrict__ kb,
                                    int64_t n_t, int64_t G, float* __restrict__ s,
                                    int64_t stride) {
  constexpr int W = Vec::kWidth;
  const int64_t full = n_t / 8 * 8;
  if constexpr (W == 8) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t t = 0; t < full; t += 8)
        scores8<DK>(qf + g * DK, kb + t * DK, s + g * stride + t);
  } else {
    for (int64_t t = 0; t < full; t += 8)
      for (int64_t g = 0; g < G; ++g)
        scores8<DK>(qf + g * DK, kb + t * DK, s + g * stride + t);
  }
  int64_t t = full;
  for (; t < n_t; ++t) {  // the block's last 1-7 keys, one at a time
    const T* k = kb + t * DK;
    for (int64_t g = 0; g < G; ++g) {
      Vec::T a = Vec::zero();
      for (int64_t d = 0; d < DK; d += W)
        a = Vec::fma(Vec::load(qf + g * DK + d), Vec::load(k + d), a);
      s[g * stride + t] = Vec::sum(a);
    }
  }
}

// Query rows that block_values_vec takes together: each value vector loaded once feeds
// kRowsTogether rows' FMAs (3 x 4 accumulators of the 32 AVX-512 registers, 2 x 4 of the 16
// AVX2 ones) and the rows' accumulator chains hide the FMA latency between tokens.
constexpr int kRowsTogether = Vec::kWidth == 16 ? 3 : 2;

// acc[g] += sum_t p[g, t] * v[t] for R (1..kRowsTogether) query rows from g0, over n_t
// values of head size DK (T: fp32 or bf16), per 4 * W dims: the rows' outputs in 4 * R
// registers, loaded and stored once per block.
template <int64_t DK, int R, typename T>
static inline void block_values_rows(const float* __restrict__ p, const T* __restrict__ vb,
                                     int64_t n_t, float* __restrict__ acc, int64_t stride) {
  constexpr int W = Vec::kWidth;
  for (int64_t d = 0; d < DK; d += 4 * W) {
    Vec::T c[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) c[r][u] = Vec::load(acc + r * DK + d + u * W);
    for (int64_t t = 0; t < n_t; ++t) {
      const T* v = vb + t * kvray::row_width<T>(DK) + d;  // an int8 row: codes, then a scale
      const Vec::T v0 = Vec::load(v), v1 = Vec::load(v + W), v2 = Vec::load(v + 2 * W),
                   v3 = Vec::load(v + 3 * W);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const Vec::T w = Vec::set1(p[r * stride + t]);
        c[r][0] = Vec::fma(w, v0, c[r][0]);
        c[r][1] = Vec::fma(w, v1, c[r][1]);
        c[r][2] = Vec::fma(w, v2, c[r][2]);
        c[r][3] = Vec::fma(w, v3, c[r][3]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) Vec::store(acc + r * DK + d + u * W, c[r][u]);
  }
}

// acc[g] += sum_t p[g, t] * v[t] for G query rows over n_t values of head size DK.
template <int64_t DK, typename T>
static inline void block_values_vec(const float* __restrict__ p, const T* __restrict__ vb,
                                    int64_t n_t, int64_t G, float* __restrict__ acc,
                                    int64_t stride) {
  int64_t g = 0;
  for (; g + kRowsTogether <= G; g += kRowsTogether)
    block_values_rows<DK, kRowsTogether>(p + g * stride, vb, n_t, acc + g * DK, stride);
  switch (G - g) {
    case 2: block_values_rows<DK, 2>(p + g * stride, vb, n_t, acc + g * DK, stride); break;
    case 1: block_values_rows<DK, 1>(p + g * stride, vb, n_t, acc + g * DK, stride); break;
    default: break;
  }
}
#endif

template <int64_t DK>
static inline void block_values(const float* __restrict__ p, const float* __restrict__ vb,
                                int64_t n_t, int64_t G, int64_t D_, float* __restrict__ acc,
                                int64_t stride) {
  const int64_t D = DK > 0 ? DK : D_;
  for (int64_t t = 0; t < n_t; ++t) {
    const float* v = vb + t * D;
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * stride + t];
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
    }
  }
}

static inline void softmax_rows(float* s, int64_t G, int64_t n) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) { sg[i] = std::exp(sg[i] - mx); sum += sg[i]; }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
  }
}

// n scores soft-capped in place: cap * tanh(s / cap), cap > 0.
static inline void cap_scores(float* s, int64_t n, float cap) {
  int64_t t = 0;
#ifdef __AVX2__
  for (; t + kvray::Vec::kWidth <= n; t += kvray::Vec::kWidth)
    kvray::Vec::store(s + t, kvray::softcap<kvray::Vec>(kvray::Vec::load(s + t), cap));
#endif
  for (; t < n; ++t) s[t] = cap * std::tanh(s[t] / cap);
}

// Scores of G query rows against one block's n_t keys (fp32), by the vector code where the
// head size takes it, then soft-capped when cap > 0.
template <int64_t DK>
static inline void score_block(const float* qf, const float* kb, int64_t n_t, int64_t G,
                               int64_t D, float* s, int64_t stride, float cap) {
#ifdef __AVX2__
  if constexpr (kVectorHead<DK>) block_scores_vec<DK>(qf, kb, n_t, G, s, stride);
  else block_scores<DK>(qf, kb, n_t, G, D, s, stride);
#else
  block_scores<DK>(qf, kb, n_t, G, D, s, stride);
#endif
  if (cap > 0)
    for (int64_t g = 0; g < G; ++g) cap_scores(s + g * stride, n_t, cap);
}

template <typename TQ, typename T, int64_t DK>
static void decode_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                        const at::Tensor& seq_lens, double scale, int64_t window, float cap,
                        at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hk = kv.size(1), NB = kv.size(2), BS = kv.size(3);
  const int64_t G = Hq / Hk, max_blocks = tables.size(1), RW = kvray::row_width<T>(D);
  const TQ* qp = q.data_ptr<TQ>();
  const T* kp = kv.data_ptr<T>();
  const T* vp = kp + Hk * NB * BS * RW;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  TQ* op = out.data_ptr<TQ>();
  // (sequence, kv head) items in chunks the threads take one at a time: a static split
  // would leave the step waiting for a thread that lost its core.
  const int64_t items = B * Hk;
  parallel_dynamic(items, chunk_for_threads(items), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), buf(BS * D), scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hk, h = idx % Hk, len = lp[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      // Whole blocks from the one holding `start`; positions before it are masked below.
      const int64_t first = start / BS, last = (len + BS - 1) / BS;
      const int64_t n = (last - first) * BS;
      scores.assign(G * n, -std::numeric_limits<float>::infinity());
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f(qp[(b * Hq + h * G + g) * D + d]) * static_cast<float>(scale);
      // Blocks sit anywhere in the cache (the hardware prefetcher does not cross into the
      // next one): the item's K blocks, then its V blocks, then the next item's first K
      // blocks are fetched about kPrefetchAhead bytes before they are used.
      const auto block_at = [&](const T* base, int64_t i) {
        return base + ((h * NB + tp[b * max_blocks + i]) * BS) * RW;
      };
      const int64_t block_bytes = BS * RW * static_cast<int64_t>(sizeof(T));
      const int64_t ahead = std::max<int64_t>(1, kPrefetchAhead / block_bytes);
      const int64_t nb = last - first;
      int64_t fetched = std::min(nb, ahead);  // the previous item fetched these
      if (idx == begin)
        for (int64_t j = 0; j < fetched; ++j)
          prefetch_block(block_at(kp, first + j), block_bytes);
      const auto fetch_until = [&](int64_t j) {  // blocks [fetched, j) of K then V
        for (j = std::min(j, 2 * nb); fetched < j; ++fetched)
          prefetch_block(fetched < nb ? block_at(kp, first + fetched)
                                      : block_at(vp, first + fetched - nb), block_bytes);
      };
      for (int64_t i = first; i < last; ++i) {
        const T* kb = block_at(kp, i);
        fetch_until(i - first + 1 + ahead);
        const int64_t n_t = std::min(BS, len - i * BS);
        float* s_blk = scores.data() + (i - first) * BS;
        score_block<DK>(qf.data(), as_float_block<T, DK>(kb, n_t, D, buf.data()), n_t, G, D,
                        s_blk, n, cap);
      }
      for (int64_t g = 0; g < G; ++g)  // the window's start may fall inside a block
        for (int64_t t = first * BS; t < start; ++t) scores[g * n + t - first * BS] =
            -std::numeric_limits<float>::infinity();
      softmax_rows(scores.data(), G, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = first; i < last; ++i) {
        const T* vb = block_at(vp, i);
        fetch_until(nb + i - first + 1 + ahead);
        if (i + 1 == last && idx + 1 < end) {  // the next item's first K blocks
          const int64_t b2 = (idx + 1) / Hk, h2 = (idx + 1) % Hk, len2 = lp[b2];
          const int64_t first2 = (window > 0 ? std::max<int64_t>(0, len2 - window) : 0) / BS;
          const int64_t nb2 = (len2 + BS - 1) / BS - first2;
          for (int64_t j = 0; j < std::min(nb2, ahead); ++j)
            prefetch_block(kp + ((h2 * NB + tp[b2 * max_blocks + first2 + j]) * BS) * RW,
                           block_bytes);
        }
        const int64_t n_t = std::min(BS, len - i * BS);
        const float* p_blk = scores.data() + (i - first) * BS;
        const float* vf = as_float_block<T, DK>(vb, n_t, D, buf.data());
#ifdef __AVX2__
        if constexpr (kVectorHead<DK>) {
          block_values_vec<DK>(p_blk, vf, n_t, G, acc.data(), n);
          continue;
        }
#endif
        block_values<DK>(p_blk, vf, n_t, G, D, acc.data(), n);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(b * Hq + h * G + g) * D + d] = static_cast<TQ>(acc[g * D + d]);
    }
  });
}

#ifdef __AVX2__
// Decode attention in one pass over each (sequence, kv head)'s blocks, for head sizes of
// Tokens per step of decode_one_pass's online softmax (whole blocks, at least one): the
// scores of two 16-token blocks, one update of the running max and rescale of the
// accumulators, then their values. On a 2-core Zen 3 EPYC (fp32, 64 sequences x 260
// tokens, 30 layers' caches, alternating in one process): 0.93x the time of a block per
// step from L3, 0.96x from DRAM; 64 tokens 0.88x / 0.95x.
constexpr int64_t kStepTokens = 32;

// Decode attention in one pass over each (sequence, kv head)'s blocks, for head sizes of
// whole chunks of four vectors over fp32 or bf16 caches (read in place; an int8 / fp8
// cache's blocks widened into two fp32 buffers of a block first): a step's scores
// (kStepTokens), then at once its values, with a running max per query row (online
// softmax), so that K and V are read as two interleaved streams. Before a block's scores
// the next block's K is prefetched and this block's V, which the step's values read after
// its scores: on a 2-core EPYC Zen 4 (bf16 cache, 30 layers, blocks in random order) that
// was 1.3-1.4x faster at 16 sequences x 88 tokens and 1.16-1.35x at 32-48 x 234 than
// fetching the next block's K and V together (the 64 prefetches of one burst outrun the
// core's outstanding misses and stall the scores). On a 2-core AVX-512 Xeon (fp32, 30
// layers' caches of 64-128 sequences, 150-660 tokens, blocks in random order), a block per
// step was 0.89-0.94x the time of the two-pass loop (all K, a softmax, all V) with its
// 16 KiB prefetch; prefetching 16 or 32 KiB ahead in this loop was slower than one block,
// vectorising the softmax or taking all KV heads of a sequence as one item even.
template <typename TQ, typename T, int64_t DK>
static void decode_one_pass(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                            const at::Tensor& seq_lens, double scale, int64_t window,
                            float cap, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = DK, RW = kvray::row_width<T>(DK);
  const int64_t Hk = kv.size(1), NB = kv.size(2), BS = kv.size(3);
  const int64_t G = Hq / Hk, max_blocks = tables.size(1);
  const TQ* qp = q.data_ptr<TQ>();
  const T* kp = kv.data_ptr<T>();
  const T* vp = kp + Hk * NB * BS * RW;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  TQ* op = out.data_ptr<TQ>();
  const int64_t block_bytes = BS * RW * static_cast<int64_t>(sizeof(T));
  // What the vector code reads: the cache itself, or a quantized block widened to fp32.
  using TR = std::conditional_t<kvray::kQuantizedKV<T>, float, T>;
  const int64_t P = std::max<int64_t>(1, kStepTokens / BS), S = P * BS;  // blocks, tokens
  constexpr bool int_dot = kReadsCodes<T, DK>;  // an int8 cache's codes read in place
  const int64_t items = B * Hk;
  parallel_dynamic(items, chunk_for_threads(items), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), s(G * S), m(G), l(G);
    std::vector<int16_t> qi(int_dot ? G * D : 0);
    std::vector<float> qs(int_dot ? G : 0), ks(int_dot ? BS : 0), w(int_dot ? G * S : 0);
    std::vector<float> buf(kvray::kQuantizedKV<T> ? BS * D : 0);
    const auto block = [&](const T* p, int64_t n_t) -> const TR* {
      if constexpr (kvray::kQuantizedKV<T>) {
        kvray::dequantize_rows(p, n_t, D, buf.data());
        return buf.data();
      } else {
        return p;
      }
    };
    const auto first_block = [&](int64_t len) {
      return (window > 0 ? std::max<int64_t>(0, len - window) : 0) / BS;
    };
    // the offset of the block after block j of item idx (the next item's first block
    // after its last one), -1 past the chunk's end
    const auto next_off = [&](int64_t idx, int64_t j, int64_t last) -> int64_t {
      if (j + 1 < last) {
        const int64_t b = idx / Hk, h = idx % Hk;
        return ((h * NB + tp[b * max_blocks + j + 1]) * BS) * RW;
      }
      if (idx + 1 >= end) return -1;
      const int64_t b2 = (idx + 1) / Hk, h2 = (idx + 1) % Hk;
      return ((h2 * NB + tp[b2 * max_blocks + first_block(lp[b2])]) * BS) * RW;
    };
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hk, h = idx % Hk, len = lp[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t first = start / BS, last = (len + BS - 1) / BS;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f(qp[(b * Hq + h * G + g) * D + d]) * static_cast<float>(scale);
#ifdef KVRAY_INT8_DOT
      if constexpr (int_dot) kvray::query_codes<DK>(qf.data(), G, qi.data(), qs.data());
#endif
      const auto off = [&](int64_t i) { return ((h * NB + tp[b * max_blocks + i]) * BS) * RW; };
      if (idx == begin) prefetch_block(kp + off(first), block_bytes);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -1e30f);  // finite: the build assumes no infinities
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t i = first; i < last; i += P) {
        const int64_t i_end = std::min(last, i + P), n = std::min(S, len - i * BS);
        for (int64_t j = i; j < i_end; ++j) {  // scores; the next K and this V fetched
          const int64_t nx = next_off(idx, j, last);
          if (nx >= 0) prefetch_block(kp + nx, block_bytes);
          prefetch_block(vp + off(j), block_bytes);
          const int64_t n_t = std::min(BS, len - j * BS);
#ifdef KVRAY_INT8_DOT
          if constexpr (int_dot) {
            kvray::block_scores_int8<DK>(qi.data(), qs.data(), kp + off(j), n_t, G,
                                         ks.data(), s.data() + (j - i) * BS, S);
            continue;
          }
#endif
          block_scores_vec<DK>(qf.data(), block(kp + off(j), n_t), n_t, G,
                               s.data() + (j - i) * BS, S);
        }
        const int64_t masked = std::max<int64_t>(0, start - i * BS);  // before the window
        for (int64_t g = 0; g < G; ++g) {
          float* sg = s.data() + g * S;
          if (cap > 0) cap_scores(sg + masked, n - masked, cap);
          float mx = m[g];
          for (int64_t t = masked; t < n; ++t) mx = std::max(mx, sg[t]);
          const float alpha = std::exp(m[g] - mx);
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            const float e = t < masked ? 0.f : std::exp(sg[t] - mx);
            sg[t] = e;
            sum += e;
          }
          l[g] = l[g] * alpha + sum;
          m[g] = mx;
          if (alpha != 1.f)
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
        }
        for (int64_t j = i; j < i_end; ++j) {
          const int64_t n_t = std::min(BS, len - j * BS);
#ifdef KVRAY_INT8_DOT
          if constexpr (int_dot) {  // the codes, each row's scale in its weight
            kvray::value_weights<DK>(s.data() + (j - i) * BS, vp + off(j), n_t, G, S, w.data());
            block_values_vec<DK>(w.data(), vp + off(j), n_t, G, acc.data(), S);
            continue;
          }
#endif
          block_values_vec<DK>(s.data() + (j - i) * BS, block(vp + off(j), n_t), n_t, G,
                               acc.data(), S);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d)
          op[(b * Hq + h * G + g) * D + d] = static_cast<TQ>(acc[g * D + d] * inv);
      }
    }
  });
}
#endif

// The one-pass loop where it applies, else decode_impl, specialised for the common head
// sizes.
template <typename TQ, typename T>
static void decode_any_d(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                         const at::Tensor& seq_lens, double scale, int64_t window,
                         float cap, at::Tensor& out) {
  const int64_t d = q.size(2);
#ifdef __AVX2__
  if constexpr (kReadsInPlace<T> || kvray::kQuantizedKV<T>) {
    if (d == 64 && kVectorHead<64>)
      return decode_one_pass<TQ, T, 64>(q, kv, tables, seq_lens, scale, window, cap, out);
    if (d == 128 && kVectorHead<128>)
      return decode_one_pass<TQ, T, 128>(q, kv, tables, seq_lens, scale, window, cap, out);
  }
#endif
  if (d == 64) decode_impl<TQ, T, 64>(q, kv, tables, seq_lens, scale, window, cap, out);
  else if (d == 128) decode_impl<TQ, T, 128>(q, kv, tables, seq_lens, scale, window, cap, out);
  else decode_impl<TQ, T, 0>(q, kv, tables, seq_lens, scale, window, cap, out);
}

at::Tensor paged_decode(at::Tensor q, at::Tensor kv, at::Tensor tables, at::Tensor seq_lens,
                        double scale, int64_t window, double softcap) {
  TORCH_CHECK(kv.size(3) <= 256, "paged_decode: block_size must be <= 256");
  TORCH_CHECK(softcap >= 0, "paged_decode: softcap must be >= 0 (0: none)");
  const float cap = static_cast<float>(softcap);
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && tables.is_contiguous() &&
              seq_lens.is_contiguous(), "paged_decode: inputs must be contiguous");
  const bool fp32_q = q.scalar_type() == at::kFloat;
  const at::ScalarType cache_type = kv.scalar_type();
  if (kvray::is_quantized_kv(cache_type)) {
    TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && kv.size(4) == q.size(2) + kvray::kScaleBytes,
                "paged_decode: an int8/fp8 cache's rows are D codes and a 4-byte scale "
                "(D + 4), D from q");
    if (q.scalar_type() == at::kHalf)  // rare (fp16 models): through fp32
      return paged_decode(q.to(at::kFloat), kv, tables, seq_lens, scale, window, softcap)
          .to(at::kHalf);
    TORCH_CHECK(fp32_q || q.scalar_type() == at::kBFloat16,
                "paged_decode: q fp32, bf16 or fp16 over an int8/fp8 cache");
    auto out = at::empty_like(q);
    const auto run = [&](auto code) {
      using T = decltype(code);
      if (fp32_q) decode_any_d<float, T>(q, kv, tables, seq_lens, scale, window, cap, out);
      else decode_any_d<c10::BFloat16, T>(q, kv, tables, seq_lens, scale, window, cap, out);
    };
    if (cache_type == at::kChar) run(int8_t{});
    else if (cache_type == at::kFloat8_e4m3fn) run(c10::Float8_e4m3fn{});
    else run(c10::Float8_e5m2{});
    return out;
  }
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() || fp32_q,
              "paged_decode: q must have the cache's dtype or be fp32");
  TORCH_CHECK(kv.size(4) == q.size(2), "paged_decode: cache rows of q's head size");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "paged_decode",
      [&] {
        if (fp32_q) decode_any_d<float, scalar_t>(q, kv, tables, seq_lens, scale, window, cap, out);
        else decode_any_d<scalar_t, scalar_t>(q, kv, tables, seq_lens, scale, window, cap, out);
      });
  return out;
}

bool paged_decode_query_codes(at::Tensor kv, int64_t head_dim) {
  // the head sizes decode_one_pass takes
  return kv.scalar_type() == at::kChar && ((head_dim == 64 && kReadsCodes<int8_t, 64>) ||
                                           (head_dim == 128 && kReadsCodes<int8_t, 128>));
}
