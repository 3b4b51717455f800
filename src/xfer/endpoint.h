// The membership of an endpoint (kvxfer_endpoint_*; docs/TRANSPORT.md,
// "Endpoints"): its address blob, its listener, and the peers that connect
// and disconnect at run time.
//
// Internal.  An endpoint is an open Engine (Engine::create_open) plus a
// Membership.  A peer's bytes move over a Link of its own (transport/ofi.h),
// made when the two sides meet or made ahead (spare Links, below): the
// connecting side sends a CONNECT on a TCP connection to the other's
// listener with its Link's address, the other answers with its own, and
// both hand their Link to the engine (reserve_peer, adopt_peer).  A BYE on
// a new TCP connection ends a peer (disconnect, destroy).
//
// Identity: every endpoint draws a random 64-bit incarnation at creation.
// Peers are keyed by it, so a process restarted at the same address is a new
// peer, and the old one is ended when the new one is met (connected either
// way): "restarted".  A CONNECT that names another incarnation than the
// listener's is answered STALE.
//
// Crossing: two endpoints that connect to each other at once must end with
// one connection.  A CONNECT that meets a connect of its own in flight to the
// same peer wins when its sender has the lower incarnation; the loser is
// answered CROSSED and its caller waits for the winner's connection.
//
// Blob (integers little-endian; kEndpointBlobBytes, or + 32 with a secret):
//   magic u32 ("KVXE"), version u16, flags u16 (bit 0: a secret follows),
//   incarnation u64, family u16 (AF_INET/AF_INET6), port u16 (network
//   order), scope_id u32, addr[16], host u64 (FNV-1a of
//   transport::host_identity()), pid u32, 0 u32, [secret 32]
// Path: a peer with the same host and another pid is reached over shared
// memory, any other over the network; both sides decide alike from the two
// blobs, and each makes only that path's Link (Membership::link_config).
// Handshake (each message length-prefixed by a u32 counting the bytes after
// it, at most kHandshakeMaxBytes):
//   request  magic u32 ("KVXH"), version u16, kind u16 (1 CONNECT, 2 BYE),
//            flags u32 (bit 0 FORCE), secret[32], from_incarnation u64,
//            to_incarnation u64, blob_len u32, blob (the sender's),
//            link_len u32, link address (CONNECT; 0 for BYE)
//   reply    magic u32, version u16, status u16, incarnation u64 (the
//            listener's), link_len u32, link address (OK to a CONNECT),
//            reason_len u32, reason
// Statuses: 0 OK, 1 REFUSED (wrong secret), 2 STALE (another incarnation),
// 3 CROSSED (the peer's own connect wins; wait for it), 4 CROSSED_LIVE (the
// peer holds a connection it made to us: wait for it, or, when we hold
// none, send again with FORCE), 5 ERROR (reason), 6 BAD (malformed).
//
// Threads: connect and disconnect run on the caller's thread (any); an
// acceptor thread serves the listener, reading every pending connection as
// its bytes come (a silent one holds no one else) and answering a whole
// handshake at once (accept_main); the engine's progress thread reports failed
// Links (Engine::set_peer_failed); a spare thread makes spare Links
// (spare_main).  Lock order: Membership::mu_, then spare_mu_ or the
// engine's.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/log.h"
#include "kvxfer/kvxfer.h"
#include "transport/ofi.h"
#include "xfer/engine.h"

namespace kvxfer::xfer {

constexpr uint32_t kEndpointBlobMagic = 0x4558564bu;  // "KVXE" little-endian
constexpr uint16_t kEndpointBlobVersion = 1;
constexpr size_t kEndpointSecretBytes = KVXFER_ENDPOINT_SECRET_BYTES;
constexpr size_t kEndpointBlobBytes = 56;          // without the secret
constexpr uint32_t kHandshakeMagic = 0x4858564bu;  // "KVXH"
constexpr uint16_t kHandshakeVersion = 1;
constexpr size_t kHandshakeMaxBytes = size_t{64} << 10;
/** How long a connection to the listener has to send its whole handshake
 *  (also bounded by the timeout), and how many may be pending at once. */
constexpr int kAcceptMs = 2000;
constexpr size_t kMaxPending = 256;
/** Bound of telling a peer BYE (disconnect; destroy: all peers together). */
constexpr int kByeMs = 1000;

/** A decoded address blob. */
struct EndpointAddress {
  uint64_t incarnation = 0;
  uint16_t family = 0;
  uint16_t port_be = 0;  // network byte order
  uint32_t scope_id = 0;
  std::array<uint8_t, 16> addr{};
  uint64_t host = 0;  // FNV-1a of transport::host_identity()
  uint32_t pid = 0;
  bool has_secret = false;
  std::array<uint8_t, kEndpointSecretBytes> secret{};

  /** "127.0.0.1:4242" / "[::1]:4242". */
  std::string text() const;
  /** True when both name the same listener (family, address, port). */
  bool same_place(const EndpointAddress& o) const;
};

std::vector<uint8_t> encode_endpoint_address(const EndpointAddress& a);
/** KVXFER_ERR_INVALID_ARGUMENT naming what is wrong: length, magic,
 *  version, flags, family, port 0, incarnation 0. */
/** FNV-1a (64-bit) of this process's transport::host_identity(). */
uint64_t host_hash();
kvxfer_result_t decode_endpoint_address(const void* blob, size_t len, EndpointAddress* out);

/** Handshake statuses (header comment). */
enum class HandshakeStatus : uint16_t {
  kOk = 0,
  kRefused = 1,
  kStale = 2,
  kCrossed = 3,
  kCrossedLive = 4,
  kError = 5,
  kBad = 6,
};

class Membership {
 public:
  struct Config {
    std::string host;  // listener and Links
    uint16_t port = 0;
    bool has_secret = false;  // else a random one, carried in the blob
    std::array<uint8_t, kEndpointSecretBytes> secret{};
    int timeout_ms = 30000;
    std::shared_ptr<TestHooks> hooks;  // test seams; null in the product
  };

  /**
   * Opens the listener and starts the acceptor thread for `engine` (an open
   * engine, which must outlive this object's stop()).  Errors: as
   * tcp::open_listener, KVXFER_ERR_SYSTEM (getrandom, eventfd).
   */
  static kvxfer_result_t create(Engine* engine, const Config& cfg,
                                std::unique_ptr<Membership>* out);
  /** stop(), if not done. */
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  /**
   * Stops the acceptor, then tells every connected peer BYE (kByeMs in
   * all).  Later connects fail; a failed Link is no longer reported.  Call
   * before the engine is destroyed.  Idempotent; one thread.
   */
  void stop();

  const std::vector<uint8_t>& address() const { return blob_; }
  uint64_t incarnation() const { return self_.incarnation; }

  /** kvxfer_endpoint_connect (errors there). */
  kvxfer_result_t connect(const void* blob, size_t len, int* peer);
  /** kvxfer_endpoint_disconnect (errors there). */
  kvxfer_result_t disconnect(int peer);

 private:
  enum class State { kOutgoing, kIncoming, kLive, kGone };
  struct Entry {
    EndpointAddress addr;
    std::vector<uint8_t> blob;
    State state = State::kGone;
    bool initiated = false;  // the Live connection is one this side made
    int peer = -1;
    std::string why;  // kGone: why
  };
  struct Reply {
    HandshakeStatus status = HandshakeStatus::kError;
    uint64_t incarnation = 0;
    std::vector<uint8_t> link;
    std::string reason;
  };

  Membership() = default;
  void accept_main();
  /** Answers the handshake frame `f` (without its length prefix) on `fd`. */
  void serve(int fd, const std::string& who, const std::vector<uint8_t>& f);
  /** Sends a CONNECT (link != null; its address goes along) or a BYE. */
  kvxfer_result_t exchange(const EndpointAddress& to, bool bye, bool force,
                           const std::vector<uint8_t>& link_addr, int budget_ms, Reply* reply);
  /** One outgoing handshake for `e`'s peer: CONNECT, then the Link's connect on OK. */
  kvxfer_result_t dial(const EndpointAddress& to, bool force, Reply* reply,
                       std::unique_ptr<transport::Link>* link);
  /** One round of connect(): *again when it must start over. */
  kvxfer_result_t connect_round(const EndpointAddress& to, const void* blob, size_t len,
                                std::chrono::steady_clock::time_point deadline, int* peer,
                                bool* again);
  /** Hands a connected Link to the engine and makes `e` Live (mu_ held). */
  int go_live(uint64_t incarnation, Entry& e, std::unique_ptr<transport::Link> link,
              bool initiated);
  /** Ends `e` (mu_ held): Gone with `why`; its engine peer dropped with `code`. */
  void end(Entry& e, kvxfer_result_t code, const std::string& why);
  void on_link_failed(int peer, const std::string& why);
  void tell_bye(const EndpointAddress& to, int budget_ms);
  const uint8_t* secret_for(const EndpointAddress& to) const;
  /** The engine's Link configuration for `peer`: with the auto provider,
   *  shared memory only to a peer on this host in another process, the
   *  network only to any other. */
  transport::LinkConfig link_config(const EndpointAddress& peer) const;

  // Spare Links (docs/TRANSPORT.md, "Endpoints"): making a Link takes 10-25
  // ms, nearly all of it the provider touching its endpoints' memory, and
  // both sides of a connect make one in turn.  Once a path has been used,
  // a thread keeps one unconnected Link of that path made ahead, and a
  // connect takes it.  Slot 0: shared memory; 1: the network path.
  static constexpr int kSpareSlots = 2;
  static constexpr int kSpareQuietMs = 200;
  int spare_slot(const transport::LinkConfig& lc) const;
  /** An unconnected Link for `peer`: the spare of its path when there is one,
   *  else a new one.  Either way the spare maker then refills that path. */
  kvxfer_result_t new_link(const EndpointAddress& peer, std::unique_ptr<transport::Link>* out);
  void spare_main();
  void stop_spares();
  struct Spare {
    bool wanted = false;  // a connect used this path: keep a spare made
    bool making = false;  // spare_main is making it (spare_mu_ not held)
    transport::LinkConfig cfg;
    std::unique_ptr<transport::Link> link;
  };
  std::mutex spare_mu_;  // after mu_ when both are held
  std::condition_variable spare_cv_;
  std::array<Spare, kSpareSlots> spares_;
  bool spares_stopped_ = false;
  std::chrono::steady_clock::time_point last_take_{};  // the last new_link
  std::thread spare_maker_;

  Engine* engine_ = nullptr;
  Config cfg_;
  EndpointAddress self_;
  std::vector<uint8_t> blob_;
  int listen_fd_ = -1;
  int stop_fd_ = -1;
  std::thread acceptor_;
  LogThrottle refused_log_;  // the acceptor's refusals: one WARN a second (a peer repeats them)

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopped_ = false;
  std::unordered_map<uint64_t, Entry> entries_;  // by the peer's incarnation
  std::vector<uint64_t> peer_incarnation_;       // engine peer index -> incarnation
};

}  // namespace kvxfer::xfer
