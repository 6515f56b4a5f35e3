#include "cuda/check.cuh"
#include "cuda/forward_ops.h"
#include "cuda/launch.cuh"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

namespace keel::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

constexpr int kCopyPerThread = 4;
constexpr int64_t kCopyChunk = kThreads * kCopyPerThread;  // floats per block of copy_batch

// Block (job, chunks blockIdx.y, + gridDim.y, ... of kCopyChunk floats). A thread loads
// all its floats of a chunk before it stores any: a store may alias a later load (the
// compiler cannot know), so a loop of load-store pairs waited a memory round trip per
// float (16 a thread took 8 us).
__global__ void copy_kernel(const CopyJob* jobs) {
  const CopyJob job = jobs[blockIdx.x];
  for (int64_t chunk = blockIdx.y; chunk * kCopyChunk < job.count; chunk += gridDim.y) {
    const int64_t first = chunk * kCopyChunk + threadIdx.x;
    float v[kCopyPerThread];
#pragma unroll
    for (int j = 0; j < kCopyPerThread; ++j) {
      if (const int64_t i = first + j * kThreads; i < job.count) v[j] = job.src[i];
    }
#pragma unroll
    for (int j = 0; j < kCopyPerThread; ++j) {
      if (const int64_t i = first + j * kThreads; i < job.count) job.dst[i] = v[j];
    }
  }
}

__global__ void copy_bytes_kernel(int4* dst, const int4* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) dst[i] = src[i];
}

__global__ void add_to_groups_kernel(float* y, const float* e, int64_t rows, int group, int64_t width) {
  const int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (i >= rows * group * width) return;
  const int64_t c = i % width, t = i / (width * group);
  y[i] += e[t * width + c];
}

__global__ void scale_kernel(float* x, int64_t count, float factor) {
  let_next_start();
  wait_for_inputs();
  const int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (i < count) x[i] *= factor;
}

// One thread per (window, slot, channel).
__global__ void slots_kernel(const float* kv, const float* gate, const float* ape, int64_t width, int dim, int ratio,
                             int half, int64_t first_row, const int64_t* starts, int64_t windows, bool previous,
                             float* values, float* gates) {
  const int slots = previous ? 2 * ratio : ratio;
  const int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (i >= windows * slots * dim) return;
  const int c = static_cast<int>(i % dim);
  const int s = static_cast<int>(i / dim % slots);
  const int64_t w = i / (int64_t{dim} * slots);
  const int64_t start = starts ? starts[w] : first_row + w * ratio;
  int64_t row;
  int channel, j;
  if (previous && s < ratio) {  // the window before: its first series
    j = s;
    row = start - ratio + j;
    channel = c;
  } else {
    j = previous ? s - ratio : s;
    row = start + j;
    channel = half + c;
  }
  values[i] = kv[row * width + channel];
  gates[i] = gate[row * width + channel] + ape[int64_t{j} * width + channel];
}

}  // namespace

void copy_batch(const CopyJob* jobs, int64_t n, int64_t longest, void* stream) {
  if (n <= 0 || longest <= 0) return;
  const int64_t chunks = (longest + kCopyChunk - 1) / kCopyChunk;
  if (n > 0x7fffffff) throw std::runtime_error("cuda::copy_batch: too many jobs");
  copy_kernel<<<dim3(static_cast<unsigned>(n), static_cast<unsigned>(std::min<int64_t>(chunks, 65535))), kThreads, 0,
                static_cast<cudaStream_t>(stream)>>>(jobs);
  check(cudaGetLastError(), "copy_batch launch");
}

void copy_bytes(void* dst, const void* src, int64_t bytes, void* stream) {
  if (bytes <= 0) return;
  if (bytes % 16 || reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16) {
    throw std::runtime_error("cuda::copy_bytes: addresses and size must be multiples of 16");
  }
  const int64_t n = bytes / 16;
  // Enough blocks to keep many reads in flight over the host link, not one a vector.
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 256));
  copy_bytes_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<int4*>(dst),
                                                                                 static_cast<const int4*>(src), n);
  check(cudaGetLastError(), "copy_bytes launch");
}

void add_to_groups(float* y, const float* e, int64_t rows, int group, int64_t width, void* stream) {
  const int64_t n = rows * group * width;
  if (n <= 0) return;
  add_to_groups_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(y, e, rows, group, width);
  check(cudaGetLastError(), "add_to_groups launch");
}

void scale(float* x, int64_t count, float factor, void* stream) {
  if (count <= 0) return;
  overlapped_launch("scale launch", scale_kernel, blocks_for(count), kThreads, 0, static_cast<cudaStream_t>(stream), x,
                    count, factor);
}

void compressor_slots(const float* kv, const float* gate, const float* ape, int64_t width, int dim, int ratio,
                      bool overlapping, int64_t first_row, int64_t windows, bool previous, float* values,
                      float* gates, void* stream, const int64_t* starts) {
  const int slots = previous ? 2 * ratio : ratio;
  const int64_t n = windows * slots * dim;
  if (n <= 0) return;
  slots_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      kv, gate, ape, width, dim, ratio, overlapping ? dim : 0, first_row, starts, windows, previous, values, gates);
  check(cudaGetLastError(), "compressor_slots launch");
}

}  // namespace keel::cuda
