// CUDA kernels of the page codec (docs/GPU.md).  They reproduce the bytes of
// codec/reference.cc: the same element math (codec/codec_math.h, compiled for
// the device), the same float tables (uploaded verbatim), the same bit layout
// (docs/FORMAT.md section 4.2).
//
// Encode, two mappings:
//  - fused (the usual case, H*A and H*R multiples of 8, e.g. any H % 8 == 0):
//    one block per (chunk, 256 channels).  Pass 1: one thread per channel
//    scans the chunk's rows for min/max (x < mn, x > mx, then canonical +0,
//    as the reference), computes chunk_affine and writes the metadata entry.
//    Pass 2: each thread takes an octet (8 consecutive channels of one row),
//    computes 8 codes with the LUT and writes A anchor bytes and R residual
//    bytes.  Because every row and every octet starts on a byte boundary of
//    both bit streams, no two threads share a byte.
//  - general (any H): kernel 1 is pass 1 over (chunk, channel); kernel 2 gives
//    each thread 8 consecutive elements of the token-major stream (they may
//    span rows and chunks), which are exactly A anchor bytes and R residual
//    bytes; metadata comes back from the payload just written.  The rows a
//    block touches (row pointer, metadata base) sit in a shared table filled
//    once per row, so no element divides by H or C.
// Both encoders count the page's full codes (shared-memory histogram per
// block, merged with 64-bit atomics: integer sums, independent of order); one
// more block then computes the per-page anchor table of the split codecs
// (FORMAT.md 2.4) with codec::anchor_table_entry and writes it last in the
// anchor payload.
// Decode: row by row, one thread per octet (8 consecutive channels) of a row,
// the row pointer and metadata base computed once per row; codes are read at
// their bit offset (any H), and the 8 values go out as one 16-byte store when
// the address is 16-byte aligned (checked at run time; narrower stores
// otherwise).  The anchor-only values of the split codecs come from the
// page's anchor table.
// Loads and stores of elements pick their width from the address at run
// time (load_x8, store_x8): the bytes never depend on it.
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "kernels/codec_kernels.cuh"

namespace kvxfer::cuda {

using detail::KCodebook;
using detail::KLayout;

namespace {

constexpr int kGroup = 256;    // channels per block of the fused encoder (= threads)
constexpr int kThreads = 256;  // threads per block of the other kernels
constexpr int kMaxChunk = 128;

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

__global__ void k_reset_status(DeviceStatus* st) {
  if (threadIdx.x == 0) {
    st->flags = 0;
    st->reserved = 0;
    st->first_bad = ~0ull;
  }
  for (unsigned i = threadIdx.x; i < 256; i += blockDim.x) st->hist[i] = 0;
}

// Per-block histogram of full codes, merged into DeviceStatus::hist.  Integer
// counts: the sum does not depend on the order of blocks or threads.
__device__ __forceinline__ void hist_zero(unsigned int* sh) {
  for (unsigned i = threadIdx.x; i < 256; i += blockDim.x) sh[i] = 0;
}
__device__ __forceinline__ void hist_flush(const unsigned int* sh, DeviceStatus* st) {
  for (unsigned i = threadIdx.x; i < 256; i += blockDim.x)
    if (sh[i] != 0)
      atomicAdd(reinterpret_cast<unsigned long long*>(&st->hist[i]),
                static_cast<unsigned long long>(sh[i]));
}

/**
 * Pass 1 for one (chunk, channel): min/max, non-finite check, affine,
 * metadata.  Returns false (and reports) if the entry is unusable.
 */
template <int DT>
__device__ __forceinline__ bool chunk_channel_affine(const KLayout& L, const uint8_t* const* rows,
                                                     int64_t t0, int nrows, int rr0, int64_t k,
                                                     int64_t c, bool fp32, uint8_t* meta,
                                                     DeviceStatus* st, codec::Affine* out,
                                                     float* range_lo, float* range_hi) {
  // The range over rows rr0.. (the sink rows left out: codec_math.h range_row0).
  float mn = detail::load_x<DT>(rows[rr0], c), mx = mn;
  for (int r = 0; r < nrows; ++r) {
    const float x = detail::load_x<DT>(rows[r], c);
    if (codec::f32_nonfinite(x)) {
      detail::report_nonfinite(st, t0 + r, c, L.H, x);
      return false;
    }
    if (r < rr0) continue;
    if (x < mn) mn = x;
    if (x > mx) mx = x;
  }
  codec::canonical_minmax(&mn, &mx);
  *range_lo = mn;
  *range_hi = mx;
  codec::Affine a{0.0f, 0.0f};
  if (!codec::chunk_affine(mn, mx, fp32, &a)) {
    atomicOr(reinterpret_cast<unsigned int*>(&st->flags), STATUS_NEED_FP32);
    return false;
  }
  detail::put_meta(meta, k * L.H + c, fp32, a);
  *out = a;
  return true;
}

/** Fused encoder: block = (chunk blockIdx.x, channels [blockIdx.y*256, +256)). */
template <int DT>
__global__ void __launch_bounds__(kGroup)
    k_encode_fused(KLayout L, KCodebook cb, int C, int64_t sink_rows, int fp32,
                   uint8_t* __restrict__ meta, uint8_t* __restrict__ anchors,
                   uint8_t* __restrict__ residuals, DeviceStatus* st) {
  __shared__ const uint8_t* rows[kMaxChunk];
  __shared__ float sm[kGroup], sd[kGroup], slo[kGroup], shi[kGroup];
  __shared__ unsigned int hist[256];
  __shared__ int skip;
  const int64_t k = blockIdx.x;
  const int64_t t0 = k * C;
  const int nrows = static_cast<int>(detail::imin(C, L.T - t0));
  const int rr0 = static_cast<int>(codec::range_row0(t0, t0 + nrows, sink_rows) - t0);
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kGroup;
  const int ng = static_cast<int>(detail::imin(kGroup, L.H - c0));
  if (threadIdx.x == 0) skip = 0;
  for (int r = threadIdx.x; r < nrows; r += blockDim.x) rows[r] = detail::row_ptr(L, t0 + r);
  hist_zero(hist);
  __syncthreads();

  if (static_cast<int>(threadIdx.x) < ng) {
    codec::Affine a{0.0f, 0.0f};
    float lo = 0.0f, hi = 0.0f;
    if (!chunk_channel_affine<DT>(L, rows, t0, nrows, rr0, k, c0 + threadIdx.x, fp32 != 0, meta, st,
                                  &a, &lo, &hi))
      skip = 1;
    slo[threadIdx.x] = lo;
    shi[threadIdx.x] = hi;
    sm[threadIdx.x] = a.m;
    sd[threadIdx.x] = detail::code_scale(cb, a.d);  // the code scale s, not d
  }
  __syncthreads();
  if (skip) return;  // the host re-encodes (fp32 metadata) or reports the error

  const int A = cb.A, R = cb.R;
  const unsigned rmask = (1u << R) - 1u;
  const int noct = (ng + 7) / 8;
  const int items = nrows * noct;
  for (int i = threadIdx.x; i < items; i += blockDim.x) {
    const int r = i / noct, o = i - r * noct;
    const int cl = o * 8;
    const int n = ng - cl < 8 ? ng - cl : 8;
    const int64_t c = c0 + cl;
    const uint8_t* row = rows[r];
    float x[8];
    if (n == 8) {
      detail::load_x8<DT>(row, c, x);
    } else {
      for (int j = 0; j < n; ++j) x[j] = detail::load_x<DT>(row, c + j);
    }
    if (r < rr0)  // a sink row: its values clamped to the chunk's range
      for (int j = 0; j < n; ++j) x[j] = codec::clamp_to_range(x[j], slo[cl + j], shi[cl + j]);
    uint64_t acc_a = 0, acc_r = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < n) {
        const uint8_t code = detail::code_of(cb, x[j], sm[cl + j], sd[cl + j]);
        if (codec::hist_row(t0 + r, sink_rows)) atomicAdd(&hist[code], 1u);
        acc_a |= static_cast<uint64_t>(code >> R) << (j * A);
        acc_r |= static_cast<uint64_t>(code & rmask) << (j * R);
      }
    }
    // Element e = t*H + c starts on a byte boundary of both streams (H*A, H*R
    // and c*A, c*R are multiples of 8), and n*A, n*R are whole bytes too.
    const uint64_t e = static_cast<uint64_t>(t0 + r) * static_cast<uint64_t>(L.H) + c;
    detail::store_bytes(anchors + e * A / 8, acc_a, n * A / 8);
    if (R > 0) detail::store_bytes(residuals + e * R / 8, acc_r, n * R / 8);
  }
  __syncthreads();
  hist_flush(hist, st);
}

/** General encoder, kernel 1: metadata of (chunk blockIdx.x, channel). */
template <int DT>
__global__ void __launch_bounds__(kThreads)
    k_encode_meta(KLayout L, int C, int64_t sink_rows, int fp32, uint8_t* __restrict__ meta,
                  DeviceStatus* st) {
  __shared__ const uint8_t* rows[kMaxChunk];
  const int64_t k = blockIdx.x;
  const int64_t t0 = k * C;
  const int nrows = static_cast<int>(detail::imin(C, L.T - t0));
  const int rr0 = static_cast<int>(codec::range_row0(t0, t0 + nrows, sink_rows) - t0);
  for (int r = threadIdx.x; r < nrows; r += blockDim.x) rows[r] = detail::row_ptr(L, t0 + r);
  __syncthreads();
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= L.H) return;
  codec::Affine a;
  float lo, hi;
  chunk_channel_affine<DT>(L, rows, t0, nrows, rr0, k, c, fp32 != 0, meta, st, &a, &lo, &hi);
}

// Rows a block of k_encode_codes can touch in one round: its 8 * kThreads
// elements start anywhere in a row, so at most 8 * kThreads + 1 rows (H = 1).
constexpr int kSpanRows = 8 * kThreads + 1;

/**
 * General encoder, kernel 2: thread j encodes elements [8j, 8j+8) of the
 * token-major stream (A anchor bytes and R residual bytes of its own), which
 * may span rows and chunks.  Per round, thread 0 finds the row and channel of
 * the block's first element (one 64-bit division per 8 * kThreads elements)
 * and the block fills a shared table of the round's rows: row pointer and
 * metadata base (t / C) * H, once per row.  A thread then needs one 32-bit
 * division for its first row in the table and none per element; a full
 * octet inside one row is loaded with 16-byte loads where aligned (load_x8).
 */
template <int DT>
__global__ void __launch_bounds__(kThreads)
    k_encode_codes(KLayout L, KCodebook cb, int C, int64_t sink_rows, int fp32,
                   const uint8_t* __restrict__ meta, uint8_t* __restrict__ anchors,
                   uint8_t* __restrict__ residuals, DeviceStatus* st) {
  // Metadata may be missing (non-finite input, fp16 overflow): then the host
  // discards this attempt, and garbage metadata must not index the LUT.  The
  // flags were set by the previous kernel: the same value for every thread.
  if (*reinterpret_cast<const volatile uint32_t*>(&st->flags) &
      (STATUS_NEED_FP32 | STATUS_NONFINITE))
    return;
  __shared__ unsigned int hist[256];
  __shared__ const uint8_t* srow[kSpanRows];
  __shared__ int64_t smeta[kSpanRows];
  __shared__ int64_t s_t0;   // the round's first row
  __shared__ uint32_t s_c0;  // channel of the round's first element in it
  __shared__ int s_nrows;
  hist_zero(hist);
  const int A = cb.A, R = cb.R;
  const unsigned rmask = (1u << R) - 1u;
  const uint32_t H = static_cast<uint32_t>(L.H);
  const uint64_t total = static_cast<uint64_t>(L.T) * H;
  const uint64_t octets = (total + 7) / 8;
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  // The loop's trip count depends on blockIdx only: every thread meets the barriers.
  for (uint64_t jb = static_cast<uint64_t>(blockIdx.x) * blockDim.x; jb < octets; jb += step) {
    __syncthreads();  // the previous round is done with the table
    if (threadIdx.x == 0) {
      const uint64_t eb = jb * 8, ee = detail::umin(total, eb + 8ull * blockDim.x);
      const uint64_t t0 = eb / H;
      const uint32_t c0 = static_cast<uint32_t>(eb - t0 * H);
      s_t0 = static_cast<int64_t>(t0);
      s_c0 = c0;
      s_nrows = static_cast<int>((c0 + (ee - eb) - 1) / H + 1);
    }
    __syncthreads();
    const int64_t tb = s_t0;
    const int nrows = s_nrows;
    for (int r = threadIdx.x; r < nrows; r += blockDim.x) {
      srow[r] = detail::row_ptr(L, tb + r);
      smeta[r] = ((tb + r) / C) * static_cast<int64_t>(H);
    }
    __syncthreads();
    const uint64_t j = jb + threadIdx.x;
    if (j >= octets) continue;
    const int n = static_cast<int>(detail::umin(8, total - j * 8));
    // Offset of the thread's first element from the round's first row: below
    // H + 8 * kThreads, so 32 bits hold it.
    const uint32_t off = s_c0 + 8u * threadIdx.x;
    int r = static_cast<int>(off / H);
    uint32_t c = off - static_cast<uint32_t>(r) * H;
    float x[8] = {};  // indexed by constants only (unrolled loops): registers, not stack
    if (n == 8 && c + 8 <= H) {
      detail::load_x8<DT>(srow[r], c, x);
    } else {
      int rr = r;
      uint32_t cc = c;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (i < n) {
          x[i] = detail::load_x<DT>(srow[rr], cc);
          if (++cc == H) cc = 0, ++rr;
        }
      }
    }
    uint64_t acc_a = 0, acc_r = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (i >= n) break;
      const int64_t t = tb + r;
      const codec::Affine a = detail::get_meta(meta, smeta[r] + c, fp32 != 0);
      float xi = x[i];
      if (t < sink_rows) {  // a sink row: clamped to its chunk's range, if it has other rows
        const int64_t t0 = (t / C) * C, t1 = detail::imin(t0 + C, L.T);
        const int64_t r0 = codec::range_row0(t0, t1, sink_rows);
        if (t < r0) {
          float mn = detail::load_x<DT>(detail::row_ptr(L, r0), c), mx = mn;
          for (int64_t u = r0 + 1; u < t1; ++u) {
            const float y = detail::load_x<DT>(detail::row_ptr(L, u), c);
            if (y < mn) mn = y;
            if (y > mx) mx = y;
          }
          codec::canonical_minmax(&mn, &mx);
          xi = codec::clamp_to_range(xi, mn, mx);
        }
      }
      const uint8_t code = detail::code_of(cb, xi, a.m, detail::code_scale(cb, a.d));
      if (codec::hist_row(t, sink_rows)) atomicAdd(&hist[code], 1u);
      acc_a |= static_cast<uint64_t>(code >> R) << (i * A);
      acc_r |= static_cast<uint64_t>(code & rmask) << (i * R);
      if (++c == H) c = 0, ++r;
    }
    detail::store_bytes(anchors + j * A, acc_a, (n * A + 7) / 8);
    if (R > 0) detail::store_bytes(residuals + j * R, acc_r, (n * R + 7) / 8);
  }
  __syncthreads();
  hist_flush(hist, st);
}

/**
 * The per-page anchor table (split codecs), last in the anchor payload:
 * entry a by codec::anchor_table_entry from the merged histogram, written as
 * little-endian float32 (any alignment).  One block of 64 threads.
 */
__global__ void k_anchor_table(KCodebook cb, uint8_t* __restrict__ out, const DeviceStatus* st) {
  if (*reinterpret_cast<const volatile uint32_t*>(&st->flags) &
      (STATUS_NEED_FP32 | STATUS_NONFINITE))
    return;
  const unsigned a = threadIdx.x;
  if (a >= (1u << cb.A)) return;
  const float v = codec::anchor_table_entry(st->hist, cb.recon_full, cb.recon_anchor[a],
                                            cb.anchor_lo[a], cb.anchor_hi[a], a, cb.R);
  detail::store_bytes(out + 4 * a, codec::f32_bits(v), 4);
}

/** Finds non-finite elements (BF16 codec): grid-stride over rows, channels across threads. */
template <int DT>
__global__ void __launch_bounds__(kThreads) k_scan_nonfinite(KLayout L, DeviceStatus* st) {
  for (int64_t t = blockIdx.x; t < L.T; t += gridDim.x) {
    const uint8_t* row = detail::row_ptr(L, t);
    for (int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; c < L.H;
         c += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      const float x = detail::load_x<DT>(row, c);
      if (codec::f32_nonfinite(x)) detail::report_nonfinite(st, t, c, L.H, x);
    }
  }
}

/** Page -> T*H contiguous values: bit copy (ODT == DT) or round to ODT. */
template <int DT, int ODT>
__global__ void __launch_bounds__(kThreads) k_pack_values(KLayout L, uint8_t* __restrict__ out) {
  for (int64_t t = blockIdx.x; t < L.T; t += gridDim.x) {
    const uint8_t* row = detail::row_ptr(L, t);
    uint8_t* orow = out + static_cast<uint64_t>(t) * L.H * (ODT == KVXFER_DTYPE_FP32 ? 4 : 2);
    for (int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; c < L.H;
         c += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      if constexpr (DT == ODT) {
        if constexpr (DT == KVXFER_DTYPE_FP32)
          reinterpret_cast<uint32_t*>(orow)[c] = reinterpret_cast<const uint32_t*>(row)[c];
        else
          reinterpret_cast<uint16_t*>(orow)[c] = reinterpret_cast<const uint16_t*>(row)[c];
      } else {
        detail::store_x<ODT>(orow, c, detail::load_x<DT>(row, c));
      }
    }
  }
}

/** T*H contiguous values of SDT -> page of DT (bit copy when equal). */
template <int SDT, int DT>
__global__ void __launch_bounds__(kThreads)
    k_unpack_values(const uint8_t* __restrict__ in, KLayout L) {
  for (int64_t t = blockIdx.x; t < L.T; t += gridDim.x) {
    uint8_t* row = detail::row_ptr(L, t);
    const uint8_t* irow = in + static_cast<uint64_t>(t) * L.H * (SDT == KVXFER_DTYPE_FP32 ? 4 : 2);
    for (int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; c < L.H;
         c += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      if constexpr (SDT == DT) {
        if constexpr (DT == KVXFER_DTYPE_FP32)
          reinterpret_cast<uint32_t*>(row)[c] = reinterpret_cast<const uint32_t*>(irow)[c];
        else
          reinterpret_cast<uint16_t*>(row)[c] = reinterpret_cast<const uint16_t*>(irow)[c];
      } else {
        detail::store_x<DT>(row, c, detail::load_x<SDT>(irow, c));
      }
    }
  }
}

/** Decode, step 1: every metadata entry finite with d >= 0, else STATUS_BAD_META. */
__global__ void __launch_bounds__(kThreads)
    k_check_meta(const uint8_t* __restrict__ meta, uint64_t entries, int fp32, KCodebook cb,
                 const uint8_t* __restrict__ table, DeviceStatus* st) {
  bool bad = false;
  // The anchor table (split codecs): every entry finite and inside its
  // anchor's bin, as codec::anchor_table_valid.
  if (table != nullptr && blockIdx.x == 0 && threadIdx.x < (1u << cb.A)) {
    const unsigned a = threadIdx.x;
    const float v = codec::bits_f32(static_cast<uint32_t>(detail::load_bytes(table + 4 * a, 4)));
    if (!(v >= cb.anchor_lo[a] && v <= cb.anchor_hi[a])) bad = true;  // NaN fails
  }
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < entries;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const codec::Affine a = detail::get_meta(meta, static_cast<int64_t>(i), fp32 != 0);
    if (codec::f32_nonfinite(a.m) || codec::f32_nonfinite(a.d) || !(a.d >= 0.0f)) bad = true;
  }
  if (bad) atomicOr(reinterpret_cast<unsigned int*>(&st->flags), STATUS_BAD_META);
}

/**
 * Decode, step 2 (anchor-only when residuals == NULL), row by row: block
 * threads (x, y) take row y of the block's rows and octet x (channels
 * [8x, 8x+8)) of it.  Per row, one thread computes the row pointer and the
 * row's metadata base (t / C) * H into shared memory; per octet, the codes are
 * read from their bit offset (t*H + c) * A, with no division, and the 8 values
 * go out as one 16-byte store where aligned (store_x8).  Any H: an octet that
 * is not byte-aligned in the streams (H not a multiple of 8) reads at a bit
 * offset, which only costs a shift.
 */
template <int DT>
__global__ void __launch_bounds__(kThreads)
    k_decode(KLayout L, KCodebook cb, int C, int fp32, const uint8_t* __restrict__ meta,
             const uint8_t* __restrict__ anchors, const uint8_t* __restrict__ residuals,
             const uint8_t* __restrict__ anchor_table, const DeviceStatus* st) {
  // Values by index: recon_full (full), the page's anchor table (anchor-only,
  // split codecs) or recon_anchor (anchor-only, INT4).
  __shared__ float table[256];
  __shared__ uint8_t* srow[kThreads];
  __shared__ int64_t smeta[kThreads];
  const bool full = residuals != nullptr;
  const int A = cb.A, R = cb.R;
  const int nt = full ? (1 << (A + R)) : (1 << A);
  const unsigned tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (unsigned i = tid; i < static_cast<unsigned>(nt); i += blockDim.x * blockDim.y)
    table[i] =
        full ? cb.recon_full[i]
        : anchor_table != nullptr
            ? codec::bits_f32(static_cast<uint32_t>(detail::load_bytes(anchor_table + 4 * i, 4)))
            : cb.recon_anchor[i];
  __syncthreads();
  // Hostile metadata: nothing is written (as the CPU decoder validates first).
  // The same flags for every thread: the whole block returns.
  if (*reinterpret_cast<const volatile uint32_t*>(&st->flags) & STATUS_BAD_META) return;
  const unsigned amask = (1u << A) - 1u, rmask = (1u << R) - 1u;
  const int H = L.H;
  const int noct = (H + 7) / 8;
  const int64_t rows_step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  // The loop's trip count depends on blockIdx only: every thread of the block
  // meets the barriers.
  for (int64_t tb = static_cast<int64_t>(blockIdx.x) * blockDim.y; tb < L.T; tb += rows_step) {
    const int64_t t = tb + threadIdx.y;
    if (threadIdx.x == 0 && t < L.T) {
      srow[threadIdx.y] = detail::row_ptr(L, t);
      smeta[threadIdx.y] = (t / C) * H;
    }
    __syncthreads();
    if (t < L.T) {
      uint8_t* const row = srow[threadIdx.y];
      const int64_t mb = smeta[threadIdx.y];
      const uint64_t erow = static_cast<uint64_t>(t) * static_cast<uint64_t>(H);
      for (int o = blockIdx.y * blockDim.x + threadIdx.x; o < noct; o += gridDim.y * blockDim.x) {
        const int c = 8 * o;
        const int n = H - c < 8 ? H - c : 8;
        const uint64_t e = erow + static_cast<uint64_t>(c);
        const uint64_t acc_a = detail::load_bits(anchors, e * A, n * A);
        const uint64_t acc_r = full ? detail::load_bits(residuals, e * R, n * R) : 0;
        codec::Affine a8[8];
        detail::get_meta8(meta, mb + c, fp32 != 0, n, a8);
        float v[8] = {};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (i < n) {
            const codec::Affine& a = a8[i];
            const unsigned an = static_cast<unsigned>(acc_a >> (i * A)) & amask;
            const unsigned idx =
                full ? (an << R) | (static_cast<unsigned>(acc_r >> (i * R)) & rmask) : an;
            v[i] = codec::denormalise(table[idx], a);
          }
        }
        detail::store_x8<DT>(row, c, n, v);
      }
    }
    __syncthreads();  // srow / smeta are rewritten by the next round
  }
}

// ---------------------------------------------------------------------------
// Launch helpers
// ---------------------------------------------------------------------------

// Launch outcomes.  cudaGetLastError() returns (and clears) the last error
// of any runtime call of this thread, not only of the launch just made: an
// error left by earlier work (an unchecked launch, a failed cudaMemcpyAsync)
// would come back after the next launch and be blamed on it.  So every entry
// point below first takes such a pending error (KVXFER_PENDING) and returns
// it, named as earlier work, without launching anything; launched() after a
// launch then reports the launch's own error.  A sticky error (the context is
// lost, e.g. an earlier kernel faulted) cannot be cleared: it is reported
// before the launch too, and every later call reports it again.
kernels::Launched launched(const char* kernel) { return {cudaGetLastError(), kernel}; }
#define KVXFER_PENDING(name)                                                    \
  if (const cudaError_t pending_ = cudaGetLastError(); pending_ != cudaSuccess) \
    return kernels::Launched { pending_, "earlier work (an error pending before " name ")" }

// Grid for grid-stride loops over `work` items of kThreads threads.
unsigned grid_for(uint64_t work) {
  const uint64_t blocks = (work + kThreads - 1) / kThreads;
  // At most 2^24 blocks: a block then handles at most 2^28 elements of a
  // 2^52-element page, so its 32-bit shared histogram cannot overflow.
  return static_cast<unsigned>(std::max<uint64_t>(1, std::min<uint64_t>(blocks, 1u << 24)));
}

// Grid of the row kernels: x over rows (grid-stride), y over channel tiles.
dim3 row_grid(int64_t T, int32_t H) {
  const unsigned y = static_cast<unsigned>(std::min<int64_t>((H + kThreads - 1) / kThreads, 65535));
  const unsigned x = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(T, 1 << 20)));
  return dim3(x, y);
}

// Block and grid of the octet-row kernels (k_decode): x over the row's
// octets (a power of two up to kThreads, so short rows share a block), y over
// rows; grid x over row groups (grid-stride), y over octet tiles.
struct OctetRowGrid {
  dim3 grid, block;
};
OctetRowGrid octet_row_grid(int64_t T, int32_t H) {
  const int64_t noct = (static_cast<int64_t>(H) + 7) / 8;
  unsigned bx = 1;
  while (bx < static_cast<unsigned>(kThreads) && bx < noct) bx *= 2;
  const unsigned by = kThreads / bx;
  const int64_t gy = std::min<int64_t>((noct + bx - 1) / bx, 65535);
  const int64_t gx = std::max<int64_t>(1, std::min<int64_t>((T + by - 1) / by, 1 << 20));
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(bx, by)};
}

// The host side (src/cuda/launch.cc) has checked the dtype.
template <typename F>
kernels::Launched by_dtype(int32_t dt, F&& f) {
  switch (dt) {
    case KVXFER_DTYPE_BF16: return f(std::integral_constant<int, KVXFER_DTYPE_BF16>{});
    case KVXFER_DTYPE_FP16: return f(std::integral_constant<int, KVXFER_DTYPE_FP16>{});
    case KVXFER_DTYPE_FP32: return f(std::integral_constant<int, KVXFER_DTYPE_FP32>{});
  }
  return {cudaErrorInvalidValue, "dtype dispatch"};
}

}  // namespace

namespace kernels {

Launched reset_status(DeviceStatus* status, cudaStream_t stream) {
  KVXFER_PENDING("reset_status");
  KVXFER_LAUNCH(1, 256, stream, k_reset_status)(status);
  return launched("reset_status");
}

Launched encode(const KLayout& L, const KCodebook& K, int chunk_tokens, int64_t chunks,
                int64_t sink_rows, bool meta_fp32, uint8_t* meta, uint8_t* anchors,
                uint8_t* residuals, DeviceStatus* status, cudaStream_t stream) {
  KVXFER_PENDING("encode");
  const int64_t H = L.H;
  const bool fused = (H * K.A) % 8 == 0 && (H * K.R) % 8 == 0;
  return by_dtype(L.dtype, [&](auto dt) -> Launched {
    constexpr int DT = decltype(dt)::value;
    if (fused) {
      const dim3 grid(static_cast<unsigned>(chunks),
                      static_cast<unsigned>((H + kGroup - 1) / kGroup));
      KVXFER_LAUNCH(grid, kGroup, stream, k_encode_fused<DT>)
      (L, K, chunk_tokens, sink_rows, meta_fp32, meta, anchors, residuals, status);
      return launched("encode_fused");
    }
    const dim3 grid(static_cast<unsigned>(chunks),
                    static_cast<unsigned>((H + kThreads - 1) / kThreads));
    KVXFER_LAUNCH(grid, kThreads, stream, k_encode_meta<DT>)
    (L, chunk_tokens, sink_rows, meta_fp32, meta, status);
    const Launched m = launched("encode_meta");
    if (m.error != cudaSuccess) return m;
    const uint64_t octets = (static_cast<uint64_t>(L.T) * L.H + 7) / 8;
    KVXFER_LAUNCH(grid_for(octets), kThreads, stream, k_encode_codes<DT>)
    (L, K, chunk_tokens, sink_rows, meta_fp32, meta, anchors, residuals, status);
    return launched("encode_codes");
  });
}

Launched anchor_table(const KCodebook& K, uint8_t* out, const DeviceStatus* status,
                      cudaStream_t stream) {
  KVXFER_PENDING("anchor_table");
  KVXFER_LAUNCH(1, 64, stream, k_anchor_table)(K, out, status);
  return launched("anchor_table");
}

Launched scan_nonfinite(const KLayout& L, DeviceStatus* status, cudaStream_t stream) {
  KVXFER_PENDING("scan_nonfinite");
  return by_dtype(L.dtype, [&](auto dt) -> Launched {
    constexpr int DT = decltype(dt)::value;
    KVXFER_LAUNCH(row_grid(L.T, L.H), kThreads, stream, k_scan_nonfinite<DT>)(L, status);
    return launched("scan_nonfinite");
  });
}

Launched pack_values(const KLayout& L, int32_t out_dtype, uint8_t* payload, cudaStream_t stream) {
  KVXFER_PENDING("pack_values");
  const dim3 grid = row_grid(L.T, L.H);
  return by_dtype(L.dtype, [&](auto dt) -> Launched {
    constexpr int DT = decltype(dt)::value;
    if (out_dtype == L.dtype)
      KVXFER_LAUNCH(grid, kThreads, stream, k_pack_values<DT, DT>)(L, payload);
    else
      KVXFER_LAUNCH(grid, kThreads, stream, k_pack_values<DT, KVXFER_DTYPE_BF16>)(L, payload);
    return launched("pack_values");
  });
}

Launched unpack_values(const uint8_t* payload, int32_t in_dtype, const KLayout& L,
                       cudaStream_t stream) {
  KVXFER_PENDING("unpack_values");
  const dim3 grid = row_grid(L.T, L.H);
  return by_dtype(L.dtype, [&](auto dt) -> Launched {
    constexpr int DT = decltype(dt)::value;
    return by_dtype(in_dtype, [&](auto sdt) -> Launched {
      constexpr int SDT = decltype(sdt)::value;
      KVXFER_LAUNCH(grid, kThreads, stream, k_unpack_values<SDT, DT>)(payload, L);
      return launched("unpack_values");
    });
  });
}

Launched decode(const KLayout& L, const KCodebook& K, int chunk_tokens, bool meta_fp32,
                uint64_t entries, const uint8_t* meta, const uint8_t* anchors,
                const uint8_t* residuals, const uint8_t* table, DeviceStatus* status,
                cudaStream_t stream) {
  KVXFER_PENDING("decode");
  KVXFER_LAUNCH(grid_for(entries), kThreads, stream, k_check_meta)
  (meta, entries, meta_fp32, K, table, status);
  const Launched c = launched("check_meta");
  if (c.error != cudaSuccess) return c;
  return by_dtype(L.dtype, [&](auto dt) -> Launched {
    constexpr int DT = decltype(dt)::value;
    const OctetRowGrid g = octet_row_grid(L.T, L.H);
    KVXFER_LAUNCH(g.grid, g.block, stream, k_decode<DT>)
    (L, K, chunk_tokens, meta_fp32, meta, anchors, residuals, table, status);
    return launched("decode");
  });
}

}  // namespace kernels
}  // namespace kvxfer::cuda
