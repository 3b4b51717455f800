// The element math of the page codec, one definition for the CPU paths
// (compiled by g++) and the CUDA kernels (compiled by nvcc): dtype
// conversions, the per-(chunk, channel) affine normalisation, the code of an
// element (one code scale per (chunk, channel); linear and nested codes by one
// fma, alpha-law codes by the threshold lookup), the reconstruction and
// the anchor table (docs/FORMAT.md, sections 2.1-2.4 and 3 "Exactness").
//
// Rules that keep both sides bit-identical:
//   - conversions are pure integer bit manipulation (no libm, no intrinsics);
//   - no std:: function that is not callable on the device: fabs is a sign-bit
//     mask, isinf/isfinite compare exponent bits, fmax is an explicit
//     comparison, floor is an integer truncation with a correction;
//   - every float operation is one correctly rounded IEEE-754 binary32
//     operation.  The CPU is compiled with -ffp-contract=off; on the device the
//     same operations are spelled __fadd_rn/__fsub_rn/__fmul_rn/__fdiv_rn,
//     which are never contracted into an FMA and are exact-rounding whatever
//     --fmad or -prec-div say (the kernels are also built with --fmad=false
//     -prec-div=true -ftz=false, kernels/CMakeLists.txt).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVXFER_HD __host__ __device__
#else
#define KVXFER_HD
#endif

namespace kvxfer::codec {

// ---------------------------------------------------------------------------
// One correctly rounded binary32 operation each, never fused.
// ---------------------------------------------------------------------------
#if defined(__CUDA_ARCH__)
KVXFER_HD inline float f_add(float a, float b) { return __fadd_rn(a, b); }
KVXFER_HD inline float f_sub(float a, float b) { return __fsub_rn(a, b); }
KVXFER_HD inline float f_mul(float a, float b) { return __fmul_rn(a, b); }
KVXFER_HD inline float f_div(float a, float b) { return __fdiv_rn(a, b); }
KVXFER_HD inline double d_add(double a, double b) { return __dadd_rn(a, b); }
KVXFER_HD inline double d_mul(double a, double b) { return __dmul_rn(a, b); }
KVXFER_HD inline double d_div(double a, double b) { return __ddiv_rn(a, b); }
KVXFER_HD inline float f_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#else
KVXFER_HD inline float f_add(float a, float b) { return a + b; }
KVXFER_HD inline float f_sub(float a, float b) { return a - b; }
KVXFER_HD inline float f_mul(float a, float b) { return a * b; }
KVXFER_HD inline float f_div(float a, float b) { return a / b; }
KVXFER_HD inline double d_add(double a, double b) { return a + b; }
KVXFER_HD inline double d_mul(double a, double b) { return a * b; }
KVXFER_HD inline double d_div(double a, double b) { return a / b; }
/** a * b + c with one rounding (IEEE fusedMultiplyAdd; the FMA instruction where there is one). */
KVXFER_HD inline float f_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#endif

// ---------------------------------------------------------------------------
// Exact dtype conversions (IEEE-754 binary16 / bfloat16 <-> binary32).
// Widening is exact.  Narrowing rounds to nearest, ties to even, overflows to
// infinity and keeps subnormals, exactly as the F16C instructions and CUDA's
// __float2half_rn / __float2bfloat16_rn do.  The kernels use these functions,
// not the CUDA intrinsics, so both sides run the same integer code.
// ---------------------------------------------------------------------------
KVXFER_HD inline uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
KVXFER_HD inline float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
/** True for +-inf and NaN (std::isfinite's negation, by exponent bits). */
KVXFER_HD inline bool f32_nonfinite(float f) { return (f32_bits(f) & 0x7F800000u) == 0x7F800000u; }
/** True for +-inf only (std::isinf). */
KVXFER_HD inline bool f32_isinf(float f) { return (f32_bits(f) & 0x7FFFFFFFu) == 0x7F800000u; }
/** |f| (std::fabs): clears the sign bit. */
KVXFER_HD inline float f32_abs(float f) { return bits_f32(f32_bits(f) & 0x7FFFFFFFu); }
/** std::fmax up to the sign of an equal pair of zeros (callers canonicalise zeros). */
KVXFER_HD inline float f32_max(float a, float b) {
  if (a != a) return b;  // fmax ignores a NaN operand
  if (b != b) return a;
  return a > b ? a : b;
}

KVXFER_HD inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
KVXFER_HD inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
KVXFER_HD inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
  // subnormal: man * 2^-24, exact in float
  const float v = f_mul(static_cast<float>(man), 5.9604644775390625e-8f);
  return sign ? -v : v;
}
KVXFER_HD inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {                       // normal half (>= 2^-14)
    const uint32_t r = a - 0x38000000u;         // rebias exponent 127 -> 15
    return sign | static_cast<uint16_t>((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  }
  if (a < 0x33000000u) return sign;  // < 2^-25: rounds to 0
  // subnormal half: value = a * 2^24 units of 2^-24, rounded to nearest even
  const uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - e;  // 14..24 (e in 102..112)
  const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  return sign | static_cast<uint16_t>(q + (rem > half || (rem == half && (q & 1u))));
}
/** The largest finite binary16, 0x7BFF. */
constexpr float kF16Max = 65504.0f;
/**
 * f32_to_f16 for a decoder's output (docs/FORMAT.md section 3, item 4): a
 * finite f that rounds beyond +-65504 gives +-65504 (0x7BFF, signed), as the
 * FP16 tier saturates (section 6.2), so that a finite page never decodes to
 * an infinity; the codec's own range (m + d at binary16 precision) may
 * reach one ulp of d past the page's largest value.  NaN and +-inf convert
 * as f32_to_f16.  The SIMD decoders clamp to +-kF16Max before converting,
 * which gives the same bits for every finite f.
 */
KVXFER_HD inline uint16_t f32_to_f16_sat(float f) {
  const uint16_t h = f32_to_f16(f);
  const bool finite = (f32_bits(f) & 0x7F800000u) != 0x7F800000u;
  return finite && (h & 0x7FFFu) == 0x7C00u ? static_cast<uint16_t>((h & 0x8000u) | 0x7BFFu) : h;
}
/** Smallest binary16 >= f, for finite f >= 0 (may be +inf). */
KVXFER_HD inline uint16_t f32_to_f16_up(float f) {
  uint16_t h = f32_to_f16(f);
  if (f16_to_f32(h) < f) ++h;  // next binary16 up (0x7BFF + 1 = +inf)
  return h;
}

// ---------------------------------------------------------------------------
// Lynx Algorithm 1, normalisation (lines 2-5).  Per-channel normalisation
// followed by per-chunk normalisation composes into one affine map per
// (chunk, channel); we store that map directly (docs/FORMAT.md "Metadata"):
//     m = (min + max) / 2,   d = max |x - m|,   z = (x - m) / d  in [-1, 1]
// m is the centre that minimises max |x - m| (so d is as small as it can be).
// With fp16 metadata, m is rounded to nearest and d is recomputed against the
// rounded m and rounded up, so |z| <= 1 still holds for every x of the chunk.
// ---------------------------------------------------------------------------
struct Affine {
  float m, d;
};

/**
 * Smallest half-range of a (chunk, channel) with binary32 metadata: a
 * positive d below it is raised to it, so that the code scale L / d of every
 * codebook (L <= 127.5) is finite (docs/FORMAT.md 2.1).  Binary16 metadata
 * never gets there (its smallest positive d is 2^-24).
 */
constexpr float kMinHalfRange = 7.8886090522101181e-31f;  // 2^-100

/** min/max with a canonical +0 for zeros (so -0/+0 order does not matter). */
KVXFER_HD inline void canonical_minmax(float* mn, float* mx) {
  *mn = f_add(*mn, 0.0f);
  *mx = f_add(*mx, 0.0f);
}

/**
 * The affine map of one (chunk, channel) from its finite min and max.  With
 * fp32 == false the result is representable in binary16; returns false if it
 * is not (range beyond 65504), in which case the page must use fp32 metadata.
 */
KVXFER_HD inline bool chunk_affine(float mn, float mx, bool fp32, Affine* a) {
  float m = f_add(f_mul(0.5f, mn), f_mul(0.5f, mx));  // halves first: no overflow
  if (!fp32) {
    const uint16_t mh = f32_to_f16(m);
    m = f16_to_f32(mh);
    if (f32_isinf(m)) return false;
  }
  float d = f_add(f32_max(f_sub(mx, m), f_sub(m, mn)), 0.0f);
  if (f32_isinf(d)) return false;
  if (!fp32) {
    d = f16_to_f32(f32_to_f16_up(d));
    if (f32_isinf(d)) return false;
  } else if (d > 0.0f && d < kMinHalfRange) {
    d = kMinHalfRange;  // keeps L / d finite (code_scale)
  }
  a->m = m;
  a->d = d;
  return true;
}

/**
 * The first row of chunk [t0, t1) whose values set the chunk's ranges
 * (docs/FORMAT.md 2.7): sink rows, sent exactly and overwritten by every
 * decoder, do not widen d, unless the chunk holds nothing else.  The
 * elements of the rows before it are encoded clamped to the range
 * (clamp_to_range), so that their codes stay in the codebook's domain.
 */
KVXFER_HD inline int64_t range_row0(int64_t t0, int64_t t1, int64_t sink_rows) {
  return sink_rows > t0 && sink_rows < t1 ? sink_rows : t0;
}

/** x clamped to the canonical range [mn, mx] of its (chunk, channel). */
KVXFER_HD inline float clamp_to_range(float x, float mn, float mx) {
  return x < mn ? mn : (x > mx ? mx : x);
}

/**
 * The code scale of one (chunk, channel), s = RN(L / d): one correctly
 * rounded division per (chunk, channel), then a multiply per element
 * (docs/FORMAT.md 2.2).  0 for a zero range.  L is Codebook::scale_num.
 */
KVXFER_HD inline float code_scale(float d, float num) { return d > 0.0f ? f_div(num, d) : 0.0f; }

/** x = m + d * r with one rounding (fma), clamped to [-FLT_MAX, FLT_MAX]. */
KVXFER_HD inline float denormalise(float r, const Affine& a) {
  const float x = f_fma(a.d, r, a.m);
  // |m| + d can round past FLT_MAX for a range that ends near it (and a
  // hostile section can carry any finite m, d): clamp, so that finite
  // metadata never reconstructs to infinity (docs/FORMAT.md 2.5).
  const float big = bits_f32(0x7F7FFFFFu);  // FLT_MAX
  return x > big ? big : (x < -big ? -big : x);
}

/**
 * The code of a normalised value z in [-1, 1] by one cell lookup and one
 * comparison (docs/FORMAT.md section 3, item 3); equal to Codebook::encode(z).
 * `base` / `next` are Codebook::lut_base / lut_next (on the device: verbatim
 * copies of them).  The domain (|z| for sign-magnitude, z otherwise) is cut
 * into cells of width 2^-lut_log2; cell i = floor(v * 2^lut_log2) + lut_origin.
 * Scaling by a power of two is exact, so the cell index is too; the floor is
 * an integer truncation corrected for negative non-integers (|v| <= 2^22).
 */
KVXFER_HD inline uint8_t encode_lut(const int32_t* base, const float* next, int lut_log2,
                                    int lut_origin, bool sign_magnitude, float z) {
  const float n = static_cast<float>(1 << lut_log2);
  if (sign_magnitude) {
    const float a = f32_abs(z);
    const int i = static_cast<int>(f_mul(a, n));  // a >= 0: truncation is the floor
    return static_cast<uint8_t>((base[i] + (a >= next[i])) | (z < 0.0f ? 0x80 : 0));
  }
  const float v = f_mul(z, n);
  int i = static_cast<int>(v);
  if (static_cast<float>(i) > v) --i;  // floor for negative non-integers
  i += lut_origin;
  return static_cast<uint8_t>(base[i] + (z >= next[i]));
}

/** How a codebook turns y = RN(x - m) into a code (Codebook::kind). */
enum CodeKind : int {
  CODE_LUT = 0,      // LYNX alpha > 0: z = RN(u * s), s = RN(1 / d), then the threshold LUT
  CODE_NEST = 1,     // LYNX alpha = 0: g = trunc(RN(u * s + 256)), s = RN(240 / d); the top
                     //   4 bits are INT4's code, the low 4 refine it (nest_code)
  CODE_UNIFORM = 2,  // INT8 / INT4: q = min(trunc(fma(u, s, L + 1/2)), 2L), s = RN(L / d)
};

/**
 * The nested code of LYNX alpha = 0 (wire format 4, docs/FORMAT.md 2.2) from
 * g = trunc(RN(u * s + 256)), s = RN(240 / d), g in [15, 496]:
 *     anchor   a = min(g >> 5, 15)                    INT4's code, bit for bit
 *     residual r = a == 15 ? min(g - 480, 15)          top cell, steps of 1/240
 *                : a == 0  ? max(g - 16, 0)            bottom cell, steps of 1/240
 *                :           (g >> 1) & 15             other cells, steps of 1/120
 *     code = a << 4 | r
 * s = 32 * RN(7.5 / d) and 256 = 32 * 8 exactly, so RN(u * s + 256) is 32
 * times INT4's RN(u * s4 + 8): the anchor is INT4's min(trunc(.), 15).
 */
KVXFER_HD inline uint8_t nest_code(int g) {
  int a = g >> 5;
  a = a > 15 ? 15 : a;
  int r;
  if (a == 15) {
    r = g - 480;
    r = r > 15 ? 15 : r;
  } else if (a == 0) {
    r = g - 16;
    r = r < 0 ? 0 : r;
  } else {
    r = (g >> 1) & 15;
  }
  return static_cast<uint8_t>(a << 4 | r);
}

/**
 * Twice the position of code c's level in units of 1/240 of z, minus 512:
 * the level is z = n / 480 (nest_recon).  Cell centres, except the two
 * extreme codes, which sit at +-1 where every (chunk, channel) has its
 * minimum and maximum.  An integer in [-480, 480].
 */
KVXFER_HD inline int nest_level2(unsigned c) {
  if (c == 0) return -480;
  if (c == 255) return 480;
  if (c < 16) return 2 * static_cast<int>(c) - 479;   // 2 (16 + c + 1/2) - 512
  if (c >= 240) return 2 * static_cast<int>(c) - 31;  // 2 (c + 240 + 1/2) - 512
  return 4 * static_cast<int>(c) - 510;               // 2 (2c + 1) - 512
}

/** What the element code needs of a codebook (the CPU's Codebook, the kernels' copy). */
struct CodeSpec {
  int kind;             // CodeKind
  float num;            // L of s = RN(L / d): 1 (LUT), 240 (NEST), (2^b - 1) / 2 (UNIFORM)
  float bias;           // L + 1/2 (UNIFORM); NEST: 256; LUT: unused
  int max_code;         // UNIFORM: 2^b - 1; NEST, LUT: 255
  const int32_t* base;  // LUT kind only: Codebook::lut_base / lut_next
  const float* next;
  int lut_log2, lut_origin;
};

/**
 * The code of one element x of a (chunk, channel) with offset m and code
 * scale s = code_scale(d, spec.num) (docs/FORMAT.md 2.2).  Every float step
 * is one correctly rounded operation: u = RN(x - m), then
 *   LUT:     z = RN(u * s), code = encode_lut(z) (the threshold count);
 *   UNIFORM: q = min(trunc(RN(u * s + L + 1/2)), 2^b - 1);
 *   NEST:    code = nest_code(trunc(RN(u * s + 256))).
 * UNIFORM is round-half-up of (z + 1) * L without a table.  |RN(x - m)| <= d
 * and s <= (L / d)(1 + 2^-24), so the sums are positive and the clamps only
 * catch the last ulp.
 */
KVXFER_HD inline uint8_t quantize(const CodeSpec& cs, float x, float m, float s) {
  const float u = f_sub(x, m);
  if (cs.kind == CODE_LUT)
    return encode_lut(cs.base, cs.next, cs.lut_log2, cs.lut_origin, true, f_mul(u, s));
  int q = static_cast<int>(f_fma(u, s, cs.bias));
  if (cs.kind == CODE_NEST) return nest_code(q);
  q = q > cs.max_code ? cs.max_code : (q < 0 ? 0 : q);
  return static_cast<uint8_t>(q);
}

/**
 * The z value of a code of the linear kinds (Codebook::recon_full), the
 * arithmetic the SIMD decoders repeat: CODE_NEST RN(nest_level2(code) * step),
 * step = RN(1/480); CODE_UNIFORM RN(code * step - 1), step = RN(2 / (2^b - 1)).
 */
KVXFER_HD inline float recon_linear(int kind, unsigned code, float step) {
  if (kind == CODE_NEST) return f_mul(static_cast<float>(nest_level2(code)), step);
  return f_fma(static_cast<float>(code), step, -1.0f);
}

/**
 * The per-page anchor table counts the full codes of the page's rows t with
 * t % kHistRowStride == 0 (t from 0 at the page's first token): a fixed
 * one-in-sixteen sample, so that counting costs a sixteenth of a pass
 * (docs/FORMAT.md 2.4).  Rows before sink_rows (2.7) are not counted:
 * decoders overwrite them; callers without sink rows pass 0.
 */
constexpr int kHistRowStride = 16;
KVXFER_HD inline bool hist_row(int64_t t, int64_t sink_rows) {
  return t % kHistRowStride == 0 && t >= sink_rows;
}

/**
 * Entry `a` of the per-page anchor table (docs/FORMAT.md section 2.4) from the
 * page's histogram of full codes: the mean of recon_full over the codes of
 * anchor a, or the bin centre `centre` when no element has anchor a, clamped
 * to the anchor's bin [lo, hi].  The arithmetic of
 * codec::anchor_table_from_histogram (codebook.cc), operation for operation:
 * sums in double in ascending code order (uint64 -> double is exact up to
 * 2^53 elements), one division, one rounding to float, then
 * std::max(v, lo) and std::min(v, hi).  The GPU encoder computes the table
 * with this function.
 */
KVXFER_HD inline float anchor_table_entry(const uint64_t* hist, const float* recon_full,
                                          float centre, float lo, float hi, unsigned a,
                                          unsigned R) {
  const unsigned run = 1u << R;
  double num = 0.0, den = 0.0;
  for (unsigned c = a * run; c < (a + 1) * run; ++c) {
    num = d_add(num, d_mul(static_cast<double>(hist[c]), static_cast<double>(recon_full[c])));
    den = d_add(den, static_cast<double>(hist[c]));
  }
  float v = den > 0.0 ? static_cast<float>(d_div(num, den)) : centre;
  v = v < lo ? lo : v;  // std::max(v, lo)
  v = hi < v ? hi : v;  // std::min(v, hi)
  return v;
}

}  // namespace kvxfer::codec
