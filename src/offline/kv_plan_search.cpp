#include "offline/kv_plan_search.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <ranges>

#include "core/error.h"
#include "attention/registry.h"
#include "core/hadamard.h"
#include "kv/kv_format.h"
#include "kv/kv_formats.h"
#include "model/cpu/cpu_runner.h"
#include "offline/eval.h"

namespace kvlm {

namespace {

namespace fs = std::filesystem;

// The formats a side may take, 16-bit first. FP8 and INT8 per-token-head cost the same
// bytes; which is better depends on the layer, so both are measured, each in the rotation
// that suits it on the real models measured (docs/results/accuracy-real.md: the rotation
// rescues INT8, makes FP8 worse on Gemma 3, and INT4 needs it). INT4 also with the layer's
// exact sink / recent tokens (PlanSearchOptions::keep_sink / keep_recent), which cost a fixed
// number of exact rows per sequence, not bytes per token.
struct Choice {
  KVCacheDType dtype;
  bool rotate;
  bool exact = false;
};
constexpr Choice kChoices[] = {{KVCacheDType::BFloat16, false},
                               {KVCacheDType::Int8PerTokenHead, true},
                               {KVCacheDType::Fp8PerTokenHead, false},
                               {KVCacheDType::Int4PerTokenHead, true},
                               {KVCacheDType::Int4PerTokenHead, true, true}};


size_t side_bytes(KVCacheDType d, const AttentionLayerDesc& a) {
  const KVStorage s = *kv_storage_of(d);
  return size_t(a.num_kv_heads) * (kv_row_code_bytes(s, a.head_dim) + kv_row_scale_bytes(s));
}

// A sample of one layer's K and V rows (after RoPE, unrotated), to choose rotation signs.
struct RowSample {
  std::vector<float> k, v;
};
constexpr size_t kSampleRows = 2048;

// Relative squared error of int4 codes of `rows` (head_dim d) rotated with `seed`'s signs.
double int4_error(const std::vector<float>& rows, int d, uint32_t seed) {
  using F = kvfmt::Format<kvfmt::I4, kvfmt::ScalePolicy::PerTokenHead>;
  const size_t dn = static_cast<size_t>(d);
  std::vector<float> x(dn), y(dn);
  std::vector<uint8_t> codes(dn / 2);
  double err = 0, norm = 0;
  for (size_t r = 0; r + size_t(d) <= rows.size(); r += size_t(d)) {
    std::copy_n(rows.begin() + ptrdiff_t(r), d, x.begin());
    num::hadamard_rotate(x.data(), d, false, seed);
    const float slot = F::encode_row(x, codes.data(), 1.0f);
    F::decode_row(codes.data(), slot, y);
    for (int i = 0; i < d; ++i) {
      err += double(x[size_t(i)] - y[size_t(i)]) * double(x[size_t(i)] - y[size_t(i)]);
      norm += double(x[size_t(i)]) * double(x[size_t(i)]);
    }
  }
  return norm > 0 ? err / norm : 0;
}

// Every layer's entry: K and V as given (16-bit where not), rotations per side, the layer's seed.
struct LayerChoice {
  KVCacheDType k = KVCacheDType::BFloat16, v = KVCacheDType::BFloat16;
  bool rotate_k = false, rotate_v = false;
  bool exact = false;  // the layer keeps exact sink / recent tokens
};

KVPlanFile plan_file(const std::vector<AttentionLayerDesc>& layers, const std::vector<LayerChoice>& choice,
                     const std::vector<uint32_t>& seeds, const ModelConfig& cfg, const PlanSearchOptions& opts) {
  KVPlanFile f;
  f.source = "<calibrate>";
  f.architecture = std::string(arch_name(cfg.arch));
  f.num_layers = cfg.num_layers;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerChoice& c = choice[i];
    KVPlanEntry e;
    e.layer = layers[i].layer;
    e.k = c.k;
    e.v = c.v;
    e.rotate_k = c.rotate_k;
    e.rotate_v = c.rotate_v;
    if ((c.rotate_k || c.rotate_v) && seeds[i] != 0) e.rotation_seed = seeds[i];
    if (c.k != KVCacheDType::BFloat16 || c.v != KVCacheDType::BFloat16) {  // a quantized layer: its exact tokens
      e.keep_sink = c.exact ? opts.keep_sink : 0;
      e.keep_recent = c.exact ? opts.keep_recent : 0;
    }
    f.entries.push_back(e);
  }
  return f;
}

// A baseline's log-probs (hundreds of MB to GB): a temporary file unlinked as soon as it is
// created and reached through /proc/self/fd, so that it goes however the search ends, a kill
// or Ctrl-C included. (Without /proc: a named file removed when the search returns or throws.)
struct TempFile {
  fs::path path;
  int fd = -1;
  explicit TempFile(const std::string& tag) {
    std::string name = (fs::temp_directory_path() / ("kvlm-calibrate-" + tag + "-XXXXXX")).string();
    fd = mkstemp(name.data());
    if (fd < 0) throw Error("cannot create a temporary file in " + fs::temp_directory_path().string() +
                            " for the baseline's log-probs (set TMPDIR to a writable directory with room)");
    const fs::path proc = "/proc/self/fd/" + std::to_string(fd);
    if (fs::exists(proc) && unlink(name.c_str()) == 0) {
      path = proc;
    } else {
      path = name;
    }
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (path.string().rfind("/proc/", 0) != 0) {
      std::error_code ec;
      fs::remove(path, ec);
    }
    close(fd);
  }
};

}  // namespace

std::string choice_name(KVCacheDType d, bool rotate, bool exact) {
  const std::string s(kv_cache_dtype_name(d));
  return s.substr(0, s.find('_')) + (rotate ? "+rot" : "") + (exact ? "+exact" : "");
}

PlanSearchResult search_kv_plan(LoadedModel& model, const std::vector<TokenId>& tokens, const PlanSearchOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!(opts.kld_budget > 0)) throw Error("--kld-budget must be positive");
  // The CPU runner shows K and V as they are stored, for the rotation seeds; on another
  // device every layer keeps the default signs.
  auto* cpu = dynamic_cast<CpuModelRunner*>(&model.model());
  const ModelConfig& cfg = model.config();
  const auto layers = attention_layers(cfg);
  if (layers.empty()) throw Error("the model has no attention layers: it holds no KV cache to plan");
  const size_t n = layers.size();
  auto say = [&](const std::string& s) {
    if (opts.progress) opts.progress(s);
  };

  // The text's windows: the search's first, then the check windows (never used to choose).
  const int total_windows = int(tokens.size() / size_t(std::max(opts.ctx, 1)));
  if (total_windows < 1)
    throw Error("the calibration text has " + std::to_string(tokens.size()) + " tokens, fewer than one window of --ctx " +
                std::to_string(opts.ctx) + "; use a longer text or a smaller --ctx");
  const int check_windows = std::min(std::max(opts.check_windows, 0), total_windows - 1);
  const int search_windows = std::min(std::max(opts.max_windows, 1), total_windows - check_windows);
  if (check_windows < opts.check_windows)
    say("the text fills " + std::to_string(total_windows) + " window" + (total_windows == 1 ? "" : "s") + " of " +
        std::to_string(opts.ctx) + " tokens: " + std::to_string(check_windows) + " check window" +
        (check_windows == 1 ? "" : "s") + " instead of " + std::to_string(opts.check_windows) +
        (check_windows == 0 ? " (the plan is not checked on text the search did not see)" : "") +
        "; give more text for a safer plan");
  // The windows measured, spread evenly over the text (its passages differ: on Gemma 3 the
  // same plan measured 2.6e-4 to 1.1e-2 on the windows of one file), search and check windows
  // alternating, each set cut out as consecutive windows for eval_perplexity.
  std::vector<TokenId> search_tokens, check_tokens;
  {
    const int n = search_windows + check_windows;
    int searched = 0, checked = 0;
    for (int i = 0; i < n; ++i) {
      const size_t w = size_t((2 * int64_t(i) + 1) * total_windows / (2 * int64_t(n)));
      const bool to_check = checked < check_windows && (searched == search_windows || i % 2 == 1);
      auto& dst = to_check ? check_tokens : search_tokens;
      (to_check ? checked : searched) += 1;
      const auto from = tokens.begin() + ptrdiff_t(w * size_t(opts.ctx));
      dst.insert(dst.end(), from, from + opts.ctx);
    }
  }

  TempFile base_file("search"), check_file("check");
  PlanSearchResult res;
  res.check_windows = check_windows;
  const std::vector<uint32_t> no_seeds(n, 0);
  // The upper bound's standard error: the larger of the per-token one and the one across windows.
  auto kld_error = [](const PerplexityResult& r) {
    double err = r.kld_mean_err;
    const size_t w = r.kld_windows.size();
    if (w >= 2) {
      double m = 0, ss = 0;
      for (double x : r.kld_windows) m += x;
      m /= double(w);
      for (double x : r.kld_windows) ss += (x - m) * (x - m);
      err = std::max(err, std::sqrt(ss / double(w - 1) / double(w)));
    }
    return err;
  };
  auto run = [&](const KVPlanFile& f, const std::vector<TokenId>& text, int windows, const fs::path& base) {
    CacheConfig c = opts.base;
    c.plan_file = f;
    model.replan_kv(c);
    PerplexityOptions p{.ctx = opts.ctx, .max_chunks = windows, .kld_base = base};
    ++res.plans_measured;
    return eval_perplexity(model, text, p);
  };
  auto measure = [&](const std::string& name, const KVPlanFile& f) {
    const PerplexityResult r = run(f, search_tokens, search_windows, base_file.path);
    PlanCandidate pc{.name = name, .file = f, .bytes_per_token = model.plan().bytes_per_token(),
                     .exact_bytes_per_sequence = size_t(model.plan().keep_sink() + model.plan().keep_recent()) *
                                                 model.plan().exact_bytes_per_token(),
                     .kld = r.kld_mean, .kld_err = kld_error(r), .same_top = r.same_top};
    pc.within_search = pc.kld + 2 * pc.kld_err <= opts.kld_budget;
    pc.within = pc.within_search && check_windows == 0;
    return pc;
  };
  // Measures a candidate within on the search windows again on the check windows.
  auto check = [&](PlanCandidate& pc) {
    if (check_windows == 0 || pc.checked || !pc.within_search) return;
    const PerplexityResult r = run(pc.file, check_tokens, check_windows, check_file.path);
    pc.checked = true;
    pc.check_kld = r.kld_mean;
    pc.check_kld_err = kld_error(r);
    pc.within = pc.check_kld + 2 * pc.check_kld_err <= opts.kld_budget;
    char line[160];
    std::snprintf(line, sizeof line, "%s on the check windows: KLD %.3g +- %.2g (%s)", pc.name.c_str(), pc.check_kld,
                  pc.check_kld_err, pc.within ? "within" : "over");
    say(line);
  };

  // 1. The 16-bit baseline, sampling K and V rows on the way.
  std::vector<RowSample> samples(n);
  {
    CacheConfig c = opts.base;
    c.plan_file = plan_file(layers, std::vector<LayerChoice>(n), no_seeds, cfg, opts);
    model.replan_kv(c);
    res.bf16_bytes_per_token = model.plan().bytes_per_token();
    if (cpu)
      cpu->set_kv_observer([&](size_t li, std::span<const float> k, std::span<const float> v) {
        if (li >= n) return;
        RowSample& s = samples[li];
        const size_t d = size_t(layers[li].head_dim), room = kSampleRows * d - std::min(kSampleRows * d, s.k.size());
        const size_t take = std::min(room, k.size());
        s.k.insert(s.k.end(), k.begin(), k.begin() + ptrdiff_t(take));
        s.v.insert(s.v.end(), v.begin(), v.begin() + ptrdiff_t(take));
      });
    struct Reset {
      CpuModelRunner* m;
      ~Reset() {
        if (m) m->set_kv_observer({});
      }
    } reset{cpu};
    const PerplexityResult r = eval_perplexity(
        model, search_tokens,
        PerplexityOptions{.ctx = opts.ctx, .max_chunks = search_windows, .save_logits = base_file.path});
    res.windows = r.chunks;
    res.scored_tokens = r.scored_tokens;
    ++res.plans_measured;
    say("baseline (K and V in bfloat16): " + std::to_string(r.chunks) + (r.chunks == 1 ? " window of " : " windows of ") + std::to_string(opts.ctx) +
        " tokens, " + std::to_string(r.scored_tokens) + " scored, perplexity " + std::to_string(r.ppl));
  }
  if (check_windows > 0) {  // the check windows' baseline (no sampling: the observer is gone)
    const PerplexityResult r = eval_perplexity(
        model, check_tokens,
        PerplexityOptions{.ctx = opts.ctx, .max_chunks = check_windows, .save_logits = check_file.path});
    ++res.plans_measured;
    say("check windows' baseline: " + std::to_string(r.chunks) + (r.chunks == 1 ? " window" : " windows") + " between the search's, " +
        std::to_string(r.scored_tokens) + " scored; a plan is accepted only if it is within the budget there too");
  }

  // Which K != V pairs each layer's backend reads (the CUDA kernels: kv/kv_formats.h's list). A
  // backend without any makes the search choose one format per layer (each side may still rotate
  // on its own).
  std::vector<const BackendCapabilities*> caps_of(n, nullptr);
  for (size_t i = 0; i < n; ++i)
    for (const auto& l : model.plan().layers)
      if (l.attn.layer == layers[i].layer)
        for (const auto& caps : builtin_backend_caps())
          if (caps.name == l.backend) caps_of[i] = &caps;
  bool split = true;
  for (const BackendCapabilities* caps : caps_of) split &= caps && caps->kv_pairs.has_value();
  res.split_kv = split;
  auto holds = [&](size_t i, KVCacheDType k, KVCacheDType v) {
    return !caps_of[i] || caps_of[i]->holds_pair(*kv_storage_of(k), *kv_storage_of(v));
  };

  // The rotation signs of each layer: the seed whose int4 codes hold its K and V rows best.
  std::vector<uint32_t> seeds(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const int d = layers[i].head_dim;
    if (!cpu || !num::is_pow2(d) || d % 8 != 0) continue;
    double best = INFINITY;
    for (uint32_t s = 0; s < uint32_t(std::max(opts.num_seeds, 1)); ++s) {
      const double e = int4_error(samples[i].k, d, s) + int4_error(samples[i].v, d, s);
      if (e < best) best = e, seeds[i] = s;
    }
  }

  // 2. Each layer's sides alone.
  const bool pow2 = std::ranges::all_of(layers, [](const auto& a) { return num::is_pow2(a.head_dim); });
  const bool int4_ok = std::ranges::all_of(layers, [](const auto& a) { return a.head_dim % 8 == 0; });
  const bool exact_ok = opts.keep_sink > 0 || opts.keep_recent > 0;
  // Each unit (a layer's K, its V, or with one format per layer both) and its options.
  const std::vector<KVSide> kBoth{KVSide::K, KVSide::V};
  for (size_t i = 0; i < n; ++i) {
    LayerSensitivity ls{.layer = layers[i].layer, .seed = seeds[i]};
    const std::vector<std::vector<KVSide>> units = split ? std::vector<std::vector<KVSide>>{{KVSide::K}, {KVSide::V}}
                                                         : std::vector<std::vector<KVSide>>{kBoth};
    for (const auto& sides : units) {
      auto& opts_of = sides.size() == 2 ? ls.kv : sides[0] == KVSide::K ? ls.k : ls.v;
      for (const Choice& ch : kChoices) {
        if ((ch.rotate && !pow2) || (ch.dtype == KVCacheDType::Int4PerTokenHead && !int4_ok) || (ch.exact && !exact_ok))
          continue;
        SideOption o{.dtype = ch.dtype, .rotate = ch.rotate, .exact = ch.exact,
                     .bytes = sides.size() * side_bytes(ch.dtype, layers[i])};
        if (ch.dtype != KVCacheDType::BFloat16) {
          std::vector<LayerChoice> c(n);
          for (KVSide side : sides) {
            (side == KVSide::K ? c[i].k : c[i].v) = ch.dtype;
            (side == KVSide::K ? c[i].rotate_k : c[i].rotate_v) = ch.rotate;
          }
          c[i].exact = ch.exact;
          const PlanCandidate pc = measure("", plan_file(layers, c, seeds, cfg, opts));
          o.kld = pc.kld;
          o.same_top = pc.same_top;
          o.exact_bytes_per_sequence = pc.exact_bytes_per_sequence;
        }
        opts_of.push_back(o);
      }
    }
    std::string line = "layer " + std::to_string(ls.layer) + " (seed " + std::to_string(ls.seed) + "):";
    for (const auto* unit : {&ls.k, &ls.v, &ls.kv})
      for (const SideOption& o : *unit)
        if (o.dtype != KVCacheDType::BFloat16) {
          char buf[96];
          std::snprintf(buf, sizeof buf, " %s %s %.1e", unit == &ls.k ? "K" : unit == &ls.v ? "V" : "KV",
                        choice_name(o.dtype, o.rotate, o.exact).c_str(), o.kld);
          line += buf;
        }
    say(line);
    res.layers.push_back(std::move(ls));
  }

  // 3. Uniform modes, for the comparison and as candidates of their own.
  auto uniform = [&](KVCacheDType k, bool rk, KVCacheDType v, bool rv, bool exact = false) {
    std::vector<LayerChoice> c(n, LayerChoice{k, v, rk, rv, exact});
    const std::string name = k == v && rk == rv ? "uniform " + choice_name(k, rk, exact)
                                                : "uniform K " + choice_name(k, rk) + " V " + choice_name(v, rv, exact);
    res.candidates.push_back(measure(name, plan_file(layers, c, seeds, cfg, opts)));
    say(name + ": KLD " + std::to_string(res.candidates.back().kld));
  };
  for (const Choice& ch : kChoices)
    if (ch.dtype != KVCacheDType::BFloat16 && !(ch.rotate && !pow2) && !(ch.dtype == KVCacheDType::Int4PerTokenHead && !int4_ok) &&
        !(ch.exact && !exact_ok))
      uniform(ch.dtype, ch.rotate, ch.dtype, ch.rotate, ch.exact);
  if (split && pow2 && int4_ok &&
      std::ranges::all_of(std::views::iota(size_t(0), n),
                          [&](size_t i) { return holds(i, KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead); })) {
    uniform(KVCacheDType::Int8PerTokenHead, true, KVCacheDType::Int4PerTokenHead, true);
    if (exact_ok) uniform(KVCacheDType::Int8PerTokenHead, true, KVCacheDType::Int4PerTokenHead, true, true);
  }

  // 4. Assembled plans: the greedy choice up to a KLD target, measured; the target bisected.
  struct Item {
    const std::vector<SideOption>* options;
    size_t at = 0;  // the option taken
    bool frozen = false;
  };
  // The plan up to `target`, and whether every side took its fewest bytes (a larger target
  // cannot change it).
  auto assemble = [&](double target) -> std::pair<KVPlanFile, bool> {
    std::vector<Item> items;  // per layer: K's and V's, or the one of both
    for (const auto& ls : res.layers) {
      if (split) {
        items.push_back({&ls.k});
        items.push_back({&ls.v});
      } else {
        items.push_back({&ls.kv});
      }
    }
    const size_t per = split ? 2 : 1;
    // A layer's bytes per token with item `moved` at option `opt` and its other item(s) as they
    // stand: the sides' pages, and the exact rows at the served context, once per layer.
    auto layer_bytes = [&](size_t moved, size_t opt) {
      const size_t first = moved / per * per;
      double bytes = 0;
      size_t exact = 0;
      for (size_t j = first; j < first + per; ++j) {
        const SideOption& o = (*items[j].options)[j == moved ? opt : items[j].at];
        bytes += double(o.bytes);
        if (o.exact) exact = std::max(exact, o.exact_bytes_per_sequence);
      }
      return bytes + (opts.context > 0 ? double(exact) / opts.context : 0.0);
    };
    double total = 0;
    for (;;) {
      // The move with the most bytes saved per unit of KLD added, over every item.
      double best_eff = -1;
      size_t best_item = 0, best_opt = 0;
      for (size_t it = 0; it < items.size(); ++it) {
        Item& item = items[it];
        if (item.frozen) continue;
        const SideOption& cur = (*item.options)[item.at];
        // With K and V apart, the other side of the layer as it stands: the pair must be one
        // the layer's backend reads.
        const SideOption* other = nullptr;
        if (split) other = &(*items[it ^ 1].options)[items[it ^ 1].at];
        const double now = layer_bytes(it, item.at);
        for (size_t o = 0; o < item.options->size(); ++o) {
          const SideOption& nx = (*item.options)[o];
          const double saved = now - layer_bytes(it, o);
          if (saved <= 0) continue;
          if (other && !holds(it / 2, it % 2 == 0 ? nx.dtype : other->dtype, it % 2 == 0 ? other->dtype : nx.dtype))
            continue;
          const double dk = std::max(nx.kld - cur.kld, 1e-12);
          const double eff = saved / dk;
          if (eff > best_eff) best_eff = eff, best_item = it, best_opt = o;
        }
      }
      if (best_eff < 0) break;
      Item& item = items[best_item];
      const double dk = (*item.options)[best_opt].kld - (*item.options)[item.at].kld;
      if (total + dk > target) {
        item.frozen = true;  // its next step does not fit; others' smaller steps may
        continue;
      }
      total += dk;
      item.at = best_opt;
    }
    std::vector<LayerChoice> c(n);
    bool cheapest = true;
    for (size_t i = 0; i < n; ++i) {
      const Item &ki = items[per * i], &vi = items[per * i + per - 1];
      const SideOption &k = (*ki.options)[ki.at], &v = (*vi.options)[vi.at];
      c[i] = {k.dtype, v.dtype, k.rotate, v.rotate, k.exact || v.exact};
      for (size_t j = per * i; j < per * i + per; ++j)
        for (size_t o = 0; o < items[j].options->size(); ++o) cheapest &= layer_bytes(j, o) >= layer_bytes(j, items[j].at);
    }
    return {plan_file(layers, c, seeds, cfg, opts), cheapest};
  };
  double lo = 0, hi = 0;  // targets: lo's plan within the budget (0: the 16-bit one), hi's not (0: none seen)
  double target = opts.kld_budget;
  for (int step = 0; step < opts.bisect_steps; ++step) {
    char name[64];
    std::snprintf(name, sizeof name, "assembled (target %.3g)", target);
    auto [file, cheapest] = assemble(target);
    // A plan measured before (a uniform one, or an earlier target's) is not measured again.
    const std::string key = kv_plan_file_json(file)["layers"].dump();
    const auto same = std::ranges::find_if(res.candidates, [&](const PlanCandidate& c) {
      return kv_plan_file_json(c.file)["layers"].dump() == key;
    });
    bool within;
    if (same != res.candidates.end()) {
      check(*same);
      within = same->within;
      say(std::string(name) + ": the plan of " + same->name);
    } else {
      PlanCandidate pc = measure(name, file);
      say(std::string(name) + ": " + std::to_string(pc.bytes_per_token) + " B/token, KLD " + std::to_string(pc.kld) +
          (pc.within_search ? " (within)" : " (over)"));
      check(pc);
      within = pc.within;
      res.candidates.push_back(std::move(pc));
    }
    if (within && cheapest) break;  // every side at its fewest bytes, and within: nothing is left to gain
    if (within) lo = target;
    else hi = target;
    target = hi == 0 ? target * 2 : lo == 0 ? target / 2 : std::sqrt(lo * hi);
  }

  // The answer: the fewest bytes at the context among the candidates within on the search
  // windows, checked in that order until one is within on the check windows too.
  std::vector<size_t> order(res.candidates.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::ranges::stable_sort(order, [&](size_t a, size_t b) {
    const PlanCandidate &x = res.candidates[a], &y = res.candidates[b];
    return x.bytes_at(opts.context) != y.bytes_at(opts.context) ? x.bytes_at(opts.context) < y.bytes_at(opts.context)
                                                                : x.kld < y.kld;
  });
  for (size_t i : order) {
    PlanCandidate& c = res.candidates[i];
    if (!c.within_search) continue;
    check(c);
    if (c.within) {
      res.best = i;
      break;
    }
  }
  CacheConfig c = opts.base;
  c.plan_file = res.best ? res.candidates[*res.best].file : plan_file(layers, std::vector<LayerChoice>(n), no_seeds, cfg, opts);
  model.replan_kv(c);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace kvlm
