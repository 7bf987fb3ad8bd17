// SHA-256 (FIPS 180-4). The KV tiers name a page by a hash of everything before it
// (engine/page_hash.h); a prompt an attacker chooses must not be able to collide with
// another user's prefix, so the hash is a cryptographic one, as vLLM's prefix-cache hashing is.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace kvlm {

class Sha256 {
 public:
  Sha256();
  void update(std::span<const uint8_t> bytes);
  void update(const void* data, size_t n) { update(std::span(static_cast<const uint8_t*>(data), n)); }
  // The digest; the object must not be updated afterwards.
  std::array<uint8_t, 32> finish();

 private:
  void block(const uint8_t* p);
  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buf_{};
  size_t used_ = 0;
  uint64_t length_ = 0;  // bytes
};

std::array<uint8_t, 32> sha256(std::span<const uint8_t> bytes);

}  // namespace kvlm
