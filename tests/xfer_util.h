// Shared pieces of the two-process transfer tests (xfer_test.cc,
// xfer_gpu_test.cc): a paged KV in host memory, the codec's own expected
// decode of it, and a communicator pair of a parent and a forked child.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "api/xfer_api.h"
#include "codec/codec.h"
#include "codec/page.h"
#include "common/error.h"
#include "common/fdio.h"
#include "fork_child.h"
#include "kvxfer/kvxfer.h"
#include "xfer/protocol.h"

namespace kvxfer {

using test::Child;

struct PagedKV {
  int32_t L, heads, hd;
  int64_t T;
  int32_t bs;
  int64_t stride;
  kvxfer_dtype_t dt;
  int64_t nblocks;
  std::vector<std::vector<uint8_t>> storage;
  std::vector<void*> k, v;
  kvxfer_kv_desc_t desc = KVXFER_KV_DESC_INITIALIZER;

  PagedKV(int32_t L_, int32_t heads_, int32_t hd_, int64_t T_, int32_t bs_,
          kvxfer_dtype_t dt_ = KVXFER_DTYPE_BF16, int64_t pad = 0)
      : L(L_), heads(heads_), hd(hd_), T(T_), bs(bs_), stride(heads_ * hd_ + pad), dt(dt_) {
    nblocks = std::max<int64_t>(1, (T + bs - 1) / bs);
    const size_t es = codec::dtype_size(dt);
    for (int i = 0; i < 2 * L * nblocks; ++i)
      storage.emplace_back(static_cast<size_t>(bs * stride) * es, 0xA5);
    for (int64_t i = 0; i < L * nblocks; ++i) k.push_back(storage[i].data());
    for (int64_t i = 0; i < L * nblocks; ++i) v.push_back(storage[L * nblocks + i].data());
    desc.num_layers = L;
    desc.kv_heads = heads;
    desc.head_dim = hd;
    desc.dtype = dt;
    desc.num_tokens = T;
    desc.block_size = bs;
    desc.row_stride = stride;
    desc.num_blocks = nblocks;
    desc.k_blocks = k.data();
    desc.v_blocks = v.data();
  }
  int32_t H() const { return heads * hd; }
  uint8_t* row(int32_t l, kvxfer_kv_kind_t kind, int64_t t) {
    void* const* b = (kind == KVXFER_KV_KEY ? k.data() : v.data()) + l * nblocks;
    return static_cast<uint8_t*>(b[t / bs]) + (t % bs) * stride * codec::dtype_size(dt);
  }
  kvxfer_page_layout_t layout(int32_t l, kvxfer_kv_kind_t kind, int64_t t0, int64_t n) {
    kvxfer_page_layout_t p{};
    p.blocks = (kind == KVXFER_KV_KEY ? k.data() : v.data()) + l * nblocks;
    p.num_blocks = nblocks;
    p.block_size = bs;
    p.row_stride = stride;
    p.first_token = t0;
    p.num_tokens = n;
    p.num_channels = H();
    p.dtype = dt;
    return p;
  }
  /** KV-like values: per-channel offsets and scales, a few outlier channels. */
  void fill(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (int32_t l = 0; l < L; ++l)
      for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
        for (int64_t t = 0; t < T; ++t)
          for (int32_t c = 0; c < H(); ++c) {
            const float scale = (c % 17 == 3) ? 20.0f : 1.0f + 0.1f * (c % 5);
            codec::store_elem(row(l, kind, t), c, dt, scale * g(rng) + 0.05f * (c % 7));
          }
  }
  std::vector<uint8_t> bytes(int32_t l, kvxfer_kv_kind_t kind) {
    std::vector<uint8_t> out;
    const size_t n = static_cast<size_t>(H()) * codec::dtype_size(dt);
    for (int64_t t = 0; t < T; ++t) out.insert(out.end(), row(l, kind, t), row(l, kind, t) + n);
    return out;
  }
};

/** What the receiver must hold: the codec's own decode of the sender's pages
 *  (anchor-only or full), written into a KV of the same shape.  `tiers`
 *  (SPECTRUM only): the request's per-token tiers. */
inline void expected_decode(PagedKV& src, const kvxfer_codec_config_t& cfg, int32_t page_tokens,
                            uint64_t tag, bool full, PagedKV* out, const uint8_t* tiers = nullptr) {
  for (const auto& p : xfer::plan_pages(src.L, src.T, page_tokens)) {
    size_t acap = 0, rcap = 0;
    ASSERT_EQ(codec::max_sizes(&cfg, p.num_tokens, src.H(), &acap, &rcap), KVXFER_SUCCESS);
    std::vector<uint8_t> a(acap), r(rcap);
    size_t alen = 0, rlen = 0;
    kvxfer_page_id_t id{static_cast<uint32_t>(p.layer), p.kind, p.token_begin, tag};
    const kvxfer_page_layout_t sl = src.layout(p.layer, p.kind, p.token_begin, p.num_tokens);
    ASSERT_EQ(
        tiers != nullptr
            ? codec::encode_page_tiered(&cfg, &id, &sl, tiers + p.token_begin, a.data(), acap,
                                        &alen, r.data(), rcap, &rlen)
            : codec::encode_page(&cfg, &id, &sl, a.data(), acap, &alen, r.data(), rcap, &rlen),
        KVXFER_SUCCESS)
        << last_error();
    const kvxfer_page_layout_t dl = out->layout(p.layer, p.kind, p.token_begin, p.num_tokens);
    ASSERT_EQ(
        codec::decode_page(a.data(), alen, full ? r.data() : nullptr, full ? rlen : 0, &id, &dl),
        KVXFER_SUCCESS)
        << last_error();
  }
}

// ---------------------------------------------------------------------------
// Two processes
// ---------------------------------------------------------------------------
inline constexpr int kTimeoutMs = 20000;
/** Timeout of the failure tests: long enough for kvxfer_comm_init on a loaded
 *  2-core machine, short enough to keep the tests quick. */
inline constexpr int kShortTimeoutMs = 4000;

using fdio::read_all;  // common/fdio.h
using fdio::write_all;

/**
 * The test seams (xfer/test_hooks.h) of every communicator init_rank makes in
 * this process.  A test sets them and puts them back; a child forked after
 * the change has the same values in its own copy.
 */
inline const std::shared_ptr<xfer::TestHooks>& test_hooks() {
  static const std::shared_ptr<xfer::TestHooks> hooks = std::make_shared<xfer::TestHooks>();
  return hooks;
}

inline kvxfer_comm_t init_rank(const kvxfer_unique_id_t& id, int rank, int timeout_ms = kTimeoutMs,
                               const char* rate = nullptr) {
  kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
  cfg.timeout_ms = timeout_ms;
  cfg.rate_limit = rate;
  cfg.bind_address = "127.0.0.1";
  kvxfer_comm_t comm = nullptr;
  if (api::comm_init(&comm, 2, id, rank, &cfg, test_hooks()) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "rank %d: kvxfer_comm_init: %s\n", rank, kvxfer_get_last_error());
    return nullptr;
  }
  return comm;
}

/** Runs `child` (rank 1) in a forked process and `parent` (rank 0) here. */
struct Pair {
  kvxfer_unique_id_t id{};
  Child child;
  bool start(const std::function<int(const kvxfer_unique_id_t&, int, int)>& fn) {
    if (kvxfer_get_unique_id(&id) != KVXFER_SUCCESS) return false;
    const kvxfer_unique_id_t copy = id;
    return child.start([fn, copy](int rd, int wr) { return fn(copy, rd, wr); });
  }
};

/** A child that is only a peer rank: joins, waits for the parent's byte, leaves. */
inline int idle_peer(const kvxfer_unique_id_t& id, int rd, int) {
  kvxfer_comm_t c = init_rank(id, 1);
  char b;
  fdio::read_all(rd, &b, 1);  // until the parent is done
  kvxfer_comm_destroy(c);
  return c != nullptr ? 0 : 1;
}
/** Lets an idle_peer child go; true if it exited 0. */
inline bool release_idle_peer(Pair* pair) {
  fdio::write_all(pair->child.to_child, "x", 1);
  return pair->child.wait(60) && WEXITSTATUS(pair->child.status) == 0;
}

/** The end of a two-process test: rank 0 leaves, the child must exit 0. */
inline void finish(Pair* pair, kvxfer_comm_t comm) {
  kvxfer_comm_destroy(comm);
  ASSERT_TRUE(pair->child.wait(60));
  EXPECT_EQ(WEXITSTATUS(pair->child.status), 0);
}

inline kvxfer_request_info_t info_of(kvxfer_request_t r) {
  kvxfer_request_info_t i = KVXFER_REQUEST_INFO_INITIALIZER;
  EXPECT_EQ(kvxfer_request_get_info(r, &i), KVXFER_SUCCESS);
  return i;
}

/** The sender's report to the parent: both byte counts of `req`, then its error text. */
inline void write_report(int wr, kvxfer_request_t req, const std::string& err) {
  const kvxfer_request_info_t i = info_of(req);
  const uint64_t counts[2] = {i.anchor_wire_bytes, i.residual_wire_bytes};
  fdio::write_all(wr, counts, sizeof(counts));
  const uint32_t n = static_cast<uint32_t>(err.size());
  fdio::write_all(wr, &n, 4);
  fdio::write_all(wr, err.data(), n);
}

struct SenderReport {
  uint64_t anchor = 0, residual = 0;
  std::string error;
};
inline bool read_report(int rd, SenderReport* rep) {
  uint64_t counts[2];
  uint32_t n = 0;
  if (!fdio::read_all(rd, counts, sizeof(counts)) || !fdio::read_all(rd, &n, 4)) return false;
  rep->anchor = counts[0];
  rep->residual = counts[1];
  rep->error.resize(n);
  return n == 0 || fdio::read_all(rd, rep->error.data(), n);
}

}  // namespace kvxfer
