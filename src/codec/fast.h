// Row kernels of the fast CPU path.  One table per instruction set; the
// driver (codec/fast.cc) splits a page into chunks over threads and calls
// them row by row.  Each kernel computes exactly the operations of the
// reference (codec/reference.cc) in the same order per element.
#pragma once

#include <cstdint>

#include "codec/page.h"

namespace kvxfer::codec::fast {

struct RowKernels {
  /** Folds one row into running min/max; false if it holds NaN or Inf. */
  bool (*minmax)(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, float* mn, float* mx);
  /** Codes of one row: codes[c] = cb.encode(normalise(x[c], {m[c], d[c]})). */
  void (*encode_row)(const uint8_t* row, kvxfer_dtype_t dt, int32_t H, const float* m,
                     const float* d, const Codebook& cb, uint8_t* codes);
  /** Values of one row: x[c] = denormalise(table[idx[c]], {m[c], d[c]}) in dtype dt. */
  void (*decode_row)(const uint8_t* idx, int32_t H, const float* m, const float* d,
                     const float* table, kvxfer_dtype_t dt, uint8_t* row);
};

const RowKernels& scalar_kernels();
/** Defined in fast_avx2.cc, compiled with -mavx2 -mf16c; call only if cpu_has_avx2(). */
const RowKernels& avx2_kernels();

}  // namespace kvxfer::codec::fast
