// The CUDA embedding against ops/linear.h's decode_row (the CPU's embedding kernel) for
// every stored format: random tables of 300 rows (the fp8 scale blocks' last row group
// partial), widths that end in a partial fp8 block, tokens that include the first and
// last rows and repeats, 1 and 4 copies, outputs poisoned. Decoding is exact on both
// sides (bit placement and one rounding per scaled product, in the same order), so the
// comparison is equality.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/embedding.h"
#include "gpu/device_memory.h"
#include "gpu/weight_cases.h"
#include "model/owned_weight.h"
#include "ops/linear.h"
#include "testing.h"

namespace keel::cuda {
namespace {

using keel::testing::random_normal;

class CudaEmbedding : public ::testing::TestWithParam<WeightCase> {};

TEST_P(CudaEmbedding, MatchesDecodeRow) {
  const WeightCase& c = GetParam();
  constexpr int64_t kRows = 300;
  for (const int64_t in : {int64_t{320}, int64_t{4096 + 64}}) {
    // Spread wide enough that the fp8/fp4 blocks' scales differ from block to block.
    const OwnedWeight host(random_normal(kRows * in, 11, 3.0f), kRows, in, c.format, c.dtype, c.scales);
    DeviceWeight table = upload(host.weight());
    const std::vector<int32_t> tokens = {0, kRows - 1, 129, 7, kRows - 1, 256};
    const auto count = static_cast<int64_t>(tokens.size());
    int32_t* dtokens = device_copy(tokens);
    for (const int copies : {1, 4}) {
      std::vector<float> want(count * copies * in);
      std::vector<float> row(in);
      for (int64_t t = 0; t < count; ++t) {
        keel::decode_row(host.weight(), tokens[t], row);
        for (int k = 0; k < copies; ++k) std::copy(row.begin(), row.end(), want.begin() + (t * copies + k) * in);
      }
      float* dout = device_poisoned(want.size());
      embed(table, dtokens, count, copies, dout);
      const std::vector<float> got = host_copy(dout, want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << c.name << " in " << in << " copies " << copies << " at token "
                                   << i / (copies * in) << " copy " << i / in % copies << " column " << i % in;
      }
      cudaFree(dout);
    }
    cudaFree(dtokens);
    release(table);
  }
}

INSTANTIATE_TEST_SUITE_P(All, CudaEmbedding,
                         ::testing::Values(kF32, kBf16, kF16, kFp8Ue8m0, kFp8F32, kMxfp4, kNvfp4), case_name);

TEST(CudaEmbedding, TokenOutsideTheTableGivesNaN) {
  const OwnedWeight host(random_normal(4 * 64, 12), 4, 64, WeightFormat::bf16, DType::bf16);
  DeviceWeight table = upload(host.weight());
  int32_t* dtokens = device_copy(std::vector<int32_t>{4, -1});
  float* dout = device_copy(std::vector<float>(2 * 64, 0.0f));  // not NaN until written
  embed(table, dtokens, 2, 1, dout);
  for (const float v : host_copy(dout, 2 * 64)) EXPECT_TRUE(std::isnan(v));
  cudaFree(dtokens);
  cudaFree(dout);
  release(table);
}

TEST(CudaEmbedding, RefusesNoCopies) {
  const OwnedWeight host(random_normal(4 * 64, 13), 4, 64, WeightFormat::bf16, DType::bf16);
  DeviceWeight table = upload(host.weight());
  EXPECT_THROW(embed(table, nullptr, 1, 0, nullptr), std::runtime_error);
  release(table);
}

}  // namespace
}  // namespace keel::cuda
