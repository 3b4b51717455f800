// AVX-512 row kernels (compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mavx2 -mf16c -mfma, selected at run time: cpu_has_avx512).
// Specialised here: the min/max scan of 16-bit rows, the binary16 metadata,
// the encode of whole rows into 4-bit fields (the nested and uniform codes;
// the alpha-law codes' threshold lookup gathers, and takes the AVX2 kernel)
// and the decode straight from them (docs/FORMAT.md 4.2), 32 elements per
// iteration; every other kernel is the AVX2 one.  Per element they perform
// the reference's operations in the same order (codec_math.h): u = x - m,
// then one fma; x = fma(d, z, m), then the rounding to the output dtype.  The intrinsics are single
// IEEE operations; contraction is off project-wide, so nothing else is fused.
//
// Element orders.  The encoder splits 32 bf16 values into two float vectors
// with one unpack each (channels [0..3, 8..11, 16..19, 24..27] and the
// others, per 32), and one packus puts the codes back in channel order; its
// m and s arrays (encode_params) are in that order.  The decoder reads 16
// bytes of 4-bit fields as 16 dwords: the even channels come from the low
// nibbles and the odd ones from the high nibbles, so its m and d arrays
// (decode_params) hold, per 32 channels, the 16 even ones and then the 16
// odd ones; one blend or permute interleaves the two results on the store.
// The nested codes' full decode instead places each channel's byte where it
// likes (pshufb) and works in channel order, m and d too: its bfloat16
// results need no permute.
// Tails (H not a multiple of 32) keep channel order and take the scalar code.
#include <immintrin.h>

#include <limits>

#include "codec/fast.h"

namespace kvxfer::codec::fast {

namespace {

// vpternlog immediates: a ? b : c (bitwise select), and a ^ (b & c).
constexpr int kSelect = 0xCA;
constexpr int kXorAnd = 0x78;

// ---------------------------------------------------------------------------
// Min/max of 16-bit rows over the order-preserving integer keys (as
// fast_avx2.cc: key = u ^ ((u >> 15) & 0x7FFF); the NaN/Inf check falls out
// of the extreme keys), 32 channels a vector, a block of up to 4 vectors of
// minima and maxima in registers while the chunk's rows stream past.
// ---------------------------------------------------------------------------
inline __m512i key16(__m512i u) {
  return _mm512_ternarylogic_epi32(u, _mm512_srai_epi16(u, 15), _mm512_set1_epi16(0x7FFF), kXorAnd);
}

// NB vectors (32 * NB channels from c0) of every row; false if a key lies
// beyond the finite ones.  The keys go back to floats (key16 is an
// involution on the bits) in mn, mx.
template <int NB>
bool minmax_block(const uint8_t* const* rows, int n, bool bf16, int32_t c0, float* mn, float* mx) {
  __m512i kmn[NB], kmx[NB];
  for (int j = 0; j < NB; ++j)
    kmn[j] = kmx[j] = key16(_mm512_loadu_si512(rows[0] + 2 * (c0 + 32 * j)));
  for (int r = 1; r < n; ++r) {
    const uint8_t* row = rows[r] + 2 * c0;
    for (int j = 0; j < NB; ++j) {
      const __m512i k = key16(_mm512_loadu_si512(row + 64 * j));
      kmn[j] = _mm512_min_epi16(kmn[j], k);
      kmx[j] = _mm512_max_epi16(kmx[j], k);
    }
  }
  const int16_t inf_key = bf16 ? 0x7F80 : 0x7C00;  // key of +Inf; -Inf's is -1 - inf_key
  const __m512i hi = _mm512_set1_epi16(static_cast<int16_t>(inf_key - 1));
  const __m512i lo = _mm512_set1_epi16(static_cast<int16_t>(-inf_key));
  __mmask32 bad = 0;
  for (int j = 0; j < NB; ++j) {
    bad |= _mm512_cmpgt_epi16_mask(kmx[j], hi) | _mm512_cmpgt_epi16_mask(lo, kmn[j]);
    for (int half = 0; half < 2; ++half) {
      const __m512i u = key16(half ? kmx[j] : kmn[j]);
      float* out = (half ? mx : mn) + c0 + 32 * j;
      const __m256i u0 = _mm512_castsi512_si256(u), u1 = _mm512_extracti64x4_epi64(u, 1);
      if (bf16) {
        _mm512_storeu_si512(out, _mm512_slli_epi32(_mm512_cvtepu16_epi32(u0), 16));
        _mm512_storeu_si512(out + 16, _mm512_slli_epi32(_mm512_cvtepu16_epi32(u1), 16));
      } else {
        _mm512_storeu_ps(out, _mm512_cvtph_ps(u0));
        _mm512_storeu_ps(out + 16, _mm512_cvtph_ps(u1));
      }
    }
  }
  return bad == 0;
}

bool chunk_minmax_avx512(const uint8_t* const* rows, int n, kvxfer_dtype_t dt, int32_t H, float* mn,
                         float* mx) {
  if (dt == KVXFER_DTYPE_FP32) return avx2_kernels().chunk_minmax(rows, n, dt, H, mn, mx);
  const bool bf16 = dt == KVXFER_DTYPE_BF16;
  const int32_t Hv = H & ~31;
  bool ok = true;
  int32_t c = 0;
  for (; c + 128 <= Hv; c += 128) ok &= minmax_block<4>(rows, n, bf16, c, mn, mx);
  switch ((Hv - c) / 32) {
    case 3: ok &= minmax_block<3>(rows, n, bf16, c, mn, mx); break;
    case 2: ok &= minmax_block<2>(rows, n, bf16, c, mn, mx); break;
    case 1: ok &= minmax_block<1>(rows, n, bf16, c, mn, mx); break;
    default: break;
  }
  return minmax_channels_scalar(rows, n, dt, Hv, H, mn, mx) && ok;
}

// ---------------------------------------------------------------------------
// Metadata (codec_math.h chunk_affine, 16 channels at a time), as
// fast_avx2.cc's chunk_meta_avx2: the F16C-style conversion rounds to nearest
// even, overflows to infinity and keeps subnormals exactly as f32_to_f16; d
// rounded up is that conversion plus one ulp where it fell below d.  Binary32
// metadata (rare) takes the scalar path.
// ---------------------------------------------------------------------------
bool chunk_meta_avx512(float* mn, float* mx, int32_t H, bool fp32, float num, uint8_t* meta,
                       float* m, float* d, float* s) {
  if (fp32) return scalar_kernels().chunk_meta(mn, mx, H, fp32, num, meta, m, d, s);
  const __m512 zero = _mm512_setzero_ps(), half = _mm512_set1_ps(0.5f);
  const __m512 inf = _mm512_set1_ps(__builtin_inff()), nv = _mm512_set1_ps(num);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __mmask16 bad = 0;
  int32_t c = 0;
  for (; c + 16 <= H; c += 16) {
    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(mn + c), zero);  // canonical +0
    const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(mx + c), zero);
    const __m256i mh =
        _mm512_cvtps_ph(_mm512_add_ps(_mm512_mul_ps(half, lo), _mm512_mul_ps(half, hi)), kRne);
    const __m512 mv = _mm512_cvtph_ps(mh);
    const __m512 dv0 =
        _mm512_add_ps(_mm512_max_ps(_mm512_sub_ps(hi, mv), _mm512_sub_ps(mv, lo)), zero);
    __m256i dh = _mm512_cvtps_ph(dv0, kRne);
    // Below d after rounding: the next binary16 up (d >= 0: one more in the bits).
    const __mmask16 below = _mm512_cmp_ps_mask(_mm512_cvtph_ps(dh), dv0, _CMP_LT_OQ);
    dh = _mm256_mask_add_epi16(dh, below, dh, _mm256_set1_epi16(1));
    const __m512 dv = _mm512_cvtph_ps(dh);
    bad |= _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, mv), inf, _CMP_EQ_OQ) |
           _mm512_cmp_ps_mask(dv, inf, _CMP_EQ_OQ);
    _mm512_storeu_ps(m + c, mv);
    _mm512_storeu_ps(d + c, dv);
    _mm512_storeu_ps(s + c, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dv, zero, _CMP_GT_OQ), nv, dv));
    // {m, d} binary16 pairs, little-endian.
    _mm512_storeu_si512(meta + 4 * c,
                        _mm512_or_si512(_mm512_cvtepu16_epi32(mh),
                                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(dh), 16)));
  }
  bool ok = bad == 0;
  if (c < H)
    ok &= scalar_kernels().chunk_meta(mn + c, mx + c, H - c, fp32, num, meta + 4 * c, m + c, d + c,
                                      s + c);
  return ok;
}

// ---------------------------------------------------------------------------
// Encode: 32 codes per iteration, as 32 words in channel order.
// ---------------------------------------------------------------------------

// encode_params for bf16 rows: per 32 channels of the vector part, the order
// of the two unpacks (channels 8L..8L+3 of each 128-bit lane L, then 8L+4..
// 8L+7).  Other dtypes and the tail keep channel order.  The alpha-law codes
// take the AVX2 kernels (encode_row_nibbles_ahead_avx512), and their order.
void encode_params_avx512(const float* m, const float* s, int32_t H, kvxfer_dtype_t dt,
                          const Codebook& cb, float* pm, float* ps) {
  if (cb.kind == CODE_LUT) return avx2_kernels().encode_params(m, s, H, dt, cb, pm, ps);
  const int32_t Hv = dt == KVXFER_DTYPE_BF16 ? (H & ~31) : 0;
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i i1 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int32_t c = 0; c < Hv; c += 32)
    for (int k = 0; k < 2; ++k) {
      const float* src = k ? s : m;
      float* dst = k ? ps : pm;
      const __m512 a = _mm512_loadu_ps(src + c), b = _mm512_loadu_ps(src + c + 16);
      _mm512_storeu_ps(dst + c, _mm512_permutex2var_ps(a, i0, b));
      _mm512_storeu_ps(dst + c + 16, _mm512_permutex2var_ps(a, i1, b));
    }
  for (int32_t c = Hv; c < H; ++c) {
    pm[c] = m[c];
    ps[c] = s[c];
  }
}

// What the code of one element needs of the codebook, in registers.
struct EncodeConsts {
  __m512 bias;
  __m512i maxc;  // UNIFORM: the largest code, in 16-bit lanes
};

// 16 int32 values from 16 floats x (u = x - m, with m and s at pm + c and
// ps + c), trunc(fma(u, s, bias)): NEST the g of nest_code, UNIFORM the
// unclamped q.
template <int KIND>
inline __m512i codes16(__m512 x, const float* pm, const float* ps, int32_t c,
                       const EncodeConsts& k) {
  static_assert(KIND == CODE_UNIFORM || KIND == CODE_NEST, "linear codes only");
  const __m512 u = _mm512_sub_ps(x, _mm512_loadu_ps(pm + c));
  return _mm512_cvttps_epi32(_mm512_fmadd_ps(u, _mm512_loadu_ps(ps + c), k.bias));
}

// The codes16 values of channels c..c+31 as 32 words in channel order,
// saturated to [0, 65535] by packus (which is the lower clamp of UNIFORM).
template <int KIND, int DT>
inline __m512i words32(const uint8_t* row, int32_t c, const float* pm, const float* ps,
                       const EncodeConsts& k) {
  if constexpr (DT == KVXFER_DTYPE_BF16) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i v = _mm512_loadu_si512(row + 2 * c);
    const __m512i q0 =
        codes16<KIND>(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v)), pm, ps, c, k);
    const __m512i q1 =
        codes16<KIND>(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v)), pm, ps, c + 16, k);
    return _mm512_packus_epi32(q0, q1);
  } else {
    __m512 x0, x1;
    if constexpr (DT == KVXFER_DTYPE_FP16) {
      x0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c)));
      x1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c + 32)));
    } else {
      x0 = _mm512_loadu_ps(reinterpret_cast<const float*>(row) + c);
      x1 = _mm512_loadu_ps(reinterpret_cast<const float*>(row) + c + 16);
    }
    const __m512i q0 = codes16<KIND>(x0, pm, ps, c, k), q1 = codes16<KIND>(x1, pm, ps, c + 16, k);
    // packus interleaves the two per 128-bit lane: qwords 0, 2, 4, 6 are q0's.
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                    _mm512_packus_epi32(q0, q1));
  }
}

// 4-bit fields of 32 channels from 16-bit lanes in channel order: `f` holds
// each field in bits 0..3 (bits 4.. may hold anything; CLEAN: they are 0),
// giving byte j = f[2j] | f[2j + 1] << 4.
template <bool CLEAN>
inline __m128i nibbles32(__m512i f) {
  const __m512i hi = _mm512_srli_epi32(f, 12);  // field 2j+1 at bits 4..7 of dword j
  if constexpr (CLEAN) return _mm512_cvtepi32_epi8(_mm512_or_si512(f, hi));
  return _mm512_cvtepi32_epi8(_mm512_ternarylogic_epi32(_mm512_set1_epi32(0x0F), f, hi, kSelect));
}

// Counts 32 codes (count8, eight per load).
inline void count32(const uint8_t* codes, uint32_t* bins) {
  for (int i = 0; i < 32; i += 8) {
    uint64_t v;
    std::memcpy(&v, codes + i, 8);
    count8(v, bins);
  }
}

// COUNT: also count `count`'s H codes into `bins` (count32), between the
// vectors; a template parameter, so that the rows that count nothing run
// the loop they ran before it existed.
template <int KIND, int DT, bool RES, bool CODES, bool COUNT>
void encode_row_nibbles_t(const uint8_t* row, int32_t H, const float* pm, const float* ps,
                          const Codebook& cb, uint8_t* pa, uint8_t* pr, uint8_t* codes,
                          const uint8_t* next, const uint8_t* count, uint32_t* bins) {
  const EncodeConsts k{_mm512_set1_ps(cb.bias),
                       _mm512_set1_epi16(static_cast<int16_t>(cb.max_code))};
  // NEST: g clamped to [16, 495] makes the anchor g >> 5 and the residual
  // g >> sh & 15, sh = 0 in the two end cells (anchors 0 and 15), else 1:
  // the top cell's min(g - 480, 15) and the bottom's max(g - 16, 0) are then
  // g & 15 (codec_math.h nest_code).
  const __m512i g_lo = _mm512_set1_epi16(16), g_hi = _mm512_set1_epi16(495);
  const __m512i sh_of_a =
      _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  // unused
                       0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0);
  const int32_t Hv = H & ~31;
  constexpr int32_t kElem = DT == KVXFER_DTYPE_FP32 ? 4 : 2;
  for (int32_t c = 0; c < Hv; c += 32) {
    // The lines of the next chunk's row that this vector spans, into L2: a
    // chunk ahead does not fit L1 (fast.cc prefetch_bytes).  Into L1 (T0),
    // Lynx encoded a KV in DRAM at 6.1 GB/s instead of 7.2, INT8 at 5.2
    // instead of 6.2-6.8 (codec_perf --dataset synth --tokens 32768 --path
    // avx512 -t 1, AMD EPYC Zen 4).
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + kElem * c), _MM_HINT_T1);
      if constexpr (kElem == 4)
        _mm_prefetch(reinterpret_cast<const char*>(next + kElem * c + 64), _MM_HINT_T1);
    }
    if constexpr (COUNT) count32(count + c, bins);
    const __m512i w = words32<KIND, DT>(row, c, pm, ps, k);
    // The anchor (clean) and the residual (bits 0..3) of each 16-bit lane.
    __m512i a, r = _mm512_setzero_si512();
    if constexpr (KIND == CODE_NEST) {
      const __m512i g = _mm512_min_epu16(_mm512_max_epu16(w, g_lo), g_hi);
      a = _mm512_srli_epi16(g, 5);
      r = _mm512_srlv_epi16(g, _mm512_permutexvar_epi16(a, sh_of_a));
      if constexpr (CODES)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + c),
                            _mm512_cvtepi16_epi8(_mm512_ternarylogic_epi32(
                                _mm512_set1_epi16(0x0F), r, _mm512_slli_epi16(a, 4), kSelect)));
    } else {
      const __m512i q = _mm512_min_epu16(w, k.maxc);  // UNIFORM's upper clamp
      if constexpr (CODES)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + c), _mm512_cvtepi16_epi8(q));
      if constexpr (RES) {
        a = _mm512_srli_epi16(q, 4);
        r = q;
      } else {
        a = q;  // 4-bit codes
      }
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pa + c / 2), nibbles32<true>(a));
    if constexpr (RES)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pr + c / 2), nibbles32<false>(r));
  }
  if constexpr (COUNT)
    for (int32_t c = Hv; c < H; ++c) ++bins[count[c]];
  if (Hv < H)
    scalar_kernels().encode_row_nibbles(row + Hv * dtype_size(static_cast<kvxfer_dtype_t>(DT)),
                                        static_cast<kvxfer_dtype_t>(DT), H - Hv, pm + Hv, ps + Hv,
                                        cb, pa + Hv / 2, RES ? pr + Hv / 2 : nullptr,
                                        CODES ? codes + Hv : nullptr);
}

template <int KIND, int DT, bool COUNT>
void encode_row_nibbles_c(const uint8_t* row, int32_t H, const float* m, const float* s,
                          const Codebook& cb, uint8_t* pa, uint8_t* pr, uint8_t* codes,
                          const uint8_t* next, const uint8_t* count, uint32_t* bins) {
  if (pr != nullptr) {
    if (codes != nullptr)
      return encode_row_nibbles_t<KIND, DT, true, true, COUNT>(row, H, m, s, cb, pa, pr, codes,
                                                               next, count, bins);
    return encode_row_nibbles_t<KIND, DT, true, false, COUNT>(row, H, m, s, cb, pa, pr, codes, next,
                                                              count, bins);
  }
  if (codes != nullptr)
    return encode_row_nibbles_t<KIND, DT, false, true, COUNT>(row, H, m, s, cb, pa, pr, codes, next,
                                                              count, bins);
  encode_row_nibbles_t<KIND, DT, false, false, COUNT>(row, H, m, s, cb, pa, pr, codes, next, count,
                                                      bins);
}

template <int KIND, int DT>
void encode_row_nibbles_dt(const uint8_t* row, int32_t H, const float* m, const float* s,
                           const Codebook& cb, uint8_t* pa, uint8_t* pr, uint8_t* codes,
                           const uint8_t* next, const uint8_t* count, uint32_t* bins) {
  if (count != nullptr)
    return encode_row_nibbles_c<KIND, DT, true>(row, H, m, s, cb, pa, pr, codes, next, count, bins);
  encode_row_nibbles_c<KIND, DT, false>(row, H, m, s, cb, pa, pr, codes, next, count, bins);
}

template <int KIND>
void encode_row_nibbles_kind(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                             const float* s, const Codebook& cb, uint8_t* pa, uint8_t* pr,
                             uint8_t* codes, const uint8_t* next, const uint8_t* count,
                             uint32_t* bins) {
  switch (dt) {
    case KVXFER_DTYPE_BF16:
      return encode_row_nibbles_dt<KIND, KVXFER_DTYPE_BF16>(row, H, m, s, cb, pa, pr, codes, next,
                                                            count, bins);
    case KVXFER_DTYPE_FP16:
      return encode_row_nibbles_dt<KIND, KVXFER_DTYPE_FP16>(row, H, m, s, cb, pa, pr, codes, next,
                                                            count, bins);
    default:
      return encode_row_nibbles_dt<KIND, KVXFER_DTYPE_FP32>(row, H, m, s, cb, pa, pr, codes, next,
                                                            count, bins);
  }
}

void encode_row_nibbles_ahead_avx512(const uint8_t* row, kvxfer_dtype_t dt, int32_t H,
                                     const float* m, const float* s, const Codebook& cb,
                                     uint8_t* pa, uint8_t* pr, uint8_t* codes, const uint8_t* next,
                                     const uint8_t* count, uint32_t* bins) {
  switch (cb.kind) {
    case CODE_UNIFORM:
      return encode_row_nibbles_kind<CODE_UNIFORM>(row, dt, H, m, s, cb, pa, pr, codes, next, count,
                                                   bins);
    case CODE_NEST:
      return encode_row_nibbles_kind<CODE_NEST>(row, dt, H, m, s, cb, pa, pr, codes, next, count,
                                                bins);
    default: {
      // The alpha-law codes' threshold lookup is two gathers per vector,
      // which AVX2's 8 lanes did faster than 16 here (about 10%, AMD EPYC):
      // the AVX2 kernel, on encode_params_avx512's arrays in its order.
      if (next != nullptr)
        for (size_t o = 0; o < static_cast<size_t>(H) * dtype_size(dt); o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + o), _MM_HINT_T1);
      if (count != nullptr) {
        int32_t c = 0;
        for (; c + 32 <= H; c += 32) count32(count + c, bins);
        for (; c < H; ++c) ++bins[count[c]];
      }
      return avx2_kernels().encode_row_nibbles(row, dt, H, m, s, cb, pa, pr, codes);
    }
  }
}

void encode_row_nibbles_avx512(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                               const float* s, const Codebook& cb, uint8_t* pa, uint8_t* pr,
                               uint8_t* codes) {
  encode_row_nibbles_ahead_avx512(row, dt, H, m, s, cb, pa, pr, codes, nullptr, nullptr, nullptr);
}

// ---------------------------------------------------------------------------
// Decode straight from the 4-bit fields, 32 values per iteration: the even
// channels' z values from the low nibbles, the odd channels' from the high
// ones.  The z value of an index comes from a 16-entry permute (the anchors,
// INT4's full codes), the linear formula (full codes of the uniform and
// nested codebooks) or a gather (alpha-law full codes).
// ---------------------------------------------------------------------------

// The full codes of the nested codebook are decoded in channel order (the
// NEST lookup of zvalues32 places each code where it likes), the rest with
// the even channels apart from the odd ones.
inline bool channel_order(const Values& v, bool full) { return full && v.linear_kind == CODE_NEST; }

// decode_params: per 32 channels of the vector part, m (d) of the 16 even
// channels, then of the 16 odd ones, or (channel_order) of the 32 channels in
// order; the tail in channel order.
void decode_params_avx512(const uint8_t* meta, int32_t H, bool fp32, const Values& v, bool full,
                          float* pm, float* pd) {
  const int32_t Hv = H & ~31;
  const bool in_order = channel_order(v, full);
  if (fp32) {
    for (int32_t c = 0; c < Hv; c += 32)
      for (int32_t i = 0; i < 32; ++i) {
        const Affine a = get_affine(meta, c + (in_order ? i : 2 * (i & 15) + (i >> 4)), true);
        pm[c + i] = a.m;
        pd[c + i] = a.d;
      }
  } else {
    // {m, d} pairs: in the 64 words of two vectors, m of channel k is word
    // 2k and d word 2k + 1.
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 32; ++i)
      idx[i] = static_cast<int16_t>(in_order ? 2 * i : 4 * (i & 15) + 2 * (i >> 4));
    const __m512i im = _mm512_load_si512(idx);
    const __m512i id = _mm512_add_epi16(im, _mm512_set1_epi16(1));
    for (int32_t c = 0; c < Hv; c += 32) {
      const __m512i e0 = _mm512_loadu_si512(meta + 4 * c),
                    e1 = _mm512_loadu_si512(meta + 4 * c + 64);
      const __m512i mw = _mm512_permutex2var_epi16(e0, im, e1);
      const __m512i dw = _mm512_permutex2var_epi16(e0, id, e1);
      _mm512_storeu_ps(pm + c, _mm512_cvtph_ps(_mm512_castsi512_si256(mw)));
      _mm512_storeu_ps(pm + c + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(mw, 1)));
      _mm512_storeu_ps(pd + c, _mm512_cvtph_ps(_mm512_castsi512_si256(dw)));
      _mm512_storeu_ps(pd + c + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dw, 1)));
    }
  }
  for (int32_t c = Hv; c < H; ++c) {
    const Affine a = get_affine(meta, c, fp32);
    pm[c] = a.m;
    pd[c] = a.d;
  }
}

enum class Lookup { PERM16, NEST, UNIFORM, GATHER };

// The nested codes' levels (codec_math.h nest_level2) are 4c - 510 but for
// codes c < 16 and c >= 240: their corrections, at index 16 + c (c < 16) and
// c - 240 (c >= 240), 0 at index 32, the index of every other code (zvalues32;
// constant initialisation: no code of this file runs before cpu_has_avx512
// is asked).
struct NestCorrections {
  alignas(64) int16_t t[64] = {};
  constexpr NestCorrections() {
    for (int c = 0; c < 16; ++c)  // nest_level2: 2c - 479, -480 at code 0
      t[16 + c] = static_cast<int16_t>((c == 0 ? -480 : 2 * c - 479) - (4 * c - 510));
    for (int c = 240; c < 256; ++c)  // 2c - 31, 480 at code 255
      t[c - 240] = static_cast<int16_t>((c == 255 ? 480 : 2 * c - 31) - (4 * c - 510));
  }
};
constexpr NestCorrections kNestCorrections;

// Word k of 128-bit lane L (zvalues32's NEST order) holds the byte of channel
// ch = 4L + k (k < 4), 16 + 4L + k - 4 (k >= 4): byte ch / 2, then 0 (0x80).
struct NestBytes {
  alignas(64) int8_t b[64] = {};
  constexpr NestBytes() {
    for (int L = 0; L < 4; ++L)
      for (int k = 0; k < 8; ++k) {
        const int ch = k < 4 ? 4 * L + k : 16 + 4 * L + k - 4;
        b[16 * L + 2 * k] = static_cast<int8_t>(ch / 2);
        b[16 * L + 2 * k + 1] = static_cast<int8_t>(-128);
      }
  }
};
constexpr NestBytes kNestBytes;

// What zvalues32 needs, in registers for a row.
struct DecodeConsts {
  __m512 t16;                // PERM16: the table
  __m512 step;               // NEST, UNIFORM: Codebook::recon_step
  __m512i corr_lo, corr_hi;  // NEST: kNestCorrections
  __m512i nest_bytes;        // NEST: the pshufb of the codes' bytes
  const float* table;        // GATHER
  explicit DecodeConsts(const Values& v)
      : t16(v.entries == 16 ? _mm512_loadu_ps(v.table) : _mm512_setzero_ps()),
        step(_mm512_set1_ps(v.step)),
        corr_lo(_mm512_load_si512(kNestCorrections.t)),
        corr_hi(_mm512_load_si512(kNestCorrections.t + 32)),
        nest_bytes(_mm512_load_si512(kNestBytes.b)),
        table(v.table) {}
};

// The z values of channels c..c+31: *ze the even ones, *zo the odd ones.
template <Lookup L>
inline void zvalues32(const uint8_t* pa, const uint8_t* pr, int32_t c, const DecodeConsts& k,
                      __m512* ze, __m512* zo) {
  const __m128i a16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pa + c / 2));
  if constexpr (L == Lookup::PERM16) {
    // vpermps reads bits 0..3 of each index.
    const __m512i ad = _mm512_cvtepu8_epi32(a16);
    *ze = _mm512_permutexvar_ps(ad, k.t16);
    *zo = _mm512_permutexvar_ps(_mm512_srli_epi32(ad, 4), k.t16);
  } else if constexpr (L == Lookup::NEST) {
    // Channel order: *ze channels 0..15, *zo 16..31.  The 32 codes as words,
    // per 128-bit lane L those of channels 4L..4L+3 and then 16+4L..16+4L+3,
    // so that the two unpacks below give 16 channels each in order.  Each
    // word takes the byte of its channel (pshufb, the high byte 0) from the
    // anchors and from the residuals: code = (a << 4 or a) & 0xF0 | (r or
    // r >> 4) & 0x0F for an even (odd) channel.
    const __m512i a64 = _mm512_broadcast_i32x4(a16);
    const __m512i r64 =
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pr + c / 2)));
    const __m512i wa = _mm512_shuffle_epi8(a64, k.nest_bytes);
    const __m512i wr = _mm512_shuffle_epi8(r64, k.nest_bytes);
    constexpr __mmask32 kEven = 0x55555555u;  // channels 4L + k: even k
    const __m512i w =
        _mm512_ternarylogic_epi32(_mm512_set1_epi16(0xF0), _mm512_mask_slli_epi16(wa, kEven, wa, 4),
                                  _mm512_mask_srli_epi16(wr, ~kEven, wr, 4), kSelect);
    // nest_level2(c) + 510 = 4c + the correction of codes < 16 and >= 240,
    // in [30, 990].  Its index (vpermt2w reads bits 0..5): t = c + 16 is
    // 16..31 for c < 16, 256..271 (0..15) for c >= 240 and 32..255 else; the
    // bytewise minimum with 0x0120 keeps the first two and makes the rest 32.
    const __m512i ci =
        _mm512_min_epu8(_mm512_add_epi16(w, _mm512_set1_epi16(16)), _mm512_set1_epi16(0x0120));
    const __m512i n510 = _mm512_add_epi16(_mm512_slli_epi16(w, 2),
                                          _mm512_permutex2var_epi16(k.corr_lo, ci, k.corr_hi));
    // To float exactly: the bits 0x4B000000 | v are 2^23 + v, less 2^23 + 510.
    const __m512i e = _mm512_set1_epi16(0x4B00);
    const __m512 bias = _mm512_set1_ps(8389118.0f);  // 2^23 + 510
    *ze = _mm512_mul_ps(_mm512_sub_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(n510, e)), bias),
                        k.step);
    *zo = _mm512_mul_ps(_mm512_sub_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(n510, e)), bias),
                        k.step);
  } else {
    const __m512i ad = _mm512_cvtepu8_epi32(a16);
    const __m512i rd =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pr + c / 2)));
    const __m512i f0 = _mm512_set1_epi32(0xF0);
    const __m512i ce = _mm512_ternarylogic_epi32(f0, _mm512_slli_epi32(ad, 4), rd, kSelect);
    const __m512i co = _mm512_ternarylogic_epi32(f0, ad, _mm512_srli_epi32(rd, 4), kSelect);
    if constexpr (L == Lookup::UNIFORM) {
      const __m512 m1 = _mm512_set1_ps(-1.0f);
      *ze = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ce), k.step, m1);
      *zo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(co), k.step, m1);
    } else {
      *ze = _mm512_i32gather_ps(ce, k.table, 4);
      *zo = _mm512_i32gather_ps(co, k.table, 4);
    }
  }
}

// One 64-byte store; NT: non-temporal (p 64-byte aligned).
template <bool NT>
inline void store64(void* p, __m512i v) {
  if constexpr (NT)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
  else
    _mm512_storeu_si512(p, v);
}

// Round-to-nearest-even float -> bfloat16 in the high half of each dword
// (the decoder never produces NaN).
inline __m512i bf16_round_hi(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
}

// Channels [Hv, H) of a row, in channel order, as the reference.
void decode_tail(const uint8_t* pa, const uint8_t* pr, int32_t Hv, int32_t H, const float* pm,
                 const float* pd, const Values& v, kvxfer_dtype_t dt, uint8_t* row) {
  for (int32_t c = Hv; c < H; ++c) {
    const unsigned sh = (c & 1) * 4;
    const unsigned a = (pa[c / 2] >> sh) & 15u;
    const unsigned i = pr != nullptr ? a << 4 | ((pr[c / 2] >> sh) & 15u) : a;
    store_elem(row, c, dt, denormalise(v.table[i], Affine{pm[c], pd[c]}));
  }
}

template <Lookup L, int DT, bool CLAMP, bool NT>
void decode_row_nibbles_t(const uint8_t* pa, const uint8_t* pr, int32_t H, const float* pm,
                          const float* pd, const Values& v, uint8_t* row) {
  const DecodeConsts k(v);
  // CLAMP: to +-FLT_MAX, or for an FP16 row to +-65504 (f32_to_f16_sat).
  constexpr bool kF16 = DT == KVXFER_DTYPE_FP16;
  const __m512 big = _mm512_set1_ps(kF16 ? kF16Max : std::numeric_limits<float>::max());
  const __m512 nbig = _mm512_set1_ps(kF16 ? -kF16Max : -std::numeric_limits<float>::max());
  const int32_t Hv = H & ~31;
  for (int32_t c = 0; c < Hv; c += 32) {
    __m512 ze, zo;
    zvalues32<L>(pa, pr, c, k, &ze, &zo);
    __m512 xe = _mm512_fmadd_ps(_mm512_loadu_ps(pd + c), ze, _mm512_loadu_ps(pm + c));
    __m512 xo = _mm512_fmadd_ps(_mm512_loadu_ps(pd + c + 16), zo, _mm512_loadu_ps(pm + c + 16));
    if constexpr (CLAMP) {
      xe = _mm512_min_ps(_mm512_max_ps(xe, nbig), big);
      xo = _mm512_min_ps(_mm512_max_ps(xo, nbig), big);
    }
    if constexpr (L == Lookup::NEST) {  // channel order: xe channels 0..15, xo 16..31
      if constexpr (DT == KVXFER_DTYPE_BF16) {
        const __m512i il = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
        // packus interleaves the two per 128-bit lane: qwords 0, 2, 4, 6 are xe's.
        store64<NT>(row + 2 * c,
                    _mm512_permutexvar_epi64(
                        il, _mm512_packus_epi32(_mm512_srli_epi32(bf16_round_hi(xe), 16),
                                                _mm512_srli_epi32(bf16_round_hi(xo), 16))));
      } else if constexpr (DT == KVXFER_DTYPE_FP16) {
        constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        store64<NT>(row + 2 * c,
                    _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(xe, kRne)),
                                       _mm512_cvtps_ph(xo, kRne), 1));
      } else {
        float* out = reinterpret_cast<float*>(row) + c;
        store64<NT>(out, _mm512_castps_si512(xe));
        store64<NT>(out + 16, _mm512_castps_si512(xo));
      }
    } else if constexpr (DT == KVXFER_DTYPE_BF16) {
      const __m512i out = _mm512_mask_blend_epi16(
          0xAAAAAAAAu, _mm512_srli_epi32(bf16_round_hi(xe), 16), bf16_round_hi(xo));
      store64<NT>(row + 2 * c, out);
    } else if constexpr (DT == KVXFER_DTYPE_FP16) {
      constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      const __m512i il =
          _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                           6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i out =
          _mm512_permutex2var_epi16(_mm512_castsi256_si512(_mm512_cvtps_ph(xe, kRne)), il,
                                    _mm512_castsi256_si512(_mm512_cvtps_ph(xo, kRne)));
      store64<NT>(row + 2 * c, out);
    } else {
      const __m512i i0 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i i1 =
          _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      float* out = reinterpret_cast<float*>(row) + c;
      store64<NT>(out, _mm512_castps_si512(_mm512_permutex2var_ps(xe, i0, xo)));
      store64<NT>(out + 16, _mm512_castps_si512(_mm512_permutex2var_ps(xe, i1, xo)));
    }
  }
  decode_tail(pa, pr, Hv, H, pm, pd, v, static_cast<kvxfer_dtype_t>(DT), row);
}

// bfloat16 output by VCVTNE2PS2BF16 (AVX512_BF16, checked at run time:
// cpu_has_avx512_bf16), which rounds to nearest even as bf16_round_hi but
// flushes subnormal inputs to zero: only for binary16 metadata and tables
// without tiny values (Values::tiny), where fma(d, z, m) is 0 or normal.
template <Lookup L, bool NT>
__attribute__((target("avx512bf16"))) void decode_row_nibbles_bf16(const uint8_t* pa,
                                                                   const uint8_t* pr, int32_t H,
                                                                   const float* pm, const float* pd,
                                                                   const Values& v, uint8_t* row) {
  const DecodeConsts k(v);
  // Words [even 0..15, odd 0..15] to channel order.
  const __m512i il = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int32_t Hv = H & ~31;
  for (int32_t c = 0; c < Hv; c += 32) {
    __m512 ze, zo;
    zvalues32<L>(pa, pr, c, k, &ze, &zo);
    const __m512 xe = _mm512_fmadd_ps(_mm512_loadu_ps(pd + c), ze, _mm512_loadu_ps(pm + c));
    const __m512 xo =
        _mm512_fmadd_ps(_mm512_loadu_ps(pd + c + 16), zo, _mm512_loadu_ps(pm + c + 16));
    const __m512i w = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(xo, xe));
    if constexpr (L == Lookup::NEST)  // channel order already
      store64<NT>(row + 2 * c, w);
    else
      store64<NT>(row + 2 * c, _mm512_permutexvar_epi16(il, w));
  }
  decode_tail(pa, pr, Hv, H, pm, pd, v, KVXFER_DTYPE_BF16, row);
}

template <Lookup L, bool CLAMP, bool NT>
void decode_row_nibbles_s(const uint8_t* pa, const uint8_t* pr, int32_t H, const float* pm,
                          const float* pd, const Values& v, kvxfer_dtype_t dt, uint8_t* row) {
  switch (dt) {
    case KVXFER_DTYPE_BF16:
      if (!CLAMP && !v.tiny && cpu_has_avx512_bf16())
        return decode_row_nibbles_bf16<L, NT>(pa, pr, H, pm, pd, v, row);
      return decode_row_nibbles_t<L, KVXFER_DTYPE_BF16, CLAMP, NT>(pa, pr, H, pm, pd, v, row);
    case KVXFER_DTYPE_FP16:
      return decode_row_nibbles_t<L, KVXFER_DTYPE_FP16, CLAMP, NT>(pa, pr, H, pm, pd, v, row);
    default:
      return decode_row_nibbles_t<L, KVXFER_DTYPE_FP32, CLAMP, NT>(pa, pr, H, pm, pd, v, row);
  }
}

// Streaming stores where asked (Values::stream) and the row allows them.
template <Lookup L, bool CLAMP>
void decode_row_nibbles_l(const uint8_t* pa, const uint8_t* pr, int32_t H, const float* pm,
                          const float* pd, const Values& v, kvxfer_dtype_t dt, uint8_t* row) {
  if (v.stream && (reinterpret_cast<uintptr_t>(row) & 63) == 0)
    return decode_row_nibbles_s<L, CLAMP, true>(pa, pr, H, pm, pd, v, dt, row);
  decode_row_nibbles_s<L, CLAMP, false>(pa, pr, H, pm, pd, v, dt, row);
}

template <bool CLAMP>
void decode_row_nibbles_c(const uint8_t* pa, const uint8_t* pr, int32_t H, const float* pm,
                          const float* pd, const Values& v, kvxfer_dtype_t dt, uint8_t* row) {
  if (pr == nullptr)  // 16 entries: the anchors, or INT4's full codes
    return decode_row_nibbles_l<Lookup::PERM16, CLAMP>(pa, pr, H, pm, pd, v, dt, row);
  if (v.linear_kind == CODE_NEST)
    return decode_row_nibbles_l<Lookup::NEST, CLAMP>(pa, pr, H, pm, pd, v, dt, row);
  if (v.linear_kind == CODE_UNIFORM)
    return decode_row_nibbles_l<Lookup::UNIFORM, CLAMP>(pa, pr, H, pm, pd, v, dt, row);
  decode_row_nibbles_l<Lookup::GATHER, CLAMP>(pa, pr, H, pm, pd, v, dt, row);
}

void decode_row_nibbles_avx512(const uint8_t* pa, const uint8_t* pr, int32_t H, const float* pm,
                               const float* pd, const Values& v, kvxfer_dtype_t dt, uint8_t* row) {
  if (v.clamp)
    decode_row_nibbles_c<true>(pa, pr, H, pm, pd, v, dt, row);
  else
    decode_row_nibbles_c<false>(pa, pr, H, pm, pd, v, dt, row);
  // GCC 12 emits no VZEROUPPER in the kernels that end by calling
  // decode_tail, and the driver's legacy-SSE code between rows (fast.cc,
  // baseline x86-64) then ran with the upper state dirty: a full decode took
  // twice the time of the same arithmetic on an Intel Xeon.
  _mm256_zeroupper();
}

}  // namespace

bool any_bad_fp16_meta_avx512(const uint8_t* meta, int64_t entries) {
  // Per dword {m, d}: m or d with the exponent all ones, or d above 0x8000
  // (negative, -0 allowed).
  const __m512i e = _mm512_set1_epi32(0x7C007C00);
  const __m512i d0 = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i dmask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __mmask32 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= entries; i += 16) {
    const __m512i v = _mm512_loadu_si512(meta + 4 * i);
    bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(v, e), e) |
           _mm512_cmpgt_epu32_mask(_mm512_and_si512(v, dmask), d0);
  }
  uint32_t tail = 0;
  for (; i < entries; ++i) {
    uint32_t w;
    std::memcpy(&w, meta + 4 * i, 4);
    const uint32_t m = w & 0xFFFFu, d = w >> 16;
    tail |= static_cast<uint32_t>((m & 0x7C00u) == 0x7C00u) | ((d & 0x7C00u) == 0x7C00u) |
            (d > 0x8000u);
  }
  return bad != 0 || tail != 0;
}

const RowKernels& avx512_kernels() {
  static const RowKernels k = [] {
    RowKernels t = avx2_kernels();
    t.chunk_minmax = chunk_minmax_avx512;
    t.chunk_meta = chunk_meta_avx512;
    t.encode_params = encode_params_avx512;
    t.encode_row_nibbles = encode_row_nibbles_avx512;
    t.encode_row_nibbles_ahead = encode_row_nibbles_ahead_avx512;
    t.decode_params = decode_params_avx512;
    t.decode_row_nibbles = decode_row_nibbles_avx512;
    return t;
  }();
  return k;
}

void stream_copy_avx512(uint8_t* dst, const uint8_t* src, size_t bytes) {
  for (size_t i = 0; i < bytes; i += 64) store64<true>(dst + i, _mm512_loadu_si512(src + i));
}

}  // namespace kvxfer::codec::fast
