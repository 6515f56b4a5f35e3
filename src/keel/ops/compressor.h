// Compressed attention entries (dsv4-forward.md §5.6, §5.7): a window of token
// projections pooled into one vector by a per-channel softmax over the window's slots.
#pragma once

#include <span>

namespace keel {

// out[c] = Σ_s softmax_s(gates[s, c]) · values[s, c] over `slots` rows of `dim`.
void pool_slots(std::span<const float> values, std::span<const float> gates, int slots, int dim,
                std::span<float> out);

}  // namespace keel
