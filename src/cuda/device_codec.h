// GPU page codec: the device codec API (src/cuda/, static library
// kvxfer_cuda) over the kernels of kernels/ (kernels/codec_kernels.h).
//
// The kernels produce exactly the payload bytes of docs/FORMAT.md section 4
// (the same bytes as codec::encode_page with Impl::REFERENCE) and decode to
// exactly the same values (docs/GPU.md says how).  Two levels:
//
//  - launch_*: enqueue kernels on the caller's stream and return at once.
//    Payloads live in device memory; outcomes the host must act on (need fp32
//    metadata, non-finite input, hostile metadata) land in a DeviceStatus in
//    device memory, read with read_status after the stream reaches it.
//  - encode_page_device / decode_page_device: the whole page codec with the
//    CPU API's contract (same results, same errors, same section bytes), for
//    a page whose KV blocks are in device memory.  Headers and checksums are
//    computed on the host (codec::write_header / codec::seal_section), after
//    the payloads are in host memory (docs/GPU.md, "Headers and checksums").
//
// Device layouts: a kvxfer_page_layout_t whose `blocks` is a DEVICE array of
// DEVICE block pointers (the runtime's block table as it already lives on the
// GPU); the other fields are read on the host.  Every block must be aligned
// to its element size (cudaMalloc'd blocks are).  The host cannot see the
// block pointers, so NULL blocks are not detected (the CPU codec checks them).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "codec/format.h"
#include "cuda/device_buffer.h"
#include "kernels/codec_kernels.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {
struct Codebook;
}

namespace kvxfer::cuda {

/**
 * Device copy of one codebook's tables: the float/int tables the CPU built
 * (codec::get_codebook), copied verbatim, never recomputed on the device.
 * Obtained from upload_codebook.  `mem` owns the device allocation: the
 * tables stay valid while any copy of this struct lives, even after the
 * bounded cache has dropped them.
 */
struct DeviceCodebook {
  std::shared_ptr<const DeviceBuffer> mem;
  const int32_t* lut_base = nullptr;    // Codebook::lut_base
  const float* lut_next = nullptr;      // Codebook::lut_next
  const float* recon_full = nullptr;    // Codebook::recon_full[256]
  const float* recon_anchor = nullptr;  // Codebook::recon_anchor[64]
  const float* anchor_lo = nullptr;     // Codebook::anchor_lo[64]
  const float* anchor_hi = nullptr;     // Codebook::anchor_hi[64]
  int32_t lut_log2 = 0, lut_origin = 0, sign_magnitude = 0;
  int32_t code_bits = 0, anchor_bits = 0, residual_bits = 0;
  int32_t anchor_table = 0;             // codec::has_anchor_table: pages carry a table
  int32_t kind = 0, max_code = 0;       // Codebook::kind, max_code
  float scale_num = 0.0f, bias = 0.0f;  // Codebook::scale_num, bias
};

/**
 * Uploads the tables of `cb` to the current device, once per codebook
 * identity (codec, alpha, anchor bits) and device.  The cache keeps at most
 * codec::kCodebookCacheSize entries per process, like the CPU cache.
 */
kvxfer_result_t upload_codebook(const codec::Codebook* cb, DeviceCodebook* out);

// DeviceStatus and its STATUS_* bits: kernels/codec_kernels.h.

/** Checks the host-visible fields of a device layout (everything but the block pointers). */
kvxfer_result_t validate_device_layout(const kvxfer_page_layout_t* l, const char* what);

// ---------------------------------------------------------------------------
// Low level: enqueue on `stream`, return at once.  Pointers are device memory.
// Payload pointers must be 8-byte aligned.
// ---------------------------------------------------------------------------

/** flags = 0, first_bad = ~0, hist = 0. */
kvxfer_result_t launch_reset_status(DeviceStatus* status, cudaStream_t stream);

/** Copies a status to the host and waits for the stream. */
kvxfer_result_t read_status(const DeviceStatus* status, DeviceStatus* out, cudaStream_t stream);

/**
 * Quantizes a page (LYNX/INT8/INT4, by `cb`).  Writes the anchor payload
 * (metadata, packed anchors, then for the split codecs the per-page anchor
 * table computed on the device from the code histogram) at `anchor_payload`
 * and the residual payload at `residual_payload` (unused when
 * cb.residual_bits == 0), exactly as FORMAT.md 4.2 lays them out, every byte
 * written (no memset needed).
 * The first `sink_rows` rows (>= 0) are the page's sink rows: they do not set
 * the ranges of a chunk that holds other rows (FORMAT.md 2.7).
 * ORs STATUS_NEED_FP32 / STATUS_NONFINITE into *status (reset it first); in
 * either case the payload is incomplete and must not be used.
 */
kvxfer_result_t launch_encode(const DeviceCodebook& cb, const kvxfer_page_layout_t* src,
                              int chunk_tokens, int64_t sink_rows, bool meta_fp32,
                              uint8_t* anchor_payload, uint8_t* residual_payload,
                              DeviceStatus* status, cudaStream_t stream);

/** ORs STATUS_NONFINITE and the first bad element into *status (BF16 codec path). */
kvxfer_result_t launch_scan_nonfinite(const kvxfer_page_layout_t* src, DeviceStatus* status,
                                      cudaStream_t stream);

/**
 * Gathers the page as T*H contiguous values of `out_dtype` (token-major):
 * the raw fallback (out_dtype = src dtype, bit copy) and the BF16 codec
 * (out_dtype = BF16, round to nearest even).
 */
kvxfer_result_t launch_pack_values(const kvxfer_page_layout_t* src, kvxfer_dtype_t out_dtype,
                                   uint8_t* payload, cudaStream_t stream);

/**
 * Decodes a quantized page into `dst` (device layout, any dtype):
 * anchor-only when residual_payload is NULL, else full precision (anchor +
 * residual, overwriting the anchor-precision values in place).  `h` is the
 * parsed anchor header (codec fields, T, H, flags); anchor-only decoding of
 * the split codecs uses the page's anchor table from the anchor payload.
 * First checks every metadata entry and the anchor table on the device; if
 * one is invalid it sets STATUS_BAD_META and writes nothing to dst.
 */
kvxfer_result_t launch_decode(const codec::PageHeader& h, const DeviceCodebook& cb,
                              const uint8_t* anchor_payload, const uint8_t* residual_payload,
                              const kvxfer_page_layout_t* dst, DeviceStatus* status,
                              cudaStream_t stream);

/** Scatters T*H contiguous values of `in_dtype` into `dst` (raw / BF16 sections). */
kvxfer_result_t launch_unpack_values(const uint8_t* payload, kvxfer_dtype_t in_dtype,
                                     const kvxfer_page_layout_t* dst, cudaStream_t stream);

// ---------------------------------------------------------------------------
// High level: the page codec for device pages, synchronous on `stream`.
// ---------------------------------------------------------------------------

/** Device scratch for one page in flight: payload buffers and a status word, owned. */
struct DeviceScratch {
  DeviceBuffer anchor;       // anchor payload, >= max anchor payload (kvxfer_page_max_size - 80)
  DeviceBuffer residual;     // residual payload
  DeviceBuffer status_word;  // one DeviceStatus

  uint8_t* anchor_payload() const { return anchor.p; }
  size_t anchor_cap() const { return anchor.n; }
  uint8_t* residual_payload() const { return residual.p; }
  size_t residual_cap() const { return residual.n; }
  DeviceStatus* status() const { return reinterpret_cast<DeviceStatus*>(status_word.p); }
  void reset() {
    anchor.reset();
    residual.reset();
    status_word.reset();
  }
};

/** (Re)allocates `out` for pages of up to T x H under `cfg`; empty on failure. */
kvxfer_result_t alloc_scratch(const kvxfer_codec_config_t* cfg, int64_t T, int32_t H,
                              DeviceScratch* out);

/**
 * codec::encode_page for a device page: same arguments, checks, errors and
 * section bytes.  Kernels run on `stream`; the payloads are copied into the
 * caller's host buffers `anchor` / `residual` (pinned memory for speed, but
 * any host memory works) and the host writes and seals both headers.
 * Returns when the sections are complete.  alpha = KVXFER_ALPHA_AUTO is
 * UNSUPPORTED here (calibrate on the host, then pass the chosen alpha).
 */
kvxfer_result_t encode_page_device(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                                   const kvxfer_page_layout_t* src, const DeviceScratch& scratch,
                                   void* anchor, size_t anchor_cap, size_t* anchor_len,
                                   void* residual, size_t residual_cap, size_t* residual_len,
                                   cudaStream_t stream);

/**
 * codec::decode_page into a device page: the sections are in host memory
 * and are validated there first (header fields, sizes, checksums, the
 * anchor/residual link, the expected identity, the destination layout, every
 * metadata entry, the anchor table), exactly as the CPU decoder does, before anything is
 * written.  Then the payloads are copied to the scratch and the decode kernel
 * runs on `stream`.  Returns after enqueueing: the host sections must stay
 * valid and dst untouched until the stream has passed this point.  `keep`
 * (optional) receives the codebook the kernel reads: hold it until the
 * stream has passed this point, so that a cache eviction meanwhile cannot
 * free tables a queued decode still reads.
 */
kvxfer_result_t decode_page_device(const void* anchor, size_t anchor_len, const void* residual,
                                   size_t residual_len, const kvxfer_page_id_t* expect,
                                   const kvxfer_page_layout_t* dst, const DeviceScratch& scratch,
                                   cudaStream_t stream, DeviceCodebook* keep = nullptr);

/** A non-blocking stream with the greatest priority the device offers (the anchor path). */
kvxfer_result_t create_anchor_stream(cudaStream_t* out);

}  // namespace kvxfer::cuda
