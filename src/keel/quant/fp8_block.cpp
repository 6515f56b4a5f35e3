#include "quant/fp8_block.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/dtype.h"
#include "quant/span_check.h"

namespace keel {
namespace {

size_t scale_bytes(ScaleFormat format) { return format == ScaleFormat::ue8m0 ? 1 : 4; }

void check(std::span<const uint8_t> codes, std::span<const uint8_t> scales, const Fp8BlockShape& shape,
           ScaleFormat format) {
  expect_size(codes.size(), static_cast<uint64_t>(shape.rows * shape.cols), "fp8 codes");
  expect_size(scales.size(), static_cast<uint64_t>(shape.scale_count()) * scale_bytes(format), "fp8 scales");
}

// Picks the block scale for `amax` and stores it; returns the f32 multiplier.
float store_scale(float amax, ScaleFormat format, std::span<uint8_t> scales, int64_t index) {
  const float raw = std::max(amax, kFp8AmaxFloor) / kE4M3Max;
  if (format == ScaleFormat::ue8m0) {
    scales[index] = ue8m0_ceil(raw);
    return ue8m0_to_f32(scales[index]);
  }
  std::memcpy(&scales[index * 4], &raw, 4);
  return raw;
}

}  // namespace

float fp8_scale_at(std::span<const uint8_t> scales, ScaleFormat format, int64_t index) {
  if (format == ScaleFormat::ue8m0) return ue8m0_to_f32(scales[index]);
  float s;
  std::memcpy(&s, &scales[index * 4], 4);
  return s;
}

void quantize_fp8_block(std::span<const float> weights, const Fp8BlockShape& shape, ScaleFormat format,
                        std::span<uint8_t> codes, std::span<uint8_t> scales) {
  expect_size(weights.size(), static_cast<uint64_t>(shape.rows * shape.cols), "fp8 weights");
  check(codes, scales, shape, format);
  for (int64_t br = 0; br < shape.scale_rows(); ++br) {
    const int64_t r0 = br * shape.block_rows, r1 = std::min(shape.rows, r0 + shape.block_rows);
    for (int64_t bc = 0; bc < shape.scale_cols(); ++bc) {
      const int64_t c0 = bc * shape.block_cols, c1 = std::min(shape.cols, c0 + shape.block_cols);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(weights[r * shape.cols + c]));
      const float s = store_scale(amax, format, scales, br * shape.scale_cols() + bc);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) codes[r * shape.cols + c] = f32_to_e4m3(weights[r * shape.cols + c] / s);
    }
  }
}

void dequantize_fp8_block_row(std::span<const uint8_t> codes, std::span<const uint8_t> scales,
                              const Fp8BlockShape& shape, ScaleFormat format, int64_t row, std::span<float> out) {
  check(codes, scales, shape, format);
  expect_size(out.size(), static_cast<uint64_t>(shape.cols), "fp8 output row");
  const int64_t scale_row = row / shape.block_rows;
  for (int64_t c = 0; c < shape.cols; ++c) {
    const float s = fp8_scale_at(scales, format, scale_row * shape.scale_cols() + c / shape.block_cols);
    out[c] = e4m3_to_f32(codes[row * shape.cols + c]) * s;
  }
}

void dequantize_fp8_block(std::span<const uint8_t> codes, std::span<const uint8_t> scales,
                          const Fp8BlockShape& shape, ScaleFormat format, std::span<float> out) {
  expect_size(out.size(), static_cast<uint64_t>(shape.rows * shape.cols), "fp8 output");
  for (int64_t r = 0; r < shape.rows; ++r)
    dequantize_fp8_block_row(codes, scales, shape, format, r, out.subspan(r * shape.cols, shape.cols));
}

void quantize_fp8_activations(std::span<const float> x, int64_t rows, int64_t cols, int group,
                              std::span<uint8_t> codes, std::span<float> scales) {
  const int64_t groups = (cols + group - 1) / group;
  expect_size(x.size(), static_cast<uint64_t>(rows * cols), "fp8 activations");
  expect_size(codes.size(), static_cast<uint64_t>(rows * cols), "fp8 activation codes");
  expect_size(scales.size(), static_cast<uint64_t>(rows * groups), "fp8 activation scales");
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * group, c1 = std::min(cols, c0 + group);
      float amax = 0;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
      const float s = ue8m0_to_f32(ue8m0_ceil(std::max(amax, kFp8AmaxFloor) / kE4M3Max));
      scales[r * groups + g] = s;
      for (int64_t c = c0; c < c1; ++c) codes[r * cols + c] = f32_to_e4m3(x[r * cols + c] / s);
    }
  }
}

}  // namespace keel
