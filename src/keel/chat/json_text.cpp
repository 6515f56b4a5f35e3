#include "chat/json_text.h"

#include <cstdio>

namespace keel {

void append_json_escaped(std::string& out, std::string_view raw) {
  for (const char ch : raw) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(ch));
          out += buf;
        } else {
          out += ch;
        }
    }
  }
}

std::string json_quote(std::string_view raw) {
  std::string out = "\"";
  append_json_escaped(out, raw);
  out += '"';
  return out;
}

std::string python_json(const nlohmann::ordered_json& value) {
  if (value.is_string()) return json_quote(value.get_ref<const std::string&>());
  std::string out;
  if (value.is_object()) {
    out += '{';
    const char* sep = "";
    for (const auto& [key, item] : value.items()) {
      out += sep;
      out += json_quote(key);
      out += ": ";
      out += python_json(item);
      sep = ", ";
    }
    out += '}';
    return out;
  }
  if (value.is_array()) {
    out += '[';
    const char* sep = "";
    for (const auto& item : value) {
      out += sep;
      out += python_json(item);
      sep = ", ";
    }
    out += ']';
    return out;
  }
  // Numbers, booleans, null: nlohmann writes floats with Python's repr rules (shortest
  // round trip, "1.0", exponent from 1e16 and below 1e-4 with two digits).
  return value.dump();
}

}  // namespace keel
