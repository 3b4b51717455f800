// The one libfabric layer, shared by the kvxfer transport (kvxfer_send/recv)
// and the NCCL net plugin.  It knows nothing about pages: it moves opaque byte
// buffers between two peers over reliable-datagram (FI_EP_RDM) endpoints.
//
//   Domain    fi_info + fabric + domain, with provider selection
//             (KVXFER_OFI_PROVIDER, or auto: tcp;ofi_rxm first).
//   Endpoint  one RDM endpoint with its own CQ and AV and a traffic class
//             (tx_attr.tclass); raw tagged send/recv/cancel and CQ polling.
//   Link      a point-to-point connection to ONE peer made of one Endpoint per
//             TrafficClass (anchor, residual).  Adds chunking, a send scheduler
//             that always posts anchor chunks before residual chunks, a bound on
//             residual bytes in flight, a shared token-bucket rate limiter,
//             DSCP marking of the provider's sockets, and timeouts.
//
// Every libfabric object is owned by a unique_ptr whose deleter calls fi_close
// (fi_freeinfo for fi_info).  Every function returns kvxfer_result_t; detail
// goes to the thread's last error (common/error.h).  Nothing here throws.
//
// Threading: a Domain, its Endpoints and a Link are driven by one thread at a
// time (FI_THREAD_DOMAIN).  Different Links may be driven by different threads.
// docs/TRANSPORT.md describes the design and the measurements behind it.
#pragma once

#include <poll.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/params.h"
#include "kvxfer/kvxfer.h"
#include "transport/dscp.h"
#include "transport/fabric_lib.h"
#include "transport/rate_limiter.h"
#include "transport/smr_region.h"

namespace kvxfer::transport {

class ShmLockWatch;  // transport/shm_reaper.h

// ---------------------------------------------------------------------------
// RAII for libfabric objects.
// ---------------------------------------------------------------------------
/** Closes any fid-derived libfabric object (fid_fabric, fid_domain, ...). */
/** fi_close() with a WARN when it fails (a close must never throw or abort). */
void close_fid(fid_t f, const char* what) noexcept;
inline const char* fid_kind(fid_fabric*) { return "fabric"; }
inline const char* fid_kind(fid_domain*) { return "domain"; }
inline const char* fid_kind(fid_cq*) { return "cq"; }
inline const char* fid_kind(fid_av*) { return "av"; }
inline const char* fid_kind(fid_ep*) { return "ep"; }
template <typename T>
struct FidCloser {
  void operator()(T* p) const noexcept {
    if (p != nullptr) close_fid(&p->fid, fid_kind(p));
  }
};
struct InfoDeleter {
  void operator()(fi_info* p) const noexcept { fabric_lib::freeinfo(p); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;
using FabricPtr = std::unique_ptr<fid_fabric, FidCloser<fid_fabric>>;
using DomainPtr = std::unique_ptr<fid_domain, FidCloser<fid_domain>>;
using CqPtr = std::unique_ptr<fid_cq, FidCloser<fid_cq>>;
using AvPtr = std::unique_ptr<fid_av, FidCloser<fid_av>>;
using EpPtr = std::unique_ptr<fid_ep, FidCloser<fid_ep>>;

/**
 * rxm's own defaults (libfabric 1.17, before apply_provider_memory_defaults):
 * messages up to FI_OFI_RXM_BUFFER_SIZE (16 KiB, less rxm's header) go
 * eager, up to FI_OFI_RXM_SAR_LIMIT (128 KiB) by segmentation, above by
 * rendezvous.  Link::post_send chunks messages below kSarLimitBytes at
 * kEagerChunkBytes so that they never take the SAR path (docs/TRANSPORT.md,
 * "Chunk sizes").
 */
constexpr size_t kEagerChunkBytes = 16000;
constexpr size_t kSarLimitBytes = 128 * 1024;

/**
 * rxm's buffer pools take about 176 MB of resident memory per peer with
 * libfabric 1.17's defaults: a shared receive queue of 4096 bounce buffers
 * of 16 KiB, and pools that grow 1024 buffers at a time.  Before libfabric
 * reads its parameters (the first fi_getinfo of the process), this sets
 * FI_OFI_RXM_MSG_RX_SIZE=16, FI_OFI_RXM_BUFFER_SIZE=1024,
 * FI_OFI_RXM_EAGER_LIMIT=16384 (over tcp, kEagerChunkBytes stays eager) and
 * FI_UNIVERSE_SIZE=16, each only when the environment does not set it:
 * about 11 MB per network peer (docs/TRANSPORT.md, "Memory";
 * XferMemory.NetworkPeerResidentSetIsBounded).  Every rxm endpoint makes
 * its receive and send pools 1024 buffers of (buffer size + about 350
 * bytes) at a time, and touches each buffer (prov/rxm/src/rxm_ep.c,
 * rxm_ep_create_pools): 2.8 MB at 1024, 9 MB at 4096.  Over tcp the
 * buffer size does not bound eager messages (rxm reads a larger unexpected
 * one into a buffer of its size, rxm_get_dyn_unexp), and sends use no
 * inject.  Over net, which has no dynamic receive buffers, rxm takes the
 * buffer size as its eager limit: messages above 1024 bytes go by SAR (to
 * 8192) or rendezvous there (docs/TRANSPORT.md, "Memory").  The universe
 * sizes rxm's completion ring of its tcp connections, (msg rx 16 + msg tx 128) x
 * universe entries of 48 bytes per endpoint (prov/rxm/src/rxm_ep.c,
 * rxm_ep_msg_cq_open): at 1024 (the default) 12 MiB, made resident a lap
 * at a time over the first 2,000 transfers; at 16, 192 KiB.  Each endpoint
 * serves one peer (its address vector holds 4); a full ring spills into
 * util_cq's overflow list, it loses nothing.
 * It also sets FI_NET_MAX_SAVED=256 when unset.  `net` reads a connection
 * in order and keeps an unexpected message aside only while it is small
 * (its inject size, 128 B) and the connection keeps fewer than
 * FI_NET_MAX_SAVED (default 4) aside (prov/net/src/xnet_progress.c,
 * xnet_save_and_cont): the next stops the connection until its receive is
 * posted, and a Link's headers and control messages then wait behind it
 * for the whole timeout (ofiDefaults.NetKeepsManySmallUnexpectedMessages).
 * Sets them once, from fabric_lib::load() before it opens libfabric (the
 * process's first Domain::open); later calls set nothing.  Thread-safe
 * (std::call_once), and safe against getenv on other threads: the variables
 * go into a new environ array, published with one compare-and-swap (not
 * setenv, whose reallocation before glibc 2.41 frees the array a concurrent
 * getenv reads).  Like getenv, it must not run while another thread calls
 * setenv, unsetenv or putenv.  Returns the variables the first call set,
 * for the log.
 */
std::string apply_provider_memory_defaults();

/** The libfabric API version this layer asks for. */
constexpr uint32_t kFiVersion = FI_VERSION(1, 17);

// ---------------------------------------------------------------------------
// Wire format of a Link (docs/TRANSPORT.md, "Message framing"; pinned by
// tests/wire_test.cc).  Chunk 0 of a message is a WireHeader, chunks 1..n
// its data; the handshake is one kHelloMagic each way per class.  Sent as
// the host's bytes: hosts are little-endian (x86-64, aarch64).
// ---------------------------------------------------------------------------
constexpr uint32_t kWireMagic = 0x4B565846;              // bytes "FXVK"
constexpr uint16_t kWireVersion = 2;                     // 2: the header carries its checksum
constexpr uint64_t kHelloMagic = 0x4B5658464C4C4548ull;  // bytes "HELLFXVK"

struct WireHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t flags;
  uint32_t chunk_bytes;  // the sender's chunk size: data chunk i covers [(i-1)c, ic)
  uint32_t check;        // wire_header_check(): the low 32 bits of XXH3_64 of the header
  uint64_t total;        // message length in bytes
  uint64_t tag;          // user tag, checked by the receiver
};
static_assert(sizeof(WireHeader) == 32, "wire header is 32 bytes");

/** The header's checksum: the low 32 bits of XXH3_64 (seed 0) of its 32
 *  bytes with `check` zero.  Any flipped byte fails wire_header_ok at once,
 *  where a flipped `total` or `chunk_bytes` would otherwise post receives
 *  that do not fit the sender's chunks (docs/TRANSPORT.md, "Message framing"). */
uint32_t wire_header_check(const WireHeader& h);
/** The header of a message of `total` bytes, in `chunk_bytes` chunks, with user tag `tag`. */
WireHeader make_wire_header(uint32_t chunk_bytes, uint64_t total, uint64_t tag);
/** True when `h`, a header chunk of `len` bytes, is valid for a receive of
 *  user tag `tag`: length, magic, version, flags 0, checksum, tag, chunk size
 *  and chunk count. */
bool wire_header_ok(const WireHeader& h, size_t len, uint64_t tag);

// ---------------------------------------------------------------------------
// Traffic classes
// ---------------------------------------------------------------------------
enum class TrafficClass : int { kAnchor = 0, kResidual = 1 };
constexpr int kNumClasses = 2;
inline int idx(TrafficClass c) { return static_cast<int>(c); }
const char* class_name(TrafficClass c);

/**
 * The tx_attr.tclass value of a traffic class: FI_TC_<name>
 * (KVXFER_TRAFFIC_CLASSES, common/params.h); kDscp gives FI_TC_DSCP | dscp,
 * dscp in 0..63.
 */
uint32_t tclass_value(params::Tclass c, int dscp);
/**
 * The same for a KVXFER_TRAFFIC_CLASSES name (case-insensitive).  False if the
 * name is unknown or dscp is outside 0..63.
 */
bool tclass_from_name(const std::string& name, int dscp, uint32_t* out);
/** Human-readable form of a tclass value ("BULK_DATA", "DSCP(46)", "0x1234"). */
std::string tclass_to_string(uint32_t tclass);

// ---------------------------------------------------------------------------
// Domain: provider selection, fabric and domain
// ---------------------------------------------------------------------------
/** Providers tried, in order, when none is named (see docs/TRANSPORT.md). */
const std::vector<std::string>& auto_providers();

/** libfabric's shared-memory provider: same-host peers (Link, "Paths"). */
constexpr const char* kShmProvider = "shm";
/**
 * Receive and send entries of a shm endpoint (its fi_info rx_attr and
 * tx_attr size).  libfabric 1.17's shm offers 1024 of each
 * (prov/shm/src/smr_attr.c); every receive entry costs the endpoint about
 * 1 KiB and every send entry about 0.8 KiB of its own memory, all touched at
 * fi_enable, two endpoints per peer.  A send entry is held only while a send
 * waits for its receiver's copy; past 64 a send waits its turn (-FI_EAGAIN,
 * retried by the Link).  Smaller sizes set with FI_SHM_RX_SIZE and
 * FI_SHM_TX_SIZE are kept.
 */
constexpr size_t kShmRxEntries = 512;
constexpr size_t kShmTxEntries = 64;
/**
 * Requests in flight with one peer over shm, both directions together.
 * shm's receive entries (kShmRxEntries) are shared by posted receives and
 * unexpected messages (smr_msg.c, smr_get_recv_entry: -FI_ENOMEM when they
 * run out).  A request keeps its DESC and STATUS receives posted, and pages
 * need theirs: with 1024 entries about 480 small requests used them all and
 * failed the link, and 384 under AddressSanitizer's slower progress.  With
 * kShmPostedShare of the entries for posted receives, one request per 8
 * entries (64) leaves two thirds of those to pages.
 */
constexpr int kShmMaxRequests = static_cast<int>(kShmRxEntries / 8);
static_assert(kShmMaxRequests == 64, "docs/TRANSPORT.md and the vLLM connector's max_loads");
/** The share of shm's receive entries the Link posts receives into (Link::
 *  max_posted_recvs); the rest is left to messages that arrive unexpected. */
constexpr double kShmPostedShare = 0.75;

/**
 * Who can reach this process's shared memory and, with CMA, its memory:
 * the kernel boot (/proc/sys/kernel/random/boot_id), the PID namespace
 * (CMA names processes by pid), the /dev/shm file system (device and inode)
 * and the user id.  Two processes with equal identities are on the same
 * host for the shm provider.  Computed once; never empty.
 */
const std::string& host_identity();

class Domain {
 public:
  /**
   * Opens the first RDM provider that offers tagged messages without memory
   * registration.  `provider` "" = auto_providers() in order; otherwise that
   * provider exactly (for example "tcp;ofi_rxm"), and its absence is an error.
   * `node` is the local address to bind ("127.0.0.1"); "" = provider default.
   * `directed_recv`: also ask for FI_DIRECTED_RECV, so that a receive can
   * name the one peer it takes messages from (Endpoint::post_recv's `src`);
   * every provider of auto_providers() offers it in libfabric 1.17.
   */
  static kvxfer_result_t open(const std::string& provider, const std::string& node,
                              std::shared_ptr<Domain>* out, bool directed_recv = false);

  const fi_info* info() const { return info_.get(); }
  fid_domain* fid() const { return domain_.get(); }
  fid_fabric* fabric() const { return fabric_.get(); }
  /** The provider as libfabric names it, e.g. "tcp;ofi_rxm". */
  const std::string& provider() const { return provider_; }

 private:
  Domain() = default;
  InfoPtr info_;
  FabricPtr fabric_;
  DomainPtr domain_;
  std::string provider_;
};

// ---------------------------------------------------------------------------
// Endpoint: one RDM endpoint, its CQ and its AV
// ---------------------------------------------------------------------------
/** One completion read from an Endpoint's CQ. */
struct CqEvent {
  void* context = nullptr;  // the context passed to post_*
  size_t len = 0;           // bytes received (receives)
  uint64_t tag = 0;
  int err = 0;  // 0, or a positive FI_E* code (FI_ECANCELED, FI_ETRUNC, ...)
  int prov_errno = 0;
};

class Endpoint {
 public:
  /** Opens an endpoint on `domain` whose tx_attr.tclass is `tclass`. */
  static kvxfer_result_t open(std::shared_ptr<Domain> domain, uint32_t tclass,
                              std::unique_ptr<Endpoint>* out);
  ~Endpoint() { close(); }
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  /** The local address (fi_getname), an opaque blob for the peer's insert_peer(). */
  const std::vector<uint8_t>& name() const { return name_; }
  /** fi_av_insert of a peer's name() blob. */
  kvxfer_result_t insert_peer(const void* addr, size_t len, fi_addr_t* out);

  // Posting: KVXFER_SUCCESS, KVXFER_IN_PROGRESS when the provider's queue is
  // full (-FI_EAGAIN: poll the CQ, then post again), or an error.  `ctx` must
  // stay valid until its completion is read or the endpoint is closed; it
  // must start with a struct fi_context2.
  kvxfer_result_t post_send(const void* buf, size_t len, fi_addr_t dest, uint64_t tag, void* ctx);
  /** `src`: the peer (insert_peer) whose messages alone it matches, on a
   *  domain opened with directed_recv; FI_ADDR_UNSPEC: any peer's. */
  kvxfer_result_t post_recv(void* buf, size_t len, uint64_t tag, void* ctx,
                            fi_addr_t src = FI_ADDR_UNSPEC);
  /** Asks the provider to cancel a posted receive (fi_cancel); a cancelled
   *  operation completes with err = FI_ECANCELED. */
  kvxfer_result_t cancel(void* ctx);
  /** Reads up to `max` completions (successes and errors); never blocks. */
  kvxfer_result_t poll(CqEvent* out, size_t max, size_t* n);
  /** Closes EP, AV and CQ (in that order).  Afterwards the provider no longer
   *  touches any posted buffer or context.  Idempotent. */
  void close();
  bool is_open() const { return ep_ != nullptr; }
  /** The CQ's wait object (FI_WAIT_FD), -1 if the provider has none. */
  int wait_fd() const { return wait_fd_; }
  /** fi_trywait on the CQ: true when it is safe to sleep on wait_fd(). */
  bool trywait();

  uint32_t tclass() const { return tclass_; }
  const fi_info* info() const { return info_.get(); }
  const Domain& domain() const { return *domain_; }

 private:
  Endpoint() = default;
  std::shared_ptr<Domain> domain_;
  InfoPtr info_;  // the domain's info with this endpoint's tclass
  CqPtr cq_;
  AvPtr av_;
  EpPtr ep_;  // declared last: closed first
  uint32_t tclass_ = 0;
  int wait_fd_ = -1;
  std::vector<uint8_t> name_;
};

// ---------------------------------------------------------------------------
// Link: one peer, one endpoint per traffic class
// ---------------------------------------------------------------------------
struct LinkConfig {
  // "" = auto: a peer on the same host (host_identity()) over kShmProvider,
  // any other over the first of auto_providers(); "shm" = shared memory only
  // (a peer on another host fails connect); any other name = that provider
  // only.  KVXFER_OFI_PROVIDER sets it.
  std::string provider;
  std::string node;  // local address to bind; "" = provider default
  // false: a peer in this very process takes the network path, never shm.
  // libfabric 1.17's shm maps a same-process peer's endpoint to that
  // endpoint's own region, which its close frees: a Link still sending to
  // it then writes to freed memory.  Endpoints, which come and go while
  // their neighbours in the process run, set it (xfer/endpoint.h).
  bool shm_in_process = true;
  // The auto provider ("") also offers shared memory; false: the network
  // path only (an endpoint that knows its peer is on another host).
  bool offer_shm = true;
  std::array<uint32_t, kNumClasses> tclass{FI_TC_LOW_LATENCY, FI_TC_BULK_DATA};
  std::array<int, kNumClasses> dscp{46, 8};  // -1 = do not mark sockets (still inspected)
  size_t chunk_bytes = 256 * 1024;           // messages are split into chunks of at most this
  size_t residual_inflight_bytes = 1 << 20;  // residual bytes posted and not completed
  size_t max_posted_chunks = 64;             // per class: send chunks posted to the provider
  size_t max_posted_recvs = 0;     // per class: receives posted ahead; 0 = the provider's rx size
  size_t recv_window_chunks = 16;  // data receives posted ahead, per message
  int64_t timeout_ms = 30000;      // inactivity timeout of every operation
  std::shared_ptr<RateLimiter> limiter;  // null = no rate limit
  // Test seam (xfer/test_hooks.h, corrupt_wire_headers): null in the product.
  // While *v > 0, each message header this Link receives takes one from it,
  // and the one that takes the last has the byte at `offset` of its
  // WireHeader flipped before it is checked.
  struct HeaderCorruption {
    std::atomic<int> count{0};
    std::atomic<int> offset{0};
  };
  std::shared_ptr<HeaderCorruption> corrupt_headers;

  /** Fills every field from the KVXFER_* parameters (node stays ""). */
  static kvxfer_result_t from_params(LinkConfig* out);
};

/** A finished operation (success or error), as returned by Link::poll(). */
struct Completion {
  uint64_t op_id = 0;
  uint64_t tag = 0;
  TrafficClass cls = TrafficClass::kAnchor;
  bool is_send = false;
  kvxfer_result_t status = KVXFER_SUCCESS;
  std::string error;  // why it failed ("" on success)
  size_t bytes = 0;   // bytes sent / received
  Clock::time_point posted, done;
};

/** What DSCP marking found and did, per class (see docs/TRANSPORT.md). */
struct DscpReport {
  bool supported = false;                           // the provider's addresses are sockaddrs
  std::array<int, kNumClasses> sockets{};           // sockets of this link's endpoints marked
  std::array<int, kNumClasses> tos_before{-1, -1};  // IP_TOS found on the first one
  std::array<int, kNumClasses> tos_after{-1, -1};   // IP_TOS read back after marking
  std::array<int, kNumClasses> nodelay{-1, -1};     // TCP_NODELAY the provider chose
  std::string note;
};

struct LinkStats {
  std::array<uint64_t, kNumClasses> chunks_posted{};
  std::array<uint64_t, kNumClasses> bytes_posted{};
  size_t max_residual_inflight = 0;  // high-water mark of residual bytes in flight
};

class Link {
 public:
  /** Largest user tag; tags of messages in flight on one class must differ. */
  static constexpr uint64_t kMaxTag = (uint64_t{1} << 40) - 2;

  /** Opens the domain and one endpoint per class.  Non-blocking. */
  static kvxfer_result_t create(const LinkConfig& cfg, std::unique_ptr<Link>* out);
  /** Cancels everything in flight (see abort()) and closes all objects. */
  ~Link();
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  /**
   * This side's address: an opaque blob to hand to the peer's connect().  It
   * lists every path this side offers (a network provider, and with the auto
   * provider also kShmProvider) with this host's identity and pid
   * (docs/TRANSPORT.md, "Address blob").
   */
  const std::vector<uint8_t>& local_address() const { return address_; }
  /**
   * Inserts the peer's blob and starts the handshake (one empty "hello" each
   * way on each class).  Chooses the path: kShmProvider when both sides offer
   * it and their host_identity() is equal, else the network provider both
   * offer; the other path's endpoints are closed.  Non-blocking: sends queue
   * until ready(); receives can be posted at once.  Errors:
   * KVXFER_ERR_CORRUPT for a malformed blob (it comes from the peer);
   * KVXFER_ERR_INVALID_ARGUMENT for a NULL one; KVXFER_ERR_MISMATCH
   * for a blob of another version, or when the two sides share no path (the
   * message lists both sides' providers); KVXFER_ERR_SYSTEM, failing the
   * link, when a same-host peer's shared-memory endpoint is already gone.
   * The handshake is bound by the timeout like every operation.
   */
  kvxfer_result_t connect(const void* blob, size_t len);
  bool ready() const { return ready_; }
  bool failed() const { return failed_; }
  /** Why the link failed ("" while it has not). */
  const std::string& failure() const { return fail_why_; }

  /**
   * Queues a message (any size, 0 included) on class `c`.  `buf` must stay
   * valid until its completion.  Matched to the peer's post_recv with the same
   * class and tag; tags (<= kMaxTag) of messages in flight on a class must be
   * distinct.  *op receives an id reported back in Completion::op_id.
   * `ahead`: a small control message; its chunks are posted before those of
   * every message of its class queued without `ahead` (which may then be
   * part posted), and after earlier `ahead` ones (FIFO among them).
   */
  kvxfer_result_t post_send(TrafficClass c, const void* buf, size_t len, uint64_t tag, uint64_t* op,
                            bool ahead = false);
  /**
   * Empties a send whose header has not been posted yet: the message still
   * goes out (the peer's receive completes), with 0 bytes.  True if emptied;
   * false if the op is unknown, not a send, or already started (it then
   * finishes as queued).  For a request that gave up (xfer/protocol.h: an
   * empty page message means the sender gave up).
   */
  bool empty_unstarted_send(uint64_t op);
  /** Posts a receive of at most `cap` bytes; a longer message fails it with
   *  KVXFER_ERR_BUFFER_TOO_SMALL (and is drained, so the sender completes).
   *  `standing`: a receive a message may come to at any time (a control
   *  stream of the engine's): the link's timeout does not expire it while
   *  nothing of its message has arrived. */
  kvxfer_result_t post_recv(TrafficClass c, void* buf, size_t cap, uint64_t tag, uint64_t* op,
                            bool standing = false);
  /**
   * Ends a receive of which nothing has arrived: the peer said no message of
   * its tag will come (a refused request).  Its posts go back to the provider
   * (fi_cancel), and poll() reports it with `code` and `why` once they have.
   * False, changing nothing, if `op` is unknown, a send, already reported or
   * ending, or its message has begun to arrive.
   */
  bool cancel_recv(uint64_t op, kvxfer_result_t code, const std::string& why);

  /**
   * Drives everything: reads both CQs (anchor first), finishes the handshake,
   * posts receives and send chunks (anchor first), enforces timeouts.  Never
   * blocks.  Returns KVXFER_SUCCESS, or the error that failed the link.
   */
  kvxfer_result_t progress();
  /** progress(), then appends every finished operation to *out; returns the count. */
  size_t poll(std::vector<Completion>* out);

  /**
   * Fails the link: closes both endpoints (the provider stops touching every
   * posted buffer), and every operation not yet reported finishes with an
   * error naming `why`.  Idempotent.  Later posts fail.
   */
  void abort(const char* why);

  /** Operations posted and not yet returned by poll(). */
  size_t ops_in_flight() const;
  /** ops_in_flight() less the standing receives nothing has arrived for
   *  (post_recv): what an idle link waits for, its sleep (prepare_wait) and
   *  its peer checks (check_liveness) count only these. */
  size_t ops_awaited() const;
  /** The provider of the path in use ("shm", "tcp;ofi_rxm", ...); before
   *  connect(), the network path's (kShmProvider when it is the only one). */
  const std::string& provider() const { return domain_->provider(); }
  /** True once connect() chose the shared-memory path. */
  bool same_host() const { return shm_path_; }
  /** True on a connected shared-memory link whose peer's hello said it
   *  rings this side's doorbell (docs/TRANSPORT.md, "Paths"):
   *  prepare_wait() can then sleep. */
  bool has_doorbell() const { return shm_path_ && bell_fd_ >= 0 && peer_rings_; }
  const LinkConfig& config() const { return cfg_; }
  const DscpReport& dscp_report() const { return dscp_; }
  const LinkStats& stats() const { return stats_; }
  /** When progress() has something to do again without a completion: the
   *  rate limiter's next token for a chunk it holds back; max() if none. */
  Clock::time_point next_deadline() const { return next_wake_; }
  /**
   * For a thread with nothing to do: appends one pollfd (POLLIN) per class
   * for this link's completion queues and returns true, or returns false
   * when the thread must not sleep (a completion is already waiting, or the
   * provider has no wait object: poll instead; a shm link with nothing in
   * flight adds nothing and returns true).  A shm link with a doorbell
   * (has_doorbell()) appends its doorbell's fd and returns true, unless
   * its region's signal word is set, the last progress() posted, cancelled
   * or left completions after reading its queues, or the provider's queue
   * was full; it first rings the peer whose signal word is set.  After poll(2),
   * or a timeout no later than next_deadline(), call progress() again.  A
   * failed link adds nothing and returns true.
   */
  bool prepare_wait(std::vector<pollfd>* fds);

 private:
  struct Op;
  struct Ctx;
  Link() = default;

  /** cfg_.chunk_bytes and max_posted_recvs: the asked values, bounded by domain_'s provider. */
  void apply_path_limits();
  kvxfer_result_t handle_event(TrafficClass c, const CqEvent& ev, Clock::time_point now);
  kvxfer_result_t on_send_done(Ctx* ctx, const CqEvent& ev, Clock::time_point now);
  kvxfer_result_t on_recv_done(Ctx* ctx, const CqEvent& ev, Clock::time_point now);
  kvxfer_result_t schedule_sends(Clock::time_point now);
  kvxfer_result_t post_recvs(Clock::time_point now);
  kvxfer_result_t check_timeouts(Clock::time_point now);
  kvxfer_result_t post_hellos();
  void mark_sockets();
  void fail_recv(Op* op, kvxfer_result_t code, const std::string& why, Clock::time_point now);
  void finish(Op* op, kvxfer_result_t code, const std::string& why, Clock::time_point now);
  void maybe_release(Op* op);
  Ctx* new_ctx(Op* op, TrafficClass c, int kind, uint32_t index, size_t bytes);
  void free_ctx(Ctx* ctx);
  kvxfer_result_t fail_link(kvxfer_result_t code, const std::string& why);
  void abort_with(kvxfer_result_t code, const std::string& why);

  LinkConfig cfg_;
  size_t asked_chunk_bytes_ = 0, asked_posted_recvs_ = 0;  // before apply_path_limits
  std::shared_ptr<Domain> domain_;
  std::array<std::unique_ptr<Endpoint>, kNumClasses> ep_;
  // The shared-memory path of the auto provider, offered beside the network
  // path until connect() picks one of the two (then these are closed or
  // moved into domain_ / ep_).
  std::shared_ptr<Domain> shm_domain_;
  std::array<std::unique_ptr<Endpoint>, kNumClasses> shm_ep_;
  bool shm_path_ = false;  // connect() chose shared memory
  // Liveness of a same-host peer (check_liveness): a pidfd of its process,
  // and the /dev/shm file of each class's region, which its endpoint close
  // unlinks.
  int peer_pidfd_ = -1;
  uint32_t peer_pid_ = 0;
  std::array<std::string, kNumClasses> peer_region_;
  bool peer_regions_removed_ = false;  // the peer died: its regions were removed
  // Bumped by every progress(); a watcher (shm_reaper.h) releases the shm
  // locks a killed peer left held once this stops moving.
  std::atomic<uint64_t> progress_epoch_{0};
  std::unique_ptr<ShmLockWatch> shm_watch_;
  std::array<fi_addr_t, kNumClasses> peer_{FI_ADDR_UNSPEC, FI_ADDR_UNSPEC};
  std::vector<uint8_t> address_;
  std::array<std::vector<uint8_t>, kNumClasses> peer_name_;

  bool connecting_ = false, ready_ = false, failed_ = false;
  kvxfer_result_t fail_code_ = KVXFER_SUCCESS;
  std::string fail_why_;
  Clock::time_point connect_started_, ready_at_;
  int hello_pending_ = 0;
  std::array<uint64_t, kNumClasses> hello_buf_{};
  std::array<uint64_t, kNumClasses> hello_out_{};
  std::array<bool, kNumClasses> hello_unsent_{};

  uint64_t next_op_id_ = 1;
  std::unordered_map<uint64_t, std::unique_ptr<Op>> ops_;
  std::array<std::deque<Op*>, kNumClasses> send_queue_;       // sends with chunks left to post
  std::array<std::deque<Op*>, kNumClasses> ahead_queue_;      // the same, posted `ahead`
  std::array<std::deque<Op*>, kNumClasses> recv_queue_;       // receives with a header to post
  std::array<std::deque<Op*>, kNumClasses> recv_data_queue_;  // header landed, data to post
  std::unordered_set<Ctx*> live_;                             // contexts the provider holds
  std::array<size_t, kNumClasses> posted_chunks_{};           // send chunks in flight
  std::array<size_t, kNumClasses> inflight_bytes_{};          // send bytes in flight
  std::array<size_t, kNumClasses> posted_recvs_{};            // receives in flight
  std::deque<Completion> done_;
  Clock::time_point next_wake_;
  Clock::time_point last_timeout_scan_;
  Clock::time_point last_send_activity_, last_recv_activity_;  // any chunk on the link

  DscpReport dscp_;
  LinkStats stats_;
  // The provider's connection per class (dscp.h, find_conn_socket): checked
  // before receives are posted, so that none meets a connection rxm freed.
  std::array<ConnSocket, kNumClasses> conn_{};
  std::array<bool, kNumClasses> probe_conn_{true, true};
  bool connection_open(int c);
  // Liveness (check_liveness): every kLivenessMs while operations are in
  // flight; a class whose socket the peer closed on two checks in a row
  // fails the link, whatever the rate or the timeout.
  static constexpr int kLivenessMs = 100;
  Clock::time_point last_liveness_check_;
  std::array<int, kNumClasses> peer_closed_checks_{};
  kvxfer_result_t check_liveness();

  // The doorbell of a shared-memory link (docs/TRANSPORT.md, "Paths"): shm
  // signals nothing a thread can sleep on, so each side makes a FIFO beside
  // its anchor region (bell_file()), and the peer writes a byte to it when
  // the signal word of one of this side's regions is set (work queued for
  // this side's progress).  Opened O_RDWR on both sides: the FIFO never
  // reads EOF, and a write never raises SIGPIPE.
  void open_bell();
  void close_bell();
  void ring_peer_if_signalled(Clock::time_point now);
  void ring_peer();
  int bell_fd_ = -1;            // this side's FIFO
  std::string bell_path_;       // unlinked once the peer holds it (ready_)
  int peer_bell_fd_ = -1;       // the peer's FIFO
  bool peer_rings_ = false;     // the peer's hello said it holds bell_fd_'s FIFO
  bool bell_armed_ = false;     // prepare_wait() handed bell_fd_ out: drain it first thing
  bool stirred_ = false;        // posted or completed something since the last ring
  bool provider_full_ = false;  // the last progress() met -FI_EAGAIN
  // The queues may hold what the last progress() did not read: it posted or
  // cancelled after reading them (shm completes a receive that meets an
  // unexpected message, an inline send and a cancel inside the call, into a
  // queue that is read, not signalled), or it stopped at its read cap.
  bool posted_after_read_ = false;
  Clock::time_point last_ring_{};
  std::array<smr::SignalView, kNumClasses> own_signal_, peer_signal_;
};

}  // namespace kvxfer::transport
