// kvxfer_perf: the product benchmark of kvxfer_send / kvxfer_recv, in the
// nccl-tests dialect.  Every column and formula is defined in
// docs/PERFORMANCE.md, section "kvxfer_perf"; run with no arguments for the
// default report.
//
// Two processes move a paged KV cache (Llama-3-8B-like by default) from rank 0
// (the sender) to rank 1 (the receiver) through the public API only
// (include/kvxfer/kvxfer.h), once per KV size (-b/-e/-f) and codec (-m):
// Lynx 4+4 progressive, and the monolithic baselines INT8, INT4 and BF16, all
// in one table from the same run.  The times are the receiver's
// ANCHOR_READY and COMPLETE, measured from the later of the two posts.  With
// -c 1 every received byte is compared with the codec's own decode of what
// was sent (#wrong).
//
// By default the receiver is a forked child of this process and reports to
// the parent over a pipe; with --rank R --id FILE the two ranks run as two
// separate commands (for example on two hosts).
#include "kvxfer/kvxfer.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "api/xfer_api.h"
#include "codec/codec_math.h"
#include "common/fdio.h"
#include "kvxfer/spectrum.h"
#include "models/synthetic_kv.h"
#include "perf/common/harness.h"
#include "perf/common/kv_data.h"

namespace {

namespace kp = kvxfer::perf;
namespace km = kvxfer::model;
using nlohmann::json;

constexpr const char* kTool = "kvxfer_perf";
// Tag of the tiny transfers that order the posts in cross-host mode.
constexpr uint64_t kBarrierTag = 0x6b76706572665f62ull;
// Longest wait for a message of the other process in fork mode (it may be
// generating a large KV, or computing the expected decode, meanwhile).
constexpr int kPipeWaitMs = 600000;

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------
int64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

using kp::split;  // perf/common/harness.h

using kp::parse_size;  // perf/common/harness.h

using kp::codec_name;  // perf/common/harness.h
using kp::dtype_name;
const char* mode_name(kvxfer_mode_t m) {
  return m == KVXFER_MODE_PROGRESSIVE ? "prog" : m == KVXFER_MODE_MONOLITHIC ? "mono" : "auto";
}

/** "<what> failed: <error string> (<code>): <last error text>" */
std::string api_error(const std::string& what, kvxfer_result_t r) {
  return kp::strprintf("%s failed: %s (%d): %s", what.c_str(), kvxfer_get_error_string(r),
                       static_cast<int>(r), kvxfer_get_last_error());
}

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------
struct Options {
  kp::CommonOptions common;
  std::string minbytes = "8M", maxbytes = "64M";
  int factor = 2;
  std::string codecs = "lynx,int8,int4,bf16";
  std::string rate;
  bool rate_given = false;
  int requests = 1;
  int layers = 32, kv_heads = 8, head_dim = 128;
  std::string dtype = "bf16";
  int block = 16;
  int page_tokens = 0;
  int chunk = 32, anchor_bits = 4;
  bool stories = false;
  bool engine_only = false;  // --engine_only: codec jobs do no work (xfer::TestHooks::skip_codec)
  std::string model_path = std::string(KVXFER_DATA_DIR) + "/stories260K.bin";
  int rank = -1;  // -1: fork mode (both ranks here)
  std::string id_file;
  int timeout_ms = 0;

  // Resolved.
  uint64_t min_b = 0, max_b = 0;
  kvxfer_dtype_t dt = KVXFER_DTYPE_BF16;
  int32_t page_tokens_eff = 0;
  int64_t timeout_eff_ms = 30000;
  bool fork_mode() const { return rank < 0; }
};

/** One column of -m: a codec configuration and how it travels. */
struct CodecCase {
  std::string name;  // as given to -m
  std::string params;
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  kvxfer_mode_t mode = KVXFER_MODE_MONOLITHIC;
};

constexpr const char* kCodecChoices = "lynx, lynx-mono, int8, int8-prog, int4, bf16, spectrum";

bool make_case(const std::string& name, const Options& o, CodecCase* c) {
  c->name = name;
  c->cfg = KVXFER_CODEC_CONFIG_INITIALIZER;  // alpha 0: the library's default
  c->cfg.chunk_tokens = o.chunk;
  c->cfg.anchor_bits = o.anchor_bits;
  if (name == "lynx" || name == "lynx-mono") {
    c->cfg.codec = KVXFER_CODEC_LYNX;
    c->mode = name == "lynx" ? KVXFER_MODE_PROGRESSIVE : KVXFER_MODE_MONOLITHIC;
  } else if (name == "int8" || name == "int8-prog") {
    c->cfg.codec = KVXFER_CODEC_INT8;
    c->mode = name == "int8" ? KVXFER_MODE_MONOLITHIC : KVXFER_MODE_PROGRESSIVE;
  } else if (name == "int4") {
    c->cfg.codec = KVXFER_CODEC_INT4;
    c->cfg.anchor_bits = 4;
    c->mode = KVXFER_MODE_MONOLITHIC;
  } else if (name == "bf16") {
    c->cfg.codec = KVXFER_CODEC_BF16;
    c->mode = KVXFER_MODE_MONOLITHIC;
  } else if (name == "spectrum") {  // kvxfer_send's default SpectrumKV policy
    c->cfg.codec = KVXFER_CODEC_SPECTRUM;
    c->mode = KVXFER_MODE_PROGRESSIVE;
  } else {
    return false;
  }
  switch (c->cfg.codec) {
    case KVXFER_CODEC_LYNX:
      c->params = kp::strprintf("a0/c%d/%d+%d", o.chunk, o.anchor_bits, 8 - o.anchor_bits);
      break;
    case KVXFER_CODEC_INT8:
      c->params = kp::strprintf("c%d/%d+%d", o.chunk, o.anchor_bits, 8 - o.anchor_bits);
      break;
    case KVXFER_CODEC_INT4: c->params = kp::strprintf("c%d/4+0", o.chunk); break;
    case KVXFER_CODEC_SPECTRUM: {
      const kvxfer_spectrum_config_t d = KVXFER_SPECTRUM_CONFIG_INITIALIZER;
      c->params = kp::strprintf("b%.2f/s%d/c%d/%d+%d", d.budget, d.sink_tokens, o.chunk,
                                o.anchor_bits, 8 - o.anchor_bits);
      break;
    }
    default: c->params = "-"; break;
  }
  return true;
}

// ---------------------------------------------------------------------------
// Shape, sizes and the plan both ranks follow
// ---------------------------------------------------------------------------
struct Shape {
  int32_t layers = 32, kv_heads = 8, head_dim = 128;
  kvxfer_dtype_t dtype = KVXFER_DTYPE_BF16;
  int32_t H() const { return kv_heads * head_dim; }
  size_t esize() const { return dtype == KVXFER_DTYPE_FP32 ? 4 : 2; }
  size_t row_bytes() const { return static_cast<size_t>(H()) * esize(); }
  uint64_t bytes_per_token() const {
    return uint64_t{2} * static_cast<uint64_t>(layers) * row_bytes();
  }
};

struct SizePoint {
  uint64_t requested = 0;  // -b/-e/-f value
  int64_t tokens = 0;      // floor(requested / bytes_per_token)
  uint64_t kv_bytes = 0;   // tokens * bytes_per_token: the size of one request's KV
};

struct Plan {
  Shape shape;
  std::vector<SizePoint> sizes;
  std::vector<CodecCase> codecs;
  int iters_total() const { return warmup + iters; }
  int warmup = 1, iters = 3, requests = 1;
  int32_t page_tokens = 256;
  int32_t block = 16;
};

// ---------------------------------------------------------------------------
// KV data: float values per (request, layer, kind), converted to the dtype.
// ---------------------------------------------------------------------------
// The exact conversions of the codec (src/codec/codec_math.h).
using kvxfer::codec::f32_to_bf16;
using kvxfer::codec::f32_to_f16;

void store_row(const float* src, int32_t H, kvxfer_dtype_t dt, uint8_t* dst) {
  switch (dt) {
    case KVXFER_DTYPE_BF16:
      for (int32_t c = 0; c < H; ++c) {
        const uint16_t v = f32_to_bf16(src[c]);
        std::memcpy(dst + 2 * c, &v, 2);
      }
      break;
    case KVXFER_DTYPE_FP16:
      for (int32_t c = 0; c < H; ++c) {
        const uint16_t v = f32_to_f16(src[c]);
        std::memcpy(dst + 2 * c, &v, 2);
      }
      break;
    default: std::memcpy(dst, src, static_cast<size_t>(H) * 4); break;
  }
}

class DataSource {
 public:
  virtual ~DataSource() = default;
  /** Values of request r, layer l, kind (0 K, 1 V), tokens [0, T): float [T][H]. */
  virtual bool fill(int r, int32_t layer, int kind, int64_t T, float* out,
                    std::string* err) const = 0;
};

/** Llama-3-8B-like synthetic KV (models/synthetic_kv.h); request r has seed 1 + r. */
class SyntheticSource : public DataSource {
 public:
  explicit SyntheticSource(const Shape& s) : spec_(kp::llama3_8b_like_spec(s.layers)) {
    spec_.n_kv_heads = s.kv_heads;
    spec_.head_dim = s.head_dim;
  }
  const km::SyntheticKVSpec& spec() const { return spec_; }
  bool fill(int r, int32_t layer, int kind, int64_t T, float* out,
            std::string* err) const override {
    km::SyntheticKVSpec s = spec_;
    s.seed = spec_.seed + static_cast<uint64_t>(r);
    return km::fill_synthetic_kv(s, layer, kind == 0 ? km::KVKind::kKey : km::KVKind::kValue, 0, T,
                                 out, 0, err);
  }

 private:
  km::SyntheticKVSpec spec_;
};

/**
 * KV of the stories260K checkpoint: BOS, 511 greedy tokens, one prefill (as
 * perf/codec_perf's "real" dataset).  Token t of request r is the model's
 * token (t + 97 r) mod 512, so longer KV tiles the real one.
 */
class StoriesSource : public DataSource {
 public:
  bool load(const std::string& path, std::string* err) {
    return kp::greedy_prefill_kv(path, &kv_, err);
  }
  bool fill(int r, int32_t layer, int kind, int64_t T, float* out,
            std::string* err) const override {
    (void)err;
    const std::vector<float>& src = (kind == 0 ? kv_.k : kv_.v)[static_cast<size_t>(layer)];
    const int64_t T_real = kv_.tokens, H = kv_.channels();
    for (int64_t t = 0; t < T; ++t) {
      const int64_t u = (t + 97 * int64_t{r}) % T_real;
      std::memcpy(out + t * H, src.data() + u * H, static_cast<size_t>(H) * sizeof(float));
    }
    return true;
  }

 private:
  kp::GreedyPrefillKV kv_;  // perf/common/kv_data.h
};

/** Reads only the llama2.c header (7 int32) of the checkpoint: the KV shape. */
bool read_model_shape(const std::string& path, Shape* s, int* seq_len, std::string* err) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    *err = "cannot open " + path + ": " + std::strerror(errno);
    return false;
  }
  int32_t h[7];
  const size_t n = std::fread(h, sizeof(int32_t), 7, f);
  std::fclose(f);
  if (n != 7 || h[0] <= 0 || h[2] <= 0 || h[3] <= 0 || h[4] <= 0 || h[0] % h[3] != 0 || h[6] <= 0) {
    *err = path + " is not a llama2.c checkpoint";
    return false;
  }
  s->layers = h[2];
  s->kv_heads = h[4];
  s->head_dim = h[0] / h[3];
  *seq_len = h[6];
  return true;
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};

/**
 * A KV cache as a serving runtime holds it: one allocation of `block`-token
 * blocks of H contiguous elements per row, handed out to (layer, K/V, block
 * index) in a fixed pseudo-random order (a splitmix64 Fisher-Yates shuffle),
 * as codec_perf lays out its pools.
 */
class PagedKV {
 public:
  PagedKV(const Shape& s, int64_t T, int32_t block, uint64_t seed) : block_(block) {
    nblocks_ = std::max<int64_t>(1, (T + block - 1) / block);
    row_bytes_ = s.row_bytes();
    const size_t block_bytes = static_cast<size_t>(block) * row_bytes_;
    const size_t total = static_cast<size_t>(2 * s.layers * nblocks_);
    bytes_ = total * block_bytes;
    mem_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (bytes_ + 63) / 64 * 64)));
    if (!mem_) throw std::bad_alloc();
    std::vector<size_t> slot(total);
    for (size_t i = 0; i < total; ++i) slot[i] = i;
    uint64_t x = seed;
    for (size_t i = total; i > 1; --i) {
      x += 0x9e3779b97f4a7c15ull;
      uint64_t z = x;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      std::swap(slot[i - 1], slot[z % i]);
    }
    const size_t per = static_cast<size_t>(s.layers * nblocks_);
    k_.resize(per);
    v_.resize(per);
    for (size_t i = 0; i < per; ++i) {
      k_[i] = mem_.get() + slot[i] * block_bytes;
      v_[i] = mem_.get() + slot[per + i] * block_bytes;
    }
    desc_ = KVXFER_KV_DESC_INITIALIZER;
    desc_.num_layers = s.layers;
    desc_.kv_heads = s.kv_heads;
    desc_.head_dim = s.head_dim;
    desc_.dtype = s.dtype;
    desc_.num_tokens = T;
    desc_.block_size = block;
    desc_.row_stride = s.H();
    desc_.num_blocks = nblocks_;
    desc_.k_blocks = k_.data();
    desc_.v_blocks = v_.data();
  }
  uint8_t* row(int32_t layer, int kind, int64_t t) {
    const std::vector<void*>& b = kind == 0 ? k_ : v_;
    return static_cast<uint8_t*>(b[static_cast<size_t>(layer * nblocks_ + t / block_)]) +
           static_cast<size_t>(t % block_) * row_bytes_;
  }
  void fill_bytes(uint8_t v) { std::memset(mem_.get(), v, bytes_); }
  const kvxfer_kv_desc_t* desc() const { return &desc_; }

 private:
  int32_t block_;
  int64_t nblocks_ = 0;
  size_t row_bytes_ = 0, bytes_ = 0;
  std::unique_ptr<uint8_t, FreeDeleter> mem_;
  std::vector<void*> k_, v_;
  kvxfer_kv_desc_t desc_;
};

/**
 * One request's KV as a contiguous image, [layer][K,V][token][H] in the
 * dtype: the receiver's copy of what the sender sends, and the expected
 * decode it is compared with.
 */
struct Image {
  Shape s;
  int64_t T = 0;
  std::vector<uint8_t> bytes;
  Image(const Shape& shape, int64_t tokens)
      : s(shape), T(tokens), bytes(static_cast<size_t>(tokens) * shape.bytes_per_token()) {}
  uint8_t* plane(int32_t layer, int kind) {
    return bytes.data() + (static_cast<size_t>(layer) * 2 + static_cast<size_t>(kind)) *
                              static_cast<size_t>(T) * s.row_bytes();
  }
};

/** Generates request r's KV and hands each (layer, kind) row to `put`. */
bool generate(const DataSource& src, const Shape& s, int64_t T, int r,
              const std::function<void(int32_t, int, int64_t, const float*)>& put,
              std::string* err) {
  std::vector<float> buf(static_cast<size_t>(T) * static_cast<size_t>(s.H()));
  for (int32_t l = 0; l < s.layers; ++l)
    for (int kind = 0; kind < 2; ++kind) {
      if (!src.fill(r, l, kind, T, buf.data(), err)) return false;
      for (int64_t t = 0; t < T; ++t) put(l, kind, t, buf.data() + t * s.H());
    }
  return true;
}

/**
 * The receiver's blocks must equal, byte for byte, the codec's own
 * kvxfer_page_encode + kvxfer_page_decode of the same pages: page ids
 * {layer, kind, token_begin, stream_id = tag}, pages of page_tokens tokens.
 */
bool expected_decode(const CodecCase& cc, const Shape& s, int64_t T, int32_t page_tokens,
                     uint64_t tag, Image& src, Image* out, std::string* err) {
  const int64_t pmax = std::min<int64_t>(page_tokens, T);
  size_t acap = 0, rcap = 0;
  kvxfer_result_t rc = kvxfer_page_max_size(&cc.cfg, pmax, s.H(), &acap, &rcap);
  if (rc < 0) {
    *err = api_error("kvxfer_page_max_size", rc);
    return false;
  }
  std::vector<uint8_t> a(acap), res(rcap);
  // SPECTRUM: the tiers kvxfer_send's default policy chooses, from the KV
  // norm over every layer's K and V in the sender's order (layer, K, V).
  std::vector<uint8_t> tiers;
  if (cc.cfg.codec == KVXFER_CODEC_SPECTRUM) {
    std::vector<void*> planes;
    for (int32_t l = 0; l < s.layers; ++l)
      for (int kind = 0; kind < 2; ++kind) planes.push_back(src.plane(l, kind));
    std::vector<kvxfer_page_layout_t> pages;
    for (void*& pl : planes)
      pages.push_back({&pl, 1, static_cast<int32_t>(T), s.H(), 0, T, s.H(), s.dtype});
    const kvxfer_spectrum_config_t policy = KVXFER_SPECTRUM_CONFIG_INITIALIZER;
    std::vector<float> imp(static_cast<size_t>(T));
    tiers.resize(static_cast<size_t>(T));
    rc = kvxfer_spectrum_importance_from_kv(pages.data(), static_cast<int32_t>(pages.size()),
                                            policy.lambda, imp.data());
    if (rc == KVXFER_SUCCESS) rc = kvxfer_spectrum_assign(&policy, T, imp.data(), tiers.data());
    if (rc < 0) {
      *err = api_error("SpectrumKV policy (expected decode)", rc);
      return false;
    }
  }
  for (int32_t l = 0; l < s.layers; ++l)
    for (int kind = 0; kind < 2; ++kind) {
      void* sb = src.plane(l, kind);
      void* db = out->plane(l, kind);
      for (int64_t t0 = 0; t0 < T; t0 += page_tokens) {
        const int64_t n = std::min<int64_t>(page_tokens, T - t0);
        kvxfer_page_id_t id{static_cast<uint32_t>(l), kind == 0 ? KVXFER_KV_KEY : KVXFER_KV_VALUE,
                            t0, tag};
        kvxfer_page_layout_t lay{&sb, 1, static_cast<int32_t>(T), s.H(), t0, n, s.H(), s.dtype};
        size_t alen = 0, rlen = 0;
        rc = tiers.empty()
                 ? kvxfer_page_encode(&cc.cfg, &id, &lay, a.data(), acap, &alen, res.data(), rcap,
                                      &rlen)
                 : kvxfer_page_encode_tiered(&cc.cfg, &id, &lay, tiers.data() + t0, a.data(), acap,
                                             &alen, res.data(), rcap, &rlen);
        if (rc < 0) {
          *err = api_error("kvxfer_page_encode (expected decode)", rc);
          return false;
        }
        lay.blocks = &db;
        rc = kvxfer_page_decode(a.data(), alen, res.data(), rlen, &id, &lay);
        if (rc < 0) {
          *err = api_error("kvxfer_page_decode (expected decode)", rc);
          return false;
        }
      }
    }
  return true;
}

/** Bytes of the receiver's blocks that differ from the expected image. */
uint64_t count_wrong(PagedKV& dst, Image& want) {
  uint64_t wrong = 0;
  const size_t rb = want.s.row_bytes();
  for (int32_t l = 0; l < want.s.layers; ++l)
    for (int kind = 0; kind < 2; ++kind) {
      const uint8_t* w = want.plane(l, kind);
      for (int64_t t = 0; t < want.T; ++t) {
        const uint8_t* g = dst.row(l, kind, t);
        const uint8_t* e = w + static_cast<size_t>(t) * rb;
        if (std::memcmp(g, e, rb) == 0) continue;
        for (size_t i = 0; i < rb; ++i) wrong += g[i] != e[i];
      }
    }
  return wrong;
}

// ---------------------------------------------------------------------------
// What the receiver reports for each batch (R requests) of one size and codec
// ---------------------------------------------------------------------------
struct RecvReq {  // POD: it crosses the pipe as bytes
  int32_t result = 0, codec = 0, mode = 0, reserved = 0;
  int64_t num_pages = 0;
  uint64_t kv_bytes = 0, anchor_wire = 0, residual_wire = 0;
  int64_t t_posted = 0, t_handshake = 0, t_anchor = 0, t_complete = 0, t_first_residual = 0;
};

struct ArrivalRec {  // POD
  int64_t t_ns = 0;
  uint64_t bytes = 0;
  int32_t request = 0, traffic_class = 0, layer = 0, reserved = 0;
};

struct BatchHeader {  // POD
  int32_t ok = 0, nreq = 0;
  int64_t wrong = -1;  // -1: not checked
  int64_t t_last_post = 0;
  uint32_t narrivals = 0, error_len = 0;
};

struct Batch {
  BatchHeader h;
  std::vector<RecvReq> reqs;
  std::vector<ArrivalRec> arrivals;  // last iteration of each size and codec only
  std::string error;

  std::vector<uint8_t> serialize() const {
    std::vector<uint8_t> b;
    auto put = [&b](const void* p, size_t n) {
      const uint8_t* c = static_cast<const uint8_t*>(p);
      b.insert(b.end(), c, c + n);
    };
    BatchHeader hh = h;
    hh.nreq = static_cast<int32_t>(reqs.size());
    hh.narrivals = static_cast<uint32_t>(arrivals.size());
    hh.error_len = static_cast<uint32_t>(error.size());
    put(&hh, sizeof(hh));
    put(reqs.data(), reqs.size() * sizeof(RecvReq));
    put(arrivals.data(), arrivals.size() * sizeof(ArrivalRec));
    put(error.data(), error.size());
    return b;
  }
  bool parse(const std::vector<uint8_t>& b) {
    if (b.size() < sizeof(BatchHeader)) return false;
    std::memcpy(&h, b.data(), sizeof(h));
    const size_t need = sizeof(h) + static_cast<size_t>(h.nreq) * sizeof(RecvReq) +
                        h.narrivals * sizeof(ArrivalRec) + h.error_len;
    if (h.nreq < 0 || b.size() != need) return false;
    size_t off = sizeof(h);
    reqs.resize(static_cast<size_t>(h.nreq));
    std::memcpy(reqs.data(), b.data() + off, reqs.size() * sizeof(RecvReq));
    off += reqs.size() * sizeof(RecvReq);
    arrivals.resize(h.narrivals);
    std::memcpy(arrivals.data(), b.data() + off, arrivals.size() * sizeof(ArrivalRec));
    off += arrivals.size() * sizeof(ArrivalRec);
    error.assign(reinterpret_cast<const char*>(b.data() + off), h.error_len);
    return true;
  }
};

// ---------------------------------------------------------------------------
// The pipe from the forked receiver to the parent: framed messages.
// ---------------------------------------------------------------------------
enum MsgType : uint32_t { kMsgPosted = 1, kMsgBatch = 2, kMsgFatal = 3 };

using kvxfer::fdio::write_all;  // common/fdio.h

bool send_msg(int fd, MsgType type, const void* p, size_t n) {
  const uint32_t hdr[2] = {type, static_cast<uint32_t>(n)};
  return write_all(fd, hdr, sizeof(hdr)) && write_all(fd, p, n);
}

/** Reads exactly n bytes before the deadline; false on EOF, error or time out. */
bool read_deadline(int fd, void* p, size_t n, int64_t deadline_ns, std::string* err) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const int64_t left_ms = (deadline_ns - mono_ns()) / 1000000;
    if (left_ms <= 0) {
      *err = "timed out waiting for the receiver process";
      return false;
    }
    pollfd pfd{fd, POLLIN, 0};
    const int pr = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000)));
    if (pr < 0 && errno == EINTR) continue;
    if (pr < 0) {
      *err = std::string("poll: ") + std::strerror(errno);
      return false;
    }
    if (pr == 0) continue;
    const ssize_t r = ::read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      *err = "the receiver process exited";
      return false;
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool recv_msg(int fd, MsgType* type, std::vector<uint8_t>* payload, int wait_ms, std::string* err) {
  const int64_t deadline = mono_ns() + int64_t{wait_ms} * 1000000;
  uint32_t hdr[2];
  if (!read_deadline(fd, hdr, sizeof(hdr), deadline, err)) return false;
  *type = static_cast<MsgType>(hdr[0]);
  payload->resize(hdr[1]);
  return hdr[1] == 0 || read_deadline(fd, payload->data(), hdr[1], deadline, err);
}

// ---------------------------------------------------------------------------
// Waiting for requests, with a watchdog on top of the transport's own timeout.
// ---------------------------------------------------------------------------
/**
 * Waits until every request is final.  A request that fails aborts the
 * communicator (so that the others end too: the run stops there).  If
 * nothing moves for stall_ms, or peer_alive() turns false, the communicator
 * is aborted as well.  Returns the first error, with its text in *err.
 */
kvxfer_result_t wait_all(kvxfer_comm_t comm, const std::vector<kvxfer_request_t>& reqs,
                         int64_t stall_ms, const std::function<bool()>& peer_alive,
                         std::string* err) {
  kvxfer_result_t first = KVXFER_SUCCESS;
  auto progress = [&reqs]() {
    uint64_t p = 0;
    for (kvxfer_request_t r : reqs) {
      kvxfer_request_info_t i = KVXFER_REQUEST_INFO_INITIALIZER;
      if (kvxfer_request_get_info(r, &i) == KVXFER_SUCCESS)
        p += static_cast<uint64_t>(i.stage) + static_cast<uint64_t>(i.pages_anchor_ready) +
             static_cast<uint64_t>(i.pages_complete) + i.anchor_wire_bytes + i.residual_wire_bytes;
      size_t n = 0;
      if (kvxfer_request_get_arrivals(r, nullptr, 0, &n) == KVXFER_SUCCESS) p += n;
    }
    return p;
  };
  uint64_t last = progress();
  int64_t last_t = mono_ns();
  bool aborted = false;
  for (kvxfer_request_t r : reqs) {
    for (;;) {
      const kvxfer_result_t w = kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 100);
      if (w == KVXFER_SUCCESS) break;
      if (w < 0) {
        if (first == KVXFER_SUCCESS) {
          first = w;
          *err = kvxfer_get_last_error();
        }
        if (!aborted) {
          kvxfer_comm_abort(comm);
          aborted = true;
        }
        break;
      }
      const uint64_t p = progress();
      if (p != last) {
        last = p;
        last_t = mono_ns();
      }
      std::string why;
      if ((mono_ns() - last_t) / 1000000 > stall_ms)
        why = kp::strprintf("no progress for %" PRId64 " ms", stall_ms);
      else if (!peer_alive())
        why = "the peer process exited";
      if (!why.empty() && !aborted) {
        if (first == KVXFER_SUCCESS) {
          first = KVXFER_ERR_TIMEOUT;
          *err = why;
        }
        kvxfer_comm_abort(comm);
        aborted = true;
      }
    }
  }
  return first;
}

void free_all(std::vector<kvxfer_request_t>* reqs) {
  for (kvxfer_request_t r : *reqs) kvxfer_request_free(r);
  reqs->clear();
}

// ---------------------------------------------------------------------------
// Ordering the posts: the receiver posts its R receives first, then the
// sender its R sends, so the time from the later post covers the sender's
// whole encode.  Fork mode: a message on the pipe.  Cross-host mode: a tiny
// transfer from rank 1 to rank 0.
// ---------------------------------------------------------------------------
class Barrier {
 public:
  virtual ~Barrier() = default;
  /** Receiver: its receives are posted (the last at t_last_post). */
  virtual bool receiver_posted(int64_t t_last_post, std::string* err) = 0;
  /** Receiver: at the end of the batch. */
  virtual bool receiver_done(std::string* err) {
    (void)err;
    return true;
  }
  /** Sender: returns once the receiver has posted. */
  virtual bool sender_wait(std::string* err) = 0;
};

class PipeBarrier : public Barrier {
 public:
  PipeBarrier(int fd_to_parent, int fd_from_child) : wr_(fd_to_parent), rd_(fd_from_child) {}
  bool receiver_posted(int64_t t_last_post, std::string* err) override {
    if (send_msg(wr_, kMsgPosted, &t_last_post, sizeof(t_last_post))) return true;
    *err = "writing to the parent failed";
    return false;
  }
  bool sender_wait(std::string* err) override {
    MsgType type;
    std::vector<uint8_t> p;
    if (!recv_msg(rd_, &type, &p, kPipeWaitMs, err)) return false;
    if (type == kMsgFatal) {
      *err = "receiver (rank 1): " + std::string(p.begin(), p.end());
      return false;
    }
    if (type == kMsgBatch) {  // a failed batch before the post
      Batch b;
      *err = b.parse(p) ? "receiver (rank 1): " + b.error : "malformed message from the receiver";
      return false;
    }
    if (type != kMsgPosted || p.size() != sizeof(int64_t)) {
      *err = "unexpected message from the receiver";
      return false;
    }
    return true;
  }

 private:
  int wr_, rd_;
};

class XferBarrier : public Barrier {
 public:
  XferBarrier(kvxfer_comm_t comm, int64_t stall_ms) : comm_(comm), stall_ms_(stall_ms) {
    k_[0] = buf_;
    v_[0] = buf_ + 16;
    desc_ = KVXFER_KV_DESC_INITIALIZER;
    desc_.num_layers = 1;
    desc_.kv_heads = 1;
    desc_.head_dim = 16;
    desc_.dtype = KVXFER_DTYPE_BF16;
    desc_.num_tokens = 1;
    desc_.block_size = 1;
    desc_.num_blocks = 1;
    desc_.k_blocks = k_;
    desc_.v_blocks = v_;
    codec_.codec = KVXFER_CODEC_BF16;
    rc_.tag = kBarrierTag;
    rc_.mode = KVXFER_MODE_MONOLITHIC;
  }
  bool receiver_posted(int64_t t_last_post, std::string* err) override {
    (void)t_last_post;
    kvxfer_request_t r = nullptr;
    const kvxfer_result_t rc = kvxfer_send(comm_, 0, &desc_, &codec_, &rc_, &r);
    if (rc < 0) {
      *err = api_error("kvxfer_send (barrier)", rc);
      return false;
    }
    pending_.push_back(r);
    return true;
  }
  bool receiver_done(std::string* err) override { return finish(err); }
  bool sender_wait(std::string* err) override {
    kvxfer_request_t r = nullptr;
    const kvxfer_result_t rc = kvxfer_recv(comm_, 1, &desc_, &rc_, &r);
    if (rc < 0) {
      *err = api_error("kvxfer_recv (barrier)", rc);
      return false;
    }
    pending_.push_back(r);
    return finish(err);
  }

 private:
  bool finish(std::string* err) {
    std::string why;
    const kvxfer_result_t rc = wait_all(
        comm_, pending_, stall_ms_, [] { return true; }, &why);
    free_all(&pending_);
    if (rc < 0) *err = "barrier transfer failed: " + why;
    return rc == KVXFER_SUCCESS;
  }
  kvxfer_comm_t comm_;
  int64_t stall_ms_;
  uint16_t buf_[32] = {};
  void* k_[1];
  void* v_[1];
  kvxfer_kv_desc_t desc_;
  kvxfer_codec_config_t codec_ = KVXFER_CODEC_CONFIG_INITIALIZER;
  kvxfer_request_config_t rc_ = KVXFER_REQUEST_CONFIG_INITIALIZER;
  std::vector<kvxfer_request_t> pending_;
};

// ---------------------------------------------------------------------------
// The two ranks
// ---------------------------------------------------------------------------
std::unique_ptr<DataSource> make_source(const Options& o, const Shape& s, std::string* err) {
  if (!o.stories) return std::make_unique<SyntheticSource>(s);
  auto src = std::make_unique<StoriesSource>();
  if (!src->load(o.model_path, err)) {
    *err = "cannot build the stories260K KV from " + o.model_path + ": " + *err;
    return nullptr;
  }
  return src;
}

uint64_t request_tag(int r) { return static_cast<uint64_t>(r) + 1; }

kvxfer_request_config_t request_config(const Plan& p, const CodecCase& cc, int r) {
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.tag = request_tag(r);
  rc.mode = cc.mode;
  rc.page_tokens = p.page_tokens;
  return rc;
}

/** Called by the sender after each batch: size index, codec index, iteration, first post. */
using SenderHook =
    std::function<bool(size_t, size_t, int, int64_t, kvxfer_result_t, const std::string&)>;

/** Rank 0.  Returns 0, or 2 after a failure (already reported through `hook` or stderr). */
int run_sender(const Options& o, const Plan& p, kvxfer_comm_t comm, Barrier* barrier,
               const std::function<bool()>& peer_alive, const SenderHook& hook) {
  std::string err;
  std::unique_ptr<DataSource> src = make_source(o, p.shape, &err);
  if (!src) {
    std::fprintf(stderr, "%s: %s\n", kTool, err.c_str());
    return 2;
  }
  for (size_t si = 0; si < p.sizes.size(); ++si) {
    const SizePoint& sp = p.sizes[si];
    std::vector<std::unique_ptr<PagedKV>> kvs;
    for (int r = 0; r < p.requests; ++r) {
      kvs.push_back(std::make_unique<PagedKV>(p.shape, sp.tokens, p.block, 0x5eed0000u + r));
      PagedKV* kv = kvs.back().get();
      const kvxfer_dtype_t dt = p.shape.dtype;
      const int32_t H = p.shape.H();
      if (!generate(
              *src, p.shape, sp.tokens, r,
              [&](int32_t l, int kind, int64_t t, const float* row) {
                store_row(row, H, dt, kv->row(l, kind, t));
              },
              &err)) {
        std::fprintf(stderr, "%s: generating the KV failed: %s\n", kTool, err.c_str());
        return 2;
      }
    }
    for (size_t ci = 0; ci < p.codecs.size(); ++ci) {
      const CodecCase& cc = p.codecs[ci];
      for (int it = 0; it < p.iters_total(); ++it) {
        if (!barrier->sender_wait(&err)) {
          hook(si, ci, it, 0, KVXFER_ERR_SYSTEM, err);
          return 2;
        }
        std::vector<kvxfer_request_t> reqs;
        kvxfer_result_t rc = KVXFER_SUCCESS;
        for (int r = 0; r < p.requests && rc == KVXFER_SUCCESS; ++r) {
          const kvxfer_request_config_t rcfg = request_config(p, cc, r);
          kvxfer_request_t req = nullptr;
          rc = kvxfer_send(comm, 1, kvs[static_cast<size_t>(r)]->desc(), &cc.cfg, &rcfg, &req);
          if (rc < 0)
            err = api_error("kvxfer_send", rc);
          else
            reqs.push_back(req);
        }
        int64_t t_first_post = 0;
        if (!reqs.empty()) {
          kvxfer_request_info_t i = KVXFER_REQUEST_INFO_INITIALIZER;
          kvxfer_request_get_info(reqs[0], &i);
          t_first_post = i.t_posted_ns;
        }
        if (rc == KVXFER_SUCCESS) {
          rc = wait_all(comm, reqs, 2 * o.timeout_eff_ms + 10000, peer_alive, &err);
        } else {
          kvxfer_comm_abort(comm);
          std::string unused;
          wait_all(comm, reqs, 2 * o.timeout_eff_ms + 10000, peer_alive, &unused);
        }
        free_all(&reqs);
        if (!hook(si, ci, it, t_first_post, rc, err) || rc != KVXFER_SUCCESS) return 2;
      }
    }
  }
  return 0;
}

/** Rank 1.  `sink` gets every batch (a failed one too, then the run stops). */
int run_receiver(const Options& o, const Plan& p, kvxfer_comm_t comm, Barrier* barrier,
                 const std::function<bool()>& peer_alive,
                 const std::function<bool(size_t, size_t, int, const Batch&)>& sink) {
  std::string err;
  auto fail = [&](size_t si, size_t ci, int it, const std::string& what) {
    Batch b;
    b.h.ok = 0;
    b.error = what;
    sink(si, ci, it, b);
    return 2;
  };
  std::unique_ptr<DataSource> src;
  if (o.common.check) {
    src = make_source(o, p.shape, &err);
    if (!src) return fail(0, 0, 0, err);
  }
  for (size_t si = 0; si < p.sizes.size(); ++si) {
    const SizePoint& sp = p.sizes[si];
    std::vector<std::unique_ptr<PagedKV>> dst;
    std::vector<std::unique_ptr<Image>> sent, want;
    for (int r = 0; r < p.requests; ++r) {
      dst.push_back(std::make_unique<PagedKV>(p.shape, sp.tokens, p.block, 0x5eed1000u + r));
      if (!o.common.check) continue;
      sent.push_back(std::make_unique<Image>(p.shape, sp.tokens));
      Image* im = sent.back().get();
      const size_t rb = p.shape.row_bytes();
      const kvxfer_dtype_t dt = p.shape.dtype;
      const int32_t H = p.shape.H();
      if (!generate(
              *src, p.shape, sp.tokens, r,
              [&](int32_t l, int kind, int64_t t, const float* row) {
                store_row(row, H, dt, im->plane(l, kind) + static_cast<size_t>(t) * rb);
              },
              &err))
        return fail(si, 0, 0, "generating the KV failed: " + err);
    }
    for (size_t ci = 0; ci < p.codecs.size(); ++ci) {
      const CodecCase& cc = p.codecs[ci];
      // What the blocks must hold at COMPLETE.  BF16 passthrough of bf16 KV:
      // exactly the bytes that were sent.
      std::vector<Image*> expect;
      if (o.common.check) {
        const bool identity =
            cc.cfg.codec == KVXFER_CODEC_BF16 && p.shape.dtype == KVXFER_DTYPE_BF16;
        if (want.size() < static_cast<size_t>(p.requests) && !identity)
          for (int r = static_cast<int>(want.size()); r < p.requests; ++r)
            want.push_back(std::make_unique<Image>(p.shape, sp.tokens));
        for (int r = 0; r < p.requests; ++r) {
          if (identity) {
            expect.push_back(sent[static_cast<size_t>(r)].get());
            continue;
          }
          Image* w = want[static_cast<size_t>(r)].get();
          if (!expected_decode(cc, p.shape, sp.tokens, p.page_tokens, request_tag(r),
                               *sent[static_cast<size_t>(r)], w, &err))
            return fail(si, ci, 0, err);
          expect.push_back(w);
        }
      }
      for (int it = 0; it < p.iters_total(); ++it) {
        for (auto& d : dst) d->fill_bytes(0xA5);  // a row never written cannot pass
        Batch b;
        std::vector<kvxfer_request_t> reqs;
        kvxfer_result_t rc = KVXFER_SUCCESS;
        for (int r = 0; r < p.requests && rc == KVXFER_SUCCESS; ++r) {
          const kvxfer_request_config_t rcfg = request_config(p, cc, r);
          kvxfer_request_t req = nullptr;
          rc = kvxfer_recv(comm, 0, dst[static_cast<size_t>(r)]->desc(), &rcfg, &req);
          if (rc < 0)
            err = api_error("kvxfer_recv", rc);
          else
            reqs.push_back(req);
        }
        for (kvxfer_request_t req : reqs) {
          kvxfer_request_info_t i = KVXFER_REQUEST_INFO_INITIALIZER;
          kvxfer_request_get_info(req, &i);
          b.h.t_last_post = std::max(b.h.t_last_post, i.t_posted_ns);
        }
        if (rc == KVXFER_SUCCESS && !barrier->receiver_posted(b.h.t_last_post, &err))
          rc = KVXFER_ERR_SYSTEM;
        if (rc == KVXFER_SUCCESS) {
          rc = wait_all(comm, reqs, 2 * o.timeout_eff_ms + 10000, peer_alive, &err);
        } else {
          kvxfer_comm_abort(comm);
          std::string unused;
          wait_all(comm, reqs, 2 * o.timeout_eff_ms + 10000, peer_alive, &unused);
        }
        std::string berr;
        if (rc == KVXFER_SUCCESS && !barrier->receiver_done(&berr)) {
          rc = KVXFER_ERR_SYSTEM;
          err = berr;
        }
        const bool last = it + 1 == p.iters_total();
        for (size_t r = 0; r < reqs.size(); ++r) {
          kvxfer_request_info_t i = KVXFER_REQUEST_INFO_INITIALIZER;
          kvxfer_request_get_info(reqs[r], &i);
          RecvReq q;
          q.result = i.result;
          q.codec = i.codec;
          q.mode = i.mode;
          q.num_pages = i.num_pages;
          q.kv_bytes = i.kv_bytes;
          q.anchor_wire = i.anchor_wire_bytes;
          q.residual_wire = i.residual_wire_bytes;
          q.t_posted = i.t_posted_ns;
          q.t_handshake = i.t_handshake_ns;
          q.t_anchor = i.t_anchor_ready_ns;
          q.t_complete = i.t_complete_ns;
          q.t_first_residual = i.t_first_residual_ns;
          b.reqs.push_back(q);
          if (rc == KVXFER_SUCCESS &&
              (i.codec != cc.cfg.codec || i.mode != cc.mode || i.kv_bytes != sp.kv_bytes)) {
            rc = KVXFER_ERR_MISMATCH;
            err = kp::strprintf("the sender used %s/%s for %" PRIu64
                                " B where this rank expected %s/%s for %" PRIu64
                                " B: run both ranks with the same flags",
                                codec_name(i.codec), mode_name(i.mode), i.kv_bytes,
                                codec_name(cc.cfg.codec), mode_name(cc.mode), sp.kv_bytes);
          }
          if (last) {
            size_t n = 0;
            kvxfer_request_get_arrivals(reqs[r], nullptr, 0, &n);
            std::vector<kvxfer_arrival_t> a(n);
            if (n > 0) kvxfer_request_get_arrivals(reqs[r], a.data(), n, &n);
            for (size_t k = 0; k < n && k < a.size(); ++k) {
              ArrivalRec ar;
              ar.t_ns = a[k].t_ns;
              ar.bytes = a[k].bytes;
              ar.request = static_cast<int32_t>(r);
              ar.traffic_class = a[k].traffic_class;
              ar.layer = a[k].layer;
              b.arrivals.push_back(ar);
            }
          }
        }
        free_all(&reqs);
        if (rc == KVXFER_SUCCESS && o.common.check) {
          uint64_t wrong = 0;
          for (size_t r = 0; r < dst.size(); ++r) wrong += count_wrong(*dst[r], *expect[r]);
          b.h.wrong = static_cast<int64_t>(wrong);
        }
        b.h.ok = rc == KVXFER_SUCCESS ? 1 : 0;
        if (rc != KVXFER_SUCCESS) b.error = err;
        if (!sink(si, ci, it, b) || rc != KVXFER_SUCCESS) return 2;
      }
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------
// The report: rows, ratios, the anchors-first check, JSON.
// ---------------------------------------------------------------------------
class Report {
 public:
  Report(const Options& o, const Plan& p)
      : o_(o),
        p_(p),
        table_({{"size(B)", 10},
                {"tokens", 6},
                {"pages", 6},
                {"codec", 8},
                {"mode", 4},
                {"params", 16},
                {"anchor(B)", 10},
                {"wire(B)", 10},
                {"t_anchor(us)", 10},
                {"t_complete(us)", 10},
                {"algbw(GB/s)", 6},
                {"wirebw(GB/s)", 6},
                {"#wrong", 6}}) {
    rows_.resize(p.sizes.size() * p.codecs.size());
  }

  void header() {
    std::printf("%s\n", table_.header().c_str());
    std::fflush(stdout);
  }

  /** One batch as the receiver saw it; t_send_post: the sender's first post (0 if unknown). */
  void add(size_t si, size_t ci, int it, const Batch& b, int64_t t_send_post) {
    Row& row = rows_[si * p_.codecs.size() + ci];
    if (!b.h.ok) {
      failed_ = true;
      return;
    }
    const int64_t t0 = std::max(b.h.t_last_post, t_send_post);
    int64_t ta = 0, tc = 0, first_res = 0;
    for (const RecvReq& q : b.reqs) {
      ta = std::max(ta, q.t_anchor);
      tc = std::max(tc, q.t_complete);
      if (q.t_first_residual > 0 && (first_res == 0 || q.t_first_residual < first_res))
        first_res = q.t_first_residual;
    }
    if (!b.reqs.empty()) {
      const RecvReq& q = b.reqs[0];
      row.pages = q.num_pages;
      row.kv_bytes = q.kv_bytes;
      row.anchor_wire = q.anchor_wire;
      row.wire = q.anchor_wire + q.residual_wire;
    }
    if (b.h.wrong >= 0) {
      row.wrong = std::max<int64_t>(row.wrong, 0) + b.h.wrong;
      ++batches_checked_;
    }
    const double ta_us = static_cast<double>(ta - t0) * 1e-3;
    const double tc_us = static_cast<double>(tc - t0) * 1e-3;
    json sample = {{"iteration", it},
                   {"timed", it >= p_.warmup},
                   {"t_anchor_us", ta_us},
                   {"t_complete_us", tc_us},
                   {"t0_ns", t0},
                   {"t_send_post_ns", t_send_post == 0 ? json(nullptr) : json(t_send_post)},
                   {"t_recv_last_post_ns", b.h.t_last_post},
                   {"wrong", b.h.wrong < 0 ? json(nullptr) : json(b.h.wrong)}};
    json reqs = json::array();
    for (const RecvReq& q : b.reqs)
      reqs.push_back({{"t_posted_ns", q.t_posted},
                      {"t_handshake_ns", q.t_handshake},
                      {"t_anchor_ready_ns", q.t_anchor},
                      {"t_complete_ns", q.t_complete},
                      {"t_first_residual_ns", q.t_first_residual},
                      {"anchor_wire_bytes", q.anchor_wire},
                      {"residual_wire_bytes", q.residual_wire}});
    sample["requests"] = reqs;
    if (first_res > 0) {
      // Progressive: did every request reach ANCHOR_READY before the first
      // residual of any of them began to be applied?
      const double margin_us = static_cast<double>(first_res - ta) * 1e-3;
      sample["anchors_first_margin_us"] = margin_us;
      ++af_batches_;
      if (first_res >= ta) ++af_ok_;
      if (af_batches_ == 1 || margin_us < af_worst_us_) af_worst_us_ = margin_us;
    }
    row.samples.push_back(sample);
    if (it >= p_.warmup) {
      row.ta.push_back(ta_us);
      row.tc.push_back(tc_us);
    }
    const CodecCase& cc = p_.codecs[ci];
    const bool lynx_prog = cc.cfg.codec == KVXFER_CODEC_LYNX && cc.mode == KVXFER_MODE_PROGRESSIVE;
    const int rank = lynx_prog ? 2 : cc.mode == KVXFER_MODE_PROGRESSIVE ? 1 : 0;
    if (!b.arrivals.empty() && rank >= timeline_rank_) {
      timeline_rank_ = rank;
      json arr = json::array();
      for (const ArrivalRec& a : b.arrivals)
        arr.push_back({{"t_us", static_cast<double>(a.t_ns - t0) * 1e-3},
                       {"class", a.traffic_class == 0 ? "anchor" : "residual"},
                       {"layer", a.layer},
                       {"request", a.request},
                       {"bytes", a.bytes}});
      json marks = json::array();
      for (const RecvReq& q : b.reqs)
        marks.push_back(
            {{"t_anchor_ready_us", static_cast<double>(q.t_anchor - t0) * 1e-3},
             {"t_complete_us", static_cast<double>(q.t_complete - t0) * 1e-3},
             {"t_first_residual_us", q.t_first_residual > 0
                                         ? json(static_cast<double>(q.t_first_residual - t0) * 1e-3)
                                         : json(nullptr)}});
      timeline_ = {{"codec", codec_name(cc.cfg.codec)},
                   {"mode", mode_name(cc.mode)},
                   {"name", cc.name},
                   {"size_bytes", p_.sizes[si].kv_bytes},
                   {"tokens", p_.sizes[si].tokens},
                   {"requests", b.reqs.size()},
                   {"iteration", it},
                   {"t_anchor_us", ta_us},
                   {"t_complete_us", tc_us},
                   {"arrivals", arr},
                   {"per_request", marks}};
    }
  }

  /** Prints the row of (si, ci) once all its iterations are in. */
  void finish_row(size_t si, size_t ci) {
    Row& row = rows_[si * p_.codecs.size() + ci];
    if (row.tc.empty()) return;
    const CodecCase& cc = p_.codecs[ci];
    const SizePoint& sp = p_.sizes[si];
    row.sta = kp::summarize(row.ta);
    row.stc = kp::summarize(row.tc);
    row.done = true;
    const double R = p_.requests;
    const double alg = kp::gbps(R * static_cast<double>(sp.kv_bytes), row.stc.median_us);
    const double wire = kp::gbps(R * static_cast<double>(row.wire), row.stc.median_us);
    if (row.wrong > 0) wrong_total_ += static_cast<uint64_t>(row.wrong);
    std::printf(
        "%s\n",
        table_
            .row({std::to_string(sp.kv_bytes), std::to_string(sp.tokens), std::to_string(row.pages),
                  codec_name(cc.cfg.codec), mode_name(cc.mode), cc.params,
                  std::to_string(row.anchor_wire), std::to_string(row.wire),
                  kp::strprintf("%.1f", row.sta.median_us),
                  kp::strprintf("%.1f", row.stc.median_us), kp::strprintf("%.2f", alg),
                  kp::strprintf("%.2f", wire), row.wrong < 0 ? "N/A" : std::to_string(row.wrong)})
            .c_str());
    std::fflush(stdout);
    jrows_.push_back({{"size_requested", sp.requested},
                      {"kv_bytes", sp.kv_bytes},
                      {"tokens", sp.tokens},
                      {"pages", row.pages},
                      {"requests", p_.requests},
                      {"name", cc.name},
                      {"codec", codec_name(cc.cfg.codec)},
                      {"mode", mode_name(cc.mode)},
                      {"params", cc.params},
                      {"config",
                       {{"alpha", cc.cfg.alpha},
                        {"chunk_tokens", cc.cfg.chunk_tokens},
                        {"anchor_bits", cc.cfg.anchor_bits}}},
                      {"anchor_wire_bytes", row.anchor_wire},
                      {"residual_wire_bytes", row.wire - row.anchor_wire},
                      {"wire_bytes", row.wire},
                      {"t_anchor", kp::to_json(row.sta)},
                      {"t_complete", kp::to_json(row.stc)},
                      {"algbw_gbps", alg},
                      {"wirebw_gbps", wire},
                      {"wrong", row.wrong < 0 ? json(nullptr) : json(row.wrong)},
                      {"samples", row.samples}});
  }

  /** Ratio lines, the anchors-first line and the footer.  Returns the exit status. */
  int footer(bool run_failed) {
    const Row* lynx = nullptr;
    json ratios = json::array();
    bool header_done = false;
    for (size_t si = 0; si < p_.sizes.size(); ++si) {
      lynx = find(si, KVXFER_CODEC_LYNX, KVXFER_MODE_PROGRESSIVE);
      const Row* int8 = find(si, KVXFER_CODEC_INT8, KVXFER_MODE_MONOLITHIC);
      if (lynx == nullptr || int8 == nullptr || int8->stc.median_us <= 0) continue;
      const double ra = lynx->sta.median_us / int8->stc.median_us;
      const double rc = lynx->stc.median_us / int8->stc.median_us;
      if (!header_done) {
        std::printf(
            "# Ratios to INT8 monolithic (medians, same size): t_anchor(lynx)/t_complete(int8)  "
            "t_complete(lynx)/t_complete(int8)\n");
        header_done = true;
      }
      std::printf("#   %10" PRIu64 " B: %.3f  %.3f\n", p_.sizes[si].kv_bytes, ra, rc);
      ratios.push_back({{"kv_bytes", p_.sizes[si].kv_bytes},
                        {"anchor_lynx_over_complete_int8", ra},
                        {"complete_lynx_over_complete_int8", rc}});
    }
    if (!header_done)
      std::printf("# Ratios to INT8 monolithic: n/a (-m needs both lynx and int8)\n");
    // The same two ratios for SpectrumKV (kvxfer_send's default policy), when -m has it.
    bool spectrum_header = false;
    for (size_t si = 0; si < p_.sizes.size(); ++si) {
      const Row* sp = find(si, KVXFER_CODEC_SPECTRUM, KVXFER_MODE_PROGRESSIVE);
      const Row* int8 = find(si, KVXFER_CODEC_INT8, KVXFER_MODE_MONOLITHIC);
      if (sp == nullptr || int8 == nullptr || int8->stc.median_us <= 0) continue;
      const double ra = sp->sta.median_us / int8->stc.median_us;
      const double rc = sp->stc.median_us / int8->stc.median_us;
      if (!spectrum_header) {
        std::printf(
            "# Ratios to INT8 monolithic (medians, same size): t_anchor(spectrum)/t_complete(int8) "
            " "
            "t_complete(spectrum)/t_complete(int8)\n");
        spectrum_header = true;
      }
      std::printf("#   %10" PRIu64 " B: %.3f  %.3f\n", p_.sizes[si].kv_bytes, ra, rc);
      ratios.push_back({{"kv_bytes", p_.sizes[si].kv_bytes},
                        {"anchor_spectrum_over_complete_int8", ra},
                        {"complete_spectrum_over_complete_int8", rc}});
    }
    json af = {{"batches", af_batches_},
               {"batches_ok", af_ok_},
               {"worst_margin_us", af_batches_ ? json(af_worst_us_) : json(nullptr)},
               {"result", af_batches_ == 0        ? "n/a"
                          : af_ok_ == af_batches_ ? "yes"
                                                  : "no"}};
    if (p_.requests > 1) {
      if (af_batches_ == 0)
        std::printf(
            "# Anchors of all requests landed before any residual was applied: n/a (no progressive "
            "codec in -m)\n");
      else
        std::printf(
            "# Anchors of all requests landed before any residual was applied: %s  (%d of %d "
            "progressive batches of %d requests; worst margin %+.1f us)\n",
            af_ok_ == af_batches_ ? "yes" : "no", af_ok_, af_batches_, p_.requests, af_worst_us_);
    }
    // Checked only where a batch completed and its blocks were compared.
    const bool checked = o_.common.check != 0 && batches_checked_ > 0;
    const bool ok = !failed_ && !run_failed && wrong_total_ == 0;
    std::printf("# Wrong bytes : %" PRIu64 " %s\n", wrong_total_,
                o_.common.check == 0 ? "(not checked)"
                : !checked           ? "(not checked: no batch completed)"
                : wrong_total_ == 0  ? "OK"
                                     : "FAILED");
    std::printf("# Transfers   : %s\n", failed_ || run_failed ? "FAILED (see stderr)" : "OK");
    std::fflush(stdout);
    summary_ = {{"ok", ok},
                {"failed", failed_ || run_failed},
                {"wrong_bytes", checked ? json(wrong_total_) : json(nullptr)}};
    ratios_ = ratios;
    anchors_first_ = af;
    if (failed_ || run_failed) return 2;
    return wrong_total_ > 0 ? 1 : 0;
  }

  json to_json() const {
    return {{"rows", jrows_},
            {"ratios", ratios_},
            {"anchors_first", anchors_first_},
            {"timeline", timeline_},
            {"summary", summary_}};
  }

 private:
  struct Row {
    int64_t pages = 0;
    uint64_t kv_bytes = 0, anchor_wire = 0, wire = 0;
    int64_t wrong = -1;
    std::vector<double> ta, tc;
    kp::Stats sta, stc;
    json samples = json::array();
    bool done = false;
  };
  const Row* find(size_t si, kvxfer_codec_t c, kvxfer_mode_t m) const {
    for (size_t ci = 0; ci < p_.codecs.size(); ++ci) {
      const CodecCase& cc = p_.codecs[ci];
      const Row& r = rows_[si * p_.codecs.size() + ci];
      if (cc.cfg.codec == c && cc.mode == m && r.done) return &r;
    }
    return nullptr;
  }

  const Options& o_;
  const Plan& p_;
  kp::Table table_;
  std::vector<Row> rows_;
  json jrows_ = json::array(), ratios_ = json::array(), anchors_first_, summary_;
  json timeline_ = nullptr;
  int timeline_rank_ = 0;
  int af_batches_ = 0, af_ok_ = 0;
  double af_worst_us_ = 0;
  uint64_t wrong_total_ = 0;
  int64_t batches_checked_ = 0;  // batches whose receiver blocks were compared
  bool failed_ = false;
};

// ---------------------------------------------------------------------------
// Output around the table
// ---------------------------------------------------------------------------
std::string options_line(const Options& o, const Plan& p) {
  std::string codecs;
  for (const CodecCase& c : p.codecs) codecs += (codecs.empty() ? "" : ",") + c.name;
  return kp::strprintf(
      "# Options: -b %" PRIu64 " -e %" PRIu64
      " -f %d -w %d -n %d -c %d -m %s -r %s -R %d%s%s | "
      "%s | time = median of -n batches, CLOCK_MONOTONIC",
      o.min_b, o.max_b, o.factor, p.warmup, p.iters, o.common.check, codecs.c_str(),
      o.rate_given ? (o.rate.empty() ? "''" : o.rate.c_str()) : "(KVXFER_RATE_LIMIT)", p.requests,
      o.stories ? " --stories" : "", o.engine_only ? " --engine_only" : "",
      o.fork_mode() ? "receiver = forked child (rank 1), sender = this process (rank 0)"
                    : kp::strprintf("cross-host: this is rank %d (%s)", o.rank,
                                    o.rank == 0 ? "sender" : "receiver")
                          .c_str());
}

std::string data_line(const Options& o, const Plan& p, int stories_T) {
  const Shape& s = p.shape;
  const std::string shape =
      kp::strprintf("%d layers x K,V x %d KV heads x %d head_dim, %s = %" PRIu64 " B per token",
                    s.layers, s.kv_heads, s.head_dim, dtype_name(s.dtype), s.bytes_per_token());
  const std::string layout =
      kp::strprintf("blocks of %d tokens, pages of %d tokens", p.block, p.page_tokens);
  if (o.stories)
    return kp::strprintf(
        "# Data: stories260K KV (%s; greedy from BOS, then prefill; %d real tokens, tiled: token "
        "t of request r is real token (t + 97 r) mod %d) | %s | %s",
        o.model_path.c_str(), stories_T, stories_T, shape.c_str(), layout.c_str());
  return kp::strprintf(
      "# Data: synthetic Llama-3-8B-like KV (models/synthetic_kv.h, seed 1 + request, rope_theta "
      "500000, 4 outlier key pairs at 100x) | %s | %s",
      shape.c_str(), layout.c_str());
}

json options_json(const Options& o, const Plan& p) {
  json codecs = json::array();
  for (const CodecCase& c : p.codecs) codecs.push_back(c.name);
  return {{"minbytes", o.min_b},
          {"maxbytes", o.max_b},
          {"stepfactor", o.factor},
          {"warmup_iters", p.warmup},
          {"iters", p.iters},
          {"check", o.common.check},
          {"engine_only", o.engine_only},
          {"codecs", codecs},
          {"rate_limit", o.rate_given ? json(o.rate) : json(nullptr)},
          {"requests", p.requests},
          {"layers", p.shape.layers},
          {"kv_heads", p.shape.kv_heads},
          {"head_dim", p.shape.head_dim},
          {"dtype", dtype_name(p.shape.dtype)},
          {"bytes_per_token", p.shape.bytes_per_token()},
          {"block_tokens", p.block},
          {"page_tokens", p.page_tokens},
          {"chunk_tokens", o.chunk},
          {"anchor_bits", o.anchor_bits},
          {"stories", o.stories},
          {"model", o.stories ? json(o.model_path) : json(nullptr)},
          {"timeout_ms", o.timeout_eff_ms},
          {"mode", o.fork_mode() ? "fork" : "cross-host"},
          {"rank", o.rank},
          {"quick", o.common.quick},
          {"time_statistic", "median"},
          {"t0", o.fork_mode() ? "max(sender's first kvxfer_send post, receiver's last "
                                 "kvxfer_recv post)"
                               : "receiver's last kvxfer_recv post"}};
}

std::string setting(const std::vector<kp::Setting>& s, const char* name) {
  for (const kp::Setting& x : s)
    if (x.name == name) return x.value;
  return "";
}

kvxfer_comm_t init_comm(const Options& o, const kvxfer_unique_id_t& id, int rank,
                        std::string* err) {
  kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
  cfg.timeout_ms = o.timeout_ms;
  cfg.rate_limit = o.rate_given ? o.rate.c_str() : nullptr;
  kvxfer_comm_t comm = nullptr;
  std::shared_ptr<kvxfer::xfer::TestHooks> hooks;
  if (o.engine_only) {  // codec jobs do no work (xfer/test_hooks.h)
    hooks = std::make_shared<kvxfer::xfer::TestHooks>();
    hooks->skip_codec = true;
  }
  const kvxfer_result_t rc = kvxfer::api::comm_init(&comm, 2, id, rank, &cfg, hooks);
  if (rc < 0) {
    *err = api_error(kp::strprintf("kvxfer_comm_init (rank %d)", rank), rc);
    return nullptr;
  }
  return comm;
}

json base_json(const Options& o, const Plan& p, const kp::MachineInfo& m,
               const std::vector<kp::Setting>& settings) {
  return {{"tool", kTool},
          {"kvxfer_version", KVXFER_VERSION_CODE},
          {"machine", kp::to_json(m)},
          {"settings", kp::to_json(settings)},
          {"options", options_json(o, p)}};
}

int write_json(const Options& o, const json& j) {
  return kp::emit_json(kTool, o.common.json_path, j);
}

// ---------------------------------------------------------------------------
// Fork mode: this process is rank 0 (sender) and prints; the child is rank 1.
// ---------------------------------------------------------------------------
int run_fork(const Options& o, const Plan& p, const json& jbase) {
  kvxfer_unique_id_t id{};
  kvxfer_result_t rc = kvxfer_get_unique_id(&id);
  if (rc < 0) {
    std::fprintf(stderr, "%s: %s\n", kTool, api_error("kvxfer_get_unique_id", rc).c_str());
    return 2;
  }
  int up[2];
  if (::pipe(up) != 0) {
    std::fprintf(stderr, "%s: pipe: %s\n", kTool, std::strerror(errno));
    return 2;
  }
  // Fork before any codec (OpenMP) work in this process: a child forked
  // after OpenMP started may hang in it.
  kp::ForkedChild child;
  std::string ferr;
  const bool started = child.start(
      [&] {
        ::close(up[0]);
        const int wr = up[1];
        std::string err;
        kvxfer_comm_t comm = init_comm(o, id, 1, &err);
        if (comm == nullptr) {
          send_msg(wr, kMsgFatal, err.data(), err.size());
          return 2;
        }
        PipeBarrier barrier(wr, -1);
        const int st = run_receiver(
            o, p, comm, &barrier, [&child] { return child.parent_alive(); },
            [wr](size_t, size_t, int, const Batch& b) {
              const std::vector<uint8_t> bytes = b.serialize();
              return send_msg(wr, kMsgBatch, bytes.data(), bytes.size());
            });
        kvxfer_comm_destroy(comm);
        ::close(wr);
        std::fflush(stderr);
        return st;
      },
      &ferr);
  if (!started) {
    std::fprintf(stderr, "%s: %s\n", kTool, ferr.c_str());
    return 2;
  }
  ::close(up[1]);
  const int rd = up[0];

  std::string err;
  kvxfer_comm_t comm = init_comm(o, id, 0, &err);
  if (comm == nullptr) {
    std::fprintf(stderr, "%s: %s\n", kTool, err.c_str());
    // The child's own reason, if it has one.
    MsgType type;
    std::vector<uint8_t> msg;
    std::string unused;
    if (recv_msg(rd, &type, &msg, 200, &unused) && type == kMsgFatal)
      std::fprintf(stderr, "%s: receiver (rank 1): %s\n", kTool,
                   std::string(msg.begin(), msg.end()).c_str());
    child.kill();
    ::close(rd);
    return 2;
  }

  Report report(o, p);
  report.header();
  PipeBarrier barrier(-1, rd);
  bool reported_failure = false;
  const int st = run_sender(
      o, p, comm, &barrier, [&child] { return child.alive(); },
      [&](size_t si, size_t ci, int it, int64_t t_post, kvxfer_result_t src,
          const std::string& serr) {
        if (src != KVXFER_SUCCESS) {
          std::fprintf(stderr, "%s: sender (rank 0): %s\n", kTool, serr.c_str());
          reported_failure = true;
          if (t_post == 0) return false;  // nothing was posted: no batch will come
        }
        MsgType type;
        std::vector<uint8_t> msg;
        std::string perr;
        if (!recv_msg(rd, &type, &msg, src == KVXFER_SUCCESS ? kPipeWaitMs : 5000, &perr)) {
          std::fprintf(stderr, "%s: %s\n", kTool, perr.c_str());
          reported_failure = true;
          return false;
        }
        Batch b;
        if (type == kMsgFatal) {
          std::fprintf(stderr, "%s: receiver (rank 1): %s\n", kTool,
                       std::string(msg.begin(), msg.end()).c_str());
          reported_failure = true;
          return false;
        }
        if (type != kMsgBatch || !b.parse(msg)) {
          std::fprintf(stderr, "%s: malformed message from the receiver\n", kTool);
          reported_failure = true;
          return false;
        }
        if (!b.h.ok) {
          std::fprintf(stderr, "%s: receiver (rank 1): %s\n", kTool, b.error.c_str());
          reported_failure = true;
        }
        report.add(si, ci, it, b, t_post);
        if (it + 1 == p.iters_total()) report.finish_row(si, ci);
        return b.h.ok != 0;
      });
  kvxfer_comm_destroy(comm);
  const double grace_s = st == 0 ? 60.0 : 10.0;
  const bool exited = child.wait_for(grace_s);
  ::close(rd);
  bool run_failed = st != 0;
  if (st == 0 && !child.exited_ok()) {  // also after wait_for killed it
    if (!exited)
      std::fprintf(stderr, "%s: the receiver process did not end within %.0f s and was killed\n",
                   kTool, grace_s);
    else
      std::fprintf(stderr, "%s: the receiver process ended abnormally (%s)\n", kTool,
                   child.describe().c_str());
    run_failed = true;
  }
  if (run_failed && !reported_failure)
    std::fprintf(stderr, "%s: the run stopped early (see above)\n", kTool);
  int status = report.footer(run_failed);
  json j = jbase;
  j.update(report.to_json());
  if (write_json(o, j) != 0) status = 2;
  return status;
}

// ---------------------------------------------------------------------------
// Cross-host mode: --rank R --id FILE.
// ---------------------------------------------------------------------------
bool read_id_file(const std::string& path, int64_t wait_ms, kvxfer_unique_id_t* id,
                  std::string* err) {
  const int64_t end = mono_ns() + wait_ms * 1000000;
  for (;;) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && st.st_size == KVXFER_UNIQUE_ID_BYTES) {
      FILE* f = std::fopen(path.c_str(), "rb");
      if (f != nullptr) {
        const size_t n = std::fread(id->internal, 1, KVXFER_UNIQUE_ID_BYTES, f);
        std::fclose(f);
        if (n == KVXFER_UNIQUE_ID_BYTES) return true;
      }
    }
    if (mono_ns() > end) {
      *err = kp::strprintf("no %d-byte unique id appeared in %s within %" PRId64
                           " ms (start rank 0 first, or together)",
                           KVXFER_UNIQUE_ID_BYTES, path.c_str(), wait_ms);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

bool write_id_file(const std::string& path, const kvxfer_unique_id_t& id, std::string* err) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    *err = "cannot create " + tmp + ": " + std::strerror(errno);
    return false;
  }
  const bool ok = std::fwrite(id.internal, 1, KVXFER_UNIQUE_ID_BYTES, f) == KVXFER_UNIQUE_ID_BYTES;
  if (std::fclose(f) != 0 || !ok) {
    *err = "cannot write " + tmp;
    return false;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {  // rank 1 never sees a partial id
    *err = "cannot rename " + tmp + " to " + path + ": " + std::strerror(errno);
    return false;
  }
  return true;
}

int run_cross(const Options& o, const Plan& p, const json& jbase) {
  kvxfer_unique_id_t id{};
  std::string err;
  if (o.rank == 0) {
    const kvxfer_result_t rc = kvxfer_get_unique_id(&id);
    if (rc < 0) {
      std::fprintf(stderr, "%s: %s\n", kTool, api_error("kvxfer_get_unique_id", rc).c_str());
      return 2;
    }
    if (!write_id_file(o.id_file, id, &err)) {
      std::fprintf(stderr, "%s: %s\n", kTool, err.c_str());
      return 2;
    }
    std::printf("# rank 0: unique id written to %s; waiting for rank 1\n", o.id_file.c_str());
    std::fflush(stdout);
  } else if (!read_id_file(o.id_file, std::max<int64_t>(o.timeout_eff_ms, 60000), &id, &err)) {
    std::fprintf(stderr, "%s: %s\n", kTool, err.c_str());
    return 2;
  }
  kvxfer_comm_t comm = init_comm(o, id, o.rank, &err);
  if (o.rank == 0) std::remove(o.id_file.c_str());  // used: a later run must not read it
  if (comm == nullptr) {
    std::fprintf(stderr, "%s: %s\n", kTool, err.c_str());
    return 2;
  }
  const int64_t stall = 2 * o.timeout_eff_ms + 10000;
  XferBarrier barrier(comm, stall);
  int status = 0;
  if (o.rank == 0) {
    std::printf("# rank 0 (sender): the table is printed by rank 1 (the receiver)\n");
    std::fflush(stdout);
    int batches = 0;
    status = run_sender(
        o, p, comm, &barrier, [] { return true; },
        [&](size_t, size_t, int, int64_t, kvxfer_result_t rc, const std::string& serr) {
          if (rc != KVXFER_SUCCESS)
            std::fprintf(stderr, "%s: sender (rank 0): %s\n", kTool, serr.c_str());
          else
            ++batches;
          return rc == KVXFER_SUCCESS;
        });
    std::printf("# rank 0: %d batches of %d request(s) sent, %s\n", batches, p.requests,
                status == 0 ? "OK" : "FAILED");
  } else {
    Report report(o, p);
    report.header();
    const int st = run_receiver(
        o, p, comm, &barrier, [] { return true; },
        [&](size_t si, size_t ci, int it, const Batch& b) {
          if (!b.h.ok) std::fprintf(stderr, "%s: receiver (rank 1): %s\n", kTool, b.error.c_str());
          report.add(si, ci, it, b, 0);
          if (b.h.ok && it + 1 == p.iters_total()) report.finish_row(si, ci);
          return b.h.ok != 0;
        });
    status = report.footer(st != 0);
    json j = jbase;
    j.update(report.to_json());
    if (write_json(o, j) != 0) status = 2;
  }
  kvxfer_comm_destroy(comm);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  o.common.iters = 3;  // before registration: the default shown by --help
  CLI::App app{
      "kvxfer_perf: time to ANCHOR_READY and COMPLETE of kvxfer_send/kvxfer_recv between two "
      "processes, Lynx progressive against monolithic INT8/INT4/BF16 (columns defined in "
      "docs/PERFORMANCE.md)"};
  kp::add_common_options(&app, &o.common);
  const CLI::Validator size_check(
      [](std::string& s) {
        uint64_t v = 0;
        if (!parse_size(s, &v) || v == 0)
          return std::string("'") + s +
                 "' is not a size: a positive number of bytes, optionally with K, M, G or T "
                 "(powers of 1024), e.g. 8M";
        return std::string();
      },
      "SIZE");
  auto* b_opt = app.add_option("-b,--minbytes", o.minbytes, "smallest KV size (bytes of the KV)")
                    ->check(size_check)
                    ->capture_default_str();
  auto* e_opt = app.add_option("-e,--maxbytes", o.maxbytes, "largest KV size (bytes of the KV)")
                    ->check(size_check)
                    ->capture_default_str();
  app.add_option("-f,--stepfactor", o.factor, "multiply the size by this factor between rows")
      ->check(CLI::Range(2, 1024))
      ->capture_default_str();
  const CLI::Validator codec_check(
      [](std::string& s) {
        Options tmp;
        CodecCase c;
        const std::vector<std::string> names = split(s);
        if (names.empty()) return std::string("empty codec list");
        for (const std::string& n : names)
          if (!make_case(n, tmp, &c))
            return "unknown codec '" + n + "' (choose from " + kCodecChoices + ")";
        return std::string();
      },
      "LIST");
  app.add_option("-m,--codecs", o.codecs,
                 std::string("comma list of ") + kCodecChoices +
                     " (lynx and int8-prog progressive, the others monolithic)")
      ->check(codec_check)
      ->capture_default_str();
  auto* r_opt = app.add_option("-r,--rate_limit", o.rate,
                               "emulated link rate, tc syntax (1gbit, 500mbit, 100mbps = bytes/s; "
                               "'' = none); default: KVXFER_RATE_LIMIT");
  app.add_option("-R,--requests", o.requests, "requests in flight per batch")
      ->check(CLI::Range(1, 16384))
      ->capture_default_str();
  auto* l_opt = app.add_option("-L,--layers", o.layers, "model layers")
                    ->check(CLI::Range(1, 4096))
                    ->capture_default_str();
  auto* h_opt = app.add_option("--kv_heads", o.kv_heads, "KV heads")
                    ->check(CLI::Range(1, 65535))
                    ->capture_default_str();
  auto* d_opt = app.add_option("--head_dim", o.head_dim, "head dimension (even)")
                    ->check(CLI::Range(2, 65535))
                    ->capture_default_str();
  app.add_option("-d,--dtype", o.dtype, "KV dtype")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->capture_default_str();
  app.add_option("--block", o.block, "tokens per KV block (vLLM-style paging)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--page_tokens", o.page_tokens, "tokens per page; 0 = KVXFER_PAGE_TOKENS")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--chunk", o.chunk, "codec chunk_tokens (16, 32, 64, 128)")
      ->check(CLI::IsMember({16, 32, 64, 128}))
      ->capture_default_str();
  app.add_option("--anchor_bits", o.anchor_bits, "anchor bits of lynx and int8 (2..6)")
      ->check(CLI::Range(2, 6))
      ->capture_default_str();
  app.add_flag("--stories", o.stories,
               "take the KV from the stories260K model (shape from the model, tokens tiled)");
  app.add_option("--model", o.model_path, "llama2.c checkpoint for --stories")
      ->capture_default_str();
  app.add_flag("--engine_only", o.engine_only,
               "measure the engine and the wire alone: codec jobs do no work, sections carry "
               "whatever staging holds, nothing is checked (-c 0); both ranks need it");
  auto* rank_opt = app.add_option("--rank", o.rank,
                                  "cross-host mode: this process is rank 0 (sender) or 1 "
                                  "(receiver); needs --id")
                       ->check(CLI::Range(0, 1));
  auto* id_opt =
      app.add_option("--id", o.id_file,
                     "cross-host mode: file for the 128-byte unique id (rank 0 writes, rank 1 "
                     "reads)");
  rank_opt->needs(id_opt);
  id_opt->needs(rank_opt);
  app.add_option("--timeout_ms", o.timeout_ms,
                 "communicator and transfer inactivity timeout; 0 = KVXFER_TIMEOUT_MS")
      ->check(CLI::Range(0, 86400000))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  o.rate_given = r_opt->count() > 0;
  if (o.engine_only) o.common.check = 0;  // the receiver's blocks are undefined
  if (o.common.quick) {
    if (b_opt->count() == 0) o.minbytes = "2M";
    if (e_opt->count() == 0) o.maxbytes = "8M";
    if (app.count("-n") == 0) o.common.iters = 2;
  }
  parse_size(o.minbytes, &o.min_b);
  parse_size(o.maxbytes, &o.max_b);
  if (o.min_b > o.max_b) {
    std::fprintf(stderr, "%s: -b %s is larger than -e %s\n", kTool, o.minbytes.c_str(),
                 o.maxbytes.c_str());
    return 2;
  }
  o.dt = o.dtype == "bf16"   ? KVXFER_DTYPE_BF16
         : o.dtype == "fp16" ? KVXFER_DTYPE_FP16
                             : KVXFER_DTYPE_FP32;

  // Every kvxfer call fails on a malformed KVXFER_* environment: say so first.
  int version = 0;
  if (kvxfer_result_t vr = kvxfer_get_version(&version); vr < 0) {
    std::fprintf(stderr, "%s: %s\n", kTool, api_error("KVXFER_* environment check", vr).c_str());
    return 2;
  }
  const kp::MachineInfo mach = kp::machine_info();
  const std::vector<kp::Setting> settings = kp::kvxfer_settings();
  o.page_tokens_eff = o.page_tokens > 0
                          ? o.page_tokens
                          : std::atoi(setting(settings, "KVXFER_PAGE_TOKENS").c_str());
  o.timeout_eff_ms =
      o.timeout_ms > 0 ? o.timeout_ms : std::atoll(setting(settings, "KVXFER_TIMEOUT_MS").c_str());
  if (o.page_tokens_eff <= 0) o.page_tokens_eff = 256;
  if (o.timeout_eff_ms <= 0) o.timeout_eff_ms = 30000;

  Plan p;
  p.warmup = o.common.warmup;
  p.iters = o.common.iters;
  p.requests = o.requests;
  p.page_tokens = o.page_tokens_eff;
  p.block = o.block;
  p.shape.layers = o.layers;
  p.shape.kv_heads = o.kv_heads;
  p.shape.head_dim = o.head_dim;
  p.shape.dtype = o.dt;
  int stories_T = 0;
  if (o.stories) {
    if (l_opt->count() + h_opt->count() + d_opt->count() > 0) {
      std::fprintf(stderr,
                   "%s: --stories takes the KV shape from the model; drop -L, --kv_heads and "
                   "--head_dim\n",
                   kTool);
      return 2;
    }
    std::string err;
    if (!read_model_shape(o.model_path, &p.shape, &stories_T, &err)) {
      std::fprintf(stderr, "%s: --stories: %s\n", kTool, err.c_str());
      return 2;
    }
  } else {
    std::string err;
    SyntheticSource probe(p.shape);
    if (!km::validate_synthetic_kv_spec(probe.spec(), &err)) {
      std::fprintf(stderr, "%s: the synthetic KV cannot take this shape: %s\n", kTool, err.c_str());
      return 2;
    }
  }
  if (static_cast<int64_t>(p.shape.kv_heads) * p.shape.head_dim > 65535) {
    std::fprintf(stderr, "%s: --kv_heads x --head_dim = %d exceeds 65535 channels\n", kTool,
                 p.shape.kv_heads * p.shape.head_dim);
    return 2;
  }
  for (const std::string& n : split(o.codecs)) {
    CodecCase c;
    make_case(n, o, &c);
    p.codecs.push_back(c);
  }
  const uint64_t bpt = p.shape.bytes_per_token();
  for (const uint64_t s : kp::size_sweep(o.min_b, o.max_b, static_cast<uint64_t>(o.factor))) {
    SizePoint sp;
    sp.requested = s;
    sp.tokens = static_cast<int64_t>(s / bpt);
    sp.kv_bytes = static_cast<uint64_t>(sp.tokens) * bpt;
    if (sp.tokens == 0) {
      std::fprintf(stderr,
                   "%s: size %" PRIu64 " B holds no whole token (%" PRIu64
                   " B per token with this shape); raise -b\n",
                   kTool, s, bpt);
      return 2;
    }
    if (sp.tokens > INT32_MAX) {
      std::fprintf(stderr, "%s: size %" PRIu64 " B is too large\n", kTool, s);
      return 2;
    }
    if (p.sizes.empty() || p.sizes.back().tokens != sp.tokens) p.sizes.push_back(sp);
  }

  kp::print_preamble(stdout, kTool, mach, settings);
  std::printf("%s\n", options_line(o, p).c_str());
  std::printf("%s\n", data_line(o, p, stories_T).c_str());
  std::printf(
      "# Times: from %s to the receiver's ANCHOR_READY (t_anchor) and COMPLETE (t_complete)%s; "
      "algbw = %ssize / t_complete; wirebw = %swire / t_complete\n",
      o.fork_mode() ? "the later of the two posts (sender's kvxfer_send, receiver's kvxfer_recv)"
                    : "the receiver's kvxfer_recv post",
      p.requests > 1 ? kp::strprintf(" of the last of the %d requests", p.requests).c_str() : "",
      p.requests > 1 ? "R x " : "", p.requests > 1 ? "R x " : "");
  std::printf("#\n");
  std::fflush(stdout);

  json jbase = base_json(o, p, mach, settings);
  if (o.stories)
    jbase["data"] = {{"source", "stories260K"},
                     {"model_path", o.model_path},
                     {"real_tokens", stories_T},
                     {"tiling", "token t of request r = real token (t + 97 r) mod real_tokens"}};
  else
    jbase["data"] = {{"source", "synthetic"},
                     {"generator", "models/synthetic_kv.h"},
                     {"seed", "1 + request index"},
                     {"rope_theta", 500000}};
  signal(SIGPIPE, SIG_IGN);
  return o.fork_mode() ? run_fork(o, p, jbase) : run_cross(o, p, jbase);
}
