// The pieces of examples/disagg_demo that its three parts share: the prefill
// process (disagg_prefill.cc: what a serving runtime's prefill node does), the
// decoder (disagg_decoder.cc: what its decode node does) and the measurement
// around them (disagg_demo.cc, disagg_report.cc).  The two processes talk over
// pipes in the framing of perf/common/pipe_msg.h.
#pragma once

#include <kvxfer/kvxfer.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "models/llama2.h"

namespace disagg {

namespace km = kvxfer::model;

inline constexpr const char* kTool = "disagg_demo";

/** CLOCK_MONOTONIC in ns (the clock of kvxfer's request timestamps). */
int64_t now_ns();
inline double ms(int64_t ns) { return static_cast<double>(ns) * 1e-6; }

/** Prints "disagg_demo: <message>" and exits with status 2. */
[[noreturn]] void die(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

#define CHECK_KVXFER(call)                                                                   \
  do {                                                                                       \
    const kvxfer_result_t r_ = (call);                                                       \
    if (r_ != KVXFER_SUCCESS)                                                                \
      die("%s failed: %s: %s", #call, kvxfer_get_error_string(r_), kvxfer_get_last_error()); \
  } while (0)

double median(std::vector<double> v);
/** "<mbit>mbit": a rate in bytes/s in the syntax of kvxfer_comm_config_t.rate_limit. */
std::string rate_text(double bytes_per_s);

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
struct DoneMsg {  // the sender's result; the decoder times the transfer itself
  int32_t result;
  char error[256];
};

/** Writes one message; dies when the pipe fails. */
void send_msg(int fd, uint32_t kind, const void* body, size_t len);
/** Reads one message of kind `want`; dies on anything else or after timeout_ms. */
std::vector<uint8_t> recv_msg(int fd, uint32_t want, int timeout_ms = 120000);

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
inline constexpr const char* kModeName[kModes] = {"BF16-mono", "INT8-mono", "INT4-mono",
                                                  "Lynx-spec"};
inline constexpr const char* kModeKey[kModes] = {"bf16", "int8", "int4", "lynx"};

/** The codec and transfer mode of a mode (the same on both sides). */
void codec_of(Mode m, kvxfer_codec_config_t* codec, kvxfer_mode_t* xmode);

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
bool pin_threads(int n);

/** BOS, then tokens sampled from the model (temperature; seed), to `len` tokens. */
std::vector<int> make_prompt(const km::Model& m, int len, uint64_t seed, float temperature);

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

/** The prefill process (rank 1): serves the decode process's messages on
 *  in_fd/out_fd until kMsgQuit (disagg_prefill.cc). */
int prefill_main(const Options& o, int in_fd, int out_fd);

}  // namespace disagg
