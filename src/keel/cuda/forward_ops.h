// The small steps of the GPU forward pass that the CPU forward pass does inline
// (model/forward.cpp): scaling, and laying out a compressor's windows
// for pool_slots. f32 / int32 in device memory, asynchronous on `stream`.
#pragma once

#include <cstdint>

namespace keel::cuda {

// One copy of a batched copy: `count` floats from src to dst (device memory).
struct CopyJob {
  float* dst;
  const float* src;
  int64_t count;
};

// Every job of `jobs` (device memory, `n` of them; none overlapping another's dst), in
// one launch: the many small row copies of a batched step (each sequence's new keys
// into its own buffers), where a cudaMemcpy each would cost a launch each.
// `longest` bounds every job's count.
void copy_batch(const CopyJob* jobs, int64_t n, int64_t longest, void* stream = nullptr);

// `bytes` from src to dst by a kernel, where src may be page-locked host memory mapped
// into the device's address space: a small host-to-device move that starts in about
// 3 us, where a DMA copy (cudaMemcpyAsync) of 2 KB takes about 10 (docs/perf.md).
// Both addresses and `bytes` are multiples of 16.
void copy_bytes(void* dst, const void* src, int64_t bytes, void* stream = nullptr);

// y[(t·group + j)·width + c] += e[t·width + c] for t < rows, j < group: a row of e added to
// each of its token's `group` rows (the MTP layer's embedding term on every stream).
void add_to_groups(float* y, const float* e, int64_t rows, int group, int64_t width, void* stream = nullptr);

// x[i] *= factor for i < count.
void scale(float* x, int64_t count, float factor, void* stream = nullptr);

// The slots of `windows` consecutive compressor windows (dsv4-forward.md §5.6, §5.7),
// from token projections kv, gate ([rows, width], gate logits without the position
// bias). Window i covers rows [first_row + i·ratio, + ratio); its slot j takes channels
// [half, half + dim) of row j, with gate bias ape[j, half + c] (half = dim for CSA's
// second series, 0 for HCA). With `previous` (CSA after the first window), the ratio
// rows before the window come first as slots [0, ratio), channels [0, dim) with bias
// ape[j, c]. values and gates are [windows, slots, dim], slots = ratio or 2·ratio.
// With `starts` (device memory, one per window), window i starts at row starts[i]
// instead: windows of several sequences gathered into one buffer.
void compressor_slots(const float* kv, const float* gate, const float* ape, int64_t width, int dim, int ratio,
                      bool overlapping, int64_t first_row, int64_t windows, bool previous, float* values,
                      float* gates, void* stream = nullptr, const int64_t* starts = nullptr);

}  // namespace keel::cuda
