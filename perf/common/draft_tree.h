// perf/common/draft_tree: committed tokens per verification pass of a linear
// draft and of token trees, counted on teacher-forced positions (issue 19's
// first measurement; docs/SPEC.md "Tree drafting: the bound").
//
// Position j of a teacher-forced run holds the anchor KV's logits after the
// full-KV greedy tokens before j.  A draft that has stayed on the full-KV
// greedy path up to j (any accepted draft has) sees exactly these logits, so
// whether each draft holds the full-KV token at j is known from them alone.
//
// Committed tokens of a pass = accepted draft depth + 1 (greedy verification
// always adds the verifier's own token at the first rejected node, or after
// the last node).  A pass verifies `budget` nodes.  Thread-safe (pure).
#pragma once

#include <cstddef>
#include <vector>

namespace kvxfer::perf {

// One teacher-forced position of a draft on the anchor KV.
struct DraftPosition {
  int rank = 1;         // 1-based rank of the full-KV greedy token among the anchor's logits
  float margin = 0.0f;  // anchor's top-1 minus top-2 logit
};

// A linear draft of `budget` tokens from position s: the anchor's top-1 at
// each position; accepted while it equals the full-KV token.
inline int linear_committed(const std::vector<DraftPosition>& p, std::size_t s, int budget) {
  int depth = 0;
  while (depth < budget && s + depth < p.size() && p[s + depth].rank == 1) ++depth;
  return depth + 1;
}

// An upper bound on a margin tree (issue 19's design: where the anchor's
// margin is below `theta`, branch to its top-k).  Along the full-KV path the
// tree holds top-1, or top-k where the margin is below theta; each candidate
// costs one node, and the wrong candidates' greedy continuations cost none.
// A real tree also pays for those continuations, so it commits at most this.
inline int tree_committed_bound(const std::vector<DraftPosition>& p, std::size_t s, int budget,
                                float theta, int k) {
  int nodes = 0, depth = 0;
  for (std::size_t j = s; j < p.size(); ++j) {
    const int want = p[j].margin < theta ? k : 1;
    const int held = want < budget - nodes ? want : budget - nodes;
    if (held <= 0) break;
    nodes += held;
    if (p[j].rank > held) break;
    ++depth;
  }
  return depth + 1;
}

// An upper bound on any tree whose candidates at a position are the anchor's
// top-ranked tokens (at most kmax): an oracle branches only where top-1 is
// wrong, holding exactly the candidates down to the full-KV token.
inline int oracle_committed_bound(const std::vector<DraftPosition>& p, std::size_t s, int budget,
                                  int kmax) {
  int nodes = 0, depth = 0;
  for (std::size_t j = s; j < p.size(); ++j) {
    if (p[j].rank > kmax || nodes + p[j].rank > budget) break;
    nodes += p[j].rank;
    ++depth;
  }
  return depth + 1;
}

}  // namespace kvxfer::perf
