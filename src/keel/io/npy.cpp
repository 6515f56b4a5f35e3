#include "io/npy.h"

#include <cctype>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "base/error.h"

namespace keel {
namespace {

constexpr char kMagic[] = "\x93NUMPY";

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, {.file = path}, "cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The value of `key` in the header dict, e.g. 'descr': '<i4' -> <i4.
std::string header_value(const std::string& header, const std::string& key, const std::string& path) {
  const auto at = header.find("'" + key + "'");
  if (at == std::string::npos) fail(ErrorCode::bad_input, {.file = path}, "npy header has no '" + key + "'");
  auto begin = header.find(':', at) + 1;
  while (begin < header.size() && header[begin] == ' ') ++begin;
  const char open = header[begin];
  const char close = open == '(' ? ')' : open == '\'' ? '\'' : ',';
  const auto end = header.find(close, begin + 1);
  if (end == std::string::npos) fail(ErrorCode::bad_input, {.file = path}, "npy header value of '" + key + "' is cut off");
  return header.substr(begin + (open == '\'' ? 1 : 0), end - begin - (open == '\'' ? 1 : 0) + (open == '(' ? 1 : 0));
}

}  // namespace

std::vector<int32_t> read_npy_ids(const std::string& path) {
  const std::string bytes = read_all(path);
  if (bytes.size() < 10 || bytes.compare(0, 6, kMagic) != 0) fail(ErrorCode::bad_input, {.file = path}, "not a .npy file");
  const int major = static_cast<uint8_t>(bytes[6]);
  const size_t len_bytes = major == 1 ? 2 : 4;
  uint32_t header_len = 0;
  std::memcpy(&header_len, bytes.data() + 8, len_bytes);
  const size_t data_at = 8 + len_bytes + header_len;
  if (data_at > bytes.size()) fail(ErrorCode::bad_input, {.file = path}, "npy header runs past the end of the file");
  const std::string header = bytes.substr(8 + len_bytes, header_len);
  const std::string descr = header_value(header, "descr", path);
  if (header_value(header, "fortran_order", path).find("False") == std::string::npos) {
    fail(ErrorCode::bad_input, {.file = path}, "Fortran-order arrays are not supported");
  }
  const std::string shape = header_value(header, "shape", path);
  int64_t count = 0;
  if (std::sscanf(shape.c_str(), "(%ld,)", &count) != 1 || shape.find(',') != shape.rfind(',')) {
    fail(ErrorCode::bad_input, {.file = path}, "expected a 1-D array, got shape " + shape);
  }
  const size_t width = descr == "<i4" ? 4 : descr == "<i8" ? 8 : 0;
  if (width == 0) fail(ErrorCode::bad_input, {.file = path}, "expected int32 or int64 ids ('<i4'/'<i8'), got '" + descr + "'");
  if (bytes.size() - data_at != static_cast<size_t>(count) * width) {
    fail(ErrorCode::bad_input, {.file = path}, "data size does not match shape " + shape);
  }
  std::vector<int32_t> ids(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    if (width == 4) {
      std::memcpy(&ids[i], bytes.data() + data_at + i * 4, 4);
      continue;
    }
    int64_t v = 0;
    std::memcpy(&v, bytes.data() + data_at + i * 8, 8);
    if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
      fail(ErrorCode::bad_input, {.file = path}, "id " + std::to_string(v) + " at index " + std::to_string(i) + " does not fit in int32");
    }
    ids[i] = static_cast<int32_t>(v);
  }
  return ids;
}

void write_npy_f32(const std::string& path, std::span<const float> values, const Shape& shape) {
  std::string dims;  // "(a, b)", or "(a,)" for one dimension
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) dims += ",";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  // Magic, version, length, then the header padded with spaces to a multiple of 64.
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  if (!out) fail(ErrorCode::io, {.file = path}, "cannot create");
  const uint16_t len = static_cast<uint16_t>(header.size());
  out.write(kMagic, 6);
  out.put(1);
  out.put(0);
  out.write(reinterpret_cast<const char*>(&len), 2);
  out << header;
  out.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size_bytes()));
  if (!out) fail(ErrorCode::io, {.file = path}, "write failed");
}

std::vector<int32_t> read_ids(const std::string& path) {
  const std::string bytes = read_all(path);
  if (bytes.compare(0, 6, kMagic) == 0) return read_npy_ids(path);
  std::vector<int32_t> ids;
  std::string token;
  const auto flush = [&] {
    if (token.empty()) return;
    char* end = nullptr;
    const long long v = std::strtoll(token.c_str(), &end, 10);
    if (*end != '\0' || v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max()) {
      fail(ErrorCode::bad_input, {.file = path}, "'" + token + "' is not a token id");
    }
    ids.push_back(static_cast<int32_t>(v));
    token.clear();
  };
  for (char ch : bytes) {
    if (std::isspace(static_cast<unsigned char>(ch)) || ch == ',') {
      flush();
    } else {
      token += ch;
    }
  }
  flush();
  return ids;
}

}  // namespace keel
