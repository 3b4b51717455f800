// Link (ofi.h), its setup: creation and address blob, connect and the path
// it takes, the hello handshake, DSCP marking and liveness.
#include <fcntl.h>
#include <pthread.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/error.h"
#include "common/log.h"
#include "common/params.h"
#include "transport/crash_signals.h"
#include "transport/dscp.h"
#include "transport/fabric_lib.h"
#include "transport/ofi.h"
#include "transport/ofi_link_internal.h"
#include "transport/shm_reaper.h"
#include "transport/smr_region.h"

namespace kvxfer::transport {

using namespace link_detail;  // NOLINT: this file's own internals

namespace {
/** Held by Link::create; held across fork() too (an endpoint's spare thread
 *  may hold it at any time), so that the child's is not left locked. */
std::mutex& create_mutex() {
  static std::mutex* mu = [] {
    auto* m = new std::mutex;
    pthread_atfork([] { create_mutex().lock(); }, [] { create_mutex().unlock(); },
                   [] { create_mutex().unlock(); });
    return m;
  }();
  return *mu;
}
}  // namespace

kvxfer_result_t Link::create(const LinkConfig& cfg, std::unique_ptr<Link>* out) {
  KVXFER_REQUIRE(out != nullptr, "Link::create: null output");
  KVXFER_REQUIRE(cfg.chunk_bytes >= 1 && cfg.chunk_bytes <= kMaxPeerChunk,
                 "chunk_bytes %zu outside [1, 2^30]", cfg.chunk_bytes);
  KVXFER_REQUIRE(cfg.timeout_ms >= 1, "timeout_ms must be positive");
  KVXFER_REQUIRE(cfg.max_posted_chunks >= 1 && cfg.recv_window_chunks >= 1,
                 "max_posted_chunks and recv_window_chunks must be positive");
  KVXFER_REQUIRE(cfg.max_posted_recvs == 0 || cfg.max_posted_recvs >= 2,
                 "max_posted_recvs must be 0 (the provider's rx size) or at least 2");
  for (int c = 0; c < kNumClasses; ++c)
    KVXFER_REQUIRE(cfg.dscp[c] >= -1 && cfg.dscp[c] <= 63, "dscp %d outside -1..63", cfg.dscp[c]);
  // One Link made at a time in the process: with Links made on two threads
  // at once while other links ran, mesh_perf --quick stalled links for the
  // whole timeout in 3 of 8 runs, and in none of 16 with this lock
  // (docs/TRANSPORT.md, "Endpoints", spare Links).
  const std::lock_guard<std::mutex> one_at_a_time(create_mutex());
  std::unique_ptr<Link> l(new Link());
  l->cfg_ = cfg;
  l->asked_chunk_bytes_ = cfg.chunk_bytes;
  l->asked_posted_recvs_ = cfg.max_posted_recvs;
  {
    const KeepSignalDispositions keep;  // shm (when named) installs SIGINT/SIGTERM handlers
    KVXFER_CHECK(Domain::open(cfg.provider, cfg.node, &l->domain_));
    for (int c = 0; c < kNumClasses; ++c)
      KVXFER_CHECK(Endpoint::open(l->domain_, cfg.tclass[c], &l->ep_[c]));
  }
  // The auto provider also offers shared memory, for a peer on this host.
  // Without it (no shm provider, /dev/shm full) every peer takes the network.
  if (cfg.provider.empty() && cfg.offer_shm) {
    std::shared_ptr<Domain> d;
    std::array<std::unique_ptr<Endpoint>, kNumClasses> e;
    kvxfer_result_t r;
    {
      const KeepSignalDispositions keep;  // shm's first endpoint installs SIGINT/SIGTERM handlers
      r = Domain::open(kShmProvider, "", &d);
      for (int c = 0; c < kNumClasses && r == KVXFER_SUCCESS; ++c)
        r = Endpoint::open(d, cfg.tclass[c], &e[c]);
    }
    if (r == KVXFER_SUCCESS) {
      l->shm_domain_ = std::move(d);
      l->shm_ep_ = std::move(e);
    } else {
      KVXFER_INFO(LOG_NET, "OFI : no shared-memory path (%s); same-host peers use %s", last_error(),
                  l->domain_->provider().c_str());
    }
  }
  l->apply_path_limits();
  if (l->shm_domain_ || l->domain_->provider() == kShmProvider) l->open_bell();

  // Address blob.
  std::vector<uint8_t>& a = l->address_;
  const std::string& host = host_identity();
  const uint32_t pid = static_cast<uint32_t>(getpid());
  a.insert(a.end(), kBlobMagic, kBlobMagic + 4);
  a.push_back(kBlobVersion);
  a.push_back(kNumClasses);
  a.push_back(l->shm_domain_ ? 2 : 1);
  a.push_back(static_cast<uint8_t>(std::min<size_t>(host.size(), 255)));
  a.insert(a.end(), host.begin(), host.begin() + std::min<size_t>(host.size(), 255));
  for (int i = 0; i < 4; ++i) a.push_back(static_cast<uint8_t>(pid >> (8 * i)));
  auto put_path = [&a](const Domain& d,
                       const std::array<std::unique_ptr<Endpoint>, kNumClasses>& e) {
    const std::string& prov = d.provider();
    a.push_back(static_cast<uint8_t>(std::min<size_t>(prov.size(), 255)));
    a.insert(a.end(), prov.begin(), prov.begin() + std::min<size_t>(prov.size(), 255));
    for (int c = 0; c < kNumClasses; ++c) {
      const std::vector<uint8_t>& n = e[c]->name();
      a.push_back(static_cast<uint8_t>(n.size() & 0xFF));
      a.push_back(static_cast<uint8_t>(n.size() >> 8));
      a.insert(a.end(), n.begin(), n.end());
    }
  };
  if (l->shm_domain_) put_path(*l->shm_domain_, l->shm_ep_);
  put_path(*l->domain_, l->ep_);
  const std::string& prov = l->domain_->provider();
  l->dscp_.supported = is_inet_sockaddr(l->ep_[0]->name().data(), l->ep_[0]->name().size()) &&
                       is_inet_sockaddr(l->ep_[1]->name().data(), l->ep_[1]->name().size());
  if (!l->dscp_.supported) {
    l->dscp_.note = "provider " + prov + " does not use socket addresses; no DSCP marking";
  }
  l->mark_sockets();  // the listeners: connections accepted later inherit their TOS
  KVXFER_INFO(
      LOG_NET,
      "OFI : link on %s: anchor tclass %s, residual tclass %s, chunk %zu B, "
      "residual in flight <= %zu B, timeout %lld ms, rate %s",
      prov.c_str(), tclass_to_string(cfg.tclass[0]).c_str(),
      tclass_to_string(cfg.tclass[1]).c_str(), l->cfg_.chunk_bytes, cfg.residual_inflight_bytes,
      static_cast<long long>(cfg.timeout_ms),
      cfg.limiter ? strprintf("%.0f B/s", cfg.limiter->bytes_per_sec()).c_str() : "unlimited");
  *out = std::move(l);
  return KVXFER_SUCCESS;
}

void Link::apply_path_limits() {
  const fi_info* info = domain_->info();
  cfg_.chunk_bytes = asked_chunk_bytes_;
  const uint64_t max_msg = info->ep_attr->max_msg_size;
  if (max_msg > 0 && cfg_.chunk_bytes > max_msg) cfg_.chunk_bytes = max_msg;
  // Receives are posted far ahead (docs/TRANSPORT.md, "Receive window"):
  // a message that arrives with its receive posted is placed at once; one
  // that arrives unexpected holds one of the provider's few receive buffers
  // (rxm: 128 per connection), and with too many of those the connection
  // stalls behind them.
  cfg_.max_posted_recvs = asked_posted_recvs_;
  if (cfg_.max_posted_recvs == 0) {
    const fi_rx_attr* rx = info->rx_attr;
    cfg_.max_posted_recvs = rx != nullptr && rx->size >= 2 ? rx->size : 1024;
    // shm's entries also hold unexpected messages (ofi.h, kShmMaxRequests).
    if (provider() == kShmProvider)
      cfg_.max_posted_recvs = std::max<size_t>(
          2, static_cast<size_t>(static_cast<double>(cfg_.max_posted_recvs) * kShmPostedShare));
  }
}

Link::~Link() {
  const size_t n = ops_in_flight();
  if (n > 0) KVXFER_INFO(LOG_NET, "OFI : link destroyed with %zu operations in flight", n);
  abort("link destroyed");
  shm_watch_.reset();  // before the pidfd it borrows
  if (peer_pidfd_ >= 0) ::close(peer_pidfd_);
  close_bell();
}

void Link::open_bell() {
  const Endpoint& anchor = shm_ep_[0] ? *shm_ep_[0] : *ep_[0];
  const std::string path = bell_file(anchor.name());
  // A file of this name is a dead process's: shm made this endpoint's
  // region, of the same name less ".bell", only because none was there.
  if (::mkfifo(path.c_str(), 0600) != 0 &&
      (errno != EEXIST || ::unlink(path.c_str()) != 0 || ::mkfifo(path.c_str(), 0600) != 0)) {
    KVXFER_INFO(LOG_NET, "OFI : no doorbell at %s (%s): a same-host peer is polled", path.c_str(),
                std::strerror(errno));
    return;
  }
  bell_fd_ = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (bell_fd_ < 0) {
    KVXFER_INFO(LOG_NET, "OFI : cannot open the doorbell %s (%s): a same-host peer is polled",
                path.c_str(), std::strerror(errno));
    (void)::unlink(path.c_str());
    return;
  }
  bell_path_ = path;
}

void Link::close_bell() {
  if (!bell_path_.empty()) (void)::unlink(bell_path_.c_str());
  bell_path_.clear();
  if (bell_fd_ >= 0) ::close(bell_fd_);
  if (peer_bell_fd_ >= 0) ::close(peer_bell_fd_);
  bell_fd_ = peer_bell_fd_ = -1;
  peer_rings_ = bell_armed_ = false;
  for (int c = 0; c < kNumClasses; ++c) {
    own_signal_[c].reset();
    peer_signal_[c].reset();
  }
}

void Link::ring_peer_if_signalled(Clock::time_point now) {
  // A signal set by what this side did (stirred_) rings at once; one set
  // otherwise (shm's segmented copies, a retry the peer queued for itself)
  // at most every 100 us while it stays set, not on every poll, and before
  // this side sleeps (prepare_wait).
  if (!stirred_ && now - last_ring_ < std::chrono::microseconds(100)) return;
  stirred_ = false;
  if (!peer_signal_[0].signalled() && !peer_signal_[1].signalled()) return;
  ring_peer();
  last_ring_ = now;
}

void Link::ring_peer() {
  static const char kRing = 0;
  (void)!::write(peer_bell_fd_, &kRing, 1);  // -EAGAIN: full, it rings already
}

size_t Link::ops_in_flight() const {
  size_t n = 0;
  for (const auto& kv : ops_)
    if (!kv.second->reported) ++n;
  return n;
}

size_t Link::ops_awaited() const {
  size_t n = 0;
  for (const auto& kv : ops_)
    if (!kv.second->reported && !kv.second->standing_idle()) ++n;
  return n;
}

kvxfer_result_t Link::connect(const void* blob, size_t len) {
  if (failed_) return set_error(fail_code_, "link failed: %s", fail_why_.c_str());
  if (connecting_) return set_error(KVXFER_ERR_INVALID_USAGE, "Link::connect called twice");
  KVXFER_REQUIRE(blob != nullptr, "null peer address");
  // Parse every path the peer offers.
  struct Path {
    std::string provider;
    std::array<std::vector<uint8_t>, kNumClasses> names;
  };
  const uint8_t* p = static_cast<const uint8_t*>(blob);
  const uint8_t* end = p + len;
  if (len < 8 || std::memcmp(p, kBlobMagic, 4) != 0)
    return set_error(KVXFER_ERR_CORRUPT, "peer address is not a kvxfer link address");
  if (p[4] != kBlobVersion)
    return set_error(KVXFER_ERR_MISMATCH,
                     "peer address has version %u, this side %u (different kvxfer versions)", p[4],
                     kBlobVersion);
  if (p[5] != kNumClasses || p[6] < 1 || p[6] > kMaxPaths)
    return set_error(KVXFER_ERR_CORRUPT,
                     "peer address has %u classes and %u paths (expected %d, 1..%d)", p[5], p[6],
                     kNumClasses, kMaxPaths);
  const int npaths = p[6];
  const size_t hlen = p[7];
  p += 8;
  if (static_cast<size_t>(end - p) < hlen + 4)
    return set_error(KVXFER_ERR_CORRUPT, "peer address is truncated");
  const std::string peer_host(reinterpret_cast<const char*>(p), hlen);
  p += hlen;
  const uint32_t peer_pid =
      p[0] | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
  p += 4;
  std::vector<Path> theirs(static_cast<size_t>(npaths));
  for (Path& path : theirs) {
    if (end - p < 1) return set_error(KVXFER_ERR_CORRUPT, "peer address is truncated");
    const size_t plen = *p++;
    if (static_cast<size_t>(end - p) < plen)
      return set_error(KVXFER_ERR_CORRUPT, "peer address is truncated");
    path.provider.assign(reinterpret_cast<const char*>(p), plen);
    p += plen;
    for (int c = 0; c < kNumClasses; ++c) {
      if (end - p < 2) return set_error(KVXFER_ERR_CORRUPT, "peer address is truncated");
      const size_t n = p[0] | (static_cast<size_t>(p[1]) << 8);
      p += 2;
      if (static_cast<size_t>(end - p) < n || n == 0)
        return set_error(KVXFER_ERR_CORRUPT, "peer address is truncated");
      path.names[c].assign(p, p + n);
      p += n;
    }
  }
  if (p != end) return set_error(KVXFER_ERR_CORRUPT, "peer address has trailing bytes");

  // Choose: shared memory when both offer it on one host, else the network
  // provider both offer.  Both sides apply the same rule to the same two
  // blobs, so they choose alike.
  const bool same_host = peer_host == host_identity() &&
                         (cfg_.shm_in_process || peer_pid != static_cast<uint32_t>(getpid()));
  const Path* pick = nullptr;
  bool pick_shm = false;
  for (const Path& path : theirs) {
    if (path.provider == kShmProvider) {
      const bool mine = shm_domain_ != nullptr || domain_->provider() == kShmProvider;
      if (mine && same_host) {
        pick = &path;
        pick_shm = true;
        break;
      }
    } else if (path.provider == domain_->provider() && domain_->provider() != kShmProvider) {
      if (pick == nullptr) pick = &path;
    }
  }
  if (pick == nullptr) {
    std::string offered;
    for (const Path& path : theirs) offered += (offered.empty() ? "" : ", ") + path.provider;
    std::string mine = domain_->provider();
    if (shm_domain_) mine = std::string(kShmProvider) + ", " + mine;
    return set_error(KVXFER_ERR_MISMATCH,
                     "no path to the peer: it offers %s, this side %s%s (set KVXFER_OFI_PROVIDER "
                     "to the same value on both, or leave it empty on both)",
                     offered.c_str(), mine.c_str(),
                     same_host ? "" : "; shm needs both on one host");
  }
  if (pick_shm && shm_domain_) {  // the network path goes; shared memory takes its place
    for (auto& e : ep_) e.reset();
    domain_ = std::move(shm_domain_);
    ep_ = std::move(shm_ep_);
    apply_path_limits();
    dscp_ = DscpReport{};
    dscp_.note = "same-host peer over shm: no sockets to mark";
  }
  for (auto& e : shm_ep_) e.reset();
  shm_domain_.reset();
  shm_path_ = pick_shm;
  for (int c = 0; c < kNumClasses; ++c) peer_name_[c] = pick->names[c];
  if (shm_path_) {
    peer_pid_ = peer_pid;
    for (int c = 0; c < kNumClasses; ++c) peer_region_[c] = smr::region_file(peer_name_[c]);
    // libfabric 1.17 keeps a closed endpoint's region in its per-process
    // list of names, and fi_av_insert of that name maps the freed region
    // (SIGSEGV).  A closed endpoint's file is gone, so check it first.
    for (int c = 0; c < kNumClasses; ++c) {
      struct stat st {};
      if (::stat(peer_region_[c].c_str(), &st) != 0)
        return fail_link(KVXFER_ERR_SYSTEM,
                         strprintf("the peer's shared-memory endpoint %s is gone (%s)",
                                   peer_region_[c].c_str(), std::strerror(errno)));
      // fi_av_insert maps the file and trusts its header: a file that is
      // not the peer's region (a corrupt or hostile address) would crash
      // this process inside libfabric.  Check it is one first.
      std::string why;
      if (!smr::region_plausible(peer_region_[c], st, peer_pid, &why))
        return fail_link(KVXFER_ERR_CORRUPT,
                         strprintf("the peer's shared-memory endpoint %s is not one: %s",
                                   peer_region_[c].c_str(), why.c_str()));
    }
#ifdef SYS_pidfd_open
    peer_pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(peer_pid), 0));
#endif
    std::vector<std::string> regions(peer_region_.begin(), peer_region_.end());
    for (int c = 0; c < kNumClasses; ++c) regions.push_back(smr::region_file(ep_[c]->name()));
    shm_watch_ =
        ShmLockWatch::start(peer_pidfd_, peer_pid_, regions, &progress_epoch_, cfg_.timeout_ms);
    // The peer's doorbell, if it made one (a peer without one is polled).
    // Not a FIFO (a hostile address naming another file): not written to.
    const std::string bell = bell_file(peer_name_[0]);
    peer_bell_fd_ = ::open(bell.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY);
    struct stat bst {};
    if (peer_bell_fd_ >= 0 && (::fstat(peer_bell_fd_, &bst) != 0 || !S_ISFIFO(bst.st_mode) ||
                               bst.st_uid != ::geteuid())) {
      ::close(peer_bell_fd_);
      peer_bell_fd_ = -1;
    }
    // Both sides' signal words, which say when to ring and when not to
    // sleep; another region layout has no doorbell.
    for (int c = 0; c < kNumClasses && bell_fd_ >= 0; ++c)
      if (!own_signal_[c].map(smr::region_file(ep_[c]->name())) ||
          !peer_signal_[c].map(peer_region_[c]))
        close_bell();
    KVXFER_INFO(LOG_NET, "OFI : peer pid %u is on this host: shared memory (%s)%s", peer_pid,
                peer_region_[0].c_str(), peer_bell_fd_ >= 0 ? ", doorbell" : ", no doorbell");
  } else {
    close_bell();  // the network path signals its own completions
  }
  for (int c = 0; c < kNumClasses; ++c)
    KVXFER_CHECK(ep_[c]->insert_peer(peer_name_[c].data(), peer_name_[c].size(), &peer_[c]));

  // Handshake: an 8-byte hello each way on each class, so that the provider's
  // connections exist (and can be DSCP-marked) before the first data chunk.
  connecting_ = true;
  connect_started_ = Clock::now();
  hello_pending_ = 0;
  for (int c = 0; c < kNumClasses; ++c) {
    hello_out_[c] = peer_bell_fd_ >= 0 ? kHelloRingsMagic : kHelloMagic;
    Ctx* r = new_ctx(nullptr, static_cast<TrafficClass>(c), kHelloRecv, 0, sizeof(uint64_t));
    kvxfer_result_t rc =
        ep_[c]->post_recv(&hello_buf_[c], sizeof(uint64_t), wire_tag(kHelloUserTag, 0), r);
    if (rc != KVXFER_SUCCESS) {
      free_ctx(r);
      return fail_link(rc < 0 ? rc : KVXFER_ERR_SYSTEM, "cannot post the handshake receive");
    }
    ++hello_pending_;
    hello_unsent_[c] = true;
    ++hello_pending_;
  }
  return post_hellos();
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::post_hellos() {
  // rxm answers -FI_EAGAIN while it connects: retried from progress().
  for (int c = 0; c < kNumClasses; ++c) {
    if (!hello_unsent_[c]) continue;
    Ctx* s = new_ctx(nullptr, static_cast<TrafficClass>(c), kHelloSend, 0, sizeof(uint64_t));
    const kvxfer_result_t rc = ep_[c]->post_send(&hello_out_[c], sizeof(uint64_t), peer_[c],
                                                 wire_tag(kHelloUserTag, 0), s);
    if (rc == KVXFER_SUCCESS) {
      hello_unsent_[c] = false;
      stirred_ = posted_after_read_ = true;
      continue;
    }
    free_ctx(s);
    if (rc != KVXFER_IN_PROGRESS) return fail_link(rc, "cannot post the handshake send");
  }
  return KVXFER_SUCCESS;
}

// Before posting receives (after the last CQ read): whether rxm still holds
// the connection to the peer (dscp.h explains the libfabric 1.17 bug this
// avoids).  The socket found first is re-checked with two system calls; a
// rescan only when that fails.  Providers whose sockets cannot tell are not
// checked again.
bool Link::connection_open(int c) {
  if (shm_path_ || !probe_conn_[c]) return true;
  if (conn_[c].fd >= 0 && conn_socket_open(conn_[c])) return true;
  conn_[c] = ConnSocket{};
  switch (find_conn_socket(ep_[c]->name(), peer_name_[c], &conn_[c])) {
    case ConnState::kOpen: return true;
    case ConnState::kUnknown: probe_conn_[c] = false; return true;
    case ConnState::kGone: break;
  }
  return false;
}

// A peer that exits, is killed or destroys its communicator closes its
// sockets.  rxm (libfabric 1.17) then neither flushes the receives posted for
// it nor fails the sends still queued behind a rate limiter, so without this
// check such operations wait for the whole timeout (30 s by default).  The
// socket must be closed by the peer AND fully read on two checks kLivenessMs
// apart, with progress in between: a peer that sent its last STATUS and then
// closed is seen only after that STATUS has been read and delivered.  Idle
// links are checked too, so that a peer that dies between requests is found
// as soon (the engine then releases its state, and an endpoint's next
// connect to it makes a new connection).
kvxfer_result_t Link::check_liveness() {
  // A killed same-host peer leaves its regions in /dev/shm (tmpfs: memory)
  // for good.  The pidfd names exactly that process, so once it is readable
  // they are no one's: remove them, with or without operations in flight (an
  // operation may have failed first, on the provider's error).
  if (shm_path_ && peer_pidfd_ >= 0 && !peer_regions_removed_) {
    pollfd f{peer_pidfd_, POLLIN, 0};
    if (::poll(&f, 1, 0) > 0) {
      for (const std::string& r : peer_region_) (void)::unlink(r.c_str());
      (void)::unlink(bell_file(peer_name_[0]).c_str());  // killed before its link was ready
      peer_regions_removed_ = true;
    }
  }
  if (shm_path_) {
    // No sockets: the peer's process (a pidfd turns readable when it exits)
    // and its regions (its endpoint close unlinks them).  Twice in a row, as
    // above, so that what it sent before it went is read first.
    std::string gone;
    if (peer_regions_removed_)  // its pidfd turned readable (above)
      gone = strprintf("the peer process (pid %u) exited or was killed", peer_pid_);
    for (int c = 0; c < kNumClasses && gone.empty(); ++c) {
      struct stat st {};
      if (::stat(peer_region_[c].c_str(), &st) != 0 && errno == ENOENT)
        gone = strprintf(
            "the peer closed its shared-memory endpoint of the %s class (%s): it "
            "destroyed its communicator or exited",
            class_name(static_cast<TrafficClass>(c)), peer_region_[c].c_str());
    }
    if (gone.empty()) {
      peer_closed_checks_ = {};
      return KVXFER_SUCCESS;
    }
    if (++peer_closed_checks_[0] >= 2) return fail_link(KVXFER_ERR_SYSTEM, gone);
    return KVXFER_SUCCESS;
  }
  for (int c = 0; c < kNumClasses; ++c) {
    if (!probe_conn_[c]) continue;
    const char* cls = class_name(static_cast<TrafficClass>(c));
    if (!connection_open(c))
      return fail_link(KVXFER_ERR_SYSTEM,
                       strprintf("the connection to the peer on the %s class is gone (the peer "
                                 "exited, was killed or destroyed its communicator)",
                                 cls));
    if (!probe_conn_[c] || !conn_socket_closed_by_peer(conn_[c])) {
      peer_closed_checks_[c] = 0;
      continue;
    }
    if (++peer_closed_checks_[c] >= 2)
      return fail_link(KVXFER_ERR_SYSTEM,
                       strprintf("the peer closed its connection on the %s class (it exited, was "
                                 "killed or destroyed its communicator)",
                                 cls));
  }
  return KVXFER_SUCCESS;
}

void Link::mark_sockets() {
  if (!dscp_.supported) return;
  for (int c = 0; c < kNumClasses; ++c) {
    if (!ep_[c]) continue;  // dscp -1: inspect and report, do not mark
    const auto* local = reinterpret_cast<const sockaddr*>(ep_[c]->name().data());
    const sockaddr* peer = nullptr;
    if (is_inet_sockaddr(peer_name_[c].data(), peer_name_[c].size()))
      peer = reinterpret_cast<const sockaddr*>(peer_name_[c].data());
    const std::vector<MarkedSocket> marked = mark_matching_sockets(local, peer, cfg_.dscp[c]);
    dscp_.sockets[c] = static_cast<int>(marked.size());
    // Report what the provider had set on the connections it made itself.
    for (const MarkedSocket& m : marked) {
      if (!m.connected) continue;
      if (dscp_.tos_before[c] < 0 || !m.by_local) dscp_.tos_before[c] = m.tos_before;
      dscp_.tos_after[c] = m.tos_after;
      if (m.nodelay >= 0) dscp_.nodelay[c] = m.nodelay;
      if (!m.by_local) break;
    }
    if (dscp_.tos_after[c] < 0 && !marked.empty()) dscp_.tos_after[c] = marked.front().tos_after;
    KVXFER_INFO(LOG_NET,
                "OFI : DSCP %d (-1: none) on %zu %s socket(s) (TOS before %d, after %d, "
                "TCP_NODELAY %d)",
                cfg_.dscp[c], marked.size(), class_name(static_cast<TrafficClass>(c)),
                dscp_.tos_before[c], dscp_.tos_after[c], dscp_.nodelay[c]);
  }
}

}  // namespace kvxfer::transport
