// Tests of the runner's matrix products (models/qmatmul.h): every output
// element has the same bits whatever the batch, the tile, the thread count
// and CPU path, and equals the definition (16-bit activation blocks).
#include "models/qmatmul.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "codec/codec_math.h"

namespace km = kvxfer::model;
namespace kd = kvxfer::model::detail;

namespace {

struct Matrix {
  km::WeightMatrix w;
  std::vector<std::uint8_t> bytes;
};

// Random blocks; fp16 scales from a realistic range, Q8_0 codes include -128.
Matrix random_matrix(km::WeightType type, int rows, int cols, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale(1e-3f, 0.05f), mn(-0.5f, 0.0f);
  Matrix m;
  const int nb = cols / 32;
  if (type == km::WeightType::kF32) {
    m.bytes.resize(static_cast<std::size_t>(rows) * cols * 4);
    std::uniform_real_distribution<float> u(-1, 1);
    for (std::size_t i = 0; i < m.bytes.size() / 4; ++i) {
      const float v = u(rng);
      std::memcpy(&m.bytes[i * 4], &v, 4);
    }
  } else {
    const int bb = type == km::WeightType::kQ4_1 ? 20 : 34;
    m.bytes.resize(static_cast<std::size_t>(rows) * nb * bb);
    for (std::size_t b = 0; b < static_cast<std::size_t>(rows) * nb; ++b) {
      std::uint8_t* p = &m.bytes[b * bb];
      const std::uint16_t d = kvxfer::codec::f32_to_f16(scale(rng)),
                          mm = kvxfer::codec::f32_to_f16(mn(rng));
      std::memcpy(p, &d, 2);
      if (type == km::WeightType::kQ4_1) std::memcpy(p + 2, &mm, 2);
      for (int j = (type == km::WeightType::kQ4_1 ? 4 : 2); j < bb; ++j)
        p[j] = static_cast<std::uint8_t>(rng());
    }
  }
  m.w = km::WeightMatrix{type, rows, cols, m.bytes.data()};
  return m;
}

std::vector<float> random_acts(int n, int cols, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0, 1);
  std::vector<float> x(static_cast<std::size_t>(n) * cols);
  for (auto& v : x) v = g(rng);
  if (!x.empty()) x[0] = 40.0f;  // an outlier channel, as real activations have
  return x;
}

// The definition of qmatmul.h written out once more, from the block bytes:
// x quantized per 32-element block to int16, exact integer block sums,
// then the two fmas per block.
float reference(const km::WeightMatrix& w, int i, const float* x) {
  if (w.type == km::WeightType::kF32) {
    std::vector<float> row(w.cols);
    km::dequantize_row(w, i, row.data());
    float v = 0;
    for (int k = 0; k < w.cols; ++k) v += row[k] * x[k];
    return v;
  }
  const bool q4 = w.type == km::WeightType::kQ4_1;
  const int nb = w.cols / 32, bb = q4 ? 20 : 34;
  const std::uint8_t* row =
      static_cast<const std::uint8_t*>(w.data) + static_cast<std::size_t>(i) * nb * bb;
  float acc = 0.0f;
  for (int b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    float amax = 0;
    for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float dx = amax / 32767.0f, id = dx > 0 ? 1.0f / dx : 0.0f;
    int isum = 0, qsum = 0;
    const std::uint8_t* blk = row + static_cast<std::size_t>(b) * bb;
    for (int k = 0; k < 32; ++k) {
      const int qx =
          static_cast<int>(std::nearbyint(std::min(32767.0f, std::max(-32767.0f, xb[k] * id))));
      const int qw = q4 ? (k < 16 ? blk[4 + k] & 0xF : blk[4 + k - 16] >> 4)
                        : static_cast<std::int8_t>(blk[2 + k]);
      isum += qw * qx;
      qsum += qx;
    }
    std::uint16_t h;
    std::memcpy(&h, blk, 2);
    const float dw = kvxfer::codec::f16_to_f32(h);
    acc = std::fma(dw * dx, static_cast<float>(isum), acc);
    if (q4) {
      std::memcpy(&h, blk + 2, 2);
      acc = std::fma(kvxfer::codec::f16_to_f32(h), dx * static_cast<float>(qsum), acc);
    }
  }
  return acc;
}

void expect_bits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    std::uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    ASSERT_EQ(x, y) << what << ": element " << i << " 0x" << std::hex << x << " vs 0x" << y;
  }
}

class QMatmul : public ::testing::TestWithParam<km::WeightType> {};

TEST_P(QMatmul, EveryBatchThreadAndPathGivesTheSameBits) {
  const km::WeightType type = GetParam();
  for (int rows : {37, 192, 577}) {
    const int cols = rows == 37 ? 96 : 576;
    const Matrix m = random_matrix(type, rows, cols, 7u + rows);
    const int n_max = 130;  // past the 64-token chunk of the batched products
    const std::vector<float> x = random_acts(n_max, cols, 11u + rows);
    // Sequential, one token at a time, one thread, scalar: the baseline.
    std::vector<float> base(static_cast<std::size_t>(n_max) * rows);
    omp_set_num_threads(1);
    for (int t = 0; t < n_max; ++t)
      kd::matmul_path(kd::Path::kScalar, m.w, &x[static_cast<std::size_t>(t) * cols], 1,
                      &base[static_cast<std::size_t>(t) * rows]);
    for (int i = 0; i < rows; i += 13)
      for (int t = 0; t < n_max; t += 9) {
        const float r = reference(m.w, i, &x[static_cast<std::size_t>(t) * cols]);
        ASSERT_EQ(std::memcmp(&r, &base[static_cast<std::size_t>(t) * rows + i], 4), 0)
            << "definition, row " << i << " token " << t;
      }
    std::vector<kd::Path> paths = {kd::Path::kScalar};
    if (kd::have_avx2()) paths.push_back(kd::Path::kAvx2);
    if (kd::have_avx512()) paths.push_back(kd::Path::kAvx512);
    for (kd::Path path : paths)
      for (int threads : {1, 2})
        for (int n : {1, 2, 3, 4, 5, 7, 16, 17, 64, 130}) {
          omp_set_num_threads(threads);
          std::vector<float> out(static_cast<std::size_t>(n) * rows);
          kd::matmul_path(path, m.w, x.data(), n, out.data());
          const std::vector<float> want(base.begin(),
                                        base.begin() + static_cast<std::ptrdiff_t>(out.size()));
          SCOPED_TRACE(testing::Message() << "rows " << rows << " n " << n << " threads " << threads
                                          << (path == kd::Path::kAvx512 ? " avx512"
                                              : path == kd::Path::kAvx2 ? " avx2"
                                                                        : " scalar"));
          expect_bits(out, want, "batched vs sequential");
        }
  }
  omp_set_num_threads(2);
}

TEST_P(QMatmul, CloseToTheExactProductOfTheDequantizedWeights) {
  const km::WeightType type = GetParam();
  const int rows = 64, cols = 1536;
  const Matrix m = random_matrix(type, rows, cols, 3);
  const std::vector<float> x = random_acts(4, cols, 5);
  std::vector<float> out(4 * rows);
  km::matmul(m.w, x.data(), 4, out.data());
  std::vector<float> row(cols);
  for (int i = 0; i < rows; ++i) {
    km::dequantize_row(m.w, i, row.data());
    for (int t = 0; t < 4; ++t) {
      const float* xt = &x[static_cast<std::size_t>(t) * cols];
      double exact = 0, mag = 0, quant = 0;
      for (int b = 0; b < cols / 32; ++b) {
        double amax = 0, wsum = 0;
        for (int k = b * 32; k < b * 32 + 32; ++k) {
          exact += static_cast<double>(row[k]) * xt[k];
          mag += std::fabs(static_cast<double>(row[k]) * xt[k]);
          amax = std::max(amax, std::fabs(static_cast<double>(xt[k])));
          wsum += std::fabs(static_cast<double>(row[k]));
        }
        // Block types: each x[k] moves by at most half a step, amax / 65534.
        if (type != km::WeightType::kF32) quant += amax / 65534.0 * wsum;
      }
      // Rounding: recursive summation, |error| <= (n-1) u sum|terms|, n the
      // elements (F32) or 2 x blocks plus the block scales' products.
      const double n_terms = type == km::WeightType::kF32 ? cols : 2 * (cols / 32) + 4;
      const double bound = 1.001 * quant + n_terms * std::ldexp(1.0, -24) * (mag + quant);
      EXPECT_LE(std::fabs(out[static_cast<std::size_t>(t) * rows + i] - exact), bound)
          << i << " " << t;
      // And the quantization bound is not vacuous: well under the product's size.
      if (type != km::WeightType::kF32) {
        EXPECT_LT(quant, 1e-3 * mag) << i << " " << t;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, QMatmul,
                         ::testing::Values(km::WeightType::kQ4_1, km::WeightType::kQ8_0,
                                           km::WeightType::kF32),
                         [](const auto& info) {
                           return info.param == km::WeightType::kQ4_1   ? std::string("Q4_1")
                                  : info.param == km::WeightType::kQ8_0 ? std::string("Q8_0")
                                                                        : std::string("F32");
                         });

TEST(QMatmulDequantize, Q4_1AndQ8_0OfAFixedBlock) {
  std::uint8_t q41[20] = {0x00, 0x3C, 0x00, 0xC0};  // d = 1, m = -2
  for (int j = 0; j < 16; ++j) q41[4 + j] = static_cast<std::uint8_t>(j | ((15 - j) << 4));
  std::uint8_t q80[34] = {0x00, 0x38};  // d = 0.5
  for (int j = 0; j < 32; ++j)
    q80[2 + j] = static_cast<std::uint8_t>(static_cast<std::int8_t>(j * 8 - 128));
  float out[32];
  km::dequantize_row(km::WeightMatrix{km::WeightType::kQ4_1, 1, 32, q41}, 0, out);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[j], static_cast<float>(j) - 2.0f);
    EXPECT_EQ(out[j + 16], static_cast<float>(15 - j) - 2.0f);
  }
  km::dequantize_row(km::WeightMatrix{km::WeightType::kQ8_0, 1, 32, q80}, 0, out);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(out[j], 0.5f * static_cast<float>(j * 8 - 128));
}

}  // namespace

#include "models/attention_kernels.h"

namespace {

TEST(AttentionKernel, Exp8IsWithinItsBoundOfExp) {
  double worst = 0;
  for (float x = -87.0f; x <= 0.0f; x += 0.001f) {
    const double e = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(kd::exp8(x) - e) / e);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(kd::exp8(0.0f), 1.0f);
  EXPECT_EQ(kd::exp8(-INFINITY), 0.0f);
  EXPECT_EQ(kd::exp8(-100.0f), 0.0f);
}

TEST(AttentionKernel, Avx2EqualsTheScalarDefinitionBitForBit) {
  if (!kd::have_avx2()) GTEST_SKIP() << "no AVX2+FMA on this CPU";
  std::mt19937 rng(9);
  std::normal_distribution<float> g(0, 2);
  const int hs = 64, kv_dim = 192;
  for (int n_keys : {1, 7, 8, 9, 100, 1031}) {
    std::vector<float> k(static_cast<std::size_t>(n_keys) * kv_dim), v(k.size()), q(hs);
    for (auto& x : k) x = g(rng);
    for (auto& x : v) x = g(rng);
    for (auto& x : q) x = g(rng);
    std::vector<std::uint8_t> drop(static_cast<std::size_t>(n_keys), 0);
    for (int t = 3; t < n_keys; t += 5) drop[t] = 1;
    for (int split : {0, n_keys / 2}) {
      for (bool use_drop : {false, true}) {
        kd::Segment segs[2] = {
            {k.data(), v.data(), static_cast<std::size_t>(kv_dim), static_cast<std::size_t>(kv_dim),
             split, use_drop ? drop.data() : nullptr},
            {k.data() + static_cast<std::size_t>(split) * kv_dim,
             v.data() + static_cast<std::size_t>(split) * kv_dim, static_cast<std::size_t>(kv_dim),
             static_cast<std::size_t>(kv_dim), n_keys - split, nullptr},
        };
        std::vector<float> s1(n_keys + 8), s2(n_keys + 8), o1(hs), o2(hs);
        kd::attend_head_scalar(q.data(), hs, 64, segs, 2, s1.data(), o1.data());
        kd::attend_head_avx2(q.data(), hs, 64, segs, 2, s2.data(), o2.data());
        SCOPED_TRACE(testing::Message()
                     << n_keys << " keys, split " << split << " drop " << use_drop);
        expect_bits(o1, o2, "attention output");
        s1.resize(n_keys);
        s2.resize(n_keys);
        expect_bits(s1, s2, "probabilities");
        double psum = 0;
        for (float p : s1) psum += p;
        EXPECT_NEAR(psum, 1.0, 1e-5);
      }
    }
  }
}

}  // namespace

namespace {
TEST(AttentionKernel, SwigluAvx2EqualsScalar) {
  if (!kd::have_avx2()) GTEST_SKIP() << "no AVX2+FMA on this CPU";
  std::mt19937 rng(4);
  std::normal_distribution<float> g(0, 30);
  std::vector<float> h(1003), up(1003);
  for (auto& x : h) x = g(rng);
  for (auto& x : up) x = g(rng);
  h[0] = -200.0f;
  h[1] = 200.0f;
  std::vector<float> a = h, b = h;
  kd::swiglu_scalar(a.data(), up.data(), a.size());
  kd::swiglu_avx2(b.data(), up.data(), b.size());
  expect_bits(a, b, "swiglu");
  EXPECT_EQ(a[1], 200.0f * up[1]);
  for (std::size_t i = 2; i < h.size(); ++i) {
    const double want = h[i] / (1.0 + std::exp(-static_cast<double>(h[i]))) * up[i];
    EXPECT_NEAR(a[i], want, 1e-5 * (std::fabs(want) + 1e-3)) << i;
  }
}
}  // namespace

namespace {
// attend_group (keys read once for several queries) gives each query the
// bits of attend_head on the segments cut to its key count.
// A head wider than the AVX2 kernels hold (136 > 128) takes attend_group's
// per-query fallback; with five segments every one of them must count.
TEST(AttentionKernel, WideHeadGroupOverFiveSegmentsEqualsOneQueryAtATime) {
  std::mt19937 rng(22);
  std::normal_distribution<float> g(0, 2);
  const int hs = 136, n_segs = 5, per = 3;
  std::vector<std::vector<float>> k(n_segs, std::vector<float>(per * hs)), v(k);
  std::vector<kd::Segment> segs;
  for (int s = 0; s < n_segs; ++s) {
    for (auto& x : k[s]) x = g(rng);
    for (auto& x : v[s]) x = g(rng);
    segs.push_back({k[s].data(), v[s].data(), static_cast<std::size_t>(hs),
                    static_cast<std::size_t>(hs), per});
  }
  const int n_q = 3;
  std::vector<std::vector<float>> qs(n_q, std::vector<float>(hs)),
      outs(n_q, std::vector<float>(hs));
  std::vector<const float*> qp;
  std::vector<float*> op;
  const std::vector<int> counts = {n_segs * per, n_segs * per - 1, 4};
  for (int i = 0; i < n_q; ++i) {
    for (auto& x : qs[i]) x = g(rng);
    qp.push_back(qs[i].data());
    op.push_back(outs[i].data());
  }
  const std::size_t stride = n_segs * per + 8;
  std::vector<float> scores(n_q * stride);
  kd::attend_group(qp.data(), counts.data(), n_q, hs, 0, segs.data(), n_segs, scores.data(), stride,
                   op.data());
  for (int i = 0; i < n_q; ++i) {
    std::vector<kd::Segment> cut;
    for (int s = 0, left = counts[i]; s < n_segs && left > 0; ++s) {
      cut.push_back(segs[s]);
      cut.back().count = std::min(per, left);
      left -= cut.back().count;
    }
    std::vector<float> s1(stride), o1(hs);
    kd::attend_head_scalar(qs[i].data(), hs, 0, cut.data(), static_cast<int>(cut.size()), s1.data(),
                           o1.data());
    SCOPED_TRACE(testing::Message() << "query " << i);
    expect_bits(outs[i], o1, "group vs single");
  }
}

TEST(AttentionKernel, GroupEqualsOneQueryAtATime) {
  std::mt19937 rng(21);
  std::normal_distribution<float> g(0, 2);
  const int hs = 64, kv_dim = 192, n_view = 77, n_tail = 21;
  std::vector<float> kv(static_cast<std::size_t>(n_view) * kv_dim), vv(kv.size());
  std::vector<float> kt(static_cast<std::size_t>(n_tail) * kv_dim), vt(kt.size());
  for (auto* v : {&kv, &vv, &kt, &vt})
    for (auto& x : *v) x = g(rng);
  std::vector<std::uint8_t> drop(n_view, 0);
  for (int t = 2; t < n_view; t += 7) drop[t] = 1;
  for (bool use_drop : {false, true}) {
    const kd::Segment segs[2] = {
        {kv.data(), vv.data(), static_cast<std::size_t>(kv_dim), static_cast<std::size_t>(kv_dim),
         n_view, use_drop ? drop.data() : nullptr},
        {kt.data(), vt.data(), static_cast<std::size_t>(kv_dim), static_cast<std::size_t>(kv_dim),
         n_tail}};
    const int n_q = 12;
    std::vector<std::vector<float>> qs(n_q, std::vector<float>(hs)),
        outs(n_q, std::vector<float>(hs));
    std::vector<const float*> qp;
    std::vector<float*> op;
    std::vector<int> counts;
    for (int i = 0; i < n_q; ++i) {
      for (auto& x : qs[i]) x = g(rng);
      qp.push_back(qs[i].data());
      op.push_back(outs[i].data());
      counts.push_back(i == 0 ? 3
                              : n_view + 1 + (i * 7) % n_tail);  // inside the view, then the tail
    }
    const std::size_t stride = n_view + n_tail + 8;
    std::vector<float> scores(n_q * stride);
    kd::attend_group(qp.data(), counts.data(), n_q, hs, 64, segs, 2, scores.data(), stride,
                     op.data());
    for (int i = 0; i < n_q; ++i) {
      kd::Segment cut[2] = {segs[0], segs[1]};
      cut[0].count = std::min(n_view, counts[i]);
      cut[1].count = counts[i] - cut[0].count;
      std::vector<float> s1(stride), o1(hs);
      kd::attend_head_scalar(qs[i].data(), hs, 64, cut, 2, s1.data(), o1.data());
      SCOPED_TRACE(testing::Message() << "query " << i << " drop " << use_drop);
      expect_bits(outs[i], o1, "group vs single");
    }
  }
}
}  // namespace

namespace {
// The AVX-512 group kernel (pairs of queries per register for the scores,
// 16 elements per register for p.v) gives every query the bits of the AVX2
// group kernel: whole blocks, causal ends inside a block, fewer keys than a
// block, dropped keys, two segments, odd and even query counts past the
// 6-query tiles, and both head sizes it serves.
TEST(AttentionKernel, Avx512GroupEqualsAvx2GroupBitForBit) {
  if (!kd::have_avx512()) GTEST_SKIP() << "no AVX-512 (F, DQ, VL) on this CPU";
  std::mt19937 rng(31);
  std::normal_distribution<float> g(0, 2);
  for (int hs : {64, 128}) {
    const int kv_dim = 3 * hs, n_view = 45, n_tail = 19;
    std::vector<float> kv(static_cast<std::size_t>(n_view) * kv_dim), vv(kv.size());
    std::vector<float> kt(static_cast<std::size_t>(n_tail) * kv_dim), vt(kt.size());
    for (auto* v : {&kv, &vv, &kt, &vt})
      for (auto& x : *v) x = g(rng);
    std::vector<std::uint8_t> drop(n_view, 0);
    for (int t = 4; t < n_view; t += 6) drop[t] = 1;
    for (bool use_drop : {false, true}) {
      const kd::Segment segs[2] = {
          {kv.data(), vv.data(), static_cast<std::size_t>(kv_dim), static_cast<std::size_t>(kv_dim),
           n_view, use_drop ? drop.data() : nullptr},
          {kt.data(), vt.data(), static_cast<std::size_t>(kv_dim), static_cast<std::size_t>(kv_dim),
           n_tail}};
      for (int n_q : {2, 3, 6, 7, 11, 24}) {
        std::vector<std::vector<float>> qs(n_q, std::vector<float>(hs));
        std::vector<std::vector<float>> o2(n_q, std::vector<float>(hs)), o5(o2);
        std::vector<const float*> qp;
        std::vector<float*> p2, p5;
        std::vector<int> counts;
        for (int i = 0; i < n_q; ++i) {
          for (auto& x : qs[i]) x = g(rng);
          qp.push_back(qs[i].data());
          p2.push_back(o2[i].data());
          p5.push_back(o5[i].data());
          // a few keys, then causal ends at every offset of the view and the tail
          counts.push_back(i % 5 == 0 ? 1 + i % 7 : n_view - 8 + (i * 5) % (n_tail + 8));
        }
        const std::size_t stride = n_view + n_tail + 8;
        std::vector<float> s2(n_q * stride), s5(s2.size());
        const std::size_t off = static_cast<std::size_t>(hs);  // the second KV head
        kd::attend_group_avx2(qp.data(), counts.data(), n_q, hs, off, segs, 2, s2.data(), stride,
                              p2.data());
        kd::attend_group_avx512(qp.data(), counts.data(), n_q, hs, off, segs, 2, s5.data(), stride,
                                p5.data());
        SCOPED_TRACE(testing::Message()
                     << "head " << hs << " queries " << n_q << " drop " << use_drop);
        for (int i = 0; i < n_q; ++i) {
          expect_bits(o5[i], o2[i], "avx512 vs avx2 output");
          const std::vector<float> a(s5.begin() + i * stride, s5.begin() + i * stride + counts[i]);
          const std::vector<float> b(s2.begin() + i * stride, s2.begin() + i * stride + counts[i]);
          expect_bits(a, b, "avx512 vs avx2 probabilities");
        }
      }
    }
  }
}
}  // namespace

namespace {
// The AVX2 and AVX-512 quantizers write the scalar one's bytes: codes at exact ties
// (x * id = k + 0.5 rounds to even), a zero block, a block with a NaN and one
// with an infinity, the clamp at +-32767, and the padding lanes of a group.
TEST(QuantizeX, VectorPathsEqualScalarOnTiesZerosAndNonFinite) {
  if (!kd::have_avx2()) GTEST_SKIP() << "no AVX2+FMA on this CPU";
  const int cols = 160, n = 19;  // 5 blocks; 2 groups, the second of 3 tokens
  std::vector<float> x = random_acts(n, cols, 9);
  // Token 0, block 0: amax 32767 so id = 1, and k + 0.5 values tie.
  for (int k = 0; k < 32; ++k) x[k] = k == 0 ? 32767.0f : static_cast<float>(k % 9) - 4.5f;
  for (int k = 32; k < 64; ++k) x[k] = 0.0f;               // token 0, block 1: all zero
  x[static_cast<std::size_t>(cols) + 70] = std::nanf("");  // token 1, block 2
  x[static_cast<std::size_t>(2 * cols) + 100] = INFINITY;  // token 2, block 3
  x[static_cast<std::size_t>(3 * cols) + 130] = -1e30f;    // token 3, block 4
  kd::QuantizedX a, b;
  kd::quantize_x(x.data(), n, cols, &a);
  kd::quantize_x_avx2(x.data(), n, cols, &b);
  ASSERT_EQ(a.q, b.q);
  ASSERT_EQ(a.qsum, b.qsum);
  ASSERT_EQ(std::memcmp(a.dx.data(), b.dx.data(), a.dx.size() * 4), 0);
  ASSERT_EQ(std::memcmp(a.sx.data(), b.sx.data(), a.sx.size() * 4), 0);
  // dx = 1: the ties went to even (k = 1..7: -3.5 -2.5 -1.5 -0.5 0.5 1.5 2.5).
  EXPECT_EQ(a.dx[a.at(0, 0)], 1.0f);
  const int want[8] = {32767, -4, -2, -2, 0, 0, 2, 2};
  for (int k = 0; k < 8; ++k) EXPECT_EQ(a.qrow(0, 0, k / 2)[k % 2], want[k]) << k;
  EXPECT_EQ(a.qsum[a.at(0, 1)], 0);
  EXPECT_EQ(a.dx[a.at(0, 1)], 0.0f);
  // The NaN's code is 0; the infinity makes dx infinite and every code 0.
  EXPECT_EQ(a.qrow(0, 2, 3)[2 * 1], 0);  // k = 6
  EXPECT_TRUE(std::isinf(a.dx[a.at(0, 3) + 2]));
  EXPECT_EQ(a.qsum[a.at(0, 3) + 2], 0);
  // -1e30 is its block's amax: code -32767.
  EXPECT_EQ(a.qrow(0, 4, 1)[2 * 3], -32767);  // k = 2
  // Padding lanes of the last group are zero.
  EXPECT_EQ(a.qrow(1, 0, 0)[2 * 5], 0);
  EXPECT_EQ(a.dx[a.at(1, 0) + 5], 0.0f);
  // Token-major (group 1, the AVX-512 kernel's): the same codes and scales,
  // from the scalar, AVX2 and AVX-512 quantizers, into a reused QuantizedX
  // holding another matrix's codes.
  std::vector<kd::QuantizedX> t(3);
  for (kd::QuantizedX& u : t) {
    u.prepare(n + 3, 7, 1);
    std::fill(u.q.begin(), u.q.end(), std::int16_t{77});
    u.prepare(n, cols / 32, 1);
  }
  kd::quantize_tokens(x.data(), cols, 0, n, 0, cols / 32, &t[0]);
  kd::quantize_tokens_avx2(x.data(), cols, 0, n, 0, cols / 32, &t[1]);
  if (kd::have_avx512()) kd::quantize_tokens_avx512(x.data(), cols, 0, n, 0, cols / 32, &t[2]);
  for (int i = 0; i < (kd::have_avx512() ? 3 : 2); ++i)
    for (int tok = 0; tok < n; ++tok)
      for (int b = 0; b < cols / 32; ++b) {
        const std::size_t s = a.at(tok / kd::kGroup, b) + tok % kd::kGroup;
        ASSERT_EQ(t[i].qsum[t[i].at(tok, b)], a.qsum[s]) << i << " " << tok << " " << b;
        ASSERT_EQ(std::memcmp(&t[i].dx[t[i].at(tok, b)], &a.dx[s], 4), 0);
        ASSERT_EQ(std::memcmp(&t[i].sx[t[i].at(tok, b)], &a.sx[s], 4), 0);
        for (int k = 0; k < 32; ++k)
          ASSERT_EQ(t[i].qrow(tok, b, 0)[k],
                    a.qrow(tok / kd::kGroup, b, k / 2)[2 * (tok % kd::kGroup) + k % 2])
              << "quantizer " << i << " token " << tok << " block " << b << " k " << k;
      }
}

// matmul_many (one parallel loop over the panels of several matrices) gives
// each matrix matmul's bits: row counts that end panels mid-way, mixed block
// types, an F32 matrix among them (taken one at a time), one token, a
// batch, and a batch past the 64-token chunk, on every path of this CPU.
TEST(QMatmulMany, EachMatrixGetsTheBitsOfItsOwnProduct) {
  const int cols = 192;
  const Matrix a = random_matrix(km::WeightType::kQ4_1, 37, cols, 41);
  const Matrix b = random_matrix(km::WeightType::kQ8_0, 64, cols, 42);
  const Matrix c = random_matrix(km::WeightType::kQ4_1, 7, cols, 43);
  const Matrix f = random_matrix(km::WeightType::kF32, 11, cols, 44);
  std::vector<kd::Path> paths = {kd::Path::kScalar};
  if (kd::have_avx2()) paths.push_back(kd::Path::kAvx2);
  if (kd::have_avx512()) paths.push_back(kd::Path::kAvx512);
  for (bool with_f32 : {false, true}) {
    std::vector<const km::WeightMatrix*> ws = {&a.w, &b.w, &c.w};
    if (with_f32) ws.insert(ws.begin() + 1, &f.w);
    for (kd::Path path : paths)
      for (int n : {1, 3, 16, 70}) {
        const std::vector<float> x = random_acts(n, cols, 45u + n);
        std::vector<std::vector<float>> many(ws.size()), one(ws.size());
        std::vector<float*> outs;
        for (std::size_t m = 0; m < ws.size(); ++m) {
          many[m].assign(static_cast<std::size_t>(n) * ws[m]->rows, -1.0f);
          one[m].assign(many[m].size(), -2.0f);
          outs.push_back(many[m].data());
          kd::matmul_path(path, *ws[m], x.data(), n, one[m].data());
        }
        kd::matmul_many_path(path, ws.data(), outs.data(), static_cast<int>(ws.size()), x.data(),
                             n);
        SCOPED_TRACE(testing::Message()
                     << "n " << n << " f32 " << with_f32 << " path " << static_cast<int>(path));
        for (std::size_t m = 0; m < ws.size(); ++m) expect_bits(many[m], one[m], "many vs one");
      }
  }
}
// The packed layout of qmatmul.h, byte by byte: each chunk word holds the
// codes its comment names, the scales sit at the row's index, and the rows
// past the matrix are zero.
TEST(QMatmulPack, LayoutOfQ4_1AndQ8_0Groups) {
  for (km::WeightType type : {km::WeightType::kQ4_1, km::WeightType::kQ8_0}) {
    const bool q4 = type == km::WeightType::kQ4_1;
    const int rows = 19, cols = 64, nb = 2, bb = q4 ? 20 : 34;
    const Matrix m = random_matrix(type, rows, cols, 61);
    std::vector<std::uint8_t> packed(km::packed_bytes(m.w));
    const std::size_t block = q4 ? km::kPackedQ4_1Block : km::kPackedQ8_0Block;
    ASSERT_EQ(packed.size(), 2 * nb * block);  // 2 groups, the second 3 rows and 13 of zeros
    km::pack_weights(m.w, packed.data());
    for (int g = 0; g < 2; ++g)
      for (int b = 0; b < nb; ++b)
        for (int r = 0; r < km::kPackRows; ++r) {
          const int row = g * km::kPackRows + r;
          const std::uint8_t* blk = &packed[(static_cast<std::size_t>(g) * nb + b) * block];
          const std::uint8_t* src = &m.bytes[(static_cast<std::size_t>(row) * nb + b) * bb];
          std::uint16_t d, mn = 0, want_d = 0, want_m = 0;
          std::memcpy(&d, blk + 2 * r, 2);
          if (q4) std::memcpy(&mn, blk + 32 + 2 * r, 2);
          if (row < rows) {
            std::memcpy(&want_d, src, 2);
            if (q4) std::memcpy(&want_m, src + 2, 2);
          }
          EXPECT_EQ(d, want_d);
          EXPECT_EQ(mn, want_m);
          for (int k = 0; k < 32; ++k) {
            int want = 0, got;
            if (row < rows)
              want = q4 ? (k < 16 ? src[4 + k] & 0xF : src[4 + k - 16] >> 4)
                        : static_cast<std::int8_t>(src[2 + k]);
            std::uint32_t word;
            if (q4) {  // chunk k / 8, pair p = (k % 8) / 2, high half for odd k
              std::memcpy(&word, blk + 64 + 64 * (k / 8) + 4 * r, 4);
              got = (word >> (4 * ((k % 8) / 2) + 16 * (k % 2))) & 0xF;
            } else {  // chunk k / 4: bytes (k0, k2, k1, k3)
              static const int at[4] = {0, 2, 1, 3};
              got = static_cast<std::int8_t>(blk[32 + 64 * (k / 4) + 4 * r + at[k % 4]]);
            }
            ASSERT_EQ(got, want) << "group " << g << " block " << b << " row " << r << " k " << k;
          }
        }
  }
}

// A matrix with its packed copy (the model's) gives the bits of the one
// without (repacked group by group as the kernel goes) and of the scalar
// path, for token counts around the kernel's tile of 8.
TEST(QMatmulPack, PackedMatrixGivesTheSameBits) {
  if (!kd::have_avx512()) GTEST_SKIP() << "no AVX-512 VNNI on this CPU";
  for (km::WeightType type : {km::WeightType::kQ4_1, km::WeightType::kQ8_0}) {
    const int rows = 45, cols = 160;
    Matrix m = random_matrix(type, rows, cols, 71);
    std::vector<std::uint8_t> packed(km::packed_bytes(m.w));
    km::pack_weights(m.w, packed.data());
    km::WeightMatrix pw = m.w;
    pw.packed = packed.data();
    for (int n : {1, 2, 3, 7, 8, 9, 16, 23, 64}) {
      const std::vector<float> x = random_acts(n, cols, 73u + n);
      std::vector<float> a(static_cast<std::size_t>(n) * rows), b(a.size()), c(a.size());
      kd::matmul_path(kd::Path::kAvx512, pw, x.data(), n, a.data());
      kd::matmul_path(kd::Path::kAvx512, m.w, x.data(), n, b.data());
      kd::matmul_path(kd::Path::kScalar, m.w, x.data(), n, c.data());
      SCOPED_TRACE(testing::Message() << "n " << n << " q4 " << (type == km::WeightType::kQ4_1));
      expect_bits(a, b, "packed vs repacked");
      expect_bits(a, c, "packed vs scalar");
    }
  }
}
}  // namespace
