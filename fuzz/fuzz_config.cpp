// libFuzzer target: config.json text -> parse_config. Bad input must end in keel::Error;
// anything else (a crash, a sanitizer report, another exception) is a bug. A config that
// parses must also survive the official-JSON round trip unchanged.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "base/error.h"
#include "io/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const keel::ModelConfig c = keel::parse_config(text, "fuzz");
    describe(c);
    if (keel::parse_config(keel::to_official_json(c), "fuzz") != c) std::abort();
  } catch (const keel::Error&) {
  }
  return 0;
}
