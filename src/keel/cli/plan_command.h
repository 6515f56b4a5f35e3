// The kernel-plan options of every command that runs a model (`keel plan`, and `keel run`
// and `keel serve` as they adopt them), and the plan they resolve to.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "io/config.h"
#include "plan/plan.h"

namespace keel::cli {

struct PlanOptions {
  std::string arch;  // "": the GPU found at run time, else cpu
  BackendChoices target, draft;
  std::string expert_format, draft_expert_format;  // "": as the config says
};

// --arch, --gemm-backend, --moe-backend, --attention-backend, their --draft-* forms,
// --expert-format and --draft-expert-format.
void add_plan_options(CLI::App* cmd, PlanOptions& options);

// The architecture the plan is for: --arch when given, else GPU 0 when this binary has
// CUDA and a GPU is present, else cpu; `source` says which, for the log.
Arch plan_arch(const PlanOptions& options, std::string* source = nullptr);

// Resolves the plan for `config` (Error(kernel_plan) listing every problem).
Plan make_plan(const ModelConfig& config, const PlanOptions& options, Arch arch);

}  // namespace keel::cli
