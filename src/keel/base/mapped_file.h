// A read-only memory map of a whole file. Checkpoint tensors are views into it, so
// weights are paged in by the OS on first use and never copied at load.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace keel {

class MappedFile {
 public:
  static MappedFile open(const std::string& path);  // throws Error(io) naming the file

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  const std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace keel
