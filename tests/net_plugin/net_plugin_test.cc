// Functional tests of the NCCL net plugin (libnccl-net-kvxfer.so), without a
// GPU: the plugin is dlopened and driven through ncclNetPlugin_v11 (and _v10)
// in two processes over 127.0.0.1, with host buffers, the way NCCL's proxy
// thread drives it.  Most cases load libnccl-net-kvxfer-test.so, the same code
// with the fault-injection and inspection hooks of net_plugin/test_hooks.h;
// the sweep and the export check use the shipped library itself.
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_tagged.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "fork_child.h"
#include "net_plugin/handle.h"
#include "net_plugin/net.h"
#include "plugin_harness.h"

namespace kvxfer::test {
namespace {

// Every process of this binary: loopback, and a short connect timeout.
const bool g_env = [] {
  setenv("KVXFER_NET_IF", "lo", 0);
  setenv("KVXFER_TIMEOUT_MS", "5000", 0);
  if (const char* p = std::getenv("KVXFER_TEST_OFI_PROVIDER")) setenv("KVXFER_OFI_PROVIDER", p, 1);
  return true;
}();

const Plugin& plug() {
  static const Plugin p = load_plugin(KVXFER_NET_PLUGIN_TEST_PATH);
  return p;
}
const Plugin& shipped() {
  static const Plugin p = load_plugin(KVXFER_NET_PLUGIN_PATH);
  return p;
}

ncclResult_t init_ctx(const Plugin& p, int traffic_class, void** ctx, uint64_t comm_id = 0x42) {
  ncclNetCommConfig_v11_t cfg;
  cfg.trafficClass = traffic_class;
  return p.v11->init(ctx, comm_id, &cfg, test_logger, nullptr);
}

using Handle = char[NCCL_NET_HANDLE_MAXSIZE];

#define CHILD_REQUIRE(cond)                                                                        \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      std::fprintf(stderr, "child %d: line %d: %s failed\n", static_cast<int>(getpid()), __LINE__, \
                   #cond);                                                                         \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

/** Parent side: init, listen, hand the handle to the child, accept. */
struct Receiver {
  const Plugin* p = nullptr;
  void* ctx = nullptr;
  void* lc = nullptr;
  void* rc = nullptr;
  ~Receiver() {
    if (rc != nullptr) p->v11->closeRecv(rc);
    if (lc != nullptr) p->v11->closeListen(lc);
    if (ctx != nullptr) p->v11->finalize(ctx);
  }
};
::testing::AssertionResult listen_accept(const Plugin& p, int tc, int to_child, Receiver* r) {
  r->p = &p;
  if (init_ctx(p, tc, &r->ctx) != ncclSuccess) return ::testing::AssertionFailure() << "init";
  Handle h;
  if (p.v11->listen(r->ctx, 0, h, &r->lc) != ncclSuccess)
    return ::testing::AssertionFailure() << "listen";
  if (!write_all(to_child, h, sizeof(h))) return ::testing::AssertionFailure() << "pipe";
  const ncclResult_t a = accept_until(p.v11, r->lc, &r->rc);
  if (a != ncclSuccess) return ::testing::AssertionFailure() << "accept returned " << a;
  return ::testing::AssertionSuccess();
}

/** Child side: init, read the handle, connect. */
bool child_connect(const Plugin& p, int tc, int from_parent, void** ctx, void** sc) {
  Handle h;
  if (init_ctx(p, tc, ctx) != ncclSuccess) return false;
  if (!read_all(from_parent, h, sizeof(h))) return false;
  return connect_until(p.v11, *ctx, 0, h, sc) == ncclSuccess;
}

std::string strprintf_test(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string strprintf_test(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

std::vector<size_t> sweep_sizes() {
  std::vector<size_t> s = {0};
  for (size_t v = 1; v <= (size_t{64} << 20); v *= 2) {
    s.push_back(v);
    if (v >= 4) {
      s.push_back(v - 1);
      s.push_back(v + 3);
    }
  }
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  while (s.back() > (size_t{64} << 20)) s.pop_back();
  return s;
}

// ---------------------------------------------------------------------------
// Sockets, for the DSCP checks
// ---------------------------------------------------------------------------
bool same_inet(const sockaddr_storage& a, const uint8_t* b, size_t blen) {
  const auto* sb = reinterpret_cast<const sockaddr*>(b);
  if (blen < sizeof(sockaddr_in) || a.ss_family != sb->sa_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = *reinterpret_cast<const sockaddr_in*>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6 && blen >= sizeof(sockaddr_in6)) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = *reinterpret_cast<const sockaddr_in6*>(b);
    return x.sin6_port == y.sin6_port && std::memcmp(&x.sin6_addr, &y.sin6_addr, 16) == 0;
  }
  return false;
}

struct SockInfo {
  bool connected = false;
  int tos = -1;
};
/** The sockets of this process whose local address is `local` or whose peer is `peer`. */
std::vector<SockInfo> sockets_of(const kvxfer_net_test_info_t& info) {
  std::vector<SockInfo> out;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return out;
  while (dirent* e = readdir(dir)) {
    const int fd = std::atoi(e->d_name);
    if (fd <= 2 || fd == dirfd(dir)) continue;
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage me{}, them{};
    socklen_t ml = sizeof(me), tl = sizeof(them);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&me), &ml) != 0) continue;
    if (me.ss_family != AF_INET && me.ss_family != AF_INET6) continue;
    const bool connected = getpeername(fd, reinterpret_cast<sockaddr*>(&them), &tl) == 0;
    const bool mine = same_inet(me, info.local, info.local_len) ||
                      (connected && info.peer_len > 0 && same_inet(them, info.peer, info.peer_len));
    if (!mine) continue;
    SockInfo s;
    s.connected = connected;
    int tos = 0;
    socklen_t len = sizeof(tos);
    if (me.ss_family == AF_INET)
      getsockopt(fd, IPPROTO_IP, IP_TOS, &tos, &len);
    else
      getsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tos, &len);
    s.tos = tos;
    out.push_back(s);
  }
  closedir(dir);
  return out;
}

/** "" if every socket of the comm carries `dscp` (and one is connected), else why not. */
std::string check_dscp(const Plugin& p, void* comm, int dscp, uint32_t tclass) {
  kvxfer_net_test_info_t info;
  if (p.comm_info(comm, &info) != 0) return "not a live comm";
  if (info.tclass != tclass)
    return "tclass " + std::to_string(info.tclass) + ", want " + std::to_string(tclass);
  if (info.dscp != dscp) return "comm dscp " + std::to_string(info.dscp);
  const std::vector<SockInfo> socks = sockets_of(info);
  int connected = 0;
  for (const SockInfo& s : socks) {
    if (s.connected) ++connected;
    const int want = dscp < 0 ? 0 : dscp;
    if ((s.tos >> 2) != want)
      return "a socket has TOS " + std::to_string(s.tos) + ", want DSCP " + std::to_string(want);
  }
  if (connected == 0) return "no connected socket found";
  return "";
}

// ===========================================================================
// ABI and properties
// ===========================================================================
TEST(NetPlugin, ExportsOnlyThePluginTables) {
  const Plugin& p = shipped();
  ASSERT_NE(p.v11, nullptr) << p.error;
  ASSERT_NE(p.v10, nullptr);
  EXPECT_STREQ(p.v11->name, "kvxfer");
  EXPECT_STREQ(p.v10->name, "kvxfer");
  EXPECT_EQ(p.inject, nullptr) << "test hooks leaked into the shipped plugin";
  // Every entry NCCL calls without checking is present; the device-offload
  // ones and makeVDevice are NULL, which NCCL checks.
  const ncclNet_v11_t& n = *p.v11;
  for (const void* f :
       {(const void*)n.init, (const void*)n.devices, (const void*)n.getProperties,
        (const void*)n.listen, (const void*)n.connect, (const void*)n.accept, (const void*)n.regMr,
        (const void*)n.regMrDmaBuf, (const void*)n.deregMr, (const void*)n.isend,
        (const void*)n.irecv, (const void*)n.iflush, (const void*)n.test, (const void*)n.closeSend,
        (const void*)n.closeRecv, (const void*)n.closeListen, (const void*)n.finalize,
        (const void*)n.setNetAttr})
    EXPECT_NE(f, nullptr);
  EXPECT_EQ(n.getDeviceMr, nullptr);
  EXPECT_EQ(n.irecvConsumed, nullptr);
  EXPECT_EQ(n.makeVDevice, nullptr);
  // The dynamic symbol table: the two tables and nothing else.
  const std::string cmd = std::string("nm -D --defined-only ") + KVXFER_NET_PLUGIN_PATH;
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::set<std::string> syms;
  char line[512];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    char addr[64], type[8], name[400];
    if (std::sscanf(line, "%63s %7s %399s", addr, type, name) == 3 && std::strcmp(type, "A") != 0)
      syms.insert(name);
  }
  ASSERT_EQ(pclose(f), 0) << "nm failed";
  EXPECT_EQ(syms, (std::set<std::string>{"ncclNetPlugin_v10", "ncclNetPlugin_v11"}));
}

TEST(NetPlugin, InitDevicesPropertiesFinalize) {
  const Plugin& p = plug();
  ASSERT_NE(p.v11, nullptr) << p.error;
  void* ctx = nullptr;
  ASSERT_EQ(init_ctx(p, 0, &ctx, 0x1111), ncclSuccess);
  ASSERT_NE(ctx, nullptr);
  EXPECT_TRUE(logged(NCCL_LOG_INFO,
                     "NET/kvxfer : init: comm 0000000000001111, traffic class 0 -> LOW_LATENCY, "
                     "DSCP 46"));
  int ndev = 0;
  ASSERT_EQ(p.v11->devices(&ndev), ncclSuccess);
  ASSERT_EQ(ndev, 1);  // KVXFER_NET_IF=lo
  ncclNetProperties_v11_t props;
  std::memset(&props, 0xAB, sizeof(props));
  ASSERT_EQ(p.v11->getProperties(0, &props), ncclSuccess);
  EXPECT_STREQ(props.name, "lo");
  EXPECT_EQ(props.pciPath, nullptr);  // lo is not on PCI
  EXPECT_NE(props.guid, 0u);
  EXPECT_EQ(props.ptrSupport, NCCL_PTR_HOST);
  EXPECT_EQ(props.regIsGlobal, 0);
  EXPECT_EQ(props.forceFlush, 0);
  EXPECT_GT(props.speed, 0);
  EXPECT_GE(props.latency, 0.0f);
  EXPECT_GT(props.maxComms, 0);
  EXPECT_EQ(props.maxRecvs, 8);
  EXPECT_EQ(props.netDeviceType, NCCL_NET_DEVICE_HOST);
  EXPECT_EQ(props.vProps.ndevs, 1);
  EXPECT_EQ(props.vProps.devs[0], 0);
  EXPECT_GE(props.maxP2pBytes, size_t{1} << 30);
  EXPECT_EQ(props.maxMultiRequestSize, 1);
  EXPECT_EQ(p.v11->getProperties(1, &props), ncclInvalidArgument);
  ncclNetProperties_v10_t p10;
  ASSERT_EQ(p.v10->getProperties(0, &p10), ncclSuccess);
  EXPECT_STREQ(p10.name, "lo");
  EXPECT_EQ(p10.maxRecvs, 8);
  EXPECT_EQ(p.v11->setNetAttr(ctx, nullptr), ncclSuccess);

  EXPECT_EQ(p.live_contexts(), 1);
  EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);
  EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);  // a second finalize is a no-op
  EXPECT_EQ(p.v11->finalize(nullptr), ncclSuccess);
  EXPECT_EQ(p.live_contexts(), 0);

  // A class that KVXFER_NET_TC_MAP lacks: init fails, *ctx stays NULL, and
  // finalize(NULL) afterwards is safe (NCCL 2.28.9 calls it).
  void* bad = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(init_ctx(p, 5, &bad), ncclInvalidArgument);
  EXPECT_EQ(bad, nullptr);
  EXPECT_TRUE(logged(NCCL_LOG_WARN, "NCCL traffic class 5 is not in KVXFER_NET_TC_MAP"));
  EXPECT_EQ(p.v11->finalize(bad), ncclSuccess);
  // Calls with a finalized or bogus context fail cleanly.
  Handle h;
  void* lc = nullptr;
  EXPECT_EQ(p.v11->listen(ctx, 0, h, &lc), ncclInvalidArgument);
  EXPECT_EQ(lc, nullptr);
}

// ===========================================================================
// Connection establishment
// ===========================================================================
TEST(NetPlugin, SameThreadConnectAcceptNeverBlocks) {
  // NCCL's GDR probe connects and accepts in one thread, alternating calls.
  const Plugin& p = plug();
  void* ctx = nullptr;
  ASSERT_EQ(init_ctx(p, 1, &ctx), ncclSuccess);
  Handle h;
  void *lc = nullptr, *sc = nullptr, *rc = nullptr;
  ASSERT_EQ(p.v11->listen(ctx, 0, h, &lc), ncclSuccess);
  const auto t0 = Clock::now();
  double longest = 0;
  int calls = 0;
  while ((sc == nullptr || rc == nullptr) && since(t0) < 10) {
    const auto c0 = Clock::now();
    if (sc == nullptr) {
      ASSERT_EQ(p.v11->connect(ctx, 0, h, &sc, nullptr), ncclSuccess);
    }
    if (rc == nullptr) {
      ASSERT_EQ(p.v11->accept(lc, &rc, nullptr), ncclSuccess);
    }
    longest = std::max(longest, since(c0));
    ++calls;
  }
  ASSERT_NE(sc, nullptr);
  ASSERT_NE(rc, nullptr);
  EXPECT_GT(calls, 1) << "connect and accept cannot both finish in one call";
  EXPECT_LT(longest, 0.5) << "a connect/accept call blocked";
  std::vector<uint8_t> src(1 << 20), dst((1 << 20) + 16, 0xEE);
  fill(src.data(), src.size(), 9);
  void *sreq = nullptr, *rreq = nullptr;
  void* data = dst.data();
  size_t cap = dst.size();
  int tag = 3;
  ASSERT_EQ(irecv_until(p.v11, rc, 1, &data, &cap, &tag, &rreq), ncclSuccess);
  ASSERT_EQ(isend_until(p.v11, sc, src.data(), src.size(), 3, &sreq), ncclSuccess);
  int sdone = 0, rdone = 0, ssize = -1, rsize = -1;
  while ((!sdone || !rdone) && since(t0) < 20) {
    if (!sdone) {
      ASSERT_EQ(p.v11->test(sreq, &sdone, &ssize), ncclSuccess);
    }
    if (!rdone) {
      ASSERT_EQ(p.v11->test(rreq, &rdone, &rsize), ncclSuccess);
    }
  }
  ASSERT_TRUE(sdone && rdone);
  EXPECT_EQ(ssize, 1 << 20);
  EXPECT_EQ(rsize, 1 << 20);
  EXPECT_EQ(first_mismatch(dst.data(), src.size(), 9), -1);
  EXPECT_EQ(dst[src.size()], 0xEE) << "written past the message";
  EXPECT_EQ(p.v11->closeSend(sc), ncclSuccess);
  EXPECT_EQ(p.v11->closeRecv(rc), ncclSuccess);
  EXPECT_EQ(p.v11->closeListen(lc), ncclSuccess);
  EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);
}

TEST(NetPlugin, ListenConnectAcceptWithRetries) {
  const Plugin& p = plug();
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void* ctx = nullptr;
    Handle h;
    CHILD_REQUIRE(init_ctx(p, 0, &ctx) == ncclSuccess);
    CHILD_REQUIRE(read_all(rd, h, sizeof(h)));
    usleep(300 * 1000);  // the parent's accept answers NULL meanwhile
    void* sc = nullptr;
    int nulls = 0;
    double longest = 0;
    const auto t0 = Clock::now();
    while (sc == nullptr && since(t0) < 20) {
      const auto c0 = Clock::now();
      CHILD_REQUIRE(p.v11->connect(ctx, 0, h, &sc, nullptr) == ncclSuccess);
      longest = std::max(longest, since(c0));
      if (sc == nullptr) ++nulls;
    }
    CHILD_REQUIRE(sc != nullptr);
    CHILD_REQUIRE(nulls >= 1);
    CHILD_REQUIRE(longest < 0.5);
    std::vector<uint8_t> buf(4096);
    fill(buf.data(), buf.size(), 77);
    void* req = nullptr;
    CHILD_REQUIRE(isend_until(p.v11, sc, buf.data(), buf.size(), 0, &req) == ncclSuccess);
    int size = -1;
    CHILD_REQUIRE(wait_done(p.v11, req, &size) == ncclSuccess && size == 4096);
    CHILD_REQUIRE(expect_token(rd, 1));
    CHILD_REQUIRE(p.v11->closeSend(sc) == ncclSuccess);
    CHILD_REQUIRE(p.v11->finalize(ctx) == ncclSuccess);
    (void)wr;
    return 0;
  }));
  void* ctx = nullptr;
  ASSERT_EQ(init_ctx(p, 0, &ctx), ncclSuccess);
  Handle h;
  void *lc = nullptr, *rc = nullptr;
  ASSERT_EQ(p.v11->listen(ctx, 0, h, &lc), ncclSuccess);
  ASSERT_TRUE(write_all(child.to_child, h, sizeof(h)));
  int nulls = 0;
  ASSERT_EQ(accept_until(p.v11, lc, &rc, 20, &nulls), ncclSuccess);
  EXPECT_GT(nulls, 0);
  std::vector<uint8_t> buf(4096);
  void* data = buf.data();
  size_t cap = buf.size();
  int tag = 0;
  void* req = nullptr;
  ASSERT_EQ(irecv_until(p.v11, rc, 1, &data, &cap, &tag, &req), ncclSuccess);
  int size = -1;
  ASSERT_EQ(wait_done(p.v11, req, &size), ncclSuccess);
  EXPECT_EQ(size, 4096);
  EXPECT_EQ(first_mismatch(buf.data(), buf.size(), 77), -1);
  send_token(child.to_child, 1);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
  EXPECT_EQ(p.v11->closeRecv(rc), ncclSuccess);
  EXPECT_EQ(p.v11->closeListen(lc), ncclSuccess);
  EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);
}

// ===========================================================================
// Data
// ===========================================================================
TEST(NetPlugin, SweepOneByteTo64MiBByteExact) {
  const Plugin& p = shipped();  // the library as shipped
  ASSERT_NE(p.v11, nullptr) << p.error;
  const std::vector<size_t> sizes = sweep_sizes();
  const size_t max = sizes.back();
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void *ctx = nullptr, *sc = nullptr;
    CHILD_REQUIRE(child_connect(p, 1, rd, &ctx, &sc));
    std::vector<uint8_t> buf(max);
    for (size_t i = 0; i < sizes.size(); ++i) {
      fill(buf.data(), sizes[i], 1000 + i);
      void* req = nullptr;
      CHILD_REQUIRE(isend_until(p.v11, sc, buf.data(), sizes[i], static_cast<int>(i % 3), &req) ==
                    ncclSuccess);
      int size = -1;
      CHILD_REQUIRE(wait_done(p.v11, req, &size, 60) == ncclSuccess);
      CHILD_REQUIRE(size == static_cast<int>(sizes[i]));
    }
    CHILD_REQUIRE(expect_token(rd, 1, 120));
    p.v11->closeSend(sc);
    p.v11->finalize(ctx);
    (void)wr;
    return 0;
  }));
  Receiver r;
  ASSERT_TRUE(listen_accept(p, 1, child.to_child, &r));
  std::vector<uint8_t> buf(max + 64);
  for (size_t i = 0; i < sizes.size(); ++i) {
    // A receive larger than the message: test() must report the sender's size.
    std::memset(buf.data(), 0xC5, sizes[i] + 64);
    void* data = buf.data();
    size_t cap = sizes[i] + 64;
    int tag = static_cast<int>(i % 3);
    void* req = nullptr;
    ASSERT_EQ(irecv_until(p.v11, r.rc, 1, &data, &cap, &tag, &req), ncclSuccess);
    int size = -1;
    ASSERT_EQ(wait_done(p.v11, req, &size, 60), ncclSuccess) << sizes[i] << " bytes";
    ASSERT_EQ(size, static_cast<int>(sizes[i]));
    ASSERT_EQ(first_mismatch(buf.data(), sizes[i], 1000 + i), -1) << sizes[i] << " bytes";
    for (size_t k = sizes[i]; k < sizes[i] + 64; ++k)
      ASSERT_EQ(buf[k], 0xC5) << "written past a message of " << sizes[i] << " bytes";
  }
  send_token(child.to_child, 1);
  ASSERT_TRUE(child.wait(60));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
}

TEST(NetPlugin, MultiRecvHonoursTagsAndReceivesMatchInPostingOrder) {
  const Plugin& p = plug();
  struct Msg {
    int tag;
    size_t size;
    uint64_t seed;
  };
  // Group 1: tags 7 3 11 5, sent in another order.  Group 2: tag 9 twice.
  // Then two separate receives with one tag, and a negative tag.
  const std::vector<Msg> sends = {{11, 3000, 11}, {5, 4000, 5},  {7, 1000, 7}, {3, 2000, 3},
                                  {9, 100, 901},  {4, 50, 4},    {9, 70, 902}, {1, 64, 101},
                                  {1, 48, 102},   {-5, 333, 555}};
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void *ctx = nullptr, *sc = nullptr;
    CHILD_REQUIRE(child_connect(p, 0, rd, &ctx, &sc));
    std::vector<std::vector<uint8_t>> bufs;
    std::vector<void*> reqs;
    for (const Msg& m : sends) {
      bufs.emplace_back(m.size);
      fill(bufs.back().data(), m.size, m.seed);
      void* req = nullptr;
      CHILD_REQUIRE(isend_until(p.v11, sc, bufs.back().data(), m.size, m.tag, &req) == ncclSuccess);
      reqs.push_back(req);
    }
    for (void* req : reqs) CHILD_REQUIRE(wait_done(p.v11, req, nullptr) == ncclSuccess);
    CHILD_REQUIRE(expect_token(rd, 1));
    p.v11->closeSend(sc);
    p.v11->finalize(ctx);
    (void)wr;
    return 0;
  }));
  Receiver r;
  ASSERT_TRUE(listen_accept(p, 0, child.to_child, &r));
  // Group 1.
  {
    std::vector<uint8_t> b[4] = {std::vector<uint8_t>(1000), std::vector<uint8_t>(2000),
                                 std::vector<uint8_t>(3000), std::vector<uint8_t>(4000)};
    void* data[4] = {b[0].data(), b[1].data(), b[2].data(), b[3].data()};
    size_t caps[4] = {1000, 2000, 3000, 4000};
    int tags[4] = {7, 3, 11, 5};
    void* req = nullptr;
    ASSERT_EQ(irecv_until(p.v11, r.rc, 4, data, caps, tags, &req), ncclSuccess);
    int sizes[4] = {-1, -1, -1, -1};
    ASSERT_EQ(wait_done(p.v11, req, sizes), ncclSuccess);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(sizes[i], static_cast<int>(caps[i])) << "element " << i;
      EXPECT_EQ(first_mismatch(b[i].data(), caps[i], static_cast<uint64_t>(tags[i])), -1)
          << "element " << i << " (tag " << tags[i] << ")";
    }
  }
  // Group 2: duplicate tags match in the group's order.
  {
    std::vector<uint8_t> b0(200), b1(200), b2(200);
    void* data[3] = {b0.data(), b1.data(), b2.data()};
    size_t caps[3] = {200, 200, 200};
    int tags[3] = {9, 9, 4};
    void* req = nullptr;
    ASSERT_EQ(irecv_until(p.v11, r.rc, 3, data, caps, tags, &req), ncclSuccess);
    int sizes[3] = {-1, -1, -1};
    ASSERT_EQ(wait_done(p.v11, req, sizes), ncclSuccess);
    EXPECT_EQ(sizes[0], 100);
    EXPECT_EQ(sizes[1], 70);
    EXPECT_EQ(sizes[2], 50);
    EXPECT_EQ(first_mismatch(b0.data(), 100, 901), -1);
    EXPECT_EQ(first_mismatch(b1.data(), 70, 902), -1);
    EXPECT_EQ(first_mismatch(b2.data(), 50, 4), -1);
  }
  // Two receives with one tag: the first posted gets the first sent, even
  // when the second is tested first.
  {
    std::vector<uint8_t> b0(64), b1(64);
    void* d0 = b0.data();
    void* d1 = b1.data();
    size_t c0 = 64, c1 = 64;
    int tag = 1;
    void *r0 = nullptr, *r1 = nullptr;
    ASSERT_EQ(irecv_until(p.v11, r.rc, 1, &d0, &c0, &tag, &r0), ncclSuccess);
    ASSERT_EQ(irecv_until(p.v11, r.rc, 1, &d1, &c1, &tag, &r1), ncclSuccess);
    int s1 = -1, s0 = -1;
    ASSERT_EQ(wait_done(p.v11, r1, &s1), ncclSuccess);
    ASSERT_EQ(wait_done(p.v11, r0, &s0), ncclSuccess);
    EXPECT_EQ(s0, 64);
    EXPECT_EQ(s1, 48);
    EXPECT_EQ(first_mismatch(b0.data(), 64, 101), -1);
    EXPECT_EQ(first_mismatch(b1.data(), 48, 102), -1);
  }
  {
    std::vector<uint8_t> b(333);
    void* d = b.data();
    size_t c = 333;
    int tag = -5;
    void* req = nullptr;
    ASSERT_EQ(irecv_until(p.v11, r.rc, 1, &d, &c, &tag, &req), ncclSuccess);
    int s = -1;
    ASSERT_EQ(wait_done(p.v11, req, &s), ncclSuccess);
    EXPECT_EQ(s, 333);
    EXPECT_EQ(first_mismatch(b.data(), 333, 555), -1);
  }
  send_token(child.to_child, 1);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
}

TEST(NetPlugin, ThirtyTwoRequestsInFlight) {
  const Plugin& p = plug();
  constexpr int kN = NCCL_NET_MAX_REQUESTS;
  auto size_of = [](int i) { return static_cast<size_t>(1000 + i * 37777); };
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void *ctx = nullptr, *sc = nullptr;
    CHILD_REQUIRE(child_connect(p, 1, rd, &ctx, &sc));
    std::vector<std::vector<uint8_t>> bufs(kN);
    void* reqs[kN];
    for (int i = 0; i < kN; ++i) {  // all posted before any is tested
      bufs[i].resize(size_of(i));
      fill(bufs[i].data(), bufs[i].size(), 300 + i);
      CHILD_REQUIRE(isend_until(p.v11, sc, bufs[i].data(), bufs[i].size(), i % 4, &reqs[i]) ==
                    ncclSuccess);
    }
    for (int i = kN - 1; i >= 0; --i) {
      int size = -1;
      CHILD_REQUIRE(wait_done(p.v11, reqs[i], &size) == ncclSuccess);
      CHILD_REQUIRE(size == static_cast<int>(size_of(i)));
    }
    CHILD_REQUIRE(expect_token(rd, 1));
    p.v11->closeSend(sc);
    p.v11->finalize(ctx);
    (void)wr;
    return 0;
  }));
  Receiver r;
  ASSERT_TRUE(listen_accept(p, 1, child.to_child, &r));
  std::vector<std::vector<uint8_t>> bufs(kN);
  void* reqs[kN];
  for (int i = 0; i < kN; ++i) {
    bufs[i].resize(size_of(i));
    void* d = bufs[i].data();
    size_t c = bufs[i].size();
    int tag = i % 4;
    ASSERT_EQ(irecv_until(p.v11, r.rc, 1, &d, &c, &tag, &reqs[i]), ncclSuccess);
  }
  kvxfer_net_test_info_t info;
  ASSERT_EQ(p.comm_info(r.rc, &info), 0);
  EXPECT_EQ(info.requests, kN);
  for (int i = 0; i < kN; ++i) {
    int size = -1;
    ASSERT_EQ(wait_done(p.v11, reqs[i], &size), ncclSuccess) << i;
    EXPECT_EQ(size, static_cast<int>(size_of(i)));
    EXPECT_EQ(first_mismatch(bufs[i].data(), bufs[i].size(), 300 + i), -1) << i;
  }
  ASSERT_EQ(p.comm_info(r.rc, &info), 0);
  EXPECT_EQ(info.requests, 0);
  send_token(child.to_child, 1);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
}

TEST(NetPlugin, CloseWithRequestsInFlightThenReconnect) {
  const Plugin& p = plug();
  constexpr size_t kBig = 4 << 20;
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void *ctx = nullptr, *sc = nullptr;
    CHILD_REQUIRE(child_connect(p, 1, rd, &ctx, &sc));
    std::vector<uint8_t> big(kBig, 0x5A);
    for (int i = 0; i < 8; ++i) {  // the parent posts only some receives
      void* req = nullptr;
      CHILD_REQUIRE(isend_until(p.v11, sc, big.data(), big.size(), 0, &req) == ncclSuccess);
    }
    CHILD_REQUIRE(send_token(wr, 1));
    CHILD_REQUIRE(expect_token(rd, 2));
    const auto t0 = Clock::now();
    CHILD_REQUIRE(p.v11->closeSend(sc) == ncclSuccess);  // 8 sends in flight
    CHILD_REQUIRE(since(t0) < 1.0);
    // The plugin still works: a new connection, a byte-exact message.
    Handle h;
    CHILD_REQUIRE(read_all(rd, h, sizeof(h)));
    CHILD_REQUIRE(connect_until(p.v11, ctx, 0, h, &sc) == ncclSuccess);
    std::vector<uint8_t> msg(100000);
    fill(msg.data(), msg.size(), 4242);
    void* req = nullptr;
    CHILD_REQUIRE(isend_until(p.v11, sc, msg.data(), msg.size(), 0, &req) == ncclSuccess);
    CHILD_REQUIRE(wait_done(p.v11, req, nullptr) == ncclSuccess);
    CHILD_REQUIRE(expect_token(rd, 3));
    p.v11->closeSend(sc);
    p.v11->finalize(ctx);
    return 0;
  }));
  Receiver r;
  ASSERT_TRUE(listen_accept(p, 1, child.to_child, &r));
  ASSERT_TRUE(expect_token(child.from_child, 1));
  std::vector<std::vector<uint8_t>> bufs(3, std::vector<uint8_t>(kBig));
  for (auto& b : bufs) {
    void* d = b.data();
    size_t c = b.size();
    int tag = 0;
    void* req = nullptr;
    ASSERT_EQ(irecv_until(p.v11, r.rc, 1, &d, &c, &tag, &req), ncclSuccess);
  }
  send_token(child.to_child, 2);
  const auto t0 = Clock::now();
  ASSERT_EQ(p.v11->closeRecv(r.rc), ncclSuccess);  // 3 receives in flight
  r.rc = nullptr;
  EXPECT_LT(since(t0), 1.0);
  EXPECT_EQ(p.v11->closeListen(r.lc), ncclSuccess);
  r.lc = nullptr;
  // Again, on the same context.
  Handle h;
  ASSERT_EQ(p.v11->listen(r.ctx, 0, h, &r.lc), ncclSuccess);
  ASSERT_TRUE(write_all(child.to_child, h, sizeof(h)));
  ASSERT_EQ(accept_until(p.v11, r.lc, &r.rc), ncclSuccess);
  std::vector<uint8_t> msg(100000);
  void* d = msg.data();
  size_t c = msg.size();
  int tag = 0;
  void* req = nullptr;
  ASSERT_EQ(irecv_until(p.v11, r.rc, 1, &d, &c, &tag, &req), ncclSuccess);
  int size = -1;
  ASSERT_EQ(wait_done(p.v11, req, &size), ncclSuccess);
  EXPECT_EQ(size, 100000);
  EXPECT_EQ(first_mismatch(msg.data(), msg.size(), 4242), -1);
  send_token(child.to_child, 3);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
}

// A sender killed while the receiver takes its 32 MiB messages one by one:
// the receive in progress (or the next one) fails from test(), within
// seconds, and the error stays.
TEST(NetPlugin, SenderKilledMidTransferGivesErrorFromTest) {
  const Plugin& p = plug();
  constexpr size_t kMsg = 32 << 20;
  constexpr int kCount = 16;
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void *ctx = nullptr, *sc = nullptr;
    CHILD_REQUIRE(child_connect(p, 0, rd, &ctx, &sc));
    std::vector<uint8_t> buf(kMsg);
    fill(buf.data(), buf.size(), 5);
    std::vector<void*> reqs(kCount);
    for (int i = 0; i < kCount; ++i)
      CHILD_REQUIRE(isend_until(p.v11, sc, buf.data(), buf.size(), 0, &reqs[i]) == ncclSuccess);
    for (int i = 0; i < kCount; ++i) (void)wait_done(p.v11, reqs[i], nullptr, 60);
    pause();  // killed by the parent
    (void)wr;
    return 0;
  }));
  Receiver r;
  ASSERT_TRUE(listen_accept(p, 0, child.to_child, &r));
  std::vector<uint8_t> buf(kMsg);
  ncclResult_t err = ncclSuccess;
  int completed = 0;
  std::string trace;
  for (int i = 0; i < kCount && err == ncclSuccess; ++i) {
    std::memset(buf.data(), 0, buf.size());
    void* d = buf.data();
    size_t c = buf.size();
    int tag = 0;
    void* req = nullptr;
    err = irecv_until(p.v11, r.rc, 1, &d, &c, &tag, &req, 10);
    trace += strprintf_test("recv %d: irecv %d", i, static_cast<int>(err));
    if (err != ncclSuccess) break;
    if (i == 2) kill(child.pid, SIGKILL);  // while this receive is under way
    const auto t0 = Clock::now();
    int size = -1;
    err = wait_done(p.v11, req, &size, 15);
    trace += strprintf_test(", test %d after %.3f s, %d bytes; ", static_cast<int>(err), since(t0),
                            size);
    SCOPED_TRACE(trace);
    if (err == ncclSuccess) {
      ++completed;
      ASSERT_EQ(size, static_cast<int>(kMsg));
      ASSERT_EQ(first_mismatch(buf.data(), buf.size(), 5), -1);
    } else {
      EXPECT_LT(since(t0), 12.0);
      // The error is returned again, not swallowed.
      int done = 1;
      EXPECT_NE(p.v11->test(req, &done, nullptr), ncclSuccess);
      EXPECT_EQ(done, 0);
    }
  }
  SCOPED_TRACE(trace);
  EXPECT_NE(err, ncclSuccess) << "every receive completed after the sender was killed";
  EXPECT_NE(err, kTimedOut) << "test() hung instead of failing";
  EXPECT_GE(completed, 2);
  EXPECT_LT(completed, kCount);
  // New work on the dead comm fails too.
  uint8_t one = 0;
  void* d = &one;
  size_t c = 1;
  int tag = 0;
  void* req = nullptr;
  EXPECT_NE(p.v11->irecv(r.rc, 1, &d, &c, &tag, nullptr, nullptr, &req), ncclSuccess);
  EXPECT_EQ(req, nullptr);
  child.wait(5);
}

// The receiver killed while the sender has 32 MiB messages in flight: the
// sender's test() fails within seconds.
TEST(NetPlugin, ReceiverKilledMidTransferGivesErrorFromTest) {
  const Plugin& p = plug();
  constexpr size_t kMsg = 32 << 20;
  constexpr int kCount = 16;
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    Receiver r;
    CHILD_REQUIRE(listen_accept(p, 1, wr, &r));
    std::vector<uint8_t> buf(kMsg);
    for (int i = 0; i < 2; ++i) {
      void* d = buf.data();
      size_t c = buf.size();
      int tag = 0;
      void* req = nullptr;
      CHILD_REQUIRE(irecv_until(p.v11, r.rc, 1, &d, &c, &tag, &req) == ncclSuccess);
      CHILD_REQUIRE(wait_done(p.v11, req, nullptr) == ncclSuccess);
    }
    void* d = buf.data();
    size_t c = buf.size();
    int tag = 0;
    void* req = nullptr;
    CHILD_REQUIRE(irecv_until(p.v11, r.rc, 1, &d, &c, &tag, &req) == ncclSuccess);
    CHILD_REQUIRE(send_token(wr, 7));
    for (;;) {  // receiving message 3 when the parent kills it
      int done = 0;
      p.v11->test(req, &done, nullptr);
      (void)rd;
    }
    return 0;
  }));
  void *ctx = nullptr, *sc = nullptr;
  {
    Handle h;
    ASSERT_EQ(init_ctx(p, 1, &ctx), ncclSuccess);
    ASSERT_TRUE(read_all(child.from_child, h, sizeof(h)));
    ASSERT_EQ(connect_until(p.v11, ctx, 0, h, &sc), ncclSuccess);
  }
  std::vector<uint8_t> buf(kMsg, 0x33);
  std::vector<void*> reqs(kCount);
  for (int i = 0; i < kCount; ++i)
    ASSERT_EQ(isend_until(p.v11, sc, buf.data(), buf.size(), 0, &reqs[i]), ncclSuccess);
  // Progress until the child has taken two messages and is on the third.
  bool ready = false;
  const auto t0 = Clock::now();
  while (!ready && since(t0) < 30) {
    int done = 0;
    ASSERT_EQ(p.v11->test(reqs[kCount - 1], &done, nullptr), ncclSuccess);
    ready = readable(child.from_child);
  }
  ASSERT_TRUE(expect_token(child.from_child, 7));
  kill(child.pid, SIGKILL);
  const auto t1 = Clock::now();
  ncclResult_t err = ncclSuccess;
  int completed = 0;
  for (int i = 0; i < kCount && err == ncclSuccess; ++i) {
    err = wait_done(p.v11, reqs[i], nullptr, 15);
    if (err == ncclSuccess) ++completed;
  }
  EXPECT_NE(err, ncclSuccess) << "every send completed after the receiver was killed";
  EXPECT_NE(err, kTimedOut) << "test() hung instead of failing";
  EXPECT_LT(since(t1), 12.0);
  EXPECT_LT(completed, kCount);
  p.v11->closeSend(sc);
  p.v11->finalize(ctx);
  child.wait(5);
}

// A peer that is alive but quiet for longer than the liveness probe's idle
// time (1 s) is not declared dead: its receive just waits.
TEST(NetPlugin, QuietPeerIsNotDeclaredDead) {
  const Plugin& p = plug();
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void *ctx = nullptr, *sc = nullptr;
    CHILD_REQUIRE(child_connect(p, 1, rd, &ctx, &sc));
    // The parent's receive is posted; stay silent (blocked, off the CPU).
    CHILD_REQUIRE(expect_token(rd, 1));
    usleep(3 * 1000 * 1000);
    std::vector<uint8_t> b(1 << 20);
    fill(b.data(), b.size(), 12);
    void* req = nullptr;
    CHILD_REQUIRE(isend_until(p.v11, sc, b.data(), b.size(), 0, &req) == ncclSuccess);
    CHILD_REQUIRE(wait_done(p.v11, req, nullptr) == ncclSuccess);
    CHILD_REQUIRE(expect_token(rd, 2));
    p.v11->closeSend(sc);
    p.v11->finalize(ctx);
    (void)wr;
    return 0;
  }));
  Receiver r;
  ASSERT_TRUE(listen_accept(p, 1, child.to_child, &r));
  std::vector<uint8_t> b(1 << 20);
  void* d = b.data();
  size_t c = b.size();
  int tag = 0;
  void* req = nullptr;
  ASSERT_EQ(irecv_until(p.v11, r.rc, 1, &d, &c, &tag, &req), ncclSuccess);
  send_token(child.to_child, 1);
  int size = -1;
  ASSERT_EQ(wait_done(p.v11, req, &size, 20), ncclSuccess);
  EXPECT_EQ(size, 1 << 20);
  EXPECT_EQ(first_mismatch(b.data(), b.size(), 12), -1);
  send_token(child.to_child, 2);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
}

// ===========================================================================
// Traffic classes
// ===========================================================================
// Two contexts (NCCL communicators) with classes 0 and 1, and one without a
// class: each context's endpoints carry its tclass, and every socket of its
// comms (listener, accepted and made connections) its DSCP, on both sides.
TEST(NetPlugin, TwoContextsMarkTheirSocketsWithTheirClass) {
  const Plugin& p = plug();
  const int classes[3] = {0, 1, -1};
  const int dscp[3] = {46, 8, -1};
  const uint32_t tclass[3] = {FI_TC_LOW_LATENCY, FI_TC_BULK_DATA, FI_TC_UNSPEC};
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void* ctx[3];
    void* sc[3];
    for (int k = 0; k < 3; ++k) CHILD_REQUIRE(child_connect(p, classes[k], rd, &ctx[k], &sc[k]));
    for (int k = 0; k < 3; ++k) {
      std::vector<uint8_t> b(1 << 20);
      fill(b.data(), b.size(), k);
      void* req = nullptr;
      CHILD_REQUIRE(isend_until(p.v11, sc[k], b.data(), b.size(), 0, &req) == ncclSuccess);
      CHILD_REQUIRE(wait_done(p.v11, req, nullptr) == ncclSuccess);
    }
    for (int k = 0; k < 3; ++k) {
      const std::string why = check_dscp(p, sc[k], dscp[k], tclass[k]);
      if (!why.empty()) {
        std::fprintf(stderr, "child: class %d: %s\n", classes[k], why.c_str());
        return 10 + k;
      }
    }
    CHILD_REQUIRE(send_token(wr, 1));
    CHILD_REQUIRE(expect_token(rd, 2));
    for (int k = 0; k < 3; ++k) {
      p.v11->closeSend(sc[k]);
      p.v11->finalize(ctx[k]);
    }
    return 0;
  }));
  Receiver r[3];
  for (int k = 0; k < 3; ++k) ASSERT_TRUE(listen_accept(p, classes[k], child.to_child, &r[k]));
  for (int k = 0; k < 3; ++k) {
    std::vector<uint8_t> b(1 << 20);
    void* d = b.data();
    size_t c = b.size();
    int tag = 0;
    void* req = nullptr;
    ASSERT_EQ(irecv_until(p.v11, r[k].rc, 1, &d, &c, &tag, &req), ncclSuccess);
    ASSERT_EQ(wait_done(p.v11, req, nullptr), ncclSuccess);
    EXPECT_EQ(first_mismatch(b.data(), b.size(), k), -1);
  }
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(check_dscp(p, r[k].rc, dscp[k], tclass[k]), "") << "class " << classes[k];
  EXPECT_TRUE(expect_token(child.from_child, 1));
  send_token(child.to_child, 2);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0)
      << "child exit " << WEXITSTATUS(child.status) << " (10 + k: class k's sockets are wrong)";
}

// ABI v10 (NCCL 2.26/2.27): the class arrives with connect(); the accepting
// side, whose context has none, takes the connecting side's.
TEST(NetPlugin, V10TableTakesTheClassFromConnect) {
  const Plugin& p = plug();
  ASSERT_NE(p.v10, nullptr);
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    CHILD_REQUIRE(p.v10->init(test_logger, nullptr) == ncclSuccess);
    Handle h;
    CHILD_REQUIRE(read_all(rd, h, sizeof(h)));
    ncclNetCommConfig_v10_t cfg;
    cfg.trafficClass = 1;
    void* sc = nullptr;
    const auto t0 = Clock::now();
    while (sc == nullptr && since(t0) < 20)
      CHILD_REQUIRE(p.v10->connect(0, &cfg, h, &sc, nullptr) == ncclSuccess);
    CHILD_REQUIRE(sc != nullptr);
    std::vector<uint8_t> b(300000);
    fill(b.data(), b.size(), 10);
    void* req = nullptr;
    CHILD_REQUIRE(isend_until(p.v11, sc, b.data(), b.size(), 2, &req) == ncclSuccess);
    CHILD_REQUIRE(wait_done(p.v11, req, nullptr) == ncclSuccess);
    const std::string why = check_dscp(p, sc, 8, FI_TC_BULK_DATA);
    if (!why.empty()) {
      std::fprintf(stderr, "child: %s\n", why.c_str());
      return 2;
    }
    CHILD_REQUIRE(expect_token(rd, 1));
    p.v10->closeSend(sc);
    (void)wr;
    return 0;
  }));
  ASSERT_EQ(p.v10->init(test_logger, nullptr), ncclSuccess);
  int ndev = 0;
  ASSERT_EQ(p.v10->devices(&ndev), ncclSuccess);
  ASSERT_EQ(ndev, 1);
  Handle h;
  void *lc = nullptr, *rc = nullptr;
  ASSERT_EQ(p.v10->listen(0, h, &lc), ncclSuccess);
  ASSERT_TRUE(write_all(child.to_child, h, sizeof(h)));
  const auto t0 = Clock::now();
  while (rc == nullptr && since(t0) < 20) ASSERT_EQ(p.v10->accept(lc, &rc, nullptr), ncclSuccess);
  ASSERT_NE(rc, nullptr);
  std::vector<uint8_t> b(300000);
  void* d = b.data();
  size_t c = b.size();
  int tag = 2;
  void* req = nullptr;
  ASSERT_EQ(irecv_until(p.v11, rc, 1, &d, &c, &tag, &req), ncclSuccess);
  ASSERT_EQ(wait_done(p.v11, req, nullptr), ncclSuccess);
  EXPECT_EQ(first_mismatch(b.data(), b.size(), 10), -1);
  // The listening endpoint was opened before the class was known (UNSPEC);
  // its sockets took the peer's DSCP at accept.
  EXPECT_EQ(check_dscp(p, rc, 8, FI_TC_UNSPEC), "");
  send_token(child.to_child, 1);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
  p.v10->closeRecv(rc);
  p.v10->closeListen(lc);
}

// ===========================================================================
// Memory registration and flush
// ===========================================================================
TEST(NetPlugin, RegMrDeregMrAndIflushOnHostMemory) {
  const Plugin& p = plug();
  void* ctx = nullptr;
  ASSERT_EQ(init_ctx(p, 0, &ctx), ncclSuccess);
  Handle h;
  void *lc = nullptr, *sc = nullptr, *rc = nullptr;
  ASSERT_EQ(p.v11->listen(ctx, 0, h, &lc), ncclSuccess);
  const auto t0 = Clock::now();
  while ((sc == nullptr || rc == nullptr) && since(t0) < 10) {
    if (sc == nullptr) {
      ASSERT_EQ(p.v11->connect(ctx, 0, h, &sc, nullptr), ncclSuccess);
    }
    if (rc == nullptr) {
      ASSERT_EQ(p.v11->accept(lc, &rc, nullptr), ncclSuccess);
    }
  }
  ASSERT_TRUE(sc != nullptr && rc != nullptr);
  std::vector<uint8_t> src(70000), dst(70000);
  fill(src.data(), src.size(), 8);
  void *smr = nullptr, *rmr = nullptr, *cuda_mr = nullptr, *dmabuf_mr = nullptr;
  ASSERT_EQ(p.v11->regMr(sc, src.data(), src.size(), NCCL_PTR_HOST, &smr), ncclSuccess);
  ASSERT_EQ(p.v11->regMr(rc, dst.data(), dst.size(), NCCL_PTR_HOST, &rmr), ncclSuccess);
  ASSERT_NE(smr, nullptr);
  EXPECT_NE(p.v11->regMr(sc, src.data(), src.size(), NCCL_PTR_CUDA, &cuda_mr), ncclSuccess);
  EXPECT_EQ(cuda_mr, nullptr);
  EXPECT_NE(p.v11->regMrDmaBuf(sc, src.data(), src.size(), NCCL_PTR_DMABUF, 0, -1, &dmabuf_mr),
            ncclSuccess);
  void *sreq = nullptr, *rreq = nullptr;
  void* d = dst.data();
  size_t c = dst.size();
  int tag = 0;
  ASSERT_EQ(p.v11->irecv(rc, 1, &d, &c, &tag, &rmr, nullptr, &rreq), ncclSuccess);
  ASSERT_NE(rreq, nullptr);
  ASSERT_EQ(p.v11->isend(sc, src.data(), src.size(), 0, smr, nullptr, &sreq), ncclSuccess);
  ASSERT_NE(sreq, nullptr);
  int sdone = 0, rdone = 0;
  while ((!sdone || !rdone) && since(t0) < 20) {
    if (!sdone) {
      ASSERT_EQ(p.v11->test(sreq, &sdone, nullptr), ncclSuccess);
    }
    if (!rdone) {
      ASSERT_EQ(p.v11->test(rreq, &rdone, nullptr), ncclSuccess);
    }
  }
  ASSERT_TRUE(sdone && rdone);
  // Host memory: the flush completes at once, and the data is in place.
  void* freq = nullptr;
  int fsize = static_cast<int>(dst.size());
  ASSERT_EQ(p.v11->iflush(rc, 1, &d, &fsize, &rmr, &freq), ncclSuccess);
  if (freq != nullptr) {
    int done = 0;
    ASSERT_EQ(p.v11->test(freq, &done, nullptr), ncclSuccess);
    EXPECT_EQ(done, 1);
  }
  EXPECT_EQ(first_mismatch(dst.data(), dst.size(), 8), -1);
  EXPECT_EQ(p.v11->deregMr(sc, smr), ncclSuccess);
  EXPECT_NE(p.v11->deregMr(sc, smr), ncclSuccess) << "a second deregMr must fail, not crash";
  EXPECT_NE(p.v11->deregMr(sc, rmr), ncclSuccess) << "rmr belongs to the recv comm";
  EXPECT_EQ(p.v11->deregMr(rc, rmr), ncclSuccess);
  EXPECT_EQ(p.v11->closeSend(sc), ncclSuccess);
  EXPECT_EQ(p.v11->closeRecv(rc), ncclSuccess);
  EXPECT_EQ(p.v11->closeListen(lc), ncclSuccess);
  EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);
}

// ===========================================================================
// Known failure modes of existing plugins
// ===========================================================================
// 1. A close that waits on a peer that never connected.
TEST(NetPluginFailureModes, CloseNeverWaitsForAPeerThatNeverConnected) {
  const Plugin& p = plug();
  void* ctx = nullptr;
  ASSERT_EQ(init_ctx(p, 0, &ctx), ncclSuccess);
  Handle h;
  void* lc = nullptr;
  ASSERT_EQ(p.v11->listen(ctx, 0, h, &lc), ncclSuccess);
  void* rc = nullptr;
  ASSERT_EQ(p.v11->accept(lc, &rc, nullptr), ncclSuccess);
  EXPECT_EQ(rc, nullptr);
  auto t0 = Clock::now();
  ASSERT_EQ(p.v11->closeListen(lc), ncclSuccess);
  EXPECT_LT(since(t0), 0.1);

  // A peer connects but this side never accepts: closeListen is immediate,
  // and the peer's connect fails (no hang) instead of waiting forever.
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void* cctx = nullptr;
    Handle ch;
    CHILD_REQUIRE(init_ctx(p, 0, &cctx) == ncclSuccess);
    CHILD_REQUIRE(read_all(rd, ch, sizeof(ch)));
    void* sc = nullptr;
    int nulls = 0;
    const ncclResult_t r = connect_until(p.v11, cctx, 0, ch, &sc, 20, &nulls);
    CHILD_REQUIRE(send_token(wr, 1));
    CHILD_REQUIRE(r != ncclSuccess && r != kTimedOut);  // timed out by the plugin (5 s), not by us
    CHILD_REQUIRE(sc == nullptr);
    CHILD_REQUIRE(p.pending_connects() == 0);
    // A connect attempt in progress that its context's finalize drops.
    CHILD_REQUIRE(read_all(rd, ch, sizeof(ch)));
    CHILD_REQUIRE(p.v11->connect(cctx, 0, ch, &sc, nullptr) == ncclSuccess && sc == nullptr);
    CHILD_REQUIRE(p.pending_connects() == 1);
    const auto f0 = Clock::now();
    CHILD_REQUIRE(p.v11->finalize(cctx) == ncclSuccess);
    CHILD_REQUIRE(since(f0) < 0.1);
    CHILD_REQUIRE(p.pending_connects() == 0);
    // The handle names the dropped attempt: connect fails, and clears it.
    CHILD_REQUIRE(p.v11->connect(cctx, 0, ch, &sc, nullptr) != ncclSuccess);
    uint64_t stage = 1;
    std::memcpy(&stage, ch + netplugin::kHandleStageOffset, sizeof(stage));
    CHILD_REQUIRE(stage == 0);
    return 0;
  }));
  ASSERT_EQ(p.v11->listen(ctx, 0, h, &lc), ncclSuccess);
  ASSERT_TRUE(write_all(child.to_child, h, sizeof(h)));
  usleep(200 * 1000);  // the child's request reaches the listener
  t0 = Clock::now();
  ASSERT_EQ(p.v11->closeListen(lc), ncclSuccess);
  EXPECT_LT(since(t0), 0.1);
  ASSERT_TRUE(expect_token(child.from_child, 1, 30));
  void* lc2 = nullptr;
  ASSERT_EQ(p.v11->listen(ctx, 0, h, &lc2), ncclSuccess);  // never accepted
  ASSERT_TRUE(write_all(child.to_child, h, sizeof(h)));
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
  t0 = Clock::now();
  EXPECT_EQ(p.v11->closeListen(lc2), ncclSuccess);
  EXPECT_LT(since(t0), 0.1);
  EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);
}

// 2. A completion delivered to a closed comm: comm A is closed with a receive
// posted while the peer sends to it; comm B of the same process gets exactly
// its own message, A's buffer is never written, and the peer's send to A
// fails instead of completing.
TEST(NetPluginFailureModes, ClosedCommGetsNoCompletion) {
  const Plugin& p = plug();
  constexpr size_t kMsg = 1 << 20;
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void *ca = nullptr, *cb = nullptr, *sa = nullptr, *sb = nullptr;
    CHILD_REQUIRE(child_connect(p, 0, rd, &ca, &sa));
    CHILD_REQUIRE(child_connect(p, 1, rd, &cb, &sb));
    CHILD_REQUIRE(expect_token(rd, 1));  // A closed on the other side
    std::vector<uint8_t> a(kMsg), b(kMsg);
    fill(a.data(), a.size(), 0xA);
    fill(b.data(), b.size(), 0xB);
    void *ra = nullptr, *rb = nullptr;
    const ncclResult_t pa = isend_until(p.v11, sa, a.data(), a.size(), 0, &ra, 5);
    CHILD_REQUIRE(isend_until(p.v11, sb, b.data(), b.size(), 0, &rb) == ncclSuccess);
    CHILD_REQUIRE(wait_done(p.v11, rb, nullptr) == ncclSuccess);
    // The send to the closed comm: an error (posting or testing), not success.
    const ncclResult_t ta = pa == ncclSuccess ? wait_done(p.v11, ra, nullptr, 15) : pa;
    std::fprintf(stderr, "child: send to the closed comm -> %d\n", static_cast<int>(ta));
    CHILD_REQUIRE(ta != ncclSuccess && ta != kTimedOut);
    CHILD_REQUIRE(send_token(wr, 2));
    CHILD_REQUIRE(expect_token(rd, 3));
    p.v11->closeSend(sa);
    p.v11->closeSend(sb);
    p.v11->finalize(ca);
    p.v11->finalize(cb);
    return 0;
  }));
  Receiver ra, rb;
  ASSERT_TRUE(listen_accept(p, 0, child.to_child, &ra));
  ASSERT_TRUE(listen_accept(p, 1, child.to_child, &rb));
  std::vector<uint8_t> abuf(kMsg, 0x77), bbuf(kMsg, 0);
  void *areq = nullptr, *breq = nullptr;
  {
    void* d = abuf.data();
    size_t c = abuf.size();
    int tag = 0;
    ASSERT_EQ(irecv_until(p.v11, ra.rc, 1, &d, &c, &tag, &areq), ncclSuccess);
    void* d2 = bbuf.data();
    size_t c2 = bbuf.size();
    ASSERT_EQ(irecv_until(p.v11, rb.rc, 1, &d2, &c2, &tag, &breq), ncclSuccess);
  }
  ASSERT_EQ(p.v11->closeRecv(ra.rc), ncclSuccess);  // its receive still posted
  ra.rc = nullptr;
  send_token(child.to_child, 1);
  int size = -1;
  ASSERT_EQ(wait_done(p.v11, breq, &size), ncclSuccess);
  EXPECT_EQ(size, static_cast<int>(kMsg));
  EXPECT_EQ(first_mismatch(bbuf.data(), bbuf.size(), 0xB), -1);
  EXPECT_TRUE(expect_token(child.from_child, 2, 30));
  for (size_t i = 0; i < abuf.size(); ++i)
    ASSERT_EQ(abuf[i], 0x77) << "closed comm's buffer written at " << i;
  send_token(child.to_child, 3);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
}

// 3. An exception inside connect leaving a dangling pointer in the handle:
// here the attempt is dropped, the handle cleared, and a retry works.  Also
// exceptions in accept and isend become error codes.
TEST(NetPluginFailureModes, ExceptionInConnectLeavesNoDanglingState) {
  const Plugin& p = plug();
  ASSERT_NE(p.inject, nullptr);
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void* ctx = nullptr;
    Handle h;
    CHILD_REQUIRE(init_ctx(p, 0, &ctx) == ncclSuccess);
    CHILD_REQUIRE(read_all(rd, h, sizeof(h)));
    p.inject(KVXFER_NET_FAULT_CONNECT_AFTER_STAGE);
    void* sc = reinterpret_cast<void*>(0x1);
    CHILD_REQUIRE(p.v11->connect(ctx, 0, h, &sc, nullptr) == ncclInternalError);
    CHILD_REQUIRE(sc == nullptr);
    uint64_t stage = 1;
    std::memcpy(&stage, h + netplugin::kHandleStageOffset, sizeof(stage));
    CHILD_REQUIRE(stage == 0);
    CHILD_REQUIRE(p.pending_connects() == 0);
    // The same handle again: a fresh attempt that succeeds.
    CHILD_REQUIRE(connect_until(p.v11, ctx, 0, h, &sc) == ncclSuccess);
    std::vector<uint8_t> b(5000);
    fill(b.data(), b.size(), 31);
    p.inject(KVXFER_NET_FAULT_ISEND_THROW);
    void* req = reinterpret_cast<void*>(0x1);
    CHILD_REQUIRE(p.v11->isend(sc, b.data(), b.size(), 0, nullptr, nullptr, &req) ==
                  ncclInternalError);
    CHILD_REQUIRE(req == nullptr);
    CHILD_REQUIRE(isend_until(p.v11, sc, b.data(), b.size(), 0, &req) == ncclSuccess);
    CHILD_REQUIRE(wait_done(p.v11, req, nullptr) == ncclSuccess);
    CHILD_REQUIRE(expect_token(rd, 1));
    p.v11->closeSend(sc);
    p.v11->finalize(ctx);
    (void)wr;
    return 0;
  }));
  void* ctx = nullptr;
  ASSERT_EQ(init_ctx(p, 0, &ctx), ncclSuccess);
  Handle h;
  void *lc = nullptr, *rc = nullptr;
  ASSERT_EQ(p.v11->listen(ctx, 0, h, &lc), ncclSuccess);
  ASSERT_TRUE(write_all(child.to_child, h, sizeof(h)));
  p.inject(KVXFER_NET_FAULT_ACCEPT_BAD_ALLOC);
  rc = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(p.v11->accept(lc, &rc, nullptr), ncclSystemError);
  EXPECT_EQ(rc, nullptr);
  EXPECT_TRUE(logged(NCCL_LOG_WARN, "accept: out of memory"));
  ASSERT_EQ(accept_until(p.v11, lc, &rc), ncclSuccess);
  std::vector<uint8_t> b(5000);
  void* d = b.data();
  size_t c = b.size();
  int tag = 0;
  void* req = nullptr;
  ASSERT_EQ(irecv_until(p.v11, rc, 1, &d, &c, &tag, &req), ncclSuccess);
  ASSERT_EQ(wait_done(p.v11, req, nullptr), ncclSuccess);
  EXPECT_EQ(first_mismatch(b.data(), b.size(), 31), -1);
  send_token(child.to_child, 1);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
  p.v11->closeRecv(rc);
  p.v11->closeListen(lc);
  p.v11->finalize(ctx);
}

// 4. Errors from test() that are swallowed: a message larger than its
// receive fails that receive, every time it is tested, with a WARN through
// NCCL's logger; the comm fails with it (later calls on it return the error);
// bogus requests fail too.
// Connects and accepts in this thread, alternating calls (as NCCL's GDR probe does).
::testing::AssertionResult connect_accept(const Plugin& p, void* ctx, void* handle, void* lc,
                                          void** sc, void** rc) {
  *sc = *rc = nullptr;
  const auto t0 = Clock::now();
  while ((*sc == nullptr || *rc == nullptr) && since(t0) < 10) {
    if (*sc == nullptr && p.v11->connect(ctx, 0, handle, sc, nullptr) != ncclSuccess)
      return ::testing::AssertionFailure() << "connect failed";
    if (*rc == nullptr && p.v11->accept(lc, rc, nullptr) != ncclSuccess)
      return ::testing::AssertionFailure() << "accept failed";
  }
  if (*sc == nullptr || *rc == nullptr) return ::testing::AssertionFailure() << "timed out";
  return ::testing::AssertionSuccess();
}

// One context with a listen comm, and the send and recv comms of a
// connection to it made in this thread (open()).  The destructor closes
// what is still open (a test that closes a comm itself sets it to null).
struct SelfComms {
  const Plugin& p = plug();
  void *ctx = nullptr, *lc = nullptr, *sc = nullptr, *rc = nullptr;
  Handle h{};
  ::testing::AssertionResult listen() {
    if (init_ctx(p, 0, &ctx) != ncclSuccess || p.v11->listen(ctx, 0, h, &lc) != ncclSuccess)
      return ::testing::AssertionFailure() << "init or listen failed";
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult open() {
    ::testing::AssertionResult r = listen();
    return r ? connect_accept(p, ctx, h, lc, &sc, &rc) : r;
  }
  /** Sends `msg` on sc with `tag`, receives it on rc: what arrived. */
  std::string exchange(const std::string& msg, int tag) {
    char buf[256] = {};
    void* data = buf;
    size_t cap = sizeof(buf);
    void *rreq = nullptr, *sreq = nullptr;
    int size = -1;
    if (irecv_until(p.v11, rc, 1, &data, &cap, &tag, &rreq) != ncclSuccess ||
        isend_until(p.v11, sc, const_cast<char*>(msg.data()), msg.size(), tag, &sreq) !=
            ncclSuccess ||
        wait_done(p.v11, rreq, &size) != ncclSuccess || size < 0)
      return "<no message>";
    return std::string(buf, static_cast<size_t>(size));
  }
  ~SelfComms() {
    if (sc != nullptr) EXPECT_EQ(p.v11->closeSend(sc), ncclSuccess);
    if (rc != nullptr) EXPECT_EQ(p.v11->closeRecv(rc), ncclSuccess);
    if (lc != nullptr) EXPECT_EQ(p.v11->closeListen(lc), ncclSuccess);
    if (ctx != nullptr) EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);
  }
};

// Someone who is not the peer, sending one tagged message to the address in
// a listen handle with raw libfabric, as anyone who can reach it can.  `pump`
// drives the plugin's side meanwhile (its provider makes progress only in
// the plugin's calls).
bool stranger_sends(const netplugin::Handle& h, const std::string& text, uint64_t tag,
                    const std::function<void()>& pump) {
  fi_info* hints = fi_allocinfo();
  hints->caps = FI_MSG | FI_TAGGED;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode = 0;
  hints->fabric_attr->prov_name = strndup(h.provider, h.provider_len);
  fi_info* info = nullptr;
  bool ok = fi_getinfo(FI_VERSION(1, 17), "127.0.0.1", nullptr, FI_SOURCE, hints, &info) == 0;
  fi_freeinfo(hints);
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_av* av = nullptr;
  fid_cq* cq = nullptr;
  fid_ep* ep = nullptr;
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_TAGGED;
  ok = ok && fi_fabric(info->fabric_attr, &fabric, nullptr) == 0 &&
       fi_domain(fabric, info, &domain, nullptr) == 0 &&
       fi_av_open(domain, &av_attr, &av, nullptr) == 0 &&
       fi_cq_open(domain, &cq_attr, &cq, nullptr) == 0 &&
       fi_endpoint(domain, info, &ep, nullptr) == 0 && fi_ep_bind(ep, &av->fid, 0) == 0 &&
       fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV) == 0 && fi_enable(ep) == 0;
  fi_addr_t dest = FI_ADDR_UNSPEC;
  ok = ok && fi_av_insert(av, h.name, 1, &dest, 0, nullptr) == 1;
  fi_context2 ctx{};
  const auto t0 = Clock::now();
  ssize_t r = -FI_EAGAIN;
  while (ok && r == -FI_EAGAIN && since(t0) < 10) {
    r = fi_tsend(ep, text.data(), text.size(), nullptr, dest, tag, &ctx);
    if (r == -FI_EAGAIN) fi_cq_read(cq, nullptr, 0);
    pump();
  }
  ok = ok && r == 0;
  fi_cq_tagged_entry done{};
  while (ok && fi_cq_read(cq, &done, 1) != 1 && since(t0) < 10) pump();
  ok = ok && done.op_context == &ctx;
  if (ep != nullptr) fi_close(&ep->fid);
  if (av != nullptr) fi_close(&av->fid);
  if (cq != nullptr) fi_close(&cq->fid);
  if (domain != nullptr) fi_close(&domain->fid);
  if (fabric != nullptr) fi_close(&fabric->fid);
  if (info != nullptr) fi_freeinfo(info);
  return ok;
}

// 5. Someone who is not the accepted peer sends to the recv comm's address
// (the listen handle's) with the tag of the next message: the receive is
// not theirs.  It takes the peer's message, byte for byte.
TEST(NetPluginFailureModes, AStrangerCannotPutDataIntoARecvComm) {
  SelfComms c;
  ASSERT_TRUE(c.open());
  netplugin::Handle hh;
  std::memcpy(&hh, c.h, sizeof(hh));
  char buf[64] = {};
  void* data = buf;
  size_t cap = sizeof(buf);
  int tag = 7;
  void *rreq = nullptr, *sreq = nullptr;
  ASSERT_EQ(irecv_until(c.p.v11, c.rc, 1, &data, &cap, &tag, &rreq), ncclSuccess);
  int done = 0, size = -1;
  ncclResult_t tr = ncclSuccess;
  auto pump = [&] {
    if (!done && tr == ncclSuccess) tr = c.p.v11->test(rreq, &done, &size);
  };
  ASSERT_TRUE(stranger_sends(hh, "EVIL from a stranger", netplugin::data_tag(7, 0), pump));
  const auto t0 = Clock::now();
  while (since(t0) < 0.5) pump();
  ASSERT_EQ(tr, ncclSuccess);
  EXPECT_FALSE(done) << "the receive took a stranger's message: \"" << buf << "\"";
  std::string good = "the peer's own message";
  ASSERT_EQ(isend_until(c.p.v11, c.sc, good.data(), good.size(), 7, &sreq), ncclSuccess);
  ASSERT_EQ(wait_done(c.p.v11, sreq, nullptr), ncclSuccess);
  if (!done) {
    ASSERT_EQ(wait_done(c.p.v11, rreq, &size), ncclSuccess);
  }
  EXPECT_EQ(size, static_cast<int>(good.size()));
  EXPECT_EQ(std::string(buf, good.size()), good);
}

// 6. A connect request that is not for this listen (a stale or corrupted
// handle: another listen id) is refused and logged; the listen waits on and
// accepts its own peer.
TEST(NetPluginFailureModes, AStrayConnectRequestLeavesTheListenWaitingForItsPeer) {
  SelfComms c;
  ASSERT_TRUE(c.listen());
  Handle stale;
  void* bad = nullptr;
  std::memcpy(stale, c.h, sizeof(stale));
  stale[offsetof(netplugin::Handle, listen_id)] ^= 0x10;
  const auto t0 = Clock::now();
  while (!logged(NCCL_LOG_WARN, "refused a connect request") && since(t0) < 10) {
    ASSERT_EQ(c.p.v11->connect(c.ctx, 0, stale, &bad, nullptr), ncclSuccess);
    ASSERT_EQ(bad, nullptr);
    ASSERT_EQ(c.p.v11->accept(c.lc, &c.rc, nullptr), ncclSuccess);
    ASSERT_EQ(c.rc, nullptr);
  }
  ASSERT_TRUE(logged(NCCL_LOG_WARN,
                     "refused a connect request that is not for this listen "
                     "(another listen id); still waiting"));
  ASSERT_TRUE(connect_accept(c.p, c.ctx, c.h, c.lc, &c.sc, &c.rc));
  EXPECT_EQ(c.exchange("after a stray connect", 1), "after a stray connect");
}

// 7. A handle whose stage names another handle's connection attempt (a
// copied or corrupted handle) fails its connect, naming that; the other
// handle's attempt goes on, and the first connects afresh.
TEST(NetPluginFailureModes, AHandleNamingAnotherHandlesAttemptIsRefused) {
  const Plugin& p = plug();
  void* ctx = nullptr;
  ASSERT_EQ(init_ctx(p, 0, &ctx), ncclSuccess);
  Handle ha, hb;
  void *la = nullptr, *lb = nullptr, *sa = nullptr, *sb = nullptr, *ra = nullptr, *rb = nullptr;
  ASSERT_EQ(p.v11->listen(ctx, 0, ha, &la), ncclSuccess);
  ASSERT_EQ(p.v11->listen(ctx, 0, hb, &lb), ncclSuccess);
  ASSERT_EQ(p.v11->connect(ctx, 0, ha, &sa, nullptr), ncclSuccess);
  ASSERT_EQ(sa, nullptr) << "a connect cannot finish in one call";
  std::memcpy(hb + netplugin::kHandleStageOffset, ha + netplugin::kHandleStageOffset, 8);
  EXPECT_EQ(p.v11->connect(ctx, 0, hb, &sb, nullptr), ncclInvalidArgument);
  EXPECT_EQ(sb, nullptr);
  EXPECT_TRUE(logged(NCCL_LOG_WARN, "the handle names the connection attempt of another handle"));
  ASSERT_TRUE(connect_accept(p, ctx, ha, la, &sa, &ra));
  ASSERT_TRUE(connect_accept(p, ctx, hb, lb, &sb, &rb));
  void* nothing = nullptr;
  EXPECT_EQ(p.v11->accept(la, &nothing, nullptr), ncclInternalError);  // A accepted once
  for (void* c : {sa, sb}) EXPECT_EQ(p.v11->closeSend(c), ncclSuccess);
  for (void* c : {ra, rb}) EXPECT_EQ(p.v11->closeRecv(c), ncclSuccess);
  for (void* c : {la, lb}) EXPECT_EQ(p.v11->closeListen(c), ncclSuccess);
  EXPECT_EQ(p.v11->finalize(ctx), ncclSuccess);
}

// 8. Pointers NCCL should no longer hold (a closed comm, a request of one,
// a garbage registration) are refused without being read: a comm here is
// mapped memory of its own (M_MMAP_THRESHOLD), which its close unmaps.  The
// threshold stays for the rest of the process: ctest runs each case alone.
TEST(NetPluginFailureModes, ClosedCommsAndGarbageHandlesAreRefusedWithoutBeingRead) {
  // Under AddressSanitizer mallopt does nothing (returns 0): ASan's own
  // allocator reports a read of freed memory instead.
  (void)mallopt(M_MMAP_THRESHOLD, 32 * 1024);
  SelfComms c;
  ASSERT_TRUE(c.open());
  const ncclNet_v11_t* net = c.p.v11;
  void *sc = c.sc, *rc = c.rc, *lc = c.lc;
  char buf[16];
  void* data = buf;
  size_t cap = sizeof(buf);
  int tag = 0, done = -1;
  void* rreq = nullptr;
  ASSERT_EQ(irecv_until(net, rc, 1, &data, &cap, &tag, &rreq), ncclSuccess);
  void* garbage = reinterpret_cast<void*>(0x10);
  void* sreq = nullptr;
  EXPECT_EQ(net->isend(sc, buf, 1, 0, garbage, nullptr, &sreq), ncclInvalidArgument);
  EXPECT_EQ(net->irecv(rc, 1, &data, &cap, &tag, &garbage, nullptr, &sreq), ncclInvalidArgument);
  EXPECT_EQ(net->test(garbage, &done, nullptr), ncclInvalidArgument);
  EXPECT_EQ(net->accept(garbage, &sreq, nullptr), ncclInvalidArgument);
  ASSERT_EQ(net->closeRecv(rc), ncclSuccess);
  c.rc = nullptr;
  EXPECT_EQ(net->test(rreq, &done, nullptr), ncclInvalidArgument);
  EXPECT_EQ(done, 0);
  EXPECT_EQ(net->closeRecv(rc), ncclInvalidArgument);
  EXPECT_EQ(net->irecv(rc, 1, &data, &cap, &tag, nullptr, nullptr, &sreq), ncclInvalidArgument);
  ASSERT_EQ(net->closeListen(lc), ncclSuccess);
  c.lc = nullptr;
  EXPECT_EQ(net->closeListen(lc), ncclInvalidArgument);
  EXPECT_EQ(net->accept(lc, &sreq, nullptr), ncclInvalidArgument);
  EXPECT_EQ(net->closeSend(sc), ncclSuccess);
  c.sc = nullptr;
  EXPECT_EQ(net->closeSend(sc), ncclInvalidArgument);
}

TEST(NetPluginFailureModes, ErrorsFromTestAreReturnedEveryTime) {
  const Plugin& p = plug();
  Child child;
  ASSERT_TRUE(child.start([&](int rd, int wr) -> int {
    void *ctx = nullptr, *sc = nullptr;
    CHILD_REQUIRE(child_connect(p, 0, rd, &ctx, &sc));
    std::vector<uint8_t> big(1000, 1);
    void* req = nullptr;
    CHILD_REQUIRE(isend_until(p.v11, sc, big.data(), big.size(), 1, &req) == ncclSuccess);
    (void)wait_done(p.v11, req, nullptr, 10);  // its fate is the receiver's concern
    CHILD_REQUIRE(expect_token(rd, 1));
    p.v11->closeSend(sc);
    p.v11->finalize(ctx);
    (void)wr;
    return 0;
  }));
  Receiver r;
  ASSERT_TRUE(listen_accept(p, 0, child.to_child, &r));
  std::vector<uint8_t> buf(100, 0);
  void* d = buf.data();
  size_t c = buf.size();
  int tag = 1;
  void* req = nullptr;
  ASSERT_EQ(irecv_until(p.v11, r.rc, 1, &d, &c, &tag, &req), ncclSuccess);
  const ncclResult_t first = wait_done(p.v11, req, nullptr);
  EXPECT_EQ(first, ncclInternalError) << "a truncated receive must fail";
  for (int i = 0; i < 3; ++i) {
    int done = 1;
    EXPECT_EQ(p.v11->test(req, &done, nullptr), ncclInternalError) << "error swallowed";
    EXPECT_EQ(done, 0);
  }
  EXPECT_TRUE(logged(NCCL_LOG_WARN, "truncated"));
  // The comm failed with it: new work is refused with the same error.
  void* req2 = nullptr;
  EXPECT_EQ(p.v11->irecv(r.rc, 1, &d, &c, &tag, nullptr, nullptr, &req2), ncclInternalError);
  EXPECT_EQ(req2, nullptr);
  // Requests that are not in flight.
  int done = 1;
  EXPECT_EQ(p.v11->test(nullptr, &done, nullptr), ncclInvalidArgument);
  int bogus[64] = {0};
  EXPECT_EQ(p.v11->test(bogus, &done, nullptr), ncclInvalidArgument);
  send_token(child.to_child, 1);
  ASSERT_TRUE(child.wait(30));
  EXPECT_TRUE(WIFEXITED(child.status) && WEXITSTATUS(child.status) == 0);
}

// ===========================================================================
// Environment (each case in a child with a fresh copy of the plugin, since
// KVXFER_* variables are read once per instance)
// ===========================================================================
int run_in_fresh_instance(const std::vector<std::pair<const char*, const char*>>& env,
                          const std::function<int(const Plugin&)>& fn) {
  Child child;
  if (!child.start([&](int, int) -> int {
        for (const auto& kv : env) setenv(kv.first, kv.second, 1);
        const std::string copy = copy_plugin(KVXFER_NET_PLUGIN_TEST_PATH);
        if (copy.empty()) return 90;
        const Plugin p = load_plugin(copy.c_str());
        unlink(copy.c_str());
        if (p.v11 == nullptr) return 91;
        return fn(p);
      }))
    return -1;
  if (!child.wait(60)) return -2;
  return WIFEXITED(child.status) ? WEXITSTATUS(child.status) : -3;
}

TEST(NetPluginEnv, MalformedClassMapFailsInitNamingIt) {
  EXPECT_EQ(
      run_in_fresh_instance({{"KVXFER_NET_TC_MAP", "0=FAST"}},
                            [](const Plugin& p) -> int {
                              void* ctx = reinterpret_cast<void*>(0x1);
                              CHILD_REQUIRE(init_ctx(p, 0, &ctx) == ncclInvalidArgument);
                              CHILD_REQUIRE(ctx == nullptr);
                              CHILD_REQUIRE(logged(NCCL_LOG_WARN, "KVXFER_NET_TC_MAP='0=FAST'"));
                              CHILD_REQUIRE(p.v11->finalize(ctx) == ncclSuccess);
                              return 0;
                            }),
      0);
  EXPECT_EQ(
      run_in_fresh_instance({{"KVXFER_TIMEOUT_MS", "soon"}},
                            [](const Plugin& p) -> int {
                              void* ctx = nullptr;
                              CHILD_REQUIRE(init_ctx(p, 0, &ctx) == ncclInvalidArgument);
                              CHILD_REQUIRE(logged(NCCL_LOG_WARN, "KVXFER_TIMEOUT_MS='soon'"));
                              return 0;
                            }),
      0);
  EXPECT_EQ(run_in_fresh_instance({{"KVXFER_OFI_PROVIDER", "nosuchprovider"}},
                                  [](const Plugin& p) -> int {
                                    void* ctx = nullptr;
                                    CHILD_REQUIRE(init_ctx(p, 0, &ctx) == ncclInvalidArgument);
                                    CHILD_REQUIRE(logged(NCCL_LOG_WARN, "nosuchprovider"));
                                    return 0;
                                  }),
            0);
  EXPECT_EQ(run_in_fresh_instance({{"KVXFER_NET_IF", "lo,nosuchif0"}},
                                  [](const Plugin& p) -> int {
                                    void* ctx = nullptr;
                                    CHILD_REQUIRE(init_ctx(p, 0, &ctx) == ncclInvalidArgument);
                                    CHILD_REQUIRE(logged(NCCL_LOG_WARN, "'nosuchif0'"));
                                    return 0;
                                  }),
            0);
}

// KVXFER_OFI_PROVIDER=tcp resolves to tcp;ofi_rxm, the name a listen handle
// carries: a connect compares the resolved names.
TEST(NetPluginEnv, AProviderNamedShortConnects) {
  EXPECT_EQ(run_in_fresh_instance({{"KVXFER_OFI_PROVIDER", "tcp"}},
                                  [](const Plugin& p) -> int {
                                    void* ctx = nullptr;
                                    CHILD_REQUIRE(init_ctx(p, 0, &ctx) == ncclSuccess);
                                    Handle h;
                                    void *lc = nullptr, *sc = nullptr, *rc = nullptr;
                                    CHILD_REQUIRE(p.v11->listen(ctx, 0, h, &lc) == ncclSuccess);
                                    CHILD_REQUIRE(connect_accept(p, ctx, h, lc, &sc, &rc));
                                    p.v11->closeSend(sc);
                                    p.v11->closeRecv(rc);
                                    p.v11->closeListen(lc);
                                    return 0;
                                  }),
            0);
}

TEST(NetPluginEnv, CustomClassMapSetsTclassAndDscp) {
  EXPECT_EQ(run_in_fresh_instance({{"KVXFER_NET_TC_MAP", "7=DSCP/26,0=anchor,*=SCAVENGER"}},
                                  [](const Plugin& p) -> int {
                                    void *c7 = nullptr, *c3 = nullptr, *c0 = nullptr;
                                    CHILD_REQUIRE(init_ctx(p, 7, &c7) == ncclSuccess);
                                    CHILD_REQUIRE(init_ctx(p, 3, &c3) == ncclSuccess);
                                    CHILD_REQUIRE(init_ctx(p, 0, &c0) == ncclSuccess);
                                    void *l7 = nullptr, *l3 = nullptr, *l0 = nullptr;
                                    Handle h;
                                    CHILD_REQUIRE(p.v11->listen(c7, 0, h, &l7) == ncclSuccess);
                                    CHILD_REQUIRE(p.v11->listen(c3, 0, h, &l3) == ncclSuccess);
                                    CHILD_REQUIRE(p.v11->listen(c0, 0, h, &l0) == ncclSuccess);
                                    kvxfer_net_test_info_t i7, i3, i0;
                                    CHILD_REQUIRE(p.comm_info(l7, &i7) == 0 &&
                                                  p.comm_info(l3, &i3) == 0 &&
                                                  p.comm_info(l0, &i0) == 0);
                                    CHILD_REQUIRE(i7.tclass == (FI_TC_DSCP | 26) && i7.dscp == 26);
                                    CHILD_REQUIRE(i3.tclass == FI_TC_SCAVENGER && i3.dscp == -1);
                                    CHILD_REQUIRE(i0.tclass == FI_TC_LOW_LATENCY && i0.dscp == 46);
                                    // The listener socket already carries the DSCP.
                                    for (const SockInfo& s : sockets_of(i7))
                                      CHILD_REQUIRE((s.tos >> 2) == 26);
                                    p.v11->closeListen(l7);
                                    p.v11->closeListen(l3);
                                    p.v11->closeListen(l0);
                                    return 0;
                                  }),
            0);
}

// The transport layer's own lines reach NCCL's logger (here at
// KVXFER_DEBUG=INFO, which lets them through the layer's own filter).
TEST(NetPluginEnv, TransportLogsReachNcclLogger) {
  EXPECT_EQ(
      run_in_fresh_instance({{"KVXFER_DEBUG", "INFO"}},
                            [](const Plugin& p) -> int {
                              void* ctx = nullptr;
                              CHILD_REQUIRE(init_ctx(p, 0, &ctx) == ncclSuccess);
                              CHILD_REQUIRE(logged(NCCL_LOG_INFO, "NET/kvxfer : OFI : provider"));
                              return 0;
                            }),
      0);
}

// A NIC on PCI (where the machine has one): pciPath comes from hwloc and is
// the sysfs path of its PCI function.
TEST(NetPluginEnv, PciPathOfARealNic) {
  std::string nic, real;
  if (DIR* dir = opendir("/sys/class/net")) {
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] == '.') continue;
      char buf[4096];
      const std::string link = std::string("/sys/class/net/") + e->d_name + "/device";
      if (realpath(link.c_str(), buf) == nullptr) continue;
      std::ifstream op(std::string("/sys/class/net/") + e->d_name + "/operstate");
      std::string state;
      op >> state;
      if (state != "up") continue;
      nic = e->d_name;
      real = buf;
      break;
    }
    closedir(dir);
  }
  if (nic.empty()) GTEST_SKIP() << "no network interface on PCI that is up";
  EXPECT_EQ(run_in_fresh_instance({{"KVXFER_NET_IF", nic.c_str()}},
                                  [&](const Plugin& p) -> int {
                                    void* ctx = nullptr;
                                    CHILD_REQUIRE(init_ctx(p, 0, &ctx) == ncclSuccess);
                                    ncclNetProperties_v11_t props;
                                    CHILD_REQUIRE(p.v11->getProperties(0, &props) == ncclSuccess);
                                    CHILD_REQUIRE(props.pciPath != nullptr);
                                    std::fprintf(stderr, "%s: pciPath %s, sysfs %s\n", nic.c_str(),
                                                 props.pciPath, real.c_str());
                                    const std::string path = props.pciPath;
                                    CHILD_REQUIRE(real.compare(0, path.size(), path) == 0);
                                    CHILD_REQUIRE(path.compare(0, 16, "/sys/devices/pci") == 0);
                                    return 0;
                                  }),
            0);
}

}  // namespace
}  // namespace kvxfer::test
