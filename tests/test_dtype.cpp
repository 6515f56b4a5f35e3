// Conversions checked against values worked out by hand from each format's definition.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

#include "base/dtype.h"

namespace keel {
namespace {

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();
float bits_f32(uint32_t u) { return std::bit_cast<float>(u); }

TEST(DType, TraitsAndSafetensorsNames) {
  EXPECT_EQ(bits(DType::bf16), 16);
  EXPECT_EQ(bits(DType::f4_e2m1), 4);
  EXPECT_EQ(name(DType::f8_e4m3), "f8_e4m3");
  EXPECT_EQ(dtype_from_safetensors("F8_E8M0"), DType::f8_e8m0);
  EXPECT_EQ(dtype_from_safetensors("I8"), DType::i8);
  EXPECT_EQ(dtype_from_safetensors("BF16"), DType::bf16);
  EXPECT_EQ(dtype_from_safetensors("F8_E4M3FN"), std::nullopt);
  EXPECT_EQ(dtype_from_safetensors("bf16"), std::nullopt);  // names are case-sensitive
  for (int i = 0; i < static_cast<int>(DType::count_); ++i) {
    const auto d = static_cast<DType>(i);
    EXPECT_EQ(dtype_from_safetensors(traits(d).safetensors_name), d);
  }
}

TEST(DType, StorageBytes) {
  EXPECT_EQ(storage_bytes(DType::bf16, 3), 6u);
  EXPECT_EQ(storage_bytes(DType::f4_e2m1, 4), 2u);
  EXPECT_EQ(storage_bytes(DType::f4_e2m1, 3), std::nullopt);  // half a byte
  EXPECT_EQ(storage_bytes(DType::f64, uint64_t{1} << 62), std::nullopt);  // overflows
  EXPECT_EQ(storage_bytes(DType::u8, 0), 0u);
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(bits_f32(0x3f808000)), 0x3f80);  // tie, 0x3f80 is even
  EXPECT_EQ(f32_to_bf16(bits_f32(0x3f818000)), 0x3f82);  // tie, 0x3f81 is odd
  EXPECT_EQ(f32_to_bf16(bits_f32(0x3f808001)), 0x3f81);  // just above the tie
  EXPECT_EQ(f32_to_bf16(bits_f32(0x7f7fffff)), 0x7f80);  // max float rounds to inf
  EXPECT_EQ(f32_to_bf16(-kInf), 0xff80);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(kNaN))));
  EXPECT_EQ(f32_to_bf16(bits_f32(0x7f800001)) & 0x7fc0, 0x7fc0);  // signalling NaN made quiet
  EXPECT_EQ(bf16_to_f32(0x4049), 3.140625f);
}

TEST(DType, F16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);    // max finite
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);    // below the midpoint to 65536
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);    // the midpoint: 0x7bff is odd, rounds up to inf
  EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);          // min normal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);          // min subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);          // tie between 0 and 2^-24: even
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -26)), 0x0001);          // 1.5 * 2^-25: nearer 2^-24
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);          // tie 1.5 * 2^-24: even code 2
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);   // tie: even
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(3.0f, -11)), 0x3c02);   // tie: odd 0x3c01 -> 0x3c02
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(kNaN) & 0x7e00, 0x7e00);
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
  EXPECT_EQ(f16_to_f32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0xfc00), -kInf);
  for (uint32_t h = 0; h < 0x10000; ++h) {  // every non-NaN code survives a round trip
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (!std::isnan(f)) {
      ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
    }
  }
}

TEST(DType, E4M3Decode) {
  EXPECT_EQ(e4m3_to_f32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_f32(0x80)));
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // min subnormal
  EXPECT_EQ(e4m3_to_f32(0x07), std::ldexp(7.0f, -9));  // max subnormal
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // min normal
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_f32(0x78), 256.0f);  // exponent 15 is a normal binade in e4m3fn
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xff)));
}

TEST(DType, E4M3EncodeRoundingAndOverflow) {
  EXPECT_EQ(f32_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);   // tie between 1 (0x38) and 1.125 (0x39): even
  EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3a);   // tie between 1.125 (0x39) and 1.25 (0x3a): even
  EXPECT_EQ(f32_to_e4m3(1.07f), 0x39);
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);  // tie between 0 and 2^-9: even
  EXPECT_EQ(f32_to_e4m3(std::ldexp(3.0f, -10)), 0x02);  // tie between 2^-9 (0x01) and 2^-8 (0x02)
  EXPECT_EQ(f32_to_e4m3(-std::ldexp(1.0f, -12)), 0x80); // underflow keeps the sign
  EXPECT_EQ(f32_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(464.0f, Overflow::nonfinite), 0x7e);  // tie with 480: 0x7e is even
  EXPECT_EQ(f32_to_e4m3(464.5f, Overflow::nonfinite), 0x7f);  // past the tie: NaN
  EXPECT_EQ(f32_to_e4m3(464.5f, Overflow::saturate), 0x7e);
  EXPECT_EQ(f32_to_e4m3(1e9f, Overflow::saturate), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-1e9f, Overflow::saturate), 0xfe);
  EXPECT_EQ(f32_to_e4m3(kInf, Overflow::saturate), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-kInf, Overflow::nonfinite), 0xff);
  EXPECT_EQ(f32_to_e4m3(kNaN) & 0x7f, 0x7f);
  for (int c = 0; c < 256; ++c) {  // every finite code survives a round trip
    if ((c & 0x7f) == 0x7f) continue;
    ASSERT_EQ(f32_to_e4m3(e4m3_to_f32(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(DType, E5M2) {
  EXPECT_EQ(e5m2_to_f32(0x3c), 1.0f);
  EXPECT_EQ(e5m2_to_f32(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(e5m2_to_f32(0x7b), 57344.0f);
  EXPECT_EQ(e5m2_to_f32(0x7c), kInf);
  EXPECT_EQ(e5m2_to_f32(0xfc), -kInf);
  EXPECT_TRUE(std::isnan(e5m2_to_f32(0x7d)));
  EXPECT_EQ(f32_to_e5m2(61439.0f, Overflow::nonfinite), 0x7b);
  EXPECT_EQ(f32_to_e5m2(61440.0f, Overflow::nonfinite), 0x7c);  // tie, 0x7b is odd: up to inf
  EXPECT_EQ(f32_to_e5m2(61440.0f, Overflow::saturate), 0x7b);
  EXPECT_EQ(f32_to_e5m2(kInf, Overflow::nonfinite), 0x7c);
  EXPECT_EQ(f32_to_e5m2(-kInf, Overflow::saturate), 0xfb);
  EXPECT_EQ(f32_to_e5m2(1.125f), 0x3c);  // tie between 1 and 1.25: even
  EXPECT_EQ(f32_to_e5m2(1.375f), 0x3e);  // tie between 1.25 (0x3d) and 1.5 (0x3e)
  EXPECT_TRUE(std::isnan(e5m2_to_f32(f32_to_e5m2(kNaN))));
  for (int c = 0; c < 256; ++c) {
    const float f = e5m2_to_f32(static_cast<uint8_t>(c));
    if (!std::isnan(f)) {
      ASSERT_EQ(f32_to_e5m2(f, Overflow::nonfinite), c) << c;
    }
  }
}

TEST(DType, E2M1) {
  const float values[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(c)), values[c]);
    EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(c | 8)), -values[c]);
    EXPECT_EQ(f32_to_e2m1(values[c]), c);
  }
  // Midpoints round to the even code.
  EXPECT_EQ(f32_to_e2m1(0.25f), 0);  // 0 | 0.5
  EXPECT_EQ(f32_to_e2m1(0.75f), 2);  // 0.5 | 1
  EXPECT_EQ(f32_to_e2m1(1.25f), 2);  // 1 | 1.5
  EXPECT_EQ(f32_to_e2m1(1.75f), 4);  // 1.5 | 2
  EXPECT_EQ(f32_to_e2m1(2.5f), 4);   // 2 | 3
  EXPECT_EQ(f32_to_e2m1(3.5f), 6);   // 3 | 4
  EXPECT_EQ(f32_to_e2m1(5.0f), 6);   // 4 | 6
  EXPECT_EQ(f32_to_e2m1(5.01f), 7);
  EXPECT_EQ(f32_to_e2m1(-0.75f), 0xa);
  EXPECT_EQ(f32_to_e2m1(7.0f), 7);    // saturates
  EXPECT_EQ(f32_to_e2m1(-kInf), 0xf);
  EXPECT_EQ(f32_to_e2m1(kNaN), 7);    // no NaN in e2m1
  EXPECT_EQ(pack_e2m1(0x3, 0xc), 0xc3);
  EXPECT_EQ(e2m1_low(0xc3), 0x3);
  EXPECT_EQ(e2m1_high(0xc3), 0xc);
}

TEST(DType, Ue8m0) {
  EXPECT_EQ(ue8m0_to_f32(127), 1.0f);
  EXPECT_EQ(ue8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(ue8m0_to_f32(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(ue8m0_to_f32(255)));
  EXPECT_EQ(ue8m0_ceil(1.0f), 127);
  EXPECT_EQ(ue8m0_ceil(1.5f), 128);
  EXPECT_EQ(ue8m0_ceil(0.75f), 127);
  EXPECT_EQ(ue8m0_ceil(0.5f), 126);
  EXPECT_EQ(ue8m0_ceil(std::ldexp(1.0f, -130)), 0);  // clamped to 2^-127
  EXPECT_EQ(ue8m0_ceil(3e38f), 254);                 // clamped to 2^127
  EXPECT_EQ(ue8m0_ceil(0.0f), 0);
  EXPECT_EQ(ue8m0_ceil(kNaN), 255);
}

}  // namespace
}  // namespace keel
