// safetensors: reading (memory-mapped, one file or sharded with
// model.safetensors.index.json) and streaming writing.
//
// File layout: u64 little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"k": "v"}}, then the data section; offsets are relative to it.
//
// Validation is complete before anything is returned: header length within the limit
// and the file, JSON well-formed, every entry well-typed, dtype known, shape x dtype
// == end - begin, every range inside the file, no two ranges overlapping, no key twice
// (nlohmann::json alone would keep the last). Each failure throws keel::Error with its
// own ErrorCode, naming the file and the tensor.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "base/mapped_file.h"
#include "base/tensor.h"

namespace keel {

// Headers larger than this are refused (the format's own reference uses 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeader = 100ull << 20;

struct TensorEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0;  // offsets inside the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;  // absolute file offset of the data section (8 + N)
  std::vector<TensorEntry> tensors;  // in file order of data_offsets
  std::map<std::string, std::string> metadata;
};

// Parses and validates a whole file image. `file_name` is only used in errors.
// This is the fuzzed entry point: it must never crash, whatever the bytes.
SafetensorsHeader parse_safetensors(std::span<const std::byte> file, const std::string& file_name);

// One mapped .safetensors file.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const SafetensorsHeader& header() const { return header_; }
  const TensorEntry* find(const std::string& name) const;  // nullptr if absent
  TensorView view(const TensorEntry& entry) const;          // Memory::mapped

 private:
  MappedFile file_;
  SafetensorsHeader header_;
  std::map<std::string, size_t> by_name_;
};

// All tensors of a checkpoint directory: model.safetensors.index.json with its shards,
// or else the single *.safetensors file(s) in the directory. With an index, every
// tensor it lists must be in the shard it names and every tensor of a shard must be
// listed (ErrorCode::index_mismatch otherwise); a name in two files is duplicate_tensor.
// Beside an index, only the shards it names are opened.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& directory);

  const std::string& directory() const { return directory_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const TensorEntry* find(const std::string& name) const;  // nullptr if absent
  TensorView view(const std::string& name) const;  // throws missing_tensor naming the dir
  const std::string& file_of(const std::string& name) const;  // throws missing_tensor
  std::vector<std::string> names() const;  // sorted
  const std::vector<SafetensorsFile>& files() const { return files_; }

 private:
  std::string directory_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::pair<size_t, const TensorEntry*>> where_;
};

// Writes a safetensors file tensor by tensor, without holding the data in memory:
// declare every tensor first (the header needs all offsets), then `write`, which asks
// `fill` for each tensor's bytes in declaration order, holding one tensor at a time.
// Names must be unique (duplicate_tensor) and shapes whole bytes of the dtype (usage).
class SafetensorsWriter {
 public:
  // Fills `out` (exactly the tensor's byte size) with its data.
  using Fill = std::function<void(std::span<std::byte> out)>;

  void add(std::string name, DType dtype, Shape shape, Fill fill);
  // `bytes` must be exactly shape x dtype long (byte_size_mismatch otherwise).
  void add_bytes(std::string name, DType dtype, Shape shape, std::vector<std::byte> bytes);
  void set_metadata(std::string key, std::string value);
  uint64_t data_bytes() const { return data_bytes_; }
  const std::vector<TensorEntry>& entries() const { return entries_; }

  // Writes to `path` (via a temporary file renamed at the end, so a failed write never
  // leaves a truncated file behind under the final name). Any failure, including an
  // exception from a `fill`, throws Error(io) naming `path`.
  void write(const std::string& path);

 private:
  std::vector<TensorEntry> entries_;
  std::vector<Fill> fills_;
  std::set<std::string> names_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_bytes_ = 0;
};

// Writes model.safetensors.index.json mapping each tensor to its shard file name.
void write_safetensors_index(const std::string& directory,
                             const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size);

}  // namespace keel
