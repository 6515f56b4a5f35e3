#include "chat/output_parser.h"

#include <algorithm>
#include <span>
#include <utility>

#include <nlohmann/json.hpp>

#include "chat/json_text.h"

namespace keel {
namespace {

constexpr std::string_view kBlockOpen = "<｜DSML｜tool_calls>";
constexpr std::string_view kBlockOpenAfterBlank = "\n\n<｜DSML｜tool_calls>";
constexpr std::string_view kBlockClose = "</｜DSML｜tool_calls>";
constexpr std::string_view kInvokeOpen = "<｜DSML｜invoke";
constexpr std::string_view kInvokeClose = "</｜DSML｜invoke>";
constexpr std::string_view kParamOpen = "<｜DSML｜parameter";
constexpr std::string_view kParamClose = "</｜DSML｜parameter>";
constexpr std::string_view kDsmlOpen = "<｜DSML｜";
constexpr std::string_view kDsmlCloseOpen = "</｜DSML｜";

// ---------------------------------------------------------------------------------------
// Markers inside text (reasoning, content, parameter values).

enum class Action : uint8_t { end_reasoning, open_block, end_output, close_param, malformed };

struct Marker {
  std::string_view text;
  Action action;
};

// Where a marker starts; `marker` null: the rest of the buffer could still become one.
struct Hit {
  size_t pos;
  const Marker* marker;
};

constexpr Marker kReasoningMarkers[] = {
    {kThinkEnd, Action::end_reasoning}, {kEosToken, Action::end_output},
    {kThinkStart, Action::malformed},   {kBosToken, Action::malformed},
    {kDsmlOpen, Action::malformed},     {kDsmlCloseOpen, Action::malformed},
    {kDsmlToken, Action::malformed},
};

constexpr Marker kContentMarkers[] = {
    {kBlockOpenAfterBlank, Action::open_block}, {kBlockOpen, Action::open_block},
    {kEosToken, Action::end_output},            {kThinkStart, Action::malformed},
    {kThinkEnd, Action::malformed},             {kBosToken, Action::malformed},
    {kDsmlOpen, Action::malformed},             {kDsmlCloseOpen, Action::malformed},
    {kDsmlToken, Action::malformed},
};

constexpr Marker kValueMarkers[] = {
    {kParamClose, Action::close_param}, {kEosToken, Action::malformed},
    {kThinkStart, Action::malformed},   {kThinkEnd, Action::malformed},
    {kBosToken, Action::malformed},     {kDsmlOpen, Action::malformed},
    {kDsmlCloseOpen, Action::malformed}, {kDsmlToken, Action::malformed},
};

// The first position where a marker matches, or where the buffer's tail is a proper
// prefix of one (unless at_end). At one position the longest full match wins, but only
// when no longer marker could still match.
std::optional<Hit> find_marker(std::string_view buf, std::span<const Marker> markers,
                               bool at_end) {
  for (size_t pos = 0; pos < buf.size(); ++pos) {
    const std::string_view rest = buf.substr(pos);
    const Marker* best = nullptr;
    bool partial = false;
    for (const Marker& m : markers) {
      if (rest.starts_with(m.text)) {
        if (!best || m.text.size() > best->text.size()) best = &m;
      } else if (!at_end && m.text.starts_with(rest)) {
        partial = true;
      }
    }
    if (partial) return Hit{pos, nullptr};
    if (best) return Hit{pos, best};
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------
// Tags of the tool-call block, as sequences of steps.

enum class Fit : uint8_t { yes, more, no };

struct TagStep {
  enum Kind : uint8_t { literal, space, quoted } kind;
  std::string_view text = {};
};

constexpr TagStep kInvokeTag[] = {
    {TagStep::literal, kInvokeOpen}, {TagStep::space}, {TagStep::literal, "name=\""},
    {TagStep::quoted}, {TagStep::literal, "\">"},
};
constexpr TagStep kParamTag[] = {
    {TagStep::literal, kParamOpen},     {TagStep::space},  {TagStep::literal, "name=\""},
    {TagStep::quoted},                  {TagStep::literal, "\""}, {TagStep::space},
    {TagStep::literal, "string=\""},    {TagStep::quoted}, {TagStep::literal, "\">"},
};
constexpr TagStep kInvokeCloseTag[] = {{TagStep::literal, kInvokeClose}};
constexpr TagStep kBlockCloseTag[] = {{TagStep::literal, kBlockClose}};

// A name in quotes: a bounded run without quotes, angle brackets, newlines or DSML.
constexpr size_t kMaxQuoted = 256;

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

bool bad_in_quotes(char c) { return c == '<' || c == '>' || c == '\n' || c == '\r'; }

struct TagMatch {
  Fit fit = Fit::no;
  size_t length = 0;
  std::vector<std::string> quoted;
};

Fit match_literal(std::string_view buf, size_t& pos, std::string_view text) {
  const size_t n = std::min(text.size(), buf.size() - pos);
  if (buf.substr(pos, n) != text.substr(0, n)) return Fit::no;
  if (n < text.size()) return Fit::more;
  pos += n;
  return Fit::yes;
}

Fit match_space(std::string_view buf, size_t& pos) {
  size_t end = pos;
  while (end < buf.size() && is_space(buf[end])) ++end;
  if (end == buf.size()) return Fit::more;  // more space, or the next step, may follow
  if (end == pos) return Fit::no;
  pos = end;
  return Fit::yes;
}

Fit match_quoted(std::string_view buf, size_t& pos, std::vector<std::string>& out) {
  size_t end = pos;
  while (end < buf.size() && buf[end] != '"') {
    if (bad_in_quotes(buf[end]) || end - pos >= kMaxQuoted) return Fit::no;
    ++end;
  }
  if (end == buf.size()) return Fit::more;
  const std::string_view text = buf.substr(pos, end - pos);
  if (text.find(kDsmlToken) != std::string_view::npos) return Fit::no;
  out.emplace_back(text);
  pos = end;
  return Fit::yes;
}

TagMatch match_tag(std::string_view buf, std::span<const TagStep> steps) {
  TagMatch m;
  size_t pos = 0;
  for (const TagStep& s : steps) {
    Fit fit = Fit::no;
    switch (s.kind) {
      case TagStep::literal: fit = match_literal(buf, pos, s.text); break;
      case TagStep::space: fit = match_space(buf, pos); break;
      case TagStep::quoted: fit = match_quoted(buf, pos, m.quoted); break;
    }
    if (fit != Fit::yes) return {fit};
  }
  m.fit = Fit::yes;
  m.length = pos;
  return m;
}

std::string quote(std::string_view text) {
  std::string out = "'";
  out += text;
  out += '\'';
  return out;
}

}  // namespace

OutputParserOptions parser_options_for_prompt(std::string_view prompt) {
  return {.thinking = prompt.ends_with(kThinkStart)};
}

OutputParser::OutputParser(OutputParserOptions options) : options_(std::move(options)) {
  if (!options_.forced.empty()) {
    pending_ = options_.forced;
    run(false);  // its delta waits in out_ for the first feed()
  }
}

Delta OutputParser::feed(std::string_view piece) {
  if (state_ == State::failed) {
    error_->text += piece;
    return {};
  }
  pending_ += piece;
  run(false);
  return std::exchange(out_, {});
}

FinalDelta OutputParser::finish() {
  switch (state_) {
    case State::block:
    case State::invoke:
    case State::string_value:
    case State::json_value:
      fail("output ended inside the tool-call block");
      break;
    default:
      run(true);
  }
  return {std::exchange(out_, {}), error_};
}

void OutputParser::run(bool at_end) {
  while (step(at_end)) {
  }
}

bool OutputParser::step(bool at_end) {
  switch (state_) {
    case State::start: return step_start(at_end);
    case State::reasoning:
    case State::content:
    case State::string_value: return step_text(at_end);
    case State::json_value: return step_json_value();
    case State::block: return step_block();
    case State::invoke: return step_invoke();
    case State::after_block: return step_after_block(at_end);
    case State::done:
      if (!pending_.empty()) fail("text after end of sentence");
      return false;
    case State::failed:
      error_->text += pending_;
      pending_.clear();
      return false;
  }
  return false;
}

// A leading <think> opens reasoning in either mode.
bool OutputParser::step_start(bool at_end) {
  if (pending_.starts_with(kThinkStart)) {
    consume(kThinkStart.size());
    state_ = State::reasoning;
    return true;
  }
  if (!at_end && kThinkStart.starts_with(pending_)) return false;
  state_ = options_.thinking ? State::reasoning : State::content;
  return true;
}

bool OutputParser::step_text(bool at_end) {
  const State state = state_;
  std::span<const Marker> markers = kValueMarkers;
  if (state == State::reasoning) markers = kReasoningMarkers;
  if (state == State::content) markers = kContentMarkers;
  const std::optional<Hit> hit = find_marker(pending_, markers, at_end);
  const std::string_view text = std::string_view(pending_).substr(0, hit ? hit->pos : pending_.size());
  if (state == State::reasoning) out_.reasoning += text;
  if (state == State::content) out_.content += text;
  if (state == State::string_value) {
    std::string escaped;
    append_json_escaped(escaped, text);
    emit_arguments(escaped);
  }
  consume(text.size());
  if (!hit || !hit->marker) return false;

  const Marker& m = *hit->marker;
  if (m.action == Action::malformed) {
    const char* where = state == State::reasoning ? "reasoning"
                        : state == State::content ? "content"
                                                  : "a parameter value";
    fail("unexpected " + quote(m.text) + " in " + where);
    return false;
  }
  consume(m.text.size());
  switch (m.action) {
    case Action::end_reasoning: state_ = State::content; break;
    case Action::open_block: state_ = State::block; break;
    case Action::end_output: state_ = State::done; break;
    case Action::close_param:
      emit_arguments("\"");
      state_ = State::invoke;
      break;
    case Action::malformed: break;
  }
  return true;
}

// A string="false" value is held whole, then checked and emitted.
bool OutputParser::step_json_value() {
  const std::optional<Hit> hit = find_marker(pending_, kValueMarkers, false);
  if (!hit || !hit->marker) return false;
  if (hit->marker->action == Action::malformed) {
    fail("unexpected " + quote(hit->marker->text) + " in the value of parameter " +
         quote(keys_.back()));
    return false;
  }
  const std::string_view value = std::string_view(pending_).substr(0, hit->pos);
  if (!nlohmann::json::accept(value)) {
    fail("parameter " + quote(keys_.back()) + " is string=\"false\" but its value is not JSON");
    return false;
  }
  emit_arguments(value);
  consume(hit->pos + kParamClose.size());
  state_ = State::invoke;
  return true;
}

bool OutputParser::step_block() {
  if (!skip_space()) return false;
  const TagMatch invoke = match_tag(pending_, kInvokeTag);
  if (invoke.fit == Fit::yes) {
    if (invoke.quoted[0].empty()) {
      fail("a tool call without a name");
      return false;
    }
    out_.tool_calls.push_back(
        {calls_, options_.id_prefix + std::to_string(calls_), invoke.quoted[0], ""});
    ++calls_;
    in_call_ = true;
    keys_.clear();
    consume(invoke.length);
    state_ = State::invoke;
    return true;
  }
  const TagMatch close = match_tag(pending_, kBlockCloseTag);
  if (close.fit == Fit::yes) {
    consume(close.length);
    state_ = State::after_block;
    return true;
  }
  if (invoke.fit == Fit::more || close.fit == Fit::more) return false;
  fail("expected <｜DSML｜invoke name=\"...\"> or </｜DSML｜tool_calls>");
  return false;
}

bool OutputParser::step_invoke() {
  if (!skip_space()) return false;
  const TagMatch param = match_tag(pending_, kParamTag);
  if (param.fit == Fit::yes) {
    const std::string& key = param.quoted[0];
    const std::string& is_string = param.quoted[1];
    if (is_string != "true" && is_string != "false") {
      fail("parameter " + quote(key) + ": string=\"" + is_string + "\" is not true or false");
      return false;
    }
    if (std::find(keys_.begin(), keys_.end(), key) != keys_.end()) {
      fail("duplicate parameter " + quote(key));
      return false;
    }
    std::string head = keys_.empty() ? "{" : ", ";
    head += json_quote(key) + ": ";
    if (is_string == "true") head += '"';
    emit_arguments(head);
    keys_.push_back(key);
    consume(param.length);
    state_ = is_string == "true" ? State::string_value : State::json_value;
    return true;
  }
  const TagMatch close = match_tag(pending_, kInvokeCloseTag);
  if (close.fit == Fit::yes) {
    emit_arguments(keys_.empty() ? "{}" : "}");
    in_call_ = false;
    consume(close.length);
    state_ = State::block;
    return true;
  }
  if (param.fit == Fit::more || close.fit == Fit::more) return false;
  fail("expected <｜DSML｜parameter name=\"...\" string=\"true|false\"> or </｜DSML｜invoke>");
  return false;
}

// Only space and end-of-sentence may follow the block.
bool OutputParser::step_after_block(bool at_end) {
  if (!skip_space()) return false;
  if (pending_.starts_with(kEosToken)) {
    consume(kEosToken.size());
    state_ = State::done;
    return true;
  }
  if (!at_end && kEosToken.starts_with(pending_)) return false;
  fail("text after the tool-call block");
  return false;
}

void OutputParser::consume(size_t n) {
  pending_.erase(0, n);
  consumed_ += n;
}

// Drops leading whitespace; false when nothing else is pending.
bool OutputParser::skip_space() {
  size_t n = 0;
  while (n < pending_.size() && is_space(pending_[n])) ++n;
  consume(n);
  return !pending_.empty();
}

void OutputParser::emit_arguments(std::string_view text) {
  const size_t index = calls_ - 1;
  if (out_.tool_calls.empty() || out_.tool_calls.back().index != index) {
    out_.tool_calls.push_back({.index = index});
  }
  out_.tool_calls.back().arguments += text;
}

void OutputParser::fail(std::string message) {
  error_ = OutputError{consumed_, std::move(message), pending_,
                       in_call_ ? std::optional<size_t>(calls_ - 1) : std::nullopt};
  consumed_ += pending_.size();
  pending_.clear();
  state_ = State::failed;
}

void append(ParsedOutput& out, const Delta& delta) {
  out.reasoning += delta.reasoning;
  out.content += delta.content;
  for (const ToolCallDelta& d : delta.tool_calls) {
    if (d.index >= out.tool_calls.size()) out.tool_calls.resize(d.index + 1);
    ToolCall& call = out.tool_calls[d.index];
    if (!d.id.empty()) call.id = d.id;
    if (!d.name.empty()) call.name = d.name;
    call.arguments += d.arguments;
  }
}

ParsedOutput parse_output(std::string_view text, const OutputParserOptions& options) {
  OutputParser parser(options);
  ParsedOutput out;
  append(out, parser.feed(text));
  FinalDelta last = parser.finish();
  append(out, last.delta);
  out.error = std::move(last.error);
  return out;
}

}  // namespace keel
