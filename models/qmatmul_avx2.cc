// AVX2 + FMA kernels of qmatmul.h (compiled with -mavx2 -mfma; called only
// when the CPU has both).  They compute exactly the scalar definition of
// qmatmul.cc: the dequantization gives the same values (Q4_1's d*q has at
// most 11 + 4 significant bits, so it is exact and fma(d, q, m) rounds once,
// as the multiply and add do), and lane l of an accumulator holds the fma
// chain of the elements k = l (mod 8).
#include <immintrin.h>

#include <cstring>

#include "models/lanes.h"
#include "models/qmatmul.h"

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

// acc[t][r] = the 8 lanes of panel row r times x row t, for NR rows and NT
// tokens (acc: one __m256 per (token, row), rows fastest).  3 x 4 is the
// largest tile whose 12 accumulators, 3 weights and 1 activation fit in the
// 16 registers: per 8 k, 7 loads and 12 fmas.
template <int NR, int NT>
void tile(const float* panel, int cols, const float* x, __m256* acc) {
  __m256 a[NR][NT];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) a[r][t] = _mm256_setzero_ps();
  int k = 0;
  do {  // cols >= 32: a do-while keeps the accumulators in registers
    __m256 w[NR];
    for (int r = 0; r < NR; ++r)
      w[r] = _mm256_loadu_ps(panel + static_cast<std::size_t>(r) * cols + k);
    for (int t = 0; t < NT; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + static_cast<std::size_t>(t) * cols + k);
      for (int r = 0; r < NR; ++r) a[r][t] = _mm256_fmadd_ps(w[r], xv, a[r][t]);
    }
    k += 8;
  } while (k < cols);
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r)
      _mm256_store_ps(reinterpret_cast<float*>(acc + t * NR + r), a[r][t]);
}

template <int NR>
void rows_tile(const float* panel, int cols, const float* x, int n_tokens, __m256* acc) {
  int t = 0;
  for (; t + 4 <= n_tokens; t += 4)
    tile<NR, 4>(panel, cols, x + static_cast<std::size_t>(t) * cols, acc + t * NR);
  const float* xt = x + static_cast<std::size_t>(t) * cols;
  switch (n_tokens - t) {
    case 3: return tile<NR, 3>(panel, cols, xt, acc + t * NR);
    case 2: return tile<NR, 2>(panel, cols, xt, acc + t * NR);
    case 1: return tile<NR, 1>(panel, cols, xt, acc + t * NR);
    default: return;
  }
}

}  // namespace

void dequantize_rows_avx2(const WeightMatrix& w, int row0, int n, float* panel) {
  const int cols = w.cols, nb = cols / 32;
  const std::uint8_t* base = static_cast<const std::uint8_t*>(w.data);
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int r = 0; r < n; ++r) {
    float* out = panel + static_cast<std::size_t>(r) * cols;
    if (w.type == WeightType::kQ4_1) {
      const std::uint8_t* p = base + static_cast<std::size_t>(row0 + r) * nb * 20;
      if (r + 1 < n) _mm_prefetch(reinterpret_cast<const char*>(p + nb * 20 * 4), _MM_HINT_T0);
      for (int b = 0; b < nb; ++b, p += 20) {
        __m256 d, m;
        half2(p, &d, &m);
        // Bytes j..j+7 widened once give elements j.. (low nibbles) and
        // 16+j.. (high nibbles).
        const __m256i b0 =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 4)));
        const __m256i b1 =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 12)));
        float* o = out + b * 32;  // d*q exact: fma = RN(RN(d*q) + m)
        _mm256_store_ps(o, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low4)), m));
        _mm256_store_ps(o + 8,
                        _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low4)), m));
        _mm256_store_ps(o + 16,
                        _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), m));
        _mm256_store_ps(o + 24,
                        _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), m));
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
      const std::uint8_t* p =
          base + static_cast<std::size_t>(r) * row_bytes + static_cast<std::size_t>(b) * 20;
      _mm_prefetch(reinterpret_cast<const char*>(p + 1024), _MM_HINT_T0);
      __m256 d, m;
      half2(p, &d, &m);
      // One widening per 8 bytes serves two groups: the low nibbles are
      // elements j..j+7, the high ones elements 16+j..16+j+7.
      const __m256i b0 =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 4)));
      const __m256i b1 =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 12)));
      const __m256 w0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low4)), m);
      const __m256 w1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low4)), m);
      const __m256 w2 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), m);
      const __m256 w3 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), m);
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
      const std::uint8_t* p =
          base + static_cast<std::size_t>(r) * row_bytes + static_cast<std::size_t>(b) * 34;
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
  const std::uint8_t* base =
      static_cast<const std::uint8_t*>(w.data) + static_cast<std::size_t>(row0) * nb * bb;
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
                         float* out, int out_stride, float* acc_buf) {
  __m256* acc = reinterpret_cast<__m256*>(acc_buf);
  switch (n_rows) {
    case 3: rows_tile<3>(panel, cols, x, n_tokens, acc); break;
    case 2: rows_tile<2>(panel, cols, x, n_tokens, acc); break;
    default: rows_tile<1>(panel, cols, x, n_tokens, acc); break;
  }
  // acc is [token][row]; out_stride == n_rows makes out the same order.
  const int n = n_tokens * n_rows;
  int i = 0;
  if (out_stride == n_rows)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, lane_sums8(acc + i));
  for (; i < n; ++i) out[(i / n_rows) * out_stride + i % n_rows] = lane_sum(acc[i]);
}

}  // namespace kvxfer::model::detail
