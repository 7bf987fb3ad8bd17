// The logprobs of a response as OpenAI writes them: completions' parallel arrays (tokens,
// token_logprobs, top_logprobs, text_offset) and chat's per-token entries with bytes
// (declared in protocol.h).
#include <cmath>

#include "server/protocol.h"

namespace kvlm::server {

double json_logprob(float v) { return std::isfinite(v) ? double(v) : -9999.0; }

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

void CompletionLogprobs::add_prompt(std::span<const TokenId> prompt, std::span<const TokenLogprobs> lps, int k,
                                    const TokenText& text) {
  // The engine reports prompt logprobs for the prompt's last lps.size() tokens (the first
  // token has no predecessor, so at most prompt.size() - 1).
  const size_t skip = prompt.size() > lps.size() ? prompt.size() - lps.size() : 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (i < skip) {
      const std::string t = text(prompt[i]);
      tokens.push_back(t);
      token_logprobs.push_back(nullptr);
      top_logprobs.push_back(nullptr);
      text_offset.push_back(offset);
      offset += utf8_length(t);
    } else {
      add(lps[i - skip], k, text);
    }
  }
}

void CompletionLogprobs::add(const TokenLogprobs& lp, int k, const TokenText& text) {
  const std::string t = text(lp.token);
  tokens.push_back(t);
  token_logprobs.push_back(json_logprob(lp.logprob));
  Json top = Json::object();
  for (size_t i = 0; i < lp.top.size() && int(i) < k; ++i) {
    const std::string s = text(lp.top[i].first);
    if (!top.contains(s)) top[s] = json_logprob(lp.top[i].second);
  }
  if (!top.contains(t)) top[t] = json_logprob(lp.logprob);  // the chosen token is always listed
  top_logprobs.push_back(std::move(top));
  text_offset.push_back(offset);
  offset += utf8_length(t);
}

Json CompletionLogprobs::to_json() const {
  Json j = Json::object();
  j["tokens"] = tokens;
  j["token_logprobs"] = token_logprobs;
  j["top_logprobs"] = top_logprobs;
  j["text_offset"] = text_offset;
  return j;
}

namespace {
Json bytes_of(const std::string& s) {
  Json b = Json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}
}  // namespace

Json chat_logprob_entry(const TokenLogprobs& lp, int k, const TokenText& text) {
  const std::string t = text(lp.token);
  Json e = Json::object();
  e["token"] = t;
  e["logprob"] = json_logprob(lp.logprob);
  e["bytes"] = bytes_of(t);
  Json top = Json::array();
  for (size_t i = 0; i < lp.top.size() && int(i) < k; ++i) {
    const std::string s = text(lp.top[i].first);
    Json te = Json::object();
    te["token"] = s;
    te["logprob"] = json_logprob(lp.top[i].second);
    te["bytes"] = bytes_of(s);
    top.push_back(std::move(te));
  }
  e["top_logprobs"] = std::move(top);
  return e;
}

}  // namespace kvlm::server

namespace kvlm::server {

Json prompt_logprobs_json(std::span<const TokenLogprobs> lps, int k, const TokenText& text) {
  Json out = Json::array({nullptr});  // the first prompt token has no context to be scored in
  for (const TokenLogprobs& lp : lps) {
    Json e = Json::object();
    const auto entry = [&](TokenId t, float logprob, int rank) {
      e[std::to_string(t)] = Json{{"logprob", json_logprob(logprob)}, {"rank", rank}, {"decoded_token", text(t)}};
    };
    entry(lp.token, lp.logprob, lp.rank);
    for (size_t i = 0; i < lp.top.size() && int(i) < k; ++i)
      if (lp.top[i].first != lp.token) entry(lp.top[i].first, lp.top[i].second, int(i) + 1);
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace kvlm::server
