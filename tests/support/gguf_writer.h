// Writes GGUF files byte by byte for tests: metadata keys of every type, string and number
// arrays, tensor directory entries.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/gguf.h"

namespace kvlm::test {

// Builds a GGUF file in memory.
class GGUFWriter {
 public:
  template <class T>
  GGUFWriter& pod(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof v);
    return *this;
  }
  GGUFWriter& str(const std::string& s) {
    pod<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  GGUFWriter& key(const std::string& k, GGUFType t) {
    ++keys;
    str(k);
    return pod<uint32_t>(uint32_t(t));
  }
  GGUFWriter& strings(const std::string& k, const std::vector<std::string>& v) {
    key(k, GGUFType::Array).pod<uint32_t>(uint32_t(GGUFType::String)).pod<uint64_t>(v.size());
    for (const auto& s : v) str(s);
    return *this;
  }
  template <class T>
  GGUFWriter& numbers(const std::string& k, GGUFType elem, const std::vector<T>& v) {
    key(k, GGUFType::Array).pod<uint32_t>(uint32_t(elem)).pod<uint64_t>(v.size());
    for (T x : v) pod<T>(x);
    return *this;
  }
  GGUFWriter& tensor(const std::string& name, std::vector<uint64_t> ne, GGMLType type, uint64_t offset) {
    str(name);
    pod<uint32_t>(uint32_t(ne.size()));
    for (uint64_t n : ne) pod<uint64_t>(n);
    pod<uint32_t>(uint32_t(type));
    return pod<uint64_t>(offset);
  }
  void pad_to(size_t align) {
    while (b.size() % align) b.push_back(0);
  }
  std::vector<uint8_t> b;
  uint64_t keys = 0;  // metadata keys written
};

// A GGUF v3 file with the metadata `meta` writes and no tensors.
template <class F>
std::vector<uint8_t> gguf_metadata_file(F&& meta) {
  GGUFWriter m;
  meta(m);
  GGUFWriter w;
  w.b = {'G', 'G', 'U', 'F'};
  w.pod<uint32_t>(3).pod<uint64_t>(0).pod<uint64_t>(m.keys);
  w.b.insert(w.b.end(), m.b.begin(), m.b.end());
  return w.b;
}

}  // namespace kvlm::test
