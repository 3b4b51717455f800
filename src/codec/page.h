// Pieces of the page codec shared by the reference path (codec/reference.cc),
// the fast CPU path (codec/fast*.cc) and, through the same definitions, the
// CUDA kernels: dtype conversions, the page layout, the per-(chunk, channel)
// affine normalisation, and the bit stream.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "codec/codebook.h"
#include "codec/format.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {

// ---------------------------------------------------------------------------
// Exact dtype conversions (IEEE-754 binary16 / bfloat16 <-> binary32).
// Widening is exact.  Narrowing rounds to nearest, ties to even, overflows to
// infinity and keeps subnormals, exactly as the F16C instructions and CUDA's
// __float2half_rn / __float2bfloat16_rn do.
// ---------------------------------------------------------------------------
inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return bits_f32(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
  // subnormal: man * 2^-24, exact in float
  const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;           // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;          // rounds to >= 65520: inf
  if (a >= 0x38800000u) {                               // normal half (>= 2^-14)
    const uint32_t r = a - 0x38000000u;                 // rebias exponent 127 -> 15
    return sign | static_cast<uint16_t>((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
  }
  if (a < 0x33000000u) return sign;                     // < 2^-25: rounds to 0
  // subnormal half: value = a * 2^24 units of 2^-24, rounded to nearest even
  const uint32_t e = a >> 23, m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - e;                       // 14..24 (e in 102..112)
  const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  return sign | static_cast<uint16_t>(q + (rem > half || (rem == half && (q & 1u))));
}
/** Smallest binary16 >= f, for finite f >= 0 (may be +inf). */
inline uint16_t f32_to_f16_up(float f) {
  uint16_t h = f32_to_f16(f);
  if (f16_to_f32(h) < f) ++h;  // next binary16 up (0x7BFF + 1 = +inf)
  return h;
}

inline float load_elem(const uint8_t* row, int64_t i, kvxfer_dtype_t dt) {
  switch (dt) {
    case KVXFER_DTYPE_BF16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * i, 2);
      return bf16_to_f32(h);
    }
    case KVXFER_DTYPE_FP16: {
      uint16_t h;
      std::memcpy(&h, row + 2 * i, 2);
      return f16_to_f32(h);
    }
    default: {
      float f;
      std::memcpy(&f, row + 4 * i, 4);
      return f;
    }
  }
}
inline void store_elem(uint8_t* row, int64_t i, kvxfer_dtype_t dt, float v) {
  switch (dt) {
    case KVXFER_DTYPE_BF16: {
      const uint16_t h = f32_to_bf16(v);
      std::memcpy(row + 2 * i, &h, 2);
      break;
    }
    case KVXFER_DTYPE_FP16: {
      const uint16_t h = f32_to_f16(v);
      std::memcpy(row + 2 * i, &h, 2);
      break;
    }
    default:
      std::memcpy(row + 4 * i, &v, 4);
  }
}

// ---------------------------------------------------------------------------
// Page layout (kvxfer_page_layout_t), validated once.
// ---------------------------------------------------------------------------
struct Layout {
  const kvxfer_page_layout_t* l;
  size_t elem;  // bytes per element
  uint8_t* row(int64_t t) const {
    const int64_t u = l->first_token + t;
    return static_cast<uint8_t*>(l->blocks[u / l->block_size]) +
           (u % l->block_size) * l->row_stride * static_cast<int64_t>(elem);
  }
};

/** Validates a layout; `what` names it in the message ("source", "destination"). */
kvxfer_result_t validate_layout(const kvxfer_page_layout_t* l, const char* what, Layout* out);

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

/** min/max with a canonical +0 for zeros (so -0/+0 order does not matter). */
inline void canonical_minmax(float* mn, float* mx) {
  *mn = *mn + 0.0f;
  *mx = *mx + 0.0f;
}

/**
 * The affine map of one (chunk, channel) from its finite min and max.  With
 * fp32 == false the result is representable in binary16; returns false if it
 * is not (range beyond 65504), in which case the page must use fp32 metadata.
 */
inline bool chunk_affine(float mn, float mx, bool fp32, Affine* a) {
  float m = 0.5f * mn + 0.5f * mx;  // halves first: no overflow
  if (!fp32) {
    const uint16_t mh = f32_to_f16(m);
    m = f16_to_f32(mh);
    if (std::isinf(m)) return false;
  }
  float d = std::fmax(mx - m, m - mn) + 0.0f;
  if (std::isinf(d)) return false;
  if (!fp32) {
    d = f16_to_f32(f32_to_f16_up(d));
    if (std::isinf(d)) return false;
  }
  a->m = m;
  a->d = d;
  return true;
}

/** z = (x - m) / d; 0 for a zero range.  Division, not a reciprocal: exact rounding. */
inline float normalise(float x, const Affine& a) { return a.d > 0.0f ? (x - a.m) / a.d : 0.0f; }

/** x = m + d * r (two roundings, never fused). */
inline float denormalise(float r, const Affine& a) {
  const float t = a.d * r;
  return a.m + t;
}

/**
 * The documented per-element error bound (docs/FORMAT.md, "Error bound"):
 *     |x - x_hat| <= d * (W/2 + 2^-21) + 2^-23 * |m| + rho(dtype) * |x_hat| + sigma(dtype)
 * W/2 is the largest half bin width of the codebook (full codes or anchors);
 * 2^-21 d + 2^-23 |m| covers the float roundings of normalise/denormalise;
 * rho, sigma cover rounding the output to the destination dtype (bf16 2^-8,
 * 1e-38; fp16 2^-11, 2^-25; fp32 0, 0).
 */
inline double error_bound(const Codebook& cb, bool full, const Affine& a, kvxfer_dtype_t out,
                          double xhat) {
  const double hw = full ? cb.max_half_width_full : cb.max_half_width_anchor;
  double b = a.d * (hw + std::ldexp(1.0, -21)) + std::ldexp(1.0, -23) * std::fabs(a.m);
  if (out == KVXFER_DTYPE_BF16) b += std::ldexp(1.0, -8) * std::fabs(xhat) + 1e-38;
  if (out == KVXFER_DTYPE_FP16) b += std::ldexp(1.0, -11) * std::fabs(xhat) + std::ldexp(1.0, -25);
  return b;
}

// Metadata entries: [chunk][channel]{m, d}, binary16 or binary32.
inline void put_affine(uint8_t* meta, int64_t idx, bool fp32, const Affine& a) {
  if (fp32) {
    std::memcpy(meta + idx * 8, &a.m, 4);
    std::memcpy(meta + idx * 8 + 4, &a.d, 4);
  } else {
    const uint16_t m = f32_to_f16(a.m), d = f32_to_f16(a.d);  // exact: already binary16
    std::memcpy(meta + idx * 4, &m, 2);
    std::memcpy(meta + idx * 4 + 2, &d, 2);
  }
}
inline Affine get_affine(const uint8_t* meta, int64_t idx, bool fp32) {
  Affine a;
  if (fp32) {
    std::memcpy(&a.m, meta + idx * 8, 4);
    std::memcpy(&a.d, meta + idx * 8 + 4, 4);
  } else {
    uint16_t m, d;
    std::memcpy(&m, meta + idx * 4, 2);
    std::memcpy(&d, meta + idx * 4 + 2, 2);
    a.m = f16_to_f32(m);
    a.d = f16_to_f32(d);
  }
  return a;
}

// ---------------------------------------------------------------------------
// Bit stream: field e of width w occupies bits [e*w, (e+1)*w), LSB first.
// ---------------------------------------------------------------------------
inline void put_bits(uint8_t* buf, uint64_t bitpos, unsigned w, unsigned v) {
  for (unsigned b = 0; b < w; ++b, ++bitpos)
    if ((v >> b) & 1u) buf[bitpos >> 3] |= static_cast<uint8_t>(1u << (bitpos & 7));
}
inline unsigned get_bits(const uint8_t* buf, uint64_t bitpos, unsigned w) {
  unsigned v = 0;
  for (unsigned b = 0; b < w; ++b, ++bitpos) v |= ((buf[bitpos >> 3] >> (bitpos & 7)) & 1u) << b;
  return v;
}

// ---------------------------------------------------------------------------
// One encode/decode job, as the paths see it.
// ---------------------------------------------------------------------------
struct EncodeJob {
  const Codebook* cb;  // nullptr for BF16 / raw
  const PageHeader* hdr;
  Layout src;
  bool meta_fp32;
  uint8_t* meta;      // anchor payload start
  uint8_t* anchors;   // after metadata
  uint8_t* residuals; // residual payload start (may be unused)
};

enum class EncodeStatus { OK, NEED_FP32, NONFINITE };

struct DecodeJob {
  const Codebook* cb;
  const PageHeader* hdr;
  Layout dst;
  bool meta_fp32;
  const uint8_t* meta;
  const uint8_t* anchors;
  const uint8_t* residuals;  // nullptr: anchor-only
};

namespace reference {
/** Plain-loop encoder of quantized pages: the definition of the bytes. */
EncodeStatus encode(const EncodeJob& job);
/** Plain-loop decoder (metadata already validated). */
void decode(const DecodeJob& job);
}  // namespace reference

namespace fast {
/** Same bytes as reference::encode, SIMD and threads.  `impl` "scalar" or "avx2". */
EncodeStatus encode(const EncodeJob& job, bool avx2, int threads);
void decode(const DecodeJob& job, bool avx2, int threads);
/** True if this CPU can run the AVX2 path (AVX2 + F16C). */
bool cpu_has_avx2();
}  // namespace fast

/**
 * Finds the first non-finite element of a page (token-major order) for the
 * error message.  Returns false if none.
 */
bool find_nonfinite(const Layout& src, int64_t T, int32_t H, int64_t* t, int32_t* h, float* v);

}  // namespace kvxfer::codec
