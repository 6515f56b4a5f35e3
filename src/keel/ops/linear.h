// y = x · Wᵀ on the CPU, over a weight in the format it is stored in (f32, bf16, f16,
// FP8 128x128 block-scaled, MXFP4, NVFP4). Each output row of W is decoded to f32 in a
// per-thread buffer right before its dot products, so a quantized model is never
// expanded in memory. Activations and accumulation are f32.
#pragma once

#include <cstdint>
#include <span>

#include "model/weights.h"

namespace keel {

// `count` rows of `cols` floats, row i at data + i * stride. `chunks`, when given, splits
// the rows into consecutive chunks of those sizes (summing to count): a batch of several
// sequences' tokens, each chunk computed exactly as a call with its rows alone would
// compute them (linear's token-count-dependent paths), so batching changes no bits.
struct ConstRows {
  const float* data = nullptr;
  int64_t count = 0;
  int64_t stride = 0;
  std::span<const int64_t> chunks = {};
  const float* row(int64_t i) const { return data + i * stride; }
};
struct Rows {
  float* data = nullptr;
  int64_t count = 0;
  int64_t stride = 0;
  float* row(int64_t i) const { return data + i * stride; }
  operator ConstRows() const { return {data, count, stride}; }
};

// Dense [count, cols] rows over a contiguous buffer.
inline ConstRows rows_of(std::span<const float> data, int64_t cols) {
  return {data.data(), static_cast<int64_t>(data.size()) / cols, cols};
}
inline Rows rows_of(std::span<float> data, int64_t cols) {
  return {data.data(), static_cast<int64_t>(data.size()) / cols, cols};
}

// Output rows [begin, begin + count) of a weight: the grouped output projection uses
// one such slice per group.
struct RowRange {
  int64_t begin = 0;
  int64_t count = -1;  // -1: to the last row
};

// Decodes row `row` of `w` (its logical [out, in] matrix) into `out` (in floats).
void decode_row(const Weight& w, int64_t row, std::span<float> out);

// y.row(t)[o] = Σ_i x.row(t)[i] · W[range.begin + o, i] for every t < x.count, x's
// chunks (if any) each as a call of its own would give them, with the weight read once.
// Parallel over output rows (OpenMP); call it from one thread.
void linear(const Weight& w, ConstRows x, Rows y, RowRange range = {});

// The same, one output row at a time through the format's reference dequantizer
// (quant/): the check for the fast decoders above.
void linear_reference(const Weight& w, ConstRows x, Rows y, RowRange range = {});

// W8A8, the numerics of DeepSeek's FP8 GEMMs (cuda/gemm_fp8.h runs them on FP8 tensor
// cores): each row of x quantized to e4m3 per 1x128 group with a power-of-two scale
// (quant/fp8_block.h's quantize_fp8_activations), then linear_reference over those
// values, each product of two exact FP8 values summed in f64.
void linear_w8a8_reference(const Weight& w, ConstRows x, Rows y, RowRange range = {});

inline int64_t out_features(const Weight& w) { return w.spec->shape[0]; }
inline int64_t in_features(const Weight& w) { return w.spec->shape[1]; }

}  // namespace keel
