// .npy ids in, float32 logits out; bytes written by hand as NumPy lays them out.
#include <gtest/gtest.h>

#include <cstring>

#include "io/npy.h"
#include "testing.h"

namespace keel {
namespace {

using testing::TempDir;

// NumPy's own layout: magic, version 1.0, u16 header length, header padded to 64.
std::vector<std::byte> npy_bytes(const std::string& descr, const std::string& shape, const void* data, size_t n) {
  std::string header = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  header.append(64 - (10 + header.size() + 1) % 64, ' ');
  header += '\n';
  std::string s = "\x93NUMPY";
  s += '\x01';
  s += '\x00';
  s += static_cast<char>(header.size() & 0xff);
  s += static_cast<char>(header.size() >> 8);
  s += header;
  s.append(static_cast<const char*>(data), n);
  std::vector<std::byte> out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

TEST(Npy, ReadsInt32AndInt64Ids) {
  TempDir dir("npy");
  const int32_t i32[] = {5, -1, 70000};
  testing::write_file(dir.file("a.npy"), npy_bytes("<i4", "(3,)", i32, sizeof i32));
  EXPECT_EQ(read_ids(dir.file("a.npy")), (std::vector<int32_t>{5, -1, 70000}));
  const int64_t i64[] = {1, 2};
  testing::write_file(dir.file("b.npy"), npy_bytes("<i8", "(2,)", i64, sizeof i64));
  EXPECT_EQ(read_npy_ids(dir.file("b.npy")), (std::vector<int32_t>{1, 2}));
}

TEST(Npy, ReadsTextIds) {
  TempDir dir("npy");
  testing::write_file(dir.file("ids.txt"), std::string("1, 2\n3\t4 "));
  EXPECT_EQ(read_ids(dir.file("ids.txt")), (std::vector<int32_t>{1, 2, 3, 4}));
  testing::write_file(dir.file("bad.txt"), std::string("1 2x"));
  EXPECT_NE(KEEL_EXPECT_ERROR(read_ids(dir.file("bad.txt")), ErrorCode::bad_input).find("'2x'"), std::string::npos);
}

TEST(Npy, RejectsWhatIsNotOneDimensionalInts) {
  TempDir dir("npy");
  const float f[] = {1.0f};
  testing::write_file(dir.file("f.npy"), npy_bytes("<f4", "(1,)", f, sizeof f));
  KEEL_EXPECT_ERROR(read_npy_ids(dir.file("f.npy")), ErrorCode::bad_input);
  const int32_t m[] = {1, 2, 3, 4};
  testing::write_file(dir.file("m.npy"), npy_bytes("<i4", "(2, 2)", m, sizeof m));
  KEEL_EXPECT_ERROR(read_npy_ids(dir.file("m.npy")), ErrorCode::bad_input);
  testing::write_file(dir.file("short.npy"), npy_bytes("<i4", "(4,)", m, 8));  // data cut short
  KEEL_EXPECT_ERROR(read_npy_ids(dir.file("short.npy")), ErrorCode::bad_input);
  const int64_t big[] = {int64_t{1} << 40};
  testing::write_file(dir.file("big.npy"), npy_bytes("<i8", "(1,)", big, sizeof big));
  KEEL_EXPECT_ERROR(read_npy_ids(dir.file("big.npy")), ErrorCode::bad_input);
}

TEST(Npy, WritesFloat32WithNumpysLayout) {
  TempDir dir("npy");
  const float values[] = {1.5f, -2.0f, 3.25f, 0.5f, 7.0f, 9.0f};
  write_npy_f32(dir.file("o.npy"), values, {2, 3});
  const auto bytes = testing::read_file(dir.file("o.npy"));
  const auto expected = npy_bytes("<f4", "(2, 3)", values, sizeof values);
  EXPECT_EQ(bytes, expected);
}

}  // namespace
}  // namespace keel
