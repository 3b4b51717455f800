// Speculative decoding on anchor KV: the internals behind include/kvxfer/spec.h
// (docs/SPEC.md).  Every function returns kvxfer_result_t and sets the
// thread's error text on failure (common/error.h); outputs are written only on
// success.  The exported wrappers are in spec_api.cc.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/struct_abi.h"
#include "kvxfer/spec.h"

namespace kvxfer::spec {

// ---- RNG: draw j of `seed` is uniform in [0, 1) (53 bits).
uint64_t splitmix64(uint64_t x);
double uniform(uint64_t seed, uint64_t draw);

// ---- the latency model's cost of a verification pass over v draft tokens
// (v + 1 tokens run): t_ver(v) = base + per_token (v + 1), docs/SPEC.md
// "Latency model".  Used by ttft_model and verify_length.
/** The largest draft_len kvxfer_spec_verify_length takes (KVXFER_SPEC_MAX is at most 4096). */
constexpr int32_t kMaxVerifyDraft = 1 << 16;

inline double verify_pass_s(double base_s, double per_token_s, double v) {
  return base_s + per_token_s * (v + 1.0);
}

// Expected final tokens of a pass over v draft tokens, each accepted with
// probability alpha independently: the accepted prefix plus the target's
// next token, sum_{i=0..v} alpha^i = (1 - alpha^(v+1)) / (1 - alpha)
// (Leviathan et al. 2023, Eq. 1); v + 1 when alpha >= 1.
inline double expected_pass_tokens(double alpha, double v) {
  return alpha >= 1.0 ? v + 1.0 : (1.0 - std::pow(alpha, v + 1.0)) / (1.0 - alpha);
}

// ---- verification (verify.cc)
kvxfer_result_t verify_greedy(const int32_t* draft, int32_t draft_len, const int32_t* target,
                              int32_t* accepted, int32_t* next_token);
kvxfer_result_t verify_stochastic(const int32_t* draft, int32_t draft_len, const float* p,
                                  const float* q, int32_t vocab, uint64_t seed, int32_t* accepted,
                                  int32_t* next_token);
kvxfer_result_t sample(const float* probs, int32_t vocab, uint64_t seed, int32_t* token);

// ---- window and monitor (window.cc)
kvxfer_result_t residual_time(const kvxfer_spec_window_config_t* config,
                              const kvxfer_request_info_t* info, int64_t now_ns, double* t_res_s);
kvxfer_result_t verify_length(int32_t draft_len, double accept_rate, double tpot_s,
                              double verify_base_s, double verify_per_token_s, int32_t* length);
kvxfer_result_t window(const kvxfer_spec_window_config_t* config, double t_res_s, double tpot_s,
                       double elapsed_s, int32_t* out);
kvxfer_result_t monitor_update(kvxfer_spec_monitor_t* m, int32_t draft_len, int32_t accepted,
                               int32_t* speculate);
kvxfer_result_t monitor_record_step(kvxfer_spec_monitor_t* m, double seconds);
kvxfer_result_t monitor_query(const kvxfer_spec_monitor_t* m, int32_t* speculate, double* rate);

// ---- latency model (ttft_model.cc)
kvxfer_result_t ttft_model(const kvxfer_spec_model_input_t* in, kvxfer_spec_model_output_t* out);

}  // namespace kvxfer::spec
