// The exported C API of the page codec; each entry runs in api_call
// (common/api_call.h).
#include "codec/codec.h"
#include "common/api_call.h"
#include "common/struct_abi.h"

using kvxfer::api_call;

namespace {

/**
 * The caller's codec config made whole (struct_abi.h: an older, smaller one
 * takes the defaults for the fields it lacks).
 */
kvxfer_result_t whole_config(const kvxfer_codec_config_t* config, kvxfer_codec_config_t* out) {
  return kvxfer::read_struct(config, out);
}

}  // namespace

extern "C" {

kvxfer_result_t kvxfer_get_version(int* version) {
  return api_call(__func__, [&] {
    KVXFER_REQUIRE(version != nullptr, "version is NULL");
    *version = KVXFER_VERSION_CODE;
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_page_max_size(const kvxfer_codec_config_t* config, int64_t num_tokens,
                                     int32_t num_channels, size_t* anchor_bytes,
                                     size_t* residual_bytes) {
  return api_call(__func__, [&] {
    kvxfer_codec_config_t c;
    KVXFER_CHECK(whole_config(config, &c));
    return kvxfer::codec::max_sizes(&c, num_tokens, num_channels, anchor_bytes, residual_bytes);
  });
}

kvxfer_result_t kvxfer_page_encode(const kvxfer_codec_config_t* config, const kvxfer_page_id_t* id,
                                   const kvxfer_page_layout_t* src, void* anchor, size_t anchor_cap,
                                   size_t* anchor_len, void* residual, size_t residual_cap,
                                   size_t* residual_len) {
  kvxfer::reset_outputs(anchor_len, residual_len);
  return api_call(__func__, [&] {
    kvxfer_codec_config_t c;
    KVXFER_CHECK(whole_config(config, &c));
    return kvxfer::codec::encode_page(&c, id, src, anchor, anchor_cap, anchor_len, residual,
                                      residual_cap, residual_len);
  });
}

kvxfer_result_t kvxfer_page_encode_tiered(const kvxfer_codec_config_t* config,
                                          const kvxfer_page_id_t* id,
                                          const kvxfer_page_layout_t* src,
                                          const uint8_t* token_tiers, void* anchor,
                                          size_t anchor_cap, size_t* anchor_len, void* residual,
                                          size_t residual_cap, size_t* residual_len) {
  kvxfer::reset_outputs(anchor_len, residual_len);
  return api_call(__func__, [&] {
    kvxfer_codec_config_t c;
    KVXFER_CHECK(whole_config(config, &c));
    return kvxfer::codec::encode_page_tiered(&c, id, src, token_tiers, anchor, anchor_cap,
                                             anchor_len, residual, residual_cap, residual_len);
  });
}

kvxfer_result_t kvxfer_page_get_tiers(const void* anchor, size_t anchor_len, uint8_t* token_tiers,
                                      int64_t num_tokens) {
  return api_call(__func__, [&] {
    return kvxfer::codec::get_page_tiers(anchor, anchor_len, token_tiers, num_tokens);
  });
}

kvxfer_result_t kvxfer_page_decode(const void* anchor, size_t anchor_len, const void* residual,
                                   size_t residual_len, const kvxfer_page_id_t* expect,
                                   const kvxfer_page_layout_t* dst) {
  return api_call(__func__, [&] {
    return kvxfer::codec::decode_page(anchor, anchor_len, residual, residual_len, expect, dst);
  });
}

kvxfer_result_t kvxfer_codec_calibrate_alpha(const kvxfer_codec_config_t* config,
                                             const kvxfer_page_layout_t* pages, int32_t num_pages,
                                             float* alpha) {
  return api_call(__func__, [&] {
    kvxfer_codec_config_t c;
    KVXFER_CHECK(whole_config(config, &c));
    c.alpha = 0.0f;  // config->alpha is ignored, as documented
    KVXFER_CHECK(kvxfer::codec::validate_config(&c));
    return kvxfer::codec::calibrate_alpha(&c, pages, num_pages, alpha);
  });
}

kvxfer_result_t kvxfer_page_inspect(const void* section, size_t len, kvxfer_page_info_t* info) {
  return api_call(__func__, [&] { return kvxfer::codec::inspect_section(section, len, info); });
}

}  // extern "C"
