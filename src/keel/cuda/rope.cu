#include "cuda/rope.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/launch.cuh"
#include "cuda/norm.h"
#include "cuda/row_chunks.cuh"

namespace keel::cuda {
namespace {

// (a, b) rotated by the angle float(position) · inv_freq (by its negative with sign -1).
__device__ __forceinline__ void rotate_pair(float& a, float& b, int64_t position, float inv_freq, float sign) {
  const float angle = static_cast<float>(position) * inv_freq;  // f32, as the CPU
  float s, c;
  sincosf(angle, &s, &c);
  s *= sign;
  const float x = a, y = b;
  a = x * c - y * s;
  b = x * s + y * c;
}

// One thread per rotated pair: index = ((token · heads) + head) · half + i.
__global__ void rotate(const float* __restrict__ inv_freq, float* x, int64_t pairs, int half, int head_dim,
                       int heads, const int64_t* __restrict__ positions, float sign) {
  const int64_t n = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  const int i = static_cast<int>(n % half);
  const float frequency = n < pairs ? inv_freq[i] : 0.0f;  // before the wait: no kernel writes it
  let_next_start();
  wait_for_inputs();
  if (n >= pairs) return;
  const int64_t row = n / half;  // token · heads + head
  const int64_t token = row / heads;
  float* p = x + row * head_dim + (head_dim - 2 * half) + 2 * i;
  rotate_pair(p[0], p[1], positions[token], frequency, sign);
}

// The pieces of one norm_rotate launch: piece p's rows are blocks [first[p], first[p + 1]).
struct NormRopeLaunch {
  NormRopePiece piece[kMaxNormRopePieces];
  int64_t first[kMaxNormRopePieces + 1];
  int count;
};

// One block per row (token · heads + head of its piece) of head_dim floats, a float4
// chunk per thread (threads past the row hold zeros): the row's RMSNorm (by the piece's
// weight, else by 1, the same bits as none: w · (x · r) is x · r when w = 1), then the
// rotation of each pair (2i, 2i+1) from rope_start on, the pair inside the thread's
// chunk (rope_start even).
__global__ void __launch_bounds__(1024)
    norm_rotate(const float* __restrict__ inv_freq, const __grid_constant__ NormRopeLaunch a, float eps, int head_dim,
                int rope_start, const int64_t* __restrict__ positions) {
  __shared__ float partial[32];
  int p = 0;
  while (p + 1 < a.count && int64_t{blockIdx.x} >= a.first[p + 1]) ++p;
  const NormRopePiece& piece = a.piece[p];
  const int64_t row = blockIdx.x - a.first[p], token = row / piece.heads;
  const int chunk = threadIdx.x, first = 4 * chunk;
  const bool inside = first < head_dim;
  // The weight and the pairs' frequencies before the wait: no kernel writes them, and a
  // block started early has them at hand when x is ready.
  Chunk<4> v{}, w{};
  float frequency[2] = {};
  if (inside) {
    w = piece.weight ? load<4>(piece.weight, chunk) : Chunk<4>{{1.0f, 1.0f, 1.0f, 1.0f}};
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      if (const int c = first + 2 * q; c >= rope_start) frequency[q] = inv_freq[(c - rope_start) / 2];
    }
  }
  let_next_start();
  wait_for_inputs();
  float* xr = piece.x + row * head_dim;
  if (inside) v = load<4>(xr, chunk);
  const float squares = warps_sum(add_squares(0.0f, v), partial, static_cast<int>(blockDim.x) / kWarp);
  if (!inside) return;
  v = scaled<true>(v, w, 1.0f / sqrtf(squares / static_cast<float>(head_dim) + eps));
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    if (const int c = first + 2 * q; c >= rope_start) {
      rotate_pair(v.v[2 * q], v.v[2 * q + 1], positions[token], frequency[q], 1.0f);
    }
  }
  store(xr, chunk, v);
}

}  // namespace

DeviceRope upload(const Rope& rope) {
  DeviceRope d;
  d.rope_dim = rope.rope_dim();
  const size_t bytes = rope.inv_freq().size() * sizeof(float);
  void* p = nullptr;
  check(cudaMalloc(&p, bytes > 0 ? bytes : sizeof(float)), "cudaMalloc");
  if (bytes > 0) check(cudaMemcpy(p, rope.inv_freq().data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  d.inv_freq = static_cast<const float*>(p);
  return d;
}

void release(DeviceRope& rope) {
  cudaFree(const_cast<float*>(rope.inv_freq));
  rope = {};
}

void rope(const DeviceRope& r, float* x, int64_t tokens, int heads, int head_dim, const int64_t* positions,
          bool inverse, void* stream) {
  if (r.rope_dim % 2 != 0 || r.rope_dim > head_dim) {
    throw std::runtime_error("cuda::rope: rope_dim " + std::to_string(r.rope_dim) + " does not fit head_dim " +
                             std::to_string(head_dim) + " in pairs");
  }
  const int half = r.rope_dim / 2;
  const int64_t pairs = tokens * heads * half;
  if (pairs <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (pairs + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) throw std::runtime_error("cuda::rope: too many rows");
  overlapped_launch("rope launch", rotate, static_cast<unsigned>(blocks), kThreads, 0,
                    static_cast<cudaStream_t>(stream), r.inv_freq, x, pairs, half, head_dim, heads, positions,
                    inverse ? -1.0f : 1.0f);
}

void norm_rope(const DeviceRope& r, float* x, int64_t tokens, int heads, int head_dim, const float* weight, float eps,
               const int64_t* positions, void* stream) {
  const NormRopePiece piece{x, heads, weight};
  norm_rope(r, std::span<const NormRopePiece>(&piece, 1), tokens, head_dim, eps, positions, stream);
}

void norm_rope(const DeviceRope& r, std::span<const NormRopePiece> pieces, int64_t tokens, int head_dim, float eps,
               const int64_t* positions, void* stream) {
  if (r.rope_dim % 2 != 0 || r.rope_dim > head_dim) {
    throw std::runtime_error("cuda::norm_rope: rope_dim " + std::to_string(r.rope_dim) + " does not fit head_dim " +
                             std::to_string(head_dim) + " in pairs");
  }
  if (pieces.size() > kMaxNormRopePieces) {
    throw std::runtime_error("cuda::norm_rope: more than " + std::to_string(kMaxNormRopePieces) + " pieces");
  }
  NormRopeLaunch a{};
  for (const NormRopePiece& piece : pieces) {
    const int64_t rows = tokens * piece.heads;
    if (rows <= 0) continue;
    // weight may be null
    if (head_dim <= 4 * 1024 && float4_rows(head_dim, {piece.x, piece.weight})) {
      a.piece[a.count] = piece;
      a.first[a.count + 1] = a.first[a.count] + rows;
      ++a.count;
    } else {  // rows of single floats, or longer than a block: the two kernels
      if (piece.weight) {
        rms_norm(piece.x, piece.weight, eps, piece.x, rows, head_dim, stream);
      } else {
        rms_norm_unweighted(piece.x, eps, rows, head_dim, stream);
      }
      rope(r, piece.x, tokens, piece.heads, head_dim, positions, false, stream);
    }
  }
  if (a.count == 0) return;
  if (a.first[a.count] > 0x7fffffff) throw std::runtime_error("cuda::norm_rope: too many rows");
  const int threads = (head_dim / 4 + kWarp - 1) / kWarp * kWarp;
  overlapped_launch("norm_rope launch", norm_rotate, static_cast<unsigned>(a.first[a.count]), threads, 0,
                    static_cast<cudaStream_t>(stream), r.inv_freq, a, eps, head_dim, head_dim - r.rope_dim, positions);
}

void register_rope(Registry&) {}

}  // namespace keel::cuda
