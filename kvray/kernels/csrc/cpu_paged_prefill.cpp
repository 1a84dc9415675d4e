// CPU paged prefill attention for kvray (built by kvray/kernels/cpu_ops.py): the new tokens
// of B sequences attend causally (optionally within a sliding window) to their sequence's
// K/V, read where they lie in the paged cache [2, Hk, num_blocks, block_size, D] - no gather
// into a contiguous copy, no mask tensor, and no work above the diagonal. An int8 / fp8
// cache ([..., D + 4], kv_quant.h) has each block widened to fp32 as it is read.
//
// Flash-attention style, per (query tile, query head): a tile is up to two vectors of one
// sequence's consecutive new tokens (32 rows with AVX-512, 16 with AVX2), held transposed
// (Qt [D][rows], scaled) so that each key's scores for all rows are two vector FMA chains:
// the scores of a cache block come out as S^T [keys][rows], the running max, the exps and
// the row sums are lane-wise, and the output rows O [rows][D] take each probability as a
// broadcast against a key's value vectors. Both products keep 16-24 accumulators in
// registers, as the GEMM kernel does (cpu_linear.cpp). Only the blocks on the diagonal (and
// at a window's edge) are masked, and masked probabilities are set to exactly zero. A soft
// cap (Gemma 2; 0: none) turns each scaled score s into cap * tanh(s / cap) before the mask.
#include "ops.h"

#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_quant.h"
#include "vec.h"

#ifdef __AVX2__
namespace {

using kvray::Vec;

constexpr int kW = Vec::kWidth;
constexpr int kTileRows = 2 * kW;  // a query tile: two vectors of rows
#ifdef __AVX512F__
constexpr int kKeyGroup = 8;  // keys per score call: 8 x 2 accumulators of 32 registers
constexpr int kPvVecs = 4;    // value vectors per output call: 6 rows x 4 of 32 registers
#else
constexpr int kKeyGroup = 4;  // 4 x 2 of 16 registers
constexpr int kPvVecs = 2;    // 6 rows x 2 of 16 registers
#endif
constexpr int kPvRows = 6;
// Scores of masked-out keys, and the running max before any key: finite (the build uses
// -ffast-math, which assumes no infinities); their probabilities are zeroed explicitly.
constexpr float kMasked = -1e30f;
// Row-to-key distances are compared as floats, clamped to +-kFar (x.5 exact as floats);
// windows of kFar or more go through the reference path (cpu_ops.paged_prefill).
constexpr int64_t kFar = 1 << 22;

// e^x for softmax, x <= 0: inputs below -87 give e^-87 (~1.6e-38, the smallest that is not
// denormal) instead of a denormal, which would cost a microcode assist per lane; a weight
// that small next to the row's largest (1) changes nothing.
inline Vec::T softmax_exp(Vec::T x) { return Vec::exp(Vec::max(x, Vec::set1(-87.f))); }

// s[j][r] = sum_d qt[d][r] * keys[j][d] for the N keys of `keys` (fp32 rows of D).
template <int N>
inline void score_keys(const float* __restrict__ qt, const float* const* keys, int64_t D,
                       float* __restrict__ s) {
  Vec::T acc[N][2];
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) acc[j][0] = acc[j][1] = Vec::zero();
  for (int64_t d = 0; d < D; ++d) {
    const Vec::T q0 = Vec::load(qt + d * kTileRows), q1 = Vec::load(qt + d * kTileRows + kW);
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      const Vec::T k = Vec::set1(keys[j][d]);
      acc[j][0] = Vec::fma(k, q0, acc[j][0]);
      acc[j][1] = Vec::fma(k, q1, acc[j][1]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < N; ++j) {
    Vec::store(s + j * kTileRows, acc[j][0]);
    Vec::store(s + j * kTileRows + kW, acc[j][1]);
  }
}

// o[r][d0 + v*kW ...] = o[...] * alpha[r] + sum_j p[j][r0 + r] * vals[j][d0 + ...], for R
// rows from r0 and NV value vectors from d0.
template <int R, int NV>
inline void accumulate_rows(const float* __restrict__ p, int64_t r0, const float* const* vals,
                            int64_t n, const float* __restrict__ alpha, float* __restrict__ o,
                            int64_t D, int64_t d0) {
  Vec::T acc[R][NV];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const Vec::T a = Vec::set1(alpha[r0 + r]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[r][v] = Vec::mul(Vec::load(o + (r0 + r) * D + d0 + v * kW), a);
  }
  for (int64_t j = 0; j < n; ++j) {
    Vec::T x[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) x[v] = Vec::load(vals[j] + d0 + v * kW);
    const float* pj = p + j * kTileRows + r0;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const Vec::T w = Vec::set1(pj[r]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fma(w, x[v], acc[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) Vec::store(o + (r0 + r) * D + d0 + v * kW, acc[r][v]);
}

template <int R>
inline void accumulate_rows_any(int nv, const float* p, int64_t r0, const float* const* vals,
                                int64_t n, const float* alpha, float* o, int64_t D,
                                int64_t d0) {
  switch (nv) {
    case 4: accumulate_rows<R, 4>(p, r0, vals, n, alpha, o, D, d0); break;
    case 3: accumulate_rows<R, 3>(p, r0, vals, n, alpha, o, D, d0); break;
    case 2: accumulate_rows<R, 2>(p, r0, vals, n, alpha, o, D, d0); break;
    default: accumulate_rows<R, 1>(p, r0, vals, n, alpha, o, D, d0); break;
  }
}

// All `rows` output rows, in calls of kPvRows rows x kPvVecs vectors.
inline void accumulate(const float* p, int64_t rows, const float* const* vals, int64_t n,
                       const float* alpha, float* o, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += kPvVecs * kW) {
    const int nv = static_cast<int>(std::min<int64_t>(kPvVecs, (D - d0) / kW));
    int64_t r0 = 0;
    for (; r0 + kPvRows <= rows; r0 += kPvRows)
      accumulate_rows_any<kPvRows>(nv, p, r0, vals, n, alpha, o, D, d0);
    switch (rows - r0) {
      case 5: accumulate_rows_any<5>(nv, p, r0, vals, n, alpha, o, D, d0); break;
      case 4: accumulate_rows_any<4>(nv, p, r0, vals, n, alpha, o, D, d0); break;
      case 3: accumulate_rows_any<3>(nv, p, r0, vals, n, alpha, o, D, d0); break;
      case 2: accumulate_rows_any<2>(nv, p, r0, vals, n, alpha, o, D, d0); break;
      case 1: accumulate_rows_any<1>(nv, p, r0, vals, n, alpha, o, D, d0); break;
      default: break;
    }
  }
}

// The n keys' scores for the tile, in groups of kKeyGroup.
inline void score_block(const float* qt, const float* const* keys, int64_t n, int64_t D,
                        float* s) {
  int64_t j = 0;
  for (; j + kKeyGroup <= n; j += kKeyGroup)
    score_keys<kKeyGroup>(qt, keys + j, D, s + j * kTileRows);
  for (; j < n; ++j) score_keys<1>(qt, keys + j, D, s + j * kTileRows);
}

// One block's n_t rows of D as fp32: an fp32 cache's own memory, else widened into buf
// (an int8 / fp8 cache's codes times their row's scale).
template <typename T>
inline const float* block_as_float(const T* src, int64_t n_t, int64_t D, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (kvray::kQuantizedKV<T>) {
    kvray::dequantize_rows(src, n_t, D, buf);
    return buf;
  } else {
    for (int64_t i = 0; i < n_t * D; ++i) buf[i] = kvray::widen(src[i]);
    return buf;
  }
}

template <typename TQ, typename T>
void prefill_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start, double scale,
                  int64_t window, float cap, at::Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(2), q_rows = q.stride(0);
  const int64_t Hk = kv.size(1), NB = kv.size(2), BS = kv.size(3);
  const int64_t G = Hq / Hk, B = seq_lens.size(0), max_blocks = tables.size(1);
  const int64_t RW = kvray::row_width<T>(D);  // elements per cache row
  const TQ* qp = q.data_ptr<TQ>();
  const T* kp = kv.data_ptr<T>();
  const T* vp = kp + Hk * NB * BS * RW;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  const int64_t* sp = query_start.data_ptr<int64_t>();
  TQ* op = out.data_ptr<TQ>();
  // (sequence, first new token of the tile) for every tile; items are (tile, query head),
  // the heads of one KV head next to each other so that its K/V stay in cache between them.
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = sp[b]; t < sp[b + 1]; t += kTileRows) tiles.emplace_back(b, t);
  const int64_t items = static_cast<int64_t>(tiles.size()) * Hq;
  const float fscale = static_cast<float>(scale);
  parallel_dynamic(items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qt(D * kTileRows), s(BS * kTileRows), o(kTileRows * D);
    std::vector<float> m(kTileRows), l(kTileRows), alpha(kTileRows);
    std::vector<float> kbuf, vbuf;
    if constexpr (!std::is_same_v<T, float>) kbuf.resize(BS * D), vbuf.resize(BS * D);
    std::vector<const float*> keys(BS), vals(BS);
    std::vector<float> iota(kTileRows);
    for (int r = 0; r < kTileRows; ++r) iota[r] = static_cast<float>(r);
    const Vec::T half = Vec::set1(0.5f), masked = Vec::set1(kMasked);
    const Vec::T unmask = Vec::set1(-0.5f * kMasked);
    const Vec::T far_edge = Vec::set1(static_cast<float>(std::min(window, kFar)) - 0.5f);
    for (int64_t idx = begin; idx < end; ++idx) {
      const auto [b, t0] = tiles[idx / Hq];
      const int64_t head = idx % Hq, h = head / G;
      const int64_t rows = std::min<int64_t>(kTileRows, sp[b + 1] - t0);
      const int64_t p0 = lp[b] - (sp[b + 1] - t0);  // the tile's first position
      const int64_t p_last = p0 + rows - 1;
      // Qt [D][rows], scaled; the rows past a short tile's end are zeros.
      std::fill(qt.begin(), qt.end(), 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        const TQ* qr = qp + (t0 + r) * q_rows + head * D;
        for (int64_t d = 0; d < D; ++d) qt[d * kTileRows + r] = kvray::widen(qr[d]) * fscale;
      }
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(m.begin(), m.end(), kMasked);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
      for (int64_t blk = first_key / BS; blk * BS <= p_last; ++blk) {
        const int64_t k0 = blk * BS, n_t = std::min(BS, p_last + 1 - k0);
        const int64_t phys = tp[b * max_blocks + blk];
        const int64_t at = ((h * NB + phys) * BS) * RW;
        const float* kb = block_as_float(kp + at, n_t, D, kbuf.data());
        const float* vb = block_as_float(vp + at, n_t, D, vbuf.data());
        for (int64_t j = 0; j < n_t; ++j) keys[j] = kb + j * D, vals[j] = vb + j * D;
        score_block(qt.data(), keys.data(), n_t, D, s.data());
        if (cap > 0)
          for (int64_t i = 0; i < n_t * kTileRows; i += kW)
            Vec::store(s.data() + i, kvray::softcap<Vec>(Vec::load(s.data() + i), cap));
        // Keys past a row's position, or a window's width or more before it, are masked:
        // dist = row position - key position, lane r of vector v holding row v * kW + r.
        if (k0 + n_t - 1 > p0 || (window > 0 && p_last - k0 >= window)) {
          for (int64_t j = 0; j < n_t; ++j) {
            const float base =
                static_cast<float>(std::clamp<int64_t>(p0 - k0 - j, -kFar, kFar));
            for (int64_t r = 0; r < kTileRows; r += kW) {
              float* sj = s.data() + j * kTileRows + r;
              const Vec::T dist = Vec::add(Vec::load(iota.data() + r), Vec::set1(base));
              Vec::T v = Vec::select_negative(Vec::add(dist, half), masked, Vec::load(sj));
              if (window > 0) v = Vec::select_negative(Vec::sub(far_edge, dist), masked, v);
              Vec::store(sj, v);
            }
          }
        }
        for (int64_t r = 0; r < kTileRows; r += kW) {
          Vec::T mx = Vec::load(m.data() + r);
          for (int64_t j = 0; j < n_t; ++j)
            mx = Vec::max(mx, Vec::load(s.data() + j * kTileRows + r));
          Vec::store(alpha.data() + r, softmax_exp(Vec::sub(Vec::load(m.data() + r), mx)));
          Vec::store(m.data() + r, mx);
          Vec::T sum = Vec::zero();
          for (int64_t j = 0; j < n_t; ++j) {
            float* sj = s.data() + j * kTileRows + r;
            const Vec::T x = Vec::load(sj);
            // a masked score's probability is exactly zero (not e^-87)
            const Vec::T pj = Vec::select_negative(Vec::add(x, unmask), Vec::zero(),
                                                   softmax_exp(Vec::sub(x, mx)));
            Vec::store(sj, pj);
            sum = Vec::add(sum, pj);
          }
          Vec::store(l.data() + r, Vec::fma(Vec::load(l.data() + r),
                                            Vec::load(alpha.data() + r), sum));
        }
        accumulate(s.data(), rows, vals.data(), n_t, alpha.data(), o.data(), D);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / l[r];
        TQ* dst = op + ((t0 + r) * Hq + head) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<TQ>(o[r * D + d] * inv);
      }
    }
  });
}

}  // namespace
#endif  // __AVX2__

bool paged_prefill_supported(const at::Tensor& q, const at::Tensor& kv) {
#ifdef __AVX2__
  const at::ScalarType q_dtype = q.scalar_type(), cache_dtype = kv.scalar_type();
  const int64_t head_dim = q.size(-1);
  if (kvray::is_quantized_kv(cache_dtype))  // int8 / fp8 rows: D codes and a scale
    return (q_dtype == at::kFloat || q_dtype == at::kBFloat16) &&
           kv.size(-1) == head_dim + kvray::kScaleBytes && head_dim > 0 &&
           head_dim % kvray::Vec::kWidth == 0;
  const bool cache_ok = cache_dtype == at::kFloat || cache_dtype == at::kBFloat16;
  return cache_ok && (q_dtype == cache_dtype || q_dtype == at::kFloat) &&
         kv.size(-1) == head_dim && head_dim > 0 && head_dim % kvray::Vec::kWidth == 0;
#else
  (void)q, (void)kv;
  return false;
#endif
}

at::Tensor paged_prefill(at::Tensor q, at::Tensor kv, at::Tensor tables, at::Tensor seq_lens,
                         at::Tensor query_start, double scale, int64_t window,
                         double softcap) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5 && paged_prefill_supported(q, kv),
              "paged_prefill: unsupported dtypes or head size (see paged_prefill_supported)");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && kv.is_contiguous() &&
              tables.is_contiguous() && seq_lens.is_contiguous() &&
              query_start.is_contiguous(),
              "paged_prefill: inputs must be contiguous (q: each token's heads)");
  TORCH_CHECK(query_start.numel() == seq_lens.numel() + 1,
              "paged_prefill: query_start needs one more entry than seq_lens");
  TORCH_CHECK(softcap >= 0, "paged_prefill: softcap must be >= 0 (0: none)");
  auto out = at::empty(q.sizes(), q.options());
#ifdef __AVX2__
  const bool fp32_q = q.scalar_type() == at::kFloat;
  const at::ScalarType cache_type = kv.scalar_type();
  const auto run = [&](auto query, auto code) {
    prefill_impl<decltype(query), decltype(code)>(q, kv, tables, seq_lens, query_start, scale,
                                                  window, static_cast<float>(softcap), out);
  };
  const auto run_q = [&](auto code) {
    if (fp32_q) run(float{}, code);
    else run(c10::BFloat16{}, code);
  };
  if (cache_type == at::kChar) run_q(int8_t{});
  else if (cache_type == at::kFloat8_e4m3fn) run_q(c10::Float8_e4m3fn{});
  else if (cache_type == at::kFloat8_e5m2) run_q(c10::Float8_e5m2{});
  else if (cache_type == at::kFloat) run(float{}, float{});
  else run_q(c10::BFloat16{});
#endif
  return out;
}
