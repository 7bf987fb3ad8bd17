// kvlm chat: an interactive multi-turn conversation using the model's chat template.
// /reset clears the history, /exit (or Ctrl-D) quits, Ctrl-C stops the current answer. A
// model that writes harmony (GPT-OSS) has its reasoning shown apart (dimmed on a terminal)
// and kept out of the history, as its template expects.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <iostream>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "core/error.h"
#include "offline/generate.h"
#include "server/tool_calls.h"
#include "text/text_output.h"
#include "text/text_processor.h"

namespace kvlm::app {

namespace {
std::atomic<bool> g_interrupted{false};
extern "C" void on_sigint(int) { g_interrupted.store(true); }
}  // namespace

CLI::App* add_chat(CLI::App& app, ChatFlags& f) {
  auto* cmd = app.add_subcommand("chat", "Chat with a model interactively (/reset, /exit; Ctrl-C stops an answer)");
  f.model.add_to(*cmd);
  f.model.add_speculative_to(*cmd);
  f.sampling.add_to(*cmd);
  cmd->add_option("--system", f.system, "a system message to start every conversation with");
  return cmd;
}

int run_chat(const ChatFlags& f) {
  ModelOptions opts = f.model.model_options();
  const TextProcessor text =
      TextProcessor::load(opts.model_dir, "chat needs one (`kvlm generate --prompt-ids` runs such a model on token ids)");
  if (!text.has_chat_template()) throw Error("this model has no chat template; use `kvlm generate --prompt` instead");
  auto engine = LoadedModel::load(opts);

  // Ctrl-C sets a flag the generation loop checks; without SA_RESTART it also interrupts a
  // pending read of the next line, which then just asks again.
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);

  nlohmann::ordered_json history = nlohmann::ordered_json::array();
  auto reset = [&] {
    history = nlohmann::ordered_json::array();
    if (!f.system.empty()) history.push_back({{"role", "system"}, {"content", f.system}});
  };
  reset();
  std::fprintf(stderr, "kvlm chat with %s — /reset clears the conversation, /exit quits, Ctrl-C stops an answer\n",
               opts.model_dir.string().c_str());
  std::fprintf(stderr, "%s\n", describe_sampling(f.sampling.params(engine->config()), engine->config()).c_str());
  const bool harmony = server::detect_tool_parser(*text.config().chat_template) == server::ToolParser::Harmony;
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  std::string line;
  for (;;) {
    std::fputs("> ", stdout);
    std::fflush(stdout);
    g_interrupted = false;
    if (!std::getline(std::cin, line)) {
      if (g_interrupted && !std::cin.eof()) {  // Ctrl-C at the prompt
        std::cin.clear();
        std::fputs("\n(use /exit or Ctrl-D to quit)\n", stdout);
        continue;
      }
      std::fputs("\n", stdout);
      return 0;
    }
    if (line == "/exit" || line == "/quit") return 0;
    if (line == "/reset") {
      reset();
      std::fputs("(conversation cleared)\n", stdout);
      continue;
    }
    if (line.empty()) continue;
    history.push_back({{"role", "user"}, {"content", line}});
    GenerateRequest req = f.sampling.request(engine->config());
    req.cancel = &g_interrupted;
    if (auto eos = text.eos_id()) req.extra_eos.push_back(*eos);
    try {
      req.prompt = text.encode_chat(history, true);
      const int room = engine->config().max_position_embeddings - int(req.prompt.size());
      if (room < 1) throw Error("the conversation no longer fits the model's context; /reset to start again");
      req.max_tokens = std::min(req.max_tokens, room);
    } catch (const Error& e) {
      history.erase(history.end() - 1);
      std::fprintf(stderr, "kvlm: error: %s\n", e.what());
      continue;
    }
    TextOutput tout(text.tokenizer(), f.sampling.stop, /*skip_special_tokens=*/!harmony);  // harmony's markers are special tokens
    std::string answer;
    server::ToolCallStream channels(server::ToolParser::Harmony);
    bool reasoning_shown = false, answer_started = false;
    auto print = [](const std::string& s) { std::fwrite(s.data(), 1, s.size(), stdout); };
    auto emit = [&](const std::string& s, bool end = false) {
      if (!harmony) {
        answer += s;
        print(s);
      } else {
        // reasoning first (dimmed on a terminal, "thinking:" otherwise), then the answer
        const server::ToolCallStream::Out o = end ? channels.finish() : channels.push(s);
        if (!o.reasoning.empty()) {
          if (!reasoning_shown) print(tty ? "\033[2m" : "thinking: ");
          reasoning_shown = true;
          print(o.reasoning);
        }
        std::string shown = o.content;
        for (const auto& call : o.calls) shown += "[call " + call.name + " " + call.arguments + "]";
        if (!shown.empty()) {
          if (reasoning_shown && !answer_started) print(tty ? "\033[0m\n" : "\n");
          answer_started = true;
          answer += o.content;
          print(shown);
        }
      }
      std::fflush(stdout);
    };
    const GenerateResult r = generate(*engine, req, [&](TokenId id) {
      emit(tout.push(id));
      return !tout.stopped();
    });
    emit(tout.finish());
    if (harmony) emit("", /*end=*/true);  // what the parser held back
    if (harmony && tty && reasoning_shown && !answer_started) std::fputs("\033[0m", stdout);
    std::fputs(r.finish_reason == "abort" ? " [stopped]\n" : "\n", stdout);
    history.push_back({{"role", "assistant"}, {"content", answer}});
    print_summary(r, *engine);
  }
}

}  // namespace kvlm::app
