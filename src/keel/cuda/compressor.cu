#include "cuda/compressor.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.cuh"

namespace keel::cuda {
namespace {

// One thread per (entry, channel), in the CPU's order: the max over slots, then the
// exponentials' sum and weighted sum together, one division.
__global__ void pool(const float* __restrict__ values, const float* __restrict__ gates, int64_t entries, int slots,
                     int dim, float* __restrict__ out) {
  const int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (n >= entries * dim) return;
  const int64_t e = n / dim, c = n % dim;
  const float* g = gates + e * slots * dim + c;
  const float* v = values + e * slots * dim + c;
  float top = -INFINITY;
  for (int s = 0; s < slots; ++s) top = fmaxf(top, g[int64_t{s} * dim]);
  float sum = 0.0f, acc = 0.0f;
  for (int s = 0; s < slots; ++s) {
    const float x = expf(g[int64_t{s} * dim] - top);
    sum += x;
    acc += x * v[int64_t{s} * dim];
  }
  out[n] = acc / sum;
}

}  // namespace

void pool_slots(const float* values, const float* gates, int64_t entries, int slots, int dim, float* out,
                void* stream) {
  if (entries <= 0 || dim <= 0) return;
  if (slots <= 0) throw std::runtime_error("cuda::pool_slots: no slots");
  constexpr int kThreads = 256;
  const int64_t blocks = (entries * dim + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) throw std::runtime_error("cuda::pool_slots: too many entries");
  pool<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(values, gates, entries,
                                                                                          slots, dim, out);
  check(cudaGetLastError(), "pool_slots launch");
}

void register_compressor(Registry& registry) {
  KernelInfo k{.name = "cuda_pool_slots",
               .op = Op::compressor,
               .archs = ArchSet::gpus_from(Arch::sm_80),
               .activations = {Activation::f32},
               .priority = 1,
               .summary = "softmax pooling of each window's slots, one thread per channel"};
  registry.add(std::move(k.with_entry(&pool_slots)));
}

}  // namespace keel::cuda
