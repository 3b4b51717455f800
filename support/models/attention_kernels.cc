// Scalar definition of the attention kernel; see attention_kernels.h.
// Built with -ffp-contract=off: every operation is the one written, and
// attention_avx2.cc performs the same operations on 8 lanes.
#include "models/attention_kernels.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "models/lanes.h"
#include "models/qmatmul.h"

namespace kvxfer::model::detail {
float present_sum(const float* e, const Segment* segs, int n_segs, int n_keys) {
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int n = 0, rank = 0;
  for (int s = 0; s < n_segs; ++s)
    for (int t = 0; t < segs[s].count && n < n_keys; ++t, ++n) {
      if (segs[s].drop != nullptr && segs[s].drop[t] != 0) continue;
      l[rank % 8] = l[rank % 8] + e[n];
      ++rank;
    }
  return lane_sum(l);
}

// exp(x) for x <= 0 (attention only needs that; x > 0 is clamped to 88.3):
// n = round(x log2 e), r = x - n ln2 (two-constant Cody-Waite, by fma), a
// degree-6 Taylor/minimax polynomial of r by Horner fma, times 2^n built in
// the exponent bits.  Below -87.3 the result is 0.
float exp8(float x) {
  if (!(x > kExpLow)) return 0.0f;  // also NaN -> 0
  if (x > kExpHigh) x = kExpHigh;
  const float n = std::nearbyint(x * kExpLog2e);
  float r = std::fma(n, -kExpLn2Hi, x);
  r = std::fma(n, -kExpLn2Lo, r);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpPoly[i]);
  p = std::fma(p, r, 1.0f);
  const std::int32_t e = (static_cast<std::int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

void attend_head_scalar(const float* q, int head_size, std::size_t kv_off, const Segment* segs,
                        int n_segs, float* scores, float* out) {
  const float div = std::sqrt(static_cast<float>(head_size));
  int n = 0, present = 0;
  float max_val = -INFINITY;
  for (int s = 0; s < n_segs; ++s) {
    for (int t = 0; t < segs[s].count; ++t, ++n) {
      if (segs[s].drop != nullptr && segs[s].drop[t] != 0) {
        scores[n] = -INFINITY;
        continue;
      }
      const float* k = segs[s].k + static_cast<std::size_t>(t) * segs[s].k_stride + kv_off;
      float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int i = 0; i < head_size; ++i) l[i % 8] = std::fma(q[i], k[i], l[i % 8]);
      scores[n] = lane_sum(l) / div;
      if (scores[n] > max_val) max_val = scores[n];
      ++present;
    }
  }
  for (int i = 0; i < head_size; ++i) out[i] = 0.0f;
  if (present == 0) {
    for (int i = 0; i < n; ++i) scores[i] = 0.0f;
    return;
  }
  for (int t = 0; t < n; ++t) scores[t] = exp8(scores[t] - max_val);  // -inf - max -> 0
  const float sum = present_sum(scores, segs, n_segs, n);
  n = 0;
  for (int s = 0; s < n_segs; ++s) {
    for (int t = 0; t < segs[s].count; ++t, ++n) {
      scores[n] = scores[n] / sum;
      if (segs[s].drop != nullptr && segs[s].drop[t] != 0) continue;
      const float a = scores[n];
      const float* v = segs[s].v + static_cast<std::size_t>(t) * segs[s].v_stride + kv_off;
      for (int i = 0; i < head_size; ++i) out[i] = std::fma(a, v[i], out[i]);
    }
  }
}

void swiglu_scalar(float* h, const float* up, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    const float v = h[i];
    h[i] = (v * (1.0f / (1.0f + exp8(-v)))) * up[i];
  }
}

void swiglu(float* h, const float* up, std::size_t n) {
  const bool avx2 = have_avx2();
  constexpr std::size_t kChunk = 4096;
  const std::size_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (std::size_t c = 0; c < chunks; ++c) {
    const std::size_t i0 = c * kChunk, len = n - i0 < kChunk ? n - i0 : kChunk;
    if (avx2)
      swiglu_avx2(h + i0, up + i0, len);
    else
      swiglu_scalar(h + i0, up + i0, len);
  }
}

void attend_head(const float* q, int head_size, std::size_t kv_off, const Segment* segs, int n_segs,
                 float* scores, float* out) {
  if (have_avx2() && head_size % 8 == 0 && head_size <= 128)
    attend_head_avx2(q, head_size, kv_off, segs, n_segs, scores, out);
  else
    attend_head_scalar(q, head_size, kv_off, segs, n_segs, scores, out);
}

void attend_group(const float* const* q, const int* counts, int n_q, int head_size,
                  std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                  std::size_t score_stride, float* const* out) {
  if (have_avx512() && n_q > 1 && head_size % 8 == 0 && head_size <= 128) {
    attend_group_avx512(q, counts, n_q, head_size, kv_off, segs, n_segs, scores, score_stride, out);
    return;
  }
  if (have_avx2() && head_size % 8 == 0 && head_size <= 128) {
    attend_group_avx2(q, counts, n_q, head_size, kv_off, segs, n_segs, scores, score_stride, out);
    return;
  }
  std::vector<Segment> cut(static_cast<std::size_t>(n_segs));
  for (int g = 0; g < n_q; ++g) {
    int left = counts[g], m = 0;
    for (int s = 0; s < n_segs && left > 0; ++s, ++m) {
      cut[m] = segs[s];
      cut[m].count = segs[s].count < left ? segs[s].count : left;
      left -= cut[m].count;
    }
    attend_head(q[g], head_size, kv_off, cut.data(), m,
                scores + static_cast<std::size_t>(g) * score_stride, out[g]);
  }
}

}  // namespace kvxfer::model::detail
