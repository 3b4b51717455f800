// The GPU half of kvxfer_send / kvxfer_recv (src/xfer/device.h) on the page
// codec of kernels/: registered at load time wherever this file is linked
// (libkvxfer.so in a CUDA build, the GPU transfer tests).  docs/GPU.md,
// "GPU path of kvxfer_send/recv".
//
// Device state is process-wide, one owner per device (DeviceState): every
// communicator of the process that moves KV on device N uses N's streams,
// scratch, table pool, event pool and registrations, under N's locks.  Every
// CUDA call runs under a DeviceGuard, so the calling thread's current device
// is the same after every call as before.
//
// Per-request path after warm-up (the first request of a shape on a device):
// no cudaMalloc, cudaMallocHost, cudaHostRegister, cudaFree or synchronous
// cudaMemcpy.  Block tables come from a per-device pool and are uploaded with
// cudaMemcpyAsync on the anchor stream; staging registrations are kept for
// the life of the staging buffer (forget, before the engine's StagingCache
// unmaps it); ready events come from a per-device pool.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "codec/page.h"
#include "common/error.h"
#include "common/log.h"
#include "cuda/cuda_check.h"
#include "cuda/device_codec.h"
#include "cuda/device_guard.h"
#include "xfer/device.h"

namespace kvxfer::cuda {
namespace {

/** Everything kvxfer keeps on one device, shared by every communicator of the process. */
struct DeviceState {
  int device = -1;
  // Created once (DeviceCodec::state), never destroyed (process lifetime).
  cudaStream_t anchor_stream = nullptr;    // encode, anchor-only decode, table uploads
  cudaStream_t residual_stream = nullptr;  // full-precision decode: default priority

  // ---- codec work (codec_mu): one encode or decode at a time on this device ----
  std::mutex codec_mu;
  DeviceScratch scratch;
  int64_t scratch_tokens = 0;
  int32_t scratch_channels = 0;

  // ---- pools (pool_mu): any thread ----
  std::mutex pool_mu;
  std::multimap<size_t, DeviceBuffer*> free_tables;  // capacity -> a table buffer not in use
  std::vector<cudaEvent_t> free_events;              // recorded by nobody any more
  cudaEvent_t tables_event = nullptr;                // after an upload / a release
};

/** Capacity class of a table of `bytes` (a power of two from 4 KiB: few classes, much reuse). */
size_t table_class(size_t bytes) {
  size_t c = 4096;
  while (c < bytes) c *= 2;
  return c;
}

class CudaDeviceCodec final : public xfer::DeviceCodec {
 public:
  kvxfer_result_t check_device(int device) override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
      return set_error(KVXFER_ERR_UNSUPPORTED, "the KV is on CUDA device %d, but CUDA reports: %s",
                       device, cudaGetErrorString(e));
    if (device >= n)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                       "the KV is on CUDA device %d, but this process sees %d device(s)", device,
                       n);
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t upload_table(int device, void* const* ptrs, size_t n,
                               std::shared_ptr<void>* table) override {
    DeviceGuard g;
    KVXFER_CHECK(g.set(device));
    DeviceState* s = nullptr;
    KVXFER_CHECK(state(device, &s));
    const size_t bytes = n * sizeof(void*);
    const size_t cls = table_class(bytes);
    DeviceBuffer* buf = nullptr;
    {
      std::lock_guard<std::mutex> lk(s->pool_mu);
      auto it = s->free_tables.find(cls);
      if (it != s->free_tables.end()) {
        buf = it->second;
        s->free_tables.erase(it);
      }
    }
    if (buf == nullptr) {  // warm-up: this size class has no free table yet
      std::unique_ptr<DeviceBuffer> b(new DeviceBuffer);
      KVXFER_CHECK(cuda_result(b->alloc(cls), "cudaMalloc(block table)", device));
      buf = b.release();
    }
    // Returned to the pool, never freed: a later upload into it is ordered
    // after every use of it by the streams (release below).
    std::shared_ptr<DeviceBuffer> owner(buf, [s](DeviceBuffer* b) { release_table(s, b); });
    // Asynchronous, on the anchor stream (encode and anchor decode run there
    // after it).  The source is pageable: cudaMemcpyAsync copies it to a
    // staging buffer before returning, so `ptrs` may go at once.  The
    // residual stream waits for the upload through tables_event.
    {
      std::lock_guard<std::mutex> lk(s->pool_mu);
      KVXFER_CHECK(cuda_result(
          cudaMemcpyAsync(buf->p, ptrs, bytes, cudaMemcpyHostToDevice, s->anchor_stream),
          "cudaMemcpyAsync(block table)", device));
      KVXFER_CHECK(cuda_result(cudaEventRecord(s->tables_event, s->anchor_stream),
                               "cudaEventRecord(block table)", device));
      KVXFER_CHECK(cuda_result(cudaStreamWaitEvent(s->residual_stream, s->tables_event, 0),
                               "cudaStreamWaitEvent(block table)", device));
    }
    *table = std::shared_ptr<void>(owner, owner->p);  // owns the buffer, points at the table
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t pin(int device, void* p, size_t len, std::shared_ptr<void>* handle) override {
    if (len == 0 || p == nullptr) return KVXFER_SUCCESS;
    std::lock_guard<std::mutex> lk(pin_mu_);
    Pinned& reg = pinned_[reinterpret_cast<uintptr_t>(p)];
    if (reg.len < len) {  // first use of this buffer (or a larger one at the same address)
      DeviceGuard g;      // registration needs a context: the KV's device, not device 0
      KVXFER_CHECK(g.set(device));
      if (reg.len > 0) {
        cudaHostUnregister(p);
        reg.len = 0;
      }
      const cudaError_t e = cudaHostRegister(p, len, cudaHostRegisterPortable);
      if (e != cudaSuccess) {
        pinned_.erase(reinterpret_cast<uintptr_t>(p));
        return cuda_result(e, "cudaHostRegister(staging)", device);
      }
      reg.len = len;
      reg.device = device;
    }
    // The registration outlives the handle: it is dropped by forget, when the
    // staging buffer is unmapped.
    *handle = std::shared_ptr<void>(p, [](void*) {});
    return KVXFER_SUCCESS;
  }

  void forget(void* p, size_t len) override {
    std::lock_guard<std::mutex> lk(pin_mu_);
    const auto b = reinterpret_cast<uintptr_t>(p);
    for (auto it = pinned_.lower_bound(b); it != pinned_.end() && it->first < b + len;) {
      DeviceGuard g;  // the device it was registered with: no context made elsewhere
      if (g.set(it->second.device) == KVXFER_SUCCESS)
        cudaHostUnregister(reinterpret_cast<void*>(it->first));
      it = pinned_.erase(it);
    }
  }

  kvxfer_result_t enqueue_host_func(void* stream, void (*fn)(void*), void* arg) override {
    cudaStream_t st = stream != nullptr ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
    const cudaError_t e = cudaLaunchHostFunc(st, fn, arg);
    if (e != cudaSuccess)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                       "cudaLaunchHostFunc on the caller's stream %p failed (%s)", stream,
                       cudaGetErrorString(e));
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t record_ready(int device, void* stream, std::shared_ptr<void>* ready) override {
    DeviceGuard g;
    KVXFER_CHECK(g.set(device));
    DeviceState* s = nullptr;
    KVXFER_CHECK(state(device, &s));
    cudaEvent_t ev = nullptr;
    {
      std::lock_guard<std::mutex> lk(s->pool_mu);
      if (!s->free_events.empty()) {
        ev = s->free_events.back();
        s->free_events.pop_back();
      }
    }
    if (ev == nullptr)  // warm-up: as many events as requests ever in flight at once
      KVXFER_CHECK(cuda_result(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming),
                               "cudaEventCreateWithFlags(ready)", device));
    std::shared_ptr<void> owner(static_cast<void*>(ev), [s](void* e) {
      // A stream that waited on it captured its state then: reusable at once.
      std::lock_guard<std::mutex> lk(s->pool_mu);
      s->free_events.push_back(static_cast<cudaEvent_t>(e));
    });
    cudaStream_t st = stream != nullptr ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
    const cudaError_t e = cudaEventRecord(ev, st);
    if (e != cudaSuccess)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                       "CUDA device %d: recording an event on the caller's stream %p failed (%s); "
                       "the stream must belong to the KV's device",
                       device, stream, cudaGetErrorString(e));
    *ready = std::move(owner);
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t encode(int device, const void* ready, const kvxfer_codec_config_t* cfg,
                         const kvxfer_page_id_t* id, const kvxfer_page_layout_t* src, void* anchor,
                         size_t anchor_cap, size_t* anchor_len, void* residual, size_t residual_cap,
                         size_t* residual_len) override {
    DeviceGuard g;
    KVXFER_CHECK(g.set(device));
    DeviceState* s = nullptr;
    KVXFER_CHECK(state(device, &s));
    std::lock_guard<std::mutex> lk(s->codec_mu);
    KVXFER_CHECK(grow_scratch(s, src->num_tokens, src->num_channels));
    if (ready != nullptr)  // the producer's work on the caller's stream, before the kernels
      KVXFER_CHECK(
          cuda_result(cudaStreamWaitEvent(s->anchor_stream,
                                          static_cast<cudaEvent_t>(const_cast<void*>(ready)), 0),
                      "cudaStreamWaitEvent(ready)", device));
    return encode_page_device(cfg, id, src, s->scratch, anchor, anchor_cap, anchor_len, residual,
                              residual_cap, residual_len, s->anchor_stream);
  }

  kvxfer_result_t decode(int device, const void* anchor, size_t anchor_len, const void* residual,
                         size_t residual_len, const kvxfer_page_id_t* expect,
                         const kvxfer_page_layout_t* dst) override {
    DeviceGuard g;
    KVXFER_CHECK(g.set(device));
    DeviceState* s = nullptr;
    KVXFER_CHECK(state(device, &s));
    std::lock_guard<std::mutex> lk(s->codec_mu);
    KVXFER_CHECK(grow_scratch(s, dst->num_tokens, dst->num_channels));
    cudaStream_t stream = residual == nullptr ? s->anchor_stream : s->residual_stream;
    DeviceCodebook keep;  // the tables the kernel reads, held until the stream passed it
    KVXFER_CHECK(decode_page_device(anchor, anchor_len, residual, residual_len, expect, dst,
                                    s->scratch, stream, &keep));
    // The host sections may be reused once this returns, and ANCHOR_READY /
    // COMPLETE promise the values are in dst: read_status waits for the
    // stream, after the decode kernel.
    DeviceStatus st{};
    KVXFER_CHECK(read_status(s->scratch.status(), &st, stream));
    if (st.flags & STATUS_BAD_META)
      return set_error(KVXFER_ERR_CORRUPT,
                       "the device decoder rejected the page's metadata (nothing written)");
    return KVXFER_SUCCESS;
  }

 private:
  struct Pinned {
    size_t len = 0;
    int device = 0;  // current when it was registered
  };

  /** Back to the pool once the streams have passed every use of the table. */
  static void release_table(DeviceState* s, DeviceBuffer* b) {
    DeviceGuard g;
    std::lock_guard<std::mutex> lk(s->pool_mu);
    // The next upload into it runs on the anchor stream: order it after the
    // residual stream's decodes (the anchor stream's own work is ordered).
    if (g.set(s->device) == KVXFER_SUCCESS &&
        cudaEventRecord(s->tables_event, s->residual_stream) == cudaSuccess &&
        cudaStreamWaitEvent(s->anchor_stream, s->tables_event, 0) == cudaSuccess) {
      s->free_tables.emplace(b->n, b);
      return;
    }
    KVXFER_WARN(LOG_NET, "CUDA device %d: could not order a block table's reuse; leaking it",
                s->device);
  }

  /** The process's state of `device`, created on first use (the current device must be it). */
  kvxfer_result_t state(int device, DeviceState** out) {
    std::lock_guard<std::mutex> lk(states_mu_);
    std::unique_ptr<DeviceState>& p = states_[device];
    if (p == nullptr) {
      auto s = std::make_unique<DeviceState>();
      s->device = device;
      KVXFER_CHECK(create_anchor_stream(&s->anchor_stream));
      KVXFER_CHECK(
          cuda_result(cudaStreamCreateWithFlags(&s->residual_stream, cudaStreamNonBlocking),
                      "cudaStreamCreateWithFlags(residual stream)", device));
      KVXFER_CHECK(cuda_result(cudaEventCreateWithFlags(&s->tables_event, cudaEventDisableTiming),
                               "cudaEventCreateWithFlags(tables)", device));
      p = std::move(s);
    }
    *out = p.get();
    return KVXFER_SUCCESS;
  }

  /** Grows the scratch of `s` to T x H (codec_mu held; the streams are idle: every op syncs). */
  static kvxfer_result_t grow_scratch(DeviceState* s, int64_t T, int32_t H) {
    if (T <= s->scratch_tokens && H <= s->scratch_channels) return KVXFER_SUCCESS;
    const int64_t t = std::max(T, s->scratch_tokens);
    const int32_t h = std::max(H, s->scratch_channels);
    s->scratch_tokens = 0;
    s->scratch_channels = 0;
    // Sized for the worst case of every codec at this shape, so one scratch
    // serves any sender's codec: codec::max_sizes counts the raw fallback
    // in the anchor, and 2 anchor bits leave the largest residual (6 bits).
    kvxfer_codec_config_t worst = KVXFER_CODEC_CONFIG_INITIALIZER;
    worst.codec = KVXFER_CODEC_INT8;
    worst.anchor_bits = 2;
    worst.chunk_tokens = 16;
    worst.nonfinite = KVXFER_NONFINITE_RAW;
    KVXFER_CHECK(alloc_scratch(&worst, t, h, &s->scratch));
    s->scratch_tokens = t;
    s->scratch_channels = h;
    return KVXFER_SUCCESS;
  }

  std::mutex states_mu_;
  std::map<int, std::unique_ptr<DeviceState>> states_;  // never erased: pointers stay valid
  std::mutex pin_mu_;
  std::map<uintptr_t, Pinned> pinned_;  // staging registrations, by base address
};

struct Registrar {
  Registrar() {
    // Never destroyed: requests, and the streams' last work, may outlive
    // static destruction at exit; the device state lives as long as the process.
    static CudaDeviceCodec* codec = new CudaDeviceCodec;
    xfer::register_device_codec(codec);
  }
};
const Registrar g_registrar;

}  // namespace
}  // namespace kvxfer::cuda
