// The browser chat page (src/server/web/chat.html, compiled into the binary by CMake).
#pragma once

#include <string_view>

namespace kvlm::server {

std::string_view chat_page();

}  // namespace kvlm::server
