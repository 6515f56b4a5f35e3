#include "cuda/kernels.h"

#include "cuda/linear.h"

// One call per CUDA kernel family.
extern "C" void keel_register_cuda_kernels(keel::Registry& registry) { keel::cuda::register_linear(registry); }
