// perf/spectrum_quality: SpectrumKV mixed precision against keep/drop and
// uniform quantization at equal transfer budgets (docs/SPECTRUMKV.md).
//
// Table 1, one row per (data set, budget b, policy).  Row names follow the
// paper (arXiv:2606.08635); docs/SPECTRUMKV.md maps them to kvxfer's API:
//   Greedy        kvxfer GREEDY, no sink pinned (s = 0), INT4 allowed: the
//                 paper's Greedy (Table 11: "sinks ranked like all others")
//   SinkProtect   kvxfer GREEDY with the first s tokens pinned to FP16, INT4
//                 allowed (the paper's SinkProtect; kvxfer's default policy)
//   Adaptive      SinkProtect with INT4 as the data set's probe decides
//                 (3-tier when it passes, else 2-Tier); no row for synth
//   2-Tier        SinkProtect with INT4 disabled (the probe's fallback: DROP
//                 below b = 1/2), always shown
//   Recency, Balanced, Random   kvxfer's variants SINK_PROTECT (sinks, then
//                 by recency), BALANCED, RANDOM (mean over --seeds seeds),
//                 sinks pinned, INT4 allowed
//   PDTrim        keep/drop: floor(b n) tokens at FP16, the first
//                 round(r floor(b n)) and the last others (r = --pdtrim-first,
//                 0.5 as the paper's Table 2), the middle dropped
//   Recent        keep/drop: the first s and the most recent others at FP16
//                 (StreamingLLM-like; PDTrim with the first region = sinks)
//   TopImp        keep/drop by importance (SWS-like): the first s and the
//                 most important others at FP16, the rest dropped
//   INT8, INT4    the uniform codecs KVXFER_CODEC_INT8 / _INT4 (b = 1/2, 1/4)
// Every SpectrumKV and keep/drop row travels as KVXFER_CODEC_SPECTRUM pages
// (kvxfer_page_encode_tiered), decoded at full precision; dropped tokens are
// masked out of attention (Model KVLayerView::drop).
// Columns:
//   bytes     wire bytes: anchor + residual sections of every page (K and V,
//             all layers, all sequences; headers, metadata and map included)
//   ratio     bytes / bytes of the same KV in fp16 (2 bytes per element)
//   vNMSE     sum |O_hat - O|^2 / sum |O|^2 of the attention outputs (per
//             head softmax(q k^T / sqrt(d)) v, no wo) of decode-time queries
//             over the transferred KV (stories, smollm2: the queries of the
//             continuation tokens over the prompt's KV; synth: generated
//             queries after the last token)
//   agree     greedy-token agreement: fraction of the teacher-forced
//             continuation tokens whose argmax equals full precision
//   PPL       exp(mean -log p(target)) over the continuation: the model's own
//             full-precision greedy tokens (stories), the real text (smollm2)
//   dPPL%     100 (PPL_hat / PPL - 1), PPL over the full-precision KV
//   PPLseq    the paper's protocol (our reading, docs/SPECTRUMKV.md): every
//             transferred token re-scored over the transferred KV of itself
//             and the tokens before it (Model::score_over_view), predicting
//             the next token of the sequence; exp(mean -log p) over them
//   dPPLseq%  100 (PPLseq_hat / PPLseq - 1) against the full-precision KV
// Data sets: stories = stories260K prefilled on sampled prompts, importance
// from its prefill attention mass; synth = the synthetic Llama-like KV
// (models/synthetic_kv.h), importance from the KV-norm fallback;
// smollm2 = SmolLM2-135M-Instruct on the real text data/apache-2.0.txt: the
// KV of its first P = --text-prompt tokens (default 1024) is transferred, the
// next --text-steps tokens (1024) of the text are teacher-forced over it (P = 0:
// all but the last steps + 1), importance from the prefill attention mass.
//
// Table 2 (smollm2): needle in a haystack.  The passkey sentence at each of
// --niah-depths depths of the text, a question in the chat template; the KV
// of the prompt (all but its last token) is transferred, the answer decoded
// greedily over it; found = the answer contains the passkey.  The INT4 probe
// of smollm2 is the paper's: 3 such trials under 3-tier Greedy at b = 0.3.
#include "perf/spectrum_quality.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/params.h"
#include "kvxfer/kvxfer.h"
#include "kvxfer/spectrum.h"
#include "models/bpe_tokenizer.h"
#include "models/chat_template.h"
#include "models/gguf.h"
#include "models/llama2.h"
#include "models/model_paths.h"
#include "models/model_probe.h"
#include "models/synthetic_kv.h"
#include "perf/common/chat_text.h"
#include "perf/common/harness.h"
#include "tiers/spectrum_impl.h"

namespace spectrum_quality {

namespace kp = kvxfer::perf;
using json = nlohmann::json;

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "spectrum_quality: %s\n", msg.c_str());
  std::exit(1);
}

// A sequence of a model's continuation (stories, smollm2).
void model_seq(const km::Model& m, const ks::Continuation& c, const std::string& name, float lambda,
               Seq* s) {
  const km::Config& mc = m.config();
  std::string e;
  s->name = name;
  s->kv = c.kv;
  s->model = &m;
  s->cont = &c;
  s->shape = km::AttentionShape{mc.n_heads, mc.n_kv_heads, mc.head_size()};
  s->nq = static_cast<int>(c.feed.size());
  s->queries = c.queries;
  if (!ks::attention_importance(m, c, lambda, &s->importance, &e)) die(e);
  if (!ks::score_prefix_view(m, c, c.kv.view(), &s->nll_prefix_full, &e)) die(e);
  compute_reference(s);
}

Seq synth_seq(int layers, int tokens, int nq, float lambda) {
  km::SyntheticKVSpec spec;
  spec.seed = 1;
  spec.n_layers = layers;
  km::SyntheticKVSpec qspec = spec;
  qspec.seed = spec.seed ^ 0x51E7A5C0FFEEull;
  qspec.key_outlier_pairs = 0;
  qspec.n_kv_heads = 32;
  Seq s;
  s.name = kp::strprintf("synth-%dx%d", layers, tokens);
  const int H = spec.row_channels();
  s.kv = km::KVCache(layers, H);
  s.kv.resize(tokens);
  s.shape = km::AttentionShape{32, spec.n_kv_heads, spec.head_dim};
  s.nq = nq;
  s.queries.resize(static_cast<size_t>(layers) * nq * s.qdim());
  std::string err;
  std::vector<kvxfer_page_layout_t> pages;
  std::vector<void*> blocks(2 * layers);
  for (int l = 0; l < layers; ++l) {
    if (!km::fill_synthetic_kv(spec, l, km::KVKind::kKey, 0, tokens, s.kv.k(l), 0, &err) ||
        !km::fill_synthetic_kv(spec, l, km::KVKind::kValue, 0, tokens, s.kv.v(l), 0, &err) ||
        !km::fill_synthetic_kv(qspec, l, km::KVKind::kKey, tokens, nq,
                               s.queries.data() + static_cast<size_t>(l) * nq * s.qdim(), 0, &err))
      die(err);
    blocks[2 * l] = s.kv.k(l);
    blocks[2 * l + 1] = s.kv.v(l);
  }
  for (int p = 0; p < 2 * layers; ++p)
    pages.push_back({&blocks[p], 1, tokens, H, 0, tokens, H, KVXFER_DTYPE_FP32});
  s.importance.resize(tokens);
  if (kvxfer_spectrum_importance_from_kv(pages.data(), static_cast<int32_t>(pages.size()), lambda,
                                         s.importance.data()) != KVXFER_SUCCESS)
    die(std::string("importance_from_kv: ") + kvxfer_get_last_error());
  compute_reference(&s);
  return s;
}

bool parse_budgets(const std::string& list, const char* flag, std::vector<double>* out) {
  out->clear();
  for (const std::string& b : kp::split(list)) {
    // Checked before the model runs: a typo must not cost a minute.
    char* end = nullptr;
    const double v = std::strtod(b.c_str(), &end);
    if (b.empty() || end == nullptr || *end != '\0' || !(v >= 0.25 && v <= 1.0)) {
      std::fprintf(stderr, "spectrum_quality: %s: '%s' is not a budget in [0.25, 1]\n", flag,
                   b.c_str());
      return false;
    }
    out->push_back(v);
  }
  return true;
}

// Passkey of NIAH depth i: 5 digits, a pure function of i.
std::string passkey_of(int i) {
  uint64_t z = 0xC0DEull + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return std::to_string(10000 + z % 90000);
}

// The SmolLM2 model, its tokenizer and chat template (perf/common/chat_text.h).
struct Chat : kp::ChatText {
  std::unique_ptr<km::Model> model;
};

/** The columns of a table row: data set, budget, policy, the tier shares, then `tail`. */
std::vector<kp::Table::Column> row_columns(std::vector<kp::Table::Column> tail) {
  std::vector<kp::Table::Column> cols = {{"data", 7}, {"b", 4},    {"policy", 11}, {"fp16", 5},
                                         {"int8", 5}, {"int4", 5}, {"drop", 5}};
  cols.insert(cols.end(), tail.begin(), tail.end());
  return cols;
}

struct NiahAcc {
  int found = 0, cases = 0;
  double tiers[4] = {0, 0, 0, 0};
  std::string map;  // per depth: '+' found, '.' not
};

}  // namespace spectrum_quality

using namespace spectrum_quality;  // NOLINT(google-build-using-namespace)

static int run(int argc, char** argv) {
  CLI::App app{"SpectrumKV quality: mixed precision vs keep/drop vs uniform at equal budget"};
  bool quick = false;
  int check = 1;
  std::string json_path, budgets_s = "0.25,0.3,0.4,0.5,0.7", datasets_s;
  std::string model_path = std::string(KVXFER_DATA_DIR) + "/stories260K.bin";
  std::string smollm2_path = km::smollm2_gguf_path();
  std::string text_path = std::string(KVXFER_DATA_DIR) + "/apache-2.0.txt";
  std::string niah_budgets_s = "0.3,0.5,0.7";
  int prompts = 3, prompt_tokens = 320, steps = 64, seeds = 3;
  int synth_layers = 2, synth_tokens = 512, synth_queries = 16;
  // seq = 2048 as the paper's Tables 2 and 3: the first half transferred,
  // the second half scored.
  int text_prompt = 1024, text_steps = 1024, niah_depths = 11, niah_haystack = 0;
  PolicyParams pp;
  auto* quick_opt = app.add_flag(
      "--quick", quick,
      "stories: 1 prompt of 192 tokens, synth: 256 tokens, budgets 0.3,0.5; data sets "
      "stories,synth unless -D; smollm2 (with -D): a 512-token prompt, 64 steps, 3 needle depths "
      "of a 512-token haystack, NIAH budgets 0.3,0.5");
  app.add_option("-J,--json", json_path, "write all results to this JSON file");
  app.add_option("-c,--check", check, "1: fail (exit 1) on an out-of-bounds result")
      ->capture_default_str()
      ->check(CLI::Range(0, 1));
  app.add_option("-D,--datasets", datasets_s,
                 "comma list of stories, synth, smollm2 (default all; smollm2 is skipped with a "
                 "message when its GGUF is absent)");
  app.add_option("-B,--budgets", budgets_s, "comma list of budgets in [0.25, 1]")
      ->capture_default_str()
      ->excludes(quick_opt);
  app.add_option("--model", model_path, "llama2.c checkpoint (stories)")->capture_default_str();
  app.add_option("--smollm2", smollm2_path, "SmolLM2-135M-Instruct GGUF")->capture_default_str();
  app.add_option("--text", text_path, "real text of smollm2 (perplexity and haystack)")
      ->capture_default_str();
  app.add_option("--prompts", prompts, "stories prompts")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--prompt-tokens", prompt_tokens, "tokens per stories prompt")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--steps", steps, "stories: teacher-forced continuation tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--text-prompt", text_prompt,
                 "smollm2: tokens of the text whose KV is transferred (0: all but the last "
                 "text-steps + 1)")
      ->capture_default_str();
  app.add_option("--text-steps", text_steps, "smollm2: teacher-forced tokens of the text")
      ->capture_default_str();
  app.add_option("--niah-depths", niah_depths, "smollm2: needle depths i/(D-1), i = 0..D-1")
      ->capture_default_str();
  app.add_option("--niah-haystack", niah_haystack,
                 "smollm2: haystack tokens (the text cut at a line break; 0: all of it)")
      ->capture_default_str();
  app.add_option("--niah-budgets", niah_budgets_s, "smollm2: NIAH budgets")
      ->capture_default_str()
      ->excludes(quick_opt);
  app.add_option("--seeds", seeds, "seeds of the Random variant")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--sinks", pp.sinks, "sink tokens s")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--lambda", pp.lambda, "recency decay of the importance")->capture_default_str();
  app.add_option("--pdtrim-first", pp.pdtrim_first,
                 "PDTrim: share of the kept tokens taken from the start")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--synth-layers", synth_layers, "synthetic layers")
      ->capture_default_str()
      ->check(CLI::Range(1, 128));
  app.add_option("--synth-tokens", synth_tokens, "synthetic tokens")
      ->capture_default_str()
      ->check(CLI::Range(1, 131072));
  CLI11_PARSE(app, argc, argv);
  if (kvxfer::params::validate() < 0) {
    std::fprintf(stderr, "spectrum_quality: %s\n", kvxfer::last_error());
    return 2;
  }
  if (quick) {
    prompts = 1;
    prompt_tokens = 192;
    synth_tokens = 256;
    synth_queries = 8;
    seeds = 2;
    budgets_s = "0.3,0.5";
    niah_budgets_s = "0.3,0.5";
    if (datasets_s.empty()) datasets_s = "stories,synth";
    text_prompt = 512;
    text_steps = 64;
    niah_depths = 3;
    niah_haystack = 512;
  }
  if (datasets_s.empty()) datasets_s = "stories,synth,smollm2";
  bool use_stories = false, use_synth = false, use_smollm2 = false;
  for (const std::string& d : kp::split(datasets_s)) {
    if (d == "stories") {
      use_stories = true;
    } else if (d == "synth") {
      use_synth = true;
    } else if (d == "smollm2") {
      use_smollm2 = true;
    } else {
      std::fprintf(stderr,
                   "spectrum_quality: -d: unknown data set '%s' (stories, synth, smollm2)\n",
                   d.c_str());
      return 2;
    }
  }
  std::vector<double> budgets, niah_budgets;
  if (!parse_budgets(budgets_s, "-B", &budgets) ||
      !parse_budgets(niah_budgets_s, "--niah-budgets", &niah_budgets))
    return 2;
  if (niah_depths < 1 || text_steps < 1 || text_prompt < 0 || niah_haystack < 0) {
    std::fprintf(stderr, "spectrum_quality: --niah-depths, --text-steps must be >= 1\n");
    return 2;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::string err;

  // Models.
  std::unique_ptr<km::Model> model;
  if (use_stories) {
    model = km::Model::load(model_path, &err);
    if (!model) die("cannot load " + model_path + ": " + err);
  }
  Chat sm;
  std::string smollm2_skip;
  std::string text;
  std::vector<int> text_tokens;
  if (use_smollm2) {
    if (!std::ifstream(smollm2_path).good()) {
      smollm2_skip = smollm2_path + " is absent (scripts/install-deps.sh fetches it)";
      use_smollm2 = false;
    } else {
      sm.model = km::Model::load(smollm2_path, &err);
      if (!sm.model) die("cannot load " + smollm2_path + ": " + err);
      if (sm.model->gguf_file() == nullptr) die(smollm2_path + " is not a GGUF");
      if (!sm.load(*sm.model->gguf_file(), &err)) die(err);
      if (!kp::read_text_file(text_path, &text, &err)) die(err);
      std::vector<int32_t> ids;
      if (sm.tok->add_bos()) ids.push_back(sm.tok->bos_id());
      if (!sm.tok->encode(text, false, &ids, &err)) die(err);
      text_tokens.assign(ids.begin(), ids.end());
      if (text_prompt == 0) text_prompt = static_cast<int>(text_tokens.size()) - text_steps - 1;
      if (text_prompt < 1 || text_prompt + text_steps + 1 > static_cast<int>(text_tokens.size()))
        die(kp::strprintf("%s has %zu tokens: too few for --text-prompt %d + --text-steps %d + 1",
                          text_path.c_str(), text_tokens.size(), text_prompt, text_steps));
    }
  }

  // The built-in INT4 tolerance probes decide the Adaptive rows' INT4:
  // stories260K's agreement probe, SmolLM2's NIAH probe (the paper's).
  ks::ProbeOptions po;
  po.base.lambda = pp.lambda;
  po.base.sink_tokens = pp.sinks;
  ks::ProbeReport probe;
  ks::NiahProbeOptions npo;
  npo.haystack = text;
  npo.niah.haystack_tokens = niah_haystack;
  npo.base.lambda = pp.lambda;
  npo.base.sink_tokens = pp.sinks;
  ks::NiahProbeReport niah_probe;
  // Data sets and probes, in parallel (one job each, single-threaded inside);
  // the longest first.
  ks::Continuation text_cont;
  Seq text_seq;
  std::vector<ks::NiahCase> niah(use_smollm2 ? niah_depths : 0);
  std::vector<std::vector<float>> niah_imp(niah.size());
  std::vector<ks::Continuation> conts(use_stories ? prompts : 0);
  std::vector<Seq> stories(conts.size());
  Seq synth;
  enum JobKind { kSmolProbe, kSmolText, kSmolNiah, kStoriesProbe, kSynth, kStories };
  std::vector<std::pair<JobKind, int>> prep;
  if (use_smollm2) {
    prep.push_back({kSmolProbe, 0});
    prep.push_back({kSmolText, 0});
    for (int i = 0; i < niah_depths; ++i) prep.push_back({kSmolNiah, i});
  }
  if (use_stories) prep.push_back({kStoriesProbe, 0});
  if (use_synth) prep.push_back({kSynth, 0});
  for (size_t i = 0; i < conts.size(); ++i) prep.push_back({kStories, static_cast<int>(i)});
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t job = 0; job < prep.size(); ++job) {
    std::string e;
    const int i = prep[job].second;
    switch (prep[job].first) {
      case kSmolProbe:
        if (!ks::probe_niah(*sm.model, *sm.tok, *sm.chat, npo, &niah_probe, &e))
          die("smollm2 probe: " + e);
        break;
      case kSmolText:
        if (!ks::make_text_continuation(*sm.model, text_tokens, text_prompt, text_steps, &text_cont,
                                        &e))
          die(e);
        model_seq(*sm.model, text_cont, "apache-2.0", pp.lambda, &text_seq);
        break;
      case kSmolNiah: {
        const double d = niah_depths == 1 ? 0.5 : static_cast<double>(i) / (niah_depths - 1);
        if (!ks::make_niah_case(*sm.model, *sm.tok, *sm.chat, text, d, passkey_of(i), npo.niah,
                                &niah[i], &e) ||
            !ks::niah_importance(*sm.model, niah[i], pp.lambda, &niah_imp[i], &e))
          die("niah: " + e);
        break;
      }
      case kStoriesProbe:
        if (!ks::probe_model(*model, po, &probe, &e)) die("probe: " + e);
        break;
      case kSynth: synth = synth_seq(synth_layers, synth_tokens, synth_queries, pp.lambda); break;
      case kStories: {
        std::vector<int> toks;
        if (!ks::sample_tokens(*model, prompt_tokens, 100 + i, &toks, &e) ||
            !ks::make_continuation(*model, toks, steps, &conts[i], &e))
          die(e);
        model_seq(*model, conts[i], kp::strprintf("sample%d-%d", 100 + i, prompt_tokens), pp.lambda,
                  &stories[i]);
        break;
      }
    }
  }
  const double t_data =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  kp::print_preamble(stdout, "spectrum_quality", kp::machine_info(), kp::kvxfer_settings());
  if (use_stories)
    std::printf(
        "# stories: stories260K, %d sampled prompts of %d tokens (KV of %d tokens each), "
        "%d-token greedy continuation; importance from prefill attention mass\n",
        prompts, prompt_tokens, prompt_tokens - 1, steps);
  if (use_synth)
    std::printf(
        "# synth:   synthetic KV L=%d, 8 KV heads x 128, T=%d, %d queries x 32 heads after "
        "the last token; importance from the KV norm\n",
        synth_layers, synth_tokens, synth_queries);
  if (use_smollm2)
    std::printf(
        "# smollm2: %s, %s (%zu tokens): KV of tokens 0..%d transferred, the next %d tokens of "
        "the text teacher-forced (PPL %.4f over the full-precision KV), and the %d transferred "
        "tokens re-scored over it (PPLseq %.4f); importance from prefill attention mass\n",
        sm.model->config().name.c_str(), text_path.substr(text_path.rfind('/') + 1).c_str(),
        text_tokens.size(), text_prompt - 1, text_steps, std::exp(text_cont.nll_full / text_steps),
        text_prompt, std::exp(text_seq.nll_prefix_full / text_prompt));
  else if (!smollm2_skip.empty())
    std::printf("# smollm2: skipped: %s\n", smollm2_skip.c_str());
  std::printf(
      "# policy:  s=%d sinks, lambda=%g, Random = mean of %d seeds, PDTrim first share %g; codec "
      "SPECTRUM (anchor 4 + residual 4 bits for INT8, chunk 32), full precision\n",
      pp.sinks, static_cast<double>(pp.lambda), seeds, pp.pdtrim_first);
  if (use_stories) {
    std::printf("# probe stories: INT4 %s (%d of %d trials passed at b=0.3):",
                probe.allow_int4 ? "ALLOWED" : "BLOCKED", probe.passed, probe.run);
    for (const ks::ProbeTrial& t : probe.trials)
      std::printf(" [3-tier %d/%d vs 2-tier %d/%d]", t.agree, t.steps, t.agree_fallback, t.steps);
    std::printf("\n");
  }
  if (use_smollm2) {
    std::printf("# probe smollm2: INT4 %s (%d of %d NIAH trials passed, 3-tier Greedy at b=0.3):\n",
                niah_probe.allow_int4 ? "ALLOWED" : "BLOCKED", niah_probe.passed, niah_probe.run);
    for (const ks::NiahProbeTrial& t : niah_probe.trials)
      std::printf("#   depth %.2f passkey %s (%d tokens): %s \"%s\"; full precision %s\n", t.depth,
                  t.passkey.c_str(), t.prompt_tokens, t.found ? "found" : "MISSED",
                  t.answer.c_str(), t.found_full ? "found" : "missed");
  }
  std::printf("#\n");

  kp::Table table(row_columns({{"bytes", 9},
                               {"ratio", 6},
                               {"vNMSE", 9},
                               {"agree", 6},
                               {"PPL", 8},
                               {"dPPL%", 8},
                               {"PPLseq", 8},
                               {"dPPLseq%", 8}}));
  std::printf("%s\n", table.header().c_str());
  struct DataSet {
    std::string name;
    std::vector<const Seq*> seqs;
    std::vector<Row> rows;
  };
  std::vector<DataSet> sets;
  if (use_smollm2)
    sets.push_back({"smollm2", {&text_seq}, make_rows(budgets, niah_probe.allow_int4)});
  if (use_stories) {
    DataSet d{"stories", {}, make_rows(budgets, probe.allow_int4)};
    for (const Seq& s : stories) d.seqs.push_back(&s);
    sets.push_back(d);
  }
  if (use_synth) sets.push_back({"synth", {&synth}, make_rows(budgets, -1)});
  struct Job {
    int set, row;
  };
  std::vector<Job> jobs;
  for (size_t d = 0; d < sets.size(); ++d)
    for (size_t r = 0; r < sets[d].rows.size(); ++r)
      jobs.push_back({static_cast<int>(d), static_cast<int>(r)});
  std::vector<Acc> accs(jobs.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Row& r = sets[jobs[j].set].rows[jobs[j].row];
    const int nseeds = r.kind == Row::kPolicy && r.variant == KVXFER_SPECTRUM_RANDOM ? seeds : 1;
    for (int sd = 0; sd < nseeds; ++sd)
      for (const Seq* s : sets[jobs[j].set].seqs) accs[j].add(eval(r, *s, pp, sd));
    accs[j].bytes /= nseeds;  // the mean transfer (ratio, vNMSE, agree are ratios of sums)
    accs[j].fp16_bytes /= nseeds;
  }
  int bad = 0;
  json jrows = json::array();
  // dPPL% and NIAH accuracy by (data set, policy, b), for the figures.
  auto key = [](const std::string& d, const std::string& p, double b) {
    return d + "/" + p + "/" + kp::strprintf("%.2f", b);
  };
  std::map<std::string, double> dppl_of, dppl_seq_of, niah_of;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const DataSet& ds = sets[jobs[j].set];
    const Row& r = ds.rows[jobs[j].row];
    const Acc& a = accs[j];
    const bool scored = a.positions > 0;
    const double ratio = a.bytes / a.fp16_bytes, vn = a.se / a.norm;
    const double tot = a.tiers[0] + a.tiers[1] + a.tiers[2] + a.tiers[3];
    auto frac = [&](int t) {
      return r.kind == Row::kUniform ? std::string("-") : kp::strprintf("%.3f", a.tiers[t] / tot);
    };
    const double agree = scored ? static_cast<double>(a.agree) / a.positions : NAN;
    const double ppl = scored ? std::exp(a.nll / a.positions) : NAN;
    const double dppl = scored ? 100.0 * (std::exp((a.nll - a.nll_full) / a.positions) - 1.0) : NAN;
    const double ppl_seq = scored ? std::exp(a.nll_seq / a.seq_positions) : NAN;
    const double dppl_seq =
        scored ? 100.0 * (std::exp((a.nll_seq - a.nll_seq_full) / a.seq_positions) - 1.0) : NAN;
    if (scored) {
      dppl_of[key(ds.name, r.name, r.b)] = dppl;
      dppl_seq_of[key(ds.name, r.name, r.b)] = dppl_seq;
    }
    // Sanity (-c 1): finite error; payload within the budget (metadata, map
    // and headers add at most 0.15 of fp16 here: stories has 32 channels, so
    // 4 bytes of metadata per 32-token chunk and channel are 1/16 alone);
    // agreement a fraction.
    const bool ok =
        std::isfinite(vn) && vn >= 0 && ratio <= r.b + 0.15 && ratio > 0 &&
        (!scored || (agree >= 0 && agree <= 1 && std::isfinite(dppl) && std::isfinite(dppl_seq)));
    if (!ok) ++bad;
    std::printf("%s%s\n",
                table
                    .row({ds.name, kp::strprintf("%.2f", r.b), r.name, frac(0), frac(1), frac(2),
                          frac(3), kp::strprintf("%.0f", a.bytes), kp::strprintf("%.4f", ratio),
                          kp::strprintf("%.3e", vn), scored ? kp::strprintf("%.4f", agree) : "-",
                          scored ? kp::strprintf("%.4f", ppl) : "-",
                          scored ? kp::strprintf("%+.2f", dppl) : "-",
                          scored ? kp::strprintf("%.4f", ppl_seq) : "-",
                          scored ? kp::strprintf("%+.2f", dppl_seq) : "-"})
                    .c_str(),
                ok ? "" : "  <- out of bounds");
    json jr = {{"dataset", ds.name},
               {"budget", r.b},
               {"policy", r.name},
               {"bytes", a.bytes},
               {"ratio", ratio},
               {"vnmse", vn},
               {"tier_fractions",
                {a.tiers[0] / tot, a.tiers[1] / tot, a.tiers[2] / tot, a.tiers[3] / tot}}};
    if (scored) {
      jr["agree"] = agree;
      jr["ppl"] = ppl;
      jr["dppl_percent"] = dppl;
      jr["positions"] = a.positions;
      jr["ppl_seq"] = ppl_seq;
      jr["dppl_seq_percent"] = dppl_seq;
      jr["seq_positions"] = a.seq_positions;
    }
    jrows.push_back(jr);
  }

  // Table 2: NIAH on SmolLM2.
  json jniah = json::array();
  if (use_smollm2) {
    const std::vector<Row> nrows = make_niah_rows(niah_budgets, niah_probe.allow_int4);
    std::vector<NiahAcc> nacc(nrows.size());
    std::vector<std::vector<char>> hit(nrows.size(), std::vector<char>(niah.size(), 0));
    std::vector<std::vector<std::array<double, 4>>> tf(
        nrows.size(), std::vector<std::array<double, 4>>(niah.size()));
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (size_t r = 0; r < nrows.size(); ++r) {
      for (size_t c = 0; c < niah.size(); ++c) {
        std::string e, answer;
        bool found = false;
        if (nrows[r].kind == Row::kFull) {
          if (!ks::niah_answer(*sm.model, *sm.tok, niah[c], niah[c].kv.view(), npo.niah, &answer,
                               &found, &e))
            die(e);
        } else {
          ks::TransferredKV tk;
          std::vector<uint8_t> tiers;
          transfer(nrows[r], niah[c].kv, niah_imp[c].data(), pp, 0, &tk, &tiers);
          for (uint8_t t : tiers) tf[r][c][t] += 1.0 / tiers.size();
          if (!ks::niah_answer(*sm.model, *sm.tok, niah[c], tk.view(), npo.niah, &answer, &found,
                               &e))
            die(e);
        }
        hit[r][c] = found ? 1 : 0;
      }
    }
    std::printf(
        "#\n# smollm2 needle in a haystack: %zu depths i/%zu of %s (%d to %d tokens per "
        "prompt), passkey per depth, greedy answer of up to %d tokens\n",
        niah.size(), niah.size() > 1 ? niah.size() - 1 : 1,
        text_path.substr(text_path.rfind('/') + 1).c_str(),
        niah.empty() ? 0 : static_cast<int>(niah.front().prompt.size()),
        niah.empty() ? 0 : static_cast<int>(niah.back().prompt.size()), npo.niah.answer_tokens);
    std::printf("# depth map: one character per depth, shallow to deep: + found, . missed\n");
    kp::Table nt(row_columns({{"found", 5}, {"acc%", 6}, {"depth map", 11}}));
    std::printf("%s\n", nt.header().c_str());
    for (size_t r = 0; r < nrows.size(); ++r) {
      const Row& row = nrows[r];
      int found = 0;
      std::string map;
      double t4[4] = {0, 0, 0, 0};
      for (size_t c = 0; c < niah.size(); ++c) {
        found += hit[r][c];
        map += hit[r][c] ? '+' : '.';
        for (int t = 0; t < 4; ++t) t4[t] += tf[r][c][t] / niah.size();
      }
      const double acc = 100.0 * found / niah.size();
      niah_of[key("smollm2", row.name, row.b)] = acc;
      const bool has_tiers = row.kind != Row::kUniform && row.kind != Row::kFull;
      auto frac = [&](int t) {
        return has_tiers ? kp::strprintf("%.3f", t4[t]) : std::string("-");
      };
      std::printf("%s\n",
                  nt.row({"smollm2", kp::strprintf("%.2f", row.b), row.name, frac(0), frac(1),
                          frac(2), frac(3), kp::strprintf("%d/%zu", found, niah.size()),
                          kp::strprintf("%.1f", acc), map})
                      .c_str());
      jniah.push_back({{"budget", row.b},
                       {"policy", row.name},
                       {"found", found},
                       {"cases", niah.size()},
                       {"accuracy_percent", acc},
                       {"depth_map", map}});
    }
  }

  // The SpectrumKV figures (docs/SPECTRUMKV.md): measurements, not checks.
  if (use_smollm2) {
    std::printf("#\n# figures (smollm2):\n");
    auto get = [](const std::map<std::string, double>& m, const std::string& k) {
      const auto it = m.find(k);
      return it == m.end() ? NAN : it->second;
    };
    // Both perplexity protocols (docs/SPECTRUMKV.md): the prompt re-scored
    // over its transferred KV (seq, the paper's Tables 2 and 3) and the
    // continuation after it (cont).
    for (const auto& proto :
         {std::make_pair("seq", &dppl_seq_of), std::make_pair("cont", &dppl_of)}) {
      const std::map<std::string, double>& m = *proto.second;
      const double g5 = get(m, key("smollm2", "Greedy", 0.5));
      const double i8 = get(m, key("smollm2", "INT8", 0.5));
      if (std::isfinite(g5) && std::isfinite(i8))
        std::printf(
            "#   %-4s Greedy b=0.5 dPPL %+.2f%% vs INT8 %+.2f%%: |diff| %.2f %s 0.5 -> %s\n",
            proto.first, g5, i8, std::fabs(g5 - i8), std::fabs(g5 - i8) <= 0.5 ? "<=" : ">",
            std::fabs(g5 - i8) <= 0.5 ? "reached" : "NOT reached");
      for (const char* pol : {"Greedy", "Adaptive"}) {
        const double g3 = get(m, key("smollm2", pol, 0.3));
        const double p3 = get(m, key("smollm2", "PDTrim", 0.3));
        if (std::isfinite(g3) && std::isfinite(p3))
          std::printf(
              "#   %-4s %s b=0.3 dPPL %+.2f%% vs PDTrim %+.2f%%: %s (figure: PDTrim's >= 3x, "
              "if the probe enables INT4; probe: INT4 %s) -> %s\n",
              proto.first, pol, g3, p3,
              g3 > 0 ? kp::strprintf("PDTrim's is %.1fx", p3 / g3).c_str()
                     : "no loss against full precision",
              niah_probe.allow_int4 ? "ALLOWED" : "BLOCKED",
              p3 >= 3 * g3 ? "reached" : "NOT reached");
      }
    }
    for (const char* pol : {"Greedy", "Adaptive"}) {
      const double n3 = get(niah_of, key("smollm2", pol, 0.3));
      const double np3 = get(niah_of, key("smollm2", "PDTrim", 0.3));
      if (std::isfinite(n3) && std::isfinite(np3))
        std::printf("#   %s b=0.3 NIAH %.1f%% vs PDTrim %.1f%% -> %s\n", pol, n3, np3,
                    n3 >= np3 ? "reached" : "NOT reached");
    }
  }

  const double t_total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("# Out of bounds values : %d %s\n", bad, bad == 0 ? "OK" : "FAILED");
  std::printf("# time: data sets and probes %.1f s, total %.1f s wall\n", t_data, t_total);
  if (!json_path.empty()) {
    json j = {{"tool", "spectrum_quality"},
              {"quick", quick},
              {"machine", kp::to_json(kp::machine_info())},
              {"settings", kp::to_json(kp::kvxfer_settings())},
              {"sinks", pp.sinks},
              {"lambda", pp.lambda},
              {"pdtrim_first", pp.pdtrim_first},
              {"rows", jrows},
              {"runtime_s", t_total},
              {"out_of_bounds", bad}};
    if (use_stories) {
      json jp = {{"allow_int4", probe.allow_int4}, {"passed", probe.passed}, {"run", probe.run}};
      json jt = json::array();
      for (const ks::ProbeTrial& t : probe.trials)
        jt.push_back({{"agree", t.agree},
                      {"agree_fallback", t.agree_fallback},
                      {"steps", t.steps},
                      {"ppl_ratio", t.ppl_ratio},
                      {"passed", t.passed}});
      jp["trials"] = jt;
      j["probe"] = jp;
      j["prompts"] = prompts;
      j["prompt_tokens"] = prompt_tokens;
      j["steps"] = steps;
    }
    if (use_synth) j["synth_tokens"] = synth_tokens;
    if (use_smollm2) {
      json jp = {{"allow_int4", niah_probe.allow_int4},
                 {"passed", niah_probe.passed},
                 {"run", niah_probe.run}};
      json jt = json::array();
      for (const ks::NiahProbeTrial& t : niah_probe.trials)
        jt.push_back({{"depth", t.depth},
                      {"passkey", t.passkey},
                      {"prompt_tokens", t.prompt_tokens},
                      {"answer", t.answer},
                      {"found", t.found},
                      {"answer_full", t.answer_full},
                      {"found_full", t.found_full}});
      jp["trials"] = jt;
      j["smollm2"] = {{"probe", jp},
                      {"text", text_path},
                      {"text_tokens", text_tokens.size()},
                      {"prompt_kv_tokens", text_prompt},
                      {"steps", text_steps},
                      {"ppl_full", std::exp(text_cont.nll_full / text_steps)},
                      {"ppl_seq_full", std::exp(text_seq.nll_prefix_full / text_prompt)},
                      {"niah", jniah}};
    } else if (!smollm2_skip.empty()) {
      j["smollm2"] = {{"skipped", smollm2_skip}};
    }
    if (!kp::write_json_file(json_path, j, &err)) die(err);
  }
  return check && bad > 0 ? 1 : 0;
}

int main(int argc, char** argv) {
  return kp::guarded_main("spectrum_quality", [&] { return run(argc, argv); });
}
