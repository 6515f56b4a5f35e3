// NVIDIA's conversions (convert.cuh) run on the current device over host vectors, one
// element at a time, results copied back. They exist so tests can hold keel's CPU
// conversions (base/dtype.h) against the hardware; kernels call convert.cuh directly.
// Throw std::runtime_error on a CUDA failure.
#pragma once

#include <cstdint>
#include <vector>

namespace keel::cuda {

// What happens past a format's max finite value. satfinite clamps to ±max (CUDA's
// __NV_SATFINITE); nosat is CUDA's __NV_NOSAT.
enum class Saturation { satfinite, nosat };

std::vector<float> bf16_to_f32_device(const std::vector<uint16_t>& bits);
std::vector<float> f16_to_f32_device(const std::vector<uint16_t>& bits);
std::vector<float> e4m3_to_f32_device(const std::vector<uint8_t>& codes);
std::vector<float> e5m2_to_f32_device(const std::vector<uint8_t>& codes);
std::vector<float> e2m1_to_f32_device(const std::vector<uint8_t>& codes);  // low nibbles
std::vector<float> ue8m0_to_f32_device(const std::vector<uint8_t>& codes);

std::vector<uint16_t> f32_to_bf16_device(const std::vector<float>& values);
std::vector<uint16_t> f32_to_f16_device(const std::vector<float>& values);
std::vector<uint8_t> f32_to_e4m3_device(const std::vector<float>& values, Saturation saturation);
std::vector<uint8_t> f32_to_e5m2_device(const std::vector<float>& values, Saturation saturation);
std::vector<uint8_t> f32_to_e2m1_device(const std::vector<float>& values);

}  // namespace keel::cuda
