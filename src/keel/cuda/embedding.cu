#include "cuda/embedding.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/convert.cuh"
#include "cuda/weight_decode.cuh"

namespace keel::cuda {
namespace {

constexpr int kThreads = 256;

// Block (token, chunk of kThreads columns), a column per thread: the row's loads all in
// flight at once (a block striding over a row waited one round trip per stride). Each
// value is decoded once and stored to every copy (coalesced: consecutive threads,
// consecutive columns).
template <WeightFormat F, DType T>
__global__ void __launch_bounds__(kThreads)
    gather(DeviceWeight w, const int32_t* __restrict__ tokens, int copies, float* __restrict__ out) {
  const int64_t t = blockIdx.x, k = int64_t{blockIdx.y} * kThreads + threadIdx.x;
  if (k >= w.in) return;
  const int64_t row = tokens[t];
  float* o = out + t * copies * w.in;
  const bool inside = row >= 0 && row < w.out;
  const float v = inside ? weight_value<F, T>(w, row, k) : __uint_as_float(0x7fc00000u);
  for (int c = 0; c < copies; ++c) o[c * w.in + k] = v;
}

template <WeightFormat F, DType T>
void launch(const DeviceWeight& w, const int32_t* tokens, int64_t count, int copies, float* out,
            cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>((w.in + kThreads - 1) / kThreads));
  gather<F, T><<<grid, kThreads, 0, stream>>>(w, tokens, copies, out);
  check(cudaGetLastError(), "embed launch");
}

}  // namespace

void embed(const DeviceWeight& table, const int32_t* tokens, int64_t count, int copies, float* out,
           void* stream_ptr) {
  if (copies <= 0) throw std::runtime_error("cuda::embed: copies " + std::to_string(copies) + " is not positive");
  if (count <= 0) return;
  if (count > 0x7fffffff) throw std::runtime_error("cuda::embed: too many tokens (" + std::to_string(count) + ")");
  if (table.in > int64_t{65535} * kThreads) throw std::runtime_error("cuda::embed: rows too wide");
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch(table, "cuda::embed",
           [&]<WeightFormat F, DType T>() { launch<F, T>(table, tokens, count, copies, out, stream); });
}

void register_embedding(Registry& registry) {
  KernelInfo k{.name = "cuda_embed",
               .op = Op::embedding,
               .archs = ArchSet::gpus_from(Arch::sm_80),
               .formats = {WeightFormat::bf16, WeightFormat::f32, WeightFormat::fp8_block, WeightFormat::mxfp4,
                           WeightFormat::nvfp4},
               .activations = {Activation::f32},
               .priority = 1,
               .summary = "row gather, a column per thread, decoded exactly and stored to each hc stream"};
  registry.add(std::move(k.with_entry(&embed)));
}

}  // namespace keel::cuda
