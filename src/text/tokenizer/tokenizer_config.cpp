#include "text/tokenizer/tokenizer_config.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "core/error.h"

namespace kvlm {

using nlohmann::json;

namespace {
// A special token is written as "<s>" or as an AddedToken object {"content": "<s>", ...}.
std::optional<std::string> token_field(const json& j, const char* key) {
  if (!j.contains(key) || j[key].is_null()) return std::nullopt;
  const json& v = j[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  throw Error(std::string("tokenizer_config.json: '") + key + "' must be a string or an object with \"content\"");
}
}  // namespace

TokenizerConfig load_tokenizer_config(const std::filesystem::path& dir) {
  TokenizerConfig c;
  std::error_code ec;
  const auto path = dir / "tokenizer_config.json";
  if (std::filesystem::exists(path, ec)) {
    const json j = read_json_file(path);
    if (!j.is_object()) throw Error(path.string() + ": expected a JSON object");
    c.bos_token = token_field(j, "bos_token");
    c.eos_token = token_field(j, "eos_token");
    c.pad_token = token_field(j, "pad_token");
    c.unk_token = token_field(j, "unk_token");
    c.add_bos_token = j.value("add_bos_token", false);
    c.add_eos_token = j.value("add_eos_token", false);
    if (j.contains("chat_template") && !j["chat_template"].is_null()) {
      const json& t = j["chat_template"];
      if (t.is_string()) {
        c.chat_template = t.get<std::string>();
      } else if (t.is_array()) {  // [{"name": "default", "template": "..."}, ...]
        for (const auto& e : t) {
          const std::string name = e.at("name").get<std::string>();
          const std::string tpl = e.at("template").get<std::string>();
          if (name == "default") c.chat_template = tpl;
          else c.named_templates[name] = tpl;
        }
      } else {
        throw Error(path.string() + ": 'chat_template' must be a string or a list of {name, template}");
      }
    }
  }
  const auto jinja = dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja, ec)) {
    std::ifstream in(jinja, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    c.chat_template = ss.str();
  }
  return c;
}

}  // namespace kvlm
