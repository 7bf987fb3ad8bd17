// /v1/embeddings' request and response bodies (protocol.h's EmbeddingRequest).
#include <cstring>
#include <set>

#include "server/protocol.h"
#include "server/request_json.h"

namespace kvlm::server {

namespace {

// RFC 4648 base64 with padding.
std::string base64_encode(std::string_view in) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  for (size_t i = 0; i < in.size(); i += 3) {
    const uint32_t b0 = uint8_t(in[i]), b1 = i + 1 < in.size() ? uint8_t(in[i + 1]) : 0,
                   b2 = i + 2 < in.size() ? uint8_t(in[i + 2]) : 0;
    const uint32_t v = b0 << 16 | b1 << 8 | b2;
    out += kAlphabet[v >> 18 & 63];
    out += kAlphabet[v >> 12 & 63];
    out += i + 1 < in.size() ? kAlphabet[v >> 6 & 63] : '=';
    out += i + 2 < in.size() ? kAlphabet[v & 63] : '=';
  }
  return out;
}

}  // namespace

EmbeddingRequest parse_embedding_request(const Json& b, const ModelInfo& info, const ApiLimits& lim) {
  check_model(b, info);
  if (field(b, "messages"))
    bad("chat-style embedding inputs (messages) are not supported by kvlm; send the text as input", "messages");
  EmbeddingRequest r;
  r.inputs = parse_prompts(b, info, "input");
  if (r.inputs.size() > size_t(lim.max_choices))
    bad(std::to_string(r.inputs.size()) + " inputs are more than " + std::to_string(lim.max_choices) +
            " in one request, this server's limit (--max-seqs-per-request); split it",
        "input");
  if (const Json* f = field(b, "encoding_format")) {
    if (!f->is_string() || (*f != "float" && *f != "base64"))
      bad("encoding_format must be \"float\" or \"base64\", got " + f->dump().substr(0, 40), "encoding_format");
    r.base64 = *f == "base64";
  }
  if (const auto d = opt_int(b, "dimensions")) {
    if (*d < 1) bad("dimensions must be a positive integer, got " + std::to_string(*d), "dimensions");
    r.dimensions = int(std::min<int64_t>(*d, INT32_MAX));
  }
  if (const auto t = opt_int(b, "truncate_prompt_tokens")) {
    if (*t < -1 || *t == 0) bad("truncate_prompt_tokens must be -1 (the model's context) or a positive count", "truncate_prompt_tokens");
    r.truncate_prompt_tokens = *t == -1 ? info.max_model_len : int(std::min<int64_t>(*t, INT32_MAX));
  }
  r.add_special_tokens = opt_bool(b, "add_special_tokens").value_or(true);
  r.priority = parse_priority(b, lim);
  r.normalize = opt_bool(b, "normalize");
  if (const Json* e = field(b, "embed_dtype"); e && *e != "float32")
    bad("embed_dtype: kvlm returns float32 embeddings", "embed_dtype");
  static const std::set<std::string> known = {"input", "model", "encoding_format", "dimensions", "user",
                                              "truncate_prompt_tokens", "add_special_tokens", "normalize",
                                              "embed_dtype", "messages", "request_id", "priority"};
  for (auto it = b.begin(); it != b.end(); ++it)
    if (!known.count(it.key())) r.ignored_fields.push_back(it.key().substr(0, 64));
  return r;
}

Json embedding_response(const std::string& model, const std::vector<std::vector<float>>& vectors, bool base64,
                        int64_t prompt_tokens) {
  Json data = Json::array();
  for (size_t i = 0; i < vectors.size(); ++i) {
    Json e = {{"object", "embedding"}, {"index", i}};
    if (base64) {
      // OpenAI's base64 form: the float32 values' little-endian bytes (numpy frombuffer).
      std::string bytes(vectors[i].size() * sizeof(float), '\0');
      std::memcpy(bytes.data(), vectors[i].data(), bytes.size());
      e["embedding"] = base64_encode(bytes);
    } else {
      e["embedding"] = vectors[i];
    }
    data.push_back(std::move(e));
  }
  return {{"object", "list"},
          {"data", std::move(data)},
          {"model", model},
          {"usage", {{"prompt_tokens", prompt_tokens}, {"total_tokens", prompt_tokens}}}};
}

}  // namespace kvlm::server
