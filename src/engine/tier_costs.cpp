#include "engine/tier_costs.h"

#include <cstdio>

#include "core/log.h"

namespace kvlm {

namespace {
double average(double avg, double x) { return avg > 0 ? 0.8 * avg + 0.2 * x : x; }
}  // namespace

void TierCosts::note_step(double seconds, int rows) {
  if (rows < kMinRows || !(seconds > 0)) return;
  per_row_ = average(per_row_, seconds / double(rows));
}

void TierCosts::note_restores(Tier t, double seconds, uint64_t pages) {
  Side& s = side(t);
  if (pages < s.last_pages || seconds < s.last_seconds) {  // totals started again: start again
    s = Side{.paid = s.paid, .assumed = s.assumed};
  }
  // The pages since the last figure, once there are enough of them to mean something.
  const uint64_t dp = pages - s.last_pages;
  if (dp < kMinIncrement) return;
  s.per_page = average(s.per_page, (seconds - s.last_seconds) / double(dp));
  s.pages += dp;
  s.last_pages = pages;
  s.last_seconds = seconds;
}

std::optional<double> TierCosts::recompute_per_page() const {
  if (assumed_recompute_ >= 0) return assumed_recompute_;
  if (!(per_row_ > 0)) return std::nullopt;
  return per_row_ * double(block_size_);
}

std::optional<double> TierCosts::restore_per_page(Tier t) const {
  const Side& s = side(t);
  if (s.assumed >= 0) return s.assumed;
  if (s.pages < kMinPages) return std::nullopt;
  return s.per_page;
}

bool TierCosts::pays(Tier t, bool probe) {
  std::optional<double> restore = restore_per_page(t);
  // A page from disk is read into host memory, then copied back from there.
  if (t == Tier::Disk && restore)
    if (const std::optional<double> host = restore_per_page(Tier::Host)) *restore += *host;
  const std::optional<double> recompute = recompute_per_page();
  Side& s = side(t);
  if (!restore || !recompute) return true;  // measured by using it
  // Apart by a margin either way, so that noise near the threshold does not flip it each step.
  const bool pays = s.paid ? *restore <= kOffAbove * *recompute : *restore <= kOnBelow * *recompute;
  if (pays != s.paid) {
    char line[240];
    std::snprintf(line, sizeof line,
                  "prefix cache: a page from the %s tier takes %.3f ms to bring back and %.3f ms to compute: %s",
                  t == Tier::Host ? "host" : "disk", *restore * 1e3, *recompute * 1e3,
                  pays ? "restoring pages again" : "computing their tokens instead");
    log::info(line);
    s.paid = pays;
  }
  // A tier that does not pay is tried again now and then (its figure moves only with use),
  // unless the figure is assumed.
  return pays || (probe && s.assumed < 0 && assumed_recompute_ < 0);
}

TierCosts::Use TierCosts::decide() {
  const bool probe = ++calls_ % kProbeEvery == 0;
  return {.host = pays(Tier::Host, probe), .disk = pays(Tier::Disk, probe)};
}

}  // namespace kvlm
