// Marks a function that nvcc compiles for the host and the device alike, and a plain
// C++ compiler for the host: code shared exactly by a CPU reference and its kernel.
#pragma once

#if defined(__CUDACC__)
#define KEEL_HOST_DEVICE __host__ __device__
#else
#define KEEL_HOST_DEVICE
#endif
