#include "chat/encoding.h"

#include <algorithm>
#include <array>
#include <map>
#include <utility>

#include "base/error.h"
#include "chat/json_text.h"

namespace keel {
namespace {

using ojson = nlohmann::ordered_json;

// Fixed texts of encoding_dsv4.py, word for word.
constexpr std::string_view kEffortMaxPreamble =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n";

constexpr std::string_view kToolsHeader = R"TOOLS(## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

)TOOLS";

constexpr std::string_view kToolsFooter =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n";

constexpr std::string_view kResponseFormatHeader =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

constexpr std::string_view kToolResultOpen = "<tool_result>";
constexpr std::string_view kToolResultClose = "</tool_result>";

constexpr std::array<std::pair<std::string_view, Role>, 6> kRoles = {{
    {"system", Role::system},
    {"user", Role::user},
    {"developer", Role::developer},
    {"assistant", Role::assistant},
    {"tool", Role::tool},
    {"latest_reminder", Role::latest_reminder},
}};

struct TaskInfo {
  std::string_view name;
  Task task;
  std::string_view token;
};
constexpr std::array<TaskInfo, 7> kTasks = {{
    {"", Task::none, ""},
    {"action", Task::action, "<｜action｜>"},
    {"query", Task::query, "<｜query｜>"},
    {"authority", Task::authority, "<｜authority｜>"},
    {"domain", Task::domain, "<｜domain｜>"},
    {"title", Task::title, "<｜title｜>"},
    {"read_url", Task::read_url, "<｜read_url｜>"},
}};

const TaskInfo& info(Task task) { return kTasks.at(static_cast<size_t>(task)); }

// ---------------------------------------------------------------------------------------
// Pre-processing: messages -> turns (tool results folded into user turns).

struct Block {
  bool tool_result = false;
  const std::string* text = nullptr;
  const std::string* tool_call_id = nullptr;
};

struct Turn {
  Role role = Role::user;
  const ChatMessage* message = nullptr;  // null for a user turn opened by a tool result
  std::vector<Block> blocks;             // user turns
  Task task = Task::none;
  bool from_context = false;
};

// A tool message joins the user turn before it (or opens one); a user message joins it
// too unless that turn carries a task. Turns never merge across the context boundary.
void append_turns(std::span<const ChatMessage> messages, bool from_context,
                  std::vector<Turn>& turns) {
  const size_t first = turns.size();
  for (const ChatMessage& m : messages) {
    const bool after_user = turns.size() > first && turns.back().role == Role::user;
    if (m.role == Role::tool) {
      const Block block{true, &m.content, &m.tool_call_id};
      if (after_user) {
        turns.back().blocks.push_back(block);
      } else {
        turns.push_back({Role::user, nullptr, {block}, Task::none, from_context});
      }
    } else if (m.role == Role::user) {
      const Block block{false, &m.content, nullptr};
      if (after_user && turns.back().task == Task::none) {
        turns.back().blocks.push_back(block);
      } else {
        turns.push_back({Role::user, &m, {block}, m.task, from_context});
      }
    } else {
      const Task task = m.role == Role::developer ? m.task : Task::none;
      turns.push_back({m.role, &m, {}, task, from_context});
    }
  }
}

// Tool results in the order of the latest assistant's calls (unknown ids first, stable).
void sort_tool_results(std::vector<Turn>& turns) {
  std::map<std::string_view, size_t> order;
  for (Turn& turn : turns) {
    if (turn.role == Role::assistant && !turn.message->tool_calls.empty()) {
      order.clear();
      const auto& calls = turn.message->tool_calls;
      for (size_t i = 0; i < calls.size(); ++i) {
        if (!calls[i].id.empty()) order[calls[i].id] = i;
      }
    } else if (turn.role == Role::user && !order.empty()) {
      std::vector<Block*> slots;
      for (Block& b : turn.blocks) {
        if (b.tool_result) slots.push_back(&b);
      }
      if (slots.size() < 2) continue;
      std::vector<Block> sorted;
      for (const Block* b : slots) sorted.push_back(*b);
      const auto rank = [&](const Block& b) {
        const auto it = order.find(*b.tool_call_id);
        return it == order.end() ? size_t{0} : it->second;
      };
      std::stable_sort(sorted.begin(), sorted.end(),
                       [&](const Block& a, const Block& b) { return rank(a) < rank(b); });
      for (size_t i = 0; i < slots.size(); ++i) *slots[i] = sorted[i];
    }
  }
}

bool is_user_like(Role role) { return role == Role::user || role == Role::developer; }

// Index of the last user/developer turn, -1 if none.
long last_user_index(const std::vector<Turn>& turns) {
  for (size_t i = turns.size(); i-- > 0;) {
    if (is_user_like(turns[i].role)) return static_cast<long>(i);
  }
  return -1;
}

// Thinking mode, dropping: developer turns before the last user turn go. Assistant turns
// before it lose their reasoning at render time (render_assistant).
std::vector<Turn> drop_thinking(std::vector<Turn> turns) {
  const long last_user = last_user_index(turns);
  std::vector<Turn> kept;
  for (size_t i = 0; i < turns.size(); ++i) {
    if (turns[i].role != Role::developer || static_cast<long>(i) >= last_user) {
      kept.push_back(std::move(turns[i]));
    }
  }
  return kept;
}

// ---------------------------------------------------------------------------------------
// Rendering.

struct RenderState {
  const std::vector<Turn>& turns;
  const EncodeOptions& options;
  bool drop;       // effective drop_thinking
  long last_user;  // index of the last user/developer turn
};

// Tools and response format of a system or developer message.
std::string render_extras(const ChatMessage& m) {
  std::string out;
  if (!m.tools.empty()) {
    out += "\n\n";
    out += render_tools(m.tools);
  }
  if (!m.response_format.is_null() && !m.response_format.empty()) {
    out += "\n\n";
    out += kResponseFormatHeader;
    out += python_json(m.response_format);
  }
  return out;
}

std::string render_user(const Turn& turn) {
  std::string out(kUserToken);
  const char* sep = "";
  for (const Block& b : turn.blocks) {
    out += sep;
    if (b.tool_result) out += kToolResultOpen;
    out += *b.text;
    if (b.tool_result) out += kToolResultClose;
    sep = "\n\n";
  }
  return out;
}

// Arguments as DSML parameters: strings raw with string="true", other values as JSON. Text
// that is not a JSON object becomes one parameter "arguments" holding that text.
std::string render_parameters(const ToolCall& call) {
  ojson args = ojson::parse(call.arguments, nullptr, /*allow_exceptions=*/false);
  if (!args.is_object()) args = ojson{{"arguments", call.arguments}};
  std::string out;
  const char* sep = "";
  for (const auto& [key, value] : args.items()) {
    out += sep;
    out += "<｜DSML｜parameter name=\"" + key + "\" string=\"";
    if (value.is_string()) {
      out += "true\">" + value.get<std::string>();
    } else {
      out += "false\">" + python_json(value);
    }
    out += "</｜DSML｜parameter>";
    sep = "\n";
  }
  return out;
}

std::string render_tool_calls(const std::vector<ToolCall>& calls) {
  if (calls.empty()) return {};
  std::string out = "\n\n<｜DSML｜tool_calls>\n";
  const char* sep = "";
  for (const ToolCall& call : calls) {
    out += sep;
    out += "<｜DSML｜invoke name=\"" + call.name + "\">\n";
    out += render_parameters(call);
    out += "\n</｜DSML｜invoke>";
    sep = "\n";
  }
  out += "\n</｜DSML｜tool_calls>";
  return out;
}

std::string render_assistant(const RenderState& s, size_t i) {
  const ChatMessage& m = *s.turns[i].message;
  std::string out;
  // A task turn's answer is a label, never reasoned.
  const bool after_task = i > 0 && s.turns[i - 1].task != Task::none;
  const bool keep_reasoning = !s.drop || static_cast<long>(i) > s.last_user;
  if (s.options.thinking && !after_task && keep_reasoning) {
    out += m.reasoning_content;
    out += kThinkEnd;
  }
  out += m.content;
  out += render_tool_calls(m.tool_calls);
  if (!m.prefix) out += kEosToken;
  return out;
}

std::string render_body(const RenderState& s, size_t i) {
  const Turn& turn = s.turns[i];
  const ChatMessage* m = turn.message;
  switch (turn.role) {
    case Role::system:
      return m->content + render_extras(*m);
    case Role::developer:
      if (m->content.empty()) {
        fail(ErrorCode::chat_request, {.field = "content"}, "a developer message needs content");
      }
      return std::string(kUserToken) + m->content + render_extras(*m);
    case Role::user:
      return render_user(turn);
    case Role::latest_reminder:
      return std::string(kLatestReminderToken) + m->content;
    case Role::assistant:
      return render_assistant(s, i);
    case Role::tool:
      break;  // folded into user turns by append_turns
  }
  return {};
}

// What follows a turn that ends the conversation or precedes an assistant (or
// latest_reminder) turn: a task token, or for user/developer turns the assistant hand-off.
std::string render_hand_off(const RenderState& s, size_t i) {
  const Turn& turn = s.turns[i];
  const bool last = i + 1 == s.turns.size();
  if (last && !s.options.add_generation_prompt) return {};
  if (!last) {
    const Role next = s.turns[i + 1].role;
    if (next != Role::assistant && next != Role::latest_reminder) return {};
  }
  const bool think = s.options.thinking && (!s.drop || static_cast<long>(i) >= s.last_user);
  if (turn.task == Task::action) {
    return std::string(kAssistantToken) +
           std::string(s.options.thinking ? kThinkStart : kThinkEnd) +
           std::string(info(Task::action).token);
  }
  if (turn.task != Task::none) return std::string(info(turn.task).token);
  if (!is_user_like(turn.role)) return {};
  return std::string(kAssistantToken) + std::string(think ? kThinkStart : kThinkEnd);
}

std::string render_turn(const RenderState& s, size_t i) {
  std::string out;
  if (i == 0 && s.options.thinking && s.options.reasoning_effort == ReasoningEffort::max) {
    out += kEffortMaxPreamble;
  }
  out += render_body(s, i);
  out += render_hand_off(s, i);
  return out;
}

// ---------------------------------------------------------------------------------------
// OpenAI JSON -> messages.

[[noreturn]] void bad(const std::string& field, const std::string& message) {
  fail(ErrorCode::chat_request, {.field = field}, message);
}

std::string got(const ojson& j) { return std::string("got ") + j.type_name(); }

const std::string& need_string(const ojson& j, const std::string& field) {
  if (!j.is_string()) bad(field, "expected a string, " + got(j));
  return j.get_ref<const std::string&>();
}

// An optional string member: absent or null -> "".
std::string optional_string(const ojson& object, std::string_view key, const std::string& field) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return {};
  return need_string(*it, field + "." + std::string(key));
}

// String, null, or text parts joined by "\n\n".
std::string content_text(const ojson& object, const std::string& field) {
  const auto it = object.find("content");
  if (it == object.end() || it->is_null()) return {};
  const std::string f = field + ".content";
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array()) bad(f, "expected a string, null or an array of text parts, " + got(*it));
  std::string out;
  for (size_t i = 0; i < it->size(); ++i) {
    const ojson& part = (*it)[i];
    const std::string pf = f + "[" + std::to_string(i) + "]";
    if (!part.is_object()) bad(pf, "expected a content part object, " + got(part));
    const std::string type = optional_string(part, "type", pf);
    if (type != "text") bad(pf + ".type", "only text parts are supported, got '" + type + "'");
    if (i > 0) out += "\n\n";
    out += optional_string(part, "text", pf);
  }
  return out;
}

Role parse_role(const ojson& object, const std::string& field) {
  const auto it = object.find("role");
  if (it == object.end()) bad(field + ".role", "missing");
  const std::string& role = need_string(*it, field + ".role");
  for (const auto& [text, value] : kRoles) {
    if (text == role) return value;
  }
  bad(field + ".role", "unknown role '" + role +
                           "' (system, user, developer, assistant, tool, latest_reminder)");
}

Task parse_task(const ojson& object, Role role, const std::string& field) {
  const std::string task = optional_string(object, "task", field);
  if (task.empty()) return Task::none;
  if (!is_user_like(role)) bad(field + ".task", "only user and developer messages take a task");
  for (const TaskInfo& t : kTasks) {
    if (t.task != Task::none && t.name == task) return t.task;
  }
  bad(field + ".task",
      "unknown task '" + task + "' (action, query, authority, domain, title, read_url)");
}

ToolCall parse_tool_call(const ojson& j, const std::string& field) {
  if (!j.is_object()) bad(field, "expected an object, " + got(j));
  ToolCall call;
  call.id = optional_string(j, "id", field);
  const std::string type = optional_string(j, "type", field);
  if (!type.empty() && type != "function") bad(field + ".type", "expected 'function'");
  const auto fn = j.find("function");
  if (fn == j.end()) bad(field + ".function", "missing");
  if (!fn->is_object()) bad(field + ".function", "expected an object, " + got(*fn));
  call.name = optional_string(*fn, "name", field + ".function");
  if (call.name.empty()) bad(field + ".function.name", "missing or empty");
  const auto args = fn->find("arguments");
  if (args == fn->end() || args->is_null()) {
    call.arguments = "{}";
  } else if (args->is_string()) {
    call.arguments = args->get<std::string>();
  } else if (args->is_object()) {
    call.arguments = args->dump();
  } else {
    bad(field + ".function.arguments", "expected a JSON string or an object, " + got(*args));
  }
  return call;
}

std::vector<ToolCall> parse_tool_calls(const ojson& object, const std::string& field) {
  const auto it = object.find("tool_calls");
  if (it == object.end() || it->is_null()) return {};
  const std::string f = field + ".tool_calls";
  if (!it->is_array()) bad(f, "expected an array, " + got(*it));
  std::vector<ToolCall> calls;
  for (size_t i = 0; i < it->size(); ++i) {
    calls.push_back(parse_tool_call((*it)[i], f + "[" + std::to_string(i) + "]"));
  }
  return calls;
}

ChatMessage parse_message(const ojson& j, const std::string& field, bool last) {
  if (!j.is_object()) bad(field, "expected a message object, " + got(j));
  ChatMessage m;
  m.role = parse_role(j, field);
  m.content = content_text(j, field);
  m.name = optional_string(j, "name", field);
  m.task = parse_task(j, m.role, field);
  if (m.role == Role::developer && m.content.empty()) {
    bad(field + ".content", "a developer message needs content");
  }
  if (m.role == Role::assistant) {
    m.reasoning_content = optional_string(j, "reasoning_content", field);
    m.tool_calls = parse_tool_calls(j, field);
  }
  if (m.role == Role::tool) m.tool_call_id = optional_string(j, "tool_call_id", field);
  if (const auto p = j.find("prefix"); p != j.end() && !p->is_null()) {
    if (!p->is_boolean()) bad(field + ".prefix", "expected a boolean, " + got(*p));
    m.prefix = p->get<bool>();
    if (m.prefix && (!last || m.role != Role::assistant)) {
      bad(field + ".prefix", "only the last message, an assistant message, can be a prefix");
    }
  }
  return m;
}

std::vector<ojson> parse_tools(const ojson& tools) {
  if (tools.is_null()) return {};
  if (!tools.is_array()) bad("tools", "expected an array, " + got(tools));
  std::vector<ojson> functions;
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    const std::string f = "tools[" + std::to_string(i) + "]";
    if (!t.is_object()) bad(f, "expected an object, " + got(t));
    if (optional_string(t, "type", f) != "function") bad(f + ".type", "expected 'function'");
    const auto fn = t.find("function");
    if (fn == t.end()) bad(f + ".function", "missing");
    if (!fn->is_object()) bad(f + ".function", "expected an object, " + got(*fn));
    if (optional_string(*fn, "name", f + ".function").empty()) {
      bad(f + ".function.name", "missing or empty");
    }
    functions.push_back(*fn);
  }
  return functions;
}

ojson parse_response_format(const ojson& format) {
  if (format.is_null()) return nullptr;
  if (!format.is_object()) bad("response_format", "expected an object, " + got(format));
  if (optional_string(format, "type", "response_format") == "text") return nullptr;
  return format;
}

}  // namespace

std::string_view name(Role role) {
  for (const auto& [text, value] : kRoles) {
    if (value == role) return text;
  }
  return "?";
}

std::string_view name(Task task) { return info(task).name; }

std::string render_tools(std::span<const ojson> functions) {
  std::string out(kToolsHeader);
  const char* sep = "";
  for (const ojson& f : functions) {
    out += sep;
    out += python_json(f);
    sep = "\n";
  }
  out += kToolsFooter;
  return out;
}

std::string encode_messages(std::span<const ChatMessage> messages, const EncodeOptions& options,
                            std::span<const ChatMessage> context) {
  std::vector<Turn> turns;
  append_turns(context, true, turns);
  append_turns(messages, false, turns);
  sort_tool_results(turns);

  const auto has_tools = [](const ChatMessage& m) { return !m.tools.empty(); };
  const bool drop = options.drop_thinking && std::none_of(context.begin(), context.end(), has_tools) &&
                    std::none_of(messages.begin(), messages.end(), has_tools);
  if (options.thinking && drop) turns = drop_thinking(std::move(turns));

  const RenderState state{turns, options, drop, last_user_index(turns)};
  std::string prompt = options.add_bos && context.empty() ? std::string(kBosToken) : "";
  for (size_t i = 0; i < turns.size(); ++i) {
    if (!turns[i].from_context) prompt += render_turn(state, i);
  }
  return prompt;
}

std::vector<ChatMessage> messages_from_openai(const ojson& messages, const ojson& tools,
                                              const ojson& response_format) {
  if (!messages.is_array() || messages.empty()) {
    bad("messages", "expected a non-empty array of messages, " + got(messages));
  }
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    out.push_back(parse_message(messages[i], "messages[" + std::to_string(i) + "]",
                                i + 1 == messages.size()));
  }
  std::vector<ojson> functions = parse_tools(tools);
  ojson format = parse_response_format(response_format);
  if (functions.empty() && format.is_null()) return out;
  if (out.front().role != Role::system) out.insert(out.begin(), ChatMessage{.role = Role::system});
  out.front().tools = std::move(functions);
  out.front().response_format = std::move(format);
  return out;
}

ReasoningEffort reasoning_effort_from_openai(const ojson& value) {
  if (value.is_null()) return ReasoningEffort::none;
  const std::string& effort = need_string(value, "reasoning_effort");
  if (effort == "low" || effort == "medium" || effort == "high") return ReasoningEffort::high;
  if (effort == "max") return ReasoningEffort::max;
  bad("reasoning_effort", "unknown effort '" + effort + "' (low, medium, high, max)");
}

}  // namespace keel
