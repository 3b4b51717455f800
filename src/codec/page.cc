// Page encode/decode orchestration: validation, header, choice of metadata
// precision, raw fallback, BF16 passthrough, and dispatch to a CPU path.
#include "codec/page.h"

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <vector>

#include "codec/codec.h"
#include "codec/driver.h"
#include "codec/fast.h"
#include "codec/tiered_format.h"
#include "common/error.h"
#include "common/log.h"
#include "common/params.h"
#include "common/struct_abi.h"

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

kvxfer_result_t resolve_impl(Impl requested, Impl* out) {
  Impl impl = requested;
  if (impl == Impl::AUTO) {
    switch (params::CodecImpl()) {
      case params::CodecPath::kAuto: impl = Impl::AUTO; break;
      case params::CodecPath::kAvx2: impl = Impl::AVX2; break;
      case params::CodecPath::kAvx512: impl = Impl::AVX512; break;
      case params::CodecPath::kScalar: impl = Impl::SCALAR; break;
      case params::CodecPath::kReference: impl = Impl::REFERENCE; break;
    }
    if (impl == Impl::AUTO)
      impl = fast::cpu_has_avx512() ? Impl::AVX512
             : fast::cpu_has_avx2() ? Impl::AVX2
                                    : Impl::SCALAR;
  }
  if (impl == Impl::AVX2 && !fast::cpu_has_avx2())
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "the AVX2 codec path was requested but this CPU "
                     "lacks AVX2/F16C");
  if (impl == Impl::AVX512 && !fast::cpu_has_avx512())
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "the AVX-512 codec path was requested but this CPU "
                     "lacks AVX-512 F/BW/VL/DQ");
  *out = impl;
  return KVXFER_SUCCESS;
}

kvxfer_result_t validate_config(const kvxfer_codec_config_t* cfg) {
  KVXFER_CHECK(check_struct_in_place(cfg));  // read_config made a smaller one whole
  // The enum fields as the integers the caller stored (c_enum_value).
  const int32_t codec = c_enum_value(cfg->codec), nonfinite = c_enum_value(cfg->nonfinite),
                groups = c_enum_value(cfg->value_groups);
  KVXFER_REQUIRE(codec >= KVXFER_CODEC_LYNX && codec <= KVXFER_CODEC_SPECTRUM, "unknown codec %d",
                 codec);
  KVXFER_REQUIRE(valid_chunk_tokens(cfg->chunk_tokens), "chunk_tokens %d is not 16, 32, 64 or 128",
                 cfg->chunk_tokens);
  KVXFER_REQUIRE(nonfinite == KVXFER_NONFINITE_ERROR || nonfinite == KVXFER_NONFINITE_RAW,
                 "unknown nonfinite policy %d", nonfinite);
  KVXFER_REQUIRE(cfg->sink_tokens >= 0 && cfg->sink_tokens <= kMaxSinkTokens,
                 "codec config: sink_tokens %d outside [0, %d]", cfg->sink_tokens, kMaxSinkTokens);
  KVXFER_REQUIRE(groups >= KVXFER_VALUE_GROUPS_CHANNEL && groups <= KVXFER_VALUE_GROUPS_AUTO,
                 "codec config: unknown value_groups %d", groups);
  KVXFER_REQUIRE(cfg->value_groups == KVXFER_VALUE_GROUPS_CHANNEL ||
                     (cfg->codec != KVXFER_CODEC_BF16 && cfg->codec != KVXFER_CODEC_SPECTRUM),
                 "codec config: value_groups %d needs LYNX, INT8 or INT4 (BF16 and SPECTRUM "
                 "have no groups to choose)",
                 static_cast<int>(cfg->value_groups));
  if (cfg->codec == KVXFER_CODEC_SPECTRUM) {
    // anchor_bits is the INT8 tier's split (docs/FORMAT.md 6.2); alpha is unused.
    KVXFER_REQUIRE(cfg->anchor_bits >= 2 && cfg->anchor_bits <= 6,
                   "codec config: anchor_bits %d must be 2..6 for SPECTRUM (its int8 tier's split)",
                   cfg->anchor_bits);
  } else if (cfg->codec != KVXFER_CODEC_BF16) {
    std::string why;
    const bool autoa = cfg->codec == KVXFER_CODEC_LYNX && cfg->alpha == KVXFER_ALPHA_AUTO;
    if (get_codebook(cfg->codec, autoa ? 0.0f : cfg->alpha, cfg->anchor_bits, &why) == nullptr)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT, "codec config: %s (alpha %g, anchor_bits %d)",
                       why.c_str(), static_cast<double>(cfg->alpha), cfg->anchor_bits);
  }
  return KVXFER_SUCCESS;
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

kvxfer_result_t max_sizes(const kvxfer_codec_config_t* cfg, int64_t T, int32_t H,
                          size_t* anchor_bytes, size_t* residual_bytes) {
  KVXFER_CHECK(validate_config(cfg));
  KVXFER_REQUIRE(anchor_bytes != nullptr && residual_bytes != nullptr, "NULL size output");
  KVXFER_REQUIRE(T >= 0 && static_cast<uint64_t>(T) <= kMaxTokens,
                 "num_tokens %" PRId64 " outside [0, 2^32]", T);
  KVXFER_REQUIRE(H >= 1 && static_cast<uint32_t>(H) <= kMaxChannels,
                 "num_channels %d outside [1, %u]", H, kMaxChannels);
  kvxfer_page_id_t id{};      // token_begin 0: the most sink rows
  id.kind = KVXFER_KV_VALUE;  // V: the kind whose grouping may change
  kvxfer_codec_config_t channel = *cfg;
  channel.value_groups = KVXFER_VALUE_GROUPS_CHANNEL;
  PageHeader h = make_header(channel, id, T, H, KVXFER_DTYPE_FP32);
  // SPECTRUM: every token FP16 is the largest page (docs/FORMAT.md 6.3).
  if (cfg->codec == KVXFER_CODEC_SPECTRUM) h.tiers[KVXFER_TIER_FP16] = static_cast<uint64_t>(T);
  if (cfg->codec != KVXFER_CODEC_BF16) h.flags = FLAG_META_FP32;
  PayloadSizes s = payload_sizes(h);
  uint64_t anchor = s.anchor_payload();
  if (cfg->value_groups != KVXFER_VALUE_GROUPS_CHANNEL) {  // the larger of the two groupings
    PageHeader t = h;
    t.flags |= FLAG_TOKEN_GROUPS;
    anchor = std::max<uint64_t>(anchor, payload_sizes(t).anchor_payload());
  }
  if (cfg->nonfinite == KVXFER_NONFINITE_RAW) {
    h.flags = FLAG_RAW;
    h.sink_rows = 0;
    anchor = std::max<uint64_t>(anchor, payload_sizes(h).anchor_payload());
  }
  *anchor_bytes = kHeaderBytes + anchor;
  *residual_bytes = kHeaderBytes + s.residual_codes;
  return KVXFER_SUCCESS;
}

kvxfer_result_t check_encode_args(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                                  const kvxfer_page_layout_t* src, const void* anchor,
                                  size_t* anchor_len, const void* residual, size_t* residual_len) {
  KVXFER_CHECK(check_encode_args_common(cfg, id, src, anchor, anchor_len, residual, residual_len));
  KVXFER_REQUIRE(cfg->codec != KVXFER_CODEC_SPECTRUM,
                 "codec SPECTRUM needs token tiers: use kvxfer_page_encode_tiered");
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

/**
 * A page's transpose in host memory, in its own dtype: row c holds channel c
 * of the T tokens (the layout of a token-grouped body, docs/FORMAT.md 2.8).
 */
class TransposedPage {
 public:
  TransposedPage() = default;
  TransposedPage(const TransposedPage&) = delete;  // its layout points into it
  TransposedPage& operator=(const TransposedPage&) = delete;
  /** Allocates H rows of T elements of `dt` (contents undefined). */
  void shape(int64_t T, int32_t H, kvxfer_dtype_t dt) {
    elem_ = dtype_size(dt);
    buf_.resize(static_cast<size_t>(T) * H * elem_);
    ptr_ = buf_.data();
    l_ = kvxfer_page_layout_t{&ptr_, 1, H, T, 0, H, static_cast<int32_t>(T), dt};
  }
  /** The transpose of rows 0..T-1 of src. */
  void fill_from(const Layout& src, int64_t T, int32_t H) {
    shape(T, H, src.l->dtype);
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* row = src.row(t);
      for (int32_t c = 0; c < H; ++c)
        std::memcpy(buf_.data() + (static_cast<size_t>(c) * T + t) * elem_, row + c * elem_, elem_);
    }
  }
  /** Writes the transpose back: row t of dst gets element t of every row. */
  void store_to(const Layout& dst, int64_t T, int32_t H) const {
    for (int64_t t = 0; t < T; ++t) {
      uint8_t* row = dst.row(t);
      for (int32_t c = 0; c < H; ++c)
        std::memcpy(row + c * elem_, buf_.data() + (static_cast<size_t>(c) * T + t) * elem_, elem_);
    }
  }
  Layout layout() const { return Layout{&l_, elem_}; }

 private:
  std::vector<uint8_t> buf_;
  void* ptr_ = nullptr;
  kvxfer_page_layout_t l_{};
  size_t elem_ = 0;
};

/** The CPU paths as an EncodeBackend: payloads straight into the host sections. */
class HostBackend final : public EncodeBackend {
 public:
  HostBackend(const Layout& lay, uint8_t* anchor, uint8_t* residual, Impl impl, int threads)
      : lay_(lay), anc_(anchor), res_(residual), impl_(impl), threads_(threads) {}

  /** The codebook of a quantizing config (validated, alpha resolved). */
  kvxfer_result_t use(const kvxfer_codec_config_t& cfg) { return codebook_of(cfg, &cb_); }

  kvxfer_result_t scan_nonfinite(NonfiniteAt* at) override {
    locate(at);
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t quantize(const PageHeader& h, EncodeStatus* status, NonfiniteAt* at) override {
    const Codebook& cb = *cb_;
    uint64_t hist[256] = {0};
    const PayloadSizes s = payload_sizes(h);
    // Token groups: the body is the encoding of the transposed page
    // (docs/FORMAT.md 2.8), encoded by the same paths.
    const bool tg = (h.flags & FLAG_TOKEN_GROUPS) != 0;
    const PageHeader body = tg ? grouped_body_header(h) : h;
    Layout qlay = lay_;
    TransposedPage tp;
    if (tg) {
      tp.fill_from(lay_, static_cast<int64_t>(h.num_tokens), static_cast<int32_t>(h.num_channels));
      qlay = tp.layout();
    }
    EncodeJob job{&cb,
                  &body,
                  qlay,
                  (h.flags & FLAG_META_FP32) != 0,
                  anc_ + kHeaderBytes,
                  nullptr,
                  res_ + kHeaderBytes,
                  hist};
    job.anchors = job.meta + s.meta_bytes;
    *status =
        impl_ == Impl::REFERENCE ? reference::encode(job) : fast::encode(job, impl_, threads_);
    if (*status == EncodeStatus::NONFINITE) {
      locate(at);
    } else if (*status == EncodeStatus::OK && has_anchor_table(cb)) {
      // Per-page anchor table, last in the anchor payload (docs/FORMAT.md 2.4).
      float table[64];
      anchor_table_from_histogram(cb, hist, table);
      uint8_t* out = anc_ + kHeaderBytes + s.table_offset();
      for (unsigned a = 0; a < (1u << cb.anchor_bits); ++a) put_f32_le(out + 4 * a, table[a]);
    }
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t pack_values(const PageHeader& h, kvxfer_dtype_t odt) override {
    pack_rows(static_cast<int64_t>(h.num_tokens), static_cast<int32_t>(h.num_channels), odt,
              anc_ + kHeaderBytes);
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t pack_bf16_scanning(const PageHeader& h, NonfiniteAt* at) override {
    // Row by row: each row is scanned while it is in L1 from its copy.
    const int64_t T = static_cast<int64_t>(h.num_tokens);
    const int32_t H = static_cast<int32_t>(h.num_channels);
    const size_t bytes = static_cast<size_t>(H) * 2;
    uint8_t* out = anc_ + kHeaderBytes;
    bool any = false;
    const bool avx2 = impl_ == Impl::AVX2 || impl_ == Impl::AVX512;
    for (int64_t t = 0; t < T; ++t) {
      uint8_t* orow = out + static_cast<size_t>(t) * bytes;
      if (avx2) {
        any |= fast::copy_row_bf16_scanning_avx2(orow, lay_.row(t), H);
      } else {
        std::memcpy(orow, lay_.row(t), bytes);
        any |= row_has_nonfinite(orow, H, KVXFER_DTYPE_BF16);
      }
    }
    at->found = false;
    if (any) locate(at);  // the first one, as scan_nonfinite reports it
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t pack_sinks(const PageHeader& h) override {
    const PayloadSizes s = payload_sizes(h);
    uint8_t* out = anc_ + kHeaderBytes + s.sink_offset();
    std::memset(out - s.sink_pad, 0, s.sink_pad);
    pack_rows(h.sink_rows, static_cast<int32_t>(h.num_channels), sink_dtype(h), out);
    return KVXFER_SUCCESS;
  }

 private:
  // Rows 0..T-1 of the source as `odt`, row after row, at `out`.
  void pack_rows(int64_t T, int32_t H, kvxfer_dtype_t odt, uint8_t* out) const {
    const kvxfer_dtype_t sdt = lay_.l->dtype;
    const size_t osz = dtype_size(odt);
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* row = lay_.row(t);
      uint8_t* orow = out + static_cast<size_t>(t) * H * osz;
      if (odt == sdt)
        std::memcpy(orow, row, static_cast<size_t>(H) * osz);
      else
        for (int32_t c = 0; c < H; ++c) store_elem(orow, c, odt, load_elem(row, c, sdt));
    }
  }

  void locate(NonfiniteAt* at) const {
    float v = 0;
    at->found = find_nonfinite(lay_, lay_.l->num_tokens, lay_.l->num_channels, &at->t, &at->c, &v);
    at->is_nan = at->found && std::isnan(v);
  }

  Layout lay_;
  uint8_t* anc_;
  uint8_t* res_;
  Impl impl_;
  int threads_;
  CodebookRef cb_;
};

}  // namespace

namespace {
/**
 * KVXFER_VALUE_GROUPS_AUTO for one V page (cfg's other fields resolved): the
 * grouping whose anchor-only decode has the smaller sum of squared errors
 * against the source (double), CHANNEL on a tie or when a trial encode
 * fails (the real encode then reports the failure).
 */
kvxfer_value_groups_t choose_value_groups(const kvxfer_codec_config_t& cfg,
                                          const kvxfer_page_id_t& id,
                                          const kvxfer_page_layout_t& src, const Layout& lay,
                                          Impl impl, int threads) {
  const int64_t T = src.num_tokens;
  const int32_t H = src.num_channels;
  std::vector<float> out(static_cast<size_t>(T) * H);
  void* block = out.data();
  const kvxfer_page_layout_t dst{
      &block, 1, static_cast<int32_t>(std::max<int64_t>(T, 1)), H, 0, T, H, KVXFER_DTYPE_FP32};
  double sse[2] = {0, 0};
  for (int g = 0; g < 2; ++g) {
    kvxfer_codec_config_t c = cfg;
    c.value_groups = g == 0 ? KVXFER_VALUE_GROUPS_CHANNEL : KVXFER_VALUE_GROUPS_TOKEN;
    size_t acap = 0, rcap = 0, alen = 0, rlen = 0;
    if (max_sizes(&c, T, H, &acap, &rcap) < 0) return KVXFER_VALUE_GROUPS_CHANNEL;
    std::vector<uint8_t> a(acap), r(rcap);
    if (encode_page(&c, &id, &src, a.data(), acap, &alen, r.data(), rcap, &rlen, impl, threads) <
            0 ||
        decode_page(a.data(), alen, nullptr, 0, &id, &dst, impl, threads) < 0)
      return KVXFER_VALUE_GROUPS_CHANNEL;
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* row = lay.row(t);
      for (int32_t ch = 0; ch < H; ++ch) {
        const double d = static_cast<double>(out[static_cast<size_t>(t) * H + ch]) -
                         load_elem(row, ch, src.dtype);
        sse[g] += d * d;
      }
    }
  }
  return sse[1] < sse[0] ? KVXFER_VALUE_GROUPS_TOKEN : KVXFER_VALUE_GROUPS_CHANNEL;
}
}  // namespace

kvxfer_result_t encode_page(const kvxfer_codec_config_t* cfg, const kvxfer_page_id_t* id,
                            const kvxfer_page_layout_t* src, void* anchor, size_t anchor_cap,
                            size_t* anchor_len, void* residual, size_t residual_cap,
                            size_t* residual_len, Impl impl, int threads) {
  KVXFER_CHECK(check_encode_args(cfg, id, src, anchor, anchor_len, residual, residual_len));
  Layout lay;
  KVXFER_CHECK(validate_layout(src, "source", &lay));  // host blocks: non-NULL too
  KVXFER_CHECK(resolve_impl(impl, &impl));
  kvxfer_codec_config_t chosen = *cfg;
  if (cfg->codec == KVXFER_CODEC_LYNX && cfg->alpha == KVXFER_ALPHA_AUTO) {
    KVXFER_CHECK(calibrate_alpha(cfg, src, 1, &chosen.alpha));
    KVXFER_TRACE(LOG_CODEC, "alpha=auto chose %g", static_cast<double>(chosen.alpha));
  }
  const int t = effective_threads(threads);
  KVXFER_REQUIRE(chosen.value_groups != KVXFER_VALUE_GROUPS_TOKEN || id->kind != KVXFER_KV_VALUE ||
                     src->num_tokens <= static_cast<int64_t>(kMaxChannels),
                 "value_groups=token: a V page of %" PRId64
                 " tokens exceeds 2^20, the channel limit of its transpose (docs/FORMAT.md 2.8)",
                 src->num_tokens);
  if (chosen.value_groups == KVXFER_VALUE_GROUPS_AUTO) {
    chosen.value_groups = KVXFER_VALUE_GROUPS_CHANNEL;
    // The transposed page has T channels: at most kMaxChannels (FORMAT.md 2.8).
    if (id->kind == KVXFER_KV_VALUE && src->num_tokens <= static_cast<int64_t>(kMaxChannels))
      chosen.value_groups = choose_value_groups(chosen, *id, *src, lay, impl, t);
    KVXFER_TRACE(LOG_CODEC, "value_groups=auto chose %s",
                 chosen.value_groups == KVXFER_VALUE_GROUPS_TOKEN ? "token" : "channel");
  }
  HostBackend be(lay, static_cast<uint8_t*>(anchor), static_cast<uint8_t*>(residual), impl, t);
  if (chosen.codec != KVXFER_CODEC_BF16) KVXFER_CHECK(be.use(chosen));
  return encode_with(chosen, *id, *src, static_cast<uint8_t*>(anchor), anchor_cap, anchor_len,
                     static_cast<uint8_t*>(residual), residual_cap, residual_len, &be, t);
}

namespace {
/**
 * True if some binary16 {m, d} entry is unusable: m or d NaN/Inf (all-ones
 * exponent) or d negative (sign set, not -0).  Branch-free on the bits, so
 * the compiler vectorises it; the caller then finds the entry to name it.
 */
bool any_bad_fp16_meta(const uint8_t* meta, int64_t entries) {
  if (fast::cpu_has_avx512()) return fast::any_bad_fp16_meta_avx512(meta, entries);
  uint32_t bad = 0;
  for (int64_t i = 0; i < entries; ++i) {
    uint32_t e;
    std::memcpy(&e, meta + 4 * i, 4);
    const uint32_t m = e & 0xFFFFu, d = e >> 16;
    bad |= static_cast<uint32_t>((m & 0x7C00u) == 0x7C00u) | ((d & 0x7C00u) == 0x7C00u) |
           (d > 0x8000u);
  }
  return bad != 0;
}
}  // namespace

kvxfer_result_t plan_decode(const void* anchor, size_t anchor_len, const void* residual,
                            size_t residual_len, const kvxfer_page_id_t* expect,
                            const kvxfer_page_layout_t* dst, DecodePlan* plan) {
  KVXFER_CHECK(plan_decode_any(anchor, anchor_len, residual, residual_len, expect, dst, plan));
  if (plan->anchor.codec == KVXFER_CODEC_SPECTRUM)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "SpectrumKV pages are decoded on the host only (kvxfer_page_decode)");
  return KVXFER_SUCCESS;
}

kvxfer_result_t plan_decode_any(const void* anchor, size_t anchor_len, const void* residual,
                                size_t residual_len, const kvxfer_page_id_t* expect,
                                const kvxfer_page_layout_t* dst, DecodePlan* plan, int threads) {
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
  if (ah.codec == KVXFER_CODEC_SPECTRUM) return plan_spectrum(plan);
  if ((ah.flags & FLAG_RAW) || ah.codec == KVXFER_CODEC_BF16) return KVXFER_SUCCESS;

  // Every metadata entry and table value, before anything is written: a
  // checksum-valid section can still be hostile.
  // Entries [chunk][channel], or with token groups [run of channels][token].
  const bool tg = (ah.flags & FLAG_TOKEN_GROUPS) != 0;
  const PageHeader body = tg ? grouped_body_header(ah) : ah;
  const int64_t across = static_cast<int64_t>(body.num_channels);
  const bool fp32 = (ah.flags & FLAG_META_FP32) != 0;
  int64_t entries =
      static_cast<int64_t>((body.num_tokens + ah.chunk_tokens - 1) / ah.chunk_tokens) * across;
  if (!fp32 && !any_bad_fp16_meta(plan->payload, entries)) entries = 0;  // the common case
  for (int64_t i = 0; i < entries; ++i) {
    const Affine a = get_affine(plan->payload, i, fp32);
    if (!std::isfinite(a.m) || !std::isfinite(a.d) || !(a.d >= 0.0f))
      return set_error(KVXFER_ERR_CORRUPT,
                       "metadata entry %lld (%s %lld, %s %lld) is invalid: offset %g, "
                       "half-range %g",
                       (long long)i, tg ? "channel run" : "chunk", (long long)(i / across),
                       tg ? "token" : "channel", (long long)(i % across), (double)a.m, (double)a.d);
  }
  std::string why;
  plan->cb = get_codebook(static_cast<kvxfer_codec_t>(ah.codec), ah.alpha, ah.anchor_bits, &why);
  if (plan->cb == nullptr)
    return set_error(KVXFER_ERR_INTERNAL, "no codebook for a valid header: %s", why.c_str());
  if (has_anchor_table(*plan->cb)) {
    for (unsigned a = 0; a < (1u << plan->cb->anchor_bits); ++a)
      plan->table[a] = get_f32_le(plan->payload + plan->sizes.table_offset() + 4 * a);
    if (!anchor_table_valid(*plan->cb, plan->table))
      return set_error(KVXFER_ERR_CORRUPT, "anchor table holds a value outside its anchor's bin");
    plan->has_table = true;
  }
  // Sink rows come from finite input (a non-finite page is sent RAW, and the
  // encoder saturates bf16 overflow): a non-finite value is corruption.
  // bf16 and fp16 alike: the exponent field all ones.
  const uint8_t* sinks = plan->payload + plan->sizes.sink_offset();
  const uint16_t emask = sink_dtype(ah) == KVXFER_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
  for (uint64_t i = 0; i < plan->sizes.sink_bytes / 2; ++i) {
    const uint16_t v = static_cast<uint16_t>(sinks[2 * i] | sinks[2 * i + 1] << 8);
    if ((v & emask) == emask)
      return set_error(KVXFER_ERR_CORRUPT, "sink row %llu, channel %llu is not finite (0x%04x)",
                       (unsigned long long)(i / ah.num_channels),
                       (unsigned long long)(i % ah.num_channels), v);
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t decode_page(const void* anchor, size_t anchor_len, const void* residual,
                            size_t residual_len, const kvxfer_page_id_t* expect,
                            const kvxfer_page_layout_t* dst, Impl impl, int threads) {
  DecodePlan plan;
  KVXFER_CHECK(plan_decode_any(anchor, anchor_len, residual, residual_len, expect, dst, &plan,
                               effective_threads(threads)));
  Layout lay;
  KVXFER_CHECK(validate_layout(dst, "destination", &lay));  // host blocks: non-NULL too
  KVXFER_CHECK(resolve_impl(impl, &impl));
  if (plan.anchor.codec == KVXFER_CODEC_SPECTRUM) {
    decode_spectrum(plan, lay, effective_threads(threads));
    return KVXFER_SUCCESS;
  }
  const PageHeader& ah = plan.anchor;
  const int64_t T = dst->num_tokens;
  const int32_t H = dst->num_channels;
  if (plan.cb == nullptr) {  // raw fallback or BF16: values in the anchor payload
    const kvxfer_dtype_t sdt =
        (ah.flags & FLAG_RAW) ? static_cast<kvxfer_dtype_t>(ah.src_dtype) : KVXFER_DTYPE_BF16;
    const size_t ssz = dtype_size(sdt);
    const size_t row_bytes = static_cast<size_t>(H) * ssz;
    // Large pages with non-temporal stores (fast::kStreamStoreBytes).
    const bool stream = impl == Impl::AVX512 && sdt == dst->dtype && row_bytes % 64 == 0 &&
                        static_cast<uint64_t>(T) * row_bytes >= fast::kStreamStoreBytes;
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* srow = plan.payload + static_cast<size_t>(t) * row_bytes;
      uint8_t* row = lay.row(t);
      if (stream && (reinterpret_cast<uintptr_t>(row) & 63) == 0)
        fast::stream_copy_avx512(row, srow, row_bytes);
      else if (sdt == dst->dtype)
        std::memcpy(row, srow, row_bytes);
      else
        for (int32_t c = 0; c < H; ++c) store_elem(row, c, dst->dtype, load_elem(srow, c, sdt));
    }
    if (stream) fast::stream_fence();
    return KVXFER_SUCCESS;
  }
  const bool fp32 = (ah.flags & FLAG_META_FP32) != 0;
  const PayloadSizes& s = plan.sizes;
  const CodebookRef& cb = plan.cb;
  // Token groups: decode the transposed page, then transpose it into place.
  const bool tg = (ah.flags & FLAG_TOKEN_GROUPS) != 0;
  const PageHeader body = tg ? grouped_body_header(ah) : ah;
  TransposedPage tp;
  if (tg) tp.shape(T, H, dst->dtype);
  const DecodeJob job{cb.get(),
                      &body,
                      tg ? tp.layout() : lay,
                      fp32,
                      plan.payload,
                      plan.payload + s.meta_bytes,
                      plan.residual_payload,
                      plan.anchor_values()};
  if (impl == Impl::REFERENCE)
    reference::decode(job);
  else
    fast::decode(job, impl, effective_threads(threads));
  if (tg) tp.store_to(lay, T, H);
  // The sink rows, exact, over their decoded codes (docs/FORMAT.md 2.7).
  const kvxfer_dtype_t kdt = sink_dtype(ah);
  const uint8_t* sinks = plan.payload + s.sink_offset();
  for (int64_t t = 0; t < static_cast<int64_t>(ah.sink_rows); ++t) {
    const uint8_t* srow = sinks + static_cast<size_t>(t) * H * 2;
    uint8_t* row = lay.row(t);
    if (kdt == dst->dtype)
      std::memcpy(row, srow, static_cast<size_t>(H) * 2);
    else
      for (int32_t c = 0; c < H; ++c) store_elem(row, c, dst->dtype, load_elem(srow, c, kdt));
  }
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
