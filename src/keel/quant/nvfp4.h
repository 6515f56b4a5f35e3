// NVFP4 (NVIDIA): e2m1 values, one e4m3 scale per 16 consecutive inputs, and one f32
// global scale per tensor (ModelOpt checkpoints: `weight` U8 [out, in/2],
// `weight_scale` F8_E4M3 [out, in/16], `weight_scale_2` F32 []):
//
//   W[n, k] = e2m1(nibble k of row n) * e4m3(S[n, k / 16]) * global
//
// Quantizing (the ModelOpt recipe): global = amax(tensor) / (448 * 6); per block
// s = e4m3(amax(block) / 6 / global) (RNE, saturating); code = e2m1(x / (s * global)),
// and a block whose scale rounds to zero stores zero codes.
#pragma once

#include <cstdint>
#include <span>

namespace keel {

inline constexpr int kNvfp4Block = 16;

// Returns the global scale. `packed` [rows, cols/2], `scales` [rows, cols/16] e4m3 codes.
float quantize_nvfp4(std::span<const float> weights, int64_t rows, int64_t cols, std::span<uint8_t> packed,
                     std::span<uint8_t> scales);
void dequantize_nvfp4_row(std::span<const uint8_t> packed, std::span<const uint8_t> scales, float global_scale,
                          int64_t cols, int64_t row, std::span<float> out);
void dequantize_nvfp4(std::span<const uint8_t> packed, std::span<const uint8_t> scales, float global_scale,
                      int64_t rows, int64_t cols, std::span<float> out);

}  // namespace keel
