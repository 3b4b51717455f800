// AVX-512 VNNI kernels of qmatmul.h (compiled with -mavx512f -mavx512dq
// -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma -mf16c; called only when the
// CPU has them).  One lane per token: a 64-byte row of the quantized
// activations holds 2 codes of 16 tokens, and vpdpwssd adds the products of
// 2 weight codes (broadcast) with them.  The integer sums are exact; the
// float steps are those of the definition, lane by lane.  Groups of up to 4
// or 8 tokens use the 128- or 256-bit forms (the same operations on fewer
// lanes).
#include <immintrin.h>

#include <cstring>

#include "models/qmatmul.h"

namespace kvxfer::model::detail {
namespace {

inline std::int32_t word(const std::int16_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

struct V16 {
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static I loadx(const std::int16_t* p) { return _mm512_loadu_si512(p); }
  static I bcast(const std::int16_t* p) { return _mm512_set1_epi32(word(p)); }
  static I dp(I a, I w, I x) { return _mm512_dpwssd_epi32(a, w, x); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
struct V8 {
  using I = __m256i;
  using F = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static I loadx(const std::int16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const I*>(p));
  }
  static I bcast(const std::int16_t* p) { return _mm256_set1_epi32(word(p)); }
  static I dp(I a, I w, I x) { return _mm256_dpwssd_epi32(a, w, x); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
struct V4 {
  using I = __m128i;
  using F = __m128;
  static I zero() { return _mm_setzero_si128(); }
  static I loadx(const std::int16_t* p) { return _mm_loadu_si128(reinterpret_cast<const I*>(p)); }
  static I bcast(const std::int16_t* p) { return _mm_set1_epi32(word(p)); }
  static I dp(I a, I w, I x) { return _mm_dpwssd_epi32(a, w, x); }
  static F fzero() { return _mm_setzero_ps(); }
  static F loadf(const float* p) { return _mm_loadu_ps(p); }
  static F set1(float v) { return _mm_set1_ps(v); }
  static F mul(F a, F b) { return _mm_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm_fmadd_ps(a, b, c); }
  static F cvt(I a) { return _mm_cvtepi32_ps(a); }
  static void store(float* p, F v) { _mm_storeu_ps(p, v); }
};

// The panel's kPanelRows rows against the first lanes of group g: 8 integer
// and 8 float accumulators.
template <class V, bool Q4>
void rows(const Panel& p, const QuantizedX& x, int g, float* out) {
  constexpr int R = kPanelRows;
  typename V::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  const std::size_t cols = static_cast<std::size_t>(p.cols);
  for (int b = 0; b < p.nb; ++b) {
    typename V::I ai[R];
    for (int r = 0; r < R; ++r) ai[r] = V::zero();
    const std::int16_t* w = p.w.data() + static_cast<std::size_t>(b) * 32;
    for (int k2 = 0; k2 < 16; ++k2) {
      const typename V::I xv = V::loadx(x.qrow(g, b, k2));
      for (int r = 0; r < R; ++r) ai[r] = V::dp(ai[r], V::bcast(w + r * cols + 2 * k2), xv);
    }
    const std::size_t at = x.at(g, b);
    const typename V::F dxv = V::loadf(&x.dx[at]);
    const typename V::F sxv = Q4 ? V::loadf(&x.sx[at]) : V::fzero();
    for (int r = 0; r < R; ++r) {
      const std::size_t rb = static_cast<std::size_t>(r) * p.nb + b;
      acc[r] = V::fma(V::mul(V::set1(p.d[rb]), dxv), V::cvt(ai[r]), acc[r]);
      if (Q4) acc[r] = V::fma(V::set1(p.m[rb]), sxv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) V::store(out + r * kGroup, acc[r]);
}

template <class V>
void rows_of(const Panel& p, const QuantizedX& x, int g, float* out) {
  if (p.q4)
    rows<V, true>(p, x, g, out);
  else
    rows<V, false>(p, x, g, out);
}

}  // namespace

void panel_products_avx512(const Panel& p, const QuantizedX& x, int g, int n_lanes, float* out) {
  if (n_lanes <= 4)
    rows_of<V4>(p, x, g, out);
  else if (n_lanes <= 8)
    rows_of<V8>(p, x, g, out);
  else
    rows_of<V16>(p, x, g, out);
}

namespace {

// The sums of each of v[0..15] as one vector, in order: pairs of rows, then
// quads, by the unpacks within 128-bit lanes, then across the 4 lanes.  Integer
// additions, so any order gives the exact sums.
inline __m512i transpose_sum16(const __m512i* v) {
  __m512i t[8], u[4];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                            _mm512_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j)
    u[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * j], t[2 * j + 1]),
                            _mm512_unpackhi_epi64(t[2 * j], t[2 * j + 1]));
  const __m512i x01 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x44),
                                       _mm512_shuffle_i32x4(u[0], u[1], 0xEE));
  const __m512i x23 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x44),
                                       _mm512_shuffle_i32x4(u[2], u[3], 0xEE));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, 0x88),
                          _mm512_shuffle_i32x4(x01, x23, 0xDD));
}

template <int T>
void rows_tokens(const WeightMatrix& w, int row0, int n, const std::int16_t* xq, const float* dx,
                 const float* sx, float* out, std::size_t out_stride) {
  const RowSpan rs(w, row0, n, kOneTokenRows);
  const int nb = rs.nb;
  const std::size_t cols = static_cast<std::size_t>(w.cols);
  const __m512i offv = _mm512_load_si512(rs.offs);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  __m512i wv[kOneTokenRows];  // one block of each row as 32 int16 (spilled to L1 for T > 1)
  for (int b = 0; b < nb; ++b) {
    rs.prefetch_next(b);
    for (int r = 0; r < kOneTokenRows; ++r) {
      const std::uint8_t* blk = rs.block(r, b);
      if (rs.q4) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        const __m256i u8 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(c, low4)),
                                                   _mm_and_si128(_mm_srli_epi16(c, 4), low4), 1);
        wv[r] = _mm512_cvtepu8_epi16(u8);
      } else {
        wv[r] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)));
      }
    }
    // The rows' (d, m) fp16 pairs (Q8_0: d and the first two codes).
    const __m512i dm = _mm512_i32gather_epi32(offv, rs.block(0, b), 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
    for (int t = 0; t < T; ++t) {
      const __m512i xv = _mm512_loadu_si512(xq + t * cols + static_cast<std::size_t>(b) * 32);
      __m512i v[kOneTokenRows];
      for (int r = 0; r < kOneTokenRows; ++r) v[r] = _mm512_madd_epi16(wv[r], xv);
      const __m512i isum = transpose_sum16(v);
      const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(dx[t * nb + b]));
      acc[t] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(isum), acc[t]);
      if (rs.q4) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[t * nb + b]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    alignas(64) float res[kOneTokenRows];
    _mm512_store_ps(res, acc[t]);
    for (int r = 0; r < n; ++r) out[t * out_stride + r] = res[r];
  }
}

}  // namespace

void rows_few_tokens_avx512(const WeightMatrix& w, int row0, int n, int n_tokens,
                            const std::int16_t* xq, const float* dx, const float* sx, float* out,
                            std::size_t out_stride) {
  switch (n_tokens) {
    case 1: return rows_tokens<1>(w, row0, n, xq, dx, sx, out, out_stride);
    case 2: return rows_tokens<2>(w, row0, n, xq, dx, sx, out, out_stride);
    case 3: return rows_tokens<3>(w, row0, n, xq, dx, sx, out, out_stride);
    default: return rows_tokens<4>(w, row0, n, xq, dx, sx, out, out_stride);
  }
}

}  // namespace kvxfer::model::detail
