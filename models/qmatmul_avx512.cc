// AVX-512 kernels of qmatmul.h for batched passes (compiled with -mavx512f
// -mavx512dq -mavx512vl -mavx2 -mfma -mf16c; called only when the CPU has
// them).  A 512-bit register holds two weight rows' 8 lanes side by side
// (row 2i in the low half, row 2i+1 in the high half), each half fed the
// same activation vector.  Lane l of each half is therefore the fma chain of
// the elements k = l (mod 8) in ascending k, exactly as in the AVX2 and
// scalar paths, and lane_sums16 (lanes.h) sums the lanes in the same order:
// the bits are those of the definition in qmatmul.h.
#include <immintrin.h>

#include <cstring>

#include "models/lanes.h"
#include "models/qmatmul.h"

namespace kvxfer::model::detail {
namespace {

// The fp16 pairs (d, m) at pa and pb (F16C: exact) as [da x 8 | db x 8]
// and [ma x 8 | mb x 8]; Q8_0 uses d only.
inline void scales_pair(const std::uint8_t* pa, const std::uint8_t* pb, __m512* d, __m512* m) {
  std::int32_t a, b;
  std::memcpy(&a, pa, 4);
  std::memcpy(&b, pb, 4);
  const __m512 f =
      _mm512_castps128_ps512(_mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(a), b, 1)));
  *d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), f);
  *m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), f);
}

// Bytes [p, p + 8) and [q, q + 8) as 16 int32: p's in the low half.
inline __m128i bytes_pair(const std::uint8_t* p, const std::uint8_t* q) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
}
inline __m512i bytes_pair_u8(const std::uint8_t* p, const std::uint8_t* q) {
  return _mm512_cvtepu8_epi32(bytes_pair(p, q));
}
inline __m512i bytes_pair_i8(const std::uint8_t* p, const std::uint8_t* q) {
  return _mm512_cvtepi8_epi32(bytes_pair(p, q));
}

// The products of NRP row pairs with NT <= 8 tokens, reduced in registers:
// out[r * ld + t] for the 2 * NRP rows and tokens t < 8 (those past NT are
// padding).  24 accumulators, 3 weights and 1 activation in the 32 registers
// at 3 x 8; per 8 k, 11 loads and 24 fmas.
template <int NRP, int NT>
void tile(const float* panel, int groups, const float* x, int cols, float* out, int ld) {
  __m512 a[NRP][8];
  for (int t = 0; t < 8; ++t)
    for (int r = 0; r < NRP; ++r) a[r][t] = _mm512_setzero_ps();
  int g = 0;
  do {  // groups >= 4: a do-while keeps the accumulators in registers
    __m512 w[NRP];
    for (int r = 0; r < NRP; ++r)
      w[r] = _mm512_load_ps(panel + (static_cast<std::size_t>(r) * groups + g) * 16);
    for (int t = 0; t < NT; ++t) {
      const __m512 xv = _mm512_broadcast_f32x8(
          _mm256_load_ps(x + static_cast<std::size_t>(t) * cols + static_cast<std::size_t>(g) * 8));
      for (int r = 0; r < NRP; ++r) a[r][t] = _mm512_fmadd_ps(w[r], xv, a[r][t]);
    }
  } while (++g < groups);
  for (int r = 0; r < NRP; ++r) {  // [row 2r, tokens 0..7 | row 2r+1, tokens 0..7]
    const __m512 sums = lane_sums16(a[r]);
    _mm256_storeu_ps(out + static_cast<std::size_t>(2 * r) * ld, _mm512_castps512_ps256(sums));
    _mm256_storeu_ps(out + static_cast<std::size_t>(2 * r + 1) * ld,
                     _mm512_extractf32x8_ps(sums, 1));
  }
}

template <int NRP>
void pairs_tile(const float* panel, int groups, const float* x, int cols, int n_tokens, float* out,
                int ld) {
  int t = 0;
  for (; t + 8 <= n_tokens; t += 8)
    tile<NRP, 8>(panel, groups, x + static_cast<std::size_t>(t) * cols, cols, out + t, ld);
  const float* xt = x + static_cast<std::size_t>(t) * cols;
  float* ot = out + t;
  switch (n_tokens - t) {
    case 7: return tile<NRP, 7>(panel, groups, xt, cols, ot, ld);
    case 6: return tile<NRP, 6>(panel, groups, xt, cols, ot, ld);
    case 5: return tile<NRP, 5>(panel, groups, xt, cols, ot, ld);
    case 4: return tile<NRP, 4>(panel, groups, xt, cols, ot, ld);
    case 3: return tile<NRP, 3>(panel, groups, xt, cols, ot, ld);
    case 2: return tile<NRP, 2>(panel, groups, xt, cols, ot, ld);
    case 1: return tile<NRP, 1>(panel, groups, xt, cols, ot, ld);
    default: return;
  }
}

}  // namespace

void dequantize_pairs_avx512(const WeightMatrix& w, int row0, int n, float* panel) {
  const int cols = w.cols, nb = cols / 32, groups = cols / 8;
  const std::uint8_t* base = static_cast<const std::uint8_t*>(w.data);
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  for (int rp = 0; rp < (n + 1) / 2; ++rp) {
    // An odd last row is paired with itself; the copy's products are dropped.
    const int ra = row0 + 2 * rp, rb = 2 * rp + 1 < n ? ra + 1 : ra;
    float* out = panel + static_cast<std::size_t>(rp) * groups * 16;
    if (w.type == WeightType::kQ4_1) {
      const std::uint8_t* p = base + static_cast<std::size_t>(ra) * nb * 20;
      const std::uint8_t* q = base + static_cast<std::size_t>(rb) * nb * 20;
      for (int b = 0; b < nb; ++b, p += 20, q += 20) {
        // The next panel's rows (6 on): in cache by the time it is dequantized.
        _mm_prefetch(reinterpret_cast<const char*>(p + 6 * nb * 20), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + 6 * nb * 20), _MM_HINT_T0);
        __m512 d, m;
        scales_pair(p, q, &d, &m);
        // Bytes j..j+7 widened once give elements j.. (low nibbles) and
        // 16+j.. (high nibbles); d*q is exact, so fma = RN(RN(d*q) + m).
        const __m512i b0 = bytes_pair_u8(p + 4, q + 4), b1 = bytes_pair_u8(p + 12, q + 12);
        float* o = out + static_cast<std::size_t>(b) * 64;
        _mm512_store_ps(o, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(b0, low4)), m));
        _mm512_store_ps(o + 16,
                        _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(b1, low4)), m));
        _mm512_store_ps(o + 32,
                        _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)), m));
        _mm512_store_ps(o + 48,
                        _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4)), m));
      }
    } else if (w.type == WeightType::kQ8_0) {
      const std::uint8_t* p = base + static_cast<std::size_t>(ra) * nb * 34;
      const std::uint8_t* q = base + static_cast<std::size_t>(rb) * nb * 34;
      for (int b = 0; b < nb; ++b, p += 34, q += 34) {
        _mm_prefetch(reinterpret_cast<const char*>(p + 6 * nb * 34), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + 6 * nb * 34), _MM_HINT_T0);
        __m512 d, m;  // m: the block's first two codes as fp16, unused
        scales_pair(p, q, &d, &m);
        for (int g = 0; g < 4; ++g)
          _mm512_store_ps(
              out + static_cast<std::size_t>(b) * 64 + g * 16,
              _mm512_mul_ps(d, _mm512_cvtepi32_ps(bytes_pair_i8(p + 2 + g * 8, q + 2 + g * 8))));
      }
    } else {
      const float* fa = w.f32() + static_cast<std::size_t>(ra) * cols;
      const float* fb = w.f32() + static_cast<std::size_t>(rb) * cols;
      for (int g = 0; g < groups; ++g) {
        std::memcpy(out + g * 16, fa + g * 8, 8 * sizeof(float));
        std::memcpy(out + g * 16 + 8, fb + g * 8, 8 * sizeof(float));
      }
    }
  }
}

void pair_products_avx512(const float* panel, int n_rows, int cols, const float* x, int n_tokens,
                          float* out, int ld) {
  const int groups = cols / 8;
  switch ((n_rows + 1) / 2) {
    case 3: return pairs_tile<3>(panel, groups, x, cols, n_tokens, out, ld);
    case 2: return pairs_tile<2>(panel, groups, x, cols, n_tokens, out, ld);
    default: return pairs_tile<1>(panel, groups, x, cols, n_tokens, out, ld);
  }
}

}  // namespace kvxfer::model::detail
