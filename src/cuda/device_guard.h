// The current CUDA device of a thread kvxfer does not own (an API caller's,
// a progress thread that also serves host requests) is the caller's state:
// DeviceGuard makes `device` current for its scope and gives the previous
// device back on destruction, so no kvxfer call changes it.  Every CUDA call
// kvxfer makes on such a thread (src/cuda/xfer_device.cc, src/nccl_backend/) runs
// under one.  Thread-safety: per thread, as the runtime's current device.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/cuda_check.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::cuda {

class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }

  /** Makes `device` current (cudaSetDevice only if it is not already); an error names it. */
  kvxfer_result_t set(int device) {
    if (!saved_) {
      const cudaError_t e = cudaGetDevice(&prev_);
      if (e != cudaSuccess) return cuda_result(e, "cudaGetDevice", device);
      saved_ = true;
    }
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == device) return KVXFER_SUCCESS;
    const cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return cuda_result(e, "cudaSetDevice", device);
    restore_ = prev_ != device;
    return KVXFER_SUCCESS;
  }

 private:
  int prev_ = 0;
  bool saved_ = false;
  bool restore_ = false;
};

}  // namespace kvxfer::cuda
