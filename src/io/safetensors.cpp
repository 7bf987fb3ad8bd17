#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/numeric.h"

namespace kvlm {

using nlohmann::json;

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// Largest header we accept; the reference implementation caps it at 100 MB too.
constexpr uint64_t kMaxHeader = 100u << 20;

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

SafetensorsHeader parse_safetensors_header(std::span<const uint8_t> head, uint64_t file_size, const std::string& label) {
  auto bad = [&](const std::string& why) { return Error(label + ": not a valid safetensors file: " + why); };
  if (file_size < 8 || head.size() < 8) throw bad("shorter than the 8-byte header length");
  const uint64_t n = read_le64(head.data());
  if (n < 2 || n > kMaxHeader) throw bad("header length " + std::to_string(n) + " is out of range");
  if (8 + n > file_size) throw bad("header length " + std::to_string(n) + " runs past the end of the file (truncated?)");
  if (8 + n > head.size()) throw bad("header not fully available");
  const char* text = reinterpret_cast<const char*>(head.data() + 8);
  json j;
  try {
    j = json::parse(text, text + n);
  } catch (const json::exception& e) {
    throw bad(std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!j.is_object()) throw bad("header is not a JSON object");

  SafetensorsHeader h;
  h.data_start = 8 + n;
  const uint64_t data_size = file_size - h.data_start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) throw bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) throw bad("__metadata__ value '" + m.key() + "' is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "'";
    if (!v.is_object()) throw bad(where + " is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) throw bad(where + " has no string 'dtype'");
    if (sh == v.end() || !sh->is_array()) throw bad(where + " has no 'shape' list");
    if (off == v.end() || !off->is_array() || off->size() != 2) throw bad(where + " has no [begin, end] 'data_offsets'");
    TensorInfo t;
    t.name = name;
    auto d = dtype_from_safetensors(dt->get<std::string>());
    if (!d) throw bad(where + " has unsupported dtype '" + dt->get<std::string>() + "'");
    t.dtype = *d;
    if (sh->size() > 8) throw bad(where + " has " + std::to_string(sh->size()) + " dimensions");
    uint64_t numel = 1;
    for (const auto& x : *sh) {
      if (!x.is_number_unsigned() && !(x.is_number_integer() && x.get<int64_t>() >= 0))
        throw bad(where + " has a shape entry that is not a non-negative integer");
      const uint64_t dim = x.get<uint64_t>();
      if (dim > (uint64_t(1) << 40) || (dim != 0 && numel > (uint64_t(1) << 50) / dim))
        throw bad(where + " has an impossibly large shape");
      numel *= dim;
      t.shape.push_back(int64_t(dim));
    }
    for (const auto& x : *off)
      if (!x.is_number_unsigned() && !(x.is_number_integer() && x.get<int64_t>() >= 0))
        throw bad(where + " has data_offsets that are not non-negative integers");
    t.begin = (*off)[0].get<uint64_t>();
    t.end = (*off)[1].get<uint64_t>();
    if (t.begin > t.end || t.end > data_size)
      throw bad(where + " data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                "] fall outside the " + std::to_string(data_size) + "-byte data section (truncated file?)");
    if (t.end - t.begin != numel * dtype_size(t.dtype))
      throw bad(where + " occupies " + std::to_string(t.end - t.begin) + " bytes but its shape and dtype need " +
                std::to_string(numel * dtype_size(t.dtype)));
    h.tensors.push_back(std::move(t));
  }
  std::vector<const TensorInfo*> order;
  for (const auto& t : h.tensors) order.push_back(&t);
  std::ranges::sort(order, [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i]->begin < order[i - 1]->end)
      throw bad("tensors '" + order[i - 1]->name + "' and '" + order[i]->name + "' overlap");
  return h;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path)
    : path_(path), file_(path) {
  header_ = parse_safetensors_header(file_.bytes(), file_.size(), path.string());
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

TensorView SafetensorsFile::view(const TensorInfo& t) const {
  return {&t, {file_.data() + header_.data_start + t.begin, size_t(t.end - t.begin)}};
}

void write_safetensors(const std::filesystem::path& path, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& t : tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= uint64_t(d);
    KVLM_CHECK(numel * dtype_size(t.dtype) == t.bytes.size(), "tensor '" + t.name + "' byte count does not match its shape");
    h[t.name] = {{"dtype", std::string(dtype_safetensors_name(t.dtype))}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  std::string text = h.dump();
  while (text.size() % 8 != 0) text.push_back(' ');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error("cannot write " + path.string());
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(text.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), std::streamsize(text.size()));
  for (const auto& t : tensors) out.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
  if (!out) throw Error("failed writing " + path.string());
}

void convert_to_f32(DType src, std::span<const uint8_t> bytes, std::span<float> out) {
  const size_t n = out.size();
  KVLM_CHECK(bytes.size() == n * dtype_size(src), "byte count mismatch");
  switch (src) {
    case DType::F32:
      std::memcpy(out.data(), bytes.data(), n * 4);
      return;
    case DType::BF16:
    case DType::F16: {
      const auto widen = src == DType::BF16 ? num::bf16_to_f32 : num::f16_to_f32;
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        out[i] = widen(h);
      }
      return;
    }
    default:
      throw Error("cannot convert " + std::string(dtype_name(src)) + " tensors to float32");
  }
}

}  // namespace kvlm
