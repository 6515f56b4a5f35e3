// The kernel plan: one resolver chooses the kernel of every op of every layer, for the
// target model (the trunk) and the draft model (the MTP layers) alike, from the registry
// of what this binary holds, before any weight is loaded. The rules (docs/kernel-plan.md):
//
//  1. `auto` (the default) picks the highest-priority registered kernel that runs on the
//     architecture and takes the op's weight format (and handles the layer's attention
//     kind).
//  2. An explicit target choice (--gemm-backend, --moe-backend, --attention-backend)
//     applies to the draft as well, unless the matching --draft-* option is given
//     (which may itself be `auto`).
//  3. An explicit choice that cannot run an op it covers (wrong architecture, format or
//     attention kind, or no kernel of that name for the op) is an error, never replaced
//     by another kernel. So is an op that no kernel can run. All problems are reported
//     at once, each naming the layers, role, op, format, architecture, the kernels that
//     would run, and the flag to change.
//
// The plan is data: the model calls each kernel through its entry, and the kernel's
// caller checks (check_runs_on) that it runs on the architecture the plan was made for.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "io/config.h"
#include "plan/arch.h"
#include "plan/kernel_registry.h"

namespace keel {

// Which model an op serves: the target (the trunk) or the draft (the MTP layers).
enum class ModelRole : uint8_t { target, draft };
const char* name(ModelRole role);

// The ops a user chooses kernels for; every other op is always `auto`.
enum class Backend : uint8_t {
  gemm,       // dense_gemm, lm_head
  moe,        // moe_gemm
  attention,  // attention_prefill, attention_decode, attention_verify
};
std::span<const Backend> all_backends();
std::span<const Op> ops_of(Backend backend);
// "--moe-backend" for the target, "--draft-moe-backend" for the draft.
const char* flag(Backend backend, ModelRole role);

// A kernel name or "auto" per backend. Target: "" means auto. Draft: "" means as the
// target.
struct BackendChoices {
  std::string gemm, moe, attention;
  const std::string& operator[](Backend backend) const;
  std::string& operator[](Backend backend);
};

struct PlanRequest {
  const ModelConfig& config;
  Arch arch = Arch::cpu;
  BackendChoices target;
  BackendChoices draft;
  // The MTP layers' routed experts, when stored in another format than the trunk's
  // (a separately quantized draft).
  std::optional<WeightFormat> draft_expert_format;
};

struct PlanEntry {
  int layer = -1;  // -1: top level (embedding, hc_head, final norm, lm_head, sampling);
                   // num_hidden_layers + d: MTP layer d
  ModelRole role = ModelRole::target;
  Op op = Op::norm;
  std::optional<WeightFormat> format;  // for ops that read weights
  const KernelInfo* kernel = nullptr;  // points into the registry the plan was made from
  std::string reason;
};

struct Plan {
  Arch arch = Arch::cpu;
  int trunk_layers = 0;
  int mtp_layers = 0;
  std::vector<PlanEntry> entries;

  const PlanEntry* find(int layer, ModelRole role, Op op, std::optional<WeightFormat> format = {}) const;
  // The kernel of an entry; Error(kernel_plan) when the plan has no such entry.
  const KernelInfo& kernel(int layer, ModelRole role, Op op, std::optional<WeightFormat> format = {}) const;

  // {"arch", "entries": [{"layer", "role", "op", "kernel", "archs": [...], "formats": [...],
  //   "reason"}, ...]}; "formats" is the weight format read, [] for ops without weights.
  std::string to_json() const;
  // One row per run of layers that resolved alike, or one per entry.
  std::string table(bool per_layer = false) const;
  // One line: the arch, the layers, and how many entries each kernel serves.
  std::string summary() const;
};

// Throws Error(usage) for an unknown kernel name or a --draft-* option on a model without
// MTP layers, Error(kernel_plan) listing every op that cannot be planned.
Plan resolve_plan(const PlanRequest& request, const Registry& registry = Registry::builtin());

// "layer 3", "mtp.0 (layer 43)", "top level".
std::string layer_label(int layer, int trunk_layers);
// Sorted layers in short form: "top level, layers 0-1, 2,4,..,42".
std::string layers_label(std::vector<int> layers, int trunk_layers);

}  // namespace keel
