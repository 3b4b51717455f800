// SpectrumKV pages, the PageCodec of codec SPECTRUM (codec/page_codec.h):
// encoder, precision-map reader and decoder (docs/FORMAT.md section 6).
// Plain loops in token order, chunks in parallel (OpenMP) when every token
// starts on a byte boundary of its streams; the quantizers are the INT8 and
// INT4 codebooks (codebook.h), the normalisation and conversions
// codec_math.h.
#include "codec/tiered_format.h"

#include <omp.h>

#include <algorithm>
#include <cinttypes>
#include <vector>

#include "codec/codec.h"
#include "codec/driver.h"
#include "codec/page_codec.h"
#include "common/error.h"
#include "common/log.h"

namespace kvxfer::codec {

namespace {

uint64_t ceil_div8(uint64_t bits) { return (bits + 7) / 8; }

void put_u64_le(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

/** The tier-count preamble of both payloads (docs/FORMAT.md 6.3). */
void put_tier_counts(uint8_t* payload, const PageHeader& h) {
  for (int k = 0; k < 4; ++k) put_u64_le(payload + 8 * k, h.tiers[k]);
}

/** The precision map: 2 bits per token, LSB-first, padding bits zero. */
void put_tier_map(uint8_t* map, const uint8_t* tiers, uint64_t T) {
  std::fill(map, map + tier_map_bytes(T), 0);
  for (uint64_t t = 0; t < T; ++t) map[t >> 2] |= static_cast<uint8_t>(tiers[t] << (2 * (t & 3)));
}

bool is_quantized(unsigned tier) { return tier == KVXFER_TIER_INT8 || tier == KVXFER_TIER_INT4; }

/** True if chunk k (tokens [k*C, min(T, k*C + C))) has an INT8 or INT4 token. */
bool chunk_has_quantized(const uint8_t* map, uint64_t T, uint64_t C, uint64_t k) {
  for (uint64_t t = k * C; t < std::min(T, k * C + C); ++t)
    if (is_quantized(tier_at(map, t))) return true;
  return false;
}

/** Sequential writer of a section 4.2 bit stream (LSB-first): the bytes of put_bits. */
class BitWriter {
 public:
  explicit BitWriter(uint8_t* out) : out_(out) {}
  void put(unsigned v, unsigned w) {
    acc_ |= static_cast<uint64_t>(v) << n_;
    n_ += w;
    while (n_ >= 8) {
      *out_++ = static_cast<uint8_t>(acc_);
      acc_ >>= 8;
      n_ -= 8;
    }
  }
  /** Writes the last partial byte, padding bits zero. */
  void flush() {
    if (n_ > 0) *out_ = static_cast<uint8_t>(acc_);
  }

 private:
  uint8_t* out_;
  uint64_t acc_ = 0;
  unsigned n_ = 0;
};

/** Sequential reader of a section 4.2 bit stream: the fields of get_bits. */
class BitReader {
 public:
  explicit BitReader(const uint8_t* in) : in_(in) {}
  unsigned get(unsigned w) {
    while (n_ < w) {
      acc_ |= static_cast<uint64_t>(*in_++) << n_;
      n_ += 8;
    }
    const unsigned v = static_cast<unsigned>(acc_ & ((1u << w) - 1));
    acc_ >>= w;
    n_ -= w;
    return v;
  }

 private:
  const uint8_t* in_;
  uint64_t acc_ = 0;
  unsigned n_ = 0;
};

const char* kv_name(const kvxfer_page_id_t& id) { return id.kind == KVXFER_KV_KEY ? "K" : "V"; }

/** Tokens of each tier before chunk k (so where chunk k starts in each stream). */
struct ChunkStart {
  uint64_t n16 = 0, n8 = 0, n4 = 0;
};

template <class TierOf>
std::vector<ChunkStart> chunk_starts(int64_t T, int C, TierOf tier_of) {
  std::vector<ChunkStart> out(static_cast<size_t>((T + C - 1) / C) + 1);
  ChunkStart cur;
  for (int64_t t = 0; t < T; ++t) {
    if (t % C == 0) out[static_cast<size_t>(t / C)] = cur;
    const unsigned tier = tier_of(t);
    cur.n16 += tier == KVXFER_TIER_FP16;
    cur.n8 += tier == KVXFER_TIER_INT8;
    cur.n4 += tier == KVXFER_TIER_INT4;
  }
  out.back() = cur;
  return out;
}

/**
 * True when every token's fields start on a byte boundary of its bit stream
 * (INT8 anchors H*A bits, residuals H*(8-A), INT4 codes H*4): chunks then
 * write and read disjoint bytes and may run in parallel.  H % 8 == 0 does it.
 */
bool token_aligned(uint64_t H, unsigned A, unsigned R) {
  return (H * A) % 8 == 0 && (H * R) % 8 == 0 && (H * 4) % 8 == 0;
}

/** OpenMP threads for `chunks` chunks: `threads` (0: one per core), at most one per chunk. */
int chunk_threads(int threads, int64_t chunks) {
  const int64_t t = threads > 0 ? threads : omp_get_max_threads();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(t, chunks)));
}

/**
 * Writes the payloads of a quantized SpectrumKV page (header fields and
 * tiers of `h` set, buffers large enough).  NEED_FP32 when a metadata pair
 * does not fit binary16 and h.flags lacks META_FP32.
 */
EncodeStatus encode_payloads(const PageHeader& h, const Layout& src, const uint8_t* tiers,
                             uint8_t* ap, uint8_t* rp, bool* saturated, int threads) {
  const SpectrumParts p = spectrum_parts(h);
  const int64_t T = static_cast<int64_t>(h.num_tokens);
  const int32_t H = static_cast<int32_t>(h.num_channels);
  const int C = h.chunk_tokens;
  const bool fp32 = (h.flags & FLAG_META_FP32) != 0;
  const unsigned A = h.anchor_bits, R = h.code_bits - h.anchor_bits;
  const auto dt = static_cast<kvxfer_dtype_t>(h.src_dtype);
  // The same quantizers as the INT8 and INT4 codecs (no second definition).
  std::string why;
  const CodebookRef cb8 = get_codebook(KVXFER_CODEC_INT8, 0.0f, static_cast<int>(A), &why);
  const CodebookRef cb4 = get_codebook(KVXFER_CODEC_INT4, 0.0f, 4, &why);

  put_tier_counts(ap, h);
  put_tier_counts(rp, h);
  put_tier_map(ap + p.map, tiers, h.num_tokens);
  const std::vector<ChunkStart> start = chunk_starts(T, C, [&](int64_t t) { return tiers[t]; });

  // Chunk k of the page: its metadata, then its tokens' fields.  Every
  // stream is written in element order, so sequential bit writers give
  // exactly the bytes of put_bits into a zeroed buffer.  Scratch (mn, mx,
  // aff) and the outputs hist / sat are the caller's (one set per thread).
  auto run_chunk = [&](int64_t k, BitWriter& w8a, BitWriter& w8r, BitWriter& w4,
                       std::vector<float>& mn, std::vector<float>& mx, std::vector<Affine>& aff,
                       std::vector<float>& s8, std::vector<float>& s4, uint64_t* hist,
                       bool* sat) -> bool {
    const int64_t t0 = k * C, t1 = std::min<int64_t>(T, t0 + C);
    // Metadata over the chunk's INT8 and INT4 tokens only (docs/FORMAT.md
    // 6.2), with the same comparisons as the other codecs (reference.cc).
    bool have = false;
    for (int64_t t = t0; t < t1; ++t) {
      if (!is_quantized(tiers[t])) continue;
      const uint8_t* row = src.row(t);
      for (int32_t c = 0; c < H; ++c) {
        const float x = load_elem(row, c, dt);
        if (!have) {
          mn[c] = mx[c] = x;
        } else {
          if (x < mn[c]) mn[c] = x;
          if (x > mx[c]) mx[c] = x;
        }
      }
      have = true;
    }
    for (int32_t c = 0; c < H; ++c) {
      Affine a{0.0f, 0.0f};  // canonical pair of a chunk without quantized tokens
      if (have) {
        canonical_minmax(&mn[c], &mx[c]);
        if (!chunk_affine(mn[c], mx[c], fp32, &a)) return false;
      }
      put_affine(ap + p.meta, k * H + c, fp32, a);
      aff[c] = a;  // what the decoder reads back: binary16 pairs are stored exactly
      s8[c] = cb8->scale(a.d);
      s4[c] = cb4->scale(a.d);
    }
    uint64_t i16 = start[static_cast<size_t>(k)].n16;  // index within the FP16 tier
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* row = src.row(t);
      switch (tiers[t]) {
        case KVXFER_TIER_FP16:
          for (int32_t c = 0; c < H; ++c) {
            const uint16_t b = fp16_tier_bits(load_elem(row, c, dt), sat);
            ap[p.fp16_high + i16 * H + c] = static_cast<uint8_t>(b >> 8);
            rp[p.fp16_low + i16 * H + c] = static_cast<uint8_t>(b & 0xFFu);
          }
          ++i16;
          break;
        case KVXFER_TIER_INT8:
          for (int32_t c = 0; c < H; ++c) {
            const uint8_t code = cb8->encode(load_elem(row, c, dt), aff[c].m, s8[c]);
            if (hist_row(t, 0)) ++hist[code];
            w8a.put(code >> R, A);
            w8r.put(code & ((1u << R) - 1), R);
          }
          break;
        case KVXFER_TIER_INT4:
          for (int32_t c = 0; c < H; ++c)
            w4.put(cb4->encode(load_elem(row, c, dt), aff[c].m, s4[c]), 4);
          break;
        default: break;  // DROP: nothing is sent, the row is not read
      }
    }
    return true;
  };

  uint64_t hist[256] = {0};  // full codes of the INT8 tier (its anchor table)
  const int64_t chunks = (T + C - 1) / C;
  bool need_fp32 = false, sat = false;
  if (token_aligned(static_cast<uint64_t>(H), A, R)) {
    // Each chunk starts its writers at its own byte offsets and ends on a
    // byte boundary: disjoint bytes, nothing to flush.  Integer histograms
    // add up in any order, so the bytes equal the one-thread encoder's.
#pragma omp parallel num_threads(chunk_threads(threads, chunks)) reduction(|| : need_fp32, sat)
    {
      uint64_t local[256] = {0};
      std::vector<float> mn(static_cast<size_t>(H)), mx(static_cast<size_t>(H));
      std::vector<Affine> aff(static_cast<size_t>(H));
      std::vector<float> s8(static_cast<size_t>(H)), s4(static_cast<size_t>(H));
#pragma omp for schedule(static)
      for (int64_t k = 0; k < chunks; ++k) {
        const ChunkStart& st = start[static_cast<size_t>(k)];
        const uint64_t e8 = st.n8 * static_cast<uint64_t>(H), e4 = st.n4 * static_cast<uint64_t>(H);
        BitWriter w8a(ap + p.int8_anchor + e8 * A / 8), w8r(rp + p.int8_residual + e8 * R / 8),
            w4(ap + p.int4_codes + e4 / 2);
        if (!need_fp32 && !run_chunk(k, w8a, w8r, w4, mn, mx, aff, s8, s4, local, &sat))
          need_fp32 = true;
      }
#pragma omp critical(kvxfer_spectrum_hist)
      for (int b = 0; b < 256; ++b) hist[b] += local[b];
    }
  } else {
    BitWriter w8a(ap + p.int8_anchor), w8r(rp + p.int8_residual), w4(ap + p.int4_codes);
    std::vector<float> mn(static_cast<size_t>(H)), mx(static_cast<size_t>(H));
    std::vector<Affine> aff(static_cast<size_t>(H));
    std::vector<float> s8(static_cast<size_t>(H)), s4(static_cast<size_t>(H));
    for (int64_t k = 0; k < chunks && !need_fp32; ++k)
      need_fp32 = !run_chunk(k, w8a, w8r, w4, mn, mx, aff, s8, s4, hist, &sat);
    w8a.flush();
    w8r.flush();
    w4.flush();
  }
  if (need_fp32) return EncodeStatus::NEED_FP32;
  *saturated = *saturated || sat;
  float table[64];
  anchor_table_from_histogram(*cb8, hist, table);
  for (unsigned a = 0; a < (1u << A); ++a) put_f32_le(ap + p.table + 4 * a, table[a]);
  return EncodeStatus::OK;
}

}  // namespace

SpectrumParts spectrum_parts(const PageHeader& h) {
  const uint64_t H = h.num_channels;
  const uint64_t n16 = h.tiers[KVXFER_TIER_FP16] * H, n8 = h.tiers[KVXFER_TIER_INT8] * H;
  const uint64_t n4 = h.tiers[KVXFER_TIER_INT4] * H;
  const bool raw = (h.flags & FLAG_RAW) != 0;
  SpectrumParts p;
  p.map = kTierCountBytes;
  p.meta = p.map + tier_map_bytes(h.num_tokens);
  const uint64_t chunks = (h.num_tokens + h.chunk_tokens - 1) / h.chunk_tokens;
  p.fp16_high = p.meta + (raw ? 0 : chunks * H * 2 * ((h.flags & FLAG_META_FP32) ? 4 : 2));
  p.int8_anchor = p.fp16_high + n16;
  p.int4_codes = p.int8_anchor + ceil_div8(n8 * h.anchor_bits);
  p.table = p.int4_codes + ceil_div8(n4 * 4);
  p.fp16_low = kTierCountBytes;
  p.int8_residual = p.fp16_low + n16;
  return p;
}

namespace {

/** SpectrumKV pages as an EncodeBackend (codec/driver.h), on the host. */
class SpectrumBackend final : public EncodeBackend {
 public:
  SpectrumBackend(const kvxfer_page_id_t& id, const Layout& lay, const uint8_t* tiers,
                  uint8_t* anchor, uint8_t* residual, int threads)
      : id_(id), lay_(lay), tiers_(tiers), anc_(anchor), res_(residual), threads_(threads) {}

  void shape_header(PageHeader* h) override {
    for (int64_t t = 0; t < lay_.l->num_tokens; ++t) ++h->tiers[tiers_[t]];
  }

  kvxfer_result_t scan_nonfinite(NonfiniteAt* at) override {
    locate(at);
    return KVXFER_SUCCESS;
  }

  kvxfer_result_t quantize(const PageHeader& h, EncodeStatus* status, NonfiniteAt* at) override {
    // Non-finite input in any token that is sent: the policy of every codec
    // (docs/FORMAT.md 5).  DROP rows are never read.
    if (!scanned_) {
      locate(at);
      scanned_ = true;
    }
    if (at->found) {
      *status = EncodeStatus::NONFINITE;
      return KVXFER_SUCCESS;
    }
    bool saturated = false;
    *status = encode_payloads(h, lay_, tiers_, anc_ + kHeaderBytes, res_ + kHeaderBytes, &saturated,
                              threads_);
    if (*status == EncodeStatus::OK && saturated)
      KVXFER_WARN(LOG_CODEC,
                  "layer %u %s tokens [%" PRId64 ", +%" PRId64
                  "): fp16-tier values beyond +-65504 saturated to +-65504",
                  id_.layer, kv_name(id_), id_.token_begin, lay_.l->num_tokens);
    return KVXFER_SUCCESS;
  }

  // SpectrumKV pages pin their sinks as FP16 tokens: make_header gives them no sink rows.
  kvxfer_result_t pack_sinks(const PageHeader&) override {
    return set_error(KVXFER_ERR_INTERNAL, "a SpectrumKV page has no sink rows");
  }

  // Lossless raw fallback: the map stays, the raw values of every token
  // that is sent follow it, and DROP tokens still decode to 0.
  kvxfer_result_t pack_values(const PageHeader& h, kvxfer_dtype_t) override {
    const SpectrumParts p = spectrum_parts(h);
    uint8_t* ap = anc_ + kHeaderBytes;
    put_tier_counts(ap, h);
    put_tier_counts(res_ + kHeaderBytes, h);
    put_tier_map(ap + p.map, tiers_, h.num_tokens);
    const size_t row_bytes = static_cast<size_t>(h.num_channels) * lay_.elem;
    uint8_t* out = ap + p.fp16_high;
    for (int64_t t = 0; t < lay_.l->num_tokens; ++t) {
      if (tiers_[t] == KVXFER_TIER_DROP) continue;
      std::memcpy(out, lay_.row(t), row_bytes);
      out += row_bytes;
    }
    return KVXFER_SUCCESS;
  }

 private:
  void locate(NonfiniteAt* at) const {
    const int32_t H = lay_.l->num_channels;
    const kvxfer_dtype_t dt = lay_.l->dtype;
    for (int64_t t = 0; t < lay_.l->num_tokens; ++t) {
      if (tiers_[t] == KVXFER_TIER_DROP || !row_has_nonfinite(lay_.row(t), H, dt)) continue;
      for (int32_t c = 0; c < H; ++c) {
        const float x = load_elem(lay_.row(t), c, dt);
        if (std::isfinite(x)) continue;
        *at = NonfiniteAt{true, t, c, std::isnan(x)};
        return;
      }
    }
  }

  kvxfer_page_id_t id_;
  Layout lay_;
  const uint8_t* tiers_;
  uint8_t* anc_;
  uint8_t* res_;
  int threads_;
  bool scanned_ = false;
};

}  // namespace

namespace {

/** Reads the precision map of a parsed anchor section (`payload` after its header). */
kvxfer_result_t read_tiers(const PageHeader& h, const uint8_t* payload, uint8_t* token_tiers,
                           int64_t num_tokens) {
  KVXFER_REQUIRE(h.codec == KVXFER_CODEC_SPECTRUM,
                 "section is codec %u, not a SpectrumKV page (codec 4): it has no precision map",
                 h.codec);
  KVXFER_REQUIRE(h.section == SECTION_ANCHOR,
                 "a residual section carries no precision map: pass the anchor section");
  KVXFER_REQUIRE(num_tokens >= 0, "num_tokens %" PRId64 " is negative", num_tokens);
  if (static_cast<uint64_t>(num_tokens) != h.num_tokens)
    return set_error(KVXFER_ERR_MISMATCH, "page has %llu tokens; the tier array holds %" PRId64,
                     (unsigned long long)h.num_tokens, num_tokens);
  KVXFER_REQUIRE(token_tiers != nullptr || num_tokens == 0, "token_tiers is NULL");
  const uint8_t* map = payload + kTierCountBytes;
  for (uint64_t t = 0; t < h.num_tokens; ++t)
    token_tiers[t] = static_cast<uint8_t>(tier_at(map, t));
  return KVXFER_SUCCESS;
}

}  // namespace

kvxfer_result_t get_page_tiers(const void* anchor, size_t anchor_len, uint8_t* token_tiers,
                               int64_t num_tokens) {
  PageHeader h;
  KVXFER_CHECK(parse_section(anchor, anchor_len, &h));  // checksum, counts and map included
  return read_tiers(h, static_cast<const uint8_t*>(anchor) + kHeaderBytes, token_tiers, num_tokens);
}

kvxfer_result_t plan_page_tiers(const DecodePlan& plan, uint8_t* token_tiers, int64_t num_tokens) {
  return read_tiers(plan.anchor, plan.payload, token_tiers, num_tokens);
}

kvxfer_result_t plan_spectrum(DecodePlan* plan) {
  const PageHeader& h = plan->anchor;
  plan->cb = nullptr;
  plan->has_table = false;
  if (h.flags & FLAG_RAW) return KVXFER_SUCCESS;  // raw values: nothing else to check
  const SpectrumParts p = spectrum_parts(h);
  const uint8_t* map = plan->payload + p.map;
  const bool fp32 = (h.flags & FLAG_META_FP32) != 0;
  const uint64_t H = h.num_channels, C = h.chunk_tokens;
  const uint64_t chunks = (h.num_tokens + C - 1) / C;
  for (uint64_t k = 0; k < chunks; ++k) {
    const bool used = chunk_has_quantized(map, h.num_tokens, C, k);
    for (uint64_t c = 0; c < H; ++c) {
      const Affine a = get_affine(plan->payload + p.meta, static_cast<int64_t>(k * H + c), fp32);
      const bool ok = used ? std::isfinite(a.m) && std::isfinite(a.d) && a.d >= 0.0f
                           : f32_bits(a.m) == 0 && f32_bits(a.d) == 0;
      if (!ok)
        return set_error(KVXFER_ERR_CORRUPT,
                         "metadata entry %llu (chunk %llu, channel %llu) is invalid: offset %g, "
                         "half-range %g%s",
                         (unsigned long long)(k * H + c), (unsigned long long)k,
                         (unsigned long long)c, (double)a.m, (double)a.d,
                         used ? "" : " (a chunk without int8/int4 tokens must carry +0, +0)");
    }
  }
  const uint64_t n16 = h.tiers[KVXFER_TIER_FP16] * H;
  for (uint64_t i = 0; i < n16; ++i)
    if ((plan->payload[p.fp16_high + i] & 0x7Cu) == 0x7Cu)
      return set_error(KVXFER_ERR_CORRUPT,
                       "fp16-tier element %llu has high byte 0x%02x: an infinity or NaN exponent",
                       (unsigned long long)i, plan->payload[p.fp16_high + i]);
  std::string why;
  plan->cb = get_codebook(KVXFER_CODEC_INT8, 0.0f, h.anchor_bits, &why);
  if (plan->cb == nullptr)
    return set_error(KVXFER_ERR_INTERNAL, "no codebook for a valid header: %s", why.c_str());
  for (unsigned a = 0; a < (1u << h.anchor_bits); ++a)
    plan->table[a] = get_f32_le(plan->payload + p.table + 4 * a);
  if (!anchor_table_valid(*plan->cb, plan->table))
    return set_error(KVXFER_ERR_CORRUPT, "anchor table holds a value outside its anchor's bin");
  plan->has_table = true;
  return KVXFER_SUCCESS;
}

void decode_spectrum(const DecodePlan& plan, const Layout& dst, int threads) {
  const PageHeader& h = plan.anchor;
  const SpectrumParts p = spectrum_parts(h);
  const int64_t T = static_cast<int64_t>(h.num_tokens);
  const int32_t H = static_cast<int32_t>(h.num_channels);
  const int C = h.chunk_tokens;
  const auto dt = dst.l->dtype;
  const uint8_t* ap = plan.payload;
  const uint8_t* rp = plan.residual_payload;  // nullptr: anchor only
  const uint8_t* map = ap + p.map;

  if (h.flags & FLAG_RAW) {
    const auto sdt = static_cast<kvxfer_dtype_t>(h.src_dtype);
    const size_t ssz = dtype_size(sdt);
    const uint8_t* in = ap + p.fp16_high;
    for (int64_t t = 0; t < T; ++t) {
      uint8_t* row = dst.row(t);
      if (tier_at(map, t) == KVXFER_TIER_DROP) {
        for (int32_t c = 0; c < H; ++c) store_elem(row, c, dt, 0.0f);
        continue;
      }
      if (sdt == dt)
        std::memcpy(row, in, static_cast<size_t>(H) * ssz);
      else
        for (int32_t c = 0; c < H; ++c) store_elem(row, c, dt, load_elem(in, c, sdt));
      in += static_cast<size_t>(H) * ssz;
    }
    return;
  }

  const bool fp32 = (h.flags & FLAG_META_FP32) != 0;
  const unsigned A = h.anchor_bits, R = h.code_bits - h.anchor_bits;
  const Codebook& cb8 = *plan.cb;
  std::string why;
  const CodebookRef cb4 = get_codebook(KVXFER_CODEC_INT4, 0.0f, 4, &why);
  const std::vector<ChunkStart> start =
      chunk_starts(T, C, [&](int64_t t) { return tier_at(map, t); });

  // Chunk k: its tokens in order, from readers positioned at the chunk's start.
  auto run_chunk = [&](int64_t k, BitReader& r8a, BitReader& r8r, BitReader& r4,
                       std::vector<Affine>& aff) {
    const int64_t t0 = k * C, t1 = std::min<int64_t>(T, t0 + C);
    bool have_aff = false;
    uint64_t i16 = start[static_cast<size_t>(k)].n16;
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* row = dst.row(t);
      const unsigned tier = tier_at(map, t);
      if (is_quantized(tier) && !have_aff) {
        for (int32_t c = 0; c < H; ++c) aff[c] = get_affine(ap + p.meta, k * H + c, fp32);
        have_aff = true;
      }
      switch (tier) {
        case KVXFER_TIER_FP16:
          for (int32_t c = 0; c < H; ++c) {
            const uint8_t hi = ap[p.fp16_high + i16 * H + c];
            const float v =
                rp != nullptr
                    ? f16_to_f32(static_cast<uint16_t>(hi << 8 | rp[p.fp16_low + i16 * H + c]))
                    : fp16_anchor_value(hi);
            store_elem(row, c, dt, v);
          }
          ++i16;
          break;
        case KVXFER_TIER_INT8:
          for (int32_t c = 0; c < H; ++c) {
            const unsigned anchor = r8a.get(A);
            const float r =
                rp != nullptr ? cb8.recon_full[anchor << R | r8r.get(R)] : plan.table[anchor];
            store_elem(row, c, dt, denormalise(r, aff[c]));
          }
          break;
        case KVXFER_TIER_INT4:
          for (int32_t c = 0; c < H; ++c)
            store_elem(row, c, dt, denormalise(cb4->recon_full[r4.get(4)], aff[c]));
          break;
        default:  // DROP
          for (int32_t c = 0; c < H; ++c) store_elem(row, c, dt, 0.0f);
      }
    }
  };

  const int64_t chunks = (T + C - 1) / C;
  const uint8_t* r8r_base = rp != nullptr ? rp + p.int8_residual : nullptr;  // anchor only: unread
  if (token_aligned(static_cast<uint64_t>(H), A, R)) {
    // Chunks read disjoint bytes and write disjoint rows.
#pragma omp parallel num_threads(chunk_threads(threads, chunks))
    {
      std::vector<Affine> aff(static_cast<size_t>(H));
#pragma omp for schedule(static)
      for (int64_t k = 0; k < chunks; ++k) {
        const ChunkStart& st = start[static_cast<size_t>(k)];
        const uint64_t e8 = st.n8 * static_cast<uint64_t>(H), e4 = st.n4 * static_cast<uint64_t>(H);
        BitReader r8a(ap + p.int8_anchor + e8 * A / 8), r4(ap + p.int4_codes + e4 / 2);
        BitReader r8r(r8r_base != nullptr ? r8r_base + e8 * R / 8 : nullptr);
        run_chunk(k, r8a, r8r, r4, aff);
      }
    }
  } else {
    BitReader r8a(ap + p.int8_anchor), r4(ap + p.int4_codes), r8r(r8r_base);
    std::vector<Affine> aff(static_cast<size_t>(H));
    for (int64_t k = 0; k < chunks; ++k) run_chunk(k, r8a, r8r, r4, aff);
  }
}

namespace {

/** SpectrumKV pages (codec SPECTRUM): a precision tier per token. */
class TieredCodec final : public PageCodec {
 public:
  const char* name() const override { return "SPECTRUM"; }
  bool token_tiers() const override { return true; }
  bool on_device() const override { return false; }
  bool has_residual() const override { return true; }
  bool value_groups() const override { return false; }

  kvxfer_result_t check_config(const kvxfer_codec_config_t& cfg) const override {
    // anchor_bits is the INT8 tier's split (docs/FORMAT.md 6.2); alpha is unused.
    KVXFER_REQUIRE(cfg.anchor_bits >= 2 && cfg.anchor_bits <= 6,
                   "codec config: anchor_bits %d must be 2..6 for SPECTRUM (its int8 tier's split)",
                   cfg.anchor_bits);
    return KVXFER_SUCCESS;
  }

  // Every token FP16 is the largest page (docs/FORMAT.md 6.3).
  void widen_max_header(PageHeader* h) const override {
    h->tiers[KVXFER_TIER_FP16] = h->num_tokens;
  }

  kvxfer_result_t encode(const EncodeCall& c) const override {
    const int64_t T = c.src->num_tokens;
    const uint8_t* token_tiers = c.token_tiers;
    KVXFER_REQUIRE(token_tiers != nullptr || T == 0,
                   "token_tiers is NULL for a page of %" PRId64 " tokens", T);
    for (int64_t t = 0; t < T; ++t)
      KVXFER_REQUIRE(token_tiers[t] <= KVXFER_TIER_DROP,
                     "token_tiers[%" PRId64
                     "] = %u is not a kvxfer_tier_t (0 FP16, 1 INT8, 2 INT4, "
                     "3 DROP)",
                     t, token_tiers[t]);
    Layout lay;
    KVXFER_CHECK(validate_layout(c.src, "source", &lay));  // host blocks: non-NULL too

    const int threads = effective_threads(c.threads);
    SpectrumBackend be(*c.id, lay, token_tiers, static_cast<uint8_t*>(c.anchor),
                       static_cast<uint8_t*>(c.residual), threads);
    return encode_with(*c.cfg, *c.id, *c.src, static_cast<uint8_t*>(c.anchor), c.anchor_cap,
                       c.anchor_len, static_cast<uint8_t*>(c.residual), c.residual_cap,
                       c.residual_len, &be, threads);
  }

  kvxfer_result_t plan(DecodePlan* plan) const override { return plan_spectrum(plan); }

  void decode(const DecodePlan& plan, const Layout& dst, Impl, int threads) const override {
    decode_spectrum(plan, dst, threads);
  }
};

}  // namespace

const PageCodec* tiered_codec() {
  static const TieredCodec codec;
  return &codec;
}

}  // namespace kvxfer::codec
