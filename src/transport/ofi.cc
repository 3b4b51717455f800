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
#include "transport/smr_region.h"

namespace kvxfer::transport {

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------
namespace {

kvxfer_result_t fi_fail(const char* call, int ret) {
  return set_error(KVXFER_ERR_SYSTEM, "%s failed: %s (%d)", call, fabric_lib::strerror(-ret), ret);
}

}  // namespace

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
        {"FI_OFI_RXM_MSG_RX_SIZE", "16"},     // rxm's receives per connection
        {"FI_OFI_RXM_BUFFER_SIZE", "1024"},   // rxm's bounce buffers
        {"FI_OFI_RXM_EAGER_LIMIT", "16384"},  // kEagerChunkBytes stays eager
        {"FI_UNIVERSE_SIZE", "16"},           // rxm's connection CQ ring
        {"FI_NET_MAX_SAVED", "256"},          // net's small unexpected messages
    };
    // Not setenv: before glibc 2.41 each new variable reallocates (and
    // frees) the environ array, and a getenv on another thread meanwhile
    // reads freed memory (it crashed Comm.ThreeRanksEveryPairExchanges).
    // The variables go into a new array, published with one compare-and-swap
    // of environ; the old one is neither changed nor freed.  The new one is
    // never freed either (not even by static destructors, as a getenv may
    // run after them).
    static auto* const added = new std::vector<std::string>();
    for (const auto& kv : kDefaults) {
      if (std::getenv(kv[0]) != nullptr) continue;  // the user's value wins
      added->push_back(strprintf("%s=%s", kv[0], kv[1]));
      set += strprintf("%s%s", set.empty() ? "" : " ", added->back().c_str());
    }
    if (added->empty()) return;
    static auto* const fresh = new std::vector<char*>();
    char** old = __atomic_load_n(&environ, __ATOMIC_ACQUIRE);
    do {  // again if environ was replaced meanwhile (a setenv that added a variable)
      size_t n = 0;
      while (old != nullptr && old[n] != nullptr) ++n;
      fresh->assign(old, old + n);
      for (std::string& v : *added) fresh->push_back(v.data());
      fresh->push_back(nullptr);
    } while (!__atomic_compare_exchange_n(&environ, &old, fresh->data(), false, __ATOMIC_RELEASE,
                                          __ATOMIC_ACQUIRE));
  });
  return set;
}

kvxfer_result_t Domain::open(const std::string& provider, const std::string& node,
                             std::shared_ptr<Domain>* out, bool directed_recv) {
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
    hints->caps = FI_MSG | FI_TAGGED | (directed_recv ? FI_DIRECTED_RECV : 0);
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
    if (d->provider_ == kShmProvider) {  // memory per endpoint (kShmRxEntries)
      d->info_->rx_attr->size = std::min(d->info_->rx_attr->size, kShmRxEntries);
      d->info_->tx_attr->size = std::min(d->info_->tx_attr->size, kShmTxEntries);
    }
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
namespace {
/** fi_getname of `ep` into *out, sized to the name; 0 or libfabric's error. */
int endpoint_name(fid_ep* ep, std::vector<uint8_t>* out) {
  size_t len = 64;
  out->resize(len);
  int r = fi_getname(&ep->fid, out->data(), &len);
  if (r == -FI_ETOOSMALL) {
    out->resize(len);
    r = fi_getname(&ep->fid, out->data(), &len);
  }
  if (r == 0) out->resize(len);
  return r;
}
}  // namespace

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
  if (r == -FI_EBUSY && shm) {
    // The region's name is this pid's and a process-wide index
    // (<pid>:<uid>:<n>): no live endpoint of this process has it, so a file
    // of that name is a killed process's that had this pid, which nobody
    // removed (a spare Link of an endpoint has no peer to do it;
    // xfer/endpoint.h).  libfabric 1.17 refuses it ("shm file in use") and
    // removes it: the second try makes the region.
    std::vector<uint8_t> name;
    if (endpoint_name(ep, &name) == 0) {
      const std::string file = smr::region_file(name);
      (void)::unlink(file.c_str());
      r = fi_enable(ep);
      KVXFER_WARN(LOG_NET, "OFI : %s was left by a killed process with this pid; %s", file.c_str(),
                  r == 0 ? "replaced" : "still refused");
    }
  }
  if (r != 0) return fi_fail("fi_enable", r);

  r = endpoint_name(ep, &e->name_);
  if (r != 0) return fi_fail("fi_getname", r);
  if (shm) smr::trim_region(smr::region_file(e->name_));
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

kvxfer_result_t Endpoint::post_recv(void* buf, size_t len, uint64_t tag, void* ctx, fi_addr_t src) {
  if (!ep_) return set_error(KVXFER_ERR_INVALID_USAGE, "endpoint is closed");
  const ssize_t r = fi_trecv(ep_.get(), buf, len, nullptr, src, tag, 0, ctx);
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

}  // namespace kvxfer::transport
