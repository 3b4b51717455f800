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
//   hello  magic u32, version u16, 0 u16, rank u32, nranks u32, secret[32],
//          payload_len u32, payload
//   table  magic u32, version u16, status u16, nranks u32,
//          nranks x (len u32, bytes)        (entries only when status == OK)
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
   */
  kvxfer_result_t accept_all(int nranks, int timeout_ms);

  const UniqueId& id() const { return id_; }

 private:
  friend kvxfer_result_t create_unique_id(const char*, UniqueId*, std::unique_ptr<BootstrapRoot>*);
  BootstrapRoot() = default;
  void close_listener();

  int listen_fd_ = -1;
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
 * "bootstrap refused by root (wrong secret or bad hello)" when the root closes
 * the connection without a table, or with errno text on other socket
 * failures; KVXFER_ERR_CORRUPT for a malformed table.
 */
kvxfer_result_t bootstrap_connect(const UniqueId& id, int rank, int nranks, int timeout_ms,
                                  const void* payload, size_t payload_len, AddressTable* table);

/** "127.0.0.1:4242" / "[::1]:4242" for logs; "<invalid id>" for a bad id. */
std::string unique_id_address(const UniqueId& id);

}  // namespace kvxfer::transport
