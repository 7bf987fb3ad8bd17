#include "io/gguf.h"


#include <algorithm>
#include <array>
#include <cstring>
#include <set>

#include "core/error.h"

namespace kvlm {

namespace {

constexpr uint64_t kMaxStringBytes = uint64_t(1) << 30;  // a key, a value or a tensor name
constexpr int kMaxArrayDepth = 8;
constexpr uint32_t kMaxDims = 4;  // GGML_MAX_DIMS

// Scalar byte sizes of the value types (0: string / array, variable).
uint64_t scalar_bytes(GGUFType t) {
  switch (t) {
    case GGUFType::Uint8: case GGUFType::Int8: case GGUFType::Bool: return 1;
    case GGUFType::Uint16: case GGUFType::Int16: return 2;
    case GGUFType::Uint32: case GGUFType::Int32: case GGUFType::Float32: return 4;
    case GGUFType::Uint64: case GGUFType::Int64: case GGUFType::Float64: return 8;
    case GGUFType::String: case GGUFType::Array: return 0;
  }
  return 0;
}

// Little-endian reads from a bounds-checked cursor.
class Reader {
 public:
  Reader(std::span<const uint8_t> b, const std::string& label) : b_(b), label_(label) {}
  uint64_t pos() const { return pos_; }
  uint64_t left() const { return b_.size() - pos_; }
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(label_ + ": not a valid GGUF file: " + what + " (at byte " + std::to_string(pos_) + " of " +
                std::to_string(b_.size()) + ")");
  }
  void need(uint64_t n, const char* what) const {
    if (n > left()) fail(std::string("truncated ") + what);
  }
  template <class T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v{};
    std::memcpy(&v, b_.data() + pos_, sizeof(T));  // the host is little-endian (x86-64, aarch64)
    pos_ += sizeof(T);
    return v;
  }
  std::span<const uint8_t> bytes(uint64_t n, const char* what) {
    need(n, what);
    auto s = b_.subspan(size_t(pos_), size_t(n));
    pos_ += n;
    return s;
  }
  std::string string(const char* what) {
    const uint64_t n = read<uint64_t>(what);
    if (n > kMaxStringBytes) fail(std::string(what) + " of " + std::to_string(n) + " bytes");
    const auto s = bytes(n, what);
    return std::string(reinterpret_cast<const char*>(s.data()), s.size());
  }
  GGUFType type(const char* what) {
    const uint32_t t = read<uint32_t>(what);
    if (t > uint32_t(GGUFType::Float64)) fail(std::string("unknown value type ") + std::to_string(t) + " of " + what);
    return GGUFType(t);
  }

 private:
  std::span<const uint8_t> b_;
  const std::string& label_;
  uint64_t pos_ = 0;
};

void read_scalar(Reader& r, GGUFType t, GGUFValue& v, const char* what) {
  switch (t) {
    case GGUFType::Uint8: v.u = r.read<uint8_t>(what); break;
    case GGUFType::Int8: v.i = r.read<int8_t>(what); break;
    case GGUFType::Uint16: v.u = r.read<uint16_t>(what); break;
    case GGUFType::Int16: v.i = r.read<int16_t>(what); break;
    case GGUFType::Uint32: v.u = r.read<uint32_t>(what); break;
    case GGUFType::Int32: v.i = r.read<int32_t>(what); break;
    case GGUFType::Uint64: v.u = r.read<uint64_t>(what); break;
    case GGUFType::Int64: v.i = r.read<int64_t>(what); break;
    case GGUFType::Float32: v.f = r.read<float>(what); break;
    case GGUFType::Float64: v.f = r.read<double>(what); break;
    case GGUFType::Bool: {
      const uint8_t b = r.read<uint8_t>(what);
      if (b > 1) r.fail(std::string("a bool of value ") + std::to_string(b) + " in " + what);
      v.u = b;
      break;
    }
    case GGUFType::String: v.s = r.string(what); break;
    case GGUFType::Array: break;  // handled by read_value
  }
}

// Skips an array's elements without keeping them (nested arrays).
void skip_array(Reader& r, int depth, const char* what) {
  if (depth > kMaxArrayDepth) r.fail(std::string("arrays nested deeper than ") + std::to_string(kMaxArrayDepth));
  const GGUFType elem = r.type(what);
  const uint64_t n = r.read<uint64_t>(what);
  if (const uint64_t sz = scalar_bytes(elem)) {
    if (n > r.left() / sz) r.fail(std::string("truncated array in ") + what);
    r.bytes(n * sz, what);
    return;
  }
  if (n > r.left() / 8) r.fail(std::string("truncated array in ") + what);  // each element takes 8+ bytes
  for (uint64_t i = 0; i < n; ++i) {
    if (elem == GGUFType::String) {
      const uint64_t len = r.read<uint64_t>(what);
      r.bytes(len, what);
    } else {
      skip_array(r, depth + 1, what);
    }
  }
}

GGUFValue read_value(Reader& r, GGUFType t, const char* what) {
  GGUFValue v;
  v.type = t;
  if (t != GGUFType::Array) {
    read_scalar(r, t, v, what);
    return v;
  }
  v.elem = r.type(what);
  v.count = r.read<uint64_t>(what);
  if (const uint64_t sz = scalar_bytes(v.elem)) {
    if (v.count > r.left() / sz) r.fail(std::string("truncated array in ") + what);
    v.raw = r.bytes(v.count * sz, what);
    if (v.elem == GGUFType::Bool)
      for (uint8_t b : v.raw)
        if (b > 1) r.fail(std::string("a bool of value ") + std::to_string(b) + " in " + what);
  } else if (v.elem == GGUFType::String) {
    if (v.count > r.left() / 8) r.fail(std::string("truncated array in ") + what);
    v.strings.reserve(size_t(v.count));
    for (uint64_t i = 0; i < v.count; ++i) v.strings.push_back(r.string(what));
  } else {
    if (v.count > r.left() / 12) r.fail(std::string("truncated array in ") + what);
    for (uint64_t i = 0; i < v.count; ++i) skip_array(r, 2, what);
  }
  return v;
}

bool is_int_type(GGUFType t) {
  switch (t) {
    case GGUFType::Uint8: case GGUFType::Int8: case GGUFType::Uint16: case GGUFType::Int16:
    case GGUFType::Uint32: case GGUFType::Int32: case GGUFType::Uint64: case GGUFType::Int64:
    case GGUFType::Bool: return true;
    default: return false;
  }
}

bool is_signed(GGUFType t) {
  return t == GGUFType::Int8 || t == GGUFType::Int16 || t == GGUFType::Int32 || t == GGUFType::Int64;
}

double element(const GGUFValue& v, uint64_t i) {
  const uint8_t* p = v.raw.data() + i * scalar_bytes(v.elem);
  auto get = [p]<class T>(T) {
    T x;
    std::memcpy(&x, p, sizeof x);
    return x;
  };
  switch (v.elem) {
    case GGUFType::Uint8: case GGUFType::Bool: return double(get(uint8_t{}));
    case GGUFType::Int8: return double(get(int8_t{}));
    case GGUFType::Uint16: return double(get(uint16_t{}));
    case GGUFType::Int16: return double(get(int16_t{}));
    case GGUFType::Uint32: return double(get(uint32_t{}));
    case GGUFType::Int32: return double(get(int32_t{}));
    case GGUFType::Uint64: return double(get(uint64_t{}));
    case GGUFType::Int64: return double(get(int64_t{}));
    case GGUFType::Float32: return double(get(float{}));
    case GGUFType::Float64: return get(double{});
    default: return 0;
  }
}

}  // namespace

std::string_view gguf_type_name(GGUFType t) {
  static constexpr std::array<std::string_view, 13> kNames{"uint8", "int8",   "uint16", "int16", "uint32",
                                                           "int32", "float32", "bool",  "string", "array",
                                                           "uint64", "int64",  "float64"};
  const auto i = size_t(t);
  return i < kNames.size() ? kNames[i] : "unknown";
}

std::optional<GGMLTypeTraits> ggml_type_traits(uint32_t type) {
  switch (GGMLType(type)) {
    case GGMLType::F32: return GGMLTypeTraits{"F32", 1, 4};
    case GGMLType::F16: return GGMLTypeTraits{"F16", 1, 2};
    case GGMLType::BF16: return GGMLTypeTraits{"BF16", 1, 2};
    case GGMLType::Q4_0: return GGMLTypeTraits{"Q4_0", 32, 18};
    case GGMLType::Q4_1: return GGMLTypeTraits{"Q4_1", 32, 20};
    case GGMLType::Q5_0: return GGMLTypeTraits{"Q5_0", 32, 22};
    case GGMLType::Q5_1: return GGMLTypeTraits{"Q5_1", 32, 24};
    case GGMLType::Q8_0: return GGMLTypeTraits{"Q8_0", 32, 34};
    case GGMLType::Q2_K: return GGMLTypeTraits{"Q2_K", 256, 84};
    case GGMLType::Q3_K: return GGMLTypeTraits{"Q3_K", 256, 110};
    case GGMLType::Q4_K: return GGMLTypeTraits{"Q4_K", 256, 144};
    case GGMLType::Q5_K: return GGMLTypeTraits{"Q5_K", 256, 176};
    case GGMLType::Q6_K: return GGMLTypeTraits{"Q6_K", 256, 210};
    case GGMLType::MXFP4: return GGMLTypeTraits{"MXFP4", 32, 17};
  }
  return std::nullopt;
}

std::string ggml_type_name(uint32_t type) {
  if (const auto t = ggml_type_traits(type)) return std::string(t->name);
  return "type " + std::to_string(type);
}

bool GGUFValue::is_integer() const { return is_int_type(type); }
bool GGUFValue::is_number() const { return is_int_type(type) || type == GGUFType::Float32 || type == GGUFType::Float64; }

int64_t GGUFTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

bool is_gguf(std::span<const uint8_t> head) { return head.size() >= 4 && std::memcmp(head.data(), "GGUF", 4) == 0; }

GGUFHeader parse_gguf(std::span<const uint8_t> file, const std::string& label) {
  Reader r(file, label);
  if (!is_gguf(file)) r.fail("no GGUF magic at the start");
  r.bytes(4, "magic");
  GGUFHeader h;
  h.version = r.read<uint32_t>("version");
  if (h.version == 1)
    throw Error(label + ": GGUF version 1 (2023) is not supported; convert the model again with a current llama.cpp");
  if (h.version != 2 && h.version != 3) {
    uint32_t swapped = __builtin_bswap32(h.version);
    if (swapped == 2 || swapped == 3)
      throw Error(label + ": a big-endian GGUF file; kvlm reads little-endian GGUF files only");
    r.fail("unknown version " + std::to_string(h.version) + " (kvlm reads versions 2 and 3)");
  }
  const uint64_t n_tensors = r.read<uint64_t>("tensor count");
  const uint64_t n_kv = r.read<uint64_t>("metadata count");
  // Every metadata pair takes at least 12 bytes (key length, value type), every tensor info 24.
  if (n_kv > r.left() / 12) r.fail("a metadata count of " + std::to_string(n_kv) + " larger than the file holds");
  if (n_tensors > r.left() / 24) r.fail("a tensor count of " + std::to_string(n_tensors) + " larger than the file holds");
  std::set<std::string, std::less<>> keys;
  h.metadata.reserve(size_t(n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    GGUFKeyValue kv;
    kv.key = r.string("metadata key");
    if (!keys.insert(kv.key).second) r.fail("metadata key '" + kv.key + "' given twice");
    const GGUFType t = r.type("metadata value");
    kv.value = read_value(r, t, kv.key.c_str());
    h.metadata.push_back(std::move(kv));
  }
  if (const GGUFValue* a = h.find("general.alignment")) {
    if (!a->is_integer() || a->type == GGUFType::Bool || is_signed(a->type) || a->u == 0 || (a->u & (a->u - 1)) != 0 ||
        a->u > (uint64_t(1) << 20))
      r.fail("general.alignment must be a power of two (an unsigned integer), got " +
             (a->is_integer() ? std::to_string(is_signed(a->type) ? uint64_t(a->i) : a->u) : std::string(gguf_type_name(a->type))));
    h.alignment = a->u;
  }
  std::set<std::string, std::less<>> names;
  h.tensors.reserve(size_t(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GGUFTensorInfo t;
    t.name = r.string("tensor name");
    if (!names.insert(t.name).second) r.fail("tensor '" + t.name + "' listed twice");
    const uint32_t nd = r.read<uint32_t>("tensor dimensions");
    if (nd == 0 || nd > kMaxDims)
      r.fail("tensor '" + t.name + "' has " + std::to_string(nd) + " dimensions (1 to 4 allowed)");
    int64_t numel = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      const uint64_t n = r.read<uint64_t>("tensor dimension");
      if (n == 0 || n > (uint64_t(1) << 40) || uint64_t(numel) > (uint64_t(1) << 50) / n)
        r.fail("tensor '" + t.name + "' has a dimension of " + std::to_string(n));
      t.ne.push_back(int64_t(n));
      numel *= int64_t(n);
    }
    t.shape.assign(t.ne.rbegin(), t.ne.rend());
    t.type = r.read<uint32_t>("tensor type");
    const auto traits = ggml_type_traits(t.type);
    if (!traits)
      throw Error(label + ": tensor '" + t.name + "' is stored as ggml type " + std::to_string(t.type) +
                  ", which kvlm cannot read (it reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K); "
                  "convert the model with one of those");
    if (t.ne[0] % traits->block != 0)
      r.fail("tensor '" + t.name + "' (" + std::string(traits->name) + ") has rows of " + std::to_string(t.ne[0]) +
             " elements, not a multiple of its block of " + std::to_string(traits->block));
    t.bytes = uint64_t(numel / traits->block) * uint64_t(traits->block_bytes);
    t.offset = r.read<uint64_t>("tensor offset");
    if (t.offset % h.alignment != 0)
      r.fail("tensor '" + t.name + "' starts at offset " + std::to_string(t.offset) + ", not a multiple of the alignment " +
             std::to_string(h.alignment));
    h.tensors.push_back(std::move(t));
  }
  const uint64_t end_of_infos = r.pos();
  h.data_start = (end_of_infos + h.alignment - 1) / h.alignment * h.alignment;
  if (!h.tensors.empty() && h.data_start > file.size()) r.fail("no data section after the tensor infos");
  const uint64_t data_bytes = h.tensors.empty() ? 0 : file.size() - h.data_start;
  std::vector<const GGUFTensorInfo*> by_offset;
  for (const auto& t : h.tensors) {
    if (t.offset > data_bytes || t.bytes > data_bytes - t.offset)
      throw Error(label + ": not a valid GGUF file: tensor '" + t.name + "' (" + ggml_type_name(t.type) + ", " +
                  std::to_string(t.bytes) + " bytes at offset " + std::to_string(t.offset) +
                  ") runs past the end of the file (data section of " + std::to_string(data_bytes) +
                  " bytes): the file is truncated or corrupt");
    by_offset.push_back(&t);
  }
  std::ranges::sort(by_offset, {}, [](const GGUFTensorInfo* t) { return t->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i - 1]->offset + by_offset[i - 1]->bytes > by_offset[i]->offset)
      throw Error(label + ": not a valid GGUF file: tensors '" + by_offset[i - 1]->name + "' and '" + by_offset[i]->name +
                  "' overlap");
  return h;
}

const GGUFValue* GGUFHeader::find(std::string_view key) const {
  for (const auto& kv : metadata)
    if (kv.key == key) return &kv.value;
  return nullptr;
}

const GGUFTensorInfo* GGUFHeader::find_tensor(std::string_view name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {
[[noreturn]] void wrong_type(std::string_view key, const GGUFValue& v, const char* want) {
  throw Error("GGUF metadata '" + std::string(key) + "' is a " + std::string(gguf_type_name(v.type)) +
              (v.type == GGUFType::Array ? " of " + std::string(gguf_type_name(v.elem)) : std::string()) + ", expected " +
              want);
}
}  // namespace

std::optional<int64_t> GGUFHeader::get_int(std::string_view key) const {
  const GGUFValue* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_integer() || v->type == GGUFType::Bool) wrong_type(key, *v, "an integer");
  if (is_signed(v->type)) return v->i;
  if (v->u > uint64_t(INT64_MAX)) throw Error("GGUF metadata '" + std::string(key) + "' is out of range");
  return int64_t(v->u);
}

std::optional<double> GGUFHeader::get_float(std::string_view key) const {
  const GGUFValue* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_number() || v->type == GGUFType::Bool) wrong_type(key, *v, "a number");
  if (v->type == GGUFType::Float32 || v->type == GGUFType::Float64) return v->f;
  return is_signed(v->type) ? double(v->i) : double(v->u);
}

std::optional<std::string> GGUFHeader::get_string(std::string_view key) const {
  const GGUFValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GGUFType::String) wrong_type(key, *v, "a string");
  return v->s;
}

std::optional<bool> GGUFHeader::get_bool(std::string_view key) const {
  const GGUFValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GGUFType::Bool) wrong_type(key, *v, "a bool");
  return v->u != 0;
}

std::optional<std::vector<std::string>> GGUFHeader::get_strings(std::string_view key) const {
  const GGUFValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GGUFType::Array || v->elem != GGUFType::String) wrong_type(key, *v, "an array of strings");
  return v->strings;
}

std::optional<std::vector<double>> GGUFHeader::get_numbers(std::string_view key) const {
  const GGUFValue* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != GGUFType::Array || !scalar_bytes(v->elem)) wrong_type(key, *v, "an array of numbers");
  std::vector<double> out(size_t(v->count));
  for (uint64_t i = 0; i < v->count; ++i) out[size_t(i)] = element(*v, i);
  return out;
}

GGUFFile::GGUFFile(const std::filesystem::path& path)
    : path_(path), file_(path), header_(parse_gguf(file_.bytes(), path.string())) {}

std::span<const uint8_t> GGUFFile::data(const GGUFTensorInfo& t) const {
  return {file_.data() + header_.data_start + t.offset, size_t(t.bytes)};
}

}  // namespace kvlm
