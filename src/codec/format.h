// Page wire format, version 3 (docs/FORMAT.md, "Wire format").
//
// A page becomes two sections, each = 80-byte header + payload:
//   anchor   section: header | metadata [chunk][channel]{offset, half_range} | packed anchors
//                      | anchor table (2^A float32; split codecs only)
//   residual section: header | packed residuals
// All integers little-endian.  Codes are packed LSB-first in a bit stream in
// page order (token-major, e = t*H + h); with 4-bit fields that is two per
// byte, the even element in the low nibble.  The checksum is XXH3-64 of the
// header (checksum field zero) seeded with XXH3-64 of the payload.  A residual
// names its anchor through `link` = the anchor's checksum.
//
// SpectrumKV pages (codec SPECTRUM, docs/FORMAT.md section 6) differ:
//   anchor   section: header | tier counts | precision map | metadata | fp16 high bytes
//                      | int8-tier anchors | int4-tier codes | int8 anchor table
//   residual section: header | tier counts | fp16 low bytes | int8-tier residuals
// The tier counts (4 x u64) are the first 32 payload bytes of both sections;
// parse_section reads them to know the payload size, and checks the map.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {

constexpr uint32_t kMagic = 0x5058564Bu;  // bytes "KVXP"
constexpr uint16_t kWireVersion = 5;
constexpr size_t kHeaderBytes = 80;
constexpr uint32_t kMaxChannels = 1u << 20;
constexpr uint64_t kMaxTokens = 1ull << 32;
/** Largest kvxfer_codec_config_t.sink_tokens (docs/FORMAT.md 2.7). */
constexpr int32_t kMaxSinkTokens = 1024;

enum SectionKind : uint8_t { SECTION_ANCHOR = 1, SECTION_RESIDUAL = 2 };
// FLAG_TOKEN_GROUPS: the codes and metadata are those of the page's
// transpose (docs/FORMAT.md 2.8): groups of C channels of one token.
enum HeaderFlags : uint8_t {
  FLAG_RAW = 1u << 0,
  FLAG_META_FP32 = 1u << 1,
  FLAG_TOKEN_GROUPS = 1u << 2
};

/** Host-side view of a section header.  Field order = wire order. */
struct PageHeader {
  // offset 0
  uint32_t magic = kMagic;
  uint16_t version = kWireVersion;
  uint16_t header_bytes = kHeaderBytes;
  // offset 8
  uint8_t section = SECTION_ANCHOR;
  uint8_t codec = KVXFER_CODEC_LYNX;
  uint8_t flags = 0;
  uint8_t src_dtype = KVXFER_DTYPE_BF16;
  uint8_t chunk_tokens = 32;
  uint8_t code_bits = 8;
  uint8_t anchor_bits = 4;
  uint8_t kind = KVXFER_KV_KEY;
  // offset 16
  float alpha = 0.0f;
  uint32_t layer = 0;
  uint32_t num_channels = 0;
  // Rows 0..sink_rows-1 (the attention sinks, tokens at positions <
  // kvxfer_codec_config_t.sink_tokens) also travel exactly, after the anchor
  // table (docs/FORMAT.md 2.7).  LYNX, INT8 and INT4 pages that are not raw.
  uint32_t sink_rows = 0;
  // offset 32
  int64_t token_begin = 0;
  uint64_t num_tokens = 0;
  uint64_t stream_id = 0;
  uint64_t payload_bytes = 0;
  uint64_t link = 0;
  uint64_t checksum = 0;  // offset 72
  // Not header bytes: SPECTRUM pages only, the token count of each tier
  // (index = kvxfer_tier_t), the first kTierCountBytes of both payloads.
  // parse_section fills it; the encoder sets it before payload_sizes.
  uint64_t tiers[4] = {0, 0, 0, 0};
};

/** SPECTRUM: bytes of the tier-count preamble (4 x u64) at the start of both payloads. */
constexpr size_t kTierCountBytes = 32;
/** SPECTRUM: bytes of the precision map of T tokens (2 bits per token). */
inline uint64_t tier_map_bytes(uint64_t T) { return (2 * T + 7) / 8; }
/** SPECTRUM: tier of token t in a precision map (2 bits, LSB-first). */
inline unsigned tier_at(const uint8_t* map, uint64_t t) {
  return (map[t >> 2] >> (2 * (t & 3))) & 3u;
}

/**
 * Sizes of each part of a page's payloads, derived from header fields.
 * SPECTRUM pages: meta_bytes = tier counts + precision map + metadata;
 * anchor_codes = fp16 high bytes + int8-tier anchors + int4-tier codes (or the
 * raw values); residual_codes = tier counts + fp16 low bytes + int8-tier
 * residuals (spectrum_parts in codec/tiered_format.h has each part).
 */
struct PayloadSizes {
  uint64_t meta_bytes = 0;      // anchor section: per-(chunk, channel) metadata
  uint64_t anchor_codes = 0;    // anchor section: packed anchors / raw / bf16 values
  uint64_t table_bytes = 0;     // anchor section, last: per-page anchor table (2^A x f32)
  uint64_t sink_pad = 0;        // anchor section: zeros that 8-align the sink rows
  uint64_t sink_bytes = 0;      // anchor section, last: the sink rows (sink_dtype)
  uint64_t residual_codes = 0;  // residual section
  uint64_t anchor_payload() const { return sink_offset() + sink_bytes; }
  uint64_t table_offset() const { return meta_bytes + anchor_codes; }
  uint64_t sink_offset() const { return meta_bytes + anchor_codes + table_bytes + sink_pad; }
};

/**
 * The dtype of a page's sink rows (docs/FORMAT.md 2.7): the source dtype when
 * it is 16-bit (so the rows are exact), else BF16 (the BF16 codec's rounding).
 */
inline kvxfer_dtype_t sink_dtype(const PageHeader& h) {
  return h.src_dtype == KVXFER_DTYPE_FP32 ? KVXFER_DTYPE_BF16
                                          : static_cast<kvxfer_dtype_t>(h.src_dtype);
}

/**
 * Computes payload sizes from the codec fields of `h` (codec, flags,
 * src_dtype, chunk_tokens, code/anchor bits, num_tokens, num_channels; for
 * SPECTRUM also `tiers`), which must already be valid.
 */
PayloadSizes payload_sizes(const PageHeader& h);

/**
 * The header of the grouped body of a FLAG_TOKEN_GROUPS page (docs/FORMAT.md
 * 2.8): h with num_tokens and num_channels swapped, the flag and the sink
 * rows cleared.  The encoders and decoders run on it over the transposed
 * page; its payload_sizes give the same metadata and code sizes as h's.
 */
inline PageHeader grouped_body_header(const PageHeader& h) {
  PageHeader b = h;
  b.num_tokens = h.num_channels;
  b.num_channels = static_cast<uint32_t>(h.num_tokens);
  b.flags = static_cast<uint8_t>(h.flags & ~FLAG_TOKEN_GROUPS);
  b.sink_rows = 0;
  return b;
}

/** Bytes of one element of `dtype` (2 or 4). */
size_t dtype_size(kvxfer_dtype_t dtype);
/** "bf16", "fp16", "fp32" ("?" for another value), for messages. */
const char* dtype_name(kvxfer_dtype_t dtype);
/** "K" or "V", for messages. */
const char* kv_kind_name(kvxfer_kv_kind_t kind);

/** Serialises `h` into 80 bytes at `out`. */
void write_header(const PageHeader& h, uint8_t* out);

/** Computes the checksum of a section whose header is already written and stores it. */
void seal_section(uint8_t* section);

/**
 * Writes and seals both headers of a page whose payloads are in place after
 * the 80-byte header slots of `anchor` and `residual`: the residual's link is
 * the anchor's checksum.  Sets the two section lengths.  threads != 1 hashes
 * the two payloads of a large page (1 MiB or more) on two threads.
 */
void seal_page(PageHeader h, uint8_t* anchor, uint8_t* residual, size_t* anchor_len,
               size_t* residual_len, int threads = 1);

/**
 * Parses and fully validates one section of exactly `len` bytes: every
 * header field, the payload size implied by them, and the checksum.  Does not
 * look inside the payload, except for SPECTRUM pages: their tier counts
 * (which the payload size depends on; they must add up to num_tokens) and, in
 * an anchor section, the precision map (its tiers must match the counts and
 * its padding bits be zero).  Errors: TRUNCATED (len shorter than the header,
 * the tier counts, or header + payload), INVALID_ARGUMENT (len longer than the
 * section), CORRUPT (a field out of range, inconsistent fields, bad checksum,
 * counts or map inconsistent).
 */
kvxfer_result_t parse_section(const void* buf, size_t len, PageHeader* h);

/**
 * The length the header at `buf` claims for its section (kHeaderBytes +
 * payload_bytes), without validating anything else: how a reader finds the
 * second of two sections sent back to back (monolithic transfers).  0 when
 * `len` is shorter than a header or the claim exceeds `len`.
 */
size_t section_extent(const void* buf, size_t len);

/**
 * Checks that `res` is the residual section of anchor `anc`: every identity
 * and codec field (and SPECTRUM tier count) equal, and res.link ==
 * anc.checksum.  Errors: MISMATCH.
 */
kvxfer_result_t check_pair(const PageHeader& anc, const PageHeader& res);

}  // namespace kvxfer::codec
