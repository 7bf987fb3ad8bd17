#include "engine/ngram_proposer.h"

#include <algorithm>

#include "core/host_threads.h"

namespace kvlm {

std::vector<TokenId> ngram_lookup(std::span<const TokenId> tokens, int min_n, int max_n, int k) {
  const int L = int(tokens.size());
  if (k < 1 || min_n < 1 || L < min_n + 1) return {};
  const TokenId last = tokens[size_t(L - 1)];
  // Every earlier position e holding the last token ends a candidate match; extend it
  // backwards (at most max_n tokens) and keep the longest, the earliest on ties.
  int best_len = 0, best_end = -1;
  for (int e = 0; e < L - 1; ++e) {
    if (tokens[size_t(e)] != last) continue;
    int m = 1;
    while (m < max_n && m <= e && tokens[size_t(e - m)] == tokens[size_t(L - 1 - m)]) ++m;
    if (m > best_len) {
      best_len = m;
      best_end = e;
      if (m == max_n) break;  // nothing longer counts
    }
  }
  if (best_len < min_n) return {};
  const int from = best_end + 1, to = std::min(L, from + k);
  return {tokens.begin() + from, tokens.begin() + to};
}

void NgramProposer::propose(std::span<Sequence* const> seqs, std::span<const int> max_draft) {
  const int n = int(seqs.size());
#pragma omp parallel for schedule(dynamic, 4) num_threads(host_threads::team()) if (n > 8)
  for (int i = 0; i < n; ++i) {
    Sequence& s = *seqs[size_t(i)];
    s.draft = ngram_lookup(s.tokens, min_n_, max_n_, std::min(k_, max_draft[size_t(i)]));
  }
}

}  // namespace kvlm
