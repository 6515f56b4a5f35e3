// The DeepSeek-V4 chat encoding (the official encoding/encoding_dsv4.py; assets.md §2.3):
// OpenAI-shaped messages -> the prompt text, special tokens written as their text (the
// tokenizer matches them as added tokens).
//
//   pre-processing  tool messages become <tool_result> blocks of a user turn (runs of
//                   tool/user messages merge into one user turn, blocks joined by "\n\n"),
//                   re-ordered to the preceding assistant's tool-call order. In thinking
//                   mode without tools anywhere, assistant turns before the last
//                   user/developer message lose their reasoning and developer messages
//                   before it are dropped.
//   start           BOS (not when continuing a context); in thinking mode with
//                   reasoning_effort max, the fixed preamble before the first message.
//   messages        system: text (+ "## Tools" block, + response format); user/developer:
//                   <｜User｜> + text; latest_reminder: <｜latest_reminder｜> + text;
//                   assistant: [reasoning </think>] content [DSML tool calls] EOS.
//   hand-off        after a user/developer turn that ends the conversation or precedes an
//                   assistant (or latest_reminder) turn: <｜Assistant｜> then <think> in
//                   thinking mode for a turn whose reasoning is kept, else </think>; a
//                   task turn gets its task token instead.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace keel {

// The special tokens as text.
inline constexpr std::string_view kBosToken = "<｜begin▁of▁sentence｜>";
inline constexpr std::string_view kEosToken = "<｜end▁of▁sentence｜>";
inline constexpr std::string_view kUserToken = "<｜User｜>";
inline constexpr std::string_view kAssistantToken = "<｜Assistant｜>";
inline constexpr std::string_view kLatestReminderToken = "<｜latest_reminder｜>";
inline constexpr std::string_view kThinkStart = "<think>";
inline constexpr std::string_view kThinkEnd = "</think>";
inline constexpr std::string_view kDsmlToken = "｜DSML｜";

enum class Role : uint8_t { system, user, developer, assistant, tool, latest_reminder };

// Internal classification tasks: a user/developer turn carrying one ends with its token.
enum class Task : uint8_t { none, action, query, authority, domain, title, read_url };

// "high" renders as none in this revision of the encoding; only max adds the preamble.
enum class ReasoningEffort : uint8_t { none, high, max };

std::string_view name(Role role);
std::string_view name(Task task);

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // a JSON object as text; anything else is passed as {"arguments": text}

  bool operator==(const ToolCall&) const = default;
};

struct ChatMessage {
  Role role = Role::user;
  std::string content;
  std::string reasoning_content;    // assistant
  std::vector<ToolCall> tool_calls;  // assistant
  std::string tool_call_id;         // tool: orders the results as the calls were made
  std::string name;                 // accepted, not rendered: the encoding has no names
  // system / developer: function objects {"name", "description", "parameters"}, written
  // into the "## Tools" block as given (key order kept).
  std::vector<nlohmann::ordered_json> tools;
  nlohmann::ordered_json response_format;  // system / developer; null or {} for none
  Task task = Task::none;                  // user / developer
  bool prefix = false;  // assistant: an unfinished turn to continue (written without EOS)
};

struct EncodeOptions {
  bool thinking = false;  // thinking mode (else chat mode)
  ReasoningEffort reasoning_effort = ReasoningEffort::none;
  bool drop_thinking = true;  // drop earlier turns' reasoning (never when tools are given)
  bool add_bos = true;
  // Write the hand-off (or task token) after a final user/developer message.
  bool add_generation_prompt = true;
};

// The prompt for `messages`. `context` is a conversation already encoded (its prompt is
// in the cache): only `messages` are written, without BOS, but they are encoded as the
// continuation of `context` (tool-result order, dropped reasoning, hand-off tokens).
// Throws Error(chat_request) for a developer message without content.
std::string encode_messages(std::span<const ChatMessage> messages, const EncodeOptions& options,
                            std::span<const ChatMessage> context = {});

// The "## Tools" block for a list of function objects (no leading blank line).
std::string render_tools(std::span<const nlohmann::ordered_json> functions);

// An OpenAI chat request's `messages`, `tools` and `response_format` -> messages. Tools and
// a response format (other than {"type": "text"}) go on the first message, a system
// message inserted empty when the conversation does not start with one (as the DSV4
// servers do). Content is a string, null, or an array of text parts (joined by "\n\n").
// Assistant tool-call arguments may be a JSON string or an object. Beyond OpenAI: the
// roles developer and latest_reminder, "task" on user/developer messages, and "prefix":
// true on a final assistant message (continue it). Malformed input throws
// Error(chat_request) naming the field, e.g. "messages[2].role".
std::vector<ChatMessage> messages_from_openai(const nlohmann::ordered_json& messages,
                                              const nlohmann::ordered_json& tools = nullptr,
                                              const nlohmann::ordered_json& response_format = nullptr);

// A request's `reasoning_effort`: null -> none; "low", "medium", "high" -> high (the
// encoding knows no lower levels); "max" -> max; else Error(chat_request).
ReasoningEffort reasoning_effort_from_openai(const nlohmann::ordered_json& value);

}  // namespace keel
