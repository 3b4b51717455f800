// The engine half of peer_message_fuzz, shared by the fuzz target and the
// corpus replay in tests/wire_test.cc: one fuzz input (byte 0 flags, then
// records) played as the peer of one request of an Engine::testing_unlinked
// engine, with the properties of fuzz/README.md checked after every round.
//
//   flags   bit 0     this rank sends (else it receives; the input plays the other side)
//           bits 1-2  num_tokens 0, 5, 24 or 40 (2 layers, 1 KV head of 4 channels)
//           bit 3     the KV is fp32 (else bf16)
//           bits 4-5  the sender's codec: LYNX, INT8, INT4, BF16 (this rank sends)
//           bit 6     page_tokens 16 (else 8) (this rank sends)
//   record  op u8     bits 0-1 the message kind (DESC, STATUS, ANCHOR, RESIDUAL),
//                     bit 2 its receive fails, bit 3 one send fails,
//                     bit 4 kvxfer_request_cancel first
//           page u16, length u16 (little-endian), then the message bytes
//
// Header-only; needs src/ on the include path and kvxfer_xfer.
#pragma once

#include <xxhash.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "xfer/engine_impl.h"

namespace kvxfer::fuzz {
namespace peer {

using kvxfer::xfer::Desc;
using kvxfer::xfer::Engine;
using kvxfer::xfer::MsgKind;
using kvxfer::xfer::PageRef;
using kvxfer::xfer::Request;

constexpr uint64_t kTag = 0x7a6;
constexpr int32_t kLayers = 2, kHeads = 1, kHeadDim = 4, kBlock = 8;
constexpr size_t kMaxRecords = 512;

uint64_t le64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

/**
 * The oracle, independent of the decoder: a section of `len` bytes is a
 * whole section (80-byte header + payload_bytes) of `section` (1 anchor, 2
 * residual) for page `p` of stream kTag, and its checksum is right
 * (docs/FORMAT.md 4.1, 4.3).  Returns its checksum, or nothing.
 */
bool section_ok(const uint8_t* s, size_t len, int section, const PageRef& p, uint64_t* sum) {
  if (len < 80 || le64(s + 56) != len - 80) return false;
  uint32_t magic;
  std::memcpy(&magic, s, 4);
  if (magic != 0x5058564Bu || s[4] != 5 || s[5] != 0 || s[8] != section) return false;
  uint32_t layer;
  std::memcpy(&layer, s + 20, 4);
  if (layer != static_cast<uint32_t>(p.layer) || s[15] != static_cast<uint8_t>(p.kind) ||
      le64(s + 32) != static_cast<uint64_t>(p.token_begin) ||
      le64(s + 40) != static_cast<uint64_t>(p.num_tokens) || le64(s + 48) != kTag)
    return false;
  uint8_t hdr[80];
  std::memcpy(hdr, s, 80);
  std::memset(hdr + 72, 0, 8);
  const uint64_t want = XXH3_64bits_withSeed(hdr, 80, XXH3_64bits(s + 80, len - 80));
  if (le64(s + 72) != want) return false;
  *sum = want;
  return true;
}

struct Delivered {
  bool ok = false;  // a successful completion with these bytes
  std::vector<uint8_t> bytes;
};

struct Harness {
  std::string violation;  // the first property broken ("" if none)
  void violated(const std::string& what) {
    if (violation.empty()) violation = what;
  }
  bool sender = false;  // this rank sends (the fuzz input plays the receiver)
  int64_t tokens = 0;
  kvxfer_dtype_t dtype = KVXFER_DTYPE_BF16;
  std::vector<std::vector<uint8_t>> blocks;
  std::vector<void*> k, v;
  std::unique_ptr<Engine> engine;
  Engine::Impl* m = nullptr;
  std::shared_ptr<Request> req;
  std::vector<bool> done;  // per testing_posts entry
  Delivered desc, status;
  std::vector<Delivered> anchor, residual;  // by page number, as posted
  bool send_failed = false;
  kvxfer_stage_t last_stage = KVXFER_STAGE_POSTED;

  bool setup(uint8_t flags) {
    sender = flags & 1;
    static const int64_t kTokens[4] = {0, 5, 24, 40};
    tokens = kTokens[(flags >> 1) & 3];
    dtype = flags & 8 ? KVXFER_DTYPE_FP32 : KVXFER_DTYPE_BF16;
    const int64_t nblocks = std::max<int64_t>(1, (tokens + kBlock - 1) / kBlock);
    const size_t esize = dtype == KVXFER_DTYPE_FP32 ? 4 : 2;
    for (int kind = 0; kind < 2; ++kind)
      for (int64_t i = 0; i < kLayers * nblocks; ++i) {
        blocks.emplace_back(static_cast<size_t>(kBlock * kHeads * kHeadDim) * esize);
        auto& b = blocks.back();
        for (size_t j = 0; j < b.size(); ++j) b[j] = static_cast<uint8_t>(j * 7 + i);
        if (esize == 2)  // keep bf16 values finite: a small exponent in every high byte
          for (size_t j = 1; j < b.size(); j += 2) b[j] = 0x3f;
        else
          for (size_t j = 3; j < b.size(); j += 4) b[j] = 0x3f;
        (kind == 0 ? k : v).push_back(b.data());
      }
    kvxfer_kv_desc_t kv = KVXFER_KV_DESC_INITIALIZER;
    kv.num_layers = kLayers;
    kv.kv_heads = kHeads;
    kv.head_dim = kHeadDim;
    kv.dtype = dtype;
    kv.num_tokens = tokens;
    kv.block_size = kBlock;
    kv.num_blocks = nblocks;
    kv.k_blocks = k.data();
    kv.v_blocks = v.data();
    kvxfer_request_config_t cfg = KVXFER_REQUEST_CONFIG_INITIALIZER;
    cfg.tag = kTag;
    kvxfer_codec_config_t codec = KVXFER_CODEC_CONFIG_INITIALIZER;
    if (sender) {
      static const kvxfer_codec_t kCodecs[4] = {KVXFER_CODEC_LYNX, KVXFER_CODEC_INT8,
                                                KVXFER_CODEC_INT4, KVXFER_CODEC_BF16};
      codec.codec = kCodecs[(flags >> 4) & 3];
      codec.chunk_tokens = 16;
      cfg.page_tokens = flags & 0x40 ? 16 : 8;
    }
    engine = Engine::testing_unlinked(1, 2);
    m = engine->testing_impl();
    if (engine->post(sender, 0, &kv, sender ? &codec : nullptr, &cfg, nullptr, &req) !=
        KVXFER_SUCCESS) {
      violated(std::string("a valid post failed: ") + kvxfer::last_error());
      return false;
    }
    drain();
    return true;
  }

  /** Codec jobs and progress rounds until nothing moves (bounded). */
  void drain() {
    for (int round = 0; round < 100000; ++round) {
      kvxfer::xfer::Job j;
      bool found = false;
      for (auto& q : m->jobs) {
        if (q.empty()) continue;
        j = std::move(q.front());
        q.pop_front();
        found = true;
        break;
      }
      if (found) m->run_job(j);
      const bool busy = m->step();
      check();
      if (!violation.empty() || (!found && !busy)) return;
    }
    violated("the engine did not settle after 100000 rounds");
  }

  /** Completes operation `i` (its index in testing_posts) with `status`, `bytes`. */
  void complete(size_t i, kvxfer_result_t status, size_t bytes) {
    done[i] = true;
    kvxfer::transport::Completion c;
    c.op_id = i + 1;
    c.tag = m->testing_posts[i].tag;
    c.cls = m->testing_posts[i].cls;
    c.is_send = m->testing_posts[i].is_send;
    c.status = status;
    if (status != KVXFER_SUCCESS) c.error = "injected failure";
    c.bytes = bytes;
    c.posted = c.done = kvxfer::transport::Clock::now();
    m->on_completion(0, c);
  }

  /** Every send completes (the first one with an error when `fail_one`). */
  void complete_sends(bool fail_one) {
    for (size_t i = 0; i < m->testing_posts.size(); ++i) {
      done.resize(m->testing_posts.size(), false);
      if (done[i] || !m->testing_posts[i].is_send) continue;
      const bool fail = fail_one;
      fail_one = false;
      // The sender's own STATUS goes out after it reports COMPLETE (protocol.h),
      // so only a failed DESC or page send means the data did not arrive.
      const auto kind = static_cast<MsgKind>((m->testing_posts[i].tag >> kvxfer::xfer::kPageBits) &
                                             ((1u << kvxfer::xfer::kKindBits) - 1));
      if (fail && kind != MsgKind::kStatus) send_failed = true;
      complete(i, fail ? KVXFER_ERR_SYSTEM : KVXFER_SUCCESS, fail ? 0 : m->testing_posts[i].len);
    }
  }

  /** One message from the peer: into the receive posted for it, if any. */
  void deliver(MsgKind kind, uint32_t page, const uint8_t* data, size_t len, bool fail) {
    const uint64_t tag = kvxfer::xfer::make_tag(req->seq, sender, kind, page);
    done.resize(m->testing_posts.size(), false);
    for (size_t i = 0; i < m->testing_posts.size(); ++i) {
      const auto& p = m->testing_posts[i];
      if (done[i] || p.is_send || p.tag != tag) continue;
      Delivered* d = kind == MsgKind::kDesc ? &desc : kind == MsgKind::kStatus ? &status : nullptr;
      if (d == nullptr) {
        auto& v = kind == MsgKind::kAnchor ? anchor : residual;
        if (v.size() <= page) v.resize(page + 1);
        d = &v[page];
      }
      if (fail || len > p.len) {  // the Link's error, or a message longer than the receive
        *d = Delivered{};
        complete(i, fail ? KVXFER_ERR_SYSTEM : KVXFER_ERR_BUFFER_TOO_SMALL, 0);
        return;
      }
      if (len > 0) std::memcpy(p.buf, data, len);
      d->ok = true;
      d->bytes.assign(data, data + len);
      complete(i, KVXFER_SUCCESS, len);
      return;
    }
  }

  /** The properties, after every round. */
  void check() {
    kvxfer_stage_t stage;
    kvxfer_result_t result;
    std::string error;
    {
      std::lock_guard<std::mutex> lk(req->mu);
      stage = req->stage;
      result = req->result;
      error = req->error;
    }
    if (stage < KVXFER_STAGE_POSTED || stage > KVXFER_STAGE_ERROR)
      violated("unknown stage " + std::to_string(stage));
    if ((last_stage == KVXFER_STAGE_COMPLETE || last_stage == KVXFER_STAGE_ERROR) &&
        stage != last_stage)
      violated("a final stage changed");
    if (stage != KVXFER_STAGE_ERROR && stage < last_stage) violated("the stage went back");
    last_stage = stage;
    if (stage == KVXFER_STAGE_ERROR && (result >= 0 || result < KVXFER_RESULT_MIN || error.empty()))
      violated("ERROR with result " + std::to_string(result) + " and message '" + error + "'");
    if (stage == KVXFER_STAGE_COMPLETE && result != KVXFER_SUCCESS) violated("COMPLETE, not ok");
    if (stage == KVXFER_STAGE_COMPLETE) check_complete();
  }

  /** Once the input is played: a request not final must have a receive
   *  posted, which the link's timeout would end; with none it never ends. */
  void check_not_stuck() {
    {
      std::lock_guard<std::mutex> lk(req->mu);
      if (req->stage == KVXFER_STAGE_COMPLETE || req->stage == KVXFER_STAGE_ERROR) return;
    }
    done.resize(m->testing_posts.size(), false);
    for (size_t i = 0; i < m->testing_posts.size(); ++i)
      if (!done[i] && !m->testing_posts[i].is_send) return;
    violated("not final, with no receive posted: nothing would end the request");
  }

  /** COMPLETE only when everything arrived whole, with every checksum right. */
  void check_complete() {
    if (!desc.ok) return violated("COMPLETE without the peer's DESC");
    Desc peer;
    if (kvxfer::xfer::decode_desc(desc.bytes.data(), desc.bytes.size(), &peer) != KVXFER_SUCCESS ||
        kvxfer::xfer::compare_desc(req->mine, peer) != KVXFER_SUCCESS)
      return violated("COMPLETE with a DESC that does not match");
    if (sender) {
      kvxfer_result_t pr = KVXFER_ERR_INTERNAL;
      std::string text;
      if (!status.ok ||
          kvxfer::xfer::decode_status(status.bytes.data(), status.bytes.size(), &pr, &text) !=
              KVXFER_SUCCESS ||
          pr != KVXFER_SUCCESS)
        return violated("sender COMPLETE without the receiver's STATUS ok");
      if (send_failed) violated("sender COMPLETE after a failed send");
      return;
    }
    const auto pages = kvxfer::xfer::plan_pages(kLayers, tokens, peer.page_tokens);
    for (size_t i = 0; i < pages.size(); ++i) {
      const std::string what = "receiver COMPLETE, page " + std::to_string(i) + ": ";
      if (anchor.size() <= i || !anchor[i].ok) return violated(what + "no anchor message");
      const std::vector<uint8_t>& a = anchor[i].bytes;
      const uint8_t* res;
      size_t alen, rlen;
      if (peer.mode == KVXFER_MODE_MONOLITHIC) {
        alen =
            a.size() >= 80
                ? 80 + static_cast<size_t>(std::min<uint64_t>(le64(a.data() + 56), a.size() - 80))
                : a.size();
        res = a.data() + alen;
        rlen = a.size() - alen;
      } else {
        if (residual.size() <= i || !residual[i].ok) return violated(what + "no residual message");
        alen = a.size();
        res = residual[i].bytes.data();
        rlen = residual[i].bytes.size();
      }
      uint64_t asum = 0, rsum = 0;
      if (!section_ok(a.data(), alen, 1, pages[i], &asum))
        return violated(what + "bad anchor section");
      if (!section_ok(res, rlen, 2, pages[i], &rsum))
        return violated(what + "bad residual section");
      if (le64(res + 64) != asum) violated(what + "residual not linked to its anchor");
    }
  }
};

/** What one input led to. */
struct Outcome {
  kvxfer_stage_t stage = KVXFER_STAGE_POSTED;
  kvxfer_result_t result = KVXFER_IN_PROGRESS;
  std::string error;      // the request's message when ERROR
  std::string violation;  // the first property broken, "" if none
};

/** Plays one fuzz input (framing above) and checks every property. */
inline Outcome play(const uint8_t* data, size_t size) {
  Outcome out;
  if (size == 0) return out;
  Harness h;
  if (h.setup(data[0])) {
    size_t off = 1;
    for (size_t n = 0; n < kMaxRecords && off + 5 <= size && h.violation.empty(); ++n) {
      const uint8_t op = data[off];
      const uint32_t page = data[off + 1] | (data[off + 2] << 8);
      size_t len = data[off + 3] | (data[off + 4] << 8);
      off += 5;
      len = std::min(len, size - off);
      if ((op & 0x10) && kvxfer::xfer::request_cancel(h.req) < 0)
        h.violated("request_cancel failed");
      h.deliver(static_cast<MsgKind>(op & 3), page, data + off, len, (op & 4) != 0);
      off += len;
      h.complete_sends((op & 8) != 0);
      h.drain();
    }
    if (h.violation.empty()) {
      h.complete_sends(false);
      h.drain();
      h.check_not_stuck();
    }
    std::lock_guard<std::mutex> lk(h.req->mu);
    out.stage = h.req->stage;
    out.result = h.req->result;
    out.error = h.req->error;
  }
  out.violation = h.violation;
  return out;
}

}  // namespace peer
}  // namespace kvxfer::fuzz
