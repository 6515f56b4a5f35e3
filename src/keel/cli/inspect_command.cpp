// keel inspect: read a checkpoint, check every tensor against its config, summarize.
#include <fmt/format.h>

#include <map>

#include "cli/commands.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "model/weights.h"

namespace keel::cli {
namespace {

void inspect(const std::string& dir) {
  const ModelConfig config = load_config(dir);
  fmt::print("{}\n", describe(config));
  const Checkpoint ckpt = Checkpoint::open(dir);
  const ModelWeights weights = ModelWeights::bind(ckpt, config);

  std::map<std::string, std::pair<uint64_t, uint64_t>> by_dtype;  // count, bytes
  uint64_t total = 0;
  for (const auto& name : ckpt.names()) {
    const TensorEntry* e = ckpt.find(name);
    auto& [count, bytes] = by_dtype[std::string(traits(e->dtype).safetensors_name)];
    ++count;
    bytes += e->end - e->begin;
    total += e->end - e->begin;
  }
  fmt::print("checkpoint: {} tensors in {} file(s), {:.1f} MiB, {} naming\n", ckpt.names().size(),
             ckpt.files().size(), total / 1048576.0, name(weights.naming()));
  for (const auto& [dtype, cb] : by_dtype)
    fmt::print("  {:<8} {:>7} tensors {:>12.1f} MiB\n", dtype, cb.first, cb.second / 1048576.0);
  fmt::print("weights: {} expected tensors present with the expected shapes and dtypes{}\n",
             weights.size(), weights.has_mtp() ? " (MTP layer included)" : "");
  if (!weights.unused().empty())
    fmt::print("unused: {} tensor(s), e.g. '{}'\n", weights.unused().size(), weights.unused().front());
}

}  // namespace

void add_inspect(CLI::App& app) {
  auto* cmd = app.add_subcommand("inspect", "Check a checkpoint against its config and summarize it");
  auto dir = std::make_shared<std::string>();
  cmd->add_option("--model", *dir, "Checkpoint directory (config.json + safetensors)")->required();
  cmd->callback([dir] { inspect(*dir); });
}

}  // namespace keel::cli
