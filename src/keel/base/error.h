// keel's one exception type. Every error names what it is about (file, tensor, field)
// and carries a code that tests and callers can match without parsing the text.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace keel {

enum class ErrorCode {
  usage,               // a bad argument from the caller or the command line
  io,                  // open / read / write / mmap failed
  // safetensors
  file_too_small,      // shorter than the 8-byte header length
  header_too_large,    // header length past the limit or past the end of the file
  header_json,         // header is not well-formed JSON, or not an object
  header_entry,        // a tensor entry lacks dtype/shape/data_offsets or has wrong types
  unknown_dtype,
  byte_size_mismatch,  // shape x dtype != data_offsets range
  out_of_bounds,       // data_offsets past the end of the file
  overlap,             // two tensors share bytes
  duplicate_tensor,
  index_json,          // model.safetensors.index.json malformed
  index_mismatch,      // a tensor in the index is missing from its shard, or the reverse
  missing_tensor,      // a tensor asked for does not exist
  // config.json
  config_json,
  config_missing,      // a required key is absent
  config_type,         // a key has the wrong JSON type
  config_value,        // a key's value is out of range or inconsistent
  unsupported_model,   // a model we recognise but do not run (e.g. a DSpark drafter)
  // weights against the config
  weights_mismatch,    // expected tensors absent or of the wrong shape/dtype (all listed)
  // the kernel plan
  kernel_plan,         // no kernel, or not the one chosen, can run an op (layer, role, op, arch named)
  // tokenizer.json / tokenizer_config.json
  tokenizer_json,      // malformed, or a field missing or of the wrong type
  tokenizer_unsupported,  // a component type or option keel does not implement (named)
  // running the model
  bad_input,           // token ids out of range, an empty prompt, a context past the maximum
  out_of_memory,       // the sequence-state pool has no free block (its capacity is the state budget)
  // chat requests
  chat_request,        // OpenAI messages/tools malformed (the field is named, e.g. messages[2].role)
};

std::string_view name(ErrorCode code);

struct ErrorContext {
  std::string file;
  std::string tensor;
  std::string field;
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, ErrorContext context, const std::string& message,
        std::vector<std::string> details = {});

  ErrorCode code() const { return code_; }
  const ErrorContext& context() const { return context_; }
  // One line per problem, for errors that report many at once.
  const std::vector<std::string>& details() const { return details_; }

 private:
  ErrorCode code_;
  ErrorContext context_;
  std::vector<std::string> details_;
};

[[noreturn]] void fail(ErrorCode code, ErrorContext context, const std::string& message,
                       std::vector<std::string> details = {});

}  // namespace keel
