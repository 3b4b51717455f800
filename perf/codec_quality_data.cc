// codec_quality's data sets: stories260K and SmolLM2 prefills with their own
// queries, and the synthetic Llama-3-8B-like KV (codec_quality.h).
#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "models/gguf.h"
#include "models/synthetic_kv.h"
#include "perf/codec_quality.h"
#include "perf/common/chat_text.h"

namespace codec_quality {

using kp::splitmix64;  // perf/common/harness.h

void attend_impl(const Seq& s, int l, const float* k, const float* v, float* out) {
  km::KVLayerView lv{k, v, static_cast<size_t>(s.H), static_cast<size_t>(s.H)};
  std::string err;
  const size_t qd = s.qdim();
  if (s.all_positions) {
    if (!km::attention(s.shape, lv, s.T, s.q[l].data(), 0, s.T, 0, out, &err)) die(err);
    return;
  }
  for (size_t i = 0; i < s.qpos.size(); ++i)
    if (!km::attention(s.shape, lv, s.qpos[i] + 1, s.q[l].data() + i * qd, 0, 1, s.qpos[i],
                       out + i * qd, &err))
      die(err);
}

void attend(const Seq& s, int l, const float* k, const float* v, float* out) {
  const double t0 = now_s();
  attend_impl(s, l, k, v, out);
  const double dt = now_s() - t0;
#pragma omp atomic
  g_time.attention += dt;
}

void compute_reference(Seq* s) {
  s->o_ref.resize(s->L);
  for (int l = 0; l < s->L; ++l) {
    s->o_ref[l].assign(s->qpos.size() * s->qdim(), 0.0f);
    attend(*s, l, s->k[l].data(), s->v[l].data(), s->o_ref[l].data());
  }
}

std::vector<int> make_tokens(const km::Model& m, const PromptSpec& p) {
  const int V = m.config().vocab_size;
  uint64_t st = p.seed * 0x2545F4914F6CDD1Dull + 17;
  std::vector<int> t;
  if (p.kind == PromptKind::kRandom) {
    t.push_back(1);
    while (static_cast<int>(t.size()) < p.length)
      t.push_back(static_cast<int>(splitmix64(&st) % V));
    return t;
  }
  km::KVCache tail;
  std::vector<float> logits;
  std::string err;
  int tok = 1;
  t.push_back(tok);
  for (int pos = 0; static_cast<int>(t.size()) < p.length; ++pos) {
    if (!m.decode_step(tok, pos, km::KVView{}, &tail, &logits, &err)) die(err);
    if (p.kind == PromptKind::kGreedy) {
      tok = km::argmax(logits.data(), logits.size());
    } else {
      double mx = logits[0], sum = 0;
      for (float x : logits) mx = std::max(mx, static_cast<double>(x));
      std::vector<double> pr(logits.size());
      for (size_t i = 0; i < pr.size(); ++i) sum += (pr[i] = std::exp(logits[i] - mx));
      const double u = (static_cast<double>(splitmix64(&st) >> 11) + 0.5) * 0x1.0p-53 * sum;
      double c = 0;
      tok = static_cast<int>(pr.size()) - 1;
      for (size_t i = 0; i < pr.size(); ++i)
        if ((c += pr[i]) > u) {
          tok = static_cast<int>(i);
          break;
        }
    }
    t.push_back(tok);
  }
  return t;
}

// A real model's prefill of `toks`: its K/V and its own recorded queries, at
// every position (max_queries <= 0 or T <= max_queries), else at max_queries
// evenly spaced positions ending with the last.
Seq model_seq(const km::Model& m, const std::string& name, const std::vector<int>& toks,
              int max_queries) {
  const km::Config& c = m.config();
  km::PrefillOptions opt;
  opt.record_queries = true;
  km::PrefillResult pr;
  std::string err;
  if (!m.prefill(toks, opt, &pr, &err)) die(name + ": " + err);
  Seq s;
  s.name = name;
  s.T = static_cast<int>(toks.size());
  s.H = c.kv_dim();
  s.L = c.n_layers;
  s.shape = km::AttentionShape{c.n_heads, c.n_kv_heads, c.head_size()};
  s.all_positions = max_queries <= 0 || s.T <= max_queries;
  if (s.all_positions)
    for (int i = 0; i < s.T; ++i) s.qpos.push_back(i);
  else
    for (int i = 0; i < max_queries; ++i)
      s.qpos.push_back(static_cast<int>((static_cast<int64_t>(i) + 1) * s.T / max_queries - 1));
  const size_t n = static_cast<size_t>(s.T) * s.H, nq = static_cast<size_t>(s.T) * c.dim;
  for (int l = 0; l < s.L; ++l) {
    s.k.emplace_back(pr.kv.k(l), pr.kv.k(l) + n);
    s.v.emplace_back(pr.kv.v(l), pr.kv.v(l) + n);
    std::vector<float> q;
    q.reserve(s.qpos.size() * c.dim);
    for (int p : s.qpos) {
      const auto row = pr.queries.begin() + l * nq + static_cast<size_t>(p) * c.dim;
      q.insert(q.end(), row, row + c.dim);
    }
    s.q.push_back(std::move(q));
  }
  compute_reference(&s);
  return s;
}

Seq stories_seq(const km::Model& m, const PromptSpec& p, const std::vector<int>& toks) {
  return model_seq(m, p.name(), toks, 0);
}

/** The whole text file at `path` (perf/common/chat_text.h); dies when unreadable. */
std::string read_text_file(const std::string& path) {
  std::string text, err;
  if (!kp::read_text_file(path, &text, &err)) die(err);
  return text;
}

std::vector<TextPrompt> smollm2_prompts(const km::Model& m, bool quick) {
  std::string err;
  const km::gguf::File* file = m.gguf_file();
  if (file == nullptr) die("the SmolLM2 model is not a GGUF file");
  kp::ChatText ct;  // perf/common/chat_text.h
  if (!ct.load(*file, &err)) die(err);
  auto encode = [&](const std::string& text) {
    std::vector<int32_t> ids;
    if (!ct.tok->encode(text, false, &ids, &err)) die(err);
    return std::vector<int>(ids.begin(), ids.end());
  };
  std::vector<TextPrompt> out;
  std::istringstream lines(read_text_file(std::string(KVXFER_DATA_DIR) + "/prompts/chat.txt"));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    if (quick && out.size() >= 2) break;
    std::vector<int> ids;
    if (!ct.encode_user(line, &ids, &err)) die(err);
    out.push_back({kp::strprintf("chat%zu", out.size() + 1), std::move(ids)});
  }
  const std::string gpl = read_text_file(std::string(KVXFER_DATA_DIR) + "/gpl-3.0-preamble.txt");
  const std::string apache = read_text_file(std::string(KVXFER_DATA_DIR) + "/apache-2.0.txt");
  auto add_long = [&](const std::string& name, const std::string& text, size_t max_tokens) {
    std::vector<int> t = encode(text);
    if (t.size() > max_tokens) t.resize(max_tokens);
    out.push_back({kp::strprintf("%s-%zu", name.c_str(), t.size()), std::move(t)});
  };
  add_long("gpl", gpl, quick ? 512 : 4096);
  if (!quick) {
    add_long("apache", apache, 2048);
    add_long("gpl+apache", gpl + "\n\n" + apache, 4096);
  }
  return out;
}

km::SyntheticKVSpec synth_spec(const SynthOptions& o) {
  km::SyntheticKVSpec spec;
  spec.seed = o.seed;
  spec.n_layers = o.layers;
  spec.n_kv_heads = 8;
  spec.head_dim = 128;
  return spec;
}

Seq synth_seq(const SynthOptions& o) {
  const km::SyntheticKVSpec spec = synth_spec(o);
  // Queries: keys of an independent seed, no outlier channels, q_heads heads.
  km::SyntheticKVSpec qspec = spec;
  qspec.seed = o.seed ^ 0x51E7A5C0FFEEull;
  qspec.key_outlier_pairs = 0;
  qspec.n_kv_heads = o.q_heads;
  Seq s;
  s.name = kp::strprintf("synth-%dx%d", o.layers, o.tokens);
  s.T = o.tokens;
  s.H = spec.row_channels();
  s.L = o.layers;
  s.shape = km::AttentionShape{o.q_heads, spec.n_kv_heads, spec.head_dim};
  s.all_positions = false;
  for (int i = 0; i < o.queries; ++i)
    s.qpos.push_back(static_cast<int>((static_cast<int64_t>(i) + 1) * o.tokens / o.queries - 1));
  std::string err;
  const size_t n = static_cast<size_t>(s.T) * s.H;
  for (int l = 0; l < s.L; ++l) {
    s.k.emplace_back(n);
    s.v.emplace_back(n);
    if (!km::fill_synthetic_kv(spec, l, km::KVKind::kKey, 0, s.T, s.k[l].data(), 0, &err) ||
        !km::fill_synthetic_kv(spec, l, km::KVKind::kValue, 0, s.T, s.v[l].data(), 0, &err))
      die(err);
    std::vector<float> q(s.qpos.size() * s.qdim());
    for (size_t i = 0; i < s.qpos.size(); ++i)
      if (!km::fill_synthetic_kv(qspec, l, km::KVKind::kKey, s.qpos[i], 1, q.data() + i * s.qdim(),
                                 0, &err))
        die(err);
    s.q.push_back(std::move(q));
  }
  compute_reference(&s);
  return s;
}

}  // namespace codec_quality
