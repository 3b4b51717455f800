#include "codec/driver.h"

#include <cinttypes>
#include <string>

#include "common/error.h"
#include "common/log.h"

namespace kvxfer::codec {

kvxfer_result_t codebook_of(const kvxfer_codec_config_t& cfg, CodebookRef* out) {
  std::string why;
  *out = get_codebook(cfg.codec, cfg.alpha, cfg.anchor_bits, &why);
  if (*out == nullptr)
    return set_error(KVXFER_ERR_INTERNAL, "no codebook for a valid config: %s", why.c_str());
  return KVXFER_SUCCESS;
}

void saturate_sink_rows(const PageHeader& h, uint8_t* anchor_payload) {
  // Only an fp32 source rounds to bf16 (sink_dtype); a finite value beyond
  // bf16's largest, 0x7F7F, would round to infinity there.
  if (sink_dtype(h) != KVXFER_DTYPE_BF16 || h.src_dtype != KVXFER_DTYPE_FP32) return;
  const PayloadSizes s = payload_sizes(h);
  uint8_t* p = anchor_payload + s.sink_offset();
  for (uint64_t i = 0; i < s.sink_bytes; i += 2) {
    const unsigned u = p[i] | static_cast<unsigned>(p[i + 1]) << 8;  // little-endian bf16
    if ((u & 0x7FFFu) == 0x7F80u) {                                  // +-inf
      p[i] = 0x7F;
      p[i + 1] = static_cast<uint8_t>((u >> 8 & 0x80u) | 0x7Fu);
    }
  }
}

kvxfer_result_t encode_with(const kvxfer_codec_config_t& cfg, const kvxfer_page_id_t& id,
                            const kvxfer_page_layout_t& src, uint8_t* anchor, size_t anchor_cap,
                            size_t* anchor_len, uint8_t* residual, size_t residual_cap,
                            size_t* residual_len, EncodeBackend* be, int seal_threads) {
  const int64_t T = src.num_tokens;
  const int32_t H = src.num_channels;
  PageHeader h = make_header(cfg, id, T, H, src.dtype);
  be->shape_header(&h);
  auto fits = [&]() -> kvxfer_result_t {
    KVXFER_CHECK(check_section_caps(h, anchor_cap, residual_cap));
    return be->check_capacity(h);
  };
  const char kind = id.kind == KVXFER_KV_KEY ? 'K' : 'V';

  NonfiniteAt bad;
  if (cfg.codec == KVXFER_CODEC_BF16 && src.dtype == KVXFER_DTYPE_BF16) {
    // The values go out as they are, FLAG_RAW or not: copy and scan at once.
    h.flags = 0;
    h.sink_rows = 0;
    KVXFER_CHECK(fits());
    KVXFER_CHECK(be->pack_bf16_scanning(h, &bad));
    if (bad.found && cfg.nonfinite == KVXFER_NONFINITE_ERROR)
      return nonfinite_error(id, bad.t, bad.c, bad.is_nan);
    if (bad.found) {
      h.flags = FLAG_RAW;
      KVXFER_WARN(LOG_CODEC,
                  "layer %u %c tokens [%" PRId64 ", +%" PRId64
                  "): non-finite input, page stored raw (lossless, not progressive)",
                  id.layer, kind, id.token_begin, T);
    }
    KVXFER_CHECK(be->finish(h));
    seal_page(h, anchor, residual, anchor_len, residual_len, seal_threads);
    return KVXFER_SUCCESS;
  }
  // Under the RAW policy, buffers that hold the page stored raw but not its
  // codes are enough when the page holds a non-finite value: look first.
  bool raw_sized = false;
  if (cfg.codec != KVXFER_CODEC_BF16 && cfg.nonfinite == KVXFER_NONFINITE_RAW) {
    if (const kvxfer_result_t rc = fits(); rc < 0) {
      const std::string codes_error = last_error();
      KVXFER_CHECK(be->scan_nonfinite(&bad));
      if (!bad.found) return set_error(rc, "%s", codes_error.c_str());
      raw_sized = true;
    }
  }
  if (cfg.codec == KVXFER_CODEC_BF16) {
    KVXFER_CHECK(be->scan_nonfinite(&bad));
  } else if (!raw_sized) {
    EncodeStatus st = EncodeStatus::NEED_FP32;
    for (int attempt = 0; attempt < 2 && st == EncodeStatus::NEED_FP32; ++attempt) {
      // First binary16 metadata; if a chunk's range does not fit, fp32 for the whole page.
      h.flags =
          static_cast<uint8_t>((h.flags & FLAG_TOKEN_GROUPS) | (attempt == 1 ? FLAG_META_FP32 : 0));
      KVXFER_CHECK(fits());
      KVXFER_CHECK(be->quantize(h, &st, &bad));
      if (st == EncodeStatus::NEED_FP32)
        KVXFER_INFO(LOG_CODEC,
                    "layer %u %c tokens [%" PRId64 ", +%" PRId64
                    "): range exceeds binary16, using fp32 metadata",
                    id.layer, kind, id.token_begin, T);
    }
    if (st == EncodeStatus::NEED_FP32)
      return set_error(KVXFER_ERR_INTERNAL, "encoder failed with fp32 metadata");
    if (st == EncodeStatus::NONFINITE) bad.found = true;
  }

  if (bad.found && cfg.nonfinite == KVXFER_NONFINITE_ERROR)
    return nonfinite_error(id, bad.t, bad.c, bad.is_nan);
  if (bad.found || cfg.codec == KVXFER_CODEC_BF16) {
    // Lossless raw fallback (input dtype) or BF16 passthrough: values go in
    // the anchor section; the residual section is empty.
    h.flags = bad.found ? FLAG_RAW : 0;
    h.sink_rows = 0;  // every value is in the payload already
    KVXFER_CHECK(fits());
    if (bad.found)
      KVXFER_WARN(LOG_CODEC,
                  "layer %u %c tokens [%" PRId64 ", +%" PRId64
                  "): non-finite input, page stored raw (lossless, not progressive)",
                  id.layer, kind, id.token_begin, T);
    KVXFER_CHECK(be->pack_values(h, bad.found ? src.dtype : KVXFER_DTYPE_BF16));
  } else if (h.sink_rows > 0) {
    KVXFER_CHECK(be->pack_sinks(h));
  }
  KVXFER_CHECK(be->finish(h));
  if (h.sink_rows > 0 && !bad.found) saturate_sink_rows(h, anchor + kHeaderBytes);
  seal_page(h, anchor, residual, anchor_len, residual_len, seal_threads);
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::codec
