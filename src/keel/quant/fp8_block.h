// FP8 e4m3 weights with one scale per 128x128 block (DeepSeek-V3/V4 dense layers), and
// the per-token 1x128 activation quantization that FP8 GEMMs pair with them.
//
//   W[n, k] = e4m3(q[n, k]) * S[n / 128, k / 128]
//
// Scales are ue8m0 bytes (DSV4: `scale_fmt: ue8m0`, every scale a power of two) or f32
// (DSV3 / Flash-Base experts). Quantizing picks s = amax / 448 per block (rounded up to
// a power of two for ue8m0, so no value saturates), amax floored at 1e-4 as DeepSeek's
// kernels do, and rounds each w / s to nearest even.
#pragma once

#include <cstdint>
#include <span>

namespace keel {

enum class ScaleFormat : uint8_t { ue8m0, f32 };

struct Fp8BlockShape {
  int64_t rows = 0;  // out features
  int64_t cols = 0;  // in features
  int block_rows = 128;
  int block_cols = 128;

  int64_t scale_rows() const { return (rows + block_rows - 1) / block_rows; }
  int64_t scale_cols() const { return (cols + block_cols - 1) / block_cols; }
  int64_t scale_count() const { return scale_rows() * scale_cols(); }
};

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kFp8AmaxFloor = 1e-4f;

// The f32 value of scale number `index` stored in `format` (bytes of ue8m0 or f32).
float fp8_scale_at(std::span<const uint8_t> scales, ScaleFormat format, int64_t index);

// `weights` row-major [rows, cols] -> e4m3 `codes` [rows, cols] and `scales`
// [scale_rows, scale_cols] (1 byte each for ue8m0, 4 for f32).
void quantize_fp8_block(std::span<const float> weights, const Fp8BlockShape& shape, ScaleFormat format,
                        std::span<uint8_t> codes, std::span<uint8_t> scales);

// One output row, for matrix kernels that dequantize on the fly.
void dequantize_fp8_block_row(std::span<const uint8_t> codes, std::span<const uint8_t> scales,
                              const Fp8BlockShape& shape, ScaleFormat format, int64_t row,
                              std::span<float> out);
void dequantize_fp8_block(std::span<const uint8_t> codes, std::span<const uint8_t> scales,
                          const Fp8BlockShape& shape, ScaleFormat format, std::span<float> out);

// Activations: per row, one power-of-two scale per `group` (128) values along K:
// s = 2^ceil(log2(amax / 448)). `codes` [rows, cols], `scales` [rows, ceil(cols/group)] f32.
void quantize_fp8_activations(std::span<const float> x, int64_t rows, int64_t cols, int group,
                              std::span<uint8_t> codes, std::span<float> scales);

}  // namespace keel
