// Linear layers and embeddings on quantized weights read in place (built by
// kvray/kernels/cpu_ops.py). The weight is one uint8 blob: kvray/quant/blob.py's
// BLOB_LAYOUT, mirrored by parse_blob below; rows in segments of one kind each (U4, U5, U6,
// S8, F8) with per-group scales and optional mins:
// w[n, k] = s[n, g] * (q[n, k] - zero) (+ m[n, g]), where s and m are fp32, fp16, or 8-bit
// integers times an fp16 per super-group (the K-quants' two levels, multiplied in fp32:
// exact). A segment's rows are interleaved in tiles of 8, so that a vector's 8 lanes are 8
// weight rows: 32 bytes hold 4 consecutive codes of each of the 8 rows (U5 / U6: their low
// nibbles, the high bits in planes after the block's nibbles).
//
// The activations are quantized per block of 32 to int8 (dx = amax / 127), as llama.cpp
// does. Per tile and block, each x row's 4 codes at a time are broadcast against the tile's
// 32-byte parts (AVX2 maddubs: unsigned U4 codes x signed activations; S8 through the sign
// trick, maddubs(|w|, sign(x, w)); with AVX-512 VNNI or AVX-VNNI one dpbusd per part
// instead, 1.35-1.5x faster from 4 rows on, S8 as (w + 128) x x less 128 x sum(x) and with
// AVX-512 two parts per dpbusd), the products summed exactly in int16 / int32 to
// one int per weight row (lane), converted once and accumulated with the multiplier s * dx:
// one fma per block for 8 weight rows, no horizontal sums. Mins add m[n, g] times the sum of
// quantized x over group g. A tile's parts are unpacked once for up to 4 x rows, the tiles
// of an L2-sized stretch taken by every pass of 4 x rows (prefill, big decode batches);
// with 512-bit VNNI and 16 or more x rows, two tiles at a time in 16-lane vectors
// (TwoTiles: no per-row shuffle of x, half the float work per weight row; S8 against 8 x
// rows a pass, interleaved per block: dot_pair_s8x8), and where the CPU has AMX-INT8 on
// its tile unit instead (quant_amx.h; the same bits).
// At a few rows a call is bound by reading its weight: each thread streams its own run of
// tiles (parallel_streams) and fetches the codes 4 KiB ahead of the block in hand.
// The error against x's exact products is at most sum over blocks of dx / 2 * sum |w|
// (tests/test_cpu_quant_kernels.py checks it).
// A row's result is the same sequence of operations whatever the number of rows in the call
// (integer sums are exact; the float accumulation runs over the blocks in order): the
// linears add nothing that depends on the rest of the batch (docs/design.md says what else
// in a step can).
// Without AVX2 (other CPUs): the dequantized matrix through ATen's matmul.
#include "ops.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernel_parts.h"
#include "quant_amx.h"
#include "quant_format.h"
#include "quant_tiles.h"
#include "vec.h"

namespace {

constexpr int64_t kHeaderBytes = 64, kSegmentBytes = 128, kMaxSegments = 1 << 16;

// One segment of rows as parse_blob found it: pointers into the blob.
struct Segment {
  int32_t kind = 0, group = 0, scale_type = kF32, zero = 0, super_group = 0;
  int64_t row0 = 0, rows = 0;
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  const uint8_t* mins = nullptr;        // null without mins
  const uint8_t* super_scales = nullptr;  // two-level only
  const uint8_t* super_mins = nullptr;    // two-level with mins only
  int64_t scale_bytes() const { return scale_type == kF32 ? 4 : scale_type == kF16 ? 2 : 1; }
  int form() const { return scale_type >= kSubU8 ? kFormSub : scale_type; }
};

struct Blob {
  int64_t N = 0, K = 0, Kp = 0;
  std::vector<Segment> segs;
  int64_t row_bytes(const Segment& s) const { return Kp * code_bits(s.kind) / 8; }
  int64_t groups(const Segment& s) const { return Kp / s.group; }
  int64_t supers(const Segment& s) const {
    return s.super_group ? (groups(s) + s.super_group - 1) / s.super_group : 0;
  }
  static int64_t tiles(const Segment& s) { return (s.rows + kTile - 1) / kTile; }
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
              "(kvray.quant.blob.to_blob)");
  const int64_t size = t.numel();
  const uint8_t* base = t.data_ptr<uint8_t>();
  TORCH_CHECK(size >= kHeaderBytes && std::memcmp(base, "KVQ3", 4) == 0, op,
              ": not a kvray quantized blob (no KVQ3 magic, or shorter than its header)");
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
    s.scale_type = read<int32_t>(e + 8);
    const int32_t has_min = read<int32_t>(e + 12);
    s.row0 = read<int64_t>(e + 16), s.rows = read<int64_t>(e + 24);
    s.zero = read<int32_t>(e + 56), s.super_group = read<int32_t>(e + 60);
    const bool two_level = s.scale_type == kSubU8 || s.scale_type == kSubS8;
    TORCH_CHECK(s.kind >= kU4 && s.kind <= kU6 && s.scale_type >= kF32 &&
                    s.scale_type <= kSubS8 && (has_min == 0 || has_min == 1) && s.group > 0 &&
                    (s.group == 16 || s.group % 32 == 0) && b.Kp % s.group == 0 &&
                    s.zero >= 0 && s.zero <= 64 && (s.zero == 0 || nibble_kind(s.kind)) &&
                    (two_level ? s.super_group > 0 && s.super_group <= (1 << 20)
                               : s.super_group == 0),
                op, ": segment ", i, ": corrupt entry (kind ", s.kind, ", group ", s.group,
                ", scale dtype ", s.scale_type, ", has_min ", has_min, ", zero ", s.zero,
                ", super_group ", s.super_group, ")");
    TORCH_CHECK(s.row0 == row && s.rows >= 0 && s.rows <= b.N - row, op, ": segment ", i,
                " holds rows ", s.row0, "+", s.rows, " where row ", row, " of ", b.N,
                " comes next");
    // bytes per tile of 8 rows
    const int64_t scale_bytes = kTile * b.groups(s) * s.scale_bytes();
    const int64_t super_bytes = kTile * b.supers(s) * 2;
    const int64_t bytes[5] = {kTile * b.row_bytes(s), scale_bytes, scale_bytes, super_bytes,
                              super_bytes};
    const bool present[5] = {true, true, has_min == 1, two_level, two_level && has_min == 1};
    static const int64_t field[5] = {32, 40, 48, 64, 72};
    const int64_t tiles = Blob::tiles(s);
    const uint8_t** dst[5] = {&s.codes, &s.scales, &s.mins, &s.super_scales, &s.super_mins};
    static const char* names[5] = {"codes", "scales", "mins", "super-scales", "super-mins"};
    for (int j = 0; j < 5; ++j) {
      if (!present[j]) continue;
      const int64_t off = read<int64_t>(e + field[j]);
      // tiles * bytes <= size - off, written so that nothing overflows
      TORCH_CHECK(off >= data0 && off % 64 == 0 && off <= size &&
                      (tiles == 0 || bytes[j] <= (size - off) / tiles),
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

// Scale or min i of a row as stored (fp32, fp16 or an 8-bit integer).
inline float param(const uint8_t* p, int32_t type, int64_t i) {
  switch (type) {
    case kF32: return read<float>(p + 4 * i);
    case kF16: return half_to_float(read<uint16_t>(p + 2 * i));
    case kSubU8: return static_cast<float>(p[i]);
    default: return static_cast<float>(static_cast<int8_t>(p[i]));
  }
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

// Row r of segment s dequantized into out[0:Kp] (the reference formula, every kind): lane
// r % 8 of its tile.
void dequant_row(const Blob& b, const Segment& s, int64_t r, float* out) {
  const int64_t ng = b.groups(s), ns = b.supers(s), lane = r % kTile, tile = r / kTile;
  const int64_t block_bytes = kTile * kBlock * code_bits(s.kind) / 8;
  const uint8_t* codes = s.codes + tile * (b.Kp / kBlock) * block_bytes + 4 * lane;
  const int64_t tile_params = ng * kTile * s.scale_bytes(), tile_supers = ns * kTile * 2;
  // a group's scale or min: one level, or the 8-bit value times its super-group's fp16
  auto value = [&](const uint8_t* p, const uint8_t* super, int64_t g) {
    const float v = param(p + tile * tile_params, s.scale_type, g * kTile + lane);
    if (!super) return v;
    return v * param(super + tile * tile_supers, kF16, g / s.super_group * kTile + lane);
  };
  for (int64_t g = 0; g < ng; ++g) {
    const float scale = value(s.scales, s.super_scales, g);
    const float min = s.mins ? value(s.mins, s.super_mins, g) : 0.f;
    for (int64_t k = g * s.group; k < (g + 1) * s.group; ++k) {
      const uint8_t* block = codes + k / kBlock * block_bytes;
      const int64_t j = k % kBlock;  // nibble kinds: part j / 8, nibble j / 4 % 2; else part j / 4
      float q;
      if (nibble_kind(s.kind)) {
        const int64_t part = j / 8, high = j / 4 % 2;
        const uint8_t byte = block[32 * part + j % 4];
        int32_t code = high ? byte >> 4 : byte & 0xF;
        const uint8_t* planes = block + 128 + j % 4;  // this row's bytes of the planes
        if (s.kind == kU5) code |= (planes[0] >> (4 * high + part) & 1) << 4;
        if (s.kind == kU6) code |= (planes[32 * high] >> (2 * part) & 3) << 4;
        q = static_cast<float>(code - s.zero);
      } else if (s.kind == kS8) {
        q = static_cast<float>(static_cast<int8_t>(block[32 * (j / 4) + j % 4]));
      } else {
        q = static_cast<float>(
            c10::Float8_e4m3fn(block[32 * (j / 4) + j % 4], c10::Float8_e4m3fn::from_bits()));
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

// Scratch that is written in full before it is read: no zero fill (std::vector's took
// ~1.6 % of a 48-row Q8_0 call).
template <typename T>
class Buffer {
 public:
  explicit Buffer(int64_t n = 0) : p_(n > 0 ? new T[n] : nullptr) {}
  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  T& operator[](int64_t i) { return p_[i]; }
  const T& operator[](int64_t i) const { return p_[i]; }
  bool empty() const { return p_ == nullptr; }

 private:
  std::unique_ptr<T[]> p_;
};

// Rows of x quantized per block of 32 along K (zero-padded to Kp), with the sums of its
// quantized values per 16.
struct QuantizedX {
  int64_t Kp = 0, nb = 0;
  Buffer<int8_t> q;     // [rows, Kp] codes
  Buffer<float> d;      // [rows, nb] block scales dx
  Buffer<float> s16;    // [rows, Kp / 16] sums of quantized x per 16 columns (mins' terms)
  Buffer<int32_t> c16;  // [rows, Kp / 16] -128 x the sums of the codes per 16 (S8, VNNI)
  // Rows 8 g .. 8 g + 7 of the first M / 8 * 8 again, interleaved per block for the S8
  // pair kernel (XView::q8), where a segment runs it; else empty.
  Buffer<int8_t> q8;
  Buffer<float> d8;
  Buffer<int32_t> c8;
};

void quantize_row(const float* x, int64_t K, int64_t Kp, int8_t* q, float* d, float* s16,
                  int32_t* c16) {
  for (int64_t k0 = 0; k0 < Kp; k0 += kBlock) {
    alignas(32) float tmp[kBlock];
    const float* src = x + k0;
    if (k0 + kBlock > K) {  // the padded tail: zeros
      std::fill(tmp, tmp + kBlock, 0.f);
      std::copy(x + k0, x + K, tmp);
      src = tmp;
    }
#ifdef __AVX2__
    // the scalar loop below, 8 lanes at a time (cvtps rounds to nearest even, as nearbyint)
    __m256 v[4], amax8 = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(src + 8 * i);
      amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], abs_mask));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax8);
    const float amax = *std::max_element(lanes, lanes + 8);
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    __m256i c[4];
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
    const __m256i lo = _mm256_add_epi32(c[0], c[1]), hi = _mm256_add_epi32(c[2], c[3]);
    alignas(32) int32_t sum_lo[8], sum_hi[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(sum_lo), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sum_hi), hi);
    int32_t sums[2] = {0, 0};
    for (int i = 0; i < 8; ++i) sums[0] += sum_lo[i], sums[1] += sum_hi[i];
    // int32 -> int8 (every value within +-127): packs keep the order within 128-bit halves
    const __m256i w16 = _mm256_packs_epi32(c[0], c[1]), w16b = _mm256_packs_epi32(c[2], c[3]);
    const __m256i b8 = _mm256_packs_epi16(w16, w16b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0),
                        _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sums[2] = {0, 0};
    for (int j = 0; j < kBlock; ++j) {
      q[k0 + j] = static_cast<int8_t>(std::nearbyint(src[j] * id));
      sums[j / 16] += q[k0 + j];
    }
#endif
    const float dx = amax / 127.f;
    d[k0 / kBlock] = dx;
    // The mins' terms read the same quantized x as the codes' terms (llama.cpp's Q8_1
    // sums): the error is then that of the whole weight w = s * q + m times x's rounding,
    // where exact sums leave the error of s * q alone, which for 4-bit codes 0..15 is about
    // twice the size (s * q is not centred): measured on the built-in Q4_1 model, decode KL
    // divergence 0.0089 with exact sums against llama.cpp's 0.0026.
    s16[k0 / 16] = dx * sums[0], s16[k0 / 16 + 1] = dx * sums[1];
    c16[k0 / 16] = -128 * sums[0], c16[k0 / 16 + 1] = -128 * sums[1];
  }
}

// Group g of 8 quantized rows (all M / 8 * 8 of them) copied interleaved per block.
void interleave_group(QuantizedX& qx, int64_t g) {
  const int64_t nb = qx.nb, n16 = qx.Kp / 16;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t r = 0; r < kRowsX; ++r) {
      const int64_t m = g * kRowsX + r, i = (g * nb + b) * kRowsX + r;
      std::memcpy(qx.q8.data() + i * kBlock, qx.q.data() + m * qx.Kp + b * kBlock, kBlock);
      qx.d8[i] = qx.d[m * nb + b];
      qx.c8[i] = qx.c16[m * n16 + 2 * b] + qx.c16[m * n16 + 2 * b + 1];
    }
}

// x's M rows quantized, then zero rows up to `rows` (the tile unit reads whole A tiles);
// with `interleave`, each whole group of 8 rows also in the S8 pair kernel's layout. One
// parallel pass over groups of 8 rows, each quantized and interleaved while in L1: done
// serially after the quantization, the copy was ~7 % of the engine thread's time at 16
// streams on a 2-core Zen 4 (prefill chunks), with the other core spinning.
QuantizedX quantize_x(const float* x, int64_t ldx, int64_t M, int64_t rows, int64_t K,
                      int64_t Kp, bool interleave) {
  QuantizedX qx;
  const int64_t nb = Kp / kBlock, n16 = Kp / 16, groups = (M + kRowsX - 1) / kRowsX;
  qx.Kp = Kp, qx.nb = nb;
  qx.q = Buffer<int8_t>(rows * Kp), qx.d = Buffer<float>(rows * nb);
  qx.s16 = Buffer<float>(rows * n16), qx.c16 = Buffer<int32_t>(rows * n16);
  std::fill(qx.q.data() + M * Kp, qx.q.data() + rows * Kp, 0);
  std::fill(qx.d.data() + M * nb, qx.d.data() + rows * nb, 0.f);
  std::fill(qx.s16.data() + M * n16, qx.s16.data() + rows * n16, 0.f);
  std::fill(qx.c16.data() + M * n16, qx.c16.data() + rows * n16, 0);
  const int64_t whole = interleave ? M / kRowsX : 0;
  if (whole > 0) {
    qx.q8 = Buffer<int8_t>(whole * nb * kRowsX * kBlock);
    qx.d8 = Buffer<float>(whole * nb * kRowsX), qx.c8 = Buffer<int32_t>(whole * nb * kRowsX);
  }
  // ~64 KiB of x a task: a decode step's rows stay on one thread. 16 KiB was 1.03-1.05x
  // faster at 16-48 rows alone, but each parallel region is one more place where a thread
  // that another process preempts holds up the other (the Serve graph on 2 cores)
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1) / kRowsX);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t m = g * kRowsX; m < std::min(M, (g + 1) * kRowsX); ++m)
        quantize_row(x + m * ldx, K, Kp, qx.q.data() + m * Kp, qx.d.data() + m * nb,
                     qx.s16.data() + m * n16, qx.c16.data() + m * n16);
      if (g < whole) interleave_group(qx, g);
    }
  });
  return qx;
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

using TilesFn = void (*)(const SegView&, const XView&, int64_t, int64_t, int64_t, float*,
                         int64_t, const float*);

// What a segment's tiles can run on: the vector units (dot_tiles) or, with AMX-INT8, the
// tile unit (amx_tiles); each names its kernel for every kind, group, scale form and offset.
struct VectorTiles {
  template <int KD, bool G16, int Form, bool Offset>
  static constexpr TilesFn fn = &dot_tiles<KD, G16, Form, Offset>;
};
#ifdef KVRAY_AMX
struct AmxTiles {
  template <int KD, bool G16, int Form, bool Offset>
  static constexpr TilesFn fn = &amx_tiles<KD, G16, Form, Offset>;
};
#endif

template <class K, int KD, bool G16, int Form>
TilesFn pick_offset(bool offset) {
  return offset ? K::template fn<KD, G16, Form, true> : K::template fn<KD, G16, Form, false>;
}

template <class K, int KD, bool G16>
TilesFn pick_form(int form, bool offset) {
  switch (form) {
    case kFormF32: return pick_offset<K, KD, G16, kFormF32>(offset);
    case kFormF16: return pick_offset<K, KD, G16, kFormF16>(offset);
    default: return pick_offset<K, KD, G16, kFormSub>(offset);
  }
}

template <class K, int KD>
TilesFn pick_tiles(bool g16, int form, bool offset) {
  return g16 ? pick_form<K, KD, true>(form, offset) : pick_form<K, KD, false>(form, offset);
}

template <class K>
TilesFn pick_kind(const Segment& s) {
  const bool g16 = s.group == 16, offset = s.mins != nullptr || s.zero != 0;
  switch (s.kind) {
    case kU4: return pick_tiles<K, kU4>(g16, s.form(), offset);
    case kU5: return pick_tiles<K, kU5>(g16, s.form(), offset);
    case kU6: return pick_tiles<K, kU6>(g16, s.form(), offset);
    default: return pick_tiles<K, kS8>(g16, s.form(), offset);
  }
}

// The tile kernel for segment s: the tile unit's (amx) or the vector one's.
TilesFn pick_kernel(const Segment& s, bool amx) {
#ifdef KVRAY_AMX
  if (amx) return pick_kind<AmxTiles>(s);
#else
  (void)amx;
#endif
  return pick_kind<VectorTiles>(s);
}

// Whether a call of M x rows takes the tile unit.
bool amx_route(int64_t M) {
#ifdef KVRAY_AMX
  return M >= kAmxRows && amx_enabled();
#else
  (void)M;
  return false;
#endif
}

// What a QuantProduct's tiles run on: the blob's segments as the kernels read them, and x
// quantized once.
struct ProductJob {
  SegView view;
  XView xv;
  TilesFn fn;
  int64_t tile0, tiles, row0;
};

}  // namespace

struct QuantProduct::State {
  Blob b;
  QuantizedX qx;
  std::vector<std::vector<float>> sums;
  std::vector<ProductJob> jobs;
  int64_t M = 0, tiles = 0;
  const float* bias = nullptr;
  bool amx = false;  // the tiles run on the tile unit (amx_tiles), two at a time
};

QuantProduct::QuantProduct(const at::Tensor& blob, const float* x, int64_t ldx, int64_t M,
                           const float* bias)
    : state_(std::make_unique<State>()) {
  State& st = *state_;
  st.b = parse_blob(blob, "linear_q");
  const Blob& b = st.b;
  for (const Segment& s : b.segs)
    TORCH_CHECK(s.kind != kF8, "linear_q: F8 weights have no CPU kernel (dequantize them)");
  st.M = M, st.bias = bias, st.amx = amx_route(M);
  // the tile unit reads x in whole A tiles of 16 rows: zero rows up to a multiple of 16
  const int64_t rows = st.amx ? (M + 15) / 16 * 16 : M;
  // the segments that run the 8-row S8 pair kernel (S8 with no mins, whole-block groups)
  auto pairs_s8x8 = [&](const Segment& s) {
#ifdef KVRAY_VNNI512
    return s.kind == kS8 && s.group % kBlock == 0 && s.mins == nullptr && !st.amx &&
           M >= kPairRowsS8;
#else
    (void)s;
    return false;
#endif
  };
  bool interleave = false;
  for (const Segment& s : b.segs) interleave = interleave || pairs_s8x8(s);
  st.qx = quantize_x(x, ldx, M, rows, b.K, b.Kp, interleave);
  st.sums.resize(b.segs.size());
  for (size_t i = 0; i < b.segs.size(); ++i) {
    const Segment& s = b.segs[i];
    const bool offset = s.mins != nullptr || s.zero != 0;
    if (offset) st.sums[i] = group_sums(st.qx, rows, s.group);
    const SegView view{s.codes, s.scales, s.mins, s.super_scales, s.super_mins,
                       kTile * b.row_bytes(s), kTile * b.groups(s) * s.scale_bytes(),
                       kTile * b.supers(s) * 2, s.group, s.super_group, s.rows, s.zero,
                       s.scale_type == kSubS8};
    const bool x8 = pairs_s8x8(s);
    const XView xv{st.qx.q.data(), st.qx.d.data(), offset ? st.sums[i].data() : nullptr,
                   st.qx.c16.data(), x8 ? st.qx.q8.data() : nullptr,
                   x8 ? st.qx.d8.data() : nullptr, x8 ? st.qx.c8.data() : nullptr,
                   st.qx.Kp, st.qx.nb, b.groups(s)};
    st.jobs.push_back({view, xv, pick_kernel(s, st.amx), st.tiles, Blob::tiles(s), s.row0});
    st.tiles += Blob::tiles(s);
  }
}

QuantProduct::~QuantProduct() = default;
int64_t QuantProduct::tiles() const { return state_->tiles; }
int64_t QuantProduct::out_features() const { return state_->b.N; }
int64_t QuantProduct::in_features() const { return state_->b.K; }
// chunks of at least ~16 KiB of codes (as cpu_linear.cpp's run)
int64_t QuantProduct::grain() const {
  return std::max<int64_t>(1, 16384 / (kTile * state_->b.Kp / 2));
}

void QuantProduct::run(int64_t t0, int64_t t1, float* y) const {
  const State& st = *state_;
  for (const ProductJob& j : st.jobs) {
    const int64_t lo = std::max(t0, j.tile0), hi = std::min(t1, j.tile0 + j.tiles);
    if (lo < hi)
      j.fn(j.view, j.xv, st.M, lo - j.tile0, hi - j.tile0, y + j.row0, st.b.N,
           st.bias ? st.bias + j.row0 : nullptr);
  }
}

namespace {

void linear_int8(const at::Tensor& blob, const float* x, int64_t ldx, int64_t M,
                 const float* bias, float* y) {
  const QuantProduct product(blob, x, ldx, M, bias);
  // about 4 chunks per thread, of whole pairs of tiles (the pair kernels' unit)
  int64_t chunk = std::max(product.grain(), chunk_for_threads(product.tiles()));
  chunk += chunk % 2;
  parallel_streams(product.tiles(), chunk,
                   [&](int64_t c0, int64_t c1) { product.run(c0, c1, y); });
}

}  // namespace
#endif  // __AVX2__

#ifndef __AVX2__
struct QuantProduct::State {};
QuantProduct::QuantProduct(const at::Tensor&, const float*, int64_t, int64_t, const float*) {
  TORCH_CHECK(false, "QuantProduct: no quantized kernels in a build without AVX2");
}
QuantProduct::~QuantProduct() = default;
int64_t QuantProduct::tiles() const { return 0; }
int64_t QuantProduct::grain() const { return 1; }
int64_t QuantProduct::out_features() const { return 0; }
int64_t QuantProduct::in_features() const { return 0; }
void QuantProduct::run(int64_t, int64_t, float*) const {}
#endif

std::string quant_dot() {
#if defined(KVRAY_VNNI512)
  return "vnni512";
#elif defined(KVRAY_VNNI)
  return "vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "none";
#endif
}

int64_t quant_amx_rows() {
#ifdef KVRAY_AMX
  return amx_enabled() ? kAmxRows : 0;
#else
  return 0;
#endif
}

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
  linear_int8(blob, xc.data_ptr<float>(), xc.stride(0), M, bp, y.data_ptr<float>());
  return y;
#else
  // No vector kernels: the dequantized matrix through ATen's matmul.
  const at::Tensor w = dequantize_q(blob);
  return has_bias ? at::addmm(*bias, x, w.t()) : at::mm(x, w.t());
#endif
}
