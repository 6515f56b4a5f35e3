#include "cuda/sampling.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
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

// Block-wide reductions (kThreads threads); every thread gets the result. The partials
// are combined in the same order every time, so a row's sums do not depend on its batch.
__device__ uint64_t block_max(uint64_t v, uint64_t* shared) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();  // the previous use of `shared` is over
  if (threadIdx.x % kWarp == 0) shared[threadIdx.x / kWarp] = v;
  __syncthreads();
  uint64_t out = 0;
  for (int w = 0; w < kWarps; ++w) out = max(out, shared[w]);
  return out;
}

__device__ float block_sum(float v, float* shared) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();
  if (threadIdx.x % kWarp == 0) shared[threadIdx.x / kWarp] = v;
  __syncthreads();
  float out = 0;
  for (int w = 0; w < kWarps; ++w) out += shared[w];
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

// One block per row: ops/sampling.cpp's summarize, pass by pass over the row (which
// stays in L2 between passes).
__global__ void __launch_bounds__(kThreads) summarize_kernel(const float* logits, int vocab, const SummaryTask* tasks,
                                                            int stride, RowTotals* totals, int32_t* ids, float* values) {
  __shared__ uint64_t max_scratch[kWarps];
  __shared__ float sum_scratch[kWarps];
  __shared__ int scan_scratch[kWarps];
  __shared__ int hist[256];
  __shared__ int found[2];
  __shared__ int greater;
  __shared__ uint64_t best[kMaxCandidates];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * vocab;
  const SummaryTask task = tasks[row];
  const float t = task.temperature;

  // The passes over the row are unrolled so that a thread's loads go out together (a
  // row is 127 loads per thread at a 129K vocabulary, one round trip each when issued
  // one at a time); each sum still adds its values in order.
  uint64_t top = 0;
#pragma unroll 8
  for (int i = threadIdx.x; i < vocab; i += kThreads) top = max(top, ranked(order_key(x[i]), i));
  top = block_max(top, max_scratch);
  const int32_t top_token = token_of(top);
  const float m = x[top_token];

  float sum = 0, sum_t = 0;
#pragma unroll 8
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    const float v = x[i];
    sum += expf(v - m);
    if (t > 0.0f) sum_t += expf((v - m) / t);
  }
  sum = block_sum(sum, sum_scratch);
  sum_t = block_sum(sum_t, sum_scratch);

  int32_t pick = -1;
  if (task.whole_pick) {
    uint64_t b = 0;
#pragma unroll 8
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

}  // namespace

void summarize_rows(const float* logits, int64_t rows, int64_t vocab, const SummaryTask* tasks, int stride,
                    RowTotals* totals, int32_t* ids, float* values, void* stream) {
  if (rows <= 0) return;
  if (vocab <= 0 || vocab > 0x7fffffff) throw std::runtime_error("cuda::summarize_rows: bad vocabulary size");
  if (rows > 0x7fffffff) throw std::runtime_error("cuda::summarize_rows: too many rows");
  if (stride < 1 || stride > kMaxCandidates) {
    throw std::runtime_error("cuda::summarize_rows: stride must be in 1.." + std::to_string(kMaxCandidates));
  }
  summarize_kernel<<<static_cast<unsigned>(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      logits, static_cast<int>(vocab), tasks, stride, totals, ids, values);
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
               .summary = "one block per row: the best candidates by radix select and bitonic sort, the normalizers, "
                          "the Gumbel-max pick; only the summary is copied back"};
  registry.add(std::move(k.with_entry(&summarize_rows)));
}

}  // namespace keel::cuda
