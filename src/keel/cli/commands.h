// Each `keel` subcommand registers itself on the app; main() dispatches.
#pragma once

#include <CLI/CLI.hpp>

namespace keel::cli {

void add_synth(CLI::App& app);
void add_inspect(CLI::App& app);
void add_plan(CLI::App& app);
void add_tokenize(CLI::App& app);
void add_logits(CLI::App& app);
void add_run(CLI::App& app);
void add_bench(CLI::App& app);
void add_bench_serve(CLI::App& bench);  // keel bench serve
void add_perplexity(CLI::App& app);
void add_serve(CLI::App& app);

}  // namespace keel::cli
