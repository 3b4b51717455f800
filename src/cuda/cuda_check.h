// The one check for CUDA runtime calls, used by all host code that calls the
// runtime (src/cuda/, src/nccl_backend/, perf/codec_perf.cc).  A failed call becomes a
// kvxfer_result_t with the runtime's text as the error message, and
// KVXFER_CUDA_CHECK propagates it with the same breadcrumb as KVXFER_CHECK.
#pragma once

#include <cuda_runtime_api.h>

#include "common/error.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::cuda {

/**
 * KVXFER_SUCCESS for cudaSuccess.  Otherwise sets the error text to "<what>
 * failed: <runtime text>" (prefixed "CUDA device <device>: " when device >= 0)
 * and returns KVXFER_ERR_OUT_OF_MEMORY for cudaErrorMemoryAllocation,
 * KVXFER_ERR_SYSTEM for anything else.
 */
inline kvxfer_result_t cuda_result(cudaError_t e, const char* what, int device = -1) {
  if (e == cudaSuccess) return KVXFER_SUCCESS;
  const kvxfer_result_t r =
      e == cudaErrorMemoryAllocation ? KVXFER_ERR_OUT_OF_MEMORY : KVXFER_ERR_SYSTEM;
  if (device >= 0)
    return set_error(r, "CUDA device %d: %s failed: %s", device, what, cudaGetErrorString(e));
  return set_error(r, "%s failed: %s", what, cudaGetErrorString(e));
}

}  // namespace kvxfer::cuda

/** Returns the kvxfer_result_t of a failed CUDA runtime call, named by its source text. */
#define KVXFER_CUDA_CHECK(call) KVXFER_CHECK(::kvxfer::cuda::cuda_result((call), #call))
