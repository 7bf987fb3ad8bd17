#include "text/text_processor.h"

#include "config/model_config.h"
#include "core/error.h"
#include "core/log.h"
#include "io/gguf.h"
#include "text/gguf_tokenizer.h"

namespace kvlm {

bool TextProcessor::available(const std::filesystem::path& dir) {
  std::error_code ec;
  if (find_gguf(dir)) return true;
  return std::filesystem::is_directory(dir, ec) && std::filesystem::exists(dir / "tokenizer.json", ec);
}

std::optional<TextProcessor> TextProcessor::load_if_usable(const std::filesystem::path& dir) {
  if (!available(dir)) return std::nullopt;
  if (!find_gguf(dir)) return load(dir);
  try {
    return load(dir);
  } catch (const Error& e) {
    log::warn(std::string(e.what()) + "; without a tokenizer, prompts must be token ids and outputs are token ids");
    return std::nullopt;
  }
}

TextProcessor TextProcessor::load(const std::filesystem::path& dir, std::string_view instead) {
  std::error_code ec;
  if (const auto gguf = find_gguf(dir)) {
    const GGUFFile f(*gguf);
    GGUFTokenizer g = load_gguf_tokenizer(f.header(), gguf->string());
    TextProcessor p(std::move(g.tokenizer), std::move(g.config));
    if (p.cfg_.chat_template) p.tpl_ = ChatTemplate::parse(*p.cfg_.chat_template, gguf->string() + " (tokenizer.chat_template)");
    return p;
  }
  if (std::filesystem::is_regular_file(dir, ec) || !available(dir))
    throw Error("'" + dir.string() + "' has no tokenizer.json (nor a .gguf file), so it cannot take text" +
                (instead.empty() ? std::string() : "; " + std::string(instead)));
  TextProcessor p(Tokenizer::load(dir), load_tokenizer_config(dir));
  if (p.cfg_.chat_template) p.tpl_ = ChatTemplate::parse(*p.cfg_.chat_template, (dir / "chat template").string());
  return p;
}

std::optional<TokenId> TextProcessor::eos_id() const { return cfg_.eos_token ? tok_.token_to_id(*cfg_.eos_token) : std::nullopt; }

std::vector<TokenId> TextProcessor::encode_prompt(std::string_view text) const {
  std::vector<TokenId> ids = tok_.encode(text);
  if (cfg_.add_bos_token && cfg_.bos_token)
    if (auto bos = tok_.token_to_id(*cfg_.bos_token); bos && (ids.empty() || ids.front() != *bos)) ids.insert(ids.begin(), *bos);
  if (cfg_.add_eos_token && cfg_.eos_token)
    if (auto eos = eos_id(); eos && (ids.empty() || ids.back() != *eos)) ids.push_back(*eos);
  return ids;
}

std::string TextProcessor::render_chat(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                       const nlohmann::ordered_json& extra) const {
  if (!tpl_) throw Error("this model has no chat template (no chat_template in tokenizer_config.json, nor tokenizer.chat_template in a GGUF file); use a plain prompt");
  nlohmann::ordered_json ctx = extra.is_object() ? extra : nlohmann::ordered_json::object();
  ctx["messages"] = messages;
  ctx["add_generation_prompt"] = add_generation_prompt;
  // transformers passes every special token of the tokenizer as a template variable.
  for (const auto& [name, value] : {std::pair{"bos_token", cfg_.bos_token}, {"eos_token", cfg_.eos_token},
                                    {"pad_token", cfg_.pad_token}, {"unk_token", cfg_.unk_token}})
    if (value && !ctx.contains(name)) ctx[name] = *value;
  return tpl_->render(ctx);
}

std::vector<TokenId> TextProcessor::encode_chat(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                                const nlohmann::ordered_json& extra) const {
  return tok_.encode(render_chat(messages, add_generation_prompt, extra), {.add_special_tokens = false});
}

}  // namespace kvlm
