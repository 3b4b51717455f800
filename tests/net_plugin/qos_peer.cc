// One side of the two-namespace QoS test through the NCCL net plugin
// (netns_qos.sh): two NCCL-style communicators, an anchor one (NCCL
// trafficClass 0) and a residual one (trafficClass 1), each with one plugin
// connection from the sender to the receiver.  The sender posts every
// residual message first, then every anchor message, and lets the network
// decide; the receiver reports when each class's bytes arrived.
//
//   qos_peer --role recv|send --plugin LIB --dir DIR [--anchor-bytes N]
//            [--residual-bytes N] [--anchor-msg N] [--residual-msg N] [--wait-s S]
//
// The receiver writes DIR/handles (both listen handles); the sender reads it.
// The receiver prints key=value lines: verify, anchor_bytes, residual_bytes,
// t_anchor_last_ms, t_residual_half_ms, t_residual_last_ms (from the first
// byte of either class).  Exit status 0 on success.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "net_plugin/nccl_net_abi.h"

namespace {

using Clock = std::chrono::steady_clock;

void logger(ncclDebugLogLevel level, unsigned long, const char* file, int line, const char* fmt,
            ...) {
  if (level != NCCL_LOG_WARN && std::getenv("QOS_VERBOSE") == nullptr) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "%s %s:%d %s\n", level == NCCL_LOG_WARN ? "WARN" : "INFO", file, line, buf);
}

uint8_t pattern(uint64_t seed, size_t i) {
  return static_cast<uint8_t>(((i + 1) * 0x9E3779B1u) ^ (seed * 131) ^ (i >> 13));
}

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

int fail(const char* what) {
  std::fprintf(stderr, "qos_peer: %s\n", what);
  std::printf("error=%s\n", what);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string role, plugin, dir;
  size_t anchor_bytes = 2 << 20, residual_bytes = 8 << 20;
  size_t anchor_msg = 64 << 10, residual_msg = 1 << 20;
  double wait_s = 60;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--role")
      role = v;
    else if (k == "--plugin")
      plugin = v;
    else if (k == "--dir")
      dir = v;
    else if (k == "--anchor-bytes")
      anchor_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--residual-bytes")
      residual_bytes = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--anchor-msg")
      anchor_msg = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--residual-msg")
      residual_msg = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--wait-s")
      wait_s = std::atof(v.c_str());
    else
      return fail("unknown argument");
  }
  if ((role != "send" && role != "recv") || plugin.empty() || dir.empty() || anchor_msg == 0 ||
      residual_msg == 0)
    return fail("usage: qos_peer --role recv|send --plugin LIB --dir DIR ...");
  void* dl = dlopen(plugin.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (dl == nullptr) return fail(dlerror());
  auto* net = static_cast<ncclNet_v11_t*>(dlsym(dl, "ncclNetPlugin_v11"));
  if (net == nullptr) return fail("no ncclNetPlugin_v11");

  // Class 0: anchors, class 1: residuals (KVXFER_NET_TC_MAP's default).
  void* ctx[2] = {nullptr, nullptr};
  for (int c = 0; c < 2; ++c) {
    ncclNetCommConfig_v11_t cfg;
    cfg.trafficClass = c;
    if (net->init(&ctx[c], 0x716f73ull + static_cast<uint64_t>(c), &cfg, logger, nullptr) !=
        ncclSuccess)
      return fail("init");
  }
  const size_t bytes[2] = {anchor_bytes, residual_bytes};
  const size_t msg[2] = {anchor_msg, residual_msg};
  size_t count[2];
  for (int c = 0; c < 2; ++c) count[c] = (bytes[c] + msg[c] - 1) / msg[c];
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
  const std::string hpath = dir + "/handles";

  if (role == "recv") {
    char handles[2][NCCL_NET_HANDLE_MAXSIZE];
    void* lc[2] = {nullptr, nullptr};
    void* rc[2] = {nullptr, nullptr};
    for (int c = 0; c < 2; ++c)
      if (net->listen(ctx[c], 0, handles[c], &lc[c]) != ncclSuccess) return fail("listen");
    const std::string tmp = hpath + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr || std::fwrite(handles, sizeof(handles), 1, f) != 1)
      return fail("write handles");
    std::fclose(f);
    if (std::rename(tmp.c_str(), hpath.c_str()) != 0) return fail("rename handles");
    while ((rc[0] == nullptr || rc[1] == nullptr) && Clock::now() < deadline)
      for (int c = 0; c < 2; ++c)
        if (rc[c] == nullptr && net->accept(lc[c], &rc[c], nullptr) != ncclSuccess)
          return fail("accept");
    if (rc[0] == nullptr || rc[1] == nullptr) return fail("accept timed out");
    // Every receive posted up front (at most 32 per comm in flight: NCCL's limit).
    std::vector<std::vector<uint8_t>> buf[2];
    std::vector<void*> req[2];
    std::vector<double> t_done[2];
    size_t next_post[2] = {0, 0}, done_n[2] = {0, 0};
    Clock::time_point t0{};
    bool started = false;
    bool verify_ok = true;
    for (int c = 0; c < 2; ++c) {
      buf[c].resize(count[c]);
      req[c].assign(count[c], nullptr);
      t_done[c].assign(count[c], -1);
    }
    while ((done_n[0] < count[0] || done_n[1] < count[1]) && Clock::now() < deadline) {
      for (int c = 0; c < 2; ++c) {
        while (next_post[c] < count[c] && next_post[c] - done_n[c] < NCCL_NET_MAX_REQUESTS) {
          const size_t k = next_post[c];
          const size_t len = std::min(msg[c], bytes[c] - k * msg[c]);
          buf[c][k].assign(len, 0);
          void* data = buf[c][k].data();
          size_t cap = len;
          int tag = 0;
          void* r = nullptr;
          if (net->irecv(rc[c], 1, &data, &cap, &tag, nullptr, nullptr, &r) != ncclSuccess)
            return fail("irecv");
          if (r == nullptr) break;
          req[c][k] = r;
          ++next_post[c];
        }
        for (size_t k = 0; k < next_post[c]; ++k) {
          if (req[c][k] == nullptr) continue;
          int done = 0, size = -1;
          if (net->test(req[c][k], &done, &size) != ncclSuccess) return fail("test");
          if (!done) continue;
          if (!started) {
            started = true;
            t0 = Clock::now();
          }
          req[c][k] = nullptr;
          t_done[c][k] = ms_since(t0);
          ++done_n[c];
          const uint64_t seed = static_cast<uint64_t>(c) * 1000003 + k;
          for (size_t i = 0; i < buf[c][k].size(); ++i)
            if (buf[c][k][i] != pattern(seed, i)) verify_ok = false;
          if (size != static_cast<int>(buf[c][k].size())) verify_ok = false;
        }
      }
    }
    if (done_n[0] < count[0] || done_n[1] < count[1]) return fail("transfer timed out");
    double a_last = 0, r_last = 0, r_half = -1;
    for (double t : t_done[0]) a_last = std::max(a_last, t);
    std::vector<double> rs = t_done[1];
    std::sort(rs.begin(), rs.end());
    r_last = rs.back();
    r_half = rs[(rs.size() - 1) / 2];
    std::printf(
        "verify=%s\nanchor_bytes=%zu\nresidual_bytes=%zu\nt_anchor_last_ms=%.1f\n"
        "t_residual_half_ms=%.1f\nt_residual_last_ms=%.1f\n",
        verify_ok ? "ok" : "MISMATCH", anchor_bytes, residual_bytes, a_last, r_half, r_last);
    if (FILE* d = std::fopen((dir + "/done").c_str(), "w")) std::fclose(d);  // the sender may close
    for (int c = 0; c < 2; ++c) {
      net->closeRecv(rc[c]);
      net->closeListen(lc[c]);
      net->finalize(ctx[c]);
    }
    return verify_ok ? 0 : 1;
  }

  // Sender.
  char handles[2][NCCL_NET_HANDLE_MAXSIZE];
  for (;;) {
    FILE* f = std::fopen(hpath.c_str(), "rb");
    if (f != nullptr) {
      const bool ok = std::fread(handles, sizeof(handles), 1, f) == 1;
      std::fclose(f);
      if (ok) break;
    }
    if (Clock::now() > deadline) return fail("no handles from the receiver");
    usleep(20000);
  }
  void* sc[2] = {nullptr, nullptr};
  while ((sc[0] == nullptr || sc[1] == nullptr) && Clock::now() < deadline)
    for (int c = 0; c < 2; ++c)
      if (sc[c] == nullptr && net->connect(ctx[c], 0, handles[c], &sc[c], nullptr) != ncclSuccess)
        return fail("connect");
  if (sc[0] == nullptr || sc[1] == nullptr) return fail("connect timed out");
  std::vector<std::vector<uint8_t>> buf[2];
  for (int c = 0; c < 2; ++c) {
    buf[c].resize(count[c]);
    for (size_t k = 0; k < count[c]; ++k) {
      const size_t len = std::min(msg[c], bytes[c] - k * msg[c]);
      buf[c][k].resize(len);
      const uint64_t seed = static_cast<uint64_t>(c) * 1000003 + k;
      for (size_t i = 0; i < len; ++i) buf[c][k][i] = pattern(seed, i);
    }
  }
  // Residuals first, then anchors; at most 32 in flight per comm.
  std::vector<void*> req[2];
  size_t next[2] = {0, 0}, done_n[2] = {0, 0};
  for (int c = 0; c < 2; ++c) req[c].assign(count[c], nullptr);
  const int order[2] = {1, 0};
  while ((done_n[0] < count[0] || done_n[1] < count[1]) && Clock::now() < deadline) {
    for (int c : order) {
      while (next[c] < count[c] && next[c] - done_n[c] < NCCL_NET_MAX_REQUESTS) {
        void* r = nullptr;
        if (net->isend(sc[c], buf[c][next[c]].data(), buf[c][next[c]].size(), 0, nullptr, nullptr,
                       &r) != ncclSuccess)
          return fail("isend");
        if (r == nullptr) break;
        req[c][next[c]++] = r;
      }
      for (size_t k = 0; k < next[c]; ++k) {
        if (req[c][k] == nullptr) continue;
        int done = 0;
        if (net->test(req[c][k], &done, nullptr) != ncclSuccess) return fail("test");
        if (done) {
          req[c][k] = nullptr;
          ++done_n[c];
        }
      }
    }
  }
  if (done_n[0] < count[0] || done_n[1] < count[1]) return fail("sends timed out");
  std::printf("sent=ok\n");
  // Close only once the receiver has everything.
  while (access((dir + "/done").c_str(), F_OK) != 0 && Clock::now() < deadline) usleep(20000);
  for (int c = 0; c < 2; ++c) {
    net->closeSend(sc[c]);
    net->finalize(ctx[c]);
  }
  return 0;
}
