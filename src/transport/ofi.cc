#include "transport/ofi.h"

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
#include "transport/shm_reaper.h"

namespace kvxfer::transport {

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------
namespace {

kvxfer_result_t fi_fail(const char* call, int ret) {
  return set_error(KVXFER_ERR_SYSTEM, "%s failed: %s (%d)", call, fabric_lib::strerror(-ret), ret);
}

// Wire format.  Chunk 0 of a message is this header; chunks 1..n carry the
// data.  The libfabric tag of chunk i of a message with user tag t is
// (t << 24) | i.  Hosts are little-endian (x86-64, aarch64).
constexpr int kChunkBits = 24;
constexpr uint64_t kMaxChunks = (uint64_t{1} << kChunkBits) - 1;
constexpr uint64_t kHelloUserTag = (uint64_t{1} << 40) - 1;  // reserved: Link::kMaxTag + 1
constexpr uint64_t kMaxPeerChunk = uint64_t{1} << 30;

uint64_t wire_tag(uint64_t user_tag, uint64_t chunk) { return (user_tag << kChunkBits) | chunk; }

// Address blob (docs/TRANSPORT.md, "Address blob"): "KVXL" | version |
// nclasses | npaths | u8 host length, host_identity() | u32 pid |
// npaths x (u8 provider length, provider, nclasses x (u16 length, fi_getname
// bytes)).
constexpr char kBlobMagic[4] = {'K', 'V', 'X', 'L'};
constexpr uint8_t kBlobVersion = 2;
constexpr int kMaxPaths = 2;

enum Kind : int { kHelloSend, kHelloRecv, kHeader, kData };

/** The /dev/shm file of a shm endpoint name ("fi_shm://<pid>:<uid>:<n>"). */
std::string shm_region_file(const std::vector<uint8_t>& name) {
  const std::string n(reinterpret_cast<const char*>(name.data()),
                      strnlen(reinterpret_cast<const char*>(name.data()), name.size()));
  const size_t slash = n.rfind('/');
  return "/dev/shm/" + (slash == std::string::npos ? n : n.substr(slash + 1));
}

}  // namespace

WireHeader make_wire_header(uint32_t chunk_bytes, uint64_t total, uint64_t tag) {
  WireHeader h{};
  h.magic = kWireMagic;
  h.version = kWireVersion;
  h.chunk_bytes = chunk_bytes;
  h.total = total;
  h.tag = tag;
  return h;
}

bool wire_header_ok(const WireHeader& h, size_t len, uint64_t tag) {
  return len == sizeof(WireHeader) && h.magic == kWireMagic && h.version == kWireVersion &&
         h.tag == tag && h.chunk_bytes != 0 && h.chunk_bytes <= kMaxPeerChunk &&
         h.total / h.chunk_bytes + (h.total % h.chunk_bytes != 0) <= kMaxChunks;  // no wrap
}

void close_fid(fid_t f, const char* what) noexcept {
  const int r = fi_close(f);
  if (r == 0) return;
  if (r == -FI_EBUSY && (std::strcmp(what, "domain") == 0 || std::strcmp(what, "fabric") == 0)) {
    // libfabric 1.17 rxm keeps the registration of a rendezvous send that an
    // endpoint close cancelled, so its domain stays busy and is leaked (a few
    // hundred bytes; no memory is pinned and no buffer is touched again).
    KVXFER_INFO(LOG_NET, "OFI : fi_close(%s) busy after cancelled transfers; leaked", what);
    return;
  }
  KVXFER_WARN(LOG_NET, "OFI : fi_close(%s) failed: %s (%d)", what, fabric_lib::strerror(-r), r);
}

const char* class_name(TrafficClass c) {
  return c == TrafficClass::kAnchor ? "anchor" : "residual";
}

namespace {
// FI_TC_<name> of each params::Tclass, in the order of KVXFER_TRAFFIC_CLASSES.
#define KVXFER_FI_TC_(e, name) FI_TC_##name,
constexpr uint32_t kFiTc[] = {KVXFER_TRAFFIC_CLASSES(KVXFER_FI_TC_)};
#undef KVXFER_FI_TC_
static_assert(sizeof(kFiTc) / sizeof(kFiTc[0]) == params::Choices<params::Tclass>::count);
}  // namespace

uint32_t tclass_value(params::Tclass c, int dscp) {
  const uint32_t v = kFiTc[params::choice_index(c)];
  return v == FI_TC_DSCP ? fi_tc_dscp_set(static_cast<uint8_t>(dscp)) : v;
}

bool tclass_from_name(const std::string& name, int dscp, uint32_t* out) {
  params::Tclass c;
  std::string why;
  if (dscp < 0 || dscp > 63 || !params::parse_enum(name.c_str(), &c, &why)) return false;
  *out = tclass_value(c, dscp);
  return true;
}

std::string tclass_to_string(uint32_t tclass) {
  if ((tclass & ~0xFFu) == FI_TC_DSCP)
    return strprintf("DSCP(%u)", static_cast<unsigned>(fi_tc_dscp_get(tclass)));
  // LABEL and BEST_EFFORT share one value; name it BEST_EFFORT.
  if (tclass == FI_TC_BEST_EFFORT) return "BEST_EFFORT";
  using Names = params::Choices<params::Tclass>;
  for (size_t i = 0; i < Names::count; ++i)
    if (kFiTc[i] == tclass && kFiTc[i] != FI_TC_DSCP) return Names::names[i];
  return strprintf("0x%x", tclass);
}

// ---------------------------------------------------------------------------
// Domain
// ---------------------------------------------------------------------------
const std::vector<std::string>& auto_providers() {
  // Measured on the development machines (docs/TRANSPORT.md, "Providers"):
  // tcp;ofi_rxm is the reference; net;ofi_rxm and net (libfabric 1.17's new
  // tcp provider, with its own RDM) pass the whole suite as well.  sockets and
  // udp;ofi_rxd complete sends the receiver never posted (no backpressure),
  // so they are used only when named.
  static const std::vector<std::string> list = {"tcp;ofi_rxm", "net;ofi_rxm", "net"};
  return list;
}

const std::string& host_identity() {
  static const std::string id = [] {
    std::string boot = "?";
    if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "re")) {
      char buf[64] = {0};
      if (std::fgets(buf, sizeof buf, f) != nullptr) boot.assign(buf, strcspn(buf, "\n"));
      std::fclose(f);
    }
    struct stat pidns {};
    struct stat shm {};
    if (::stat("/proc/self/ns/pid", &pidns) != 0) pidns.st_ino = 0;
    if (::stat("/dev/shm", &shm) != 0) shm.st_dev = shm.st_ino = 0;
    return strprintf("%s/pidns:%llu/shm:%llu:%llu/uid:%u", boot.c_str(),
                     static_cast<unsigned long long>(pidns.st_ino),
                     static_cast<unsigned long long>(shm.st_dev),
                     static_cast<unsigned long long>(shm.st_ino), static_cast<unsigned>(getuid()));
  }();
  return id;
}

std::string apply_provider_memory_defaults() {
  static std::once_flag once;
  static std::string set;
  std::call_once(once, [] {
    static const char* const kDefaults[][2] = {
        {"FI_OFI_RXM_MSG_RX_SIZE", "16"},
        {"FI_OFI_RXM_BUFFER_SIZE", "4096"},
        {"FI_OFI_RXM_EAGER_LIMIT", "16384"},
    };
    for (const auto& kv : kDefaults) {
      if (std::getenv(kv[0]) != nullptr) continue;  // the user's value wins
      if (setenv(kv[0], kv[1], 0) == 0)
        set += strprintf("%s%s=%s", set.empty() ? "" : " ", kv[0], kv[1]);
    }
  });
  return set;
}

kvxfer_result_t Domain::open(const std::string& provider, const std::string& node,
                             std::shared_ptr<Domain>* out) {
  KVXFER_CHECK(fabric_lib::load());  // sets the provider memory defaults first
  static std::once_flag logged;
  const std::string set = apply_provider_memory_defaults();
  std::call_once(logged, [&] {
    if (!set.empty())
      KVXFER_INFO(LOG_ENV, "OFI : provider memory defaults %s (set before libfabric's first use)",
                  set.c_str());
  });
  std::vector<std::string> candidates;
  if (provider.empty()) {
    candidates = auto_providers();
  } else {
    candidates.push_back(provider);
  }
  std::string tried;
  for (const std::string& p : candidates) {
    InfoPtr hints(fabric_lib::dupinfo(nullptr));
    if (!hints) return set_error(KVXFER_ERR_OUT_OF_MEMORY, "fi_allocinfo failed");
    hints->caps = FI_MSG | FI_TAGGED;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = 0;  // no registration: plain host memory
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->fabric_attr->prov_name = strdup(p.c_str());
    fi_info* raw = nullptr;
    // shm names each endpoint after its source address; with none given it
    // uses the pid and a per-process counter, unique on the host.  (A node
    // gives every process the same names: fi_enable fails with -FI_EBUSY.)
    const bool no_node = node.empty() || p == kShmProvider;
    const int r = no_node ? fabric_lib::getinfo(kFiVersion, nullptr, nullptr, 0, hints.get(), &raw)
                          : fabric_lib::getinfo(kFiVersion, node.c_str(), nullptr, FI_SOURCE,
                                                hints.get(), &raw);
    InfoPtr list(raw);
    if (r != 0 || raw == nullptr) {
      tried +=
          strprintf("%s%s: %s", tried.empty() ? "" : "; ", p.c_str(), fabric_lib::strerror(-r));
      KVXFER_INFO(LOG_NET, "OFI : provider %s unavailable: %s", p.c_str(),
                  fabric_lib::strerror(-r));
      continue;
    }
    // Prefer the entry whose provider is exactly the one asked for ("net"
    // lists both native "net" and "net;ofi_rxm").
    const fi_info* pick = raw;
    for (const fi_info* i = raw; i != nullptr; i = i->next)
      if (p == i->fabric_attr->prov_name) {
        pick = i;
        break;
      }
    std::shared_ptr<Domain> d(new Domain());
    d->info_.reset(fabric_lib::dupinfo(pick));
    if (!d->info_) return set_error(KVXFER_ERR_OUT_OF_MEMORY, "fi_dupinfo failed");
    d->provider_ = d->info_->fabric_attr->prov_name;
    fid_fabric* fabric = nullptr;
    int rc = fabric_lib::fabric(d->info_->fabric_attr, &fabric, nullptr);
    if (rc != 0) return fi_fail("fi_fabric", rc);
    d->fabric_.reset(fabric);
    fid_domain* domain = nullptr;
    rc = fi_domain(fabric, d->info_.get(), &domain, nullptr);
    if (rc != 0) return fi_fail("fi_domain", rc);
    d->domain_.reset(domain);
    if (const int n = restore_crash_signals(); n > 0)
      KVXFER_INFO(LOG_INIT,
                  "OFI : default action restored for %d signal(s) that libinfinipath or "
                  "libpsm took over",
                  n);
    KVXFER_INFO(LOG_NET, "OFI : provider %s (asked %s), domain %s, node %s", d->provider_.c_str(),
                p.c_str(), d->info_->domain_attr->name, no_node ? "(default)" : node.c_str());
    *out = std::move(d);
    return KVXFER_SUCCESS;
  }
  return set_error(provider.empty() ? KVXFER_ERR_UNSUPPORTED : KVXFER_ERR_INVALID_ARGUMENT,
                   "no usable libfabric RDM provider%s%s (%s)", provider.empty() ? "" : " named ",
                   provider.c_str(), tried.c_str());
}

// ---------------------------------------------------------------------------
// Endpoint
// ---------------------------------------------------------------------------
kvxfer_result_t Endpoint::open(std::shared_ptr<Domain> domain, uint32_t tclass,
                               std::unique_ptr<Endpoint>* out) {
  std::unique_ptr<Endpoint> e(new Endpoint());
  e->domain_ = std::move(domain);
  e->tclass_ = tclass;
  e->info_.reset(fabric_lib::dupinfo(e->domain_->info()));
  if (!e->info_) return set_error(KVXFER_ERR_OUT_OF_MEMORY, "fi_dupinfo failed");
  e->info_->tx_attr->tclass = tclass;

  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_TAGGED;
  // A file descriptor to sleep on when there is nothing to do
  // (Link::prepare_wait); a provider without one is polled.  shm's peers
  // never signal it (libfabric 1.17 wakes no one across processes), so shm
  // is always polled.
  const bool shm = e->domain_->provider() == kShmProvider;
  cq_attr.wait_obj = shm ? FI_WAIT_NONE : FI_WAIT_FD;
  fid_cq* cq = nullptr;
  int r = fi_cq_open(e->domain_->fid(), &cq_attr, &cq, nullptr);
  if (r != 0 && !shm) {
    cq_attr.wait_obj = FI_WAIT_NONE;
    r = fi_cq_open(e->domain_->fid(), &cq_attr, &cq, nullptr);
  } else if (!shm && fi_control(&cq->fid, FI_GETWAIT, &e->wait_fd_) != 0) {
    e->wait_fd_ = -1;
  }
  if (r != 0) return fi_fail("fi_cq_open", r);
  e->cq_.reset(cq);

  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  av_attr.count = 4;
  fid_av* av = nullptr;
  r = fi_av_open(e->domain_->fid(), &av_attr, &av, nullptr);
  if (r != 0) return fi_fail("fi_av_open", r);
  e->av_.reset(av);

  fid_ep* ep = nullptr;
  r = fi_endpoint(e->domain_->fid(), e->info_.get(), &ep, nullptr);
  if (r != 0) return fi_fail("fi_endpoint", r);
  e->ep_.reset(ep);
  r = fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV);
  if (r != 0) return fi_fail("fi_ep_bind(cq)", r);
  r = fi_ep_bind(ep, &av->fid, 0);
  if (r != 0) return fi_fail("fi_ep_bind(av)", r);
  r = fi_enable(ep);
  if (r != 0) return fi_fail("fi_enable", r);

  size_t len = 64;
  e->name_.resize(len);
  r = fi_getname(&ep->fid, e->name_.data(), &len);
  if (r == -FI_ETOOSMALL) {
    e->name_.resize(len);
    r = fi_getname(&ep->fid, e->name_.data(), &len);
  }
  if (r != 0) return fi_fail("fi_getname", r);
  e->name_.resize(len);
  *out = std::move(e);
  return KVXFER_SUCCESS;
}

bool Endpoint::trywait() {
  if (!cq_ || wait_fd_ < 0) return false;
  fid* f = &cq_->fid;
  return fi_trywait(domain_->fabric(), &f, 1) == FI_SUCCESS;
}

void Endpoint::close() {
  wait_fd_ = -1;
  ep_.reset();
  av_.reset();
  cq_.reset();
}

kvxfer_result_t Endpoint::insert_peer(const void* addr, size_t len, fi_addr_t* out) {
  if (!ep_) return set_error(KVXFER_ERR_INVALID_USAGE, "endpoint is closed");
  KVXFER_REQUIRE(addr != nullptr && len > 0, "empty peer address");
  (void)len;  // the provider knows its own address length
  const int n = fi_av_insert(av_.get(), addr, 1, out, 0, nullptr);
  if (n != 1)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "fi_av_insert rejected the peer address (%d)", n);
  return KVXFER_SUCCESS;
}

kvxfer_result_t Endpoint::post_send(const void* buf, size_t len, fi_addr_t dest, uint64_t tag,
                                    void* ctx) {
  if (!ep_) return set_error(KVXFER_ERR_INVALID_USAGE, "endpoint is closed");
  const ssize_t r = fi_tsend(ep_.get(), buf, len, nullptr, dest, tag, ctx);
  if (r == 0) return KVXFER_SUCCESS;
  if (r == -FI_EAGAIN) return KVXFER_IN_PROGRESS;
  return fi_fail("fi_tsend", static_cast<int>(r));
}

kvxfer_result_t Endpoint::post_recv(void* buf, size_t len, uint64_t tag, void* ctx) {
  if (!ep_) return set_error(KVXFER_ERR_INVALID_USAGE, "endpoint is closed");
  const ssize_t r = fi_trecv(ep_.get(), buf, len, nullptr, FI_ADDR_UNSPEC, tag, 0, ctx);
  if (r == 0) return KVXFER_SUCCESS;
  if (r == -FI_EAGAIN) return KVXFER_IN_PROGRESS;
  return fi_fail("fi_trecv", static_cast<int>(r));
}

kvxfer_result_t Endpoint::cancel(void* ctx) {
  if (!ep_) return set_error(KVXFER_ERR_INVALID_USAGE, "endpoint is closed");
  const ssize_t r = fi_cancel(&ep_->fid, ctx);
  if (r == 0) return KVXFER_SUCCESS;
  return fi_fail("fi_cancel", static_cast<int>(r));
}

kvxfer_result_t Endpoint::poll(CqEvent* out, size_t max, size_t* n) {
  *n = 0;
  if (!cq_) return set_error(KVXFER_ERR_INVALID_USAGE, "endpoint is closed");
  fi_cq_tagged_entry entries[32];
  while (*n < max) {
    const size_t want = std::min(max - *n, sizeof(entries) / sizeof(entries[0]));
    const ssize_t r = fi_cq_read(cq_.get(), entries, want);
    if (r == -FI_EAGAIN) return KVXFER_SUCCESS;
    if (r == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      const ssize_t e = fi_cq_readerr(cq_.get(), &err, 0);
      if (e == -FI_EAGAIN) return KVXFER_SUCCESS;
      if (e < 0) return fi_fail("fi_cq_readerr", static_cast<int>(e));
      CqEvent& ev = out[(*n)++];
      ev.context = err.op_context;
      ev.len = err.len;
      ev.tag = err.tag;
      ev.err = err.err != 0 ? err.err : FI_EOTHER;
      ev.prov_errno = err.prov_errno;
      continue;
    }
    if (r < 0) return fi_fail("fi_cq_read", static_cast<int>(r));
    for (ssize_t i = 0; i < r; ++i) {
      CqEvent& ev = out[(*n)++];
      ev.context = entries[i].op_context;
      ev.len = entries[i].len;
      ev.tag = entries[i].tag;
      ev.err = 0;
      ev.prov_errno = 0;
    }
    if (static_cast<size_t>(r) < want) return KVXFER_SUCCESS;
  }
  return KVXFER_SUCCESS;
}

// ---------------------------------------------------------------------------
// LinkConfig
// ---------------------------------------------------------------------------
kvxfer_result_t LinkConfig::from_params(LinkConfig* out) {
  KVXFER_CHECK(params::validate());
  LinkConfig c;
  c.provider = params::OfiProvider();
  const int anchor_dscp = static_cast<int>(params::AnchorDscp());
  const int residual_dscp = static_cast<int>(params::ResidualDscp());
  c.tclass = {tclass_value(params::AnchorTc(), anchor_dscp),
              tclass_value(params::ResidualTc(), residual_dscp)};
  c.dscp = {anchor_dscp, residual_dscp};
  c.chunk_bytes = static_cast<size_t>(params::NetChunkBytes());
  c.residual_inflight_bytes = static_cast<size_t>(params::ResidualInflightBytes());
  c.timeout_ms = params::TimeoutMs();
  KVXFER_CHECK(RateLimiter::from_params(&c.limiter));
  *out = std::move(c);
  return KVXFER_SUCCESS;
}

// ---------------------------------------------------------------------------
// Link internals
// ---------------------------------------------------------------------------
struct Link::Op {
  uint64_t id = 0;
  TrafficClass cls = TrafficClass::kAnchor;
  bool is_send = false;
  uint64_t tag = 0;
  uint8_t* buf = nullptr;
  size_t size = 0;           // send: length; receive: capacity
  WireHeader hdr{};          // send: what goes out; receive: where the header lands
  uint64_t total = 0;        // message length
  uint64_t chunk = 0;        // chunk size (receive: the sender's)
  uint32_t nchunks = 0;      // data chunks
  uint32_t next_post = 0;    // next chunk to post: 0 = header, 1..nchunks = data
  uint32_t done_chunks = 0;  // chunks completed, header included
  uint32_t outstanding = 0;  // contexts of this op held by the provider
  uint64_t bytes_done = 0;   // data bytes completed
  bool have_header = false;  // receive: header arrived
  bool queued = false;       // in send_queue_ / recv_queue_
  bool reported = false;     // its Completion was emitted
  bool cancelling = false;   // receive: outstanding posts being cancelled
  bool draining = false;     // receive: too small, data lands in scratch
  kvxfer_result_t pending_code = KVXFER_SUCCESS;  // reported once cancelling settles
  std::string pending_why;
  std::unique_ptr<uint8_t[]> scratch;
  Clock::time_point posted, last_activity, cancel_deadline;

  bool has_work() const {
    if (cancelling) return false;
    if (is_send) return next_post <= nchunks;
    return next_post == 0 || (have_header && next_post <= nchunks);
  }
};

struct Link::Ctx {
  fi_context2 fi;  // must be first: the provider's scratch space
  Op* op;
  TrafficClass cls;
  int kind;
  uint32_t index;
  size_t bytes;
};

Link::Ctx* Link::new_ctx(Op* op, TrafficClass c, int kind, uint32_t index, size_t bytes) {
  Ctx* ctx = new Ctx();
  ctx->op = op;
  ctx->cls = c;
  ctx->kind = kind;
  ctx->index = index;
  ctx->bytes = bytes;
  live_.insert(ctx);
  return ctx;
}

void Link::free_ctx(Ctx* ctx) {
  live_.erase(ctx);
  delete ctx;
}

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
}

size_t Link::ops_in_flight() const {
  size_t n = 0;
  for (const auto& kv : ops_)
    if (!kv.second->reported) ++n;
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
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "peer address is not a kvxfer link address");
  if (p[4] != kBlobVersion)
    return set_error(KVXFER_ERR_MISMATCH,
                     "peer address has version %u, this side %u (different kvxfer versions)", p[4],
                     kBlobVersion);
  if (p[5] != kNumClasses || p[6] < 1 || p[6] > kMaxPaths)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                     "peer address has %u classes and %u paths (expected %d, 1..%d)", p[5], p[6],
                     kNumClasses, kMaxPaths);
  const int npaths = p[6];
  const size_t hlen = p[7];
  p += 8;
  if (static_cast<size_t>(end - p) < hlen + 4)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "peer address is truncated");
  const std::string peer_host(reinterpret_cast<const char*>(p), hlen);
  p += hlen;
  const uint32_t peer_pid =
      p[0] | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
  p += 4;
  std::vector<Path> theirs(static_cast<size_t>(npaths));
  for (Path& path : theirs) {
    if (end - p < 1) return set_error(KVXFER_ERR_INVALID_ARGUMENT, "peer address is truncated");
    const size_t plen = *p++;
    if (static_cast<size_t>(end - p) < plen)
      return set_error(KVXFER_ERR_INVALID_ARGUMENT, "peer address is truncated");
    path.provider.assign(reinterpret_cast<const char*>(p), plen);
    p += plen;
    for (int c = 0; c < kNumClasses; ++c) {
      if (end - p < 2) return set_error(KVXFER_ERR_INVALID_ARGUMENT, "peer address is truncated");
      const size_t n = p[0] | (static_cast<size_t>(p[1]) << 8);
      p += 2;
      if (static_cast<size_t>(end - p) < n || n == 0)
        return set_error(KVXFER_ERR_INVALID_ARGUMENT, "peer address is truncated");
      path.names[c].assign(p, p + n);
      p += n;
    }
  }
  if (p != end) return set_error(KVXFER_ERR_INVALID_ARGUMENT, "peer address has trailing bytes");

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
    for (int c = 0; c < kNumClasses; ++c) peer_region_[c] = shm_region_file(peer_name_[c]);
    // libfabric 1.17 keeps a closed endpoint's region in its per-process
    // list of names, and fi_av_insert of that name maps the freed region
    // (SIGSEGV).  A closed endpoint's file is gone, so check it first.
    for (int c = 0; c < kNumClasses; ++c) {
      struct stat st {};
      if (::stat(peer_region_[c].c_str(), &st) != 0)
        return fail_link(KVXFER_ERR_SYSTEM,
                         strprintf("the peer's shared-memory endpoint %s is gone (%s)",
                                   peer_region_[c].c_str(), std::strerror(errno)));
    }
#ifdef SYS_pidfd_open
    peer_pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(peer_pid), 0));
#endif
    std::vector<std::string> regions(peer_region_.begin(), peer_region_.end());
    for (int c = 0; c < kNumClasses; ++c) regions.push_back(shm_region_file(ep_[c]->name()));
    shm_watch_ =
        ShmLockWatch::start(peer_pidfd_, peer_pid_, regions, &progress_epoch_, cfg_.timeout_ms);
    KVXFER_INFO(LOG_NET, "OFI : peer pid %u is on this host: shared memory (%s)", peer_pid,
                peer_region_[0].c_str());
  }
  for (int c = 0; c < kNumClasses; ++c)
    KVXFER_CHECK(ep_[c]->insert_peer(peer_name_[c].data(), peer_name_[c].size(), &peer_[c]));

  // Handshake: an 8-byte hello each way on each class, so that the provider's
  // connections exist (and can be DSCP-marked) before the first data chunk.
  connecting_ = true;
  connect_started_ = Clock::now();
  hello_pending_ = 0;
  for (int c = 0; c < kNumClasses; ++c) {
    hello_out_[c] = kHelloMagic;
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
      continue;
    }
    free_ctx(s);
    if (rc != KVXFER_IN_PROGRESS) return fail_link(rc, "cannot post the handshake send");
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::post_send(TrafficClass c, const void* buf, size_t len, uint64_t tag,
                                uint64_t* op_id) {
  if (failed_) return set_error(fail_code_, "link failed: %s", fail_why_.c_str());
  KVXFER_REQUIRE(c == TrafficClass::kAnchor || c == TrafficClass::kResidual, "bad traffic class");
  KVXFER_REQUIRE(buf != nullptr || len == 0, "null send buffer");
  KVXFER_REQUIRE(tag <= kMaxTag, "tag %" PRIu64 " above the maximum %" PRIu64, tag, kMaxTag);
  // Messages below rxm's SAR limit travel in eager-size chunks; larger ones in
  // chunk_bytes chunks (rxm rendezvous).  rxm's segmentation-and-reassembly
  // path, between the two, stalled with many messages outstanding
  // (docs/TRANSPORT.md, "Chunk sizes").
  const size_t chunk_bytes =
      len < kSarLimitBytes ? std::min(cfg_.chunk_bytes, kEagerChunkBytes) : cfg_.chunk_bytes;
  const uint64_t nchunks = (len + chunk_bytes - 1) / chunk_bytes;
  KVXFER_REQUIRE(nchunks <= kMaxChunks, "message of %zu bytes needs more than 2^24 chunks", len);
  auto op = std::make_unique<Op>();
  op->id = next_op_id_++;
  op->cls = c;
  op->is_send = true;
  op->tag = tag;
  op->buf = const_cast<uint8_t*>(static_cast<const uint8_t*>(buf));
  op->size = len;
  op->total = len;
  op->chunk = chunk_bytes;
  op->nchunks = static_cast<uint32_t>(nchunks);
  op->hdr = make_wire_header(static_cast<uint32_t>(chunk_bytes), len, tag);
  op->posted = op->last_activity = Clock::now();
  op->queued = true;
  send_queue_[idx(c)].push_back(op.get());
  if (op_id != nullptr) *op_id = op->id;
  ops_.emplace(op->id, std::move(op));
  return KVXFER_SUCCESS;
}

bool Link::empty_unstarted_send(uint64_t op_id) {
  auto it = ops_.find(op_id);
  if (it == ops_.end()) return false;
  Op* op = it->second.get();
  if (!op->is_send || op->reported || op->next_post != 0) return false;
  op->size = 0;
  op->total = 0;
  op->nchunks = 0;
  op->hdr.total = 0;
  return true;
}

kvxfer_result_t Link::post_recv(TrafficClass c, void* buf, size_t cap, uint64_t tag,
                                uint64_t* op_id) {
  if (failed_) return set_error(fail_code_, "link failed: %s", fail_why_.c_str());
  KVXFER_REQUIRE(c == TrafficClass::kAnchor || c == TrafficClass::kResidual, "bad traffic class");
  KVXFER_REQUIRE(buf != nullptr || cap == 0, "null receive buffer");
  KVXFER_REQUIRE(tag <= kMaxTag, "tag %" PRIu64 " above the maximum %" PRIu64, tag, kMaxTag);
  auto op = std::make_unique<Op>();
  op->id = next_op_id_++;
  op->cls = c;
  op->is_send = false;
  op->tag = tag;
  op->buf = static_cast<uint8_t*>(buf);
  op->size = cap;
  op->posted = op->last_activity = Clock::now();
  op->queued = true;
  recv_queue_[idx(c)].push_back(op.get());
  if (op_id != nullptr) *op_id = op->id;
  ops_.emplace(op->id, std::move(op));
  return KVXFER_SUCCESS;
}

void Link::finish(Op* op, kvxfer_result_t code, const std::string& why, Clock::time_point now) {
  if (op->reported) return;
  op->reported = true;
  Completion cpl;
  cpl.op_id = op->id;
  cpl.tag = op->tag;
  cpl.cls = op->cls;
  cpl.is_send = op->is_send;
  cpl.status = code;
  cpl.error = why;
  cpl.bytes = code == KVXFER_SUCCESS ? op->total : op->bytes_done;
  cpl.posted = op->posted;
  cpl.done = now;
  done_.push_back(std::move(cpl));
}

void Link::maybe_release(Op* op) {
  if (op->reported && op->outstanding == 0 && !op->queued && !op->has_work()) ops_.erase(op->id);
}

kvxfer_result_t Link::fail_link(kvxfer_result_t code, const std::string& why) {
  if (!failed_) {
    KVXFER_WARN(LOG_NET, "OFI : link failed: %s", why.c_str());
    abort_with(code < 0 ? code : KVXFER_ERR_SYSTEM, why);
  }
  return set_error(fail_code_, "link failed: %s", fail_why_.c_str());
}

void Link::abort(const char* why) { abort_with(KVXFER_ERR_SYSTEM, why); }

void Link::abort_with(kvxfer_result_t code, const std::string& why) {
  if (failed_) return;
  failed_ = true;
  ready_ = false;
  fail_code_ = code;
  fail_why_ = why;
  shm_watch_.reset();
  // Closing the endpoints flushes the provider's queues: from here on no
  // posted buffer or context is touched again.
  for (auto& e : ep_)
    if (e) e->close();
  for (Ctx* c : live_) delete c;
  live_.clear();
  const Clock::time_point now = Clock::now();
  for (auto& kv : ops_) {
    Op* op = kv.second.get();
    if (!op->reported)
      finish(
          op, code,
          op->cancelling ? op->pending_why + "; then link aborted: " + why : "link aborted: " + why,
          now);
  }
  ops_.clear();
  for (int c = 0; c < kNumClasses; ++c) {
    send_queue_[c].clear();
    recv_queue_[c].clear();
    recv_data_queue_[c].clear();
    posted_chunks_[c] = inflight_bytes_[c] = posted_recvs_[c] = 0;
  }
}

void Link::fail_recv(Op* op, kvxfer_result_t code, const std::string& why, Clock::time_point now) {
  if (op->cancelling) return;
  op->cancelling = true;
  op->pending_code = code;
  op->pending_why = why;
  // Grace for the provider to return the cancelled receives; past it the link
  // is failed (closing the endpoints is the only other way to get the user's
  // buffer back safely).
  op->cancel_deadline =
      now + std::chrono::milliseconds(std::min<int64_t>(cfg_.timeout_ms, 1000) + 100);
  for (Ctx* ctx : live_)
    if (ctx->op == op) (void)ep_[idx(ctx->cls)]->cancel(ctx);
  if (op->outstanding == 0) finish(op, code, why, now);
}

kvxfer_result_t Link::handle_event(TrafficClass c, const CqEvent& ev, Clock::time_point now) {
  Ctx* ctx = static_cast<Ctx*>(ev.context);
  if (ctx == nullptr || live_.count(ctx) == 0) {
    KVXFER_WARN(LOG_NET, "OFI : completion with unknown context on %s endpoint (err %d)",
                class_name(c), ev.err);
    return KVXFER_SUCCESS;
  }
  live_.erase(ctx);
  std::unique_ptr<Ctx> hold(ctx);
  if (ctx->kind == kHelloSend || ctx->kind == kHelloRecv) {
    if (ev.err != 0)
      return fail_link(KVXFER_ERR_SYSTEM, strprintf("handshake %s on the %s endpoint failed: %s",
                                                    ctx->kind == kHelloSend ? "send" : "receive",
                                                    class_name(c), fabric_lib::strerror(ev.err)));
    if (ctx->kind == kHelloRecv && hello_buf_[idx(c)] != kHelloMagic)
      return fail_link(KVXFER_ERR_CORRUPT, "handshake message from the peer is malformed");
    if (--hello_pending_ == 0) {
      ready_ = true;
      ready_at_ = now;
      mark_sockets();
      KVXFER_INFO(LOG_NET, "OFI : link ready after %.1f ms",
                  std::chrono::duration<double, std::milli>(now - connect_started_).count());
    }
    return KVXFER_SUCCESS;
  }
  Op* op = ctx->op;
  op->outstanding--;
  if (op->is_send) return on_send_done(ctx, ev, now);
  return on_recv_done(ctx, ev, now);
}

kvxfer_result_t Link::on_send_done(Ctx* ctx, const CqEvent& ev, Clock::time_point now) {
  Op* op = ctx->op;
  const int c = idx(ctx->cls);
  posted_chunks_[c]--;
  inflight_bytes_[c] -= ctx->bytes;
  if (ev.err != 0)
    return fail_link(KVXFER_ERR_SYSTEM,
                     strprintf("send of tag %" PRIu64 " chunk %u on the %s endpoint failed: %s "
                               "(provider errno %d)",
                               op->tag, ctx->index, class_name(ctx->cls),
                               fabric_lib::strerror(ev.err), ev.prov_errno));
  op->done_chunks++;
  if (ctx->kind == kData) op->bytes_done += ctx->bytes;
  op->last_activity = now;
  last_send_activity_ = now;
  if (op->done_chunks == op->nchunks + 1) finish(op, KVXFER_SUCCESS, "", now);
  maybe_release(op);
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::on_recv_done(Ctx* ctx, const CqEvent& ev, Clock::time_point now) {
  Op* op = ctx->op;
  const int c = idx(ctx->cls);
  posted_recvs_[c]--;
  if (ev.err == FI_ECANCELED && !op->cancelling) {
    // Not ours: rxm flushes the receives of a connection the peer closed.
    fail_recv(op, KVXFER_ERR_SYSTEM,
              strprintf("receive of tag %" PRIu64 " chunk %u on the %s endpoint was flushed by "
                        "the provider: the connection to the peer is gone (the peer exited, was "
                        "killed or destroyed its communicator)",
                        op->tag, ctx->index, class_name(ctx->cls)),
              now);
  } else if (ev.err != 0 && !(ev.err == FI_ECANCELED && op->cancelling)) {
    fail_recv(op, ev.err == FI_ETRUNC ? KVXFER_ERR_TRUNCATED : KVXFER_ERR_SYSTEM,
              strprintf("receive of tag %" PRIu64 " chunk %u on the %s endpoint failed: %s",
                        op->tag, ctx->index, class_name(ctx->cls), fabric_lib::strerror(ev.err)),
              now);
  }
  if (op->cancelling) {
    if (op->outstanding == 0) finish(op, op->pending_code, op->pending_why, now);
    maybe_release(op);
    return KVXFER_SUCCESS;
  }
  op->last_activity = now;
  last_recv_activity_ = now;
  if (ctx->kind == kHeader) {
    const WireHeader& h = op->hdr;
    if (!wire_header_ok(h, ev.len, op->tag)) {
      fail_recv(op, KVXFER_ERR_CORRUPT,
                strprintf("message header of tag %" PRIu64 " on the %s class is malformed", op->tag,
                          class_name(op->cls)),
                now);
      maybe_release(op);
      return KVXFER_SUCCESS;
    }
    op->have_header = true;
    op->total = h.total;
    op->chunk = h.chunk_bytes;
    op->nchunks = static_cast<uint32_t>((h.total + h.chunk_bytes - 1) / h.chunk_bytes);
    op->done_chunks = 1;
    if (op->total > op->size) {
      // Drain the message into scratch so that the sender completes; the
      // user's buffer is never touched, so the error is reported now.
      op->draining = true;
      op->scratch.reset(new (std::nothrow) uint8_t[std::min<uint64_t>(op->chunk, op->total)]);
      finish(op, KVXFER_ERR_BUFFER_TOO_SMALL,
             strprintf("message of tag %" PRIu64 " on the %s class has %" PRIu64
                       " bytes, the receive only %zu",
                       op->tag, class_name(op->cls), op->total, op->size),
             now);
      if (!op->scratch) op->cancelling = true;  // cannot drain; the sender will time out
    }
    if (op->nchunks == 0) {
      finish(op, KVXFER_SUCCESS, "", now);
    } else if (!op->queued && op->has_work()) {
      // Its data receives go before any header receive still to post: the
      // sender's posted chunks are this message's data, and they complete
      // only once these receives exist.
      op->queued = true;
      recv_data_queue_[c].push_back(op);
    }
    maybe_release(op);
    return KVXFER_SUCCESS;
  }
  // A data chunk.
  const uint64_t off = static_cast<uint64_t>(ctx->index - 1) * op->chunk;
  const uint64_t want = std::min<uint64_t>(op->chunk, op->total - off);
  if (ev.len != want) {
    fail_recv(
        op, KVXFER_ERR_TRUNCATED,
        strprintf("chunk %u of tag %" PRIu64 " on the %s class has %zu bytes, expected %" PRIu64,
                  ctx->index, op->tag, class_name(op->cls), ev.len, want),
        now);
    maybe_release(op);
    return KVXFER_SUCCESS;
  }
  op->done_chunks++;
  op->bytes_done += want;
  if (op->done_chunks == op->nchunks + 1) {
    finish(op, KVXFER_SUCCESS, "", now);  // no-op for a draining op (already reported)
  } else if (!op->queued && op->has_work()) {
    op->queued = true;
    recv_data_queue_[c].push_back(op);  // data first (see the header case)
  }
  maybe_release(op);
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
// closed is seen only after that STATUS has been read and delivered.
kvxfer_result_t Link::check_liveness() {
  if (ops_in_flight() == 0) {
    peer_closed_checks_ = {};
    return KVXFER_SUCCESS;
  }
  if (shm_path_) {
    // No sockets: the peer's process (a pidfd turns readable when it exits)
    // and its regions (its endpoint close unlinks them).  Twice in a row, as
    // above, so that what it sent before it went is read first.
    std::string gone;
    if (peer_pidfd_ >= 0) {
      pollfd f{peer_pidfd_, POLLIN, 0};
      if (::poll(&f, 1, 0) > 0) {
        gone = strprintf("the peer process (pid %u) exited or was killed", peer_pid_);
        // A killed process leaves its regions in /dev/shm (tmpfs: memory)
        // for good.  The pidfd names exactly that process, so they are no
        // one's now: remove them.
        for (const std::string& f : peer_region_) (void)::unlink(f.c_str());
      }
    }
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

kvxfer_result_t Link::post_recvs(Clock::time_point now) {
  (void)now;
  for (int c = 0; c < kNumClasses; ++c) {  // anchor first
    // Two queues, each kept in order: ops whose header has landed and whose
    // data receives are still to post (in the order the headers landed,
    // which is the order the peer sends), served first; then ops still to
    // post their header receive (in the order they were asked for).
    // Header receives may fill only half of the posting window: the other
    // half is kept for data receives, and an op blocked on a header slot
    // does not stop the data receives.  Otherwise receives posted ahead for
    // later messages crowd out the data of the messages the sender is
    // sending now, and both sides stall (seen with more than 128 messages
    // outstanding on a class).  Data receives must also keep the order of
    // their headers: matching an unexpected message happens when its
    // receive is posted, so posting out of order completes messages out of
    // order.
    if (ready_ && (!recv_data_queue_[c].empty() || !recv_queue_[c].empty()) && !connection_open(c))
      return fail_link(KVXFER_ERR_SYSTEM,
                       strprintf("the connection to the peer on the %s class is gone (the peer "
                                 "exited or closed); no more receives are posted on it",
                                 class_name(static_cast<TrafficClass>(c))));
    bool provider_full = false;
    for (auto* qp : {&recv_data_queue_[c], &recv_queue_[c]}) {
      auto& q = *qp;
      std::deque<Op*> keep;
      while (!q.empty() && !provider_full) {
        Op* op = q.front();
        q.pop_front();
        op->queued = false;
        bool blocked = false;
        while (op->has_work()) {
          const bool header = op->next_post == 0;
          if (!header && op->outstanding >= cfg_.recv_window_chunks)
            break;  // requeued on completion
          if (posted_recvs_[c] >= (header ? cfg_.max_posted_recvs / 2 : cfg_.max_posted_recvs)) {
            blocked = true;
            break;
          }
          void* dst;
          size_t len;
          int kind;
          if (header) {
            dst = &op->hdr;
            len = sizeof(WireHeader);
            kind = kHeader;
          } else {
            const uint64_t off = static_cast<uint64_t>(op->next_post - 1) * op->chunk;
            len = static_cast<size_t>(std::min<uint64_t>(op->chunk, op->total - off));
            dst = op->draining ? op->scratch.get() : op->buf + off;
            kind = kData;
          }
          Ctx* ctx = new_ctx(op, static_cast<TrafficClass>(c), kind, op->next_post, len);
          const kvxfer_result_t r =
              ep_[c]->post_recv(dst, len, wire_tag(op->tag, op->next_post), ctx);
          if (r == KVXFER_IN_PROGRESS) {  // the provider's queue is full: retry next progress()
            free_ctx(ctx);
            blocked = provider_full = true;
            break;
          }
          if (r != KVXFER_SUCCESS) {
            free_ctx(ctx);
            return fail_link(r, strprintf("posting a receive on the %s endpoint failed: %s",
                                          class_name(static_cast<TrafficClass>(c)), last_error()));
          }
          op->outstanding++;
          posted_recvs_[c]++;
          op->next_post++;
        }
        if (blocked && op->has_work()) {
          op->queued = true;
          keep.push_back(op);
        } else {
          maybe_release(op);  // waits for its header or a window slot; requeued on completion
        }
      }
      while (!q.empty()) {  // not reached this time (provider full): same order, after `keep`
        keep.push_back(q.front());
        q.pop_front();
      }
      q.swap(keep);
    }
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::schedule_sends(Clock::time_point now) {
  if (!ready_) return KVXFER_SUCCESS;
  for (;;) {
    // Strict priority: a residual chunk is posted only when no anchor chunk is
    // waiting.  When anchors are blocked (provider queue bound, rate limit),
    // residuals wait too.
    int c;
    if (!send_queue_[0].empty()) {
      c = 0;
    } else if (!send_queue_[1].empty()) {
      c = 1;
    } else {
      break;
    }
    if (posted_chunks_[c] >= cfg_.max_posted_chunks) break;
    Op* op = send_queue_[c].front();
    const uint32_t i = op->next_post;
    const void* src;
    size_t bytes;
    if (i == 0) {
      src = &op->hdr;
      bytes = sizeof(WireHeader);
    } else {
      const uint64_t off = static_cast<uint64_t>(i - 1) * op->chunk;
      bytes = static_cast<size_t>(std::min<uint64_t>(op->chunk, op->total - off));
      src = op->buf + off;
    }
    if (c == 1 && inflight_bytes_[1] > 0 &&
        inflight_bytes_[1] + bytes > cfg_.residual_inflight_bytes)
      break;
    if (cfg_.limiter && !cfg_.limiter->try_acquire(bytes, now)) {
      next_wake_ = now + cfg_.limiter->wait_hint(bytes, now);
      break;
    }
    Ctx* ctx = new_ctx(op, static_cast<TrafficClass>(c), i == 0 ? kHeader : kData, i, bytes);
    const kvxfer_result_t r = ep_[c]->post_send(src, bytes, peer_[c], wire_tag(op->tag, i), ctx);
    if (r != KVXFER_SUCCESS) {
      free_ctx(ctx);
      if (cfg_.limiter) cfg_.limiter->refund(bytes);
      if (r == KVXFER_IN_PROGRESS) break;
      return fail_link(r, strprintf("posting a send on the %s endpoint failed: %s",
                                    class_name(static_cast<TrafficClass>(c)), last_error()));
    }
    op->outstanding++;
    op->next_post++;
    posted_chunks_[c]++;
    inflight_bytes_[c] += bytes;
    stats_.chunks_posted[c]++;
    stats_.bytes_posted[c] += bytes;
    if (c == 1)
      stats_.max_residual_inflight = std::max(stats_.max_residual_inflight, inflight_bytes_[1]);
    if (op->next_post > op->nchunks) {
      send_queue_[c].pop_front();
      op->queued = false;
    }
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::check_timeouts(Clock::time_point now) {
  const auto timeout = std::chrono::milliseconds(cfg_.timeout_ms);
  if (connecting_ && !ready_ && now - connect_started_ > timeout)
    return fail_link(
        KVXFER_ERR_TIMEOUT,
        strprintf("handshake with the peer did not complete within %lld ms (peer dead, "
                  "not connecting, or unreachable)",
                  static_cast<long long>(cfg_.timeout_ms)));
  std::vector<Op*> expired;
  for (auto& kv : ops_) {
    Op* op = kv.second.get();
    if (op->cancelling) {
      if (now > op->cancel_deadline)
        return fail_link(KVXFER_ERR_TIMEOUT,
                         op->pending_why + "; the provider did not return the cancelled receive");
      continue;
    }
    if (op->reported && !op->draining) continue;
    // The timeout detects a peer that is dead or silent, not an operation
    // that waits its turn: while traffic moves on the link in either
    // direction, no operation expires.  An operation can wait a long time
    // behind others for good reasons: a residual behind every anchor of a
    // rate-limited link, a reply (kvxfer's STATUS) after a long transfer the
    // other way, a chunk whose receive the peer posts only when a window
    // slot frees.  Before the link is ready the handshake is the clock (it
    // has its own timeout).
    const bool waiting = op->is_send ? op->outstanding == 0 : !op->have_header;
    if (waiting && connecting_ && !ready_) continue;
    const Clock::time_point last =
        std::max({op->last_activity, ready_at_, last_send_activity_, last_recv_activity_});
    if (now - last > timeout) expired.push_back(op);
  }
  for (Op* op : expired) {
    const std::string why =
        strprintf("%s of tag %" PRIu64 " on the %s class made no progress for %lld ms (%s)",
                  op->is_send ? "send" : "receive", op->tag, class_name(op->cls),
                  static_cast<long long>(cfg_.timeout_ms),
                  op->is_send ? "peer dead or not receiving" : "peer dead or never sent");
    if (op->is_send) {
      if (op->outstanding > 0) return fail_link(KVXFER_ERR_TIMEOUT, why);  // cannot cancel sends
      auto& q = send_queue_[idx(op->cls)];
      q.erase(std::remove(q.begin(), q.end(), op), q.end());
      op->queued = false;
      op->cancelling = true;
      finish(op, KVXFER_ERR_TIMEOUT, why, now);
      maybe_release(op);
    } else {
      fail_recv(op, KVXFER_ERR_TIMEOUT, why, now);
      maybe_release(op);
    }
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t Link::progress() {
  progress_epoch_.fetch_add(1, std::memory_order_relaxed);
  if (failed_) return set_error(fail_code_, "link failed: %s", fail_why_.c_str());
  Clock::time_point now = Clock::now();
  CqEvent evs[64];
  for (int c = 0; c < kNumClasses; ++c) {  // anchor CQ first
    for (int round = 0; round < 8; ++round) {
      size_t n = 0;
      const kvxfer_result_t r = ep_[c]->poll(evs, 64, &n);
      if (r != KVXFER_SUCCESS)
        return fail_link(r, strprintf("reading the %s completion queue failed: %s",
                                      class_name(static_cast<TrafficClass>(c)), last_error()));
      if (n > 0) now = Clock::now();
      for (size_t i = 0; i < n; ++i) {
        KVXFER_CHECK(handle_event(static_cast<TrafficClass>(c), evs[i], now));
        if (failed_) return fail_code_;
      }
      if (n < 64) break;
    }
  }
  next_wake_ = Clock::time_point::max();  // lowered by the rate limiter when it holds a chunk
  if (connecting_ && !ready_) KVXFER_CHECK(post_hellos());
  KVXFER_CHECK(post_recvs(now));
  KVXFER_CHECK(schedule_sends(now));
  if (now - last_timeout_scan_ >= std::chrono::milliseconds(5)) {
    last_timeout_scan_ = now;
    KVXFER_CHECK(check_timeouts(now));
  }
  if (ready_ && now - last_liveness_check_ >= std::chrono::milliseconds(kLivenessMs)) {
    last_liveness_check_ = now;
    KVXFER_CHECK(check_liveness());
  }
  return failed_ ? fail_code_ : KVXFER_SUCCESS;
}

bool Link::prepare_wait(std::vector<pollfd>* fds) {
  if (failed_) return true;
  if (!ready_) return false;  // connecting: rxm's connection events need polling
  // shm has no wait object, but with nothing in flight there is nothing to
  // poll for: what the peer sends waits in this side's region until a post
  // (which wakes the caller) asks for it.
  if (shm_path_ && ops_in_flight() == 0) return true;
  const size_t first = fds->size();
  for (int c = 0; c < kNumClasses; ++c) {
    Endpoint* e = ep_[c].get();
    if (e == nullptr || !e->is_open()) continue;
    if (!e->trywait()) {
      fds->resize(first);
      return false;
    }
    fds->push_back(pollfd{e->wait_fd(), POLLIN, 0});
  }
  return true;
}

size_t Link::poll(std::vector<Completion>* out) {
  (void)progress();
  size_t n = 0;
  while (!done_.empty()) {
    out->push_back(std::move(done_.front()));
    done_.pop_front();
    ++n;
  }
  return n;
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
