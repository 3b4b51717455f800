// Tests of the libfabric layer (src/transport/): rate parsing and the token
// bucket, traffic-class mapping, and two-endpoint loopback transfers (in one
// process, or between two processes joined by pipes).  Every transfer goes to
// 127.0.0.1 only, and every wait is bounded: a hang fails the test instead of
// blocking it.
#include "transport/ofi.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/fdio.h"
#include "fork_child.h"
#include "transport/dscp.h"
#include "transport/rate_limiter.h"
#include "transport/shm_reaper.h"
#include "transport/smr_region.h"

namespace kvxfer::transport {
namespace {

using std::chrono::milliseconds;
using Sec = std::chrono::duration<double>;

constexpr TrafficClass kA = TrafficClass::kAnchor;
constexpr TrafficClass kR = TrafficClass::kResidual;

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
/** Byte i of the test pattern `seed`: a pure function of (seed, i). */
uint8_t pattern_byte(uint64_t seed, uint64_t i) {
  return static_cast<uint8_t>(splitmix64(seed * 0x100000001B3ull + (i >> 3)) >> (8 * (i & 7)));
}
std::vector<uint8_t> pattern(uint64_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t w = 0; w < n; w += 8) {  // the same bytes as pattern_byte, a word at a time
    const uint64_t x = splitmix64(seed * 0x100000001B3ull + (w >> 3));
    for (size_t j = 0; j < 8 && w + j < n; ++j) v[w + j] = static_cast<uint8_t>(x >> (8 * j));
  }
  return v;
}
/** "" when equal, else where the first difference is. */
std::string compare(const std::vector<uint8_t>& got, uint64_t seed, size_t n) {
  if (got.size() < n) return "buffer too short";
  for (size_t i = 0; i < n; ++i)
    if (got[i] != pattern_byte(seed, i)) {
      char b[128];
      std::snprintf(b, sizeof(b), "byte %zu: got 0x%02x, want 0x%02x", i, got[i],
                    pattern_byte(seed, i));
      return b;
    }
  return "";
}

/** The provider under test: KVXFER_TEST_OFI_PROVIDER (the survey sets it), else auto. */
std::string provider_under_test() {
  const char* p = std::getenv("KVXFER_TEST_OFI_PROVIDER");
  return p != nullptr ? p : "";
}

/** True when the run may take shared memory: the auto provider, or shm named. */
bool shm_under_test() {
  const std::string p = provider_under_test();
  return p.empty() || p == kShmProvider;
}

LinkConfig loopback_config(const std::string& provider = provider_under_test()) {
  LinkConfig cfg;
  cfg.provider = provider;
  cfg.node = "127.0.0.1";  // tests talk to 127.0.0.0/8 only
  cfg.timeout_ms = 15000;
  return cfg;
}

/** loopback_config() on a network provider: the one under test, else auto's first. */
LinkConfig network_config() {
  const std::string p = provider_under_test();
  return loopback_config(p.empty() ? auto_providers()[0] : p);
}

struct Driver {
  std::vector<Link*> links;
  std::map<Link*, std::vector<Completion>> done;

  /** Drives every link until pred() or the deadline; false on deadline. */
  bool until(const std::function<bool()>& pred, double seconds) {
    const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(Sec(seconds));
    while (!pred()) {
      if (Clock::now() > end) return false;
      for (Link* l : links) l->poll(&done[l]);
    }
    return true;
  }
  const Completion* find(Link* l, uint64_t op) {
    for (const Completion& c : done[l])
      if (c.op_id == op) return &c;
    return nullptr;
  }
  bool finished(Link* l, const std::vector<uint64_t>& ops) {
    for (uint64_t op : ops)
      if (find(l, op) == nullptr) return false;
    return true;
  }
};

/** Two connected links in this process (a and b), both ready. */
struct Pair {
  std::unique_ptr<Link> a, b;
  Driver drv;
};
::testing::AssertionResult make_pair(const LinkConfig& ca, const LinkConfig& cb, Pair* p) {
  if (Link::create(ca, &p->a) != KVXFER_SUCCESS)
    return ::testing::AssertionFailure() << "create a: " << kvxfer_get_last_error();
  if (Link::create(cb, &p->b) != KVXFER_SUCCESS)
    return ::testing::AssertionFailure() << "create b: " << kvxfer_get_last_error();
  if (p->a->connect(p->b->local_address().data(), p->b->local_address().size()) != KVXFER_SUCCESS)
    return ::testing::AssertionFailure() << "connect a: " << kvxfer_get_last_error();
  if (p->b->connect(p->a->local_address().data(), p->a->local_address().size()) != KVXFER_SUCCESS)
    return ::testing::AssertionFailure() << "connect b: " << kvxfer_get_last_error();
  p->drv.links = {p->a.get(), p->b.get()};
  if (!p->drv.until([&] { return p->a->ready() && p->b->ready(); }, 30))
    return ::testing::AssertionFailure() << "handshake did not finish (a failed " << p->a->failed()
                                         << ", b failed " << p->b->failed() << ")";
  return ::testing::AssertionSuccess();
}

// Pipes between two processes.
using kvxfer::fdio::read_all;  // common/fdio.h
using kvxfer::fdio::write_all;
bool send_blob(int fd, const std::vector<uint8_t>& b) {
  const uint32_t n = static_cast<uint32_t>(b.size());
  return write_all(fd, &n, 4) && write_all(fd, b.data(), b.size());
}
bool recv_blob(int fd, std::vector<uint8_t>* b, int timeout_ms) {
  uint32_t n = 0;
  if (!read_all(fd, &n, 4, timeout_ms) || n > (1u << 20)) return false;
  b->resize(n);
  return read_all(fd, b->data(), n, timeout_ms);
}

using test::Child;  // tests/fork_child.h
using test::readable;

// ---------------------------------------------------------------------------
// Rate strings and the token bucket
// ---------------------------------------------------------------------------
TEST(ofiRate, ParsesTcUnits) {
  struct Case {
    const char* text;
    double bytes_per_sec;
  } ok[] = {
      {"", 0},
      {"25gbit", 25e9 / 8},
      {"1gbit", 1e9 / 8},
      {"500mbit", 500e6 / 8},
      {"200mbit", 25e6},
      {"1.5gbit", 1.5e9 / 8},
      {"100kbit", 100e3 / 8},
      {"8bit", 1},
      {"100mbps", 100e6},  // tc: bps = bytes per second
      {"2kbps", 2000},
      {"1mibit", 1024.0 * 1024 / 8},
      {"1gibps", 1024.0 * 1024 * 1024},
      {"10GBIT", 10e9 / 8},
      {"3Mbit", 3e6 / 8},
      {"1tbit", 1e12 / 8},
  };
  for (const auto& c : ok) {
    double v = -1;
    std::string why;
    EXPECT_TRUE(parse_rate(c.text, &v, &why)) << "'" << c.text << "': " << why;
    EXPECT_DOUBLE_EQ(v, c.bytes_per_sec) << c.text;
  }
  const char* bad[] = {"25",      "25g",    "gbit",   "25 gbit", " 25gbit", "25gbit ",
                       "-1gbit",  "+1gbit", "0gbit",  "0bit",    "1e9bit",  "1.2.3gbit",
                       "25gbits", "25gb",   "25xbit", "abc",     "1kibit2", "nanbit",
                       "infbit",  "1kkbit", ".bit",   "1bit/s",  "1gbit\n", "4bit"};
  for (const char* b : bad) {
    double v = -1;
    std::string why;
    EXPECT_FALSE(parse_rate(b, &v, &why)) << "'" << b << "' was accepted as " << v;
    EXPECT_FALSE(why.empty()) << b;
  }
}

TEST(ofiRate, TokenBucketWithFakeClock) {
  const Clock::time_point t0{};  // fake clock
  RateLimiter rl(1000.0, 100);   // 1000 B/s, 100 B burst
  EXPECT_TRUE(rl.try_acquire(100, t0));
  EXPECT_FALSE(rl.try_acquire(1, t0));
  EXPECT_EQ(rl.wait_hint(10, t0), std::chrono::duration_cast<Clock::duration>(milliseconds(10)));
  EXPECT_FALSE(rl.try_acquire(60, t0 + milliseconds(50)));
  EXPECT_TRUE(rl.try_acquire(50, t0 + milliseconds(50)));
  // A chunk larger than the burst passes once the bucket is full, then the
  // bucket owes the difference.
  EXPECT_FALSE(rl.try_acquire(300, t0 + milliseconds(149)));
  EXPECT_TRUE(rl.try_acquire(300, t0 + milliseconds(150)));  // 100 tokens -> -200
  EXPECT_FALSE(rl.try_acquire(1, t0 + milliseconds(350)));   // 0 tokens
  EXPECT_TRUE(rl.try_acquire(1, t0 + milliseconds(351)));
  rl.refund(1000);  // refunds never exceed the burst
  EXPECT_TRUE(rl.try_acquire(100, t0 + milliseconds(351)));
  EXPECT_FALSE(rl.try_acquire(1, t0 + milliseconds(351)));
}

TEST(ofiRate, GreedySenderNeverBeatsTheRate) {
  // Over T seconds a greedy sender gets at most burst + rate*T + chunk bytes.
  const double rate = 25e6;  // 200mbit
  const uint64_t burst = 256 * 1024, chunk = 256 * 1024 + 7;
  RateLimiter rl(rate, burst);
  const Clock::time_point t0{};
  uint64_t granted = 0;
  for (int us = 0; us <= 2000000; us += 50) {
    const Clock::time_point t = t0 + std::chrono::microseconds(us);
    while (rl.try_acquire(chunk, t)) granted += chunk;
    const double bound = burst + rate * us * 1e-6 + chunk;
    ASSERT_LE(static_cast<double>(granted), bound) << "at " << us << " us";
  }
  // ... and it is not starved either: within one chunk of the rate.
  EXPECT_GE(static_cast<double>(granted), rate * 2.0 - 2.0 * chunk);
}

// ---------------------------------------------------------------------------
// Provider memory defaults
// ---------------------------------------------------------------------------
// In a fresh process (threadsafe death-test style re-executes this binary):
// the defaults go into the environment while another thread reads it, and
// the array that thread may be reading is left as it was.  setenv instead
// reallocates it: the array gains an entry in place or is freed.
void set_defaults_while_reading_the_environment() {
  const char* const kVars[][2] = {{"FI_OFI_RXM_MSG_RX_SIZE", "16"},
                                  {"FI_OFI_RXM_BUFFER_SIZE", "1024"},
                                  {"FI_OFI_RXM_EAGER_LIMIT", "16384"},
                                  {"FI_UNIVERSE_SIZE", "16"},
                                  {"FI_NET_MAX_SAVED", "256"}};
  for (const auto& kv : kVars) unsetenv(kv[0]);
  unsetenv("KVXFER_TEST_MARK");
  setenv("KVXFER_TEST_MARK", "1", 1);  // environ is now an array setenv allocated
  char** const before = environ;
  std::vector<char*> snapshot;
  for (size_t i = 0; before[i] != nullptr; ++i) snapshot.push_back(before[i]);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> reads{0};
  std::thread reader([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      if (getenv("KVXFER_TEST_NEVER_SET") != nullptr) std::_Exit(3);
      reads.fetch_add(1, std::memory_order_relaxed);
    }
  });
  while (reads.load() < 100) std::this_thread::yield();
  const std::string set = apply_provider_memory_defaults();
  stop = true;
  reader.join();
  for (size_t i = 0; i < snapshot.size(); ++i)
    if (before[i] != snapshot[i]) {
      std::fprintf(stderr, "entry %zu of the old environ array changed\n", i);
      std::_Exit(1);
    }
  if (before[snapshot.size()] != nullptr) {
    std::fprintf(stderr, "the old environ array gained an entry\n");
    std::_Exit(1);
  }
  for (const auto& kv : kVars) {
    const char* v = getenv(kv[0]);
    if (v == nullptr || std::strcmp(v, kv[1]) != 0) {
      std::fprintf(stderr, "%s=%s, expected %s\n", kv[0], v != nullptr ? v : "(unset)", kv[1]);
      std::_Exit(1);
    }
  }
  std::fprintf(stderr, "set %s\n", set.c_str());
  std::_Exit(0);
}

TEST(ofiDefaultsDeathTest, SetWhileAnotherThreadReadsTheEnvironment) {
#ifdef GTEST_FLAG_SET
  GTEST_FLAG_SET(death_test_style, "threadsafe");
#else
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
#endif
  EXPECT_EXIT(set_defaults_while_reading_the_environment(), ::testing::ExitedWithCode(0),
              "set FI_OFI_RXM_MSG_RX_SIZE=16 FI_OFI_RXM_BUFFER_SIZE=1024 "
              "FI_OFI_RXM_EAGER_LIMIT=16384 FI_UNIVERSE_SIZE=16 FI_NET_MAX_SAVED=256");
}

// libfabric 1.17's `net` reads a connection in order, and keeps an
// unexpected message aside only while it is small (its inject size) and the
// connection keeps fewer than FI_NET_MAX_SAVED (4 by default) of them: the
// next one stops the connection until a receive for it is posted.  So with
// 4, a receive for the 16th small message never completes while the 5th's
// is not posted; Xfer.ManyMidSizeMessagesDoNotStall timed out on `net` that
// way.  The transport's default (apply_provider_memory_defaults) keeps 256.
TEST(ofiDefaults, NetKeepsManySmallUnexpectedMessages) {
  constexpr int kN = 16;
  struct Ctx {
    fi_context2 fi;
  };
  // Buffers and contexts first: the endpoints, closed before them, may hold them.
  std::vector<Ctx> sent(kN);
  std::vector<uint64_t> out(kN);
  Ctx got{};
  uint64_t in = 0;
  std::shared_ptr<Domain> da, db;
  if (Domain::open("net", "127.0.0.1", &da) != KVXFER_SUCCESS)
    GTEST_SKIP() << "no net provider: " << kvxfer_get_last_error();
  ASSERT_EQ(Domain::open("net", "127.0.0.1", &db), KVXFER_SUCCESS) << kvxfer_get_last_error();
  std::unique_ptr<Endpoint> a, b;
  ASSERT_EQ(Endpoint::open(da, 0, &a), KVXFER_SUCCESS) << kvxfer_get_last_error();
  ASSERT_EQ(Endpoint::open(db, 0, &b), KVXFER_SUCCESS) << kvxfer_get_last_error();
  fi_addr_t to_b = FI_ADDR_UNSPEC, to_a = FI_ADDR_UNSPEC;
  ASSERT_EQ(a->insert_peer(b->name().data(), b->name().size(), &to_b), KVXFER_SUCCESS);
  ASSERT_EQ(b->insert_peer(a->name().data(), a->name().size(), &to_a), KVXFER_SUCCESS);
  // Only the last message's receive: the 15 before it arrive unexpected.
  ASSERT_EQ(b->post_recv(&in, sizeof(in), kN, &got), KVXFER_SUCCESS);
  int posted = 0, sends_done = 0;
  bool received = false;
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  while ((!received || sends_done < kN) && Clock::now() < deadline) {
    if (posted < kN) {  // in order; KVXFER_IN_PROGRESS (connecting, queue full): again
      out[posted] = 1000 + posted;
      const kvxfer_result_t r =
          a->post_send(&out[posted], sizeof(uint64_t), to_b, posted + 1, &sent[posted]);
      ASSERT_TRUE(r == KVXFER_SUCCESS || r == KVXFER_IN_PROGRESS) << kvxfer_get_last_error();
      if (r == KVXFER_SUCCESS) ++posted;
    }
    CqEvent ev[16];
    size_t n = 0;
    ASSERT_EQ(a->poll(ev, 16, &n), KVXFER_SUCCESS);
    for (size_t i = 0; i < n; ++i, ++sends_done) EXPECT_EQ(ev[i].err, 0);
    ASSERT_EQ(b->poll(ev, 16, &n), KVXFER_SUCCESS);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(ev[i].context, &got);
      EXPECT_EQ(ev[i].err, 0);
      received = true;
    }
  }
  EXPECT_TRUE(received) << "the receive for message " << kN << " of " << kN
                        << " did not complete within 3 s (FI_NET_MAX_SAVED="
                        << (std::getenv("FI_NET_MAX_SAVED") ? std::getenv("FI_NET_MAX_SAVED")
                                                            : "unset")
                        << ")";
  EXPECT_EQ(in, 1000u + kN - 1);
  EXPECT_EQ(sends_done, kN);
}

// ---------------------------------------------------------------------------
// Traffic classes
// ---------------------------------------------------------------------------
TEST(ofiTrafficClass, NamesMapToFiTc) {
  uint32_t v = 0;
  ASSERT_TRUE(tclass_from_name("LOW_LATENCY", 46, &v));
  EXPECT_EQ(v, static_cast<uint32_t>(FI_TC_LOW_LATENCY));
  ASSERT_TRUE(tclass_from_name("bulk_data", 8, &v));
  EXPECT_EQ(v, static_cast<uint32_t>(FI_TC_BULK_DATA));
  ASSERT_TRUE(tclass_from_name("UNSPEC", 0, &v));
  EXPECT_EQ(v, static_cast<uint32_t>(FI_TC_UNSPEC));
  ASSERT_TRUE(tclass_from_name("DSCP", 46, &v));
  EXPECT_EQ(v, static_cast<uint32_t>(FI_TC_DSCP) | 46u);
  EXPECT_EQ(fi_tc_dscp_get(v), 46);
  for (const char* n : {"LABEL", "BEST_EFFORT", "DEDICATED_ACCESS", "SCAVENGER", "NETWORK_CTRL"})
    EXPECT_TRUE(tclass_from_name(n, 0, &v)) << n;
  EXPECT_FALSE(tclass_from_name("FAST", 0, &v));
  EXPECT_FALSE(tclass_from_name("", 0, &v));
  EXPECT_FALSE(tclass_from_name("DSCP", 64, &v));
  EXPECT_EQ(tclass_to_string(FI_TC_BULK_DATA), "BULK_DATA");
  EXPECT_EQ(tclass_to_string(fi_tc_dscp_set(8)), "DSCP(8)");
}

// ---------------------------------------------------------------------------
// Two processes exchange messages of every size on both classes
// ---------------------------------------------------------------------------
const size_t kSizes[] = {0, 1, 4096, 1 << 20, 8 << 20};
constexpr int kNumSizes = sizeof(kSizes) / sizeof(kSizes[0]);

/**
 * One side of the exchange: sends every size on both classes and receives the
 * peer's, checks every byte.  `side` 0 or 1 picks the seeds.  Returns "" or
 * what went wrong.
 */
std::string exchange_side(int side, int rfd, int wfd, const LinkConfig& cfg) {
  std::unique_ptr<Link> link;
  if (Link::create(cfg, &link) != KVXFER_SUCCESS)
    return std::string("create: ") + kvxfer_get_last_error();
  if (!send_blob(wfd, link->local_address())) return "cannot write the address";
  std::vector<uint8_t> peer;
  if (!recv_blob(rfd, &peer, 30000)) return "no address from the peer";
  if (link->connect(peer.data(), peer.size()) != KVXFER_SUCCESS)
    return std::string("connect: ") + kvxfer_get_last_error();
  std::vector<std::vector<uint8_t>> out, in;
  std::vector<uint64_t> ops;
  std::map<uint64_t, std::pair<uint64_t, size_t>> expect;  // recv op -> (seed, size)
  for (TrafficClass c : {kA, kR}) {
    for (int k = 0; k < kNumSizes; ++k) {
      const uint64_t tag = static_cast<uint64_t>(idx(c)) * 100 + k;
      const uint64_t my_seed = 1000 * (side + 1) + tag, peer_seed = 1000 * (2 - side) + tag;
      out.push_back(pattern(my_seed, kSizes[k]));
      in.emplace_back(kSizes[k] + 16, 0xEE);  // larger than needed: size comes from the sender
      uint64_t s = 0, r = 0;
      if (link->post_recv(c, in.back().data(), in.back().size(), tag, &r) != KVXFER_SUCCESS ||
          link->post_send(c, out.back().data(), out.back().size(), tag, &s) != KVXFER_SUCCESS)
        return std::string("post: ") + kvxfer_get_last_error();
      ops.push_back(s);
      ops.push_back(r);
      expect[r] = {peer_seed, kSizes[k]};
    }
  }
  std::vector<Completion> done;
  const auto end = Clock::now() + std::chrono::seconds(60);
  while (done.size() < ops.size()) {
    if (Clock::now() > end) return "transfers did not finish within 60 s";
    link->poll(&done);
  }
  std::string err;
  for (const Completion& c : done) {
    if (c.status != KVXFER_SUCCESS) return "operation failed: " + c.error;
    auto it = expect.find(c.op_id);
    if (it == expect.end()) continue;
    if (c.bytes != it->second.second)
      return "received " + std::to_string(c.bytes) + " bytes, sent " +
             std::to_string(it->second.second);
    const size_t i = std::find(ops.begin(), ops.end(), c.op_id) - ops.begin();
    const std::string diff = compare(in[i / 2], it->second.first, it->second.second);
    if (!diff.empty()) return "tag " + std::to_string(c.tag) + ": " + diff;
    // Nothing past the message was written.
    for (size_t b = it->second.second; b < in[i / 2].size(); ++b)
      if (in[i / 2][b] != 0xEE) return "tag " + std::to_string(c.tag) + ": wrote past the message";
  }
  // Barrier, still progressing, so that neither side closes while the other
  // is still pulling data.
  const char ok = 'k';
  if (!write_all(wfd, &ok, 1)) return "cannot write the barrier";
  const auto bend = Clock::now() + std::chrono::seconds(30);
  while (!readable(rfd)) {
    if (Clock::now() > bend) return "no barrier from the peer";
    link->poll(&done);
  }
  return "";
}

TEST(ofiLink, TwoProcessesExchangeAllSizesOnBothClasses) {
  const LinkConfig cfg = loopback_config();
  Child child;
  ASSERT_TRUE(child.start([&](int rfd, int wfd) {
    const std::string err = exchange_side(1, rfd, wfd, cfg);
    if (!err.empty()) std::fprintf(stderr, "child: %s\n", err.c_str());
    return err.empty() ? 0 : 1;
  }));
  const std::string err = exchange_side(0, child.from_child, child.to_child, cfg);
  EXPECT_EQ(err, "");
  ASSERT_TRUE(child.wait(60)) << "child hung";
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0)
      << "child status " << child.status;
}

TEST(ofiLink, InProcessExchangeWithSmallChunks) {
  // Tiny chunks: many chunks per message, receive windows refilled many times,
  // a chunk size that divides nothing evenly.
  LinkConfig ca = loopback_config(), cb = loopback_config();
  ca.chunk_bytes = 4099;
  cb.chunk_bytes = 65536;  // the receiver's own chunk size does not matter
  ca.residual_inflight_bytes = 3 * 4099;
  Pair p;
  ASSERT_TRUE(make_pair(ca, cb, &p));
  const size_t n = (1 << 20) + 3;
  std::vector<uint8_t> src0 = pattern(77, n), src1 = pattern(78, n), dst0(n), dst1(n);
  uint64_t s0, s1, r0, r1;
  ASSERT_EQ(p.b->post_recv(kR, dst1.data(), n, 5, &r1), KVXFER_SUCCESS);
  ASSERT_EQ(p.a->post_send(kA, src0.data(), n, 5, &s0), KVXFER_SUCCESS);
  ASSERT_EQ(p.a->post_send(kR, src1.data(), n, 5, &s1), KVXFER_SUCCESS);  // same tag, other class
  ASSERT_EQ(p.b->post_recv(kA, dst0.data(), n, 5, &r0), KVXFER_SUCCESS);
  Link* a = p.a.get();
  Link* b = p.b.get();
  ASSERT_TRUE(p.drv.until(
      [&] {
        return p.drv.finished(a, {s0, s1}) && p.drv.finished(b, {r0, r1});
      },
      60));
  for (const Completion& c : p.drv.done[b]) EXPECT_EQ(c.status, KVXFER_SUCCESS) << c.error;
  EXPECT_EQ(compare(dst0, 77, n), "");
  EXPECT_EQ(compare(dst1, 78, n), "");
  EXPECT_LE(a->stats().max_residual_inflight, ca.residual_inflight_bytes);
}

// ---------------------------------------------------------------------------
// Anchors first
// ---------------------------------------------------------------------------
TEST(ofiLink, AnchorOvertakesQueuedResidual) {
  Pair p;
  ASSERT_TRUE(make_pair(loopback_config(), loopback_config(), &p));
  Link* a = p.a.get();
  Link* b = p.b.get();
  const size_t kResidualMsgs = 16, kMsg = 1 << 20, kAnchor = 64 * 1024;
  std::vector<std::vector<uint8_t>> rsrc, rdst;
  std::vector<uint64_t> rsend, rrecv;
  for (size_t i = 0; i < kResidualMsgs; ++i) {
    rsrc.push_back(pattern(500 + i, kMsg));
    rdst.emplace_back(kMsg);
    uint64_t r, s;
    ASSERT_EQ(b->post_recv(kR, rdst.back().data(), kMsg, i, &r), KVXFER_SUCCESS);
    ASSERT_EQ(a->post_send(kR, rsrc.back().data(), kMsg, i, &s), KVXFER_SUCCESS);
    rrecv.push_back(r);
    rsend.push_back(s);
  }
  // Let the residual stream get going: the first residual message lands.
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(b, {rrecv[0]}); }, 60));
  std::vector<uint8_t> asrc = pattern(9, kAnchor), adst(kAnchor);
  uint64_t ar, as;
  ASSERT_EQ(b->post_recv(kA, adst.data(), kAnchor, 1, &ar), KVXFER_SUCCESS);
  ASSERT_EQ(a->post_send(kA, asrc.data(), kAnchor, 1, &as), KVXFER_SUCCESS);
  std::vector<uint64_t> all = rrecv;
  all.push_back(ar);
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(b, all); }, 120));

  // Receive completion order at the receiver: the anchor lands before the
  // residual data is finished.
  const Completion* anchor = p.drv.find(b, ar);
  ASSERT_NE(anchor, nullptr);
  ASSERT_EQ(anchor->status, KVXFER_SUCCESS) << anchor->error;
  size_t residual_before = 0;
  Clock::time_point last_residual{};
  for (uint64_t r : rrecv) {
    const Completion* c = p.drv.find(b, r);
    ASSERT_EQ(c->status, KVXFER_SUCCESS) << c->error;
    last_residual = std::max(last_residual, c->done);
    if (c->done <= anchor->done) ++residual_before;
  }
  EXPECT_LT(anchor->done, last_residual);
  // The anchor waited behind at most the residual bytes already in flight
  // (1 MiB = one message here) plus the message that was landing.
  EXPECT_LE(residual_before, 4u) << "residual messages completed before the anchor";
  std::printf("[ info ] residual messages landed before the anchor: %zu of %zu\n", residual_before,
              kResidualMsgs);
  EXPECT_EQ(compare(adst, 9, kAnchor), "");
  for (size_t i = 0; i < kResidualMsgs; ++i) EXPECT_EQ(compare(rdst[i], 500 + i, kMsg), "") << i;
  EXPECT_LE(a->stats().max_residual_inflight, a->config().residual_inflight_bytes);
}

// A control message posted `ahead` goes before the messages of its class
// queued without it: only what the provider already holds lands first.
TEST(ofiLink, AheadMessageOvertakesQueuedMessagesOfItsClass) {
  LinkConfig cfg = loopback_config();
  cfg.max_posted_chunks = 8;  // the provider holds at most two 1 MiB messages (5 chunks each)
  Pair p;
  ASSERT_TRUE(make_pair(cfg, cfg, &p));
  Link* a = p.a.get();
  Link* b = p.b.get();
  const size_t kMsgs = 16, kMsg = 1 << 20, kCtl = 80;
  std::vector<std::vector<uint8_t>> src, dst;
  std::vector<uint64_t> sends, recvs;
  for (size_t i = 0; i < kMsgs; ++i) {
    src.push_back(pattern(700 + i, kMsg));
    dst.emplace_back(kMsg);
    uint64_t r, s;
    ASSERT_EQ(b->post_recv(kA, dst.back().data(), kMsg, i, &r), KVXFER_SUCCESS);
    ASSERT_EQ(a->post_send(kA, src.back().data(), kMsg, i, &s), KVXFER_SUCCESS);
    recvs.push_back(r);
    sends.push_back(s);
  }
  a->poll(&p.drv.done[a]);  // one round: the first 8 chunks go to the provider
  std::vector<uint8_t> csrc = pattern(11, kCtl), cdst(kCtl);
  uint64_t cr, cs;
  ASSERT_EQ(b->post_recv(kA, cdst.data(), kCtl, 100, &cr), KVXFER_SUCCESS);
  ASSERT_EQ(a->post_send(kA, csrc.data(), kCtl, 100, &cs, /*ahead=*/true), KVXFER_SUCCESS);
  std::vector<uint64_t> all = recvs;
  all.push_back(cr);
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(b, all); }, 120));
  const Completion* ctl = p.drv.find(b, cr);
  ASSERT_NE(ctl, nullptr);
  ASSERT_EQ(ctl->status, KVXFER_SUCCESS) << ctl->error;
  size_t before = 0;
  for (uint64_t r : recvs) {
    const Completion* c = p.drv.find(b, r);
    ASSERT_EQ(c->status, KVXFER_SUCCESS) << c->error;
    if (c->done <= ctl->done) ++before;
  }
  // At most the two messages the provider held (one whole, one in part) land
  // first; FIFO would put it after all 16.
  EXPECT_LE(before, 2u) << "messages of the class completed before the ahead message";
  std::printf("[ info ] queued messages landed before the ahead message: %zu of %zu\n", before,
              kMsgs);
  EXPECT_EQ(compare(cdst, 11, kCtl), "");
  for (size_t i = 0; i < kMsgs; ++i) EXPECT_EQ(compare(dst[i], 700 + i, kMsg), "") << i;
}

// ---------------------------------------------------------------------------
// Rate limiter on a real link
// ---------------------------------------------------------------------------
TEST(ofiLink, RateLimiterBoundsBothClassesTogether) {
  double rate = 0;
  std::string why;
  ASSERT_TRUE(parse_rate("200mbit", &rate, &why));
  LinkConfig ca = loopback_config();
  ca.limiter = std::make_shared<RateLimiter>(rate, ca.chunk_bytes);
  Pair p;
  ASSERT_TRUE(make_pair(ca, loopback_config(), &p));
  Link* a = p.a.get();
  Link* b = p.b.get();
  // 10 MB in total, half per class: one limiter emulates one link.
  const size_t half = 5000000;
  std::vector<uint8_t> s0 = pattern(1, half), s1 = pattern(2, half), d0(half), d1(half);
  uint64_t r0, r1, x0, x1;
  ASSERT_EQ(b->post_recv(kA, d0.data(), half, 3, &r0), KVXFER_SUCCESS);
  ASSERT_EQ(b->post_recv(kR, d1.data(), half, 3, &r1), KVXFER_SUCCESS);
  const auto t0 = Clock::now();
  ASSERT_EQ(a->post_send(kA, s0.data(), half, 3, &x0), KVXFER_SUCCESS);
  ASSERT_EQ(a->post_send(kR, s1.data(), half, 3, &x1), KVXFER_SUCCESS);
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(b, {r0, r1}); }, 120));
  const double elapsed =
      Sec(std::max(p.drv.find(b, r0)->done, p.drv.find(b, r1)->done) - t0).count();
  const double floor = 0.9 * (2.0 * half) / rate;
  std::printf("[ info ] 10 MB at 200mbit: %.3f s (lower bound %.3f s)\n", elapsed, floor);
  EXPECT_GE(elapsed, floor);
  EXPECT_EQ(compare(d0, 1, half), "");
  EXPECT_EQ(compare(d1, 2, half), "");
}

// ---------------------------------------------------------------------------
// Failures: timeouts, peer death, close with operations in flight
// ---------------------------------------------------------------------------
TEST(ofiLink, ReceiveNeverSentTimesOutAndLinkSurvives) {
  LinkConfig cfg = loopback_config();
  cfg.timeout_ms = 500;
  Pair p;
  ASSERT_TRUE(make_pair(cfg, cfg, &p));
  Link* a = p.a.get();
  Link* b = p.b.get();
  std::vector<uint8_t> buf(4096);
  uint64_t r;
  ASSERT_EQ(b->post_recv(kA, buf.data(), buf.size(), 42, &r), KVXFER_SUCCESS);
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(b, {r}); }, 20)) << "receive never ended";
  const Completion* c = p.drv.find(b, r);
  EXPECT_NE(c->status, KVXFER_SUCCESS);
  EXPECT_NE(c->error.find("no progress"), std::string::npos) << c->error;
  // The cancelled receive was returned by the provider: the link still works.
  EXPECT_FALSE(b->failed());
  std::vector<uint8_t> src = pattern(3, 4096);
  uint64_t s, r2;
  ASSERT_EQ(b->post_recv(kA, buf.data(), buf.size(), 43, &r2), KVXFER_SUCCESS);
  ASSERT_EQ(a->post_send(kA, src.data(), src.size(), 43, &s), KVXFER_SUCCESS);
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(b, {r2}); }, 20));
  EXPECT_EQ(p.drv.find(b, r2)->status, KVXFER_SUCCESS) << p.drv.find(b, r2)->error;
  EXPECT_EQ(compare(buf, 3, 4096), "");
}

// cancel_recv ends a receive nothing has come for, at once and with the
// code given; the receive posted next by the same tag takes the next message,
// and a receive whose message has come is not cancelled.
TEST(ofiLink, CancelledReceiveEndsAtOnceAndTheLinkGoesOn) {
  Pair p;
  ASSERT_TRUE(make_pair(loopback_config(), loopback_config(), &p));
  Link* a = p.a.get();
  Link* b = p.b.get();
  std::vector<uint8_t> buf(4096), buf2(4096);
  uint64_t r, s, r2;
  ASSERT_EQ(b->post_recv(kA, buf.data(), buf.size(), 44, &r), KVXFER_SUCCESS);
  (void)p.drv.until([] { return false; }, 0.05);  // 50 ms of progress: it is posted
  const auto t0 = Clock::now();
  EXPECT_FALSE(b->cancel_recv(r + 1000, KVXFER_ERR_CANCELLED, "no such op"));
  ASSERT_TRUE(b->cancel_recv(r, KVXFER_ERR_CANCELLED, "the peer refused it"));
  EXPECT_FALSE(b->cancel_recv(r, KVXFER_ERR_CANCELLED, "twice"));
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(b, {r}); }, 5)) << "not ended";
  EXPECT_LT(Sec(Clock::now() - t0).count(), 1.0);
  const Completion* c = p.drv.find(b, r);
  EXPECT_EQ(c->status, KVXFER_ERR_CANCELLED);
  EXPECT_EQ(c->error, "the peer refused it");
  EXPECT_EQ(c->bytes, 0u);
  EXPECT_FALSE(b->failed());
  std::vector<uint8_t> src = pattern(5, 4096);
  ASSERT_EQ(b->post_recv(kA, buf2.data(), buf2.size(), 44, &r2), KVXFER_SUCCESS);
  ASSERT_EQ(a->post_send(kA, src.data(), src.size(), 44, &s), KVXFER_SUCCESS);
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(b, {r2}); }, 20));
  EXPECT_EQ(p.drv.find(b, r2)->status, KVXFER_SUCCESS) << p.drv.find(b, r2)->error;
  EXPECT_EQ(compare(buf2, 5, 4096), "");
  EXPECT_EQ(buf, std::vector<uint8_t>(4096, 0)) << "the cancelled receive took bytes";
  EXPECT_FALSE(b->cancel_recv(r2, KVXFER_ERR_CANCELLED, "arrived"));
  EXPECT_FALSE(a->cancel_recv(s, KVXFER_ERR_CANCELLED, "a send"));
}

TEST(ofiLink, SendNeverReceivedTimesOut) {
  LinkConfig cfg = loopback_config();
  cfg.timeout_ms = 500;
  Pair p;
  ASSERT_TRUE(make_pair(cfg, cfg, &p));
  Link* a = p.a.get();
  // Large enough that the provider cannot complete it without the receiver.
  std::vector<uint8_t> src = pattern(4, 8 << 20);
  uint64_t s;
  ASSERT_EQ(a->post_send(kR, src.data(), src.size(), 9, &s), KVXFER_SUCCESS);
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(a, {s}); }, 20)) << "send never ended";
  const Completion* c = p.drv.find(a, s);
  if (c->status == KVXFER_SUCCESS)
    GTEST_SKIP() << "provider " << a->provider() << " buffers unexpected messages at the receiver: "
                 << "a send completes without a matching receive (no backpressure)";
  std::printf("[ info ] %s\n", c->error.c_str());
  EXPECT_TRUE(a->failed());
}

TEST(ofiLink, ReceiveTooSmallFailsAndSenderCompletes) {
  Pair p;
  ASSERT_TRUE(make_pair(loopback_config(), loopback_config(), &p));
  Link* a = p.a.get();
  Link* b = p.b.get();
  std::vector<uint8_t> src = pattern(5, 1 << 20), dst(1000, 0x5A);
  uint64_t s, r;
  ASSERT_EQ(b->post_recv(kA, dst.data(), dst.size(), 1, &r), KVXFER_SUCCESS);
  ASSERT_EQ(a->post_send(kA, src.data(), src.size(), 1, &s), KVXFER_SUCCESS);
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(a, {s}) && p.drv.finished(b, {r}); }, 30));
  EXPECT_EQ(p.drv.find(b, r)->status, KVXFER_ERR_BUFFER_TOO_SMALL);
  EXPECT_EQ(p.drv.find(a, s)->status, KVXFER_SUCCESS) << p.drv.find(a, s)->error;
  for (uint8_t v : dst) ASSERT_EQ(v, 0x5A) << "the too-small buffer was written";
}

TEST(ofiLink, PeerKilledMidTransferEndsWithError) {
  LinkConfig cfg = loopback_config();
  cfg.timeout_ms = 2000;
  Child child;
  ASSERT_TRUE(child.start([&](int rfd, int wfd) {
    // The child sends 64 MiB at 80mbit (about 7 s), and is killed mid-way.
    LinkConfig cc = loopback_config();
    cc.limiter = std::make_shared<RateLimiter>(10e6, cc.chunk_bytes);
    const std::vector<uint8_t> src = pattern(6, 64 << 20);  // before connecting: the
    std::unique_ptr<Link> link;                             // peer waits on our progress
    if (Link::create(cc, &link) != KVXFER_SUCCESS || !send_blob(wfd, link->local_address()))
      return 2;
    std::vector<uint8_t> peer;
    if (!recv_blob(rfd, &peer, 30000) || link->connect(peer.data(), peer.size()) != KVXFER_SUCCESS)
      return 3;
    uint64_t s;
    if (link->post_send(kR, src.data(), src.size(), 1, &s) != KVXFER_SUCCESS) return 4;
    std::vector<Completion> done;
    bool told = false;
    const auto end = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < end) {
      link->poll(&done);
      if (!told && link->stats().bytes_posted[1] > (2 << 20)) {
        const char m = 's';
        (void)write_all(wfd, &m, 1);
        told = true;
      }
    }
    return 5;
  }));
  std::unique_ptr<Link> link;
  ASSERT_EQ(Link::create(cfg, &link), KVXFER_SUCCESS) << kvxfer_get_last_error();
  ASSERT_TRUE(send_blob(child.to_child, link->local_address()));
  std::vector<uint8_t> peer;
  ASSERT_TRUE(recv_blob(child.from_child, &peer, 30000));
  ASSERT_EQ(link->connect(peer.data(), peer.size()), KVXFER_SUCCESS) << kvxfer_get_last_error();
  std::vector<Completion> done;
  // The receive's inactivity clock starts when it is posted: post it once the
  // handshake is done, so that a slow child start-up is not a timeout.
  const auto started = Clock::now();
  while (!link->ready()) {
    ASSERT_LT(Clock::now() - started, std::chrono::seconds(60)) << "handshake with the child";
    ASSERT_EQ(link->progress(), KVXFER_SUCCESS) << kvxfer_get_last_error();
  }
  std::vector<uint8_t> dst(64 << 20);
  uint64_t r;
  ASSERT_EQ(link->post_recv(kR, dst.data(), dst.size(), 1, &r), KVXFER_SUCCESS);
  // Progress until the child says data is flowing, then kill it.
  while (!readable(child.from_child) && done.empty()) {
    ASSERT_LT(Clock::now() - started, std::chrono::seconds(60)) << "child never started sending";
    link->poll(&done);
  }
  ASSERT_TRUE(done.empty()) << "the receive ended before the kill: " << done[0].error;
  kill(child.pid, SIGKILL);
  const auto killed = Clock::now();
  while (done.empty()) {
    ASSERT_LT(Clock::now() - killed, std::chrono::seconds(30))
        << "receive hung after the peer died";
    link->poll(&done);
  }
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].op_id, r);
  EXPECT_NE(done[0].status, KVXFER_SUCCESS);
  EXPECT_GT(done[0].bytes, 0u) << "the kill was meant to land mid-transfer";
  EXPECT_LT(done[0].bytes, dst.size());
  std::printf("[ info ] ended %.2f s after the kill with %zu of %zu bytes: %s\n",
              Sec(Clock::now() - killed).count(), done[0].bytes, dst.size(), done[0].error.c_str());
  if (link->same_host()) {
    // The killed child's shared-memory regions are removed by the survivor
    // at its next liveness check (every 100 ms): the receive may have failed
    // first, on the provider's error.
    const std::string prefix = std::to_string(child.pid) + ":";
    auto left = [&] {
      std::vector<std::string> v;
      for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
        if (e.path().filename().string().rfind(prefix, 0) == 0) v.push_back(e.path().string());
      return v;
    };
    const auto until = Clock::now() + std::chrono::seconds(2);
    while (!left().empty() && Clock::now() < until) {
      link->poll(&done);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    for (const std::string& f : left()) ADD_FAILURE() << f << " left behind";
  }
  child.wait(10);
}

TEST(ofiLink, AbortAndDestroyWithOperationsInFlight) {
  LinkConfig cfg = loopback_config();
  cfg.timeout_ms = 1000;
  Pair p;
  ASSERT_TRUE(make_pair(cfg, cfg, &p));
  Link* a = p.a.get();
  Link* b = p.b.get();
  const size_t n = 8 << 20;
  std::vector<std::vector<uint8_t>> src, dst;
  std::vector<uint64_t> sends, recvs;
  for (int i = 0; i < 4; ++i) {
    src.push_back(pattern(i, n));
    dst.emplace_back(n);
    uint64_t s, r;
    ASSERT_EQ(b->post_recv(i % 2 ? kR : kA, dst.back().data(), n, i, &r), KVXFER_SUCCESS);
    ASSERT_EQ(a->post_send(i % 2 ? kR : kA, src.back().data(), n, i, &s), KVXFER_SUCCESS);
    sends.push_back(s);
    recvs.push_back(r);
  }
  for (int i = 0; i < 20; ++i)
    for (Link* l : p.drv.links) l->poll(&p.drv.done[l]);
  const size_t in_flight = a->ops_in_flight();
  a->abort("test abort");
  EXPECT_TRUE(a->failed());
  a->poll(&p.drv.done[a]);
  EXPECT_TRUE(p.drv.finished(a, sends));
  size_t errors = 0;
  for (const Completion& c : p.drv.done[a])
    if (c.status != KVXFER_SUCCESS) {
      ++errors;
      EXPECT_NE(c.error.find("test abort"), std::string::npos) << c.error;
    }
  EXPECT_EQ(errors, in_flight);
  uint64_t late;
  EXPECT_NE(a->post_send(kA, src[0].data(), 1, 99, &late), KVXFER_SUCCESS);
  p.a.reset();  // destroy the aborted link
  p.drv.links = {b};
  // The receiver's operations end with an error (timeout), never hang.
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(b, recvs); }, 30)) << "receiver hung";
  // Over the network the receiver needs the sender for every byte, so some
  // receives fail.  Over shared memory the sender's buffers (alive here) may
  // still be read after its abort: a receive that completes holds the bytes.
  size_t failed = 0;
  for (size_t i = 0; i < recvs.size(); ++i) {
    const Completion* c = p.drv.find(b, recvs[i]);
    if (c->status != KVXFER_SUCCESS) {
      ++failed;
    } else {
      EXPECT_EQ(dst[i], src[i]) << "receive " << i << " completed with other bytes";
    }
  }
  if (!b->same_host()) {
    EXPECT_GT(failed, 0u);
  }
  // Destroying a link with operations in flight (no abort first) is safe.
  // (If the provider did not return the cancelled receives in time, b has
  // failed itself, which is the other legal outcome.)
  std::vector<uint8_t> more(n);
  uint64_t r;
  if (!b->failed()) {
    ASSERT_EQ(b->post_recv(kA, more.data(), n, 100, &r), KVXFER_SUCCESS);
    b->poll(&p.drv.done[b]);
  }
  p.b.reset();
}

TEST(ofiLink, RejectsBadArgumentsAndAddresses) {
  std::unique_ptr<Link> l;
  ASSERT_EQ(Link::create(loopback_config(), &l), KVXFER_SUCCESS) << kvxfer_get_last_error();
  uint8_t b[4];
  uint64_t op;
  EXPECT_EQ(l->post_send(kA, b, 4, Link::kMaxTag + 1, &op), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(l->post_recv(kA, nullptr, 4, 1, &op), KVXFER_ERR_INVALID_ARGUMENT);
  const uint8_t junk[] = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_EQ(l->connect(junk, sizeof(junk)), KVXFER_ERR_CORRUPT);  // the peer's bytes
  std::vector<uint8_t> self = l->local_address();
  self.pop_back();
  EXPECT_NE(l->connect(self.data(), self.size()), KVXFER_SUCCESS);
  LinkConfig bad = loopback_config("no_such_provider");
  std::unique_ptr<Link> l2;
  EXPECT_NE(Link::create(bad, &l2), KVXFER_SUCCESS);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("no_such_provider"), std::string::npos);
}

TEST(ofiLink, HandshakeWithAbsentPeerTimesOut) {
  LinkConfig cfg = loopback_config();
  cfg.timeout_ms = 300;
  std::unique_ptr<Link> a, b;
  ASSERT_EQ(Link::create(cfg, &a), KVXFER_SUCCESS);
  ASSERT_EQ(Link::create(cfg, &b), KVXFER_SUCCESS);
  const std::vector<uint8_t> addr = b->local_address();
  b.reset();  // the peer is gone before it ever connects
  if (a->connect(addr.data(), addr.size()) != KVXFER_SUCCESS) {
    // Some providers (sockets) connect at once and see the refusal.
    EXPECT_TRUE(a->failed()) << kvxfer_get_last_error();
    return;
  }
  std::vector<uint8_t> src(100);
  uint64_t s;
  ASSERT_EQ(a->post_send(kA, src.data(), src.size(), 1, &s), KVXFER_SUCCESS);
  std::vector<Completion> done;
  const auto end = Clock::now() + std::chrono::seconds(20);
  while (done.empty() && Clock::now() < end) a->poll(&done);
  ASSERT_EQ(done.size(), 1u) << "send to an absent peer hung";
  EXPECT_NE(done[0].status, KVXFER_SUCCESS);
  EXPECT_TRUE(a->failed());
}

// ---------------------------------------------------------------------------
// Paths: shared memory for a peer on this host, the network for the others
// ---------------------------------------------------------------------------
/** Sends `n` bytes each way on both classes over a connected pair; true when every byte arrived. */
::testing::AssertionResult exchange(Pair* p, size_t n) {
  std::vector<std::vector<uint8_t>> src, dst;
  std::map<Link*, std::vector<uint64_t>> ops;
  uint64_t tag = 0;
  for (TrafficClass c : {kA, kR})
    for (Link* to : {p->a.get(), p->b.get()}) {
      Link* from = to == p->a.get() ? p->b.get() : p->a.get();
      src.push_back(pattern(tag + 40, n));
      dst.emplace_back(n);
      uint64_t r, x;
      if (to->post_recv(c, dst.back().data(), n, tag, &r) != KVXFER_SUCCESS ||
          from->post_send(c, src.back().data(), n, tag, &x) != KVXFER_SUCCESS)
        return ::testing::AssertionFailure() << "post: " << kvxfer_get_last_error();
      ops[to].push_back(r);
      ops[from].push_back(x);
      ++tag;
    }
  if (!p->drv.until(
          [&] {
            return p->drv.finished(p->a.get(), ops[p->a.get()]) &&
                   p->drv.finished(p->b.get(), ops[p->b.get()]);
          },
          30))
    return ::testing::AssertionFailure() << "exchange did not finish";
  for (Link* l : {p->a.get(), p->b.get()})
    for (uint64_t op : ops[l])
      if (p->drv.find(l, op)->status != KVXFER_SUCCESS)
        return ::testing::AssertionFailure() << p->drv.find(l, op)->error;
  for (size_t i = 0; i < src.size(); ++i)
    if (dst[i] != src[i]) return ::testing::AssertionFailure() << "message " << i << " differs";
  return ::testing::AssertionSuccess();
}

/** The host identity's bytes in an address blob (docs/TRANSPORT.md, "Address blob"). */
std::string blob_host(const std::vector<uint8_t>& blob) {
  return std::string(reinterpret_cast<const char*>(blob.data()) + 8, blob[7]);
}

TEST(ofiPath, SameHostPeersTakeSharedMemory) {
  if (!provider_under_test().empty()) GTEST_SKIP() << "a provider is named";
  Pair p;
  ASSERT_TRUE(make_pair(loopback_config(), loopback_config(), &p));
  for (Link* l : p.drv.links) {
    EXPECT_TRUE(l->same_host());
    EXPECT_EQ(l->provider(), kShmProvider);
    EXPECT_FALSE(l->dscp_report().supported);
  }
  EXPECT_EQ(blob_host(p.a->local_address()), host_identity());
  EXPECT_TRUE(exchange(&p, 3 << 20));
  EXPECT_TRUE(exchange(&p, 1000));
}

TEST(ofiPath, NamedNetworkProviderKeepsSameHostPeersOnTheNetwork) {
  Pair p;
  const LinkConfig net = network_config();
  ASSERT_TRUE(make_pair(net, net, &p));
  for (Link* l : p.drv.links) {
    EXPECT_FALSE(l->same_host());
    EXPECT_EQ(l->provider().find(kShmProvider), std::string::npos) << l->provider();
  }
  EXPECT_TRUE(exchange(&p, 1 << 20));
}

TEST(ofiPath, AutoMeetsANamedNetworkProviderOnTheNetwork) {
  if (!provider_under_test().empty()) GTEST_SKIP() << "a provider is named";
  Pair p;
  ASSERT_TRUE(make_pair(loopback_config(), network_config(), &p));
  EXPECT_FALSE(p.a->same_host());
  EXPECT_EQ(p.a->provider(), p.b->provider());
  EXPECT_TRUE(exchange(&p, 1 << 20));
}

// A peer address whose shared-memory names point at files that are not shm
// regions (corrupt, or hostile): libfabric would map them and trust their
// header (SIGSEGV in fi_av_insert); connect refuses them at the call.
TEST(ofiPath, SharedMemoryNamesThatAreNotRegionsAreRefused) {
  if (!shm_under_test()) GTEST_SKIP() << "shared memory only";
  const std::string& host = host_identity();
  const uint32_t pid = static_cast<uint32_t>(getpid());
  for (const size_t size : {size_t{1500}, size_t{1} << 20}) {  // too small; right size, no header
    std::vector<std::string> files;
    std::vector<uint8_t> blob = {'K', 'V', 'X', 'L', 3, 2, 1, static_cast<uint8_t>(host.size())};
    blob.insert(blob.end(), host.begin(), host.end());
    for (int i = 0; i < 4; ++i) blob.push_back(static_cast<uint8_t>(pid >> (8 * i)));
    const std::string prov = kShmProvider;
    blob.push_back(static_cast<uint8_t>(prov.size()));
    blob.insert(blob.end(), prov.begin(), prov.end());
    for (int c = 0; c < 2; ++c) {
      const std::string leaf = "kvxfer-not-a-region-" + std::to_string(pid) + "-" +
                               std::to_string(size) + "-" + std::to_string(c);
      files.push_back("/dev/shm/" + leaf);
      const int fd = ::open(files.back().c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
      ASSERT_GE(fd, 0);
      ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
      ::close(fd);
      const std::string name = "fi_shm://" + leaf;
      blob.push_back(static_cast<uint8_t>(name.size() + 1));
      blob.push_back(0);
      blob.insert(blob.end(), name.begin(), name.end());
      blob.push_back(0);
    }
    std::unique_ptr<Link> a;
    ASSERT_EQ(Link::create(loopback_config(), &a), KVXFER_SUCCESS) << kvxfer_get_last_error();
    EXPECT_EQ(a->connect(blob.data(), blob.size()), KVXFER_ERR_CORRUPT) << kvxfer_get_last_error();
    EXPECT_NE(std::string(kvxfer_get_last_error()).find("is not one"), std::string::npos)
        << kvxfer_get_last_error();
    EXPECT_TRUE(a->failed());
    for (const std::string& f : files) ::unlink(f.c_str());
  }
}

/** A shm domain and one endpoint on it. */
void open_shm_endpoint(std::shared_ptr<Domain>* d, std::unique_ptr<Endpoint>* e) {
  ASSERT_EQ(Domain::open(kShmProvider, "", d), KVXFER_SUCCESS) << kvxfer_get_last_error();
  ASSERT_EQ(Endpoint::open(*d, 0, e), KVXFER_SUCCESS) << kvxfer_get_last_error();
}

// An idle shm endpoint holds little memory (docs/TRANSPORT.md, "Endpoints"):
// its entries are capped (ofi.h, kShmRxEntries) and its region keeps
// no pages past its last field (smr_region.h, trim_region).  Untrimmed, a
// 16 MiB region held 3.8 MiB or more of tmpfs from its creation on.
TEST(ofiPath, SharedMemoryEndpointHoldsLittleMemory) {
  if (!shm_under_test()) GTEST_SKIP() << "shared memory only";
  std::shared_ptr<Domain> d;
  std::unique_ptr<Endpoint> e;
  ASSERT_NO_FATAL_FAILURE(open_shm_endpoint(&d, &e));
  EXPECT_LE(e->info()->rx_attr->size, kShmRxEntries);
  EXPECT_LE(e->info()->tx_attr->size, kShmTxEntries);
  const std::string file = smr::region_file(e->name());
  struct stat st {};
  ASSERT_EQ(::stat(file.c_str(), &st), 0) << file;
  EXPECT_EQ(st.st_size, 16 << 20);
  // Header, queues and the pages the entries' index arrays touch.
  EXPECT_LE(static_cast<int64_t>(st.st_blocks) * 512, int64_t{256} << 10) << file;
  // The unused tail: the region's 16 MiB less about 10 MiB of queues and
  // buffers with 512 receive entries.
  EXPECT_GT(smr::trim_region(file), size_t{4} << 20);
}

// A region file with the name this process's next shm endpoint gets (a
// killed process with this pid left it): the endpoint removes it and opens.
TEST(ofiPath, AStaleRegionOfThisPidIsReplaced) {
  if (!shm_under_test()) GTEST_SKIP() << "shared memory only";
  std::shared_ptr<Domain> d;
  std::unique_ptr<Endpoint> e;
  ASSERT_NO_FATAL_FAILURE(open_shm_endpoint(&d, &e));
  // <pid>:<uid>:<n>: the next endpoint of this process gets n + 1.
  const std::string file = smr::region_file(e->name());
  const size_t colon = file.rfind(':');
  ASSERT_NE(colon, std::string::npos) << file;
  const std::string next =
      file.substr(0, colon + 1) + std::to_string(std::stoll(file.substr(colon + 1)) + 1);
  const int fd = ::open(next.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << next;
  const std::vector<uint8_t> junk(4096, 0xAB);
  ASSERT_EQ(::write(fd, junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  ::close(fd);
  std::unique_ptr<Endpoint> f;
  const kvxfer_result_t r = Endpoint::open(d, 0, &f);
  if (r != KVXFER_SUCCESS) (void)::unlink(next.c_str());
  ASSERT_EQ(r, KVXFER_SUCCESS) << kvxfer_get_last_error();
  EXPECT_EQ(smr::region_file(f->name()), next);
  struct stat st {};
  ASSERT_EQ(::stat(next.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 16 << 20) << "the region, not the stale file";
}

// trim_region leaves alone a file without libfabric 1.17's header.
TEST(ofiPath, TrimLeavesAFileThatIsNotARegion) {
  const std::string f = "/dev/shm/kvxfer-not-a-region-trim-" + std::to_string(getpid());
  const int fd = ::open(f.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  const std::vector<uint8_t> bytes(1 << 20, 0xAB);
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  EXPECT_EQ(smr::trim_region(f), 0u);
  std::vector<uint8_t> back(bytes.size());
  EXPECT_EQ(::pread(fd, back.data(), back.size(), 0), static_cast<ssize_t>(back.size()));
  EXPECT_EQ(back, bytes);
  ::close(fd);
  ::unlink(f.c_str());
  EXPECT_EQ(smr::trim_region(f), 0u);  // and a file that is gone
}

TEST(ofiPath, SharedMemoryOnlyAndNetworkOnlyShareNoPath) {
  std::unique_ptr<Link> a, b;
  ASSERT_EQ(Link::create(loopback_config(kShmProvider), &a), KVXFER_SUCCESS)
      << kvxfer_get_last_error();
  ASSERT_EQ(Link::create(network_config(), &b), KVXFER_SUCCESS) << kvxfer_get_last_error();
  const std::vector<uint8_t> to_b = b->local_address(), to_a = a->local_address();
  EXPECT_EQ(a->connect(to_b.data(), to_b.size()), KVXFER_ERR_MISMATCH);
  const std::string e = kvxfer_get_last_error();
  EXPECT_NE(e.find("offers " + b->provider()), std::string::npos) << e;
  EXPECT_NE(e.find("this side shm"), std::string::npos) << e;
  EXPECT_EQ(b->connect(to_a.data(), to_a.size()), KVXFER_ERR_MISMATCH);
}

TEST(ofiPath, PeerOnAnotherHostTakesTheNetwork) {
  if (!provider_under_test().empty()) GTEST_SKIP() << "a provider is named";
  std::unique_ptr<Link> a, b;
  ASSERT_EQ(Link::create(loopback_config(), &a), KVXFER_SUCCESS) << kvxfer_get_last_error();
  ASSERT_EQ(Link::create(loopback_config(), &b), KVXFER_SUCCESS) << kvxfer_get_last_error();
  ASSERT_EQ(a->local_address()[6], 2) << "auto offers shm and the network";
  // Each side sees the other's blob with another host identity.
  std::vector<uint8_t> to_b = b->local_address(), to_a = a->local_address();
  to_b[8] ^= 1;
  to_a[8] ^= 1;
  ASSERT_EQ(a->connect(to_b.data(), to_b.size()), KVXFER_SUCCESS) << kvxfer_get_last_error();
  ASSERT_EQ(b->connect(to_a.data(), to_a.size()), KVXFER_SUCCESS) << kvxfer_get_last_error();
  Pair p;
  p.a = std::move(a);
  p.b = std::move(b);
  p.drv.links = {p.a.get(), p.b.get()};
  ASSERT_TRUE(p.drv.until([&] { return p.a->ready() && p.b->ready(); }, 30));
  for (Link* l : p.drv.links) {
    EXPECT_FALSE(l->same_host());
    EXPECT_EQ(l->provider(), auto_providers()[0]);
  }
  EXPECT_TRUE(exchange(&p, 1 << 20));
}

TEST(ofiPath, BlobOfAnotherVersionOrShapeIsRefused) {
  std::unique_ptr<Link> a, b;
  ASSERT_EQ(Link::create(loopback_config(), &a), KVXFER_SUCCESS);
  ASSERT_EQ(Link::create(loopback_config(), &b), KVXFER_SUCCESS);
  std::vector<uint8_t> blob = b->local_address();
  blob[4] = 1;  // version 1
  EXPECT_EQ(a->connect(blob.data(), blob.size()), KVXFER_ERR_MISMATCH);
  EXPECT_NE(std::string(kvxfer_get_last_error()).find("version 1"), std::string::npos);
  blob = b->local_address();
  blob[6] = 3;  // paths
  EXPECT_EQ(a->connect(blob.data(), blob.size()), KVXFER_ERR_CORRUPT);
  blob = b->local_address();
  blob.resize(blob.size() - 3);
  EXPECT_EQ(a->connect(blob.data(), blob.size()), KVXFER_ERR_CORRUPT);
  EXPECT_FALSE(a->failed());
}

// A same-host peer has no socket to watch: the survivor sees its process
// exit (pidfd) or its endpoints close (the regions' files go), in well under
// the timeout, and fails what is in flight.
TEST(ofiPath, SharedMemoryPeerThatClosesIsSeenBeforeTheTimeout) {
  if (!shm_under_test()) GTEST_SKIP() << "shared memory only";
  LinkConfig cfg = loopback_config();
  cfg.timeout_ms = 15000;
  Pair p;
  ASSERT_TRUE(make_pair(cfg, cfg, &p));
  ASSERT_TRUE(p.b->same_host());
  std::vector<uint8_t> dst(1 << 20);
  uint64_t r;
  ASSERT_EQ(p.b->post_recv(kA, dst.data(), dst.size(), 5, &r), KVXFER_SUCCESS);
  p.drv.until([] { return false; }, 0.05);
  const auto t0 = Clock::now();
  p.a.reset();  // closes a's endpoints; nothing was sent
  p.drv.links = {p.b.get()};
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(p.b.get(), {r}); }, 10));
  const double s = Sec(Clock::now() - t0).count();
  const Completion* c = p.drv.find(p.b.get(), r);
  EXPECT_NE(c->status, KVXFER_SUCCESS);
  EXPECT_NE(c->error.find("closed its shared-memory endpoint"), std::string::npos) << c->error;
  std::printf("[ info ] closed shm peer seen after %.3f s (timeout %.0f s)\n", s,
              cfg.timeout_ms / 1000.0);
  EXPECT_LT(s, 2.0);
}

/** The /dev/shm file of the anchor region a blob of the auto provider offers (its shm path). */
std::string shm_anchor_file(const std::vector<uint8_t>& blob) {
  size_t off = 8 + blob[7] + 4;  // header, host, pid
  const std::string prov(reinterpret_cast<const char*>(&blob[off + 1]), blob[off]);
  if (blob[6] != 2 || prov != kShmProvider) return "";
  off += 1 + blob[off];
  const size_t len = blob[off] | (blob[off + 1] << 8);
  std::string name(reinterpret_cast<const char*>(&blob[off + 2]), len);
  name.resize(strnlen(name.c_str(), name.size()));
  return "/dev/shm/" + name.substr(name.rfind('/') + 1);
}

// shm signals no file descriptor: each side of a same-host link makes a
// FIFO, and its peer writes to it after posting or completing anything
// (Link::prepare_wait, docs/TRANSPORT.md "Paths").  A receiver with a
// receive posted then sleeps in poll(2) until the sender's chunks are in its
// region, instead of polling.  The FIFO's name goes once the link is ready.
TEST(ofiPath, SharedMemoryReceiverSleepsUntilItsPeerRings) {
  if (!provider_under_test().empty()) GTEST_SKIP() << "a provider is named";
  Pair p;
  ASSERT_TRUE(make_pair(loopback_config(), loopback_config(), &p));
  ASSERT_TRUE(p.a->same_host());
  EXPECT_TRUE(p.a->has_doorbell());
  EXPECT_TRUE(p.b->has_doorbell());
  for (Link* l : {p.a.get(), p.b.get()}) {
    const std::string bell = shm_anchor_file(l->local_address()) + ".bell";
    struct stat st {};
    EXPECT_NE(::stat(bell.c_str(), &st), 0) << bell << " is still there";
  }
  const size_t n = 3 << 20;
  std::vector<uint8_t> src(n), dst(n);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  uint64_t r, s;
  ASSERT_EQ(p.b->post_recv(kA, dst.data(), n, 5, &r), KVXFER_SUCCESS);
  // Progress until b may sleep with its doorbell quiet (the handshake's
  // rings drained, the receive's post read back).
  std::vector<pollfd> fds;
  bool quiet = false;
  for (int i = 0; i < 10 && !quiet; ++i) {
    ASSERT_EQ(p.b->progress(), KVXFER_SUCCESS);
    fds.clear();
    quiet = p.b->prepare_wait(&fds) && ::poll(fds.data(), fds.size(), 0) == 0;
  }
  ASSERT_TRUE(quiet) << "a receive is awaited: the doorbell, not polling";
  ASSERT_EQ(fds.size(), 1u);
  EXPECT_EQ(::poll(fds.data(), fds.size(), 50), 0) << "a ring with nothing sent";
  ASSERT_EQ(p.a->post_send(kA, src.data(), n, 5, &s), KVXFER_SUCCESS);
  ASSERT_EQ(p.a->progress(), KVXFER_SUCCESS);  // posts the header and chunks: rings b
  const auto t0 = Clock::now();
  ASSERT_EQ(::poll(fds.data(), fds.size(), 5000), 1);
  EXPECT_NE(fds[0].revents & POLLIN, 0);
  std::printf("[ info ] the receiver woke %.0f us after the sender's progress()\n",
              std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(p.b.get(), {r}); }, 10));
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(p.a.get(), {s}); }, 10));
  EXPECT_EQ(p.drv.find(p.b.get(), r)->status, KVXFER_SUCCESS);
  EXPECT_EQ(p.drv.find(p.b.get(), r)->bytes, n);
  EXPECT_TRUE(dst == src);
}

// A message that arrived before its receive: shm completes the receive
// inside fi_trecv, into a queue nothing signals.  The side that posted must
// read it before it sleeps (it slept the engine's 100 ms cap instead, and a
// request to a connected endpoint took 100-300 ms at p99).
TEST(ofiPath, SharedMemoryReceiveOfAnArrivedMessageDoesNotSleep) {
  if (!provider_under_test().empty()) GTEST_SKIP() << "a provider is named";
  Pair p;
  ASSERT_TRUE(make_pair(loopback_config(), loopback_config(), &p));
  ASSERT_TRUE(p.b->has_doorbell());
  std::vector<uint8_t> src(64), dst(64);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(3 * i + 1);
  uint64_t r, s;
  ASSERT_EQ(p.a->post_send(kA, src.data(), src.size(), 7, &s), KVXFER_SUCCESS);
  ASSERT_TRUE(p.drv.until([&] { return p.drv.finished(p.a.get(), {s}); }, 10));
  for (int i = 0; i < 3; ++i) ASSERT_EQ(p.b->progress(), KVXFER_SUCCESS);  // unexpected at b
  ASSERT_EQ(p.b->post_recv(kA, dst.data(), dst.size(), 7, &r), KVXFER_SUCCESS);
  // The engine's loop: progress, and sleep when the link allows it.  Every
  // byte is at b already: a sleep that times out is a lost wake.
  const auto t0 = Clock::now();
  std::vector<Completion> done;
  int timed_out = 0;
  while (done.empty() && Clock::now() - t0 < std::chrono::seconds(5)) {
    p.b->poll(&done);
    std::vector<pollfd> fds;
    if (done.empty() && p.b->prepare_wait(&fds) && ::poll(fds.data(), fds.size(), 200) == 0)
      ++timed_out;
  }
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].op_id, r);
  EXPECT_EQ(done[0].status, KVXFER_SUCCESS);
  EXPECT_TRUE(dst == src);
  EXPECT_EQ(timed_out, 0) << "the receive completed inside its post and waited for a ring";
}

// A receive that times out is cancelled, and shm writes its completion
// inside fi_cancel, unsignalled: the link must read it before it sleeps.
TEST(ofiPath, SharedMemoryCancelledReceiveDoesNotSleep) {
  if (!provider_under_test().empty()) GTEST_SKIP() << "a provider is named";
  LinkConfig cfg = loopback_config();
  cfg.timeout_ms = 100;
  Pair p;
  ASSERT_TRUE(make_pair(cfg, cfg, &p));
  ASSERT_TRUE(p.b->has_doorbell());
  std::vector<uint8_t> dst(1 << 16);
  uint64_t r;
  ASSERT_EQ(p.b->post_recv(kA, dst.data(), dst.size(), 11, &r), KVXFER_SUCCESS);
  bool quiet = false;  // its header receive posted, the handshake's rings drained
  for (int i = 0; i < 10 && !quiet; ++i) {
    ASSERT_EQ(p.b->progress(), KVXFER_SUCCESS);
    std::vector<pollfd> fds;
    quiet = p.b->prepare_wait(&fds) && ::poll(fds.data(), fds.size(), 0) == 0;
  }
  ASSERT_TRUE(quiet);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  ASSERT_EQ(p.b->progress(), KVXFER_SUCCESS);  // the timeout: cancels the receive
  std::vector<Completion> done;
  for (int i = 0; i < 10 && done.empty(); ++i) {
    std::vector<pollfd> fds;
    ASSERT_FALSE(p.b->prepare_wait(&fds) && ::poll(fds.data(), fds.size(), 0) == 0)
        << "the cancelled receive's completion is unread: the link must not sleep";
    p.b->poll(&done);
  }
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].op_id, r);
  EXPECT_EQ(done[0].status, KVXFER_ERR_TIMEOUT) << done[0].error;
}

// A peer address whose doorbell name is not a FIFO (a hostile peer's
// regular file): nothing is written to it, and the link works by polling.
TEST(ofiPath, ADoorbellThatIsNotAFifoIsNeitherWrittenNorUsed) {
  if (!provider_under_test().empty()) GTEST_SKIP() << "a provider is named";
  std::unique_ptr<Link> a, b;
  ASSERT_EQ(Link::create(loopback_config(), &a), KVXFER_SUCCESS) << kvxfer_get_last_error();
  ASSERT_EQ(Link::create(loopback_config(), &b), KVXFER_SUCCESS) << kvxfer_get_last_error();
  const std::string bell = shm_anchor_file(b->local_address()) + ".bell";
  ASSERT_FALSE(bell.empty());
  ASSERT_EQ(::unlink(bell.c_str()), 0) << bell;
  const int fd = ::open(bell.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(a->connect(b->local_address().data(), b->local_address().size()), KVXFER_SUCCESS);
  ASSERT_EQ(b->connect(a->local_address().data(), a->local_address().size()), KVXFER_SUCCESS);
  Driver drv;
  drv.links = {a.get(), b.get()};
  ASSERT_TRUE(drv.until([&] { return a->ready() && b->ready(); }, 30));
  EXPECT_TRUE(a->has_doorbell());   // b holds a's FIFO
  EXPECT_FALSE(b->has_doorbell());  // a does not ring b
  std::vector<uint8_t> src(1 << 20, 0x5A), dst(1 << 20);
  uint64_t r, s;
  ASSERT_EQ(b->post_recv(kA, dst.data(), dst.size(), 9, &r), KVXFER_SUCCESS);
  ASSERT_EQ(a->post_send(kA, src.data(), src.size(), 9, &s), KVXFER_SUCCESS);
  std::vector<pollfd> fds;
  EXPECT_FALSE(b->prepare_wait(&fds)) << "no doorbell and a receive awaited: b must poll";
  ASSERT_TRUE(
      drv.until([&] { return drv.finished(b.get(), {r}) && drv.finished(a.get(), {s}); }, 10));
  EXPECT_TRUE(dst == src);
  struct stat st {};
  ASSERT_EQ(::fstat(fd, &st), 0);
  EXPECT_EQ(st.st_size, 0) << "a wrote into a file that is not a doorbell";
  ::close(fd);
  (void)::unlink(bell.c_str());
}

// libfabric 1.17's shm keeps a spinlock in each region; a receiver holds its
// own while it copies, and a sender takes it to post.  A peer killed (or
// stopped) holding it would leave this side spinning in fi_tsend for good:
// the watcher (shm_reaper.h) releases it, and the link fails as for any dead
// (or silent) peer.
void peer_holding_its_region_lock(bool stop) {
  alarm(120);  // without the watcher this side spins inside libfabric: die, do not hang
  const uint64_t released_before = ShmLockWatch::released();
  LinkConfig cfg = loopback_config();
  cfg.timeout_ms = 1000;
  Child child;
  ASSERT_TRUE(child.start([&](int rfd, int wfd) {
    std::unique_ptr<Link> link;
    if (Link::create(cfg, &link) != KVXFER_SUCCESS || !send_blob(wfd, link->local_address()))
      return 2;
    std::vector<uint8_t> peer;
    if (!recv_blob(rfd, &peer, 30000) || link->connect(peer.data(), peer.size()) != KVXFER_SUCCESS)
      return 3;
    while (!link->ready())
      if (link->progress() != KVXFER_SUCCESS) return 4;
    // Die, or stop, inside the section libfabric's progress holds the lock for.
    const int fd = open(shm_anchor_file(link->local_address()).c_str(), O_RDWR);
    void* p = fd < 0 ? MAP_FAILED : mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return 5;
    pthread_spin_lock(reinterpret_cast<pthread_spinlock_t*>(static_cast<char*>(p) + 24));
    const char m = 'h';
    (void)write_all(wfd, &m, 1);
    usleep(300 * 1000);
    raise(stop ? SIGSTOP : SIGKILL);
    return 6;
  }));
  std::unique_ptr<Link> link;
  ASSERT_EQ(Link::create(cfg, &link), KVXFER_SUCCESS) << kvxfer_get_last_error();
  ASSERT_TRUE(send_blob(child.to_child, link->local_address()));
  std::vector<uint8_t> peer;
  ASSERT_TRUE(recv_blob(child.from_child, &peer, 30000));
  ASSERT_FALSE(shm_anchor_file(peer).empty());
  ASSERT_EQ(link->connect(peer.data(), peer.size()), KVXFER_SUCCESS) << kvxfer_get_last_error();
  const auto t0 = Clock::now();
  while (!link->ready()) {
    ASSERT_LT(Clock::now() - t0, std::chrono::seconds(30)) << "handshake with the child";
    ASSERT_EQ(link->progress(), KVXFER_SUCCESS) << kvxfer_get_last_error();
  }
  pollfd pf{child.from_child, POLLIN, 0};
  ASSERT_EQ(poll(&pf, 1, 30000), 1) << "the child never took its lock";
  std::vector<uint8_t> src(1 << 20, 7);
  uint64_t s;
  ASSERT_EQ(link->post_send(kA, src.data(), src.size(), 1, &s), KVXFER_SUCCESS);
  const auto posted = Clock::now();
  std::vector<Completion> done;
  while (done.empty() && Clock::now() - posted < std::chrono::seconds(20)) link->poll(&done);
  ASSERT_EQ(done.size(), 1u) << "the send hung";
  EXPECT_NE(done[0].status, KVXFER_SUCCESS);
  EXPECT_NE(done[0].error.find(stop ? "made no progress" : "exited or was killed"),
            std::string::npos)
      << done[0].error;
  EXPECT_GT(ShmLockWatch::released(), released_before);
  std::printf(
      "[ info ] the send failed %.2f s after it was posted (the child %s holding its "
      "lock 0.3 s in; timeout %lld ms): %s\n",
      Sec(Clock::now() - posted).count(), stop ? "stopped" : "died",
      static_cast<long long>(cfg.timeout_ms), done[0].error.c_str());
  if (stop) kill(child.pid, SIGKILL);
  child.wait(10);
  alarm(0);
}

TEST(ofiPath, PeerKilledHoldingItsRegionLockDoesNotHangTheSurvivor) {
  if (!provider_under_test().empty()) GTEST_SKIP() << "a provider is named";
  peer_holding_its_region_lock(false);
}

TEST(ofiPath, PeerStoppedHoldingItsRegionLockFailsAfterTheTimeout) {
  if (!provider_under_test().empty()) GTEST_SKIP() << "a provider is named";
  peer_holding_its_region_lock(true);
}

// A child forked while this process's watcher waits on the registry's
// condition variable inherits the variable with a waiter that does not exist
// in the child: glibc's notify_all there (a watch's destructor) then waited
// for it for good.  Seen as a rare sender hang in comm_destroy
// (Xfer.Int4AndBf16Monolithic, about 1 run in 250 under load): its
// progress thread stuck in ~ShmLockWatch.
TEST(ofiPath, AChildForkedDuringAWatchEndsItsOwnWatch) {
  const std::string file = "/dev/shm/kvxfer-test-watch-" + std::to_string(getpid());
  {
    const int fd = open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 4096), 0);
    std::vector<uint8_t> page(4096, 0);
    page[0] = smr::kVersion;
    const int unlocked = 1;  // glibc's unlocked spinlock: the watch has nothing to release
    std::memcpy(page.data() + smr::kLockOffset, &unlocked, sizeof unlocked);
    ASSERT_TRUE(write_all(fd, page.data(), page.size()));
    close(fd);
  }
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, getpid(), 0));
  ASSERT_GE(pidfd, 0);
  std::atomic<uint64_t> epoch{0};
  std::unique_ptr<ShmLockWatch> mine = ShmLockWatch::start(pidfd, getpid(), {file}, &epoch, 60000);
  ASSERT_NE(mine, nullptr);
  int hung = 0;
  for (int i = 0; i < 8 && hung == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(7));  // the watcher waits, nearly always
    const pid_t c = fork();
    ASSERT_GE(c, 0);
    if (c == 0) {  // watches come and go, as a child's links do
      for (int k = 0; k < 4; ++k) {
        std::unique_ptr<ShmLockWatch> w =
            ShmLockWatch::start(pidfd, getpid(), {file}, &epoch, 60000);
        if (w == nullptr) _exit(3);
        std::this_thread::sleep_for(std::chrono::milliseconds(k * 11));
        w.reset();  // notify_all
      }
      _exit(0);
    }
    int st = 0;
    const auto t0 = Clock::now();
    while (waitpid(c, &st, WNOHANG) == 0) {
      if (Clock::now() - t0 > std::chrono::seconds(5)) {
        kill(c, SIGKILL);
        waitpid(c, &st, 0);
        ++hung;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (WIFEXITED(st)) {
      EXPECT_EQ(WEXITSTATUS(st), 0) << "fork " << i << ": no watch started";
    }
  }
  EXPECT_EQ(hung, 0) << "a child hung ending its watch (5 s)";
  mine.reset();
  close(pidfd);
  unlink(file.c_str());
}

// shm's first endpoint installs SIGINT/SIGTERM/SIGSEGV/SIGBUS handlers that
// unlink the process's regions.  The Link keeps the process's own: a server
// that drains on SIGTERM keeps its same-host links.
std::atomic<int> g_sigterm_seen{0};
void on_sigterm(int) { g_sigterm_seen.fetch_add(1); }

TEST(ofiPath, ProcessSignalHandlersAreKept) {
  if (!shm_under_test()) GTEST_SKIP() << "shared memory only";
  Child child;  // its own process: the handlers are process-wide
  ASSERT_TRUE(child.start([&](int, int) {
    struct sigaction mine {};
    mine.sa_handler = on_sigterm;
    sigemptyset(&mine.sa_mask);
    if (sigaction(SIGTERM, &mine, nullptr) != 0) return 2;
    struct sigaction before_int {};
    sigaction(SIGINT, nullptr, &before_int);
    Pair p;
    if (!make_pair(loopback_config(), loopback_config(), &p) || !p.a->same_host()) return 3;
    struct sigaction now {};
    sigaction(SIGTERM, nullptr, &now);
    if (now.sa_handler != on_sigterm) return 4;
    sigaction(SIGINT, nullptr, &now);
    if (now.sa_handler != before_int.sa_handler) return 5;
    raise(SIGTERM);  // handled: the process goes on, its links too
    if (g_sigterm_seen.load() != 1) return 6;
    if (!exchange(&p, 1 << 20)) return 7;
    return 0;
  }));
  ASSERT_TRUE(child.wait(30)) << "the child hung";
  ASSERT_TRUE(WIFEXITED(child.status)) << "the child died of signal " << WTERMSIG(child.status);
  EXPECT_EQ(WEXITSTATUS(child.status), 0)
      << "2-3: setup, 4-5: a handler replaced, 6: SIGTERM not seen, 7: the links failed after "
         "SIGTERM";
}

// ---------------------------------------------------------------------------
// DSCP marking
// ---------------------------------------------------------------------------
TEST(ofiDscp, LinkMarksItsSockets) {
  Pair p;
  ASSERT_TRUE(make_pair(network_config(), network_config(), &p));
  for (Link* l : p.drv.links) {
    const DscpReport& r = l->dscp_report();
    if (!r.supported) GTEST_SKIP() << "provider " << l->provider() << ": " << r.note;
    for (int c = 0; c < kNumClasses; ++c) {
      EXPECT_GE(r.sockets[c], 1) << class_name(static_cast<TrafficClass>(c));
      EXPECT_EQ(r.tos_after[c], l->config().dscp[c] << 2)
          << class_name(static_cast<TrafficClass>(c));
      std::printf(
          "[ info ] %s %s: %d socket(s), TOS before 0x%02x after 0x%02x, TCP_NODELAY %d "
          "(tclass %s)\n",
          l->provider().c_str(), class_name(static_cast<TrafficClass>(c)), r.sockets[c],
          r.tos_before[c], r.tos_after[c], r.nodelay[c],
          tclass_to_string(l->config().tclass[c]).c_str());
    }
  }
}

TEST(ofiDscp, ProviderIgnoresTclassDscp) {
  // tclass = FI_TC_DSCP | dscp on both endpoints, no marking by the layer:
  // what TOS does the provider put on the connections it makes?
  LinkConfig cfg = network_config();
  cfg.tclass = {fi_tc_dscp_set(46), fi_tc_dscp_set(8)};
  cfg.dscp = {-1, -1};
  Pair p;
  ASSERT_TRUE(make_pair(cfg, cfg, &p));
  if (!p.a->dscp_report().supported) GTEST_SKIP() << p.a->dscp_report().note;
  int connected_seen = 0;
  for (Link* l : p.drv.links) {
    const DscpReport& r = l->dscp_report();
    for (int c = 0; c < kNumClasses; ++c) {
      std::printf("[ info ] %s %s with tclass %s, no marking: TOS 0x%02x, TCP_NODELAY %d\n",
                  l->provider().c_str(), class_name(static_cast<TrafficClass>(c)),
                  tclass_to_string(cfg.tclass[c]).c_str(), r.tos_after[c], r.nodelay[c]);
      if (r.tos_after[c] >= 0) {
        ++connected_seen;
        EXPECT_EQ(r.tos_after[c], 0)
            << "this provider honours FI_TC_DSCP: update docs/TRANSPORT.md";
      }
    }
  }
  EXPECT_GT(connected_seen, 0);
}

/** Captures IPv4 TCP and UDP packets on lo: (source port, destination port, TOS). */
class LoopbackCapture {
 public:
  bool start(std::string* why) {
    fd_ = socket(AF_PACKET, SOCK_DGRAM, htons(ETH_P_IP));
    if (fd_ < 0) {
      *why = std::string("AF_PACKET socket: ") + std::strerror(errno) + " (needs CAP_NET_RAW)";
      return false;
    }
    sockaddr_ll sll{};
    sll.sll_family = AF_PACKET;
    sll.sll_protocol = htons(ETH_P_IP);
    sll.sll_ifindex = static_cast<int>(if_nametoindex("lo"));
    timeval tv{0, 50000};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    // Loopback packets are up to 64 KiB each: a default-sized buffer drops most.
    const int rcvbuf = 64 << 20;
    if (setsockopt(fd_, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof(rcvbuf)) != 0)
      setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    if (sll.sll_ifindex == 0 || bind(fd_, reinterpret_cast<sockaddr*>(&sll), sizeof(sll)) != 0) {
      *why = std::string("bind to lo: ") + std::strerror(errno);
      return false;
    }
    thread_ = std::thread([this] {
      uint8_t buf[256];
      while (!stop_) {
        const ssize_t n = recv(fd_, buf, sizeof(buf), MSG_TRUNC);
        if (n < 20) continue;
        const size_t ihl = (buf[0] & 0xF) * 4u;
        if ((buf[0] >> 4) != 4 || (buf[9] != IPPROTO_TCP && buf[9] != IPPROTO_UDP) ||
            static_cast<size_t>(n) < ihl + 14)
          continue;
        const uint16_t sport = static_cast<uint16_t>(buf[ihl] << 8 | buf[ihl + 1]);
        const uint16_t dport = static_cast<uint16_t>(buf[ihl + 2] << 8 | buf[ihl + 3]);
        const bool syn = buf[9] == IPPROTO_TCP && (buf[ihl + 13] & 0x02);
        std::lock_guard<std::mutex> lk(mu_);
        packets_.push_back({sport, dport, buf[1], syn});
      }
    });
    return true;
  }
  struct Packet {
    uint16_t sport, dport;
    uint8_t tos;
    bool syn;
  };
  std::vector<Packet> stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> lk(mu_);
    return packets_;
  }
  ~LoopbackCapture() {
    stop();
    if (fd_ >= 0) close(fd_);
  }

 private:
  int fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::vector<Packet> packets_;
};

uint16_t port_of(const std::vector<uint8_t>& name) {
  return ntohs(reinterpret_cast<const sockaddr_in*>(name.data())->sin_port);
}

TEST(ofiDscp, PacketsOnTheWireCarryTheClassDscp) {
  std::string why;
  LoopbackCapture cap;
  if (!cap.start(&why)) GTEST_SKIP() << "cannot capture on lo: " << why;
  std::unique_ptr<Link> a, b;
  LinkConfig cfg = network_config();
  ASSERT_EQ(Link::create(cfg, &a), KVXFER_SUCCESS);
  ASSERT_EQ(Link::create(cfg, &b), KVXFER_SUCCESS);
  if (!a->dscp_report().supported) GTEST_SKIP() << a->dscp_report().note;
  // The listening ports of each class: every connection of a class has one
  // of them at one end.  (Parsed from the blob, docs/TRANSPORT.md "Address blob".)
  std::set<uint16_t> ports[kNumClasses];
  for (Link* l : {a.get(), b.get()}) {
    const std::vector<uint8_t>& blob = l->local_address();
    // One path (a network provider): header, host, pid, provider.
    ASSERT_EQ(blob[6], 1);
    size_t off = 8 + blob[7] + 4;
    off += 1 + blob[off];
    for (int c = 0; c < kNumClasses; ++c) {
      const size_t len = blob[off] | (blob[off + 1] << 8);
      ports[c].insert(
          port_of(std::vector<uint8_t>(blob.begin() + off + 2, blob.begin() + off + 2 + len)));
      off += 2 + len;
    }
  }
  Pair p;
  p.a = std::move(a);
  p.b = std::move(b);
  ASSERT_EQ(p.a->connect(p.b->local_address().data(), p.b->local_address().size()), KVXFER_SUCCESS);
  ASSERT_EQ(p.b->connect(p.a->local_address().data(), p.a->local_address().size()), KVXFER_SUCCESS);
  p.drv.links = {p.a.get(), p.b.get()};
  ASSERT_TRUE(p.drv.until([&] { return p.a->ready() && p.b->ready(); }, 30));
  // The handshake's own packets precede the marking; start a fresh capture.
  (void)cap.stop();
  LoopbackCapture cap2;
  ASSERT_TRUE(cap2.start(&why)) << why;
  // Both directions, both classes, several messages each.
  const std::vector<uint8_t> src = pattern(1, 1 << 20);
  std::vector<std::vector<uint8_t>> dst;
  std::map<Link*, std::vector<uint64_t>> recvs;
  for (int m = 0; m < 4; ++m)
    for (TrafficClass c : {kA, kR})
      for (Link* to : {p.a.get(), p.b.get()}) {
        Link* from = to == p.a.get() ? p.b.get() : p.a.get();
        dst.emplace_back(src.size());
        uint64_t r, x;
        ASSERT_EQ(to->post_recv(c, dst.back().data(), src.size(), m, &r), KVXFER_SUCCESS);
        ASSERT_EQ(from->post_send(c, src.data(), src.size(), m, &x), KVXFER_SUCCESS);
        recvs[to].push_back(r);
      }
  ASSERT_TRUE(p.drv.until(
      [&] {
        return p.drv.finished(p.a.get(), recvs[p.a.get()]) &&
               p.drv.finished(p.b.get(), recvs[p.b.get()]);
      },
      60));
  const std::vector<LoopbackCapture::Packet> pk = cap2.stop();
  std::map<int, std::map<int, int>> seen;  // class -> tos -> packets
  for (const auto& q : pk) {
    for (int c = 0; c < kNumClasses; ++c)
      if (ports[c].count(q.sport) || ports[c].count(q.dport)) seen[c][q.tos]++;
  }
  for (int c = 0; c < kNumClasses; ++c) {
    const int want = cfg.dscp[c] << 2;
    ASSERT_FALSE(seen[c].empty()) << "no " << class_name(static_cast<TrafficClass>(c))
                                  << " packets seen";
    for (const auto& t : seen[c]) {
      std::printf("[ info ] %s packets with TOS 0x%02x (DSCP %d): %d\n",
                  class_name(static_cast<TrafficClass>(c)), t.first, t.first >> 2, t.second);
      EXPECT_EQ(t.first & ~3, want) << class_name(static_cast<TrafficClass>(c));
    }
  }
}

// ---------------------------------------------------------------------------
// Provider survey (a measurement, run on request)
// ---------------------------------------------------------------------------
TEST(ofiProviders, Survey) {
  // Runs this whole test binary once per provider (KVXFER_TEST_OFI_PROVIDER),
  // each run in its own process with a deadline, and prints one line each.
  if (std::getenv("KVXFER_TEST_PROVIDER_SURVEY") == nullptr)
    GTEST_SKIP()
        << "set KVXFER_TEST_PROVIDER_SURVEY=1 to measure every provider (docs/TRANSPORT.md)";
  const char* providers[] = {"tcp;ofi_rxm", "shm",     "tcp",        "net",
                             "net;ofi_rxm", "sockets", "udp;ofi_rxd"};
  bool rxm_ok = false;
  for (const char* prov : providers) {
    char log[] = "/tmp/kvxfer_survey_XXXXXX";
    const int fd = mkstemp(log);
    ASSERT_GE(fd, 0);
    const auto t0 = Clock::now();
    fflush(nullptr);
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      setenv("KVXFER_TEST_OFI_PROVIDER", prov, 1);
      unsetenv("KVXFER_TEST_PROVIDER_SURVEY");
      execl("/proc/self/exe", "ofi_test", "--gtest_filter=ofi*-ofiProviders.*", nullptr);
      _exit(127);
    }
    close(fd);
    int status = 0;
    bool exited = false;
    while (Sec(Clock::now() - t0).count() < 300) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        break;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    if (!exited) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
    }
    std::string out;
    if (FILE* f = std::fopen(log, "r")) {
      char line[1024];
      while (std::fgets(line, sizeof(line), f)) {
        const std::string l(line);
        if (l.find("[  FAILED  ] ofi") == 0 && l.find(" ms)") != std::string::npos)
          out += "    " + l;
        if (l.find("[  PASSED  ]") == 0 || l.find("[ info ]") == 0 ||
            l.find("[  SKIPPED ] ofi") == 0)
          out += "    " + l;
      }
      std::fclose(f);
    }
    std::remove(log);
    const bool ok = exited && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    std::printf("[ survey ] %-12s %s after %.1f s\n%s", prov,
                !exited ? "HUNG (killed at 300 s)"
                : ok    ? "all tests pass"
                        : "FAILURES",
                Sec(Clock::now() - t0).count(), out.c_str());
    if (std::string(prov) == "tcp;ofi_rxm") rxm_ok = ok;
  }
  EXPECT_TRUE(rxm_ok) << "tcp;ofi_rxm must pass";
}

}  // namespace
}  // namespace kvxfer::transport
