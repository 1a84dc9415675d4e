// CPU paged decode attention for kvray (built by kvray/kernels/cpu_ops.py).
// Reads K/V straight from the paged cache [2, Hk, num_blocks, block_size, D]: one pass over
// K for the scores, one over V for the output, parallel over (sequence, kv head). q is the
// cache's dtype, or fp32 over a bf16/fp16 cache (the fused decode layer of a bf16 model keeps
// its activations in fp32); the output has q's dtype.
#include "ops.h"

#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
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
  for (int64_t i = 0; i < total; ++i) dst[i] = to_f(src[i]);
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
      for (int64_t i = first; i < last; ++i) {
        const T* kb = kp + ((h * NB + tp[b * max_blocks + i]) * BS) * D;
        const int64_t n_t = std::min(BS, len - i * BS);
        to_float_block<T, DK>(kb, n_t, D, buf.data());
        block_scores<DK>(qf.data(), buf.data(), n_t, G, D, scores.data() + (i - first) * BS, n);
      }
      for (int64_t g = 0; g < G; ++g)  // the window's start may fall inside a block
        for (int64_t t = first * BS; t < start; ++t) scores[g * n + t - first * BS] =
            -std::numeric_limits<float>::infinity();
      softmax_rows(scores.data(), G, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = first; i < last; ++i) {
        const T* vb = vp + ((h * NB + tp[b * max_blocks + i]) * BS) * D;
        const int64_t n_t = std::min(BS, len - i * BS);
        to_float_block<T, DK>(vb, n_t, D, buf.data());
        block_values<DK>(scores.data() + (i - first) * BS, buf.data(), n_t, G, D, acc.data(), n);
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
