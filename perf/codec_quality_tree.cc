// codec_quality --tree-study: where the anchor draft fails, and the committed
// tokens per verification pass of linear drafts and token trees (docs/SPEC.md,
// "Tree drafting: the bound").
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "perf/codec_quality.h"
#include "perf/common/draft_tree.h"

namespace codec_quality {

struct StudyPrompt {
  std::vector<kp::DraftPosition> pos;  // anchor rank of the full token, anchor margin
  std::vector<float> full_margin;      // the verifier's margin at the same positions
};

// The anchor KV of the default codec (KVXFER_CODEC_CONFIG_INITIALIZER: what
// disagg_demo sends), teacher-forced on the verifier's greedy tokens:
// decoding on the codec's full KV (anchor + residual) from the prompt's last
// token, so position j holds what a draft still on the verifier's path sees.
StudyPrompt study_prompt(const km::Model& m, const GreedyCase& g, int steps, uint64_t stream) {
  const CodedKV c = code_kv(RowSpec{}, g.kv, stream);
  const GreedyRun verifier = greedy_decode(m, c.full, g.last, steps);
  StudyPrompt sp;
  sp.full_margin = verifier.margin;
  km::KVCache tail;
  std::vector<float> logits;
  std::string err;
  if (!m.verify(verifier.feed, c.anchor.n_tokens, c.anchor, &tail, &logits, &err)) die(err);
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  for (size_t j = 0; j < verifier.feed.size(); ++j) {
    const float* lg = logits.data() + j * V;
    const int ref = verifier.ref[j];
    float margin = 0;
    top_with_margin(lg, V, &margin);
    int rank = 1;  // ties rank as argmax does: the lower index first
    for (size_t i = 0; i < V; ++i)
      if (lg[i] > lg[ref] || (lg[i] == lg[ref] && static_cast<int>(i) < ref)) ++rank;
    sp.pos.push_back({rank, margin});
  }
  return sp;
}

void run_tree_study(const std::string& dataset, const km::Model& m,
                    const std::vector<GreedyCase>& cases, int steps, json* out) {
  std::vector<StudyPrompt> sps(cases.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < cases.size(); ++i) sps[i] = study_prompt(m, cases[i], steps, 1000 + i);
  int n = 0, dis = 0;
  std::map<int, int> rank_hist;  // at the disagreements: 2, 3, 4, 5 (= more than 4)
  for (const StudyPrompt& sp : sps) {
    for (const kp::DraftPosition& d : sp.pos) {
      ++n;
      if (d.rank > 1) {
        ++dis;
        ++rank_hist[std::min(d.rank, 5)];
      }
    }
  }
  std::printf(
      "# tree study: %s, the default codec's anchor KV (Lynx, C 32, 4-bit anchor, 1 sink row), "
      "teacher-forced on the verifier's greedy tokens: %d positions over %zu prompts, "
      "%d disagreements (anchor agreement %.4f)\n",
      dataset.c_str(), n, sps.size(), dis, n > 0 ? 1.0 - static_cast<double>(dis) / n : 0.0);
  std::printf(
      "# rank of the verifier's token among the anchor's logits at the disagreements: "
      "2: %d, 3: %d, 4: %d, >4: %d\n",
      rank_hist[2], rank_hist[3], rank_hist[4], rank_hist[5]);
  std::printf(
      "# margin as a predictor (top-1 minus top-2 logit): below theta, the share of positions "
      "(branch), the share of the disagreements there (recall), and agreement at or above "
      "theta; anchor = what the drafter sees, full = the verifier's own margin\n");
  std::printf("#  theta  branch_a  recall_a  agree_above_a  branch_f  recall_f\n");
  json jpred = json::array();
  for (float th : {0.1f, 0.25f, 0.5f, 1.0f, 2.0f}) {
    int below_a = 0, dis_below_a = 0, above_a = 0, agree_above_a = 0, below_f = 0, dis_below_f = 0;
    for (const StudyPrompt& sp : sps)
      for (size_t j = 0; j < sp.pos.size(); ++j) {
        const bool wrong = sp.pos[j].rank > 1;
        if (sp.pos[j].margin < th) {
          ++below_a;
          dis_below_a += wrong;
        } else {
          ++above_a;
          agree_above_a += !wrong;
        }
        if (sp.full_margin[j] < th) {
          ++below_f;
          dis_below_f += wrong;
        }
      }
    const auto share = [](int a, int b) { return b > 0 ? static_cast<double>(a) / b : 0.0; };
    std::printf("#  %5.2f  %8.3f  %8.3f  %13.4f  %8.3f  %8.3f\n", th, share(below_a, n),
                share(dis_below_a, dis), share(agree_above_a, above_a), share(below_f, n),
                share(dis_below_f, dis));
    jpred.push_back({{"theta", std::round(th * 100.0) / 100.0},  // 0.1, not 0.100000001
                     {"branch_anchor", share(below_a, n)},
                     {"recall_anchor", share(dis_below_a, dis)},
                     {"agree_above_anchor", share(agree_above_a, above_a)},
                     {"branch_full", share(below_f, n)},
                     {"recall_full", share(dis_below_f, dis)}});
  }
  std::printf(
      "# committed tokens per verification pass of B nodes (accepted + 1), mean over windows "
      "starting at every position that leaves B more: linear = the anchor's greedy draft; "
      "tree = the best margin tree (branch to the anchor's top-k where its margin < theta; "
      "theta 0.1-2, k 2-4), bounded from above: wrong candidates cost one node each and "
      "their continuations none; oracle = branches only where top-1 is wrong, the top-k "
      "down to the right token (k <= 4)\n");
  kp::Table table({{"B", 3},
                   {"windows", 7},
                   {"linear", 7},
                   {"tree", 7},
                   {"theta", 5},
                   {"k", 2},
                   {"x_lin", 5},
                   {"oracle", 7},
                   {"x_lin", 5},
                   {"B+1", 4}});
  std::printf("%s\n", table.header().c_str());
  json jb = json::array();
  for (int B : {4, 8, 16, 32, 64, 128}) {
    double lin = 0, orc = 0;
    int windows = 0;
    std::map<std::pair<float, int>, double> tree;
    for (const StudyPrompt& sp : sps)
      for (size_t s = 0; s + B <= sp.pos.size(); ++s) {
        ++windows;
        lin += kp::linear_committed(sp.pos, s, B);
        orc += kp::oracle_committed_bound(sp.pos, s, B, 4);
        for (float th : {0.1f, 0.25f, 0.5f, 1.0f, 2.0f})
          for (int k : {2, 3, 4}) tree[{th, k}] += kp::tree_committed_bound(sp.pos, s, B, th, k);
      }
    if (windows == 0) {
      std::printf("# B = %d: no window (needs --greedy-steps >= %d)\n", B, B);
      continue;
    }
    auto best = tree.begin();
    for (auto it = tree.begin(); it != tree.end(); ++it)
      if (it->second > best->second) best = it;
    const double w = windows;
    std::printf(
        "%s\n",
        table
            .row({std::to_string(B), std::to_string(windows), kp::strprintf("%.2f", lin / w),
                  kp::strprintf("%.2f", best->second / w), kp::strprintf("%g", best->first.first),
                  std::to_string(best->first.second), kp::strprintf("%.3f", best->second / lin),
                  kp::strprintf("%.2f", orc / w), kp::strprintf("%.3f", orc / lin),
                  std::to_string(B + 1)})
            .c_str());
    json jt = json::array();
    for (const auto& [key, v] : tree)
      jt.push_back({{"theta", std::round(key.first * 100.0) / 100.0},
                    {"k", key.second},
                    {"committed", v / w}});
    jb.push_back({{"budget", B},
                  {"windows", windows},
                  {"linear", lin / w},
                  {"oracle", orc / w},
                  {"tree", jt}});
  }
  (*out)[dataset] = {
      {"positions", n},
      {"disagreements", dis},
      {"rank_at_disagreements",
       {{"2", rank_hist[2]}, {"3", rank_hist[3]}, {"4", rank_hist[4]}, {">4", rank_hist[5]}}},
      {"predictor", jpred},
      {"budgets", jb}};
}

}  // namespace codec_quality
