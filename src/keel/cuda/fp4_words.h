// How the GPU stores MXFP4 and NVFP4 codes: each 32-bit word of eight e2m1 codes with
// its bits moved so that the tensor-core tiles build their bf16 pairs in few operations.
//
// A checkpoint keeps value i of a word at bits 4i .. 4i+3 (bit 4i+3 the sign). The tiles
// (gemm_mma.cu) take values i and i+4 as one bf16 pair, each value's sign at bit 15 of its
// half and its exponent and mantissa bits at 8..6, which reads as the value times 2^-126.
// From the checkpoint's order each pair took a shift for the signs, another for the rest,
// and two masks: about 16 integer operations per word, most of a one-token tile's
// instructions (ncu: 442 per 2 KiB warp step, 254 of them these). Packed, the four pairs
// of a word take 9: pair (0, 4) is in place, (1, 5) is a shift by 4, (2, 6) a rotation by
// 10, and (3, 7) two shifts (no placement gives all four a single shift: the pair's bits
// do not tile a word by rotations).
//
// Where bit b of value i sits in a packed word (b = 0 .. 2 exponent and mantissa, 3 sign):
//   value 0: 6 7 8 15     value 4: 22 23 24 31
//   value 1: 2 3 4 11     value 5: 18 19 20 27
//   value 2: 28 29 30 5   value 6: 12 13 14 21
//   value 3: 0 1 10 9     value 7: 16 17 26 25
// cuda::upload packs every MXFP4 and NVFP4 weight so, on the device; every device reader
// decodes packed words. The CPU keeps the checkpoint's order.
#pragma once

#include <cstdint>

#include "base/host_device.h"

namespace keel::cuda {

KEEL_HOST_DEVICE constexpr uint32_t rotate_left(uint32_t w, int s) {
  return s == 0 ? w : (w << s) | (w >> (32 - s));
}

// The checkpoint's word packed: the bits of each mask rotated left by its amount (seven
// groups of bits that move together, read off the table above).
KEEL_HOST_DEVICE constexpr uint32_t pack_fp4_word(uint32_t w) {
  return rotate_left(w & 0x00800080u, 4) | rotate_left(w & 0x00070007u, 6) | rotate_left(w & 0x00080008u, 12) |
         rotate_left(w & 0x37003700u, 20) | rotate_left(w & 0x88008800u, 26) | rotate_left(w & 0x40004000u, 28) |
         rotate_left(w & 0x00700070u, 30);
}

// The checkpoint's word back from a packed one (for the readers that take one value at a time).
KEEL_HOST_DEVICE constexpr uint32_t unpack_fp4_word(uint32_t p) {
  return (rotate_left(p, 28) & 0x00800080u) | (rotate_left(p, 26) & 0x00070007u) |
         (rotate_left(p, 20) & 0x00080008u) | (rotate_left(p, 12) & 0x37003700u) |
         (rotate_left(p, 6) & 0x88008800u) | (rotate_left(p, 4) & 0x40004000u) | (rotate_left(p, 2) & 0x00700070u);
}

// Values k and k+4 (k = 0 .. 3) of a packed word as a bf16 pair of their values times
// 2^-126: signs at bits 15 and 31, exponent and mantissa bits at 8..6 and 24..22 (code 1,
// 0.5, reads as the subnormal 2^-127).
template <int k>
KEEL_HOST_DEVICE constexpr uint32_t fp4_pair(uint32_t p) {
  constexpr uint32_t kPair = 0x81c081c0u;  // the bits of one pair, signs and the rest
  if constexpr (k == 0) return p & kPair;
  if constexpr (k == 1) return (p << 4) & kPair;
  if constexpr (k == 2) return rotate_left(p, 10) & kPair;
  return ((p << 6) & 0x80c080c0u) | ((p >> 2) & 0x01000100u);
}

}  // namespace keel::cuda
