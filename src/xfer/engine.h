// The engine behind kvxfer_comm_t and kvxfer_send / kvxfer_recv.
//
// An Engine owns one transport::Communicator (a Link per peer), one progress
// thread and a pool of codec threads (docs/TRANSPORT.md, "Threads"):
//   progress thread  the only thread that touches the Links: posts DESC,
//                    page and STATUS messages (protocol.h), reads completions,
//                    runs the handshake, posts residual receives into the
//                    bounded staging pool, publishes stages and runs the
//                    callbacks; sleeps on the Links' CQ wait objects and an
//                    eventfd when nothing moves;
//   codec threads    (KVXFER_CODEC_THREADS, 1..64; default half the CPUs, 1..8)
//                    encode pages (sender) and decode them into the
//                    receiver's blocks, one page per thread, highest priority
//                    first: anchor decodes, then encodes, then residual decodes.
// API threads only queue new requests (under the engine's lock) and read or
// wait on a Request's public state (under the request's lock).
//
// Memory (docs/TRANSPORT.md, "Memory"): the sender holds each request's
// encoded sections until its messages are sent; the receiver holds each
// request's anchor sections (they are needed again to apply the residual),
// both in buffers of a StagingCache (staging.h) that keeps released ones for
// the next request; residual sections land in ONE staging pool of
// KVXFER_RECV_STAGING_BYTES shared by every request, so staging does not
// grow with requests in flight.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "kvxfer/spectrum.h"
#include "transport/bootstrap.h"
#include "xfer/protocol.h"
#include "xfer/test_hooks.h"

namespace kvxfer::transport {
struct LinkConfig;
class Link;
}  // namespace kvxfer::transport

namespace kvxfer::xfer {

/**
 * The most peers an endpoint lets handshake at once: an accepted CONNECT
 * past it is answered ERROR ("busy"), so that a peer holding the blob cannot
 * make it open Links (about 1.6 MB and 1 fd each over shared memory, 11 MB
 * and 24 fds over the network) faster than their handshakes time out.  A
 * handshake takes milliseconds; lazily connecting peers stay far below it.
 */
constexpr int kMaxHandshakingPeers = 64;

class Engine;
class Request;
struct Work;  // the progress thread's private state of a request (engine.cc)

/** Where kvxfer_request_cancel leaves a request for its engine's progress
 *  thread; shared by the engine and its requests, so a request that outlives
 *  its communicator finds it closed. */
struct CancelInbox {
  std::mutex mu;
  std::vector<std::shared_ptr<Request>> requests;
  std::atomic<bool> pending{false};
  std::atomic<bool> layers_marked{false};  // kvxfer_send_layer_ready since the last round
  bool closed = false;                     // the engine is gone
  int wake_fd = -1;  // the engine's progress wake-up (eventfd); -1 once closed
};

/** One section's arrival (receiver) or send completion (sender). */
struct Arrival {
  int64_t t_ns;
  int32_t traffic_class;  // 0 anchor, 1 residual
  int32_t layer;
  uint64_t bytes;
};

/** A request.  Public state under `mu`; `work` belongs to the progress thread. */
class Request {
 public:
  Request();
  ~Request();
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;

  // ---- fixed at post --------------------------------------------------------
  bool is_send = false;
  int peer = -1;
  uint32_t seq = 0;
  // match_by_id: the runtime's id.  A receive's seq is the sender's, known
  // once its RDV arrives (protocol.h); until then `bound` is false and the
  // request waits in the engine's rendezvous list (progress thread only).
  bool by_id = false;
  uint64_t request_id = 0;
  bool bound = true;
  // When an unbound receive began to wait for its RDV (CLOCK_MONOTONIC ns):
  // it fails alone once it has waited the timeout (sweep_claims).
  int64_t rdv_since = 0;
  // A send to KVXFER_ANY_PEER no peer has asked for yet: peer is -1 until
  // claim() sets it (under mu) and clears this (progress thread).
  bool unclaimed = false;
  // Post order within the communicator (the peer sends in this order); a
  // receive by id takes it when its RDV arrives (the sender's order).
  uint64_t order = 0;
  kvxfer_request_config_t cfg{};
  void* handle = nullptr;  // the kvxfer_request_t given to callbacks
  Desc mine;               // what this side announces
  int32_t block_size = 0;
  int64_t row_stride = 0, num_blocks = 0;
  std::vector<void*> k_blocks, v_blocks;
  int device = -1;  // CUDA ordinal of the blocks, -1 = host memory
  // device >= 0: the block tables copied to the device (device arrays of
  // num_layers * num_blocks pointers), which the kernels read (xfer/device.h).
  std::shared_ptr<void> dev_k_blocks, dev_v_blocks;
  // Sender, device >= 0: the event recorded on the caller's stream at post
  // (DeviceCodec::record_ready); every encode waits on it.
  std::shared_ptr<void> ready;
  uint64_t kv_bytes = 0;
  // stream_layers sends: layers [0, layers_ready) may be read (the API thread
  // advances it, the progress thread reads it); t_layer_mark is the post or
  // the last kvxfer_send_layer_ready (ns), for the timeout.  Others:
  // num_layers from the post.
  std::atomic<int32_t> layers_ready{0};
  std::atomic<int64_t> t_layer_mark{0};
  std::vector<uint8_t> layer_marked;  // under mu
  // SpectrumKV (codec SPECTRUM): one tier (kvxfer_tier_t) per token, the
  // same for every layer's K and V.  Sender: the policy's choice, fixed at
  // post.  Receiver: read from the layer-0 K pages' precision maps by the
  // codec thread; complete once the request is ANCHOR_READY.
  std::vector<uint8_t> tiers;

  // ---- public state (mu) ----------------------------------------------------
  mutable std::mutex mu;
  std::condition_variable cv;
  kvxfer_stage_t stage = KVXFER_STAGE_POSTED;
  kvxfer_result_t result = KVXFER_IN_PROGRESS;
  std::string error;
  kvxfer_codec_t codec = KVXFER_CODEC_LYNX;
  kvxfer_mode_t mode = KVXFER_MODE_AUTO;
  int64_t num_pages = 0, pages_anchor = 0, pages_complete = 0;
  std::vector<int64_t> layer_pages, layer_anchor, layer_complete;
  uint64_t anchor_wire_bytes = 0, residual_wire_bytes = 0;
  int64_t t_posted = 0, t_handshake = 0, t_anchor_ready = 0, t_complete = 0, t_error = 0,
          t_first_residual = 0;
  std::vector<Arrival> arrivals;
  bool callback_running = false;
  bool cancel_requested = false;

  std::shared_ptr<CancelInbox> inbox;  // fixed at post
  std::unique_ptr<Work> work;          // progress thread only
};

/** Monotonic time in ns (CLOCK_MONOTONIC, as steady_clock on Linux). */
int64_t now_ns();

/** kvxfer_test / kvxfer_test_layer (layer -1 = the whole request). */
kvxfer_result_t request_test(const Request& r, int32_t layer, kvxfer_stage_t* stage);
/** kvxfer_wait / kvxfer_wait_layer; `want`: the caller's stage as its integer (c_enum_value). */
kvxfer_result_t request_wait(Request& r, int32_t layer, int32_t want, int timeout_ms);
kvxfer_result_t request_info(const Request& r, kvxfer_request_info_t* info);
/**
 * kvxfer_request_cancel: asks the progress thread to fail `r` with
 * KVXFER_ERR_CANCELLED (and tell the peer).  Returns at once; a final
 * request, or one already being cancelled, is left as it is.
 */
kvxfer_result_t request_cancel(const std::shared_ptr<Request>& r);
/** kvxfer_send_layer_ready. */
kvxfer_result_t request_layer_ready(Request& r, int32_t layer);
/** kvxfer_request_get_tiers. */
kvxfer_result_t request_tiers(const Request& r, uint8_t* tiers, int64_t num_tokens);

/** The SpectrumKV arguments of kvxfer_send_spectrum (NULL members = defaults). */
struct SpectrumArgs {
  const kvxfer_spectrum_config_t* policy = nullptr;
  const float* importance = nullptr;  // [num_tokens], or NULL: the KV norm
};
/** True when COMPLETE or ERROR and no callback is running (after waiting for one). */
bool request_wait_final_callbacks(Request& r);

class Engine {
 public:
  /**
   * Joins the communicator (transport::Communicator::create) and starts the
   * threads.  `root` is the listener kvxfer_get_unique_id made (rank 0 only).
   * `rate_limit`: tc syntax for this communicator's own token bucket, "" for
   * none, NULL for the process-wide KVXFER_RATE_LIMIT one.  `hooks`: test
   * and benchmark seams (test_hooks.h), shared with the caller; null for a
   * product communicator.
   */
  static kvxfer_result_t create(const transport::UniqueId& id,
                                std::unique_ptr<transport::BootstrapRoot> root, int rank,
                                int nranks, int timeout_ms, const std::string& bind,
                                const char* rate_limit, std::unique_ptr<Engine>* out,
                                std::shared_ptr<TestHooks> hooks = nullptr);
  /**
   * The engine of an endpoint (xfer/endpoint.h): no peer yet, rank() -1.
   * Its peers come and go through reserve_peer/adopt_peer/drop_peer, which
   * the endpoint's Membership calls.  `bind`: the Links' local address;
   * `rate_limit`, `hooks`: as create.
   */
  static kvxfer_result_t create_open(int timeout_ms, const std::string& bind,
                                     const char* rate_limit, std::unique_ptr<Engine>* out,
                                     std::shared_ptr<TestHooks> hooks = nullptr);

  /** The configuration of this engine's Links (for the endpoint's new ones). */
  const transport::LinkConfig& link_config() const;
  /** A new peer slot (open engine); posts to it are accepted once adopted.  Any thread. */
  int reserve_peer();
  /**
   * Hands the connected Link of `peer` (reserve_peer's) to the progress
   * thread; posts to `peer` are accepted from now on.  Any thread.
   */
  void adopt_peer(int peer, std::unique_ptr<transport::Link> link);
  /**
   * Ends `peer`: later posts to it fail at the call naming `why`; the
   * progress thread fails its requests with (`code`, `why`), then closes and
   * frees its Link once nothing of it is in flight.  Idempotent.  Any thread.
   */
  void drop_peer(int peer, kvxfer_result_t code, const std::string& why, bool close_link = true);
  /**
   * After drop_peer(..., close_link = false): closes the Link, which was
   * kept open so that the peer could be told first (its requests then fail
   * as it was told, not by the connection's reset).  Any thread.
   */
  void close_peer(int peer);
  /**
   * Called on the progress thread, with no engine lock held, once when the
   * Link of a peer fails (dead, stalled or corrupt peer).  Set before the
   * first adopt_peer.
   */
  using PeerFailed = std::function<void(int peer, const std::string& why)>;
  void set_peer_failed(PeerFailed f);
  /** Adopted peers whose Link has not finished its handshake (neither
   *  ready nor failed): what an endpoint bounds its accepts by.  Any thread. */
  int handshaking_peers() const;
  /** The most peers an endpoint lets handshake at once (its accepts):
   *  kMaxHandshakingPeers, or the test hooks' max_handshaking. */
  int max_handshaking_peers() const;

  /** Aborts what is in flight, joins both threads, closes the Links. */
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int rank() const;
  int nranks() const;

  /**
   * Validates and queues a send (is_send) or receive.  `handle` is what the
   * callbacks receive.  Errors are returned at once; nothing is queued.
   * A send of device KV is ordered after the work enqueued on `cuda_stream`
   * (a cudaStream_t of the KV's device; NULL = the legacy default stream)
   * before this call (kvxfer_send_on_stream).  `memory_checked`: the
   * blocks belong to a registered pool (kv_pool.h), so their memory is not
   * probed again.
   */
  kvxfer_result_t post(bool is_send, int peer, const kvxfer_kv_desc_t* kv,
                       const kvxfer_codec_config_t* codec, const kvxfer_request_config_t* cfg,
                       void* handle, std::shared_ptr<Request>* out,
                       const SpectrumArgs* spectrum = nullptr, void* cuda_stream = nullptr,
                       bool memory_checked = false);

  /** Fails every request not yet final and closes the Links; never blocks on a peer. */
  void abort(const char* why);
  /** True once abort() was called (kvxfer_comm_abort, or destroy). */
  bool aborted() const;

  struct Impl;

  /**
   * Test seam (fuzz/peer_message_fuzz.cc): rank `rank` of `nranks` with no
   * Communicator and no threads.  Its Link posts are recorded in
   * Impl::testing_posts; the caller completes them (Impl::on_completion),
   * runs the codec jobs (Impl::run_job) and the progress rounds (Impl::step).
   */
  static std::unique_ptr<Engine> testing_unlinked(int rank, int nranks);
  Impl* testing_impl() { return impl_.get(); }

 private:
  Engine() = default;
  /** Impl's state from the parameters (everything but the Links and threads). */
  static void init_state(Impl* m, int rank, int nranks, int timeout_ms,
                         std::shared_ptr<TestHooks> hooks);
  /** Impl's eventfd and threads. */
  static kvxfer_result_t start_threads(Impl* m);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvxfer::xfer
