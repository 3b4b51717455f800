// Unit tests of perf/common/draft_tree.h: committed tokens of linear drafts
// and the two tree bounds, on hand-built teacher-forced positions.
#include "perf/common/draft_tree.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvxfer::perf {
namespace {

// rank 1 = the anchor's top-1 is the full-KV token.
std::vector<DraftPosition> run(const std::vector<int>& ranks, const std::vector<float>& margins) {
  std::vector<DraftPosition> p;
  for (std::size_t i = 0; i < ranks.size(); ++i) p.push_back({ranks[i], margins[i]});
  return p;
}

TEST(DraftTree, LinearCommitsTheAcceptedPrefixPlusOne) {
  const auto p = run({1, 1, 2, 1, 1}, {3, 3, 0.2f, 3, 3});
  EXPECT_EQ(linear_committed(p, 0, 5), 3);  // 2 accepted, then the verifier's token
  EXPECT_EQ(linear_committed(p, 0, 1), 2);  // the whole 1-token draft accepted
  EXPECT_EQ(linear_committed(p, 2, 3), 1);  // rejected at once
  EXPECT_EQ(linear_committed(p, 3, 2), 3);
}

TEST(DraftTree, MarginTreePaysKNodesWhereItBranches) {
  const auto p = run({1, 1, 2, 1, 1, 3}, {3, 0.1f, 0.2f, 3, 3, 0.1f});
  // theta 0.5, k 2: positions 1 and 2 cost 2 nodes each; position 2's token
  // is the anchor's second, so the tree passes it.
  EXPECT_EQ(tree_committed_bound(p, 0, 7, 0.5f, 2), 6);   // 1+2+2+1+1 = 7 nodes, depth 5
  EXPECT_EQ(tree_committed_bound(p, 0, 6, 0.5f, 2), 5);   // 6 nodes reach depth 4
  EXPECT_EQ(tree_committed_bound(p, 0, 4, 0.5f, 2), 3);   // at position 2 only top-1 fits
  EXPECT_EQ(tree_committed_bound(p, 0, 20, 0.5f, 2), 6);  // rank 3 at position 5 breaks it
  EXPECT_EQ(tree_committed_bound(p, 0, 20, 0.5f, 3), 7);  // k 3 holds it
  // A threshold below every margin is the linear draft.
  EXPECT_EQ(tree_committed_bound(p, 0, 6, 0.0f, 2), linear_committed(p, 0, 6));
}

TEST(DraftTree, OracleBranchesOnlyWhereTopOneIsWrong) {
  const auto p = run({1, 1, 2, 1, 4}, {3, 0.1f, 0.2f, 3, 3});
  EXPECT_EQ(oracle_committed_bound(p, 0, 5, 4), 5);   // 1+1+2+1 nodes, depth 4
  EXPECT_EQ(oracle_committed_bound(p, 0, 3, 4), 3);   // rank 2 does not fit in 1 node
  EXPECT_EQ(oracle_committed_bound(p, 0, 20, 3), 5);  // rank 4 beyond kmax 3
  EXPECT_EQ(oracle_committed_bound(p, 0, 20, 4), 6);
}

}  // namespace
}  // namespace kvxfer::perf
