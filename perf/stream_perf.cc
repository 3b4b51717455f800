// stream_perf: sends that stream layer by layer (kvxfer_request_config_t
// stream_layers, kvxfer_send_layer_ready) against the same send posted after
// the last layer, as a prefill produces its KV.  docs/PERFORMANCE.md,
// "perf/stream_perf", defines every column.
//
// This process is rank 0, the sender: a synthetic prefill writes one layer of
// a Llama-3-8B-like KV (perf/common/kv_data.h) every --layer_ms ms into the
// KV the send reads.  A forked child is rank 1, the receiver: it posts its
// receive first, then reports the request's times (CLOCK_MONOTONIC, the same
// clock in both processes) and the bytes that differ from the codec's own
// decode of the sender's values (#wrong).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/fdio.h"
#include "common/units.h"
#include "kvxfer/kvxfer.h"
#include "perf/common/harness.h"
#include "perf/common/kv_data.h"
#include "perf/common/whole_kv.h"

namespace {

namespace kp = kvxfer::perf;
namespace km = kvxfer::model;
using nlohmann::json;

constexpr const char* kTool = "stream_perf";
constexpr uint64_t kTag = 11;

struct Options {
  kp::CommonOptions common;
  std::string rate = "10gbit";
  std::string codecs = "bf16,lynx";
  int layers = 32;
  int64_t tokens = 512;  // 32 layers x K,V x 512 x 8 x 128 x 2 B = 64 MiB
  double layer_ms = 2.0;
  int timeout_ms = 30000;
};

using Kv = kp::WholeKv;

bool fill(Kv* kv) {
  const km::SyntheticKVSpec spec = kp::llama3_8b_like_spec(kv->L);
  std::vector<float> tmp(static_cast<size_t>(kv->T) * kv->H());
  std::string err;
  for (int l = 0; l < kv->L; ++l)
    for (int kind = 0; kind < 2; ++kind) {
      if (!km::fill_synthetic_kv(spec, l, static_cast<km::KVKind>(kind), 0, kv->T, tmp.data(), 0,
                                 &err)) {
        std::fprintf(stderr, "%s: synthetic KV: %s\n", kTool, err.c_str());
        return false;
      }
      auto& dst = kind == 0 ? kv->k[l] : kv->v[l];
      for (size_t i = 0; i < tmp.size(); ++i) dst[i] = kp::bf16_of(tmp[i]);
    }
  return true;
}

kvxfer_codec_config_t codec_of(const std::string& name) {
  kvxfer_codec_config_t c = KVXFER_CODEC_CONFIG_INITIALIZER;
  if (name == "bf16") c.codec = KVXFER_CODEC_BF16;
  if (name == "int8") c.codec = KVXFER_CODEC_INT8;
  return c;  // lynx: the default, 4 + 4
}

// One line per request from the receiver.
struct Report {
  int32_t result;
  int64_t t_anchor_ns, t_complete_ns;
  uint64_t anchor_wire, residual_wire, wrong;
};

kvxfer_comm_t init_comm(const Options& o, const kvxfer_unique_id_t& id, int rank) {
  std::string err;
  kvxfer_comm_t comm = kp::init_comm(id, 2, rank, o.rate, o.timeout_ms, &err);
  if (comm == nullptr) std::fprintf(stderr, "%s: %s\n", kTool, err.c_str());
  return comm;
}

/** The receiver: for each codec byte `c` from the parent, one receive, then its Report. */
int receiver(const Options& o, const kvxfer_unique_id_t& id, int rd, int wr,
             const std::vector<std::string>& codecs) {
  kvxfer_comm_t comm = init_comm(o, id, 1);
  if (comm == nullptr) return 2;
  Kv src(o.layers, o.tokens);
  if (!fill(&src)) return 2;
  std::vector<Kv> want;
  for (const std::string& c : codecs) {
    want.emplace_back(o.layers, o.tokens);
    std::string err;
    if (!kp::expected_decode(src, codec_of(c), 256, kTag, &want.back(), &err)) {
      std::fprintf(stderr, "%s: expected pages: %s\n", kTool, err.c_str());
      return 2;
    }
  }
  Kv dst(o.layers, o.tokens);
  uint8_t which;
  while (kvxfer::fdio::read_all(rd, &which, 1, -1) && which != 0xFF) {
    kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
    rc.tag = kTag;
    kvxfer_request_t req = nullptr;
    for (auto& l : dst.k) std::fill(l.begin(), l.end(), 0xA5A5);
    for (auto& l : dst.v) std::fill(l.begin(), l.end(), 0xA5A5);
    Report rep{};
    if (kvxfer_recv(comm, 0, &dst.desc, &rc, &req) < 0) {
      rep.result = -100;
      kvxfer::fdio::write_all(wr, &rep, sizeof(rep));
      continue;
    }
    kvxfer::fdio::write_all(wr, &which, 1);  // posted
    rep.result = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, o.timeout_ms * 2);
    kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
    kvxfer_request_get_info(req, &info);
    rep.t_anchor_ns = info.t_anchor_ready_ns;
    rep.t_complete_ns = info.t_complete_ns;
    rep.anchor_wire = info.anchor_wire_bytes;
    rep.residual_wire = info.residual_wire_bytes;
    rep.wrong = want[which].differing(dst);
    kvxfer_request_free(req);
    kvxfer::fdio::write_all(wr, &rep, sizeof(rep));
  }
  kvxfer_comm_destroy(comm);
  return 0;
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

struct Sample {
  double anchor_ms, complete_ms;  // after the last layer was ready
  double layer_wire_ms, layer_anchor_ms;
  uint64_t wrong;
};

/**
 * One transfer: the prefill writes layer l at t0 + (l + 1) * layer_ms;
 * streamed, the send is posted at t0 and each layer marked as written;
 * else the send is posted once the last layer is written.
 */
bool one(const Options& o, kvxfer_comm_t comm, const Kv& src, Kv* kv, uint8_t which,
         const kvxfer_codec_config_t& cfg, bool streamed, double rate, int rd, int wr,
         Sample* out) {
  for (auto& l : kv->k) std::fill(l.begin(), l.end(), 0);
  for (auto& l : kv->v) std::fill(l.begin(), l.end(), 0);
  uint8_t ack;
  if (!kvxfer::fdio::write_all(wr, &which, 1) || !kvxfer::fdio::read_all(rd, &ack, 1, o.timeout_ms))
    return false;
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.tag = kTag;
  rc.stream_layers = streamed ? 1 : 0;
  kvxfer_request_t req = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  if (streamed && kvxfer_send(comm, 1, &kv->desc, &cfg, &rc, &req) < 0) return false;
  int64_t t_last = 0;
  for (int l = 0; l < o.layers; ++l) {
    std::this_thread::sleep_until(
        t0 + std::chrono::microseconds(static_cast<int64_t>((l + 1) * o.layer_ms * 1000)));
    std::memcpy(kv->k[l].data(), src.k[l].data(), src.layer_bytes());
    std::memcpy(kv->v[l].data(), src.v[l].data(), src.layer_bytes());
    t_last = now_ns();
    if (streamed && kvxfer_send_layer_ready(req, l) < 0) return false;
  }
  if (!streamed && kvxfer_send(comm, 1, &kv->desc, &cfg, &rc, &req) < 0) return false;
  const kvxfer_result_t r = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, o.timeout_ms * 2);
  kvxfer_request_free(req);
  Report rep{};
  if (!kvxfer::fdio::read_all(rd, &rep, sizeof(rep), o.timeout_ms * 2)) return false;
  if (r != KVXFER_SUCCESS || rep.result != KVXFER_SUCCESS) {
    std::fprintf(stderr, "%s: transfer failed: sender %d, receiver %d\n", kTool, r, rep.result);
    return false;
  }
  out->anchor_ms = (rep.t_anchor_ns - t_last) * 1e-6;
  out->complete_ms = (rep.t_complete_ns - t_last) * 1e-6;
  out->layer_wire_ms =
      static_cast<double>(rep.anchor_wire + rep.residual_wire) / o.layers / rate * 1e3;
  out->layer_anchor_ms = static_cast<double>(rep.anchor_wire) / o.layers / rate * 1e3;
  out->wrong = rep.wrong;
  return true;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty()      ? 0
         : v.size() % 2 ? v[v.size() / 2]
                        : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

}  // namespace

static int run(int argc, char** argv) {
  Options o;
  CLI::App app{
      "stream_perf: layer-streamed sends against sends posted after the last layer "
      "(columns defined in docs/PERFORMANCE.md)"};
  kp::add_common_options(&app, &o.common);
  app.add_option("-r,--rate_limit", o.rate, "link emulation, tc syntax")->capture_default_str();
  app.add_option("--codec", o.codecs, "comma list of bf16,lynx,int8")->capture_default_str();
  app.add_option("--layers", o.layers, "layers of the KV")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--tokens", o.tokens, "tokens of the KV")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--layer_ms", o.layer_ms, "ms the synthetic prefill takes per layer")
      ->check(CLI::Range(0.0, 1000.0))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (o.common.quick) {
    o.layers = 8;
    o.common.iters = std::min(o.common.iters, 3);
  }
  double rate = 0;
  std::string why;
  if (!kvxfer::params::parse_rate(o.rate, &rate, &why) || rate <= 0) {
    std::fprintf(stderr, "%s: -r %s: %s\n", kTool, o.rate.c_str(),
                 rate <= 0 ? "a rate is needed (the bound is per byte of it)" : why.c_str());
    return 2;
  }
  const std::vector<std::string> codecs = kp::split(o.codecs);
  for (const std::string& c : codecs)
    if (c != "bf16" && c != "lynx" && c != "int8") {
      std::fprintf(stderr, "%s: unknown codec '%s'\n", kTool, c.c_str());
      return 2;
    }

  // Four KVs (the sender's source and copy, the receiver's source and
  // destination): refused here, not by the kernel's out-of-memory killer.
  const double need = 4.0 * 2.0 * o.layers * static_cast<double>(o.tokens) * 8 * 128 * 2;
  const uint64_t avail = kp::mem_available_bytes();
  if (avail > 0 && need > static_cast<double>(avail)) {
    std::fprintf(stderr,
                 "%s: --layers %d --tokens %" PRId64
                 " needs %.1f GiB for four copies of the KV, more than the %.1f GiB available\n",
                 kTool, o.layers, o.tokens, need / (1 << 30),
                 static_cast<double>(avail) / (1 << 30));
    return 2;
  }
  kvxfer_unique_id_t id{};
  if (kvxfer_get_unique_id(&id) < 0) {
    std::fprintf(stderr, "%s: kvxfer_get_unique_id: %s\n", kTool, kvxfer_get_last_error());
    return 2;
  }
  int down[2], up[2];
  if (::pipe(down) != 0 || ::pipe(up) != 0) return 2;
  // Fork before any OpenMP work (the synthetic KV) in this process.
  kp::ForkedChild child;
  std::string ferr;
  if (!child.start(
          [&] {
            ::close(down[1]);
            ::close(up[0]);
            return receiver(o, id, down[0], up[1], codecs);
          },
          &ferr)) {
    std::fprintf(stderr, "%s: %s\n", kTool, ferr.c_str());
    return 2;
  }
  ::close(down[0]);
  ::close(up[1]);
  const int rd = up[0], wr = down[1];

  kp::print_preamble(stdout, kTool, kp::machine_info(), kp::kvxfer_settings());
  Kv src(o.layers, o.tokens), kv(o.layers, o.tokens);
  const double kv_mib = 2.0 * o.layers * src.layer_bytes() / (1 << 20);
  std::printf("# Options: -r %s --codec %s --layers %d --tokens %" PRId64
              " --layer_ms %g -w %d -n %d | KV %.0f MiB (8 x 128 bf16), one layer every %g ms\n",
              o.rate.c_str(), o.codecs.c_str(), o.layers, o.tokens, o.layer_ms, o.common.warmup,
              o.common.iters, kv_mib, o.layer_ms);
  std::printf(
      "# after_last = t_stage - t_last_layer_ready (median ms): stage = COMPLETE for "
      "bf16 and int8, ANCHOR_READY for lynx;\n# bound = 1.15 x (one layer's wire bytes "
      "(lynx: anchor bytes) / rate) + 2 ms\n");
  kvxfer_comm_t comm = init_comm(o, id, 0);
  if (comm == nullptr || !fill(&src)) return 2;

  kp::Table table({{"codec", 5},
                   {"posted", 11},
                   {"t_anchor-last(ms)", 8},
                   {"t_complete-last(ms)", 8},
                   {"bound(ms)", 8},
                   {"met", 3},
                   {"#wrong", 6}});
  std::printf("%s\n", table.header().c_str());
  json rows = json::array();
  bool ok = true, all_met = true;
  uint64_t wrong_total = 0;
  for (size_t ci = 0; ci < codecs.size() && ok; ++ci) {
    const kvxfer_codec_config_t cfg = codec_of(codecs[ci]);
    const bool lynx = codecs[ci] == "lynx";
    for (bool streamed : {true, false}) {
      std::vector<double> a, c;
      Sample s{};
      uint64_t wrong = 0;
      for (int it = 0; it < o.common.warmup + o.common.iters; ++it) {
        if (!one(o, comm, src, &kv, static_cast<uint8_t>(ci), cfg, streamed, rate, rd, wr, &s)) {
          ok = false;
          break;
        }
        wrong += s.wrong;
        if (it < o.common.warmup) continue;
        a.push_back(s.anchor_ms);
        c.push_back(s.complete_ms);
      }
      if (!ok) break;
      const double bound = 1.15 * (lynx ? s.layer_anchor_ms : s.layer_wire_ms) + 2.0;
      const double got = lynx ? median(a) : median(c);
      const bool met = got <= bound;
      if (streamed) all_met &= met;
      wrong_total += wrong;
      std::printf("%s\n", table
                              .row({codecs[ci], streamed ? "streamed" : "after_last",
                                    kp::strprintf("%.2f", median(a)),
                                    kp::strprintf("%.2f", median(c)), kp::strprintf("%.2f", bound),
                                    streamed ? (met ? "yes" : "no") : "-", std::to_string(wrong)})
                              .c_str());
      std::fflush(stdout);
      rows.push_back({{"codec", codecs[ci]},
                      {"posted", streamed ? "streamed" : "after_last"},
                      {"anchor_after_last_ms", a},
                      {"complete_after_last_ms", c},
                      {"bound_ms", bound},
                      {"wrong", wrong}});
    }
  }
  const uint8_t quit = 0xFF;
  kvxfer::fdio::write_all(wr, &quit, 1);
  kvxfer_comm_destroy(comm);
  child.wait_for(30);
  std::printf("# Wrong elements: %" PRIu64 " %s\n", wrong_total,
              wrong_total == 0 ? "OK" : "FAILED");
  std::printf("# Streamed rows within their bound: %s\n", all_met ? "yes" : "no");
  const int json_rc =
      kp::emit_json(kTool, o.common.json_path, {{"tool", kTool}, {"rate", o.rate}, {"rows", rows}});
  if (!ok) return 2;
  if (wrong_total > 0) return 1;
  return json_rc;
}

int main(int argc, char** argv) {
  return kp::guarded_main(kTool, [&] { return run(argc, argv); });
}
