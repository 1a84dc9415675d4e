// CPU paged decode attention for kvray (built by kvray/kernels/cpu_ops.py).
// Reads K/V straight from the paged cache [2, Hk, num_blocks, block_size, D]: one pass over
// K for the scores, one over V for the output, parallel over (sequence, kv head). q is the
// cache's dtype, or fp32 over a bf16/fp16 cache (the fused decode layer of a bf16 model keeps
// its activations in fp32); the output has q's dtype. Head sizes of 64 and 128 run AVX2
// code for the scores and the weighted sum of V, and each next block is prefetched (blocks
// lie anywhere in the cache): together 1.3x the plain loops in a 64-sequence bf16 decode
// step on a 2-core AMX Xeon (attention 11.6-11.9 -> 8.7-9.4 ms of a ~50 ms step).
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

static inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// One block as fp32: an fp32 cache's own memory, else converted into `buf`.
template <typename T, int64_t DK>
static inline const float* as_float_block(const T* src, int64_t n, int64_t D_, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
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
// The 8 horizontal sums of a0..a7, as one vector [sum(a0), ..., sum(a7)].
static inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                          __m256 a6, __m256 a7) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                       _mm256_permute2f128_ps(h0, h1, 0x31));
}

// block_scores for head sizes of 64 and 128: eight keys at a time per query row, eight
// accumulators (named: GCC keeps them in registers), one combined horizontal sum instead of
// one per key.
template <int64_t DK>
static inline void block_scores_avx2(const float* __restrict__ qf,
                                     const float* __restrict__ kb, int64_t n_t, int64_t G,
                                     float* __restrict__ s, int64_t stride) {
  static_assert(DK % 8 == 0, "head size in vectors of 8");
  int64_t t = 0;
  for (; t + 8 <= n_t; t += 8) {
    const float* k = kb + t * DK;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * DK;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
             a6 = a0, a7 = a0;
      for (int64_t d = 0; d < DK; d += 8) {
        const __m256 q = _mm256_loadu_ps(qg + d);
        a0 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 0 * DK + d), a0);
        a1 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 1 * DK + d), a1);
        a2 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 2 * DK + d), a2);
        a3 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 3 * DK + d), a3);
        a4 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 4 * DK + d), a4);
        a5 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 5 * DK + d), a5);
        a6 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 6 * DK + d), a6);
        a7 = _mm256_fmadd_ps(q, _mm256_loadu_ps(k + 7 * DK + d), a7);
      }
      _mm256_storeu_ps(s + g * stride + t, sum8(a0, a1, a2, a3, a4, a5, a6, a7));
    }
  }
  if (t < n_t) block_scores<DK>(qf, kb + t * DK, n_t - t, G, DK, s + t, stride);
}

// block_values for a head size that is a multiple of 64: each query row's output kept in 8
// registers per 64 dims over the block's tokens (loaded and stored once per block).
template <int64_t DK>
static inline void block_values_avx2(const float* __restrict__ p,
                                     const float* __restrict__ vb, int64_t n_t, int64_t G,
                                     float* __restrict__ acc, int64_t stride) {
  static_assert(DK % 64 == 0, "head size in chunks of 64");
  for (int64_t g = 0; g < G; ++g) {
    const float* pg = p + g * stride;
    for (int64_t d = 0; d < DK; d += 64) {
      float* a = acc + g * DK + d;
      __m256 c0 = _mm256_loadu_ps(a), c1 = _mm256_loadu_ps(a + 8),
             c2 = _mm256_loadu_ps(a + 16), c3 = _mm256_loadu_ps(a + 24),
             c4 = _mm256_loadu_ps(a + 32), c5 = _mm256_loadu_ps(a + 40),
             c6 = _mm256_loadu_ps(a + 48), c7 = _mm256_loadu_ps(a + 56);
      for (int64_t t = 0; t < n_t; ++t) {
        const __m256 w = _mm256_broadcast_ss(pg + t);
        const float* v = vb + t * DK + d;
        c0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), c0);
        c1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), c1);
        c2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), c2);
        c3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), c3);
        c4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 32), c4);
        c5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 40), c5);
        c6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 48), c6);
        c7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 56), c7);
      }
      _mm256_storeu_ps(a, c0); _mm256_storeu_ps(a + 8, c1);
      _mm256_storeu_ps(a + 16, c2); _mm256_storeu_ps(a + 24, c3);
      _mm256_storeu_ps(a + 32, c4); _mm256_storeu_ps(a + 40, c5);
      _mm256_storeu_ps(a + 48, c6); _mm256_storeu_ps(a + 56, c7);
    }
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

template <typename TQ, typename T, int64_t DK>
static void decode_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                        const at::Tensor& seq_lens, double scale, int64_t window,
                        at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hk = kv.size(1), NB = kv.size(2), BS = kv.size(3);
  const int64_t G = Hq / Hk, max_blocks = tables.size(1);
  const TQ* qp = q.data_ptr<TQ>();
  const T* kp = kv.data_ptr<T>();
  const T* vp = kp + Hk * NB * BS * D;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  TQ* op = out.data_ptr<TQ>();
  at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
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
      // Blocks sit anywhere in the cache: each is fetched ahead while the one before is
      // being worked on (the hardware prefetcher does not cross into the next block).
      const auto block_at = [&](const T* base, int64_t i) {
        return base + ((h * NB + tp[b * max_blocks + i]) * BS) * D;
      };
      const int64_t block_bytes = BS * D * static_cast<int64_t>(sizeof(T));
      prefetch_block(block_at(kp, first), block_bytes);
      for (int64_t i = first; i < last; ++i) {
        const T* kb = block_at(kp, i);
        prefetch_block(i + 1 < last ? block_at(kp, i + 1) : block_at(vp, first), block_bytes);
        const int64_t n_t = std::min(BS, len - i * BS);
        const float* kf = as_float_block<T, DK>(kb, n_t, D, buf.data());
        float* s_blk = scores.data() + (i - first) * BS;
#ifdef __AVX2__
        if constexpr (DK > 0 && DK % 64 == 0) {
          block_scores_avx2<DK>(qf.data(), kf, n_t, G, s_blk, n);
          continue;
        }
#endif
        block_scores<DK>(qf.data(), kf, n_t, G, D, s_blk, n);
      }
      for (int64_t g = 0; g < G; ++g)  // the window's start may fall inside a block
        for (int64_t t = first * BS; t < start; ++t) scores[g * n + t - first * BS] =
            -std::numeric_limits<float>::infinity();
      softmax_rows(scores.data(), G, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = first; i < last; ++i) {
        const T* vb = block_at(vp, i);
        if (i + 1 < last) prefetch_block(block_at(vp, i + 1), block_bytes);
        const int64_t n_t = std::min(BS, len - i * BS);
        const float* vf = as_float_block<T, DK>(vb, n_t, D, buf.data());
        const float* p_blk = scores.data() + (i - first) * BS;
#ifdef __AVX2__
        if constexpr (DK > 0 && DK % 64 == 0) {
          block_values_avx2<DK>(p_blk, vf, n_t, G, acc.data(), n);
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

// decode_impl specialised for the common head sizes.
template <typename TQ, typename T>
static void decode_any_d(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                         const at::Tensor& seq_lens, double scale, int64_t window,
                         at::Tensor& out) {
  const int64_t d = q.size(2);
  if (d == 64) decode_impl<TQ, T, 64>(q, kv, tables, seq_lens, scale, window, out);
  else if (d == 128) decode_impl<TQ, T, 128>(q, kv, tables, seq_lens, scale, window, out);
  else decode_impl<TQ, T, 0>(q, kv, tables, seq_lens, scale, window, out);
}

at::Tensor paged_decode(at::Tensor q, at::Tensor kv, at::Tensor tables, at::Tensor seq_lens,
                        double scale, int64_t window) {
  TORCH_CHECK(kv.size(3) <= 256, "paged_decode: block_size must be <= 256");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && tables.is_contiguous() &&
              seq_lens.is_contiguous(), "paged_decode: inputs must be contiguous");
  const bool fp32_q = q.scalar_type() == at::kFloat;
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() || fp32_q,
              "paged_decode: q must have the cache's dtype or be fp32");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, kv.scalar_type(), "paged_decode",
      [&] {
        if (fp32_q) decode_any_d<float, scalar_t>(q, kv, tables, seq_lens, scale, window, out);
        else decode_any_d<scalar_t, scalar_t>(q, kv, tables, seq_lens, scale, window, out);
      });
  return out;
}
