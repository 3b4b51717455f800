// Tests of speculative decoding on anchor KV (include/kvxfer/spec.h,
// src/speculative/): greedy and stochastic verification with their edge cases, a
// chi-square test that stochastic verification samples exactly the target
// distribution, the residual-time estimate, the adaptive window, the
// acceptance monitor, the latency model, and a greedy speculative decode of
// stories260K on anchor-only KV that must reproduce full-KV decoding exactly.
#include "kvxfer/spec.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/log.h"
#include "models/llama2.h"

namespace km = kvxfer::model;

namespace {

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

// Regularised upper incomplete gamma Q(a, x) (Numerical Recipes 6.2: series
// for x < a + 1, continued fraction otherwise), for the chi-square survival
// function P(X > x) = Q(df / 2, x / 2).
double gamma_q(double a, double x) {
  if (x <= 0.0) return 1.0;
  const double gln = std::lgamma(a);
  if (x < a + 1.0) {
    double ap = a, sum = 1.0 / a, del = sum;
    for (int n = 0; n < 10000; ++n) {
      ap += 1.0;
      del *= x / ap;
      sum += del;
      if (std::fabs(del) < std::fabs(sum) * 1e-15) break;
    }
    return 1.0 - sum * std::exp(-x + a * std::log(x) - gln);
  }
  const double fpmin = 1e-300;
  double b = x + 1.0 - a, c = 1.0 / fpmin, d = 1.0 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::fabs(d) < fpmin) d = fpmin;
    c = b + an / c;
    if (std::fabs(c) < fpmin) c = fpmin;
    d = 1.0 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1.0) < 1e-15) break;
  }
  return std::exp(-x + a * std::log(x) - gln) * h;
}

double chi2_sf(double x, int df) { return gamma_q(0.5 * df, 0.5 * x); }

struct Chi2 {
  double stat = 0.0;
  int df = -1;
  double p_value = 1.0;
  bool zero_cells_ok = true;  // no count where the expectation is 0
};

// Pearson's statistic of `counts` against n * expected (cells of expectation 0
// must be empty and do not count towards the degrees of freedom).
Chi2 chi_square(const std::vector<int64_t>& counts, const std::vector<double>& expected,
                int64_t n) {
  Chi2 r;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected[i] <= 0.0) {
      if (counts[i] != 0) r.zero_cells_ok = false;
      continue;
    }
    const double e = expected[i] * static_cast<double>(n);
    const double d = static_cast<double>(counts[i]) - e;
    r.stat += d * d / e;
    r.df++;
  }
  r.p_value = chi2_sf(r.stat, r.df);
  return r;
}

// Every chi-square test below fails a correct implementation with
// probability kAlpha over the choice of seed (the seeds are fixed, so a run
// is deterministic: a pass stays a pass).  Three such tests: the suite's
// false-failure rate is at most 3e-4.
constexpr double kAlpha = 1e-4;

int32_t sample(const std::vector<float>& probs, uint64_t seed) {
  int32_t t = -1;
  EXPECT_EQ(kvxfer_spec_sample(probs.data(), static_cast<int32_t>(probs.size()), seed, &t),
            KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  return t;
}

// Seeds for drafting, far from the verification seeds (0, 1, 2, ...).
uint64_t draft_seed(int64_t trial, int pos) {
  return 0x5eed000000000000ull + static_cast<uint64_t>(trial) * 8 + static_cast<uint64_t>(pos);
}

}  // namespace

// ---------------------------------------------------------------------------
// Greedy verification
// ---------------------------------------------------------------------------

TEST(SpecGreedy, DraftLengthZeroReturnsTheTargetToken) {
  const int32_t target[] = {42};
  int32_t a = -1, next = -1;
  ASSERT_EQ(kvxfer_spec_verify_greedy(nullptr, 0, target, &a, &next), KVXFER_SUCCESS);
  EXPECT_EQ(a, 0);
  EXPECT_EQ(next, 42);
}

TEST(SpecGreedy, AllAcceptedGivesTheBonusToken) {
  const int32_t draft[] = {5, 6, 7};
  const int32_t target[] = {5, 6, 7, 8};
  int32_t a = -1, next = -1;
  ASSERT_EQ(kvxfer_spec_verify_greedy(draft, 3, target, &a, &next), KVXFER_SUCCESS);
  EXPECT_EQ(a, 3);
  EXPECT_EQ(next, 8);
}

TEST(SpecGreedy, FirstTokenRejected) {
  const int32_t draft[] = {5, 6, 7};
  const int32_t target[] = {9, 6, 7, 8};  // later positions agree, but only the prefix counts
  int32_t a = -1, next = -1;
  ASSERT_EQ(kvxfer_spec_verify_greedy(draft, 3, target, &a, &next), KVXFER_SUCCESS);
  EXPECT_EQ(a, 0);
  EXPECT_EQ(next, 9);
}

TEST(SpecGreedy, RejectionInTheMiddleCorrects) {
  const int32_t draft[] = {5, 6, 7, 1};
  const int32_t target[] = {5, 6, 3, 1, 2};
  int32_t a = -1, next = -1;
  ASSERT_EQ(kvxfer_spec_verify_greedy(draft, 4, target, &a, &next), KVXFER_SUCCESS);
  EXPECT_EQ(a, 2);
  EXPECT_EQ(next, 3);
}

TEST(SpecGreedy, BadArgumentsAreRefusedAndOutputsUntouched) {
  const int32_t draft[] = {1, 2};
  const int32_t target[] = {1, 2, 3};
  const int32_t bad[] = {1, -2, 3};
  int32_t a = -7, next = -7;
  EXPECT_EQ(kvxfer_spec_verify_greedy(draft, -1, target, &a, &next), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_greedy(nullptr, 2, target, &a, &next), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_greedy(draft, 2, nullptr, &a, &next), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_greedy(draft, 2, target, nullptr, &next),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_greedy(draft, 2, bad, &a, &next), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("target[1] = -2"), std::string::npos)
      << kvxfer_get_last_error();
  EXPECT_EQ(a, -7);
  EXPECT_EQ(next, -7);
}

// ---------------------------------------------------------------------------
// Stochastic verification: edge cases
// ---------------------------------------------------------------------------

TEST(SpecStochastic, DraftLengthZeroSamplesTheTarget) {
  const float p[] = {0.0f, 0.0f, 1.0f};
  for (uint64_t seed = 0; seed < 50; ++seed) {
    int32_t a = -1, next = -1;
    ASSERT_EQ(kvxfer_spec_verify_stochastic(nullptr, 0, p, nullptr, 3, seed, &a, &next),
              KVXFER_SUCCESS)
        << kvxfer_get_last_error();
    EXPECT_EQ(a, 0);
    EXPECT_EQ(next, 2);
  }
}

TEST(SpecStochastic, EqualDistributionsAcceptEverything) {
  // u * q(s) < p(s) holds for every u < 1 when p = q: the whole draft passes,
  // and the bonus token comes from the last target row.
  const float row[] = {0.2f, 0.5f, 0.3f};
  const float bonus[] = {0.0f, 1.0f, 0.0f};
  std::vector<float> p, q;
  for (int i = 0; i < 4; ++i) {
    p.insert(p.end(), row, row + 3);
    q.insert(q.end(), row, row + 3);
  }
  p.insert(p.end(), bonus, bonus + 3);
  const int32_t draft[] = {0, 1, 2, 1};
  for (uint64_t seed = 0; seed < 200; ++seed) {
    int32_t a = -1, next = -1;
    ASSERT_EQ(kvxfer_spec_verify_stochastic(draft, 4, p.data(), q.data(), 3, seed, &a, &next),
              KVXFER_SUCCESS);
    EXPECT_EQ(a, 4);
    EXPECT_EQ(next, 1);
  }
}

TEST(SpecStochastic, FirstTokenRejectedWhenTheTargetNeverProducesIt) {
  // p(s) = 0: always rejected; the correction comes from norm(max(0, p - q)),
  // which here is all on token 1 (token 2 has p <= q).
  const float p[] = {0.0f, 0.6f, 0.4f, /*bonus*/ 1.0f, 0.0f, 0.0f};
  const float q[] = {0.5f, 0.0f, 0.5f};
  const int32_t draft[] = {0};
  for (uint64_t seed = 0; seed < 200; ++seed) {
    int32_t a = -1, next = -1;
    ASSERT_EQ(kvxfer_spec_verify_stochastic(draft, 1, p, q, 3, seed, &a, &next), KVXFER_SUCCESS);
    EXPECT_EQ(a, 0);
    EXPECT_EQ(next, 1);
  }
}

TEST(SpecStochastic, ZerosInTheDraftDistribution) {
  // q(s) = 0 < p(s) (a draft token its own distribution never proposes, e.g.
  // after top-k truncation) is always accepted: p/q is infinite.
  const float p[] = {0.5f, 0.5f, /*bonus*/ 0.0f, 1.0f};
  const float q[] = {0.0f, 1.0f};
  const int32_t draft[] = {0};
  for (uint64_t seed = 0; seed < 100; ++seed) {
    int32_t a = -1, next = -1;
    ASSERT_EQ(kvxfer_spec_verify_stochastic(draft, 1, p, q, 2, seed, &a, &next), KVXFER_SUCCESS);
    EXPECT_EQ(a, 1);
    EXPECT_EQ(next, 1);
  }
  // p = q with q(s) = p(s) = 0: rejected, and max(0, p - q) is zero
  // everywhere, so the correction is sampled from p.
  const float pz[] = {0.0f, 1.0f, 0.0f, 1.0f};
  const float qz[] = {0.0f, 1.0f};
  int32_t a = -1, next = -1;
  ASSERT_EQ(kvxfer_spec_verify_stochastic(draft, 1, pz, qz, 2, 3, &a, &next), KVXFER_SUCCESS);
  EXPECT_EQ(a, 0);
  EXPECT_EQ(next, 1);
}

TEST(SpecStochastic, VocabOfOne) {
  const float p[] = {1.0f, 1.0f, 1.0f};
  const float q[] = {1.0f, 1.0f};
  const int32_t draft[] = {0, 0};
  int32_t a = -1, next = -1;
  ASSERT_EQ(kvxfer_spec_verify_stochastic(draft, 2, p, q, 1, 7, &a, &next), KVXFER_SUCCESS);
  EXPECT_EQ(a, 2);
  EXPECT_EQ(next, 0);
  int32_t t = -1;
  ASSERT_EQ(kvxfer_spec_sample(p, 1, 9, &t), KVXFER_SUCCESS);
  EXPECT_EQ(t, 0);
  const int32_t gd[] = {0, 0};
  const int32_t gt[] = {0, 0, 0};
  ASSERT_EQ(kvxfer_spec_verify_greedy(gd, 2, gt, &a, &next), KVXFER_SUCCESS);
  EXPECT_EQ(a, 2);
  EXPECT_EQ(next, 0);
}

TEST(SpecStochastic, RowsNeedNotBeNormalisedAndResultsArePure) {
  const float p[] = {0.1f, 0.2f, 0.7f, 0.3f, 0.3f, 0.4f};
  const float q[] = {0.6f, 0.3f, 0.1f};
  float p3[6], q3[3];
  for (int i = 0; i < 6; ++i) p3[i] = 3.0f * p[i];
  for (int i = 0; i < 3; ++i) q3[i] = 0.5f * q[i];
  const int32_t draft[] = {0};
  int rejected = 0;
  for (uint64_t seed = 0; seed < 300; ++seed) {
    int32_t a1, n1, a2, n2, a3, n3;
    ASSERT_EQ(kvxfer_spec_verify_stochastic(draft, 1, p, q, 3, seed, &a1, &n1), KVXFER_SUCCESS);
    ASSERT_EQ(kvxfer_spec_verify_stochastic(draft, 1, p, q, 3, seed, &a2, &n2), KVXFER_SUCCESS);
    ASSERT_EQ(kvxfer_spec_verify_stochastic(draft, 1, p3, q3, 3, seed, &a3, &n3), KVXFER_SUCCESS);
    EXPECT_EQ(a1, a2);
    EXPECT_EQ(n1, n2);
    EXPECT_EQ(a1, a3);
    EXPECT_EQ(n1, n3);
    if (a1 == 0) {
      ++rejected;
      EXPECT_NE(n1, 0) << "the correction never repeats a token with p <= q";
    }
  }
  // Acceptance probability p(0)/q(0) = 1/6: most of the 300 are rejected.
  EXPECT_GT(rejected, 200);
  EXPECT_LT(rejected, 290);
}

TEST(SpecStochastic, BadArgumentsAreRefusedBeforeAnyOutput) {
  const float p[] = {0.5f, 0.5f, 0.5f, 0.5f};
  const float q[] = {0.5f, 0.5f};
  const float nan_q[] = {std::nanf(""), 0.5f};
  const float neg_q[] = {-0.1f, 0.5f};
  const float zero_q[] = {0.0f, 0.0f};
  const int32_t draft[] = {0};
  const int32_t out_of_range[] = {2};
  int32_t a = -7, next = -7;
  auto bad = [&](const int32_t* d, int32_t n, const float* pp, const float* qq, int32_t v,
                 const char* what) {
    EXPECT_EQ(kvxfer_spec_verify_stochastic(d, n, pp, qq, v, 1, &a, &next),
              KVXFER_ERR_INVALID_ARGUMENT)
        << what;
    EXPECT_NE(std::string(kvxfer_get_last_error()).find(what), std::string::npos)
        << kvxfer_get_last_error();
  };
  bad(draft, 1, p, nan_q, 2, "not finite");
  bad(draft, 1, p, neg_q, 2, "negative");
  bad(draft, 1, p, zero_q, 2, "sums to 0");
  bad(out_of_range, 1, p, q, 2, "outside [0, 2)");
  bad(draft, 1, p, q, 0, "vocab 0 < 1");
  bad(draft, -1, p, q, 2, "negative");
  bad(draft, 1, nullptr, q, 2, "target_probs is NULL");
  bad(draft, 1, p, nullptr, 2, "draft_probs is NULL");
  EXPECT_EQ(a, -7);
  EXPECT_EQ(next, -7);
  int32_t t = -7;
  EXPECT_EQ(kvxfer_spec_sample(zero_q, 2, 0, &t), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(t, -7);
}

// ---------------------------------------------------------------------------
// Stochastic verification: the output distribution is the target's
// ---------------------------------------------------------------------------

TEST(SpecChiSquare, StatisticIsCalibrated) {
  // Table values: P(chi2_4 > 18.467) = 0.001, P(chi2_26 > 38.885) = 0.05.
  EXPECT_NEAR(chi2_sf(18.467, 4), 0.001, 2e-6);
  EXPECT_NEAR(chi2_sf(38.885, 26), 0.05, 5e-5);
  EXPECT_NEAR(chi2_sf(4.0, 2), std::exp(-2.0), 1e-12);
}

TEST(SpecChiSquare, SamplerMatchesItsDistribution) {
  const std::vector<float> q = {0.05f, 0.1f, 0.0f, 0.25f, 0.3f, 0.3f};
  const int64_t n = 60000;
  std::vector<int64_t> counts(q.size(), 0);
  for (int64_t t = 0; t < n; ++t) counts[static_cast<size_t>(sample(q, draft_seed(t, 0)))]++;
  const Chi2 c = chi_square(counts, std::vector<double>(q.begin(), q.end()), n);
  EXPECT_TRUE(c.zero_cells_ok);
  EXPECT_GT(c.p_value, kAlpha) << "chi2 " << c.stat << " df " << c.df;
}

TEST(SpecChiSquare, OneDraftTokenGivesTheTargetDistribution) {
  // p has a zero where q has mass and much more mass than q elsewhere.
  const std::vector<float> p = {0.3f, 0.25f, 0.2f, 0.15f, 0.1f, 0.0f, /*bonus*/
                                0.1f, 0.1f,  0.2f, 0.2f,  0.2f, 0.2f};
  const std::vector<float> q = {0.05f, 0.1f, 0.1f, 0.25f, 0.3f, 0.2f};
  const std::vector<double> target(p.begin(), p.begin() + 6);
  const int64_t n = 60000;
  std::vector<int64_t> counts(6, 0), naive(6, 0);
  for (int64_t t = 0; t < n; ++t) {
    const int32_t s = sample(q, draft_seed(t, 0));
    int32_t a = -1, next = -1;
    ASSERT_EQ(kvxfer_spec_verify_stochastic(&s, 1, p.data(), q.data(), 6, static_cast<uint64_t>(t),
                                            &a, &next),
              KVXFER_SUCCESS);
    counts[static_cast<size_t>(a == 1 ? s : next)]++;
    naive[static_cast<size_t>(s)]++;  // what accepting every draft would give
  }
  const Chi2 c = chi_square(counts, target, n);
  EXPECT_TRUE(c.zero_cells_ok) << "a token with p = 0 was produced";
  EXPECT_GT(c.p_value, kAlpha) << "chi2 " << c.stat << " df " << c.df;
  // The test has power: the draft distribution itself fails it by far.
  const Chi2 w = chi_square(naive, target, n);
  EXPECT_TRUE(!w.zero_cells_ok || w.p_value < 1e-12);
}

TEST(SpecChiSquare, TwoDraftTokensGiveTheJointTargetDistribution) {
  // Three positions with their own p_i and q_i (independent of context, so
  // the target's joint law of the first three tokens is p_0 x p_1 x p_2).
  // Draft 2 tokens from q_0, q_1; verify; complete the sequence to three
  // tokens from the target itself, as decoding would.  Covers acceptance,
  // correction at either position and the bonus token.
  const int V = 3;
  const std::vector<std::vector<float>> p = {
      {0.5f, 0.3f, 0.2f}, {0.1f, 0.6f, 0.3f}, {0.25f, 0.25f, 0.5f}};
  const std::vector<std::vector<float>> q = {{0.2f, 0.3f, 0.5f}, {0.4f, 0.4f, 0.2f}};
  std::vector<float> p_rows, q_rows;
  for (const auto& r : p) p_rows.insert(p_rows.end(), r.begin(), r.end());
  for (const auto& r : q) q_rows.insert(q_rows.end(), r.begin(), r.end());
  std::vector<double> expected(V * V * V);
  for (int x = 0; x < V; ++x)
    for (int y = 0; y < V; ++y)
      for (int z = 0; z < V; ++z)
        expected[(x * V + y) * V + z] = double{p[0][x]} * p[1][y] * p[2][z];
  const int64_t n = 100000;
  std::vector<int64_t> counts(expected.size(), 0);
  int64_t full = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t draft[2] = {sample(q[0], draft_seed(t, 0)), sample(q[1], draft_seed(t, 1))};
    int32_t a = -1, next = -1;
    ASSERT_EQ(kvxfer_spec_verify_stochastic(draft, 2, p_rows.data(), q_rows.data(), V,
                                            static_cast<uint64_t>(t), &a, &next),
              KVXFER_SUCCESS);
    std::vector<int32_t> out(draft, draft + a);
    out.push_back(next);
    while (out.size() < 3)
      out.push_back(sample(p[out.size()], draft_seed(t, 4 + static_cast<int>(out.size()))));
    counts[static_cast<size_t>((out[0] * V + out[1]) * V + out[2])]++;
    if (a == 2) ++full;
  }
  const Chi2 c = chi_square(counts, expected, n);
  EXPECT_EQ(c.df, 26);
  EXPECT_GT(c.p_value, kAlpha) << "chi2 " << c.stat << " df " << c.df;
  // Both draft tokens survive with probability sum_x min(p0, q0) * sum_y min(p1, q1) = 0.7 * 0.7.
  EXPECT_NEAR(static_cast<double>(full) / n, 0.49, 0.01);
}

// ---------------------------------------------------------------------------
// Residual time and the adaptive window
// ---------------------------------------------------------------------------

namespace {

kvxfer_request_info_t progressive_info() {
  kvxfer_request_info_t i = KVXFER_REQUEST_INFO_INITIALIZER;
  i.stage = KVXFER_STAGE_ANCHOR_READY;
  i.mode = KVXFER_MODE_PROGRESSIVE;
  i.num_pages = 10;
  i.pages_anchor_ready = 10;
  i.anchor_wire_bytes = 1000000;
  i.t_posted_ns = 1000000000;
  i.t_handshake_ns = 1000000000;
  return i;
}

}  // namespace

TEST(SpecWindow, ResidualTimeFromLiveProgress) {
  kvxfer_spec_window_config_t cfg = KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER;
  kvxfer_request_info_t info = progressive_info();
  double t = -1;
  // 1 MB of anchors in 0.1 s: 10 MB/s; 0.8 MB of residual expected: 0.08 s.
  ASSERT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 100000000, &t),
            KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  EXPECT_NEAR(t, 0.08, 1e-12);
  // Half the residual in after 0.14 s in all: 1.4 MB / 0.14 s, 0.4 MB left.
  info.residual_wire_bytes = 400000;
  info.pages_complete = 5;
  ASSERT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 140000000, &t),
            KVXFER_SUCCESS);
  EXPECT_NEAR(t, 0.04, 1e-12);
  // More than the prior predicted and not complete: one more mean page.
  info.residual_wire_bytes = 900000;
  info.pages_complete = 9;
  ASSERT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 190000000, &t),
            KVXFER_SUCCESS);
  EXPECT_NEAR(t, 90000.0 / 1e7, 1e-12);
  // COMPLETE and monolithic requests have nothing left.
  info.stage = KVXFER_STAGE_COMPLETE;
  ASSERT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 1, &t), KVXFER_SUCCESS);
  EXPECT_EQ(t, 0.0);
  info = progressive_info();
  info.mode = KVXFER_MODE_MONOLITHIC;
  t = -1;
  ASSERT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 1, &t), KVXFER_SUCCESS);
  EXPECT_EQ(t, 0.0);
}

TEST(SpecWindow, ResidualTimeRefusesWhatItCannotEstimate) {
  kvxfer_spec_window_config_t cfg = KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER;
  kvxfer_request_info_t info = progressive_info();
  double t = -1;
  info.stage = KVXFER_STAGE_POSTED;
  EXPECT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 1000, &t),
            KVXFER_ERR_INVALID_USAGE);
  info = progressive_info();
  info.is_send = 1;
  EXPECT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 1000, &t),
            KVXFER_ERR_INVALID_ARGUMENT);
  info = progressive_info();
  info.stage = KVXFER_STAGE_ERROR;
  info.result = KVXFER_ERR_TIMEOUT;
  EXPECT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 1000, &t),
            KVXFER_ERR_INVALID_USAGE);
  // No elapsed time: no rate, unless the config gives one.
  info = progressive_info();
  EXPECT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns, &t),
            KVXFER_ERR_INVALID_USAGE);
  cfg.link_bytes_per_s = 8e6;
  ASSERT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns, &t), KVXFER_SUCCESS);
  EXPECT_NEAR(t, 0.1, 1e-12);
  EXPECT_EQ(kvxfer_spec_residual_time(nullptr, &info, 0, &t), KVXFER_ERR_INVALID_ARGUMENT);
  kvxfer_request_info_t raw{};
  EXPECT_EQ(kvxfer_spec_residual_time(&cfg, &raw, 0, &t), KVXFER_ERR_INVALID_ARGUMENT);
  cfg.residual_ratio = 0;
  EXPECT_EQ(kvxfer_spec_residual_time(&cfg, &info, 0, &t), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NEAR(t, 0.1, 1e-12) << "output written on failure";
}

// An info with a stage or mode outside its enum (the caller's own struct),
// or one whose estimate overflows, is refused; nothing is written.
TEST(SpecWindow, ResidualTimeRefusesBadEnumsAndAnOverflow) {
  kvxfer_spec_window_config_t cfg = KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER;
  double t = -1;
  kvxfer_request_info_t info = progressive_info();
  info.stage = static_cast<kvxfer_stage_t>(9);
  EXPECT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 1000, &t),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("stage 9 or mode 1"), std::string::npos);
  info = progressive_info();
  info.mode = static_cast<kvxfer_mode_t>(9);
  EXPECT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 1000, &t),
            KVXFER_ERR_INVALID_ARGUMENT);
  info = progressive_info();
  cfg.residual_ratio = 1e308;  // left = 1e308 * 1e6 bytes
  EXPECT_EQ(kvxfer_spec_residual_time(&cfg, &info, info.t_handshake_ns + 1000000, &t),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("overflows"), std::string::npos);
  EXPECT_EQ(t, -1);
}

TEST(SpecWindow, CeilOfResidualOverTpotPlusMarginClamped) {
  kvxfer_spec_window_config_t cfg = KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER;
  int32_t w = -1;
  ASSERT_EQ(kvxfer_spec_window(&cfg, 0.08, 0.01, 0.0, &w), KVXFER_SUCCESS);
  EXPECT_EQ(w, 8 + 2);
  ASSERT_EQ(kvxfer_spec_window(&cfg, 0.0801, 0.01, 0.0, &w), KVXFER_SUCCESS);
  EXPECT_EQ(w, 9 + 2);
  // Re-estimated later: elapsed + remaining, margin added once.
  ASSERT_EQ(kvxfer_spec_window(&cfg, 0.03, 0.01, 0.05, &w), KVXFER_SUCCESS);
  EXPECT_EQ(w, 8 + 2);
  ASSERT_EQ(kvxfer_spec_window(&cfg, 0.0, 0.01, 0.0, &w), KVXFER_SUCCESS);
  EXPECT_EQ(w, 2);
  // KVXFER_SPEC_MAX (default 64) and the caller's cap.
  ASSERT_EQ(kvxfer_spec_window(&cfg, 10.0, 0.01, 0.0, &w), KVXFER_SUCCESS);
  EXPECT_EQ(w, 64);
  ASSERT_EQ(kvxfer_spec_window(&cfg, 1e300, 1e-300, 0.0, &w), KVXFER_SUCCESS);
  EXPECT_EQ(w, 64);
  cfg.max_tokens = 5;
  ASSERT_EQ(kvxfer_spec_window(&cfg, 10.0, 0.01, 0.0, &w), KVXFER_SUCCESS);
  EXPECT_EQ(w, 5);
  cfg.margin = 0;
  cfg.max_tokens = 0;
  ASSERT_EQ(kvxfer_spec_window(&cfg, 0.0, 0.01, 0.0, &w), KVXFER_SUCCESS);
  EXPECT_EQ(w, 0);
  EXPECT_EQ(kvxfer_spec_window(&cfg, 0.1, 0.0, 0.0, &w), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_window(&cfg, -0.1, 0.01, 0.0, &w), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_window(&cfg, std::nan(""), 0.01, 0.0, &w), KVXFER_ERR_INVALID_ARGUMENT);
  cfg.margin = -1;
  EXPECT_EQ(kvxfer_spec_window(&cfg, 0.1, 0.01, 0.0, &w), KVXFER_ERR_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// Acceptance monitor
// ---------------------------------------------------------------------------

namespace {

std::atomic<int> g_fallback_logs{0};
void count_fallback_logs(kvxfer::LogLevel level, uint32_t, const char* msg) {
  if (level == kvxfer::LOG_WARN && std::strstr(msg, "speculative decoding off") != nullptr)
    g_fallback_logs++;
}

}  // namespace

TEST(SpecMonitor, FallsBackOnceBelowTheThresholdAndStays) {
  kvxfer::set_log_sink(count_fallback_logs);
  g_fallback_logs = 0;
  kvxfer_spec_monitor_t m = KVXFER_SPEC_MONITOR_INITIALIZER;
  m.min_accept = 0.5;
  int32_t spec = -1;
  double rate = -1;
  ASSERT_EQ(kvxfer_spec_monitor_query(&m, &spec, &rate), KVXFER_SUCCESS);
  EXPECT_EQ(spec, 1);
  EXPECT_EQ(rate, 1.0);
  ASSERT_EQ(kvxfer_spec_monitor_update(&m, 10, 10, &spec), KVXFER_SUCCESS);
  ASSERT_EQ(kvxfer_spec_monitor_update(&m, 10, 2, &spec), KVXFER_SUCCESS);
  EXPECT_EQ(m.accepted, 12);
  EXPECT_EQ(m.rejected, 1);
  EXPECT_EQ(m.full_accepts, 1);
  EXPECT_EQ(m.drafted, 20);
  ASSERT_EQ(kvxfer_spec_monitor_query(&m, &spec, &rate), KVXFER_SUCCESS);
  EXPECT_DOUBLE_EQ(rate, 12.0 / 13.0);
  // Each (5, 0) pass examines one token and rejects it: 12 / (13 + k) < 0.5
  // first at k = 12.
  for (int k = 1; k <= 12; ++k) {
    ASSERT_EQ(kvxfer_spec_monitor_update(&m, 5, 0, &spec), KVXFER_SUCCESS);
    EXPECT_EQ(spec, k < 12 ? 1 : 0) << k;
  }
  EXPECT_EQ(m.fallen_back, 1);
  // Sticky, and logged once.
  for (int k = 0; k < 5; ++k)
    ASSERT_EQ(kvxfer_spec_monitor_update(&m, 8, 8, &spec), KVXFER_SUCCESS);
  EXPECT_EQ(spec, 0);
  EXPECT_EQ(g_fallback_logs.load(), 1);
  kvxfer::set_log_sink(nullptr);
}

TEST(SpecMonitor, NeedsMinTokensAndUsesTheEnvironmentDefault) {
  kvxfer_spec_monitor_t m =
      KVXFER_SPEC_MONITOR_INITIALIZER;  // min_accept < 0: KVXFER_SPEC_MIN_ACCEPT
  int32_t spec = -1;
  for (int k = 0; k < 15; ++k)
    ASSERT_EQ(kvxfer_spec_monitor_update(&m, 3, 0, &spec), KVXFER_SUCCESS);
  EXPECT_EQ(spec, 1) << "15 examined tokens < min_tokens 16";
  ASSERT_EQ(kvxfer_spec_monitor_update(&m, 3, 0, &spec), KVXFER_SUCCESS);
  EXPECT_EQ(spec, 0);
  // Draft length 0 examines nothing.
  kvxfer_spec_monitor_t z = KVXFER_SPEC_MONITOR_INITIALIZER;
  for (int k = 0; k < 40; ++k)
    ASSERT_EQ(kvxfer_spec_monitor_update(&z, 0, 0, &spec), KVXFER_SUCCESS);
  EXPECT_EQ(spec, 1);
  EXPECT_EQ(z.rejected, 0);
  EXPECT_EQ(z.full_accepts, 0);
}

TEST(SpecMonitor, TpotMovingAverageAndBadInput) {
  kvxfer_spec_monitor_t m = KVXFER_SPEC_MONITOR_INITIALIZER;
  ASSERT_EQ(kvxfer_spec_monitor_record_step(&m, 0.010), KVXFER_SUCCESS);
  EXPECT_DOUBLE_EQ(m.tpot_s, 0.010);
  ASSERT_EQ(kvxfer_spec_monitor_record_step(&m, 0.020), KVXFER_SUCCESS);
  EXPECT_DOUBLE_EQ(m.tpot_s, 0.8 * 0.010 + 0.2 * 0.020);
  EXPECT_EQ(kvxfer_spec_monitor_record_step(&m, 0.0), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_monitor_update(&m, 3, 4, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m.rounds, 0);
  kvxfer_spec_monitor_t raw{};
  EXPECT_EQ(kvxfer_spec_monitor_update(&raw, 1, 1, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  m.min_accept = 1.5;
  EXPECT_EQ(kvxfer_spec_monitor_update(&m, 1, 1, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// The environment (read once per process: each case runs in a re-executed child)
// ---------------------------------------------------------------------------

// In the child: sets KVXFER_SPEC_MIN_ACCEPT=`value` and exits 0 when two
// different kvxfer_spec_* calls fail naming the variable and its value.
[[noreturn]] void ExpectMalformedMinAccept(const char* value) {
  setenv("KVXFER_SPEC_MIN_ACCEPT", value, 1);
  const int32_t target[] = {1};
  int32_t a = 0, n = 0;
  const kvxfer_result_t r1 = kvxfer_spec_verify_greedy(nullptr, 0, target, &a, &n);
  const std::string text = kvxfer_get_last_error();
  kvxfer_spec_monitor_t m = KVXFER_SPEC_MONITOR_INITIALIZER;
  const kvxfer_result_t r2 = kvxfer_spec_monitor_update(&m, 1, 1, nullptr);
  std::fprintf(stderr, "%s\n", text.c_str());
  const std::string want =
      std::string("malformed environment: KVXFER_SPEC_MIN_ACCEPT='") + value + "'";
  std::_Exit(r1 == KVXFER_ERR_INVALID_ARGUMENT && r2 == KVXFER_ERR_INVALID_ARGUMENT &&
                     text.find(want) != std::string::npos
                 ? 0
                 : 1);
}

// In the child: KVXFER_SPEC_MIN_ACCEPT=0.9 makes a monitor at 0.8 fall back,
// and KVXFER_SPEC_MAX=8 caps the window.
[[noreturn]] void ExpectMinAcceptAndSpecMaxHonoured() {
  setenv("KVXFER_SPEC_MIN_ACCEPT", "0.9", 1);
  setenv("KVXFER_SPEC_MAX", "8", 1);
  kvxfer_spec_monitor_t m = KVXFER_SPEC_MONITOR_INITIALIZER;
  int32_t spec = -1, w = -1;
  for (int k = 0; k < 4; ++k) kvxfer_spec_monitor_update(&m, 5, 4, &spec);  // 16 / 20 = 0.8
  kvxfer_spec_window_config_t cfg = KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER;
  const kvxfer_result_t r = kvxfer_spec_window(&cfg, 1.0, 0.01, 0.0, &w);
  std::_Exit(spec == 0 && r == KVXFER_SUCCESS && w == 8 ? 0 : 1);
}

// In the child: a malformed KVXFER_SPEC_MAX fails the spec calls too (params::validate).
[[noreturn]] void ExpectMalformedSpecMax() {
  setenv("KVXFER_SPEC_MAX", "-1", 1);
  int32_t w = -1;
  kvxfer_spec_window_config_t cfg = KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER;
  const kvxfer_result_t r = kvxfer_spec_window(&cfg, 1.0, 0.01, 0.0, &w);
  std::fprintf(stderr, "%s\n", kvxfer_get_last_error());
  std::_Exit(r == KVXFER_ERR_INVALID_ARGUMENT ? 0 : 1);
}

class SpecEnvironment : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(SpecEnvironment, MalformedMinAcceptFailsEverySpecCall) {
  for (const char* v : {"half", "0.5x", "2", "", "nan", "-0.1"})
    EXPECT_EXIT(ExpectMalformedMinAccept(v), ::testing::ExitedWithCode(0), "KVXFER_SPEC_MIN_ACCEPT")
        << "'" << v << "'";
}

TEST_F(SpecEnvironment, MinAcceptAndSpecMaxAreHonoured) {
  EXPECT_EXIT(ExpectMinAcceptAndSpecMaxHonoured(), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(ExpectMalformedSpecMax(), ::testing::ExitedWithCode(0), "KVXFER_SPEC_MAX='-1'");
}

// ---------------------------------------------------------------------------
// Latency model
// ---------------------------------------------------------------------------

namespace {

kvxfer_spec_model_input_t model_input() {
  kvxfer_spec_model_input_t in = KVXFER_SPEC_MODEL_INPUT_INITIALIZER;
  in.link_bytes_per_s = 1e6;
  in.t_fixed_s = 0.001;
  in.tpot_s = 0.001;
  in.t_verify_base_s = 0.0005;
  in.t_verify_per_token_s = 0.0001;
  in.bytes[KVXFER_SPEC_SCHEME_BF16] = 100000;
  in.bytes[KVXFER_SPEC_SCHEME_INT8] = 56000;
  in.bytes[KVXFER_SPEC_SCHEME_INT4] = 32000;
  in.anchor_bytes = 32000;
  in.residual_bytes = 24000;
  in.accept_rate = 0.5;
  in.num_tokens = 64;
  return in;
}

}  // namespace

TEST(SpecModel, MonolithicAndAdaptiveLynx) {
  const kvxfer_spec_model_input_t in = model_input();
  kvxfer_spec_model_output_t o = KVXFER_SPEC_MODEL_OUTPUT_INITIALIZER;
  ASSERT_EQ(kvxfer_spec_ttft_model(&in, &o), KVXFER_SUCCESS) << kvxfer_get_last_error();
  // (16)-(18)
  EXPECT_NEAR(o.ttft_s[KVXFER_SPEC_SCHEME_BF16], 0.001 + 0.1 + 0.001, 1e-12);
  EXPECT_NEAR(o.ttft_s[KVXFER_SPEC_SCHEME_INT8], 0.001 + 0.056 + 0.001, 1e-12);
  EXPECT_NEAR(o.ttft_s[KVXFER_SPEC_SCHEME_INT4], 0.001 + 0.032 + 0.001, 1e-12);
  EXPECT_NEAR(o.ttnt_s[KVXFER_SPEC_SCHEME_INT8], 0.057 + 0.064, 1e-12);
  // (19): t_res = 24 ms, adaptive k = 24 + 2, no exposure, 24 drafted.
  EXPECT_NEAR(o.t_res_s, 0.024, 1e-12);
  EXPECT_EQ(o.window, 26);
  EXPECT_EQ(o.drafted, 24);
  EXPECT_EQ(o.exposure_s, 0.0);
  // (20): the first token comes from the anchors, like INT4's.
  const int L = KVXFER_SPEC_SCHEME_LYNX;
  EXPECT_NEAR(o.ttft_s[L], 0.033 + 0.001, 1e-12);
  EXPECT_NEAR(o.ttft_s[L] / o.ttft_s[KVXFER_SPEC_SCHEME_INT4], 1.0, 1e-12);
  EXPECT_LT(o.ttft_s[L] / o.ttft_s[KVXFER_SPEC_SCHEME_INT8], 0.6);
  const double commit = 0.033 + 0.024 + 0.0005 + 0.0001 * 25;
  EXPECT_NEAR(o.ttft_commit_s[L], commit, 1e-12);
  const double abar = 0.5 * (1 - std::pow(0.5, 24)) / 0.5;
  EXPECT_NEAR(o.expected_accepted, abar, 1e-12);
  EXPECT_NEAR(o.ttnt_s[L], commit + (64 - abar - 1) * 0.001, 1e-12);
}

TEST(SpecModel, FixedWindowsExposeTheResidual) {
  kvxfer_spec_model_input_t in = model_input();
  kvxfer_spec_model_output_t o = KVXFER_SPEC_MODEL_OUTPUT_INITIALIZER;
  in.window = 10;
  ASSERT_EQ(kvxfer_spec_ttft_model(&in, &o), KVXFER_SUCCESS);
  EXPECT_NEAR(o.exposure_s, 0.014, 1e-12);
  EXPECT_EQ(o.drafted, 10);
  const int L = KVXFER_SPEC_SCHEME_LYNX;
  EXPECT_NEAR(o.ttft_commit_s[L], 0.033 + 0.010 + 0.014 + 0.0005 + 0.0001 * 11, 1e-12);
  // No speculation: Lynx waits for the residual, like a monolithic INT8.
  in.window = 0;
  ASSERT_EQ(kvxfer_spec_ttft_model(&in, &o), KVXFER_SUCCESS);
  EXPECT_NEAR(o.exposure_s, 0.024, 1e-12);
  EXPECT_NEAR(o.ttft_s[L], 0.033 + 0.024 + 0.0006, 1e-12);
  EXPECT_EQ(o.ttft_s[L], o.ttft_commit_s[L]);
  // The adaptive window clamped by max_window.
  in.window = -1;
  in.max_window = 4;
  in.accept_rate = 1.0;
  ASSERT_EQ(kvxfer_spec_ttft_model(&in, &o), KVXFER_SUCCESS);
  EXPECT_EQ(o.window, 4);
  EXPECT_NEAR(o.exposure_s, 0.020, 1e-12);
  EXPECT_EQ(o.expected_accepted, 4.0);
  // Verifying only a prefix of the draft: v = 2 of the 4.
  in.max_verify = 2;
  ASSERT_EQ(kvxfer_spec_ttft_model(&in, &o), KVXFER_SUCCESS);
  EXPECT_EQ(o.drafted, 4);
  EXPECT_EQ(o.verified, 2);
  EXPECT_EQ(o.expected_accepted, 2.0);
  EXPECT_NEAR(o.ttft_commit_s[L], 0.033 + 0.024 + 0.0005 + 0.0001 * 3, 1e-12);
  in.max_verify = 0;
  // A burst lets the first b bytes through at once.
  in.burst_bytes = 8000;
  ASSERT_EQ(kvxfer_spec_ttft_model(&in, &o), KVXFER_SUCCESS);
  EXPECT_NEAR(o.t_ready_s[KVXFER_SPEC_SCHEME_INT4], 0.001 + 0.024, 1e-12);
}

TEST(SpecModel, BadInputIsRefused) {
  kvxfer_spec_model_output_t o = KVXFER_SPEC_MODEL_OUTPUT_INITIALIZER;
  auto refuse = [&](void (*edit)(kvxfer_spec_model_input_t*)) {
    kvxfer_spec_model_input_t in = model_input();
    edit(&in);
    return kvxfer_spec_ttft_model(&in, &o);
  };
  EXPECT_EQ(refuse([](kvxfer_spec_model_input_t* i) { i->link_bytes_per_s = 0; }),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(refuse([](kvxfer_spec_model_input_t* i) { i->tpot_s = -1; }),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(refuse([](kvxfer_spec_model_input_t* i) { i->accept_rate = 1.5; }),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(refuse([](kvxfer_spec_model_input_t* i) { i->max_verify = -1; }),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(refuse([](kvxfer_spec_model_input_t* i) { i->num_tokens = 0; }),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(refuse([](kvxfer_spec_model_input_t* i) { i->bytes[1] = std::nan(""); }),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(refuse([](kvxfer_spec_model_input_t* i) { i->size = 0; }), KVXFER_ERR_INVALID_ARGUMENT);
  const kvxfer_spec_model_input_t in = model_input();
  EXPECT_EQ(kvxfer_spec_ttft_model(&in, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// Greedy speculative decoding of stories260K on anchor-only KV
// ---------------------------------------------------------------------------

namespace {

const char* kModelPath = KVXFER_DATA_DIR "/stories260K.bin";

// Round-trips one layer's K or V ([n][kv_dim] float32, in place) through the
// Lynx codec, keeping only the anchor (anchor_only) or everything.
void codec_roundtrip(float* rows, int n, int kv_dim, uint32_t layer, kvxfer_kv_kind_t kind,
                     bool anchor_only) {
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  void* block = rows;
  kvxfer_page_layout_t lay{&block, 1, n, kv_dim, 0, n, kv_dim, KVXFER_DTYPE_FP32};
  kvxfer_page_id_t id{layer, kind, 0, 0};
  size_t acap = 0, rcap = 0, alen = 0, rlen = 0;
  ASSERT_EQ(kvxfer_page_max_size(&cfg, n, kv_dim, &acap, &rcap), KVXFER_SUCCESS);
  std::vector<uint8_t> a(acap), r(rcap);
  ASSERT_EQ(kvxfer_page_encode(&cfg, &id, &lay, a.data(), acap, &alen, r.data(), rcap, &rlen),
            KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_page_decode(a.data(), alen, anchor_only ? nullptr : r.data(),
                               anchor_only ? 0 : rlen, &id, &lay),
            KVXFER_SUCCESS)
      << kvxfer_get_last_error();
}

km::KVView view_of(const km::KVCache& c) { return c.view(); }

}  // namespace

// A link rate so small that the times overflow (a subnormal R) is refused,
// not answered with infinities and success.
TEST(SpecModel, TimesThatOverflowAreRefused) {
  kvxfer_spec_model_input_t in = model_input();
  in.link_bytes_per_s = 1e-320;
  kvxfer_spec_model_output_t o = KVXFER_SPEC_MODEL_OUTPUT_INITIALIZER;
  const kvxfer_spec_model_output_t before = o;
  EXPECT_EQ(kvxfer_spec_ttft_model(&in, &o), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("overflow"), std::string::npos);
  EXPECT_EQ(std::memcmp(&o, &before, sizeof(o)), 0) << "output written on failure";
}

TEST(SpecModelRun, DraftOnAnchorsVerifyOnFullIsIdenticalToFullDecoding) {
  // One thread: the model is tiny, and OpenMP teams on a loaded 2-core machine
  // cost far more than they save (the results are bit-identical either way).
  omp_set_num_threads(1);
  std::string err;
  std::unique_ptr<km::Model> m = km::Model::load(kModelPath, &err);
  ASSERT_NE(m, nullptr) << "cannot load " << kModelPath << ": " << err;
  const km::Config& c = m->config();
  // Prompt: BOS and 120 greedy tokens; the KV covers all but the last.
  std::vector<int> prompt = {1};
  {
    km::KVCache tail;
    std::vector<float> logits;
    for (int pos = 0; pos < 120; ++pos) {
      ASSERT_TRUE(m->decode_step(prompt.back(), pos, km::KVView{}, &tail, &logits, &err)) << err;
      prompt.push_back(km::argmax(logits.data(), logits.size()));
    }
  }
  const int P = static_cast<int>(prompt.size());
  km::PrefillResult pre;
  ASSERT_TRUE(m->prefill(std::vector<int>(prompt.begin(), prompt.end() - 1), {}, &pre, &err))
      << err;
  km::KVCache full = pre.kv, anchor = pre.kv;
  for (int l = 0; l < c.n_layers; ++l) {
    codec_roundtrip(full.k(l), P - 1, c.kv_dim(), l, KVXFER_KV_KEY, false);
    codec_roundtrip(full.v(l), P - 1, c.kv_dim(), l, KVXFER_KV_VALUE, false);
    codec_roundtrip(anchor.k(l), P - 1, c.kv_dim(), l, KVXFER_KV_KEY, true);
    codec_roundtrip(anchor.v(l), P - 1, c.kv_dim(), l, KVXFER_KV_VALUE, true);
  }
  const km::KVView fv = view_of(full), av = view_of(anchor);
  const int N = 48;
  // Reference: plain greedy decoding on the full KV.
  std::vector<int> ref;
  {
    km::KVCache tail;
    std::vector<float> logits;
    int tok = prompt.back();
    for (int i = 0; i < N; ++i) {
      ASSERT_TRUE(m->decode_step(tok, P - 1 + i, fv, &tail, &logits, &err)) << err;
      tok = km::argmax(logits.data(), logits.size());
      ref.push_back(tok);
    }
  }
  // Speculative: rounds of `k` draft tokens on the anchor KV, each verified in
  // one batched pass on the full KV.
  kvxfer_spec_monitor_t mon = KVXFER_SPEC_MONITOR_INITIALIZER;
  mon.min_accept = 0.0;
  for (int k : {0, 1, 4, 16}) {
    std::vector<int> out;
    km::KVCache vtail;  // full-KV rows of the accepted tokens
    int tok = prompt.back();
    while (static_cast<int>(out.size()) < N) {
      const int pos = P - 1 + static_cast<int>(out.size());
      // The draft tail starts as a copy of the verified tail (same rows).
      km::KVCache dtail = vtail;
      std::vector<int32_t> draft;
      std::vector<float> logits;
      int t = tok;
      for (int i = 0; i < k && pos + i + 1 < c.seq_len; ++i) {
        ASSERT_TRUE(m->decode_step(t, pos + i, av, &dtail, &logits, &err)) << err;
        t = km::argmax(logits.data(), logits.size());
        draft.push_back(t);
      }
      std::vector<int> batch = {tok};
      batch.insert(batch.end(), draft.begin(), draft.end());
      const int before = vtail.n_tokens();
      ASSERT_TRUE(m->verify(batch, pos, fv, &vtail, &logits, &err)) << err;
      std::vector<int32_t> target(batch.size());
      for (size_t i = 0; i < batch.size(); ++i)
        target[i] = km::argmax(logits.data() + i * c.vocab_size, c.vocab_size);
      int32_t a = -1, next = -1;
      ASSERT_EQ(kvxfer_spec_verify_greedy(draft.data(), static_cast<int32_t>(draft.size()),
                                          target.data(), &a, &next),
                KVXFER_SUCCESS);
      ASSERT_EQ(kvxfer_spec_monitor_update(&mon, static_cast<int32_t>(draft.size()), a, nullptr),
                KVXFER_SUCCESS);
      vtail.truncate(before + 1 + a);  // rows of tok and the accepted draft
      out.insert(out.end(), draft.begin(), draft.begin() + a);
      out.push_back(next);
      tok = next;
    }
    out.resize(N);
    EXPECT_EQ(out, ref) << "window " << k;
  }
  double rate = 0;
  int32_t spec = 0;
  ASSERT_EQ(kvxfer_spec_monitor_query(&mon, &spec, &rate), KVXFER_SUCCESS);
  std::printf(
      "stories260K, %d-token prompt, anchor-only drafts: per-token acceptance %.3f "
      "(%lld accepted, %lld rejections, %lld drafted)\n",
      P, rate, static_cast<long long>(mon.accepted), static_cast<long long>(mon.rejected),
      static_cast<long long>(mon.drafted));
  EXPECT_GT(mon.accepted, 0);
}

// kvxfer_spec_verify_length: the v in [1, draft_len] with the most expected
// final tokens per second, E(v) / t_ver(v), or 0 when a decode step does
// better.  The expectation here is the closed form (1 - a^(v+1)) / (1 - a)
// over every v, not the function's running sum and early stop.
int32_t best_length_brute_force(int32_t d, double a, double tpot, double base, double per) {
  double best = -1.0;
  int32_t best_v = 0;
  for (int32_t v = 1; v <= d; ++v) {
    const double e = a >= 1.0 ? v + 1.0 : (1.0 - std::pow(a, v + 1.0)) / (1.0 - a);
    const double r = e / (base + per * (v + 1.0));
    if (r >= best) {
      best = r;
      best_v = v;
    }
  }
  return d > 0 && best * tpot >= 1.0 ? best_v : 0;
}

TEST(SpecVerifyLength, ChecksTheLengthWithTheMostTokensPerSecond) {
  int32_t n = -1;
  // a = 0.9: v = 6 drafts (7 tokens) cost 10 + 3 * 7 = 31 ms and commit
  // (1 - 0.9^7) / 0.1 = 5.217 tokens, 168.3/s, above v = 5 (28 ms, 4.686:
  // 167.3/s) and v = 7 (34 ms, 5.695: 167.5/s).
  ASSERT_EQ(kvxfer_spec_verify_length(64, 0.9, 0.030, 0.010, 0.003, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 6);
  ASSERT_EQ(kvxfer_spec_verify_length(4, 0.9, 0.030, 0.010, 0.003, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 4);  // the draft is shorter than the best pass
  // SmolLM2 on the 2-core CPU (docs/SPEC.md): base 1.2 ms, 0.47 ms/token,
  // TPOT 2.1 ms, a = 0.977.
  ASSERT_EQ(kvxfer_spec_verify_length(64, 0.977, 0.0021, 0.0012, 0.00047, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 13);
  // Every draft token accepted: longer passes only amortise the base.
  ASSERT_EQ(kvxfer_spec_verify_length(64, 1.0, 0.030, 0.010, 0.003, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 64);
  // No per-token cost (a GPU): the whole draft.
  ASSERT_EQ(kvxfer_spec_verify_length(64, 0.95, 0.030, 0.010, 0.0, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 64);
  // Free passes: the whole draft.
  ASSERT_EQ(kvxfer_spec_verify_length(64, 0.5, 0.030, 0.0, 0.0, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 64);
  // A pass of one draft commits 1.5 tokens in 40 ms: 37.5/s, below a 20 ms
  // decode step's 50/s.
  ASSERT_EQ(kvxfer_spec_verify_length(64, 0.5, 0.020, 0.020, 0.010, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 0);
  // At the boundary the pass is taken: 1.5 tokens in 0.375 s = 1 / 0.25 s
  // (values exact in binary).
  ASSERT_EQ(kvxfer_spec_verify_length(64, 0.5, 0.25, 0.125, 0.125, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 1);
  ASSERT_EQ(kvxfer_spec_verify_length(0, 0.9, 0.030, 0.010, 0.003, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 0);
  // A grid against the brute force.
  for (double a : {0.0, 0.3, 0.7, 0.9, 0.977, 0.999, 1.0})
    for (double base : {0.0005, 0.002, 0.01})
      for (double per : {0.0001, 0.0005, 0.003})
        for (int32_t d : {1, 7, 64, 300}) {
          ASSERT_EQ(kvxfer_spec_verify_length(d, a, 0.004, base, per, &n), KVXFER_SUCCESS);
          EXPECT_EQ(n, best_length_brute_force(d, a, 0.004, base, per))
              << "a " << a << " base " << base << " per " << per << " d " << d;
        }
}

TEST(SpecVerifyLength, RejectsBadArguments) {
  int32_t n = 0;
  EXPECT_EQ(kvxfer_spec_verify_length(64, 0.9, 0.03, 0.01, 0.003, nullptr),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_length(-1, 0.9, 0.03, 0.01, 0.003, &n), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_length(64, 1.1, 0.03, 0.01, 0.003, &n), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_length(64, std::nan(""), 0.03, 0.01, 0.003, &n),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_length(64, 0.9, 0.0, 0.01, 0.003, &n), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_length(64, 0.9, 0.03, -0.01, 0.003, &n),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("verify_base_s"), std::string::npos);
  EXPECT_EQ(
      kvxfer_spec_verify_length(64, 0.9, 0.03, std::numeric_limits<double>::infinity(), 0.003, &n),
      KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_spec_verify_length(64, 0.9, 0.03, 0.01, -1.0, &n), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("verify_per_token_s"), std::string::npos);
}

// Costs that are subnormal, or huge, give the same length as the same costs
// in seconds: the rates are compared, not their magnitude (they once all
// overflowed to infinity and the whole draft won the tie).  A draft longer
// than kvxfer can verify is refused at once, not scanned for seconds.
TEST(SpecVerifyLength, TheScaleOfTheCostsDoesNotChangeTheLength) {
  int32_t n = -1, want = -1;
  for (double scale : {1e-310, 1e-300, 1.0, 1e300}) {
    // No fixed cost: E(v) / (v + 1) falls from v = 1 (0.75 tokens per
    // `scale` seconds), above a decode step's 0.5: the shortest pass.
    ASSERT_EQ(kvxfer_spec_verify_length(64, 0.5, 2.0 * scale, 0.0, scale, &n), KVXFER_SUCCESS)
        << scale;
    EXPECT_EQ(n, 1) << scale;
    ASSERT_EQ(kvxfer_spec_verify_length(64, 0.9, 0.030 * scale, 0.010 * scale, 0.003 * scale, &n),
              KVXFER_SUCCESS);
    want = best_length_brute_force(64, 0.9, 0.030, 0.010, 0.003);
    EXPECT_EQ(n, want) << scale;
  }
  EXPECT_EQ(want, 6);
  ASSERT_EQ(kvxfer_spec_verify_length(65536, 0.9, 1.0, 1.0, 0.0, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 65536);  // no per-token cost: the whole draft, without a scan
  EXPECT_EQ(kvxfer_spec_verify_length(65537, 0.9, 1.0, 1.0, 0.0, &n), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("draft_len 65537 exceeds 65536"),
            std::string::npos);
  EXPECT_EQ(n, 65536);
}
