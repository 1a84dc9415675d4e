// Linear layers and embeddings on quantized weights read in place (built by
// kvray/kernels/cpu_ops.py). The weight is one uint8 blob: kvray/quant/tensor.py's
// BLOB_LAYOUT, mirrored by parse_blob below; rows in segments of one kind each (U4, S8, F8)
// with per-group scales (fp32/fp16) and optional mins: w[n, k] = s[n, g] * q[n, k] (+ m[n, g]).
//
// Few rows (decode): llama.cpp's method. Each row of x is quantized per block of 32 to int8
// (dx = amax / 127); per weight row and block, an integer dot product of the codes with the
// activation codes (AVX2 maddubs: unsigned U4 codes x signed activations; S8 through the
// sign trick, maddubs(|w|, sign(x, w))), madd with ones, converted to float and accumulated
// with the multiplier dx * scale: one vector accumulator per x row over the whole weight row,
// summed once. Mins add m[n, g] * the sum of quantized x over group g. Each weight row is
// unpacked once for up to 4 rows of x (U4 rows two blocks per load, x's codes stored in the
// matching pair order); the error against x's exact products is at most sum over blocks of
// dx / 2 * sum |w| (tests/test_cpu_quant_kernels.py checks it).
// Every number of rows takes this path, so that a row's result never depends on how many
// rows share its call: greedy tokens stay the same whatever else is in the batch, and after
// a preemption recomputes a request's tokens as a prefill. (An fp32 path on weights
// dequantized into panels per tile ran prefills of 256 rows 1.5x faster for Q4_1, 1.3x
// for Q8_0, but gave different numbers from the decode steps' int8 path: removed.)
// Without AVX2 (other CPUs): the dequantized matrix through ATen's matmul.
#include "ops.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

enum Kind : int32_t { kU4 = 1, kS8 = 2, kF8 = 3 };
constexpr int64_t kBlock = 32;  // codes per activation block (and the K padding unit)
constexpr int64_t kHeaderBytes = 64, kSegmentBytes = 64, kMaxSegments = 1 << 16;

// One segment of rows as parse_blob found it: pointers into the blob.
struct Segment {
  int32_t kind = 0, group = 0;
  bool half = false;  // fp16 scales/mins (else fp32)
  int64_t row0 = 0, rows = 0;
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const uint8_t* mins = nullptr;  // null without mins
};

struct Blob {
  int64_t N = 0, K = 0, Kp = 0;
  std::vector<Segment> segs;
  int64_t row_bytes(const Segment& s) const { return s.kind == kU4 ? Kp / 2 : Kp; }
  int64_t groups(const Segment& s) const { return Kp / s.group; }
};

template <typename T>
T read(const uint8_t* p) {  // little-endian fields at any alignment
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The blob's header and segment table, checked: every size and offset is validated against
// the tensor before a kernel reads through it (a corrupt file must raise, not crash).
Blob parse_blob(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 1 &&
                  t.is_contiguous(),
              op, ": a quantized weight is a contiguous 1-D uint8 CPU tensor "
              "(QuantTensor.to_blob())");
  const int64_t size = t.numel();
  const uint8_t* base = t.data_ptr<uint8_t>();
  TORCH_CHECK(size >= kHeaderBytes && std::memcmp(base, "KVQ1", 4) == 0, op,
              ": not a kvray quantized blob (no KVQ1 magic, or shorter than its header)");
  Blob b;
  const int32_t nseg = read<int32_t>(base + 4);
  b.N = read<int64_t>(base + 8), b.K = read<int64_t>(base + 16), b.Kp = read<int64_t>(base + 24);
  TORCH_CHECK(nseg >= 0 && nseg <= kMaxSegments && b.N >= 0 && b.N < (int64_t{1} << 40) &&
                  b.K >= 1 && b.K < (int64_t{1} << 32) && b.Kp == (b.K + 31) / 32 * 32,
              op, ": corrupt blob header (", nseg, " segments, N ", b.N, ", K ", b.K,
              ", padded K ", b.Kp, ")");
  const int64_t data0 = kHeaderBytes + kSegmentBytes * nseg;
  TORCH_CHECK(size >= data0, op, ": blob truncated: ", size, " bytes cannot hold its ", nseg,
              " segment entries");
  int64_t row = 0;
  for (int32_t i = 0; i < nseg; ++i) {
    const uint8_t* e = base + kHeaderBytes + kSegmentBytes * i;
    Segment s;
    s.kind = read<int32_t>(e), s.group = read<int32_t>(e + 4);
    const int32_t sdt = read<int32_t>(e + 8), has_min = read<int32_t>(e + 12);
    s.row0 = read<int64_t>(e + 16), s.rows = read<int64_t>(e + 24);
    TORCH_CHECK(s.kind >= kU4 && s.kind <= kF8 && (sdt == 0 || sdt == 1) &&
                    (has_min == 0 || has_min == 1) && s.group > 0 &&
                    (s.group == 16 || s.group % 32 == 0) && b.Kp % s.group == 0,
                op, ": segment ", i, ": corrupt entry (kind ", s.kind, ", group ", s.group,
                ", scale dtype ", sdt, ", has_min ", has_min, ")");
    TORCH_CHECK(s.row0 == row && s.rows >= 0 && s.rows <= b.N - row, op, ": segment ", i,
                " holds rows ", s.row0, "+", s.rows, " where row ", row, " of ", b.N,
                " comes next");
    s.half = sdt == 1;
    const int64_t scale_bytes = b.groups(s) * (s.half ? 2 : 4);
    const int64_t bytes[3] = {b.row_bytes(s), scale_bytes, has_min ? scale_bytes : 0};
    const uint8_t** dst[3] = {&s.codes, &s.scales, &s.mins};
    static const char* names[3] = {"codes", "scales", "mins"};
    for (int j = 0; j < (has_min ? 3 : 2); ++j) {
      const int64_t off = read<int64_t>(e + 32 + 8 * j);
      // rows * bytes <= size - off, written so that nothing overflows
      TORCH_CHECK(off >= data0 && off % 64 == 0 && off <= size &&
                      (s.rows == 0 || bytes[j] <= (size - off) / s.rows),
                  op, ": segment ", i, "'s ", names[j], " at byte ", off,
                  " do not fit in the blob's ", size, " bytes (truncated or corrupt)");
      *dst[j] = base + off;
    }
    b.segs.push_back(s);
    row += s.rows;
  }
  TORCH_CHECK(row == b.N, op, ": the segments hold ", row, " rows, the header says ", b.N);
  return b;
}

float half_to_float(uint16_t h) {
#if defined(__F16C__) && defined(__AVX2__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// Scale or min i of a row (fp32 or fp16).
inline float param(const uint8_t* p, bool half, int64_t i) {
  return half ? half_to_float(read<uint16_t>(p + 2 * i)) : read<float>(p + 4 * i);
}

// v as stored in a register: keeps -ffast-math from fusing the product into the next add,
// so that dequantized values round as kvray/quant/tensor.py's (q * s, then + min).
inline float rounded(float v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm("" : "+x"(v));
#elif defined(__GNUC__) && defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}

// Row r of segment s dequantized into out[0:Kp] (the reference formula, every kind).
void dequant_row(const Blob& b, const Segment& s, int64_t r, float* out) {
  const uint8_t* codes = s.codes + r * b.row_bytes(s);
  const int64_t ng = b.groups(s);
  const uint8_t* sc = s.scales + r * ng * (s.half ? 2 : 4);
  const uint8_t* mn = s.mins ? s.mins + r * ng * (s.half ? 2 : 4) : nullptr;
#if defined(__AVX2__) && defined(__GNUC__)
  if (s.kind != kF8) {  // 16 codes at a time (the panels of the many-rows path)
    for (int64_t c = 0; c < b.Kp / 16; ++c) {
      const int64_t g = c * 16 / s.group;
      __m128i bytes;
      if (s.kind == kU4) {
        bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * (c / 2)));
        if (c & 1) bytes = _mm_srli_epi16(bytes, 4);
        bytes = _mm_and_si128(bytes, _mm_set1_epi8(0xF));
      } else {
        bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c));
      }
      const __m256 sv = _mm256_set1_ps(param(sc, s.half, g));
      const __m256 mv = _mm256_set1_ps(mn ? param(mn, s.half, g) : 0.f);
      for (int h = 0; h < 2; ++h) {
        const __m128i part = h ? _mm_srli_si128(bytes, 8) : bytes;
        const __m256i q = s.kind == kU4 ? _mm256_cvtepu8_epi32(part) : _mm256_cvtepi8_epi32(part);
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), sv);
        asm("" : "+x"(v));  // as rounded(): q * s rounded, then + min
        _mm256_storeu_ps(out + 16 * c + 8 * h, _mm256_add_ps(v, mv));
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < ng; ++g) {
    const float scale = param(sc, s.half, g), min = mn ? param(mn, s.half, g) : 0.f;
    for (int64_t k = g * s.group; k < (g + 1) * s.group; ++k) {
      float q;
      if (s.kind == kU4) {
        const uint8_t byte = codes[k / kBlock * 16 + k % 16];
        q = static_cast<float>(k % kBlock < 16 ? byte & 0xF : byte >> 4);
      } else if (s.kind == kS8) {
        q = static_cast<float>(static_cast<int8_t>(codes[k]));
      } else {
        q = static_cast<float>(c10::Float8_e4m3fn(codes[k], c10::Float8_e4m3fn::from_bits()));
      }
      out[k] = rounded(scale * q) + min;
    }
  }
}

// Which segment holds global row n (a handful of segments: a scan).
const Segment& segment_of(const Blob& b, int64_t n) {
  for (const Segment& s : b.segs)
    if (n < s.row0 + s.rows) return s;
  TORCH_CHECK(false, "row ", n, " outside the blob");
  return b.segs.back();
}

// Rows of x quantized per block of 32 along K (zero-padded to Kp), with the sums of its quantized values per 16.
struct QuantizedX {
  int64_t Kp = 0, nb = 0;
  std::vector<int8_t> q;   // [M, Kp] codes
  std::vector<int8_t> qp;  // the codes in pair order (pair_order), for U4 weights
  std::vector<float> d;    // [M, nb] block scales dx
  std::vector<float> s16;  // [M, Kp / 16] sums of quantized x per 16 columns (mins' terms)
};

void quantize_row(const float* x, int64_t K, int64_t Kp, int8_t* q, float* d, float* s16) {
  for (int64_t k0 = 0; k0 < Kp; k0 += kBlock) {
    alignas(32) float tmp[kBlock];
    const float* src = x + k0;
    if (k0 + kBlock > K) {  // the padded tail: zeros
      std::fill(tmp, tmp + kBlock, 0.f);
      std::copy(x + k0, x + K, tmp);
      src = tmp;
    }
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    const float dx = amax / 127.f;
    d[k0 / kBlock] = dx;
    int32_t sums[2] = {0, 0};
    for (int j = 0; j < kBlock; ++j) {
      q[k0 + j] = static_cast<int8_t>(std::nearbyint(src[j] * id));
      sums[j / 16] += q[k0 + j];
    }
    // The mins' terms read the same quantized x as the codes' terms (llama.cpp's Q8_1
    // sums): the error is then that of the whole weight w = s * q + m times x's rounding,
    // where exact sums leave the error of s * q alone, which for 4-bit codes 0..15 is about
    // twice the size (s * q is not centred): measured on the built-in Q4_1 model, decode KL
    // divergence 0.0089 with exact sums against llama.cpp's 0.0026.
    s16[k0 / 16] = dx * sums[0], s16[k0 / 16 + 1] = dx * sums[1];
  }
}

QuantizedX quantize_x(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp) {
  QuantizedX qx;
  qx.Kp = Kp, qx.nb = Kp / kBlock;
  qx.q.resize(M * Kp), qx.d.resize(M * qx.nb), qx.s16.resize(M * Kp / 16);
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)),
                   [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * ldx, K, Kp, qx.q.data() + m * Kp, qx.d.data() + m * qx.nb,
                   qx.s16.data() + m * Kp / 16);
  });
  return qx;
}

// x's codes as U4 weights read them two blocks at a time: for blocks b, b + 1 (b even), 64
// bytes [b's first 16, b + 1's first 16, b's last 16, b + 1's last 16], matching the low
// and high nibbles of the two blocks' 32 code bytes loaded at once (an odd last block as is).
void pair_order(QuantizedX& qx, int64_t M) {
  qx.qp.resize(qx.q.size());
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* src = qx.q.data() + m * qx.Kp;
    int8_t* dst = qx.qp.data() + m * qx.Kp;
    int64_t b = 0;
    for (; b + 2 <= qx.nb; b += 2) {
      const int8_t* b0 = src + b * kBlock;
      int8_t* o = dst + b * kBlock;
      std::memcpy(o, b0, 16), std::memcpy(o + 16, b0 + 32, 16);
      std::memcpy(o + 32, b0 + 16, 16), std::memcpy(o + 48, b0 + 48, 16);
    }
    if (b < qx.nb) std::memcpy(dst + b * kBlock, src + b * kBlock, kBlock);
  }
}

// sum of x over each group of `group` columns [M, Kp / group], from the sums per 16.
std::vector<float> group_sums(const QuantizedX& qx, int64_t M, int64_t group) {
  const int64_t per = group / 16, n16 = qx.Kp / 16, ng = qx.Kp / group;
  std::vector<float> out(M * ng, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < n16; ++i) out[m * ng + i / per] += qx.s16[m * n16 + i];
  return out;
}

}  // namespace

#ifdef __AVX2__
namespace {

using kvray::Vec8;

// A segment's rows and x's codes as one kernel call reads them.
struct SegView {
  const uint8_t* codes;
  const uint8_t* scales;
  const uint8_t* mins;  // null without mins
  int64_t row_bytes, ng, group;
};
struct XView {
  const int8_t* q;
  const int8_t* qp;  // pair order (U4 weights)
  const float* d;
  const float* gs;  // sums of x per group of this segment's size (with mins)
  int64_t Kp, nb, ng;
  XView at(int64_t m) const {
    return {q + m * Kp, qp ? qp + m * Kp : nullptr, d + m * nb, gs ? gs + m * ng : nullptr, Kp,
            nb, ng};
  }
};

template <bool Half>
inline float scale_at(const uint8_t* p, int64_t i) {
  if constexpr (Half) return half_to_float(read<uint16_t>(p + 2 * i));
  else return read<float>(p + 4 * i);
}

// Block b's 32 codes: U4 unpacked to bytes 0..15 in code order (low nibbles, then high).
template <int KD>
inline __m256i load_codes(const uint8_t* row, int64_t b) {
  if constexpr (KD == kU4) {
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0xF));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
  }
}

// The 8 int32 partial dot products of a block (as floats): lanes 0-3 the first 16 codes.
template <int KD>
inline __m256 block_dot(__m256i w, __m256i w_abs, const int8_t* xq) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i p = KD == kU4 ? _mm256_maddubs_epi16(w, xv)
                              : _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(xv, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

// acc + mins[g] * gs[g] over a row's ng groups, as lanes (summed with the row's dot).
template <bool Half>
inline __m256 add_min_terms(__m256 acc, const uint8_t* mins, const float* gs, int64_t ng) {
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8) {
    const __m256 mv = Half ? _mm256_cvtph_ps(_mm_loadu_si128(
                                 reinterpret_cast<const __m128i*>(mins + 2 * g)))
                           : _mm256_loadu_ps(reinterpret_cast<const float*>(mins + 4 * g));
    acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(gs + g), acc);
  }
  if (g < ng) {
    alignas(32) float mv[8] = {}, gv[8] = {};
    for (int64_t i = g; i < ng; ++i) mv[i - g] = scale_at<Half>(mins, i), gv[i - g] = gs[i];
    acc = _mm256_fmadd_ps(_mm256_load_ps(mv), _mm256_load_ps(gv), acc);
  }
  return acc;
}

// Two U4 blocks (b, b + 1) against x's codes in pair order: lanes 0-3 block b, 4-7 b + 1.
// The two maddubs products add in int16 without overflow (2 x 2 x 15 x 127 < 2^15).
inline __m256 pair_dot(__m256i lo, __m256i hi, const int8_t* xp) {
  const __m256i a = _mm256_maddubs_epi16(
      lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp)));
  const __m256i c = _mm256_maddubs_epi16(
      hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 32)));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(a, c), _mm256_set1_epi16(1)));
}

// Bytes ahead of a row's codes that the code stream is prefetched. The built-in model's
// linears of one decode step at M = 1 on a 2-core AVX2 EPYC (alternating, median of 5):
// none / 512 / 1 KiB / 2 KiB: Q4_1 5.15 / 5.08 / 5.01 / 4.86 ms, Q8_0 5.47 / 5.49 / 5.24 /
// 4.99 ms (a few %, near the noise, but in the same direction for both).
constexpr int64_t kPrefetchBytes = 2048;

// A weight row's multipliers for M rows of x: mult[m * ns + j] = dx[m, block of j] * its
// scale, j over the row's blocks (ns = nb) or, with group 16, their halves (ns = 2 nb): one
// broadcast per block in the hot loop instead of a conversion and a multiply per x row.
template <int M, bool G16, bool Half>
inline void row_multipliers(const uint8_t* sc, const XView& x, int64_t group, float* bs,
                            float* mult) {
  const int64_t nb = x.nb, ns = G16 ? 2 * nb : nb;
  if (G16 || group == kBlock) {  // one scale per entry
    int64_t j = 0;
    for (; j + 8 <= ns; j += 8)
      _mm256_storeu_ps(bs + j, Half ? _mm256_cvtph_ps(_mm_loadu_si128(
                                          reinterpret_cast<const __m128i*>(sc + 2 * j)))
                                    : _mm256_loadu_ps(reinterpret_cast<const float*>(sc + 4 * j)));
    for (; j < ns; ++j) bs[j] = scale_at<Half>(sc, j);
  } else {
    const int64_t bpg = group / kBlock;
    for (int64_t g = 0; g < nb / bpg; ++g)
      std::fill(bs + g * bpg, bs + (g + 1) * bpg, scale_at<Half>(sc, g));
  }
  for (int m = 0; m < M; ++m) {
    const float* d = x.d + m * nb;
    float* out = mult + m * ns;
    if constexpr (G16) {
      for (int64_t j = 0; j < ns; ++j) out[j] = bs[j] * d[j >> 1];
    } else {
      int64_t j = 0;
      for (; j + 8 <= nb; j += 8)
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(bs + j), _mm256_loadu_ps(d + j)));
      for (; j < nb; ++j) out[j] = bs[j] * d[j];
    }
  }
}

// Block b's multiplier vector: one value, or with group 16 [half 0 x4 | half 1 x4].
template <bool G16>
inline __m256 mult_at(const float* mult, int64_t b) {
  if constexpr (G16) {
    const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(mult + 2 * b)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  } else {
    return _mm256_broadcast_ss(mult + b);
  }
}

// Blocks b, b + 1 of a U4 row (group >= 32) into accumulators acc[.][u].
template <int M, int U>
inline void u4_pair(const uint8_t* codes, const XView& x, const float* mult, int64_t ns,
                    int64_t b, __m256 (&acc)[M][U], int u) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 16 * b));
  const __m256i mask = _mm256_set1_epi8(0xF);
  const __m256i lo = _mm256_and_si256(v, mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
    acc[m][u] = _mm256_fmadd_ps(pair_dot(lo, hi, x.qp + m * x.Kp + kBlock * b),
                                mult_at<true>(mult + m * ns + b, 0), acc[m][u]);
}

// Rows [r0, r1) of a segment against M (1..4) rows of x: y[m * ldy + r] (+ bias[r]). U
// accumulators per x row (alternate blocks) hide the FMA latency; bs and mult are scratch
// for row_multipliers.
template <int M, int KD, bool G16, bool Half>
void dot_rows(const SegView& s, const XView& x, int64_t r0, int64_t r1, float* y,
              int64_t ldy, const float* bias, float* bs, float* mult) {
  // Two accumulators per x row whatever M is: the sum for a row is then the same sequence of
  // operations in a call of 1 row as of 300, so its result does not depend on the batch.
  constexpr int U = 2;
  const int64_t sbytes = Half ? 2 : 4, nb = x.nb, ns = G16 ? 2 * nb : nb;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* codes = s.codes + r * s.row_bytes;
    for (int64_t off = 0; off < s.row_bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(codes) + kPrefetchBytes + off, _MM_HINT_T0);
    row_multipliers<M, G16, Half>(s.scales + r * s.ng * sbytes, x, s.group, bs, mult);
    __m256 acc[M][U];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    int64_t b = 0;
    if constexpr (KD == kU4 && !G16) {  // two blocks per 32-byte load
      for (; b + 2 * U <= nb; b += 2 * U)
#pragma GCC unroll 2
        for (int u = 0; u < U; ++u) u4_pair<M, U>(codes, x, mult, ns, b + 2 * u, acc, u);
      for (; b + 2 <= nb; b += 2) u4_pair<M, U>(codes, x, mult, ns, b, acc, 0);
    }
    for (; b + U <= nb; b += U) {
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) {
        const __m256i w = load_codes<KD>(codes, b + u);
        const __m256i wa = KD == kS8 ? _mm256_abs_epi8(w) : w;
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m)
          acc[m][u] = _mm256_fmadd_ps(block_dot<KD>(w, wa, x.q + m * x.Kp + kBlock * (b + u)),
                                      mult_at<G16>(mult + m * ns, b + u), acc[m][u]);
      }
    }
    for (; b < nb; ++b) {
      const __m256i w = load_codes<KD>(codes, b);
      const __m256i wa = KD == kS8 ? _mm256_abs_epi8(w) : w;
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m)
        acc[m][0] = _mm256_fmadd_ps(block_dot<KD>(w, wa, x.q + m * x.Kp + kBlock * b),
                                    mult_at<G16>(mult + m * ns, b), acc[m][0]);
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      __m256 a = _mm256_add_ps(acc[m][0], acc[m][1]);
      if (s.mins) a = add_min_terms<Half>(a, s.mins + r * s.ng * sbytes, x.gs + m * x.ng, s.ng);
      y[m * ldy + r] = Vec8::sum(a) + (bias ? bias[r] : 0.f);
    }
  }
}

// Rows [r0, r1) of a segment against all M rows of x: tiles of weight rows small enough to
// stay in L2 while passes of 4 x rows go over them.
template <int KD, bool G16, bool Half>
void int8_rows(const SegView& s, const XView& x, int64_t M, int64_t r0, int64_t r1, float* y,
               int64_t ldy, const float* bias) {
  const int64_t tile = std::max<int64_t>(4, 65536 / s.row_bytes);
  std::vector<float> bs(2 * x.nb), mult(4 * 2 * x.nb);
  float *bp = bs.data(), *mp = mult.data();
  for (int64_t t0 = r0; t0 < r1; t0 += tile) {
    const int64_t t1 = std::min(r1, t0 + tile);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      dot_rows<4, KD, G16, Half>(s, x.at(m), t0, t1, y + m * ldy, ldy, bias, bp, mp);
    float* ym = y + m * ldy;
    switch (M - m) {
      case 3: dot_rows<3, KD, G16, Half>(s, x.at(m), t0, t1, ym, ldy, bias, bp, mp); break;
      case 2: dot_rows<2, KD, G16, Half>(s, x.at(m), t0, t1, ym, ldy, bias, bp, mp); break;
      case 1: dot_rows<1, KD, G16, Half>(s, x.at(m), t0, t1, ym, ldy, bias, bp, mp); break;
      default: break;
    }
  }
}

using RowsFn = void (*)(const SegView&, const XView&, int64_t, int64_t, int64_t, float*,
                        int64_t, const float*);

template <int KD>
RowsFn pick_rows(bool g16, bool half) {
  if (g16) return half ? &int8_rows<KD, true, true> : &int8_rows<KD, true, false>;
  return half ? &int8_rows<KD, false, true> : &int8_rows<KD, false, false>;
}

void linear_int8(const Blob& b, const float* x, int64_t ldx, int64_t M, const float* bias,
                 float* y) {
  QuantizedX qx = quantize_x(x, ldx, M, b.K, b.Kp);
  for (const Segment& s : b.segs)
    if (s.kind == kU4 && s.group != 16 && qx.qp.empty()) pair_order(qx, M);
  struct Job { SegView view; XView xv; RowsFn fn; int64_t row0, rows; };
  std::vector<std::vector<float>> sums(b.segs.size());
  std::vector<Job> jobs;
  for (size_t i = 0; i < b.segs.size(); ++i) {
    const Segment& s = b.segs[i];
    if (s.mins) sums[i] = group_sums(qx, M, s.group);
    const RowsFn fn = s.kind == kU4 ? pick_rows<kU4>(s.group == 16, s.half)
                                    : pick_rows<kS8>(s.group == 16, s.half);
    jobs.push_back({{s.codes, s.scales, s.mins, b.row_bytes(s), b.groups(s), s.group},
                    {qx.q.data(), qx.qp.empty() ? nullptr : qx.qp.data(), qx.d.data(),
                     s.mins ? sums[i].data() : nullptr, qx.Kp,
                     qx.nb, b.groups(s)},
                    fn, s.row0, s.rows});
  }
  // chunks of at least ~16 KiB of codes, about 4 per thread (as cpu_linear.cpp's run)
  const int64_t grain = std::max<int64_t>(4, 16384 / (b.Kp / 2) / 4 * 4);
  const int64_t chunk = std::max(grain, chunk_for_threads(b.N) / 4 * 4);
  parallel_dynamic(b.N, chunk, [&](int64_t n0, int64_t n1) {
    for (const Job& j : jobs) {
      const int64_t lo = std::max(n0, j.row0), hi = std::min(n1, j.row0 + j.rows);
      if (lo < hi)
        j.fn(j.view, j.xv, M, lo - j.row0, hi - j.row0, y + j.row0, b.N,
             bias ? bias + j.row0 : nullptr);
    }
  });
}

}  // namespace
#endif  // __AVX2__

at::Tensor dequantize_q(at::Tensor blob) {
  const Blob b = parse_blob(blob, "dequantize_q");
  auto out = at::empty({b.N, b.K}, at::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, b.N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(b.Kp);
    for (int64_t n = n0; n < n1; ++n) {
      const Segment& s = segment_of(b, n);
      dequant_row(b, s, n - s.row0, row.data());
      std::copy(row.begin(), row.begin() + b.K, o + n * b.K);
    }
  });
  return out;
}

at::Tensor embedding_q(at::Tensor blob, at::Tensor ids) {
  const Blob b = parse_blob(blob, "embedding_q");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.device().is_cpu(),
              "embedding_q: int64 CPU token ids expected");
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t T = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < b.N, "embedding_q: token id ", id[t],
                " outside the vocabulary of ", b.N);
  auto out = at::empty({T, b.K}, at::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(b.Kp);
    for (int64_t t = t0; t < t1; ++t) {
      const Segment& s = segment_of(b, id[t]);
      dequant_row(b, s, id[t] - s.row0, row.data());
      std::copy(row.begin(), row.begin() + b.K, o + t * b.K);
    }
  });
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(b.K);
  return out.view(shape);
}

at::Tensor linear_q(at::Tensor x, at::Tensor blob, c10::optional<at::Tensor> bias) {
  const Blob b = parse_blob(blob, "linear_q");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "linear_q: fp32 CPU x [M, K] expected");
  TORCH_CHECK(x.size(1) == b.K, "linear_q: x has ", x.size(1), " columns, the weight ", b.K);
  for (const Segment& s : b.segs)
    TORCH_CHECK(s.kind != kF8, "linear_q: F8 weights have no CPU kernel (dequantize them)");
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == b.N &&
                            bias->scalar_type() == at::kFloat),
              "linear_q: fp32 bias [N] expected");
  const int64_t M = x.size(0);
  auto y = at::empty({M, b.N}, x.options());
  if (M == 0 || b.N == 0) return y;
#ifdef __AVX2__
  const at::Tensor xc = x.stride(1) == 1 && x.stride(0) >= b.K ? x : x.contiguous();
  const at::Tensor bc = has_bias ? bias->contiguous() : at::Tensor();
  const float* bp = has_bias ? bc.data_ptr<float>() : nullptr;
  linear_int8(b, xc.data_ptr<float>(), xc.stride(0), M, bp, y.data_ptr<float>());
  return y;
#else
  // No vector kernels: the dequantized matrix through ATen's matmul.
  const at::Tensor w = dequantize_q(blob);
  return has_bias ? at::addmm(*bias, x, w.t()) : at::mm(x, w.t());
#endif
}
