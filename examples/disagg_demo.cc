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
//   ./build/examples/disagg_demo                      default: table (+ sweeps for stories260K)
//   ./build/examples/disagg_demo -r 20mbit -p 400 --reps 5 --json out.json
//   python3 examples/plot_demo.py out.json -o demo.png
#include <kvxfer/kvxfer.h>
#include <kvxfer/spec.h>
#include <omp.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/fdio.h"
#include "common/units.h"
#include "models/bpe_tokenizer.h"
#include "models/chat_template.h"
#include "models/cpu_affinity.h"
#include "models/gguf.h"
#include "models/llama2.h"
#include "models/model_paths.h"

namespace km = kvxfer::model;
using json = nlohmann::json;

namespace {

const char* kTool = "disagg_demo";

// ---------------------------------------------------------------------------
// Small utilities
// ---------------------------------------------------------------------------

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

double ms(int64_t ns) { return static_cast<double>(ns) * 1e-6; }

[[noreturn]] void die(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
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

#define CHECK_KVXFER(call)                                                                   \
  do {                                                                                       \
    const kvxfer_result_t r_ = (call);                                                       \
    if (r_ != KVXFER_SUCCESS)                                                                \
      die("%s failed: %s: %s", #call, kvxfer_get_error_string(r_), kvxfer_get_last_error()); \
  } while (0)

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/** A link rate in tc syntax ("50mbit", "1.5gbit", "10mbps" = bytes/s), parsed by the one parser
 *  of KVXFER_RATE_LIMIT (common/units.h).  Empty (no limit) is refused: the demo needs a link. */
bool parse_link_rate(const std::string& text, double* bytes_per_s, std::string* why) {
  if (!kvxfer::params::parse_rate(text, bytes_per_s, why)) return false;
  if (*bytes_per_s > 0) return true;
  *why = "is empty";
  return false;
}

std::string rate_text(double bytes_per_s) {
  char b[64];
  std::snprintf(b, sizeof b, "%gmbit", bytes_per_s * 8 / 1e6);
  return b;
}

// ---------------------------------------------------------------------------
// Pipes between the two processes: framed messages (kind, length, bytes).
// ---------------------------------------------------------------------------

enum MsgKind : uint32_t {
  kMsgComm = 1,     // parent -> child: unique id + rate string; child joins as rank 1
  kMsgPrompt = 2,   // parent -> child: PromptMsg (+ given tokens); child replies kMsgTokens
  kMsgTokens = 3,   // child -> parent: int32 tokens
  kMsgXfer = 4,     // parent -> child: XferMsg; child replies kMsgPosted, then kMsgDone
  kMsgPosted = 5,   // child -> parent: int64 t_posted_ns (the sender's kvxfer_send)
  kMsgDone = 6,     // child -> parent: DoneMsg
  kMsgEndComm = 7,  // parent -> child: destroy the communicator
  kMsgQuit = 8,
};

struct PromptMsg {
  int32_t id, len;
  uint64_t seed;
  float temperature;
  int32_t given;  // number of given tokens that follow
};
struct XferMsg {
  int32_t prompt_id, kv_tokens, mode, page_tokens;
  uint64_t tag;
};
struct DoneMsg {
  int32_t result;
  int64_t t_posted, t_handshake, t_anchor_ready, t_complete;
  uint64_t anchor_bytes, residual_bytes;
  char error[256];
};

using kvxfer::fdio::read_all;  // common/fdio.h
using kvxfer::fdio::write_all;

void send_msg(int fd, uint32_t kind, const void* body, size_t len) {
  const uint32_t hdr[2] = {kind, static_cast<uint32_t>(len)};
  if (!write_all(fd, hdr, sizeof hdr) || (len > 0 && !write_all(fd, body, len)))
    die("pipe write failed: %s", std::strerror(errno));
}

std::vector<uint8_t> recv_msg(int fd, uint32_t want, int timeout_ms = 120000) {
  uint32_t hdr[2];
  if (!read_all(fd, hdr, sizeof hdr, timeout_ms)) die("the other process went silent (pipe)");
  std::vector<uint8_t> body(hdr[1]);
  if (hdr[1] > 0 && !read_all(fd, body.data(), body.size(), timeout_ms)) die("short pipe message");
  if (hdr[0] != want) die("unexpected pipe message %u (wanted %u)", hdr[0], want);
  return body;
}

template <typename T>
T as(const std::vector<uint8_t>& b) {
  T t;
  if (b.size() < sizeof(T)) die("short pipe message");
  std::memcpy(&t, b.data(), sizeof(T));
  return t;
}

// ---------------------------------------------------------------------------
// Modes
// ---------------------------------------------------------------------------

enum Mode { kBF16 = 0, kINT8 = 1, kINT4 = 2, kLynx = 3, kModes = 4 };
const char* kModeName[kModes] = {"BF16-mono", "INT8-mono", "INT4-mono", "Lynx-spec"};
const char* kModeKey[kModes] = {"bf16", "int8", "int4", "lynx"};

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

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

struct Options {
  std::string model_path;  // default: SmolLM2 when fetched, else stories260K
  // SmolLM2 (a GGUF with a tokenizer): real prompts instead of sampled ones.
  std::string prompts_path = KVXFER_DATA_DIR "/prompts/chat.txt";
  std::string long_text_path = KVXFER_DATA_DIR "/apache-2.0.txt";
  std::string long_rate = "100mbit";
  int long_reps = 3;  // runs per mode of the long prompt (one prompt: its runs are the sample)
  int show_text = 2;
  std::string verify_rule = "adaptive";
  std::string rate = "50mbit";
  int prompt_len = 400;
  std::string prompt_ids;  // "1,2,3": given prompt instead of a generated one
  int tokens = 64;
  int reps = 3;
  std::vector<std::string> sweep_rates = {"20mbit", "50mbit", "100mbit", "200mbit"};
  std::vector<int> sweep_lens = {100, 200, 400};
  bool no_sweep = false;
  bool quick = false;
  std::string json_path;
  uint64_t seed = 1;
  float temperature = 1.0f;
  int page_tokens = 128;
  int threads = 1;
  int draft_threads = 0;  // model threads while drafting; 0 = max(1, threads - 1)
  int margin = 2;
  int verify_max = 0;
  int first_verify = 4;  // the first pass checks at most this many; 0 = no cap
  bool no_pin = false;   // leave the decode process's model threads unpinned
  bool pinned = false;   // set in main: they are pinned, one per CPU

  /** Model threads while drafting (--draft_threads, or one fewer than --threads). */
  int drafting_threads() const {
    return draft_threads > 0 ? draft_threads : std::max(1, threads - 1);
  }
};

// ---------------------------------------------------------------------------
// Prompt and KV helpers (both processes)
// ---------------------------------------------------------------------------

/** Pins the calling process's team of n model threads, one per CPU; warns and
 *  returns false when it cannot (fewer CPUs than threads). */
bool pin_threads(int n) {
  std::string why;
  if (km::pin_openmp_threads(n, &why)) return true;
  std::fprintf(stderr, "disagg_demo: model threads left unpinned: %s\n", why.c_str());
  return false;
}

std::vector<float> softmax(const std::vector<float>& logits, float temperature) {
  std::vector<float> p(logits.size());
  const float mx = *std::max_element(logits.begin(), logits.end());
  double s = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] = std::exp((logits[i] - mx) / temperature);
    s += p[i];
  }
  for (float& x : p) x = static_cast<float>(x / s);
  return p;
}

/** BOS, then tokens sampled from the model (temperature; seed), to `len` tokens. */
std::vector<int> make_prompt(const km::Model& m, int len, uint64_t seed, float temperature) {
  std::vector<int> t = {1};
  km::KVCache tail;
  std::vector<float> logits;
  std::string err;
  while (static_cast<int>(t.size()) < len) {
    const int pos = static_cast<int>(t.size()) - 1;
    if (!m.decode_step(t.back(), pos, km::KVView{}, &tail, &logits, &err)) die("%s", err.c_str());
    int32_t next = km::argmax(logits.data(), logits.size());
    if (temperature > 0) {
      const std::vector<float> p = softmax(logits, temperature);
      CHECK_KVXFER(kvxfer_spec_sample(p.data(), static_cast<int32_t>(p.size()),
                                      seed * 1000003 + static_cast<uint64_t>(pos), &next));
    }
    t.push_back(next);
  }
  return t;
}

/** A float32 KV in one block per layer ([tokens][kv_dim]) and its descriptor. */
struct BlockKV {
  std::vector<std::vector<float>> k, v;
  std::vector<void*> kp, vp;
  int kv_dim = 0;

  void init(const km::Config& c, int capacity) {
    kv_dim = c.kv_dim();
    k.assign(c.n_layers, std::vector<float>(static_cast<size_t>(capacity) * kv_dim, 0.0f));
    v = k;
    kp.resize(c.n_layers);
    vp.resize(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
      kp[l] = k[l].data();
      vp[l] = v[l].data();
    }
  }
  int capacity() const { return k.empty() ? 0 : static_cast<int>(k[0].size()) / kv_dim; }
  kvxfer_kv_desc_t desc(const km::Config& c, int tokens) const {
    kvxfer_kv_desc_t d = KVXFER_KV_DESC_INITIALIZER;
    d.num_layers = c.n_layers;
    d.kv_heads = c.n_kv_heads;
    d.head_dim = c.head_size();
    d.dtype = KVXFER_DTYPE_FP32;
    d.num_tokens = tokens;
    d.block_size = std::max(1, capacity());
    d.row_stride = kv_dim;
    d.num_blocks = 1;
    d.k_blocks = kp.data();
    d.v_blocks = vp.data();
    return d;
  }
  km::KVView view(int tokens) const {
    km::KVView w;
    w.n_tokens = tokens;
    for (size_t l = 0; l < k.size(); ++l)
      w.layers.push_back(
          {k[l].data(), v[l].data(), static_cast<size_t>(kv_dim), static_cast<size_t>(kv_dim)});
    return w;
  }
};

// ---------------------------------------------------------------------------
// The prefill process (rank 1)
// ---------------------------------------------------------------------------

int prefill_main(const Options& o, int in_fd, int out_fd) {
  alarm(1800);  // never outlive a hung parent for long
  std::string err;
  std::unique_ptr<km::Model> model = km::Model::load(o.model_path, &err);
  if (!model) die("prefill: %s", err.c_str());
  const km::Config& c = model->config();
  std::map<int, BlockKV> kvs;  // prompt id -> prefill KV (all but the last prompt token)
  kvxfer_comm_t comm = nullptr;
  std::string rate;
  for (;;) {
    uint32_t hdr[2];
    if (!read_all(in_fd, hdr, sizeof hdr, 600000)) die("prefill: parent went silent");
    std::vector<uint8_t> body(hdr[1]);
    if (hdr[1] > 0 && !read_all(in_fd, body.data(), body.size(), 60000)) die("prefill: short msg");
    switch (hdr[0]) {
      case kMsgComm: {
        kvxfer_unique_id_t id;
        std::memcpy(&id, body.data(), sizeof id);
        rate.assign(reinterpret_cast<const char*>(body.data()) + sizeof id,
                    body.size() - sizeof id);
        kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
        cfg.rate_limit = rate.c_str();
        CHECK_KVXFER(kvxfer_comm_init(&comm, 2, id, 1, &cfg));
        break;
      }
      case kMsgPrompt: {
        const PromptMsg pm = as<PromptMsg>(body);
        std::vector<int> tokens;
        if (pm.given > 0) {
          const int32_t* g = reinterpret_cast<const int32_t*>(body.data() + sizeof(PromptMsg));
          tokens.assign(g, g + pm.given);
        } else {
          tokens = make_prompt(*model, pm.len, pm.seed, pm.temperature);
        }
        km::PrefillResult pre;
        const std::vector<int> head(tokens.begin(), tokens.end() - 1);
        if (!model->prefill(head, {}, &pre, &err)) die("prefill: %s", err.c_str());
        BlockKV& kv = kvs[pm.id];
        kv.init(c, static_cast<int>(head.size()));
        for (int l = 0; l < c.n_layers; ++l) {
          std::memcpy(kv.k[l].data(), pre.kv.k(l), kv.k[l].size() * sizeof(float));
          std::memcpy(kv.v[l].data(), pre.kv.v(l), kv.v[l].size() * sizeof(float));
        }
        std::vector<int32_t> out(tokens.begin(), tokens.end());
        send_msg(out_fd, kMsgTokens, out.data(), out.size() * sizeof(int32_t));
        break;
      }
      case kMsgXfer: {
        const XferMsg x = as<XferMsg>(body);
        auto it = kvs.find(x.prompt_id);
        if (it == kvs.end() || comm == nullptr) die("prefill: transfer before prompt/comm");
        const kvxfer_kv_desc_t d = it->second.desc(c, x.kv_tokens);
        kvxfer_codec_config_t codec;
        kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
        codec_of(static_cast<Mode>(x.mode), &codec, &rc.mode);
        rc.tag = x.tag;
        rc.page_tokens = x.page_tokens;
        kvxfer_request_t req = nullptr;
        const int64_t t_post = now_ns();
        CHECK_KVXFER(kvxfer_send(comm, 0, &d, &codec, &rc, &req));
        send_msg(out_fd, kMsgPosted, &t_post, sizeof t_post);
        DoneMsg done{};
        done.result = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, -1);
        if (done.result != KVXFER_SUCCESS)
          std::snprintf(done.error, sizeof done.error, "%s", kvxfer_get_last_error());
        kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
        CHECK_KVXFER(kvxfer_request_get_info(req, &info));
        done.t_posted = info.t_posted_ns;
        done.t_handshake = info.t_handshake_ns;
        done.t_anchor_ready = info.t_anchor_ready_ns;
        done.t_complete = info.t_complete_ns;
        done.anchor_bytes = info.anchor_wire_bytes;
        done.residual_bytes = info.residual_wire_bytes;
        CHECK_KVXFER(kvxfer_request_free(req));
        send_msg(out_fd, kMsgDone, &done, sizeof done);
        break;
      }
      case kMsgEndComm:
        CHECK_KVXFER(kvxfer_comm_destroy(comm));
        comm = nullptr;
        break;
      case kMsgQuit:
        if (comm != nullptr) kvxfer_comm_destroy(comm);
        return 0;
      default: die("prefill: unknown message %u", hdr[0]);
    }
  }
}

// ---------------------------------------------------------------------------
// The decode process (rank 0)
// ---------------------------------------------------------------------------

/** One timed run of one mode. */
struct Run {
  Mode mode = kBF16;
  double rate_bps = 0;          // bytes/s
  int prompt_len = 0, rep = 0;  // prompt_len: the point's key (text prompts: the set)
  int tokens_in = 0;            // the prompt's actual length
  int64_t t0 = 0;               // sender's kvxfer_send
  int64_t t_handshake = 0, t_anchor = 0, t_first_residual = 0, t_complete = 0;  // receiver
  int64_t t_snapshot = 0;    // Lynx: anchor snapshot taken (callback)
  int64_t t_first_emit = 0;  // first output token emitted
  int64_t t_verify_start = 0, t_verify_end = 0;
  std::vector<int64_t> t_commit;       // when output token i became final
  std::vector<int> tokens, reference;  // output; plain greedy on the same received KV
  uint64_t anchor_bytes = 0, residual_bytes = 0;
  int drafted = 0, verified = 0, accepted = 0, matched = 0, window0 = 0;
  int passes = 0;  // verification passes (Lynx)
  /** Each verification pass: tokens run (the last final token + the checked
   *  drafts), its time and the start-up calibration's a(C) + b(C) k (ms). */
  struct Pass {
    int tokens = 0;
    double ms = 0, pred_ms = 0;
  };
  std::vector<Pass> pass_log;
  bool rejected = false;   // a draft token was rejected (else the checked draft was all accepted)
  double t_res_pred0 = 0;  // residual time predicted at ANCHOR_READY
  bool speculated = false;
  bool stages_ok = true;
  std::string stage_problem;
};

/** The receiver's anchor snapshot, taken on the progress thread in on_anchor_ready. */
struct Snapshot {
  const BlockKV* src = nullptr;
  BlockKV* dst = nullptr;
  int tokens = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool taken = false;
  int64_t t = 0;
};

void on_anchor_ready(kvxfer_request_t, kvxfer_stage_t stage, kvxfer_result_t, void* user) {
  Snapshot* s = static_cast<Snapshot*>(user);
  if (stage == KVXFER_STAGE_ANCHOR_READY) {
    // Residuals of this request are applied only after this callback returns
    // (docs/SPEC.md, "The anchor snapshot"), so this copy is anchor-precision.
    const size_t n = static_cast<size_t>(s->tokens) * s->src->kv_dim * sizeof(float);
    for (size_t l = 0; l < s->src->k.size(); ++l) {
      std::memcpy(s->dst->k[l].data(), s->src->k[l].data(), n);
      std::memcpy(s->dst->v[l].data(), s->src->v[l].data(), n);
    }
  }
  std::lock_guard<std::mutex> lk(s->mu);
  s->taken = true;
  s->t = now_ns();
  s->cv.notify_all();
}

/** The latency model's runner costs at one point of the table (cal_at in main). */
struct Calibration {
  double tpot_s = 0;         // decode step (median)
  double verify_base_s = 0;  // verify pass: base + per_token * tokens
  double verify_per_token_s = 0;
};

/** The runner's costs at one context (KV tokens), timed at start-up: a decode
 *  step, and a verification pass of k tokens as a(C) + b(C) k (the latency
 *  model's t_ver, docs/SPEC.md), fitted by least squares to the medians of
 *  passes of 1, 4, 16 and 64 tokens. */
struct PassCost {
  double tpot_s = 0, base_s = 0, per_token_s = 0;
  double pass_s(int tokens) const { return base_s + per_token_s * tokens; }
};

class Decoder {
 public:
  /** capacity: the longest KV (tokens) a run receives. */
  Decoder(const Options& o, const km::Model& m, int to_child, int from_child, int capacity)
      : o_(o), m_(m), c_(m.config()), to_(to_child), from_(from_child) {
    recv_.init(c_, capacity);
    snap_.init(c_, capacity);
  }

  void open_comm(double rate_bps) {
    kvxfer_unique_id_t id;
    CHECK_KVXFER(kvxfer_get_unique_id(&id));  // this process is rank 0
    rate_ = rate_text(rate_bps);
    std::vector<uint8_t> b(sizeof id + rate_.size());
    std::memcpy(b.data(), &id, sizeof id);
    std::memcpy(b.data() + sizeof id, rate_.data(), rate_.size());
    send_msg(to_, kMsgComm, b.data(), b.size());
    kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
    cfg.rate_limit = rate_.c_str();
    CHECK_KVXFER(kvxfer_comm_init(&comm_, 2, id, 0, &cfg));
  }

  void close_comm() {
    send_msg(to_, kMsgEndComm, nullptr, 0);
    CHECK_KVXFER(kvxfer_comm_destroy(comm_));
    comm_ = nullptr;
  }

  /** Asks the prefill process for prompt `id` (generated or given); returns its tokens. */
  std::vector<int> prompt(int id, int len, uint64_t seed, const std::vector<int>& given) {
    PromptMsg pm{id, len, seed, o_.temperature, static_cast<int32_t>(given.size())};
    std::vector<uint8_t> b(sizeof pm + given.size() * sizeof(int32_t));
    std::memcpy(b.data(), &pm, sizeof pm);
    for (size_t i = 0; i < given.size(); ++i) {
      const int32_t t = given[i];
      std::memcpy(b.data() + sizeof pm + i * sizeof t, &t, sizeof t);
    }
    send_msg(to_, kMsgPrompt, b.data(), b.size());
    const std::vector<uint8_t> r = recv_msg(from_, kMsgTokens);
    std::vector<int> t(r.size() / sizeof(int32_t));
    for (size_t i = 0; i < t.size(); ++i) std::memcpy(&t[i], r.data() + i * 4, 4);
    return t;
  }

  /** Transfers prompt `pid`'s KV (prompt[0..L-2]) in `mode` and decodes N tokens. */
  Run run(Mode mode, int pid, const std::vector<int>& prompt, int L, int rep, double rate_bps) {
    Run r;
    r.mode = mode;
    r.rate_bps = rate_bps;
    r.prompt_len = L;
    r.tokens_in = L;
    r.rep = rep;
    const int n_kv = L - 1, N = o_.tokens;
    const kvxfer_kv_desc_t d = recv_.desc(c_, n_kv);
    Snapshot snap;
    snap.src = &recv_;
    snap.dst = &snap_;
    snap.tokens = n_kv;
    kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
    rc.tag = ++tag_;
    if (mode == kLynx) {
      rc.on_anchor_ready = on_anchor_ready;
      rc.user_data = &snap;
    }
    kvxfer_request_t req = nullptr;
    CHECK_KVXFER(kvxfer_recv(comm_, 1, &d, &rc, &req));
    XferMsg x{pid, n_kv, mode, o_.page_tokens, rc.tag};
    send_msg(to_, kMsgXfer, &x, sizeof x);

    const km::KVView full = recv_.view(n_kv), anchor = snap_.view(n_kv);
    std::vector<float> logits;
    std::string err;
    km::KVCache tail;  // full-KV rows of the final tokens after the prompt
    int tok = prompt[L - 1];
    auto step = [&](const km::KVView& view, km::KVCache* t, int token, int pos) {
      const int64_t a = now_ns();
      if (!m_.decode_step(token, pos, view, t, &logits, &err)) die("decode: %s", err.c_str());
      const int64_t b = now_ns();
      CHECK_KVXFER(kvxfer_spec_monitor_record_step(&monitor_, ms(b - a) * 1e-3));
      step_samples_.push_back(ms(b - a) * 1e-3);
      return km::argmax(logits.data(), logits.size());
    };
    auto commit = [&](int token) {
      r.tokens.push_back(token);
      r.t_commit.push_back(now_ns());
      if (r.t_first_emit == 0) r.t_first_emit = r.t_commit.back();
    };

    int32_t speculate = 0;
    CHECK_KVXFER(kvxfer_spec_monitor_query(&monitor_, &speculate, nullptr));
    if (mode == kLynx && speculate) {
      // ANCHOR_READY: wait for the snapshot the callback takes.
      {
        std::unique_lock<std::mutex> lk(snap.mu);
        while (!snap.taken) {
          snap.cv.wait_for(lk, std::chrono::milliseconds(5));
          kvxfer_stage_t st;
          const kvxfer_result_t tr = kvxfer_test(req, &st);
          if (tr < 0) die("receive failed: %s", kvxfer_get_last_error());
        }
      }
      r.t_snapshot = snap.t;
      r.speculated = true;
      kvxfer_spec_window_config_t wc = KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER;
      wc.margin = o_.margin;
      wc.max_tokens = std::min(N, c_.seq_len - L);
      wc.residual_ratio = residual_ratio_;
      wc.link_bytes_per_s = rate_bps;
      std::vector<int32_t> draft;
      km::KVCache dtail;
      const int64_t t_start = now_ns();
      int t = tok;
      // Drafting runs while the residual is in flight: it leaves the
      // transfer's progress and decode threads one of the model's threads
      // (docs/SPEC.md, "Results on SmolLM2").
      const int draft_threads = o_.drafting_threads();
      omp_set_num_threads(draft_threads);
      for (;;) {
        kvxfer_stage_t st;
        const kvxfer_result_t tr = kvxfer_test(req, &st);
        if (tr < 0) die("receive failed: %s", kvxfer_get_last_error());
        if (st == KVXFER_STAGE_COMPLETE) break;
        kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
        CHECK_KVXFER(kvxfer_request_get_info(req, &info));
        const int64_t now = now_ns();
        double t_res = 0;
        int32_t w = 0;
        if (kvxfer_spec_residual_time(&wc, &info, now, &t_res) != KVXFER_SUCCESS) t_res = 0;
        if (monitor_.tpot_s > 0) {
          CHECK_KVXFER(
              kvxfer_spec_window(&wc, t_res, monitor_.tpot_s, ms(now - t_start) * 1e-3, &w));
        } else {
          w = 1;  // no step measured yet: draft one, which measures TPOT
        }
        if (draft.empty()) {
          r.window0 = w;
          r.t_res_pred0 = t_res;
        }
        if (static_cast<int>(draft.size()) >= w) break;  // window full: wait for the residual
        t = step(anchor, &dtail, t, L - 1 + static_cast<int>(draft.size()));
        draft.push_back(t);
        if (r.t_first_emit == 0) r.t_first_emit = now_ns();
      }
      if (o_.pinned) pin_threads(o_.threads);
      // Verify the draft in batched passes on the full KV; row i of a pass's
      // logits scores its draft token i.  The first pass starts now, the
      // residual perhaps still in flight: it reads layer l of the full KV
      // only once kvxfer_wait_layer says that layer is COMPLETE (all its
      // pages' residuals applied and checked), so what is left of it at
      // COMPLETE is the last layers' share (docs/SPEC.md, "The first pass
      // after COMPLETE").  Until the last layer is complete it runs on the
      // drafting threads, leaving the transfer its core.  The later passes
      // run after COMPLETE.
      auto team_for_rest = [&] {
        kvxfer_stage_t last = KVXFER_STAGE_POSTED;
        (void)kvxfer_test_layer(req, c_.n_layers - 1, &last);
        omp_set_num_threads(last == KVXFER_STAGE_COMPLETE ? o_.threads : draft_threads);
      };
      auto layer_complete = [&](int layer) {
        if (kvxfer_wait_layer(req, layer, KVXFER_STAGE_COMPLETE, -1) != KVXFER_SUCCESS)
          return false;
        team_for_rest();
        return true;
      };
      team_for_rest();
      r.t_verify_start = now_ns();
      // Passes until a rejection or the end of the draft.  Each pass checks
      // the next v draft tokens: all that are left (--verify_rule all), or
      // the v with the most expected final tokens per second at this
      // context's pass cost (kvxfer_spec_verify_length); at most
      // --verify_max per pass, and --first_verify in the first.  A pass
      // whose tokens are all accepted also yields the model's next token;
      // when that equals the next draft token it is accepted too and the
      // next pass goes on from there.
      const size_t n_check = draft.size();
      size_t pos = 0;  // draft tokens accepted so far
      int cur = tok;   // the last final token, whose KV row is not in the tail yet
      r.drafted = static_cast<int>(draft.size());
      for (;;) {
        const int64_t p0 = now_ns();
        size_t v = n_check - pos;
        const PassCost& cost = cost_at(n_kv);
        if (o_.verify_rule == "adaptive") {
          // The acceptance so far, with a prior of 9 accepted in 10 (the
          // paper's 90.4%) so that one early rejection does not stop every
          // later verification (and with it the evidence).
          const double rate = (static_cast<double>(monitor_.accepted) + 9.0) /
                              (static_cast<double>(monitor_.accepted + monitor_.rejected) + 10.0);
          int32_t n = 0;
          CHECK_KVXFER(kvxfer_spec_verify_length(static_cast<int32_t>(v), rate, cost.tpot_s,
                                                 cost.base_s, cost.per_token_s, &n));
          v = static_cast<size_t>(n);
        }
        if (o_.verify_max > 0) v = std::min(v, static_cast<size_t>(o_.verify_max));
        if (r.passes == 0 && o_.first_verify > 0)
          v = std::min(v, static_cast<size_t>(o_.first_verify));
        std::vector<int> batch = {cur};
        batch.insert(batch.end(), draft.begin() + static_cast<std::ptrdiff_t>(pos),
                     draft.begin() + static_cast<std::ptrdiff_t>(pos + v));
        const int rows0 = tail.n_tokens();
        const bool first = r.passes == 0;
        if (!(first ? m_.verify(batch, L - 1 + rows0, full, &tail, &logits, &err, layer_complete)
                    : m_.verify(batch, L - 1 + rows0, full, &tail, &logits, &err)))
          die("verify: %s (%s)", err.c_str(), kvxfer_get_last_error());
        int64_t p_start = p0;  // the first pass: its time after COMPLETE
        if (first) {
          omp_set_num_threads(o_.threads);
          if (kvxfer_wait(req, KVXFER_STAGE_COMPLETE, -1) != KVXFER_SUCCESS)
            die("receive failed: %s", kvxfer_get_last_error());
          kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
          CHECK_KVXFER(kvxfer_request_get_info(req, &info));
          p_start = std::max(p0, info.t_complete_ns);
        }
        std::vector<int32_t> target(batch.size());
        for (size_t i = 0; i < batch.size(); ++i)
          target[i] = km::argmax(logits.data() + i * c_.vocab_size, c_.vocab_size);
        int32_t a = 0, next = 0;
        CHECK_KVXFER(kvxfer_spec_verify_greedy(draft.data() + pos, static_cast<int32_t>(v),
                                               target.data(), &a, &next));
        tail.truncate(rows0 + 1 + a);  // the rows of cur and of the accepted draft tokens
        const double pass_s = ms(now_ns() - p_start) * 1e-3;
        r.pass_log.push_back({static_cast<int>(batch.size()), pass_s * 1e3,
                              cost.pass_s(static_cast<int>(batch.size())) * 1e3});
        // The accepted tokens become final now (the first one was emitted
        // earlier, when it was drafted).
        for (int i = 0; i < a && static_cast<int>(r.tokens.size()) < N; ++i)
          commit(draft[pos + static_cast<size_t>(i)]);
        r.verified += static_cast<int>(v);
        for (size_t i = 0; i < v; ++i) r.matched += draft[pos + i] == target[i] ? 1 : 0;
        if (v > 0)
          CHECK_KVXFER(kvxfer_spec_monitor_update(&monitor_, static_cast<int32_t>(v), a, nullptr));
        ++r.passes;
        pos += static_cast<size_t>(a);
        if (static_cast<size_t>(a) < v) r.rejected = true;
        const bool go_on = static_cast<size_t>(a) == v && pos < n_check && draft[pos] == next &&
                           static_cast<int>(r.tokens.size()) < N;
        if (static_cast<int>(r.tokens.size()) < N) commit(next);  // the correction, or draft[pos]
        cur = next;
        if (!go_on) break;
        ++pos;  // draft[pos] == next was accepted without a check
        if (pos >= n_check) break;
      }
      r.accepted = static_cast<int>(pos);
      r.t_verify_end = now_ns();
      const int next = cur;
      tok = next;
    } else {
      const kvxfer_result_t wr = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, -1);
      if (wr != KVXFER_SUCCESS) die("receive failed: %s", kvxfer_get_last_error());
    }
    // Decode the rest on the full KV.
    while (static_cast<int>(r.tokens.size()) < N) {
      const int pos = L - 1 + tail.n_tokens();
      tok = step(full, &tail, tok, pos);
      commit(tok);
    }

    // Untimed: the transfer's record, the sender's, and the reference decode.
    kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
    CHECK_KVXFER(kvxfer_request_get_info(req, &info));
    r.t_handshake = info.t_handshake_ns;
    r.t_anchor = info.t_anchor_ready_ns;
    r.t_first_residual = info.t_first_residual_ns;
    r.t_complete = info.t_complete_ns;
    r.anchor_bytes = info.anchor_wire_bytes;
    r.residual_bytes = info.residual_wire_bytes;
    CHECK_KVXFER(kvxfer_request_free(req));
    r.t0 = as<int64_t>(recv_msg(from_, kMsgPosted));
    const DoneMsg done = as<DoneMsg>(recv_msg(from_, kMsgDone));
    if (done.result != KVXFER_SUCCESS) die("send failed: %s", done.error);
    if (mode == kLynx && r.anchor_bytes > 0)
      residual_ratio_ = static_cast<double>(r.residual_bytes) / r.anchor_bytes;
    {
      km::KVCache t2;
      int tk = prompt[L - 1];
      for (int i = 0; i < N; ++i) {
        if (!m_.decode_step(tk, L - 1 + i, full, &t2, &logits, &err)) die("%s", err.c_str());
        tk = km::argmax(logits.data(), logits.size());
        r.reference.push_back(tk);
      }
    }
    check_stages(&r);
    return r;
  }

  /** Times the runner at a KV of n_kv tokens (PassCost), untimed by the
   *  runs, on the receive buffer (the values do not change the time).  The
   *  first call also seeds the monitor's TPOT. */
  void calibrate_at(int n_kv) {
    if (pass_cost_.count(n_kv) != 0) return;
    const km::KVView kv = recv_.view(n_kv);
    std::vector<float> logits;
    std::string err;
    std::vector<double> steps;
    for (int rep = 0; rep < 3; ++rep) {
      km::KVCache t;
      int tok = 1;
      for (int i = 0; i < 4; ++i) {
        const int64_t a = now_ns();
        if (!m_.decode_step(tok, n_kv + i, kv, &t, &logits, &err)) die("%s", err.c_str());
        steps.push_back(ms(now_ns() - a) * 1e-3);
        tok = km::argmax(logits.data(), logits.size());
      }
    }
    PassCost c;
    c.tpot_s = median(steps);
    // Passes of k tokens, 3 timings each; least squares over the medians.
    std::vector<std::pair<double, double>> pts;
    for (int k : {1, 4, 16, 64}) {
      if (n_kv + k > c_.seq_len) break;
      std::vector<double> t;
      for (int rep = 0; rep < 3; ++rep) {
        km::KVCache tail;
        const std::vector<int> batch(static_cast<size_t>(k), 1);
        const int64_t a = now_ns();
        if (!m_.verify(batch, n_kv, kv, &tail, &logits, &err)) die("%s", err.c_str());
        t.push_back(ms(now_ns() - a) * 1e-3);
      }
      pts.push_back({static_cast<double>(k), median(t)});
    }
    double sk = 0, st = 0, skk = 0, skt = 0;
    for (const auto& [k, t] : pts) {
      sk += k;
      st += t;
      skk += k * k;
      skt += k * t;
    }
    const double n = static_cast<double>(pts.size());
    const double den = n * skk - sk * sk;
    c.per_token_s = pts.size() >= 2 && den > 0 ? std::max(0.0, (n * skt - sk * st) / den) : 0.0;
    c.base_s = std::max(0.0, (st - c.per_token_s * sk) / n);
    if (pass_cost_.empty())
      for (int i = 0; i < 8; ++i)
        CHECK_KVXFER(kvxfer_spec_monitor_record_step(&monitor_, c.tpot_s));
    pass_cost_[n_kv] = c;
  }

  /** The calibration at the nearest timed context (calibrate_at first). */
  const PassCost& cost_at(int n_kv) const {
    if (pass_cost_.empty()) die("cost_at(%d) before calibrate_at", n_kv);
    auto it = pass_cost_.lower_bound(n_kv);
    if (it == pass_cost_.end()) return std::prev(it)->second;
    if (it != pass_cost_.begin() && n_kv - std::prev(it)->first < it->first - n_kv)
      return std::prev(it)->second;
    return it->second;
  }

  /** Decode-step times of every timed run (seconds). */
  const std::vector<double>& step_samples() const { return step_samples_; }
  /** Forgets the samples (after the warm-up). */
  void clear_samples() { step_samples_.clear(); }
  const kvxfer_spec_monitor_t& monitor() const { return monitor_; }

 private:
  void check_stages(Run* r) {
    auto bad = [&](const char* what) {
      r->stages_ok = false;
      if (!r->stage_problem.empty()) r->stage_problem += "; ";
      r->stage_problem += what;
    };
    if (!(r->t0 <= r->t_handshake && r->t_handshake <= r->t_anchor && r->t_anchor <= r->t_complete))
      bad("not POSTED <= handshake <= ANCHOR_READY <= COMPLETE");
    if (r->mode == kLynx) {
      if (!(r->t_anchor < r->t_complete)) bad("ANCHOR_READY not before COMPLETE");
      if (!(r->t_first_residual >= r->t_anchor)) bad("a residual applied before ANCHOR_READY");
      if (r->speculated && !(r->t_snapshot >= r->t_anchor && r->t_snapshot <= r->t_complete))
        bad("the anchor snapshot is not between ANCHOR_READY and COMPLETE");
      if (r->drafted > 0 && !(r->t_first_emit >= r->t_anchor)) bad("drafted before ANCHOR_READY");
      // The first pass may start before COMPLETE: it reads each layer only
      // after kvxfer_wait_layer(COMPLETE) (Model::verify's layer_ready).
      if (r->speculated && !(r->t_verify_start >= r->t_anchor)) bad("verified before ANCHOR_READY");
    } else if (r->t_first_residual != 0 || r->residual_bytes != 0) {
      bad("a monolithic transfer carried residual sections");
    }
    if (!r->t_commit.empty() && !(r->t_commit.front() >= r->t_anchor))
      bad("a final token before the KV was usable");
  }

  const Options& o_;
  const km::Model& m_;
  const km::Config& c_;
  int to_, from_;
  kvxfer_comm_t comm_ = nullptr;
  std::string rate_;
  BlockKV recv_, snap_;
  uint64_t tag_ = 0;
  double residual_ratio_ = 0.8;        // residual / anchor bytes of the last Lynx transfer
  std::map<int, PassCost> pass_cost_;  // by KV tokens (calibrate_at)
  kvxfer_spec_monitor_t monitor_ = KVXFER_SPEC_MONITOR_INITIALIZER;
  std::vector<double> step_samples_;
};

// ---------------------------------------------------------------------------
// Aggregation and output
// ---------------------------------------------------------------------------

struct Point {  // one (rate, prompt length) of the sweep
  double rate_bps = 0;
  int prompt_len = 0;
};
bool operator<(const Point& a, const Point& b) {
  return a.rate_bps != b.rate_bps ? a.rate_bps < b.rate_bps : a.prompt_len < b.prompt_len;
}

struct Summary {
  Mode mode = kBF16;
  int runs = 0;
  double ttft_ms = 0, ttft_commit_ms = 0, tt32_ms = 0, tt64_ms = 0, anchor_ms = 0, complete_ms = 0;
  double wire_kb = 0, anchor_kb = 0, residual_kb = 0;
  long drafted = 0, verified = 0, accepted = 0, rejected = 0, matched = 0, full_accepts = 0,
       draft_runs = 0;
  int identical_full = 0, identical_bf16 = 0, compared_bf16 = 0;
  double prefix_bf16 = 0;  // mean fraction of tokens before the first difference from BF16
  int stage_errors = 0;
  int window0 = 0;
  double t_res_pred0_ms = 0;
  // ttft_model predictions
  double pred_ttft_ms = 0, pred_ttft_commit_ms = 0, pred_tt32_ms = 0, pred_tt64_ms = 0;

  double accept_rate() const {
    return accepted + rejected > 0 ? static_cast<double>(accepted) / (accepted + rejected) : 0.0;
  }
  double agreement() const { return verified > 0 ? static_cast<double>(matched) / verified : 0.0; }
  double p_full() const {
    return draft_runs > 0 ? static_cast<double>(full_accepts) / draft_runs : 0.0;
  }
};

double t_tokens_ms(const Run& r, int n) {
  if (static_cast<int>(r.t_commit.size()) < n) return std::nan("");
  return ms(r.t_commit[static_cast<size_t>(n - 1)] - r.t0);
}

Summary summarize(Mode m, const std::vector<const Run*>& runs,
                  const std::map<std::pair<int, int>, const Run*>& bf16_of) {
  Summary s;
  s.mode = m;
  std::vector<double> ttft, ttfc, t32, t64, ta, tc, wire, anc, res, tres, w0;
  for (const Run* r : runs) {
    s.runs++;
    ttft.push_back(ms(r->t_first_emit - r->t0));
    ttfc.push_back(t_tokens_ms(*r, 1));
    t32.push_back(t_tokens_ms(*r, 32));
    t64.push_back(t_tokens_ms(*r, 64));
    ta.push_back(ms(r->t_anchor - r->t0));
    tc.push_back(ms(r->t_complete - r->t0));
    wire.push_back((r->anchor_bytes + r->residual_bytes) / 1024.0);
    anc.push_back(r->anchor_bytes / 1024.0);
    res.push_back(r->residual_bytes / 1024.0);
    if (r->speculated) {
      s.drafted += r->drafted;
      s.verified += r->verified;
      s.accepted += r->accepted;
      s.matched += r->matched;
      if (r->verified > 0) {
        s.draft_runs++;
        if (r->rejected) {
          s.rejected++;
        } else {
          s.full_accepts++;
        }
      }
      tres.push_back(r->t_res_pred0 * 1e3);
      w0.push_back(r->window0);
    }
    if (r->tokens == r->reference) s.identical_full++;
    auto it = bf16_of.find({r->prompt_len, r->rep});
    if (it != bf16_of.end()) {
      s.compared_bf16++;
      const std::vector<int>& b = it->second->tokens;
      if (r->tokens == b) s.identical_bf16++;
      size_t k = 0;
      while (k < b.size() && k < r->tokens.size() && b[k] == r->tokens[k]) ++k;
      s.prefix_bf16 += static_cast<double>(k) / std::max<size_t>(1, b.size());
    }
    if (!r->stages_ok) s.stage_errors++;
  }
  if (s.compared_bf16 > 0) s.prefix_bf16 /= s.compared_bf16;
  s.ttft_ms = median(ttft);
  s.ttft_commit_ms = median(ttfc);
  s.tt32_ms = median(t32);
  s.tt64_ms = median(t64);
  s.anchor_ms = median(ta);
  s.complete_ms = median(tc);
  s.wire_kb = median(wire);
  s.anchor_kb = median(anc);
  s.residual_kb = median(res);
  s.t_res_pred0_ms = median(tres);
  s.window0 = w0.empty() ? 0 : static_cast<int>(median(w0));
  return s;
}

/** Fills the ttft_model predictions of the four summaries of one point. */
void predict(const Point& p, const Calibration& cal, double t_fixed_s, double burst,
             double accept_rate, int margin, int max_window, int max_verify, Summary* s) {
  kvxfer_spec_model_input_t in = KVXFER_SPEC_MODEL_INPUT_INITIALIZER;
  in.link_bytes_per_s = p.rate_bps;
  in.burst_bytes = burst;
  in.t_fixed_s = t_fixed_s;
  in.tpot_s = cal.tpot_s;
  in.t_verify_base_s = cal.verify_base_s;
  in.t_verify_per_token_s = cal.verify_per_token_s;
  for (int m = 0; m < kLynx; ++m) in.bytes[m] = s[m].wire_kb * 1024.0;
  in.anchor_bytes = s[kLynx].anchor_kb * 1024.0;
  in.residual_bytes = s[kLynx].residual_kb * 1024.0;
  in.window = -1;
  in.margin = margin;
  in.max_window = max_window;
  in.max_verify = max_verify;
  in.accept_rate = accept_rate;
  for (int n : {32, 64}) {
    in.num_tokens = n;
    kvxfer_spec_model_output_t out = KVXFER_SPEC_MODEL_OUTPUT_INITIALIZER;
    CHECK_KVXFER(kvxfer_spec_ttft_model(&in, &out));
    for (int m = 0; m < kModes; ++m) {
      s[m].pred_ttft_ms = out.ttft_s[m] * 1e3;
      s[m].pred_ttft_commit_ms = out.ttft_commit_s[m] * 1e3;
      (n == 32 ? s[m].pred_tt32_ms : s[m].pred_tt64_ms) = out.ttnt_s[m] * 1e3;
    }
  }
}

std::string fmt(double v, const char* f = "%.2f") {
  if (!std::isfinite(v)) return "-";
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

json summary_json(const Point& p, const Summary& s) {
  auto num = [](double v) { return std::isfinite(v) ? json(v) : json(nullptr); };
  return json{{"rate_mbit", p.rate_bps * 8 / 1e6},
              {"prompt_len", p.prompt_len},
              {"mode", kModeKey[s.mode]},
              {"runs", s.runs},
              {"ttft_ms", num(s.ttft_ms)},
              {"ttft_commit_ms", num(s.ttft_commit_ms)},
              {"tt32_ms", num(s.tt32_ms)},
              {"tt64_ms", num(s.tt64_ms)},
              {"anchor_ready_ms", num(s.anchor_ms)},
              {"complete_ms", num(s.complete_ms)},
              {"wire_kib", s.wire_kb},
              {"anchor_kib", s.anchor_kb},
              {"residual_kib", s.residual_kb},
              {"drafted", s.drafted},
              {"verified", s.verified},
              {"accepted", s.accepted},
              {"rejections", s.rejected},
              {"accept_rate", s.accept_rate()},
              {"draft_agreement", s.agreement()},
              {"p_whole_draft", s.p_full()},
              {"draft_rounds", s.draft_runs},
              {"window_at_anchor_ready", s.window0},
              {"t_res_predicted_ms", num(s.t_res_pred0_ms)},
              {"identical_full", s.identical_full},
              {"identical_bf16", s.identical_bf16},
              {"prefix_agreement_bf16", s.prefix_bf16},
              {"stage_errors", s.stage_errors},
              {"pred_ttft_ms", s.pred_ttft_ms},
              {"pred_ttft_commit_ms", s.pred_ttft_commit_ms},
              {"pred_tt32_ms", s.pred_tt32_ms},
              {"pred_tt64_ms", s.pred_tt64_ms}};
}

/** The prompts of text mode: sets[0] chat prompts, sets[1] the long text (or none). */
struct TextPrompts {
  std::vector<std::vector<int>> sets[2];
  std::vector<std::string> users[2];  // the user turn of each prompt
  std::unique_ptr<km::BpeTokenizer> tokenizer;
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
      if (t == tokenizer->eos_id() || tokenizer->token_text(t) == "<|im_end|>") break;
      cut.push_back(t);
    }
    std::string out, err;
    if (!tokenizer->decode(cut, &out, &err)) die("decode: %s", err.c_str());
    return out;
  }
};

std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) die("cannot read %s", path.c_str());
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

/** The chat prompts (one per line; at most --reps of them when given) and the
 *  long text, each as a user turn of the model's chat template, tokenized. */
TextPrompts load_text_prompts(const Options& o, const km::gguf::File& file, bool reps_given) {
  TextPrompts tp;
  std::string err;
  tp.tokenizer = km::BpeTokenizer::from_gguf(file, &err);
  if (!tp.tokenizer) die("%s", err.c_str());
  const std::unique_ptr<km::ChatTemplate> chat = km::ChatTemplate::from_gguf(file, &err);
  if (!chat) die("%s", err.c_str());
  auto add = [&](int set, const std::string& user) {
    std::vector<int32_t> ids;
    if (!tp.tokenizer->encode(chat->render_user(user), true, &ids, &err)) die("%s", err.c_str());
    tp.sets[set].emplace_back(ids.begin(), ids.end());
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

void print_main_table(const Point& p, const Summary* s, int tokens, const std::string& what) {
  std::printf(
      "#\n# Link %s, %s, %d output tokens, %d run(s) per mode; times in ms from kvxfer_send, "
      "medians; TTFTc = first committed (verified) token, prefix = mean accepted draft tokens "
      "per verification pass\n",
      rate_text(p.rate_bps).c_str(), what.c_str(), tokens, s[0].runs);
  std::printf("#%10s %8s %8s %8s %8s %8s %8s %8s %8s %8s %8s %7s %7s %8s %8s %6s %6s %6s %6s %7s\n",
              "mode", "wire_KiB", "anchor", "complete", "TTFT", "TTFTc", "pred", "TT32T", "pred",
              "TT64T", "pred", "drafted", "accept", "acc_rate", "agree", "prefix", "P(all)",
              "=full", "=bf16", "bf16pre");
  for (int m = 0; m < kModes; ++m) {
    const Summary& x = s[m];
    const bool l = m == kLynx;
    std::printf(
        " %10s %8s %8s %8s %8s %8s %8s %8s %8s %8s %8s %7s %7s %8s %8s %6s %6s %5.0f%% %5.0f%% "
        "%6.0f%%\n",
        kModeName[m], fmt(x.wire_kb, "%.1f").c_str(), fmt(x.anchor_ms).c_str(),
        fmt(x.complete_ms).c_str(), fmt(x.ttft_ms).c_str(), fmt(x.ttft_commit_ms).c_str(),
        fmt(x.pred_ttft_ms).c_str(), fmt(x.tt32_ms).c_str(), fmt(x.pred_tt32_ms).c_str(),
        fmt(x.tt64_ms).c_str(), tokens >= 64 ? fmt(x.pred_tt64_ms).c_str() : "-",
        l ? std::to_string(x.drafted).c_str() : "-", l ? std::to_string(x.accepted).c_str() : "-",
        l ? fmt(x.accept_rate(), "%.3f").c_str() : "-",
        l ? fmt(x.agreement(), "%.3f").c_str() : "-",
        l && x.draft_runs > 0 ? fmt(static_cast<double>(x.accepted) / x.draft_runs, "%.1f").c_str()
                              : "-",
        l ? fmt(x.p_full(), "%.2f").c_str() : "-", 100.0 * x.identical_full / x.runs,
        x.compared_bf16 ? 100.0 * x.identical_bf16 / x.compared_bf16 : 0.0, 100.0 * x.prefix_bf16);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "disagg_demo: prefill and decode processes over an emulated link; Lynx progressive "
      "transfer with speculative decoding on the anchors against BF16/INT8/INT4 monolithic "
      "(docs/SPEC.md)"};
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
  app.add_option("-p,--prompt_len", o.prompt_len, "prompt tokens (BOS + sampled tokens)");
  app.add_option("--prompt", o.prompt_ids, "comma-separated prompt token ids instead");
  app.add_option("--tokens", o.tokens, "output tokens per run (>= 1; TT64T needs 64)");
  app.add_option("--reps", o.reps, "runs per mode and point (different prompts)");
  app.add_option("--sweep_rates", o.sweep_rates, "rates of the sweep (at the main prompt length)");
  app.add_option("--sweep_lens", o.sweep_lens, "prompt lengths of the sweep (at the main rate)");
  app.add_flag("--no_sweep", o.no_sweep, "only the main table");
  app.add_flag("--quick", o.quick, "small and fast (the ctest): 1 run, 32 tokens, no sweep");
  app.add_option("-J,--json", o.json_path, "write every run and summary to this JSON file");
  app.add_option("--seed", o.seed, "prompt sampling seed");
  app.add_option("--temperature", o.temperature, "prompt sampling temperature (0 = greedy)");
  app.add_option("--page_tokens", o.page_tokens, "tokens per transfer page");
  app.add_option("--threads", o.threads, "OpenMP threads of the model in each process");
  app.add_option("--draft_threads", o.draft_threads,
                 "OpenMP threads while drafting on the anchor KV, with the residual in flight "
                 "(0: one fewer than --threads, at least 1)");
  app.add_option("--margin", o.margin, "speculative window margin (tokens)");
  app.add_option("--verify_max", o.verify_max,
                 "a verification pass checks at most this many draft tokens (passes go on "
                 "while every token is accepted); 0 = no cap");
  app.add_flag("--no_pin", o.no_pin,
               "leave the decode process's model threads unpinned (by default each of "
               "--threads >= 2 is pinned to its own CPU)");
  app.add_option("--first_verify", o.first_verify,
                 "the first verification pass checks at most this many draft tokens, so that "
                 "the first committed token comes soon after COMPLETE; 0 = no cap");
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
  std::vector<int> given;
  if (!o.prompt_ids.empty()) {
    size_t at = 0;
    while (at < o.prompt_ids.size()) {
      size_t comma = o.prompt_ids.find(',', at);
      if (comma == std::string::npos) comma = o.prompt_ids.size();
      given.push_back(std::atoi(o.prompt_ids.substr(at, comma - at).c_str()));
      at = comma + 1;
    }
    o.prompt_len = static_cast<int>(given.size());
    o.sweep_lens.clear();
  }
  if (o.tokens < 1 || o.reps < 1 || o.threads < 1 || o.draft_threads < 0 || o.margin < 0)
    die("bad option value");

  // The emulated link is slow and the KV small: a token bucket as deep as the
  // default chunk (256 KiB) would let most of a transfer through unlimited.
  // 16 KiB: shallower buckets lose rate to the progress thread's wake-up
  // jitter on a busy 2-core machine (docs/SPEC.md, "The emulated link").
  setenv("KVXFER_NET_CHUNK_BYTES", "16384", 0);
  setenv("KVXFER_CODEC_THREADS", "1", 0);  // tiny pages; two processes share the cores
  const double burst = std::atof(std::getenv("KVXFER_NET_CHUNK_BYTES"));

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
  if (text_mode && !text.sets[1].empty()) {
    double b = 0;
    if (!parse_link_rate(o.long_rate, &b, &why))
      die("bad --long_rate '%s': %s", o.long_rate.c_str(), why.c_str());
    points.insert({b, 1});
  }
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
    j["config"] = {{"main_rate_mbit", main_rate * 8 / 1e6},
                   {"prompt_len", o.prompt_len},
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
