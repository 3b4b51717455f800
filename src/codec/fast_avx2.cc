// AVX2 + F16C row kernels (compiled with -mavx2 -mf16c, selected at run time).
// Per element they perform the reference's operations in the same order:
// subtract, divide, table lookup; multiply, add, round to the output dtype.
// No FMA: contraction is off project-wide and -mfma is not given.
#include <immintrin.h>

#include <limits>

#include "codec/fast.h"

namespace kvxfer::codec::fast {

namespace {

inline __m256 load8(const uint8_t* row, int32_t c, kvxfer_dtype_t dt) {
  switch (dt) {
    case KVXFER_DTYPE_BF16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case KVXFER_DTYPE_FP16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c)));
    default: return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + c);
  }
}

// Round-to-nearest-even float -> bfloat16 for finite or infinite input (the
// decoder never produces NaN), packed to 8 x u16.
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

bool minmax_avx2(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, float* mn, float* mx) {
  const __m256 inf = _mm256_set1_ps(__builtin_inff());
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int32_t c = 0;
  for (; c + 8 <= H; c += 8) {
    const __m256 x = load8(row, c, dt);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_and_ps(x, absmask), inf, _CMP_LT_OQ));
    // Operand order as the reference's "if (x < mn) mn = x": keep mn unless x < mn.
    _mm256_storeu_ps(mn + c,
                     _mm256_blendv_ps(_mm256_loadu_ps(mn + c), x,
                                      _mm256_cmp_ps(x, _mm256_loadu_ps(mn + c), _CMP_LT_OQ)));
    _mm256_storeu_ps(mx + c,
                     _mm256_blendv_ps(_mm256_loadu_ps(mx + c), x,
                                      _mm256_cmp_ps(x, _mm256_loadu_ps(mx + c), _CMP_GT_OQ)));
  }
  bool ok = _mm256_movemask_ps(finite) == 0xFF;
  for (; c < H; ++c) {
    const float x = load_elem(row, c, dt);
    ok &= std::isfinite(x);
    if (x < mn[c]) mn[c] = x;
    if (x > mx[c]) mx[c] = x;
  }
  return ok;
}

void encode_row_avx2(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                     const float* d, const Codebook& cb, uint8_t* codes) {
  const __m256 n = _mm256_set1_ps(static_cast<float>(1 << cb.lut_log2));
  const __m256 zero = _mm256_setzero_ps();
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i origin = _mm256_set1_epi32(cb.lut_origin);
  const int* base = cb.lut_base.data();
  const float* next = cb.lut_next.data();
  int32_t c = 0;
  for (; c + 8 <= H; c += 8) {
    const __m256 x = load8(row, c, dt);
    const __m256 dv = _mm256_loadu_ps(d + c);
    const __m256 z = _mm256_and_ps(_mm256_div_ps(_mm256_sub_ps(x, _mm256_loadu_ps(m + c)), dv),
                                   _mm256_cmp_ps(dv, zero, _CMP_GT_OQ));
    __m256i code;
    if (cb.sign_magnitude) {
      const __m256 a = _mm256_and_ps(z, absmask);
      const __m256i i = _mm256_cvttps_epi32(_mm256_mul_ps(a, n));
      const __m256i q = _mm256_sub_epi32(
          _mm256_i32gather_epi32(base, i, 4),
          _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_i32gather_ps(next, i, 4), _CMP_GE_OQ)));
      const __m256i s = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(z, zero, _CMP_LT_OQ)),
                                         _mm256_set1_epi32(0x80));
      code = _mm256_or_si256(q, s);
    } else {
      const __m256i i =
          _mm256_add_epi32(_mm256_cvttps_epi32(_mm256_floor_ps(_mm256_mul_ps(z, n))), origin);
      code = _mm256_sub_epi32(
          _mm256_i32gather_epi32(base, i, 4),
          _mm256_castps_si256(_mm256_cmp_ps(z, _mm256_i32gather_ps(next, i, 4), _CMP_GE_OQ)));
    }
    const __m128i w =
        _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + c), _mm_packus_epi16(w, w));
  }
  if (c < H)
    scalar_kernels().encode_row(row + c * dtype_size(dt), dt, H - c, m + c, d + c, cb, codes + c);
}

void decode_row_avx2(const uint8_t* idx, int32_t H, const float* m, const float* d,
                     const float* table, kvxfer_dtype_t dt, uint8_t* row) {
  int32_t c = 0;
  for (; c + 8 <= H; c += 8) {
    const __m256i i =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(idx + c)));
    const __m256 r = _mm256_i32gather_ps(table, i, 4);
    const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
    const __m256 v = _mm256_min_ps(  // the clamp of codec_math.h denormalise()
        _mm256_max_ps(
            _mm256_add_ps(_mm256_loadu_ps(m + c), _mm256_mul_ps(_mm256_loadu_ps(d + c), r)),
            _mm256_sub_ps(_mm256_setzero_ps(), big)),
        big);
    switch (dt) {
      case KVXFER_DTYPE_BF16:
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 2 * c), to_bf16(v));
        break;
      case KVXFER_DTYPE_FP16:
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 2 * c),
                         _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        break;
      default: _mm256_storeu_ps(reinterpret_cast<float*>(row) + c, v);
    }
  }
  if (c < H)
    scalar_kernels().decode_row(idx + c, H - c, m + c, d + c, table, dt, row + c * dtype_size(dt));
}

}  // namespace

const RowKernels& avx2_kernels() {
  static const RowKernels k{minmax_avx2, encode_row_avx2, decode_row_avx2};
  return k;
}

}  // namespace kvxfer::codec::fast
