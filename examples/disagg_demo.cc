// disagg_demo: disaggregated decoding of SmolLM2-135M-Instruct (or the
// llama2.c model stories260K) over an emulated link, with Lynx progressive
// transfer and speculative decoding on the anchors (docs/SPEC.md, "The demo").
//
// Two processes on one host.  The prefill process (a forked child, rank 1)
// makes a prompt, runs the model's prefill over it and sends the KV with
// kvxfer_send.  The decode process (this one, rank 0) receives it with
// kvxfer_recv into float32 blocks that the model reads directly, and produces
// the output tokens.  Every mode crosses the same rate-limited link
// (kvxfer_comm_config_t.rate_limit):
//   BF16, INT8, INT4   monolithic: decode starts at COMPLETE;
//   Lynx               progressive: at ANCHOR_READY the decoder drafts greedily
//                      on the anchor-precision KV (a snapshot taken in the
//                      on_anchor_ready callback), for the adaptive window
//                      kvxfer_spec_window; then it verifies the draft in batched
//                      passes on the full KV (kvxfer_spec_verify_greedy), the
//                      first reading each layer as its residual completes,
//                      each as long as kvxfer_spec_verify_length finds best for
//                      the runner's cost at that context (timed at start-up),
//                      keeps the accepted prefix, corrects, and goes on decoding.
// The decode process pins its model threads one per CPU (--no_pin: not).
// After each run (untimed) the decoder decodes again, plainly, on the KV it
// received: the outputs must be identical (greedy verification is lossless).
//
// The prefill KV covers the prompt minus its last token; the decode node runs
// the last prompt token, so its first output is the first generated token.
// Times are CLOCK_MONOTONIC (one host) from the sender's kvxfer_send post:
//   TTFT   first output token emitted (Lynx: the first draft token, made on the
//          anchors); TTFTc the first committed (verified) token;
//   TT32T, TT64T  32 / 64 *final* (verified) tokens.
// With SmolLM2 (a GGUF) the prompts are real text: the chat prompts of
// --prompts and the long text of --long_text, each a user turn of the model's
// chat template, tokenized by its own tokenizer; stories260K's prompts are
// sampled from the model.  The KV of these small models is 10-1000x smaller
// than a large model's, so the link is slow (4 mbit for SmolLM2, 20-200 mbit
// for stories260K) for the transfer to dominate, as it does for large models
// on real links, and the rate limiter's burst (the chunk size) is lowered to
// 16 KiB (KVXFER_NET_CHUNK_BYTES, unless set).
//
// The parts a serving runtime would copy are disagg_prefill.cc (the prefill
// node: prefill, kvxfer_send) and disagg_decoder.{h,cc} (the decode node:
// kvxfer_recv, drafting on the anchors, verification); this file and
// disagg_report.{h,cc} are the measurement around them.
//
//   ./build/examples/disagg_demo                      default: table (+ sweeps for stories260K)
//   ./build/examples/disagg_demo -r 20mbit -p 400 --reps 5 --json out.json
//   python3 examples/plot_demo.py out.json -o demo.png
#include <kvxfer/kvxfer.h>
#include <kvxfer/spec.h>
#include <omp.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/units.h"
#include "examples/disagg.h"
#include "examples/disagg_decoder.h"
#include "examples/disagg_report.h"
#include "models/cpu_affinity.h"
#include "models/gguf.h"
#include "models/llama2.h"
#include "models/model_paths.h"
#include "perf/common/chat_text.h"
#include "perf/common/pipe_msg.h"

using json = nlohmann::json;

// ---------------------------------------------------------------------------
// Small utilities (disagg.h)
// ---------------------------------------------------------------------------
namespace disagg {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "%s: ", kTool);
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  std::fflush(nullptr);
  std::_Exit(2);
}

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string rate_text(double bytes_per_s) {
  char b[64];
  std::snprintf(b, sizeof b, "%gmbit", bytes_per_s * 8 / 1e6);
  return b;
}

void send_msg(int fd, uint32_t kind, const void* body, size_t len) {
  if (!kvxfer::perf::send_msg(fd, kind, body, len))
    die("pipe write failed: %s", std::strerror(errno));
}

std::vector<uint8_t> recv_msg(int fd, uint32_t want, int timeout_ms) {
  uint32_t kind = 0;
  std::vector<uint8_t> body;
  std::string err;
  if (!kvxfer::perf::recv_msg(fd, &kind, &body, timeout_ms, "the other process", &err))
    die("the other process went silent (pipe): %s", err.c_str());
  if (kind != want) die("unexpected pipe message %u (wanted %u)", kind, want);
  return body;
}

void codec_of(Mode m, kvxfer_codec_config_t* codec, kvxfer_mode_t* xmode) {
  *codec = KVXFER_CODEC_CONFIG_INITIALIZER;
  switch (m) {
    case kBF16:
      codec->codec = KVXFER_CODEC_BF16;
      *xmode = KVXFER_MODE_MONOLITHIC;
      break;
    case kINT8:
      codec->codec = KVXFER_CODEC_INT8;
      *xmode = KVXFER_MODE_MONOLITHIC;
      break;
    case kINT4:
      codec->codec = KVXFER_CODEC_INT4;
      *xmode = KVXFER_MODE_MONOLITHIC;
      break;
    default:
      codec->codec = KVXFER_CODEC_LYNX;
      *xmode = KVXFER_MODE_PROGRESSIVE;
      break;
  }
}

bool pin_threads(int n) {
  std::string why;
  if (km::pin_openmp_threads(n, &why)) return true;
  std::fprintf(stderr, "disagg_demo: model threads left unpinned: %s\n", why.c_str());
  return false;
}

}  // namespace disagg

namespace {

using namespace disagg;  // NOLINT(google-build-using-namespace)

/** A link rate in tc syntax ("50mbit", "1.5gbit", "10mbps" = bytes/s), parsed by the one parser
 *  of KVXFER_RATE_LIMIT (common/units.h).  Empty (no limit) is refused: the demo needs a link. */
bool parse_link_rate(const std::string& text, double* bytes_per_s, std::string* why) {
  if (!kvxfer::params::parse_rate(text, bytes_per_s, why)) return false;
  if (*bytes_per_s > 0) return true;
  *why = "is empty";
  return false;
}

/** The prompts of text mode: sets[0] chat prompts, sets[1] the long text (or none). */
struct TextPrompts {
  std::vector<std::vector<int>> sets[2];
  std::vector<std::string> users[2];  // the user turn of each prompt
  kvxfer::perf::ChatText ct;          // the tokenizer and chat template (perf/common/chat_text.h)
  std::string len_range(int set) const {
    size_t lo = SIZE_MAX, hi = 0;
    for (const auto& t : sets[set]) {
      lo = std::min(lo, t.size());
      hi = std::max(hi, t.size());
    }
    return lo == hi ? std::to_string(lo) : std::to_string(lo) + "-" + std::to_string(hi);
  }
  /** Decoded text of `ids` up to the first end-of-sequence token. */
  std::string text(const std::vector<int>& ids) const {
    std::vector<int32_t> cut;
    for (int t : ids) {
      if (t == ct.tok->eos_id() || ct.tok->token_text(t) == "<|im_end|>") break;
      cut.push_back(t);
    }
    std::string out, err;
    if (!ct.tok->decode(cut, &out, &err)) die("decode: %s", err.c_str());
    return out;
  }
};

std::string read_text_file(const std::string& path) {
  std::string text, err;
  if (!kvxfer::perf::read_text_file(path, &text, &err)) die("%s", err.c_str());
  return text;
}

/** The chat prompts (one per line; at most --reps of them when given) and the
 *  long text, each as a user turn of the model's chat template, tokenized. */
TextPrompts load_text_prompts(const Options& o, const km::gguf::File& file, bool reps_given) {
  TextPrompts tp;
  std::string err;
  if (!tp.ct.load(file, &err)) die("%s", err.c_str());
  auto add = [&](int set, const std::string& user) {
    std::vector<int> ids;
    if (!tp.ct.encode_user(user, &ids, &err)) die("%s", err.c_str());
    tp.sets[set].push_back(std::move(ids));
    tp.users[set].push_back(user);
  };
  std::istringstream lines(read_text_file(o.prompts_path));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    if (reps_given && static_cast<int>(tp.sets[0].size()) >= o.reps) break;
    add(0, line);
  }
  if (tp.sets[0].empty()) die("no prompts in %s", o.prompts_path.c_str());
  if (!o.long_text_path.empty() && !o.quick)
    add(1,
        "Summarize the following text in a few sentences.\n\n" + read_text_file(o.long_text_path));
  return tp;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "disagg_demo: prefill and decode processes over an emulated link; Lynx progressive "
      "transfer with speculative decoding on the anchors against BF16/INT8/INT4 monolithic "
      "(docs/SPEC.md)"};
  app.option_defaults()->always_capture_default();  // --help shows each default
  app.add_option("--model", o.model_path,
                 "GGUF (llama) or llama2.c checkpoint, or 'smollm2' (the fetched "
                 "SmolLM2-135M-Instruct; exit 77 when absent); default SmolLM2 when "
                 "scripts/install-deps.sh has fetched it, else data/stories260K.bin");
  app.add_option(
      "--prompts", o.prompts_path,
      "chat prompts, one per line (GGUF models: each is a user turn of the chat template)");
  app.add_option("--long_text", o.long_text_path,
                 "a long real text, summarised as one more prompt (at --long_rate); '' = none");
  app.add_option("--long_rate", o.long_rate, "link rate of the long prompt");
  app.add_option("--long_reps", o.long_reps,
                 "runs per mode of the long prompt (medians and pairs over them)")
      ->check(CLI::Range(1, 100));
  app.add_option("--show_text", o.show_text, "print the decoded text of this many prompts");
  app.add_option("--verify_rule", o.verify_rule,
                 "adaptive: passes of the length with the most expected final tokens per second, "
                 "from the acceptance so far and the pass cost timed at start-up "
                 "(kvxfer_spec_verify_length); all: the whole draft in one pass")
      ->check(CLI::IsMember({"adaptive", "all"}));
  app.add_option("-r,--rate", o.rate,
                 "link rate of the main table, tc syntax (20mbit, 1gbit, "
                 "10mbps = bytes/s); the unit is required, as in KVXFER_RATE_LIMIT");
  const int cpus = omp_get_num_procs();
  app.add_option("-p,--prompt_len", o.prompt_len, "prompt tokens (BOS + sampled tokens)")
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--prompt", o.prompt_ids, "comma-separated prompt token ids instead");
  app.add_option("--tokens", o.tokens, "output tokens per run (>= 1; TT64T needs 64)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--reps", o.reps, "runs per mode and point (different prompts)")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--sweep_rates", o.sweep_rates, "rates of the sweep (at the main prompt length)");
  app.add_option("--sweep_lens", o.sweep_lens, "prompt lengths of the sweep (at the main rate)");
  app.add_flag("--no_sweep", o.no_sweep, "only the main table");
  app.add_flag("--quick", o.quick, "small and fast (the ctest): 1 run, 32 tokens, no sweep");
  app.add_option("-J,--json", o.json_path, "write every run and summary to this JSON file");
  app.add_option("--seed", o.seed, "prompt sampling seed");
  app.add_option("--temperature", o.temperature, "prompt sampling temperature (0 = greedy)")
      ->check([](const std::string& v) {
        float t = 0;
        return CLI::detail::lexical_cast(v, t) && std::isfinite(t) && t >= 0
                   ? std::string()
                   : "must be a finite number >= 0";
      });
  app.add_option("--page_tokens", o.page_tokens, "tokens per transfer page")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--threads", o.threads, "OpenMP threads of the model in each process")
      ->check(CLI::Range(1, cpus));
  app.add_option("--draft_threads", o.draft_threads,
                 "OpenMP threads while drafting on the anchor KV, with the residual in flight "
                 "(0: one fewer than --threads, at least 1)")
      ->check(CLI::Range(0, cpus));
  app.add_option("--margin", o.margin, "speculative window margin (tokens)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--verify_max", o.verify_max,
                 "a verification pass checks at most this many draft tokens (passes go on "
                 "while every token is accepted); 0 = no cap")
      ->check(CLI::Range(0, 1 << 20));
  app.add_flag("--no_pin", o.no_pin,
               "leave the decode process's model threads unpinned (by default each of "
               "--threads >= 2 is pinned to its own CPU)");
  app.add_option("--first_verify", o.first_verify,
                 "the first verification pass checks at most this many draft tokens, so that "
                 "the first committed token comes soon after COMPLETE; 0 = no cap")
      ->check(CLI::Range(0, 1 << 20));
  CLI11_PARSE(app, argc, argv);
  if (o.model_path == "smollm2") {
    o.model_path = km::smollm2_gguf_path();
    if (!std::ifstream(o.model_path).good()) {
      std::printf("# %s: SmolLM2 not fetched (%s; scripts/install-deps.sh fetches it): skipped\n",
                  kTool, o.model_path.c_str());
      return 77;
    }
  }
  if (o.model_path.empty()) {
    o.model_path = km::smollm2_gguf_path();
    if (!std::ifstream(o.model_path).good()) {
      std::printf(
          "# %s: SmolLM2 not fetched (%s; scripts/install-deps.sh fetches it): using "
          "stories260K\n",
          kTool, o.model_path.c_str());
      o.model_path = KVXFER_DATA_DIR "/stories260K.bin";
    }
  }
  // SmolLM2's KV is 23 KB per token: the default link is slower than for
  // stories260K, so that the residual takes more than 32 decode steps
  // (docs/SPEC.md, "Results on SmolLM2-135M-Instruct"); the rate sweep only on
  // request.
  const bool gguf_model = km::gguf::has_magic(o.model_path);
  if (gguf_model) {
    if (app.count("--rate") == 0) o.rate = o.quick ? "8mbit" : "4mbit";
    if (app.count("--sweep_rates") == 0) o.sweep_rates.clear();
  }
  if (o.quick) {
    if (app.count("--reps") == 0) o.reps = 1;
    if (app.count("--tokens") == 0) o.tokens = 32;
    o.no_sweep = true;
    if (app.count("--prompt_len") == 0) o.prompt_len = 160;
    if (app.count("--rate") == 0 && !gguf_model) o.rate = "20mbit";
  }
  double main_rate = 0;
  std::string why;
  if (!parse_link_rate(o.rate, &main_rate, &why))
    die("bad rate '%s': %s", o.rate.c_str(), why.c_str());
  double long_rate = 0;  // checked whether or not a long prompt runs
  if (!parse_link_rate(o.long_rate, &long_rate, &why))
    die("bad --long_rate '%s': %s", o.long_rate.c_str(), why.c_str());
  if (!o.long_text_path.empty() && !std::ifstream(o.long_text_path).good())
    die("--long_text '%s' cannot be read", o.long_text_path.c_str());
  std::vector<int> given;
  if (!o.prompt_ids.empty()) {
    size_t at = 0;
    while (at < o.prompt_ids.size()) {
      size_t comma = o.prompt_ids.find(',', at);
      if (comma == std::string::npos) comma = o.prompt_ids.size();
      const std::string id = o.prompt_ids.substr(at, comma - at);
      char* end = nullptr;
      errno = 0;
      const long v = id.empty() ? -1 : std::strtol(id.c_str(), &end, 10);
      if (id.empty() || *end != '\0' || errno != 0 || v < 0 || v > INT32_MAX ||
          std::isspace(static_cast<unsigned char>(id[0])))
        die("--prompt: '%s' is not a token id (comma-separated integers >= 0)", id.c_str());
      given.push_back(static_cast<int>(v));
      at = comma + 1;
    }
    o.prompt_len = static_cast<int>(given.size());
    o.sweep_lens.clear();
  }

  // The emulated link is slow and the KV small: a token bucket as deep as the
  // default chunk (256 KiB) would let most of a transfer through unlimited.
  // 16 KiB: shallower buckets lose rate to the progress thread's wake-up
  // jitter on a busy 2-core machine (docs/SPEC.md, "The emulated link").
  setenv("KVXFER_NET_CHUNK_BYTES", "16384", 0);
  setenv("KVXFER_CODEC_THREADS", "1", 0);  // tiny pages; two processes share the cores
  uint64_t burst_bytes = 0;                // as the library reads it (tc sizes: 64k, 1MiB)
  if (!kvxfer::params::parse_size(std::getenv("KVXFER_NET_CHUNK_BYTES"), &burst_bytes, &why))
    die("KVXFER_NET_CHUNK_BYTES='%s' %s", std::getenv("KVXFER_NET_CHUNK_BYTES"), why.c_str());
  const double burst = static_cast<double>(burst_bytes);

  // Fork before anything runs OpenMP (the codec, the model) in this process.
  int down[2], up[2];
  if (pipe(down) != 0 || pipe(up) != 0) die("pipe: %s", std::strerror(errno));
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child < 0) die("fork: %s", std::strerror(errno));
  if (child == 0) {
    close(down[1]);
    close(up[0]);
    omp_set_num_threads(o.threads);
    std::_Exit(prefill_main(o, down[0], up[1]));
  }
  close(down[0]);
  close(up[1]);
  const int to_child = down[1], from_child = up[0];
  omp_set_num_threads(o.threads);
  // The decode process's model threads, one per CPU (docs/SPEC.md, "The
  // first pass after COMPLETE"); the prefill process's are not timed.
  o.pinned = o.threads >= 2 && !o.no_pin && pin_threads(o.threads);

  std::string err;
  std::unique_ptr<km::Model> model = km::Model::load(o.model_path, &err);
  if (!model) die("%s", err.c_str());
  const km::Config& cfg = model->config();
  // A GGUF model brings its tokenizer: real prompts (text mode).  A point's
  // prompt_len is then the prompt set: 0 = the chat prompts, 1 = the long text.
  TextPrompts text;
  const bool text_mode = model->gguf_file() != nullptr && given.empty();
  if (text_mode)
    text = load_text_prompts(o, *model->gguf_file(), app.count("--reps") > 0 || o.quick);
  // Points: the main one, the rate sweep at the main length, the length sweep at the main rate.
  std::set<Point> points = {{main_rate, text_mode ? 0 : o.prompt_len}};
  if (!o.no_sweep) {
    for (const std::string& r : o.sweep_rates) {
      double b = 0;
      if (!parse_link_rate(r, &b, &why)) die("bad sweep rate '%s': %s", r.c_str(), why.c_str());
      points.insert({b, text_mode ? 0 : o.prompt_len});
    }
    if (!text_mode)
      for (int L : o.sweep_lens) points.insert({main_rate, L});
  }
  if (text_mode && !text.sets[1].empty()) points.insert({long_rate, 1});
  int max_len = 0;
  if (text_mode) {
    for (const auto& set : text.sets)
      for (const auto& t : set) max_len = std::max(max_len, static_cast<int>(t.size()));
    if (max_len + o.tokens > cfg.seq_len)
      die("a prompt of %d tokens + %d tokens exceeds seq_len %d", max_len, o.tokens, cfg.seq_len);
  } else {
    for (const Point& p : points) {
      if (p.prompt_len < 2 || p.prompt_len + o.tokens > cfg.seq_len)
        die("prompt length %d + %d tokens must fit in seq_len %d (and be >= 2)", p.prompt_len,
            o.tokens, cfg.seq_len);
      max_len = std::max(max_len, p.prompt_len);
    }
  }

  std::printf(
      "# %s: %s (dim %d, %d layers, %d KV heads x %d, vocab %d), KV float32 in both "
      "processes\n",
      kTool, o.model_path.c_str(), cfg.dim, cfg.n_layers, cfg.n_kv_heads, cfg.head_size(),
      cfg.vocab_size);
  std::printf(
      "# page %d tokens, KVXFER_NET_CHUNK_BYTES %s (rate-limiter burst), model threads "
      "%d (%d while drafting%s), KVXFER_SPEC_MAX %s, KVXFER_SPEC_MIN_ACCEPT %s\n",
      o.page_tokens, std::getenv("KVXFER_NET_CHUNK_BYTES"), o.threads, o.drafting_threads(),
      o.pinned ? "; decode process's pinned one per CPU" : "",
      std::getenv("KVXFER_SPEC_MAX") ? std::getenv("KVXFER_SPEC_MAX") : "64 (default)",
      std::getenv("KVXFER_SPEC_MIN_ACCEPT") ? std::getenv("KVXFER_SPEC_MIN_ACCEPT")
                                            : "0.5 (default)");
  std::fflush(stdout);

  const int64_t t_begin = now_ns();
  Decoder dec(o, *model, to_child, from_child, std::min(cfg.seq_len, max_len + o.tokens + 1));
  // prompts[set][rep] and the prefill process's id of each.
  std::vector<std::vector<int>> prompts_of[2], pid_of(2);
  int n_prompts = 0;
  if (text_mode) {
    // The long prompt is one text: it runs --long_reps times per mode, each
    // run a rep of its set (the chat set's reps are its prompts).
    for (int set = 0; set < 2; ++set)
      for (const auto& t : text.sets[set]) {
        const int pid = n_prompts++;
        const std::vector<int> tokens = dec.prompt(pid, static_cast<int>(t.size()), 0, t);
        for (int k = 0; k < (set == 1 ? o.long_reps : 1); ++k) {
          pid_of[set].push_back(pid);
          prompts_of[set].push_back(tokens);
        }
      }
    std::printf("# %zu chat prompt(s) of %s tokens%s, prefilled in %.2f s\n", text.sets[0].size(),
                text.len_range(0).c_str(),
                text.sets[1].empty() ? ""
                                     : (", and a long one of " + text.len_range(1) + " tokens (" +
                                        std::to_string(o.long_reps) + " runs per mode)")
                                           .c_str(),
                ms(now_ns() - t_begin) * 1e-3);
  } else {
    for (int rep = 0; rep < o.reps; ++rep) {
      pid_of[0].push_back(n_prompts);
      prompts_of[0].push_back(
          dec.prompt(n_prompts++, max_len, o.seed + static_cast<uint64_t>(rep), given));
    }
    std::printf("# %d prompt(s) of %d tokens made and prefilled in %.2f s\n", o.reps, max_len,
                ms(now_ns() - t_begin) * 1e-3);
  }
  std::fflush(stdout);
  auto set_of = [&](const Point& p) { return text_mode ? p.prompt_len : 0; };
  auto len_of = [&](const Point& p, int rep) {
    return text_mode ? static_cast<int>(prompts_of[p.prompt_len][static_cast<size_t>(rep)].size())
                     : p.prompt_len;
  };
  std::vector<Run> runs;
  std::vector<double> handshake_s;
  // The runner's decode step and verification pass at every context the runs
  // use, timed before any run (Decoder::calibrate_at).
  {
    const int64_t t_cal = now_ns();
    std::set<int> contexts;
    for (const Point& p : points)
      for (size_t rep = 0; rep < prompts_of[set_of(p)].size(); ++rep)
        contexts.insert(len_of(p, static_cast<int>(rep)) - 1);
    for (int n_kv : contexts) dec.calibrate_at(n_kv);
    std::printf("# the runner timed at %zu context(s) of %d-%d KV tokens in %.2f s\n",
                contexts.size(), *contexts.begin(), *contexts.rbegin(),
                ms(now_ns() - t_cal) * 1e-3);
  }
  // The decode steps of each rate's timed runs.
  std::map<double, std::vector<double>> steps_at;
  std::set<double> rates;
  for (const Point& p : points) rates.insert(p.rate_bps);
  for (double rate : rates) {
    dec.open_comm(rate);
    // Warm-up (not recorded): a Lynx transfer of the main length (text mode:
    // the first prompt of the rate's first set); sets the residual/anchor
    // ratio.
    Point first{};
    for (const Point& p : points)
      if (p.rate_bps == rate) {
        first = p;
        break;
      }
    const int L0 = text_mode ? len_of(first, 0) : std::min(o.prompt_len, max_len);
    dec.run(kLynx, pid_of[set_of(first)][0], prompts_of[set_of(first)][0], L0, 0, rate);
    dec.clear_samples();
    for (const Point& p : points) {
      if (p.rate_bps != rate) continue;
      const int set = set_of(p);
      for (size_t rep = 0; rep < prompts_of[set].size(); ++rep)
        for (int m = 0; m < kModes; ++m) {
          const int r = static_cast<int>(rep);
          runs.push_back(dec.run(static_cast<Mode>(m), pid_of[set][rep], prompts_of[set][rep],
                                 len_of(p, r), r, rate));
          runs.back().prompt_len = p.prompt_len;
          handshake_s.push_back(ms(runs.back().t_handshake - runs.back().t0) * 1e-3);
        }
    }
    steps_at[rate] = dec.step_samples();
    dec.close_comm();
  }
  send_msg(to_child, kMsgQuit, nullptr, 0);
  int status = 0;
  waitpid(child, &status, 0);
  const double wall_s = ms(now_ns() - t_begin) * 1e-3;

  // Summaries per point and mode, with the model's predictions.  The model's
  // TPOT at a point: what its rate's timed runs met (the machine may be
  // busier than during the start-up timing); its verification cost: the
  // start-up passes at its prompts' contexts (median over the prompts).
  auto cal_at = [&](const Point& p) {
    Calibration c;
    const std::vector<double>& steps = steps_at[p.rate_bps];
    std::vector<double> base, per, tpot;
    for (size_t rep = 0; rep < prompts_of[set_of(p)].size(); ++rep) {
      const PassCost& pc = dec.cost_at(len_of(p, static_cast<int>(rep)) - 1);
      base.push_back(pc.base_s);
      per.push_back(pc.per_token_s);
      tpot.push_back(pc.tpot_s);
    }
    c.verify_base_s = median(base);
    c.verify_per_token_s = median(per);
    c.tpot_s = steps.empty() ? median(tpot) : median(steps);
    return c;
  };
  const Calibration cal = cal_at(Point{main_rate, text_mode ? 0 : o.prompt_len});
  const double t_fixed = median(handshake_s);
  // The acceptance rate the model uses: every Lynx run of the whole session.
  long acc = 0, rej = 0;
  for (const Run& r : runs)
    if (r.mode == kLynx && r.verified > 0) {
      acc += r.accepted;
      rej += r.rejected ? 1 : 0;
    }
  const double alpha = acc + rej > 0 ? static_cast<double>(acc) / (acc + rej) : 0.0;
  std::map<Point, std::vector<Summary>> table;
  for (const Point& p : points) {
    std::map<std::pair<int, int>, const Run*> bf16_of;
    std::vector<const Run*> per[kModes];
    for (const Run& r : runs)
      if (r.rate_bps == p.rate_bps && r.prompt_len == p.prompt_len) {
        per[r.mode].push_back(&r);
        if (r.mode == kBF16) bf16_of[{r.prompt_len, r.rep}] = &r;
      }
    std::vector<Summary> s(kModes);
    for (int m = 0; m < kModes; ++m) s[m] = summarize(static_cast<Mode>(m), per[m], bf16_of);
    const int max_window = std::min(o.tokens, cfg.seq_len - p.prompt_len);
    predict(p, cal_at(p), t_fixed, burst, alpha, o.margin, max_window, o.verify_max, s.data());
    table[p] = s;
  }

  const Point main_point{main_rate, text_mode ? 0 : o.prompt_len};
  auto what = [&](const Point& p) {
    if (!text_mode)
      return "prompt " + std::to_string(p.prompt_len) + " tokens (KV of " +
             std::to_string(p.prompt_len - 1) + ")";
    return std::to_string(text.sets[p.prompt_len].size()) +
           (p.prompt_len == 0 ? " chat prompt(s) of " : " long prompt(s) of ") +
           text.len_range(p.prompt_len) + " tokens";
  };
  for (const Point& p : points) {
    const Calibration c = cal_at(p);
    // The timed passes against the start-up a(C) + b(C) k at their context.
    std::vector<double> first, all;
    for (const Run& r : runs)
      if (r.rate_bps == p.rate_bps && r.prompt_len == p.prompt_len)
        for (size_t i = 0; i < r.pass_log.size(); ++i) {
          const double x = r.pass_log[i].ms / r.pass_log[i].pred_ms;
          all.push_back(x);
          if (i == 0) first.push_back(x);
        }
    std::printf(
        "# calibration at %s, %s: TPOT %.3f ms (its timed runs); verify pass %.3f + %.4f "
        "ms/token (passes of 1, 4, 16, 64 tokens timed at start-up at each prompt's context, "
        "median over the prompts); fixed latency (post to handshake) %.3f ms; per-token "
        "acceptance used by the model %.3f\n",
        rate_text(p.rate_bps).c_str(), what(p).c_str(), c.tpot_s * 1e3, c.verify_base_s * 1e3,
        c.verify_per_token_s * 1e3, t_fixed * 1e3, alpha);
    if (!all.empty())
      std::printf(
          "#   its timed verification passes / the start-up cost at their context and size: "
          "first passes median %.2f (max %.2f, %zu), all passes median %.2f (max %.2f, %zu)\n",
          median(first), *std::max_element(first.begin(), first.end()), first.size(), median(all),
          *std::max_element(all.begin(), all.end()), all.size());
  }
  print_main_table(main_point, table[main_point].data(), o.tokens, what(main_point));
  for (const auto& [p, s] : table)
    if (text_mode && p.prompt_len == 1) print_main_table(p, s.data(), o.tokens, what(p));
  const std::vector<Summary>& ms_ = table[main_point];
  std::printf(
      "# Lynx TTFT / INT4 TTFT = %.3f, Lynx TTFT / INT8 TTFT = %.3f, Lynx TT%dT / INT8 "
      "TT%dT = %.3f\n",
      ms_[kLynx].ttft_ms / ms_[kINT4].ttft_ms, ms_[kLynx].ttft_ms / ms_[kINT8].ttft_ms,
      std::min(o.tokens, 64), std::min(o.tokens, 64),
      (o.tokens >= 64 ? ms_[kLynx].tt64_ms / ms_[kINT8].tt64_ms
                      : ms_[kLynx].tt32_ms / ms_[kINT8].tt32_ms));
  for (const auto& [p, s] : table) {
    if (p.rate_bps != main_rate && !(text_mode && p.prompt_len == 1)) continue;
    // TPOT of this point: INT8-mono's steady decoding after COMPLETE,
    // (time of token N - time of token 1) / (N - 1), median over its runs.
    std::vector<double> steps;
    for (const Run& r : runs)
      if (r.mode == kINT8 && r.rate_bps == p.rate_bps && r.prompt_len == p.prompt_len &&
          r.t_commit.size() > 1)
        steps.push_back(ms(r.t_commit.back() - r.t_commit.front()) /
                        static_cast<double>(r.t_commit.size() - 1));
    const double tpot = steps.empty() ? cal.tpot_s * 1e3 : median(steps);
    std::printf(
        "# %s, %s: in TPOT (%.2f ms, INT8-mono's decode): TT32T(Lynx) - TT32T(INT8) = %+.1f, "
        "TTFTc(Lynx) - "
        "TTFT(INT8) = %+.1f; TTFT(Lynx) / TTFT(INT4) = %.3f; per-token agreement %.3f, "
        "mean accepted prefix %.1f\n",
        rate_text(p.rate_bps).c_str(), what(p).c_str(), tpot,
        (s[kLynx].tt32_ms - s[kINT8].tt32_ms) / tpot,
        (s[kLynx].ttft_commit_ms - s[kINT8].ttft_ms) / tpot, s[kLynx].ttft_ms / s[kINT4].ttft_ms,
        s[kLynx].agreement(),
        s[kLynx].draft_runs > 0 ? static_cast<double>(s[kLynx].accepted) / s[kLynx].draft_runs
                                : 0.0);
    // The same differences paired by prompt: the median over the prompts of
    // (Lynx run - INT8 run on the same prompt), so that the prompts' own
    // spread (their lengths, their transfer times) does not enter.  The long
    // prompt's pairs are its runs (rep k of each mode).
    std::map<int, const Run*> int8_of;
    for (const Run& r : runs)
      if (r.mode == kINT8 && r.rate_bps == p.rate_bps && r.prompt_len == p.prompt_len)
        int8_of[r.rep] = &r;
    std::vector<double> d32, dc;
    for (const Run& r : runs) {
      if (r.mode != kLynx || r.rate_bps != p.rate_bps || r.prompt_len != p.prompt_len) continue;
      const auto it = int8_of.find(r.rep);
      if (it == int8_of.end()) continue;
      const Run& b = *it->second;
      const double a = t_tokens_ms(r, 32) - t_tokens_ms(b, 32);
      if (std::isfinite(a)) d32.push_back(a);  // runs of fewer than 32 tokens have none
      dc.push_back(t_tokens_ms(r, 1) - ms(b.t_first_emit - b.t0));
    }
    if (!d32.empty() && !dc.empty())
      std::printf(
          "# %s, %s: paired by prompt (median of Lynx - INT8 on the same prompt, in TPOT): "
          "TT32T %+.1f, TTFTc - TTFT %+.1f (%zu pairs)\n",
          rate_text(p.rate_bps).c_str(), what(p).c_str(), median(d32) / tpot, median(dc) / tpot,
          d32.size());
  }
  if (points.size() > 1) {
    std::printf("#\n# Sweep: measured against kvxfer_spec_ttft_model (Eq. 16-20), medians, ms\n");
    std::printf("#%9s %6s %10s %8s %8s %8s %8s %8s %8s %8s\n", "rate", "prompt", "mode", "TTFT",
                "pred", "err%", "TT64T", "pred", "err%", "acc_rate");
    for (const auto& [p, s] : table)
      for (int m = 0; m < kModes; ++m) {
        const Summary& x = s[m];
        const double t64 = o.tokens >= 64 ? x.tt64_ms : x.tt32_ms;
        const double p64 = o.tokens >= 64 ? x.pred_tt64_ms : x.pred_tt32_ms;
        std::printf(" %9s %6d %10s %8s %8s %8s %8s %8s %8s %8s\n", rate_text(p.rate_bps).c_str(),
                    p.prompt_len, kModeName[m], fmt(x.ttft_ms).c_str(), fmt(x.pred_ttft_ms).c_str(),
                    fmt(100.0 * (x.ttft_ms - x.pred_ttft_ms) / x.pred_ttft_ms, "%+.1f").c_str(),
                    fmt(t64).c_str(), fmt(p64).c_str(),
                    fmt(100.0 * (t64 - p64) / p64, "%+.1f").c_str(),
                    m == kLynx ? fmt(x.accept_rate(), "%.3f").c_str() : "-");
      }
  }

  // Verdicts (exit status): Lynx output identical to full-KV decoding on every
  // run, and the stages in order.
  int not_identical = 0, stage_errors = 0, lynx_runs = 0, drafted_runs = 0;
  for (const Run& r : runs) {
    if (r.tokens != r.reference) ++not_identical;
    if (!r.stages_ok) {
      ++stage_errors;
      std::fprintf(stderr, "%s: %s run (rate %s, prompt %d, rep %d): %s\n", kTool,
                   kModeName[r.mode], rate_text(r.rate_bps).c_str(), r.prompt_len, r.rep,
                   r.stage_problem.c_str());
    }
    if (r.mode == kLynx) {
      ++lynx_runs;
      if (r.drafted > 0) ++drafted_runs;
    }
  }
  std::printf("#\n# Runs: %zu (%d Lynx, %d of them drafted before COMPLETE), %.1f s in all\n",
              runs.size(), lynx_runs, drafted_runs, wall_s);
  std::printf("# Output differs from decoding on the same received KV : %d %s\n", not_identical,
              not_identical == 0 ? "OK" : "FAILED");
  std::printf("# Stages out of order                                  : %d %s\n", stage_errors,
              stage_errors == 0 ? "OK" : "FAILED");
  const kvxfer_spec_monitor_t& mon = dec.monitor();
  std::printf(
      "# Acceptance monitor: %s (per-token acceptance %.3f over %lld examined draft "
      "tokens)\n",
      mon.fallen_back ? "FELL BACK to waiting for the full KV" : "speculating",
      mon.accepted + mon.rejected > 0
          ? static_cast<double>(mon.accepted) / (mon.accepted + mon.rejected)
          : 0.0,
      static_cast<long long>(mon.accepted + mon.rejected));

  if (text_mode && o.show_text > 0) {
    for (int set = 0; set < 2; ++set)
      for (size_t rep = 0;
           rep < text.sets[set].size() && rep < (set == 0 ? static_cast<size_t>(o.show_text) : 1u);
           ++rep)
        for (const Run& r : runs) {
          if (r.mode != kLynx || r.prompt_len != set || r.rep != static_cast<int>(rep)) continue;
          std::string user = text.users[set][rep];
          if (user.size() > 160) user = user.substr(0, 160) + "...";
          for (char& ch : user)
            if (ch == '\n') ch = ' ';
          std::printf(
              "#\n# Prompt (%d tokens): %s\n# Lynx-spec output: %s\n# Full-KV output:   %s\n# %s\n",
              r.tokens_in, user.c_str(), text.text(r.tokens).c_str(),
              text.text(r.reference).c_str(),
              r.tokens == r.reference ? "identical token for token" : "DIFFERENT");
          break;
        }
  }

  if (!o.json_path.empty()) {
    json j;
    j["tool"] = kTool;
    j["model"] = o.model_path;
    // prompt_len: the main point's, as the summary rows name it (with text
    // prompts, the set: 0 chat, 1 long text).
    j["config"] = {{"main_rate_mbit", main_rate * 8 / 1e6},
                   {"prompt_len", text_mode ? 0 : o.prompt_len},
                   {"text_prompts", text_mode},
                   {"tokens", o.tokens},
                   {"reps", o.reps},
                   {"page_tokens", o.page_tokens},
                   {"seed", o.seed},
                   {"temperature", o.temperature},
                   {"threads", o.threads},
                   {"margin", o.margin},
                   {"burst_bytes", burst},
                   {"wall_s", wall_s}};
    j["calibration"] = {{"tpot_ms", cal.tpot_s * 1e3},
                        {"verify_base_ms", cal.verify_base_s * 1e3},
                        {"verify_per_token_ms", cal.verify_per_token_s * 1e3},
                        {"t_fixed_ms", t_fixed * 1e3},
                        {"accept_rate", alpha}};
    j["calibration_by_point"] = json::array();
    for (const Point& p : points) {
      const Calibration c = cal_at(p);
      j["calibration_by_point"].push_back({{"rate", rate_text(p.rate_bps)},
                                           {"prompt_len", p.prompt_len},
                                           {"tpot_ms", c.tpot_s * 1e3},
                                           {"verify_base_ms", c.verify_base_s * 1e3},
                                           {"verify_per_token_ms", c.verify_per_token_s * 1e3}});
    }
    j["summary"] = json::array();
    for (const auto& [p, s] : table)
      for (int m = 0; m < kModes; ++m) j["summary"].push_back(summary_json(p, s[m]));
    j["runs"] = json::array();
    for (const Run& r : runs) {
      json t = json::array();
      for (int64_t c : r.t_commit) t.push_back(ms(c - r.t0));
      json pass_tokens = json::array(), pass_ms = json::array(), pass_pred = json::array();
      for (const Run::Pass& q : r.pass_log) {
        pass_tokens.push_back(q.tokens);
        pass_ms.push_back(q.ms);
        pass_pred.push_back(q.pred_ms);
      }
      j["runs"].push_back(
          {{"mode", kModeKey[r.mode]},
           {"rate_mbit", r.rate_bps * 8 / 1e6},
           {"prompt_len", r.prompt_len},
           {"prompt_tokens", r.tokens_in},
           {"rep", r.rep},
           {"ttft_ms", ms(r.t_first_emit - r.t0)},
           {"handshake_ms", ms(r.t_handshake - r.t0)},
           {"anchor_ready_ms", ms(r.t_anchor - r.t0)},
           {"first_residual_ms", r.t_first_residual ? ms(r.t_first_residual - r.t0) : 0.0},
           {"complete_ms", ms(r.t_complete - r.t0)},
           {"verify_ms", r.speculated ? ms(r.t_verify_end - r.t_verify_start) : 0.0},
           {"pass_tokens", pass_tokens},
           {"pass_ms", pass_ms},
           {"pass_pred_ms", pass_pred},
           {"anchor_bytes", r.anchor_bytes},
           {"residual_bytes", r.residual_bytes},
           {"drafted", r.drafted},
           {"verified", r.verified},
           {"accepted", r.accepted},
           {"matched", r.matched},
           {"passes", r.passes},
           {"window_at_anchor_ready", r.window0},
           {"t_res_predicted_ms", r.t_res_pred0 * 1e3},
           {"identical_full", r.tokens == r.reference},
           {"stages_ok", r.stages_ok},
           {"commit_ms", t},
           {"tokens", r.tokens}});
    }
    j["verdict"] = {{"not_identical", not_identical}, {"stage_errors", stage_errors}};
    std::ofstream f(o.json_path);
    f << j.dump(1) << "\n";
    if (!f) die("cannot write %s", o.json_path.c_str());
    std::printf("# JSON written to %s\n", o.json_path.c_str());
  }
  const bool child_ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (!child_ok) std::fprintf(stderr, "%s: the prefill process failed\n", kTool);
  return not_identical == 0 && stage_errors == 0 && child_ok ? 0 : 1;
}
