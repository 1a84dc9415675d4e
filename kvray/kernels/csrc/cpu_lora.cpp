// Batched LoRA for a batch whose rows run different adapters (kvray/kernels/lora.py says
// the layout): rows grouped by slot, then per (slot, slice, 4 rows) the shrink t = x A^T
// (each chunk of an A row loaded once for the 4 rows) and per (slot, 64 output columns) the
// expand y += t B^T with B stored transposed in blocks of 64 columns (one block is one
// contiguous read): broadcast-FMA along the output, the block's sums in registers.
// fp32 math; x/y fp32 or bf16 (y rounded once), adapter weights fp32 or bf16.
#include "ops.h"

#include <algorithm>
#include <array>
#include <vector>

#include "vec.h"

namespace {

#if defined(__AVX512F__)
using V = kvray::Vec16;
#elif defined(__AVX2__)
using V = kvray::Vec8;
#endif

constexpr int64_t kRowBlock = 4;  // x rows sharing each load of an A row (shrink)
constexpr int64_t kColBlock = 64;  // output columns kept in registers (expand)

// out[m][j] = x_m . w_j for the kRows rows x_m (stride K) and j in [0, r): each chunk of a
// w row is loaded once for all the rows (independent FMA chains, one per row, in registers).
template <int kRows, typename TW>
void shrink_rows(const float* x, const TW* w, int64_t r, int64_t K, float* out,
                 int64_t out_stride) {
  for (int64_t j = 0; j < r; ++j) {
    const TW* wj = w + j * K;
    float sums[kRows];
    for (int m = 0; m < kRows; ++m) sums[m] = 0.f;
    int64_t k = 0;
#if defined(__AVX2__)
    typename V::T acc[kRows];
    for (int m = 0; m < kRows; ++m) acc[m] = V::zero();
    for (; k + V::kWidth <= K; k += V::kWidth) {
      const typename V::T wv = V::load(wj + k);
      for (int m = 0; m < kRows; ++m) acc[m] = V::fma(V::load(x + m * K + k), wv, acc[m]);
    }
    for (int m = 0; m < kRows; ++m) sums[m] = V::sum(acc[m]);
#endif
    for (; k < K; ++k) {
      const float wk = kvray::widen(wj[k]);
      for (int m = 0; m < kRows; ++m) sums[m] += x[m * K + k] * wk;
    }
    for (int m = 0; m < kRows; ++m) out[m * out_stride + j] = sums[m];
  }
}

template <typename TW>
void shrink_block(const float* x, int64_t n, const TW* w, int64_t r, int64_t K, float* out,
                  int64_t out_stride) {
  switch (n) {
    case 1: return shrink_rows<1>(x, w, r, K, out, out_stride);
    case 2: return shrink_rows<2>(x, w, r, K, out, out_stride);
    case 3: return shrink_rows<3>(x, w, r, K, out, out_stride);
    default: return shrink_rows<4>(x, w, r, K, out, out_stride);
  }
}

// y[c] += sum_j t[j] * b[j * kColBlock + c] for c in [0, width <= kColBlock): the block's
// sums in registers across the r rows of b (one column block of B^T, contiguous).
template <typename TX, typename TW>
void expand_block(TX* y, const float* t, const TW* b, int64_t r, int64_t width) {
  constexpr int64_t N = kColBlock;
  float acc_mem[kColBlock];
  int64_t c = 0;
#if defined(__AVX2__)
  constexpr int64_t kVecs = kColBlock / V::kWidth;
  if (width == kColBlock) {
    typename V::T acc[kVecs];
    for (int64_t v = 0; v < kVecs; ++v) acc[v] = V::zero();
    for (int64_t j = 0; j < r; ++j) {
      const typename V::T tj = V::set1(t[j]);
      const TW* bj = b + j * N;
      for (int64_t v = 0; v < kVecs; ++v)
        acc[v] = V::fma(tj, V::load(bj + v * V::kWidth), acc[v]);
    }
    for (int64_t v = 0; v < kVecs; ++v) V::store(acc_mem + v * V::kWidth, acc[v]);
    c = kColBlock;
  }
#endif
  if (c < width) {
    for (int64_t q = 0; q < width; ++q) acc_mem[q] = 0.f;
    for (int64_t j = 0; j < r; ++j)
      for (int64_t q = 0; q < width; ++q) acc_mem[q] += t[j] * kvray::widen(b[j * N + q]);
  }
  for (int64_t q = 0; q < width; ++q)
    y[q] = static_cast<TX>(static_cast<float>(y[q]) + acc_mem[q]);
}

template <typename TX, typename TW>
void lora_add_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
                   const at::Tensor& ranks, const std::vector<int64_t>& starts,
                   const at::Tensor& row_slots) {
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t S = a.size(0), n_slices = a.size(1), R = a.size(2);
  const int64_t* slot_of = row_slots.data_ptr<int64_t>();
  const int64_t* rank = ranks.data_ptr<int64_t>();
  // rows grouped by slot (counting sort): slot s's rows are order[begin[s] .. begin[s + 1])
  std::vector<int64_t> begin(S + 1, 0), order(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slot_of[t];
    TORCH_CHECK(s >= -1 && s < S, "lora_add: row slot ", s, " outside [-1, ", S, ")");
    if (s >= 0) ++begin[s + 1];
  }
  for (int64_t s = 0; s < S; ++s) begin[s + 1] += begin[s];
  const int64_t num_rows = begin[S];
  if (num_rows == 0) return;
  std::vector<int64_t> fill(begin.begin(), begin.end() - 1);
  for (int64_t t = 0; t < T; ++t)
    if (slot_of[t] >= 0) order[fill[slot_of[t]]++] = t;
  // the grouped rows of x in fp32, and their shrunk t [rows, slices, R]
  std::vector<float> xf(num_rows * K), shrunk(num_rows * n_slices * R, 0.f);
  const TX* xp = x.data_ptr<TX>();
  const int64_t x_stride = x.stride(0), y_stride = y.stride(0);
  for (int64_t i = 0; i < num_rows; ++i) {
    const TX* row = xp + order[i] * x_stride;
    for (int64_t k = 0; k < K; ++k) xf[i * K + k] = static_cast<float>(row[k]);
  }
  const TW* ap = a.data_ptr<TW>();
  const TW* bp = bt.data_ptr<TW>();
  // shrink: one item per (slot, slice, block of up to kRowBlock of its rows)
  std::vector<std::array<int64_t, 3>> shrink_items;  // slot, slice, first grouped row
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < n_slices; ++i)
      if (rank[s * n_slices + i] > 0)
        for (int64_t m = begin[s]; m < begin[s + 1]; m += kRowBlock)
          shrink_items.push_back({s, i, m});
  parallel_dynamic(static_cast<int64_t>(shrink_items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      const auto [s, i, m] = shrink_items[it];
      const int64_t n = std::min(kRowBlock, begin[s + 1] - m);
      shrink_block(xf.data() + m * K, n, ap + (s * n_slices + i) * R * K,
                  rank[s * n_slices + i], K, shrunk.data() + (m * n_slices + i) * R,
                  n_slices * R);
    }
  });
  // expand: one item per (slot, column block of B^T, slice): a block straddling two slices
  // is two items, each of its own columns
  std::vector<std::array<int64_t, 4>> expand_items;  // slot, slice, first column, end
  for (int64_t s = 0; s < S; ++s) {
    if (begin[s + 1] == begin[s]) continue;
    for (int64_t i = 0; i < n_slices; ++i) {
      if (rank[s * n_slices + i] == 0) continue;
      for (int64_t c = starts[i]; c < starts[i + 1]; c = (c / kColBlock + 1) * kColBlock)
        expand_items.push_back({s, i, c, std::min(starts[i + 1], (c / kColBlock + 1) *
                                                                     kColBlock)});
    }
  }
  TX* yp = y.data_ptr<TX>();
  const int64_t NB = bt.size(1);
  parallel_dynamic(static_cast<int64_t>(expand_items.size()), 4, [&](int64_t lo, int64_t hi) {
    for (int64_t it = lo; it < hi; ++it) {
      const auto [s, i, c0, c1] = expand_items[it];
      const int64_t r = rank[s * n_slices + i];
      const TW* block = bp + ((s * NB + c0 / kColBlock) * R) * kColBlock + c0 % kColBlock;
      for (int64_t m = begin[s]; m < begin[s + 1]; ++m)
        expand_block(yp + order[m] * y_stride + c0, shrunk.data() + (m * n_slices + i) * R,
                     block, r, c1 - c0);
    }
  });
}

}  // namespace

at::Tensor lora_add(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor bt, at::Tensor ranks,
                    std::vector<int64_t> slice_starts, at::Tensor row_slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 &&
              y.stride(1) == 1 && x.scalar_type() == y.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "lora_add: x [T, K] and y [T, N] of one dtype (fp32 or bf16), unit stride");
  TORCH_CHECK(a.dim() == 4 && a.is_contiguous() && bt.dim() == 4 && bt.is_contiguous() &&
              a.scalar_type() == bt.scalar_type() &&
              (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) &&
              a.size(0) == bt.size(0) && a.size(2) == bt.size(2) && a.size(3) == x.size(1) &&
              bt.size(3) == kColBlock && bt.size(1) * kColBlock >= y.size(1),
              "lora_add: a [S, slices, R, K] and bt [S, ceil(N / 64), R, 64] (fp32 or bf16, "
              "contiguous)");
  const int64_t n_slices = a.size(1);
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.is_contiguous() &&
              ranks.dim() == 2 && ranks.size(0) == a.size(0) && ranks.size(1) == n_slices,
              "lora_add: int64 ranks [S, slices]");
  TORCH_CHECK(static_cast<int64_t>(slice_starts.size()) == n_slices + 1 &&
              slice_starts.front() == 0 && slice_starts.back() == y.size(1) &&
              std::is_sorted(slice_starts.begin(), slice_starts.end()),
              "lora_add: slice_starts [0, ..., N] ascending, one more than the slices");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.is_contiguous() &&
              row_slots.numel() == x.size(0), "lora_add: int64 row_slots [T]");
  const int64_t* rank = ranks.data_ptr<int64_t>();
  for (int64_t k = 0; k < ranks.numel(); ++k)
    TORCH_CHECK(rank[k] >= 0 && rank[k] <= a.size(2), "lora_add: a rank outside [0, R]");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "lora_add", [&] {
    using TX = scalar_t;
    if (a.scalar_type() == at::kFloat)
      lora_add_impl<TX, float>(y, x, a, bt, ranks, slice_starts, row_slots);
    else
      lora_add_impl<TX, c10::BFloat16>(y, x, a, bt, ranks, slice_starts, row_slots);
  });
  return y;
}
