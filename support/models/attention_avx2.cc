// AVX2 + FMA path of the attention kernel (compiled with -mavx2 -mfma): the
// operations of attention_kernels.cc on 8 lanes, so the bits are the same;
// and the AVX-512 kernels of the batched pass (target attribute).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "models/attention_kernels.h"
#include "models/lanes.h"

namespace kvxfer::model::detail {
namespace {

// exp8 of attention_kernels.cc on 8 lanes.
__m256 exp8v(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_GT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kExpLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kExpLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kExpLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
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
  for (int t = 0; t < n8; t += 8)
    _mm256_storeu_ps(sc + t, _mm256_div_ps(_mm256_loadu_ps(sc + t), sum));
}

// Scores of 8 consecutive keys (rows k0 + u*stride, u < 8) for one query in
// registers: the 8-lane dots reduced by the shuffles of lane_sum, divided.
template <int NV>
inline __m256 scores8(const __m256* qv, int nv_run, const float* k0, std::size_t stride,
                      __m256 divv) {
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
      for (int u = 0; u < 4; ++u)
        kv[u] = _mm256_loadu_ps(kh + static_cast<std::size_t>(u) * stride + 8 * j);
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

// The AVX-512 kernels of the batched pass (attend_group_avx512).  They are
// compiled for AVX-512 by a target attribute and called only when the CPU
// has it; the rest of the group kernel is shared with the AVX2 path.  A
// 512-bit register holds two queries' 8 lanes side by side (scores) or 16
// elements of one output row (p.v); both keep each value's chain of
// operations, so the bits are those of the AVX2 path.
#define KVXFER_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx2,fma,f16c")))

// exp8v on 16 lanes: the same operations per lane.
KVXFER_AVX512 inline __m512 exp8v512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_GT_OQ);
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kExpLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kExpLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(live, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// softmax_scores with 16 lanes for the exps and the divisions; the sum still
// adds each group of 8 exps in order, so the bits are softmax_scores'.
KVXFER_AVX512 void softmax_scores512(float* sc, int n, float max_val, const Segment* segs,
                                     int n_segs) {
  const int n8 = (n + 7) / 8 * 8;
  for (int t = n; t < n8; ++t) sc[t] = -INFINITY;  // exp8 -> 0, and + 0 leaves a lane unchanged
  const __m512 mx = _mm512_set1_ps(max_val);
  __m256 sumv = _mm256_setzero_ps();
  int t = 0;
  for (; t + 16 <= n8; t += 16) {
    const __m512 e = exp8v512(_mm512_sub_ps(_mm512_loadu_ps(sc + t), mx));
    _mm512_storeu_ps(sc + t, e);
    sumv = _mm256_add_ps(sumv, _mm512_castps512_ps256(e));
    sumv = _mm256_add_ps(sumv, _mm512_extractf32x8_ps(e, 1));
  }
  if (t < n8) {  // the last 8
    const __m256 e = exp8v(_mm256_sub_ps(_mm256_loadu_ps(sc + t), _mm512_castps512_ps256(mx)));
    _mm256_storeu_ps(sc + t, e);
    sumv = _mm256_add_ps(sumv, e);
  }
  bool dropping = false;  // with a drop mask, lanes go by present rank (present_sum)
  for (int s = 0, seen = 0; s < n_segs && seen < n; seen += segs[s].count, ++s)
    dropping = dropping || segs[s].drop != nullptr;
  const float total = dropping ? present_sum(sc, segs, n_segs, n) : lane_sum(sumv);
  const __m512 sum = _mm512_set1_ps(total);
  for (t = 0; t + 16 <= n8; t += 16)
    _mm512_storeu_ps(sc + t, _mm512_div_ps(_mm512_loadu_ps(sc + t), sum));
  if (t < n8)
    _mm256_storeu_ps(sc + t, _mm256_div_ps(_mm256_loadu_ps(sc + t), _mm256_set1_ps(total)));
}

// Scores of 8 consecutive keys for NP query pairs: qpair holds pair p's
// element group j as [query 2p | query 2p+1] at (p * nv + j) * 16 (64-byte
// aligned); dst[2p], dst[2p+1] receive 8 scores each (nullptr: dropped).
// At NP = 3: 24 accumulators, 3 queries and 1 key in the 32 registers.
// pow2: div is a power of two (head_size 64: 8), so multiplying by its
// inverse gives the bits of the division (both are the rounded x / div).
template <int NP, int NV>
KVXFER_AVX512 void scores_pairs(const float* qpair, int nv_run, const float* k0, std::size_t stride,
                                float div, bool pow2, float* const* dst) {
  const int nv = NV > 0 ? NV : nv_run;
  __m512 acc[NP][8];
  for (int p = 0; p < NP; ++p)
    for (int u = 0; u < 8; ++u) acc[p][u] = _mm512_setzero_ps();
  for (int j = 0; j < nv; ++j) {
    __m512 qv[NP];
    for (int p = 0; p < NP; ++p)
      qv[p] = _mm512_load_ps(qpair + (static_cast<std::size_t>(p) * nv + j) * 16);
    for (int u = 0; u < 8; ++u) {
      const __m512 kb = _mm512_broadcast_f32x8(
          _mm256_loadu_ps(k0 + static_cast<std::size_t>(u) * stride + 8 * j));
      for (int p = 0; p < NP; ++p) acc[p][u] = _mm512_fmadd_ps(qv[p], kb, acc[p][u]);
    }
  }
  const __m512 divv = _mm512_set1_ps(div), inv = _mm512_set1_ps(1.0f / div);
  for (int p = 0; p < NP; ++p) {
    const __m512 r =
        pow2 ? _mm512_mul_ps(lane_sums16(acc[p]), inv) : _mm512_div_ps(lane_sums16(acc[p]), divv);
    if (dst[2 * p] != nullptr) _mm256_storeu_ps(dst[2 * p], _mm512_castps512_ps256(r));
    if (dst[2 * p + 1] != nullptr) _mm256_storeu_ps(dst[2 * p + 1], _mm512_extractf32x8_ps(r, 1));
  }
}

// qpair (see scores_pairs) of the queries g[0..n): pair i is g[2i], g[2i+1]
// (an odd last query paired with itself).
KVXFER_AVX512 void build_pairs(const float* const* q, const int* g, int n, int nv, float* qpair) {
  for (int i = 0; i < n; i += 2) {
    const float* a = q[g[i]];
    const float* b = q[g[i + 1 < n ? i + 1 : i]];
    for (int j = 0; j < nv; ++j) {
      float* o = qpair + (static_cast<std::size_t>(i / 2) * nv + j) * 16;
      _mm256_store_ps(o, _mm256_loadu_ps(a + 8 * j));
      _mm256_store_ps(o + 8, _mm256_loadu_ps(b + 8 * j));
    }
  }
}

template <int NV>
KVXFER_AVX512 void scores_block512(const float* qpair, int n, int nv, const float* k0,
                                   std::size_t stride, float div, bool pow2, float* const* dst) {
  // The keys two blocks on: the KV of a long context streams from memory.
  for (int u = 16; u < 24; ++u)
    for (int l = 0; l < nv * 8; l += 16)
      _mm_prefetch(reinterpret_cast<const char*>(k0 + static_cast<std::size_t>(u) * stride + l),
                   _MM_HINT_T0);
  int i = 0;  // queries, 6 per tile
  for (; i + 6 <= n; i += 6)
    scores_pairs<3, NV>(qpair + static_cast<std::size_t>(i / 2) * nv * 16, nv, k0, stride, div,
                        pow2, dst + i);
  float* rest[6] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  for (int r = 0; r < n - i; ++r) rest[r] = dst[i + r];
  const float* qp = qpair + static_cast<std::size_t>(i / 2) * nv * 16;
  switch ((n - i + 1) / 2) {
    case 2: return scores_pairs<2, NV>(qp, nv, k0, stride, div, pow2, rest);
    case 1: return scores_pairs<1, NV>(qp, nv, k0, stride, div, pow2, rest);
    default:
      if (n > i) scores_pairs<3, NV>(qp, nv, k0, stride, div, pow2, rest);
      return;
  }
}

// out[r] += sum over t in [t0, t1) of p[r][t] * v_t (fma chains, t ascending,
// per element) for NQ queries and a head of 64 * nh elements: 16 per
// register, 4 registers of each of up to 6 queries at a time.
template <int NQ>
KVXFER_AVX512 void pv_rows(const float* const* p, float* const* out, int nh, const float* v0,
                           std::size_t v_stride, int t0, int t1) {
  for (int h = 0; h < nh; ++h) {
    __m512 o[NQ][4];
    for (int r = 0; r < NQ; ++r)
      for (int j = 0; j < 4; ++j) o[r][j] = _mm512_loadu_ps(out[r] + 64 * h + 16 * j);
    for (int t = t0; t < t1; ++t) {
      const float* v = v0 + static_cast<std::size_t>(t) * v_stride + 64 * h;
      __m512 vv[4];
      for (int j = 0; j < 4; ++j) vv[j] = _mm512_loadu_ps(v + 16 * j);
      for (int r = 0; r < NQ; ++r) {
        const __m512 a = _mm512_set1_ps(p[r][t]);
        for (int j = 0; j < 4; ++j) o[r][j] = _mm512_fmadd_ps(a, vv[j], o[r][j]);
      }
    }
    for (int r = 0; r < NQ; ++r)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out[r] + 64 * h + 16 * j, o[r][j]);
  }
}

KVXFER_AVX512 void pv_block512(const float* const* p, float* const* out, int n, int nh,
                               const float* v0, std::size_t v_stride, int t0, int t1) {
  for (int t = t1; t < 2 * t1 - t0; ++t)  // the next block's values
    for (int l = 0; l < 64 * nh; l += 16)
      _mm_prefetch(reinterpret_cast<const char*>(v0 + static_cast<std::size_t>(t) * v_stride + l),
                   _MM_HINT_T0);
  int i = 0;
  for (; i + 6 <= n; i += 6) pv_rows<6>(p + i, out + i, nh, v0, v_stride, t0, t1);
  switch (n - i) {
    case 5: return pv_rows<5>(p + i, out + i, nh, v0, v_stride, t0, t1);
    case 4: return pv_rows<4>(p + i, out + i, nh, v0, v_stride, t0, t1);
    case 3: return pv_rows<3>(p + i, out + i, nh, v0, v_stride, t0, t1);
    case 2: return pv_rows<2>(p + i, out + i, nh, v0, v_stride, t0, t1);
    case 1: return pv_rows<1>(p + i, out + i, nh, v0, v_stride, t0, t1);
    default: return;
  }
}

}  // namespace

namespace {

// NV = head_size / 8 as a constant (0: known only at run time), so that the
// query and output registers stay in registers.
// wide: the AVX-512 kernels for whole blocks (head_size a multiple of 64).
template <int NV>
void attend_group_impl(bool wide, const float* const* q, const int* counts, int n_q, int head_size,
                       std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                       std::size_t score_stride, float* const* out) {
  const float div = std::sqrt(static_cast<float>(head_size));
  const __m256 divv = _mm256_set1_ps(div);
  const bool div_pow2 = div == std::exp2(std::round(std::log2(div)));
  const int nv = NV > 0 ? NV : head_size / 8;
  // Pass 1: scores, keys outermost in blocks of 8, so a block of K stays in
  // L1 while every query reads it.  A score's bits do not depend on the
  // blocking (scores8 == lane_sum / div, key by key).
  std::vector<int> active(static_cast<std::size_t>(n_q));
  // Before the fewest keys any query has, every query sees every block.
  const int min_count = *std::min_element(counts, counts + n_q);
  // The queries that see the whole block ending at key `end` (counting from
  // the first segment) into active; their number.  The set only shrinks as
  // end grows, so equal counts mean equal sets.
  auto seeing = [&](int end) {
    int na = 0;
    if (end <= min_count) {
      for (int g = 0; g < n_q; ++g) active[na++] = g;
      return na;
    }
    for (int g = 0; g < n_q; ++g)
      if (counts[g] >= end) active[na++] = g;
    return na;
  };
  // wide: the active queries in pairs (scores_pairs), rebuilt when the set
  // changes (it only shrinks, at the causal end of the keys).
  std::vector<float> pair_mem;
  float* qpair = nullptr;
  int paired = -1;
  std::vector<float*> dsts(static_cast<std::size_t>(n_q));
  if (wide) {
    pair_mem.resize(static_cast<std::size_t>(n_q + 1) / 2 * nv * 16 + 16);
    const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(pair_mem.data());
    qpair = reinterpret_cast<float*>((a + 63) & ~static_cast<std::uintptr_t>(63));
  }
  int base = 0;
  for (int s = 0; s < n_segs; ++s) {
    const Segment& sg = segs[s];
    int t = 0;
    if (sg.drop == nullptr) {
      int placed = -1;  // wide: dsts hold the rows of these many queries at key t - 8
      for (; t + 8 <= sg.count; t += 8) {
        const float* k0 = sg.k + static_cast<std::size_t>(t) * sg.k_stride + kv_off;
        auto dst = [&](int g) {
          return scores + static_cast<std::size_t>(g) * score_stride + base + t;
        };
        if (wide) {
          // Inside the fewest keys the set and its pairs stay; the rows move on by 8.
          const int na = placed == n_q && base + t + 8 <= min_count ? n_q : seeing(base + t + 8);
          if (na != paired) build_pairs(q, active.data(), na, nv, qpair);
          paired = na;
          if (na == placed) {
            for (int i = 0; i < na; ++i) dsts[i] += 8;
          } else {
            for (int i = 0; i < na; ++i) dsts[i] = dst(active[i]);
          }
          placed = na;
          scores_block512<NV>(qpair, na, nv, k0, sg.k_stride, div, div_pow2, dsts.data());
          continue;
        }
        const int na = seeing(base + t + 8);  // the queries that see the whole block, in pairs
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
    __m256 mv = _mm256_set1_ps(-INFINITY), m1 = mv, m2 = mv, m3 = mv;  // 4 chains
    int t8 = 0;
    for (; t8 + 32 <= n; t8 += 32) {
      mv = _mm256_max_ps(_mm256_loadu_ps(sc + t8), mv);
      m1 = _mm256_max_ps(_mm256_loadu_ps(sc + t8 + 8), m1);
      m2 = _mm256_max_ps(_mm256_loadu_ps(sc + t8 + 16), m2);
      m3 = _mm256_max_ps(_mm256_loadu_ps(sc + t8 + 24), m3);
    }
    for (; t8 + 8 <= n; t8 += 8) mv = _mm256_max_ps(_mm256_loadu_ps(sc + t8), mv);
    mv = _mm256_max_ps(_mm256_max_ps(mv, m1), _mm256_max_ps(m2, m3));
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
    if (wide)
      softmax_scores512(sc, n, max_val, segs, n_segs);
    else
      softmax_scores(sc, n, max_val, segs, n_segs);
  }
  // Pass 3: out_g = fma chain over keys in order, keys outermost in blocks of
  // 16 (32 on the AVX-512 path) so a block of V stays in L1; each query's accumulators live in
  // registers for the block.  Queries that see the whole block (no drop
  // mask) go three at a time over 32 elements of the head: 12 independent
  // chains, where one query's 8 would wait on the fma latency.
  // The AVX-512 kernel keeps 6 queries' outputs in registers over a block:
  // 32 keys (8 KiB of V) load and store them half as often as 16.
  const int kBlock = wide ? 32 : 16;
  std::vector<const float*> wide_p(wide ? static_cast<std::size_t>(n_q) : 0);
  std::vector<float*> wide_o(wide_p.size());
  base = 0;
  for (int s = 0; s < n_segs; ++s) {
    const Segment& sg = segs[s];
    int listed = -1;  // wide: wide_p/wide_o hold these many queries of this segment
    for (int t0 = 0; t0 < sg.count; t0 += kBlock) {
      const int t1 = std::min(sg.count, t0 + kBlock);
      int nfull = sg.drop == nullptr && nv % 4 == 0 ? seeing(base + t1) : 0;
      if (wide && nfull > 0) {  // all the queries that see the whole block
        if (nfull != listed) {
          for (int i = 0; i < nfull; ++i) {
            wide_p[i] = scores + static_cast<std::size_t>(active[i]) * score_stride + base;
            wide_o[i] = out[active[i]];
          }
          listed = nfull;
        }
        pv_block512(wide_p.data(), wide_o.data(), nfull, head_size / 64, sg.v + kv_off, sg.v_stride,
                    t0, t1);
      }
      nfull -= wide ? 0 : nfull % 3;
      for (int i = 0; i < nfull && !wide; i += 3) {
        const float* p[3];
        for (int r = 0; r < 3; ++r)
          p[r] = scores + static_cast<std::size_t>(active[i + r]) * score_stride + base;
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
      for (int g = 0, k = 0; g < n_q && nfull < n_q; ++g) {
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

namespace {
void attend_group_on(bool wide, const float* const* q, const int* counts, int n_q, int head_size,
                     std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                     std::size_t score_stride, float* const* out) {
  switch (head_size) {
    case 64:
      return attend_group_impl<8>(wide, q, counts, n_q, head_size, kv_off, segs, n_segs, scores,
                                  score_stride, out);
    case 128:
      return attend_group_impl<16>(wide, q, counts, n_q, head_size, kv_off, segs, n_segs, scores,
                                   score_stride, out);
    case 8:
      return attend_group_impl<1>(false, q, counts, n_q, head_size, kv_off, segs, n_segs, scores,
                                  score_stride, out);
    default:
      return attend_group_impl<0>(false, q, counts, n_q, head_size, kv_off, segs, n_segs, scores,
                                  score_stride, out);
  }
}
}  // namespace

void attend_group_avx2(const float* const* q, const int* counts, int n_q, int head_size,
                       std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                       std::size_t score_stride, float* const* out) {
  attend_group_on(false, q, counts, n_q, head_size, kv_off, segs, n_segs, scores, score_stride,
                  out);
}

void attend_group_avx512(const float* const* q, const int* counts, int n_q, int head_size,
                         std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                         std::size_t score_stride, float* const* out) {
  attend_group_on(true, q, counts, n_q, head_size, kv_off, segs, n_segs, scores, score_stride, out);
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
