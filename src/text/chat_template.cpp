#include "text/chat_template.h"

#include "core/error.h"
#include "text/jinja/ast.h"
#include "text/jinja/parser.h"
#include "text/jinja/render.h"

namespace kvlm {

namespace {

template <class Json>
std::string render_json(const jinja::Template& tpl, const Json& context, const ChatTemplateRenderOptions& options) {
  if (!context.is_object()) throw Error(tpl.name + ": the context must be a JSON object, got " + std::string(context.type_name()));
  jinja::Value ctx;
  try {
    ctx = jinja::from_json(context);
  } catch (const jinja::RuntimeError& e) {
    throw Error(tpl.name + ": " + e.what());
  }
  jinja::RenderOptions o;
  o.now = options.now;
  return jinja::render(tpl, ctx, o);
}

}  // namespace

ChatTemplate ChatTemplate::parse(std::string_view source, std::string name) {
  ChatTemplate t;
  t.tpl_ = std::make_shared<const jinja::Template>(jinja::parse_template(source, std::move(name)));
  return t;
}

std::string ChatTemplate::render(const nlohmann::json& context, const ChatTemplateRenderOptions& options) const {
  if (!tpl_) throw Error("chat template: render() on an empty ChatTemplate (use ChatTemplate::parse)");
  return render_json(*tpl_, context, options);
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context, const ChatTemplateRenderOptions& options) const {
  if (!tpl_) throw Error("chat template: render() on an empty ChatTemplate (use ChatTemplate::parse)");
  return render_json(*tpl_, context, options);
}

const std::string& ChatTemplate::name() const {
  static const std::string empty;
  return tpl_ ? tpl_->name : empty;
}

}  // namespace kvlm
