#include "quant/mxfp4.h"

#include <algorithm>
#include <cmath>

#include "base/dtype.h"
#include "quant/e2m1_rows.h"

namespace keel {

void pack_e2m1(std::span<const uint8_t> codes, std::span<uint8_t> packed) {
  expect_size(codes.size() % 2, 0, "e2m1 code count parity");
  expect_size(packed.size(), codes.size() / 2, "e2m1 packed");
  for (size_t j = 0; j < packed.size(); ++j) packed[j] = keel::pack_e2m1(codes[2 * j], codes[2 * j + 1]);
}

void unpack_e2m1(std::span<const uint8_t> packed, std::span<uint8_t> codes) {
  expect_size(codes.size(), packed.size() * 2, "e2m1 codes");
  for (size_t j = 0; j < packed.size(); ++j) {
    codes[2 * j] = e2m1_low(packed[j]);
    codes[2 * j + 1] = e2m1_high(packed[j]);
  }
}

void quantize_mxfp4(std::span<const float> weights, int64_t rows, int64_t cols, std::span<uint8_t> packed,
                    std::span<uint8_t> scales) {
  expect_divisible(cols, kMxfp4Block, "mxfp4 cols");
  expect_size(weights.size(), static_cast<uint64_t>(rows * cols), "mxfp4 weights");
  expect_size(packed.size(), static_cast<uint64_t>(rows * cols / 2), "mxfp4 packed");
  expect_size(scales.size(), static_cast<uint64_t>(rows * cols / kMxfp4Block), "mxfp4 scales");
  const float amax_floor = kE2M1Max * std::ldexp(1.0f, -126);
  for (int64_t b = 0; b < rows * cols / kMxfp4Block; ++b) {
    const float* x = &weights[b * kMxfp4Block];
    float amax = amax_floor;
    for (int i = 0; i < kMxfp4Block; ++i) amax = std::max(amax, std::fabs(x[i]));
    scales[b] = ue8m0_ceil(amax / kE2M1Max);
    const float s = ue8m0_to_f32(scales[b]);
    for (int i = 0; i < kMxfp4Block; i += 2)
      packed[(b * kMxfp4Block + i) / 2] = keel::pack_e2m1(f32_to_e2m1(x[i] / s), f32_to_e2m1(x[i + 1] / s));
  }
}

void dequantize_mxfp4_row(std::span<const uint8_t> packed, std::span<const uint8_t> scales, int64_t cols,
                          int64_t row, std::span<float> out) {
  dequantize_e2m1_row(packed, scales, cols, kMxfp4Block, row, out, ue8m0_to_f32);
}

void dequantize_mxfp4(std::span<const uint8_t> packed, std::span<const uint8_t> scales, int64_t rows,
                      int64_t cols, std::span<float> out) {
  expect_divisible(cols, kMxfp4Block, "mxfp4 cols");
  expect_size(packed.size(), static_cast<uint64_t>(rows * cols / 2), "mxfp4 packed");
  expect_size(scales.size(), static_cast<uint64_t>(rows * cols / kMxfp4Block), "mxfp4 scales");
  expect_size(out.size(), static_cast<uint64_t>(rows * cols), "mxfp4 output");
  for (int64_t r = 0; r < rows; ++r) dequantize_mxfp4_row(packed, scales, cols, r, out.subspan(r * cols, cols));
}

}  // namespace keel
