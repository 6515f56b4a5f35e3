// Asynchronous copies from global into shared memory (cp.async, sm_80 on), shared by the
// kernels that stage a tile while computing on the one before (cuda/gemm_mma.cu,
// cuda/attention.cu). A thread's copies are grouped by commit; wait<N> returns once at
// most N of its groups are still in flight (the block still needs a barrier before
// reading what other threads copied).
#pragma once

#include <cstdint>

namespace keel::cuda {

// 16 bytes, both addresses 16-byte aligned; not kept in L1 (.cg).
__device__ __forceinline__ void cp_async16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global));
}
// The same, fetching the 256 bytes around it into L2 (the next lanes' or steps' chunks of
// a weight row read once).
__device__ __forceinline__ void cp_async16_l2_256(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global));
}
// 4 bytes, both addresses 4-byte aligned (.ca: the only cache mode for fewer than 16).
__device__ __forceinline__ void cp_async4(void* shared, const void* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
               "l"(global));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

}  // namespace keel::cuda
