// Quantization formats, checked bit for bit on vectors worked out by hand, then on
// random data against the error bound each format guarantees.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "base/dtype.h"
#include "cuda/fp4_words.h"
#include "quant/fp8_block.h"
#include "quant/mxfp4.h"
#include "quant/nvfp4.h"
#include "testing.h"

namespace keel {
namespace {

TEST(Fp8Block, HandComputedUe8m0) {
  // 2x3 matrix, 2x2 blocks. Block (0,0) = {1, -2, 0.5, 3}: amax 3, 3/448 rounds up to
  // 2^-7 (ue8m0 120); codes are value * 128: 128 -> 0x70, -256 -> 0xf8, 64 -> 0x68,
  // 384 = 1.5 * 2^8 -> 0x7c. Block (0,1) = {896, 7}: amax 896, 896/448 = 2 (ue8m0 128);
  // 448 -> 0x7e, 3.5 = 1.75 * 2 -> 0x46.
  const std::vector<float> w = {1, -2, 896, 0.5f, 3, 7};
  const Fp8BlockShape shape{2, 3, 2, 2};
  std::vector<uint8_t> codes(6, 0xab), scales(2, 0xab);
  quantize_fp8_block(w, shape, ScaleFormat::ue8m0, codes, scales);
  EXPECT_EQ(scales, (std::vector<uint8_t>{120, 128}));
  EXPECT_EQ(codes, (std::vector<uint8_t>{0x70, 0xf8, 0x7e, 0x68, 0x7c, 0x46}));
  std::vector<float> back(6, -1);
  dequantize_fp8_block(codes, scales, shape, ScaleFormat::ue8m0, back);
  EXPECT_EQ(back, w);  // every value here is exactly representable
}

TEST(Fp8Block, HandComputedF32Scales) {
  // f32 scale = amax / 448 exactly; 1 / (3/448) = 149.33 lies between 144 (0x71) and
  // 160 (0x72), nearer 144.
  const std::vector<float> w = {1, -2, 0.5f, 3};
  const Fp8BlockShape shape{2, 2, 2, 2};
  std::vector<uint8_t> codes(4), scales(4);
  quantize_fp8_block(w, shape, ScaleFormat::f32, codes, scales);
  EXPECT_FLOAT_EQ(fp8_scale_at(scales, ScaleFormat::f32, 0), 3.0f / 448.0f);
  EXPECT_EQ(codes[0], 0x71);
  EXPECT_EQ(codes[3], 0x7e);  // the amax maps to 448
}

TEST(Fp8Block, AllZeroBlockUsesTheAmaxFloor) {
  const std::vector<float> w(4, 0.0f);
  std::vector<uint8_t> codes(4, 0xab), scales(1);
  quantize_fp8_block(w, {2, 2, 2, 2}, ScaleFormat::ue8m0, codes, scales);
  EXPECT_EQ(scales[0], ue8m0_ceil(1e-4f / 448.0f));
  EXPECT_EQ(codes, std::vector<uint8_t>(4, 0));
}

TEST(Fp8Block, RandomWithinHalfUlpAcrossBlockEdges) {
  // 130 x 260 crosses both 128-wide block edges. e4m3 has 3 mantissa bits: the rounding
  // error is at most 2^-4 relative, plus half the subnormal step (2^-10 * s) near zero.
  const Fp8BlockShape shape{130, 260};
  const auto w = testing::random_normal(130 * 260, 7);
  std::vector<uint8_t> codes(w.size()), scales(shape.scale_count());
  quantize_fp8_block(w, shape, ScaleFormat::ue8m0, codes, scales);
  std::vector<float> back(w.size());
  dequantize_fp8_block(codes, scales, shape, ScaleFormat::ue8m0, back);
  for (int64_t r = 0; r < shape.rows; ++r)
    for (int64_t c = 0; c < shape.cols; ++c) {
      const float s = fp8_scale_at(scales, ScaleFormat::ue8m0, (r / 128) * shape.scale_cols() + c / 128);
      const float x = w[r * shape.cols + c];
      ASSERT_LE(std::fabs(back[r * shape.cols + c] - x), std::fabs(x) / 16 + s * std::ldexp(1.0f, -10))
          << r << "," << c;
    }
}

TEST(Fp8Block, ActivationsPerTokenGroups) {
  // One row, group 4: {1, 2, -3, 0.5} amax 3 -> 3/448 rounds up to 2^-7; {100, 0, 0, 0}
  // amax 100 -> 100/448 = 0.223 rounds up to 0.25.
  const std::vector<float> x = {1, 2, -3, 0.5f, 100, 0, 0, 0};
  std::vector<uint8_t> codes(8);
  std::vector<float> scales(2);
  quantize_fp8_activations(x, 1, 8, 4, codes, scales);
  EXPECT_EQ(scales, (std::vector<float>{std::ldexp(1.0f, -7), 0.25f}));
  EXPECT_EQ(codes[0], 0x70);         // 128
  EXPECT_EQ(codes[2], 0x80 | 0x7c);  // -384
  EXPECT_EQ(codes[4], f32_to_e4m3(400.0f));
  EXPECT_EQ(e4m3_to_f32(codes[4]), 384.0f);  // 400 rounds to 384 (step 32 in [256, 512))
}

TEST(Mxfp4, PackIsLowNibbleFirst) {
  const std::vector<uint8_t> codes = {0x1, 0x2, 0xf, 0x0};
  std::vector<uint8_t> packed(2);
  pack_e2m1(codes, packed);
  EXPECT_EQ(packed, (std::vector<uint8_t>{0x21, 0x0f}));
  std::vector<uint8_t> back(4);
  unpack_e2m1(packed, back);
  EXPECT_EQ(back, codes);
}

TEST(Mxfp4, HandComputed) {
  // Block 0: amax 6 -> scale 2^ceil(log2(1)) = 1 (ue8m0 127); 6 -> 7, -3 -> 0xd, 0.5 -> 1.
  // Block 1: amax 7 -> 7/6 rounds up to 2 (ue8m0 128); 7/2 = 3.5 ties to 4 (code 6),
  // 5/2 = 2.5 ties to 2 (code 4), -1/2 -> 0x9.
  std::vector<float> w(64, 0.0f);
  w[0] = 6, w[1] = -3, w[2] = 0.5f;
  w[32] = 7, w[33] = 5, w[35] = -1;
  std::vector<uint8_t> packed(32, 0xab), scales(2, 0xab);
  quantize_mxfp4(w, 1, 64, packed, scales);
  EXPECT_EQ(scales, (std::vector<uint8_t>{127, 128}));
  EXPECT_EQ(packed[0], 0xd7);
  EXPECT_EQ(packed[1], 0x01);
  EXPECT_EQ(packed[16], 0x46);
  EXPECT_EQ(packed[17], 0x90);
  for (int j : {2, 15, 18, 31}) EXPECT_EQ(packed[j], 0) << j;
  std::vector<float> back(64, -1);
  dequantize_mxfp4(packed, scales, 1, 64, back);
  EXPECT_EQ(back[0], 6);
  EXPECT_EQ(back[1], -3);
  EXPECT_EQ(back[32], 8);   // 7 -> 4 * 2
  EXPECT_EQ(back[33], 4);   // 5 -> 2 * 2
  EXPECT_EQ(back[35], -1);
}

TEST(Mxfp4, TinyBlockUsesTheAmaxFloor) {
  std::vector<float> w(32, 0.0f);
  std::vector<uint8_t> packed(16), scales(1);
  quantize_mxfp4(w, 1, 32, packed, scales);
  EXPECT_EQ(scales[0], 1);  // 6 * 2^-126 / 6 = 2^-126 -> byte 1
}

TEST(Mxfp4, RandomWithinHalfStep) {
  // The largest e2m1 step is 2 (between 4 and 6); with the scale chosen so nothing
  // saturates, the error is at most half a step times the block scale.
  const int64_t rows = 3, cols = 96;
  const auto w = testing::random_normal(rows * cols, 11);
  std::vector<uint8_t> packed(rows * cols / 2), scales(rows * cols / 32);
  quantize_mxfp4(w, rows, cols, packed, scales);
  std::vector<float> back(w.size());
  dequantize_mxfp4(packed, scales, rows, cols, back);
  for (size_t i = 0; i < w.size(); ++i) {
    const float s = ue8m0_to_f32(scales[i / 32]);
    ASSERT_LE(std::fabs(back[i] - w[i]), s) << i;
  }
}

// The GPU's packed FP4 words (cuda/fp4_words.h, plain bit operations, so they run here).
// Packing moves each of a word's 32 bits to its own place and unpacking brings it back.
TEST(Fp4Words, PackingIsABijectionUndoneByUnpacking) {
  uint32_t seen = 0;
  for (int bit = 0; bit < 32; ++bit) {
    const uint32_t packed = cuda::pack_fp4_word(uint32_t{1} << bit);
    ASSERT_EQ(packed & (packed - 1), 0u) << "bit " << bit << " went to no single place";
    ASSERT_NE(packed, 0u) << "bit " << bit;
    EXPECT_EQ(seen & packed, 0u) << "bit " << bit << " lands where another did";
    seen |= packed;
    EXPECT_EQ(cuda::unpack_fp4_word(packed), uint32_t{1} << bit);
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 1000; ++i) {
    const uint32_t w = rng();
    EXPECT_EQ(cuda::unpack_fp4_word(cuda::pack_fp4_word(w)), w);
  }
}

// Each pair the tensor-core tiles build from a packed word is the checkpoint's values k
// and k+4 as bf16 bits that read as the e2m1 value times 2^-126 (each of the 16 codes in
// each of the 8 places, with random codes around it).
TEST(Fp4Words, PairsAreTheValuesAsBf16) {
  const auto half_value = [](uint32_t bits16) {
    const uint32_t f = bits16 << 16;
    float v;
    std::memcpy(&v, &f, sizeof v);
    return std::ldexp(v, 126);
  };
  const auto pairs = [](uint32_t packed) {
    return std::array<uint32_t, 4>{cuda::fp4_pair<0>(packed), cuda::fp4_pair<1>(packed), cuda::fp4_pair<2>(packed),
                                   cuda::fp4_pair<3>(packed)};
  };
  std::mt19937 rng(12);
  for (int place = 0; place < 8; ++place) {
    for (uint32_t code = 0; code < 16; ++code) {
      const uint32_t w = (rng() & ~(0xfu << (4 * place))) | code << (4 * place);
      const std::array<uint32_t, 4> p = pairs(cuda::pack_fp4_word(w));
      for (int i = 0; i < 8; ++i) {
        const uint32_t c = (w >> (4 * i)) & 0xfu;
        const uint32_t bits = (p[i % 4] >> (16 * (i / 4))) & 0xffffu;
        EXPECT_EQ(half_value(bits), e2m1_to_f32(static_cast<uint8_t>(c))) << "value " << i << " code " << c;
        EXPECT_EQ(bits & ~0x81c0u, 0u) << "value " << i << ": bits outside the sign, exponent and mantissa";
      }
    }
  }
}

TEST(Mxfp4, RejectsWrongSizes) {
  std::vector<float> w(48);
  std::vector<uint8_t> packed(24), scales(1);
  KEEL_EXPECT_ERROR(quantize_mxfp4(w, 1, 48, packed, scales), ErrorCode::usage);  // 48 % 32
  std::vector<float> out(32);
  std::vector<uint8_t> p(16), s(1);
  KEEL_EXPECT_ERROR(dequantize_mxfp4_row(p, s, 32, 1, out), ErrorCode::usage);  // row 1 of 1
}

TEST(Nvfp4, HandComputed) {
  // amax 2688 = 448 * 6 -> global 1. Block 0 amax 2688 -> scale e4m3(448) = 0x7e:
  // 2688 -> 6 (7), 448 -> 1 (2), -1344 -> -3 (0xd). Block 1 amax 12 -> scale 2 (0x40):
  // 12 -> 6 (7), 3 -> 1.5 (3), -1 -> -0.5 (0x9).
  std::vector<float> w(32, 0.0f);
  w[0] = 2688, w[1] = 448, w[2] = -1344;
  w[16] = 12, w[17] = 3, w[18] = -1;
  std::vector<uint8_t> packed(16, 0xab), scales(2, 0xab);
  const float global = quantize_nvfp4(w, 1, 32, packed, scales);
  EXPECT_EQ(global, 1.0f);
  EXPECT_EQ(scales, (std::vector<uint8_t>{0x7e, 0x40}));
  EXPECT_EQ(packed[0], 0x27);
  EXPECT_EQ(packed[1], 0x0d);
  EXPECT_EQ(packed[8], 0x37);
  EXPECT_EQ(packed[9], 0x09);
  std::vector<float> back(32, -1);
  dequantize_nvfp4(packed, scales, global, 1, 32, back);
  EXPECT_EQ(back, w);  // all exactly representable
}

TEST(Nvfp4, ZeroBlockStoresZeroCodes) {
  std::vector<float> w(32, 0.0f);
  w[0] = 1.0f;  // block 1 is all zero
  std::vector<uint8_t> packed(16, 0xab), scales(2, 0xab);
  quantize_nvfp4(w, 1, 32, packed, scales);
  EXPECT_EQ(scales[1], 0);
  for (int j = 8; j < 16; ++j) EXPECT_EQ(packed[j], 0);
}

TEST(Nvfp4, RandomWithinBound) {
  // Error per element <= half the largest e2m1 step (1) times the block scale, plus the
  // e4m3 rounding of the scale itself (<= 2^-4 relative, on values up to 6 * scale).
  const int64_t rows = 4, cols = 48;
  const auto w = testing::random_normal(rows * cols, 13);
  std::vector<uint8_t> packed(rows * cols / 2), scales(rows * cols / 16);
  const float global = quantize_nvfp4(w, rows, cols, packed, scales);
  std::vector<float> back(w.size());
  dequantize_nvfp4(packed, scales, global, rows, cols, back);
  for (size_t i = 0; i < w.size(); ++i) {
    const float s = e4m3_to_f32(scales[i / 16]) * global;
    ASSERT_LE(std::fabs(back[i] - w[i]), s * (1.0f + 6.0f / 16)) << i;
  }
}

}  // namespace
}  // namespace keel
