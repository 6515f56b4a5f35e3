// The CUDA matrix kernels per stored format on DeepSeek-V4-Flash shapes, next to the
// device copy bandwidth measured in the same run (cudaMemcpy device to device: bytes
// read + bytes written per second), one row per case and kernel (gemv: linear(), the
// CUDA-core GEMV; mma: linear_mma(), the tensor-core kernel) with the floor of its size
// (read_floor.h: one kernel reading the weight's bytes and nothing else); then one token's
// projections of one x as a Flash layer makes them, one by one and as one group
// (linear_mma_group); then a layer's one-token FP8 products as a dependent chain (alone,
// launched in turn, from a CUDA graph); then FP8 and MXFP4 shapes
// at 1, 8, 64, 256 and 4096 tokens per call (FP8 also by w8a8: linear_w8a8, FP8
// activations on FP8 tensor cores, on sm_89 and later); then the routed experts' pair forms (gemv:
// linear_pairs, mma: linear_pairs_mma) over 256 experts, 6 per token; then the
// lightning indexer with its top-k for one decode token by actual context length; then
// decode attention by key list length and rows per call, the CUDA-core kernel
// (attend_decode) against the tensor-core one's decode entry (attend_mma_decode).
//
//   keel_gpu_bench [--iters N] [--attention]
//
// --attention runs the decode attention table alone (after the copy bandwidth).
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cuda/attention.h"
#include "cuda/gemm_fp8.h"
#include "cuda/gemm_mma.h"
#include "cuda/indexer.h"
#include "cuda/linear.h"
#include "model/owned_weight.h"
#include "read_floor.h"

namespace {

void check(cudaError_t e) {
  if (e != cudaSuccess) {
    fmt::print(stderr, "CUDA error: {}\n", cudaGetErrorString(e));
    std::exit(1);
  }
}

template <typename F>
double seconds(F&& body, int iters) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start));
  check(cudaEventCreate(&stop));
  body();  // warm up
  check(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i) body();
  check(cudaEventRecord(stop));
  check(cudaEventSynchronize(stop));
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop));
  return ms / 1e3 / iters;
}

std::vector<float> normal(size_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

float* upload_floats(const std::vector<float>& v) {
  float* d = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&d), v.size() * sizeof(float)));
  check(cudaMemcpy(d, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

// The kernels compared, with the name their rows carry.
struct Kernel {
  const char* name;
  void (*run)(const keel::cuda::DeviceWeight&, const float*, float*, int64_t, void*);
};
const Kernel kKernels[] = {{"gemv", &keel::cuda::linear}, {"mma", &keel::cuda::linear_mma}};

void decode_attention_table(int iters) {
  // Flash's decode attention: 64 heads of 512 sharing one key per list entry, lists of
  // window (128) plus compressed entries, each row its own list of random rows of 8,192
  // keys (16 MB: they stay in L2, where a decode step's keys come from DRAM).
  constexpr int kAttHeads = 64, kAttDim = 512, kKvRows = 8192, kMostRows = 64, kLongest = 2048;
  float* kv = upload_floats(normal(size_t{kKvRows} * kAttDim));
  float* att_q = upload_floats(normal(size_t{kMostRows} * kAttHeads * kAttDim));
  float* sinks = upload_floats(std::vector<float>(kAttHeads, 0.0f));
  float *att_out = nullptr, *att_scratch = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&att_out), size_t{kMostRows} * kAttHeads * kAttDim * sizeof(float)));
  check(cudaMalloc(reinterpret_cast<void**>(&att_scratch),
                   keel::cuda::attend_decode_scratch(kMostRows, kAttHeads, kAttDim, kLongest) * sizeof(float)));
  unsigned* att_arrivals = nullptr;  // zero before the first call; each call leaves them so
  const size_t counters = keel::cuda::attend_decode_arrivals(kMostRows, kAttHeads);
  check(cudaMalloc(reinterpret_cast<void**>(&att_arrivals), counters * sizeof(unsigned)));
  check(cudaMemset(att_arrivals, 0, counters * sizeof(unsigned)));
  std::mt19937 pick_rng(2);
  std::uniform_int_distribution<int32_t> pick(0, kKvRows - 1);
  std::vector<int32_t> index(size_t{kMostRows} * kLongest);
  for (int32_t& i : index) i = pick(pick_rng);
  int32_t* dindex = nullptr;
  int32_t* doffsets = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&dindex), index.size() * sizeof(int32_t)));
  check(cudaMemcpy(dindex, index.data(), index.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  check(cudaMalloc(reinterpret_cast<void**>(&doffsets), (kMostRows + 1) * sizeof(int32_t)));
  fmt::print("\ndecode attention, us per call ({} heads x {}, one list per row)\n", kAttHeads, kAttDim);
  fmt::print("{:>6} {:>6} {:>12} {:>12}\n", "rows", "keys", "cuda cores", "tensor cores");
  for (const int rows : {1, 8, 64}) {
    for (const int keys : {128, 256, 384, 512, 640, 1024, 2048}) {
      std::vector<int32_t> offsets(rows + 1);
      for (int r = 0; r <= rows; ++r) offsets[r] = r * keys;
      check(cudaMemcpy(doffsets, offsets.data(), offsets.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
      const auto time = [&](auto* kernel) {
        return seconds([&] {
          kernel(att_q, rows, kAttHeads, kAttDim, kv, dindex, doffsets, sinks, 0.05f, att_out,
                 {att_scratch, att_arrivals}, keys, {}, nullptr);
        }, iters);
      };
      const double cores = time(&keel::cuda::attend_decode), tensor = time(&keel::cuda::attend_mma_decode);
      fmt::print("{:>6} {:>6} {:>12.1f} {:>12.1f}\n", rows, keys, cores * 1e6, tensor * 1e6);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // each row out as it is measured, also when stopped part-way
  int iters = 50;
  bool attention_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else if (std::string(argv[i]) == "--attention") {
      attention_only = true;
    } else {
      std::fprintf(stderr, "usage: keel_gpu_bench [--iters N] [--attention]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0));

  const size_t copy_bytes = size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  check(cudaMalloc(&a, copy_bytes));
  check(cudaMalloc(&b, copy_bytes));
  check(cudaMemset(a, 1, copy_bytes));
  const double copy_s = seconds([&] { check(cudaMemcpy(b, a, copy_bytes, cudaMemcpyDeviceToDevice)); }, 10);
  const double copy_bw = 2.0 * copy_bytes / copy_s;
  cudaFree(a);
  cudaFree(b);
  fmt::print("device: {} (sm_{}{}), copy bandwidth {:.0f} GB/s (read + write, {} GiB)\n", prop.name, prop.major,
             prop.minor, copy_bw / 1e9, copy_bytes >> 30);
  if (attention_only) {
    decode_attention_table(iters);
    return 0;
  }
  fmt::print("{:<28} {:>6} {:>12} {:>10} {:>10} {:>8} {:>10} {:>8}\n", "case (out x in, format)", "kernel",
             "weight MiB", "us", "GB/s", "of copy", "floor us", "of floor");

  struct Case {
    const char* name;
    int64_t out, in;
    keel::WeightFormat format;
    keel::DType dtype;
  };
  // Flash shapes: q_b (32768 x 1024), o_b (4096 x 8192), an expert's w1 (2048 x 4096),
  // lm_head (129280 x 4096, bf16).
  const Case cases[] = {
      {"wq_a fp8", 1024, 4096, keel::WeightFormat::fp8_block, keel::DType::f8_e4m3},
      {"wq_b fp8", 32768, 1024, keel::WeightFormat::fp8_block, keel::DType::f8_e4m3},
      {"wo_b fp8", 4096, 8192, keel::WeightFormat::fp8_block, keel::DType::f8_e4m3},
      {"expert w1 mxfp4", 2048, 4096, keel::WeightFormat::mxfp4, keel::DType::i8},
      {"expert w1 x 48 mxfp4", 2048 * 48, 4096, keel::WeightFormat::mxfp4, keel::DType::i8},
      {"expert w1 x 48 nvfp4", 2048 * 48, 4096, keel::WeightFormat::nvfp4, keel::DType::u8},
      {"lm_head bf16", 129280, 4096, keel::WeightFormat::bf16, keel::DType::bf16},
  };
  // Each call reads the next of enough copies of the weight to pass 512 MiB, so that no
  // call finds its weight in L2 (as in a decode step, which reads every weight once).
  for (const Case& c : cases) {
    const keel::OwnedWeight host(normal(size_t(c.out * c.in)), c.out, c.in, c.format, c.dtype);
    std::vector<keel::cuda::DeviceWeight> copies{keel::cuda::upload(host.weight())};
    while (copies.size() * copies[0].bytes < (size_t{512} << 20)) copies.push_back(keel::cuda::upload(host.weight()));
    const std::vector<float> xs = normal(size_t(c.in));
    float *x = nullptr, *y = nullptr;
    check(cudaMalloc(reinterpret_cast<void**>(&x), c.in * sizeof(float)));
    check(cudaMalloc(reinterpret_cast<void**>(&y), c.out * sizeof(float)));
    check(cudaMemcpy(x, xs.data(), xs.size() * sizeof(float), cudaMemcpyHostToDevice));
    // The floor: a plain kernel reading the copies' codes in turn, its time scaled up to
    // their bytes with the scales (a few percent more).
    std::vector<const void*> codes;
    for (const keel::cuda::DeviceWeight& w : copies) codes.push_back(w.data);
    const size_t code_bytes = host.weight().data.nbytes();
    double floor = 1e30;  // the best of a few grid sizes
    for (const int per_multiprocessor : {2, 4, 8}) {
      size_t next = 0;
      floor = std::min(floor, seconds([&] { stream_read(codes[next++ % codes.size()], code_bytes, per_multiprocessor); },
                                      iters));
    }
    floor *= static_cast<double>(copies[0].bytes) / code_bytes;
    const auto row = [&](const char* name, const Kernel& k) {
      size_t next = 0;
      const double s = seconds([&] { k.run(copies[next++ % copies.size()], x, y, 1, nullptr); }, iters);
      check(cudaDeviceSynchronize());
      const double bw = copies[0].bytes / s;
      fmt::print("{:<28} {:>6} {:>12.1f} {:>10.1f} {:>10.0f} {:>7.1f}% {:>10.1f} {:>7.1f}%\n",
                 fmt::format("{} ({}x{})", c.name, c.out, c.in), name, copies[0].bytes / 1048576.0, s * 1e6, bw / 1e9,
                 100 * bw / copy_bw, floor * 1e6, 100 * floor / s);
    };
    for (const Kernel& k : kKernels) row(k.name, k);
    for (keel::cuda::DeviceWeight& w : copies) keel::cuda::release(w);
    cudaFree(x);
    cudaFree(y);
  }

  // One token's projections of one x, as a Flash decode layer makes them: one by one
  // (linear_mma each) against one launch (linear_mma_group). The x of a CSA layer's
  // attention feeds wq_a, wkv, the compressor's wkv and wgate and the indexer's
  // compressor wkv, wgate and weights_proj; the x of the MoE the router's gate and the
  // shared expert's w1 and w3. Each call takes the next of enough copies of the group to
  // pass 512 MiB (no weight found in L2).
  struct Group {
    const char* name;
    std::vector<Case> members;
  };
  const Case kWqA{"wq_a", 1024, 4096, keel::WeightFormat::fp8_block, keel::DType::f8_e4m3},
      kWkv{"wkv", 512, 4096, keel::WeightFormat::fp8_block, keel::DType::f8_e4m3},
      kCompressor{"compressor", 1024, 4096, keel::WeightFormat::bf16, keel::DType::bf16},
      kIndexCompressor{"indexer compressor", 256, 4096, keel::WeightFormat::bf16, keel::DType::bf16},
      kIndexWeights{"indexer weights", 64, 4096, keel::WeightFormat::bf16, keel::DType::bf16},
      kGate{"router", 256, 4096, keel::WeightFormat::bf16, keel::DType::bf16},
      kShared{"shared expert", 2048, 4096, keel::WeightFormat::fp8_block, keel::DType::f8_e4m3};
  const Group groups[] = {
      {"attention x (sliding)", {kWqA, kWkv}},
      {"attention x (CSA)", {kWqA, kWkv, kCompressor, kCompressor, kIndexCompressor, kIndexCompressor, kIndexWeights}},
      {"moe x", {kGate, kShared, kShared}},
  };
  fmt::print("\n{:<28} {:>8} {:>12} {:>12} {:>10} {:>12} {:>8}\n", "one token, one x", "weights", "MiB",
             "one by one", "group", "group GB/s", "of copy");
  for (const Group& g : groups) {
    std::vector<std::unique_ptr<keel::OwnedWeight>> hosts;
    for (const Case& c : g.members) {
      hosts.push_back(std::make_unique<keel::OwnedWeight>(normal(size_t(c.out * c.in)), c.out, c.in, c.format, c.dtype));
    }
    std::vector<std::vector<keel::cuda::DeviceWeight>> copies;  // copies[i]: one copy of the group
    std::vector<float*> ys;
    for (const Case& c : g.members) {
      float* y = nullptr;
      check(cudaMalloc(reinterpret_cast<void**>(&y), c.out * sizeof(float)));
      ys.push_back(y);
    }
    uint64_t group_bytes = 0;
    while (copies.empty() || copies.size() * group_bytes < (size_t{512} << 20)) {
      copies.emplace_back();
      group_bytes = 0;
      for (const auto& h : hosts) {
        copies.back().push_back(keel::cuda::upload(h->weight()));
        group_bytes += copies.back().back().bytes;
      }
    }
    const std::vector<float> xs = normal(4096);
    float* x = nullptr;
    check(cudaMalloc(reinterpret_cast<void**>(&x), xs.size() * sizeof(float)));
    check(cudaMemcpy(x, xs.data(), xs.size() * sizeof(float), cudaMemcpyHostToDevice));
    size_t next = 0;
    const double alone = seconds(
        [&] {
          const auto& ws = copies[next++ % copies.size()];
          for (size_t i = 0; i < ws.size(); ++i) keel::cuda::linear_mma(ws[i], x, ys[i], 1, nullptr);
        },
        iters);
    const double grouped = seconds(
        [&] {
          const auto& ws = copies[next++ % copies.size()];
          std::vector<keel::cuda::GemmProduct> products;
          for (size_t i = 0; i < ws.size(); ++i) products.push_back({&ws[i], ys[i]});
          keel::cuda::linear_mma_group(products, x, 1, nullptr);
        },
        iters);
    check(cudaDeviceSynchronize());
    const double bw = group_bytes / grouped;
    fmt::print("{:<28} {:>8} {:>12.1f} {:>10.1f}us {:>10.1f}us {:>12.0f} {:>7.1f}%\n", g.name, g.members.size(),
               group_bytes / 1048576.0, alone * 1e6, grouped * 1e6, bw / 1e9, 100 * bw / copy_bw);
    for (auto& ws : copies) {
      for (keel::cuda::DeviceWeight& w : ws) keel::cuda::release(w);
    }
    for (float* y : ys) cudaFree(y);
    cudaFree(x);
  }

  // One token's dense products in a chain, each taking the output of the one before as
  // its x, as a decode layer runs them (wq_a, wq_b, wo_b, then the shared expert's w1 and
  // w2; Flash's shapes, FP8): each alone (summed), launched one after the other, and
  // replayed from a CUDA graph (as the decode graphs run them: a launch may start while
  // the one before ends), against one read of all their bytes (the floor). What the
  // chain takes beyond its bytes at the copy bandwidth, per launch, is the price of a
  // product boundary, which no single product's row shows. Each call takes the next of 4
  // copies of the chain (no weight found in L2).
  {
    const keel::WeightFormat fp8 = keel::WeightFormat::fp8_block;
    const Case chain[] = {{"wq_a", 1024, 4096, fp8, keel::DType::f8_e4m3},
                          {"wq_b", 32768, 1024, fp8, keel::DType::f8_e4m3},
                          {"wo_b", 4096, 8192, fp8, keel::DType::f8_e4m3},
                          {"shared w1", 2048, 4096, fp8, keel::DType::f8_e4m3},
                          {"shared w2", 4096, 2048, fp8, keel::DType::f8_e4m3}};
    constexpr int kCopies = 4;
    std::vector<std::vector<keel::cuda::DeviceWeight>> copies(kCopies);
    std::vector<float*> ys;
    uint64_t chain_bytes = 0;
    for (const Case& c : chain) {
      const keel::OwnedWeight host(normal(size_t(c.out * c.in)), c.out, c.in, c.format, c.dtype);
      for (auto& ws : copies) ws.push_back(keel::cuda::upload(host.weight()));
      chain_bytes += copies[0].back().bytes;
      float* y = nullptr;
      check(cudaMalloc(reinterpret_cast<void**>(&y), c.out * sizeof(float)));
      ys.push_back(y);
    }
    int64_t widest = 0;  // each alone reads x: as wide as the widest product's input
    for (const Case& c : chain) widest = std::max(widest, c.in);
    const std::vector<float> xs = normal(size_t(widest));
    float* x = nullptr;
    check(cudaMalloc(reinterpret_cast<void**>(&x), xs.size() * sizeof(float)));
    check(cudaMemcpy(x, xs.data(), xs.size() * sizeof(float), cudaMemcpyHostToDevice));
    // Product i reads the first chain[i].in values of the one before's output.
    const auto run_chain = [&](const std::vector<keel::cuda::DeviceWeight>& ws, cudaStream_t stream) {
      const float* in = x;
      for (size_t i = 0; i < ws.size(); ++i) {
        keel::cuda::linear_mma(ws[i], in, ys[i], 1, stream);
        in = ys[i];
      }
    };
    double alone = 0;
    for (size_t i = 0; i < std::size(chain); ++i) {
      size_t next = 0;
      alone += seconds([&] { keel::cuda::linear_mma(copies[next++ % kCopies][i], x, ys[i], 1, nullptr); }, iters);
    }
    size_t next = 0;
    const double launched = seconds([&] { run_chain(copies[next++ % kCopies], nullptr); }, iters);
    cudaStream_t capturing = nullptr;
    check(cudaStreamCreateWithFlags(&capturing, cudaStreamNonBlocking));
    std::vector<cudaGraphExec_t> graphs;
    for (const auto& ws : copies) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      check(cudaStreamBeginCapture(capturing, cudaStreamCaptureModeThreadLocal));
      run_chain(ws, capturing);
      check(cudaStreamEndCapture(capturing, &graph));
      check(cudaGraphInstantiate(&exec, graph, 0));
      check(cudaGraphDestroy(graph));
      graphs.push_back(exec);
    }
    const double replayed = seconds([&] { check(cudaGraphLaunch(graphs[next++ % kCopies], nullptr)); }, iters);
    check(cudaDeviceSynchronize());
    void* raw = nullptr;  // the floor: kCopies times the chain's bytes, read a chain's worth at a time
    check(cudaMalloc(&raw, kCopies * chain_bytes));
    check(cudaMemset(raw, 1, kCopies * chain_bytes));
    double floor = 1e30;
    for (const int per_multiprocessor : {2, 4, 8}) {
      floor = std::min(floor, seconds([&] {
                         stream_read(static_cast<char*>(raw) + next++ % kCopies * chain_bytes, chain_bytes / 16 * 16,
                                     per_multiprocessor);
                       }, iters));
    }
    const double at_copy = chain_bytes / copy_bw;
    fmt::print("\none token's chain: wq_a, wq_b, wo_b, shared w1, w2 (fp8, {:.1f} MiB; at the copy bandwidth {:.1f} us, "
               "one read {:.1f} us)\n",
               chain_bytes / 1048576.0, at_copy * 1e6, floor * 1e6);
    fmt::print("{:<20} {:>10} {:>8} {:>18}\n", "how", "us", "of copy", "us a launch over");
    for (const auto& [how, s] : {std::pair<const char*, double>{"each alone, summed", alone},
                                 {"launched in turn", launched}, {"graph replay", replayed}}) {
      fmt::print("{:<20} {:>10.1f} {:>7.1f}% {:>18.2f}\n", how, s * 1e6, 100 * at_copy / s,
                 (s - at_copy) * 1e6 / std::size(chain));
    }
    for (cudaGraphExec_t g : graphs) cudaGraphExecDestroy(g);
    cudaStreamDestroy(capturing);
    cudaFree(raw);
    for (auto& ws : copies) {
      for (keel::cuda::DeviceWeight& w : ws) keel::cuda::release(w);
    }
    for (float* y : ys) cudaFree(y);
    cudaFree(x);
  }

  // Several rows of x per call (batched decode of many sequences, prefill): the GEMV
  // reads and decodes each weight chunk once per tile of 8 tokens, the MMA kernel once
  // per 16 tokens. GB/s counts the weight's bytes once per call, so it grows as more
  // tokens share each read; TFLOP/s counts 2·out·in per token.
  fmt::print("\n{:<28} {:>6} {:>7} {:>10} {:>10} {:>12} {:>8} {:>8}\n", "case (out x in, format)", "kernel", "tokens",
             "us", "us/token", "weight GB/s", "of copy", "TFLOP/s");
  const Case batched[] = {
      {"wo_b fp8", 4096, 8192, keel::WeightFormat::fp8_block, keel::DType::f8_e4m3},
      {"wq_b fp8", 32768, 1024, keel::WeightFormat::fp8_block, keel::DType::f8_e4m3},
      {"expert w1 mxfp4", 2048, 4096, keel::WeightFormat::mxfp4, keel::DType::i8},
  };
  const bool fp8_mma = prop.major * 10 + prop.minor >= 89;
  for (const Case& c : batched) {
    const keel::OwnedWeight host(normal(size_t(c.out * c.in)), c.out, c.in, c.format, c.dtype);
    keel::cuda::DeviceWeight w = keel::cuda::upload(host.weight());
    std::vector<Kernel> kernels(std::begin(kKernels), std::end(kKernels));
    if (fp8_mma && c.format == keel::WeightFormat::fp8_block) kernels.push_back({"w8a8", &keel::cuda::linear_w8a8});
    for (const int64_t tokens : {1, 8, 64, 256, 4096}) {
      const std::vector<float> xs = normal(size_t(tokens * c.in));
      float *x = nullptr, *y = nullptr;
      check(cudaMalloc(reinterpret_cast<void**>(&x), xs.size() * sizeof(float)));
      check(cudaMalloc(reinterpret_cast<void**>(&y), tokens * c.out * sizeof(float)));
      check(cudaMemcpy(x, xs.data(), xs.size() * sizeof(float), cudaMemcpyHostToDevice));
      for (const Kernel& k : kernels) {
        if (tokens > 256 && k.run == &keel::cuda::linear) continue;  // the GEMV is for few tokens
        const double s = seconds([&] { k.run(w, x, y, tokens, nullptr); }, iters);
        check(cudaDeviceSynchronize());
        const double bw = w.bytes / s;
        fmt::print("{:<28} {:>6} {:>7} {:>10.1f} {:>10.2f} {:>12.0f} {:>7.1f}% {:>8.1f}\n",
                   fmt::format("{} ({}x{})", c.name, c.out, c.in), k.name, tokens, s * 1e6, s * 1e6 / tokens,
                   bw / 1e9, 100 * bw / copy_bw, 2.0 * c.out * c.in * tokens / s / 1e12);
      }
      cudaFree(x);
      cudaFree(y);
    }
    keel::cuda::release(w);
  }

  // Routed experts as batched decode runs them: each token's 6 distinct random experts
  // of 256 (Flash's w1: 2048 x 4096 MXFP4), one (token, expert) pair per output row. The
  // GEMV reads an expert's weight once per pair, the MMA form once per group of up to 8
  // of its pairs. GB/s counts the distinct experts' bytes once per call. One token's
  // calls take the next of 32 sets of experts, so that no call finds its experts in L2;
  // at 8 tokens they fit in L2, and the iterations reread the same ones.
  {
    constexpr int kExperts = 256, kPerToken = 6;
    const int64_t out = 2048, in = 4096;
    const keel::OwnedWeight host(normal(size_t(out * in)), out, in, keel::WeightFormat::mxfp4, keel::DType::i8);
    std::vector<keel::cuda::DeviceWeight> table;  // one copy per expert: distinct bytes
    for (int e = 0; e < kExperts; ++e) table.push_back(keel::cuda::upload(host.weight()));
    keel::cuda::DeviceWeight* dtable = nullptr;
    check(cudaMalloc(reinterpret_cast<void**>(&dtable), kExperts * sizeof(keel::cuda::DeviceWeight)));
    check(cudaMemcpy(dtable, table.data(), kExperts * sizeof(keel::cuda::DeviceWeight), cudaMemcpyHostToDevice));
    using Pairs = void(const keel::cuda::DeviceWeight*, int, const keel::cuda::DeviceWeight&, const int32_t*, int64_t,
                       int, const float*, float*, int32_t*, void*, keel::cuda::ExpertIds);
    // "mma-s": the ids settled (one token's pairs ask for their weights before the wait,
    // here while the call before runs).
    struct Form {
      const char* name;
      Pairs* run;
      keel::cuda::ExpertIds ids;
    };
    const Form forms[] = {{"gemv", &keel::cuda::linear_pairs, keel::cuda::ExpertIds::just_written},
                          {"mma", &keel::cuda::linear_pairs_mma, keel::cuda::ExpertIds::just_written},
                          {"mma-s", &keel::cuda::linear_pairs_mma, keel::cuda::ExpertIds::settled}};
    fmt::print("\nrouted experts: {} of {}x{} mxfp4 ({:.1f} MiB each), {} per token\n", kExperts, out, in,
               table[0].bytes / 1048576.0, kPerToken);
    fmt::print("{:>7} {:>7} {:>8} {:>6} {:>10} {:>10} {:>8}\n", "tokens", "pairs", "experts", "kernel", "us",
               "GB/s", "of copy");
    std::mt19937 rng(3);
    for (const int64_t tokens : {1, 8, 64, 256}) {
      const int64_t pairs = tokens * kPerToken, sets = tokens == 1 ? 32 : 1;
      std::vector<int32_t> ids(sets * pairs), all(kExperts);
      std::iota(all.begin(), all.end(), 0);
      for (int64_t t = 0; t < sets * tokens; ++t) {
        std::shuffle(all.begin(), all.end(), rng);
        std::copy_n(all.begin(), kPerToken, ids.begin() + t * kPerToken);
      }
      const size_t distinct = std::set<int32_t>(ids.begin(), ids.begin() + pairs).size();
      const std::vector<float> xs = normal(size_t(tokens * in));
      float *x = nullptr, *y = nullptr;
      int32_t *dids = nullptr, *scratch = nullptr;
      check(cudaMalloc(reinterpret_cast<void**>(&x), xs.size() * sizeof(float)));
      check(cudaMalloc(reinterpret_cast<void**>(&y), pairs * out * sizeof(float)));
      check(cudaMalloc(reinterpret_cast<void**>(&dids), ids.size() * sizeof(int32_t)));
      check(cudaMalloc(reinterpret_cast<void**>(&scratch),
                       keel::cuda::linear_pairs_scratch(pairs, kExperts) * sizeof(int32_t)));
      check(cudaMemcpy(x, xs.data(), xs.size() * sizeof(float), cudaMemcpyHostToDevice));
      check(cudaMemcpy(dids, ids.data(), ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
      const auto row = [&](const Form& form) {
        int64_t next = 0;
        const double s = seconds(
            [&] {
              form.run(dtable, kExperts, table[0], dids + next++ % sets * pairs, pairs, kPerToken, x, y, scratch,
                       nullptr, form.ids);
            },
            iters);
        check(cudaDeviceSynchronize());
        const double bw = double(distinct) * table[0].bytes / s;
        fmt::print("{:>7} {:>7} {:>8} {:>6} {:>10.1f} {:>10.0f} {:>7.1f}%\n", tokens, pairs, distinct, form.name,
                   s * 1e6, bw / 1e9, 100 * bw / copy_bw);
      };
      for (const Form& form : forms) row(form);
      for (void* p : {static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(dids),
                      static_cast<void*>(scratch)})
        cudaFree(p);
    }
    cudaFree(dtable);
    for (keel::cuda::DeviceWeight& w : table) keel::cuda::release(w);
  }

  // Flash's indexer: 64 heads of 128, top 512 over CSA entries (one per 4 tokens). The
  // work follows the entries that exist; the configured maximum context (1M) appears
  // nowhere.
  constexpr int kHeads = 64, kDim = 128, kTop = 512, kRatio = 4;
  const int64_t most = (int64_t{512} << 10) / kRatio;
  float* keys = upload_floats(normal(most * kDim));
  float* q = upload_floats(normal(kHeads * kDim));
  float* weights = upload_floats(normal(kHeads));
  float* scores = nullptr;
  int32_t *visible = nullptr, *offsets = nullptr, *picked = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&scores), most * sizeof(float)));
  check(cudaMalloc(reinterpret_cast<void**>(&visible), sizeof(int32_t)));
  check(cudaMalloc(reinterpret_cast<void**>(&offsets), sizeof(int32_t)));
  check(cudaMalloc(reinterpret_cast<void**>(&picked), kTop * sizeof(int32_t)));
  check(cudaMemset(offsets, 0, sizeof(int32_t)));
  fmt::print("\nindexer + top-k, one decode token ({} heads x {}, top {}, one entry per {} tokens; max context 1M)\n",
             kHeads, kDim, kTop, kRatio);
  fmt::print("{:>10} {:>10} {:>10} {:>12}\n", "context", "entries", "us", "key GB/s");
  for (const int64_t context : {int64_t{4} << 10, int64_t{32} << 10, int64_t{128} << 10, int64_t{512} << 10}) {
    const auto entries = static_cast<int32_t>(context / kRatio);
    check(cudaMemcpy(visible, &entries, sizeof(int32_t), cudaMemcpyHostToDevice));
    const double s = seconds(
        [&] {
          keel::cuda::indexer_select(q, weights, 1, kHeads, kDim, keys, visible, entries, kTop, 0, offsets, picked,
                                     scores);
        },
        iters);
    fmt::print("{:>9}K {:>10} {:>10.1f} {:>12.0f}\n", context >> 10, entries, s * 1e6,
               entries * kDim * sizeof(float) / s / 1e9);
  }

  decode_attention_table(iters);
  return 0;
}
