// The tokenizer tests' shared corpus (tests/data/tokenizers/corpus.json, written by
// tools/make_tokenizer_goldens.py): its strings as raw bytes, and the helpers around it.
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlm::test {

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::string from_hex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out.push_back(char(std::stoi(h.substr(i, 2), nullptr, 16)));
  return out;
}

// The corpus strings, invalid UTF-8 ("hex" entries) kept as raw bytes.
inline const std::vector<std::string>& tokenizer_corpus(const std::filesystem::path& corpus_json) {
  static const std::vector<std::string> texts = [&] {
    std::vector<std::string> t;
    for (const auto& e : nlohmann::json::parse(read_file(corpus_json)))
      t.push_back(e.contains("hex") ? from_hex(e["hex"].get<std::string>()) : e["text"].get<std::string>());
    return t;
  }();
  return texts;
}

// Printable form of possibly invalid UTF-8.
inline std::string show(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace kvlm::test
