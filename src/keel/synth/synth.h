// `keel synth`: random DeepSeek-V4 checkpoints of any shape, in the official format
// (FP8 block-scaled dense linears, MXFP4 routed experts, bf16/f32 elsewhere, the
// `.scale` sidecars, tid2eid), with a matching config.json. Used by tests and
// benchmarks. Every tensor is random: no zero sinks or biases, distinct tid2eid rows.
//
// Tensors are generated one at a time while the file is written, so a full-width
// Flash-shaped checkpoint of a few layers needs memory for one tensor only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/config.h"

namespace keel {

// Preset names: "tiny" (dsv4-forward.md §10 dimensions, every layer kind, runs
// anywhere), "small" (a few hundred MB, for CPU benchmarks), "flash" (DeepSeek-V4-Flash).
std::vector<std::string> synth_shapes();

struct SynthOptions {
  std::string shape = "tiny";
  int layers = 0;                  // trunk layers; 0 = the preset's own count
  int mtp_layers = -1;             // -1 = the preset's (1)
  uint64_t seed = 1;
  uint64_t shard_bytes = 4ull << 30;  // a new shard file once one would pass this size
};

// The config of a preset with the options applied (same path as reading config.json).
ModelConfig synth_config(const SynthOptions& options);

struct SynthResult {
  ModelConfig config;
  std::vector<std::string> files;  // written, relative to the directory
  uint64_t tensors = 0;
  uint64_t bytes = 0;
};

// Writes config.json and the safetensors file(s) (plus model.safetensors.index.json
// when sharded) into `directory`, creating it.
SynthResult synth_checkpoint(const SynthOptions& options, const std::string& directory);

}  // namespace keel
