#include "cuda/linear.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/check.cuh"
#include "cuda/weight_decode.cuh"
#include "plan/kernel_registry.h"

namespace keel::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * kWarp;
constexpr int kTokenTile = 8;  // tokens that share each decoded weight chunk

// The stored row is read 16 bytes per lane per step. Each format says how many values
// such a chunk holds (kValues), decodes them without their scale (decode), finds the
// scale that applies at (row, k) (scale), and adds the chunk's products with x to a
// running sum (add_dot), in the order the kernels have always summed. add_dot spells
// out every rounding (the compiler never contracts the _rn intrinsics into other
// operations), so a row's sum takes the same operations whichever kernel, tile size or
// place in a tile computes it: a token's output does not depend on the other tokens of
// the call.

struct NoScale {};

template <WeightFormat F, DType T>
struct Format;

template <>
struct Format<WeightFormat::f32, DType::f32> {
  static constexpr int kValues = 4;
  using Scale = NoScale;
  __device__ static void decode(uint4 c, float v[kValues]) {
    v[0] = __uint_as_float(c.x), v[1] = __uint_as_float(c.y), v[2] = __uint_as_float(c.z), v[3] = __uint_as_float(c.w);
  }
  __device__ static Scale scale(const DeviceWeight&, int64_t, int64_t) { return {}; }
  // ((v0·x0 + v1·x1) + v2·x2) + v3·x3, then onto the sum.
  __device__ static float add_dot(float sum, const float* v, const float* x, Scale) {
    float s = __fmaf_rn(v[0], x[0], __fmul_rn(v[1], x[1]));
    s = __fmaf_rn(v[2], x[2], s);
    s = __fmaf_rn(v[3], x[3], s);
    return __fadd_rn(sum, s);
  }
};

template <>
struct Format<WeightFormat::bf16, DType::bf16> {
  static constexpr int kValues = 8;
  using Scale = NoScale;
  __device__ static void decode(uint4 c, float v[kValues]) {
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ static Scale scale(const DeviceWeight&, int64_t, int64_t) { return {}; }
  // Pairs (v0·x0 + v1·x1), (v2·x2 + v3·x3), ... summed in order, then onto the sum.
  __device__ static float add_dot(float sum, const float* v, const float* x, Scale) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kValues; i += 2) s = __fadd_rn(s, __fmaf_rn(v[i], x[i], __fmul_rn(v[i + 1], x[i + 1])));
    return __fadd_rn(sum, s);
  }
};

template <>
struct Format<WeightFormat::fp8_block, DType::f8_e4m3> {
  static constexpr int kValues = 16;  // within one 128-wide scale block
  using Scale = float;
  __device__ static void decode(uint4 c, float v[kValues]) {
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < kValues; ++i) v[i] = e4m3((w[i / 4] >> (8 * (i % 4))) & 0xffu);
  }
  __device__ static Scale scale(const DeviceWeight& w, int64_t row, int64_t k) { return fp8_block_scale(w, row, k); }
  // Σ v_i·x_i in i order, then times the block scale onto the sum.
  __device__ static float add_dot(float sum, const float* v, const float* x, Scale scale) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kValues; ++i) s = __fmaf_rn(v[i], x[i], s);
    return __fmaf_rn(s, scale, sum);
  }
};

// MXFP4 and NVFP4: 32 e2m1 values per chunk, summed as two halves of 16 in i order,
// combined under one MX scale or two NV block scales and the global scale.
struct NvScales {
  float first, second, global;
};
template <WeightFormat F>
struct Fp4 {
  static constexpr int kValues = 32;
  using Scale = std::conditional_t<F == WeightFormat::mxfp4, float, NvScales>;
  __device__ static void decode(uint4 c, float v[kValues]) {
    const uint32_t w[4] = {unpack_fp4_word(c.x), unpack_fp4_word(c.y), unpack_fp4_word(c.z), unpack_fp4_word(c.w)};
#pragma unroll
    for (int i = 0; i < kValues; ++i) v[i] = e2m1((w[i / 8] >> (4 * (i % 8))) & 0xfu);
  }
  __device__ static Scale scale(const DeviceWeight& w, int64_t row, int64_t k) {
    if constexpr (F == WeightFormat::mxfp4) {
      return ue8m0(w.scale[(row * w.in + k) / 32]);
    } else {
      const uint8_t* s = w.scale + (row * w.in + k) / 16;
      return {e4m3(s[0]), e4m3(s[1]), w.global_scale};
    }
  }
  __device__ static float add_dot(float sum, const float* v, const float* x, Scale scale) {
    float half[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kValues; ++i) half[i / 16] = __fmaf_rn(v[i], x[i], half[i / 16]);
    if constexpr (F == WeightFormat::mxfp4) {
      return __fmaf_rn(__fadd_rn(half[0], half[1]), scale, sum);
    } else {
      return __fmaf_rn(__fmaf_rn(half[0], scale.first, __fmul_rn(half[1], scale.second)), scale.global, sum);
    }
  }
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

// Rows per warp of the chunked kernels. One token takes 4, which share each lane's
// slice of x. A tile of tokens keeps its rows' decoded chunks in registers while the
// tokens pass; 32 values per lane (4 rows of bf16, 2 of FP8, 1 of FP4) stay under 128
// registers, two blocks per SM. A row's sums do not depend on it: lanes split every row
// alike.
template <WeightFormat F, DType T, int kTile>
constexpr int kRowsPerWarp = kTile == 1 ? 4 : std::min(4, 32 / Format<F, T>::kValues);

// A warp computes up to kRows output rows from `first` for `tokens` ≤ kTile rows of x
// (at least one): lanes stride over 16-byte chunks of the rows; each chunk is read and
// decoded once, then multiplied with the matching slice of each token's x; sums in f32,
// then a reduction across the warp. Needs in % kValues == 0.
template <WeightFormat F, DType T, int kTile, int kRows = kRowsPerWarp<F, T, kTile>>
__device__ __forceinline__ void warp_rows(const DeviceWeight& w, int64_t first, int lane, const float* __restrict__ x,
                                          float* __restrict__ y, int tokens) {
  using Fmt = Format<F, T>;
  constexpr int V = Fmt::kValues;
  const int rows = static_cast<int>(min(int64_t{kRows}, w.out - first));
  const auto* base = static_cast<const uint8_t*>(w.data);
  const int64_t n = w.in / V, stride = row_bytes<F, T>(w.in);
  float sum[kTile][kRows] = {};
  for (int64_t c = lane; c < n; c += kWarp) {
    float v[kRows][V];  // the rows' chunks, decoded on the first token's pass
    typename Fmt::Scale s[kRows];
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (t > 0 && t >= tokens) break;  // a tile has a token: no test for the first
      float xs[V];
#pragma unroll
      for (int i = 0; i < V; i += 4) {
        const float4 q = __ldg(reinterpret_cast<const float4*>(x + t * w.in + c * V + i));
        xs[i] = q.x, xs[i + 1] = q.y, xs[i + 2] = q.z, xs[i + 3] = q.w;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (t == 0) {
          // Rows past the matrix's end (in its last warp) read its last row again, never stored.
          const int64_t row = first + min(r, rows - 1);
          Fmt::decode(__ldg(reinterpret_cast<const uint4*>(base + row * stride) + c), v[r]);
          s[r] = Fmt::scale(w, row, c * V);
        }
        sum[t][r] = Fmt::add_dot(sum[t][r], v[r], xs, s[r]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kTile; ++t) {
    if (t < tokens) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
#pragma unroll
        for (int offset = kWarp / 2; offset > 0; offset /= 2) {
          sum[t][r] += __shfl_xor_sync(0xffffffffu, sum[t][r], offset);
        }
        if (lane == 0 && r < rows) y[t * w.out + first + r] = sum[t][r];
      }
    }
  }
}

// Any in_features (small test models, odd low-rank widths): a warp per row, lanes over
// single values, one token at a time. Not a fast path; shapes of real models take
// warp_rows.
template <WeightFormat F, DType T>
__device__ __forceinline__ void warp_row_any_width(const DeviceWeight& w, int64_t row, int lane, const float* xt,
                                                   float* yt) {
  float sum = 0.0f;
  for (int64_t k = lane; k < w.in; k += kWarp) sum += weight_value<F, T>(w, row, k) * xt[k];
  for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) yt[row] = sum;
}

// This thread's warp counted over the grid, row block `block` holding kWarpsPerBlock.
__device__ __forceinline__ int64_t warp_index(int64_t block) { return block * kWarpsPerBlock + threadIdx.x / kWarp; }

// A block per (row block, tile of up to kTile tokens). The tiles of a row block are
// adjacent in launch order, so they run together and read the block's rows from memory
// about once between them (the rest from L2), even for weights larger than L2.
template <WeightFormat F, DType T, int kTile>
__global__ void gemv_tiles(DeviceWeight w, const float* __restrict__ x, float* __restrict__ y, int64_t tokens,
                           unsigned tiles) {
  const int64_t first = warp_index(blockIdx.x / tiles) * kRowsPerWarp<F, T, kTile>;
  if (first >= w.out) return;
  const int64_t t0 = int64_t{blockIdx.x % tiles} * kTile;
  warp_rows<F, T, kTile>(w, first, threadIdx.x % kWarp, x + t0 * w.in, y + t0 * w.out,
                         static_cast<int>(min(int64_t{kTile}, tokens - t0)));
}

template <WeightFormat F, DType T>
__global__ void gemv_any_width(DeviceWeight w, const float* __restrict__ x, float* __restrict__ y, int64_t tokens) {
  const int64_t row = warp_index(blockIdx.x);
  if (row >= w.out) return;
  const int lane = threadIdx.x % kWarp;
  for (int64_t t = 0; t < tokens; ++t) warp_row_any_width<F, T>(w, row, lane, x + t * w.in, y + t * w.out);
}

// Pair p (blockIdx.y) multiplies x row p / per_row by the weight of expert experts[p];
// a negative expert or a weight without data (another rank's) gives zeros. A pair is a
// one-token product, computed as linear() computes one token. Its weight's fields live
// in registers (they come from device memory, not kernel parameters); the bounds hold
// it to 3 blocks per SM for FP8 and FP4 and 4 for f32 and bf16 (ptxas left alone
// takes more registers for NVFP4 than 3 blocks allow).
template <WeightFormat F, DType T, bool kChunked>
__global__ void __launch_bounds__(kThreads, Format<F, T>::kValues >= 16 ? 3 : 4)
    gemv_pairs(const DeviceWeight* __restrict__ table, int64_t out, const int32_t* __restrict__ experts, int per_row,
               const float* __restrict__ x, float* __restrict__ y) {
  constexpr int kRows = kChunked ? kRowsPerWarp<F, T, 1> : 1;
  const int64_t first = warp_index(blockIdx.x) * kRows;
  if (first >= out) return;
  const int64_t p = blockIdx.y;
  const int32_t e = experts[p];
  const int lane = threadIdx.x % kWarp;
  float* yp = y + p * out;
  if (e < 0 || table[e].data == nullptr) {
    if (lane < min(int64_t{kRows}, out - first)) yp[first + lane] = 0.0f;
    return;
  }
  const DeviceWeight w = table[e];
  const float* xp = x + (p / per_row) * w.in;
  if constexpr (kChunked) {
    warp_rows<F, T, 1>(w, first, lane, xp, yp, 1);
  } else {
    warp_row_any_width<F, T>(w, first, lane, xp, yp);
  }
}

// Whether the kernels can read 16-byte chunks of rows and x: whole chunks per row,
// aligned rows and x (weights from upload() start 256-byte aligned).
template <WeightFormat F, DType T>
bool chunked(int64_t in, const float* x, const void* data) {
  return in % Format<F, T>::kValues == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(data) % 16 == 0;
}

// Blocks of kWarpsPerBlock warps of `rows_per_warp` rows each over `out` rows.
int64_t row_blocks(int64_t out, int rows_per_warp) {
  const int64_t rows = int64_t{kWarpsPerBlock} * rows_per_warp;
  return (out + rows - 1) / rows;
}

// A tile of tokens on the chunked kernel; a single token takes a tile of one, which
// holds no registers for tokens it does not have.
template <WeightFormat F, DType T, int kTile>
void launch_tiles(const DeviceWeight& w, const float* x, float* y, int64_t tokens, cudaStream_t stream) {
  const int64_t tiles = (tokens + kTile - 1) / kTile;
  const int64_t blocks = row_blocks(w.out, kRowsPerWarp<F, T, kTile>) * tiles;
  if (blocks > INT_MAX) throw std::runtime_error("cuda::linear: " + std::to_string(tokens) + " tokens in one call");
  gemv_tiles<F, T, kTile><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(w, x, y, tokens,
                                                                                  static_cast<unsigned>(tiles));
}

template <WeightFormat F, DType T>
void launch(const DeviceWeight& w, const float* x, float* y, int64_t tokens, cudaStream_t stream) {
  if (tokens <= 0) return;
  if (!chunked<F, T>(w.in, x, w.data)) {
    gemv_any_width<F, T><<<static_cast<unsigned>(row_blocks(w.out, 1)), kThreads, 0, stream>>>(w, x, y, tokens);
  } else if (tokens == 1) {
    launch_tiles<F, T, 1>(w, x, y, tokens, stream);
  } else {
    launch_tiles<F, T, kTokenTile>(w, x, y, tokens, stream);
  }
  check(cudaGetLastError(), "gemv launch");
}

template <WeightFormat F, DType T>
void launch_pairs(const DeviceWeight* table, const DeviceWeight& like, const int32_t* experts, int64_t pairs,
                  int per_row, const float* x, float* y, cudaStream_t stream) {
  if (pairs > 65535) throw std::runtime_error("cuda::linear_pairs: more than 65535 pairs in one call");
  const bool whole = chunked<F, T>(like.in, x, like.data);
  const dim3 grid(static_cast<unsigned>(row_blocks(like.out, whole ? kRowsPerWarp<F, T, 1> : 1)),
                  static_cast<unsigned>(pairs));
  if (whole) {
    gemv_pairs<F, T, true><<<grid, kThreads, 0, stream>>>(table, like.out, experts, per_row, x, y);
  } else {
    gemv_pairs<F, T, false><<<grid, kThreads, 0, stream>>>(table, like.out, experts, per_row, x, y);
  }
  check(cudaGetLastError(), "gemv_pairs launch");
}

// FP4 codes packed in place (fp4_words.h), a word per thread.
__global__ void pack_fp4_kernel(uint32_t* words, int64_t n) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < n) words[i] = pack_fp4_word(words[i]);
}

void pack_fp4(void* data, uint64_t bytes) {
  // Whole words always: an MX row is blocks of 32 values, an NVFP4 row of 16.
  if (bytes % 4 != 0) throw std::runtime_error("cuda::upload: FP4 codes that are not whole 32-bit words");
  const int64_t words = static_cast<int64_t>(bytes / 4);
  if (words == 0) return;
  pack_fp4_kernel<<<static_cast<unsigned>((words + 255) / 256), 256>>>(static_cast<uint32_t*>(data), words);
  check(cudaGetLastError(), "pack_fp4 launch");
  check(cudaDeviceSynchronize(), "pack_fp4");  // before any stream that does not wait for the default one
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
  if (w.format == WeightFormat::mxfp4 || w.format == WeightFormat::nvfp4) pack_fp4(data, w.data.nbytes());
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
  dispatch(w, "cuda::linear", [&]<WeightFormat F, DType T>() {
    if constexpr (T == DType::f16) {
      throw std::runtime_error("cuda::linear: no kernel for f16 weights");  // f16 stores embedding tables only
    } else {
      launch<F, T>(w, x, y, tokens, stream);
    }
  });
}

void linear_pairs(const DeviceWeight* table, int /*n_table*/, const DeviceWeight& like, const int32_t* experts,
                  int64_t pairs, int per_row, const float* x, float* y, int32_t* /*scratch*/, void* stream_ptr,
                  ExpertIds /*ids*/) {
  if (pairs <= 0) return;
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch(like, "cuda::linear_pairs", [&]<WeightFormat F, DType T>() {
    if constexpr (T == DType::f16) {
      throw std::runtime_error("cuda::linear_pairs: no kernel for f16 weights");
    } else {
      launch_pairs<F, T>(table, like, experts, pairs, per_row, x, y, stream);
    }
  });
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
                 .summary = "decode GEMV, weights dequantized in registers once per tile of up to 8 tokens"};
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
