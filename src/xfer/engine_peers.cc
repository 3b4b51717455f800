// The progress thread's side of an engine's peers (engine.h): the
// rendezvous of requests matched by id (protocol.h, RDV), and the peers an
// endpoint adopts and drops at run time (Engine::adopt_peer / drop_peer).
#include "common/heap.h"
#include "xfer/engine_impl.h"

namespace kvxfer::xfer {

// A by-id send announces (request id -> seq) on its peer's rendezvous stream
// before its DESC, in post order (protocol.h, RDV).
bool Engine::Impl::post_rdv_send(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  io(r->peer).asks.erase(r->request_id);  // the receiver's ask, if it came first, was for this
  w.rdv_out = encode_rdv(r->request_id, r->seq);
  const uint64_t tag =
      make_tag(kRdvSeq, false, MsgKind::kStatus, io(r->peer).rdv_sent++ & (kMaxPages - 1));
  return post_for(r, TrafficClass::kAnchor, tag, true, w.rdv_out.data(), w.rdv_out.size(),
                  OpKind::kRdvSend, 0);
}

// A by-id send that failed before its receiver's DESC came (cancelled, most
// often: a runtime aborting a request its decode has not asked for yet)
// withdraws its announcement, so that a receiver with no receive bound to it
// refuses it now (on_withdraw) and the id and request slot are free then,
// not at the timeout.  Only while its DESC and STATUS receives are posted,
// which the refusal's messages end (refuse_rdv), and while no STATUS of the
// receiver's came (it knows of the request then).
void Engine::Impl::withdraw(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  if (!r->is_send || !r->by_id || w.rdv_out.empty() || !w.withdraw_out.empty() ||
      w.handshake_done || w.peer_refused || w.peer_status || links_aborted || !comm)
    return;
  if (Link* l = comm->link(r->peer); l == nullptr || l->failed()) return;
  bool desc = false, status = false;
  for (const auto& [op, ref] : io(r->peer).ops)
    if (ref.req == r) {
      desc |= ref.kind == OpKind::kDescRecv;
      status |= ref.kind == OpKind::kStatusRecv;
    }
  if (!desc || !status) return;
  w.withdraw_out = encode_withdraw(r->request_id, r->seq, w.fail_code);
  const uint64_t tag =
      make_tag(kRdvSeq, false, MsgKind::kStatus, io(r->peer).rdv_sent++ & (kMaxPages - 1));
  post_for(r, TrafficClass::kAnchor, tag, true, w.withdraw_out.data(), w.withdraw_out.size(),
           OpKind::kRdvSend, 0);
}

// A new receive by id: bound at once to an announcement that came first, else
// it waits for one with the rendezvous stream's receive posted.
void Engine::Impl::bind_or_wait(const std::shared_ptr<Request>& r) {
  const int p = r->peer;
  io(p).rdv_refused.erase(r->request_id);  // posted again: this one wants the data
  auto it = io(p).rdv_parked.find(r->request_id);
  if (it != io(p).rdv_parked.end()) {
    r->seq = it->second.seq;
    r->order = it->second.order;
    r->bound = true;
    io(p).rdv_parked.erase(it);
    start(r);
    return;
  }
  r->work->started = true;  // a cancel fails it while it waits (settle)
  r->rdv_since = now_ns();
  io(p).rdv_waiting.push_back(r);
  if (links_aborted) {
    fail(r, KVXFER_ERR_INVALID_USAGE, "communicator aborted");
    return;
  }
  if (!send_ask(r)) return;  // a send to KVXFER_ANY_PEER waits for it
  arm_rdv(p);
}

bool Engine::Impl::send_ask(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  w.ask_out = encode_ask(r->request_id);
  w.ask_n = io(r->peer).ask_sent++;
  const uint64_t tag = make_tag(kRdvSeq, true, MsgKind::kStatus, w.ask_n & (kMaxPages - 1));
  return post_for(r, TrafficClass::kAnchor, tag, true, w.ask_out.data(), w.ask_out.size(),
                  OpKind::kAskSend, 0);
}

// Sends to KVXFER_ANY_PEER (kvxfer.h) and the asks of receives by id
// (protocol.h, ASK), and the announcements of sends by id (RDV, WITHDRAW).
// Every peer's ask and rendezvous streams have a standing receive posted,
// which the link's timeout leaves alone, so that their messages never pile
// up in the provider, whether or not a request waits for them.
void Engine::Impl::arm_streams() {
  if (!comm || links_aborted) return;
  for (int p = 0; p < npeers(); ++p) {
    if (!pio[static_cast<size_t>(p)] || io(p).draining) continue;
    Link* l = comm->link(p);
    if (l == nullptr || l->failed()) continue;
    arm_rdv(p);
    if (io(p).ask_armed) continue;
    const uint64_t tag =
        make_tag(kRdvSeq, true, MsgKind::kStatus, io(p).ask_received & (kMaxPages - 1));
    if (post_raw(p, TrafficClass::kAnchor, tag, false, io(p).ask_in.data(), io(p).ask_in.size(),
                 nullptr, OpKind::kAskRecv, 0, nullptr, /*standing=*/true) >= 0)
      io(p).ask_armed = true;
  }
}

void Engine::Impl::on_ask(int peer, const Completion& c) {
  PeerIo& pi = io(peer);
  pi.ask_armed = false;
  if (c.status != KVXFER_SUCCESS && (c.status != KVXFER_ERR_BUFFER_TOO_SMALL)) return;
  const uint32_t n = pi.ask_received++;  // the stream's message was consumed, good or not
  uint64_t id = 0;
  if (c.status != KVXFER_SUCCESS || decode_ask(pi.ask_in.data(), c.bytes, &id) != KVXFER_SUCCESS) {
    KVXFER_WARN(LOG_NET, "peer %d sent a malformed ask (%zu bytes); ignored", peer, c.bytes);
    return;
  }
  bool runs = false;   // a send of the id to this peer, posted: it is kept for it
  bool waits = false;  // a send to KVXFER_ANY_PEER of the id, posted and not yet claimed
  {
    std::lock_guard<std::mutex> lk(mu);
    const auto it = ids_send.find(peer);
    runs = it != ids_send.end() && it->second.count(id) != 0;
    waits = ids_any.count(id) != 0;
  }
  // A send of the id that runs keeps the ask: its RDV answers it, or, if
  // it fails before its receiver's DESC (the receive whose ask took it was
  // cancelled), fail() does; one that failed so already answers now.
  // Without either the receive would wait its timeout.
  if (runs) {
    const auto it = std::find_if(active.begin(), active.end(), [&](const auto& r) {
      return r->is_send && r->by_id && !r->unclaimed && r->peer == peer && r->request_id == id;
    });
    if (it != active.end() && (*it)->work->failed && !(*it)->work->handshake_done) {
      answer_ask(peer, id, n, {(*it)->work->fail_code, (*it)->work->fail_text, now_ns()});
      return;
    }
  }
  // No send of the id: one that withdrew is answered, the receive fails.
  for (const auto* m : {&pi.withdrew, &any_withdrawn})
    if (const auto wd = m->find(id); !runs && !waits && wd != m->end()) {
      answer_ask(peer, id, n, wd->second);
      return;
    }
  if (static_cast<int64_t>(pi.asks.size()) >= max_requests && pi.asks.count(id) == 0) {
    auto oldest = std::min_element(
        pi.asks.begin(), pi.asks.end(),
        [](const auto& a, const auto& b) { return a.second.t_ns < b.second.t_ns; });
    pi.asks.erase(oldest);
  }
  pi.asks[id] = {now_ns(), n};  // a later ask of the id is the one to answer
  claims_dirty = true;
}

void Engine::Impl::answer_ask(int peer, uint64_t id, uint32_t n, const PeerIo::Refusal& why) {
  if (io(peer).draining) return;
  std::vector<uint8_t> b = encode_withdraw(id, kRdvSeq, why.code, static_cast<uint16_t>(n));
  const uint64_t tag =
      make_tag(kRdvSeq, false, MsgKind::kStatus, io(peer).rdv_sent++ & (kMaxPages - 1));
  uint64_t op = 0;
  if (post_raw(peer, TrafficClass::kAnchor, tag, true, b.data(), b.size(), nullptr,
               OpKind::kRdvSend, 0, &op) >= 0)
    io(peer).drain_bufs[op] = std::move(b);  // the vector's storage moves: the Link keeps it
}

void Engine::Impl::answer_kept_ask(int peer, uint64_t id, const PeerIo::Refusal& why) {
  if (links_aborted || !pio[static_cast<size_t>(peer)]) return;
  const auto a = io(peer).asks.find(id);
  if (a == io(peer).asks.end()) return;
  answer_ask(peer, id, a->second.n, why);
  io(peer).asks.erase(a);
}

void Engine::Impl::try_claims() {
  claims_dirty = false;
  std::vector<std::pair<int64_t, int>> askers;  // (when, peer)
  for (size_t i = 0; i < unclaimed.size();) {
    const std::shared_ptr<Request> r = unclaimed[i];
    askers.clear();
    for (int p = 0; p < npeers() && !r->work->failed; ++p) {
      if (!pio[static_cast<size_t>(p)] || io(p).draining) continue;
      if (Link* l = comm ? comm->link(p) : nullptr; l == nullptr || l->failed()) continue;
      auto it = io(p).asks.find(r->request_id);
      if (it != io(p).asks.end()) askers.emplace_back(it->second.t_ns, p);
    }
    std::sort(askers.begin(), askers.end());
    bool taken = false;
    for (const auto& a : askers)
      if ((taken = claim(r, a.second))) break;
    if (taken || r->work->failed)
      unclaimed.erase(unclaimed.begin() + static_cast<std::ptrdiff_t>(i));
    else
      ++i;
  }
}

// The first peer that asked takes the send: it is counted against that peer
// as if posted to it now (false, and it waits on, while the peer is at its
// limits) and starts with its RDV.
bool Engine::Impl::claim(const std::shared_ptr<Request>& r, int peer) {
  {
    std::lock_guard<std::mutex> lk(mu);
    if (take_peer_slot_locked(*r, peer) != KVXFER_SUCCESS) return false;
    ids_any.erase(r->request_id);
    r->order = next_order++;
  }
  {
    std::lock_guard<std::mutex> lk(r->mu);
    r->peer = peer;
  }
  r->unclaimed = false;
  io(peer).asks.erase(r->request_id);
  start(r);
  return true;
}

void Engine::Impl::sweep_claims() {
  const int64_t now = now_ns();
  if (now - last_claim_sweep < 20 * 1000000LL) return;
  last_claim_sweep = now;
  for (const std::shared_ptr<Request>& r : std::vector<std::shared_ptr<Request>>(unclaimed)) {
    const int64_t limit_ms = r->cfg.claim_timeout_ms > 0 ? r->cfg.claim_timeout_ms : timeout_ms;
    if (!r->work->failed && now - r->t_posted > limit_ms * 1000000)
      fail(r, KVXFER_ERR_TIMEOUT,
           strprintf("no peer asked for request id %llu within %lld ms (claim_timeout_ms): no "
                     "kvxfer_recv by that id was posted toward this endpoint",
                     static_cast<unsigned long long>(r->request_id),
                     static_cast<long long>(limit_ms)));
  }
  unclaimed.erase(std::remove_if(unclaimed.begin(), unclaimed.end(),
                                 [](const std::shared_ptr<Request>& r) { return r->work->failed; }),
                  unclaimed.end());
  // Receives by id whose sender has not announced them within the timeout
  // of their wait: each fails alone, and its sender, if it comes later, is
  // told (rdv_refused).  Announcements no receive took within the timeout:
  // their senders are told, as for a cancelled receive.
  for (int p = 0; p < npeers(); ++p) {
    if (!pio[static_cast<size_t>(p)]) continue;
    for (auto it = io(p).rdv_parked.begin(); it != io(p).rdv_parked.end();) {
      if (now - it->second.t_ns <= timeout_ms * 1000000) {
        ++it;
        continue;
      }
      // No empty DESC: with equal timeouts the sender's DESC receive has
      // expired by now (it was posted before its announcement left), and a
      // message no receive takes would stay in its provider.
      refuse_rdv(
          p, it->second.seq, KVXFER_ERR_TIMEOUT,
          strprintf("no kvxfer_recv by request id %llu was posted within %lld ms of its "
                    "send's announcement",
                    static_cast<unsigned long long>(it->first), static_cast<long long>(timeout_ms)),
          /*empty_desc=*/false);
      it = io(p).rdv_parked.erase(it);
    }
    for (const std::shared_ptr<Request>& r :
         std::vector<std::shared_ptr<Request>>(io(p).rdv_waiting.begin(), io(p).rdv_waiting.end()))
      if (!r->work->failed && now - r->rdv_since > timeout_ms * 1000000)
        fail(r, KVXFER_ERR_TIMEOUT,
             strprintf("peer %d never posted the matching kvxfer_send (request id %llu) within "
                       "%lld ms",
                       p, static_cast<unsigned long long>(r->request_id),
                       static_cast<long long>(timeout_ms)));
  }
  // Asks no send took, refusals no announcement came for, and sends to
  // KVXFER_ANY_PEER that ended unclaimed: kept for the timeout (a sender
  // that comes later times out on its own side).
  for (const auto& pi : pio) {
    if (!pi) continue;
    for (auto it = pi->asks.begin(); it != pi->asks.end();)
      it = now - it->second.t_ns > timeout_ms * 1000000 ? pi->asks.erase(it) : std::next(it);
    for (auto* m : {&pi->rdv_refused, &pi->withdrew})
      for (auto it = m->begin(); it != m->end();)
        it = now - it->second.t_ns > timeout_ms * 1000000 ? m->erase(it) : std::next(it);
  }
  for (auto it = any_withdrawn.begin(); it != any_withdrawn.end();)
    it = now - it->second.t_ns > timeout_ms * 1000000 ? any_withdrawn.erase(it) : std::next(it);
}

// The stream's receive is posted on every usable link (arm_streams), so that
// announcements and withdrawals are read as they come, whether or not a
// receive waits.  It is a standing receive, which the link's timeout leaves
// alone: each waiting receive and parked announcement has its own deadline
// (sweep_claims), whatever other traffic the link carries.
void Engine::Impl::arm_rdv(int peer) {
  if (io(peer).rdv_armed != 0 || links_aborted || io(peer).draining) return;
  const uint64_t tag =
      make_tag(kRdvSeq, false, MsgKind::kStatus, io(peer).rdv_received & (kMaxPages - 1));
  const kvxfer_result_t rc =
      post_raw(peer, TrafficClass::kAnchor, tag, false, io(peer).rdv_in.data(),
               io(peer).rdv_in.size(), nullptr, OpKind::kRdvRecv, 0, nullptr, /*standing=*/true);
  if (rc >= 0) {
    io(peer).rdv_armed = 1;
    return;
  }
  const std::string why =
      strprintf("posting a receive from peer %d failed: %s", peer, last_error());
  for (const auto& r : std::vector<std::shared_ptr<Request>>(io(peer).rdv_waiting.begin(),
                                                             io(peer).rdv_waiting.end()))
    fail(r, rc, why);
}

void Engine::Impl::on_rdv(int peer, const Completion& c) {
  io(peer).rdv_armed = 0;
  uint64_t id = 0;
  uint32_t seq = 0;
  kvxfer_result_t rc = c.status, withdrawn = KVXFER_SUCCESS;
  uint16_t ask = 0;
  std::string why = c.error;
  if (rc == KVXFER_SUCCESS) {
    rc = decode_rdv(io(peer).rdv_in.data(), c.bytes, &id, &seq, &withdrawn, &ask);
    if (rc < 0) why = last_error();
  }
  if (rc < 0) {  // the stream is broken (the link failed): every waiting receive fails
    const std::string text = strprintf("peer %d: %s", peer, why.c_str());
    for (const auto& r : std::vector<std::shared_ptr<Request>>(io(peer).rdv_waiting.begin(),
                                                               io(peer).rdv_waiting.end()))
      fail(r, rc, text);
    return;
  }
  io(peer).rdv_received++;
  if (withdrawn < 0) {
    on_withdraw(peer, id, seq, withdrawn, ask);
    arm_rdv(peer);
    return;
  }
  // A receive by id takes its place among the engine's requests when its
  // sender's announcement arrives, which is the sender's post order: the
  // order its residuals come in (enqueue_residuals), whatever order the
  // receives were posted in.
  uint64_t arrival = 0;
  {
    std::lock_guard<std::mutex> lk(mu);
    arrival = next_order++;
  }
  auto& q = io(peer).rdv_waiting;
  auto it = std::find_if(q.begin(), q.end(),
                         [&](const std::shared_ptr<Request>& r) { return r->request_id == id; });
  if (it != q.end() && (*it)->work->failed) {  // failed, not settled yet: told now
    const std::shared_ptr<Request> r = *it;
    q.erase(it);
    r->work->rdv_told = true;
    refuse_rdv(peer, seq, r->work->fail_code, r->work->fail_text);
  } else if (it != q.end()) {
    const std::shared_ptr<Request> r = *it;
    q.erase(it);
    r->seq = seq;
    r->order = arrival;
    r->bound = true;
    start(r);
  } else if (auto ref = io(peer).rdv_refused.find(id); ref != io(peer).rdv_refused.end()) {
    refuse_rdv(peer, seq, ref->second.code, ref->second.text);
    io(peer).rdv_refused.erase(ref);
  } else {
    io(peer).rdv_parked[id] = {seq, arrival, now_ns()};
  }
  arm_rdv(peer);
}

// A WITHDRAW (protocol.h): an announcement no receive has taken is refused
// now.  One a receive took goes on: that receive fails on the sender's
// STATUS.  With seq kRdvSeq, the answer to this side's ask number `ask`
// (mod 2^16): no send of the id will come, and the receive that asked fails.
// A receive posted later asks again, and is answered (or its sender's new
// RDV binds it): an answer to an earlier ask of the id does not touch it.
void Engine::Impl::on_withdraw(int peer, uint64_t id, uint32_t seq, kvxfer_result_t why,
                               uint16_t ask) {
  const std::string text = strprintf(
      "peer %d withdrew the kvxfer_send of request id %llu before a kvxfer_recv took it (%s)", peer,
      static_cast<unsigned long long>(id), kvxfer_get_error_string(why));
  if (seq == kRdvSeq) {
    auto& q = io(peer).rdv_waiting;
    const auto w = std::find_if(q.begin(), q.end(), [&](const std::shared_ptr<Request>& r) {
      return r->request_id == id && !r->work->failed && !r->work->ask_out.empty() &&
             static_cast<uint16_t>(r->work->ask_n) == ask;
    });
    if (w == q.end()) return;
    const std::shared_ptr<Request> r = *w;
    r->work->rdv_told = true;  // its sender is gone: nobody to refuse
    fail(r, why, text);
    return;
  }
  const auto it = io(peer).rdv_parked.find(id);
  if (it == io(peer).rdv_parked.end() || it->second.seq != seq) return;
  io(peer).rdv_parked.erase(it);
  refuse_rdv(peer, seq, why, text);
}

void Engine::Impl::remember(std::unordered_map<uint64_t, PeerIo::Refusal>& ids, uint64_t id,
                            PeerIo::Refusal why) {
  if (static_cast<int64_t>(ids.size()) >= max_requests && ids.count(id) == 0)
    ids.erase(std::min_element(ids.begin(), ids.end(), [](const auto& a, const auto& b) {
      return a.second.t_ns < b.second.t_ns;
    }));
  ids[id] = std::move(why);
}

// The announced request `seq` from `peer` has no receive any more (cancelled
// or failed while it waited), or none came within the timeout of its
// announcement (sweep_claims): its sender gets this STATUS, then, unless
// `empty_desc` is false (sweep_claims), an empty DESC (protocol.h: a
// refusal, no page may follow), which ends its DESC receive at once: its id
// and request slot are free once that DESC has come, just after the
// STATUS, not at the timeout.  Without the empty DESC the STATUS carries
// kStatusNoDesc, and the sender ends its DESC receive itself (a busy link
// keeps it posted).  Its DESC and STATUS are received and dropped, so
// nothing of it stays in the provider.
void Engine::Impl::refuse_rdv(int peer, uint32_t seq, kvxfer_result_t code, const std::string& text,
                              bool empty_desc) {
  struct Post {
    uint64_t tag;
    bool is_send;
    std::vector<uint8_t> buf;
    size_t len;
    OpKind kind;
  };
  std::vector<uint8_t> status = encode_status(code, text, empty_desc ? 0 : kStatusNoDesc);
  const size_t status_len = status.size();
  Post posts[4] = {
      {make_tag(seq, true, MsgKind::kStatus, 0), true, std::move(status), status_len,
       OpKind::kStatusSend},
      {make_tag(seq, true, MsgKind::kDesc, 0), true, std::vector<uint8_t>(1), 0, OpKind::kDescSend},
      {make_tag(seq, false, MsgKind::kDesc, 0), false, std::vector<uint8_t>(kDescBytes), kDescBytes,
       OpKind::kDescRecv},
      {make_tag(seq, false, MsgKind::kStatus, 0), false,
       std::vector<uint8_t>(kStatusHeaderBytes + kMaxStatusText),
       kStatusHeaderBytes + kMaxStatusText, OpKind::kStatusRecv}};
  for (Post& p : posts) {
    if (p.kind == OpKind::kDescSend && !empty_desc) continue;
    // The vector's storage moves with it into the map: the Link keeps its address.
    uint64_t op = 0;
    if (post_raw(peer, TrafficClass::kAnchor, p.tag, p.is_send, p.buf.data(), p.len, nullptr,
                 p.kind, 0, &op) >= 0)
      io(peer).drain_bufs[op] = std::move(p.buf);
  }
}

void Engine::Impl::end_desc_recv(const std::shared_ptr<Request>& r, const std::string& why) {
  Link* l = comm ? comm->link(r->peer) : nullptr;
  if (l == nullptr) return;
  for (const auto& [op, ref] : io(r->peer).ops)
    if (ref.req == r && ref.kind == OpKind::kDescRecv)
      (void)l->cancel_recv(op, KVXFER_ERR_CANCELLED,
                           "the receiver refused the request, and no descriptor follows: " + why);
}

// Peers of an endpoint (Engine::adopt_peer / drop_peer).  An adopted Link
// joins the table before this round's new requests start; a dropped peer's
// requests fail, its Link is aborted at once and freed by release_drained
// once the aborted operations have come back.
void Engine::Impl::take_peer_changes(std::vector<std::pair<int, std::unique_ptr<Link>>>& adopts,
                                     std::vector<Drop>& drops) {
  for (auto& [p, link] : adopts) {
    grow_progress(p + 1);
    io(p).handshaking = !link->ready() && !link->failed();  // counted by adopt_peer
    comm->set_link(p, std::move(link));
  }
  for (const Drop& d : drops) {
    grow_progress(d.peer + 1);
    if (!pio[static_cast<size_t>(d.peer)]) continue;  // released already
    if (d.fail_requests) {
      const std::vector<std::shared_ptr<Request>> all = active;
      for (const auto& r : all)
        if (r->peer == d.peer) fail(r, d.code, d.why);
    }
    io(d.peer).holding = !d.close_link;
    if (Link* l = comm->link(d.peer); l != nullptr && d.close_link) l->abort(d.why.c_str());
    io(d.peer).draining = true;
  }
}

void Engine::Impl::release_drained() {
  bool released = false;
  for (int p = 0; p < npeers(); ++p) {
    if (!pio[p] || !io(p).draining || io(p).holding) continue;
    Link* l = comm->link(p);
    if (l != nullptr && l->ops_in_flight() > 0) continue;
    bool busy = false;  // a request of this peer not finalised yet still reads its state
    for (const auto& r : active) busy = busy || r->peer == p;
    if (busy) continue;
    comm->release_link(p, "peer disconnected");
    if (io(p).handshaking) handshaking--;
    pio[p].reset();
    {
      std::lock_guard<std::mutex> lk(mu);  // its ids: none is in flight now
      ids_send.erase(p);
      ids_recv.erase(p);
    }
    released = true;
  }
  // A peer's Link frees megabytes in many blocks (libfabric's pools): give
  // the free pages back, so that a long-lived endpoint whose peers come and
  // go keeps a flat resident set (perf/endpoint_perf, "rss_growth").
  if (released) trim_heap();
}

}  // namespace kvxfer::xfer
