// kvxfer_perf's report; see xfer_report.h.
#include "perf/common/xfer_report.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

namespace kvxfer::perf {

using nlohmann::json;

Report::Report(int check, const Plan& p)
    : check_(check),
      p_(p),
      table_({{"size(B)", 10},
              {"tokens", 6},
              {"pages", 6},
              {"codec", 8},
              {"mode", 4},
              {"params", 16},
              {"anchor(B)", 10},
              {"wire(B)", 10},
              {"t_anchor(us)", 10},
              {"t_complete(us)", 10},
              {"algbw(GB/s)", 6},
              {"wirebw(GB/s)", 6},
              {"#wrong", 6}}) {
  rows_.resize(p.sizes.size() * p.codecs.size());
}

void Report::header() {
  std::printf("%s\n", table_.header().c_str());
  std::fflush(stdout);
}

/** One batch as the receiver saw it; t_send_post: the sender's first post (0 if unknown). */
void Report::add(size_t si, size_t ci, int it, const Batch& b, int64_t t_send_post) {
  Row& row = rows_[si * p_.codecs.size() + ci];
  if (!b.h.ok) {
    failed_ = true;
    return;
  }
  const int64_t t0 = std::max(b.h.t_last_post, t_send_post);
  int64_t ta = 0, tc = 0, first_res = 0;
  for (const RecvReq& q : b.reqs) {
    ta = std::max(ta, q.t_anchor);
    tc = std::max(tc, q.t_complete);
    if (q.t_first_residual > 0 && (first_res == 0 || q.t_first_residual < first_res))
      first_res = q.t_first_residual;
  }
  if (!b.reqs.empty()) {
    const RecvReq& q = b.reqs[0];
    row.pages = q.num_pages;
    row.kv_bytes = q.kv_bytes;
    row.anchor_wire = q.anchor_wire;
    row.wire = q.anchor_wire + q.residual_wire;
  }
  if (b.h.wrong >= 0) {
    row.wrong = std::max<int64_t>(row.wrong, 0) + b.h.wrong;
    ++batches_checked_;
  }
  const double ta_us = static_cast<double>(ta - t0) * 1e-3;
  const double tc_us = static_cast<double>(tc - t0) * 1e-3;
  json sample = {{"iteration", it},
                 {"timed", it >= p_.warmup},
                 {"t_anchor_us", ta_us},
                 {"t_complete_us", tc_us},
                 {"t0_ns", t0},
                 {"t_send_post_ns", t_send_post == 0 ? json(nullptr) : json(t_send_post)},
                 {"t_recv_last_post_ns", b.h.t_last_post},
                 {"wrong", b.h.wrong < 0 ? json(nullptr) : json(b.h.wrong)}};
  json reqs = json::array();
  for (const RecvReq& q : b.reqs)
    reqs.push_back({{"t_posted_ns", q.t_posted},
                    {"t_handshake_ns", q.t_handshake},
                    {"t_anchor_ready_ns", q.t_anchor},
                    {"t_complete_ns", q.t_complete},
                    {"t_first_residual_ns", q.t_first_residual},
                    {"anchor_wire_bytes", q.anchor_wire},
                    {"residual_wire_bytes", q.residual_wire}});
  sample["requests"] = reqs;
  if (first_res > 0) {
    // Progressive: did every request reach ANCHOR_READY before the first
    // residual of any of them began to be applied?
    const double margin_us = static_cast<double>(first_res - ta) * 1e-3;
    sample["anchors_first_margin_us"] = margin_us;
    ++af_batches_;
    if (first_res >= ta) ++af_ok_;
    if (af_batches_ == 1 || margin_us < af_worst_us_) af_worst_us_ = margin_us;
  }
  row.samples.push_back(sample);
  if (it >= p_.warmup) {
    row.ta.push_back(ta_us);
    row.tc.push_back(tc_us);
  }
  const CodecCase& cc = p_.codecs[ci];
  const bool lynx_prog = cc.cfg.codec == KVXFER_CODEC_LYNX && cc.mode == KVXFER_MODE_PROGRESSIVE;
  const int rank = lynx_prog ? 2 : cc.mode == KVXFER_MODE_PROGRESSIVE ? 1 : 0;
  if (!b.arrivals.empty() && rank >= timeline_rank_) {
    timeline_rank_ = rank;
    json arr = json::array();
    for (const ArrivalRec& a : b.arrivals)
      arr.push_back({{"t_us", static_cast<double>(a.t_ns - t0) * 1e-3},
                     {"class", a.traffic_class == 0 ? "anchor" : "residual"},
                     {"layer", a.layer},
                     {"request", a.request},
                     {"bytes", a.bytes}});
    json marks = json::array();
    for (const RecvReq& q : b.reqs)
      marks.push_back(
          {{"t_anchor_ready_us", static_cast<double>(q.t_anchor - t0) * 1e-3},
           {"t_complete_us", static_cast<double>(q.t_complete - t0) * 1e-3},
           {"t_first_residual_us", q.t_first_residual > 0
                                       ? json(static_cast<double>(q.t_first_residual - t0) * 1e-3)
                                       : json(nullptr)}});
    timeline_ = {{"codec", codec_name(cc.cfg.codec)},
                 {"mode", mode_name(cc.mode)},
                 {"name", cc.name},
                 {"size_bytes", p_.sizes[si].kv_bytes},
                 {"tokens", p_.sizes[si].tokens},
                 {"requests", b.reqs.size()},
                 {"iteration", it},
                 {"t_anchor_us", ta_us},
                 {"t_complete_us", tc_us},
                 {"arrivals", arr},
                 {"per_request", marks}};
  }
}

/** Prints the row of (si, ci) once all its iterations are in. */
void Report::finish_row(size_t si, size_t ci) {
  Row& row = rows_[si * p_.codecs.size() + ci];
  if (row.tc.empty()) return;
  const CodecCase& cc = p_.codecs[ci];
  const SizePoint& sp = p_.sizes[si];
  row.sta = summarize(row.ta);
  row.stc = summarize(row.tc);
  row.done = true;
  const double R = p_.requests;
  const double alg = gbps(R * static_cast<double>(sp.kv_bytes), row.stc.median_us);
  const double wire = gbps(R * static_cast<double>(row.wire), row.stc.median_us);
  if (row.wrong > 0) wrong_total_ += static_cast<uint64_t>(row.wrong);
  std::printf("%s\n",
              table_
                  .row({std::to_string(sp.kv_bytes), std::to_string(sp.tokens),
                        std::to_string(row.pages), codec_name(cc.cfg.codec), mode_name(cc.mode),
                        cc.params, std::to_string(row.anchor_wire), std::to_string(row.wire),
                        strprintf("%.1f", row.sta.median_us), strprintf("%.1f", row.stc.median_us),
                        strprintf("%.2f", alg), strprintf("%.2f", wire),
                        row.wrong < 0 ? "N/A" : std::to_string(row.wrong)})
                  .c_str());
  std::fflush(stdout);
  jrows_.push_back({{"size_requested", sp.requested},
                    {"kv_bytes", sp.kv_bytes},
                    {"tokens", sp.tokens},
                    {"pages", row.pages},
                    {"requests", p_.requests},
                    {"name", cc.name},
                    {"codec", codec_name(cc.cfg.codec)},
                    {"mode", mode_name(cc.mode)},
                    {"params", cc.params},
                    {"config",
                     {{"alpha", cc.cfg.alpha},
                      {"chunk_tokens", cc.cfg.chunk_tokens},
                      {"anchor_bits", cc.cfg.anchor_bits}}},
                    {"anchor_wire_bytes", row.anchor_wire},
                    {"residual_wire_bytes", row.wire - row.anchor_wire},
                    {"wire_bytes", row.wire},
                    {"t_anchor", perf::to_json(row.sta)},
                    {"t_complete", perf::to_json(row.stc)},
                    {"algbw_gbps", alg},
                    {"wirebw_gbps", wire},
                    {"wrong", row.wrong < 0 ? json(nullptr) : json(row.wrong)},
                    {"samples", row.samples}});
}

/** Ratio lines, the anchors-first line and the footer.  Returns the exit status. */
int Report::footer(bool run_failed) {
  // Lynx progressive, then SpectrumKV (kvxfer_send's default policy) when -m
  // has it: t_anchor and t_complete over INT8 monolithic's t_complete.
  json ratios = json::array();
  for (const kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_SPECTRUM}) {
    const std::string name = codec == KVXFER_CODEC_LYNX ? "lynx" : "spectrum";
    bool header_done = false;
    for (size_t si = 0; si < p_.sizes.size(); ++si) {
      const Row* r = find(si, codec, KVXFER_MODE_PROGRESSIVE);
      const Row* int8 = find(si, KVXFER_CODEC_INT8, KVXFER_MODE_MONOLITHIC);
      if (r == nullptr || int8 == nullptr || int8->stc.median_us <= 0) continue;
      const double ra = r->sta.median_us / int8->stc.median_us;
      const double rc = r->stc.median_us / int8->stc.median_us;
      if (!header_done) {
        std::printf(
            "# Ratios to INT8 monolithic (medians, same size): t_anchor(%s)/t_complete(int8)  "
            "t_complete(%s)/t_complete(int8)\n",
            name.c_str(), name.c_str());
        header_done = true;
      }
      std::printf("#   %10" PRIu64 " B: %.3f  %.3f\n", p_.sizes[si].kv_bytes, ra, rc);
      ratios.push_back({{"kv_bytes", p_.sizes[si].kv_bytes},
                        {"anchor_" + name + "_over_complete_int8", ra},
                        {"complete_" + name + "_over_complete_int8", rc}});
    }
    if (!header_done && codec == KVXFER_CODEC_LYNX)
      std::printf("# Ratios to INT8 monolithic: n/a (-m needs both lynx and int8)\n");
  }
  json af = {{"batches", af_batches_},
             {"batches_ok", af_ok_},
             {"worst_margin_us", af_batches_ ? json(af_worst_us_) : json(nullptr)},
             {"result", af_batches_ == 0        ? "n/a"
                        : af_ok_ == af_batches_ ? "yes"
                                                : "no"}};
  if (p_.requests > 1) {
    if (af_batches_ == 0)
      std::printf(
          "# Anchors of all requests landed before any residual was applied: n/a (no progressive "
          "codec in -m)\n");
    else
      std::printf(
          "# Anchors of all requests landed before any residual was applied: %s  (%d of %d "
          "progressive batches of %d requests; worst margin %+.1f us)\n",
          af_ok_ == af_batches_ ? "yes" : "no", af_ok_, af_batches_, p_.requests, af_worst_us_);
  }
  // Checked only where a batch completed and its blocks were compared.
  const bool checked = check_ != 0 && batches_checked_ > 0;
  const bool ok = !failed_ && !run_failed && wrong_total_ == 0;
  std::printf("# Wrong bytes : %" PRIu64 " %s\n", wrong_total_,
              check_ == 0         ? "(not checked)"
              : !checked          ? "(not checked: no batch completed)"
              : wrong_total_ == 0 ? "OK"
                                  : "FAILED");
  std::printf("# Transfers   : %s\n", failed_ || run_failed ? "FAILED (see stderr)" : "OK");
  std::fflush(stdout);
  summary_ = {{"ok", ok},
              {"failed", failed_ || run_failed},
              {"wrong_bytes", checked ? json(wrong_total_) : json(nullptr)}};
  ratios_ = ratios;
  anchors_first_ = af;
  if (failed_ || run_failed) return 2;
  return wrong_total_ > 0 ? 1 : 0;
}

nlohmann::json Report::to_json() const {
  return {{"rows", jrows_},
          {"ratios", ratios_},
          {"anchors_first", anchors_first_},
          {"timeline", timeline_},
          {"summary", summary_}};
}

const Report::Row* Report::find(size_t si, kvxfer_codec_t c, kvxfer_mode_t m) const {
  for (size_t ci = 0; ci < p_.codecs.size(); ++ci) {
    const CodecCase& cc = p_.codecs[ci];
    const Row& r = rows_[si * p_.codecs.size() + ci];
    if (cc.cfg.codec == c && cc.mode == m && r.done) return &r;
  }
  return nullptr;
}

}  // namespace kvxfer::perf
