#include "perf/common/kv_data.h"

#include <cstddef>
#include <memory>
#include <utility>

#include "models/llama2.h"

namespace kvxfer::perf {

namespace km = kvxfer::model;

km::SyntheticKVSpec llama3_8b_like_spec(int n_layers) {
  km::SyntheticKVSpec spec;
  spec.seed = 1;
  spec.n_layers = n_layers;
  spec.n_kv_heads = 8;
  spec.head_dim = 128;
  spec.rope_theta = 500000.0f;  // Llama-3
  return spec;
}

bool greedy_prefill_kv(const std::string& path, GreedyPrefillKV* out, std::string* err) {
  std::unique_ptr<km::Model> m = km::Model::load(path, err);
  if (!m) return false;
  const km::Config& c = m->config();
  const int T = c.seq_len;
  std::vector<int> toks{1};
  km::KVCache tail;
  std::vector<float> logits;
  for (int pos = 0; pos + 1 < T; ++pos) {
    if (!m->decode_step(toks[static_cast<size_t>(pos)], pos, km::KVView{}, &tail, &logits, err)) {
      *err = "decode_step: " + *err;
      return false;
    }
    toks.push_back(km::argmax(logits.data(), logits.size()));
  }
  km::PrefillResult pre;
  if (!m->prefill(toks, km::PrefillOptions{}, &pre, err)) {
    *err = "prefill: " + *err;
    return false;
  }
  GreedyPrefillKV r;
  r.tokens = T;
  r.layers = c.n_layers;
  r.kv_heads = c.n_kv_heads;
  r.head_dim = c.head_size();
  r.ids = std::move(toks);
  const size_t n = static_cast<size_t>(T) * static_cast<size_t>(c.kv_dim());
  for (int l = 0; l < c.n_layers; ++l) {
    r.k.emplace_back(pre.kv.k(l), pre.kv.k(l) + n);
    r.v.emplace_back(pre.kv.v(l), pre.kv.v(l) + n);
  }
  *out = std::move(r);
  return true;
}

}  // namespace kvxfer::perf
