#include "cuda/convert.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

#include "cuda/check.cuh"
#include "cuda/convert.cuh"

namespace keel::cuda {
namespace {

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};

template <typename T>
std::unique_ptr<T, CudaFree> device_alloc(size_t n) {
  void* p = nullptr;
  check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
  return std::unique_ptr<T, CudaFree>(static_cast<T*>(p));
}

template <typename In, typename Out, typename Op>
__global__ void map_kernel(const In* in, Out* out, size_t n, Op op) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = op(in[i]);
  }
}

// out[i] = op(in[i]) on the device.
template <typename Out, typename In, typename Op>
std::vector<Out> map_on_device(const std::vector<In>& in, Op op) {
  const size_t n = in.size();
  if (n == 0) return {};
  auto d_in = device_alloc<In>(n);
  auto d_out = device_alloc<Out>(n);
  check(cudaMemcpy(d_in.get(), in.data(), n * sizeof(In), cudaMemcpyHostToDevice), "cudaMemcpy to device");
  // Poison, so that elements a broken kernel leaves unwritten show up as mismatches.
  check(cudaMemset(d_out.get(), 0xab, n * sizeof(Out)), "cudaMemset");
  constexpr int kThreads = 256;
  const auto blocks = static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 4096));
  map_kernel<<<blocks, kThreads>>>(d_in.get(), d_out.get(), n, op);
  check(cudaGetLastError(), "kernel launch");
  check(cudaDeviceSynchronize(), "kernel");
  std::vector<Out> out(n);
  check(cudaMemcpy(out.data(), d_out.get(), n * sizeof(Out), cudaMemcpyDeviceToHost), "cudaMemcpy to host");
  return out;
}

__nv_saturation_t nv(Saturation s) { return s == Saturation::satfinite ? __NV_SATFINITE : __NV_NOSAT; }

// Functors rather than lambdas: host lambdas cannot become __device__ code without
// --extended-lambda.
struct DecodeBf16 {
  __device__ float operator()(uint16_t b) const { return decode_bf16(b); }
};
struct DecodeF16 {
  __device__ float operator()(uint16_t b) const { return decode_f16(b); }
};
struct DecodeE4m3 {
  __device__ float operator()(uint8_t c) const { return decode_e4m3(c); }
};
struct DecodeE5m2 {
  __device__ float operator()(uint8_t c) const { return decode_e5m2(c); }
};
struct DecodeE2m1 {
  __device__ float operator()(uint8_t c) const { return decode_e2m1(c); }
};
struct DecodeUe8m0 {
  __device__ float operator()(uint8_t c) const { return decode_ue8m0(c); }
};
struct EncodeBf16 {
  __device__ uint16_t operator()(float x) const { return encode_bf16(x); }
};
struct EncodeF16 {
  __device__ uint16_t operator()(float x) const { return encode_f16(x); }
};
struct EncodeE2m1 {
  __device__ uint8_t operator()(float x) const { return encode_e2m1(x); }
};
struct EncodeE4m3 {
  __nv_saturation_t saturation;
  __device__ uint8_t operator()(float x) const { return encode_e4m3(x, saturation); }
};
struct EncodeE5m2 {
  __nv_saturation_t saturation;
  __device__ uint8_t operator()(float x) const { return encode_e5m2(x, saturation); }
};

}  // namespace

std::vector<float> bf16_to_f32_device(const std::vector<uint16_t>& bits) {
  return map_on_device<float>(bits, DecodeBf16{});
}
std::vector<float> f16_to_f32_device(const std::vector<uint16_t>& bits) {
  return map_on_device<float>(bits, DecodeF16{});
}
std::vector<float> e4m3_to_f32_device(const std::vector<uint8_t>& codes) {
  return map_on_device<float>(codes, DecodeE4m3{});
}
std::vector<float> e5m2_to_f32_device(const std::vector<uint8_t>& codes) {
  return map_on_device<float>(codes, DecodeE5m2{});
}
std::vector<float> e2m1_to_f32_device(const std::vector<uint8_t>& codes) {
  return map_on_device<float>(codes, DecodeE2m1{});
}
std::vector<float> ue8m0_to_f32_device(const std::vector<uint8_t>& codes) {
  return map_on_device<float>(codes, DecodeUe8m0{});
}

std::vector<uint16_t> f32_to_bf16_device(const std::vector<float>& values) {
  return map_on_device<uint16_t>(values, EncodeBf16{});
}
std::vector<uint16_t> f32_to_f16_device(const std::vector<float>& values) {
  return map_on_device<uint16_t>(values, EncodeF16{});
}
std::vector<uint8_t> f32_to_e2m1_device(const std::vector<float>& values) {
  return map_on_device<uint8_t>(values, EncodeE2m1{});
}

std::vector<uint8_t> f32_to_e4m3_device(const std::vector<float>& values, Saturation saturation) {
  return map_on_device<uint8_t>(values, EncodeE4m3{nv(saturation)});
}

std::vector<uint8_t> f32_to_e5m2_device(const std::vector<float>& values, Saturation saturation) {
  return map_on_device<uint8_t>(values, EncodeE5m2{nv(saturation)});
}

}  // namespace keel::cuda
