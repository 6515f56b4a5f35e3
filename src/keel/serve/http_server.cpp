#include "serve/http_server.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <deque>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "serve/metrics.h"

namespace keel::serve {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

struct HttpServer::Impl {
  Engine& engine;
  ServedModel served;
  ServerOptions options;
  net::io_context io{1};
  tcp::acceptor acceptor{io};
  net::signal_set signals{io, SIGINT, SIGTERM};
  LabeledCounter http_requests;  // by status code
  std::atomic<int64_t> connections{0};
  std::atomic<uint64_t> next_id{0};
  int64_t created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();

  Impl(Engine& e, const ServedModel& s, ServerOptions o) : engine(e), served(s), options(std::move(o)) {}
  void accept();
  std::string metrics() const;
};

namespace {

std::string_view reason(int status) {
  switch (status) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Payload Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
  }
  return "Status";
}

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, HttpServer::Impl& server) : stream_(std::move(socket)), server_(server) {
    server_.connections++;
  }
  ~Session() {
    server_.connections--;
    for (auto& h : handles_) h->cancel();
  }

  // Reads the next request on the connection (the first, or the next one kept alive).
  void start() {
    parser_.emplace();
    parser_->body_limit(server_.options.max_body_bytes);
    request_.reset();
    builder_.reset();
    handles_.clear();
    done_ = written_ = keep_alive_ = false;
    ++serial_;
    stream_.expires_after(std::chrono::seconds(60));  // also the idle limit of a kept-alive connection
    http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
      self->on_read(ec);
    });
  }

 private:
  void on_read(beast::error_code ec) {
    stream_.expires_never();
    // JSON responses carry their length, so the connection can take another request;
    // a server-sent event stream ends by closing it.
    keep_alive_ = !ec && parser_->get().keep_alive();
    if (ec == http::error::body_limit) {
      return respond_error(ApiError(413, "invalid_request_error",
                                    fmt::format("the body is larger than {} bytes", server_.options.max_body_bytes)));
    }
    if (ec) return close();
    try {
      handle(parser_->get());
    } catch (const ApiError& e) {
      respond_error(e);
    } catch (const std::exception& e) {
      respond_error(ApiError(500, "server_error", e.what()));
    }
  }

  void handle(const http::request<http::string_body>& req) {
    const std::string target(req.target().substr(0, req.target().find('?')));
    const bool get = req.method() == http::verb::get, post = req.method() == http::verb::post;
    if (target.starts_with("/v1/") && !server_.options.api_key.empty()) {
      const auto auth = req[http::field::authorization];
      if (auth != "Bearer " + server_.options.api_key) {
        throw ApiError(401, "invalid_request_error", "a valid API key is required (Authorization: Bearer KEY)", {},
                       "invalid_api_key");
      }
    }
    const auto method_check = [&](bool ok) {
      if (!ok) throw ApiError(405, "invalid_request_error", fmt::format("{} does not allow {}", target, std::string(req.method_string())));
    };
    if (target == "/health") {
      method_check(get);
      return respond(200, R"({"status":"ok"})");
    }
    if (target == "/metrics") {
      method_check(get);
      return respond(200, server_.metrics(), "text/plain; version=0.0.4");
    }
    if (target == "/v1/models") {
      method_check(get);
      nlohmann::ordered_json m = {{"id", server_.served.id}, {"object", "model"}, {"created", server_.created},
                                  {"owned_by", "keel"}, {"max_model_len", server_.served.model.config().max_position_embeddings}};
      return respond(200, nlohmann::ordered_json{{"object", "list"}, {"data", {m}}}.dump());
    }
    if (target == "/v1/chat/completions" || target == "/v1/completions") {
      method_check(post);
      return generate(target == "/v1/chat/completions" ? Endpoint::chat : Endpoint::completions, req.body());
    }
    throw ApiError(404, "invalid_request_error", fmt::format("no route {} {}", std::string(req.method_string()), target));
  }

  void generate(Endpoint endpoint, const std::string& body) {
    request_ = std::make_unique<ApiRequest>(parse_request(endpoint, body, server_.served));
    const std::string id = fmt::format("{}-{:x}{:06x}", endpoint == Endpoint::chat ? "chatcmpl" : "cmpl",
                                       server_.created, server_.next_id++);
    builder_ = std::make_unique<ResponseBuilder>(*request_, server_.served, id, server_.created);
    const auto executor = stream_.get_executor();
    for (int i = 0; i < request_->n; ++i) {
      GenerationRequest g = request_->generation;
      g.sampling.seed += static_cast<uint64_t>(i);
      std::shared_ptr<RequestHandle> handle;
      try {
        handle = server_.engine.submit(std::move(g), [self = shared_from_this(), i, executor, serial = serial_](
                                                          GenerationEvent&& ev) {
          net::post(executor, [self, i, serial, ev = std::move(ev)] {
            if (serial == self->serial_) self->on_event(i, ev);  // not a late event of an earlier request
          });
        });
      } catch (const Error& e) {
        for (auto& h : handles_) h->cancel();
        throw bad_request(e.what(), e.context().field);
      }
      if (!handle) {
        for (auto& h : handles_) h->cancel();
        handles_.clear();
        return respond_error(ApiError(503, "server_error", "the server is at its request limit; retry later", {}, "overloaded"),
                             "Retry-After: 1\r\n");
      }
      handles_.push_back(std::move(handle));
    }
    if (request_->stream) {
      keep_alive_ = false;
      server_.http_requests.add("200");
      send("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n");
    }
    watch();
  }

  // A read while the response is produced: its failure means the client went away (the
  // requests are cancelled). Bytes it reads are the start of the client's next request
  // and are kept for it.
  void watch() {
    watching_ = true;
    stream_.socket().async_read_some(net::buffer(scratch_), [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->watching_ = false;
      if (!ec) {
        self->buffer_.commit(net::buffer_copy(self->buffer_.prepare(n), net::buffer(self->scratch_.data(), n)));
        return self->done_ ? self->after_response() : self->watch();
      }
      if (ec == net::error::operation_aborted && self->done_) return self->after_response();  // cancelled by us
      self->disconnected_ = true;
      for (auto& h : self->handles_) h->cancel();
    });
  }

  // Once the response is written and no read is in flight: the next request, or close.
  void after_response() {
    if (!written_) return;
    if (!keep_alive_ || disconnected_) return close();
    if (watching_) {
      beast::error_code ec;
      stream_.socket().cancel(ec);  // the watch ends with operation_aborted and comes back here
      return;
    }
    start();
  }

  void on_event(int choice, const GenerationEvent& ev) {
    if (done_) return;
    std::vector<std::string> chunks;
    try {
      chunks = builder_->on_event(choice, ev);
    } catch (const std::exception& e) {
      for (auto& h : handles_) h->cancel();
      if (!request_->stream) return respond_error(ApiError(500, "server_error", e.what()));
      done_ = complete_ = true;
      send("data: " + ApiError(500, "server_error", e.what()).body() + "\n\n");
      return flush();
    }
    if (request_->stream) {
      for (const auto& c : chunks) send("data: " + c + "\n\n");
    }
    if (!builder_->finished()) return;
    done_ = true;
    const auto failure = builder_->failure();
    if (request_->stream) {
      if (failure) send("data: " + failure->body() + "\n\n");
      if (request_->include_usage && !failure) send("data: " + builder_->usage_chunk() + "\n\n");
      send("data: [DONE]\n\n");
      complete_ = true;
      flush();
    } else if (failure) {
      respond_error(*failure);
    } else {
      respond(200, builder_->response());
    }
  }

  void respond_error(const ApiError& e, const std::string& extra_headers = {}) {
    done_ = true;
    respond(e.status, e.body(), "application/json", extra_headers);
  }

  void respond(int status, const std::string& body, std::string_view type = "application/json",
               const std::string& extra_headers = {}) {
    done_ = true;
    server_.http_requests.add(std::to_string(status));
    send(fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: {}\r\n{}\r\n{}",
                     status, reason(status), type, body.size(), keep_alive_ ? "keep-alive" : "close", extra_headers,
                     body));
    complete_ = true;
    flush();
  }

  void send(std::string data) {
    if (disconnected_) return;
    outbox_.push_back(std::move(data));
    flush();
  }

  void flush() {
    if (writing_) return;
    if (outbox_.empty()) {
      if (complete_) {
        complete_ = false;
        written_ = true;
        after_response();
      }
      return;
    }
    writing_ = true;
    net::async_write(stream_.socket(), net::buffer(outbox_.front()), [self = shared_from_this()](beast::error_code ec, size_t) {
      self->writing_ = false;
      self->outbox_.pop_front();
      if (ec) {
        self->disconnected_ = true;
        self->outbox_.clear();
        for (auto& h : self->handles_) h->cancel();
        return self->close();
      }
      self->flush();
    });
  }

  void close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.socket().close(ec);
  }

  beast::tcp_stream stream_;
  HttpServer::Impl& server_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::unique_ptr<ApiRequest> request_;
  std::unique_ptr<ResponseBuilder> builder_;
  std::vector<std::shared_ptr<RequestHandle>> handles_;
  std::deque<std::string> outbox_;
  std::array<char, 256> scratch_{};
  bool writing_ = false, done_ = false, disconnected_ = false;
  bool complete_ = false;    // the whole response is queued
  bool written_ = false;     // ... and written
  bool keep_alive_ = false;  // the connection takes another request after it
  bool watching_ = false;    // watch()'s read is in flight
  uint64_t serial_ = 0;      // the connection's request number: engine events carry theirs
};

}  // namespace

void HttpServer::Impl::accept() {
  acceptor.async_accept(net::make_strand(io), [this](beast::error_code ec, tcp::socket socket) {
    if (!acceptor.is_open()) return;
    if (!ec) std::make_shared<Session>(std::move(socket), *this)->start();
    accept();
  });
}

std::string HttpServer::Impl::metrics() const {
  std::string out;
  http_requests.write(out, "keel_http_requests_total", "code", "HTTP responses, by status code");
  write_gauge(out, "keel_http_connections", "Open HTTP connections", static_cast<double>(connections.load()));
  engine.write_metrics(out);
  return out;
}

HttpServer::HttpServer(Engine& engine, const ServedModel& served, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, served, std::move(options))) {
  Impl& s = *impl_;
  try {
    const tcp::endpoint endpoint(net::ip::make_address(s.options.host), s.options.port);
    s.acceptor.open(endpoint.protocol());
    s.acceptor.set_option(net::socket_base::reuse_address(true));
    s.acceptor.bind(endpoint);
    s.acceptor.listen(net::socket_base::max_listen_connections);
  } catch (const std::exception& e) {
    fail(ErrorCode::io, {.field = "--host/--port"}, fmt::format("cannot listen on {}:{}: {}", s.options.host, s.options.port, e.what()));
  }
  s.signals.async_wait([this](beast::error_code, int) { stop(); });
  s.accept();
}

HttpServer::~HttpServer() = default;

uint16_t HttpServer::port() const { return impl_->acceptor.local_endpoint().port(); }

void HttpServer::run() { impl_->io.run(); }

void HttpServer::stop() {
  net::post(impl_->io, [this] {
    beast::error_code ec;
    impl_->acceptor.close(ec);
    impl_->signals.cancel(ec);
    impl_->io.stop();
  });
}

}  // namespace keel::serve
