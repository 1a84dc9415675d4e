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
#include <type_traits>
#include <vector>

#include "kernel_parts.h"
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

int64_t linear_rows_grain(int64_t K) {
  return std::max<int64_t>(4, 16384 / std::max<int64_t>(K, 1) / 4 * 4);
}

void linear_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  tile_rows<float>(x, w, nullptr, y, M, K, N, n0, n1);
}

void linear_rows(const float* x, const c10::BFloat16* w, float* y, int64_t M, int64_t K,
                 int64_t N, int64_t n0, int64_t n1) {
  tile_rows<c10::BFloat16>(x, w, nullptr, y, M, K, N, n0, n1);
}

template <typename W>
static void run(const float* x, const W* w, const float* b, float* y, int64_t M, int64_t K,
                int64_t N) {
  // At least ~64 KiB of weights per chunk (amortises the hand-out), about 4 chunks per
  // thread (balance when a thread loses its core for a while).
  const int64_t per = chunk_for_threads(N) / 4 * 4;
  parallel_dynamic(N, std::max(linear_rows_grain(K), per), [&](int64_t n0, int64_t n1) {
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

// y = x w^T (+ bias) for many rows (prefill chunks, mixed steps, decode batches past the
// small-M kernel) as tiles of y handed out to the threads one at a time (parallel_dynamic).
// MKL's own threading splits the matrix statically: when another process takes a core for
// a few ms (Serve's proxy and ingress streaming tokens beside the engine), the other thread
// finishes its half and waits; here it takes over the remaining tiles.
//
// fp32 with AVX2 runs our own register-blocked kernel (below); other dtypes run one
// single-threaded sgemm per tile (MKL runs sequentially inside a parallel region).
constexpr int64_t kTileRows = 256;  // rows of x per tile (at most)
constexpr int64_t kTileCols = 96;   // the sgemm-per-tile path's columns per tile

#ifdef __AVX2__
// Weight rows (output columns) per panel: two vectors (32 with AVX-512, 16 with AVX2).
constexpr int64_t kWPanel = 2 * Vec::kWidth;
#else
constexpr int64_t kWPanel = 16;
#endif

// Panels holding N weight rows (the last one padded).
static int64_t num_panels(int64_t N) { return (N + kWPanel - 1) / kWPanel; }

// Elements in a weight [N, K] packed by pack_linear_weight (N rounded up to whole panels).
static int64_t packed_linear_numel(int64_t N, int64_t K) {
  return num_panels(N) * kWPanel * K;
}

// Panel p of w [N, K]: weight rows [p * kWPanel, (p + 1) * kWPanel), k-major into
// dst[k * kWPanel + j] (rows past N are zeros). Paired (a gate_up weight, N = 2I): the
// panel's first half holds gate rows [p * h, (p + 1) * h), its second half the up rows
// [I + p * h, I + (p + 1) * h), h = kWPanel / 2, so that one panel's two accumulator
// vectors are a gate and its up.
template <typename S, typename D>
static void pack_w_panel(const S* w, int64_t N, int64_t K, int64_t p, D* dst,
                         bool paired = false) {
  constexpr int64_t h = kWPanel / 2;
  for (int64_t j = 0; j < kWPanel; ++j) {
    const int64_t n = paired ? (j < h ? p * h + j : N / 2 + p * h + j - h) : p * kWPanel + j;
    if (n < N) {
      const S* src = w + n * K;
      for (int64_t k = 0; k < K; ++k) dst[k * kWPanel + j] = static_cast<D>(src[k]);
    } else {
      for (int64_t k = 0; k < K; ++k) dst[k * kWPanel + j] = static_cast<D>(0.f);
    }
  }
}

#ifdef __AVX2__
// The kernel computes R rows of x against one panel (R x 32 outputs with AVX-512, R x 16
// with AVX2; R up to kXRows below) over the whole K: per k, two vector loads of the panel
// and R broadcasts of x feed 2R FMAs. x is read where it lies (each row one sequential
// stream, a cache line per 16 k), and the accumulators are rows of y, stored as they are.
// The earlier kernel (x repacked per call into k-major panels of 32 rows against groups of
// 6 weight rows, 12 accumulators, outputs transposed on the way out) spent ~6 % of its
// time repacking x and ~5 % storing, and read 128 bytes of x from L2 per 12 FMAs where
// this one reads 128 bytes of weights per 24. On a 2-core AVX-512 Xeon, the built-in
// model's 30 layers' linears, alternating in one process: 0.90-0.96x the time at 2,048
// rows, 0.86-0.88x at 256, 0.86-0.93x at 128, 0.84-0.93x at 64, 0.79-0.85x at 40
// (~300-315 GFLOP/s at 256-2,048 rows against a torch.mm peak of ~350).
//
// x rows per block: 12 with AVX-512 (24 of its 32 registers), 6 with AVX2 (12 of 16). On
// a 2-core AVX2 EPYC (Zen 3), the 30 layers' linears on packed weights, alternating in one
// process (median of 5): 6 rows 0.88-0.93x the time of 5 at 2,048 rows, even at 64 and
// 256; 4 rows 1.2-1.4x slower. (The AVX2 build run on an AVX-512 Xeon had preferred 5:
// against the kernel before this one, 6 rows 1.08-1.09x its time at 2,048 rows, 5 even.)
constexpr int kXRows = Vec::kWidth == 16 ? 12 : 6;

// How far ahead the first row block prefetches a panel packed once (it meets the panel
// straight from memory). On a 2-core AVX-512 Xeon (fp32, two threads), every linear of the
// built-in model's 30 layers at 64 rows, cold weights, alternating in one process: none
// 64-68 ms, 1 KiB 58, 4 KiB 55-57: without it the block waits on DRAM.
constexpr int64_t kPackedPrefetchBytes = 4096;

// A gate_up weight packed paired (pack_w_panel): its outputs in the plain order, or
// silu(gate) * up (the MLP's activation, fused: half the outputs written, no second pass).
enum class GateUp { kNo, kPlain, kSiluMul };

// Where a block's outputs go: the panel's two vectors of columns to y (row stride ldy) and
// y_hi (y + one vector for a plain weight; the up half's columns for a paired one), with
// the bias at bias and bias_hi; with silu_mul, silu(first) * second to y alone.
struct PanelOut {
  float* y;
  float* y_hi;
  int64_t ldy;
  const float* bias;
  const float* bias_hi;
  bool silu_mul;
};

// sum_k x[r, k] * panel[k, 0:cols] (+ bias) for R rows of x (row stride ldx), stored as
// `o` says; the accumulator arrays are indexed by unrolled constants, so they stay in
// registers (checked in the disassembly: no stack traffic in the k loop). With `prefetch`
// the panel comes from memory and is prefetched kPackedPrefetchBytes ahead; `pf_lines`
// cache lines from `pf` (a share of the next panel) are prefetched into L2 evenly over K,
// so that later row blocks overlap the next panel's DRAM reads with arithmetic: at most
// one line per k, so a share longer than K is cut short (a tile of two row blocks
// prefetches half the next panel; prefetching all of it, two lines per k, was 1.05-1.14x
// slower at 24 rows).
template <int R, bool prefetch, typename WT>
static void block_rows_panel(const float* __restrict__ x, int64_t ldx,
                             const WT* __restrict__ wp, int64_t K, const PanelOut& o,
                             int64_t cols, const char* pf, int64_t pf_lines) {
  constexpr int W = Vec::kWidth;
  using V = Vec::T;
  V c0[R], c1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = Vec::zero();
  const int64_t pf_every = pf_lines > 0 ? std::max<int64_t>(1, K / pf_lines) : K + 1;
  int64_t pf_next = 0, pf_done = 0;
  for (int64_t k = 0; k < K; ++k) {
    const WT* a = wp + k * kWPanel;
    if constexpr (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(a) + kPackedPrefetchBytes, _MM_HINT_T0);
      if constexpr (kWPanel * sizeof(WT) > 64)
        _mm_prefetch(reinterpret_cast<const char*>(a) + kPackedPrefetchBytes + 64, _MM_HINT_T0);
    }
    if (k == pf_next && pf_done < pf_lines) {
      _mm_prefetch(pf + 64 * pf_done, _MM_HINT_T1);
      ++pf_done;
      pf_next += pf_every;
    }
    const V w0 = Vec::load(a), w1 = Vec::load(a + W);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const V b = Vec::set1(x[r * ldx + k]);
      c0[r] = Vec::fma(b, w0, c0[r]);
      c1[r] = Vec::fma(b, w1, c1[r]);
    }
  }
  const int64_t ldy = o.ldy;
  if (cols == kWPanel) {
    V b0 = Vec::zero(), b1 = b0;
    if (o.bias != nullptr) b0 = Vec::load(o.bias), b1 = Vec::load(o.bias_hi);
    if (o.silu_mul) {  // as silu_and_mul (cpu_fused.cpp) computes it: the same values
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r)
        Vec::store(o.y + r * ldy,
                   Vec::mul(kvray::silu<Vec>(Vec::add(c0[r], b0)), Vec::add(c1[r], b1)));
      return;
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      Vec::store(o.y + r * ldy, Vec::add(c0[r], b0));
      Vec::store(o.y_hi + r * ldy, Vec::add(c1[r], b1));
    }
    return;
  }
  alignas(64) float out[kWPanel];  // the last panel of a plain weight: its `cols` outputs
  for (int r = 0; r < R; ++r) {
    Vec::store(out, c0[r]);
    Vec::store(out + W, c1[r]);
    for (int64_t j = 0; j < cols; ++j) o.y[r * ldy + j] = out[j] + (o.bias ? o.bias[j] : 0.f);
  }
}

// block_rows_panel for `rows` (1..kXRows) rows.
template <bool prefetch, typename WT>
static void block_rows_any(int64_t rows, const float* x, int64_t ldx, const WT* wp,
                           int64_t K, const PanelOut& o, int64_t cols, const char* pf,
                           int64_t pf_lines) {
#define KVRAY_ROWS(n)                                                      \
  case n:                                                                  \
    block_rows_panel<n, prefetch, WT>(x, ldx, wp, K, o, cols, pf, pf_lines);  \
    break;
  switch (rows) {
    KVRAY_ROWS(1) KVRAY_ROWS(2) KVRAY_ROWS(3) KVRAY_ROWS(4) KVRAY_ROWS(5) KVRAY_ROWS(6)
#if defined(__AVX512F__)
    KVRAY_ROWS(7) KVRAY_ROWS(8) KVRAY_ROWS(9) KVRAY_ROWS(10) KVRAY_ROWS(11)
    KVRAY_ROWS(12)
#endif
    default: break;
  }
#undef KVRAY_ROWS
}

// Panels of weights in one tile of y: their rows of x are read from L2 once per panel.
constexpr int64_t kTilePanels = 3;

// y = x w^T (+ bias), fp32, from a weight packed once (`packed`, pack_linear_weight's
// layout) or a plain w [N, K] whose panels each tile packs for itself (~1/(2 * rows) of
// the tile's arithmetic). Tiles of y: up to 256 rows of x (fewer for long K, so that they
// stay in L2) x kTilePanels panels, taken by the threads one at a time; within a tile,
// panel by panel, row blocks of kXRows (the last two split evenly: no block of a few rows).
template <typename WT = float>
static void linear_fp32(const float* x, int64_t ldx, const float* w, const WT* packed,
                        const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                        GateUp gate_up = GateUp::kNo) {
  const bool paired = gate_up != GateUp::kNo;
  const bool silu_mul = gate_up == GateUp::kSiluMul;
  const int64_t ldy = silu_mul ? N / 2 : N;
  const int64_t tile_rows = std::max<int64_t>(
      kXRows, std::min<int64_t>(kTileRows, 196608 / std::max<int64_t>(K, 1) / kXRows * kXRows));
  const int64_t panels = num_panels(N);
  const int64_t tiles_n = (panels + kTilePanels - 1) / kTilePanels;
  const int64_t tiles = (M + tile_rows - 1) / tile_rows * tiles_n;
  const int64_t panel_lines = kWPanel * K * static_cast<int64_t>(sizeof(WT)) / 64;
  parallel_dynamic(tiles, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<WT> buf;  // a panel packed here (plain fp32 weights)
    if (packed == nullptr) buf.resize(static_cast<size_t>(kWPanel * K));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t / tiles_n * tile_rows, m1 = std::min(M, m0 + tile_rows);
      const int64_t q0 = t % tiles_n * kTilePanels, q1 = std::min(panels, q0 + kTilePanels);
      for (int64_t q = q0; q < q1; ++q) {
        const WT* wp = buf.data();
        if (packed != nullptr) wp = packed + q * kWPanel * K;
        else if constexpr (std::is_same_v<WT, float>)  // (bf16 weights come packed)
          pack_w_panel(w, N, K, q, buf.data(), paired);
        const int64_t n = q * kWPanel, cols = std::min<int64_t>(kWPanel, N - n);
        // The panel's columns: [n, n + kWPanel) of a plain weight; of a paired one
        // [q * W, (q + 1) * W) and the same columns of the up half.
        const int64_t lo = paired ? q * Vec::kWidth : n;
        const int64_t hi = paired ? N / 2 + lo : n + Vec::kWidth;
        // A panel packed once comes from memory: the first row block prefetches it ahead,
        // the others share the prefetching of the next panel.
        const int64_t blocks = (m1 - m0 + kXRows - 1) / kXRows;
        const char* next = packed != nullptr && q + 1 < panels
                               ? reinterpret_cast<const char*>(wp + kWPanel * K) : nullptr;
        const int64_t share =
            next != nullptr && blocks > 1 ? (panel_lines + blocks - 2) / (blocks - 1) : 0;
        for (int64_t m = m0, i = 0; m < m1; ++i) {
          int64_t rows = std::min<int64_t>(kXRows, m1 - m);
          if (m1 - m > kXRows && m1 - m < 2 * kXRows) rows = (m1 - m + 1) / 2;
          const int64_t first = (i - 1) * share;
          const int64_t lines =
              i == 0 ? 0 : std::max<int64_t>(0, std::min(share, panel_lines - first));
          const char* pf = lines > 0 ? next + 64 * first : nullptr;
          const PanelOut o{y + m * ldy + lo, y + m * ldy + hi, ldy,
                           bias ? bias + lo : nullptr, bias ? bias + hi : nullptr, silu_mul};
          if (packed != nullptr && i == 0)
            block_rows_any<true>(rows, x + m * ldx, ldx, wp, K, o, cols, pf, lines);
          else
            block_rows_any<false>(rows, x + m * ldx, ldx, wp, K, o, cols, pf, lines);
          m += rows;
        }
      }
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
    linear_fp32<float>(xc.data_ptr<float>(), xc.stride(0), wc.data_ptr<float>(), nullptr,
                has_bias ? bc.data_ptr<float>() : nullptr, y.data_ptr<float>(), M,
                xc.size(1), N);
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

static at::Tensor pack_weight(const at::Tensor& w, bool paired, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              name, ": an fp32 or bf16 CPU weight [N, K] expected");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1);
  TORCH_CHECK(!paired || N % kWPanel == 0, name, ": N (", N,
              ") must be a whole number of panels: twice ", kWPanel / 2, " x a count");
  auto out = at::empty({packed_linear_numel(N, K)}, wc.options());
  const auto pack_all = [&](auto* dst, const auto* src) {
    at::parallel_for(0, num_panels(N), 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        pack_w_panel(src, N, K, p, dst + p * kWPanel * K, paired);
    });
  };
  if (wc.scalar_type() == at::kFloat)
    pack_all(out.data_ptr<float>(), wc.data_ptr<float>());
  else  // a bf16 weight packs as bf16: half the bytes, widened exactly in the kernel
    pack_all(out.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>());
  return out;
}

at::Tensor pack_linear_weight(at::Tensor w) {
  return pack_weight(w, false, "pack_linear_weight");
}

at::Tensor pack_gate_up_weight(at::Tensor w) {
  return pack_weight(w, true, "pack_gate_up_weight");
}

static at::Tensor packed_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                                const c10::optional<at::Tensor>& bias, int gate_up,
                                const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              name, ": fp32 CPU x [M, K] expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 1 &&
                  (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16) &&
                  packed.is_contiguous() && N > 0 && packed.numel() == packed_linear_numel(N, K),
              name, ": the packed weight does not hold ", N, " x ", K, " fp32 or bf16 values");
  TORCH_CHECK(gate_up == 0 || N % kWPanel == 0, name, ": N (", N,
              ") is not a paired gate_up weight's");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == N &&
                            bias->scalar_type() == at::kFloat),
              name, ": fp32 bias [N] expected");
  const bool silu_mul = gate_up == 2;
  auto y = at::empty({M, silu_mul ? N / 2 : N}, x.options());
#ifdef __AVX2__
  if (M > 0 && K > 0) {
    const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
    const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
    const GateUp mode = gate_up == 0 ? GateUp::kNo : silu_mul ? GateUp::kSiluMul : GateUp::kPlain;
    const float* b = has_bias ? bc.data_ptr<float>() : nullptr;
    if (packed.scalar_type() == at::kFloat)
      linear_fp32(xc.data_ptr<float>(), xc.stride(0), nullptr, packed.data_ptr<float>(), b,
                  y.data_ptr<float>(), M, K, N, mode);
    else
      linear_fp32(xc.data_ptr<float>(), xc.stride(0), nullptr,
                  packed.data_ptr<c10::BFloat16>(), b, y.data_ptr<float>(), M, K, N, mode);
  } else {
    y.zero_();
    if (has_bias && M > 0 && !silu_mul) y.add_(*bias);
    if (has_bias && M > 0 && silu_mul) {
      const at::Tensor g = bias->slice(0, 0, N / 2), u = bias->slice(0, N / 2, N);
      y.copy_((at::silu(g) * u).expand({M, N / 2}));
    }
  }
#else
  TORCH_CHECK(false, name, ": this build has no AVX2 kernels");
#endif
  return y;
}

at::Tensor linear_packed(at::Tensor x, at::Tensor packed, int64_t N,
                         c10::optional<at::Tensor> bias) {
  return packed_matmul(x, packed, N, bias, 0, "linear_packed");
}

at::Tensor linear_packed_gate_up(at::Tensor x, at::Tensor packed, int64_t N,
                                 c10::optional<at::Tensor> bias, bool silu_mul) {
  return packed_matmul(x, packed, N, bias, silu_mul ? 2 : 1, "linear_packed_gate_up");
}
