// The CUDA kernels' entries in the kernel registry (plan/kernel_registry.h).
//
// Each CUDA source that defines kernels also defines a `register_<family>(Registry&)`
// beside them, adding one KernelInfo per kernel with its entry point, the exact archs it
// runs on (what its source supports, intersected with what this build compiled:
// KEEL_CUDA_ARCHS) and the formats it takes; kernels.cu calls each of them.
#pragma once

#include "plan/kernel_registry.h"

// Defined in kernels.cu, called by Registry::builtin() through a weak reference (see
// plan/kernel_registry.cpp); unmangled so CMake can name it in a link option.
extern "C" void keel_register_cuda_kernels(keel::Registry& registry);
