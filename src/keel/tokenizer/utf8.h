// UTF-8 scanning as the tokenizer needs it: the replacement rule for invalid input, and
// the GPT-2 byte <-> character table of byte-level BPE.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace keel::tok {

// One step of a UTF-8 scan at s[i].
struct Utf8Step {
  size_t length;     // bytes consumed: the whole sequence, or its maximal invalid subpart
  char32_t cp;       // the code point when valid
  bool valid;
  bool truncated;    // invalid only because the input ends inside a well-formed prefix
};
Utf8Step utf8_step(std::string_view s, size_t i);

// Length of the UTF-8 sequence that starts with this lead byte (1 for anything else).
inline size_t utf8_lead_length(unsigned char b) {
  return b < 0xC0 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

// True when s is well-formed UTF-8.
bool utf8_valid(std::string_view s);

// Replaces every maximal invalid subpart with U+FFFD (the Unicode "best practice" that
// Python's bytes.decode('utf-8', 'replace') and Rust's from_utf8_lossy follow).
std::string utf8_sanitize(std::string_view s);

void append_utf8(std::string& out, char32_t cp);

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68
// bytes to U+0100.. in byte order.
const std::array<char32_t, 256>& byte_to_char();
// The inverse: -1 for characters outside the table.
int byte_of_char(char32_t c);

}  // namespace keel::tok
