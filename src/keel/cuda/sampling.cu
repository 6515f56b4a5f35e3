#include "cuda/sampling.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/row_chunks.cuh"
#include "ops/sampling_noise.h"

namespace keel::cuda {
namespace {

constexpr int kThreads = 1024, kWarps = kThreads / kWarp;

// A float's bits as an unsigned key in the same order (-0 and +0 one key, as they
// compare equal), and a (key, token) pair in one word whose larger value is the larger
// key, ties to the lower token: the order summarize's candidates and picks use.
__device__ uint32_t order_key(float v) {
  if (v == 0.0f) v = 0.0f;
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ uint64_t ranked(uint32_t key, int32_t token) {
  return (static_cast<uint64_t>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(token));
}
__device__ int32_t token_of(uint64_t r) { return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(r)); }

// A warp's reductions; every lane gets the result, combined in the same order every time.
__device__ uint64_t warp_max(uint64_t v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}
__device__ float warp_sum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// A block-wide maximum (kThreads threads); every thread gets the result.
__device__ uint64_t block_max(uint64_t v, uint64_t* shared) {
  v = warp_max(v);
  __syncthreads();  // the previous use of `shared` is over
  if (threadIdx.x % kWarp == 0) shared[threadIdx.x / kWarp] = v;
  __syncthreads();
  uint64_t out = 0;
  for (int w = 0; w < kWarps; ++w) out = max(out, shared[w]);
  return out;
}

// The sum of v over the threads before this one.
__device__ int block_exclusive_sum(int v, int* shared) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  int inclusive = v;
  for (int offset = 1; offset < kWarp; offset *= 2) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  __syncthreads();
  if (lane == kWarp - 1) shared[warp] = inclusive;
  __syncthreads();
  int before = inclusive - v;
  for (int w = 0; w < warp; ++w) before += shared[w];
  return before;
}

// The key of the `need`-th largest of the row (1-based), by 8-bit digits from the top:
// each pass counts the keys that share the digits found so far. On return `need` is how
// many tokens with exactly that key belong to the best `need`.
__device__ uint32_t select_key(const float* x, int vocab, int& need, int* hist, int* found) {
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += kThreads) hist[d] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t u = order_key(x[i]);
      if ((u & mask) == prefix) atomicAdd(&hist[(u >> shift) & 0xffu], 1);
    }
    __syncthreads();
    if (threadIdx.x < kWarp) {  // lane l holds digits 255 − 8l down to 248 − 8l
      const int lane = threadIdx.x, top = 255 - 8 * lane;
      int count = 0;
      for (int d = top; d > top - 8; --d) count += hist[d];
      int inclusive = count;
      for (int offset = 1; offset < kWarp; offset *= 2) {
        const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += up;
      }
      int above = inclusive - count;
      if (above < need && need <= inclusive) {
        for (int d = top; d > top - 8; --d) {
          if (above + hist[d] >= need) {
            found[0] = d;
            found[1] = need - above;
            break;
          }
          above += hist[d];
        }
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(found[0]) << shift;
    mask |= 0xffu << shift;
    need = found[1];
  }
  return prefix;
}

// Sorts p (a power of two) ranked values descending.
__device__ void sort_descending(uint64_t* v, int p) {
  for (int k = 2; k <= p; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      for (int i = threadIdx.x; i < p; i += kThreads) {
        const int other = i ^ j;
        if (other > i) {
          const uint64_t a = v[i], b = v[other];
          if ((i & k) == 0 ? a < b : a > b) {
            v[i] = b;
            v[other] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// --- A row's maximum and normalizers, in chunks --------------------------------------
//
// One block reading a 129K-token row once for its maximum and again for the sums of exp
// is two chains of round trips (30 us a row on an H200). Instead a block of
// kChunkThreads takes each kChunk logits of the row, every load in flight at once, and
// leaves the chunk's best token and its sums relative to the chunk's own maximum m_c;
// the row's block then takes the best of the bests (exact: the ranked order is total)
// and adds sum_c · exp(m_c − m) in chunk order. The chunks follow from the vocabulary
// alone, so a row's bits do not depend on its batch.
constexpr int kChunkThreads = 256, kPerThread = 16, kChunk = kChunkThreads * kPerThread;

struct ChunkTotals {
  uint64_t top;      // the chunk's best, ranked
  float sum, sum_t;  // Σ exp(v − m_c) and (temperature t > 0) Σ exp((v − m_c) / t)
};

__host__ __device__ int chunk_count(int64_t vocab) { return static_cast<int>((vocab + kChunk - 1) / kChunk); }

// Block (row, chunk): that chunk's totals into chunks[row · gridDim.y + chunk].
__global__ void __launch_bounds__(kChunkThreads) chunk_kernel(const float* logits, int vocab, const SummaryTask* tasks,
                                                             ChunkTotals* chunks) {
  constexpr int kChunkWarps = kChunkThreads / kWarp;
  __shared__ uint64_t tops[kChunkWarps];
  __shared__ float sums[2][kChunkWarps];
  const float* x = logits + int64_t{blockIdx.x} * vocab;
  const int first = static_cast<int>(blockIdx.y) * kChunk + static_cast<int>(threadIdx.x);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  float v[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = first + j * kChunkThreads;
    v[j] = i < vocab ? x[i] : 0.0f;
  }
  uint64_t top = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = first + j * kChunkThreads;
    if (i < vocab) top = max(top, ranked(order_key(v[j]), i));
  }
  top = warp_max(top);
  if (lane == 0) tops[warp] = top;
  __syncthreads();
  for (int w = 0; w < kChunkWarps; ++w) top = max(top, tops[w]);
  const float m = x[token_of(top)], t = tasks[blockIdx.x].temperature;

  // A chunk of -inf adds nothing to a row with a finite maximum (exp(-inf − m) = 0).
  float sum = 0, sum_t = 0;
  if (m != -INFINITY) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (first + j * kChunkThreads >= vocab) break;
      sum += expf(v[j] - m);
      if (t > 0.0f) sum_t += expf((v[j] - m) / t);
    }
  }
  sum = warps_sum(sum, sums[0], kChunkWarps), sum_t = warps_sum(sum_t, sums[1], kChunkWarps);
  if (threadIdx.x == 0) chunks[int64_t{blockIdx.x} * gridDim.y + blockIdx.y] = {top, sum, sum_t};
}

// The row's best (ranked) and its sums, relative to its maximum, from its chunks' (warp
// 0; the others wait).
__device__ ChunkTotals combine_chunks(const float* x, const ChunkTotals* row_chunks, int count, float t,
                                      ChunkTotals* shared) {
  if (threadIdx.x < kWarp) {
    const int lane = threadIdx.x;
    uint64_t top = 0;
    for (int c = lane; c < count; c += kWarp) top = max(top, row_chunks[c].top);
    top = warp_max(top);
    const float m = x[token_of(top)];
    float sum = 0, sum_t = 0;
    for (int c = lane; c < count; c += kWarp) {
      const ChunkTotals chunk = row_chunks[c];
      const float m_c = x[token_of(chunk.top)];
      sum += chunk.sum * expf(m_c - m);
      if (t > 0.0f) sum_t += chunk.sum_t * expf((m_c - m) / t);
    }
    sum = warp_sum(sum), sum_t = warp_sum(sum_t);
    if (lane == 0) *shared = {top, sum, sum_t};
  }
  __syncthreads();
  return *shared;
}

// One block per row: ops/sampling.cpp's summarize from the row's chunk totals, then pass
// by pass over the row (which stays in L2 between passes) for what else its task asks.
__global__ void __launch_bounds__(kThreads) summarize_kernel(const float* logits, int vocab, const SummaryTask* tasks,
                                                            const ChunkTotals* chunks, int stride, RowTotals* totals,
                                                            int32_t* ids, float* values) {
  __shared__ uint64_t max_scratch[kWarps];
  __shared__ int scan_scratch[kWarps];
  __shared__ int hist[256];
  __shared__ int found[2];
  __shared__ int greater;
  __shared__ uint64_t best[kMaxCandidates];
  __shared__ ChunkTotals combined;
  const int64_t row = blockIdx.x;
  const float* x = logits + row * vocab;
  const SummaryTask task = tasks[row];
  const float t = task.temperature;

  const int count_chunks = chunk_count(vocab);
  const ChunkTotals c = combine_chunks(x, chunks + row * count_chunks, count_chunks, t, &combined);
  const uint64_t top = c.top;
  const float m = x[token_of(top)], sum = c.sum, sum_t = c.sum_t;

  int32_t pick = -1;
  if (task.whole_pick) {
    uint64_t b = 0;
#pragma unroll 8  // a thread's loads go out together (a 129K row is 127 per thread)
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float k = (x[i] - m) / t;
      if (k >= task.log_min_p) b = max(b, ranked(order_key(k + gumbel_noise(task.seed, task.draw, i)), i));
    }
    pick = token_of(block_max(b, max_scratch));
  }

  const int count = min(min(task.candidates, stride), vocab);
  if (count == 1) {
    if (threadIdx.x == 0) best[0] = top;
  } else {
    int need = count;
    const uint32_t kth = select_key(x, vocab, need, hist, found);
    if (threadIdx.x == 0) greater = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const uint32_t u = order_key(x[i]);
      if (u > kth) best[atomicAdd(&greater, 1)] = ranked(u, i);
    }
    // Of the tokens whose key is the kth's, the `need` lowest: each thread takes a
    // contiguous range of ids, in order.
    const int per = (vocab + kThreads - 1) / kThreads;
    const int lo = min(vocab, static_cast<int>(threadIdx.x) * per), hi = min(vocab, lo + per);
    int mine = 0;
    for (int i = lo; i < hi; ++i) mine += order_key(x[i]) == kth;
    int before = block_exclusive_sum(mine, scan_scratch);  // its __syncthreads orders `greater`
    const int first = greater;
    for (int i = lo; i < hi && before < need; ++i) {
      if (order_key(x[i]) == kth) best[first + before++] = ranked(kth, i);
    }
    int p = 1;
    while (p < count) p *= 2;
    for (int j = count + threadIdx.x; j < p; j += kThreads) best[j] = 0;
    __syncthreads();
    sort_descending(best, p);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < count; j += kThreads) {
    const int32_t token = token_of(best[j]);
    ids[row * stride + j] = token;
    values[row * stride + j] = x[token];
  }
  if (threadIdx.x == 0) {
    totals[row] = {m, m + logf(sum), sum_t, pick >= 0 ? x[pick] : 0.0f, pick, count};
  }
}

// A thread per row: its pick, then its experts in each hash layer.
__global__ void take_picks_kernel(const RowTotals* totals, const int32_t* ids, int stride, const int32_t* sources,
                                  int rows, int vocab, const int32_t* tid2eid, int hash_layers, int k, int32_t* tokens,
                                  int32_t* hashed) {
  const int r = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (r >= rows) return;
  const int32_t source = sources[r];
  if (source < 0) return;
  const int row = source >> 1;
  int32_t token = (source & 1) ? totals[row].whole_pick : ids[static_cast<int64_t>(row) * stride];
  if (token < 0 || token >= vocab) token = 0;
  tokens[r] = token;
  for (int h = 0; h < hash_layers; ++h) {
    const int32_t* experts = tid2eid + (static_cast<int64_t>(h) * vocab + token) * k;
    int32_t* out = hashed + (static_cast<int64_t>(h) * rows + r) * k;
    for (int e = 0; e < k; ++e) out[e] = experts[e];
  }
}

}  // namespace

int32_t pick_source(int64_t summary_row, PickKind kind) {
  if (kind == PickKind::candidates) throw std::logic_error("cuda::pick_source: a draw among candidates needs the host");
  if (summary_row < 0 || summary_row >= (int64_t{1} << 30)) throw std::runtime_error("cuda::pick_source: bad row");
  return static_cast<int32_t>(2 * summary_row + (kind == PickKind::whole_row ? 1 : 0));
}

void take_picks(const RowTotals* totals, const int32_t* ids, int stride, const int32_t* sources, int64_t rows,
                int64_t vocab, const int32_t* tid2eid, int hash_layers, int k, int32_t* tokens, int32_t* hashed,
                void* stream) {
  if (rows <= 0) return;
  if (rows > 0x7fffffff || vocab <= 0 || vocab > 0x7fffffff) throw std::runtime_error("cuda::take_picks: bad sizes");
  constexpr int kPickThreads = 128;
  const auto blocks = static_cast<unsigned>((rows + kPickThreads - 1) / kPickThreads);
  take_picks_kernel<<<blocks, kPickThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      totals, ids, stride, sources, static_cast<int>(rows), static_cast<int>(vocab), tid2eid, hash_layers, k, tokens,
      hashed);
  check(cudaGetLastError(), "take_picks launch");
}

size_t summary_scratch_bytes(int64_t rows, int64_t vocab) {
  return static_cast<size_t>(std::max<int64_t>(rows, 0) * std::max(chunk_count(vocab), 0)) * sizeof(ChunkTotals);
}

void summarize_rows(const float* logits, int64_t rows, int64_t vocab, const SummaryTask* tasks, int stride,
                    RowTotals* totals, int32_t* ids, float* values, void* scratch, void* stream) {
  if (rows <= 0) return;
  if (vocab <= 0 || vocab > 0x7fffffff) throw std::runtime_error("cuda::summarize_rows: bad vocabulary size");
  if (rows > 0x7fffffff) throw std::runtime_error("cuda::summarize_rows: too many rows");
  if (stride < 1 || stride > kMaxCandidates) {
    throw std::runtime_error("cuda::summarize_rows: stride must be in 1.." + std::to_string(kMaxCandidates));
  }
  const auto s = static_cast<cudaStream_t>(stream);
  auto* chunks = static_cast<ChunkTotals*>(scratch);
  chunk_kernel<<<dim3(static_cast<unsigned>(rows), static_cast<unsigned>(chunk_count(vocab))), kChunkThreads, 0, s>>>(
      logits, static_cast<int>(vocab), tasks, chunks);
  check(cudaGetLastError(), "summarize_rows launch");
  summarize_kernel<<<static_cast<unsigned>(rows), kThreads, 0, s>>>(logits, static_cast<int>(vocab), tasks, chunks,
                                                                    stride, totals, ids, values);
  check(cudaGetLastError(), "summarize_rows launch");
}

RowSummary row_summary(const RowTotals& t, const int32_t* ids, const float* values, int64_t vocab) {
  RowSummary s{.vocab = vocab,
               .max_logit = t.max_logit,
               .log_z = t.log_z,
               .z_t = t.z_t,
               .whole_pick = t.whole_pick,
               .whole_pick_logit = t.whole_pick_logit};
  s.ids.assign(ids, ids + t.count);
  s.logits.assign(values, values + t.count);
  return s;
}

void register_sampling(Registry& registry) {
  KernelInfo k{.name = "cuda_sampling",
               .op = Op::sampling,
               .archs = ArchSet::gpus_from(Arch::sm_80),
               .activations = {Activation::f32},
               .priority = 1,
               .summary = "blocks of 4096 logits for each row's maximum and normalizers, then one block per row: the best "
                          "candidates by radix select and bitonic sort, the Gumbel-max pick; only the summary is copied back, "
                          "and a pipelined step's tokens are picked from it on the device"};
  registry.add(std::move(k.with_entry(&summarize_rows)));
}

}  // namespace keel::cuda
