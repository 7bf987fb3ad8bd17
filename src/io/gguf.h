// GGUF files (llama.cpp's model format, versions 2 and 3, little-endian): the header, the
// typed metadata, the tensor directory (pure parsing over the file's bytes, fuzzed), and
// read-only mmap access.
//
// File layout:
//   "GGUF", u32 version, u64 tensor count, u64 metadata count
//   metadata: (string key, u32 value type, value) x count; a string is u64 length + bytes,
//     an array is u32 element type + u64 count + elements (arrays may nest)
//   tensor infos: (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset) x count
//   padding to `general.alignment` (default 32), then the data section; each tensor's offset
//   is relative to it and a multiple of the alignment.
// ne[0] is the innermost (contiguous) dimension: a [rows][cols] matrix has ne = {cols, rows};
// GGUFTensorInfo::shape lists the dimensions outermost first, as safetensors does.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/mapped_file.h"

namespace kvlm {

// Metadata value types (gguf_type).
enum class GGUFType : uint32_t {
  Uint8 = 0, Int8 = 1, Uint16 = 2, Int16 = 3, Uint32 = 4, Int32 = 5, Float32 = 6, Bool = 7,
  String = 8, Array = 9, Uint64 = 10, Int64 = 11, Float64 = 12,
};
std::string_view gguf_type_name(GGUFType t);

// Tensor data types (ggml_type) kvlm reads: the ones weights are stored in (not ggml's
// activation-only Q8_1 / Q8_K, nor the IQ and ternary types). MXFP4 is GPT-OSS's expert
// format: per 32 values one E8M0 exponent byte e and 16 bytes of E2M1 codes (value j in the
// low nibble of byte j, value j + 16 in the high one), each code times 2^(e - 127).
enum class GGMLType : uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39,
};
// Elements per block and bytes per block of a type; nullopt for a type id kvlm does not know.
struct GGMLTypeTraits {
  std::string_view name;
  int64_t block = 1;
  int64_t block_bytes = 0;
};
std::optional<GGMLTypeTraits> ggml_type_traits(uint32_t type);
// "Q4_K", or "type 23" for an id kvlm does not know (llama.cpp's IQ types and others).
std::string ggml_type_name(uint32_t type);

struct GGUFValue {
  GGUFType type = GGUFType::Uint8;
  // Scalars: integers in i (signed types) or u (unsigned and bool), floats in f, strings in s.
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0;
  std::string s;
  // Arrays: the element type and count; string elements in strings, numeric elements as
  // their little-endian bytes in raw (a view into the parsed buffer), nested arrays neither.
  GGUFType elem = GGUFType::Uint8;
  uint64_t count = 0;
  std::vector<std::string> strings;
  std::span<const uint8_t> raw;

  bool is_integer() const;  // an integer or bool scalar
  bool is_number() const;   // is_integer() or a float scalar
};

struct GGUFKeyValue {
  std::string key;
  GGUFValue value;
};

struct GGUFTensorInfo {
  std::string name;
  uint32_t type = 0;            // ggml_type
  std::vector<int64_t> ne;      // innermost first, as stored
  std::vector<int64_t> shape;   // outermost first
  uint64_t offset = 0;          // within the data section
  uint64_t bytes = 0;           // from the type's block layout
  int64_t numel() const;
};

struct GGUFHeader {
  uint32_t version = 0;
  uint64_t alignment = 32;
  uint64_t data_start = 0;  // file offset of the data section
  std::vector<GGUFKeyValue> metadata;  // in file order
  std::vector<GGUFTensorInfo> tensors;  // in file order

  const GGUFValue* find(std::string_view key) const;
  const GGUFTensorInfo* find_tensor(std::string_view name) const;
  // Typed lookups: nullopt when the key is absent; kvlm::Error when it has another type.
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;  // any numeric type
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<bool> get_bool(std::string_view key) const;
  // An array of strings / of numbers (any numeric element type, widened).
  std::optional<std::vector<std::string>> get_strings(std::string_view key) const;
  std::optional<std::vector<double>> get_numbers(std::string_view key) const;
};

// Parses and validates a whole GGUF file held in `file`: magic, version, every length and
// count against the bytes that remain, value and tensor types, duplicate keys and names,
// dimensions, the alignment, each tensor's byte range inside the data section and not
// overlapping another. Throws kvlm::Error naming `label` and what is wrong.
GGUFHeader parse_gguf(std::span<const uint8_t> file, const std::string& label);

// True when `head` starts with the GGUF magic.
bool is_gguf(std::span<const uint8_t> head);

class GGUFFile {
 public:
  // mmaps `path` read-only and parses it. Throws kvlm::Error.
  explicit GGUFFile(const std::filesystem::path& path);
  GGUFFile(const GGUFFile&) = delete;
  GGUFFile& operator=(const GGUFFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const GGUFHeader& header() const { return header_; }
  uint64_t size() const { return file_.size(); }
  // A tensor's bytes in the mapping.
  std::span<const uint8_t> data(const GGUFTensorInfo& t) const;

 private:
  std::filesystem::path path_;
  MappedFile file_;
  GGUFHeader header_;  // its numeric arrays view file_
};

}  // namespace kvlm
