// One page encoder over a small backend interface.  The outline every
// quantizing path shares lives here once (docs/FORMAT.md 2.1 and 5): the
// header, binary16 metadata first and binary32 for the whole page when a
// range does not fit, the non-finite policy (an error naming the element, or
// the lossless raw page), the BF16 passthrough, the capacity checks and the
// seal.  A backend only produces payload bytes where it keeps them: the CPU
// paths (codec/uniform_codec.cc, codec/tiered_format.cc) in the caller's host
// sections, the CUDA kernels (src/cuda/device_codec.cc) in device scratch
// copied back by finish().
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec/codebook.h"
#include "codec/format.h"
#include "codec/page.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {

/** The first NaN or Inf of a page in token-major order, when found. */
struct NonfiniteAt {
  bool found = false;
  int64_t t = 0;  // token within the page
  int32_t c = 0;  // channel
  bool is_nan = false;
};

class EncodeBackend {
 public:
  virtual ~EncodeBackend() = default;
  /** Fills what the header needs beyond the config (SPECTRUM: the tier counts). */
  virtual void shape_header(PageHeader* h) { (void)h; }
  /** Checks beyond the caller's section capacities (device scratch); default none. */
  virtual kvxfer_result_t check_capacity(const PageHeader& h) {
    (void)h;
    return KVXFER_SUCCESS;
  }
  /** Finds the first non-finite value of the source, if any: for the BF16
   *  codec, and for a RAW-policy page whose codes do not fit its buffers. */
  virtual kvxfer_result_t scan_nonfinite(NonfiniteAt* at) = 0;
  /**
   * Writes the metadata, codes and (split codecs) anchor table of the page
   * that `h` describes (flags say binary16 or binary32 metadata).  *status is
   * OK, NEED_FP32 (a range does not fit binary16) or NONFINITE, with *at set.
   */
  virtual kvxfer_result_t quantize(const PageHeader& h, EncodeStatus* status, NonfiniteAt* at) = 0;
  /** RAW fallback or BF16 passthrough: the values, as `dtype`, into the anchor payload. */
  virtual kvxfer_result_t pack_values(const PageHeader& h, kvxfer_dtype_t dtype) = 0;
  /**
   * BF16 passthrough of a bf16 source, whose bytes are the same with and
   * without FLAG_RAW: pack_values(h, BF16) and scan_nonfinite(at) in one pass
   * over the source.  Default: the two calls.
   */
  virtual kvxfer_result_t pack_bf16_scanning(const PageHeader& h, NonfiniteAt* at) {
    const kvxfer_result_t rc = scan_nonfinite(at);
    return rc < 0 ? rc : pack_values(h, KVXFER_DTYPE_BF16);
  }
  /** Rows 0..h.sink_rows-1 as sink_dtype(h), at the anchor payload's sink_offset(). */
  virtual kvxfer_result_t pack_sinks(const PageHeader& h) = 0;
  /** Makes the payloads of `h` final in the host sections (device: the copies back). */
  virtual kvxfer_result_t finish(const PageHeader& h) {
    (void)h;
    return KVXFER_SUCCESS;
  }
};

/**
 * The codebook of a validated quantizing config (alpha resolved), for a
 * backend; KVXFER_ERR_INTERNAL if there is none.
 */
kvxfer_result_t codebook_of(const kvxfer_codec_config_t& cfg, CodebookRef* out);

/**
 * Sink rows of an fp32 source travel as bf16 (docs/FORMAT.md 2.7); a finite
 * value beyond bf16's range rounds to infinity there and is saturated here to
 * +-0x7F7F (3.3895e38), as SpectrumKV's FP16 tier saturates, so that finite
 * input never decodes to infinity and the decoder may refuse non-finite sink
 * values.  Runs on the host anchor payload after EncodeBackend::finish, for
 * every backend.
 */
void saturate_sink_rows(const PageHeader& h, uint8_t* anchor_payload);

/**
 * Encodes one page through `be` into the host sections `anchor` / `residual`
 * (headers written and sealed here).  `cfg` is validated, and alpha is a
 * value, not KVXFER_ALPHA_AUTO (the caller resolves it).
 * `seal_threads` as seal_page.  Errors: those of the backend,
 * KVXFER_ERR_BUFFER_TOO_SMALL, KVXFER_ERR_NONFINITE (policy ERROR).
 */
kvxfer_result_t encode_with(const kvxfer_codec_config_t& cfg, const kvxfer_page_id_t& id,
                            const kvxfer_page_layout_t& src, uint8_t* anchor, size_t anchor_cap,
                            size_t* anchor_len, uint8_t* residual, size_t residual_cap,
                            size_t* residual_len, EncodeBackend* be, int seal_threads);

}  // namespace kvxfer::codec
