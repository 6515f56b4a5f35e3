// Programmatic dependent launch (sm_90 on): a kernel started by overlapped_launch may begin
// while the kernel before it in the stream (or graph) is still running, so its launch
// and its preamble (reading weights, say) overlap that kernel's tail. Such a kernel
// must call wait_for_inputs() on every path before it reads anything an earlier kernel
// wrote or writes anything an earlier kernel reads; once past it, every earlier kernel
// has finished and its writes are visible (each of them waited in turn). It may call
// let_next_start() early so that the kernel after it can start its own preamble: a
// kernel that reads no weights calls it first of all, so that a product after it
// launches and loads its first weights while the product before it still runs (a
// product lets the next kernel start once past its wait, which bounds the chain of
// launched, waiting kernels at the next product). On older GPUs both are no-ops and
// the launch is an ordinary one. For .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "cuda/check.cuh"

namespace keel::cuda {

__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_next_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, shared, stream>>>(args...), allowed to overlap the kernel before
// it (see above); throws naming `what` if the launch fails.
template <typename... Params, typename... Args>
void overlapped_launch(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
                       cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = &overlap;
  config.numAttrs = 1;
  check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}

// A kernel whose dynamic shared memory may pass 48 KiB opts in to `bytes`, once per
// device (the attribute is set on the current device's copy of the kernel).
template <auto kKernel>
void allow_shared(int bytes) {
  static std::atomic<uint64_t> devices{0};  // a bit per device done
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  const uint64_t bit = uint64_t{1} << (device % 64);
  if (devices.load() & bit) return;
  check(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), "cudaFuncSetAttribute");
  devices.fetch_or(bit);
}

}  // namespace keel::cuda
