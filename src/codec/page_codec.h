// The page codec strategy: one implementation per family of pages, chosen
// once from the codec enum (a config's codec, or a page header's).
//
//   uniform (codec/uniform_codec.cc): LYNX, INT8, INT4 and BF16, every token
//            at the codec's precision (docs/FORMAT.md sections 2 to 5);
//   tiered  (codec/tiered_format.cc): SPECTRUM, a precision tier per token
//            (docs/FORMAT.md section 6).
//
// page_codec() in codec/page_codec.cc is the one registry from the enum to
// its implementation.  The entry points of codec/codec.h run the checks every
// codec shares (codec/page.h) and hand the rest to the chosen PageCodec.
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec/codec.h"
#include "codec/page.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {

/** One encode call, its arguments validated by the entry point (check_encode_args_common). */
struct EncodeCall {
  const kvxfer_codec_config_t* cfg;
  const kvxfer_page_id_t* id;
  const kvxfer_page_layout_t* src;
  const uint8_t* token_tiers;  // codecs with token tiers only (encode_page_tiered)
  void* anchor;
  size_t anchor_cap;
  size_t* anchor_len;
  void* residual;
  size_t residual_cap;
  size_t* residual_len;
  Impl impl;
  int threads;
};

class PageCodec {
 public:
  virtual ~PageCodec() = default;
  /** The codec's name in messages ("LYNX", "SPECTRUM", ...). */
  virtual const char* name() const = 0;
  /** True if every token has its own precision tier (encode_page_tiered, a precision map). */
  virtual bool token_tiers() const = 0;
  /** True if the CUDA codec (src/cuda) encodes and decodes these pages. */
  virtual bool on_device() const = 0;
  /** True if a page has residual bits (a progressive transfer has a second step). */
  virtual bool has_residual() const = 0;
  /** True if V pages may be token-grouped (kvxfer_codec_config_t.value_groups). */
  virtual bool value_groups() const = 0;
  /** The checks of validate_config that depend on the codec (the shared ones passed). */
  virtual kvxfer_result_t check_config(const kvxfer_codec_config_t& cfg) const = 0;
  /** Widens the header of max_sizes to the codec's largest page; default nothing. */
  virtual void widen_max_header(PageHeader* h) const { (void)h; }
  virtual kvxfer_result_t encode(const EncodeCall& c) const = 0;
  /**
   * The codec's checks of a parsed page (plan_sections done) before anything
   * is written; sets plan->cb and the anchor table.  Errors: CORRUPT.
   */
  virtual kvxfer_result_t plan(DecodePlan* plan) const = 0;
  /** Decodes a planned page into the host layout `dst` (impl resolved). */
  virtual void decode(const DecodePlan& plan, const Layout& dst, Impl impl, int threads) const = 0;
};

/**
 * The argument checks of every page encoder (CPU and CUDA host path): sets
 * both lengths to 0 first, then validates config, id, buffers and the layout's
 * shape (not its block pointers, which may be device memory).
 * check_encode_args also refuses codec SPECTRUM, which needs token tiers
 * (encode_page_tiered); check_encode_args_common does not.
 */
kvxfer_result_t check_encode_args_common(const kvxfer_codec_config_t* cfg,
                                         const kvxfer_page_id_t* id,
                                         const kvxfer_page_layout_t* src, const void* anchor,
                                         size_t* anchor_len, const void* residual,
                                         size_t* residual_len);
kvxfer_result_t check_encode_args(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                                  const kvxfer_page_layout_t* src, const void* anchor,
                                  size_t* anchor_len, const void* residual, size_t* residual_len);

/**
 * Every check decoding makes before it writes (docs/FORMAT.md 4.4):
 * plan_sections, then those of the page's codec (PageCodec::plan): every
 * metadata pair and table entry.  Does not touch the destination's blocks
 * (they may be device memory).  Shared by the CPU decoder and the CUDA host
 * path.  Pages of a codec without a GPU decoder (PageCodec::on_device, codec
 * SPECTRUM) fail with KVXFER_ERR_UNSUPPORTED here: only the CPU decoder,
 * through plan_decode_any, decodes them.
 */
kvxfer_result_t plan_decode(const void* anchor, size_t anchor_len, const void* residual,
                            size_t residual_len, const kvxfer_page_id_t* expect,
                            const kvxfer_page_layout_t* dst, DecodePlan* plan);
/**
 * plan_decode for every codec, SPECTRUM included.  threads as for
 * plan_sections.  For a SPECTRUM page plan->cb is the INT8 tier's codebook
 * (nullptr for a raw page).
 */
kvxfer_result_t plan_decode_any(const void* anchor, size_t anchor_len, const void* residual,
                                size_t residual_len, const kvxfer_page_id_t* expect,
                                const kvxfer_page_layout_t* dst, DecodePlan* plan, int threads = 1);
/**
 * Adds the residual section to a plan made from the anchor alone: parses and
 * checksums it and checks that it belongs to plan->anchor (check_pair).  The
 * anchor is not parsed again; its bytes must still be where the plan points.
 */
kvxfer_result_t plan_residual(DecodePlan* plan, const void* residual, size_t residual_len);
/**
 * Decodes a planned page (plan_decode_any, plan_residual) into the host
 * layout `dst`, which must be the one it was planned for.  decode_page is
 * plan_decode_any and this.
 */
kvxfer_result_t decode_planned(const DecodePlan& plan, const kvxfer_page_layout_t* dst,
                               Impl impl = Impl::AUTO, int threads = 0);
/**
 * get_page_tiers on a planned anchor section (the same checks and errors,
 * without parsing the section again).
 */
kvxfer_result_t plan_page_tiers(const DecodePlan& plan, uint8_t* token_tiers, int64_t num_tokens);

/** The largest kvxfer_codec_t value: codecs are 0..kLastCodec. */
constexpr int32_t kLastCodec = KVXFER_CODEC_SPECTRUM;

/** The implementation of `codec`; nullptr for a value outside kvxfer_codec_t. */
const PageCodec* page_codec(int32_t codec);

/** The implementations (the registry's entries). */
const PageCodec* uniform_codec(kvxfer_codec_t codec);
const PageCodec* tiered_codec();

}  // namespace kvxfer::codec
