// AVX2 kernels of qmatmul.h (compiled with -mavx2 -mfma -mf16c; called only
// when the CPU has them).  The integer block sums are exact, so any order
// gives qmatmul.h's isum; the float steps are those of the definition, lane
// by lane (one token per lane).
#include <immintrin.h>

#include <cstring>

#include "models/qmatmul.h"

namespace kvxfer::model::detail {
namespace {

inline float half(const std::uint8_t* p) {
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // F16C: exact, as codec::f16_to_f32
}

inline __m256i bcast2(const std::int16_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Rows [r0, r0 + R) of the panel against tokens [lo, lo + 8) of group g:
// out[r * kGroup + lo + t].  madd_epi16 adds 2 products of 16-bit codes.
template <int R, bool Q4>
void rows8(const Panel& p, int r0, const QuantizedX& x, int g, int lo, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < p.nb; ++b) {
    __m256i ai[R];
    for (int r = 0; r < R; ++r) ai[r] = _mm256_setzero_si256();
    const std::int16_t* w = p.w.data() + static_cast<std::size_t>(r0) * p.cols + b * 32;
    for (int k2 = 0; k2 < 16; ++k2) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qrow(g, b, k2) + 2 * lo));
      for (int r = 0; r < R; ++r)
        ai[r] = _mm256_add_epi32(
            ai[r],
            _mm256_madd_epi16(bcast2(w + static_cast<std::size_t>(r) * p.cols + 2 * k2), xv));
    }
    const std::size_t at = x.at(g, b) + lo;
    const __m256 dxv = _mm256_loadu_ps(&x.dx[at]);
    const __m256 sxv = Q4 ? _mm256_loadu_ps(&x.sx[at]) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const std::size_t rb = static_cast<std::size_t>(r0 + r) * p.nb + b;
      const __m256 s = _mm256_mul_ps(_mm256_set1_ps(p.d[rb]), dxv);
      acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(ai[r]), acc[r]);
      if (Q4) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(p.m[rb]), sxv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(out + static_cast<std::size_t>(r0 + r) * kGroup + lo, acc[r]);
}

}  // namespace

void unpack_panel_avx2(const WeightMatrix& w, int row0, int n, Panel* p) {
  const int cols = w.cols, nb = cols / 32;
  p->reset(cols);
  p->q4 = w.type == WeightType::kQ4_1;
  const std::uint8_t* base = static_cast<const std::uint8_t*>(w.data);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const std::size_t row_bytes = static_cast<std::size_t>(nb) * (p->q4 ? 20 : 34);
  for (int r = 0; r < kPanelRows; ++r) {
    const int row = row0 + (r < n ? r : 0);
    const std::uint8_t* src = base + static_cast<std::size_t>(row) * row_bytes;
    // Row r of the panel after next: in cache by the time it is unpacked.
    for (std::size_t off = 0; off < row_bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(src + 2 * kPanelRows * row_bytes + off),
                   _MM_HINT_T0);
    std::int16_t* dst = &p->w[static_cast<std::size_t>(r) * cols];
    float* d = &p->d[static_cast<std::size_t>(r) * nb];
    float* m = &p->m[static_cast<std::size_t>(r) * nb];
    for (int b = 0; b < nb; ++b) {
      if (p->q4) {
        const std::uint8_t* blk = src + static_cast<std::size_t>(b) * 20;
        d[b] = half(blk);
        m[b] = half(blk + 2);
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * 32),
                            _mm256_cvtepu8_epi16(_mm_and_si128(v, low4)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * 32 + 16),
                            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low4)));
      } else {
        const std::uint8_t* blk = src + static_cast<std::size_t>(b) * 34;
        d[b] = half(blk);
        m[b] = 0.0f;
        for (int h = 0; h < 2; ++h)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + b * 32 + 16 * h),
                              _mm256_cvtepi8_epi16(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(blk + 2 + 16 * h))));
      }
    }
  }
}

void quantize_x_avx2(const float* x, int n, int cols, QuantizedX* out) {
  out->prepare(n, cols / 32);
  quantize_tokens_avx2(x, cols, 0, n, 0, cols / 32, out);
}

void quantize_tokens_avx2(const float* x, int cols, int t0, int t1, int b0, int b1,
                          QuantizedX* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(32767.0f),
               lo = _mm256_set1_ps(-32767.0f);
  for (int t = t0; t < t1; ++t) {
    const int g = t / out->group, lane = t % out->group;
    for (int b = b0; b < b1; ++b) {
      const float* xb = x + static_cast<std::size_t>(t) * cols + static_cast<std::size_t>(b) * 32;
      __m256 v[4];
      // amax: max(|x|, acc) keeps acc where |x| is NaN, as the scalar loop does.
      __m256 mx = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), mx);
      }
      alignas(32) float ml[8];
      _mm256_store_ps(ml, mx);
      float amax = 0.0f;
      for (float e : ml) amax = e > amax ? e : amax;
      const float dx = amax / 32767.0f;
      const float id = dx > 0.0f ? 1.0f / dx : 0.0f;
      const __m256 idv = _mm256_set1_ps(id);
      __m256i q[4];
      for (int j = 0; j < 4; ++j) {
        __m256 s = _mm256_mul_ps(v[j], idv);
        s = _mm256_and_ps(s, _mm256_cmp_ps(s, s, _CMP_ORD_Q));               // NaN -> 0
        q[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(s, lo), hi));  // ties to even
      }
      const __m256i s01 = _mm256_add_epi32(q[0], q[1]), s23 = _mm256_add_epi32(q[2], q[3]);
      const __m256i s4 = _mm256_add_epi32(s01, s23);
      __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
      s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4E));
      s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1));
      const std::int32_t qsum = _mm_cvtsi128_si32(s2);
      // 32 codes in order: packs interleaves 128-bit lanes, the permute undoes it.
      alignas(32) std::int32_t words[16];
      for (int h = 0; h < 2; ++h)
        _mm256_store_si256(
            reinterpret_cast<__m256i*>(words + 8 * h),
            _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8));
      if (out->group == 1)  // the block's codes in order
        std::memcpy(out->qrow_mut(g, b, 0), words, sizeof words);
      else
        for (int k2 = 0; k2 < 16; ++k2)
          std::memcpy(out->qrow_mut(g, b, k2) + 2 * lane, &words[k2], 4);
      const std::size_t at = out->at(g, b) + lane;
      out->dx[at] = dx;
      out->qsum[at] = qsum;
      out->sx[at] = dx * static_cast<float>(qsum);
    }
  }
}

void panel_products_avx2(const Panel& p, const QuantizedX& x, int g, int n_lanes, float* out) {
  for (int lo = 0; lo < n_lanes; lo += 8) {
    if (p.q4) {
      rows8<4, true>(p, 0, x, g, lo, out);
      rows8<4, true>(p, 4, x, g, lo, out);
    } else {
      rows8<4, false>(p, 0, x, g, lo, out);
      rows8<4, false>(p, 4, x, g, lo, out);
    }
  }
}

namespace {

// fp16 bits in the low 16 bits of each int32 lane, as 8 floats (F16C: exact).
inline __m256 halves(__m256i v) {
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(p));
}

}  // namespace

void rows_one_token_avx2(const WeightMatrix& w, int row0, int n, const std::int16_t* xq,
                         const float* dx, const float* sx, float* out) {
  constexpr int R = kOneTokenRows;
  const RowSpan rs(w, row0, n);
  const __m256i offv = _mm256_load_si256(reinterpret_cast<const __m256i*>(rs.offs));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  __m256 acc = _mm256_setzero_ps();
  for (int b = 0; b < rs.nb; ++b) {
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32 + 16));
    rs.prefetch_next(b);
    __m256i v[R];
    for (int r = 0; r < R; ++r) {
      const std::uint8_t* blk = rs.block(r, b);
      __m256i wa, wb;
      if (rs.q4) {
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        wa = _mm256_cvtepu8_epi16(_mm_and_si128(c, low4));
        wb = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(c, 4), low4));
      } else {
        wa = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
        wb = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
      }
      v[r] = _mm256_add_epi32(_mm256_madd_epi16(wa, xa), _mm256_madd_epi16(wb, xb));
    }
    // The 8 rows' sums in order (integer additions: exact in any order).
    const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20),
                                          _mm256_permute2x128_si256(u0, u1, 0x31));
    const __m256i dm =
        _mm256_i32gather_epi32(reinterpret_cast<const int*>(rs.block(0, b)), offv, 1);
    const __m256 s = _mm256_mul_ps(halves(_mm256_and_si256(dm, lo16)), _mm256_set1_ps(dx[b]));
    acc = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(isum), acc);
    if (rs.q4) acc = _mm256_fmadd_ps(halves(_mm256_srli_epi32(dm, 16)), _mm256_set1_ps(sx[b]), acc);
  }
  alignas(32) float res[R];
  _mm256_store_ps(res, acc);
  for (int r = 0; r < n; ++r) out[r] = res[r];
}

}  // namespace kvxfer::model::detail
