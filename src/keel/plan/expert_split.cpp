#include "plan/expert_split.h"

#include <fmt/format.h>

namespace keel {

std::vector<int64_t> ExpertSplit::experts_of(int rank, int64_t experts) const {
  std::vector<int64_t> out;
  for (int64_t e = 0; e < experts; ++e) {
    if (owner(e) == rank) out.push_back(e);
  }
  return out;
}

std::string ExpertSplit::describe(const ModelConfig& c) const {
  std::string out = fmt::format(
      "expert parallel over {} GPUs: routed expert e on rank e % {}; attention, compressors, indexer, shared "
      "expert, embedding and head replicated; one all-reduce of the MoE output per MoE layer ({} per token)\n",
      ranks, ranks, c.num_hidden_layers);
  for (int r = 0; r < ranks; ++r) {
    const auto held = experts_of(r, c.n_routed_experts);
    out += fmt::format("  rank {}: GPU {}, {} of {} routed experts per layer (", r, r, held.size(), c.n_routed_experts);
    for (size_t i = 0; i < held.size() && i < 3; ++i) out += fmt::format("{}{}", i ? "," : "", held[i]);
    if (held.size() > 3) out += fmt::format(",..,{}", held.back());
    out += r == 0 ? "), runs the shared expert\n" : ")\n";
  }
  return out;
}

}  // namespace keel
