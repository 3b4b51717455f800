// Internals of Link shared by its two files (ofi_link.cc: the data path;
// ofi_link_setup.cc: creation, connect and liveness).  Not installed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "transport/ofi.h"
#include "transport/smr_region.h"

namespace kvxfer::transport::link_detail {

// Wire format.  Chunk 0 of a message is this header; chunks 1..n carry the
// data.  The libfabric tag of chunk i of a message with user tag t is
// (t << 24) | i.  Hosts are little-endian (x86-64, aarch64).
inline constexpr int kChunkBits = 24;
inline constexpr uint64_t kMaxChunks = (uint64_t{1} << kChunkBits) - 1;
inline constexpr uint64_t kHelloUserTag = (uint64_t{1} << 40) - 1;  // reserved: Link::kMaxTag + 1
inline constexpr uint64_t kMaxPeerChunk = uint64_t{1} << 30;

inline uint64_t wire_tag(uint64_t user_tag, uint64_t chunk) {
  return (user_tag << kChunkBits) | chunk;
}

// Address blob (docs/TRANSPORT.md, "Address blob"): "KVXL" | version |
// nclasses | npaths | u8 host length, host_identity() | u32 pid |
// npaths x (u8 provider length, provider, nclasses x (u16 length, fi_getname
// bytes)).
inline constexpr char kBlobMagic[4] = {'K', 'V', 'X', 'L'};
inline constexpr uint8_t kBlobVersion = 3;  // 3: shared-memory peers ring a doorbell
inline constexpr int kMaxPaths = 2;

enum Kind : int { kHelloSend, kHelloRecv, kHeader, kData };

// The hello of a side that holds its peer's doorbell ("HELLFXVB"); the
// plain kHelloMagic says it does not.
inline constexpr uint64_t kHelloRingsMagic = 0x425658464C4C4548ull;

// This side's doorbell: a FIFO beside the anchor endpoint's shm region,
// "/dev/shm/<pid>:<uid>:<n>.bell" (removed with the regions of a dead pid,
// remove_shm_regions_of).
inline std::string bell_file(const std::vector<uint8_t>& anchor_name) {
  return smr::region_file(anchor_name) + ".bell";
}

}  // namespace kvxfer::transport::link_detail

namespace kvxfer::transport {

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
  bool queued = false;       // in send_queue_, ahead_queue_ or recv_queue_
  bool reported = false;     // its Completion was emitted
  bool cancelling = false;   // receive: outstanding posts being cancelled
  bool draining = false;     // receive: too small, data lands in scratch
  bool standing = false;     // receive: never expires before its header (post_recv)
  kvxfer_result_t pending_code = KVXFER_SUCCESS;  // reported once cancelling settles
  std::string pending_why;
  std::unique_ptr<uint8_t[]> scratch;
  Clock::time_point posted, last_activity, cancel_deadline;

  bool has_work() const {
    if (cancelling) return false;
    if (is_send) return next_post <= nchunks;
    return next_post == 0 || (have_header && next_post <= nchunks);
  }
  /** A standing receive nothing has arrived for: no timeout, not awaited. */
  bool standing_idle() const { return standing && !have_header; }
};

struct Link::Ctx {
  fi_context2 fi;  // must be first: the provider's scratch space
  Op* op;
  TrafficClass cls;
  int kind;
  uint32_t index;
  size_t bytes;
};

}  // namespace kvxfer::transport
