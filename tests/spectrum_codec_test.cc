// SpectrumKV pages (codec SPECTRUM, docs/FORMAT.md section 6): per-token
// precision tiers.  Checked here:
//   - all-INT8 / all-INT4 pages carry exactly the INT8 / INT4 codec's codes,
//     metadata and anchor table, and decode to the same bytes;
//   - FP16 tokens restore their binary16 rounding exactly; their anchor-only
//     value is the midpoint of its 256 binary16 values (exhaustive);
//   - every tier stays within its computed bound at both precisions, and the
//     bounds are tight;
//   - the precision map survives the wire; sinks are exact; DROP decodes to 0;
//   - truncated, forged and inconsistent sections are rejected before any
//     write; bad arguments are refused with INVALID_ARGUMENT.
#include <gtest/gtest.h>

#include <cinttypes>
#include <limits>
#include <random>

#include "codec/page_codec.h"
#include "codec/tiered_format.h"
#include "test_util.h"

namespace kvxfer::codec {
namespace {

using test::config;
using test::PagedBuffer;
using Bytes = std::vector<uint8_t>;

const kvxfer_page_id_t kId{3, KVXFER_KV_VALUE, 1000, 42};

kvxfer_codec_config_t spectrum_config(int chunk = 32, int anchor_bits = 4) {
  kvxfer_codec_config_t c = KVXFER_CODEC_CONFIG_INITIALIZER;
  c.codec = KVXFER_CODEC_SPECTRUM;
  c.chunk_tokens = chunk;
  c.anchor_bits = anchor_bits;
  return c;
}

test::Encoded encode_tiered(const kvxfer_codec_config_t& cfg, const PagedBuffer& src,
                            const std::vector<uint8_t>& tiers, kvxfer_page_id_t id = kId,
                            int threads = 0) {
  test::Encoded e;
  size_t amax = 0, rmax = 0;
  e.rc = max_sizes(&cfg, src.layout.num_tokens, src.layout.num_channels, &amax, &rmax);
  if (e.rc != KVXFER_SUCCESS) return e;
  e.anchor.assign(amax, 0xEE);
  e.residual.assign(rmax, 0xEE);
  size_t al = 0, rl = 0;
  e.rc = encode_page_tiered(&cfg, &id, &src.layout, tiers.data(), e.anchor.data(), amax, &al,
                            e.residual.data(), rmax, &rl, threads);
  e.anchor.resize(al);
  e.residual.resize(rl);
  return e;
}

kvxfer_result_t decode(const test::Encoded& e, bool full, PagedBuffer* dst) {
  return decode_page(e.anchor.data(), e.anchor.size(), full ? e.residual.data() : nullptr,
                     full ? e.residual.size() : 0, nullptr, &dst->layout);
}

std::vector<uint8_t> random_tiers(int64_t T, uint64_t seed, bool with_drop = true) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> t(static_cast<size_t>(T));
  for (auto& v : t) v = static_cast<uint8_t>(rng() % (with_drop ? 4 : 3));
  return t;
}

// Units in the last place of binary16 in the binade of the binary16 value `b`.
double ulp16(uint16_t b) {
  const int e = (b >> 10) & 31;
  return std::ldexp(1.0, e == 0 ? -24 : e - 25);
}

// Relative and absolute rounding of an output dtype (docs/FORMAT.md 2.5).
double dst_rounding(kvxfer_dtype_t dt, double xhat) {
  if (dt == KVXFER_DTYPE_BF16) return std::ldexp(1.0, -8) * std::fabs(xhat) + 1e-38;
  if (dt == KVXFER_DTYPE_FP16) return std::ldexp(1.0, -11) * std::fabs(xhat) + std::ldexp(1.0, -25);
  return 0.0;
}

/**
 * Checks every decoded element of a SpectrumKV page against its tier's
 * bound, computed from the source and the stored metadata:
 *   FP16 full:   the binary16 rounding of x, exactly (then the dst rounding);
 *   FP16 anchor: |x - x_hat| <= 128 ulp16 (0.5 for the rounding of x, 127.5
 *                for the midpoint) + dst rounding;
 *   INT8/INT4:   error_bound of the INT8 / INT4 codebook (page.h);
 *   DROP:        +0.
 * Raises *worst_out to the largest error / bound ratio per tier (tightness).
 */
void expect_tier_bounds(const PagedBuffer& src, const PagedBuffer& out,
                        const std::vector<uint8_t>& tiers, const Bytes& anchor, bool full,
                        const std::string& what, std::array<double, 4>* worst_out = nullptr) {
  std::array<double, 4> local{0, 0, 0, 0};
  std::array<double, 4>& worst = worst_out != nullptr ? *worst_out : local;
  PageHeader h;
  EXPECT_EQ(parse_section(anchor.data(), anchor.size(), &h), KVXFER_SUCCESS) << last_error();
  const SpectrumParts p = spectrum_parts(h);
  const bool fp32 = h.flags & FLAG_META_FP32;
  const CodebookRef cb8 = get_codebook(KVXFER_CODEC_INT8, 0.0f, h.anchor_bits, nullptr);
  const CodebookRef cb4 = get_codebook(KVXFER_CODEC_INT4, 0.0f, 4, nullptr);
  const int32_t H = src.layout.num_channels;
  const kvxfer_dtype_t dt = out.layout.dtype;
  for (int64_t t = 0; t < src.layout.num_tokens; ++t)
    for (int32_t c = 0; c < H; ++c) {
      const double x = src.get(t, c), xh = out.get(t, c);
      auto where = [&] {
        return what + ": token " + std::to_string(t) + " channel " + std::to_string(c) + " tier " +
               std::to_string(tiers[t]) + " x=" + std::to_string(x) +
               " x_hat=" + std::to_string(xh);
      };
      const unsigned tier = tiers[t];
      if (tier == KVXFER_TIER_DROP) {
        uint8_t zero[4] = {0, 0, 0, 0}, got[4];
        std::memcpy(got, out.lay().row(t) + c * out.lay().elem, out.lay().elem);
        ASSERT_EQ(std::memcmp(got, zero, out.lay().elem), 0) << where() << ": DROP is not +0";
        continue;
      }
      if (tier == KVXFER_TIER_FP16) {
        bool sat = false;
        const uint16_t b = fp16_tier_bits(static_cast<float>(x), &sat);
        const double x16 = f16_to_f32(b);
        if (full) {
          // Exact: the binary16 rounding, then only the destination's rounding.
          uint8_t want[4], got[4];
          store_elem(want, 0, dt, static_cast<float>(x16));
          std::memcpy(got, out.lay().row(t) + c * out.lay().elem, out.lay().elem);
          ASSERT_EQ(std::memcmp(got, want, out.lay().elem), 0) << where();
        } else {
          const double bound = 128.0 * ulp16(b) + dst_rounding(dt, xh);
          const double err = sat ? std::fabs(x16 - xh) : std::fabs(x - xh);
          ASSERT_LE(err, bound) << where();
          worst[tier] = std::max(worst[tier], err / bound);
        }
        continue;
      }
      const Affine a =
          get_affine(anchor.data() + kHeaderBytes + p.meta, (t / h.chunk_tokens) * H + c, fp32);
      const Codebook& cb = tier == KVXFER_TIER_INT8 ? *cb8 : *cb4;
      const double bound = error_bound(cb, full, a, dt, xh);
      ASSERT_LE(std::fabs(x - xh), bound) << where() << " m=" << a.m << " d=" << a.d;
      if (a.d > 0) worst[tier] = std::max(worst[tier], std::fabs(x - xh) / bound);
    }
}

// ---------------------------------------------------------------------------
// Same codes as the INT8 / INT4 codecs
// ---------------------------------------------------------------------------

// An all-INT8 SpectrumKV page holds the INT8 codec's page, part for part:
// metadata, anchors, anchor table and residuals are byte-identical, and both
// decode to identical bytes at both precisions.
TEST(SpectrumCodec, AllInt8IsTheInt8Codec) {
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32})
    for (int C : {16, 32, 64, 128})
      for (int A : {2, 3, 4, 5, 6})
        for (auto [T, H] : {std::pair<int64_t, int32_t>{77, 24}, {200, 7}, {5, 33}}) {
          SCOPED_TRACE("dtype " + std::to_string(dt) + " C " + std::to_string(C) + " A " +
                       std::to_string(A) + " T " + std::to_string(T) + " H " + std::to_string(H));
          PagedBuffer src(T, H, dt, 16);
          test::fill_kv_like(&src, 100 + C + A + T, 3.0f);
          const auto ref =
              test::encode(config(KVXFER_CODEC_INT8, 0.0f, C, A), src, Impl::REFERENCE);
          ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
          const std::vector<uint8_t> tiers(T, KVXFER_TIER_INT8);
          const auto sp = encode_tiered(spectrum_config(C, A), src, tiers);
          ASSERT_EQ(sp.rc, KVXFER_SUCCESS) << last_error();
          PageHeader rh, sh;
          ASSERT_EQ(parse_section(ref.anchor.data(), ref.anchor.size(), &rh), KVXFER_SUCCESS);
          ASSERT_EQ(parse_section(sp.anchor.data(), sp.anchor.size(), &sh), KVXFER_SUCCESS);
          EXPECT_EQ(rh.flags, sh.flags);
          const PayloadSizes rs = payload_sizes(rh);
          const SpectrumParts p = spectrum_parts(sh);
          const uint8_t* ra = ref.anchor.data() + kHeaderBytes;
          const uint8_t* sa = sp.anchor.data() + kHeaderBytes;
          const Bytes ref_meta(ra, ra + rs.meta_bytes), sp_meta(sa + p.meta, sa + p.fp16_high);
          ASSERT_EQ(ref_meta, sp_meta) << "metadata differs";
          const Bytes ref_codes(ra + rs.meta_bytes, ra + rs.table_offset());
          const Bytes sp_codes(sa + p.int8_anchor, sa + p.int4_codes);
          ASSERT_EQ(ref_codes, sp_codes) << "anchors differ";
          const Bytes ref_table(ra + rs.table_offset(), ra + rs.anchor_payload());
          const Bytes sp_table(sa + p.table, sa + p.table + (4u << A));
          ASSERT_EQ(ref_table, sp_table) << "anchor table differs";
          const Bytes ref_res(ref.residual.begin() + kHeaderBytes, ref.residual.end());
          const Bytes sp_res(sp.residual.begin() + kHeaderBytes + p.int8_residual,
                             sp.residual.end());
          ASSERT_EQ(ref_res, sp_res) << "residuals differ";
          for (bool full : {false, true}) {
            PagedBuffer a(T, H, KVXFER_DTYPE_FP32, 8), b(T, H, KVXFER_DTYPE_FP32, 8);
            ASSERT_EQ(decode(ref, full, &a), KVXFER_SUCCESS) << last_error();
            ASSERT_EQ(decode(sp, full, &b), KVXFER_SUCCESS) << last_error();
            const long d = test::first_diff(a.bytes(), b.bytes());
            ASSERT_EQ(d, -1) << (full ? "full" : "anchor") << " decode differs at "
                             << test::hex(b.bytes(), d);
          }
        }
}

TEST(SpectrumCodec, AllInt4IsTheInt4Codec) {
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32})
    for (int C : {16, 32, 64, 128})
      for (auto [T, H] : {std::pair<int64_t, int32_t>{77, 24}, {130, 5}, {3, 64}}) {
        SCOPED_TRACE("dtype " + std::to_string(dt) + " C " + std::to_string(C) + " T " +
                     std::to_string(T) + " H " + std::to_string(H));
        PagedBuffer src(T, H, dt, 16);
        test::fill_kv_like(&src, 7 + C + T, 2.0f);
        const auto ref = test::encode(config(KVXFER_CODEC_INT4, 0.0f, C, 4), src, Impl::REFERENCE);
        ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
        const auto sp =
            encode_tiered(spectrum_config(C, 4), src, std::vector<uint8_t>(T, KVXFER_TIER_INT4));
        ASSERT_EQ(sp.rc, KVXFER_SUCCESS) << last_error();
        PageHeader rh, sh;
        ASSERT_EQ(parse_section(ref.anchor.data(), ref.anchor.size(), &rh), KVXFER_SUCCESS);
        ASSERT_EQ(parse_section(sp.anchor.data(), sp.anchor.size(), &sh), KVXFER_SUCCESS);
        const PayloadSizes rs = payload_sizes(rh);
        const SpectrumParts p = spectrum_parts(sh);
        const uint8_t* ra = ref.anchor.data() + kHeaderBytes;
        const uint8_t* sa = sp.anchor.data() + kHeaderBytes;
        ASSERT_EQ(Bytes(ra, ra + rs.meta_bytes), Bytes(sa + p.meta, sa + p.fp16_high));
        ASSERT_EQ(Bytes(ra + rs.meta_bytes, ra + rs.anchor_payload()),
                  Bytes(sa + p.int4_codes, sa + p.table))
            << "codes differ";
        // Nothing of an INT4 token is in the residual: only the tier counts.
        EXPECT_EQ(sp.residual.size(), kHeaderBytes + kTierCountBytes);
        for (bool full : {false, true}) {
          PagedBuffer a(T, H, dt, 5), b(T, H, dt, 5);
          ASSERT_EQ(decode(ref, full, &a), KVXFER_SUCCESS) << last_error();
          ASSERT_EQ(decode(sp, full, &b), KVXFER_SUCCESS) << last_error();
          ASSERT_EQ(test::first_diff(a.bytes(), b.bytes()), -1);
        }
      }
}

// ---------------------------------------------------------------------------
// FP16 tier
// ---------------------------------------------------------------------------

// The anchor value of every high byte with a finite exponent is the mean of
// its 256 binary16 values (they are evenly spaced), computed here by brute
// force in double, and it lies inside their range.
TEST(SpectrumCodec, Fp16AnchorValueIsTheMidpointOfItsHighByte) {
  for (unsigned hi = 0; hi < 256; ++hi) {
    if ((hi & 0x7C) == 0x7C) continue;  // exponent 31: rejected by the decoder
    double sum = 0, lo = INFINITY, up = -INFINITY;
    for (unsigned lo8 = 0; lo8 < 256; ++lo8) {
      const double v = f16_to_f32(static_cast<uint16_t>(hi << 8 | lo8));
      sum += v;
      lo = std::min(lo, v);
      up = std::max(up, v);
    }
    const float got = fp16_anchor_value(static_cast<uint8_t>(hi));
    EXPECT_EQ(static_cast<double>(got), sum / 256) << "high byte 0x" << std::hex << hi;
    EXPECT_EQ(static_cast<double>(got), (lo + up) / 2) << "high byte 0x" << std::hex << hi;
    EXPECT_LE(std::fabs(got - lo), 127.5 * ulp16(static_cast<uint16_t>(hi << 8)));
  }
}

// fp16 input through the FP16 tier comes back bit for bit (it is already
// binary16), at full precision, into an fp16 destination.
TEST(SpectrumCodec, Fp16TierIsLosslessForFp16Input) {
  PagedBuffer src(96, 40, KVXFER_DTYPE_FP16, 16);
  test::fill_kv_like(&src, 5, 10.0f);
  // Every finite binary16 magnitude class: subnormals, zeros of both signs, extremes.
  src.set(0, 0, -0.0f);
  src.set(0, 1, f16_to_f32(0x0001));
  src.set(0, 2, f16_to_f32(0x83FF));
  src.set(0, 3, 65504.0f);
  src.set(0, 4, -65504.0f);
  const auto e = encode_tiered(spectrum_config(), src, std::vector<uint8_t>(96, KVXFER_TIER_FP16));
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  PagedBuffer out(96, 40, KVXFER_DTYPE_FP16, 7, 0, 3);
  ASSERT_EQ(decode(e, true, &out), KVXFER_SUCCESS) << last_error();
  const long d = test::first_diff(src.bytes(), out.bytes());
  EXPECT_EQ(d, -1) << test::hex(out.bytes(), d);
}

// Values beyond binary16's range saturate to +-65504 (never infinity); values
// that round to 65504 are ordinary.  The page still decodes finite at both
// precisions.
TEST(SpectrumCodec, Fp16TierSaturatesBeyond65504) {
  PagedBuffer src(2, 6, KVXFER_DTYPE_FP32, 16);
  const float xs[6] = {1e5f, -7e4f, 65519.0f, 65520.0f, 3.0e38f, -65504.0f};
  const float want[6] = {65504.0f, -65504.0f, 65504.0f, 65504.0f, 65504.0f, -65504.0f};
  for (int c = 0; c < 6; ++c) {
    src.set(0, c, xs[c]);
    src.set(1, c, 1.0f);
  }
  const auto e = encode_tiered(spectrum_config(), src, {KVXFER_TIER_FP16, KVXFER_TIER_INT8});
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  PagedBuffer full(2, 6, KVXFER_DTYPE_FP32), anc(2, 6, KVXFER_DTYPE_FP32);
  ASSERT_EQ(decode(e, true, &full), KVXFER_SUCCESS) << last_error();
  ASSERT_EQ(decode(e, false, &anc), KVXFER_SUCCESS) << last_error();
  for (int c = 0; c < 6; ++c) {
    EXPECT_EQ(full.get(0, c), want[c]) << "channel " << c;
    EXPECT_TRUE(std::isfinite(anc.get(0, c)));
    EXPECT_LE(std::fabs(anc.get(0, c) - want[c]), 128.0 * 32.0) << "channel " << c;
  }
}

// ---------------------------------------------------------------------------
// Mixed tiers: bounds at both precisions, the map, sinks, DROP
// ---------------------------------------------------------------------------

struct Case {
  int64_t T;
  int32_t H;
  int C, A;
  kvxfer_dtype_t src, dst;
  int32_t src_block, dst_block;
};

// Random tiers over shapes, chunk sizes, splits, input and output dtypes and
// block geometries: every element within its tier's bound at both
// precisions, the map read back, and the same values in two destination
// geometries.  The bounds are tight on the larger pages.
TEST(SpectrumCodec, RandomTiersRoundTrip) {
  std::vector<Case> cases;
  const kvxfer_dtype_t dts[] = {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32};
  int k = 0;
  for (int64_t T : {0, 1, 17, 100, 300})
    for (int32_t H : {1, 6, 64})
      for (int C : {16, 32, 64, 128}) {
        ++k;
        cases.push_back({T, H, C, 2 + k % 5, dts[k % 3], dts[(k / 3) % 3], 16, 1 + k % 7});
      }
  std::array<double, 4> worst_full{0, 0, 0, 0}, worst_anchor{0, 0, 0, 0};
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE("case " + std::to_string(i) + ": T " + std::to_string(c.T) + " H " +
                 std::to_string(c.H) + " C " + std::to_string(c.C) + " A " + std::to_string(c.A) +
                 " src " + std::to_string(c.src) + " dst " + std::to_string(c.dst));
    PagedBuffer src(c.T, c.H, c.src, c.src_block);
    test::fill_kv_like(&src, 1000 + i, 1.5f);
    const auto tiers = random_tiers(c.T, 77 + i);
    const auto e = encode_tiered(spectrum_config(c.C, c.A), src, tiers);
    ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
    std::vector<uint8_t> back(c.T + 1, 0xCC);
    ASSERT_EQ(get_page_tiers(e.anchor.data(), e.anchor.size(), back.data(), c.T), KVXFER_SUCCESS)
        << last_error();
    EXPECT_EQ(std::vector<uint8_t>(back.begin(), back.begin() + c.T), tiers);
    EXPECT_EQ(back[c.T], 0xCC) << "wrote past num_tokens";
    for (bool full : {false, true}) {
      PagedBuffer out(c.T, c.H, c.dst, c.dst_block, 2, 1);
      PagedBuffer flat(c.T, c.H, c.dst, 1024, 0, 0);
      ASSERT_EQ(decode(e, full, &out), KVXFER_SUCCESS) << last_error();
      ASSERT_EQ(decode(e, full, &flat), KVXFER_SUCCESS) << last_error();
      ASSERT_EQ(test::first_diff(out.bytes(), flat.bytes()), -1) << "geometry changed the values";
      expect_tier_bounds(src, out, tiers, e.anchor, full, full ? "full" : "anchor-only",
                         full ? &worst_full : &worst_anchor);
    }
  }
  // Tight: the bounds are not vacuous (fp16 full is exact, so it has no ratio).
  EXPECT_GT(worst_anchor[KVXFER_TIER_FP16], 0.5);
  EXPECT_GT(worst_anchor[KVXFER_TIER_INT8], 0.5);
  EXPECT_GT(worst_anchor[KVXFER_TIER_INT4], 0.5);
  EXPECT_GT(worst_full[KVXFER_TIER_INT8], 0.5);
  EXPECT_GT(worst_full[KVXFER_TIER_INT4], 0.5);
}

// Chunks run in parallel when every token starts on a byte boundary of its
// streams (H * A, H * (8 - A), H * 4 multiples of 8); otherwise one thread.
// Either way the sections and the decoded values are the same bytes for any
// thread count, including chunks that need fp32 metadata.
TEST(SpectrumCodec, ThreadCountsGiveIdenticalBytes) {
  struct Case {
    int64_t T;
    int32_t H;
    int C, A;
  } cases[] = {{300, 64, 16, 4}, {1000, 128, 32, 2}, {257, 8, 64, 6},
               {130, 6, 16, 4},  {500, 1, 32, 3},    {64, 1024, 16, 5}};
  for (const Case& c : cases) {
    SCOPED_TRACE("T " + std::to_string(c.T) + " H " + std::to_string(c.H) + " C " +
                 std::to_string(c.C) + " A " + std::to_string(c.A));
    PagedBuffer src(c.T, c.H, KVXFER_DTYPE_BF16);
    test::fill_kv_like(&src, 9 + c.T, 1.5f);
    const auto tiers = random_tiers(c.T, 5 + c.H);
    if (c.T > 200) {  // one chunk needs fp32 metadata (an INT8/INT4 outlier): all of them get it
      int64_t t = 150;
      while (tiers[t] != KVXFER_TIER_INT8 && tiers[t] != KVXFER_TIER_INT4) ++t;
      src.set(t, 0, 3e38f);
    }
    const auto one = encode_tiered(spectrum_config(c.C, c.A), src, tiers, kId, 1);
    ASSERT_EQ(one.rc, KVXFER_SUCCESS) << last_error();
    PageHeader h;
    ASSERT_EQ(parse_section(one.anchor.data(), one.anchor.size(), &h), KVXFER_SUCCESS);
    EXPECT_EQ((h.flags & FLAG_META_FP32) != 0, c.T > 200);
    for (int threads : {2, 3, 8}) {
      const auto many = encode_tiered(spectrum_config(c.C, c.A), src, tiers, kId, threads);
      ASSERT_EQ(many.rc, KVXFER_SUCCESS) << last_error();
      ASSERT_EQ(test::first_diff(one.anchor, many.anchor), -1) << threads << " threads, anchor";
      ASSERT_EQ(test::first_diff(one.residual, many.residual), -1) << threads << " threads";
      for (bool full : {false, true}) {
        PagedBuffer a(c.T, c.H, KVXFER_DTYPE_FP32), b(c.T, c.H, KVXFER_DTYPE_FP32);
        const uint8_t* res = full ? one.residual.data() : nullptr;
        const size_t rlen = full ? one.residual.size() : 0;
        ASSERT_EQ(decode_page(one.anchor.data(), one.anchor.size(), res, rlen, nullptr, &a.layout,
                              Impl::AUTO, 1),
                  KVXFER_SUCCESS)
            << last_error();
        ASSERT_EQ(decode_page(one.anchor.data(), one.anchor.size(), res, rlen, nullptr, &b.layout,
                              Impl::AUTO, threads),
                  KVXFER_SUCCESS)
            << last_error();
        ASSERT_EQ(test::first_diff(a.bytes(), b.bytes()), -1) << threads << " threads, " << full;
      }
    }
  }
}

// Attention sinks: the first s tokens are FP16 and hold large outliers.  They
// come back exactly (binary16 rounding) after the full transfer, and they do
// not widen the INT8/INT4 tokens' metadata: chunk 0's half-range is that of
// the quantized tokens alone.
TEST(SpectrumCodec, SinkTokensAreExactAndDoNotWidenTheRange) {
  const int64_t T = 64;
  const int32_t H = 16;
  const int s = 4;
  PagedBuffer src(T, H, KVXFER_DTYPE_BF16, 16);
  test::fill_kv_like(&src, 9, 0.05f);
  std::vector<uint8_t> tiers(T);
  for (int64_t t = 0; t < T; ++t)
    tiers[t] = t < s ? KVXFER_TIER_FP16 : (t % 3 == 0 ? KVXFER_TIER_INT4 : KVXFER_TIER_INT8);
  for (int t = 0; t < s; ++t)
    for (int32_t c = 0; c < H; ++c) src.set(t, c, (c % 2 ? 1.0f : -1.0f) * (900.0f + 13.0f * t));
  const auto e = encode_tiered(spectrum_config(32, 4), src, tiers);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  PagedBuffer out(T, H, KVXFER_DTYPE_FP32, 16);
  ASSERT_EQ(decode(e, true, &out), KVXFER_SUCCESS) << last_error();
  for (int t = 0; t < s; ++t)
    for (int32_t c = 0; c < H; ++c) {
      bool sat = false;
      ASSERT_EQ(out.get(t, c), f16_to_f32(fp16_tier_bits(src.get(t, c), &sat)))
          << "sink token " << t << " channel " << c;
    }
  PageHeader h;
  ASSERT_EQ(parse_section(e.anchor.data(), e.anchor.size(), &h), KVXFER_SUCCESS);
  const SpectrumParts p = spectrum_parts(h);
  for (int32_t c = 0; c < H; ++c) {
    float mn = INFINITY, mx = -INFINITY;
    for (int64_t t = s; t < 32; ++t) {
      mn = std::min(mn, src.get(t, c));
      mx = std::max(mx, src.get(t, c));
    }
    const Affine a = get_affine(e.anchor.data() + kHeaderBytes + p.meta, c, false);
    // d is the quantized tokens' half range, rounded up to binary16 after rounding m.
    EXPECT_LE(a.d, (mx - mn) / 2 * 1.01f + 1e-3f) << "channel " << c;
    EXPECT_LT(a.d, 100.0f) << "the sinks widened channel " << c;  // with them: ~470
  }
  expect_tier_bounds(src, out, tiers, e.anchor, true, "sinks");
}

// DROP tokens decode to +0 at both precisions, their rows are never read (a
// NaN there is not an error), and nothing of them is on the wire.
TEST(SpectrumCodec, DropTokensDecodeToZeroAndAreNotRead) {
  const int64_t T = 40;
  const int32_t H = 8;
  PagedBuffer src(T, H, KVXFER_DTYPE_FP32, 16);
  test::fill_kv_like(&src, 3);
  std::vector<uint8_t> tiers(T, KVXFER_TIER_INT8);
  for (int64_t t = 10; t < 34; ++t) tiers[t] = KVXFER_TIER_DROP;
  for (int32_t c = 0; c < H; ++c) src.set(12, c, std::numeric_limits<float>::quiet_NaN());
  const auto e = encode_tiered(spectrum_config(16, 4), src, tiers);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  // Only the 16 INT8 tokens are on the wire (4 + 4 bits each).
  PageHeader h;
  ASSERT_EQ(parse_section(e.anchor.data(), e.anchor.size(), &h), KVXFER_SUCCESS);
  EXPECT_EQ(h.tiers[KVXFER_TIER_DROP], 24u);
  EXPECT_EQ(e.residual.size(), kHeaderBytes + kTierCountBytes + 16 * H * 4 / 8);
  EXPECT_EQ(e.anchor.size(),
            kHeaderBytes + kTierCountBytes + 10 + 3 * H * 4 + 16 * H * 4 / 8 + 4 * 16);
  // Chunk 1 (tokens 16..31) has no quantized token: canonical {+0, +0}.
  const SpectrumParts p = spectrum_parts(h);
  for (int32_t c = 0; c < H; ++c) {
    const Affine a = get_affine(e.anchor.data() + kHeaderBytes + p.meta, H + c, false);
    EXPECT_EQ(f32_bits(a.m), 0u);
    EXPECT_EQ(f32_bits(a.d), 0u);
  }
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32})
    for (bool full : {false, true}) {
      PagedBuffer out(T, H, dt, 16);  // filled with 0xA5
      ASSERT_EQ(decode(e, full, &out), KVXFER_SUCCESS) << last_error();
      for (int64_t t = 0; t < T; ++t) {
        if (tiers[t] == KVXFER_TIER_DROP) {
          for (int32_t c = 0; c < H; ++c)
            ASSERT_EQ(f32_bits(out.get(t, c)), 0u) << "token " << t << " channel " << c;
        }
      }
    }
}

// The anchor section alone is the usable approximation of every tier (the
// progressive guarantee), and a residual is needed only for FP16 and INT8.
TEST(SpectrumCodec, AnchorAloneApproximatesEveryTier) {
  const int64_t T = 128;
  const int32_t H = 32;
  PagedBuffer src(T, H, KVXFER_DTYPE_FP32, 16);
  test::fill_kv_like(&src, 21);
  const auto tiers = random_tiers(T, 5, false);
  const auto e = encode_tiered(spectrum_config(32, 3), src, tiers);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  PagedBuffer anc(T, H, KVXFER_DTYPE_FP32), full(T, H, KVXFER_DTYPE_FP32);
  ASSERT_EQ(decode(e, false, &anc), KVXFER_SUCCESS) << last_error();
  ASSERT_EQ(decode(e, true, &full), KVXFER_SUCCESS) << last_error();
  expect_tier_bounds(src, anc, tiers, e.anchor, false, "anchor");
  // INT4 tokens are complete in the anchor: both decodes agree on them.
  for (int64_t t = 0; t < T; ++t) {
    if (tiers[t] != KVXFER_TIER_INT4) continue;
    for (int32_t c = 0; c < H; ++c) ASSERT_EQ(anc.get(t, c), full.get(t, c));
  }
  // Anchor bytes per element: 8 (FP16), 3 (INT8), 4 (INT4) bits plus fixed parts.
  uint64_t n[4] = {0, 0, 0, 0};
  for (uint8_t t : tiers) ++n[t];
  const uint64_t codes = n[0] * H + (n[1] * H * 3 + 7) / 8 + (n[2] * H * 4 + 7) / 8;
  EXPECT_EQ(e.anchor.size(), kHeaderBytes + kTierCountBytes + (T * 2 + 7) / 8 +
                                 4 * H * 4 /* 4 chunks x H x fp16 pairs */ + codes + 4 * 8);
}

// ---------------------------------------------------------------------------
// Non-finite input and large ranges
// ---------------------------------------------------------------------------

TEST(SpectrumCodec, NonFiniteFollowsThePolicy) {
  const int64_t T = 20;
  const int32_t H = 6;
  PagedBuffer src(T, H, KVXFER_DTYPE_BF16, 16);
  test::fill_kv_like(&src, 4);
  src.set(7, 2, -std::numeric_limits<float>::infinity());
  auto tiers = random_tiers(T, 8, false);
  tiers[7] = KVXFER_TIER_FP16;
  tiers[3] = KVXFER_TIER_DROP;
  auto cfg = spectrum_config(16, 4);
  auto e = encode_tiered(cfg, src, tiers);
  EXPECT_EQ(e.rc, KVXFER_ERR_NONFINITE);
  EXPECT_STREQ(last_error(), "Inf at layer 3 V, token 1007, channel 2");
  EXPECT_TRUE(e.anchor.empty() && e.residual.empty());

  cfg.nonfinite = KVXFER_NONFINITE_RAW;
  e = encode_tiered(cfg, src, tiers);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  kvxfer_page_info_t info;
  ASSERT_EQ(inspect_section(e.anchor.data(), e.anchor.size(), &info), KVXFER_SUCCESS);
  EXPECT_EQ(info.raw_fallback, 1);
  EXPECT_EQ(info.codec, KVXFER_CODEC_SPECTRUM);
  std::vector<uint8_t> back(T);
  ASSERT_EQ(get_page_tiers(e.anchor.data(), e.anchor.size(), back.data(), T), KVXFER_SUCCESS);
  EXPECT_EQ(back, tiers);
  // Lossless (anchor alone), DROP still 0.
  PagedBuffer out(T, H, KVXFER_DTYPE_BF16, 3);
  ASSERT_EQ(decode(e, false, &out), KVXFER_SUCCESS) << last_error();
  for (int64_t t = 0; t < T; ++t)
    for (int32_t c = 0; c < H; ++c) {
      const float want = tiers[t] == KVXFER_TIER_DROP ? 0.0f : src.get(t, c);
      ASSERT_EQ(f32_bits(out.get(t, c)), f32_bits(want)) << "token " << t << " channel " << c;
    }
  PagedBuffer out2(T, H, KVXFER_DTYPE_BF16, 3);
  ASSERT_EQ(decode(e, true, &out2), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(out.bytes(), out2.bytes());
}

// A quantized range beyond binary16 switches the page to fp32 metadata, as
// for the other codecs; FP16 tokens beside it are unaffected.
TEST(SpectrumCodec, HugeQuantizedRangeUsesFp32Metadata) {
  const int64_t T = 40;
  const int32_t H = 5;
  PagedBuffer src(T, H, KVXFER_DTYPE_FP32, 16);
  test::fill_kv_like(&src, 6, 1e4f);
  src.set(20, 1, 3e6f);
  auto tiers = random_tiers(T, 2, false);
  tiers[20] = KVXFER_TIER_INT8;
  const auto e = encode_tiered(spectrum_config(16, 4), src, tiers);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  kvxfer_page_info_t info;
  ASSERT_EQ(inspect_section(e.anchor.data(), e.anchor.size(), &info), KVXFER_SUCCESS);
  EXPECT_EQ(info.meta_fp32, 1);
  for (bool full : {false, true}) {
    PagedBuffer out(T, H, KVXFER_DTYPE_FP32, 16);
    ASSERT_EQ(decode(e, full, &out), KVXFER_SUCCESS) << last_error();
    expect_tier_bounds(src, out, tiers, e.anchor, full, full ? "full" : "anchor");
  }
}

// ---------------------------------------------------------------------------
// Sizes
// ---------------------------------------------------------------------------

// kvxfer_page_max_size for SPECTRUM is the all-FP16 page with fp32
// metadata: no tier mix exceeds it, and an all-FP16 page with fp32 metadata
// reaches it exactly.
TEST(SpectrumCodec, MaxSizeIsTheAllFp16Page) {
  for (int A : {2, 6})
    for (auto [T, H] : {std::pair<int64_t, int32_t>{33, 7}, {64, 16}, {1, 1}}) {
      const auto cfg = spectrum_config(16, A);
      size_t amax = 0, rmax = 0;
      ASSERT_EQ(max_sizes(&cfg, T, H, &amax, &rmax), KVXFER_SUCCESS);
      PagedBuffer src(T, H, KVXFER_DTYPE_FP32, 16);
      test::fill_kv_like(&src, 1, 1e5f);  // beyond binary16: fp32 metadata
      for (uint64_t seed = 0; seed < 20; ++seed) {
        const auto tiers =
            seed == 0 ? std::vector<uint8_t>(T, KVXFER_TIER_FP16) : random_tiers(T, seed);
        const auto e = encode_tiered(cfg, src, tiers);
        ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
        EXPECT_LE(e.anchor.size(), amax);
        EXPECT_LE(e.residual.size(), rmax);
        if (seed == 0) {
          EXPECT_EQ(e.residual.size(), rmax);
        }
      }
      // All FP16 but one INT8 token whose range needs fp32 metadata: the largest anchor.
      std::vector<uint8_t> tiers(T, KVXFER_TIER_FP16);
      tiers[0] = KVXFER_TIER_INT8;
      src.set(0, 0, 1e6f);
      const auto e = encode_tiered(cfg, src, tiers);
      ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
      EXPECT_LE(e.anchor.size(), amax);
      EXPECT_GE(e.anchor.size() + H, amax);  // one token's H bytes of fp16 became A-bit fields
    }
}

// ---------------------------------------------------------------------------
// Bad arguments
// ---------------------------------------------------------------------------

TEST(SpectrumCodec, BadArgumentsAreRefused) {
  PagedBuffer src(20, 6, KVXFER_DTYPE_FP32, 16);
  test::fill_kv_like(&src, 1);
  const auto cfg = spectrum_config();
  Bytes a(4096), r(4096);
  size_t al = 99, rl = 99;
  const auto tiers = random_tiers(20, 3);
  auto enc = [&](const kvxfer_codec_config_t& c, const uint8_t* t) {
    al = rl = 99;
    return encode_page_tiered(&c, &kId, &src.layout, t, a.data(), a.size(), &al, r.data(), r.size(),
                              &rl);
  };
  EXPECT_EQ(enc(cfg, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("token_tiers is NULL"), std::string::npos);
  EXPECT_EQ(al + rl, 0u);
  auto bad = tiers;
  bad[13] = 4;
  EXPECT_EQ(enc(cfg, bad.data()), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_STREQ(last_error(),
               "token_tiers[13] = 4 is not a kvxfer_tier_t (0 FP16, 1 INT8, 2 INT4, 3 DROP)");
  EXPECT_EQ(al + rl, 0u);
  EXPECT_EQ(enc(config(KVXFER_CODEC_INT8, 0.0f), tiers.data()), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("need codec SPECTRUM"), std::string::npos);
  auto c7 = cfg;
  c7.anchor_bits = 7;
  EXPECT_EQ(enc(c7, tiers.data()), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("anchor_bits 7 must be 2..6"), std::string::npos);
  // Too small: BUFFER_TOO_SMALL, lengths 0.
  al = rl = 99;
  EXPECT_EQ(encode_page_tiered(&cfg, &kId, &src.layout, tiers.data(), a.data(), 100, &al, r.data(),
                               r.size(), &rl),
            KVXFER_ERR_BUFFER_TOO_SMALL);
  EXPECT_EQ(al + rl, 0u);
  // The untiered encoder refuses SPECTRUM.
  al = rl = 99;
  EXPECT_EQ(encode_page(&cfg, &kId, &src.layout, a.data(), a.size(), &al, r.data(), r.size(), &rl),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("needs token tiers: use kvxfer_page_encode_tiered"),
            std::string::npos);
  EXPECT_EQ(al + rl, 0u);
  // An empty page needs no tier array.
  PagedBuffer empty(0, 6, KVXFER_DTYPE_FP32, 16);
  EXPECT_EQ(encode_page_tiered(&cfg, &kId, &empty.layout, nullptr, a.data(), a.size(), &al,
                               r.data(), r.size(), &rl),
            KVXFER_SUCCESS)
      << last_error();
  EXPECT_EQ(get_page_tiers(a.data(), al, nullptr, 0), KVXFER_SUCCESS) << last_error();
}

// ---------------------------------------------------------------------------
// Hostile and damaged sections
// ---------------------------------------------------------------------------

struct Page {
  PagedBuffer src{40, 6, KVXFER_DTYPE_FP32, 16};
  std::vector<uint8_t> tiers;
  test::Encoded e;
  Page() {
    test::fill_kv_like(&src, 12);
    tiers = random_tiers(40, 4);
    tiers[0] = KVXFER_TIER_FP16;
    tiers[1] = KVXFER_TIER_INT8;
    tiers[2] = KVXFER_TIER_INT4;
    tiers[39] = KVXFER_TIER_DROP;  // 40 tokens: the map's last byte is full
    e = encode_tiered(spectrum_config(16, 4), src, tiers);
    EXPECT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  }
};

// Every rejection: the code, a substring of the message, and an untouched
// destination (anchor-only and full), plus the same verdict from get_tiers.
void expect_rejected(const Bytes& anchor, const Bytes& residual, kvxfer_result_t want,
                     const std::string& substr, bool check_tiers = true) {
  PagedBuffer dst(40, 6, KVXFER_DTYPE_FP16, 16);
  const Bytes before = dst.bytes();
  // Link the residual to the (forged) anchor, so that full decoding reaches
  // the same check instead of failing on the pairing.
  Bytes linked = residual;
  if (anchor.size() >= kHeaderBytes && linked.size() >= kHeaderBytes) {
    std::memcpy(linked.data() + 64, anchor.data() + 72, 8);
    seal_section(linked.data());
  }
  for (bool full : {false, true}) {
    if (full && residual.empty()) continue;
    clear_error();
    const kvxfer_result_t r =
        decode_page(anchor.data(), anchor.size(), full ? linked.data() : nullptr,
                    full ? linked.size() : 0, nullptr, &dst.layout);
    EXPECT_EQ(r, want) << last_error();
    EXPECT_NE(std::string(last_error()).find(substr), std::string::npos)
        << "message \"" << last_error() << "\" lacks \"" << substr << "\"";
    EXPECT_EQ(dst.bytes(), before) << "a failed decode wrote the destination";
  }
  if (check_tiers) {
    std::vector<uint8_t> tiers(40, 0xCC);
    EXPECT_EQ(get_page_tiers(anchor.data(), anchor.size(), tiers.data(), 40), want);
    EXPECT_EQ(tiers, std::vector<uint8_t>(40, 0xCC)) << "get_tiers wrote on failure";
  }
}

TEST(SpectrumCodec, TruncatedMapIsRejected) {
  Page pg;
  const Bytes& a = pg.e.anchor;
  // Cut inside the map, inside the tier counts, and one byte short of the end.
  for (size_t keep : {kHeaderBytes + kTierCountBytes + 3, kHeaderBytes + 10, a.size() - 1}) {
    SCOPED_TRACE("kept " + std::to_string(keep) + " bytes");
    expect_rejected(Bytes(a.begin(), a.begin() + keep), pg.e.residual, KVXFER_ERR_TRUNCATED,
                    "truncated");
    kvxfer_page_info_t info;
    EXPECT_EQ(inspect_section(a.data(), keep, &info), KVXFER_ERR_TRUNCATED);
  }
  // A residual cut short, too.
  PagedBuffer dst(40, 6, KVXFER_DTYPE_FP16, 16);
  EXPECT_EQ(decode_page(a.data(), a.size(), pg.e.residual.data(), pg.e.residual.size() - 1, nullptr,
                        &dst.layout),
            KVXFER_ERR_TRUNCATED);
}

// With the checksum re-forged, a rewritten map entry, padding bit, tier
// count, metadata pair or FP16 high byte is still caught.
TEST(SpectrumCodec, ForgedSectionsAreRejected) {
  Page pg;
  const size_t map = kHeaderBytes + kTierCountBytes;
  {  // token 1: INT8 -> INT4 in the map; the counts no longer match
    Bytes a = pg.e.anchor;
    a[map] = static_cast<uint8_t>((a[map] & ~(3u << 2)) | (KVXFER_TIER_INT4 << 2));
    seal_section(a.data());
    expect_rejected(a, pg.e.residual, KVXFER_ERR_CORRUPT, "precision map holds");
  }
  {  // swap two tokens' tiers: the counts match; the map is a valid one
    Bytes a = pg.e.anchor;
    std::vector<uint8_t> t = pg.tiers;
    std::swap(t[0], t[1]);
    std::fill(a.begin() + map, a.begin() + map + 10, 0);
    for (size_t i = 0; i < 40; ++i) a[map + i / 4] |= static_cast<uint8_t>(t[i] << (2 * (i % 4)));
    seal_section(a.data());
    std::vector<uint8_t> back(40);
    ASSERT_EQ(get_page_tiers(a.data(), a.size(), back.data(), 40), KVXFER_SUCCESS);
    EXPECT_EQ(back, t);  // the checksum is what guards the map's content
  }
  {  // tier counts rewritten (sum kept): the payload size no longer matches
    Bytes a = pg.e.anchor;
    a[kHeaderBytes + 0] += 1;  // fp16 + 1
    a[kHeaderBytes + 8] -= 1;  // int8 - 1
    seal_section(a.data());
    expect_rejected(a, pg.e.residual, KVXFER_ERR_CORRUPT, "payload_bytes");
  }
  {  // tier counts that do not add up to num_tokens
    Bytes a = pg.e.anchor;
    a[kHeaderBytes + 24] += 1;
    seal_section(a.data());
    expect_rejected(a, pg.e.residual, KVXFER_ERR_CORRUPT, "do not add up to num_tokens");
  }
  {  // a residual whose counts differ from its anchor's: not its residual
    Bytes r = pg.e.residual;
    PageHeader rh;
    ASSERT_EQ(parse_section(r.data(), r.size(), &rh), KVXFER_SUCCESS);
    r[kHeaderBytes + 16] += 1;  // int4 + 1
    r[kHeaderBytes + 24] -= 1;  // drop - 1
    seal_section(r.data());
    PagedBuffer dst(40, 6, KVXFER_DTYPE_FP16, 16);
    const Bytes before = dst.bytes();
    EXPECT_EQ(decode_page(pg.e.anchor.data(), pg.e.anchor.size(), r.data(), r.size(), nullptr,
                          &dst.layout),
              KVXFER_ERR_MISMATCH)
        << last_error();
    EXPECT_EQ(dst.bytes(), before);
  }
  PageHeader h;
  ASSERT_EQ(parse_section(pg.e.anchor.data(), pg.e.anchor.size(), &h), KVXFER_SUCCESS);
  const SpectrumParts p = spectrum_parts(h);
  {  // an FP16 high byte with an all-ones exponent (infinity/NaN at full precision)
    Bytes a = pg.e.anchor;
    a[kHeaderBytes + p.fp16_high] = 0x7C;
    seal_section(a.data());
    expect_rejected(a, pg.e.residual, KVXFER_ERR_CORRUPT, "infinity or NaN exponent", false);
  }
  {  // a non-finite metadata pair
    Bytes a = pg.e.anchor;
    a[kHeaderBytes + p.meta + 1] = 0x7C;  // m of chunk 0 channel 0 = inf
    a[kHeaderBytes + p.meta] = 0x00;
    seal_section(a.data());
    expect_rejected(a, pg.e.residual, KVXFER_ERR_CORRUPT, "metadata entry 0", false);
  }
  {  // the anchor table outside its bins
    Bytes a = pg.e.anchor;
    put_f32_le(a.data() + kHeaderBytes + p.table, 5.0f);
    seal_section(a.data());
    expect_rejected(a, pg.e.residual, KVXFER_ERR_CORRUPT, "anchor table", false);
  }
}

// Padding bits of the map and the canonical metadata of chunks without
// quantized tokens must be zero.
TEST(SpectrumCodec, NonZeroPaddingAndNonCanonicalMetadataAreRejected) {
  const int64_t T = 21;  // map of 6 bytes, the last holding one token
  PagedBuffer src(T, 3, KVXFER_DTYPE_FP32, 16);
  test::fill_kv_like(&src, 31);
  std::vector<uint8_t> tiers(T, KVXFER_TIER_FP16);
  tiers[0] = KVXFER_TIER_INT8;  // chunk 0 quantized, chunk 1 (tokens 16..20) all FP16
  const auto e = encode_tiered(spectrum_config(16, 4), src, tiers);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  PagedBuffer dst(T, 3, KVXFER_DTYPE_FP32, 16);
  const Bytes before = dst.bytes();
  const size_t map = kHeaderBytes + kTierCountBytes;
  Bytes a = e.anchor;
  a[map + 5] |= 0x40;  // a padding bit
  seal_section(a.data());
  EXPECT_EQ(decode_page(a.data(), a.size(), nullptr, 0, nullptr, &dst.layout), KVXFER_ERR_CORRUPT);
  EXPECT_NE(std::string(last_error()).find("padding bits after token 21"), std::string::npos)
      << last_error();
  kvxfer_page_info_t info;
  EXPECT_EQ(inspect_section(a.data(), a.size(), &info), KVXFER_ERR_CORRUPT);

  PageHeader h;
  ASSERT_EQ(parse_section(e.anchor.data(), e.anchor.size(), &h), KVXFER_SUCCESS);
  const SpectrumParts p = spectrum_parts(h);
  a = e.anchor;
  const uint16_t one = f32_to_f16(1.0f);
  std::memcpy(a.data() + kHeaderBytes + p.meta + 4 * 3 /* chunk 1 channel 0, m */, &one, 2);
  seal_section(a.data());
  EXPECT_EQ(decode_page(a.data(), a.size(), nullptr, 0, nullptr, &dst.layout), KVXFER_ERR_CORRUPT);
  EXPECT_NE(std::string(last_error()).find("must carry +0, +0"), std::string::npos) << last_error();
  EXPECT_EQ(dst.bytes(), before);
}

TEST(SpectrumCodec, GetTiersRefusesOtherSections) {
  Page pg;
  std::vector<uint8_t> tiers(40, 0xCC);
  const std::vector<uint8_t> untouched = tiers;
  EXPECT_EQ(get_page_tiers(pg.e.residual.data(), pg.e.residual.size(), tiers.data(), 40),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("residual section carries no precision map"),
            std::string::npos);
  EXPECT_EQ(get_page_tiers(pg.e.anchor.data(), pg.e.anchor.size(), tiers.data(), 39),
            KVXFER_ERR_MISMATCH);
  EXPECT_EQ(get_page_tiers(pg.e.anchor.data(), pg.e.anchor.size(), nullptr, 40),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(get_page_tiers(pg.e.anchor.data(), pg.e.anchor.size(), tiers.data(), -1),
            KVXFER_ERR_INVALID_ARGUMENT);
  const auto int8 = test::encode(config(KVXFER_CODEC_INT8, 0.0f, 16, 4), pg.src, Impl::REFERENCE);
  ASSERT_EQ(int8.rc, KVXFER_SUCCESS);
  EXPECT_EQ(get_page_tiers(int8.anchor.data(), int8.anchor.size(), tiers.data(), 40),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("not a SpectrumKV page"), std::string::npos);
  EXPECT_EQ(tiers, untouched);
  // The device decoder's planner refuses SpectrumKV pages (host only).
  PagedBuffer dst(40, 6, KVXFER_DTYPE_FP32, 16);
  DecodePlan plan;
  EXPECT_EQ(
      plan_decode(pg.e.anchor.data(), pg.e.anchor.size(), nullptr, 0, nullptr, &dst.layout, &plan),
      KVXFER_ERR_UNSUPPORTED);
}

// ---------------------------------------------------------------------------
// The public C API
// ---------------------------------------------------------------------------

TEST(SpectrumCodec, PublicApiRoundTrip) {
  const int64_t T = 50;
  const int32_t H = 10;
  PagedBuffer src(T, H, KVXFER_DTYPE_BF16, 16);
  test::fill_kv_like(&src, 77);
  const auto tiers = random_tiers(T, 9);
  const auto cfg = spectrum_config(32, 4);
  size_t amax = 0, rmax = 0;
  ASSERT_EQ(kvxfer_page_max_size(&cfg, T, H, &amax, &rmax), KVXFER_SUCCESS);
  Bytes a(amax), r(rmax);
  size_t al = 0, rl = 0;
  ASSERT_EQ(kvxfer_page_encode_tiered(&cfg, &kId, &src.layout, tiers.data(), a.data(), amax, &al,
                                      r.data(), rmax, &rl),
            KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  EXPECT_EQ(kvxfer_page_encode(&cfg, &kId, &src.layout, a.data(), amax, &al, r.data(), rmax, &rl),
            KVXFER_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(kvxfer_page_encode_tiered(&cfg, &kId, &src.layout, tiers.data(), a.data(), amax, &al,
                                      r.data(), rmax, &rl),
            KVXFER_SUCCESS);
  std::vector<uint8_t> back(T);
  ASSERT_EQ(kvxfer_page_get_tiers(a.data(), al, back.data(), T), KVXFER_SUCCESS);
  EXPECT_EQ(back, tiers);
  kvxfer_page_info_t info;
  ASSERT_EQ(kvxfer_page_inspect(a.data(), al, &info), KVXFER_SUCCESS);
  EXPECT_EQ(info.codec, KVXFER_CODEC_SPECTRUM);
  EXPECT_EQ(info.anchor_bits, 4);
  EXPECT_EQ(info.residual_bits, 4);
  EXPECT_EQ(info.num_tokens, T);
  ASSERT_EQ(kvxfer_page_inspect(r.data(), rl, &info), KVXFER_SUCCESS);
  EXPECT_EQ(info.is_residual, 1);
  PagedBuffer out(T, H, KVXFER_DTYPE_FP32, 4);
  ASSERT_EQ(kvxfer_page_decode(a.data(), al, r.data(), rl, &kId, &out.layout), KVXFER_SUCCESS);
  a.resize(al);
  expect_tier_bounds(src, out, tiers, a, true, "api");
}

}  // namespace
}  // namespace kvxfer::codec
