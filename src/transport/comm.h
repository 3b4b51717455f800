// A communicator of N ranks over the libfabric layer (docs/TRANSPORT.md).
//
// Internal (no public API).  Every rank holds one Link (ofi.h) per peer: the
// pair (i, j) is joined by Link i->j on rank i and Link j->i on rank j, each
// with one RDM endpoint per traffic class.  create():
//   1. opens one Link per peer (non-blocking);
//   2. runs the bootstrap (bootstrap.h) with a payload that lists this rank's
//      Link addresses indexed by peer rank (format below); rank 0 also runs
//      the root's accept_all (with its final status round) on a helper
//      thread, joined before create returns;
//   3. connects each Link to the matching entry of the peer's payload;
//   4. drives every Link until all handshakes are done, reports READY on its
//      bootstrap connection, and keeps driving them until the root says
//      every rank is READY: create returns on every rank at about the same
//      time, once every pair is connected.
// One deadline (timeout_ms from the start of create) bounds all four steps;
// a wrong secret, a missing rank or a dead peer is an error, never a hang.
// Fail fast: a rank that fails in step 1 reports it (report_failure: a
// failure report, or fail_all on rank 0); one that fails in step 3 or 4
// reports RANK_FAILED on its bootstrap connection, and one whose process
// ends closes it.  Either way the root relays it, and every other rank fails
// within about a second with "rank N failed: <its reason>" rather than at
// the deadline.
//
// Payload format (integers little-endian):
//   magic u32 ("KVXC"), version u16, 0 u16, rank u32, nranks u32,
//   nranks x (len u32, bytes)     (len 0 for the rank itself)
//
// Threading: a Communicator is driven by one thread at a time, like a Link;
// abort() must be called from that thread (or under the caller's lock).
// Different Links of one Communicator may be driven by different threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "transport/bootstrap.h"
#include "transport/ofi.h"

namespace kvxfer::transport {

constexpr uint32_t kCommPayloadMagic = 0x4358564bu;  // "KVXC" little-endian
constexpr uint16_t kCommPayloadVersion = 1;

/** Encodes `addrs` (indexed by peer rank; addrs[rank] empty) as a payload. */
std::vector<uint8_t> encode_comm_payload(int rank, const std::vector<std::vector<uint8_t>>& addrs);
/** Decodes a payload that must come from `rank` of `nranks`; the blob this
 *  rank needs is (*addrs)[my_rank].  KVXFER_ERR_CORRUPT when malformed. */
kvxfer_result_t decode_comm_payload(const std::vector<uint8_t>& payload, int rank, int nranks,
                                    std::vector<std::vector<uint8_t>>* addrs);

class Communicator {
 public:
  /**
   * Builds rank `rank` of an `nranks`-rank communicator (2 <= nranks <=
   * kBootstrapMaxRanks) from `id`.  Rank 0 must pass the BootstrapRoot that
   * create_unique_id() returned with `id` (it runs accept_all on a helper
   * thread, which is always joined before create returns); every other rank
   * passes nullptr.  `cfg` configures every Link (its timeout_ms stays the
   * Links' inactivity timeout).  Returns when every Link of every rank is
   * ready (the final status round, bootstrap.h).
   * Errors: KVXFER_ERR_INVALID_ARGUMENT (bad rank/nranks/timeout/out, root on
   * a rank other than 0 or missing on rank 0); KVXFER_ERR_TIMEOUT (a rank
   * missing, the table or a handshake not done within timeout_ms);
   * KVXFER_ERR_SYSTEM with "bootstrap refused by root (wrong secret or bad
   * hello)" for a wrong secret; KVXFER_ERR_SYSTEM with "rank N failed:
   * <reason>" when another rank failed (its reason, as it reported it, or
   * "its bootstrap connection ended before it was ready" when its process
   * ended after the table), within about a second; KVXFER_ERR_CORRUPT
   * for a malformed payload; any Link::create/connect error.  The message
   * names the rank and the step.
   */
  static kvxfer_result_t create(const UniqueId& id, BootstrapRoot* root_or_null, int rank,
                                int nranks, const LinkConfig& cfg, int timeout_ms,
                                std::unique_ptr<Communicator>* out);

  /**
   * Fails fast: tells the other ranks of `id` that `rank` failed, with this
   * thread's last_error() as the reason, so that their create() fails within
   * about a second instead of at its timeout (bootstrap.h).  Rank 0 passes
   * its root (BootstrapRoot::fail_all, which consumes it), the others nullptr
   * (bootstrap_report_failure).  Bounded by min(timeout_ms,
   * kBootstrapFailGraceMs) plus the root's grace; best effort.  Returns
   * `code` with the last error text as it was on entry.  create() calls it
   * for its own failures before the bootstrap; callers that fail before
   * create() (Engine::create) call it themselves.
   */
  static kvxfer_result_t report_failure(const UniqueId& id, BootstrapRoot* root_or_null, int rank,
                                        int nranks, int timeout_ms, kvxfer_result_t code);

  /** Aborts and closes every Link; safe with operations in flight. */
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int nranks() const { return nranks_; }
  /** The Link to `peer`; nullptr for peer == rank(), out of range, or released. */
  Link* link(int peer) const;

  /**
   * A communicator with no peers, whose Links come and go (set_link,
   * release_link): the peers of an endpoint (xfer/endpoint.h).  rank() is -1.
   */
  static std::unique_ptr<Communicator> create_open();
  /** Sets the Link of peer `peer` (>= 0; the table grows).  Same thread as progress(). */
  void set_link(int peer, std::unique_ptr<Link> link);
  /** Closes and frees the Link of `peer` (Link::abort first if it has ops in flight). */
  void release_link(int peer, const char* why);
  /** Slots in the Link table (nranks() for a communicator made by create()). */
  int slots() const { return static_cast<int>(links_.size()); }

  /** Drives every Link once; the first Link error, else KVXFER_SUCCESS. */
  kvxfer_result_t progress();

  /**
   * Fails every Link (Link::abort): every operation not yet reported ends
   * with an error naming `why`, and later posts fail.  Idempotent.
   */
  void abort(const char* why);
  bool aborted() const { return aborted_; }

 private:
  Communicator() = default;
  int rank_ = -1, nranks_ = 0;
  bool aborted_ = false;
  std::vector<std::unique_ptr<Link>> links_;  // indexed by peer; null for self
};

}  // namespace kvxfer::transport
