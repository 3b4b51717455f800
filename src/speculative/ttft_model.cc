// The latency model of include/kvxfer/spec.h (kvxfer_spec_ttft_model): the
// Lynx paper's Eq. 16-20 as docs/SPEC.md ("Latency model") reads them.
#include <cmath>

#include "common/error.h"
#include "speculative/spec_impl.h"

namespace kvxfer::spec {

namespace {

bool ok_nonneg(double x) { return std::isfinite(x) && x >= 0.0; }

}  // namespace

kvxfer_result_t ttft_model(const kvxfer_spec_model_input_t* in, kvxfer_spec_model_output_t* out) {
  KVXFER_CHECK(check_struct_in_place(in));
  KVXFER_CHECK(check_struct_in_place(out));
  KVXFER_REQUIRE(std::isfinite(in->link_bytes_per_s) && in->link_bytes_per_s > 0.0,
                 "link_bytes_per_s %g is not > 0", in->link_bytes_per_s);
  KVXFER_REQUIRE(std::isfinite(in->tpot_s) && in->tpot_s > 0.0, "tpot_s %g is not > 0", in->tpot_s);
  KVXFER_REQUIRE(ok_nonneg(in->burst_bytes) && ok_nonneg(in->t_fixed_s) &&
                     ok_nonneg(in->t_prefill_s) && ok_nonneg(in->t_verify_base_s) &&
                     ok_nonneg(in->t_verify_per_token_s) && ok_nonneg(in->anchor_bytes) &&
                     ok_nonneg(in->residual_bytes),
                 "a time or size is negative or not finite");
  for (int c = 0; c < KVXFER_SPEC_SCHEME_COUNT; ++c)
    KVXFER_REQUIRE(ok_nonneg(in->bytes[c]), "bytes[%d] = %g is negative or not finite", c,
                   in->bytes[c]);
  KVXFER_REQUIRE(std::isfinite(in->accept_rate) && in->accept_rate >= 0.0 && in->accept_rate <= 1.0,
                 "accept_rate %g is outside [0, 1]", in->accept_rate);
  KVXFER_REQUIRE(in->num_tokens >= 1, "num_tokens %d < 1", in->num_tokens);
  KVXFER_REQUIRE(in->margin >= 0 && in->max_window >= 0 && in->max_verify >= 0,
                 "margin %d, max_window %d or max_verify %d is negative", in->margin,
                 in->max_window, in->max_verify);

  const double R = in->link_bytes_per_s, tpot = in->tpot_s, N = in->num_tokens;
  // (16) transfer of B bytes on a token-bucket link of depth b.
  auto t_x = [&](double B) {
    const double over = B - in->burst_bytes;
    return in->t_fixed_s + (over > 0.0 ? over : 0.0) / R;
  };
  auto t_ver = [&](int d) {
    return verify_pass_s(in->t_verify_base_s, in->t_verify_per_token_s, static_cast<double>(d));
  };
  kvxfer_spec_model_output_t o = *out;
  // (17), (18): monolithic schemes decode once everything has landed.
  for (int c = 0; c < KVXFER_SPEC_SCHEME_LYNX; ++c) {
    o.t_ready_s[c] = in->t_prefill_s + t_x(in->bytes[c]);
    o.ttft_s[c] = o.t_ready_s[c] + tpot;
    o.ttft_commit_s[c] = o.ttft_s[c];
    o.ttnt_s[c] = o.t_ready_s[c] + N * tpot;
  }
  // (19) anchors, then the residual behind them on the same link.
  const double t_a = t_x(in->anchor_bytes);
  const double t_res = in->residual_bytes / R;
  double k = in->window;
  if (in->window < 0) {
    k = std::ceil(t_res / tpot) + in->margin;
    if (in->max_window > 0 && k > in->max_window) k = in->max_window;
  }
  if (k > 1e9) k = 1e9;
  const double exposure = std::fmax(0.0, t_res - k * tpot);
  const double d = std::fmin(k, std::ceil(t_res / tpot));
  const double v = in->max_verify > 0 ? std::fmin(d, in->max_verify) : d;
  const double alpha = in->accept_rate;
  // abar = sum_{i=1..v} alpha^i, in closed form.
  const double abar = expected_pass_tokens(alpha, v) - 1.0;
  const int L = KVXFER_SPEC_SCHEME_LYNX;
  o.t_ready_s[L] = in->t_prefill_s + t_a;
  const double commit =
      in->t_prefill_s + t_a + std::fmax(d * tpot, t_res) + t_ver(static_cast<int>(v));
  // (20)
  o.ttft_s[L] = k >= 1 ? o.t_ready_s[L] + tpot : commit;
  o.ttft_commit_s[L] = commit;
  o.ttnt_s[L] = commit + std::fmax(0.0, N - (abar + 1.0)) * tpot;
  o.t_res_s = t_res;
  o.exposure_s = exposure;
  o.expected_accepted = abar;
  o.window = static_cast<int32_t>(k);
  o.drafted = static_cast<int32_t>(d);
  o.verified = static_cast<int32_t>(v);
  bool finite =
      std::isfinite(o.t_res_s) && std::isfinite(o.exposure_s) && std::isfinite(o.expected_accepted);
  for (int c = 0; c < KVXFER_SPEC_SCHEME_COUNT; ++c)
    finite = finite && std::isfinite(o.t_ready_s[c]) && std::isfinite(o.ttft_s[c]) &&
             std::isfinite(o.ttft_commit_s[c]) && std::isfinite(o.ttnt_s[c]);
  KVXFER_REQUIRE(finite,
                 "the model's times overflow: link_bytes_per_s %g is too small for these sizes", R);
  *out = o;
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::spec
