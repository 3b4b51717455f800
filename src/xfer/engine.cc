// The engine behind kvxfer_send / kvxfer_recv (engine.h, protocol.h).
#include "xfer/engine.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstring>
#include <deque>
#include <thread>
#include <unordered_map>

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
#include "xfer/staging.h"

namespace kvxfer::xfer {

using transport::Clock;
using transport::Completion;
using transport::Link;
using transport::TrafficClass;

namespace {

std::atomic<int> g_corrupt_sections{0};
std::atomic<bool> g_pause_residuals{false};

const char* kind_name(kvxfer_kv_kind_t k) { return k == KVXFER_KV_KEY ? "K" : "V"; }

}  // namespace

void testing_corrupt_next_sections(int count) { g_corrupt_sections.store(count); }
void testing_pause_residuals(bool paused) { g_pause_residuals.store(paused); }

/**
 * Codec worker threads of an engine: KVXFER_CODEC_THREADS when set, else
 * half the usable CPUs (the progress thread, the provider and, on loopback,
 * the peer need the rest), between 1 and 8.  Each encodes or decodes whole
 * pages on one thread: OpenMP inside a 512 KiB page cost more than it gave
 * on a small machine (docs/PERFORMANCE.md, "Where the engine's time goes").
 */
int codec_workers() {
  const int64_t p = params::CodecThreads();
  if (p > 0) return static_cast<int>(std::min<int64_t>(p, 64));
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  return std::max(1, std::min(8, cpus / 2));
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------
// The progress thread's private state of a request.
// ---------------------------------------------------------------------------
struct PageState {
  size_t a_off = 0, a_cap = 0;  // slot in `astore` (monolithic: both sections)
  size_t r_off = 0, r_cap = 0;  // sender: slot in `rstore`; receiver: staging capacity
  size_t a_len = 0, r_len = 0;  // section bytes (sender: encoded; receiver: received)
  bool encoded = false;         // sender
  bool anchor_applied = false;  // receiver
  bool residual_arrived = false;
  std::unique_ptr<uint8_t[]> staging;  // receiver: the residual section
};

struct Work {
  std::vector<PageRef> pages;
  std::vector<PageState> ps;
  Staging astore, rstore;  // from the engine's StagingCache
  // Device requests: astore/rstore page-locked (xfer/device.h, pin); released
  // before the stores (declared after them, reset first in finalise).
  std::shared_ptr<void> apin, rpin;
  kvxfer_codec_config_t codec{};  // sender's codec (receiver: from the handshake)
  kvxfer_mode_t mode = KVXFER_MODE_AUTO;
  int32_t page_tokens = 0;

  bool started = false;
  bool handshake_done = false, handshake_ok = false;
  std::vector<uint8_t> desc_out, desc_in, status_out, status_in;
  size_t next_page_send = 0;      // sender: pages posted to the Link
  size_t next_residual_post = 0;  // receiver: residual receives posted
  int64_t sends_done = 0, anchor_sends_done = 0;
  bool peer_status = false, peer_status_ok = false;
  bool status_sent = false;
  bool in_residual_fifo = false;
  bool peer_gave_up = false;  // receiver: an empty page message arrived

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

Request::Request() : work(new Work) {}
Request::~Request() = default;

// ---------------------------------------------------------------------------
// Public state queries (any thread).
// ---------------------------------------------------------------------------
namespace {

kvxfer_stage_t stage_of(const Request& r, int32_t layer) {
  if (r.stage == KVXFER_STAGE_ERROR || layer < 0) return r.stage;
  if (r.stage == KVXFER_STAGE_COMPLETE) return KVXFER_STAGE_COMPLETE;
  const size_t l = static_cast<size_t>(layer);
  if (l >= r.layer_pages.size()) return r.stage;  // before the handshake: pages unknown
  if (!r.is_send && r.layer_complete[l] == r.layer_pages[l] && r.t_handshake != 0)
    return KVXFER_STAGE_COMPLETE;
  if (r.stage == KVXFER_STAGE_ANCHOR_READY) return KVXFER_STAGE_ANCHOR_READY;
  if (!r.is_send && r.layer_anchor[l] == r.layer_pages[l] && r.t_handshake != 0)
    return KVXFER_STAGE_ANCHOR_READY;
  return KVXFER_STAGE_POSTED;
}

kvxfer_result_t check_layer(const Request& r, int32_t layer) {
  if (layer < -1 || layer >= r.mine.num_layers)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "layer %d outside [0, %d)", layer,
                     r.mine.num_layers);
  return KVXFER_SUCCESS;
}

kvxfer_result_t report(const Request& r, kvxfer_stage_t s) {
  if (s == KVXFER_STAGE_ERROR) return set_error(r.result, "%s", r.error.c_str());
  return s == KVXFER_STAGE_COMPLETE ? KVXFER_SUCCESS : KVXFER_IN_PROGRESS;
}

}  // namespace

kvxfer_result_t request_test(const Request& r, int32_t layer, kvxfer_stage_t* stage) {
  KVXFER_CHECK(check_layer(r, layer));
  std::lock_guard<std::mutex> lk(r.mu);
  const kvxfer_stage_t s = stage_of(r, layer);
  if (stage != nullptr) *stage = s;
  return report(r, s);
}

kvxfer_result_t request_wait(Request& r, int32_t layer, kvxfer_stage_t stage, int timeout_ms) {
  KVXFER_CHECK(check_layer(r, layer));
  KVXFER_REQUIRE(stage == KVXFER_STAGE_ANCHOR_READY || stage == KVXFER_STAGE_COMPLETE,
                 "kvxfer_wait: stage must be ANCHOR_READY or COMPLETE, not %d",
                 static_cast<int>(stage));
  std::unique_lock<std::mutex> lk(r.mu);
  auto reached = [&] {
    const kvxfer_stage_t s = stage_of(r, layer);
    return s == KVXFER_STAGE_ERROR || s >= stage;
  };
  if (timeout_ms < 0) {
    r.cv.wait(lk, reached);
  } else if (!r.cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), reached)) {
    return KVXFER_IN_PROGRESS;
  }
  const kvxfer_stage_t s = stage_of(r, layer);
  if (s == KVXFER_STAGE_ERROR) return set_error(r.result, "%s", r.error.c_str());
  return KVXFER_SUCCESS;
}

kvxfer_result_t request_info(const Request& r, kvxfer_request_info_t* info) {
  KVXFER_REQUIRE(info != nullptr, "info is NULL");
  KVXFER_REQUIRE(info->size == sizeof(kvxfer_request_info_t) && info->magic == KVXFER_CONFIG_MAGIC,
                 "kvxfer_request_info_t not initialised (size %zu, magic 0x%x): use "
                 "KVXFER_REQUEST_INFO_INITIALIZER",
                 info->size, info->magic);
  std::lock_guard<std::mutex> lk(r.mu);
  info->stage = r.stage;
  info->result = r.result;
  info->is_send = r.is_send ? 1 : 0;
  info->peer = r.peer;
  info->codec = r.codec;
  info->mode = r.mode;
  info->num_pages = r.num_pages;
  info->pages_anchor_ready = r.pages_anchor;
  info->pages_complete = r.pages_complete;
  info->kv_bytes = r.kv_bytes;
  info->anchor_wire_bytes = r.anchor_wire_bytes;
  info->residual_wire_bytes = r.residual_wire_bytes;
  info->t_posted_ns = r.t_posted;
  info->t_handshake_ns = r.t_handshake;
  info->t_anchor_ready_ns = r.t_anchor_ready;
  info->t_complete_ns = r.t_complete;
  info->t_error_ns = r.t_error;
  info->t_first_residual_ns = r.t_first_residual;
  return KVXFER_SUCCESS;
}

kvxfer_result_t request_cancel(const std::shared_ptr<Request>& r) {
  {
    std::lock_guard<std::mutex> lk(r->mu);
    if (r->stage == KVXFER_STAGE_COMPLETE || r->stage == KVXFER_STAGE_ERROR || r->cancel_requested)
      return KVXFER_SUCCESS;
    r->cancel_requested = true;
  }
  CancelInbox& in = *r->inbox;
  std::lock_guard<std::mutex> lk(in.mu);
  if (in.closed) return KVXFER_SUCCESS;  // the communicator is gone: the request is in ERROR
  in.requests.push_back(r);
  in.pending.store(true);
  const uint64_t one = 1;
  if (in.wake_fd >= 0) (void)!write(in.wake_fd, &one, sizeof(one));  // wake the progress thread
  return KVXFER_SUCCESS;
}

kvxfer_result_t request_tiers(const Request& r, uint8_t* tiers, int64_t num_tokens) {
  std::lock_guard<std::mutex> lk(r.mu);
  KVXFER_REQUIRE(tiers != nullptr || num_tokens == 0, "tiers is NULL");
  KVXFER_REQUIRE(num_tokens == r.mine.num_tokens,
                 "num_tokens %" PRId64 " is not the request's %" PRId64, num_tokens,
                 r.mine.num_tokens);
  if (!r.is_send && r.stage == KVXFER_STAGE_ERROR)
    return set_error(KVXFER_ERR_INVALID_USAGE, "the request failed: %s", r.error.c_str());
  if (!r.is_send && r.stage != KVXFER_STAGE_ANCHOR_READY && r.stage != KVXFER_STAGE_COMPLETE)
    return set_error(KVXFER_ERR_INVALID_USAGE,
                     "the tiers are known once the request is ANCHOR_READY (it is not yet)");
  if (r.codec != KVXFER_CODEC_SPECTRUM)
    return set_error(KVXFER_ERR_INVALID_USAGE,
                     "the request's codec is not SPECTRUM: every token has the codec's precision");
  if (num_tokens > 0) std::memcpy(tiers, r.tiers.data(), static_cast<size_t>(num_tokens));
  return KVXFER_SUCCESS;
}

bool request_wait_final_callbacks(Request& r) {
  std::unique_lock<std::mutex> lk(r.mu);
  if (r.stage != KVXFER_STAGE_COMPLETE && r.stage != KVXFER_STAGE_ERROR) return false;
  r.cv.wait(lk, [&] { return !r.callback_running; });
  return true;
}

// ---------------------------------------------------------------------------
// The engine.
// ---------------------------------------------------------------------------
namespace {

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
};

struct JobDone {
  std::shared_ptr<Request> req;
  JobKind kind;
  size_t page;
  kvxfer_result_t rc;
  std::string error;
  size_t a_len = 0, r_len = 0;
  bool skipped = false;
};

enum class OpKind { kDescSend, kDescRecv, kStatusSend, kStatusRecv, kAnchor, kResidual };

struct OpRef {
  std::shared_ptr<Request> req;
  OpKind kind;
  size_t page;
  bool is_send;
};

/** The layout of page `ref` in one side's blocks. */
kvxfer_page_layout_t page_layout(const Request& r, const PageRef& ref) {
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
kvxfer_page_layout_t codec_layout(const Request& r, const PageRef& ref) {
  kvxfer_page_layout_t l = page_layout(r, ref);
  if (r.device >= 0) {
    const auto* table = static_cast<void* const*>(
        (ref.kind == KVXFER_KV_KEY ? r.dev_k_blocks : r.dev_v_blocks).get());
    l.blocks = table + static_cast<size_t>(ref.layer) * static_cast<size_t>(r.num_blocks);
  }
  return l;
}

/** Page-locks a staging store of a device request (a failure only costs speed). */
std::shared_ptr<void> pin_store(const Request& r, uint8_t* p, size_t len) {
  std::shared_ptr<void> h;
  if (r.device < 0 || p == nullptr) return h;
  if (xfer::device_codec()->pin(p, len, &h) < 0)
    KVXFER_WARN(LOG_NET,
                "could not page-lock %zu bytes of staging (%s); copying through pageable memory",
                len, last_error());
  return h;
}

kvxfer_page_id_t page_id(const Request& r, const PageRef& ref) {
  kvxfer_page_id_t id{};
  id.layer = static_cast<uint32_t>(ref.layer);
  id.kind = ref.kind;
  id.token_begin = ref.token_begin;
  id.stream_id = r.mine.tag;
  return id;
}

std::string page_name(const PageRef& p) {
  return strprintf("page of layer %d %s, tokens [%" PRId64 ", %" PRId64 ")", p.layer,
                   kind_name(p.kind), p.token_begin, p.token_begin + p.num_tokens);
}

}  // namespace

struct Engine::Impl {
  std::unique_ptr<transport::Communicator> comm;
  int rank = -1, nranks = 0;
  int64_t timeout_ms = 30000;

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
  std::vector<uint32_t> next_send_seq, next_recv_seq;
  std::vector<int> inflight_send, inflight_recv;
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
  std::mutex device_mu;  // device codec calls, one at a time

  // ---- progress thread only ----
  std::thread progress_thread;
  std::vector<std::unordered_map<uint64_t, OpRef>> ops;  // per peer: Link op id -> what
  std::vector<std::shared_ptr<Request>> active;
  std::deque<std::shared_ptr<Request>> residual_fifo;
  size_t staging_budget = 0, staging_used = 0;
  bool links_aborted = false;
  int64_t max_requests = 1024;
  int32_t default_page_tokens = 256;

  // ------------------------------------------------------------------------
  void progress_main();
  void codec_main();
  bool step();  // one round of progress; true if anything happened
  void wait_for_work(int idle);
  std::vector<pollfd> wait_fds;

  void start(const std::shared_ptr<Request>& r);
  bool post_link_send(const std::shared_ptr<Request>& r, TrafficClass c, OpKind k, MsgKind mk,
                      size_t page, const void* buf, size_t len);
  bool post_link_recv(const std::shared_ptr<Request>& r, TrafficClass c, OpKind k, MsgKind mk,
                      size_t page, void* buf, size_t cap);
  void on_completion(int peer, const Completion& c);
  void on_job_done(JobDone& d);
  void on_handshake(const std::shared_ptr<Request>& r);
  void sender_pump(const std::shared_ptr<Request>& r);
  void flush_residuals(int peer);
  std::vector<int64_t> anchors_unposted;  // per peer: anchors of handshaken sends not yet posted
  std::vector<std::deque<std::pair<std::shared_ptr<Request>, size_t>>> held_residuals;  // per peer
  void post_residual_recvs();
  void enqueue_residuals(const std::shared_ptr<Request>& r);
  void queue_job(Job&& j);
  void queue_full(const std::shared_ptr<Request>& r, size_t page);
  std::vector<std::pair<std::shared_ptr<Request>, size_t>> held_full;  // residuals not yet applied
  int64_t anchors_unapplied = 0;  // receiver: anchors of handshaken requests not yet decoded
  void fail(const std::shared_ptr<Request>& r, kvxfer_result_t code, const std::string& text);
  void take_cancels();
  void send_status(const std::shared_ptr<Request>& r, kvxfer_result_t code,
                   const std::string& text);
  void maybe_complete(const std::shared_ptr<Request>& r);
  void publish(const std::shared_ptr<Request>& r, kvxfer_stage_t stage);
  void settle(const std::shared_ptr<Request>& r);  // publish ERROR / finalise when possible
  void finalise(const std::shared_ptr<Request>& r);
};

// ---------------------------------------------------------------------------
// Creation and teardown
// ---------------------------------------------------------------------------
kvxfer_result_t Engine::create(const transport::UniqueId& id,
                               std::unique_ptr<transport::BootstrapRoot> root, int rank, int nranks,
                               int timeout_ms, const std::string& bind, const char* rate_limit,
                               std::unique_ptr<Engine>* out) {
  transport::LinkConfig lc;
  KVXFER_CHECK(transport::LinkConfig::from_params(&lc));
  lc.node = bind;
  if (rate_limit != nullptr) {
    double bps = 0;
    std::string why;
    KVXFER_REQUIRE(params::parse_rate(rate_limit, &bps, &why), "rate_limit '%s' %s", rate_limit,
                   why.c_str());
    lc.limiter = bps > 0 ? std::make_shared<transport::RateLimiter>(
                               bps, static_cast<uint64_t>(params::NetChunkBytes()))
                         : nullptr;
  }
  lc.timeout_ms = timeout_ms;
  std::unique_ptr<Engine> e(new Engine);
  e->impl_.reset(new Impl);
  Impl& m = *e->impl_;
  KVXFER_CHECK(
      transport::Communicator::create(id, root.get(), rank, nranks, lc, timeout_ms, &m.comm));
  m.rank = rank;
  m.nranks = nranks;
  m.timeout_ms = timeout_ms;
  m.next_send_seq.assign(nranks, 0);
  m.next_recv_seq.assign(nranks, 0);
  m.inflight_send.assign(nranks, 0);
  m.inflight_recv.assign(nranks, 0);
  m.ops.resize(nranks);
  m.anchors_unposted.assign(nranks, 0);
  m.held_residuals.resize(nranks);
  m.staging_budget = static_cast<size_t>(params::RecvStagingBytes());
  m.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (m.wake_fd < 0) return set_error(KVXFER_ERR_SYSTEM, "eventfd: %s", std::strerror(errno));
  m.inbox->wake_fd = m.wake_fd;
  m.staging = StagingCache::create(static_cast<size_t>(params::StagingCacheBytes()), 1000);
  m.max_requests = params::MaxRequests();
  m.default_page_tokens = static_cast<int32_t>(params::PageTokens());
  const int workers = codec_workers();
  for (int i = 0; i < workers; ++i) m.codec_threads.emplace_back([&m] { m.codec_main(); });
  m.progress_thread = std::thread([&m] { m.progress_main(); });
  KVXFER_INFO(LOG_INIT, "communicator rank %d of %d ready (provider %s, %d codec thread%s)", rank,
              nranks, m.comm->link(rank == 0 ? 1 : 0)->provider().c_str(), workers,
              workers == 1 ? "" : "s");
  *out = std::move(e);
  return KVXFER_SUCCESS;
}

Engine::~Engine() {
  if (!impl_) return;
  // Let requests that already reached their final stage finish their last
  // control messages (the STATUS the peer waits for), for a bounded time;
  // then abort whatever is still in flight.
  const auto grace =
      Clock::now() + std::chrono::milliseconds(std::min<int64_t>(impl_->timeout_ms, 1000));
  while (impl_->finalising.load() > 0 && Clock::now() < grace)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  abort("communicator destroyed");
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->stop_requested = true;
  }
  impl_->kick();
  if (impl_->progress_thread.joinable()) impl_->progress_thread.join();
  {
    std::lock_guard<std::mutex> lk(impl_->cmu);
    impl_->codec_stop = true;
  }
  impl_->cwake.notify_all();
  for (std::thread& t : impl_->codec_threads)
    if (t.joinable()) t.join();
  {
    std::lock_guard<std::mutex> lk(impl_->inbox->mu);
    impl_->inbox->closed = true;
    impl_->inbox->requests.clear();
    impl_->inbox->wake_fd = -1;
  }
  if (impl_->wake_fd >= 0) close(impl_->wake_fd);
  impl_->wake_fd = -1;
  impl_->comm.reset();
}

int Engine::rank() const { return impl_->rank; }
int Engine::nranks() const { return impl_->nranks; }

void Engine::abort(const char* why) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (impl_->abort_requested) return;
    impl_->abort_requested = true;
    impl_->aborted_flag = true;
    impl_->abort_why = why;
  }
  impl_->kick();
}

// ---------------------------------------------------------------------------
// Posting (API threads)
// ---------------------------------------------------------------------------

/**
 * SpectrumKV: the tier of every token, chosen once per request by the policy
 * (include/kvxfer/spectrum.h) from the runtime's importance or, without it,
 * from the KV norm over every layer's K and V (docs/SPECTRUMKV.md).
 */
kvxfer_result_t spectrum_tiers(Request& r, const kvxfer_kv_desc_t* kv, const SpectrumArgs* sa) {
  if (kv->device >= 0)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "codec SPECTRUM has no GPU encoder: the KV must be in host memory");
  kvxfer_spectrum_config_t policy = KVXFER_SPECTRUM_CONFIG_INITIALIZER;
  if (sa != nullptr && sa->policy != nullptr) policy = *sa->policy;
  const int64_t n = kv->num_tokens;
  r.tiers.assign(static_cast<size_t>(n), KVXFER_TIER_FP16);
  if (n == 0) return KVXFER_SUCCESS;
  const bool needs_importance =
      policy.variant == KVXFER_SPECTRUM_GREEDY || policy.variant == KVXFER_SPECTRUM_BALANCED;
  std::vector<float> norm;
  const float* importance = sa != nullptr ? sa->importance : nullptr;
  if (importance == nullptr && needs_importance) {
    std::vector<kvxfer_page_layout_t> pages;
    for (int32_t l = 0; l < kv->num_layers; ++l)
      for (kvxfer_kv_kind_t k : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
        pages.push_back(page_layout(r, {l, k, 0, n}));
    norm.resize(static_cast<size_t>(n));
    const kvxfer_result_t rc = kvxfer_spectrum_importance_from_kv(
        pages.data(), static_cast<int32_t>(pages.size()), policy.lambda, norm.data());
    if (rc < 0) return set_error(rc, "SpectrumKV importance from the KV norm: %s", last_error());
    importance = norm.data();
  }
  const kvxfer_result_t rc = kvxfer_spectrum_assign(&policy, n, importance, r.tiers.data());
  if (rc < 0) return set_error(rc, "SpectrumKV policy: %s", last_error());
  return KVXFER_SUCCESS;
}

kvxfer_result_t Engine::post(bool is_send, int peer, const kvxfer_kv_desc_t* kv,
                             const kvxfer_codec_config_t* codec, const kvxfer_request_config_t* cfg,
                             void* handle, std::shared_ptr<Request>* out,
                             const SpectrumArgs* spectrum) {
  Impl& m = *impl_;
  KVXFER_REQUIRE(peer >= 0 && peer < m.nranks && peer != m.rank,
                 "peer %d is not another rank of this %d-rank communicator (this is rank %d)", peer,
                 m.nranks, m.rank);
  codec::KvDesc shape;
  KVXFER_CHECK(codec::validate_kv_desc(
      kv, is_send ? codec::KvAccess::kRead : codec::KvAccess::kWrite, "", &shape));
  xfer::DeviceCodec* dev = nullptr;
  if (kv->device >= 0) {
    dev = xfer::device_codec();
    if (dev == nullptr)
      return set_error(KVXFER_ERR_UNSUPPORTED,
                       "the KV is on CUDA device %d, but this build of kvxfer has no CUDA "
                       "support (docs/GPU.md)",
                       kv->device);
    KVXFER_CHECK(dev->check_device(kv->device));
  }

  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  if (cfg != nullptr) {
    KVXFER_REQUIRE(
        cfg->size == sizeof(kvxfer_request_config_t) && cfg->magic == KVXFER_CONFIG_MAGIC,
        "request config not initialised (size %zu, magic 0x%x): use "
        "KVXFER_REQUEST_CONFIG_INITIALIZER",
        cfg->size, cfg->magic);
    KVXFER_REQUIRE(cfg->version / 100 == KVXFER_VERSION_CODE / 100,
                   "request config version %u is from another kvxfer.h (this library is %d; the "
                   "major and minor version must match): use KVXFER_REQUEST_CONFIG_INITIALIZER",
                   cfg->version, KVXFER_VERSION_CODE);
    rc = *cfg;
  }
  KVXFER_REQUIRE(rc.mode == KVXFER_MODE_AUTO || rc.mode == KVXFER_MODE_PROGRESSIVE ||
                     rc.mode == KVXFER_MODE_MONOLITHIC,
                 "mode %d is not AUTO, PROGRESSIVE or MONOLITHIC", static_cast<int>(rc.mode));
  KVXFER_REQUIRE(rc.page_tokens >= 0, "page_tokens %d is negative", rc.page_tokens);

  auto r = std::make_shared<Request>();
  r->is_send = is_send;
  r->peer = peer;
  r->cfg = rc;
  r->handle = handle;
  r->mine.is_sender = is_send;
  r->mine.tag = rc.tag;
  r->mine.num_layers = kv->num_layers;
  r->mine.kv_heads = kv->kv_heads;
  r->mine.head_dim = kv->head_dim;
  r->mine.dtype = kv->dtype;
  r->mine.num_tokens = kv->num_tokens;
  r->mine.on_device = kv->device >= 0;
  r->block_size = kv->block_size;
  r->row_stride = shape.row_stride;
  r->num_blocks = shape.blocks_used;  // the tables hold only the blocks tokens live in
  r->kv_bytes = shape.kv_bytes;
  r->k_blocks = std::move(shape.k_blocks);
  r->v_blocks = std::move(shape.v_blocks);
  if (dev != nullptr && kv->num_tokens > 0) {
    const size_t n = r->k_blocks.size();
    KVXFER_CHECK(dev->upload_table(kv->device, r->k_blocks.data(), n, &r->dev_k_blocks));
    KVXFER_CHECK(dev->upload_table(kv->device, r->v_blocks.data(), n, &r->dev_v_blocks));
  }
  r->device = kv->device;
  if (!is_send) r->tiers.assign(static_cast<size_t>(kv->num_tokens), KVXFER_TIER_FP16);

  if (is_send) {
    kvxfer_codec_config_t cc = KVXFER_CODEC_CONFIG_INITIALIZER;
    if (codec != nullptr) cc = *codec;
    kvxfer_codec_config_t check = cc;
    if (check.alpha == KVXFER_ALPHA_AUTO) check.alpha = 0.0f;
    KVXFER_CHECK(codec::validate_config(&check));
    const kvxfer_mode_t mode = resolve_mode(rc.mode, cc);
    KVXFER_REQUIRE(!(mode == KVXFER_MODE_PROGRESSIVE && cc.codec == KVXFER_CODEC_BF16),
                   "BF16 passthrough has no residual: use MONOLITHIC or AUTO mode");
    if (cc.codec == KVXFER_CODEC_SPECTRUM) KVXFER_CHECK(spectrum_tiers(*r, kv, spectrum));
    if (kv->device >= 0 && cc.codec == KVXFER_CODEC_LYNX && cc.alpha == KVXFER_ALPHA_AUTO)
      return set_error(KVXFER_ERR_UNSUPPORTED,
                       "alpha=auto is not available for KV on a CUDA device: calibrate on a host "
                       "copy (kvxfer_codec_calibrate_alpha) and pass the chosen alpha");
    const int32_t pt = rc.page_tokens > 0 ? rc.page_tokens : m.default_page_tokens;
    const uint64_t per = static_cast<uint64_t>((kv->num_tokens + pt - 1) / pt);
    KVXFER_REQUIRE(static_cast<uint64_t>(kv->num_layers) * 2 * per <= kMaxPages,
                   "%" PRIu64 " pages exceed the protocol's 2^%d; raise page_tokens",
                   static_cast<uint64_t>(kv->num_layers) * 2 * per, kPageBits);
    r->mine.codec = cc;
    r->mine.mode = mode;
    r->mine.page_tokens = pt;
    r->codec = cc.codec;
    r->mode = mode;
  }
  r->t_posted = now_ns();
  r->inbox = m.inbox;

  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.aborted_flag)
      return set_error(KVXFER_ERR_INVALID_USAGE, "the communicator was aborted (%s)",
                       m.abort_why.c_str());
    int& inflight = is_send ? m.inflight_send[peer] : m.inflight_recv[peer];
    if (inflight >= m.max_requests)
      return set_error(KVXFER_ERR_INVALID_USAGE,
                       "%d kvxfer_%s requests already in flight with peer %d (KVXFER_MAX_REQUESTS)",
                       inflight, is_send ? "send" : "recv", peer);
    inflight++;
    uint32_t& seq = is_send ? m.next_send_seq[peer] : m.next_recv_seq[peer];
    r->seq = seq;
    seq = (seq + 1) & kSeqMask;
    r->order = m.next_order++;
    m.submitted.push_back(r);
  }
  m.kick();
  *out = std::move(r);
  return KVXFER_SUCCESS;
}

// ---------------------------------------------------------------------------
// Codec thread
// ---------------------------------------------------------------------------
void Engine::Impl::codec_main() {
  for (;;) {
    Job j;
    {
      std::unique_lock<std::mutex> lk(cmu);
      cwake.wait(lk, [&] {
        if (codec_stop) return true;
        for (auto& q : jobs)
          if (!q.empty()) return true;
        return false;
      });
      bool found = false;
      for (auto& q : jobs) {
        if (q.empty()) continue;
        j = std::move(q.front());
        q.pop_front();
        found = true;
        break;
      }
      if (!found) return;  // stop requested and nothing left
    }
    JobDone d;
    d.req = j.req;
    d.kind = j.kind;
    d.page = j.page;
    d.rc = KVXFER_SUCCESS;
    Request& r = *j.req;
    if (r.work->cancel.load()) {
      d.skipped = true;
    } else if (j.kind == JobKind::kEncode) {
      kvxfer_codec_config_t cc = j.codec;
      Work& w = *r.work;  // alpha fields: codec threads, under alpha_mu
      if (cc.alpha == KVXFER_ALPHA_AUTO) {
        std::lock_guard<std::mutex> alk(w.alpha_mu);  // the first encode calibrates, once
        if (!w.alpha_resolved) {
          // Calibrate on up to 16 pages spread over the request.
          std::vector<kvxfer_page_layout_t> sample;
          const size_t n = static_cast<size_t>(r.num_pages);
          const size_t step = std::max<size_t>(1, n / 16);
          const auto pages = plan_pages(r.mine.num_layers, r.mine.num_tokens, r.mine.page_tokens);
          for (size_t i = 0; i < pages.size(); i += step)
            sample.push_back(page_layout(r, pages[i]));
          kvxfer_codec_config_t c0 = cc;
          c0.alpha = 0.0f;
          float a = 0.0f;
          d.rc =
              codec::calibrate_alpha(&c0, sample.data(), static_cast<int32_t>(sample.size()), &a);
          if (d.rc < 0) d.error = strprintf("alpha calibration failed: %s", last_error());
          w.alpha = a;
          w.alpha_resolved = true;
        }
        cc.alpha = w.alpha;
      }
      if (d.rc == KVXFER_SUCCESS) {
        const kvxfer_page_layout_t src = codec_layout(r, j.ref);
        const kvxfer_page_id_t id = page_id(r, j.ref);
        if (r.device >= 0) {
          std::lock_guard<std::mutex> lk(device_mu);
          d.rc = xfer::device_codec()->encode(r.device, &cc, &id, &src, j.a, j.a_cap, &d.a_len, j.r,
                                              j.r_cap, &d.r_len);
        } else if (cc.codec == KVXFER_CODEC_SPECTRUM) {
          d.rc = codec::encode_page_tiered(&cc, &id, &src,
                                           r.tiers.data() + static_cast<size_t>(j.ref.token_begin),
                                           j.a, j.a_cap, &d.a_len, j.r, j.r_cap, &d.r_len, 1);
        } else {
          d.rc = codec::encode_page(&cc, &id, &src, j.a, j.a_cap, &d.a_len, j.r, j.r_cap, &d.r_len,
                                    codec::Impl::AUTO, 1);
        }
        if (d.rc < 0) {
          d.error = strprintf("encoding the %s failed: %s", page_name(j.ref).c_str(), last_error());
        } else if (j.monolithic && d.r_len > 0) {
          std::memmove(j.a + d.a_len, j.r, d.r_len);  // one message: anchor then residual
        }
      }
    } else {
      const kvxfer_page_layout_t dst = codec_layout(r, j.ref);
      const kvxfer_page_id_t id = page_id(r, j.ref);
      const uint8_t* a = j.a;
      size_t a_len = j.a_len;
      const uint8_t* res = nullptr;
      size_t r_len = 0;
      if (j.kind == JobKind::kDecodeMono) {
        // Both sections back to back: the first one's header gives its
        // length; decode_page validates both in full.
        const size_t first = codec::section_extent(j.a, j.a_len);
        if (first > 0) {
          a_len = first;
          res = j.a + first;
          r_len = j.a_len - first;
        }
      } else if (j.kind == JobKind::kDecodeFull) {
        res = j.r;
        r_len = j.r_len;
      }
      if (d.rc == KVXFER_SUCCESS && r.device >= 0) {
        std::lock_guard<std::mutex> lk(device_mu);
        d.rc = xfer::device_codec()->decode(r.device, a, a_len, res, r_len, &id, &dst);
      } else if (d.rc == KVXFER_SUCCESS) {
        d.rc = codec::decode_page(a, a_len, res, r_len, &id, &dst, codec::Impl::AUTO, 1);
      }
      // SpectrumKV: the tiers of the request's tokens, from the layer-0 K
      // pages' precision maps (the same for every layer, K and V).
      if (d.rc == KVXFER_SUCCESS && j.kind != JobKind::kDecodeFull && j.ref.layer == 0 &&
          j.ref.kind == KVXFER_KV_KEY && r.work->codec.codec == KVXFER_CODEC_SPECTRUM)
        d.rc = codec::get_page_tiers(
            a, a_len, r.tiers.data() + static_cast<size_t>(j.ref.token_begin), j.ref.num_tokens);
      if (d.rc < 0)
        d.error = strprintf("the %s failed to decode: %s", page_name(j.ref).c_str(), last_error());
    }
    {
      std::lock_guard<std::mutex> lk(cmu);
      jobs_done.push_back(std::move(d));
    }
    kick();
  }
}

void Engine::Impl::queue_full(const std::shared_ptr<Request>& r, size_t page) {
  // Strict priority on the receiver: no residual is applied while an anchor
  // of any request is still expected (issue 4, "Concurrency").
  if (g_pause_residuals.load() || anchors_unapplied > 0) {
    held_full.emplace_back(r, page);
    return;
  }
  {
    // Stamped here, where anchors_unapplied == 0 is checked, on the thread
    // that also stamps handshakes: every request handshaken before this
    // instant is at ANCHOR_READY by it.
    std::lock_guard<std::mutex> lk(r->mu);
    if (r->t_first_residual == 0) r->t_first_residual = now_ns();
  }
  Work& w = *r->work;
  PageState& p = w.ps[page];
  Job j;
  j.req = r;
  j.kind = JobKind::kDecodeFull;
  j.page = page;
  j.ref = w.pages[page];
  j.a = w.astore.get() + p.a_off;
  j.a_len = p.a_len;
  j.r = p.staging.get();
  j.r_len = p.r_len;
  queue_job(std::move(j));
}

void Engine::Impl::queue_job(Job&& j) {
  j.req->work->jobs++;
  {
    std::lock_guard<std::mutex> lk(cmu);
    jobs[static_cast<int>(j.kind)].push_back(std::move(j));
  }
  cwake.notify_one();
}

// ---------------------------------------------------------------------------
// Progress thread
// ---------------------------------------------------------------------------
void Engine::Impl::progress_main() {
  int idle = 0;
  Clock::time_point stop_deadline = Clock::time_point::max();
  for (;;) {
    const bool busy = step();
    bool stop;
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = stop_requested && links_aborted && active.empty() && submitted.empty();
      if (stop_requested && links_aborted && stop_deadline == Clock::time_point::max())
        stop_deadline = Clock::now() + std::chrono::seconds(10);
    }
    if (stop) return;
    if (Clock::now() > stop_deadline) {
      // Every Link is closed, so nothing can complete any more; a request
      // still here is a bug.  Never hang the caller's destroy on it.
      KVXFER_WARN(LOG_NET, "destroy: %zu request(s) did not wind down; leaving them",
                  active.size());
      return;
    }
    if (busy) {
      idle = 0;
      continue;
    }
    wait_for_work(++idle);
  }
}

// Nothing moved in the last round.  A few rounds of yield first (a
// completion is often microseconds away), then sleep in poll(2) until a
// completion queue, a post, a codec result or a cancel wakes us, or the rate
// limiter's next token is due; at most 100 ms, so timeouts and liveness
// checks still run.  The thread never spins against the codec threads for a
// core.  A provider without CQ wait objects is polled: 100 us sleeps.
void Engine::Impl::wait_for_work(int idle) {
  if (idle < 8) {
    std::this_thread::yield();
    return;
  }
  Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(100);
  wait_fds.clear();
  wait_fds.push_back(pollfd{wake_fd, POLLIN, 0});
  bool can_sleep = true;
  for (int p = 0; p < nranks && can_sleep; ++p) {
    Link* l = comm->link(p);
    if (l == nullptr) continue;
    can_sleep = l->prepare_wait(&wait_fds);
    deadline = std::min(deadline, l->next_deadline());
  }
  if (!can_sleep) {
    if (idle < 64) {
      std::this_thread::yield();
    } else {
      deadline = std::min(deadline, Clock::now() + std::chrono::microseconds(100));
      std::this_thread::sleep_until(deadline);
    }
    return;
  }
  const auto wait = deadline - Clock::now();
  if (wait <= Clock::duration::zero()) return;
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wait).count();
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  if (ppoll(wait_fds.data(), wait_fds.size(), &ts, nullptr) > 0 &&
      (wait_fds[0].revents & POLLIN) != 0) {
    uint64_t n;
    (void)!read(wake_fd, &n, sizeof(n));
  }
}

bool Engine::Impl::step() {
  bool busy = false;
  std::deque<std::shared_ptr<Request>> fresh;
  bool do_abort = false;
  std::string why;
  {
    std::lock_guard<std::mutex> lk(mu);
    fresh.swap(submitted);
    if (abort_requested && !links_aborted) {
      do_abort = true;
      why = abort_why;
    }
  }
  for (auto& r : fresh) {
    active.push_back(r);
    start(r);
    busy = true;
  }
  if (inbox->pending.load()) {
    take_cancels();
    busy = true;
  }
  if (do_abort) {
    KVXFER_INFO(LOG_NET, "aborting communicator rank %d: %s", rank, why.c_str());
    comm->abort(why.c_str());
    links_aborted = true;
    const std::vector<std::shared_ptr<Request>> all = active;
    for (auto& r : all) fail(r, KVXFER_ERR_INVALID_USAGE, "communicator aborted (" + why + ")");
    busy = true;
  }

  // Network completions, peer by peer.
  std::vector<Completion> done;
  for (int p = 0; p < nranks; ++p) {
    Link* l = comm->link(p);
    if (l == nullptr) continue;
    done.clear();
    l->poll(&done);
    for (const Completion& c : done) on_completion(p, c);
    if (!done.empty()) busy = true;
  }

  // Codec results.
  std::deque<JobDone> results;
  {
    std::lock_guard<std::mutex> lk(cmu);
    results.swap(jobs_done);
  }
  for (auto& d : results) on_job_done(d);
  if (!results.empty()) busy = true;

  post_residual_recvs();
  const Clock::time_point now = Clock::now();
  if (now - last_trim >= std::chrono::milliseconds(100)) {
    last_trim = now;
    staging->trim(now);
  }
  if (!held_full.empty() && !g_pause_residuals.load() && anchors_unapplied == 0) {
    auto held = std::move(held_full);
    held_full.clear();
    for (auto& [r, page] : held)
      if (!r->work->failed) queue_full(r, page);  // a failed one's staging goes at finalise
    busy = true;
  }

  // Publish errors and release finished requests.
  // Backwards by index: settle may finalise (erase) the request it is given,
  // and this runs on every progress round, so no copy of `active`.
  for (size_t i = active.size(); i-- > 0;) {
    const std::shared_ptr<Request> r = active[i];  // outlives its erasure
    settle(r);
  }
  return busy;
}

bool Engine::Impl::post_link_send(const std::shared_ptr<Request>& r, TrafficClass c, OpKind k,
                                  MsgKind mk, size_t page, const void* buf, size_t len) {
  Link* l = comm->link(r->peer);
  uint64_t op = 0;
  const kvxfer_result_t rc =
      l->post_send(c, buf, len, make_tag(r->seq, !r->is_send, mk, page), &op);
  if (rc < 0) {
    fail(r, rc, strprintf("posting a send to peer %d failed: %s", r->peer, last_error()));
    return false;
  }
  ops[r->peer][op] = OpRef{r, k, page, true};
  r->work->ops++;
  return true;
}

bool Engine::Impl::post_link_recv(const std::shared_ptr<Request>& r, TrafficClass c, OpKind k,
                                  MsgKind mk, size_t page, void* buf, size_t cap) {
  Link* l = comm->link(r->peer);
  uint64_t op = 0;
  const kvxfer_result_t rc = l->post_recv(c, buf, cap, make_tag(r->seq, r->is_send, mk, page), &op);
  if (rc < 0) {
    fail(r, rc, strprintf("posting a receive from peer %d failed: %s", r->peer, last_error()));
    return false;
  }
  ops[r->peer][op] = OpRef{r, k, page, false};
  r->work->ops++;
  return true;
}

void Engine::Impl::start(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  w.started = true;
  if (links_aborted) {
    fail(r, KVXFER_ERR_INVALID_USAGE, "communicator aborted");
    return;
  }
  if (r->is_send) {
    w.codec = r->mine.codec;
    w.mode = r->mine.mode;
    w.page_tokens = r->mine.page_tokens;
    w.pages = plan_pages(r->mine.num_layers, r->mine.num_tokens, w.page_tokens);
    w.ps.resize(w.pages.size());
    kvxfer_codec_config_t sz = w.codec;
    if (sz.alpha == KVXFER_ALPHA_AUTO) sz.alpha = 0.0f;
    const int32_t H = r->mine.kv_heads * r->mine.head_dim;
    size_t atot = 0, rtot = 0;
    for (size_t i = 0; i < w.pages.size(); ++i) {
      size_t a = 0, b = 0;
      const kvxfer_result_t rc = codec::max_sizes(&sz, w.pages[i].num_tokens, H, &a, &b);
      if (rc < 0) {
        fail(r, rc, last_error());
        return;
      }
      PageState& p = w.ps[i];
      if (w.mode == KVXFER_MODE_MONOLITHIC) {
        p.a_off = atot;
        p.a_cap = a + b;
        atot += a + b;
        p.r_cap = b;  // the encoder writes the residual after the anchor's capacity
      } else {
        p.a_off = atot;
        p.a_cap = a;
        p.r_off = rtot;
        p.r_cap = b;
        atot += a;
        rtot += b;
      }
    }
    if (!staging->get(atot, &w.astore) ||
        (w.mode == KVXFER_MODE_PROGRESSIVE && !staging->get(rtot, &w.rstore))) {
      fail(r, KVXFER_ERR_OUT_OF_MEMORY,
           strprintf("no memory for %zu bytes of encoded sections", atot + rtot));
      return;
    }
    w.apin = pin_store(*r, w.astore.get(), atot);
    if (w.rstore) w.rpin = pin_store(*r, w.rstore.get(), rtot);
    {
      std::lock_guard<std::mutex> lk(r->mu);
      r->num_pages = static_cast<int64_t>(w.pages.size());
    }
  }
  w.desc_out = encode_desc(r->mine);
  w.desc_in.assign(kDescBytes, 0);
  w.status_in.assign(kStatusHeaderBytes + kMaxStatusText, 0);
  if (!post_link_send(r, TrafficClass::kAnchor, OpKind::kDescSend, MsgKind::kDesc, 0,
                      w.desc_out.data(), w.desc_out.size()) ||
      !post_link_recv(r, TrafficClass::kAnchor, OpKind::kDescRecv, MsgKind::kDesc, 0,
                      w.desc_in.data(), w.desc_in.size()) ||
      !post_link_recv(r, TrafficClass::kAnchor, OpKind::kStatusRecv, MsgKind::kStatus, 0,
                      w.status_in.data(), w.status_in.size()))
    return;
  if (r->is_send) {
    // Encode at once, overlapping the handshake; pages go out as they are ready.
    for (size_t i = 0; i < w.pages.size(); ++i) {
      PageState& p = w.ps[i];
      Job j;
      j.req = r;
      j.kind = JobKind::kEncode;
      j.page = i;
      j.codec = w.codec;
      j.ref = w.pages[i];
      j.monolithic = w.mode == KVXFER_MODE_MONOLITHIC;
      j.a = w.astore.get() + p.a_off;
      if (j.monolithic) {
        j.a_cap = p.a_cap - p.r_cap;
        j.r = j.a + j.a_cap;
        j.r_cap = p.r_cap;
      } else {
        j.a_cap = p.a_cap;
        j.r = w.rstore.get() + p.r_off;
        j.r_cap = p.r_cap;
      }
      queue_job(std::move(j));
    }
  }
}

void Engine::Impl::on_handshake(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  w.handshake_done = true;
  Desc peer;
  kvxfer_result_t rc = decode_desc(w.desc_in.data(), w.desc_in.size(), &peer);
  if (rc == KVXFER_SUCCESS) rc = compare_desc(r->mine, peer);
  if (rc < 0) {
    fail(r, rc, strprintf("%s (peer %d)", last_error(), r->peer));
    return;
  }
  w.handshake_ok = true;
  const int32_t L = r->mine.num_layers;
  if (!r->is_send) {
    w.codec = peer.codec;
    w.mode = peer.mode;
    w.page_tokens = peer.page_tokens;
    w.pages = plan_pages(L, r->mine.num_tokens, w.page_tokens);
    w.ps.resize(w.pages.size());
    kvxfer_codec_config_t sz = w.codec;
    if (sz.alpha == KVXFER_ALPHA_AUTO) sz.alpha = 0.0f;
    const int32_t H = r->mine.kv_heads * r->mine.head_dim;
    size_t atot = 0;
    for (size_t i = 0; i < w.pages.size(); ++i) {
      size_t a = 0, b = 0;
      rc = codec::max_sizes(&sz, w.pages[i].num_tokens, H, &a, &b);
      if (rc < 0) {
        fail(r, KVXFER_ERR_CORRUPT,
             strprintf("the sender's codec configuration is invalid: %s", last_error()));
        return;
      }
      PageState& p = w.ps[i];
      p.a_off = atot;
      p.a_cap = w.mode == KVXFER_MODE_MONOLITHIC ? a + b : a;
      p.r_cap = b;
      atot += p.a_cap;
    }
    if (!w.failed && !staging->get(atot, &w.astore))
      fail(r, KVXFER_ERR_OUT_OF_MEMORY,
           strprintf("no memory for %zu bytes of anchor sections", atot));
    if (!w.failed) w.apin = pin_store(*r, w.astore.get(), atot);
  }
  {
    std::lock_guard<std::mutex> lk(r->mu);
    r->t_handshake = now_ns();
    r->num_pages = static_cast<int64_t>(w.pages.size());
    r->codec = w.codec.codec;
    r->mode = w.mode;
    r->layer_pages.assign(static_cast<size_t>(L), 0);
    r->layer_anchor.assign(static_cast<size_t>(L), 0);
    r->layer_complete.assign(static_cast<size_t>(L), 0);
    for (const PageRef& p : w.pages) r->layer_pages[static_cast<size_t>(p.layer)]++;
  }
  if (r->is_send) {
    anchors_unposted[r->peer] += static_cast<int64_t>(w.pages.size());
    if (w.pages.empty()) publish(r, KVXFER_STAGE_ANCHOR_READY);
    sender_pump(r);
    maybe_complete(r);
    return;
  }
  // A request that failed before its handshake (cancelled, timed out)
  // drains the sender's page messages into zero-capacity receives: nothing
  // lands in the blocks and none of its anchors is awaited by the strict
  // anchor priority (anchors_unapplied).
  static uint8_t sink;
  for (size_t i = 0; i < w.pages.size(); ++i) {
    PageState& p = w.ps[i];
    if (!post_link_recv(r, TrafficClass::kAnchor, OpKind::kAnchor, MsgKind::kAnchor, i,
                        w.failed ? &sink : w.astore.get() + p.a_off, w.failed ? 0 : p.a_cap))
      return;
  }
  w.anchors_remaining = w.failed ? 0 : static_cast<int64_t>(w.pages.size());
  anchors_unapplied += w.anchors_remaining;
  if (w.mode == KVXFER_MODE_PROGRESSIVE && !w.pages.empty()) {
    w.in_residual_fifo = true;
    enqueue_residuals(r);
  }
  if (w.pages.empty()) {
    publish(r, KVXFER_STAGE_ANCHOR_READY);
    maybe_complete(r);
  }
}

void Engine::Impl::sender_pump(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  if (!w.handshake_ok) return;
  static const uint8_t kEmpty = 0;
  const bool progressive = w.mode == KVXFER_MODE_PROGRESSIVE;
  while (w.next_page_send < w.pages.size()) {
    const size_t i = w.next_page_send;
    PageState& p = w.ps[i];
    // A failed request keeps its message sequence whole (protocol.h): an
    // empty message for every section left.
    const bool empty = w.failed;
    if (!empty && !p.encoded) break;
    w.next_page_send++;
    anchors_unposted[r->peer]--;
    const size_t alen = empty ? 0 : progressive ? p.a_len : p.a_len + p.r_len;
    post_link_send(r, TrafficClass::kAnchor, OpKind::kAnchor, MsgKind::kAnchor, i,
                   empty ? &kEmpty : w.astore.get() + p.a_off, alen);
    if (!progressive) continue;
    if (empty) {
      post_link_send(r, TrafficClass::kResidual, OpKind::kResidual, MsgKind::kResidual, i, &kEmpty,
                     0);
    } else {
      w.held++;
      held_residuals[r->peer].emplace_back(r, i);
    }
  }
  flush_residuals(r->peer);
}

// Residuals to a peer go to the Link only once every anchor of every request
// to that peer has been posted: the Link's scheduler then sends anchor chunks
// first, and no residual can slip through while an anchor is still being
// encoded (figure 3 of the issue: with many requests in flight, every
// request's anchor lands before any residual).
void Engine::Impl::flush_residuals(int peer) {
  if (anchors_unposted[peer] > 0) return;
  static const uint8_t kEmpty = 0;
  auto& q = held_residuals[peer];
  // In request post order, pages ascending: the order the receiver posts its
  // residual receives in (enqueue_residuals), whatever order handshakes took.
  std::stable_sort(q.begin(), q.end(), [](const auto& a, const auto& b) {
    return a.first->order != b.first->order ? a.first->order < b.first->order : a.second < b.second;
  });
  while (!q.empty()) {
    auto [r, i] = std::move(q.front());
    q.pop_front();
    Work& w = *r->work;
    w.held--;
    const PageState& p = w.ps[i];
    if (w.failed)
      post_link_send(r, TrafficClass::kResidual, OpKind::kResidual, MsgKind::kResidual, i, &kEmpty,
                     0);
    else
      post_link_send(r, TrafficClass::kResidual, OpKind::kResidual, MsgKind::kResidual, i,
                     w.rstore.get() + p.r_off, p.r_len);
  }
}

// Residual receives are posted in the order the requests were posted, which
// is the order each peer sends them, whatever order the handshakes completed
// in: a receive posted ahead of the message the sender is on could hold the
// whole staging pool while that message waits (a stall seen with 4 requests
// of 8 MiB of residuals each against 16 MiB of staging).
void Engine::Impl::enqueue_residuals(const std::shared_ptr<Request>& r) {
  auto it = residual_fifo.end();
  while (it != residual_fifo.begin() && (*std::prev(it))->order > r->order) --it;
  residual_fifo.insert(it, r);
}

void Engine::Impl::post_residual_recvs() {
  while (!residual_fifo.empty()) {
    std::shared_ptr<Request> r = residual_fifo.front();
    Work& w = *r->work;
    while (w.next_residual_post < w.pages.size()) {
      const size_t i = w.next_residual_post;
      PageState& p = w.ps[i];
      if (w.failed) {
        // Drain: a zero-capacity receive consumes the message without staging.
        static uint8_t sink;
        if (!post_link_recv(r, TrafficClass::kResidual, OpKind::kResidual, MsgKind::kResidual, i,
                            &sink, 0))
          break;
      } else {
        if (staging_used > 0 && staging_used + p.r_cap > staging_budget) return;
        p.staging.reset(new uint8_t[std::max<size_t>(p.r_cap, 1)]);
        staging_used += p.r_cap;
        if (!post_link_recv(r, TrafficClass::kResidual, OpKind::kResidual, MsgKind::kResidual, i,
                            p.staging.get(), p.r_cap)) {
          staging_used -= p.r_cap;
          p.staging.reset();
          continue;  // the request failed: drain the rest
        }
      }
      w.next_residual_post++;
    }
    w.in_residual_fifo = false;
    residual_fifo.pop_front();
  }
}

void Engine::Impl::on_completion(int peer, const Completion& c) {
  auto it = ops[peer].find(c.op_id);
  if (it == ops[peer].end()) return;  // a Link-internal operation
  OpRef ref = std::move(it->second);
  ops[peer].erase(it);
  const std::shared_ptr<Request>& r = ref.req;
  Work& w = *r->work;
  w.ops--;
  const bool ok = c.status == KVXFER_SUCCESS;
  if (!ok && !w.handshake_done && c.status == KVXFER_ERR_TIMEOUT) {
    // Nothing came from the peer for this request: say so, whichever of its
    // receives timed out first.
    fail(r, c.status,
         strprintf("peer %d never posted the matching kvxfer_%s within %lld ms (%s)", r->peer,
                   r->is_send ? "recv" : "send", static_cast<long long>(timeout_ms),
                   c.error.c_str()));
  }
  const int64_t t =
      std::chrono::duration_cast<std::chrono::nanoseconds>(c.done.time_since_epoch()).count();
  switch (ref.kind) {
    case OpKind::kDescSend:
    case OpKind::kStatusSend:
      if (!ok) fail(r, c.status, strprintf("peer %d: %s", r->peer, c.error.c_str()));
      break;
    case OpKind::kDescRecv:
      if (!ok) {
        fail(r, c.status, strprintf("peer %d: %s", r->peer, c.error.c_str()));
      } else if (c.bytes != kDescBytes) {
        fail(r, KVXFER_ERR_CORRUPT,
             strprintf("peer %d sent a %zu-byte descriptor", r->peer, c.bytes));
      } else {
        on_handshake(r);
      }
      break;
    case OpKind::kStatusRecv: {
      w.peer_status = true;
      if (!ok) {
        fail(r, c.status, strprintf("peer %d: %s", r->peer, c.error.c_str()));
        break;
      }
      kvxfer_result_t pr = KVXFER_SUCCESS;
      std::string text;
      const kvxfer_result_t rc = decode_status(w.status_in.data(), c.bytes, &pr, &text);
      if (rc < 0) {
        fail(r, rc, strprintf("peer %d: %s", r->peer, last_error()));
      } else if (pr == KVXFER_ERR_CANCELLED) {
        fail(r, pr,
             strprintf("the peer cancelled the request: peer %d (%s): %s", r->peer,
                       r->is_send ? "receiver" : "sender", text.c_str()));
      } else if (pr != KVXFER_SUCCESS) {
        fail(r, pr,
             strprintf("peer %d (%s) failed: %s", r->peer, r->is_send ? "receiver" : "sender",
                       text.c_str()));
      } else {
        w.peer_status_ok = true;
        maybe_complete(r);
      }
      break;
    }
    case OpKind::kAnchor:
    case OpKind::kResidual: {
      const bool anchor = ref.kind == OpKind::kAnchor;
      PageState& p = w.ps[ref.page];
      if (!ok) {
        if (anchor || !w.failed)
          fail(r, c.status, strprintf("peer %d: %s", r->peer, c.error.c_str()));
        if (!anchor && p.staging) {
          staging_used -= p.r_cap;
          p.staging.reset();
        }
        break;
      }
      {
        std::lock_guard<std::mutex> lk(r->mu);
        r->arrivals.push_back({t, anchor ? 0 : 1, w.pages[ref.page].layer, c.bytes});
        if (!r->is_send) (anchor ? r->anchor_wire_bytes : r->residual_wire_bytes) += c.bytes;
      }
      if (r->is_send) {
        w.sends_done++;
        if (anchor) {
          w.anchor_sends_done++;
          if (!w.failed && w.anchor_sends_done == static_cast<int64_t>(w.pages.size()))
            publish(r, KVXFER_STAGE_ANCHOR_READY);
        }
        maybe_complete(r);
        break;
      }
      // Receiver.  An empty page message is the sender giving up (protocol.h):
      // its STATUS, already on the way, says why.
      if (c.bytes == 0 && !w.failed) w.peer_gave_up = true;
      if (w.failed || w.peer_gave_up) {
        if (!anchor && p.staging) {
          staging_used -= p.r_cap;
          p.staging.reset();
        }
        break;
      }
      uint8_t* section = anchor ? w.astore.get() + p.a_off : p.staging.get();
      if (c.bytes > 0 && g_corrupt_sections.load() > 0 && g_corrupt_sections.fetch_sub(1) > 0)
        section[c.bytes / 2] ^= 0x5a;  // test seam: the checksum must catch this
      if (anchor) {
        p.a_len = c.bytes;
        Job j;
        j.req = r;
        j.kind = w.mode == KVXFER_MODE_MONOLITHIC ? JobKind::kDecodeMono : JobKind::kDecodeAnchor;
        j.page = ref.page;
        j.ref = w.pages[ref.page];
        j.a = section;
        j.a_len = c.bytes;
        queue_job(std::move(j));
      } else {
        p.r_len = c.bytes;
        p.residual_arrived = true;
        if (p.anchor_applied) queue_full(r, ref.page);
      }
      break;
    }
  }
}

void Engine::Impl::on_job_done(JobDone& d) {
  const std::shared_ptr<Request>& r = d.req;
  Work& w = *r->work;
  w.jobs--;
  PageState& p = w.ps[d.page];
  if (d.kind == JobKind::kDecodeFull && p.staging) {
    staging_used -= p.r_cap;
    p.staging.reset();
  }
  if (d.skipped || w.failed) return;
  if (d.rc < 0) {
    fail(r, d.rc, d.error);
    return;
  }
  const size_t layer = static_cast<size_t>(w.pages[d.page].layer);
  switch (d.kind) {
    case JobKind::kEncode: {
      p.a_len = d.a_len;
      p.r_len = d.r_len;
      p.encoded = true;
      {
        std::lock_guard<std::mutex> lk(r->mu);
        if (w.mode == KVXFER_MODE_MONOLITHIC) {
          r->anchor_wire_bytes += d.a_len + d.r_len;
        } else {
          r->anchor_wire_bytes += d.a_len;
          r->residual_wire_bytes += d.r_len;
        }
      }
      sender_pump(r);
      break;
    }
    case JobKind::kDecodeAnchor: {
      p.anchor_applied = true;
      w.anchors_remaining--;
      anchors_unapplied--;
      bool all;
      {
        std::lock_guard<std::mutex> lk(r->mu);
        r->pages_anchor++;
        r->layer_anchor[layer]++;
        all = r->pages_anchor == r->num_pages;
      }
      r->cv.notify_all();
      if (all) publish(r, KVXFER_STAGE_ANCHOR_READY);
      if (p.residual_arrived) queue_full(r, d.page);
      break;
    }
    case JobKind::kDecodeMono:
    case JobKind::kDecodeFull: {
      const bool mono = d.kind == JobKind::kDecodeMono;
      bool all_anchor = false;
      {
        std::lock_guard<std::mutex> lk(r->mu);
        if (mono) {
          w.anchors_remaining--;
          anchors_unapplied--;
          r->pages_anchor++;
          r->layer_anchor[layer]++;
          all_anchor = r->pages_anchor == r->num_pages;
        }
        r->pages_complete++;
        r->layer_complete[layer]++;
      }
      r->cv.notify_all();
      if (all_anchor) publish(r, KVXFER_STAGE_ANCHOR_READY);
      maybe_complete(r);
      break;
    }
  }
}

void Engine::Impl::maybe_complete(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  if (w.failed || !w.handshake_ok || w.final_published) return;
  const int64_t n = static_cast<int64_t>(w.pages.size());
  if (r->is_send) {
    const int64_t msgs = w.mode == KVXFER_MODE_PROGRESSIVE ? 2 * n : n;
    if (w.sends_done < msgs || !w.peer_status_ok) return;
    // STATUS first: the on_complete callback (run by publish) may abort the
    // communicator, and the peer waits for this message.
    send_status(r, KVXFER_SUCCESS, "");
    publish(r, KVXFER_STAGE_COMPLETE);
  } else {
    int64_t complete;
    {
      std::lock_guard<std::mutex> lk(r->mu);
      complete = r->pages_complete;
    }
    if (complete < n) return;
    // STATUS first: the on_complete callback (run by publish) may abort the
    // communicator, and the peer waits for this message.
    send_status(r, KVXFER_SUCCESS, "");
    publish(r, KVXFER_STAGE_COMPLETE);
  }
}

void Engine::Impl::send_status(const std::shared_ptr<Request>& r, kvxfer_result_t code,
                               const std::string& text) {
  Work& w = *r->work;
  if (w.status_sent || links_aborted) return;
  w.status_sent = true;
  w.status_out = encode_status(code, text);
  if (post_link_send(r, TrafficClass::kAnchor, OpKind::kStatusSend, MsgKind::kStatus, 0,
                     w.status_out.data(), w.status_out.size()))
    comm->link(r->peer)->progress();  // hand it to the provider now: an abort may follow
}

void Engine::Impl::fail(const std::shared_ptr<Request>& r, kvxfer_result_t code,
                        const std::string& text) {
  Work& w = *r->work;
  if (w.failed || w.final_published) return;
  w.failed = true;
  w.fail_code = code < 0 ? code : KVXFER_ERR_INTERNAL;
  w.fail_text = text;
  w.cancel.store(true);
  anchors_unapplied -= w.anchors_remaining;  // its anchors are no longer awaited
  w.anchors_remaining = 0;
  KVXFER_INFO(LOG_NET, "kvxfer_%s #%u with peer %d failed: %s", r->is_send ? "send" : "recv",
              r->seq, r->peer, text.c_str());
  send_status(r, w.fail_code, text);
  // Keep the message sequence whole (protocol.h): the sender sends what is
  // left as empty messages, the receiver drains its residual receives.  Page
  // messages already given to the Link but not started go out empty too, so
  // the peer hears of the failure after one message, not after the KV.
  if (r->is_send) {
    Link* l = comm->link(r->peer);
    if (l != nullptr)
      for (const auto& [op, ref] : ops[r->peer])
        if (ref.req == r && (ref.kind == OpKind::kAnchor || ref.kind == OpKind::kResidual))
          l->empty_unstarted_send(op);
    sender_pump(r);
  }
  if (!r->is_send && w.handshake_ok && !w.in_residual_fifo && w.mode == KVXFER_MODE_PROGRESSIVE &&
      w.next_residual_post < w.pages.size()) {
    w.in_residual_fifo = true;
    enqueue_residuals(r);
  }
}

// kvxfer_request_cancel: the request fails like any other (fail), so every
// stage is covered by the same path: the peer learns it from the STATUS, the
// message sequence is kept whole (unsent pages go out empty, residuals are
// drained), and its memory goes at finalise.
void Engine::Impl::take_cancels() {
  std::vector<std::shared_ptr<Request>> got;
  {
    std::lock_guard<std::mutex> lk(inbox->mu);
    got.swap(inbox->requests);
    inbox->pending.store(false);
  }
  std::vector<std::shared_ptr<Request>> later;
  for (auto& r : got) {
    if (!r->work->started) {  // posted, not yet taken from `submitted`: next round
      later.push_back(r);
      continue;
    }
    fail(r, KVXFER_ERR_CANCELLED,
         strprintf("the kvxfer_%s was cancelled on rank %d (kvxfer_request_cancel)",
                   r->is_send ? "send" : "recv", rank));
  }
  if (!later.empty()) {
    std::lock_guard<std::mutex> lk(inbox->mu);
    inbox->requests.insert(inbox->requests.end(), later.begin(), later.end());
    inbox->pending.store(true);
  }
}

void Engine::Impl::publish(const std::shared_ptr<Request>& r, kvxfer_stage_t stage) {
  Work& w = *r->work;
  kvxfer_callback_t cb = nullptr;
  kvxfer_result_t result;
  {
    std::lock_guard<std::mutex> lk(r->mu);
    if (r->stage == KVXFER_STAGE_ERROR || r->stage == KVXFER_STAGE_COMPLETE) return;
    if (stage != KVXFER_STAGE_ERROR && stage <= r->stage) return;
    const int64_t t = now_ns();
    switch (stage) {
      case KVXFER_STAGE_ANCHOR_READY: r->t_anchor_ready = t; break;
      case KVXFER_STAGE_COMPLETE:
        if (r->t_anchor_ready == 0) r->t_anchor_ready = t;
        r->t_complete = t;
        break;
      case KVXFER_STAGE_ERROR:
        r->t_error = t;
        r->error = w.fail_text;
        break;
      default: break;
    }
    if (stage == KVXFER_STAGE_ERROR || stage == KVXFER_STAGE_COMPLETE) finalising.fetch_add(1);
    r->stage = stage;
    r->result = stage == KVXFER_STAGE_ERROR      ? w.fail_code
                : stage == KVXFER_STAGE_COMPLETE ? KVXFER_SUCCESS
                                                 : KVXFER_IN_PROGRESS;
    result = r->result;
    cb = stage == KVXFER_STAGE_ANCHOR_READY ? r->cfg.on_anchor_ready : r->cfg.on_complete;
    if (cb != nullptr) r->callback_running = true;
  }
  if (stage == KVXFER_STAGE_ERROR || stage == KVXFER_STAGE_COMPLETE) {
    w.final_published = true;  // `finalising` counted it above, before any waiter could see it
  }
  r->cv.notify_all();
  if (cb != nullptr) {
    cb(static_cast<kvxfer_request_t>(r->handle), stage, result, r->cfg.user_data);
    {
      std::lock_guard<std::mutex> lk(r->mu);
      r->callback_running = false;
    }
    r->cv.notify_all();
  }
}

void Engine::Impl::settle(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  // An error becomes visible only once no codec job can touch the caller's
  // blocks any more: after it, the caller may free them.
  if (w.failed && !w.final_published && w.jobs == 0) publish(r, KVXFER_STAGE_ERROR);
  if (!w.final_published || w.jobs > 0 || w.ops > 0 || w.held > 0 || w.in_residual_fifo) return;
  if (!w.failed && !w.status_sent) return;
  finalise(r);
}

void Engine::Impl::finalise(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  w.apin.reset();
  w.rpin.reset();
  w.astore.reset();
  w.rstore.reset();
  for (PageState& p : w.ps)
    if (p.staging) {
      staging_used -= p.r_cap;
      p.staging.reset();
    }
  w.ps.clear();
  w.ps.shrink_to_fit();
  w.finalised = true;
  finalising.fetch_sub(1);
  {
    std::lock_guard<std::mutex> lk(mu);  // it counted against KVXFER_MAX_REQUESTS until now
    (r->is_send ? inflight_send : inflight_recv)[r->peer]--;
  }
  active.erase(std::remove(active.begin(), active.end(), r), active.end());
}

}  // namespace kvxfer::xfer
