#include "base/error.h"

#include <array>

namespace keel {
namespace {

// "file 'a': tensor 'b': field 'c': message", then one indented line per detail.
std::string compose(ErrorCode code, const ErrorContext& c, const std::string& message,
                    const std::vector<std::string>& details) {
  std::string s;
  if (!c.file.empty()) s += "file '" + c.file + "': ";
  if (!c.tensor.empty()) s += "tensor '" + c.tensor + "': ";
  if (!c.field.empty()) s += "field '" + c.field + "': ";
  s += message;
  s += " [";
  s += name(code);
  s += "]";
  for (const auto& d : details) s += "\n  " + d;
  return s;
}

}  // namespace

std::string_view name(ErrorCode code) {
  static constexpr std::array kNames = {
      "usage",         "io",           "file_too_small",   "header_too_large", "header_json",
      "header_entry",  "unknown_dtype", "byte_size_mismatch", "out_of_bounds", "overlap",
      "duplicate_tensor", "index_json", "index_mismatch",  "missing_tensor",   "config_json",
      "config_missing", "config_type", "config_value",     "unsupported_model", "weights_mismatch",
      "kernel_plan",
      "tokenizer_json", "tokenizer_unsupported",
      "bad_input",     "out_of_memory",
      "chat_request",
  };
  static_assert(kNames.size() == static_cast<size_t>(ErrorCode::chat_request) + 1);
  return kNames.at(static_cast<size_t>(code));
}

Error::Error(ErrorCode code, ErrorContext context, const std::string& message,
             std::vector<std::string> details)
    : std::runtime_error(compose(code, context, message, details)),
      code_(code),
      context_(std::move(context)),
      details_(std::move(details)) {}

void fail(ErrorCode code, ErrorContext context, const std::string& message,
          std::vector<std::string> details) {
  throw Error(code, std::move(context), message, std::move(details));
}

}  // namespace keel
