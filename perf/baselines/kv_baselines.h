// External KV-cache quantization baselines for perf/codec_quality and
// tests/quality_test.  These are NOT kvxfer codecs: they have no wire format,
// no anchor/residual split and no fast path.  They are plain reference code
// that quantizes a page and reconstructs it, so that the kvxfer codecs can be
// compared with the strongest published schemes at the same bits.
//
// Every baseline is uniform asymmetric (min/max) quantization of a *group* of
// elements with b-bit codes and an fp16 scale and fp16 zero point (the group
// minimum) per group, as in KIVI:
//     Z. Liu, J. Yuan, H. Jin, S. Zhong, Z. Xu, V. Braverman, B. Chen, X. Hu,
//     "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
//     ICML 2024, arXiv:2402.02750.
// Quantizer of one group (KIVI's fake-quant, Algorithm/Listing in the paper
// and its reference code):
//     scale = (max - min) / (2^b - 1)
//     q     = clamp(round((x - min) / scale), 0, 2^b - 1)     round: half to even
//     x_hat = q * scale + min
// Deviation, for exact storage: min and scale are stored as binary16, so we
// round min DOWN and scale UP to binary16 (min_h <= min, min_h + (2^b-1)
// scale_h >= max), and quantize against the stored values.  The error per
// element is then at most scale_h / 2 (plus float rounding, see
// error_bound()), and what is reconstructed is exactly what the stored
// (codes, min_h, scale_h) give.  A group with max == min gets scale 0 and
// code 0.  Inputs must be finite and within the binary16 range (|x| < 65504);
// quantize_page() fails otherwise.
//
// Named baselines (group layouts):
//   * INT8 / INT4 per token: 8- or 4-bit codes, one group per token row (all
//     H channels) -- the common "per-token" KV quantizer without channel
//     grouping (INT4 per token is included to show what an ungrouped 4-bit
//     quantizer does with outlier key channels).
//   * KIVI-style INT4 / INT2: keys per channel (groups of `group` = 32
//     consecutive tokens of one channel), values per token (groups of 32
//     consecutive channels of one token).  KIVI additionally keeps the most
//     recent R tokens (R = 32..128) in full precision; in a KV *transfer*
//     every token must be sent, so that window is not modelled here.
//
// Storage (bits on the wire), the documented formula:
//     bits = T * H * b + 32 * (number of groups)        (fp16 scale + fp16 zero)
// Groups at the end of an axis that is not a multiple of `group` are shorter
// and still pay 32 bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvxfer::baselines {

/** How a page [T][H] (row-major, token-major) is cut into groups. */
enum class GroupAxis {
  kPerToken,    // a group = `group` consecutive channels of one token
  kPerChannel,  // a group = `group` consecutive tokens of one channel
};

/** Stored parameters of one group; both are binary16 values. */
struct GroupParams {
  float min = 0.0f;    // zero point, rounded down to binary16
  float scale = 0.0f;  // step, rounded up to binary16; 0 for a constant group
};

/** Parameters of a group with finite extremes mn <= mx, for b-bit codes. */
GroupParams group_params(float mn, float mx, int bits);

/** Code of x (0 .. 2^b - 1) against stored parameters. */
unsigned quantize(float x, const GroupParams& p, int bits);

/** Reconstruction q * scale + min (two float roundings, never fused). */
inline float dequantize(unsigned q, const GroupParams& p) {
  const float t = static_cast<float>(q) * p.scale;
  return t + p.min;
}

/**
 * Guaranteed bound of |x - x_hat| for an element x of a group with
 * parameters p:  scale * (1/2 + (L+1) 2^-23) + 2^-23 * (|min| + |x_hat|),
 * L = 2^b - 1; the extra terms cover the float roundings of (x - min)/scale
 * and of q*scale + min.
 */
double error_bound(const GroupParams& p, int bits, float x_hat);

/** One quantized page. */
struct QuantizedPage {
  std::vector<std::uint8_t> codes;  // [T][H], one code per element
  std::vector<GroupParams> params;  // per group, see group_index()
  std::vector<float> recon;         // [T][H] reconstruction
};

/** Number of groups of a [T][H] page. */
std::int64_t num_groups(std::int64_t T, int H, GroupAxis axis, int group);

/** Index of the group of element (t, h). */
std::int64_t group_index(std::int64_t t, int h, std::int64_t T, int H, GroupAxis axis, int group);

/** Bits on the wire of a [T][H] page: T*H*bits + 32 * num_groups. */
double storage_bits(std::int64_t T, int H, GroupAxis axis, int group, int bits);

/**
 * Quantizes x ([T][H], row-major, rows `stride` floats apart, stride >= H)
 * with `bits`-bit codes (1..8) in groups of `group` (>= 1) along `axis`.
 * Returns false with *error for bad arguments or non-finite / out-of-binary16
 * input.
 */
bool quantize_page(const float* x, std::int64_t T, int H, std::size_t stride, GroupAxis axis,
                   int group, int bits, QuantizedPage* out, std::string* error);

// ---------------------------------------------------------------------------
// The named baselines used by perf/codec_quality.
// ---------------------------------------------------------------------------
enum class Baseline { kInt8PerToken, kInt4PerToken, kKiviInt4, kKiviInt2 };

constexpr int kKiviGroup = 32;

const char* baseline_name(Baseline b);

/** Code bits of a baseline (8, 4, 4, 2). */
int baseline_bits(Baseline b);

/** The group layout a baseline uses for keys (is_key) or values. */
void baseline_layout(Baseline b, bool is_key, int H, GroupAxis* axis, int* group);

}  // namespace kvxfer::baselines
