// SpectrumKV on the reference model runner; see model_probe.h.
#include "models/model_probe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvxfer::spectrum {
namespace {

uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

bool fail(std::string* error, const std::string& msg) {
  if (error != nullptr) *error = msg;
  return false;
}

bool api_fail(std::string* error, const char* what, kvxfer_result_t r) {
  return fail(error, std::string(what) + ": " + kvxfer_get_error_string(r) + ": " +
                         kvxfer_get_last_error());
}

// One float32 page of n rows of H channels, contiguous.
kvxfer_page_layout_t page_of(void** block, int64_t n, int32_t H) {
  return kvxfer_page_layout_t{
      block, 1, static_cast<int32_t>(n > 0 ? n : 1), H, 0, n, H, KVXFER_DTYPE_FP32};
}

struct TrialCtx {
  const km::Model* m;
  const ProbeOptions* opt;
  ProbeReport* report;
  std::string error;
};

bool run_trial(const km::Model& m, const ProbeOptions& opt, int trial,
               const kvxfer_spectrum_config_t& cfg, ProbeTrial* out, std::string* error) {
  std::vector<int> prompt;
  if (!sample_tokens(m, opt.prompt_tokens, opt.seed + static_cast<uint64_t>(trial), &prompt, error))
    return false;
  Continuation c;
  if (!make_continuation(m, prompt, opt.steps, &c, error)) return false;
  std::vector<float> imp;
  if (!attention_importance(m, c, cfg.lambda, &imp, error)) return false;
  kvxfer_codec_config_t codec = opt.codec;
  codec.codec = KVXFER_CODEC_SPECTRUM;
  out->steps = opt.steps;
  for (int fallback = 0; fallback < 2; ++fallback) {
    kvxfer_spectrum_config_t pc = cfg;
    pc.allow_int4 = fallback ? 0 : 1;
    std::vector<uint8_t> tiers(imp.size());
    const kvxfer_result_t r =
        kvxfer_spectrum_assign(&pc, static_cast<int64_t>(imp.size()), imp.data(), tiers.data());
    if (r != KVXFER_SUCCESS) return api_fail(error, "kvxfer_spectrum_assign", r);
    TransferredKV t;
    if (!transfer_kv(c.kv, codec, tiers.data(), false, &t, error)) return false;
    int agree = 0;
    double nll = 0;
    if (!score_view(m, c, t.view(), &agree, &nll, error)) return false;
    if (fallback) {
      out->agree_fallback = agree;
    } else {
      out->agree = agree;
      out->ppl_ratio = std::exp((nll - c.nll_full) / opt.steps);
    }
  }
  // Passes when INT4 is not catastrophic (the paper's criterion, as an
  // agreement floor) and not worse than the 2-tier fallback at the same budget.
  out->passed = out->agree >= opt.min_agreement * opt.steps && out->agree >= out->agree_fallback;
  return true;
}

kvxfer_result_t trial_cb(int32_t trial, const kvxfer_spectrum_config_t* cfg, int32_t* passed,
                         void* user) {
  TrialCtx* ctx = static_cast<TrialCtx*>(user);
  ProbeTrial t;
  if (!run_trial(*ctx->m, *ctx->opt, trial, *cfg, &t, &ctx->error)) return KVXFER_ERR_INTERNAL;
  ctx->report->trials.push_back(t);
  *passed = t.passed ? 1 : 0;
  return KVXFER_SUCCESS;
}

}  // namespace

km::KVView TransferredKV::view() const {
  km::KVView v = kv.view();
  if (!drop.empty())
    for (auto& l : v.layers) l.drop = drop.data();
  return v;
}

bool transfer_kv(const km::KVCache& kv, const kvxfer_codec_config_t& codec, const uint8_t* tiers,
                 bool anchor_only, TransferredKV* out, std::string* error) {
  const bool spectrum = codec.codec == KVXFER_CODEC_SPECTRUM;
  if (spectrum != (tiers != nullptr))
    return fail(error, "transfer_kv: tiers are needed by, and only by, KVXFER_CODEC_SPECTRUM");
  const int L = kv.n_layers(), n = kv.n_tokens(), H = kv.kv_dim();
  TransferredKV r;
  r.kv = km::KVCache(L, H);
  r.kv.resize(n);
  if (spectrum) {
    r.drop.assign(static_cast<size_t>(n), 0);
    bool any = false;
    for (int j = 0; j < n; ++j) any |= (r.drop[j] = tiers[j] == KVXFER_TIER_DROP) != 0;
    if (!any) r.drop.clear();
  }
  size_t acap = 0, rcap = 0;
  kvxfer_result_t rc = kvxfer_page_max_size(&codec, n, H, &acap, &rcap);
  if (rc != KVXFER_SUCCESS) return api_fail(error, "kvxfer_page_max_size", rc);
  std::vector<uint8_t> a(acap), res(rcap);
  for (int l = 0; l < L; ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      void* src = const_cast<float*>(kind == 0 ? kv.k(l) : kv.v(l));
      void* dst = kind == 0 ? r.kv.k(l) : r.kv.v(l);
      const kvxfer_page_layout_t sl = page_of(&src, n, H), dl = page_of(&dst, n, H);
      const kvxfer_page_id_t id{static_cast<uint32_t>(l),
                                kind == 0 ? KVXFER_KV_KEY : KVXFER_KV_VALUE, 0, 0};
      size_t alen = 0, rlen = 0;
      rc = spectrum ? kvxfer_page_encode_tiered(&codec, &id, &sl, tiers, a.data(), acap, &alen,
                                                res.data(), rcap, &rlen)
                    : kvxfer_page_encode(&codec, &id, &sl, a.data(), acap, &alen, res.data(), rcap,
                                         &rlen);
      if (rc != KVXFER_SUCCESS) return api_fail(error, "encode", rc);
      rc = kvxfer_page_decode(a.data(), alen, anchor_only ? nullptr : res.data(),
                              anchor_only ? 0 : rlen, &id, &dl);
      if (rc != KVXFER_SUCCESS) return api_fail(error, "kvxfer_page_decode", rc);
      r.anchor_bytes += alen;
      if (!anchor_only) r.residual_bytes += rlen;
    }
  }
  *out = std::move(r);
  return true;
}

bool sample_tokens(const km::Model& m, int length, uint64_t seed, std::vector<int>* out,
                   std::string* error) {
  if (length < 1 || length > m.config().seq_len)
    return fail(error, "prompt length " + std::to_string(length) + " is outside [1, seq_len]");
  uint64_t st = seed * 0x2545F4914F6CDD1Dull + 17;
  std::vector<int> t{1};
  km::KVCache tail;
  std::vector<float> logits;
  int tok = 1;
  for (int pos = 0; static_cast<int>(t.size()) < length; ++pos) {
    if (!m.decode_step(tok, pos, km::KVView{}, &tail, &logits, error)) return false;
    double mx = logits[0], sum = 0;
    for (float x : logits) mx = std::max(mx, static_cast<double>(x));
    std::vector<double> p(logits.size());
    for (size_t i = 0; i < p.size(); ++i) sum += (p[i] = std::exp(logits[i] - mx));
    const double u = (static_cast<double>(splitmix64(&st) >> 11) + 0.5) * 0x1.0p-53 * sum;
    double c = 0;
    tok = static_cast<int>(p.size()) - 1;
    for (size_t i = 0; i < p.size(); ++i)
      if ((c += p[i]) > u) {
        tok = static_cast<int>(i);
        break;
      }
    t.push_back(tok);
  }
  *out = std::move(t);
  return true;
}

namespace {

// The continuation's queries (a prefill of prefix + feed records them) and
// the full-precision score, for a continuation whose kv, feed and ref are set.
bool finish_continuation(const km::Model& m, const std::vector<int>& prefix, Continuation* c,
                         std::string* error) {
  const km::Config& cfg = m.config();
  const int steps = static_cast<int>(c->feed.size());
  std::vector<int> all = prefix;
  all.insert(all.end(), c->feed.begin(), c->feed.end());
  km::PrefillOptions qo;
  qo.record_queries = true;
  km::PrefillResult qr;
  if (!m.prefill(all, qo, &qr, error)) return false;
  const size_t n = prefix.size(), T = all.size(), D = static_cast<size_t>(cfg.dim);
  c->queries.resize(static_cast<size_t>(cfg.n_layers) * steps * D);
  for (int l = 0; l < cfg.n_layers; ++l)
    std::memcpy(&c->queries[static_cast<size_t>(l) * steps * D], &qr.queries[(l * T + n) * D],
                static_cast<size_t>(steps) * D * sizeof(float));
  int agree = 0;
  return score_view(m, *c, c->kv.view(), &agree, &c->nll_full, error);
}

bool prefill_prefix(const km::Model& m, const std::vector<int>& prefix, Continuation* c,
                    std::string* error) {
  km::PrefillOptions po;
  po.record_attention_mass = true;
  km::PrefillResult pr;
  if (!m.prefill(prefix, po, &pr, error)) return false;
  c->prefix = prefix;
  c->kv = std::move(pr.kv);
  c->attention_mass = std::move(pr.attention_mass);
  return true;
}

}  // namespace

bool make_continuation(const km::Model& m, const std::vector<int>& prompt, int steps,
                       Continuation* out, std::string* error) {
  const km::Config& cfg = m.config();
  if (prompt.size() < 2 || steps < 1 ||
      static_cast<int64_t>(prompt.size()) - 1 + steps > cfg.seq_len)
    return fail(error,
                "make_continuation: need a prompt of >= 2 tokens and prompt - 1 + steps "
                "<= seq_len");
  Continuation c;
  const std::vector<int> prefix(prompt.begin(), prompt.end() - 1);
  if (!prefill_prefix(m, prefix, &c, error)) return false;
  const km::KVView view = c.kv.view();
  km::KVCache tail;
  std::vector<float> logits;
  int tok = prompt.back();
  for (int j = 0; j < steps; ++j) {
    c.feed.push_back(tok);
    if (!m.decode_step(tok, view.n_tokens + j, view, &tail, &logits, error)) return false;
    tok = km::argmax(logits.data(), logits.size());
    c.ref.push_back(tok);
  }
  if (!finish_continuation(m, prefix, &c, error)) return false;
  *out = std::move(c);
  return true;
}

bool make_text_continuation(const km::Model& m, const std::vector<int>& tokens,
                            int prompt_kv_tokens, int steps, Continuation* out,
                            std::string* error) {
  const int64_t P = prompt_kv_tokens;
  if (P < 1 || steps < 1 || P + steps + 1 > static_cast<int64_t>(tokens.size()) ||
      P + steps > m.config().seq_len)
    return fail(error, "make_text_continuation: need 1 <= prompt (" + std::to_string(P) +
                           "), 1 <= steps (" + std::to_string(steps) +
                           "), prompt + steps + 1 <= text tokens (" +
                           std::to_string(tokens.size()) + ") and prompt + steps <= seq_len");
  Continuation c;
  const std::vector<int> prefix(tokens.begin(), tokens.begin() + P);
  if (!prefill_prefix(m, prefix, &c, error)) return false;
  c.feed.assign(tokens.begin() + P, tokens.begin() + P + steps);
  c.target.assign(tokens.begin() + P + 1, tokens.begin() + P + steps + 1);
  // ref: the full-precision argmax of every row (one batched pass gives
  // every row the bits of one-token decoding).
  km::KVCache tail;
  std::vector<float> logits;
  if (!m.verify(c.feed, static_cast<int>(P), c.kv.view(), &tail, &logits, error)) return false;
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  for (int j = 0; j < steps; ++j) c.ref.push_back(km::argmax(logits.data() + j * V, V));
  if (!finish_continuation(m, prefix, &c, error)) return false;
  *out = std::move(c);
  return true;
}

namespace {
// -log softmax(row)[target] (natural log, double).
double neg_log_prob(const float* row, size_t V, int target) {
  double mx = row[0], z = 0;
  for (size_t i = 1; i < V; ++i) mx = std::max(mx, static_cast<double>(row[i]));
  for (size_t i = 0; i < V; ++i) z += std::exp(row[i] - mx);
  return -(row[target] - mx - std::log(z));
}
}  // namespace

bool score_view(const km::Model& m, const Continuation& c, const km::KVView& view, int* agree,
                double* nll, std::string* error) {
  km::KVCache tail;
  std::vector<float> logits;
  if (!m.verify(c.feed, view.n_tokens, view, &tail, &logits, error)) return false;
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  int a = 0;
  double s = 0;
  for (size_t j = 0; j < c.feed.size(); ++j) {
    const float* row = logits.data() + j * V;
    if (km::argmax(row, V) == c.ref[j]) ++a;
    s += neg_log_prob(row, V, c.target.empty() ? c.ref[j] : c.target[j]);
  }
  *agree = a;
  *nll = s;
  return true;
}

bool score_prefix_view(const km::Model& m, const Continuation& c, const km::KVView& view,
                       double* nll, std::string* error) {
  const int n = static_cast<int>(c.prefix.size());
  if (n < 1 || c.feed.empty() || view.n_tokens != n)
    return fail(error, "score_prefix_view: the view holds " + std::to_string(view.n_tokens) +
                           " tokens, the prefix " + std::to_string(n) +
                           " (and the continuation must not be empty)");
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  constexpr int kBatch = 128;
  std::vector<float> logits;
  double s = 0;
  for (int i0 = 0; i0 < n; i0 += kBatch) {
    const int i1 = std::min(n, i0 + kBatch);
    const std::vector<int> toks(c.prefix.begin() + i0, c.prefix.begin() + i1);
    if (!m.score_over_view(toks, i0, view, &logits, error)) return false;
    for (int i = i0; i < i1; ++i)
      s += neg_log_prob(logits.data() + static_cast<size_t>(i - i0) * V, V,
                        i + 1 < n ? c.prefix[i + 1] : c.feed[0]);
  }
  *nll = s;
  return true;
}

namespace {
// Token importance of an n-token prefill from its attention mass
// ([n_layers * n_heads][n], PrefillResult::attention_mass).
bool importance_from_mass(const km::Model& m, const std::vector<float>& mass, int64_t n,
                          float lambda, std::vector<float>* importance, std::string* error) {
  const km::Config& cfg = m.config();
  std::vector<float> imp(static_cast<size_t>(n));
  const kvxfer_result_t r = kvxfer_spectrum_importance_from_attention(
      mass.data(), cfg.n_layers * cfg.n_heads, n, lambda, imp.data());
  if (r != KVXFER_SUCCESS) return api_fail(error, "kvxfer_spectrum_importance_from_attention", r);
  *importance = std::move(imp);
  return true;
}
}  // namespace

bool attention_importance(const km::Model& m, const Continuation& c, float lambda,
                          std::vector<float>* importance, std::string* error) {
  return importance_from_mass(m, c.attention_mass, c.kv.n_tokens(), lambda, importance, error);
}

bool probe_model(const km::Model& m, const ProbeOptions& opt, ProbeReport* out,
                 std::string* error) {
  ProbeReport rep;
  TrialCtx ctx{&m, &opt, &rep, {}};
  const kvxfer_result_t r =
      kvxfer_spectrum_run_probe(&opt.base, trial_cb, &ctx, &rep.allow_int4, &rep.passed, &rep.run);
  if (r != KVXFER_SUCCESS)
    return ctx.error.empty() ? api_fail(error, "kvxfer_spectrum_run_probe", r)
                             : fail(error, ctx.error);
  *out = std::move(rep);
  return true;
}

}  // namespace kvxfer::spectrum

// ---------------------------------------------------------------------------
// Needle in a haystack
// ---------------------------------------------------------------------------

namespace kvxfer::spectrum {

bool make_niah_case(const km::Model& m, const km::BpeTokenizer& tok, const km::ChatTemplate& chat,
                    const std::string& haystack, double depth, const std::string& passkey,
                    const NiahOptions& opt, NiahCase* out, std::string* error) {
  if (!(depth >= 0 && depth <= 1))
    return fail(error, "make_niah_case: depth " + std::to_string(depth) + " is not in [0, 1]");
  const size_t slot = opt.needle.find("{}");
  if (slot == std::string::npos) return fail(error, "make_niah_case: the needle has no {}");
  if (passkey.empty()) return fail(error, "make_niah_case: empty passkey");
  std::string hay = haystack;
  if (opt.haystack_tokens > 0) {
    std::vector<int32_t> ids;
    if (!tok.encode(hay, false, &ids, error)) return false;
    if (static_cast<int64_t>(ids.size()) > opt.haystack_tokens) {
      ids.resize(static_cast<size_t>(opt.haystack_tokens));
      std::string head;
      if (!tok.decode(ids, &head, error)) return false;
      const size_t cut = head.rfind('\n');
      if (cut == std::string::npos || cut == 0)
        return fail(error, "make_niah_case: no line break in the first " +
                               std::to_string(opt.haystack_tokens) + " tokens of the haystack");
      hay.resize(cut + 1);
    }
  }
  if (hay.empty() || hay.back() != '\n') hay += '\n';
  size_t at = 0;
  if (depth > 0) {
    at = hay.find('\n', static_cast<size_t>(std::floor(depth * static_cast<double>(hay.size()))));
    at = at == std::string::npos ? hay.size() : at + 1;
  }
  const std::string needle = opt.needle.substr(0, slot) + passkey + opt.needle.substr(slot + 2);
  const std::string user = hay.substr(0, at) + needle + "\n" + hay.substr(at) + "\n" + opt.question;
  const std::string text = chat.render_user(user);
  NiahCase c;
  c.depth = depth;
  c.passkey = passkey;
  std::vector<int32_t> ids;
  if (tok.add_bos()) ids.push_back(tok.bos_id());
  if (!tok.encode(text, true, &ids, error)) return false;
  // The needle's first token: the tokens of the text before it (it starts a
  // line, so the pre-tokenizer splits there).
  std::vector<int32_t> before;
  if (tok.add_bos()) before.push_back(tok.bos_id());
  if (!tok.encode(std::string_view(text).substr(0, text.find(needle)), true, &before, error))
    return false;
  c.needle_token = static_cast<int>(before.size());
  c.prompt.assign(ids.begin(), ids.end());
  if (c.prompt.size() < 2 ||
      static_cast<int64_t>(c.prompt.size()) + opt.answer_tokens > m.config().seq_len)
    return fail(error, "make_niah_case: a prompt of " + std::to_string(c.prompt.size()) +
                           " tokens and " + std::to_string(opt.answer_tokens) +
                           " answer tokens do not fit seq_len");
  const std::vector<int> prefix(c.prompt.begin(), c.prompt.end() - 1);
  km::PrefillOptions po;
  po.record_attention_mass = true;
  km::PrefillResult pr;
  if (!m.prefill(prefix, po, &pr, error)) return false;
  c.kv = std::move(pr.kv);
  c.attention_mass = std::move(pr.attention_mass);
  *out = std::move(c);
  return true;
}

bool niah_answer(const km::Model& m, const km::BpeTokenizer& tok, const NiahCase& c,
                 const km::KVView& view, const NiahOptions& opt, std::string* answer, bool* found,
                 std::string* error) {
  if (view.n_tokens + 1 != static_cast<int>(c.prompt.size()))
    return fail(error, "niah_answer: the view must hold the prompt's first n - 1 tokens");
  const int32_t end_of_turn = tok.token_id("<|im_end|>");
  km::KVCache tail;
  std::vector<float> logits;
  std::vector<int32_t> out;
  int t = c.prompt.back();
  for (int i = 0; i < opt.answer_tokens; ++i) {
    if (!m.decode_step(t, view.n_tokens + i, view, &tail, &logits, error)) return false;
    t = km::argmax(logits.data(), logits.size());
    if (t == end_of_turn || t == tok.eos_id()) break;
    out.push_back(t);
  }
  std::string a;
  if (!tok.decode(out, &a, error)) return false;
  *found = a.find(c.passkey) != std::string::npos;
  *answer = std::move(a);
  return true;
}

bool niah_importance(const km::Model& m, const NiahCase& c, float lambda,
                     std::vector<float>* importance, std::string* error) {
  return importance_from_mass(m, c.attention_mass, c.kv.n_tokens(), lambda, importance, error);
}

namespace {

struct NiahCtx {
  const km::Model* m;
  const km::BpeTokenizer* tok;
  const km::ChatTemplate* chat;
  const NiahProbeOptions* opt;
  NiahProbeReport* report;
  std::string error;
};

bool niah_trial(NiahCtx* ctx, int k, const kvxfer_spectrum_config_t& cfg, NiahProbeTrial* out) {
  const NiahProbeOptions& o = *ctx->opt;
  std::string* error = &ctx->error;
  NiahCase c;
  if (!make_niah_case(*ctx->m, *ctx->tok, *ctx->chat, o.haystack, o.depths[k], o.passkeys[k],
                      o.niah, &c, error))
    return false;
  out->depth = c.depth;
  out->passkey = c.passkey;
  out->prompt_tokens = static_cast<int>(c.prompt.size());
  if (!niah_answer(*ctx->m, *ctx->tok, c, c.kv.view(), o.niah, &out->answer_full, &out->found_full,
                   error))
    return false;
  std::vector<float> imp;
  if (!niah_importance(*ctx->m, c, cfg.lambda, &imp, error)) return false;
  std::vector<uint8_t> tiers(imp.size());
  const kvxfer_result_t r =
      kvxfer_spectrum_assign(&cfg, static_cast<int64_t>(imp.size()), imp.data(), tiers.data());
  if (r != KVXFER_SUCCESS) return api_fail(error, "kvxfer_spectrum_assign", r);
  kvxfer_codec_config_t codec = o.codec;
  codec.codec = KVXFER_CODEC_SPECTRUM;
  TransferredKV t;
  if (!transfer_kv(c.kv, codec, tiers.data(), false, &t, error)) return false;
  return niah_answer(*ctx->m, *ctx->tok, c, t.view(), o.niah, &out->answer, &out->found, error);
}

kvxfer_result_t niah_trial_cb(int32_t trial, const kvxfer_spectrum_config_t* cfg, int32_t* passed,
                              void* user) {
  NiahCtx* ctx = static_cast<NiahCtx*>(user);
  NiahProbeTrial t;
  if (!niah_trial(ctx, trial, *cfg, &t)) return KVXFER_ERR_INTERNAL;
  ctx->report->trials.push_back(t);
  *passed = t.found ? 1 : 0;
  return KVXFER_SUCCESS;
}

}  // namespace

bool probe_niah(const km::Model& m, const km::BpeTokenizer& tok, const km::ChatTemplate& chat,
                const NiahProbeOptions& opt, NiahProbeReport* out, std::string* error) {
  NiahProbeReport rep;
  NiahCtx ctx{&m, &tok, &chat, &opt, &rep, {}};
  const kvxfer_result_t r = kvxfer_spectrum_run_probe(&opt.base, niah_trial_cb, &ctx,
                                                      &rep.allow_int4, &rep.passed, &rep.run);
  if (r != KVXFER_SUCCESS)
    return ctx.error.empty() ? api_fail(error, "kvxfer_spectrum_run_probe", r)
                             : fail(error, ctx.error);
  *out = std::move(rep);
  return true;
}

}  // namespace kvxfer::spectrum
