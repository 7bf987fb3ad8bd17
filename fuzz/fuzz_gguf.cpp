// libFuzzer target: the GGUF parser must accept or reject any byte string with a
// kvlm::Error, never crash, hang or read out of bounds. Accepted files must describe tensors
// that lie inside the file, and their typed lookups must not crash either; nor may turning
// their metadata into a Hugging Face config (map_gguf_model) or a tokenizer
// (load_gguf_tokenizer, then encoding and decoding a short text).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "core/error.h"
#include "io/gguf.h"
#include "io/gguf_model.h"
#include "text/gguf_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto h = kvlm::parse_gguf({data, size}, "fuzz");
    for (const auto& t : h.tensors)
      if (h.data_start + t.offset + t.bytes > size) std::abort();  // an accepted file must be in bounds
    for (const auto& kv : h.metadata) {
      try {
        if (kv.value.type == kvlm::GGUFType::Array) (void)h.get_numbers(kv.key);
        else (void)h.get_float(kv.key);
      } catch (const kvlm::Error&) {
      }
    }
    try {
      (void)kvlm::map_gguf_model(h, "fuzz");
    } catch (const kvlm::Error&) {
    }
    try {
      const auto t = kvlm::load_gguf_tokenizer(h, "fuzz");
      const auto ids = t.tokenizer.encode("Hello  world <s>\n\xC3\xA9 12");
      (void)t.tokenizer.decode(ids);
    } catch (const kvlm::Error&) {
    }
  } catch (const kvlm::Error&) {
  }
  return 0;
}
