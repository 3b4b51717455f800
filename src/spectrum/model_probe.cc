// SpectrumKV on the reference model runner; see model_probe.h.
#include "spectrum/model_probe.h"

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
  km::PrefillOptions po;
  po.record_attention_mass = true;
  km::PrefillResult pr;
  if (!m.prefill(prefix, po, &pr, error)) return false;
  c.kv = std::move(pr.kv);
  c.attention_mass = std::move(pr.attention_mass);
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
  // The continuation's queries: a prefill of prefix + feed records them.
  std::vector<int> all = prefix;
  all.insert(all.end(), c.feed.begin(), c.feed.end());
  km::PrefillOptions qo;
  qo.record_queries = true;
  km::PrefillResult qr;
  if (!m.prefill(all, qo, &qr, error)) return false;
  const size_t n = prefix.size(), T = all.size(), D = static_cast<size_t>(cfg.dim);
  c.queries.resize(static_cast<size_t>(cfg.n_layers) * steps * D);
  for (int l = 0; l < cfg.n_layers; ++l)
    std::memcpy(&c.queries[static_cast<size_t>(l) * steps * D], &qr.queries[(l * T + n) * D],
                static_cast<size_t>(steps) * D * sizeof(float));
  int agree = 0;
  if (!score_view(m, c, view, &agree, &c.nll_full, error)) return false;
  *out = std::move(c);
  return true;
}

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
    double mx = row[0], z = 0;
    for (size_t i = 1; i < V; ++i) mx = std::max(mx, static_cast<double>(row[i]));
    for (size_t i = 0; i < V; ++i) z += std::exp(row[i] - mx);
    s += -(row[c.ref[j]] - mx - std::log(z));
  }
  *agree = a;
  *nll = s;
  return true;
}

bool attention_importance(const km::Model& m, const Continuation& c, float lambda,
                          std::vector<float>* importance, std::string* error) {
  const km::Config& cfg = m.config();
  const int64_t n = c.kv.n_tokens();
  std::vector<float> imp(static_cast<size_t>(n));
  const kvxfer_result_t r = kvxfer_spectrum_importance_from_attention(
      c.attention_mass.data(), cfg.n_layers * cfg.n_heads, n, lambda, imp.data());
  if (r != KVXFER_SUCCESS) return api_fail(error, "kvxfer_spectrum_importance_from_attention", r);
  *importance = std::move(imp);
  return true;
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
