// Launches of the page codec's CUDA kernels (kernels/codec_kernels.cu): the
// whole interface of kernels/, and all the host needs to know of it.  Each
// call enqueues its kernels on `stream` and returns at once, with the outcome
// of the launch.  No argument checks here: the validated host interface is
// src/cuda/device_codec.h, which calls these.
//
// The kernels produce the payload bytes of docs/FORMAT.md section 4.2 with the
// element math of src/codec/codec_math.h (docs/GPU.md).  Every pointer is
// device memory; payload and status pointers are 8-byte aligned.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvxfer::cuda {

/** Outcome of the kernels, in device memory (8-byte aligned). */
struct DeviceStatus {
  uint32_t flags;  // STATUS_* bits
  uint32_t reserved;
  uint64_t first_bad;  // (t * H + c) << 1 | is_inf of the first non-finite element
                       // in token-major order; ~0 if none
  uint64_t hist[256];  // encode: the page's histogram of full codes (anchor table, FORMAT 2.4)
};
enum : uint32_t {
  STATUS_NEED_FP32 = 1u << 0,  // a (chunk, channel) range does not fit binary16 metadata
  STATUS_NONFINITE = 1u << 1,  // NaN or Inf in the input
  STATUS_BAD_META = 1u << 2,   // decode: a metadata entry is not finite or d < 0, or an anchor
                               // table entry is outside its bin; nothing written
};

namespace kernels {

/** A page layout as the kernels see it (a device block table). */
struct KLayout {
  void* const* blocks;       // device array of device block pointers
  int64_t block_size;        // tokens per block
  int64_t row_stride_bytes;  // bytes between consecutive tokens of a block
  int64_t first_token;
  int64_t T;
  int32_t H;
  int32_t dtype;  // kvxfer_dtype_t: BF16, FP16 or FP32
};

/** Tables and widths of a device codebook, by value in kernel parameters. */
struct KCodebook {
  const int32_t* __restrict__ base;
  const float* __restrict__ next;
  const float* __restrict__ recon_full;
  const float* __restrict__ recon_anchor;
  const float* __restrict__ anchor_lo;
  const float* __restrict__ anchor_hi;
  int lut_log2, lut_origin, sign_magnitude;
  int A, R;               // anchor / residual bits
  int kind, max_code;     // Codebook::kind, max_code
  float scale_num, bias;  // Codebook::scale_num, bias
};

/**
 * A call's outcome: cudaSuccess, or the error and what it belongs to.  Each
 * call first takes an error left pending by earlier work on this thread
 * (cudaGetLastError() before launching): it returns that error with `kernel`
 * "earlier work (an error pending before <call>)" and launches nothing, so
 * that an old failure is not blamed on this launch.  Otherwise `kernel` names
 * the kernel whose launch failed (cudaGetLastError() right after it).  A
 * sticky error (a lost context) is reported by every call.
 */
struct Launched {
  cudaError_t error;
  const char* kernel;
};

/** flags = 0, first_bad = ~0, hist = 0. */
Launched reset_status(DeviceStatus* status, cudaStream_t stream);

/**
 * Quantizes a page of T > 0 tokens in `chunks` chunks: metadata at `meta`,
 * packed anchors at `anchors`, residuals at `residuals`; ORs STATUS_NEED_FP32 /
 * STATUS_NONFINITE into *status and counts the full codes into status->hist.
 * Rows before `sink_rows` do not set the range of a chunk that holds other
 * rows, and are encoded clamped to it (codec_math.h range_row0).
 */
Launched encode(const KLayout& L, const KCodebook& cb, int chunk_tokens, int64_t chunks,
                int64_t sink_rows, bool meta_fp32, uint8_t* meta, uint8_t* anchors,
                uint8_t* residuals, DeviceStatus* status, cudaStream_t stream);

/** The per-page anchor table (64 floats at `out`) from status->hist, after encode. */
Launched anchor_table(const KCodebook& cb, uint8_t* out, const DeviceStatus* status,
                      cudaStream_t stream);

/** ORs STATUS_NONFINITE and the first bad element into *status (T > 0). */
Launched scan_nonfinite(const KLayout& L, DeviceStatus* status, cudaStream_t stream);

/** Gathers the page as T*H token-major values of out_dtype (L.dtype or BF16), T > 0. */
Launched pack_values(const KLayout& L, int32_t out_dtype, uint8_t* payload, cudaStream_t stream);

/** Scatters T*H token-major values of in_dtype into the page (T > 0). */
Launched unpack_values(const uint8_t* payload, int32_t in_dtype, const KLayout& L,
                       cudaStream_t stream);

/**
 * Decode of a quantized page (T > 0): checks the `entries` metadata entries
 * and the anchor table (`table`, NULL when the page has none), setting
 * STATUS_BAD_META, then decodes anchor-only (residuals NULL) or full
 * precision into the page unless the check failed.
 */
Launched decode(const KLayout& L, const KCodebook& cb, int chunk_tokens, bool meta_fp32,
                uint64_t entries, const uint8_t* meta, const uint8_t* anchors,
                const uint8_t* residuals, const uint8_t* table, DeviceStatus* status,
                cudaStream_t stream);

}  // namespace kernels
}  // namespace kvxfer::cuda
