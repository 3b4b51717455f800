// AVX2 + FMA kernels of qmatmul.h (compiled with -mavx2 -mfma; called only
// when the CPU has both).  They compute exactly the scalar definition of
// qmatmul.cc: the dequantization is the same multiply and add, and lane l of
// an accumulator holds the fma chain of the elements k = l (mod 8).
#include <immintrin.h>

#include <cstring>

#include "model/lanes.h"
#include "model/qmatmul.h"

namespace kvxfer::model::detail {
namespace {

// d of a Q8_0 block by F16C, broadcast.
inline __m256 half1(const std::uint8_t* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(v)));
}

// d and m of a Q4_1 block (two fp16 at p) by F16C: exact, as f16_to_f32 is.
inline void half2(const std::uint8_t* p, __m256* d, __m256* m) {
  std::int32_t v;
  std::memcpy(&v, p, 4);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(v));
  *d = _mm256_broadcastss_ps(f);
  *m = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
}

template <int NR, int NT>
void tile(const float* panel, int cols, const float* x, float* out, int out_stride) {
  __m256 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int k = 0; k < cols; k += 8) {
    __m256 w[NR];
    for (int r = 0; r < NR; ++r) w[r] = _mm256_loadu_ps(panel + static_cast<std::size_t>(r) * cols + k);
    for (int t = 0; t < NT; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + static_cast<std::size_t>(t) * cols + k);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm256_fmadd_ps(w[r], xv, acc[r][t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) out[static_cast<std::size_t>(t) * out_stride + r] = lane_sum(acc[r][t]);
}

template <int NR>
void rows_tile(const float* panel, int cols, const float* x, int n_tokens, float* out, int stride) {
  int t = 0;
  for (; t + 3 <= n_tokens; t += 3)
    tile<NR, 3>(panel, cols, x + static_cast<std::size_t>(t) * cols, out + static_cast<std::size_t>(t) * stride, stride);
  if (n_tokens - t == 2)
    tile<NR, 2>(panel, cols, x + static_cast<std::size_t>(t) * cols, out + static_cast<std::size_t>(t) * stride, stride);
  else if (n_tokens - t == 1)
    tile<NR, 1>(panel, cols, x + static_cast<std::size_t>(t) * cols, out + static_cast<std::size_t>(t) * stride, stride);
}

}  // namespace

void dequantize_rows_avx2(const WeightMatrix& w, int row0, int n, float* panel) {
  const int cols = w.cols, nb = cols / 32;
  const std::uint8_t* base = static_cast<const std::uint8_t*>(w.data);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int r = 0; r < n; ++r) {
    float* out = panel + static_cast<std::size_t>(r) * cols;
    if (w.type == WeightType::kQ4_1) {
      const std::uint8_t* p = base + static_cast<std::size_t>(row0 + r) * nb * 20;
      if (r + 1 < n) _mm_prefetch(reinterpret_cast<const char*>(p + nb * 20 * 4), _MM_HINT_T0);
      for (int b = 0; b < nb; ++b, p += 20) {
        __m256 d, m;
        half2(p, &d, &m);
        const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
        const __m128i lo = _mm_and_si128(qs, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int g = 0; g < 4; ++g) {
          const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[g]));
          _mm256_storeu_ps(out + b * 32 + g * 8, _mm256_add_ps(_mm256_mul_ps(d, q), m));
        }
      }
    } else if (w.type == WeightType::kQ8_0) {
      const std::uint8_t* p = base + static_cast<std::size_t>(row0 + r) * nb * 34;
      for (int b = 0; b < nb; ++b, p += 34) {
        const __m256 d = half1(p);
        for (int g = 0; g < 4; ++g) {
          const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + g * 8));
          const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
          _mm256_storeu_ps(out + b * 32 + g * 8, _mm256_mul_ps(d, q));
        }
      }
    } else {
      std::memcpy(out, w.f32() + static_cast<std::size_t>(row0 + r) * cols,
                  static_cast<std::size_t>(cols) * sizeof(float));
    }
  }
}

namespace {

template <int NR>
void one_token_q4_1(const std::uint8_t* base, std::size_t row_bytes, int nb, const float* x,
                    float* out) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8),
                 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
    for (int r = 0; r < NR; ++r) {
      const std::uint8_t* p = base + static_cast<std::size_t>(r) * row_bytes + static_cast<std::size_t>(b) * 20;
      _mm_prefetch(reinterpret_cast<const char*>(p + 1024), _MM_HINT_T0);
      __m256 d, m;
      half2(p, &d, &m);
      // One widening per 8 bytes serves two groups: the low nibbles are
      // elements j..j+7, the high ones elements 16+j..16+j+7.
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 4)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 12)));
      const __m256 w0 = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low4))), m);
      const __m256 w1 = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low4))), m);
      const __m256 w2 = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4))), m);
      const __m256 w3 = _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))), m);
      acc[r] = _mm256_fmadd_ps(w0, x0, acc[r]);
      acc[r] = _mm256_fmadd_ps(w1, x1, acc[r]);
      acc[r] = _mm256_fmadd_ps(w2, x2, acc[r]);
      acc[r] = _mm256_fmadd_ps(w3, x3, acc[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = lane_sum(acc[r]);
}

template <int NR>
void one_token_q8_0(const std::uint8_t* base, std::size_t row_bytes, int nb, const float* x,
                    float* out) {
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const float* xb = x + b * 32;
    for (int r = 0; r < NR; ++r) {
      const std::uint8_t* p = base + static_cast<std::size_t>(r) * row_bytes + static_cast<std::size_t>(b) * 34;
      _mm_prefetch(reinterpret_cast<const char*>(p + 1024), _MM_HINT_T0);
      const __m256 d = half1(p);
      for (int g = 0; g < 4; ++g) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + g * 8));
        const __m256 wv = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
        acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xb + g * 8), acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = lane_sum(acc[r]);
}

template <int NR>
void one_token(const WeightMatrix& w, int row0, const float* x, float* out) {
  const int nb = w.cols / 32;
  const std::size_t bb = w.type == WeightType::kQ4_1 ? 20 : 34;
  const std::uint8_t* base = static_cast<const std::uint8_t*>(w.data) + static_cast<std::size_t>(row0) * nb * bb;
  if (w.type == WeightType::kQ4_1)
    one_token_q4_1<NR>(base, nb * bb, nb, x, out);
  else
    one_token_q8_0<NR>(base, nb * bb, nb, x, out);
}

}  // namespace

void rows_one_token_avx2(const WeightMatrix& w, int row0, int n, const float* x, float* out) {
  switch (n) {
    case 4: return one_token<4>(w, row0, x, out);
    case 3: return one_token<3>(w, row0, x, out);
    case 2: return one_token<2>(w, row0, x, out);
    default: return one_token<1>(w, row0, x, out);
  }
}

void panel_products_avx2(const float* panel, int n_rows, int cols, const float* x, int n_tokens,
                         float* out, int out_stride) {
  switch (n_rows) {
    case 4: return rows_tile<4>(panel, cols, x, n_tokens, out, out_stride);
    case 3: return rows_tile<3>(panel, cols, x, n_tokens, out, out_stride);
    case 2: return rows_tile<2>(panel, cols, x, n_tokens, out, out_stride);
    default: return rows_tile<1>(panel, cols, x, n_tokens, out, out_stride);
  }
}

}  // namespace kvxfer::model::detail
