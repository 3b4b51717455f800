// The rendezvous of kvxfer_perf's two processes: framed messages over a pipe
// (pipe_msg.h, which the disaggregated demo shares), waiting for kvxfer
// requests with a watchdog, the barrier that orders the receiver's posts before the
// sender's, the unique-id file of cross-host runs, and the per-batch report
// a receiver sends back.  Public API only (kvxfer/kvxfer.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "perf/common/pipe_msg.h"

namespace kvxfer::perf {

/** Message types of kvxfer_perf's receiver -> sender pipe (pipe_msg.h). */
enum MsgType : uint32_t { kMsgPosted = 1, kMsgBatch = 2, kMsgFatal = 3 };

// ---------------------------------------------------------------------------
// What the receiver reports for each batch (R requests) of one size and codec
// ---------------------------------------------------------------------------
struct RecvReq {  // POD: it crosses the pipe as bytes
  int32_t result = 0, codec = 0, mode = 0, reserved = 0;
  int64_t num_pages = 0;
  uint64_t kv_bytes = 0, anchor_wire = 0, residual_wire = 0;
  int64_t t_posted = 0, t_handshake = 0, t_anchor = 0, t_complete = 0, t_first_residual = 0;

  /** The record of a request's kvxfer_request_get_info. */
  static RecvReq of(const kvxfer_request_info_t& i);
};

struct ArrivalRec {  // POD
  int64_t t_ns = 0;
  uint64_t bytes = 0;
  int32_t request = 0, traffic_class = 0, layer = 0, reserved = 0;
};

struct BatchHeader {  // POD
  int32_t ok = 0, nreq = 0;
  int64_t wrong = -1;  // -1: not checked
  int64_t t_last_post = 0;
  uint32_t narrivals = 0, error_len = 0;
};

struct Batch {
  BatchHeader h;
  std::vector<RecvReq> reqs;
  std::vector<ArrivalRec> arrivals;  // last iteration of each size and codec only
  std::string error;

  std::vector<uint8_t> serialize() const;
  bool parse(const std::vector<uint8_t>& b);
};

// ---------------------------------------------------------------------------
// Waiting for requests, with a watchdog on top of the transport's own timeout.
// ---------------------------------------------------------------------------
/**
 * Waits until every request is final.  A request that fails aborts the
 * communicator (so that the others end too: the run stops there).  If
 * nothing moves for stall_ms, or peer_alive() turns false, the communicator
 * is aborted as well.  Returns the first error, with its text in *err.
 */
kvxfer_result_t wait_all(kvxfer_comm_t comm, const std::vector<kvxfer_request_t>& reqs,
                         int64_t stall_ms, const std::function<bool()>& peer_alive,
                         std::string* err);

/**
 * The end of a batch whose posts returned `posted`: on success, wait_all;
 * after a failed post, aborts the communicator and waits for the requests
 * that were posted to end, keeping `posted` and *err.
 */
kvxfer_result_t settle(kvxfer_comm_t comm, const std::vector<kvxfer_request_t>& reqs,
                       kvxfer_result_t posted, int64_t stall_ms,
                       const std::function<bool()>& peer_alive, std::string* err);

void free_all(std::vector<kvxfer_request_t>* reqs);

// ---------------------------------------------------------------------------
// Ordering the posts: the receiver posts its R receives first, then the
// sender its R sends, so the time from the later post covers the sender's
// whole encode.  Fork mode: a message on the pipe.  Cross-host mode: a tiny
// transfer from rank 1 to rank 0.
// ---------------------------------------------------------------------------
class Barrier {
 public:
  virtual ~Barrier() = default;
  /** Receiver: its receives are posted (the last at t_last_post). */
  virtual bool receiver_posted(int64_t t_last_post, std::string* err) = 0;
  /** Receiver: at the end of the batch. */
  virtual bool receiver_done(std::string* err) {
    (void)err;
    return true;
  }
  /** Sender: returns once the receiver has posted. */
  virtual bool sender_wait(std::string* err) = 0;
};

class PipeBarrier : public Barrier {
 public:
  PipeBarrier(int fd_to_parent, int fd_from_child) : wr_(fd_to_parent), rd_(fd_from_child) {}
  bool receiver_posted(int64_t t_last_post, std::string* err) override;
  bool sender_wait(std::string* err) override;

 private:
  int wr_, rd_;
};

class XferBarrier : public Barrier {
 public:
  XferBarrier(kvxfer_comm_t comm, int64_t stall_ms);
  bool receiver_posted(int64_t t_last_post, std::string* err) override;
  bool receiver_done(std::string* err) override { return finish(err); }
  bool sender_wait(std::string* err) override;

 private:
  bool finish(std::string* err);
  kvxfer_comm_t comm_;
  int64_t stall_ms_;
  uint16_t buf_[32] = {};
  void* k_[1];
  void* v_[1];
  kvxfer_kv_desc_t desc_;
  kvxfer_codec_config_t codec_ = KVXFER_CODEC_CONFIG_INITIALIZER;
  kvxfer_request_config_t rc_ = KVXFER_REQUEST_CONFIG_INITIALIZER;
  std::vector<kvxfer_request_t> pending_;
};

// ---------------------------------------------------------------------------
// Cross-host mode: the unique id travels in a file.
// ---------------------------------------------------------------------------
/** Waits up to wait_ms for a whole unique id in `path`. */
bool read_id_file(const std::string& path, int64_t wait_ms, kvxfer_unique_id_t* id,
                  std::string* err);
/** Writes the id to `path` atomically (a temporary file, then rename). */
bool write_id_file(const std::string& path, const kvxfer_unique_id_t& id, std::string* err);

}  // namespace kvxfer::perf
