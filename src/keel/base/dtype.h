// Element types keel reads and writes, and exact conversions between them and f32.
//
// Rounding: every narrowing conversion rounds to nearest, ties to even (on the
// code's last mantissa bit), as IEEE 754 and the OCP 8-bit/MX formats define it.
//
// What happens when a value does not fit (`Overflow`):
//
//   format    max finite   Overflow::saturate      Overflow::nonfinite (torch's cast)
//   bf16/f16  IEEE         (always IEEE: ±inf)     ±inf
//   e4m3fn    448          ±448                    NaN (e4m3fn has no inf)
//   e5m2      57344        ±57344                  ±inf
//   e2m1      6            ±6 (the only mode)      -
//   ue8m0     2^127        scales are made with ue8m0_ceil(), which clamps to [2^-127, 2^127]
//
// "Does not fit" means the correctly rounded result lies beyond max finite: for e4m3fn
// 464 still rounds (tie, to even) to 448, 464.01 overflows. NaN input stays NaN in every
// format that has one (sign kept) and becomes +6 in e2m1, which has none. Infinite input
// saturates or stays infinite by the same rule.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace keel {

enum class DType : uint8_t {
  f64,
  f32,
  f16,
  bf16,
  f8_e4m3,   // OCP e4m3fn: bias 7, no inf, NaN = 0x7f / 0xff
  f8_e5m2,   // bias 15, IEEE-like inf and NaN
  f8_e8m0,   // unsigned power-of-two scale: 2^(byte-127), 0xff = NaN
  f4_e2m1,   // two per byte, low nibble = even element
  i64,
  i32,
  i16,
  i8,
  u8,
  boolean,
  count_,
};

struct DTypeTraits {
  DType dtype;
  std::string_view name;              // keel's name, used in messages
  std::string_view safetensors_name;  // the header's "dtype" string
  int bits;                           // storage bits per element
};

const DTypeTraits& traits(DType dtype);
inline std::string_view name(DType dtype) { return traits(dtype).name; }
inline int bits(DType dtype) { return traits(dtype).bits; }
std::optional<DType> dtype_from_safetensors(std::string_view name);

// Bytes that `elements` values of `dtype` occupy; nullopt when they do not fill whole
// bytes (an odd number of e2m1 values) or the count overflows.
std::optional<uint64_t> storage_bytes(DType dtype, uint64_t elements);

enum class Overflow { saturate, nonfinite };

float bf16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float value);
float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

float e4m3_to_f32(uint8_t code);
uint8_t f32_to_e4m3(float value, Overflow overflow = Overflow::saturate);
float e5m2_to_f32(uint8_t code);
uint8_t f32_to_e5m2(float value, Overflow overflow = Overflow::saturate);

// e2m1 codes are the low 4 bits: bit 3 sign, then 2 exponent bits, 1 mantissa bit.
float e2m1_to_f32(uint8_t code);
uint8_t f32_to_e2m1(float value);
// A byte of packed e2m1 holds element 2j in the low nibble, 2j+1 in the high nibble.
inline uint8_t pack_e2m1(uint8_t even, uint8_t odd) {
  return static_cast<uint8_t>((even & 0xf) | (odd & 0xf) << 4);
}
inline uint8_t e2m1_low(uint8_t byte) { return byte & 0xf; }
inline uint8_t e2m1_high(uint8_t byte) { return byte >> 4; }

float ue8m0_to_f32(uint8_t code);
// The smallest power of two >= value (value > 0, finite), as a ue8m0 code clamped to
// [2^-127, 2^127]; this is how MX and DeepSeek's ue8m0 scales round ("round up").
uint8_t ue8m0_ceil(float value);

}  // namespace keel
