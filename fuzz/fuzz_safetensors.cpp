// libFuzzer target for the safetensors header parser. keel::Error is the expected way
// to refuse bad input; any other exception, a crash, or a header that passes while
// breaking what parse_safetensors promises, is a bug.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "base/error.h"
#include "io/safetensors.h"

namespace {

// What a successful parse guarantees: ranges in the file, sized by shape x dtype,
// sorted by begin and disjoint unless empty.
void check(const keel::SafetensorsHeader& h, size_t file_size) {
  uint64_t furthest = 0;
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const auto& e = h.tensors[i];
    const auto bytes = keel::storage_bytes(e.dtype, static_cast<uint64_t>(keel::numel(e.shape)));
    if (e.begin > e.end || h.data_start + e.end > file_size || bytes != e.end - e.begin) std::abort();
    if (i > 0 && e.begin < h.tensors[i - 1].begin) std::abort();
    if (e.begin == e.end) continue;
    if (e.begin < furthest) std::abort();
    furthest = std::max(furthest, e.end);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    check(keel::parse_safetensors(std::as_bytes(std::span(data, size)), "fuzz.safetensors"), size);
  } catch (const keel::Error&) {
  }
  return 0;
}
