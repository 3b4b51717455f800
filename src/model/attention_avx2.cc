// AVX2 + FMA path of the attention kernel (compiled with -mavx2 -mfma): the
// operations of attention_kernels.cc on 8 lanes, so the bits are the same.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "model/attention_kernels.h"
#include "model/lanes.h"

namespace kvxfer::model::detail {
namespace {

// exp8 of attention_kernels.cc on 8 lanes.
__m256 exp8v(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

}  // namespace

void swiglu_avx2(float* h, const float* up, std::size_t n) {
  std::size_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(h + i);
    const __m256 e = exp8v(_mm256_xor_ps(v, sign));
    const __m256 silu = _mm256_mul_ps(v, _mm256_div_ps(one, _mm256_add_ps(one, e)));
    _mm256_storeu_ps(h + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  swiglu_scalar(h + i, up + i, n - i);
}

namespace {

// The softmax of n scores in place (scratch up to the next multiple of 8):
// e = exp8(s - max), the sum over 8 lanes by index, e / sum.
inline void softmax_scores(float* sc, int n, float max_val, const Segment* segs, int n_segs) {
  const int n8 = (n + 7) / 8 * 8;
  for (int t = n; t < n8; ++t) sc[t] = -INFINITY;  // exp8 -> 0, and + 0 leaves a lane unchanged
  const __m256 mx = _mm256_set1_ps(max_val);
  __m256 sumv = _mm256_setzero_ps();
  for (int t = 0; t < n8; t += 8) {
    const __m256 e = exp8v(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mx));
    _mm256_storeu_ps(sc + t, e);
    sumv = _mm256_add_ps(sumv, e);
  }
  bool dropping = false;  // with a drop mask, lanes go by present rank (present_sum)
  for (int s = 0, seen = 0; s < n_segs && seen < n; seen += segs[s].count, ++s)
    dropping = dropping || segs[s].drop != nullptr;
  const __m256 sum = _mm256_set1_ps(dropping ? present_sum(sc, segs, n_segs, n) : lane_sum(sumv));
  for (int t = 0; t < n8; t += 8) _mm256_storeu_ps(sc + t, _mm256_div_ps(_mm256_loadu_ps(sc + t), sum));
}

// Scores of 8 consecutive keys (rows k0 + u*stride, u < 8) for one query in
// registers: the 8-lane dots reduced by the shuffles of lane_sum, divided.
template <int NV>
inline __m256 scores8(const __m256* qv, int nv_run, const float* k0, std::size_t stride, __m256 divv) {
  const int nv = NV > 0 ? NV : nv_run;
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  // j outermost: the 8 keys' chains interleave, so consecutive fmas are
  // independent (each key's chain is still j ascending).
  for (int j = 0; j < nv; ++j)
    for (int u = 0; u < 8; ++u)
      acc[u] = _mm256_fmadd_ps(
          qv[j], _mm256_loadu_ps(k0 + static_cast<std::size_t>(u) * stride + 8 * j), acc[u]);
  return _mm256_div_ps(lane_sums8(acc), divv);
}

// scores8 for two queries at once: per 8 elements of the head, 4 keys are
// loaded once for both (8 accumulators, 4 key registers), so the fmas, not
// the loads, bound the loop.  Each score is still its own chain over j.
template <int NV>
inline void scores8x2(const float* qa, const float* qb, int nv_run, const float* k0,
                      std::size_t stride, __m256 divv, float* outa, float* outb) {
  const int nv = NV > 0 ? NV : nv_run;
  for (int half = 0; half < 2; ++half) {
    __m256 a[2][4];
    for (int g = 0; g < 2; ++g)
      for (int u = 0; u < 4; ++u) a[g][u] = _mm256_setzero_ps();
    const float* kh = k0 + static_cast<std::size_t>(4 * half) * stride;
    for (int j = 0; j < nv; ++j) {
      __m256 kv[4];
      for (int u = 0; u < 4; ++u) kv[u] = _mm256_loadu_ps(kh + static_cast<std::size_t>(u) * stride + 8 * j);
      const __m256 x = _mm256_loadu_ps(qa + 8 * j);
      for (int u = 0; u < 4; ++u) a[0][u] = _mm256_fmadd_ps(x, kv[u], a[0][u]);
      const __m256 y = _mm256_loadu_ps(qb + 8 * j);
      for (int u = 0; u < 4; ++u) a[1][u] = _mm256_fmadd_ps(y, kv[u], a[1][u]);
    }
    // Keys 4*half.. of query a in the low half, of query b in the high half.
    const __m256 acc[8] = {a[0][0], a[0][1], a[0][2], a[0][3], a[1][0], a[1][1], a[1][2], a[1][3]};
    const __m256 r = _mm256_div_ps(lane_sums8(acc), divv);
    _mm_storeu_ps(outa + 4 * half, _mm256_castps256_ps128(r));
    _mm_storeu_ps(outb + 4 * half, _mm256_extractf128_ps(r, 1));
  }
}

}  // namespace

namespace {

// NV = head_size / 8 as a constant (0: known only at run time), so that the
// query and output registers stay in registers.
template <int NV>
void attend_group_impl(const float* const* q, const int* counts, int n_q, int head_size,
                       std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                       std::size_t score_stride, float* const* out) {
  const float div = std::sqrt(static_cast<float>(head_size));
  const __m256 divv = _mm256_set1_ps(div);
  const int nv = NV > 0 ? NV : head_size / 8;
  // Pass 1: scores, keys outermost in blocks of 8, so a block of K stays in
  // L1 while every query reads it.  A score's bits do not depend on the
  // blocking (scores8 == lane_sum / div, key by key).
  std::vector<int> active(static_cast<std::size_t>(n_q));
  int base = 0;
  for (int s = 0; s < n_segs; ++s) {
    const Segment& sg = segs[s];
    int t = 0;
    if (sg.drop == nullptr) {
      for (; t + 8 <= sg.count; t += 8) {
        const float* k0 = sg.k + static_cast<std::size_t>(t) * sg.k_stride + kv_off;
        int na = 0;  // the queries that see the whole block, in pairs
        for (int g = 0; g < n_q; ++g)
          if (counts[g] >= base + t + 8) active[na++] = g;
        auto dst = [&](int g) { return scores + static_cast<std::size_t>(g) * score_stride + base + t; };
        int i = 0;
        for (; i + 2 <= na; i += 2)
          scores8x2<NV>(q[active[i]], q[active[i + 1]], nv, k0, sg.k_stride, divv, dst(active[i]),
                        dst(active[i + 1]));
        if (i < na) {
          __m256 qv[16];
          for (int j = 0; j < nv; ++j) qv[j] = _mm256_loadu_ps(q[active[i]] + 8 * j);
          _mm256_storeu_ps(dst(active[i]), scores8<NV>(qv, nv, k0, sg.k_stride, divv));
        }
      }
    }
    // Keys not covered by a whole block of this query: one at a time.
    for (int g = 0; g < n_q; ++g) {
      const int c = std::max(0, std::min(sg.count, counts[g] - base));
      float* sc = scores + static_cast<std::size_t>(g) * score_stride + base;
      for (int u = sg.drop == nullptr ? c / 8 * 8 : 0; u < c; ++u) {
        if (sg.drop != nullptr && sg.drop[u] != 0) {
          sc[u] = -INFINITY;
          continue;
        }
        const float* k = sg.k + static_cast<std::size_t>(u) * sg.k_stride + kv_off;
        __m256 acc = _mm256_setzero_ps();
        for (int j = 0; j < nv; ++j)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + 8 * j), _mm256_loadu_ps(k + 8 * j), acc);
        sc[u] = lane_sum(acc) / div;
      }
    }
    base += sg.count;
  }
  // Pass 2: per query, the softmax of attend_head_avx2.
  for (int g = 0; g < n_q; ++g) {
    float* sc = scores + static_cast<std::size_t>(g) * score_stride;
    const int n = counts[g];
    // The maximum (exact, so any order gives its value; a zero's sign
    // cannot change exp8(s - max)).
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int t8 = 0;
    for (; t8 + 8 <= n; t8 += 8) mv = _mm256_max_ps(_mm256_loadu_ps(sc + t8), mv);
    alignas(32) float ml[8];
    _mm256_store_ps(ml, mv);
    float max_val = -INFINITY;
    for (float v : ml)
      if (v > max_val) max_val = v;
    for (int t = t8; t < n; ++t)
      if (sc[t] > max_val) max_val = sc[t];
    int present = 0, seen = 0;  // keys not dropped among the first n
    for (int s = 0; s < n_segs && seen < n; ++s) {
      const int c = std::min(segs[s].count, n - seen);
      if (segs[s].drop == nullptr) {
        present += c;
      } else {
        for (int t = 0; t < c; ++t) present += segs[s].drop[t] == 0 ? 1 : 0;
      }
      seen += c;
    }
    for (int i = 0; i < head_size; ++i) out[g][i] = 0.0f;
    if (present == 0) {
      for (int t = 0; t < n; ++t) sc[t] = 0.0f;
      continue;
    }
    softmax_scores(sc, n, max_val, segs, n_segs);
  }
  // Pass 3: out_g = fma chain over keys in order, keys outermost in blocks of
  // 16 so a block of V stays in L1; each query's accumulators live in
  // registers for the block.  Queries that see the whole block (no drop
  // mask) go three at a time over 32 elements of the head: 12 independent
  // chains, where one query's 8 would wait on the fma latency.
  constexpr int kBlock = 16;
  base = 0;
  for (int s = 0; s < n_segs; ++s) {
    const Segment& sg = segs[s];
    for (int t0 = 0; t0 < sg.count; t0 += kBlock) {
      const int t1 = std::min(sg.count, t0 + kBlock);
      int nfull = 0;
      if (sg.drop == nullptr && nv % 4 == 0)
        for (int g = 0; g < n_q; ++g)
          if (counts[g] - base >= t1) active[nfull++] = g;
      nfull -= nfull % 3;
      for (int i = 0; i < nfull; i += 3) {
        const float* p[3];
        for (int r = 0; r < 3; ++r) p[r] = scores + static_cast<std::size_t>(active[i + r]) * score_stride + base;
        for (int h = 0; h < nv; h += 4) {
          __m256 o[3][4];
          for (int r = 0; r < 3; ++r)
            for (int j = 0; j < 4; ++j) o[r][j] = _mm256_loadu_ps(out[active[i + r]] + 8 * (h + j));
          for (int t = t0; t < t1; ++t) {
            const __m256 a0 = _mm256_set1_ps(p[0][t]), a1 = _mm256_set1_ps(p[1][t]),
                         a2 = _mm256_set1_ps(p[2][t]);
            const float* v = sg.v + static_cast<std::size_t>(t) * sg.v_stride + kv_off + 8 * h;
            for (int j = 0; j < 4; ++j) {
              const __m256 vv = _mm256_loadu_ps(v + 8 * j);
              o[0][j] = _mm256_fmadd_ps(a0, vv, o[0][j]);
              o[1][j] = _mm256_fmadd_ps(a1, vv, o[1][j]);
              o[2][j] = _mm256_fmadd_ps(a2, vv, o[2][j]);
            }
          }
          for (int r = 0; r < 3; ++r)
            for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out[active[i + r]] + 8 * (h + j), o[r][j]);
        }
      }
      for (int g = 0, k = 0; g < n_q; ++g) {
        if (k < nfull && active[k] == g) {  // done above (active is ascending)
          ++k;
          continue;
        }
        const int end = std::min(t1, counts[g] - base);
        if (end <= t0) continue;
        const float* p = scores + static_cast<std::size_t>(g) * score_stride + base;
        __m256 o[16];
        for (int j = 0; j < nv; ++j) o[j] = _mm256_loadu_ps(out[g] + 8 * j);
        for (int t = t0; t < end; ++t) {
          if (sg.drop != nullptr && sg.drop[t] != 0) continue;
          const __m256 a = _mm256_set1_ps(p[t]);
          const float* v = sg.v + static_cast<std::size_t>(t) * sg.v_stride + kv_off;
          for (int j = 0; j < nv; ++j) o[j] = _mm256_fmadd_ps(a, _mm256_loadu_ps(v + 8 * j), o[j]);
        }
        for (int j = 0; j < nv; ++j) _mm256_storeu_ps(out[g] + 8 * j, o[j]);
      }
    }
    base += sg.count;
  }
}

}  // namespace

void attend_group_avx2(const float* const* q, const int* counts, int n_q, int head_size,
                       std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                       std::size_t score_stride, float* const* out) {
  switch (head_size) {
    case 64: return attend_group_impl<8>(q, counts, n_q, head_size, kv_off, segs, n_segs, scores, score_stride, out);
    case 128: return attend_group_impl<16>(q, counts, n_q, head_size, kv_off, segs, n_segs, scores, score_stride, out);
    case 8: return attend_group_impl<1>(q, counts, n_q, head_size, kv_off, segs, n_segs, scores, score_stride, out);
    default: return attend_group_impl<0>(q, counts, n_q, head_size, kv_off, segs, n_segs, scores, score_stride, out);
  }
}

// One query is a group of one: the same operations, so the same bits.
void attend_head_avx2(const float* q, int head_size, std::size_t kv_off, const Segment* segs,
                      int n_segs, float* scores, float* out) {
  int count = 0;
  for (int s = 0; s < n_segs; ++s) count += segs[s].count;
  attend_group_avx2(&q, &count, 1, head_size, kv_off, segs, n_segs, scores,
                    static_cast<std::size_t>(count) + 8, &out);
}

}  // namespace kvxfer::model::detail
