// keel synth: write a random DeepSeek-V4 checkpoint of a preset shape.
#include <chrono>
#include <fmt/format.h>

#include "cli/commands.h"
#include "synth/synth.h"

namespace keel::cli {

void add_synth(CLI::App& app) {
  auto* cmd = app.add_subcommand("synth", "Write a random DeepSeek-V4 checkpoint (official format)");
  auto options = std::make_shared<SynthOptions>();
  auto out = std::make_shared<std::string>();
  auto shard_mb = std::make_shared<uint64_t>(4096);
  std::string shapes;
  for (const auto& s : synth_shapes()) shapes += (shapes.empty() ? "" : "|") + s;
  cmd->add_option("--shape", options->shape, "Preset shape: " + shapes)->capture_default_str();
  cmd->add_option("--layers", options->layers, "Trunk layers (default: the preset's)");
  cmd->add_option("--mtp-layers", options->mtp_layers, "MTP layers (default 1)");
  cmd->add_option("--seed", options->seed, "Random seed")->capture_default_str();
  cmd->add_option("--shard-mb", *shard_mb, "Start a new shard file past this size (MiB)")->capture_default_str();
  cmd->add_option("--out", *out, "Output directory")->required();
  cmd->callback([options, out, shard_mb] {
    options->shard_bytes = *shard_mb << 20;
    const auto start = std::chrono::steady_clock::now();
    const SynthResult r = synth_checkpoint(*options, *out);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    fmt::print("wrote {}: {} tensors, {:.1f} MiB in {} file(s), {:.1f} s\n", *out, r.tensors,
               r.bytes / 1048576.0, r.files.size(), seconds);
  });
}

}  // namespace keel::cli
