// One kvxfer_nccl_xfer call (nccl_internal.h, run_call): its ops through
// the five phases that nccl_backend.cc describes, each one NCCL group over
// every op still in it, and the failure path that aborts the communicator
// and parks the buffers still in use.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "codec/format.h"
#include "common/error.h"
#include "common/log.h"
#include "common/params.h"
#include "cuda/cuda_check.h"
#include "cuda/device_codec.h"
#include "nccl_backend/nccl_internal.h"
#include "xfer/protocol.h"

using kvxfer::set_error;
using kvxfer::strprintf;

namespace kvxfer::nccl {
namespace {

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

}  // namespace

kvxfer_result_t run_call(kvxfer_nccl_comm_t c, kvxfer_nccl_op_t* ops, int n, bool wait_ready) {
  Call call(c, ops, n, wait_ready);
  return call.run();
}

}  // namespace kvxfer::nccl
