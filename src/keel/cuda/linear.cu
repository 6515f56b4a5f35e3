#include "cuda/linear.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/weight_decode.cuh"
#include "plan/kernel_registry.h"

namespace keel::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kRowsPerWarp = 4;  // rows share each lane's slice of x, read once
constexpr int kRowsPerBlock = kWarpsPerBlock * kRowsPerWarp;

// The stored row is read 16 bytes per lane per step; each format says how many values
// such a chunk holds and how to add their products with x.

template <WeightFormat F, DType T>
struct Format;

template <>
struct Format<WeightFormat::f32, DType::f32> {
  static constexpr int kValues = 4;
  __device__ static float dot(const DeviceWeight&, int64_t, int64_t, uint4 c, const float* x) {
    return __uint_as_float(c.x) * x[0] + __uint_as_float(c.y) * x[1] + __uint_as_float(c.z) * x[2] +
           __uint_as_float(c.w) * x[3];
  }
};

template <>
struct Format<WeightFormat::bf16, DType::bf16> {
  static constexpr int kValues = 8;
  __device__ static float dot(const DeviceWeight&, int64_t, int64_t, uint4 c, const float* x) {
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) s += __uint_as_float(w[i] << 16) * x[2 * i] + __uint_as_float(w[i] & 0xffff0000u) * x[2 * i + 1];
    return s;
  }
};

template <>
struct Format<WeightFormat::fp8_block, DType::f8_e4m3> {
  static constexpr int kValues = 16;  // within one 128-wide scale block
  __device__ static float dot(const DeviceWeight& w, int64_t row, int64_t k, uint4 c, const float* x) {
    const float scale = fp8_block_scale(w, row, k);
    const uint32_t v[4] = {c.x, c.y, c.z, c.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) s += e4m3((v[i / 4] >> (8 * (i % 4))) & 0xffu) * x[i];
    return s * scale;
  }
};

// MXFP4 and NVFP4: 32 e2m1 values per chunk, one MX scale or two NV scales.
template <WeightFormat F>
struct Fp4 {
  static constexpr int kValues = 32;
  __device__ static float dot(const DeviceWeight& w, int64_t row, int64_t k, uint4 c, const float* x) {
    const uint32_t v[4] = {c.x, c.y, c.z, c.w};
    float half[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 32; ++i) half[i / 16] += e2m1((v[i / 8] >> (4 * (i % 8))) & 0xfu) * x[i];
    if constexpr (F == WeightFormat::mxfp4) {
      return (half[0] + half[1]) * ue8m0(w.scale[(row * w.in + k) / 32]);
    } else {
      const uint8_t* s = w.scale + (row * w.in + k) / 16;
      return (half[0] * float_of_e4m3(s[0]) + half[1] * float_of_e4m3(s[1])) * w.global_scale;
    }
  }
  __device__ static float float_of_e4m3(uint8_t b) { return e4m3(b); }
};
template <>
struct Format<WeightFormat::mxfp4, DType::i8> : Fp4<WeightFormat::mxfp4> {};
template <>
struct Format<WeightFormat::nvfp4, DType::u8> : Fp4<WeightFormat::nvfp4> {};

// Bytes per stored value, times two for fp4 (two values per byte).
template <WeightFormat F, DType T>
__host__ __device__ constexpr int64_t row_bytes(int64_t in) {
  if constexpr (F == WeightFormat::mxfp4 || F == WeightFormat::nvfp4) return in / 2;
  if constexpr (T == DType::f32) return in * 4;
  if constexpr (T == DType::bf16) return in * 2;
  return in;
}

// A warp computes up to kRowsPerWarp output rows from `first` for one row of x: lanes
// stride over 16-byte chunks of the rows, keep the matching slice of x in registers for
// all of them, sum in f32, then reduce across the warp. Needs in % kValues == 0.
template <WeightFormat F, DType T>
__device__ __forceinline__ void warp_rows(const DeviceWeight& w, int64_t first, int lane, const float* __restrict__ xt,
                                          float* __restrict__ yt) {
  using Fmt = Format<F, T>;
  constexpr int V = Fmt::kValues;
  const int rows = static_cast<int>(min(int64_t{kRowsPerWarp}, w.out - first));
  const auto* base = static_cast<const uint8_t*>(w.data);
  const int64_t n = w.in / V, stride = row_bytes<F, T>(w.in);
  float sum[kRowsPerWarp] = {};
  for (int64_t c = lane; c < n; c += kWarp) {
    float xs[V];
#pragma unroll
    for (int i = 0; i < V; i += 4) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(xt + c * V + i));
      xs[i] = v.x, xs[i + 1] = v.y, xs[i + 2] = v.z, xs[i + 3] = v.w;
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (r < rows) {
        const uint4 chunk = __ldg(reinterpret_cast<const uint4*>(base + (first + r) * stride) + c);
        sum[r] += Fmt::dot(w, first + r, c * V, chunk, xs);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], offset);
    if (lane == 0 && r < rows) yt[first + r] = sum[r];
  }
}

// Any in_features (small test models, odd low-rank widths): a warp per row, lanes over
// single values. Not a fast path; shapes of real models take warp_rows.
template <WeightFormat F, DType T>
__device__ __forceinline__ void warp_row_any_width(const DeviceWeight& w, int64_t row, int lane, const float* xt,
                                                   float* yt) {
  float sum = 0.0f;
  for (int64_t k = lane; k < w.in; k += kWarp) sum += weight_value<F, T>(w, row, k) * xt[k];
  for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) yt[row] = sum;
}

// The first output row of this warp: chunked kernels give a warp kRowsPerWarp rows.
template <bool kChunked>
__device__ __forceinline__ int64_t warp_first_row() {
  const int64_t warp = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarp;
  return kChunked ? warp * kRowsPerWarp : warp;
}

template <WeightFormat F, DType T, bool kChunked>
__device__ __forceinline__ void warp_product(const DeviceWeight& w, int64_t first, const float* xt, float* yt) {
  const int lane = threadIdx.x % kWarp;
  if constexpr (kChunked) {
    warp_rows<F, T>(w, first, lane, xt, yt);
  } else {
    warp_row_any_width<F, T>(w, first, lane, xt, yt);
  }
}

template <WeightFormat F, DType T, bool kChunked>
__global__ void gemv(DeviceWeight w, const float* __restrict__ x, float* __restrict__ y, int64_t tokens) {
  const int64_t first = warp_first_row<kChunked>();
  if (first >= w.out) return;
  for (int64_t t = 0; t < tokens; ++t) warp_product<F, T, kChunked>(w, first, x + t * w.in, y + t * w.out);
}

// Pair p (blockIdx.y) multiplies x row p / per_row by the weight of expert experts[p];
// a negative expert or a weight without data (another rank's) gives zeros.
template <WeightFormat F, DType T, bool kChunked>
__global__ void gemv_pairs(const DeviceWeight* __restrict__ table, int64_t out, const int32_t* __restrict__ experts,
                           int per_row, const float* __restrict__ x, float* __restrict__ y) {
  const int64_t first = warp_first_row<kChunked>();
  if (first >= out) return;
  const int64_t p = blockIdx.y;
  const int32_t e = experts[p];
  float* yp = y + p * out;
  if (e < 0 || table[e].data == nullptr) {
    const int lane = threadIdx.x % kWarp;
    const int rows = kChunked ? static_cast<int>(min(int64_t{kRowsPerWarp}, out - first)) : 1;
    if (lane < rows) yp[first + lane] = 0.0f;
    return;
  }
  const DeviceWeight w = table[e];
  warp_product<F, T, kChunked>(w, first, x + (p / per_row) * w.in, yp);
}

// Whether gemv can read 16-byte chunks of rows and x: whole chunks per row, aligned
// rows and x (weights from upload() start 256-byte aligned).
template <WeightFormat F, DType T>
bool chunked(int64_t in, const float* x, const void* data) {
  return in % Format<F, T>::kValues == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(data) % 16 == 0;
}

unsigned row_blocks(int64_t out, bool chunked) {
  const int64_t rows = chunked ? kRowsPerBlock : kWarpsPerBlock;
  return static_cast<unsigned>((out + rows - 1) / rows);
}

template <WeightFormat F, DType T>
void launch(const DeviceWeight& w, const float* x, float* y, int64_t tokens, cudaStream_t stream) {
  if (chunked<F, T>(w.in, x, w.data)) {
    gemv<F, T, true><<<row_blocks(w.out, true), kWarpsPerBlock * kWarp, 0, stream>>>(w, x, y, tokens);
  } else {
    gemv<F, T, false><<<row_blocks(w.out, false), kWarpsPerBlock * kWarp, 0, stream>>>(w, x, y, tokens);
  }
  check(cudaGetLastError(), "gemv launch");
}

template <WeightFormat F, DType T>
void launch_pairs(const DeviceWeight* table, const DeviceWeight& like, const int32_t* experts, int64_t pairs,
                  int per_row, const float* x, float* y, cudaStream_t stream) {
  if (pairs > 65535) throw std::runtime_error("cuda::linear_pairs: more than 65535 pairs in one call");
  const bool whole = chunked<F, T>(like.in, x, like.data);
  const dim3 grid(row_blocks(like.out, whole), static_cast<unsigned>(pairs));
  if (whole) {
    gemv_pairs<F, T, true><<<grid, kWarpsPerBlock * kWarp, 0, stream>>>(table, like.out, experts, per_row, x, y);
  } else {
    gemv_pairs<F, T, false><<<grid, kWarpsPerBlock * kWarp, 0, stream>>>(table, like.out, experts, per_row, x, y);
  }
  check(cudaGetLastError(), "gemv_pairs launch");
}

// Calls fn.template operator()<F, T>() for the weight's format and stored dtype.
template <typename Fn>
void dispatch(const DeviceWeight& w, Fn&& fn) {
  switch (w.format) {
    case WeightFormat::f32:
    case WeightFormat::bf16:
      if (w.dtype == DType::f32) return fn.template operator()<WeightFormat::f32, DType::f32>();
      if (w.dtype == DType::bf16) return fn.template operator()<WeightFormat::bf16, DType::bf16>();
      break;
    case WeightFormat::fp8_block: return fn.template operator()<WeightFormat::fp8_block, DType::f8_e4m3>();
    case WeightFormat::mxfp4: return fn.template operator()<WeightFormat::mxfp4, DType::i8>();
    case WeightFormat::nvfp4: return fn.template operator()<WeightFormat::nvfp4, DType::u8>();
  }
  throw std::runtime_error("cuda::linear: no kernel for this weight dtype");
}

}  // namespace

DeviceWeight upload(const Weight& w) {
  DeviceWeight d;
  d.format = w.format;
  d.dtype = w.data.dtype;
  d.out = w.spec->shape[0];
  d.in = w.spec->shape[1];
  d.global_scale = w.global_scale;
  d.f32_scales = w.scale_format == ScaleFormat::f32;
  void* data = nullptr;
  check(cudaMalloc(&data, w.data.nbytes()), "cudaMalloc");
  check(cudaMemcpy(data, w.data.data, w.data.nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
  d.data = data;
  d.bytes = w.data.nbytes();
  if (w.scale.data) {
    void* scale = nullptr;
    check(cudaMalloc(&scale, w.scale.nbytes()), "cudaMalloc");
    check(cudaMemcpy(scale, w.scale.data, w.scale.nbytes(), cudaMemcpyHostToDevice), "cudaMemcpy");
    d.scale = static_cast<const uint8_t*>(scale);
    d.scale_cols = w.scale.shape.size() > 1 ? w.scale.shape[1] : 0;
    d.bytes += w.scale.nbytes();
  }
  return d;
}

void release(DeviceWeight& w) {
  cudaFree(const_cast<void*>(w.data));
  cudaFree(const_cast<uint8_t*>(w.scale));
  w = {};
}

void linear(const DeviceWeight& w, const float* x, float* y, int64_t tokens, void* stream_ptr) {
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch(w, [&]<WeightFormat F, DType T>() { launch<F, T>(w, x, y, tokens, stream); });
}

void linear_pairs(const DeviceWeight* table, const DeviceWeight& like, const int32_t* experts, int64_t pairs,
                  int per_row, const float* x, float* y, void* stream_ptr) {
  if (pairs <= 0) return;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch(like, [&]<WeightFormat F, DType T>() { launch_pairs<F, T>(table, like, experts, pairs, per_row, x, y, stream); });
}

void register_linear(Registry& registry) {
  // Plain CUDA, no arch-specific instructions: the build's sm_80 code (SASS, and PTX
  // that newer GPUs compile at load) runs on every supported GPU.
  const auto gemv = [&](Op op) {
    KernelInfo k{.name = "cuda_gemv",
                 .op = op,
                 .archs = ArchSet::gpus_from(Arch::sm_80),
                 .formats = {WeightFormat::bf16, WeightFormat::f32, WeightFormat::fp8_block, WeightFormat::mxfp4,
                             WeightFormat::nvfp4},
                 .activations = {Activation::f32},
                 .priority = 1,
                 .summary = "decode GEMV, one warp per 4 rows, weights dequantized in registers"};
    registry.add(std::move(k.with_entry(&linear)));
  };
  gemv(Op::dense_gemm);
  gemv(Op::lm_head);
  KernelInfo pairs{.name = "cuda_gemv_pairs",
                   .op = Op::moe_gemm,
                   .archs = ArchSet::gpus_from(Arch::sm_80),
                   .formats = {WeightFormat::bf16, WeightFormat::f32, WeightFormat::fp8_block, WeightFormat::mxfp4,
                               WeightFormat::nvfp4},
                   .activations = {Activation::f32},
                   .priority = 1,
                   .summary = "decode GEMV per (token, routed expert) pair, experts read on the device (no host sync)"};
  registry.add(std::move(pairs.with_entry(&linear_pairs)));
}

}  // namespace keel::cuda
