// spectrum_quality's rows and their evaluation: a sequence's KV through a
// row's policy or codec (spectrum_quality_rows.cc), used by the tables of
// spectrum_quality.cc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "kvxfer/spectrum.h"
#include "models/llama2.h"
#include "models/model_probe.h"

namespace spectrum_quality {

namespace km = kvxfer::model;
namespace ks = kvxfer::spectrum;

[[noreturn]] void die(const std::string& msg);

// One sequence: its KV (what is transferred), importance, and decode queries.
struct Seq {
  std::string name;
  km::KVCache kv;
  std::vector<float> importance;
  km::AttentionShape shape;
  std::vector<float> queries;  // [L][nq][n_heads*head_size], each attending to all n tokens
  int nq = 0;
  std::vector<std::vector<float>> o_ref;   // [L][nq*qdim]
  const km::Model* model = nullptr;        // scores cont (stories, smollm2)
  const ks::Continuation* cont = nullptr;  // stories, smollm2
  double nll_prefix_full = 0;              // ks::score_prefix_view over the full KV
  size_t qdim() const { return static_cast<size_t>(shape.n_heads) * shape.head_size; }
};

void compute_reference(Seq* s);

struct Row {
  std::string name;
  double b = 0;  // budget (uniform codecs: their own)
  enum Kind { kPolicy, kPdtrim, kRecent, kTopImp, kUniform, kFull } kind = kPolicy;
  kvxfer_spectrum_variant_t variant = KVXFER_SPECTRUM_GREEDY;
  int sinks = -1;  // -1: --sinks
  int allow_int4 = 0;
  kvxfer_codec_t codec = KVXFER_CODEC_SPECTRUM;
};

struct Acc {
  double bytes = 0, fp16_bytes = 0, se = 0, norm = 0, nll = 0, nll_full = 0;
  double nll_seq = 0, nll_seq_full = 0;  // the prompt re-scored over its transferred KV
  int agree = 0, positions = 0, seq_positions = 0;
  double tiers[4] = {0, 0, 0, 0};
  void add(const Acc& o) {
    bytes += o.bytes;
    fp16_bytes += o.fp16_bytes;
    se += o.se;
    norm += o.norm;
    nll += o.nll;
    nll_full += o.nll_full;
    nll_seq += o.nll_seq;
    nll_seq_full += o.nll_seq_full;
    agree += o.agree;
    positions += o.positions;
    seq_positions += o.seq_positions;
    for (int t = 0; t < 4; ++t) tiers[t] += o.tiers[t];
  }
};

struct PolicyParams {
  int sinks = 4;
  float lambda = 0.00390625f;
  double pdtrim_first = 0.5;
};

std::vector<uint8_t> tiers_for(const Row& r, int64_t n, const float* importance,
                               const PolicyParams& pp, uint64_t seed);

// The KV of `kv` after row r's transfer (kFull: none, the KV itself).
void transfer(const Row& r, const km::KVCache& kv, const float* importance, const PolicyParams& pp,
              uint64_t seed, ks::TransferredKV* tk, std::vector<uint8_t>* tiers);

Acc eval(const Row& r, const Seq& s, const PolicyParams& pp, uint64_t seed);

// adaptive_int4 < 0: no probe for this data set (no Adaptive row).
std::vector<Row> make_rows(const std::vector<double>& budgets, int adaptive_int4);

// NIAH rows: the paper's Table 4 methods and ours.
std::vector<Row> make_niah_rows(const std::vector<double>& budgets, int adaptive_int4);

}  // namespace spectrum_quality
