// Greedy and stochastic verification of a draft (include/kvxfer/spec.h,
// docs/SPEC.md "Verification"), and the counter-based RNG they share.
#include <cmath>
#include <vector>

#include "common/error.h"
#include "speculative/spec_impl.h"

namespace kvxfer::spec {

uint64_t splitmix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

double uniform(uint64_t seed, uint64_t draw) {
  const uint64_t z = splitmix64(seed + (draw + 1) * 0x9E3779B97F4A7C15ull);
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

namespace {

// Checks one probability row and returns its sum (double) in *sum.
kvxfer_result_t check_row(const float* row, int32_t vocab, const char* what, int32_t index,
                          double* sum) {
  double s = 0.0;
  for (int32_t x = 0; x < vocab; ++x) {
    const float v = row[x];
    if (!std::isfinite(v) || v < 0.0f)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                       "%s row %d, token %d: probability %g is negative or not finite", what, index,
                       x, static_cast<double>(v));
    s += static_cast<double>(v);
  }
  if (!(s > 0.0)) return set_error(KVXFER_ERR_INVALID_ARGUMENT, "%s row %d sums to 0", what, index);
  *sum = s;
  return KVXFER_SUCCESS;
}

// Inverse CDF: the first token whose cumulative weight exceeds u * total,
// skipping zero weights; rounding at the top end falls back to the last token
// of positive weight.
int32_t pick(const std::vector<double>& w, double total, double u) {
  const double target = u * total;
  double c = 0.0;
  int32_t last = -1;
  for (size_t x = 0; x < w.size(); ++x) {
    if (!(w[x] > 0.0)) continue;
    c += w[x];
    last = static_cast<int32_t>(x);
    if (target < c) return last;
  }
  return last;
}

}  // namespace

kvxfer_result_t verify_greedy(const int32_t* draft, int32_t draft_len, const int32_t* target,
                              int32_t* accepted, int32_t* next_token) {
  KVXFER_REQUIRE(draft_len >= 0, "draft_len %d is negative", draft_len);
  KVXFER_REQUIRE(draft != nullptr || draft_len == 0, "draft is NULL");
  KVXFER_REQUIRE(target != nullptr, "target is NULL");
  KVXFER_REQUIRE(accepted != nullptr && next_token != nullptr, "accepted or next_token is NULL");
  for (int32_t i = 0; i < draft_len; ++i)
    KVXFER_REQUIRE(draft[i] >= 0, "draft[%d] = %d is not a token id", i, draft[i]);
  for (int32_t i = 0; i <= draft_len; ++i)
    KVXFER_REQUIRE(target[i] >= 0, "target[%d] = %d is not a token id", i, target[i]);
  int32_t a = 0;
  while (a < draft_len && draft[a] == target[a]) ++a;
  *accepted = a;
  *next_token = target[a];
  return KVXFER_SUCCESS;
}

kvxfer_result_t verify_stochastic(const int32_t* draft, int32_t draft_len, const float* p,
                                  const float* q, int32_t vocab, uint64_t seed, int32_t* accepted,
                                  int32_t* next_token) {
  KVXFER_REQUIRE(draft_len >= 0, "draft_len %d is negative", draft_len);
  KVXFER_REQUIRE(vocab >= 1, "vocab %d < 1", vocab);
  KVXFER_REQUIRE(draft != nullptr || draft_len == 0, "draft is NULL");
  KVXFER_REQUIRE(q != nullptr || draft_len == 0, "draft_probs is NULL");
  KVXFER_REQUIRE(p != nullptr, "target_probs is NULL");
  KVXFER_REQUIRE(accepted != nullptr && next_token != nullptr, "accepted or next_token is NULL");
  const size_t V = static_cast<size_t>(vocab);
  // Validate everything first: no result is written for bad input.
  std::vector<double> psum(static_cast<size_t>(draft_len) + 1),
      qsum(static_cast<size_t>(draft_len));
  for (int32_t i = 0; i < draft_len; ++i)
    KVXFER_REQUIRE(draft[i] >= 0 && draft[i] < vocab, "draft[%d] = %d is outside [0, %d)", i,
                   draft[i], vocab);
  for (int32_t i = 0; i <= draft_len; ++i)
    KVXFER_CHECK(check_row(p + static_cast<size_t>(i) * V, vocab, "target_probs", i, &psum[i]));
  for (int32_t i = 0; i < draft_len; ++i)
    KVXFER_CHECK(check_row(q + static_cast<size_t>(i) * V, vocab, "draft_probs", i, &qsum[i]));

  std::vector<double> w(V);
  for (int32_t i = 0; i < draft_len; ++i) {
    const float* pi = p + static_cast<size_t>(i) * V;
    const float* qi = q + static_cast<size_t>(i) * V;
    const int32_t s = draft[i];
    const double ps = static_cast<double>(pi[s]) / psum[i];
    const double qs = static_cast<double>(qi[s]) / qsum[i];
    // Eq. 10: accept with probability min(1, p/q), written without a division.
    if (uniform(seed, 2 * static_cast<uint64_t>(i)) * qs < ps) continue;
    // Eq. 11: first rejection; resample from norm(max(0, p - q)).
    double total = 0.0;
    for (size_t x = 0; x < V; ++x) {
      const double d = static_cast<double>(pi[x]) / psum[i] - static_cast<double>(qi[x]) / qsum[i];
      w[x] = d > 0.0 ? d : 0.0;
      total += w[x];
    }
    if (!(total > 0.0)) {  // p == q: only a draft token q never proposes gets here
      for (size_t x = 0; x < V; ++x) w[x] = static_cast<double>(pi[x]);
      total = psum[i];
    }
    *accepted = i;
    *next_token = pick(w, total, uniform(seed, 2 * static_cast<uint64_t>(i) + 1));
    return KVXFER_SUCCESS;
  }
  // Every draft token accepted: the bonus token comes from the last target row.
  const float* pd = p + static_cast<size_t>(draft_len) * V;
  for (size_t x = 0; x < V; ++x) w[x] = static_cast<double>(pd[x]);
  *accepted = draft_len;
  *next_token = pick(w, psum[draft_len], uniform(seed, 2 * static_cast<uint64_t>(draft_len) + 1));
  return KVXFER_SUCCESS;
}

kvxfer_result_t sample(const float* probs, int32_t vocab, uint64_t seed, int32_t* token) {
  KVXFER_REQUIRE(probs != nullptr && token != nullptr, "probs or token is NULL");
  KVXFER_REQUIRE(vocab >= 1, "vocab %d < 1", vocab);
  double total = 0.0;
  KVXFER_CHECK(check_row(probs, vocab, "probs", 0, &total));
  std::vector<double> w(probs, probs + vocab);
  *token = pick(w, total, uniform(seed, 0));
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::spec
