// Communicator (transport/comm.h): N ranks joined through the bootstrap, one
// Link per peer.  Loopback only (127.0.0.1); every wait is bounded, so a hang
// fails the test instead of blocking it.
#include "transport/comm.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "fork_child.h"

namespace kvxfer::transport {
namespace {

using std::chrono::milliseconds;
constexpr TrafficClass kA = TrafficClass::kAnchor;
constexpr TrafficClass kR = TrafficClass::kResidual;
constexpr int kCreateTimeoutMs = 20000;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
std::vector<uint8_t> pattern(uint64_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t w = 0; w < n; w += 8) {
    const uint64_t x = splitmix64(seed * 0x100000001B3ull + (w >> 3));
    for (size_t j = 0; j < 8 && w + j < n; ++j) v[w + j] = static_cast<uint8_t>(x >> (8 * j));
  }
  return v;
}
/** "" when equal, else where the first difference is. */
std::string compare(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size())
    return "size " + std::to_string(got.size()) + " != " + std::to_string(want.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) return "first difference at byte " + std::to_string(i);
  return "";
}

LinkConfig loopback_config() {
  LinkConfig cfg;
  const char* p = std::getenv("KVXFER_TEST_OFI_PROVIDER");
  cfg.provider = p != nullptr ? p : "";
  cfg.node = "127.0.0.1";
  cfg.timeout_ms = 15000;
  return cfg;
}

long ms_since(Clock::time_point t0) {
  return static_cast<long>(std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count());
}

struct Created {
  kvxfer_result_t r = KVXFER_ERR_INTERNAL;
  std::string err;
  long ms = 0;
  std::unique_ptr<Communicator> comm;
};
Created create_rank(const UniqueId& id, BootstrapRoot* root, int rank, int nranks, int timeout_ms) {
  Created c;
  const auto t0 = Clock::now();
  c.r = Communicator::create(id, root, rank, nranks, loopback_config(), timeout_ms, &c.comm);
  c.ms = ms_since(t0);
  c.err = last_error();
  return c;
}

/** Drives `comm` until every op in `ops` (peer, op id) finished or `seconds`
 *  pass; returns the completions found, or "" on timeout via *err. */
bool drive(Communicator* comm, const std::vector<std::pair<int, uint64_t>>& ops, double seconds,
           std::vector<Completion>* got, std::string* err) {
  const auto end = Clock::now() + milliseconds(static_cast<int64_t>(seconds * 1000));
  std::vector<std::vector<Completion>> done(static_cast<size_t>(comm->nranks()));
  for (;;) {
    size_t found = 0;
    for (const auto& [peer, op] : ops)
      for (const Completion& c : done[peer])
        if (c.op_id == op) ++found;
    if (found == ops.size()) break;
    if (Clock::now() > end) {
      *err = "timed out with " + std::to_string(ops.size() - found) + " ops unfinished";
      return false;
    }
    for (int p = 0; p < comm->nranks(); ++p)
      if (Link* l = comm->link(p)) l->poll(&done[p]);
  }
  got->clear();
  for (const auto& [peer, op] : ops)
    for (const Completion& c : done[peer])
      if (c.op_id == op) got->push_back(c);
  for (const Completion& c : *got)
    if (c.status != KVXFER_SUCCESS) {
      *err = "op " + std::to_string(c.op_id) + " failed: " + c.error;
      return false;
    }
  return true;
}

/** Keeps driving every link until `flag` is set or `seconds` pass. */
void drive_until(Communicator* comm, const std::atomic<bool>& flag, double seconds) {
  const auto end = Clock::now() + milliseconds(static_cast<int64_t>(seconds * 1000));
  while (!flag.load() && Clock::now() < end) {
    comm->progress();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// ---------------------------------------------------------------------------
// A forked child, bounded (killed and reaped by the destructor if running).
// ---------------------------------------------------------------------------
bool write_byte(int fd, char c) {
  for (;;) {
    const ssize_t w = write(fd, &c, 1);
    if (w < 0 && errno == EINTR) continue;
    return w == 1;
  }
}
using test::Child;  // tests/fork_child.h
using test::readable;

constexpr size_t kAnchorBytes = size_t{1} << 20;
constexpr size_t kResidualBytes = size_t{4} << 20;

/** Posts receives of one anchor and one residual message from `peer`. */
bool recv_pair(Communicator* comm, int peer, uint64_t seed, std::string* err) {
  std::vector<uint8_t> a(kAnchorBytes), r(kResidualBytes);
  uint64_t oa = 0, orr = 0;
  Link* l = comm->link(peer);
  if (l->post_recv(kA, a.data(), a.size(), 1, &oa) != KVXFER_SUCCESS ||
      l->post_recv(kR, r.data(), r.size(), 2, &orr) != KVXFER_SUCCESS) {
    *err = std::string("post_recv: ") + last_error();
    return false;
  }
  std::vector<Completion> got;
  if (!drive(comm, {{peer, oa}, {peer, orr}}, 60, &got, err)) return false;
  std::string d = compare(a, pattern(seed, kAnchorBytes));
  if (d.empty()) d = compare(r, pattern(seed + 1, kResidualBytes));
  for (const Completion& c : got)
    if (c.bytes != (c.cls == kA ? kAnchorBytes : kResidualBytes))
      d = "completion reports " + std::to_string(c.bytes) + " bytes";
  if (!d.empty()) *err = d;
  return d.empty();
}
bool send_pair(Communicator* comm, int peer, uint64_t seed, std::string* err) {
  const std::vector<uint8_t> a = pattern(seed, kAnchorBytes), r = pattern(seed + 1, kResidualBytes);
  uint64_t oa = 0, orr = 0;
  Link* l = comm->link(peer);
  if (l->post_send(kA, a.data(), a.size(), 1, &oa) != KVXFER_SUCCESS ||
      l->post_send(kR, r.data(), r.size(), 2, &orr) != KVXFER_SUCCESS) {
    *err = std::string("post_send: ") + last_error();
    return false;
  }
  std::vector<Completion> got;
  return drive(comm, {{peer, oa}, {peer, orr}}, 60, &got, err);
}

// ---------------------------------------------------------------------------
TEST(Comm, PayloadRoundTripAndCorruption) {
  std::vector<std::vector<uint8_t>> addrs = {{1, 2, 3}, {}, {9, 8, 7, 6, 5}};
  const std::vector<uint8_t> p = encode_comm_payload(1, addrs);
  std::vector<std::vector<uint8_t>> back;
  ASSERT_EQ(decode_comm_payload(p, 1, 3, &back), KVXFER_SUCCESS) << last_error();
  EXPECT_EQ(back, addrs);
  EXPECT_EQ(decode_comm_payload(p, 2, 3, &back), KVXFER_ERR_CORRUPT);  // wrong rank
  EXPECT_EQ(decode_comm_payload(p, 1, 4, &back), KVXFER_ERR_CORRUPT);  // wrong nranks
  std::vector<uint8_t> cut(p.begin(), p.end() - 1);
  EXPECT_EQ(decode_comm_payload(cut, 1, 3, &back), KVXFER_ERR_CORRUPT);
  std::vector<uint8_t> bad = p;
  bad[0] ^= 1;
  EXPECT_EQ(decode_comm_payload(bad, 1, 3, &back), KVXFER_ERR_CORRUPT);
  std::vector<uint8_t> longer = p;
  longer.push_back(0);
  EXPECT_EQ(decode_comm_payload(longer, 1, 3, &back), KVXFER_ERR_CORRUPT);
}

TEST(Comm, RejectsBadArguments) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  std::unique_ptr<Communicator> c;
  const LinkConfig cfg = loopback_config();
  EXPECT_EQ(Communicator::create(id, root.get(), 0, 1, cfg, 1000, &c), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(Communicator::create(id, root.get(), 2, 2, cfg, 1000, &c), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(Communicator::create(id, root.get(), 1, 2, cfg, 1000, &c), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(Communicator::create(id, nullptr, 0, 2, cfg, 1000, &c), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(Communicator::create(id, root.get(), 0, 2, cfg, 0, &c), KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(Communicator::create(id, root.get(), 0, 2, cfg, 1000, nullptr),
            KVXFER_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(c, nullptr);
}

TEST(Comm, TwoProcessesExchangeBothClassesBothWays) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();

  Child child;  // rank 1; forked before any libfabric state exists in this process
  ASSERT_TRUE(child.start([id](int from_parent, int /*to_parent*/) {
    Created c = create_rank(id, nullptr, 1, 2, kCreateTimeoutMs);
    if (c.r != KVXFER_SUCCESS) {
      std::fprintf(stderr, "child create: %s\n", c.err.c_str());
      return 10;
    }
    std::string err;
    if (!recv_pair(c.comm.get(), 0, 100, &err)) {
      std::fprintf(stderr, "child recv: %s\n", err.c_str());
      return 11;
    }
    if (!send_pair(c.comm.get(), 0, 200, &err)) {
      std::fprintf(stderr, "child send: %s\n", err.c_str());
      return 12;
    }
    // Keep the links alive until the parent has everything.
    const auto end = Clock::now() + std::chrono::seconds(60);
    while (!readable(from_parent) && Clock::now() < end) c.comm->progress();
    return readable(from_parent) ? 0 : 13;
  }));

  Created c = create_rank(id, root.get(), 0, 2, kCreateTimeoutMs);
  ASSERT_EQ(c.r, KVXFER_SUCCESS) << c.err;
  ASSERT_EQ(c.comm->rank(), 0);
  ASSERT_EQ(c.comm->nranks(), 2);
  EXPECT_EQ(c.comm->link(0), nullptr);
  EXPECT_EQ(c.comm->link(2), nullptr);
  ASSERT_NE(c.comm->link(1), nullptr);
  EXPECT_TRUE(c.comm->link(1)->ready());
  std::string err;
  EXPECT_TRUE(send_pair(c.comm.get(), 1, 100, &err)) << err;
  EXPECT_TRUE(recv_pair(c.comm.get(), 1, 200, &err)) << err;
  write_byte(child.to_child, 'x');
  ASSERT_TRUE(child.wait(60)) << "child hung";
  ASSERT_TRUE(WIFEXITED(child.status)) << "child status " << child.status;
  EXPECT_EQ(WEXITSTATUS(child.status), 0) << "child failed (see its stderr)";
}

TEST(Comm, ThreeRanksEveryPairExchanges) {
  constexpr int kN = 3;
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  std::atomic<int> finished{0};
  auto rank_main = [&](int rank) -> std::string {
    Created c = create_rank(id, rank == 0 ? root.get() : nullptr, rank, kN, kCreateTimeoutMs);
    if (c.r != KVXFER_SUCCESS) {
      finished.fetch_add(1);
      return "create: " + c.err;
    }
    constexpr size_t kBytes = 300 * 1024 + 7;
    std::vector<std::vector<uint8_t>> in(kN), out(kN);
    std::vector<std::pair<int, uint64_t>> ops;
    std::string err;
    for (int p = 0; p < kN; ++p) {
      if (p == rank) continue;
      in[p].resize(kBytes);
      out[p] = pattern(uint64_t(rank) * 10 + p, kBytes);
      uint64_t op = 0;
      const TrafficClass cls = (rank + p) % 2 == 0 ? kA : kR;
      if (c.comm->link(p)->post_recv(cls, in[p].data(), kBytes, 5, &op) != KVXFER_SUCCESS)
        err = std::string("post_recv: ") + last_error();
      ops.emplace_back(p, op);
      if (c.comm->link(p)->post_send(cls, out[p].data(), kBytes, 5, &op) != KVXFER_SUCCESS)
        err = std::string("post_send: ") + last_error();
      ops.emplace_back(p, op);
    }
    std::vector<Completion> got;
    if (err.empty() && drive(c.comm.get(), ops, 60, &got, &err)) {
      for (int p = 0; p < kN && err.empty(); ++p)
        if (p != rank) {
          const std::string d = compare(in[p], pattern(uint64_t(p) * 10 + rank, kBytes));
          if (!d.empty()) err = "from rank " + std::to_string(p) + ": " + d;
        }
    }
    // Barrier: keep driving until every rank is done, then tear down.
    finished.fetch_add(1);
    const auto end = Clock::now() + std::chrono::seconds(60);
    while (finished.load() < kN && Clock::now() < end) c.comm->progress();
    return err;
  };
  std::vector<std::future<std::string>> f;
  for (int r = 0; r < kN; ++r) f.push_back(std::async(std::launch::async, rank_main, r));
  for (int r = 0; r < kN; ++r) {
    ASSERT_EQ(f[r].wait_for(std::chrono::seconds(120)), std::future_status::ready) << "hang";
    EXPECT_EQ(f[r].get(), "") << "rank " << r;
  }
}

TEST(Comm, TamperedSecretFailsWhileOthersTimeOut) {
  constexpr int kN = 3;
  constexpr int kTimeoutMs = 1500;
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  UniqueId bad = id;
  bad.secret[3] ^= 0x40;
  auto r0 = std::async(std::launch::async, create_rank, id, root.get(), 0, kN, kTimeoutMs);
  auto r1 = std::async(std::launch::async, create_rank, id, nullptr, 1, kN, kTimeoutMs);
  auto r2 = std::async(std::launch::async, create_rank, bad, nullptr, 2, kN, kTimeoutMs);
  for (auto* f : {&r0, &r1, &r2})
    ASSERT_EQ(f->wait_for(std::chrono::seconds(15)), std::future_status::ready) << "hang";
  Created b = r2.get();
  EXPECT_EQ(b.r, KVXFER_ERR_SYSTEM) << b.err;
  EXPECT_NE(b.err.find("wrong secret"), std::string::npos) << b.err;
  EXPECT_NE(b.err.find("comm rank 2/3"), std::string::npos) << b.err;
  EXPECT_EQ(b.comm, nullptr);
  Created o0 = r0.get(), o1 = r1.get();
  for (Created* op : {&o0, &o1}) {
    const Created& o = *op;
    EXPECT_EQ(o.r, KVXFER_ERR_TIMEOUT) << o.err;
    EXPECT_EQ(o.comm, nullptr);
    EXPECT_LT(o.ms, 3 * kTimeoutMs + 2000) << o.err;
  }
}

// Fail fast (bootstrap.h): a rank that fails before the bootstrap tells the
// root, and the others fail within about a second with its reason, not at
// their 30 s deadline.  The failure: a libfabric provider that does not exist.
constexpr int kFailFastTimeoutMs = 30000;
constexpr const char* kNoProvider = "no-such-provider";

bool read_all_fd(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

TEST(Comm, RankFailingToOpenItsLinkFailsTheOthersFast) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  Child child;  // rank 1: its provider does not exist
  ASSERT_TRUE(child.start([id](int, int) {
    LinkConfig cfg = loopback_config();
    cfg.provider = kNoProvider;
    std::unique_ptr<Communicator> c;
    const kvxfer_result_t r = Communicator::create(id, nullptr, 1, 2, cfg, kFailFastTimeoutMs, &c);
    const std::string err = last_error();
    if (r == KVXFER_SUCCESS || err.find("comm rank 1/2: opening the link to rank 0") != 0) {
      std::fprintf(stderr, "child: unexpected result %d: %s\n", r, err.c_str());
      return 1;
    }
    return 0;
  }));
  Created c = create_rank(id, root.get(), 0, 2, kFailFastTimeoutMs);
  EXPECT_EQ(c.r, KVXFER_ERR_SYSTEM) << c.err;
  EXPECT_EQ(c.comm, nullptr);
  EXPECT_NE(c.err.find("comm rank 0/2: bootstrap failed"), std::string::npos) << c.err;
  EXPECT_NE(c.err.find("rank 1 failed: comm rank 1/2: opening the link to rank 0"),
            std::string::npos)
      << c.err;
  EXPECT_NE(c.err.find(kNoProvider), std::string::npos) << c.err;
  EXPECT_LT(c.ms, 5000) << "rank 0 waited for its timeout instead of failing fast";
  std::printf(
      "[ fail fast ] rank 0 failed after %.3f s (rank 1 could not open its link; "
      "timeout %d s)\n",
      c.ms / 1000.0, kFailFastTimeoutMs / 1000);
  ASSERT_TRUE(child.wait(30)) << "child hung";
  ASSERT_TRUE(WIFEXITED(child.status)) << "child status " << child.status;
  EXPECT_EQ(WEXITSTATUS(child.status), 0) << "child failed (see its stderr)";
}

TEST(Comm, RootRankFailingToOpenItsLinkFailsTheOthersFast) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  Child child;  // rank 1, healthy: reports how long its create took
  ASSERT_TRUE(child.start([id](int, int to_parent) {
    if (!write_byte(to_parent, 's')) return 2;
    Created c = create_rank(id, nullptr, 1, 2, kFailFastTimeoutMs);
    const int32_t ms = static_cast<int32_t>(c.ms);
    if (write(to_parent, &ms, sizeof ms) != sizeof ms) return 3;
    if (c.r != KVXFER_ERR_SYSTEM ||
        c.err.find("rank 0 failed: comm rank 0/2: opening the link to "
                   "rank 1") == std::string::npos ||
        c.err.find(kNoProvider) == std::string::npos) {
      std::fprintf(stderr, "child: unexpected result %d: %s\n", c.r, c.err.c_str());
      return 1;
    }
    return 0;
  }));
  char started = 0;
  ASSERT_TRUE(read_all_fd(child.from_child, &started, 1));
  LinkConfig cfg = loopback_config();
  cfg.provider = kNoProvider;
  std::unique_ptr<Communicator> comm;
  const auto t0 = Clock::now();
  EXPECT_EQ(Communicator::create(id, root.get(), 0, 2, cfg, kFailFastTimeoutMs, &comm),
            KVXFER_ERR_SYSTEM);
  const long ms0 = ms_since(t0);
  const std::string err0 = last_error();
  EXPECT_EQ(err0.find("comm rank 0/2: opening the link to rank 1"), 0u) << err0;
  EXPECT_LT(ms0, 5000) << err0;
  int32_t ms1 = -1;
  ASSERT_TRUE(read_all_fd(child.from_child, &ms1, sizeof ms1)) << "child sent no time";
  EXPECT_GE(ms1, 0);
  EXPECT_LT(ms1, 5000) << "rank 1 waited for its timeout instead of failing fast";
  std::printf(
      "[ fail fast ] rank 1 failed after %.3f s (rank 0, the root's, could not open its "
      "link; timeout %d s); rank 0 returned after %.3f s\n",
      ms1 / 1000.0, kFailFastTimeoutMs / 1000, ms0 / 1000.0);
  ASSERT_TRUE(child.wait(30)) << "child hung";
  ASSERT_TRUE(WIFEXITED(child.status)) << "child status " << child.status;
  EXPECT_EQ(WEXITSTATUS(child.status), 0) << "child failed (see its stderr)";
}

// Fail fast after the table (steps 3 and 4): the bootstrap connections stay
// open for a final status round, so a rank that fails to connect, or whose
// process ends, fails the others at once.  Rank 1 here is a stand-in that
// joins the bootstrap directly with a real Link's address and then fails.
enum class Rank1Ends { kReportsFailure, kHangsUp };
void rank1_fails_after_the_table(Rank1Ends how) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto r0 = std::async(std::launch::async, create_rank, id, root.get(), 0, 2, kFailFastTimeoutMs);
  std::unique_ptr<Link> link;  // never connected: rank 0's handshake waits on it
  ASSERT_EQ(Link::create(loopback_config(), &link), KVXFER_SUCCESS) << last_error();
  const std::vector<uint8_t> payload = encode_comm_payload(1, {link->local_address(), {}});
  AddressTable table;
  std::unique_ptr<BootstrapSession> session;
  ASSERT_EQ(bootstrap_connect(id, 1, 2, kFailFastTimeoutMs, payload.data(), payload.size(), &table,
                              &session),
            KVXFER_SUCCESS)
      << last_error();
  std::this_thread::sleep_for(milliseconds(100));  // rank 0 is in step 4 now
  const auto t0 = Clock::now();
  if (how == Rank1Ends::kReportsFailure)
    ASSERT_EQ(session->report("cannot reach rank 0 (test)"), KVXFER_SUCCESS) << last_error();
  else
    session.reset();
  ASSERT_EQ(r0.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "hang";
  const long ms = ms_since(t0);
  Created c = r0.get();
  EXPECT_EQ(c.r, KVXFER_ERR_SYSTEM) << c.err;
  EXPECT_EQ(c.comm, nullptr);
  EXPECT_NE(c.err.find(how == Rank1Ends::kReportsFailure
                           ? "rank 1 failed: cannot reach rank 0 (test)"
                           : "rank 1 failed: its bootstrap connection ended before it was ready"),
            std::string::npos)
      << c.err;
  EXPECT_LT(ms, 5000) << c.err;
  std::printf("[ fail fast ] rank 0 failed %.3f s after rank 1 %s in step 4 (timeout %d s)\n",
              ms / 1000.0, how == Rank1Ends::kReportsFailure ? "reported a failure" : "hung up",
              kFailFastTimeoutMs / 1000);
}

TEST(Comm, RankFailingAfterTheTableFailsTheOthersFast) {
  rank1_fails_after_the_table(Rank1Ends::kReportsFailure);
}

TEST(Comm, RankHangingUpAfterTheTableFailsTheOthersFast) {
  rank1_fails_after_the_table(Rank1Ends::kHangsUp);
}

// Rank 0 (the root's) failing in step 3 fails the others as fast: here rank 1
// (a stand-in) gives it an address it cannot connect to.
TEST(Comm, RootRankFailingToConnectFailsTheOthersFast) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  auto r0 = std::async(std::launch::async, create_rank, id, root.get(), 0, 2, kFailFastTimeoutMs);
  const std::vector<uint8_t> payload = encode_comm_payload(1, {{'n', 'o', 'p', 'e'}, {}});
  AddressTable table;
  std::unique_ptr<BootstrapSession> session;
  const auto t0 = Clock::now();
  ASSERT_EQ(bootstrap_connect(id, 1, 2, kFailFastTimeoutMs, payload.data(), payload.size(), &table,
                              &session),
            KVXFER_SUCCESS)
      << last_error();
  kvxfer_result_t v = KVXFER_SUCCESS;
  bool ready = false;
  while (v == KVXFER_SUCCESS && !ready && ms_since(t0) < 20000) {
    v = session->poll(&ready);
    std::this_thread::sleep_for(milliseconds(1));
  }
  const long ms = ms_since(t0);
  const std::string err = last_error();
  EXPECT_EQ(v, KVXFER_ERR_SYSTEM) << err;
  EXPECT_NE(err.find("rank 0 failed: comm rank 0/2: connecting to rank 1"), std::string::npos)
      << err;
  EXPECT_LT(ms, 5000) << err;
  std::printf("[ fail fast ] rank 1 heard of rank 0's step-3 failure after %.3f s (timeout %d s)\n",
              ms / 1000.0, kFailFastTimeoutMs / 1000);
  ASSERT_EQ(r0.wait_for(std::chrono::seconds(20)), std::future_status::ready) << "hang";
  Created c = r0.get();
  EXPECT_EQ(c.r, KVXFER_ERR_SYSTEM) << c.err;
  EXPECT_EQ(c.err.find("comm rank 0/2: connecting to rank 1"), 0u) << c.err;
}

TEST(Comm, AbortEndsPostedReceiveWithAnError) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  std::atomic<bool> rank1_done{false};
  auto rank0 = std::async(std::launch::async, [&]() -> std::string {
    Created c = create_rank(id, root.get(), 0, 2, kCreateTimeoutMs);
    if (c.r != KVXFER_SUCCESS) return "create: " + c.err;
    drive_until(c.comm.get(), rank1_done, 60);  // its link fails when rank 1 aborts
    return "";
  });
  {
    Created c = create_rank(id, nullptr, 1, 2, kCreateTimeoutMs);
    if (c.r == KVXFER_SUCCESS) {
      std::vector<uint8_t> buf(4096);
      uint64_t op = 0;
      Link* l = c.comm->link(0);
      EXPECT_EQ(l->post_recv(kA, buf.data(), buf.size(), 7, &op), KVXFER_SUCCESS) << last_error();
      std::vector<Completion> done;
      l->poll(&done);
      EXPECT_TRUE(done.empty());
      EXPECT_EQ(l->ops_in_flight(), 1u);
      c.comm->abort("test abort");
      EXPECT_TRUE(c.comm->aborted());
      const auto end = Clock::now() + std::chrono::seconds(10);
      while (done.empty() && Clock::now() < end) l->poll(&done);
      EXPECT_EQ(done.size(), 1u);
      if (!done.empty()) {
        EXPECT_EQ(done[0].op_id, op);
        EXPECT_NE(done[0].status, KVXFER_SUCCESS);
        EXPECT_NE(done[0].error.find("test abort"), std::string::npos) << done[0].error;
      }
      EXPECT_EQ(l->ops_in_flight(), 0u);
      uint64_t op2 = 0;
      EXPECT_NE(l->post_recv(kA, buf.data(), buf.size(), 8, &op2), KVXFER_SUCCESS);
      c.comm->abort("again");  // idempotent
    } else {
      ADD_FAILURE() << "create: " << c.err;
    }
    rank1_done = true;
  }
  ASSERT_EQ(rank0.wait_for(std::chrono::seconds(90)), std::future_status::ready) << "hang";
  EXPECT_EQ(rank0.get(), "");
}

TEST(Comm, DestroyIsSafeWithOpsInFlight) {
  UniqueId id;
  std::unique_ptr<BootstrapRoot> root;
  ASSERT_EQ(create_unique_id("127.0.0.1", &id, &root), KVXFER_SUCCESS) << last_error();
  std::atomic<bool> rank0_posted{false}, rank1_posted{false}, rank0_gone{false};
  auto rank0 = std::async(std::launch::async, [&]() -> std::string {
    Created c = create_rank(id, root.get(), 0, 2, kCreateTimeoutMs);
    if (c.r != KVXFER_SUCCESS) {
      rank0_gone = true;
      return "create: " + c.err;
    }
    // Sends nobody receives (rank 1 posts other tags): still in flight below.
    std::vector<uint8_t> big = pattern(7, kResidualBytes), small = pattern(8, 1000);
    uint64_t op = 0;
    std::string err;
    if (c.comm->link(1)->post_send(kR, big.data(), big.size(), 99, &op) != KVXFER_SUCCESS ||
        c.comm->link(1)->post_send(kA, small.data(), small.size(), 98, &op) != KVXFER_SUCCESS)
      err = std::string("post_send: ") + last_error();
    rank0_posted = true;
    drive_until(c.comm.get(), rank1_posted, 60);
    const auto end = Clock::now() + milliseconds(100);
    while (Clock::now() < end) c.comm->progress();
    c.comm.reset();  // destructor with ops in flight
    rank0_gone = true;
    return err;
  });
  Created c = create_rank(id, nullptr, 1, 2, kCreateTimeoutMs);
  ASSERT_EQ(c.r, KVXFER_SUCCESS) << c.err;
  std::vector<uint8_t> buf(kResidualBytes);
  uint64_t op = 0;
  ASSERT_EQ(c.comm->link(0)->post_recv(kR, buf.data(), buf.size(), 5, &op), KVXFER_SUCCESS)
      << last_error();
  drive_until(c.comm.get(), rank0_posted, 60);
  EXPECT_EQ(c.comm->link(0)->ops_in_flight(), 1u);
  rank1_posted = true;
  drive_until(c.comm.get(), rank0_gone, 60);  // the peer vanishes under a posted receive
  c.comm.reset();                             // destructor with an op in flight
  ASSERT_EQ(rank0.wait_for(std::chrono::seconds(90)), std::future_status::ready) << "hang";
  EXPECT_EQ(rank0.get(), "");
}

}  // namespace
}  // namespace kvxfer::transport
