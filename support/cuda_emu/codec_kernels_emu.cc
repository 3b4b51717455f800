// src/kernels/codec_kernels.cu compiled as C++ for the CPU emulation (cuda_emu.h):
// the same kernel source, run by gpu_emu_test where no GPU exists.
// clang-format off
#include "cuda_emu/cuda_emu.h"  // first: it must define __shared__ before any CUDA header

#include "kernels/codec_kernels.cu"  // src/, on the include path
// clang-format on
