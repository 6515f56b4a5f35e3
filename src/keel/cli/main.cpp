#include <cstdio>
#include <exception>

#include "base/error.h"
#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"keel: an inference engine for DeepSeek-V4-class models"};
  app.set_version_flag("--version", "keel 0.1.0");
  app.require_subcommand(1);
  keel::cli::add_synth(app);
  keel::cli::add_inspect(app);
  keel::cli::add_plan(app);
  keel::cli::add_tokenize(app);
  keel::cli::add_logits(app);
  keel::cli::add_run(app);
  keel::cli::add_bench(app);
  keel::cli::add_perplexity(app);
  keel::cli::add_serve(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const keel::Error& e) {
    std::fprintf(stderr, "keel: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "keel: internal error: %s\n", e.what());
    return 3;
  }
  return 0;
}
