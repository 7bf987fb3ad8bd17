// safetensors files: header parsing (pure, fuzzed), read-only mmap access, and writing.
//
// File layout: u64 little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data section; offsets are relative to the start of the data section.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/mapped_file.h"

namespace kvlm {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range within the data section
  int64_t numel() const;
};

struct SafetensorsHeader {
  uint64_t data_start = 0;  // 8 + N
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

// Validates everything the header claims against the file size: header length, JSON
// shape, dtypes, shapes, offsets inside the data section, byte counts matching the shape,
// no overlapping tensors. `head` is the start of the file (at least 8 + N bytes of it, or
// the whole file). Throws kvlm::Error naming `label` and the offending tensor.
SafetensorsHeader parse_safetensors_header(std::span<const uint8_t> head, uint64_t file_size, const std::string& label);

// A tensor's bytes inside a mapped file, plus its dtype and shape.
struct TensorView {
  const TensorInfo* info = nullptr;
  std::span<const uint8_t> bytes;
};

class SafetensorsFile {
 public:
  // mmaps `path` read-only and parses its header. Throws kvlm::Error.
  explicit SafetensorsFile(const std::filesystem::path& path);
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  const TensorInfo* find(std::string_view name) const;
  TensorView view(const TensorInfo& t) const;

 private:
  std::filesystem::path path_;
  MappedFile file_;
  SafetensorsHeader header_;
  std::map<std::string, size_t, std::less<>> index_;
};

struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
};

// Writes a safetensors file (header padded to 8 bytes, tensors in the given order).
void write_safetensors(const std::filesystem::path& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Element conversion to fp32 for F32 / F16 / BF16 sources. Throws for other dtypes.
void convert_to_f32(DType src, std::span<const uint8_t> bytes, std::span<float> out);

}  // namespace kvlm
