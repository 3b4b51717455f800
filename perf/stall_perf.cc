// stall_perf: a sender stopped (SIGSTOP) in the middle of its messages.  The
// receiver's request must end in KVXFER_ERR_TIMEOUT, and the receiver must
// live on: no crash in the seconds after (libfabric closes the stopped
// peer's endpoints then), and its next request, from another peer, exact.
// docs/PERFORMANCE.md, "perf/stall_perf", defines every line.
//
// Each run has its own survivor process, so that a crash shows as a signal:
//   --api endpoint  the survivor (forked by this coordinator) has endpoints
//                   A (the receiver, with --timeout_ms) and B (the other
//                   peer); the stopped sender, which it forks, sends --mib
//                   MiB to A by id at the run's rate and codec;
//   --api comm      a 3-rank kvxfer_comm_init: the survivor is rank 0, the
//                   stopped sender rank 1, the other peer rank 2.
// The survivor stops the sender once `cut` pages have arrived (cut drawn
// from --seed in [1, pages/2]), waits for the request to fail, waits
// --after_ms more, then receives a request from the other peer and checks
// every byte.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "perf/common/endpoint_util.h"
#include "perf/common/harness.h"
#include "perf/common/pipe_msg.h"
#include "perf/common/whole_kv.h"
#include "transport/shm_reaper.h"

namespace {

namespace kp = kvxfer::perf;
using Clock = std::chrono::steady_clock;

constexpr const char* kTool = "stall_perf";
constexpr int kLayers = 8, kHeads = 8, kHeadDim = 128;
constexpr int32_t kPageTokens = 256;
constexpr uint32_t kMsgAddr = 1, kMsgResult = 2;

struct Options {
  kp::CommonOptions common;
  int runs = 25;
  std::vector<std::string> codecs{"lynx", "bf16"};
  std::vector<std::string> rates{"", "1gbit"};
  int timeout_ms = 1000;
  int after_ms = 1500;
  int mib = 32;
  uint64_t seed = 1;
  std::string provider;  // KVXFER_OFI_PROVIDER for every process; "" = the default path
  std::vector<std::string> apis{"endpoint", "comm"};
};

/** What a survivor reports: its verdict and the request's time to fail. */
struct Result {
  int32_t code = 0;  // 0 ok, 1 finished before the stop (no cut), >= 10 a failure (see why)
  double fail_s = 0;
  char why[200] = {};
};

kvxfer_codec_config_t codec_of(const std::string& name) {
  kvxfer_codec_config_t c = KVXFER_CODEC_CONFIG_INITIALIZER;
  if (name == "bf16") c.codec = KVXFER_CODEC_BF16;
  return c;
}

/** The stopped process: connects to A and sends request 1; the survivor stops it midway. */
int stopped_main(int rd, int wr, const Options& o, const std::string& codec,
                 const std::string& rate) {
  kvxfer_endpoint_config_t cfg = KVXFER_ENDPOINT_CONFIG_INITIALIZER;
  cfg.bind_address = "127.0.0.1";
  cfg.timeout_ms = 30000;
  cfg.rate_limit = rate.empty() ? nullptr : rate.c_str();
  kvxfer_comm_t ep = nullptr;
  auto failed = [](const char* what, int code) {
    std::fprintf(stderr, "%s: the stopped sender: %s: %s\n", kTool, what, kvxfer_get_last_error());
    return code;
  };
  if (kvxfer_endpoint_create(&ep, &cfg) != KVXFER_SUCCESS) return failed("create", 2);
  uint32_t t;
  std::vector<uint8_t> a;
  std::string err;
  if (!kp::recv_msg(rd, &t, &a, kp::kPipeWaitMs, "the survivor", &err)) return 3;
  int peer = -1;
  if (kvxfer_endpoint_connect(ep, a.data(), a.size(), &peer) != KVXFER_SUCCESS)
    return failed("connect", 4);
  kp::WholeKv kv(kLayers, static_cast<int64_t>(o.mib) * 32, kHeads, kHeadDim);
  kp::fill_uniform(&kv, 1);
  const kvxfer_codec_config_t cc = codec_of(codec);
  const kvxfer_request_config_t rc = kp::by_id(1, kPageTokens);
  kvxfer_request_t r = nullptr;
  if (kvxfer_send(ep, peer, &kv.desc, &cc, &rc, &r) != KVXFER_SUCCESS) return failed("send", 5);
  (void)kp::send_msg(wr, kMsgAddr, nullptr, 0);  // posted
  kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000);  // stopped long before, then killed
  return 0;
}

Result fail(int code, const std::string& why) {
  Result r;
  r.code = code;
  std::snprintf(r.why, sizeof r.why, "%s", why.c_str());
  return r;
}

Result stop_midway(kvxfer_request_t r, pid_t s, int cut, int timeout_ms);

/** The survivor of one run, with endpoints. */
Result survivor(const Options& o, const std::string& codec, const std::string& rate, int cut) {
  // The sender first: a fork after kvxfer has threads would copy libfabric's
  // state mid-use into a child that has none of them.
  int down[2], up[2];
  if (pipe(down) != 0 || pipe(up) != 0) return fail(11, "pipe");
  const pid_t s = fork();
  if (s == 0) {
    close(down[1]);
    close(up[0]);
    _exit(stopped_main(down[0], up[1], o, codec, rate));
  }
  close(down[0]);
  close(up[1]);
  auto kill_sender = [&] {
    kill(s, SIGKILL);
    waitpid(s, nullptr, 0);
    kvxfer::transport::remove_shm_regions_of(s);
  };
  std::vector<uint8_t> aa, ba;
  kvxfer_comm_t a = kp::make_endpoint(kTool, o.timeout_ms, 0, &aa);
  kvxfer_comm_t b = kp::make_endpoint(kTool, 30000, 0, &ba);
  if (a == nullptr || b == nullptr) {
    kill_sender();
    return fail(10, "endpoint create");
  }
  uint32_t t;
  std::vector<uint8_t> m;
  std::string err;
  int pa = -1;
  kp::WholeKv dst(kLayers, static_cast<int64_t>(o.mib) * 32, kHeads, kHeadDim);
  const kvxfer_request_config_t rc = kp::by_id(1, kPageTokens);
  kvxfer_request_t r = nullptr;
  if (!kp::send_msg(down[1], kMsgAddr, aa.data(), aa.size()) ||
      !kp::recv_msg(up[0], &t, &m, 60000, "the sender", &err)) {
    int st = 0;
    if (waitpid(s, &st, WNOHANG) != s) {
      kill(s, SIGKILL);
      waitpid(s, &st, 0);
    }
    kvxfer::transport::remove_shm_regions_of(s);
    return fail(12, "the sender did not post: " + err + " (its exit status " +
                        std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : -1) + ", stderr)");
  }
  // The sender connected before it posted: it is A's only peer, index 0.
  pa = 0;
  if (kvxfer_recv(a, pa, &dst.desc, &rc, &r) != KVXFER_SUCCESS) {
    kill_sender();
    return fail(13, std::string("recv: ") + kvxfer_get_last_error());
  }
  Result res = stop_midway(r, s, cut, o.timeout_ms);
  kvxfer_request_free(r);
  // The window in which the survivor died before: libfabric closes the
  // stopped peer's endpoints now.
  std::this_thread::sleep_for(std::chrono::milliseconds(o.after_ms));
  // The next request, from another peer: exact.
  int ab = -1, ba_peer = -1;
  if (kvxfer_endpoint_connect(a, ba.data(), ba.size(), &ab) != KVXFER_SUCCESS ||
      kvxfer_endpoint_connect(b, aa.data(), aa.size(), &ba_peer) != KVXFER_SUCCESS) {
    kill_sender();
    return fail(15, std::string("connect to the other peer: ") + kvxfer_get_last_error());
  }
  kp::WholeKv src(kLayers, 256, kHeads, kHeadDim), got(kLayers, 256, kHeads, kHeadDim),
      want(kLayers, 256, kHeads, kHeadDim);
  kp::fill_uniform(&src, 2);
  const kvxfer_codec_config_t cc = codec_of(codec);
  const kvxfer_request_config_t rc2 = kp::by_id(2, kPageTokens);
  kvxfer_request_t rs = nullptr, rr = nullptr;
  const bool posted = kvxfer_recv(a, ab, &got.desc, &rc2, &rr) == KVXFER_SUCCESS &&
                      kvxfer_send(b, ba_peer, &src.desc, &cc, &rc2, &rs) == KVXFER_SUCCESS;
  const bool done = posted && kvxfer_wait(rr, KVXFER_STAGE_COMPLETE, 30000) == KVXFER_SUCCESS &&
                    kvxfer_wait(rs, KVXFER_STAGE_COMPLETE, 30000) == KVXFER_SUCCESS;
  if (!done) {
    kill_sender();
    return fail(16, std::string("the next request: ") + kvxfer_get_last_error());
  }
  if (!kp::expected_decode(src, cc, kPageTokens, 0, &want, &err)) return fail(17, err);
  const uint64_t wrong = want.differing(got);
  kvxfer_request_free(rs);
  kvxfer_request_free(rr);
  kill_sender();
  kvxfer_comm_destroy(b);
  kvxfer_comm_destroy(a);
  if (wrong != 0)
    return fail(18, "the next request has " + std::to_string(wrong) + " wrong values");
  return res;
}

/** Waits for `cut` arrivals (or the end) of `r`, stops `s`, and times the
 *  request's failure; code 1 when it had all arrived. */
Result stop_midway(kvxfer_request_t r, pid_t s, int cut, int timeout_ms) {
  size_t n = 0;
  const auto give_up = Clock::now() + std::chrono::seconds(60);
  kvxfer_stage_t st = KVXFER_STAGE_POSTED;
  while (n < static_cast<size_t>(cut) && Clock::now() < give_up) {
    kvxfer_request_get_arrivals(r, nullptr, 0, &n);
    kvxfer_test(r, &st);
    if (st == KVXFER_STAGE_COMPLETE || st == KVXFER_STAGE_ERROR) break;
  }
  kill(s, SIGSTOP);
  const auto t0 = Clock::now();
  const kvxfer_result_t w = kvxfer_wait(r, KVXFER_STAGE_COMPLETE, timeout_ms * 3 + 10000);
  Result res;
  res.fail_s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (w == KVXFER_SUCCESS) res.code = 1;
  if (w != KVXFER_SUCCESS && w != KVXFER_ERR_TIMEOUT)
    res = fail(14, std::string("the stalled request ended with ") + kvxfer_get_error_string(w) +
                       ": " + kvxfer_get_last_error());
  return res;
}

/** The communicator form (kvxfer_comm_init, 3 ranks): the survivor is rank
 *  0, the stopped sender rank 1, the other peer rank 2. */
Result survivor_comm(const Options& o, const std::string& codec, const std::string& rate, int cut) {
  kvxfer_unique_id_t id;
  if (kvxfer_get_unique_id(&id) != KVXFER_SUCCESS) return fail(10, "unique id");
  int go[2];
  if (pipe(go) != 0) return fail(11, "pipe");
  const kvxfer_codec_config_t cc = codec_of(codec);
  auto peer = [&](int rank) {
    std::string err;
    kvxfer_comm_t c = kp::init_comm(id, 3, rank, rank == 1 ? rate : std::string(), 30000, &err);
    if (c == nullptr) return 2;
    kp::WholeKv kv(kLayers, rank == 1 ? static_cast<int64_t>(o.mib) * 32 : 256, kHeads, kHeadDim);
    kp::fill_uniform(&kv, static_cast<uint64_t>(rank));
    if (rank == 2) {
      char b;
      if (read(go[0], &b, 1) != 1) return 3;
    }
    kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
    rc.page_tokens = kPageTokens;
    rc.tag = static_cast<uint64_t>(rank);
    kvxfer_request_t r = nullptr;
    if (kvxfer_send(c, 0, &kv.desc, &cc, &rc, &r) != KVXFER_SUCCESS) return 4;
    kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000);  // rank 1 is stopped long before, then killed
    kvxfer_request_free(r);
    kvxfer_comm_destroy(c);
    return 0;
  };
  const pid_t s = fork();
  if (s == 0) _exit(peer(1));
  const pid_t other = fork();
  if (other == 0) _exit(peer(2));
  close(go[0]);
  auto reap = [&] {
    kill(s, SIGKILL);
    kill(other, SIGKILL);
    waitpid(s, nullptr, 0);
    waitpid(other, nullptr, 0);
    kvxfer::transport::remove_shm_regions_of(s);
    kvxfer::transport::remove_shm_regions_of(other);
  };
  std::string err;
  kvxfer_comm_t a = kp::init_comm(id, 3, 0, std::string(), o.timeout_ms, &err);
  if (a == nullptr) {
    reap();
    return fail(12, err);
  }
  kp::WholeKv dst(kLayers, static_cast<int64_t>(o.mib) * 32, kHeads, kHeadDim);
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.page_tokens = kPageTokens;
  rc.tag = 1;
  kvxfer_request_t r = nullptr;
  if (kvxfer_recv(a, 1, &dst.desc, &rc, &r) != KVXFER_SUCCESS) {
    reap();
    return fail(13, std::string("recv: ") + kvxfer_get_last_error());
  }
  Result res = stop_midway(r, s, cut, o.timeout_ms);
  kvxfer_request_free(r);
  std::this_thread::sleep_for(std::chrono::milliseconds(o.after_ms));
  // The next request, from rank 2: exact.
  kp::WholeKv src(kLayers, 256, kHeads, kHeadDim), got(kLayers, 256, kHeads, kHeadDim),
      want(kLayers, 256, kHeads, kHeadDim);
  kp::fill_uniform(&src, 2);
  rc.tag = 2;
  kvxfer_request_t r2 = nullptr;
  const bool done = write(go[1], "g", 1) == 1 &&
                    kvxfer_recv(a, 2, &got.desc, &rc, &r2) == KVXFER_SUCCESS &&
                    kvxfer_wait(r2, KVXFER_STAGE_COMPLETE, 30000) == KVXFER_SUCCESS;
  const std::string why = done ? "" : kvxfer_get_last_error();
  kvxfer_request_free(r2);
  reap();
  kvxfer_comm_destroy(a);
  if (!done) return fail(16, "the next request: " + why);
  if (!kp::expected_decode(src, cc, kPageTokens, 2, &want, &err)) return fail(17, err);
  const uint64_t wrong = want.differing(got);
  if (wrong != 0)
    return fail(18, "the next request has " + std::to_string(wrong) + " wrong values");
  return res;
}

struct Row {
  int runs = 0, ok = 0, uncut = 0, crashes = 0, hangs = 0, failures = 0;
  std::vector<double> fail_s;
  std::string first_problem;
};

/** One run in a child process; its verdict, or the signal that ended it. */
void run_one(const Options& o, const std::string& api, const std::string& codec,
             const std::string& rate, int cut, Row* row) {
  int p[2];
  if (pipe(p) != 0) return;
  const pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    alarm(static_cast<unsigned>(o.timeout_ms * 3 / 1000 + o.after_ms / 1000 + 90));
    Result r = api == "comm" ? survivor_comm(o, codec, rate, cut) : survivor(o, codec, rate, cut);
    // The survivor's comm_init has its --timeout_ms (the stall's) for three
    // forked ranks' links and bootstrap, which a loaded machine can exceed
    // before any stall: the run, not the start-up, is what is measured, so
    // it is made once more.
    if (api == "comm" && r.code == 12 && std::strstr(r.why, "timed out") != nullptr)
      r = survivor_comm(o, codec, rate, cut);
    (void)kp::send_msg(p[1], kMsgResult, &r, sizeof r);
    _exit(0);
  }
  close(p[1]);
  uint32_t t;
  std::vector<uint8_t> m;
  std::string err;
  const bool got = kp::recv_msg(p[0], &t, &m, kp::kPipeWaitMs, "the survivor", &err) &&
                   m.size() == sizeof(Result);
  close(p[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  ++row->runs;
  auto note = [&](const std::string& what) {
    if (row->first_problem.empty()) row->first_problem = what;
  };
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    (sig == SIGALRM ? row->hangs : row->crashes)++;
    note(std::string("the survivor died of ") + strsignal(sig) + " (cut " + std::to_string(cut) +
         ")");
    return;
  }
  if (!got) {
    ++row->failures;
    note("no verdict: " + err);
    return;
  }
  Result r;
  std::memcpy(&r, m.data(), sizeof r);
  if (r.code == 0) {
    ++row->ok;
    row->fail_s.push_back(r.fail_s);
  } else if (r.code == 1) {
    ++row->uncut;
  } else {
    ++row->failures;
    note(r.why);
  }
}

}  // namespace

static int run(int argc, char** argv) {
  Options o;
  CLI::App app{
      "stall_perf: a sender stopped (SIGSTOP) mid-message; the survivor times the request out, "
      "lives on, and its next request from another peer is exact (docs/PERFORMANCE.md)"};
  kp::add_common_options(&app, &o.common);
  app.add_option("-N,--runs", o.runs, "runs per api, codec and rate")->check(CLI::PositiveNumber);
  app.add_option("-m,--codecs", o.codecs, "lynx, bf16")
      ->delimiter(',')
      ->check(CLI::IsMember({"lynx", "bf16"}));
  app.add_option("-r,--rates", o.rates, "sender's rate limits, tc syntax; '' = none")
      ->delimiter(',');
  app.add_option("--timeout_ms", o.timeout_ms, "the survivor's endpoint timeout")
      ->check(CLI::Range(100, 600000));
  app.add_option("--after_ms", o.after_ms, "wait after the failure, before the next request")
      ->check(CLI::Range(0, 600000));
  app.add_option("--mib", o.mib, "MiB of bf16 KV the stopped sender sends")
      ->check(CLI::Range(1, 4096));
  app.add_option("--seed", o.seed, "cut points");
  app.add_option("--api", o.apis, "endpoint (kvxfer_endpoint_*), comm (kvxfer_comm_init, 3 ranks)")
      ->delimiter(',')
      ->check(CLI::IsMember({"endpoint", "comm"}));
  app.add_option("--provider", o.provider,
                 "KVXFER_OFI_PROVIDER of every process ('tcp;ofi_rxm', 'shm'); '' = default");
  CLI11_PARSE(app, argc, argv);
  if (o.common.quick) {  // smaller defaults; what the command line set stays
    if (app.count("--runs") == 0) o.runs = 1;
    // a rate at which 8 MiB takes long enough to be cut on a busy machine
    if (app.count("--rates") == 0) o.rates = {"200mbit"};
    if (app.count("--after_ms") == 0) o.after_ms = 500;
    if (app.count("--mib") == 0) o.mib = 8;
  }
  if (!o.provider.empty()) setenv("KVXFER_OFI_PROVIDER", o.provider.c_str(), 1);
  const int pages = kLayers * 2 * ((o.mib * 32 + kPageTokens - 1) / kPageTokens);
  std::mt19937 rng(static_cast<uint32_t>(o.seed));
  std::printf(
      "# %s: %d runs per row, %d MiB (%d pages), survivor timeout %d ms, then %d ms, "
      "provider %s\n",
      kTool, o.runs, o.mib, pages, o.timeout_ms, o.after_ms,
      o.provider.empty() ? "default" : o.provider.c_str());
  std::printf("# %8s %6s %8s %5s %4s %6s %8s %6s %9s %11s %11s\n", "api", "codec", "rate", "runs",
              "ok", "uncut", "crashes", "hangs", "failures", "fail_p50_s", "fail_max_s");
  std::fflush(stdout);
  int bad = 0;
  for (const std::string& api : o.apis)
    for (const std::string& codec : o.codecs)
      for (const std::string& rate : o.rates) {
        Row row;
        for (int i = 0; i < o.runs; ++i)
          run_one(o, api, codec, rate, 1 + static_cast<int>(rng() % std::max(1, pages / 2)), &row);
        std::sort(row.fail_s.begin(), row.fail_s.end());
        const double p50 = row.fail_s.empty() ? 0 : row.fail_s[row.fail_s.size() / 2];
        const double mx = row.fail_s.empty() ? 0 : row.fail_s.back();
        std::printf("  %8s %6s %8s %5d %4d %6d %8d %6d %9d %11.3f %11.3f\n", api.c_str(),
                    codec.c_str(), rate.empty() ? "none" : rate.c_str(), row.runs, row.ok,
                    row.uncut, row.crashes, row.hangs, row.failures, p50, mx);
        if (!row.first_problem.empty())
          std::printf("    first problem: %s\n", row.first_problem.c_str());
        bad += row.crashes + row.hangs + row.failures;
        if (row.ok == 0) ++bad;  // no run stopped the sender mid-transfer
        std::fflush(stdout);
      }
  std::printf("# crashes, hangs and failures: %d: %s\n", bad, bad == 0 ? "PASS" : "FAIL");
  return bad == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  return kp::guarded_main(kTool, [&] { return run(argc, argv); });
}
