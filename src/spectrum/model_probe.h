// SpectrumKV on the reference model runner (src/model): the KV round trip
// through the page codec with per-token tiers, greedy agreement and
// perplexity of a teacher-forced continuation, and the built-in INT4
// tolerance probe (docs/SPECTRUMKV.md, "The built-in probe").
//
// Not part of libkvxfer.so: used by tests/spectrum_test.cc and
// perf/spectrum_quality.  Functions return bool and set *error on failure
// (the convention of src/model); the codec's own errors are quoted.
// Thread-safety: every function is reentrant (the Model is read only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "kvxfer/spectrum.h"
#include "model/llama2.h"

namespace kvxfer::spectrum {

namespace km = kvxfer::model;

/**
 * A KV cache after a transfer: every layer's K and V encoded as one page of
 * all n tokens, then decoded (anchor + residual, or anchor only).
 */
struct TransferredKV {
  km::KVCache kv;             // decoded values, float32 [L][n][kv_dim]
  std::vector<uint8_t> drop;  // [n]: 1 where the tier is DROP (empty: none dropped)
  uint64_t anchor_bytes = 0;  // sum of the anchor sections (K and V, all layers)
  uint64_t residual_bytes = 0;
  /** A view of kv with the drop mask on every layer (valid while *this lives). */
  km::KVView view() const;
};

/**
 * Encodes kv's n tokens page by page and decodes them into *out.
 * tiers: uint8 [n] kvxfer_tier_t for codec KVXFER_CODEC_SPECTRUM
 * (kvxfer_page_encode_tiered); must be nullptr for any other codec
 * (kvxfer_page_encode).  anchor_only: decode the anchor sections alone, and
 * count no residual bytes.
 */
bool transfer_kv(const km::KVCache& kv, const kvxfer_codec_config_t& codec, const uint8_t* tiers,
                 bool anchor_only, TransferredKV* out, std::string* error);

/** BOS (1), then tokens sampled at temperature 1 with a splitmix64 stream of `seed`. */
bool sample_tokens(const km::Model& m, int length, uint64_t seed, std::vector<int>* out,
                   std::string* error);

/**
 * A prompt's full-precision prefill and its greedy continuation:
 * prefix = prompt[0..n-2] is prefilled (its KV is what a transfer moves); the
 * continuation feeds prompt[n-1] then `steps` - 1 full-precision greedy
 * tokens, and ref[j] is the full-precision argmax after feed[0..j].
 */
struct Continuation {
  km::KVCache kv;                     // prefill of the prefix, n - 1 tokens
  std::vector<float> attention_mass;  // PrefillResult::attention_mass of the prefix
  std::vector<int> feed, ref;         // [steps]
  std::vector<float> queries;         // [L][steps][dim]: the continuation's queries
  double nll_full = 0;                // sum of -log p(ref[j]) on the full KV
};
bool make_continuation(const km::Model& m, const std::vector<int>& prompt, int steps,
                       Continuation* out, std::string* error);

/**
 * Teacher-forced pass of c.feed over `view` (one batched Model::verify):
 * *agree = positions whose argmax equals c.ref, *nll = sum of -log p(ref[j])
 * (natural log, double).  Perplexity = exp(nll / steps).
 */
bool score_view(const km::Model& m, const Continuation& c, const km::KVView& view, int* agree,
                double* nll, std::string* error);

/** Importance of the prefix tokens from c.attention_mass
 * (kvxfer_spectrum_importance_from_attention). */
bool attention_importance(const km::Model& m, const Continuation& c, float lambda,
                          std::vector<float>* importance, std::string* error);

/** Options of the built-in probe. */
struct ProbeOptions {
  int prompt_tokens = 256;     // sampled prompt length per trial (<= seq_len - steps)
  int steps = 64;              // teacher-forced continuation tokens per trial
  double min_agreement = 0.5;  // agreement floor of a passing trial
  uint64_t seed = 0x5BEC7;     // trial k samples its prompt with seed + k
  kvxfer_spectrum_config_t base = KVXFER_SPECTRUM_CONFIG_INITIALIZER;
  kvxfer_codec_config_t codec = KVXFER_CODEC_CONFIG_INITIALIZER;  // codec forced to SPECTRUM
};

struct ProbeTrial {
  int steps = 0;
  int agree = 0;           // 3-tier greedy at b = 0.3 (the trial)
  int agree_fallback = 0;  // same prompt, allow_int4 = 0 (for the record)
  double ppl_ratio = 0;    // perplexity 3-tier / full precision
  bool passed = false;
};

struct ProbeReport {
  int allow_int4 = 0, passed = 0, run = 0;
  std::vector<ProbeTrial> trials;
};

/**
 * The built-in INT4 tolerance probe: kvxfer_spectrum_run_probe with a trial
 * that samples a prompt, prefills it, assigns 3-tier GREEDY tiers at
 * b = 0.3 from the attention-mass importance, transfers the KV through the
 * SpectrumKV codec (full precision), and measures greedy agreement over
 * `steps` teacher-forced tokens.  It passes when that agreement is >=
 * min_agreement (INT4 is not catastrophic) and >= the agreement of the
 * 2-tier fallback (allow_int4 = 0) on the same prompt and budget (INT4 does
 * not do worse than what the runtime would do without it).  Deterministic.
 */
bool probe_model(const km::Model& m, const ProbeOptions& opt, ProbeReport* out, std::string* error);

}  // namespace kvxfer::spectrum
