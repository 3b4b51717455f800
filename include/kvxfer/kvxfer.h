/*
 * kvxfer: progressive KV-cache transfer for disaggregated LLM serving.
 *
 * This is the single public header.  The ABI is C: a result enum, POD config
 * structs carrying size/magic/version with an _INITIALIZER macro, and opaque
 * communicator and request handles.  No C++ type crosses this boundary, so a
 * Python runtime can call the library through ctypes.  Only symbols named
 * kvxfer_* are exported.
 *
 * Page codec (this header, section "Page codec"):
 *   A KV *page* is one layer's K or V for T consecutive tokens across
 *   H = kv_heads * head_dim channels.  kvxfer_page_encode() turns a page into
 *   an *anchor* section (header, per-chunk metadata, the high bits of every
 *   code, a per-page anchor table for some codecs) and a *residual* section
 *   (the low bits).  The anchor section alone decodes to an approximate page;
 *   anchor + residual restore the codes exactly.  The codec definition and the
 *   wire format are in docs/FORMAT.md.
 *
 * Transfers (section "Communicators and progressive transfers"): a
 * communicator joins N ranks (kvxfer_get_unique_id, kvxfer_comm_init);
 * kvxfer_send / kvxfer_recv move a paged KV cache between two of them,
 * anchors first on the high-priority traffic class, residuals after on the
 * low-priority one; a request reports ANCHOR_READY, then COMPLETE (or ERROR).
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
  KVXFER_ERR_TIMEOUT = -12,   /**< no progress within KVXFER_TIMEOUT_MS (peer dead or silent) */
  KVXFER_ERR_CANCELLED = -13, /**< kvxfer_request_cancel on this rank or on the peer */
  KVXFER_RESULT_MIN = -13     /**< the most negative code; codes run from KVXFER_RESULT_MIN to 1 */
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
 *  - LYNX: 8-bit code split into `anchor_bits` high bits and 8 - anchor_bits
 *    low bits.  alpha > 0: the sign-magnitude alpha-law code of Lynx,
 *    Algorithm 1.  alpha = 0 (the default): a nested code whose 4-bit anchor
 *    is exactly INT4's code, refined to steps of 1/120 of the half-range.
 *  - INT8: uniform asymmetric 8-bit code, split the same way ("Lynx-INT8").
 *  - INT4: uniform asymmetric 4-bit code, anchor only (empty residual).
 *  - BF16: passthrough as bfloat16 (round-to-nearest-even), anchor only.
 */
typedef enum {
  KVXFER_CODEC_LYNX = 0,
  KVXFER_CODEC_INT8 = 1,
  KVXFER_CODEC_INT4 = 2,
  KVXFER_CODEC_BF16 = 3,
  /** SpectrumKV: per-token precision tiers (kvxfer_tier_t) carried in a
   *  per-token precision map in the anchor section (docs/FORMAT.md,
   *  "SpectrumKV pages"; docs/SPECTRUMKV.md). */
  KVXFER_CODEC_SPECTRUM = 4
} kvxfer_codec_t;

/**
 * SpectrumKV precision tier of one token (one byte per token wherever a tier
 * array appears).  DROP: the token is not transferred at all (only when int4
 * is disabled and the budget is below 1/2, docs/SPECTRUMKV.md).
 */
typedef enum {
  KVXFER_TIER_FP16 = 0,
  KVXFER_TIER_INT8 = 1,
  KVXFER_TIER_INT4 = 2,
  KVXFER_TIER_DROP = 3
} kvxfer_tier_t;

/** What the encoder does with NaN or +-Inf in the input. */
typedef enum {
  /** Fail with KVXFER_ERR_NONFINITE naming layer, K/V, token and channel. */
  KVXFER_NONFINITE_ERROR = 0,
  /** Encode that page losslessly as raw input-dtype values (flagged in the
   *  header; docs/FORMAT.md "Raw fallback").  Progressive decoding is lost for
   *  the page: its anchor section carries everything. */
  KVXFER_NONFINITE_RAW = 1
} kvxfer_nonfinite_policy_t;

/**
 * How the V pages of LYNX, INT8 and INT4 are grouped for the min/max
 * normalisation (docs/FORMAT.md 2.8).  K pages are always grouped per
 * (chunk of C tokens, channel), as Lynx's Algorithm 1 does.
 */
typedef enum {
  /** Per (chunk of C tokens, channel): Lynx Algorithm 1 (the default). */
  KVXFER_VALUE_GROUPS_CHANNEL = 0,
  /** Per (token, run of C channels): KIVI's value grouping (Liu et al. 2024),
   *  for values whose scale varies from token to token.  CPU pages only: a
   *  CUDA encode or decode of such a page fails with KVXFER_ERR_UNSUPPORTED. */
  KVXFER_VALUE_GROUPS_TOKEN = 1,
  /** Per V page, the one of the two whose anchor-only decode has the smaller
   *  squared error on that page (the encoder runs both; about 3x the encode
   *  time of V pages).  On a CUDA device: CHANNEL. */
  KVXFER_VALUE_GROUPS_AUTO = 2
} kvxfer_value_groups_t;

/**
 * Magic of every kvxfer struct that begins with `size`, `magic` and
 * `version` (set by its _INITIALIZER).  Fields are only ever appended to such
 * a struct, each new one at the previous sizeof, so `size` says which fields
 * the caller's header had.  The library accepts a struct when `magic` is this
 * value; `size` lies between the size of its smallest layout and sizeof in
 * the library's header, and is a multiple of the struct's alignment; and
 * `version` has the library's major version and is not newer in
 * major.minor.  An older, smaller struct is read with the _INITIALIZER's
 * values for the fields it lacks, as NCCL reads ncclConfig_t.  A larger one
 * comes from a newer header and is refused with KVXFER_ERR_INVALID_ARGUMENT,
 * the error naming both sizes.  The smallest layouts:
 * kvxfer_codec_config_t without value_groups, kvxfer_kv_desc_t without
 * device, kvxfer_request_config_t without stream_layers; every other struct
 * has one layout.  A struct the library writes
 * (kvxfer_request_info_t, kvxfer_spec_monitor_t, ...) or reads in place
 * (kvxfer_nccl_op_t's kv and codec) must have every field.
 */
#define KVXFER_CONFIG_MAGIC 0x6b767866u /* 'kvxf' */

/**
 * Value of kvxfer_codec_config_t.alpha that lets the LYNX encoder choose alpha
 * for each page from its own data (see kvxfer_codec_calibrate_alpha; the
 * chosen value is recorded in the page header).
 */
#define KVXFER_ALPHA_AUTO (-1.0f)

/**
 * Codec parameters.  Initialise with KVXFER_CODEC_CONFIG_INITIALIZER, then
 * change fields.  `size`, `magic` and `version` follow KVXFER_CONFIG_MAGIC's
 * rule: a smaller struct from a header without value_groups is accepted, and
 * value_groups is then KVXFER_VALUE_GROUPS_CHANNEL.
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
  /** Attention sinks: the rows of tokens at absolute positions [0,
   *  sink_tokens) also travel exactly in the anchor section (16-bit: the
   *  source dtype, or BF16 for fp32 sources), so that both the anchor-only and
   *  the full decode reproduce them.  0..1024, default 1; LYNX, INT8 and INT4
   *  (SPECTRUM pins its own sinks).  Costs 2 bytes per channel per sink row,
   *  on the pages that hold them.  Why: docs/FORMAT.md 2.7 (a model's first
   *  token takes most of the attention; StreamingLLM, Xiao et al. 2024). */
  int32_t sink_tokens;
  /** Grouping of V pages, default KVXFER_VALUE_GROUPS_CHANNEL; LYNX, INT8
   *  and INT4 (the others need CHANNEL). */
  kvxfer_value_groups_t value_groups;
} kvxfer_codec_config_t;

#define KVXFER_CODEC_CONFIG_INITIALIZER                                                         \
  {                                                                                             \
    sizeof(kvxfer_codec_config_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, KVXFER_CODEC_LYNX, \
        0.0f, 32, 4, KVXFER_NONFINITE_ERROR, 1, KVXFER_VALUE_GROUPS_CHANNEL                     \
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
 * Codec SPECTRUM needs token tiers: use kvxfer_page_encode_tiered (here it
 * fails with KVXFER_ERR_INVALID_ARGUMENT).
 *
 * anchor, residual: caller-owned output buffers of anchor_cap and
 * residual_cap bytes; on success *anchor_len and *residual_len hold the bytes
 * written.  On failure both lengths are 0 and the buffers' contents are
 * unspecified; the input is never modified.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (config, layout, NULL pointers; the
 * two outputs sharing a byte, or an output sharing one with a source row or
 * the source's block list), KVXFER_ERR_BUFFER_TOO_SMALL (policy RAW: buffers
 * that hold a page stored raw are enough for a page with a non-finite
 * value), KVXFER_ERR_NONFINITE (policy ERROR; the message names layer, K/V,
 * token and channel).
 * Uses up to KVXFER_CODEC_THREADS threads (OpenMP) and the fastest CPU path
 * (KVXFER_CODEC_IMPL); the bytes are identical for every choice.
 */
kvxfer_result_t kvxfer_page_encode(const kvxfer_codec_config_t* config, const kvxfer_page_id_t* id,
                                   const kvxfer_page_layout_t* src, void* anchor, size_t anchor_cap,
                                   size_t* anchor_len, void* residual, size_t residual_cap,
                                   size_t* residual_len);

/**
 * Encodes one SpectrumKV page (config->codec must be KVXFER_CODEC_SPECTRUM):
 * token t of `src` is sent at precision tier token_tiers[t]
 * (docs/FORMAT.md section 6, "SpectrumKV pages"):
 *  - KVXFER_TIER_FP16: the value rounded to binary16 (nearest even; beyond
 *    +-65504 saturated to +-65504).  Anchor: its high byte (sign, exponent, 2
 *    mantissa bits); residual: its low byte.
 *  - KVXFER_TIER_INT8: the KVXFER_CODEC_INT8 code, split into config->anchor_bits
 *    (2..6) anchor bits and 8 - anchor_bits residual bits.
 *  - KVXFER_TIER_INT4: the KVXFER_CODEC_INT4 code, all in the anchor.
 *  - KVXFER_TIER_DROP: nothing is sent; the token decodes to 0.
 * INT8 and INT4 tokens share per-(chunk, channel) affine metadata taken over
 * those tokens only (FP16 and DROP tokens excluded).  The anchor section also
 * carries the precision map (2 bits per token), so it alone decodes every
 * tier to a usable approximation; anchor + residual give every FP16 token its
 * exact binary16 value and every INT8 token its full code.
 *
 * token_tiers: num_tokens bytes of kvxfer_tier_t values, read only (NULL only
 * when src->num_tokens is 0).  DROP rows of `src` are never read.  Other
 * arguments, outputs and buffer sizes as kvxfer_page_encode (size buffers with
 * kvxfer_page_max_size, whose SPECTRUM bound is the all-FP16 page).
 * Non-finite values in a token that is sent follow config->nonfinite (RAW: the
 * page's sent tokens are stored raw after the map).  Uses up to
 * KVXFER_CODEC_THREADS threads (OpenMP, over chunks) when H is a multiple of
 * 8, else the calling thread; the bytes are identical either way.
 * Thread-safe for distinct outputs.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (codec not SPECTRUM, NULL or out-of-range
 * tier, config, layout, NULL pointers, outputs sharing a byte with each other,
 * a source row, the source's block list or the tiers), KVXFER_ERR_BUFFER_TOO_SMALL,
 * KVXFER_ERR_NONFINITE.  On failure both lengths are 0.
 */
kvxfer_result_t kvxfer_page_encode_tiered(const kvxfer_codec_config_t* config,
                                          const kvxfer_page_id_t* id,
                                          const kvxfer_page_layout_t* src,
                                          const uint8_t* token_tiers, void* anchor,
                                          size_t anchor_cap, size_t* anchor_len, void* residual,
                                          size_t residual_cap, size_t* residual_len);

/**
 * Reads the precision map of a SpectrumKV page from its anchor section, after
 * validating the section in full (header, sizes, checksum, tier counts, map).
 * token_tiers: caller-owned array of num_tokens bytes (NULL only when 0),
 * receives kvxfer_tier_t values; written only on success.
 * Errors: KVXFER_ERR_TRUNCATED / KVXFER_ERR_CORRUPT (bad section),
 * KVXFER_ERR_INVALID_ARGUMENT (not a SpectrumKV anchor section, NULL),
 * KVXFER_ERR_MISMATCH (num_tokens is not the page's token count).
 */
kvxfer_result_t kvxfer_page_get_tiers(const void* anchor, size_t anchor_len, uint8_t* token_tiers,
                                      int64_t num_tokens);

/**
 * Decodes a page into `dst` (any dtype, any block layout with the page's T and H).
 *
 * residual == NULL (residual_len 0) decodes at anchor precision; otherwise the
 * residual must belong to this anchor (same page, linked by checksum) and the
 * page is restored at full precision.  Every field and size is validated and
 * both checksums verified before anything is written to dst.
 * expect: if non-NULL, the page identity the caller expects; a different one
 * fails with KVXFER_ERR_MISMATCH, a kind other than K or V with
 * KVXFER_ERR_INVALID_ARGUMENT.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (also a section, or dst's block list,
 * sharing a byte with a row of dst), KVXFER_ERR_TRUNCATED, KVXFER_ERR_CORRUPT,
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

/** Validates one section (header, sizes, checksum) and describes it.  For a
 *  SpectrumKV page, anchor_bits / residual_bits are its INT8 tier's split and
 *  kvxfer_page_get_tiers reads its precision map.
 *  section: `len` bytes, read only; info: written only on success.  Any thread.
 *  Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL), KVXFER_ERR_TRUNCATED (shorter
 *  than its header says), KVXFER_ERR_CORRUPT (a bad field or checksum). */
kvxfer_result_t kvxfer_page_inspect(const void* section, size_t len, kvxfer_page_info_t* info);

/* ------------------------------------------------------------------------ */
/* Communicators and progressive transfers (docs/TRANSPORT.md, "Transfers")   */
/* ------------------------------------------------------------------------ */

/** Bytes of a unique id (as NCCL_UNIQUE_ID_BYTES). */
#define KVXFER_UNIQUE_ID_BYTES 128

/**
 * The bootstrap handle of a communicator: the root's TCP address and a 32-byte
 * random secret.  Plain bytes: copy it to the other ranks out-of-band (a file,
 * an RPC, MPI_Bcast), as with ncclUniqueId.  The secret is a guard against
 * stray and stale processes, not against someone who can read the network.
 */
typedef struct {
  char internal[KVXFER_UNIQUE_ID_BYTES];
} kvxfer_unique_id_t;

/** Opaque communicator handle (kvxfer_comm_init). */
typedef struct kvxfer_comm* kvxfer_comm_t;
/** Opaque request handle (kvxfer_send / kvxfer_recv); freed by kvxfer_request_free. */
typedef struct kvxfer_request* kvxfer_request_t;

/**
 * Makes a unique id and starts listening for the ranks' bootstrap hellos on
 * KVXFER_BOOTSTRAP_ADDR (default 127.0.0.1; set it to an address the other
 * hosts can reach).  The process that calls this must become rank 0 of the
 * communicator built from the id (kvxfer_comm_init consumes the listener); an
 * id that is never used keeps one listening socket open until the process
 * exits.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, an unusable address),
 * KVXFER_ERR_SYSTEM (socket, bind, getrandom).
 */
kvxfer_result_t kvxfer_get_unique_id(kvxfer_unique_id_t* id);

/** Communicator options; start from KVXFER_COMM_CONFIG_INITIALIZER.
 *  `size`, `magic`, `version`: KVXFER_CONFIG_MAGIC's rule; one layout. */
typedef struct {
  size_t size;      /**< sizeof(kvxfer_comm_config_t) */
  uint32_t magic;   /**< KVXFER_CONFIG_MAGIC */
  uint32_t version; /**< KVXFER_VERSION_CODE of the header used */
  /** Deadline of kvxfer_comm_init and inactivity timeout of every transfer,
   *  in ms; 0 = KVXFER_TIMEOUT_MS; negative is refused. */
  int32_t timeout_ms;
  /** Local address the libfabric endpoints bind to (numeric IPv4/IPv6);
   *  NULL = KVXFER_BIND_ADDR.  Copied; need not outlive the call.  One that
   *  does not resolve, or a wildcard (0.0.0.0, ::), is
   *  KVXFER_ERR_INVALID_ARGUMENT naming it. */
  const char* bind_address;
  /** Link emulation for this communicator's links, tc syntax ("1gbit",
   *  "500mbit", "100mbps" = bytes/s; "" = none); NULL = KVXFER_RATE_LIMIT
   *  (one bucket shared by the process).  Copied. */
  const char* rate_limit;
} kvxfer_comm_config_t;

#define KVXFER_COMM_CONFIG_INITIALIZER \
  { sizeof(kvxfer_comm_config_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0, NULL, NULL }

/**
 * Builds rank `rank` of an `nranks`-rank communicator from `id` (as
 * ncclCommInitRank).  Collective: every rank calls it; it returns when every
 * rank has joined and every pair is connected, or fails within the timeout.
 * A rank that presents a different secret is refused by the root and never
 * counted.  A progress thread per communicator drives the network and a codec
 * thread encodes and decodes pages; both are joined by destroy.
 * `config` may be NULL (defaults).
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, nranks outside [2, 65536], rank
 * out of range, config refused by KVXFER_CONFIG_MAGIC's rule, timeout_ms
 * negative, a config string that is not readable memory, id malformed, rank 0
 * in a process that did not make the id, or rank 0 with an id already used:
 * each id makes one communicator; `*comm` is then NULL, and an id refused for
 * a bad argument is still usable);
 * KVXFER_ERR_TIMEOUT (a rank missing, a peer unreachable); KVXFER_ERR_SYSTEM
 * (wrong secret: "bootstrap refused by root"; socket errors; another rank's
 * kvxfer_comm_init failed: "rank N failed: <its error>", within about a
 * second rather than at the timeout, see docs/TRANSPORT.md).  A rank that
 * fails after the bad-argument checks above tells the others so.
 * Thread-safety: any thread; the communicator is then usable from any thread.
 */
kvxfer_result_t kvxfer_comm_init(kvxfer_comm_t* comm, int nranks, kvxfer_unique_id_t id, int rank,
                                 const kvxfer_comm_config_t* config);

/**
 * Fails every request of the communicator that has not reached a final stage
 * (stage ERROR, result KVXFER_ERR_INVALID_USAGE, "communicator aborted") and
 * closes the connections.  Asynchronous: it returns at once, and the progress
 * thread closes the connections and publishes the ERROR stages shortly after
 * (kvxfer_wait on a request sees them).  Never blocks on a peer.  An aborted
 * endpoint takes no new peer: kvxfer_endpoint_connect fails with
 * KVXFER_ERR_INVALID_USAGE, and its listener refuses connects.  The communicator must
 * still be destroyed; requests must still be freed.  Idempotent.  Any thread.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (comm NULL; unlike destroy, abort of
 * NULL is a caller bug).
 */
kvxfer_result_t kvxfer_comm_abort(kvxfer_comm_t comm);

/**
 * Aborts (as kvxfer_comm_abort) every request still in flight, joins the
 * communicator's threads and frees it.  Safe with requests in flight: their
 * handles stay valid (stage ERROR) until kvxfer_request_free.  Requests
 * already final get up to min(timeout, 1 s) to send their last control
 * message, which their peer waits for.  Returns within a bounded time
 * whatever the peers do.  No other call on `comm` may run concurrently or
 * follow (as ncclCommDestroy).  NULL is a no-op.
 */
kvxfer_result_t kvxfer_comm_destroy(kvxfer_comm_t comm);

/** Number of ranks / this rank's index (0-based).  Any thread.
 *  Errors: KVXFER_ERR_INVALID_ARGUMENT (comm or the output NULL). */
kvxfer_result_t kvxfer_comm_count(kvxfer_comm_t comm, int* nranks);
kvxfer_result_t kvxfer_comm_user_rank(kvxfer_comm_t comm, int* rank);

/*
 * Endpoints (docs/TRANSPORT.md, "Endpoints").  An endpoint is a
 * kvxfer_comm_t whose peers join and leave at run time, as NIXL's agents and
 * Mooncake's segments do: every request call (kvxfer_send, kvxfer_recv,
 * kvxfer_send_blocks, ...) takes the peer index kvxfer_endpoint_connect
 * returned.  kvxfer_comm_count gives the peer slots used so far (indices
 * are never reused) and kvxfer_comm_user_rank gives -1.  Destroy it with
 * kvxfer_comm_destroy, which first tells every connected peer.
 */

/** Endpoint options; start from KVXFER_ENDPOINT_CONFIG_INITIALIZER.
 *  `size`, `magic`, `version`: KVXFER_CONFIG_MAGIC's rule. */
typedef struct {
  size_t size;      /**< sizeof(kvxfer_endpoint_config_t) */
  uint32_t magic;   /**< KVXFER_CONFIG_MAGIC */
  uint32_t version; /**< KVXFER_VERSION_CODE of the header used */
  /** Inactivity timeout of every transfer and bound of a connect, in ms;
   *  0 = KVXFER_TIMEOUT_MS; negative is refused. */
  int32_t timeout_ms;
  /** TCP port of the endpoint's listener, 0..65535; 0 = any free one.  A
   *  process restarted with the same port keeps its address, and its peers
   *  see a new incarnation there. */
  int32_t port;
  /** Local address of the listener and of the libfabric endpoints (numeric
   *  IPv4/IPv6 or a host name; not a wildcard: peers connect to it); NULL =
   *  KVXFER_BIND_ADDR.  Copied. */
  const char* bind_address;
  /** Link emulation, tc syntax as kvxfer_comm_config_t; NULL =
   *  KVXFER_RATE_LIMIT (one bucket for the process).  Copied. */
  const char* rate_limit;
  /** KVXFER_ENDPOINT_SECRET_BYTES bytes that every endpoint of a deployment
   *  shares and presents when it connects; a peer that presents another is
   *  refused.  NULL = a random secret, carried in this endpoint's address
   *  blob (then the blob is what lets a peer in).  Copied. */
  const uint8_t* secret;
} kvxfer_endpoint_config_t;

#define KVXFER_ENDPOINT_CONFIG_INITIALIZER                                                        \
  {                                                                                               \
    sizeof(kvxfer_endpoint_config_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0, 0, NULL, NULL, \
        NULL                                                                                      \
  }

/** Bytes of an endpoint secret. */
#define KVXFER_ENDPOINT_SECRET_BYTES 32
/** Upper bound on the bytes of an endpoint's address blob. */
#define KVXFER_ENDPOINT_ADDRESS_MAX 128

/**
 * Creates an endpoint with no peer: a TCP listener for connection
 * handshakes (on bind_address:port), the progress and codec threads.  Each
 * endpoint has a random 64-bit incarnation, so a process restarted at the
 * same address is a new peer to the others.  More than one per process is
 * allowed.  `config` may be NULL.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL ep, config refused by
 * KVXFER_CONFIG_MAGIC's rule, negative timeout, port outside 0..65535, an
 * unresolvable or wildcard address, a bad rate, a string or secret pointer
 * that is not readable memory); KVXFER_ERR_SYSTEM (the
 * port is taken: "bind: Address already in use", socket errors).
 * Thread-safety: any thread; the endpoint is then usable from any thread.
 */
kvxfer_result_t kvxfer_endpoint_create(kvxfer_comm_t* ep, const kvxfer_endpoint_config_t* config);

/**
 * Copies the endpoint's address blob (at most KVXFER_ENDPOINT_ADDRESS_MAX
 * bytes: listener address, incarnation, and the secret when the config gave
 * none) into `buf` and sets *len to its length.  Ship it out of band, for
 * example in vLLM's kv_transfer_params.  `*len` holds the capacity of buf on
 * entry.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULLs, not an endpoint);
 * KVXFER_ERR_BUFFER_TOO_SMALL (*len is set to the size needed).  Any thread.
 */
kvxfer_result_t kvxfer_endpoint_address(kvxfer_comm_t ep, void* buf, size_t* len);

/**
 * Connects to the endpoint whose address blob is `address` and sets *peer
 * to its index.  Connecting again to a connected peer (from this side or
 * after it connected to us) gives the same index; two endpoints that connect
 * to each other at once get one connection.  After a disconnect, or once the
 * peer failed, a connect makes a new connection with a new index.  Blocks
 * for one TCP handshake (bounded by the timeout); the libfabric handshake
 * goes on in the background and requests posted meanwhile wait for it.
 * A connected peer at the same listener address with another incarnation
 * (the process restarted) is ended: its requests fail.  (A peer that
 * connects to us from a new incarnation at a connected peer's address does
 * not end it: the old one ends when its Link fails, docs/TRANSPORT.md
 * "Incarnations".)
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULLs, not an endpoint, a malformed
 * or truncated blob, this endpoint's own blob, or the peer refused our
 * secret: "refused ... wrong secret"); KVXFER_ERR_MISMATCH (the endpoint at
 * that address is another incarnation: it restarted, get its new blob);
 * KVXFER_ERR_SYSTEM (unreachable: "connection refused", socket errors;
 * "busy": 64 peers are already in their handshake with that endpoint,
 * connect again later);
 * KVXFER_ERR_CORRUPT (the peer's answer, or the shared-memory names it
 * gives, are malformed); KVXFER_ERR_TIMEOUT (no answer within the timeout).
 * Nothing changes on an error.  Thread-safety: any thread, concurrently with posts and with
 * connects and disconnects of any peer.
 */
kvxfer_result_t kvxfer_endpoint_connect(kvxfer_comm_t ep, const void* address, size_t len,
                                        int* peer);

/**
 * Disconnects `peer`: its requests not yet final fail with
 * KVXFER_ERR_CANCELLED ("disconnected"), later posts to it fail at the call,
 * and the peer is told (its requests with this endpoint fail the same way).
 * Its connection state is freed once nothing of it is in flight.  Bounded:
 * telling the peer waits at most min(timeout, 1 s).
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, not an endpoint, an index that
 * connect never gave); KVXFER_ERR_INVALID_USAGE (already disconnected or
 * failed; the message says why).  Any thread.
 */
kvxfer_result_t kvxfer_endpoint_disconnect(kvxfer_comm_t ep, int peer);

/**
 * A KV cache as the serving runtime holds it: paged, one block table per
 * layer (vLLM/SGLang style).  Token t of layer l's K lives in block
 * k_blocks[l * num_blocks + t / block_size], at row t % block_size; a row is
 * kv_heads * head_dim contiguous elements of `dtype` (heads major), and rows
 * are row_stride elements apart.  V likewise through v_blocks.
 * The sender's and the receiver's descriptors must agree on num_layers,
 * kv_heads, head_dim, dtype and num_tokens (checked by a handshake; a
 * difference fails the request on both sides, naming the field); block_size,
 * row_stride and the pointers are each side's own.  A receiver's rows may not
 * share a byte (kvxfer_recv refuses blocks that alias; interleaved K and V
 * rows are fine); a sender may name one block twice.
 * Ownership: the arrays are copied by kvxfer_send/recv; the blocks themselves
 * must stay valid and unwritten until the request reaches a final stage
 * (COMPLETE or ERROR): the sender encodes and sends them while it runs, and
 * bytes written meanwhile may arrive torn, a page of neither version, with
 * no error (the checksums cover what was sent).  Host memory, or CUDA device memory
 * with `device` set (docs/GPU.md).  `size`, `magic` and `version` follow
 * KVXFER_CONFIG_MAGIC's rule: a smaller descriptor from a header without
 * `device` is accepted as host memory (device -1).
 */
typedef struct {
  size_t size;          /**< sizeof(kvxfer_kv_desc_t) */
  uint32_t magic;       /**< KVXFER_CONFIG_MAGIC */
  uint32_t version;     /**< KVXFER_VERSION_CODE of the header used */
  int32_t num_layers;   /**< >= 1 */
  int32_t kv_heads;     /**< >= 1 */
  int32_t head_dim;     /**< >= 1; kv_heads * head_dim <= 65535 */
  kvxfer_dtype_t dtype; /**< BF16, FP16 or FP32 */
  int64_t num_tokens;   /**< >= 0; 0 is a legal (empty) transfer */
  int32_t block_size;   /**< tokens per block, >= 1 */
  int64_t row_stride;   /**< elements between consecutive rows of a block; 0 = kv_heads*head_dim */
  int64_t
      num_blocks; /**< blocks per layer in k_blocks and v_blocks (>= ceil(num_tokens/block_size)) */
  void* const* k_blocks; /**< [num_layers * num_blocks] block base pointers of K */
  void* const* v_blocks; /**< [num_layers * num_blocks] block base pointers of V */
  /** Where the blocks live: -1 host memory (the default); >= 0 the CUDA
   *  device of that ordinal (the tables above are then host arrays of device
   *  pointers).  Device memory needs a CUDA build and a usable device;
   *  elsewhere it is refused with KVXFER_ERR_UNSUPPORTED (kvxfer_send). */
  int32_t device;
} kvxfer_kv_desc_t;

#define KVXFER_KV_DESC_INITIALIZER                                               \
  {                                                                              \
    sizeof(kvxfer_kv_desc_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0, 0, 0, \
        KVXFER_DTYPE_BF16, 0, 0, 0, 0, NULL, NULL, -1                            \
  }

/** Stages of a request, in order; ERROR is final and may follow any other. */
typedef enum {
  KVXFER_STAGE_POSTED = 0,       /**< accepted, handshake or data in progress */
  KVXFER_STAGE_ANCHOR_READY = 1, /**< receiver: every page decoded at anchor precision into
                                      the blocks; sender: every anchor section sent */
  KVXFER_STAGE_COMPLETE = 2,     /**< receiver: every page at full precision, every checksum
                                      verified; sender: the receiver confirmed it */
  KVXFER_STAGE_ERROR = 3         /**< failed; kvxfer_test returns the error and its text */
} kvxfer_stage_t;

/** How the pages travel. */
typedef enum {
  /** PROGRESSIVE for codecs that split a code (LYNX, INT8, SPECTRUM),
   *  MONOLITHIC otherwise (INT4, BF16). */
  KVXFER_MODE_AUTO = 0,
  /** Anchor sections on the high-priority class, residual sections on the
   *  low-priority class; ANCHOR_READY comes first.  INT4, whose residual is
   *  empty, sends empty residual messages; BF16 is refused at the call
   *  (KVXFER_ERR_INVALID_ARGUMENT). */
  KVXFER_MODE_PROGRESSIVE = 1,
  /** Both sections of a page in one message on one class (the anchor class);
   *  ANCHOR_READY and COMPLETE coincide.  The baseline. */
  KVXFER_MODE_MONOLITHIC = 2
} kvxfer_mode_t;

/**
 * Called on the communicator's progress thread when a request reaches a
 * stage.  It must return quickly and must not call kvxfer_wait on a request
 * of the same communicator (kvxfer_test and kvxfer_request_get_info are
 * fine).  It must not free the request, and must not destroy the
 * communicator (kvxfer_comm_abort is fine).
 * The stage is visible to kvxfer_test/kvxfer_wait just before the callback
 * runs, so a waiter may wake before the callback has finished.
 * Guarantee: while on_anchor_ready runs, the receiver's blocks hold exactly
 * the anchor-precision values of every page; no residual of the request is
 * applied before it returns (a caller may copy the anchor KV there, e.g. to
 * draft on it while the residuals land).
 */
typedef void (*kvxfer_callback_t)(kvxfer_request_t request, kvxfer_stage_t stage,
                                  kvxfer_result_t result, void* user_data);

/** Per-request options; start from KVXFER_REQUEST_CONFIG_INITIALIZER.  NULL = defaults.
 *  `size`, `magic`, `version`: KVXFER_CONFIG_MAGIC's rule; a smaller one from
 *  a header without stream_layers is accepted, and stream_layers is then 0. */
typedef struct {
  size_t size;                       /**< sizeof(kvxfer_request_config_t) */
  uint32_t magic;                    /**< KVXFER_CONFIG_MAGIC */
  uint32_t version;                  /**< KVXFER_VERSION_CODE of the header used */
  uint64_t tag;                      /**< must be equal on both sides (checked); 0 by default */
  kvxfer_mode_t mode;                /**< sender only: the receiver follows the sender */
  int32_t page_tokens;               /**< sender only: tokens per page, 0 = KVXFER_PAGE_TOKENS */
  kvxfer_callback_t on_anchor_ready; /**< optional: ANCHOR_READY reached */
  kvxfer_callback_t on_complete;     /**< optional: COMPLETE or ERROR reached (final) */
  void* user_data;                   /**< passed to both callbacks */
  /** Sender only.  0: the KV is complete when the send is posted.  1: it is
   *  produced layer by layer after the post (a prefill in progress); no page
   *  of layer l is read before kvxfer_send_layer_ready(request, l), none is
   *  written after it, and layers leave in order, each as soon as it and
   *  every layer before it are marked.  In PROGRESSIVE mode the receiver
   *  applies no residual while an anchor of a request it knows is expected,
   *  so a layer reaches ANCHOR_READY as it lands but COMPLETE only after the
   *  last layer's anchors (docs/TRANSPORT.md, "Layer-streamed sends"); in
   *  MONOLITHIC mode each layer is COMPLETE as it lands.  Host KV only;
   *  not with codec SPECTRUM or alpha = auto, which look at every layer
   *  first (KVXFER_ERR_UNSUPPORTED). */
  int32_t stream_layers;
  /** 0: this request matches the peer's request of the same position, the
   *  i-th send to a peer with its i-th receive from this rank (as NCCL).
   *  1: it matches the peer's request with the same `request_id` and
   *  match_by_id = 1, whatever their order; either side may post first.  The
   *  two kinds may be mixed on one peer; each kind matches only its own.
   *  A request by id that its peer does not match within the communicator's
   *  timeout fails with KVXFER_ERR_TIMEOUT, whatever other traffic the link
   *  carries: a receive counted from its post, a send from the peer's
   *  receipt of its announcement (the send learns the peer's reason). */
  int32_t match_by_id;
  /** match_by_id = 1: the runtime's 64-bit request id (e.g. a hash of
   *  vLLM's request id).  A second send (receive) with an id already in
   *  flight to (from) the same peer is refused at the call; so is a second
   *  send to KVXFER_ANY_PEER with an id still waiting for its peer. */
  uint64_t request_id;
  /** Sender to KVXFER_ANY_PEER only: how long the send waits for a peer to
   *  ask for it, in ms, before it fails with KVXFER_ERR_TIMEOUT (on this
   *  side only: no peer knows it).  0 = the communicator's timeout
   *  (KVXFER_TIMEOUT_MS, or the endpoint config's timeout_ms); > 0 e.g. 480000 as
   *  vLLM's NixlConnector waits for a decode to read a prefill's blocks. */
  int32_t claim_timeout_ms;
} kvxfer_request_config_t;

#define KVXFER_REQUEST_CONFIG_INITIALIZER                                         \
  {                                                                               \
    sizeof(kvxfer_request_config_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0, \
        KVXFER_MODE_AUTO, 0, NULL, NULL, NULL, 0, 0, 0, 0                         \
  }

/**
 * The `peer` of a kvxfer_send (or kvxfer_send_blocks) with match_by_id = 1
 * that goes to whichever peer asks for its request_id: the runtime does not
 * know yet which decode instance will take a prefill's KV.  A receive by id
 * asks its peer for the id (protocol message ASK, docs/TRANSPORT.md "Request
 * protocol"), posted before or after the send; the first peer to ask takes
 * the send, which then runs as a send to that peer (kvxfer_request_get_info
 * gives its peer, -1 until then).  A send with stream_layers may mark
 * layers while it waits.  Not for kvxfer_recv (KVXFER_ERR_INVALID_ARGUMENT).
 * A send nobody asks for fails after claim_timeout_ms; kvxfer_request_cancel
 * ends it at once.  Asks that find no send wait, per peer, for the
 * communicator's timeout; a receive whose ask comes after its send ended so
 * (within that timeout) fails at once with the send's error.
 */
#define KVXFER_ANY_PEER (-1)

/**
 * Sends the KV cache described by `kv` to rank `peer`, encoded with `codec`
 * (NULL = KVXFER_CODEC_CONFIG_INITIALIZER: Lynx 4+4).  Returns at once with
 * `*request`; encoding, the handshake and the transfer run on the
 * communicator's threads.  The i-th kvxfer_send to a peer matches that peer's
 * i-th kvxfer_recv from this rank (as NCCL send/recv), or, with the request
 * config's match_by_id, the receive with the same request_id; the tags must
 * agree.  With match_by_id, `peer` may be KVXFER_ANY_PEER: the send goes to
 * the first peer whose receive asks for its request_id.
 * Pages are `page_tokens` tokens of one layer's K or V; they are sent in
 * layer order, anchors of every request in flight before any residual.
 * Codec SPECTRUM uses the default SpectrumKV policy and the KV norm as
 * importance; kvxfer_send_spectrum (kvxfer/spectrum.h) takes both.
 * KV on a CUDA device (kv->device >= 0) is encoded there and staged through
 * pinned host memory (docs/GPU.md).  Stream order: kvxfer_send is
 * kvxfer_send_on_stream with stream NULL, the legacy default stream (see
 * there for what that waits for; a KV written on a non-blocking stream needs
 * kvxfer_send_on_stream).  KVXFER_ERR_UNSUPPORTED in a build
 * without CUDA, where CUDA reports no usable driver or device (the message
 * quotes CUDA), or for SPECTRUM; KVXFER_ERR_INVALID_ARGUMENT for an ordinal
 * past the last device.
 * Descriptor checks (one validation, shared with the NCCL backend): size,
 * magic and version (major.minor of this header); sizes that cannot
 * overflow (num_tokens <= 2^32, num_layers * num_blocks <= 2^32, KV below
 * 2^62 bytes); the block tables readable; every block a token lives in
 * non-NULL and aligned to the element size; in host memory, its first and
 * last used byte readable (send) or writable (recv), probed with
 * process_vm_readv/writev, and every page between them mapped (mincore), so
 * that a bad pointer is an error, never a crash.  A page between them that is
 * mapped but protected (PROT_NONE; read-only, for recv) is not detected.
 * Errors (nothing is sent): KVXFER_ERR_INVALID_ARGUMENT (a NULL, a bad
 * descriptor, codec or peer; the message names the field), or
 * KVXFER_ERR_INVALID_USAGE (communicator aborted,
 * or KVXFER_MAX_REQUESTS requests already in flight with this peer in this
 * direction, or 64 requests in flight with a peer reached over shared
 * memory, both directions together: kvxfer gives each shm endpoint 512
 * receive entries (docs/TRANSPORT.md); or match_by_id with a request_id already in flight with
 * this peer in this direction, or KVXFER_MAX_REQUESTS sends to
 * KVXFER_ANY_PEER waiting, or one of them with this request_id).  A request keeps its place until
 * the progress thread retires it: shortly after its final stage (so a post right after kvxfer_wait
 * saw COMPLETE may still be refused), and for a request that failed or was cancelled while messages
 * of it were still posted, once those complete or time out (KVXFER_TIMEOUT_MS). A send by id
 * cancelled before its peer posted the receive withdraws itself: its place is free within a round
 * trip, and a receive by that id posted within the timeout, with no new send of the id posted,
 * fails within a round trip (docs/TRANSPORT.md); one its peer refused because no receive came
 * within the timeout frees its place when the refusal comes. Later failures (descriptor mismatch,
 * NaN/Inf with the ERROR policy, a peer that dies, a corrupted section) put the request in stage
 * ERROR. Thread-safety: any thread; posts from different threads
 * to one peer are matched in the order the calls take the communicator's lock.
 */
kvxfer_result_t kvxfer_send(kvxfer_comm_t comm, int peer, const kvxfer_kv_desc_t* kv,
                            const kvxfer_codec_config_t* codec,
                            const kvxfer_request_config_t* config, kvxfer_request_t* request);

/**
 * kvxfer_send of KV in CUDA device memory, stream-ordered as NCCL's
 * operations are: the encoding reads the KV only after every operation
 * enqueued on `stream` before this call has completed, so the send may be
 * posted right after the kernels that write the KV (a forward pass), without
 * synchronising.  Work enqueued on `stream` after the call is not waited for
 * and does not wait for kvxfer: the blocks must not be written until the
 * request is final (as kvxfer_send).  The call itself never blocks on the
 * device: it records an event on `stream` (cudaEventRecord, on the calling
 * thread) and kvxfer's own streams wait on it (cudaStreamWaitEvent).
 *
 * `stream` is a cudaStream_t (as void*, so that this header needs no CUDA
 * header) of the KV's device (kv->device).  NULL means the legacy default
 * stream (cudaStreamLegacy) of that device: work on it, and by its implicit
 * synchronisation work on blocking streams, is waited for; work on streams
 * created with cudaStreamNonBlocking or on a per-thread default stream is
 * NOT, so a framework that writes the KV there must pass that stream (or
 * synchronise before the call).  For host KV (kv->device < 0) `stream` is
 * ignored and the call is kvxfer_send.
 *
 * The calling thread's current CUDA device is the same after the call as
 * before (true of every kvxfer call).
 * Errors: as kvxfer_send; KVXFER_ERR_INVALID_ARGUMENT also when recording
 * on `stream` fails (a stream of another device, a destroyed stream).
 * Thread-safety: as kvxfer_send; the event is recorded during the call, so
 * the order of the call relative to the caller's own launches on `stream`
 * is what counts.
 */
kvxfer_result_t kvxfer_send_on_stream(kvxfer_comm_t comm, int peer, const kvxfer_kv_desc_t* kv,
                                      const kvxfer_codec_config_t* codec,
                                      const kvxfer_request_config_t* config, void* stream,
                                      kvxfer_request_t* request);

/**
 * Marks `layer` of a send posted with stream_layers = 1 as written: its
 * pages may now be read, encoded and sent.  Layers are sent in order, so a
 * layer marked before an earlier one waits for it.  Marking a layer twice,
 * or marking one of a request already final, changes nothing and succeeds.
 * A send whose next layer is not marked within KVXFER_TIMEOUT_MS (the
 * communicator's timeout) of the post or of the last mark ends in ERROR
 * with KVXFER_ERR_TIMEOUT, naming the layer; its peer is told.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (request NULL, layer outside
 * [0, num_layers)); KVXFER_ERR_INVALID_USAGE (a receive, or a send posted
 * without stream_layers).
 * Thread-safety: any thread, concurrently with every other call on the
 * request but kvxfer_request_free.
 */
kvxfer_result_t kvxfer_send_layer_ready(kvxfer_request_t request, int32_t layer);

/**
 * Receives a KV cache from rank `peer` into the blocks of `kv` (see
 * kvxfer_send for matching).  The codec and page size are the sender's.
 * The descriptor is checked as kvxfer_send's; the writability probe writes
 * back the first and last byte it read of each block, so nothing may write
 * the blocks while this call runs.
 * Anchor-precision values are written into the blocks as anchors land
 * (ANCHOR_READY once all are there; kvxfer_test_layer per layer), then
 * overwritten with full-precision values (COMPLETE).  A page's residual is
 * applied only after its anchor.  Every section's checksum is verified before
 * any of its values is written; a failure ends the request in ERROR and
 * COMPLETE is never reported.
 * Device KV (kv->device >= 0): the decode is synchronous per page on
 * kvxfer's streams, so when a stage is reported (kvxfer_test, kvxfer_wait,
 * the callbacks, kvxfer_test_layer) the values are already in device memory:
 * any stream may read them with work enqueued after that report, no stream
 * wait or event is needed.  Work enqueued before the report is not ordered
 * against the decode.
 * Errors as kvxfer_send.
 */
kvxfer_result_t kvxfer_recv(kvxfer_comm_t comm, int peer, const kvxfer_kv_desc_t* kv,
                            const kvxfer_request_config_t* config, kvxfer_request_t* request);

/* ------------------------------------------------------------------------ */
/* Registered KV pools: requests that name block ids                         */
/* ------------------------------------------------------------------------ */

/** Opaque handle of a registered KV pool (kvxfer_kv_pool_register). */
typedef struct kvxfer_kv_pool* kvxfer_kv_pool_t;

/**
 * A runtime's KV pool, registered once: per layer, K and V blocks at a fixed
 * stride from a base address, as vLLM's and SGLang's paged caches hold them.
 * Block b of layer l's K starts at k_layers[l] + b * block_stride bytes; a
 * block is block_size rows of kv_heads * head_dim contiguous elements of
 * `dtype` (heads major), rows row_stride elements apart.  V likewise from
 * v_layers[l].  vLLM's FlashAttention layout [2, num_blocks, block_size,
 * heads, head_dim] per layer is k_layers[l] = &t[0], v_layers[l] = &t[1],
 * block_stride 0 (one block's bytes).
 * Ownership: the two arrays are copied at registration; the memory they
 * point to must stay valid until kvxfer_kv_pool_deregister.
 */
typedef struct {
  size_t size;           /**< sizeof(kvxfer_kv_pool_desc_t) */
  uint32_t magic;        /**< KVXFER_CONFIG_MAGIC */
  uint32_t version;      /**< KVXFER_VERSION_CODE of the header used */
  int32_t num_layers;    /**< >= 1 */
  int32_t kv_heads;      /**< >= 1 */
  int32_t head_dim;      /**< >= 1; kv_heads * head_dim <= 65535 */
  kvxfer_dtype_t dtype;  /**< BF16, FP16 or FP32 */
  int32_t block_size;    /**< tokens per block, >= 1 */
  int64_t num_blocks;    /**< blocks per layer, >= 1; num_layers * num_blocks <= 2^32 */
  int64_t row_stride;    /**< elements between rows of a block; 0 = kv_heads * head_dim */
  int64_t block_stride;  /**< bytes from block b to b + 1; 0 = block_size * row_stride * element */
  void* const* k_layers; /**< [num_layers] address of block 0 of each layer's K */
  void* const* v_layers; /**< [num_layers] address of block 0 of each layer's V */
  int32_t device;        /**< -1 host memory; >= 0 the CUDA device of that ordinal */
} kvxfer_kv_pool_desc_t;

#define KVXFER_KV_POOL_DESC_INITIALIZER                                               \
  {                                                                                   \
    sizeof(kvxfer_kv_pool_desc_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0, 0, 0, \
        KVXFER_DTYPE_BF16, 0, 0, 0, 0, NULL, NULL, -1                                 \
  }

/**
 * Registers a KV pool and validates it once: the fields as kvxfer_send
 * checks a descriptor's, every base aligned to the element size, no two
 * blocks of any layer's K or V sharing a byte, a device pool's CUDA device
 * usable, and in
 * host memory each layer's K and V region (num_blocks blocks) probed as a
 * receiver's blocks are: its first and last byte readable and writable (the
 * write puts back the byte read, so nothing may write the pool during the
 * call) and every page between them mapped.  Requests on the pool then check
 * only their block ids.  A pool serves any number of communicators and
 * requests at once.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, a bad field, regions that
 * overlap, a region that is not accessible; the message names the field,
 * layer and byte); KVXFER_ERR_UNSUPPORTED (device >= 0 in a build without
 * CUDA or where CUDA reports no usable device).
 * Thread-safety: any thread.
 */
kvxfer_result_t kvxfer_kv_pool_register(const kvxfer_kv_pool_desc_t* desc, kvxfer_kv_pool_t* pool);

/**
 * Frees a pool.  Refused with KVXFER_ERR_INVALID_USAGE while a request that
 * names it has not reached a final stage (the message says how many); the
 * pool is then left as it was.  NULL is a no-op.  No call may use the pool
 * during or after a successful deregistration.
 * Thread-safety: any thread.
 */
kvxfer_result_t kvxfer_kv_pool_deregister(kvxfer_kv_pool_t pool);

/**
 * The blocks of one request on a pool: tokens [0, num_tokens) live in
 * block_ids[t / block_size] of every layer (K and V), at row t % block_size.
 * `head_begin` and `num_heads` pick the KV heads [head_begin, head_begin +
 * num_heads) of each row (num_heads 0: every head from head_begin): a
 * decode rank holding more heads than a prefill rank posts one receive per
 * prefill rank, each naming that rank's heads (vLLM's heterogeneous tensor
 * parallelism).  Both sides of a request must name as many heads.
 * Ownership: block_ids is copied by the call.
 */
typedef struct {
  size_t size;              /**< sizeof(kvxfer_kv_blocks_t) */
  uint32_t magic;           /**< KVXFER_CONFIG_MAGIC */
  uint32_t version;         /**< KVXFER_VERSION_CODE of the header used */
  int64_t num_tokens;       /**< >= 0 */
  const int32_t* block_ids; /**< [num_block_ids] ids in [0, the pool's num_blocks) */
  int64_t num_block_ids;    /**< >= ceil(num_tokens / block_size); extra ids are ignored */
  int32_t head_begin;       /**< first KV head, >= 0 */
  int32_t num_heads;        /**< heads from head_begin; 0 = to the last */
} kvxfer_kv_blocks_t;

#define KVXFER_KV_BLOCKS_INITIALIZER \
  { sizeof(kvxfer_kv_blocks_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0, NULL, 0, 0, 0 }

/**
 * kvxfer_send of the KV in `blocks` of a registered pool.  Matching, stages,
 * codecs and every other rule are kvxfer_send's; the descriptor the peer
 * compares has the pool's num_layers, head_dim and dtype, `num_heads` heads
 * and num_tokens.  The blocks are not probed again (the pool was).
 * Errors: as kvxfer_send; KVXFER_ERR_INVALID_ARGUMENT also for a NULL pool,
 * a block id out of range (naming its index and value), too few ids, a head
 * range outside the pool, or (kvxfer_recv_blocks) a block named twice.
 * Receives in flight on one pool may name the same block: the runtime owns
 * its blocks (as with NIXL), and vLLM's connector posts many one-token
 * receives into its null block to release prefills; which receive's rows
 * land in a shared block is then not defined.
 */
kvxfer_result_t kvxfer_send_blocks(kvxfer_comm_t comm, int peer, kvxfer_kv_pool_t pool,
                                   const kvxfer_kv_blocks_t* blocks,
                                   const kvxfer_codec_config_t* codec,
                                   const kvxfer_request_config_t* config,
                                   kvxfer_request_t* request);

/** kvxfer_recv into `blocks` of a registered pool (see kvxfer_send_blocks). */
kvxfer_result_t kvxfer_recv_blocks(kvxfer_comm_t comm, int peer, kvxfer_kv_pool_t pool,
                                   const kvxfer_kv_blocks_t* blocks,
                                   const kvxfer_request_config_t* config,
                                   kvxfer_request_t* request);

/**
 * Non-blocking check.  `*stage` (may be NULL) receives the current stage.
 * Returns KVXFER_SUCCESS once COMPLETE, KVXFER_IN_PROGRESS before, or the
 * request's error code (stage ERROR; the text is the last error).
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (request NULL).
 */
kvxfer_result_t kvxfer_test(kvxfer_request_t request, kvxfer_stage_t* stage);

/**
 * Waits until the request reaches `stage` (ANCHOR_READY or COMPLETE) or
 * fails.  timeout_ms < 0 waits without a limit of its own (the transport's
 * KVXFER_TIMEOUT_MS still ends a stalled transfer).  Returns KVXFER_SUCCESS,
 * KVXFER_IN_PROGRESS if timeout_ms passed first (the request goes on), or the
 * request's error code.  Do not call it from a callback.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (request NULL, stage not ANCHOR_READY or
 * COMPLETE).
 */
kvxfer_result_t kvxfer_wait(kvxfer_request_t request, kvxfer_stage_t stage, int timeout_ms);

/**
 * Stream-ordered kvxfer_wait: enqueues on `stream` (a cudaStream_t; NULL =
 * the legacy default stream) a wait for `request` to reach `stage`
 * (ANCHOR_READY or COMPLETE) or a final stage, so that work enqueued on
 * `stream` after this call, e.g. the decode step reading received device KV,
 * starts only then, while the calling thread goes on at once.  The wait is a
 * host function (cudaLaunchHostFunc) that blocks its stream, not the device;
 * it holds its own reference to the request, so kvxfer_request_free may run
 * before the stream has passed it.  The stream is released when the request
 * ends in ERROR too: check its stage (kvxfer_test) before trusting the
 * values, as after kvxfer_wait.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL request, a stage other than
 * ANCHOR_READY or COMPLETE, or a stream CUDA refuses; nothing enqueued),
 * KVXFER_ERR_UNSUPPORTED (a build without CUDA).
 * Thread-safety: any thread.
 */
kvxfer_result_t kvxfer_request_wait_on_stream(kvxfer_request_t request, kvxfer_stage_t stage,
                                              void* stream);

/**
 * Per-layer progress for layer-pipelined decode: `*stage` receives
 * ANCHOR_READY once every page of `layer` (K and V) is at anchor precision in
 * the receiver's blocks, COMPLETE once at full precision, ERROR if the
 * request failed.  Same return values as kvxfer_test.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (request NULL, layer negative or not
 * below the request's num_layers).
 */
kvxfer_result_t kvxfer_test_layer(kvxfer_request_t request, int32_t layer, kvxfer_stage_t* stage);

/** kvxfer_wait for one layer (see kvxfer_test_layer). */
kvxfer_result_t kvxfer_wait_layer(kvxfer_request_t request, int32_t layer, kvxfer_stage_t stage,
                                  int timeout_ms);

/** Timestamps (CLOCK_MONOTONIC, ns; 0 = not reached) and byte counts of a request. */
typedef struct {
  size_t size;      /**< sizeof(kvxfer_request_info_t), set by the caller */
  uint32_t magic;   /**< KVXFER_CONFIG_MAGIC, set by the caller */
  uint32_t version; /**< KVXFER_VERSION_CODE, set by the caller */
  kvxfer_stage_t stage;
  kvxfer_result_t result; /**< KVXFER_SUCCESS, KVXFER_IN_PROGRESS or the error */
  int32_t is_send;
  int32_t peer;
  kvxfer_codec_t codec; /**< the sender's codec (receiver: once the handshake is done) */
  kvxfer_mode_t mode;   /**< PROGRESSIVE or MONOLITHIC (AUTO resolved) */
  int64_t num_pages;
  int64_t pages_anchor_ready; /**< pages at anchor precision or better */
  int64_t pages_complete;     /**< pages at full precision */
  uint64_t kv_bytes;          /**< bytes of the KV in its dtype (K and V, all layers) */
  uint64_t anchor_wire_bytes; /**< bytes of anchor sections (monolithic: every section) */
  uint64_t residual_wire_bytes;
  int64_t t_posted_ns;
  int64_t t_handshake_ns; /**< both descriptors seen and equal (a receive: and admitted,
                             KVXFER_RECV_ANCHOR_BYTES) */
  int64_t t_anchor_ready_ns;
  int64_t t_complete_ns;
  int64_t t_error_ns;
  /** Receiver: when the first residual section was released to be applied,
   *  which happens only while every handshaken request is at ANCHOR_READY
   *  (the "anchors before residuals" check of kvxfer_perf); sender: 0. */
  int64_t t_first_residual_ns;
} kvxfer_request_info_t;

#define KVXFER_REQUEST_INFO_INITIALIZER                                                           \
  {                                                                                               \
    sizeof(kvxfer_request_info_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, KVXFER_STAGE_POSTED, \
        KVXFER_IN_PROGRESS, 0, 0, KVXFER_CODEC_LYNX, KVXFER_MODE_AUTO, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
        0, 0, 0                                                                                   \
  }

/** Fills `*info` (its size/magic/version set by the caller, e.g. with
 *  KVXFER_REQUEST_INFO_INITIALIZER): a consistent snapshot.  Any thread.
 *  Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, info refused by
 *  KVXFER_CONFIG_MAGIC's rule; written in place, it must have every field). */
kvxfer_result_t kvxfer_request_get_info(kvxfer_request_t request, kvxfer_request_info_t* info);

/** One page section's arrival (receiver) or send completion (sender). */
typedef struct {
  int64_t t_ns;          /**< CLOCK_MONOTONIC, ns */
  int32_t traffic_class; /**< 0 anchor (high priority), 1 residual (low priority) */
  int32_t layer;
  uint64_t bytes; /**< section bytes on the wire */
} kvxfer_arrival_t;

/**
 * Copies up to `capacity` arrival records, in the order they happened, into
 * `out` (may be NULL when capacity is 0) and sets `*count` to the total
 * recorded so far (at most 2 per page).  For plotting which class landed when.
 * The records are copied; `out` is the caller's.  Any thread.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (request or count NULL, out NULL with
 * capacity > 0).
 */
kvxfer_result_t kvxfer_request_get_arrivals(kvxfer_request_t request, kvxfer_arrival_t* out,
                                            size_t capacity, size_t* count);

/**
 * Cancels one request, on either side and at any stage (before the peer has
 * posted its match, while anchors or residuals are in flight), without
 * touching the other requests of the communicator.  Asynchronous: it returns
 * at once; the request then reaches ERROR with KVXFER_ERR_CANCELLED, once no
 * codec work touches its blocks any more (kvxfer_wait returns then, and the
 * blocks may be reused).  Its staging memory is released.  The peer's
 * matching request ends in ERROR with KVXFER_ERR_CANCELLED and a message
 * saying that the peer cancelled it, unless it was final already (a send
 * cancelled after its last byte went may end CANCELLED while its receive
 * is COMPLETE); a peer that posts its match later gets the same.
 * Cancelling a request that is already final (COMPLETE or ERROR), or
 * already cancelled, changes nothing and succeeds.  The handle must still
 * be freed.  Any thread.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (request NULL).
 */
kvxfer_result_t kvxfer_request_cancel(kvxfer_request_t request);

/**
 * Frees a request in a final stage (COMPLETE or ERROR).  A request still in
 * flight is left alone and KVXFER_ERR_INVALID_USAGE is returned: wait for it,
 * cancel it, or abort the communicator first.  NULL is a no-op.  The
 * handle is gone afterwards: no other thread may be in, or enter, a call on
 * it (kvxfer_wait included), as with free().
 */
kvxfer_result_t kvxfer_request_free(kvxfer_request_t request);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVXFER_KVXFER_H_ */
