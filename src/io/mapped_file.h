// A file mapped read-only into memory for the lifetime of the object (safetensors and GGUF
// files: tensors are read in place).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>

namespace kvlm {

class MappedFile {
 public:
  // Maps `path` (an empty file maps to no bytes; its format's parser says why that is wrong).
  // Throws kvlm::Error when it cannot be opened or mapped or is not a regular file.
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {data_, size_t(size_)}; }
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace kvlm
