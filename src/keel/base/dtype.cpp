#include "base/dtype.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>

namespace keel {
namespace {

constexpr std::array<DTypeTraits, static_cast<size_t>(DType::count_)> kTraits = {{
    {DType::f64, "f64", "F64", 64},
    {DType::f32, "f32", "F32", 32},
    {DType::f16, "f16", "F16", 16},
    {DType::bf16, "bf16", "BF16", 16},
    {DType::f8_e4m3, "f8_e4m3", "F8_E4M3", 8},
    {DType::f8_e5m2, "f8_e5m2", "F8_E5M2", 8},
    {DType::f8_e8m0, "f8_e8m0", "F8_E8M0", 8},
    {DType::f4_e2m1, "f4_e2m1", "F4", 4},
    {DType::i64, "i64", "I64", 64},
    {DType::i32, "i32", "I32", 32},
    {DType::i16, "i16", "I16", 16},
    {DType::i8, "i8", "I8", 8},
    {DType::u8, "u8", "U8", 8},
    {DType::boolean, "bool", "BOOL", 8},
}};
static_assert([] {
  for (size_t i = 0; i < kTraits.size(); ++i)
    if (static_cast<size_t>(kTraits[i].dtype) != i) return false;
  return true;
}(), "kTraits must be indexed by DType");

// A small float format: 1 sign bit, `exp_bits`, `man_bits`. Positive finite codes
// 0..max_code are increasing in value, which the encoder relies on.
struct MiniFloat {
  int exp_bits;
  int man_bits;
  int bias;
  uint8_t max_code;       // largest positive finite code
  int nonfinite_code;     // code for overflow in Overflow::nonfinite (-1: none)
  int nan_code;           // positive NaN code (-1: none)
  bool ieee_specials;     // all-ones exponent is inf/NaN (e5m2)
};

constexpr MiniFloat kE4M3{4, 3, 7, 0x7e, 0x7f, 0x7f, false};
constexpr MiniFloat kE5M2{5, 2, 15, 0x7b, 0x7c, 0x7e, true};
constexpr MiniFloat kE2M1{2, 1, 1, 0x7, -1, -1, false};

float decode_minifloat(uint8_t code, const MiniFloat& f) {
  const int sign_shift = f.exp_bits + f.man_bits;
  const bool negative = (code >> sign_shift) & 1;
  const int exp_all = (1 << f.exp_bits) - 1;
  const int man_all = (1 << f.man_bits) - 1;
  const int exponent = (code >> f.man_bits) & exp_all;
  const int mantissa = code & man_all;
  float value;
  if (f.ieee_specials && exponent == exp_all) {
    value = mantissa == 0 ? std::numeric_limits<float>::infinity()
                          : std::numeric_limits<float>::quiet_NaN();
  } else if (f.nan_code >= 0 && (code & ((1 << sign_shift) - 1)) == f.nan_code) {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), 1 - f.bias - f.man_bits);
  } else {
    value = std::ldexp(static_cast<float>((1 << f.man_bits) | mantissa), exponent - f.bias - f.man_bits);
  }
  return negative ? -value : value;
}

// Values of the positive finite codes, in code order.
template <const MiniFloat& F>
const std::array<float, 128>& positive_values() {
  static const std::array<float, 128> table = [] {
    std::array<float, 128> t{};
    for (int c = 0; c <= F.max_code; ++c) t[c] = decode_minifloat(static_cast<uint8_t>(c), F);
    return t;
  }();
  return table;
}

template <const MiniFloat& F>
uint8_t encode_minifloat(float value, Overflow overflow) {
  const int sign_shift = F.exp_bits + F.man_bits;
  const uint8_t sign = std::signbit(value) ? static_cast<uint8_t>(1u << sign_shift) : 0;
  if (std::isnan(value)) {
    return F.nan_code >= 0 ? static_cast<uint8_t>(sign | F.nan_code) : F.max_code;
  }
  const float a = std::fabs(value);
  const auto& v = positive_values<F>();
  const float max = v[F.max_code];
  uint8_t code;
  if (a > max) {
    // Past max finite: round to max unless RNE would carry into the next binade step.
    const float half_ulp = (max - v[F.max_code - 1]) / 2;
    const bool to_max = a < max + half_ulp || (a == max + half_ulp && (F.max_code & 1) == 0);
    if (to_max || overflow == Overflow::saturate || F.nonfinite_code < 0) {
      code = F.max_code;
    } else {
      code = static_cast<uint8_t>(F.nonfinite_code);
    }
  } else {
    const auto* end = v.begin() + F.max_code + 1;
    const auto* hi = std::lower_bound(v.begin(), end, a);  // first value >= a
    code = static_cast<uint8_t>(hi - v.begin());
    if (*hi != a) {
      const uint8_t lo = code - 1;
      const float below = a - v[lo], above = *hi - a;
      if (below < above || (below == above && (lo & 1) == 0)) code = lo;
    }
  }
  return sign | code;
}

}  // namespace

const DTypeTraits& traits(DType dtype) { return kTraits.at(static_cast<size_t>(dtype)); }

std::optional<DType> dtype_from_safetensors(std::string_view name) {
  for (const auto& t : kTraits)
    if (t.safetensors_name == name) return t.dtype;
  return std::nullopt;
}

std::optional<uint64_t> storage_bytes(DType dtype, uint64_t elements) {
  const uint64_t b = static_cast<uint64_t>(bits(dtype));
  if (elements > std::numeric_limits<uint64_t>::max() / b) return std::nullopt;
  const uint64_t total_bits = elements * b;
  if (total_bits % 8 != 0) return std::nullopt;
  return total_bits / 8;
}

float bf16_to_f32(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t f32_to_bf16(float value) {
  uint32_t u = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((u >> 16) | 0x40);  // keep it quiet NaN
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  float magnitude;
  if (exponent == 0x1f) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else {
    magnitude = std::bit_cast<float>(((exponent + 112) << 23) | (mantissa << 13));
  }
  return std::bit_cast<float>(std::bit_cast<uint32_t>(magnitude) | sign);
}

uint16_t f32_to_f16(float value) {
  uint32_t x = std::bit_cast<uint32_t>(value);
  const uint32_t sign = x & 0x80000000u;
  x ^= sign;
  uint32_t h;
  if (x >= 0x47800000u) {  // >= 65536: inf, NaN, or past the largest finite after rounding
    h = x > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (x < 0x38800000u) {  // below 2^-14: subnormal or zero. Adding 0.5 lets the FPU
    // round the value to a multiple of 2^-24 (ties to even); the low bits are the code.
    const float shifted = std::bit_cast<float>(x) + 0.5f;
    h = std::bit_cast<uint32_t>(shifted) - 0x3f000000u;
  } else {  // normal: rebias the exponent, round the 13 dropped mantissa bits to even
    const uint32_t odd = (x >> 13) & 1;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfff + odd;
    h = x >> 13;
  }
  return static_cast<uint16_t>(h | (sign >> 16));
}

float e4m3_to_f32(uint8_t code) { return decode_minifloat(code, kE4M3); }
uint8_t f32_to_e4m3(float value, Overflow overflow) { return encode_minifloat<kE4M3>(value, overflow); }
float e5m2_to_f32(uint8_t code) { return decode_minifloat(code, kE5M2); }
uint8_t f32_to_e5m2(float value, Overflow overflow) { return encode_minifloat<kE5M2>(value, overflow); }
float e2m1_to_f32(uint8_t code) { return decode_minifloat(code & 0xf, kE2M1); }
uint8_t f32_to_e2m1(float value) { return encode_minifloat<kE2M1>(value, Overflow::saturate); }

float ue8m0_to_f32(uint8_t code) {
  if (code == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(code) - 127);
}

uint8_t ue8m0_ceil(float value) {
  if (std::isnan(value)) return 0xff;
  if (!(value > 0)) return 0;
  if (std::isinf(value)) return 254;
  int exponent;
  const float mantissa = std::frexp(value, &exponent);  // value = mantissa * 2^exponent, mantissa in [0.5, 1)
  const int e = mantissa == 0.5f ? exponent - 1 : exponent;
  return static_cast<uint8_t>(std::clamp(e, -127, 127) + 127);
}

}  // namespace keel
