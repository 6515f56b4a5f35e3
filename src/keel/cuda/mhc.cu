#include "cuda/mhc.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/cp_async.cuh"
#include "cuda/hyper_expand.cuh"
#include "cuda/launch.cuh"
#include "cuda/row_chunks.cuh"

namespace keel::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
// The mix's dot products over hc·D (16384 at Flash width) are split into slices of this
// many values, one warp each: a single warp per row leaves most of the GPU idle while
// it waits on its loads, and a decode step has one token.
constexpr int64_t kMixSlice = 1024;

__host__ __device__ int64_t mix_slices(int64_t width) { return (width + kMixSlice - 1) / kMixSlice; }

// The slice of the mix's width that a warp of block (row group, slice, token) takes, and
// its row m: below rows a row of fn, at rows the streams with themselves (the RMS's sum
// of squares), past it none.
struct DotSlice {
  int m;
  int64_t begin, end;
};
__device__ DotSlice dot_slice(int warps, int64_t width) {
  const int64_t begin = int64_t{blockIdx.y} * kMixSlice;
  return {static_cast<int>(blockIdx.x) * warps + static_cast<int>(threadIdx.x) / kWarp, begin,
          min(width, begin + kMixSlice)};
}

// v · w over `chunks` chunks of Width, lane taking chunks lane, lane + 32, ... in turn.
// One warp; every lane gets the sum.
template <int Width>
__device__ float warp_dot(const float* __restrict__ v, const float* __restrict__ w, int64_t chunks, int lane) {
  float sum = 0.0f;
#pragma unroll 8
  for (int64_t i = lane; i < chunks; i += kWarp) {
    const Chunk<Width> a = load<Width>(v, i), b = load<Width>(w, i);
#pragma unroll
    for (int k = 0; k < Width; ++k) sum += a.v[k] * b.v[k];
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

// dots[t, m, c]: the slice's dot product of token t's flattened streams v with w (fn's
// row m over the slice, or v itself), by one warp.
template <int Width>
__device__ void slice_dot(const DotSlice& s, const float* __restrict__ v, const float* __restrict__ w, int rows,
                          float* __restrict__ dots) {
  const float sum = warp_dot<Width>(v, w, (s.end - s.begin) / Width, threadIdx.x % kWarp);
  if (threadIdx.x % kWarp == 0) dots[(int64_t{blockIdx.z} * (rows + 1) + s.m) * gridDim.y + blockIdx.y] = sum;
}

// As ops/norm.cpp's rms_factor, from the sum of squares.
__device__ float rms_factor(float squares, int64_t width, float norm_eps) {
  return 1.0f / sqrtf(squares / static_cast<float>(width) + norm_eps);
}

// hc_head's dot products, kWarpsPerBlock rows per block.
template <int Width>
__global__ void mix_dots(const float* __restrict__ fn, const float* __restrict__ streams, int rows, int64_t width,
                         float* __restrict__ dots) {
  const DotSlice s = dot_slice(kWarpsPerBlock, width);
  if (s.m > rows) return;
  const float* v = streams + int64_t{blockIdx.z} * width + s.begin;
  slice_dot<Width>(s, v, s.m < rows ? fn + s.m * width + s.begin : v, rows, dots);
}

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The slices' partial sums of rows 0..rows (slice_dots' output for token t) into d, one
// row per thread of the block, each in slice order. The loads go to L2 (other blocks
// of the launch may have written them). A row's loads are issued kSliceBatch at a time:
// one after another they would cost an L2 round trip each. The batch past the last slice
// is padded with +0, which leaves the sum (never −0) as it is.
constexpr int kSliceBatch = 16;
__device__ void sum_slices(const float* __restrict__ dots, int64_t t, int rows, int64_t width, float* d) {
  const int64_t slices = mix_slices(width);
  for (int m = threadIdx.x; m <= rows; m += blockDim.x) {
    const float* part = dots + (t * (rows + 1) + m) * slices;
    float sum = 0.0f;
    for (int64_t c = 0; c < slices; c += kSliceBatch) {
      float v[kSliceBatch];
#pragma unroll
      for (int k = 0; k < kSliceBatch; ++k) v[k] = c + k < slices ? __ldcg(part + c + k) : 0.0f;
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

// comb for one token from its summed dots d (d[rows] the sum of squares, r its RMS
// factor) by one warp, lane = its lane: the CPU's logits, then the Sinkhorn of comb with
// HC > 0 one lane per entry (HC² ≤ 32) and with HC == 0 (any hc, passed at run time) on
// lane 0.
template <int HC>
__device__ void comb_of(const float* d, float r, const float* __restrict__ base, const float* __restrict__ scale,
                        int hc, int iters, float hc_eps, int lane, float* __restrict__ comb) {
  const auto logit = [&](int e) { return d[2 * hc + e] * r * scale[2] + base[2 * hc + e]; };
  if constexpr (HC > 0) {
    // Lanes past the first HC² work on a copy of the same matrix, unstored.
    const int e = lane % (HC * HC);
    const float c = sinkhorn_entry<HC>(logit(e), e, iters, hc_eps);
    if (lane < HC * HC) comb[lane] = c;
  } else if (lane == 0) {
    float c[kMaxHyperStreams * kMaxHyperStreams];
    for (int e = 0; e < hc * hc; ++e) c[e] = logit(e);
    sinkhorn_serial(c, hc, iters, hc_eps);
    for (int e = 0; e < hc * hc; ++e) comb[e] = c[e];
  }
}

// Σ_j pre[j] · s[j · dim] for chunk i of a token's D channels, in the CPU's order.
template <int Width>
__device__ __forceinline__ Chunk<Width> collapsed(const float* pre, const float* __restrict__ s, int hc, int64_t dim,
                                                  int64_t i) {
  Chunk<Width> x{};
  for (int j = 0; j < hc; ++j) {
    const Chunk<Width> v = load<Width>(s + j * dim, i);
#pragma unroll
    for (int k = 0; k < Width; ++k) x.v[k] += pre[j] * v.v[k];
  }
  return x;
}

// hyper_in's block: kSiteWarps warps, one fn row each for the dots; at the finish the
// first kCollapseWarps collapse and normalize while the last runs the Sinkhorn.
constexpr int kSiteWarps = 9;
constexpr int kCollapseWarps = kSiteWarps - 1;
constexpr int kCollapseThreads = kCollapseWarps * kWarp;
// The chunks of x a collapsing thread holds between its sum of squares and its output:
// D up to kHeldChunks · Width · 256 (4096 at float4, Flash's) is read once; wider rows
// read their other chunks twice. More would cost the registers the dots need.
constexpr int kHeldChunks = 4;

// x = RMSNorm(Σ_j pre[j] · streams[j]; norm) for one token, by the first kCollapseWarps
// warps of the block (thread k takes chunks k, k + kCollapseThreads, ...), as
// ops/norm.cpp: w ⊙ (x · 1 / sqrt(Σx² / D + eps)).
template <int Width>
__device__ void collapse_norm(const float* pre, const float* __restrict__ streams, int hc, int64_t dim,
                              const float* __restrict__ norm, float eps, float* __restrict__ x, float* partial) {
  const int64_t chunks = dim / Width;
  Chunk<Width> held[kHeldChunks];
  float squares = 0.0f;
#pragma unroll
  for (int h = 0; h < kHeldChunks; ++h) {
    if (const int64_t i = threadIdx.x + h * kCollapseThreads; i < chunks) {
      held[h] = collapsed<Width>(pre, streams, hc, dim, i);
      squares = add_squares(squares, held[h]);
    }
  }
  for (int64_t i = threadIdx.x + kHeldChunks * kCollapseThreads; i < chunks; i += kCollapseThreads) {
    squares = add_squares(squares, collapsed<Width>(pre, streams, hc, dim, i));
  }
  const float r = 1.0f / sqrtf(warps_sum(squares, partial, kCollapseWarps) / static_cast<float>(dim) + eps);
#pragma unroll
  for (int h = 0; h < kHeldChunks; ++h) {
    if (const int64_t i = threadIdx.x + h * kCollapseThreads; i < chunks) {
      store(x, i, scaled<true>(held[h], load<Width>(norm, i), r));
    }
  }
  for (int64_t i = threadIdx.x + kHeldChunks * kCollapseThreads; i < chunks; i += kCollapseThreads) {
    store(x, i, scaled<true>(collapsed<Width>(pre, streams, hc, dim, i), load<Width>(norm, i), r));
  }
}

// What hyper_in's kernel reads and writes (device pointers and sizes).
struct SiteLaunch {
  SiteParams site;
  SiteMix out;
  const float* streams;
  float* dots;
  unsigned* arrivals;
  int hc, iters;
  int64_t dim;
  float hc_eps, norm_eps;
  bool staged;  // each warp's slice of fn staged in the launch's dynamic shared memory
};

// The calls whose fn slices are staged in shared memory (site_in), and their bytes a block.
constexpr int64_t kStagedMaxTokens = 8;
constexpr int kStagedBytes = kSiteWarps * kMixSlice * sizeof(float);

// A warp's slice of its fn row (`chunks` chunks of Width from `row`) copied into its
// slot of shared memory, lane by lane as warp_dot reads it back (cp.async: each lane's
// own wait orders the two, with no barrier).
template <int Width>
__device__ void stage_slice(const float* __restrict__ row, int64_t chunks, int lane, float* slot) {
  for (int64_t i = lane; i < chunks; i += kWarp) {
    if constexpr (Width == 4) {
      cp_async16(slot + 4 * i, row + 4 * i);
    } else {
      cp_async4(slot + i, row + i);
    }
  }
  cp_async_commit();
}

// Asks L2 for the `count` floats at p, a 128-byte line per thread of the block.
__device__ void prefetch_l2(const float* p, int64_t count) {
  constexpr int64_t kLine = 128 / sizeof(float);
  for (int64_t i = threadIdx.x * kLine; i < count; i += int64_t{blockDim.x} * kLine) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
  }
}

// Block (row group, slice, token) computes its rows' dots over its slice (slice_dot);
// the token's last block to finish (counted in arrivals[t], which it resets) adds up
// the slices and forms pre and post, then its last warp the Sinkhorn of comb while the
// others collapse the streams and normalize the sum. At most 56 registers (4 blocks per
// SM): a call of many tokens is mostly dots, each token rereading fn from L2, and
// wants the warps in flight (72 registers left 3 blocks and made prefill's mHC 11% slower).
// The site's weights are read before wait_for_inputs (no kernel writes them), so that a
// block started early has them at hand when the streams are ready: base and scale in
// shared memory for the last block, the norm asked into L2 for it, and in a call of few
// tokens (a launch with kStagedBytes of dynamic shared memory) each warp's slice of fn in
// shared memory, so that after the wait the dots read only the streams. (Many tokens'
// blocks cannot all start early, and 36 KiB a block would halve them on a GPU of 100 KiB
// a multiprocessor.)
template <int HC, int Width>
__global__ void __launch_bounds__(kSiteWarps* kWarp, 4) site_in(const SiteLaunch a) {
  const int hc = HC > 0 ? HC : a.hc;
  const int rows = (2 + hc) * hc;
  const int64_t t = blockIdx.z, width = hc * a.dim;
  constexpr int kMixRows = (2 + kMaxHyperStreams) * kMaxHyperStreams;
  extern __shared__ __align__(16) float staged[];  // [kSiteWarps][kMixSlice] where staged
  __shared__ float base[kMixRows], scale[3];
  const DotSlice s = dot_slice(kSiteWarps, width);
  float* slot = a.staged && s.m < rows ? staged + (threadIdx.x / kWarp) * kMixSlice : nullptr;
  const float* row = a.site.fn + s.m * width + s.begin;  // of fn where s.m < rows
  if (slot) stage_slice<Width>(row, (s.end - s.begin) / Width, threadIdx.x % kWarp, slot);
  if (const int i = threadIdx.x; i < rows) base[i] = a.site.base[i];
  if (const int i = threadIdx.x - rows; i >= 0 && i < 3) scale[i] = a.site.scale[i];
  if (blockIdx.x == 0 && blockIdx.y == 0) prefetch_l2(a.site.norm, a.dim);
  let_next_start();
  wait_for_inputs();
  if (s.m <= rows) {
    const float* v = a.streams + t * width + s.begin;
    cp_async_wait<0>();
    slice_dot<Width>(s, v, slot ? slot : s.m < rows ? row : v, rows, a.dots);
  }
  __shared__ bool last;
  __threadfence();  // this block's dots before its arrival
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&a.arrivals[t], 1u) == gridDim.x * gridDim.y - 1;
  __syncthreads();
  if (!last) return;

  __shared__ float d[kMixRows + 1];
  __shared__ float pre[kMaxHyperStreams];
  __shared__ float partial[kCollapseWarps];
  if (threadIdx.x == 0) a.arrivals[t] = 0;  // ready for the next launch
  sum_slices(a.dots, t, rows, width, d);
  const float r = rms_factor(d[rows], width, a.norm_eps);
  if (const int j = threadIdx.x; j < hc) {
    pre[j] = sigmoid(d[j] * r * scale[0] + base[j]) + a.hc_eps;
    a.out.pre[t * hc + j] = pre[j];
    a.out.post[t * hc + j] = 2.0f * sigmoid(d[hc + j] * r * scale[1] + base[hc + j]);
  }
  __syncthreads();
  if (threadIdx.x / kWarp == kCollapseWarps) {
    comb_of<HC>(d, r, base, scale, hc, a.iters, a.hc_eps, threadIdx.x % kWarp, a.out.comb + t * hc * hc);
  } else {
    collapse_norm<Width>(pre, a.streams + t * width, hc, a.dim, a.site.norm, a.norm_eps, a.out.x + t * a.dim,
                         partial);
  }
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
  if (c < dim) out[t * dim + c] = collapsed<1>(pre, streams + t * width, hc, dim, c).v[0];
}

// The sublayer output a site's expand adds: a row per token.
struct RowOutput {
  const float* y;
  __device__ float operator()(int64_t t, int64_t d, int64_t dim) const { return y[t * dim + d]; }
};

// The MoE's output formed on the way, as cuda::combine_pairs rounds it: Σ_{i<k}
// weights[t·k + i] · pairs[t·k + i] (+ shared[t]).
struct PairsOutput {
  const float *pairs, *weights, *shared;
  int k;
  __device__ float operator()(int64_t t, int64_t d, int64_t dim) const {
    const float sum = pairs_sum(pairs, weights, k, t, d, dim);
    return shared ? sum + shared[t * dim + d] : sum;
  }
};

// One thread per (token, channel) (hyper_expand.cuh).
template <typename Output>
__global__ void expand(const float* __restrict__ post, const float* __restrict__ comb, const Output output,
                       float* streams, int hc, int64_t dim, int64_t tokens) {
  let_next_start();
  wait_for_inputs();
  const int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (n >= tokens * dim) return;
  const int64_t t = n / dim, d = n % dim;
  expand_channel(post + t * hc, comb + t * hc * hc, output(t, d, dim), streams + t * hc * dim + d, hc, dim);
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

template <typename Output>
void launch_expand(const HyperParams& p, const float* post, const float* comb, const Output& output, float* streams,
                   int64_t tokens, void* stream) {
  check_params(p, "cuda::hyper_expand");
  if (tokens <= 0) return;
  constexpr int kThreads = 256;
  overlapped_launch("hyper_expand launch", expand<Output>, blocks_of(tokens * p.dim, kThreads, "cuda::hyper_expand"),
                    kThreads, 0, static_cast<cudaStream_t>(stream), post, comb, output, streams, p.hc, p.dim, tokens);
}

}  // namespace

int64_t hyper_in_scratch(const HyperParams& p, int64_t tokens) {
  return tokens * ((2 + p.hc) * p.hc + 1) * mix_slices(p.hc * p.dim);
}

void hyper_in(const HyperParams& p, const SiteParams& site, const float* streams, int64_t tokens, const SiteMix& out,
              float* scratch, unsigned* arrivals, void* stream) {
  check_params(p, "cuda::hyper_in");
  if (tokens <= 0) return;
  if (tokens > 65535) throw std::runtime_error("cuda::hyper_in: more than 65535 tokens per call");
  const int rows = (2 + p.hc) * p.hc;
  const dim3 grid((rows + 1 + kSiteWarps - 1) / kSiteWarps, static_cast<unsigned>(mix_slices(p.hc * p.dim)),
                  static_cast<unsigned>(tokens));
  const bool staged = tokens <= kStagedMaxTokens;
  const SiteLaunch a{site, out, streams, scratch, arrivals, p.hc, p.sinkhorn_iters, p.dim, p.hc_eps, p.norm_eps,
                     staged};
  // hc 4 is every DeepSeek-V4; other hc (small test models) take the serial Sinkhorn.
  const bool wide = float4_rows(p.dim, {site.fn, site.norm, streams, out.x});
  const auto kernel = p.hc == 4 ? (wide ? site_in<4, 4> : site_in<4, 1>) : (wide ? site_in<0, 4> : site_in<0, 1>);
  overlapped_launch("hyper_in launch", kernel, grid, kSiteWarps * kWarp, staged ? kStagedBytes : 0,
                    static_cast<cudaStream_t>(stream), a);
}

void hyper_expand(const HyperParams& p, const float* post, const float* comb, const float* y, float* streams,
                  int64_t tokens, void* stream) {
  launch_expand(p, post, comb, RowOutput{y}, streams, tokens, stream);
}

void hyper_expand_pairs(const HyperParams& p, const float* post, const float* comb, const float* pairs,
                        const float* weights, int k, const float* shared, float* streams, int64_t tokens,
                        void* stream) {
  launch_expand(p, post, comb, PairsOutput{pairs, weights, shared, k}, streams, tokens, stream);
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
  const auto dots = float4_rows(p.dim, {fn, streams}) ? mix_dots<4> : mix_dots<1>;
  dots<<<grid, kWarpsPerBlock * kWarp, 0, stream>>>(fn, streams, p.hc, p.hc * p.dim, scratch);
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
               .summary = "a site's mix, collapse and RMSNorm in one launch (warp per fn row slice, the token's last "
                          "block finishes: lane per entry Sinkhorn at hc 4 beside the collapse), expand"};
  registry.add(std::move(k.with_entry(&hyper_in)));
}

}  // namespace keel::cuda
