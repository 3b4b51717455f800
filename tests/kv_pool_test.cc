// Registered KV pools (kvxfer_kv_pool_register), requests that name block ids
// and KV head ranges (kvxfer_send_blocks / kvxfer_recv_blocks), and sends
// that stream layer by layer (stream_layers, kvxfer_send_layer_ready).
// Transfers run between the parent and forked children over loopback; the
// received bytes are compared bit for bit with the codec's own decode of the
// sender's values.
//
// As xfer_test, the codec runs single-threaded (no OpenMP pool before fork).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "codec/page.h"
#include "common/fdio.h"
#include "kvxfer/kvxfer.h"
#include "kvxfer/spectrum.h"
#include "xfer_util.h"

namespace kvxfer {
namespace {

/**
 * A host pool laid out as vLLM's FlashAttention backend holds one layer:
 * [2][num_blocks][block_size][heads * head_dim], K then V.
 */
struct HostPool {
  int32_t L, heads, hd, bs;
  int64_t nblocks;
  kvxfer_dtype_t dt;
  std::vector<std::vector<uint8_t>> layers;
  std::vector<void*> kb, vb;
  kvxfer_kv_pool_desc_t desc = KVXFER_KV_POOL_DESC_INITIALIZER;
  kvxfer_kv_pool_t pool = nullptr;

  HostPool(int32_t L_, int32_t heads_, int32_t hd_, int32_t bs_, int64_t nblocks_,
           kvxfer_dtype_t dt_ = KVXFER_DTYPE_BF16)
      : L(L_), heads(heads_), hd(hd_), bs(bs_), nblocks(nblocks_), dt(dt_) {
    for (int32_t l = 0; l < L; ++l) {
      layers.emplace_back(2 * block_bytes() * static_cast<size_t>(nblocks), 0xA5);
      kb.push_back(layers.back().data());
      vb.push_back(layers.back().data() + block_bytes() * static_cast<size_t>(nblocks));
    }
    desc.num_layers = L;
    desc.kv_heads = heads;
    desc.head_dim = hd;
    desc.dtype = dt;
    desc.block_size = bs;
    desc.num_blocks = nblocks;
    desc.k_layers = kb.data();
    desc.v_layers = vb.data();
  }
  ~HostPool() {
    if (pool != nullptr) kvxfer_kv_pool_deregister(pool);
  }
  size_t es() const { return codec::dtype_size(dt); }
  size_t row_bytes() const { return static_cast<size_t>(heads) * hd * es(); }
  size_t block_bytes() const { return row_bytes() * static_cast<size_t>(bs); }
  bool reg() { return kvxfer_kv_pool_register(&desc, &pool) == KVXFER_SUCCESS; }
  uint8_t* row(int32_t l, kvxfer_kv_kind_t kind, int32_t id, int64_t r) {
    uint8_t* base = static_cast<uint8_t*>(kind == KVXFER_KV_KEY ? kb[l] : vb[l]);
    return base + static_cast<size_t>(id) * block_bytes() + static_cast<size_t>(r) * row_bytes();
  }
  /** Token t of a request on `ids`, heads from `h0` on. */
  uint8_t* token(int32_t l, kvxfer_kv_kind_t kind, const std::vector<int32_t>& ids, int64_t t,
                 int32_t h0 = 0) {
    return row(l, kind, ids[static_cast<size_t>(t / bs)], t % bs) +
           static_cast<size_t>(h0) * hd * es();
  }
  /** Layer l of `src` (its heads are heads [h0, h0 + src.heads) here) into the blocks `ids`. */
  void put_layer(PagedKV& src, int32_t l, const std::vector<int32_t>& ids, int32_t h0 = 0) {
    const size_t n = static_cast<size_t>(src.H()) * es();
    for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
      for (int64_t t = 0; t < src.T; ++t)
        std::memcpy(token(l, kind, ids, t, h0), src.row(l, kind, t), n);
  }
  void put(PagedKV& src, const std::vector<int32_t>& ids, int32_t h0 = 0) {
    for (int32_t l = 0; l < src.L; ++l) put_layer(src, l, ids, h0);
  }
  /** Every token of every layer on `ids`, heads [h0, h0 + want.heads), equal to `want`. */
  void expect_equal(PagedKV& want, const std::vector<int32_t>& ids, int32_t h0, const char* what) {
    const size_t n = static_cast<size_t>(want.H()) * es();
    for (int32_t l = 0; l < want.L; ++l)
      for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
        for (int64_t t = 0; t < want.T; ++t)
          ASSERT_EQ(std::memcmp(token(l, kind, ids, t, h0), want.row(l, kind, t), n), 0)
              << what << ": layer " << l << (kind == KVXFER_KV_KEY ? " K" : " V") << " token " << t
              << " heads from " << h0;
  }
};

/** `n` distinct block ids of [0, nblocks), shuffled (a runtime's free list). */
std::vector<int32_t> shuffled_ids(int64_t nblocks, size_t n, uint64_t seed) {
  std::vector<int32_t> all(static_cast<size_t>(nblocks));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), std::mt19937_64(seed));
  all.resize(n);
  return all;
}

kvxfer_kv_blocks_t blocks_of(const std::vector<int32_t>& ids, int64_t T, int32_t h0 = 0,
                             int32_t nh = 0) {
  kvxfer_kv_blocks_t b = KVXFER_KV_BLOCKS_INITIALIZER;
  b.num_tokens = T;
  b.block_ids = ids.data();
  b.num_block_ids = static_cast<int64_t>(ids.size());
  b.head_begin = h0;
  b.num_heads = nh;
  return b;
}

kvxfer_comm_t init_n(const kvxfer_unique_id_t& id, int nranks, int rank,
                     int timeout_ms = kTimeoutMs) {
  kvxfer_comm_config_t cfg = KVXFER_COMM_CONFIG_INITIALIZER;
  cfg.timeout_ms = timeout_ms;
  cfg.bind_address = "127.0.0.1";
  kvxfer_comm_t comm = nullptr;
  if (kvxfer_comm_init(&comm, nranks, id, rank, &cfg) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "rank %d: kvxfer_comm_init: %s\n", rank, kvxfer_get_last_error());
    return nullptr;
  }
  return comm;
}

constexpr int32_t kL = 3, kHd = 64, kBs = 16, kPageTokens = 128;
constexpr int64_t kT = 300, kPoolBlocks = 64;
constexpr uint64_t kTag = 7;

kvxfer_request_config_t request_config(int32_t stream_layers = 0) {
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.page_tokens = kPageTokens;
  rc.tag = kTag;
  rc.stream_layers = stream_layers;
  return rc;
}

// ---------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------
TEST(KvPool, RegistersAndRefusesBadFieldsNamingThem) {
  HostPool p(kL, 2, kHd, kBs, kPoolBlocks);
  ASSERT_TRUE(p.reg()) << kvxfer_get_last_error();
  EXPECT_EQ(kvxfer_kv_pool_deregister(p.pool), KVXFER_SUCCESS);
  p.pool = nullptr;
  EXPECT_EQ(kvxfer_kv_pool_deregister(nullptr), KVXFER_SUCCESS);

  auto refused = [&](kvxfer_kv_pool_desc_t d, const char* words) {
    kvxfer_kv_pool_t out = reinterpret_cast<kvxfer_kv_pool_t>(0x1);
    EXPECT_EQ(kvxfer_kv_pool_register(&d, &out), KVXFER_ERR_INVALID_ARGUMENT) << words;
    EXPECT_EQ(out, nullptr) << words;
    EXPECT_NE(std::string(kvxfer_get_last_error()).find(words), std::string::npos)
        << kvxfer_get_last_error();
  };
  kvxfer_kv_pool_desc_t d = p.desc;
  d.size = 8;
  refused(d, "not initialised");
  d = p.desc;
  d.num_layers = 0;
  refused(d, "num_layers 0");
  d = p.desc;
  d.block_stride = static_cast<int64_t>(p.block_bytes()) - 2;
  refused(d, "block_stride");
  d = p.desc;
  d.v_layers = nullptr;
  refused(d, "k_layers and v_layers");
  d = p.desc;
  d.head_dim = 0;
  refused(d, "head_dim 0");
  // Sizes whose product wraps int64 (2^30 rows of 2^40 fp32 elements): refused
  // before any arithmetic on them, as in a request's descriptor.
  d = p.desc;
  d.block_size = 1 << 30;
  d.row_stride = int64_t{1} << 40;
  d.dtype = KVXFER_DTYPE_FP32;
  refused(d, "a block of 1073741824 rows of row_stride 1099511627776 exceeds 2^62 bytes");
  // A layer whose last block is not accessible memory (PROT_NONE: whatever
  // lies past a mapping may be mapped, under AddressSanitizer it is).
  const size_t layer = p.block_bytes() * static_cast<size_t>(kPoolBlocks);
  void* m = mmap(nullptr, layer, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(m, MAP_FAILED);
  ASSERT_EQ(
      mprotect(static_cast<uint8_t*>(m) + layer - p.block_bytes(), p.block_bytes(), PROT_NONE), 0);
  std::vector<void*> k = p.kb;
  k[1] = m;
  d = p.desc;
  d.k_layers = k.data();
  refused(d, "KV pool: layer 1 K block 63");
  munmap(m, layer);
  // K and V of a layer at the same place, or two layers sharing blocks: a
  // receive would write one over the other.
  d = p.desc;
  d.v_layers = p.kb.data();
  refused(d, "layer 0 K and layer 0 V overlap");
  std::vector<void*> v = p.vb;
  v[0] = static_cast<uint8_t*>(p.kb[1]) + p.block_bytes() / 2;
  d = p.desc;
  d.v_layers = v.data();
  refused(d, "overlap");
  // Interleaved K and V blocks (FlashInfer's [num_blocks][2][block] layout)
  // share no byte: accepted.
  std::vector<uint8_t> inter(2 * p.block_bytes() * kPoolBlocks * kL, 0);
  std::vector<void*> ik, iv;
  for (int32_t l = 0; l < kL; ++l) {
    ik.push_back(inter.data() + l * 2 * p.block_bytes() * kPoolBlocks);
    iv.push_back(static_cast<uint8_t*>(ik.back()) + p.block_bytes());
  }
  d = p.desc;
  d.k_layers = ik.data();
  d.v_layers = iv.data();
  d.block_stride = static_cast<int64_t>(2 * p.block_bytes());
  kvxfer_kv_pool_t ipool = nullptr;
  EXPECT_EQ(kvxfer_kv_pool_register(&d, &ipool), KVXFER_SUCCESS) << kvxfer_get_last_error();
  EXPECT_EQ(kvxfer_kv_pool_deregister(ipool), KVXFER_SUCCESS);
  // Interleaved K and V rows (vLLM 0.33's [num_blocks, heads, block_size,
  // K|V] per head): accepted; V half a row after K: refused.
  const int64_t row = static_cast<int64_t>(p.block_bytes()) / kBs;  // one K row's bytes
  d = p.desc;
  d.row_stride = 2 * p.desc.kv_heads * p.desc.head_dim;
  d.block_stride = 2 * row * kBs;
  d.k_layers = ik.data();
  std::vector<void*> rv;
  for (void* b : ik) rv.push_back(static_cast<uint8_t*>(b) + row);
  d.v_layers = rv.data();
  EXPECT_EQ(kvxfer_kv_pool_register(&d, &ipool), KVXFER_SUCCESS) << kvxfer_get_last_error();
  EXPECT_EQ(kvxfer_kv_pool_deregister(ipool), KVXFER_SUCCESS);
  for (void*& b : rv) b = static_cast<uint8_t*>(b) - row / 2;
  refused(d, "layer 0 K and layer 0 V overlap");
  // A pool on a device this process cannot use.
  d = p.desc;
  d.device = 7;
  kvxfer_kv_pool_t dpool = reinterpret_cast<kvxfer_kv_pool_t>(0x1);
  EXPECT_EQ(kvxfer_kv_pool_register(&d, &dpool), KVXFER_ERR_UNSUPPORTED) << kvxfer_get_last_error();
  EXPECT_EQ(dpool, nullptr);
  EXPECT_EQ(kvxfer_kv_pool_register(nullptr, &p.pool), KVXFER_ERR_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// Block-id requests between two processes
// ---------------------------------------------------------------------------
/** The sender child: a pool of `heads` heads holding `src`'s values at shuffled ids. */
int send_blocks_child(const kvxfer_unique_id_t& id, int nranks, int rank, int wr, int32_t heads,
                      uint64_t seed, const kvxfer_codec_config_t& cfg) {
  kvxfer_comm_t comm = init_n(id, nranks, rank);
  if (comm == nullptr) return 10;
  PagedKV src(kL, heads, kHd, kT, kBs);
  src.fill(seed);
  HostPool pool(kL, heads, kHd, kBs, kPoolBlocks);
  if (!pool.reg()) return 11;
  const std::vector<int32_t> ids = shuffled_ids(kPoolBlocks, (kT + kBs - 1) / kBs, seed);
  pool.put(src, ids);
  const kvxfer_kv_blocks_t b = blocks_of(ids, kT);
  const kvxfer_request_config_t rc = request_config();
  kvxfer_request_t req = nullptr;
  if (kvxfer_send_blocks(comm, 0, pool.pool, &b, &cfg, &rc, &req) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "send_blocks: %s\n", kvxfer_get_last_error());
    return 12;
  }
  const kvxfer_result_t r = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000);
  if (r != KVXFER_SUCCESS) return 13;
  write_report(wr, req, "");
  kvxfer_request_free(req);
  kvxfer_comm_destroy(comm);
  return 0;
}

void blocks_round_trip(const kvxfer_codec_config_t& cfg) {
  const uint64_t seed = 99;
  Pair pair;
  ASSERT_TRUE(pair.start([&](const kvxfer_unique_id_t& id, int, int wr) {
    return send_blocks_child(id, 2, 1, wr, 2, seed, cfg);
  }));
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  HostPool pool(kL, 2, kHd, kBs, kPoolBlocks);
  ASSERT_TRUE(pool.reg()) << kvxfer_get_last_error();
  const std::vector<int32_t> ids = shuffled_ids(kPoolBlocks, (kT + kBs - 1) / kBs, seed + 1);
  const kvxfer_kv_blocks_t b = blocks_of(ids, kT);
  const kvxfer_request_config_t rc = request_config();
  kvxfer_request_t req = nullptr;
  ASSERT_EQ(kvxfer_recv_blocks(comm, 1, pool.pool, &b, &rc, &req), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  PagedKV src(kL, 2, kHd, kT, kBs);
  src.fill(seed);
  PagedKV want(kL, 2, kHd, kT, kBs);
  expected_decode(src, cfg, kPageTokens, kTag, true, &want);
  pool.expect_equal(want, ids, 0, "full");
  SenderReport rep;
  ASSERT_TRUE(read_report(pair.child.from_child, &rep));
  const kvxfer_request_info_t end = info_of(req);
  EXPECT_EQ(rep.anchor, end.anchor_wire_bytes);
  EXPECT_EQ(rep.residual, end.residual_wire_bytes);
  EXPECT_EQ(kvxfer_request_free(req), KVXFER_SUCCESS);
  finish(&pair, comm);
}

TEST(KvPool, BlocksRoundTripLynxBitExact) { blocks_round_trip(KVXFER_CODEC_CONFIG_INITIALIZER); }

TEST(KvPool, BlocksRoundTripBf16Lossless) {
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  cfg.codec = KVXFER_CODEC_BF16;
  blocks_round_trip(cfg);
}

// Prefill TP 2 into decode TP 1: ranks 1 and 2 hold 2 KV heads each; rank 0
// holds all 4 in one pool and receives each prefill rank's heads into the
// same blocks (vLLM's NixlConnector with a larger decode TP).
void heterogeneous_tp(const kvxfer_codec_config_t& cfg) {
  kvxfer_unique_id_t id{};
  ASSERT_EQ(kvxfer_get_unique_id(&id), KVXFER_SUCCESS);
  test::Child c1, c2;
  const uint64_t seed = 500;
  ASSERT_TRUE(c1.start([&](int, int wr) { return send_blocks_child(id, 3, 1, wr, 2, seed, cfg); }));
  ASSERT_TRUE(
      c2.start([&](int, int wr) { return send_blocks_child(id, 3, 2, wr, 2, seed + 1, cfg); }));
  kvxfer_comm_t comm = init_n(id, 3, 0);
  ASSERT_NE(comm, nullptr);
  HostPool pool(kL, 4, kHd, kBs, kPoolBlocks);
  ASSERT_TRUE(pool.reg()) << kvxfer_get_last_error();
  const std::vector<int32_t> ids = shuffled_ids(kPoolBlocks, (kT + kBs - 1) / kBs, 3);
  const kvxfer_request_config_t rc = request_config();
  kvxfer_request_t req[2] = {nullptr, nullptr};
  for (int r = 0; r < 2; ++r) {
    const kvxfer_kv_blocks_t b = blocks_of(ids, kT, 2 * r, 2);
    ASSERT_EQ(kvxfer_recv_blocks(comm, r + 1, pool.pool, &b, &rc, &req[r]), KVXFER_SUCCESS)
        << kvxfer_get_last_error();
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(kvxfer_wait(req[r], KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
        << kvxfer_get_last_error();
    PagedKV src(kL, 2, kHd, kT, kBs);
    src.fill(seed + static_cast<uint64_t>(r));
    PagedKV want(kL, 2, kHd, kT, kBs);
    expected_decode(src, cfg, kPageTokens, kTag, true, &want);
    pool.expect_equal(want, ids, 2 * r, "prefill rank");
    EXPECT_EQ(kvxfer_request_free(req[r]), KVXFER_SUCCESS);
  }
  kvxfer_comm_destroy(comm);
  ASSERT_TRUE(c1.wait(60));
  ASSERT_TRUE(c2.wait(60));
  EXPECT_EQ(WEXITSTATUS(c1.status), 0);
  EXPECT_EQ(WEXITSTATUS(c2.status), 0);
}

TEST(KvPool, PrefillTp2IntoDecodeTp1Bf16) {
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  cfg.codec = KVXFER_CODEC_BF16;
  heterogeneous_tp(cfg);
}

TEST(KvPool, PrefillTp2IntoDecodeTp1Lynx) { heterogeneous_tp(KVXFER_CODEC_CONFIG_INITIALIZER); }

TEST(KvPool, BadBlockIdsAndHeadRangesFailAtTheCallNamingThem) {
  Pair pair;
  ASSERT_TRUE(pair.start(idle_peer));
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  HostPool pool(kL, 2, kHd, kBs, kPoolBlocks);
  ASSERT_TRUE(pool.reg());
  std::vector<int32_t> ids = shuffled_ids(kPoolBlocks, 19, 1);
  auto refused = [&](const kvxfer_kv_blocks_t& b, const char* words) {
    kvxfer_request_t req = reinterpret_cast<kvxfer_request_t>(0x1);
    EXPECT_EQ(kvxfer_recv_blocks(comm, 1, pool.pool, &b, nullptr, &req),
              KVXFER_ERR_INVALID_ARGUMENT)
        << words;
    EXPECT_EQ(req, nullptr);
    EXPECT_NE(std::string(kvxfer_get_last_error()).find(words), std::string::npos)
        << kvxfer_get_last_error();
  };
  const int32_t id3 = ids[3];
  ids[3] = kPoolBlocks;
  refused(blocks_of(ids, kT), "block_ids[3] = 64 is not a block of the pool");
  ids[3] = -1;
  refused(blocks_of(ids, kT), "block_ids[3] = -1");
  ids[3] = id3;
  std::vector<int32_t> few(ids.begin(), ids.begin() + 10);
  refused(blocks_of(few, kT), "num_block_ids 10 cannot hold 300 tokens");
  refused(blocks_of(ids, kT, 1, 2), "heads [1, 1 + 2) are outside the pool's 2 KV heads");
  refused(blocks_of(ids, kT, 2, 0), "heads [2");
  std::vector<int32_t> twice = ids;
  twice[7] = twice[2];
  refused(blocks_of(twice, kT), "block_ids[2] and block_ids[7] are both block");
  kvxfer_kv_blocks_t b = blocks_of(ids, kT);
  b.magic = 0;
  refused(b, "not initialised");
  kvxfer_request_t req = nullptr;
  EXPECT_EQ(kvxfer_recv_blocks(comm, 1, nullptr, &b, nullptr, &req), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(release_idle_peer(&pair));
  kvxfer_comm_destroy(comm);
}

TEST(KvPool, DeregisterIsRefusedWhileARequestUsesThePool) {
  Pair pair;
  ASSERT_TRUE(pair.start(idle_peer));
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  HostPool pool(kL, 2, kHd, kBs, kPoolBlocks);
  ASSERT_TRUE(pool.reg());
  const std::vector<int32_t> ids = shuffled_ids(kPoolBlocks, 19, 1);
  const kvxfer_kv_blocks_t b = blocks_of(ids, kT);
  kvxfer_request_t req = nullptr;
  ASSERT_EQ(kvxfer_recv_blocks(comm, 1, pool.pool, &b, nullptr, &req), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_kv_pool_deregister(pool.pool), KVXFER_ERR_INVALID_USAGE);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("1 request(s)"), std::string::npos)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_request_cancel(req), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 20000), KVXFER_ERR_CANCELLED);
  EXPECT_EQ(kvxfer_kv_pool_deregister(pool.pool), KVXFER_SUCCESS) << kvxfer_get_last_error();
  pool.pool = nullptr;
  EXPECT_EQ(kvxfer_request_free(req), KVXFER_SUCCESS);
  EXPECT_TRUE(release_idle_peer(&pair));
  kvxfer_comm_destroy(comm);
}

// ---------------------------------------------------------------------------
// Layer-streamed sends
// ---------------------------------------------------------------------------
/**
 * The streaming sender: posts before its KV exists, then writes and marks
 * layers 0 .. L-2, waits for the parent's byte, and only then writes and
 * marks the last layer.
 */
int streamed_sender(const kvxfer_unique_id_t& id, int rd, uint64_t seed,
                    const kvxfer_codec_config_t& cfg) {
  kvxfer_comm_t comm = init_rank(id, 1);
  if (comm == nullptr) return 10;
  PagedKV src(kL, 2, kHd, kT, kBs);
  src.fill(seed);
  PagedKV kv(kL, 2, kHd, kT, kBs);  // 0xA5 until each layer is written
  const kvxfer_request_config_t rc = request_config(1);
  kvxfer_request_t req = nullptr;
  if (kvxfer_send(comm, 0, &kv.desc, &cfg, &rc, &req) != KVXFER_SUCCESS) return 11;
  auto write_layer = [&](int32_t l) {
    for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
      for (int64_t t = 0; t < kT; ++t)
        std::memcpy(kv.row(l, kind, t), src.row(l, kind, t), static_cast<size_t>(src.H()) * 2);
    return kvxfer_send_layer_ready(req, l) == KVXFER_SUCCESS;
  };
  for (int32_t l = 0; l + 1 < kL; ++l)
    if (!write_layer(l)) return 12;
  if (kvxfer_send_layer_ready(req, 0) != KVXFER_SUCCESS) return 13;  // twice: no change
  char go;
  if (!fdio::read_all(rd, &go, 1)) return 14;
  if (!write_layer(kL - 1)) return 15;
  if (kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000) != KVXFER_SUCCESS) return 16;
  kvxfer_request_free(req);
  kvxfer_comm_destroy(comm);
  return 0;
}

void streamed(const kvxfer_codec_config_t& cfg) {
  const uint64_t seed = 77;
  Pair pair;
  ASSERT_TRUE(pair.start([&](const kvxfer_unique_id_t& id, int rd, int) {
    return streamed_sender(id, rd, seed, cfg);
  }));
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  PagedKV dst(kL, 2, kHd, kT, 32);
  const kvxfer_request_config_t rc = request_config();
  kvxfer_request_t req = nullptr;
  ASSERT_EQ(kvxfer_recv(comm, 1, &dst.desc, &rc, &req), KVXFER_SUCCESS) << kvxfer_get_last_error();
  // Every layer but the last arrives while the last does not exist yet.
  ASSERT_EQ(kvxfer_wait_layer(req, kL - 2, KVXFER_STAGE_ANCHOR_READY, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kvxfer_stage_t st;
  EXPECT_EQ(kvxfer_test_layer(req, kL - 1, &st), KVXFER_IN_PROGRESS);
  EXPECT_EQ(st, KVXFER_STAGE_POSTED);
  EXPECT_EQ(kvxfer_test(req, &st), KVXFER_IN_PROGRESS);
  EXPECT_EQ(st, KVXFER_STAGE_POSTED);
  ASSERT_TRUE(fdio::write_all(pair.child.to_child, "g", 1));
  ASSERT_EQ(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  PagedKV src(kL, 2, kHd, kT, kBs);
  src.fill(seed);
  PagedKV want(kL, 2, kHd, kT, kBs);
  expected_decode(src, cfg, kPageTokens, kTag, true, &want);
  for (int32_t l = 0; l < kL; ++l)
    for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
      ASSERT_EQ(dst.bytes(l, kind), want.bytes(l, kind)) << "layer " << l;
  EXPECT_EQ(kvxfer_request_free(req), KVXFER_SUCCESS);
  finish(&pair, comm);
}

TEST(KvStream, LayersLeaveAsTheyAreMarkedLynxBitExact) {
  streamed(KVXFER_CODEC_CONFIG_INITIALIZER);
}

TEST(KvStream, LayersLeaveAsTheyAreMarkedBf16) {
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  cfg.codec = KVXFER_CODEC_BF16;
  streamed(cfg);
}

// A layer never marked: the sender fails with TIMEOUT naming it, and the
// receiver hears of it.
int never_marking_sender(const kvxfer_unique_id_t& id, int wr) {
  kvxfer_comm_t comm = init_rank(id, 1, kShortTimeoutMs);
  if (comm == nullptr) return 10;
  PagedKV kv(kL, 2, kHd, kT, kBs);
  const kvxfer_request_config_t rc = request_config(1);
  kvxfer_request_t req = nullptr;
  if (kvxfer_send(comm, 0, &kv.desc, nullptr, &rc, &req) != KVXFER_SUCCESS) return 11;
  if (kvxfer_send_layer_ready(req, 0) != KVXFER_SUCCESS) return 12;
  const auto t0 = std::chrono::steady_clock::now();
  const kvxfer_result_t r = kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  write_report(wr, req, kvxfer_get_last_error());
  kvxfer_request_free(req);
  kvxfer_comm_destroy(comm);
  if (r != KVXFER_ERR_TIMEOUT) return 13;
  return s < kShortTimeoutMs / 1000.0 + 3 ? 0 : 14;
}

TEST(KvStream, ALayerNeverMarkedTimesOutNamingIt) {
  Pair pair;
  ASSERT_TRUE(pair.start(
      [&](const kvxfer_unique_id_t& id, int, int wr) { return never_marking_sender(id, wr); }));
  // The receiver's own timeout is longer: the sender's layer timeout is what ends it.
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  PagedKV dst(kL, 2, kHd, kT, 32);
  const kvxfer_request_config_t rc = request_config();
  kvxfer_request_t req = nullptr;
  ASSERT_EQ(kvxfer_recv(comm, 1, &dst.desc, &rc, &req), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000), KVXFER_ERR_TIMEOUT);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("layer 1 was not marked ready"),
            std::string::npos)
      << kvxfer_get_last_error();
  SenderReport rep;
  ASSERT_TRUE(read_report(pair.child.from_child, &rep));
  EXPECT_NE(rep.error.find("layer 1 was not marked ready"), std::string::npos) << rep.error;
  EXPECT_EQ(kvxfer_request_free(req), KVXFER_SUCCESS);
  finish(&pair, comm);
}

// Two streamed sends to one peer: A marks a layer every 3 s (within the 4 s
// timeout), B is queued behind A and never marked.  B fails within the
// timeout of its post, while A is still sending, not once A is done.
int queued_streams_sender(const kvxfer_unique_id_t& id, int wr) {
  kvxfer_comm_t comm = init_rank(id, 1, kShortTimeoutMs);
  if (comm == nullptr) return 10;
  PagedKV a(kL, 2, kHd, kT, kBs), b(kL, 2, kHd, kT, kBs);
  const kvxfer_request_config_t rc = request_config(1);
  kvxfer_request_t ra = nullptr, rb = nullptr;
  if (kvxfer_send(comm, 0, &a.desc, nullptr, &rc, &ra) != KVXFER_SUCCESS ||
      kvxfer_send(comm, 0, &b.desc, nullptr, &rc, &rb) != KVXFER_SUCCESS)
    return 11;
  const auto t0 = std::chrono::steady_clock::now();
  double b_failed_s = -1;
  for (int32_t l = 0; l < kL; ++l) {
    if (l > 0) {
      const auto next = t0 + std::chrono::seconds(3 * l);
      while (std::chrono::steady_clock::now() < next) {
        kvxfer_stage_t st;
        if (b_failed_s < 0 && kvxfer_test(rb, &st) == KVXFER_ERR_TIMEOUT)
          b_failed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    if (kvxfer_send_layer_ready(ra, l) != KVXFER_SUCCESS) return 12;
  }
  const kvxfer_result_t a_rc = kvxfer_wait(ra, KVXFER_STAGE_COMPLETE, 60000);
  const kvxfer_result_t b_rc = kvxfer_wait(rb, KVXFER_STAGE_COMPLETE, 60000);
  const std::string b_err = kvxfer_get_last_error();
  write_report(wr, rb, b_err);
  kvxfer_request_free(ra);
  kvxfer_request_free(rb);
  kvxfer_comm_destroy(comm);
  if (a_rc != KVXFER_SUCCESS) return 13;
  if (b_rc != KVXFER_ERR_TIMEOUT) return 14;
  // B's timeout is 4 s from its post; A's last layer goes at 6 s.
  return b_failed_s > 0 && b_failed_s < 5.5 ? 0 : 15;
}

TEST(KvStream, AQueuedStreamedSendTimesOutFromItsPost) {
  Pair pair;
  ASSERT_TRUE(pair.start(
      [&](const kvxfer_unique_id_t& id, int, int wr) { return queued_streams_sender(id, wr); }));
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  PagedKV a(kL, 2, kHd, kT, 32), b(kL, 2, kHd, kT, 32);
  const kvxfer_request_config_t rc = request_config();
  kvxfer_request_t ra = nullptr, rb = nullptr;
  ASSERT_EQ(kvxfer_recv(comm, 1, &a.desc, &rc, &ra), KVXFER_SUCCESS);
  ASSERT_EQ(kvxfer_recv(comm, 1, &b.desc, &rc, &rb), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_wait(ra, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  EXPECT_EQ(kvxfer_wait(rb, KVXFER_STAGE_COMPLETE, 60000), KVXFER_ERR_TIMEOUT);
  SenderReport rep;
  ASSERT_TRUE(read_report(pair.child.from_child, &rep));
  EXPECT_NE(rep.error.find("layer 0 was not marked ready"), std::string::npos) << rep.error;
  EXPECT_EQ(kvxfer_request_free(ra), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_request_free(rb), KVXFER_SUCCESS);
  finish(&pair, comm);
}

TEST(KvStream, MisuseIsRefusedAtTheCall) {
  Pair pair;
  ASSERT_TRUE(pair.start(idle_peer));
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  PagedKV kv(kL, 2, kHd, kT, kBs);
  kvxfer_request_config_t rc = request_config(2);
  kvxfer_request_t req = nullptr;
  EXPECT_EQ(kvxfer_send(comm, 1, &kv.desc, nullptr, &rc, &req), KVXFER_ERR_INVALID_ARGUMENT);
  rc.stream_layers = 1;
  EXPECT_EQ(kvxfer_recv(comm, 1, &kv.desc, &rc, &req), KVXFER_ERR_INVALID_ARGUMENT);
  kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  cfg.alpha = KVXFER_ALPHA_AUTO;
  EXPECT_EQ(kvxfer_send(comm, 1, &kv.desc, &cfg, &rc, &req), KVXFER_ERR_UNSUPPORTED);
  cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  cfg.codec = KVXFER_CODEC_SPECTRUM;
  EXPECT_EQ(kvxfer_send(comm, 1, &kv.desc, &cfg, &rc, &req), KVXFER_ERR_UNSUPPORTED);
  EXPECT_EQ(kvxfer_send_layer_ready(nullptr, 0), KVXFER_ERR_INVALID_ARGUMENT);
  // A plain send and a receive cannot be marked; a streamed send checks the layer.
  kvxfer_request_config_t plain = request_config();
  kvxfer_request_t s = nullptr, r = nullptr, st = nullptr;
  ASSERT_EQ(kvxfer_send(comm, 1, &kv.desc, nullptr, &plain, &s), KVXFER_SUCCESS);
  ASSERT_EQ(kvxfer_recv(comm, 1, &kv.desc, &plain, &r), KVXFER_SUCCESS);
  ASSERT_EQ(kvxfer_send(comm, 1, &kv.desc, nullptr, &rc, &st), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_send_layer_ready(s, 0), KVXFER_ERR_INVALID_USAGE);
  EXPECT_EQ(kvxfer_send_layer_ready(r, 0), KVXFER_ERR_INVALID_USAGE);
  EXPECT_EQ(kvxfer_send_layer_ready(st, kL), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kvxfer_send_layer_ready(st, -1), KVXFER_ERR_INVALID_ARGUMENT);
  for (kvxfer_request_t q : {s, r, st}) {
    kvxfer_request_cancel(q);
    EXPECT_EQ(kvxfer_wait(q, KVXFER_STAGE_COMPLETE, 20000), KVXFER_ERR_CANCELLED);
    EXPECT_EQ(kvxfer_send_layer_ready(st, 1), KVXFER_SUCCESS);  // final: no change
    EXPECT_EQ(kvxfer_request_free(q), KVXFER_SUCCESS);
  }
  EXPECT_TRUE(release_idle_peer(&pair));
  kvxfer_comm_destroy(comm);
}

// ---------------------------------------------------------------------------
// Requests matched by id
// ---------------------------------------------------------------------------
kvxfer_request_config_t by_id(uint64_t id) {
  kvxfer_request_config_t rc = request_config();
  rc.match_by_id = 1;
  rc.request_id = id;
  return rc;
}

/**
 * Sends `ids` (seed = id) to rank 0 in this order, waiting for a byte on `rd`
 * before `late`; after `plain_after` (if one of them) an order-matched send
 * of seed kPlainSeed.
 */
constexpr uint64_t kPlainSeed = 1000;
int by_id_sender(const kvxfer_unique_id_t& id, int rd, int wr, const std::vector<uint64_t>& ids,
                 uint64_t late, const kvxfer_codec_config_t& cfg, uint64_t plain_after = 0,
                 int timeout_ms = kTimeoutMs) {
  kvxfer_comm_t comm = init_rank(id, 1, timeout_ms);
  if (comm == nullptr) return 10;
  std::vector<std::unique_ptr<PagedKV>> kv;
  std::vector<kvxfer_request_t> req;
  for (uint64_t i : ids) {
    if (i == late) {
      char b;
      if (!fdio::read_all(rd, &b, 1)) return 11;
    }
    kv.push_back(std::make_unique<PagedKV>(kL, 2, kHd, kT, kBs));
    kv.back()->fill(i);
    const kvxfer_request_config_t rc = by_id(i);
    kvxfer_request_t r = nullptr;
    if (kvxfer_send(comm, 0, &kv.back()->desc, &cfg, &rc, &r) != KVXFER_SUCCESS) return 12;
    req.push_back(r);
    if (i != plain_after) continue;
    kv.push_back(std::make_unique<PagedKV>(kL, 2, kHd, kT, kBs));
    kv.back()->fill(kPlainSeed);
    const kvxfer_request_config_t plain = request_config();
    if (kvxfer_send(comm, 0, &kv.back()->desc, &cfg, &plain, &r) != KVXFER_SUCCESS) return 14;
    req.push_back(r);
  }
  fdio::write_all(wr, "p", 1);  // all posted
  int st = 0;
  for (kvxfer_request_t r : req) {
    const kvxfer_result_t w = kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000);
    const std::string err = w == KVXFER_SUCCESS ? "" : kvxfer_get_last_error();
    write_report(wr, r, err);
    if (w != KVXFER_SUCCESS && w != KVXFER_ERR_CANCELLED) st = 13;
    kvxfer_request_free(r);
  }
  kvxfer_comm_destroy(comm);
  return st;
}

// The sender posts 11, 22, an order-matched send, 33 and 44 (44 only once the
// receiver says so); the receiver posts the order-matched receive, then 44
// (before its send exists), 33, 11 and 22.  Each lands exactly.
TEST(KvById, PostsInAnyOrderOnEitherSideMatchTheirIds) {
  const kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  const std::vector<uint64_t> ids{11, 22, 33, 44};
  Pair pair;
  ASSERT_TRUE(pair.start([&](const kvxfer_unique_id_t& id, int rd, int wr) {
    return by_id_sender(id, rd, wr, ids, 44, cfg, 22);
  }));
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  std::map<uint64_t, std::unique_ptr<PagedKV>> dst;
  std::map<uint64_t, kvxfer_request_t> req;
  dst[kPlainSeed] = std::make_unique<PagedKV>(kL, 2, kHd, kT, 32);
  const kvxfer_request_config_t plain = request_config();
  ASSERT_EQ(kvxfer_recv(comm, 1, &dst[kPlainSeed]->desc, &plain, &req[kPlainSeed]), KVXFER_SUCCESS);
  for (uint64_t i : {44, 33, 11, 22}) {
    dst[i] = std::make_unique<PagedKV>(kL, 2, kHd, kT, 32);
    const kvxfer_request_config_t rc = by_id(i);
    ASSERT_EQ(kvxfer_recv(comm, 1, &dst[i]->desc, &rc, &req[i]), KVXFER_SUCCESS)
        << kvxfer_get_last_error();
    if (i == 44) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  // 11, 22 and 33 complete while 44 has not been sent.
  for (uint64_t i : {uint64_t{11}, uint64_t{22}, kPlainSeed, uint64_t{33}})
    ASSERT_EQ(kvxfer_wait(req[i], KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
        << "id " << i << ": " << kvxfer_get_last_error();
  kvxfer_stage_t st;
  EXPECT_EQ(kvxfer_test(req[44], &st), KVXFER_IN_PROGRESS);
  ASSERT_TRUE(fdio::write_all(pair.child.to_child, "g", 1));
  ASSERT_EQ(kvxfer_wait(req[44], KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  char b;
  ASSERT_TRUE(fdio::read_all(pair.child.from_child, &b, 1));
  for (uint64_t i : {uint64_t{11}, uint64_t{22}, kPlainSeed, uint64_t{33}, uint64_t{44}}) {
    PagedKV src(kL, 2, kHd, kT, kBs);
    src.fill(i);
    PagedKV want(kL, 2, kHd, kT, kBs);
    expected_decode(src, cfg, kPageTokens, kTag, true, &want);
    for (int32_t l = 0; l < kL; ++l)
      for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
        ASSERT_EQ(dst[i]->bytes(l, kind), want.bytes(l, kind)) << "id " << i << ", layer " << l;
    SenderReport rep;
    ASSERT_TRUE(read_report(pair.child.from_child, &rep));
    EXPECT_EQ(kvxfer_request_free(req[i]), KVXFER_SUCCESS);
  }
  finish(&pair, comm);
}

TEST(KvById, ADuplicateIdInFlightIsRefusedAtTheCall) {
  Pair pair;
  ASSERT_TRUE(pair.start(idle_peer));
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  PagedKV kv(kL, 2, kHd, kT, kBs);
  const kvxfer_request_config_t rc = by_id(7);
  kvxfer_request_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  ASSERT_EQ(kvxfer_recv(comm, 1, &kv.desc, &rc, &a), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_recv(comm, 1, &kv.desc, &rc, &b), KVXFER_ERR_INVALID_USAGE);
  EXPECT_NE(std::string(kvxfer_get_last_error())
                .find("a kvxfer_recv with request id 7 is already in flight with peer 1"),
            std::string::npos)
      << kvxfer_get_last_error();
  EXPECT_EQ(b, nullptr);
  ASSERT_EQ(kvxfer_send(comm, 1, &kv.desc, nullptr, &rc, &c), KVXFER_SUCCESS);  // other way
  EXPECT_EQ(kvxfer_send(comm, 1, &kv.desc, nullptr, &rc, &d), KVXFER_ERR_INVALID_USAGE);
  kvxfer_request_config_t bad = rc;
  bad.match_by_id = 2;
  EXPECT_EQ(kvxfer_recv(comm, 1, &kv.desc, &bad, &d), KVXFER_ERR_INVALID_ARGUMENT);
  for (kvxfer_request_t q : {a, c}) {
    kvxfer_request_cancel(q);
    EXPECT_EQ(kvxfer_wait(q, KVXFER_STAGE_COMPLETE, 20000), KVXFER_ERR_CANCELLED);
    EXPECT_EQ(kvxfer_request_free(q), KVXFER_SUCCESS);
  }
  EXPECT_TRUE(release_idle_peer(&pair));
  kvxfer_comm_destroy(comm);
}

// A receive by id cancelled before its sender posts: the sender, posting
// later, ends in ERROR with the cancel.
TEST(KvById, AReceiveCancelledBeforeItsSendTellsTheSender) {
  const kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  Pair pair;
  ASSERT_TRUE(pair.start([&](const kvxfer_unique_id_t& id, int rd, int wr) {
    return by_id_sender(id, rd, wr, {9}, 9, cfg);
  }));
  kvxfer_comm_t comm = init_rank(pair.id, 0);
  ASSERT_NE(comm, nullptr);
  PagedKV dst(kL, 2, kHd, kT, 32);
  const kvxfer_request_config_t rc = by_id(9);
  kvxfer_request_t req = nullptr;
  ASSERT_EQ(kvxfer_recv(comm, 1, &dst.desc, &rc, &req), KVXFER_SUCCESS);
  ASSERT_EQ(kvxfer_request_cancel(req), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 20000), KVXFER_ERR_CANCELLED);
  EXPECT_EQ(kvxfer_request_free(req), KVXFER_SUCCESS);
  ASSERT_TRUE(fdio::write_all(pair.child.to_child, "g", 1));
  char b;
  ASSERT_TRUE(fdio::read_all(pair.child.from_child, &b, 1));
  SenderReport rep;
  ASSERT_TRUE(read_report(pair.child.from_child, &rep));
  EXPECT_NE(rep.error.find("cancelled"), std::string::npos) << rep.error;
  finish(&pair, comm);
}

// A receive by id whose sender never posts fails with the timeout.
TEST(KvById, AReceiveWhoseSendNeverComesTimesOut) {
  Pair pair;
  ASSERT_TRUE(pair.start([](const kvxfer_unique_id_t& id, int rd, int) {
    kvxfer_comm_t c = init_rank(id, 1, kShortTimeoutMs);
    char b;
    fdio::read_all(rd, &b, 1);
    kvxfer_comm_destroy(c);
    return c != nullptr ? 0 : 1;
  }));
  kvxfer_comm_t comm = init_rank(pair.id, 0, kShortTimeoutMs);
  ASSERT_NE(comm, nullptr);
  PagedKV dst(kL, 2, kHd, kT, 32);
  const kvxfer_request_config_t rc = by_id(5);
  kvxfer_request_t req = nullptr;
  ASSERT_EQ(kvxfer_recv(comm, 1, &dst.desc, &rc, &req), KVXFER_SUCCESS);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(kvxfer_wait(req, KVXFER_STAGE_COMPLETE, 60000), KVXFER_ERR_TIMEOUT);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("never posted the matching kvxfer_send"),
            std::string::npos)
      << kvxfer_get_last_error();
  EXPECT_LT(s, kShortTimeoutMs / 1000.0 + 3);
  EXPECT_EQ(kvxfer_request_free(req), KVXFER_SUCCESS);
  fdio::write_all(pair.child.to_child, "x", 1);
  finish(&pair, comm);
}

// One request by id with `id` on `comm` to or from `peer`, waited for: a send
// of the KV filled with seed `id`, or a receive checked against the codec's
// decode of it.  True when it completes exactly.
bool exchange_one(kvxfer_comm_t comm, int peer, bool is_send, uint64_t id,
                  const kvxfer_codec_config_t& cfg) {
  const kvxfer_request_config_t rc = by_id(id);
  kvxfer_request_t r = nullptr;
  PagedKV src(kL, 2, kHd, kT, kBs), dst(kL, 2, kHd, kT, 32);
  src.fill(id);
  const kvxfer_result_t posted = is_send ? kvxfer_send(comm, peer, &src.desc, &cfg, &rc, &r)
                                         : kvxfer_recv(comm, peer, &dst.desc, &rc, &r);
  bool ok =
      posted == KVXFER_SUCCESS && kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000) == KVXFER_SUCCESS;
  if (ok && !is_send) {
    PagedKV want(kL, 2, kHd, kT, kBs);
    expected_decode(src, cfg, kPageTokens, kTag, true, &want);
    for (int32_t l = 0; l < kL; ++l)
      for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
        ok = ok && dst.bytes(l, kind) == want.bytes(l, kind);
  }
  if (r != nullptr) kvxfer_request_free(r);
  return ok;
}

// A request by id (id 5; a receive, or a send with `orphan_is_send`) that its
// peer never matches fails once it has waited the timeout, alone, while
// requests by other ids keep the link busy: one every timeout / 4 for 1.5
// timeouts, each exact, those posted just before its deadline included.
// `why`: what its error says.
void orphan_times_out_while_traffic_flows(bool orphan_is_send, const std::string& why) {
  const kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  constexpr int kRounds = 6;
  const auto gap = std::chrono::milliseconds(kShortTimeoutMs / 4);
  // The traffic goes the other way from the orphan; its sender keeps the pace.
  const bool parent_sends = orphan_is_send;
  Pair pair;
  ASSERT_TRUE(pair.start([&](const kvxfer_unique_id_t& id, int, int) -> int {
    kvxfer_comm_t c = init_rank(id, 1, kShortTimeoutMs);
    if (c == nullptr) return 1;
    int failed = 0;
    for (int i = 0; i < kRounds; ++i) {
      failed += !exchange_one(c, 0, !parent_sends, 100 + static_cast<uint64_t>(i), cfg);
      if (!parent_sends) std::this_thread::sleep_for(gap);
    }
    kvxfer_comm_destroy(c);
    return failed;
  }));
  kvxfer_comm_t comm = init_rank(pair.id, 0, kShortTimeoutMs);
  ASSERT_NE(comm, nullptr);
  PagedKV orphan(kL, 2, kHd, kT, kBs);
  orphan.fill(5);
  const kvxfer_request_config_t xc = by_id(5);
  kvxfer_request_t x = nullptr;
  ASSERT_EQ(orphan_is_send ? kvxfer_send(comm, 1, &orphan.desc, &cfg, &xc, &x)
                           : kvxfer_recv(comm, 1, &orphan.desc, &xc, &x),
            KVXFER_SUCCESS);
  for (int i = 0; i < kRounds; ++i) {
    ASSERT_TRUE(exchange_one(comm, 1, parent_sends, 100 + static_cast<uint64_t>(i), cfg))
        << "id " << 100 + i << ": " << kvxfer_get_last_error();
    if (parent_sends) std::this_thread::sleep_for(gap);
  }
  ASSERT_EQ(kvxfer_wait(x, KVXFER_STAGE_COMPLETE, 0), KVXFER_ERR_TIMEOUT) << "still waiting";
  EXPECT_NE(std::string(kvxfer_get_last_error()).find(why), std::string::npos)
      << kvxfer_get_last_error();
  kvxfer_request_info_t inf = KVXFER_REQUEST_INFO_INITIALIZER;
  ASSERT_EQ(kvxfer_request_get_info(x, &inf), KVXFER_SUCCESS);
  const double waited = (inf.t_error_ns - inf.t_posted_ns) / 1e9;
  EXPECT_GE(waited, kShortTimeoutMs / 1000.0) << "failed before its timeout";
  EXPECT_LT(waited, kShortTimeoutMs / 1000.0 + 1) << "failed late: the traffic held it off";
  EXPECT_EQ(kvxfer_request_free(x), KVXFER_SUCCESS);
  ASSERT_TRUE(pair.child.wait(60));
  EXPECT_EQ(WEXITSTATUS(pair.child.status), 0) << "the child's requests that failed";
  EXPECT_EQ(kvxfer_comm_destroy(comm), KVXFER_SUCCESS);
}

TEST(KvById, AWaitingReceiveTimesOutAloneWhileOtherRequestsFlow) {
  orphan_times_out_while_traffic_flows(false,
                                       "peer 1 never posted the matching kvxfer_send "
                                       "(request id 5)");
}

// The receiver refuses the announcement no receive took, and its reason
// reaches the sender.
TEST(KvById, AnUnmatchedSendTimesOutWhileOtherRequestsFlow) {
  orphan_times_out_while_traffic_flows(true, "no kvxfer_recv by request id 5");
}

// ---------------------------------------------------------------------------
// The environment is read once per process: this case runs in a re-executed child.
// ---------------------------------------------------------------------------
// In the child: a malformed variable fails every call before its body runs;
// the outputs a call empties on failure read empty all the same.
[[noreturn]] void ExpectOutputsResetUnderMalformedEnvironment() {
  setenv("KVXFER_CODEC_IMPL", "sse9", 1);
  auto* const junk = reinterpret_cast<void*>(0x1);
  kvxfer_comm_t comm = static_cast<kvxfer_comm_t>(junk), ep = static_cast<kvxfer_comm_t>(junk);
  kvxfer_kv_pool_t pool = static_cast<kvxfer_kv_pool_t>(junk);
  kvxfer_request_t req[4];
  for (auto& r : req) r = static_cast<kvxfer_request_t>(junk);
  kvxfer_unique_id_t id{};
  int bad = 0;
  bad += kvxfer_comm_init(&comm, 2, id, 0, nullptr) != KVXFER_ERR_INVALID_ARGUMENT;
  bad += kvxfer_endpoint_create(&ep, nullptr) != KVXFER_ERR_INVALID_ARGUMENT;
  bad += kvxfer_kv_pool_register(nullptr, &pool) != KVXFER_ERR_INVALID_ARGUMENT;
  bad += kvxfer_send(nullptr, 0, nullptr, nullptr, nullptr, &req[0]) != KVXFER_ERR_INVALID_ARGUMENT;
  bad += kvxfer_recv(nullptr, 0, nullptr, nullptr, &req[1]) != KVXFER_ERR_INVALID_ARGUMENT;
  bad += kvxfer_send_spectrum(nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, &req[2]) !=
         KVXFER_ERR_INVALID_ARGUMENT;
  bad += kvxfer_recv_blocks(nullptr, 0, nullptr, nullptr, nullptr, &req[3]) !=
         KVXFER_ERR_INVALID_ARGUMENT;
  bool empty = comm == nullptr && ep == nullptr && pool == nullptr;
  for (auto r : req) empty = empty && r == nullptr;
  std::fprintf(stderr, "%d calls not refused; outputs %s\n", bad, empty ? "empty" : "NOT empty");
  std::_Exit(bad == 0 && empty ? 0 : 1);
}

TEST(KvPoolDeathTest, MalformedEnvironmentStillEmptiesTheOutputs) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(ExpectOutputsResetUnderMalformedEnvironment(), ::testing::ExitedWithCode(0),
              "0 calls not refused; outputs empty");
}

}  // namespace

}  // namespace kvxfer

int main(int argc, char** argv) {
  setenv("KVXFER_CODEC_THREADS", "1", 1);  // no OpenMP pool before fork()
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
