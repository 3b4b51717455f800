// Test harness for the NCCL net plugin, after aws-ofi-nccl's hardware-free
// functional tests: dlopen the built plugin, look up ncclNetPlugin_v11, and
// drive it the way NCCL's proxy thread does (non-blocking connect/accept and
// isend/irecv/test loops), in two processes over 127.0.0.1 with host buffers.
// Every wait has a deadline.
#pragma once

#include <dlfcn.h>
#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common/fdio.h"
#include "net_plugin/nccl_net_abi.h"
#include "net_plugin/test_hooks.h"

namespace kvxfer::test {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// The logger handed to init(): keeps every line, prints WARNs (all lines with
// KVXFER_TEST_VERBOSE=1).
// ---------------------------------------------------------------------------
struct LogLine {
  int level;
  unsigned long flags;
  std::string text;
};
inline std::mutex& log_mu() {
  static std::mutex m;
  return m;
}
inline std::vector<LogLine>& log_lines() {
  static std::vector<LogLine> v;
  return v;
}
inline void test_logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                        const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  static const bool verbose = std::getenv("KVXFER_TEST_VERBOSE") != nullptr;
  if (level == NCCL_LOG_WARN || verbose)
    std::fprintf(stderr, "[%d] %s %s:%d %s\n", static_cast<int>(getpid()),
                 level == NCCL_LOG_WARN ? "WARN" : "INFO", file, line, buf);
  std::lock_guard<std::mutex> lk(log_mu());
  log_lines().push_back({static_cast<int>(level), flags, buf});
}
/** True if a logged line at `level` contains `needle`. */
inline bool logged(int level, const char* needle) {
  std::lock_guard<std::mutex> lk(log_mu());
  for (const LogLine& l : log_lines())
    if (l.level == level && l.text.find(needle) != std::string::npos) return true;
  return false;
}

// ---------------------------------------------------------------------------
// Loading the plugin
// ---------------------------------------------------------------------------
struct Plugin {
  void* dl = nullptr;
  ncclNet_v11_t* v11 = nullptr;
  ncclNet_v10_t* v10 = nullptr;
  kvxfer_net_test_inject_fn inject = nullptr;
  kvxfer_net_test_comm_info_fn comm_info = nullptr;
  kvxfer_net_test_count_fn pending_connects = nullptr;
  kvxfer_net_test_count_fn live_contexts = nullptr;
  std::string error;
};

/** dlopen + dlsym, as NCCL does (RTLD_NOW | RTLD_LOCAL). */
inline Plugin load_plugin(const char* path) {
  Plugin p;
  p.dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (p.dl == nullptr) {
    const char* e = dlerror();
    p.error = e != nullptr ? e : "dlopen failed";
    return p;
  }
  p.v11 = static_cast<ncclNet_v11_t*>(dlsym(p.dl, "ncclNetPlugin_v11"));
  p.v10 = static_cast<ncclNet_v10_t*>(dlsym(p.dl, "ncclNetPlugin_v10"));
  p.inject = reinterpret_cast<kvxfer_net_test_inject_fn>(dlsym(p.dl, "kvxfer_net_test_inject"));
  p.comm_info =
      reinterpret_cast<kvxfer_net_test_comm_info_fn>(dlsym(p.dl, "kvxfer_net_test_comm_info"));
  p.pending_connects =
      reinterpret_cast<kvxfer_net_test_count_fn>(dlsym(p.dl, "kvxfer_net_test_pending_connects"));
  p.live_contexts =
      reinterpret_cast<kvxfer_net_test_count_fn>(dlsym(p.dl, "kvxfer_net_test_live_contexts"));
  if (p.v11 == nullptr) p.error = "no ncclNetPlugin_v11 in the plugin";
  return p;
}

/** Copies the plugin to a fresh path, so that dlopen gives a fresh instance
 *  (its own KVXFER_* cache): for tests that change the environment. */
inline std::string copy_plugin(const char* path) {
  char tmpl[] = "/tmp/kvxfer-np-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return "";
  FILE* in = std::fopen(path, "rb");
  if (in == nullptr) {
    close(fd);
    return "";
  }
  char buf[1 << 16];
  size_t n;
  bool ok = true;
  while ((n = std::fread(buf, 1, sizeof(buf), in)) > 0)
    if (write(fd, buf, n) != static_cast<ssize_t>(n)) ok = false;
  std::fclose(in);
  close(fd);
  return ok ? std::string(tmpl) : "";
}

// ---------------------------------------------------------------------------
// Pipes between the two processes
// ---------------------------------------------------------------------------
inline bool write_all(int fd, const void* p, size_t n) { return fdio::write_all(fd, p, n); }
inline bool read_all(int fd, void* p, size_t n, double seconds = 30) {
  return fdio::read_all(fd, p, n, static_cast<int>(seconds * 1000));
}
inline bool send_token(int fd, uint32_t v) { return write_all(fd, &v, sizeof(v)); }
inline bool expect_token(int fd, uint32_t v, double seconds = 30) {
  uint32_t got = 0;
  return read_all(fd, &got, sizeof(got), seconds) && got == v;
}

// ---------------------------------------------------------------------------
// Data: a pure function of (seed, index), so each side can regenerate it.
// ---------------------------------------------------------------------------
inline uint8_t pattern_byte(uint64_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
  x ^= x >> 29;
  return static_cast<uint8_t>(x ^ (x >> 17));
}
inline void fill(void* buf, size_t n, uint64_t seed) {
  auto* b = static_cast<uint8_t*>(buf);
  for (size_t i = 0; i < n; ++i) b[i] = pattern_byte(seed, i);
}
/** -1 if buf holds the pattern, else the first differing index. */
inline int64_t first_mismatch(const void* buf, size_t n, uint64_t seed) {
  const auto* b = static_cast<const uint8_t*>(buf);
  for (size_t i = 0; i < n; ++i)
    if (b[i] != pattern_byte(seed, i)) return static_cast<int64_t>(i);
  return -1;
}

// ---------------------------------------------------------------------------
// Driving the plugin with deadlines
// ---------------------------------------------------------------------------
// "The harness gave up": 7 (ncclInProgress in nccl.h), which a net plugin
// never returns, inside the enum's range of values (comparing an
// out-of-range enum value is undefined).
constexpr ncclResult_t kTimedOut = static_cast<ncclResult_t>(7);

inline double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/** connect() until a comm comes back; *null_calls counts the NULL answers. */
inline ncclResult_t connect_until(const ncclNet_v11_t* net, void* ctx, int dev, void* handle,
                                  void** comm, double seconds = 20, int* null_calls = nullptr) {
  const auto t0 = Clock::now();
  *comm = nullptr;
  while (since(t0) < seconds) {
    const ncclResult_t r = net->connect(ctx, dev, handle, comm, nullptr);
    if (r != ncclSuccess) return r;
    if (*comm != nullptr) return ncclSuccess;
    if (null_calls != nullptr) ++*null_calls;
    usleep(200);
  }
  return kTimedOut;
}
inline ncclResult_t accept_until(const ncclNet_v11_t* net, void* listen_comm, void** comm,
                                 double seconds = 20, int* null_calls = nullptr) {
  const auto t0 = Clock::now();
  *comm = nullptr;
  while (since(t0) < seconds) {
    const ncclResult_t r = net->accept(listen_comm, comm, nullptr);
    if (r != ncclSuccess) return r;
    if (*comm != nullptr) return ncclSuccess;
    if (null_calls != nullptr) ++*null_calls;
    usleep(200);
  }
  return kTimedOut;
}
/** isend, retried while the plugin answers with a NULL request. */
inline ncclResult_t isend_until(const ncclNet_v11_t* net, void* comm, void* data, size_t size,
                                int tag, void** req, double seconds = 20) {
  const auto t0 = Clock::now();
  *req = nullptr;
  while (since(t0) < seconds) {
    const ncclResult_t r = net->isend(comm, data, size, tag, nullptr, nullptr, req);
    if (r != ncclSuccess || *req != nullptr) return r;
    usleep(50);
  }
  return kTimedOut;
}
inline ncclResult_t irecv_until(const ncclNet_v11_t* net, void* comm, int n, void** data,
                                size_t* sizes, int* tags, void** req, double seconds = 20) {
  const auto t0 = Clock::now();
  *req = nullptr;
  while (since(t0) < seconds) {
    const ncclResult_t r = net->irecv(comm, n, data, sizes, tags, nullptr, nullptr, req);
    if (r != ncclSuccess || *req != nullptr) return r;
    usleep(50);
  }
  return kTimedOut;
}
/** test() until done, an error, or the deadline (kTimedOut). */
inline ncclResult_t wait_done(const ncclNet_v11_t* net, void* req, int* sizes,
                              double seconds = 30) {
  const auto t0 = Clock::now();
  while (since(t0) < seconds) {
    int done = 0;
    const ncclResult_t r = net->test(req, &done, sizes);
    if (r != ncclSuccess) return r;
    if (done) return ncclSuccess;
    sched_yield();  // the peer shares these CPUs
  }
  return kTimedOut;
}

}  // namespace kvxfer::test
