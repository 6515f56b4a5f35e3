// The row loop both FP4 formats share: e2m1 pairs (low nibble first) times the scale of
// their block, which each format decodes its own way.
#pragma once

#include <cstdint>
#include <span>

#include "base/dtype.h"
#include "quant/span_check.h"

namespace keel {

template <typename ScaleOf>  // float(uint8_t stored_scale)
void dequantize_e2m1_row(std::span<const uint8_t> packed, std::span<const uint8_t> scales, int64_t cols,
                         int block, int64_t row, std::span<float> out, ScaleOf scale_of) {
  expect_divisible(cols, block, "fp4 cols");
  expect_size(out.size(), static_cast<uint64_t>(cols), "fp4 output row");
  expect_row(row, packed.size(), scales.size(), cols, block);
  const uint8_t* p = &packed[row * cols / 2];
  const uint8_t* s = &scales[row * cols / block];
  for (int64_t k = 0; k < cols; k += 2) {
    const float scale = scale_of(s[k / block]);
    out[k] = e2m1_to_f32(e2m1_low(p[k / 2])) * scale;
    out[k + 1] = e2m1_to_f32(e2m1_high(p[k / 2])) * scale;
  }
}

}  // namespace keel
