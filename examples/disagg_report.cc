// The measurement of examples/disagg_demo; see disagg_report.h.
#include "examples/disagg_report.h"

#include <kvxfer/spec.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace disagg {

using json = nlohmann::json;

double t_tokens_ms(const Run& r, int n) {
  if (static_cast<int>(r.t_commit.size()) < n) return std::nan("");
  return ms(r.t_commit[static_cast<size_t>(n - 1)] - r.t0);
}

Summary summarize(Mode m, const std::vector<const Run*>& runs,
                  const std::map<std::pair<int, int>, const Run*>& bf16_of) {
  Summary s;
  s.mode = m;
  std::vector<double> ttft, ttfc, t32, t64, ta, tc, wire, anc, res, tres, w0;
  for (const Run* r : runs) {
    s.runs++;
    ttft.push_back(ms(r->t_first_emit - r->t0));
    ttfc.push_back(t_tokens_ms(*r, 1));
    t32.push_back(t_tokens_ms(*r, 32));
    t64.push_back(t_tokens_ms(*r, 64));
    ta.push_back(ms(r->t_anchor - r->t0));
    tc.push_back(ms(r->t_complete - r->t0));
    wire.push_back((r->anchor_bytes + r->residual_bytes) / 1024.0);
    anc.push_back(r->anchor_bytes / 1024.0);
    res.push_back(r->residual_bytes / 1024.0);
    if (r->speculated) {
      s.drafted += r->drafted;
      s.verified += r->verified;
      s.accepted += r->accepted;
      s.matched += r->matched;
      if (r->verified > 0) {
        s.draft_runs++;
        if (r->rejected) {
          s.rejected++;
        } else {
          s.full_accepts++;
        }
      }
      tres.push_back(r->t_res_pred0 * 1e3);
      w0.push_back(r->window0);
    }
    if (r->tokens == r->reference) s.identical_full++;
    auto it = bf16_of.find({r->prompt_len, r->rep});
    if (it != bf16_of.end()) {
      s.compared_bf16++;
      const std::vector<int>& b = it->second->tokens;
      if (r->tokens == b) s.identical_bf16++;
      size_t k = 0;
      while (k < b.size() && k < r->tokens.size() && b[k] == r->tokens[k]) ++k;
      s.prefix_bf16 += static_cast<double>(k) / std::max<size_t>(1, b.size());
    }
    if (!r->stages_ok) s.stage_errors++;
  }
  if (s.compared_bf16 > 0) s.prefix_bf16 /= s.compared_bf16;
  s.ttft_ms = median(ttft);
  s.ttft_commit_ms = median(ttfc);
  s.tt32_ms = median(t32);
  s.tt64_ms = median(t64);
  s.anchor_ms = median(ta);
  s.complete_ms = median(tc);
  s.wire_kb = median(wire);
  s.anchor_kb = median(anc);
  s.residual_kb = median(res);
  s.t_res_pred0_ms = median(tres);
  s.window0 = w0.empty() ? 0 : static_cast<int>(median(w0));
  return s;
}

/** Fills the ttft_model predictions of the four summaries of one point. */
void predict(const Point& p, const Calibration& cal, double t_fixed_s, double burst,
             double accept_rate, int margin, int max_window, int max_verify, Summary* s) {
  kvxfer_spec_model_input_t in = KVXFER_SPEC_MODEL_INPUT_INITIALIZER;
  in.link_bytes_per_s = p.rate_bps;
  in.burst_bytes = burst;
  in.t_fixed_s = t_fixed_s;
  in.tpot_s = cal.tpot_s;
  in.t_verify_base_s = cal.verify_base_s;
  in.t_verify_per_token_s = cal.verify_per_token_s;
  for (int m = 0; m < kLynx; ++m) in.bytes[m] = s[m].wire_kb * 1024.0;
  in.anchor_bytes = s[kLynx].anchor_kb * 1024.0;
  in.residual_bytes = s[kLynx].residual_kb * 1024.0;
  in.window = -1;
  in.margin = margin;
  in.max_window = max_window;
  in.max_verify = max_verify;
  in.accept_rate = accept_rate;
  for (int n : {32, 64}) {
    in.num_tokens = n;
    kvxfer_spec_model_output_t out = KVXFER_SPEC_MODEL_OUTPUT_INITIALIZER;
    CHECK_KVXFER(kvxfer_spec_ttft_model(&in, &out));
    for (int m = 0; m < kModes; ++m) {
      s[m].pred_ttft_ms = out.ttft_s[m] * 1e3;
      s[m].pred_ttft_commit_ms = out.ttft_commit_s[m] * 1e3;
      (n == 32 ? s[m].pred_tt32_ms : s[m].pred_tt64_ms) = out.ttnt_s[m] * 1e3;
    }
  }
}

std::string fmt(double v, const char* f) {
  if (!std::isfinite(v)) return "-";
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

json summary_json(const Point& p, const Summary& s) {
  auto num = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
  return json{{"rate_mbit", p.rate_bps * 8 / 1e6},
              {"prompt_len", p.prompt_len},
              {"mode", kModeKey[s.mode]},
              {"runs", s.runs},
              {"ttft_ms", num(s.ttft_ms)},
              {"ttft_commit_ms", num(s.ttft_commit_ms)},
              {"tt32_ms", num(s.tt32_ms)},
              {"tt64_ms", num(s.tt64_ms)},
              {"anchor_ready_ms", num(s.anchor_ms)},
              {"complete_ms", num(s.complete_ms)},
              {"wire_kib", s.wire_kb},
              {"anchor_kib", s.anchor_kb},
              {"residual_kib", s.residual_kb},
              {"drafted", s.drafted},
              {"verified", s.verified},
              {"accepted", s.accepted},
              {"rejections", s.rejected},
              {"accept_rate", s.accept_rate()},
              {"draft_agreement", s.agreement()},
              {"p_whole_draft", s.p_full()},
              {"draft_rounds", s.draft_runs},
              {"window_at_anchor_ready", s.window0},
              {"t_res_predicted_ms", num(s.t_res_pred0_ms)},
              {"identical_full", s.identical_full},
              {"identical_bf16", s.identical_bf16},
              {"prefix_agreement_bf16", s.prefix_bf16},
              {"stage_errors", s.stage_errors},
              {"pred_ttft_ms", s.pred_ttft_ms},
              {"pred_ttft_commit_ms", s.pred_ttft_commit_ms},
              {"pred_tt32_ms", s.pred_tt32_ms},
              {"pred_tt64_ms", s.pred_tt64_ms}};
}

void print_main_table(const Point& p, const Summary* s, int tokens, const std::string& what) {
  std::printf(
      "#\n# Link %s, %s, %d output tokens, %d run(s) per mode; times in ms from kvxfer_send, "
      "medians; TTFTc = first committed (verified) token, prefix = mean accepted draft tokens "
      "per verification pass\n",
      rate_text(p.rate_bps).c_str(), what.c_str(), tokens, s[0].runs);
  std::printf("#%10s %8s %8s %8s %8s %8s %8s %8s %8s %8s %8s %7s %7s %8s %8s %6s %6s %6s %6s %7s\n",
              "mode", "wire_KiB", "anchor", "complete", "TTFT", "TTFTc", "pred", "TT32T", "pred",
              "TT64T", "pred", "drafted", "accept", "acc_rate", "agree", "prefix", "P(all)",
              "=full", "=bf16", "bf16pre");
  for (int m = 0; m < kModes; ++m) {
    const Summary& x = s[m];
    const bool l = m == kLynx;
    std::printf(
        " %10s %8s %8s %8s %8s %8s %8s %8s %8s %8s %8s %7s %7s %8s %8s %6s %6s %5.0f%% %5.0f%% "
        "%6.0f%%\n",
        kModeName[m], fmt(x.wire_kb, "%.1f").c_str(), fmt(x.anchor_ms).c_str(),
        fmt(x.complete_ms).c_str(), fmt(x.ttft_ms).c_str(), fmt(x.ttft_commit_ms).c_str(),
        fmt(x.pred_ttft_ms).c_str(), fmt(x.tt32_ms).c_str(), fmt(x.pred_tt32_ms).c_str(),
        fmt(x.tt64_ms).c_str(), tokens >= 64 ? fmt(x.pred_tt64_ms).c_str() : "-",
        l ? std::to_string(x.drafted).c_str() : "-", l ? std::to_string(x.accepted).c_str() : "-",
        l ? fmt(x.accept_rate(), "%.3f").c_str() : "-",
        l ? fmt(x.agreement(), "%.3f").c_str() : "-",
        l && x.draft_runs > 0 ? fmt(static_cast<double>(x.accepted) / x.draft_runs, "%.1f").c_str()
                              : "-",
        l ? fmt(x.p_full(), "%.2f").c_str() : "-", 100.0 * x.identical_full / x.runs,
        x.compared_bf16 ? 100.0 * x.identical_bf16 / x.compared_bf16 : 0.0, 100.0 * x.prefix_bf16);
  }
}

}  // namespace disagg
