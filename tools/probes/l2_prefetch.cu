// Probe: can the weights of a product be brought into L2 while the GPU runs a kernel that
// leaves the memory idle (a decode layer's attention, an mHC site's input, the router:
// tens of microseconds a layer), so that the product then reads them from L2? A busy
// kernel (a few blocks spinning for a set time) runs on one stream while a prefetch
// kernel on another asks L2 for a weight's bytes (cp.async.bulk.prefetch.L2, a 64 KiB
// range an instruction, nothing waits for it); then a read kernel streams the weight as
// a product would. Against it: the read after the same busy kernel without the prefetch
// (the weight in memory only: a larger buffer is read first to evict it). Also whether
// the prefetch slows the busy kernel, and how fast it fills L2 alone.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o l2_prefetch l2_prefetch.cu
//   ./l2_prefetch
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "check.cuh"

constexpr int64_t kPiece = 64 << 10;  // bytes a prefetch instruction asks for

// Spins `cycles` on each of its blocks: a kernel that keeps a few multiprocessors busy
// and the memory idle.
__global__ void busy(int64_t cycles, unsigned* sink) {
  const int64_t end = clock64() + cycles;
  unsigned spins = 0;
  while (clock64() < end) ++spins;
  if (spins == 0xffffffffu) *sink = spins;  // never: keeps the loop
}

// Asks L2 for [w, w + bytes), a piece per thread at a time.
__global__ void prefetch(const uint8_t* w, int64_t bytes) {
  const int64_t pieces = bytes / kPiece;
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < pieces; p += int64_t{gridDim.x} * blockDim.x) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w + p * kPiece), "r"(static_cast<unsigned>(kPiece))
                 : "memory");
  }
}

// Reads every byte of w once, 16 at a time, as a product's stream of its weight would.
__global__ void read(const uint4* w, int64_t chunks, unsigned* sink) {
  unsigned x = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < chunks; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldcg(w + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345678u) sink[blockIdx.x] = x;  // almost never: keeps the loads
}

int main() {
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  int khz = 0;
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  std::printf("device: %s, %d multiprocessors, L2 %d MiB, clock %d MHz\n", prop.name, sms, prop.l2CacheSize >> 20,
              khz / 1000);
  const int64_t most = int64_t{64} << 20, evict_bytes = int64_t{1} << 30;
  uint8_t *w = nullptr, *evict = nullptr;
  unsigned* sink = nullptr;
  CK(cudaMalloc(&w, most));
  CK(cudaMalloc(&evict, evict_bytes));
  CK(cudaMalloc(&sink, 1 << 20));
  CK(cudaMemset(w, 1, most));
  CK(cudaMemset(evict, 2, evict_bytes));
  cudaStream_t main_stream, side;
  CK(cudaStreamCreateWithFlags(&main_stream, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t a, b, c, d, fork, joined;
  for (cudaEvent_t* event : {&a, &b, &c, &d, &fork, &joined}) CK(cudaEventCreate(event));
  const int read_blocks = 4 * sms, threads = 256;
  const int64_t busy_cycles = int64_t{khz} * 20 / 1000;  // about 20 us at the rated clock

  const auto elapsed_us = [&](cudaEvent_t from, cudaEvent_t to) {
    float ms = 0;
    CK(cudaEventSynchronize(to));
    CK(cudaEventElapsedTime(&ms, from, to));
    return 1000.0 * ms;
  };
  const auto evict_l2 = [&] {
    read<<<read_blocks, threads, 0, main_stream>>>(reinterpret_cast<const uint4*>(evict), evict_bytes / 16, sink);
  };
  // Busy on main; with `ahead`, the prefetch of `bytes` on the side stream beside it; then
  // the read on main right after the busy kernel (the prefetch kernel only issues: it
  // ends long before). Returns {busy us, read us}.
  const auto run = [&](int64_t bytes, bool ahead) {
    evict_l2();
    CK(cudaEventRecord(fork, main_stream));
    CK(cudaStreamWaitEvent(side, fork));
    CK(cudaEventRecord(a, main_stream));
    busy<<<8, 32, 0, main_stream>>>(busy_cycles, sink);
    if (ahead) prefetch<<<1, 32, 0, side>>>(w, bytes);
    CK(cudaEventRecord(b, main_stream));
    CK(cudaEventRecord(joined, side));
    CK(cudaStreamWaitEvent(main_stream, joined));
    CK(cudaEventRecord(c, main_stream));
    read<<<read_blocks, threads, 0, main_stream>>>(reinterpret_cast<const uint4*>(w), bytes / 16, sink);
    CK(cudaEventRecord(d, main_stream));
    return std::make_pair(elapsed_us(a, b), elapsed_us(c, d));
  };

  std::printf("%9s %14s %14s %16s %16s %12s\n", "MiB", "read cold us", "GB/s", "read after us", "GB/s",
              "busy us (w/)");
  for (const int64_t mib : {4, 8, 16, 32, 48, 64}) {
    const int64_t bytes = mib << 20;
    run(bytes, false), run(bytes, true);  // warm-up
    double cold = 0, after = 0, busy_alone = 0, busy_with = 0;
    constexpr int kRuns = 5;
    for (int r = 0; r < kRuns; ++r) {
      const auto [b0, r0] = run(bytes, false);
      const auto [b1, r1] = run(bytes, true);
      busy_alone += b0 / kRuns, cold += r0 / kRuns, busy_with += b1 / kRuns, after += r1 / kRuns;
    }
    std::printf("%9lld %14.1f %14.0f %16.1f %16.0f %5.1f (%5.1f)\n", static_cast<long long>(mib), cold, bytes / cold / 1e3,
                after, bytes / after / 1e3, busy_alone, busy_with);
  }

  // The prefetch kernel's own time: issuing, not the transfer.
  std::printf("\nthe prefetch's issue alone (1 block of 32 threads), 32 MiB: ");
  evict_l2();
  CK(cudaEventRecord(a, main_stream));
  prefetch<<<1, 32, 0, main_stream>>>(w, int64_t{32} << 20);
  CK(cudaEventRecord(b, main_stream));
  std::printf("%.1f us\n", elapsed_us(a, b));
  CK(cudaDeviceSynchronize());
  return 0;
}
