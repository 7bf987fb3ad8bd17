// The top-level fields of a completions or chat request body that kvlm does not read: OpenAI's
// and vLLM's fields it does not implement are refused by name (a 400), anything else is
// listed for the server's log (docs/serving-flags.md, "Request fields").
#pragma once

#include <string>
#include <vector>

#include "server/protocol.h"

namespace kvlm::server {

// Throws ApiError 400 naming the first field kvlm does not implement that is set to anything
// but its neutral value (null, false, an empty list or object, modalities ["text"],
// length_penalty 1); reasoning_effort is a chat field.
void refuse_unimplemented_fields(const Json& body, bool chat);

// The fields of `body` that are neither read, refused nor a label (user, metadata,
// service_tier) by the endpoint (chat or completions), each cut to 64 characters.
std::vector<std::string> unrecognized_fields(const Json& body, bool chat);

}  // namespace kvlm::server
