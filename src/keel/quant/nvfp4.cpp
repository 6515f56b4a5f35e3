#include "quant/nvfp4.h"

#include <algorithm>
#include <cmath>

#include "base/dtype.h"
#include "quant/fp8_block.h"
#include "quant/mxfp4.h"
#include "quant/e2m1_rows.h"
#include "quant/span_check.h"

namespace keel {
namespace {

void check(uint64_t packed, uint64_t scales, int64_t rows, int64_t cols) {
  expect_divisible(cols, kNvfp4Block, "nvfp4 cols");
  expect_size(packed, static_cast<uint64_t>(rows * cols / 2), "nvfp4 packed");
  expect_size(scales, static_cast<uint64_t>(rows * cols / kNvfp4Block), "nvfp4 scales");
}

}  // namespace

float quantize_nvfp4(std::span<const float> weights, int64_t rows, int64_t cols, std::span<uint8_t> packed,
                     std::span<uint8_t> scales) {
  check(packed.size(), scales.size(), rows, cols);
  expect_size(weights.size(), static_cast<uint64_t>(rows * cols), "nvfp4 weights");
  float amax = 0;
  for (float w : weights) amax = std::max(amax, std::fabs(w));
  // An all-zero tensor keeps global 1 so that nothing divides by zero.
  const float global = amax > 0 ? amax / (kE4M3Max * kE2M1Max) : 1.0f;
  for (int64_t b = 0; b < rows * cols / kNvfp4Block; ++b) {
    const float* x = &weights[b * kNvfp4Block];
    float block_amax = 0;
    for (int i = 0; i < kNvfp4Block; ++i) block_amax = std::max(block_amax, std::fabs(x[i]));
    scales[b] = f32_to_e4m3(block_amax / kE2M1Max / global);
    const float s = e4m3_to_f32(scales[b]) * global;
    for (int i = 0; i < kNvfp4Block; i += 2) {
      const uint8_t even = s > 0 ? f32_to_e2m1(x[i] / s) : 0;
      const uint8_t odd = s > 0 ? f32_to_e2m1(x[i + 1] / s) : 0;
      packed[(b * kNvfp4Block + i) / 2] = pack_e2m1(even, odd);
    }
  }
  return global;
}

void dequantize_nvfp4_row(std::span<const uint8_t> packed, std::span<const uint8_t> scales, float global_scale,
                          int64_t cols, int64_t row, std::span<float> out) {
  dequantize_e2m1_row(packed, scales, cols, kNvfp4Block, row, out,
                      [global_scale](uint8_t s) { return e4m3_to_f32(s) * global_scale; });
}

void dequantize_nvfp4(std::span<const uint8_t> packed, std::span<const uint8_t> scales, float global_scale,
                      int64_t rows, int64_t cols, std::span<float> out) {
  check(packed.size(), scales.size(), rows, cols);
  expect_size(out.size(), static_cast<uint64_t>(rows * cols), "nvfp4 output");
  for (int64_t r = 0; r < rows; ++r)
    dequantize_nvfp4_row(packed, scales, global_scale, cols, r, out.subspan(r * cols, cols));
}

}  // namespace keel
