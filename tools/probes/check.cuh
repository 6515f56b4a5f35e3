// What the probes share: CK(call) prints the failing CUDA call and its error, and exits.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                             \
  do {                                                                    \
    const cudaError_t ck_status = (x);                                    \
    if (ck_status != cudaSuccess) {                                       \
      std::printf("%s: %s\n", #x, cudaGetErrorString(ck_status));         \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)
