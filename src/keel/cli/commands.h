// Each `keel` subcommand registers itself on the app; main() dispatches.
#pragma once

#include <CLI/CLI.hpp>

namespace keel::cli {

void add_synth(CLI::App& app);
void add_inspect(CLI::App& app);

}  // namespace keel::cli
