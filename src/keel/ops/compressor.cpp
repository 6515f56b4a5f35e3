#include "ops/compressor.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace keel {

void pool_slots(std::span<const float> values, std::span<const float> gates, int slots, int dim,
                std::span<float> out) {
  for (int c = 0; c < dim; ++c) {
    float top = -std::numeric_limits<float>::infinity();
    for (int s = 0; s < slots; ++s) top = std::max(top, gates[s * dim + c]);
    float sum = 0.0f, acc = 0.0f;
    for (int s = 0; s < slots; ++s) {
      const float e = std::exp(gates[s * dim + c] - top);
      sum += e;
      acc += e * values[s * dim + c];
    }
    out[c] = acc / sum;
  }
}

}  // namespace keel
