// Pieces of the page codec below every PageCodec (codec/page_codec.h), shared
// by the uniform codecs (codec/uniform_codec.cc, their reference and fast CPU
// paths), the SpectrumKV codec (codec/tiered_format.cc) and, through the same
// definitions, the CUDA kernels: dtype conversions, the page layout, the
// per-(chunk, channel) affine normalisation, the bit stream, and the checks
// of a received page that do not depend on its codec.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "codec/codebook.h"
#include "codec/codec.h"
#include "codec/codec_math.h"
#include "codec/format.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {

class PageCodec;

// Exact dtype conversions (f32_bits, bits_f32, bf16_to_f32, f32_to_bf16,
// f16_to_f32, f32_to_f16, f32_to_f16_up), Affine, canonical_minmax,
// chunk_affine, code_scale, quantize, recon_linear, denormalise and the LUT encode live in
// codec/codec_math.h, shared with the CUDA kernels (kernels/).

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
      const uint16_t h = f32_to_f16_sat(v);
      std::memcpy(row + 2 * i, &h, 2);
      break;
    }
    default: std::memcpy(row + 4 * i, &v, 4);
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

/**
 * Validates every field of a layout and that each row address is computable
 * without overflow; `what` names it in the message ("source", "destination").
 * Does not dereference the block table (device layouts hold device pointers).
 */
kvxfer_result_t validate_layout_shape(const kvxfer_page_layout_t* l, const char* what);

/** validate_layout_shape, then that every referenced host block is non-NULL. */
kvxfer_result_t validate_layout(const kvxfer_page_layout_t* l, const char* what, Layout* out);

/**
 * The block of layout `l` (validated by validate_layout_shape) holding the
 * first row of the page that shares a byte with [p, p + n), or -1 when none
 * does.  A row is its H elements, not the gap to the next row.  Compares the
 * block pointers, never reads the blocks.  Cost: one step per block of the page.
 */
int64_t block_meeting(const kvxfer_page_layout_t* l, const void* p, size_t n);

/** True when [a, a + an) and [b, b + bn) share a byte. */
bool ranges_meet(const void* a, size_t an, const void* b, size_t bn);

/**
 * The header max_sizes starts from: a V page of T x H at token 0 (the most
 * sink rows) from an fp32 source, channel groups.  Its codec may widen it
 * (PageCodec::widen_max_header).
 */
PageHeader max_header(const kvxfer_codec_config_t& cfg, int64_t T, int32_t H);

/**
 * max_sizes of a validated config over `h` (max_header, widened): the
 * largest sections of any page of its shape.
 */
void max_section_bytes(const kvxfer_codec_config_t& cfg, PageHeader h, size_t* anchor_bytes,
                       size_t* residual_bytes);

/** Header fields of a page before any data is seen (flags, sizes and checksums later). */
PageHeader make_header(const kvxfer_codec_config_t& cfg, const kvxfer_page_id_t& id, int64_t T,
                       int32_t H, kvxfer_dtype_t src_dtype);

/** Threads of a codec call: `threads` if > 0, else KVXFER_CODEC_THREADS, else
 *  0 (the OpenMP default, one per core). */
int effective_threads(int threads);

/**
 * KVXFER_ERR_BUFFER_TOO_SMALL unless the caller's section buffers (bytes,
 * header included) hold the page that header `h` describes.
 */
kvxfer_result_t check_section_caps(const PageHeader& h, size_t anchor_cap, size_t residual_cap);

/** True if a row of H values of `dt` holds a NaN or Inf (tested on the exponent bits). */
bool row_has_nonfinite(const uint8_t* row, int32_t H, kvxfer_dtype_t dt);

/** KVXFER_ERR_NONFINITE naming the element: "NaN at layer 6 K, token 241, channel 7". */
kvxfer_result_t nonfinite_error(const kvxfer_page_id_t& id, int64_t t, int32_t c, bool is_nan);

/**
 * The documented per-element error bound (docs/FORMAT.md, "Error bound"):
 *     |x - x_hat| <= d * (w + 2^-21) + 2^-23 * |m| + rho(dtype) * |x_hat| + sigma(dtype)
 * w is the largest half bin width W/2 of the full codes, or for anchor-only
 * decoding the largest anchor bin width W (per-page table) or W/2 (INT4);
 * 2^-21 d + 2^-23 |m| covers the float roundings of normalise/denormalise;
 * rho, sigma cover rounding the output to the destination dtype (bf16 2^-8,
 * 1e-38; fp16 2^-11, 2^-25; fp32 0, 0).
 */
inline double error_bound(const Codebook& cb, bool full, const Affine& a, kvxfer_dtype_t out,
                          double xhat) {
  // Anchor values from a per-page table lie anywhere inside their bin: the
  // whole width W, not W/2, bounds them.
  const double hw =
      full ? cb.max_half_width_full : (has_anchor_table(cb) ? 2.0 : 1.0) * cb.max_half_width_anchor;
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

/** Little-endian float32 (the anchor table's wire encoding). */
inline void put_f32_le(uint8_t* p, float v) {
  const uint32_t u = f32_bits(v);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(u >> (8 * i));
}
inline float get_f32_le(const uint8_t* p) {
  uint32_t u = 0;
  for (int i = 0; i < 4; ++i) u |= static_cast<uint32_t>(p[i]) << (8 * i);
  return bits_f32(u);
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
  uint8_t* meta;       // anchor payload start
  uint8_t* anchors;    // after metadata
  uint8_t* residuals;  // residual payload start (may be unused)
  uint64_t* hist;      // [256] zeroed; the encoder adds the full codes of the rows hist_row() picks
};

enum class EncodeStatus { OK, NEED_FP32, NONFINITE };

struct DecodeJob {
  const Codebook* cb;
  const PageHeader* hdr;
  Layout dst;
  bool meta_fp32;
  const uint8_t* meta;
  const uint8_t* anchors;
  const uint8_t* residuals;   // nullptr: anchor-only
  const float* anchor_table;  // anchor-only values: the page's table, or cb->recon_anchor
};

/**
 * What decoding a page needs, established by plan_decode before anything is
 * written: the parsed anchor header, payload sizes and pointers (host
 * memory), and for quantized pages the codebook and the validated anchor table.
 */
struct DecodePlan {
  PageHeader anchor;
  const PageCodec* codec = nullptr;  // the anchor header's codec (page_codec)
  PayloadSizes sizes;
  const uint8_t* payload = nullptr;           // anchor payload
  const uint8_t* residual_payload = nullptr;  // nullptr: anchor-only
  CodebookRef cb;                             // nullptr: raw fallback or BF16
  bool has_table = false;
  float table[64];
  /** Anchor-only reconstruction values: the page's table, or the bin centres. */
  const float* anchor_values() const { return has_table ? table : cb->recon_anchor; }
};

/**
 * The checks of plan_decode that every codec shares: both sections parsed
 * and checksummed, their pairing, the expected identity and the destination's
 * shape against the page (not its blocks).  Sets plan->anchor, sizes and the
 * payload pointers; plan->codec and the codec's own checks are the caller's.
 * threads != 1 verifies the two checksums of a page of 1 MiB or more on two
 * threads.
 */
kvxfer_result_t plan_sections(const void* anchor, size_t anchor_len, const void* residual,
                              size_t residual_len, const kvxfer_page_id_t* expect,
                              const kvxfer_page_layout_t* dst, DecodePlan* plan, int threads = 1);
namespace reference {
/** Plain-loop encoder of quantized pages: the definition of the bytes. */
EncodeStatus encode(const EncodeJob& job);
/** Plain-loop decoder (metadata already validated). */
void decode(const DecodeJob& job);
}  // namespace reference

namespace fast {
/**
 * Same bytes as reference::encode, SIMD and threads.  `impl` SCALAR, AVX2 or
 * AVX512 (resolved: the CPU has it).
 */
EncodeStatus encode(const EncodeJob& job, Impl impl, int threads);
/** Same values as reference::decode; `impl` as for encode. */
void decode(const DecodeJob& job, Impl impl, int threads);
/** True if this CPU can run the AVX2 path (AVX2 + F16C). */
bool cpu_has_avx2();
/**
 * True if this CPU can run the AVX-512 path (codec/fast_avx512.cc): AVX-512
 * F, BW, VL and DQ, and what the AVX2 path needs.
 */
bool cpu_has_avx512();
/**
 * The BF16 passthrough of one bf16 row (fast_avx2.cc; only if cpu_has_avx2()):
 * copies H values (2*H bytes) from src to dst, which must not overlap, and
 * returns whether any is NaN or Inf (exponent bits all set), as
 * row_has_nonfinite does, in the same pass.
 */
bool copy_row_bf16_scanning_avx2(uint8_t* dst, const uint8_t* src, int32_t H);
/**
 * Whether any of `entries` binary16 metadata pairs {m, d} at `meta` is
 * invalid: m or d infinite or NaN, or d negative (fast_avx512.cc; only if
 * cpu_has_avx512()).  The decoder's check of every entry before it writes.
 */
bool any_bad_fp16_meta_avx512(const uint8_t* meta, int64_t entries);
}  // namespace fast

/**
 * Finds the first non-finite element of a page (token-major order) for the
 * error message.  Returns false if none.
 */
bool find_nonfinite(const Layout& src, int64_t T, int32_t H, int64_t* t, int32_t* h, float* v);

}  // namespace kvxfer::codec
