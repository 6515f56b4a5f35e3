#include "io/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/error.h"

namespace keel {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kMetadataKey = "__metadata__";
constexpr uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();

std::string describe(DType dtype, const Shape& shape) {
  return fmt::format("shape {} x {}", to_string(shape), traits(dtype).safetensors_name);
}

// The bytes `shape` x `dtype` occupy, or nullopt with the reason in `why`. The non-zero
// dimensions must multiply to at most 2^63 - 1, so that numel() and strides, in any
// order, fit int64 even for an empty tensor.
std::optional<uint64_t> byte_size(DType dtype, const Shape& shape, std::string& why) {
  uint64_t product = 1;  // of the non-zero dimensions
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      why = fmt::format("{}: dimension {} is negative", describe(dtype, shape), i);
      return std::nullopt;
    }
    const auto dim = static_cast<uint64_t>(shape[i]);
    if (dim != 0 && product > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dim) {
      why = fmt::format("{}: the dimensions multiply past 2^63 - 1", describe(dtype, shape));
      return std::nullopt;
    }
    product *= std::max<uint64_t>(dim, 1);
  }
  const uint64_t elements = std::ranges::find(shape, 0) != shape.end() ? 0 : product;
  const auto bytes = storage_bytes(dtype, elements);
  if (!bytes) {
    why = bits(dtype) < 8 && elements % (8 / bits(dtype)) != 0
              ? fmt::format("{} is {} elements of {} bits, which do not fill whole bytes",
                            describe(dtype, shape), elements, bits(dtype))
              : fmt::format("{} is too large: its size in bits passes 2^64", describe(dtype, shape));
  }
  return bytes;
}

// A short description of a JSON value for messages; never dumps a whole container,
// which may be nested arbitrarily deep.
std::string show(const json& v) {
  if (v.is_structured()) return fmt::format("an {}", v.type_name());
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 40 ? s.substr(0, 37) + "..." : s;
}

// Parses `text` as a JSON object; anything else fails with `code`.
json parse_object(std::string_view text, ErrorCode code, const ErrorContext& at) {
  json value;
  try {
    value = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    fail(code, at, fmt::format("not well-formed JSON: {}", e.what()));
  }
  if (!value.is_object()) fail(code, at, fmt::format("expected a JSON object, found {}", show(value)));
  return value;
}

struct DuplicateKey {
  std::string outer;  // the top-level key it sits under (itself when at top level)
  std::string key;
  bool nested = false;
};

// Finds the first key repeated within one object, which nlohmann::json would silently
// resolve to the last value. A second pass, over text already known to parse.
class DuplicateKeyFinder final : public nlohmann::json_sax<json> {
 public:
  std::optional<DuplicateKey> found;

  bool start_object(size_t) override {
    open_.emplace_back();
    return true;
  }
  bool end_object() override {
    open_.pop_back();
    return true;
  }
  bool key(string_t& k) override {
    if (open_.size() == 1) outer_ = k;
    if (open_.back().insert(k).second) return true;
    found = DuplicateKey{outer_, k, open_.size() > 1};
    return false;  // stop at the first
  }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_array(size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(size_t, const std::string&, const json::exception&) override { return false; }

 private:
  std::vector<std::set<std::string>> open_;  // keys seen, per object being parsed
  std::string outer_;
};

std::optional<DuplicateKey> find_duplicate_key(std::string_view text) {
  DuplicateKeyFinder finder;
  json::sax_parse(text.begin(), text.end(), &finder);
  return finder.found;
}

// A JSON integer >= 0 (5, not 5.0 or -1); nlohmann stores integers past 2^64 as floats.
std::optional<uint64_t> non_negative(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

// entry[at.field], which must exist.
const json& field(const json& entry, const ErrorContext& at) {
  const auto it = entry.find(at.field);
  if (it == entry.end()) fail(ErrorCode::header_entry, at, "missing");
  return *it;
}

DType parse_dtype(const json& entry, const ErrorContext& at) {
  const json& v = field(entry, at);
  if (!v.is_string()) fail(ErrorCode::header_entry, at, fmt::format("expected a string, found {}", show(v)));
  const auto dtype = dtype_from_safetensors(v.get_ref<const std::string&>());
  if (!dtype) {
    std::string known;
    for (size_t i = 0; i < static_cast<size_t>(DType::count_); ++i)
      known += (i ? ", " : "") + std::string(traits(static_cast<DType>(i)).safetensors_name);
    fail(ErrorCode::unknown_dtype, at, fmt::format("unknown dtype {}; known: {}", show(v), known));
  }
  return *dtype;
}

Shape parse_shape(const json& entry, const ErrorContext& at) {
  const json& v = field(entry, at);
  if (!v.is_array())
    fail(ErrorCode::header_entry, at, fmt::format("expected an array of non-negative integers, found {}", show(v)));
  Shape shape;
  for (size_t i = 0; i < v.size(); ++i) {
    const auto d = non_negative(v[i]);
    if (!d || *d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(ErrorCode::header_entry, at,
           fmt::format("dimension {} is {}, expected an integer in [0, 2^63)", i, show(v[i])));
    shape.push_back(static_cast<int64_t>(*d));
  }
  return shape;
}

std::pair<uint64_t, uint64_t> parse_offsets(const json& entry, const ErrorContext& at) {
  const json& v = field(entry, at);
  if (!v.is_array() || v.size() != 2)
    fail(ErrorCode::header_entry, at,
         fmt::format("expected [begin, end], found {}",
                     v.is_array() ? fmt::format("an array of {} elements", v.size()) : show(v)));
  const auto begin = non_negative(v[0]);
  const auto end = non_negative(v[1]);
  if (!begin || !end)
    fail(ErrorCode::header_entry, at,
         fmt::format("expected two non-negative integers, found [{}, {}]", show(v[0]), show(v[1])));
  if (*begin > *end) fail(ErrorCode::header_entry, at, fmt::format("begin {} is past end {}", *begin, *end));
  return {*begin, *end};
}

// One tensor entry: well-typed, known dtype, shape x dtype == its byte range, and the
// range inside the `data_size` bytes of the data section.
TensorEntry parse_entry(const std::string& name, const json& v, uint64_t data_size, const std::string& file) {
  const ErrorContext at{.file = file, .tensor = name};
  const auto at_field = [&](const char* key) { return ErrorContext{.file = file, .tensor = name, .field = key}; };
  if (!v.is_object()) fail(ErrorCode::header_entry, at, fmt::format("expected an object, found {}", show(v)));
  TensorEntry e{.name = name};
  e.dtype = parse_dtype(v, at_field("dtype"));
  e.shape = parse_shape(v, at_field("shape"));
  std::tie(e.begin, e.end) = parse_offsets(v, at_field("data_offsets"));
  std::string why;
  const auto bytes = byte_size(e.dtype, e.shape, why);
  if (!bytes) fail(ErrorCode::byte_size_mismatch, at, why);
  if (*bytes != e.end - e.begin)
    fail(ErrorCode::byte_size_mismatch, at,
         fmt::format("{} needs {} bytes, data_offsets give {} ([{}, {}])", describe(e.dtype, e.shape), *bytes,
                     e.end - e.begin, e.begin, e.end));
  if (e.end > data_size)
    fail(ErrorCode::out_of_bounds, at,
         fmt::format("data_offsets [{}, {}] end past the data section, which holds {} bytes", e.begin, e.end,
                     data_size));
  return e;
}

std::map<std::string, std::string> parse_metadata(const json& v, const std::string& file) {
  const ErrorContext at{.file = file, .field = kMetadataKey};
  if (!v.is_object()) fail(ErrorCode::header_entry, at, fmt::format("expected an object, found {}", show(v)));
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : v.items()) {
    if (!value.is_string())
      fail(ErrorCode::header_entry, at, fmt::format("value of '{}' is {}, expected a string", key, show(value)));
    metadata.emplace(key, value.get<std::string>());
  }
  return metadata;
}

// Tensors sorted by begin: each non-empty range must start at or after the furthest end
// seen so far. Empty ranges hold no bytes and overlap nothing.
void check_overlaps(const std::vector<TensorEntry>& tensors, const std::string& file) {
  const TensorEntry* furthest = nullptr;
  for (const auto& e : tensors) {
    if (e.begin == e.end) continue;
    if (furthest && e.begin < furthest->end)
      fail(ErrorCode::overlap, {.file = file, .tensor = e.name},
           fmt::format("bytes [{}, {}) overlap tensor '{}' at [{}, {})", e.begin, e.end, furthest->name,
                       furthest->begin, furthest->end));
    if (!furthest || e.end > furthest->end) furthest = &e;
  }
}

uint64_t read_u64_le(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | std::to_integer<uint64_t>(p[i]);
  return v;
}

std::array<std::byte, 8> u64_le(uint64_t v) {
  std::array<std::byte, 8> out;
  for (auto& b : out) {
    b = static_cast<std::byte>(v & 0xff);
    v >>= 8;
  }
  return out;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(ErrorCode::io, {.file = path}, "cannot open");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail(ErrorCode::io, {.file = path}, "cannot read");
  return text;
}

// model.safetensors.index.json -> tensor name -> shard file name (a plain file name,
// so that an index cannot point outside its directory).
std::map<std::string, std::string> read_index(const std::string& path) {
  const std::string text = read_text(path);
  const json index = parse_object(text, ErrorCode::index_json, {.file = path});
  if (const auto dup = find_duplicate_key(text))
    fail(ErrorCode::index_json, {.file = path}, fmt::format("key '{}' appears twice", dup->key));
  if (const auto m = index.find("metadata"); m != index.end() && !m->is_object())
    fail(ErrorCode::index_json, {.file = path, .field = "metadata"}, fmt::format("expected an object, found {}", show(*m)));
  const auto it = index.find("weight_map");
  if (it == index.end() || !it->is_object() || it->empty())
    fail(ErrorCode::index_json, {.file = path, .field = "weight_map"},
         fmt::format("expected a non-empty object of tensor -> shard file, found {}",
                     it == index.end() ? "nothing" : show(*it)));
  std::map<std::string, std::string> weight_map;
  for (const auto& [name, shard] : it->items()) {
    const ErrorContext at{.file = path, .tensor = name, .field = "weight_map"};
    if (!shard.is_string()) fail(ErrorCode::index_json, at, fmt::format("expected a shard file name, found {}", show(shard)));
    const auto& s = shard.get_ref<const std::string&>();
    if (s.empty() || s == "." || s == ".." || s.find('/') != std::string::npos)
      fail(ErrorCode::index_json, at, fmt::format("shard {} is not a file name in the index's directory", show(shard)));
    weight_map.emplace(name, s);
  }
  return weight_map;
}

// Every *.safetensors file directly in `directory`, sorted.
std::vector<std::string> safetensors_files(const std::string& directory) {
  std::error_code ec;
  std::vector<std::string> paths;
  for (fs::directory_iterator it(directory, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code not_regular;
    if (it->path().extension() == ".safetensors" && it->is_regular_file(not_regular)) paths.push_back(it->path().string());
  }
  if (ec) fail(ErrorCode::io, {.file = directory}, "cannot list the directory: " + ec.message());
  if (paths.empty()) fail(ErrorCode::io, {.file = directory}, fmt::format("no *.safetensors file and no {}", kIndexName));
  std::ranges::sort(paths);
  return paths;
}

// Each tensor of the index in the shard it names, and each tensor of each shard listed.
void check_index(const Checkpoint& c, const std::map<std::string, std::string>& weight_map,
                 const std::string& index_path) {
  for (const auto& [name, shard] : weight_map) {
    const std::string path = (fs::path(c.directory()) / shard).string();
    if (!c.contains(name))
      fail(ErrorCode::index_mismatch, {.file = path, .tensor = name},
           fmt::format("listed in '{}' for this shard, absent from it", index_path));
    if (c.file_of(name) != path)
      fail(ErrorCode::index_mismatch, {.file = path, .tensor = name},
           fmt::format("listed in '{}' for this shard, found in '{}'", index_path, c.file_of(name)));
  }
  for (const auto& file : c.files())
    for (const auto& e : file.header().tensors)
      if (!weight_map.contains(e.name))
        fail(ErrorCode::index_mismatch, {.file = file.path(), .tensor = e.name},
             fmt::format("in this shard, not listed in '{}'", index_path));
}

// A file written as `path`.tmp and renamed to `path` by commit(); destroyed before
// that (an exception on the way), it removes the temporary file.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail_errno("cannot create");
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }

  void write(std::span<const std::byte> bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::write(fd_, bytes.data(), bytes.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail_errno("cannot write");
      bytes = bytes.subspan(static_cast<size_t>(n));
    }
  }

  void commit() {
    if (::close(std::exchange(fd_, -1)) != 0) fail_errno("cannot write");
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail_errno("cannot rename into place");
    committed_ = true;
  }

 private:
  [[noreturn]] void fail_errno(const char* what) const {
    const int err = errno;
    fail(ErrorCode::io, {.file = path_}, fmt::format("{} '{}': {}", what, tmp_, std::strerror(err)));
  }

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Header strings must be valid UTF-8, which JSON requires and nlohmann::json enforces
// only when dumping.
void check_utf8(const std::string& s, const ErrorContext& at) {
  try {
    (void)json(s).dump();
  } catch (const json::exception&) {
    fail(ErrorCode::usage, at, fmt::format("'{}' is not valid UTF-8", s));
  }
}

// The header JSON, padded with spaces so that the data section starts 8-byte aligned.
std::string header_text(const std::vector<TensorEntry>& entries, const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  for (const auto& e : entries) {
    header[e.name] = {{"dtype", traits(e.dtype).safetensors_name},
                      {"shape", e.shape},
                      {"data_offsets", json::array({e.begin, e.end})}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

}  // namespace

SafetensorsHeader parse_safetensors(std::span<const std::byte> file, const std::string& file_name) {
  const ErrorContext at{.file = file_name};
  if (file.size() < 8)
    fail(ErrorCode::file_too_small, at,
         fmt::format("file is {} bytes, shorter than the 8-byte header length", file.size()));
  const uint64_t n = read_u64_le(file.data());
  if (n > kMaxSafetensorsHeader)
    fail(ErrorCode::header_too_large, at, fmt::format("header length {} exceeds the limit of {} bytes", n, kMaxSafetensorsHeader));
  if (n > file.size() - 8)
    fail(ErrorCode::header_too_large, at,
         fmt::format("header length {} exceeds the {} bytes after the length field", n, file.size() - 8));

  SafetensorsHeader header;
  header.data_start = 8 + n;
  const std::string_view text(reinterpret_cast<const char*>(file.data() + 8), n);
  const json root = parse_object(text, ErrorCode::header_json, at);
  if (const auto dup = find_duplicate_key(text)) {
    if (!dup->nested) fail(ErrorCode::duplicate_tensor, {.file = file_name, .tensor = dup->key}, "appears twice in the header");
    fail(ErrorCode::header_entry, {.file = file_name, .tensor = dup->outer, .field = dup->key}, "key appears twice");
  }
  const uint64_t data_size = file.size() - header.data_start;
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      header.metadata = parse_metadata(value, file_name);
    } else {
      header.tensors.push_back(parse_entry(key, value, data_size, file_name));
    }
  }
  std::ranges::stable_sort(header.tensors, {}, &TensorEntry::begin);
  check_overlaps(header.tensors, file_name);
  return header;
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.file_ = MappedFile::open(path);
  f.header_ = parse_safetensors(f.file_.bytes(), path);
  for (size_t i = 0; i < f.header_.tensors.size(); ++i) f.by_name_.emplace(f.header_.tensors[i].name, i);
  return f;
}

const TensorEntry* SafetensorsFile::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

TensorView SafetensorsFile::view(const TensorEntry& entry) const {
  return TensorView::contiguous(file_.data() + header_.data_start + entry.begin, entry.dtype, entry.shape,
                                Memory::mapped);
}

Checkpoint Checkpoint::open(const std::string& directory) {
  Checkpoint c;
  c.directory_ = directory;
  const std::string index_path = (fs::path(directory) / kIndexName).string();
  std::error_code ec;
  const bool indexed = fs::exists(index_path, ec);
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> paths;
  if (indexed) {
    weight_map = read_index(index_path);
    std::set<std::string> shards;
    for (const auto& [name, shard] : weight_map) shards.insert(shard);
    for (const auto& shard : shards) paths.push_back((fs::path(directory) / shard).string());
  } else {
    paths = safetensors_files(directory);
  }
  for (const auto& path : paths) c.files_.push_back(SafetensorsFile::open(path));
  // Entries live in each file's vector, which moving the files does not reallocate.
  for (size_t i = 0; i < c.files_.size(); ++i) {
    for (const auto& e : c.files_[i].header().tensors) {
      const auto [it, inserted] = c.where_.try_emplace(e.name, i, &e);
      if (!inserted)
        fail(ErrorCode::duplicate_tensor, {.file = c.files_[i].path(), .tensor = e.name},
             fmt::format("also in '{}'", c.files_[it->second.first].path()));
    }
  }
  if (indexed) check_index(c, weight_map, index_path);
  return c;
}

const TensorEntry* Checkpoint::find(const std::string& name) const {
  const auto it = where_.find(name);
  return it == where_.end() ? nullptr : it->second.second;
}

TensorView Checkpoint::view(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) fail(ErrorCode::missing_tensor, {.file = directory_, .tensor = name}, "not in the checkpoint");
  return files_[it->second.first].view(*it->second.second);
}

const std::string& Checkpoint::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) fail(ErrorCode::missing_tensor, {.file = directory_, .tensor = name}, "not in the checkpoint");
  return files_[it->second.first].path();
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> names;
  names.reserve(where_.size());
  for (const auto& [name, where] : where_) names.push_back(name);
  return names;
}

void SafetensorsWriter::add(std::string name, DType dtype, Shape shape, Fill fill) {
  const ErrorContext at{.tensor = name};
  if (name.empty() || name == kMetadataKey) fail(ErrorCode::usage, at, "not a usable tensor name");
  check_utf8(name, at);
  if (!fill) fail(ErrorCode::usage, at, "no fill function");
  std::string why;
  const auto bytes = byte_size(dtype, shape, why);
  if (!bytes) fail(ErrorCode::usage, at, why);
  if (*bytes > kMaxU64 - data_bytes_) fail(ErrorCode::usage, at, "the file would exceed 2^64 bytes");
  if (!names_.insert(name).second) fail(ErrorCode::duplicate_tensor, at, "declared twice");
  entries_.push_back({std::move(name), dtype, std::move(shape), data_bytes_, data_bytes_ + *bytes});
  fills_.push_back(std::move(fill));
  data_bytes_ += *bytes;
}

void SafetensorsWriter::add_bytes(std::string name, DType dtype, Shape shape, std::vector<std::byte> bytes) {
  std::string why;
  const auto need = byte_size(dtype, shape, why);
  if (need && *need != bytes.size())
    fail(ErrorCode::byte_size_mismatch, {.tensor = name},
         fmt::format("{} needs {} bytes, got {}", describe(dtype, shape), *need, bytes.size()));
  add(std::move(name), dtype, std::move(shape),
      [data = std::move(bytes)](std::span<std::byte> out) { std::ranges::copy(data, out.begin()); });
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  check_utf8(key, {.field = kMetadataKey});
  check_utf8(value, {.field = kMetadataKey});
  metadata_.insert_or_assign(std::move(key), std::move(value));
}

void SafetensorsWriter::write(const std::string& path) {
  const std::string header = header_text(entries_, metadata_);
  if (header.size() > kMaxSafetensorsHeader)
    fail(ErrorCode::io, {.file = path},
         fmt::format("header of {} bytes exceeds the limit of {}", header.size(), kMaxSafetensorsHeader));
  AtomicFile out(path);
  out.write(u64_le(header.size()));
  out.write(std::as_bytes(std::span(header)));
  for (size_t i = 0; i < entries_.size(); ++i) {
    const TensorEntry& e = entries_[i];
    HostBuffer data;
    try {
      data = HostBuffer(e.end - e.begin);
      fills_[i]({data.data(), data.size()});
    } catch (const std::exception& ex) {
      fail(ErrorCode::io, {.file = path, .tensor = e.name}, fmt::format("cannot produce the data: {}", ex.what()));
    }
    out.write({data.data(), data.size()});
  }
  out.commit();
}

void write_safetensors_index(const std::string& directory, const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size) {
  const json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";
  AtomicFile out((fs::path(directory) / kIndexName).string());
  out.write(std::as_bytes(std::span(text)));
  out.commit();
}

}  // namespace keel
