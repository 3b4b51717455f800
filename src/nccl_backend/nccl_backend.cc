// The NCCL backend of kvxfer (include/kvxfer/kvxfer_nccl.h, docs/NCCL.md).
//
// A kvxfer_nccl_comm_t holds two NCCL communicators, one per traffic class,
// and two CUDA streams: the anchor stream (greatest priority,
// cuda::create_anchor_stream) and the residual stream (least priority).
// kvxfer_nccl_xfer runs its ops through five phases, each one NCCL group
// spanning every op still in it, so that a rank may send to itself:
//
//   P1 DESC     anchor comm   both ways   80 B (xfer::encode_desc)
//   P2 LENGTHS  anchor comm   sender ->   status block + (anchor, residual) length per page
//   P3 ANCHORS  anchor comm   sender ->   every anchor section of the op, concatenated
//                                         (MONOLITHIC: the residuals follow in the same group)
//   P4 RESIDUAL residual comm sender ->   every residual section, concatenated; the residual
//                                         stream waits for P3 on the device (strict order)
//   P5 STATUS   anchor comm   <- receiver status block: what completes the sender
//
// Counts are equal on both sides by construction: P1 and P5 are fixed, P2
// follows from the two descriptors, P3/P4 from P2.  Every wait polls the
// stream and ncclCommGetAsyncError under a deadline; a timeout or an NCCL
// error aborts the owned communicators and fails every op not yet final.
//
// nccl_call.cc runs the phases of a call; this file holds the communicators,
// the checks of a call's arguments and the exported C API.
#include "nccl_backend/nccl_backend.h"

#include <cuda_runtime.h>
#include <time.h>

#include <chrono>
#include <cinttypes>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "codec/codec.h"
#include "codec/format.h"
#include "codec/kv_desc.h"
#include "codec/page_codec.h"
#include "common/api_call.h"
#include "common/error.h"
#include "common/log.h"
#include "common/params.h"
#include "common/struct_abi.h"
#include "cuda/cuda_check.h"
#include "cuda/device_codec.h"
#include "cuda/device_guard.h"
#include "nccl_backend/nccl_internal.h"
#include "xfer/protocol.h"

using kvxfer::set_error;
using kvxfer::strprintf;

namespace kvxfer {
KVXFER_STRUCT_ABI(kvxfer_nccl_config_t, "NCCL config", KVXFER_NCCL_CONFIG_INITIALIZER,
                  sizeof(kvxfer_nccl_config_t));
KVXFER_STRUCT_ABI(kvxfer_nccl_op_t, "kvxfer_nccl_op_t", KVXFER_NCCL_OP_INITIALIZER,
                  sizeof(kvxfer_nccl_op_t));
}  // namespace kvxfer

namespace kvxfer::nccl {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

kvxfer_result_t nccl_fail(ncclResult_t r, const char* what, ncclComm_t c) {
  const char* last = c != nullptr ? ncclGetLastError(c) : ncclGetLastError(nullptr);
  return set_error(KVXFER_ERR_SYSTEM, "%s failed: %s%s%s", what, ncclGetErrorString(r),
                   last != nullptr && *last ? ": " : "", last != nullptr ? last : "");
}

kvxfer_result_t async_state(ncclComm_t comm, const char* what, bool* busy) {
  ncclResult_t a = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(comm, &a);
  if (q != ncclSuccess) return nccl_fail(q, "ncclCommGetAsyncError", comm);
  if (a != ncclSuccess && a != ncclInProgress) {
    nccl_fail(a, what, comm);
    return set_error(KVXFER_ERR_SYSTEM, "%s", last_error());
  }
  if (busy != nullptr) *busy = a == ncclInProgress;
  return KVXFER_SUCCESS;
}

kvxfer_result_t wait_idle(ncclComm_t comm, int64_t timeout_ms, std::chrono::microseconds period,
                          const char* what, const char* late, const char* hint) {
  return poll_until(timeout_ms, period, what, late, hint, [&](bool* done) {
    bool busy = false;
    const kvxfer_result_t r = async_state(comm, what, &busy);
    *done = !busy;
    return r;
  });
}

namespace {

kvxfer_result_t check_comm(kvxfer_nccl_comm_t c) {
  KVXFER_REQUIRE(c != nullptr, "NULL communicator");
  if (c->aborted)
    return set_error(KVXFER_ERR_INVALID_USAGE, "communicator aborted (%s)", c->abort_why.c_str());
  return KVXFER_SUCCESS;
}

/** Polls a non-blocking communicator until what it is doing (its init, a finalize) is done. */
kvxfer_result_t wait_init(ncclComm_t comm, int64_t timeout_ms, const char* what) {
  return wait_idle(comm, timeout_ms, std::chrono::microseconds(100), what, "not done",
                   "a rank missing?");
}

/** Streams and events of a communicator whose NCCL communicators are set. */
kvxfer_result_t make_streams(kvxfer_nccl_comm_s* c) {
  KVXFER_CHECK(cuda::create_anchor_stream(&c->astream));
  int least = 0, greatest = 0;
  KVXFER_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  KVXFER_CUDA_CHECK(cudaStreamCreateWithPriority(&c->rstream, cudaStreamNonBlocking, least));
  KVXFER_CUDA_CHECK(cudaEventCreateWithFlags(&c->aevent, cudaEventDisableTiming));
  KVXFER_CUDA_CHECK(cudaEventCreateWithFlags(&c->revent, cudaEventDisableTiming));
  KVXFER_CUDA_CHECK(cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming));
  return KVXFER_SUCCESS;
}

/** Frees streams/events/parked buffers once the streams are idle; false if they never got idle. */
bool release_streams(kvxfer_nccl_comm_s* c, int64_t timeout_ms) {
  const int64_t end = now_ns() + timeout_ms * 1000000;
  for (cudaStream_t s : {c->astream, c->rstream}) {
    if (s == nullptr) continue;
    while (cudaStreamQuery(s) == cudaErrorNotReady) {
      if (now_ns() > end) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  c->parked.clear();
  c->bufs.clear();
  c->desc.reset();
  c->hdesc.reset();
  if (c->ready) cudaEventDestroy(c->ready);
  c->ready = nullptr;
  if (c->aevent) cudaEventDestroy(c->aevent);
  if (c->revent) cudaEventDestroy(c->revent);
  if (c->astream) cudaStreamDestroy(c->astream);
  if (c->rstream) cudaStreamDestroy(c->rstream);
  c->aevent = c->revent = nullptr;
  c->astream = c->rstream = nullptr;
  return true;
}

}  // namespace

size_t status_block_bytes() { return kStatusBlock; }

kvxfer_result_t check_config(const kvxfer_nccl_config_t* cfg, Options* out) {
  Options o;
  o.timeout_ms = params::TimeoutMs();
  if (cfg != nullptr) {
    KVXFER_CHECK(check_struct_in_place(cfg));
    KVXFER_REQUIRE(cfg->anchor_traffic_class >= -1,
                   "anchor_traffic_class %d: use -1 (unset) or a class >= 0",
                   cfg->anchor_traffic_class);
    KVXFER_REQUIRE(cfg->residual_traffic_class >= -1,
                   "residual_traffic_class %d: use -1 (unset) or a class >= 0",
                   cfg->residual_traffic_class);
    KVXFER_REQUIRE(cfg->timeout_ms >= 0, "timeout_ms %d is negative (0 = KVXFER_TIMEOUT_MS)",
                   cfg->timeout_ms);
    o.anchor_tc = cfg->anchor_traffic_class;
    o.residual_tc = cfg->residual_traffic_class;
    if (cfg->timeout_ms > 0) o.timeout_ms = cfg->timeout_ms;
  }
  *out = o;
  return KVXFER_SUCCESS;
}

kvxfer_result_t validate_op(const kvxfer_nccl_op_t* op, int index, int nranks, int device) {
  KVXFER_REQUIRE(op != nullptr, "op %d is NULL", index);
  const std::string prefix = strprintf("op %d: ", index);
  KVXFER_CHECK(check_struct_in_place(op, prefix.c_str()));
  KVXFER_REQUIRE(op->is_send == 0 || op->is_send == 1, "op %d: is_send %d is not 0 or 1", index,
                 op->is_send);
  KVXFER_REQUIRE(op->peer >= 0 && op->peer < nranks,
                 "op %d: peer %d is not a rank of this %d-rank communicator", index, op->peer,
                 nranks);
  const kvxfer_kv_desc_t* kv = op->kv;
  codec::KvDesc shape;
  KVXFER_CHECK(codec::validate_kv_desc(kv, codec::KvAccess::kNone, prefix, &shape));
  // The call reads *kv and *codec in place: they must have every field.
  KVXFER_CHECK(check_struct_in_place(kv, prefix.c_str()));
  if (kv->device == -1)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "op %d: the KV is in host memory (device -1); the NCCL backend moves device "
                     "KV: use kvxfer_send/kvxfer_recv for host memory",
                     index);
  KVXFER_REQUIRE(kv->device == device,
                 "op %d: the KV is on CUDA device %d, the communicator on device %d", index,
                 kv->device, device);
  if (kv->num_tokens > 0) {
    for (int32_t l = 0; l < kv->num_layers; ++l)
      for (kvxfer_kv_kind_t k : {KVXFER_KV_KEY, KVXFER_KV_VALUE}) {
        const size_t base = static_cast<size_t>(l) * static_cast<size_t>(kv->num_blocks);
        kvxfer_page_layout_t pl{};
        pl.blocks = (k == KVXFER_KV_KEY ? kv->k_blocks : kv->v_blocks) + base;
        pl.num_blocks = kv->num_blocks;
        pl.block_size = kv->block_size;
        pl.row_stride = shape.row_stride;
        pl.first_token = 0;
        pl.num_tokens = kv->num_tokens;
        pl.num_channels = static_cast<int32_t>(shape.channels);
        pl.dtype = kv->dtype;
        const kvxfer_result_t v =
            cuda::validate_device_layout(&pl, op->is_send ? "source" : "destination");
        if (v < 0)
          return set_error(v, "op %d: layer %d %s: %s", index, l, codec::kv_kind_name(k),
                           last_error());
      }
  }
  if (op->is_send) {
    kvxfer_codec_config_t cc = KVXFER_CODEC_CONFIG_INITIALIZER;
    if (op->codec != nullptr) {
      KVXFER_CHECK(check_struct_in_place(op->codec, prefix.c_str()));
      cc = *op->codec;
    }
    if (cc.codec == KVXFER_CODEC_LYNX && cc.alpha == KVXFER_ALPHA_AUTO)
      return set_error(KVXFER_ERR_UNSUPPORTED,
                       "op %d: alpha=auto is not available on the GPU path; calibrate on the host "
                       "(kvxfer_codec_calibrate_alpha) and pass the chosen alpha",
                       index);
    const codec::PageCodec* pc = codec::page_codec(cc.codec);
    if (pc != nullptr && !pc->on_device())
      return set_error(KVXFER_ERR_UNSUPPORTED,
                       "op %d: codec %s has no GPU encoder; the NCCL backend moves device "
                       "KV only (use kvxfer_send_spectrum from host memory)",
                       index, pc->name());
    const kvxfer_result_t v = codec::validate_config(&cc);
    if (v < 0) return set_error(v, "op %d: %s", index, last_error());
    const int32_t op_mode = c_enum_value(op->mode);
    KVXFER_REQUIRE(op_mode == KVXFER_MODE_AUTO || op_mode == KVXFER_MODE_PROGRESSIVE ||
                       op_mode == KVXFER_MODE_MONOLITHIC,
                   "op %d: mode %d is not AUTO, PROGRESSIVE or MONOLITHIC", index, op_mode);
    const kvxfer_mode_t mode = xfer::resolve_mode(op->mode, cc);
    KVXFER_REQUIRE(!(mode == KVXFER_MODE_PROGRESSIVE && cc.codec == KVXFER_CODEC_BF16),
                   "op %d: BF16 passthrough has no residual: use MONOLITHIC or AUTO mode", index);
    KVXFER_REQUIRE(op->page_tokens >= 0, "op %d: page_tokens %d is negative", index,
                   op->page_tokens);
  }
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::nccl

namespace kvxfer::nccl {
namespace {
/** kvxfer_nccl_xfer_on_stream (stream NULL: kvxfer_nccl_xfer). */
kvxfer_result_t nccl_xfer(kvxfer_nccl_comm_t comm, kvxfer_nccl_op_t* ops, int num_ops,
                          cudaStream_t stream) {
  {
    KVXFER_REQUIRE(comm != nullptr, "NULL communicator");
    KVXFER_REQUIRE(num_ops >= 0, "num_ops %d is negative", num_ops);
    KVXFER_REQUIRE(num_ops == 0 || ops != nullptr, "NULL ops with num_ops %d", num_ops);
    for (int i = 0; i < num_ops; ++i)
      KVXFER_CHECK(validate_op(&ops[i], i, comm->nranks, comm->device));
    KVXFER_CHECK(check_comm(comm));
    for (int i = 0; i < num_ops; ++i) {
      kvxfer_nccl_op_t& o = ops[i];
      o.stage = KVXFER_STAGE_POSTED;
      o.result = KVXFER_IN_PROGRESS;
      o.error[0] = '\0';
      o.num_pages = 0;
      o.anchor_wire_bytes = o.residual_wire_bytes = 0;
      o.t_anchor_ready_ns = o.t_complete_ns = 0;
    }
    if (num_ops == 0) return KVXFER_SUCCESS;
    kvxfer::cuda::DeviceGuard dg;  // the caller's device is given back on return
    KVXFER_CHECK(dg.set(comm->device));
    // Stream order: record the caller's stream now (NULL: the legacy default
    // stream); every kernel and copy of the call waits on it.
    const cudaError_t e =
        cudaEventRecord(comm->ready, stream != nullptr ? stream : cudaStreamLegacy);
    if (e != cudaSuccess)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                       "CUDA device %d: recording an event on the caller's stream %p failed (%s); "
                       "the stream must belong to the communicator's device",
                       comm->device, static_cast<void*>(stream), cudaGetErrorString(e));
    return run_call(comm, ops, num_ops, true);
  }
}
}  // namespace
}  // namespace kvxfer::nccl

// ---------------------------------------------------------------------------
// Exported C API
// ---------------------------------------------------------------------------
using kvxfer::api_call;
namespace knccl = kvxfer::nccl;

extern "C" {

kvxfer_result_t kvxfer_nccl_comm_init(kvxfer_nccl_comm_t* comm, int nranks, ncclUniqueId anchor_id,
                                      ncclUniqueId residual_id, int rank, int device,
                                      const kvxfer_nccl_config_t* config) {
  kvxfer::reset_outputs(comm);
  return api_call("kvxfer_nccl_comm_init", [&]() -> kvxfer_result_t {
    KVXFER_REQUIRE(comm != nullptr, "NULL communicator output");
    KVXFER_REQUIRE(nranks >= 1, "nranks %d must be at least 1", nranks);
    KVXFER_REQUIRE(rank >= 0 && rank < nranks, "rank %d is outside [0, %d)", rank, nranks);
    KVXFER_REQUIRE(device >= -1, "device %d is not -1 (current) or a CUDA ordinal", device);
    KVXFER_REQUIRE(std::memcmp(&anchor_id, &residual_id, sizeof(ncclUniqueId)) != 0,
                   "the anchor and residual ids are equal: call ncclGetUniqueId twice");
    knccl::Options opt;
    KVXFER_CHECK(knccl::check_config(config, &opt));
    // The communicator's device for the calls below; the caller's current
    // device is given back on return (kvxfer::cuda::DeviceGuard).
    kvxfer::cuda::DeviceGuard dg;
    int dev = 0;
    KVXFER_CUDA_CHECK(cudaGetDevice(&dev));
    if (device >= 0) dev = device;
    KVXFER_CHECK(dg.set(dev));

    auto c = std::make_unique<kvxfer_nccl_comm_s>();
    c->owned = true;
    c->device = dev;
    c->nranks = nranks;
    c->rank = rank;
    c->opt = opt;
    // On any failure below: abort what exists, free the rest.
    struct Guard {
      kvxfer_nccl_comm_s* c;
      bool armed = true;
      ~Guard() {
        if (!armed) return;
        if (c->anchor) ncclCommAbort(c->anchor);
        if (c->residual) ncclCommAbort(c->residual);
        c->anchor = c->residual = nullptr;
        knccl::release_streams(c, 1000);
      }
    } guard{c.get()};

    const ncclUniqueId ids[2] = {anchor_id, residual_id};
    const int32_t tcs[2] = {opt.anchor_tc, opt.residual_tc};
    ncclComm_t* outs[2] = {&c->anchor, &c->residual};
    const char* names[2] = {"kvxfer-anchor", "kvxfer-residual"};
    for (int i = 0; i < 2; ++i) {  // both created before either is waited for
      ncclConfig_t nc = NCCL_CONFIG_INITIALIZER;
      nc.blocking = 0;
      if (tcs[i] >= 0) nc.trafficClass = tcs[i];
      nc.commName = names[i];
      const ncclResult_t r = ncclCommInitRankConfig(outs[i], nranks, ids[i], rank, &nc);
      if (r != ncclSuccess && r != ncclInProgress)
        return knccl::nccl_fail(r, "ncclCommInitRankConfig", *outs[i]);
    }
    KVXFER_CHECK(knccl::wait_init(c->anchor, opt.timeout_ms, "anchor communicator init"));
    KVXFER_CHECK(knccl::wait_init(c->residual, opt.timeout_ms, "residual communicator init"));
    KVXFER_CHECK(knccl::make_streams(c.get()));
    KVXFER_INFO(LOG_INIT,
                "NCCL backend: rank %d/%d on device %d, anchor trafficClass %d, residual %d", rank,
                nranks, dev, opt.anchor_tc, opt.residual_tc);
    guard.armed = false;
    *comm = c.release();
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_nccl_comm_init_from_comms(kvxfer_nccl_comm_t* comm, ncclComm_t anchor_comm,
                                                 ncclComm_t residual_comm,
                                                 const kvxfer_nccl_config_t* config) {
  kvxfer::reset_outputs(comm);
  return api_call("kvxfer_nccl_comm_init_from_comms", [&]() -> kvxfer_result_t {
    KVXFER_REQUIRE(comm != nullptr, "NULL communicator output");
    KVXFER_REQUIRE(anchor_comm != nullptr && residual_comm != nullptr,
                   "both NCCL communicators must be given");
    KVXFER_REQUIRE(anchor_comm != residual_comm,
                   "the anchor and residual communicators are the same: create two, one per "
                   "traffic class (docs/NCCL.md)");
    knccl::Options opt;
    KVXFER_CHECK(knccl::check_config(config, &opt));
    int n[2], r[2], d[2];
    ncclComm_t cs[2] = {anchor_comm, residual_comm};
    for (int i = 0; i < 2; ++i) {
      ncclResult_t a = ncclSuccess;
      ncclResult_t q = ncclCommGetAsyncError(cs[i], &a);
      if (q != ncclSuccess) return knccl::nccl_fail(q, "ncclCommGetAsyncError", cs[i]);
      KVXFER_REQUIRE(a == ncclSuccess, "the %s communicator is not ready (%s)",
                     i == 0 ? "anchor" : "residual", ncclGetErrorString(a));
      q = ncclCommCount(cs[i], &n[i]);
      if (q == ncclSuccess) q = ncclCommUserRank(cs[i], &r[i]);
      if (q == ncclSuccess) q = ncclCommCuDevice(cs[i], &d[i]);
      if (q != ncclSuccess) return knccl::nccl_fail(q, "ncclCommCount/UserRank/CuDevice", cs[i]);
    }
    KVXFER_REQUIRE(n[0] == n[1] && r[0] == r[1] && d[0] == d[1],
                   "the communicators differ: %d/%d ranks, rank %d/%d, device %d/%d (anchor/"
                   "residual)",
                   n[0], n[1], r[0], r[1], d[0], d[1]);
    kvxfer::cuda::DeviceGuard dg;  // the caller's device is given back on return
    KVXFER_CHECK(dg.set(d[0]));
    auto c = std::make_unique<kvxfer_nccl_comm_s>();
    c->anchor = anchor_comm;
    c->residual = residual_comm;
    c->owned = false;
    c->device = d[0];
    c->nranks = n[0];
    c->rank = r[0];
    c->opt = opt;
    const kvxfer_result_t s = knccl::make_streams(c.get());
    if (s < 0) {
      knccl::release_streams(c.get(), 1000);
      return s;
    }
    *comm = c.release();
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_nccl_comm_abort(kvxfer_nccl_comm_t comm) {
  return api_call("kvxfer_nccl_comm_abort", [&]() -> kvxfer_result_t {
    KVXFER_REQUIRE(comm != nullptr, "NULL communicator");
    if (comm->aborted) return KVXFER_SUCCESS;
    comm->aborted = true;
    comm->abort_why = "kvxfer_nccl_comm_abort was called";
    if (comm->owned) {
      if (comm->anchor) ncclCommAbort(comm->anchor);
      if (comm->residual) ncclCommAbort(comm->residual);
      comm->anchor = comm->residual = nullptr;
    }
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_nccl_comm_destroy(kvxfer_nccl_comm_t comm) {
  return api_call("kvxfer_nccl_comm_destroy", [&]() -> kvxfer_result_t {
    if (comm == nullptr) return KVXFER_SUCCESS;
    kvxfer::cuda::DeviceGuard dg;  // declared first: restored after the buffers are freed
    std::unique_ptr<kvxfer_nccl_comm_s> c(comm);
    (void)dg.set(c->device);
    kvxfer_result_t result = KVXFER_SUCCESS;
    if (c->owned && !c->aborted) {
      // Finalize (non-blocking: polled under the timeout), then destroy; abort if it stalls.
      for (ncclComm_t* p : {&c->anchor, &c->residual}) {
        if (*p == nullptr) continue;
        ncclResult_t r = ncclCommFinalize(*p);
        kvxfer_result_t w = KVXFER_SUCCESS;
        if (r == ncclSuccess || r == ncclInProgress)
          w = knccl::wait_init(*p, c->opt.timeout_ms, "ncclCommFinalize");
        if (r != ncclSuccess && r != ncclInProgress)
          w = knccl::nccl_fail(r, "ncclCommFinalize", *p);
        if (w < 0) {
          result = w;
          ncclCommAbort(*p);
        } else {
          ncclCommDestroy(*p);
        }
        *p = nullptr;
      }
    } else if (c->owned) {
      if (c->anchor) ncclCommAbort(c->anchor);
      if (c->residual) ncclCommAbort(c->residual);
    }
    c->anchor = c->residual = nullptr;
    if (!knccl::release_streams(c.get(), c->opt.timeout_ms)) {
      // Work still pending on kvxfer's streams (user communicators not aborted):
      // its buffers cannot be freed safely; leak them rather than corrupt memory.
      auto* leaked = c.release();
      (void)leaked;
      return set_error(KVXFER_ERR_TIMEOUT,
                       "kvxfer_nccl_comm_destroy: operations still pending on kvxfer's streams "
                       "after %" PRId64
                       " ms (abort the NCCL communicators first); their buffers "
                       "are leaked",
                       comm->opt.timeout_ms);
    }
    return result;
  });
}

kvxfer_result_t kvxfer_nccl_comm_count(kvxfer_nccl_comm_t comm, int* nranks) {
  return api_call("kvxfer_nccl_comm_count", [&]() -> kvxfer_result_t {
    KVXFER_REQUIRE(comm != nullptr && nranks != nullptr, "NULL argument");
    *nranks = comm->nranks;
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_nccl_comm_user_rank(kvxfer_nccl_comm_t comm, int* rank) {
  return api_call("kvxfer_nccl_comm_user_rank", [&]() -> kvxfer_result_t {
    KVXFER_REQUIRE(comm != nullptr && rank != nullptr, "NULL argument");
    *rank = comm->rank;
    return KVXFER_SUCCESS;
  });
}

kvxfer_result_t kvxfer_nccl_xfer(kvxfer_nccl_comm_t comm, kvxfer_nccl_op_t* ops, int num_ops) {
  return api_call("kvxfer_nccl_xfer",
                  [&] { return knccl::nccl_xfer(comm, ops, num_ops, nullptr); });
}

kvxfer_result_t kvxfer_nccl_xfer_on_stream(kvxfer_nccl_comm_t comm, kvxfer_nccl_op_t* ops,
                                           int num_ops, cudaStream_t stream) {
  return api_call("kvxfer_nccl_xfer_on_stream",
                  [&] { return knccl::nccl_xfer(comm, ops, num_ops, stream); });
}

const char* kvxfer_nccl_get_last_error(void) { return kvxfer::last_error(); }

}  // extern "C"
