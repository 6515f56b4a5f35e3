#include "read_floor.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

// Every 16-byte word of p[0, n) once, folded into one value that is stored only if it
// equals `marker` (about never, but the compiler cannot know: the loads stay).
__global__ void read_kernel(const uint4* __restrict__ p, size_t n, unsigned marker, unsigned* sink) {
  unsigned folded = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    folded ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (folded == marker) *sink = folded;
}

}  // namespace

void stream_read(const void* data, size_t bytes, int per_multiprocessor) {
  static int multiprocessors = 0;
  static unsigned* sink = nullptr;
  if (multiprocessors == 0) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaMalloc(reinterpret_cast<void**>(&sink), sizeof(unsigned)) != cudaSuccess) {
      std::fprintf(stderr, "stream_read: no CUDA device\n");
      std::exit(1);
    }
  }
  const size_t words = bytes / 16;
  const auto blocks = static_cast<unsigned>(
      std::clamp<size_t>((words + 255) / 256, 1, size_t(per_multiprocessor) * multiprocessors));
  read_kernel<<<blocks, 256>>>(static_cast<const uint4*>(data), words, 0x9e3779b9u, sink);
}
