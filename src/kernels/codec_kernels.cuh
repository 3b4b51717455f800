// Device helpers of the codec kernels (kernels/codec_kernels.cu): the page
// layout, element loads/stores, metadata entries and bit packing.  The element
// math itself is codec/codec_math.h, shared verbatim with the CPU paths.
#pragma once

#include <cstdint>

#include "codec/codec_math.h"
#include "kernels/codec_kernels.h"
#include "kvxfer/kvxfer.h"

// Kernel launch on a stream: KVXFER_LAUNCH(grid, block, stream, kernel)(args...).
// A macro so that support/cuda_emu/ (a CPU emulation used to exercise the kernels on
// machines without a GPU) can run the same source.
#ifndef KVXFER_LAUNCH
#define KVXFER_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<(grid), (block), 0, (stream)>>>
#endif

namespace kvxfer::cuda::detail {

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint64_t umin(uint64_t a, uint64_t b) { return a < b ? a : b; }

using kernels::KCodebook;
using kernels::KLayout;

__device__ __forceinline__ uint8_t* row_ptr(const KLayout& L, int64_t t) {
  const int64_t u = L.first_token + t;
  return static_cast<uint8_t*>(L.blocks[u / L.block_size]) +
         (u % L.block_size) * L.row_stride_bytes;
}

template <int DT>
__device__ __forceinline__ float load_x(const uint8_t* row, int64_t c) {
  if constexpr (DT == KVXFER_DTYPE_BF16) {
    return codec::bf16_to_f32(reinterpret_cast<const uint16_t*>(row)[c]);
  } else if constexpr (DT == KVXFER_DTYPE_FP16) {
    return codec::f16_to_f32(reinterpret_cast<const uint16_t*>(row)[c]);
  } else {
    return reinterpret_cast<const float*>(row)[c];
  }
}

/**
 * Loads 8 consecutive elements starting at channel c (a full octet) into x,
 * with one or two 16-byte loads when the address allows, else one by one.
 */
template <int DT>
__device__ __forceinline__ void load_x8(const uint8_t* row, int64_t c, float* x) {
  constexpr int es = DT == KVXFER_DTYPE_FP32 ? 4 : 2;
  const uint8_t* p = row + c * es;
  if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    if constexpr (es == 2) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint16_t lo = static_cast<uint16_t>(w[i]), hi = static_cast<uint16_t>(w[i] >> 16);
        if constexpr (DT == KVXFER_DTYPE_BF16) {
          x[2 * i] = codec::bf16_to_f32(lo);
          x[2 * i + 1] = codec::bf16_to_f32(hi);
        } else {
          x[2 * i] = codec::f16_to_f32(lo);
          x[2 * i + 1] = codec::f16_to_f32(hi);
        }
      }
    } else {
      const float4 a = reinterpret_cast<const float4*>(p)[0];
      const float4 b = reinterpret_cast<const float4*>(p)[1];
      x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
      x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = load_x<DT>(row, c + i);
  }
}

/** Stores v into element c of a row of dtype DT, rounded as codec::store_elem does. */
template <int DT>
__device__ __forceinline__ void store_x(uint8_t* row, int64_t c, float v) {
  if constexpr (DT == KVXFER_DTYPE_BF16) {
    reinterpret_cast<uint16_t*>(row)[c] = codec::f32_to_bf16(v);
  } else if constexpr (DT == KVXFER_DTYPE_FP16) {
    reinterpret_cast<uint16_t*>(row)[c] = codec::f32_to_f16_sat(v);
  } else {
    reinterpret_cast<float*>(row)[c] = v;
  }
}

/** The element bits of v in dtype DT (2-byte dtypes), rounded as codec::store_elem does. */
template <int DT>
__device__ __forceinline__ uint32_t half_bits(float v) {
  if constexpr (DT == KVXFER_DTYPE_BF16)
    return codec::f32_to_bf16(v);
  else
    return codec::f32_to_f16_sat(v);
}

/**
 * Stores n (1..8) values at channels c.. of a row of dtype DT, rounded as
 * store_x.  A full octet goes out as one 16-byte store (two for FP32) when its
 * address is 16-byte aligned, which the run-time check decides (a row stride
 * or block base need not be); otherwise as the widest stores its alignment
 * allows (8, 4, then element size).  The bytes are the same either way.
 */
template <int DT>
__device__ __forceinline__ void store_x8(uint8_t* row, int64_t c, int n, const float* v) {
  constexpr int es = DT == KVXFER_DTYPE_FP32 ? 4 : 2;
  uint8_t* p = row + c * es;
  if (n < 8) {
    for (int i = 0; i < n; ++i) store_x<DT>(row, c + i, v[i]);
    return;
  }
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if constexpr (es == 2) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = half_bits<DT>(v[2 * i]) | (half_bits<DT>(v[2 * i + 1]) << 16);
    if ((a & 15u) == 0) {
      uint4 q;
      q.x = w[0], q.y = w[1], q.z = w[2], q.w = w[3];
      *reinterpret_cast<uint4*>(p) = q;
    } else if ((a & 7u) == 0) {
      uint2 q0, q1;
      q0.x = w[0], q0.y = w[1], q1.x = w[2], q1.y = w[3];
      reinterpret_cast<uint2*>(p)[0] = q0;
      reinterpret_cast<uint2*>(p)[1] = q1;
    } else if ((a & 3u) == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) reinterpret_cast<uint32_t*>(p)[i] = w[i];
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        reinterpret_cast<uint16_t*>(p)[2 * i] = static_cast<uint16_t>(w[i]);
        reinterpret_cast<uint16_t*>(p)[2 * i + 1] = static_cast<uint16_t>(w[i] >> 16);
      }
    }
  } else {
    if ((a & 15u) == 0) {
      float4 q0, q1;
      q0.x = v[0], q0.y = v[1], q0.z = v[2], q0.w = v[3];
      q1.x = v[4], q1.y = v[5], q1.z = v[6], q1.w = v[7];
      reinterpret_cast<float4*>(p)[0] = q0;
      reinterpret_cast<float4*>(p)[1] = q1;
    } else if ((a & 7u) == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float2 q;
        q.x = v[2 * i], q.y = v[2 * i + 1];
        reinterpret_cast<float2*>(p)[i] = q;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) reinterpret_cast<float*>(p)[i] = v[i];
    }
  }
}

// Metadata entries [chunk][channel]{m, d}: 2 x binary16 (4 bytes) or 2 x
// binary32 (8 bytes), little-endian, as codec::put_affine / get_affine.
__device__ __forceinline__ void put_meta(uint8_t* meta, int64_t idx, bool fp32, codec::Affine a) {
  if (fp32) {
    reinterpret_cast<float2*>(meta)[idx] = make_float2(a.m, a.d);
  } else {
    reinterpret_cast<uint32_t*>(meta)[idx] = static_cast<uint32_t>(codec::f32_to_f16(a.m)) |
                                             (static_cast<uint32_t>(codec::f32_to_f16(a.d)) << 16);
  }
}
__device__ __forceinline__ codec::Affine get_meta(const uint8_t* meta, int64_t idx, bool fp32) {
  if (fp32) {
    const float2 v = reinterpret_cast<const float2*>(meta)[idx];
    return codec::Affine{v.x, v.y};
  }
  const uint32_t v = reinterpret_cast<const uint32_t*>(meta)[idx];
  return codec::Affine{codec::f16_to_f32(static_cast<uint16_t>(v)),
                       codec::f16_to_f32(static_cast<uint16_t>(v >> 16))};
}

/**
 * The n (1..8) metadata entries idx.. (channels of one chunk row): with 16-byte
 * loads when they are 8 and 16-byte aligned (2 loads for binary16 entries, 4
 * for binary32), else one by one.  The same values as get_meta.
 */
__device__ __forceinline__ void get_meta8(const uint8_t* meta, int64_t idx, bool fp32, int n,
                                          codec::Affine* out) {
  const uint8_t* p = meta + idx * (fp32 ? 8 : 4);
  if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    if (fp32) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = reinterpret_cast<const float4*>(p)[i];
        out[2 * i] = codec::Affine{v.x, v.y};
        out[2 * i + 1] = codec::Affine{v.z, v.w};
      }
    } else {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint4 v = reinterpret_cast<const uint4*>(p)[i];
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k)
          out[4 * i + k] = codec::Affine{codec::f16_to_f32(static_cast<uint16_t>(w[k])),
                                         codec::f16_to_f32(static_cast<uint16_t>(w[k] >> 16))};
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < n) out[i] = get_meta(meta, idx + i, fp32);
}

/**
 * Writes the low `nbytes` (1..8) bytes of v, little-endian, at p (any
 * alignment): one store when the address allows, else the widest aligned
 * pieces (4, 2, 1 bytes) in address order.
 */
__device__ __forceinline__ void store_bytes(uint8_t* p, uint64_t v, int nbytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (nbytes == 8 && (a & 7u) == 0) {
    *reinterpret_cast<uint64_t*>(p) = v;
    return;
  }
  int i = 0;
  while (i < nbytes) {
    const uintptr_t q = a + i;
    if (nbytes - i >= 4 && (q & 3u) == 0) {
      *reinterpret_cast<uint32_t*>(p + i) = static_cast<uint32_t>(v >> (8 * i));
      i += 4;
    } else if (nbytes - i >= 2 && (q & 1u) == 0) {
      *reinterpret_cast<uint16_t*>(p + i) = static_cast<uint16_t>(v >> (8 * i));
      i += 2;
    } else {
      p[i] = static_cast<uint8_t>(v >> (8 * i));
      i += 1;
    }
  }
}
/**
 * Reads `nbytes` (1..8) bytes at p, little-endian: one load when the address
 * allows, else the widest aligned pieces (4, 2, 1 bytes).
 */
__device__ __forceinline__ uint64_t load_bytes(const uint8_t* p, int nbytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (nbytes == 4 && (a & 3u) == 0) return *reinterpret_cast<const uint32_t*>(p);
  if (nbytes == 8 && (a & 7u) == 0) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
  int i = 0;
  while (i < nbytes) {
    const uintptr_t q = a + i;
    if (nbytes - i >= 4 && (q & 3u) == 0) {
      v |= static_cast<uint64_t>(*reinterpret_cast<const uint32_t*>(p + i)) << (8 * i);
      i += 4;
    } else if (nbytes - i >= 2 && (q & 1u) == 0) {
      v |= static_cast<uint64_t>(*reinterpret_cast<const uint16_t*>(p + i)) << (8 * i);
      i += 2;
    } else {
      v |= static_cast<uint64_t>(p[i]) << (8 * i);
      i += 1;
    }
  }
  return v;
}

/**
 * Reads `nbits` (0..56) bits of a little-endian bit stream starting at bit
 * `bit`: the bytes that hold them (at most 8), shifted down.  Higher bits of
 * the result are the stream's following bits, not zero.
 */
__device__ __forceinline__ uint64_t load_bits(const uint8_t* p, uint64_t bit, int nbits) {
  if (nbits == 0) return 0;
  const int sh = static_cast<int>(bit & 7u);
  return load_bytes(p + (bit >> 3), (sh + nbits + 7) / 8) >> sh;
}

/** The code scale s of a (chunk, channel) with half-range d (codec_math's code_scale). */
__device__ __forceinline__ float code_scale(const KCodebook& cb, float d) {
  return codec::code_scale(d, cb.scale_num);
}

/** The code of one element x with offset m and code scale s: codec_math's quantize. */
__device__ __forceinline__ uint8_t code_of(const KCodebook& cb, float x, float m, float s) {
  const codec::CodeSpec cs{cb.kind, cb.scale_num, cb.bias,     cb.max_code,
                           cb.base, cb.next,      cb.lut_log2, cb.lut_origin};
  return codec::quantize(cs, x, m, s);
}

/** Records a non-finite element: the flag, and the first one in token-major order. */
__device__ __forceinline__ void report_nonfinite(DeviceStatus* st, int64_t t, int64_t c, int64_t H,
                                                 float x) {
  atomicOr(reinterpret_cast<unsigned int*>(&st->flags), STATUS_NONFINITE);
  const unsigned long long key =
      (static_cast<unsigned long long>(t * H + c) << 1) | (codec::f32_isinf(x) ? 1ull : 0ull);
  atomicMin(reinterpret_cast<unsigned long long*>(&st->first_bad), key);
}

}  // namespace kvxfer::cuda::detail
