// How expert parallelism splits a model over ranks (parallel/expert_parallel.h): routed
// expert e lives on rank e % ranks, so every rank holds every ranks-th expert of every
// MoE layer (MTP included) and the hash layers' fixed assignments spread as evenly as
// the learned ones. Attention, compressors, the indexer, the shared expert (run by
// rank 0), embedding and head are replicated. `keel plan --gpus N` prints this.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "io/config.h"

namespace keel {

struct ExpertSplit {
  int ranks = 1;
  int hosts = 1;  // rank r runs on host r / (ranks / hosts), on that host's GPU r % (ranks / hosts)

  int owner(int64_t expert) const { return static_cast<int>(expert % ranks); }
  std::vector<int64_t> experts_of(int rank, int64_t experts) const;
  // One line for the split, then one per rank: its experts and what it runs besides.
  std::string describe(const ModelConfig& config) const;
};

// Which of all the ranks this process drives. One host: all of them. Several hosts,
// one process each: host h drives its GPUs 0..gpus-1 as ranks h*gpus .. h*gpus+gpus-1.
// Host 0 makes NCCL's unique id and writes it to `id_file` (a path every host reads,
// e.g. on shared storage; it must not exist yet, and is removed once every rank has
// joined); the other hosts wait up to `wait` for it. NCCL's own bootstrap then
// connects them.
struct Ranks {
  int gpus = 1;  // GPUs of this host used, 0..gpus-1
  int hosts = 1;
  int host = 0;  // this process's place among the hosts
  std::string id_file;
  std::chrono::seconds wait{300};

  int world() const { return gpus * hosts; }
  int first() const { return host * gpus; }
  // Throws Error(usage) naming the option (--gpus, --host-rank, --nccl-id) that is off.
  void check() const;
};

}  // namespace keel
