// How an embedding model turns a prompt's final hidden states into one vector (--runner
// pooling): sentence-transformers' modules.json with its Pooling module's config (Qwen3-Embedding
// and most decoder embedding models ship these), or, without them, vLLM's default for a
// decoder: the last token, L2-normalized. Matryoshka models (config.json `is_matryoshka` or
// `matryoshka_dimensions`, the fields vLLM reads) may be cut to a request's `dimensions`.
#pragma once

#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kvlm {

enum class PoolingType { Last, Mean, Cls };
std::string_view pooling_type_name(PoolingType t);  // "last", "mean", "cls"

struct PoolingConfig {
  PoolingType type = PoolingType::Last;
  bool normalize = true;
  bool matryoshka = false;                 // `dimensions` may cut the vector
  std::vector<int> matryoshka_dimensions;  // the sizes allowed (empty: any from 1 up)
  std::string source;                      // where the choice came from, for the startup line
};

// The directory's sentence-transformers configuration, or nullopt when it has no modules.json.
// Throws kvlm::Error, naming the file and field, for a configuration kvlm cannot run the same
// way (max or weighted-mean pooling, a Dense projection, include_prompt false, a malformed file).
std::optional<PoolingConfig> read_sentence_transformers(const std::filesystem::path& dir);

// The pooling of `dir`'s model: read_sentence_transformers, else the last token, normalized;
// then the Matryoshka fields of its config.json.
PoolingConfig resolve_pooling(const std::filesystem::path& dir);

// Pools a prompt's final hidden states into one vector as they arrive, chunk by chunk (a long
// prompt's prefill comes in several steps): Last keeps the last row, Cls the first, Mean a
// running sum (in double: thousands of rows).
class Pooler {
 public:
  Pooler(PoolingType type, int width);
  // `rows`: [n][width], the prompt rows first_row .. first_row + n - 1, in order.
  void add(std::span<const float> rows, int first_row);
  int rows_seen() const { return seen_; }
  // The vector: `dims` values (0 = width; a Matryoshka cut keeps the first dims), then
  // L2-normalized when `normalize` (after the cut, as vLLM and sentence-transformers do).
  std::vector<float> finish(bool normalize, int dims = 0) const;

 private:
  PoolingType type_;
  int width_;
  int seen_ = 0;
  std::vector<double> acc_;
};

}  // namespace kvlm
