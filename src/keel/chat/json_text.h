// JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes it, which is
// what the DeepSeek-V4 reference encoder puts into prompts (tool schemas, non-string tool
// arguments) and what its output parser builds tool-call arguments with: ", " and ": "
// separators, key order kept, non-ASCII bytes written as they are.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace keel {

// Escapes `raw` for the inside of a JSON string literal: '"', '\\', \b \f \n \r \t and the
// other bytes below 0x20 (as \u00xx). Other bytes, UTF-8 included, pass through, so a
// string may be escaped piece by piece at any byte boundary.
void append_json_escaped(std::string& out, std::string_view raw);

// `raw` as a quoted JSON string.
std::string json_quote(std::string_view raw);

// json.dumps(value, ensure_ascii=False).
std::string python_json(const nlohmann::ordered_json& value);

}  // namespace keel
