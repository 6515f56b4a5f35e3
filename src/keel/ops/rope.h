// Rotary position embedding as DeepSeek-V4 applies it (dsv4-forward.md §2.3): adjacent
// channel pairs (2i, 2i+1) of the trailing `rope_dim` channels rotate; the leading
// "nope" channels do not. The "compress" rope of CSA/HCA layers adds YaRN frequency
// blending (no attention factor).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "io/config.h"

namespace keel {

class Rope {
 public:
  Rope() = default;
  explicit Rope(const RopeConfig& config);

  // Rotates the trailing rope_dim channels of `head` by angle position · f_i, or by
  // −position · f_i when `inverse` (the attention output un-rotates).
  void apply(std::span<float> head, int64_t position, bool inverse = false) const;
  // Every `head_dim` slice of `heads`.
  void apply_heads(std::span<float> heads, int head_dim, int64_t position, bool inverse = false) const;

  const std::vector<float>& inv_freq() const { return inv_freq_; }
  int rope_dim() const { return rope_dim_; }

 private:
  int rope_dim_ = 0;
  std::vector<float> inv_freq_;
};

}  // namespace keel
