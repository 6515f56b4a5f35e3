// keel perplexity: perplexity of a text under the model, in windows of --context tokens.
#include <cstdio>
#include <fmt/format.h>
#include <fstream>
#include <sstream>

#include "base/error.h"
#include "cli/commands.h"
#include "cli/load_model.h"
#include "io/npy.h"
#include "model/perplexity.h"
#include "tokenizer/tokenizer.h"

namespace keel::cli {

void add_perplexity(CLI::App& app) {
  auto* cmd = app.add_subcommand("perplexity", "Perplexity of a text (or of token ids) under the model");
  struct Options {
    std::string model, text, ids;
    int64_t context = 512;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("--model", o->model, "Model directory")->required();
  auto* text = cmd->add_option("--text", o->text, "UTF-8 text file, tokenized with the model's tokenizer (BOS added)");
  auto* ids = cmd->add_option("--ids", o->ids, "Token ids instead of text (.npy or a text file of integers)");
  text->excludes(ids);
  cmd->add_option("--context", o->context, "Window size in tokens (capped at the model's maximum)")
      ->capture_default_str();
  cmd->callback([o] {
    if (o->text.empty() == o->ids.empty()) fail(ErrorCode::usage, {}, "give one of --text FILE and --ids FILE");
    std::vector<int32_t> tokens;
    if (!o->text.empty()) {
      std::ifstream in(o->text, std::ios::binary);
      if (!in) fail(ErrorCode::io, {.file = o->text}, "cannot open");
      std::stringstream ss;
      ss << in.rdbuf();
      tokens = Tokenizer::from_model_dir(o->model).encode(ss.str(), /*add_special_tokens=*/true);
    } else {
      tokens = read_ids(o->ids);
    }
    const auto model = load_model(o->model);
    const int64_t context = std::min<int64_t>(o->context, model->config().max_position_embeddings);
    const auto r = perplexity(*model, tokens, context, [](const PerplexityResult& p) {
      fmt::print(stderr, "\r[{} windows] running perplexity {:.4f}", p.windows, p.perplexity());
      std::fflush(stderr);
    });
    fmt::print(stderr, "\n");
    fmt::print("perplexity: {:.4f}\ntokens: {} ({} scored, {} windows of up to {})\nnats per token: {:.6f}\n",
               r.perplexity(), tokens.size(), r.predicted, r.windows, context, r.nats_per_token());
  });
}

}  // namespace keel::cli
