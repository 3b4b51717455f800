// AVX2 + F16C + FMA row kernels (compiled with -mavx2 -mf16c -mfma, selected
// at run time).  Per element they perform the reference's operations in the
// same order (codec_math.h): u = x - m, then one fma (linear codes) or a
// multiply and the table lookup (alpha-law codes); x = fma(d, r, m), then the
// rounding to the output dtype.  The intrinsics are single IEEE operations;
// contraction is off project-wide, so nothing else is fused.
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

// ---------------------------------------------------------------------------
// Min/max.  Over the order-preserving integer key of the bits (sign-magnitude
// to two's complement: key = u ^ ((u >> 15) & 0x7FFF) for 16-bit values), so
// bf16/fp16 rows need no conversion, and the non-finite check falls out of
// the extreme keys: a value is NaN or Inf iff its key is >= the key of +Inf or
// <= the key of -Inf.  The key order equals the float order except that -0 <
// +0, which canonical_minmax erases.
// ---------------------------------------------------------------------------
inline __m256i key16(__m256i u) {
  return _mm256_xor_si256(u, _mm256_and_si256(_mm256_srai_epi16(u, 15), _mm256_set1_epi16(0x7FFF)));
}
inline __m256i key32(__m256i u) {
  return _mm256_xor_si256(
      u, _mm256_and_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(0x7FFFFFFF)));
}

// Channels per register block: 4 vectors of min and of max stay in registers
// while the chunk's rows stream past.
constexpr int kMinmaxVecs = 4;

// Integer keys of 16 or 32 bits, 256 bits at a time.
template <int BITS>
struct Keys;
template <>
struct Keys<16> {
  using T = int16_t;
  static __m256i key(__m256i u) { return key16(u); }
  static __m256i min(__m256i a, __m256i b) { return _mm256_min_epi16(a, b); }
  static __m256i max(__m256i a, __m256i b) { return _mm256_max_epi16(a, b); }
  static __m256i gt(__m256i a, __m256i b) { return _mm256_cmpgt_epi16(a, b); }
};
template <>
struct Keys<32> {
  using T = int32_t;
  static __m256i key(__m256i u) { return key32(u); }
  static __m256i min(__m256i a, __m256i b) { return _mm256_min_epi32(a, b); }
  static __m256i max(__m256i a, __m256i b) { return _mm256_max_epi32(a, b); }
  static __m256i gt(__m256i a, __m256i b) { return _mm256_cmpgt_epi32(a, b); }
};

// Row-major: each row streams through once (the hardware prefetcher follows
// it), and the per-channel key accumulators kmn/kmx (Hv keys each) stay in
// L1.  Returns the lanes whose keys lie beyond [lo, hi]: NaN or Inf.
template <int BITS>
__m256i accumulate_keys(const uint8_t* const* rows, int n, int32_t Hv, typename Keys<BITS>::T* kmn,
                        typename Keys<BITS>::T* kmx, __m256i hi, __m256i lo) {
  using K = Keys<BITS>;
  constexpr int kLanes = 256 / BITS, kBytes = BITS / 8;
  auto at = [](typename K::T* p, int32_t c) { return reinterpret_cast<__m256i*>(p + c); };
  for (int32_t c = 0; c < Hv; c += kLanes) {
    const __m256i k =
        K::key(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[0] + kBytes * c)));
    _mm256_storeu_si256(at(kmn, c), k);
    _mm256_storeu_si256(at(kmx, c), k);
  }
  for (int r = 1; r < n; ++r)
    for (int32_t c = 0; c < Hv; c += kLanes) {
      const __m256i k =
          K::key(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r] + kBytes * c)));
      _mm256_storeu_si256(at(kmn, c), K::min(_mm256_loadu_si256(at(kmn, c)), k));
      _mm256_storeu_si256(at(kmx, c), K::max(_mm256_loadu_si256(at(kmx, c)), k));
    }
  __m256i bad = _mm256_setzero_si256();
  for (int32_t c = 0; c < Hv; c += kLanes)
    bad = _mm256_or_si256(bad, _mm256_or_si256(K::gt(_mm256_loadu_si256(at(kmx, c)), hi),
                                               K::gt(lo, _mm256_loadu_si256(at(kmn, c)))));
  return bad;
}

bool minmax16(const uint8_t* const* rows, int n, bool bf16, int32_t H, float* mn, float* mx) {
  const int16_t inf_key = bf16 ? 0x7F80 : 0x7C00;  // key of +Inf; -Inf's is -1 - inf_key
  const int32_t Hv = H & ~15;
  // Keys as int16 over the float buffers' storage: mn/mx hold H floats, so
  // their first H * 2 bytes are free until the conversion below.
  int16_t* kmn = reinterpret_cast<int16_t*>(mn);
  int16_t* kmx = reinterpret_cast<int16_t*>(mx);
  const __m256i bad = accumulate_keys<16>(rows, n, Hv, kmn, kmx,
                                          _mm256_set1_epi16(static_cast<int16_t>(inf_key - 1)),
                                          _mm256_set1_epi16(static_cast<int16_t>(-inf_key)));
  // Keys back to floats (key16 is an involution on the bits), 8 at a time
  // from the top: the floats of channels [c, c+8) overwrite bytes [4c, 4c+32),
  // which hold keys of channels >= 2c, all converted already.
  for (int32_t c = Hv - 8; c >= 0; c -= 8) {
    for (int half = 0; half < 2; ++half) {
      int16_t* k = half ? kmx : kmn;
      float* out = half ? mx : mn;
      const __m128i kk = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k + c));
      const __m128i u =
          _mm_xor_si128(kk, _mm_and_si128(_mm_srai_epi16(kk, 15), _mm_set1_epi16(0x7FFF)));
      const __m256 f = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(u), 16))
                            : _mm256_cvtph_ps(u);
      _mm256_storeu_ps(out + c, f);
    }
  }
  const bool ok = _mm256_testz_si256(bad, bad) != 0;
  return minmax_channels_scalar(rows, n, bf16 ? KVXFER_DTYPE_BF16 : KVXFER_DTYPE_FP16, Hv, H, mn,
                                mx) &&
         ok;
}

bool minmax32(const uint8_t* const* rows, int n, int32_t H, float* mn, float* mx) {
  const int32_t Hv = H & ~7;
  int32_t* kmn = reinterpret_cast<int32_t*>(mn);  // keys in place of the floats
  int32_t* kmx = reinterpret_cast<int32_t*>(mx);
  const __m256i bad = accumulate_keys<32>(rows, n, Hv, kmn, kmx, _mm256_set1_epi32(0x7F7FFFFF),
                                          _mm256_set1_epi32(-0x7F800000));
  const __m256i m31 = _mm256_set1_epi32(0x7FFFFFFF);
  for (int32_t c = 0; c < Hv; c += 8)
    for (int32_t* k : {kmn, kmx}) {  // key32 is an involution on the bits
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(k + c),
                          _mm256_xor_si256(v, _mm256_and_si256(_mm256_srai_epi32(v, 31), m31)));
    }
  const bool ok = _mm256_testz_si256(bad, bad) != 0;
  return minmax_channels_scalar(rows, n, KVXFER_DTYPE_FP32, Hv, H, mn, mx) && ok;
}

bool chunk_minmax_avx2(const uint8_t* const* rows, int n, kvxfer_dtype_t dt, int32_t H, float* mn,
                       float* mx) {
  if (dt == KVXFER_DTYPE_FP32) return minmax32(rows, n, H, mn, mx);
  return minmax16(rows, n, dt == KVXFER_DTYPE_BF16, H, mn, mx);
}

// ---------------------------------------------------------------------------
// Metadata (codec_math.h chunk_affine, 8 channels at a time).  F16C's
// conversion rounds to nearest even, overflows to infinity and keeps
// subnormals exactly as f32_to_f16; rounding d up is that conversion plus one
// ulp where it fell below d.  Binary32 metadata (rare) takes the scalar path.
// ---------------------------------------------------------------------------
bool chunk_meta_avx2(float* mn, float* mx, int32_t H, bool fp32, float num, uint8_t* meta, float* m,
                     float* d, float* s) {
  if (fp32) return scalar_kernels().chunk_meta(mn, mx, H, fp32, num, meta, m, d, s);
  const __m256 zero = _mm256_setzero_ps(), half = _mm256_set1_ps(0.5f);
  const __m256 inf = _mm256_set1_ps(__builtin_inff()), nv = _mm256_set1_ps(num);
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256 bad = zero;
  int32_t c = 0;
  for (; c + 8 <= H; c += 8) {
    const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(mn + c), zero);  // canonical +0
    const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(mx + c), zero);
    const __m128i mh =
        _mm256_cvtps_ph(_mm256_add_ps(_mm256_mul_ps(half, lo), _mm256_mul_ps(half, hi)), kRne);
    const __m256 mv = _mm256_cvtph_ps(mh);
    const __m256 dv0 =
        _mm256_add_ps(_mm256_max_ps(_mm256_sub_ps(hi, mv), _mm256_sub_ps(mv, lo)), zero);
    __m128i dh = _mm256_cvtps_ph(dv0, kRne);
    // Below d after rounding: the next binary16 up (d >= 0: one more in the bits).
    const __m256 below = _mm256_cmp_ps(_mm256_cvtph_ps(dh), dv0, _CMP_LT_OQ);
    const __m256i bel = _mm256_castps_si256(below);
    const __m128i bel16 =
        _mm_packs_epi32(_mm256_castsi256_si128(bel), _mm256_extracti128_si256(bel, 1));
    dh = _mm_sub_epi16(dh, bel16);
    const __m256 dv = _mm256_cvtph_ps(dh);
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), mv),
                                                       inf, _CMP_EQ_OQ),
                                         _mm256_cmp_ps(dv, inf, _CMP_EQ_OQ)));
    _mm256_storeu_ps(m + c, mv);
    _mm256_storeu_ps(d + c, dv);
    _mm256_storeu_ps(s + c,
                     _mm256_and_ps(_mm256_div_ps(nv, dv), _mm256_cmp_ps(dv, zero, _CMP_GT_OQ)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(meta + 4 * c), _mm_unpacklo_epi16(mh, dh));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(meta + 4 * c + 16), _mm_unpackhi_epi16(mh, dh));
  }
  bool ok = _mm256_movemask_ps(bad) == 0;
  if (c < H)
    ok &= scalar_kernels().chunk_meta(mn + c, mx + c, H - c, fp32, num, meta + 4 * c, m + c, d + c,
                                      s + c);
  return ok;
}

void load_meta_avx2(const uint8_t* meta, int32_t H, bool fp32, float* m, float* d) {
  if (fp32) return scalar_kernels().load_meta(meta, H, fp32, m, d);
  int32_t c = 0;
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  for (; c + 8 <= H; c += 8) {
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 4 * c));
    // {m, d} pairs -> 8 m (low halves) and 8 d (high halves), in order.
    const __m256i mm = _mm256_and_si256(e, lo16), dd = _mm256_srli_epi32(e, 16);
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(mm, dd), 0xD8);
    _mm256_storeu_ps(m + c, _mm256_cvtph_ps(_mm256_castsi256_si128(p)));
    _mm256_storeu_ps(d + c, _mm256_cvtph_ps(_mm256_extracti128_si256(p, 1)));
  }
  if (c < H) scalar_kernels().load_meta(meta + 4 * c, H - c, fp32, m + c, d + c);
}

// ---------------------------------------------------------------------------
// Encode: 32 codes per iteration, packed to bytes with two packus and one
// lane fix-up.  packus saturates to [0, 255], which is the UNIFORM clamp.
// ---------------------------------------------------------------------------
// LYNX alpha = 0 (codec_math.h nest_code) on 16 x int16 g in [15, 496].
inline __m256i nest_codes16(__m256i g) {
  const __m256i k15 = _mm256_set1_epi16(15);
  const __m256i a = _mm256_min_epi16(_mm256_srai_epi16(g, 5), k15);
  const __m256i mid = _mm256_and_si256(_mm256_srai_epi16(g, 1), k15);
  const __m256i top = _mm256_min_epi16(_mm256_sub_epi16(g, _mm256_set1_epi16(480)), k15);
  const __m256i bot =
      _mm256_max_epi16(_mm256_sub_epi16(g, _mm256_set1_epi16(16)), _mm256_setzero_si256());
  __m256i r = _mm256_blendv_epi8(mid, top, _mm256_cmpeq_epi16(a, k15));
  r = _mm256_blendv_epi8(r, bot, _mm256_cmpeq_epi16(a, _mm256_setzero_si256()));
  return _mm256_or_si256(_mm256_slli_epi16(a, 4), r);
}

template <int KIND>
// LUT kind: `base` is Codebook::lut_base8 and `next` Codebook::thresholds_inf.
inline __m256i codes8(__m256 x, const float* m, const float* s, int32_t c, __m256 bias,
                      const uint8_t* base, const float* next, __m256 ncells) {
  const __m256 u = _mm256_sub_ps(x, _mm256_loadu_ps(m + c));
  const __m256 sv = _mm256_loadu_ps(s + c);
  if constexpr (KIND == CODE_UNIFORM || KIND == CODE_NEST) {  // NEST: g, coded in codes32
    return _mm256_cvttps_epi32(_mm256_fmadd_ps(u, sv, bias));
  } else {
    const __m256 z = _mm256_mul_ps(u, sv);
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z);
    // Byte counts (L1-resident), then the one threshold that can follow.
    const __m256i i = _mm256_cvttps_epi32(_mm256_mul_ps(a, ncells));
    const __m256i b = _mm256_and_si256(
        _mm256_i32gather_epi32(reinterpret_cast<const int*>(base), i, 1), _mm256_set1_epi32(0xFF));
    const __m256i q = _mm256_sub_epi32(
        b, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_i32gather_ps(next, b, 4), _CMP_GE_OQ)));
    const __m256i sign =
        _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ)),
                         _mm256_set1_epi32(0x80));
    return _mm256_or_si256(q, sign);
  }
}

// 4 x 8 int32 codes8 results to 32 bytes (in packus lane order); the nested
// code is formed on the 16-bit g values between the two packs.
template <int KIND>
inline __m256i pack_codes(__m256i q0, __m256i q1, __m256i q2, __m256i q3) {
  __m256i lo = _mm256_packus_epi32(q0, q1), hi = _mm256_packus_epi32(q2, q3);
  if constexpr (KIND == CODE_NEST) {
    lo = nest_codes16(lo);
    hi = nest_codes16(hi);
  }
  return _mm256_packus_epi16(lo, hi);
}

// The per-codebook last step on 32 packed byte codes: INT4's clamp to 15
// (packus already clamped to [0, 255]).
template <int KIND>
inline __m256i finish_codes(__m256i b, __m256i maxc) {
  if constexpr (KIND == CODE_UNIFORM) b = _mm256_min_epu8(b, maxc);
  return b;
}

// 32 byte codes of elements c..c+31, in order.
template <int KIND>
inline __m256i codes32(const uint8_t* row, kvxfer_dtype_t dt, int32_t c, const float* m,
                       const float* s, __m256 bias, const uint8_t* base, const float* next,
                       __m256 ncells, __m256i maxc) {
  const __m256i fix = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i q0 = codes8<KIND>(load8(row, c, dt), m, s, c, bias, base, next, ncells);
  const __m256i q1 = codes8<KIND>(load8(row, c + 8, dt), m, s, c + 8, bias, base, next, ncells);
  const __m256i q2 = codes8<KIND>(load8(row, c + 16, dt), m, s, c + 16, bias, base, next, ncells);
  const __m256i q3 = codes8<KIND>(load8(row, c + 24, dt), m, s, c + 24, bias, base, next, ncells);
  return finish_codes<KIND>(_mm256_permutevar8x32_epi32(pack_codes<KIND>(q0, q1, q2, q3), fix),
                            maxc);
}

template <int KIND>
void encode_row_kind(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                     const float* s, const Codebook& cb, uint8_t* codes) {
  const __m256 bias = _mm256_set1_ps(cb.bias);
  const __m256 ncells = _mm256_set1_ps(static_cast<float>(1 << cb.lut_log2));
  const __m256i maxc = _mm256_set1_epi8(static_cast<char>(cb.max_code));
  int32_t c = 0;
  for (; c + 32 <= H; c += 32)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + c),
                        codes32<KIND>(row, dt, c, m, s, bias, cb.lut_base8.data(),
                                      cb.thresholds_inf, ncells, maxc));
  if (c < H)
    scalar_kernels().encode_row(row + c * dtype_size(dt), dt, H - c, m + c, s + c, cb, codes + c);
}

// encode_params for bf16 rows: within each 16 channels of the vector part,
// the order [0..3, 8..11 | 4..7, 12..15] of unpacklo/unpackhi, which turn
// 16 bf16 into two float vectors with one shuffle each; packus then puts the
// codes back in channel order.  Other dtypes and the tail keep channel order.
void encode_params_avx2(const float* m, const float* s, int32_t H, kvxfer_dtype_t dt,
                        const Codebook&, float* pm, float* ps) {
  const int32_t Hv = dt == KVXFER_DTYPE_BF16 ? (H & ~31) : 0;
  for (int32_t c = 0; c < Hv; c += 16)
    for (int k = 0; k < 2; ++k) {
      const float* src = k ? s : m;
      float* dst = k ? ps : pm;
      const __m256 a = _mm256_loadu_ps(src + c), b = _mm256_loadu_ps(src + c + 8);
      _mm256_storeu_ps(dst + c, _mm256_permute2f128_ps(a, b, 0x20));      // 0..3, 8..11
      _mm256_storeu_ps(dst + c + 8, _mm256_permute2f128_ps(a, b, 0x31));  // 4..7, 12..15
    }
  for (int32_t c = Hv; c < H; ++c) {
    pm[c] = m[c];
    ps[c] = s[c];
  }
}

// 32 byte codes of channels c..c+31 in channel order, from encode_params'
// arrays: bf16 by one unpacklo/unpackhi per 8 values (the order that
// encode_params arranged), other dtypes as codes32.
template <int KIND, int DT>
inline __m256i codes32p(const uint8_t* row, int32_t c, const float* pm, const float* ps,
                        __m256 bias, const uint8_t* base, const float* next, __m256 ncells,
                        __m256i maxc) {
  if constexpr (DT != KVXFER_DTYPE_BF16) {
    return codes32<KIND>(row, static_cast<kvxfer_dtype_t>(DT), c, pm, ps, bias, base, next, ncells,
                         maxc);
  } else {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c + 32));
    auto lo = [&](__m256i v) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)); };
    auto hi = [&](__m256i v) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)); };
    const __m256i q0 = codes8<KIND>(lo(v0), pm, ps, c, bias, base, next, ncells);
    const __m256i q1 = codes8<KIND>(hi(v0), pm, ps, c + 8, bias, base, next, ncells);
    const __m256i q2 = codes8<KIND>(lo(v1), pm, ps, c + 16, bias, base, next, ncells);
    const __m256i q3 = codes8<KIND>(hi(v1), pm, ps, c + 24, bias, base, next, ncells);
    return finish_codes<KIND>(_mm256_permute4x64_epi64(pack_codes<KIND>(q0, q1, q2, q3), 0xD8),
                              maxc);
  }
}

// Codes -> 4-bit fields, 32 at a time.  maddubs with (1, 16) folds each byte
// pair (even, odd) into even | odd << 4 (both < 16); one pack and one lane
// fix-up then give 16 anchor and 16 residual bytes.
template <int KIND, int DT, bool RES, bool CODES>
void encode_row_nibbles_t(const uint8_t* row, int32_t H, const float* pm, const float* ps,
                          const Codebook& cb, uint8_t* pa, uint8_t* pr, uint8_t* codes) {
  const __m256 bias = _mm256_set1_ps(cb.bias);
  const __m256 ncells = _mm256_set1_ps(static_cast<float>(1 << cb.lut_log2));
  const __m256i maxc = _mm256_set1_epi8(static_cast<char>(cb.max_code));
  const __m256i lo4 = _mm256_set1_epi8(0x0F), fold = _mm256_set1_epi16(0x1001);  // bytes 1, 16
  const uint8_t* base = cb.lut_base8.data();
  const float* next = cb.thresholds_inf;
  int32_t c = 0;
  for (; c + 32 <= H; c += 32) {
    const __m256i w = codes32p<KIND, DT>(row, c, pm, ps, bias, base, next, ncells, maxc);
    if constexpr (CODES) _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + c), w);
    if constexpr (RES) {
      const __m256i a = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), lo4), fold);
      const __m256i r = _mm256_maddubs_epi16(_mm256_and_si256(w, lo4), fold);
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, r), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pa + c / 2), _mm256_castsi256_si128(p));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pr + c / 2), _mm256_extracti128_si256(p, 1));
    } else {  // 4-bit codes: byte = c[2j] | c[2j+1] << 4
      const __m256i a = _mm256_maddubs_epi16(w, fold);
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, a), 0xD8);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pa + c / 2), _mm256_castsi256_si128(p));
    }
  }
  if (c < H)
    scalar_kernels().encode_row_nibbles(row + c * dtype_size(static_cast<kvxfer_dtype_t>(DT)),
                                        static_cast<kvxfer_dtype_t>(DT), H - c, pm + c, ps + c, cb,
                                        pa + c / 2, RES ? pr + c / 2 : nullptr,
                                        CODES ? codes + c : nullptr);
}

template <int KIND, int DT>
void encode_row_nibbles_dt(const uint8_t* row, int32_t H, const float* m, const float* s,
                           const Codebook& cb, uint8_t* pa, uint8_t* pr, uint8_t* codes) {
  if (pr != nullptr) {
    if (codes != nullptr)
      return encode_row_nibbles_t<KIND, DT, true, true>(row, H, m, s, cb, pa, pr, codes);
    return encode_row_nibbles_t<KIND, DT, true, false>(row, H, m, s, cb, pa, pr, codes);
  }
  if (codes != nullptr)
    return encode_row_nibbles_t<KIND, DT, false, true>(row, H, m, s, cb, pa, pr, codes);
  encode_row_nibbles_t<KIND, DT, false, false>(row, H, m, s, cb, pa, pr, codes);
}

template <int KIND>
void encode_row_nibbles_kind(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                             const float* s, const Codebook& cb, uint8_t* pa, uint8_t* pr,
                             uint8_t* codes) {
  switch (dt) {
    case KVXFER_DTYPE_BF16:
      return encode_row_nibbles_dt<KIND, KVXFER_DTYPE_BF16>(row, H, m, s, cb, pa, pr, codes);
    case KVXFER_DTYPE_FP16:
      return encode_row_nibbles_dt<KIND, KVXFER_DTYPE_FP16>(row, H, m, s, cb, pa, pr, codes);
    default: return encode_row_nibbles_dt<KIND, KVXFER_DTYPE_FP32>(row, H, m, s, cb, pa, pr, codes);
  }
}

void encode_row_nibbles_avx2(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                             const float* s, const Codebook& cb, uint8_t* pa, uint8_t* pr,
                             uint8_t* codes) {
  switch (cb.kind) {
    case CODE_UNIFORM:
      return encode_row_nibbles_kind<CODE_UNIFORM>(row, dt, H, m, s, cb, pa, pr, codes);
    case CODE_NEST: return encode_row_nibbles_kind<CODE_NEST>(row, dt, H, m, s, cb, pa, pr, codes);
    default: return encode_row_nibbles_kind<CODE_LUT>(row, dt, H, m, s, cb, pa, pr, codes);
  }
}

void encode_row_avx2(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                     const float* s, const Codebook& cb, uint8_t* codes) {
  switch (cb.kind) {
    case CODE_UNIFORM: return encode_row_kind<CODE_UNIFORM>(row, dt, H, m, s, cb, codes);
    case CODE_NEST: return encode_row_kind<CODE_NEST>(row, dt, H, m, s, cb, codes);
    default: return encode_row_kind<CODE_LUT>(row, dt, H, m, s, cb, codes);
  }
}

// ---------------------------------------------------------------------------
// Calibration errors: lanes 0..3 and 4..7 of 8 channels are two vectors of
// doubles; each lane adds in channel order, as the scalar loop.
// ---------------------------------------------------------------------------
void row_sq_errors_avx2(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const uint8_t* codes,
                        const float* m, const float* d, const uint8_t* ok, const float* full,
                        const float* anchor, unsigned R, double* acc_full, double* acc_anchor) {
  __m256d f0 = _mm256_loadu_pd(acc_full), f1 = _mm256_loadu_pd(acc_full + 4);
  __m256d a0 = _mm256_loadu_pd(acc_anchor), a1 = _mm256_loadu_pd(acc_anchor + 4);
  const __m256 big = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 nbig = _mm256_sub_ps(_mm256_setzero_ps(), big);
  const __m128i sh = _mm_cvtsi32_si128(static_cast<int>(R));
  int32_t c = 0;
  for (; c + 8 <= H; c += 8) {
    const __m256i q =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c)));
    const __m256i keep = _mm256_cmpgt_epi32(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ok + c))),
        _mm256_setzero_si256());
    const __m256 x = load8(row, c, dt);
    const __m256 mv = _mm256_loadu_ps(m + c), dv = _mm256_loadu_ps(d + c);
    auto err = [&](__m256 r, __m256d* lo, __m256d* hi) {
      const __m256 xh = _mm256_min_ps(_mm256_max_ps(_mm256_fmadd_ps(dv, r, mv), nbig), big);
      // Not-ok channels (their chunk holds NaN or Inf): both sides 0, so
      // e * e = +0 leaves the lane as it is, as the scalar loop's skip.
      const __m256 k = _mm256_castsi256_ps(keep);
      const __m256 xs = _mm256_and_ps(xh, k), x0 = _mm256_and_ps(x, k);
      const __m256d el = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(xs)),
                                       _mm256_cvtps_pd(_mm256_castps256_ps128(x0)));
      const __m256d eh = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(xs, 1)),
                                       _mm256_cvtps_pd(_mm256_extractf128_ps(x0, 1)));
      *lo = _mm256_add_pd(*lo, _mm256_mul_pd(el, el));
      *hi = _mm256_add_pd(*hi, _mm256_mul_pd(eh, eh));
    };
    err(_mm256_i32gather_ps(full, q, 4), &f0, &f1);
    err(_mm256_i32gather_ps(anchor, _mm256_srl_epi32(q, sh), 4), &a0, &a1);
  }
  _mm256_storeu_pd(acc_full, f0);
  _mm256_storeu_pd(acc_full + 4, f1);
  _mm256_storeu_pd(acc_anchor, a0);
  _mm256_storeu_pd(acc_anchor + 4, a1);
  if (c < H) {  // the tail keeps lane c % 8 (c is a multiple of 8 here)
    scalar_kernels().row_sq_errors(row + c * dtype_size(dt), dt, H - c, codes + c, m + c, d + c,
                                   ok + c, full, anchor, R, acc_full, acc_anchor);
  }
}

// ---------------------------------------------------------------------------
// Decode: 16 values per iteration.  The z value of an index comes from the
// linear formula (full codes of the uniform and nested codebooks), two 8-entry
// permutes (tables of 16, the 4-bit anchors), or a gather.
// ---------------------------------------------------------------------------
enum class Lookup { NEST, UNIFORM, PERM16, GATHER };

template <Lookup L>
inline __m256 value8(const uint8_t* idx, int32_t c, const Values& v, __m256 t0, __m256 t1) {
  const __m256i i =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(idx + c)));
  if constexpr (L == Lookup::UNIFORM) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(v.step), _mm256_set1_ps(-1.0f));
  } else if constexpr (L == Lookup::PERM16) {
    const __m256 lo = _mm256_permutevar8x32_ps(t0, i), hi = _mm256_permutevar8x32_ps(t1, i);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
  } else {
    return _mm256_i32gather_ps(v.table, i, 4);
  }
}

// The z values of 16 nested codes (codec_math.h nest_level2), in 16-bit lanes:
// 4c - 510 inside, corrected by max(0, 2c - 479) above code 239 and
// max(0, 31 - 2c) below code 16, and by one at codes 0 and 255; then
// RN(n * step) in two halves of 8.
inline void nest_values16(const uint8_t* idx, int32_t c, float step, __m256* z0, __m256* z1) {
  const __m256i i =
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(idx + c)));
  const __m256i c2 = _mm256_add_epi16(i, i);
  const __m256i top =
      _mm256_max_epi16(_mm256_sub_epi16(c2, _mm256_set1_epi16(479)), _mm256_setzero_si256());
  const __m256i bot =
      _mm256_max_epi16(_mm256_sub_epi16(_mm256_set1_epi16(31), c2), _mm256_setzero_si256());
  __m256i n = _mm256_sub_epi16(_mm256_add_epi16(c2, c2), _mm256_set1_epi16(510));
  n = _mm256_add_epi16(_mm256_sub_epi16(n, top), bot);
  n = _mm256_sub_epi16(n, _mm256_cmpeq_epi16(i, _mm256_set1_epi16(255)));
  n = _mm256_add_epi16(n, _mm256_cmpeq_epi16(i, _mm256_setzero_si256()));
  const __m256 sv = _mm256_set1_ps(step);
  *z0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(n))), sv);
  *z1 =
      _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(n, 1))), sv);
}

// Round-to-nearest-even float -> bfloat16 (the decoder never produces NaN),
// as 8 x u32 holding the bf16 in their low half.
inline __m256i bf16_round(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb),
                           16);
}

template <Lookup L, bool CLAMP>
void decode_row_kind(const uint8_t* idx, int32_t H, const float* m, const float* d, const Values& v,
                     kvxfer_dtype_t dt, uint8_t* row) {
  __m256 t0 = _mm256_setzero_ps(), t1 = t0;
  if constexpr (L == Lookup::PERM16) {
    t0 = _mm256_loadu_ps(v.table);
    t1 = _mm256_loadu_ps(v.table + 8);
  }
  // CLAMP: to +-FLT_MAX, or for an FP16 row to +-65504 (f32_to_f16_sat).
  const bool f16 = dt == KVXFER_DTYPE_FP16;
  const __m256 big = _mm256_set1_ps(f16 ? kF16Max : std::numeric_limits<float>::max());
  auto value = [&](int32_t c, __m256 z) {
    __m256 x = _mm256_fmadd_ps(_mm256_loadu_ps(d + c), z, _mm256_loadu_ps(m + c));
    if constexpr (CLAMP)
      x = _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), big)), big);
    return x;
  };
  int32_t c = 0;
  for (; c + 16 <= H; c += 16) {
    __m256 z0, z1;
    if constexpr (L == Lookup::NEST) {
      nest_values16(idx, c, v.step, &z0, &z1);
    } else {
      z0 = value8<L>(idx, c, v, t0, t1);
      z1 = value8<L>(idx, c + 8, v, t0, t1);
    }
    const __m256 x0 = value(c, z0), x1 = value(c + 8, z1);
    switch (dt) {
      case KVXFER_DTYPE_BF16: {
        const __m256i p =
            _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_round(x0), bf16_round(x1)), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 2 * c), p);
        break;
      }
      case KVXFER_DTYPE_FP16:
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 2 * c),
                         _mm256_cvtps_ph(x0, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 2 * c + 16),
                         _mm256_cvtps_ph(x1, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        break;
      default:
        _mm256_storeu_ps(reinterpret_cast<float*>(row) + c, x0);
        _mm256_storeu_ps(reinterpret_cast<float*>(row) + c + 8, x1);
    }
  }
  if (c < H)
    scalar_kernels().decode_row(idx + c, H - c, m + c, d + c, v, dt, row + c * dtype_size(dt));
}

template <bool CLAMP>
void decode_row_clamp(const uint8_t* idx, int32_t H, const float* m, const float* d,
                      const Values& v, kvxfer_dtype_t dt, uint8_t* row) {
  if (v.linear_kind == CODE_UNIFORM)
    return decode_row_kind<Lookup::UNIFORM, CLAMP>(idx, H, m, d, v, dt, row);
  if (v.linear_kind == CODE_NEST)
    return decode_row_kind<Lookup::NEST, CLAMP>(idx, H, m, d, v, dt, row);
  if (v.entries == 16) return decode_row_kind<Lookup::PERM16, CLAMP>(idx, H, m, d, v, dt, row);
  return decode_row_kind<Lookup::GATHER, CLAMP>(idx, H, m, d, v, dt, row);
}

void decode_row_avx2(const uint8_t* idx, int32_t H, const float* m, const float* d, const Values& v,
                     kvxfer_dtype_t dt, uint8_t* row) {
  if (v.clamp) return decode_row_clamp<true>(idx, H, m, d, v, dt, row);
  decode_row_clamp<false>(idx, H, m, d, v, dt, row);
}

}  // namespace

bool copy_row_bf16_scanning_avx2(uint8_t* dst, const uint8_t* src, int32_t H) {
  const __m256i mask = _mm256_set1_epi16(0x7F80);
  __m256i any = _mm256_setzero_si256();
  const size_t n = static_cast<size_t>(H) * 2;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    any = _mm256_or_si256(any, _mm256_cmpeq_epi16(_mm256_and_si256(a, mask), mask));
    any = _mm256_or_si256(any, _mm256_cmpeq_epi16(_mm256_and_si256(b, mask), mask));
  }
  bool bad = !_mm256_testz_si256(any, any);
  for (; i < n; i += 2) {
    uint16_t u;
    std::memcpy(&u, src + i, 2);
    std::memcpy(dst + i, &u, 2);
    bad = bad || (u & 0x7F80) == 0x7F80;
  }
  return bad;
}

const RowKernels& avx2_kernels() {
  static const RowKernels k{chunk_minmax_avx2,
                            chunk_meta_avx2,
                            load_meta_avx2,
                            encode_row_avx2,
                            encode_params_avx2,
                            encode_row_nibbles_avx2,
                            row_sq_errors_avx2,
                            decode_row_avx2,
                            nullptr,
                            nullptr,
                            nullptr};
  return k;
}

}  // namespace kvxfer::codec::fast
