#include "model/kernels.h"

namespace keel {
namespace {

// Binds `slot` to the plan's kernel for the op when the plan has an entry for it. (Not
// named `bind`: argument-dependent lookup would find std::bind for span-taking kernels.)
template <typename Fn>
void bind_entry(LayerKernels& k, const Plan& plan, int layer, ModelRole role, Op op, Fn*& slot,
                std::optional<WeightFormat> format = {}) {
  const PlanEntry* entry = plan.find(layer, role, op, format);
  if (!entry) return;
  slot = entry->kernel->entry_as<Fn>();
  k.used.push_back(entry->kernel);
}

}  // namespace

LayerKernels bind_kernels(const Plan& plan, int layer, ModelRole role) {
  LayerKernels k;
  for (const WeightFormat f : all_weight_formats()) {
    const auto i = static_cast<size_t>(f);
    bind_entry(k, plan, layer, role, layer < 0 ? Op::lm_head : Op::dense_gemm, k.gemm[i], f);
    bind_entry(k, plan, layer, role, Op::moe_gemm, k.experts[i], f);
    bind_entry(k, plan, layer, role, Op::embedding, k.embedding, f);
  }
  bind_entry(k, plan, layer, role, Op::attention_prefill, k.attend_prefill);
  bind_entry(k, plan, layer, role, Op::attention_decode, k.attend_decode);
  bind_entry(k, plan, layer, role, Op::compressor, k.pool);
  bind_entry(k, plan, layer, role, Op::indexer, k.index);
  bind_entry(k, plan, layer, role, Op::mhc, k.mix);
  bind_entry(k, plan, layer, role, Op::norm, k.norm);
  return k;
}

}  // namespace keel
