/*
 * kvxfer: progressive KV-cache transfer for disaggregated LLM serving.
 *
 * This is the single public header.  The ABI is C: a result enum, POD config
 * structs carrying size/magic/version with an _INITIALIZER macro (and, with
 * the transport, opaque communicator and request handles).  No C++ type crosses this boundary, so a Python runtime can call the
 * library through ctypes.  Only symbols named kvxfer_* are exported.
 *
 * Page codec (this header, section "Page codec"):
 *   A KV *page* is one layer's K or V for T consecutive tokens across
 *   H = kv_heads * head_dim channels.  kvxfer_page_encode() turns a page into
 *   an *anchor* section (header, per-chunk metadata, the high bits of every
 *   code, the per-page anchor table) and a *residual* section (the low bits).  The anchor section alone
 *   decodes to an approximate page; anchor + residual restore the codes
 *   exactly.  The codec definition and the wire format are in docs/FORMAT.md.
 *
 * Thread-safety: every function in this header is thread-safe; functions that
 * take output buffers write only those buffers.  Error text from the last
 * failing call is kept per thread (kvxfer_get_last_error).
 */
#ifndef KVXFER_KVXFER_H_
#define KVXFER_KVXFER_H_

#include <stddef.h>
#include <stdint.h>

#include "kvxfer/version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Results                                                                   */
/* ------------------------------------------------------------------------ */

/**
 * Result of every kvxfer call.  KVXFER_SUCCESS is 0; "still in progress" is
 * positive; errors are negative (as NIXL does), so `r < 0` tests for failure.
 */
typedef enum {
  KVXFER_SUCCESS = 0,
  KVXFER_IN_PROGRESS = 1,
  KVXFER_ERR_INVALID_ARGUMENT = -1, /**< a bad pointer, size, enum or layout */
  KVXFER_ERR_INVALID_USAGE = -2,    /**< calls in the wrong order or state */
  KVXFER_ERR_BUFFER_TOO_SMALL = -3, /**< an output buffer is smaller than needed */
  KVXFER_ERR_NONFINITE = -4,        /**< NaN or Inf in the input KV */
  KVXFER_ERR_TRUNCATED = -5,        /**< a section is shorter than its header says */
  KVXFER_ERR_CORRUPT = -6,          /**< a checksum or a header field is wrong */
  KVXFER_ERR_MISMATCH = -7,         /**< sections or layouts that do not belong together */
  KVXFER_ERR_UNSUPPORTED = -8,      /**< a valid request this build cannot serve */
  KVXFER_ERR_SYSTEM = -9,           /**< an OS call failed (errno in the message) */
  KVXFER_ERR_INTERNAL = -10,        /**< a bug in kvxfer; please report it */
  KVXFER_ERR_OUT_OF_MEMORY = -11,
  KVXFER_ERR_TIMEOUT = -12, /**< no progress within KVXFER_TIMEOUT_MS (peer dead or silent) */
  KVXFER_RESULT_MIN = -12   /**< the most negative code; codes run from KVXFER_RESULT_MIN to 1 */
} kvxfer_result_t;

/** Static, never-NULL description of a result code ("invalid argument"). */
const char* kvxfer_get_error_string(kvxfer_result_t result);

/**
 * Text of the last error raised on the calling thread, with the detail
 * (e.g. "NaN at layer 3 V, token 17, channel 5").  Empty string when the last
 * call succeeded.  The pointer stays valid until the next kvxfer call on the
 * same thread.
 */
const char* kvxfer_get_last_error(void);

/** Library version as KVXFER_VERSION_CODE (major*10000 + minor*100 + patch). */
kvxfer_result_t kvxfer_get_version(int* version);

/* ------------------------------------------------------------------------ */
/* Page codec                                                                */
/* ------------------------------------------------------------------------ */

/** Element type of a KV page in memory. */
typedef enum { KVXFER_DTYPE_BF16 = 0, KVXFER_DTYPE_FP16 = 1, KVXFER_DTYPE_FP32 = 2 } kvxfer_dtype_t;

/** Which tensor of the layer a page belongs to. */
typedef enum { KVXFER_KV_KEY = 0, KVXFER_KV_VALUE = 1 } kvxfer_kv_kind_t;

/**
 * Codecs.  All quantizing codecs use the same per-(chunk, channel) affine
 * normalisation; they differ in how a normalised value becomes a code
 * (docs/FORMAT.md, "Codecs").
 *  - LYNX: 8-bit sign-magnitude alpha-law code (Lynx, Algorithm 1), split into
 *    `anchor_bits` high bits and 8 - anchor_bits low bits.
 *  - INT8: uniform asymmetric 8-bit code, split the same way ("Lynx-INT8").
 *  - INT4: uniform asymmetric 4-bit code, anchor only (empty residual).
 *  - BF16: passthrough as bfloat16 (round-to-nearest-even), anchor only.
 */
typedef enum {
  KVXFER_CODEC_LYNX = 0,
  KVXFER_CODEC_INT8 = 1,
  KVXFER_CODEC_INT4 = 2,
  KVXFER_CODEC_BF16 = 3
} kvxfer_codec_t;

/** What the encoder does with NaN or +-Inf in the input. */
typedef enum {
  /** Fail with KVXFER_ERR_NONFINITE naming layer, K/V, token and channel. */
  KVXFER_NONFINITE_ERROR = 0,
  /** Encode that page losslessly as raw input-dtype values (flagged in the
   *  header; docs/FORMAT.md "Raw fallback").  Progressive decoding is lost for
   *  the page: its anchor section carries everything. */
  KVXFER_NONFINITE_RAW = 1
} kvxfer_nonfinite_policy_t;

#define KVXFER_CONFIG_MAGIC 0x6b767866u /* 'kvxf' */

/**
 * Value of kvxfer_codec_config_t.alpha that lets the LYNX encoder choose alpha
 * for each page from its own data (see kvxfer_codec_calibrate_alpha; the
 * chosen value is recorded in the page header).
 */
#define KVXFER_ALPHA_AUTO (-1.0f)

/**
 * Codec parameters.  Initialise with KVXFER_CODEC_CONFIG_INITIALIZER, then
 * change fields.  `size`, `magic` and `version` let the library reject a
 * struct from an incompatible header.
 */
typedef struct {
  size_t size;          /**< sizeof(kvxfer_codec_config_t) */
  uint32_t magic;       /**< KVXFER_CONFIG_MAGIC */
  uint32_t version;     /**< KVXFER_VERSION_CODE of the header used */
  kvxfer_codec_t codec; /**< default KVXFER_CODEC_LYNX */
  float alpha;          /**< alpha-law parameter, 0 (linear, the default) to 1000, or
                             KVXFER_ALPHA_AUTO; LYNX only.  docs/FORMAT.md 2.6 says why 0. */
  int32_t chunk_tokens; /**< C: tokens per normalisation chunk, 16, 32, 64 or 128 */
  int32_t anchor_bits;  /**< A: 2..6 for LYNX and INT8 (residual = 8 - A); 4 for INT4 */
  kvxfer_nonfinite_policy_t nonfinite; /**< default KVXFER_NONFINITE_ERROR */
} kvxfer_codec_config_t;

#define KVXFER_CODEC_CONFIG_INITIALIZER                                                         \
  {                                                                                             \
    sizeof(kvxfer_codec_config_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, KVXFER_CODEC_LYNX, \
        0.0f, 32, 4, KVXFER_NONFINITE_ERROR                                                     \
  }

/**
 * Where a page lives: the runtime's own paged layout (vLLM/SGLang style).
 *
 * Token t of the page (0 <= t < num_tokens) is token u = first_token + t of
 * the block list; it is the row
 *     blocks[u / block_size] + (u % block_size) * row_stride      (elements)
 * holding num_channels contiguous elements of `dtype`.
 * Requirements: block_size >= 1; row_stride >= num_channels; num_channels >= 1;
 * num_tokens >= 0 (0 is an empty page); every referenced block non-NULL;
 * num_blocks large enough for first_token + num_tokens.
 * Ownership: the caller owns all memory; kvxfer only reads (encode) or
 * writes (decode) the rows named above, nothing else.
 */
typedef struct {
  void* const* blocks; /**< array of num_blocks block base pointers */
  int64_t num_blocks;
  int32_t block_size;   /**< tokens per block */
  int64_t row_stride;   /**< elements between consecutive tokens of a block */
  int64_t first_token;  /**< offset of the page's first token in the block list */
  int64_t num_tokens;   /**< T */
  int32_t num_channels; /**< H = kv_heads * head_dim */
  kvxfer_dtype_t dtype;
} kvxfer_page_layout_t;

/** Identity of a page, carried in both section headers. */
typedef struct {
  uint32_t layer;
  kvxfer_kv_kind_t kind;
  int64_t token_begin; /**< absolute position of the page's first token in the sequence */
  uint64_t stream_id;  /**< caller-chosen id (e.g. request id); 0 if unused */
} kvxfer_page_id_t;

/**
 * Upper bound of the two section sizes (bytes) of a page of `num_tokens` x
 * `num_channels` encoded with `config`, whatever the data.  Use it to size
 * buffers; kvxfer_page_encode reports the exact sizes.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT for a bad config or shape.
 */
kvxfer_result_t kvxfer_page_max_size(const kvxfer_codec_config_t* config, int64_t num_tokens,
                                     int32_t num_channels, size_t* anchor_bytes,
                                     size_t* residual_bytes);

/**
 * Encodes one page into an anchor section and a residual section.
 *
 * anchor, residual: caller-owned output buffers of anchor_cap and
 * residual_cap bytes; on success *anchor_len and *residual_len hold the bytes
 * written.  On failure both lengths are 0 and the buffers' contents are
 * unspecified; the input is never modified.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (config, layout, NULL pointers),
 * KVXFER_ERR_BUFFER_TOO_SMALL, KVXFER_ERR_NONFINITE (policy ERROR; the message
 * names layer, K/V, token and channel).
 * Uses up to KVXFER_CODEC_THREADS threads (OpenMP) and the fastest CPU path
 * (KVXFER_CODEC_IMPL); the bytes are identical for every choice.
 */
kvxfer_result_t kvxfer_page_encode(const kvxfer_codec_config_t* config, const kvxfer_page_id_t* id,
                                   const kvxfer_page_layout_t* src, void* anchor, size_t anchor_cap,
                                   size_t* anchor_len, void* residual, size_t residual_cap,
                                   size_t* residual_len);

/**
 * Decodes a page into `dst` (any dtype, any block layout with the page's T and H).
 *
 * residual == NULL (residual_len 0) decodes at anchor precision; otherwise the
 * residual must belong to this anchor (same page, linked by checksum) and the
 * page is restored at full precision.  Every field and size is validated and
 * both checksums verified before anything is written to dst.
 * expect: if non-NULL, the page identity the caller expects; a different one
 * fails with KVXFER_ERR_MISMATCH.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT, KVXFER_ERR_TRUNCATED, KVXFER_ERR_CORRUPT,
 * KVXFER_ERR_MISMATCH (T/H differ from dst, residual of another page, identity).
 */
kvxfer_result_t kvxfer_page_decode(const void* anchor, size_t anchor_len, const void* residual,
                                   size_t residual_len, const kvxfer_page_id_t* expect,
                                   const kvxfer_page_layout_t* dst);

/**
 * Chooses the LYNX alpha for a set of calibration pages (e.g. a few pages of
 * one layer's K, or V), by the rule of docs/FORMAT.md section 2.6:
 *   candidates A = {0, 1, 2, 5, 10, 20, 50, 100, 255};
 *   E_full(a), E_anchor(a) = squared reconstruction error (fp32) over a
 *   deterministic sample of at most 8 chunks per page;
 *   alpha = argmin_{a in A, E_full(a) <= E_full(0)} E_anchor(a)   (ties: smaller a).
 * So the choice is never worse than linear (alpha = 0) at either precision on
 * the calibration data.  config->alpha is ignored; chunk_tokens and
 * anchor_bits are used.  Non-finite elements are skipped.
 * pages: array of num_pages >= 1 layouts (read only).  alpha: output.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (config not LYNX, bad layout).
 */
kvxfer_result_t kvxfer_codec_calibrate_alpha(const kvxfer_codec_config_t* config,
                                             const kvxfer_page_layout_t* pages, int32_t num_pages,
                                             float* alpha);

/** What a section header says (after full validation, checksum included). */
typedef struct {
  int32_t is_residual; /**< 0 anchor section, 1 residual section */
  kvxfer_codec_t codec;
  int32_t raw_fallback; /**< 1 if the page was stored raw (non-finite input) */
  float alpha;
  int32_t chunk_tokens;
  int32_t anchor_bits;
  int32_t residual_bits;
  kvxfer_dtype_t src_dtype; /**< dtype of the encoded input */
  int32_t meta_fp32;        /**< 1 if metadata is fp32 (fp16 range exceeded) */
  kvxfer_page_id_t id;
  int64_t num_tokens;
  int32_t num_channels;
  size_t section_bytes; /**< total bytes of this section, header included */
} kvxfer_page_info_t;

/** Validates one section (header, sizes, checksum) and describes it. */
kvxfer_result_t kvxfer_page_inspect(const void* section, size_t len, kvxfer_page_info_t* info);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVXFER_KVXFER_H_ */
