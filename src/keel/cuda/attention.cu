#include "cuda/attention.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"

namespace keel::cuda {
namespace {

constexpr int kHeadsPerBlock = 4;  // one warp per head; the heads share each key tile
constexpr int kTile = 8;           // keys staged in shared memory per step
constexpr int kPerLane = kMaxAttentionHeadDim / kWarp;
static_assert(kTile <= kHeadsPerBlock * kWarp, "one thread finds each key row of a tile");

// Splits of one query's key list (flash-decoding): one per kKeysPerSplit keys, at most
// kMaxSplits. A function of the list's length only, never of the other queries in the
// call, so a query's result is the same alone and in a batch.
constexpr int kKeysPerSplit = 32;
constexpr int kMaxSplits = 16;
__host__ __device__ constexpr int splits_of(int keys) {
  return keys <= kKeysPerSplit ? 1 : min(kMaxSplits, (keys + kKeysPerSplit - 1) / kKeysPerSplit);
}

// Block (head group, sequence, split), with `paged` the sequence's keys through its block
// table, else rows of `kv`: each warp keeps its head's query slice, running
// max m, denominator l and weighted key sum in registers (lane holds channels
// lane + 32·i) and folds in its split's keys one tile at a time (online softmax). The
// sink starts split 0's softmax: m = sink, l = exp(sink − m) = 1, sum = 0; the other
// splits start empty (m = −inf, l = 0). With one split the result is written as is;
// with several, each split's (m, l, sum) goes to `partial` for `combine`.
__global__ void __launch_bounds__(kHeadsPerBlock* kWarp)
    decode(const float* __restrict__ q, int heads, int head_dim, const float* __restrict__ kv,
           const int32_t* __restrict__ key_index, const int32_t* __restrict__ key_offsets,
           const float* __restrict__ sinks, float scale, float* __restrict__ out, float* __restrict__ partial,
           PagedTables paged) {
  __shared__ float tile[kTile * kMaxAttentionHeadDim];
  const int b = blockIdx.y;
  const int all = key_offsets[b + 1] - key_offsets[b], splits = splits_of(all), split = blockIdx.z;
  if (split >= splits) return;  // a shorter list than the call's longest
  const float* const* table = paged.tables ? paged.tables[b] : nullptr;
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
  float m = split == 0 ? (active ? sinks[h] : 0.0f) : -INFINITY, l = split == 0 ? 1.0f : 0.0f;

  const int per_split = (all + splits - 1) / splits;
  const int first = key_offsets[b] + min(all, split * per_split);
  const int count = min(all, (split + 1) * per_split) - min(all, split * per_split);
  __shared__ const float* rows[kTile];  // the tile's key rows, found once per key
  for (int base = 0; base < count; base += kTile) {
    const int n = min(kTile, count - base);
    __syncthreads();  // the previous tile is no longer read
    if (threadIdx.x < n) {
      const int64_t r = key_index[first + base + threadIdx.x];
      rows[threadIdx.x] = table ? paged_row(table, paged.rows_per_block, r, head_dim) : kv + r * head_dim;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n * head_dim; e += blockDim.x) {
      const int j = e / head_dim, d = e % head_dim;
      tile[j * kMaxAttentionHeadDim + d] = rows[j][d];
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
  if (splits == 1) {
    float* orow = out + (int64_t{b} * heads + h) * head_dim;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + kWarp * i;
      if (d < head_dim) orow[d] = acc[i] / l;
    }
    return;
  }
  // partial[(b, h, split)] = m, l, then head_dim sums; rows of gridDim.z splits each.
  float* prow = partial + ((int64_t{b} * heads + h) * gridDim.z + split) * (head_dim + 2);
  if (lane == 0) prow[0] = m, prow[1] = l;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + kWarp * i;
    if (d < head_dim) prow[2 + d] = acc[i];
  }
}

// One block per (sequence, head) of a sequence whose keys were split: the splits'
// softmax pieces rescaled to their common max and added, in split order.
__global__ void combine(const float* __restrict__ partial, const int32_t* __restrict__ key_offsets, int heads,
                        int head_dim, int stride, float* __restrict__ out) {
  const int64_t bh = blockIdx.x, b = bh / heads;
  const int splits = splits_of(key_offsets[b + 1] - key_offsets[b]);
  if (splits == 1) return;  // written by the decode kernel
  const float* p = partial + bh * stride * (head_dim + 2);
  float top = -INFINITY;
  for (int s = 0; s < splits; ++s) top = fmaxf(top, p[s * (head_dim + 2)]);
  float l = 0.0f;
  for (int s = 0; s < splits; ++s) l += p[s * (head_dim + 2) + 1] * expf(p[s * (head_dim + 2)] - top);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) sum += p[s * (head_dim + 2) + 2 + d] * expf(p[s * (head_dim + 2)] - top);
    out[bh * head_dim + d] = sum / l;
  }
}

}  // namespace

int64_t attend_decode_scratch(int sequences, int heads, int head_dim, int max_keys) {
  const int splits = splits_of(max_keys);
  return splits == 1 ? 0 : int64_t{sequences} * heads * splits * (head_dim + 2);
}

void attend_decode(const float* q, int sequences, int heads, int head_dim, const float* kv,
                   const int32_t* key_index, const int32_t* key_offsets, const float* sinks, float scale,
                   float* out, float* scratch, int max_keys, PagedTables paged, void* stream) {
  if (head_dim <= 0 || head_dim > kMaxAttentionHeadDim) {
    throw std::runtime_error("cuda::attend_decode: head_dim " + std::to_string(head_dim) + " is not in 1.." +
                             std::to_string(kMaxAttentionHeadDim));
  }
  if (sequences <= 0 || heads <= 0) return;
  if (sequences > 65535) throw std::runtime_error("cuda::attend_decode: more than 65535 sequences");
  if (paged.tables && paged.rows_per_block < 1) throw std::runtime_error("cuda::attend_decode: paged keys without rows per block");
  const int splits = splits_of(max_keys);
  if (splits > 1 && scratch == nullptr) throw std::runtime_error("cuda::attend_decode: no scratch for split keys");
  const dim3 grid((heads + kHeadsPerBlock - 1) / kHeadsPerBlock, sequences, splits);
  decode<<<grid, kHeadsPerBlock * kWarp, 0, static_cast<cudaStream_t>(stream)>>>(
      q, heads, head_dim, kv, key_index, key_offsets, sinks, scale, out, scratch, paged);
  check(cudaGetLastError(), "attend_decode launch");
  if (splits > 1) {
    combine<<<static_cast<unsigned>(int64_t{sequences} * heads), 128, 0, static_cast<cudaStream_t>(stream)>>>(
        scratch, key_offsets, heads, head_dim, splits, out);
    check(cudaGetLastError(), "attend_decode combine launch");
  }
}

void register_attention(Registry& registry) {
  // Prefill and verify run the same kernel with one "sequence" per query token (each
  // token has its own key list), on CUDA cores: correct, but without the tensor-core
  // reuse of keys across a chunk's tokens that a prefill kernel should have.
  const auto add = [&](Op op, const char* summary) {
    KernelInfo k{.name = "cuda_decode_attention",
                 .op = op,
                 .archs = ArchSet::gpus_from(Arch::sm_80),
                 .activations = {Activation::f32},
                 .priority = 1,
                 .summary = summary};
    registry.add(std::move(k.with_entry(&attend_decode)));
  };
  add(Op::attention_decode, "one query per sequence over indexed window + compressed keys, sink, online softmax");
  add(Op::attention_prefill, "the decode kernel once per chunk token (CUDA cores, no MMA yet)");
  add(Op::attention_verify, "the decode kernel once per draft token (CUDA cores, no MMA yet)");
}

}  // namespace keel::cuda
