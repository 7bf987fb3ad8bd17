// libFuzzer target: the safetensors header parser must accept or reject any byte string
// with a kvlm::Error, never crash, hang or read out of bounds. Accepted headers must
// describe tensors that lie inside the file.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "core/error.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto h = kvlm::parse_safetensors_header({data, size}, size, "fuzz");
    for (const auto& t : h.tensors)
      if (h.data_start + t.end > size || t.begin > t.end) std::abort();  // an accepted header must be in bounds
  } catch (const kvlm::Error&) {
  }
  return 0;
}
