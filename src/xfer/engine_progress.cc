// The progress thread of the engine (engine.h): the only thread that touches
// the Links; handshakes, page and STATUS messages, stages, callbacks.
#include "xfer/engine_impl.h"

namespace kvxfer::xfer {

// ---------------------------------------------------------------------------
// Progress thread
// ---------------------------------------------------------------------------
void Engine::Impl::progress_main() {
  pthread_setname_np(pthread_self(), "kvxfer-progress");  // for top -H, perf, gdb
  int idle = 0;
  Clock::time_point idle_since;
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
    if (idle == 0) idle_since = Clock::now();
    idle = std::min(idle + 1, 1 << 20);  // no overflow on a long idle
    wait_for_work(idle, idle_since);
  }
}

// Nothing moved in the last round.  A few rounds of yield first (a
// completion is often microseconds away), then sleep in poll(2) until a
// completion queue, a post, a codec result or a cancel wakes us, or the rate
// limiter's next token is due; at most 100 ms, so timeouts and liveness
// checks still run.  The thread never spins against the codec threads for a
// core.
//
// A shm link sleeps on its doorbell, which the peer rings (Link::
// prepare_wait).  A link without CQ wait objects or a doorbell (a shm peer
// that does not ring) with operations in flight must be polled: the peer's
// next message lands in this side's region and nothing signals it.  The
// thread yields for the first 200 us of idleness (a
// transfer's next chunk is microseconds away), then sleeps on the wake fd
// alone (a post or a codec result still wakes it at once) for 100 us,
// doubling after 5, 10 and 20 ms of idleness to 800 us.
void Engine::Impl::wait_for_work(int idle, Clock::time_point idle_since) {
  if (idle < 8) {
    std::this_thread::yield();
    return;
  }
  const Clock::time_point now = Clock::now();
  Clock::time_point deadline = std::min(now + std::chrono::milliseconds(100), layer_deadline);
  wait_fds.clear();
  wait_fds.push_back(pollfd{wake_fd, POLLIN, 0});
  // A send to KVXFER_ANY_PEER waits for an ask, and a receive by id for its
  // RDV, which an shm peer without a doorbell would not signal (both come to
  // standing receives): poll, as for any operation in flight there.
  bool can_sleep = unclaimed.empty();
  for (int p = 0; p < npeers() && can_sleep; ++p) {
    Link* l = comm->link(p);
    if (l == nullptr) continue;
    can_sleep = l->prepare_wait(&wait_fds);
    if (can_sleep && pio[static_cast<size_t>(p)] && !io(p).rdv_waiting.empty() && l->same_host() &&
        !l->has_doorbell())
      can_sleep = false;
    deadline = std::min(deadline, l->next_deadline());
  }
  if (!can_sleep) {
    const auto idle_for = now - idle_since;
    if (idle_for < std::chrono::microseconds(200)) {
      std::this_thread::yield();
      return;
    }
    const int doublings = idle_for < std::chrono::milliseconds(5)    ? 0
                          : idle_for < std::chrono::milliseconds(10) ? 1
                          : idle_for < std::chrono::milliseconds(20) ? 2
                                                                     : 3;
    deadline = std::min(deadline, now + std::chrono::microseconds(100 << doublings));
    wait_fds.resize(1);  // the wake fd
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
  std::vector<std::pair<int, std::unique_ptr<Link>>> adopts;
  std::vector<Drop> drops;
  bool do_abort = false;
  std::string why;
  {
    std::lock_guard<std::mutex> lk(mu);
    fresh.swap(submitted);
    adopts.swap(adopt_queue);
    drops.swap(drop_queue);
    if (abort_requested && !links_aborted) {
      do_abort = true;
      why = abort_why;
    }
  }
  // Adopted peers before the new requests (one may be for them), dropped
  // peers after (every request of theirs then fails with the drop's reason).
  std::vector<Drop> no_drops;
  if (!adopts.empty()) {
    take_peer_changes(adopts, no_drops);
    adopts.clear();
  }
  for (auto& r : fresh) {
    active.push_back(r);
    if (r->is_send && r->by_id) {  // a new send of the id: asks for it are not answered
      any_withdrawn.erase(r->request_id);
      for (const auto& pi : pio)
        if (pi) pi->withdrew.erase(r->request_id);
    }
    if (r->unclaimed) {         // a send to KVXFER_ANY_PEER: waits for a peer's ask
      r->work->started = true;  // a cancel fails it while it waits
      unclaimed.push_back(r);
      claims_dirty = true;
    } else if (r->bound) {
      start(r);
    } else {
      bind_or_wait(r);
    }
    busy = true;
  }
  if (!drops.empty()) {
    take_peer_changes(adopts, drops);
    busy = true;
  }
  if (inbox->pending.load()) {
    take_cancels();
    busy = true;
  }
  if (inbox->layers_marked.exchange(false)) {  // kvxfer_send_layer_ready: encodes may go
    for (int p = 0; p < npeers(); ++p) pump_encodes(p);
    busy = true;
  }
  // Every round, not with the periodic work: the layer's timeout must win
  // the race with the Link's own inactivity timeout of the same length, whose
  // message would not name the layer.
  check_layer_timeouts();
  if (do_abort) {
    if (rank >= 0)
      KVXFER_INFO(LOG_NET, "aborting communicator rank %d: %s", rank, why.c_str());
    else
      KVXFER_INFO(LOG_NET, "aborting endpoint: %s", why.c_str());
    if (comm) comm->abort(why.c_str());
    links_aborted = true;
    const std::vector<std::shared_ptr<Request>> all = active;
    for (auto& r : all) fail(r, KVXFER_ERR_INVALID_USAGE, "communicator aborted (" + why + ")");
    busy = true;
  }

  // Network completions, peer by peer.
  std::vector<Completion> done;
  std::vector<std::pair<int, std::string>> newly_failed;
  for (int p = 0; p < npeers(); ++p) {
    Link* l = comm ? comm->link(p) : nullptr;
    if (l == nullptr) continue;
    done.clear();
    l->poll(&done);
    for (const Completion& c : done) on_completion(p, c);
    if (!done.empty()) busy = true;
    if (io(p).handshaking && (l->ready() || l->failed())) {
      io(p).handshaking = false;
      handshaking--;
    }
    if (l->failed() && !io(p).failure_told && !io(p).draining) {
      io(p).failure_told = true;
      newly_failed.emplace_back(p, l->failure());
    }
  }
  release_drained();
  arm_streams();
  if (claims_dirty) try_claims();
  sweep_claims();
  if (!newly_failed.empty()) {
    PeerFailed told;
    {
      std::lock_guard<std::mutex> lk(mu);
      told = peer_failed;
    }
    if (told)
      for (const auto& [p, text] : newly_failed) told(p, text);
  }

  // Codec results.
  std::deque<JobDone> results;
  {
    std::lock_guard<std::mutex> lk(cmu);
    results.swap(jobs_done);
  }
  for (auto& d : results) on_job_done(d);
  if (!results.empty()) busy = true;

  admit_gated();
  post_residual_recvs();
  const Clock::time_point now = Clock::now();
  if (now - last_trim >= std::chrono::milliseconds(100)) {
    last_trim = now;
    staging->trim(now);
  }
  if (!held_full.empty() && !residuals_paused() && anchors_unapplied == 0) {
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
  return post_for(r, c, make_tag(r->seq, !r->is_send, mk, page), true, buf, len, k, page);
}

bool Engine::Impl::post_link_recv(const std::shared_ptr<Request>& r, TrafficClass c, OpKind k,
                                  MsgKind mk, size_t page, void* buf, size_t cap) {
  return post_for(r, c, make_tag(r->seq, r->is_send, mk, page), false, buf, cap, k, page);
}

bool Engine::Impl::post_for(const std::shared_ptr<Request>& r, TrafficClass c, uint64_t tag,
                            bool is_send, const void* buf, size_t len, OpKind k, size_t page) {
  const kvxfer_result_t rc = post_raw(r->peer, c, tag, is_send, buf, len, r, k, page);
  if (rc < 0)
    fail(r, rc,
         strprintf("posting a %s peer %d failed: %s", is_send ? "send to" : "receive from", r->peer,
                   last_error()));
  return rc >= 0;
}

kvxfer_result_t Engine::Impl::post_raw(int peer, TrafficClass c, uint64_t tag, bool is_send,
                                       const void* buf, size_t len,
                                       const std::shared_ptr<Request>& r, OpKind k, size_t page,
                                       uint64_t* op_out, bool standing) {
  uint64_t op = 0;
  kvxfer_result_t rc = KVXFER_SUCCESS;
  if (!comm) {
    testing_posts.push_back(
        {peer, c, tag, is_send, static_cast<uint8_t*>(const_cast<void*>(buf)), len});
    op = testing_posts.size();
  } else if (Link* l = comm->link(peer); l == nullptr) {
    return set_error(KVXFER_ERR_INVALID_USAGE, "peer %d is disconnected", peer);
  } else if (is_send) {
    // The handshake's messages go ahead of the messages already queued on
    // the class: a burst's later DESCs would otherwise reach the receiver
    // only after the earlier requests' anchors, too late for its strict
    // priority to see them (docs/TRANSPORT.md, "Handshakes ahead of
    // pages").  So does a receiver's STATUS (refuse_rdv's has no request):
    // it keeps its place before the DESC that follows it when a receive
    // fails early, and its sender stops at once.  A sender's STATUS stays
    // behind its page messages.
    const bool from_receiver = r == nullptr || !r->is_send;
    const bool ahead = k == OpKind::kDescSend || k == OpKind::kRdvSend || k == OpKind::kAskSend ||
                       (k == OpKind::kStatusSend && from_receiver);
    rc = l->post_send(c, buf, len, tag, &op, ahead);
  } else {
    rc = l->post_recv(c, const_cast<void*>(buf), len, tag, &op, standing);
  }
  if (rc < 0) return rc;
  io(peer).ops[op] = OpRef{r, k, page, is_send};
  if (r != nullptr) r->work->ops++;
  if (op_out != nullptr) *op_out = op;
  return KVXFER_SUCCESS;
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
    size_t rtot = 0;
    for (size_t i = 0; i < w.pages.size(); ++i) {
      size_t a = 0, b = 0;
      const kvxfer_result_t rc = codec::max_sizes(&sz, w.pages[i].num_tokens, H, &a, &b);
      if (rc < 0) {
        fail(r, rc, last_error());
        return;
      }
      PageState& p = w.ps[i];
      if (w.mode == KVXFER_MODE_MONOLITHIC) {
        p.a_cap = a + b;
        p.r_cap = b;  // the encoder writes the residual after the anchor's capacity
      } else {
        p.a_cap = a;
        p.r_off = rtot;
        p.r_cap = b;
        rtot += b;
      }
    }
    w.rstore_bytes = rtot;
    {
      std::lock_guard<std::mutex> lk(r->mu);
      r->num_pages = static_cast<int64_t>(w.pages.size());
    }
  }
  if (r->is_send && r->by_id && !post_rdv_send(r)) return;
  w.desc_in.assign(kDescBytes, 0);
  w.status_in.assign(kStatusHeaderBytes + kMaxStatusText, 0);
  // A sender's DESC goes now.  A receiver's goes now too when the gate has
  // room for its KV's size, which bounds its anchor store whatever the
  // sender's codec (reserved here, made exact at the handshake): the common
  // case pays no extra round trip.  Else once the sender's DESC has come and
  // its store fits (admit_recv): until then its sender sends nothing.
  if (!r->is_send && recv_gate.empty() &&  // none waits before it
      (gate_used == 0 || gate_used + r->kv_bytes <= gate_budget)) {
    w.gate_bytes = r->kv_bytes;
    gate_used += w.gate_bytes;
    w.pre_admitted = true;
  }
  if (((r->is_send || w.pre_admitted) && !send_desc(r)) ||
      !post_link_recv(r, TrafficClass::kAnchor, OpKind::kDescRecv, MsgKind::kDesc, 0,
                      w.desc_in.data(), w.desc_in.size()) ||
      !post_link_recv(r, TrafficClass::kAnchor, OpKind::kStatusRecv, MsgKind::kStatus, 0,
                      w.status_in.data(), w.status_in.size()))
    return;
  // A sender takes its staging and encodes once matched (alloc_send): the
  // receiver's DESC says its memory is there.  Except when no other send of
  // this engine holds staging: then it starts at once, overlapping the
  // handshake, as a lone request always did (a burst still waits for its
  // receivers, one request aside).
  if (r->is_send) {
    io(r->peer).encode_fifo.push_back(r);
    if (sends_staged == 0 && alloc_send(r)) pump_encodes(r->peer);
  }
}

bool Engine::Impl::send_desc(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  if (w.desc_sent) return true;
  w.desc_sent = true;
  w.desc_out = encode_desc(r->mine);
  return post_link_send(r, TrafficClass::kAnchor, OpKind::kDescSend, MsgKind::kDesc, 0,
                        w.desc_out.data(), w.desc_out.size());
}

bool Engine::Impl::alloc_send(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  if (w.send_staged) return true;
  if (!make_window(r, true) ||
      (w.mode == KVXFER_MODE_PROGRESSIVE && !staging->get(w.rstore_bytes, &w.rstore))) {
    fail(r, KVXFER_ERR_OUT_OF_MEMORY,
         strprintf("no memory for %zu bytes of encoded sections",
                   w.slot_bytes * w.free_slots.size() + w.rstore_bytes));
    return false;
  }
  if (w.rstore) w.rpin = pin_store(*r, w.rstore.get(), w.rstore.capacity());
  w.send_staged = true;
  ++sends_staged;
  return true;
}

void Engine::Impl::pump_encodes(int peer) {
  if (!pio[static_cast<size_t>(peer)]) return;  // released
  auto& q = io(peer).encode_fifo;
  for (auto it = q.begin(); it != q.end();) {
    const std::shared_ptr<Request> r = *it;
    queue_encodes(r);
    Work& w = *r->work;
    if (w.failed || w.next_encode >= w.pages.size()) {
      it = q.erase(it);
      continue;
    }
    // It waits for its slots.  Once its receiver has matched it, the ones
    // behind wait too (pages leave in request order); before, they may go:
    // a receive by id may come in any order, or never, and an earlier send
    // the receiver has not posted must not hold back the ones it has.
    if (w.handshake_ok) return;
    ++it;
  }
}

bool Engine::Impl::make_window(const std::shared_ptr<Request>& r, bool window) {
  Work& w = *r->work;
  w.slot_bytes = 1;
  for (const PageState& p : w.ps) w.slot_bytes = std::max(w.slot_bytes, p.a_cap);
  const size_t pages = w.pages.size();
  size_t slots = pages;
  if (window) {
    slots = std::min(pages, std::max<size_t>(2, window_bytes / w.slot_bytes));
    w.free_slots.clear();
    for (size_t i = slots; i-- > 0;) w.free_slots.push_back(static_cast<int32_t>(i));
  }
  if (!staging->get(slots * w.slot_bytes, &w.astore)) return false;
  w.apin = pin_store(*r, w.astore.get(), w.astore.capacity());
  return true;
}

void Engine::Impl::release_slot(Work& w, size_t page) {
  PageState& p = w.ps[page];
  if (p.slot < 0) return;
  w.free_slots.push_back(p.slot);
  p.slot = -1;
}

// A stream_layers send with a layer still unmarked, and no mark within the
// timeout of its post or of its last mark, fails (its peer is told), wherever
// it is in its peer's encode queue.  The earliest deadline of the others is
// when the progress thread wakes next at the latest (wait_for_work), so that
// the sender's reason reaches the peer before the peer's own timeout of the
// same length, which names no layer, fires.
void Engine::Impl::check_layer_timeouts() {
  const int64_t now = now_ns();
  int64_t first = INT64_MAX;
  std::vector<std::pair<std::shared_ptr<Request>, int32_t>> late;
  for (const auto& pi : pio)
    for (const std::shared_ptr<Request>& r : pi ? pi->encode_fifo : decltype(pi->encode_fifo){}) {
      const int32_t ready = r->layers_ready.load();
      if (r->work->failed || r->cfg.stream_layers == 0 || ready >= r->mine.num_layers) continue;
      const int64_t deadline = r->t_layer_mark.load() + timeout_ms * 1000000;
      if (now > deadline)
        late.emplace_back(r, ready);
      else
        first = std::min(first, deadline + 1);
    }
  layer_deadline = first == INT64_MAX
                       ? Clock::time_point::max()
                       : Clock::time_point(std::chrono::duration_cast<Clock::duration>(
                             std::chrono::nanoseconds(first)));
  for (const auto& [r, layer] : late)  // fail() changes the queues
    fail(r, KVXFER_ERR_TIMEOUT,
         strprintf("layer %d was not marked ready (kvxfer_send_layer_ready) within %lld ms", layer,
                   static_cast<long long>(timeout_ms)));
}

void Engine::Impl::queue_encodes(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  const int32_t ready = r->layers_ready.load();
  while (!w.failed && w.next_encode < w.pages.size() && !w.free_slots.empty() &&
         w.pages[w.next_encode].layer < ready) {
    const size_t i = w.next_encode++;
    PageState& p = w.ps[i];
    p.slot = w.free_slots.back();
    w.free_slots.pop_back();
    p.a_off = static_cast<size_t>(p.slot) * w.slot_bytes;
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

// Receives are posted in page order (the order the sender sends); a failed
// request drains the rest into zero-capacity receives at once, so nothing
// lands in the blocks and the sender's message sequence completes.
void Engine::Impl::post_anchor_recvs(const std::shared_ptr<Request>& r) {
  static uint8_t sink;
  Work& w = *r->work;
  while (w.next_anchor_post < w.pages.size()) {
    const size_t i = w.next_anchor_post;
    PageState& p = w.ps[i];
    uint8_t* buf = &sink;
    size_t cap = 0;
    if (!w.failed) {
      p.a_off = i * w.slot_bytes;  // a receiver has a slot per page
      buf = w.astore.get() + p.a_off;
      cap = p.a_cap;
    }
    w.next_anchor_post++;
    if (!post_link_recv(r, TrafficClass::kAnchor, OpKind::kAnchor, MsgKind::kAnchor, i, buf, cap))
      return;  // failed: fail() posted the drains of the rest
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
  const int32_t L = r->mine.num_layers;
  if (r->is_send) w.handshake_ok = true;
  if (!r->is_send) {
    w.codec = peer.codec;
    w.mode = peer.mode;
    w.page_tokens = peer.page_tokens;
    w.pages = plan_pages(L, r->mine.num_tokens, w.page_tokens);
    w.ps.resize(w.pages.size());
    kvxfer_codec_config_t sz = w.codec;
    if (sz.alpha == KVXFER_ALPHA_AUTO) sz.alpha = 0.0f;
    const int32_t H = r->mine.kv_heads * r->mine.head_dim;
    for (size_t i = 0; i < w.pages.size(); ++i) {
      size_t a = 0, b = 0;
      rc = codec::max_sizes(&sz, w.pages[i].num_tokens, H, &a, &b);
      if (rc < 0) {
        fail(r, KVXFER_ERR_CORRUPT,
             strprintf("the sender's codec configuration is invalid: %s", last_error()));
        return;
      }
      PageState& p = w.ps[i];
      p.a_cap = w.mode == KVXFER_MODE_MONOLITHIC ? a + b : a;
      p.r_cap = b;
    }
    // Its anchor store must fit KVXFER_RECV_ANCHOR_BYTES beside the running
    // receives (one always runs); else it waits its turn, in post order.
    size_t slot = 1;
    for (const PageState& p : w.ps) slot = std::max(slot, p.a_cap);
    const size_t need = slot * w.pages.size();
    if (w.pre_admitted || w.failed) {  // its DESC went at post: the reservation becomes exact
      ungate_bytes(w);
      w.gate_bytes = w.failed ? 0 : need;
      gate_used += w.gate_bytes;
    } else if (recv_gate.empty() && (gate_used == 0 || gate_used + need <= gate_budget)) {
      w.gate_bytes = need;
      gate_used += need;
    } else {
      w.gate_bytes = need;
      w.gated = true;
      insert_in_order(&recv_gate, r);
      return;
    }
    admit_recv(r);
    return;
  }
  publish_handshake(r);
  if (!w.pages.empty()) io(r->peer).anchors_unposted.insert(r.get());
  if (w.pages.empty()) publish(r, KVXFER_STAGE_ANCHOR_READY);
  if (!w.failed) alloc_send(r);  // a failed one sends empty messages: no staging
  sender_pump(r);
  pump_encodes(r->peer);  // matched now: it may take its turn in the queue
  maybe_complete(r);
}

// The handshake's facts, for kvxfer_request_get_info and the per-layer stages.
void Engine::Impl::publish_handshake(const std::shared_ptr<Request>& r) {
  const Work& w = *r->work;
  const size_t L = static_cast<size_t>(r->mine.num_layers);
  std::lock_guard<std::mutex> lk(r->mu);
  r->t_handshake = now_ns();
  r->num_pages = static_cast<int64_t>(w.pages.size());
  r->codec = w.codec.codec;
  r->mode = w.mode;
  r->layer_pages.assign(L, 0);
  r->layer_anchor.assign(L, 0);
  r->layer_complete.assign(L, 0);
  for (const PageRef& p : w.pages) r->layer_pages[static_cast<size_t>(p.layer)]++;
}

void Engine::Impl::ungate_bytes(Work& w) {
  gate_used -= w.gate_bytes;
  w.gate_bytes = 0;
}

void Engine::Impl::admit_gated() {
  while (!recv_gate.empty()) {
    const std::shared_ptr<Request> r = recv_gate.front();
    if (gate_used > 0 && gate_used + r->work->gate_bytes > gate_budget) return;
    recv_gate.pop_front();
    gate_used += r->work->gate_bytes;
    admit_recv(r);
  }
}

// Its gate bytes are counted by the caller (on_handshake, admit_gated); a
// failed one's are not (fail() admits it to drain the sender's messages).
void Engine::Impl::admit_recv(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  w.gated = false;
  w.handshake_ok = true;
  // One slot per page: the receiver posts every page receive at once, in
  // the order the sender sends.  Posting a monolithic request's pages as
  // slots free up put them behind other requests' receives in the Link's
  // posting order, and with progressive and monolithic requests mixed on
  // one peer the anchor class stalled until the timeout.
  if (!w.failed && !make_window(r, false))
    fail(r, KVXFER_ERR_OUT_OF_MEMORY,
         strprintf("no memory for %zu bytes of anchor sections", w.slot_bytes * w.pages.size()));
  publish_handshake(r);
  // A request that failed before its handshake (cancelled, timed out)
  // drains the sender's page messages into zero-capacity receives: nothing
  // lands in the blocks and none of its anchors is awaited by the strict
  // anchor priority (anchors_unapplied).
  post_anchor_recvs(r);
  w.anchors_remaining = w.failed ? 0 : static_cast<int64_t>(w.pages.size());
  anchors_unapplied += w.anchors_remaining;
  if (w.mode == KVXFER_MODE_PROGRESSIVE && !w.pages.empty() && !w.in_residual_fifo) {
    w.in_residual_fifo = true;
    enqueue_residuals(r);
  }
  // The sender's go: its receives are posted, its memory is here.
  if (!send_desc(r)) return;
  if (w.pages.empty() && !w.failed) {
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
    const size_t alen = empty ? 0 : progressive ? p.a_len : p.a_len + p.r_len;
    post_link_send(r, TrafficClass::kAnchor, OpKind::kAnchor, MsgKind::kAnchor, i,
                   empty ? &kEmpty : w.astore.get() + p.a_off, alen);
    if (!progressive) continue;
    if (empty) {
      post_link_send(r, TrafficClass::kResidual, OpKind::kResidual, MsgKind::kResidual, i, &kEmpty,
                     0);
    } else {
      w.held++;
      io(r->peer).held_residuals.emplace_back(r, i);
    }
  }
  if (w.next_page_send == w.pages.size()) io(r->peer).anchors_unposted.erase(r.get());
  flush_residuals(r->peer);
}

// A residual to a peer goes to the Link once every anchor of every other
// handshaken send to that peer is posted; its own send's later pages may
// still be encoding.  The Link sends no residual chunk while an anchor chunk
// waits, so a lone send's residuals take the link while its later pages
// encode (Lynx's split streams keep the link busy): held until its last
// anchor was posted, they left an encoder-bound link idle and then came
// after it (a 43 ms tail in Xfer.ResidualsUseTheLinkWhileLaterPagesEncode).
// With other sends in flight they wait for all their anchors, as the
// receiver may not know those sends yet: released once the sends posted
// before theirs had their anchors posted, they were applied before a later
// send's DESC arrived (figure 3 of perf/run_figures.sh failed in 5 runs of
// 100, against 1).  Sends not matched yet do not count: their receivers may
// be waiting for these sends to end (KVXFER_RECV_ANCHOR_BYTES), and counting
// them stalled Xfer.ResidualsBeyondTheStagingPoolKeepFlowing.  Residual
// messages keep request order, then page order: the order the receiver
// posts their receives in.  The receiver applies none before every anchor
// it knows of (queue_full).
void Engine::Impl::flush_residuals(int peer) {
  static const uint8_t kEmpty = 0;
  const auto& unposted = io(peer).anchors_unposted;
  auto& q = io(peer).held_residuals;
  // In request post order, pages ascending: the order the receiver posts its
  // residual receives in (enqueue_residuals), whatever order handshakes took.
  q.sort([](const auto& a, const auto& b) {  // stable
    return a.first->order != b.first->order ? a.first->order < b.first->order : a.second < b.second;
  });
  while (!q.empty()) {
    if (!unposted.empty() && (unposted.size() > 1 || *unposted.begin() != q.front().first.get()))
      return;
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
  insert_in_order(&residual_fifo, r);
}

void insert_in_order(std::deque<std::shared_ptr<Request>>* q, const std::shared_ptr<Request>& r) {
  auto it = q->end();
  while (it != q->begin() && (*std::prev(it))->order > r->order) --it;
  q->insert(it, r);
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
  auto it = io(peer).ops.find(c.op_id);
  if (it == io(peer).ops.end()) return;  // a Link-internal operation
  OpRef ref = std::move(it->second);
  io(peer).ops.erase(it);
  if (ref.req == nullptr) {  // the rendezvous stream, or a refused request's drain
    if (ref.kind == OpKind::kRdvRecv) {
      on_rdv(peer, c);
    } else if (ref.kind == OpKind::kAskRecv) {
      on_ask(peer, c);
    } else {
      io(peer).drain_bufs.erase(c.op_id);  // a refusal's buffer, free once its op ended
    }
    return;
  }
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
  if (c.status == KVXFER_ERR_TIMEOUT && r->is_send && r->by_id &&
      (ref.kind == OpKind::kDescRecv || ref.kind == OpKind::kStatusRecv)) {
    std::lock_guard<std::mutex> lk(mu);  // the seq is not taken again (seq_expired)
    std::vector<bool>& expired = seq_expired[static_cast<size_t>(r->peer)];
    expired.resize(kRdvSeq - kIdSeqBase, false);
    expired[r->seq - kIdSeqBase] = true;
  }
  const int64_t t =
      std::chrono::duration_cast<std::chrono::nanoseconds>(c.done.time_since_epoch()).count();
  switch (ref.kind) {
    case OpKind::kRdvSend:
    case OpKind::kRdvRecv:
    case OpKind::kAskSend:
    case OpKind::kAskRecv:
    case OpKind::kDescSend:
    case OpKind::kStatusSend:
      if (!ok) fail(r, c.status, strprintf("peer %d: %s", r->peer, c.error.c_str()));
      break;
    case OpKind::kDescRecv:
      if (!ok) {
        fail(r, c.status, strprintf("peer %d: %s", r->peer, c.error.c_str()));
      } else if (c.bytes == 0 && r->is_send) {
        // A refusal (Engine::Impl::refuse_rdv): no page may follow, and its
        // STATUS, sent before it, says why; the STATUS receive still posted
        // ends the request (or its timeout does).
        w.peer_refused = true;
        if (w.peer_status_ok)
          fail(r, KVXFER_ERR_CORRUPT,
               strprintf("peer %d (receiver) refused the request after reporting success: not "
                         "the protocol of a kvxfer peer",
                         r->peer));
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
      uint16_t flags = 0;
      const kvxfer_result_t rc = decode_status(w.status_in.data(), c.bytes, &pr, &text, &flags);
      if (rc < 0) {
        fail(r, rc, strprintf("peer %d: %s", r->peer, last_error()));
      } else if ((flags & kStatusNoDesc) != 0 && (!r->is_send || w.handshake_done)) {
        fail(r, KVXFER_ERR_CORRUPT,
             strprintf("peer %d sent a refusal to a request it had %s: not the protocol of a "
                       "kvxfer peer",
                       r->peer, r->is_send ? "answered" : "sent"));
      } else if ((flags & kStatusNoDesc) != 0) {
        fail(r, pr, strprintf("peer %d (receiver) failed: %s", r->peer, text.c_str()));
        end_desc_recv(r, text);
      } else if (pr == KVXFER_ERR_CANCELLED) {
        fail(r, pr,
             strprintf("the peer cancelled the request: peer %d (%s): %s", r->peer,
                       r->is_send ? "receiver" : "sender", text.c_str()));
      } else if (pr != KVXFER_SUCCESS) {
        fail(r, pr,
             strprintf("peer %d (%s) failed: %s", r->peer, r->is_send ? "receiver" : "sender",
                       text.c_str()));
      } else if (!r->is_send) {
        // A sender reports success only once this side's STATUS ok came
        // (maybe_complete): one before, or after it gave up (an empty page
        // message), leaves nothing to wait on, so the receive would hang.
        const char* what = w.peer_gave_up ? "had its pages (it sent empty ones)" : "completed";
        fail(r, KVXFER_ERR_CORRUPT,
             strprintf("peer %d (sender) reported success before this receive %s: not the "
                       "protocol of a kvxfer peer",
                       r->peer, what));
      } else if (w.peer_refused) {
        fail(r, KVXFER_ERR_CORRUPT,
             strprintf("peer %d (receiver) reported success after refusing the request: not the "
                       "protocol of a kvxfer peer",
                       r->peer));
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
      // A sender's slot is free once its message is sent.
      if (anchor && r->is_send) {
        release_slot(w, ref.page);
        pump_encodes(r->peer);
      }
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
      if (hooks && c.bytes > 0 && hooks->take_corruption(anchor)) {
        const int64_t at = hooks->corrupt_offset.load();  // test seam: the checks must catch it
        section[at >= 0 && static_cast<size_t>(at) < c.bytes ? at : c.bytes / 2] ^= 0x5a;
      }
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

}  // namespace kvxfer::xfer
