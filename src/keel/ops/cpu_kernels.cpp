// The CPU reference kernels, registered next to the functions that implement them: each
// entry holds the address of the function the CPU forward pass calls, so the registry
// lists exactly what is compiled in. Registration is an explicit function that
// Registry::builtin() calls (not a static initializer, which a static library's link
// could drop together with this otherwise-unreferenced object file).
#include <vector>

#include "ops/attention.h"
#include "ops/compressor.h"
#include "ops/hyper.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/sampling.h"
#include "plan/kernel_registry.h"

namespace keel {
namespace {

// Sampling on the CPU is the Sampler's per-step call.
int32_t sample_cpu(Sampler& sampler, std::span<const float> logits) { return sampler.next(logits); }

// Every CPU kernel reads f32 activations; the linears decode any stored format row by
// row (ops/linear.h).
template <typename Fn>
void add_cpu(Registry& r, Op op, Fn* fn, const char* summary, std::vector<WeightFormat> formats = {}) {
  KernelInfo k{.name = "cpu",
               .op = op,
               .archs = {Arch::cpu},
               .formats = std::move(formats),
               .activations = {Activation::f32},
               .priority = 0,
               .summary = summary};
  r.add(std::move(k.with_entry(fn)));
}

}  // namespace

void register_cpu_kernels(Registry& r) {
  const auto every = [] {
    const auto all = all_weight_formats();
    return std::vector<WeightFormat>(all.begin(), all.end());
  };
  add_cpu(r, Op::embedding, &decode_row, "one row of the table, decoded from its stored format", every());
  add_cpu(r, Op::dense_gemm, &linear, "y = x W^T, rows decoded per thread (OpenMP over output rows)", every());
  add_cpu(r, Op::moe_gemm, &linear, "each routed expert's rows through the dense linear", every());
  add_cpu(r, Op::lm_head, &linear, "the dense linear over the vocabulary", every());
  add_cpu(r, Op::moe_routing, &route, "sqrtsoftplus/sigmoid scores, biased top-k or tid2eid, normalized weights");
  add_cpu(r, Op::attention_prefill, &attend, "per token over window + compressed keys, with sink");
  add_cpu(r, Op::attention_decode, &attend, "per token over window + compressed keys, with sink");
  add_cpu(r, Op::attention_verify, &attend, "per token over window + compressed keys, with sink");
  add_cpu(r, Op::compressor, &pool_slots, "softmax pooling of a window's slots");
  add_cpu(r, Op::indexer, &indexer_select, "ReLU-weighted scores over visible entries (with top-k)");
  add_cpu(r, Op::topk, &indexer_select, "fused into the indexer's scoring pass");
  add_cpu(r, Op::mhc, &hyper_mix, "per-token mix with Sinkhorn projection, collapse, expand");
  add_cpu(r, Op::norm, &rms_norm, "RMSNorm in f32");
  add_cpu(r, Op::sampling, &sample_cpu, "greedy or temperature/top-k/top-p/min-p, seeded");
  // A GPU backend returns logits to the host, where the same sampler picks the token.
  KernelInfo host{.name = "host",
                  .op = Op::sampling,
                  .archs = ArchSet::gpus_from(Arch::sm_80),
                  .activations = {Activation::f32},
                  .priority = 0,
                  .summary = "the CPU sampler over logits copied back from the GPU"};
  r.add(std::move(host.with_entry(&sample_cpu)));
}

}  // namespace keel
