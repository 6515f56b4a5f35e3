// Streaming DeepSeek-V4 output parsing. Every case is fed whole, in every 2-way split and
// one byte at a time; the concatenated deltas must equal the hand-written expectation, so a
// marker split at any byte can neither leak into content or arguments nor be lost.
#include <gtest/gtest.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "chat/output_parser.h"

namespace keel {
namespace {

const std::string EOS = "<｜end▁of▁sentence｜>";
const std::string BLOCK = "\n\n<｜DSML｜tool_calls>\n";
const std::string END_BLOCK = "</｜DSML｜tool_calls>";

std::string invoke(const std::string& name, const std::string& params) {
  return "<｜DSML｜invoke name=\"" + name + "\">\n" + params + "</｜DSML｜invoke>\n";
}
std::string param(const std::string& name, bool is_string, const std::string& value) {
  return "<｜DSML｜parameter name=\"" + name + "\" string=\"" + (is_string ? "true" : "false") +
         "\">" + value + "</｜DSML｜parameter>\n";
}

struct ExpectedError {
  size_t offset;
  std::string text;
  std::optional<size_t> tool_call;
};

struct Expected {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;
  std::optional<ExpectedError> error;
};

// Empty when `got` is `want`, else what differs.
std::string differences(const ParsedOutput& got, const Expected& want) {
  std::ostringstream out;
  if (got.reasoning != want.reasoning) {
    out << "reasoning: got [" << got.reasoning << "] want [" << want.reasoning << "]\n";
  }
  if (got.content != want.content) {
    out << "content: got [" << got.content << "] want [" << want.content << "]\n";
  }
  if (got.tool_calls != want.tool_calls) {
    out << "tool calls differ; got:\n";
    for (const ToolCall& c : got.tool_calls) {
      out << "  " << c.id << " " << c.name << " " << c.arguments << "\n";
    }
  }
  if (got.error.has_value() != want.error.has_value()) {
    out << "error: got " << (got.error ? got.error->message : "none") << "\n";
  } else if (got.error) {
    if (got.error->offset != want.error->offset) {
      out << "error offset: got " << got.error->offset << " want " << want.error->offset << "\n";
    }
    if (got.error->text != want.error->text) {
      out << "error text: got [" << got.error->text << "] want [" << want.error->text << "]\n";
    }
    if (got.error->tool_call != want.error->tool_call) out << "error tool_call differs\n";
    if (got.error->message.empty()) out << "error message empty\n";
  }
  return out.str();
}

ParsedOutput stream(const std::vector<std::string_view>& pieces, const OutputParserOptions& o) {
  OutputParser parser(o);
  ParsedOutput out;
  for (std::string_view piece : pieces) append(out, parser.feed(piece));
  FinalDelta last = parser.finish();
  append(out, last.delta);
  out.error = last.error;
  return out;
}

// Whole, every 2-way split, and byte by byte.
void check_all_splits(const std::string& text, const Expected& want,
                      const OutputParserOptions& options = {}) {
  ASSERT_EQ(differences(parse_output(text, options), want), "") << "whole text";
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    const std::string_view t(text);
    const std::string diff = differences(stream({t.substr(0, cut), t.substr(cut)}, options), want);
    ASSERT_EQ(diff, "") << "split at byte " << cut;
  }
  std::vector<std::string_view> bytes;
  for (size_t i = 0; i < text.size(); ++i) bytes.push_back(std::string_view(text).substr(i, 1));
  ASSERT_EQ(differences(stream(bytes, options), want), "") << "one byte at a time";
}

OutputParserOptions thinking() { return {.thinking = true}; }

// --- reasoning and content ---------------------------------------------------------------

TEST(OutputParser, PlainContent) {
  check_all_splits("Hello, world!" + EOS, {.content = "Hello, world!"});
  check_all_splits("No end of sentence", {.content = "No end of sentence"});
  check_all_splits("a\n\nb\n", {.content = "a\n\nb\n"});
  check_all_splits("", {});
}

TEST(OutputParser, NearMarkersAreText) {
  check_all_splits("<thinking> and <｜DSM and \n\n<｜DSML and </thin" + EOS,
                   {.content = "<thinking> and <｜DSM and \n\n<｜DSML and </thin"});
  check_all_splits("<think", {.content = "<think"});
}

TEST(OutputParser, ThinkingModeSplitsReasoningFromContent) {
  check_all_splits("Let me think.</think>It is 4." + EOS,
                   {.reasoning = "Let me think.", .content = "It is 4."}, thinking());
}

TEST(OutputParser, ThinkingModeStartCases) {
  // The prompt already ended with <think>; a repeated one is dropped.
  check_all_splits("<think>R</think>C", {.reasoning = "R", .content = "C"}, thinking());
  check_all_splits("</think>C" + EOS, {.content = "C"}, thinking());
  // Cut off while thinking: all of it is reasoning, no error.
  check_all_splits("still thinking", {.reasoning = "still thinking"}, thinking());
  check_all_splits("R" + EOS, {.reasoning = "R"}, thinking());
  // Chat mode, but the model opens thinking itself.
  check_all_splits("<think>R</think>C", {.reasoning = "R", .content = "C"});
  // Only at the very start.
  check_all_splits("C<think>", {.content = "C", .error = ExpectedError{1, "<think>", {}}});
}

TEST(OutputParser, OptionsForPrompt) {
  EXPECT_TRUE(parser_options_for_prompt("<｜User｜>Hi<｜Assistant｜><think>").thinking);
  EXPECT_FALSE(parser_options_for_prompt("<｜User｜>Hi<｜Assistant｜></think>").thinking);
  EXPECT_FALSE(parser_options_for_prompt("").thinking);
}

// --- tool calls ---------------------------------------------------------------------------

TEST(OutputParser, OneToolCall) {
  const std::string text = "Let me check." + BLOCK +
                           invoke("get_weather", param("city", true, "Paris") +
                                                     param("days", false, "3")) +
                           END_BLOCK + EOS;
  check_all_splits(text, {.content = "Let me check.",
                          .tool_calls = {{"call_0", "get_weather",
                                          R"({"city": "Paris", "days": 3})"}}});
}

// tool_choice: the prompt already opened the block (and the named call); the parser
// takes that opening as the output's first bytes, then the model's text.
TEST(OutputParser, ForcedOpeningIsParsedFirst) {
  const std::string named = BLOCK + "<｜DSML｜invoke name=\"get_weather\">\n";
  check_all_splits(param("city", true, "Paris") + "</｜DSML｜invoke>\n" + END_BLOCK + EOS,
                   {.tool_calls = {{"call_0", "get_weather", R"({"city": "Paris"})"}}}, {.forced = named});
  check_all_splits(invoke("f", "") + END_BLOCK, {.tool_calls = {{"call_0", "f", "{}"}}}, {.forced = BLOCK});
}

TEST(OutputParser, ToolCallsAfterReasoningWithValueKinds) {
  const std::string text =
      "Need data.</think>" + BLOCK +
      invoke("write", param("text", true, "line 1\n\"q\" \\ <b> é\t") +
                          param("opts", false, "{\"a\": [1, 2], \"b\": null}")) +
      invoke("now", "") + END_BLOCK + EOS;
  check_all_splits(
      text,
      {.reasoning = "Need data.",
       .tool_calls = {{"call_0", "write",
                       R"({"text": "line 1\n\"q\" \\ <b> é\t", "opts": {"a": [1, 2], "b": null}})"},
                      {"call_1", "now", "{}"}}},
      thinking());
}

TEST(OutputParser, IdsUseThePrefix) {
  const std::string text = BLOCK + invoke("f", "") + END_BLOCK;
  check_all_splits(text, {.tool_calls = {{"req7-0", "f", "{}"}}}, {.id_prefix = "req7-"});
}

TEST(OutputParser, BlockWithoutBlankLineAndLooseSpacing) {
  const std::string text =
      "X<｜DSML｜tool_calls> <｜DSML｜invoke  name=\"f\">\t<｜DSML｜parameter name=\"k\"\n"
      "string=\"true\">v</｜DSML｜parameter></｜DSML｜invoke>\r\n</｜DSML｜tool_calls>\n" +
      EOS;
  check_all_splits(text, {.content = "X", .tool_calls = {{"call_0", "f", R"({"k": "v"})"}}});
}

TEST(OutputParser, EmptyBlockAndEmptyValues) {
  check_all_splits("A" + BLOCK + END_BLOCK, {.content = "A"});
  const std::string text = BLOCK + invoke("f", param("s", true, "")) + END_BLOCK;
  check_all_splits(text, {.tool_calls = {{"call_0", "f", R"({"s": ""})"}}});
}

TEST(OutputParser, ReadsWhatTheEncoderWrites) {
  // The assistant turn of the encoding tests, after its hand-off.
  const std::string text =
      "Checking.\n\n<｜DSML｜tool_calls>\n"
      "<｜DSML｜invoke name=\"get_weather\">\n"
      "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
      "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
      "</｜DSML｜invoke>\n"
      "<｜DSML｜invoke name=\"g\">\n"
      "\n"
      "</｜DSML｜invoke>\n"
      "</｜DSML｜tool_calls>" +
      EOS;
  check_all_splits(text, {.content = "Checking.",
                          .tool_calls = {{"call_0", "get_weather", R"({"city": "Paris", "days": 3})"},
                                         {"call_1", "g", "{}"}}});
}

// --- streaming behaviour -------------------------------------------------------------------

TEST(OutputParserStreaming, HoldsBackOnlyWhatCouldStartAMarker) {
  OutputParser p;
  EXPECT_EQ(p.feed("Hello").content, "Hello");
  EXPECT_EQ(p.feed(" <").content, " ");
  EXPECT_EQ(p.feed("b").content, "<b");
  EXPECT_EQ(p.feed("\n").content, "");
  EXPECT_EQ(p.feed("\n").content, "");
  EXPECT_EQ(p.feed("x").content, "\n\nx");
  EXPECT_EQ(p.feed("\n").content, "");
  const FinalDelta last = p.finish();
  EXPECT_EQ(last.delta.content, "\n");
  EXPECT_FALSE(last.error);
}

TEST(OutputParserStreaming, LeadingThinkIsHeldUntilDecided) {
  OutputParser p;
  EXPECT_TRUE(p.feed("<th").empty());
  EXPECT_TRUE(p.feed("ink>").empty());
  EXPECT_EQ(p.feed("R").reasoning, "R");
}

TEST(OutputParserStreaming, ToolCallDeltas) {
  OutputParser p;
  EXPECT_EQ(p.feed("Ok." + BLOCK).content, "Ok.");
  const Delta head = p.feed("<｜DSML｜invoke name=\"get_weather\">\n");
  ASSERT_EQ(head.tool_calls.size(), 1u);
  EXPECT_EQ(head.tool_calls[0].index, 0u);
  EXPECT_EQ(head.tool_calls[0].id, "call_0");
  EXPECT_EQ(head.tool_calls[0].name, "get_weather");
  EXPECT_EQ(head.tool_calls[0].arguments, "");
  // String values stream; the held-back '<' could start the closing tag.
  const Delta value = p.feed("<｜DSML｜parameter name=\"city\" string=\"true\">Par<");
  ASSERT_EQ(value.tool_calls.size(), 1u);
  EXPECT_EQ(value.tool_calls[0].id, "");
  EXPECT_EQ(value.tool_calls[0].name, "");
  EXPECT_EQ(value.tool_calls[0].arguments, R"({"city": "Par)");
  EXPECT_EQ(p.feed("is<").tool_calls.at(0).arguments, "<is");
  EXPECT_EQ(p.feed("/｜DSML｜parameter>\n").tool_calls.at(0).arguments, "\"");
  // JSON values are emitted once closed and checked.
  EXPECT_TRUE(p.feed("<｜DSML｜parameter name=\"days\" string=\"false\">3").tool_calls.at(0)
                  .arguments == ", \"days\": ");
  EXPECT_EQ(p.feed("</｜DSML｜parameter>\n").tool_calls.at(0).arguments, "3");
  EXPECT_EQ(p.feed("</｜DSML｜invoke>\n").tool_calls.at(0).arguments, "}");
  EXPECT_TRUE(p.feed(END_BLOCK + EOS).empty());
  EXPECT_FALSE(p.finish().error);
}

// --- malformed output: reported, never content, never dropped ---------------------------

TEST(OutputParserMalformed, StrayTokensInText) {
  check_all_splits("Hi</think>there", {.content = "Hi", .error = ExpectedError{2, "</think>there", {}}});
  check_all_splits("Hi<｜begin▁of▁sentence｜>x",
                   {.content = "Hi", .error = ExpectedError{2, "<｜begin▁of▁sentence｜>x", {}}});
  check_all_splits("A<｜DSML｜invoke name=\"f\">",
                   {.content = "A", .error = ExpectedError{1, "<｜DSML｜invoke name=\"f\">", {}}});
  check_all_splits("A｜DSML｜B", {.content = "A", .error = ExpectedError{1, "｜DSML｜B", {}}});
  // Tool calls inside reasoning.
  const std::string in_reasoning = "R" + BLOCK + invoke("f", "") + END_BLOCK;
  check_all_splits(in_reasoning,
                   {.reasoning = "R\n\n", .error = ExpectedError{3, in_reasoning.substr(3), {}}},
                   thinking());
}

TEST(OutputParserMalformed, TextAfterTheEnd) {
  check_all_splits("Hi" + EOS + "more", {.content = "Hi", .error = ExpectedError{2 + EOS.size(), "more", {}}});
  const std::string head = BLOCK + invoke("f", "") + END_BLOCK;
  check_all_splits(head + "\ntrailing" + EOS,
                   {.tool_calls = {{"call_0", "f", "{}"}},
                    .error = ExpectedError{head.size() + 1, "trailing" + EOS, {}}});
}

TEST(OutputParserMalformed, BadTags) {
  // invoke without a name attribute
  const std::string no_name = "<｜DSML｜invoke>\n</｜DSML｜invoke>\n" + END_BLOCK;
  check_all_splits("A" + BLOCK + no_name,
                   {.content = "A", .error = ExpectedError{1 + BLOCK.size(), no_name, {}}});
  // an empty name
  const std::string empty_name = invoke("", "") + END_BLOCK;
  check_all_splits(BLOCK + empty_name, {.error = ExpectedError{BLOCK.size(), empty_name, {}}});
  // string="maybe": the call has begun and is left unfinished
  const std::string head = BLOCK + "<｜DSML｜invoke name=\"f\">\n";
  const std::string bad_flag = "<｜DSML｜parameter name=\"k\" string=\"maybe\">v</｜DSML｜parameter>\n";
  check_all_splits(head + bad_flag,
                   {.tool_calls = {{"call_0", "f", ""}},
                    .error = ExpectedError{head.size(), bad_flag, 0}});
  // junk between tags
  check_all_splits(head + "junk",
                   {.tool_calls = {{"call_0", "f", ""}}, .error = ExpectedError{head.size(), "junk", 0}});
}

TEST(OutputParserMalformed, BadValues) {
  const std::string head = BLOCK + "<｜DSML｜invoke name=\"f\">\n" + param("a", true, "x");
  // string="false" value that is not JSON: held whole, reported whole
  const std::string not_json = "{oops</｜DSML｜parameter>\n</｜DSML｜invoke>\n" + END_BLOCK;
  const size_t value_at = head.size() + std::string("<｜DSML｜parameter name=\"b\" string=\"false\">").size();
  check_all_splits(head + "<｜DSML｜parameter name=\"b\" string=\"false\">" + not_json,
                   {.tool_calls = {{"call_0", "f", R"({"a": "x", "b": )"}},
                    .error = ExpectedError{value_at, not_json, 0}});
  // duplicate parameter
  const std::string again = param("a", true, "y") + "</｜DSML｜invoke>\n" + END_BLOCK;
  check_all_splits(head + again, {.tool_calls = {{"call_0", "f", R"({"a": "x")"}},
                                  .error = ExpectedError{head.size(), again, 0}});
  // a stray token inside a string value
  const std::string open = BLOCK + "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"s\" string=\"true\">";
  check_all_splits(open + "ab<think>cd",
                   {.tool_calls = {{"call_0", "f", R"({"s": "ab)"}},
                    .error = ExpectedError{open.size() + 2, "<think>cd", 0}});
}

TEST(OutputParserMalformed, EndsInsideTheBlock) {
  const std::string open = BLOCK + "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"city\" string=\"true\">";
  check_all_splits(open + "Par", {.tool_calls = {{"call_0", "f", R"({"city": "Par)"}},
                                  .error = ExpectedError{open.size() + 3, "", 0}});
  check_all_splits(open + "Paris</｜DSML｜para",
                   {.tool_calls = {{"call_0", "f", R"({"city": "Paris)"}},
                    .error = ExpectedError{open.size() + 5, "</｜DSML｜para", 0}});
  // between calls: nothing unfinished
  const std::string done = BLOCK + invoke("f", "");
  check_all_splits(done, {.tool_calls = {{"call_0", "f", "{}"}}, .error = ExpectedError{done.size(), "", {}}});
  check_all_splits("A" + BLOCK, {.content = "A", .error = ExpectedError{1 + BLOCK.size(), "", {}}});
}

}  // namespace
}  // namespace keel
