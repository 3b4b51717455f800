// The codec threads of the engine (engine.h): encode pages, decode them into
// the receiver's blocks, highest priority first; and what the progress
// thread does with their results (on_job_done).
#include "codec/page_codec.h"
#include "xfer/engine_impl.h"

namespace kvxfer::xfer {

// ---------------------------------------------------------------------------
// Codec thread
// ---------------------------------------------------------------------------
void Engine::Impl::codec_main() {
  pthread_setname_np(pthread_self(), "kvxfer-codec");  // for top -H, perf, gdb
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
    run_job(j);
  }
}

void Engine::Impl::run_job(Job& j) {
  JobDone d;
  d.req = j.req;
  d.kind = j.kind;
  d.page = j.page;
  d.rc = KVXFER_SUCCESS;
  Request& r = *j.req;
  if (r.work->cancel.load()) {
    d.skipped = true;
  } else if (hooks && hooks->skip_codec) {
    if (j.kind == JobKind::kEncode) {  // the largest sizes, the bytes staging holds
      kvxfer_codec_config_t cc = j.codec;
      if (cc.alpha == KVXFER_ALPHA_AUTO) cc.alpha = 0.0f;
      d.rc = codec::max_sizes(&cc, j.ref.num_tokens, r.mine.kv_heads * r.mine.head_dim, &d.a_len,
                              &d.r_len);
      if (d.rc < 0) d.error = last_error();
    }
  } else if (j.kind == JobKind::kEncode) {
    if (hooks && hooks->encode_delay_us.load() > 0)
      std::this_thread::sleep_for(std::chrono::microseconds(hooks->encode_delay_us.load()));
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
        for (size_t i = 0; i < pages.size(); i += step) sample.push_back(page_layout(r, pages[i]));
        kvxfer_codec_config_t c0 = cc;
        c0.alpha = 0.0f;
        float a = 0.0f;
        d.rc = codec::calibrate_alpha(&c0, sample.data(), static_cast<int32_t>(sample.size()), &a);
        if (d.rc < 0) d.error = strprintf("alpha calibration failed: %s", last_error());
        w.alpha = a;
        w.alpha_resolved = true;
      }
      cc.alpha = w.alpha;
    }
    if (d.rc == KVXFER_SUCCESS) {
      const kvxfer_page_layout_t src = codec_layout(r, j.ref);
      const kvxfer_page_id_t id = page_id(r, j.ref);
      if (r.device >= 0) {  // serialised per device by the codec (process-wide)
        d.rc = xfer::device_codec()->encode(r.device, r.ready.get(), &cc, &id, &src, j.a, j.a_cap,
                                            &d.a_len, j.r, j.r_cap, &d.r_len);
      } else {  // a codec with token tiers (SpectrumKV) reads those of the page's tokens
        d.rc = codec::encode_any_page(
            &cc, &id, &src, r.tiers.data() + static_cast<size_t>(j.ref.token_begin), j.a, j.a_cap,
            &d.a_len, j.r, j.r_cap, &d.r_len, codec::Impl::AUTO, 1);
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
    std::unique_ptr<codec::DecodePlan> plan;
    if (d.rc == KVXFER_SUCCESS && r.device >= 0) {  // serialised per device by the codec
      d.rc = xfer::device_codec()->decode(r.device, a, a_len, res, r_len, &id, &dst);
    } else if (d.rc == KVXFER_SUCCESS && j.plan != nullptr) {
      // The residual step: the anchor section was parsed and checked by the
      // anchor step, whose plan this is; only the residual is new.
      d.rc = codec::plan_residual(j.plan.get(), res, r_len);
      if (d.rc == KVXFER_SUCCESS) d.rc = codec::decode_planned(*j.plan, &dst, codec::Impl::AUTO, 1);
    } else if (d.rc == KVXFER_SUCCESS) {
      plan = std::make_unique<codec::DecodePlan>();
      d.rc = codec::plan_decode_any(a, a_len, res, r_len, &id, &dst, plan.get(), 1);
      if (d.rc == KVXFER_SUCCESS) d.rc = codec::decode_planned(*plan, &dst, codec::Impl::AUTO, 1);
    }
    // Token tiers (SpectrumKV): those of the request's tokens, from the
    // layer-0 K pages' precision maps (the same for every layer, K and V).
    if (d.rc == KVXFER_SUCCESS && j.kind != JobKind::kDecodeFull && j.ref.layer == 0 &&
        j.ref.kind == KVXFER_KV_KEY && codec::page_codec(r.work->codec.codec)->token_tiers()) {
      uint8_t* tiers = r.tiers.data() + static_cast<size_t>(j.ref.token_begin);
      d.rc = plan != nullptr ? codec::plan_page_tiers(*plan, tiers, j.ref.num_tokens)
                             : codec::get_page_tiers(a, a_len, tiers, j.ref.num_tokens);
    }
    // The anchor step's plan goes to the page's residual step (queue_full).
    if (d.rc == KVXFER_SUCCESS && j.kind == JobKind::kDecodeAnchor) d.plan = std::move(plan);
    if (d.rc < 0)
      d.error = strprintf("the %s failed to decode: %s", page_name(j.ref).c_str(), last_error());
  }
  {
    std::lock_guard<std::mutex> lk(cmu);
    jobs_done.push_back(std::move(d));
  }
  kick();
}

void Engine::Impl::queue_full(const std::shared_ptr<Request>& r, size_t page) {
  // Strict priority on the receiver: no residual is applied while an anchor
  // of any request is still expected (docs/TRANSPORT.md, "Strict anchor
  // priority across requests").
  if (residuals_paused() || anchors_unapplied > 0) {
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
  j.plan = std::move(p.plan);
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

// A codec job's result, on the progress thread: the page's next step.
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
      p.plan = std::move(d.plan);
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

}  // namespace kvxfer::xfer
