// The DeepSeek-V4 message encoding (assets.md §2.3). Every expected prompt is written out
// by hand from the rules of encoding_dsv4.py, never produced by the encoder.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "chat/encoding.h"
#include "testing.h"

namespace keel {
namespace {

using ojson = nlohmann::ordered_json;

const std::string BOS = "<｜begin▁of▁sentence｜>";
const std::string EOS = "<｜end▁of▁sentence｜>";
const std::string USER = "<｜User｜>";
const std::string ASSISTANT = "<｜Assistant｜>";

ChatMessage system_msg(std::string content) { return {.role = Role::system, .content = content}; }
ChatMessage user(std::string content) { return {.role = Role::user, .content = content}; }
ChatMessage developer(std::string content) {
  return {.role = Role::developer, .content = content};
}
ChatMessage assistant(std::string content, std::string reasoning = "",
                      std::vector<ToolCall> calls = {}) {
  return {.role = Role::assistant,
          .content = content,
          .reasoning_content = reasoning,
          .tool_calls = calls};
}
ChatMessage tool(std::string id, std::string content) {
  return {.role = Role::tool, .content = content, .tool_call_id = id};
}

EncodeOptions chat_mode() { return {}; }
EncodeOptions thinking_mode() { return {.thinking = true}; }

std::string encode(const std::vector<ChatMessage>& messages, const EncodeOptions& options,
                   const std::vector<ChatMessage>& context = {}) {
  return encode_messages(messages, options, context);
}

const ToolCall kWeatherCall{"call_1", "get_weather", R"({"city": "Paris", "days": 3})"};

// The DSML text of kWeatherCall after an assistant's content.
const std::string kWeatherDsml =
    "\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>";

const ojson kWeatherFunction = ojson::parse(
    R"({"name": "get_weather", "description": "Météo", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}})");

// The "## Tools" block for kWeatherFunction: keys in request order, Python spacing,
// non-ASCII kept.
const std::string kWeatherTools = R"(## Tools

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

{"name": "get_weather", "description": "Météo", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
)";

const std::string kEffortMax =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n";

// --- start, system, user, hand-off ---------------------------------------------------

TEST(ChatEncoding, ChatModeEndsWithAssistantAndThinkEnd) {
  EXPECT_EQ(encode({system_msg("You are terse."), user("Hi")}, chat_mode()),
            BOS + "You are terse." + USER + "Hi" + ASSISTANT + "</think>");
}

TEST(ChatEncoding, ThinkingModeEndsWithAssistantAndThinkStart) {
  EXPECT_EQ(encode({user("Hi")}, thinking_mode()), BOS + USER + "Hi" + ASSISTANT + "<think>");
}

TEST(ChatEncoding, BosOnlyWhenAsked) {
  EncodeOptions o = chat_mode();
  o.add_bos = false;
  EXPECT_EQ(encode({user("Hi")}, o), USER + "Hi" + ASSISTANT + "</think>");
}

TEST(ChatEncoding, NoGenerationPromptLeavesTheLastUserTurnOpen) {
  EncodeOptions o = thinking_mode();
  o.add_generation_prompt = false;
  EXPECT_EQ(encode({user("Q1"), assistant("A1"), user("Q2")}, o),
            BOS + USER + "Q1" + ASSISTANT + "</think>A1" + EOS + USER + "Q2");
}

TEST(ChatEncoding, SystemMessageAloneHasNoHandOff) {
  EXPECT_EQ(encode({system_msg("S")}, chat_mode()), BOS + "S");
}

TEST(ChatEncoding, ConsecutiveUserMessagesMergeWithBlankLine) {
  EXPECT_EQ(encode({user("a"), user("b")}, chat_mode()),
            BOS + USER + "a\n\nb" + ASSISTANT + "</think>");
}

// --- assistant turns, thinking and the drop rules -------------------------------------

TEST(ChatEncoding, ChatModeNeverWritesReasoning) {
  EXPECT_EQ(encode({user("Q1"), assistant("A1", "R1"), user("Q2")}, chat_mode()),
            BOS + USER + "Q1" + ASSISTANT + "</think>A1" + EOS + USER + "Q2" + ASSISTANT +
                "</think>");
}

TEST(ChatEncoding, ThinkingModeDropsEarlierReasoning) {
  EXPECT_EQ(encode({user("Q1"), assistant("A1", "R1"), user("Q2")}, thinking_mode()),
            BOS + USER + "Q1" + ASSISTANT + "</think>A1" + EOS + USER + "Q2" + ASSISTANT +
                "<think>");
}

TEST(ChatEncoding, ThinkingModeWithoutDropKeepsEveryTurnsReasoning) {
  EncodeOptions o = thinking_mode();
  o.drop_thinking = false;
  EXPECT_EQ(encode({user("Q1"), assistant("A1", "R1"), user("Q2")}, o),
            BOS + USER + "Q1" + ASSISTANT + "<think>R1</think>A1" + EOS + USER + "Q2" +
                ASSISTANT + "<think>");
}

TEST(ChatEncoding, ReasoningAfterTheLastUserTurnIsKept) {
  // A trailing assistant turn (e.g. a conversation being scored) keeps its reasoning.
  EXPECT_EQ(encode({user("Q"), assistant("A", "R")}, thinking_mode()),
            BOS + USER + "Q" + ASSISTANT + "<think>R</think>A" + EOS);
}

TEST(ChatEncoding, ThinkingModeDropsDeveloperMessagesBeforeTheLastUser) {
  EXPECT_EQ(encode({system_msg("S"), developer("D"), user("U")}, thinking_mode()),
            BOS + "S" + USER + "U" + ASSISTANT + "<think>");
}

TEST(ChatEncoding, ChatModeKeepsDeveloperMessages) {
  EXPECT_EQ(encode({developer("D"), user("U")}, chat_mode()),
            BOS + USER + "D" + USER + "U" + ASSISTANT + "</think>");
}

TEST(ChatEncoding, LastDeveloperMessageGetsTheHandOff) {
  EXPECT_EQ(encode({user("U"), assistant("A"), developer("D")}, thinking_mode()),
            BOS + USER + "U" + ASSISTANT + "</think>A" + EOS + USER + "D" + ASSISTANT + "<think>");
}

TEST(ChatEncoding, DeveloperWithoutContentIsAnError) {
  const std::string what = KEEL_EXPECT_ERROR(encode({developer("")}, chat_mode()),
                                             ErrorCode::chat_request);
  EXPECT_NE(what.find("developer"), std::string::npos) << what;
}

TEST(ChatEncoding, PrefixAssistantTurnHasNoEos) {
  ChatMessage partial = assistant("The answer is");
  partial.prefix = true;
  EXPECT_EQ(encode({user("Q"), partial}, chat_mode()),
            BOS + USER + "Q" + ASSISTANT + "</think>The answer is");
}

// --- tool calls, tool results, tools --------------------------------------------------

TEST(ChatEncoding, AssistantToolCallsInDsml) {
  EXPECT_EQ(encode({user("Weather?"), assistant("Checking.", "", {kWeatherCall})}, chat_mode()),
            BOS + USER + "Weather?" + ASSISTANT + "</think>Checking." + kWeatherDsml + EOS);
}

TEST(ChatEncoding, SeveralCallsAndValueKinds) {
  const ToolCall mixed{"c1", "f", R"({"s": "a \"q\" <b>", "l": [1, 2.5, "x"], "o": {"k": null}, "t": true})"};
  const ToolCall empty{"c2", "g", "{}"};
  const ToolCall not_object{"c3", "h", "plain text"};
  EXPECT_EQ(encode({user("Q"), assistant("", "", {mixed, empty, not_object})}, chat_mode()),
            BOS + USER + "Q" + ASSISTANT + "</think>" +
                "\n\n<｜DSML｜tool_calls>\n"
                "<｜DSML｜invoke name=\"f\">\n"
                "<｜DSML｜parameter name=\"s\" string=\"true\">a \"q\" <b></｜DSML｜parameter>\n"
                "<｜DSML｜parameter name=\"l\" string=\"false\">[1, 2.5, \"x\"]</｜DSML｜parameter>\n"
                "<｜DSML｜parameter name=\"o\" string=\"false\">{\"k\": null}</｜DSML｜parameter>\n"
                "<｜DSML｜parameter name=\"t\" string=\"false\">true</｜DSML｜parameter>\n"
                "</｜DSML｜invoke>\n"
                "<｜DSML｜invoke name=\"g\">\n"
                "\n"
                "</｜DSML｜invoke>\n"
                "<｜DSML｜invoke name=\"h\">\n"
                "<｜DSML｜parameter name=\"arguments\" string=\"true\">plain text</｜DSML｜parameter>\n"
                "</｜DSML｜invoke>\n"
                "</｜DSML｜tool_calls>" +
                EOS);
}

TEST(ChatEncoding, ToolResultsBecomeUserBlocksInCallOrder) {
  const ToolCall first{"id_a", "a", "{}"};
  const ToolCall second{"id_b", "b", "{}"};
  const std::string prompt = encode(
      {user("Q"), assistant("", "", {first, second}), tool("id_b", "B out"), tool("id_a", "A out"),
       user("and?")},
      chat_mode());
  EXPECT_EQ(prompt, BOS + USER + "Q" + ASSISTANT + "</think>" +
                        "\n\n<｜DSML｜tool_calls>\n"
                        "<｜DSML｜invoke name=\"a\">\n\n</｜DSML｜invoke>\n"
                        "<｜DSML｜invoke name=\"b\">\n\n</｜DSML｜invoke>\n"
                        "</｜DSML｜tool_calls>" +
                        EOS + USER + "<tool_result>A out</tool_result>\n\n" +
                        "<tool_result>B out</tool_result>\n\nand?" + ASSISTANT + "</think>");
}

TEST(ChatEncoding, SystemToolsBlockAndNoDropWithTools) {
  // With tools anywhere nothing is dropped: every turn keeps its reasoning and each
  // hand-off opens thinking.
  ChatMessage sys = system_msg("Be brief.");
  sys.tools = {kWeatherFunction};
  const std::string prompt =
      encode({sys, user("Weather?"), assistant("", "Need data.", {kWeatherCall}),
              tool("call_1", "sunny")},
             thinking_mode());
  EXPECT_EQ(prompt, BOS + "Be brief.\n\n" + kWeatherTools + USER + "Weather?" + ASSISTANT +
                        "<think>Need data.</think>" + kWeatherDsml + EOS + USER +
                        "<tool_result>sunny</tool_result>" + ASSISTANT + "<think>");
}

TEST(ChatEncoding, ThinkingAgentLoopWithoutToolsDropsTheCallsReasoning) {
  // The tool result is a user turn, so the calling assistant turn is before the last user
  // turn: its reasoning goes, and its hand-off is </think>.
  EXPECT_EQ(encode({user("Weather?"), assistant("", "Need data.", {kWeatherCall}),
                    tool("call_1", "sunny")},
                   thinking_mode()),
            BOS + USER + "Weather?" + ASSISTANT + "</think>" + kWeatherDsml + EOS + USER +
                "<tool_result>sunny</tool_result>" + ASSISTANT + "<think>");
}

TEST(ChatEncoding, DeveloperToolsAndResponseFormat) {
  ChatMessage dev = developer("Use tools.");
  dev.tools = {kWeatherFunction};
  dev.response_format = ojson::parse(R"({"type": "json_object"})");
  EXPECT_EQ(encode({dev}, chat_mode()),
            BOS + USER + "Use tools.\n\n" + kWeatherTools +
                "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to "
                "reply:\n{\"type\": \"json_object\"}" +
                ASSISTANT + "</think>");
}

TEST(ChatEncoding, SystemResponseFormat) {
  ChatMessage sys = system_msg("S");
  sys.response_format = ojson::parse(R"({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})");
  EXPECT_EQ(encode({sys, user("U")}, chat_mode()),
            BOS + "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema "
                  "to reply:\n{\"type\": \"json_schema\", \"json_schema\": {\"name\": \"x\", "
                  "\"schema\": {\"type\": \"object\"}}}" +
                USER + "U" + ASSISTANT + "</think>");
}

// --- reasoning effort, latest_reminder, tasks ------------------------------------------

TEST(ChatEncoding, MaxEffortPreambleOnlyInThinkingMode) {
  EncodeOptions o = thinking_mode();
  o.reasoning_effort = ReasoningEffort::max;
  EXPECT_EQ(encode({system_msg("S"), user("U")}, o),
            BOS + kEffortMax + "S" + USER + "U" + ASSISTANT + "<think>");
  o.reasoning_effort = ReasoningEffort::high;
  EXPECT_EQ(encode({system_msg("S"), user("U")}, o), BOS + "S" + USER + "U" + ASSISTANT + "<think>");
  EncodeOptions c = chat_mode();
  c.reasoning_effort = ReasoningEffort::max;
  EXPECT_EQ(encode({user("U")}, c), BOS + USER + "U" + ASSISTANT + "</think>");
}

TEST(ChatEncoding, LatestReminder) {
  // A user turn followed by a latest_reminder turn still gets its hand-off.
  const ChatMessage reminder{.role = Role::latest_reminder, .content = "Today is Monday."};
  EXPECT_EQ(encode({system_msg("S"), user("U"), reminder}, chat_mode()),
            BOS + "S" + USER + "U" + ASSISTANT + "</think>" + "<｜latest_reminder｜>Today is Monday.");
}

TEST(ChatEncoding, TaskTokens) {
  ChatMessage query = user("U");
  query.task = Task::query;
  EXPECT_EQ(encode({query}, thinking_mode()), BOS + USER + "U" + "<｜query｜>");

  ChatMessage action = user("U");
  action.task = Task::action;
  EXPECT_EQ(encode({action}, thinking_mode()), BOS + USER + "U" + ASSISTANT + "<think><｜action｜>");
  EXPECT_EQ(encode({action}, chat_mode()), BOS + USER + "U" + ASSISTANT + "</think><｜action｜>");

  // The answer to a task is written without reasoning, even in thinking mode.
  ChatMessage title = user("U");
  title.task = Task::title;
  EXPECT_EQ(encode({title, assistant("A title", "R")}, thinking_mode()),
            BOS + USER + "U" + "<｜title｜>" + "A title" + EOS);
}

// --- continuing a context ---------------------------------------------------------------

TEST(ChatEncoding, ContextIsNotRewrittenAndHasNoBos) {
  EXPECT_EQ(encode({user("Q2")}, thinking_mode(), {user("Q1"), assistant("A1", "R1")}),
            USER + "Q2" + ASSISTANT + "<think>");
}

TEST(ChatEncoding, ToolResultsAfterContextFollowTheContextsCallOrder) {
  const ToolCall first{"id_a", "a", "{}"};
  const ToolCall second{"id_b", "b", "{}"};
  EXPECT_EQ(encode({tool("id_b", "B"), tool("id_a", "A")}, chat_mode(),
                   {user("Q"), assistant("", "", {first, second})}),
            USER + "<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>" + ASSISTANT +
                "</think>");
}

// --- OpenAI JSON -> messages ------------------------------------------------------------

TEST(ChatEncodingJson, ConvertsAConversation) {
  const ojson request = ojson::parse(R"({
    "messages": [
      {"role": "system", "content": "S"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
      {"role": "assistant", "content": null, "reasoning_content": "R",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    ]})");
  const std::vector<ChatMessage> m = messages_from_openai(request["messages"]);
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m[0].role, Role::system);
  EXPECT_EQ(m[0].content, "S");
  EXPECT_EQ(m[1].content, "a\n\nb");
  EXPECT_EQ(m[1].name, "ann");
  EXPECT_EQ(m[2].role, Role::assistant);
  EXPECT_EQ(m[2].content, "");
  EXPECT_EQ(m[2].reasoning_content, "R");
  ASSERT_EQ(m[2].tool_calls.size(), 1u);
  EXPECT_EQ(m[2].tool_calls[0], (ToolCall{"c1", "get_weather", R"({"city":"Paris"})"}));
  EXPECT_EQ(m[3].role, Role::tool);
  EXPECT_EQ(m[3].tool_call_id, "c1");
  EXPECT_EQ(m[3].content, "sunny");
}

TEST(ChatEncodingJson, ToolsGoOnAnInsertedEmptySystemMessage) {
  const ojson messages = ojson::parse(R"([{"role": "user", "content": "Weather?"}])");
  const ojson tools = ojson::array({{{"type", "function"}, {"function", kWeatherFunction}}});
  const std::vector<ChatMessage> m = messages_from_openai(messages, tools);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0].role, Role::system);
  EXPECT_EQ(encode(m, chat_mode()),
            BOS + "\n\n" + kWeatherTools + USER + "Weather?" + ASSISTANT + "</think>");
}

TEST(ChatEncodingJson, ToolsAndResponseFormatJoinAnExistingSystemMessage) {
  const ojson messages =
      ojson::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])");
  const ojson tools = ojson::array({{{"type", "function"}, {"function", kWeatherFunction}}});
  const std::vector<ChatMessage> m =
      messages_from_openai(messages, tools, ojson::parse(R"({"type": "json_object"})"));
  ASSERT_EQ(m.size(), 2u);
  ASSERT_EQ(m[0].tools.size(), 1u);
  EXPECT_EQ(m[0].tools[0], kWeatherFunction);
  EXPECT_EQ(m[0].response_format, ojson::parse(R"({"type": "json_object"})"));
  // {"type": "text"} asks for nothing.
  const std::vector<ChatMessage> plain =
      messages_from_openai(messages, nullptr, ojson::parse(R"({"type": "text"})"));
  EXPECT_TRUE(plain[0].response_format.is_null());
}

TEST(ChatEncodingJson, ExtensionsTaskPrefixAndRoles) {
  const std::vector<ChatMessage> m = messages_from_openai(ojson::parse(R"([
    {"role": "developer", "content": "D", "task": "domain"},
    {"role": "latest_reminder", "content": "L"},
    {"role": "assistant", "content": "A", "prefix": true}])"));
  EXPECT_EQ(m[0].task, Task::domain);
  EXPECT_EQ(m[1].role, Role::latest_reminder);
  EXPECT_TRUE(m[2].prefix);
}

TEST(ChatEncodingJson, ReasoningEffort) {
  EXPECT_EQ(reasoning_effort_from_openai(nullptr), ReasoningEffort::none);
  EXPECT_EQ(reasoning_effort_from_openai("low"), ReasoningEffort::high);
  EXPECT_EQ(reasoning_effort_from_openai("high"), ReasoningEffort::high);
  EXPECT_EQ(reasoning_effort_from_openai("max"), ReasoningEffort::max);
  const std::string what =
      KEEL_EXPECT_ERROR(reasoning_effort_from_openai("extreme"), ErrorCode::chat_request);
  EXPECT_NE(what.find("reasoning_effort"), std::string::npos) << what;
}

struct BadRequest {
  const char* messages;
  const char* tools;
  const char* field;  // must be named in the error
};

TEST(ChatEncodingJson, MalformedInputNamesTheField) {
  const BadRequest cases[] = {
      {R"({"role": "user"})", "null", "field 'messages'"},
      {R"([])", "null", "field 'messages'"},
      {R"([{"role": "user", "content": "a"}, 7])", "null", "messages[1]'"},
      {R"([{"content": "a"}])", "null", "messages[0].role"},
      {R"([{"role": "robot", "content": "a"}])", "null", "messages[0].role"},
      {R"([{"role": 3, "content": "a"}])", "null", "messages[0].role"},
      {R"([{"role": "user", "content": 5}])", "null", "messages[0].content"},
      {R"([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}])",
       "null", "messages[0].content[1].type"},
      {R"([{"role": "user", "content": [{"type": "text", "text": 1}]}])", "null",
       "messages[0].content[0].text"},
      {R"([{"role": "developer", "content": ""}])", "null", "messages[0].content"},
      {R"([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": {}}])", "null",
       "messages[1].tool_calls"},
      {R"([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}])", "null",
       "messages[0].tool_calls[0].function.name"},
      {R"([{"role": "assistant", "tool_calls": [{"id": "x"}]}])", "null",
       "messages[0].tool_calls[0].function"},
      {R"([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}])",
       "null", "messages[0].tool_calls[0].function.arguments"},
      {R"([{"role": "tool", "tool_call_id": 4, "content": "r"}])", "null",
       "messages[0].tool_call_id"},
      {R"([{"role": "user", "content": "a", "task": "dance"}])", "null", "messages[0].task"},
      {R"([{"role": "assistant", "content": "a", "task": "query"}])", "null", "messages[0].task"},
      {R"([{"role": "assistant", "content": "a", "prefix": true}, {"role": "user", "content": "b"}])",
       "null", "messages[0].prefix"},
      {R"([{"role": "user", "content": "a"}])", R"({"type": "function"})", "field 'tools'"},
      {R"([{"role": "user", "content": "a"}])", R"([{"type": "retrieval"}])", "tools[0].type"},
      {R"([{"role": "user", "content": "a"}])", R"([{"type": "function", "function": {}}])",
       "tools[0].function.name"},
  };
  for (const BadRequest& c : cases) {
    const std::string what = KEEL_EXPECT_ERROR(
        messages_from_openai(ojson::parse(c.messages), ojson::parse(c.tools)),
        ErrorCode::chat_request);
    EXPECT_NE(what.find(c.field), std::string::npos) << c.messages << "\n  -> " << what;
  }
}

TEST(ChatEncodingJson, MalformedResponseFormat) {
  const std::string what = KEEL_EXPECT_ERROR(
      messages_from_openai(ojson::parse(R"([{"role": "user", "content": "a"}])"), nullptr, "json"),
      ErrorCode::chat_request);
  EXPECT_NE(what.find("response_format"), std::string::npos) << what;
}

}  // namespace
}  // namespace keel
