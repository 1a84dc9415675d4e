// A MoE layer's experts for a few tokens in one call (built by kvray/kernels/cpu_ops.py).
//
// The Python layer (kvray/models/moe.py) runs each active expert as its own ops: gather its
// rows, gate/up, SiLU-and-mul, down, scale, index_add. At batch 1 on a Qwen3-MoE-shaped
// model (top-4 of 32 narrow experts) that is some 30 calls per layer whose overhead, not
// the weights' bytes, set the step time. Here the routed (token, weight) pairs are grouped
// by expert, then one parallel pass runs every active expert's gate/up rows (the threads
// share the union of the experts' weight rows, each thread one stream through it), the
// activation follows per expert, a second pass runs the down rows, and the rows are added
// into the output scaled by their routing weights, experts in ascending order (as the
// Python loop's index_add). The products are linear_small_m's and linear_q's own kernels
// (kernel_parts.h): the same values as those ops give each expert's rows.
//
// moe_route computes the routing itself (router linear, softmax, top-k, renormalisation and
// Qwen2-MoE's shared-expert gate) and moe_mlp a whole MoE MLP (routing, experts, shared
// expert) for the fused decode layer (cpu_layer.cpp); the Python layer routes through the
// same moe_route, so both paths give the same values.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "kernel_parts.h"
#include "ops.h"

namespace {

// One product of a pass: `units` weight rows (dense) or tiles (quantized), run by ranges.
struct Product {
  int64_t units = 0, grain = 1;
  std::function<void(int64_t, int64_t)> run;
};

// Every product's units in one pass over the threads: units numbered product after product,
// each thread taking a contiguous run of them (the weights read as one stream).
void run_products(const std::vector<Product>& products) {
  int64_t total = 0, grain = 1;
  for (const Product& p : products) total += p.units, grain = std::max(grain, p.grain);
  parallel_streams(total, std::max(grain, chunk_for_threads(total)),
                   [&](int64_t c0, int64_t c1) {
    int64_t first = 0;
    for (const Product& p : products) {
      const int64_t lo = std::max(c0, first), hi = std::min(c1, first + p.units);
      if (lo < hi) p.run(lo - first, hi - first);
      first += p.units;
    }
  });
}

// One local expert's routed rows, and its buffers.
struct ExpertRows {
  int64_t local = 0;
  std::vector<int64_t> tokens;
  std::vector<float> weights;
  at::Tensor x, gate_up, act, down;  // [M, H], [M, 2I], [M, I], [M, H] fp32
};

// The routed pairs grouped by local expert (ascending), tokens ascending within each, and
// each expert's rows of x gathered.
std::vector<ExpertRows> group_rows(const at::Tensor& x, const at::Tensor& weights,
                                   const at::Tensor& experts, const at::Tensor& local_index,
                                   int64_t num_local) {
  const int64_t T = experts.size(0), k = experts.size(1), E = local_index.numel();
  const int64_t* ep = experts.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  const int64_t* lp = local_index.data_ptr<int64_t>();
  std::vector<ExpertRows> by_local(num_local);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ep[t * k + j];
      TORCH_CHECK(e >= 0 && e < E, "moe_experts: expert id ", e, " of ", E);
      if (lp[e] < 0) continue;  // another rank's expert
      by_local[lp[e]].tokens.push_back(t);
      by_local[lp[e]].weights.push_back(wp[t * k + j]);
    }
  std::vector<ExpertRows> active;
  const int64_t H = x.size(1);
  const float* xp = x.data_ptr<float>();
  for (int64_t l = 0; l < num_local; ++l) {
    if (by_local[l].tokens.empty()) continue;
    ExpertRows r = std::move(by_local[l]);
    r.local = l;
    const int64_t M = static_cast<int64_t>(r.tokens.size());
    r.x = at::empty({M, H}, x.options());  // (a row copy: index_select costs ~5 us a call)
    float* dst = r.x.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      std::memcpy(dst + m * H, xp + r.tokens[m] * H, H * sizeof(float));
    active.push_back(std::move(r));
  }
  return active;
}

// x's columns in a quantized weight's stored order (GPTQ act-order), when it has one;
// index K (one past x's columns) reads zeros, a TP shard's padding (quant.tensor's
// gather_input).
at::Tensor permuted(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& perms,
                    size_t i) {
  if (i >= perms.size() || !perms[i].has_value() || !perms[i]->defined()) return x;
  const at::Tensor& perm = *perms[i];
  const at::Tensor src = perm.numel() > x.size(1) ? at::constant_pad_nd(x, {0, 1}) : x;
  return src.index_select(1, perm).contiguous();
}

// The experts' weights as the op takes them: stacked dense [experts, N, K] (fp32 or bf16),
// or one quantized blob per local expert.
struct Weights {
  at::Tensor dense;
  const std::vector<at::Tensor>* blobs = nullptr;
};

template <typename W>
Product dense_product(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N) {
  return {N, linear_rows_grain(K),
          [=](int64_t n0, int64_t n1) { linear_rows(x, w, y, M, K, N, n0, n1); }};
}

// The products of one pass over the active experts: gate/up of their rows of x, or down of
// their activations; the outputs allocated here, the quantized products kept in `keep`.
std::vector<Product> pass(std::vector<ExpertRows>& rows, const Weights& w, bool gate_up,
                          const std::vector<c10::optional<at::Tensor>>& perms,
                          std::vector<std::unique_ptr<QuantProduct>>& keep) {
  std::vector<Product> products;
  for (ExpertRows& r : rows) {
    at::Tensor& in = gate_up ? r.x : r.act;
    at::Tensor& out = gate_up ? r.gate_up : r.down;
    const int64_t M = in.size(0), K = in.size(1);
    if (w.blobs != nullptr) {
      in = permuted(in, perms, 2 * r.local + (gate_up ? 0 : 1));
      keep.push_back(std::make_unique<QuantProduct>(w.blobs->at(r.local), in.data_ptr<float>(),
                                                    K, M, nullptr));
      const QuantProduct* p = keep.back().get();
      TORCH_CHECK(p->in_features() == K, "moe_experts_q: local expert ", r.local, "'s ",
                  gate_up ? "gate/up" : "down", " takes ", p->in_features(),
                  " columns, its input has ", K);
      out = at::empty({M, p->out_features()}, in.options());
      float* y = out.data_ptr<float>();
      products.push_back({p->tiles(), p->grain(), [p, y](int64_t t0, int64_t t1) {
                            p->run(t0, t1, y);
                          }});
      continue;
    }
    const int64_t N = w.dense.size(1), offset = r.local * N * K;
    TORCH_CHECK(w.dense.size(2) == K, "moe_experts: the ", gate_up ? "w13" : "w2",
                " weights take ", w.dense.size(2), " columns, the input has ", K);
    out = at::empty({M, N}, in.options());
    const float* x = in.data_ptr<float>();
    float* y = out.data_ptr<float>();
    if (w.dense.scalar_type() == at::kFloat)
      products.push_back(dense_product(x, w.dense.data_ptr<float>() + offset, y, M, K, N));
    else
      products.push_back(
          dense_product(x, w.dense.data_ptr<c10::BFloat16>() + offset, y, M, K, N));
  }
  return products;
}

at::Tensor moe_experts_impl(const at::Tensor& x, const at::Tensor& weights,
                            const at::Tensor& experts, const at::Tensor& local_index,
                            const Weights& w13, const Weights& w2, int64_t num_local,
                            const std::vector<c10::optional<at::Tensor>>& perms) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "moe_experts: contiguous fp32 x [T, H] expected");
  TORCH_CHECK(experts.dim() == 2 && experts.size(0) == x.size(0) &&
                  experts.scalar_type() == at::kLong && experts.is_contiguous() &&
                  weights.sizes() == experts.sizes() && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(),
              "moe_experts: routing weights (fp32) and expert ids (int64) [T, k] expected");
  TORCH_CHECK(local_index.dim() == 1 && local_index.scalar_type() == at::kLong &&
                  local_index.is_contiguous(),
              "moe_experts: local_index int64 [experts] expected");
  const int64_t* lp = local_index.data_ptr<int64_t>();
  for (int64_t e = 0; e < local_index.numel(); ++e)
    TORCH_CHECK(lp[e] < num_local, "moe_experts: expert ", e, " maps to local expert ",
                lp[e], " of ", num_local);
  std::vector<ExpertRows> rows = group_rows(x, weights, experts, local_index, num_local);
  std::vector<std::unique_ptr<QuantProduct>> keep;
  run_products(pass(rows, w13, true, perms, keep));
  for (ExpertRows& r : rows) {
    const int64_t M = r.gate_up.size(0), I = r.gate_up.size(1) / 2;
    r.act = at::empty({M, I}, x.options());
    const float* g = r.gate_up.data_ptr<float>();
    float* a = r.act.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      silu_and_mul_f32(g + m * 2 * I, g + m * 2 * I + I, a + m * I, I);
  }
  run_products(pass(rows, w2, false, perms, keep));
  auto out = at::zeros_like(x);
  const int64_t H = x.size(1);
  float* op = out.data_ptr<float>();
  for (const ExpertRows& r : rows) {
    TORCH_CHECK(r.down.size(1) == H, "moe_experts: the down weights give ", r.down.size(1),
                " columns, x has ", H);
    const float* y = r.down.data_ptr<float>();
    for (size_t m = 0; m < r.tokens.size(); ++m) {
      float* o = op + r.tokens[m] * H;
      const float w = r.weights[m];
      for (int64_t h = 0; h < H; ++h) o[h] += y[m * H + h] * w;
    }
  }
  return out;
}

// Each row's top_k of softmax(logits[:E]) (k passes of a strict >: the first of equal
// values wins, and a NaN is never picked over a number), renormalised over the k when asked;
// with a shared gate, sigmoid(logits[E]) per row.
void route_rows(const at::Tensor& logits, int64_t E, int64_t top_k, bool renormalize,
                float* weights, int64_t* experts, float* shared_scale) {
  const int64_t T = logits.size(0), width = logits.size(1);
  const float* lp = logits.data_ptr<float>();
  std::vector<float> p(E);
  std::vector<char> taken(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = lp + t * width;
    float mx = l[0], sum = 0.f;
    for (int64_t e = 1; e < E; ++e) mx = l[e] > mx ? l[e] : mx;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
    std::fill(taken.begin(), taken.end(), 0);
    float chosen = 0.f;
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      experts[t * top_k + j] = best;
      chosen += (weights[t * top_k + j] = p[best] / sum);
    }
    if (renormalize)
      for (int64_t j = 0; j < top_k; ++j) weights[t * top_k + j] /= chosen;
    if (shared_scale != nullptr) shared_scale[t] = 1.f / (1.f + std::exp(-l[E]));
  }
}

// y = x w^T for a quantized blob (linear_q) or a dense fp32 / bf16 weight (linear_small_m).
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w) {
  return w.scalar_type() == at::kByte ? linear_q(x, w, c10::nullopt)
                                      : linear_small_m(x, w, c10::nullopt);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route(at::Tensor x, at::Tensor router,
                                                         int64_t top_k, bool renormalize,
                                                         bool shared_gate) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "moe_route: contiguous fp32 x [T, H] expected");
  TORCH_CHECK(router.dim() == 2 && router.size(1) == x.size(1),
              "moe_route: router weights [experts (+ 1 shared gate), H] expected");
  const int64_t T = x.size(0), E = router.size(0) - (shared_gate ? 1 : 0);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_route: top_k ", top_k, " of ", E, " experts");
  const at::Tensor logits = linear_small_m(x, router, c10::nullopt);
  auto weights = at::empty({T, top_k}, x.options());
  auto experts = at::empty({T, top_k}, x.options().dtype(at::kLong));
  at::Tensor scale = shared_gate ? at::empty({T, 1}, x.options()) : at::Tensor();
  route_rows(logits, E, top_k, renormalize, weights.data_ptr<float>(),
             experts.data_ptr<int64_t>(), shared_gate ? scale.data_ptr<float>() : nullptr);
  return {weights, experts, scale};
}

at::Tensor moe_mlp(const at::Tensor& x, const std::vector<at::Tensor>& moe,
                   const std::vector<int64_t>& dims) {
  TORCH_CHECK(dims.size() == 4 && moe.size() >= 7,
              "moe_mlp: [router, local_index, counts, shared gate_up, shared down, experts...] "
              "and dims [top_k, renormalize, local experts, count] expected");
  const at::Tensor &router = moe[0], &local_index = moe[1], &counts = moe[2],
                   &shared_gate_up = moe[3], &shared_down = moe[4];
  const bool shared = shared_gate_up.numel() > 0;
  const int64_t num_local = dims[2];
  auto [weights, experts, scale] = moe_route(x, router, dims[0], dims[1] != 0, shared);
  if (dims[3] != 0) {  // the routing into this layer's token counters
    TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 1 &&
                    counts.is_contiguous() && counts.numel() == local_index.numel(),
                "moe_mlp: int64 counts [experts] expected");
    int64_t* cp = counts.data_ptr<int64_t>();
    const int64_t* ep = experts.data_ptr<int64_t>();
    for (int64_t i = 0; i < experts.numel(); ++i) ++cp[ep[i]];
  }
  at::Tensor out;
  if (moe[5].dim() == 3) {  // stacked dense experts
    TORCH_CHECK(moe.size() == 7, "moe_mlp: stacked w13 and w2 expected");
    out = moe_experts(x, weights, experts, local_index, moe[5], moe[6]);
  } else {  // a blob per matrix, then optionally their input permutations (none: empty)
    const int64_t n = static_cast<int64_t>(moe.size()) - 5;
    TORCH_CHECK(n == 2 * num_local || n == 4 * num_local,
                "moe_mlp: a w13 and a w2 blob per local expert (and two permutations each)");
    std::vector<at::Tensor> w13(moe.begin() + 5, moe.begin() + 5 + num_local),
        w2(moe.begin() + 5 + num_local, moe.begin() + 5 + 2 * num_local);
    std::vector<c10::optional<at::Tensor>> perms;
    for (int64_t i = 5 + 2 * num_local; i < static_cast<int64_t>(moe.size()); ++i)
      perms.emplace_back(moe[i].numel() ? c10::optional<at::Tensor>(moe[i]) : c10::nullopt);
    out = moe_experts_q(x, weights, experts, local_index, w13, w2, perms);
  }
  if (!shared) return out;
  // as the Python layer adds it: out + sigmoid(gate) * shared_expert(x), ATen's ops
  const at::Tensor y = small_linear(silu_and_mul(small_linear(x, shared_gate_up)), shared_down);
  return at::add(out, at::mul(scale, y));
}

at::Tensor moe_experts(at::Tensor x, at::Tensor weights, at::Tensor experts,
                       at::Tensor local_index, at::Tensor w13, at::Tensor w2) {
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == w2.scalar_type() &&
                  (w13.scalar_type() == at::kFloat || w13.scalar_type() == at::kBFloat16) &&
                  w2.size(0) == w13.size(0) && w13.size(1) == 2 * w2.size(2),
              "moe_experts: contiguous fp32 or bf16 w13 [experts, 2I, H] and w2 [experts, H, "
              "I] expected");
  return moe_experts_impl(x, weights, experts, local_index, Weights{w13}, Weights{w2},
                          w13.size(0), {});
}

at::Tensor moe_experts_q(at::Tensor x, at::Tensor weights, at::Tensor experts,
                         at::Tensor local_index, std::vector<at::Tensor> w13,
                         std::vector<at::Tensor> w2,
                         std::vector<c10::optional<at::Tensor>> perms) {
  TORCH_CHECK(w13.size() == w2.size() && (perms.empty() || perms.size() == 2 * w13.size()),
              "moe_experts_q: a w13 and a w2 blob per local expert (and none or two input "
              "permutations each) expected");
  return moe_experts_impl(x, weights, experts, local_index, Weights{at::Tensor(), &w13},
                          Weights{at::Tensor(), &w2}, static_cast<int64_t>(w13.size()), perms);
}
