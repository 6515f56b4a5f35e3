// Helpers shared by the test binaries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "base/error.h"
#include "ops/sampling.h"

namespace keel::testing {

// A fresh, empty directory under the build tree, removed when the object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& tag);
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

void write_file(const std::string& path, std::span<const std::byte> bytes);
void write_file(const std::string& path, const std::string& text);
std::vector<std::byte> read_file(const std::string& path);

// Random floats from N(0, stddev) that are never exactly zero (stddev > 0).
std::vector<float> random_normal(size_t n, uint32_t seed, float stddev = 1.0f);

// A fixture tensor's values (int32 or f32), by name; fails the test if it is absent.
std::vector<int32_t> fixture_ints(const std::string& path, const std::string& name);
std::vector<float> fixture_floats(const std::string& path, const std::string& name);

// Two sampling summaries with the same candidates, logits, whole-row pick and
// normalizers, bit for bit.
bool same_summary(const RowSummary& a, const RowSummary& b);

}  // namespace keel::testing

// Runs `statement`, expects a keel::Error with `expected_code`, and returns its message
// so the caller can check what it names.
#define KEEL_EXPECT_ERROR(statement, expected_code)                                  \
  [&]() -> std::string {                                                              \
    try {                                                                             \
      statement;                                                                      \
    } catch (const ::keel::Error& e) {                                                \
      EXPECT_EQ(::keel::name(e.code()), ::keel::name(expected_code)) << e.what();     \
      return e.what();                                                                \
    }                                                                                 \
    ADD_FAILURE() << "expected keel::Error " << ::keel::name(expected_code);          \
    return {};                                                                        \
  }()
