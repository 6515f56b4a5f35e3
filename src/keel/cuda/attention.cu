#include "cuda/attention.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/cp_async.cuh"
#include "cuda/launch.cuh"
#include "cuda/mma_bf16.cuh"

namespace keel::cuda {
namespace {

constexpr int kHeadsPerBlock = 4;  // one warp per head; the heads share each key tile
constexpr int kTile = 8;           // keys staged in shared memory per step
constexpr int kPerLane = kMaxAttentionHeadDim / kWarp;
constexpr int kHalf = kTile / 2;  // keys a fold takes at a time (decode's kLean)
static_assert(kTile <= kHeadsPerBlock * kWarp, "one thread finds each key row of a tile");

// Splits of one query's key list (flash-decoding): one per kKeysPerSplit keys, at most
// kMaxSplits. A function of the list's length only, never of the other queries in the
// call, so a query's result is the same alone and in a batch.
constexpr int kKeysPerSplit = 32;
constexpr int kMaxSplits = 16;
__host__ __device__ constexpr int splits_of(int keys, int keys_per_split = kKeysPerSplit) {
  return keys <= keys_per_split ? 1 : min(kMaxSplits, (keys + keys_per_split - 1) / keys_per_split);
}

// One (sequence, head)'s split pieces p (a row of head_dim + 2 per split: m, l, then the
// head_dim sums) merged into `out`: rescaled to their common max and added, in split
// order. The thread takes columns first + step·i, i < kColumns. Every split's m and l
// are loaded at once, then each split's columns at once (the loops are unrolled), so a
// merge costs a memory round trip or two per split, not one per split and column. The
// loads go through L2 alone: other blocks of the same launch may have written the pieces.
template <int kColumns>
__device__ __forceinline__ void merge_splits(const float* p, int splits, int head_dim, float* __restrict__ out,
                                             int first, int step) {
  float m[kMaxSplits], weight[kMaxSplits];
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) m[s] = s < splits ? __ldcg(p + s * (head_dim + 2)) : -INFINITY;
  float top = -INFINITY;
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    if (s < splits) top = fmaxf(top, m[s]);
  }
  float l = 0.0f;
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    weight[s] = s < splits ? expf(m[s] - top) : 0.0f;
    if (s < splits) l += __ldcg(p + s * (head_dim + 2) + 1) * weight[s];
  }
  float sum[kColumns] = {};
#pragma unroll
  for (int s = 0; s < kMaxSplits; ++s) {
    if (s >= splits) break;
    float piece[kColumns];
#pragma unroll
    for (int i = 0; i < kColumns; ++i) {
      const int d = first + step * i;
      piece[i] = d < head_dim ? __ldcg(p + s * (head_dim + 2) + 2 + d) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kColumns; ++i) sum[i] += piece[i] * weight[s];
  }
#pragma unroll
  for (int i = 0; i < kColumns; ++i) {
    if (const int d = first + step * i; d < head_dim) out[d] = sum[i] / l;
  }
}

// Block (head group, sequence, split), with `paged` the sequence's keys through its block
// table, else rows of `kv`: each warp keeps its head's query slice, running
// max m, denominator l and weighted key sum in registers and folds in its split's keys
// one tile at a time (online softmax). A lane holds channels 4·lane + 128·k + c (k, c <
// 4: kPerLane of them), so that it reads a tile row's values four at a time. The
// sink starts split 0's softmax: m = sink, l = exp(sink − m) = 1, sum = 0; the other
// splits start empty (m = −inf, l = 0). With one split the result is written as is;
// with several, each split's (m, l, sum) goes to `partial`, and the head group's last
// block to finish (counted in arrivals[sequence · heads + head group], which it resets)
// merges them (merge_splits, as the tensor-core kernel's combine launch does).
//
// kDim is head_dim where the launch knows it (kMaxAttentionHeadDim, Flash's: no channel
// is past the end, every row a whole number of float4s), else 0 (any head_dim up to
// kMaxAttentionHeadDim, read from the argument, every channel checked). A warp's tile fold was about
// 950 instructions with head_dim at run time: per-channel bounds tests and branches and
// one shared-memory load per value (ncu, docs/perf.md 2026-12-06).
//
// The split's key rows are found kFound at a time (one thread a key, all in flight at
// once), and each tile is copied into shared memory (cp.async, two buffers) while the
// warps fold in the tile before it: a tile costs one memory round trip at most, where
// copying it element by element cost one per element a thread copied.
constexpr int kFound = kHeadsPerBlock * kWarp;
static_assert(kPerLane % 4 == 0);

// Channel i of a lane's kPerLane (see decode).
__device__ __forceinline__ int lane_channel(int lane, int i) { return 4 * lane + 4 * kWarp * (i / 4) + i % 4; }

// The four values of `row` at d .. d + 3 (d a multiple of 4), zero past `dim`.
template <int kDim>
__device__ __forceinline__ float4 four_at(const float* row, int d, int dim) {
  if constexpr (kDim != 0) {
    return *reinterpret_cast<const float4*>(row + d);
  } else {
    return make_float4(d < dim ? row[d] : 0.0f, d + 1 < dim ? row[d + 1] : 0.0f, d + 2 < dim ? row[d + 2] : 0.0f,
                       d + 3 < dim ? row[d + 3] : 0.0f);
  }
}

template <int kDim, bool kLean>
__global__ void __launch_bounds__(kHeadsPerBlock* kWarp, kLean ? 4 : 1)
    decode(const float* __restrict__ q, int heads, int head_dim, const float* __restrict__ kv,
           const int32_t* __restrict__ key_index, const int32_t* __restrict__ key_offsets,
           const float* __restrict__ sinks, float scale, float* __restrict__ out, float* __restrict__ partial,
           unsigned* __restrict__ arrivals, PagedTables paged) {
  static_assert(kDim == 0 || kDim == kMaxAttentionHeadDim);
  __shared__ __align__(16) float tiles[2][kTile * kMaxAttentionHeadDim];
  __shared__ const float* rows[kFound];  // key rows of the current pass
  let_next_start();
  wait_for_inputs();
  const int dim = kDim != 0 ? kDim : head_dim;
  const int b = blockIdx.y;
  const int all = key_offsets[b + 1] - key_offsets[b], splits = splits_of(all), split = blockIdx.z;
  if (split >= splits) return;  // a shorter list than the call's longest
  const float* const* table = paged.tables ? paged.tables[b] : nullptr;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int h = blockIdx.x * kHeadsPerBlock + warp;
  const bool active = h < heads;  // inactive warps still help stage tiles

  float qh[kPerLane], acc[kPerLane];
  const float* qrow = q + (int64_t{b} * heads + (active ? h : 0)) * dim;
#pragma unroll
  for (int i = 0; i < kPerLane; i += 4) {
    const float4 v = four_at<kDim>(qrow, lane_channel(lane, i), dim);
    qh[i] = v.x, qh[i + 1] = v.y, qh[i + 2] = v.z, qh[i + 3] = v.w;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.0f;
  float m = split == 0 ? (active ? sinks[h] : 0.0f) : -INFINITY, l = split == 0 ? 1.0f : 0.0f;

  // Keys `first` .. `first + n - 1` of the pass into `tile`, one commit group; the rows
  // past n are zeroed, so that the fold reads a whole tile. A thread copies the same
  // columns of each row (head_dim ≤ the block's threads · 4): no division a copy.
  const bool vector = dim % 4 == 0;  // rows 16-byte aligned: whole float4 copies
  static_assert(kMaxAttentionHeadDim <= 4 * kFound, "a thread's one float4 of each row");
  const auto stage = [&](int first, int n, float* tile) {
    for (int j = 0; j < kTile; ++j) {
      float* to = tile + j * kMaxAttentionHeadDim;
      if (j >= n) {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) to[d] = 0.0f;
      } else if (vector) {
        if (const int d = 4 * threadIdx.x; d < dim) cp_async16(to + d, rows[first + j] + d);
      } else {
        for (int d = threadIdx.x; d < dim; d += blockDim.x) cp_async4(to + d, rows[first + j] + d);
      }
    }
    cp_async_commit();
  };
  // The tile's n keys into m, l and acc at once: the scores of the whole tile, then one
  // new max and one correction for the tile, its exponentials side by side, and each
  // channel's sum over the tile's keys. Folding key by key made every key's two
  // exponentials and 16 multiply-adds wait on the key before (the kernel grew by about
  // 3.6 us a tile of a split: docs/perf.md, 2026-12-02). The scores and the sums go in
  // two halves of kHalf keys, each key's score and each channel's sum in the same order
  // either way: unrolled (kLean false) every load of the tile is in flight at once; one
  // half at a time (kLean) the kernel fits 128 registers. Every product and sum is
  // rounded as written (__fmaf_rn, __fmul_rn, __fadd_rn): without that the two forms'
  // bits differed, since the compiler may fuse a product with the add after it either
  // way (fma(acc, scale, weight · key) or fma(weight, key, acc · scale)) and need not
  // choose alike in both forms.
  const auto fold = [&](const float* tile, int n) {
    float s[kTile];
#pragma unroll(kLean ? 1 : 2)
    for (int half = 0; half < kTile; half += kHalf) {
      float part[kHalf] = {};
#pragma unroll
      for (int i = 0; i < kPerLane; i += 4) {  // each key's sum in channel order; a float4 of every key at once
#pragma unroll
        for (int j = 0; j < kHalf; ++j) {
          const float4 t = four_at<kDim>(tile + (half + j) * kMaxAttentionHeadDim, lane_channel(lane, i), dim);
          part[j] = __fmaf_rn(qh[i], t.x, part[j]);
          part[j] = __fmaf_rn(qh[i + 1], t.y, part[j]);
          part[j] = __fmaf_rn(qh[i + 2], t.z, part[j]);
          part[j] = __fmaf_rn(qh[i + 3], t.w, part[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kHalf; ++j) {
#pragma unroll
        for (int offset = kWarp / 2; offset > 0; offset /= 2) part[j] += __shfl_xor_sync(0xffffffffu, part[j], offset);
        if (half == 0) s[j] = part[j]; else s[kHalf + j] = part[j];  // constant indices: registers
      }
    }
    float top = m;
#pragma unroll
    for (int j = 0; j < kTile; ++j) {
      s[j] = j < n ? __fmul_rn(s[j], scale) : -INFINITY;
      top = fmaxf(top, s[j]);
    }
    const float correction = expf(m - top);  // 0 while m is -inf (a split's first tile)
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kTile; ++j) sum = __fadd_rn(sum, s[j] = expf(s[j] - top));  // 0 past n
    l = __fmaf_rn(l, correction, sum);
    m = top;
#pragma unroll(kLean ? 1 : 2)
    for (int half = 0; half < kTile; half += kHalf) {
      float weight[kHalf];
      const float scaled = half == 0 ? correction : 1.0f;  // the old sums scaled once (× 1 is exact)
#pragma unroll
      for (int j = 0; j < kHalf; ++j) weight[j] = half == 0 ? s[j] : s[kHalf + j];
#pragma unroll
      for (int i = 0; i < kPerLane; i += 4) {
        float4 channels{__fmul_rn(acc[i], scaled), __fmul_rn(acc[i + 1], scaled), __fmul_rn(acc[i + 2], scaled),
                        __fmul_rn(acc[i + 3], scaled)};
#pragma unroll
        for (int j = 0; j < kHalf; ++j) {
          const float4 t = four_at<kDim>(tile + (half + j) * kMaxAttentionHeadDim, lane_channel(lane, i), dim);
          channels.x = __fmaf_rn(weight[j], t.x, channels.x);
          channels.y = __fmaf_rn(weight[j], t.y, channels.y);
          channels.z = __fmaf_rn(weight[j], t.z, channels.z);
          channels.w = __fmaf_rn(weight[j], t.w, channels.w);
        }
        acc[i] = channels.x, acc[i + 1] = channels.y, acc[i + 2] = channels.z, acc[i + 3] = channels.w;
      }
    }
  };

  const int per_split = (all + splits - 1) / splits;
  const int first = key_offsets[b] + min(all, split * per_split);
  const int count = min(all, (split + 1) * per_split) - min(all, split * per_split);
  for (int pass = 0; pass < count; pass += kFound) {
    const int found = min(kFound, count - pass), n_tiles = (found + kTile - 1) / kTile;
    __syncthreads();  // the previous pass's rows and tiles are no longer read
    if (threadIdx.x < found) {
      const int64_t r = key_index[first + pass + threadIdx.x];
      rows[threadIdx.x] = table ? paged_row(table, paged.rows_per_block, r, dim) : kv + r * dim;
    }
    __syncthreads();
    stage(0, min(kTile, found), tiles[0]);
    for (int t = 0; t < n_tiles; ++t) {
      if (t + 1 < n_tiles) {
        stage((t + 1) * kTile, min(kTile, found - (t + 1) * kTile), tiles[(t + 1) % 2]);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // tile t is in shared memory
      if (active) fold(tiles[t % 2], min(kTile, found - t * kTile));
      __syncthreads();  // its buffer is free for tile t + 2
    }
  }
  float* orow = out + (int64_t{b} * heads + h) * dim;
  if (splits == 1) {
    if (!active) return;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (const int d = lane_channel(lane, i); d < dim) orow[d] = acc[i] / l;
    }
    return;
  }
  // partial[(b, h, split)] = m, l, then head_dim sums; rows of gridDim.z splits each.
  const float* pieces = partial + (int64_t{b} * heads + h) * gridDim.z * (dim + 2);
  if (active) {
    float* prow = partial + ((int64_t{b} * heads + h) * gridDim.z + split) * (dim + 2);
    if (lane == 0) prow[0] = m, prow[1] = l;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (const int d = lane_channel(lane, i); d < dim) prow[2 + d] = acc[i];
    }
  }
  __shared__ bool last;
  __threadfence();  // this block's pieces before its arrival
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned& arrived = arrivals[int64_t{b} * heads + blockIdx.x];
    last = atomicAdd(&arrived, 1u) == static_cast<unsigned>(splits) - 1;
    if (last) arrived = 0;  // ready for the next launch
  }
  __syncthreads();
  if (last && active) merge_splits<kPerLane>(pieces, splits, dim, orow, lane, kWarp);
}

// The tensor-core kernel's merge: one block per (sequence, head) of a sequence whose keys
// were split, a thread per column (merge_splits; launched with head_dim threads or more).
__global__ void combine(const float* __restrict__ partial, const int32_t* __restrict__ key_offsets, int heads,
                        int head_dim, int stride, int keys_per_split, float* __restrict__ out) {
  let_next_start();
  wait_for_inputs();
  const int64_t bh = blockIdx.x, b = bh / heads;
  const int splits = splits_of(key_offsets[b + 1] - key_offsets[b], keys_per_split);
  if (splits == 1) return;  // written by the attention kernel
  merge_splits<1>(partial + bh * stride * (head_dim + 2), splits, head_dim, out + bh * head_dim, threadIdx.x, 0);
}


// --- Tensor-core attention for many query rows (prefill) -----------------------------------
//
// The 64 heads of a query token share its keys, so a block takes 32 heads of one row as
// two 16-row MMA tiles (mma.sync m16n8k16) against 16 keys at a time: S = Q·Kᵀ, then the
// online softmax, then O += P·V with V = K. Operands are f32 split into bf16 hi + lo and
// multiplied as hi·hi + lo·hi + hi·lo (about 16 bits of each factor; the dropped lo·lo
// is below 2^-16 of a product). Warp w works on head tile w / 4 and quarter w % 4 of
// head_dim: for S it sums its quarter's products, the four partial S are added in
// quarter order through shared memory (so the tile's four warps hold the same S), and
// for O it owns that quarter's output columns.
namespace mma_rows {

constexpr int kHeads = 32;                       // per block: two MMA row tiles
constexpr int kQuarters = 4;                     // warps per row tile
constexpr int kThreads = 2 * kQuarters * kWarp;  // 256
constexpr int kKeys = 16;                        // keys per staged tile
constexpr int kMaxSteps = kMaxAttentionHeadDim / kQuarters / 16;  // 16-wide k steps in a quarter
constexpr int kPad = 8;  // bf16 values after each staged key row: rows 16 bytes off a 128-byte multiple
// Keys per split for prefill's rows: many rows fill the GPU, so a split is long. Decode
// and verify (a row or a few per sequence) split as the CUDA-core kernel does.
constexpr int kPrefillKeysPerSplit = 512;
constexpr int kLanesPerKey = kThreads / kKeys;  // threads staging one key row
static_assert(kLanesPerKey * kKeys == kThreads);

// head_dim rounded up so each quarter is whole 16-wide k steps.
__host__ __device__ constexpr int padded(int head_dim) { return (head_dim + 16 * kQuarters - 1) / (16 * kQuarters) * (16 * kQuarters); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p, bool trans) {
  const auto a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  if (trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  }
}

// Block (head group, row, split). The staged tile: key j's row as bf16 hi and lo, kPad
// apart from the next row; each thread stages a sixteenth of one key's row, fetching the
// next tile into registers while the block computes on this one. The key rows are found
// kThreads at a time (a thread a key), so that a tile's fetch is one memory round trip,
// not three (list entry, block table, row).
template <int kDim>
__global__ void __launch_bounds__(kThreads, 1)
    attend(const float* __restrict__ q, int heads, int head_dim_arg, const float* __restrict__ kv,
           const int32_t* __restrict__ key_index, const int32_t* __restrict__ key_offsets,
           const float* __restrict__ sinks, float scale, float* __restrict__ out, float* __restrict__ partial,
           PagedTables paged, int keys_per_split) {
  constexpr int kStride = kMaxAttentionHeadDim + kPad;
  __shared__ __align__(16) uint16_t khi[kKeys * kStride], klo[kKeys * kStride];
  __shared__ float reduce[2 * kQuarters][8][kWarp];  // each warp's partial S
  __shared__ const float* rows[kThreads];             // key rows of keys kThreads·n .. kThreads·(n + 1) - 1
  static_assert(kDim == 0 || kDim == kMaxAttentionHeadDim);
  const int head_dim = kDim != 0 ? kDim : head_dim_arg;
  let_next_start();  // the combine may launch meanwhile (it waits for this kernel)
  wait_for_inputs();
  const int b = blockIdx.y;
  const int all = key_offsets[b + 1] - key_offsets[b], splits = splits_of(all, keys_per_split), split = blockIdx.z;
  if (split >= splits) return;  // a shorter list than the call's longest
  const float* const* table = paged.tables ? paged.tables[b] : nullptr;
  const int dp = padded(head_dim), quarter = dp / kQuarters, steps = quarter / 16, stride = dp + kPad;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp, g = lane / 4, t = lane % 4;
  const int tile = warp / kQuarters, part = warp % kQuarters;
  const int h0 = blockIdx.x * kHeads + tile * 16 + g, h1 = h0 + 8;  // this lane's two heads

  // The query fragments of this warp's quarter, hi and lo (zero past heads or head_dim).
  uint32_t qhi[kMaxSteps][4], qlo[kMaxSteps][4];
  const auto q_at = [&](int h, int d) {
    return h < heads && d < head_dim ? q[(int64_t{b} * heads + h) * head_dim + d] : 0.0f;
  };
#pragma unroll
  for (int s = 0; s < kMaxSteps; ++s) {
    if (s >= steps) break;
    const int d = part * quarter + s * 16 + 2 * t;
    const Split r0 = hi_lo(q_at(h0, d), q_at(h0, d + 1)), r1 = hi_lo(q_at(h1, d), q_at(h1, d + 1));
    const Split r2 = hi_lo(q_at(h0, d + 8), q_at(h0, d + 9)), r3 = hi_lo(q_at(h1, d + 8), q_at(h1, d + 9));
    qhi[s][0] = r0.hi, qhi[s][1] = r1.hi, qhi[s][2] = r2.hi, qhi[s][3] = r3.hi;
    qlo[s][0] = r0.lo, qlo[s][1] = r1.lo, qlo[s][2] = r2.lo, qlo[s][3] = r3.lo;
  }

  float o[kMaxSteps * 2][4] = {};  // this warp's quarter of O: n-tiles of 8 columns
  float m[2], l[2];                // per head row g, g + 8
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = r == 0 ? h0 : h1;
    m[r] = split == 0 && h < heads ? sinks[h] : -INFINITY;
    l[r] = split == 0 && h < heads ? 1.0f : 0.0f;
  }

  const int per_split = (all + splits - 1) / splits;
  const int first = key_offsets[b] + min(all, split * per_split);
  const int count = min(all, (split + 1) * per_split) - min(all, split * per_split);
  // Staging: thread's key j of a tile, columns 4·(c + kLanesPerKey·i).
  const int j = threadIdx.x / kLanesPerKey, c = threadIdx.x % kLanesPerKey;
  const bool vector = head_dim % 4 == 0;
  // Rows of keys from `pass` (a multiple of kThreads) on; the caller syncs before use.
  const auto find = [&](int pass) {
    if (pass + threadIdx.x < count) {
      const int64_t r = key_index[first + pass + threadIdx.x];
      rows[threadIdx.x] = table ? paged_row(table, paged.rows_per_block, r, head_dim) : kv + r * head_dim;
    }
  };
  float4 next[kMaxSteps];  // dp / 64 ≤ 8 float4 per thread
  const auto fetch = [&](int base) {
    const float* row = base + j < count ? rows[(base + j) % kThreads] : nullptr;
#pragma unroll
    for (int i = 0; i < kMaxSteps; ++i) {
      const int d = 4 * (c + kLanesPerKey * i);
      if (d >= dp) break;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (row != nullptr && d < head_dim) {
        if (vector) {
          v = __ldg(reinterpret_cast<const float4*>(row + d));
        } else {
          v.x = row[d];
          v.y = d + 1 < head_dim ? row[d + 1] : 0.0f;
          v.z = d + 2 < head_dim ? row[d + 2] : 0.0f;
          v.w = d + 3 < head_dim ? row[d + 3] : 0.0f;
        }
      }
      next[i] = v;
    }
  };
  static_assert(kThreads % kKeys == 0, "a tile's rows are found in one pass");
  if (count > 0) {
    find(0);
    __syncthreads();
    fetch(0);
  }
  for (int base = 0; base < count; base += kKeys) {
    const int n = min(kKeys, count - base);
    __syncthreads();  // the previous tile and partial S are no longer read
#pragma unroll
    for (int i = 0; i < kMaxSteps; ++i) {
      const int d = 4 * (c + kLanesPerKey * i);
      if (d >= dp) break;
      const Split a = hi_lo(next[i].x, next[i].y), z = hi_lo(next[i].z, next[i].w);
      *reinterpret_cast<uint2*>(&khi[j * stride + d]) = make_uint2(a.hi, z.hi);
      *reinterpret_cast<uint2*>(&klo[j * stride + d]) = make_uint2(a.lo, z.lo);
    }
    __syncthreads();
    if (base + kKeys < count) {  // in flight while this tile computes
      if ((base + kKeys) % kThreads == 0) {  // the pass's rows were all fetched (two barriers ago)
        find(base + kKeys);
        __syncthreads();
      }
      fetch(base + kKeys);
    }

    // This quarter's part of S = Q·Kᵀ for keys 0-7 (s[0]) and 8-15 (s[1]).
    float s[2][4] = {};
    // ldmatrix rows: lane i gives key (i % 8) + 8·(i / 16), columns + 8·(i / 8 % 2).
    const int key = lane % 8 + 8 * (lane / 16), col8 = 8 * (lane / 8 % 2);
#pragma unroll
    for (int st = 0; st < kMaxSteps; ++st) {
      if (st >= steps) break;
      const int d = part * quarter + st * 16 + col8;
      uint32_t bh[4], bl[4];
      ldmatrix_x4(bh, &khi[key * stride + d], false);
      ldmatrix_x4(bl, &klo[key * stride + d], false);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) mma_split(s[nt], qhi[st], qlo[st], bh[2 * nt], bh[2 * nt + 1], bl[2 * nt], bl[2 * nt + 1]);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) reduce[warp][e][lane] = s[e / 4][e % 4];
    __syncthreads();
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float sum = reduce[tile * kQuarters][e][lane];
      for (int w = 1; w < kQuarters; ++w) sum = __fadd_rn(sum, reduce[tile * kQuarters + w][e][lane]);
      const int k = (e / 4) * 8 + 2 * t + e % 2;  // the key of s[e / 4][e % 4]
      s[e / 4][e % 4] = k < n ? sum * scale : -INFINITY;
    }

    // Online softmax per head row (r = 0: s[.][0..1], row g; r = 1: s[.][2..3], row g + 8).
    uint32_t phi[4], plo[4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float top = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      const float m_new = fmaxf(m[r], top), correction = expf(m[r] - m_new);
      float p[2][2], sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int x = 0; x < 2; ++x) sum += p[nt][x] = expf(s[nt][2 * r + x] - m_new);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l[r] = l[r] * correction + sum;
      m[r] = m_new;
#pragma unroll
      for (int nt = 0; nt < kMaxSteps * 2; ++nt) o[nt][2 * r] *= correction, o[nt][2 * r + 1] *= correction;
      // P as the A fragment: rows g / g + 8 at registers 0 / 1 (keys 2t, 2t+1) and 2 / 3 (8 + 2t, ...).
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const Split x = hi_lo(p[nt][0], p[nt][1]);
        phi[2 * nt + r] = x.hi, plo[2 * nt + r] = x.lo;
      }
    }

    // O += P·V over this quarter's columns, two n-tiles per ldmatrix (transposed: keys are k).
    // Lane i gives key (i % 8) + 8·(i / 8 % 2), columns + 8·(i / 16).
    const int vkey = lane % 8 + 8 * (lane / 8 % 2), vcol = 8 * (lane / 16);
#pragma unroll
    for (int nt = 0; nt < kMaxSteps * 2; nt += 2) {
      if (nt * 8 >= quarter) break;
      const int d = part * quarter + nt * 8 + vcol;
      uint32_t vh[4], vl[4];
      ldmatrix_x4(vh, &khi[vkey * stride + d], true);
      ldmatrix_x4(vl, &klo[vkey * stride + d], true);
#pragma unroll
      for (int x = 0; x < 2; ++x) mma_split(o[nt + x], phi, plo, vh[2 * x], vh[2 * x + 1], vl[2 * x], vl[2 * x + 1]);
    }
  }

  // Lane's values: n-tile nt, columns part·quarter + 8·nt + 2t (+1), rows g (0, 1) and g + 8 (2, 3).
  const int stride_z = gridDim.z;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = r == 0 ? h0 : h1;
    if (h >= heads) continue;
    float* row;
    if (splits == 1) {
      row = out + (int64_t{b} * heads + h) * head_dim;
    } else {  // partial[(b, h, split)] = m, l, then head_dim sums, as the decode kernel's
      float* prow = partial + ((int64_t{b} * heads + h) * stride_z + split) * (head_dim + 2);
      if (part == 0 && t == 0) prow[0] = m[r], prow[1] = l[r];
      row = prow + 2;
    }
#pragma unroll
    for (int nt = 0; nt < kMaxSteps * 2; ++nt) {
      const int d = part * quarter + nt * 8 + 2 * t;
      if (nt * 8 >= quarter) break;
      if (d < head_dim) row[d] = splits == 1 ? o[nt][2 * r] / l[r] : o[nt][2 * r];
      if (d + 1 < head_dim) row[d + 1] = splits == 1 ? o[nt][2 * r + 1] / l[r] : o[nt][2 * r + 1];
    }
  }
}

}  // namespace mma_rows
}  // namespace

int64_t attend_decode_scratch(int sequences, int heads, int head_dim, int max_keys) {
  const int splits = splits_of(max_keys);
  return splits == 1 ? 0 : int64_t{sequences} * heads * splits * (head_dim + 2);
}

int64_t attend_decode_arrivals(int sequences, int heads) { return int64_t{sequences} * heads; }

namespace {

// What both launchers check before launching.
void check_call(const char* who, int sequences, int head_dim, PagedTables paged) {
  if (head_dim <= 0 || head_dim > kMaxAttentionHeadDim) {
    throw std::runtime_error(std::string(who) + ": head_dim " + std::to_string(head_dim) + " is not in 1.." +
                             std::to_string(kMaxAttentionHeadDim));
  }
  if (sequences > 65535) throw std::runtime_error(std::string(who) + ": more than 65535 query rows");
  if (paged.tables && paged.rows_per_block < 1) {
    throw std::runtime_error(std::string(who) + ": paged keys without rows per block");
  }
}

// Merges the split rows' pieces (a no-op for rows whose list was not split).
void launch_combine(const float* scratch, const int32_t* key_offsets, int sequences, int heads, int head_dim,
                    int splits, int keys_per_split, float* out, cudaStream_t stream) {
  const int threads = (head_dim + kWarp - 1) / kWarp * kWarp;  // a column each (head_dim ≤ 512)
  overlapped_launch("attention combine launch", combine, static_cast<unsigned>(int64_t{sequences} * heads), threads, 0,
                    stream, scratch, key_offsets, heads, head_dim, splits, keys_per_split, out);
}

}  // namespace

void attend_decode(const float* q, int sequences, int heads, int head_dim, const float* kv,
                   const int32_t* key_index, const int32_t* key_offsets, const float* sinks, float scale,
                   float* out, SplitScratch scratch, int max_keys, PagedTables paged, void* stream_ptr) {
  check_call("cuda::attend_decode", sequences, head_dim, paged);
  if (sequences <= 0 || heads <= 0) return;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int splits = splits_of(max_keys);
  if (splits > 1 && (scratch.partial == nullptr || scratch.arrivals == nullptr)) {
    throw std::runtime_error("cuda::attend_decode: no scratch (partial sums and arrival counters) for split keys");
  }
  const dim3 grid((heads + kHeadsPerBlock - 1) / kHeadsPerBlock, sequences, splits);
  // One row a call: every load of a tile in flight (208 registers on sm_90a, two blocks a
  // multiprocessor). Several: half a tile at a time, four blocks a multiprocessor; the
  // same bits, so a row's result does not depend on its batch.
  const bool lean = sequences > 1, flash = head_dim == kMaxAttentionHeadDim;
  const auto kernel = flash ? (lean ? decode<kMaxAttentionHeadDim, true> : decode<kMaxAttentionHeadDim, false>)
                            : (lean ? decode<0, true> : decode<0, false>);
  overlapped_launch("attend_decode launch", kernel, grid, kHeadsPerBlock * kWarp, 0, stream, q, heads, head_dim, kv,
                    key_index, key_offsets, sinks, scale, out, scratch.partial, scratch.arrivals, paged);
}

namespace {

void launch_mma(const char* who, const float* q, int rows, int heads, int head_dim, const float* kv,
                const int32_t* key_index, const int32_t* key_offsets, const float* sinks, float scale, float* out,
                float* scratch, int max_keys, PagedTables paged, int keys_per_split, void* stream_ptr) {
  check_call(who, rows, head_dim, paged);
  if (rows <= 0 || heads <= 0) return;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int splits = splits_of(max_keys, keys_per_split);
  if (splits > 1 && scratch == nullptr) throw std::runtime_error(std::string(who) + ": no scratch for split keys");
  const dim3 grid((heads + mma_rows::kHeads - 1) / mma_rows::kHeads, rows, splits);
  const auto kernel = head_dim == kMaxAttentionHeadDim ? mma_rows::attend<kMaxAttentionHeadDim> : mma_rows::attend<0>;
  overlapped_launch("attend_mma launch", kernel, grid, mma_rows::kThreads, 0, stream, q, heads, head_dim, kv,
                    key_index, key_offsets, sinks, scale, out, scratch, paged, keys_per_split);
  if (splits > 1) launch_combine(scratch, key_offsets, rows, heads, head_dim, splits, keys_per_split, out, stream);
}

}  // namespace

void attend_mma(const float* q, int rows, int heads, int head_dim, const float* kv, const int32_t* key_index,
                const int32_t* key_offsets, const float* sinks, float scale, float* out, SplitScratch scratch,
                int max_keys, PagedTables paged, void* stream) {
  launch_mma("cuda::attend_mma", q, rows, heads, head_dim, kv, key_index, key_offsets, sinks, scale, out,
             scratch.partial, max_keys, paged, mma_rows::kPrefillKeysPerSplit, stream);
}

void attend_mma_decode(const float* q, int rows, int heads, int head_dim, const float* kv, const int32_t* key_index,
                       const int32_t* key_offsets, const float* sinks, float scale, float* out, SplitScratch scratch,
                       int max_keys, PagedTables paged, void* stream) {
  launch_mma("cuda::attend_mma_decode", q, rows, heads, head_dim, kv, key_index, key_offsets, sinks, scale, out,
             scratch.partial, max_keys, paged, kKeysPerSplit, stream);
}

void register_attention(Registry& registry) {
  const auto add = [&](const char* name, auto* entry, Op op, int priority, std::vector<AttentionKind> kinds,
                       const char* summary) {
    KernelInfo k{.name = name,
                 .op = op,
                 .archs = ArchSet::gpus_from(Arch::sm_80),
                 .activations = {Activation::f32},
                 .attention_kinds = std::move(kinds),
                 .priority = priority,
                 .summary = summary};
    registry.add(std::move(k.with_entry(entry)));
  };
  // The CUDA-core kernel: f32 throughout, one query row per block group.
  add("cuda_decode_attention", &attend_decode, Op::attention_decode, 1, {},
      "one query per sequence over indexed window + compressed keys, sink, online softmax (CUDA cores)");
  add("cuda_decode_attention", &attend_decode, Op::attention_prefill, 1, {},
      "the decode kernel once per chunk token (CUDA cores)");
  add("cuda_decode_attention", &attend_decode, Op::attention_verify, 1, {},
      "the decode kernel once per draft token, so verified rows equal decoded ones bit for bit");
  // mma.sync bf16 is on every GPU from sm_80 on: prefill's many rows a call take it.
  // Decode and verify take the CUDA-core kernel in every layer kind: since head_dim 512
  // is compiled in, one row runs faster there at every length (640 keys: 18.4 against
  // 27.5 us on an H100), though the tensor cores still win from about 384 keys at 8 or 64
  // rows a call (640 keys, 8 rows: 79.0 against 61.2 us since the lean fold; docs/perf.md,
  // 2026-12-06 and 12-07); the choice is per layer kind, never per call, so that a row's
  // bits do not depend on its batch, and a verified row has the bits plain decoding gives
  // it.
  add("cuda_mma_attention", &attend_mma, Op::attention_prefill, 2, {},
      "tensor cores (mma.sync, f32 as bf16 hi + lo): 32 heads of a query row against 16 keys at a time");
}

}  // namespace keel::cuda
