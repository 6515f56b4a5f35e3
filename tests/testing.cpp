#include "testing.h"

#include "io/safetensors.h"

#include <atomic>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <unistd.h>

namespace keel::testing {

TempDir::TempDir(const std::string& tag) {
  static std::atomic<int> counter{0};
  path_ = std::filesystem::path(KEEL_BINARY_DIR) / "test-tmp" /
          (tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void write_file(const std::string& path, std::span<const std::byte> bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

void write_file(const std::string& path, const std::string& text) {
  write_file(path, std::as_bytes(std::span(text.data(), text.size())));
}

std::vector<std::byte> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

std::vector<float> random_normal(size_t n, uint32_t seed, float stddev) {
  // Zeros are drawn again, so a zero deviation would never end (a test once hung so).
  if (!(stddev > 0.0f)) throw std::invalid_argument("random_normal: stddev must be positive");
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) {
    do x = dist(rng);
    while (x == 0.0f);
  }
  return v;
}

namespace {

template <typename T>
std::vector<T> fixture_values(const std::string& path, const std::string& name) {
  const auto f = SafetensorsFile::open(path);
  const auto* entry = f.find(name);
  if (!entry) throw std::runtime_error(path + " has no tensor " + name);
  const TensorView v = f.view(*entry);
  return std::vector<T>(v.as<T>(), v.as<T>() + v.numel());
}

}  // namespace

std::vector<int32_t> fixture_ints(const std::string& path, const std::string& name) {
  return fixture_values<int32_t>(path, name);
}

std::vector<float> fixture_floats(const std::string& path, const std::string& name) {
  return fixture_values<float>(path, name);
}

bool same_summary(const RowSummary& a, const RowSummary& b) {
  return a.ids == b.ids && a.logits == b.logits && a.whole_pick == b.whole_pick &&
         std::memcmp(&a.log_z, &b.log_z, sizeof(float)) == 0 && std::memcmp(&a.z_t, &b.z_t, sizeof(float)) == 0;
}

}  // namespace keel::testing
