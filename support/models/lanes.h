// The one lane order of the runner's 8-lane float sums (attention): lane
// l accumulates the elements i = l (mod 8), and the lanes are summed as
//   ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
// The scalar form is the definition; the AVX2 form (only in files compiled
// with -mavx2) performs the same additions.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvxfer::model::detail {

inline float lane_sum(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

#if defined(__AVX2__)
inline float lane_sum(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // l0+l4 ..
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// lane_sum of each of v[0..7] at once, as one vector in their order: the
// same additions, u = lo + hi (l0+l4, l1+l5, l2+l6, l3+l7), then
// (u0+u2) + (u1+u3), on transposed vectors.
inline __m256 lane_sums8(const __m256* v) {
  __m256 u[4];
  for (int i = 0; i < 4; ++i)  // [v2i.lo | v2i+1.lo] + [v2i.hi | v2i+1.hi]
    u[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  // [u0+u2, u1+u3] of v0, v2 | of v1, v3 (and of v4, v6 | v5, v7).
  const __m256 s0 =
      _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x44), _mm256_shuffle_ps(u[0], u[1], 0xEE));
  const __m256 s1 =
      _mm256_add_ps(_mm256_shuffle_ps(u[2], u[3], 0x44), _mm256_shuffle_ps(u[2], u[3], 0xEE));
  // (u0+u2) + (u1+u3): lanes hold v0, v2, v4, v6 | v1, v3, v5, v7.
  const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(s0, s1, 0x88), _mm256_shuffle_ps(s0, s1, 0xDD));
  return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// lane_sum of both 8-lane halves of v[0..7] at once (AVX-512, by target
// attribute: the callers are AVX-512 code): r[u] = lane_sum(low half of
// v[u]), r[8 + u] = lane_sum(high half).  The same additions: u = lo + hi
// (l0+l4, l1+l5, l2+l6, l3+l7), then (u0+u2) + (u1+u3), on transposed
// vectors.
__attribute__((target("avx512f"))) inline __m512 lane_sums16(const __m512* v) {
  __m512 u[4];
  for (int i = 0; i < 4; ++i)  // 128-bit lanes: [lo, lo, lo, lo] + [hi, hi, hi, hi]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
  const __m512 s0 =
      _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x44), _mm512_shuffle_ps(u[0], u[1], 0xEE));
  const __m512 s1 =
      _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], 0x44), _mm512_shuffle_ps(u[2], u[3], 0xEE));
  // 128-bit lane L of f: half (L & 1) of v[2i + (L >> 1)], i = 0..3.
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(s0, s1, 0x88), _mm512_shuffle_ps(s0, s1, 0xDD));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), f);
}
#endif

}  // namespace kvxfer::model::detail
