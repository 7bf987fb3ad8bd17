#include "kernel_timeline.h"

#include <algorithm>
#include <map>
#include <stdexcept>

#ifdef KVLM_HAVE_CUPTI
#include <cupti.h>
#include <cxxabi.h>

#include <cstdlib>
#include <mutex>
#endif

namespace kvlm::bench {

namespace {

#ifdef KVLM_HAVE_CUPTI
std::mutex g_mu;
std::vector<KernelRecord> g_records;  // CUPTI's buffers are delivered on its own thread

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  throw std::runtime_error(std::string("CUPTI ") + what + ": " + (s ? s : "unknown error"));
}

// "void kvlm::cuda::(anonymous namespace)::foo_kernel<A, 4>(Params)" -> "foo_kernel<A, 4>"
std::string short_name(const char* mangled) {
  if (!mangled) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : mangled;
  std::free(d);
  for (const std::string cut : {"kvlm::cuda::", "(anonymous namespace)::", "kvlm::"})
    for (size_t at; (at = s.find(cut)) != std::string::npos;) s.erase(at, cut.size());
  // the parameter list: the last '(' at template depth 0
  int depth = 0;
  size_t open = std::string::npos;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    else if (s[i] == '>') --depth;
    else if (s[i] == '(' && depth == 0) open = i;
  }
  if (open != std::string::npos && open > 0) s.resize(open);
  if (s.rfind("void ", 0) == 0) s.erase(0, 5);
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t(16) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

const char* copy_kind(uint8_t k) {
  switch (k) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "DtoD";
    default: return "other";
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<KernelRecord> got;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
      got.push_back({short_name(k->name), k->start, k->end, k->gridX * k->gridY * k->gridZ,
                     k->blockX * k->blockY * k->blockZ});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* c = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
      got.push_back({std::string("[memcpy ") + copy_kind(c->copyKind) + " " + std::to_string(c->bytes) + " B]",
                     c->start, c->end, 0, 0});
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
      got.push_back({"[memset " + std::to_string(m->bytes) + " B]", m->start, m->end, 0, 0});
    }
  }
  std::free(buffer);
  const std::lock_guard<std::mutex> lock(g_mu);
  g_records.insert(g_records.end(), got.begin(), got.end());
}

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET};
#endif

struct Pos {  // one position of the step's sequence, summed over the steps (and layers) that have it
  std::string name;
  int grid = 0, block = 0;
  double dur = 0, excl = 0, gap = 0;  // ns
  int n = 0;
};

// A kernel's name as a table cell: long template argument lists cut at 110 characters.
std::string cell(const std::string& name) { return name.size() > 110 ? name.substr(0, 107) + "..." : name; }

void print_rows(std::FILE* out, const std::vector<Pos>& rows, int first_index) {
  for (size_t i = 0; i < rows.size(); ++i) {
    const Pos& p = rows[i];
    const std::string shape = p.grid ? std::to_string(p.grid) + " x " + std::to_string(p.block) : "";
    std::fprintf(out, "| %d | %s | %s | %.2f | %.2f | %.2f |\n", first_index + int(i), cell(p.name).c_str(), shape.c_str(),
                 p.dur / p.n / 1e3, p.excl / p.n / 1e3, p.gap / p.n / 1e3);
  }
}

}  // namespace

bool KernelTimeline::available() {
#ifdef KVLM_HAVE_CUPTI
  return true;
#else
  return false;
#endif
}

KernelTimeline::KernelTimeline() {
#ifdef KVLM_HAVE_CUPTI
  {
    const std::lock_guard<std::mutex> lock(g_mu);
    g_records.clear();
  }
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  for (CUpti_ActivityKind k : kKinds) check(cuptiActivityEnable(k), "enable activity");
#else
  throw std::runtime_error("decode_bench was built without CUPTI (the CUDA toolkit's libcupti); --kernels needs it");
#endif
}

KernelTimeline::~KernelTimeline() {
#ifdef KVLM_HAVE_CUPTI
  if (!stopped_) {
    for (CUpti_ActivityKind k : kKinds) cuptiActivityDisable(k);
    cuptiActivityFlushAll(1);
  }
#endif
}

void KernelTimeline::mark() {
#ifdef KVLM_HAVE_CUPTI
  uint64_t t = 0;
  check(cuptiGetTimestamp(&t), "timestamp");
  marks_.push_back(t);
#endif
}

void KernelTimeline::report(std::FILE* out, const std::string& title, int layers) {
#ifdef KVLM_HAVE_CUPTI
  check(cuptiActivityFlushAll(1), "flush");
  for (CUpti_ActivityKind k : kKinds) cuptiActivityDisable(k);
  stopped_ = true;
  std::vector<KernelRecord> all;
  {
    const std::lock_guard<std::mutex> lock(g_mu);
    all.swap(g_records);
  }
  print_timeline(out, title, layers, std::move(all), marks_);
#else
  (void)out, (void)title, (void)layers;
#endif
}

void print_timeline(std::FILE* out, const std::string& title, int layers, std::vector<KernelRecord> all,
                    const std::vector<uint64_t>& marks) {
  std::sort(all.begin(), all.end(), [](const KernelRecord& a, const KernelRecord& b) { return a.start < b.start; });
  if (marks.empty()) return;
  // the steps' records, in start order
  std::vector<std::vector<KernelRecord>> steps(marks.size());
  for (const KernelRecord& r : all) {
    if (r.start < marks[0]) continue;
    const size_t s = size_t(std::upper_bound(marks.begin(), marks.end(), r.start) - marks.begin()) - 1;
    steps[s].push_back(r);
  }
  double span = 0, busy = 0, lead = 0, count = 0;
  std::map<std::string, Pos> by_name;
  std::vector<std::vector<double>> excl(steps.size()), gap(steps.size());
  for (size_t s = 0; s < steps.size(); ++s) {
    const auto& st = steps[s];
    if (st.empty()) continue;
    uint64_t frontier = st[0].start, last = 0;
    for (const KernelRecord& r : st) {
      const double e = r.end > std::max(r.start, frontier) ? double(r.end - std::max(r.start, frontier)) : 0.0;
      excl[s].push_back(e);
      gap[s].push_back(double(int64_t(r.start) - int64_t(frontier)));
      frontier = std::max(frontier, r.end);
      last = std::max(last, r.end);
      busy += e;
      Pos& p = by_name[r.name];
      p.name = r.name;
      p.dur += double(r.end - r.start);
      p.excl += e;
      ++p.n;
    }
    span += double(last - st[0].start);
    lead += double(st[0].start - marks[s]);
    count += double(st.size());
  }
  const double ns = double(steps.size());
  std::fprintf(out, "\n### kernels of a step: %s (%zu steps under CUPTI)\n\n", title.c_str(), steps.size());
  std::fprintf(out,
               "On the GPU a step spans %.3f ms from its first kernel's start to its last one's end; some kernel or copy "
               "runs for %.3f ms of it (their union) and nothing for %.3f ms; %.0f kernels and copies a step; the first "
               "starts %.1f us after the host began the step.\n\n",
               span / ns / 1e6, busy / ns / 1e6, (span - busy) / ns / 1e6, count / ns, lead / ns / 1e3);
  // by name, most exclusive time first
  std::vector<Pos> names;
  for (auto& [k, p] : by_name) names.push_back(p);
  std::sort(names.begin(), names.end(), [](const Pos& a, const Pos& b) { return a.excl > b.excl; });
  std::fprintf(out, "| kernel | per step | us each, start to end | us exclusive a step | share of the span |\n|---|---:|---:|---:|---:|\n");
  for (const Pos& p : names)
    std::fprintf(out, "| %s | %.1f | %.2f | %.1f | %.1f%% |\n", cell(p.name).c_str(), p.n / ns, p.dur / p.n / 1e3, p.excl / ns / 1e3,
                 100 * p.excl / span);
  // the sequence: every step must run the same kernels in the same order (graph replays do)
  const auto& s0 = steps[0];
  bool same = !s0.empty();
  for (const auto& st : steps) {
    same = same && st.size() == s0.size();
    for (size_t i = 0; same && i < st.size(); ++i) same = st[i].name == s0[i].name;
  }
  if (!same) {
    std::fprintf(out, "\n(the steps ran different kernel sequences: no per-layer view)\n");
    return;
  }
  auto at = [&](size_t i) {
    Pos p{s0[i].name, s0[i].grid, s0[i].block};
    for (size_t s = 0; s < steps.size(); ++s) {
      p.dur += double(steps[s][i].end - steps[s][i].start);
      p.excl += excl[s][i];
      p.gap += gap[s][i];
      ++p.n;
    }
    return p;
  };
  // The layers: the first kernel to run exactly `layers` times a step (up to its template
  // arguments) marks them, each window from one of its runs to the next being a layer (the
  // last one, running into the LM head, counts with the step's last kernels). Windows that run
  // the same kernels are averaged together: a Q4_K_M file holds some layers' matrices in 6-bit
  // blocks, which other GEMV variants (and sometimes more launches) read.
  auto base = [](const std::string& n) { return n.substr(0, n.find('<')); };
  std::map<std::string, std::vector<size_t>> where;
  for (size_t i = 0; i < s0.size(); ++i) where[base(s0[i].name)].push_back(i);
  std::vector<size_t> anchors;
  for (size_t i = 0; i < s0.size() && layers > 1 && anchors.empty(); ++i) {
    const auto& w = where[base(s0[i].name)];
    if (int(w.size()) == layers && w[0] == i) anchors = w;
  }
  const char* head = "| # | kernel | CTAs x threads | us start to end | us exclusive | us from the frontier to its start |\n|---:|---|---|---:|---:|---:|\n";
  auto excl_sum = [&](size_t a, size_t b) {
    double t = 0;
    for (size_t s = 0; s < steps.size(); ++s)
      for (size_t i = a; i < b; ++i) t += excl[s][i];
    return t / ns;
  };
  if (anchors.empty()) {
    std::fprintf(out, "\n(no kernel runs once a layer: the whole step in order)\n\n%s", head);
    std::vector<Pos> rows;
    for (size_t i = 0; i < s0.size(); ++i) rows.push_back(at(i));
    print_rows(out, rows, 0);
    return;
  }
  // the layer windows [anchors[j], anchors[j + 1]), grouped by their kernels
  std::vector<std::pair<std::vector<std::string>, std::vector<size_t>>> kinds;  // kernels, windows' starts
  for (size_t j = 0; j + 1 < anchors.size(); ++j) {
    std::vector<std::string> seq;
    for (size_t i = anchors[j]; i < anchors[j + 1]; ++i) seq.push_back(s0[i].name);
    auto it = std::find_if(kinds.begin(), kinds.end(), [&](const auto& k) { return k.first == seq; });
    if (it == kinds.end()) kinds.push_back({seq, {anchors[j]}});
    else it->second.push_back(anchors[j]);
  }
  std::fprintf(out,
               "\nIn order (a negative distance from the frontier: the kernel started before the kernels before it had "
               "finished, under programmatic dependent launch): the step's first %zu kernels (%.1f us exclusive); the "
               "%zu layers from one %s to the next (%.1f us exclusive in all), each kind of layer averaged over its "
               "layers; then the last layer's kernels and the rest (%.1f us exclusive).\n\n%s",
               anchors[0], excl_sum(0, anchors[0]) / 1e3, anchors.size() - 1, base(s0[anchors[0]].name).c_str(),
               excl_sum(anchors[0], anchors.back()) / 1e3, excl_sum(anchors.back(), s0.size()) / 1e3, head);
  std::vector<Pos> rows;
  for (size_t i = 0; i < anchors[0]; ++i) rows.push_back(at(i));
  print_rows(out, rows, 0);
  for (const auto& [seq, starts] : kinds) {
    rows.clear();
    double total = 0;
    for (size_t t = 0; t < seq.size(); ++t) {
      Pos p = at(starts[0] + t);
      for (size_t l = 1; l < starts.size(); ++l) {
        const Pos q = at(starts[l] + t);
        p.dur += q.dur, p.excl += q.excl, p.gap += q.gap, p.n += q.n;
      }
      total += p.excl / p.n;
      rows.push_back(p);
    }
    std::fprintf(out, "| | *%zu layer%s like this (the first from #%zu): %.1f us exclusive each* | | | | |\n", starts.size(),
                 starts.size() == 1 ? "" : "s", starts[0], total / 1e3);
    print_rows(out, rows, int(starts[0]));
  }
  rows.clear();
  for (size_t i = anchors.back(); i < s0.size(); ++i) rows.push_back(at(i));
  std::fprintf(out, "| | *the last layer and after it:* | | | | |\n");
  print_rows(out, rows, int(anchors.back()));
}

}  // namespace kvlm::bench
