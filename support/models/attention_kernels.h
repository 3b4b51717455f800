// The per-head attention kernel of the model runner, one definition for the
// scalar path and the AVX2 path (attention_kernels.cc, attention_avx2.cc),
// bit-identical between them and independent of how queries are batched:
//   s_t  = lanes(q . k_t) / sqrt(head_size), where lanes() accumulates
//          element i in lane i mod 8 by fma and sums the lanes as
//          ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7));
//   e_t  = exp8(s_t - max_t s_t), exp8 the polynomial of attention_kernels.cc
//          (|relative error| < 3e-7 against exp; 0 below -87.3);
//   sum  = lanes over the present keys (the r-th present key in lane r mod 8,
//          so a dropped key changes nothing but its absence);
//   out  = fma chain over t ascending of (e_t / sum) * v_t, per element.
// Keys a drop mask marks absent are skipped (e_t = 0); when every key is
// absent the output is zero.  head_size must be a multiple of 8.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvxfer::model::detail {

// A run of keys/values of one layer: `count` rows; kv_off selects the head.
struct Segment {
  const float* k;
  const float* v;
  std::size_t k_stride;
  std::size_t v_stride;
  int count;
  const std::uint8_t* drop = nullptr;  // KVLayerView::drop (nullptr: all present)
};

// One query head against up to n_segs segments (in order).  q, out:
// head_size floats; scores: scratch of at least the total key count + 8.
void attend_head(const float* q, int head_size, std::size_t kv_off, const Segment* segs, int n_segs,
                 float* scores, float* out);

// Several queries against one run of keys: query g attends to the first
// counts[g] keys of the segments (concatenated), as attend_head would on the
// segments cut to that many keys, with the same bits (attend_head_avx2 is
// the group of one).  Keys are read once for
// all the queries (the batched pass: the query heads of one KV head, for a
// chunk of tokens).  q[g], out[g]: head_size floats; scores: n_q rows of
// score_stride >= max(counts) + 8 floats.
void attend_group(const float* const* q, const int* counts, int n_q, int head_size,
                  std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                  std::size_t score_stride, float* const* out);
void attend_group_avx2(const float* const* q, const int* counts, int n_q, int head_size,
                       std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                       std::size_t score_stride, float* const* out);
// The same with AVX-512 kernels for head_size 64 or 128 (the AVX2 path for
// other sizes); requires have_avx512().  attend_group picks it when the CPU
// has AVX-512 and n_q > 1.
void attend_group_avx512(const float* const* q, const int* counts, int n_q, int head_size,
                         std::size_t kv_off, const Segment* segs, int n_segs, float* scores,
                         std::size_t score_stride, float* const* out);

// The two paths, for the tests; attend_head picks AVX2 when the CPU has it
// and head_size <= 128.  The *_avx2 entry points require head_size <= 128 (a
// multiple of 8): they hold a head in 16 registers' worth of stack.
void attend_head_scalar(const float* q, int head_size, std::size_t kv_off, const Segment* segs,
                        int n_segs, float* scores, float* out);
void attend_head_avx2(const float* q, int head_size, std::size_t kv_off, const Segment* segs,
                      int n_segs, float* scores, float* out);

// The sum of the exps e[t] of the present keys among the first n_keys of the
// segments, in the lane order above.
float present_sum(const float* e, const Segment* segs, int n_segs, int n_keys);

// exp8 of one value (the scalar definition of the polynomial).
float exp8(float x);

// exp8's constants, shared by its scalar and vector forms: 0 at or below
// kExpLow, inputs clamped to kExpHigh, n = round(x log2 e), r = x - n ln2 in
// two parts, p = Horner over kExpPoly (degree 6 down to 1) then + 1.
constexpr float kExpLow = -87.3f, kExpHigh = 88.3f, kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693145751953125f, kExpLn2Lo = 1.428606765330187045e-06f;
constexpr float kExpPoly[6] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f};

// SwiGLU of the feed-forward, in place: h[i] = (h[i] * (1 / (1 + exp8(-h[i])))) * up[i]
// (exp8 clamps -h[i] above 88.3, so a very negative h gives silu ~ -0).
// Same bits on the scalar and AVX2 paths; parallel over i (OpenMP).
void swiglu(float* h, const float* up, std::size_t n);
void swiglu_scalar(float* h, const float* up, std::size_t n);
void swiglu_avx2(float* h, const float* up, std::size_t n);

}  // namespace kvxfer::model::detail
