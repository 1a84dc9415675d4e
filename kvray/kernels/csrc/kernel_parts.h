// Pieces of kvray's CPU ops that other ops run inside their own parallel loops (not bound to
// Python): the small-M linear's rows and the quantized linear's tiles, so that one call can
// run several products (a MoE layer's experts, cpu_moe.cpp) in one pass over the threads.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <memory>

// Rows [n0, n1) of y = x w^T for M rows of fp32 x [M, K] (y [M, N]), by linear_small_m's
// kernel: each weight row read once for all M rows.
void linear_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n0, int64_t n1);
void linear_rows(const float* x, const c10::BFloat16* w, float* y, int64_t M, int64_t K,
                 int64_t N, int64_t n0, int64_t n1);
// Weight rows per chunk of linear_rows worth handing to a thread (~16 KiB of fp32 weights).
int64_t linear_rows_grain(int64_t K);

// silu(g) * u for one row of I (fp32), as silu_and_mul computes it.
void silu_and_mul_f32(const float* g, const float* u, float* o, int64_t I);

// linear_q's kernel in two steps: the constructor reads the blob (which must outlive this)
// and quantizes x's M rows; run(t0, t1, y) writes the columns of y = x W^T (+ bias)
// [M, out_features()] of the weight's tiles [t0, t1) (8 weight rows each). Needs AVX2
// (quant_dot() != "none").
class QuantProduct {
 public:
  QuantProduct(const at::Tensor& blob, const float* x, int64_t ldx, int64_t M,
               const float* bias);
  ~QuantProduct();
  int64_t tiles() const;
  int64_t grain() const;  // tiles per chunk worth handing to a thread (~16 KiB of codes)
  int64_t out_features() const;
  int64_t in_features() const;
  void run(int64_t t0, int64_t t1, float* y) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};
