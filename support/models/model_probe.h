// SpectrumKV on the reference model runner (support/models/): the KV round trip
// through the page codec with per-token tiers, greedy agreement and
// perplexity of a teacher-forced continuation, and the built-in INT4
// tolerance probe (docs/SPECTRUMKV.md, "The built-in probe").
//
// Not part of libkvxfer.so: used by tests/spectrum_test.cc and
// perf/spectrum_quality.  Functions return bool and set *error on failure
// (the convention of support/models/); the codec's own errors are quoted.
// Thread-safety: every function is reentrant (the Model is read only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "kvxfer/spectrum.h"
#include "models/bpe_tokenizer.h"
#include "models/chat_template.h"
#include "models/llama2.h"

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
  std::vector<int> prefix;            // the prefilled tokens, n - 1
  km::KVCache kv;                     // prefill of the prefix, n - 1 tokens
  std::vector<float> attention_mass;  // PrefillResult::attention_mass of the prefix
  std::vector<int> feed, ref;         // [steps]
  // [steps] or empty: the tokens the perplexity scores (a real text's next
  // tokens); empty = ref (the model's own full-precision greedy tokens).
  std::vector<int> target;
  std::vector<float> queries;  // [L][steps][dim]: the continuation's queries
  double nll_full = 0;         // sum of -log p(target or ref [j]) on the full KV
};
bool make_continuation(const km::Model& m, const std::vector<int>& prompt, int steps,
                       Continuation* out, std::string* error);

/**
 * A real text's continuation over its prompt (perplexity on real text):
 * tokens[0..prompt_kv_tokens-1] are prefilled (the KV a transfer moves);
 * feed[j] = tokens[prompt_kv_tokens + j] and target[j] = tokens[prompt_kv_tokens
 * + j + 1] for j < steps (teacher forcing on the text itself); ref[j] is the
 * full-precision argmax after feed[0..j] (greedy agreement).  Needs
 * prompt_kv_tokens >= 1, steps >= 1, prompt_kv_tokens + steps + 1 <=
 * tokens.size() and prompt_kv_tokens + steps <= seq_len.
 */
bool make_text_continuation(const km::Model& m, const std::vector<int>& tokens,
                            int prompt_kv_tokens, int steps, Continuation* out, std::string* error);

/**
 * Teacher-forced pass of c.feed over `view` (one batched Model::verify):
 * *agree = positions whose argmax equals c.ref, *nll = sum of -log p(t[j])
 * with t = c.target, or c.ref when c.target is empty (natural log, double).
 * Perplexity = exp(nll / steps).
 */
bool score_view(const km::Model& m, const Continuation& c, const km::KVView& view, int* agree,
                double* nll, std::string* error);

/**
 * Perplexity of the prefix itself over `view` (a transferred copy of c.kv,
 * docs/SPECTRUMKV.md, "Perplexity: two protocols"): position i of the prefix
 * is re-scored over rows 0..i of the view (Model::score_over_view, in
 * batches of 128 tokens) and predicts the next token of the sequence
 * (prefix[i+1], then feed[0]).  *nll = the sum of -log p over those
 * prefix.size() positions (natural log, double); perplexity = exp(nll / n).
 * The view must hold prefix.size() tokens with token 0 present.
 */
bool score_prefix_view(const km::Model& m, const Continuation& c, const km::KVView& view,
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

// ---------------------------------------------------------------------------
// Needle in a haystack (NIAH) on a chat model: the paper's retrieval test and
// its INT4 tolerance probe (docs/SPECTRUMKV.md, "Needle in a haystack").
// ---------------------------------------------------------------------------

/** How a NIAH prompt is built. */
struct NiahOptions {
  /** The haystack is the text cut at its last line break within this many
   *  tokens (0: the whole text). */
  int haystack_tokens = 0;
  /** The needle, with "{}" where the passkey goes; inserted as a line of
   *  its own. */
  std::string needle = "The secret passkey is {}.";
  /** Asked after the haystack, in the same user turn. */
  std::string question =
      "What is the secret passkey mentioned in the text above? Answer with the number only.";
  int answer_tokens = 24;  // greedy tokens decoded (fewer when <|im_end|> comes)
};

/**
 * One NIAH prompt, prefilled at full precision.  The user turn is the
 * haystack with the needle line inserted after the first line break at or
 * after byte floor(depth * haystack bytes) (at the start for depth 0), a
 * blank line, then the question; it is rendered with the chat template
 * (system turn, user turn, assistant generation prompt) and encoded with
 * special tokens (BOS first when the tokenizer asks for it).
 * The KV of prompt[0..n-2] is what a transfer moves (n = prompt.size()); the
 * decode side feeds prompt[n-1] over the transferred KV, so every answer
 * token is computed from it.
 */
struct NiahCase {
  double depth = 0;
  std::string passkey;
  std::vector<int> prompt;            // chat prompt, token ids
  int needle_token = 0;               // first token of the needle line in prompt
  km::KVCache kv;                     // prefill of prompt[0..n-2]
  std::vector<float> attention_mass;  // PrefillResult::attention_mass of that prefill
};
bool make_niah_case(const km::Model& m, const km::BpeTokenizer& tok, const km::ChatTemplate& chat,
                    const std::string& haystack, double depth, const std::string& passkey,
                    const NiahOptions& opt, NiahCase* out, std::string* error);

/**
 * Greedy answer over `view` (the transferred KV of c, drop mask included):
 * feeds c.prompt.back(), then decodes up to opt.answer_tokens tokens, stopping
 * after the tokenizer's end-of-turn token (<|im_end|>) or EOS.  *answer: the
 * decoded text; *found: the answer contains c.passkey.
 */
bool niah_answer(const km::Model& m, const km::BpeTokenizer& tok, const NiahCase& c,
                 const km::KVView& view, const NiahOptions& opt, std::string* answer, bool* found,
                 std::string* error);

/** Importance of a NIAH case's prefilled tokens (from c.attention_mass). */
bool niah_importance(const km::Model& m, const NiahCase& c, float lambda,
                     std::vector<float>* importance, std::string* error);

/** Options of the built-in NIAH probe. */
struct NiahProbeOptions {
  std::string haystack;                                             // the long real text
  double depths[KVXFER_SPECTRUM_PROBE_TRIALS] = {0.25, 0.5, 0.75};  // trial k's needle depth
  std::string passkeys[KVXFER_SPECTRUM_PROBE_TRIALS] = {"48213", "70546", "93187"};
  NiahOptions niah;
  kvxfer_spectrum_config_t base = KVXFER_SPECTRUM_CONFIG_INITIALIZER;
  kvxfer_codec_config_t codec = KVXFER_CODEC_CONFIG_INITIALIZER;  // codec forced to SPECTRUM
};

struct NiahProbeTrial {
  double depth = 0;
  std::string passkey;
  int prompt_tokens = 0;
  std::string answer;       // greedy answer under the probe's policy
  bool found = false;       // the trial's result: answer contains the passkey
  std::string answer_full;  // greedy answer over the full-precision KV (for the record)
  bool found_full = false;
};

struct NiahProbeReport {
  int allow_int4 = 0, passed = 0, run = 0;
  std::vector<NiahProbeTrial> trials;
};

/**
 * The paper's INT4 tolerance probe on the bundled runner:
 * kvxfer_spectrum_run_probe with a trial k that builds the NIAH case of
 * depths[k] / passkeys[k] (make_niah_case), computes the attention-mass
 * importance with the config's lambda, assigns tiers under the config the
 * probe passes (3-tier GREEDY at b = 0.3), sends every layer's K and V
 * through the SPECTRUM codec (full decode), masks DROP tokens, and passes
 * when the greedy answer contains the passkey.  INT4 is enabled iff 2 of the
 * 3 trials pass (the probe stops once decided).  The full-precision answer of
 * each trial is recorded, not used.  Deterministic.  Reentrant (the model,
 * tokenizer and template are read only).
 */
bool probe_niah(const km::Model& m, const km::BpeTokenizer& tok, const km::ChatTemplate& chat,
                const NiahProbeOptions& opt, NiahProbeReport* out, std::string* error);

}  // namespace kvxfer::spectrum
