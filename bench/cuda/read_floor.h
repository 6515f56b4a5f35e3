// What one kernel reading a weight can reach on this card: a plain streaming read of the
// same bytes (keel_gpu_bench's "floor" column). A one-token product is one such read
// plus its math, so this, not the copy bandwidth, bounds it launch by launch; a whole
// step can beat it only where launches overlap.
#pragma once

#include <cstddef>

// Reads `bytes` (a multiple of 16) at `data` (device memory) once, `per_multiprocessor`
// blocks of 256 threads per multiprocessor in a grid-stride loop; asynchronous.
void stream_read(const void* data, size_t bytes, int per_multiprocessor);
