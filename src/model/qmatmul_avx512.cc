// AVX-512 kernels of qmatmul.h for batched passes (compiled with -mavx512f
// -mavx512dq -mavx512vl -mavx2 -mfma -mf16c; called only when the CPU has
// them).  A 512-bit register holds two weight rows' 8 lanes side by side
// (row 2i in the low half, row 2i+1 in the high half), each half fed the
// same activation vector.  Lane l of each half is therefore the fma chain of
// the elements k = l (mod 8) in ascending k, exactly as in the AVX2 and
// scalar paths, and the lanes are summed by the same lane_sums8: the bits are
// those of the definition in qmatmul.h.
#include <immintrin.h>

#include <cstring>

#include "model/lanes.h"
#include "model/qmatmul.h"

namespace kvxfer::model::detail {
namespace {

// [a x 8 | b x 8] of two fp16 scalars at pa and pb (F16C: exact).
inline __m512 half_pair(const std::uint8_t* pa, const std::uint8_t* pb) {
  std::uint16_t ha, hb;
  std::memcpy(&ha, pa, 2);
  std::memcpy(&hb, pb, 2);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(ha | (std::uint32_t{hb} << 16))));
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(_mm_cvtss_f32(f)),
                              _mm512_set1_ps(_mm_cvtss_f32(_mm_movehdup_ps(f))));
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

// acc[t][rp] = the two rows' 8 lanes of row pair rp times x row t, for NRP
// pairs and NT tokens: 24 accumulators, 3 weights and 1 activation in the 32
// registers at 3 x 8; per 8 k, 11 loads and 24 fmas.
template <int NRP, int NT>
void tile(const float* panel, int groups, const float* x, int cols, __m512* acc) {
  __m512 a[NRP][NT];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NRP; ++r) a[r][t] = _mm512_setzero_ps();
  int g = 0;
  do {  // groups >= 4: a do-while keeps the accumulators in registers
    __m512 w[NRP];
    for (int r = 0; r < NRP; ++r)
      w[r] = _mm512_load_ps(panel + (static_cast<std::size_t>(r) * groups + g) * 16);
    for (int t = 0; t < NT; ++t) {
      const __m512 xv = _mm512_broadcast_f32x8( _mm256_load_ps(x + static_cast<std::size_t>(t) * cols + static_cast<std::size_t>(g) * 8));
      for (int r = 0; r < NRP; ++r) a[r][t] = _mm512_fmadd_ps(w[r], xv, a[r][t]);
    }
  } while (++g < groups);
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NRP; ++r) _mm512_store_ps(reinterpret_cast<float*>(acc + t * NRP + r), a[r][t]);
}

template <int NRP>
void pairs_tile(const float* panel, int groups, const float* x, int cols, int n_tokens, __m512* acc) {
  int t = 0;
  for (; t + 8 <= n_tokens; t += 8)
    tile<NRP, 8>(panel, groups, x + static_cast<std::size_t>(t) * cols, cols, acc + t * NRP);
  const float* xt = x + static_cast<std::size_t>(t) * cols;
  __m512* at = acc + t * NRP;
  switch (n_tokens - t) {
    case 7: return tile<NRP, 7>(panel, groups, xt, cols, at);
    case 6: return tile<NRP, 6>(panel, groups, xt, cols, at);
    case 5: return tile<NRP, 5>(panel, groups, xt, cols, at);
    case 4: return tile<NRP, 4>(panel, groups, xt, cols, at);
    case 3: return tile<NRP, 3>(panel, groups, xt, cols, at);
    case 2: return tile<NRP, 2>(panel, groups, xt, cols, at);
    case 1: return tile<NRP, 1>(panel, groups, xt, cols, at);
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
        const __m512 d = half_pair(p, q), m = half_pair(p + 2, q + 2);
        // Bytes j..j+7 widened once give elements j.. (low nibbles) and
        // 16+j.. (high nibbles); d*q is exact, so fma = RN(RN(d*q) + m).
        const __m512i b0 = bytes_pair_u8(p + 4, q + 4), b1 = bytes_pair_u8(p + 12, q + 12);
        float* o = out + static_cast<std::size_t>(b) * 64;
        _mm512_store_ps(o, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(b0, low4)), m));
        _mm512_store_ps(o + 16, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(b1, low4)), m));
        _mm512_store_ps(o + 32, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)), m));
        _mm512_store_ps(o + 48, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4)), m));
      }
    } else if (w.type == WeightType::kQ8_0) {
      const std::uint8_t* p = base + static_cast<std::size_t>(ra) * nb * 34;
      const std::uint8_t* q = base + static_cast<std::size_t>(rb) * nb * 34;
      for (int b = 0; b < nb; ++b, p += 34, q += 34) {
        const __m512 d = half_pair(p, q);
        for (int g = 0; g < 4; ++g)
          _mm512_store_ps(out + static_cast<std::size_t>(b) * 64 + g * 16,
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
                          float* out, int out_stride, float* acc_buf) {
  __m512* acc = reinterpret_cast<__m512*>(acc_buf);
  const int groups = cols / 8, n_pairs = (n_rows + 1) / 2;
  switch (n_pairs) {
    case 3: pairs_tile<3>(panel, groups, x, cols, n_tokens, acc); break;
    case 2: pairs_tile<2>(panel, groups, x, cols, n_tokens, acc); break;
    default: pairs_tile<1>(panel, groups, x, cols, n_tokens, acc); break;
  }
  // acc is [token][pair], each pair two rows' 8 lanes: as __m256 it is
  // [token][row] over 2 * n_pairs rows.
  const __m256* lanes = reinterpret_cast<const __m256*>(acc_buf);
  const int width = 2 * n_pairs, n = n_tokens * width;
  if (out_stride == width && width == n_rows) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, lane_sums8(lanes + i));
    for (; i < n; ++i) out[i] = lane_sum(lanes[i]);
    return;
  }
  for (int t = 0; t < n_tokens; ++t)
    for (int r = 0; r < n_rows; ++r)
      out[static_cast<std::size_t>(t) * out_stride + r] = lane_sum(lanes[t * width + r]);
}

}  // namespace kvxfer::model::detail
