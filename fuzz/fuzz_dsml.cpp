// libFuzzer target: model output bytes -> OutputParser. Byte 0 picks the mode (bit 0:
// thinking), byte 1 seeds the split into pieces, the rest is the output. Checked:
//   - streaming in random pieces and byte by byte equals parse_output of the whole text;
//   - no marker (BOS, EOS, <think>, </think>, the DSML token) in reasoning, content, tool
//     names or arguments;
//   - nothing dropped: an error's text is exactly the output from its offset on;
//   - for UTF-8 output, every finished call's arguments are a JSON object, and encoding
//     the parsed turn with encode_messages then parsing it again gives the same turn.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/encoding.h"
#include "chat/output_parser.h"

namespace {

using keel::OutputParser;
using keel::OutputParserOptions;
using keel::ParsedOutput;

void check(bool ok) {
  if (!ok) std::abort();
}

bool same(const ParsedOutput& a, const ParsedOutput& b) {
  if (a.reasoning != b.reasoning || a.content != b.content || a.tool_calls != b.tool_calls) {
    return false;
  }
  if (a.error.has_value() != b.error.has_value()) return false;
  return !a.error || (a.error->offset == b.error->offset && a.error->message == b.error->message &&
                      a.error->text == b.error->text && a.error->tool_call == b.error->tool_call);
}

ParsedOutput stream(std::string_view text, const OutputParserOptions& options,
                    uint32_t seed) {
  OutputParser parser(options);
  ParsedOutput out;
  size_t pos = 0;
  while (pos < text.size()) {
    seed ^= seed << 13;
    seed ^= seed >> 17;
    seed ^= seed << 5;
    const size_t n = seed % 9;  // empty pieces too
    append(out, parser.feed(text.substr(pos, n)));
    pos += std::min(n, text.size() - pos);
  }
  keel::FinalDelta last = parser.finish();
  append(out, last.delta);
  out.error = last.error;
  return out;
}

ParsedOutput byte_by_byte(std::string_view text, const OutputParserOptions& options) {
  OutputParser parser(options);
  ParsedOutput out;
  for (size_t i = 0; i < text.size(); ++i) append(out, parser.feed(text.substr(i, 1)));
  keel::FinalDelta last = parser.finish();
  append(out, last.delta);
  out.error = last.error;
  return out;
}

bool has_markup(std::string_view s) {
  for (std::string_view m : {keel::kBosToken, keel::kEosToken, keel::kThinkStart, keel::kThinkEnd,
                             keel::kDsmlToken}) {
    if (s.find(m) != std::string_view::npos) return true;
  }
  return false;
}

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return false;
    }
    i += n;
  }
  return true;
}

nlohmann::json arguments_of(const keel::ToolCall& call) {
  return nlohmann::json::parse(call.arguments, nullptr, /*allow_exceptions=*/false);
}

// The parsed turn, encoded as an assistant message and parsed again, is the same turn.
void check_round_trip(const ParsedOutput& p, bool thinking) {
  keel::ChatMessage turn{.role = keel::Role::assistant,
                         .content = p.content,
                         .reasoning_content = p.reasoning,
                         .tool_calls = p.tool_calls};
  const bool reasoned = thinking || !p.reasoning.empty();
  const std::string text = keel::encode_messages(
      std::vector<keel::ChatMessage>{turn}, {.thinking = reasoned, .add_bos = false});
  const ParsedOutput again = keel::parse_output(text, {.thinking = reasoned});
  check(!again.error);
  check(again.reasoning == p.reasoning && again.content == p.content);
  check(again.tool_calls.size() == p.tool_calls.size());
  for (size_t i = 0; i < p.tool_calls.size(); ++i) {
    check(again.tool_calls[i].name == p.tool_calls[i].name);
    check(arguments_of(again.tool_calls[i]) == arguments_of(p.tool_calls[i]));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const OutputParserOptions options{.thinking = (data[0] & 1) != 0};
  const uint32_t seed = 0x9E3779B9u ^ data[1];
  const std::string_view text(reinterpret_cast<const char*>(data) + 2, size - 2);

  const ParsedOutput whole = keel::parse_output(text, options);
  check(same(whole, stream(text, options, seed)));
  if (text.size() <= 4096) check(same(whole, byte_by_byte(text, options)));

  check(!has_markup(whole.reasoning) && !has_markup(whole.content));
  for (const keel::ToolCall& call : whole.tool_calls) {
    check(!has_markup(call.name) && !has_markup(call.arguments));
  }
  if (whole.error) {
    check(whole.error->offset <= text.size() && text.substr(whole.error->offset) == whole.error->text);
  }
  if (!valid_utf8(text)) return 0;
  for (size_t i = 0; i < whole.tool_calls.size(); ++i) {
    if (whole.error && whole.error->tool_call == i) continue;
    check(arguments_of(whole.tool_calls[i]).is_object());
  }
  if (!whole.error) check_round_trip(whole, options.thinking);
  return 0;
}
