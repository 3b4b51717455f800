// memory_perf: what a communicator's resident set does under load and over
// time, on both ranks.  docs/PERFORMANCE.md, "perf/memory_perf", defines
// every line.
//
//   --case churn  -N transfers (20,000) of a small KV (64 pages) one after
//                 another; VmRSS after the first and every N/10.  The
//                 growth (last minus first) must stay within 2 MB.
//   --case burst  -R requests (64) of 1 to 32 MiB of KV (seeded), Lynx
//                 progressive, all posted at once, at -r (1gbit).  Each
//                 side touches its KV first, resets its peak (VmHWM, by
//                 /proc/self/clear_refs) and reads VmRSS; the peak after
//                 the burst less that is its memory beyond the KV.  Every
//                 received byte is checked; each request's anchors must
//                 land before its first residual.
//
// This process is rank 0 (the sender); a forked child is rank 1.
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "perf/common/harness.h"
#include "perf/common/pipe_msg.h"
#include "perf/common/whole_kv.h"

namespace {

namespace kp = kvxfer::perf;

constexpr const char* kTool = "memory_perf";
constexpr int kHeads = 8, kHeadDim = 128;
constexpr int32_t kPageTokens = 256;
constexpr uint32_t kMsgReport = 2;

struct Options {
  kp::CommonOptions common;
  std::string which = "burst";
  int transfers = 20000;
  int requests = 64;
  int min_mib = 1, max_mib = 32;
  std::string rate = "1gbit";
  uint64_t seed = 1;
  int timeout_ms = 60000;
  double growth_mb = 2, beyond_mb = 64;  // the targets
};

/** Resets VmHWM to the current VmRSS (Linux clear_refs, value 5). */
bool reset_peak() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  return static_cast<bool>(f);
}

/** The burst's requests: tokens of each (8 layers x K,V x 8 x 128 bf16: 32 tokens a MiB). */
std::vector<int64_t> burst_plan(const Options& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<int64_t> t;
  for (int i = 0; i < o.requests; ++i)
    t.push_back(32 * (o.min_mib + static_cast<int64_t>(rng() % (o.max_mib - o.min_mib + 1))));
  return t;
}

kvxfer_request_config_t config(uint64_t tag) {
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.page_tokens = kPageTokens;
  rc.tag = tag;
  return rc;
}

/** One side's figures, sent from the receiver to the sender as text. */
struct Side {
  std::string text;  // one line per figure
  bool ok = true;
};

Side churn(kvxfer_comm_t comm, int rank, const Options& o) {
  Side s;
  // 64 pages: 32 layers x K,V, one page of 16 tokens each.
  kp::WholeKv kv(32, 16, kHeads, kHeadDim);
  if (rank == 0) kp::fill_uniform(&kv, 7);
  const kvxfer_codec_config_t cc = KVXFER_CODEC_CONFIG_INITIALIZER;
  long first = -1, last = -1;
  char line[256];
  const int step = std::max(1, o.transfers / 10);
  for (int i = 1; i <= o.transfers; ++i) {
    const kvxfer_request_config_t rc = config(static_cast<uint64_t>(i));
    kvxfer_request_t r = nullptr;
    const kvxfer_result_t p = rank == 0 ? kvxfer_send(comm, 1, &kv.desc, &cc, &rc, &r)
                                        : kvxfer_recv(comm, 0, &kv.desc, &rc, &r);
    if (p != KVXFER_SUCCESS || kvxfer_wait(r, KVXFER_STAGE_COMPLETE, o.timeout_ms) != 0) {
      std::snprintf(line, sizeof line, "rank %d: transfer %d failed: %s\n", rank, i,
                    kvxfer_get_last_error());
      s.text += line;
      s.ok = false;
      kvxfer_request_free(r);
      return s;
    }
    kvxfer_request_free(r);
    if (i == 1 || i % step == 0) {
      last = kp::proc_status_kib("VmRSS");
      if (first < 0) first = last;
      std::snprintf(
          line, sizeof line,
          "  rank %d after %6d transfers: VmRSS %8.2f MiB (%+.2f; anon %.2f, shmem "
          "%.2f, file %.2f; malloc %.2f of %.2f)\n",
          rank, i, last / 1024.0, (last - first) / 1024.0, kp::proc_status_kib("RssAnon") / 1024.0,
          kp::proc_status_kib("RssShmem") / 1024.0, kp::proc_status_kib("RssFile") / 1024.0,
          mallinfo2().uordblks / 1048576.0, mallinfo2().arena / 1048576.0);
      s.text += line;
    }
  }
  const double growth = (last - first) / 1024.0;
  const bool met = growth * 1.048576 <= o.growth_mb;  // MiB to MB
  s.ok = s.ok && met;
  std::snprintf(line, sizeof line,
                "rank %d: VmRSS after %d transfers less after the first: %+.2f MiB (%.2f MB; "
                "target <= %.0f MB): %s\n",
                rank, o.transfers, growth, growth * 1.048576, o.growth_mb, met ? "met" : "MISSED");
  s.text += line;
  return s;
}

Side burst(kvxfer_comm_t comm, int rank, const Options& o) {
  Side s;
  const std::vector<int64_t> plan = burst_plan(o);
  std::vector<std::unique_ptr<kp::WholeKv>> kvs;
  uint64_t kv_bytes = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    kvs.push_back(std::make_unique<kp::WholeKv>(8, plan[i], kHeads, kHeadDim));
    if (rank == 0)
      kp::fill_uniform(kvs.back().get(), 1000 + i);  // the receiver's are zero: touched too
    kv_bytes += 16 * kvs.back()->layer_bytes();
  }
  reset_peak();
  const long base = kp::proc_status_kib("VmRSS");
  const kvxfer_codec_config_t cc = KVXFER_CODEC_CONFIG_INITIALIZER;
  std::vector<kvxfer_request_t> reqs(plan.size(), nullptr);
  bool ok = true;
  for (size_t i = 0; i < plan.size() && ok; ++i) {
    const kvxfer_request_config_t rc = config(i + 1);
    ok = (rank == 0 ? kvxfer_send(comm, 1, &kvs[i]->desc, &cc, &rc, &reqs[i])
                    : kvxfer_recv(comm, 0, &kvs[i]->desc, &rc, &reqs[i])) == KVXFER_SUCCESS;
  }
  char line[320];
  for (size_t i = 0; i < plan.size() && ok; ++i)
    if (kvxfer_wait(reqs[i], KVXFER_STAGE_COMPLETE, o.timeout_ms) != KVXFER_SUCCESS) {
      std::snprintf(line, sizeof line, "rank %d: request %zu failed: %s\n", rank, i + 1,
                    kvxfer_get_last_error());
      s.text += line;
      ok = false;
    }
  const long peak = kp::proc_status_kib("VmHWM");
  const double beyond = (peak - base) / 1024.0;
  // Anchors first, as the receiver applies them: a request's first residual
  // after every request handshaken by then reached ANCHOR_READY.  (On the
  // wire a residual may land before a later page's anchor: residuals use the
  // link while pages encode, docs/TRANSPORT.md.)
  int anchors_first = 0;
  if (rank == 1 && ok) {
    std::vector<kvxfer_request_info_t> inf(reqs.size(), KVXFER_REQUEST_INFO_INITIALIZER);
    for (size_t i = 0; i < reqs.size(); ++i) kvxfer_request_get_info(reqs[i], &inf[i]);
    for (const kvxfer_request_info_t& j : inf) {
      bool first = j.t_first_residual_ns > 0;
      for (const kvxfer_request_info_t& i : inf)
        if (i.t_handshake_ns <= j.t_first_residual_ns &&
            i.t_anchor_ready_ns > j.t_first_residual_ns)
          first = false;
      anchors_first += first;
    }
  }
  uint64_t wrong = 0;
  if (rank == 1 && ok && o.common.check != 0)
    for (size_t i = 0; i < plan.size(); ++i) {
      kp::WholeKv src(8, plan[i], kHeads, kHeadDim), want(8, plan[i], kHeads, kHeadDim);
      kp::fill_uniform(&src, 1000 + i);
      std::string err;
      if (!kp::expected_decode(src, cc, kPageTokens, i + 1, &want, &err)) {
        s.text += "expected decode: " + err + "\n";
        ok = false;
        break;
      }
      wrong += want.differing(*kvs[i]);
    }
  for (kvxfer_request_t r : reqs) kvxfer_request_free(r);
  const bool met = ok && beyond * 1.048576 <= o.beyond_mb;
  std::snprintf(line, sizeof line,
                "rank %d (%s): KV %.1f MiB; peak VmRSS beyond it %.1f MiB (%.1f MB; target <= "
                "%.0f MB): %s\n",
                rank, rank == 0 ? "sender" : "receiver", kv_bytes / 1048576.0, beyond,
                beyond * 1.048576, o.beyond_mb, met ? "met" : "MISSED");
  s.text += line;
  if (rank == 1 && ok) {
    std::snprintf(line, sizeof line,
                  "rank 1: requests whose first residual was applied after every anchor: %d of "
                  "%zu; #wrong %" PRIu64 "%s\n",
                  anchors_first, plan.size(), wrong, o.common.check != 0 ? "" : " (not checked)");
    s.text += line;
  }
  s.ok = met && (rank == 0 || (wrong == 0 && anchors_first == static_cast<int>(plan.size())));
  return s;
}

Side run_rank(const kvxfer_unique_id_t& id, int rank, const Options& o) {
  std::string err;
  kvxfer_comm_t comm =
      kp::init_comm(id, 2, rank, o.which == "burst" ? o.rate : std::string(), o.timeout_ms, &err);
  if (comm == nullptr) return Side{err + "\n", false};
  Side s = o.which == "churn" ? churn(comm, rank, o) : burst(comm, rank, o);
  kvxfer_comm_destroy(comm);
  return s;
}

}  // namespace

static int run(int argc, char** argv) {
  Options o;
  CLI::App app{
      "memory_perf: a communicator's resident set over 20,000 transfers (churn) and "
      "under a burst of requests (burst), on both ranks (docs/PERFORMANCE.md)"};
  kp::add_common_options(&app, &o.common);
  app.add_option("--case", o.which, "churn or burst")->check(CLI::IsMember({"churn", "burst"}));
  app.add_option("-N,--transfers", o.transfers, "churn: transfers")->check(CLI::PositiveNumber);
  app.add_option("-R,--requests", o.requests, "burst: requests")->check(CLI::Range(1, 1024));
  app.add_option("--min_mib", o.min_mib, "burst: smallest request")->check(CLI::Range(1, 1024));
  app.add_option("--max_mib", o.max_mib, "burst: largest request")->check(CLI::Range(1, 1024));
  app.add_option("-r,--rate_limit", o.rate, "burst: link rate, tc syntax ('' = none)");
  app.add_option("--seed", o.seed, "burst: request sizes");
  CLI11_PARSE(app, argc, argv);
  if (o.common.quick) {  // smaller defaults; what the command line set stays
    if (app.count("--transfers") == 0) o.transfers = 500;
    if (app.count("--requests") == 0) o.requests = 8;
    if (app.count("--max_mib") == 0) o.max_mib = 4;
    if (app.count("--rate_limit") == 0) o.rate = "";
  }
  if (o.max_mib < o.min_mib) {
    std::fprintf(stderr, "%s: --max_mib %d is below --min_mib %d\n", kTool, o.max_mib, o.min_mib);
    return 2;
  }
  kvxfer_unique_id_t id;
  if (kvxfer_get_unique_id(&id) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "%s: kvxfer_get_unique_id: %s\n", kTool, kvxfer_get_last_error());
    return 2;
  }
  int up[2];
  if (pipe(up) != 0) return 2;
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child == 0) {
    close(up[0]);
    const Side s = run_rank(id, 1, o);
    const std::string msg = (s.ok ? "1" : "0") + s.text;
    (void)kp::send_msg(up[1], kMsgReport, msg.data(), msg.size());
    _exit(0);
  }
  close(up[1]);
  std::printf("# %s --case %s: ", kTool, o.which.c_str());
  if (o.which == "churn")
    std::printf("%d transfers of 64 pages (2 MiB of KV), Lynx, one at a time\n", o.transfers);
  else
    std::printf("%d requests of %d-%d MiB of KV, Lynx progressive, all in flight, rate %s\n",
                o.requests, o.min_mib, o.max_mib, o.rate.empty() ? "none" : o.rate.c_str());
  const Side mine = run_rank(id, 0, o);
  uint32_t t;
  std::vector<uint8_t> m;
  std::string err;
  const bool got = kp::recv_msg(up[0], &t, &m, kp::kPipeWaitMs, "the receiver", &err);
  int status = 0;
  waitpid(child, &status, 0);
  std::printf("%s", mine.text.c_str());
  const std::string theirs = got ? std::string(m.begin(), m.end()) : "0" + err + "\n";
  std::printf("%s", theirs.c_str() + 1);
  const bool pass = mine.ok && theirs[0] == '1';
  std::printf("# %s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

int main(int argc, char** argv) {
  return kp::guarded_main(kTool, [&] { return run(argc, argv); });
}
