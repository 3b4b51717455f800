// Out-of-band bootstrap of a communicator (docs/TRANSPORT.md).
//
// One side calls create_unique_id(): it opens a TCP listener (the root) and
// fills a 128-byte UniqueId with the listener's address and a 32-byte random
// secret (getrandom).  The id is passed out-of-band, as ncclGetUniqueId's is.
// Every rank (0..nranks-1) calls bootstrap_connect() with the id and an opaque
// payload (typically the libfabric Link::local_address()); the root's
// accept_all() collects one hello per rank and sends every rank the table of
// all ranks' payloads (an allgather).
//
// Wire format (all integers little-endian, every message length-prefixed by a
// u32 that counts the bytes after it, every message <= kBootstrapMaxMessage):
//   hello  magic u32, version u16, flags u16, rank u32, nranks u32, secret[32],
//          payload_len u32, payload
//   table  magic u32, version u16, status u16, nranks u32,
//          nranks x (len u32, bytes)        (entries only when status == OK)
//          failed_rank u32, reason_len u32, reason   (status == RANK_FAILED)
// flags is 0 in a rank's hello; kBootstrapHelloFailed marks a failure report
// (bootstrap_report_failure), whose payload is the reason text.  Statuses:
// 0 OK, 1 the root timed out, 2 the table is too large, 3 RANK_FAILED,
// 4 READY.
//
// Final status round (accept_all with final_round; bootstrap_connect with a
// BootstrapSession), on the same connections after the table:
//   rank -> root   magic u32, version u16, status u16 (4 READY or 3
//                  RANK_FAILED), nranks u32, rank u32, reason_len u32, reason
//   root -> rank   READY (header only) once every rank is READY; RANK_FAILED
//                  (failed rank, reason) at the first failure or hang-up; or
//                  1 (timed out)
//
// Fail fast: a rank that fails before it has joined reports it
// (bootstrap_report_failure); the root's own rank failing calls fail_all.
// The root then answers every rank it holds, and every rank that says hello
// within kBootstrapFailGraceMs after (bounded by its deadline), with
// RANK_FAILED naming the first failing rank and its reason, so no rank waits
// for the whole timeout.  A rank that comes later still waits for its own
// deadline (the listener is closed by then).
//
// Security: a hello whose secret differs (compared in constant time), or that
// is malformed, names a rank out of range or already taken, or disagrees on
// nranks, is refused: the root logs it at WARN with the peer's address and
// closes the connection without consuming a rank slot, and keeps waiting for
// the legitimate ranks until its deadline.  The secret keeps stray or stale
// processes out; it travels in clear text, so it is no defence against an
// attacker who can read the bootstrap traffic.
//
// Every socket is non-blocking; every read, write and connect is bounded by a
// deadline (poll); EINTR is retried; sends use MSG_NOSIGNAL.  Nothing here
// throws.  A BootstrapRoot is driven by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::transport {

constexpr uint32_t kBootstrapMagic = 0x4258564bu;  // "KVXB" little-endian
constexpr uint16_t kBootstrapVersion = 1;
constexpr size_t kBootstrapSecretBytes = 32;
/** Upper bound on any bootstrap message (a hello or the whole table). */
constexpr size_t kBootstrapMaxMessage = size_t{1} << 20;
/** Upper bound on one rank's payload (an address blob). */
constexpr size_t kBootstrapMaxPayload = size_t{64} << 10;
/** Upper bound on nranks. */
constexpr int kBootstrapMaxRanks = 1 << 16;
/** Hello flag: a failure report, whose payload is the reason text. */
constexpr uint16_t kBootstrapHelloFailed = 0x0001;
/** Table status: a rank failed; failed_rank u32, reason_len u32, reason follow. */
constexpr uint16_t kBootstrapStatusRankFailed = 3;
/** Status of a rank's final report, and of the root's answer once every
 *  rank reported it (the final status round). */
constexpr uint16_t kBootstrapStatusReady = 4;
/** Upper bound on a failure reason (longer ones are cut). */
constexpr size_t kBootstrapMaxReason = 512;
/** How long the root keeps answering ranks after a failure, and the bound on
 *  bootstrap_report_failure (both also bounded by their timeout_ms). */
constexpr int kBootstrapFailGraceMs = 1000;

/**
 * The unique id: a 128-byte POD, copied as bytes (memcpy) between processes.
 * magic/version/family/scope_id are in host order, port in network order.
 */
struct UniqueId {
  uint32_t magic;    // kBootstrapMagic
  uint16_t version;  // kBootstrapVersion
  uint16_t family;   // AF_INET or AF_INET6
  uint16_t port;     // network byte order
  uint16_t reserved0;
  uint32_t scope_id;  // sin6_scope_id (IPv6 link-local), else 0
  uint8_t addr[16];   // in_addr (first 4 bytes) or in6_addr
  uint8_t secret[kBootstrapSecretBytes];
  uint8_t reserved[64];
};
static_assert(sizeof(UniqueId) == 128, "UniqueId must be 128 bytes");
static_assert(std::is_trivially_copyable_v<UniqueId> && std::is_standard_layout_v<UniqueId>,
              "UniqueId must be a POD");

/** One payload per rank, indexed by rank. */
using AddressTable = std::vector<std::vector<uint8_t>>;

/** The root's side: owns the listening socket (closed on destruction). */
class BootstrapRoot {
 public:
  ~BootstrapRoot();
  BootstrapRoot(const BootstrapRoot&) = delete;
  BootstrapRoot& operator=(const BootstrapRoot&) = delete;

  /**
   * Accepts hellos until every rank 0..nranks-1 has presented the secret, then
   * sends each the table of all payloads.  Refused connections do not count.
   * One-shot: the listener is closed when it returns, whatever the outcome.
   * Errors: KVXFER_ERR_TIMEOUT when ranks are still missing after timeout_ms
   * (the ranks already accepted are told so and return KVXFER_ERR_TIMEOUT
   * too); KVXFER_ERR_SYSTEM on a socket failure or a rank that cannot be sent
   * the table; KVXFER_ERR_INVALID_ARGUMENT / _INVALID_USAGE on bad calls;
   * KVXFER_ERR_UNSUPPORTED if the table would exceed kBootstrapMaxMessage.
   * The table phase gets max(remaining, 1 s) to finish its writes.
   * A valid failure report (a hello with kBootstrapHelloFailed and the right
   * secret, nranks and an in-range rank, taken or not) ends the wait: every
   * accepted rank, the reporter, and every rank whose hello arrives within
   * min(kBootstrapFailGraceMs, what is left of timeout_ms) is sent
   * RANK_FAILED with the reporter's rank and reason (the grace ends early
   * once every rank is told); then KVXFER_ERR_SYSTEM "bootstrap: rank N
   * failed: <reason>" (failed_rank() is then N).  A failure report with a
   * wrong secret is refused like any bad hello and aborts nothing.
   */
  //
  // With final_round, the connections stay open after the table and the root
  // runs the final status round before it returns: every rank sends READY or
  // RANK_FAILED (BootstrapSession::report); the first failure, or a rank
  // whose connection ends first (crashed, gave up), is relayed to every other
  // rank at once as RANK_FAILED and returned as KVXFER_ERR_SYSTEM "rank N
  // failed: <reason>"; when all are READY every rank is sent READY and
  // accept_all returns KVXFER_SUCCESS.  The round is bounded by timeout_ms
  // too (then TIMEOUT to every rank, and KVXFER_ERR_TIMEOUT).  Every rank must
  // then join with a session (bootstrap_connect's last argument).
  kvxfer_result_t accept_all(int nranks, int timeout_ms, bool final_round = false);

  /**
   * For a root whose own rank `failed_rank` failed before it could serve:
   * answers every rank that says hello (or reports a failure) with
   * RANK_FAILED naming `failed_rank` and `reason`, for up to
   * min(kBootstrapFailGraceMs, timeout_ms) or until every other rank is told.
   * One-shot, like accept_all (the listener is closed when it returns).
   * Errors: KVXFER_ERR_TIMEOUT when some ranks were not told in time (they
   * time out on their own); KVXFER_ERR_INVALID_ARGUMENT / _INVALID_USAGE.
   */
  kvxfer_result_t fail_all(int nranks, int failed_rank, const char* reason, int timeout_ms);

  /** The rank whose failure accept_all/fail_all relayed; -1 when none. */
  int failed_rank() const { return failed_rank_; }

  const UniqueId& id() const { return id_; }

 private:
  friend kvxfer_result_t create_unique_id(const char*, UniqueId*, std::unique_ptr<BootstrapRoot>*);
  BootstrapRoot() = default;
  void close_listener();
  kvxfer_result_t serve(int nranks, int timeout_ms, int own_failed_rank,
                        const std::string& own_reason, bool final_round);

  int listen_fd_ = -1;
  int failed_rank_ = -1;
  UniqueId id_{};
};

/**
 * Opens the root's listener on `bind_host` (a numeric IPv4/IPv6 address or a
 * host name; NULL means 127.0.0.1) at an ephemeral port and fills `*id` with
 * its address and a fresh random secret.  `*root` receives the listener's
 * owner.  A wildcard address (0.0.0.0, ::) is refused: the id must carry an
 * address the ranks can connect to.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULLs, unresolvable or wildcard host),
 * KVXFER_ERR_SYSTEM (socket/bind/listen/getrandom).
 */
kvxfer_result_t create_unique_id(const char* bind_host, UniqueId* id,
                                 std::unique_ptr<BootstrapRoot>* root);

/**
 * Joins the bootstrap as `rank` of `nranks`: connects to the root (retrying a
 * refused connect until the deadline, so ranks may start before the root),
 * sends the hello with `payload`, and receives the table into `*table`
 * (table->size() == nranks, (*table)[rank] equals the payload).  Never blocks
 * beyond timeout_ms.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (bad id, rank, nranks, timeout, payload
 * size); KVXFER_ERR_TIMEOUT (root unreachable, or the table did not come in
 * time, or the root gave up waiting for other ranks); KVXFER_ERR_SYSTEM with
 * "bootstrap refused by root" when the root closes the connection without a
 * table (a wrong secret, a malformed hello, a rank taken or out of range,
 * another nranks, or a flood of unauthenticated connections that pushed this
 * one out before its hello was read), or with errno text on other
 * socket failures; KVXFER_ERR_SYSTEM with "bootstrap: rank N failed: <reason>" when the root relays
 * another rank's failure (RANK_FAILED); KVXFER_ERR_CORRUPT for a malformed table.
 */
kvxfer_result_t bootstrap_connect(const UniqueId& id, int rank, int nranks, int timeout_ms,
                                  const void* payload, size_t payload_len, AddressTable* table);

/**
 * A rank's connection to the root kept open after the table, for the final
 * status round (BootstrapRoot::accept_all with final_round): the rank sends
 * READY once it is connected to every peer, or RANK_FAILED with its reason,
 * and polls for the root's verdict meanwhile, so that a failure on any rank
 * after the table reaches every rank at once.  Destroying it closes the
 * connection, which the root reads as this rank failing.  One thread.
 */
class BootstrapSession {
 public:
  /** Takes `fd` (made by bootstrap_connect). */
  BootstrapSession(int fd, int rank, int nranks, std::string root);
  ~BootstrapSession();
  BootstrapSession(const BootstrapSession&) = delete;
  BootstrapSession& operator=(const BootstrapSession&) = delete;

  /**
   * Sends this rank's final status: READY when `failure_reason` is NULL, else
   * RANK_FAILED with the reason (cut to kBootstrapMaxReason).  READY at
   * most once; RANK_FAILED may follow it (a Link failing while this rank
   * waits for the others), and the root relays it as any other.
   * Errors: KVXFER_ERR_SYSTEM (the root closed, socket errors),
   * KVXFER_ERR_TIMEOUT (not sent within kBootstrapFailGraceMs).
   */
  kvxfer_result_t report(const char* failure_reason);

  /**
   * Non-blocking: reads what the root sent.  KVXFER_SUCCESS with *all_ready
   * false while nothing complete came, true once the root said every rank is
   * READY.  Errors: KVXFER_ERR_SYSTEM "bootstrap: rank N failed: <reason>"
   * (relayed), or when the root closed the connection; KVXFER_ERR_TIMEOUT
   * when the root gave up waiting; KVXFER_ERR_CORRUPT for a malformed frame.
   */
  kvxfer_result_t poll(bool* all_ready);

 private:
  int fd_ = -1;
  int rank_ = 0, nranks_ = 0;
  std::string root_;
  std::vector<uint8_t> buf_;  // the root's frame, prefix included, as it comes
};

/**
 * bootstrap_connect that keeps the connection as `*session`, for a root that
 * runs accept_all with final_round.  Errors: as bootstrap_connect;
 * KVXFER_ERR_INVALID_ARGUMENT for a NULL session.
 */
kvxfer_result_t bootstrap_connect(const UniqueId& id, int rank, int nranks, int timeout_ms,
                                  const void* payload, size_t payload_len, AddressTable* table,
                                  std::unique_ptr<BootstrapSession>* session);

/**
 * Tells the root that `rank` of `nranks` failed, with `reason` (cut to
 * kBootstrapMaxReason bytes), so the root fails every rank at once instead of
 * letting them wait for their timeout.  Bounded by min(timeout_ms,
 * kBootstrapFailGraceMs) in all: connects (retrying a refused connect), sends
 * a hello with kBootstrapHelloFailed and the reason as payload, and waits for
 * the root's RANK_FAILED answer.  Best effort: the caller keeps its own error
 * (and must save its last_error() text first: this call overwrites it).
 * Returns KVXFER_SUCCESS when the root acknowledged.
 * Errors: KVXFER_ERR_TIMEOUT (root unreachable, or no answer yet: a report
 * that reached the root's backlog is still read when the root serves);
 * KVXFER_ERR_SYSTEM "bootstrap refused by root" (wrong secret, nranks
 * mismatch: the root ignores the report); KVXFER_ERR_INVALID_ARGUMENT;
 * KVXFER_ERR_CORRUPT for a malformed answer.
 */
kvxfer_result_t bootstrap_report_failure(const UniqueId& id, int rank, int nranks, int timeout_ms,
                                         const char* reason);

/** "127.0.0.1:4242" / "[::1]:4242" for logs; "<invalid id>" for a bad id. */
std::string unique_id_address(const UniqueId& id);

/**
 * Why `id` is not an id create_unique_id could have made, or nullptr when it
 * could be: magic and version, family AF_INET or AF_INET6, a port, and zero
 * in every byte the family leaves unused (reserved0, reserved, and for
 * AF_INET scope_id and addr[4..16)).  A copy that lost or changed bytes
 * (a truncated memcpy, a text round trip) fails here, at the call.
 */
const char* unique_id_defect(const UniqueId& id);

}  // namespace kvxfer::transport
