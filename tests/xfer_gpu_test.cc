// The GPU path of kvxfer_send / kvxfer_recv (src/xfer/device.h,
// src/cuda/xfer_device.cc): KV blocks in CUDA device memory on either side,
// staged through pinned host buffers over the libfabric loopback.
//
// Received values are copied back to the host and compared bit for bit with
// the CPU codec's own decode of the sender's pages (anchor-only at
// ANCHOR_READY, full at COMPLETE); byte counts are compared across the sides.
//
// Built twice (tests/CMakeLists.txt):
//  - xfer_gpu_test (label "gpu"): the real kernels.  Without a usable device
//    every transfer case skips, and NoDeviceIsAClearError checks the error.
//  - xfer_gpu_emu_test (label "gpu-emu"): the kernels' CPU emulation
//    (support/cuda_emu/, "device" memory is host memory), so the engine's device
//    path runs in CI.
//
// CUDA cannot be used in a child forked after the parent initialised it, so
// the parent never calls CUDA: both ranks of every transfer run in forked
// children, which report failures on stderr and by exit status.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fork_child.h"
#include "xfer/engine.h"
#include "xfer_util.h"

namespace kvxfer {
namespace {

#define CHILD_CHECK(cond, ...)                             \
  do {                                                     \
    if (!(cond)) {                                         \
      std::fprintf(stderr, "%s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                   \
      std::fprintf(stderr, "\n");                          \
      return 1;                                            \
    }                                                      \
  } while (0)

/** Runs fn in a forked child; its exit status (0 = pass), or -1 if it did not end. */
int in_child(const std::function<int()>& fn, double seconds = 120) {
  Child c;
  if (!c.start([&](int, int) { return fn(); })) return -1;
  if (!c.wait(seconds)) return -1;
  return WIFEXITED(c.status) ? WEXITSTATUS(c.status) : -1;
}

/** Whether a usable device exists, asked in a child so the parent stays CUDA-free. */
bool have_device(std::string* why) {
  static int cached = -1;
  static std::string reason;
  if (cached < 0) {
    const int rc = in_child([] {
      int n = 0;
      const cudaError_t e = cudaGetDeviceCount(&n);
      if (e != cudaSuccess) {
        std::fprintf(stderr, "cudaGetDeviceCount: %s\n", cudaGetErrorString(e));
        return 2;
      }
      return n > 0 ? 0 : 3;
    });
    cached = rc == 0 ? 1 : 0;
    reason = rc == 2   ? "CUDA reports an error (no driver or no device)"
             : rc == 3 ? "no CUDA device"
                       : "the device probe failed";
  }
  *why = reason;
  return cached == 1;
}

#define REQUIRE_DEVICE()                           \
  do {                                             \
    std::string why_;                              \
    if (!have_device(&why_)) GTEST_SKIP() << why_; \
  } while (0)

/** A PagedKV mirrored in device memory: one cudaMalloc per block. */
struct DeviceKV {
  PagedKV& host;
  std::vector<void*> k, v;
  kvxfer_kv_desc_t desc;

  explicit DeviceKV(PagedKV& h) : host(h), desc(h.desc) {}
  /** Copies the blocks to `device` and waits until they are there. */
  bool upload(int device = 0) {
    int prev = 0;
    if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) return false;
    for (size_t i = 0; i < host.k.size() + host.v.size(); ++i) {
      const bool is_k = i < host.k.size();
      void* hp = is_k ? host.k[i] : host.v[i - host.k.size()];
      const size_t n = host.storage[i].size();
      void* d = nullptr;
      if (cudaMalloc(&d, n) != cudaSuccess) return false;
      if (cudaMemcpy(d, hp, n, cudaMemcpyHostToDevice) != cudaSuccess) return false;
      (is_k ? k : v).push_back(d);
    }
    // A cudaMemcpy from pageable memory may return before the DMA has landed;
    // kvxfer's streams are non-blocking, so wait here (the stream-ordered
    // case has its own test: kvxfer_send_on_stream).
    if (cudaDeviceSynchronize() != cudaSuccess) return false;
    desc.k_blocks = k.data();
    desc.v_blocks = v.data();
    desc.device = device;
    return cudaSetDevice(prev) == cudaSuccess;
  }
  /** Copies the device blocks back into the host mirror. */
  bool download() {
    for (size_t i = 0; i < host.k.size() + host.v.size(); ++i) {
      const bool is_k = i < host.k.size();
      void* hp = is_k ? host.k[i] : host.v[i - host.k.size()];
      void* d = is_k ? k[i] : v[i - host.k.size()];
      if (cudaMemcpy(hp, d, host.storage[i].size(), cudaMemcpyDeviceToHost) != cudaSuccess)
        return false;
    }
    return true;
  }
  /** download() in `st`'s order: after the work enqueued on it before (then synchronised). */
  bool download_on(cudaStream_t st) {
    for (size_t i = 0; i < host.k.size() + host.v.size(); ++i) {
      const bool is_k = i < host.k.size();
      void* hp = is_k ? host.k[i] : host.v[i - host.k.size()];
      void* d = is_k ? k[i] : v[i - host.k.size()];
      if (cudaMemcpyAsync(hp, d, host.storage[i].size(), cudaMemcpyDeviceToHost, st) != cudaSuccess)
        return false;
    }
    return cudaStreamSynchronize(st) == cudaSuccess;
  }
  ~DeviceKV() {
    for (void* p : k) cudaFree(p);
    for (void* p : v) cudaFree(p);
  }
};

struct Shape {
  int32_t L = 2, heads = 2, hd = 64;
  int64_t T = 300;
  int32_t page_tokens = 128;
};

enum class Where { kHost, kDevice };

/** rank 1: sends a KV filled from `seed`, from the host or the device. */
int gpu_sender(const kvxfer_unique_id_t& id, int wr, const Shape& s, Where where,
               const kvxfer_codec_config_t& cfg, kvxfer_mode_t mode, uint64_t seed,
               kvxfer_result_t expect = KVXFER_SUCCESS) {
  kvxfer_comm_t comm = init_rank(id, 1);
  CHILD_CHECK(comm != nullptr, "sender: init");
  PagedKV kv(s.L, s.heads, s.hd, s.T, 16);
  kv.fill(seed);
  DeviceKV dev(kv);
  if (where == Where::kDevice) CHILD_CHECK(dev.upload(), "sender: upload");
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.mode = mode;
  rc.page_tokens = s.page_tokens;
  rc.tag = 9;
  kvxfer_request_t req = nullptr;
  const kvxfer_kv_desc_t& d = where == Where::kDevice ? dev.desc : kv.desc;
  CHILD_CHECK(kvxfer_send(comm, 0, &d, &cfg, &rc, &req) == KVXFER_SUCCESS, "sender: send: %s",
              kvxfer_get_last_error());
  const kvxfer_result_t r = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000);
  const std::string err = r == KVXFER_SUCCESS ? "" : kvxfer_get_last_error();
  CHILD_CHECK(r == expect, "sender: wait gave %d (%s), expected %d", r, err.c_str(), expect);
  write_report(wr, req, err);
  kvxfer_request_free(req);
  kvxfer_comm_destroy(comm);
  return 0;
}

/** Compares every layer's K and V of `got` and `want`; 0 if bit-equal. */
int compare(PagedKV& got, PagedKV& want, const char* what) {
  for (int32_t l = 0; l < got.L; ++l)
    for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE}) {
      const auto a = got.bytes(l, kind), b = want.bytes(l, kind);
      CHILD_CHECK(a.size() == b.size(), "%s: sizes differ", what);
      for (size_t i = 0; i < a.size(); ++i)
        CHILD_CHECK(a[i] == b[i], "%s: layer %d %c byte %zu: got 0x%02x, expected 0x%02x", what, l,
                    kind == KVXFER_KV_KEY ? 'K' : 'V', i, a[i], b[i]);
    }
  return 0;
}

/**
 * rank 0: receives into host or device blocks of another geometry (block 48,
 * padded rows), checks anchor-only values at ANCHOR_READY (residuals held
 * back) and full values at COMPLETE against the CPU codec, and the byte
 * counts against the sender's.
 */
int gpu_receiver(const kvxfer_unique_id_t& id, int rd, const Shape& s, Where where,
                 const kvxfer_codec_config_t& cfg, uint64_t seed) {
  kvxfer_comm_t comm = init_rank(id, 0);
  CHILD_CHECK(comm != nullptr, "receiver: init");
  PagedKV dst(s.L, s.heads, s.hd, s.T, 48, KVXFER_DTYPE_BF16, 5);
  DeviceKV dev(dst);
  if (where == Where::kDevice) CHILD_CHECK(dev.upload(), "receiver: upload");
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.tag = 9;
  test_hooks()->pause_residuals = true;
  kvxfer_request_t req = nullptr;
  const kvxfer_kv_desc_t& d = where == Where::kDevice ? dev.desc : dst.desc;
  CHILD_CHECK(kvxfer_recv(comm, 1, &d, &rc, &req) == KVXFER_SUCCESS, "receiver: recv: %s",
              kvxfer_get_last_error());
  CHILD_CHECK(kvxfer_wait(req, KVXFER_STAGE_ANCHOR_READY, 60000) == KVXFER_SUCCESS,
              "receiver: anchor wait: %s", kvxfer_get_last_error());
  PagedKV src(s.L, s.heads, s.hd, s.T, 16);
  src.fill(seed);
  const kvxfer_request_info_t mid = info_of(req);
  if (mid.mode == KVXFER_MODE_PROGRESSIVE) {
    PagedKV anchor(s.L, s.heads, s.hd, s.T, 64);
    expected_decode(src, cfg, s.page_tokens, 9, false, &anchor);
    if (where == Where::kDevice) CHILD_CHECK(dev.download(), "receiver: download");
    if (compare(dst, anchor, "anchor-only") != 0) return 1;
    CHILD_CHECK(mid.pages_complete == 0, "residuals applied while paused");
  }
  test_hooks()->pause_residuals = false;
  if (where == Where::kDevice) {
    // Stream-ordered: a copy enqueued after kvxfer_request_wait_on_stream
    // on a non-blocking stream reads the full values.
    CHILD_CHECK(kvxfer_request_wait_on_stream(req, KVXFER_STAGE_POSTED, nullptr) ==
                    KVXFER_ERR_INVALID_ARGUMENT,
                "receiver: a stream wait for POSTED was not refused");
    cudaStream_t st = nullptr;
    CHILD_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess,
                "receiver: stream");
    CHILD_CHECK(kvxfer_request_wait_on_stream(req, KVXFER_STAGE_COMPLETE, st) == KVXFER_SUCCESS,
                "receiver: stream wait: %s", kvxfer_get_last_error());
    CHILD_CHECK(dev.download_on(st), "receiver: download on the stream");
    cudaStreamDestroy(st);
    kvxfer_stage_t stage = KVXFER_STAGE_POSTED;
    CHILD_CHECK(kvxfer_test(req, &stage) == KVXFER_SUCCESS && stage == KVXFER_STAGE_COMPLETE,
                "receiver: the stream passed its wait at stage %d", static_cast<int>(stage));
    PagedKV full(s.L, s.heads, s.hd, s.T, 64);
    expected_decode(src, cfg, s.page_tokens, 9, true, &full);
    if (compare(dst, full, "full, read on the stream") != 0) return 1;
  }
  CHILD_CHECK(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000) == KVXFER_SUCCESS,
              "receiver: complete wait: %s", kvxfer_get_last_error());
  PagedKV full(s.L, s.heads, s.hd, s.T, 64);
  expected_decode(src, cfg, s.page_tokens, 9, true, &full);
  if (where == Where::kDevice) CHILD_CHECK(dev.download(), "receiver: download");
  if (compare(dst, full, "full") != 0) return 1;
  const kvxfer_request_info_t end = info_of(req);
  SenderReport rep;
  CHILD_CHECK(read_report(rd, &rep), "receiver: sender report");
  CHILD_CHECK(rep.anchor == end.anchor_wire_bytes && rep.residual == end.residual_wire_bytes,
              "bytes sent %llu+%llu, received %llu+%llu", (unsigned long long)rep.anchor,
              (unsigned long long)rep.residual, (unsigned long long)end.anchor_wire_bytes,
              (unsigned long long)end.residual_wire_bytes);
  kvxfer_request_free(req);
  kvxfer_comm_destroy(comm);
  return 0;
}

/** How a request ended: result, error text and the final info. */
struct Outcome {
  kvxfer_result_t result = KVXFER_IN_PROGRESS;
  std::string error;
  kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
};

/** rank 0: receives into device blocks (block 16) and records how it ended. */
int device_receive(const kvxfer_unique_id_t& id, const Shape& s, Outcome* out) {
  kvxfer_comm_t comm = init_rank(id, 0);
  CHILD_CHECK(comm != nullptr, "receiver: init");
  PagedKV dst(s.L, s.heads, s.hd, s.T, 16);
  DeviceKV dev(dst);
  CHILD_CHECK(dev.upload(), "upload");
  kvxfer_request_t req = nullptr;
  CHILD_CHECK(kvxfer_recv(comm, 1, &dev.desc, nullptr, &req) == KVXFER_SUCCESS, "recv: %s",
              kvxfer_get_last_error());
  out->result = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000);
  out->error = out->result < 0 ? kvxfer_get_last_error() : "";
  out->info = info_of(req);
  kvxfer_request_free(req);
  kvxfer_comm_destroy(comm);
  return 0;
}

/** Both ranks in children: the sender forked by the receiver's child. */
void transfer(Where from, Where to, const kvxfer_codec_config_t& cfg, kvxfer_mode_t mode) {
  Shape s;
  const uint64_t seed = 77;
  const int rc = in_child([&] {
    Pair pair;
    if (!pair.start([&](const kvxfer_unique_id_t& id, int, int wr) {
          return gpu_sender(id, wr, s, from, cfg, mode, seed);
        }))
      return 20;
    const int r = gpu_receiver(pair.id, pair.child.from_child, s, to, cfg, seed);
    if (!pair.child.wait(60)) return 21;
    return r != 0 ? r : WEXITSTATUS(pair.child.status);
  });
  EXPECT_EQ(rc, 0) << "see the children's messages above";
}

kvxfer_codec_config_t codec(kvxfer_codec_t c, float alpha = 0.0f) {
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  cfg.codec = c;
  cfg.alpha = alpha;
  return cfg;
}

TEST(XferGpu, DeviceToDeviceLynxAnchorThenFullBitExact) {
  REQUIRE_DEVICE();
  transfer(Where::kDevice, Where::kDevice, codec(KVXFER_CODEC_LYNX, 5.0f), KVXFER_MODE_PROGRESSIVE);
}

TEST(XferGpu, DeviceToHostInt8Progressive) {
  REQUIRE_DEVICE();
  transfer(Where::kDevice, Where::kHost, codec(KVXFER_CODEC_INT8), KVXFER_MODE_PROGRESSIVE);
}

TEST(XferGpu, HostToDeviceLynxMonolithic) {
  REQUIRE_DEVICE();
  transfer(Where::kHost, Where::kDevice, codec(KVXFER_CODEC_LYNX), KVXFER_MODE_MONOLITHIC);
}

TEST(XferGpu, DeviceInt4AndBf16) {
  REQUIRE_DEVICE();
  transfer(Where::kDevice, Where::kDevice, codec(KVXFER_CODEC_INT4), KVXFER_MODE_AUTO);
  transfer(Where::kDevice, Where::kDevice, codec(KVXFER_CODEC_BF16), KVXFER_MODE_AUTO);
}

// A NaN in device memory fails both sides with the CPU encoder's message
// (layer, K/V, token, channel), and nothing completes.
TEST(XferGpu, NonFiniteDeviceInputFailsBothSidesNamingTheElement) {
  REQUIRE_DEVICE();
  const int rc = in_child([] {
    Shape s;
    Pair pair;
    if (!pair.start([&](const kvxfer_unique_id_t& id, int, int wr) {
          kvxfer_comm_t comm = init_rank(id, 1);
          CHILD_CHECK(comm != nullptr, "sender: init");
          PagedKV kv(s.L, s.heads, s.hd, s.T, 16);
          kv.fill(5);
          codec::store_elem(kv.row(1, KVXFER_KV_VALUE, 200), 17, kv.dt, NAN);
          DeviceKV dev(kv);
          CHILD_CHECK(dev.upload(), "upload");
          kvxfer_request_t req = nullptr;
          const kvxfer_codec_config_t cfg = codec(KVXFER_CODEC_LYNX);
          CHILD_CHECK(kvxfer_send(comm, 0, &dev.desc, &cfg, nullptr, &req) == KVXFER_SUCCESS,
                      "send: %s", kvxfer_get_last_error());
          const kvxfer_result_t r = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000);
          CHILD_CHECK(r == KVXFER_ERR_NONFINITE, "sender: %d %s", r, kvxfer_get_last_error());
          const std::string e = kvxfer_get_last_error();
          CHILD_CHECK(e.find("layer 1") != std::string::npos &&
                          e.find("token 200") != std::string::npos &&
                          e.find("channel 17") != std::string::npos,
                      "sender's message does not name the element: %s", e.c_str());
          kvxfer_request_free(req);
          kvxfer_comm_destroy(comm);
          (void)wr;
          return 0;
        }))
      return 20;
    Outcome o;
    if (device_receive(pair.id, s, &o) != 0) return 1;
    CHILD_CHECK(o.result < 0, "receiver completed a transfer whose sender failed");
    CHILD_CHECK(o.info.stage != KVXFER_STAGE_COMPLETE, "receiver reports COMPLETE");
    if (!pair.child.wait(60)) return 21;
    return WEXITSTATUS(pair.child.status);
  });
  EXPECT_EQ(rc, 0) << "see the children's messages above";
}

// Refused at post, before any message: alpha=auto (the device encoder cannot
// calibrate), a device ordinal that does not exist.
TEST(XferGpu, DeviceRequestsRefusedAtPost) {
  REQUIRE_DEVICE();
  const int rc = in_child([] {
    Pair pair;
    if (!pair.start(idle_peer)) return 20;
    kvxfer_comm_t comm = init_rank(pair.id, 0);
    CHILD_CHECK(comm != nullptr, "init");
    PagedKV kv(2, 2, 8, 40, 16);
    DeviceKV dev(kv);
    CHILD_CHECK(dev.upload(), "upload");
    kvxfer_request_t req = nullptr;
    kvxfer_codec_config_t cfg = codec(KVXFER_CODEC_LYNX, KVXFER_ALPHA_AUTO);
    CHILD_CHECK(kvxfer_send(comm, 1, &dev.desc, &cfg, nullptr, &req) == KVXFER_ERR_UNSUPPORTED,
                "alpha=auto: %s", kvxfer_get_last_error());
    CHILD_CHECK(std::string(kvxfer_get_last_error()).find("calibrate") != std::string::npos,
                "alpha=auto message: %s", kvxfer_get_last_error());
    cfg = codec(KVXFER_CODEC_LYNX);  // no GPU kernels for token-grouped V pages
    cfg.value_groups = KVXFER_VALUE_GROUPS_TOKEN;
    CHILD_CHECK(kvxfer_send(comm, 1, &dev.desc, &cfg, nullptr, &req) == KVXFER_ERR_UNSUPPORTED,
                "value_groups=token on a device: %s", kvxfer_get_last_error());
    CHILD_CHECK(
        std::string(kvxfer_get_last_error()).find("value_groups=token") != std::string::npos,
        "value_groups=token message: %s", kvxfer_get_last_error());
    cfg = codec(KVXFER_CODEC_SPECTRUM);  // no GPU encoder for SpectrumKV pages
    CHILD_CHECK(kvxfer_send(comm, 1, &dev.desc, &cfg, nullptr, &req) == KVXFER_ERR_UNSUPPORTED,
                "SPECTRUM on a device: %s", kvxfer_get_last_error());
    int n = 0;
    cudaGetDeviceCount(&n);
    kvxfer_kv_desc_t d = dev.desc;
    d.device = n;  // one past the last device
    CHILD_CHECK(kvxfer_recv(comm, 1, &d, nullptr, &req) == KVXFER_ERR_INVALID_ARGUMENT,
                "device %d: %s", n, kvxfer_get_last_error());
    CHILD_CHECK(req == nullptr, "a refused request was returned");
    kvxfer_comm_destroy(comm);
    return release_idle_peer(&pair) ? 0 : 21;
  });
  EXPECT_EQ(rc, 0) << "see the children's messages above";
}

// A host SPECTRUM sender and a device receiver: refused at the handshake on
// both sides (no GPU decoder for SpectrumKV pages), so no page is sent (only
// the empty messages that keep the sequence whole) and nothing is decoded.
TEST(XferGpu, SpectrumIntoDeviceMemoryFailsAtTheHandshake) {
  REQUIRE_DEVICE();
  const int rc = in_child([] {
    Shape s;
    Pair pair;
    if (!pair.start([&](const kvxfer_unique_id_t& id, int, int) {
          kvxfer_comm_t comm = init_rank(id, 1);
          CHILD_CHECK(comm != nullptr, "sender: init");
          PagedKV kv(s.L, s.heads, s.hd, s.T, 16);
          kv.fill(3);
          const kvxfer_codec_config_t cfg = codec(KVXFER_CODEC_SPECTRUM);
          kvxfer_request_t req = nullptr;
          CHILD_CHECK(kvxfer_send(comm, 0, &kv.desc, &cfg, nullptr, &req) == KVXFER_SUCCESS,
                      "send: %s", kvxfer_get_last_error());
          const kvxfer_result_t r = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000);
          CHILD_CHECK(r == KVXFER_ERR_UNSUPPORTED, "sender: %d %s", r, kvxfer_get_last_error());
          kvxfer_request_free(req);
          kvxfer_comm_destroy(comm);
          return 0;
        }))
      return 20;
    Outcome o;
    if (device_receive(pair.id, s, &o) != 0) return 1;
    CHILD_CHECK(o.result == KVXFER_ERR_UNSUPPORTED, "receiver: %d %s", o.result, o.error.c_str());
    CHILD_CHECK(o.error.find("no GPU decoder") != std::string::npos, "message: %s",
                o.error.c_str());
    CHILD_CHECK(o.info.pages_anchor_ready == 0, "pages were decoded");
    if (!pair.child.wait(60)) return 21;
    return WEXITSTATUS(pair.child.status);
  });
  EXPECT_EQ(rc, 0) << "see the children's messages above";
}

// ---------------------------------------------------------------------------
// Process-wide device state, device guards, stream order (issue 44).
// Both ranks of a communicator live in one process here, on threads.
// ---------------------------------------------------------------------------

#ifdef KVXFER_GPU_EMULATION
extern "C" int kvxfer_emu_allocs, kvxfer_emu_frees, kvxfer_emu_sync_copies,
    kvxfer_emu_host_registers, kvxfer_emu_host_register_device;
#endif

/** The calling thread's current device, or -1. */
int current_device() {
  int d = -1;
  return cudaGetDevice(&d) == cudaSuccess ? d : -1;
}

/** Full-precision values of a transfer from a KV filled from `seed`: 0 if bit-equal. */
int check_full(PagedKV& dst, const Shape& s, const kvxfer_codec_config_t& cfg, uint64_t seed,
               uint64_t tag) {
  PagedKV src(s.L, s.heads, s.hd, s.T, 16);
  src.fill(seed);
  PagedKV full(s.L, s.heads, s.hd, s.T, 64);
  expected_decode(src, cfg, s.page_tokens, tag, true, &full);
  return compare(dst, full, "full");
}

/** rank 0 on a thread: receives into host blocks `dst` (block 48, padded rows). */
int host_receive(kvxfer_comm_t comm, PagedKV& dst, uint64_t tag) {
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.tag = tag;
  kvxfer_request_t req = nullptr;
  CHILD_CHECK(kvxfer_recv(comm, 1, &dst.desc, &rc, &req) == KVXFER_SUCCESS, "recv: %s",
              kvxfer_get_last_error());
  CHILD_CHECK(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000) == KVXFER_SUCCESS, "recv wait: %s",
              kvxfer_get_last_error());
  kvxfer_request_free(req);
  return 0;
}

/** Both ranks of one communicator, initialised on two threads. */
struct LocalPair {
  kvxfer_comm_t c[2] = {nullptr, nullptr};
  bool init() {
    kvxfer_unique_id_t id{};
    if (kvxfer_get_unique_id(&id) != KVXFER_SUCCESS) return false;
    std::thread t([&] { c[1] = init_rank(id, 1); });
    c[0] = init_rank(id, 0);
    t.join();
    return c[0] != nullptr && c[1] != nullptr;
  }
  ~LocalPair() {
    std::thread t([&] { kvxfer_comm_destroy(c[1]); });
    kvxfer_comm_destroy(c[0]);
    t.join();
  }
};

/** rank 1's send of `dev` on `stream` (NULL: kvxfer_send), waited for. */
int send_and_wait(kvxfer_comm_t comm, const kvxfer_kv_desc_t& d, const Shape& s,
                  const kvxfer_codec_config_t& cfg, uint64_t tag, void* stream, bool on_stream) {
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.mode = KVXFER_MODE_PROGRESSIVE;
  rc.page_tokens = s.page_tokens;
  rc.tag = tag;
  kvxfer_request_t req = nullptr;
  const kvxfer_result_t r = on_stream ? kvxfer_send_on_stream(comm, 0, &d, &cfg, &rc, stream, &req)
                                      : kvxfer_send(comm, 0, &d, &cfg, &rc, &req);
  CHILD_CHECK(r == KVXFER_SUCCESS, "send: %s", kvxfer_get_last_error());
  CHILD_CHECK(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000) == KVXFER_SUCCESS, "send wait: %s",
              kvxfer_get_last_error());
  kvxfer_request_free(req);
  return 0;
}

// Two communicators of one process send device KV from the same device at
// once: their encodes share the device's streams and scratch (one owner per
// device), and every page arrives bit-exact.  After a warm-up round of the
// same shapes, the pools are full: no later round copies synchronously or
// frees, and the three later rounds together allocate and register at most
// one more block table and staging buffer per communicator (a loaded machine
// may run the warm-up's two requests one after the other, so only a later
// round holds two at once), and one of them allocates nothing (the
// emulation counts).  The
// staging cache keeps idle buffers 60 s here instead of 1 s (it unmaps an
// idle buffer, and drops its registration, after that), so that a slow run
// (ThreadSanitizer) does not lose them between the rounds.
TEST(XferGpu, TwoCommunicatorsEncodeConcurrentlyOnOneDeviceBitExact) {
  REQUIRE_DEVICE();
  const int rc = in_child([] {
    Shape s;
    s.T = 260;
    s.page_tokens = 64;
    test_hooks()->staging_keep_ms = 60000;
    LocalPair p[2];
    for (auto& q : p) CHILD_CHECK(q.init(), "communicator init");
    const kvxfer_codec_config_t cfg[2] = {codec(KVXFER_CODEC_LYNX, 5.0f), codec(KVXFER_CODEC_INT8)};
    const uint64_t seed[2] = {101, 202};
    std::vector<std::unique_ptr<PagedKV>> kv;
    std::vector<std::unique_ptr<DeviceKV>> dev;
    for (int i = 0; i < 2; ++i) {
      kv.push_back(std::make_unique<PagedKV>(s.L, s.heads, s.hd, s.T, 16));
      kv.back()->fill(seed[i]);
      dev.push_back(std::make_unique<DeviceKV>(*kv.back()));
      CHILD_CHECK(dev.back()->upload(0), "upload");
    }
    constexpr int kRounds = 4;
    int counts[kRounds + 1][4] = {};            // before each round and after the last
    std::vector<std::unique_ptr<PagedKV>> got;  // [round * 2 + i]
    for (int r = 0; r < 2 * kRounds; ++r)
      got.push_back(std::make_unique<PagedKV>(s.L, s.heads, s.hd, s.T, 48, KVXFER_DTYPE_BF16, 5));
    auto count = [&](int at) {
#ifdef KVXFER_GPU_EMULATION
      counts[at][0] = kvxfer_emu_allocs;
      counts[at][1] = kvxfer_emu_frees;
      counts[at][2] = kvxfer_emu_sync_copies;
      counts[at][3] = kvxfer_emu_host_registers;
#else
      (void)at;
#endif
    };
    for (int round = 0; round < kRounds; ++round) {
      count(round);
      int res[4] = {-1, -1, -1, -1};
      std::vector<std::thread> th;
      for (int i = 0; i < 2; ++i) {
        const uint64_t tag = 10 * round + i;
        th.emplace_back([&, i, tag] {
          res[2 * i] = send_and_wait(p[i].c[1], dev[i]->desc, s, cfg[i], tag, nullptr, false);
        });
        th.emplace_back([&, i, tag, round] {
          res[2 * i + 1] = host_receive(p[i].c[0], *got[2 * round + i], tag);
        });
      }
      for (auto& t : th) t.join();
      for (int i = 0; i < 4; ++i) CHILD_CHECK(res[i] == 0, "round %d, thread %d failed", round, i);
    }
    count(kRounds);
#ifdef KVXFER_GPU_EMULATION
    const int* w = counts[1];  // after the warm-up round
    const int* e = counts[kRounds];
    bool some_round_allocates_nothing = false;
    for (int r = 1; r < kRounds; ++r)
      some_round_allocates_nothing |= counts[r + 1][0] == counts[r][0];
    CHILD_CHECK(e[1] == w[1] && e[2] == w[2] && e[0] - w[0] <= 2 && e[3] - w[3] <= 2 &&
                    some_round_allocates_nothing,
                "after warm-up: %d allocations, %d frees, %d synchronous copies, %d host "
                "registrations in %d rounds (expected at most 2, 0, 0, 2, and a round with no "
                "allocation)",
                e[0] - w[0], e[1] - w[1], e[2] - w[2], e[3] - w[3], kRounds - 1);
#else
    (void)counts;
#endif
    for (int round = 0; round < kRounds; ++round)
      for (int i = 0; i < 2; ++i)
        if (check_full(*got[2 * round + i], s, cfg[i], seed[i], 10 * round + i) != 0) return 1;
    return 0;
  });
  EXPECT_EQ(rc, 0) << "see the children's messages above";
}

// Every API call leaves the calling thread's current device as it was, with
// the KV on another device; host registrations are made on the KV's device
// (the progress thread's default device 0 would create a context there).
TEST(XferGpu, ApiCallsKeepTheCallersCurrentDevice) {
  REQUIRE_DEVICE();
  const int rc = in_child([] {
    int n = 0;
    CHILD_CHECK(cudaGetDeviceCount(&n) == cudaSuccess && n >= 1, "device count");
    const int kvd = n > 1 ? 1 : 0;   // the KV's device
    const int mine = n > 2 ? 2 : 0;  // the caller's current device
    Shape s;
    s.T = 100;
    s.page_tokens = 64;
    LocalPair p;
    CHILD_CHECK(p.init(), "communicator init");
    PagedKV kv(s.L, s.heads, s.hd, s.T, 16);
    kv.fill(7);
    DeviceKV dev(kv);
    CHILD_CHECK(dev.upload(kvd), "upload");
    PagedKV back(s.L, s.heads, s.hd, s.T, 16);
    DeviceKV rdev(back);
    CHILD_CHECK(rdev.upload(kvd), "upload");
    const kvxfer_codec_config_t cfg = codec(KVXFER_CODEC_LYNX, 5.0f);
    int rres = -1;
    std::thread recv_thread([&] {  // rank 0: device blocks, its own current device
      const int other = n > 3 ? 3 : 0;
      if (cudaSetDevice(other) != cudaSuccess) return;
      kvxfer_request_t req = nullptr;
      kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
      rc.tag = 3;
      if (kvxfer_recv(p.c[0], 1, &rdev.desc, &rc, &req) != KVXFER_SUCCESS) return;
      if (current_device() != other) return;
      const kvxfer_result_t w = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000);
      if (current_device() != other || w != KVXFER_SUCCESS) return;
      kvxfer_request_free(req);
      rres = current_device() == other ? 0 : 1;
    });
    CHILD_CHECK(cudaSetDevice(mine) == cudaSuccess, "cudaSetDevice");
    kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
    rc.tag = 3;
    rc.page_tokens = s.page_tokens;
    kvxfer_request_t req = nullptr;
    CHILD_CHECK(
        kvxfer_send_on_stream(p.c[1], 0, &dev.desc, &cfg, &rc, nullptr, &req) == KVXFER_SUCCESS,
        "send: %s", kvxfer_get_last_error());
    CHILD_CHECK(current_device() == mine, "kvxfer_send_on_stream changed the device to %d",
                current_device());
    kvxfer_stage_t st;
    (void)kvxfer_test(req, &st);
    CHILD_CHECK(current_device() == mine, "kvxfer_test changed the device");
    CHILD_CHECK(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000) == KVXFER_SUCCESS, "wait: %s",
                kvxfer_get_last_error());
    CHILD_CHECK(current_device() == mine, "kvxfer_wait changed the device");
    kvxfer_request_free(req);
    recv_thread.join();
    CHILD_CHECK(rres == 0, "the receiving thread's device changed, or its transfer failed");
    CHILD_CHECK(rdev.download(), "download");
    PagedKV full(s.L, s.heads, s.hd, s.T, 64);
    expected_decode(kv, cfg, s.page_tokens, 3, true, &full);
    if (compare(back, full, "full") != 0) return 1;
#ifdef KVXFER_GPU_EMULATION
    CHILD_CHECK(kvxfer_emu_host_register_device == kvd,
                "staging was registered with device %d current, not the KV's device %d",
                kvxfer_emu_host_register_device, kvd);
#endif
    CHILD_CHECK(current_device() == mine, "the device changed");
    return 0;
  });
  EXPECT_EQ(rc, 0) << "see the children's messages above";
}

#ifndef KVXFER_GPU_EMULATION
void CUDART_CB sleep_on_stream(void*) { usleep(300 * 1000); }
#endif

// kvxfer_send_on_stream right after a producer that has not finished: the
// KV's final values are copied in on a non-blocking stream behind a 300 ms
// host function, and the send is posted at once, unsynchronised.  The
// receiver must get the final values, bit for bit (not the stale ones).
// Needs real streams: skipped in the emulation, where everything runs at once.
TEST(XferGpu, SendOnStreamWaitsForAnUnsynchronisedProducer) {
  REQUIRE_DEVICE();
#ifdef KVXFER_GPU_EMULATION
  GTEST_SKIP() << "emulated streams run everything at once: nothing to wait for";
#else
  const int rc = in_child([] {
    Shape s;
    s.page_tokens = 64;
    LocalPair p;
    CHILD_CHECK(p.init(), "communicator init");
    PagedKV stale(s.L, s.heads, s.hd, s.T, 16);
    stale.fill(1);
    DeviceKV dev(stale);
    CHILD_CHECK(dev.upload(0), "upload");
    PagedKV fresh(s.L, s.heads, s.hd, s.T, 16);
    fresh.fill(2);
    cudaStream_t prod = nullptr;
    CHILD_CHECK(cudaStreamCreateWithFlags(&prod, cudaStreamNonBlocking) == cudaSuccess, "stream");
    std::vector<void*> pinned;
    CHILD_CHECK(cudaLaunchHostFunc(prod, sleep_on_stream, nullptr) == cudaSuccess, "host func");
    for (size_t i = 0; i < fresh.storage.size(); ++i) {
      const bool is_k = i < fresh.k.size();
      const size_t n = fresh.storage[i].size();
      void* h = nullptr;
      CHILD_CHECK(cudaMallocHost(&h, n) == cudaSuccess, "cudaMallocHost");
      std::memcpy(h, is_k ? fresh.k[i] : fresh.v[i - fresh.k.size()], n);
      pinned.push_back(h);
      void* d = is_k ? dev.k[i] : dev.v[i - fresh.k.size()];
      CHILD_CHECK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, prod) == cudaSuccess, "copy");
    }
    const kvxfer_codec_config_t cfg = codec(KVXFER_CODEC_LYNX, 5.0f);
    int rres = -1;
    PagedKV got(s.L, s.heads, s.hd, s.T, 48, KVXFER_DTYPE_BF16, 5);
    std::thread rt([&] { rres = host_receive(p.c[0], got, 4); });
    const int sres = send_and_wait(p.c[1], dev.desc, s, cfg, 4, prod, true);
    rt.join();
    cudaStreamSynchronize(prod);
    for (void* h : pinned) cudaFreeHost(h);
    cudaStreamDestroy(prod);
    CHILD_CHECK(sres == 0 && rres == 0, "sender %d, receiver %d", sres, rres);
    return check_full(got, s, cfg, 2, 4);  // seed 1 here: the stale KV was encoded
  });
  EXPECT_EQ(rc, 0) << "see the children's messages above";
#endif
}

#ifndef KVXFER_GPU_EMULATION
// On a machine without a usable device (CI), a device request is a clear
// error at post, not a crash or a hang.
TEST(XferGpu, NoDeviceIsAClearError) {
  std::string why;
  if (have_device(&why)) GTEST_SKIP() << "a device is present";
  const int rc = in_child([] {
    Pair pair;
    if (!pair.start(idle_peer)) return 20;
    kvxfer_comm_t comm = init_rank(pair.id, 0);
    CHILD_CHECK(comm != nullptr, "init");
    PagedKV kv(2, 2, 8, 40, 16);
    kvxfer_kv_desc_t d = kv.desc;
    d.device = 0;
    kvxfer_request_t req = nullptr;
    const kvxfer_result_t r = kvxfer_send(comm, 1, &d, nullptr, nullptr, &req);
    CHILD_CHECK(r == KVXFER_ERR_UNSUPPORTED || r == KVXFER_ERR_INVALID_ARGUMENT, "send gave %d: %s",
                r, kvxfer_get_last_error());
    CHILD_CHECK(std::string(kvxfer_get_last_error()).find("CUDA device 0") != std::string::npos,
                "message: %s", kvxfer_get_last_error());
    CHILD_CHECK(req == nullptr, "a refused request was returned");
    kvxfer_comm_destroy(comm);
    return release_idle_peer(&pair) ? 0 : 21;
  });
  EXPECT_EQ(rc, 0) << "see the children's messages above";
}
#endif

}  // namespace
}  // namespace kvxfer

int main(int argc, char** argv) {
  setenv("KVXFER_CODEC_THREADS", "1", 1);  // no OpenMP pool before fork()
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
