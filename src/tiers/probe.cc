// The INT4 tolerance probe (kvxfer_spectrum_run_probe; docs/SPECTRUMKV.md,
// "INT4 tolerance probe"): the paper's (arXiv:2606.08635) three aggressive
// trials under the 3-tier policy, INT4 allowed when at least 2 pass.
#include "common/error.h"
#include "tiers/spectrum_impl.h"

namespace kvxfer::spectrum {

kvxfer_result_t run_probe(const kvxfer_spectrum_config_t* base, kvxfer_spectrum_trial_fn trial,
                          void* user_data, int32_t* allow_int4, int32_t* passed, int32_t* run) {
  KVXFER_REQUIRE(trial != nullptr, "trial callback is NULL");
  KVXFER_REQUIRE(allow_int4 != nullptr, "allow_int4 is NULL");
  kvxfer_spectrum_config_t cfg = KVXFER_SPECTRUM_CONFIG_INITIALIZER;
  if (base != nullptr) {
    KVXFER_CHECK(validate_config(base));
    cfg = *base;
  }
  cfg.variant = KVXFER_SPECTRUM_GREEDY;
  cfg.allow_int4 = 1;
  cfg.budget = KVXFER_SPECTRUM_PROBE_BUDGET;
  int32_t ok = 0, done = 0;
  const int32_t fails_to_block = KVXFER_SPECTRUM_PROBE_TRIALS - KVXFER_SPECTRUM_PROBE_PASSES + 1;
  while (done < KVXFER_SPECTRUM_PROBE_TRIALS && ok < KVXFER_SPECTRUM_PROBE_PASSES &&
         done - ok < fails_to_block) {
    int32_t p = -1;
    const kvxfer_spectrum_config_t arg = cfg;  // the callback gets its own copy
    const kvxfer_result_t r = trial(done, &arg, &p, user_data);
    if (r < 0) {
      breadcrumb(__FILE__, __LINE__, r);
      return r;
    }
    KVXFER_REQUIRE(p == 0 || p == 1, "probe trial %d set *passed = %d (must be 0 or 1)", done, p);
    ok += p;
    ++done;
  }
  *allow_int4 = ok >= KVXFER_SPECTRUM_PROBE_PASSES ? 1 : 0;
  if (passed != nullptr) *passed = ok;
  if (run != nullptr) *run = done;
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::spectrum
