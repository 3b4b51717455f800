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

/** The largest kvxfer_codec_t value: codecs are 0..kLastCodec. */
constexpr int32_t kLastCodec = KVXFER_CODEC_SPECTRUM;

/** The implementation of `codec`; nullptr for a value outside kvxfer_codec_t. */
const PageCodec* page_codec(int32_t codec);

/** The implementations (the registry's entries). */
const PageCodec* uniform_codec(kvxfer_codec_t codec);
const PageCodec* tiered_codec();

}  // namespace kvxfer::codec
