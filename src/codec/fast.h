// Row kernels of the fast CPU path.  One table per instruction set; the
// driver (codec/fast.cc) splits a page into chunks over threads and calls
// them chunk by chunk and row by row, while the chunk is in cache.  Each
// kernel computes exactly the operations of the reference
// (codec/reference.cc, codec_math.h quantize / denormalise) per element.
#pragma once

#include <cstdint>

#include "codec/page.h"

namespace kvxfer::codec::fast {

/** What decode_row reconstructs an index to (before denormalise). */
struct Values {
  const float* table;  // index -> z value (recon_full, the page's anchor table, recon_anchor)
  int entries;         // size of `table` (16 for the 4-bit anchors, 256 for full codes)
  int linear_kind;     // CODE_NEST / CODE_UNIFORM: table[i] == recon_linear(kind, i, step)
                       // (full codes of the linear codebooks); CODE_LUT: none
  float step;          // Codebook::recon_step
  bool clamp;          // clamp to +-FLT_MAX, or +-65504 into an FP16 row (f32_to_f16_sat):
                       // fp32 metadata, or a chunk f16_chunk_may_saturate finds (binary16
                       // metadata cannot overflow binary32)
  bool tiny;           // some table[i] != 0 has |table[i]| < 2^-79: with binary16 metadata,
                       // fma(d, z, m) may then be subnormal (else it is 0 or >= 2^-126)
  bool stream;         // decode_row_nibbles may write with non-temporal stores (a page too
                       // large to stay in cache); the caller fences them (SFENCE)
};

struct RowKernels {
  /**
   * Per-channel min and max of rows[0..n) (n >= 1) of H values of dtype dt,
   * as the reference's "if (x < mn) mn = x" scan up to the sign of zeros
   * (callers canonicalise).  Returns false if any value is NaN or Inf.
   */
  bool (*chunk_minmax)(const uint8_t* const* rows, int n, kvxfer_dtype_t dt, int32_t H, float* mn,
                       float* mx);
  /**
   * The metadata of one chunk from its per-channel min/max (mn, mx are
   * canonicalised in place): chunk_affine of every channel, the entries
   * written at `meta` (binary16 pairs, or binary32 when fp32), and m[c],
   * d[c] and the code scale s[c] = code_scale(d[c], num).  Returns false if
   * some entry does not fit binary16 (the page must use fp32 metadata).
   */
  bool (*chunk_meta)(float* mn, float* mx, int32_t H, bool fp32, float num, uint8_t* meta, float* m,
                     float* d, float* s);
  /** m[c], d[c] of the H metadata entries at `meta` (get_affine). */
  void (*load_meta)(const uint8_t* meta, int32_t H, bool fp32, float* m, float* d);
  /** Codes of one row: codes[c] = quantize(cb.spec(), x[c], m[c], s[c]). */
  void (*encode_row)(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                     const float* s, const Codebook& cb, uint8_t* codes);
  /**
   * Arranges a chunk's m and s (channel order) into pm, ps for
   * encode_row_nibbles of cb's codes, in whatever order its vectors read them.
   */
  void (*encode_params)(const float* m, const float* s, int32_t H, kvxfer_dtype_t dt,
                        const Codebook& cb, float* pm, float* ps);
  /**
   * encode_row on encode_params' arrays, then the 4-bit fields of docs/FORMAT.md 4.2 (even element
   * in the low nibble): anchors (code >> 4) at pa and, when pr is non-NULL, residuals (code & 15)
   * at pr; for 4-bit codes (INT4) pr is NULL and pa gets the codes.  `codes` (may be NULL) also
   * receives the codes.  H even.
   */
  void (*encode_row_nibbles)(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                             const float* s, const Codebook& cb, uint8_t* pa, uint8_t* pr,
                             uint8_t* codes);
  /**
   * The squared errors of one row for alpha calibration (codec/calibrate.cc):
   * for every channel c with ok[c], e = double(denormalise(full[code[c]])) -
   * double(x[c]) and likewise with anchor[code[c] >> R]; e * e is added to
   * lane c % 8 of acc_full / acc_anchor.  Each lane adds in channel order,
   * so every path returns the same doubles.
   */
  void (*row_sq_errors)(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const uint8_t* codes,
                        const float* m, const float* d, const uint8_t* ok, const float* full,
                        const float* anchor, unsigned R, double* acc_full, double* acc_anchor);
  /** Values of one row: x[c] = denormalise(v.table[idx[c]], {m[c], d[c]}) in dtype dt. */
  void (*decode_row)(const uint8_t* idx, int32_t H, const float* m, const float* d, const Values& v,
                     kvxfer_dtype_t dt, uint8_t* row);
  /**
   * load_meta for decode_row_nibbles: m and d of the H entries at `meta`, in
   * whatever order its vectors read them for the values `v` and full codes
   * (`full`) or anchors.  NULL where decode_row_nibbles is.
   */
  void (*decode_params)(const uint8_t* meta, int32_t H, bool fp32, const Values& v, bool full,
                        float* pm, float* pd);
  /**
   * decode_row straight from the 4-bit fields of one row (docs/FORMAT.md 4.2,
   * even element in the low nibble): idx[c] = anchor (pr NULL) or anchor << 4
   * | residual, on decode_params' arrays, without an index array.  H even.
   * NULL: the driver unpacks the fields and calls decode_row.
   */
  void (*decode_row_nibbles)(const uint8_t* pa, const uint8_t* pr, int32_t H, const float* pm,
                             const float* pd, const Values& v, kvxfer_dtype_t dt, uint8_t* row);
  /**
   * encode_row_nibbles that also asks for the H values at `next` (a row of
   * the next chunk; NULL: none) to be brought into cache, a line per vector
   * as it goes rather than all at once (a hint: it changes no result), and
   * counts the H codes at `count` (NULL: none; another row's, not `codes`)
   * into `bins`, four interleaved tables of 256 uint32 (fast.cc's
   * CodeHistogram, whose room the caller reserves): table j is bins +
   * 256 * j.  NULL: not offered, the driver prefetches the row before the
   * call and counts the codes after it.
   */
  void (*encode_row_nibbles_ahead)(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                                   const float* s, const Codebook& cb, uint8_t* pa, uint8_t* pr,
                                   uint8_t* codes, const uint8_t* next, const uint8_t* count,
                                   uint32_t* bins);
};

/**
 * Counts the 8 codes of `v` (its bytes, lowest first) into four interleaved
 * tables of 256 uint32, table j at bins + 256 * j, two codes per table: the
 * layout of fast.cc's CodeHistogram and of encode_row_nibbles_ahead's
 * `bins`.  static: each file keeps its own copy, compiled with its own
 * target flags (the AVX-512 file's must not stand in for the baseline's).
 */
static inline void count8(uint64_t v, uint32_t* bins) {
  ++bins[v & 0xff];
  ++bins[256 + ((v >> 8) & 0xff)];
  ++bins[512 + ((v >> 16) & 0xff)];
  ++bins[768 + ((v >> 24) & 0xff)];
  ++bins[(v >> 32) & 0xff];
  ++bins[256 + ((v >> 40) & 0xff)];
  ++bins[512 + ((v >> 48) & 0xff)];
  ++bins[768 + (v >> 56)];
}

const RowKernels& scalar_kernels();
/**
 * The scalar min/max of channels [from, H) over rows[0..n): mn[j], mx[j]
 * for j in [from, H), in the reference's order.  False if an element is
 * NaN or Inf.  Defined once in fast.cc (baseline flags): the SIMD paths call
 * it for the channels their vectors do not cover.
 */
bool minmax_channels_scalar(const uint8_t* const* rows, int n, kvxfer_dtype_t dt, int32_t from,
                            int32_t H, float* mn, float* mx);
/** Defined in fast_avx2.cc, compiled with -mavx2 -mf16c -mfma; call only if cpu_has_avx2(). */
const RowKernels& avx2_kernels();
/**
 * Defined in fast_avx512.cc, compiled with -mavx512f -mavx512bw -mavx512vl
 * -mavx512dq -mavx2 -mf16c -mfma; call only if cpu_has_avx512().  Kernels it
 * does not specialise are the AVX2 ones.
 */
const RowKernels& avx512_kernels();
/**
 * True if this CPU has AVX512_BF16 besides cpu_has_avx512(): the AVX-512
 * decode then rounds to bfloat16 with VCVTNE2PS2BF16 where no result can be
 * subnormal (the instruction flushes those to zero).
 */
bool cpu_has_avx512_bf16();
/** The row kernels of a resolved path: SCALAR, AVX2 or AVX512. */
const RowKernels& kernels_for(Impl impl);

/**
 * Decoded pages with at least this many bytes of values are written with
 * non-temporal stores where the path has them (Values::stream, and the
 * passthrough copy below): a page that size is not read back soon (the
 * engine's 512 KiB pages land in a KV of many pages), and streaming saves
 * the read for ownership of every destination line.  BF16 passthrough over
 * shm, 64 MiB: 0.775 of fi_pingpong against 0.715 with cached stores
 * (median of 6 interleaved rounds).
 */
constexpr uint64_t kStreamStoreBytes = uint64_t{256} << 10;
/**
 * Copies `bytes` (a multiple of 64) from `src` to the 64-byte aligned `dst`
 * with non-temporal stores.  Defined in fast_avx512.cc; call only if
 * cpu_has_avx512(), and stream_fence() before the data counts as written.
 */
void stream_copy_avx512(uint8_t* dst, const uint8_t* src, size_t bytes);
/** Orders this thread's non-temporal stores before what follows (SFENCE). */
void stream_fence();

}  // namespace kvxfer::codec::fast
