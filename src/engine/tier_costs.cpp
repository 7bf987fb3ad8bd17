#include "engine/tier_costs.h"

#include <cstdio>

#include "core/log.h"

namespace kvlm {

void TierCosts::note_step(double seconds, int rows) {
  if (rows < kMinRows || !(seconds > 0)) return;
  const double r = seconds / double(rows);
  per_row_ = per_row_ > 0 ? 0.8 * per_row_ + 0.2 * r : r;
}

void TierCosts::note_restores(Tier t, double seconds, uint64_t pages) {
  Side& s = side(t);
  s.seconds = seconds;
  s.pages = pages;
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
  return s.seconds / double(s.pages);
}

bool TierCosts::pays(Tier t, bool probe) {
  std::optional<double> restore = restore_per_page(t);
  // A page from disk is read into host memory, then copied back from there.
  if (t == Tier::Disk && restore)
    if (const std::optional<double> host = restore_per_page(Tier::Host)) *restore += *host;
  const std::optional<double> recompute = recompute_per_page();
  const bool pays = probe || !restore || !recompute || *restore <= *recompute;
  Side& s = side(t);
  if (!probe && restore && recompute && pays != s.paid) {
    char line[240];
    std::snprintf(line, sizeof line, "prefix cache: a page from the %s tier takes %.3f ms to bring back and %.3f ms to compute: %s",
                  t == Tier::Host ? "host" : "disk", *restore * 1e3, *recompute * 1e3,
                  pays ? "restoring it again" : "computing its tokens instead");
    log::info(line);
    s.paid = pays;
  }
  return pays;
}

TierCosts::Use TierCosts::decide() {
  const bool probe = ++calls_ % kProbeEvery == 0;
  return {.host = pays(Tier::Host, probe), .disk = pays(Tier::Disk, probe)};
}

}  // namespace kvlm
