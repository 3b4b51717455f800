// kvxfer_perf: the product benchmark of kvxfer_send / kvxfer_recv, in the
// nccl-tests dialect.  Every column and formula is defined in
// docs/PERFORMANCE.md, section "kvxfer_perf"; run with no arguments for the
// default report.
//
// Two processes move a paged KV cache (Llama-3-8B-like by default) from rank 0
// (the sender) to rank 1 (the receiver) through the public API
// (include/kvxfer/kvxfer.h), once per KV size (-b/-e/-f) and codec (-m):
// Lynx 4+4 progressive, and the monolithic baselines INT8, INT4 and BF16, all
// in one table from the same run.  The times are the receiver's
// ANCHOR_READY and COMPLETE, measured from the later of the two posts.  With
// -c 1 every received byte is compared with the codec's own decode of what
// was sent (#wrong).
//
// One parameter reaches past the public API: --engine_only creates the
// communicator with kvxfer::api::comm_init (api/xfer_api.h) and the engine's
// TestHooks::skip_codec, so that codec jobs do no work and the engine and the
// wire are timed alone (nothing is checked).  Without it, the communicator is
// the one kvxfer_comm_init makes.
//
// By default the receiver is a forked child of this process and reports to
// the parent over a pipe; with --rank R --id FILE the two ranks run as two
// separate commands (for example on two hosts).  The rendezvous, the barrier,
// the KV and the report are shared code in perf/common (rendezvous.h,
// xfer_kv.h, xfer_report.h); this file holds the options and the two ranks.
#include "kvxfer/kvxfer.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "api/xfer_api.h"
#include "models/synthetic_kv.h"
#include "perf/common/harness.h"
#include "perf/common/rendezvous.h"
#include "perf/common/xfer_kv.h"
#include "perf/common/xfer_plan.h"
#include "perf/common/xfer_report.h"

namespace {

namespace kp = kvxfer::perf;
namespace km = kvxfer::model;
using nlohmann::json;

constexpr const char* kTool = "kvxfer_perf";
// The writer of the pipe in fork mode, as pipe errors name it.
constexpr const char* kPeer = "the receiver process";

// perf/common: the plan (xfer_plan.h), the KV (xfer_kv.h), the rendezvous
// (rendezvous.h) and the report (xfer_report.h).
using namespace kp;  // NOLINT(google-build-using-namespace)

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
  /** The watchdog of a batch (wait_all): twice the transfer timeout, plus 10 s. */
  int64_t stall_ms() const { return 2 * timeout_eff_ms + 10000; }
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
        rc = settle(comm, reqs, rc, o.stall_ms(), peer_alive, &err);
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
        rc = settle(comm, reqs, rc, o.stall_ms(), peer_alive, &err);
        std::string berr;
        if (rc == KVXFER_SUCCESS && !barrier->receiver_done(&berr)) {
          rc = KVXFER_ERR_SYSTEM;
          err = berr;
        }
        const bool last = it + 1 == p.iters_total();
        for (size_t r = 0; r < reqs.size(); ++r) {
          kvxfer_request_info_t i = KVXFER_REQUEST_INFO_INITIALIZER;
          kvxfer_request_get_info(reqs[r], &i);
          b.reqs.push_back(RecvReq::of(i));
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
    uint32_t type;
    std::vector<uint8_t> msg;
    std::string unused;
    if (recv_msg(rd, &type, &msg, 200, kPeer, &unused) && type == kMsgFatal)
      std::fprintf(stderr, "%s: receiver (rank 1): %s\n", kTool,
                   std::string(msg.begin(), msg.end()).c_str());
    child.kill();
    ::close(rd);
    return 2;
  }

  Report report(o.common.check, p);
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
        uint32_t type;
        std::vector<uint8_t> msg;
        std::string perr;
        if (!recv_msg(rd, &type, &msg, src == KVXFER_SUCCESS ? kPipeWaitMs : 5000, kPeer, &perr)) {
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
  XferBarrier barrier(comm, o.stall_ms());
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
    Report report(o.common.check, p);
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

static int run(int argc, char** argv) {
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
          if (!make_case(n, tmp.chunk, tmp.anchor_bits, &c))
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
               "whatever staging holds, nothing is checked (-c 0); both ranks need it.  The one "
               "parameter past the public API: the engine's TestHooks::skip_codec, set through "
               "api/xfer_api.h");
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
    make_case(n, o.chunk, o.anchor_bits, &c);
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

int main(int argc, char** argv) {
  return kp::guarded_main(kTool, [&] { return run(argc, argv); });
}
