#include "cuda/moe_routing.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"

namespace keel::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarp;

// The order of the selection: the higher biased score, then the lower expert.
__device__ bool before(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

// One block per token. Scores and biased scores live in shared memory; each of the k
// rounds takes the best unselected expert by a block-wide (value, index) reduction.
__global__ void __launch_bounds__(kThreads)
    route_tokens(float* logits, int experts, ScoringFunc func, const float* __restrict__ bias,
                 const int32_t* __restrict__ hashed, int k, float scaling, int32_t* __restrict__ experts_out,
                 float* __restrict__ weights_out) {
  wait_for_inputs();
  let_next_start();
  extern __shared__ float shared[];
  float* score = shared;               // [experts]
  float* biased = shared + experts;    // [experts], score + bias
  int* taken = reinterpret_cast<int*>(biased + experts);  // [experts]
  __shared__ float best_value[kWarps];
  __shared__ int best_index[kWarps];
  const int64_t t = blockIdx.x;
  float* row = logits + t * experts;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    const float x = row[e];
    const float s = func == ScoringFunc::sqrtsoftplus ? sqrtf(x > 20.0f ? x : log1pf(expf(x)))  // PyTorch softplus
                                                      : 1.0f / (1.0f + expf(-x));
    row[e] = s;
    score[e] = s;
    biased[e] = s + (bias ? bias[e] : 0.0f);
    taken[e] = 0;
  }
  __syncthreads();
  int32_t* out_e = experts_out + t * k;
  if (hashed) {
    for (int i = threadIdx.x; i < k; i += blockDim.x) out_e[i] = hashed[t * k + i];
  } else {
    const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
    for (int round = 0; round < k; ++round) {
      float v = -INFINITY;
      int index = -1;
      for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        if (!taken[e] && (index < 0 || before(biased[e], e, v, index))) v = biased[e], index = e;
      }
      for (int offset = kWarp / 2; offset > 0; offset /= 2) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
        const int oi = __shfl_xor_sync(0xffffffffu, index, offset);
        if (oi >= 0 && (index < 0 || before(ov, oi, v, index))) v = ov, index = oi;
      }
      if (lane == 0) best_value[warp] = v, best_index[warp] = index;
      __syncthreads();
      if (threadIdx.x == 0) {
        float bv = best_value[0];
        int bi = best_index[0];
        for (int w = 1; w < kWarps; ++w) {
          if (best_index[w] >= 0 && (bi < 0 || before(best_value[w], best_index[w], bv, bi)))
            bv = best_value[w], bi = best_index[w];
        }
        out_e[round] = bi;
        taken[bi] = 1;
      }
      __syncthreads();
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int i = 0; i < k; ++i) sum += score[out_e[i]];
    for (int i = 0; i < k; ++i) weights_out[t * k + i] = score[out_e[i]] / (sum + 1e-20f) * scaling;
  }
}

}  // namespace

void route(float* logits, int64_t tokens, int experts, ScoringFunc func, const float* bias, const int32_t* hashed,
           int k, float scaling, int32_t* experts_out, float* weights_out, void* stream) {
  if (k <= 0 || k > experts) {
    throw std::runtime_error("cuda::route: k " + std::to_string(k) + " is not in 1.." + std::to_string(experts));
  }
  if (tokens <= 0) return;
  if (tokens > 0x7fffffff) throw std::runtime_error("cuda::route: too many tokens");
  const size_t shared = size_t(experts) * (2 * sizeof(float) + sizeof(int));
  if (shared > 48 * 1024) throw std::runtime_error("cuda::route: too many experts (" + std::to_string(experts) + ")");
  overlapped_launch("route launch", route_tokens, static_cast<unsigned>(tokens), kThreads, shared,
                    static_cast<cudaStream_t>(stream), logits, experts, func, bias, hashed, k, scaling, experts_out,
                    weights_out);
}

void register_moe_routing(Registry& registry) {
  KernelInfo k{.name = "cuda_route",
               .op = Op::moe_routing,
               .archs = ArchSet::gpus_from(Arch::sm_80),
               .activations = {Activation::f32},
               .priority = 1,
               .summary = "scores, biased top-k (block argmax per round) or tid2eid, normalized weights"};
  registry.add(std::move(k.with_entry(&route)));
}

}  // namespace keel::cuda
