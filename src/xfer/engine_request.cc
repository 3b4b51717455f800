// A request's end on the progress thread (engine.h): completion, failure,
// cancel, the stages published to the API threads and the release of its
// memory.
#include "xfer/engine_impl.h"

namespace kvxfer::xfer {

void Engine::Impl::maybe_complete(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  if (w.failed || !w.handshake_ok || w.final_published) return;
  const int64_t n = static_cast<int64_t>(w.pages.size());
  if (r->is_send) {
    const int64_t msgs = w.mode == KVXFER_MODE_PROGRESSIVE ? 2 * n : n;
    if (w.sends_done < msgs || !w.peer_status_ok) return;
    release_stores(w);
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
    release_stores(w);
    // STATUS first: the on_complete callback (run by publish) may abort the
    // communicator, and the peer waits for this message.
    send_status(r, KVXFER_SUCCESS, "");
    publish(r, KVXFER_STAGE_COMPLETE);
  }
}

// Every page section has been sent (sender) or decoded (receiver): the
// staging goes back to the cache before COMPLETE is visible, so that the
// caller's next request reuses it instead of mapping another (a long-lived
// communicator's resident set stays flat: perf/memory_perf --case churn).
// What is left (the STATUS exchange) reads none of it.
void Engine::Impl::release_stores(Work& w) {
  if (w.jobs == 0) drop_stores(w);  // else finalise does it
}

// The request's staging and its accounting (gate bytes, staged sends); pins
// before the stores they pin.
void Engine::Impl::drop_stores(Work& w) {
  ungate_bytes(w);
  unstage_send(w);
  w.apin.reset();
  w.rpin.reset();
  w.astore.reset();
  w.rstore.reset();
}

void Engine::Impl::send_status(const std::shared_ptr<Request>& r, kvxfer_result_t code,
                               const std::string& text) {
  Work& w = *r->work;
  if (w.status_sent || links_aborted || !r->bound) return;
  w.status_sent = true;
  w.status_out = encode_status(code, text);
  if (post_link_send(r, TrafficClass::kAnchor, OpKind::kStatusSend, MsgKind::kStatus, 0,
                     w.status_out.data(), w.status_out.size()) &&
      comm && comm->link(r->peer) != nullptr)
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
  if (r->unclaimed) {  // no peer took it: nothing posted; its id is free
    {
      std::lock_guard<std::mutex> lk(mu);
      ids_any.erase(r->request_id);
    }
    // A peer that asks for it (or asked, and waits for a slot) is told.
    const PeerIo::Refusal why{w.fail_code, text, now_ns()};
    remember(any_withdrawn, r->request_id, why);
    for (int p = 0; p < npeers(); ++p) answer_kept_ask(p, r->request_id, why);
    return;
  }
  send_status(r, w.fail_code, text);
  withdraw(r);  // a by-id send its receiver has not taken yet (engine_peers.cc)
  if (r->is_send && r->by_id && !w.handshake_done && pio[static_cast<size_t>(r->peer)]) {
    // No receive of its peer has it: an ask of its id from that peer, come
    // while it ran or within the timeout, is answered as after a WITHDRAW.
    const PeerIo::Refusal why{w.fail_code, text, now_ns()};
    remember(io(r->peer).withdrew, r->request_id, why);
    answer_kept_ask(r->peer, r->request_id, why);
  }
  // Keep the message sequence whole (protocol.h): the sender sends what is
  // left as empty messages, the receiver drains its residual receives.  Page
  // messages already given to the Link but not started go out empty too, so
  // the peer hears of the failure after one message, not after the KV.
  if (r->is_send) {
    Link* l = comm ? comm->link(r->peer) : nullptr;
    if (l != nullptr)
      for (const auto& [op, ref] : io(r->peer).ops)
        if (ref.req == r && (ref.kind == OpKind::kAnchor || ref.kind == OpKind::kResidual))
          l->empty_unstarted_send(op);
    sender_pump(r);
    pump_encodes(r->peer);  // its encodes stop: the next request's may go
  }
  if (!r->is_send && !w.handshake_ok) {
    // Its sender starts on this side's DESC: it goes now, with drains for the
    // pages when they are known (admit_recv), so the sender's messages end.
    if (w.gated) {  // not counted in gate_used while it waited
      recv_gate.erase(std::find(recv_gate.begin(), recv_gate.end(), r));
      w.gate_bytes = 0;
    }
    // Not started, or a receive by id not yet bound to its sender's seq:
    // no message of its own has a tag yet (settle tells a later sender).
    if (!w.started || !r->bound || links_aborted) return;
    if (w.handshake_done)
      admit_recv(r);
    else
      send_desc(r);
    return;
  }
  if (!r->is_send && w.handshake_ok) post_anchor_recvs(r);  // drains for the pages left
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
    // An endpoint's engine has no rank: its side is named instead.
    const std::string where = rank >= 0 ? strprintf("rank %d", rank)
                                        : std::string(r->is_send ? "its sender" : "its receiver");
    fail(r, KVXFER_ERR_CANCELLED,
         strprintf("the kvxfer_%s was cancelled on %s (kvxfer_request_cancel)",
                   r->is_send ? "send" : "recv", where.c_str()));
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
  if (!r->bound) {  // a receive by id that failed before its sender announced it
    io(r->peer).rdv_waiting.remove(r);
    if (!w.rdv_told) {  // its sender is told when its announcement comes
      remember(io(r->peer).rdv_refused, r->request_id, {w.fail_code, w.fail_text, now_ns()});
      arm_rdv(r->peer);
    }
  }
  finalise(r);
}

void Engine::Impl::unstage_send(Work& w) {
  if (!w.send_staged) return;
  w.send_staged = false;
  --sends_staged;
}

void Engine::Impl::finalise(const std::shared_ptr<Request>& r) {
  Work& w = *r->work;
  drop_stores(w);
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
    if (!r->unclaimed) {                 // an unclaimed send gave its id back when it failed
      (r->is_send ? inflight_send : inflight_recv)[r->peer]--;
      if (r->by_id) {
        auto& ids = r->is_send ? ids_send : ids_recv;
        if (const auto it = ids.find(r->peer); it != ids.end()) it->second.erase(r->request_id);
      }
    }
  }
  // An ask of its id that came while it ran was for it, or is answered (fail).
  if (r->is_send && r->by_id && !r->unclaimed && pio[static_cast<size_t>(r->peer)])
    io(r->peer).asks.erase(r->request_id);
  if (!unclaimed.empty()) claims_dirty = true;  // a slot of its peer is free
  active.erase(std::remove(active.begin(), active.end(), r), active.end());
}

}  // namespace kvxfer::xfer
