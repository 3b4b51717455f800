// spectrum_quality's rows and their evaluation; see spectrum_quality.h.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "perf/spectrum_quality.h"
#include "tiers/spectrum_impl.h"

namespace spectrum_quality {

void attend(const Seq& s, const km::KVView& view, int l, float* out) {
  std::string err;
  const int n = view.n_tokens;
  for (int i = 0; i < s.nq; ++i)
    if (!km::attention(s.shape, view.layers[l], n,
                       s.queries.data() + (static_cast<size_t>(l) * s.nq + i) * s.qdim(), 0, 1,
                       n - 1, out + i * s.qdim(), &err))
      die(err);
}

void compute_reference(Seq* s) {
  const km::KVView v = s->kv.view();
  s->o_ref.resize(s->kv.n_layers());
  for (int l = 0; l < s->kv.n_layers(); ++l) {
    s->o_ref[l].resize(s->nq * s->qdim());
    attend(*s, v, l, s->o_ref[l].data());
  }
}

std::vector<uint8_t> tiers_for(const Row& r, int64_t n, const float* importance,
                               const PolicyParams& pp, uint64_t seed) {
  std::vector<uint8_t> t(static_cast<size_t>(n), KVXFER_TIER_DROP);
  const int sinks = r.sinks >= 0 ? r.sinks : pp.sinks;
  if (r.kind == Row::kPolicy) {
    kvxfer_spectrum_config_t c = KVXFER_SPECTRUM_CONFIG_INITIALIZER;
    c.budget = r.b;
    c.sink_tokens = sinks;
    c.lambda = pp.lambda;
    c.variant = r.variant;
    c.seed = seed;
    c.allow_int4 = r.allow_int4;
    if (kvxfer_spectrum_assign(&c, n, importance, t.data()) != KVXFER_SUCCESS)
      die(std::string("assign: ") + kvxfer_get_last_error());
    return t;
  }
  // Keep/drop: floor(U / 4) tokens at FP16 (4 units each, within the policy's U).
  const int64_t keep = ks::budget_units(r.b, n) / 4;
  if (r.kind == Row::kPdtrim) {
    const int64_t first = std::min<int64_t>(keep, std::llround(pp.pdtrim_first * keep));
    for (int64_t j = 0; j < first; ++j) t[j] = KVXFER_TIER_FP16;
    for (int64_t j = n - (keep - first); j < n; ++j) t[j] = KVXFER_TIER_FP16;
    return t;
  }
  const int64_t s0 = std::min<int64_t>(sinks, keep);
  for (int64_t j = 0; j < s0; ++j) t[j] = KVXFER_TIER_FP16;
  if (r.kind == Row::kRecent) {
    for (int64_t j = std::max(s0, n - (keep - s0)); j < n; ++j) t[j] = KVXFER_TIER_FP16;
  } else {
    const std::vector<int64_t> order = ks::importance_order(importance, s0, n);
    for (int64_t k = 0; k < keep - s0; ++k) t[order[k]] = KVXFER_TIER_FP16;
  }
  return t;
}

// The KV of `kv` after row r's transfer (kFull: none, the KV itself).
void transfer(const Row& r, const km::KVCache& kv, const float* importance, const PolicyParams& pp,
              uint64_t seed, ks::TransferredKV* tk, std::vector<uint8_t>* tiers) {
  std::string err;
  kvxfer_codec_config_t cc = KVXFER_CODEC_CONFIG_INITIALIZER;
  cc.codec = r.codec;
  tiers->clear();
  if (r.kind != Row::kUniform) *tiers = tiers_for(r, kv.n_tokens(), importance, pp, seed);
  if (!ks::transfer_kv(kv, cc, tiers->empty() ? nullptr : tiers->data(), false, tk, &err))
    die(r.name + ": " + err);
}

Acc eval(const Row& r, const Seq& s, const PolicyParams& pp, uint64_t seed) {
  Acc a;
  std::string err;
  ks::TransferredKV tk;
  std::vector<uint8_t> tiers;
  transfer(r, s.kv, s.importance.data(), pp, seed, &tk, &tiers);
  for (uint8_t t : tiers) a.tiers[t] += 1;
  a.bytes = static_cast<double>(tk.anchor_bytes + tk.residual_bytes);
  a.fp16_bytes = 2.0 * 2.0 * s.kv.n_layers() * s.kv.n_tokens() * s.kv.kv_dim();
  const km::KVView view = tk.view();
  std::vector<float> out(s.nq * s.qdim());
  for (int l = 0; l < s.kv.n_layers(); ++l) {
    attend(s, view, l, out.data());
    for (size_t i = 0; i < out.size(); ++i) {
      const double d = static_cast<double>(out[i]) - s.o_ref[l][i];
      a.se += d * d;
      a.norm += static_cast<double>(s.o_ref[l][i]) * s.o_ref[l][i];
    }
  }
  if (s.model != nullptr && s.cont != nullptr) {
    double nll = 0;
    int agree = 0;
    if (!ks::score_view(*s.model, *s.cont, view, &agree, &nll, &err)) die(err);
    a.agree = agree;
    a.positions = static_cast<int>(s.cont->feed.size());
    a.nll = nll;
    a.nll_full = s.cont->nll_full;
    if (!ks::score_prefix_view(*s.model, *s.cont, view, &a.nll_seq, &err)) die(r.name + ": " + err);
    a.nll_seq_full = s.nll_prefix_full;
    a.seq_positions = static_cast<int>(s.cont->prefix.size());
  }
  return a;
}

Row policy_row(const char* name, double b, kvxfer_spectrum_variant_t v, int int4, int sinks = -1) {
  Row r;
  r.name = name;
  r.b = b;
  r.variant = v;
  r.allow_int4 = int4;
  r.sinks = sinks;
  return r;
}

Row keep_drop_row(const char* name, double b, Row::Kind k) {
  Row r;
  r.name = name;
  r.b = b;
  r.kind = k;
  return r;
}

Row uniform_row(kvxfer_codec_t c) {
  Row u;
  u.kind = Row::kUniform;
  u.codec = c;
  u.name = c == KVXFER_CODEC_INT8 ? "INT8" : "INT4";
  u.b = c == KVXFER_CODEC_INT8 ? 0.5 : 0.25;
  return u;
}

// adaptive_int4 < 0: no probe for this data set (no Adaptive row).
std::vector<Row> make_rows(const std::vector<double>& budgets, int adaptive_int4) {
  std::vector<Row> rows;
  for (double b : budgets) {
    rows.push_back(policy_row("Greedy", b, KVXFER_SPECTRUM_GREEDY, 1, 0));
    rows.push_back(policy_row("SinkProtect", b, KVXFER_SPECTRUM_GREEDY, 1));
    if (adaptive_int4 >= 0)
      rows.push_back(policy_row("Adaptive", b, KVXFER_SPECTRUM_GREEDY, adaptive_int4));
    rows.push_back(policy_row("2-Tier", b, KVXFER_SPECTRUM_GREEDY, 0));
    rows.push_back(policy_row("Recency", b, KVXFER_SPECTRUM_SINK_PROTECT, 1));
    rows.push_back(policy_row("Balanced", b, KVXFER_SPECTRUM_BALANCED, 1));
    rows.push_back(policy_row("Random", b, KVXFER_SPECTRUM_RANDOM, 1));
    rows.push_back(keep_drop_row("PDTrim", b, Row::kPdtrim));
    rows.push_back(keep_drop_row("Recent", b, Row::kRecent));
    rows.push_back(keep_drop_row("TopImp", b, Row::kTopImp));
  }
  rows.push_back(uniform_row(KVXFER_CODEC_INT8));
  rows.push_back(uniform_row(KVXFER_CODEC_INT4));
  return rows;
}

// NIAH rows: the paper's Table 4 methods and ours.
std::vector<Row> make_niah_rows(const std::vector<double>& budgets, int adaptive_int4) {
  std::vector<Row> rows;
  Row f;
  f.name = "Full";
  f.b = 1;
  f.kind = Row::kFull;
  rows.push_back(f);
  for (double b : budgets) {
    rows.push_back(policy_row("Greedy", b, KVXFER_SPECTRUM_GREEDY, 1, 0));
    rows.push_back(policy_row("SinkProtect", b, KVXFER_SPECTRUM_GREEDY, 1));
    rows.push_back(policy_row("Adaptive", b, KVXFER_SPECTRUM_GREEDY, adaptive_int4));
    rows.push_back(policy_row("2-Tier", b, KVXFER_SPECTRUM_GREEDY, 0));
    rows.push_back(keep_drop_row("PDTrim", b, Row::kPdtrim));
    rows.push_back(keep_drop_row("TopImp", b, Row::kTopImp));
  }
  rows.push_back(uniform_row(KVXFER_CODEC_INT8));
  rows.push_back(uniform_row(KVXFER_CODEC_INT4));
  return rows;
}

}  // namespace spectrum_quality
