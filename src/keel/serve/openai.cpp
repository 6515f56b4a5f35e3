#include "serve/openai.h"

#include <fmt/format.h>
#include <random>
#include <set>

#include "base/error.h"
#include "chat/encoding.h"

namespace keel::serve {

using json = nlohmann::ordered_json;

std::string ApiError::body() const {
  json e = {{"message", what()}, {"type", type}, {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}};
  return json{{"error", e}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

ApiError bad_request(const std::string& message, std::string param) {
  return ApiError(400, "invalid_request_error", message, std::move(param));
}

namespace {

const std::set<std::string> kCommon = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n",
    "stop", "logprobs", "top_logprobs", "user", "frequency_penalty", "presence_penalty", "ignore_eos",
    "skip_special_tokens", "priority"};
const std::set<std::string> kChat = {"messages", "max_completion_tokens", "tools", "tool_choice", "response_format",
                                     "reasoning_effort", "thinking", "chat_template_kwargs", "parallel_tool_calls"};
const std::set<std::string> kCompletions = {"prompt"};

double number(const json& body, const char* key, double fallback, double lo, double hi) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  if (!body[key].is_number()) throw bad_request(fmt::format("'{}' must be a number", key), key);
  const double v = body[key].get<double>();
  if (!(v >= lo && v <= hi)) throw bad_request(fmt::format("'{}' must be between {} and {}, got {}", key, lo, hi, v), key);
  return v;
}

std::optional<int64_t> integer(const json& body, const char* key, int64_t lo, int64_t hi) {
  if (!body.contains(key) || body[key].is_null()) return std::nullopt;
  if (!body[key].is_number_integer()) throw bad_request(fmt::format("'{}' must be an integer", key), key);
  const int64_t v = body[key].get<int64_t>();
  if (v < lo || v > hi) throw bad_request(fmt::format("'{}' must be between {} and {}, got {}", key, lo, hi, v), key);
  return v;
}

bool boolean(const json& body, const char* key, bool fallback) {
  if (!body.contains(key) || body[key].is_null()) return fallback;
  if (!body[key].is_boolean()) throw bad_request(fmt::format("'{}' must be a boolean", key), key);
  return body[key].get<bool>();
}

// Thinking mode from the request: "thinking": true | {"type": "enabled"}, or
// chat_template_kwargs {"thinking" | "enable_thinking": true}.
bool thinking_of(const json& body) {
  if (body.contains("thinking") && !body["thinking"].is_null()) {
    const json& t = body["thinking"];
    if (t.is_boolean()) return t.get<bool>();
    if (t.is_object() && t.contains("type") && t["type"].is_string()) {
      const auto type = t["type"].get<std::string>();
      if (type == "enabled") return true;
      if (type == "disabled") return false;
    }
    throw bad_request("'thinking' must be a boolean or {\"type\": \"enabled\" | \"disabled\"}", "thinking");
  }
  if (body.contains("chat_template_kwargs") && body["chat_template_kwargs"].is_object()) {
    const json& k = body["chat_template_kwargs"];
    for (const char* key : {"thinking", "enable_thinking"}) {
      if (k.contains(key)) {
        if (!k[key].is_boolean()) throw bad_request(fmt::format("'chat_template_kwargs.{}' must be a boolean", key), "chat_template_kwargs");
        return k[key].get<bool>();
      }
    }
  }
  return false;
}

// The opening the reply is forced to for tool_choice "required" (choice null) or a named
// function ({"type": "function", "function": {"name": ...}}): the DSML tool-call block,
// and the invoke tag of the named function. The model writes the rest; no constrained
// decoding checks the arguments against the schema.
std::string forced_tool_call(const json& tools, const json* choice) {
  if (!tools.is_array() || tools.empty()) throw bad_request("this 'tool_choice' needs 'tools'", "tool_choice");
  const std::string dsml(kDsmlToken);
  std::string forced = "\n\n<" + dsml + "tool_calls>\n";
  if (!choice) return forced;
  const json* fn = choice->contains("function") ? &(*choice)["function"] : nullptr;
  if (choice->value("type", json()) != "function" || !fn || !fn->is_object() || !fn->contains("name") ||
      !(*fn)["name"].is_string()) {
    throw bad_request("'tool_choice' as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                      "tool_choice");
  }
  const std::string name = (*fn)["name"].get<std::string>();
  const bool known = std::any_of(tools.begin(), tools.end(), [&](const json& t) {
    return t.is_object() && t.contains("function") && t["function"].is_object() &&
           t["function"].value("name", json()) == name;
  });
  if (!known) throw bad_request(fmt::format("'tool_choice' names '{}', which is not in 'tools'", name), "tool_choice");
  return forced + "<" + dsml + "invoke name=\"" + name + "\">\n";
}

std::string finish_name(Finish f, bool tool_calls) {
  if (f == Finish::length) return "length";
  return tool_calls ? "tool_calls" : "stop";
}

}  // namespace

ApiRequest parse_request(Endpoint endpoint, std::string_view text, const ServedModel& served) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::parse_error& e) {
    throw bad_request(fmt::format("the body is not valid JSON (or not valid UTF-8): {}", e.what()));
  }
  if (!body.is_object()) throw bad_request("the body must be a JSON object");
  const auto& own = endpoint == Endpoint::chat ? kChat : kCompletions;
  for (const auto& [key, value] : body.items()) {
    if (!kCommon.contains(key) && !own.contains(key)) throw bad_request(fmt::format("unknown parameter '{}'", key), key);
  }
  if (!body.contains("model") || !body["model"].is_string()) throw bad_request("'model' is required (a string)", "model");
  if (body["model"].get<std::string>() != served.id) {
    throw ApiError(404, "invalid_request_error",
                   fmt::format("the model '{}' does not exist; this server serves '{}'", body["model"].get<std::string>(), served.id),
                   "model", "model_not_found");
  }
  for (const char* key : {"frequency_penalty", "presence_penalty"}) {
    if (number(body, key, 0, -2, 2) != 0) throw bad_request(fmt::format("'{}' is not supported (only 0)", key), key);
  }

  ApiRequest r{.endpoint = endpoint};
  const ModelConfig& c = served.model.config();
  if (endpoint == Endpoint::chat) {
    if (!body.contains("messages")) throw bad_request("'messages' is required", "messages");
    json tools = body.value("tools", json(nullptr));
    std::string forced;  // the reply's forced opening, for tool_choice required or a named function
    if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
      const json& tc = body["tool_choice"];
      if (tc.is_string()) {
        const auto v = tc.get<std::string>();
        if (v != "none" && v != "auto" && v != "required") throw bad_request("'tool_choice' must be none, auto, required or a function", "tool_choice");
        if (v == "none") tools = nullptr;
        if (v == "required") forced = forced_tool_call(tools, nullptr);
      } else if (tc.is_object()) {
        forced = forced_tool_call(tools, &tc);
      } else {
        throw bad_request("'tool_choice' must be a string or an object", "tool_choice");
      }
    }
    std::vector<ChatMessage> messages;
    EncodeOptions options{.thinking = thinking_of(body)};
    try {
      messages = messages_from_openai(body["messages"], tools, body.value("response_format", json(nullptr)));
      options.reasoning_effort = reasoning_effort_from_openai(body.value("reasoning_effort", json(nullptr)));
      if (messages.empty()) throw bad_request("'messages' must not be empty", "messages");
      r.prompt_text = encode_messages(messages, options);
    } catch (const Error& e) {
      throw bad_request(e.what(), e.context().field.empty() ? "messages" : e.context().field);
    }
    if (!forced.empty() && options.thinking) {
      throw bad_request("tool_choice 'required' or a named function needs thinking off: keel enforces it by opening "
                        "the reply with the tool-call block, which would skip the reasoning", "tool_choice");
    }
    r.prompt_text += forced;
    r.parser = parser_options_for_prompt(r.prompt_text);
    r.parser.forced = forced;
    r.generation.prompt = served.tokenizer.encode(r.prompt_text, false);
    r.logprobs = boolean(body, "logprobs", false);
    if (auto top = integer(body, "top_logprobs", 0, 20)) {
      if (!r.logprobs) throw bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs");
      r.generation.top_logprobs = static_cast<int>(*top);
    } else if (r.logprobs) {
      r.generation.top_logprobs = 0;
    }
  } else {
    if (!body.contains("prompt")) throw bad_request("'prompt' is required", "prompt");
    const json& p = body["prompt"];
    if (p.is_string()) {
      r.prompt_text = p.get<std::string>();
      r.generation.prompt = served.tokenizer.encode(r.prompt_text, true);
    } else if (p.is_array() && !p.empty() && p.front().is_number_integer()) {
      for (const json& id : p) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= c.vocab_size) {
          throw bad_request(fmt::format("'prompt' token ids must be integers in 0..{}", c.vocab_size - 1), "prompt");
        }
        r.generation.prompt.push_back(id.get<int32_t>());
      }
    } else {
      throw bad_request("'prompt' must be a string or an array of token ids", "prompt");
    }
    if (auto lp = integer(body, "logprobs", 0, 20)) {
      r.logprobs = true;
      r.generation.top_logprobs = static_cast<int>(*lp);
    }
  }
  if (r.generation.prompt.empty()) throw bad_request("the prompt is empty", endpoint == Endpoint::chat ? "messages" : "prompt");

  const int64_t context = c.max_position_embeddings;
  const int64_t prompt_tokens = static_cast<int64_t>(r.generation.prompt.size());
  std::optional<int64_t> max_tokens = integer(body, "max_tokens", INT64_MIN, INT64_MAX);
  if (endpoint == Endpoint::chat) {
    if (auto m = integer(body, "max_completion_tokens", INT64_MIN, INT64_MAX)) max_tokens = m;
  }
  if (max_tokens && *max_tokens < 1) {
    throw bad_request(fmt::format("'max_tokens' must be at least 1, got {}", *max_tokens), "max_tokens");
  }
  if (prompt_tokens >= context || (max_tokens && prompt_tokens + *max_tokens > context)) {
    throw ApiError(400, "invalid_request_error",
                   fmt::format("this model's maximum context length is {} tokens; the request has {} prompt tokens "
                               "and asks for {} more",
                               context, prompt_tokens, max_tokens ? fmt::format("{}", *max_tokens) : std::string("at least 1")),
                   endpoint == Endpoint::chat ? "messages" : "prompt", "context_length_exceeded");
  }
  r.generation.max_tokens = static_cast<int>(max_tokens.value_or(context - prompt_tokens));

  SamplingParams& s = r.generation.sampling;
  s.temperature = static_cast<float>(number(body, "temperature", 1.0, 0, 2));
  s.top_p = static_cast<float>(number(body, "top_p", 1.0, 1e-9, 1));
  s.min_p = static_cast<float>(number(body, "min_p", 0.0, 0, 1));
  s.top_k = static_cast<int>(integer(body, "top_k", -1, c.vocab_size).value_or(0));
  if (s.top_k < 0) s.top_k = 0;
  if (auto priority = integer(body, "priority", -1'000'000, 1'000'000)) {
    r.generation.priority = static_cast<int>(*priority);
  }
  if (auto seed = integer(body, "seed", INT64_MIN, INT64_MAX)) {
    s.seed = static_cast<uint64_t>(*seed);
  } else {
    s.seed = std::random_device{}() * 0x100000000ull + std::random_device{}();
  }
  r.n = static_cast<int>(integer(body, "n", 1, 16).value_or(1));
  r.stream = boolean(body, "stream", false);
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    if (!body["stream_options"].is_object()) throw bad_request("'stream_options' must be an object", "stream_options");
    r.include_usage = boolean(body["stream_options"], "include_usage", false);
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& st = body["stop"];
    if (st.is_string()) {
      r.generation.stop.push_back(st.get<std::string>());
    } else if (st.is_array() && st.size() <= 16) {
      for (const json& x : st) {
        if (!x.is_string()) throw bad_request("'stop' must be a string or an array of strings", "stop");
        r.generation.stop.push_back(x.get<std::string>());
      }
    } else {
      throw bad_request("'stop' must be a string or an array of at most 16 strings", "stop");
    }
  }
  r.generation.ignore_eos = boolean(body, "ignore_eos", false);
  r.generation.skip_special = boolean(body, "skip_special_tokens", endpoint == Endpoint::completions);
  try {
    check(s);
  } catch (const Error& e) {
    throw bad_request(e.what(), e.context().field);
  }
  return r;
}

struct ResponseBuilder::Choice {
  explicit Choice(const OutputParserOptions& options) : parser(options) {}
  OutputParser parser;
  ParsedOutput parsed;  // chat
  std::string text;     // completions
  json logprobs = json::array();
  json completion_logprobs = {{"tokens", json::array()}, {"token_logprobs", json::array()},
                              {"top_logprobs", json::array()}, {"text_offset", json::array()}};
  bool started = false;
  Finish finish = Finish::none;
  std::string error;
  int prompt_tokens = 0, completion_tokens = 0;
};

ResponseBuilder::ResponseBuilder(const ApiRequest& request, const ServedModel& served, std::string id, int64_t created)
    : request_(request), served_(served), id_(std::move(id)), created_(created) {
  for (int i = 0; i < request.n; ++i) choices_.push_back(std::make_shared<Choice>(request.parser));
}

json ResponseBuilder::logprob_entry(const TokenLogprob& lp) const {
  const auto entry = [&](int32_t id, float logprob) {
    const std::string token = served_.tokenizer.decode(std::span(&id, 1));
    json bytes = json::array();
    for (unsigned char ch : token) bytes.push_back(ch);
    return json{{"token", token}, {"logprob", logprob}, {"bytes", bytes}};
  };
  json e = entry(lp.id, lp.logprob);
  json top = json::array();
  for (const auto& [id, logprob] : lp.top) top.push_back(entry(id, logprob));
  e["top_logprobs"] = top;
  return e;
}

json ResponseBuilder::chunk(json choice) const {
  return json{{"id", id_},
              {"object", request_.endpoint == Endpoint::chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created_},
              {"model", served_.id},
              {"choices", json::array({std::move(choice)})}};
}

json ResponseBuilder::usage() const {
  int prompt = 0, completion = 0;
  for (const auto& c : choices_) {
    prompt = c->prompt_tokens;
    completion += c->completion_tokens;
  }
  return json{{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
}

std::vector<std::string> ResponseBuilder::on_event(int index, const GenerationEvent& ev) {
  Choice& c = *choices_.at(index);
  std::vector<std::string> out;
  const bool chat = request_.endpoint == Endpoint::chat;
  if (request_.stream && chat && !c.started) {
    out.push_back(chunk({{"index", index}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                         {"finish_reason", nullptr}}).dump(-1, ' ', false, json::error_handler_t::replace));
  }
  c.started = true;
  c.prompt_tokens = ev.prompt_tokens;
  c.completion_tokens = ev.completion_tokens;
  json lp = nullptr;
  if (ev.logprob) {
    if (chat) {
      json e = logprob_entry(*ev.logprob);
      c.logprobs.push_back(e);
      lp = json{{"content", json::array({e})}};
    } else {
      json e = logprob_entry(*ev.logprob);
      json top = json::object();
      for (const auto& t : e["top_logprobs"]) top[t["token"].get<std::string>()] = t["logprob"];
      auto& cl = c.completion_logprobs;
      cl["tokens"].push_back(e["token"]);
      cl["token_logprobs"].push_back(e["logprob"]);
      cl["top_logprobs"].push_back(top);
      cl["text_offset"].push_back(c.text.size());
      lp = json{{"tokens", {e["token"]}}, {"token_logprobs", {e["logprob"]}}, {"top_logprobs", {top}},
                {"text_offset", {c.text.size()}}};
    }
  }
  c.finish = ev.finish;
  c.error = ev.error;
  const bool ended = ev.finish == Finish::stop || ev.finish == Finish::length;
  json finish_reason = nullptr;
  if (chat) {
    Delta delta = c.parser.feed(ev.text);
    if (ended) {
      FinalDelta fd = c.parser.finish();
      delta.reasoning += fd.delta.reasoning;
      delta.content += fd.delta.content;
      for (auto& t : fd.delta.tool_calls) delta.tool_calls.push_back(std::move(t));
      c.parsed.error = fd.error;
    }
    append(c.parsed, delta);
    if (ended) finish_reason = finish_name(ev.finish, !c.parsed.tool_calls.empty());
    if (request_.stream && (!delta.empty() || !lp.is_null() || ended)) {
      json d = json::object();
      if (!delta.reasoning.empty()) d["reasoning_content"] = delta.reasoning;
      if (!delta.content.empty()) d["content"] = delta.content;
      if (!delta.tool_calls.empty()) {
        json calls = json::array();
        for (const auto& t : delta.tool_calls) {
          json call = {{"index", t.index}};
          if (!t.id.empty()) call["id"] = t.id, call["type"] = "function";
          json fn = json::object();
          if (!t.name.empty()) fn["name"] = t.name;
          fn["arguments"] = t.arguments;
          call["function"] = fn;
          calls.push_back(call);
        }
        d["tool_calls"] = calls;
      }
      json ch = {{"index", index}, {"delta", d}, {"logprobs", lp}, {"finish_reason", finish_reason}};
      if (ended && c.parsed.error) {
        ch["unparsed"] = {{"offset", c.parsed.error->offset}, {"reason", c.parsed.error->message}, {"text", c.parsed.error->text}};
      }
      out.push_back(chunk(ch).dump(-1, ' ', false, json::error_handler_t::replace));
    }
  } else {
    c.text += ev.text;
    if (ended) finish_reason = finish_name(ev.finish, false);
    if (request_.stream && (!ev.text.empty() || !lp.is_null() || ended)) {
      out.push_back(chunk({{"index", index}, {"text", ev.text}, {"logprobs", lp}, {"finish_reason", finish_reason}}).dump(-1, ' ', false, json::error_handler_t::replace));
    }
  }
  return out;
}

bool ResponseBuilder::finished() const {
  for (const auto& c : choices_) {
    if (c->finish == Finish::none) return false;
  }
  return true;
}

std::optional<ApiError> ResponseBuilder::failure() const {
  for (const auto& c : choices_) {
    if (c->finish == Finish::timeout) return ApiError(504, "timeout", "the request timed out", {}, "timeout");
    if (c->finish == Finish::error) return ApiError(500, "server_error", c->error);
    if (c->finish == Finish::cancelled) return ApiError(503, "server_error", "the request was cancelled", {}, "cancelled");
  }
  return std::nullopt;
}

std::string ResponseBuilder::usage_chunk() const {
  json u = chunk(nullptr);
  u["choices"] = json::array();
  u["usage"] = usage();
  return u.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ResponseBuilder::response() const {
  const bool chat = request_.endpoint == Endpoint::chat;
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& c = *choices_[i];
    if (chat) {
      json message = {{"role", "assistant"}, {"content", c.parsed.content}};
      if (request_.parser.thinking || !c.parsed.reasoning.empty()) message["reasoning_content"] = c.parsed.reasoning;
      if (!c.parsed.tool_calls.empty()) {
        json calls = json::array();
        for (const auto& t : c.parsed.tool_calls) {
          calls.push_back({{"id", t.id}, {"type", "function"}, {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
        }
        message["tool_calls"] = calls;
      }
      json ch = {{"index", i}, {"message", message},
                 {"logprobs", request_.logprobs ? json{{"content", c.logprobs}} : json(nullptr)},
                 {"finish_reason", finish_name(c.finish, !c.parsed.tool_calls.empty())}};
      if (c.parsed.error) {
        ch["unparsed"] = {{"offset", c.parsed.error->offset}, {"reason", c.parsed.error->message}, {"text", c.parsed.error->text}};
      }
      choices.push_back(ch);
    } else {
      choices.push_back({{"index", i}, {"text", c.text},
                         {"logprobs", request_.logprobs ? c.completion_logprobs : json(nullptr)},
                         {"finish_reason", finish_name(c.finish, false)}});
    }
  }
  return json{{"id", id_}, {"object", chat ? "chat.completion" : "text_completion"}, {"created", created_},
              {"model", served_.id}, {"choices", choices}, {"usage", usage()}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace keel::serve
