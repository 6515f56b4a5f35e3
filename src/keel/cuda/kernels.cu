#include "cuda/kernels.h"

#include "cuda/attention.h"
#include "cuda/compressor.h"
#include "cuda/embedding.h"
#include "cuda/gemm_fp8.h"
#include "cuda/gemm_mma.h"
#include "cuda/indexer.h"
#include "cuda/linear.h"
#include "cuda/mhc.h"
#include "cuda/moe_routing.h"
#include "cuda/norm.h"
#include "cuda/rope.h"
#include "cuda/sampling.h"

// One call per CUDA kernel family.
extern "C" void keel_register_cuda_kernels(keel::Registry& registry) {
  keel::cuda::register_embedding(registry);
  keel::cuda::register_linear(registry);
  keel::cuda::register_gemm_mma(registry);
  keel::cuda::register_gemm_fp8(registry);
  keel::cuda::register_norm(registry);
  keel::cuda::register_rope(registry);
  keel::cuda::register_attention(registry);
  keel::cuda::register_mhc(registry);
  keel::cuda::register_compressor(registry);
  keel::cuda::register_indexer(registry);
  keel::cuda::register_moe_routing(registry);
  keel::cuda::register_sampling(registry);
}
