// The decode side of examples/disagg_demo: what a serving runtime's decode
// node does with kvxfer and kvxfer/spec.h.  It receives the KV with
// kvxfer_recv into float32 blocks the model reads directly; for Lynx it
// drafts on the anchor-precision KV from ANCHOR_READY (a snapshot taken in
// the on_anchor_ready callback), verifies the draft in batched passes as the
// residual lands (kvxfer_spec_verify_greedy, kvxfer_spec_verify_length), and
// decodes on.  Run records the times the measurement (disagg_demo.cc) reports.
#pragma once

#include <kvxfer/kvxfer.h>
#include <kvxfer/spec.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "examples/disagg.h"

namespace disagg {

/** One timed run of one mode. */
struct Run {
  Mode mode = kBF16;
  double rate_bps = 0;          // bytes/s
  int prompt_len = 0, rep = 0;  // prompt_len: the point's key (text prompts: the set)
  int tokens_in = 0;            // the prompt's actual length
  int64_t t0 = 0;               // sender's kvxfer_send
  int64_t t_handshake = 0, t_anchor = 0, t_first_residual = 0, t_complete = 0;  // receiver
  int64_t t_snapshot = 0;    // Lynx: anchor snapshot taken (callback)
  int64_t t_first_emit = 0;  // first output token emitted
  int64_t t_verify_start = 0, t_verify_end = 0;
  std::vector<int64_t> t_commit;       // when output token i became final
  std::vector<int> tokens, reference;  // output; plain greedy on the same received KV
  uint64_t anchor_bytes = 0, residual_bytes = 0;
  int drafted = 0, verified = 0, accepted = 0, matched = 0, window0 = 0;
  int passes = 0;  // verification passes (Lynx)
  /** Each verification pass: tokens run (the last final token + the checked
   *  drafts), its time and the start-up calibration's a(C) + b(C) k (ms). */
  struct Pass {
    int tokens = 0;
    double ms = 0, pred_ms = 0;
  };
  std::vector<Pass> pass_log;
  bool rejected = false;   // a draft token was rejected (else the checked draft was all accepted)
  double t_res_pred0 = 0;  // residual time predicted at ANCHOR_READY
  bool speculated = false;
  bool stages_ok = true;
  std::string stage_problem;
};

/** The receiver's anchor snapshot, taken on the progress thread in on_anchor_ready. */
struct Snapshot {
  const BlockKV* src = nullptr;
  BlockKV* dst = nullptr;
  int tokens = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool taken = false;
  int64_t t = 0;
};

/** The request callback: takes the anchor snapshot at ANCHOR_READY. */
void on_anchor_ready(kvxfer_request_t, kvxfer_stage_t stage, kvxfer_result_t, void* user);

/** The latency model's runner costs at one point of the table (cal_at in main). */
struct Calibration {
  double tpot_s = 0;         // decode step (median)
  double verify_base_s = 0;  // verify pass: base + per_token * tokens
  double verify_per_token_s = 0;
};

/** The runner's costs at one context (KV tokens), timed at start-up: a decode
 *  step, and a verification pass of k tokens as a(C) + b(C) k (the latency
 *  model's t_ver, docs/SPEC.md), fitted by least squares to the medians of
 *  passes of 1, 4, 16 and 64 tokens. */
struct PassCost {
  double tpot_s = 0, base_s = 0, per_token_s = 0;
  double pass_s(int tokens) const { return base_s + per_token_s * tokens; }
};

class Decoder {
 public:
  /** capacity: the longest KV (tokens) a run receives. */
  Decoder(const Options& o, const km::Model& m, int to_child, int from_child, int capacity)
      : o_(o), m_(m), c_(m.config()), to_(to_child), from_(from_child) {
    recv_.init(c_, capacity);
    snap_.init(c_, capacity);
  }

  void open_comm(double rate_bps);

  void close_comm() {
    send_msg(to_, kMsgEndComm, nullptr, 0);
    CHECK_KVXFER(kvxfer_comm_destroy(comm_));
    comm_ = nullptr;
  }

  /** Asks the prefill process for prompt `id` (generated or given); returns its tokens. */
  std::vector<int> prompt(int id, int len, uint64_t seed, const std::vector<int>& given);

  /** Transfers prompt `pid`'s KV (prompt[0..L-2]) in `mode` and decodes N tokens. */
  Run run(Mode mode, int pid, const std::vector<int>& prompt, int L, int rep, double rate_bps);

  /** Times the runner at a KV of n_kv tokens (PassCost), untimed by the
   *  runs, on the receive buffer (the values do not change the time).  The
   *  first call also seeds the monitor's TPOT. */
  void calibrate_at(int n_kv);

  /** The calibration at the nearest timed context (calibrate_at first). */
  const PassCost& cost_at(int n_kv) const;

  /** Decode-step times of every timed run (seconds). */
  const std::vector<double>& step_samples() const { return step_samples_; }
  /** Forgets the samples (after the warm-up). */
  void clear_samples() { step_samples_.clear(); }
  const kvxfer_spec_monitor_t& monitor() const { return monitor_; }

 private:
  void check_stages(Run* r);

  const Options& o_;
  const km::Model& m_;
  const km::Config& c_;
  int to_, from_;
  kvxfer_comm_t comm_ = nullptr;
  std::string rate_;
  BlockKV recv_, snap_;
  uint64_t tag_ = 0;
  double residual_ratio_ = 0.8;        // residual / anchor bytes of the last Lynx transfer
  std::map<int, PassCost> pass_cost_;  // by KV tokens (calibrate_at)
  kvxfer_spec_monitor_t monitor_ = KVXFER_SPEC_MONITOR_INITIALIZER;
  std::vector<double> step_samples_;
};

}  // namespace disagg
