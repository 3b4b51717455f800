// What a test or a benchmark changes in one engine.  An engine created with
// hooks (Engine::create's `hooks`; kvxfer::api::comm_init) shares them with
// its creator; one created without (kvxfer_comm_init) has none, and its
// progress and codec threads take no branch on them beyond a null check.
// Not installed; nothing here is exported from libkvxfer.so.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "transport/ofi.h"

namespace kvxfer::xfer {

struct TestHooks {
  // ---- Read once, when the engine is created -------------------------------
  /** Peers an endpoint lets handshake at once; 0: kMaxHandshakingPeers. */
  int max_handshaking = 0;
  /** Codec threads; 0: the default rule (KVXFER_CODEC_THREADS or half the CPUs). */
  int codec_workers = 0;
  /** Staging bytes per request (KVXFER_STAGING_WINDOW_BYTES; at least two
   *  pages); 0: the parameter. */
  size_t staging_window = 0;
  /** Anchor-store bytes of a receiver's running receives
   *  (KVXFER_RECV_ANCHOR_BYTES); 0: the parameter. */
  size_t recv_anchor_bytes = 0;
  /** How long an idle staging buffer (and a device request's registration of
   *  it) is kept before it is unmapped, in ms; 0: 1000.  Lets a slow run
   *  (ThreadSanitizer) check reuse across requests. */
  int64_t staging_keep_ms = 0;
  /**
   * Measurement seam (kvxfer_perf --engine_only): codec jobs do no work.  An
   * encode reports its pages at their largest encoded size with whatever
   * bytes staging holds; a decode writes nothing and fails nothing.  So a
   * transfer measures the engine and the wire alone.  Both ranks must set
   * it; the receiver's blocks are then undefined.  Never for real transfers.
   */
  bool skip_codec = false;

  // ---- Read by the running engine; any thread may change them ---------------
  /** Each encode job sleeps this long first (us), so a test can make the
   *  encoder slower than the link. */
  std::atomic<int64_t> encode_delay_us{0};
  /** While true, no residual is applied (full decodes wait), so a test can
   *  read the blocks at exactly anchor precision. */
  std::atomic<bool> pause_residuals{false};
  /** The next `n` page sections this engine receives get one byte flipped
   *  before decoding (the checksum must catch it). */
  std::atomic<int> corrupt_sections{0};
  /** Likewise for residual sections only (anchor sections pass untouched),
   *  so a test can corrupt a residual after ANCHOR_READY. */
  std::atomic<int> corrupt_residuals{0};
  /** The byte those corruptions flip: its offset in the section (below 80:
   *  the page header, docs/FORMAT.md 4.1); -1: the section's middle. */
  std::atomic<int64_t> corrupt_offset{-1};

  /** Link message headers (transport/ofi.h, LinkConfig::corrupt_headers):
   *  the count-th header a Link of this engine receives from now gets the
   *  byte at `offset` of its WireHeader flipped.  Shared with the Links. */
  std::shared_ptr<transport::LinkConfig::HeaderCorruption> corrupt_wire_headers =
      std::make_shared<transport::LinkConfig::HeaderCorruption>();

  /** An endpoint's spare Links (xfer/endpoint.h): made ahead by its
   *  thread, and taken by a connect or an accept. */
  std::atomic<int> spare_links_made{0};
  std::atomic<int> spare_links_taken{0};

  /** Engine::post sleeps this long (ms) once the progress thread can see the
   *  new request, before it returns: a request may end meanwhile. */
  std::atomic<int64_t> post_return_delay_ms{0};

  /** Takes one corruption for a received section; true: flip a byte. */
  bool take_corruption(bool anchor) {
    if (corrupt_sections.load() > 0 && corrupt_sections.fetch_sub(1) > 0) return true;
    return !anchor && corrupt_residuals.load() > 0 && corrupt_residuals.fetch_sub(1) > 0;
  }
};

}  // namespace kvxfer::xfer
