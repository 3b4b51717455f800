// Endpoints (kvxfer_endpoint_*): peers that connect and disconnect at run
// time, address blobs and their secret, restarted and dead peers.  Two or
// more endpoints live in this process (or in forked children where a peer
// must die); received bytes are compared bit for bit with the codec's own
// decode of the sender's values.
#include "xfer/endpoint.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "api/xfer_api.h"
#include "common/fdio.h"
#include "fork_child.h"
#include "kvxfer/kvxfer.h"
#include "transport/tcp_io.h"
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
              const char* rate = nullptr, std::shared_ptr<xfer::TestHooks> hooks = nullptr) {
    kvxfer_endpoint_config_t cfg = KVXFER_ENDPOINT_CONFIG_INITIALIZER;
    cfg.timeout_ms = timeout_ms;
    cfg.bind_address = "127.0.0.1";
    cfg.port = port;
    cfg.secret = secret;
    cfg.rate_limit = rate;
    if (api::endpoint_create(&ep, &cfg, std::move(hooks)) != KVXFER_SUCCESS) {
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

/** dst holds exactly the codec's own decode of src. */
void expect_exact(PagedKV& src, PagedKV& dst, const kvxfer_codec_config_t& cfg) {
  PagedKV want(kL, kHeads, kHd, kT, kBs);
  expected_decode(src, cfg, kPageTokens, 0, true, &want);
  for (int32_t l = 0; l < kL; ++l)
    for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
      ASSERT_EQ(dst.bytes(l, kind), want.bytes(l, kind)) << "layer " << l;
}

/** One send of KV seeded `seed` from (a, pa) to (b, pb) by id `id`; bytes checked. */
/** Both requests complete, dst is src exactly; both are freed. */
void complete_exact(kvxfer_request_t s, kvxfer_request_t r, PagedKV& src, PagedKV& dst,
                    const kvxfer_codec_config_t& cfg) {
  ASSERT_EQ(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  expect_exact(src, dst, cfg);
  kvxfer_request_free(s);
  kvxfer_request_free(r);
}

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
  complete_exact(s, r, src, dst, cfg);
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

/** A TCP connection to the listener of the endpoint whose blob is `at`. */
transport::tcp::Fd dial_listener(const xfer::EndpointAddress& at) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = at.port_be;
  std::memcpy(&sa.sin_addr, at.addr.data(), 4);
  transport::tcp::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
  return fd;
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

/** Waits up to 5 s for `n` to reach `want`; true if it did. */
bool reaches(const std::atomic<int>& n, int want) {
  const auto end = Clock::now() + std::chrono::seconds(5);
  while (n.load() < want && Clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return n.load() >= want;
}

TEST(Endpoint, AConnectTakesTheSpareLinkMadeAheadAndAFailedOneDropsIt) {
  auto ha = std::make_shared<xfer::TestHooks>(), hb = std::make_shared<xfer::TestHooks>();
  Ep a(nullptr, 0, kTimeoutMs, nullptr, ha), b(nullptr, 0, kTimeoutMs, nullptr, hb);
  // No path used yet: the first connect and its accept make their Links.
  const int ab = a.connect(b);
  ASSERT_GE(ab, 0);
  EXPECT_EQ(ha->spare_links_taken.load(), 0);
  EXPECT_EQ(hb->spare_links_taken.load(), 0);
  // Once quiet, each side has made one spare of the path it used.
  ASSERT_TRUE(reaches(ha->spare_links_made, 1));
  ASSERT_TRUE(reaches(hb->spare_links_made, 1));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(ha->spare_links_made.load(), 1) << "one spare per path, not more";
  // A new peer's connect takes a's spare, and the bytes are exact over it.
  auto hc = std::make_shared<xfer::TestHooks>();
  Ep c(nullptr, 0, kTimeoutMs, nullptr, hc);
  const int ac = a.connect(c);
  ASSERT_GE(ac, 0);
  EXPECT_EQ(ha->spare_links_taken.load(), 1);
  EXPECT_EQ(hc->spare_links_taken.load(), 0);
  int ca = -1;
  ASSERT_EQ(kvxfer_endpoint_connect(c.ep, a.addr.data(), a.addr.size(), &ca), KVXFER_SUCCESS);
  transfer_exact(a.ep, ac, c.ep, ca, 1, 21, lynx());
  transfer_exact(a.ep, ab, b.ep, b.connect(a), 2, 22, bf16());
  // b accepts with its spare.
  ASSERT_TRUE(reaches(ha->spare_links_made, 2));
  EXPECT_EQ(kvxfer_endpoint_disconnect(a.ep, ab), KVXFER_SUCCESS);
  EXPECT_GE(a.connect(b), 0);
  EXPECT_EQ(hb->spare_links_taken.load(), 1);
  EXPECT_EQ(ha->spare_links_taken.load(), 2);
  // A refused CONNECT carried the spare's address to the refusing side: that
  // Link is dropped, so the slot is empty and a new spare is made.
  ASSERT_TRUE(reaches(ha->spare_links_made, 3));
  uint8_t s1[32];
  std::memset(s1, 1, 32);
  Ep d(s1);
  int p = -1;
  expect_error(kvxfer_endpoint_connect(a.ep, d.addr.data(), d.addr.size(), &p),
               KVXFER_ERR_INVALID_ARGUMENT, "wrong secret");
  EXPECT_EQ(ha->spare_links_taken.load(), 3);
  EXPECT_TRUE(reaches(ha->spare_links_made, 4));
}

// A request that ends before kvxfer_send returns: its callback gets the
// caller's handle, and kvxfer_test on it (allowed in a callback) reads the
// request, not an empty handle (it crashed).
TEST(Endpoint, ACallbackOfARequestThatEndsBeforeItsPostReturnsCanTestIt) {
  auto hooks = std::make_shared<xfer::TestHooks>();
  Ep a(nullptr, 0, kTimeoutMs, nullptr, hooks), b;
  ASSERT_NE(a.ep, nullptr);
  ASSERT_NE(b.ep, nullptr);
  const int ab = a.connect(b), ba = b.connect(a);
  PagedKV src(kL, kHeads, kHd, kT, kBs), dst(kL, kHeads, kHd, kT, kBs);
  src.fill(3);
  codec::store_elem(src.row(0, KVXFER_KV_KEY, 0), 0, KVXFER_DTYPE_BF16, NAN);  // ERROR policy
  struct Seen {
    std::atomic<int> calls{0};
    std::atomic<int> test_rc{1};
    std::atomic<int> stage{-1};
  } seen;
  kvxfer_request_config_t rc = by_id(7);
  kvxfer_request_t r = nullptr, s = nullptr;
  ASSERT_EQ(kvxfer_recv(b.ep, ba, &dst.desc, &rc, &r), KVXFER_SUCCESS) << kvxfer_get_last_error();
  rc.user_data = &seen;
  rc.on_complete = [](kvxfer_request_t req, kvxfer_stage_t, kvxfer_result_t, void* u) {
    auto* x = static_cast<Seen*>(u);
    kvxfer_stage_t st = KVXFER_STAGE_POSTED;
    x->test_rc = kvxfer_test(req, &st);
    x->stage = st;
    x->calls++;
  };
  hooks->post_return_delay_ms = 2000;  // the send fails on the engine's threads meanwhile
  ASSERT_EQ(kvxfer_send(a.ep, ab, &src.desc, nullptr, &rc, &s), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  hooks->post_return_delay_ms = 0;
  EXPECT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 60000), KVXFER_ERR_NONFINITE);
  EXPECT_EQ(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000), KVXFER_ERR_NONFINITE)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_request_free(s), KVXFER_SUCCESS);  // waits for a callback still running
  EXPECT_EQ(seen.calls.load(), 1);
  EXPECT_EQ(seen.test_rc.load(), KVXFER_ERR_NONFINITE);
  EXPECT_EQ(seen.stage.load(), KVXFER_STAGE_ERROR);
  kvxfer_request_free(r);
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

// Config pointers that are not readable memory (a wild string, a secret of
// fewer than 32 bytes before an unmapped page): an error at the call, naming
// the field, never a crash.
TEST(Endpoint, UnreadableConfigPointersFailAtTheCall) {
  const long page = sysconf(_SC_PAGESIZE);
  auto* m = static_cast<uint8_t*>(
      mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(m, MAP_FAILED);
  ASSERT_EQ(mprotect(m + page, page, PROT_NONE), 0);
  std::memset(m, 'a', page);  // no NUL before the unreadable page
  struct Case {
    const char* field;
    void (*edit)(kvxfer_endpoint_config_t*, uint8_t*, long);
  } const cases[] = {
      {"bind_address",
       [](kvxfer_endpoint_config_t* c, uint8_t* m, long page) {
         c->bind_address = reinterpret_cast<const char*>(m + page);
       }},
      {"bind_address",
       [](kvxfer_endpoint_config_t* c, uint8_t* m, long page) {
         c->bind_address = reinterpret_cast<const char*>(m + page - 8);  // runs into it
       }},
      {"rate_limit", [](kvxfer_endpoint_config_t* c, uint8_t* m,
                        long page) { c->rate_limit = reinterpret_cast<const char*>(m + page); }},
      {"secret",
       [](kvxfer_endpoint_config_t* c, uint8_t* m, long page) {
         c->secret = m + page - 16;  // 16 of its 32 bytes readable
       }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.field);
    kvxfer_endpoint_config_t cfg = KVXFER_ENDPOINT_CONFIG_INITIALIZER;
    cfg.bind_address = "127.0.0.1";
    k.edit(&cfg, m, page);
    kvxfer_comm_t ep = reinterpret_cast<kvxfer_comm_t>(0x1);
    expect_error(kvxfer_endpoint_create(&ep, &cfg), KVXFER_ERR_INVALID_ARGUMENT, k.field);
    EXPECT_EQ(ep, nullptr);
    // A communicator's config has the same two strings.
    if (std::string(k.field) == "secret") continue;
    kvxfer_comm_config_t cc = KVXFER_COMM_CONFIG_INITIALIZER;
    cc.bind_address = cfg.bind_address;
    cc.rate_limit = cfg.rate_limit;
    kvxfer_unique_id_t id{};
    kvxfer_comm_t comm = reinterpret_cast<kvxfer_comm_t>(0x1);
    expect_error(kvxfer_comm_init(&comm, 2, id, 1, &cc), KVXFER_ERR_INVALID_ARGUMENT, k.field);
    EXPECT_EQ(comm, nullptr);
  }
  munmap(m, 2 * page);
}

// A bind address the endpoint's listener cannot use fails the call, naming it.
TEST(Endpoint, AnUnusableBindAddressFailsAtTheCall) {
  const std::pair<const char*, const char*> cases[] = {
      {"garbage.invalid", "endpoint: cannot resolve bind host 'garbage.invalid'"},
      {"0.0.0.0", "endpoint: bind host '0.0.0.0' is a wildcard address"}};
  for (const auto& [host, words] : cases) {
    kvxfer_endpoint_config_t cfg = KVXFER_ENDPOINT_CONFIG_INITIALIZER;
    cfg.bind_address = host;
    kvxfer_comm_t ep = reinterpret_cast<kvxfer_comm_t>(0x1);
    expect_error(kvxfer_endpoint_create(&ep, &cfg), KVXFER_ERR_INVALID_ARGUMENT, words);
    EXPECT_EQ(ep, nullptr) << host;
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

// Connections that send nothing, or garbage, hold the listener for no one
// else: a peer's connect goes through at once beside them, and the listener
// drops them at its deadline.
TEST(Endpoint, SilentAndGarbageConnectionsDelayNoConnect) {
  Ep a, b;
  xfer::EndpointAddress at;
  ASSERT_EQ(xfer::decode_endpoint_address(a.addr.data(), a.addr.size(), &at), KVXFER_SUCCESS);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = at.port_be;
  std::memcpy(&sa.sin_addr, at.addr.data(), 4);
  std::vector<int> socks;
  for (int i = 0; i < 12; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    if (i % 3 == 1) (void)!::write(fd, "\xff\xff\x00\x00garbage", 12);  // a frame that never ends
    if (i % 3 == 2) (void)!::write(fd, "\x04\x00\x00\x00junk", 8);      // a whole frame, malformed
    socks.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto t0 = Clock::now();
  const int ba = b.connect(a);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(s, 1.0) << "the connect waited behind silent connections";
  const int ab = a.connect(b);
  transfer_exact(b.ep, ba, a.ep, ab, 3, 3, lynx());
  for (int fd : socks) ::close(fd);
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

// kvxfer_send, posted again while it is refused at the call
// (KVXFER_ERR_INVALID_USAGE: its id or slot not free yet), for up to 2 s:
// an id a failed request held must be free by then, not at the 20 s
// timeout.  Returns the last post's result.
kvxfer_result_t send_when_free(kvxfer_comm_t ep, int peer, const kvxfer_kv_desc_t* kv,
                               const kvxfer_codec_config_t& cfg, const kvxfer_request_config_t& rc,
                               kvxfer_request_t* s) {
  const auto t0 = Clock::now();
  kvxfer_result_t posted = KVXFER_ERR_INVALID_USAGE;
  while (posted == KVXFER_ERR_INVALID_USAGE && Clock::now() - t0 < std::chrono::seconds(2)) {
    posted = kvxfer_send(ep, peer, kv, &cfg, &rc, s);
    if (posted != KVXFER_SUCCESS) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return posted;
}

// Receives by id cancelled before their sends were posted: every sender is
// told when its announcement comes, not only the first (the rendezvous
// stream's standing receive reads every announcement).
TEST(Endpoint, ReceivesCancelledBeforeTheirSendsTellEverySender) {
  Ep a, b;
  const int ab = a.connect(b), ba = b.connect(a);
  PagedKV src(kL, kHeads, kHd, kT, kBs), dst(kL, kHeads, kHd, kT, kBs);
  const kvxfer_codec_config_t cfg = lynx();
  std::vector<kvxfer_request_t> recvs, sends;
  for (uint64_t id : {31, 32, 33}) {
    const kvxfer_request_config_t rc = by_id(id);
    kvxfer_request_t r = nullptr;
    ASSERT_EQ(kvxfer_recv(b.ep, ba, &dst.desc, &rc, &r), KVXFER_SUCCESS);
    ASSERT_EQ(kvxfer_request_cancel(r), KVXFER_SUCCESS);
    EXPECT_EQ(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED);
    recvs.push_back(r);
  }
  for (uint64_t id : {31, 32, 33}) {
    const kvxfer_request_config_t rc = by_id(id);
    kvxfer_request_t s = nullptr;
    ASSERT_EQ(kvxfer_send(a.ep, ab, &src.desc, &cfg, &rc, &s), KVXFER_SUCCESS);
    sends.push_back(s);
  }
  for (kvxfer_request_t s : sends) {
    expect_error(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED,
                 "the peer cancelled");
    // Final means free: the refusal's empty DESC ended the send's DESC
    // receive, so nothing of it waits for the timeout.
    EXPECT_EQ(kvxfer_request_free(s), KVXFER_SUCCESS) << kvxfer_get_last_error();
  }
  for (kvxfer_request_t r : recvs) kvxfer_request_free(r);
  // The ids are free again once the refusal's empty DESC has come, just
  // after its STATUS: within 2 s here, not after the 20 s timeout.  A send
  // and a receive of one of them then meet.
  src.fill(31);
  const kvxfer_request_config_t rc = by_id(31);
  kvxfer_request_t s = nullptr, r = nullptr;
  ASSERT_EQ(send_when_free(a.ep, ab, &src.desc, cfg, rc, &s), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_recv(b.ep, ba, &dst.desc, &rc, &r), KVXFER_SUCCESS) << kvxfer_get_last_error();
  complete_exact(s, r, src, dst, cfg);
}

// Sends by id cancelled before their receives were posted (a runtime
// aborting a request its decode has not asked for yet): each withdraws its
// announcement, so its id is free again at once, not after the 20 s
// timeout; a receive of a withdrawn id posted later fails within a round
// trip (its ask is answered), naming the withdrawal; and a send posted again
// by the id meets the receive posted next.
TEST(Endpoint, SendsCancelledBeforeTheirReceivesAreWithdrawnAtOnce) {
  Ep a, b;
  const int ab = a.connect(b), ba = b.connect(a);
  PagedKV src(kL, kHeads, kHd, kT, kBs), dst(kL, kHeads, kHd, kT, kBs);
  const kvxfer_codec_config_t cfg = lynx();
  for (uint64_t id : {41, 42, 43}) {
    const kvxfer_request_config_t rc = by_id(id);
    kvxfer_request_t s = nullptr;
    ASSERT_EQ(kvxfer_send(a.ep, ab, &src.desc, &cfg, &rc, &s), KVXFER_SUCCESS);
    // 41 is cancelled before its announcement can have been read, the
    // others once it waits at the receiver.
    if (id != 41) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ASSERT_EQ(kvxfer_request_cancel(s), KVXFER_SUCCESS);
    expect_error(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED,
                 "cancelled on its sender");
    EXPECT_EQ(kvxfer_request_free(s), KVXFER_SUCCESS) << kvxfer_get_last_error();
  }
  // Each id is free within 2 s, not at the timeout: a send by it is taken
  // again.
  // 41's blocks stay unwritten while its send runs.
  PagedKV src41(kL, kHeads, kHd, kT, kBs);
  src41.fill(41);
  std::vector<kvxfer_request_t> again;
  for (uint64_t id : {41, 42, 43}) {
    const kvxfer_request_config_t rc = by_id(id);
    kvxfer_request_t s = nullptr;
    ASSERT_EQ(send_when_free(a.ep, ab, id == 41 ? &src41.desc : &src.desc, cfg, rc, &s),
              KVXFER_SUCCESS)
        << "id " << id << ": " << kvxfer_get_last_error();
    if (id == 41) {
      again.push_back(s);
      continue;
    }
    ASSERT_EQ(kvxfer_request_cancel(s), KVXFER_SUCCESS);
    EXPECT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED);
    kvxfer_request_free(s);
  }
  // A receive by a withdrawn id fails at once, with the sender's reason:
  // its ask is answered.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  {
    const kvxfer_request_config_t rc = by_id(43);
    kvxfer_request_t r = nullptr;
    ASSERT_EQ(kvxfer_recv(b.ep, ba, &dst.desc, &rc, &r), KVXFER_SUCCESS);
    const auto t0 = Clock::now();
    expect_error(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED,
                 "withdrew the kvxfer_send of request id 43 before a kvxfer_recv took it");
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
    kvxfer_request_free(r);
  }
  // 41 was posted again: the receive posted next meets it, whether or not
  // its new announcement has come.
  const kvxfer_request_config_t rc = by_id(41);
  kvxfer_request_t r = nullptr;
  ASSERT_EQ(kvxfer_recv(b.ep, ba, &dst.desc, &rc, &r), KVXFER_SUCCESS);
  complete_exact(again[0], r, src41, dst, cfg);
}

// A runtime that cancels a send by id and posts it again at once, then
// posts its receive: the receive meets the new send every time, never the
// withdrawal of the old one (before, it failed as withdrawn when it came
// before the new announcement).
TEST(Endpoint, AReceivePostedRightAfterASendIsPostedAgainMeetsIt) {
  Ep a, b;
  const int ab = a.connect(b), ba = b.connect(a);
  const kvxfer_codec_config_t cfg = bf16();
  PagedKV src(1, 1, 8, 16, kBs), dst(1, 1, 8, 16, kBs);
  int failed = 0;
  for (uint64_t id = 500; id < 540; ++id) {
    src.fill(id);
    const kvxfer_request_config_t rc = by_id(id);
    kvxfer_request_t s = nullptr, s2 = nullptr, r = nullptr;
    ASSERT_EQ(kvxfer_send(a.ep, ab, &src.desc, &cfg, &rc, &s), KVXFER_SUCCESS);
    if (id % 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));  // announced first
    ASSERT_EQ(kvxfer_request_cancel(s), KVXFER_SUCCESS);
    EXPECT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED);
    kvxfer_request_free(s);
    ASSERT_EQ(send_when_free(a.ep, ab, &src.desc, cfg, rc, &s2), KVXFER_SUCCESS)
        << "id " << id << ": " << kvxfer_get_last_error();
    ASSERT_EQ(kvxfer_recv(b.ep, ba, &dst.desc, &rc, &r), KVXFER_SUCCESS);
    for (kvxfer_request_t q : {r, s2})
      if (kvxfer_wait(q, KVXFER_STAGE_COMPLETE, 5000) != KVXFER_SUCCESS && failed++ < 3)
        ADD_FAILURE() << "id " << id << ": " << kvxfer_get_last_error();
    EXPECT_EQ(dst.bytes(0, KVXFER_KV_KEY), src.bytes(0, KVXFER_KV_KEY)) << "id " << id;
    EXPECT_EQ(dst.bytes(0, KVXFER_KV_VALUE), src.bytes(0, KVXFER_KV_VALUE)) << "id " << id;
    kvxfer_request_free(s2);
    kvxfer_request_free(r);
  }
  EXPECT_EQ(failed, 0);
}

// A by-id send whose receive never comes, on an idle link: its DESC and
// STATUS receives expire before the receiver refuses it at its own timeout,
// and the refusal stays unmatched in the sender's provider.  The request
// that takes its seq next, 16,383 by-id sends later, must not read it: the
// seq is not taken again.  (Before, that request failed with "no
// kvxfer_recv by request id 77 was posted ...".)
TEST(Endpoint, ARefusalThatCameAfterItsSendExpiredFailsNoLaterRequest) {
  constexpr int kT300 = 300;
  Ep a(nullptr, 0, kT300), b(nullptr, 0, kT300);
  const int ab = a.connect(b), ba = b.connect(a);
  const kvxfer_codec_config_t cfg = bf16();
  PagedKV orphan(1, 1, 8, 16, kBs);
  {
    const kvxfer_request_config_t rc = by_id(77);
    kvxfer_request_t s = nullptr;
    ASSERT_EQ(kvxfer_send(a.ep, ab, &orphan.desc, &cfg, &rc, &s), KVXFER_SUCCESS);
    EXPECT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 20000), KVXFER_ERR_TIMEOUT);
    kvxfer_request_free(s);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(3 * kT300));  // the refusal comes
  // Every seq of the id space once, and one more: 32 transfers at a time.
  constexpr int kWindow = 32, kN = 0x3FFF + kWindow;
  std::vector<std::unique_ptr<PagedKV>> src, dst;
  for (int i = 0; i < kWindow; ++i) {
    src.push_back(std::make_unique<PagedKV>(1, 1, 8, 16, kBs));
    dst.push_back(std::make_unique<PagedKV>(1, 1, 8, 16, kBs));
    src.back()->fill(static_cast<uint64_t>(i));
  }
  int failed = 0;
  for (int i0 = 0; i0 < kN; i0 += kWindow) {
    std::vector<kvxfer_request_t> s(kWindow), r(kWindow);
    for (int k = 0; k < kWindow; ++k) {
      const kvxfer_request_config_t rc = by_id(1000 + static_cast<uint64_t>(i0 + k));
      ASSERT_EQ(kvxfer_recv(b.ep, ba, &dst[k]->desc, &rc, &r[k]), KVXFER_SUCCESS)
          << kvxfer_get_last_error();
      ASSERT_EQ(kvxfer_send(a.ep, ab, &src[k]->desc, &cfg, &rc, &s[k]), KVXFER_SUCCESS)
          << kvxfer_get_last_error();
    }
    for (int k = 0; k < kWindow; ++k) {
      for (kvxfer_request_t q : {s[k], r[k]})
        if (kvxfer_wait(q, KVXFER_STAGE_COMPLETE, 20000) != KVXFER_SUCCESS && failed++ < 3)
          ADD_FAILURE() << "transfer " << i0 + k << ": " << kvxfer_get_last_error();
      for (int32_t l = 0; l < 1; ++l)
        for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
          EXPECT_EQ(dst[k]->bytes(l, kind), src[k]->bytes(l, kind)) << "transfer " << i0 + k;
      kvxfer_request_free(s[k]);
      kvxfer_request_free(r[k]);
    }
  }
  EXPECT_EQ(failed, 0);
}

// A by-id send whose receive never comes, on a busy link: its DESC receive
// does not expire while other requests flow, and no DESC follows the
// receiver's refusal at its timeout (its STATUS says so, kStatusNoDesc).
// The send ends on it, its id free at once: a send posted again by the id
// is taken within the timeout, while the traffic goes on, and meets its
// receive.  (Before, the id stayed taken while the link was busy.)
TEST(Endpoint, ASendRefusedAtItsTimeoutOnABusyLinkFreesItsIdAtOnce) {
  constexpr int kT300 = 300;
  Ep a(nullptr, 0, kT300), b(nullptr, 0, kT300);
  const int ab = a.connect(b), ba = b.connect(a);
  const kvxfer_codec_config_t cfg = bf16();
  PagedKV orphan(kL, kHeads, kHd, kT, kBs), dst(kL, kHeads, kHd, kT, kBs);
  orphan.fill(88);
  const kvxfer_request_config_t rc = by_id(88);
  kvxfer_request_t s = nullptr, again = nullptr;
  ASSERT_EQ(kvxfer_send(a.ep, ab, &orphan.desc, &cfg, &rc, &s), KVXFER_SUCCESS);
  // Traffic both ways every 20 ms until the id is taken again, or for
  // three timeouts after the orphan failed.
  Clock::time_point failed_at{};
  double took = -1;
  for (uint64_t id = 2000; id < 2400 && again == nullptr; ++id) {
    transfer_exact(id % 2 ? a.ep : b.ep, id % 2 ? ab : ba, id % 2 ? b.ep : a.ep, id % 2 ? ba : ab,
                   id, id, cfg);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (failed_at == Clock::time_point{}) {
      if (kvxfer_test(s, nullptr) == KVXFER_IN_PROGRESS) continue;
      failed_at = Clock::now();
      ASSERT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 0), KVXFER_ERR_TIMEOUT);
      EXPECT_NE(std::string(kvxfer_get_last_error()).find("no kvxfer_recv by request id 88"),
                std::string::npos)
          << kvxfer_get_last_error();
      kvxfer_request_free(s);
    }
    const double since = std::chrono::duration<double>(Clock::now() - failed_at).count();
    if (kvxfer_send(a.ep, ab, &orphan.desc, &cfg, &rc, &again) == KVXFER_SUCCESS)
      took = since;
    else if (since > 3 * kT300 / 1000.0)
      break;
  }
  ASSERT_NE(failed_at, Clock::time_point{}) << "the orphan never failed";
  ASSERT_NE(again, nullptr) << "id 88 still taken " << 3 * kT300
                            << " ms after its send failed, the link busy: "
                            << kvxfer_get_last_error();
  EXPECT_LT(took, kT300 / 1000.0) << "id 88 was taken again only after the link's timeout";
  kvxfer_request_t r = nullptr;
  ASSERT_EQ(kvxfer_recv(b.ep, ba, &dst.desc, &rc, &r), KVXFER_SUCCESS) << kvxfer_get_last_error();
  complete_exact(again, r, orphan, dst, cfg);
}

// ---------------------------------------------------------------------------
// Sends to KVXFER_ANY_PEER: a prefill's send goes to whichever decode asks.
// ---------------------------------------------------------------------------

kvxfer_request_config_t any_peer(uint64_t id, int claim_timeout_ms = 0) {
  kvxfer_request_config_t rc = by_id(id);
  rc.claim_timeout_ms = claim_timeout_ms;
  return rc;
}

int info_peer(kvxfer_request_t r) {
  kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
  EXPECT_EQ(kvxfer_request_get_info(r, &info), KVXFER_SUCCESS) << kvxfer_get_last_error();
  return info.peer;
}

/** A prefill endpoint and a decode endpoint connected to it, with a KV each. */
struct PrefillDecode {
  Ep prefill, decode;
  int d_p = decode.connect(prefill);  // the prefill, as the decode's peer
  PagedKV src{kL, kHeads, kHd, kT, kBs}, dst{kL, kHeads, kHd, kT, kBs};
  kvxfer_request_t s = nullptr, r = nullptr;
  /** Both requests complete, dst is src exactly, both freed. */
  void complete_exact(const kvxfer_codec_config_t& cfg) {
    ASSERT_EQ(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
        << kvxfer_get_last_error();
    ASSERT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
        << kvxfer_get_last_error();
    expect_exact(src, dst, cfg);
  }
  ~PrefillDecode() {
    kvxfer_request_free(s);
    kvxfer_request_free(r);
  }
};

TEST(EndpointAnyPeer, ASendGoesToWhicheverPeerAsksForItsId) {
  Ep prefill, a, b;
  const int a_p = a.connect(prefill), b_p = b.connect(prefill);
  const int p_a = prefill.connect(a), p_b = prefill.connect(b);  // the same peers, from there
  ASSERT_GE(p_a, 0);
  ASSERT_GE(p_b, 0);
  ASSERT_NE(p_a, p_b);
  PagedKV src7(kL, kHeads, kHd, kT, kBs), src8(kL, kHeads, kHd, kT, kBs),
      src9(kL, kHeads, kHd, kT, kBs);
  src7.fill(7);
  src8.fill(8);
  src9.fill(9);
  PagedKV dst7(kL, kHeads, kHd, kT, kBs), dst8(kL, kHeads, kHd, kT, kBs),
      dst9(kL, kHeads, kHd, kT, kBs);
  const kvxfer_codec_config_t cfg = lynx();
  kvxfer_request_t s7 = nullptr, s8 = nullptr, s9 = nullptr, r7 = nullptr, r8 = nullptr,
                   r9 = nullptr;
  const kvxfer_request_config_t c7 = any_peer(7), c8 = any_peer(8), c9 = any_peer(9);
  // Sends first: nobody has asked, so they wait without a peer.
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src7.desc, &cfg, &c7, &s7), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src8.desc, &cfg, &c8, &s8), KVXFER_SUCCESS);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(info_peer(s7), -1);
  kvxfer_stage_t st = KVXFER_STAGE_ERROR;
  EXPECT_EQ(kvxfer_test(s7, &st), KVXFER_IN_PROGRESS);
  EXPECT_EQ(st, KVXFER_STAGE_POSTED);
  // b asks for 7, a for 8: each gets its own KV.
  ASSERT_EQ(kvxfer_recv(b.ep, b_p, &dst7.desc, &c7, &r7), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_recv(a.ep, a_p, &dst8.desc, &c8, &r8), KVXFER_SUCCESS);
  // A receive that asks before its send is posted waits for it.
  ASSERT_EQ(kvxfer_recv(a.ep, a_p, &dst9.desc, &c9, &r9), KVXFER_SUCCESS);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src9.desc, &cfg, &c9, &s9), KVXFER_SUCCESS);
  for (kvxfer_request_t r : {r7, r8, r9, s7, s8, s9})
    ASSERT_EQ(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
        << kvxfer_get_last_error();
  expect_exact(src7, dst7, cfg);
  expect_exact(src8, dst8, cfg);
  expect_exact(src9, dst9, cfg);
  EXPECT_EQ(info_peer(s7), p_b);
  EXPECT_EQ(info_peer(s8), p_a);
  EXPECT_EQ(info_peer(s9), p_a);
  for (kvxfer_request_t r : {r7, r8, r9, s7, s8, s9}) kvxfer_request_free(r);
  // The id is free again once its send finished.
  transfer_exact(prefill.ep, p_b, b.ep, b_p, 7, 70, bf16());
}

TEST(EndpointAnyPeer, ASendNobodyAsksForTimesOutOrIsCancelledAtOnce) {
  PrefillDecode t;
  auto& [prefill, decode, d_p, src, dst, s, r] = t;
  src.fill(3);
  const kvxfer_codec_config_t cfg = lynx();
  const kvxfer_request_config_t timed = any_peer(1, 300), waits = any_peer(2);
  kvxfer_request_t s1 = nullptr, s2 = nullptr;
  const auto t0 = Clock::now();
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src.desc, &cfg, &timed, &s1), KVXFER_SUCCESS);
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src.desc, &cfg, &waits, &s2), KVXFER_SUCCESS);
  expect_error(kvxfer_wait(s1, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_TIMEOUT, "no peer asked");
  const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 1.5);
  const auto t1 = Clock::now();
  ASSERT_EQ(kvxfer_request_cancel(s2), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_wait(s2, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED);
  EXPECT_LT(Clock::now() - t1, std::chrono::milliseconds(500));
  kvxfer_request_free(s1);
  kvxfer_request_free(s2);
  // Both ids may be posted again, and a receive then takes them.
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src.desc, &cfg, &waits, &s), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_recv(decode.ep, d_p, &dst.desc, &waits, &r), KVXFER_SUCCESS);
  t.complete_exact(cfg);
}

// A receive that asks for a send to KVXFER_ANY_PEER which ended before any
// peer took it (cancelled, or its claim timeout passed) is answered (a
// WITHDRAW, protocol version 6) and fails at once with the send's reason,
// not at its own timeout.  A send posted again by the id is taken.
TEST(EndpointAnyPeer, AReceiveAskingForASendThatEndedUnclaimedFailsAtOnce) {
  PrefillDecode t;
  auto& [prefill, decode, d_p, src, dst, s, r] = t;
  src.fill(6);
  const kvxfer_codec_config_t cfg = lynx();
  const kvxfer_request_config_t cancelled = any_peer(6), timed = any_peer(16, 100);
  kvxfer_request_t s1 = nullptr, s2 = nullptr;
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src.desc, &cfg, &cancelled, &s1),
            KVXFER_SUCCESS);
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src.desc, &cfg, &timed, &s2), KVXFER_SUCCESS);
  ASSERT_EQ(kvxfer_request_cancel(s1), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_wait(s1, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED);
  EXPECT_EQ(kvxfer_wait(s2, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_TIMEOUT);
  kvxfer_request_free(s1);
  kvxfer_request_free(s2);
  for (const auto& [id, code] : {std::make_pair(uint64_t{6}, KVXFER_ERR_CANCELLED),
                                 std::make_pair(uint64_t{16}, KVXFER_ERR_TIMEOUT)}) {
    SCOPED_TRACE(id);
    const kvxfer_request_config_t rc = by_id(id);
    kvxfer_request_t x = nullptr;
    const auto t0 = Clock::now();
    ASSERT_EQ(kvxfer_recv(decode.ep, d_p, &dst.desc, &rc, &x), KVXFER_SUCCESS);
    EXPECT_EQ(kvxfer_wait(x, KVXFER_STAGE_COMPLETE, 5000), code) << kvxfer_get_last_error();
    EXPECT_NE(std::string(kvxfer_get_last_error()).find("withdrew the kvxfer_send of request id"),
              std::string::npos)
        << kvxfer_get_last_error();
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1)) << "it waited for its timeout";
    kvxfer_request_free(x);
  }
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src.desc, &cfg, &cancelled, &s),
            KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_recv(decode.ep, d_p, &dst.desc, &cancelled, &r), KVXFER_SUCCESS);
  t.complete_exact(cfg);
}

TEST(EndpointAnyPeer, ACancelledReceiveFailsTheSendItTook) {
  PrefillDecode t;
  auto& [prefill, decode, d_p, src, dst, s, r] = t;
  const kvxfer_codec_config_t cfg = lynx();
  kvxfer_request_config_t rc = any_peer(5);
  rc.stream_layers = 1;  // the send cannot finish: its layers are never marked
  const kvxfer_request_config_t asks = by_id(5);
  ASSERT_EQ(kvxfer_recv(decode.ep, d_p, &dst.desc, &asks, &r), KVXFER_SUCCESS);
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src.desc, &cfg, &rc, &s), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  for (int i = 0; i < 200 && info_peer(s) < 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_GE(info_peer(s), 0) << "the receive's ask never reached the send";
  const auto t0 = Clock::now();
  ASSERT_EQ(kvxfer_request_cancel(r), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED);
  // An endpoint has no rank: the error names the side that cancelled.
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("kvxfer_recv was cancelled on its receiver"),
            std::string::npos)
      << kvxfer_get_last_error();
  EXPECT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED)
      << kvxfer_get_last_error();
  EXPECT_EQ(std::string(kvxfer_get_last_error()).find("rank -1"), std::string::npos)
      << kvxfer_get_last_error();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
}

TEST(EndpointAnyPeer, AStreamedSendMarksLayersBeforeAndAfterItsPeerAsks) {
  PrefillDecode t;
  auto& [prefill, decode, d_p, src, dst, s, r] = t;
  src.fill(21);
  const kvxfer_codec_config_t cfg = lynx();
  kvxfer_request_config_t rc = any_peer(11);
  rc.stream_layers = 1;
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src.desc, &cfg, &rc, &s), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_send_layer_ready(s, 0), KVXFER_SUCCESS) << kvxfer_get_last_error();
  const kvxfer_request_config_t asks = by_id(11);
  ASSERT_EQ(kvxfer_recv(decode.ep, d_p, &dst.desc, &asks, &r), KVXFER_SUCCESS);
  // Layer 0 arrives while layer 1 does not exist yet (its residuals follow
  // every anchor, so ANCHOR_READY is the stage to wait for).
  ASSERT_EQ(kvxfer_wait_layer(r, 0, KVXFER_STAGE_ANCHOR_READY, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  kvxfer_stage_t st = KVXFER_STAGE_ERROR;
  EXPECT_EQ(kvxfer_test_layer(r, 1, &st), KVXFER_IN_PROGRESS);
  EXPECT_EQ(st, KVXFER_STAGE_POSTED);
  ASSERT_EQ(kvxfer_send_layer_ready(s, 1), KVXFER_SUCCESS);
  t.complete_exact(cfg);
}

TEST(EndpointAnyPeer, BadUsesFailAtTheCall) {
  Ep prefill, decode;
  const int d_p = decode.connect(prefill);
  PagedKV kv(kL, kHeads, kHd, kT, kBs);
  const kvxfer_codec_config_t cfg = lynx();
  kvxfer_request_t r = nullptr;
  kvxfer_request_config_t rc = any_peer(1);
  expect_error(kvxfer_recv(decode.ep, KVXFER_ANY_PEER, &kv.desc, &rc, &r),
               KVXFER_ERR_INVALID_ARGUMENT, "a receive names the peer");
  kvxfer_request_config_t by_order = KVXFER_REQUEST_CONFIG_INITIALIZER;
  expect_error(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &kv.desc, &cfg, &by_order, &r),
               KVXFER_ERR_INVALID_ARGUMENT, "needs match_by_id");
  expect_error(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &kv.desc, &cfg, nullptr, &r),
               KVXFER_ERR_INVALID_ARGUMENT, "needs match_by_id");
  rc.claim_timeout_ms = -1;
  expect_error(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &kv.desc, &cfg, &rc, &r),
               KVXFER_ERR_INVALID_ARGUMENT, "claim_timeout_ms -1 is negative");
  rc.claim_timeout_ms = 100;
  expect_error(kvxfer_recv(decode.ep, d_p, &kv.desc, &rc, &r), KVXFER_ERR_INVALID_ARGUMENT,
               "claim_timeout_ms is for a send to KVXFER_ANY_PEER");
  rc.claim_timeout_ms = 0;
  kvxfer_request_t s = nullptr;
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &kv.desc, &cfg, &rc, &s), KVXFER_SUCCESS);
  expect_error(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &kv.desc, &cfg, &rc, &r),
               KVXFER_ERR_INVALID_USAGE, "already waits for a peer");
  ASSERT_EQ(kvxfer_request_cancel(s), KVXFER_SUCCESS);
  EXPECT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 5000), KVXFER_ERR_CANCELLED);
  kvxfer_request_free(s);
}

// The ask stream's receive stands on an idle link past the link's timeout,
// and the link lives on (a receive left to expire would fail or flood it).
TEST(EndpointAnyPeer, AnIdlePeerKeepsItsAskStreamPastTheTimeout) {
  Ep prefill(nullptr, 0, 300), decode(nullptr, 0, 300);
  const int d_p = decode.connect(prefill);
  const int p_d = prefill.connect(decode);
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  PagedKV src(kL, kHeads, kHd, kT, kBs), dst(kL, kHeads, kHd, kT, kBs);
  src.fill(4);
  const kvxfer_codec_config_t cfg = bf16();
  const kvxfer_request_config_t rc = any_peer(3, 5000);
  kvxfer_request_t s = nullptr, r = nullptr;
  ASSERT_EQ(kvxfer_send(prefill.ep, KVXFER_ANY_PEER, &src.desc, &cfg, &rc, &s), KVXFER_SUCCESS);
  const kvxfer_request_config_t asks = by_id(3);
  ASSERT_EQ(kvxfer_recv(decode.ep, d_p, &dst.desc, &asks, &r), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS);
  EXPECT_EQ(info_peer(s), p_d);
  expect_exact(src, dst, cfg);
  kvxfer_request_free(s);
  kvxfer_request_free(r);
}

// ---------------------------------------------------------------------------
// Peers in other processes: restarted, dead, stalled.
// ---------------------------------------------------------------------------

struct PeerCmd {
  char op;  // 's' send by id, 'q' quit
  uint64_t id;
};

/**
 * A peer process: waits for a 'g' and a port (int32) if `wait_go`, makes an
 * endpoint on `port`
 * (rate `rate`), sends its address up, reads the parent's, connects to it,
 * and sends KV seeded by id when told.  Exit 0 after 'q'.
 */
int peer_process(int rd, int wr, int port, bool wait_go, const char* rate, const char* codec) {
  char g = 0;
  if (wait_go && (!fdio::read_all(rd, &g, 1) || g != 'g' || !fdio::read_all(rd, &port, 4)))
    return 2;  // the port comes with the word to go
  kvxfer_endpoint_config_t cfg = KVXFER_ENDPOINT_CONFIG_INITIALIZER;
  cfg.bind_address = "127.0.0.1";
  cfg.port = port;
  cfg.rate_limit = rate;
  cfg.timeout_ms = kTimeoutMs;
  kvxfer_comm_t ep = nullptr;
  if (kvxfer_endpoint_create(&ep, &cfg) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "peer: %s\n", kvxfer_get_last_error());
    return 3;
  }
  uint8_t a[KVXFER_ENDPOINT_ADDRESS_MAX];
  size_t n = sizeof a;
  kvxfer_endpoint_address(ep, a, &n);
  const uint32_t n32 = static_cast<uint32_t>(n);
  uint32_t plen = 0;
  uint8_t parent[KVXFER_ENDPOINT_ADDRESS_MAX];
  if (!fdio::write_all(wr, &n32, 4) || !fdio::write_all(wr, a, n) ||
      !fdio::read_all(rd, &plen, 4) || plen > sizeof parent || !fdio::read_all(rd, parent, plen))
    return 4;
  int peer = -1;
  if (kvxfer_endpoint_connect(ep, parent, plen, &peer) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "peer: connect: %s\n", kvxfer_get_last_error());
    return 5;
  }
  kvxfer_codec_config_t cc = KVXFER_CODEC_CONFIG_INITIALIZER;
  if (std::string(codec) == "bf16") cc.codec = KVXFER_CODEC_BF16;
  std::vector<std::unique_ptr<PagedKV>> kvs;
  std::vector<kvxfer_request_t> reqs;
  for (;;) {
    PeerCmd c{};
    if (!fdio::read_all(rd, &c, sizeof c)) return 6;
    if (c.op == 'q') break;
    kvs.push_back(std::make_unique<PagedKV>(kL, kHeads, kHd, c.id >= 1000 ? 4096 : kT, kBs));
    kvs.back()->fill(c.id);
    const kvxfer_request_config_t rc = by_id(c.id);
    kvxfer_request_t r = nullptr;
    if (kvxfer_send(ep, peer, &kvs.back()->desc, &cc, &rc, &r) != KVXFER_SUCCESS) return 7;
    reqs.push_back(r);
  }
  for (kvxfer_request_t r : reqs) {
    kvxfer_wait(r, KVXFER_STAGE_COMPLETE, kTimeoutMs);
    kvxfer_request_free(r);
  }
  kvxfer_comm_destroy(ep);
  return 0;
}

/** Reads a peer's address and gives it the parent's. */
std::vector<uint8_t> meet(Child& c, const Ep& parent) {
  uint32_t n = 0;
  std::vector<uint8_t> a(KVXFER_ENDPOINT_ADDRESS_MAX);
  if (!fdio::read_all(c.from_child, &n, 4, 30000) || n > a.size() ||
      !fdio::read_all(c.from_child, a.data(), n, 30000))
    return {};
  a.resize(n);
  const uint32_t m = static_cast<uint32_t>(parent.addr.size());
  fdio::write_all(c.to_child, &m, 4);
  fdio::write_all(c.to_child, parent.addr.data(), m);
  return a;
}

void tell(Child& c, char op, uint64_t id) {
  const PeerCmd cmd{op, id};
  fdio::write_all(c.to_child, &cmd, sizeof cmd);
}

/** A receive by id `id` from `peer`, of KV seeded `id`; checks the bytes. */
void receive_exact(kvxfer_comm_t ep, int peer, Child& c, uint64_t id,
                   const kvxfer_codec_config_t& cfg) {
  PagedKV dst(kL, kHeads, kHd, kT, kBs);
  const kvxfer_request_config_t rc = by_id(id);
  kvxfer_request_t r = nullptr;
  ASSERT_EQ(kvxfer_recv(ep, peer, &dst.desc, &rc, &r), KVXFER_SUCCESS) << kvxfer_get_last_error();
  tell(c, 's', id);
  ASSERT_EQ(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  kvxfer_request_free(r);
  PagedKV src(kL, kHeads, kHd, kT, kBs);
  src.fill(id);
  PagedKV want(kL, kHeads, kHd, kT, kBs);
  expected_decode(src, cfg, kPageTokens, 0, true, &want);
  for (int32_t l = 0; l < kL; ++l)
    for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
      ASSERT_EQ(dst.bytes(l, kind), want.bytes(l, kind)) << "id " << id << " layer " << l;
}

// The first incarnation takes any port (0); the second takes that port again
// at once, while the listener's connections of the first are in TIME_WAIT.
TEST(EndpointPeers, ARestartedPeerAtTheSameAddressIsANewIncarnation) {
  Child first, second;
  ASSERT_TRUE(
      first.start([](int rd, int wr) { return peer_process(rd, wr, 0, false, nullptr, "lynx"); }));
  ASSERT_TRUE(
      second.start([](int rd, int wr) { return peer_process(rd, wr, 0, true, nullptr, "lynx"); }));
  Ep a;
  const std::vector<uint8_t> b1 = meet(first, a);
  ASSERT_FALSE(b1.empty());
  int p1 = -1;
  ASSERT_EQ(kvxfer_endpoint_connect(a.ep, b1.data(), b1.size(), &p1), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  receive_exact(a.ep, p1, first, 1, lynx());
  // A receive the first incarnation never serves: it fails once it is killed.
  PagedKV dst(kL, kHeads, kHd, kT, kBs);
  const kvxfer_request_config_t rc = by_id(2);
  kvxfer_request_t pending = nullptr;
  ASSERT_EQ(kvxfer_recv(a.ep, p1, &dst.desc, &rc, &pending), KVXFER_SUCCESS);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ::kill(first.pid, SIGKILL);
  const auto t_kill = Clock::now();
  EXPECT_LT(kvxfer_wait(pending, KVXFER_STAGE_COMPLETE, 5000), 0);
  const double s = std::chrono::duration<double>(Clock::now() - t_kill).count();
  EXPECT_LT(s, 1.5) << "the dead incarnation's request ended after " << s
                    << " s: " << kvxfer_get_last_error();
  kvxfer_request_free(pending);
  first.wait(10);
  // The second incarnation, at the same address.
  xfer::EndpointAddress first_at;
  ASSERT_EQ(xfer::decode_endpoint_address(b1.data(), b1.size(), &first_at), KVXFER_SUCCESS);
  const int port = ntohs(first_at.port_be);
  fdio::write_all(second.to_child, "g", 1);
  fdio::write_all(second.to_child, &port, 4);
  const std::vector<uint8_t> b2 = meet(second, a);
  ASSERT_EQ(b2.size(), b1.size());
  EXPECT_NE(b2, b1);
  EXPECT_EQ(std::memcmp(b2.data() + 16, b1.data() + 16, 24), 0) << "same listener address";
  int p = -1;
  expect_error(kvxfer_endpoint_connect(a.ep, b1.data(), b1.size(), &p), KVXFER_ERR_MISMATCH,
               "restarted");
  int p2 = -1;
  ASSERT_EQ(kvxfer_endpoint_connect(a.ep, b2.data(), b2.size(), &p2), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  EXPECT_NE(p2, p1);
  receive_exact(a.ep, p2, second, 3, lynx());
  tell(second, 'q', 0);
  EXPECT_TRUE(second.wait(30));
  EXPECT_EQ(WEXITSTATUS(second.status), 0);
}

TEST(EndpointPeers, ADeadPeerAt50MbitFailsItsRequestsWithinASecondAndAHalf) {
  Child c;
  ASSERT_TRUE(
      c.start([](int rd, int wr) { return peer_process(rd, wr, 0, false, "50mbit", "bf16"); }));
  Ep a, b;
  const std::vector<uint8_t> blob = meet(c, a);
  ASSERT_FALSE(blob.empty());
  int p = -1;
  ASSERT_EQ(kvxfer_endpoint_connect(a.ep, blob.data(), blob.size(), &p), KVXFER_SUCCESS);
  PagedKV dst(kL, kHeads, kHd, 4096, kBs);  // 4 MiB: over 0.6 s at 50 mbit
  const kvxfer_request_config_t rc = by_id(1000);
  kvxfer_request_t r = nullptr;
  ASSERT_EQ(kvxfer_recv(a.ep, p, &dst.desc, &rc, &r), KVXFER_SUCCESS);
  tell(c, 's', 1000);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  kvxfer_stage_t st;
  ASSERT_EQ(kvxfer_test(r, &st), KVXFER_IN_PROGRESS) << "finished before the kill";
  ::kill(c.pid, SIGKILL);
  const auto t_kill = Clock::now();
  EXPECT_LT(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 10000), 0);
  const double s = std::chrono::duration<double>(Clock::now() - t_kill).count();
  EXPECT_LT(s, 1.5) << kvxfer_get_last_error();
  kvxfer_request_free(r);
  c.wait(10);
  // This endpoint goes on with its other peers.
  const int ab = a.connect(b), ba = b.connect(a);
  transfer_exact(b.ep, ba, a.ep, ab, 4, 4, lynx());
}

// A peer killed between requests is found as one killed mid-transfer is:
// within 1.5 s its index refuses posts at the call, and a connect to its
// blob no longer returns the dead index but tries afresh (and fails: no one
// listens there).
TEST(EndpointPeers, AnIdlePeerThatDiesIsFoundWithinASecondAndAHalf) {
  Child c;
  ASSERT_TRUE(
      c.start([](int rd, int wr) { return peer_process(rd, wr, 0, false, nullptr, "bf16"); }));
  Ep a;
  const std::vector<uint8_t> blob = meet(c, a);
  ASSERT_FALSE(blob.empty());
  int p = -1;
  ASSERT_EQ(kvxfer_endpoint_connect(a.ep, blob.data(), blob.size(), &p), KVXFER_SUCCESS);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // idle, connected
  ::kill(c.pid, SIGKILL);
  const auto t_kill = Clock::now();
  c.wait(10);
  // Nothing is posted meanwhile (a posted request would have the link
  // watched anyway): the connect returns the old index until the death is found.
  kvxfer_result_t connected = KVXFER_SUCCESS;
  double s = 0;
  int q = p;
  while (s < 5.0) {
    connected = kvxfer_endpoint_connect(a.ep, blob.data(), blob.size(), &q);
    if (connected != KVXFER_SUCCESS) break;
    EXPECT_EQ(q, p);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    s = std::chrono::duration<double>(Clock::now() - t_kill).count();
  }
  EXPECT_EQ(connected, KVXFER_ERR_SYSTEM) << kvxfer_get_last_error();
  EXPECT_EQ(q, -1);
  EXPECT_LT(s, 1.5);
  PagedKV dst(kL, kHeads, kHd, kT, kBs);
  const kvxfer_request_config_t rc = by_id(1002);
  kvxfer_request_t r = nullptr;
  expect_error(kvxfer_recv(a.ep, p, &dst.desc, &rc, &r), KVXFER_ERR_INVALID_USAGE,
               "is disconnected");
}

TEST(EndpointPeers, AStalledPeerTimesOutAndTheEndpointLivesOn) {
  Child c;
  ASSERT_TRUE(
      c.start([](int rd, int wr) { return peer_process(rd, wr, 0, false, "50mbit", "lynx"); }));
  Ep a(nullptr, 0, 2000), b;
  const std::vector<uint8_t> blob = meet(c, a);
  ASSERT_FALSE(blob.empty());
  int p = -1;
  ASSERT_EQ(kvxfer_endpoint_connect(a.ep, blob.data(), blob.size(), &p), KVXFER_SUCCESS);
  PagedKV dst(kL, kHeads, kHd, 4096, kBs);
  const kvxfer_request_config_t rc = by_id(1001);
  kvxfer_request_t r = nullptr;
  ASSERT_EQ(kvxfer_recv(a.ep, p, &dst.desc, &rc, &r), KVXFER_SUCCESS);
  tell(c, 's', 1001);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ::kill(c.pid, SIGSTOP);
  const auto t_stop = Clock::now();
  expect_error(kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 10000), KVXFER_ERR_TIMEOUT, "");
  const double s = std::chrono::duration<double>(Clock::now() - t_stop).count();
  EXPECT_LT(s, 2.0 + 3.0);  // the 2 s timeout, and slack for a loaded machine
  kvxfer_request_free(r);
  // The endpoint goes on with its other peers, a second later too.
  const int ab = a.connect(b), ba = b.connect(a);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  transfer_exact(b.ep, ba, a.ep, ab, 5, 5, lynx());
  ::kill(c.pid, SIGKILL);
  c.wait(10);
}

// ---------------------------------------------------------------------------
// Many peers, and connects racing with posts.
// ---------------------------------------------------------------------------
TEST(Endpoint, SixtyFourRequestsInFlightOverFourPeersAreExact) {
  Ep d;
  std::vector<std::unique_ptr<Ep>> pre;
  for (int i = 0; i < 4; ++i) pre.push_back(std::make_unique<Ep>());
  std::vector<int> dp(4), pd(4);
  for (int i = 0; i < 4; ++i) {
    pd[i] = pre[i]->connect(d);
    dp[i] = d.connect(*pre[i]);
  }
  const kvxfer_codec_config_t cfg = lynx();
  std::vector<std::unique_ptr<PagedKV>> src, dst;
  std::vector<kvxfer_request_t> sends, recvs;
  std::vector<uint64_t> order;
  for (uint64_t id = 1; id <= 64; ++id) order.push_back(id);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(9));
  for (uint64_t id : order) {  // receives first, in a shuffled order
    dst.push_back(std::make_unique<PagedKV>(kL, kHeads, kHd, kT, kBs));
    const kvxfer_request_config_t rc = by_id(id);
    kvxfer_request_t r = nullptr;
    ASSERT_EQ(kvxfer_recv(d.ep, dp[id % 4], &dst.back()->desc, &rc, &r), KVXFER_SUCCESS)
        << kvxfer_get_last_error();
    recvs.push_back(r);
  }
  for (uint64_t id = 1; id <= 64; ++id) {
    src.push_back(std::make_unique<PagedKV>(kL, kHeads, kHd, kT, kBs));
    src.back()->fill(id);
    const kvxfer_request_config_t rc = by_id(id);
    kvxfer_request_t s = nullptr;
    ASSERT_EQ(kvxfer_send(pre[id % 4]->ep, pd[id % 4], &src.back()->desc, &cfg, &rc, &s),
              KVXFER_SUCCESS)
        << kvxfer_get_last_error();
    sends.push_back(s);
  }
  for (size_t i = 0; i < recvs.size(); ++i) {
    ASSERT_EQ(kvxfer_wait(recvs[i], KVXFER_STAGE_COMPLETE, 120000), KVXFER_SUCCESS)
        << kvxfer_get_last_error();
    PagedKV want(kL, kHeads, kHd, kT, kBs);
    expected_decode(*src[order[i] - 1], cfg, kPageTokens, 0, true, &want);
    for (int32_t l = 0; l < kL; ++l)
      for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
        ASSERT_EQ(dst[i]->bytes(l, kind), want.bytes(l, kind)) << "id " << order[i];
  }
  for (kvxfer_request_t s : sends) {
    EXPECT_EQ(kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 60000), KVXFER_SUCCESS);
    kvxfer_request_free(s);
  }
  for (kvxfer_request_t r : recvs) kvxfer_request_free(r);
}

TEST(Endpoint, ConnectsAndDisconnectsRacingWithPostsNeverHangOrCorrupt) {
  Ep a, b;
  std::atomic<bool> racing{true}, finished{false};
  int completed = 0, failed = 0, refused = 0;
  const kvxfer_codec_config_t cfg = lynx();
  // A thread disconnects one side or the other at random moments, first 20
  // times, then every 100 ms until the posts stop (which ends a request whose
  // partner was refused).  Meanwhile this thread connects and posts pairs by
  // id, each side on the peer index it has now.
  std::thread disc([&] {
    std::mt19937 rng(5);
    for (int i = 0; !finished.load(); ++i) {
      if (i == 20) racing = false;
      std::this_thread::sleep_for(std::chrono::milliseconds(racing ? 20 + rng() % 80 : 100));
      Ep& side = (rng() & 1) != 0 ? a : b;
      const Ep& other = &side == &a ? b : a;
      int p = -1;
      if (kvxfer_endpoint_connect(side.ep, other.addr.data(), other.addr.size(), &p) ==
          KVXFER_SUCCESS)
        kvxfer_endpoint_disconnect(side.ep, p);  // INVALID_USAGE if already gone: fine
    }
  });
  PagedKV src(kL, kHeads, kHd, kT, kBs);
  src.fill(42);
  PagedKV want(kL, kHeads, kHd, kT, kBs);
  expected_decode(src, cfg, kPageTokens, 0, true, &want);
  for (uint64_t id = 1; racing.load(); ++id) {
    int pa = -1, pb = -1;
    if (kvxfer_endpoint_connect(a.ep, b.addr.data(), b.addr.size(), &pa) != KVXFER_SUCCESS ||
        kvxfer_endpoint_connect(b.ep, a.addr.data(), a.addr.size(), &pb) != KVXFER_SUCCESS) {
      ++refused;
      continue;
    }
    PagedKV dst(kL, kHeads, kHd, kT, kBs);
    const kvxfer_request_config_t rc = by_id(id);
    kvxfer_request_t r = nullptr, s = nullptr;
    const kvxfer_result_t pr = kvxfer_recv(b.ep, pb, &dst.desc, &rc, &r);
    const kvxfer_result_t ps = kvxfer_send(a.ep, pa, &src.desc, &cfg, &rc, &s);
    for (kvxfer_result_t posted : {pr, ps})  // refused at the call: the peer is gone
      if (posted != KVXFER_SUCCESS) {
        EXPECT_EQ(posted, KVXFER_ERR_INVALID_USAGE) << kvxfer_get_last_error();
        ++refused;
      }
    // Each ends, in well under the timeout: never hangs.
    kvxfer_result_t wr = KVXFER_ERR_INTERNAL, ws = KVXFER_ERR_INTERNAL;
    if (r != nullptr) wr = kvxfer_wait(r, KVXFER_STAGE_COMPLETE, 15000);
    if (s != nullptr) ws = kvxfer_wait(s, KVXFER_STAGE_COMPLETE, 15000);
    for (kvxfer_result_t w : {wr, ws}) EXPECT_NE(w, KVXFER_ERR_TIMEOUT) << "id " << id;
    if (r != nullptr && wr == KVXFER_SUCCESS) {
      ++completed;
      for (int32_t l = 0; l < kL; ++l)
        for (auto kind : {KVXFER_KV_KEY, KVXFER_KV_VALUE})
          ASSERT_EQ(dst.bytes(l, kind), want.bytes(l, kind)) << "id " << id << " layer " << l;
    } else if (r != nullptr) {
      ++failed;
    }
    kvxfer_request_free(r);
    kvxfer_request_free(s);
  }
  finished = true;
  disc.join();
  EXPECT_GT(completed, 0);
  EXPECT_GT(failed + refused, 0) << "no disconnect hit a request";
  // And after it all, a clean transfer.
  const int ab = a.connect(b), ba = b.connect(a);
  transfer_exact(a.ep, ab, b.ep, ba, 999999, 7, lynx());
}

/** The head of a handshake answer: magic, status, the listener's incarnation. */
struct Answer {
  uint32_t magic = 0;
  xfer::HandshakeStatus status = xfer::HandshakeStatus::kBad;
  uint64_t incarnation = 0;
};

/** Sends `to`'s listener a CONNECT from `from` (its blob, with `to`'s
 *  secret) offering link address `link`; the answer's head. */
Answer send_connect(const Ep& to, const xfer::EndpointAddress& from,
                    const std::vector<uint8_t>& link) {
  namespace tcp = transport::tcp;
  xfer::EndpointAddress at;
  EXPECT_EQ(xfer::decode_endpoint_address(to.addr.data(), to.addr.size(), &at), KVXFER_SUCCESS);
  const std::vector<uint8_t> blob = xfer::encode_endpoint_address(from);
  std::vector<uint8_t> f(4);  // the CONNECT frame of endpoint.cc's exchange()
  tcp::put_u32(&f, xfer::kHandshakeMagic);
  tcp::put_u16(&f, xfer::kHandshakeVersion);
  tcp::put_u16(&f, 1);  // CONNECT
  tcp::put_u32(&f, 0);  // flags
  f.insert(f.end(), at.secret.begin(), at.secret.end());
  tcp::put_u64(&f, from.incarnation);
  tcp::put_u64(&f, at.incarnation);
  tcp::put_u32(&f, static_cast<uint32_t>(blob.size()));
  f.insert(f.end(), blob.begin(), blob.end());
  tcp::put_u32(&f, static_cast<uint32_t>(link.size()));
  f.insert(f.end(), link.begin(), link.end());
  tcp::finish_frame(&f);
  tcp::Fd fd = dial_listener(at);
  const tcp::Deadline d = tcp::deadline_after(5000);
  bool closed = false;
  EXPECT_EQ(tcp::send_all(fd.get(), f.data(), f.size(), d, "test", "CONNECT", &closed),
            KVXFER_SUCCESS);
  uint8_t head[4 + 16];  // length prefix, magic, version, status, incarnation
  Answer a;
  if (tcp::recv_all(fd.get(), head, sizeof head, d, "test", "the answer", &closed) !=
      KVXFER_SUCCESS)
    return a;
  a.magic = tcp::get_u32(head + 4);
  a.status = static_cast<xfer::HandshakeStatus>(tcp::get_u16(head + 10));
  a.incarnation = tcp::get_u64(head + 12);
  return a;
}

/** The address of a Link that is never progressed: a peer that starts a
 *  handshake and never finishes it. */
std::unique_ptr<transport::Link> silent_link() {
  transport::LinkConfig lc;
  EXPECT_EQ(transport::LinkConfig::from_params(&lc), KVXFER_SUCCESS);
  std::unique_ptr<transport::Link> link;
  EXPECT_EQ(transport::Link::create(lc, &link), KVXFER_SUCCESS) << last_error();
  return link;
}

// A CONNECT that names the listener's own incarnation as its sender (a
// replayed or forged frame with the right secret) is refused as malformed;
// before, the endpoint made itself a peer.  The next real peer takes index 0.
TEST(Endpoint, AConnectFromTheListenersOwnIncarnationIsRefused) {
  Ep a, b;
  xfer::EndpointAddress at;
  ASSERT_EQ(xfer::decode_endpoint_address(a.addr.data(), a.addr.size(), &at), KVXFER_SUCCESS);
  ASSERT_TRUE(at.has_secret);
  const Answer ans = send_connect(a, at, std::vector<uint8_t>(40, 0x11));  // from: a itself
  EXPECT_EQ(ans.magic, xfer::kHandshakeMagic);
  EXPECT_EQ(ans.status, xfer::HandshakeStatus::kBad);
  EXPECT_EQ(ans.incarnation, at.incarnation);
  EXPECT_EQ(a.connect(b), 0) << "a peer slot went to the listener itself";
  EXPECT_EQ(b.connect(a), 0);
  transfer_exact(a.ep, 0, b.ep, 0, 4, 4, bf16());
}

// A CONNECT from a new incarnation that claims the listener address of a
// live peer (any holder of the blob can send one, with the secret it
// carries) does not end that peer: before, its requests failed with "the
// endpoint ... restarted" though it had not.
TEST(Endpoint, AConnectClaimingALivePeersAddressDoesNotEndIt) {
  Ep a, b;
  const int ab = a.connect(b), ba = b.connect(a);
  ASSERT_GE(ab, 0);
  ASSERT_GE(ba, 0);
  xfer::EndpointAddress claim;
  ASSERT_EQ(xfer::decode_endpoint_address(b.addr.data(), b.addr.size(), &claim), KVXFER_SUCCESS);
  claim.incarnation ^= 0x5a5a5a5a5a5aull;  // "b restarted"
  const std::unique_ptr<transport::Link> link = silent_link();
  ASSERT_TRUE(link);
  ASSERT_EQ(send_connect(a, claim, link->local_address()).status, xfer::HandshakeStatus::kOk);
  // The real b is still a's peer ab, and moves exact bytes both ways.
  EXPECT_EQ(a.connect(b), ab);
  transfer_exact(a.ep, ab, b.ep, ba, 11, 11, lynx());
  transfer_exact(b.ep, ba, a.ep, ab, 12, 12, bf16());
}

// Peers that start a handshake and never finish it are bounded: past the
// limit a CONNECT is answered "busy" (ERROR) and opens no Link, so a holder
// of the blob cannot make the endpoint open Links faster than they time out
// (a flood of 300 took 2.9 GB and 6,584 fds).  Once they time out, a real
// peer connects again.
TEST(Endpoint, PeersStillHandshakingAreBoundedAndABusyConnectFailsClearly) {
  auto hooks = std::make_shared<xfer::TestHooks>();
  hooks->max_handshaking = 2;
  Ep a(nullptr, 0, 3000, nullptr, hooks), b;  // its silent handshakes end after 3 s
  ASSERT_NE(a.ep, nullptr);
  xfer::EndpointAddress from;
  ASSERT_EQ(xfer::decode_endpoint_address(b.addr.data(), b.addr.size(), &from), KVXFER_SUCCESS);
  std::vector<std::unique_ptr<transport::Link>> silent;
  for (int i = 0; i < 3; ++i) {
    silent.push_back(silent_link());
    ASSERT_TRUE(silent.back());
    from.incarnation += 1;
    from.port_be = htons(static_cast<uint16_t>(40000 + i));  // three "peers"
    const xfer::HandshakeStatus want =
        i < 2 ? xfer::HandshakeStatus::kOk : xfer::HandshakeStatus::kError;
    const xfer::HandshakeStatus got = send_connect(a, from, silent.back()->local_address()).status;
    EXPECT_EQ(static_cast<int>(got), static_cast<int>(want)) << "CONNECT " << i;
  }
  int p = -1;
  expect_error(kvxfer_endpoint_connect(b.ep, a.addr.data(), a.addr.size(), &p), KVXFER_ERR_SYSTEM,
               "busy: 2 peers of this endpoint are still in their handshake");
  // The two silent handshakes time out (3 s), and b gets in.
  kvxfer_result_t r = KVXFER_ERR_SYSTEM;
  for (auto until = Clock::now() + std::chrono::seconds(15);
       r != KVXFER_SUCCESS && Clock::now() < until;
       std::this_thread::sleep_for(std::chrono::milliseconds(200)))
    r = kvxfer_endpoint_connect(b.ep, a.addr.data(), a.addr.size(), &p);
  ASSERT_EQ(r, KVXFER_SUCCESS) << kvxfer_get_last_error();
  transfer_exact(b.ep, p, a.ep, a.connect(b), 13, 13, lynx());
}

// An aborted endpoint takes no new peer: its own connects fail at the call,
// and its listener refuses the connects of others, who are told why.
TEST(Endpoint, AnAbortedEndpointTakesNoNewPeer) {
  Ep a, b, c;
  ASSERT_EQ(a.connect(b), 0);
  ASSERT_EQ(kvxfer_comm_abort(a.ep), KVXFER_SUCCESS);
  int p = -1;
  expect_error(kvxfer_endpoint_connect(a.ep, c.addr.data(), c.addr.size(), &p),
               KVXFER_ERR_INVALID_USAGE, "aborted");
  EXPECT_EQ(p, -1);
  expect_error(kvxfer_endpoint_connect(a.ep, b.addr.data(), b.addr.size(), &p),
               KVXFER_ERR_INVALID_USAGE, "aborted");
  expect_error(kvxfer_endpoint_connect(c.ep, a.addr.data(), a.addr.size(), &p), KVXFER_ERR_SYSTEM,
               "the endpoint was aborted");
  EXPECT_EQ(p, -1);
  // c itself is fine.
  EXPECT_EQ(c.connect(b), 0);
}

// A listener that answers a CONNECT with an answer no endpoint sends: an OK
// whose link address is not one, or a status past the known ones.  Both are
// the peer's bytes: KVXFER_ERR_CORRUPT, not the caller's INVALID_ARGUMENT.
TEST(Endpoint, AMalformedAnswerIsCorrupt) {
  namespace tcp = transport::tcp;
  struct Case {
    uint16_t status;
    size_t link_bytes;
    const char* words;
  } const cases[] = {{0, 40, "not a kvxfer link address"},
                     {0, 0, "answered OK without a link address"},
                     {77, 40, "answered with status 77"}};
  for (const Case& k : cases) {
    SCOPED_TRACE(k.words);
    const uint16_t status = k.status;
    Ep a, b;
    tcp::Fd lst(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t sl = sizeof sa;
    ASSERT_EQ(::bind(lst.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa), 0);
    ASSERT_EQ(::listen(lst.get(), 4), 0);
    ASSERT_EQ(::getsockname(lst.get(), reinterpret_cast<sockaddr*>(&sa), &sl), 0);
    // b's blob, pointing at this listener.
    xfer::EndpointAddress at;
    ASSERT_EQ(xfer::decode_endpoint_address(b.addr.data(), b.addr.size(), &at), KVXFER_SUCCESS);
    at.port_be = sa.sin_port;
    const std::vector<uint8_t> blob = xfer::encode_endpoint_address(at);
    std::thread fake([&] {
      tcp::Fd c(::accept4(lst.get(), nullptr, nullptr, SOCK_CLOEXEC));
      const tcp::Deadline d = tcp::deadline_after(5000);
      bool closed = false;
      uint8_t len[4];
      if (tcp::recv_all(c.get(), len, 4, d, "test", "CONNECT", &closed) != KVXFER_SUCCESS) return;
      std::vector<uint8_t> body(tcp::get_u32(len));
      if (tcp::recv_all(c.get(), body.data(), body.size(), d, "test", "CONNECT", &closed) !=
          KVXFER_SUCCESS)
        return;
      std::vector<uint8_t> f(4);
      tcp::put_u32(&f, xfer::kHandshakeMagic);
      tcp::put_u16(&f, xfer::kHandshakeVersion);
      tcp::put_u16(&f, status);
      tcp::put_u64(&f, at.incarnation);
      const std::vector<uint8_t> link(k.link_bytes, 0x11);  // not a Link address
      tcp::put_u32(&f, static_cast<uint32_t>(link.size()));
      f.insert(f.end(), link.begin(), link.end());
      tcp::put_u32(&f, 0);  // no reason
      tcp::finish_frame(&f);
      (void)tcp::send_all(c.get(), f.data(), f.size(), d, "test", "the answer", &closed);
    });
    int p = -1;
    expect_error(kvxfer_endpoint_connect(a.ep, blob.data(), blob.size(), &p), KVXFER_ERR_CORRUPT,
                 k.words);
    EXPECT_EQ(p, -1);
    fake.join();
  }
}

// A process out of file descriptors: a connection waits in the listener's
// backlog and accept4 fails with EMFILE each time.  The acceptor pauses
// (100 ms a time) instead of spinning a core (95% before), and accepts again
// once descriptors are free.  In a child, whose descriptor limit it lowers.
TEST(Endpoint, OutOfDescriptorsTheListenerPausesAndRecovers) {
  test::Child child;
  ASSERT_TRUE(child.start([](int, int) {
    Ep a;
    if (a.ep == nullptr) return 10;
    xfer::EndpointAddress at;
    if (xfer::decode_endpoint_address(a.addr.data(), a.addr.size(), &at) != KVXFER_SUCCESS)
      return 11;
    rlimit lim{};
    getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = 256;
    if (setrlimit(RLIMIT_NOFILE, &lim) != 0) return 12;
    std::vector<int> hog;
    for (int fd; (fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) hog.push_back(fd);
    // A connection made with the last free descriptor: none is left to
    // accept it, so it waits in the backlog.
    ::close(hog.back());
    hog.pop_back();
    transport::tcp::Fd waiting = dial_listener(at);
    auto cpu_s = [] {
      rusage u{};
      getrusage(RUSAGE_SELF, &u);
      return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
             1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
    };
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const double c0 = cpu_s();
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    const double used = cpu_s() - c0;
    std::printf("[ emfile ] process CPU over 1.5 s with the backlog unaccepted: %.3f s\n", used);
    std::fflush(stdout);
    for (int fd : hog) ::close(fd);
    if (used > 0.5) return 13;  // spinning: about 1.4 s
    Ep b;
    int p = -1;
    if (kvxfer_endpoint_connect(b.ep, a.addr.data(), a.addr.size(), &p) != KVXFER_SUCCESS)
      return 14;
    return 0;
  }));
  ASSERT_TRUE(child.wait(60));
  ASSERT_TRUE(WIFEXITED(child.status));
  EXPECT_EQ(WEXITSTATUS(child.status), 0) << "13: the acceptor spun; others: setup";
}

// Two connected endpoints of two processes (a shared-memory link) with
// nothing to do sleep: the standing receive of each peer's ask stream keeps
// no progress thread polling (Link::ops_awaited).  Polling wakes a thread
// about 1,000 times a second.
TEST(Endpoint, AnIdleSharedMemoryPairSleeps) {
  test::Child child;
  ASSERT_TRUE(child.start([](int rd, int wr) {
    Ep a;
    const uint32_t n = static_cast<uint32_t>(a.addr.size());
    if (a.ep == nullptr || !fdio::write_all(wr, &n, sizeof n) ||
        !fdio::write_all(wr, a.addr.data(), n))
      return 10;
    char go;
    if (!fdio::read_all(rd, &go, 1)) return 11;  // the parent connected
    auto switches = [] {
      rusage u{};
      getrusage(RUSAGE_SELF, &u);
      return u.ru_nvcsw + u.ru_nivcsw;
    };
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const long c0 = switches();
    std::this_thread::sleep_for(std::chrono::seconds(1));
    const long used = switches() - c0;
    std::printf("[ idle ] context switches in 1 s of an idle endpoint: %ld\n", used);
    std::fflush(stdout);
    (void)!fdio::write_all(wr, &go, 1);
    return used > 400 ? 13 : 0;
  }));
  uint32_t n = 0;
  ASSERT_TRUE(fdio::read_all(child.from_child, &n, sizeof n));
  std::vector<uint8_t> addr(n);
  ASSERT_TRUE(fdio::read_all(child.from_child, addr.data(), n));
  Ep b;
  int p = -1;
  ASSERT_EQ(kvxfer_endpoint_connect(b.ep, addr.data(), addr.size(), &p), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_TRUE(fdio::write_all(child.to_child, "g", 1));
  char done;
  EXPECT_TRUE(fdio::read_all(child.from_child, &done, 1));
  ASSERT_TRUE(child.wait(60));
  ASSERT_TRUE(WIFEXITED(child.status));
  EXPECT_EQ(WEXITSTATUS(child.status), 0) << "13: an idle progress thread polls";
}

// Two threads connect and disconnect the same pair from both sides at once,
// both endpoints alive all along: every connect succeeds (before, a connect
// that met a racing disconnect failed with TIMEOUT or INTERNAL).
TEST(Endpoint, ConnectsFromBothSidesRacingWithDisconnectsAllSucceed) {
  Ep a, b;
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0};
  std::vector<std::string> errors[2];
  auto loop = [&](int side) {
    Ep& me = side == 0 ? a : b;
    const Ep& other = side == 0 ? b : a;
    while (!stop.load()) {
      int p = -1;
      if (kvxfer_endpoint_connect(me.ep, other.addr.data(), other.addr.size(), &p) !=
          KVXFER_SUCCESS) {
        errors[side].push_back(kvxfer_get_last_error());
        continue;
      }
      ++ok;
      (void)kvxfer_endpoint_disconnect(me.ep, p);  // may already be gone: the other side's
    }
  };
  std::thread t0(loop, 0), t1(loop, 1);
  std::this_thread::sleep_for(std::chrono::seconds(3));
  stop = true;
  t0.join();
  t1.join();
  std::printf("[ race ] %d connects, %zu + %zu failed\n", ok.load(), errors[0].size(),
              errors[1].size());
  EXPECT_GT(ok.load(), 20);
  for (const auto& e : errors)
    EXPECT_TRUE(e.empty()) << e.size() << " connects failed, the first: " << e.front();
}

}  // namespace
}  // namespace kvxfer
