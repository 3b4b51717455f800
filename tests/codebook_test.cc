// The scalar quantizers: exhaustive code/split checks and hand-computed values.
#include "codec/codebook.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "codec/detmath.h"
#include "codec/page.h"

namespace kvxfer::codec {
namespace {

struct CbCase {
  kvxfer_codec_t codec;
  float alpha;
  int anchor_bits;
};

std::vector<CbCase> all_codebooks() {
  std::vector<CbCase> v;
  for (float alpha : {0.0f, 5.0f, 20.0f, 100.0f, 255.0f, 1000.0f})
    for (int a = 2; a <= 6; ++a) v.push_back({KVXFER_CODEC_LYNX, alpha, a});
  for (int a = 2; a <= 6; ++a) v.push_back({KVXFER_CODEC_INT8, 0.0f, a});
  v.push_back({KVXFER_CODEC_INT4, 0.0f, 4});
  return v;
}

CodebookRef cb_of(const CbCase& c) {
  std::string why;
  const CodebookRef cb = get_codebook(c.codec, c.alpha, c.anchor_bits, &why);
  EXPECT_NE(cb, nullptr) << why;
  return cb;
}

TEST(Codebook, EveryCodeSplitsAndMergesExactly) {
  for (const auto& c : all_codebooks()) {
    const CodebookRef cb = cb_of(c);
    const unsigned R = cb->residual_bits, ncodes = 1u << cb->code_bits;
    for (unsigned code = 0; code < ncodes; ++code) {
      // Through the bit stream, at an odd offset, next to other fields.
      uint8_t abuf[8] = {0}, rbuf[8] = {0};
      put_bits(abuf, 3 * cb->anchor_bits, cb->anchor_bits, code >> R);
      if (R) put_bits(rbuf, 5 * R, R, code & ((1u << R) - 1));
      const unsigned a = get_bits(abuf, 3 * cb->anchor_bits, cb->anchor_bits);
      const unsigned r = R ? get_bits(rbuf, 5 * R, R) : 0;
      ASSERT_EQ((a << R) | r, code) << "codec " << c.codec << " A=" << c.anchor_bits;
      ASSERT_LT(a, 1u << cb->anchor_bits);
    }
  }
}

TEST(Codebook, EveryCodeReconstructsInsideItsOwnBinAndEncodesBack) {
  for (const auto& c : all_codebooks()) {
    const CodebookRef cb = cb_of(c);
    const unsigned ncodes = 1u << cb->code_bits, R = cb->residual_bits;
    for (unsigned code = 0; code < ncodes; ++code) {
      const float r = cb->recon_full[code];
      // The linear levels at +-1 may land one ulp outside (RN(q * step)).
      ASSERT_GE(r, -1.0f - 1e-6f);
      ASSERT_LE(r, 1.0f + 1e-6f);
      ASSERT_EQ(cb->encode_z(r), code)
          << "codec " << c.codec << " alpha " << c.alpha << " code " << code;
      if (cb->kind != CODE_LUT) {
        ASSERT_EQ(r, recon_linear(cb->kind, code, cb->recon_step));
      }
      // The anchor value lies in the union of its codes' bins: it encodes to a
      // code with the same anchor.
      ASSERT_EQ(cb->encode_z(cb->recon_anchor[code >> R]) >> R, code >> R);
    }
  }
}

// The code of z by the closed formula, in double; -1 near an edge (1e-5 uniform, 1e-4 in y nested).
// Uniform: round half up of (z + 1) * (2^b - 1) / 2.  LYNX alpha 0 (nested):
// the last code whose lower edge E(c), in y = 256 + 240 z, is <= y, with
// E = 16 + c below code 16, 2c up to 239, c + 240 above (docs/FORMAT.md 2.2).
int closed_form_code(const Codebook& cb, double z) {
  if (cb.kind == CODE_NEST) {
    const double y = 256.0 + 240.0 * z;
    if (std::fabs(y - std::floor(y + 0.5)) < 1e-4) return -1;  // 3 ulp of y <= 496
    int code = 0;
    for (int c = 1; c < 256; ++c)
      if ((c < 16 ? 16 + c : (c < 240 ? 2 * c : c + 240)) <= y) code = c;
    return code;
  }
  const double y = (z + 1.0) * cb.scale_num;
  if (std::fabs(y - std::floor(y) - 0.5) < 1e-5) return -1;
  return static_cast<int>(std::min<double>(cb.max_code, std::max(0.0, std::floor(y + 0.5))));
}

TEST(Codebook, FastLookupEqualsDefinitionOnEveryBoundary) {
  // Every threshold, its float neighbours, and a dense sweep: the lookup of
  // the alpha-law codebooks equals the threshold count, and the formula of
  // the linear codebooks equals round-half-up in double away from ties.
  for (const auto& c : all_codebooks()) {
    const CodebookRef cb = cb_of(c);
    std::vector<float> probes = {0.0f, -0.0f, 1.0f, -1.0f, 1e-30f, -1e-30f, 1e-45f};
    for (float t : cb->thresholds)
      for (float v : {t, std::nextafter(t, 2.0f), std::nextafter(t, -2.0f)}) {
        probes.push_back(v);
        probes.push_back(-v);
      }
    for (int i = 0; i <= 20000; ++i) probes.push_back(-1.0f + i / 10000.0f);
    for (float z : probes) {
      if (!(z >= -1.0f && z <= 1.0f)) continue;
      const unsigned fastq = cb->encode_fast(z, 0.0f, cb->scale(1.0f));
      ASSERT_EQ(fastq, cb->encode_z(z))
          << "z=" << z << " codec " << c.codec << " alpha " << c.alpha;
      if (cb->kind == CODE_LUT) {
        ASSERT_EQ(fastq, cb->encode_threshold(z)) << "z=" << z << " alpha " << c.alpha;
      } else {
        const int want = closed_form_code(*cb, z);
        if (want >= 0) {
          ASSERT_EQ(static_cast<int>(fastq), want) << "z=" << z << " codec " << c.codec;
        }
      }
    }
  }
}

TEST(Codebook, LinearCodesTrackTheScaleOfTheirChunk) {
  // x in a chunk of offset m and half-range d, through s = RN(L / d): the code
  // of x = m + z d equals the closed form of z away from ties, for ranges far
  // from 1 and offsets far from 0 (the multiply by a reciprocal).
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4}) {
    const CodebookRef cb = get_codebook(codec, 0.0f, 4, nullptr);
    for (float d : {std::ldexp(1.0f, -24), 3e-3f, 0.7f, 1.0f, 13.0f, 65504.0f})
      for (float m : {0.0f, -1.5f, 100.0f}) {
        const float s = cb->scale(d);
        for (int i = 0; i <= 2000; ++i) {
          const double z = -1.0 + i / 1000.0;
          const float x = static_cast<float>(m + z * d);
          const double zx = (static_cast<double>(x) - m) / d;  // the z x really has
          if (!(zx >= -1.0 && zx <= 1.0)) continue;
          const int want = closed_form_code(*cb, zx);
          if (want < 0) continue;
          ASSERT_EQ(static_cast<int>(cb->encode(x, m, s)), want)
              << "codec " << codec << " d " << d << " m " << m << " x " << x;
        }
      }
  }
}

TEST(Codebook, LynxMatchesAlphaLawFormula) {
  // q = round(ln(1 + alpha |z|) / ln(1 + alpha) * 127), computed here with libm
  // in double.  Points within 1e-6 of a rounding tie are skipped (there the
  // float threshold table is the definition).
  for (float alpha : {5.0f, 20.0f, 100.0f, 255.0f}) {
    const CodebookRef cb = get_codebook(KVXFER_CODEC_LYNX, alpha, 4, nullptr);
    for (int i = 0; i <= 4000; ++i) {
      const float z = -1.0f + i / 2000.0f;
      const double y =
          std::log1p(alpha * std::fabs(static_cast<double>(z))) / std::log1p(alpha) * 127.0;
      if (std::fabs(y - std::floor(y) - 0.5) < 1e-6) continue;
      const unsigned q = static_cast<unsigned>(std::floor(y + 0.5));
      ASSERT_EQ(cb->encode_z(z), q | (z < 0 ? 0x80u : 0u)) << "alpha " << alpha << " z " << z;
    }
  }
  // alpha = 0 is the nested code, by hand: y = 256 + 240 z, anchor = INT4's
  // round((z + 1) * 7.5), residual in steps of 1/120 (1/240 in the end cells).
  const CodebookRef lin = get_codebook(KVXFER_CODEC_LYNX, 0.0f, 4, nullptr);
  EXPECT_EQ(lin->encode_z(0.5f), 11u << 4 | 12u);  // y 376: INT4 11.25 -> 11, (376 - 352) / 2
  EXPECT_EQ(lin->encode_z(-0.5f), 4u << 4 | 4u);   // y 136: INT4 3.75 -> 4, (136 - 128) / 2
  EXPECT_EQ(lin->encode_z(-1.0f), 0u);
  EXPECT_EQ(lin->encode_z(1.0f), 255u);
  EXPECT_EQ(lin->encode_z(0.0f), 8u << 4);
  EXPECT_EQ(lin->encode_z(-1e-30f), 8u << 4);
  EXPECT_EQ(lin->encode_z(0.99f), 15u << 4 | 13u);  // y 493.6: top cell, 493 - 480
  EXPECT_EQ(lin->encode_z(-0.99f), 0u << 4 | 2u);   // y 18.4: bottom cell, 18 - 16
  // Levels: cell centres, the extremes at +-1.
  EXPECT_EQ(lin->recon_full[0], -1.0f);
  EXPECT_EQ(lin->recon_full[255], 1.0f);
  EXPECT_FLOAT_EQ(lin->recon_full[8u << 4], 1.0f / 240);     // y 257
  EXPECT_FLOAT_EQ(lin->recon_full[15u << 4], 224.5f / 240);  // y 480.5
  EXPECT_FLOAT_EQ(lin->recon_full[1], (16.5f + 1 - 256) / 240);
  EXPECT_NEAR(lin->max_half_width_full, 1.0 / 240, 1e-7);
  EXPECT_NEAR(lin->max_half_width_anchor, 1.0 / 15, 1e-6);
  EXPECT_FALSE(has_anchor_table(*lin));
}

TEST(Codebook, NestedAnchorIsInt4BitForBit) {
  // The 4-bit anchor of LYNX alpha 0 is INT4's code of the same element, and
  // its value is INT4's level (the same float), for ranges far from 1,
  // offsets far from 0 and the float neighbours of every INT4 tie.
  const CodebookRef lyn = get_codebook(KVXFER_CODEC_LYNX, 0.0f, 4, nullptr);
  const CodebookRef i4 = get_codebook(KVXFER_CODEC_INT4, 0.0f, 4, nullptr);
  for (int a = 0; a < 16; ++a) EXPECT_EQ(lyn->recon_anchor[a], i4->recon_full[a]) << a;
  std::mt19937 rng(7);
  size_t n = 0;
  for (float d : {std::ldexp(1.0f, -24), 3e-3f, 0.7f, 1.0f, 13.0f, 65504.0f})
    for (float m : {0.0f, -1.5f, 100.0f}) {
      const float sl = lyn->scale(d), s4 = i4->scale(d);
      ASSERT_EQ(sl, 32.0f * s4);  // RN(240 / d) = 32 RN(7.5 / d): a power of two apart
      std::vector<float> xs;
      for (int k = 0; k <= 15; ++k) {  // INT4's ties and their neighbours
        const float x = static_cast<float>(m + (k + 0.5) / 7.5 * d - d);
        for (float v : {x, std::nextafter(x, 1e30f), std::nextafter(x, -1e30f)}) xs.push_back(v);
      }
      for (int i = 0; i < 4000; ++i)
        xs.push_back(
            static_cast<float>(m + d * std::uniform_real_distribution<double>(-1, 1)(rng)));
      for (float x : xs) {
        if (!(std::fabs(static_cast<double>(x) - m) <= d)) continue;
        ASSERT_EQ(lyn->encode(x, m, sl) >> 4, i4->encode(x, m, s4))
            << "x " << x << " m " << m << " d " << d;
        ++n;
      }
    }
  EXPECT_GT(n, 60000u);
}

TEST(Codebook, UniformBaselinesMatchHandComputedValues) {
  // Asymmetric min/max INT8 on a channel 0..15: m = d = 7.5, so
  // q = round((x - 0) / 15 * 255) = 17 x.
  const CodebookRef i8 = get_codebook(KVXFER_CODEC_INT8, 0.0f, 4, nullptr);
  const CodebookRef i4 = get_codebook(KVXFER_CODEC_INT4, 0.0f, 4, nullptr);
  const float s8 = i8->scale(7.5f), s4 = i4->scale(7.5f);
  for (int x = 0; x < 16; ++x) {
    EXPECT_EQ(i8->encode(static_cast<float>(x), 7.5f, s8), 17u * x);
    EXPECT_EQ(i4->encode(static_cast<float>(x), 7.5f, s4), static_cast<unsigned>(x));
    // Every code, the extremes included, reconstructs at the textbook level
    // min + q * scale.
    EXPECT_FLOAT_EQ(7.5f + 7.5f * i8->recon_full[17 * x], static_cast<float>(x));
    EXPECT_FLOAT_EQ(7.5f + 7.5f * i4->recon_full[x], static_cast<float>(x));
  }
  EXPECT_FLOAT_EQ(i8->recon_full[0], -1.0f);
  EXPECT_FLOAT_EQ(i8->recon_full[255], 1.0f);
  EXPECT_FLOAT_EQ(i4->recon_full[0], -1.0f);
  // INT4 has no residual: its anchor value is its level.
  for (int q = 0; q < 16; ++q) EXPECT_EQ(i4->recon_anchor[q], i4->recon_full[q]);
  // INT8 4+4 anchor a covers codes [16a, 16a+15]: centre of [lo, hi].
  for (int a = 1; a < 15; ++a)
    EXPECT_FLOAT_EQ(i8->recon_anchor[a], static_cast<float>(-1.0 + (32.0 * a + 15.0) / 255.0)) << a;
  EXPECT_FLOAT_EQ(i8->recon_anchor[0], static_cast<float>(0.5 * (-1.0 + (-1.0 + 31.0 / 255.0))));
  // Largest distance from a code's value to its bin's ends: INT8 1/255 (the
  // interior half step; the end codes at +-1 reach as far inside their
  // half-width bins); INT4 1/15.
  EXPECT_NEAR(i8->max_half_width_full, 1.0 / 255, 1e-6);
  EXPECT_NEAR(i4->max_half_width_full, 1.0 / 15, 1e-6);
  EXPECT_NEAR(i8->max_half_width_anchor, 16.0 / 255, 1e-6);
}

TEST(Codebook, LynxAnchorIsSignPlusTopMagnitudeBits) {
  const CodebookRef cb = get_codebook(KVXFER_CODEC_LYNX, 100.0f, 4, nullptr);
  for (unsigned code = 0; code < 256; ++code) {
    const unsigned a = code >> 4;
    EXPECT_EQ(a >> 3, code >> 7);            // sign bit
    EXPECT_EQ(a & 7u, (code & 0x7Fu) >> 4);  // top 3 of 7 magnitude bits
    // Anchor-only value has the code's sign and sits inside the anchor's range.
    if (code & 0x80u)
      EXPECT_LT(cb->recon_anchor[a], 0.0f);
    else
      EXPECT_GT(cb->recon_anchor[a], 0.0f);
  }
  // Symmetric: anchor of -z is the mirror of anchor of z.
  for (unsigned a = 0; a < 8; ++a) EXPECT_EQ(cb->recon_anchor[a], -cb->recon_anchor[a | 8]);
}

TEST(Codebook, RejectsInvalidParameters) {
  std::string why;
  EXPECT_EQ(get_codebook(KVXFER_CODEC_LYNX, -1.0f, 4, &why), nullptr);
  EXPECT_EQ(get_codebook(KVXFER_CODEC_LYNX, NAN, 4, &why), nullptr);
  EXPECT_EQ(get_codebook(KVXFER_CODEC_LYNX, 2000.0f, 4, &why), nullptr);
  EXPECT_EQ(get_codebook(KVXFER_CODEC_LYNX, 20.0f, 1, &why), nullptr);
  EXPECT_EQ(get_codebook(KVXFER_CODEC_LYNX, 20.0f, 7, &why), nullptr);
  EXPECT_EQ(get_codebook(KVXFER_CODEC_INT4, 0.0f, 3, &why), nullptr);
  EXPECT_EQ(get_codebook(KVXFER_CODEC_BF16, 0.0f, 4, &why), nullptr);
  EXPECT_FALSE(why.empty());
}

TEST(DetMath, MatchesLibmClosely) {
  for (double x : {0.0, 1e-9, 1e-3, 0.5, 1.0, 5.0, 20.0, 100.0, 255.0, 1000.0})
    EXPECT_NEAR(detmath::log1p(x), std::log1p(x), 1e-14 * (1 + std::log1p(x))) << x;
  for (double x : {-3.0, -1e-4, 0.0, 1e-6, 0.01, 0.3, 1.0, 5.5, 6.9})
    EXPECT_NEAR(detmath::expm1(x), std::expm1(x),
                1e-13 * std::max(1e-300, std::fabs(std::expm1(x))))
        << x;
}

TEST(Conversions, Fp16AndBf16RoundTripAndRoundToNearestEven) {
  // Every binary16 value widens and narrows back to itself.
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t v = static_cast<uint16_t>(h);
    if ((v & 0x7C00u) == 0x7C00u && (v & 0x3FFu)) continue;  // NaN payloads
    ASSERT_EQ(f32_to_f16(f16_to_f32(v)), v) << std::hex << h;
    ASSERT_EQ(f32_to_bf16(bf16_to_f32(v)), v) << std::hex << h;
  }
  // Ties to even, overflow, subnormals (hand-computed bit patterns).
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3C00u);      // tie -> even (down)
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02u);  // tie -> even (up)
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7BFFu);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00u);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001u);
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000u);  // tie -> even 0
  EXPECT_EQ(f32_to_f16(std::ldexp(1.5f, -25)), 0x0001u);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80u);  // tie -> even
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82u);
  EXPECT_EQ(f32_to_f16_up(1.0f + std::ldexp(1.0f, -12)), 0x3C01u);
  EXPECT_EQ(f32_to_f16_up(1.0f), 0x3C00u);
  EXPECT_EQ(f32_to_f16_up(70000.0f), 0x7C00u);
}

}  // namespace
}  // namespace kvxfer::codec
