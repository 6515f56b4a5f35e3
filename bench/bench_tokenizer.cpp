// Encode and decode speed of keel's tokenizer on one thread.
//
//   build/bench_tokenizer [--benchmark_filter=...]
// Environment: KEEL_TOKENIZER (default tests/fixtures/tokenizer/deepseek-v3/tokenizer.json)
// and KEEL_BENCH_TEXT (a UTF-8 text file; default: the texts of
// tests/fixtures/tokenizer/corpus.jsonl joined by newlines), both relative to the
// working directory. Throughput is reported as bytes_per_second of input text.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

const keel::Tokenizer& tokenizer() {
  static const keel::Tokenizer t = keel::Tokenizer::load(
      env_or("KEEL_TOKENIZER", "tests/fixtures/tokenizer/deepseek-v3/tokenizer.json"), "");
  return t;
}

const std::string& text() {
  static const std::string t = [] {
    const std::string path = env_or("KEEL_BENCH_TEXT", "");
    if (!path.empty()) return read_file(path);
    std::istringstream corpus(read_file("tests/fixtures/tokenizer/corpus.jsonl"));
    std::string out, line;
    while (std::getline(corpus, line)) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("text")) out += j["text"].get<std::string>() + "\n";
    }
    return out;
  }();
  return t;
}

std::vector<std::string> lines() {
  std::vector<std::string> out;
  std::istringstream in(text());
  std::string line;
  while (std::getline(in, line)) out.push_back(line + "\n");
  return out;
}

void BM_EncodeWhole(benchmark::State& state) {
  const auto& tok = tokenizer();
  const auto& t = text();
  size_t ids = 0;
  for (auto _ : state) {
    auto v = tok.encode(t);
    ids = v.size();
    benchmark::DoNotOptimize(v.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * t.size()));
  state.counters["tokens"] = static_cast<double>(ids);
}

void BM_EncodeLines(benchmark::State& state) {
  const auto& tok = tokenizer();
  const auto ls = lines();
  size_t bytes = 0;
  for (const auto& l : ls) bytes += l.size();
  std::vector<int32_t> ids;
  for (auto _ : state) {
    for (const auto& l : ls) {
      ids.clear();
      tok.encode(l, false, ids);
      benchmark::DoNotOptimize(ids.data());
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

void BM_Decode(benchmark::State& state) {
  const auto& tok = tokenizer();
  const auto ids = tok.encode(text());
  for (auto _ : state) {
    auto s = tok.decode(ids);
    benchmark::DoNotOptimize(s.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text().size()));
}

void BM_StreamDecode(benchmark::State& state) {
  const auto& tok = tokenizer();
  const auto ids = tok.encode(text());
  std::string out;
  for (auto _ : state) {
    keel::StreamDecoder stream(tok);
    out.clear();
    for (const int32_t id : ids) stream.push(id, out);
    out += stream.flush();
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text().size()));
}

}  // namespace

BENCHMARK(BM_EncodeWhole)->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK(BM_EncodeLines)->Unit(benchmark::kMillisecond)->MinTime(2.0);
BENCHMARK(BM_Decode)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_StreamDecode)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
