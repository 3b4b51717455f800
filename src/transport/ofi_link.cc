// Link (ofi.h), its data path: posts, completions, chunking, the
// anchor-first scheduler, receive window, timeouts.
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/error.h"
#include "common/log.h"
#include "common/params.h"
#include "transport/crash_signals.h"
#include "transport/dscp.h"
#include "transport/fabric_lib.h"
#include "transport/ofi.h"
#include "transport/ofi_link_internal.h"
#include "transport/shm_reaper.h"

namespace kvxfer::transport {

using namespace link_detail;  // NOLINT: this file's own internals

uint32_t wire_header_check(const WireHeader& h) {
  WireHeader z = h;
  z.check = 0;
  return static_cast<uint32_t>(XXH3_64bits(&z, sizeof z));
}

WireHeader make_wire_header(uint32_t chunk_bytes, uint64_t total, uint64_t tag) {
  WireHeader h{};
  h.magic = kWireMagic;
  h.version = kWireVersion;
  h.chunk_bytes = chunk_bytes;
  h.total = total;
  h.tag = tag;
  h.check = wire_header_check(h);
  return h;
}

bool wire_header_ok(const WireHeader& h, size_t len, uint64_t tag) {
  return len == sizeof(WireHeader) && h.magic == kWireMagic && h.version == kWireVersion &&
         h.flags == 0 && h.check == wire_header_check(h) && h.tag == tag && h.chunk_bytes != 0 &&
         h.chunk_bytes <= kMaxPeerChunk &&
         h.total / h.chunk_bytes + (h.total % h.chunk_bytes != 0) <= kMaxChunks;  // no wrap
}

Link::Ctx* Link::new_ctx(Op* op, TrafficClass c, int kind, uint32_t index, size_t bytes) {
  Ctx* ctx = new Ctx();
  ctx->op = op;
  ctx->cls = c;
  ctx->kind = kind;
  ctx->index = index;
  ctx->bytes = bytes;
  live_.insert(ctx);
  return ctx;
}

void Link::free_ctx(Ctx* ctx) {
  live_.erase(ctx);
  delete ctx;
}

kvxfer_result_t Link::post_send(TrafficClass c, const void* buf, size_t len, uint64_t tag,
                                uint64_t* op_id, bool ahead) {
  if (failed_) return set_error(fail_code_, "link failed: %s", fail_why_.c_str());
  KVXFER_REQUIRE(c == TrafficClass::kAnchor || c == TrafficClass::kResidual, "bad traffic class");
  KVXFER_REQUIRE(buf != nullptr || len == 0, "null send buffer");
  KVXFER_REQUIRE(tag <= kMaxTag, "tag %" PRIu64 " above the maximum %" PRIu64, tag, kMaxTag);
  // Messages below rxm's SAR limit travel in eager-size chunks; larger ones in
  // chunk_bytes chunks (rxm rendezvous).  rxm's segmentation-and-reassembly
  // path, between the two, stalled with many messages outstanding
  // (docs/TRANSPORT.md, "Chunk sizes").
  const size_t chunk_bytes =
      len < kSarLimitBytes ? std::min(cfg_.chunk_bytes, kEagerChunkBytes) : cfg_.chunk_bytes;
  const uint64_t nchunks = (len + chunk_bytes - 1) / chunk_bytes;
  KVXFER_REQUIRE(nchunks <= kMaxChunks, "message of %zu bytes needs more than 2^24 chunks", len);
  auto op = std::make_unique<Op>();
  op->id = next_op_id_++;
  op->cls = c;
  op->is_send = true;
  op->tag = tag;
  op->buf = const_cast<uint8_t*>(static_cast<const uint8_t*>(buf));
  op->size = len;
  op->total = len;
  op->chunk = chunk_bytes;
  op->nchunks = static_cast<uint32_t>(nchunks);
  op->hdr = make_wire_header(static_cast<uint32_t>(chunk_bytes), len, tag);
  op->posted = op->last_activity = Clock::now();
  op->queued = true;
  (ahead ? ahead_queue_ : send_queue_)[idx(c)].push_back(op.get());
  if (op_id != nullptr) *op_id = op->id;
  ops_.emplace(op->id, std::move(op));
  return KVXFER_SUCCESS;
}

bool Link::empty_unstarted_send(uint64_t op_id) {
  auto it = ops_.find(op_id);
  if (it == ops_.end()) return false;
  Op* op = it->second.get();
  if (!op->is_send || op->reported || op->next_post != 0) return false;
  op->size = 0;
  op->total = 0;
  op->nchunks = 0;
  op->hdr = make_wire_header(op->hdr.chunk_bytes, 0, op->hdr.tag);
  return true;
}

bool Link::cancel_recv(uint64_t op_id, kvxfer_result_t code, const std::string& why) {
  auto it = ops_.find(op_id);
  if (it == ops_.end()) return false;
  Op* op = it->second.get();
  if (op->is_send || op->reported || op->cancelling || op->have_header) return false;
  fail_recv(op, code, why, Clock::now());
  maybe_release(op);
  return true;
}

kvxfer_result_t Link::post_recv(TrafficClass c, void* buf, size_t cap, uint64_t tag,
                                uint64_t* op_id, bool standing) {
  if (failed_) return set_error(fail_code_, "link failed: %s", fail_why_.c_str());
  KVXFER_REQUIRE(c == TrafficClass::kAnchor || c == TrafficClass::kResidual, "bad traffic class");
  KVXFER_REQUIRE(buf != nullptr || cap == 0, "null receive buffer");
  KVXFER_REQUIRE(tag <= kMaxTag, "tag %" PRIu64 " above the maximum %" PRIu64, tag, kMaxTag);
  auto op = std::make_unique<Op>();
  op->id = next_op_id_++;
  op->cls = c;
  op->is_send = false;
  op->tag = tag;
  op->buf = static_cast<uint8_t*>(buf);
  op->size = cap;
  op->posted = op->last_activity = Clock::now();
  op->queued = true;
  op->standing = standing;
  recv_queue_[idx(c)].push_back(op.get());
  if (op_id != nullptr) *op_id = op->id;
  ops_.emplace(op->id, std::move(op));
  return KVXFER_SUCCESS;
}

void Link::finish(Op* op, kvxfer_result_t code, const std::string& why, Clock::time_point now) {
  if (op->reported) return;
  op->reported = true;
  Completion cpl;
  cpl.op_id = op->id;
  cpl.tag = op->tag;
  cpl.cls = op->cls;
  cpl.is_send = op->is_send;
  cpl.status = code;
  cpl.error = why;
  cpl.bytes = code == KVXFER_SUCCESS ? op->total : op->bytes_done;
  cpl.posted = op->posted;
  cpl.done = now;
  done_.push_back(std::move(cpl));
}

void Link::maybe_release(Op* op) {
  if (op->reported && op->outstanding == 0 && !op->queued && !op->has_work()) ops_.erase(op->id);
}

kvxfer_result_t Link::fail_link(kvxfer_result_t code, const std::string& why) {
  if (!failed_) {
    KVXFER_WARN(LOG_NET, "OFI : link failed: %s", why.c_str());
    abort_with(code < 0 ? code : KVXFER_ERR_SYSTEM, why);
  }
  return set_error(fail_code_, "link failed: %s", fail_why_.c_str());
}

void Link::abort(const char* why) { abort_with(KVXFER_ERR_SYSTEM, why); }

void Link::abort_with(kvxfer_result_t code, const std::string& why) {
  if (failed_) return;
  failed_ = true;
  ready_ = false;
  fail_code_ = code;
  fail_why_ = why;
  shm_watch_.reset();
  // Closing the endpoints flushes the provider's queues: from here on no
  // posted buffer or context is touched again.
  for (auto& e : ep_)
    if (e) e->close();
  for (Ctx* c : live_) delete c;
  live_.clear();
  const Clock::time_point now = Clock::now();
  for (auto& kv : ops_) {
    Op* op = kv.second.get();
    if (!op->reported)
      finish(
          op, code,
          op->cancelling ? op->pending_why + "; then link aborted: " + why : "link aborted: " + why,
          now);
  }
  ops_.clear();
  for (int c = 0; c < kNumClasses; ++c) {
    send_queue_[c].clear();
    ahead_queue_[c].clear();
    recv_queue_[c].clear();
    recv_data_queue_[c].clear();
    posted_chunks_[c] = inflight_bytes_[c] = posted_recvs_[c] = 0;
  }
}

void Link::fail_recv(Op* op, kvxfer_result_t code, const std::string& why, Clock::time_point now) {
  if (op->cancelling) return;
  op->cancelling = true;
  op->pending_code = code;
  op->pending_why = why;
  // Grace for the provider to return the cancelled receives; past it the link
  // is failed (closing the endpoints is the only other way to get the user's
  // buffer back safely).
  op->cancel_deadline =
      now + std::chrono::milliseconds(std::min<int64_t>(cfg_.timeout_ms, 1000) + 100);
  for (Ctx* ctx : live_)
    // shm writes the cancelled receive's completion at once, unsignalled.
    if (ctx->op == op && ep_[idx(ctx->cls)]->cancel(ctx) == KVXFER_SUCCESS)
      posted_after_read_ = true;
  if (op->outstanding == 0) finish(op, code, why, now);
}

kvxfer_result_t Link::handle_event(TrafficClass c, const CqEvent& ev, Clock::time_point now) {
  Ctx* ctx = static_cast<Ctx*>(ev.context);
  if (ctx == nullptr || live_.count(ctx) == 0) {
    KVXFER_WARN(LOG_NET, "OFI : completion with unknown context on %s endpoint (err %d)",
                class_name(c), ev.err);
    return KVXFER_SUCCESS;
  }
  live_.erase(ctx);
  std::unique_ptr<Ctx> hold(ctx);
  if (ctx->kind == kHelloSend || ctx->kind == kHelloRecv) {
    if (ev.err != 0)
      return fail_link(KVXFER_ERR_SYSTEM, strprintf("handshake %s on the %s endpoint failed: %s",
                                                    ctx->kind == kHelloSend ? "send" : "receive",
                                                    class_name(c), fabric_lib::strerror(ev.err)));
    if (ctx->kind == kHelloRecv) {
      if (hello_buf_[idx(c)] == kHelloRingsMagic)
        peer_rings_ = true;
      else if (hello_buf_[idx(c)] != kHelloMagic)
        return fail_link(KVXFER_ERR_CORRUPT, "handshake message from the peer is malformed");
    }
    if (--hello_pending_ == 0) {
      ready_ = true;
      ready_at_ = now;
      // The peer's hellos came after its connect() opened this side's
      // doorbell: its name can go (a killed process then leaves no FIFO).
      if (!bell_path_.empty()) (void)::unlink(bell_path_.c_str());
      bell_path_.clear();
      mark_sockets();
      KVXFER_INFO(LOG_NET, "OFI : link ready after %.1f ms",
                  std::chrono::duration<double, std::milli>(now - connect_started_).count());
    }
    return KVXFER_SUCCESS;
  }
  Op* op = ctx->op;
  op->outstanding--;
  if (op->is_send) return on_send_done(ctx, ev, now);
  return on_recv_done(ctx, ev, now);
}

kvxfer_result_t Link::on_send_done(Ctx* ctx, const CqEvent& ev, Clock::time_point now) {
  Op* op = ctx->op;
  const int c = idx(ctx->cls);
  posted_chunks_[c]--;
  inflight_bytes_[c] -= ctx->bytes;
  if (ev.err != 0)
    return fail_link(KVXFER_ERR_SYSTEM,
                     strprintf("send of tag %" PRIu64 " chunk %u on the %s endpoint failed: %s "
                               "(provider errno %d)",
                               op->tag, ctx->index, class_name(ctx->cls),
                               fabric_lib::strerror(ev.err), ev.prov_errno));
  op->done_chunks++;
  if (ctx->kind == kData) op->bytes_done += ctx->bytes;
  op->last_activity = now;
  last_send_activity_ = now;
  if (op->done_chunks == op->nchunks + 1) finish(op, KVXFER_SUCCESS, "", now);
  maybe_release(op);
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::on_recv_done(Ctx* ctx, const CqEvent& ev, Clock::time_point now) {
  Op* op = ctx->op;
  const int c = idx(ctx->cls);
  posted_recvs_[c]--;
  if (ev.err == FI_ECANCELED && !op->cancelling) {
    // Not ours: rxm flushes the receives of a connection the peer closed.
    fail_recv(op, KVXFER_ERR_SYSTEM,
              strprintf("receive of tag %" PRIu64 " chunk %u on the %s endpoint was flushed by "
                        "the provider: the connection to the peer is gone (the peer exited, was "
                        "killed or destroyed its communicator)",
                        op->tag, ctx->index, class_name(ctx->cls)),
              now);
  } else if (ev.err != 0 && !(ev.err == FI_ECANCELED && op->cancelling)) {
    fail_recv(op, ev.err == FI_ETRUNC ? KVXFER_ERR_TRUNCATED : KVXFER_ERR_SYSTEM,
              strprintf("receive of tag %" PRIu64 " chunk %u on the %s endpoint failed: %s",
                        op->tag, ctx->index, class_name(ctx->cls), fabric_lib::strerror(ev.err)),
              now);
  }
  if (op->cancelling) {
    if (op->outstanding == 0) finish(op, op->pending_code, op->pending_why, now);
    maybe_release(op);
    return KVXFER_SUCCESS;
  }
  op->last_activity = now;
  last_recv_activity_ = now;
  if (ctx->kind == kHeader) {
    if (cfg_.corrupt_headers && cfg_.corrupt_headers->count.load() > 0 &&
        cfg_.corrupt_headers->count.fetch_sub(1) == 1) {
      const int at = cfg_.corrupt_headers->offset.load();  // test seam (LinkConfig)
      if (at >= 0 && static_cast<size_t>(at) < sizeof(WireHeader))
        reinterpret_cast<uint8_t*>(&op->hdr)[at] ^= 0x5a;
    }
    const WireHeader& h = op->hdr;
    if (!wire_header_ok(h, ev.len, op->tag)) {
      fail_recv(op, KVXFER_ERR_CORRUPT,
                strprintf("message header of tag %" PRIu64 " on the %s class is malformed", op->tag,
                          class_name(op->cls)),
                now);
      maybe_release(op);
      return KVXFER_SUCCESS;
    }
    op->have_header = true;
    op->total = h.total;
    op->chunk = h.chunk_bytes;
    op->nchunks = static_cast<uint32_t>((h.total + h.chunk_bytes - 1) / h.chunk_bytes);
    op->done_chunks = 1;
    if (op->total > op->size) {
      // Drain the message into scratch so that the sender completes; the
      // user's buffer is never touched, so the error is reported now.
      op->draining = true;
      op->scratch.reset(new (std::nothrow) uint8_t[std::min<uint64_t>(op->chunk, op->total)]);
      finish(op, KVXFER_ERR_BUFFER_TOO_SMALL,
             strprintf("message of tag %" PRIu64 " on the %s class has %" PRIu64
                       " bytes, the receive only %zu",
                       op->tag, class_name(op->cls), op->total, op->size),
             now);
      if (!op->scratch) op->cancelling = true;  // cannot drain; the sender will time out
    }
    if (op->nchunks == 0) {
      finish(op, KVXFER_SUCCESS, "", now);
    } else if (!op->queued && op->has_work()) {
      // Its data receives go before any header receive still to post: the
      // sender's posted chunks are this message's data, and they complete
      // only once these receives exist.
      op->queued = true;
      recv_data_queue_[c].push_back(op);
    }
    maybe_release(op);
    return KVXFER_SUCCESS;
  }
  // A data chunk.
  const uint64_t off = static_cast<uint64_t>(ctx->index - 1) * op->chunk;
  const uint64_t want = std::min<uint64_t>(op->chunk, op->total - off);
  if (ev.len != want) {
    fail_recv(
        op, KVXFER_ERR_TRUNCATED,
        strprintf("chunk %u of tag %" PRIu64 " on the %s class has %zu bytes, expected %" PRIu64,
                  ctx->index, op->tag, class_name(op->cls), ev.len, want),
        now);
    maybe_release(op);
    return KVXFER_SUCCESS;
  }
  op->done_chunks++;
  op->bytes_done += want;
  if (op->done_chunks == op->nchunks + 1) {
    finish(op, KVXFER_SUCCESS, "", now);  // no-op for a draining op (already reported)
  } else if (!op->queued && op->has_work()) {
    op->queued = true;
    recv_data_queue_[c].push_back(op);  // data first (see the header case)
  }
  maybe_release(op);
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::post_recvs(Clock::time_point now) {
  (void)now;
  for (int c = 0; c < kNumClasses; ++c) {  // anchor first
    // Two queues, each kept in order: ops whose header has landed and whose
    // data receives are still to post (in the order the headers landed,
    // which is the order the peer sends), served first; then ops still to
    // post their header receive (in the order they were asked for).
    // Header receives may fill only half of the posting window: the other
    // half is kept for data receives, and an op blocked on a header slot
    // does not stop the data receives.  Otherwise receives posted ahead for
    // later messages crowd out the data of the messages the sender is
    // sending now, and both sides stall (seen with more than 128 messages
    // outstanding on a class).  Data receives must also keep the order of
    // their headers: matching an unexpected message happens when its
    // receive is posted, so posting out of order completes messages out of
    // order.
    if (ready_ && (!recv_data_queue_[c].empty() || !recv_queue_[c].empty()) && !connection_open(c))
      return fail_link(KVXFER_ERR_SYSTEM,
                       strprintf("the connection to the peer on the %s class is gone (the peer "
                                 "exited or closed); no more receives are posted on it",
                                 class_name(static_cast<TrafficClass>(c))));
    bool provider_full = false;
    for (auto* qp : {&recv_data_queue_[c], &recv_queue_[c]}) {
      auto& q = *qp;
      std::deque<Op*> keep;
      while (!q.empty() && !provider_full) {
        Op* op = q.front();
        q.pop_front();
        op->queued = false;
        bool blocked = false;
        while (op->has_work()) {
          const bool header = op->next_post == 0;
          if (!header && op->outstanding >= cfg_.recv_window_chunks)
            break;  // requeued on completion
          if (posted_recvs_[c] >= (header ? cfg_.max_posted_recvs / 2 : cfg_.max_posted_recvs)) {
            blocked = true;
            break;
          }
          void* dst;
          size_t len;
          int kind;
          if (header) {
            dst = &op->hdr;
            len = sizeof(WireHeader);
            kind = kHeader;
          } else {
            const uint64_t off = static_cast<uint64_t>(op->next_post - 1) * op->chunk;
            len = static_cast<size_t>(std::min<uint64_t>(op->chunk, op->total - off));
            dst = op->draining ? op->scratch.get() : op->buf + off;
            kind = kData;
          }
          Ctx* ctx = new_ctx(op, static_cast<TrafficClass>(c), kind, op->next_post, len);
          const kvxfer_result_t r =
              ep_[c]->post_recv(dst, len, wire_tag(op->tag, op->next_post), ctx);
          if (r == KVXFER_IN_PROGRESS) {  // the provider's queue is full: retry next progress()
            free_ctx(ctx);
            blocked = provider_full = provider_full_ = true;
            break;
          }
          if (r != KVXFER_SUCCESS) {
            free_ctx(ctx);
            return fail_link(r, strprintf("posting a receive on the %s endpoint failed: %s",
                                          class_name(static_cast<TrafficClass>(c)), last_error()));
          }
          op->outstanding++;
          posted_recvs_[c]++;
          op->next_post++;
          stirred_ = posted_after_read_ = true;
        }
        if (blocked && op->has_work()) {
          op->queued = true;
          keep.push_back(op);
        } else {
          maybe_release(op);  // waits for its header or a window slot; requeued on completion
        }
      }
      while (!q.empty()) {  // not reached this time (provider full): same order, after `keep`
        keep.push_back(q.front());
        q.pop_front();
      }
      q.swap(keep);
    }
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::schedule_sends(Clock::time_point now) {
  if (!ready_) return KVXFER_SUCCESS;
  for (;;) {
    // Strict priority: a residual chunk is posted only when no anchor chunk is
    // waiting.  When anchors are blocked (provider queue bound, rate limit),
    // residuals wait too.  Within a class, `ahead` messages first.
    int c = 0;
    std::deque<Op*>* q = nullptr;
    for (int k = 0; k < kNumClasses && q == nullptr; ++k) {
      c = k;
      if (!ahead_queue_[k].empty())
        q = &ahead_queue_[k];
      else if (!send_queue_[k].empty())
        q = &send_queue_[k];
    }
    if (q == nullptr) break;
    if (posted_chunks_[c] >= cfg_.max_posted_chunks) break;
    Op* op = q->front();
    const uint32_t i = op->next_post;
    const void* src;
    size_t bytes;
    if (i == 0) {
      src = &op->hdr;
      bytes = sizeof(WireHeader);
    } else {
      const uint64_t off = static_cast<uint64_t>(i - 1) * op->chunk;
      bytes = static_cast<size_t>(std::min<uint64_t>(op->chunk, op->total - off));
      src = op->buf + off;
    }
    if (c == 1 && inflight_bytes_[1] > 0 &&
        inflight_bytes_[1] + bytes > cfg_.residual_inflight_bytes)
      break;
    if (cfg_.limiter && !cfg_.limiter->try_acquire(bytes, now)) {
      next_wake_ = now + cfg_.limiter->wait_hint(bytes, now);
      break;
    }
    Ctx* ctx = new_ctx(op, static_cast<TrafficClass>(c), i == 0 ? kHeader : kData, i, bytes);
    const kvxfer_result_t r = ep_[c]->post_send(src, bytes, peer_[c], wire_tag(op->tag, i), ctx);
    if (r != KVXFER_SUCCESS) {
      free_ctx(ctx);
      if (cfg_.limiter) cfg_.limiter->refund(bytes);
      if (r == KVXFER_IN_PROGRESS) {
        provider_full_ = true;
        break;
      }
      return fail_link(r, strprintf("posting a send on the %s endpoint failed: %s",
                                    class_name(static_cast<TrafficClass>(c)), last_error()));
    }
    op->outstanding++;
    op->next_post++;
    stirred_ = posted_after_read_ = true;
    posted_chunks_[c]++;
    inflight_bytes_[c] += bytes;
    stats_.chunks_posted[c]++;
    stats_.bytes_posted[c] += bytes;
    if (c == 1)
      stats_.max_residual_inflight = std::max(stats_.max_residual_inflight, inflight_bytes_[1]);
    if (op->next_post > op->nchunks) {
      q->pop_front();
      op->queued = false;
    }
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::check_timeouts(Clock::time_point now) {
  const auto timeout = std::chrono::milliseconds(cfg_.timeout_ms);
  if (connecting_ && !ready_ && now - connect_started_ > timeout)
    return fail_link(
        KVXFER_ERR_TIMEOUT,
        strprintf("handshake with the peer did not complete within %lld ms (peer dead, "
                  "not connecting, or unreachable)",
                  static_cast<long long>(cfg_.timeout_ms)));
  std::vector<Op*> expired;
  for (auto& kv : ops_) {
    Op* op = kv.second.get();
    if (op->cancelling) {
      if (now > op->cancel_deadline)
        return fail_link(KVXFER_ERR_TIMEOUT,
                         op->pending_why + "; the provider did not return the cancelled receive");
      continue;
    }
    if (op->reported && !op->draining) continue;
    if (op->standing_idle()) continue;
    // The timeout detects a peer that is dead or silent, not an operation
    // that waits its turn: while traffic moves on the link in either
    // direction, no operation expires.  An operation can wait a long time
    // behind others for good reasons: a residual behind every anchor of a
    // rate-limited link, a reply (kvxfer's STATUS) after a long transfer the
    // other way, a chunk whose receive the peer posts only when a window
    // slot frees.  Before the link is ready the handshake is the clock (it
    // has its own timeout).
    const bool waiting = op->is_send ? op->outstanding == 0 : !op->have_header;
    if (waiting && connecting_ && !ready_) continue;
    const Clock::time_point last =
        std::max({op->last_activity, ready_at_, last_send_activity_, last_recv_activity_});
    if (now - last > timeout) expired.push_back(op);
  }
  for (Op* op : expired) {
    const std::string why =
        strprintf("%s of tag %" PRIu64 " on the %s class made no progress for %lld ms (%s)",
                  op->is_send ? "send" : "receive", op->tag, class_name(op->cls),
                  static_cast<long long>(cfg_.timeout_ms),
                  op->is_send ? "peer dead or not receiving" : "peer dead or never sent");
    if (op->is_send) {
      if (op->outstanding > 0) return fail_link(KVXFER_ERR_TIMEOUT, why);  // cannot cancel sends
      for (auto* q : {&send_queue_[idx(op->cls)], &ahead_queue_[idx(op->cls)]})
        q->erase(std::remove(q->begin(), q->end(), op), q->end());
      op->queued = false;
      op->cancelling = true;
      finish(op, KVXFER_ERR_TIMEOUT, why, now);
      maybe_release(op);
    } else {
      fail_recv(op, KVXFER_ERR_TIMEOUT, why, now);
      maybe_release(op);
    }
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::progress() {
  progress_epoch_.fetch_add(1, std::memory_order_relaxed);
  if (failed_) return set_error(fail_code_, "link failed: %s", fail_why_.c_str());
  Clock::time_point now = Clock::now();
  if (bell_armed_) {  // before the queues: a ring after this read stays for poll(2)
    char drain[512];
    while (::read(bell_fd_, drain, sizeof(drain)) == static_cast<ssize_t>(sizeof(drain))) {
    }
    bell_armed_ = false;
  }
  provider_full_ = posted_after_read_ = false;
  CqEvent evs[64];
  for (int c = 0; c < kNumClasses; ++c) {  // anchor CQ first
    for (int round = 0; round < 8; ++round) {
      size_t n = 0;
      const kvxfer_result_t r = ep_[c]->poll(evs, 64, &n);
      if (r != KVXFER_SUCCESS)
        return fail_link(r, strprintf("reading the %s completion queue failed: %s",
                                      class_name(static_cast<TrafficClass>(c)), last_error()));
      if (n > 0) {
        now = Clock::now();
        stirred_ = true;
      }
      for (size_t i = 0; i < n; ++i) {
        KVXFER_CHECK(handle_event(static_cast<TrafficClass>(c), evs[i], now));
        if (failed_) return fail_code_;
      }
      if (n < 64) break;
      if (round == 7) posted_after_read_ = true;  // entries left: read them before any sleep
    }
  }
  next_wake_ = Clock::time_point::max();  // lowered by the rate limiter when it holds a chunk
  if (connecting_ && !ready_) KVXFER_CHECK(post_hellos());
  KVXFER_CHECK(post_recvs(now));
  KVXFER_CHECK(schedule_sends(now));
  if (now - last_timeout_scan_ >= std::chrono::milliseconds(5)) {
    last_timeout_scan_ = now;
    KVXFER_CHECK(check_timeouts(now));
  }
  if (ready_ && now - last_liveness_check_ >= std::chrono::milliseconds(kLivenessMs)) {
    last_liveness_check_ = now;
    KVXFER_CHECK(check_liveness());
  }
  // What this side posted or completed may be the peer's next work (a
  // command in its region, a response to its send): wake it.
  if (peer_bell_fd_ >= 0 && !failed_) ring_peer_if_signalled(now);
  return failed_ ? fail_code_ : KVXFER_SUCCESS;
}

bool Link::prepare_wait(std::vector<pollfd>* fds) {
  if (failed_) return true;
  if (!ready_) return false;  // connecting: rxm's connection events need polling
  // The peer rings when it finds this side's signal word set; a ring after
  // progress() drained the bell wakes poll(2).  A signal still set is work
  // progress() has not taken up (shm retries by signalling itself); a full
  // provider queue frees without a signal: in both, poll.
  if (has_doorbell()) {
    if (provider_full_ || posted_after_read_ || own_signal_[0].signalled() ||
        own_signal_[1].signalled())
      return false;
    // A ring progress() held back (ring_peer_if_signalled) goes now: the
    // peer may sleep too.
    if (peer_bell_fd_ >= 0 && (peer_signal_[0].signalled() || peer_signal_[1].signalled()))
      ring_peer();
    bell_armed_ = true;
    fds->push_back(pollfd{bell_fd_, POLLIN, 0});
    return true;
  }
  // shm has no wait object, but with nothing in flight there is nothing to
  // poll for: what the peer sends waits in this side's region until a post
  // (which wakes the caller) asks for it.
  if (shm_path_ && ops_awaited() == 0) return true;
  const size_t first = fds->size();
  for (int c = 0; c < kNumClasses; ++c) {
    Endpoint* e = ep_[c].get();
    if (e == nullptr || !e->is_open()) continue;
    if (!e->trywait()) {
      fds->resize(first);
      return false;
    }
    fds->push_back(pollfd{e->wait_fd(), POLLIN, 0});
  }
  return true;
}

size_t Link::poll(std::vector<Completion>* out) {
  (void)progress();
  size_t n = 0;
  while (!done_.empty()) {
    out->push_back(std::move(done_.front()));
    done_.pop_front();
    ++n;
  }
  return n;
}

}  // namespace kvxfer::transport
