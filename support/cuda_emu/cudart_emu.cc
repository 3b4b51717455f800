// The CUDA runtime calls of src/cuda/ and tests/gpu_test.cc, emulated on the
// host for kvxfer_cuda_emu (see cuda_emu.h): a few fake devices whose memory is
// host memory, a current device per thread, streams that run everything at
// once.  Not a general cudart.
// clang-format off
#include "cuda_emu/cuda_emu.h"  // first: it must define __shared__ before any CUDA header
// clang-format on

#include <ucontext.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace emu {

// One OS thread runs every CUDA thread of a block as a fiber (ucontext):
// __syncthreads() switches back to the scheduler, which resumes each live
// fiber in turn, so all threads of the block meet at every barrier.
Idx thread_idx, block_idx;
dim3 block_dim, grid_dim;

namespace {
// ThreadSanitizer must be told about the fibers (else it sees one thread
// jump between stacks); the switches synchronise, as __syncthreads does.
#if defined(__SANITIZE_THREAD__)
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
}
void* g_tsan_sched = nullptr;
inline void tsan_switch(void* f) { __tsan_switch_to_fiber(f, 0); }
#else
inline void tsan_switch(void*) {}
#endif

constexpr size_t kStack = 256 * 1024;
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
  void* tsan = nullptr;
};
// One kernel at a time in the process, as __shared__ (a function-local
// static) and the scheduler below are process-wide: kernels launched by
// several host threads (two communicators' codec threads) run one after the
// other, each to completion.
std::mutex g_run_mu;
ucontext_t g_sched;
std::vector<Fiber> g_fibers;
const std::function<void()>* g_body = nullptr;
unsigned g_cur = 0;

void fiber_main() {
  (*g_body)();
  g_fibers[g_cur].done = true;
#if defined(__SANITIZE_THREAD__)
  // Leave without returning (a return would be instrumented on the
  // scheduler's fiber): straight back to the scheduler, this fiber is done.
  tsan_switch(g_tsan_sched);
  setcontext(&g_sched);
#endif
}  // returns to uc_link = g_sched
}  // namespace

void syncthreads() {
#if defined(__SANITIZE_THREAD__)
  tsan_switch(g_tsan_sched);
#endif
  swapcontext(&g_fibers[g_cur].ctx, &g_sched);
}

namespace {
void run_locked(dim3 g, dim3 b, const std::function<void()>& body) {
  const unsigned nt = b.x * b.y * b.z;
  if (g_fibers.size() < nt) g_fibers.resize(nt);
#if defined(__SANITIZE_THREAD__)
  g_tsan_sched = __tsan_get_current_fiber();
#endif
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
#if defined(__SANITIZE_THREAD__)
          if (f.tsan != nullptr) __tsan_destroy_fiber(f.tsan);  // a fresh one per context
          f.tsan = __tsan_create_fiber(0);
#endif
        }
        for (bool live = true; live;) {
          live = false;
          for (unsigned t = 0; t < nt; ++t) {
            if (g_fibers[t].done) continue;
            thread_idx = Idx{t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
            block_idx = Idx{bx, by, bz};
            g_cur = t;
            tsan_switch(g_fibers[t].tsan);
            swapcontext(&g_sched, &g_fibers[t].ctx);
            live = live || !g_fibers[t].done;
          }
        }
      }
}
}  // namespace

void run(dim3 g, dim3 b, const std::function<void()>& body) {
  std::lock_guard<std::mutex> lk(g_run_mu);
  run_locked(g, b, body);
}

}  // namespace emu

namespace {
// Several fake devices (kEmuDevices), each thread with its own current device
// (0 until cudaSetDevice), as the runtime keeps it per thread: tests check
// that kvxfer restores the caller's device.  Streams are distinct objects that
// remember their device and priority; everything runs at once, so events are
// always complete.  Memory is host memory shared by all "devices".
constexpr int kEmuDevices = 4;
thread_local int t_device = 0;
struct EmuStream {
  int device;
  int priority;
};
struct EmuEvent {
  int device;
  int recorded;
};
}  // namespace

extern "C" {

int kvxfer_emu_device_count = kEmuDevices;  // tests may lower it (cudaGetDeviceCount)

cudaError_t cudaGetDeviceCount(int* count) {
  *count = kvxfer_emu_device_count;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= kvxfer_emu_device_count) return cudaErrorInvalidDevice;
  t_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error (emulated)" : "error (emulated)";
}
// Allocation and synchronous-copy counters: tests check that the
// per-request path allocates nothing after warm-up.
int kvxfer_emu_allocs = 0;       // cudaMalloc, cudaMallocHost, cudaHostAlloc
int kvxfer_emu_frees = 0;        // cudaFree, cudaFreeHost
int kvxfer_emu_sync_copies = 0;  // cudaMemcpy
cudaError_t cudaMalloc(void** p, size_t n) {
  __atomic_add_fetch(&kvxfer_emu_allocs, 1, __ATOMIC_RELAXED);
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256);
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaMallocHost(void** p, size_t n) { return cudaMalloc(p, n); }
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int) { return cudaMalloc(p, n); }
cudaError_t cudaFree(void* p) {
  __atomic_add_fetch(&kvxfer_emu_frees, 1, __ATOMIC_RELAXED);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, enum cudaMemcpyKind) {
  __atomic_add_fetch(&kvxfer_emu_sync_copies, 1, __ATOMIC_RELAXED);
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, enum cudaMemcpyKind, cudaStream_t) {
  if (n) std::memmove(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* d, int v, size_t n, cudaStream_t) {
  std::memset(d, v, n);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int, int priority) {
  *s = reinterpret_cast<cudaStream_t>(new EmuStream{t_device, priority});
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  return cudaStreamCreateWithPriority(s, flags, 0);
}
cudaError_t cudaStreamGetPriority(cudaStream_t s, int* priority) {
  *priority = reinterpret_cast<EmuStream*>(s)->priority;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete reinterpret_cast<EmuStream*>(s);
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = reinterpret_cast<cudaEvent_t>(new EmuEvent{t_device, 0});
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete reinterpret_cast<EmuEvent*>(e);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  // The event and the stream must belong to one device.
  auto* ev = reinterpret_cast<EmuEvent*>(e);
  if (s != nullptr && s != cudaStreamLegacy && s != cudaStreamPerThread &&
      reinterpret_cast<EmuStream*>(s)->device != ev->device)
    return cudaErrorInvalidResourceHandle;
  __atomic_store_n(&ev->recorded, 1, __ATOMIC_RELEASE);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }
// Streams run their work when it is enqueued: a host function runs at once.
cudaError_t cudaLaunchHostFunc(cudaStream_t, cudaHostFn_t fn, void* data) {
  fn(data);
  return cudaSuccess;
}
int kvxfer_emu_host_register_device = -1;  // the current device of the last cudaHostRegister
int kvxfer_emu_host_registers = 0;         // cudaHostRegister calls so far
cudaError_t cudaHostRegister(void*, size_t, unsigned int) {
  __atomic_store_n(&kvxfer_emu_host_register_device, t_device, __ATOMIC_RELAXED);
  __atomic_add_fetch(&kvxfer_emu_host_registers, 1, __ATOMIC_RELAXED);
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void*) { return cudaSuccess; }

}  // extern "C"
