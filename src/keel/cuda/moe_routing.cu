#include "cuda/moe_routing.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"

namespace keel::cuda {
namespace {

constexpr int kThreads = 256;

// The order of the selection: the higher biased score, then the lower expert.
__device__ bool before(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

// One block per token. Its threads score the experts into shared memory, then rank
// them: an expert's rank is how many experts come before it in the selection's order (a
// strict total order), and the expert of rank r < k is the r-th pick, all experts at
// once; the first warp then forms the weights. (k rounds of a block-wide argmax, two
// barriers and a serial pass over the warps each, took 8.0-8.4 us a token at 256
// experts and top-6 on an H200 against 3.5 us for a hash layer's; the ranks take 6.9.)
__global__ void __launch_bounds__(kThreads)
    route_tokens(float* logits, int experts, ScoringFunc func, const float* __restrict__ bias,
                 const int32_t* __restrict__ hashed, int k, float scaling, int32_t* __restrict__ experts_out,
                 float* __restrict__ weights_out) {
  extern __shared__ float shared[];
  float* score = shared;                                  // [experts]
  float* biased = shared + experts;                       // [experts], score + bias
  int* chosen = reinterpret_cast<int*>(biased + experts);  // [k], in selection order
  // The bias before the wait (no kernel writes it), each thread's own experts' alone.
  for (int e = threadIdx.x; e < experts; e += blockDim.x) biased[e] = bias ? bias[e] : 0.0f;
  let_next_start();
  wait_for_inputs();
  const int64_t t = blockIdx.x;
  float* row = logits + t * experts;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    const float x = row[e];
    const float s = func == ScoringFunc::sqrtsoftplus ? sqrtf(x > 20.0f ? x : log1pf(expf(x)))  // PyTorch softplus
                                                      : 1.0f / (1.0f + expf(-x));
    row[e] = s;
    score[e] = s;
    biased[e] = s + biased[e];
  }
  // Each pick defaults to expert 0: NaN scores (which order before nothing) leave ranks
  // unused, and an id must never point past the table.
  for (int i = threadIdx.x; i < k; i += blockDim.x) chosen[i] = 0;
  __syncthreads();
  if (hashed) {
    for (int i = threadIdx.x; i < k; i += blockDim.x) chosen[i] = hashed[t * k + i];
  } else {
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
      const float v = biased[e];
      int rank = 0;
      // 32 experts at a time, until k of them come before e: most experts stop early.
      for (int o0 = 0; o0 < experts && rank < k; o0 += kWarp) {
        const int end = min(experts, o0 + kWarp);
#pragma unroll 8
        for (int o = o0; o < end; ++o) rank += before(biased[o], o, v, e);
      }
      if (rank < k) chosen[rank] = e;
    }
  }
  __syncthreads();
  if (threadIdx.x >= kWarp) return;
  const int lane = threadIdx.x;
  // ops/moe.cpp's weights: the chosen scores summed in selection order, each divided by the sum.
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum += score[chosen[i]];
  for (int i = lane; i < k; i += kWarp) {
    experts_out[t * k + i] = chosen[i];
    weights_out[t * k + i] = score[chosen[i]] / (sum + 1e-20f) * scaling;
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
  const size_t shared = size_t(experts) * 2 * sizeof(float) + size_t(k) * sizeof(int);
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
               .summary = "scores, biased top-k (each expert ranked at once) or tid2eid, normalized weights"};
  registry.add(std::move(k.with_entry(&route)));
}

}  // namespace keel::cuda
