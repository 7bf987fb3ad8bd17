// kvlm: the command-line entry point.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
#include <exception>

#include <unistd.h>

#include "app/commands.h"
#include "core/error.h"
#include "core/log.h"

#ifndef KVLM_VERSION
#define KVLM_VERSION "0.1.0"
#endif

namespace {

// OpenMP's threads wait passively (sleep, not spin) unless the user says otherwise: spinning
// threads on a machine shared with another busy process took 10-20x the time (each barrier of
// every step waited for a thread that had lost its core to a spinner). libgomp reads
// OMP_WAIT_POLICY once, as it loads, before main: the process starts itself again with it set.
void default_wait_policy(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY")) return;
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  ::execv("/proc/self/exe", argv);  // returns only when it fails: go on spinning
}

}  // namespace

int main(int argc, char** argv) {
  default_wait_policy(argv);
  CLI::App app{"kvlm: LLM inference with a KV cache in any precision, chosen per layer", "kvlm"};
  app.set_version_flag("--version", KVLM_VERSION);
  app.require_subcommand(1);
  bool verbose = false, quiet = false;
  app.add_flag("-v,--verbose", verbose, "more diagnostics on stderr");
  app.add_flag("-q,--quiet", quiet, "no warnings on stderr");
  kvlm::app::GenerateFlags gen;
  kvlm::app::ChatFlags chat;
  kvlm::app::InspectFlags insp;
  kvlm::app::TokenizeFlags tok, detok;
  kvlm::app::TemplateFlags tpl;
  kvlm::app::ServeFlags serve;
  kvlm::app::ServeExtraFlags serve_extra;
  kvlm::app::BenchFlags bench;
  kvlm::app::CalibrateFlags cal;
  kvlm::app::EvalFlags evalf;
  auto* gen_cmd = kvlm::app::add_generate(app, gen);
  auto* chat_cmd = kvlm::app::add_chat(app, chat);
  auto* insp_cmd = kvlm::app::add_inspect(app, insp);
  auto* tok_cmd = kvlm::app::add_tokenize(app, tok);
  auto* detok_cmd = kvlm::app::add_detokenize(app, detok);
  auto* tpl_cmd = kvlm::app::add_render_template(app, tpl);
  auto* serve_cmd = kvlm::app::add_serve(app, serve);
  serve_extra.add_to(*serve_cmd);
  auto* bench_cmd = kvlm::app::add_bench(app, bench);
  auto* cal_cmd = kvlm::app::add_calibrate(app, cal);
  auto* eval_cmd = kvlm::app::add_eval(app, evalf);
  for (auto* cmd : {gen_cmd, chat_cmd, insp_cmd, tok_cmd, detok_cmd, tpl_cmd, cal_cmd, eval_cmd, serve_cmd, bench_cmd,
                    bench.throughput_cmd, bench.serve_cmd})
    cmd->fallthrough();  // -q / -v may follow the subcommand
  // vLLM's short form -tp N (CLI11 takes one-letter short flags only): the long one.
  std::vector<std::string> args(argv + 1, argv + argc);
  for (std::string& a : args) {
    if (a == "-tp") a = "--tensor-parallel-size";
    else if (a.rfind("-tp=", 0) == 0) a = "--tensor-parallel-size=" + a.substr(4);
  }
  std::reverse(args.begin(), args.end());  // CLI11 parses a reversed vector
  try {
    app.parse(args);
  } catch (const CLI::ExtrasError& e) {
    // An unknown flag: name the closest valid one of the command it was given to.
    const CLI::App* cmd = &app;
    for (bool deeper = true; deeper;) {
      deeper = false;
      for (const CLI::App* sub : cmd->get_subcommands())
        if (sub->parsed()) {
          cmd = sub;
          deeper = true;
          break;
        }
    }
    std::vector<std::string> extras = cmd->remaining();
    if (extras.empty()) extras = app.remaining();
    bool after_flag = false;
    for (const std::string& arg : extras) {
      if (arg.rfind("-", 0) != 0) {
        // The value of the unknown flag before it, most likely: not an error of its own.
        if (!after_flag) std::fprintf(stderr, "kvlm: error: unexpected argument '%s'\n", arg.c_str());
        after_flag = false;
        continue;
      }
      after_flag = arg.find('=') == std::string::npos;
      const std::string hint = kvlm::app::closest_flag(*cmd, arg);
      std::fprintf(stderr, "kvlm: error: unknown flag '%s'%s\n", arg.c_str(),
                   hint.empty() ? "" : ("; did you mean '" + hint + "'?").c_str());
    }
    if (extras.empty()) std::fprintf(stderr, "kvlm: error: %s\n", e.what());
    std::string path;
    for (const CLI::App* c = cmd; c && c != &app; c = c->get_parent()) path = " " + c->get_name() + path;
    std::fprintf(stderr, "Run 'kvlm%s --help' for the flags.\n", path.c_str());
    return 2;
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // --help / --version exit 0; usage errors exit 2
  }
  kvlm::log::set_level(quiet ? kvlm::log::Level::Quiet : verbose ? kvlm::log::Level::Info : kvlm::log::Level::Warn);
  try {
    if (gen_cmd->parsed()) return kvlm::app::run_generate(gen);
    if (chat_cmd->parsed()) return kvlm::app::run_chat(chat);
    if (insp_cmd->parsed()) return kvlm::app::run_inspect(insp);
    if (tok_cmd->parsed()) return kvlm::app::run_tokenize(tok);
    if (detok_cmd->parsed()) return kvlm::app::run_detokenize(detok);
    if (tpl_cmd->parsed()) return kvlm::app::run_render_template(tpl);
    if (serve_cmd->parsed()) return kvlm::app::run_serve(serve, serve_extra);
    if (bench_cmd->parsed()) return kvlm::app::run_bench(bench);
    if (cal_cmd->parsed()) return kvlm::app::run_calibrate(cal);
    if (eval_cmd->parsed()) return kvlm::app::run_eval(*eval_cmd, evalf);
  } catch (const kvlm::Error& e) {
    std::fprintf(stderr, "kvlm: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "kvlm: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvlm: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
