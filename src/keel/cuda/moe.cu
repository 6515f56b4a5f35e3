#include "cuda/moe.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"

namespace keel::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;  // a million threads fill any GPU; past that each loops

// The pieces of one launch: piece p covers floats [first[p], first[p + 1]) of the launch.
struct SwigluLaunch {
  SwigluPiece piece[kMaxSwigluPieces];
  int64_t first[kMaxSwigluPieces + 1];
  int count;
  float limit;
};

// The CPU's expression in its order; std::min and std::clamp spelled out so that a NaN
// gate or up goes through as it does there (fminf would drop it).
__global__ void swiglu(const __grid_constant__ SwigluLaunch a) {
  let_next_start();
  wait_for_inputs();
  const float limit = a.limit;
  for (int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; n < a.first[a.count];
       n += int64_t{gridDim.x} * blockDim.x) {
    int p = 0;
    while (p + 1 < a.count && n >= a.first[p + 1]) ++p;
    float* gate = a.piece[p].gate;
    const float* up = a.piece[p].up;
    const int64_t i = n - a.first[p];
    const float g = limit < gate[i] ? limit : gate[i];
    const float u = up[i] < -limit ? -limit : limit < up[i] ? limit : up[i];
    gate[i] = g / (1.0f + expf(-g)) * u;
  }
}

// One thread per (token, column); the pairs summed in slot order, then the shared expert.
__global__ void combine(const float* __restrict__ y, const float* __restrict__ weights, int64_t tokens, int k,
                        int64_t dim, const float* __restrict__ shared, float* __restrict__ out) {
  const int64_t n = tokens * dim;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / dim, d = i % dim;
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += weights[t * k + j] * y[(t * k + j) * dim + d];
    out[i] = shared ? sum + shared[i] : sum;
  }
}

constexpr int kGroupThreads = 1024;

// One block: counts per expert (bucket n_experts for negative ids), their exclusive
// sums, each pair placed at its expert's cursor, then the groups of at most `tile`. Each
// thread takes a run of buckets and the block scans the runs' pair and group counts (one
// thread walking every bucket took about 14 us at 256 experts, twice a layer in a
// batched decode step).
__global__ void group_kernel(const int32_t* __restrict__ experts, int64_t pairs, int n_experts, int tile,
                             int32_t* __restrict__ order, PairGroup* __restrict__ groups,
                             int32_t* __restrict__ group_count) {
  extern __shared__ int32_t shared[];
  __shared__ int32_t warp_pairs[kGroupThreads / 32], warp_groups[kGroupThreads / 32];
  const int buckets = n_experts + 1;
  int32_t* count = shared;             // [buckets]
  int32_t* cursor = shared + buckets;  // [buckets]: first slot, then the next free one
  for (int e = threadIdx.x; e < buckets; e += blockDim.x) count[e] = 0;
  __syncthreads();
  const auto bucket = [&](int64_t p) { return experts[p] < 0 ? n_experts : experts[p]; };
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[bucket(p)], 1);
  __syncthreads();

  // This thread's buckets [first, last): their pairs and groups, then the sums of those
  // before them (a warp scan, then one over the warps' totals).
  const int per = (buckets + blockDim.x - 1) / blockDim.x;
  const int first = min(buckets, static_cast<int>(threadIdx.x) * per), last = min(buckets, first + per);
  int32_t own_pairs = 0, own_groups = 0;
  for (int e = first; e < last; ++e) own_pairs += count[e], own_groups += (count[e] + tile - 1) / tile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t sum_pairs = own_pairs, sum_groups = own_groups;  // inclusive, within the warp
  for (int d = 1; d < 32; d *= 2) {
    const int32_t p = __shfl_up_sync(0xffffffffu, sum_pairs, d), g = __shfl_up_sync(0xffffffffu, sum_groups, d);
    if (lane >= d) sum_pairs += p, sum_groups += g;
  }
  if (lane == 31) warp_pairs[warp] = sum_pairs, warp_groups[warp] = sum_groups;
  __syncthreads();
  if (warp == 0) {  // the warps' totals, inclusive
    const int warps = blockDim.x / 32;
    int32_t p = lane < warps ? warp_pairs[lane] : 0, g = lane < warps ? warp_groups[lane] : 0;
    for (int d = 1; d < 32; d *= 2) {
      const int32_t up_p = __shfl_up_sync(0xffffffffu, p, d), up_g = __shfl_up_sync(0xffffffffu, g, d);
      if (lane >= d) p += up_p, g += up_g;
    }
    if (lane < warps) warp_pairs[lane] = p, warp_groups[lane] = g;
  }
  __syncthreads();
  int32_t at = sum_pairs - own_pairs + (warp > 0 ? warp_pairs[warp - 1] : 0);
  int32_t made = sum_groups - own_groups + (warp > 0 ? warp_groups[warp - 1] : 0);
  if (threadIdx.x == blockDim.x - 1) *group_count = made + own_groups;
  for (int e = first; e < last; ++e) {
    cursor[e] = at;
    for (int32_t f = 0; f < count[e]; f += tile) groups[made++] = {e == n_experts ? -1 : e, at + f, min(tile, count[e] - f)};
    at += count[e];
  }
  __syncthreads();
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    order[atomicAdd(&cursor[bucket(p)], 1)] = static_cast<int32_t>(p);
  }
}

unsigned blocks_for(int64_t n) { return static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxBlocks)); }

}  // namespace

void clamped_swiglu(float* gate, const float* up, int64_t count, float limit, void* stream) {
  const SwigluPiece piece{gate, up, count};
  clamped_swiglu(std::span<const SwigluPiece>(&piece, 1), limit, stream);
}

void clamped_swiglu(std::span<const SwigluPiece> pieces, float limit, void* stream) {
  if (pieces.size() > kMaxSwigluPieces) {
    throw std::runtime_error("cuda::clamped_swiglu: more than " + std::to_string(kMaxSwigluPieces) + " pieces");
  }
  SwigluLaunch a{};
  a.limit = limit;
  for (const SwigluPiece& p : pieces) {
    if (p.count <= 0) continue;
    a.piece[a.count] = p;
    a.first[a.count + 1] = a.first[a.count] + p.count;
    ++a.count;
  }
  if (a.count == 0) return;
  overlapped_launch("clamped_swiglu launch", swiglu, blocks_for(a.first[a.count]), kThreads, 0,
                    static_cast<cudaStream_t>(stream), a);
}

void combine_pairs(const float* y, const float* weights, int64_t tokens, int k, int64_t dim, const float* shared,
                   float* out, void* stream) {
  if (tokens <= 0 || dim <= 0) return;
  combine<<<blocks_for(tokens * dim), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(y, weights, tokens, k, dim,
                                                                                       shared, out);
  check(cudaGetLastError(), "combine_pairs launch");
}

void group_pairs(const int32_t* experts, int64_t pairs, int n_experts, int tile, int32_t* order, PairGroup* groups,
                 int32_t* group_count, void* stream) {
  if (n_experts < 1 || n_experts > kMaxGroupedExperts || tile < 1 || pairs < 0 || pairs > 0x7fffffff) {
    throw std::runtime_error("cuda::group_pairs: experts in 1.." + std::to_string(kMaxGroupedExperts) +
                             ", a positive tile and fewer than 2^31 pairs");
  }
  const size_t shared = 2 * static_cast<size_t>(n_experts + 1) * sizeof(int32_t);
  group_kernel<<<1, kGroupThreads, shared, static_cast<cudaStream_t>(stream)>>>(experts, pairs, n_experts, tile,
                                                                                order, groups, group_count);
  check(cudaGetLastError(), "group_pairs launch");
}

}  // namespace keel::cuda
