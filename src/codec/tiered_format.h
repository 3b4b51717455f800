// SpectrumKV pages (codec SPECTRUM): every token of a page has its own
// precision tier (kvxfer_tier_t), recorded in a per-token precision map in the
// anchor section (docs/FORMAT.md section 6, "SpectrumKV pages").
//
//   FP16: the value rounded to binary16 (saturated at +-65504); the anchor
//         carries the high byte (sign, exponent, 2 mantissa bits: an E5M2
//         value), the residual the low byte.
//   INT8: the INT8 codec's code (uniform asymmetric, codebook.h) on the
//         page's per-(chunk, channel) affine metadata, split A / 8 - A.
//   INT4: the INT4 codec's code on the same metadata, all in the anchor.
//   DROP: nothing is sent; decodes to +0 at every precision.
// The metadata of a (chunk, channel) is taken over its INT8 and INT4 tokens
// only (FP16 and DROP tokens excluded), with the binary16 / binary32 rule of
// the other codecs (codec_math.h, chunk_affine).
//
// This file only lays out and checks the format; the quantizers are the
// existing codebooks and the element math is codec_math.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "codec/codec_math.h"
#include "codec/format.h"
#include "codec/page.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {

/**
 * Byte offsets of every part of a SpectrumKV page's two payloads
 * (docs/FORMAT.md 6.3), from the header fields and tier counts of `h`, which
 * must be valid.  Bit-packed parts hold the fields of the k-th token of their
 * tier (ascending t) at elements k*H + c, LSB-first, as in section 4.2.
 */
struct SpectrumParts {
  // anchor payload
  uint64_t map;          // precision map: 2 bits per token, LSB-first, zero padding
  uint64_t meta;         // [chunk][channel]{m, d} (quantized pages only)
  uint64_t fp16_high;    // n_fp16 * H bytes; RAW pages: the raw values of non-DROP tokens
  uint64_t int8_anchor;  // n_int8 * H fields of A bits
  uint64_t int4_codes;   // n_int4 * H fields of 4 bits
  uint64_t table;        // 2^A float32: the INT8 tier's anchor table (docs/FORMAT.md 2.4)
  // residual payload
  uint64_t fp16_low;       // n_fp16 * H bytes
  uint64_t int8_residual;  // n_int8 * H fields of 8 - A bits
};
SpectrumParts spectrum_parts(const PageHeader& h);

/**
 * The FP16 tier's value: x rounded to binary16 (nearest, ties to even), with
 * an overflow saturated to the largest finite binary16 (+-65504) instead of
 * infinity (docs/FORMAT.md 6.2).  x must be finite.  *saturated is set (never
 * cleared) when that happened.
 */
KVXFER_HD inline uint16_t fp16_tier_bits(float x, bool* saturated) {
  uint16_t b = f32_to_f16(x);
  if ((b & 0x7C00u) == 0x7C00u) {
    *saturated = true;
    b = static_cast<uint16_t>((b & 0x8000u) | 0x7BFFu);
  }
  return b;
}

/**
 * Anchor-only value of an FP16-tier element from its high byte `hi` (an
 * exponent field below 31, which the decoder checks): the midpoint of the
 * smallest and largest of the 256 binary16 values sharing that high byte,
 *     (f16(hi << 8) + f16(hi << 8 | 0xFF)) / 2,
 * exact in binary32.  Its error is at most 127.5 units in the last place of
 * binary16 in that binade (docs/FORMAT.md 6.2).
 */
KVXFER_HD inline float fp16_anchor_value(uint8_t hi) {
  const uint16_t base = static_cast<uint16_t>(hi) << 8;
  return f_mul(f_add(f16_to_f32(base), f16_to_f32(static_cast<uint16_t>(base | 0xFFu))), 0.5f);
}

/**
 * The SpectrumKV checks of plan_decode, before anything is written
 * (docs/FORMAT.md 6.4): every metadata pair of a chunk with INT8/INT4 tokens
 * finite with d >= 0, every other pair {+0, +0}; the anchor table inside its
 * bins; no FP16 high byte with an all-ones exponent.  Sets plan->cb (the INT8
 * tier's codebook) and plan->table.  Errors: CORRUPT.
 */
kvxfer_result_t plan_spectrum(DecodePlan* plan);

/**
 * Decodes a planned SpectrumKV page into `dst`.  Chunks in parallel on
 * `threads` OpenMP threads (0: one per core) when every token's fields start
 * on a byte boundary of its stream (H * A, H * (8 - A) and H * 4 multiples of
 * 8), else one thread; the values are the same either way.
 */
void decode_spectrum(const DecodePlan& plan, const Layout& dst, int threads);

}  // namespace kvxfer::codec
