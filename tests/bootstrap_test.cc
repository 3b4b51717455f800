// Bootstrap (transport/bootstrap.h): unique id, root, ranks.  Loopback only.
#include "transport/bootstrap.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"

namespace kvxfer::transport {
namespace {

using Clock = std::chrono::steady_clock;

long ms_since(Clock::time_point t0) {
  return static_cast<long>(
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
}

std::vector<uint8_t> blob_for(int rank) {
  std::vector<uint8_t> b(1000 + 1500 * static_cast<size_t>(rank));
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(rank * 31 + i * 7 + (i >> 8));
  return b;
}

struct Outcome {
  kvxfer_result_t r = KVXFER_ERR_INTERNAL;
  std::string err;
  AddressTable table;
  long ms = 0;
};

Outcome run_rank(const UniqueId& id, int rank, int nranks, int timeout_ms,
                 std::vector<uint8_t> payload) {
  Outcome o;
  auto t0 = Clock::now();
  o.r = bootstrap_connect(id, rank, nranks, timeout_ms, payload.data(), payload.size(), &o.table);
  o.ms = ms_since(t0);
  o.err = last_error();
  return o;
}

std::future<Outcome> start_rank(const UniqueId& id, int rank, int nranks, int timeout_ms) {
  return std::async(std::launch::async, run_rank, id, rank, nranks, timeout_ms, blob_for(rank));
}

std::future<Outcome> start_root(BootstrapRoot* root, int nranks, int timeout_ms) {
  return std::async(std::launch::async, [=] {
    Outcome o;
    auto t0 = Clock::now();
    o.r = root->accept_all(nranks, timeout_ms);
    o.ms = ms_since(t0);
    o.err = last_error();
    return o;
  });
}

void expect_full_table(const Outcome& o, int nranks) {
  ASSERT_EQ(o.r, KVXFER_SUCCESS) << o.err;
  ASSERT_EQ(o.table.size(), static_cast<size_t>(nranks));
  for (int r = 0; r < nranks; ++r) EXPECT_EQ(o.table[r], blob_for(r)) << "rank " << r;
}

/** A raw TCP connection to the root (test-side attacker), with a recv timeout. */
int raw_connect(const UniqueId& id) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = id.port;
  std::memcpy(&sa.sin_addr, id.addr, 4);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

/** True when the root closed (EOF or reset) before the 5 s receive timeout. */
bool closed_by_root(int fd) {
  char c;
  for (;;) {
    ssize_t n = ::recv(fd, &c, 1, 0);
    if (n == 0) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno == ECONNRESET;
    return false;  // the root never sends anything to a refused peer
  }
}

TEST(Bootstrap, OneRootThreeRanksExchangeBlobs) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_root(root.get(), 3, 10000);
  std::vector<std::future<Outcome>> ranks;
  for (int r = 0; r < 3; ++r) ranks.push_back(start_rank(id, r, 3, 10000));
  for (auto& f : ranks) expect_full_table(f.get(), 3);
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_SUCCESS) << ro.err;
}

TEST(Bootstrap, RanksMayStartBeforeTheRootAccepts) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id(nullptr, &id, &root), KVXFER_SUCCESS) << last_error();
  std::vector<std::future<Outcome>> ranks;
  for (int r = 0; r < 2; ++r) ranks.push_back(start_rank(id, r, 2, 10000));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // ranks wait in the backlog
  auto rootf = start_root(root.get(), 2, 10000);
  for (auto& f : ranks) expect_full_table(f.get(), 2);
  EXPECT_EQ(rootf.get().r, KVXFER_SUCCESS);
}

TEST(Bootstrap, WrongSecretIsRefusedWhileLegitRanksComplete) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_root(root.get(), 3, 10000);

  UniqueId bad = id;
  bad.secret[kBootstrapSecretBytes - 1] ^= 0x01;
  Outcome b = run_rank(bad, 0, 3, 5000, blob_for(0));  // the root is waiting: refused at once
  EXPECT_EQ(b.r, KVXFER_ERR_SYSTEM) << b.err;
  EXPECT_NE(b.err.find("bootstrap refused by root: "), std::string::npos) << b.err;
  EXPECT_LT(b.ms, 4000);

  std::vector<std::future<Outcome>> ranks;
  for (int r = 0; r < 3; ++r) ranks.push_back(start_rank(id, r, 3, 10000));
  for (auto& f : ranks) expect_full_table(f.get(), 3);
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_SUCCESS) << ro.err;
}

TEST(Bootstrap, NranksMismatchAndDuplicateRankAreRefused) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_root(root.get(), 3, 10000);

  // Right secret, wrong nranks (rank 5 of 8 when the root expects 3).
  Outcome m = run_rank(id, 5, 8, 5000, blob_for(5));
  EXPECT_EQ(m.r, KVXFER_ERR_SYSTEM) << m.err;
  EXPECT_NE(m.err.find("refused"), std::string::npos) << m.err;

  // Two claimants of rank 0: whichever comes second is refused.
  auto a = start_rank(id, 0, 3, 10000);
  auto c = start_rank(id, 0, 3, 10000);
  auto t0 = Clock::now();
  while (a.wait_for(std::chrono::milliseconds(2)) != std::future_status::ready &&
         c.wait_for(std::chrono::milliseconds(2)) != std::future_status::ready)
    ASSERT_LT(ms_since(t0), 5000) << "neither duplicate rank 0 was refused";
  bool a_first = a.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  Outcome loser = a_first ? a.get() : c.get();
  EXPECT_EQ(loser.r, KVXFER_ERR_SYSTEM) << loser.err;
  EXPECT_NE(loser.err.find("refused"), std::string::npos) << loser.err;

  auto r1 = start_rank(id, 1, 3, 10000);
  auto r2 = start_rank(id, 2, 3, 10000);
  expect_full_table(a_first ? c.get() : a.get(), 3);
  expect_full_table(r1.get(), 3);
  expect_full_table(r2.get(), 3);
  EXPECT_EQ(rootf.get().r, KVXFER_SUCCESS);
}

// A rank with the secret but another nranks, whose rank is one of the
// root's: the job cannot complete, so every rank fails at once with both
// counts, not at the timeout (NCCL's root fails on a rank-count mismatch too).
TEST(Bootstrap, ARankStartedWithAnotherNranksFailsEveryRankFast) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  constexpr int kTimeoutMs = 30000;
  auto rootf = start_root(root.get(), 3, kTimeoutMs);
  auto r0 = start_rank(id, 0, 3, kTimeoutMs);
  auto r2 = start_rank(id, 2, 3, kTimeoutMs);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // 0 and 2 are waiting
  Outcome odd = run_rank(id, 1, 4, kTimeoutMs, blob_for(1));
  const char* why = "rank 1 failed: it was started with nranks 4, the root with 3";
  for (Outcome o : {r0.get(), r2.get(), odd}) {
    EXPECT_EQ(o.r, KVXFER_ERR_SYSTEM) << o.err;
    EXPECT_NE(o.err.find(why), std::string::npos) << o.err;
    EXPECT_LT(o.ms, 5000) << o.err;
    EXPECT_TRUE(o.table.empty());
  }
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_ERR_SYSTEM) << ro.err;
  EXPECT_NE(ro.err.find(why), std::string::npos) << ro.err;
  EXPECT_LT(ro.ms, 5000);
  EXPECT_EQ(root->failed_rank(), 1);
}

TEST(Bootstrap, MissingRankTimesOut) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  const int timeout_ms = 300;
  auto rootf = start_root(root.get(), 3, timeout_ms);
  auto r0 = start_rank(id, 0, 3, 10000);
  auto r1 = start_rank(id, 1, 3, 10000);
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_ERR_TIMEOUT) << ro.err;
  EXPECT_GE(ro.ms, timeout_ms - 10);
  EXPECT_LT(ro.ms, 10 * timeout_ms);
  EXPECT_NE(ro.err.find("missing: 2"), std::string::npos) << ro.err;
  // The ranks that came are told, and fail fast rather than at their own 10 s.
  for (auto* f : {&r0, &r1}) {
    Outcome o = f->get();
    EXPECT_EQ(o.r, KVXFER_ERR_TIMEOUT) << o.err;
    EXPECT_LT(o.ms, 5000);
  }
}

TEST(Bootstrap, RankTimesOutWithoutRoot) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  root.reset();  // nothing listens any more
  Outcome o = run_rank(id, 0, 2, 200, blob_for(0));
  EXPECT_EQ(o.r, KVXFER_ERR_TIMEOUT) << o.err;
  EXPECT_GE(o.ms, 150);
  EXPECT_LT(o.ms, 2000);

  // A root that listens but never accepts: the rank times out waiting for the table.
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  o = run_rank(id, 0, 2, 200, blob_for(0));
  EXPECT_EQ(o.r, KVXFER_ERR_TIMEOUT) << o.err;
  EXPECT_LT(o.ms, 2000);
}

TEST(Bootstrap, GarbageIsRefusedWithoutHangingTheRoot) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_root(root.get(), 2, 10000);

  // An idle connection that never sends: must not block anyone.
  int idle = raw_connect(id);
  ASSERT_GE(idle, 0);

  // HTTP: the "length" is huge, refused at once.
  int http = raw_connect(id);
  ASSERT_GE(http, 0);
  const char req[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(::send(http, req, sizeof req - 1, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof req - 1));
  EXPECT_TRUE(closed_by_root(http));
  ::close(http);

  // A plausible length with random bytes: bad magic.
  int junk = raw_connect(id);
  ASSERT_GE(junk, 0);
  std::vector<uint8_t> f(4 + 60);
  uint32_t len = 60;
  std::memcpy(f.data(), &len, 4);  // little-endian host
  for (size_t i = 4; i < f.size(); ++i) f[i] = static_cast<uint8_t>(i * 131 + 7);
  ASSERT_EQ(::send(junk, f.data(), f.size(), MSG_NOSIGNAL), static_cast<ssize_t>(f.size()));
  EXPECT_TRUE(closed_by_root(junk));
  ::close(junk);

  // A truncated hello then a hang-up.
  int cut = raw_connect(id);
  ASSERT_GE(cut, 0);
  ASSERT_EQ(::send(cut, f.data(), 10, MSG_NOSIGNAL), 10);
  ::close(cut);

  // A zero length.
  int zero = raw_connect(id);
  ASSERT_GE(zero, 0);
  uint32_t z = 0;
  ASSERT_EQ(::send(zero, &z, 4, MSG_NOSIGNAL), 4);
  EXPECT_TRUE(closed_by_root(zero));
  ::close(zero);

  auto r0 = start_rank(id, 0, 2, 10000);
  auto r1 = start_rank(id, 1, 2, 10000);
  expect_full_table(r0.get(), 2);
  expect_full_table(r1.get(), 2);
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_SUCCESS) << ro.err;
  ::close(idle);
}

// A flood of silent connections queued behind the ranks' (more than the
// root holds, kMaxPending) does not push the ranks out: their hellos are
// read between bounded batches of accepts.  Before, the root accepted the
// whole backlog first, evicting the oldest connections, the ranks', before
// their hellos were read ("refused by root").
TEST(Bootstrap, AFloodOfSilentConnectionsBehindTheRanksDoesNotEvictThem) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  // The ranks connect and send their hellos into the listener's backlog...
  auto r0 = start_rank(id, 0, 2, 20000);
  auto r1 = start_rank(id, 1, 2, 20000);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // ...then 400 connections that never send queue behind them...
  std::vector<int> silent;
  for (int i = 0; i < 400; ++i) {
    const int fd = raw_connect(id);
    ASSERT_GE(fd, 0) << i;
    silent.push_back(fd);
  }
  // ...and only then does the root accept.
  auto rootf = start_root(root.get(), 2, 20000);
  expect_full_table(r0.get(), 2);
  expect_full_table(r1.get(), 2);
  const Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_SUCCESS) << ro.err;
  for (int fd : silent) ::close(fd);
}

TEST(Bootstrap, UniqueIdRoundTripsThroughBytes) {
  UniqueId a, b;
  std::unique_ptr<BootstrapRoot> ra, rb;
  ASSERT_EQ(create_unique_id("127.0.0.1", &a, &ra), KVXFER_SUCCESS) << last_error();
  ASSERT_EQ(create_unique_id("127.0.0.1", &b, &rb), KVXFER_SUCCESS) << last_error();
  EXPECT_NE(std::memcmp(a.secret, b.secret, kBootstrapSecretBytes), 0);
  EXPECT_NE(a.port, b.port);

  unsigned char bytes[sizeof(UniqueId)];
  std::memcpy(bytes, &a, sizeof bytes);
  UniqueId c;
  std::memset(&c, 0xff, sizeof c);
  std::memcpy(&c, bytes, sizeof c);
  EXPECT_EQ(std::memcmp(&a, &c, sizeof c), 0);
  EXPECT_EQ(unique_id_address(c), unique_id_address(a));

  // The copy works as the original would.
  auto rootf = start_root(ra.get(), 1, 10000);
  Outcome o = run_rank(c, 0, 1, 10000, blob_for(0));
  expect_full_table(o, 1);
  EXPECT_EQ(rootf.get().r, KVXFER_SUCCESS);
  // One-shot: a second accept_all is a usage error.
  EXPECT_EQ(ra->accept_all(1, 100), KVXFER_ERR_INVALID_USAGE);
}

// ---------------------------------------------------------------------------
// Fail fast: a failure report (bootstrap_report_failure) or the root's own
// rank failing (fail_all) ends every rank's wait within about a second.
// ---------------------------------------------------------------------------
struct Report {
  kvxfer_result_t r = KVXFER_ERR_INTERNAL;
  std::string err;
  long ms = 0;
};
Report report(const UniqueId& id, int rank, int nranks, int timeout_ms, const char* reason) {
  Report o;
  auto t0 = Clock::now();
  o.r = bootstrap_report_failure(id, rank, nranks, timeout_ms, reason);
  o.ms = ms_since(t0);
  o.err = last_error();
  return o;
}

TEST(Bootstrap, FailureReportFailsEveryRankFast) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  constexpr int kTimeoutMs = 30000;
  const auto t0 = Clock::now();
  auto rootf = start_root(root.get(), 4, kTimeoutMs);
  auto r0 = start_rank(id, 0, 4, kTimeoutMs);
  auto r2 = start_rank(id, 2, 4, kTimeoutMs);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // 0 and 2 are waiting
  Report rep = report(id, 1, 4, kTimeoutMs, "no NIC\nat all");
  EXPECT_EQ(rep.r, KVXFER_SUCCESS) << rep.err;  // the root acknowledged
  EXPECT_LT(rep.ms, 2000);
  // Rank 3 comes within the grace: told as well.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  Outcome o3 = run_rank(id, 3, 4, kTimeoutMs, blob_for(3));
  for (Outcome o : {r0.get(), r2.get(), o3}) {
    EXPECT_EQ(o.r, KVXFER_ERR_SYSTEM) << o.err;
    EXPECT_NE(o.err.find("rank 1 failed: no NIC?at all"), std::string::npos) << o.err;
    EXPECT_LT(o.ms, 5000) << o.err;
    EXPECT_TRUE(o.table.empty());
  }
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_ERR_SYSTEM) << ro.err;
  EXPECT_NE(ro.err.find("rank 1 failed: no NIC?at all"), std::string::npos) << ro.err;
  EXPECT_NE(ro.err.find("told 4 of 4 ranks"), std::string::npos) << ro.err;
  EXPECT_EQ(root->failed_rank(), 1);
  const long total = ms_since(t0);
  EXPECT_LT(total, 5000);  // not the 30 s timeout
  std::printf("[ fail fast ] every rank failed %ld ms after the start (timeout %d ms)\n", total,
              kTimeoutMs);
}

TEST(Bootstrap, FailureReportWaitsInTheBacklogUntilTheRootServes) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  // Nobody serves yet: the report is sent, unanswered, within its 1 s bound.
  Report rep = report(id, 1, 2, 30000, "bad config");
  EXPECT_EQ(rep.r, KVXFER_ERR_TIMEOUT) << rep.err;
  EXPECT_GE(rep.ms, kBootstrapFailGraceMs - 50);
  EXPECT_LT(rep.ms, kBootstrapFailGraceMs + 1500);
  // The root reads it from the backlog when it starts, and fails rank 0 at once.
  auto rootf = start_root(root.get(), 2, 30000);
  Outcome o0 = run_rank(id, 0, 2, 30000, blob_for(0));
  EXPECT_EQ(o0.r, KVXFER_ERR_SYSTEM) << o0.err;
  EXPECT_NE(o0.err.find("rank 1 failed: bad config"), std::string::npos) << o0.err;
  EXPECT_LT(o0.ms, 5000);
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_ERR_SYSTEM) << ro.err;
  EXPECT_LT(ro.ms, 5000);
}

TEST(Bootstrap, RootsOwnRankFailingFailsTheOthersFast) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto r1 = start_rank(id, 1, 3, 30000);
  auto r2 = start_rank(id, 2, 3, 30000);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto t0 = Clock::now();
  EXPECT_EQ(root->fail_all(3, 0, "cannot open the NIC", 30000), KVXFER_SUCCESS) << last_error();
  EXPECT_LT(ms_since(t0), 2000);  // returns once both others are told
  EXPECT_EQ(root->failed_rank(), 0);
  for (auto* f : {&r1, &r2}) {
    Outcome o = f->get();
    EXPECT_EQ(o.r, KVXFER_ERR_SYSTEM) << o.err;
    EXPECT_NE(o.err.find("rank 0 failed: cannot open the NIC"), std::string::npos) << o.err;
    EXPECT_LT(o.ms, 5000);
  }
  // One-shot: the listener is gone.
  EXPECT_EQ(root->fail_all(3, 0, "again", 100), KVXFER_ERR_INVALID_USAGE);
  EXPECT_EQ(root->accept_all(3, 100), KVXFER_ERR_INVALID_USAGE);
}

TEST(Bootstrap, FailAllGivesUpAfterTheGraceWhenRanksStayAway) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto t0 = Clock::now();
  EXPECT_EQ(root->fail_all(3, 0, "gone", 30000), KVXFER_ERR_TIMEOUT);
  const long ms = ms_since(t0);
  EXPECT_NE(std::string(last_error()).find("not told: 1, 2"), std::string::npos) << last_error();
  EXPECT_GE(ms, kBootstrapFailGraceMs - 50);
  EXPECT_LT(ms, kBootstrapFailGraceMs + 1500);
  // Bounded by its timeout too.
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  t0 = Clock::now();
  EXPECT_EQ(root->fail_all(2, 1, "gone", 100), KVXFER_ERR_TIMEOUT);
  EXPECT_LT(ms_since(t0), 1000);
  EXPECT_EQ(root->fail_all(2, 2, "x", 100), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(root->fail_all(2, 0, nullptr, 100), KVXFER_ERR_INVALID_ARGUMENT);
}

TEST(Bootstrap, FailureReportWithAWrongSecretAbortsNothing) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_root(root.get(), 2, 10000);
  auto r0 = start_rank(id, 0, 2, 10000);
  UniqueId bad = id;
  bad.secret[7] ^= 0x80;
  Report rep = report(bad, 1, 2, 10000, "forged");
  EXPECT_EQ(rep.r, KVXFER_ERR_SYSTEM) << rep.err;
  EXPECT_NE(rep.err.find("bootstrap refused by root"), std::string::npos) << rep.err;
  // Nor does one for a rank beyond the root's nranks.
  Report beyond = report(id, 2, 3, 10000, "wrong size");
  EXPECT_EQ(beyond.r, KVXFER_ERR_SYSTEM) << beyond.err;
  EXPECT_NE(beyond.err.find("bootstrap refused by root"), std::string::npos) << beyond.err;
  // The legitimate rank 1 completes the table.
  auto r1 = start_rank(id, 1, 2, 10000);
  expect_full_table(r0.get(), 2);
  expect_full_table(r1.get(), 2);
  EXPECT_EQ(rootf.get().r, KVXFER_SUCCESS);
  EXPECT_EQ(root->failed_rank(), -1);
}

TEST(Bootstrap, FailureReportInvalidArguments) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(bootstrap_report_failure(id, 0, 2, 100, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bootstrap_report_failure(id, 2, 2, 100, "x"), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bootstrap_report_failure(id, 0, 0, 100, "x"), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bootstrap_report_failure(id, 0, 2, 0, "x"), KVXFER_ERR_INVALID_ARGUMENT);
  UniqueId bad = id;
  bad.magic ^= 1;
  EXPECT_EQ(bootstrap_report_failure(bad, 0, 2, 100, "x"), KVXFER_ERR_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// The final status round (accept_all with final_round, BootstrapSession).
// ---------------------------------------------------------------------------
struct Joined {
  kvxfer_result_t r = KVXFER_ERR_INTERNAL;
  std::string err;
  AddressTable table;
  std::unique_ptr<BootstrapSession> session;
};
std::future<Joined> start_session_rank(const UniqueId& id, int rank, int nranks, int timeout_ms) {
  return std::async(std::launch::async, [=] {
    Joined j;
    const std::vector<uint8_t> p = blob_for(rank);
    j.r = bootstrap_connect(id, rank, nranks, timeout_ms, p.data(), p.size(), &j.table, &j.session);
    j.err = last_error();
    return j;
  });
}
std::future<Outcome> start_final_root(BootstrapRoot* root, int nranks, int timeout_ms) {
  return std::async(std::launch::async, [=] {
    Outcome o;
    auto t0 = Clock::now();
    o.r = root->accept_all(nranks, timeout_ms, /*final_round=*/true);
    o.ms = ms_since(t0);
    o.err = last_error();
    return o;
  });
}
/** Polls until the root's verdict or `ms`; KVXFER_ERR_INTERNAL when none came. */
kvxfer_result_t await_verdict(BootstrapSession* s, int ms, std::string* err, long* took = nullptr) {
  const auto t0 = Clock::now();
  while (ms_since(t0) < ms) {
    bool ready = false;
    const kvxfer_result_t r = s->poll(&ready);
    if (r != KVXFER_SUCCESS || ready) {
      *err = r != KVXFER_SUCCESS ? last_error() : "";
      if (took != nullptr) *took = ms_since(t0);
      return r;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  *err = "no verdict";
  return KVXFER_ERR_INTERNAL;
}
std::vector<Joined> join_all(const UniqueId& id, int nranks, int timeout_ms) {
  std::vector<std::future<Joined>> f;
  for (int r = 0; r < nranks; ++r) f.push_back(start_session_rank(id, r, nranks, timeout_ms));
  std::vector<Joined> out;
  for (auto& x : f) out.push_back(x.get());
  return out;
}

TEST(Bootstrap, FinalRoundEveryRankReady) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_final_root(root.get(), 3, 10000);
  std::vector<Joined> j = join_all(id, 3, 10000);
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(j[r].r, KVXFER_SUCCESS) << j[r].err;
    ASSERT_EQ(j[r].table.size(), 3u);
    EXPECT_EQ(j[r].table[2], blob_for(2));
  }
  std::string err;
  bool ready = true;
  EXPECT_EQ(j[0].session->poll(&ready), KVXFER_SUCCESS);
  EXPECT_FALSE(ready);  // nobody reported yet
  for (int r = 0; r < 3; ++r) ASSERT_EQ(j[r].session->report(nullptr), KVXFER_SUCCESS);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(await_verdict(j[r].session.get(), 5000, &err), 0) << err;
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_SUCCESS) << ro.err;
}

TEST(Bootstrap, FinalRoundRelaysAFailureAtOnce) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_final_root(root.get(), 3, 30000);
  std::vector<Joined> j = join_all(id, 3, 30000);
  for (int r = 0; r < 3; ++r) ASSERT_EQ(j[r].r, KVXFER_SUCCESS) << j[r].err;
  ASSERT_EQ(j[0].session->report(nullptr), KVXFER_SUCCESS);  // 0 is ready, 2 still busy
  ASSERT_EQ(j[1].session->report("handshake with rank 2 failed"), KVXFER_SUCCESS);
  for (int r : {0, 2}) {
    std::string err;
    long took = -1;
    EXPECT_EQ(await_verdict(j[r].session.get(), 5000, &err, &took), KVXFER_ERR_SYSTEM) << err;
    EXPECT_NE(err.find("rank 1 failed: handshake with rank 2 failed"), std::string::npos) << err;
    EXPECT_LT(took, 5000);
  }
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_ERR_SYSTEM) << ro.err;
  EXPECT_NE(ro.err.find("rank 1 failed: handshake with rank 2 failed"), std::string::npos)
      << ro.err;
  EXPECT_LT(ro.ms, 5000);
  EXPECT_EQ(root->failed_rank(), 1);
}

TEST(Bootstrap, FinalRoundARankAlreadyReadyMayStillFail) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_final_root(root.get(), 3, 30000);
  std::vector<Joined> j = join_all(id, 3, 30000);
  for (int r = 0; r < 3; ++r) ASSERT_EQ(j[r].r, KVXFER_SUCCESS) << j[r].err;
  ASSERT_EQ(j[0].session->report(nullptr), KVXFER_SUCCESS);
  ASSERT_EQ(j[1].session->report(nullptr), KVXFER_SUCCESS);
  ASSERT_EQ(j[0].session->report("the link to rank 2 died"), KVXFER_SUCCESS);
  for (int r : {1, 2}) {
    std::string err;
    EXPECT_EQ(await_verdict(j[r].session.get(), 5000, &err), KVXFER_ERR_SYSTEM) << err;
    EXPECT_NE(err.find("rank 0 failed: the link to rank 2 died"), std::string::npos) << err;
  }
  EXPECT_EQ(rootf.get().r, KVXFER_ERR_SYSTEM);
  EXPECT_EQ(root->failed_rank(), 0);
}

TEST(Bootstrap, FinalRoundTreatsAHangUpAsAFailure) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_final_root(root.get(), 2, 30000);
  std::vector<Joined> j = join_all(id, 2, 30000);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(j[r].r, KVXFER_SUCCESS) << j[r].err;
  j[1].session.reset();  // rank 1 crashed or gave up
  std::string err;
  EXPECT_EQ(await_verdict(j[0].session.get(), 5000, &err), KVXFER_ERR_SYSTEM) << err;
  EXPECT_NE(err.find("rank 1 failed: its bootstrap connection ended before it was ready"),
            std::string::npos)
      << err;
  EXPECT_EQ(rootf.get().r, KVXFER_ERR_SYSTEM);
}

TEST(Bootstrap, FinalRoundTimesOutAndSaysSo) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto rootf = start_final_root(root.get(), 2, 500);
  std::vector<Joined> j = join_all(id, 2, 10000);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(j[r].r, KVXFER_SUCCESS) << j[r].err;
  ASSERT_EQ(j[0].session->report(nullptr), KVXFER_SUCCESS);  // rank 1 never reports
  std::string err;
  EXPECT_EQ(await_verdict(j[0].session.get(), 5000, &err), KVXFER_ERR_TIMEOUT) << err;
  Outcome ro = rootf.get();
  EXPECT_EQ(ro.r, KVXFER_ERR_TIMEOUT) << ro.err;
  EXPECT_NE(ro.err.find("not ready: 1"), std::string::npos) << ro.err;
}

/** Local addresses (hex, as in /proc/net/tcp{,6}) of sockets listening on `port`. */
std::vector<std::string> listeners_on_port(uint16_t port) {
  std::vector<std::string> out;
  char want[8];
  std::snprintf(want, sizeof want, ":%04X", port);
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      char local[64], remote[64], state[8];
      if (std::sscanf(line.c_str(), "%*s %63s %63s %7s", local, remote, state) != 3) continue;
      std::string l(local);
      if (std::string(state) == "0A" && l.size() > 5 && l.compare(l.size() - 5, 5, want) == 0)
        out.push_back(l.substr(0, l.size() - 5));
    }
  }
  return out;
}

TEST(Bootstrap, ListensOnLoopbackOnly) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id(nullptr, &id, &root), KVXFER_SUCCESS) << last_error();
  ASSERT_EQ(id.family, AF_INET);
  in_addr a;
  std::memcpy(&a, id.addr, 4);
  EXPECT_EQ(ntohl(a.s_addr), INADDR_LOOPBACK);
  EXPECT_EQ(unique_id_address(id).rfind("127.0.0.1:", 0), 0u) << unique_id_address(id);
  auto ls = listeners_on_port(ntohs(id.port));
  ASSERT_EQ(ls.size(), 1u);
  EXPECT_EQ(ls[0], "0100007F");  // 127.0.0.1 as /proc prints it

  // A wildcard bind is refused outright (nothing is opened).
  UniqueId w;
  std::unique_ptr<BootstrapRoot> wr;
  EXPECT_EQ(create_unique_id("0.0.0.0", &w, &wr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(create_unique_id("::", &w, &wr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(wr, nullptr);

  // IPv6 loopback, where the host has it.
  UniqueId v6;
  std::unique_ptr<BootstrapRoot> r6;
  if (create_unique_id("::1", &v6, &r6) == KVXFER_SUCCESS) {
    ASSERT_EQ(v6.family, AF_INET6);
    in6_addr a6;
    std::memcpy(&a6, v6.addr, 16);
    EXPECT_TRUE(IN6_IS_ADDR_LOOPBACK(&a6));
    auto rootf = start_root(r6.get(), 1, 10000);
    expect_full_table(run_rank(v6, 0, 1, 10000, blob_for(0)), 1);
    EXPECT_EQ(rootf.get().r, KVXFER_SUCCESS);
  }
}

TEST(Bootstrap, InvalidArguments) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  EXPECT_EQ(create_unique_id("127.0.0.1", nullptr, &root), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(create_unique_id("127.0.0.1", &id, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(create_unique_id("not a host name..invalid", &id, &root), KVXFER_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  AddressTable t;
  uint8_t p[4] = {1, 2, 3, 4};
  EXPECT_EQ(bootstrap_connect(id, 0, 1, 100, p, 4, nullptr), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bootstrap_connect(id, 1, 1, 100, p, 4, &t), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bootstrap_connect(id, -1, 2, 100, p, 4, &t), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bootstrap_connect(id, 0, 0, 100, p, 4, &t), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bootstrap_connect(id, 0, 1, 0, p, 4, &t), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bootstrap_connect(id, 0, 1, 100, nullptr, 4, &t), KVXFER_ERR_INVALID_ARGUMENT);
  std::vector<uint8_t> big(kBootstrapMaxPayload + 1);
  EXPECT_EQ(bootstrap_connect(id, 0, 1, 100, big.data(), big.size(), &t),
            KVXFER_ERR_INVALID_ARGUMENT);
  UniqueId bad = id;
  bad.magic ^= 1;
  EXPECT_EQ(bootstrap_connect(bad, 0, 1, 100, p, 4, &t), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(root->accept_all(0, 100), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(root->accept_all(1, 0), KVXFER_ERR_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace kvxfer::transport
