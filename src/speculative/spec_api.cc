// The exported C API of include/kvxfer/spec.h.  Each entry runs in api_call
// (common/api_call.h), which checks the KVXFER_* environment and turns exceptions
// into results (KVXFER_SPEC_MIN_ACCEPT included: a FLOAT of params.def).
#include "common/api_call.h"
#include "speculative/spec_impl.h"

extern "C" {

kvxfer_result_t kvxfer_spec_verify_greedy(const int32_t* draft, int32_t draft_len,
                                          const int32_t* target, int32_t* accepted,
                                          int32_t* next_token) {
  return kvxfer::api_call(__func__, [&] {
    return kvxfer::spec::verify_greedy(draft, draft_len, target, accepted, next_token);
  });
}

kvxfer_result_t kvxfer_spec_verify_stochastic(const int32_t* draft, int32_t draft_len,
                                              const float* target_probs, const float* draft_probs,
                                              int32_t vocab, uint64_t seed, int32_t* accepted,
                                              int32_t* next_token) {
  return kvxfer::api_call(__func__, [&] {
    return kvxfer::spec::verify_stochastic(draft, draft_len, target_probs, draft_probs, vocab, seed,
                                           accepted, next_token);
  });
}

kvxfer_result_t kvxfer_spec_sample(const float* probs, int32_t vocab, uint64_t seed,
                                   int32_t* token) {
  return kvxfer::api_call(__func__,
                          [&] { return kvxfer::spec::sample(probs, vocab, seed, token); });
}

kvxfer_result_t kvxfer_spec_residual_time(const kvxfer_spec_window_config_t* config,
                                          const kvxfer_request_info_t* info, int64_t now_ns,
                                          double* t_res_s) {
  return kvxfer::api_call(
      __func__, [&] { return kvxfer::spec::residual_time(config, info, now_ns, t_res_s); });
}

kvxfer_result_t kvxfer_spec_window(const kvxfer_spec_window_config_t* config, double t_res_s,
                                   double tpot_s, double elapsed_s, int32_t* window) {
  return kvxfer::api_call(
      __func__, [&] { return kvxfer::spec::window(config, t_res_s, tpot_s, elapsed_s, window); });
}

kvxfer_result_t kvxfer_spec_verify_length(int32_t draft_len, double accept_rate, double tpot_s,
                                          double verify_base_s, double verify_per_token_s,
                                          int32_t* length) {
  return kvxfer::api_call(__func__, [&] {
    return kvxfer::spec::verify_length(draft_len, accept_rate, tpot_s, verify_base_s,
                                       verify_per_token_s, length);
  });
}

kvxfer_result_t kvxfer_spec_monitor_update(kvxfer_spec_monitor_t* monitor, int32_t draft_len,
                                           int32_t accepted, int32_t* speculate) {
  return kvxfer::api_call(__func__, [&] {
    return kvxfer::spec::monitor_update(monitor, draft_len, accepted, speculate);
  });
}

kvxfer_result_t kvxfer_spec_monitor_record_step(kvxfer_spec_monitor_t* monitor, double seconds) {
  return kvxfer::api_call(__func__,
                          [&] { return kvxfer::spec::monitor_record_step(monitor, seconds); });
}

kvxfer_result_t kvxfer_spec_monitor_query(const kvxfer_spec_monitor_t* monitor, int32_t* speculate,
                                          double* rate) {
  return kvxfer::api_call(__func__,
                          [&] { return kvxfer::spec::monitor_query(monitor, speculate, rate); });
}

kvxfer_result_t kvxfer_spec_ttft_model(const kvxfer_spec_model_input_t* in,
                                       kvxfer_spec_model_output_t* out) {
  return kvxfer::api_call(__func__, [&] { return kvxfer::spec::ttft_model(in, out); });
}

}  // extern "C"
