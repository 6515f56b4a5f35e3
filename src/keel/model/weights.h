// Binds a checkpoint's tensors to the schema of its config, checking every expected
// tensor (and scale sidecar) for presence, shape and dtype before anything runs. All
// problems are collected and reported in one Error(weights_mismatch).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "io/config.h"
#include "io/names.h"
#include "io/safetensors.h"
#include "model/schema.h"
#include "quant/fp8_block.h"

namespace keel {

// One weight as stored: views into the mapped checkpoint, no copy.
struct Weight {
  const TensorSpec* spec = nullptr;
  WeightFormat format = WeightFormat::bf16;  // for floats: bf16, f32 (or f16 data) as stored
  TensorView data;                           // stored layout; fp4 packed [out, in/2]
  TensorView scale;                          // fp8_block / mxfp4 / nvfp4 only
  ScaleFormat scale_format = ScaleFormat::ue8m0;  // fp8_block: ue8m0 bytes or f32
  float global_scale = 1.0f;                 // nvfp4 only
};

class ModelWeights {
 public:
  // Throws Error(weights_mismatch) listing every missing or mismatched tensor.
  static ModelWeights bind(const Checkpoint& checkpoint, const ModelConfig& config);

  const Weight& at(const std::string& official_name) const;  // throws missing_tensor
  const std::vector<TensorSpec>& specs() const { return specs_; }
  Naming naming() const { return naming_; }
  // transformers never saves the MTP layer, so a checkpoint in its naming has none.
  bool has_mtp() const { return has_mtp_; }
  // Checkpoint tensors the schema does not use (reported, not an error).
  const std::vector<std::string>& unused() const { return unused_; }
  uint64_t stored_bytes() const { return stored_bytes_; }
  size_t size() const { return weights_.size(); }  // weights bound

 private:
  std::vector<TensorSpec> specs_;
  std::map<std::string, Weight> weights_;
  Naming naming_ = Naming::official;
  bool has_mtp_ = false;
  std::vector<std::string> unused_;
  uint64_t stored_bytes_ = 0;
};

}  // namespace keel
