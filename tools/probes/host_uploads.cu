// Probe: what moving a few host bytes to the device costs a stream between kernels, by
// way of moving them: a DMA copy from page-locked memory (cudaMemcpyAsync), a kernel
// reading the page-locked memory through its device address, a kernel that gets the
// bytes as its parameter. Each way is timed after a small kernel, N times in a row, in
// a graph (the host cannot set the pace) and launched one by one after a long kernel
// (the host ahead); the figure is per kernel + move. Behind cuda/gpu_model.cpp's Staging.
//
//   nvcc -O2 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -o host_uploads host_uploads.cu
//   ./host_uploads          (docs/perf.md has its figures on one H200)
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>
__global__ void spin(long long ns) { long long t0 = clock64(); while (clock64() - t0 < ns) {} }
__global__ void tiny(float* x, const int* idx) { if (threadIdx.x == 0 && blockIdx.x == 0) x[0] += idx[0]; }
template <int kBytes> struct Blob { int4 v[kBytes / 16]; };
template <int kBytes> __global__ void by_value(Blob<kBytes> b, int4* dst, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = b.v[i];
}
__global__ void zero_copy(const int4* src, int4* dst, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
int main() {
  float* x; int* d; int* h; int* hm;
  cudaMalloc(&x, 4096); cudaMalloc(&d, 1 << 22); cudaMallocHost(&h, 1 << 22);
  cudaHostAlloc(&hm, 1 << 22, cudaHostAllocMapped);
  int* hm_dev; cudaHostGetDevicePointer(&hm_dev, hm, 0);
  for (int i = 0; i < 1 << 20; ++i) h[i] = hm[i] = 1;
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const int N = 100;
  // Timed in a graph and one by one; per kernel + move.
  auto timed = [&](const char* name, auto&& body) {
    cudaGraph_t g; cudaGraphExec_t e;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    for (int i = 0; i < N; ++i) { body(); tiny<<<132, 128, 0, s>>>(x, d); }
    cudaStreamEndCapture(s, &g); cudaGraphInstantiate(&e, g, 0);
    cudaGraphLaunch(e, s); cudaStreamSynchronize(s);
    cudaEventRecord(a, s);
    for (int r = 0; r < 8; ++r) cudaGraphLaunch(e, s);
    cudaEventRecord(b, s); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    // eager too, with the host ahead
    spin<<<1, 1, 0, s>>>(100000000LL);
    cudaEvent_t c, dd; cudaEventCreate(&c); cudaEventCreate(&dd);
    cudaEventRecord(c, s);
    for (int i = 0; i < N; ++i) { body(); tiny<<<132, 128, 0, s>>>(x, d); }
    cudaEventRecord(dd, s); cudaEventSynchronize(dd);
    float ms2; cudaEventElapsedTime(&ms2, c, dd);
    printf("%-36s graph %.2f us, eager %.2f us  (%s)\n", name, ms * 1e3 / (8 * N), ms2 * 1e3 / N, cudaGetErrorString(cudaGetLastError()));
  };
  timed("kernel only", [] {});
  char name[64];
  for (int bytes : {64, 256, 512, 1024, 2048, 3072, 4096, 8192, 32768, 262144}) {
    snprintf(name, sizeof name, "memcpy %d B", bytes);
    timed(name, [&] { cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s); });
  }
  for (int bytes : {256, 4096, 32768, 262144}) {
    snprintf(name, sizeof name, "zero-copy kernel %d B", bytes);
    const int n = bytes / 16;
    timed(name, [&] { zero_copy<<<(n + 255) / 256 < 64 ? (n + 255) / 256 : 64, 256, 0, s>>>((const int4*)hm_dev, (int4*)d, n); });
  }
  { Blob<1024> b1; memset(&b1, 1, sizeof b1); timed("by-value kernel 1 KB", [&] { by_value<1024><<<1, 256, 0, s>>>(b1, (int4*)d, 64); }); }
  { Blob<4096> b4; memset(&b4, 1, sizeof b4); timed("by-value kernel 4 KB", [&] { by_value<4096><<<1, 256, 0, s>>>(b4, (int4*)d, 256); }); }
  { static Blob<16384> b16; memset(&b16, 1, sizeof b16); timed("by-value kernel 16 KB", [&] { by_value<16384><<<1, 256, 0, s>>>(b16, (int4*)d, 1024); }); }
  { static Blob<32000> b32; memset(&b32, 1, sizeof b32); timed("by-value kernel 32000 B", [&] { by_value<32000><<<1, 256, 0, s>>>(b32, (int4*)d, 2000); }); }
}
