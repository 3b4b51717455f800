// The CUDA runtime calls of src/cuda/ and tests/gpu_test.cc, emulated on the
// host for kvxfer_cuda_emu (see cuda_emu.h): one fake device whose memory is host
// memory, streams that run everything at once.  Not a general cudart.
// clang-format off
#include "cuda_emu.h"  // first: it must define __shared__ before any CUDA header
// clang-format on

#include <ucontext.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace emu {

// One OS thread runs every CUDA thread of a block as a fiber (ucontext):
// __syncthreads() switches back to the scheduler, which resumes each live
// fiber in turn, so all threads of the block meet at every barrier.
Idx thread_idx, block_idx;
dim3 block_dim, grid_dim;

namespace {
constexpr size_t kStack = 256 * 1024;
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
};
ucontext_t g_sched;
std::vector<Fiber> g_fibers;
const std::function<void()>* g_body = nullptr;
unsigned g_cur = 0;

void fiber_main() {
  (*g_body)();
  g_fibers[g_cur].done = true;  // returns to uc_link = g_sched
}
}  // namespace

void syncthreads() { swapcontext(&g_fibers[g_cur].ctx, &g_sched); }

void run(dim3 g, dim3 b, const std::function<void()>& body) {
  const unsigned nt = b.x * b.y * b.z;
  if (g_fibers.size() < nt) g_fibers.resize(nt);
  g_body = &body;
  block_dim = b;
  grid_dim = g;
  for (unsigned bz = 0; bz < g.z; ++bz)
    for (unsigned by = 0; by < g.y; ++by)
      for (unsigned bx = 0; bx < g.x; ++bx) {
        for (unsigned t = 0; t < nt; ++t) {
          Fiber& f = g_fibers[t];
          if (f.stack.empty()) f.stack.resize(kStack);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = &g_sched;
          makecontext(&f.ctx, fiber_main, 0);
          f.done = false;
        }
        for (bool live = true; live;) {
          live = false;
          for (unsigned t = 0; t < nt; ++t) {
            if (g_fibers[t].done) continue;
            thread_idx = Idx{t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
            block_idx = Idx{bx, by, bz};
            g_cur = t;
            swapcontext(&g_sched, &g_fibers[t].ctx);
            live = live || !g_fibers[t].done;
          }
        }
      }
}

}  // namespace emu

namespace {
int g_stream_dummy[4];
}

extern "C" {

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error (emulated)" : "error (emulated)";
}
cudaError_t cudaMalloc(void** p, size_t n) {
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaMallocHost(void** p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int) { return cudaMalloc(p, n); }
cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, enum cudaMemcpyKind) {
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, enum cudaMemcpyKind k, cudaStream_t) {
  return cudaMemcpy(d, s, n, k);
}
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t) {
  std::memset(d, v, n);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int, int priority) {
  g_stream_dummy[0] = priority;
  *s = reinterpret_cast<cudaStream_t>(&g_stream_dummy[0]);
  return cudaSuccess;
}
cudaError_t cudaStreamGetPriority(cudaStream_t s, int* priority) {
  *priority = *reinterpret_cast<int*>(s);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  g_stream_dummy[1] = 0;
  *s = reinterpret_cast<cudaStream_t>(&g_stream_dummy[1]);
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void*, size_t, unsigned int) { return cudaSuccess; }
cudaError_t cudaHostUnregister(void*) { return cudaSuccess; }

}  // extern "C"
