// Tokenizer encode speed on one core: a ~1 MB text built from the tokenizer test corpus
// (prose, code, whitespace, digits, CJK, emoji, other scripts, special-token strings),
// encoded whole, best of 3 runs. Prints MB/s per tokenizer.json.
//
// usage: kvlm_bench_tokenizer [--write-text FILE] TOKENIZER_DIR...
//   --write-text  also writes the benchmark text, so HF tokenizers can be timed on the
//                 same bytes (tools/make_tokenizer_goldens.py --bench FILE).
#include <chrono>
#include <ctime>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "text/tokenizer/tokenizer.h"
#include "text/tokenizer/unicode.h"

using namespace kvlm;

int main(int argc, char** argv) {
  std::string write_to;
  std::vector<std::string> dirs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--write-text" && i + 1 < argc) write_to = argv[++i];
    else dirs.push_back(a);
  }
  std::ifstream in(std::string(KVLM_TEST_DATA) + "/data/tokenizers/corpus.json");
  const auto corpus = nlohmann::json::parse(in);
  std::string text;
  while (text.size() < (1u << 20))
    for (const auto& e : corpus)
      if (e.contains("text")) text += e["text"].get<std::string>() + "\n";
  text.resize(1u << 20);
  text.resize(text.size() - utf8::incomplete_tail(text));
  if (!write_to.empty()) std::ofstream(write_to, std::ios::binary) << text;
  for (const auto& d : dirs) {
    const Tokenizer tok = Tokenizer::load(d);
    // Thread CPU time as well as wall time: the 2-core dev/CI machines are often busy, and
    // CPU time is what "MB/s on one core" means.
    double best_wall = 1e9, best_cpu = 1e9;
    size_t n = 0;
    for (int r = 0; r < 3; ++r) {
      timespec c0{}, c1{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
      const auto t0 = std::chrono::steady_clock::now();
      n = tok.encode(text).size();
      best_wall = std::min(best_wall, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
      best_cpu = std::min(best_cpu, double(c1.tv_sec - c0.tv_sec) + 1e-9 * double(c1.tv_nsec - c0.tv_nsec));
    }
    std::printf("bench %s: kvlm %.2f MB/s per core-second (%.2f MB/s wall; %zu bytes -> %zu tokens, best of 3)\n", d.c_str(),
                double(text.size()) / best_cpu / 1e6, double(text.size()) / best_wall / 1e6, text.size(), n);
  }
  return 0;
}
