// keel bench serve: a load generator for any OpenAI-compatible server, in the manner of
// `vllm bench serve`: random token-id prompts of a given length, or the prompts of a
// file, to /v1/completions, streamed, with a fixed concurrency or a Poisson request
// rate; it reports TTFT, TPOT,
// inter-token latency and end-to-end latency (mean, p50, p99) and request and token
// throughput. One thread per concurrent client (Boost.Beast, blocking).
#include <utility>  // before Boost.Asio, which uses std::exchange without it

#include <algorithm>
#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <fmt/format.h>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "base/error.h"
#include "cli/commands.h"

namespace keel::cli {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string url = "http://127.0.0.1:8000", model, prompts;
  int num_prompts = 64, concurrency = 8, input_len = 128, output_len = 64, token_range = 4000;
  double request_rate = 0;  // requests/s, Poisson; 0: as fast as the concurrency allows
  uint64_t seed = 1;
  bool json = false;
};

struct Target {
  std::string host, port;
};

Target parse_url(const std::string& url) {
  const std::string prefix = "http://";
  if (!url.starts_with(prefix)) fail(ErrorCode::usage, {.field = "--url"}, "only http:// URLs: '" + url + "'");
  std::string rest = url.substr(prefix.size());
  rest = rest.substr(0, rest.find('/'));
  const auto colon = rest.rfind(':');
  if (colon == std::string::npos) return {rest, "80"};
  return {rest.substr(0, colon), rest.substr(colon + 1)};
}

// What one request measured; seconds.
struct Result {
  bool ok = false;
  std::string error;
  int input_tokens = 0, output_tokens = 0;  // as the server's usage counts them
  double ttft = 0, e2e = 0;
  std::vector<double> itl;  // gaps between streamed chunks after the first
};

http::request<http::string_body> post(const Target& t, const std::string& path, const std::string& body) {
  http::request<http::string_body> req{http::verb::post, path, 11};
  req.set(http::field::host, t.host);
  req.set(http::field::content_type, "application/json");
  req.body() = body;
  req.prepare_payload();
  return req;
}

// One streamed completion: the time of each SSE event that carries text, and the usage.
Result run_one(const Target& target, const json& body) {
  Result r;
  const auto start = Clock::now();
  try {
    net::io_context io;
    beast::tcp_stream stream(io);
    stream.connect(net::ip::tcp::resolver(io).resolve(target.host, target.port));
    http::write(stream, post(target, "/v1/completions", body.dump()));
    beast::flat_buffer buffer;
    http::response_parser<http::buffer_body> parser;
    parser.body_limit(boost::none);
    http::read_header(stream, buffer, parser);
    if (parser.get().result() != http::status::ok) {
      r.error = fmt::format("HTTP {}", parser.get().result_int());
      return r;
    }
    std::string pending;
    char chunk[8192];
    double last = 0;
    while (!parser.is_done()) {
      parser.get().body().data = chunk;
      parser.get().body().size = sizeof(chunk);
      beast::error_code ec;
      http::read_some(stream, buffer, parser, ec);
      if (ec == http::error::need_buffer) ec = {};
      if (ec && ec != http::error::end_of_stream) throw beast::system_error(ec);
      pending.append(chunk, sizeof(chunk) - parser.get().body().size);
      for (size_t end; (end = pending.find("\n\n")) != std::string::npos; pending.erase(0, end + 2)) {
        const std::string event = pending.substr(0, end);
        if (!event.starts_with("data: ") || event == "data: [DONE]") continue;
        const json data = json::parse(event.substr(6));
        if (data.contains("usage") && data["usage"].is_object()) {
          r.output_tokens = data["usage"]["completion_tokens"];
          r.input_tokens = data["usage"]["prompt_tokens"];
        }
        const bool text = data.contains("choices") && !data["choices"].empty() &&
                          !data["choices"][0].value("text", std::string()).empty();
        if (!text) continue;
        const double now = std::chrono::duration<double>(Clock::now() - start).count();
        if (r.ttft == 0) {
          r.ttft = now;
        } else {
          r.itl.push_back(now - last);
        }
        last = now;
      }
      if (ec == http::error::end_of_stream) break;
    }
    r.ok = r.output_tokens > 0;
    if (!r.ok) r.error = "no usage in the stream";
  } catch (const std::exception& e) {
    r.error = e.what();
  }
  r.e2e = std::chrono::duration<double>(Clock::now() - start).count();
  return r;
}

std::string first_model(const Target& target) {
  net::io_context io;
  beast::tcp_stream stream(io);
  stream.connect(net::ip::tcp::resolver(io).resolve(target.host, target.port));
  http::request<http::empty_body> req{http::verb::get, "/v1/models", 11};
  req.set(http::field::host, target.host);
  http::write(stream, req);
  beast::flat_buffer buffer;
  http::response<http::string_body> res;
  http::read(stream, buffer, res);
  const json models = json::parse(res.body());
  if (!models.contains("data") || models["data"].empty()) fail(ErrorCode::bad_input, {.field = "--url"}, "the server lists no model");
  return models["data"][0]["id"];
}

struct Summary {
  double mean = 0, p50 = 0, p99 = 0;
};

Summary summarize(std::vector<double> v) {
  if (v.empty()) return {};
  std::sort(v.begin(), v.end());
  double sum = 0;
  for (double x : v) sum += x;
  const auto at = [&](double q) { return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))]; };
  return {sum / v.size(), at(0.5), at(0.99)};
}

// The prompts of a file: one per line, either text or a JSON object with a "prompt"
// string (the JSONL of vLLM's custom dataset); empty lines are skipped.
std::vector<std::string> read_prompts(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(ErrorCode::io, {.file = path}, "cannot open the prompts file");
  std::vector<std::string> prompts;
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (line.empty()) continue;
    if (!line.starts_with("{")) {
      prompts.push_back(line);
      continue;
    }
    const json row = json::parse(line, nullptr, false);
    if (row.is_discarded() || !row.contains("prompt") || !row["prompt"].is_string()) {
      fail(ErrorCode::bad_input, {.file = path}, fmt::format("line {}: not a JSON object with a \"prompt\" string", number));
    }
    prompts.push_back(row["prompt"]);
  }
  if (prompts.empty()) fail(ErrorCode::bad_input, {.file = path}, "no prompts in the file");
  return prompts;
}

void run_bench_serve(const Options& o) {
  if (o.num_prompts < 1 || o.concurrency < 1 || o.input_len < 1 || o.output_len < 1 || o.token_range < 11) {
    fail(ErrorCode::usage, {}, "prompts, concurrency, input and output lengths must be >= 1, --token-range > 10");
  }
  const Target target = parse_url(o.url);
  const std::string model = o.model.empty() ? first_model(target) : o.model;
  std::mt19937_64 rng(o.seed);
  std::vector<json> bodies;
  std::vector<double> arrivals;  // seconds from the start
  double t = 0;
  std::exponential_distribution<double> gap(o.request_rate > 0 ? o.request_rate : 1.0);
  const std::vector<std::string> texts = o.prompts.empty() ? std::vector<std::string>{} : read_prompts(o.prompts);
  for (int i = 0; i < o.num_prompts; ++i) {
    json prompt;
    if (texts.empty()) {
      std::vector<int> ids(o.input_len);
      for (int& id : ids) id = static_cast<int>(10 + rng() % static_cast<uint64_t>(o.token_range - 10));
      prompt = ids;
    } else {
      prompt = texts[i % texts.size()];  // the file's prompts in order, again from the first
    }
    bodies.push_back({{"model", model}, {"prompt", prompt}, {"max_tokens", o.output_len}, {"temperature", 0},
                      {"ignore_eos", true}, {"stream", true}, {"stream_options", {{"include_usage", true}}}});
    arrivals.push_back(t);
    if (o.request_rate > 0) t += gap(rng);
  }

  std::vector<Result> results(o.num_prompts);
  std::atomic<int> next{0};
  const auto start = Clock::now();
  std::vector<std::thread> clients;
  for (int c = 0; c < std::min(o.concurrency, o.num_prompts); ++c) {
    clients.emplace_back([&] {
      for (int i; (i = next++) < o.num_prompts;) {
        std::this_thread::sleep_until(start + std::chrono::duration<double>(arrivals[i]));
        results[i] = run_one(target, bodies[i]);
      }
    });
  }
  for (auto& th : clients) th.join();
  const double duration = std::chrono::duration<double>(Clock::now() - start).count();

  int completed = 0;
  long long input_tokens = 0, output_tokens = 0;
  std::vector<double> ttft, tpot, itl, e2e;
  std::string first_error;
  for (const Result& r : results) {
    if (!r.ok) {
      if (first_error.empty()) first_error = r.error;
      continue;
    }
    ++completed;
    input_tokens += r.input_tokens;
    output_tokens += r.output_tokens;
    ttft.push_back(r.ttft);
    e2e.push_back(r.e2e);
    if (r.output_tokens > 1) tpot.push_back((r.e2e - r.ttft) / (r.output_tokens - 1));
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
  }
  const Summary s_ttft = summarize(ttft), s_tpot = summarize(tpot), s_itl = summarize(itl), s_e2e = summarize(e2e);
  if (o.json) {
    const auto ms = [](const Summary& s) { return json{{"mean", s.mean * 1e3}, {"p50", s.p50 * 1e3}, {"p99", s.p99 * 1e3}}; };
    const json out = {{"model", model}, {"requests", o.num_prompts}, {"completed", completed},
                      {"failed", o.num_prompts - completed}, {"duration_s", duration},
                      {"input_tokens", input_tokens}, {"output_tokens", output_tokens},
                      {"request_throughput", completed / duration}, {"output_throughput", output_tokens / duration},
                      {"total_token_throughput", (input_tokens + output_tokens) / duration},
                      {"ttft_ms", ms(s_ttft)}, {"tpot_ms", ms(s_tpot)}, {"itl_ms", ms(s_itl)}, {"e2e_ms", ms(s_e2e)},
                      {"first_error", first_error}};
    fmt::print("{}\n", out.dump());
    return;
  }
  fmt::print("model                     {}\n", model);
  fmt::print("requests                  {} completed, {} failed{}\n", completed, o.num_prompts - completed,
             first_error.empty() ? "" : " (first error: " + first_error + ")");
  fmt::print("duration                  {:.2f} s\n", duration);
  fmt::print("request throughput        {:.2f} req/s\n", completed / duration);
  fmt::print("output token throughput   {:.1f} tok/s\n", output_tokens / duration);
  fmt::print("total token throughput    {:.1f} tok/s\n", (input_tokens + output_tokens) / duration);
  const auto row = [](const char* name, const Summary& s) {
    fmt::print("{:<25} mean {:9.2f}  p50 {:9.2f}  p99 {:9.2f} ms\n", name, s.mean * 1e3, s.p50 * 1e3, s.p99 * 1e3);
  };
  row("time to first token", s_ttft);
  row("time per output token", s_tpot);
  row("inter-token latency", s_itl);
  row("end-to-end latency", s_e2e);
}

}  // namespace

void add_bench_serve(CLI::App& bench) {
  auto* cmd = bench.add_subcommand("serve", "Load an OpenAI-compatible server: latency and throughput");
  auto o = std::make_shared<Options>();
  cmd->add_option("--url", o->url, "Server base URL")->capture_default_str();
  cmd->add_option("--model", o->model, "Model name (default: the first /v1/models lists)");
  cmd->add_option("--num-prompts", o->num_prompts, "Requests to send")->capture_default_str();
  cmd->add_option("--concurrency", o->concurrency, "Requests in flight at most")->capture_default_str();
  cmd->add_option("--request-rate", o->request_rate, "Poisson arrivals per second (0: back to back)")->capture_default_str();
  cmd->add_option("--input-len", o->input_len, "Prompt tokens (random ids)")->capture_default_str();
  cmd->add_option("--prompts", o->prompts,
                  "A file of prompts instead of random ids: one per line, text or JSON {\"prompt\": ...}; "
                  "used in order, again from the first");
  cmd->add_option("--output-len", o->output_len, "Generated tokens per request (ignore_eos)")->capture_default_str();
  cmd->add_option("--token-range", o->token_range, "Prompt ids are drawn from [10, N)")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the prompts and arrivals")->capture_default_str();
  cmd->add_flag("--json", o->json, "One JSON object instead of the table");
  cmd->callback([o] { run_bench_serve(*o); });
}

}  // namespace keel::cli
