// Device decoders of the codes a DeviceWeight stores, shared by the kernels that read
// weights (linear.cu, embedding.cu), and the host switch from a weight's format to the
// kernel instance for it. The decoders place the code's bits in an f32 and rebias, as
// ops/linear.cpp does, so they agree with the CPU's decoding bit for bit (convert.cuh's
// hardware conversions differ only on NaN codes, which weights never hold). For .cu
// files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/convert.cuh"
#include "cuda/fp4_words.h"
#include "cuda/linear.h"

namespace keel::cuda {

__device__ __forceinline__ float e4m3(uint32_t b) {
  return __uint_as_float((b & 0x80u) << 24 | (b & 0x7fu) << 20) * 0x1p120f;
}
__device__ __forceinline__ float e2m1(uint32_t nibble) {
  return __uint_as_float((nibble & 0x8u) << 28 | (nibble & 0x7u) << 22) * 0x1p126f;
}
__device__ __forceinline__ float ue8m0(uint32_t b) {
  return b == 0 ? 0x1p-127f : b == 255 ? __uint_as_float(0x7fc00000u) : __uint_as_float(b << 23);
}

// The scale of the 128x128 block holding W[row, k] of an fp8_block weight.
__device__ __forceinline__ float fp8_block_scale(const DeviceWeight& w, int64_t row, int64_t k) {
  const int64_t index = ((row + w.first_row) / 128) * w.scale_cols + k / 128;
  return w.f32_scales ? reinterpret_cast<const float*>(w.scale)[index] : ue8m0(w.scale[index]);
}

// W[row, k] of a stored weight, in the same operations (and so the same roundings) as
// ops/linear.cpp's decode_row: one value at a time, for any shape.
template <WeightFormat F, DType T>
__device__ __forceinline__ float weight_value(const DeviceWeight& w, int64_t row, int64_t k) {
  if constexpr (T == DType::f32) {
    return static_cast<const float*>(w.data)[row * w.in + k];
  } else if constexpr (T == DType::bf16) {
    return __uint_as_float(uint32_t{static_cast<const uint16_t*>(w.data)[row * w.in + k]} << 16);
  } else if constexpr (T == DType::f16) {
    return decode_f16(static_cast<const uint16_t*>(w.data)[row * w.in + k]);
  } else if constexpr (F == WeightFormat::fp8_block) {
    return e4m3(static_cast<const uint8_t*>(w.data)[row * w.in + k]) * fp8_block_scale(w, row, k);
  } else {
    const auto* words = static_cast<const uint32_t*>(w.data);
    const int64_t n = row * w.in + k;  // eight a word, packed (fp4_words.h)
    const float code = e2m1((unpack_fp4_word(words[n / 8]) >> (4 * (n % 8))) & 0xfu);
    if constexpr (F == WeightFormat::mxfp4) return code * ue8m0(w.scale[n / 32]);
    return code * (e4m3(w.scale[n / 16]) * w.global_scale);  // the CPU's block scale, then the code
  }
}

// Calls fn.template operator()<F, T>() for the weight's format and stored dtype (f32,
// bf16 or f16 for a float weight); throws std::runtime_error, naming `who`, for any
// other combination.
template <typename Fn>
void dispatch(const DeviceWeight& w, const char* who, Fn&& fn) {
  switch (w.format) {
    case WeightFormat::f32:
    case WeightFormat::bf16:
      if (w.dtype == DType::f32) return fn.template operator()<WeightFormat::f32, DType::f32>();
      if (w.dtype == DType::bf16) return fn.template operator()<WeightFormat::bf16, DType::bf16>();
      if (w.dtype == DType::f16) return fn.template operator()<WeightFormat::bf16, DType::f16>();
      break;
    case WeightFormat::fp8_block: return fn.template operator()<WeightFormat::fp8_block, DType::f8_e4m3>();
    case WeightFormat::mxfp4: return fn.template operator()<WeightFormat::mxfp4, DType::i8>();
    case WeightFormat::nvfp4: return fn.template operator()<WeightFormat::nvfp4, DType::u8>();
  }
  throw std::runtime_error(std::string(who) + ": no kernel for this weight dtype");
}

}  // namespace keel::cuda
