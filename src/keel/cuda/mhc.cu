#include "cuda/mhc.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.cuh"

namespace keel::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
// The mix's dot products over hc·D (16384 at Flash width) are split into slices of this
// many values, one warp each: a single warp per row leaves most of the GPU idle while
// it waits on its loads, and a decode step has one token.
constexpr int64_t kMixSlice = 1024;

__host__ __device__ int64_t mix_slices(int64_t width) { return (width + kMixSlice - 1) / kMixSlice; }

// The dot product the mix is built from: row m < rows of fn with one token's flattened
// streams v, or (m == rows) v with itself, the RMS's sum of squares. One warp; every
// lane gets the sum.
__device__ float mix_dot(const float* __restrict__ fn, const float* __restrict__ v, int m, int rows, int64_t width,
                         int lane, int64_t begin, int64_t end) {
  const float* w = m < rows ? fn + int64_t{m} * width : v;
  float sum = 0.0f;
  for (int64_t i = begin + lane; i < end; i += kWarp) sum += v[i] * w[i];
  for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

// As ops/norm.cpp's rms_factor, from the sum of squares.
__device__ float rms_factor(float squares, int64_t width, float norm_eps) {
  return 1.0f / sqrtf(squares / static_cast<float>(width) + norm_eps);
}

// Step 1, block (row group, slice, token), one warp per row of fn and slice c of the
// width: dots[t, m, c] = streams[t] · fn[m] over the slice for m < rows, and
// dots[t, rows, c] = streams[t] · streams[t] over it.
__global__ void mix_dots(const float* __restrict__ fn, const float* __restrict__ streams, int rows, int64_t width,
                         float* __restrict__ dots) {
  const int m = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (m > rows) return;
  const int64_t c = blockIdx.y, slices = gridDim.y, t = blockIdx.z;
  const int64_t begin = c * kMixSlice, end = min(width, begin + kMixSlice);
  const float sum = mix_dot(fn, streams + t * width, m, rows, width, lane, begin, end);
  if (lane == 0) dots[(t * (rows + 1) + m) * slices + c] = sum;
}

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The slices' partial sums of rows 0..rows (mix_dots' output for token t) into d, one
// row per thread of the calling group, each in slice order. A row's loads are issued
// kSliceBatch at a time: one after another they would cost an L2 round trip each. The
// batch past the last slice is padded with +0, which leaves the sum (never −0) as it is.
constexpr int kSliceBatch = 16;
__device__ void sum_slices(const float* __restrict__ dots, int64_t t, int rows, int64_t width, float* d) {
  const int64_t slices = mix_slices(width);
  for (int m = threadIdx.x; m <= rows; m += blockDim.x) {
    const float* part = dots + (t * (rows + 1) + m) * slices;
    float sum = 0.0f;
    for (int64_t c = 0; c < slices; c += kSliceBatch) {
      float v[kSliceBatch];
#pragma unroll
      for (int k = 0; k < kSliceBatch; ++k) v[k] = c + k < slices ? part[c + k] : 0.0f;
#pragma unroll
      for (int k = 0; k < kSliceBatch; ++k) sum += v[k];
    }
    d[m] = sum;
  }
  __syncthreads();
}

// ops/hyper.cpp's sinkhorn on one thread, for any n ≤ kMaxHyperStreams: the matrix is
// indexed at run time, so it lives in local memory (slow, but only for hc other than 4).
__device__ void sinkhorn_serial(float* c, int n, int iters, float eps) {
  for (int i = 0; i < n; ++i) {
    float top = c[i * n];
    for (int j = 1; j < n; ++j) top = fmaxf(top, c[i * n + j]);
    float sum = 0.0f;
    for (int j = 0; j < n; ++j) sum += c[i * n + j] = expf(c[i * n + j] - top);
    for (int j = 0; j < n; ++j) c[i * n + j] = c[i * n + j] / sum + eps;
  }
  const auto columns = [&] {
    for (int j = 0; j < n; ++j) {
      float sum = 0.0f;
      for (int i = 0; i < n; ++i) sum += c[i * n + j];
      for (int i = 0; i < n; ++i) c[i * n + j] /= sum + eps;
    }
  };
  columns();
  for (int it = 1; it < iters; ++it) {
    for (int i = 0; i < n; ++i) {
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) sum += c[i * n + j];
      for (int j = 0; j < n; ++j) c[i * n + j] /= sum + eps;
    }
    columns();
  }
}

// The same Sinkhorn with one entry per lane: each group of N·N lanes holds a matrix,
// lane e entry (e / N, e % N) in a register. A row or column sum gathers its N entries
// by shuffles and adds them in the CPU's order, so every step rounds as ops/hyper.cpp
// does; a pass costs N shuffles and one division per lane instead of N·N divisions in
// series on one lane.
template <int N>
__device__ float sinkhorn_entry(float c, int e, int iters, float eps) {
  static_assert(kWarp % (N * N) == 0, "a warp holds whole matrices");
  const int i = e / N, j = e % N;
  const auto at = [](float v, int entry) { return __shfl_sync(0xffffffffu, v, entry, N * N); };
  const auto row_sum = [&](float v) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) sum += at(v, i * N + k);
    return sum;
  };
  const auto column_sum = [&](float v) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) sum += at(v, k * N + j);
    return sum;
  };
  float top = at(c, i * N);
#pragma unroll
  for (int k = 1; k < N; ++k) top = fmaxf(top, at(c, i * N + k));
  c = expf(c - top);
  c = c / row_sum(c) + eps;
  c /= column_sum(c) + eps;
  for (int it = 1; it < iters; ++it) {
    c /= row_sum(c) + eps;
    c /= column_sum(c) + eps;
  }
  return c;
}

// Step 2, one warp per token: the lanes add up the slices, then form the CPU's
// hyper_mix after the projection, in its order: pre and post one lane per stream, the
// Sinkhorn of comb with HC > 0 one lane per entry (HC² ≤ 32) and with HC == 0 (any hc,
// passed at run time) on lane 0.
template <int HC>
__global__ void mix_finish(const float* __restrict__ dots, const float* __restrict__ base,
                           const float* __restrict__ scale, int hc_arg, int64_t width, int iters, float hc_eps,
                           float norm_eps, float* __restrict__ pre, float* __restrict__ post,
                           float* __restrict__ comb) {
  const int hc = HC > 0 ? HC : hc_arg;
  __shared__ float d[(2 + kMaxHyperStreams) * kMaxHyperStreams + 1];
  const int64_t t = blockIdx.x;
  const int rows = (2 + hc) * hc, lane = threadIdx.x;
  sum_slices(dots, t, rows, width, d);
  const float r = rms_factor(d[rows], width, norm_eps);
  if (const int j = lane; j < hc) {
    pre[t * hc + j] = sigmoid(d[j] * r * scale[0] + base[j]) + hc_eps;
    post[t * hc + j] = 2.0f * sigmoid(d[hc + j] * r * scale[1] + base[hc + j]);
  }
  const auto logit = [&](int e) { return d[2 * hc + e] * r * scale[2] + base[2 * hc + e]; };
  if constexpr (HC > 0) {
    // Lanes past the first HC² work on a copy of the same matrix, unstored.
    const int e = static_cast<int>(threadIdx.x % (HC * HC));
    const float c = sinkhorn_entry<HC>(logit(e), e, iters, hc_eps);
    if (lane < HC * HC) comb[t * HC * HC + lane] = c;
  } else if (lane == 0) {
    float c[kMaxHyperStreams * kMaxHyperStreams];
    for (int e = 0; e < hc * hc; ++e) c[e] = logit(e);
    sinkhorn_serial(c, hc, iters, hc_eps);
    for (int e = 0; e < hc * hc; ++e) comb[t * hc * hc + e] = c[e];
  }
}

// Σ_j pre[j] · s[j · dim], in the CPU's order.
__device__ float collapse_one(const float* pre, const float* __restrict__ s, int hc, int64_t dim) {
  float sum = 0.0f;
  for (int j = 0; j < hc; ++j) sum += pre[j] * s[j * dim];
  return sum;
}

// One thread per (token, channel).
__global__ void collapse(const float* __restrict__ pre, const float* __restrict__ streams, int hc, int64_t dim,
                         int64_t tokens, float* __restrict__ out) {
  const int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (n >= tokens * dim) return;
  const int64_t t = n / dim, d = n % dim;
  out[n] = collapse_one(pre + t * hc, streams + t * hc * dim + d, hc, dim);
}

// hc_head after mix_dots (rows = hc): block (chunk, token) adds up the slices, forms
// pre in shared memory (each block of a token alike), then collapses the streams over
// its chunk of D, a channel per thread (one block over all of D walked it 16 loads deep
// per thread at Flash width, one round trip after another).
constexpr int kHeadThreads = 256;
__global__ void head(const float* __restrict__ dots, const float* __restrict__ base, const float* __restrict__ scale,
                     const float* __restrict__ streams, int hc, int64_t dim, float hc_eps, float norm_eps,
                     float* __restrict__ out) {
  __shared__ float d[kMaxHyperStreams + 1];
  __shared__ float pre[kMaxHyperStreams];
  const int64_t t = blockIdx.y, width = hc * dim;
  sum_slices(dots, t, hc, width, d);
  if (const int j = threadIdx.x; j < hc) {
    const float r = rms_factor(d[hc], width, norm_eps);
    pre[j] = sigmoid(d[j] * r * scale[0] + base[j]) + hc_eps;
  }
  __syncthreads();
  const int64_t c = int64_t{blockIdx.x} * kHeadThreads + threadIdx.x;
  if (c < dim) out[t * dim + c] = collapse_one(pre, streams + t * width + c, hc, dim);
}

// One thread per (token, channel): reads the hc old values first, so in place is safe.
__global__ void expand(const float* __restrict__ post, const float* __restrict__ comb, const float* __restrict__ y,
                       float* streams, int hc, int64_t dim, int64_t tokens) {
  const int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (n >= tokens * dim) return;
  const int64_t t = n / dim, d = n % dim;
  float* s = streams + t * hc * dim + d;
  float old[kMaxHyperStreams];
  for (int j = 0; j < hc; ++j) old[j] = s[j * dim];
  const float* c = comb + t * hc * hc;
  for (int k = 0; k < hc; ++k) {
    float sum = 0.0f;
    for (int j = 0; j < hc; ++j) sum += c[j * hc + k] * old[j];
    s[k * dim] = post[t * hc + k] * y[n] + sum;
  }
}

void check_params(const HyperParams& p, const char* what) {
  if (p.hc <= 0 || p.hc > kMaxHyperStreams || p.dim <= 0) {
    throw std::runtime_error(std::string(what) + ": hc " + std::to_string(p.hc) + " (at most " +
                             std::to_string(kMaxHyperStreams) + ") or dim " + std::to_string(p.dim) +
                             " out of range");
  }
}

unsigned blocks_of(int64_t n, int threads, const char* what) {
  const int64_t blocks = (n + threads - 1) / threads;
  if (blocks > 0x7fffffff) throw std::runtime_error(std::string(what) + ": too many tokens");
  return static_cast<unsigned>(blocks);
}

}  // namespace

int64_t hyper_mix_scratch(const HyperParams& p, int64_t tokens) {
  return tokens * ((2 + p.hc) * p.hc + 1) * mix_slices(p.hc * p.dim);
}

void hyper_mix(const HyperParams& p, const float* fn, const float* base, const float* scale, const float* streams,
               int64_t tokens, float* pre, float* post, float* comb, float* scratch, void* stream_ptr) {
  check_params(p, "cuda::hyper_mix");
  if (tokens <= 0) return;
  if (tokens > 65535) throw std::runtime_error("cuda::hyper_mix: more than 65535 tokens per call");
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int rows = (2 + p.hc) * p.hc;
  const dim3 grid((rows + 1 + kWarpsPerBlock - 1) / kWarpsPerBlock, static_cast<unsigned>(mix_slices(p.hc * p.dim)),
                  static_cast<unsigned>(tokens));
  mix_dots<<<grid, kWarpsPerBlock * kWarp, 0, stream>>>(fn, streams, rows, p.hc * p.dim, scratch);
  check(cudaGetLastError(), "hyper_mix launch");
  // hc 4 is every DeepSeek-V4; other hc (small test models) take the serial Sinkhorn.
  const auto finish = p.hc == 4 ? mix_finish<4> : mix_finish<0>;
  finish<<<static_cast<unsigned>(tokens), kWarp, 0, stream>>>(scratch, base, scale, p.hc, p.hc * p.dim,
                                                             p.sinkhorn_iters, p.hc_eps, p.norm_eps, pre, post, comb);
  check(cudaGetLastError(), "hyper_mix launch");
}

void hyper_collapse(const HyperParams& p, const float* pre, const float* streams, int64_t tokens, float* out,
                    void* stream) {
  check_params(p, "cuda::hyper_collapse");
  if (tokens <= 0) return;
  constexpr int kThreads = 256;
  collapse<<<blocks_of(tokens * p.dim, kThreads, "cuda::hyper_collapse"), kThreads, 0,
             static_cast<cudaStream_t>(stream)>>>(pre, streams, p.hc, p.dim, tokens, out);
  check(cudaGetLastError(), "hyper_collapse launch");
}

void hyper_expand(const HyperParams& p, const float* post, const float* comb, const float* y, float* streams,
                  int64_t tokens, void* stream) {
  check_params(p, "cuda::hyper_expand");
  if (tokens <= 0) return;
  constexpr int kThreads = 256;
  expand<<<blocks_of(tokens * p.dim, kThreads, "cuda::hyper_expand"), kThreads, 0,
           static_cast<cudaStream_t>(stream)>>>(post, comb, y, streams, p.hc, p.dim, tokens);
  check(cudaGetLastError(), "hyper_expand launch");
}

int64_t hyper_head_scratch(const HyperParams& p, int64_t tokens) {
  return tokens * (p.hc + 1) * mix_slices(p.hc * p.dim);
}

void hyper_head(const HyperParams& p, const float* fn, const float* base, const float* scale, const float* streams,
                int64_t tokens, float* out, float* scratch, void* stream_ptr) {
  check_params(p, "cuda::hyper_head");
  if (tokens <= 0) return;
  if (tokens > 65535) throw std::runtime_error("cuda::hyper_head: more than 65535 tokens per call");
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  const dim3 grid((p.hc + 1 + kWarpsPerBlock - 1) / kWarpsPerBlock, static_cast<unsigned>(mix_slices(p.hc * p.dim)),
                  static_cast<unsigned>(tokens));
  mix_dots<<<grid, kWarpsPerBlock * kWarp, 0, stream>>>(fn, streams, p.hc, p.hc * p.dim, scratch);
  check(cudaGetLastError(), "hyper_head launch");
  const dim3 chunks(blocks_of(p.dim, kHeadThreads, "cuda::hyper_head"), static_cast<unsigned>(tokens));
  head<<<chunks, kHeadThreads, 0, stream>>>(scratch, base, scale, streams, p.hc, p.dim, p.hc_eps, p.norm_eps, out);
  check(cudaGetLastError(), "hyper_head launch");
}

void register_mhc(Registry& registry) {
  KernelInfo k{.name = "cuda_mhc",
               .op = Op::mhc,
               .archs = ArchSet::gpus_from(Arch::sm_80),
               .activations = {Activation::f32},
               .priority = 1,
               .summary = "per-token mix (warp per fn row slice, lane per entry Sinkhorn at hc 4), collapse, expand"};
  registry.add(std::move(k.with_entry(&hyper_mix)));
}

}  // namespace keel::cuda
