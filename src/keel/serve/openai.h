// The OpenAI API over the engine, without the transport: request bodies -> engine
// requests (validated, chat messages through the DSV4 encoding), engine events ->
// response JSON or stream chunks (reasoning, content and tool calls through the
// OutputParser). docs/serve.md lists the parameters.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/output_parser.h"
#include "model/model.h"
#include "serve/engine.h"
#include "tokenizer/tokenizer.h"

namespace keel::serve {

// An error response: the HTTP status and OpenAI's {"error": {...}} body.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string type, const std::string& message, std::string param = {}, std::string code = {})
      : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)), code(std::move(code)) {}
  int status;
  std::string type, param, code;
  std::string body() const;
};

ApiError bad_request(const std::string& message, std::string param = {});

struct ServedModel {
  std::string id;  // the name clients give as "model"
  const Model& model;
  const Tokenizer& tokenizer;
};

enum class Endpoint : uint8_t { chat, completions };

struct ApiRequest {
  Endpoint endpoint = Endpoint::chat;
  std::string prompt_text;          // the encoded chat prompt, or the completion prompt
  GenerationRequest generation;     // choice i samples with seed + i
  int n = 1;
  bool stream = false, include_usage = false, logprobs = false;
  OutputParserOptions parser;       // chat
};

// Throws ApiError: 400 (malformed JSON or UTF-8, invalid or unsupported parameters, a
// prompt over the context), 404 (unknown model).
ApiRequest parse_request(Endpoint endpoint, std::string_view body, const ServedModel& served);

// Engine events of every choice -> the response. In streaming mode each event gives the
// chunks to send (JSON texts, "data: " framing is the caller's); otherwise the events are
// gathered and response() gives the whole body.
class ResponseBuilder {
 public:
  ResponseBuilder(const ApiRequest& request, const ServedModel& served, std::string id, int64_t created);

  std::vector<std::string> on_event(int choice, const GenerationEvent& event);
  bool finished() const;                // every choice has ended
  std::optional<ApiError> failure() const;  // a choice ended by timeout or error
  std::string usage_chunk() const;      // the final chunk with usage (stream_options.include_usage)
  std::string response() const;         // the non-streamed body

 private:
  struct Choice;
  nlohmann::ordered_json chunk(nlohmann::ordered_json choice) const;
  nlohmann::ordered_json usage() const;
  nlohmann::ordered_json logprob_entry(const TokenLogprob& lp) const;

  const ApiRequest& request_;
  const ServedModel& served_;
  std::string id_;
  int64_t created_;
  std::vector<std::shared_ptr<Choice>> choices_;
};

}  // namespace keel::serve
