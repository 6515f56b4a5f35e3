// The HTTP front of `keel serve`: Boost.Beast over one Asio thread, every connection
// asynchronous (no thread per connection); streamed responses are server-sent events.
// Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
// GET /metrics. Each response closes its connection (no keep-alive yet). A client that
// disconnects cancels its request: the engine frees its state at the next step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "serve/engine.h"
#include "serve/openai.h"

namespace keel::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;            // 0: any free port (port() tells which)
  std::string api_key;             // non-empty: /v1/* needs "Authorization: Bearer KEY"
  size_t max_body_bytes = 8u << 20;  // larger bodies get 413
};

class HttpServer {
 public:
  // Binds and listens (throws Error(io) when it cannot).
  HttpServer(Engine& engine, const ServedModel& served, ServerOptions options);
  ~HttpServer();
  uint16_t port() const;
  void run();   // serves until stop() or SIGINT / SIGTERM
  void stop();  // thread-safe

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel::serve
