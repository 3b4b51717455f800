#include "net_plugin/net.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <rdma/fi_errno.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/error.h"
#include "common/params.h"
#include "net_plugin/devices.h"
#include "net_plugin/handle.h"
#include "net_plugin/log.h"
#include "net_plugin/tcmap.h"
#include "net_plugin/topo.h"
#include "transport/dscp.h"
#include "transport/ofi.h"

namespace kvxfer::netplugin {

using Clock = std::chrono::steady_clock;
using transport::Domain;
using transport::Endpoint;

namespace {

// ---------------------------------------------------------------------------
// Wire messages of the connection handshake (control tags: bit 62 set).
// ---------------------------------------------------------------------------
constexpr uint64_t kTagConnectRequest = kCtrlTagBit | 1;
constexpr uint64_t kTagConnectAck = kCtrlTagBit | 2;
constexpr uint32_t kRequestMagic = 0x5258564B;  // "KVXR"
constexpr uint32_t kAckMagic = 0x4158564B;      // "KVXA"
constexpr uint16_t kWireVersion = 1;

struct ConnectRequest {
  uint32_t magic;
  uint16_t version;
  uint16_t name_len;
  uint64_t listen_id;  // from the handle: proves which listen this is for
  int32_t nccl_class;  // the connecting side's class (-1: not set)
  uint32_t tclass;
  int32_t dscp;
  uint32_t reserved;
  uint8_t name[96];  // the connecting endpoint's address
};
struct ConnectAck {
  uint32_t magic;
  uint32_t reserved;
  uint64_t listen_id;
};

// Magic numbers at the start of every object NCCL holds a pointer to, checked
// on each call; cleared when the object is freed.
constexpr uint32_t kSendMagic = 0x53504E4B;    // "KNPS"
constexpr uint32_t kRecvMagic = 0x52504E4B;    // "KNPR"
constexpr uint32_t kListenMagic = 0x4C504E4B;  // "KNPL"
constexpr uint32_t kReqMagic = 0x51504E4B;     // "KNPQ"
constexpr uint32_t kMrMagic = 0x4D504E4B;      // "KNPM"
constexpr uint32_t kDeadMagic = 0xDEADDEAD;

ncclResult_t fail(ncclResult_t code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t fail(ncclResult_t code, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  NP_WARN("%s", msg);
  return code;
}

/** Provider errors that mean the peer or the connection is gone. */
bool is_remote_error(int err) {
  switch (err) {
    case ECANCELED:
    case ECONNRESET:
    case ECONNABORTED:
    case ECONNREFUSED:
    case ENOTCONN:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ETIMEDOUT:
    case ESHUTDOWN:
    case EIO: return true;
    default: return false;
  }
}

std::string addr_string(const std::vector<uint8_t>& name) {
  if (!transport::is_inet_sockaddr(name.data(), name.size())) return "(non-IP address)";
  char host[64] = "?";
  const auto* sa = reinterpret_cast<const sockaddr*>(name.data());
  unsigned port = 0;
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    return strprintf("%s:%u", host, port);
  }
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
  inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
  port = ntohs(in6->sin6_port);
  return strprintf("[%s]:%u", host, port);
}

// ---------------------------------------------------------------------------
// Contexts and the process-wide state
// ---------------------------------------------------------------------------
struct Context {
  uint64_t id = 0;
  uint64_t comm_id = 0;
  ClassSettings cls;
};

struct CtlOp {
  fi_context2 fi;  // first: the provider's scratch space
  int kind;
};

struct PendingConnect {
  uint64_t id = 0;
  std::shared_ptr<Context> ctx;
  int dev = 0;
  ClassSettings cls;
  std::unique_ptr<Endpoint> ep;
  fi_addr_t peer = FI_ADDR_UNSPEC;
  std::vector<uint8_t> peer_name;
  uint64_t listen_id = 0;
  ConnectRequest req{};
  ConnectAck ack{};
  CtlOp req_op{}, ack_op{};
  bool req_posted = false, req_done = false, ack_done = false;
  Clock::time_point started;
};

struct Global {
  std::mutex mu;
  // Discovered once, by the first init().
  bool discovered = false;
  ncclResult_t discover_result = ncclSuccess;
  std::vector<NetDevice> devices;
  std::string provider;  // the provider a probe domain resolved to
  bool provider_hmem = false;
  TcMap tcmap;
  int64_t timeout_ms = 30000;
  int max_comms = 0;
  // Live objects.
  std::unordered_map<uint64_t, std::shared_ptr<Context>> contexts;
  uint64_t next_ctx = 1;
  std::unordered_map<uint64_t, std::unique_ptr<PendingConnect>> pending;
  uint64_t next_pending = 1;
  // Every comm and registration NCCL holds a pointer to, until its close or
  // deregMr (under live_mu, not mu: read on every isend, irecv and test, from
  // NCCL's proxy threads at once): a pointer is looked up here before it is
  // read, so a closed or garbage one is an error, not a read of freed memory.
  std::shared_mutex live_mu;
  std::unordered_set<const void*> live_data;    // DataComm
  std::unordered_set<const void*> live_listen;  // ListenComm
  std::unordered_set<const void*> live_mrs;     // MemHandle
  std::map<uintptr_t, const void*> live_reqs;   // a DataComm's request array -> the DataComm
  std::mt19937_64 rng{std::random_device{}()};
};

Global& g() {
  static Global* s = new Global();  // never destroyed: comms NCCL still holds may refer to it
  return *s;
}

std::shared_ptr<Context> find_context(void* ctx) {
  const uint64_t id = reinterpret_cast<uintptr_t>(ctx);
  std::lock_guard<std::mutex> lk(g().mu);
  auto it = g().contexts.find(id);
  return it == g().contexts.end() ? nullptr : it->second;
}

using LiveSet = std::unordered_set<const void*> Global::*;
bool is_live(LiveSet set, const void* p) {
  std::shared_lock<std::shared_mutex> lk(g().live_mu);
  return p != nullptr && (g().*set).count(p) != 0;
}
void set_live(LiveSet set, const void* p, bool live) {
  std::unique_lock<std::shared_mutex> lk(g().live_mu);
  if (live)
    (g().*set).insert(p);
  else
    (g().*set).erase(p);
}

ncclResult_t discover_locked() {
  Global& s = g();
  if (s.discovered) return s.discover_result;
  s.discovered = true;
  s.discover_result = ncclInternalError;
  if (params::validate() != KVXFER_SUCCESS)
    return s.discover_result = fail(ncclInvalidArgument, "%s", last_error());
  std::string why;
  if (!TcMap::parse(params::NetTcMap(), TcMap::presets_from_params(), &s.tcmap, &why))
    return s.discover_result = fail(ncclInvalidArgument, "KVXFER_NET_TC_MAP='%s' %s",
                                    params::NetTcMap().c_str(), why.c_str());
  s.timeout_ms = params::TimeoutMs();
  std::unique_ptr<Topology> topo;
  if (Topology::load_system(&topo) != KVXFER_SUCCESS) {
    NP_INFO(NCCL_INIT | NCCL_NET, "hwloc topology unavailable (%s); no PCI paths", last_error());
    topo.reset();
  }
  if (choose_devices(list_interfaces(), params::NetIf(), topo.get(), &s.devices) != KVXFER_SUCCESS)
    return s.discover_result = fail(ncclInvalidArgument, "%s", last_error());
  // Open the provider once on the first device: the provider must exist here,
  // and its capabilities decide ptrSupport.
  std::shared_ptr<Domain> probe;
  // With FI_DIRECTED_RECV, as every comm's endpoint asks (net_listen): a
  // provider without it fails here, by name, not at the first listen.
  const kvxfer_result_t rc =
      Domain::open(params::OfiProvider(), s.devices[0].address, &probe, /*directed_recv=*/true);
  if (rc != KVXFER_SUCCESS)  // a named provider that is missing is a bad setting
    return s.discover_result =
               fail(rc == KVXFER_ERR_INVALID_ARGUMENT ? ncclInvalidArgument : ncclSystemError,
                    "no libfabric provider on %s (%s): %s", s.devices[0].ifname.c_str(),
                    s.devices[0].address.c_str(), last_error());
  s.provider = probe->provider();
  s.provider_hmem = (probe->info()->caps & FI_HMEM) != 0;
  probe.reset();
  rlimit nofile{};
  const rlim_t fds = getrlimit(RLIMIT_NOFILE, &nofile) == 0 ? nofile.rlim_cur : 1024;
  // Each comm holds an endpoint listener, its connections and a few pipes.
  s.max_comms = static_cast<int>(std::min<rlim_t>(65536, std::max<rlim_t>(1, fds / 4)));
  for (size_t i = 0; i < s.devices.size(); ++i) {
    const NetDevice& d = s.devices[i];
    NP_INFO(NCCL_INIT | NCCL_NET, "device %zu: %s %s, PCI %s, %d Mbit/s%s", i, d.ifname.c_str(),
            d.address.c_str(), d.pci_path.empty() ? "(none)" : d.pci_path.c_str(), d.speed_mbps,
            d.local ? ", local to this process's CPUs" : "");
  }
  NP_INFO(NCCL_INIT | NCCL_NET,
          "provider %s%s; KVXFER_NET_TC_MAP='%s'; timeout %lld ms; pointers: host only "
          "(the libfabric layer opens domains without FI_HMEM)",
          s.provider.c_str(), s.provider_hmem ? " (offers FI_HMEM)" : "", s.tcmap.text().c_str(),
          static_cast<long long>(s.timeout_ms));
  return s.discover_result = ncclSuccess;
}

ncclResult_t check_dev(int dev) {
  std::lock_guard<std::mutex> lk(g().mu);
  if (!g().discovered || g().discover_result != ncclSuccess)
    return fail(ncclInternalError, "device %d used before a successful init()", dev);
  if (dev < 0 || static_cast<size_t>(dev) >= g().devices.size())
    return fail(ncclInvalidArgument, "device %d does not exist (%zu devices)", dev,
                g().devices.size());
  return ncclSuccess;
}

NetDevice device(int dev) {
  std::lock_guard<std::mutex> lk(g().mu);
  return g().devices[static_cast<size_t>(dev)];
}

// Marks this endpoint's sockets (its listener and accepted connections by
// local address, the connections it made by the peer's address).
void mark_sockets(const Endpoint& ep, const std::vector<uint8_t>* peer, int dscp,
                  const char* what) {
  if (dscp < 0) return;
  const std::vector<uint8_t>& me = ep.name();
  if (!transport::is_inet_sockaddr(me.data(), me.size())) {
    NP_INFO(NCCL_NET, "%s: provider addresses are not sockaddrs; DSCP %d not applied", what, dscp);
    return;
  }
  const sockaddr* peer_sa = nullptr;
  if (peer != nullptr && transport::is_inet_sockaddr(peer->data(), peer->size()))
    peer_sa = reinterpret_cast<const sockaddr*>(peer->data());
  const auto marked =
      transport::mark_matching_sockets(reinterpret_cast<const sockaddr*>(me.data()), peer_sa, dscp);
  int ok = 0;
  for (const auto& m : marked)
    if (m.tos_after >= 0 && (m.tos_after >> 2) == dscp) ++ok;
  NP_INFO(NCCL_NET, "%s: DSCP %d on %d of %zu socket(s) of %s", what, dscp, ok, marked.size(),
          addr_string(me).c_str());
}

// Whether the TCP connection between this endpoint and its peer still exists:
// some socket of this process that is connected (not listening) and whose
// local address is the endpoint's (a connection the peer made) or whose peer
// address is the peer endpoint's (one this side made) is ESTABLISHED.
// libfabric 1.17's rxm never completes a rendezvous send whose receiver died,
// and answers -FI_EAGAIN forever to sends to a closed endpoint; this is how
// the plugin notices (docs/NET_PLUGIN.md, "Failure detection").
// *known is false when the answer cannot be told (non-socket addresses, or no
// TCP socket found at all, e.g. a UDP provider).
bool peer_connected(const Endpoint& ep, const std::vector<uint8_t>& peer, bool* known) {
  *known = false;
  const std::vector<uint8_t>& me = ep.name();
  if (!transport::is_inet_sockaddr(me.data(), me.size()) ||
      !transport::is_inet_sockaddr(peer.data(), peer.size()))
    return true;
  const auto socks =
      transport::mark_matching_sockets(reinterpret_cast<const sockaddr*>(me.data()),
                                       reinterpret_cast<const sockaddr*>(peer.data()), -1);
  bool any_tcp = false;
  for (const auto& m : socks) {
    if (m.type != SOCK_STREAM) continue;
    any_tcp = true;
    tcp_info ti{};
    socklen_t len = sizeof(ti);
    if (getsockopt(m.fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) continue;
    if (ti.tcpi_state == TCP_ESTABLISHED) {
      *known = true;
      return true;
    }
  }
  *known = any_tcp;
  return !any_tcp;
}

using transport::conn_socket_open;
using transport::ConnSocket;  // transport/dscp.h
using transport::ConnState;

ConnState find_conn_socket(const Endpoint& ep, const std::vector<uint8_t>& peer, ConnSocket* out) {
  return transport::find_conn_socket(ep.name(), peer, out);
}

// ---------------------------------------------------------------------------
// Data comms and requests
// ---------------------------------------------------------------------------
class DataComm;

enum class ReqKind : uint8_t { kFree, kSend, kRecv, kFlush };

struct Request;
struct SubOp {
  fi_context2 fi;  // first: the provider's scratch space
  Request* req;
  int index;
};

struct Request {
  uint32_t magic = kReqMagic;
  ReqKind kind = ReqKind::kFree;
  DataComm* comm = nullptr;
  int n = 0;
  int posted = 0;     // sub-operations the provider accepted
  int completed = 0;  // sub-operations completed (successfully or not)
  SubOp ops[kMaxRecvs];
  void* data[kMaxRecvs];
  size_t cap[kMaxRecvs];
  uint64_t ftag[kMaxRecvs];
  int nccl_tag[kMaxRecvs];
  size_t bytes[kMaxRecvs];
  ncclResult_t error = ncclSuccess;
  bool error_logged = false;
  std::string why;
};

struct MemHandle {
  uint32_t magic = kMrMagic;
  DataComm* comm = nullptr;
  void* data = nullptr;
  size_t size = 0;
  int type = 0;
};

class DataComm {
 public:
  DataComm(bool is_send, std::shared_ptr<Context> ctx, int dev, const ClassSettings& cls,
           std::unique_ptr<Endpoint> ep, fi_addr_t peer, std::vector<uint8_t> peer_name)
      : magic(is_send ? kSendMagic : kRecvMagic),
        ctx_(std::move(ctx)),
        dev_(dev),
        cls_(cls),
        ep_(std::move(ep)),
        peer_(peer),
        peer_name_(std::move(peer_name)) {
    last_activity_ = last_check_ = Clock::now();
    for (Request& r : reqs_) {
      r.comm = this;
      for (int i = 0; i < kMaxRecvs; ++i) {
        r.ops[i].req = &r;
        r.ops[i].index = i;
      }
    }
  }
  ~DataComm() { close(); }

  uint32_t magic;
  bool is_send() const { return magic == kSendMagic; }
  const char* kind() const { return is_send() ? "send" : "recv"; }
  const ClassSettings& cls() const { return cls_; }
  const Endpoint* ep() const { return ep_.get(); }
  const std::vector<uint8_t>& peer_name() const { return peer_name_; }
  int active() const { return active_; }
  /** The address of this comm's request array (the live_reqs key). */
  uintptr_t reqs_base() const { return reinterpret_cast<uintptr_t>(reqs_.data()); }
  /** Whether `p` is one of this comm's requests (compares addresses only). */
  bool owns_request(const void* p) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    return a >= reqs_base() && a < reinterpret_cast<uintptr_t>(reqs_.data() + reqs_.size()) &&
           (a - reqs_base()) % sizeof(Request) == 0;
  }

  /** Closes the endpoint: the provider never touches a posted buffer again. */
  void close() {
    if (ep_ && active_ > 0)
      NP_INFO(NCCL_NET, "%s comm to %s closed with %d request(s) in flight", kind(),
              addr_string(peer_name_).c_str(), active_);
    ep_.reset();
    for (MemHandle* m : mrs_) {
      set_live(&Global::live_mrs, m, false);
      m->magic = kDeadMagic;
      delete m;
    }
    mrs_.clear();
  }

  ncclResult_t failed() const { return failed_; }

  /** Sticky failure of the whole comm; every request reports it from now on. */
  void fail_comm(ncclResult_t code, const std::string& why) {
    if (failed_ != ncclSuccess) return;
    failed_ = code;
    fail_why_ = why;
    NP_WARN("%s comm to %s failed: %s", kind(), addr_string(peer_name_).c_str(), why.c_str());
  }
  ncclResult_t report_failure() const { return failed_; }  // fail_comm logged it
  const std::string& fail_why() const { return fail_why_; }

  Request* alloc(ReqKind kind) {
    if (active_ >= kRequestsPerComm) return nullptr;
    for (Request& r : reqs_) {
      if (r.kind != ReqKind::kFree) continue;
      r.kind = kind;
      r.n = r.posted = r.completed = 0;
      r.error = ncclSuccess;
      r.error_logged = false;
      r.why.clear();
      ++active_;
      return &r;
    }
    return nullptr;
  }
  void release(Request* r) {
    r->kind = ReqKind::kFree;
    --active_;
  }

  /** Reads completions and re-posts what the provider refused before. */
  void progress() {
    if (!ep_ || failed_ != ncclSuccess) return;
    transport::CqEvent evs[64];
    for (int round = 0; round < 16; ++round) {
      size_t n = 0;
      if (ep_->poll(evs, 64, &n) != KVXFER_SUCCESS) {
        fail_comm(ncclSystemError,
                  std::string("reading the completion queue failed: ") + last_error());
        return;
      }
      for (size_t i = 0; i < n; ++i) on_event(evs[i]);
      if (n > 0) last_activity_ = Clock::now();
      if (n < 64) break;
    }
    retry_unposted();
    check_liveness();
  }

  /** While work waits and nothing has moved for a second, is the peer still there? */
  void check_liveness() {
    if (failed_ != ncclSuccess || (active_ == 0 && !stalled_)) return;
    const Clock::time_point now = Clock::now();
    if (now - last_activity_ < kLivenessIdle || now - last_check_ < kLivenessIdle) return;
    last_check_ = now;
    bool known = false;
    if (!peer_connected(*ep_, peer_name_, &known) && known)
      fail_comm(ncclRemoteError,
                strprintf("the connection to %s is gone (the peer exited or closed its comm) "
                          "with %d request(s) in flight",
                          addr_string(peer_name_).c_str(), active_));
  }

  /**
   * Before posting receives: whether the provider still holds the connection
   * to the peer.  False (and the comm failed) once it is gone.
   *
   * libfabric 1.17's ofi_rxm frees a connection when it reads the peer's
   * shutdown (inside fi_cq_read) but leaves the messages that connection
   * delivered on the endpoint's unexpected-message queue.  A later fi_trecv
   * that matches such a rendezvous request (a large message the peer sent
   * before it died, no receive posted for it yet) looks the freed connection
   * up by index (rxm_handle_rndv -> ofi_idm_at on a released index-map chunk)
   * and crashes with SIGSEGV.  rxm closes the connection's socket and frees
   * the connection together, only while it progresses (never inside
   * fi_trecv), so a receive posted after the last poll while the socket is
   * still open can never meet a freed connection; once the socket is closed,
   * the comm fails instead of posting.
   */
  bool recv_conn_open() {
    if (!probe_conn_) return true;
    if (conn_sock_.fd >= 0 && conn_socket_open(conn_sock_)) return true;
    conn_sock_ = ConnSocket{};
    switch (find_conn_socket(*ep_, peer_name_, &conn_sock_)) {
      case ConnState::kOpen: return true;
      case ConnState::kUnknown: probe_conn_ = false; return true;  // cannot tell: post as before
      case ConnState::kGone: break;
    }
    fail_comm(ncclRemoteError,
              strprintf("the connection to %s is gone (the peer exited or closed its comm); "
                        "no more receives are posted on it, %d request(s) in flight",
                        addr_string(peer_name_).c_str(), active_));
    return false;
  }

  // ---- send side -------------------------------------------------------
  ncclResult_t isend(void* data, size_t size, int tag, void** request) {
    progress();
    if (failed_ != ncclSuccess) return report_failure();
    Request* r = alloc(ReqKind::kSend);
    if (r == nullptr) return ncclSuccess;  // all requests busy: NCCL retries
    uint32_t& seq = seq_[tag];
    r->n = 1;
    r->data[0] = data;
    r->cap[0] = size;
    r->nccl_tag[0] = tag;
    r->ftag[0] = data_tag(tag, seq);
    const kvxfer_result_t rc = ep_->post_send(data, size, peer_, r->ftag[0], &r->ops[0]);
    if (rc == KVXFER_IN_PROGRESS) {  // provider queue full: NULL request, NCCL retries
      release(r);
      stalled_ = true;
      return ncclSuccess;
    }
    stalled_ = false;
    last_activity_ = Clock::now();
    if (rc != KVXFER_SUCCESS) {
      release(r);
      fail_comm(ncclSystemError, std::string("posting a send failed: ") + last_error());
      return failed_;
    }
    ++seq;
    r->posted = 1;
    *request = r;
    return ncclSuccess;
  }

  // ---- receive side ----------------------------------------------------
  ncclResult_t irecv(int n, void** data, size_t* sizes, int* tags, void** request) {
    progress();
    if (failed_ != ncclSuccess) return report_failure();
    if (!recv_conn_open()) return failed_;  // after the last poll, before the post
    Request* r = alloc(ReqKind::kRecv);
    if (r == nullptr) return ncclSuccess;
    r->n = n;
    // Per-tag sequence numbers; two receives of one group with the same tag
    // take consecutive numbers.
    for (int i = 0; i < n; ++i) {
      uint32_t s = seq_[tags[i]];
      for (int j = 0; j < i; ++j)
        if (tags[j] == tags[i]) ++s;
      r->data[i] = data[i];
      r->cap[i] = sizes[i];
      r->nccl_tag[i] = tags[i];
      r->ftag[i] = data_tag(tags[i], s);
      r->bytes[i] = 0;
    }
    const kvxfer_result_t rc = post_recvs(r);
    if (rc != KVXFER_SUCCESS && rc != KVXFER_IN_PROGRESS) {
      release(r);
      fail_comm(ncclSystemError, std::string("posting a receive failed: ") + last_error());
      return failed_;
    }
    if (r->posted == 0) {  // nothing accepted: NULL request, NCCL retries
      release(r);
      stalled_ = true;
      return ncclSuccess;
    }
    stalled_ = false;
    last_activity_ = Clock::now();
    for (int i = 0; i < n; ++i) ++seq_[tags[i]];
    if (r->posted < n) unposted_.push_back(r);
    *request = r;
    return ncclSuccess;
  }

  ncclResult_t iflush(void** request) {
    if (failed_ != ncclSuccess) return report_failure();
    // Host memory: received data is in place when the receive completes, so
    // the flush is complete at once.
    Request* r = alloc(ReqKind::kFlush);
    *request = r;  // null (no free request) also means "nothing to flush"
    return ncclSuccess;
  }

  ncclResult_t test(Request* r, int* done, int* sizes) {
    *done = 0;
    progress();
    if (r->error != ncclSuccess) {
      if (!r->error_logged) {
        r->error_logged = true;
        NP_WARN("%s request failed: %s", kind(), r->why.c_str());
      }
      return r->error;  // sticky: the request stays failed until the comm closes
    }
    if (failed_ != ncclSuccess) return report_failure();
    if (r->posted < r->n || r->completed < r->n) return ncclSuccess;
    if (sizes != nullptr) {
      for (int i = 0; i < r->n; ++i)
        sizes[i] = static_cast<int>(std::min<size_t>(r->bytes[i], INT_MAX));
    }
    *done = 1;
    release(r);
    return ncclSuccess;
  }

  ncclResult_t reg_mr(void* data, size_t size, int type, void** mhandle) {
    if (type != NCCL_PTR_HOST)
      return fail(ncclInternalError,
                  "regMr: memory type %d is not supported (host memory only: the libfabric "
                  "layer opens domains without FI_HMEM)",
                  type);
    auto* m = new MemHandle();
    m->comm = this;
    m->data = data;
    m->size = size;
    m->type = type;
    mrs_.insert(m);
    set_live(&Global::live_mrs, m, true);
    *mhandle = m;
    return ncclSuccess;
  }
  ncclResult_t dereg_mr(void* mhandle) {
    auto* m = static_cast<MemHandle*>(mhandle);
    auto it = mrs_.find(m);
    if (m == nullptr || it == mrs_.end())
      return fail(ncclInternalError, "deregMr: %p is not a registration of this comm", mhandle);
    mrs_.erase(it);
    set_live(&Global::live_mrs, m, false);
    m->magic = kDeadMagic;
    delete m;
    return ncclSuccess;
  }

 private:
  kvxfer_result_t post_recvs(Request* r) {
    while (r->posted < r->n) {
      const int i = r->posted;
      // Directed: only the accepted peer's messages match, not those of
      // anyone else who sends to this endpoint's published address.
      const kvxfer_result_t rc =
          ep_->post_recv(r->data[i], r->cap[i], r->ftag[i], &r->ops[i], peer_);
      if (rc != KVXFER_SUCCESS) return rc;
      ++r->posted;
    }
    return KVXFER_SUCCESS;
  }

  void retry_unposted() {
    if (unposted_.empty() || !recv_conn_open()) return;
    while (!unposted_.empty()) {
      Request* r = unposted_.front();
      const kvxfer_result_t rc = post_recvs(r);
      if (rc == KVXFER_IN_PROGRESS) return;
      unposted_.pop_front();
      if (rc != KVXFER_SUCCESS) {
        fail_comm(ncclSystemError, std::string("posting a receive failed: ") + last_error());
        return;
      }
    }
  }

  void on_event(const transport::CqEvent& ev) {
    const auto p = reinterpret_cast<uintptr_t>(ev.context);
    const auto lo = reinterpret_cast<uintptr_t>(reqs_.data());
    const auto hi = reinterpret_cast<uintptr_t>(reqs_.data() + reqs_.size());
    if (ev.context == nullptr || p < lo || p >= hi) {
      NP_WARN("%s comm: completion with a context that is not one of its requests (err %d)", kind(),
              ev.err);
      return;
    }
    auto* op = static_cast<SubOp*>(ev.context);
    Request* r = op->req;
    if (r->kind == ReqKind::kFree || op->index >= r->n) {
      NP_WARN("%s comm: completion for a request that is not in flight (err %d)", kind(), ev.err);
      return;
    }
    const int i = op->index;
    ++r->completed;
    if (ev.err == 0) {
      r->bytes[i] = is_send() ? r->cap[i] : ev.len;
      return;
    }
    const std::string what = strprintf("%s of %zu bytes with tag %d",
                                       is_send() ? "send" : "receive", r->cap[i], r->nccl_tag[i]);
    if (!is_send() && ev.err == FI_ETRUNC) {
      // The sender sent more than this receive can hold: a usage error that
      // NCCL never recovers from.  Whether the provider keeps the connection
      // depends on timing (libfabric 1.17 tcp;ofi_rxm sometimes drops it), so
      // the whole comm fails, every time.
      if (r->error == ncclSuccess) {
        r->error = ncclInternalError;
        r->why = what + ": the peer sent a larger message (truncated)";
      }
      fail_comm(ncclInternalError, r->why);
      return;
    }
    const std::string why = strprintf("%s to/from %s failed: %s (provider errno %d)", what.c_str(),
                                      addr_string(peer_name_).c_str(),
                                      transport::fabric_lib::strerror(ev.err), ev.prov_errno);
    if (r->error == ncclSuccess) {
      r->error = is_remote_error(ev.err) ? ncclRemoteError : ncclSystemError;
      r->why = why;
    }
    fail_comm(r->error, why);
  }

  std::shared_ptr<Context> ctx_;
  int dev_;
  ClassSettings cls_;
  std::unique_ptr<Endpoint> ep_;
  fi_addr_t peer_;
  std::vector<uint8_t> peer_name_;
  std::array<Request, kRequestsPerComm> reqs_;
  int active_ = 0;
  std::unordered_map<int, uint32_t> seq_;
  std::deque<Request*> unposted_;
  std::unordered_set<MemHandle*> mrs_;
  ncclResult_t failed_ = ncclSuccess;
  std::string fail_why_;
  bool stalled_ = false;    // the provider refused the last post (-FI_EAGAIN)
  ConnSocket conn_sock_;    // the socket of the connection to the peer (recv_conn_open)
  bool probe_conn_ = true;  // false: the sockets cannot tell (recv_conn_open)
  Clock::time_point last_activity_, last_check_;
  static constexpr std::chrono::seconds kLivenessIdle{1};
};

// A DataComm in the registries (live_data, live_reqs), or out of them.
void set_live_data(DataComm* c, bool live) {
  std::unique_lock<std::shared_mutex> lk(g().live_mu);
  if (live) {
    g().live_data.insert(c);
    g().live_reqs[c->reqs_base()] = c;
  } else {
    g().live_data.erase(c);
    g().live_reqs.erase(c->reqs_base());
  }
}

// The live DataComm whose request `r` is, or null (one ordered lookup).
DataComm* request_owner(const void* r) {
  std::shared_lock<std::shared_mutex> lk(g().live_mu);
  auto it = g().live_reqs.upper_bound(reinterpret_cast<uintptr_t>(r));
  if (it == g().live_reqs.begin()) return nullptr;
  --it;
  auto* c = static_cast<DataComm*>(const_cast<void*>(it->second));
  return c->owns_request(r) ? c : nullptr;
}

DataComm* as_data_comm(void* comm, uint32_t want) {
  if (!is_live(&Global::live_data, comm)) return nullptr;
  auto* c = static_cast<DataComm*>(comm);
  if (want == 0 ? (c->magic != kSendMagic && c->magic != kRecvMagic) : c->magic != want)
    return nullptr;
  return c;
}

// ---------------------------------------------------------------------------
// Listen comm
// ---------------------------------------------------------------------------
struct ListenComm {
  uint32_t magic = kListenMagic;
  std::shared_ptr<Context> ctx;
  int dev = 0;
  ClassSettings cls;
  std::unique_ptr<Endpoint> ep;
  uint64_t listen_id = 0;
  enum State { kWaiting, kAcking, kAccepted, kFailed } state = kWaiting;
  ncclResult_t error = ncclSuccess;
  ConnectRequest req{};
  ConnectAck ack{};
  CtlOp req_op{}, ack_op{};
  bool ack_posted = false, ack_done = false;
  fi_addr_t peer = FI_ADDR_UNSPEC;
  std::vector<uint8_t> peer_name;

  ncclResult_t failed(ncclResult_t code) {
    state = kFailed;
    error = code;
    ep.reset();
    return code;
  }
};

}  // namespace

// ---------------------------------------------------------------------------
// Fault injection (armed only through libnccl-net-kvxfer-test.so)
// ---------------------------------------------------------------------------
namespace fault {
namespace {
std::atomic<int> g_armed{kNone};
}
void arm(int point) { g_armed.store(point); }
void hit(Point p) {
  int want = p;
  if (g_armed.load(std::memory_order_relaxed) != p || !g_armed.compare_exchange_strong(want, kNone))
    return;
  if (p == kAcceptBadAlloc) throw std::bad_alloc();
  throw std::runtime_error("injected fault");
}
}  // namespace fault

// ---------------------------------------------------------------------------
// init / finalize / devices / properties
// ---------------------------------------------------------------------------
ncclResult_t net_init(void** ctx, uint64_t comm_id, int traffic_class, ncclDebugLogger_t logger) {
  set_nccl_logger(logger);
  if (ctx != nullptr) *ctx = nullptr;
  std::lock_guard<std::mutex> lk(g().mu);
  if (discover_locked() != ncclSuccess) return g().discover_result;
  auto c = std::make_shared<Context>();
  c->comm_id = comm_id;
  std::string why;
  if (!g().tcmap.lookup(traffic_class, &c->cls, &why))
    return fail(ncclInvalidArgument, "%s", why.c_str());
  c->id = g().next_ctx++;
  g().contexts.emplace(c->id, c);
  NP_INFO(NCCL_INIT | NCCL_NET, "init: comm %016llx, traffic class %d -> %s (%s)",
          static_cast<unsigned long long>(comm_id), traffic_class, c->cls.describe().c_str(),
          c->cls.source.c_str());
  if (ctx != nullptr) *ctx = reinterpret_cast<void*>(static_cast<uintptr_t>(c->id));
  return ncclSuccess;
}

ncclResult_t net_finalize(void* ctx) {
  if (ctx == nullptr) {
    NP_INFO(NCCL_INIT | NCCL_NET, "finalize(NULL): nothing to do");
    return ncclSuccess;
  }
  const uint64_t id = reinterpret_cast<uintptr_t>(ctx);
  std::vector<std::unique_ptr<PendingConnect>> dropped;
  {
    std::lock_guard<std::mutex> lk(g().mu);
    if (g().contexts.erase(id) == 0) {
      NP_INFO(NCCL_INIT | NCCL_NET, "finalize: context %llu is not live (already finalized)",
              static_cast<unsigned long long>(id));
      return ncclSuccess;
    }
    for (auto it = g().pending.begin(); it != g().pending.end();) {
      if (it->second->ctx && it->second->ctx->id == id) {
        dropped.push_back(std::move(it->second));
        it = g().pending.erase(it);
      } else {
        ++it;
      }
    }
  }
  if (!dropped.empty())
    NP_INFO(NCCL_INIT | NCCL_NET, "finalize: dropped %zu unfinished connection attempt(s)",
            dropped.size());
  return ncclSuccess;  // comms still open keep their own reference to the context
}

ncclResult_t net_devices(int* ndev) {
  std::lock_guard<std::mutex> lk(g().mu);
  if (!g().discovered || g().discover_result != ncclSuccess) {
    *ndev = 0;
    return fail(ncclInternalError, "devices() before a successful init()");
  }
  *ndev = static_cast<int>(g().devices.size());
  return ncclSuccess;
}

ncclResult_t net_get_properties(int dev, ncclNetProperties_v11_t* props) {
  if (const ncclResult_t r = check_dev(dev); r != ncclSuccess) return r;
  std::lock_guard<std::mutex> lk(g().mu);
  const NetDevice& d = g().devices[static_cast<size_t>(dev)];
  std::memset(props, 0, sizeof(*props));
  props->name = const_cast<char*>(d.ifname.c_str());
  props->pciPath = d.pci_path.empty() ? nullptr : const_cast<char*>(d.pci_path.c_str());
  props->guid = d.guid;
  // CUDA pointers would need FI_HMEM on the domain; the libfabric layer does
  // not ask for it (docs/NET_PLUGIN.md).
  props->ptrSupport = NCCL_PTR_HOST;
  props->regIsGlobal = 0;
  props->forceFlush = 0;
  props->speed = d.speed_mbps;
  props->port = 0;
  props->latency = 0;
  props->maxComms = g().max_comms;
  props->maxRecvs = kMaxRecvs;
  props->netDeviceType = NCCL_NET_DEVICE_HOST;
  props->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;
  props->vProps.ndevs = 1;
  props->vProps.devs[0] = dev;
  // test() reports sizes as int.
  props->maxP2pBytes = INT_MAX;
  props->maxCollBytes = INT_MAX;
  props->maxMultiRequestSize = 1;
  return ncclSuccess;
}

// ---------------------------------------------------------------------------
// listen / connect / accept
// ---------------------------------------------------------------------------
ncclResult_t net_listen(void* ctx, int dev, void* handle, void** listen_comm) {
  *listen_comm = nullptr;
  std::shared_ptr<Context> c = find_context(ctx);
  if (!c) return fail(ncclInvalidArgument, "listen: %p is not a live context", ctx);
  if (const ncclResult_t r = check_dev(dev); r != ncclSuccess) return r;
  const NetDevice d = device(dev);
  auto lc = std::make_unique<ListenComm>();
  lc->ctx = c;
  lc->dev = dev;
  lc->cls = c->cls;
  std::shared_ptr<Domain> domain;
  if (Domain::open(params::OfiProvider(), d.address, &domain, /*directed_recv=*/true) !=
          KVXFER_SUCCESS ||
      Endpoint::open(domain, lc->cls.tclass, &lc->ep) != KVXFER_SUCCESS)
    return fail(ncclSystemError, "listen on %s (%s): %s", d.ifname.c_str(), d.address.c_str(),
                last_error());
  const std::vector<uint8_t>& name = lc->ep->name();
  const std::string& prov = domain->provider();
  if (name.size() > kMaxEpName || prov.size() > kMaxProviderName)
    return fail(ncclInternalError,
                "listen: provider %s address of %zu bytes does not fit the handle", prov.c_str(),
                name.size());
  {
    std::lock_guard<std::mutex> lk(g().mu);
    lc->listen_id = g().rng() | 1;
  }
  // Receive the connect request first: a connecting peer may come at once.
  lc->req_op.kind = 1;
  const kvxfer_result_t rc =
      lc->ep->post_recv(&lc->req, sizeof(lc->req), kTagConnectRequest, &lc->req_op);
  if (rc != KVXFER_SUCCESS)
    return fail(ncclSystemError, "listen: posting the connect receive failed: %s", last_error());
  // The listener socket: connections it accepts later inherit its TOS.
  mark_sockets(*lc->ep, nullptr, lc->cls.dscp, "listen");
  Handle h{};
  h.magic = kHandleMagic;
  h.version = kHandleVersion;
  h.name_len = static_cast<uint8_t>(name.size());
  h.provider_len = static_cast<uint8_t>(prov.size());
  h.listen_id = lc->listen_id;
  std::memcpy(h.provider, prov.data(), prov.size());
  std::memcpy(h.name, name.data(), name.size());
  h.stage = 0;
  std::memcpy(handle, &h, sizeof(h));
  NP_INFO(NCCL_NET, "listen on %s at %s, %s", d.ifname.c_str(), addr_string(name).c_str(),
          lc->cls.describe().c_str());
  set_live(&Global::live_listen, lc.get(), true);
  *listen_comm = lc.release();
  return ncclSuccess;
}

namespace {

void write_stage(void* handle, uint64_t id) {
  std::memcpy(static_cast<uint8_t*>(handle) + kHandleStageOffset, &id, sizeof(id));
}
uint64_t read_stage(const void* handle) {
  uint64_t id = 0;
  std::memcpy(&id, static_cast<const uint8_t*>(handle) + kHandleStageOffset, sizeof(id));
  return id;
}

// The attempt `id`, taken out of the registry; null if there is none.  With
// `h`: only when the attempt is that handle's (its listen id and address),
// else it stays, and *mismatch is set.
std::unique_ptr<PendingConnect> take_pending(uint64_t id, const Handle* h = nullptr,
                                             bool* mismatch = nullptr) {
  std::lock_guard<std::mutex> lk(g().mu);
  auto it = g().pending.find(id);
  if (it == g().pending.end()) return nullptr;
  if (h != nullptr) {
    const PendingConnect& a = *it->second;
    if (h->listen_id != a.listen_id || h->name_len != a.peer_name.size() ||
        std::memcmp(h->name, a.peer_name.data(), a.peer_name.size()) != 0) {
      *mismatch = true;
      return nullptr;
    }
  }
  std::unique_ptr<PendingConnect> p = std::move(it->second);
  g().pending.erase(it);
  return p;
}

// Starts a connection attempt: the endpoint, the peer, the acknowledgement receive.
ncclResult_t start_connect(const std::shared_ptr<Context>& c, int dev, const Handle& h,
                           const int* class_override, std::unique_ptr<PendingConnect>* out) {
  if (h.magic != kHandleMagic || h.version != kHandleVersion || h.name_len == 0 ||
      h.name_len > kMaxEpName || h.provider_len == 0 || h.provider_len > kMaxProviderName)
    return fail(ncclInvalidArgument, "connect: the handle is not a kvxfer listen handle");
  const std::string prov(h.provider, h.provider_len);
  std::string here;  // what KVXFER_OFI_PROVIDER resolved to at init (auto: any)
  {
    std::lock_guard<std::mutex> lk(g().mu);
    here = g().provider;
  }
  if (!params::OfiProvider().empty() && here != prov)
    return fail(ncclInvalidArgument,
                "connect: the listener uses provider %s, KVXFER_OFI_PROVIDER here is %s (%s)",
                prov.c_str(), params::OfiProvider().c_str(), here.c_str());
  auto p = std::make_unique<PendingConnect>();
  p->ctx = c;
  p->dev = dev;
  p->cls = c->cls;
  if (class_override != nullptr) {
    std::string why;
    std::lock_guard<std::mutex> lk(g().mu);
    if (!g().tcmap.lookup(*class_override, &p->cls, &why))
      return fail(ncclInvalidArgument, "connect: %s", why.c_str());
  }
  p->listen_id = h.listen_id;
  p->peer_name.assign(h.name, h.name + h.name_len);
  const NetDevice d = device(dev);
  std::shared_ptr<Domain> domain;
  if (Domain::open(prov, d.address, &domain, /*directed_recv=*/true) != KVXFER_SUCCESS ||
      Endpoint::open(domain, p->cls.tclass, &p->ep) != KVXFER_SUCCESS)
    return fail(ncclSystemError, "connect from %s (%s): %s", d.ifname.c_str(), d.address.c_str(),
                last_error());
  if (p->ep->name().size() > sizeof(p->req.name))
    return fail(ncclInternalError, "connect: provider address of %zu bytes is too long",
                p->ep->name().size());
  if (p->ep->insert_peer(p->peer_name.data(), p->peer_name.size(), &p->peer) != KVXFER_SUCCESS)
    return fail(ncclInvalidArgument, "connect: the listener's address is unusable: %s",
                last_error());
  mark_sockets(*p->ep, nullptr, p->cls.dscp, "connect");
  p->ack_op.kind = 2;
  if (p->ep->post_recv(&p->ack, sizeof(p->ack), kTagConnectAck, &p->ack_op, p->peer) !=
      KVXFER_SUCCESS)
    return fail(ncclSystemError, "connect: posting the acknowledgement receive failed: %s",
                last_error());
  ConnectRequest& rq = p->req;
  rq.magic = kRequestMagic;
  rq.version = kWireVersion;
  rq.name_len = static_cast<uint16_t>(p->ep->name().size());
  rq.listen_id = h.listen_id;
  rq.nccl_class = p->cls.nccl_class;
  rq.tclass = p->cls.tclass;
  rq.dscp = p->cls.dscp;
  std::memcpy(rq.name, p->ep->name().data(), p->ep->name().size());
  p->req_op.kind = 1;
  p->started = Clock::now();
  *out = std::move(p);
  return ncclSuccess;
}

// One step of an attempt.  ncclSuccess with *ready false: call again.
ncclResult_t step_connect(PendingConnect* p, bool* ready) {
  *ready = false;
  if (!p->req_posted) {
    const kvxfer_result_t rc =
        p->ep->post_send(&p->req, sizeof(p->req), p->peer, kTagConnectRequest, &p->req_op);
    if (rc == KVXFER_SUCCESS) {
      p->req_posted = true;
    } else if (rc != KVXFER_IN_PROGRESS) {  // -FI_EAGAIN while rxm connects
      return fail(ncclSystemError, "connect: sending the connect request failed: %s", last_error());
    }
  }
  transport::CqEvent evs[4];
  size_t n = 0;
  if (p->ep->poll(evs, 4, &n) != KVXFER_SUCCESS)
    return fail(ncclSystemError, "connect: reading the completion queue failed: %s", last_error());
  for (size_t i = 0; i < n; ++i) {
    const transport::CqEvent& ev = evs[i];
    const bool is_req = ev.context == &p->req_op, is_ack = ev.context == &p->ack_op;
    if (!is_req && !is_ack) {
      NP_WARN("connect: completion with an unknown context (err %d)", ev.err);
      continue;
    }
    if (ev.err != 0)
      return fail(is_remote_error(ev.err) ? ncclRemoteError : ncclSystemError,
                  "connect to %s: %s failed: %s (provider errno %d)",
                  addr_string(p->peer_name).c_str(),
                  is_req ? "the connect request" : "the acknowledgement",
                  transport::fabric_lib::strerror(ev.err), ev.prov_errno);
    if (is_req) p->req_done = true;
    if (is_ack) {
      if (ev.len != sizeof(ConnectAck) || p->ack.magic != kAckMagic ||
          p->ack.listen_id != p->listen_id)
        return fail(ncclRemoteError, "connect to %s: malformed acknowledgement",
                    addr_string(p->peer_name).c_str());
      p->ack_done = true;
    }
  }
  if (p->req_done && p->ack_done) {
    *ready = true;
    return ncclSuccess;
  }
  const int64_t timeout_ms = params::TimeoutMs();
  if (Clock::now() - p->started > std::chrono::milliseconds(timeout_ms))
    return fail(ncclRemoteError,
                "connect to %s: no answer within %lld ms (KVXFER_TIMEOUT_MS): the peer did not "
                "accept, or is unreachable",
                addr_string(p->peer_name).c_str(), static_cast<long long>(timeout_ms));
  return ncclSuccess;
}

}  // namespace

ncclResult_t net_connect(void* ctx, int dev, void* handle, void** send_comm,
                         const int* class_override) {
  *send_comm = nullptr;
  if (handle == nullptr) return fail(ncclInvalidArgument, "connect: null handle");
  std::unique_ptr<PendingConnect> p;
  const uint64_t stage = read_stage(handle);
  if (stage != 0) {
    Handle h;
    std::memcpy(&h, handle, sizeof(h));
    bool mismatch = false;
    p = take_pending(stage, &h, &mismatch);
    if (mismatch) {  // the attempt stays for its own handle
      write_stage(handle, 0);
      return fail(ncclInvalidArgument,
                  "connect: the handle names the connection attempt of another handle (a "
                  "copied or corrupted handle); connect with the listener's handle as written");
    }
    if (!p) {
      write_stage(handle, 0);
      return fail(ncclInternalError,
                  "connect: the handle refers to a connection attempt that no longer exists "
                  "(it failed, or its context was finalized)");
    }
  } else {
    std::shared_ptr<Context> c = find_context(ctx);
    if (!c) return fail(ncclInvalidArgument, "connect: %p is not a live context", ctx);
    if (const ncclResult_t r = check_dev(dev); r != ncclSuccess) return r;
    Handle h;
    std::memcpy(&h, handle, sizeof(h));
    const ncclResult_t r = start_connect(c, dev, h, class_override, &p);
    if (r != ncclSuccess) return r;
    std::lock_guard<std::mutex> lk(g().mu);
    p->id = g().next_pending++;
  }
  // From here the attempt lives in the registry whenever it is not in `p`,
  // and the handle names it only while it is there (or about to be).
  const uint64_t id = p->id;
  write_stage(handle, id);
  auto park = [&]() {
    std::lock_guard<std::mutex> lk(g().mu);
    g().pending[id] = std::move(p);
  };
  auto drop = [&]() {
    write_stage(handle, 0);
    p.reset();
  };
  try {
    fault::hit(fault::kConnectAfterStage);
    bool ready = false;
    const ncclResult_t r = step_connect(p.get(), &ready);
    if (r != ncclSuccess) {
      drop();
      return r;
    }
    if (!ready) {
      park();
      return ncclSuccess;
    }
    mark_sockets(*p->ep, &p->peer_name, p->cls.dscp, "connect");
    NP_INFO(NCCL_NET, "connected %s -> %s, %s", addr_string(p->ep->name()).c_str(),
            addr_string(p->peer_name).c_str(), p->cls.describe().c_str());
    std::unique_ptr<DataComm> comm(
        new DataComm(true, p->ctx, p->dev, p->cls, std::move(p->ep), p->peer, p->peer_name));
    set_live_data(comm.get(), true);
    drop();
    *send_comm = comm.release();
    return ncclSuccess;
  } catch (...) {
    drop();
    throw;
  }
}

void net_connect_abandon(void* handle) {
  if (handle == nullptr) return;
  const uint64_t stage = read_stage(handle);
  if (stage != 0) (void)take_pending(stage);
  write_stage(handle, 0);
}

ncclResult_t net_accept(void* listen_comm, void** recv_comm) {
  *recv_comm = nullptr;
  if (!is_live(&Global::live_listen, listen_comm))
    return fail(ncclInvalidArgument, "accept: %p is not a listen comm", listen_comm);
  auto* lc = static_cast<ListenComm*>(listen_comm);
  fault::hit(fault::kAcceptBadAlloc);
  if (lc->state == ListenComm::kFailed) return lc->error;
  if (lc->state == ListenComm::kAccepted)
    return fail(ncclInternalError, "accept: this listen comm has already accepted its peer");
  transport::CqEvent evs[4];
  size_t n = 0;
  if (lc->ep->poll(evs, 4, &n) != KVXFER_SUCCESS)
    return lc->failed(
        fail(ncclSystemError, "accept: reading the completion queue failed: %s", last_error()));
  for (size_t i = 0; i < n; ++i) {
    const transport::CqEvent& ev = evs[i];
    const bool is_req = ev.context == &lc->req_op, is_ack = ev.context == &lc->ack_op;
    if (!is_req && !is_ack) {
      NP_WARN("accept: completion with an unknown context (err %d)", ev.err);
      continue;
    }
    if (ev.err != 0 && !(is_req && ev.err == FI_ETRUNC))
      return lc->failed(fail(is_remote_error(ev.err) ? ncclRemoteError : ncclSystemError,
                             "accept: %s failed: %s (provider errno %d)",
                             is_req ? "the connect request" : "the acknowledgement",
                             transport::fabric_lib::strerror(ev.err), ev.prov_errno));
    if (is_ack) {
      lc->ack_done = true;
      continue;
    }
    const ConnectRequest& rq = lc->req;
    if (ev.err != 0 || ev.len != sizeof(ConnectRequest) || rq.magic != kRequestMagic ||
        rq.version != kWireVersion || rq.listen_id != lc->listen_id || rq.name_len == 0 ||
        rq.name_len > sizeof(rq.name)) {
      // Not this listen's peer (another listen's handle, a stale one, a
      // stranger): refused, and the listen waits on for its own peer, who
      // may be right behind it.  The sender gets no answer and times out.
      NP_WARN(
          "accept: refused a connect request that is not for this listen (%s); still "
          "waiting",
          ev.err != 0                        ? "longer than a connect request"
          : ev.len != sizeof(ConnectRequest) ? "wrong length"
          : rq.listen_id != lc->listen_id    ? "another listen id"
                                             : "malformed");
      std::memset(&lc->req, 0, sizeof(lc->req));
      if (lc->ep->post_recv(&lc->req, sizeof(lc->req), kTagConnectRequest, &lc->req_op) !=
          KVXFER_SUCCESS)
        return lc->failed(fail(
            ncclSystemError, "accept: posting the connect receive again failed: %s", last_error()));
      continue;
    }
    lc->peer_name.assign(rq.name, rq.name + rq.name_len);
    if (lc->ep->insert_peer(lc->peer_name.data(), lc->peer_name.size(), &lc->peer) !=
        KVXFER_SUCCESS)
      return lc->failed(
          fail(ncclRemoteError, "accept: the peer's address is unusable: %s", last_error()));
    // A context without a class (v10, where only connect() carries one)
    // takes the connecting side's DSCP for its own sockets.
    if (lc->cls.nccl_class == NCCL_NET_TRAFFIC_CLASS_UNDEF && rq.nccl_class >= 0) {
      lc->cls.nccl_class = rq.nccl_class;
      lc->cls.dscp = rq.dscp;
      lc->cls.source = "from the connecting peer";
    } else if (rq.nccl_class != lc->cls.nccl_class) {
      NP_INFO(NCCL_NET, "accept: peer uses traffic class %d, this side %d", rq.nccl_class,
              lc->cls.nccl_class);
    }
    lc->ack.magic = kAckMagic;
    lc->ack.listen_id = lc->listen_id;
    lc->ack_op.kind = 2;
    lc->state = ListenComm::kAcking;
  }
  if (lc->state == ListenComm::kAcking && !lc->ack_posted) {
    const kvxfer_result_t rc =
        lc->ep->post_send(&lc->ack, sizeof(lc->ack), lc->peer, kTagConnectAck, &lc->ack_op);
    if (rc == KVXFER_SUCCESS) {
      lc->ack_posted = true;
    } else if (rc != KVXFER_IN_PROGRESS) {
      return lc->failed(
          fail(ncclSystemError, "accept: sending the acknowledgement failed: %s", last_error()));
    }
  }
  if (lc->state != ListenComm::kAcking || !lc->ack_done) return ncclSuccess;
  mark_sockets(*lc->ep, &lc->peer_name, lc->cls.dscp, "accept");
  NP_INFO(NCCL_NET, "accepted %s -> %s, %s", addr_string(lc->peer_name).c_str(),
          addr_string(lc->ep->name()).c_str(), lc->cls.describe().c_str());
  std::unique_ptr<DataComm> comm(
      new DataComm(false, lc->ctx, lc->dev, lc->cls, std::move(lc->ep), lc->peer, lc->peer_name));
  set_live_data(comm.get(), true);
  lc->state = ListenComm::kAccepted;
  *recv_comm = comm.release();
  return ncclSuccess;
}

// ---------------------------------------------------------------------------
// Memory registration, data, test, close
// ---------------------------------------------------------------------------
ncclResult_t net_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  *mhandle = nullptr;
  DataComm* c = as_data_comm(comm, 0);
  if (c == nullptr) return fail(ncclInvalidArgument, "regMr: %p is not a send or recv comm", comm);
  return c->reg_mr(data, size, type, mhandle);
}

ncclResult_t net_dereg_mr(void* comm, void* mhandle) {
  DataComm* c = as_data_comm(comm, 0);
  if (c == nullptr)
    return fail(ncclInvalidArgument, "deregMr: %p is not a send or recv comm", comm);
  return c->dereg_mr(mhandle);
}

ncclResult_t net_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                       void** request) {
  *request = nullptr;
  fault::hit(fault::kIsendThrow);
  DataComm* c = as_data_comm(send_comm, kSendMagic);
  if (c == nullptr) return fail(ncclInvalidArgument, "isend: %p is not a send comm", send_comm);
  if (data == nullptr && size > 0) return fail(ncclInvalidArgument, "isend: null buffer");
  if (mhandle != nullptr && !is_live(&Global::live_mrs, mhandle))
    return fail(ncclInvalidArgument, "isend: %p is not a memory registration", mhandle);
  return c->isend(data, size, tag, request);
}

ncclResult_t net_irecv(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                       void** mhandles, void** request) {
  *request = nullptr;
  DataComm* c = as_data_comm(recv_comm, kRecvMagic);
  if (c == nullptr) return fail(ncclInvalidArgument, "irecv: %p is not a recv comm", recv_comm);
  if (n < 1 || n > kMaxRecvs)
    return fail(ncclInvalidArgument, "irecv: n = %d outside 1..%d (maxRecvs)", n, kMaxRecvs);
  for (int i = 0; i < n; ++i) {
    if (data[i] == nullptr && sizes[i] > 0)
      return fail(ncclInvalidArgument, "irecv: null buffer %d", i);
    if (mhandles != nullptr && mhandles[i] != nullptr && !is_live(&Global::live_mrs, mhandles[i]))
      return fail(ncclInvalidArgument, "irecv: %p is not a memory registration", mhandles[i]);
  }
  return c->irecv(n, data, sizes, tags, request);
}

ncclResult_t net_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                        void** request) {
  (void)data;
  (void)sizes;
  (void)mhandles;
  *request = nullptr;
  DataComm* c = as_data_comm(recv_comm, kRecvMagic);
  if (c == nullptr) return fail(ncclInvalidArgument, "iflush: %p is not a recv comm", recv_comm);
  if (n < 0 || n > kMaxRecvs) return fail(ncclInvalidArgument, "iflush: n = %d", n);
  return c->iflush(request);
}

ncclResult_t net_test(void* request, int* done, int* sizes) {
  if (done != nullptr) *done = 0;
  auto* r = static_cast<Request*>(request);
  // A request of a live comm: only then is it read.
  if (r == nullptr || request_owner(r) == nullptr || done == nullptr || r->magic != kReqMagic ||
      r->kind == ReqKind::kFree)
    return fail(ncclInvalidArgument, "test: %p is not a request in flight", request);
  return r->comm->test(r, done, sizes);
}

ncclResult_t net_close_send(void* send_comm) {
  DataComm* c = as_data_comm(send_comm, kSendMagic);
  if (c == nullptr) return fail(ncclInvalidArgument, "closeSend: %p is not a send comm", send_comm);
  set_live_data(c, false);
  c->close();
  c->magic = kDeadMagic;
  delete c;
  return ncclSuccess;
}

ncclResult_t net_close_recv(void* recv_comm) {
  DataComm* c = as_data_comm(recv_comm, kRecvMagic);
  if (c == nullptr) return fail(ncclInvalidArgument, "closeRecv: %p is not a recv comm", recv_comm);
  set_live_data(c, false);
  c->close();
  c->magic = kDeadMagic;
  delete c;
  return ncclSuccess;
}

ncclResult_t net_close_listen(void* listen_comm) {
  if (!is_live(&Global::live_listen, listen_comm))
    return fail(ncclInvalidArgument, "closeListen: %p is not a listen comm", listen_comm);
  auto* lc = static_cast<ListenComm*>(listen_comm);
  set_live(&Global::live_listen, lc, false);
  lc->ep.reset();  // never waits for a peer
  lc->magic = kDeadMagic;
  delete lc;
  return ncclSuccess;
}

// ---------------------------------------------------------------------------
// Inspection for tests
// ---------------------------------------------------------------------------
bool comm_info(void* comm, CommInfo* out) {
  if (comm == nullptr) return false;
  if (is_live(&Global::live_listen, comm)) {
    auto* lc = static_cast<ListenComm*>(comm);
    out->kind = 3;
    out->nccl_class = lc->cls.nccl_class;
    out->tclass = lc->cls.tclass;
    out->dscp = lc->cls.dscp;
    if (lc->ep) {
      out->local = lc->ep->name().data();
      out->local_len = lc->ep->name().size();
    }
    return true;
  }
  DataComm* c = as_data_comm(comm, 0);
  if (c == nullptr) return false;
  out->kind = c->is_send() ? 1 : 2;
  out->nccl_class = c->cls().nccl_class;
  out->tclass = c->ep() != nullptr ? c->ep()->tclass() : c->cls().tclass;
  out->dscp = c->cls().dscp;
  if (c->ep() != nullptr) {
    out->local = c->ep()->name().data();
    out->local_len = c->ep()->name().size();
  }
  out->peer = c->peer_name().data();
  out->peer_len = c->peer_name().size();
  out->requests = c->active();
  return true;
}

int pending_connects() {
  std::lock_guard<std::mutex> lk(g().mu);
  return static_cast<int>(g().pending.size());
}

int live_contexts() {
  std::lock_guard<std::mutex> lk(g().mu);
  return static_cast<int>(g().contexts.size());
}

}  // namespace kvxfer::netplugin
