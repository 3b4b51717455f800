// Page codec: fast paths byte-identical to the reference, reconstruction
// within the documented bound, and every bad input rejected clearly.
#include <gtest/gtest.h>

#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>

#include "codec/fast.h"
#include "test_util.h"

namespace kvxfer::codec {
namespace {

using test::config;
using test::PagedBuffer;

std::vector<Impl> fast_impls() {
  std::vector<Impl> v{Impl::SCALAR};
  if (fast::cpu_has_avx2()) v.push_back(Impl::AVX2);
  if (fast::cpu_has_avx512()) v.push_back(Impl::AVX512);
  return v;
}

// Checks every decoded element against the documented bound, using the
// metadata stored in the anchor section.
void expect_within_bound(const PagedBuffer& src, const PagedBuffer& out,
                         const std::vector<uint8_t>& anchor, bool full, const char* what) {
  PageHeader h;
  ASSERT_EQ(parse_section(anchor.data(), anchor.size(), &h), KVXFER_SUCCESS) << last_error();
  const CodebookRef cb =
      get_codebook(static_cast<kvxfer_codec_t>(h.codec), h.alpha, h.anchor_bits, nullptr);
  ASSERT_NE(cb, nullptr);
  const bool fp32 = h.flags & FLAG_META_FP32;
  const int32_t H = src.layout.num_channels;
  double worst = 0;
  for (int64_t t = 0; t < src.layout.num_tokens; ++t)
    for (int32_t c = 0; c < H; ++c) {
      const Affine a = get_affine(anchor.data() + kHeaderBytes, (t / h.chunk_tokens) * H + c, fp32);
      const double x = src.get(t, c), xh = out.get(t, c);
      const double bound = error_bound(*cb, full, a, out.layout.dtype, xh);
      ASSERT_LE(std::fabs(x - xh), bound)
          << what << ": token " << t << " channel " << c << " x=" << x << " x_hat=" << xh
          << " m=" << a.m << " d=" << a.d;
      if (a.d > 0)
        worst = std::max(worst, std::fabs(x - xh) / (a.d * (full ? cb->max_half_width_full
                                                                 : cb->max_half_width_anchor)));
    }
  // The bound is tight: some element comes close to it (not a vacuous check).
  if (src.layout.num_tokens * H > 1000) {
    EXPECT_GT(worst, 0.5) << what;
  }
}

struct Shape {
  int64_t T;
  int32_t H;
  int32_t block;
};

// Every codec and parameter combination, several shapes (T not a multiple
// of the chunk or the block, T < chunk, odd H), three dtypes: the fast paths
// produce the reference's bytes, and decoding stays within the bound.
TEST(PageCodec, FastPathsAreByteIdenticalToReferenceForEveryParameterCombination) {
  std::vector<kvxfer_codec_config_t> cfgs;
  for (int chunk : {16, 32, 64, 128}) {
    for (float alpha : {0.0f, 5.0f, 20.0f, 100.0f, 255.0f})
      for (int a = 2; a <= 6; ++a) cfgs.push_back(config(KVXFER_CODEC_LYNX, alpha, chunk, a));
    for (int a = 2; a <= 6; ++a) cfgs.push_back(config(KVXFER_CODEC_INT8, 0, chunk, a));
    cfgs.push_back(config(KVXFER_CODEC_INT4, 0, chunk));
  }
  const Shape shapes[] = {{1, 8, 16}, {37, 24, 16}, {130, 33, 7}};
  uint64_t seed = 1;
  for (const auto& cfg : cfgs)
    for (const Shape& s : shapes)
      for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
        PagedBuffer src(s.T, s.H, dt, s.block);
        test::fill_kv_like(&src, seed++);
        const auto ref = test::encode(cfg, src, Impl::REFERENCE);
        ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
        for (Impl impl : fast_impls()) {
          const auto f = test::encode(cfg, src, impl, {3, KVXFER_KV_VALUE, 1000, 42}, 2);
          ASSERT_EQ(f.rc, KVXFER_SUCCESS);
          const long da = test::first_diff(ref.anchor, f.anchor),
                     dr = test::first_diff(ref.residual, f.residual);
          ASSERT_EQ(da, -1) << "anchor differs: ref " << test::hex(ref.anchor, da) << " fast "
                            << test::hex(f.anchor, da) << " codec " << cfg.codec << " alpha "
                            << cfg.alpha << " A " << cfg.anchor_bits << " C " << cfg.chunk_tokens
                            << " T " << s.T;
          ASSERT_EQ(dr, -1) << "residual differs: ref " << test::hex(ref.residual, dr) << " fast "
                            << test::hex(f.residual, dr);
        }
        for (bool full : {false, true}) {
          PagedBuffer out_ref(s.T, s.H, dt, 5, 0, 2);
          ASSERT_EQ(decode_page(
                        ref.anchor.data(), ref.anchor.size(), full ? ref.residual.data() : nullptr,
                        full ? ref.residual.size() : 0, nullptr, &out_ref.layout, Impl::REFERENCE),
                    KVXFER_SUCCESS)
              << last_error();
          for (Impl impl : fast_impls()) {
            PagedBuffer out(s.T, s.H, dt, 5, 0, 2);
            ASSERT_EQ(decode_page(ref.anchor.data(), ref.anchor.size(),
                                  full ? ref.residual.data() : nullptr,
                                  full ? ref.residual.size() : 0, nullptr, &out.layout, impl, 2),
                      KVXFER_SUCCESS);
            ASSERT_EQ(test::first_diff(out_ref.bytes(), out.bytes()), -1) << "decoded bytes differ";
          }
          expect_within_bound(src, out_ref, ref.anchor, full, full ? "full" : "anchor");
        }
      }
}

// An FP16 page whose largest value is 65504, the largest finite binary16:
// the codec's range (m + d, d rounded up at binary16 precision) reaches
// 65536, one ulp of d past it.  Decoded into FP16, every path saturates
// there (f32_to_f16_sat): 65504, never +inf, with the same bytes.
TEST(PageCodec, AFiniteFp16PageNeverDecodesToInfinity) {
  const int64_t T = 32;
  const int32_t H = 40;  // a SIMD body and a tail
  PagedBuffer src(T, H, KVXFER_DTYPE_FP16, 16);
  for (int64_t t = 0; t < T; ++t)
    for (int32_t c = 0; c < H; ++c)
      src.set(t, c, t == 0 ? (c % 2 ? 65504.0f : -65504.0f) : -9968.0f + (t - 1) * 100.0f);
  for (const auto& cfg : {config(KVXFER_CODEC_INT8, 0, 32), config(KVXFER_CODEC_INT4, 0, 32),
                          config(KVXFER_CODEC_LYNX, 0, 32), config(KVXFER_CODEC_LYNX, 5, 32)}) {
    kvxfer_codec_config_t c = cfg;
    c.sink_tokens = 0;  // token 0 is coded, not pinned
    const auto e = test::encode(c, src, Impl::REFERENCE);
    ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
    for (bool full : {false, true}) {
      PagedBuffer ref(T, H, KVXFER_DTYPE_FP16, 16);
      ASSERT_EQ(decode_page(e.anchor.data(), e.anchor.size(), full ? e.residual.data() : nullptr,
                            full ? e.residual.size() : 0, nullptr, &ref.layout, Impl::REFERENCE),
                KVXFER_SUCCESS);
      for (int64_t t = 0; t < T; ++t)
        for (int32_t k = 0; k < H; ++k)
          ASSERT_TRUE(std::isfinite(ref.get(t, k)))
              << "codec " << c.codec << " alpha " << c.alpha << (full ? " full" : " anchor")
              << ": token " << t << " channel " << k << " decodes to " << ref.get(t, k);
      expect_within_bound(src, ref, e.anchor, full, full ? "full" : "anchor");
      for (Impl impl : fast_impls()) {
        PagedBuffer out(T, H, KVXFER_DTYPE_FP16, 16);
        ASSERT_EQ(decode_page(e.anchor.data(), e.anchor.size(), full ? e.residual.data() : nullptr,
                              full ? e.residual.size() : 0, nullptr, &out.layout, impl),
                  KVXFER_SUCCESS);
        ASSERT_EQ(test::first_diff(ref.bytes(), out.bytes()), -1)
            << "codec " << c.codec << " impl " << static_cast<int>(impl);
      }
    }
  }
  EXPECT_EQ(f32_to_f16_sat(65536.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16_sat(-1e30f), 0xFBFF);
  EXPECT_EQ(f32_to_f16_sat(std::numeric_limits<float>::infinity()), 0x7C00);  // inf stays
  EXPECT_EQ(f32_to_f16_sat(65519.0f), 0x7BFF);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7C00);
}

TEST(PageCodec, AdversarialPagesAreByteIdentical) {
  // Values on and next to bin thresholds, ties, zeros of both signs, huge and
  // tiny magnitudes, constant channels.
  const auto cfg = config(KVXFER_CODEC_LYNX, 100.0f, 16);
  const CodebookRef cb = get_codebook(KVXFER_CODEC_LYNX, 100.0f, 4, nullptr);
  PagedBuffer src(64, 40, KVXFER_DTYPE_FP32, 16);
  std::mt19937 rng(7);
  for (int64_t t = 0; t < 64; ++t)
    for (int32_t c = 0; c < 40; ++c) {
      float v;
      switch (c % 8) {
        case 0:
          v = (t == 0) ? -1.0f
                       : (t == 1 ? 1.0f : cb->thresholds[rng() % 127] * ((rng() & 1) ? 1 : -1));
          break;
        case 1: v = (t & 1) ? 0.0f : -0.0f; break;
        case 2: v = 3.25f; break;  // constant channel
        case 3: v = std::ldexp(1.0f, -140) * static_cast<float>(rng() % 5); break;  // denormals
        case 4: v = 1e30f * ((rng() & 1) ? 1.0f : -1.0f); break;  // forces fp32 metadata
        case 5: v = std::nextafter(cb->thresholds[t % 127], 0.0f); break;
        case 6: v = static_cast<float>(t % 3) - 1.0f; break;
        default: v = static_cast<float>(rng()) / static_cast<float>(rng.max()) - 0.5f;
      }
      src.set(t, c, v);
    }
  const auto ref = test::encode(cfg, src, Impl::REFERENCE);
  ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
  kvxfer_page_info_t info;
  ASSERT_EQ(inspect_section(ref.anchor.data(), ref.anchor.size(), &info), KVXFER_SUCCESS);
  EXPECT_EQ(info.meta_fp32, 1);  // 1e30 exceeds binary16
  for (Impl impl : fast_impls()) {
    const auto f = test::encode(cfg, src, impl);
    ASSERT_EQ(test::first_diff(ref.anchor, f.anchor), -1);
    ASSERT_EQ(test::first_diff(ref.residual, f.residual), -1);
  }
  PagedBuffer out(64, 40, KVXFER_DTYPE_FP32);
  ASSERT_EQ(decode_page(ref.anchor.data(), ref.anchor.size(), ref.residual.data(),
                        ref.residual.size(), nullptr, &out.layout),
            KVXFER_SUCCESS);
  expect_within_bound(src, out, ref.anchor, true, "adversarial full");
  // Constant channel: zero range, reconstructed exactly.
  for (int64_t t = 0; t < 64; ++t) EXPECT_EQ(out.get(t, 2), 3.25f);
}

// A page built to sit on the edges of format 2's arithmetic (docs/FORMAT.md
// 2.1, 2.2): channels whose chunks span exactly [-1, 1] (m = 0, d = 1, so x
// is z) carrying every code threshold of the codebook and its float
// neighbours; an offset far from 0 with a tiny range; ranges at the binary16
// limit (65504) and past it (binary32 metadata); +-0; subnormals of the
// dtype; constant channels; random KV-like values.  T = 50 leaves a partial
// chunk, H = 70 a tail after two 32-wide vectors.
void fill_edges(PagedBuffer* p, const Codebook& cb, bool past_fp16, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const kvxfer_dtype_t dt = p->layout.dtype;
  const float tiny = dt == KVXFER_DTYPE_FP16 ? std::ldexp(1.0f, -24) : std::ldexp(1.0f, -140);
  // The largest binary16 range the dtype holds (bf16: 65280), or past it.
  const float big = dt == KVXFER_DTYPE_FP16   ? 65504.0f
                    : past_fp16               ? 1e6f
                    : dt == KVXFER_DTYPE_BF16 ? 65280.0f
                                              : 65504.0f;
  // The z of every code edge of the codebook, both signs, and neighbours.
  std::vector<float> edges;
  for (float t : cb.thresholds)
    for (float v : {t, std::nextafter(t, 2.0f), std::nextafter(t, -2.0f)}) {
      edges.push_back(v);
      edges.push_back(-v);
    }
  for (int q = 0; q <= 496; ++q) {  // the linear codes' own edges
    const float v = static_cast<float>(cb.kind == CODE_NEST ? (q - 256) / 240.0  // integer y
                                                            : (q + 0.5) / cb.scale_num - 1);
    if (v >= -1.0f && v <= 1.0f) edges.push_back(v);
  }
  const int64_t T = p->layout.num_tokens;
  const int32_t H = p->layout.num_channels;
  for (int64_t t = 0; t < T; ++t)
    for (int32_t c = 0; c < H; ++c) {
      float v;
      const int64_t in_chunk = t % 16;
      switch (c % 10) {
        case 0:
        case 1:  // z itself: the chunk's first two rows pin the range to [-1, 1]
          v = in_chunk == 0 ? -1.0f : in_chunk == 1 ? 1.0f : edges[rng() % edges.size()];
          break;
        case 2: v = 100.0f + 0.01f * (static_cast<float>(rng() % 201) / 100.0f - 1.0f); break;
        case 3: v = (rng() & 1 ? big : -big) * (in_chunk < 2 ? 1.0f : 0.37f); break;
        case 4: v = (t & 1) ? 0.0f : -0.0f; break;
        case 5: v = tiny * static_cast<float>(rng() % 7) * ((rng() & 1) ? 1.0f : -1.0f); break;
        case 6: v = -2.5f; break;                        // constant
        case 7: v = in_chunk == 0 ? 0.0f : 1.0f; break;  // z = -1 and +1 only
        default: v = std::normal_distribution<float>(0.0f, 1.5f)(rng);
      }
      p->set(t, c, v);
    }
}

TEST(PageCodec, EdgePagesAreByteIdenticalOnEveryPathDtypeAndThreadCount) {
  struct Case {
    kvxfer_codec_t codec;
    float alpha;
    int anchor_bits;
  };
  const Case cases[] = {{KVXFER_CODEC_LYNX, 0.0f, 4}, {KVXFER_CODEC_LYNX, 100.0f, 4},
                        {KVXFER_CODEC_LYNX, 0.0f, 3}, {KVXFER_CODEC_INT8, 0.0f, 4},
                        {KVXFER_CODEC_INT8, 0.0f, 5}, {KVXFER_CODEC_INT4, 0.0f, 4}};
  uint64_t seed = 11;
  for (const Case& k : cases)
    for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32})
      for (bool past_fp16 : {false, true})
        for (int chunk : {16, 32}) {
          if (past_fp16 && dt == KVXFER_DTYPE_FP16) continue;  // fp16 input cannot exceed it
          const CodebookRef cb = get_codebook(k.codec, k.alpha, k.anchor_bits, nullptr);
          PagedBuffer src(50, 70, dt, 16);
          fill_edges(&src, *cb, past_fp16, seed++);
          const auto cfg = config(k.codec, k.alpha, chunk, k.anchor_bits);
          const auto ref = test::encode(cfg, src, Impl::REFERENCE);
          ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
          kvxfer_page_info_t info;
          ASSERT_EQ(inspect_section(ref.anchor.data(), ref.anchor.size(), &info), KVXFER_SUCCESS);
          EXPECT_EQ(info.meta_fp32, past_fp16 ? 1 : 0);
          const std::string what = std::string("codec ") + std::to_string(k.codec) + " alpha " +
                                   std::to_string(k.alpha) + " A " + std::to_string(k.anchor_bits) +
                                   " dtype " + std::to_string(dt) + " C " + std::to_string(chunk) +
                                   (past_fp16 ? " fp32 meta" : "");
          for (Impl impl : fast_impls())
            for (int threads : {1, 2}) {
              const auto f = test::encode(cfg, src, impl, {3, KVXFER_KV_VALUE, 1000, 42}, threads);
              ASSERT_EQ(f.rc, KVXFER_SUCCESS);
              const long da = test::first_diff(ref.anchor, f.anchor);
              ASSERT_EQ(da, -1) << what << ": anchor byte " << da << " ref "
                                << test::hex(ref.anchor, da) << " fast " << test::hex(f.anchor, da);
              ASSERT_EQ(test::first_diff(ref.residual, f.residual), -1) << what;
            }
          for (bool full : {false, true}) {
            PagedBuffer out_ref(50, 70, dt, 16);
            ASSERT_EQ(
                decode_page(ref.anchor.data(), ref.anchor.size(),
                            full ? ref.residual.data() : nullptr, full ? ref.residual.size() : 0,
                            nullptr, &out_ref.layout, Impl::REFERENCE),
                KVXFER_SUCCESS);
            for (Impl impl : fast_impls())
              for (int threads : {1, 2}) {
                PagedBuffer out(50, 70, dt, 16);
                ASSERT_EQ(decode_page(ref.anchor.data(), ref.anchor.size(),
                                      full ? ref.residual.data() : nullptr,
                                      full ? ref.residual.size() : 0, nullptr, &out.layout, impl,
                                      threads),
                          KVXFER_SUCCESS);
                ASSERT_EQ(test::first_diff(out_ref.bytes(), out.bytes()), -1)
                    << what << (full ? " full" : " anchor") << " decode";
              }
            expect_within_bound(src, out_ref, ref.anchor, full, what.c_str());
            // Constant channels come back exactly, at both precisions.
            for (int64_t t = 0; t < 50; ++t) ASSERT_EQ(out_ref.get(t, 6), -2.5f) << what;
          }
        }
}

// The vector paths proper: 1024 channels (32 vectors of 32) and many rows.
TEST(PageCodec, WidePagesAreByteIdenticalOnEveryPath) {
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4})
    for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
      PagedBuffer src(200, 1024, dt, 16);
      test::fill_kv_like(&src, 5 + dt);
      const auto cfg = config(codec, 0.0f, 32);
      const auto ref = test::encode(cfg, src, Impl::REFERENCE);
      ASSERT_EQ(ref.rc, KVXFER_SUCCESS);
      for (Impl impl : fast_impls()) {
        const auto f = test::encode(cfg, src, impl, {3, KVXFER_KV_VALUE, 1000, 42}, 2);
        ASSERT_EQ(test::first_diff(ref.anchor, f.anchor), -1) << codec << " " << dt;
        ASSERT_EQ(test::first_diff(ref.residual, f.residual), -1) << codec << " " << dt;
        for (bool full : {false, true}) {
          PagedBuffer a(200, 1024, dt, 16), b(200, 1024, dt, 16);
          ASSERT_EQ(decode_page(
                        ref.anchor.data(), ref.anchor.size(), full ? ref.residual.data() : nullptr,
                        full ? ref.residual.size() : 0, nullptr, &a.layout, Impl::REFERENCE),
                    KVXFER_SUCCESS);
          ASSERT_EQ(decode_page(ref.anchor.data(), ref.anchor.size(),
                                full ? ref.residual.data() : nullptr,
                                full ? ref.residual.size() : 0, nullptr, &b.layout, impl, 2),
                    KVXFER_SUCCESS);
          ASSERT_EQ(test::first_diff(a.bytes(), b.bytes()), -1) << codec << " " << dt << full;
        }
      }
    }
}

// The AVX-512 path against the reference, bit for bit: the nibble kernels'
// vector part and tails (H = 2 .. 1024), every source and output dtype, the
// linear, nested and alpha-law codes, binary32 metadata, sink rows.
TEST(PageCodec, Avx512IsByteIdenticalToReferenceOnEveryShapeAndDtype) {
  if (!fast::cpu_has_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  struct Case {
    kvxfer_codec_t codec;
    float alpha;
    int anchor_bits;
  };
  const Case cases[] = {{KVXFER_CODEC_LYNX, 0.0f, 4}, {KVXFER_CODEC_LYNX, 20.0f, 4},
                        {KVXFER_CODEC_INT8, 0.0f, 4}, {KVXFER_CODEC_INT4, 0.0f, 4},
                        {KVXFER_CODEC_LYNX, 0.0f, 3}, {KVXFER_CODEC_INT8, 0.0f, 5}};
  const kvxfer_dtype_t dts[] = {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32};
  uint64_t seed = 77;
  for (const Case& k : cases)
    for (int32_t H : {2, 30, 32, 70, 96, 160, 1024})
      for (kvxfer_dtype_t dt : dts)
        for (int variant = 0; variant < 3; ++variant) {  // KV-like; edges; edges past fp16
          if (variant == 2 && dt == KVXFER_DTYPE_FP16) continue;
          const int64_t T = H >= 1024 ? 40 : 67;
          PagedBuffer src(T, H, dt, 16);
          if (variant == 0)
            test::fill_kv_like(&src, seed++);
          else
            fill_edges(&src, *get_codebook(k.codec, k.alpha, k.anchor_bits, nullptr), variant == 2,
                       seed++);
          auto cfg = config(k.codec, k.alpha, 16, k.anchor_bits);
          cfg.sink_tokens = variant == 0 ? 3 : 0;
          const kvxfer_page_id_t id{3, KVXFER_KV_KEY, 0, 42};
          const auto ref = test::encode(cfg, src, Impl::REFERENCE, id);
          ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
          const std::string what = "codec " + std::to_string(k.codec) + " alpha " +
                                   std::to_string(k.alpha) + " A " + std::to_string(k.anchor_bits) +
                                   " H " + std::to_string(H) + " dtype " + std::to_string(dt) +
                                   " variant " + std::to_string(variant);
          const auto f = test::encode(cfg, src, Impl::AVX512, id);
          ASSERT_EQ(f.rc, KVXFER_SUCCESS) << last_error();
          ASSERT_EQ(test::first_diff(ref.anchor, f.anchor), -1) << what;
          ASSERT_EQ(test::first_diff(ref.residual, f.residual), -1) << what;
          for (bool full : {false, true})
            for (kvxfer_dtype_t odt : dts) {
              PagedBuffer a(T, H, odt, 16), b(T, H, odt, 16);
              for (auto [out, impl] : {std::pair{&a, Impl::REFERENCE}, {&b, Impl::AVX512}})
                ASSERT_EQ(decode_page(ref.anchor.data(), ref.anchor.size(),
                                      full ? ref.residual.data() : nullptr,
                                      full ? ref.residual.size() : 0, &id, &out->layout, impl, 1),
                          KVXFER_SUCCESS)
                    << last_error();
              ASSERT_EQ(test::first_diff(a.bytes(), b.bytes()), -1)
                  << what << (full ? " full" : " anchor") << " decode to " << odt;
            }
        }
}

// Pages of fast::kStreamStoreBytes of values or more (the engine's 512 KiB,
// and 4 MiB): the AVX-512 decode, and the BF16 passthrough copy, write
// 64-byte aligned rows with non-temporal stores.
TEST(PageCodec, Avx512LargeAlignedPageDecodesAsTheReference) {
  if (!fast::cpu_has_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  for (const int64_t T : {256, 2048}) {
    const int32_t H = 1024;
    ASSERT_GE(static_cast<uint64_t>(T) * H * 2, fast::kStreamStoreBytes);
    PagedBuffer src(T, H, KVXFER_DTYPE_BF16, 16);
    test::fill_kv_like(&src, 99);
    const size_t bytes = static_cast<size_t>(T) * H * 2;
    struct Free {
      void operator()(void* p) const { std::free(p); }
    };
    std::unique_ptr<uint8_t, Free> a(static_cast<uint8_t*>(std::aligned_alloc(64, bytes))),
        b(static_cast<uint8_t*>(std::aligned_alloc(64, bytes)));
    void* pa = a.get();
    void* pb = b.get();
    kvxfer_page_layout_t la{&pa, 1, static_cast<int32_t>(T), H, 0, T, H, KVXFER_DTYPE_BF16};
    kvxfer_page_layout_t lb = la;
    lb.blocks = &pb;
    for (kvxfer_codec_t codec :
         {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4, KVXFER_CODEC_BF16}) {
      const auto e = test::encode(config(codec, 0.0f, 32), src, Impl::AVX512);
      ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
      for (bool full : {false, true}) {
        if (full && e.residual.empty()) continue;  // BF16: one section
        std::memset(a.get(), 0x5A, bytes);
        std::memset(b.get(), 0xA5, bytes);
        for (auto [lay, impl] : {std::pair{&la, Impl::REFERENCE}, {&lb, Impl::AVX512}})
          ASSERT_EQ(
              decode_page(e.anchor.data(), e.anchor.size(), full ? e.residual.data() : nullptr,
                          full ? e.residual.size() : 0, nullptr, lay, impl, 1),
              KVXFER_SUCCESS)
              << last_error();
        ASSERT_EQ(std::memcmp(a.get(), b.get(), bytes), 0)
            << codec << (full ? " full" : " anchor") << " T " << T;
        if (codec == KVXFER_CODEC_BF16) {  // passthrough: the source's bytes
          const std::vector<uint8_t> want = src.bytes();
          ASSERT_EQ(std::memcmp(a.get(), want.data(), bytes), 0);
        }
      }
    }
  }
}

// An anchor table value that is subnormal (a hostile but valid section: it
// lies in its anchor's bin) makes subnormal values, which VCVTNE2PS2BF16
// would flush to zero: the AVX-512 decode must round them as the reference.
TEST(PageCodec, Avx512SubnormalAnchorTableValuesDecodeAsTheReference) {
  if (!fast::cpu_has_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  const CodebookRef cb = get_codebook(KVXFER_CODEC_INT8, 0.0f, 4, nullptr);
  const int64_t T = 64;
  const int32_t H = 64;
  // m = 0 and d = 1 in every chunk and channel; the other rows near 0.
  PagedBuffer src(T, H, KVXFER_DTYPE_BF16, 16);
  for (int64_t t = 0; t < T; ++t)
    for (int32_t c = 0; c < H; ++c)
      src.set(t, c, t % 4 == 0 ? -1.0f : t % 4 == 1 ? 1.0f : (c % 2 ? -0.03f : 0.03f));
  const auto e = test::encode(config(KVXFER_CODEC_INT8, 0.0f, 16), src, Impl::REFERENCE);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
  PageHeader h;
  ASSERT_EQ(parse_section(e.anchor.data(), e.anchor.size(), &h), KVXFER_SUCCESS);
  ASSERT_EQ(h.flags & FLAG_META_FP32, 0);
  int hits = 0;
  std::vector<uint8_t> bad = e.anchor;
  for (unsigned a = 0; a < 16; ++a)
    for (float z : {1e-40f, -1e-40f})
      if (z >= cb->anchor_lo[a] && z <= cb->anchor_hi[a]) {
        put_f32_le(bad.data() + kHeaderBytes + payload_sizes(h).table_offset() + 4 * a, z);
        ++hits;
        break;
      }
  ASSERT_GT(hits, 0) << "no anchor bin holds a subnormal value";
  seal_section(bad.data());
  for (kvxfer_dtype_t odt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
    PagedBuffer a(T, H, odt, 16), b(T, H, odt, 16);
    for (auto [out, impl] : {std::pair{&a, Impl::REFERENCE}, {&b, Impl::AVX512}})
      ASSERT_EQ(decode_page(bad.data(), bad.size(), nullptr, 0, nullptr, &out->layout, impl, 1),
                KVXFER_SUCCESS)
          << last_error();
    ASSERT_EQ(test::first_diff(a.bytes(), b.bytes()), -1) << "to " << odt;
    if (odt == KVXFER_DTYPE_BF16) {  // the test reaches a subnormal output
      bool subnormal = false;
      for (int64_t t = 0; t < T; ++t)
        for (int32_t c = 0; c < H; ++c) {
          const float x = a.get(t, c);
          subnormal |= x != 0.0f && std::fabs(x) < std::numeric_limits<float>::min();
        }
      EXPECT_TRUE(subnormal);
    }
  }
}

// Every 8-bit code of the nested and uniform codebooks, decoded from each
// position of a 32-channel vector: the AVX-512 formulas against the table,
// with binary16 metadata (scale 1) and binary32 metadata (scale 2^20, beyond
// binary16's range).
TEST(PageCodec, Avx512DecodesEveryCodeAsTheReference) {
  if (!fast::cpu_has_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  for (const float scale : {1.0f, 0x1p20f})
    for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8}) {
      // 512 rows of 64 channels whose chunk ranges are [-scale, scale] (rows 0
      // and 1 of each chunk: m = 0, d = scale), the rest of channel c in row t
      // scale times the z of code (t + 9c) % 256 (within [-1, 1]).
      const CodebookRef cb = get_codebook(codec, 0.0f, 4, nullptr);
      const int64_t T = 512;
      const int32_t H = 64;
      auto code = [](int64_t t, int32_t c) { return static_cast<int>((t + 9 * c) % 256); };
      PagedBuffer src(T, H, KVXFER_DTYPE_FP32, 16);
      for (int64_t t = 0; t < T; ++t)
        for (int32_t c = 0; c < H; ++c)
          src.set(
              t, c,
              scale * (t % 16 < 2 ? (t % 2 ? 1.0f : -1.0f)
                                  : std::min(1.0f, std::max(-1.0f, cb->recon_full[code(t, c)]))));
      const auto cfg = config(codec, 0.0f, 16, 4);
      const auto ref = test::encode(cfg, src, Impl::REFERENCE);
      ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
      kvxfer_page_info_t info;
      ASSERT_EQ(inspect_section(ref.anchor.data(), ref.anchor.size(), &info), KVXFER_SUCCESS);
      ASSERT_EQ(info.meta_fp32, scale > 1.0f ? 1 : 0);
      for (kvxfer_dtype_t odt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
        PagedBuffer a(T, H, odt, 16), b(T, H, odt, 16);
        for (auto [out, impl] : {std::pair{&a, Impl::REFERENCE}, {&b, Impl::AVX512}})
          ASSERT_EQ(decode_page(ref.anchor.data(), ref.anchor.size(), ref.residual.data(),
                                ref.residual.size(), nullptr, &out->layout, impl, 1),
                    KVXFER_SUCCESS)
              << last_error();
        ASSERT_EQ(test::first_diff(a.bytes(), b.bytes()), -1) << codec << " to " << odt;
        // Every code occurred: each element decoded to its own code's z.
        if (odt == KVXFER_DTYPE_FP32) {
          for (int64_t t = 0; t < T; ++t)
            for (int32_t c = 0; c < H && t % 16 >= 2; ++c)
              ASSERT_EQ(a.get(t, c), scale * cb->recon_full[code(t, c)])
                  << codec << " t " << t << " c " << c;
        }
      }
    }
}

TEST(PageCodec, LargePageManyThreadsMatchesReference) {
  const auto cfg = config(KVXFER_CODEC_LYNX, 20.0f, 32);
  PagedBuffer src(1000, 256, KVXFER_DTYPE_BF16, 16, 0, 0);
  test::fill_kv_like(&src, 99);
  const auto ref = test::encode(cfg, src, Impl::REFERENCE);
  for (Impl impl : fast_impls()) {
    for (int threads : {1, 2, 3}) {
      const auto f = test::encode(cfg, src, impl, {3, KVXFER_KV_VALUE, 1000, 42}, threads);
      ASSERT_EQ(test::first_diff(ref.anchor, f.anchor), -1) << threads;
      ASSERT_EQ(test::first_diff(ref.residual, f.residual), -1) << threads;
    }
  }
}

TEST(PageCodec, Fp16MetadataWhenRangeFitsAndBitsPerElement) {
  const auto cfg = config(KVXFER_CODEC_LYNX, 20.0f, 32);
  PagedBuffer src(64, 128, KVXFER_DTYPE_BF16);
  test::fill_kv_like(&src, 5);
  const auto e = test::encode(cfg, src, Impl::AUTO);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS);
  // 80-byte header + 2 chunks x 128 channels x 2 x fp16 + 64*128 4-bit anchors
  // + the 16-entry float32 anchor table.
  EXPECT_EQ(e.anchor.size(), 80u + 2 * 128 * 4 + 64 * 128 / 2 + 16 * 4);
  EXPECT_EQ(e.residual.size(), 80u + 64 * 128 / 2);
}

TEST(PageCodec, BF16PassthroughIsLosslessForBf16Input) {
  const auto cfg = config(KVXFER_CODEC_BF16);
  PagedBuffer src(45, 20, KVXFER_DTYPE_BF16, 8);
  test::fill_kv_like(&src, 11);
  const auto e = test::encode(cfg, src, Impl::AUTO);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS);
  EXPECT_EQ(e.anchor.size(), 80u + 45 * 20 * 2);
  EXPECT_EQ(e.residual.size(), 80u);
  PagedBuffer out(45, 20, KVXFER_DTYPE_BF16, 3, 1, 0);
  ASSERT_EQ(decode_page(e.anchor.data(), e.anchor.size(), e.residual.data(), e.residual.size(),
                        nullptr, &out.layout),
            KVXFER_SUCCESS);
  EXPECT_EQ(out.bytes(), src.bytes());
}

// ---------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------

TEST(PageCodecBadInput, NaNAndInfAreErrorsNamingLayerTokenChannel) {
  for (kvxfer_codec_t codec :
       {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4, KVXFER_CODEC_BF16})
    for (float bad :
         {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()})
      for (Impl impl : {Impl::REFERENCE, Impl::SCALAR, Impl::AUTO}) {
        PagedBuffer src(50, 16, KVXFER_DTYPE_FP32);
        test::fill_kv_like(&src, 3);
        src.set(41, 7, bad);
        const auto e = test::encode(config(codec), src, impl, {6, KVXFER_KV_KEY, 200, 0});
        ASSERT_EQ(e.rc, KVXFER_ERR_NONFINITE);
        const std::string msg = last_error();
        EXPECT_NE(msg.find(std::isnan(bad) ? "NaN" : "Inf"), std::string::npos) << msg;
        EXPECT_NE(msg.find("layer 6 K, token 241, channel 7"), std::string::npos) << msg;
        EXPECT_EQ(e.anchor.size(), 0u);
      }
}

// BF16 passthrough of bf16 input copies and scans in one pass
// (pack_bf16_scanning): the first non-finite value in token, channel order
// is named, and the RAW policy keeps the bytes, flagged raw.
TEST(PageCodecBadInput, Bf16PassthroughOfBf16InputFindsTheFirstNonFinite) {
  // H = 16 and the tail of H = 88 take the scalar end of the AVX2 row copy;
  // 64 and the head of 88 its vectors of 16 channels, two per step.  Some
  // cases have the Inf alone, so that no other value gives the page away.
  const struct {
    int32_t H, c;
    bool nan_too;
  } cases[] = {{16, 7, true}, {64, 7, true}, {64, 20, false}, {88, 50, false}, {88, 80, false}};
  for (const auto& k : cases)
    for (kvxfer_nonfinite_policy_t policy : {KVXFER_NONFINITE_ERROR, KVXFER_NONFINITE_RAW})
      for (Impl impl : {Impl::REFERENCE, Impl::AUTO}) {
        SCOPED_TRACE(testing::Message() << "H " << k.H << " channel " << k.c);
        auto cfg = config(KVXFER_CODEC_BF16);
        cfg.nonfinite = policy;
        PagedBuffer src(50, k.H, KVXFER_DTYPE_BF16, 8);
        test::fill_kv_like(&src, 3);
        const auto clean = test::encode(cfg, src, impl, {6, KVXFER_KV_KEY, 200, 0});
        ASSERT_EQ(clean.rc, KVXFER_SUCCESS);
        kvxfer_page_info_t info;
        ASSERT_EQ(inspect_section(clean.anchor.data(), clean.anchor.size(), &info), KVXFER_SUCCESS);
        EXPECT_EQ(info.raw_fallback, 0);
        src.set(41, k.c, -std::numeric_limits<float>::infinity());
        if (k.nan_too) src.set(44, 2, std::numeric_limits<float>::quiet_NaN());
        const auto e = test::encode(cfg, src, impl, {6, KVXFER_KV_KEY, 200, 0});
        if (policy == KVXFER_NONFINITE_ERROR) {
          ASSERT_EQ(e.rc, KVXFER_ERR_NONFINITE);
          const std::string msg = last_error();
          const std::string want = "Inf at layer 6 K, token 241, channel " + std::to_string(k.c);
          EXPECT_NE(msg.find(want), std::string::npos) << msg;
          EXPECT_EQ(e.anchor.size(), 0u);
          continue;
        }
        ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
        ASSERT_EQ(inspect_section(e.anchor.data(), e.anchor.size(), &info), KVXFER_SUCCESS);
        EXPECT_EQ(info.raw_fallback, 1);
        EXPECT_EQ(e.anchor.size(), 80u + 50 * static_cast<size_t>(k.H) * 2);
        PagedBuffer out(50, k.H, KVXFER_DTYPE_BF16, 3, 1, 0);
        ASSERT_EQ(decode_page(e.anchor.data(), e.anchor.size(), e.residual.data(),
                              e.residual.size(), nullptr, &out.layout),
                  KVXFER_SUCCESS);
        EXPECT_EQ(out.bytes(), src.bytes());
      }
}

TEST(PageCodecBadInput, NonFiniteRawFallbackIsLossless) {
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32}) {
    auto cfg = config(KVXFER_CODEC_LYNX);
    cfg.nonfinite = KVXFER_NONFINITE_RAW;
    PagedBuffer src(40, 12, dt);
    test::fill_kv_like(&src, 4);
    src.set(3, 2, std::numeric_limits<float>::quiet_NaN());
    src.set(39, 11, -std::numeric_limits<float>::infinity());
    const auto e = test::encode(cfg, src, Impl::AUTO);
    ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
    kvxfer_page_info_t info;
    ASSERT_EQ(inspect_section(e.anchor.data(), e.anchor.size(), &info), KVXFER_SUCCESS);
    EXPECT_EQ(info.raw_fallback, 1);
    PagedBuffer out(40, 12, dt, 16, 0, 0);
    // Anchor-only already restores a raw page completely.
    ASSERT_EQ(decode_page(e.anchor.data(), e.anchor.size(), nullptr, 0, nullptr, &out.layout),
              KVXFER_SUCCESS);
    EXPECT_EQ(out.bytes(), src.bytes());
    ASSERT_EQ(decode_page(e.anchor.data(), e.anchor.size(), e.residual.data(), e.residual.size(),
                          nullptr, &out.layout),
              KVXFER_SUCCESS);
    EXPECT_EQ(out.bytes(), src.bytes());
  }
}

TEST(PageCodecBadInput, ConstantChannelsAndHugeAndDenormalValues) {
  struct Case {
    const char* name;
    float base, spread;
    bool fp32_meta;
  };
  const Case cases[] = {{"constant", 2.5f, 0.0f, false},
                        {"huge", 3e37f, 1e37f, true},
                        {"beyond fp16", 7e4f, 10.0f, true},
                        {"denormal", 0.0f, 1e-40f, false},
                        {"tiny normal", 1e-30f, 1e-31f, false}};
  for (const auto& k : cases)
    for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4}) {
      PagedBuffer src(40, 9, KVXFER_DTYPE_FP32);
      std::mt19937 rng(1);
      for (int64_t t = 0; t < 40; ++t)
        for (int32_t c = 0; c < 9; ++c)
          src.set(t, c, k.base + k.spread * (static_cast<float>(rng() % 1000) / 500.0f - 1.0f));
      const auto cfg = config(codec, 100.0f);
      const auto e = test::encode(cfg, src, Impl::REFERENCE);
      ASSERT_EQ(e.rc, KVXFER_SUCCESS) << k.name << ": " << last_error();
      kvxfer_page_info_t info;
      ASSERT_EQ(inspect_section(e.anchor.data(), e.anchor.size(), &info), KVXFER_SUCCESS);
      EXPECT_EQ(info.meta_fp32, k.fp32_meta ? 1 : 0) << k.name;
      for (Impl impl : fast_impls()) {
        const auto f = test::encode(cfg, src, impl);
        ASSERT_EQ(test::first_diff(e.anchor, f.anchor), -1) << k.name;
        ASSERT_EQ(test::first_diff(e.residual, f.residual), -1) << k.name;
      }
      for (bool full : {false, true}) {
        PagedBuffer out(40, 9, KVXFER_DTYPE_FP32);
        ASSERT_EQ(decode_page(e.anchor.data(), e.anchor.size(), full ? e.residual.data() : nullptr,
                              full ? e.residual.size() : 0, nullptr, &out.layout),
                  KVXFER_SUCCESS);
        expect_within_bound(src, out, e.anchor, full, k.name);
        if (k.spread == 0.0f) {
          EXPECT_EQ(out.bytes(), src.bytes()) << "constant channel must be exact";
        }
      }
    }
}

TEST(PageCodecBadInput, EmptyAndShortPages) {
  const auto cfg = config(KVXFER_CODEC_LYNX, 20.0f, 64);
  // T = 0: a valid, empty page (header-only sections).
  PagedBuffer empty(0, 16, KVXFER_DTYPE_BF16);
  const auto e0 = test::encode(cfg, empty, Impl::AUTO);
  ASSERT_EQ(e0.rc, KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(e0.anchor.size(), 80u + 16 * 4);  // header + anchor table (bin centres)
  EXPECT_EQ(e0.residual.size(), 80u);
  PagedBuffer out0(0, 16, KVXFER_DTYPE_BF16);
  EXPECT_EQ(decode_page(e0.anchor.data(), e0.anchor.size(), e0.residual.data(), e0.residual.size(),
                        nullptr, &out0.layout),
            KVXFER_SUCCESS);
  // T smaller than one chunk.
  PagedBuffer small(5, 16, KVXFER_DTYPE_BF16);
  test::fill_kv_like(&small, 8);
  const auto e5 = test::encode(cfg, small, Impl::AUTO);
  ASSERT_EQ(e5.rc, KVXFER_SUCCESS);
  PagedBuffer out5(5, 16, KVXFER_DTYPE_BF16);
  ASSERT_EQ(decode_page(e5.anchor.data(), e5.anchor.size(), e5.residual.data(), e5.residual.size(),
                        nullptr, &out5.layout),
            KVXFER_SUCCESS);
  expect_within_bound(small, out5, e5.anchor, true, "T<C");
}

TEST(PageCodecBadInput, WrongDtypeStrideBlocksAndBuffers) {
  const auto cfg = config(KVXFER_CODEC_LYNX);
  PagedBuffer src(40, 16, KVXFER_DTYPE_BF16);
  test::fill_kv_like(&src, 2);
  auto expect_invalid = [&](kvxfer_page_layout_t l, const char* needle) {
    size_t al, rl;
    std::vector<uint8_t> a(1 << 16), r(1 << 16);
    kvxfer_page_id_t id{0, KVXFER_KV_KEY, 0, 0};
    EXPECT_EQ(encode_page(&cfg, &id, &l, a.data(), a.size(), &al, r.data(), r.size(), &rl),
              KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(last_error()).find(needle), std::string::npos) << last_error();
  };
  kvxfer_page_layout_t l = src.layout;
  l.dtype = static_cast<kvxfer_dtype_t>(7);
  expect_invalid(l, "dtype");
  l = src.layout;
  l.row_stride = 15;
  expect_invalid(l, "row_stride");
  l = src.layout;
  l.num_blocks = 2;
  expect_invalid(l, "num_blocks");
  l = src.layout;
  l.block_size = 0;
  expect_invalid(l, "block_size");
  l = src.layout;
  l.num_channels = 0;
  expect_invalid(l, "num_channels");
  l = src.layout;
  std::vector<void*> holes(src.ptrs);
  holes[2] = nullptr;
  l.blocks = holes.data();
  expect_invalid(l, "block 2 is NULL");

  // Output buffers one byte too small.
  size_t amax, rmax, al = 7, rl = 7;
  ASSERT_EQ(max_sizes(&cfg, 40, 16, &amax, &rmax), KVXFER_SUCCESS);
  const auto ok = test::encode(cfg, src, Impl::AUTO);
  std::vector<uint8_t> a(amax), r(rmax);
  kvxfer_page_id_t id{0, KVXFER_KV_KEY, 0, 0};
  EXPECT_EQ(
      encode_page(&cfg, &id, &src.layout, a.data(), ok.anchor.size() - 1, &al, r.data(), rmax, &rl),
      KVXFER_ERR_BUFFER_TOO_SMALL);
  EXPECT_EQ(al, 0u);
  EXPECT_EQ(encode_page(&cfg, &id, &src.layout, a.data(), amax, &al, r.data(),
                        ok.residual.size() - 1, &rl),
            KVXFER_ERR_BUFFER_TOO_SMALL);

  // Destination of the wrong shape.
  PagedBuffer wrong(41, 16, KVXFER_DTYPE_BF16);
  EXPECT_EQ(decode_page(ok.anchor.data(), ok.anchor.size(), nullptr, 0, nullptr, &wrong.layout),
            KVXFER_ERR_MISMATCH);
  PagedBuffer wrongh(40, 17, KVXFER_DTYPE_BF16);
  EXPECT_EQ(decode_page(ok.anchor.data(), ok.anchor.size(), nullptr, 0, nullptr, &wrongh.layout),
            KVXFER_ERR_MISMATCH);
}

TEST(PageCodecBadInput, ExtremeFiniteRangesNeverDecodeToInfinity) {
  // Values at +-FLT_MAX, and ranges ending at FLT_MAX: |m| + d stays finite
  // (or the page is stored raw), so no reconstruction m + d*r overflows.
  const float big = std::numeric_limits<float>::max();
  const float cases[][2] = {{-big, big}, {1e38f, big}, {-big, -1e38f}, {-big, 0.0f}};
  for (const auto& range : cases)
    for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4}) {
      PagedBuffer src(20, 4, KVXFER_DTYPE_FP32);
      for (int64_t t = 0; t < 20; ++t)
        for (int32_t c = 0; c < 4; ++c)
          src.set(t, c,
                  t % 3 == 0   ? range[0]
                  : t % 3 == 1 ? range[1]
                               : range[0] / 2 + range[1] / 2);
      const auto e = test::encode(config(codec), src, Impl::AUTO);
      ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
      for (bool full : {false, true}) {
        PagedBuffer out(20, 4, KVXFER_DTYPE_FP32);
        ASSERT_EQ(decode_page(e.anchor.data(), e.anchor.size(), full ? e.residual.data() : nullptr,
                              full ? e.residual.size() : 0, nullptr, &out.layout),
                  KVXFER_SUCCESS);
        for (int64_t t = 0; t < 20; ++t)
          for (int32_t c = 0; c < 4; ++c)
            ASSERT_TRUE(std::isfinite(out.get(t, c))) << "token " << t << " range " << range[0];
      }
    }
}

TEST(PageCodecBadInput, ChecksumValidHugeMetadataNeverDecodesToInfinity) {
  // A hostile sender can reseal a section whose metadata is finite but whose
  // reconstructions m + d*r overflow float: the decoder clamps them to
  // +-FLT_MAX, so no output is infinite.
  PagedBuffer src(20, 4, KVXFER_DTYPE_FP32);
  test::fill_kv_like(&src, 3, 1e6f);  // beyond binary16: fp32 metadata
  const auto e = test::encode(config(KVXFER_CODEC_LYNX), src, Impl::AUTO);
  ASSERT_EQ(e.rc, KVXFER_SUCCESS);
  kvxfer_page_info_t info;
  ASSERT_EQ(inspect_section(e.anchor.data(), e.anchor.size(), &info), KVXFER_SUCCESS);
  ASSERT_EQ(info.meta_fp32, 1);
  std::vector<uint8_t> bad = e.anchor;
  const float huge = 3e38f;
  uint8_t le[4];
  put_f32_le(le, huge);
  for (size_t i = 0; i < 8; ++i)  // chunk 0, channels 0..3: m = d = 3e38
    for (size_t k = 0; k < 4; ++k) bad.at(kHeaderBytes + 4 * i + k) = le[k];
  seal_section(bad.data());
  for (Impl impl : {Impl::REFERENCE, Impl::SCALAR, Impl::AUTO}) {
    PagedBuffer out(20, 4, KVXFER_DTYPE_FP32);
    ASSERT_EQ(decode_page(bad.data(), bad.size(), nullptr, 0, nullptr, &out.layout, impl),
              KVXFER_SUCCESS);
    int clamped = 0;
    for (int64_t t = 0; t < 20; ++t)
      for (int32_t c = 0; c < 4; ++c) {
        ASSERT_TRUE(std::isfinite(out.get(t, c))) << "token " << t << " channel " << c;
        clamped += out.get(t, c) == std::numeric_limits<float>::max();
      }
    EXPECT_GT(clamped, 0) << "the test must reach the clamp";
  }
}

TEST(PageCodecBadInput, EncodeArgumentsCheckedBeforeAnyOutput) {
  const auto cfg = config(KVXFER_CODEC_LYNX);
  PagedBuffer src(40, 16, KVXFER_DTYPE_BF16);
  test::fill_kv_like(&src, 2);
  std::vector<uint8_t> a(1 << 16), r(1 << 16);
  size_t al = 7, rl = 7;
  kvxfer_page_id_t id{0, KVXFER_KV_KEY, 0, 0};
  // Lengths read 0 after any failure, even the first check.
  EXPECT_EQ(
      encode_page(nullptr, &id, &src.layout, a.data(), a.size(), &al, r.data(), r.size(), &rl),
      KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(al, 0u);
  EXPECT_EQ(rl, 0u);
  // One buffer for both sections.
  EXPECT_EQ(encode_page(&cfg, &id, &src.layout, a.data(), a.size(), &al, a.data(), a.size(), &rl),
            KVXFER_ERR_INVALID_ARGUMENT);
  // token_begin + T must not overflow (error messages name absolute tokens).
  id.token_begin = std::numeric_limits<int64_t>::max() - 10;
  EXPECT_EQ(encode_page(&cfg, &id, &src.layout, a.data(), a.size(), &al, r.data(), r.size(), &rl),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("overflows"), std::string::npos) << last_error();
  // A C caller may store any int in the enum field; it is refused, not loaded
  // as the enum (undefined behaviour, which the UBSan build would report).
  id.token_begin = 0;
  id.kind = static_cast<kvxfer_kv_kind_t>(7);
  EXPECT_EQ(encode_page(&cfg, &id, &src.layout, a.data(), a.size(), &al, r.data(), r.size(), &rl),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("bad K/V kind 7"), std::string::npos) << last_error();
}

TEST(PageCodecBadInput, InvalidConfigs) {
  PagedBuffer src(8, 8, KVXFER_DTYPE_BF16);
  auto bad = [&](kvxfer_codec_config_t c) { return test::encode(c, src, Impl::AUTO).rc; };
  auto c = config(KVXFER_CODEC_LYNX);
  c.chunk_tokens = 48;
  EXPECT_EQ(bad(c), KVXFER_ERR_INVALID_ARGUMENT);
  c = config(KVXFER_CODEC_LYNX);
  c.alpha = -2;
  EXPECT_EQ(bad(c), KVXFER_ERR_INVALID_ARGUMENT);
  c.alpha = 1000.5f;
  EXPECT_EQ(bad(c), KVXFER_ERR_INVALID_ARGUMENT);
  c.alpha = KVXFER_ALPHA_AUTO;  // the one negative value that is valid
  EXPECT_EQ(bad(c), KVXFER_SUCCESS);
  c = config(KVXFER_CODEC_INT8);
  c.alpha = KVXFER_ALPHA_AUTO;  // alpha is ignored by the uniform codecs
  EXPECT_EQ(bad(c), KVXFER_SUCCESS);
  c = config(KVXFER_CODEC_LYNX);
  c.anchor_bits = 7;
  EXPECT_EQ(bad(c), KVXFER_ERR_INVALID_ARGUMENT);
  c = config(KVXFER_CODEC_LYNX);
  c.magic = 0;
  EXPECT_EQ(bad(c), KVXFER_ERR_INVALID_ARGUMENT);
  c = config(KVXFER_CODEC_LYNX);
  c.size = 8;
  EXPECT_EQ(bad(c), KVXFER_ERR_INVALID_ARGUMENT);
  c = config(KVXFER_CODEC_LYNX);
  c.codec = static_cast<kvxfer_codec_t>(9);
  EXPECT_EQ(bad(c), KVXFER_ERR_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// alpha = auto (docs/FORMAT.md section 2.6)
// ---------------------------------------------------------------------------

struct PageErrors {
  double full = 0, anchor = 0;
};

// Squared error of pages encoded with `alpha`, through the real codec, over
// the rows of the calibration sample (FORMAT.md 2.6: rows t % 16 == 0; these pages have
// at most 8 chunks, so every chunk is sampled).
PageErrors page_errors(const std::vector<PagedBuffer*>& pages, float alpha) {
  PageErrors e;
  for (const PagedBuffer* p : pages) {
    const auto enc = test::encode(config(KVXFER_CODEC_LYNX, alpha, 32), *p, Impl::AUTO);
    EXPECT_EQ(enc.rc, KVXFER_SUCCESS);
    for (bool full : {false, true}) {
      PagedBuffer out(p->layout.num_tokens, p->layout.num_channels, KVXFER_DTYPE_FP32);
      EXPECT_EQ(
          decode_page(enc.anchor.data(), enc.anchor.size(), full ? enc.residual.data() : nullptr,
                      full ? enc.residual.size() : 0, nullptr, &out.layout),
          KVXFER_SUCCESS);
      for (int64_t t = 0; t < p->layout.num_tokens; ++t)
        for (int32_t c = 0; c < p->layout.num_channels && t % 16 == 0; ++c) {
          const double d = static_cast<double>(p->get(t, c)) - out.get(t, c);
          (full ? e.full : e.anchor) += d * d;
        }
    }
  }
  return e;
}

// Two fixed page sets: KV-like Laplacian data, and symmetric sparse spikes
// (each chunk-channel holds one +50 and one -50, the rest ~N(0, 3)), where
// the bulk sits at z ~ 0 and companding pays.
std::vector<std::unique_ptr<PagedBuffer>> calibration_set(bool spiky) {
  std::vector<std::unique_ptr<PagedBuffer>> v;
  std::mt19937 rng(spiky ? 17 : 23);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int i = 0; i < 3; ++i) {
    // 256 tokens = 8 chunks of 32: the calibration sample is the whole page.
    auto p = std::make_unique<PagedBuffer>(256, 24, KVXFER_DTYPE_FP32);
    if (spiky) {
      for (int64_t t = 0; t < 256; ++t)
        for (int32_t c = 0; c < 24; ++c)
          p->set(t, c,
                 (t % 32 == c % 32)          ? 50.0f
                 : (t % 32 == (c + 16) % 32) ? -50.0f
                                             : 3.0f * n(rng));
    } else {
      test::fill_kv_like(p.get(), 100 + i);
    }
    v.push_back(std::move(p));
  }
  return v;
}

TEST(AlphaAuto, RuleIsTheDocumentedArgminAndNeverWorseThanLinear) {
  for (bool spiky : {false, true}) {
    auto set = calibration_set(spiky);
    std::vector<kvxfer_page_layout_t> layouts;
    std::vector<PagedBuffer*> pages;
    for (auto& p : set) {
      layouts.push_back(p->layout);
      pages.push_back(p.get());
    }
    auto cfg = config(KVXFER_CODEC_LYNX, KVXFER_ALPHA_AUTO, 32);
    float chosen = -5;
    std::vector<CalibrationError> errs;
    ASSERT_EQ(
        calibrate_alpha(&cfg, layouts.data(), static_cast<int32_t>(layouts.size()), &chosen, &errs),
        KVXFER_SUCCESS);
    // The calibration errors are the real codec's errors on these pages.
    for (const auto& ce : errs) {
      const PageErrors pe = page_errors(pages, ce.alpha);
      EXPECT_NEAR(ce.full, pe.full, 1e-6 * pe.full + 1e-12) << ce.alpha;
      EXPECT_NEAR(ce.anchor, pe.anchor, 1e-6 * pe.anchor + 1e-12) << ce.alpha;
    }
    // Brute force of the documented rule.
    size_t best = 0;
    for (size_t i = 1; i < errs.size(); ++i)
      if (errs[i].full <= errs[0].full && errs[i].anchor < errs[best].anchor) best = i;
    EXPECT_EQ(chosen, errs[best].alpha);
    // No worse than alpha = 0 at either precision; never dominated by alpha = 255.
    const PageErrors a = page_errors(pages, chosen), z = page_errors(pages, 0.0f),
                     m = page_errors(pages, 255.0f);
    EXPECT_LE(a.full, z.full);
    EXPECT_LE(a.anchor, z.anchor);
    EXPECT_FALSE(m.full < a.full && m.anchor < a.anchor);
    if (spiky) {
      EXPECT_GT(chosen, 0.0f) << "companding must win on sparse spikes";
      EXPECT_LT(a.anchor, 0.5 * z.anchor);
    }
    // Encoding with alpha = auto records the chosen value in the header.
    const auto enc = test::encode(cfg, *set[0], Impl::AUTO);
    ASSERT_EQ(enc.rc, KVXFER_SUCCESS);
    kvxfer_page_info_t info;
    ASSERT_EQ(inspect_section(enc.anchor.data(), enc.anchor.size(), &info), KVXFER_SUCCESS);
    float single = -5;
    ASSERT_EQ(calibrate_alpha(&cfg, &set[0]->layout, 1, &single), KVXFER_SUCCESS);
    EXPECT_EQ(info.alpha, single);
  }
}

TEST(AlphaAuto, RejectsBadCalibrationInput) {
  auto cfg = config(KVXFER_CODEC_INT8);
  PagedBuffer p(8, 8, KVXFER_DTYPE_BF16);
  float a;
  EXPECT_EQ(calibrate_alpha(&cfg, &p.layout, 1, &a), KVXFER_ERR_INVALID_ARGUMENT);
  cfg = config(KVXFER_CODEC_LYNX);
  EXPECT_EQ(calibrate_alpha(&cfg, &p.layout, 0, &a), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(calibrate_alpha(&cfg, nullptr, 1, &a), KVXFER_ERR_INVALID_ARGUMENT);
  kvxfer_page_layout_t bad = p.layout;
  bad.row_stride = 1;
  EXPECT_EQ(calibrate_alpha(&cfg, &bad, 1, &a), KVXFER_ERR_INVALID_ARGUMENT);
}

// Attention sinks (docs/FORMAT.md 2.7): the rows of tokens at positions <
// sink_tokens decode exactly at anchor and full precision, on every path;
// the other rows are what they are without sinks; the wire holds exactly
// 2 bytes per channel per sink row after the 8-aligned end of the table.
// Sink rows travel exactly and do not widen the ranges of their chunk
// (FORMAT.md 2.7): every other row decodes as in a page without sinks whose
// sink rows of a mixed chunk are copies of that chunk's first other row
// (which sets the same ranges), on every CPU path, bit for bit.
TEST(PageCodec, SinkRowsDecodeExactlyOnEveryPath) {
  const int64_t T = 40;
  const int32_t H = 70;
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4})
    for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32})
      for (int64_t begin : {int64_t{0}, int64_t{2}, int64_t{5}, int64_t{64}})
        for (int sinks : {5, 20}) {  // 20: chunk 0 all sinks, chunk 1 mixed
          PagedBuffer src(T, H, dt, 16), same_ranges(T, H, dt, 16);
          for (PagedBuffer* b : {&src, &same_ranges}) {
            fill_kv_like(b, 77 + static_cast<uint64_t>(begin), 0.01f);
            for (int32_t c = 0; c < H; ++c) {  // sinks far outside the other rows' range
              b->set(0, c, 300.0f * (c % 2 ? 1.0f : -1.0f));
              b->set(17, c, -200.0f * (c % 3 ? 1.0f : -1.0f));
            }
          }
          kvxfer_codec_config_t cfg = config(codec, 0.0f, 16);
          cfg.sink_tokens = sinks;
          kvxfer_codec_config_t none = cfg;
          none.sink_tokens = 0;
          const kvxfer_page_id_t id{1, KVXFER_KV_VALUE, begin, 9};
          const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(sinks - begin, T));
          for (int64_t t0 = 0; t0 < T; t0 += 16) {
            // FORMAT.md 2.7, not range_row0: a chunk holding sink rows and
            // others takes its ranges from the others; a sink-only chunk
            // keeps its own.
            const int64_t t1 = std::min<int64_t>(T, t0 + 16);
            const int64_t r0 = rows > t0 && rows < t1 ? rows : t0;
            for (int64_t t = t0; t < r0; ++t)
              for (int32_t c = 0; c < H; ++c) same_ranges.set(t, c, src.get(r0, c));
          }
          const auto ref = test::encode(cfg, src, Impl::REFERENCE, id);
          const auto plain = test::encode(none, src, Impl::REFERENCE, id);
          const auto same = test::encode(cfg, same_ranges, Impl::REFERENCE, id);
          ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << last_error();
          ASSERT_EQ(plain.rc, KVXFER_SUCCESS) << last_error();
          ASSERT_EQ(same.rc, KVXFER_SUCCESS) << last_error();
          const std::string what = "codec " + std::to_string(codec) + " dtype " +
                                   std::to_string(dt) + " begin " + std::to_string(begin) +
                                   " sinks " + std::to_string(sinks);
          // Size: the plain page, padded to 8, plus the rows.
          const size_t plain_payload = plain.anchor.size() - kHeaderBytes;
          const size_t pad = rows > 0 ? (8 - plain_payload % 8) % 8 : 0;
          EXPECT_EQ(ref.anchor.size(),
                    plain.anchor.size() + pad + static_cast<size_t>(rows * H * 2))
              << what;
          EXPECT_EQ(ref.residual.size(), plain.residual.size()) << what;
          for (Impl impl : fast_impls()) {
            const auto e = test::encode(cfg, src, impl, id);
            ASSERT_EQ(e.anchor, ref.anchor) << what;
            ASSERT_EQ(e.residual, ref.residual) << what;
          }
          for (bool full : {false, true}) {
            if (full && codec == KVXFER_CODEC_INT4) continue;
            PagedBuffer out(T, H, KVXFER_DTYPE_FP32, 8), out_plain(T, H, KVXFER_DTYPE_FP32, 8),
                out_same(T, H, KVXFER_DTYPE_FP32, 8);
            ASSERT_EQ(decode_page(ref.anchor.data(), ref.anchor.size(),
                                  full ? ref.residual.data() : nullptr,
                                  full ? ref.residual.size() : 0, &id, &out.layout, Impl::AUTO, 1),
                      KVXFER_SUCCESS)
                << last_error();
            ASSERT_EQ(decode_page(plain.anchor.data(), plain.anchor.size(),
                                  full ? plain.residual.data() : nullptr,
                                  full ? plain.residual.size() : 0, &id, &out_plain.layout,
                                  Impl::AUTO, 1),
                      KVXFER_SUCCESS);
            ASSERT_EQ(
                decode_page(same.anchor.data(), same.anchor.size(),
                            full ? same.residual.data() : nullptr, full ? same.residual.size() : 0,
                            &id, &out_same.layout, Impl::AUTO, 1),
                KVXFER_SUCCESS);
            for (int64_t t = 0; t < T; ++t)
              for (int32_t c = 0; c < H; ++c) {
                // fp32 sources travel as bf16: the BF16 codec's rounding.
                const float want =
                    t < rows ? (dt == KVXFER_DTYPE_FP32 ? bf16_to_f32(f32_to_bf16(src.get(t, c)))
                                                        : src.get(t, c))
                             : out_same.get(t, c);
                ASSERT_EQ(out.get(t, c), want) << what << " full " << full << " t " << t;
              }
            if (rows > 0) {
              EXPECT_NE(out_plain.get(0, 1), out.get(0, 1)) << "the sink changed nothing";
            }
          }
          if (rows > 0 && rows < 16) {  // chunk 0 is mixed: its ranges left the sinks out
            const auto wide = test::encode(none, src, Impl::REFERENCE, id);
            EXPECT_NE(std::vector<uint8_t>(wide.anchor.begin() + kHeaderBytes,
                                           wide.anchor.begin() + kHeaderBytes + 4 * H),
                      std::vector<uint8_t>(ref.anchor.begin() + kHeaderBytes,
                                           ref.anchor.begin() + kHeaderBytes + 4 * H))
                << what << ": chunk 0's metadata still spans the sinks";
          }
        }
}

// The ranges of chunks with sink rows (FORMAT.md 2.7), read from the wire and
// compared with values chosen to be exact in binary16: a chunk of sink rows
// only (sink_rows at a chunk's end) keeps its own range; a mixed chunk takes
// the range of its other rows.
TEST(PageCodec, SinkChunkRangesFollowTheFormatAtChunkBoundaries) {
  const int64_t T = 40;
  const int32_t H = 8;
  for (int sinks : {16, 20, 32})
    for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4}) {
      PagedBuffer src(T, H, KVXFER_DTYPE_FP32, 16);
      for (int64_t t = 0; t < T; ++t)
        for (int32_t c = 0; c < H; ++c) {
          const bool sink = t < sinks;
          // sink rows span [-2, 6] (m 2, d 4); the others [-1, 1] (m 0, d 1)
          const float lo = sink ? -2.0f : -1.0f, hi = sink ? 6.0f : 1.0f;
          src.set(t, c, t % 3 == 0 ? lo : (t % 3 == 1 ? hi : 0.5f * (lo + hi) + 0.25f));
        }
      kvxfer_codec_config_t cfg = config(codec, 0.0f, 16);
      cfg.sink_tokens = sinks;
      const auto e = test::encode(cfg, src, Impl::REFERENCE, {0, KVXFER_KV_KEY, 0, 1});
      ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
      for (int64_t chunk = 0; chunk < 3; ++chunk) {
        const int64_t t0 = chunk * 16, t1 = std::min<int64_t>(T, t0 + 16);
        // a chunk of sink rows only has every row < sinks and so takes their range
        const bool sink_range = t1 <= sinks;
        for (int32_t c = 0; c < H; ++c) {
          const uint8_t* pair = e.anchor.data() + kHeaderBytes + 4 * (chunk * H + c);
          const float m = f16_to_f32(static_cast<uint16_t>(pair[0] | pair[1] << 8));
          const float d = f16_to_f32(static_cast<uint16_t>(pair[2] | pair[3] << 8));
          EXPECT_EQ(m, sink_range ? 2.0f : 0.0f) << "sinks " << sinks << " chunk " << chunk;
          EXPECT_EQ(d, sink_range ? 4.0f : 1.0f) << "sinks " << sinks << " chunk " << chunk;
        }
      }
    }
}

// The anchor table samples rows t % 16 == 0 after the sink rows (FORMAT.md
// 2.4): changing any other row, keeping every range, leaves the table's bytes
// as they were; changing a sampled row moves them.
TEST(PageCodec, AnchorTableSamplesEverySixteenthRowAfterTheSinks) {
  const int64_t T = 64;
  const int32_t H = 64;
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8})
    for (int anchor_bits : {3, 4}) {
      if (codec == KVXFER_CODEC_LYNX && anchor_bits == 4) continue;  // INT4's levels, no table
      kvxfer_codec_config_t cfg = config(codec, 0.0f, 32, anchor_bits);
      const size_t table_bytes = 4u << anchor_bits;
      // values in (-1, 1), rows 1 and 2 of every chunk at -1 and 1: the ranges
      // stay (0, 1) whatever the other rows hold
      auto page = [&](int64_t changed_row) {
        PagedBuffer p(T, H, KVXFER_DTYPE_FP32, 16);
        std::mt19937_64 rng(5);
        std::uniform_real_distribution<float> u(-0.99f, 0.99f);
        for (int64_t t = 0; t < T; ++t)
          for (int32_t c = 0; c < H; ++c) {
            float v = t % 32 == 1 ? -1.0f : (t % 32 == 2 ? 1.0f : u(rng));
            if (t == changed_row) v = -0.5f * v;
            p.set(t, c, v);
          }
        const auto e = test::encode(cfg, p, Impl::REFERENCE, {0, KVXFER_KV_KEY, 0, 1});
        EXPECT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
        // FORMAT.md 4: the table ends the anchor section before the sink rows'
        // padding; the sink row (sink_tokens 1) is H bf16 values.
        const size_t sink_bytes = 2 * H;
        const size_t end = e.anchor.size() - sink_bytes;
        const size_t pad = (end - kHeaderBytes) % 8;  // none for these sizes
        EXPECT_EQ(pad, 0u);
        return std::vector<uint8_t>(e.anchor.begin() + end - table_bytes, e.anchor.begin() + end);
      };
      const auto base = page(-1);
      for (int64_t row : {0, 8, 24, 40, 63})  // row 0 is the sink row
        EXPECT_EQ(page(row), base) << "codec " << codec << " A " << anchor_bits << " row " << row;
      for (int64_t row : {16, 32, 48})
        EXPECT_NE(page(row), base) << "codec " << codec << " A " << anchor_bits << " row " << row;
    }
}

// Token groups (docs/FORMAT.md 2.8): the payload of a V page with
// value_groups TOKEN is, byte for byte, the payload of its transpose encoded
// with channel groups, on every path; decoding it gives the transposed
// decode back, and the sink row stays exact.
TEST(PageCodec, TokenGroupsEncodeTheTransposedPageOnEveryPath) {
  const Shape shapes[] = {{37, 40, 16}, {256, 192, 64}, {5, 8, 4}, {70, 33, 16}};
  for (kvxfer_codec_t codec : {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8, KVXFER_CODEC_INT4})
    for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32})
      for (const Shape& sh : shapes)
        for (int sinks : {0, 1}) {
          const int64_t T = sh.T;
          const int32_t H = sh.H;
          PagedBuffer src(T, H, dt, sh.block);
          fill_kv_like(&src, 500 + static_cast<uint64_t>(T * H), 0.1f);
          PagedBuffer tr(H, static_cast<int32_t>(T), dt, 7);  // the transpose
          for (int64_t t = 0; t < T; ++t)
            for (int32_t c = 0; c < H; ++c) tr.set(c, static_cast<int32_t>(t), src.get(t, c));
          kvxfer_codec_config_t cfg = config(codec, 0.0f, 16);
          cfg.sink_tokens = sinks;
          cfg.value_groups = KVXFER_VALUE_GROUPS_TOKEN;
          kvxfer_codec_config_t chan = cfg;
          chan.value_groups = KVXFER_VALUE_GROUPS_CHANNEL;
          chan.sink_tokens = 0;
          const kvxfer_page_id_t id{2, KVXFER_KV_VALUE, 0, 7};
          const std::string what = "codec " + std::to_string(codec) + " dtype " +
                                   std::to_string(dt) + " T " + std::to_string(T) + " H " +
                                   std::to_string(H) + " sinks " + std::to_string(sinks);
          const auto ref = test::encode(cfg, src, Impl::REFERENCE, id);
          const auto want = test::encode(chan, tr, Impl::REFERENCE, id);
          ASSERT_EQ(ref.rc, KVXFER_SUCCESS) << what << ": " << last_error();
          ASSERT_EQ(want.rc, KVXFER_SUCCESS) << what << ": " << last_error();
          PageHeader h;
          ASSERT_EQ(parse_section(ref.anchor.data(), ref.anchor.size(), &h), KVXFER_SUCCESS);
          EXPECT_EQ(h.flags & FLAG_TOKEN_GROUPS, FLAG_TOKEN_GROUPS) << what;
          const size_t body = want.anchor.size() - kHeaderBytes;
          ASSERT_GE(ref.anchor.size(), kHeaderBytes + body) << what;
          EXPECT_EQ(0, std::memcmp(ref.anchor.data() + kHeaderBytes,
                                   want.anchor.data() + kHeaderBytes, body))
              << what;
          ASSERT_EQ(ref.residual.size(), want.residual.size()) << what;
          EXPECT_EQ(0, std::memcmp(ref.residual.data() + kHeaderBytes,
                                   want.residual.data() + kHeaderBytes,
                                   ref.residual.size() - kHeaderBytes))
              << what;
          size_t amax = 0, rmax = 0;
          ASSERT_EQ(max_sizes(&cfg, T, H, &amax, &rmax), KVXFER_SUCCESS);
          EXPECT_LE(ref.anchor.size(), amax) << what;
          EXPECT_LE(ref.residual.size(), rmax) << what;
          for (Impl impl : fast_impls()) {
            const auto e = test::encode(cfg, src, impl, id, 2);
            ASSERT_EQ(e.anchor, ref.anchor) << what << " impl " << static_cast<int>(impl);
            ASSERT_EQ(e.residual, ref.residual) << what;
          }
          for (bool full : {false, true}) {
            if (full && codec == KVXFER_CODEC_INT4) continue;
            for (Impl impl : {Impl::REFERENCE, Impl::SCALAR, Impl::AUTO}) {
              PagedBuffer out(T, H, KVXFER_DTYPE_FP32, 8);
              PagedBuffer tout(H, static_cast<int32_t>(T), KVXFER_DTYPE_FP32, 8);
              ASSERT_EQ(decode_page(ref.anchor.data(), ref.anchor.size(),
                                    full ? ref.residual.data() : nullptr,
                                    full ? ref.residual.size() : 0, &id, &out.layout, impl, 2),
                        KVXFER_SUCCESS)
                  << what << ": " << last_error();
              ASSERT_EQ(decode_page(want.anchor.data(), want.anchor.size(),
                                    full ? want.residual.data() : nullptr,
                                    full ? want.residual.size() : 0, &id, &tout.layout, impl, 2),
                        KVXFER_SUCCESS);
              for (int64_t t = 0; t < T; ++t)
                for (int32_t c = 0; c < H; ++c) {
                  const float exact = dt == KVXFER_DTYPE_FP32
                                          ? bf16_to_f32(f32_to_bf16(src.get(t, c)))
                                          : src.get(t, c);
                  const float w = t < sinks ? exact : tout.get(c, static_cast<int32_t>(t));
                  ASSERT_EQ(out.get(t, c), w)
                      << what << " full " << full << " t " << t << " c " << c;
                }
            }
          }
        }
}

// AUTO keeps, per V page, the grouping whose anchor-only decode is closer to
// the input: values whose scale changes from token to token go to token
// groups, channel outliers stay in channel groups, and K pages never move.
TEST(PageCodec, ValueGroupsAutoPicksTheSmallerAnchorError) {
  const int64_t T = 128;
  const int32_t H = 128;
  PagedBuffer per_token(T, H, KVXFER_DTYPE_BF16, 32), per_channel(T, H, KVXFER_DTYPE_BF16, 32);
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int32_t c = 0; c < H; ++c) {
      per_token.set(t, c, u(rng) * (t % 4 == 0 ? 20.0f : 0.5f));
      per_channel.set(t, c, u(rng) * (c % 8 == 0 ? 20.0f : 0.5f));
    }
  kvxfer_codec_config_t autoc = config(KVXFER_CODEC_LYNX, 0.0f, 32);
  autoc.value_groups = KVXFER_VALUE_GROUPS_AUTO;
  kvxfer_codec_config_t tok = autoc, chan = autoc;
  tok.value_groups = KVXFER_VALUE_GROUPS_TOKEN;
  chan.value_groups = KVXFER_VALUE_GROUPS_CHANNEL;
  const kvxfer_page_id_t v{0, KVXFER_KV_VALUE, 0, 1}, k{0, KVXFER_KV_KEY, 0, 1};
  for (Impl impl : {Impl::REFERENCE, Impl::AUTO}) {
    EXPECT_EQ(test::encode(autoc, per_token, impl, v).anchor,
              test::encode(tok, per_token, impl, v).anchor);
    EXPECT_NE(test::encode(autoc, per_token, impl, v).anchor,
              test::encode(chan, per_token, impl, v).anchor);
    EXPECT_EQ(test::encode(autoc, per_channel, impl, v).anchor,
              test::encode(chan, per_channel, impl, v).anchor);
    EXPECT_EQ(test::encode(autoc, per_token, impl, k).anchor,
              test::encode(chan, per_token, impl, k).anchor);
    EXPECT_EQ(test::encode(tok, per_token, impl, k).anchor,
              test::encode(chan, per_token, impl, k).anchor)
        << "K pages keep channel groups";
  }
}

TEST(PageCodecBadInput, ValueGroupsAreValidatedAndTheFlagIsCheckedOnParse) {
  PagedBuffer src(40, 16, KVXFER_DTYPE_BF16, 16);
  fill_kv_like(&src, 3);
  kvxfer_codec_config_t cfg = config(KVXFER_CODEC_LYNX, 0.0f, 32);
  cfg.value_groups = static_cast<kvxfer_value_groups_t>(3);
  EXPECT_EQ(test::encode(cfg, src, Impl::AUTO).rc, KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(last_error()).find("value_groups"), std::string::npos) << last_error();
  for (kvxfer_codec_t c : {KVXFER_CODEC_BF16, KVXFER_CODEC_SPECTRUM}) {
    kvxfer_codec_config_t b = config(c, 0.0f, 32);
    b.value_groups = KVXFER_VALUE_GROUPS_AUTO;
    size_t a = 0, r = 0;
    EXPECT_EQ(max_sizes(&b, 40, 16, &a, &r), KVXFER_ERR_INVALID_ARGUMENT) << c;
  }
  // A V page longer than 2^20 tokens has no token-grouped form (its
  // transpose would have too many channels): TOKEN refuses it, AUTO and
  // CHANNEL encode it alike.
  {
    const int64_t T = (int64_t{1} << 20) + 1;
    PagedBuffer longp(T, 1, KVXFER_DTYPE_BF16, 1 << 16, 0, 0);
    for (int64_t t = 0; t < T; ++t) longp.set(t, 0, static_cast<float>(t % 97) - 48.0f);
    kvxfer_codec_config_t tok = config(KVXFER_CODEC_LYNX, 0.0f, 32);
    tok.value_groups = KVXFER_VALUE_GROUPS_TOKEN;
    EXPECT_EQ(test::encode(tok, longp, Impl::AUTO).rc, KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(last_error()).find("exceeds 2^20"), std::string::npos) << last_error();
    kvxfer_codec_config_t au = tok, ch = tok;
    au.value_groups = KVXFER_VALUE_GROUPS_AUTO;
    ch.value_groups = KVXFER_VALUE_GROUPS_CHANNEL;
    const auto a = test::encode(au, longp, Impl::AUTO);
    ASSERT_EQ(a.rc, KVXFER_SUCCESS) << last_error();
    EXPECT_EQ(a.anchor, test::encode(ch, longp, Impl::AUTO).anchor);
  }
  // A token-group flag on a K page or a BF16 page is refused by the parser,
  // checksum or not.
  PageHeader h;
  h.codec = KVXFER_CODEC_LYNX;
  h.kind = KVXFER_KV_KEY;
  h.flags = FLAG_TOKEN_GROUPS;
  h.num_channels = 16;
  h.num_tokens = 40;
  h.payload_bytes = payload_sizes(h).anchor_payload();
  std::vector<uint8_t> buf(kHeaderBytes + h.payload_bytes, 0);
  write_header(h, buf.data());
  PageHeader got;
  EXPECT_EQ(parse_section(buf.data(), buf.size(), &got), KVXFER_ERR_CORRUPT);
  EXPECT_NE(std::string(last_error()).find("token groups"), std::string::npos) << last_error();
  h.kind = KVXFER_KV_VALUE;
  h.num_channels = 1;
  h.num_tokens = (uint64_t{1} << 20) + 1;
  h.payload_bytes = payload_sizes(h).anchor_payload();
  buf.assign(kHeaderBytes + h.payload_bytes, 0);
  write_header(h, buf.data());
  EXPECT_EQ(parse_section(buf.data(), buf.size(), &got), KVXFER_ERR_CORRUPT);
  EXPECT_NE(std::string(last_error()).find("at most 2^20"), std::string::npos) << last_error();
}

TEST(PageCodec, LynxAlphaZeroAnchorDecodesToInt4sBytes) {
  // Format 4: the 4-bit anchor of LYNX alpha 0 is INT4's code (codec_math.h
  // nest_code), so its anchor-only decode is INT4's decode, byte for byte, on
  // every path and dtype, INT4's ties and their float neighbours included.
  const int64_t T = 70;
  const int32_t H = 70;
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16, KVXFER_DTYPE_FP32})
    for (int C : {16, 32}) {
      PagedBuffer src(T, H, dt, 16);
      fill_edges(&src, *get_codebook(KVXFER_CODEC_INT4, 0.0f, 4, nullptr), false, 11 + C);
      const kvxfer_page_id_t id{2, KVXFER_KV_KEY, 100, 3};
      const auto lyn = test::encode(config(KVXFER_CODEC_LYNX, 0.0f, C), src, Impl::REFERENCE, id);
      const auto i4 = test::encode(config(KVXFER_CODEC_INT4, 0.0f, C), src, Impl::REFERENCE, id);
      ASSERT_EQ(lyn.rc, KVXFER_SUCCESS) << last_error();
      ASSERT_EQ(i4.rc, KVXFER_SUCCESS) << last_error();
      // Same anchor payload but the header: metadata, then the same codes, no table.
      ASSERT_EQ(lyn.anchor.size(), i4.anchor.size());
      EXPECT_TRUE(std::equal(lyn.anchor.begin() + kHeaderBytes, lyn.anchor.end(),
                             i4.anchor.begin() + kHeaderBytes));
      std::vector<Impl> impls = fast_impls();
      impls.insert(impls.begin(), Impl::REFERENCE);
      for (Impl impl : impls) {
        for (kvxfer_dtype_t odt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP32}) {
          PagedBuffer a(T, H, odt, 8), b(T, H, odt, 8);
          ASSERT_EQ(decode_page(lyn.anchor.data(), lyn.anchor.size(), nullptr, 0, &id, &a.layout,
                                impl, 1),
                    KVXFER_SUCCESS)
              << last_error();
          ASSERT_EQ(
              decode_page(i4.anchor.data(), i4.anchor.size(), nullptr, 0, &id, &b.layout, impl, 1),
              KVXFER_SUCCESS)
              << last_error();
          ASSERT_TRUE(a.bytes() == b.bytes())
              << "dtype " << dt << " C " << C << " impl " << static_cast<int>(impl);
        }
      }
    }
}

TEST(PageCodec, SinkRowsSaturateBf16OverflowAndRefuseNonFiniteValues) {
  // An fp32 sink beyond bf16's range travels as +-0x7F7F, not infinity.
  {
    PagedBuffer src(20, 8, KVXFER_DTYPE_FP32, 16);
    fill_kv_like(&src, 5);
    src.set(0, 0, 3.4e38f);
    src.set(0, 1, -3.4e38f);
    kvxfer_codec_config_t cfg = config(KVXFER_CODEC_LYNX, 0.0f, 16);
    cfg.sink_tokens = 2;
    const kvxfer_page_id_t id{0, KVXFER_KV_KEY, 0, 1};
    for (Impl impl : {Impl::REFERENCE, Impl::SCALAR}) {
      const auto e = test::encode(cfg, src, impl, id);
      ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
      PagedBuffer out(20, 8, KVXFER_DTYPE_FP32, 8);
      ASSERT_EQ(decode_page(e.anchor.data(), e.anchor.size(), e.residual.data(), e.residual.size(),
                            &id, &out.layout, Impl::AUTO, 1),
                KVXFER_SUCCESS)
          << last_error();
      EXPECT_EQ(out.get(0, 0), bf16_to_f32(0x7F7F));
      EXPECT_EQ(out.get(0, 1), bf16_to_f32(0xFF7F));
      EXPECT_EQ(out.get(0, 2), bf16_to_f32(f32_to_bf16(src.get(0, 2))));
    }
  }
  // A non-finite sink value in a checksum-valid section is CORRUPT, and
  // nothing is written.
  for (kvxfer_dtype_t dt : {KVXFER_DTYPE_BF16, KVXFER_DTYPE_FP16})
    for (uint16_t bad : {uint16_t{0x7F80}, uint16_t{0xFFC1}, uint16_t{0x7C00}, uint16_t{0xFE00}}) {
      const bool is_bad =
          dt == KVXFER_DTYPE_BF16 ? (bad & 0x7F80) == 0x7F80 : (bad & 0x7C00) == 0x7C00;
      PagedBuffer src(20, 8, dt, 16);
      fill_kv_like(&src, 6);
      kvxfer_codec_config_t cfg = config(KVXFER_CODEC_INT8, 0.0f, 16);
      cfg.sink_tokens = 3;
      const kvxfer_page_id_t id{0, KVXFER_KV_VALUE, 0, 1};
      auto e = test::encode(cfg, src, Impl::REFERENCE, id);
      ASSERT_EQ(e.rc, KVXFER_SUCCESS) << last_error();
      PageHeader h;
      ASSERT_EQ(parse_section(e.anchor.data(), e.anchor.size(), &h), KVXFER_SUCCESS);
      ASSERT_EQ(h.sink_rows, 3u);
      const size_t at =
          kHeaderBytes + payload_sizes(h).sink_offset() + 2 * (2 * 8 + 5);  // row 2, ch 5
      e.anchor[at] = static_cast<uint8_t>(bad & 0xFF);
      e.anchor[at + 1] = static_cast<uint8_t>(bad >> 8);
      seal_section(e.anchor.data());
      PagedBuffer out(20, 8, KVXFER_DTYPE_FP32, 8);
      const auto before = out.bytes();
      const kvxfer_result_t r = decode_page(e.anchor.data(), e.anchor.size(), nullptr, 0, &id,
                                            &out.layout, Impl::AUTO, 1);
      if (!is_bad) {  // 0x7C00 and 0xFE00 are finite bf16 values
        EXPECT_EQ(r, KVXFER_SUCCESS) << last_error();
        continue;
      }
      ASSERT_EQ(r, KVXFER_ERR_CORRUPT) << "dtype " << dt << " value " << bad;
      EXPECT_NE(std::string(last_error()).find("sink row 2, channel 5 is not finite"),
                std::string::npos)
          << last_error();
      EXPECT_TRUE(out.bytes() == before);
    }
}

TEST(PageCodec, SinkTokensOutsideItsRangeAreRefused) {
  for (int32_t bad : {-1, kMaxSinkTokens + 1}) {
    kvxfer_codec_config_t cfg = config(KVXFER_CODEC_LYNX, 0.0f);
    cfg.sink_tokens = bad;
    size_t a = 0, r = 0;
    EXPECT_EQ(max_sizes(&cfg, 16, 8, &a, &r), KVXFER_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(last_error()).find("sink_tokens"), std::string::npos) << last_error();
  }
}
}  // namespace
}  // namespace kvxfer::codec
