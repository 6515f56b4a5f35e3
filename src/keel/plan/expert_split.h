// How expert parallelism splits a model over ranks (parallel/expert_parallel.h): routed
// expert e lives on rank e % ranks, so every rank holds every ranks-th expert of every
// MoE layer (MTP included) and the hash layers' fixed assignments spread as evenly as
// the learned ones. Attention, compressors, the indexer, the shared expert (run by
// rank 0), embedding and head are replicated. `keel plan --gpus N` prints this.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/config.h"

namespace keel {

struct ExpertSplit {
  int ranks = 1;

  int owner(int64_t expert) const { return static_cast<int>(expert % ranks); }
  std::vector<int64_t> experts_of(int rank, int64_t experts) const;
  // One line for the split, then one per rank: its experts and what it runs besides.
  std::string describe(const ModelConfig& config) const;
};

}  // namespace keel
