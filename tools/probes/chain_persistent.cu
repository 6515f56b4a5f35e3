// Probe: can a chain of dependent one-token products (each product's x is the output of
// the one before, as in a decode layer) stream its weights at the copy bandwidth when
// one persistent kernel runs the whole chain? Each block owns a slice of every
// product's rows and streams its slices through a shared-memory ring in chain order,
// without regard to product boundaries: only a product's math waits for the product
// before it (a counter each block bumps once its slice of y is written), so the weights
// of the next product keep arriving while the last blocks finish the one before.
// Against it, the same block code launched once per product (plain launches, and with
// programmatic dependent launch and the ring's first loads before the wait), which is
// how keel's decode runs its products now. FP8 e4m3 weights without scales, CUDA-core
// math in f32: bytes and dependencies as a layer's, not its exact arithmetic.
// The chain is keel_gpu_bench's: wq_a, wq_b, wo_b, the shared expert's w1 and w2.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o chain_persistent chain_persistent.cu
//   ./chain_persistent
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <random>
#include <vector>

#include "check.cuh"

constexpr int kThreads = 512;
constexpr int kChunk = kThreads * 32;  // bytes a chunk: 32 per thread (two 16-byte copies)
constexpr int kMaxProducts = 8;
constexpr int kMaxIn = 8192;
constexpr int kMaxRowsPerBlock = 512;

struct Product {
  const uint8_t* w;  // out x in bytes, row-major
  const float* x;    // in floats
  float* y;          // out floats
  int out, in;
};
struct Chain {
  Product p[kMaxProducts];
  int count;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* global) {
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(global));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void wait_groups() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Two e4m3 bytes (low half of `v`) as floats.
__device__ __forceinline__ float2 e4m3x2(uint16_t v) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
  return __half22float2(*reinterpret_cast<__half2*>(&h));
}

// Block b's rows of a product: [first, end).
__device__ __forceinline__ int2 rows_of(int out, int b, int blocks) {
  return make_int2(static_cast<int>(int64_t{out} * b / blocks), static_cast<int>(int64_t{out} * (b + 1) / blocks));
}
__device__ __forceinline__ int chunks_of(const Product& p, int b, int blocks) {
  const int2 r = rows_of(p.out, b, blocks);
  return static_cast<int>((int64_t{r.y - r.x} * p.in + kChunk - 1) / kChunk);
}

// Products [first, last] of the chain by this block, kDepth chunks in the ring (kDepth - 1
// in flight ahead of the one computed). kPersistent: a product's math waits for every
// block's slice of the one before (flags[p - 1] reaching epoch · gridDim.x); otherwise
// the launch is one product and waits for the kernel before it (griddepcontrol.wait, a
// no-op in a plain launch) after its ring's first loads.
template <int kDepth, bool kPersistent>
__global__ void __launch_bounds__(kThreads, 1)
    chain_kernel(const Chain chain, int first, int last, unsigned* flags, unsigned epoch) {
  extern __shared__ __align__(16) uint8_t shared[];
  uint8_t* ring = shared;
  float* xs = reinterpret_cast<float*>(shared + kDepth * kChunk);
  float* acc = xs + kMaxIn;
  const int b = blockIdx.x, blocks = gridDim.x, t = threadIdx.x;

  // The block's chunks in chain order: chunk q is product p's chunk q - start[p]. The
  // starts and row ranges are found once: the divisions they take, repeated for every
  // chunk, would cost more than the chunk's math.
  __shared__ int start[kMaxProducts + 1];
  __shared__ int2 slice_rows[kMaxProducts];
  if (t == 0) {
    start[first] = 0;
    for (int p = first; p <= last; ++p) {
      slice_rows[p] = rows_of(chain.p[p].out, b, blocks);
      start[p + 1] = start[p] + chunks_of(chain.p[p], b, blocks);
    }
  }
  __syncthreads();
  const int total = start[last + 1];
  // Chunk q's product and byte offset in its slice.
  const auto locate = [&](int q, int& p, int64_t& at) {
    p = first;
    while (q >= start[p + 1]) ++p;
    at = int64_t{q - start[p]} * kChunk;
  };
  const auto issue = [&](int q) {
    if (q < total) {
      int p;
      int64_t at;
      locate(q, p, at);
      const Product& pr = chain.p[p];
      const int2 r = slice_rows[p];
      const int64_t slice = int64_t{r.y - r.x} * pr.in, mine = at + 32 * t;
      const uint8_t* src = pr.w + int64_t{r.x} * pr.in + mine;
      uint8_t* dst = ring + (q % kDepth) * kChunk + 32 * t;
      if (mine < slice) cp_async16(dst, src), cp_async16(dst + 16, src + 16);
    }
    commit();
  };

  for (int q = 0; q < kDepth - 1; ++q) issue(q);
  if (!kPersistent) {
    pdl_launch();
    pdl_wait();
  }
  int current = -1;  // the product whose x is in xs
  for (int q = 0; q < total; ++q) {
    wait_groups<kDepth - 2>();
    __syncthreads();  // chunk q is in the ring; chunk q - 1's slot is free
    issue(q + kDepth - 1);
    int p;
    int64_t at;
    locate(q, p, at);
    const Product& pr = chain.p[p];
    const int2 r = slice_rows[p];
    if (p != current) {  // the product's first chunk: its x, once the product before is done
      if (kPersistent && p > 0) {
        if (t == 0) {
          const unsigned target = epoch * blocks;
          while (true) {
            unsigned seen;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(flags + p - 1) : "memory");
            if (seen >= target) break;
            __nanosleep(64);
          }
        }
        __syncthreads();
      }
      for (int i = t; i < pr.in / 4; i += kThreads) {  // in is a multiple of 4
        reinterpret_cast<float4*>(xs)[i] = __ldcg(reinterpret_cast<const float4*>(pr.x) + i);
      }
      for (int i = t; i < r.y - r.x; i += kThreads) acc[i] = 0.0f;
      __syncthreads();
      current = p;
    }
    // The warp's 1 KiB of the chunk lies in one row (in is a multiple of 1024). Lane l
    // takes its words l, l + 32, ..., l + 224: a warp's reads of the ring and of x are
    // then 32 consecutive words or float4s (no bank conflicts), where a lane's own 32
    // consecutive bytes put 8 lanes of every float4 read of x on the same banks.
    const int lane = t % 32, warp_at = 1024 * (t / 32);
    const int64_t slice = int64_t{r.y - r.x} * pr.in, mine = at + warp_at;
    float sum = 0.0f;
    int row = 0;
    if (mine < slice) {
      row = static_cast<int>(mine / pr.in);
      const int k = static_cast<int>(mine % pr.in);
      const uint32_t* v = reinterpret_cast<const uint32_t*>(ring + (q % kDepth) * kChunk + warp_at);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t word = v[lane + 32 * j];
        const float2 lo = e4m3x2(static_cast<uint16_t>(word)), hi = e4m3x2(static_cast<uint16_t>(word >> 16));
        const float4 xk = *reinterpret_cast<const float4*>(xs + k + 4 * (lane + 32 * j));
        sum += lo.x * xk.x + lo.y * xk.y + hi.x * xk.z + hi.y * xk.w;
      }
    }
    // The warp's sum goes to its row at once.
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0 && mine < slice) atomicAdd(acc + row, sum);
    const bool product_ends = q + 1 == start[p + 1];
    if (product_ends) {
      __syncthreads();
      for (int i = t; i < r.y - r.x; i += kThreads) pr.y[r.x + i] = acc[i];
      if (kPersistent) {
        __threadfence();
        __syncthreads();
        if (t == 0) atomicAdd(flags + p, 1u);
      }
    }
  }
  wait_groups<0>();
}

template <typename K>
void launch(K kernel, int blocks, size_t smem, bool pdl, const Chain& c, int first, int last, unsigned* flags,
            unsigned epoch) {
  cudaLaunchAttribute a{};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = blocks;
  config.blockDim = kThreads;
  config.dynamicSmemBytes = smem;
  config.stream = 0;
  config.attrs = &a;
  config.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&config, kernel, c, first, last, flags, epoch));
}

// An e4m3 code as a float (normal and subnormal codes; the probe makes no NaN).
float e4m3_value(uint8_t v) {
  const int e = (v >> 3) & 15, m = v & 7;
  const float magnitude = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return v & 0x80 ? -magnitude : magnitude;
}

// Largest |a - reference| over the largest |reference|.
double relative_error(const std::vector<float>& a, const std::vector<double>& reference) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(a[i] - reference[i]));
    scale = std::max(scale, std::fabs(reference[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

template <int kDepth>
void run_all(const std::vector<Chain>& chains, const std::vector<double>& reference, double copy_bw,
             double chain_bytes, int sms) {
  const size_t smem = size_t{kDepth} * kChunk + (kMaxIn + kMaxRowsPerBlock) * sizeof(float);
  auto persistent = chain_kernel<kDepth, true>;
  auto single = chain_kernel<kDepth, false>;
  CK(cudaFuncSetAttribute(persistent, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  CK(cudaFuncSetAttribute(single, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent, kThreads, smem));
  if (per_sm < 1) {
    std::printf("ring of %d chunks: does not fit\n", kDepth);
    return;
  }
  const int blocks = sms;  // one a multiprocessor: every block resident at once
  const int n = chains[0].count;
  unsigned* flags;
  CK(cudaMalloc(&flags, kMaxProducts * sizeof(unsigned)));
  CK(cudaMemset(flags, 0, kMaxProducts * sizeof(unsigned)));
  unsigned epoch = 0;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const auto time = [&](auto body) {
    for (size_t i = 0; i < chains.size(); ++i) body(chains[i]);
    CK(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int round = 0; round < 3; ++round) {
      const int reps = 40;
      CK(cudaEventRecord(e0));
      for (int r = 0; r < reps; ++r) body(chains[r % chains.size()]);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      best = std::min(best, ms * 1e3f / reps);
    }
    return best;
  };
  // The flags only grow: launch e waits for e · blocks arrivals at each product.
  const float t_persistent = time([&](const Chain& c) { launch(persistent, blocks, smem, false, c, 0, n - 1, flags, ++epoch); });
  // The last product's y from the persistent kernel against one launch per product.
  const Chain& c0 = chains[0];
  launch(persistent, blocks, smem, false, c0, 0, n - 1, flags, ++epoch);
  std::vector<float> a(c0.p[n - 1].out), b(c0.p[n - 1].out);
  CK(cudaMemcpy(a.data(), c0.p[n - 1].y, a.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const float t_plain = time([&](const Chain& c) {
    for (int p = 0; p < n; ++p) launch(single, blocks, smem, false, c, p, p, flags, 0);
  });
  const float t_pdl = time([&](const Chain& c) {
    for (int p = 0; p < n; ++p) launch(single, blocks, smem, true, c, p, p, flags, 0);
  });
  for (int p = 0; p < n; ++p) launch(single, blocks, smem, false, c0, p, p, flags, 0);
  CK(cudaMemcpy(b.data(), c0.p[n - 1].y, b.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const auto row = [&](const char* how, float us) {
    std::printf("  %-36s %8.2f us  %6.0f GB/s  %5.1f%% of copy\n", how, us, chain_bytes / us / 1e3,
                100.0 * chain_bytes / us / 1e3 / (copy_bw / 1e9));
  };
  std::printf("ring of %d chunks (%d KiB a block, %d blocks); last y against the host's, max |error| / max |y|: "
              "persistent %.2e, a kernel a product %.2e\n",
              kDepth, kDepth * kChunk / 1024, blocks, relative_error(a, reference), relative_error(b, reference));
  row("one persistent kernel for the chain", t_persistent);
  row("a kernel a product, plain launches", t_plain);
  row("a kernel a product, PDL, ring first", t_pdl);
  CK(cudaFree(flags));
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  // Copy bandwidth (read + write), as keel bench measures it.
  const size_t copy_bytes = size_t{2} << 30;
  void *ca, *cb;
  CK(cudaMalloc(&ca, copy_bytes));
  CK(cudaMalloc(&cb, copy_bytes));
  CK(cudaMemset(ca, 1, copy_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaMemcpy(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < 5; ++i) CK(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice));
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  const double copy_bw = 2.0 * copy_bytes * 5 / (ms / 1e3);
  CK(cudaFree(ca));
  CK(cudaFree(cb));

  struct Shape {
    int out, in;
  };
  const Shape shapes[] = {{1024, 4096}, {32768, 1024}, {4096, 8192}, {2048, 4096}, {4096, 2048}};
  const int n = static_cast<int>(std::size(shapes));
  double chain_bytes = 0;
  for (const Shape& s : shapes) chain_bytes += double(s.out) * s.in;
  // Weights: e4m3 codes of magnitude 0.5 to 0.94, random signs (no NaN, sums stay finite
  // through the chain). Four copies, each call taking the next: none found in L2.
  std::mt19937 rng(1);
  std::vector<Chain> chains(4);
  float* x0;
  CK(cudaMalloc(&x0, kMaxIn * sizeof(float)));
  std::vector<double> reference(kMaxIn);  // chains[0] on the host: x, then each product's y
  {
    std::vector<float> x(kMaxIn);
    for (float& v : x) v = std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng);
    CK(cudaMemcpy(x0, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    reference.assign(x.begin(), x.end());
  }
  std::vector<float*> ys(n);
  for (int p = 0; p < n; ++p) CK(cudaMalloc(&ys[p], shapes[p].out * sizeof(float)));
  for (Chain& c : chains) {
    c.count = n;
    for (int p = 0; p < n; ++p) {
      const Shape& s = shapes[p];
      std::vector<uint8_t> w(size_t(s.out) * s.in);
      for (uint8_t& v : w) {
        const uint32_t r = rng();
        v = static_cast<uint8_t>((r & 0x80u) | 0x30u | (r & 0x07u));
      }
      if (&c == &chains[0]) {
        std::vector<double> y(s.out, 0.0);
        for (int o = 0; o < s.out; ++o) {
          for (int k = 0; k < s.in; ++k) y[o] += e4m3_value(w[size_t(o) * s.in + k]) * reference[k];
        }
        reference = std::move(y);
      }
      uint8_t* dw;
      CK(cudaMalloc(&dw, w.size()));
      CK(cudaMemcpy(dw, w.data(), w.size(), cudaMemcpyHostToDevice));
      c.p[p] = {dw, p == 0 ? x0 : ys[p - 1], ys[p], s.out, s.in};
    }
  }
  std::printf("%s: %d SMs; copy bandwidth %.0f GB/s; chain wq_a, wq_b, wo_b, w1, w2: %.1f MiB (%.2f us at copy)\n",
              prop.name, sms, copy_bw / 1e9, chain_bytes / 1048576.0, chain_bytes / copy_bw * 1e6);
  run_all<4>(chains, reference, copy_bw, chain_bytes, sms);
  run_all<8>(chains, reference, copy_bw, chain_bytes, sms);
  run_all<12>(chains, reference, copy_bw, chain_bytes, sms);
  return 0;
}
