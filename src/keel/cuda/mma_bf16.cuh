// The bf16 tensor-core pieces the mma.sync kernels share (cuda/gemm_mma.cu,
// cuda/attention.cu): packing f32 pairs as bf16, the hi + lo split that carries about
// 16 bits of an f32 through two bf16 MMAs, and the m16n8k16 MMA itself (sm_80 on).
#pragma once

#include <cstdint>

namespace keel::cuda {

// bf16(lo) in the low half, bf16(hi) in the high half, rounded to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// A pair of f32 values as bf16 hi + lo: hi = bf16(x), lo = bf16(x - hi) (x - hi is
// exact in f32).
struct Split {
  uint32_t hi, lo;
};
__device__ __forceinline__ Split hi_lo(float a, float b) {
  const uint32_t hi = pack_bf16x2(a, b);
  const float ra = __fsub_rn(a, __uint_as_float(hi << 16));
  const float rb = __fsub_rn(b, __uint_as_float(hi & 0xffff0000u));
  return {hi, pack_bf16x2(ra, rb)};
}

// d += A·B for one 16x8x16 tile: A 16 rows by 16 k (row-major fragments), B 16 k by 8
// columns, lane 4g + t holding rows g and g + 8 and columns 2t, 2t + 1 of C/D.
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += A·B with both factors split into hi + lo: hi·hi, lo·hi, hi·lo (the lo·lo term,
// under 2^-16 of a product, dropped).
__device__ __forceinline__ void mma_split(float (&d)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                          uint32_t b0_hi, uint32_t b1_hi, uint32_t b0_lo, uint32_t b1_lo) {
  mma(d, a_hi, b0_hi, b1_hi);
  mma(d, a_lo, b0_hi, b1_hi);
  mma(d, a_hi, b0_lo, b1_lo);
}

}  // namespace keel::cuda
