// codec_quality's shared pieces: the codec rows, the data sets (built in
// codec_quality_data.cc), greedy decoding and the codec round trip of a KV,
// used by the codec table (codec_quality.cc) and the tree study
// (codec_quality_tree.cc).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "models/llama2.h"
#include "perf/baselines/kv_baselines.h"
#include "perf/common/harness.h"

namespace codec_quality {

namespace km = kvxfer::model;
namespace kb = kvxfer::baselines;
namespace kp = kvxfer::perf;
using json = nlohmann::json;

// Thread-seconds spent in each stage (reported in the footer).
struct Timers {
  double codec = 0, attention = 0, greedy = 0;
};
extern Timers g_time;

double now_s();
[[noreturn]] void die(const std::string& msg);

struct RowSpec {
  enum Kind { kKvxfer, kBaseline } kind = kKvxfer;
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  bool auto_alpha = false;
  kb::Baseline baseline = kb::Baseline::kInt8PerToken;
  int base_sinks = 0;  // baselines: the first rows also sent as bf16, as kvxfer's sink rows

  bool progressive() const {
    return kind == kKvxfer && (cfg.codec == KVXFER_CODEC_LYNX || cfg.codec == KVXFER_CODEC_INT8);
  }
  std::string codec_name() const {
    if (kind == kBaseline) return kb::baseline_name(baseline);
    switch (cfg.codec) {
      case KVXFER_CODEC_LYNX: return "Lynx";
      case KVXFER_CODEC_INT8: return "INT8";
      case KVXFER_CODEC_INT4: return "INT4";
      case KVXFER_CODEC_BF16: return "BF16";
      case KVXFER_CODEC_SPECTRUM:
        return "SpectrumKV";  // not a row of this table (perf/spectrum_quality)
    }
    return "?";
  }
  std::string split() const {
    if (kind == kBaseline) return kp::strprintf("%d", kb::baseline_bits(baseline));
    if (cfg.codec == KVXFER_CODEC_BF16) return "16";
    if (cfg.codec == KVXFER_CODEC_INT4) return "4";
    return kp::strprintf("%d+%d", cfg.anchor_bits, 8 - cfg.anchor_bits);
  }
  std::string alpha() const {
    if (kind != kKvxfer || cfg.codec != KVXFER_CODEC_LYNX) return "-";
    if (auto_alpha) return "auto";
    return kp::strprintf("%g", cfg.alpha);
  }
  std::string group() const {
    if (kind == kBaseline)
      return baseline == kb::Baseline::kInt8PerToken || baseline == kb::Baseline::kInt4PerToken
                 ? "tok"
                 : "32";
    if (cfg.codec == KVXFER_CODEC_BF16) return "-";
    const char* v = cfg.value_groups == KVXFER_VALUE_GROUPS_TOKEN  ? "t"
                    : cfg.value_groups == KVXFER_VALUE_GROUPS_AUTO ? "a"
                                                                   : "";
    return kp::strprintf("%d%s", cfg.chunk_tokens, v);
  }
  // Attention-sink rows sent exactly (kvxfer codecs; docs/FORMAT.md 2.7).
  std::string sinks() const {
    if (kind == kBaseline) return base_sinks > 0 ? kp::strprintf("%d", base_sinks) : "-";
    if (cfg.codec == KVXFER_CODEC_BF16) return "-";
    return kp::strprintf("%d", cfg.sink_tokens);
  }
  std::string label() const {
    return codec_name() + " " + split() + " a=" + alpha() + " C=" + group() + " s=" + sinks();
  }
};

// One page through a row: anchor-precision and full-precision reconstructions.
struct PageOut {
  std::vector<float> anchor, full;
  double bits_anchor = 0, bits_total = 0;  // bits on the wire for this page
  float chosen_alpha = -1.0f;              // from the anchor header (LYNX)
};

void run_page(const RowSpec& row, const float* x, int64_t T, int H, uint32_t layer, bool is_key,
              uint64_t stream, PageOut* out);

struct Seq {
  std::string name;
  int T = 0, H = 0, L = 0;
  std::vector<std::vector<float>> k, v;  // [L][T*H]
  km::AttentionShape shape;
  std::vector<int> qpos;                  // query positions, ascending
  bool all_positions = false;             // qpos == 0..T-1
  std::vector<std::vector<float>> q;      // [L][nq * n_heads*head_size]
  std::vector<std::vector<float>> o_ref;  // [L][nq * n_heads*head_size]
  size_t qdim() const { return static_cast<size_t>(shape.n_heads) * shape.head_size; }
};

/** Attention of s's queries of layer l over K/V k, v into out (timed in g_time). */
void attend(const Seq& s, int l, const float* k, const float* v, float* out);
void compute_reference(Seq* s);

// Token sequences: BOS (1) then greedy (temperature 0) or sampled (temperature
// 1, inverse CDF with a splitmix64 stream) continuation, or uniform random ids.
enum class PromptKind { kGreedy, kSampled, kRandom };

struct PromptSpec {
  PromptKind kind;
  int length;
  uint64_t seed;
  std::string name() const {
    const char* k = kind == PromptKind::kGreedy    ? "greedy"
                    : kind == PromptKind::kSampled ? "sample"
                                                   : "random";
    return kind == PromptKind::kGreedy
               ? kp::strprintf("%s-%d", k, length)
               : kp::strprintf("%s%llu-%d", k, static_cast<unsigned long long>(seed), length);
  }
};

std::vector<int> make_tokens(const km::Model& m, const PromptSpec& p);

// A real model's prefill of `toks`: its K/V and its own recorded queries, at
// every position (max_queries <= 0 or T <= max_queries), else at max_queries
// evenly spaced positions ending with the last.
Seq model_seq(const km::Model& m, const std::string& name, const std::vector<int>& toks,
              int max_queries);

Seq stories_seq(const km::Model& m, const PromptSpec& p, const std::vector<int>& toks);

// SmolLM2 prompts: the chat prompts of data/prompts/chat.txt, each a user turn
// of the model's chat template, and long real-text prompts (raw text, no
// template): the GPL-3.0 preamble, the first 2048 tokens of the Apache-2.0
// license, and the two texts one after the other (about 3K tokens).
struct TextPrompt {
  std::string name;
  std::vector<int> toks;
};

std::vector<TextPrompt> smollm2_prompts(const km::Model& m, bool quick);

struct SynthOptions {
  int layers = 4, tokens = 1024, queries = 32, q_heads = 32;
  uint64_t seed = 1;
};

Seq synth_seq(const SynthOptions& o);

// The argmax of a row of logits and its margin over the runner-up.
int top_with_margin(const float* logits, size_t n, float* margin);

// Greedy decoding over a KV view, one decode_step at a time from `first`.
struct GreedyRun {
  std::vector<int> feed;      // tokens fed at positions n_tokens .. n_tokens+steps-1
  std::vector<int> ref;       // argmax at each step
  std::vector<float> margin;  // top-1 minus top-2 logit at each step
};

GreedyRun greedy_decode(const km::Model& m, const km::KVView& view, int first, int steps);

// Greedy-agreement case: full-precision prefix KV and the teacher-forced run.
struct GreedyCase {
  std::string name;
  km::KVCache kv;    // prefill of P[0..n-2]
  int last = 0;      // P[n-1], the first token fed
  GreedyRun greedy;  // full-precision greedy from P[n-1] (empty without a reference)
};

// A prefill's KV through a codec, every layer's K and V as one page: the
// decoded pages and views of them at anchor and at full precision.  The
// views point into `k` and `v`.
struct CodedKV {
  std::vector<PageOut> k, v;
  km::KVView anchor, full;
};

CodedKV code_kv(const RowSpec& row, const km::KVCache& kv, uint64_t stream);

void run_tree_study(const std::string& dataset, const km::Model& m,
                    const std::vector<GreedyCase>& cases, int steps, json* out);

}  // namespace codec_quality
