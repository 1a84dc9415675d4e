// The CPU ops of kvray's extension (bound to Python in bindings.cpp).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <tuple>
#include <vector>

// fn(begin, end) over [0, n) in chunks of `chunk`, which the threads take one at a time
// (an atomic counter; at::parallel_for's OpenMP split is static). When another process
// takes a core for a few ms (the Serve ingress streaming tokens, Ray), the thread left
// with it would otherwise hold up the whole step.
template <typename F>
inline void parallel_dynamic(int64_t n, int64_t chunk, const F& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// parallel_dynamic for a pass that streams its input from memory: each thread owns a
// contiguous run of the chunks and takes them in order (one unbroken stream, which the
// prefetchers keep ahead of), and once its own run is done takes what is left of the
// others' runs, one chunk at a time. Measured on a quantized decode step (120 calls of
// 0.3-1 MiB each, 2 threads): 1.1-1.2x faster than chunks handed out in one shared order,
// where each thread jumps to a new place every chunk.
template <typename F>
inline void parallel_streams(int64_t n, int64_t chunk, const F& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1) {
    if (n > 0) fn(0, n);
    return;
  }
  // run r: chunks [r * chunks / threads, (r + 1) * chunks / threads), next[r] its next one
  std::vector<std::atomic<int64_t>> next(threads);
  for (int64_t r = 0; r < threads; ++r) next[r] = r * chunks / threads;
  at::parallel_for(0, threads, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t own = r0; own < r1; ++own) {
      for (int64_t i = 0; i < threads; ++i) {
        const int64_t r = (own + i) % threads, end = (r + 1) * chunks / threads;
        for (int64_t c = next[r].fetch_add(1); c < end; c = next[r].fetch_add(1))
          fn(c * chunk, std::min(n, (c + 1) * chunk));
      }
    }
  });
}

// A chunk size for parallel_dynamic giving each thread about `per_thread` of the n items
// (at least one item per chunk): enough chunks to rebalance when a thread loses its core,
// few enough that handing them out stays cheap.
inline int64_t chunk_for_threads(int64_t n, int64_t per_thread = 4) {
  return std::max<int64_t>(1, n / (per_thread * std::max(at::get_num_threads(), 1)));
}

// Paged decode attention: q [B, Hq, D] against the paged cache [2, Hk, blocks, bs, D]
// (D + 4 for an int8 / fp8 cache: codes and a scale per row, kv_quant.h); softcap > 0 caps
// the scaled scores at softcap * tanh(s / softcap) (Gemma 2), 0 leaves them.
at::Tensor paged_decode(at::Tensor q, at::Tensor kv, at::Tensor tables, at::Tensor seq_lens,
                        double scale, int64_t window, double softcap);
// Whether paged_decode scores this cache with each query row rounded to int16 codes (an int8
// cache, head sizes 64 and 128, on a build with AVX2; kv_quant.round_query_rows).
bool paged_decode_query_codes(at::Tensor kv, int64_t head_dim);

// Paged prefill attention: the new tokens q [T, Hq, D] of B sequences (sequence b's at
// query_start[b]..query_start[b + 1], the last of its seq_lens[b] positions) attend causally
// to their K/V in the paged cache -> [T, Hq, D], scores capped as paged_decode's. Only where
// paged_prefill_supported says so.
at::Tensor paged_prefill(at::Tensor q, at::Tensor kv, at::Tensor tables, at::Tensor seq_lens,
                         at::Tensor query_start, double scale, int64_t window, double softcap);
bool paged_prefill_supported(const at::Tensor& q, const at::Tensor& kv);

// y = x w^T (+ bias) for a few rows of x (fp32): every weight row is read once for all rows.
at::Tensor linear_small_m(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);

// y = x w^T (+ bias) for many rows: tiles taken by the threads one at a time (a thread that
// loses its core for a while does not stall the others); fp32 tiles run a register-blocked
// kernel at vector_lanes() width, other dtypes one single-threaded sgemm each.
at::Tensor linear_tiled(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);

// w [N, K] (fp32, or bf16: packed as bf16, widened exactly in the kernel) packed once for
// linear_packed: panels of 2 x vector_lanes() weight rows, k-major within a panel (the
// last panel padded with zero rows).
at::Tensor pack_linear_weight(at::Tensor w);

// linear_tiled's fp32 kernel on a weight packed by pack_linear_weight (out_features N):
// no packing per call, the panels prefetched ahead.
at::Tensor linear_packed(at::Tensor x, at::Tensor packed, int64_t N,
                         c10::optional<at::Tensor> bias);

// A gate_up weight [2I, K] (gate rows, then up rows) packed for linear_packed_gate_up:
// each panel a vector of gate rows and the same rows of up (I a multiple of the lanes).
at::Tensor pack_gate_up_weight(at::Tensor w);

// x [M, K] against a weight packed by pack_gate_up_weight (N = 2I): x w^T (+ bias) in the
// plain order [M, 2I], or with silu_mul the MLP's activation silu(gate) * up [M, I].
at::Tensor linear_packed_gate_up(at::Tensor x, at::Tensor packed, int64_t N,
                                 c10::optional<at::Tensor> bias, bool silu_mul);

// fp32 lanes of the vector kernels this build runs: 16 (AVX-512), 8 (AVX2) or 1 (none).
int64_t vector_lanes();

// RMSNorm of each row (fp32 math); with residual: residual += x in place first, and the
// sum is normalised (the fused residual add of a decoder layer).
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps,
                    c10::optional<at::Tensor> residual);

// Rotary embedding ("rotate half") of x [T, H, D] in place; cos/sin: fp32 [max_pos, D/2].
void rotary_inplace(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);

// Write this step's K and V ([T, Hk, D], unit stride in D; the cache's dtype or fp32) into
// the paged cache at `slots` (int64 [T]); a slot outside the cache is an error. An int8 /
// fp8 cache gets each (token, head) row quantized: codes and its scale (kv_quant.h).
void write_kv(at::Tensor k, at::Tensor v, at::Tensor kv, at::Tensor slots);

// silu(gate) * up for gate_up = [gate | up] of shape [T, 2 * I] -> [T, I].
at::Tensor silu_and_mul(at::Tensor gate_up);

// One decoder layer for a decode batch (one new token per row): input norm (+ residual),
// QKV, optional per-head q/k norms, rotary, K/V write, paged decode attention, O, post norm
// (+ residual), gate/up, SiLU-and-mul, down. w: [in_norm, qkv, q_norm, k_norm, o,
// post_norm, gate_up, down] (q_norm/k_norm empty when absent); bias: [qkv, o, gate_up,
// down]; dims: [Hq, Hk, D]. With weights packed once (pack_linear_weight; gate_up by
// pack_gate_up_weight when paired), w holds four more, [qkv, o, gate_up, down] packed, and
// dims six more, [small-M rows, N of qkv, o, gate_up, down, gate_up paired (0/1)]: a batch
// of more rows than the first takes the packed weights (a paired gate_up with the
// activation in its epilogue), a smaller one the small-M kernel on w's. Returns (layer output, residual); the residual is updated in
// place (it is `hidden` itself on the first layer).
std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor hidden, c10::optional<at::Tensor> residual, std::vector<at::Tensor> w,
    std::vector<c10::optional<at::Tensor>> bias, std::vector<int64_t> dims, double eps,
    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor tables,
    at::Tensor seq_lens, at::Tensor slots, double scale, int64_t window);

// decode_layer for each of a pipeline stage's layers in turn (w[i], bias[i], kv[i],
// windows[i]: layer i's), in one call: no Python and no GIL between the layers.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    at::Tensor hidden, c10::optional<at::Tensor> residual,
    std::vector<std::vector<at::Tensor>> w,
    std::vector<std::vector<c10::optional<at::Tensor>>> bias, std::vector<int64_t> dims,
    double eps, at::Tensor positions, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv,
    at::Tensor tables, at::Tensor seq_lens, at::Tensor slots, double scale,
    std::vector<int64_t> windows);

// decode_layer / decode_layers with each row's LoRA adapter added to the qkv, o, gate_up
// and down outputs: lora [a, bt, ranks, slice starts (int64)] x 4 per layer (lora_add's
// layout), lora_rows int64 [T] the rows' slots (-1: none).
std::tuple<at::Tensor, at::Tensor> decode_layer_lora(
    at::Tensor hidden, c10::optional<at::Tensor> residual, std::vector<at::Tensor> w,
    std::vector<c10::optional<at::Tensor>> bias, std::vector<int64_t> dims, double eps,
    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor tables,
    at::Tensor seq_lens, at::Tensor slots, double scale, int64_t window,
    std::vector<at::Tensor> lora, at::Tensor lora_rows);
std::tuple<at::Tensor, at::Tensor> decode_layers_lora(
    at::Tensor hidden, c10::optional<at::Tensor> residual,
    std::vector<std::vector<at::Tensor>> w,
    std::vector<std::vector<c10::optional<at::Tensor>>> bias, std::vector<int64_t> dims,
    double eps, at::Tensor positions, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv,
    at::Tensor tables, at::Tensor seq_lens, at::Tensor slots, double scale,
    std::vector<int64_t> windows, std::vector<std::vector<at::Tensor>> lora,
    at::Tensor lora_rows);

// decode_layer / decode_layers where a layer's MLP may be a MoE layer's: moe (moe[i] for
// layer i, empty for a dense one) holds moe_mlp's arguments, moe_dims its dims (one set for
// the model; w's gate_up and down of a MoE layer are unused).
std::tuple<at::Tensor, at::Tensor> decode_layer_moe(
    at::Tensor hidden, c10::optional<at::Tensor> residual, std::vector<at::Tensor> w,
    std::vector<c10::optional<at::Tensor>> bias, std::vector<int64_t> dims, double eps,
    at::Tensor positions, at::Tensor cos, at::Tensor sin, at::Tensor kv, at::Tensor tables,
    at::Tensor seq_lens, at::Tensor slots, double scale, int64_t window,
    std::vector<at::Tensor> moe, std::vector<int64_t> moe_dims);
std::tuple<at::Tensor, at::Tensor> decode_layers_moe(
    at::Tensor hidden, c10::optional<at::Tensor> residual,
    std::vector<std::vector<at::Tensor>> w,
    std::vector<std::vector<c10::optional<at::Tensor>>> bias, std::vector<int64_t> dims,
    double eps, at::Tensor positions, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> kv,
    at::Tensor tables, at::Tensor seq_lens, at::Tensor slots, double scale,
    std::vector<int64_t> windows, std::vector<std::vector<at::Tensor>> moe,
    std::vector<int64_t> moe_dims);

// Index of each row's largest value of x [B, V] (fp32/bf16/fp16, unit stride along V), as
// torch.argmax(dim=-1) picks it: the first of equal maxima; a NaN beats everything.
at::Tensor argmax_rows(at::Tensor x);

// y = x W^T (+ bias) for fp32 x [M, K] (unit stride along K) and W a quantized blob
// (kvray/quant/blob.py's BLOB_LAYOUT: U4/U5/U6/S8 segments, any group, fp32/fp16 or
// two-level scales, with or without mins and a code offset), read in place: activations quantized to int8 per block and integer dot
// products, the same operations for a row whatever the number of rows (cpu_quant.cpp).
at::Tensor linear_q(at::Tensor x, at::Tensor blob, c10::optional<at::Tensor> bias);

// The integer dot product linear_q's kernel runs on: "vnni512" (AVX-512 VNNI, BW and VL:
// dpbusd, 512 bits for S8 codes), "vnni" (256-bit dpbusd, AVX-VNNI), "avx2" (maddubs) or
// "none" (dequantized matmul).
std::string quant_dot();
// From how many x rows linear_q runs on AMX tiles; 0 where it never does (no AMX-INT8 in the
// build, or the kernel refused the tile registers).
int64_t quant_amx_rows();

// Rows `ids` (int64, any shape) of a quantized blob dequantized -> fp32 [*ids.shape, K].
at::Tensor embedding_q(at::Tensor blob, at::Tensor ids);

// The whole quantized blob dequantized -> fp32 [N, K] (every kind, F8 included).
at::Tensor dequantize_q(at::Tensor blob);

// y [T, N] += each row's LoRA delta in place (kvray/kernels/lora.py: a [S, slices, R, K],
// bt [S, R, N], ranks int64 [S, slices], slice_starts [0, ..., N], row_slots int64 [T] with
// -1 for rows without an adapter); x/y fp32 or bf16, a/bt fp32 or bf16. Returns y.
at::Tensor lora_add(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor bt, at::Tensor ranks,
                    std::vector<int64_t> slice_starts, at::Tensor row_slots);

// A MoE layer's experts for a few tokens in one call: fp32 x [T, H], the routing's fp32
// weights and int64 global expert ids [T, k], local_index int64 [experts] (the row of w13 /
// w2 holding each expert here, -1: another rank's); w13 [local, 2I, H] (gate rows, then up)
// and w2 [local, H, I], fp32 or bf16. Returns sum over each token's experts held here of
// weight * down(silu(gate) * up) -> fp32 [T, H].
at::Tensor moe_experts(at::Tensor x, at::Tensor weights, at::Tensor experts,
                       at::Tensor local_index, at::Tensor w13, at::Tensor w2);

// moe_experts with each local expert's w13 and w2 a quantized blob (linear_q's), and
// optionally their input permutations (GPTQ act-order): perms [w13 of expert 0, w2 of
// expert 0, ...], None for none, or empty.
at::Tensor moe_experts_q(at::Tensor x, at::Tensor weights, at::Tensor experts,
                         at::Tensor local_index, std::vector<at::Tensor> w13,
                         std::vector<at::Tensor> w2,
                         std::vector<c10::optional<at::Tensor>> perms);

// A MoE layer's routing for a few fp32 rows x [T, H]: router [E (+ 1), H] fp32 / bf16 (with
// shared_gate its last row is Qwen2-MoE's shared-expert gate) -> (fp32 weights [T, top_k]
// of softmax over the E logits, renormalised over the k when asked; int64 expert ids
// [T, top_k], largest first, the lower id of equal values first; fp32 sigmoid of the shared
// gate [T, 1], or undefined).
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route(at::Tensor x, at::Tensor router,
                                                         int64_t top_k, bool renormalize,
                                                         bool shared_gate);

// A whole MoE MLP for a few fp32 rows (the fused decode layer's, cpu_layer.cpp): moe_route,
// the experts (moe_experts / moe_experts_q) and the shared expert. moe: [router,
// local_index, counts (int64 [experts], added to when dims[3]), shared gate_up, shared down
// (empty: none; dense or a blob), then stacked w13, w2 or a w13 blob per local expert, a w2
// blob per local expert and optionally their permutations (moe_experts_q's order, empty:
// none)]; dims: [top_k, renormalize, local experts, count].
at::Tensor moe_mlp(const at::Tensor& x, const std::vector<at::Tensor>& moe,
                   const std::vector<int64_t>& dims);
