// The exported C API of include/kvxfer/spectrum.h.  Each entry runs in
// api_call (common/api_call.h), which checks the KVXFER_* environment and turns
// exceptions into results.
#include "common/api_call.h"
#include "tiers/spectrum_impl.h"

namespace ks = kvxfer::spectrum;

extern "C" {

kvxfer_result_t kvxfer_spectrum_budget_fractions(double budget, int32_t allow_int4,
                                                 double* fractions) {
  return kvxfer::api_call(__func__,
                          [&] { return ks::budget_fractions(budget, allow_int4, fractions); });
}

kvxfer_result_t kvxfer_spectrum_tier_counts(const kvxfer_spectrum_config_t* config,
                                            int64_t num_tokens, int64_t* counts, int64_t* sinks) {
  return kvxfer::api_call(__func__, [&] {
    KVXFER_REQUIRE(counts != nullptr, "counts is NULL");
    ks::Counts c;
    KVXFER_CHECK(ks::tier_counts(config, num_tokens, &c));
    for (int t = 0; t < 4; ++t) counts[t] = c.count[t];
    if (sinks != nullptr) *sinks = c.sinks;
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_spectrum_importance_from_attention(const float* attention_mass,
                                                          int32_t num_rows, int64_t num_tokens,
                                                          float lambda, float* importance) {
  return kvxfer::api_call(__func__, [&] {
    return ks::importance_from_attention(attention_mass, num_rows, num_tokens, lambda, importance);
  });
}

kvxfer_result_t kvxfer_spectrum_importance_from_kv(const kvxfer_page_layout_t* pages,
                                                   int32_t num_pages, float lambda,
                                                   float* importance) {
  return kvxfer::api_call(
      __func__, [&] { return ks::importance_from_kv(pages, num_pages, lambda, importance); });
}

kvxfer_result_t kvxfer_spectrum_assign(const kvxfer_spectrum_config_t* config, int64_t num_tokens,
                                       const float* importance, uint8_t* tiers) {
  return kvxfer::api_call(__func__,
                          [&] { return ks::assign(config, num_tokens, importance, tiers); });
}

kvxfer_result_t kvxfer_spectrum_run_probe(const kvxfer_spectrum_config_t* base,
                                          kvxfer_spectrum_trial_fn trial, void* user_data,
                                          int32_t* allow_int4, int32_t* passed, int32_t* run) {
  return kvxfer::api_call(
      __func__, [&] { return ks::run_probe(base, trial, user_data, allow_int4, passed, run); });
}

}  // extern "C"
