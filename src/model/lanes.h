// The one lane order of the runner's 8-lane sums (qmatmul, attention): lane
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
#endif

}  // namespace kvxfer::model::detail
