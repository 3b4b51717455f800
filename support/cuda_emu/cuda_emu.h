// CPU emulation of the CUDA features the codec kernels use, so that
// src/kernels/codec_kernels.cu can run on a machine without a GPU (library
// kvxfer_cuda_emu, support/cuda_emu/CMakeLists.txt; codec_kernels_emu.cc includes this
// first, then the .cu file, compiled as C++ by the host compiler):
//   - a kernel launch runs every block in turn; the threads of a block run as
//     fibers on one OS thread, so __syncthreads() is a real barrier (every
//     thread reaches it before any goes on) and __shared__ (a function-local
//     static) is shared by the block;
//   - atomics are GCC atomics; "device memory" is host memory (cudart_emu.cc).
// It checks the indexing, packing and control flow of the kernels and of the
// host code around them.  It does not check device arithmetic: without
// __CUDA_ARCH__, codec_math.h uses the host operators instead of the __f*_rn
// intrinsics, and no GPU memory model or scheduling is involved.
#pragma once

#define __shared__ static
#define __launch_bounds__(...)
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <tuple>
#include <utility>

namespace emu {

struct Idx {
  unsigned x = 0, y = 0, z = 0;
};
extern Idx thread_idx, block_idx;
extern dim3 block_dim, grid_dim;

void syncthreads();
/** Runs body() once per thread of every block of grid g, blocks of b threads. */
void run(dim3 g, dim3 b, const std::function<void()>& body);

template <typename... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  template <typename... A>
  void operator()(A&&... a) const {
    const std::tuple<P...> args(static_cast<P>(a)...);  // by value, as a launch copies them
    run(grid, block, [&] { std::apply(kernel, args); });
  }
};
template <typename... P>
Launch<P...> launcher(dim3 g, dim3 b, void (*k)(P...)) {
  return Launch<P...>{k, g, b};
}

}  // namespace emu

#define threadIdx ::emu::thread_idx
#define blockIdx ::emu::block_idx
#define blockDim ::emu::block_dim
#define gridDim ::emu::grid_dim
#define __syncthreads() ::emu::syncthreads()
#define KVXFER_LAUNCH(grid, block, stream, ...) \
  ((void)(stream), ::emu::launcher(dim3(grid), dim3(block), &__VA_ARGS__))

inline unsigned int atomicOr(unsigned int* p, unsigned int v) {
  return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (v < old &&
         !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
