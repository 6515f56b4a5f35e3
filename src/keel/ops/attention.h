// The attention core of DeepSeek-V4 (dsv4-forward.md §5.4, §5.8): one shared K=V head
// per token, each query head a softmax over its key set plus a learned sink logit; and
// the lightning indexer that picks which compressed entries a CSA query sees.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace keel {

// out_h = Σ_j P_hj · key_j with P_h = softmax({q_h · key_j · scale}_j ∪ {sink_h}) and the
// sink's share dropped. `q` and `out` are [heads, head_dim]; each key has head_dim floats.
void attend(std::span<const float> q, int heads, int head_dim, std::span<const float* const> keys,
            std::span<const float> sinks, float scale, std::span<float> out);

// score_w = Σ_h weight_h · ReLU(q_h · key_w) · key_dim^-0.5 for every entry of `keys`
// (the visible ones, key_dim floats each); returns the indices of the min(k, visible)
// highest scores (ties: the lower index first).
std::vector<int64_t> indexer_select(std::span<const float> q, std::span<const float> weights, int heads,
                                    int key_dim, std::span<const float* const> keys, int k);

}  // namespace keel
