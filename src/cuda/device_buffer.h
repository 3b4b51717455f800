// The one owner of CUDA memory in kvxfer: an RAII buffer of device memory
// (cudaMalloc) or page-locked host memory (cudaMallocHost, so copies are
// asynchronous and fast), freed on destruction or on the next alloc.  Moving
// one hands its memory over and leaves it empty.  Memory shared by several
// owners (a device codebook held by a cache and by its users, a block table
// held by a transfer) is a std::shared_ptr to one.  Not thread-safe: one owner
// at a time.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvxfer::cuda {

template <bool kPinnedHost>
class CudaBuffer {
 public:
  uint8_t* p = nullptr;
  size_t n = 0;  // bytes asked for

  CudaBuffer() = default;
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  /** Takes `o`'s memory; `o` is left empty (p null, n 0). */
  CudaBuffer(CudaBuffer&& o) noexcept : p(o.p), n(o.n) {
    o.p = nullptr;
    o.n = 0;
  }
  /** Frees this buffer's memory, then takes `o`'s; `o` is left empty. */
  CudaBuffer& operator=(CudaBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      p = o.p;
      n = o.n;
      o.p = nullptr;
      o.n = 0;
    }
    return *this;
  }
  ~CudaBuffer() { reset(); }

  /** Allocates max(bytes, 8) bytes (never a null pointer for 0). */
  cudaError_t alloc(size_t bytes) {
    reset();
    void* q = nullptr;
    const size_t m = bytes > 8 ? bytes : 8;
    const cudaError_t e = kPinnedHost ? cudaMallocHost(&q, m) : cudaMalloc(&q, m);
    if (e == cudaSuccess) {
      p = static_cast<uint8_t*>(q);
      n = bytes;
    }
    return e;
  }
  void reset() {
    if (p != nullptr) {
      if (kPinnedHost)
        cudaFreeHost(p);
      else
        cudaFree(p);
    }
    p = nullptr;
    n = 0;
  }
};
using DeviceBuffer = CudaBuffer<false>;
using PinnedBuffer = CudaBuffer<true>;

}  // namespace kvxfer::cuda
