// What the prefix cache's lower tiers (host_kv_tier.h, disk_kv_tier.h) name a page by: a hash
// of everything its K/V depends on — a root that covers the model, its weights and the KV plan
// (kv_root), then every token up to the page's end, chained page by page:
//   chain(page 0) = H(root, tokens of page 0),  chain(page i) = H(chain(page i-1), tokens of page i)
// H is SHA-256 truncated to 128 bits, so a prompt chosen to collide with another user's
// prefix is out of reach (the pool's own identities are serials, exact by construction; a
// tier entry outlives them — a restart, for the disk — and is named by content instead). The
// page's own tokens are also compared on every hit.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "core/index_types.h"
#include "core/sha256.h"

namespace kvlm {

struct PageHash {
  uint64_t lo = 0, hi = 0;
  bool empty() const { return lo == 0 && hi == 0; }
  friend bool operator==(const PageHash&, const PageHash&) = default;
  std::string hex() const {
    static constexpr char d[] = "0123456789abcdef";
    std::string s(32, '0');
    for (int i = 0; i < 16; ++i) {
      const uint64_t w = i < 8 ? hi : lo;
      const auto b = uint8_t(w >> (56 - 8 * (i % 8)));
      s[size_t(2 * i)] = d[b >> 4];
      s[size_t(2 * i + 1)] = d[b & 15];
    }
    return s;
  }
};

namespace page_hash_detail {
inline PageHash from_digest(const std::array<uint8_t, 32>& d) {
  PageHash h;
  for (int i = 0; i < 8; ++i) {
    h.hi = h.hi << 8 | d[size_t(i)];
    h.lo = h.lo << 8 | d[size_t(8 + i)];
  }
  if (h.empty()) h.lo = 1;  // empty() means "no hash"
  return h;
}
}  // namespace page_hash_detail

// The root of every chain: a hash of a description of what the pages' bytes depend on.
inline PageHash kv_root(std::string_view description) {
  return page_hash_detail::from_digest(
      sha256(std::span(reinterpret_cast<const uint8_t*>(description.data()), description.size())));
}

// The hash of a page holding `tokens` after the page hashed `parent` (the root for page 0).
inline PageHash page_chain(const PageHash& parent, std::span<const TokenId> tokens) {
  // The parent big-endian, then the tokens as little-endian int32 whatever the host, packed and
  // hashed 64 tokens at a time.
  Sha256 s;
  uint8_t b[4 * 64];
  for (int i = 0; i < 8; ++i) {
    b[i] = uint8_t(parent.hi >> (56 - 8 * i));
    b[8 + i] = uint8_t(parent.lo >> (56 - 8 * i));
  }
  s.update(b, 16);
  for (size_t i = 0; i < tokens.size();) {
    size_t n = 0;
    for (; n < 64 && i < tokens.size(); ++n, ++i) {
      const auto u = uint32_t(tokens[i]);
      for (int k = 0; k < 4; ++k) b[4 * n + size_t(k)] = uint8_t(u >> (8 * k));
    }
    s.update(b, 4 * n);
  }
  return page_hash_detail::from_digest(s.finish());
}

struct PageHashHasher {
  size_t operator()(const PageHash& h) const { return size_t(h.lo ^ (h.hi * 0x9e3779b97f4a7c15ULL)); }
};

}  // namespace kvlm
