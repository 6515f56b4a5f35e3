#include "cuda/kernels.h"

// One call per CUDA kernel family, added with the family's first kernel, e.g.
//   keel::cuda::register_dense_gemm(registry);   // cuda/dense_gemm.cu
extern "C" void keel_register_cuda_kernels(keel::Registry& registry) { (void)registry; }
