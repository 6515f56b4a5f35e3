// Every tensor a DeepSeek-V4 checkpoint holds for a given config: official name,
// logical shape, and how it may be stored. `keel synth` writes from this list and the
// loader checks a checkpoint against it, so the two can never disagree.
//
// Shapes follow dsv4-checkpoint.md §1.2 (linears are [out, in]); for packed FP4 the
// stored shape is [out, in/2], scales are described by `scale_shape`.
#pragma once

#include <string>
#include <vector>

#include "base/tensor.h"
#include "io/config.h"

namespace keel {

enum class TensorRole : uint8_t {
  linear,     // a matrix multiplied by activations; stored in `format`
  norm,       // an RMSNorm weight (bf16 in official checkpoints)
  parameter,  // other float parameters: hc_*, attn_sink, compressor ape, router bias (f32)
  table,      // integer lookup table: the hash router's tid2eid
};

struct TensorSpec {
  std::string name;     // official name, e.g. "layers.3.attn.wq_a.weight"
  Shape shape;          // logical shape
  TensorRole role;
  WeightFormat format;  // linears: how they are stored; norms/parameters: bf16 or f32 as
                        // shipped; tables: unused (always an integer dtype)
  int layer = -1;       // -1: top level; num_hidden_layers + d: MTP layer d
};

const char* name(TensorRole role);

// In the order a checkpoint is written: top level, then layer by layer, then MTP.
std::vector<TensorSpec> expected_tensors(const ModelConfig& config);

// The official name prefix of layer `layer` ("layers.7." or, past the trunk, "mtp.0.").
std::string layer_prefix(const ModelConfig& config, int layer);

// The stored shape of a linear's weight and of its scale sidecar in `format`.
Shape stored_shape(const TensorSpec& spec);
Shape scale_shape(const TensorSpec& spec, const ModelConfig& config);

}  // namespace keel
