#include "cuda/indexer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"

namespace keel::cuda {
namespace {

// --- Scores ------------------------------------------------------------------------------

// A block scores kKeyTile keys of one token against kHeadTile heads at a time: a small
// GEMM (heads × key_dim) · (key_dim × keys) staged through shared memory kDimChunk
// channels at a time, each thread holding a 4 heads × 4 keys tile of dot products.
constexpr int kKeyTile = 64;
constexpr int kHeadTile = 64;
constexpr int kDimChunk = 32;
constexpr int kScoreThreads = 256;
constexpr int kKeyGroups = kKeyTile / 4;               // threads across the keys
static_assert(kKeyTile <= kScoreThreads, "one thread finds each key row of a tile");
constexpr int kHeadGroups = kScoreThreads / kKeyGroups;  // threads across the heads
constexpr int kRow = kKeyTile + 4;  // padded rows: float4-aligned, fewer bank conflicts on the stores
static_assert(kHeadGroups * 4 == kHeadTile && kKeyTile == kHeadTile, "one staging loop fills both tiles");

// Block (token, key tile). The heads' ReLU-weighted sum is reduced across the head groups
// through shared memory; blocks past the token's visible count leave at once, as do all
// blocks of a token whose list is short enough to be taken whole.
__global__ void __launch_bounds__(kScoreThreads)
    score_keys(const float* __restrict__ q, const float* __restrict__ weights, int heads, int key_dim,
               const float* __restrict__ keys, const int32_t* __restrict__ visible, int64_t max_visible, int k,
               float scale, float* __restrict__ scores, PagedTables paged) {
  __shared__ __align__(16) float qs[kDimChunk][kRow];
  __shared__ __align__(16) float ks[kDimChunk][kRow];
  __shared__ float partial[kHeadGroups][kKeyTile];
  let_next_start();
  wait_for_inputs();
  const int64_t t = blockIdx.x;
  const int64_t n = min(int64_t{visible[t]}, max_visible);
  const int64_t w0 = int64_t{blockIdx.y} * kKeyTile;
  if (n <= k || w0 >= n) return;
  // The tile's key rows, found once per key (null past the visible count).
  __shared__ const float* rows[kKeyTile];
  if (threadIdx.x < kKeyTile) {
    const int64_t w = w0 + threadIdx.x;
    const float* const* table = paged.tables ? paged.tables[t] : nullptr;
    rows[threadIdx.x] = w >= n ? nullptr : table ? paged_row(table, paged.rows_per_block, w, key_dim) : keys + w * key_dim;
  }
  const int tx = threadIdx.x % kKeyGroups, ty = threadIdx.x / kKeyGroups;
  const float* qt = q + t * heads * key_dim;

  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int h0 = 0; h0 < heads; h0 += kHeadTile) {
    float acc[4][4] = {};
    for (int d0 = 0; d0 < key_dim; d0 += kDimChunk) {
      __syncthreads();  // the previous chunk is no longer read
      // Consecutive threads read consecutive channels of one head / key row (coalesced).
      for (int e = threadIdx.x; e < kDimChunk * kKeyTile; e += kScoreThreads) {
        const int r = e / kDimChunk, d = e % kDimChunk, dd = d0 + d;
        const int h = h0 + r;
        qs[d][r] = h < heads && dd < key_dim ? qt[int64_t{h} * key_dim + dd] : 0.0f;
        ks[d][r] = rows[r] && dd < key_dim ? rows[r][dd] : 0.0f;
      }
      __syncthreads();
#pragma unroll 8
      for (int d = 0; d < kDimChunk; ++d) {
        const float4 a4 = *reinterpret_cast<const float4*>(&qs[d][ty * 4]);
        const float4 b4 = *reinterpret_cast<const float4*>(&ks[d][tx * 4]);
        const float a[4] = {a4.x, a4.y, a4.z, a4.w}, b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int h = h0 + ty * 4 + i;
      if (h >= heads) continue;
      const float weight = weights[t * heads + h];
#pragma unroll
      for (int j = 0; j < 4; ++j) sum[j] += weight * fmaxf(acc[i][j], 0.0f) * scale;  // the CPU's product order
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) partial[ty][tx * 4 + j] = sum[j];
  __syncthreads();
  if (threadIdx.x < kKeyTile && w0 + threadIdx.x < n) {
    float s = 0.0f;
#pragma unroll
    for (int g = 0; g < kHeadGroups; ++g) s += partial[g][threadIdx.x];
    scores[t * max_visible + w0 + threadIdx.x] = s;
  }
}

// --- Top-k ---------------------------------------------------------------------------

constexpr int kSelectThreads = 1024;
constexpr int kSelectWarps = kSelectThreads / kWarp;
constexpr int kLoadsPerThread = 4;  // independent loads in flight per thread while counting
constexpr int kChunk = kSelectThreads * kLoadsPerThread;
static_assert(kSelectWarps <= kWarp, "one warp scans the warps' totals");
static_assert(kChunk < (1 << 16), "a chunk's counts fit the 16-bit halves of the packed scan");

// Unsigned keys in the floats' order (flip all bits of negatives, the sign bit of
// positives), so the k-th largest score is found digit by digit. -0 counts as +0: the
// CPU's comparison sees them equal.
__device__ uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

// Block-wide exclusive prefix sum of `value`; `total` gets the block's sum. Every thread
// calls it; `warp_sums` is free again on return.
__device__ uint32_t exclusive_scan(uint32_t value, uint32_t* warp_sums, uint32_t& total) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  uint32_t x = value;
#pragma unroll
  for (int offset = 1; offset < kWarp; offset *= 2) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  if (lane == kWarp - 1) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t s = lane < kSelectWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < kWarp; offset *= 2) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, s, offset);
      if (lane >= offset) s += y;
    }
    if (lane < kSelectWarps) warp_sums[lane] = s;
  }
  __syncthreads();
  const uint32_t before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - value;
  total = warp_sums[kSelectWarps - 1];
  __syncthreads();
  return before;
}

// One block per token. Four counting passes over the scores fix the k-th largest key 8
// bits at a time (only keys matching the digits fixed so far are counted), leaving
// `ties`: how many keys equal to it are taken. A last pass writes, chunk by chunk, the
// keys above it and the first `ties` keys equal to it; the scan of (above, equal) counts
// gives each its slot, so the indices come out ascending.
__global__ void __launch_bounds__(kSelectThreads)
    select_top(const float* __restrict__ scores, int64_t max_visible, const int32_t* __restrict__ visible, int k,
               int32_t index_base, const int32_t* __restrict__ out_offsets, int32_t* __restrict__ out,
               const int32_t* __restrict__ base_rows) {
  __shared__ uint32_t hist[256];
  __shared__ uint32_t warp_sums[kSelectWarps];
  __shared__ uint32_t chosen_digit, chosen_ties;
  let_next_start();
  wait_for_inputs();
  const int64_t t = blockIdx.x;
  const int n = static_cast<int>(min(int64_t{visible[t]}, max_visible));
  int32_t* dst = out + out_offsets[t];
  if (base_rows) index_base = base_rows[t];
  if (n <= k) {  // every visible entry (none when n ≤ 0), no scores needed
    for (int i = threadIdx.x; i < n; i += kSelectThreads) dst[i] = index_base + i;
    return;
  }
  const float* s = scores + t * max_visible;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;

  uint32_t prefix = 0, mask = 0, ties = static_cast<uint32_t>(k);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += kChunk) {
      int digit[kLoadsPerThread];
#pragma unroll
      for (int j = 0; j < kLoadsPerThread; ++j) {
        const int i = base + j * kSelectThreads + threadIdx.x;
        const uint32_t u = i < n ? order_key(s[i]) : 0;
        digit[j] = i < n && (u & mask) == prefix ? static_cast<int>((u >> shift) & 0xffu) : -1;
      }
      // Scores near the top share their high digits: one atomic per distinct digit per
      // warp, not per lane.
#pragma unroll
      for (int j = 0; j < kLoadsPerThread; ++j) {
        const unsigned peers = __match_any_sync(0xffffffffu, digit[j]);
        if (digit[j] >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[digit[j]], __popc(peers));
      }
    }
    __syncthreads();
    // The digit where the count from the top reaches `ties`: lane l holds bins 255 − 8l
    // down to 248 − 8l; a scan across the lanes gives the count above each lane's bins.
    if (warp == 0) {
      uint32_t c[8], own = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) own += c[j] = hist[255 - 8 * lane - j];
      uint32_t through = own;
#pragma unroll
      for (int offset = 1; offset < kWarp; offset *= 2) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, through, offset);
        if (lane >= offset) through += y;
      }
      uint32_t above = through - own;
      if (above < ties && ties <= through) {
        for (int j = 0; j < 8; ++j) {
          if (above + c[j] >= ties) {
            chosen_digit = 255 - 8 * lane - j;
            chosen_ties = ties - above;
            break;
          }
          above += c[j];
        }
      }
    }
    __syncthreads();
    prefix |= chosen_digit << shift;
    mask |= 0xffu << shift;
    ties = chosen_ties;
  }

  // Write pass: each thread takes kLoadsPerThread consecutive scores, so thread order is
  // index order within a chunk.
  const uint32_t above_total = static_cast<uint32_t>(k) - ties;
  uint32_t above_before = 0, equal_before = 0;  // over earlier chunks; the same in every thread
  for (int base = 0; base < n; base += kChunk) {
    const int first = base + threadIdx.x * kLoadsPerThread;
    uint32_t key[kLoadsPerThread], above = 0, equal = 0;
#pragma unroll
    for (int j = 0; j < kLoadsPerThread; ++j) {
      key[j] = first + j < n ? order_key(s[first + j]) : 0;
      if (first + j < n) above += key[j] > prefix, equal += key[j] == prefix;
    }
    uint32_t total;
    const uint32_t ex = exclusive_scan(above << 16 | equal, warp_sums, total);
    uint32_t a = above_before + (ex >> 16), e = equal_before + (ex & 0xffffu);
    // A key above the threshold goes after every earlier one above and every earlier tie
    // that is taken; a tie is taken while fewer than `ties` came before it.
#pragma unroll
    for (int j = 0; j < kLoadsPerThread; ++j) {
      if (first + j >= n) break;
      if (key[j] > prefix) {
        dst[a + min(e, ties)] = index_base + first + j;
        ++a;
      } else if (key[j] == prefix) {
        if (e < ties) dst[a + e] = index_base + first + j;
        ++e;
      }
    }
    above_before += total >> 16;
    equal_before += total & 0xffffu;
    if (above_before == above_total && equal_before >= ties) break;  // all k written
  }
}

}  // namespace

void indexer_select(const float* q, const float* weights, int64_t tokens, int heads, int key_dim,
                    const float* keys, const int32_t* visible, int64_t max_visible, int k, int32_t index_base,
                    const int32_t* out_offsets, int32_t* out, float* scores, PagedTables paged,
                    const int32_t* base_rows, void* stream) {
  if (heads <= 0 || key_dim <= 0) {
    throw std::runtime_error("cuda::indexer_select: heads " + std::to_string(heads) + " and key_dim " +
                             std::to_string(key_dim) + " must be positive");
  }
  if (tokens <= 0 || k <= 0) return;
  if (tokens > 0x7fffffff) throw std::runtime_error("cuda::indexer_select: too many tokens");
  if (paged.tables && paged.rows_per_block < 1) throw std::runtime_error("cuda::indexer_select: paged keys without rows per block");
  const int64_t tiles = (std::max(max_visible, int64_t{0}) + kKeyTile - 1) / kKeyTile;
  if (tiles > 65535) {
    throw std::runtime_error("cuda::indexer_select: max_visible " + std::to_string(max_visible) + " over " +
                             std::to_string(65535 * kKeyTile));
  }
  const auto s = static_cast<cudaStream_t>(stream);
  const float scale = 1.0f / std::sqrt(static_cast<float>(key_dim));  // as the CPU rounds it
  if (tiles > 0) {
    overlapped_launch("indexer_select score launch", score_keys,
                      dim3(static_cast<unsigned>(tokens), static_cast<unsigned>(tiles)), kScoreThreads, 0, s, q, weights,
                      heads, key_dim, keys, visible, max_visible, k, scale, scores, paged);
  }
  overlapped_launch("indexer_select top-k launch", select_top, static_cast<unsigned>(tokens), kSelectThreads, 0, s,
                    scores, max_visible, visible, k, index_base, out_offsets, out, base_rows);
}

void register_indexer(Registry& registry) {
  KernelInfo indexer{.name = "cuda_indexer",
                     .op = Op::indexer,
                     .archs = ArchSet::gpus_from(Arch::sm_80),
                     .activations = {Activation::f32},
                     .priority = 1,
                     .summary = "ReLU-weighted scores (tiled over keys and heads), then the top-k below"};
  registry.add(std::move(indexer.with_entry(&indexer_select)));
  KernelInfo topk{.name = "cuda_indexer",
                  .op = Op::topk,
                  .archs = ArchSet::gpus_from(Arch::sm_80),
                  .activations = {Activation::f32},
                  .priority = 1,
                  .summary = "fused into the indexer: radix select per token, indices in ascending order"};
  registry.add(std::move(topk.with_entry(&indexer_select)));
}

}  // namespace keel::cuda
