// The rendezvous of two benchmark processes; see rendezvous.h.
#include "perf/common/rendezvous.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <thread>

#include "perf/common/harness.h"
#include "perf/common/xfer_plan.h"

namespace kvxfer::perf {
namespace {
// Tag of the tiny transfers that order the posts in cross-host mode.
constexpr uint64_t kBarrierTag = 0x6b76706572665f62ull;
constexpr const char* kPeer = "the receiver process";
}  // namespace

RecvReq RecvReq::of(const kvxfer_request_info_t& i) {
  return {i.result,
          i.codec,
          i.mode,
          0,
          i.num_pages,
          i.kv_bytes,
          i.anchor_wire_bytes,
          i.residual_wire_bytes,
          i.t_posted_ns,
          i.t_handshake_ns,
          i.t_anchor_ready_ns,
          i.t_complete_ns,
          i.t_first_residual_ns};
}

std::vector<uint8_t> Batch::serialize() const {
  std::vector<uint8_t> b;
  auto put = [&b](const void* p, size_t n) {
    const uint8_t* c = static_cast<const uint8_t*>(p);
    b.insert(b.end(), c, c + n);
  };
  BatchHeader hh = h;
  hh.nreq = static_cast<int32_t>(reqs.size());
  hh.narrivals = static_cast<uint32_t>(arrivals.size());
  hh.error_len = static_cast<uint32_t>(error.size());
  put(&hh, sizeof(hh));
  put(reqs.data(), reqs.size() * sizeof(RecvReq));
  put(arrivals.data(), arrivals.size() * sizeof(ArrivalRec));
  put(error.data(), error.size());
  return b;
}

bool Batch::parse(const std::vector<uint8_t>& b) {
  if (b.size() < sizeof(BatchHeader)) return false;
  std::memcpy(&h, b.data(), sizeof(h));
  const size_t need = sizeof(h) + static_cast<size_t>(h.nreq) * sizeof(RecvReq) +
                      h.narrivals * sizeof(ArrivalRec) + h.error_len;
  if (h.nreq < 0 || b.size() != need) return false;
  size_t off = sizeof(h);
  reqs.resize(static_cast<size_t>(h.nreq));
  std::memcpy(reqs.data(), b.data() + off, reqs.size() * sizeof(RecvReq));
  off += reqs.size() * sizeof(RecvReq);
  arrivals.resize(h.narrivals);
  std::memcpy(arrivals.data(), b.data() + off, arrivals.size() * sizeof(ArrivalRec));
  off += arrivals.size() * sizeof(ArrivalRec);
  error.assign(reinterpret_cast<const char*>(b.data() + off), h.error_len);
  return true;
}

/**
 * Waits until every request is final.  A request that fails aborts the
 * communicator (so that the others end too: the run stops there).  If
 * nothing moves for stall_ms, or peer_alive() turns false, the communicator
 * is aborted as well.  Returns the first error, with its text in *err.
 */
kvxfer_result_t wait_all(kvxfer_comm_t comm, const std::vector<kvxfer_request_t>& reqs,
                         int64_t stall_ms, const std::function<bool()>& peer_alive,
                         std::string* err) {
  kvxfer_result_t first = KVXFER_SUCCESS;
  auto progress = [&reqs]() {
    uint64_t p = 0;
    for (kvxfer_request_t r : reqs) {
      kvxfer_request_info_t i = KVXFER_REQUEST_INFO_INITIALIZER;
      if (kvxfer_request_get_info(r, &i) == KVXFER_SUCCESS)
        p += static_cast<uint64_t>(i.stage) + static_cast<uint64_t>(i.pages_anchor_ready) +
             static_cast<uint64_t>(i.pages_complete) + i.anchor_wire_bytes + i.residual_wire_bytes;
      size_t n = 0;
      if (kvxfer_request_get_arrivals(r, nullptr, 0, &n) == KVXFER_SUCCESS) p += n;
    }
    return p;
  };
  uint64_t last = progress();
  int64_t last_t = mono_ns();
  bool aborted = false;
  for (kvxfer_request_t r : reqs) {
    for (;;) {
      const kvxfer_result_t w = kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 100);
      if (w == KVXFER_SUCCESS) break;
      if (w < 0) {
        if (first == KVXFER_SUCCESS) {
          first = w;
          *err = kvxfer_get_last_error();
        }
        if (!aborted) {
          kvxfer_comm_abort(comm);
          aborted = true;
        }
        break;
      }
      const uint64_t p = progress();
      if (p != last) {
        last = p;
        last_t = mono_ns();
      }
      std::string why;
      if ((mono_ns() - last_t) / 1000000 > stall_ms)
        why = strprintf("no progress for %" PRId64 " ms", stall_ms);
      else if (!peer_alive())
        why = "the peer process exited";
      if (!why.empty() && !aborted) {
        if (first == KVXFER_SUCCESS) {
          first = KVXFER_ERR_TIMEOUT;
          *err = why;
        }
        kvxfer_comm_abort(comm);
        aborted = true;
      }
    }
  }
  return first;
}

kvxfer_result_t settle(kvxfer_comm_t comm, const std::vector<kvxfer_request_t>& reqs,
                       kvxfer_result_t posted, int64_t stall_ms,
                       const std::function<bool()>& peer_alive, std::string* err) {
  if (posted == KVXFER_SUCCESS) return wait_all(comm, reqs, stall_ms, peer_alive, err);
  kvxfer_comm_abort(comm);
  std::string unused;
  wait_all(comm, reqs, stall_ms, peer_alive, &unused);
  return posted;
}

void free_all(std::vector<kvxfer_request_t>* reqs) {
  for (kvxfer_request_t r : *reqs) kvxfer_request_free(r);
  reqs->clear();
}

bool PipeBarrier::receiver_posted(int64_t t_last_post, std::string* err) {
  if (send_msg(wr_, kMsgPosted, &t_last_post, sizeof(t_last_post))) return true;
  *err = "writing to the parent failed";
  return false;
}

bool PipeBarrier::sender_wait(std::string* err) {
  uint32_t type;
  std::vector<uint8_t> p;
  if (!recv_msg(rd_, &type, &p, kPipeWaitMs, kPeer, err)) return false;
  if (type == kMsgFatal) {
    *err = "receiver (rank 1): " + std::string(p.begin(), p.end());
    return false;
  }
  if (type == kMsgBatch) {  // a failed batch before the post
    Batch b;
    *err = b.parse(p) ? "receiver (rank 1): " + b.error : "malformed message from the receiver";
    return false;
  }
  if (type != kMsgPosted || p.size() != sizeof(int64_t)) {
    *err = "unexpected message from the receiver";
    return false;
  }
  return true;
}

XferBarrier::XferBarrier(kvxfer_comm_t comm, int64_t stall_ms) : comm_(comm), stall_ms_(stall_ms) {
  k_[0] = buf_;
  v_[0] = buf_ + 16;
  desc_ = KVXFER_KV_DESC_INITIALIZER;
  desc_.num_layers = 1;
  desc_.kv_heads = 1;
  desc_.head_dim = 16;
  desc_.dtype = KVXFER_DTYPE_BF16;
  desc_.num_tokens = 1;
  desc_.block_size = 1;
  desc_.num_blocks = 1;
  desc_.k_blocks = k_;
  desc_.v_blocks = v_;
  codec_.codec = KVXFER_CODEC_BF16;
  rc_.tag = kBarrierTag;
  rc_.mode = KVXFER_MODE_MONOLITHIC;
}

bool XferBarrier::receiver_posted(int64_t t_last_post, std::string* err) {
  (void)t_last_post;
  kvxfer_request_t r = nullptr;
  const kvxfer_result_t rc = kvxfer_send(comm_, 0, &desc_, &codec_, &rc_, &r);
  if (rc < 0) {
    *err = api_error("kvxfer_send (barrier)", rc);
    return false;
  }
  pending_.push_back(r);
  return true;
}

bool XferBarrier::sender_wait(std::string* err) {
  kvxfer_request_t r = nullptr;
  const kvxfer_result_t rc = kvxfer_recv(comm_, 1, &desc_, &rc_, &r);
  if (rc < 0) {
    *err = api_error("kvxfer_recv (barrier)", rc);
    return false;
  }
  pending_.push_back(r);
  return finish(err);
}

bool XferBarrier::finish(std::string* err) {
  std::string why;
  const kvxfer_result_t rc = wait_all(
      comm_, pending_, stall_ms_, [] { return true; }, &why);
  free_all(&pending_);
  if (rc < 0) *err = "barrier transfer failed: " + why;
  return rc == KVXFER_SUCCESS;
}

bool read_id_file(const std::string& path, int64_t wait_ms, kvxfer_unique_id_t* id,
                  std::string* err) {
  const int64_t end = mono_ns() + wait_ms * 1000000;
  for (;;) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && st.st_size == KVXFER_UNIQUE_ID_BYTES) {
      FILE* f = std::fopen(path.c_str(), "rb");
      if (f != nullptr) {
        const size_t n = std::fread(id->internal, 1, KVXFER_UNIQUE_ID_BYTES, f);
        std::fclose(f);
        if (n == KVXFER_UNIQUE_ID_BYTES) return true;
      }
    }
    if (mono_ns() > end) {
      *err = strprintf("no %d-byte unique id appeared in %s within %" PRId64
                       " ms (start rank 0 first, or together)",
                       KVXFER_UNIQUE_ID_BYTES, path.c_str(), wait_ms);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

bool write_id_file(const std::string& path, const kvxfer_unique_id_t& id, std::string* err) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    *err = "cannot create " + tmp + ": " + std::strerror(errno);
    return false;
  }
  const bool ok = std::fwrite(id.internal, 1, KVXFER_UNIQUE_ID_BYTES, f) == KVXFER_UNIQUE_ID_BYTES;
  if (std::fclose(f) != 0 || !ok) {
    *err = "cannot write " + tmp;
    return false;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {  // rank 1 never sees a partial id
    *err = "cannot rename " + tmp + " to " + path + ": " + std::strerror(errno);
    return false;
  }
  return true;
}

}  // namespace kvxfer::perf
