// kvxfer_perf's report: one table row per (size, codec) from the receiver's
// batches, the ratios to INT8 monolithic, the anchors-first check, the
// footer and the JSON (docs/PERFORMANCE.md, section "kvxfer_perf").
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "perf/common/harness.h"
#include "perf/common/rendezvous.h"
#include "perf/common/xfer_plan.h"

namespace kvxfer::perf {

class Report {
 public:
  /** check: -c (1: the receiver compared its blocks). */
  Report(int check, const Plan& p);

  /** Prints the table header. */
  void header();

  /** One batch as the receiver saw it; t_send_post: the sender's first post (0 if unknown). */
  void add(size_t si, size_t ci, int it, const Batch& b, int64_t t_send_post);

  /** Prints the row of (si, ci) once all its iterations are in. */
  void finish_row(size_t si, size_t ci);

  /** Ratio lines, the anchors-first line and the footer.  Returns the exit status. */
  int footer(bool run_failed);

  nlohmann::json to_json() const;

 private:
  struct Row {
    int64_t pages = 0;
    uint64_t kv_bytes = 0, anchor_wire = 0, wire = 0;
    int64_t wrong = -1;
    std::vector<double> ta, tc;
    Stats sta, stc;
    nlohmann::json samples = nlohmann::json::array();
    bool done = false;
  };
  const Row* find(size_t si, kvxfer_codec_t c, kvxfer_mode_t m) const;

  int check_;
  const Plan& p_;
  Table table_;
  std::vector<Row> rows_;
  nlohmann::json jrows_ = nlohmann::json::array(), ratios_ = nlohmann::json::array(),
                 anchors_first_, summary_;
  nlohmann::json timeline_ = nullptr;
  int timeline_rank_ = 0;
  int af_batches_ = 0, af_ok_ = 0;
  double af_worst_us_ = 0;
  uint64_t wrong_total_ = 0;
  int64_t batches_checked_ = 0;  // batches whose receiver blocks were compared
  bool failed_ = false;
};

}  // namespace kvxfer::perf
