// keel tokenize: JSON Lines of strings on stdin -> ids, one line each; --decode reverses.
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "base/error.h"
#include "cli/commands.h"
#include "tokenizer/tokenizer.h"

namespace keel::cli {
namespace {

struct TokenizeArgs {
  std::string tokenizer;
  bool add_special = false;
  bool decode = false;
  bool skip_special = false;
};

void run(const TokenizeArgs& a) {
  const Tokenizer tok = std::filesystem::is_directory(a.tokenizer) ? Tokenizer::from_model_dir(a.tokenizer)
                                                                    : Tokenizer::load(a.tokenizer);
  std::string line, out;
  std::vector<int32_t> ids;
  for (size_t n = 1; std::getline(std::cin, line); ++n) {
    const std::string where = "stdin line " + std::to_string(n);
    out.clear();
    if (a.decode) {
      ids.clear();
      std::istringstream in(line);
      std::string word;
      while (in >> word) {
        size_t used = 0;
        long long id = -1;
        try {
          id = std::stoll(word, &used);
        } catch (const std::exception&) {
        }
        if (used != word.size() || id < 0 || id >= tok.vocab_size())
          fail(ErrorCode::usage, {.file = where}, "'" + word + "' is not a token id (0.." +
                                                      std::to_string(tok.vocab_size() - 1) + ")");
        ids.push_back(static_cast<int32_t>(id));
      }
      out = nlohmann::json(tok.decode(ids, a.skip_special)).dump();
    } else {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const nlohmann::json::parse_error&) {
        fail(ErrorCode::usage, {.file = where}, "not a JSON string");
      }
      if (!j.is_string()) fail(ErrorCode::usage, {.file = where}, "not a JSON string");
      ids.clear();
      tok.encode(j.get_ref<const std::string&>(), a.add_special, ids);
      for (size_t k = 0; k < ids.size(); ++k) {
        if (k) out += ' ';
        out += std::to_string(ids[k]);
      }
    }
    out += '\n';
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
  std::fflush(stdout);
}

}  // namespace

void add_tokenize(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "tokenize", "Encode JSON Lines of strings from stdin to token ids (or --decode ids to strings)");
  auto args = std::make_shared<TokenizeArgs>();
  cmd->add_option("--tokenizer", args->tokenizer,
                  "tokenizer.json (tokenizer_config.json beside it is read too) or its directory")
      ->required();
  cmd->add_flag("--add-special", args->add_special, "Add the special tokens (BOS) as the model expects");
  cmd->add_flag("--decode", args->decode, "Read space-separated ids per line, print one JSON string per line");
  cmd->add_flag("--skip-special", args->skip_special, "With --decode: leave special tokens out");
  cmd->callback([args] { run(*args); });
}

}  // namespace keel::cli
