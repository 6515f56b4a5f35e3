// The end of a split-k mma.sync tile (cuda/gemm_mma.cu, cuda/gemm_fp8.cu): the warps of
// a row tile each summed one share of k; their totals are added in share order, so a
// row's result does not depend on which warp finishes first.
#pragma once

#include <cstdint>

namespace keel::cuda {

// `total` is a warp's R x C tiles of 16 rows by 8 columns in the m16n8 accumulator
// layout (lane 4g + t holds rows g, g + 8 and columns 2t, 2t + 1 of each tile). Warp
// `share` of each group of `split` (a power of two) consecutive warps adds up every
// split-th value over the group, through `shares` (the block's scratch), and passes it
// to store(row, column, value), row and column within the warp's tiles.
template <int R, int C, int Warps, typename Store>
__device__ __forceinline__ void add_shares(const float (&total)[R][C][4], float (&shares)[Warps][R * C * 4][32],
                                           int warp, int lane, int share, int split, Store&& store) {
  const int g = lane / 4, t = lane % 4;
  if (split > 1) {
#pragma unroll
    for (int e = 0; e < R * C * 4; ++e) shares[warp][e][lane] = total[e / (C * 4)][e / 4 % C][e % 4];
    __syncthreads();
  }
#pragma unroll
  for (int e = 0; e < R * C * 4; ++e) {
    const int i = e / (C * 4), c = e / 4 % C, r = e % 4;
    if ((e & (split - 1)) != share) continue;  // split is a power of two
    float v = total[i][c][r];
    if (split > 1) {
      v = shares[warp - share][e][lane];
      for (int s = 1; s < split; ++s) v = __fadd_rn(v, shares[warp - share + s][e][lane]);
    }
    store(16 * i + g + 8 * (r / 2), 8 * c + 2 * t + r % 2, v);
  }
}

}  // namespace keel::cuda
