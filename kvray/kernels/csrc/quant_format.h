// The codes of kvray's quantized weight blobs as the CPU kernels see them (cpu_quant.cpp,
// quant_tiles.h; the Python side is kvray/quant/blob.py's BLOB_LAYOUT).
#pragma once

#include <cstdint>

namespace {

enum Kind : int32_t { kU4 = 1, kS8 = 2, kF8 = 3, kU5 = 4, kU6 = 5 };
// scale dtypes: fp32, fp16, and the two-level 8-bit integers (times an fp16 per super-group)
enum ScaleType : int32_t { kF32 = 0, kF16 = 1, kSubU8 = 2, kSubS8 = 3 };
// which form of the scales a kernel is built for: fp32, fp16, two-level
enum ScaleForm : int { kFormF32 = 0, kFormF16 = 1, kFormSub = 2 };

constexpr bool nibble_kind(int32_t kind) { return kind == kU4 || kind == kU5 || kind == kU6; }
// bits per code as the blob stores it
constexpr int64_t code_bits(int32_t kind) {
  return kind == kU4 ? 4 : kind == kU5 ? 5 : kind == kU6 ? 6 : 8;
}
constexpr int64_t kBlock = 32;  // codes per activation block (and the K padding unit)
constexpr int64_t kTile = 8;    // weight rows interleaved per tile (one per vector lane)
// x rows per interleaved group of the S8 pair kernel (XView::q8): quantize_x writes
// them, dot_pair_s8x8 reads them
constexpr int kRowsX = 8;

}  // namespace
