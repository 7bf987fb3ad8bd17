// Whether the prefix cache's lower tiers pay: copying a page back from host memory
// (host_kv_tier.h) or reading it from disk (disk_kv_tier.h) against computing its tokens again.
// Both sides are measured as the engine runs, as moving averages: a page's restore from the
// copies' own times (the runner's events on a GPU, the disk readers' busy time), a page's
// recompute from the steps that computed many prompt rows (seconds per row, the page copies
// that ran inside the step taken out, times the page's tokens). A prefix hit and a preempted
// sequence's resume both take pages from a tier only while it pays; otherwise their tokens are
// computed again. Until a side has been measured the tier is used (the measurement needs it);
// the decision flips only past a margin (kOffAbove, kOnBelow), and a tier found not to pay is
// used again for one schedule in kProbeEvery, so that its figure follows the disk and the load.
// On every device measured so far restores win by one to two orders of magnitude; what this
// catches is a slow disk (a network mount, a throttled volume) under a fast GPU.
#pragma once

#include <cstdint>
#include <optional>

namespace kvlm {

class TierCosts {
 public:
  enum class Tier { Host, Disk };
  explicit TierCosts(int block_size) : block_size_(block_size) {}

  // A step that computed `rows` rows, most of them prompt rows (the caller's check), in
  // `seconds`. Steps of fewer than kMinRows rows cost per row what a prefill does not, and are
  // ignored.
  void note_step(double seconds, int rows);
  // A tier's cumulative restore time and pages so far (the totals, not the increments; pages
  // of another size counted in pages' worth of bytes).
  void note_restores(Tier t, double seconds, uint64_t pages);
  // Which tiers' pages are to be taken now; called once per schedule (the probe's clock).
  struct Use {
    bool host = true, disk = true;
  };
  Use decide();

  // A figure in place of a side's measurement, seconds per page (tests; < 0: measure again).
  void assume(Tier t, double seconds_per_page) { side(t).assumed = seconds_per_page; }
  void assume_recompute(double seconds_per_page) { assumed_recompute_ = seconds_per_page; }

  std::optional<double> recompute_per_page() const;   // seconds; none until measured
  // Seconds; a disk page's read alone (its copy back from host memory is the host's).
  std::optional<double> restore_per_page(Tier t) const;

  static constexpr int kMinRows = 256;
  static constexpr uint64_t kMinPages = 16;     // pages restored before a tier's cost is believed
  static constexpr uint64_t kMinIncrement = 4;  // pages per sample of the moving average
  static constexpr uint64_t kProbeEvery = 256;
  static constexpr double kOffAbove = 1.25, kOnBelow = 0.8;  // restore / recompute

 private:
  struct Side {
    double per_page = 0;  // moving average (0: none yet)
    uint64_t pages = 0;   // pages averaged
    double last_seconds = 0;
    uint64_t last_pages = 0;  // the totals of the last sample
    bool paid = true;         // the last decision (logged when it changes)
    double assumed = -1;
  };
  bool pays(Tier t, bool probe);
  Side& side(Tier t) { return t == Tier::Host ? host_ : disk_; }
  const Side& side(Tier t) const { return t == Tier::Host ? host_ : disk_; }

  int block_size_;
  double per_row_ = 0;  // moving average, seconds per row of prefill-sized steps (0: none yet)
  double assumed_recompute_ = -1;
  Side host_, disk_;
  uint64_t calls_ = 0;
};

}  // namespace kvlm
