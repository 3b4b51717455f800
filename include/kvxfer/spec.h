/*
 * kvxfer speculative decoding on anchor-precision KV (docs/SPEC.md).
 *
 * With a progressive transfer (kvxfer_recv, KVXFER_MODE_PROGRESSIVE) the
 * decode node holds the whole KV at anchor precision at ANCHOR_READY, long
 * before COMPLETE.  Lynx (arXiv:2607.01831) drafts tokens on that approximate
 * KV while the residual is in flight, then verifies the draft in one batched
 * pass on the full-precision KV.  The output is exactly what decoding on the
 * full KV gives: token for token with greedy verification, in distribution
 * with stochastic verification.
 *
 * This header holds the pieces of that loop that do not depend on a model:
 *   - verification: kvxfer_spec_verify_greedy, kvxfer_spec_verify_stochastic
 *     (Lynx Eq. 10-11; Chen et al. 2023, "Accelerating Large Language Model
 *     Decoding with Speculative Sampling"), kvxfer_spec_sample;
 *   - how long to draft: kvxfer_spec_residual_time (from a request's live
 *     progress) and kvxfer_spec_window (ceil(t_res / TPOT) + margin, clamped
 *     by KVXFER_SPEC_MAX);
 *   - when to stop speculating: kvxfer_spec_monitor_t (running acceptance
 *     against KVXFER_SPEC_MIN_ACCEPT);
 *   - the latency model kvxfer_spec_ttft_model (Lynx Eq. 16-20).
 * examples/disagg_demo.cc runs the whole loop with the stories260K model.
 *
 * Conventions are those of kvxfer.h: every call returns kvxfer_result_t
 * (negative = error, text in kvxfer_get_last_error), structs carry
 * size/magic/version and start from their _INITIALIZER, and nothing is kept
 * between calls except in caller-owned structs.  Outputs are written only on
 * success.
 *
 * Thread-safety: every function is reentrant and may be called from any
 * thread.  A kvxfer_spec_monitor_t is plain caller-owned state: do not update
 * one monitor from two threads at once.
 */
#ifndef KVXFER_SPEC_H_
#define KVXFER_SPEC_H_

#include <stddef.h>
#include <stdint.h>

#include "kvxfer/kvxfer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Verification                                                              */
/* ------------------------------------------------------------------------ */

/**
 * Greedy verification of a draft.
 *
 * draft: int32 [draft_len] token ids s_1..s_d, drafted on the anchor KV.
 * target: int32 [draft_len + 1] the target model's argmax at every draft
 *   position, from one verification pass over the full KV: target[i] is the
 *   token the full-KV model chooses after the context and s_1..s_i, so
 *   target[i] is compared with draft[i], and target[draft_len] is the token
 *   after a fully accepted draft.
 * Result (the source equation):
 *   accepted   a = min({i : draft[i] != target[i]} U {draft_len})
 *   next_token = target[a]     (the correction, or the bonus token if a = d)
 * so draft[0..a-1] followed by next_token is exactly what greedy decoding on
 * the full KV produces: a + 1 final tokens per pass.
 * draft_len may be 0 (draft may then be NULL): a = 0, next_token = target[0].
 * Ownership: the arrays are read only.  Outputs: *accepted, *next_token.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL pointer, draft_len < 0, a negative
 *   token id in draft or target).
 */
kvxfer_result_t kvxfer_spec_verify_greedy(const int32_t* draft, int32_t draft_len,
                                          const int32_t* target, int32_t* accepted,
                                          int32_t* next_token);

/**
 * Stochastic (speculative-sampling) verification of a draft, Lynx Eq. 10-11
 * (Chen et al. 2023, Algorithm 2).
 *
 * draft: int32 [draft_len] tokens s_1..s_d, each sampled from its draft
 *   distribution q_i (the model on the anchor KV).
 * target_probs: float32 [draft_len + 1][vocab], row i = p_i, the target
 *   model's distribution (full KV) at draft position i; row draft_len is the
 *   distribution after a fully accepted draft.
 * draft_probs: float32 [draft_len][vocab], row i = q_i.
 * Rows need not be normalised: each is divided by its own sum (in double).
 * Every element must be finite and >= 0 and every row must have a positive sum.
 * seed: the caller's RNG seed; the result is a pure function of the inputs
 *   and the seed.  Use a new seed for every call (e.g. base + step).
 * Procedure, for i = 0, 1, ..., draft_len - 1, with u_i uniform in [0, 1):
 *   (Eq. 10) accept s_i iff  u_i * q_i(s_i) < p_i(s_i)
 *            (= "with probability min(1, p/q)"; q_i(s_i) = 0 < p_i(s_i) accepts,
 *            p_i(s_i) = 0 always rejects);
 *   (Eq. 11) at the first rejection, a = i and next_token is sampled from
 *            norm(max(0, p_i - q_i)); if that is zero everywhere (p_i = q_i,
 *            only possible for a draft token with q_i(s_i) = 0), from p_i.
 *   If nothing is rejected, a = draft_len and next_token is sampled from
 *   p_{draft_len}.
 * Then draft[0..a-1] followed by next_token is distributed exactly as
 * sampling from the target model (tests/spec_test.cc checks this with a
 * chi-square test).
 * RNG: draw j of a call is u = (splitmix64(seed + (j + 1) * 0x9E3779B97F4A7C15) >> 11) * 2^-53;
 * the acceptance test at position i uses draw 2i, the final sample (at
 * position a) draw 2a + 1, by inverse CDF over the token order.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL pointer, draft_len < 0, vocab < 1,
 *   a draft token outside [0, vocab), a negative or non-finite probability, a
 *   row summing to 0).  Everything is validated before any result is written.
 */
kvxfer_result_t kvxfer_spec_verify_stochastic(const int32_t* draft, int32_t draft_len,
                                              const float* target_probs, const float* draft_probs,
                                              int32_t vocab, uint64_t seed, int32_t* accepted,
                                              int32_t* next_token);

/**
 * Samples one token from `probs` (float32 [vocab], not necessarily
 * normalised; finite, >= 0, positive sum) with draw 0 of `seed` (the RNG of
 * kvxfer_spec_verify_stochastic), by inverse CDF.  For drafting from q.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT.
 */
kvxfer_result_t kvxfer_spec_sample(const float* probs, int32_t vocab, uint64_t seed,
                                   int32_t* token);

/* ------------------------------------------------------------------------ */
/* Speculative window                                                        */
/* ------------------------------------------------------------------------ */

/** Options of kvxfer_spec_residual_time and kvxfer_spec_window.  Its
 *  `size`, `magic` and `version`, like those of every struct of this header,
 *  follow KVXFER_CONFIG_MAGIC's rule (kvxfer.h); each has one layout. */
typedef struct {
  size_t size;      /**< sizeof(kvxfer_spec_window_config_t) */
  uint32_t magic;   /**< KVXFER_CONFIG_MAGIC */
  uint32_t version; /**< KVXFER_VERSION_CODE of the header used */
  /** Tokens drafted beyond ceil(t_res / TPOT), for estimation error; >= 0, default 2. */
  int32_t margin;
  /** The caller's own cap on the window (room left in the sequence, tokens
   *  wanted); 0 = none.  KVXFER_SPEC_MAX always applies. */
  int32_t max_tokens;
  /** Residual bytes per anchor byte, used until the residual's size is known
   *  (a receiver learns it only as the residual lands).  > 0; default 0.8:
   *  Lynx 4+4 with 32-token chunks, 4.04 residual bits per 5.07 anchor bits
   *  on stories260K pages.  Set it from a finished request of the same shape
   *  (residual_wire_bytes / anchor_wire_bytes) for a better first estimate. */
  double residual_ratio;
  /** Link rate in bytes/s to use while progress gives none (nothing received
   *  yet); 0 = none. */
  double link_bytes_per_s;
} kvxfer_spec_window_config_t;

#define KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER \
  { sizeof(kvxfer_spec_window_config_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 2, 0, 0.8, 0.0 }

/**
 * Predicts t_res, the time until a progressive receive reaches COMPLETE, from
 * its live progress (`info` from kvxfer_request_get_info on the receiver,
 * taken at CLOCK_MONOTONIC time now_ns).
 *   B_a  = info->anchor_wire_bytes            (every anchor has landed)
 *   B_r  = info->residual_wire_bytes          (residual bytes landed so far)
 *   B_rt = max(residual_ratio * B_a, B_r)     (expected residual total)
 *   left = B_rt - B_r, or B_r / num_pages (one more page) when that is 0
 *   R    = (B_a + B_r) / (now_ns - t_handshake_ns)   (the rate seen so far;
 *          config->link_bytes_per_s before any byte has landed)
 *   t_res = left / R  seconds.
 * COMPLETE, and MONOLITHIC requests (nothing follows the anchors), give 0.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, an uninitialised struct, a send
 *   request: only the receiver sees arrivals, a stage or mode outside its
 *   enum, a time that overflows); KVXFER_ERR_INVALID_USAGE (the
 *   anchors have not all landed, the request failed, or no rate is known).
 */
kvxfer_result_t kvxfer_spec_residual_time(const kvxfer_spec_window_config_t* config,
                                          const kvxfer_request_info_t* info, int64_t now_ns,
                                          double* t_res_s);

/**
 * The adaptive speculative window: how many tokens to draft in total since
 * drafting began, given that `elapsed_s` seconds have passed since then and
 * the residual is predicted to land in `t_res_s` more seconds:
 *   window = min(cap, ceil((elapsed_s + t_res_s) / tpot_s) + margin),
 *   cap    = min(KVXFER_SPEC_MAX, config->max_tokens if > 0).
 * At ANCHOR_READY (elapsed 0) this is the review's ceil(t_res / TPOT) +
 * margin; calling it again after every draft step re-predicts the landing
 * time from live progress without adding the margin twice.  tpot_s is the
 * measured time of one draft step (kvxfer_spec_monitor_t.tpot_s).
 * Draft while drafted < window and the request is not COMPLETE.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, an uninitialised config, margin
 *   or max_tokens < 0, tpot_s not > 0, t_res_s or elapsed_s negative or NaN).
 */
kvxfer_result_t kvxfer_spec_window(const kvxfer_spec_window_config_t* config, double t_res_s,
                                   double tpot_s, double elapsed_s, int32_t* window);

/**
 * How many of `draft_len` draft tokens one verification pass should check,
 * from the acceptance seen so far and the pass's measured cost.  A pass over
 * v draft tokens runs v + 1 tokens (the last final token and the v drafts)
 * and costs, in seconds, the latency model's
 *   t_ver(v) = verify_base_s + verify_per_token_s * (v + 1)
 * (docs/SPEC.md, "Latency model").  With each draft token accepted with the
 * per-token rate a (kvxfer_spec_monitor_t), independently, it commits in
 * expectation
 *   E(v) = sum_{i=0..v} a^i = (1 - a^(v+1)) / (1 - a)      (v + 1 when a = 1)
 * final tokens: the accepted prefix plus the target's own next token
 * (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
 * Decoding", Eq. 1).  length is the v in [1, draft_len] that commits the most
 * tokens per second, E(v) / t_ver(v) (the largest such v on a tie), or 0 when
 * that rate is below a decode step's, 1 / tpot_s, or draft_len is 0: the
 * caller then decodes (or passes only the last final token).  A fixed cost
 * (verify_base_s > 0) favours long passes; a per-token cost and a < 1
 * favour short ones; with verify_per_token_s = 0 (a GPU) the whole draft.
 * docs/SPEC.md, "Verified length".
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (length NULL, draft_len < 0 or above
 *   65536, accept_rate outside [0, 1], tpot_s not > 0, verify_base_s or
 *   verify_per_token_s negative, any value NaN or infinite).
 */
kvxfer_result_t kvxfer_spec_verify_length(int32_t draft_len, double accept_rate, double tpot_s,
                                          double verify_base_s, double verify_per_token_s,
                                          int32_t* length);

/* ------------------------------------------------------------------------ */
/* Acceptance monitor                                                        */
/* ------------------------------------------------------------------------ */

/**
 * Running acceptance of speculative decoding, and the decision to stop it.
 * Caller-owned; start from KVXFER_SPEC_MONITOR_INITIALIZER; the fields from
 * `rounds` on are maintained by the functions below (read them, do not write).
 * Per-token acceptance rate (the maximum-likelihood estimate of the
 * probability that a draft token is accepted, given that it is examined):
 *   rate = accepted / (accepted + rejected)      (1 while nothing is examined)
 * Once at least min_tokens draft tokens have been examined and rate <
 * min_accept, the monitor falls back for good (fallen_back = 1): the caller
 * stops drafting and waits for the full KV, as a monolithic transfer would.
 * The fallback is logged once (WARN, subsystem MODEL).
 */
typedef struct {
  size_t size;      /**< sizeof(kvxfer_spec_monitor_t) */
  uint32_t magic;   /**< KVXFER_CONFIG_MAGIC */
  uint32_t version; /**< KVXFER_VERSION_CODE of the header used */
  /** Fallback threshold in [0, 1]; < 0 = KVXFER_SPEC_MIN_ACCEPT (default 0.5). */
  double min_accept;
  /** Examined draft tokens needed before a fallback; >= 1, default 16. */
  int64_t min_tokens;
  /** Weight of a new sample in the TPOT moving average, in (0, 1]; default 0.2. */
  double tpot_weight;
  int64_t rounds;       /**< verification passes recorded */
  int64_t drafted;      /**< draft tokens submitted to verification */
  int64_t accepted;     /**< draft tokens accepted (sum of accepted prefixes) */
  int64_t rejected;     /**< passes that ended with a rejection (one examined token each) */
  int64_t full_accepts; /**< passes with draft_len >= 1 whose whole draft was accepted */
  double tpot_s;        /**< moving average of kvxfer_spec_monitor_record_step; 0 = none yet */
  int32_t fallen_back;  /**< 1 once speculation is off (sticky) */
} kvxfer_spec_monitor_t;

#define KVXFER_SPEC_MONITOR_INITIALIZER                                                           \
  {                                                                                               \
    sizeof(kvxfer_spec_monitor_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, -1.0, 16, 0.2, 0, 0, \
        0, 0, 0, 0.0, 0                                                                           \
  }

/**
 * Records one verification pass: `draft_len` tokens were verified and the
 * first `accepted` of them were kept (0 <= accepted <= draft_len).
 * *speculate (may be NULL) receives 1 if the caller should keep drafting,
 * 0 once the monitor has fallen back.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL or uninitialised monitor, bad
 *   counts, min_accept > 1, min_tokens < 1, malformed KVXFER_SPEC_MIN_ACCEPT).
 */
kvxfer_result_t kvxfer_spec_monitor_update(kvxfer_spec_monitor_t* monitor, int32_t draft_len,
                                           int32_t accepted, int32_t* speculate);

/** Records the duration of one decode step (seconds, > 0) in the TPOT moving average.
 *  The monitor is the caller's; one thread at a time per monitor.
 *  Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL or uninitialised monitor, seconds
 *  not finite or <= 0, min_accept > 1, min_tokens < 1, tpot_weight outside (0, 1]). */
kvxfer_result_t kvxfer_spec_monitor_record_step(kvxfer_spec_monitor_t* monitor, double seconds);

/** *speculate = 1 unless the monitor has fallen back; *rate (may be NULL) = the running
 *  acceptance rate, accepted / (accepted + rejected) examined tokens (1 before any).
 *  Reads the monitor only.
 *  Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL or uninitialised monitor, speculate NULL,
 *  the monitor's fields out of range as in kvxfer_spec_monitor_record_step). */
kvxfer_result_t kvxfer_spec_monitor_query(const kvxfer_spec_monitor_t* monitor, int32_t* speculate,
                                          double* rate);

/* ------------------------------------------------------------------------ */
/* Latency model (Lynx Eq. 16-20; docs/SPEC.md "Latency model")              */
/* ------------------------------------------------------------------------ */

/** The transfer schemes the model compares (array index of its outputs). */
typedef enum {
  KVXFER_SPEC_SCHEME_BF16 = 0, /**< monolithic bf16 */
  KVXFER_SPEC_SCHEME_INT8 = 1, /**< monolithic 8-bit */
  KVXFER_SPEC_SCHEME_INT4 = 2, /**< monolithic 4-bit */
  KVXFER_SPEC_SCHEME_LYNX = 3, /**< progressive anchor + residual, speculative decoding */
  KVXFER_SPEC_SCHEME_COUNT = 4
} kvxfer_spec_scheme_t;

/** Inputs of kvxfer_spec_ttft_model.  Times in seconds, sizes in bytes. */
typedef struct {
  size_t size;             /**< sizeof(kvxfer_spec_model_input_t) */
  uint32_t magic;          /**< KVXFER_CONFIG_MAGIC */
  uint32_t version;        /**< KVXFER_VERSION_CODE of the header used */
  double link_bytes_per_s; /**< R, > 0 */
  double burst_bytes;      /**< b: bytes the link passes before the rate binds (bucket depth) */
  double t_fixed_s;        /**< t0: per-transfer latency independent of size (handshake, ...) */
  double t_prefill_s;      /**< t_pre: prefill before the send; 0 = times counted from the send */
  double tpot_s;           /**< one decode step, > 0 */
  double t_verify_base_s;  /**< verification pass of k draft tokens: base + per_token * (k + 1) */
  double t_verify_per_token_s;
  double bytes[KVXFER_SPEC_SCHEME_COUNT]; /**< B_c, wire bytes of the whole KV per monolithic
                                               scheme; the LYNX entry is ignored */
  double anchor_bytes;                    /**< B_a, Lynx anchor sections */
  double residual_bytes;                  /**< B_r, Lynx residual sections */
  int32_t window;     /**< k, tokens drafted; < 0 = adaptive: ceil(t_res / TPOT) + margin */
  int32_t margin;     /**< >= 0, for window < 0 */
  int32_t max_window; /**< clamp of the adaptive window; 0 = none */
  /** v: the verification pass covers at most this many of the d draft tokens
   *  (the rest are dropped); 0 = all.  Worth setting where a batched pass
   *  costs about as much as that many decode steps (a CPU). */
  int32_t max_verify;
  double accept_rate; /**< alpha, per-token acceptance in [0, 1] */
  int32_t num_tokens; /**< N >= 1 for the time to N final tokens (e.g. 64) */
} kvxfer_spec_model_input_t;

#define KVXFER_SPEC_MODEL_INPUT_INITIALIZER                                                     \
  {                                                                                             \
    sizeof(kvxfer_spec_model_input_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0.0, 0.0, 0.0, \
        0.0, 0.0, 0.0, 0.0, {0.0, 0.0, 0.0, 0.0}, 0.0, 0.0, -1, 2, 0, 0, 0.0, 64                \
  }

/** Outputs of kvxfer_spec_ttft_model, indexed by kvxfer_spec_scheme_t. */
typedef struct {
  size_t size;                                    /**< sizeof(kvxfer_spec_model_output_t) */
  uint32_t magic;                                 /**< KVXFER_CONFIG_MAGIC */
  uint32_t version;                               /**< KVXFER_VERSION_CODE of the header used */
  double t_ready_s[KVXFER_SPEC_SCHEME_COUNT];     /**< decoding may start (Lynx: anchors landed) */
  double ttft_s[KVXFER_SPEC_SCHEME_COUNT];        /**< first output token emitted */
  double ttft_commit_s[KVXFER_SPEC_SCHEME_COUNT]; /**< first token final (verified) */
  double ttnt_s[KVXFER_SPEC_SCHEME_COUNT];        /**< num_tokens final tokens */
  double t_res_s;           /**< residual transfer after the anchors, B_r / R */
  double exposure_s;        /**< max(0, t_res - k * TPOT) */
  double expected_accepted; /**< abar = sum_{i=1..v} alpha^i */
  int32_t window;           /**< k, the window used */
  int32_t drafted;          /**< d = min(k, ceil(t_res / TPOT)) */
  int32_t verified;         /**< v = min(d, max_verify or d) */
} kvxfer_spec_model_output_t;

#define KVXFER_SPEC_MODEL_OUTPUT_INITIALIZER                                                    \
  {                                                                                             \
    sizeof(kvxfer_spec_model_output_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, {0, 0, 0, 0}, \
        {0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, 0.0, 0.0, 0.0, 0, 0, 0                        \
  }

/**
 * The TTFT model (the paper's Eq. 16-20 as docs/SPEC.md reads them):
 *   (16) t_x(B) = t0 + max(0, B - b) / R                     transfer of B bytes
 *   (17) TTFT_c = t_pre + t_x(B_c) + TPOT                    c = BF16, INT8
 *   (18) TTFT_c = t_pre + t_x(B_c) + TPOT                    c = INT4
 *   (19) t_a = t_x(B_a),  t_res = B_r / R,  E = max(0, t_res - k TPOT)
 *   (20) TTFT_Lynx = t_pre + t_a + TPOT                      k >= 1: the first token
 *                                                            is drafted on the anchors
 *                  = t_pre + t_a + t_res + t_ver(0)          k = 0: no speculation
 * Drafting stops at COMPLETE or after k tokens, so d = min(k, ceil(t_res/TPOT))
 * tokens are drafted; the first v = min(d, max_verify or d) are verified in
 * one pass once the residual is in:
 *   TTFT_commit_Lynx = t_pre + t_a + max(d TPOT, t_res) + t_ver(v)
 *                    (= t_pre + t_a + k TPOT + E + t_ver(k) when v = d = k)
 * with t_ver(v) = t_verify_base + t_verify_per_token (v + 1).  Time to N final
 * tokens:  monolithic  t_pre + t_x(B_c) + N TPOT;
 *          Lynx        TTFT_commit_Lynx + max(0, N - (abar + 1)) TPOT,
 *                      abar = sum_{i=1..v} alpha^i  (expected accepted prefix).
 * Monolithic schemes have ttft_commit = ttft.  Adaptive window (window < 0):
 * k = ceil(t_res / TPOT) + margin, clamped to max_window when that is > 0.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, uninitialised structs, R or TPOT
 *   not > 0, negative or non-finite times or sizes, alpha outside [0, 1],
 *   num_tokens < 1, margin, max_window or max_verify < 0, an output time
 *   that overflows: R too small for the sizes).
 */
kvxfer_result_t kvxfer_spec_ttft_model(const kvxfer_spec_model_input_t* in,
                                       kvxfer_spec_model_output_t* out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVXFER_SPEC_H_ */
