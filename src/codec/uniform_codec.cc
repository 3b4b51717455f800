// The uniform page codecs, LYNX, INT8, INT4 and BF16: every token of a page
// at the codec's precision (docs/FORMAT.md sections 2 to 5).  alpha=auto and
// value_groups=auto, the raw fallback, the BF16 passthrough, the checks of a
// received page and the dispatch to a CPU path (codec/reference.cc,
// codec/fast*.cc).  One PageCodec per codec value (codec/page_codec.h).
#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <string>
#include <vector>

#include "codec/driver.h"
#include "codec/fast.h"
#include "codec/page.h"
#include "codec/page_codec.h"
#include "common/error.h"
#include "common/log.h"

namespace kvxfer::codec {

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

/** Encodes with a config whose alpha and value_groups are resolved (HostBackend). */
kvxfer_result_t encode_resolved(const kvxfer_codec_config_t& chosen, const kvxfer_page_id_t& id,
                                const kvxfer_page_layout_t& src, const Layout& lay, void* anchor,
                                size_t anchor_cap, size_t* anchor_len, void* residual,
                                size_t residual_cap, size_t* residual_len, Impl impl, int t) {
  HostBackend be(lay, static_cast<uint8_t*>(anchor), static_cast<uint8_t*>(residual), impl, t);
  if (chosen.codec != KVXFER_CODEC_BF16) KVXFER_CHECK(be.use(chosen));
  return encode_with(chosen, id, src, static_cast<uint8_t*>(anchor), anchor_cap, anchor_len,
                     static_cast<uint8_t*>(residual), residual_cap, residual_len, &be, t);
}

/**
 * Every metadata entry, table value and sink row of a parsed uniform page
 * (plan_sections done), before anything is written: a checksum-valid section
 * can still be hostile.
 */
kvxfer_result_t plan_uniform(DecodePlan* plan) {
  const PageHeader& ah = plan->anchor;
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

/** Decodes a planned uniform page into `lay` (host memory). */
void decode_uniform(const DecodePlan& plan, const Layout& lay, Impl impl, int threads) {
  const PageHeader& ah = plan.anchor;
  const int64_t T = lay.l->num_tokens;
  const int32_t H = lay.l->num_channels;
  const kvxfer_dtype_t dt = lay.l->dtype;
  if (plan.cb == nullptr) {  // raw fallback or BF16: values in the anchor payload
    const kvxfer_dtype_t sdt =
        (ah.flags & FLAG_RAW) ? static_cast<kvxfer_dtype_t>(ah.src_dtype) : KVXFER_DTYPE_BF16;
    const size_t ssz = dtype_size(sdt);
    const size_t row_bytes = static_cast<size_t>(H) * ssz;
    // Large pages with non-temporal stores (fast::kStreamStoreBytes).
    const bool stream = impl == Impl::AVX512 && sdt == dt && row_bytes % 64 == 0 &&
                        static_cast<uint64_t>(T) * row_bytes >= fast::kStreamStoreBytes;
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* srow = plan.payload + static_cast<size_t>(t) * row_bytes;
      uint8_t* row = lay.row(t);
      if (stream && (reinterpret_cast<uintptr_t>(row) & 63) == 0)
        fast::stream_copy_avx512(row, srow, row_bytes);
      else if (sdt == dt)
        std::memcpy(row, srow, row_bytes);
      else
        for (int32_t c = 0; c < H; ++c) store_elem(row, c, dt, load_elem(srow, c, sdt));
    }
    if (stream) fast::stream_fence();
    return;
  }
  const bool fp32 = (ah.flags & FLAG_META_FP32) != 0;
  const PayloadSizes& s = plan.sizes;
  const CodebookRef& cb = plan.cb;
  // Token groups: decode the transposed page, then transpose it into place.
  const bool tg = (ah.flags & FLAG_TOKEN_GROUPS) != 0;
  const PageHeader body = tg ? grouped_body_header(ah) : ah;
  TransposedPage tp;
  if (tg) tp.shape(T, H, dt);
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
    fast::decode(job, impl, threads);
  if (tg) tp.store_to(lay, T, H);
  // The sink rows, exact, over their decoded codes (docs/FORMAT.md 2.7).
  const kvxfer_dtype_t kdt = sink_dtype(ah);
  const uint8_t* sinks = plan.payload + s.sink_offset();
  for (int64_t t = 0; t < static_cast<int64_t>(ah.sink_rows); ++t) {
    const uint8_t* srow = sinks + static_cast<size_t>(t) * H * 2;
    uint8_t* row = lay.row(t);
    if (kdt == dt)
      std::memcpy(row, srow, static_cast<size_t>(H) * 2);
    else
      for (int32_t c = 0; c < H; ++c) store_elem(row, c, dt, load_elem(srow, c, kdt));
  }
}

/**
 * KVXFER_VALUE_GROUPS_AUTO for one V page (cfg's other fields resolved): the
 * grouping whose anchor-only decode has the smaller sum of squared errors
 * against the source (double), CHANNEL on a tie or when a trial encode
 * fails (the real encode then reports the failure).
 */
kvxfer_value_groups_t choose_value_groups(const PageCodec& codec, const kvxfer_codec_config_t& cfg,
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
    PageHeader widest = max_header(c, T, H);
    codec.widen_max_header(&widest);
    max_section_bytes(c, widest, &acap, &rcap);
    std::vector<uint8_t> a(acap), r(rcap);
    DecodePlan plan;
    Layout out_lay;
    if (encode_resolved(c, id, src, lay, a.data(), acap, &alen, r.data(), rcap, &rlen, impl,
                        threads) < 0 ||
        plan_sections(a.data(), alen, nullptr, 0, &id, &dst, &plan, threads) < 0 ||
        plan_uniform(&plan) < 0 || validate_layout(&dst, "destination", &out_lay) < 0)
      return KVXFER_VALUE_GROUPS_CHANNEL;
    decode_uniform(plan, out_lay, impl, threads);
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

/** One of LYNX, INT8, INT4, BF16. */
class UniformCodec final : public PageCodec {
 public:
  UniformCodec(kvxfer_codec_t codec, const char* name) : codec_(codec), name_(name) {}
  const char* name() const override { return name_; }
  bool token_tiers() const override { return false; }
  bool on_device() const override { return true; }
  bool has_residual() const override {
    return codec_ == KVXFER_CODEC_LYNX || codec_ == KVXFER_CODEC_INT8;
  }
  bool value_groups() const override { return codec_ != KVXFER_CODEC_BF16; }

  kvxfer_result_t check_config(const kvxfer_codec_config_t& cfg) const override {
    if (codec_ == KVXFER_CODEC_BF16) return KVXFER_SUCCESS;
    std::string why;
    const bool autoa = codec_ == KVXFER_CODEC_LYNX && cfg.alpha == KVXFER_ALPHA_AUTO;
    if (get_codebook(codec_, autoa ? 0.0f : cfg.alpha, cfg.anchor_bits, &why) == nullptr)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT, "codec config: %s (alpha %g, anchor_bits %d)",
                       why.c_str(), static_cast<double>(cfg.alpha), cfg.anchor_bits);
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t encode(const EncodeCall& c) const override {
    const kvxfer_codec_config_t* cfg = c.cfg;
    const kvxfer_page_id_t* id = c.id;
    const kvxfer_page_layout_t* src = c.src;
    Impl impl = c.impl;
    Layout lay;
    KVXFER_CHECK(validate_layout(src, "source", &lay));  // host blocks: non-NULL too
    KVXFER_CHECK(resolve_impl(impl, &impl));
    kvxfer_codec_config_t chosen = *cfg;
    if (cfg->codec == KVXFER_CODEC_LYNX && cfg->alpha == KVXFER_ALPHA_AUTO) {
      KVXFER_CHECK(calibrate_alpha(cfg, src, 1, &chosen.alpha));
      KVXFER_TRACE(LOG_CODEC, "alpha=auto chose %g", static_cast<double>(chosen.alpha));
    }
    const int t = effective_threads(c.threads);
    KVXFER_REQUIRE(chosen.value_groups != KVXFER_VALUE_GROUPS_TOKEN ||
                       id->kind != KVXFER_KV_VALUE ||
                       src->num_tokens <= static_cast<int64_t>(kMaxChannels),
                   "value_groups=token: a V page of %" PRId64
                   " tokens exceeds 2^20, the channel limit of its transpose (docs/FORMAT.md 2.8)",
                   src->num_tokens);
    if (chosen.value_groups == KVXFER_VALUE_GROUPS_AUTO) {
      chosen.value_groups = KVXFER_VALUE_GROUPS_CHANNEL;
      // The transposed page has T channels: at most kMaxChannels (FORMAT.md 2.8).
      if (id->kind == KVXFER_KV_VALUE && src->num_tokens <= static_cast<int64_t>(kMaxChannels))
        chosen.value_groups = choose_value_groups(*this, chosen, *id, *src, lay, impl, t);
      KVXFER_TRACE(LOG_CODEC, "value_groups=auto chose %s",
                   chosen.value_groups == KVXFER_VALUE_GROUPS_TOKEN ? "token" : "channel");
    }
    return encode_resolved(chosen, *id, *src, lay, c.anchor, c.anchor_cap, c.anchor_len, c.residual,
                           c.residual_cap, c.residual_len, impl, t);
  }

  kvxfer_result_t plan(DecodePlan* plan) const override { return plan_uniform(plan); }

  void decode(const DecodePlan& plan, const Layout& dst, Impl impl, int threads) const override {
    decode_uniform(plan, dst, impl, threads);
  }

 private:
  kvxfer_codec_t codec_;
  const char* name_;
};

const PageCodec* uniform_codec(kvxfer_codec_t codec) {
  static const UniformCodec lynx(KVXFER_CODEC_LYNX, "LYNX"), int8(KVXFER_CODEC_INT8, "INT8"),
      int4(KVXFER_CODEC_INT4, "INT4"), bf16(KVXFER_CODEC_BF16, "BF16");
  switch (codec) {
    case KVXFER_CODEC_LYNX: return &lynx;
    case KVXFER_CODEC_INT8: return &int8;
    case KVXFER_CODEC_INT4: return &int4;
    case KVXFER_CODEC_BF16: return &bf16;
    default: return nullptr;
  }
}

}  // namespace kvxfer::codec
