#include "model/kernels.h"

namespace keel {

LayerKernels bind_kernels(const Plan& plan, int layer, ModelRole role) {
  LayerKernels k;
  bind_common(k, plan, layer, role);
  return k;
}

}  // namespace keel
