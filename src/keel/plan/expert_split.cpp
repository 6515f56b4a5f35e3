#include "plan/expert_split.h"

#include <fmt/format.h>

#include "base/error.h"

namespace keel {

std::vector<int64_t> ExpertSplit::experts_of(int rank, int64_t experts) const {
  std::vector<int64_t> out;
  for (int64_t e = 0; e < experts; ++e) {
    if (owner(e) == rank) out.push_back(e);
  }
  return out;
}

std::string ExpertSplit::describe(const ModelConfig& c) const {
  const int per_host = ranks / hosts;
  std::string out = fmt::format(
      "expert parallel over {} GPUs{}: routed expert e on rank e % {}; attention, compressors, indexer, shared "
      "expert, embedding and head replicated; one all-reduce of the MoE output per MoE layer ({} per token)\n",
      ranks, hosts > 1 ? fmt::format(" ({} hosts of {})", hosts, per_host) : "", ranks, c.num_hidden_layers);
  for (int r = 0; r < ranks; ++r) {
    const auto held = experts_of(r, c.n_routed_experts);
    const std::string where =
        hosts > 1 ? fmt::format("host {} GPU {}", r / per_host, r % per_host) : fmt::format("GPU {}", r);
    out += fmt::format("  rank {}: {}, {} of {} routed experts per layer (", r, where, held.size(), c.n_routed_experts);
    for (size_t i = 0; i < held.size() && i < 3; ++i) out += fmt::format("{}{}", i ? "," : "", held[i]);
    if (held.size() > 3) out += fmt::format(",..,{}", held.back());
    out += r == 0 ? "), runs the shared expert\n" : ")\n";
  }
  return out;
}

void Ranks::check() const {
  if (gpus < 1) fail(ErrorCode::usage, {.field = "--gpus"}, fmt::format("{} GPUs per host", gpus));
  if (hosts < 1 || host < 0 || host >= hosts) {
    fail(ErrorCode::usage, {.field = "--host-rank"}, fmt::format("host {} of {}: the host rank is 0..hosts-1", host, hosts));
  }
  if (hosts > 1 && id_file.empty()) {
    fail(ErrorCode::usage, {.field = "--nccl-id"}, "several hosts share NCCL's unique id through --nccl-id FILE");
  }
}

}  // namespace keel
