// The measurement of examples/disagg_demo: the summary of a point's runs per
// mode (medians, acceptance, agreement with BF16), the latency model's
// predictions, the main table and the JSON summaries.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "examples/disagg.h"
#include "examples/disagg_decoder.h"

namespace disagg {

struct Point {  // one (rate, prompt length) of the sweep
  double rate_bps = 0;
  int prompt_len = 0;
};
inline bool operator<(const Point& a, const Point& b) {
  return a.rate_bps != b.rate_bps ? a.rate_bps < b.rate_bps : a.prompt_len < b.prompt_len;
}

struct Summary {
  Mode mode = kBF16;
  int runs = 0;
  double ttft_ms = 0, ttft_commit_ms = 0, tt32_ms = 0, tt64_ms = 0, anchor_ms = 0, complete_ms = 0;
  double wire_kb = 0, anchor_kb = 0, residual_kb = 0;
  long drafted = 0, verified = 0, accepted = 0, rejected = 0, matched = 0, full_accepts = 0,
       draft_runs = 0;
  int identical_full = 0, identical_bf16 = 0, compared_bf16 = 0;
  double prefix_bf16 = 0;  // mean fraction of tokens before the first difference from BF16
  int stage_errors = 0;
  int window0 = 0;
  double t_res_pred0_ms = 0;
  // ttft_model predictions
  double pred_ttft_ms = 0, pred_ttft_commit_ms = 0, pred_tt32_ms = 0, pred_tt64_ms = 0;

  double accept_rate() const {
    return accepted + rejected > 0 ? static_cast<double>(accepted) / (accepted + rejected) : 0.0;
  }
  double agreement() const { return verified > 0 ? static_cast<double>(matched) / verified : 0.0; }
  double p_full() const {
    return draft_runs > 0 ? static_cast<double>(full_accepts) / draft_runs : 0.0;
  }
};

/** Time to the n-th final token of a run, ms from the sender's post (NaN when fewer). */
double t_tokens_ms(const Run& r, int n);

/** The summary of one mode's runs; bf16_of: the BF16 run of each (prompt, rep). */
Summary summarize(Mode m, const std::vector<const Run*>& runs,
                  const std::map<std::pair<int, int>, const Run*>& bf16_of);

/** Fills the ttft_model predictions of the four summaries of one point. */
void predict(const Point& p, const Calibration& cal, double t_fixed_s, double burst,
             double accept_rate, int margin, int max_window, int max_verify, Summary* s);

/** v with printf format f, or "-" when not finite. */
std::string fmt(double v, const char* f = "%.2f");

nlohmann::json summary_json(const Point& p, const Summary& s);

/** The main table of one point: a row per mode. */
void print_main_table(const Point& p, const Summary* s, int tokens, const std::string& what);

}  // namespace disagg
