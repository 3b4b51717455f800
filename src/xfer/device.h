// The GPU half of kvxfer_send / kvxfer_recv, behind an interface.
//
// The engine (engine.cc) has no CUDA dependency: when a request's KV is on a
// CUDA device (kvxfer_kv_desc_t::device >= 0), it calls the DeviceCodec
// registered at load time.  src/cuda/xfer_device.cc implements it on the page
// codec of kernels/ (cuda::encode_page_device / decode_page_device) and
// registers it; a build without CUDA registers none, and device requests fail
// with KVXFER_ERR_UNSUPPORTED.  docs/GPU.md, "GPU path of kvxfer_send/recv".
//
// Staging (the libfabric backend; Debian's libfabric has no FI_HMEM for
// CUDA): the sender's codec thread encodes page i+1 on the device and copies
// its two sections into the request's host send buffers, which are pinned
// (pin), while the progress thread sends page i from the same buffers.  The
// receiver validates the sections on the host, copies their payloads to the
// device and runs the decode kernel; decode returns once the values are in
// the receiver's device blocks, so ANCHOR_READY / COMPLETE keep their meaning.
//
// Stream order (kvxfer_send_on_stream): post() records an event on the
// caller's stream on the caller's thread (record_ready); every encode of the
// request makes kvxfer's stream wait on it, so the kernels read the KV only
// after the work the caller had enqueued before the post.
//
// Threading: every method may be called from any thread, by any number of
// engines (communicators) at once.  The implementation owns one state per
// device for the whole process (streams, scratch, pools) and serialises
// encode/decode per device; it leaves the calling thread's current CUDA
// device as it found it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kvxfer/kvxfer.h"

namespace kvxfer::xfer {

class DeviceCodec {
 public:
  virtual ~DeviceCodec() = default;

  /** SUCCESS if `device` is a usable CUDA device; else an error naming the reason. */
  virtual kvxfer_result_t check_device(int device) = 0;

  /**
   * Copies `n` block pointers (device addresses, as the runtime's block table
   * holds them) into a device array, asynchronously, in stream order before
   * every later encode/decode on `device` (`ptrs` may be reused on return).
   * *table owns it: on release it goes back to a per-device pool, reused once
   * the device has passed every use of it.
   */
  virtual kvxfer_result_t upload_table(int device, void* const* ptrs, size_t n,
                                       std::shared_ptr<void>* table) = 0;

  /**
   * Page-locks `len` bytes of host memory at `p` for fast copies (a staging
   * buffer), with `device` current (its context, not device 0's).  The
   * registration is kept past *handle for the next request that stages
   * through the same buffer, until forget(p, ...) (call it before unmapping).
   * A failure is not an error for the transfer (copies through pageable
   * memory are correct, only slower): the caller logs it and goes on.
   */
  virtual kvxfer_result_t pin(int device, void* p, size_t len, std::shared_ptr<void>* handle) = 0;

  /** Drops every registration of pin() that starts in [p, p + len) (the buffer is going away). */
  virtual void forget(void* p, size_t len) = 0;

  /**
   * Records, on the calling thread, an event on `stream` (a cudaStream_t of
   * `device`; NULL = the legacy default stream) into *ready; pass ready.get()
   * to encode.  Errors: INVALID_ARGUMENT (a stream of another device).
   */
  virtual kvxfer_result_t record_ready(int device, void* stream, std::shared_ptr<void>* ready) = 0;

  /**
   * codec::encode_page for a device page (src.blocks is a device array),
   * ordered after `ready` (from record_ready; NULL: no wait).  Returns when
   * the sections are in the host buffers.
   */
  virtual kvxfer_result_t encode(int device, const void* ready, const kvxfer_codec_config_t* cfg,
                                 const kvxfer_page_id_t* id, const kvxfer_page_layout_t* src,
                                 void* anchor, size_t anchor_cap, size_t* anchor_len,
                                 void* residual, size_t residual_cap, size_t* residual_len) = 0;

  /**
   * codec::decode_page into a device page (dst.blocks is a device array):
   * the same validation before any write; returns when the values are in
   * dst.  residual == NULL decodes at anchor precision.
   */
  virtual kvxfer_result_t decode(int device, const void* anchor, size_t anchor_len,
                                 const void* residual, size_t residual_len,
                                 const kvxfer_page_id_t* expect,
                                 const kvxfer_page_layout_t* dst) = 0;

  /**
   * Enqueues fn(arg) on `stream` (a cudaStream_t; NULL = the legacy default
   * stream) with cudaLaunchHostFunc: later work on the stream waits for it to
   * return.  fn must not call CUDA.  Errors: INVALID_ARGUMENT (CUDA refused
   * the stream; fn is not called and arg stays the caller's).
   */
  virtual kvxfer_result_t enqueue_host_func(void* stream, void (*fn)(void*), void* arg) = 0;
};

/** The registered device codec, or nullptr in a build without CUDA. */
DeviceCodec* device_codec();

/**
 * The device codec for memory on CUDA device `device` (>= 0) in *out, once
 * DeviceCodec::check_device accepts the ordinal.  `what` starts the message
 * ("the KV" or "KV pool: the pool").  Errors: KVXFER_ERR_UNSUPPORTED (a build
 * without CUDA, or CUDA reports no usable driver or device: the message
 * quotes it), KVXFER_ERR_INVALID_ARGUMENT (an ordinal past the last device).
 * Thread-safe.
 */
kvxfer_result_t usable_device_codec(int device, const char* what, DeviceCodec** out);

/** Registers `c` (static lifetime).  Called once, by src/cuda/xfer_device.cc. */
void register_device_codec(DeviceCodec* c);

}  // namespace kvxfer::xfer
