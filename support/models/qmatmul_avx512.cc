// AVX-512 VNNI kernel of qmatmul.h (compiled with -mavx512f -mavx512dq
// -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c; called only when the
// CPU has them).  One lane per weight row: a group of 16 rows in the packed
// layout (pack_weights) gives, per pair of columns, one register of 16 rows'
// code pairs after a shift and a mask, and vpdpwssd adds its products with a
// token's 2 activation codes (broadcast).  The same registers serve up to 8
// tokens.  The integer sums are exact in any order; the float steps are those
// of the definition, lane by lane.
#include <immintrin.h>

#include <cstring>

#include "models/qmatmul.h"

namespace kvxfer::model::detail {
namespace {

inline __m512i bcast_pair(const std::int16_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Rows of one packed group against tokens [0, T) of x (codes xq [T][cols],
// block scales dx, sx [T][nb]): out[t * out_stride + r] for the rows in
// `rows`.  A token's integer sums go to C independent chains (C > 1 when
// few tokens would leave the vpdpwssd latency exposed) and are added at the
// end of each block: exact, so the chains change nothing but the speed.
// next: the group to prefetch, a block's share per block (nullptr: none).
template <bool Q4, int T>
void group_tokens(const std::uint8_t* group, const std::uint8_t* next, int nb,
                  const std::int16_t* xq, std::size_t cols, const float* dx, const float* sx,
                  __mmask16 rows, float* out, std::size_t out_stride) {
  constexpr int C = T == 1 ? 4 : T == 2 ? 2 : 1;
  constexpr std::size_t kBlock = Q4 ? kPackedQ4_1Block : kPackedQ8_0Block;
  constexpr int kScales = Q4 ? 64 : 32;
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const std::uint8_t* blk = group + static_cast<std::size_t>(b) * kBlock;
    const std::uint8_t* codes = blk + kScales;
    if (next != nullptr)
      for (std::size_t off = 0; off < kBlock; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + b * kBlock + off), _MM_HINT_T0);
    __m512i ai[T][C];
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) ai[t][c] = _mm512_setzero_si512();
    const std::int16_t* xb = xq + static_cast<std::size_t>(b) * 32;
    if (Q4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(codes + 64 * j);
        for (int p = 0; p < 4; ++p) {
          const __m512i w = _mm512_and_si512(p == 0 ? raw : _mm512_srli_epi32(raw, 4 * p), nibbles);
          const int k = 8 * j + 2 * p, c = (4 * j + p) % C;
          for (int t = 0; t < T; ++t)
            ai[t][c] = _mm512_dpwssd_epi32(ai[t][c], w, bcast_pair(xb + t * cols + k));
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        const __m512i raw = _mm512_loadu_si512(codes + 64 * j);
        const __m512i lo = _mm512_srai_epi16(_mm512_slli_epi16(raw, 8), 8);  // k = 4j, 4j + 1
        const __m512i hi = _mm512_srai_epi16(raw, 8);                        // k = 4j + 2, 4j + 3
        const int c = j % C;
        for (int t = 0; t < T; ++t) {
          ai[t][c] = _mm512_dpwssd_epi32(ai[t][c], lo, bcast_pair(xb + t * cols + 4 * j));
          ai[t][c] = _mm512_dpwssd_epi32(ai[t][c], hi, bcast_pair(xb + t * cols + 4 * j + 2));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const __m512 m =
        Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)))
           : _mm512_setzero_ps();
    for (int t = 0; t < T; ++t) {
      __m512i isum = ai[t][0];
      for (int c = 1; c < C; ++c) isum = _mm512_add_epi32(isum, ai[t][c]);
      const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(dx[t * nb + b]));
      acc[t] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(isum), acc[t]);
      if (Q4) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[t * nb + b]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(out + t * out_stride, rows, acc[t]);
}

// The last tile prefetches the next group: the first tile of a group waits
// on memory, the others read it from L1 and would leave the link idle.
template <bool Q4>
void group_tiles(const std::uint8_t* group, const std::uint8_t* next_group, int nb,
                 const std::int16_t* xq, std::size_t cols, const float* dx, const float* sx, int n,
                 __mmask16 rows, float* out, std::size_t out_stride) {
  for (int t0 = 0; t0 < n; t0 += kTileTokens) {
    const std::uint8_t* next = t0 + kTileTokens >= n ? next_group : nullptr;
    const std::int16_t* x = xq + static_cast<std::size_t>(t0) * cols;
    const float* d = dx + static_cast<std::size_t>(t0) * nb;
    const float* s = sx + static_cast<std::size_t>(t0) * nb;
    float* o = out + static_cast<std::size_t>(t0) * out_stride;
    switch (n - t0 < kTileTokens ? n - t0 : kTileTokens) {
      case 1: group_tokens<Q4, 1>(group, next, nb, x, cols, d, s, rows, o, out_stride); break;
      case 2: group_tokens<Q4, 2>(group, next, nb, x, cols, d, s, rows, o, out_stride); break;
      case 3: group_tokens<Q4, 3>(group, next, nb, x, cols, d, s, rows, o, out_stride); break;
      case 4: group_tokens<Q4, 4>(group, next, nb, x, cols, d, s, rows, o, out_stride); break;
      case 5: group_tokens<Q4, 5>(group, next, nb, x, cols, d, s, rows, o, out_stride); break;
      case 6: group_tokens<Q4, 6>(group, next, nb, x, cols, d, s, rows, o, out_stride); break;
      case 7: group_tokens<Q4, 7>(group, next, nb, x, cols, d, s, rows, o, out_stride); break;
      default: group_tokens<Q4, 8>(group, next, nb, x, cols, d, s, rows, o, out_stride); break;
    }
  }
}

}  // namespace

void quantize_tokens_avx512(const float* x, int cols, int t0, int t1, int b0, int b1,
                            QuantizedX* out) {
  const __m512 hi = _mm512_set1_ps(32767.0f), lo = _mm512_set1_ps(-32767.0f);
  for (int t = t0; t < t1; ++t) {
    const float* xt = x + static_cast<std::size_t>(t) * cols;
    // 16 blocks at a time: their maxima, then their scales by one vector
    // division each (IEEE divisions, so the scalar bits), then their codes;
    // the blocks' long reduction chains overlap instead of following each other.
    for (int c0 = b0; c0 < b1; c0 += 16) {
      const int nc = b1 - c0 < 16 ? b1 - c0 : 16;
      alignas(64) float amax[16] = {}, dxs[16], ids[16];
      for (int i = 0; i < nc; ++i) {
        const float* xb = xt + static_cast<std::size_t>(c0 + i) * 32;
        // max(|x|, acc) keeps acc where |x| is NaN, as the scalar loop does.
        amax[i] = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + 16)),
                          _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)), _mm512_setzero_ps())));
      }
      const __m512 dxv = _mm512_div_ps(_mm512_load_ps(amax), _mm512_set1_ps(32767.0f));
      _mm512_store_ps(dxs, dxv);
      _mm512_store_ps(ids,
                      _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dxv, _mm512_setzero_ps(), _CMP_GT_OQ),
                                          _mm512_set1_ps(1.0f), dxv));
      for (int i = 0; i < nc; ++i) {
        const int b = c0 + i;
        const float* xb = xt + static_cast<std::size_t>(b) * 32;
        const __m512 idv = _mm512_set1_ps(ids[i]);
        __m512i q[2];
        for (int h = 0; h < 2; ++h) {
          const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), idv);
          const __m512 f =
              _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, s, _CMP_ORD_Q), s);    // NaN -> 0
          q[h] = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(f, lo), hi));  // ties to even
        }
        const std::int32_t qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
        alignas(64) std::int16_t codes[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes), _mm512_cvtepi32_epi16(q[0]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 16), _mm512_cvtepi32_epi16(q[1]));
        std::memcpy(out->qrow_mut(t, b, 0), codes, sizeof codes);  // group 1: [token][cols]
        const std::size_t at = out->at(t, b);
        out->dx[at] = dxs[i];
        out->qsum[at] = qsum;
        out->sx[at] = dxs[i] * static_cast<float>(qsum);
      }
    }
  }
}

void group_products_avx512(WeightType type, const std::uint8_t* group, const std::uint8_t* next,
                           int n_rows, const QuantizedX& x, int cols, float* out,
                           std::size_t out_stride) {
  const __mmask16 rows = static_cast<__mmask16>((1u << n_rows) - 1);
  const std::int16_t* xq = x.qrow(0, 0, 0);
  const std::size_t c = static_cast<std::size_t>(cols);
  if (type == WeightType::kQ4_1)
    group_tiles<true>(group, next, x.nb, xq, c, x.dx.data(), x.sx.data(), x.n, rows, out,
                      out_stride);
  else
    group_tiles<false>(group, next, x.nb, xq, c, x.dx.data(), x.sx.data(), x.n, rows, out,
                       out_stride);
}

}  // namespace kvxfer::model::detail
