// libFuzzer target: a request body, whatever its bytes, is parsed into a request or refused
// with an ApiError (or a kvlm::Error from a grammar), never a crash, a hang or a read out of
// bounds. Bodies that carry a constraint (response_format, structured_outputs, guided_*,
// tools with tool_choice required) have their grammar compiled and run a few steps over a
// small vocabulary, so the JSON-schema, regex and GBNF converters and the matcher are fuzzed
// through the same door a client uses. The input's first byte picks the endpoint.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "core/error.h"
#include "grammar_walk.h"
#include "server/protocol.h"

using namespace kvlm;

namespace {

void exercise(const server::GenParams& g) {
  if (g.grammar) fuzz::walk_grammar(*g.grammar);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = data[0] & 1;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  server::ModelInfo info;
  info.name = "m";
  info.max_model_len = 4096;
  info.vocab_size = 300;
  info.has_tokenizer = true;
  info.has_chat_template = true;
  info.tool_parser = (data[0] & 2) ? server::ToolParser::Llama3Json : server::ToolParser::Hermes;
  const server::ApiLimits limits;
  try {
    const auto j = server::parse_body(body, limits);
    if (chat) {
      const auto r = server::parse_chat_request(j, info, limits);
      exercise(r.gen);
      (void)server::resolve_max_tokens(r.gen, 10, info.max_model_len, true);
    } else {
      const auto r = server::parse_completion_request(j, info, limits);
      exercise(r.gen);
      (void)server::resolve_max_tokens(r.gen, 10, info.max_model_len, false);
    }
  } catch (const server::ApiError&) {
  } catch (const Error&) {
  }
  return 0;
}
