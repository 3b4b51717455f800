// The registry of page codecs (page_codec: the codec enum to its PageCodec)
// and the entry points of codec/codec.h, which run the checks every codec
// shares and hand the rest to the codec a config or a page header names.
#include "codec/page_codec.h"

#include <algorithm>
#include <cinttypes>
#include <tuple>

#include "codec/codec.h"
#include "codec/format.h"
#include "common/error.h"
#include "common/struct_abi.h"

namespace kvxfer::codec {

const PageCodec* page_codec(int32_t codec) {
  switch (codec) {
    case KVXFER_CODEC_LYNX:
    case KVXFER_CODEC_INT8:
    case KVXFER_CODEC_INT4:
    case KVXFER_CODEC_BF16: return uniform_codec(static_cast<kvxfer_codec_t>(codec));
    case KVXFER_CODEC_SPECTRUM: return tiered_codec();
    default: return nullptr;
  }
}

kvxfer_result_t validate_config(const kvxfer_codec_config_t* cfg) {
  KVXFER_CHECK(check_struct_in_place(cfg));  // read_config made a smaller one whole
  // The enum fields as the integers the caller stored (c_enum_value).
  const int32_t codec = c_enum_value(cfg->codec), nonfinite = c_enum_value(cfg->nonfinite),
                groups = c_enum_value(cfg->value_groups);
  const PageCodec* pc = page_codec(codec);
  KVXFER_REQUIRE(pc != nullptr, "unknown codec %d", codec);
  KVXFER_REQUIRE(valid_chunk_tokens(cfg->chunk_tokens), "chunk_tokens %d is not 16, 32, 64 or 128",
                 cfg->chunk_tokens);
  KVXFER_REQUIRE(nonfinite == KVXFER_NONFINITE_ERROR || nonfinite == KVXFER_NONFINITE_RAW,
                 "unknown nonfinite policy %d", nonfinite);
  KVXFER_REQUIRE(cfg->sink_tokens >= 0 && cfg->sink_tokens <= kMaxSinkTokens,
                 "codec config: sink_tokens %d outside [0, %d]", cfg->sink_tokens, kMaxSinkTokens);
  KVXFER_REQUIRE(groups >= KVXFER_VALUE_GROUPS_CHANNEL && groups <= KVXFER_VALUE_GROUPS_AUTO,
                 "codec config: unknown value_groups %d", groups);
  KVXFER_REQUIRE(cfg->value_groups == KVXFER_VALUE_GROUPS_CHANNEL || pc->value_groups(),
                 "codec config: value_groups %d needs LYNX, INT8 or INT4 (BF16 and SPECTRUM "
                 "have no groups to choose)",
                 static_cast<int>(cfg->value_groups));
  return pc->check_config(*cfg);
}

namespace {

/** max_sizes of a validated config and shape. */
void valid_max_sizes(const kvxfer_codec_config_t& cfg, int64_t T, int32_t H, size_t* anchor_bytes,
                     size_t* residual_bytes) {
  PageHeader h = max_header(cfg, T, H);
  page_codec(cfg.codec)->widen_max_header(&h);
  max_section_bytes(cfg, h, anchor_bytes, residual_bytes);
}

}  // namespace

kvxfer_result_t max_sizes(const kvxfer_codec_config_t* cfg, int64_t T, int32_t H,
                          size_t* anchor_bytes, size_t* residual_bytes) {
  KVXFER_CHECK(validate_config(cfg));
  KVXFER_REQUIRE(anchor_bytes != nullptr && residual_bytes != nullptr, "NULL size output");
  KVXFER_REQUIRE(T >= 0 && static_cast<uint64_t>(T) <= kMaxTokens,
                 "num_tokens %" PRId64 " outside [0, 2^32]", T);
  KVXFER_REQUIRE(H >= 1 && static_cast<uint32_t>(H) <= kMaxChannels,
                 "num_channels %d outside [1, %u]", H, kMaxChannels);
  valid_max_sizes(*cfg, T, H, anchor_bytes, residual_bytes);
  return KVXFER_SUCCESS;
}

kvxfer_result_t check_encode_args(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                                  const kvxfer_page_layout_t* src, const void* anchor,
                                  size_t* anchor_len, const void* residual, size_t* residual_len) {
  KVXFER_CHECK(check_encode_args_common(cfg, id, src, anchor, anchor_len, residual, residual_len));
  const PageCodec* codec = page_codec(cfg->codec);
  KVXFER_REQUIRE(!codec->token_tiers(), "codec %s needs token tiers: use kvxfer_page_encode_tiered",
                 codec->name());
  return KVXFER_SUCCESS;
}

kvxfer_result_t check_encode_args_common(const kvxfer_codec_config_t* cfg,
                                         const kvxfer_page_id_t* id,
                                         const kvxfer_page_layout_t* src, const void* anchor,
                                         size_t* anchor_len, const void* residual,
                                         size_t* residual_len) {
  // On every failure both lengths read 0 (whatever fails first).
  if (anchor_len != nullptr) *anchor_len = 0;
  if (residual_len != nullptr) *residual_len = 0;
  KVXFER_CHECK(validate_config(cfg));
  KVXFER_REQUIRE(id != nullptr, "page id is NULL");
  const int32_t kind = c_enum_value(id->kind);
  KVXFER_REQUIRE(kind == KVXFER_KV_KEY || kind == KVXFER_KV_VALUE, "bad K/V kind %d", kind);
  KVXFER_REQUIRE(id->token_begin >= 0, "negative token_begin %" PRId64, id->token_begin);
  KVXFER_REQUIRE(
      anchor != nullptr && residual != nullptr && anchor_len != nullptr && residual_len != nullptr,
      "NULL output buffer or length");
  KVXFER_REQUIRE(anchor != residual, "anchor and residual must be different buffers");
  KVXFER_CHECK(validate_layout_shape(src, "source"));
  KVXFER_REQUIRE(id->token_begin <= (int64_t{1} << 62) - src->num_tokens,
                 "token_begin %" PRId64 " + num_tokens %" PRId64 " overflows", id->token_begin,
                 src->num_tokens);
  return KVXFER_SUCCESS;
}

namespace {

/** Bytes of a layout's block list: the pointers, every one of num_blocks. */
size_t block_list_bytes(const kvxfer_page_layout_t* l) {
  return static_cast<size_t>(l->num_blocks) * sizeof(void*);
}

/**
 * The buffers of a host encode share no byte: the two outputs (as far as
 * the page can fill them, max_sizes), and each output with the source rows,
 * the source's block list and the token tiers.  Else encode would write
 * over what it reads.
 */
kvxfer_result_t check_encode_buffers(const kvxfer_codec_config_t* cfg,
                                     const kvxfer_page_layout_t* src, const uint8_t* token_tiers,
                                     const void* anchor, size_t anchor_cap, const void* residual,
                                     size_t residual_cap) {
  size_t amax = 0, rmax = 0;  // cfg and src are validated (check_encode_args_common)
  valid_max_sizes(*cfg, src->num_tokens, src->num_channels, &amax, &rmax);
  const size_t an = std::min(anchor_cap, amax), rn = std::min(residual_cap, rmax);
  KVXFER_REQUIRE(!ranges_meet(anchor, an, residual, rn),
                 "the anchor buffer [%p, +%zu) and the residual buffer [%p, +%zu) overlap", anchor,
                 an, residual, rn);
  for (auto [buf, n, what] : {std::tuple{anchor, an, "anchor"}, {residual, rn, "residual"}}) {
    const int64_t b = block_meeting(src, buf, n);
    KVXFER_REQUIRE(b < 0,
                   "the %s buffer [%p, +%zu) overlaps source block %" PRId64
                   ": encode would write over its input",
                   what, buf, n, b);
    KVXFER_REQUIRE(token_tiers == nullptr ||
                       !ranges_meet(buf, n, token_tiers, static_cast<size_t>(src->num_tokens)),
                   "the %s buffer [%p, +%zu) overlaps the token tiers", what, buf, n);
    KVXFER_REQUIRE(!ranges_meet(buf, n, src->blocks, block_list_bytes(src)),
                   "the %s buffer [%p, +%zu) overlaps the source's block list [%p, +%zu)", what,
                   buf, n, static_cast<const void*>(src->blocks), block_list_bytes(src));
  }
  return KVXFER_SUCCESS;
}

}  // namespace

kvxfer_result_t encode_page(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                            const kvxfer_page_layout_t* src, void* anchor, size_t anchor_cap,
                            size_t* anchor_len, void* residual, size_t residual_cap,
                            size_t* residual_len, Impl impl, int threads) {
  KVXFER_CHECK(check_encode_args(cfg, id, src, anchor, anchor_len, residual, residual_len));
  KVXFER_CHECK(check_encode_buffers(cfg, src, nullptr, anchor, anchor_cap, residual, residual_cap));
  return page_codec(cfg->codec)
      ->encode(EncodeCall{cfg, id, src, nullptr, anchor, anchor_cap, anchor_len, residual,
                          residual_cap, residual_len, impl, threads});
}

kvxfer_result_t encode_page_tiered(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                                   const kvxfer_page_layout_t* src, const uint8_t* token_tiers,
                                   void* anchor, size_t anchor_cap, size_t* anchor_len,
                                   void* residual, size_t residual_cap, size_t* residual_len,
                                   int threads) {
  KVXFER_CHECK(check_encode_args_common(cfg, id, src, anchor, anchor_len, residual, residual_len));
  const PageCodec* codec = page_codec(cfg->codec);
  KVXFER_REQUIRE(codec->token_tiers(),
                 "token tiers need codec SPECTRUM (4), not codec %d: use kvxfer_page_encode",
                 static_cast<int>(cfg->codec));
  KVXFER_CHECK(
      check_encode_buffers(cfg, src, token_tiers, anchor, anchor_cap, residual, residual_cap));
  return codec->encode(EncodeCall{cfg, id, src, token_tiers, anchor, anchor_cap, anchor_len,
                                  residual, residual_cap, residual_len, Impl::AUTO, threads});
}

kvxfer_result_t encode_any_page(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                                const kvxfer_page_layout_t* src, const uint8_t* token_tiers,
                                void* anchor, size_t anchor_cap, size_t* anchor_len, void* residual,
                                size_t residual_cap, size_t* residual_len, Impl impl, int threads) {
  const PageCodec* codec = cfg != nullptr ? page_codec(cfg->codec) : nullptr;
  if (codec != nullptr && codec->token_tiers())
    return encode_page_tiered(cfg, id, src, token_tiers, anchor, anchor_cap, anchor_len, residual,
                              residual_cap, residual_len, threads);
  return encode_page(cfg, id, src, anchor, anchor_cap, anchor_len, residual, residual_cap,
                     residual_len, impl, threads);
}

kvxfer_result_t plan_decode(const void* anchor, size_t anchor_len, const void* residual,
                            size_t residual_len, const kvxfer_page_id_t* expect,
                            const kvxfer_page_layout_t* dst, DecodePlan* plan) {
  KVXFER_CHECK(plan_decode_any(anchor, anchor_len, residual, residual_len, expect, dst, plan));
  if (!plan->codec->on_device())
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "SpectrumKV pages are decoded on the host only (kvxfer_page_decode)");
  return KVXFER_SUCCESS;
}

kvxfer_result_t plan_decode_any(const void* anchor, size_t anchor_len, const void* residual,
                                size_t residual_len, const kvxfer_page_id_t* expect,
                                const kvxfer_page_layout_t* dst, DecodePlan* plan, int threads) {
  KVXFER_CHECK(
      plan_sections(anchor, anchor_len, residual, residual_len, expect, dst, plan, threads));
  plan->codec = page_codec(plan->anchor.codec);  // parse_section checked the range
  return plan->codec->plan(plan);
}

kvxfer_result_t plan_residual(DecodePlan* plan, const void* residual, size_t residual_len) {
  PageHeader rh;
  KVXFER_CHECK(parse_section(residual, residual_len, &rh));
  KVXFER_CHECK(check_pair(plan->anchor, rh));
  plan->residual_payload = static_cast<const uint8_t*>(residual) + kHeaderBytes;
  return KVXFER_SUCCESS;
}

kvxfer_result_t decode_planned(const DecodePlan& plan, const kvxfer_page_layout_t* dst, Impl impl,
                               int threads) {
  Layout lay;
  KVXFER_CHECK(validate_layout(dst, "destination", &lay));  // host blocks: non-NULL too
  KVXFER_CHECK(resolve_impl(impl, &impl));
  plan.codec->decode(plan, lay, impl, effective_threads(threads));
  return KVXFER_SUCCESS;
}

kvxfer_result_t decode_page(const void* anchor, size_t anchor_len, const void* residual,
                            size_t residual_len, const kvxfer_page_id_t* expect,
                            const kvxfer_page_layout_t* dst, Impl impl, int threads) {
  DecodePlan plan;
  KVXFER_CHECK(plan_decode_any(anchor, anchor_len, residual, residual_len, expect, dst, &plan,
                               effective_threads(threads)));
  // Decode reads the sections while it writes the rows.
  for (auto [buf, n, what] :
       {std::tuple{anchor, anchor_len, "anchor"}, {residual, residual_len, "residual"}}) {
    const int64_t b = block_meeting(dst, buf, n);  // -1 for no residual (n = 0)
    KVXFER_REQUIRE(b < 0,
                   "the %s section [%p, +%zu) overlaps destination block %" PRId64
                   ": decode would write over what it reads",
                   what, buf, n, b);
  }
  // ... and reads the block list while it writes the rows.
  const int64_t b = block_meeting(dst, dst->blocks, block_list_bytes(dst));
  KVXFER_REQUIRE(b < 0,
                 "the destination's block list [%p, +%zu) lies in destination block %" PRId64
                 ": decode would write over the pointers it reads",
                 static_cast<const void*>(dst->blocks), block_list_bytes(dst), b);
  return decode_planned(plan, dst, impl, threads);
}

}  // namespace kvxfer::codec
