// How long to draft (residual-time prediction, adaptive window) and when to
// stop (acceptance monitor); include/kvxfer/spec.h, docs/SPEC.md.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "common/params.h"
#include "speculative/spec_impl.h"

namespace kvxfer::spec {

namespace {

bool finite_nonneg(double x) { return std::isfinite(x) && x >= 0.0; }

}  // namespace

kvxfer_result_t residual_time(const kvxfer_spec_window_config_t* config,
                              const kvxfer_request_info_t* info, int64_t now_ns, double* t_res_s) {
  KVXFER_CHECK(check_struct_in_place(config));
  KVXFER_CHECK(check_struct_in_place(info));
  KVXFER_REQUIRE(t_res_s != nullptr, "t_res_s is NULL");
  KVXFER_REQUIRE(std::isfinite(config->residual_ratio) && config->residual_ratio > 0.0,
                 "residual_ratio %g is not > 0", config->residual_ratio);
  KVXFER_REQUIRE(finite_nonneg(config->link_bytes_per_s), "link_bytes_per_s %g is negative",
                 config->link_bytes_per_s);
  KVXFER_REQUIRE(info->is_send == 0,
                 "a send request: only the receiver's progress predicts the residual time");
  // Read as integers: loading an enum object that holds no enumerator's
  // value is undefined (UBSan's -fsanitize=enum).
  int stage = 0, mode = 0;
  static_assert(sizeof(info->stage) == sizeof(int) && sizeof(info->mode) == sizeof(int), "C enums");
  std::memcpy(&stage, &info->stage, sizeof(int));
  std::memcpy(&mode, &info->mode, sizeof(int));
  KVXFER_REQUIRE(stage >= KVXFER_STAGE_POSTED && stage <= KVXFER_STAGE_ERROR &&
                     mode >= KVXFER_MODE_AUTO && mode <= KVXFER_MODE_MONOLITHIC,
                 "info: stage %d or mode %d is not one of kvxfer.h's (fill it with "
                 "kvxfer_request_info)",
                 stage, mode);
  if (info->stage == KVXFER_STAGE_ERROR)
    return set_error(KVXFER_ERR_INVALID_USAGE, "the request failed (%d)",
                     static_cast<int>(info->result));
  if (info->stage == KVXFER_STAGE_COMPLETE || info->mode == KVXFER_MODE_MONOLITHIC) {
    *t_res_s = 0.0;
    return KVXFER_SUCCESS;
  }
  if (info->stage != KVXFER_STAGE_ANCHOR_READY)
    return set_error(KVXFER_ERR_INVALID_USAGE,
                     "the anchors have not all landed (%lld of %lld pages): no residual estimate "
                     "before ANCHOR_READY",
                     static_cast<long long>(info->pages_anchor_ready),
                     static_cast<long long>(info->num_pages));
  const double ba = static_cast<double>(info->anchor_wire_bytes);
  const double br = static_cast<double>(info->residual_wire_bytes);
  double left = config->residual_ratio * ba - br;
  if (!(left > 0.0)) {
    // More has landed than the prior predicted, yet not everything: one more
    // page of the mean size so far.
    left = br / static_cast<double>(info->num_pages > 0 ? info->num_pages : 1);
  }
  double rate = 0.0;
  const double elapsed = static_cast<double>(now_ns - info->t_handshake_ns) * 1e-9;
  if (info->t_handshake_ns > 0 && elapsed > 0.0 && ba + br > 0.0) rate = (ba + br) / elapsed;
  if (!(rate > 0.0)) rate = config->link_bytes_per_s;
  if (!(rate > 0.0))
    return set_error(KVXFER_ERR_INVALID_USAGE,
                     "no link rate yet (nothing landed since the handshake) and no "
                     "link_bytes_per_s in the config");
  const double t = left / rate;
  KVXFER_REQUIRE(std::isfinite(t),
                 "the residual time overflows (residual_ratio %g, %lld anchor bytes, rate %g B/s)",
                 config->residual_ratio, static_cast<long long>(info->anchor_wire_bytes), rate);
  *t_res_s = t;
  return KVXFER_SUCCESS;
}

kvxfer_result_t window(const kvxfer_spec_window_config_t* config, double t_res_s, double tpot_s,
                       double elapsed_s, int32_t* out) {
  KVXFER_CHECK(check_struct_in_place(config));
  KVXFER_REQUIRE(out != nullptr, "window is NULL");
  KVXFER_REQUIRE(config->margin >= 0 && config->max_tokens >= 0,
                 "margin %d or max_tokens %d is negative", config->margin, config->max_tokens);
  KVXFER_REQUIRE(std::isfinite(tpot_s) && tpot_s > 0.0, "tpot_s %g is not > 0", tpot_s);
  KVXFER_REQUIRE(finite_nonneg(t_res_s) && finite_nonneg(elapsed_s),
                 "t_res_s %g or elapsed_s %g is negative or not finite", t_res_s, elapsed_s);
  int64_t cap = params::SpecMax();
  if (config->max_tokens > 0 && config->max_tokens < cap) cap = config->max_tokens;
  const double want = std::ceil((elapsed_s + t_res_s) / tpot_s) + config->margin;
  *out = static_cast<int32_t>(want >= static_cast<double>(cap) ? cap : static_cast<int64_t>(want));
  return KVXFER_SUCCESS;
}

kvxfer_result_t verify_length(int32_t draft_len, double accept_rate, double tpot_s,
                              double verify_base_s, double verify_per_token_s, int32_t* length) {
  KVXFER_REQUIRE(length != nullptr, "length is NULL");
  KVXFER_REQUIRE(draft_len >= 0, "draft_len %d is negative", draft_len);
  KVXFER_REQUIRE(accept_rate >= 0.0 && accept_rate <= 1.0, "accept_rate %g is outside [0, 1]",
                 accept_rate);
  KVXFER_REQUIRE(std::isfinite(tpot_s) && tpot_s > 0.0, "tpot_s %g is not > 0", tpot_s);
  KVXFER_REQUIRE(finite_nonneg(verify_base_s), "verify_base_s %g is negative or not finite",
                 verify_base_s);
  KVXFER_REQUIRE(finite_nonneg(verify_per_token_s),
                 "verify_per_token_s %g is negative or not finite", verify_per_token_s);
  KVXFER_REQUIRE(draft_len <= kMaxVerifyDraft, "draft_len %d exceeds %d", draft_len,
                 kMaxVerifyDraft);
  // spec.h: the v in [1, draft_len] with the most expected final tokens per
  // second, E(v) / t_ver(v) (expected_pass_tokens, verify_pass_s).
  // E is concave and t_ver affine, so the rate rises to one peak (or
  // plateau) and then falls: the scan stops at the first fall.
  if (draft_len == 0) {
    *length = 0;
    return KVXFER_SUCCESS;
  }
  if (verify_base_s + verify_per_token_s == 0.0) {  // passes are free
    *length = draft_len;
    return KVXFER_SUCCESS;
  }
  // The costs scaled by a power of two, exactly, so that the largest is in
  // [0.5, 1): tiny (subnormal) costs would make every rate infinite, and
  // ties of infinities pick the wrong v.  The comparisons are unchanged.
  int e = 0;
  std::frexp(std::fmax(verify_base_s, verify_per_token_s), &e);
  const double base = std::ldexp(verify_base_s, -e), per = std::ldexp(verify_per_token_s, -e);
  auto rate_at = [&](int32_t v) {
    const double x = static_cast<double>(v);
    return expected_pass_tokens(accept_rate, x) / verify_pass_s(base, per, x);
  };
  double best = 0.0;
  int32_t best_v = 0;
  if (accept_rate >= 1.0 || per == 0.0) {  // the rate never falls: the whole draft
    best_v = draft_len;
    best = rate_at(draft_len);
  } else {
    for (int32_t v = 1; v <= draft_len; ++v) {
      const double rate = rate_at(v);
      if (rate < best) break;
      best = rate;
      best_v = v;
    }
  }
  // best is in tokens per 2^e seconds.
  *length = best * std::ldexp(tpot_s, -e) >= 1.0 ? best_v : 0;
  return KVXFER_SUCCESS;
}

namespace {

kvxfer_result_t check_monitor(const kvxfer_spec_monitor_t* m) {
  KVXFER_CHECK(check_struct_in_place(m));
  KVXFER_REQUIRE(std::isfinite(m->min_accept) && m->min_accept <= 1.0,
                 "min_accept %g is above 1 or not finite", m->min_accept);
  KVXFER_REQUIRE(m->min_tokens >= 1, "min_tokens %lld < 1", static_cast<long long>(m->min_tokens));
  KVXFER_REQUIRE(std::isfinite(m->tpot_weight) && m->tpot_weight > 0.0 && m->tpot_weight <= 1.0,
                 "tpot_weight %g is outside (0, 1]", m->tpot_weight);
  return KVXFER_SUCCESS;
}

double rate_of(const kvxfer_spec_monitor_t& m) {
  const int64_t examined = m.accepted + m.rejected;
  return examined > 0 ? static_cast<double>(m.accepted) / static_cast<double>(examined) : 1.0;
}

}  // namespace

kvxfer_result_t monitor_update(kvxfer_spec_monitor_t* m, int32_t draft_len, int32_t accepted,
                               int32_t* speculate) {
  KVXFER_CHECK(check_monitor(m));
  KVXFER_REQUIRE(draft_len >= 0 && accepted >= 0 && accepted <= draft_len,
                 "accepted %d is outside [0, draft_len %d]", accepted, draft_len);
  m->rounds++;
  m->drafted += draft_len;
  m->accepted += accepted;
  if (accepted < draft_len) m->rejected++;
  if (draft_len > 0 && accepted == draft_len) m->full_accepts++;
  const double threshold = m->min_accept >= 0.0 ? m->min_accept : params::SpecMinAccept();
  const int64_t examined = m->accepted + m->rejected;
  const double rate = rate_of(*m);
  if (!m->fallen_back && examined >= m->min_tokens && rate < threshold) {
    m->fallen_back = 1;
    KVXFER_WARN(LOG_MODEL,
                "speculative decoding off: per-token acceptance %.3f < %.3f "
                "(KVXFER_SPEC_MIN_ACCEPT) after %lld examined draft tokens; waiting for the full "
                "KV from now on",
                rate, threshold, static_cast<long long>(examined));
  }
  if (speculate != nullptr) *speculate = m->fallen_back ? 0 : 1;
  return KVXFER_SUCCESS;
}

kvxfer_result_t monitor_record_step(kvxfer_spec_monitor_t* m, double seconds) {
  KVXFER_CHECK(check_monitor(m));
  KVXFER_REQUIRE(std::isfinite(seconds) && seconds > 0.0, "step time %g is not > 0", seconds);
  m->tpot_s =
      m->tpot_s > 0.0 ? (1.0 - m->tpot_weight) * m->tpot_s + m->tpot_weight * seconds : seconds;
  return KVXFER_SUCCESS;
}

kvxfer_result_t monitor_query(const kvxfer_spec_monitor_t* m, int32_t* speculate, double* rate) {
  KVXFER_CHECK(check_monitor(m));
  KVXFER_REQUIRE(speculate != nullptr, "speculate is NULL");
  *speculate = m->fallen_back ? 0 : 1;
  if (rate != nullptr) *rate = rate_of(*m);
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::spec
