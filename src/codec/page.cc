// The pieces of the page codec below every PageCodec (codec/page_codec.h):
// layout checks, the header, non-finite scans, the codec-independent checks
// of a received page (plan_sections) and inspect_section.
#include "codec/page.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "common/params.h"

namespace kvxfer::codec {

kvxfer_result_t validate_layout_shape(const kvxfer_page_layout_t* l, const char* what) {
  KVXFER_REQUIRE(l != nullptr, "%s layout is NULL", what);
  const int32_t dtype = c_enum_value(l->dtype);
  KVXFER_REQUIRE(
      dtype == KVXFER_DTYPE_BF16 || dtype == KVXFER_DTYPE_FP16 || dtype == KVXFER_DTYPE_FP32,
      "%s dtype %d is not BF16, FP16 or FP32", what, dtype);
  KVXFER_REQUIRE(l->num_channels >= 1 && static_cast<uint32_t>(l->num_channels) <= kMaxChannels,
                 "%s num_channels %d outside [1, %u]", what, l->num_channels, kMaxChannels);
  KVXFER_REQUIRE(l->num_tokens >= 0 && static_cast<uint64_t>(l->num_tokens) <= kMaxTokens,
                 "%s num_tokens %" PRId64 " outside [0, 2^32]", what, l->num_tokens);
  KVXFER_REQUIRE(l->block_size >= 1, "%s block_size %d must be >= 1", what, l->block_size);
  KVXFER_REQUIRE(l->row_stride >= l->num_channels,
                 "%s row_stride %" PRId64 " is smaller than num_channels %d", what, l->row_stride,
                 l->num_channels);
  KVXFER_REQUIRE(l->first_token >= 0, "%s first_token %" PRId64 " is negative", what,
                 l->first_token);
  // Every row address must be computable without overflow: the token range
  // ends below 2^62, and a block's byte size (block_size * row_stride * elem)
  // fits in 2^62 too.
  constexpr int64_t kLimit = int64_t{1} << 62;
  KVXFER_REQUIRE(l->first_token <= kLimit - l->num_tokens,
                 "%s token range [%" PRId64 ", +%" PRId64 ") overflows", what, l->first_token,
                 l->num_tokens);
  KVXFER_REQUIRE(l->row_stride <= kLimit / l->block_size / 4,
                 "%s block of %d rows of stride %" PRId64 " overflows the address space", what,
                 l->block_size, l->row_stride);
  if (l->num_tokens > 0) {
    KVXFER_REQUIRE(l->blocks != nullptr, "%s block list is NULL", what);
    const int64_t last = (l->first_token + l->num_tokens - 1) / l->block_size;
    KVXFER_REQUIRE(last < l->num_blocks,
                   "%s needs blocks up to index %" PRId64 " but num_blocks is %" PRId64, what, last,
                   l->num_blocks);
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t validate_layout(const kvxfer_page_layout_t* l, const char* what, Layout* out) {
  KVXFER_CHECK(validate_layout_shape(l, what));
  if (l->num_tokens > 0) {
    // Host memory: the block pointers themselves can be checked too.
    const int64_t first = l->first_token / l->block_size;
    const int64_t last = (l->first_token + l->num_tokens - 1) / l->block_size;
    for (int64_t b = first; b <= last; ++b)
      KVXFER_REQUIRE(l->blocks[b] != nullptr, "%s block %" PRId64 " is NULL", what, b);
  }
  out->l = l;
  out->elem = dtype_size(l->dtype);
  return KVXFER_SUCCESS;
}

int64_t block_meeting(const kvxfer_page_layout_t* l, const void* p, size_t n) {
  if (l->num_tokens == 0 || n == 0) return -1;
  using Wide = __int128;  // pointer differences and row offsets, without overflow
  const Wide es = static_cast<Wide>(dtype_size(l->dtype));
  const Wide S = l->row_stride * es, R = l->num_channels * es;
  const int64_t bs = l->block_size, u0 = l->first_token, u1 = u0 + l->num_tokens - 1;
  for (int64_t b = u0 / bs; b <= u1 / bs; ++b) {
    const int64_t r0 = b == u0 / bs ? u0 % bs : 0, r1 = b == u1 / bs ? u1 % bs : bs - 1;
    // Row r spans [r S, r S + R) from the block's base; it meets [lo, lo + n)
    // iff lo - R < r S < lo + n.  The first r past lo - R:
    const Wide lo = static_cast<Wide>(reinterpret_cast<uintptr_t>(p)) -
                    static_cast<Wide>(reinterpret_cast<uintptr_t>(l->blocks[b]));
    const Wide a = lo - R;
    Wide r = a / S + 1;
    if (a < 0 && a % S != 0) --r;  // floor division
    if (r < r0) r = r0;
    if (r <= r1 && r * S < lo + static_cast<Wide>(n)) return b;
  }
  return -1;
}

bool ranges_meet(const void* a, size_t an, const void* b, size_t bn) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return an > 0 && bn > 0 && (x < y ? y - x < an : x - y < bn);
}

kvxfer_result_t nonfinite_error(const kvxfer_page_id_t& id, int64_t t, int32_t c, bool is_nan) {
  return set_error(KVXFER_ERR_NONFINITE, "%s at layer %u %c, token %" PRId64 ", channel %d",
                   is_nan ? "NaN" : "Inf", id.layer, id.kind == KVXFER_KV_KEY ? 'K' : 'V',
                   id.token_begin + t, c);
}

/** True if a row of H values of `dt` holds a NaN or Inf: an all-ones
 *  exponent, tested on the bits (branch-free, so the compiler vectorises it). */
bool row_has_nonfinite(const uint8_t* row, int32_t H, kvxfer_dtype_t dt) {
  uint32_t any = 0;
  if (dt == KVXFER_DTYPE_FP32) {
    for (int32_t c = 0; c < H; ++c) {
      uint32_t u;
      std::memcpy(&u, row + 4 * c, 4);
      any |= static_cast<uint32_t>((u & 0x7F800000u) == 0x7F800000u);
    }
  } else {
    const uint16_t mask = dt == KVXFER_DTYPE_BF16 ? 0x7F80 : 0x7C00;
    for (int32_t c = 0; c < H; ++c) {
      uint16_t u;
      std::memcpy(&u, row + 2 * c, 2);
      any |= static_cast<uint32_t>((u & mask) == mask);
    }
  }
  return any != 0;
}

bool find_nonfinite(const Layout& src, int64_t T, int32_t H, int64_t* t, int32_t* h, float* v) {
  for (int64_t i = 0; i < T; ++i) {
    const uint8_t* row = src.row(i);
    if (!row_has_nonfinite(row, H, src.l->dtype)) continue;  // the fast common case
    for (int32_t c = 0; c < H; ++c) {
      const float x = load_elem(row, c, src.l->dtype);
      if (!std::isfinite(x)) {
        *t = i;
        *h = c;
        *v = x;
        return true;
      }
    }
  }
  return false;
}

kvxfer_result_t check_section_caps(const PageHeader& h, size_t anchor_cap, size_t residual_cap) {
  const PayloadSizes s = payload_sizes(h);
  if (anchor_cap < kHeaderBytes + s.anchor_payload() ||
      residual_cap < kHeaderBytes + s.residual_codes)
    return set_error(KVXFER_ERR_BUFFER_TOO_SMALL,
                     "page needs %llu anchor and %llu residual bytes; buffers hold %zu and %zu "
                     "(size them with kvxfer_page_max_size)",
                     (unsigned long long)(kHeaderBytes + s.anchor_payload()),
                     (unsigned long long)(kHeaderBytes + s.residual_codes), anchor_cap,
                     residual_cap);
  return KVXFER_SUCCESS;
}

PageHeader make_header(const kvxfer_codec_config_t& cfg, const kvxfer_page_id_t& id, int64_t T,
                       int32_t H, kvxfer_dtype_t src_dtype) {
  PageHeader h;
  h.codec = static_cast<uint8_t>(cfg.codec);
  h.src_dtype = static_cast<uint8_t>(src_dtype);
  h.chunk_tokens = static_cast<uint8_t>(cfg.chunk_tokens);
  switch (cfg.codec) {
    case KVXFER_CODEC_LYNX:
      h.alpha = cfg.alpha == 0.0f ? 0.0f : cfg.alpha;  // no -0 on the wire
      [[fallthrough]];
    case KVXFER_CODEC_INT8:
    case KVXFER_CODEC_SPECTRUM:  // the INT8 tier's split; INT4 tier codes are 4 anchor bits
      h.code_bits = 8;
      h.anchor_bits = static_cast<uint8_t>(cfg.anchor_bits);
      break;
    case KVXFER_CODEC_INT4:
      h.code_bits = 4;
      h.anchor_bits = 4;
      break;
    default: h.code_bits = 0; h.anchor_bits = 0;
  }
  h.kind = static_cast<uint8_t>(id.kind);
  h.layer = id.layer;
  h.num_channels = static_cast<uint32_t>(H);
  h.token_begin = id.token_begin;
  h.num_tokens = static_cast<uint64_t>(T);
  h.stream_id = id.stream_id;
  if (h.code_bits != 0 && cfg.codec != KVXFER_CODEC_SPECTRUM && id.token_begin < cfg.sink_tokens)
    h.sink_rows = static_cast<uint32_t>(std::min<int64_t>(cfg.sink_tokens - id.token_begin, T));
  // AUTO is resolved per page before the header is made (encode_page).
  if (h.code_bits != 0 && cfg.codec != KVXFER_CODEC_SPECTRUM && id.kind == KVXFER_KV_VALUE &&
      cfg.value_groups == KVXFER_VALUE_GROUPS_TOKEN)
    h.flags = FLAG_TOKEN_GROUPS;
  return h;
}

int effective_threads(int threads) {
  if (threads > 0) return threads;
  const int64_t p = params::CodecThreads();
  return p > 0 ? static_cast<int>(p) : 0;  // 0: OpenMP default (one per core)
}

PageHeader max_header(const kvxfer_codec_config_t& cfg, int64_t T, int32_t H) {
  kvxfer_page_id_t id{};      // token_begin 0: the most sink rows
  id.kind = KVXFER_KV_VALUE;  // V: the kind whose grouping may change
  kvxfer_codec_config_t channel = cfg;
  channel.value_groups = KVXFER_VALUE_GROUPS_CHANNEL;
  return make_header(channel, id, T, H, KVXFER_DTYPE_FP32);
}

void max_section_bytes(const kvxfer_codec_config_t& cfg, PageHeader h, size_t* anchor_bytes,
                       size_t* residual_bytes) {
  if (cfg.codec != KVXFER_CODEC_BF16) h.flags = FLAG_META_FP32;
  PayloadSizes s = payload_sizes(h);
  uint64_t anchor = s.anchor_payload();
  if (cfg.value_groups != KVXFER_VALUE_GROUPS_CHANNEL) {  // the larger of the two groupings
    PageHeader t = h;
    t.flags |= FLAG_TOKEN_GROUPS;
    anchor = std::max<uint64_t>(anchor, payload_sizes(t).anchor_payload());
  }
  if (cfg.nonfinite == KVXFER_NONFINITE_RAW) {
    h.flags = FLAG_RAW;
    h.sink_rows = 0;
    anchor = std::max<uint64_t>(anchor, payload_sizes(h).anchor_payload());
  }
  *anchor_bytes = kHeaderBytes + anchor;
  *residual_bytes = kHeaderBytes + s.residual_codes;
}

kvxfer_result_t plan_sections(const void* anchor, size_t anchor_len, const void* residual,
                              size_t residual_len, const kvxfer_page_id_t* expect,
                              const kvxfer_page_layout_t* dst, DecodePlan* plan, int threads) {
  if (expect != nullptr) {  // the caller's id, checked as encode checks it
    const int32_t kind = c_enum_value(expect->kind);
    KVXFER_REQUIRE(kind == KVXFER_KV_KEY || kind == KVXFER_KV_VALUE,
                   "expected page id: bad K/V kind %d", kind);
  }
  PageHeader& ah = plan->anchor;
  PageHeader rh;
  // The two checksums of a large page on two threads.  The error state is
  // per thread, so a failed section is parsed again here to report it.
  if (threads != 1 && residual != nullptr && anchor_len + residual_len >= (size_t{1} << 20)) {
    kvxfer_result_t ra = KVXFER_SUCCESS, rr = KVXFER_SUCCESS;
#pragma omp parallel sections num_threads(2)
    {
#pragma omp section
      ra = parse_section(anchor, anchor_len, &ah);
#pragma omp section
      rr = parse_section(residual, residual_len, &rh);
    }
    if (ra < 0) return parse_section(anchor, anchor_len, &ah);
    if (ah.section != SECTION_ANCHOR)
      return set_error(KVXFER_ERR_MISMATCH, "the anchor argument holds a residual section");
    if (rr < 0) return parse_section(residual, residual_len, &rh);
  } else {
    KVXFER_CHECK(parse_section(anchor, anchor_len, &ah));
    if (ah.section != SECTION_ANCHOR)
      return set_error(KVXFER_ERR_MISMATCH, "the anchor argument holds a residual section");
    if (residual != nullptr) KVXFER_CHECK(parse_section(residual, residual_len, &rh));
  }
  if (residual != nullptr) {
    KVXFER_CHECK(check_pair(ah, rh));
  } else {
    KVXFER_REQUIRE(residual_len == 0, "residual is NULL but residual_len is %zu", residual_len);
  }
  if (expect != nullptr &&
      (expect->layer != ah.layer || static_cast<uint8_t>(expect->kind) != ah.kind ||
       expect->token_begin != ah.token_begin || expect->stream_id != ah.stream_id))
    return set_error(KVXFER_ERR_MISMATCH,
                     "section is layer %u %c tokens from %lld stream %llu; expected layer %u %c "
                     "tokens from %lld stream %llu",
                     ah.layer, ah.kind == KVXFER_KV_KEY ? 'K' : 'V', (long long)ah.token_begin,
                     (unsigned long long)ah.stream_id, expect->layer,
                     expect->kind == KVXFER_KV_KEY ? 'K' : 'V', (long long)expect->token_begin,
                     (unsigned long long)expect->stream_id);
  KVXFER_CHECK(validate_layout_shape(dst, "destination"));
  if (static_cast<uint64_t>(dst->num_tokens) != ah.num_tokens ||
      static_cast<uint32_t>(dst->num_channels) != ah.num_channels)
    return set_error(KVXFER_ERR_MISMATCH,
                     "page is %llu tokens x %u channels; destination is %lld x %d",
                     (unsigned long long)ah.num_tokens, ah.num_channels, (long long)dst->num_tokens,
                     dst->num_channels);
  plan->sizes = payload_sizes(ah);
  plan->payload = static_cast<const uint8_t*>(anchor) + kHeaderBytes;
  plan->residual_payload =
      residual != nullptr ? static_cast<const uint8_t*>(residual) + kHeaderBytes : nullptr;
  plan->has_table = false;
  return KVXFER_SUCCESS;
}

kvxfer_result_t inspect_section(const void* section, size_t len, kvxfer_page_info_t* info) {
  KVXFER_REQUIRE(info != nullptr, "info is NULL");
  PageHeader h;
  KVXFER_CHECK(parse_section(section, len, &h));
  info->is_residual = h.section == SECTION_RESIDUAL;
  info->codec = static_cast<kvxfer_codec_t>(h.codec);
  info->raw_fallback = (h.flags & FLAG_RAW) != 0;
  info->alpha = h.alpha;
  info->chunk_tokens = h.chunk_tokens;
  info->anchor_bits = h.anchor_bits;
  info->residual_bits = h.code_bits - h.anchor_bits;
  info->src_dtype = static_cast<kvxfer_dtype_t>(h.src_dtype);
  info->meta_fp32 = (h.flags & FLAG_META_FP32) != 0;
  info->id.layer = h.layer;
  info->id.kind = static_cast<kvxfer_kv_kind_t>(h.kind);
  info->id.token_begin = h.token_begin;
  info->id.stream_id = h.stream_id;
  info->num_tokens = static_cast<int64_t>(h.num_tokens);
  info->num_channels = static_cast<int32_t>(h.num_channels);
  info->section_bytes = kHeaderBytes + h.payload_bytes;
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::codec
