// The decode side of examples/disagg_demo; see disagg_decoder.h.
#include "examples/disagg_decoder.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

namespace disagg {

void on_anchor_ready(kvxfer_request_t, kvxfer_stage_t stage, kvxfer_result_t, void* user) {
  Snapshot* s = static_cast<Snapshot*>(user);
  if (stage == KVXFER_STAGE_ANCHOR_READY) {
    // Residuals of this request are applied only after this callback returns
    // (docs/SPEC.md, "The anchor snapshot"), so this copy is anchor-precision.
    const size_t n = static_cast<size_t>(s->tokens) * s->src->kv_dim * sizeof(float);
    for (size_t l = 0; l < s->src->k.size(); ++l) {
      std::memcpy(s->dst->k[l].data(), s->src->k[l].data(), n);
      std::memcpy(s->dst->v[l].data(), s->src->v[l].data(), n);
    }
  }
  std::lock_guard<std::mutex> lk(s->mu);
  s->taken = true;
  s->t = now_ns();
  s->cv.notify_all();
}

void Decoder::open_comm(double rate_bps) {
  kvxfer_unique_id_t id;
  CHECK_KVXFER(kvxfer_get_unique_id(&id));  // this process is rank 0
  rate_ = rate_text(rate_bps);
  std::vector<uint8_t> b(sizeof id + rate_.size());
  std::memcpy(b.data(), &id, sizeof id);
  std::memcpy(b.data() + sizeof id, rate_.data(), rate_.size());
  send_msg(to_, kMsgComm, b.data(), b.size());
  kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
  cfg.rate_limit = rate_.c_str();
  CHECK_KVXFER(kvxfer_comm_init(&comm_, 2, id, 0, &cfg));
}

std::vector<int> Decoder::prompt(int id, int len, uint64_t seed, const std::vector<int>& given) {
  PromptMsg pm{id, len, seed, o_.temperature, static_cast<int32_t>(given.size())};
  std::vector<uint8_t> b(sizeof pm + given.size() * sizeof(int32_t));
  std::memcpy(b.data(), &pm, sizeof pm);
  for (size_t i = 0; i < given.size(); ++i) {
    const int32_t t = given[i];
    std::memcpy(b.data() + sizeof pm + i * sizeof t, &t, sizeof t);
  }
  send_msg(to_, kMsgPrompt, b.data(), b.size());
  const std::vector<uint8_t> r = recv_msg(from_, kMsgTokens);
  std::vector<int> t(r.size() / sizeof(int32_t));
  for (size_t i = 0; i < t.size(); ++i) std::memcpy(&t[i], r.data() + i * 4, 4);
  return t;
}

Run Decoder::run(Mode mode, int pid, const std::vector<int>& prompt, int L, int rep,
                 double rate_bps) {
  Run r;
  r.mode = mode;
  r.rate_bps = rate_bps;
  r.prompt_len = L;
  r.tokens_in = L;
  r.rep = rep;
  const int n_kv = L - 1, N = o_.tokens;
  const kvxfer_kv_desc_t d = recv_.desc(c_, n_kv);
  Snapshot snap;
  snap.src = &recv_;
  snap.dst = &snap_;
  snap.tokens = n_kv;
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.tag = ++tag_;
  if (mode == kLynx) {
    rc.on_anchor_ready = on_anchor_ready;
    rc.user_data = &snap;
  }
  kvxfer_request_t req = nullptr;
  CHECK_KVXFER(kvxfer_recv(comm_, 1, &d, &rc, &req));
  XferMsg x{pid, n_kv, mode, o_.page_tokens, rc.tag};
  send_msg(to_, kMsgXfer, &x, sizeof x);

  const km::KVView full = recv_.view(n_kv), anchor = snap_.view(n_kv);
  std::vector<float> logits;
  std::string err;
  km::KVCache tail;  // full-KV rows of the final tokens after the prompt
  int tok = prompt[L - 1];
  auto step = [&](const km::KVView& view, km::KVCache* t, int token, int pos) {
    const int64_t a = now_ns();
    if (!m_.decode_step(token, pos, view, t, &logits, &err)) die("decode: %s", err.c_str());
    const int64_t b = now_ns();
    CHECK_KVXFER(kvxfer_spec_monitor_record_step(&monitor_, ms(b - a) * 1e-3));
    step_samples_.push_back(ms(b - a) * 1e-3);
    return km::argmax(logits.data(), logits.size());
  };
  auto commit = [&](int token) {
    r.tokens.push_back(token);
    r.t_commit.push_back(now_ns());
    if (r.t_first_emit == 0) r.t_first_emit = r.t_commit.back();
  };

  int32_t speculate = 0;
  CHECK_KVXFER(kvxfer_spec_monitor_query(&monitor_, &speculate, nullptr));
  if (mode == kLynx && speculate) {
    // ANCHOR_READY: wait for the snapshot the callback takes.
    {
      std::unique_lock<std::mutex> lk(snap.mu);
      while (!snap.taken) {
        snap.cv.wait_for(lk, std::chrono::milliseconds(5));
        kvxfer_stage_t st;
        const kvxfer_result_t tr = kvxfer_test(req, &st);
        if (tr < 0) die("receive failed: %s", kvxfer_get_last_error());
      }
    }
    r.t_snapshot = snap.t;
    r.speculated = true;
    kvxfer_spec_window_config_t wc = KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER;
    wc.margin = o_.margin;
    wc.max_tokens = std::min(N, c_.seq_len - L);
    wc.residual_ratio = residual_ratio_;
    wc.link_bytes_per_s = rate_bps;
    std::vector<int32_t> draft;
    km::KVCache dtail;
    const int64_t t_start = now_ns();
    int t = tok;
    // Drafting runs while the residual is in flight: it leaves the
    // transfer's progress and decode threads one of the model's threads
    // (docs/SPEC.md, "Results on SmolLM2").
    const int draft_threads = o_.drafting_threads();
    omp_set_num_threads(draft_threads);
    for (;;) {
      kvxfer_stage_t st;
      const kvxfer_result_t tr = kvxfer_test(req, &st);
      if (tr < 0) die("receive failed: %s", kvxfer_get_last_error());
      if (st == KVXFER_STAGE_COMPLETE) break;
      kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
      CHECK_KVXFER(kvxfer_request_get_info(req, &info));
      const int64_t now = now_ns();
      double t_res = 0;
      int32_t w = 0;
      if (kvxfer_spec_residual_time(&wc, &info, now, &t_res) != KVXFER_SUCCESS) t_res = 0;
      if (monitor_.tpot_s > 0) {
        CHECK_KVXFER(kvxfer_spec_window(&wc, t_res, monitor_.tpot_s, ms(now - t_start) * 1e-3, &w));
      } else {
        w = 1;  // no step measured yet: draft one, which measures TPOT
      }
      if (draft.empty()) {
        r.window0 = w;
        r.t_res_pred0 = t_res;
      }
      if (static_cast<int>(draft.size()) >= w) break;  // window full: wait for the residual
      t = step(anchor, &dtail, t, L - 1 + static_cast<int>(draft.size()));
      draft.push_back(t);
      if (r.t_first_emit == 0) r.t_first_emit = now_ns();
    }
    if (o_.pinned) pin_threads(o_.threads);
    // Verify the draft in batched passes on the full KV; row i of a pass's
    // logits scores its draft token i.  The first pass starts now, the
    // residual perhaps still in flight: it reads layer l of the full KV
    // only once kvxfer_wait_layer says that layer is COMPLETE (all its
    // pages' residuals applied and checked), so what is left of it at
    // COMPLETE is the last layers' share (docs/SPEC.md, "The first pass
    // after COMPLETE").  Until the last layer is complete it runs on the
    // drafting threads, leaving the transfer its core.  The later passes
    // run after COMPLETE.
    auto team_for_rest = [&] {
      kvxfer_stage_t last = KVXFER_STAGE_POSTED;
      (void)kvxfer_test_layer(req, c_.n_layers - 1, &last);
      omp_set_num_threads(last == KVXFER_STAGE_COMPLETE ? o_.threads : draft_threads);
    };
    auto layer_complete = [&](int layer) {
      if (kvxfer_wait_layer(req, layer, KVXFER_STAGE_COMPLETE, -1) != KVXFER_SUCCESS) return false;
      team_for_rest();
      return true;
    };
    team_for_rest();
    r.t_verify_start = now_ns();
    // Passes until a rejection or the end of the draft.  Each pass checks
    // the next v draft tokens: all that are left (--verify_rule all), or
    // the v with the most expected final tokens per second at this
    // context's pass cost (kvxfer_spec_verify_length); at most
    // --verify_max per pass, and --first_verify in the first.  A pass
    // whose tokens are all accepted also yields the model's next token;
    // when that equals the next draft token it is accepted too and the
    // next pass goes on from there.
    const size_t n_check = draft.size();
    size_t pos = 0;  // draft tokens accepted so far
    int cur = tok;   // the last final token, whose KV row is not in the tail yet
    r.drafted = static_cast<int>(draft.size());
    for (;;) {
      const int64_t p0 = now_ns();
      size_t v = n_check - pos;
      const PassCost& cost = cost_at(n_kv);
      if (o_.verify_rule == "adaptive") {
        // The acceptance so far, with a prior of 9 accepted in 10 (the
        // paper's 90.4%) so that one early rejection does not stop every
        // later verification (and with it the evidence).
        const double rate = (static_cast<double>(monitor_.accepted) + 9.0) /
                            (static_cast<double>(monitor_.accepted + monitor_.rejected) + 10.0);
        int32_t n = 0;
        CHECK_KVXFER(kvxfer_spec_verify_length(static_cast<int32_t>(v), rate, cost.tpot_s,
                                               cost.base_s, cost.per_token_s, &n));
        v = static_cast<size_t>(n);
      }
      if (o_.verify_max > 0) v = std::min(v, static_cast<size_t>(o_.verify_max));
      if (r.passes == 0 && o_.first_verify > 0)
        v = std::min(v, static_cast<size_t>(o_.first_verify));
      std::vector<int> batch = {cur};
      batch.insert(batch.end(), draft.begin() + static_cast<std::ptrdiff_t>(pos),
                   draft.begin() + static_cast<std::ptrdiff_t>(pos + v));
      const int rows0 = tail.n_tokens();
      const bool first = r.passes == 0;
      if (!(first ? m_.verify(batch, L - 1 + rows0, full, &tail, &logits, &err, layer_complete)
                  : m_.verify(batch, L - 1 + rows0, full, &tail, &logits, &err)))
        die("verify: %s (%s)", err.c_str(), kvxfer_get_last_error());
      int64_t p_start = p0;  // the first pass: its time after COMPLETE
      if (first) {
        omp_set_num_threads(o_.threads);
        if (kvxfer_wait(req, KVXFER_STAGE_COMPLETE, -1) != KVXFER_SUCCESS)
          die("receive failed: %s", kvxfer_get_last_error());
        kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
        CHECK_KVXFER(kvxfer_request_get_info(req, &info));
        p_start = std::max(p0, info.t_complete_ns);
      }
      std::vector<int32_t> target(batch.size());
      for (size_t i = 0; i < batch.size(); ++i)
        target[i] = km::argmax(logits.data() + i * c_.vocab_size, c_.vocab_size);
      int32_t a = 0, next = 0;
      CHECK_KVXFER(kvxfer_spec_verify_greedy(draft.data() + pos, static_cast<int32_t>(v),
                                             target.data(), &a, &next));
      tail.truncate(rows0 + 1 + a);  // the rows of cur and of the accepted draft tokens
      const double pass_s = ms(now_ns() - p_start) * 1e-3;
      r.pass_log.push_back({static_cast<int>(batch.size()), pass_s * 1e3,
                            cost.pass_s(static_cast<int>(batch.size())) * 1e3});
      // The accepted tokens become final now (the first one was emitted
      // earlier, when it was drafted).
      for (int i = 0; i < a && static_cast<int>(r.tokens.size()) < N; ++i)
        commit(draft[pos + static_cast<size_t>(i)]);
      r.verified += static_cast<int>(v);
      for (size_t i = 0; i < v; ++i) r.matched += draft[pos + i] == target[i] ? 1 : 0;
      if (v > 0)
        CHECK_KVXFER(kvxfer_spec_monitor_update(&monitor_, static_cast<int32_t>(v), a, nullptr));
      ++r.passes;
      pos += static_cast<size_t>(a);
      if (static_cast<size_t>(a) < v) r.rejected = true;
      const bool go_on = static_cast<size_t>(a) == v && pos < n_check && draft[pos] == next &&
                         static_cast<int>(r.tokens.size()) < N;
      if (static_cast<int>(r.tokens.size()) < N) commit(next);  // the correction, or draft[pos]
      cur = next;
      if (!go_on) break;
      ++pos;  // draft[pos] == next was accepted without a check
      if (pos >= n_check) break;
    }
    r.accepted = static_cast<int>(pos);
    r.t_verify_end = now_ns();
    const int next = cur;
    tok = next;
  } else {
    const kvxfer_result_t wr = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, -1);
    if (wr != KVXFER_SUCCESS) die("receive failed: %s", kvxfer_get_last_error());
  }
  // Decode the rest on the full KV.
  while (static_cast<int>(r.tokens.size()) < N) {
    const int pos = L - 1 + tail.n_tokens();
    tok = step(full, &tail, tok, pos);
    commit(tok);
  }

  // Untimed: the transfer's record, the sender's, and the reference decode.
  kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
  CHECK_KVXFER(kvxfer_request_get_info(req, &info));
  r.t_handshake = info.t_handshake_ns;
  r.t_anchor = info.t_anchor_ready_ns;
  r.t_first_residual = info.t_first_residual_ns;
  r.t_complete = info.t_complete_ns;
  r.anchor_bytes = info.anchor_wire_bytes;
  r.residual_bytes = info.residual_wire_bytes;
  CHECK_KVXFER(kvxfer_request_free(req));
  r.t0 = as<int64_t>(recv_msg(from_, kMsgPosted));
  const DoneMsg done = as<DoneMsg>(recv_msg(from_, kMsgDone));
  if (done.result != KVXFER_SUCCESS) die("send failed: %s", done.error);
  if (mode == kLynx && r.anchor_bytes > 0)
    residual_ratio_ = static_cast<double>(r.residual_bytes) / r.anchor_bytes;
  {
    km::KVCache t2;
    int tk = prompt[L - 1];
    for (int i = 0; i < N; ++i) {
      if (!m_.decode_step(tk, L - 1 + i, full, &t2, &logits, &err)) die("%s", err.c_str());
      tk = km::argmax(logits.data(), logits.size());
      r.reference.push_back(tk);
    }
  }
  check_stages(&r);
  return r;
}

void Decoder::calibrate_at(int n_kv) {
  if (pass_cost_.count(n_kv) != 0) return;
  const km::KVView kv = recv_.view(n_kv);
  std::vector<float> logits;
  std::string err;
  std::vector<double> steps;
  for (int rep = 0; rep < 3; ++rep) {
    km::KVCache t;
    int tok = 1;
    for (int i = 0; i < 4; ++i) {
      const int64_t a = now_ns();
      if (!m_.decode_step(tok, n_kv + i, kv, &t, &logits, &err)) die("%s", err.c_str());
      steps.push_back(ms(now_ns() - a) * 1e-3);
      tok = km::argmax(logits.data(), logits.size());
    }
  }
  PassCost c;
  c.tpot_s = median(steps);
  // Passes of k tokens, 3 timings each; least squares over the medians.
  std::vector<std::pair<double, double>> pts;
  for (int k : {1, 4, 16, 64}) {
    if (n_kv + k > c_.seq_len) break;
    std::vector<double> t;
    for (int rep = 0; rep < 3; ++rep) {
      km::KVCache tail;
      const std::vector<int> batch(static_cast<size_t>(k), 1);
      const int64_t a = now_ns();
      if (!m_.verify(batch, n_kv, kv, &tail, &logits, &err)) die("%s", err.c_str());
      t.push_back(ms(now_ns() - a) * 1e-3);
    }
    pts.push_back({static_cast<double>(k), median(t)});
  }
  double sk = 0, st = 0, skk = 0, skt = 0;
  for (const auto& [k, t] : pts) {
    sk += k;
    st += t;
    skk += k * k;
    skt += k * t;
  }
  const double n = static_cast<double>(pts.size());
  const double den = n * skk - sk * sk;
  c.per_token_s = pts.size() >= 2 && den > 0 ? std::max(0.0, (n * skt - sk * st) / den) : 0.0;
  c.base_s = std::max(0.0, (st - c.per_token_s * sk) / n);
  if (pass_cost_.empty())
    for (int i = 0; i < 8; ++i) CHECK_KVXFER(kvxfer_spec_monitor_record_step(&monitor_, c.tpot_s));
  pass_cost_[n_kv] = c;
}

const PassCost& Decoder::cost_at(int n_kv) const {
  if (pass_cost_.empty()) die("cost_at(%d) before calibrate_at", n_kv);
  auto it = pass_cost_.lower_bound(n_kv);
  if (it == pass_cost_.end()) return std::prev(it)->second;
  if (it != pass_cost_.begin() && n_kv - std::prev(it)->first < it->first - n_kv)
    return std::prev(it)->second;
  return it->second;
}

void Decoder::check_stages(Run* r) {
  auto bad = [&](const char* what) {
    r->stages_ok = false;
    if (!r->stage_problem.empty()) r->stage_problem += "; ";
    r->stage_problem += what;
  };
  if (!(r->t0 <= r->t_handshake && r->t_handshake <= r->t_anchor && r->t_anchor <= r->t_complete))
    bad("not POSTED <= handshake <= ANCHOR_READY <= COMPLETE");
  if (r->mode == kLynx) {
    if (!(r->t_anchor < r->t_complete)) bad("ANCHOR_READY not before COMPLETE");
    if (!(r->t_first_residual >= r->t_anchor)) bad("a residual applied before ANCHOR_READY");
    if (r->speculated && !(r->t_snapshot >= r->t_anchor && r->t_snapshot <= r->t_complete))
      bad("the anchor snapshot is not between ANCHOR_READY and COMPLETE");
    if (r->drafted > 0 && !(r->t_first_emit >= r->t_anchor)) bad("drafted before ANCHOR_READY");
    // The first pass may start before COMPLETE: it reads each layer only
    // after kvxfer_wait_layer(COMPLETE) (Model::verify's layer_ready).
    if (r->speculated && !(r->t_verify_start >= r->t_anchor)) bad("verified before ANCHOR_READY");
  } else if (r->t_first_residual != 0 || r->residual_bytes != 0) {
    bad("a monolithic transfer carried residual sections");
  }
  if (!r->t_commit.empty() && !(r->t_commit.front() >= r->t_anchor))
    bad("a final token before the KV was usable");
}

}  // namespace disagg
