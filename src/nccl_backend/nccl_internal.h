// Internals of the NCCL backend shared by its two source files:
//   nccl_backend.cc  communicators (init, abort, destroy), the checks of a
//                    call's arguments, and the exported C API;
//   nccl_call.cc     one kvxfer_nccl_xfer call: its five phases.
// nccl_backend.cc describes the protocol.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cinttypes>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "cuda/device_codec.h"
#include "nccl_backend/nccl_backend.h"
#include "xfer/protocol.h"

// Device buffers and staging of a call that could not be drained (timeout,
// NCCL failure): kept until destroy, when the streams are idle.
struct ParkedCall;

namespace kvxfer::nccl {
/**
 * The device and pinned buffers of the i-th op of a call, kept by the
 * communicator for the i-th op of later calls: grown when an op needs more,
 * never freed before kvxfer_nccl_comm_destroy (or parked with a call that
 * could not be drained), so a call of shapes already seen allocates nothing.
 * Reuse is safe: a call returns only once its streams have passed every use.
 */
struct OpBuffers {
  cuda::DeviceBuffer ktable, vtable, dmeta, danc, dres, dstat;
  cuda::PinnedBuffer hmeta, hanc, hres, hstat;
  cuda::DeviceScratch scratch;
  int64_t scratch_tokens = 0;
  int32_t scratch_channels = 0;
};
}  // namespace kvxfer::nccl

struct kvxfer_nccl_comm_s {
  ncclComm_t anchor = nullptr;
  ncclComm_t residual = nullptr;
  bool owned = false;
  int device = 0, nranks = 0, rank = 0;
  kvxfer::nccl::Options opt;
  cudaStream_t astream = nullptr, rstream = nullptr;
  cudaEvent_t aevent = nullptr, revent = nullptr;
  cudaEvent_t ready = nullptr;  // recorded on the caller's stream at each call
  // Reused by every call (kvxfer::nccl::OpBuffers): op i's buffers, the
  // descriptors on the device and their pinned host copy.
  std::vector<std::unique_ptr<kvxfer::nccl::OpBuffers>> bufs;
  kvxfer::cuda::DeviceBuffer desc;
  kvxfer::cuda::PinnedBuffer hdesc;
  bool aborted = false;
  std::string abort_why;
  std::vector<std::shared_ptr<ParkedCall>> parked;
};

namespace kvxfer::nccl {

/** Bytes of the status block (P2, P5): result and text, padded. */
constexpr size_t kStatusBlock = xfer::kStatusHeaderBytes + xfer::kMaxStatusText;  // 1040
static_assert(kStatusBlock % 8 == 0, "lengths after the status block stay 8-byte aligned");

/** CLOCK_MONOTONIC in nanoseconds. */
int64_t now_ns();

/** KVXFER_ERR_SYSTEM: "<what> failed: <NCCL's string>: <its last error on c>". */
kvxfer_result_t nccl_fail(ncclResult_t r, const char* what, ncclComm_t c = nullptr);

/** NCCL's asynchronous state of `comm`.  An error fails `what`
 *  (KVXFER_ERR_SYSTEM); `*busy`, when given, tells whether an operation (its
 *  init, a group) is still in progress. */
kvxfer_result_t async_state(ncclComm_t comm, const char* what, bool* busy);

/**
 * The backend's one polling loop: calls `step(&done)` every `period` until
 * it sets `done` (KVXFER_SUCCESS) or fails (its error).  After `timeout_ms`
 * it fails with KVXFER_ERR_TIMEOUT, "<what>: <late> within <ms> ms (<hint>)".
 * Blocks the calling thread.
 */
template <typename Step>
kvxfer_result_t poll_until(int64_t timeout_ms, std::chrono::microseconds period, const char* what,
                           const char* late, const char* hint, Step&& step) {
  const int64_t end = now_ns() + timeout_ms * 1000000;
  for (;;) {
    bool done = false;
    if (const kvxfer_result_t r = step(&done); r < 0) return r;
    if (done) return KVXFER_SUCCESS;
    if (now_ns() > end)
      return set_error(KVXFER_ERR_TIMEOUT, "%s: %s within %" PRId64 " ms (%s)", what, late,
                       timeout_ms, hint);
    std::this_thread::sleep_for(period);
  }
}

/** Polls until nothing is in progress on `comm` (poll_until's arguments). */
kvxfer_result_t wait_idle(ncclComm_t comm, int64_t timeout_ms, std::chrono::microseconds period,
                          const char* what, const char* late, const char* hint);

/**
 * Runs the ops of one kvxfer_nccl_xfer call (validated, on `c`'s device,
 * published POSTED) through the five phases.  wait_ready: c->ready was
 * recorded on the caller's stream, and kvxfer's streams wait on it.
 */
kvxfer_result_t run_call(kvxfer_nccl_comm_t c, kvxfer_nccl_op_t* ops, int n, bool wait_ready);

}  // namespace kvxfer::nccl
