#include "cli/load_model.h"

#include <chrono>
#include <cstdio>
#include <fmt/format.h>

namespace keel::cli {

void add_kernel_options(CLI::App* cmd, KernelOptions& o) {
  for (const Backend b : all_backends()) {
    cmd->add_option(flag(b, ModelRole::target), o.target[b], "Kernel for the target's ops of this kind (default auto)");
    cmd->add_option(flag(b, ModelRole::draft), o.draft[b], "Kernel for the draft (MTP) layers (default: as the target)");
  }
  cmd->add_flag("--verbose", o.verbose, "Print the whole kernel plan");
  cmd->add_option("--device", o.device, "Where the model runs: cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--gpus", o.gpus, "Split the model over GPUs 0..N-1 (expert parallel, see keel plan --gpus)")
      ->check(CLI::Range(1, 64));
  cmd->add_flag("--eager", o.eager, "GPU: launch decode steps kernel by kernel instead of replaying CUDA graphs");
}

void add_host_options(CLI::App* cmd, KernelOptions& o) {
  cmd->add_option("--hosts", o.hosts, "Several hosts, one process each with the same command: the ranks are hosts x --gpus")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--host-rank", o.host_rank, "With --hosts: this host's place, 0..hosts-1 (host 0 writes --nccl-id)")
      ->check(CLI::Range(0, 1023));
  cmd->add_option("--nccl-id", o.nccl_id,
                  "With --hosts: a file every host can read (shared storage) that host 0 writes NCCL's unique id to; "
                  "it must not exist at launch and is removed once all ranks have joined");
}

std::unique_ptr<Model> load_model(const std::string& directory, bool quiet, const KernelOptions& kernels) {
  const auto start = std::chrono::steady_clock::now();
  Model::Progress progress;
  if (!quiet) {
    // At most a few updates a second: a line per percent would flood a log.
    progress = [last = start](uint64_t done, uint64_t total) mutable {
      const auto now = std::chrono::steady_clock::now();
      if (done < total && now - last < std::chrono::milliseconds(200)) return;
      last = now;
      fmt::print(stderr, "\rloading weights: {:3.0f}% ({:.1f} / {:.1f} MiB)", total ? 100.0 * done / total : 100.0,
                 done / 1048576.0, total / 1048576.0);
      std::fflush(stderr);
    };
  }
  auto model = Model::load(directory, progress, kernels.target, kernels.draft);
  if (!quiet) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print(stderr, "\r{:<60}\rloaded {} ({} layers, {:.1f} MiB) in {:.2f} s\n", "", directory, model->config().num_hidden_layers,
               model->weights().stored_bytes() / 1048576.0, s);
    fmt::print(stderr, "{}\n", model->plan().summary());
  }
  if (kernels.verbose) fmt::print(stderr, "{}", model->plan().table());
  return model;
}

}  // namespace keel::cli
