// fanin_perf: several prefill processes send to one decode process at once;
// does every anchor of every request land before any residual is applied?
// docs/PERFORMANCE.md, "perf/fanin_perf", defines every column.
//
// This process is rank 0, the decode side: it posts every receive first.
// Ranks 1..P are forked prefill processes, each sending -R requests of
// --tokens tokens (Lynx 4+4) on the same emulated link rate.  The margin is
// the first residual applied on the decode side (any request) minus the last
// anchor applied there (any request): positive when every anchor came first.
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/fdio.h"
#include "kvxfer/kvxfer.h"
#include "perf/common/harness.h"
#include "perf/common/whole_kv.h"

namespace {

namespace kp = kvxfer::perf;
using nlohmann::json;

constexpr const char* kTool = "fanin_perf";
constexpr int32_t kLayers = 8, kPageTokens = 256;

struct Options {
  kp::CommonOptions common;
  std::string rate = "1gbit";
  int prefill = 4;
  int requests = 4;
  int64_t tokens = 1024;  // 8 layers x K,V x 1024 x 1024 x 2 B = 32 MiB per request
  int timeout_ms = 60000;
};

using Kv = kp::WholeKv;

/** KV-like bf16 values (per-channel scale, Gaussian), a function of `seed`. */
void fill(Kv* kv, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (int l = 0; l < kv->L; ++l)
    for (auto* t : {&kv->k[l], &kv->v[l]})
      for (size_t i = 0; i < t->size(); ++i)
        (*t)[i] = kp::bf16_of(g(rng) * (1.0f + 0.25f * static_cast<float>(i % 7)));
}

uint64_t seed_of(int rank, int request) { return 1000u * static_cast<uint64_t>(rank) + request; }

kvxfer_comm_t init_comm(const Options& o, const kvxfer_unique_id_t& id, int rank) {
  std::string err;
  kvxfer_comm_t comm = kp::init_comm(id, o.prefill + 1, rank, o.rate, o.timeout_ms, &err);
  if (comm == nullptr) std::fprintf(stderr, "%s: %s\n", kTool, err.c_str());
  return comm;
}

/**
 * A prefill process: makes its KV, says so on `wr`, waits for the decode
 * side's byte on `rd` (so that every prefill posts at once), posts -R sends
 * to rank 0 and waits for all of them.
 */
int prefill(const Options& o, const kvxfer_unique_id_t& id, int rank, int rd, int wr) {
  kvxfer_comm_t comm = init_comm(o, id, rank);
  if (comm == nullptr) return 2;
  std::vector<Kv> kv;
  for (int r = 0; r < o.requests; ++r) {
    kv.emplace_back(kLayers, o.tokens);
    fill(&kv.back(), seed_of(rank, r));
  }
  char b = 'r';
  if (!kvxfer::fdio::write_all(wr, &b, 1) || !kvxfer::fdio::read_all(rd, &b, 1, o.timeout_ms))
    return 5;
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.page_tokens = kPageTokens;
  std::vector<kvxfer_request_t> req(static_cast<size_t>(o.requests), nullptr);
  for (int r = 0; r < o.requests; ++r)
    if (kvxfer_send(comm, 0, &kv[r].desc, nullptr, &rc, &req[r]) < 0) return 3;
  int st = 0;
  for (kvxfer_request_t q : req) {
    if (kvxfer_wait(q, KVXFER_STAGE_COMPLETE, o.timeout_ms * 2) != KVXFER_SUCCESS) st = 4;
    kvxfer_request_free(q);
  }
  kvxfer_comm_destroy(comm);
  return st;
}

/** Elements of `got` that differ from the codec's own decode of `src` (the engine's pages). */
uint64_t wrong_elements(const Kv& src, const Kv& got) {
  Kv want(kLayers, src.T);
  std::string err;
  if (!kp::expected_decode(src, KVXFER_CODEC_CONFIG_INITIALIZER, kPageTokens, 0, &want, &err)) {
    std::fprintf(stderr, "%s: expected pages: %s\n", kTool, err.c_str());
    return UINT64_MAX;
  }
  return want.differing(got);
}

}  // namespace

static int run(int argc, char** argv) {
  Options o;
  CLI::App app{
      "fanin_perf: prefill processes sending to one decode process at once; anchors "
      "of every request before any residual? (docs/PERFORMANCE.md)"};
  kp::add_common_options(&app, &o.common);
  app.add_option("-r,--rate_limit", o.rate, "link emulation of every process, tc syntax")
      ->capture_default_str();
  app.add_option("-P,--prefill", o.prefill, "prefill processes")
      ->check(CLI::Range(1, 32))
      ->capture_default_str();
  app.add_option("-R,--requests", o.requests, "requests per prefill process")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--tokens", o.tokens, "tokens per request (8 layers of 8 x 128 bf16)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (o.common.quick) o.tokens = std::min<int64_t>(o.tokens, 256);
  // Every anchor of every request before any residual needs every request's
  // anchor store at once on the decode side: above the default
  // KVXFER_RECV_ANCHOR_BYTES, which bounds memory by letting requests take
  // turns (docs/TRANSPORT.md, "Memory").  Unless set, the KV of them all.
  const uint64_t all_kv =
      static_cast<uint64_t>(o.prefill) * o.requests * 2 * kLayers * o.tokens * 8 * 128 * 2;
  if (std::getenv("KVXFER_RECV_ANCHOR_BYTES") == nullptr)
    setenv("KVXFER_RECV_ANCHOR_BYTES", std::to_string(all_kv).c_str(), 1);

  kvxfer_unique_id_t id{};
  if (kvxfer_get_unique_id(&id) < 0) {
    std::fprintf(stderr, "%s: kvxfer_get_unique_id: %s\n", kTool, kvxfer_get_last_error());
    return 2;
  }
  std::vector<std::unique_ptr<kp::ForkedChild>> children;
  std::vector<int> to_child, from_child;
  for (int p = 1; p <= o.prefill; ++p) {
    int down[2], up[2];
    if (::pipe(down) != 0 || ::pipe(up) != 0) return 2;
    children.push_back(std::make_unique<kp::ForkedChild>());
    std::string err;
    if (!children.back()->start(
            [&o, &id, p, down, up] {
              ::close(down[1]);
              ::close(up[0]);
              return prefill(o, id, p, down[0], up[1]);
            },
            &err)) {
      std::fprintf(stderr, "%s: %s\n", kTool, err.c_str());
      return 2;
    }
    ::close(down[0]);
    ::close(up[1]);
    to_child.push_back(down[1]);
    from_child.push_back(up[0]);
  }
  kp::print_preamble(stdout, kTool, kp::machine_info(), kp::kvxfer_settings());
  const double req_mib = 2.0 * kLayers * o.tokens * 8 * 128 * 2 / (1 << 20);
  std::printf("# Options: -r %s -P %d -R %d --tokens %" PRId64
              " | Lynx 4+4, %.0f MiB per request, %d requests into rank 0; "
              "KVXFER_RECV_ANCHOR_BYTES=%s\n",
              o.rate.c_str(), o.prefill, o.requests, o.tokens, req_mib, o.prefill * o.requests,
              std::getenv("KVXFER_RECV_ANCHOR_BYTES"));
  kvxfer_comm_t comm = init_comm(o, id, 0);
  if (comm == nullptr) return 2;
  std::vector<Kv> dst;
  for (int i = 0; i < o.prefill * o.requests; ++i) dst.emplace_back(kLayers, o.tokens);
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  std::vector<kvxfer_request_t> req;
  for (int p = 1; p <= o.prefill; ++p)
    for (int r = 0; r < o.requests; ++r) {
      kvxfer_request_t q = nullptr;
      if (kvxfer_recv(comm, p, &dst[static_cast<size_t>((p - 1) * o.requests + r)].desc, &rc, &q) <
          0) {
        std::fprintf(stderr, "%s: kvxfer_recv: %s\n", kTool, kvxfer_get_last_error());
        return 2;
      }
      req.push_back(q);
    }
  // Every prefill has its KV: they post at once.
  char b;
  for (int fd : from_child)
    if (!kvxfer::fdio::read_all(fd, &b, 1, o.timeout_ms)) {
      std::fprintf(stderr, "%s: a prefill process did not get ready\n", kTool);
      return 2;
    }
  const int64_t t_post = [] {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
  }();
  for (int fd : to_child) kvxfer::fdio::write_all(fd, "g", 1);
  int64_t last_anchor = 0, first_residual = INT64_MAX, last_complete = 0;
  uint64_t wire = 0;
  bool ok = true;
  for (kvxfer_request_t q : req) {
    if (kvxfer_wait(q, KVXFER_STAGE_COMPLETE, o.timeout_ms * 2) != KVXFER_SUCCESS) {
      std::fprintf(stderr, "%s: a receive failed: %s\n", kTool, kvxfer_get_last_error());
      ok = false;
    }
    kvxfer_request_info_t i = KVXFER_REQUEST_INFO_INITIALIZER;
    kvxfer_request_get_info(q, &i);
    last_anchor = std::max(last_anchor, i.t_anchor_ready_ns);
    if (i.t_first_residual_ns > 0) first_residual = std::min(first_residual, i.t_first_residual_ns);
    last_complete = std::max(last_complete, i.t_complete_ns);
    wire += i.anchor_wire_bytes + i.residual_wire_bytes;
    kvxfer_request_free(q);
  }
  kvxfer_comm_destroy(comm);
  for (auto& c : children)
    if (!c->wait_for(60) || !c->exited_ok()) {
      std::fprintf(stderr, "%s: a prefill process ended with %s\n", kTool, c->describe().c_str());
      ok = false;
    }
  uint64_t wrong = 0;
  for (int p = 1; p <= o.prefill && ok; ++p)
    for (int r = 0; r < o.requests; ++r) {
      Kv src(kLayers, o.tokens);
      fill(&src, seed_of(p, r));
      wrong += wrong_elements(src, dst[static_cast<size_t>((p - 1) * o.requests + r)]);
    }
  const double margin_ms = (first_residual - last_anchor) * 1e-6;
  const double span_s = (last_complete - t_post) * 1e-9;
  std::printf(
      "# last anchor applied %.2f ms after the prefills' go; first residual applied %.2f ms "
      "after it\n",
      (last_anchor - t_post) * 1e-6, (first_residual - t_post) * 1e-6);
  std::printf(
      "# margin (first residual - last anchor): %+.2f ms: every anchor before any "
      "residual: %s\n",
      margin_ms, margin_ms >= 0 ? "yes" : "no");
  std::printf("# all %zu requests complete after %.1f ms; %.3f GB/s of wire bytes into rank 0\n",
              req.size(), span_s * 1e3, span_s > 0 ? wire / span_s * 1e-9 : 0.0);
  std::printf("# Wrong elements: %" PRIu64 " %s\n", wrong, wrong == 0 ? "OK" : "FAILED");
  const int json_rc = kp::emit_json(kTool, o.common.json_path,
                                    {{"tool", kTool},
                                     {"rate", o.rate},
                                     {"prefill", o.prefill},
                                     {"requests", o.requests},
                                     {"margin_ms", margin_ms},
                                     {"complete_ms", span_s * 1e3},
                                     {"wrong", wrong}});
  if (!ok) return 2;
  if (wrong > 0) return 1;
  return json_rc;
}

int main(int argc, char** argv) {
  return kp::guarded_main(kTool, [&] { return run(argc, argv); });
}
