// net_plugin_perf: ping-pong through the NCCL net plugin (libnccl-net-kvxfer.so,
// driven through ncclNetPlugin_v11 as NCCL's proxy would) against fi_pingpong
// on the same libfabric provider, in the same run, size by size.
//
//   net_plugin_perf                     # 64 B .. 16 MiB, x4, 20 iterations
//   net_plugin_perf -b 1K -e 64M -f 2 -n 50 -J out.json
//
// Two processes (this one and a forked peer) and two plugin comms, one per
// direction (NCCL comms are one-way).  One iteration: rank 0 sends S bytes,
// rank 1 receives them and sends S bytes back.  As fi_pingpong counts it:
//   time/xfer (us) = elapsed / (2 * iters)        MB/s = 2 * iters * S / elapsed
// For each size the plugin and fi_pingpong (-e rdm -m tagged, the same provider
// and iterations) alternate -R times, the plugin's processes waiting blocked
// while fi_pingpong runs, and the best run of each is reported.
// ratio = plugin MB/s / fi_pingpong MB/s.
// docs/NET_PLUGIN.md ("Performance") defines the columns.
#include <dlfcn.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/fdio.h"
#include "kvxfer/version.h"
#include "net_plugin/handle.h"
#include "net_plugin/nccl_net_abi.h"
#include "perf/common/harness.h"

namespace kvxfer::perf {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  CommonOptions common;
  std::string minbytes = "64", maxbytes = "16M";
  int factor = 4;
  std::string plugin = KVXFER_NET_PLUGIN_PATH;
  std::string fi_pingpong = "/usr/bin/fi_pingpong";
  int traffic_class = 0;
  int repeats = 5;
};

// The best (smallest) time of the runs: on a shared machine a run is only
// ever slowed down (a peer preempted for a scheduler tick stalls the
// ping-pong), so the fastest run of each side is the fairest comparison.
double best(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::min_element(v.begin(), v.end());
}

// ---------------------------------------------------------------------------
// Pipes
// ---------------------------------------------------------------------------
using kvxfer::fdio::read_all;  // common/fdio.h (blocking: the peer waits off the CPU)
using kvxfer::fdio::write_all;

// ---------------------------------------------------------------------------
// The plugin side
// ---------------------------------------------------------------------------
void quiet_logger(ncclDebugLogLevel level, unsigned long, const char* file, int line,
                  const char* fmt, ...) {
  if (level != NCCL_LOG_WARN) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "WARN %s:%d %s\n", file, line, buf);
}

struct Rank {
  ncclNet_v11_t* net = nullptr;
  void* ctx = nullptr;
  void* send = nullptr;
  void* recv = nullptr;
  std::string provider;
  std::string error;
};

bool wait_req(ncclNet_v11_t* net, void* req, int* size, std::string* error) {
  const auto t0 = Clock::now();
  for (;;) {
    int done = 0;
    if (net->test(req, &done, size) != ncclSuccess) {
      *error = "test() failed";
      return false;
    }
    if (done) return true;
    if (Clock::now() - t0 > std::chrono::seconds(60)) {
      *error = "a transfer took more than 60 s";
      return false;
    }
  }
}

// Opens the plugin and connects both directions.  Rank 0 listens first.
bool setup_rank(const Options& o, int rank, int rd, int wr, Rank* r) {
  void* dl = dlopen(o.plugin.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (dl == nullptr) {
    r->error = std::string("dlopen: ") + dlerror();
    return false;
  }
  r->net = static_cast<ncclNet_v11_t*>(dlsym(dl, "ncclNetPlugin_v11"));
  if (r->net == nullptr) {
    r->error = "no ncclNetPlugin_v11 in " + o.plugin;
    return false;
  }
  ncclNetCommConfig_v11_t cfg;
  cfg.trafficClass = o.traffic_class;
  if (r->net->init(&r->ctx, 0x6e707065726600ull + rank, &cfg, quiet_logger, nullptr) !=
      ncclSuccess) {
    r->error = "init failed (see the WARN above)";
    return false;
  }
  char mine[NCCL_NET_HANDLE_MAXSIZE], theirs[NCCL_NET_HANDLE_MAXSIZE];
  void* lc = nullptr;
  if (r->net->listen(r->ctx, 0, mine, &lc) != ncclSuccess) {
    r->error = "listen failed";
    return false;
  }
  netplugin::Handle h;
  std::memcpy(&h, mine, sizeof(h));
  r->provider.assign(h.provider, h.provider_len);
  if (!write_all(wr, mine, sizeof(mine)) || !read_all(rd, theirs, sizeof(theirs))) {
    r->error = "handle exchange failed";
    return false;
  }
  const auto t0 = Clock::now();
  while ((r->send == nullptr || r->recv == nullptr) &&
         Clock::now() - t0 < std::chrono::seconds(30)) {
    if (r->send == nullptr && r->net->connect(r->ctx, 0, theirs, &r->send, nullptr) != ncclSuccess)
      break;
    if (r->recv == nullptr && r->net->accept(lc, &r->recv, nullptr) != ncclSuccess) break;
  }
  r->net->closeListen(lc);
  if (r->send == nullptr || r->recv == nullptr) {
    r->error = "connect/accept failed";
    return false;
  }
  return true;
}

uint8_t pattern(uint64_t seed, size_t i) {
  return static_cast<uint8_t>(((i + 1) * 0x9E3779B1u) ^ (seed * 131) ^ (i >> 13));
}

// One size: warmup + iters round trips.  Rank 0 returns the elapsed time of
// the timed ones; #wrong counts bytes that differ from the pattern in the
// last message each rank received.
bool pingpong(Rank* r, int rank, size_t size, int warmup, int iters, bool check,
              std::vector<uint8_t>* sbuf, std::vector<uint8_t>* rbuf, double* us, uint64_t* wrong) {
  const ncclNet_v11_t* net = r->net;
  *wrong = 0;
  Clock::time_point t0;
  for (int it = -warmup; it < iters; ++it) {
    if (it == 0) t0 = Clock::now();
    const uint64_t seed = static_cast<uint64_t>(it + warmup) * 2 + static_cast<uint64_t>(rank);
    if (check && it == iters - 1)
      for (size_t i = 0; i < size; ++i) (*sbuf)[i] = pattern(seed, i);
    void* rreq = nullptr;
    void* data = rbuf->data();
    size_t cap = size;
    int tag = 0;
    while (rreq == nullptr)
      if (net->irecv(r->recv, 1, &data, &cap, &tag, nullptr, nullptr, &rreq) != ncclSuccess)
        return false;
    int got = -1;
    if (rank == 1 && !wait_req(r->net, rreq, &got, &r->error)) return false;
    void* sreq = nullptr;
    while (sreq == nullptr)
      if (net->isend(r->send, sbuf->data(), size, 0, nullptr, nullptr, &sreq) != ncclSuccess)
        return false;
    if (!wait_req(r->net, sreq, nullptr, &r->error)) return false;
    if (rank == 0 && !wait_req(r->net, rreq, &got, &r->error)) return false;
    if (got != static_cast<int>(size)) {
      r->error = "received a message of the wrong size";
      return false;
    }
    if (check && it == iters - 1) {
      const uint64_t peer_seed = seed - static_cast<uint64_t>(rank) + (rank == 0 ? 1 : 0);
      for (size_t i = 0; i < size; ++i)
        if ((*rbuf)[i] != pattern(peer_seed, i)) ++*wrong;
    }
  }
  *us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  return true;
}

// ---------------------------------------------------------------------------
// fi_pingpong
// ---------------------------------------------------------------------------
struct FiResult {
  bool ok = false;
  double mbps = 0, us = 0;
  std::string error;
};

int free_port() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 47592;
  if (bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  close(s);
  return port;
}

bool port_listening(int port) {
  for (const char* f : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(f);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream ss(line);
      std::string sl, local, remote, st;
      ss >> sl >> local >> remote >> st;
      const size_t colon = local.rfind(':');
      if (colon == std::string::npos || st != "0A") continue;  // 0A = LISTEN
      if (std::strtol(local.c_str() + colon + 1, nullptr, 16) == port) return true;
    }
  }
  return false;
}

// Runs argv with stdout to a pipe; returns the pid and the pipe's read end.
pid_t spawn(const std::vector<std::string>& args, int* out_fd) {
  int p[2];
  if (pipe(p) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(p[1], 1);
    dup2(p[1], 2);
    close(p[0]);
    close(p[1]);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(p[1]);
  *out_fd = p[0];
  return pid;
}

std::string drain(int fd, pid_t pid, double seconds, int* status) {
  std::string out;
  const auto end = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  char buf[4096];
  for (;;) {
    pollfd pfd{fd, POLLIN, 0};
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count());
    if (left <= 0) {
      kill(pid, SIGKILL);
      break;
    }
    if (poll(&pfd, 1, left) <= 0) continue;
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  waitpid(pid, status, 0);
  return out;
}

FiResult run_fi_pingpong(const Options& o, const std::string& provider, size_t size, int iters) {
  FiResult r;
  const int port = free_port();
  const std::vector<std::string> base = {o.fi_pingpong,
                                         "-p",
                                         provider,
                                         "-e",
                                         "rdm",
                                         "-m",
                                         "tagged",
                                         "-I",
                                         std::to_string(iters),
                                         "-S",
                                         std::to_string(size)};
  std::vector<std::string> srv = base, cli = base;
  srv.insert(srv.end(), {"-B", std::to_string(port)});
  cli.insert(cli.end(), {"-P", std::to_string(port), "127.0.0.1"});
  int sfd = -1, cfd = -1;
  const pid_t spid = spawn(srv, &sfd);
  if (spid < 0) {
    r.error = "cannot start " + o.fi_pingpong;
    return r;
  }
  const auto t0 = Clock::now();
  while (!port_listening(port) && Clock::now() - t0 < std::chrono::seconds(10)) usleep(10000);
  const pid_t cpid = spawn(cli, &cfd);
  int cst = 0, sst = 0;
  const std::string cout = cpid > 0 ? drain(cfd, cpid, 300, &cst) : "";
  const std::string sout = drain(sfd, spid, 10, &sst);
  // bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
  std::istringstream ss(cout);
  std::string line;
  while (std::getline(ss, line)) {
    std::istringstream ls(line);
    std::string bytes, sent, ack, total, time;
    double mbps = 0, us = 0;
    if ((ls >> bytes >> sent >> ack >> total >> time >> mbps >> us) && !bytes.empty() &&
        std::isdigit(static_cast<unsigned char>(bytes[0]))) {
      r.ok = true;
      r.mbps = mbps;
      r.us = us;
    }
  }
  if (!r.ok) r.error = "fi_pingpong gave no result: " + cout + sout;
  return r;
}

// ---------------------------------------------------------------------------
int run(const Options& o) {
  uint64_t minb = 0, maxb = 0;
  if (!parse_size(o.minbytes, &minb) || !parse_size(o.maxbytes, &maxb) || minb == 0 ||
      maxb < minb || maxb > (uint64_t{1} << 30)) {
    std::fprintf(stderr, "net_plugin_perf: bad -b/-e (sizes 1 .. 1G, -b <= -e)\n");
    return 2;
  }
  const std::vector<uint64_t> sweep = size_sweep(minb, maxb, static_cast<uint64_t>(o.factor));
  const std::vector<size_t> sizes(sweep.begin(), sweep.end());
  const int iters = o.common.iters, warmup = o.common.warmup;

  int down[2], up[2];
  if (pipe(down) != 0 || pipe(up) != 0) return 2;
  ForkedChild child;
  std::string ferr;
  const bool started = child.start(
      [&] {  // rank 1: answers every ping; waits blocked between sizes
        close(down[1]);
        close(up[0]);
        Rank r;
        if (!setup_rank(o, 1, down[0], up[1], &r)) {
          std::fprintf(stderr, "rank 1: %s\n", r.error.c_str());
          return 3;
        }
        std::vector<uint8_t> sbuf(maxb), rbuf(maxb);
        for (size_t i = 0; i < sizes.size() * static_cast<size_t>(o.repeats); ++i) {
          uint32_t go = 0;
          if (!read_all(down[0], &go, sizeof(go)) || go != i / static_cast<size_t>(o.repeats))
            return 4;
          double us = 0;
          uint64_t wrong = 0;
          const size_t size = sizes[i / static_cast<size_t>(o.repeats)];
          if (!pingpong(&r, 1, size, warmup, iters, o.common.check != 0, &sbuf, &rbuf, &us,
                        &wrong)) {
            std::fprintf(stderr, "rank 1: %s\n", r.error.c_str());
            return 5;
          }
          const uint64_t w = wrong;
          if (!write_all(up[1], &w, sizeof(w))) return 6;
        }
        r.net->closeSend(r.send);
        r.net->closeRecv(r.recv);
        r.net->finalize(r.ctx);
        return 0;
      },
      &ferr);
  if (!started) {
    std::fprintf(stderr, "net_plugin_perf: %s\n", ferr.c_str());
    return 2;
  }
  close(down[0]);
  close(up[1]);
  Rank r;
  if (!setup_rank(o, 0, up[0], down[1], &r)) {
    std::fprintf(stderr, "rank 0: %s\n", r.error.c_str());
    child.kill();
    return 3;
  }
  const char* ifname = std::getenv("KVXFER_NET_IF");
  std::printf(
      "# Options: plugin %s (ncclNetPlugin_v11), provider %s, interface %s, "
      "NCCL trafficClass %d, -b %zu -e %zu -f %d, -w %d -n %d -R %d, -c %d\n",
      o.plugin.c_str(), r.provider.c_str(), ifname != nullptr ? ifname : "(default)",
      o.traffic_class, sizes.front(), sizes.back(), o.factor, warmup, iters, o.repeats,
      o.common.check);
  std::printf("# Baseline: %s -p \"%s\" -e rdm -m tagged -I <n> -S <size>, 127.0.0.1\n#\n",
              o.fi_pingpong.c_str(), r.provider.c_str());
  Table t({{"size", 10},
           {"iters", 6},
           {"plugin_us", 11},
           {"plugin_MB/s", 11},
           {"fi_pp_us", 11},
           {"fi_pp_MB/s", 10},
           {"ratio", 6},
           {"#wrong", 6}});
  std::puts(t.header().c_str());
  std::vector<uint8_t> sbuf(maxb), rbuf(maxb);
  nlohmann::json rows = nlohmann::json::array();
  double log_ratio = 0;
  int nratio = 0;
  uint64_t wrong_total = 0;
  bool failed = false;
  for (size_t i = 0; i < sizes.size() && !failed; ++i) {
    // Plugin and fi_pingpong alternate, -R times each; the best runs are reported.
    std::vector<double> plugin_us, fi_us, fi_mbps;
    uint64_t wrong = 0;
    std::string fi_error;
    for (int rep = 0; rep < o.repeats; ++rep) {
      const uint32_t go = static_cast<uint32_t>(i);
      double us = 0;
      uint64_t w = 0, peer_wrong = 0;
      if (!write_all(down[1], &go, sizeof(go)) ||
          !pingpong(&r, 0, sizes[i], warmup, iters, o.common.check != 0, &sbuf, &rbuf, &us, &w) ||
          !read_all(up[0], &peer_wrong, sizeof(peer_wrong))) {
        std::fprintf(stderr, "rank 0: size %zu: %s\n", sizes[i], r.error.c_str());
        failed = true;
        break;
      }
      wrong += w + peer_wrong;
      plugin_us.push_back(us / (2.0 * iters));
      const FiResult fi = run_fi_pingpong(o, r.provider, sizes[i], iters);
      if (fi.ok) {
        fi_us.push_back(fi.us);
        fi_mbps.push_back(fi.mbps);
      } else {
        fi_error = fi.error;
      }
    }
    if (failed) break;
    if (fi_us.empty())
      std::fprintf(stderr, "fi_pingpong, size %zu: %s\n", sizes[i], fi_error.c_str());
    wrong_total += wrong;
    const double xfer_us = best(plugin_us);
    const double mbps = static_cast<double>(sizes[i]) / xfer_us;
    const bool fi_ok = !fi_us.empty();
    const double fi_xfer_us = best(fi_us);
    const double fi_mb = fi_ok ? static_cast<double>(sizes[i]) / fi_xfer_us : 0;
    const double ratio = fi_ok && fi_mb > 0 ? mbps / fi_mb : 0;
    if (ratio > 0) {
      log_ratio += std::log(ratio);
      ++nratio;
    }
    std::puts(t.row({std::to_string(sizes[i]), std::to_string(iters), strprintf("%.2f", xfer_us),
                     strprintf("%.2f", mbps), fi_ok ? strprintf("%.2f", fi_xfer_us) : "n/a",
                     fi_ok ? strprintf("%.2f", fi_mb) : "n/a",
                     ratio > 0 ? strprintf("%.2f", ratio) : "n/a",
                     o.common.check ? std::to_string(wrong) : "N/A"})
                  .c_str());
    std::fflush(stdout);
    rows.push_back({{"size", sizes[i]},
                    {"iters", iters},
                    {"repeats", o.repeats},
                    {"plugin_us_per_xfer", xfer_us},
                    {"plugin_us_per_xfer_all", plugin_us},
                    {"plugin_MBps", mbps},
                    {"fi_pingpong_ok", fi_ok},
                    {"fi_pingpong_us_per_xfer", fi_xfer_us},
                    {"fi_pingpong_us_per_xfer_all", fi_us},
                    {"fi_pingpong_MBps", fi_mb},
                    {"fi_pingpong_MBps_reported", fi_mbps},
                    {"ratio", ratio},
                    {"wrong", wrong}});
  }
  r.net->closeSend(r.send);
  r.net->closeRecv(r.recv);
  r.net->finalize(r.ctx);
  if (failed) child.kill();
  child.wait();
  std::printf("# Out of bounds values : %llu %s\n", static_cast<unsigned long long>(wrong_total),
              wrong_total == 0 ? "OK" : "FAILED");
  if (nratio > 0)
    std::printf("# Avg ratio (geometric mean of plugin/fi_pingpong MB/s): %.2f\n",
                std::exp(log_ratio / nratio));
  if (!o.common.json_path.empty()) {
    nlohmann::json j;
    j["tool"] = "net_plugin_perf";
    j["version"] = strprintf("%d.%d.%d", KVXFER_MAJOR, KVXFER_MINOR, KVXFER_PATCH);
    j["machine"] = to_json(machine_info());
    j["settings"] = to_json(kvxfer_settings());
    j["provider"] = r.provider;
    j["rows"] = rows;
    j["geomean_ratio"] = nratio > 0 ? std::exp(log_ratio / nratio) : 0.0;
    std::string err;
    if (!write_json_file(o.common.json_path, j, &err)) {
      std::fprintf(stderr, "net_plugin_perf: %s\n", err.c_str());
      return 2;
    }
  }
  if (nratio == 0) std::printf("# No fi_pingpong baseline ran: no ratio measured. FAILED\n");
  return failed || wrong_total != 0 || nratio == 0 || !child.exited_ok() ? 1 : 0;
}

}  // namespace
}  // namespace kvxfer::perf

int main(int argc, char** argv) {
  using namespace kvxfer::perf;
  // Loopback by default: the comparison runs fi_pingpong on 127.0.0.1.
  setenv("KVXFER_NET_IF", "lo", 0);
  Options o;
  o.common.iters = 20;
  o.common.warmup = 2;
  CLI::App app{"NCCL net plugin ping-pong against fi_pingpong on the same provider"};
  add_common_options(&app, &o.common);
  app.add_option("-b,--minbytes", o.minbytes, "smallest message (K, M, G = powers of 1024)")
      ->capture_default_str();
  app.add_option("-e,--maxbytes", o.maxbytes, "largest message")->capture_default_str();
  app.add_option("-f,--stepfactor", o.factor, "size factor between rows")
      ->check(CLI::Range(2, 1024))
      ->capture_default_str();
  app.add_option("--plugin", o.plugin, "the plugin library")->capture_default_str();
  app.add_option("--fi_pingpong", o.fi_pingpong, "fabtests' fi_pingpong")->capture_default_str();
  app.add_option("--tc", o.traffic_class, "NCCL trafficClass of both communicators")
      ->capture_default_str();
  app.add_option("--repeats", o.repeats,
                 "runs of each side per size, alternating; the best of each is reported")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (o.common.quick) {
    o.maxbytes = "1M";
    o.common.iters = 5;
    o.common.warmup = 1;
    o.repeats = 1;
  }
  if (::access(o.fi_pingpong.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "net_plugin_perf: --fi_pingpong '%s' is not an executable: %s\n",
                 o.fi_pingpong.c_str(), std::strerror(errno));
    return 2;
  }
  print_preamble(stdout, "net_plugin_perf", machine_info(), kvxfer_settings());
  return run(o);
}
