// Device-side conversions between keel's element types and f32, built on NVIDIA's own
// intrinsics so that kernels decode and encode exactly as the hardware does (and as
// keel's CPU conversions in base/dtype.h, which tests/gpu/test_convert_cuda.cpp checks
// bit for bit). For .cu files only.
//
// Which of these are single instructions depends on the arch the kernel is built for:
// fp8 decode and fp8 SATFINITE encode are hardware cvt from sm_89 on and emulated in
// software below it; fp8 NOSAT encode is always emulated (PTX has no non-saturating
// fp8 cvt from f32); e2m1 and ue8m0 are hardware only on the sm_100+/sm_120+
// family-specific targets (100a, 120a, ...).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace keel::cuda {

__device__ __forceinline__ float half_raw_to_f32(__half_raw h) { return __half2float(__half(h)); }

__device__ __forceinline__ float decode_bf16(uint16_t bits) {
  __nv_bfloat16_raw r;
  r.x = bits;
  return __bfloat162float(__nv_bfloat16(r));
}

__device__ __forceinline__ float decode_f16(uint16_t bits) {
  __half_raw r;
  r.x = bits;
  return half_raw_to_f32(r);
}

// Every e4m3/e5m2/e2m1 value is exact in f16, so going through it loses nothing.
__device__ __forceinline__ float decode_e4m3(uint8_t code) {
  return half_raw_to_f32(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3));
}

__device__ __forceinline__ float decode_e5m2(uint8_t code) {
  return half_raw_to_f32(__nv_cvt_fp8_to_halfraw(code, __NV_E5M2));
}

// `code` in the low nibble, as keel::e2m1_low/e2m1_high return it.
__device__ __forceinline__ float decode_e2m1(uint8_t code) {
  return half_raw_to_f32(__nv_cvt_fp4_to_halfraw(code & 0xf, __NV_E2M1));
}

// Every ue8m0 value (2^-127 .. 2^127, NaN) is exact in bf16.
__device__ __forceinline__ float decode_ue8m0(uint8_t code) {
  return __bfloat162float(__nv_bfloat16(__nv_cvt_e8m0_to_bf16raw(code)));
}

__device__ __forceinline__ uint16_t encode_bf16(float x) {
  return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(x)).x;
}

__device__ __forceinline__ uint16_t encode_f16(float x) {
  return static_cast<__half_raw>(__float2half_rn(x)).x;
}

__device__ __forceinline__ uint8_t encode_e4m3(float x, __nv_saturation_t saturation) {
  return __nv_cvt_float_to_fp8(x, saturation, __NV_E4M3);
}

__device__ __forceinline__ uint8_t encode_e5m2(float x, __nv_saturation_t saturation) {
  return __nv_cvt_float_to_fp8(x, saturation, __NV_E5M2);
}

// Round to nearest even; NVIDIA's e2m1 conversion always saturates.
__device__ __forceinline__ uint8_t encode_e2m1(float x) {
  return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest);
}

}  // namespace keel::cuda
