/*
 * kvxfer SpectrumKV precision policy (docs/SPECTRUMKV.md).
 *
 * SpectrumKV (Yang, "SpectrumKV: Per-Token Mixed-Precision KV Cache Transfer
 * for Prefill-Decode Disaggregated LLM Serving", arXiv:2606.08635) gives each
 * token of a KV cache its own precision tier (kvxfer_tier_t in kvxfer.h):
 * attention sinks and important tokens FP16, medium ones INT8, the rest INT4
 * when the model tolerates INT4, else the 2-tier fallback FP16 + INT8 (and
 * DROP below a budget of 1/2).  The page codec KVXFER_CODEC_SPECTRUM
 * (kvxfer_page_encode_tiered, kvxfer.h) encodes a page from such a tier map.
 *
 * This header holds the policy, which does not depend on a model:
 *   - the budget mapping: a normalised budget b (fp16 = 1, int8 = 1/2,
 *     int4 = 1/4, drop = 0 per token) to exact tier fractions
 *     (kvxfer_spectrum_budget_fractions) and to token counts that never
 *     exceed the budget (kvxfer_spectrum_tier_counts);
 *   - token importance I_j = A_j * exp(-lambda * Delta_j) from attention
 *     mass (kvxfer_spectrum_importance_from_attention) or, without attention
 *     statistics, from the KV norm (kvxfer_spectrum_importance_from_kv);
 *   - the assignment of tiers (kvxfer_spectrum_assign): the first s tokens
 *     (sinks) FP16, then the sorted-importance rule (the paper's
 *     Proposition 1), or one of the baseline variants;
 *   - the INT4 tolerance probe (kvxfer_spectrum_run_probe): the runtime's own
 *     trials under 3-tier greedy at b = 0.3, INT4 allowed when at least 2 of
 *     3 pass.
 *
 * Conventions are those of kvxfer.h: every call returns kvxfer_result_t
 * (negative = error, text in kvxfer_get_last_error), structs carry
 * size/magic/version and start from their _INITIALIZER, and outputs are
 * written only on success.
 *
 * Thread-safety: every function is reentrant and may be called from any
 * thread; nothing is kept between calls.  kvxfer_spectrum_run_probe calls the
 * trial callback on the calling thread, one trial at a time.
 */
#ifndef KVXFER_SPECTRUM_H_
#define KVXFER_SPECTRUM_H_

#include <stddef.h>
#include <stdint.h>

#include "kvxfer/kvxfer.h"

#ifdef __cplusplus
extern "C" {
#endif

/** How kvxfer_spectrum_assign places the tiers (docs/SPECTRUMKV.md, "Variants"). */
typedef enum {
  /** SpectrumKV: sinks FP16, then tiers by descending importance (Proposition 1). */
  KVXFER_SPECTRUM_GREEDY = 0,
  /** Importance-blind baseline: sinks FP16, then tiers by recency (the most
   *  recent tokens get the most precise tiers); importance is not read. */
  KVXFER_SPECTRUM_SINK_PROTECT = 1,
  /** Sinks FP16, then the budget split evenly over consecutive windows of
   *  balance_tokens tokens, the sorted-importance rule inside each window:
   *  every part of the context gets the same tier mix. */
  KVXFER_SPECTRUM_BALANCED = 2,
  /** Sinks FP16, then the same tier counts as GREEDY on a random
   *  permutation of the other tokens (seeded; importance is not read). */
  KVXFER_SPECTRUM_RANDOM = 3
} kvxfer_spectrum_variant_t;

/**
 * SpectrumKV policy parameters.  Initialise with
 * KVXFER_SPECTRUM_CONFIG_INITIALIZER, then change fields.  `size`, `magic`
 * and `version` follow KVXFER_CONFIG_MAGIC's rule (kvxfer.h); one layout.
 */
typedef struct {
  size_t size;      /**< sizeof(kvxfer_spectrum_config_t) */
  uint32_t magic;   /**< KVXFER_CONFIG_MAGIC */
  uint32_t version; /**< KVXFER_VERSION_CODE of the header used */
  /** b: payload budget per token in units of an fp16 token, in [0.25, 1];
   *  default 0.55 (every token at least INT8, the sinks and about a tenth of
   *  the tokens FP16; at exactly 1/2 nothing is left to pin the sinks).  A
   *  double, read to the nearest 10^-9 (docs/SPECTRUMKV.md). */
  double budget;
  /** s: the first s tokens of the request are attention sinks, pinned to
   *  FP16 inside the budget (as many as the budget can pay for without
   *  pushing another token below the cheapest tier of the budget mapping);
   *  >= 0, default 4.  Use 0 for a request that does not start the sequence. */
  int32_t sink_tokens;
  /** lambda: recency decay per token of the importance, finite, >= 0;
   *  default 1/256 (docs/SPECTRUMKV.md says why). */
  float lambda;
  kvxfer_spectrum_variant_t variant; /**< default KVXFER_SPECTRUM_GREEDY */
  uint64_t seed;                     /**< RANDOM only; default 0 */
  /** 1: INT4 may be used (the probe passed); 0: the 2-tier fallback
   *  FP16 + INT8, with DROP below b = 1/2.  Default 0: INT4 needs a probe. */
  int32_t allow_int4;
  /** BALANCED only: window in tokens, >= 1; default 32. */
  int32_t balance_tokens;
} kvxfer_spectrum_config_t;

#define KVXFER_SPECTRUM_CONFIG_INITIALIZER                                               \
  {                                                                                      \
    sizeof(kvxfer_spectrum_config_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0.55, 4, \
        0.00390625f, KVXFER_SPECTRUM_GREEDY, 0, 0, 32                                    \
  }

/* ------------------------------------------------------------------------ */
/* Budget mapping                                                            */
/* ------------------------------------------------------------------------ */

/**
 * The exact tier fractions of a budget, before sinks and integer rounding
 * (docs/SPECTRUMKV.md, "Budget mapping"; the 3-tier line is the paper's):
 *   b in [1/2, 1]            2-tier:  f16 = 2b - 1,  f8 = 2 - 2b
 *   b in [1/4, 1/2), int4    3-tier:  f8 = 4b - 1,   f4 = 2 - 4b
 *   b in [1/4, 1/2), no int4 drop:    f8 = 2b,       fd = 1 - 2b
 * (every other fraction 0), so f16 + f8/2 + f4/4 = b and the fractions sum
 * to 1.  At b = 1/2 both sides give f8 = 1.
 * fractions: double [4], indexed by kvxfer_tier_t (FP16, INT8, INT4, DROP).
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, b not in [0.25, 1] or NaN,
 *   allow_int4 not 0 or 1).
 */
kvxfer_result_t kvxfer_spectrum_budget_fractions(double budget, int32_t allow_int4,
                                                 double* fractions);

/**
 * Token counts per tier for `num_tokens` tokens (the rule of
 * docs/SPECTRUMKV.md, "Token counts"), in integer quarter-token units:
 *   U  = floor(4 n b_q), b_q = round(b 10^9) 10^-9   the budget (fp16 = 4, int8 = 2,
 *                                                 int4 = 1, drop = 0 units), exact
 *   s' = min(s, n, floor((U - c n) / (4 - c)))    sinks the budget can pay for,
 *                                                 c = 2 if U >= 2n, else 1 with
 *                                                 int4, 0 without (the cheapest
 *                                                 tier the mapping uses)
 *   n' = n - s',  U' = U - 4 s'                   the other tokens and their budget
 *   U' >= 2n':           n16 = floor((U' - 2n') / 2),  n8 = n' - n16
 *   U' <  2n', int4:     n8 = U' - n',                 n4 = 2n' - U'
 *   U' <  2n', no int4:  n8 = floor(U' / 2),           nd = n' - n8
 * counts[FP16] includes the s' sinks.  4 n16 + 2 n8 + n4 <= U always, and
 * from b = 1/2 up (U >= 2n) no token is INT4 or DROP.
 * counts: int64 [4] indexed by kvxfer_tier_t; sinks (may be NULL): s'.
 * num_tokens may be 0 (all counts 0).
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, a bad config, num_tokens < 0
 *   or > 2^40).
 */
kvxfer_result_t kvxfer_spectrum_tier_counts(const kvxfer_spectrum_config_t* config,
                                            int64_t num_tokens, int64_t* counts, int64_t* sinks);

/* ------------------------------------------------------------------------ */
/* Importance                                                                */
/* ------------------------------------------------------------------------ */

/**
 * Importance from attention statistics (the paper's definition):
 *   A_j = sum_r attention_mass[r * num_tokens + j]      (in double)
 *   I_j = A_j * exp(-lambda * Delta_j),  Delta_j = num_tokens - 1 - j
 * so the last token has Delta 0.  Rows r are what the runtime aggregates
 * over, typically one per (layer, head), each the attention probability that
 * token j received, summed over the prefill queries (models/llama2.h's
 * PrefillResult::attention_mass has this layout).  Delta counts tokens to the
 * end of the given range: pass the whole sequence.
 * attention_mass: float32 [num_rows][num_tokens], finite, >= 0 (read only).
 * importance: float32 [num_tokens] output (I_j rounded to float, at most
 *   FLT_MAX; it may underflow to 0 for large lambda * Delta, ties are then
 *   broken by position in kvxfer_spectrum_assign).
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL with num_tokens > 0, num_rows < 1,
 *   num_tokens < 0, lambda negative or not finite, a negative or non-finite
 *   mass, named by row and token).
 */
kvxfer_result_t kvxfer_spectrum_importance_from_attention(const float* attention_mass,
                                                          int32_t num_rows, int64_t num_tokens,
                                                          float lambda, float* importance);

/**
 * Importance when the runtime has no attention statistics: the KV norm.
 *   A_j = sum_p || row j of pages[p] ||_2      (all channels, in double)
 *   I_j = A_j * exp(-lambda * Delta_j),  Delta_j = T - 1 - j
 * pages: num_pages >= 1 layouts (kvxfer.h), all with the same num_tokens T
 *   (e.g. K and V of every layer over the whole sequence); any dtype and
 *   channel count; read only.  The transfer engine calls this when the
 *   runtime supplies no importance.
 * importance: float32 [T] output (rounded to float, at most FLT_MAX).
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, num_pages < 1, a bad layout,
 *   pages of different num_tokens, lambda negative or not finite),
 *   KVXFER_ERR_NONFINITE (NaN/Inf input, naming page, token and channel).
 */
kvxfer_result_t kvxfer_spectrum_importance_from_kv(const kvxfer_page_layout_t* pages,
                                                   int32_t num_pages, float lambda,
                                                   float* importance);

/* ------------------------------------------------------------------------ */
/* Assignment                                                                */
/* ------------------------------------------------------------------------ */

/**
 * Assigns a tier to each of `num_tokens` tokens.
 * Tokens 0..s'-1 (s' of kvxfer_spectrum_tier_counts) get FP16.  The others
 * are put in an order and given, in that order, n16 - s' FP16, then n8 INT8,
 * n4 INT4 and nd DROP (the counts of kvxfer_spectrum_tier_counts):
 *   GREEDY        descending importance, ties: the later token first
 *                 (Proposition 1: for any per-tier errors e_FP16 <= e_INT8 <=
 *                 e_INT4 <= e_DROP this minimises sum_j I_j e(tier_j) over
 *                 all assignments with these counts);
 *   SINK_PROTECT  descending position (the most recent first);
 *   BALANCED      windows of balance_tokens consecutive non-sink tokens, window
 *                 w of n_w tokens with budget floor(U' n_w / n') units and its
 *                 own counts by the same rule, GREEDY order inside the window;
 *   RANDOM        a Fisher-Yates permutation drawn from splitmix64(seed)
 *                 (docs/SPECTRUMKV.md gives the exact stream).
 * The result is a pure function of the arguments, and never exceeds the
 * budget.
 * importance: float32 [num_tokens], finite (read only); GREEDY and BALANCED
 *   only, may be NULL for SINK_PROTECT and RANDOM.
 * tiers: uint8 [num_tokens] output, kvxfer_tier_t values.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, a bad config, num_tokens < 0 or
 *   > 2^40, a non-finite importance, named by token).
 */
kvxfer_result_t kvxfer_spectrum_assign(const kvxfer_spectrum_config_t* config, int64_t num_tokens,
                                       const float* importance, uint8_t* tiers);

/* ------------------------------------------------------------------------ */
/* INT4 tolerance probe                                                      */
/* ------------------------------------------------------------------------ */

/** Trials of kvxfer_spectrum_run_probe, and the passes it needs. */
#define KVXFER_SPECTRUM_PROBE_TRIALS 3
#define KVXFER_SPECTRUM_PROBE_PASSES 2
/** The budget the probe trials run at (the paper's "aggressive" b). */
#define KVXFER_SPECTRUM_PROBE_BUDGET 0.3

/**
 * One trial of the runtime's INT4 tolerance probe.  `trial` is 0, 1 or 2;
 * `config` is the policy to test (3-tier GREEDY, allow_int4 = 1, budget
 * KVXFER_SPECTRUM_PROBE_BUDGET).  The runtime runs its own test (e.g. a
 * needle-in-a-haystack retrieval) with the KV transferred under `config`,
 * and sets *passed to 1 (the model kept its answer) or 0.
 * Returning a negative result aborts the probe with that result.
 * The paper's trial (and the built-in one on kvxfer's reference runner,
 * probe_niah in models/model_probe.h): a needle-in-a-haystack prompt
 * with a passkey hidden at a different depth per trial; passed = the greedy
 * answer over the KV transferred under `config` contains the passkey.
 * `config` is owned by the probe and valid during the call only; user_data
 * is passed through unchanged.  Called on the thread that called
 * kvxfer_spectrum_run_probe, one trial at a time.
 */
typedef kvxfer_result_t (*kvxfer_spectrum_trial_fn)(int32_t trial,
                                                    const kvxfer_spectrum_config_t* config,
                                                    int32_t* passed, void* user_data);

/**
 * Runs the INT4 tolerance probe: trials 0, 1, 2 in order under `base` with
 * variant GREEDY, allow_int4 1 and budget KVXFER_SPECTRUM_PROBE_BUDGET
 * (sink_tokens, lambda and the rest from `base`; NULL = defaults).  INT4 is
 * allowed when at least KVXFER_SPECTRUM_PROBE_PASSES of the
 * KVXFER_SPECTRUM_PROBE_TRIALS trials pass.  Trials stop as soon as the
 * verdict is decided (after 2 passes or 2 failures), so 2 or 3 run.
 * allow_int4: output 0/1 (put it in the policy's config); passed, run
 *   (may be NULL): trials passed and trials run.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL trial or allow_int4, a bad base,
 *   a trial setting *passed to other than 0 or 1); a trial's own error.
 */
kvxfer_result_t kvxfer_spectrum_run_probe(const kvxfer_spectrum_config_t* base,
                                          kvxfer_spectrum_trial_fn trial, void* user_data,
                                          int32_t* allow_int4, int32_t* passed, int32_t* run);

/* ------------------------------------------------------------------------ */
/* Transfers (kvxfer_send / kvxfer_recv, kvxfer.h)                           */
/* ------------------------------------------------------------------------ */

/**
 * kvxfer_send with SpectrumKV pages (docs/FORMAT.md section 6): the policy
 * chooses one tier per token once for the request (kvxfer_spectrum_assign),
 * the same for every layer's K and V, and every page carries its tokens'
 * precision map in the anchor section.  Progressive as the other split
 * codecs: the anchor class carries the INT8 tokens' anchors, the FP16
 * tokens' high bytes and all INT4 tokens; the residual class the rest.
 * kvxfer_send with codec SPECTRUM is this call with policy and importance
 * NULL.
 * codec: chunk_tokens, anchor_bits (the INT8 tier's split) and nonfinite;
 *   codec must be KVXFER_CODEC_SPECTRUM; NULL = defaults with SPECTRUM.
 * policy: NULL = KVXFER_SPECTRUM_CONFIG_INITIALIZER (INT4 off until a probe
 *   allows it).  Copied; need not outlive the call.
 * importance: float32 [kv->num_tokens] (the runtime's I_j, e.g. from
 *   kvxfer_spectrum_importance_from_attention), read during the call only;
 *   NULL = the KV norm over every layer's K and V
 *   (kvxfer_spectrum_importance_from_kv, computed here on the calling thread).
 * The KV must be in host memory (no GPU encoder for SPECTRUM yet).  The
 * receiver posts a plain kvxfer_recv and reads the tiers with
 * kvxfer_request_get_tiers (DROP tokens decode to 0: mask them).
 * Errors: those of kvxfer_send; KVXFER_ERR_INVALID_ARGUMENT (a bad policy,
 *   a non-finite importance, named by token); KVXFER_ERR_UNSUPPORTED (KV on a
 *   CUDA device); KVXFER_ERR_NONFINITE (KV norm of NaN/Inf input).
 */
kvxfer_result_t kvxfer_send_spectrum(kvxfer_comm_t comm, int peer, const kvxfer_kv_desc_t* kv,
                                     const kvxfer_codec_config_t* codec,
                                     const kvxfer_spectrum_config_t* policy,
                                     const float* importance, const kvxfer_request_config_t* config,
                                     kvxfer_request_t* request);

/**
 * The tier (kvxfer_tier_t) of each token of a SPECTRUM request.  Sender: any
 * time after posting.  Receiver: once the request is ANCHOR_READY (read from
 * the pages' precision maps, which passed their checksums).
 * tiers: uint8 [num_tokens] output; num_tokens must be the request's.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, wrong num_tokens),
 *   KVXFER_ERR_INVALID_USAGE (codec not SPECTRUM, receiver not yet
 *   ANCHOR_READY, or failed).
 */
kvxfer_result_t kvxfer_request_get_tiers(kvxfer_request_t request, uint8_t* tiers,
                                         int64_t num_tokens);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVXFER_SPECTRUM_H_ */
