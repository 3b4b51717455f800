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
// Threading: check_device, upload_table and pin may be called from any
// thread; encode and decode from one thread at a time (the engine's codec
// thread), which owns the per-device streams and scratch.
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
   * holds them) into a device array.  *table owns it (freed on release).
   */
  virtual kvxfer_result_t upload_table(int device, void* const* ptrs, size_t n,
                                       std::shared_ptr<void>* table) = 0;

  /**
   * Page-locks `len` bytes of host memory at `p` for fast copies (a staging
   * buffer).  *handle unpins on release.  A failure is not an error for the
   * transfer (copies through pageable memory are correct, only slower): the
   * caller logs it and goes on.
   */
  virtual kvxfer_result_t pin(void* p, size_t len, std::shared_ptr<void>* handle) = 0;

  /** codec::encode_page for a device page (src.blocks is a device array). */
  virtual kvxfer_result_t encode(int device, const kvxfer_codec_config_t* cfg,
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
};

/** The registered device codec, or nullptr in a build without CUDA. */
DeviceCodec* device_codec();

/** Registers `c` (static lifetime).  Called once, by src/cuda/xfer_device.cc. */
void register_device_codec(DeviceCodec* c);

}  // namespace kvxfer::xfer
