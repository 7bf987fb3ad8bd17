// The kernels of a decode step on the GPU's own clock, from CUPTI's activity records: which
// kernels a step runs, in what order, how long each takes and how much of the step each one
// holds the GPU alone. Nsight Systems is not available on the benchmark machines, and the
// step's time outside its GEMVs (norms, RoPE, attention, launches: issue 50's batch-1 gap) can
// only be divided among its ~300 kernels this way.
//
//   KernelTimeline tl;            // CUPTI's kernel, copy and memset records on from here on
//   ... warm-up steps ...         // (CUDA graphs captured now are traced when replayed)
//   for each timed step: tl.mark(); step();
//   tl.report(stdout, title, layers);
//
// Without CUPTI at build time (KVLM_HAVE_CUPTI undefined) available() is false and the rest
// does nothing.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace kvlm::bench {

struct KernelRecord {
  std::string name;  // demangled, namespaces and parameter list dropped; copies as "[memcpy HtoD]"
  uint64_t start = 0, end = 0;  // ns, CUPTI's clock
  int grid = 0, block = 0;      // CTAs and threads per CTA (0 for copies)
};

class KernelTimeline {
 public:
  // Whether CUPTI was built in; a failure to start it is reported by the constructor.
  static bool available();
  KernelTimeline();  // starts recording (throws if CUPTI refuses)
  ~KernelTimeline();
  KernelTimeline(const KernelTimeline&) = delete;
  KernelTimeline& operator=(const KernelTimeline&) = delete;

  // A step begins now: records that start after this mark (and before the next) are its own.
  void mark();
  // Stops recording and prints, for the marked steps: the step's span on the GPU, the time
  // some kernel ran (their union) and the idle rest; then the kernels in their order, the
  // step's first kernels, one layer (its kernels averaged over every layer whose sequence is
  // the same) and the last ones, each with its time start to end and its exclusive time (how
  // far it moved the step's end past the kernels before it: the exclusive times sum to the
  // union). `layers`: the model's layer count, to find the layers' period.
  void report(std::FILE* out, const std::string& title, int layers);

 private:
  std::vector<uint64_t> marks_;
  bool stopped_ = false;
};

// report()'s analysis of given records and step marks (for tests; report() passes CUPTI's).
void print_timeline(std::FILE* out, const std::string& title, int layers, std::vector<KernelRecord> records,
                    const std::vector<uint64_t>& marks);

}  // namespace kvlm::bench
