// The engine behind kvxfer_send / kvxfer_recv (engine.h, protocol.h): creation
// and teardown, posting, and the public state queries.  The codec threads are
// in engine_codec.cc, the progress thread in engine_progress.cc,
// engine_peers.cc and engine_request.cc (engine_impl.h).
#include "xfer/engine.h"

#include <map>
#include <string>

#include "codec/page_codec.h"
#include "common/struct_abi.h"
#include "tiers/spectrum_impl.h"
#include "xfer/engine_impl.h"

namespace kvxfer::xfer {

/**
 * Codec worker threads of an engine: KVXFER_CODEC_THREADS when set, else
 * half the usable CPUs (the progress thread, the provider and, on loopback,
 * the peer need the rest), between 1 and 8.  Each encodes or decodes whole
 * pages on one thread: OpenMP inside a 512 KiB page cost more than it gave
 * on a small machine (docs/PERFORMANCE.md, "Where the engine's time goes").
 * TestHooks::codec_workers, when positive, overrides both.
 */
int codec_workers(const TestHooks* hooks) {
  if (hooks != nullptr && hooks->codec_workers > 0) return hooks->codec_workers;
  const int64_t p = params::CodecThreads();
  if (p > 0) return static_cast<int>(p);  // at most 64 (params.def)
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  return std::max(1, std::min(8, cpus / 2));
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

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

kvxfer_result_t request_wait(Request& r, int32_t layer, int32_t want, int timeout_ms) {
  KVXFER_CHECK(check_layer(r, layer));
  KVXFER_REQUIRE(want == KVXFER_STAGE_ANCHOR_READY || want == KVXFER_STAGE_COMPLETE,
                 "kvxfer_wait: stage must be ANCHOR_READY or COMPLETE, not %d", want);
  std::unique_lock<std::mutex> lk(r.mu);
  auto reached = [&] {
    const kvxfer_stage_t s = stage_of(r, layer);
    return s == KVXFER_STAGE_ERROR || s >= want;
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
  KVXFER_CHECK(check_struct_in_place(info));
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

kvxfer_result_t request_layer_ready(Request& r, int32_t layer) {
  {
    std::lock_guard<std::mutex> lk(r.mu);
    KVXFER_REQUIRE(layer >= 0 && layer < r.mine.num_layers,
                   "layer %d is outside [0, %d), the request's layers", layer, r.mine.num_layers);
    if (!r.is_send || r.cfg.stream_layers == 0)
      return set_error(KVXFER_ERR_INVALID_USAGE,
                       "kvxfer_send_layer_ready is for a send posted with stream_layers = 1");
    if (r.layer_marked[static_cast<size_t>(layer)] != 0) return KVXFER_SUCCESS;
    r.layer_marked[static_cast<size_t>(layer)] = 1;
    int32_t ready = r.layers_ready.load();
    while (ready < r.mine.num_layers && r.layer_marked[static_cast<size_t>(ready)] != 0) ++ready;
    r.layers_ready.store(ready);
    r.t_layer_mark.store(now_ns());
  }
  CancelInbox& in = *r.inbox;
  std::lock_guard<std::mutex> lk(in.mu);
  in.layers_marked.store(true);
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
  if (!codec::page_codec(r.codec)->token_tiers())
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
// Creation and teardown
// ---------------------------------------------------------------------------
namespace {

/** The Links' configuration: the KVXFER_* parameters, `bind`, and the rate limit. */
kvxfer_result_t make_link_config(int timeout_ms, const std::string& bind, const char* rate_limit,
                                 transport::LinkConfig* lc) {
  KVXFER_CHECK(transport::LinkConfig::from_params(lc));
  lc->node = bind;
  if (rate_limit != nullptr) {
    double bps = 0;
    std::string why;
    KVXFER_REQUIRE(params::parse_rate(rate_limit, &bps, &why), "rate_limit '%s' %s", rate_limit,
                   why.c_str());
    lc->limiter = bps > 0 ? std::make_shared<transport::RateLimiter>(
                                bps, transport::RateLimiter::burst_for(
                                         bps, static_cast<uint64_t>(params::NetChunkBytes())))
                          : nullptr;
  }
  lc->timeout_ms = timeout_ms;
  return KVXFER_SUCCESS;
}

}  // namespace

kvxfer_result_t Engine::create(const transport::UniqueId& id,
                               std::unique_ptr<transport::BootstrapRoot> root, int rank, int nranks,
                               int timeout_ms, const std::string& bind, const char* rate_limit,
                               std::unique_ptr<Engine>* out, std::shared_ptr<TestHooks> hooks) {
  transport::LinkConfig lc;
  // A failure here still tells the other ranks (fail fast, comm.h).
  const kvxfer_result_t prep = make_link_config(timeout_ms, bind, rate_limit, &lc);
  if (prep != KVXFER_SUCCESS)
    return transport::Communicator::report_failure(id, root.get(), rank, nranks, timeout_ms, prep);
  std::unique_ptr<Engine> e(new Engine);
  e->impl_.reset(new Impl);
  Impl& m = *e->impl_;
  if (hooks) lc.corrupt_headers = hooks->corrupt_wire_headers;
  KVXFER_CHECK(
      transport::Communicator::create(id, root.get(), rank, nranks, lc, timeout_ms, &m.comm));
  m.link_cfg = lc;
  init_state(&m, rank, nranks, timeout_ms, std::move(hooks));
  for (int p = 0; p < nranks; ++p) {
    const transport::Link* l = m.comm->link(p);
    m.peer_shm[p] = l != nullptr && l->provider() == transport::kShmProvider;
  }
  KVXFER_CHECK(start_threads(&m));
  // Each peer's path: "provider shm", or with several "providers shm x3, tcp;ofi_rxm x1".
  std::map<std::string, int> paths;
  for (int p = 0; p < nranks; ++p)
    if (const transport::Link* l = m.comm->link(p)) ++paths[l->provider()];
  std::string path_text = paths.size() == 1 ? "provider " + paths.begin()->first : "providers";
  if (paths.size() > 1)
    for (const auto& [prov, n] : paths)
      path_text += strprintf("%s %s x%d", path_text == "providers" ? "" : ",", prov.c_str(), n);
  KVXFER_INFO(LOG_INIT, "communicator rank %d of %d ready (%s, %zu codec thread%s)", rank, nranks,
              path_text.c_str(), m.codec_threads.size(), m.codec_threads.size() == 1 ? "" : "s");
  *out = std::move(e);
  return KVXFER_SUCCESS;
}

kvxfer_result_t Engine::create_open(int timeout_ms, const std::string& bind, const char* rate_limit,
                                    std::unique_ptr<Engine>* out,
                                    std::shared_ptr<TestHooks> hooks) {
  transport::LinkConfig lc;
  KVXFER_CHECK(make_link_config(timeout_ms, bind, rate_limit, &lc));
  std::unique_ptr<Engine> e(new Engine);
  e->impl_.reset(new Impl);
  Impl& m = *e->impl_;
  m.comm = transport::Communicator::create_open();
  if (hooks) lc.corrupt_headers = hooks->corrupt_wire_headers;
  m.link_cfg = lc;
  init_state(&m, -1, 0, timeout_ms, std::move(hooks));
  KVXFER_CHECK(start_threads(&m));
  *out = std::move(e);
  return KVXFER_SUCCESS;
}

kvxfer_result_t Engine::start_threads(Impl* mp) {
  Impl& m = *mp;
  m.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (m.wake_fd < 0) return set_error(KVXFER_ERR_SYSTEM, "eventfd: %s", std::strerror(errno));
  m.inbox->wake_fd = m.wake_fd;
  const int workers = codec_workers(m.hooks.get());
  for (int i = 0; i < workers; ++i) m.codec_threads.emplace_back([&m] { m.codec_main(); });
  m.progress_thread = std::thread([&m] { m.progress_main(); });
  return KVXFER_SUCCESS;
}

const transport::LinkConfig& Engine::link_config() const { return impl_->link_cfg; }

int Engine::reserve_peer() {
  std::lock_guard<std::mutex> lk(impl_->mu);
  const int p = impl_->nranks;
  impl_->grow_api(p + 1);
  return p;
}

void Engine::adopt_peer(int peer, std::unique_ptr<transport::Link> link) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (peer < 0 || peer >= impl_->nranks || impl_->peer_state[peer] != Impl::kPeerReserved) return;
    impl_->peer_state[peer] = Impl::kPeerLive;
    impl_->peer_shm[peer] = link->provider() == transport::kShmProvider;
    // Counted now, not at the progress thread's next round, so that an
    // endpoint's next accept sees it (handshaking_peers).  Nothing moves
    // the Link until that round: take_peer_changes finds the same state.
    if (!link->ready() && !link->failed()) impl_->handshaking++;
    impl_->adopt_queue.emplace_back(peer, std::move(link));
  }
  impl_->kick();
}

void Engine::drop_peer(int peer, kvxfer_result_t code, const std::string& why, bool close_link) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (peer < 0 || peer >= impl_->nranks || impl_->peer_state[peer] == Impl::kPeerGone) return;
    impl_->peer_state[peer] = Impl::kPeerGone;
    impl_->peer_gone_why[peer] = why;
    impl_->drop_queue.push_back({peer, code, why, true, close_link});
  }
  impl_->kick();
}

void Engine::close_peer(int peer) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    if (peer < 0 || peer >= impl_->nranks || impl_->peer_state[peer] != Impl::kPeerGone) return;
    impl_->drop_queue.push_back({peer, KVXFER_SUCCESS, impl_->peer_gone_why[peer], false, true});
  }
  impl_->kick();
}

int Engine::handshaking_peers() const { return impl_->handshaking.load(); }

int Engine::max_handshaking_peers() const {
  return impl_->hooks && impl_->hooks->max_handshaking > 0 ? impl_->hooks->max_handshaking
                                                           : kMaxHandshakingPeers;
}

void Engine::set_peer_failed(PeerFailed f) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->peer_failed = std::move(f);
}

std::unique_ptr<Engine> Engine::testing_unlinked(int rank, int nranks) {
  std::unique_ptr<Engine> e(new Engine);
  e->impl_.reset(new Impl);
  init_state(e->impl_.get(), rank, nranks, 0, nullptr);  // timeout 0: the destructor does not wait
  return e;
}

void Engine::Impl::grow_api(int n) {
  if (n <= nranks && !next_send_seq.empty()) return;
  const size_t u = static_cast<size_t>(n);
  next_send_seq.resize(u, 0);
  next_recv_seq.resize(u, 0);
  next_id_seq.resize(u, kIdSeqBase);
  seq_expired.resize(u);
  inflight_send.resize(u, 0);
  inflight_recv.resize(u, 0);
  peer_state.resize(u, kPeerReserved);
  peer_shm.resize(u, 0);
  peer_gone_why.resize(u);
  nranks = std::max(nranks, n);
}

void Engine::Impl::grow_progress(int n) {
  while (npeers() < n) pio.push_back(std::make_unique<PeerIo>());
}

void Engine::init_state(Impl* mp, int rank, int nranks, int timeout_ms,
                        std::shared_ptr<TestHooks> hooks) {
  Impl& m = *mp;
  m.hooks = std::move(hooks);
  const size_t window = m.hooks ? m.hooks->staging_window : 0;
  const int64_t keep_ms = m.hooks ? m.hooks->staging_keep_ms : 0;
  m.rank = rank;
  m.timeout_ms = timeout_ms;
  m.grow_api(nranks);
  m.grow_progress(nranks);
  std::fill(m.peer_state.begin(), m.peer_state.end(), Impl::kPeerLive);  // a fixed communicator
  m.staging_budget = static_cast<size_t>(params::RecvStagingBytes());
  const size_t gate = m.hooks ? m.hooks->recv_anchor_bytes : 0;
  m.gate_budget = gate > 0 ? gate : static_cast<size_t>(params::RecvAnchorBytes());
  m.window_bytes = window > 0 ? window : static_cast<size_t>(params::StagingWindowBytes());
  m.staging = StagingCache::create(static_cast<size_t>(params::StagingCacheBytes()),
                                   keep_ms > 0 ? keep_ms : 1000);
  m.max_requests = params::MaxRequests();
  m.default_page_tokens = static_cast<int32_t>(params::PageTokens());
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
int Engine::nranks() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->nranks;
}

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

bool Engine::aborted() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->aborted_flag;
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
    const kvxfer_result_t rc = spectrum::importance_from_kv(
        pages.data(), static_cast<int32_t>(pages.size()), policy.lambda, norm.data());
    if (rc < 0) return set_error(rc, "SpectrumKV importance from the KV norm: %s", last_error());
    importance = norm.data();
  }
  const kvxfer_result_t rc = spectrum::assign(&policy, n, importance, r.tiers.data());
  if (rc < 0) return set_error(rc, "SpectrumKV policy: %s", last_error());
  return KVXFER_SUCCESS;
}

namespace {

/** KVXFER_SUCCESS when posts to `peer` are accepted; under m.mu. */
kvxfer_result_t peer_usable_locked(const Engine::Impl& m, int peer) {
  if (m.rank >= 0)
    KVXFER_REQUIRE(peer >= 0 && peer < m.nranks && peer != m.rank,
                   "peer %d is not another rank of this %d-rank communicator (this is rank %d)",
                   peer, m.nranks, m.rank);
  KVXFER_REQUIRE(peer >= 0 && peer < m.nranks && m.peer_state[peer] != Engine::Impl::kPeerReserved,
                 "peer %d is not a peer of this endpoint (kvxfer_endpoint_connect gives peers)",
                 peer);
  if (m.peer_state[peer] == Engine::Impl::kPeerGone)
    return set_error(KVXFER_ERR_INVALID_USAGE, "peer %d is disconnected: %s", peer,
                     m.peer_gone_why[peer].c_str());
  return KVXFER_SUCCESS;
}

kvxfer_result_t peer_usable(Engine::Impl& m, int peer) {
  std::lock_guard<std::mutex> lk(m.mu);
  return peer_usable_locked(m, peer);
}

}  // namespace

kvxfer_result_t Engine::Impl::take_peer_slot_locked(Request& r, int peer) {
  KVXFER_CHECK(peer_usable_locked(*this, peer));
  int& inflight = r.is_send ? inflight_send[peer] : inflight_recv[peer];
  if (inflight >= max_requests)
    return set_error(KVXFER_ERR_INVALID_USAGE,
                     "%d kvxfer_%s requests already in flight with peer %d (KVXFER_MAX_REQUESTS)",
                     inflight, r.is_send ? "send" : "recv", peer);
  const int both = inflight_send[peer] + inflight_recv[peer];
  if (peer_shm[peer] != 0 && both >= transport::kShmMaxRequests)
    return set_error(KVXFER_ERR_INVALID_USAGE,
                     "%d requests already in flight with peer %d, which this process reaches "
                     "over shared memory: it takes %d (its endpoints' %zu receive entries); wait "
                     "for some to finish",
                     both, peer, transport::kShmMaxRequests, transport::kShmRxEntries);
  if (r.by_id) {
    auto& ids = r.is_send ? ids_send[peer] : ids_recv[peer];
    if (!ids.insert(r.request_id).second)
      return set_error(KVXFER_ERR_INVALID_USAGE,
                       "a kvxfer_%s with request id %llu is already in flight with peer %d",
                       r.is_send ? "send" : "recv", static_cast<unsigned long long>(r.request_id),
                       peer);
    if (r.is_send) {  // the sender chooses the seq and announces it (protocol.h, RDV)
      uint32_t& seq = next_id_seq[peer];
      const auto next = [&seq] { seq = seq + 1 == kRdvSeq ? kIdSeqBase : seq + 1; };
      const std::vector<bool>& expired = seq_expired[peer];
      for (uint32_t n = 0;
           !expired.empty() && expired[seq - kIdSeqBase] && n < kRdvSeq - kIdSeqBase; ++n)
        next();  // (were every seq expired, it would take one: no better choice is left)
      r.seq = seq;
      next();
    } else {
      r.bound = false;
    }
  } else {
    uint32_t& seq = r.is_send ? next_send_seq[peer] : next_recv_seq[peer];
    r.seq = seq;
    seq = (seq + 1) % kIdSeqBase;
  }
  inflight++;
  return KVXFER_SUCCESS;
}

kvxfer_result_t Engine::post(bool is_send, int peer, const kvxfer_kv_desc_t* kv,
                             const kvxfer_codec_config_t* codec, const kvxfer_request_config_t* cfg,
                             void* handle, std::shared_ptr<Request>* out,
                             const SpectrumArgs* spectrum, void* cuda_stream, bool memory_checked) {
  Impl& m = *impl_;
  const bool any_peer = peer == KVXFER_ANY_PEER;
  if (any_peer)
    KVXFER_REQUIRE(is_send, "KVXFER_ANY_PEER is for a send: a receive names the peer it asks");
  else
    KVXFER_CHECK(peer_usable(m, peer));
  codec::KvDesc shape;
  KVXFER_CHECK(codec::validate_kv_desc(kv,
                                       memory_checked ? codec::KvAccess::kNone
                                       : is_send      ? codec::KvAccess::kRead
                                                      : codec::KvAccess::kWrite,
                                       "", &shape));
  xfer::DeviceCodec* dev = nullptr;
  if (kv->device >= 0) KVXFER_CHECK(xfer::usable_device_codec(kv->device, "the KV", &dev));

  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  if (cfg != nullptr) KVXFER_CHECK(read_struct(cfg, &rc));
  const int32_t mode = c_enum_value(rc.mode);
  KVXFER_REQUIRE(
      mode == KVXFER_MODE_AUTO || mode == KVXFER_MODE_PROGRESSIVE || mode == KVXFER_MODE_MONOLITHIC,
      "mode %d is not AUTO, PROGRESSIVE or MONOLITHIC", mode);
  KVXFER_REQUIRE(rc.page_tokens >= 0, "page_tokens %d is negative", rc.page_tokens);
  KVXFER_REQUIRE(rc.stream_layers == 0 || rc.stream_layers == 1, "stream_layers %d is not 0 or 1",
                 rc.stream_layers);
  KVXFER_REQUIRE(rc.match_by_id == 0 || rc.match_by_id == 1, "match_by_id %d is not 0 or 1",
                 rc.match_by_id);
  KVXFER_REQUIRE(!any_peer || rc.match_by_id == 1,
                 "KVXFER_ANY_PEER needs match_by_id = 1: a peer asks for the send by its "
                 "request_id");
  KVXFER_REQUIRE(rc.claim_timeout_ms >= 0, "claim_timeout_ms %d is negative", rc.claim_timeout_ms);
  KVXFER_REQUIRE(any_peer || rc.claim_timeout_ms == 0,
                 "claim_timeout_ms is for a send to KVXFER_ANY_PEER");
  if (rc.stream_layers != 0) {
    KVXFER_REQUIRE(is_send, "stream_layers is for a send: a receive follows its sender");
    if (kv->device >= 0)
      return set_error(KVXFER_ERR_UNSUPPORTED,
                       "stream_layers is not available for KV on a CUDA device");
    const codec::PageCodec* pc = codec != nullptr ? codec::page_codec(codec->codec) : nullptr;
    const bool spectrum_codec = pc != nullptr && pc->token_tiers();
    const bool auto_alpha =
        codec != nullptr && codec->codec == KVXFER_CODEC_LYNX && codec->alpha == KVXFER_ALPHA_AUTO;
    if (spectrum_codec || auto_alpha || spectrum != nullptr)
      return set_error(
          KVXFER_ERR_UNSUPPORTED,
          "stream_layers cannot serve %s, which looks at every layer before the "
          "first is sent",
          auto_alpha ? "alpha = auto (calibrate on a copy and pass the alpha)" : "codec SPECTRUM");
  }

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
  // The encodes wait for the producer's work: an event on the caller's stream,
  // recorded here, on the caller's thread, in the order of the caller's calls.
  if (dev != nullptr && is_send && kv->num_tokens > 0)
    KVXFER_CHECK(dev->record_ready(kv->device, cuda_stream, &r->ready));
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
    if (codec::page_codec(cc.codec)->token_tiers()) KVXFER_CHECK(spectrum_tiers(*r, kv, spectrum));
    if (kv->device >= 0 && cc.codec == KVXFER_CODEC_LYNX && cc.alpha == KVXFER_ALPHA_AUTO)
      return set_error(KVXFER_ERR_UNSUPPORTED,
                       "alpha=auto is not available for KV on a CUDA device: calibrate on a host "
                       "copy (kvxfer_codec_calibrate_alpha) and pass the chosen alpha");
    if (kv->device >= 0 && cc.value_groups == KVXFER_VALUE_GROUPS_TOKEN)
      return set_error(KVXFER_ERR_UNSUPPORTED,
                       "value_groups=token is not available for KV on a CUDA device "
                       "(docs/FORMAT.md 2.8): use channel, or auto (channel on the GPU)");
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
  r->t_layer_mark.store(r->t_posted);
  if (rc.stream_layers != 0)
    r->layer_marked.assign(static_cast<size_t>(kv->num_layers), 0);
  else
    r->layers_ready.store(kv->num_layers);

  r->by_id = rc.match_by_id != 0;
  r->request_id = rc.request_id;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (m.aborted_flag)
      return set_error(KVXFER_ERR_INVALID_USAGE, "the communicator was aborted (%s)",
                       m.abort_why.c_str());
    if (any_peer) {  // counted against a peer once one takes it (Impl::claim)
      if (static_cast<int64_t>(m.ids_any.size()) >= m.max_requests)
        return set_error(KVXFER_ERR_INVALID_USAGE,
                         "%zu sends to KVXFER_ANY_PEER already wait for a peer "
                         "(KVXFER_MAX_REQUESTS)",
                         m.ids_any.size());
      if (!m.ids_any.insert(rc.request_id).second)
        return set_error(KVXFER_ERR_INVALID_USAGE,
                         "a kvxfer_send to KVXFER_ANY_PEER with request id %llu already waits for "
                         "a peer",
                         static_cast<unsigned long long>(rc.request_id));
      r->unclaimed = true;
    } else {
      KVXFER_CHECK(m.take_peer_slot_locked(*r, peer));
    }
    r->order = m.next_order++;
    // The caller's handle holds the request before the progress thread can
    // see it: a request that ends at once calls its callbacks with that
    // handle, and kvxfer_test on it reads this pointer.
    *out = r;
    m.submitted.push_back(std::move(r));
  }
  m.kick();
  if (m.hooks && m.hooks->post_return_delay_ms.load() > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(m.hooks->post_return_delay_ms.load()));
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::xfer
