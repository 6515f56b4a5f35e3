// Loading a model for a command, with a progress line on stderr.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "model/model.h"

namespace keel::cli {

// The user's kernel choices (keel run, keel bench): the backends of the target and of
// the draft (MTP) layers, and whether to print the whole plan.
struct KernelOptions {
  BackendChoices target, draft;
  bool verbose = false;
  std::string device = "cpu";  // cpu, cuda or cuda:N (cli/runner.h)
  int gpus = 0;                // > 1: expert parallel over GPUs 0..gpus-1 (overrides device)
  bool eager = false;          // GPU: decode steps launch kernel by kernel, no CUDA graphs
  // Several hosts, one process each (parallel::Ranks): hosts > 1 splits over hosts x gpus ranks.
  int hosts = 1, host_rank = 0;
  std::string nccl_id;
};
void add_kernel_options(CLI::App* cmd, KernelOptions& options);
// --hosts, --host-rank, --nccl-id: for the commands every host runs alike (run, bench, logits).
void add_host_options(CLI::App* cmd, KernelOptions& options);

// Loads the model on the CPU with those choices; unless quiet, a progress line while
// weights are read, then the plan's one-line summary (the whole plan when verbose).
std::unique_ptr<Model> load_model(const std::string& directory, bool quiet = false, const KernelOptions& kernels = {});

}  // namespace keel::cli
