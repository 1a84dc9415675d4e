// Linear layer for the few-row inputs of decode steps (built by kvray/kernels/cpu_ops.py).
//
// A decode step multiplies one row of activations per running sequence by every weight
// matrix: memory-bound, the weights streamed once from DRAM. MKL's sgemm (PyTorch's CPU
// path) re-reads the whole weight matrix for each row below M of about 16, and its gemv
// reaches about half of the read bandwidth on some CPUs. Here each weight row is loaded
// once and multiplied with all M rows of x, which stay in L1/L2, parallel over weight rows.
// Weights may be bf16 (widened to fp32 in registers, exactly): half the bytes to stream, the
// same products as fp32 weights holding the same values.
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

using kvray::widen;
#ifdef __AVX2__
// The small-M kernel runs at the vector width of vec.h: 16 floats with AVX-512 (half the
// instructions per byte of weights; on a 2-core AMX Xeon, every linear of the built-in
// model's bf16 weights once: 1.14-1.19x the AVX2 width at 1 row, 18-19 -> 21 GB/s,
// 1.03-1.06x at 2-4 rows, 1.16x at 8, alternating runs), else 8.
using kvray::Vec;
#endif

// Bytes ahead of the current load that each weight row stream prefetches: software
// prefetch this far ahead lifted the M = 1 kernel from ~14 to ~16-18 GB/s on an AVX2 EPYC
// (256 and 512 bytes gained less; on an AMX Xeon 1-4 KiB made no difference). On a 2-core
// AVX-512 Xeon without AMX, 2 KiB ahead: every linear of a decode step once (bf16 copies,
// interleaved runs) 1.05-1.1x faster than 1 KiB at 1-8 rows; 3-4 KiB no better than 2.
#ifdef __AVX2__
constexpr int kPrefetchBytes = Vec::kWidth == 16 ? 2048 : 1024;
#endif

// Rows [n0, n1) of y^T for M <= 8 rows of x: y[m * N + n] = dot(x[m], w[n]) (+ b[n]).
// One weight row at a time, read front to back: each thread reads one sequential stream,
// which the hardware prefetcher follows (and a software prefetch per cache line). Interleaving
// 2-4 weight rows (4 streams per thread) read at only 9-11 GB/s where one stream reads
// 16-18 (AVX2 EPYC, measured). U independent accumulators per x row keep the FMA latency
// hidden.
template <int M, int U, typename W>
static void rows(const float* __restrict__ x, const W* __restrict__ w,
                 const float* __restrict__ b, float* __restrict__ y, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* row = w + n * K;
    float acc[M];
    int64_t k = 0;
#ifdef __AVX2__
    constexpr int V = Vec::kWidth;
    constexpr int64_t kStepBytes = V * U * static_cast<int64_t>(sizeof(W));
    typename Vec::T a[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) a[m][u] = Vec::zero();
    for (; k + V * U <= K; k += V * U) {
      for (int64_t off = 0; off < kStepBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes + off,
                     _MM_HINT_T0);
      for (int u = 0; u < U; ++u) {
        const auto wv = Vec::load(row + k + V * u);
        for (int m = 0; m < M; ++m)
          a[m][u] = Vec::fma(wv, Vec::load(x + m * K + k + V * u), a[m][u]);
      }
    }
    for (; k + V <= K; k += V) {
      const auto wv = Vec::load(row + k);
      for (int m = 0; m < M; ++m) a[m][0] = Vec::fma(wv, Vec::load(x + m * K + k), a[m][0]);
    }
    for (int m = 0; m < M; ++m) {
      for (int u = 1; u < U; ++u) a[m][0] = Vec::add(a[m][0], a[m][u]);
      acc[m] = Vec::sum(a[m][0]);
    }
#else
    for (int m = 0; m < M; ++m) acc[m] = 0.f;
#endif
    for (; k < K; ++k)
      for (int m = 0; m < M; ++m) acc[m] += widen(row[k]) * x[m * K + k];
    for (int m = 0; m < M; ++m) y[m * N + n] = acc[m] + (b ? b[n] : 0.f);
  }
}

// x rows per pass over a weight tile: 8 with AVX-512's 32 vector registers (8
// accumulators, one per row: the weight tile is read from L2 and, for bf16, widened half as
// often as with 4), 4 with AVX2's 16 (4 rows x 2 accumulators). On a 2-core AVX-512 Xeon,
// the decoder's linears (bf16 copies, cold) at 8-32 rows: 1.1-1.3x the 4-row passes; 12 or
// 16 rows per pass, or 2 accumulators per row, were no faster.
#if defined(__AVX2__)
constexpr int64_t kRowGroup = Vec::kWidth == 16 ? 8 : 4;
#else
constexpr int64_t kRowGroup = 4;
#endif

// Rows [n0, n1) of w against M rows of x, a tile of weight rows at a time: the tile stays
// in L2 while groups of kRowGroup x rows pass over it, so w is read from memory once.
template <typename W>
static void tile_rows(const float* x, const W* w, const float* b, float* y, int64_t M,
                      int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t tile = std::max<int64_t>(4, (32768 / std::max<int64_t>(K, 1)) / 4 * 4);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    int64_t m = 0;
    if constexpr (kRowGroup == 8)
      for (; m + 8 <= M; m += 8) rows<8, 1, W>(x + m * K, w, b, y + m * N, K, N, t0, t1);
    for (; m + 4 <= M; m += 4) rows<4, 2, W>(x + m * K, w, b, y + m * N, K, N, t0, t1);
    switch (M - m) {
      case 3: rows<3, 2, W>(x + m * K, w, b, y + m * N, K, N, t0, t1); break;
      case 2: rows<2, 2, W>(x + m * K, w, b, y + m * N, K, N, t0, t1); break;
      case 1: rows<1, 4, W>(x + m * K, w, b, y + m * N, K, N, t0, t1); break;
      default: break;
    }
  }
}

template <typename W>
static void run(const float* x, const W* w, const float* b, float* y, int64_t M, int64_t K,
                int64_t N) {
  // At least ~64 KiB of weights per chunk (amortises the hand-out), about 4 chunks per
  // thread (balance when a thread loses its core for a while).
  const int64_t grain = std::max<int64_t>(4, 16384 / std::max<int64_t>(K, 1) / 4 * 4);
  const int64_t per = chunk_for_threads(N) / 4 * 4;
  parallel_dynamic(N, std::max(grain, per), [&](int64_t n0, int64_t n1) {
    tile_rows<W>(x, w, b, y, M, K, N, n0, n1);
  });
}

at::Tensor linear_small_m(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_small_m: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat &&
              (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "linear_small_m: fp32 x with fp32 or bf16 w only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "linear_small_m: contiguous inputs");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 32, "linear_small_m: 1 <= M <= 32");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N &&
                bias->scalar_type() == at::kFloat, "linear_small_m: bias [N] fp32");
    b = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  if (w.scalar_type() == at::kFloat)
    run(x.data_ptr<float>(), w.data_ptr<float>(), b, y.data_ptr<float>(), M, K, N);
  else
    run(x.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), b, y.data_ptr<float>(), M, K, N);
  return y;
}

// y = x w^T (+ bias) for many rows (prefill chunks, mixed steps) as tiles of at most
// kTileRows x kTileCols outputs handed out to the threads one at a time (parallel_dynamic).
// MKL's own threading splits the matrix statically: when another process takes a core for
// a few ms (Serve's proxy and ingress streaming tokens beside the engine), the other thread
// finishes its half and waits; here it takes over the remaining tiles.
//
// fp32 with AVX2 runs our own register-blocked kernel (below); other dtypes run one
// single-threaded sgemm per tile (MKL runs sequentially inside a parallel region).
constexpr int64_t kPackedGroupRows = 6;  // pack_linear_weight's groups (kGroup below)
constexpr int64_t kTileRows = 256;
constexpr int64_t kTileCols = 96;  // 16 groups of kGroup weight rows

#ifdef __AVX2__
// The kernel computes each kPanel x 6 block of y (kPanel = two vectors of x rows: 32 with
// AVX-512, 16 with AVX2; 6 rows of w) in 12 vector registers over the whole K: per k, two
// vector loads of x and 6 broadcasts of w feed 12 FMAs, so it runs at the FMA units' pace.
// Both operands are repacked so that each is read as one sequential stream: x into panels
// of kPanel rows, k-major (xp[k * kPanel + j], once per call, shared by every tile), and
// each tile's weight rows into groups of 6, k-major (per tile, ~1/500 of its arithmetic).
// On an AVX2 EPYC (87 GFLOP/s FMA peak per core), one thread, the decoder's shapes at 256
// rows: 70-80 GFLOP/s alone, MKL's sgemm 57-71; on the shared machine, alternating with
// F.linear, 0.8-1.5x per shape (about even at two threads), and the offline concurrency-16
// serving workload 1.05x the sgemm-per-tile path (no difference with 20 % of the CPU taken
// by other processes). On an AVX-512 Xeon (two threads, 256 rows) 16 lanes run the
// decoder's shapes at 245-275 GFLOP/s, 8 lanes at 150-160, MKL's sgemm at 285-315; 12
// weight rows per block (24 accumulators) and K split into L1-sized depths were no faster.
constexpr int64_t kPanel = 2 * Vec::kWidth;
constexpr int kGroup = kPackedGroupRows;
// How far ahead a weight packed once is prefetched while the first x panel meets it. On a
// 2-core AVX-512 Xeon (fp32, two threads), every linear of the built-in model's 30 layers
// at 64 rows, cold weights, alternating in one process: none 64-68 ms, 1 KiB 58, 4 KiB
// 55-57 (F.linear, MKL's sgemm repacking the weight per call, 73-75): without it the
// first panel waits on DRAM, which a register-blocked kernel at 64 rows cannot hide.
constexpr int64_t kPackedPrefetchBytes = 4096;

// Rows [m0, m0 + kPanel) of x (row stride ldx) into xp[k * kPanel + j]; rows past M are
// zeros. Eight k at a time for all kPanel rows: the writes stay within 8 * kPanel floats.
static void pack_x_panel(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t m0,
                         float* xp) {
  const int64_t rows = std::min<int64_t>(kPanel, M - m0);
  for (int64_t k0 = 0; k0 < K; k0 += 8) {
    const int64_t kn = std::min<int64_t>(8, K - k0);
    for (int64_t j = 0; j < kPanel; ++j) {
      float* dst = xp + k0 * kPanel + j;
      if (j < rows) {
        const float* src = x + (m0 + j) * ldx + k0;
        for (int64_t k = 0; k < kn; ++k) dst[k * kPanel] = src[k];
      } else {
        for (int64_t k = 0; k < kn; ++k) dst[k * kPanel] = 0.f;
      }
    }
  }
}

// `rows` (1-6) rows of w from `w` (row stride K) into wp[k * 6 + i]; missing rows are zeros.
static void pack_w_group(const float* w, int64_t K, int64_t rows, float* wp) {
  for (int64_t i = 0; i < kGroup; ++i) {
    if (i < rows) {
      const float* src = w + i * K;
      for (int64_t k = 0; k < K; ++k) wp[k * kGroup + i] = src[k];
    } else {
      for (int64_t k = 0; k < K; ++k) wp[k * kGroup + i] = 0.f;
    }
  }
}

// The first `rows` (<= kWidth) lanes of c0..c5 as rows of y: y[j * ldy + i] = ci[j], i < 6.
// The block's accumulators hold one weight row's outputs per register (a column of y),
// which a scalar scatter wrote one float at a time. Here pairs of registers are interleaved
// (unpack), the pairs' 64-bit halves joined (shuffle), so that each row's first four outputs
// sit in one 128-bit lane and its last two in half of another: then two plain stores per
// row. On a 2-core AVX-512 Xeon, the 30 layers' packed linears at 2,048 / 512 / 256 rows:
// 1.05 / 1.03 / 1.00x the scatter's speed (leaving out every store, an upper bound, was
// 1.07-1.15x).
static inline void store_rows_x6(Vec::T c0, Vec::T c1, Vec::T c2, Vec::T c3, Vec::T c4,
                                 Vec::T c5, float* __restrict__ y, int64_t ldy, int64_t rows) {
  constexpr int W = Vec::kWidth;
  const Vec::T t01l = Vec::unpacklo(c0, c1), t01h = Vec::unpackhi(c0, c1);
  const Vec::T t23l = Vec::unpacklo(c2, c3), t23h = Vec::unpackhi(c2, c3);
  const Vec::T t45l = Vec::unpacklo(c4, c5), t45h = Vec::unpackhi(c4, c5);
  // In each 128-bit lane L (rows 4L..4L+3): quad[r] holds row 4L+r's outputs 0-3, pair[r / 2]
  // its outputs 4-5 in the low (r even) or high (r odd) 64 bits.
  alignas(64) float quad[4][W], pair[2][W];
  Vec::store(quad[0], Vec::shuffle<0x44>(t01l, t23l));
  Vec::store(quad[1], Vec::shuffle<0xEE>(t01l, t23l));
  Vec::store(quad[2], Vec::shuffle<0x44>(t01h, t23h));
  Vec::store(quad[3], Vec::shuffle<0xEE>(t01h, t23h));
  Vec::store(pair[0], t45l);
  Vec::store(pair[1], t45h);
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t lane = j / 4, r = j % 4;
    float* dst = y + j * ldy;
    std::memcpy(dst, quad[r] + 4 * lane, 4 * sizeof(float));
    std::memcpy(dst + 4, pair[r / 2] + 4 * lane + 2 * (r % 2), 2 * sizeof(float));
  }
}

// y[j, i] = sum_k xp[k, j] * wp[k, i] (+ bias[i]) for the block's `rows` valid x rows and
// `cols` valid weight rows; y has row stride ldy. The twelve accumulators are named
// variables: kept in an array, GCC stored them to the stack on every k (3x slower).
// With `prefetch` the weight group is read from memory (a weight packed once, not a tile
// just packed into L2): the next bytes of its stream are prefetched as the k loop goes.
// With `half` only the panel's first vector of x rows is computed (a last panel of at most
// kWidth rows: 6 accumulators, which still keep both FMA units about 3/4 busy, rather than
// twice the arithmetic on zero rows: decode batches just past a multiple of kPanel).
template <bool prefetch, bool half>
static void block_panel_x6(const float* __restrict__ xp, const float* __restrict__ wp,
                           int64_t K, const float* __restrict__ bias, float* __restrict__ y,
                           int64_t ldy, int64_t rows, int64_t cols) {
  constexpr int W = Vec::kWidth;
  using R = Vec::T;
  R c00 = Vec::zero(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  R c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
// One weight row i of the group: its broadcast times both halves of the x panel's column.
#define KVRAY_FMA_ROW(i, lo, hi)   \
  b = Vec::set1(a[i]);             \
  lo = Vec::fma(b, x0, lo);        \
  if constexpr (!half) hi = Vec::fma(b, x1, hi);
  for (int64_t k = 0; k < K; ++k) {
    const R x0 = Vec::load(xp + k * kPanel);
    const R x1 = half ? x0 : Vec::load(xp + k * kPanel + W);
    const float* a = wp + k * kGroup;
    if (prefetch)
      _mm_prefetch(reinterpret_cast<const char*>(a) + kPackedPrefetchBytes, _MM_HINT_T0);
    R b;
    KVRAY_FMA_ROW(0, c00, c01)
    KVRAY_FMA_ROW(1, c10, c11)
    KVRAY_FMA_ROW(2, c20, c21)
    KVRAY_FMA_ROW(3, c30, c31)
    KVRAY_FMA_ROW(4, c40, c41)
    KVRAY_FMA_ROW(5, c50, c51)
  }
#undef KVRAY_FMA_ROW
  if (cols == kGroup) {  // every weight row of the group: transposed in registers
    if (bias != nullptr) {
      c00 = Vec::add(c00, Vec::set1(bias[0])), c01 = Vec::add(c01, Vec::set1(bias[0]));
      c10 = Vec::add(c10, Vec::set1(bias[1])), c11 = Vec::add(c11, Vec::set1(bias[1]));
      c20 = Vec::add(c20, Vec::set1(bias[2])), c21 = Vec::add(c21, Vec::set1(bias[2]));
      c30 = Vec::add(c30, Vec::set1(bias[3])), c31 = Vec::add(c31, Vec::set1(bias[3]));
      c40 = Vec::add(c40, Vec::set1(bias[4])), c41 = Vec::add(c41, Vec::set1(bias[4]));
      c50 = Vec::add(c50, Vec::set1(bias[5])), c51 = Vec::add(c51, Vec::set1(bias[5]));
    }
    store_rows_x6(c00, c10, c20, c30, c40, c50, y, ldy, std::min<int64_t>(rows, W));
    if (!half && rows > W) store_rows_x6(c01, c11, c21, c31, c41, c51, y + W * ldy, ldy, rows - W);
    return;
  }
  alignas(64) float out[kGroup][kPanel];
  const R acc[kGroup][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                            {c30, c31}, {c40, c41}, {c50, c51}};
  for (int i = 0; i < kGroup; ++i) {
    Vec::store(out[i], acc[i][0]);
    if constexpr (!half) Vec::store(out[i] + W, acc[i][1]);
  }
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t i = 0; i < cols; ++i) y[j * ldy + i] = out[i][j] + (bias ? bias[i] : 0.f);
}

// The tile y[m0:m1, n0:n1]: its weight rows packed into groups of 6 (the last one padded
// with zero rows), then panel by panel of x, each panel (K x kPanel floats, in L1/L2)
// meeting every group of the tile (in L2) before the next panel is read. With `packed`
// (the whole weight packed once, pack_linear_weight) the tile's groups are read from there.
static void tile_fp32(const float* xp, const float* w, const float* packed, const float* bias,
                      float* y, int64_t M, int64_t K, int64_t N, int64_t m0, int64_t m1,
                      int64_t n0, int64_t n1, float* wp) {
  const int64_t groups = (n1 - n0 + kGroup - 1) / kGroup;
  if (packed != nullptr) {
    wp = const_cast<float*>(packed) + n0 * K;  // n0 is a whole number of groups
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t n = n0 + g * kGroup;
      pack_w_group(w + n * K, K, std::min<int64_t>(kGroup, n1 - n), wp + g * kGroup * K);
    }
  }
  for (int64_t p = m0; p < m1; p += kPanel) {
    const int64_t rows = std::min<int64_t>(kPanel, M - p);
    // The first panel meets each group straight from memory; later ones find it in L2.
    const bool from_memory = packed != nullptr && p == m0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t n = n0 + g * kGroup;
      const int64_t cols = std::min<int64_t>(kGroup, n1 - n);
      const float* bn = bias ? bias + n : nullptr;
      const float* xb = xp + p * K;
      const float* wb = wp + g * kGroup * K;
      float* yb = y + p * N + n;
      if (rows <= Vec::kWidth) {
        if (from_memory) block_panel_x6<true, true>(xb, wb, K, bn, yb, N, rows, cols);
        else block_panel_x6<false, true>(xb, wb, K, bn, yb, N, rows, cols);
      } else {
        if (from_memory) block_panel_x6<true, false>(xb, wb, K, bn, yb, N, rows, cols);
        else block_panel_x6<false, false>(xb, wb, K, bn, yb, N, rows, cols);
      }
    }
  }
}

// y = x w^T (+ bias) over the tiles, from w [N, K] (packed per tile) or a weight packed once.
static void linear_tiled_fp32(const at::Tensor& x, const float* wd, const float* packed,
                              int64_t N, const float* bias, at::Tensor& y) {
  static_assert(kTileRows % kPanel == 0, "a tile holds whole panels");
  static_assert(kTileCols % kGroup == 0, "a tile holds whole weight groups");
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  const int64_t panels = (M + kPanel - 1) / kPanel;
  // 64-byte aligned (the CPU allocator's alignment), and each panel a multiple of 64 bytes.
  auto xp_t = at::empty({panels * kPanel * K}, x.options());
  float* xp = xp_t.data_ptr<float>();
  const float* xd = x.data_ptr<float>();
  parallel_dynamic(panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) pack_x_panel(xd, ldx, M, K, p * kPanel, xp + p * kPanel * K);
  });
  float* yd = y.data_ptr<float>();
  const int64_t tiles_n = (N + kTileCols - 1) / kTileCols;
  const int64_t tiles = (M + kTileRows - 1) / kTileRows * tiles_n;
  parallel_dynamic(tiles, 1, [&](int64_t t0, int64_t t1) {
    // The packed weights of one tile, per thread (reused: no allocation per tile).
    thread_local std::vector<float> wp;
    if (packed == nullptr) wp.resize(static_cast<size_t>((kTileCols + kGroup) * K));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t / tiles_n * kTileRows, n0 = t % tiles_n * kTileCols;
      tile_fp32(xp, wd, packed, bias, yd, M, K, N, m0, std::min(M, m0 + kTileRows), n0,
                std::min(N, n0 + kTileCols), wp.data());
    }
  });
}
#endif

int64_t vector_lanes() {
#ifdef __AVX2__
  return Vec::kWidth;
#else
  return 1;
#endif
}

at::Tensor linear_tiled(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_tiled: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "linear_tiled: x and w of one dtype");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == w.size(0)),
              "linear_tiled: bias [N] expected");
  const int64_t M = x.size(0), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
#ifdef __AVX2__
  if (x.scalar_type() == at::kFloat && M > 0 && x.size(1) > 0) {
    const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
    const at::Tensor wc = w.contiguous();
    const at::Tensor bc = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
    linear_tiled_fp32(xc, wc.data_ptr<float>(), nullptr, N,
                      has_bias ? bc.data_ptr<float>() : nullptr, y);
    return y;
  }
#endif
  const int64_t tiles_n = (N + kTileCols - 1) / kTileCols;
  const int64_t tiles = (M + kTileRows - 1) / kTileRows * tiles_n;
  // The ATen calls in the threads run under the caller's thread-local state (inference
  // mode, grad mode).
  const at::ThreadLocalState state;
  parallel_dynamic(tiles, 1, [&](int64_t t0, int64_t t1) {
    at::ThreadLocalStateGuard guard(state);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t / tiles_n * kTileRows, n0 = t % tiles_n * kTileCols;
      const int64_t m1 = std::min(M, m0 + kTileRows), n1 = std::min(N, n0 + kTileCols);
      at::Tensor out = y.slice(0, m0, m1).slice(1, n0, n1);
      at::Tensor wt = w.slice(0, n0, n1).t();
      if (has_bias)
        at::addmm_out(out, bias->slice(0, n0, n1), x.slice(0, m0, m1), wt);
      else
        at::mm_out(out, x.slice(0, m0, m1), wt);
    }
  });
  return y;
}

// Floats in a weight [N, K] packed by pack_linear_weight (N rounded up to whole groups).
static int64_t packed_linear_numel(int64_t N, int64_t K) {
  const int64_t group = kPackedGroupRows;
  return (N + group - 1) / group * group * K;
}

at::Tensor pack_linear_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "pack_linear_weight: an fp32 CPU weight [N, K] expected");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  auto out = at::empty({packed_linear_numel(N, K)}, wc.options());
#ifdef __AVX2__
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, (N + kGroup - 1) / kGroup, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      pack_w_group(src + g * kGroup * K, K, std::min<int64_t>(kGroup, N - g * kGroup),
                   dst + g * kGroup * K);
  });
#else
  TORCH_CHECK(false, "pack_linear_weight: this build has no AVX2 kernels");
#endif
  return out;
}

at::Tensor linear_packed(at::Tensor x, at::Tensor packed, int64_t N,
                         c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "linear_packed: fp32 CPU x [M, K] expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous() && N > 0 && packed.numel() == packed_linear_numel(N, K),
              "linear_packed: the packed weight does not hold ", N, " x ", K, " floats");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == N &&
                            bias->scalar_type() == at::kFloat),
              "linear_packed: fp32 bias [N] expected");
  auto y = at::empty({M, N}, x.options());
#ifdef __AVX2__
  if (M > 0 && K > 0) {
    const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
    const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
    linear_tiled_fp32(xc, nullptr, packed.data_ptr<float>(), N,
                      has_bias ? bc.data_ptr<float>() : nullptr, y);
  } else {
    y.zero_();
    if (has_bias && M > 0) y.add_(*bias);
  }
#else
  TORCH_CHECK(false, "linear_packed: this build has no AVX2 kernels");
#endif
  return y;
}
