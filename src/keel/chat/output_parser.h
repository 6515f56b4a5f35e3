// DeepSeek-V4 output -> reasoning, content and OpenAI tool calls, streamed.
//
// The generated text of one assistant turn is
//     [reasoning </think>] content ["\n\n" DSML tool-call block] [<｜end▁of▁sentence｜>]
// where the reasoning part exists when the prompt ended with <think> (thinking mode); a
// leading <think> also opens it (and is dropped in thinking mode). The block is
//     <｜DSML｜tool_calls>
//     <｜DSML｜invoke name="NAME">
//     <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>
//     </｜DSML｜invoke>
//     </｜DSML｜tool_calls>
// with any whitespace between tags. string="true" values are raw text, string="false"
// values JSON; a call's arguments are the JSON object {"K": V, ...} (Python's spacing, as
// the reference parser writes it). Missing end-of-sentence is not an error (the server may
// strip it, or the output was cut by max_tokens).
//
// Streaming: feed() returns what is known so far. No markup ever reaches reasoning, content
// or arguments: bytes that could start a marker (at most a marker's length) are held back
// until the next piece decides. String values stream as they come; JSON values are emitted
// whole once checked. If pieces end on UTF-8 character boundaries, so do the deltas.
//
// Malformed output (the one rule): parsing stops at the first markup that does not fit the
// grammar above (a stray <think>, </think>, BOS or DSML token, a bad tag, a string="false"
// value that is not JSON, a duplicate parameter, text after the block or after
// end-of-sentence, output ending inside the block). From that byte on nothing more is
// emitted; finish() reports an OutputError holding the byte offset, the reason and all
// the remaining text, and the tool call left unfinished, if any. Nothing is silently
// dropped and malformed markup never becomes content.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "chat/encoding.h"

namespace keel {

struct OutputParserOptions {
  bool thinking = false;             // the prompt ended with <think>: output opens in reasoning
  std::string id_prefix = "call_";   // tool call i gets the id id_prefix + i
  // Text the turn starts with that the prompt already holds (a forced tool-call opening,
  // for tool_choice): parsed as the output's first bytes, its delta returned by the first
  // feed(). Error offsets count it.
  std::string forced;
};

// Options matching a prompt from encode_messages: thinking when it ends with <think>.
OutputParserOptions parser_options_for_prompt(std::string_view prompt);

struct ToolCallDelta {
  size_t index = 0;       // the call's position in this output
  std::string id;         // only in a call's first delta
  std::string name;       // only in a call's first delta
  std::string arguments;  // the next piece of the arguments' JSON text
};

struct Delta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;  // at most one per index, in index order

  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

struct OutputError {
  size_t offset = 0;       // byte offset in the output where parsing stopped
  std::string message;
  std::string text;        // the output from `offset` on, unparsed
  std::optional<size_t> tool_call;  // index of the call left unfinished, if any
};

struct FinalDelta {
  Delta delta;
  std::optional<OutputError> error;
};

class OutputParser {
 public:
  explicit OutputParser(OutputParserOptions options = {});

  Delta feed(std::string_view piece);
  // Flushes what was held back and reports malformed output. Call once, last.
  FinalDelta finish();

 private:
  enum class State : uint8_t {
    start, reasoning, content, block, invoke, string_value, json_value, after_block, done, failed
  };

  bool step(bool at_end);
  bool step_start(bool at_end);
  bool step_text(bool at_end);
  bool step_json_value();
  bool step_block();
  bool step_invoke();
  bool step_after_block(bool at_end);
  void run(bool at_end);

  void consume(size_t n);
  bool skip_space();
  void emit_arguments(std::string_view text);
  void fail(std::string message);  // stops parsing at the first pending byte

  OutputParserOptions options_;
  State state_ = State::start;
  std::string pending_;    // received, not yet consumed
  size_t consumed_ = 0;    // bytes before pending_
  size_t calls_ = 0;       // calls begun
  bool in_call_ = false;
  std::vector<std::string> keys_;  // parameters of the current call
  std::optional<OutputError> error_;
  Delta out_;              // the delta being built
};

struct ParsedOutput {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
  std::optional<OutputError> error;
};

// Adds a delta to a parse result (arguments concatenated per call).
void append(ParsedOutput& out, const Delta& delta);

// The whole text at once; equal to appending every delta of any streaming split.
ParsedOutput parse_output(std::string_view text, const OutputParserOptions& options = {});

}  // namespace keel
