#include "codec/format.h"

#include <xxhash.h>
#if defined(__x86_64__)
// XXH3 through libxxhash's run-time dispatch (AVX2 where the CPU has it):
// the same hash, computed with the widest vectors available.
#include <immintrin.h>
#include <xxh_x86dispatch.h>
#endif

#include <cmath>
#include <cstring>

#include "codec/codebook.h"
#include "common/error.h"

namespace kvxfer::codec {

namespace {

// Little-endian field codecs: the wire order is explicit, independent of the host.
template <typename T>
void put(uint8_t*& p, T v) {
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  for (size_t i = 0; i < sizeof(T); ++i) *p++ = static_cast<uint8_t>(u >> (8 * i));
}
template <typename T>
T get(const uint8_t*& p) {
  uint64_t u = 0;
  for (size_t i = 0; i < sizeof(T); ++i) u |= static_cast<uint64_t>(*p++) << (8 * i);
  T v;
  std::memcpy(&v, &u, sizeof(T));
  return v;
}

constexpr size_t kPayloadBytesOffset = 56;
constexpr size_t kChecksumOffset = 72;

#if defined(__x86_64__)
__attribute__((target("avx"))) void vzeroupper() { _mm256_zeroupper(); }
#endif
// libxxhash's AVX2 / AVX-512 code returns with the upper halves of the vector
// registers in use, and legacy-SSE code after it (this library's baseline
// x86-64 code: the metadata checks of a decode, the scalar codec) then runs
// several times slower on some CPUs (measured: 4.5x on an AMD EPYC with
// AVX-512), until a VZEROUPPER.
void clear_upper_state() {
#if defined(__x86_64__)
  static const bool avx = __builtin_cpu_supports("avx");
  if (avx) vzeroupper();
#endif
}

// Format 2: the payload is hashed first and its hash seeds the hash of the
// header (checksum field zero), so that the payload hashes of a page's two
// sections are independent of the headers and of each other (the residual's
// header holds the anchor's checksum) and can be computed at the same time.
uint64_t payload_hash(const uint8_t* section, uint64_t payload_bytes) {
  const uint64_t h = XXH3_64bits(section + kHeaderBytes, payload_bytes);
  clear_upper_state();
  return h;
}
uint64_t header_checksum(const uint8_t* section, uint64_t payload_hash) {
  uint8_t hdr[kHeaderBytes];
  std::memcpy(hdr, section, kHeaderBytes);
  std::memset(hdr + kChecksumOffset, 0, 8);
  return XXH3_64bits_withSeed(hdr, kHeaderBytes, payload_hash);
}
uint64_t compute_checksum(const uint8_t* section, uint64_t payload_bytes) {
  return header_checksum(section, payload_hash(section, payload_bytes));
}

uint64_t ceil_div8(uint64_t bits) { return (bits + 7) / 8; }

}  // namespace

size_t dtype_size(kvxfer_dtype_t dtype) { return dtype == KVXFER_DTYPE_FP32 ? 4 : 2; }

const char* dtype_name(kvxfer_dtype_t dtype) {
  switch (dtype) {
    case KVXFER_DTYPE_BF16: return "bf16";
    case KVXFER_DTYPE_FP16: return "fp16";
    case KVXFER_DTYPE_FP32: return "fp32";
  }
  return "?";
}

const char* kv_kind_name(kvxfer_kv_kind_t kind) { return kind == KVXFER_KV_KEY ? "K" : "V"; }

PayloadSizes payload_sizes(const PageHeader& h) {
  PayloadSizes s;
  const uint64_t n = h.num_tokens * h.num_channels;
  if (h.codec == KVXFER_CODEC_SPECTRUM) {
    // docs/FORMAT.md 6.3.  Counts <= T <= 2^32 and H <= 2^20: no overflow.
    const uint64_t H = h.num_channels;
    const uint64_t n16 = h.tiers[KVXFER_TIER_FP16] * H, n8 = h.tiers[KVXFER_TIER_INT8] * H,
                   n4 = h.tiers[KVXFER_TIER_INT4] * H;
    s.meta_bytes = kTierCountBytes + tier_map_bytes(h.num_tokens);
    if (h.flags & FLAG_RAW) {
      s.anchor_codes = (n16 + n8 + n4) * dtype_size(static_cast<kvxfer_dtype_t>(h.src_dtype));
      s.residual_codes = kTierCountBytes;
      return s;
    }
    const uint64_t chunks = (h.num_tokens + h.chunk_tokens - 1) / h.chunk_tokens;
    s.meta_bytes += chunks * H * 2 * ((h.flags & FLAG_META_FP32) ? 4 : 2);
    const unsigned R = h.code_bits - h.anchor_bits;
    s.anchor_codes = n16 + ceil_div8(n8 * h.anchor_bits) + ceil_div8(n4 * 4);
    s.table_bytes = 4ull << h.anchor_bits;
    s.residual_codes = kTierCountBytes + n16 + ceil_div8(n8 * R);
    return s;
  }
  if (h.flags & FLAG_RAW) {
    s.anchor_codes = n * dtype_size(static_cast<kvxfer_dtype_t>(h.src_dtype));
  } else if (h.codec == KVXFER_CODEC_BF16) {
    s.anchor_codes = n * 2;
  } else {
    // Groups: C tokens of one channel, or with FLAG_TOKEN_GROUPS C channels
    // of one token (docs/FORMAT.md 2.8).
    const bool tg = (h.flags & FLAG_TOKEN_GROUPS) != 0;
    const uint64_t along = tg ? h.num_channels : h.num_tokens;
    const uint64_t across = tg ? h.num_tokens : h.num_channels;
    const uint64_t chunks = (along + h.chunk_tokens - 1) / h.chunk_tokens;
    s.meta_bytes = chunks * across * 2 * ((h.flags & FLAG_META_FP32) ? 4 : 2);
    s.anchor_codes = ceil_div8(n * h.anchor_bits);
    s.residual_codes = ceil_div8(n * (h.code_bits - h.anchor_bits));
    if (carries_anchor_table(static_cast<kvxfer_codec_t>(h.codec), h.alpha, h.code_bits,
                             h.anchor_bits))
      s.table_bytes = 4ull << h.anchor_bits;
    if (h.sink_rows > 0) {
      s.sink_pad = (8 - (s.meta_bytes + s.anchor_codes + s.table_bytes) % 8) % 8;
      s.sink_bytes = static_cast<uint64_t>(h.sink_rows) * h.num_channels * 2;  // <= 2^53
    }
  }
  return s;
}

void write_header(const PageHeader& h, uint8_t* out) {
  uint8_t* p = out;
  put(p, h.magic);
  put(p, h.version);
  put(p, h.header_bytes);
  put(p, h.section);
  put(p, h.codec);
  put(p, h.flags);
  put(p, h.src_dtype);
  put(p, h.chunk_tokens);
  put(p, h.code_bits);
  put(p, h.anchor_bits);
  put(p, h.kind);
  put(p, h.alpha);
  put(p, h.layer);
  put(p, h.num_channels);
  put(p, h.sink_rows);
  put(p, h.token_begin);
  put(p, h.num_tokens);
  put(p, h.stream_id);
  put(p, h.payload_bytes);
  put(p, h.link);
  put(p, h.checksum);
}

void seal_section(uint8_t* section) {
  const uint8_t* p = section + 56;  // payload_bytes
  const uint64_t payload = get<uint64_t>(p);
  uint8_t* q = section + kChecksumOffset;
  put(q, compute_checksum(section, payload));
}

void seal_page(PageHeader h, uint8_t* anchor, uint8_t* residual, size_t* anchor_len,
               size_t* residual_len, int threads) {
  const PayloadSizes s = payload_sizes(h);
  // The two payload hashes first, on two threads when the page is large.
  uint64_t ha = 0, hr = 0;
  const bool two = threads != 1 && s.anchor_payload() + s.residual_codes >= (uint64_t{1} << 20);
#pragma omp parallel sections num_threads(2) if (two)
  {
#pragma omp section
    ha = payload_hash(anchor, s.anchor_payload());
#pragma omp section
    hr = payload_hash(residual, s.residual_codes);
  }
  h.section = SECTION_ANCHOR;
  h.payload_bytes = s.anchor_payload();
  h.link = 0;
  write_header(h, anchor);
  const uint64_t ca = header_checksum(anchor, ha);
  uint8_t* q = anchor + kChecksumOffset;
  put(q, ca);
  h.section = SECTION_RESIDUAL;
  h.payload_bytes = s.residual_codes;
  h.link = ca;  // the anchor's checksum
  write_header(h, residual);
  q = residual + kChecksumOffset;
  put(q, header_checksum(residual, hr));
  *anchor_len = kHeaderBytes + s.anchor_payload();
  *residual_len = kHeaderBytes + s.residual_codes;
}

size_t section_extent(const void* buf, size_t len) {
  if (buf == nullptr || len < kHeaderBytes) return 0;
  const uint8_t* p = static_cast<const uint8_t*>(buf) + kPayloadBytesOffset;
  const uint64_t payload = get<uint64_t>(p);
  if (payload > len - kHeaderBytes) return 0;
  return kHeaderBytes + static_cast<size_t>(payload);
}

kvxfer_result_t parse_section(const void* buf, size_t len, PageHeader* out) {
  if (buf == nullptr) return set_error(KVXFER_ERR_INVALID_ARGUMENT, "section pointer is NULL");
  if (len < kHeaderBytes)
    return set_error(KVXFER_ERR_TRUNCATED, "section is %zu bytes, shorter than the %zu-byte header",
                     len, kHeaderBytes);
  const uint8_t* base = static_cast<const uint8_t*>(buf);
  const uint8_t* p = base;
  PageHeader h;
  h.magic = get<uint32_t>(p);
  h.version = get<uint16_t>(p);
  h.header_bytes = get<uint16_t>(p);
  h.section = get<uint8_t>(p);
  h.codec = get<uint8_t>(p);
  h.flags = get<uint8_t>(p);
  h.src_dtype = get<uint8_t>(p);
  h.chunk_tokens = get<uint8_t>(p);
  h.code_bits = get<uint8_t>(p);
  h.anchor_bits = get<uint8_t>(p);
  h.kind = get<uint8_t>(p);
  h.alpha = get<float>(p);
  h.layer = get<uint32_t>(p);
  h.num_channels = get<uint32_t>(p);
  h.sink_rows = get<uint32_t>(p);
  h.token_begin = get<int64_t>(p);
  h.num_tokens = get<uint64_t>(p);
  h.stream_id = get<uint64_t>(p);
  h.payload_bytes = get<uint64_t>(p);
  h.link = get<uint64_t>(p);
  h.checksum = get<uint64_t>(p);

#define CORRUPT_IF(cond, ...) \
  if (cond) return set_error(KVXFER_ERR_CORRUPT, __VA_ARGS__)
  CORRUPT_IF(h.magic != kMagic, "bad magic 0x%08x (not a kvxfer page section)", h.magic);
  CORRUPT_IF(h.version != kWireVersion, "wire version %u, this build reads version %u", h.version,
             kWireVersion);
  CORRUPT_IF(h.header_bytes != kHeaderBytes, "header_bytes %u, expected %zu", h.header_bytes,
             kHeaderBytes);
  CORRUPT_IF(h.section != SECTION_ANCHOR && h.section != SECTION_RESIDUAL, "bad section kind %u",
             h.section);
  CORRUPT_IF(h.codec > KVXFER_CODEC_SPECTRUM, "bad codec %u", h.codec);
  CORRUPT_IF(h.flags & ~(FLAG_RAW | FLAG_META_FP32 | FLAG_TOKEN_GROUPS), "unknown flags 0x%02x",
             h.flags);
  CORRUPT_IF((h.flags & FLAG_TOKEN_GROUPS) &&
                 ((h.flags & FLAG_RAW) || h.codec == KVXFER_CODEC_BF16 ||
                  h.codec == KVXFER_CODEC_SPECTRUM || h.kind != KVXFER_KV_VALUE),
             "token groups on a page that is not a quantized V page (flags 0x%02x)", h.flags);
  CORRUPT_IF((h.flags & FLAG_TOKEN_GROUPS) && h.num_tokens > kMaxChannels,
             "token groups on a page of %llu tokens (at most 2^20)",
             (unsigned long long)h.num_tokens);
  CORRUPT_IF(h.src_dtype > KVXFER_DTYPE_FP32, "bad source dtype %u", h.src_dtype);
  CORRUPT_IF(!valid_chunk_tokens(h.chunk_tokens), "bad chunk_tokens %u", h.chunk_tokens);
  CORRUPT_IF(h.kind > KVXFER_KV_VALUE, "bad K/V kind %u", h.kind);
  CORRUPT_IF(h.sink_rows != 0 && ((h.flags & FLAG_RAW) || h.codec == KVXFER_CODEC_BF16 ||
                                  h.codec == KVXFER_CODEC_SPECTRUM),
             "sink_rows %u on a page without codes", h.sink_rows);
  CORRUPT_IF(h.num_channels == 0 || h.num_channels > kMaxChannels, "bad num_channels %u",
             h.num_channels);
  CORRUPT_IF(h.num_tokens > kMaxTokens, "bad num_tokens %llu", (unsigned long long)h.num_tokens);
  CORRUPT_IF(h.sink_rows > h.num_tokens, "sink_rows %u exceeds num_tokens %llu", h.sink_rows,
             (unsigned long long)h.num_tokens);
  CORRUPT_IF(h.token_begin < 0, "negative token_begin %lld", (long long)h.token_begin);
  CORRUPT_IF(h.section == SECTION_ANCHOR && h.link != 0, "anchor section with a link");
  switch (h.codec) {
    case KVXFER_CODEC_LYNX:
    case KVXFER_CODEC_INT8:
    case KVXFER_CODEC_SPECTRUM:  // the INT8 tier's split (its INT4 tier is all anchor)
      CORRUPT_IF(h.code_bits != 8 || h.anchor_bits < 2 || h.anchor_bits > 6, "bad bit split %u/%u",
                 h.code_bits, h.anchor_bits);
      break;
    case KVXFER_CODEC_INT4:
      CORRUPT_IF(h.code_bits != 4 || h.anchor_bits != 4, "bad bit split %u/%u", h.code_bits,
                 h.anchor_bits);
      break;
    default:  // BF16
      CORRUPT_IF(h.code_bits != 0 || h.anchor_bits != 0, "bad bit split %u/%u", h.code_bits,
                 h.anchor_bits);
      CORRUPT_IF(h.flags & FLAG_META_FP32, "BF16 page with a metadata flag");
  }
  if (h.codec == KVXFER_CODEC_LYNX) {
    CORRUPT_IF(!(h.alpha >= 0.0f && h.alpha <= kMaxAlpha), "bad alpha %g", (double)h.alpha);
  } else {
    CORRUPT_IF(std::memcmp(&h.alpha, "\0\0\0\0", 4) != 0, "alpha set on a non-LYNX page");
  }
  CORRUPT_IF((h.flags & FLAG_RAW) && (h.flags & FLAG_META_FP32), "raw page with a metadata flag");

  if (h.codec == KVXFER_CODEC_SPECTRUM) {
    // The payload size depends on the tier counts, the first 32 payload bytes.
    CORRUPT_IF(h.payload_bytes < kTierCountBytes,
               "SpectrumKV payload_bytes %llu is shorter than its %zu-byte tier counts",
               (unsigned long long)h.payload_bytes, kTierCountBytes);
    if (len < kHeaderBytes + kTierCountBytes)
      return set_error(KVXFER_ERR_TRUNCATED,
                       "SpectrumKV section truncated: %zu bytes, shorter than header and tier "
                       "counts (%zu)",
                       len, kHeaderBytes + kTierCountBytes);
    const uint8_t* q = base + kHeaderBytes;
    uint64_t sum = 0;
    bool in_range = true;
    for (int k = 0; k < 4; ++k) {
      h.tiers[k] = get<uint64_t>(q);
      in_range = in_range && h.tiers[k] <= h.num_tokens;
      if (in_range) sum += h.tiers[k];  // each <= 2^32: no overflow
    }
    CORRUPT_IF(!in_range || sum != h.num_tokens,
               "SpectrumKV tier counts fp16 %llu + int8 %llu + int4 %llu + drop %llu do not add "
               "up to num_tokens %llu",
               (unsigned long long)h.tiers[0], (unsigned long long)h.tiers[1],
               (unsigned long long)h.tiers[2], (unsigned long long)h.tiers[3],
               (unsigned long long)h.num_tokens);
  }
#undef CORRUPT_IF

  const PayloadSizes sizes = payload_sizes(h);
  const uint64_t expect =
      h.section == SECTION_ANCHOR ? sizes.anchor_payload() : sizes.residual_codes;
  if (h.payload_bytes != expect)
    return set_error(KVXFER_ERR_CORRUPT, "payload_bytes %llu, but the header fields imply %llu",
                     (unsigned long long)h.payload_bytes, (unsigned long long)expect);
  const uint64_t total = kHeaderBytes + h.payload_bytes;
  if (len < total)
    return set_error(KVXFER_ERR_TRUNCATED, "section truncated: %zu of %llu bytes", len,
                     (unsigned long long)total);
  if (len > total)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                     "section length %zu exceeds the %llu bytes its header describes", len,
                     (unsigned long long)total);
  const uint64_t sum = compute_checksum(base, h.payload_bytes);
  if (sum != h.checksum)
    return set_error(KVXFER_ERR_CORRUPT,
                     "checksum mismatch on %s section of layer %u %c tokens [%lld, +%llu): "
                     "stored %016llx, computed %016llx",
                     h.section == SECTION_ANCHOR ? "anchor" : "residual", h.layer,
                     h.kind == KVXFER_KV_KEY ? 'K' : 'V', (long long)h.token_begin,
                     (unsigned long long)h.num_tokens, (unsigned long long)h.checksum,
                     (unsigned long long)sum);
  if (h.codec == KVXFER_CODEC_SPECTRUM && h.section == SECTION_ANCHOR) {
    // The precision map, after the counts: its tiers must be the counted ones
    // (every 2-bit value names a tier, so a forged map shows up here or in the
    // sizes) and its padding bits zero.
    const uint8_t* map = base + kHeaderBytes + kTierCountBytes;
    const uint64_t T = h.num_tokens;
    uint64_t seen[4] = {0, 0, 0, 0};
    for (uint64_t t = 0; t < T; ++t) ++seen[tier_at(map, t)];
    const uint64_t mb = tier_map_bytes(T);
    const unsigned used_bits = static_cast<unsigned>(2 * T - 8 * (mb - 1));  // in the last byte
    if (mb > 0 && used_bits < 8 && (map[mb - 1] >> used_bits) != 0)
      return set_error(KVXFER_ERR_CORRUPT,
                       "SpectrumKV precision map: padding bits after token %llu are 0x%02x, must "
                       "be 0",
                       (unsigned long long)T, map[mb - 1] >> used_bits);
    for (int k = 0; k < 4; ++k)
      if (seen[k] != h.tiers[k])
        return set_error(KVXFER_ERR_CORRUPT,
                         "SpectrumKV precision map holds fp16 %llu, int8 %llu, int4 %llu, drop "
                         "%llu tokens; the tier counts say %llu, %llu, %llu, %llu",
                         (unsigned long long)seen[0], (unsigned long long)seen[1],
                         (unsigned long long)seen[2], (unsigned long long)seen[3],
                         (unsigned long long)h.tiers[0], (unsigned long long)h.tiers[1],
                         (unsigned long long)h.tiers[2], (unsigned long long)h.tiers[3]);
  }
  *out = h;
  return KVXFER_SUCCESS;
}

kvxfer_result_t check_pair(const PageHeader& a, const PageHeader& r) {
  if (a.section != SECTION_ANCHOR)
    return set_error(KVXFER_ERR_MISMATCH, "first section is not an anchor section");
  if (r.section != SECTION_RESIDUAL)
    return set_error(KVXFER_ERR_MISMATCH, "second section is not a residual section");
  const bool same = a.codec == r.codec && a.flags == r.flags && a.src_dtype == r.src_dtype &&
                    a.chunk_tokens == r.chunk_tokens && a.code_bits == r.code_bits &&
                    a.anchor_bits == r.anchor_bits && a.kind == r.kind &&
                    std::memcmp(&a.alpha, &r.alpha, 4) == 0 && a.layer == r.layer &&
                    a.num_channels == r.num_channels && a.token_begin == r.token_begin &&
                    a.num_tokens == r.num_tokens && a.stream_id == r.stream_id &&
                    a.sink_rows == r.sink_rows &&
                    std::memcmp(a.tiers, r.tiers, sizeof(a.tiers)) == 0;
  if (!same || r.link != a.checksum)
    return set_error(KVXFER_ERR_MISMATCH,
                     "residual section (layer %u %c tokens [%lld, +%llu), stream %llu) does not "
                     "belong to anchor section (layer %u %c tokens [%lld, +%llu), stream %llu)%s",
                     r.layer, r.kind == KVXFER_KV_KEY ? 'K' : 'V', (long long)r.token_begin,
                     (unsigned long long)r.num_tokens, (unsigned long long)r.stream_id, a.layer,
                     a.kind == KVXFER_KV_KEY ? 'K' : 'V', (long long)a.token_begin,
                     (unsigned long long)a.num_tokens, (unsigned long long)a.stream_id,
                     same ? " (link checksum differs)" : "");
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::codec
