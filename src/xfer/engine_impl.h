// Internals of the engine shared by its source files (not installed):
//   engine.cc           creation and teardown, posting, public state queries;
//   engine_codec.cc     the codec threads;
//   engine_progress.cc  the progress thread: Links, handshakes, pages;
//   engine_peers.cc     its peers: rendezvous by id, peers adopted and dropped;
//   engine_request.cc   a request's end: completion, failure, cancel, stages.
// engine.h has the design; docs/TRANSPORT.md, "Transfers", the protocol.
#pragma once

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstring>
#include <deque>
#include <list>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "codec/codec.h"
#include "codec/format.h"
#include "codec/kv_desc.h"
#include "codec/page.h"
#include "common/error.h"
#include "common/log.h"
#include "common/params.h"
#include "transport/comm.h"
#include "transport/ofi.h"
#include "xfer/device.h"
#include "xfer/engine.h"
#include "xfer/staging.h"

namespace kvxfer::xfer {

using transport::Clock;
using transport::Completion;
using transport::Link;
using transport::TrafficClass;

/** Inserts `r` into `q`, kept in request post order (Request::order). */
void insert_in_order(std::deque<std::shared_ptr<Request>>* q, const std::shared_ptr<Request>& r);

/** Codec worker threads of an engine (engine.cc); `hooks` may be null. */
int codec_workers(const TestHooks* hooks);

// ---------------------------------------------------------------------------
// The progress thread's private state of a request.
// ---------------------------------------------------------------------------
struct PageState {
  size_t a_off = 0, a_cap = 0;  // slot in `astore` (monolithic: both sections)
  int32_t slot = -1;            // its slot of the staging window (-1: none held)
  size_t r_off = 0, r_cap = 0;  // sender: slot in `rstore`; receiver: staging capacity
  size_t a_len = 0, r_len = 0;  // section bytes (sender: encoded; receiver: received)
  bool encoded = false;         // sender
  bool anchor_applied = false;  // receiver
  bool residual_arrived = false;
  std::unique_ptr<uint8_t[]> staging;  // receiver: the residual section
  // Receiver: the anchor section as its decode parsed it, for the residual step.
  std::unique_ptr<codec::DecodePlan> plan;
};

struct Work {
  std::vector<PageRef> pages;
  std::vector<PageState> ps;
  Staging astore, rstore;  // from the engine's StagingCache
  // The staging window (KVXFER_STAGING_WINDOW_BYTES): `astore` holds
  // `free_slots.size()` + slots in use of `slot_bytes` each.  A sender's page
  // takes a slot when its encode is queued and gives it back when its anchor
  // (or monolithic) message is sent, so its sections cycle through a few
  // cache-resident slots instead of a buffer the size of the KV.  A
  // receiver's page i sits at i * slot_bytes, every receive posted at the
  // handshake (engine_progress.cc, on_handshake, says why).
  size_t slot_bytes = 0;
  size_t rstore_bytes = 0;  // sender, progressive: every page's residual capacity
  std::vector<int32_t> free_slots;
  size_t next_encode = 0;       // sender: pages whose encode is queued
  size_t next_anchor_post = 0;  // receiver: anchor (or monolithic) receives posted
  // Device requests: astore/rstore page-locked (xfer/device.h, pin); released
  // before the stores (declared after them, reset first in finalise).
  std::shared_ptr<void> apin, rpin;
  kvxfer_codec_config_t codec{};  // sender's codec (receiver: from the handshake)
  kvxfer_mode_t mode = KVXFER_MODE_AUTO;
  int32_t page_tokens = 0;

  bool started = false;
  bool handshake_done = false, handshake_ok = false;
  std::vector<uint8_t> desc_out, desc_in, status_out, status_in;
  std::vector<uint8_t> rdv_out;       // a by-id sender's RDV (protocol.h)
  std::vector<uint8_t> withdraw_out;  // its WITHDRAW, if it fails before the receiver's DESC
  std::vector<uint8_t> ask_out;       // a by-id receiver's ASK (protocol.h)
  uint32_t ask_n = 0;                 // its number on the peer's ask stream
  bool rdv_told = false;              // a failed receive by id whose RDV came: refused then
  size_t next_page_send = 0;          // sender: pages posted to the Link
  size_t next_residual_post = 0;      // receiver: residual receives posted
  int64_t sends_done = 0, anchor_sends_done = 0;
  bool peer_status = false, peer_status_ok = false;
  bool status_sent = false;
  bool in_residual_fifo = false;
  bool peer_gave_up = false;  // receiver: an empty page message arrived
  bool peer_refused = false;  // sender: an empty DESC arrived (refuse_rdv: no page follows)
  bool desc_sent = false;     // this side's DESC was posted (a receiver's waits: admit_recv)
  bool gated = false;         // receiver: waiting in recv_gate
  bool pre_admitted = false;  // receiver: its DESC went at post (its KV's size reserved)
  bool send_staged = false;   // sender: holds its window and residual store (sends_staged)
  size_t gate_bytes = 0;      // receiver: counted in gate_used (reserved, then its anchor store)

  // Failure: decided at once, published (stage ERROR) when no codec job runs.
  bool failed = false;
  kvxfer_result_t fail_code = KVXFER_SUCCESS;
  std::string fail_text;
  std::atomic<bool> cancel{false};  // read by the codec thread

  bool final_published = false;
  bool finalised = false;
  int ops = 0;                    // Link operations not yet completed
  int jobs = 0;                   // codec jobs queued or running
  int held = 0;                   // sender: residuals waiting in held_residuals
  int64_t anchors_remaining = 0;  // receiver: this request's share of anchors_unapplied

  // Codec threads, under alpha_mu: alpha resolved by calibration (alpha = auto).
  std::mutex alpha_mu;
  bool alpha_resolved = false;
  float alpha = 0.0f;
};

// ---------------------------------------------------------------------------
// The engine.
// ---------------------------------------------------------------------------
enum class JobKind { kDecodeAnchor = 0, kDecodeMono = 1, kEncode = 2, kDecodeFull = 3 };

struct Job {
  std::shared_ptr<Request> req;
  JobKind kind;
  size_t page;
  // Inputs, fixed when queued (the codec thread never reads Work's containers).
  kvxfer_codec_config_t codec;
  PageRef ref;
  uint8_t* a = nullptr;  // sender: anchor slot; receiver: anchor (or monolithic) section
  size_t a_len = 0, a_cap = 0;
  uint8_t* r = nullptr;  // sender: residual slot; receiver: residual section
  size_t r_len = 0, r_cap = 0;
  bool monolithic = false;
  std::unique_ptr<codec::DecodePlan> plan;  // kDecodeFull: the anchor step's (may be null)
};

struct JobDone {
  std::shared_ptr<Request> req;
  JobKind kind;
  size_t page;
  kvxfer_result_t rc;
  std::string error;
  size_t a_len = 0, r_len = 0;
  bool skipped = false;
  std::unique_ptr<codec::DecodePlan> plan;  // kDecodeAnchor on the host: for the residual step
};

enum class OpKind {
  kDescSend,
  kDescRecv,
  kStatusSend,
  kStatusRecv,
  kAnchor,
  kResidual,
  kRdvSend,  // a by-id send's announcement (protocol.h, RDV)
  kRdvRecv,  // the peer's rendezvous stream (no request: OpRef::req is null)
  kAskSend,  // a by-id receive's ASK (protocol.h)
  kAskRecv   // the peer's ask stream (no request)
};

struct OpRef {
  std::shared_ptr<Request> req;
  OpKind kind;
  size_t page;
  bool is_send;
};

/** The layout of page `ref` in one side's blocks. */
inline kvxfer_page_layout_t page_layout(const Request& r, const PageRef& ref) {
  kvxfer_page_layout_t l{};
  const auto& blocks = ref.kind == KVXFER_KV_KEY ? r.k_blocks : r.v_blocks;
  l.blocks = blocks.data() + static_cast<size_t>(ref.layer) * static_cast<size_t>(r.num_blocks);
  l.num_blocks = r.num_blocks;
  l.block_size = r.block_size;
  l.row_stride = r.row_stride;
  l.first_token = ref.token_begin;
  l.num_tokens = ref.num_tokens;
  l.num_channels = r.mine.kv_heads * r.mine.head_dim;
  l.dtype = r.mine.dtype;
  return l;
}

/**
 * The layout the codec reads or writes: page_layout, with the block table the
 * kernels can read when the KV is on a device (a device array).
 */
inline kvxfer_page_layout_t codec_layout(const Request& r, const PageRef& ref) {
  kvxfer_page_layout_t l = page_layout(r, ref);
  if (r.device >= 0) {
    const auto* table = static_cast<void* const*>(
        (ref.kind == KVXFER_KV_KEY ? r.dev_k_blocks : r.dev_v_blocks).get());
    l.blocks = table + static_cast<size_t>(ref.layer) * static_cast<size_t>(r.num_blocks);
  }
  return l;
}

/**
 * Page-locks a staging store of a device request (a failure only costs
 * speed): all `len` bytes of its capacity, so the registration, kept by the
 * device codec, serves every later request the store's buffer stages.
 */
inline std::shared_ptr<void> pin_store(const Request& r, uint8_t* p, size_t len) {
  std::shared_ptr<void> h;
  if (r.device < 0 || p == nullptr) return h;
  if (xfer::device_codec()->pin(r.device, p, len, &h) < 0)
    KVXFER_WARN(LOG_NET,
                "could not page-lock %zu bytes of staging (%s); copying through pageable memory",
                len, last_error());
  return h;
}

inline kvxfer_page_id_t page_id(const Request& r, const PageRef& ref) {
  kvxfer_page_id_t id{};
  id.layer = static_cast<uint32_t>(ref.layer);
  id.kind = ref.kind;
  id.token_begin = ref.token_begin;
  id.stream_id = r.mine.tag;
  return id;
}

inline std::string page_name(const PageRef& p) {
  return strprintf("page of layer %d %s, tokens [%" PRId64 ", %" PRId64 ")", p.layer,
                   codec::kv_kind_name(p.kind), p.token_begin, p.token_begin + p.num_tokens);
}

/** The progress thread's state of one peer (Engine::Impl::io). */
struct PeerIo {
  std::unordered_map<uint64_t, OpRef> ops;  // Link op id -> what
  // The handshaken sends with anchors not yet posted (Work::next_page_send
  // below its page count).
  std::unordered_set<const Request*> anchors_unposted;
  // Residuals held until every anchor of every other handshaken send to
  // this peer is posted (flush_residuals).
  std::list<std::pair<std::shared_ptr<Request>, size_t>> held_residuals;
  // The sends whose encodes are not all queued, in post order: of those the
  // receiver has matched (handshake_ok), only the first may queue encodes,
  // so page messages leave in request order, then page order, which is the
  // order the receiver posts its receives in.  One not matched yet fills its
  // window and lets the ones behind it go (pump_encodes).  Interleaving the
  // matched requests' windows sent pages the receiver had no receive for
  // yet; rxm's unexpected-message buffers filled and the anchor class
  // stalled when progressive and monolithic requests shared a peer.
  std::list<std::shared_ptr<Request>> encode_fifo;
  // Rendezvous of requests matched by id (protocol.h, RDV): the receives
  // waiting for their sender's announcement, announcements that no receive
  // wants yet (id -> seq, order), whether the stream's receive is posted and
  // its buffer, and the stream's counters both ways.
  std::list<std::shared_ptr<Request>> rdv_waiting;
  struct Parked {
    uint32_t seq;
    uint64_t order;
    int64_t t_ns;  // arrival: refused once it has waited the timeout (sweep_claims)
  };
  std::unordered_map<uint64_t, Parked> rdv_parked;
  bool rdv_armed = false;
  std::vector<uint8_t> rdv_in = std::vector<uint8_t>(kRdvBytes);
  uint32_t rdv_sent = 0, rdv_received = 0;
  // Ids of receives cancelled (or failed) before their RDV came: when it
  // does, the sender is told with a STATUS, and its DESC and STATUS are
  // drained (ops with a null request).
  struct Refusal {
    kvxfer_result_t code;
    std::string text;
    int64_t t_ns;  // kept for the timeout (sweep_claims), then dropped
  };
  std::unordered_map<uint64_t, Refusal> rdv_refused;
  // Sender: ids of this side's by-id sends to the peer that withdrew
  // (protocol.h, WITHDRAW), kept for the timeout: an ask for one is answered
  // with a WITHDRAW of seq kRdvSeq (answer_ask), so the receive fails after
  // a round trip; a new send of the id drops it.
  std::unordered_map<uint64_t, Refusal> withdrew;
  // The peer's ask stream (protocol.h, ASK): its standing receive and
  // buffer, the stream's counters both ways, and asks no send to
  // KVXFER_ANY_PEER has taken yet (id -> when, ns), kept for the timeout.
  bool ask_armed = false;
  std::vector<uint8_t> ask_in = std::vector<uint8_t>(kAskBytes);
  uint32_t ask_sent = 0, ask_received = 0;
  struct Ask {
    int64_t t_ns;  // arrival: the earliest asker takes a send (try_claims)
    uint32_t n;    // its number on the stream, which a WITHDRAW answering it names
  };
  std::unordered_map<uint64_t, Ask> asks;
  std::unordered_map<uint64_t, std::vector<uint8_t>> drain_bufs;  // by Link op id
  bool draining = false;      // dropped: its Link goes once drained
  bool holding = false;       // dropped, its Link kept open until close_peer
  bool failure_told = false;  // its Link's failure was reported (peer_failed)
  bool handshaking = false;   // counted in Impl::handshaking (adopted, Link not ready yet)
};

struct Engine::Impl {
  std::unique_ptr<transport::Communicator> comm;  // null: Engine::testing_unlinked
  // Engine::testing_unlinked: with no Communicator, every Link post is
  // recorded here (its op id is the index + 1) and the caller completes it
  // with on_completion; step() then polls no Link.
  struct TestingPost {
    int peer;
    TrafficClass cls;
    uint64_t tag;
    bool is_send;
    uint8_t* buf;  // a receive's buffer (cap bytes), or the bytes sent
    size_t len;
  };
  std::vector<TestingPost> testing_posts;
  int rank = -1, nranks = 0;  // nranks: peer slots (an endpoint's grow, under mu)
  int64_t timeout_ms = 30000;
  transport::LinkConfig link_cfg;  // of every Link (an endpoint makes more)
  // Adopted peers whose Link is neither ready nor failed (PeerIo::handshaking):
  // raised by Engine::adopt_peer, lowered by the progress thread, read by an
  // endpoint's acceptor.
  std::atomic<int> handshaking{0};
  // Test and benchmark seams (test_hooks.h); null for a product communicator.
  std::shared_ptr<TestHooks> hooks;
  bool residuals_paused() const { return hooks && hooks->pause_residuals.load(); }

  // ---- shared with API threads (mu) ----
  std::mutex mu;
  // The progress thread sleeps in poll(2) on this eventfd and the Links'
  // completion-queue fds (wait_for_work); posts, codec results, cancels,
  // abort and stop write to it (kick).
  int wake_fd = -1;
  void kick() const {
    const uint64_t one = 1;
    if (wake_fd >= 0) (void)!write(wake_fd, &one, sizeof(one));
  }
  std::deque<std::shared_ptr<Request>> submitted;
  std::vector<uint32_t> next_send_seq, next_recv_seq;  // by order: [0, kIdSeqBase)
  std::vector<uint32_t> next_id_seq;                   // sends by id: [kIdSeqBase, kRdvSeq)
  // Sends by id, per peer: the seqs whose DESC or STATUS receive expired.
  // The peer's answer may still come and would stay unmatched in the
  // provider, where it would fail the request that next takes the seq, so
  // no later send takes it (a bit per seq, made at the first expiry).
  std::vector<std::vector<bool>> seq_expired;
  std::vector<int> inflight_send, inflight_recv;
  // Peers of an endpoint (Engine::reserve_peer/adopt_peer/drop_peer): the
  // state of each slot, why it was dropped, whether it is over shm; and what
  // the progress thread has to take up.
  enum PeerState : uint8_t { kPeerReserved, kPeerLive, kPeerGone };
  std::vector<uint8_t> peer_state, peer_shm;
  std::vector<std::string> peer_gone_why;
  std::vector<std::pair<int, std::unique_ptr<transport::Link>>> adopt_queue;
  struct Drop {
    int peer;
    kvxfer_result_t code;
    std::string why;
    bool fail_requests = true;  // false: close_peer (the requests were failed before)
    bool close_link = true;     // false: drop_peer with the Link kept open
  };
  std::vector<Drop> drop_queue;
  Engine::PeerFailed peer_failed;  // set before the first adopt
  /** Sizes the per-peer state of API threads to n slots (under mu, or before the threads). */
  void grow_api(int n);
  // match_by_id: the ids in flight per peer (an entry from its first
  // request by id until the peer is released), for the duplicate check, and
  // those of sends to KVXFER_ANY_PEER no peer has taken yet.
  std::unordered_map<int, std::unordered_set<uint64_t>> ids_send, ids_recv;
  std::unordered_set<uint64_t> ids_any;
  // Ids of sends to KVXFER_ANY_PEER that failed (cancelled, claim timeout)
  // before any peer took them, kept for the timeout (at most max_requests,
  // the oldest goes): a peer that asks for one is answered with a WITHDRAW
  // (answer_ask), so its receive fails at once.  A new send of the id drops
  // it; so does, for PeerIo::withdrew, a new send of the id to any peer.
  std::unordered_map<uint64_t, PeerIo::Refusal> any_withdrawn;
  /** Answers `peer`'s ask number `n` of `id` with a WITHDRAW of seq kRdvSeq
   *  (protocol.h). */
  void answer_ask(int peer, uint64_t id, uint32_t n, const PeerIo::Refusal& why);
  /** answer_ask for the ask of `id` that `peer` sent and this side kept
   *  (PeerIo::asks), which it drops; nothing if none is kept. */
  void answer_kept_ask(int peer, uint64_t id, const PeerIo::Refusal& why);
  /** Under mu: counts `r` against `peer` (KVXFER_MAX_REQUESTS, shm's
   *  limit, the ids in flight) and gives it its seq.  KVXFER_ERR_INVALID_USAGE
   *  or INVALID_ARGUMENT (a bad or gone peer) with nothing changed. */
  kvxfer_result_t take_peer_slot_locked(Request& r, int peer);
  uint64_t next_order = 0;
  bool abort_requested = false, stop_requested = false;
  std::string abort_why;
  bool aborted_flag = false;       // set by abort(); later posts fail
  std::atomic<int> finalising{0};  // requests final to the user, control messages pending
  std::shared_ptr<CancelInbox> inbox = std::make_shared<CancelInbox>();
  std::shared_ptr<StagingCache> staging;  // astore/rstore of every request
  Clock::time_point last_trim;

  // ---- codec thread (cmu) ----
  std::mutex cmu;
  std::condition_variable cwake;
  std::array<std::deque<Job>, 4> jobs;  // by JobKind priority
  std::deque<JobDone> jobs_done;
  bool codec_stop = false;
  std::vector<std::thread> codec_threads;

  // ---- progress thread only ----
  std::thread progress_thread;
  // The progress thread's state of each peer (PeerIo), one slot per peer
  // index; an endpoint frees a peer's once it is released (release_drained),
  // so a slot it ever had costs a null pointer.
  std::vector<std::unique_ptr<PeerIo>> pio;
  PeerIo& io(int p) { return *pio[static_cast<size_t>(p)]; }
  /** Sizes the progress thread's per-peer state to n slots (progress thread). */
  void grow_progress(int n);
  int npeers() const { return static_cast<int>(pio.size()); }
  /** Adopts and drops what API threads queued (progress thread). */
  void take_peer_changes(std::vector<std::pair<int, std::unique_ptr<transport::Link>>>& adopts,
                         std::vector<Drop>& drops);
  /** Frees the Links of dropped peers once nothing of theirs is in flight. */
  void release_drained();
  std::vector<std::shared_ptr<Request>> active;
  std::deque<std::shared_ptr<Request>> residual_fifo;
  size_t staging_budget = 0, staging_used = 0;
  // Receives whose anchor store does not fit KVXFER_RECV_ANCHOR_BYTES yet, in
  // post order; their DESC is held back, so their senders send nothing.
  std::deque<std::shared_ptr<Request>> recv_gate;
  size_t gate_budget = 0, gate_used = 0;
  // Sends holding staging: one may take it before its receiver's go.
  int sends_staged = 0;
  bool links_aborted = false;
  int64_t max_requests = 1024;
  int32_t default_page_tokens = 256;

  // ------------------------------------------------------------------------
  void progress_main();
  void codec_main();
  void run_job(Job& j);  // one codec job; its JobDone goes to jobs_done
  bool step();           // one round of progress; true if anything happened
  void wait_for_work(int idle, Clock::time_point idle_since);
  std::vector<pollfd> wait_fds;

  void start(const std::shared_ptr<Request>& r);
  bool post_link_send(const std::shared_ptr<Request>& r, TrafficClass c, OpKind k, MsgKind mk,
                      size_t page, const void* buf, size_t len);
  bool post_link_recv(const std::shared_ptr<Request>& r, TrafficClass c, OpKind k, MsgKind mk,
                      size_t page, void* buf, size_t cap);
  void on_completion(int peer, const Completion& c);
  void on_job_done(JobDone& d);
  void on_handshake(const std::shared_ptr<Request>& r);
  /** This side's DESC, once (a receiver's when admitted, or when it fails). */
  bool send_desc(const std::shared_ptr<Request>& r);
  /** Receiver: its anchor store, anchor receives and DESC, the sender's go. */
  void admit_recv(const std::shared_ptr<Request>& r);
  /** Admits the receives of recv_gate that fit now, in order. */
  void admit_gated();
  /** Gives a receive's anchor-store bytes back to the gate. */
  void ungate_bytes(Work& w);
  /** Sender, matched: its staging window and residual store. */
  bool alloc_send(const std::shared_ptr<Request>& r);
  void unstage_send(Work& w);
  void sender_pump(const std::shared_ptr<Request>& r);
  void flush_residuals(int peer);
  void post_residual_recvs();
  void enqueue_residuals(const std::shared_ptr<Request>& r);
  void queue_job(Job&& j);
  void queue_full(const std::shared_ptr<Request>& r, size_t page);
  size_t window_bytes = 4 << 20;  // KVXFER_STAGING_WINDOW_BYTES
  /** A request's `astore`: `window` (sender) a few slots, tracked in free_slots; else one per page.
   */
  bool make_window(const std::shared_ptr<Request>& r, bool window);
  void release_slot(Work& w, size_t page);
  void queue_encodes(const std::shared_ptr<Request>& r);  // sender: as slots and layers allow
  // stream_layers sends waiting too long for a layer fail; the earliest
  // deadline of the others goes to layer_deadline, which wait_for_work keeps.
  void check_layer_timeouts();
  Clock::time_point layer_deadline = Clock::time_point::max();
  void pump_encodes(int peer);
  void post_anchor_recvs(
      const std::shared_ptr<Request>& r);  // receiver: every page, at the handshake
  std::vector<std::pair<std::shared_ptr<Request>, size_t>> held_full;  // residuals not yet applied
  void refuse_rdv(int peer, uint32_t seq, kvxfer_result_t code, const std::string& text,
                  bool empty_desc = true);
  /** A Link post of `tag` for `r` (null: the engine's own), recorded as
   *  (k, page) and counted in r's ops; the op id in *op.  The Link's error
   *  if it refused it (nothing recorded). */
  kvxfer_result_t post_raw(int peer, TrafficClass c, uint64_t tag, bool is_send, const void* buf,
                           size_t len, const std::shared_ptr<Request>& r, OpKind k, size_t page,
                           uint64_t* op = nullptr, bool standing = false);
  /** post_raw for request `r`, which fails (fail()) if the Link refuses it. */
  bool post_for(const std::shared_ptr<Request>& r, TrafficClass c, uint64_t tag, bool is_send,
                const void* buf, size_t len, OpKind k, size_t page);
  void bind_or_wait(const std::shared_ptr<Request>& r);  // a new receive by id
  void arm_rdv(int peer);
  void withdraw(const std::shared_ptr<Request>& r);
  // Adds `id` to rdv_refused, withdrew or any_withdrawn, which keep at most
  // max_requests ids each (the oldest goes): a runtime cancelling requests
  // by new ids faster than the timeout retires them cannot grow them.
  void remember(std::unordered_map<uint64_t, PeerIo::Refusal>& ids, uint64_t id,
                PeerIo::Refusal why);
  void on_withdraw(int peer, uint64_t id, uint32_t seq, kvxfer_result_t why, uint16_t ask);
  void on_rdv(int peer, const Completion& c);
  bool post_rdv_send(const std::shared_ptr<Request>& r);
  // Sends to KVXFER_ANY_PEER (kvxfer.h) waiting for a peer's ASK, in post
  // order (progress thread); claims_dirty: an ask, a waiting send or a free
  // slot came since try_claims last looked.
  std::vector<std::shared_ptr<Request>> unclaimed;
  bool claims_dirty = false;
  int64_t last_claim_sweep = 0;
  void arm_streams();  // every peer's ask and rendezvous streams
  void on_ask(int peer, const Completion& c);
  bool send_ask(const std::shared_ptr<Request>& r);  // a receive by id asks its peer
  void try_claims();                                 // match waiting sends and asks
  bool claim(const std::shared_ptr<Request>& r, int peer);
  void sweep_claims();            // timeouts of both
  int64_t anchors_unapplied = 0;  // receiver: anchors of handshaken requests not yet decoded
  void fail(const std::shared_ptr<Request>& r, kvxfer_result_t code, const std::string& text);
  /** A by-id send its receiver refused with kStatusNoDesc (`why`): its DESC
   *  receive, which no message will end, is cancelled, so the request ends
   *  and its id and slot are free at once, busy link or idle. */
  void end_desc_recv(const std::shared_ptr<Request>& r, const std::string& why);
  void take_cancels();
  void send_status(const std::shared_ptr<Request>& r, kvxfer_result_t code,
                   const std::string& text);
  void maybe_complete(const std::shared_ptr<Request>& r);
  void publish(const std::shared_ptr<Request>& r, kvxfer_stage_t stage);
  void settle(const std::shared_ptr<Request>& r);  // publish ERROR / finalise when possible
  void release_stores(Work& w);
  void drop_stores(Work& w);
  void publish_handshake(const std::shared_ptr<Request>& r);
  void finalise(const std::shared_ptr<Request>& r);
};

}  // namespace kvxfer::xfer
