// Endpoints (kvxfer_endpoint_*): peers that connect and disconnect at run
// time, address blobs and their secret, restarted and dead peers.  Two or
// more endpoints live in this process (or in forked children where a peer
// must die); received bytes are compared bit for bit with the codec's own
// decode of the sender's values.
#include "xfer/endpoint.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/fdio.h"
#include "kvxfer/kvxfer.h"
#include "xfer_util.h"

namespace kvxfer {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int32_t kL = 2, kHeads = 2, kHd = 64, kBs = 16, kPageTokens = 64;
constexpr int64_t kT = 200;

struct Ep {
  kvxfer_comm_t ep = nullptr;
  std::vector<uint8_t> addr;
  explicit Ep(const uint8_t* secret = nullptr, int port = 0, int timeout_ms = kTimeoutMs,
              const char* rate = nullptr) {
    kvxfer_endpoint_config_t cfg = KVXFER_ENDPOINT_CONFIG_INITIALIZER;
    cfg.timeout_ms = timeout_ms;
    cfg.bind_address = "127.0.0.1";
    cfg.port = port;
    cfg.secret = secret;
    cfg.rate_limit = rate;
    if (kvxfer_endpoint_create(&ep, &cfg) != KVXFER_SUCCESS) {
      ADD_FAILURE() << "kvxfer_endpoint_create: " << kvxfer_get_last_error();
      return;
    }
    addr.resize(KVXFER_ENDPOINT_ADDRESS_MAX);
    size_t n = addr.size();
    EXPECT_EQ(kvxfer_endpoint_address(ep, addr.data(), &n), KVXFER_SUCCESS);
    addr.resize(n);
  }
  ~Ep() { kvxfer_comm_destroy(ep); }
  int connect(const Ep& other) {
    int p = -1;
    EXPECT_EQ(kvxfer_endpoint_connect(ep, other.addr.data(), other.addr.size(), &p), KVXFER_SUCCESS)
        << kvxfer_get_last_error();
    return p;
  }
};

kvxfer_request_config_t by_id(uint64_t id) {
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.page_tokens = kPageTokens;
  rc.match_by_id = 1;
  rc.request_id = id;
  return rc;
}

/** One send of KV seeded `seed` from (a, pa) to (b, pb) by id `id`; bytes checked. */
void transfer_exact(kvxfer_comm_t a, int pa, kvxfer_comm_t b, int pb, uint64_t id, uint64_t seed,
                    const kvxfer_codec_config_t& cfg) {
  PagedKV src(kL, kHeads, kHd, kT, kBs);
  src.fill(seed);
  PagedKV dst(kL, kHeads, kHd, kT, kBs);
  const kvxfer_request_config_t rc = by_id(id);
  kvxfer_request_t s = nullptr, r = nullptr;
  ASSERT_EQ(kvxfer_recv(b, pb, &dst.desc, &rc, &r), KVXFER_SUCCESS) << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_send(a, pa, &src.desc, &cfg, &rc, &s), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  PagedKV want(kL, kHeads, kHd, kT, kBs);
  expected_decode(src, cfg, kPageTokens, 0, true, &want);
  for (int32_t l = 0; l < kL; ++l)
    for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
      ASSERT_EQ(dst.bytes(l, kind), want.bytes(l, kind)) << "layer " << l;
  kvxfer_request_free(s);
  kvxfer_request_free(r);
}

kvxfer_codec_config_t lynx() { return KVXFER_CODEC_CONFIG_INITIALIZER; }
kvxfer_codec_config_t bf16() {
  kvxfer_codec_config_t c = KVXFER_CODEC_CONFIG_INITIALIZER;
  c.codec = KVXFER_CODEC_BF16;
  return c;
}

void expect_error(kvxfer_result_t got, kvxfer_result_t want, const char* words) {
  EXPECT_EQ(got, want) << kvxfer_get_last_error();
  EXPECT_NE(std::string(kvxfer_get_last_error()).find(words), std::string::npos)
      << "wanted \"" << words << "\" in: " << kvxfer_get_last_error();
}

// ---------------------------------------------------------------------------
TEST(Endpoint, PeersConnectEitherWayAndMoveExactBytes) {
  Ep a, b;
  ASSERT_NE(a.ep, nullptr);
  ASSERT_NE(b.ep, nullptr);
  const int ab = a.connect(b);
  ASSERT_GE(ab, 0);
  // Connecting again, from either side, gives the same peer.
  EXPECT_EQ(a.connect(b), ab);
  const int ba = b.connect(a);
  ASSERT_GE(ba, 0);
  EXPECT_EQ(b.connect(a), ba);
  int n = 0;
  EXPECT_EQ(kvxfer_comm_count(a.ep, &n), KVXFER_SUCCESS);
  EXPECT_EQ(n, 1);
  int rank = 0;
  EXPECT_EQ(kvxfer_comm_user_rank(a.ep, &rank), KVXFER_SUCCESS);
  EXPECT_EQ(rank, -1);
  transfer_exact(a.ep, ab, b.ep, ba, 1, 11, lynx());
  transfer_exact(b.ep, ba, a.ep, ab, 2, 12, bf16());
}

TEST(Endpoint, CrossedConnectsEndWithOnePeerEachSide) {
  for (int round = 0; round < 10; ++round) {
    Ep a, b;
    int pa = -1, pb = -1;
    std::thread t([&] { pb = b.connect(a); });
    pa = a.connect(b);
    t.join();
    ASSERT_GE(pa, 0);
    ASSERT_GE(pb, 0);
    int na = 0, nb = 0;
    kvxfer_comm_count(a.ep, &na);
    kvxfer_comm_count(b.ep, &nb);
    EXPECT_EQ(na, 1) << "round " << round;
    EXPECT_EQ(nb, 1) << "round " << round;
    transfer_exact(a.ep, pa, b.ep, pb, 5, 100 + round, lynx());
  }
}

TEST(Endpoint, BadAddressesFailAtTheCallAndChangeNothing) {
  Ep a, b;
  int p = 7;
  std::mt19937_64 rng(3);
  std::vector<uint8_t> junk(72);
  for (auto& x : junk) x = static_cast<uint8_t>(rng());
  expect_error(kvxfer_endpoint_connect(a.ep, junk.data(), junk.size(), &p),
               KVXFER_ERR_INVALID_ARGUMENT, "not an endpoint address");
  EXPECT_EQ(p, -1);
  expect_error(kvxfer_endpoint_connect(a.ep, b.addr.data(), b.addr.size() - 1, &p),
               KVXFER_ERR_INVALID_ARGUMENT, "truncated");
  expect_error(kvxfer_endpoint_connect(a.ep, b.addr.data(), 4, &p), KVXFER_ERR_INVALID_ARGUMENT,
               "truncated");
  expect_error(kvxfer_endpoint_connect(a.ep, a.addr.data(), a.addr.size(), &p),
               KVXFER_ERR_INVALID_ARGUMENT, "this endpoint's own");
  // The blob's secret changed: b refuses, and says so at a's call.
  std::vector<uint8_t> forged = b.addr;
  ASSERT_EQ(forged.size(), xfer::kEndpointBlobBytes + xfer::kEndpointSecretBytes);
  forged.back() ^= 1;
  expect_error(kvxfer_endpoint_connect(a.ep, forged.data(), forged.size(), &p),
               KVXFER_ERR_INVALID_ARGUMENT, "wrong secret");
  // A configured secret is not in the blob; another one is refused.
  uint8_t s1[32], s2[32];
  std::memset(s1, 1, 32);
  std::memset(s2, 2, 32);
  Ep c(s1), d(s2), e(s1);
  EXPECT_EQ(c.addr.size(), xfer::kEndpointBlobBytes);
  expect_error(kvxfer_endpoint_connect(d.ep, c.addr.data(), c.addr.size(), &p),
               KVXFER_ERR_INVALID_ARGUMENT, "wrong secret");
  // An endpoint nobody listens at any more.
  std::vector<uint8_t> gone;
  {
    Ep f;
    gone = f.addr;
  }
  expect_error(kvxfer_endpoint_connect(a.ep, gone.data(), gone.size(), &p), KVXFER_ERR_SYSTEM,
               "refused");
  // Nothing changed: the right peers still connect and move bytes.
  const int ab = a.connect(b), ba = b.connect(a);
  transfer_exact(a.ep, ab, b.ep, ba, 9, 9, lynx());
  const int ec = e.connect(c), ce = c.connect(e);
  transfer_exact(e.ep, ec, c.ep, ce, 9, 10, bf16());
  // The address of a communicator, or into a buffer too small.
  size_t n = 4;
  uint8_t small[4];
  expect_error(kvxfer_endpoint_address(a.ep, small, &n), KVXFER_ERR_BUFFER_TOO_SMALL, "holds 4");
  EXPECT_EQ(n, a.addr.size());
  expect_error(kvxfer_endpoint_disconnect(a.ep, 99), KVXFER_ERR_INVALID_ARGUMENT,
               "not a peer of this endpoint");
  kvxfer_request_t r = nullptr;
  PagedKV kv(kL, kHeads, kHd, kT, kBs);
  const kvxfer_request_config_t rc = by_id(1);
  expect_error(kvxfer_recv(a.ep, 5, &kv.desc, &rc, &r), KVXFER_ERR_INVALID_ARGUMENT,
               "not a peer of this endpoint");
}

TEST(Endpoint, DisconnectFailsRequestsOnBothSidesAndReconnectIsNew) {
  Ep a, b;
  const int ab = a.connect(b), ba = b.connect(a);
  PagedKV kv(kL, kHeads, kHd, kT, kBs);
  const kvxfer_request_config_t rc = by_id(77);
  kvxfer_request_t ra = nullptr, rb = nullptr;
  ASSERT_EQ(kvxfer_recv(a.ep, ab, &kv.desc, &rc, &ra), KVXFER_SUCCESS);
  PagedKV kv2(kL, kHeads, kHd, kT, kBs);
  const kvxfer_request_config_t rc2 = by_id(78);
  ASSERT_EQ(kvxfer_recv(b.ep, ba, &kv2.desc, &rc2, &rb), KVXFER_SUCCESS);
  const auto t0 = Clock::now();
  ASSERT_EQ(kvxfer_endpoint_disconnect(a.ep, ab), KVXFER_SUCCESS) << kvxfer_get_last_error();
  expect_error(kvxfer_wait(ra, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED, "disconnected");
  // The peer was told: its request fails too, well within a second.
  expect_error(kvxfer_wait(rb, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED, "disconnected");
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  kvxfer_request_t r = nullptr;
  expect_error(kvxfer_recv(a.ep, ab, &kv.desc, &rc, &r), KVXFER_ERR_INVALID_USAGE, "disconnected");
  expect_error(kvxfer_recv(b.ep, ba, &kv.desc, &rc, &r), KVXFER_ERR_INVALID_USAGE, "disconnected");
  expect_error(kvxfer_endpoint_disconnect(a.ep, ab), KVXFER_ERR_INVALID_USAGE, "not connected");
  kvxfer_request_free(ra);
  kvxfer_request_free(rb);
  // A new connection, with a new index on both sides.
  const int ab2 = a.connect(b);
  const int ba2 = b.connect(a);
  EXPECT_NE(ab2, ab);
  EXPECT_NE(ba2, ba);
  transfer_exact(a.ep, ab2, b.ep, ba2, 77, 5, lynx());
}

}  // namespace
}  // namespace kvxfer
