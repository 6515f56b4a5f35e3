// MXFP4 (OCP microscaling): e2m1 values, one ue8m0 scale per 32 consecutive inputs.
// DSV4 routed experts store W [out, in] as I8 [out, in/2] (low nibble = even input)
// with scales F8_E8M0 [out, in/32]:
//
//   W[n, k] = e2m1(nibble k of row n) * 2^(S[n, k / 32] - 127)
//
// Quantizing follows DeepSeek/vLLM: amax = max(|x| over the block, 6 * 2^-126),
// scale = 2^ceil(log2(amax / 6)) (so nothing saturates), code = e2m1(x / scale), RNE.
#pragma once

#include <cstdint>
#include <span>

namespace keel {

inline constexpr int kMxfp4Block = 32;
inline constexpr float kE2M1Max = 6.0f;

// `codes` one e2m1 code per byte, count even -> `packed` count/2 bytes; and back.
void pack_e2m1(std::span<const uint8_t> codes, std::span<uint8_t> packed);
void unpack_e2m1(std::span<const uint8_t> packed, std::span<uint8_t> codes);

// `weights` [rows, cols] row-major, cols % 32 == 0 -> `packed` [rows, cols/2], `scales` [rows, cols/32].
void quantize_mxfp4(std::span<const float> weights, int64_t rows, int64_t cols, std::span<uint8_t> packed,
                    std::span<uint8_t> scales);
void dequantize_mxfp4_row(std::span<const uint8_t> packed, std::span<const uint8_t> scales, int64_t cols,
                          int64_t row, std::span<float> out);
void dequantize_mxfp4(std::span<const uint8_t> packed, std::span<const uint8_t> scales, int64_t rows,
                      int64_t cols, std::span<float> out);

}  // namespace keel
