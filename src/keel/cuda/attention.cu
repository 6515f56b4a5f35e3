#include "cuda/attention.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.cuh"

namespace keel::cuda {
namespace {

constexpr int kHeadsPerBlock = 4;  // one warp per head; the heads share each key tile
constexpr int kTile = 8;           // keys staged in shared memory per step
constexpr int kPerLane = kMaxAttentionHeadDim / kWarp;

// Block (head group, sequence): each warp keeps its head's query slice, running max m,
// denominator l and weighted key sum in registers (lane holds channels lane + 32·i) and
// folds in the keys one tile at a time (online softmax). The sink starts the softmax:
// m = sink, l = exp(sink − m) = 1, sum = 0.
__global__ void __launch_bounds__(kHeadsPerBlock* kWarp)
    decode(const float* __restrict__ q, int heads, int head_dim, const float* __restrict__ kv,
           const int32_t* __restrict__ key_index, const int32_t* __restrict__ key_offsets,
           const float* __restrict__ sinks, float scale, float* __restrict__ out) {
  __shared__ float tile[kTile * kMaxAttentionHeadDim];
  const int b = blockIdx.y;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int h = blockIdx.x * kHeadsPerBlock + warp;
  const bool active = h < heads;  // inactive warps still help stage tiles

  float qh[kPerLane], acc[kPerLane];
  const float* qrow = q + (int64_t{b} * heads + (active ? h : 0)) * head_dim;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + kWarp * i;
    qh[i] = d < head_dim ? qrow[d] : 0.0f;
    acc[i] = 0.0f;
  }
  float m = active ? sinks[h] : 0.0f, l = 1.0f;

  const int first = key_offsets[b], count = key_offsets[b + 1] - first;
  for (int base = 0; base < count; base += kTile) {
    const int n = min(kTile, count - base);
    __syncthreads();  // the previous tile is no longer read
    for (int e = threadIdx.x; e < n * head_dim; e += blockDim.x) {
      const int j = e / head_dim, d = e % head_dim;
      tile[j * kMaxAttentionHeadDim + d] = kv[int64_t{key_index[first + base + j]} * head_dim + d];
    }
    __syncthreads();
    if (!active) continue;
    float s[kTile];
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      float partial = 0.0f;
      if (j < n) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int d = lane + kWarp * i;
          if (d < head_dim) partial += qh[i] * tile[j * kMaxAttentionHeadDim + d];
        }
      }
      s[j] = partial;
    }
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
#pragma unroll
      for (int offset = kWarp / 2; offset > 0; offset /= 2) s[j] += __shfl_xor_sync(0xffffffffu, s[j], offset);
    }
    for (int j = 0; j < n; ++j) {
      const float score = s[j] * scale;
      if (score > m) {
        const float correction = expf(m - score);
        l *= correction;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) acc[i] *= correction;
        m = score;
      }
      const float p = expf(score - m);
      l += p;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + kWarp * i;
        if (d < head_dim) acc[i] += p * tile[j * kMaxAttentionHeadDim + d];
      }
    }
  }
  if (!active) return;
  float* orow = out + (int64_t{b} * heads + h) * head_dim;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + kWarp * i;
    if (d < head_dim) orow[d] = acc[i] / l;
  }
}

}  // namespace

void attend_decode(const float* q, int sequences, int heads, int head_dim, const float* kv,
                   const int32_t* key_index, const int32_t* key_offsets, const float* sinks, float scale,
                   float* out, void* stream) {
  if (head_dim <= 0 || head_dim > kMaxAttentionHeadDim) {
    throw std::runtime_error("cuda::attend_decode: head_dim " + std::to_string(head_dim) + " is not in 1.." +
                             std::to_string(kMaxAttentionHeadDim));
  }
  if (sequences <= 0 || heads <= 0) return;
  if (sequences > 65535) throw std::runtime_error("cuda::attend_decode: more than 65535 sequences");
  const dim3 grid((heads + kHeadsPerBlock - 1) / kHeadsPerBlock, sequences);
  decode<<<grid, kHeadsPerBlock * kWarp, 0, static_cast<cudaStream_t>(stream)>>>(
      q, heads, head_dim, kv, key_index, key_offsets, sinks, scale, out);
  check(cudaGetLastError(), "attend_decode launch");
}

void register_attention(Registry& registry) {
  KernelInfo k{.name = "cuda_decode_attention",
               .op = Op::attention_decode,
               .archs = ArchSet::gpus_from(Arch::sm_80),
               .activations = {Activation::f32},
               .priority = 1,
               .summary = "one query per sequence over indexed window + compressed keys, sink, online softmax"};
  registry.add(std::move(k.with_entry(&attend_decode)));
}

}  // namespace keel::cuda
