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
#include "nccl/nccl_backend.h"

#include <cuda_runtime.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "api/api_call.h"
#include "codec/codec.h"
#include "codec/format.h"
#include "codec/kv_desc.h"
#include "codec/page_codec.h"
#include "common/error.h"
#include "common/log.h"
#include "common/params.h"
#include "common/struct_abi.h"
#include "cuda/cuda_check.h"
#include "cuda/device_codec.h"
#include "cuda/device_guard.h"
#include "xfer/protocol.h"

using kvxfer::set_error;
using kvxfer::strprintf;

namespace kvxfer {
KVXFER_STRUCT_ABI(kvxfer_nccl_config_t, "NCCL config", KVXFER_NCCL_CONFIG_INITIALIZER,
                  sizeof(kvxfer_nccl_config_t));
KVXFER_STRUCT_ABI(kvxfer_nccl_op_t, "kvxfer_nccl_op_t", KVXFER_NCCL_OP_INITIALIZER,
                  sizeof(kvxfer_nccl_op_t));
}  // namespace kvxfer

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
namespace {

constexpr size_t kStatusBlock = xfer::kStatusHeaderBytes + xfer::kMaxStatusText;  // 1040
static_assert(kStatusBlock % 8 == 0, "lengths after the status block stay 8-byte aligned");

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

kvxfer_result_t nccl_fail(ncclResult_t r, const char* what, ncclComm_t c = nullptr) {
  const char* last = c != nullptr ? ncclGetLastError(c) : ncclGetLastError(nullptr);
  return set_error(KVXFER_ERR_SYSTEM, "%s failed: %s%s%s", what, ncclGetErrorString(r),
                   last != nullptr && *last ? ": " : "", last != nullptr ? last : "");
}

/** NCCL's asynchronous state of `comm`.  An error fails `what`
 *  (KVXFER_ERR_SYSTEM); `*busy`, when given, tells whether an operation (its
 *  init, a group) is still in progress. */
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
                          const char* what, const char* late, const char* hint) {
  return poll_until(timeout_ms, period, what, late, hint, [&](bool* done) {
    bool busy = false;
    const kvxfer_result_t r = async_state(comm, what, &busy);
    *done = !busy;
    return r;
  });
}

// ---- RAII -------------------------------------------------------------------
using DevBuf = cuda::DeviceBuffer;
using HostBuf = cuda::PinnedBuffer;  // page-locked, so copies are asynchronous and fast

/**
 * At least `bytes` in *b: the buffer kept from an earlier call when it is
 * large enough, else a new one (Buf::alloc; the error as a kvxfer_result_t).
 */
template <class Buf>
kvxfer_result_t alloc(Buf* b, size_t bytes) {
  if (b->p != nullptr && b->n >= bytes) return KVXFER_SUCCESS;
  KVXFER_CUDA_CHECK(b->alloc(bytes));
  return KVXFER_SUCCESS;
}

/** Scratch for pages of up to T x H under any codec (the worst case), kept in `b`. */
kvxfer_result_t reserve_scratch(OpBuffers* b, int64_t T, int32_t H) {
  if (b->scratch.status() != nullptr && T <= b->scratch_tokens && H <= b->scratch_channels)
    return KVXFER_SUCCESS;
  const int64_t t = std::max(T, b->scratch_tokens);
  const int32_t h = std::max(H, b->scratch_channels);
  b->scratch_tokens = 0;
  b->scratch_channels = 0;
  kvxfer_codec_config_t worst = KVXFER_CODEC_CONFIG_INITIALIZER;  // as src/cuda/xfer_device.cc
  worst.codec = KVXFER_CODEC_INT8;
  worst.anchor_bits = 2;
  worst.chunk_tokens = 16;
  worst.nonfinite = KVXFER_NONFINITE_RAW;
  KVXFER_CHECK(cuda::alloc_scratch(&worst, t, h, &b->scratch));
  b->scratch_tokens = t;
  b->scratch_channels = h;
  return KVXFER_SUCCESS;
}

// ---- per-op state -------------------------------------------------------------
struct OpState {
  explicit OpState(OpBuffers& b)
      : buffers(b),
        ktable(b.ktable),
        vtable(b.vtable),
        hmeta(b.hmeta),
        hanc(b.hanc),
        hres(b.hres),
        hstat(b.hstat),
        dmeta(b.dmeta),
        danc(b.danc),
        dres(b.dres),
        dstat(b.dstat),
        scratch(b.scratch) {}
  OpBuffers& buffers;  // the communicator's, for this op index
  kvxfer_nccl_op_t* op = nullptr;
  int index = 0;
  bool final = false;    // COMPLETE or ERROR published
  bool in_data = false;  // both sides passed P2: P3..P5 flow
  bool failed = false;   // this side's data path failed (receiver: reported in P5)
  kvxfer_result_t fail_r = KVXFER_SUCCESS;
  std::string fail_text;

  xfer::Desc mine, peer;
  kvxfer_codec_config_t codec{};  // the sender's
  kvxfer_mode_t mode = KVXFER_MODE_AUTO;
  int32_t H = 0;
  int64_t row_stride = 0;
  std::vector<xfer::PageRef> pages;
  DevBuf &ktable, &vtable;

  std::vector<uint64_t> alen, rlen, aoff, roff;
  uint64_t atot = 0, rtot = 0;
  // Receiver: the codebooks of the decodes enqueued, held until the streams
  // have passed them (a cache eviction meanwhile must not free their tables).
  std::vector<cuda::DeviceCodebook> codebooks;
  HostBuf &hmeta, &hanc, &hres, &hstat;
  DevBuf &dmeta, &danc, &dres, &dstat;
  cuda::DeviceScratch& scratch;

  kvxfer_page_layout_t layout(const xfer::PageRef& p) const {
    kvxfer_page_layout_t l{};
    const auto* table =
        reinterpret_cast<void* const*>((p.kind == KVXFER_KV_KEY ? ktable : vtable).p);
    const kvxfer_kv_desc_t& kv = *op->kv;
    l.blocks = table + static_cast<size_t>(p.layer) * static_cast<size_t>(kv.num_blocks);
    l.num_blocks = kv.num_blocks;
    l.block_size = kv.block_size;
    l.row_stride = row_stride;
    l.first_token = p.token_begin;
    l.num_tokens = p.num_tokens;
    l.num_channels = H;
    l.dtype = kv.dtype;
    return l;
  }
  kvxfer_page_id_t page_id(const xfer::PageRef& p) const {
    kvxfer_page_id_t id{};
    id.layer = static_cast<uint32_t>(p.layer);
    id.kind = p.kind;
    id.token_begin = p.token_begin;
    id.stream_id = mine.tag;
    return id;
  }
  size_t meta_bytes() const { return kStatusBlock + 16 * pages.size(); }
};

}  // namespace
}  // namespace kvxfer::nccl

struct ParkedCall {
  std::vector<std::unique_ptr<kvxfer::nccl::OpState>> ops;
  std::vector<std::unique_ptr<kvxfer::nccl::OpBuffers>> bufs;  // the ops' buffers
  kvxfer::nccl::DevBuf desc;
  kvxfer::nccl::HostBuf hdesc;
};

namespace kvxfer::nccl {
namespace {

void fill_status_block(uint8_t* dst, kvxfer_result_t r, const std::string& text) {
  std::memset(dst, 0, kStatusBlock);
  const std::vector<uint8_t> b = xfer::encode_status(r, text);
  std::memcpy(dst, b.data(), b.size());
}
kvxfer_result_t read_status_block(const uint8_t* src, kvxfer_result_t* r, std::string* text) {
  uint32_t n = 0;
  std::memcpy(&n, src + 12, 4);
  if (n > xfer::kMaxStatusText)
    return set_error(KVXFER_ERR_CORRUPT, "status block claims %u bytes of text", n);
  return xfer::decode_status(src, xfer::kStatusHeaderBytes + n, r, text);
}

/** One kvxfer_nccl_xfer call. */
class Call {
 public:
  /** wait_ready: c->ready was recorded on the caller's stream; kvxfer's streams wait on it. */
  Call(kvxfer_nccl_comm_t c, kvxfer_nccl_op_t* ops, int n, bool wait_ready)
      : c_(c), desc_(c->desc), wait_ready_(wait_ready) {
    while (c->bufs.size() < static_cast<size_t>(n))
      c->bufs.push_back(std::make_unique<OpBuffers>());
    for (int i = 0; i < n; ++i) {
      auto s = std::make_unique<OpState>(*c->bufs[static_cast<size_t>(i)]);
      s->op = &ops[i];
      s->index = i;
      st_.push_back(std::move(s));
    }
  }
  kvxfer_result_t run();

 private:
  kvxfer_nccl_comm_t c_;
  std::vector<std::unique_ptr<OpState>> st_;
  DevBuf& desc_;  // the communicator's
  bool wait_ready_ = false;
  bool fatal_ = false;

  // ---- outcome of one op ----
  void finish(OpState& s, kvxfer_result_t r, const std::string& text) {
    if (s.final) return;
    s.final = true;
    kvxfer_nccl_op_t& o = *s.op;
    o.result = r;
    o.stage = r == KVXFER_SUCCESS ? KVXFER_STAGE_COMPLETE : KVXFER_STAGE_ERROR;
    std::snprintf(o.error, sizeof(o.error), "%s", text.c_str());
    if (r == KVXFER_SUCCESS) o.t_complete_ns = now_ns();
    if (r < 0)
      KVXFER_INFO(LOG_NET, "nccl op %d (%s peer %d): %s", s.index, o.is_send ? "send" : "recv",
                  o.peer, text.c_str());
    if (o.on_complete != nullptr) o.on_complete(s.index, o.stage, r, o.user_data);
  }
  void anchor_ready(OpState& s) {
    kvxfer_nccl_op_t& o = *s.op;
    o.t_anchor_ready_ns = now_ns();
    if (o.on_anchor_ready != nullptr)
      o.on_anchor_ready(s.index, KVXFER_STAGE_ANCHOR_READY, KVXFER_SUCCESS, o.user_data);
  }
  /** Marks this side's data path failed (the first reason is kept). */
  void mark_failed(OpState& s, kvxfer_result_t r, const std::string& text) {
    if (s.failed) return;
    s.failed = true;
    s.fail_r = r;
    s.fail_text = text;
  }

  /** A timeout or NCCL/CUDA failure: abort, fail everything, park the buffers. */
  kvxfer_result_t fatal(kvxfer_result_t r) {
    const std::string why = last_error();
    fatal_ = true;
    c_->aborted = true;
    c_->abort_why = why;
    if (c_->owned) {
      if (c_->anchor != nullptr) ncclCommAbort(c_->anchor);
      if (c_->residual != nullptr) ncclCommAbort(c_->residual);
      c_->anchor = c_->residual = nullptr;
    }
    KVXFER_WARN(LOG_NET, "NCCL backend: %s; communicator %s", why.c_str(),
                c_->owned ? "aborted" : "unusable (abort the user's communicators)");
    for (auto& s : st_) finish(*s, r, why);
    // Work may still be pending on the streams: the buffers go with the
    // parked call (freed at destroy, once the streams are idle); a later
    // call starts new ones.
    auto p = std::make_shared<ParkedCall>();
    p->ops = std::move(st_);
    p->bufs = std::move(c_->bufs);
    c_->bufs.clear();
    p->desc = std::move(c_->desc);
    p->hdesc = std::move(c_->hdesc);
    c_->parked.push_back(std::move(p));
    return set_error(r, "%s", why.c_str());
  }

  /** ncclGroupStart; issue(); ncclGroupEnd; then waits until NCCL has enqueued it. */
  template <typename F>
  kvxfer_result_t group(ncclComm_t comm, const char* phase, F&& issue) {
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return nccl_fail(r, "ncclGroupStart");
    const kvxfer_result_t ir = issue();
    r = ncclGroupEnd();
    if (ir < 0) return ir;
    if (r != ncclSuccess && r != ncclInProgress) {
      nccl_fail(r, "ncclGroupEnd", comm);
      return set_error(KVXFER_ERR_SYSTEM, "%s: %s", phase, last_error());
    }
    return wait_idle(comm, c_->opt.timeout_ms, std::chrono::microseconds(20), phase,
                     "NCCL did not enqueue the group", "a peer missing?");
  }

  /** Waits for everything enqueued so far on `stream`, polling both communicators. */
  kvxfer_result_t wait(cudaStream_t stream, cudaEvent_t ev, const char* phase) {
    KVXFER_CUDA_CHECK(cudaEventRecord(ev, stream));
    return poll_until(c_->opt.timeout_ms, std::chrono::microseconds(20), phase, "no completion",
                      "peer dead or not posting", [&](bool* done) {
                        const cudaError_t e = cudaEventQuery(ev);
                        if (e == cudaSuccess) {
                          *done = true;
                          return KVXFER_SUCCESS;
                        }
                        if (e != cudaErrorNotReady) return cuda::cuda_result(e, phase);
                        for (ncclComm_t comm : {c_->anchor, c_->residual})
                          if (const kvxfer_result_t r = async_state(comm, phase, nullptr); r < 0)
                            return r;
                        return KVXFER_SUCCESS;
                      });
  }

  kvxfer_result_t setup();
  kvxfer_result_t phase_desc();
  kvxfer_result_t encode_all();
  kvxfer_result_t phase_lengths();
  kvxfer_result_t phase_data();
  kvxfer_result_t phase_status();
  void decode_pages(OpState& s, bool full, cudaStream_t stream);
};

#define NCCLB_FATAL(call)                              \
  do {                                                 \
    const kvxfer_result_t nb_r_ = (call);              \
    if (nb_r_ < 0) {                                   \
      ::kvxfer::breadcrumb(__FILE__, __LINE__, nb_r_); \
      return fatal(nb_r_);                             \
    }                                                  \
  } while (0)

// Block tables to the device (nothing has been sent yet: failures are plain errors).
kvxfer_result_t Call::setup() {
  for (auto& sp : st_) {
    OpState& s = *sp;
    const kvxfer_nccl_op_t& o = *s.op;
    const kvxfer_kv_desc_t& kv = *o.kv;
    s.H = kv.kv_heads * kv.head_dim;
    s.row_stride = kv.row_stride == 0 ? s.H : kv.row_stride;
    s.mine.is_sender = o.is_send != 0;
    s.mine.tag = o.tag;
    s.mine.num_layers = kv.num_layers;
    s.mine.kv_heads = kv.kv_heads;
    s.mine.head_dim = kv.head_dim;
    s.mine.dtype = kv.dtype;
    s.mine.num_tokens = kv.num_tokens;
    if (o.is_send) {
      kvxfer_codec_config_t cc = KVXFER_CODEC_CONFIG_INITIALIZER;
      if (o.codec != nullptr) cc = *o.codec;
      s.mine.codec = cc;
      s.mine.mode = xfer::resolve_mode(o.mode, cc);
      s.mine.page_tokens =
          o.page_tokens > 0 ? o.page_tokens : static_cast<int32_t>(params::PageTokens());
    }
    if (kv.num_tokens > 0) {
      const size_t n = static_cast<size_t>(kv.num_layers) * static_cast<size_t>(kv.num_blocks);
      KVXFER_CHECK(alloc(&s.ktable, n * sizeof(void*)));
      KVXFER_CHECK(alloc(&s.vtable, n * sizeof(void*)));
      // In stream order before every kernel that reads them (the residual
      // stream waits for the anchor stream before it decodes).  Pageable
      // source: staged by the runtime before the call returns.
      KVXFER_CUDA_CHECK(cudaMemcpyAsync(s.ktable.p, kv.k_blocks, n * sizeof(void*),
                                        cudaMemcpyHostToDevice, c_->astream));
      KVXFER_CUDA_CHECK(cudaMemcpyAsync(s.vtable.p, kv.v_blocks, n * sizeof(void*),
                                        cudaMemcpyHostToDevice, c_->astream));
    }
  }
  KVXFER_CHECK(alloc(&desc_, 2 * xfer::kDescBytes * st_.size()));
  KVXFER_CHECK(alloc(&c_->hdesc, 2 * xfer::kDescBytes * st_.size()));
  return KVXFER_SUCCESS;
}

// P1: descriptors both ways on the anchor communicator.
kvxfer_result_t Call::phase_desc() {
  const size_t host_bytes = 2 * xfer::kDescBytes * st_.size();
  uint8_t* host = c_->hdesc.p;  // pinned: the copies below are truly asynchronous
  for (size_t i = 0; i < st_.size(); ++i) {
    const std::vector<uint8_t> d = xfer::encode_desc(st_[i]->mine);
    std::memcpy(host + 2 * i * xfer::kDescBytes, d.data(), xfer::kDescBytes);
  }
  const cudaError_t e0 =
      cudaMemcpyAsync(desc_.p, host, host_bytes, cudaMemcpyHostToDevice, c_->astream);
  if (e0 != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e0, "cudaMemcpyAsync(desc)"));
  // Pairing on each (this rank -> peer) channel, where NCCL matches sends and
  // receives in issue order: every rank sends the descriptors of its send ops
  // first, then those of its recv ops, and receives into its recv ops first,
  // then its send ops.  So this rank's i-th send op to P meets P's i-th recv
  // op from here, and the reverse, also when P is this rank.
  NCCLB_FATAL(group(c_->anchor, "descriptor exchange", [&]() -> kvxfer_result_t {
    for (int pass = 0; pass < 2; ++pass)
      for (size_t i = 0; i < st_.size(); ++i) {
        if (st_[i]->mine.is_sender != (pass == 0)) continue;
        const ncclResult_t r = ncclSend(desc_.p + 2 * i * xfer::kDescBytes, xfer::kDescBytes,
                                        ncclUint8, st_[i]->op->peer, c_->anchor, c_->astream);
        if (r != ncclSuccess) return nccl_fail(r, "ncclSend(desc)", c_->anchor);
      }
    for (int pass = 0; pass < 2; ++pass)
      for (size_t i = 0; i < st_.size(); ++i) {
        if (st_[i]->mine.is_sender != (pass == 1)) continue;
        const ncclResult_t r = ncclRecv(desc_.p + (2 * i + 1) * xfer::kDescBytes, xfer::kDescBytes,
                                        ncclUint8, st_[i]->op->peer, c_->anchor, c_->astream);
        if (r != ncclSuccess) return nccl_fail(r, "ncclRecv(desc)", c_->anchor);
      }
    return KVXFER_SUCCESS;
  }));
  const cudaError_t e =
      cudaMemcpyAsync(host, desc_.p, host_bytes, cudaMemcpyDeviceToHost, c_->astream);
  if (e != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e, "cudaMemcpyAsync(desc)"));
  NCCLB_FATAL(wait(c_->astream, c_->aevent, "descriptor exchange"));

  for (size_t i = 0; i < st_.size(); ++i) {
    OpState& s = *st_[i];
    const uint8_t* theirs = host + (2 * i + 1) * xfer::kDescBytes;
    kvxfer_result_t r = xfer::decode_desc(theirs, xfer::kDescBytes, &s.peer);
    if (r == KVXFER_SUCCESS) r = xfer::compare_desc(s.mine, s.peer);
    if (r == KVXFER_SUCCESS && !s.mine.is_sender) {
      kvxfer_codec_config_t check = s.peer.codec;
      r = codec::validate_config(&check);
      if (r < 0)
        r = set_error(KVXFER_ERR_CORRUPT, "the sender's codec is invalid: %s", last_error());
    }
    if (r < 0) {
      finish(s, r, last_error());
      continue;
    }
    const xfer::Desc& snd = s.mine.is_sender ? s.mine : s.peer;
    s.codec = snd.codec;
    s.mode = snd.mode;
    s.pages = xfer::plan_pages(snd.num_layers, snd.num_tokens, snd.page_tokens);
    s.op->num_pages = static_cast<int64_t>(s.pages.size());
  }
  return KVXFER_SUCCESS;
}

// The sender encodes every page on the GPU into pinned host staging (headers
// and checksums sealed on the host by encode_page_device).
kvxfer_result_t Call::encode_all() {
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final || !s.mine.is_sender) continue;
    const size_t np = s.pages.size();
    s.alen.assign(np, 0);
    s.rlen.assign(np, 0);
    s.aoff.assign(np, 0);
    s.roff.assign(np, 0);
    size_t acap = 0, rcap = 0;
    for (const auto& p : s.pages) {
      size_t a = 0, r = 0;
      KVXFER_CHECK(codec::max_sizes(&s.codec, p.num_tokens, s.H, &a, &r));
      acap += a;
      rcap += r;
    }
    NCCLB_FATAL(alloc(&s.hanc, acap));
    NCCLB_FATAL(alloc(&s.hres, rcap));
    if (np > 0) NCCLB_FATAL(reserve_scratch(&s.buffers, s.mine.page_tokens, s.H));
    uint64_t ao = 0, ro = 0;
    for (size_t i = 0; i < np; ++i) {
      const xfer::PageRef& p = s.pages[i];
      const kvxfer_page_layout_t l = s.layout(p);
      const kvxfer_page_id_t id = s.page_id(p);
      size_t al = 0, rl = 0;
      const kvxfer_result_t r =
          cuda::encode_page_device(&s.codec, &id, &l, s.scratch, s.hanc.p + ao, acap - ao, &al,
                                   s.hres.p + ro, rcap - ro, &rl, c_->astream);
      if (r < 0) {
        mark_failed(s, r, last_error());
        break;
      }
      s.aoff[i] = ao;
      s.roff[i] = ro;
      s.alen[i] = al;
      s.rlen[i] = rl;
      ao += al;
      ro += rl;
    }
    s.atot = ao;
    s.rtot = ro;
  }
  return KVXFER_SUCCESS;
}

// P2: the sender's status and per-page lengths.
kvxfer_result_t Call::phase_lengths() {
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final) continue;
    NCCLB_FATAL(alloc(&s.hmeta, s.meta_bytes()));
    NCCLB_FATAL(alloc(&s.dmeta, s.meta_bytes()));
    if (s.mine.is_sender) {
      std::memset(s.hmeta.p, 0, s.meta_bytes());
      fill_status_block(s.hmeta.p, s.failed ? s.fail_r : KVXFER_SUCCESS,
                        s.failed ? s.fail_text : std::string());
      if (!s.failed)
        for (size_t i = 0; i < s.pages.size(); ++i) {
          std::memcpy(s.hmeta.p + kStatusBlock + 16 * i, &s.alen[i], 8);
          std::memcpy(s.hmeta.p + kStatusBlock + 16 * i + 8, &s.rlen[i], 8);
        }
      const cudaError_t e = cudaMemcpyAsync(s.dmeta.p, s.hmeta.p, s.meta_bytes(),
                                            cudaMemcpyHostToDevice, c_->astream);
      if (e != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e, "cudaMemcpyAsync(lengths)"));
    }
  }
  NCCLB_FATAL(group(c_->anchor, "lengths", [&]() -> kvxfer_result_t {
    for (auto& sp : st_) {
      OpState& s = *sp;
      if (s.final) continue;
      const ncclResult_t r =
          s.mine.is_sender
              ? ncclSend(s.dmeta.p, s.meta_bytes(), ncclUint8, s.op->peer, c_->anchor, c_->astream)
              : ncclRecv(s.dmeta.p, s.meta_bytes(), ncclUint8, s.op->peer, c_->anchor, c_->astream);
      if (r != ncclSuccess) return nccl_fail(r, "ncclSend/ncclRecv(lengths)", c_->anchor);
    }
    return KVXFER_SUCCESS;
  }));
  for (auto& sp : st_) {  // the lengths to the (pinned) host, in stream order
    OpState& s = *sp;
    if (s.final || s.mine.is_sender) continue;
    const cudaError_t e =
        cudaMemcpyAsync(s.hmeta.p, s.dmeta.p, s.meta_bytes(), cudaMemcpyDeviceToHost, c_->astream);
    if (e != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e, "cudaMemcpyAsync(lengths)"));
  }
  NCCLB_FATAL(wait(c_->astream, c_->aevent, "lengths"));

  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final) continue;
    if (s.mine.is_sender) {
      if (s.failed) {
        finish(s, s.fail_r, s.fail_text);
        continue;
      }
      s.in_data = true;
      continue;
    }
    kvxfer_result_t sr = KVXFER_SUCCESS;
    std::string text;
    if (read_status_block(s.hmeta.p, &sr, &text) < 0) {
      finish(s, KVXFER_ERR_CORRUPT, last_error());
      continue;
    }
    if (sr != KVXFER_SUCCESS) {  // the sender failed (NaN with the ERROR policy, ...)
      finish(s, sr < 0 ? sr : KVXFER_ERR_CORRUPT, text);
      continue;
    }
    const size_t np = s.pages.size();
    s.alen.assign(np, 0);
    s.rlen.assign(np, 0);
    s.aoff.assign(np, 0);
    s.roff.assign(np, 0);
    bool ok = true;
    for (size_t i = 0; i < np && ok; ++i) {
      std::memcpy(&s.alen[i], s.hmeta.p + kStatusBlock + 16 * i, 8);
      std::memcpy(&s.rlen[i], s.hmeta.p + kStatusBlock + 16 * i + 8, 8);
      size_t a = 0, r = 0;
      if (codec::max_sizes(&s.codec, s.pages[i].num_tokens, s.H, &a, &r) < 0 || s.alen[i] > a ||
          s.rlen[i] > r || s.alen[i] < codec::kHeaderBytes) {
        set_error(KVXFER_ERR_CORRUPT,
                  "page %zu: the sender announces %" PRIu64 " anchor and %" PRIu64
                  " residual bytes; at most %zu and %zu are possible",
                  i, s.alen[i], s.rlen[i], a, r);
        ok = false;
      }
      s.aoff[i] = s.atot;
      s.roff[i] = s.rtot;
      s.atot += s.alen[i];
      s.rtot += s.rlen[i];
    }
    if (!ok) {  // one-sided: the sender's next send times out (docs/NCCL.md)
      finish(s, KVXFER_ERR_CORRUPT, last_error());
      continue;
    }
    NCCLB_FATAL(alloc(&s.hanc, s.atot));
    NCCLB_FATAL(alloc(&s.hres, s.rtot));
    if (np > 0) NCCLB_FATAL(reserve_scratch(&s.buffers, s.peer.page_tokens, s.H));
    s.in_data = true;
  }
  return KVXFER_SUCCESS;
}

void Call::decode_pages(OpState& s, bool full, cudaStream_t stream) {
  for (size_t i = 0; i < s.pages.size() && !s.failed; ++i) {
    const xfer::PageRef& p = s.pages[i];
    const kvxfer_page_layout_t l = s.layout(p);
    const kvxfer_page_id_t id = s.page_id(p);
    const uint8_t* res = full && s.rlen[i] > 0 ? s.hres.p + s.roff[i] : nullptr;
    cuda::DeviceCodebook keep;
    const kvxfer_result_t r =
        cuda::decode_page_device(s.hanc.p + s.aoff[i], s.alen[i], res, res ? s.rlen[i] : 0, &id, &l,
                                 s.scratch, stream, &keep);
    if (keep.mem != nullptr) s.codebooks.push_back(std::move(keep));
    if (r < 0)
      mark_failed(s, r,
                  strprintf("page of layer %d %s, tokens [%" PRId64 ", %" PRId64 "): %s", p.layer,
                            codec::kv_kind_name(p.kind), p.token_begin,
                            p.token_begin + p.num_tokens, last_error()));
  }
}

// P3 + P4: anchors on the anchor communicator, then residuals on the residual one.
kvxfer_result_t Call::phase_data() {
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final || !s.in_data) continue;
    s.op->anchor_wire_bytes = s.atot;
    s.op->residual_wire_bytes = s.rtot;
    if (s.mode == KVXFER_MODE_MONOLITHIC) {
      s.op->anchor_wire_bytes += s.rtot;
      s.op->residual_wire_bytes = 0;
    }
    NCCLB_FATAL(alloc(&s.danc, s.atot));
    NCCLB_FATAL(alloc(&s.dres, s.rtot));
    if (s.mine.is_sender) {  // pinned -> device, in stream order before the sends
      cudaError_t e = cudaSuccess;
      if (s.atot > 0)
        e = cudaMemcpyAsync(s.danc.p, s.hanc.p, s.atot, cudaMemcpyHostToDevice, c_->astream);
      if (e == cudaSuccess && s.rtot > 0)
        e = cudaMemcpyAsync(s.dres.p, s.hres.p, s.rtot, cudaMemcpyHostToDevice, c_->astream);
      if (e != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e, "cudaMemcpyAsync(sections)"));
    }
  }
  auto p2p = [&](OpState& s, uint8_t* buf, uint64_t n, ncclComm_t comm,
                 cudaStream_t stream) -> kvxfer_result_t {
    if (n == 0) return KVXFER_SUCCESS;
    const ncclResult_t r = s.mine.is_sender ? ncclSend(buf, n, ncclUint8, s.op->peer, comm, stream)
                                            : ncclRecv(buf, n, ncclUint8, s.op->peer, comm, stream);
    return r == ncclSuccess ? KVXFER_SUCCESS : nccl_fail(r, "ncclSend/ncclRecv(sections)", comm);
  };
  NCCLB_FATAL(group(c_->anchor, "anchor sections", [&]() -> kvxfer_result_t {
    for (auto& sp : st_) {
      OpState& s = *sp;
      if (s.final || !s.in_data) continue;
      KVXFER_CHECK(p2p(s, s.danc.p, s.atot, c_->anchor, c_->astream));
      if (s.mode == KVXFER_MODE_MONOLITHIC)
        KVXFER_CHECK(p2p(s, s.dres.p, s.rtot, c_->anchor, c_->astream));
    }
    return KVXFER_SUCCESS;
  }));
  // Strict order: the residual stream starts after every anchor of the call.
  {
    cudaError_t e = cudaEventRecord(c_->aevent, c_->astream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(c_->rstream, c_->aevent, 0);
    if (e != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e, "cudaStreamWaitEvent(anchors)"));
  }
  NCCLB_FATAL(group(c_->residual, "residual sections", [&]() -> kvxfer_result_t {
    for (auto& sp : st_) {
      OpState& s = *sp;
      if (s.final || !s.in_data || s.mode == KVXFER_MODE_MONOLITHIC) continue;
      KVXFER_CHECK(p2p(s, s.dres.p, s.rtot, c_->residual, c_->rstream));
    }
    return KVXFER_SUCCESS;
  }));

  // Anchors landed: the receiver copies them to the host (in stream order,
  // after the receives), validates and decodes.
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final || !s.in_data || s.mine.is_sender) continue;
    cudaError_t e = cudaSuccess;
    if (s.atot > 0)
      e = cudaMemcpyAsync(s.hanc.p, s.danc.p, s.atot, cudaMemcpyDeviceToHost, c_->astream);
    if (e == cudaSuccess && s.mode == KVXFER_MODE_MONOLITHIC && s.rtot > 0)
      e = cudaMemcpyAsync(s.hres.p, s.dres.p, s.rtot, cudaMemcpyDeviceToHost, c_->astream);
    if (e != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e, "cudaMemcpyAsync(anchor sections)"));
  }
  NCCLB_FATAL(wait(c_->astream, c_->aevent, "anchor sections"));
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final || !s.in_data || s.mine.is_sender) continue;
    decode_pages(s, s.mode == KVXFER_MODE_MONOLITHIC, c_->astream);
  }
  NCCLB_FATAL(wait(c_->astream, c_->aevent, "anchor decode"));
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (!s.final && s.in_data && !s.failed) anchor_ready(s);
  }

  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final || !s.in_data || s.mine.is_sender || s.mode == KVXFER_MODE_MONOLITHIC) continue;
    if (s.rtot > 0) {
      const cudaError_t e =
          cudaMemcpyAsync(s.hres.p, s.dres.p, s.rtot, cudaMemcpyDeviceToHost, c_->rstream);
      if (e != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e, "cudaMemcpyAsync(residual sections)"));
    }
  }
  NCCLB_FATAL(wait(c_->rstream, c_->revent, "residual sections"));
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final || !s.in_data || s.mine.is_sender || s.mode == KVXFER_MODE_MONOLITHIC) continue;
    decode_pages(s, true, c_->rstream);
  }
  NCCLB_FATAL(wait(c_->rstream, c_->revent, "residual decode"));
  return KVXFER_SUCCESS;
}

// P5: the receiver's result goes back to the sender.
kvxfer_result_t Call::phase_status() {
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final || !s.in_data) continue;
    NCCLB_FATAL(alloc(&s.hstat, kStatusBlock));
    NCCLB_FATAL(alloc(&s.dstat, kStatusBlock));
    if (!s.mine.is_sender) {
      fill_status_block(s.hstat.p, s.failed ? s.fail_r : KVXFER_SUCCESS,
                        s.failed ? s.fail_text : std::string());
      const cudaError_t e =
          cudaMemcpyAsync(s.dstat.p, s.hstat.p, kStatusBlock, cudaMemcpyHostToDevice, c_->astream);
      if (e != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e, "cudaMemcpyAsync(status)"));
    }
  }
  NCCLB_FATAL(group(c_->anchor, "final status", [&]() -> kvxfer_result_t {
    for (auto& sp : st_) {
      OpState& s = *sp;
      if (s.final || !s.in_data) continue;
      const ncclResult_t r =
          s.mine.is_sender
              ? ncclRecv(s.dstat.p, kStatusBlock, ncclUint8, s.op->peer, c_->anchor, c_->astream)
              : ncclSend(s.dstat.p, kStatusBlock, ncclUint8, s.op->peer, c_->anchor, c_->astream);
      if (r != ncclSuccess) return nccl_fail(r, "ncclSend/ncclRecv(status)", c_->anchor);
    }
    return KVXFER_SUCCESS;
  }));
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final || !s.in_data || !s.mine.is_sender) continue;
    const cudaError_t e =
        cudaMemcpyAsync(s.hstat.p, s.dstat.p, kStatusBlock, cudaMemcpyDeviceToHost, c_->astream);
    if (e != cudaSuccess) NCCLB_FATAL(cuda::cuda_result(e, "cudaMemcpyAsync(status)"));
  }
  NCCLB_FATAL(wait(c_->astream, c_->aevent, "final status"));
  for (auto& sp : st_) {
    OpState& s = *sp;
    if (s.final || !s.in_data) continue;
    if (!s.mine.is_sender) {
      finish(s, s.failed ? s.fail_r : KVXFER_SUCCESS, s.failed ? s.fail_text : std::string());
      continue;
    }
    kvxfer_result_t rr = KVXFER_SUCCESS;
    std::string text;
    if (read_status_block(s.hstat.p, &rr, &text) < 0)
      finish(s, KVXFER_ERR_CORRUPT, last_error());
    else
      finish(s, rr, text);
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Call::run() {
  if (wait_ready_) {  // stream order: nothing of this call runs before the caller's work
    KVXFER_CUDA_CHECK(cudaStreamWaitEvent(c_->astream, c_->ready, 0));
    KVXFER_CUDA_CHECK(cudaStreamWaitEvent(c_->rstream, c_->ready, 0));
  }
  KVXFER_CHECK(setup());  // nothing sent yet
  KVXFER_CHECK(phase_desc());
  if (!fatal_) KVXFER_CHECK(encode_all());
  if (!fatal_) KVXFER_CHECK(phase_lengths());
  if (!fatal_) KVXFER_CHECK(phase_data());
  if (!fatal_) KVXFER_CHECK(phase_status());
  for (auto& s : st_)
    if (!s->final) finish(*s, KVXFER_ERR_INTERNAL, "op left unfinished");
  for (auto& s : st_)
    if (s->op->result < 0) return set_error(s->op->result, "op %d: %s", s->index, s->op->error);
  return KVXFER_SUCCESS;
}

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
    Call call(comm, ops, num_ops, true);
    return call.run();
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
  return api_call("kvxfer_nccl_comm_init", [&]() -> kvxfer_result_t {
    KVXFER_REQUIRE(comm != nullptr, "NULL communicator output");
    *comm = nullptr;
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
  return api_call("kvxfer_nccl_comm_init_from_comms", [&]() -> kvxfer_result_t {
    KVXFER_REQUIRE(comm != nullptr, "NULL communicator output");
    *comm = nullptr;
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
