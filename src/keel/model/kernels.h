// The CPU forward pass calls its kernels through the plan: each layer binds, once at
// load, the entry points the plan chose for its ops (plan/plan.h), and checks before
// running a layer that every one of them was validated for the CPU.
#pragma once

#include <array>
#include <vector>

#include "ops/attention.h"
#include "ops/compressor.h"
#include "ops/hyper.h"
#include "ops/linear.h"
#include "ops/norm.h"
#include "plan/plan.h"

namespace keel {

struct LayerKernels {
  using Linear = void(const Weight&, ConstRows, Rows, RowRange);
  using Embedding = void(const Weight&, int64_t, std::span<float>);

  std::array<Linear*, 5> gemm{};     // by WeightFormat: dense_gemm (lm_head at top level)
  std::array<Linear*, 5> experts{};  // by WeightFormat: moe_gemm
  Embedding* embedding = nullptr;    // top level only
  decltype(&attend) attend_prefill = nullptr;
  decltype(&attend) attend_decode = nullptr;
  decltype(&pool_slots) pool = nullptr;
  decltype(&indexer_select) index = nullptr;
  decltype(&hyper_mix) mix = nullptr;
  decltype(&rms_norm) norm = nullptr;
  std::vector<const KernelInfo*> used;  // what `check` verifies

  // By the format the schema (and so the plan) gives the tensor; a float tensor may be
  // stored as f32 where the schema says bf16, which the kernel reads either way.
  Linear* linear_for(const Weight& w) const { return gemm[static_cast<size_t>(w.spec->format)]; }
  Linear* expert_for(const Weight& w) const { return experts[static_cast<size_t>(w.spec->format)]; }
  // Error(kernel_plan) if a bound kernel was not planned for `running`.
  void check(Arch running) const {
    for (const KernelInfo* k : used) check_runs_on(*k, running);
  }
};

// Binds `slot` to the plan's kernel for the op when the plan has an entry for it, and
// records the kernel in `used` for the caller's check_runs_on. (Not named `bind`:
// argument-dependent lookup would find std::bind for span-taking kernels.)
template <typename Fn>
void bind_entry(std::vector<const KernelInfo*>& used, const Plan& plan, int layer, ModelRole role, Op op, Fn*& slot,
                std::optional<WeightFormat> format = {}) {
  const PlanEntry* entry = plan.find(layer, role, op, format);
  if (!entry) return;
  slot = entry->kernel->template entry_as<Fn>();
  used.push_back(entry->kernel);
}

// Binds the slots every backend's kernel table has, by the same names: gemm and experts
// (per WeightFormat), embedding, attend_prefill, attend_decode, pool, index, mix, norm.
// Each slot's type is the signature that backend calls, checked against the entry.
template <typename Table>
void bind_common(Table& k, const Plan& plan, int layer, ModelRole role) {
  for (const WeightFormat f : all_weight_formats()) {
    const auto i = static_cast<size_t>(f);
    bind_entry(k.used, plan, layer, role, layer < 0 ? Op::lm_head : Op::dense_gemm, k.gemm[i], f);
    bind_entry(k.used, plan, layer, role, Op::moe_gemm, k.experts[i], f);
    bind_entry(k.used, plan, layer, role, Op::embedding, k.embedding, f);
  }
  bind_entry(k.used, plan, layer, role, Op::attention_prefill, k.attend_prefill);
  bind_entry(k.used, plan, layer, role, Op::attention_decode, k.attend_decode);
  bind_entry(k.used, plan, layer, role, Op::compressor, k.pool);
  bind_entry(k.used, plan, layer, role, Op::indexer, k.index);
  bind_entry(k.used, plan, layer, role, Op::mhc, k.mix);
  bind_entry(k.used, plan, layer, role, Op::norm, k.norm);
}

// The kernels of `layer` (-1: top level) for `role`, from a plan made for Arch::cpu.
LayerKernels bind_kernels(const Plan& plan, int layer, ModelRole role);

}  // namespace keel
