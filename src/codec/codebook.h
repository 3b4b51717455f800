// The scalar quantizers of every kvxfer codec, defined by tables.
//
// This file is the one place where the Lynx formulas live (docs/FORMAT.md
// derives and cites each one):
//   alpha-law magnitude (Lynx, Algorithm 1, companding step):
//       Y(|z|) = ln(1 + alpha*|z|) / ln(1 + alpha) * (2^7 - 1),  q = round(Y)
//   its inverse, used for bin edges:
//       g(y) = ((1 + alpha)^(y/127) - 1) / alpha          (alpha = 0: y / 127)
//   anchor / residual split of the 8-bit sign-magnitude code (Lynx Eq. 9,
//   with the +7 bias removed, docs/FORMAT.md "Split"):
//       anchor = code >> R,  residual = code & (2^R - 1),  code = anchor << R | residual
//   uniform asymmetric baselines (min/max per channel per chunk):
//       q = round((z + 1) / 2 * (2^b - 1))
//
// A code is decided from u = RN(x - m) and the code scale s = RN(L / d) of
// its (chunk, channel) (codec_math.h quantize, docs/FORMAT.md 2.2):
//   LYNX alpha > 0 (CODE_LUT):  z = RN(u * s), q = #{k : |z| >= T[k]}, code = (z < 0) << 7 | q
//   LYNX alpha = 0 (CODE_NEST): code = nest_code(trunc(RN(u * s + 256))), s = RN(240 / d):
//                               INT4's code in the top 4 bits, refined by the low 4
//   INT8/INT4 (CODE_UNIFORM):   code = min(trunc(RN(u * s + L + 1/2)), 2L)
// The uniform codes reconstruct at their levels (z = -1 + q/L), the nested
// code at its cell centres, both with the extremes at +-1; alpha-law codes at
// the centre of their bin.
// Thresholds are computed with codec/detmath (bit-reproducible); all tables
// are shared verbatim with the fast CPU path and the CUDA kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "codec/codec_math.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {

struct Codebook {
  kvxfer_codec_t codec;
  float alpha;                    // 0 unless LYNX
  int code_bits;                  // 8 (LYNX, INT8) or 4 (INT4)
  int anchor_bits;                // A
  int residual_bits;              // R = code_bits - A
  bool sign_magnitude;            // LYNX alpha > 0: sign bit + 7-bit alpha-law magnitude
  int kind;                       // CodeKind (codec_math.h)
  float scale_num;                // L of the code scale s = RN(L / d)
  float bias;                     // L + 1/2 (CODE_UNIFORM); 256 (CODE_NEST)
  int max_code;                   // CODE_UNIFORM: 2^b - 1; else 255
  float recon_step;               // linear kinds: recon_full = recon_linear(code, step)
  std::vector<float> thresholds;  // ascending; 127 (alpha-law) or 2^b - 1 (uniform, nested)
  float recon_full[256];          // z value of each code (level, or bin centre)
  float recon_anchor[64];         // z value of each anchor: centre of its bins; R = 0: recon_full;
                                  // LYNX alpha 0 at 4+4: INT4's level
  double max_half_width_full;     // max over codes of |z - recon| inside the bin (z units)
  double max_half_width_anchor;   // same over anchors
  float anchor_lo[64], anchor_hi[64];  // bin of each anchor in z (union of its codes' bins)

  // Fast-path lookup (codec/fast*.cc).  The domain (|z| in [0,1] for
  // sign-magnitude, z in [-1,1] for uniform) is cut into cells of width
  // 2^-lut_log2; cell i = floor(v * 2^lut_log2) + lut_origin.  Each cell holds at
  // most one threshold (checked when built), so
  //     code_of(v) = lut_base[i] + (v >= lut_next[i]).
  int lut_log2;
  int lut_origin;                 // 0, or 2^lut_log2 for the signed domain
  std::vector<int32_t> lut_base;  // #{k : T[k] <= start of cell i}
  std::vector<float> lut_next;    // T[lut_base[i]], or +inf
  // The same lookup in a form for SIMD gathers that stays in L1 (codec/fast_avx2.cc):
  // lut_base as bytes (sign-magnitude codebooks: counts <= 127), padded by 3
  // so that 4-byte gathers stay inside, and the thresholds with +inf at 127:
  //     code_of(v) = lut_base8[i] + (v >= thresholds_inf[lut_base8[i]]).
  std::vector<uint8_t> lut_base8;
  float thresholds_inf[128];

  /** The threshold count of a normalised value z in [-1, 1] (CODE_LUT's definition). */
  uint8_t encode_threshold(float z) const;

  /** The code scale s of a (chunk, channel) with half-range d. */
  float scale(float d) const { return code_scale(d, scale_num); }

  /** What codec_math.h quantize() needs; valid while the codebook lives. */
  CodeSpec spec() const {
    return CodeSpec{kind,     scale_num, bias, max_code, lut_base.data(), lut_next.data(),
                    lut_log2, lut_origin};
  }

  /**
   * The definition: the code of x in a (chunk, channel) with offset m and
   * code scale s = scale(d).  CODE_LUT counts thresholds here
   * (encode_threshold); quantize() reaches the same code by the lookup.
   */
  uint8_t encode(float x, float m, float s) const {
    if (kind == CODE_LUT) return encode_threshold(f_mul(f_sub(x, m), s));
    return quantize(spec(), x, m, s);
  }

  /** The code of a normalised value z (m = 0, d = 1): encode(z, 0, scale(1)). */
  uint8_t encode_z(float z) const { return encode(z, 0.0f, scale(1.0f)); }

  /** encode() by the fast lookup (codec_math.h quantize): the same code. */
  uint8_t encode_fast(float x, float m, float s) const { return quantize(spec(), x, m, s); }
};

/** Shared ownership: a codebook lives while a caller holds it or the cache keeps it. */
using CodebookRef = std::shared_ptr<const Codebook>;

/** Most codebooks the process-wide cache keeps (the oldest is dropped first). */
constexpr size_t kCodebookCacheSize = 64;

/**
 * Returns the codebook for (codec, alpha, anchor_bits), built on first use.
 * Thread-safe.  The cache holds at most kCodebookCacheSize entries, so a peer
 * that sends pages with ever-new alphas cannot grow memory without bound; a
 * dropped codebook is freed when its last user releases it.  Returns nullptr
 * with *why set for an invalid combination or for BF16 (no codebook).
 */
CodebookRef get_codebook(kvxfer_codec_t codec, float alpha, int anchor_bits, std::string* why);

/**
 * True if pages of (codec, alpha, bits) carry a per-page anchor table
 * (docs/FORMAT.md 2.4): the split codecs (LYNX, INT8 with code_bits >
 * anchor_bits), except LYNX alpha = 0 at 4+4, whose anchor is INT4's code and
 * reconstructs at INT4's levels.  INT4 (anchor only) keeps its levels.  The
 * one rule for the encoders, the decoders and the payload sizes.
 */
inline bool carries_anchor_table(kvxfer_codec_t codec, float alpha, int code_bits,
                                 int anchor_bits) {
  return code_bits > anchor_bits &&
         !(codec == KVXFER_CODEC_LYNX && alpha == 0.0f && anchor_bits == 4);
}
inline bool has_anchor_table(const Codebook& cb) {
  return carries_anchor_table(cb.codec, cb.alpha, cb.code_bits, cb.anchor_bits);
}

/**
 * The per-page anchor reconstruction table (docs/FORMAT.md section 2.4): the
 * value of anchor a is the mean of the full-precision values of the page's
 * elements whose anchor is a,
 *     table[a] = sum_{c : c >> R == a} hist[c] * recon_full[c] / sum hist[c],
 * or the bin centre recon_anchor[a] when no element has anchor a.  `hist` is
 * the page's histogram of full codes (integers: independent of the order in
 * which threads or GPU blocks count them); the sums run in ascending code
 * order in double, so every path computes the same float.  The result is
 * clamped to the anchor's bin.
 */
void anchor_table_from_histogram(const Codebook& cb, const uint64_t* hist, float* table);

/** True if every entry is finite and inside its anchor's bin (decoder check). */
bool anchor_table_valid(const Codebook& cb, const float* table);

/** Valid ranges, shared by config validation and header parsing. */
constexpr float kMaxAlpha = 1000.0f;
bool valid_chunk_tokens(int c);

}  // namespace kvxfer::codec
