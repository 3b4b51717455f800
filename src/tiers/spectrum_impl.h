// SpectrumKV precision policy: the internals behind include/kvxfer/spectrum.h
// (docs/SPECTRUMKV.md).  Every function returns kvxfer_result_t and sets the
// thread's error text on failure (common/error.h); outputs are written only on
// success.  The exported wrappers are in spectrum_api.cc.
#pragma once

#include <cstdint>
#include <vector>

#include "kvxfer/spectrum.h"

namespace kvxfer::spectrum {

/** Tier counts of the rule of kvxfer_spectrum_tier_counts (sinks included in count[FP16]). */
struct Counts {
  int64_t count[4] = {0, 0, 0, 0};  // indexed by kvxfer_tier_t
  int64_t sinks = 0;                // s'
  int64_t budget_units = 0;         // U, quarter-token units
};

/** Checks size/magic and every field; the message names the field. */
kvxfer_result_t validate_config(const kvxfer_spectrum_config_t* c);

/** Quarter-token units of each tier: FP16 4, INT8 2, INT4 1, DROP 0. */
constexpr int64_t kTierUnits[4] = {4, 2, 1, 0};

/** The largest num_tokens the policy accepts (keeps every product in int64). */
constexpr int64_t kMaxTokens = int64_t{1} << 40;

/**
 * The count rule for `n` non-sink tokens with `units` quarter-token units
 * (units >= n with int4, >= 0 without): out[FP16..DROP].
 */
void split_units(int64_t n, int64_t units, bool int4, int64_t out[4]);

kvxfer_result_t budget_fractions(double budget, int32_t allow_int4, double* fractions);
/** Validated config; n in [0, kMaxTokens]. */
kvxfer_result_t tier_counts(const kvxfer_spectrum_config_t* c, int64_t n, Counts* out);

/**
 * U = floor(4 n b_q), b_q = round(b 10^9) / 10^9, in exact integer arithmetic
 * (docs/SPECTRUMKV.md, "Token counts").  b in [0.25, 1], n in [0, 2^40].
 */
int64_t budget_units(double b, int64_t n);

kvxfer_result_t importance_from_attention(const float* mass, int32_t rows, int64_t n, float lambda,
                                          float* importance);
kvxfer_result_t importance_from_kv(const kvxfer_page_layout_t* pages, int32_t num_pages,
                                   float lambda, float* importance);

/**
 * The GREEDY order of tokens [begin, end): descending importance, ties the
 * later token first.  importance must be finite.  Shared with the
 * benchmark's keep/drop baselines so that every row ranks tokens alike.
 */
std::vector<int64_t> importance_order(const float* importance, int64_t begin, int64_t end);

kvxfer_result_t assign(const kvxfer_spectrum_config_t* c, int64_t n, const float* importance,
                       uint8_t* tiers);

/**
 * The codec config of kvxfer_send_spectrum in *out: `codec` made whole
 * (common/struct_abi.h), or with `codec` NULL the defaults with codec
 * SPECTRUM.  Errors: INVALID_ARGUMENT (another codec, or a bad struct).
 */
kvxfer_result_t send_codec_config(const kvxfer_codec_config_t* codec, kvxfer_codec_config_t* out);

kvxfer_result_t run_probe(const kvxfer_spectrum_config_t* base, kvxfer_spectrum_trial_fn trial,
                          void* user_data, int32_t* allow_int4, int32_t* passed, int32_t* run);

}  // namespace kvxfer::spectrum
