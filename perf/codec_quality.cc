// perf/codec_quality: accuracy of the kvxfer page codecs, and of external
// KV-quantization baselines at the same bits, on real and synthetic KV caches.
//
// One table, one row per (data set, codec setting):
//   code              code bits: A+R for progressive codecs (anchor + residual
//                     bits), else the bits of the single code
//   alpha             LYNX alpha ("auto": KVXFER_ALPHA_AUTO; the chosen values
//                     are printed on a '#' line after the row)
//   C                 chunk tokens (kvxfer), group size (KIVI) or "tok" (one
//                     group per token row); a suffix t / a: V pages grouped
//                     per (token, C channels) / the better grouping per page
//                     (value_groups TOKEN / AUTO, docs/FORMAT.md 2.8)
//   s                 sink_tokens (kvxfer codecs): leading token rows sent
//                     exactly (docs/FORMAT.md 2.7); "-" where not applicable
//   bits_a / bits_t   bits per element on the wire: anchor section / anchor +
//                     residual.  kvxfer codecs: the actual encoded section
//                     sizes (headers and metadata included).  Baselines: the
//                     documented storage formula (codes + fp16 scale and
//                     zero per group, perf/baselines/kv_baselines.h).
//   vNMSE_a / vNMSE_f attention-output error sum |O_hat - O|^2 / sum |O|^2
//                     (sums over layers, query positions, heads and
//                     sequences) with the KV decoded at anchor precision /
//                     full precision.  O is the per-head softmax(q k^T/sqrt(d)) v
//                     (no wo projection), causal.
//   Kcos / Vcos       mean over token rows (all layers, all sequences) of the
//                     cosine between the original and the decoded K row / V row
//                     (a row = all kv_heads*head_dim channels of one token).
//   agree_a / agree_f greedy-decoding agreement (the real models): fraction
//                     of teacher-forced decode positions whose argmax equals
//                     full-precision decoding (see "Greedy agreement" below).
// Codecs with a single section (kvxfer INT4 and BF16, all baselines) report
// the same numbers in the anchor and full columns.
//
// Data sets
//   stories: the real stories260K model (llama2.c checkpoint, 5 layers, 4 KV
//     heads x 8 dims), prefilled on deterministic token sequences; the
//     queries are the model's own recorded queries at every position.  Pages:
//     one page per (sequence, layer, K/V) holding all T tokens.
//   synth: the synthetic Llama-like generator (models/synthetic_kv.h; 8 KV
//     heads x 128 dims, 100x persistent key outlier channels, Laplacian bulk,
//     RoPE keys).  There are no real queries, so queries are drawn from the
//     same generator family: the *keys* of an independent seed with the outlier
//     channels switched off (Laplacian bulk with per-channel scale), 32 query
//     heads (GQA 4:1, as Llama-3-8B), RoPE-rotated at the query's own
//     position; evaluated at evenly spaced positions, each attending causally
//     to the keys before it.  Pages: one per (layer, K/V), all T tokens.
//   smollm2: SmolLM2-135M-Instruct (the GGUF that scripts/install-deps.sh
//     fetches; 30 layers, 3 KV heads x 64 dims) prefilled on the 10 chat
//     prompts of data/prompts/chat.txt (chat template) and on three real
//     texts of 0.8K-3K tokens (data/: the GPL-3.0 preamble, the Apache-2.0
//     license, both); the model's own queries at 64 evenly spaced positions
//     per sequence.  Pages: one per (sequence, layer, K/V), all T tokens.
//
// Greedy agreement: for each prompt P of a real model (cut to at most 448 tokens so
// that 64 more fit in the 512-token context), prefill P[0..n-2] at full
// precision, pass that KV cache (every layer, K and V, as pages) through the
// codec, then decode 64 positions over the decoded KV view, in one batched
// Model::verify pass (row j of verify equals decode_step after feeding the
// j tokens before it; the program checks this on the full-precision view,
// where the agreement must be 1).  The tokens fed are teacher-forced on the
// full-precision greedy sequence (P[n-1], then the full-precision argmax of
// each previous step), so every position is comparable; the K/V of the tokens
// generated after the prompt stay exact in the tail.  Reported: the fraction of the 64 x (number of
// prompts) positions whose argmax equals full-precision decoding.
//
// --tree-study replaces the table: the default codec's anchor KV,
// teacher-forced on the verifier's greedy tokens (decoding on anchor +
// residual); where the anchor's greedy token is wrong (its margin, the
// verifier token's rank), and the committed tokens per pass of a linear draft
// against upper bounds for token trees (docs/SPEC.md "Tree drafting: the
// bound").
#include "perf/codec_quality.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "codec/codec_math.h"
#include "common/error.h"
#include "common/params.h"
#include "kvxfer/kvxfer.h"
#include "models/bpe_tokenizer.h"
#include "models/chat_template.h"
#include "models/llama2.h"
#include "models/model_paths.h"
#include "models/synthetic_kv.h"
#include "perf/baselines/kv_baselines.h"
#include "perf/common/draft_tree.h"
#include "perf/common/harness.h"

namespace codec_quality {

namespace kc = kvxfer::codec;

Timers g_time;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "codec_quality: %s\n", msg.c_str());
  std::exit(1);
}

// ---------------------------------------------------------------------------
// Codec rows
// ---------------------------------------------------------------------------
RowSpec kvx(kvxfer_codec_t codec, float alpha, int chunk, int anchor_bits) {
  RowSpec r;
  r.kind = RowSpec::kKvxfer;
  r.cfg.codec = codec;
  r.cfg.alpha = codec == KVXFER_CODEC_LYNX ? alpha : 0.0f;
  r.cfg.chunk_tokens = chunk;
  r.cfg.anchor_bits = anchor_bits;
  return r;
}

RowSpec base(kb::Baseline b) {
  RowSpec r;
  r.kind = RowSpec::kBaseline;
  r.baseline = b;
  return r;
}

#ifdef KVXFER_ALPHA_AUTO
// Lynx 4+4, C = 32, alpha chosen per page (KVXFER_ALPHA_AUTO).
RowSpec auto_alpha_row() {
  RowSpec r = kvx(KVXFER_CODEC_LYNX, 0.0f, 32, 4);
  r.cfg.alpha = KVXFER_ALPHA_AUTO;
  r.auto_alpha = true;
  return r;
}
#endif

// Lynx 4+4, alpha 0, C = 32 with V pages grouped per token / chosen per page.
void add_value_group_rows(std::vector<RowSpec>* rows) {
  for (kvxfer_value_groups_t g : {KVXFER_VALUE_GROUPS_TOKEN, KVXFER_VALUE_GROUPS_AUTO}) {
    RowSpec r = kvx(KVXFER_CODEC_LYNX, 0.0f, 32, 4);
    r.cfg.value_groups = g;
    rows->push_back(r);
  }
}

// The external baselines and BF16, last in every data set's list.
void add_baseline_rows(std::vector<RowSpec>* rows) {
  for (kb::Baseline b : {kb::Baseline::kInt8PerToken, kb::Baseline::kInt4PerToken,
                         kb::Baseline::kKiviInt4, kb::Baseline::kKiviInt2})
    rows->push_back(base(b));
  // KIVI-4 with kvxfer's sink row, at the same bits as the kvxfer rows (s = 1).
  RowSpec kivi_sink = base(kb::Baseline::kKiviInt4);
  kivi_sink.base_sinks = kivi_sink.cfg.sink_tokens;  // the default, 1
  rows->push_back(kivi_sink);
  rows->push_back(kvx(KVXFER_CODEC_BF16, 0.0f, 32, 4));
}

std::vector<RowSpec> make_rows() {
  std::vector<RowSpec> rows;
  for (int c : {16, 32, 64})
    for (float a : {0.0f, 5.0f, 20.0f, 100.0f, 255.0f})
      rows.push_back(kvx(KVXFER_CODEC_LYNX, a, c, 4));
  for (int ab : {3, 5, 6})
    for (float a : {0.0f, 20.0f}) rows.push_back(kvx(KVXFER_CODEC_LYNX, a, 32, ab));
#ifdef KVXFER_ALPHA_AUTO
  rows.push_back(auto_alpha_row());
#endif
  add_value_group_rows(&rows);
  for (int c : {16, 32, 64}) rows.push_back(kvx(KVXFER_CODEC_INT8, 0.0f, c, 4));
  for (int c : {16, 32, 64}) rows.push_back(kvx(KVXFER_CODEC_INT4, 0.0f, c, 4));
  add_baseline_rows(&rows);
  return rows;
}

// SmolLM2 (30 layers, 64 positions of greedy agreement per prompt) runs a
// shorter list: the settings the comparisons need.
std::vector<RowSpec> make_rows_smollm2() {
  std::vector<RowSpec> rows;
  for (int c : {16, 32, 64}) rows.push_back(kvx(KVXFER_CODEC_LYNX, 0.0f, c, 4));
  rows.push_back(kvx(KVXFER_CODEC_LYNX, 100.0f, 32, 4));
#ifdef KVXFER_ALPHA_AUTO
  rows.push_back(auto_alpha_row());
#endif
  for (int ab : {3, 5}) rows.push_back(kvx(KVXFER_CODEC_LYNX, 0.0f, 32, ab));
  add_value_group_rows(&rows);
  rows.push_back(kvx(KVXFER_CODEC_INT8, 0.0f, 32, 4));
  for (int c : {16, 32, 64}) rows.push_back(kvx(KVXFER_CODEC_INT4, 0.0f, c, 4));
  // Without the sink row: the codec of format 2, and textbook min/max INT4.
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT4}) {
    RowSpec r = kvx(codec, 0.0f, 32, 4);
    r.cfg.sink_tokens = 0;
    rows.push_back(r);
  }
  add_baseline_rows(&rows);
  return rows;
}

void run_page_impl(const RowSpec& row, const float* x, int64_t T, int H, uint32_t layer,
                   bool is_key, uint64_t stream, PageOut* out) {
  const size_t n = static_cast<size_t>(T) * H;
  if (row.kind == RowSpec::kBaseline) {
    kb::GroupAxis axis;
    int group;
    kb::baseline_layout(row.baseline, is_key, H, &axis, &group);
    const int bits = kb::baseline_bits(row.baseline);
    kb::QuantizedPage qp;
    std::string err;
    if (!kb::quantize_page(x, T, H, H, axis, group, bits, &qp, &err)) die(row.label() + ": " + err);
    out->full = std::move(qp.recon);
    // Sink rows as kvxfer sends them from an fp32 source: bf16 (docs/FORMAT.md 2.7).
    const int64_t sink = std::min<int64_t>(row.base_sinks, T);
    for (size_t i = 0; i < static_cast<size_t>(sink) * H; ++i)
      out->full[i] = kc::bf16_to_f32(kc::f32_to_bf16(x[i]));
    out->anchor = out->full;
    out->bits_anchor = out->bits_total =
        kb::storage_bits(T, H, axis, group, bits) + 16.0 * static_cast<double>(sink) * H;
    return;
  }
  void* blk = const_cast<float*>(x);
  kvxfer_page_layout_t src{&blk, 1, static_cast<int32_t>(T), H, 0, T, H, KVXFER_DTYPE_FP32};
  const kvxfer_page_id_t id{layer, is_key ? KVXFER_KV_KEY : KVXFER_KV_VALUE, 0, stream};
  size_t acap = 0, rcap = 0, alen = 0, rlen = 0;
  kvxfer_result_t r = kc::max_sizes(&row.cfg, T, H, &acap, &rcap);
  if (r != KVXFER_SUCCESS) die(row.label() + ": max_sizes: " + kvxfer_get_last_error());
  std::vector<uint8_t> a(acap), res(rcap);
  // One thread per call: rows are evaluated in parallel (main), which uses the
  // cores far better than fine-grained threading of small pages.
  r = kc::encode_page(&row.cfg, &id, &src, a.data(), acap, &alen, res.data(), rcap, &rlen,
                      kc::Impl::AUTO, 1);
  if (r != KVXFER_SUCCESS) die(row.label() + ": encode: " + kvxfer_get_last_error());
  out->anchor.assign(n, 0.0f);
  out->full.assign(n, 0.0f);
  void* ab = out->anchor.data();
  void* fb = out->full.data();
  kvxfer_page_layout_t da{&ab, 1, static_cast<int32_t>(T), H, 0, T, H, KVXFER_DTYPE_FP32};
  kvxfer_page_layout_t df{&fb, 1, static_cast<int32_t>(T), H, 0, T, H, KVXFER_DTYPE_FP32};
  r = kc::decode_page(a.data(), alen, nullptr, 0, &id, &da, kc::Impl::AUTO, 1);
  if (r != KVXFER_SUCCESS) die(row.label() + ": decode anchor: " + kvxfer_get_last_error());
  if (row.progressive()) {
    r = kc::decode_page(a.data(), alen, res.data(), rlen, &id, &df, kc::Impl::AUTO, 1);
    if (r != KVXFER_SUCCESS) die(row.label() + ": decode full: " + kvxfer_get_last_error());
  } else {
    out->full = out->anchor;  // single-section codec: the (empty) residual is not sent
  }
  out->bits_anchor = 8.0 * static_cast<double>(alen);
  out->bits_total = 8.0 * static_cast<double>(alen + (row.progressive() ? rlen : 0));
  kvxfer_page_info_t info;
  if (kc::inspect_section(a.data(), alen, &info) == KVXFER_SUCCESS &&
      info.codec == KVXFER_CODEC_LYNX)
    out->chosen_alpha = info.alpha;
}

void run_page(const RowSpec& row, const float* x, int64_t T, int H, uint32_t layer, bool is_key,
              uint64_t stream, PageOut* out) {
  const double t0 = now_s();
  run_page_impl(row, x, T, H, layer, is_key, stream, out);
  const double dt = now_s() - t0;
#pragma omp atomic
  g_time.codec += dt;
}

// ---------------------------------------------------------------------------
// Data sets
// ---------------------------------------------------------------------------
// The argmax of a row of logits and its margin over the runner-up.
int top_with_margin(const float* logits, size_t n, float* margin) {
  const int top = km::argmax(logits, n);
  float second = -INFINITY;
  for (size_t i = 0; i < n; ++i)
    if (static_cast<int>(i) != top) second = std::max(second, logits[i]);
  *margin = logits[top] - second;
  return top;
}

GreedyRun greedy_decode(const km::Model& m, const km::KVView& view, int first, int steps) {
  GreedyRun r;
  km::KVCache tail;
  std::vector<float> logits;
  std::string err;
  int tok = first;
  for (int j = 0; j < steps; ++j) {
    r.feed.push_back(tok);
    if (!m.decode_step(tok, view.n_tokens + j, view, &tail, &logits, &err)) die(err);
    float margin = 0;
    tok = top_with_margin(logits.data(), logits.size(), &margin);
    r.ref.push_back(tok);
    r.margin.push_back(margin);
  }
  return r;
}

// One batched teacher-forced pass (Model::verify: row j equals what
// decode_step would return for feed[j] after decoding feed[0..j-1] over the
// same view, with exact K/V of the fed tokens in the tail).
int run_greedy(const km::Model& m, const GreedyCase& g, const km::KVView& view) {
  const double t0 = now_s();
  km::KVCache tail;
  std::vector<float> logits;
  std::string err;
  if (!m.verify(g.greedy.feed, view.n_tokens, view, &tail, &logits, &err)) die(err);
  const size_t V = static_cast<size_t>(m.config().vocab_size);
  int agree = 0;
  for (size_t j = 0; j < g.greedy.feed.size(); ++j)
    if (km::argmax(logits.data() + j * V, V) == g.greedy.ref[j]) ++agree;
  const double dt = now_s() - t0;
#pragma omp atomic
  g_time.greedy += dt;
  return agree;
}

// reference = false: the prefill only (the tree study decodes its own).
GreedyCase greedy_case(const km::Model& m, const std::string& name, std::vector<int> toks,
                       int steps, bool reference) {
  const int maxlen = m.config().seq_len - steps;
  if (static_cast<int>(toks.size()) > maxlen) toks.resize(maxlen);
  GreedyCase g;
  g.name = name;
  km::PrefillResult pr;
  std::string err;
  std::vector<int> prefix(toks.begin(), toks.end() - 1);
  if (!m.prefill(prefix, km::PrefillOptions{}, &pr, &err)) die(err);
  g.kv = std::move(pr.kv);
  g.last = toks.back();
  if (!reference) return g;
  const km::KVView view = g.kv.view();
  g.greedy = greedy_decode(m, view, g.last, steps);
  const int self = run_greedy(m, g, view);
  if (self != steps)
    std::fprintf(stderr,
                 "codec_quality: warning: %s: the batched pass reproduces full-precision "
                 "decode_step argmax on only %d of %d positions\n",
                 name.c_str(), self, steps);
  return g;
}

// ---------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------
struct Acc {
  double se_a = 0, se_f = 0, norm = 0;
  double kcos_a = 0, kcos_f = 0, vcos_a = 0, vcos_f = 0;
  int64_t krows = 0, vrows = 0;
  double bits_a = 0, bits_t = 0, elems = 0;
  int agree_a = 0, agree_f = 0, agree_n = 0;
  std::map<std::string, int> alphas;  // chosen alpha histogram ("K 5", "V 0")
  json per_seq = json::array();
  json per_prompt = json::array();  // greedy agreement per prompt
};

double row_cos_sum(const float* x, const float* y, int64_t T, int H) {
  double s = 0;
  for (int64_t t = 0; t < T; ++t) {
    double xy = 0, xx = 0, yy = 0;
    for (int h = 0; h < H; ++h) {
      const double a = x[t * H + h], b = y[t * H + h];
      xy += a * b;
      xx += a * a;
      yy += b * b;
    }
    s += (xx == 0 && yy == 0) ? 1.0 : (xx == 0 || yy == 0) ? 0.0 : xy / std::sqrt(xx * yy);
  }
  return s;
}

void sq_err(const std::vector<float>& ref, const std::vector<float>& got, double* se,
            double* norm) {
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    *se += d * d;
    if (norm != nullptr) *norm += static_cast<double>(ref[i]) * ref[i];
  }
}

void eval_seq(const RowSpec& row, const Seq& s, uint64_t stream, Acc* acc) {
  double se_a = 0, se_f = 0, norm = 0;
  std::vector<float> out(s.qpos.size() * s.qdim());
  for (int l = 0; l < s.L; ++l) {
    PageOut pk, pv;
    run_page(row, s.k[l].data(), s.T, s.H, l, true, stream, &pk);
    run_page(row, s.v[l].data(), s.T, s.H, l, false, stream, &pv);
    acc->bits_a += pk.bits_anchor + pv.bits_anchor;
    acc->bits_t += pk.bits_total + pv.bits_total;
    acc->elems += 2.0 * s.T * s.H;
    if (pk.chosen_alpha >= 0 && row.auto_alpha) {
      ++acc->alphas[kp::strprintf("K %g", pk.chosen_alpha)];
      ++acc->alphas[kp::strprintf("V %g", pv.chosen_alpha)];
    }
    acc->kcos_a += row_cos_sum(s.k[l].data(), pk.anchor.data(), s.T, s.H);
    acc->kcos_f += row_cos_sum(s.k[l].data(), pk.full.data(), s.T, s.H);
    acc->vcos_a += row_cos_sum(s.v[l].data(), pv.anchor.data(), s.T, s.H);
    acc->vcos_f += row_cos_sum(s.v[l].data(), pv.full.data(), s.T, s.H);
    acc->krows += s.T;
    acc->vrows += s.T;
    attend(s, l, pk.full.data(), pv.full.data(), out.data());
    sq_err(s.o_ref[l], out, &se_f, &norm);
    if (row.progressive()) {
      attend(s, l, pk.anchor.data(), pv.anchor.data(), out.data());
      sq_err(s.o_ref[l], out, &se_a, nullptr);
    }
  }
  if (!row.progressive()) se_a = se_f;
  acc->se_a += se_a;
  acc->se_f += se_f;
  acc->norm += norm;
  acc->per_seq.push_back(
      {{"seq", s.name}, {"vnmse_anchor", se_a / norm}, {"vnmse_full", se_f / norm}});
}

CodedKV code_kv(const RowSpec& row, const km::KVCache& kv, uint64_t stream) {
  const int L = kv.n_layers(), T = kv.n_tokens(), H = kv.kv_dim();
  CodedKV c;
  c.k.resize(L);
  c.v.resize(L);
  c.anchor.n_tokens = c.full.n_tokens = T;
  for (int l = 0; l < L; ++l) {
    run_page(row, kv.k(l), T, H, l, true, stream, &c.k[l]);
    run_page(row, kv.v(l), T, H, l, false, stream, &c.v[l]);
    c.anchor.layers.push_back({c.k[l].anchor.data(), c.v[l].anchor.data(), static_cast<size_t>(H),
                               static_cast<size_t>(H)});
    c.full.layers.push_back(
        {c.k[l].full.data(), c.v[l].full.data(), static_cast<size_t>(H), static_cast<size_t>(H)});
  }
  return c;
}

void eval_greedy(const km::Model& m, const RowSpec& row, const GreedyCase& g, uint64_t stream,
                 Acc* acc) {
  const CodedKV c = code_kv(row, g.kv, stream);
  const int f = run_greedy(m, g, c.full);
  const int a = row.progressive() ? run_greedy(m, g, c.anchor) : f;
  acc->agree_f += f;
  acc->agree_a += a;
  acc->agree_n += static_cast<int>(g.greedy.feed.size());
  acc->per_prompt.push_back({{"prompt", g.name},
                             {"agree_anchor", a},
                             {"agree_full", f},
                             {"positions", g.greedy.feed.size()}});
}

std::string sci(double x) { return kp::strprintf("%.3e", x); }
std::string cosf(double x) { return kp::strprintf("%.6f", x); }

void print_row(const kp::Table& table, const std::string& dataset, const RowSpec& row,
               const Acc& acc, json* jrows) {
  const double va = acc.se_a / acc.norm, vf = acc.se_f / acc.norm;
  const double ba = acc.bits_a / acc.elems, bt = acc.bits_t / acc.elems;
  const double kca = acc.kcos_a / acc.krows, kcf = acc.kcos_f / acc.krows;
  const double vca = acc.vcos_a / acc.vrows, vcf = acc.vcos_f / acc.vrows;
  const bool has_agree = acc.agree_n > 0;
  const double aa = has_agree ? static_cast<double>(acc.agree_a) / acc.agree_n : 0;
  const double af = has_agree ? static_cast<double>(acc.agree_f) / acc.agree_n : 0;
  std::printf("%s\n", table
                          .row({dataset, row.codec_name(), row.split(), row.alpha(), row.group(),
                                row.sinks(), kp::strprintf("%.3f", ba), kp::strprintf("%.3f", bt),
                                sci(va), sci(vf), cosf(kca), cosf(kcf), cosf(vca), cosf(vcf),
                                has_agree ? kp::strprintf("%.4f", aa) : "-",
                                has_agree ? kp::strprintf("%.4f", af) : "-"})
                          .c_str());
  json jr = {
      {"dataset", dataset},
      {"codec", row.codec_name()},
      {"split", row.split()},
      {"alpha", row.alpha()},
      {"group", row.group()},
      {"value_groups", row.kind == RowSpec::kKvxfer ? static_cast<int>(row.cfg.value_groups) : -1},
      {"sink_tokens", row.sinks()},
      {"progressive", row.progressive()},
      {"bits_anchor", ba},
      {"bits_total", bt},
      {"vnmse_anchor", va},
      {"vnmse_full", vf},
      {"key_cos_anchor", kca},
      {"key_cos_full", kcf},
      {"value_cos_anchor", vca},
      {"value_cos_full", vcf},
      {"per_seq", acc.per_seq}};
  if (has_agree) {
    jr["greedy_agree_anchor"] = aa;
    jr["greedy_agree_full"] = af;
    jr["greedy_positions"] = acc.agree_n;
    jr["greedy_per_prompt"] = acc.per_prompt;
  }
  if (!acc.alphas.empty()) {
    jr["chosen_alpha_pages"] = acc.alphas;
    std::string line;
    for (const auto& kv : acc.alphas)
      line += kp::strprintf(" [%s]x%d", kv.first.c_str(), kv.second);
    std::printf("#   %s alpha=auto chose (pages):%s\n", dataset.c_str(), line.c_str());
  }
  std::fflush(stdout);
  jrows->push_back(std::move(jr));
}

// ---------------------------------------------------------------------------
// Tree study (--tree-study; issue 19's first measurement, docs/SPEC.md "Tree
// drafting: the bound")
// ---------------------------------------------------------------------------
}  // namespace codec_quality

using namespace codec_quality;  // NOLINT(google-build-using-namespace)

int main(int argc, char** argv) {
  CLI::App app{"kvxfer codec accuracy: attention-output vNMSE, K/V cosine, bits, greedy agreement"};
  bool quick = false;
  std::string json_path;
  std::string model_path = std::string(KVXFER_DATA_DIR) + "/stories260K.bin";
  std::string smollm2_path = km::smollm2_gguf_path();
  std::vector<std::string> data_sets = {"stories", "synth", "smollm2"};
  SynthOptions so;
  int greedy_steps = 64, smollm2_queries = 64;
  bool tree_study = false;
  app.add_flag("--quick", quick,
               "smaller data sets (2 prompts, 2 x 512 synthetic tokens; SmolLM2: 2 chat prompts "
               "and 512 tokens of text)");
  app.add_option("-J,--json", json_path, "write all results to this JSON file");
  app.add_option("-D,--datasets,--data", data_sets,
                 "data sets, a comma or space list: stories, synth, smollm2 (skipped with a note "
                 "when its model file is absent)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::IsMember({"stories", "synth", "smollm2"}));
  app.add_option("--model", model_path, "llama2.c checkpoint of the stories data set")
      ->capture_default_str();
  app.add_option("--smollm2", smollm2_path, "SmolLM2-135M-Instruct GGUF (KVXFER_SMOLLM2_GGUF)")
      ->capture_default_str();
  app.add_option("--synth-layers", so.layers, "synthetic layers")
      ->check(CLI::Range(1, 128))
      ->capture_default_str();
  app.add_option("--synth-tokens", so.tokens, "synthetic tokens")
      ->check(CLI::Range(1, 1 << 17))
      ->capture_default_str();
  app.add_option("--synth-queries", so.queries,
                 "synthetic query positions per layer (at most --synth-tokens)")
      ->check(CLI::Range(1, 1 << 17))
      ->capture_default_str();
  app.add_option("--smollm2-queries", smollm2_queries,
                 "SmolLM2: query positions per sequence (evenly spaced, ending with the last)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--greedy-steps", greedy_steps,
                 "teacher-forced decode steps per prompt (0: no greedy agreement; at most the "
                 "model's context - 2)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_flag("--tree-study", tree_study,
               "instead of the codec table: where the anchor draft fails, and the committed "
               "tokens per pass of linear drafts and token trees (needs stories or smollm2, "
               "--greedy-steps >= 4; docs/SPEC.md)");
  CLI11_PARSE(app, argc, argv);
  if (so.queries > so.tokens) {
    std::fprintf(stderr, "codec_quality: --synth-queries %d exceeds --synth-tokens %d\n",
                 so.queries, so.tokens);
    return 2;
  }
  // K and V of 1024 fp32 channels per token row and layer: 8 KiB.
  if (static_cast<int64_t>(so.layers) * so.tokens > (int64_t{4} << 30) / 8192) {
    std::fprintf(stderr,
                 "codec_quality: --synth-layers %d x --synth-tokens %d: the synthetic KV "
                 "(8 KiB per token and layer) would exceed 4 GiB\n",
                 so.layers, so.tokens);
    return 2;
  }
  if (tree_study && greedy_steps < 4) {
    std::fprintf(stderr,
                 "codec_quality: --tree-study needs --greedy-steps >= 4 (the smallest "
                 "verification pass it counts)\n");
    return 2;
  }
  // A malformed KVXFER_* variable stops the run (exit 2), as in codec_perf.
  if (kvxfer::params::validate() < 0) {
    std::fprintf(stderr, "codec_quality: %s\n", kvxfer::last_error());
    return 2;
  }
  if (quick) {
    so.layers = 2;
    so.tokens = 512;
    so.queries = 16;
  }
  const auto t_start = std::chrono::steady_clock::now();
  auto wanted = [&](const char* n) {
    return std::find(data_sets.begin(), data_sets.end(), n) != data_sets.end();
  };

  struct Dataset {
    std::string name;
    const km::Model* model = nullptr;  // the model of the greedy cases
    std::vector<Seq> seqs;
    std::vector<GreedyCase> greedy;
    std::vector<RowSpec> rows;
  };
  std::vector<Dataset> datasets;
  std::string err;
  std::unique_ptr<km::Model> stories, smollm2;
  std::string smollm2_note;
  // Jobs that build the data sets, run in parallel (each single-threaded inside).
  std::vector<std::function<void()>> jobs;
  if (wanted("stories")) {
    stories = km::Model::load(model_path, &err);
    if (!stories) die("cannot load " + model_path + ": " + err);
  }
  if (wanted("smollm2")) {
    std::ifstream probe(smollm2_path, std::ios::binary);
    if (!probe) {
      smollm2_note = "skipped: no model at " + smollm2_path +
                     " (scripts/install-deps.sh fetches it; data/README.md)";
    } else {
      smollm2 = km::Model::load(smollm2_path, &err);
      if (!smollm2) die("cannot load " + smollm2_path + ": " + err);
    }
  }
  // Each greedy prompt keeps at least 2 tokens before the steps.
  for (const km::Model* mp : {stories.get(), smollm2.get()}) {
    if (mp != nullptr && greedy_steps > mp->config().seq_len - 2) {
      std::fprintf(stderr,
                   "codec_quality: --greedy-steps %d leaves no prompt in a %d-token context "
                   "(at most %d)\n",
                   greedy_steps, mp->config().seq_len, mp->config().seq_len - 2);
      return 2;
    }
  }
  if (tree_study && !wanted("stories") && !wanted("smollm2")) {
    std::fprintf(stderr, "codec_quality: --tree-study needs a model data set (stories, smollm2)\n");
    return 2;
  }
  std::vector<PromptSpec> prompts = {{PromptKind::kGreedy, 512, 0},
                                     {PromptKind::kSampled, 512, 1},
                                     {PromptKind::kSampled, 256, 2},
                                     {PromptKind::kRandom, 128, 3}};
  if (quick) prompts = {{PromptKind::kGreedy, 256, 0}, {PromptKind::kRandom, 128, 3}};
  std::vector<TextPrompt> texts;
  if (smollm2) texts = smollm2_prompts(*smollm2, quick);
  // Reserve first: jobs hold pointers into these vectors.
  datasets.reserve(3);
  // A model's data set of n prompts: each a sequence (not in the tree study)
  // and a greedy case, built in a job of its own.  toks(i): prompt i's tokens
  // (in the job); seq(i, toks): its sequence.
  using Tokens = std::vector<int>;
  auto add_model_set = [&](const char* name, const km::Model* m, std::vector<RowSpec> rows,
                           size_t n, std::function<std::string(size_t)> name_of,
                           std::function<Tokens(size_t)> toks_of,
                           std::function<Seq(size_t, const Tokens&)> seq_of) {
    Dataset& d = datasets.emplace_back();
    d.name = name;
    d.model = m;
    d.rows = std::move(rows);
    d.seqs.resize(tree_study ? 0 : n);
    d.greedy.resize(greedy_steps > 0 ? n : 0);
    for (size_t i = 0; i < n; ++i)
      jobs.push_back([&d, m, greedy_steps, tree_study, i, name_of, toks_of, seq_of] {
        const Tokens toks = toks_of(i);
        if (!tree_study) d.seqs[i] = seq_of(i, toks);
        if (greedy_steps > 0)
          d.greedy[i] = greedy_case(*m, name_of(i), toks, greedy_steps, !tree_study);
      });
  };
  if (stories) {
    const km::Model* m = stories.get();
    add_model_set(
        "stories", m, make_rows(), prompts.size(),
        [&prompts](size_t i) { return prompts[i].name(); },
        [m, &prompts](size_t i) { return make_tokens(*m, prompts[i]); },
        [m, &prompts](size_t i, const Tokens& t) { return stories_seq(*m, prompts[i], t); });
  }
  if (wanted("synth") && !tree_study) {
    Dataset& d = datasets.emplace_back();
    d.name = "synth";
    d.rows = make_rows();
    d.seqs.resize(1);
    jobs.push_back([&d, &so] { d.seqs[0] = synth_seq(so); });
  }
  if (smollm2) {
    const km::Model* m = smollm2.get();
    add_model_set(
        "smollm2", m, make_rows_smollm2(), texts.size(),
        [&texts](size_t i) { return texts[i].name; }, [&texts](size_t i) { return texts[i].toks; },
        [m, &texts, smollm2_queries](size_t i, const Tokens& t) {
          return model_seq(*m, texts[i].name, t, smollm2_queries);
        });
  }
  // Longest first (the SmolLM2 texts), so that the two threads finish together.
  std::reverse(jobs.begin(), jobs.end());
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t j = 0; j < jobs.size(); ++j) jobs[j]();
  const double t_data =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

  kp::print_preamble(stdout, "codec_quality", kp::machine_info(), kp::kvxfer_settings());
  for (const Dataset& ds : datasets) {
    if (ds.name == "stories") {
      std::printf(
          "# stories: stories260K (L=5, 4 KV heads x 8 = H 32), real queries at every position; "
          "sequences:");
    } else if (ds.name == "synth") {
      std::printf(
          "# synth:   synthetic KV L=%d, 8 KV heads x 128 = H 1024, T=%d, %d query heads (GQA), "
          "%d query positions/layer\n",
          so.layers, so.tokens, so.q_heads, so.queries);
      continue;
    } else {
      std::printf(
          "# smollm2: SmolLM2-135M-Instruct Q4_1 (L=30, 3 KV heads x 64 = H 192, 9 query heads), "
          "its own queries at %d evenly spaced positions per sequence (all when fewer); "
          "sequences:",
          smollm2_queries);
    }
    for (const Seq& s : ds.seqs) std::printf(" %s", s.name.c_str());
    for (size_t i = 0; tree_study && i < ds.greedy.size(); ++i)
      std::printf(" %s", ds.greedy[i].name.c_str());
    std::printf("\n");
  }
  if (!smollm2_note.empty()) std::printf("# smollm2: %s\n", smollm2_note.c_str());
  for (const Dataset& ds : datasets) {
    if (ds.greedy.empty() || tree_study) continue;  // the study has no fp32 reference
    int n = 0, close01 = 0, close05 = 0;
    for (const GreedyCase& g : ds.greedy)
      for (float mg : g.greedy.margin) {
        ++n;
        close01 += mg < 0.1f;
        close05 += mg < 0.5f;
      }
    std::printf(
        "# agree:   %s: greedy agreement, teacher-forced on the full-precision greedy sequence, "
        "%d steps x %zu prompts; of the %d positions, %d (%.1f%%) have a full-precision "
        "top-1/top-2 logit margin < 0.1 and %d (%.1f%%) < 0.5 (near-ties: agreement saturates "
        "below 1)\n",
        ds.name.c_str(), greedy_steps, ds.greedy.size(), n, close01, 100.0 * close01 / n, close05,
        100.0 * close05 / n);
  }
  if (tree_study) {
    json study = json::object();
    for (const Dataset& ds : datasets)
      if (!ds.greedy.empty()) run_tree_study(ds.name, *ds.model, ds.greedy, greedy_steps, &study);
    const double t_total =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    std::printf("# time: %.1f s wall\n", t_total);
    if (!json_path.empty()) {
      const json j = {{"tool", "codec_quality --tree-study"},
                      {"machine", kp::to_json(kp::machine_info())},
                      {"settings", kp::to_json(kp::kvxfer_settings())},
                      {"greedy_steps", greedy_steps},
                      {"study", study},
                      {"runtime_s", t_total}};
      if (!kp::write_json_file(json_path, j, &err)) die(err);
    }
    return 0;
  }
  std::printf(
      "# _a = anchor only, _f = full (anchor + residual); single-section codecs repeat "
      "the value. bits: per element on the wire.\n");
  std::printf("#\n");

  kp::Table table({{"data", 7},
                   {"codec", 10},
                   {"code", 4},
                   {"alpha", 5},
                   {"C", 3},
                   {"s", 1},
                   {"bits_a", 6},
                   {"bits_t", 6},
                   {"vNMSE_a", 9},
                   {"vNMSE_f", 9},
                   {"Kcos_a", 8},
                   {"Kcos_f", 8},
                   {"Vcos_a", 8},
                   {"Vcos_f", 8},
                   {"agree_a", 7},
                   {"agree_f", 7}});
  std::printf("%s\n", table.header().c_str());
  std::fflush(stdout);

  json jrows = json::array();
  for (const Dataset& ds : datasets) {
    const std::vector<RowSpec>& rows = ds.rows;
    // Rows in parallel, each single-threaded inside (nested OpenMP regions of
    // the model and the codec run on one thread); printed in order.
    std::vector<Acc> accs(rows.size());
    std::vector<char> done(rows.size(), 0);
    size_t next_print = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (size_t r = 0; r < rows.size(); ++r) {
      Acc& acc = accs[r];
      uint64_t stream = 0;
      for (const Seq& s : ds.seqs) eval_seq(rows[r], s, ++stream, &acc);
      for (const GreedyCase& g : ds.greedy) eval_greedy(*ds.model, rows[r], g, ++stream, &acc);
#pragma omp critical(print_rows)
      {
        done[r] = 1;
        for (; next_print < rows.size() && done[next_print]; ++next_print)
          print_row(table, ds.name, rows[next_print], accs[next_print], &jrows);
      }
    }
  }
  const double t_total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::printf(
      "# time: data sets %.1f s; thread-seconds: codec %.1f, attention %.1f, greedy %.1f; "
      "total %.1f s wall\n",
      t_data, g_time.codec, g_time.attention, g_time.greedy, t_total);

  if (!json_path.empty()) {
    json j = {{"tool", "codec_quality"},
              {"quick", quick},
              {"machine", kp::to_json(kp::machine_info())},
              {"settings", kp::to_json(kp::kvxfer_settings())},
              {"synthetic",
               {{"layers", so.layers},
                {"tokens", so.tokens},
                {"query_positions", so.queries},
                {"query_heads", so.q_heads},
                {"seed", so.seed}}},
              {"greedy_steps", greedy_steps},
              {"rows", jrows},
              {"runtime_s", t_total}};
    json seqs = json::array();
    for (const Dataset& ds : datasets)
      for (const Seq& s : ds.seqs)
        seqs.push_back({{"dataset", ds.name}, {"seq", s.name}, {"T", s.T}, {"H", s.H}, {"L", s.L}});
    j["sequences"] = seqs;
    if (!kp::write_json_file(json_path, j, &err)) die(err);
  }
  return 0;
}
