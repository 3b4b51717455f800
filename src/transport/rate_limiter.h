// Token-bucket rate limiter that emulates one link (KVXFER_RATE_LIMIT).  One
// limiter is shared by the anchor and the residual class of a Link (and, for
// the process-wide limiter, by every Link), so both classes compete for the
// same emulated wire; the Link's send scheduler asks anchors first, so anchors
// win every contended token.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "common/params.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::transport {

using Clock = std::chrono::steady_clock;

// The rate grammar (common/units.h), for kvxfer_comm_config_t.rate_limit.
using params::parse_rate;

/**
 * A token bucket of `burst_bytes` filled at `bytes_per_sec`.
 *
 * try_acquire(b) succeeds when the bucket holds at least min(b, burst) tokens
 * and then removes b (the bucket may go negative by at most b - burst, which
 * lets a chunk larger than the burst through without ever stalling forever).
 * Hence over any interval of length T starting with a full bucket, the bytes
 * granted are at most  burst + rate * T + max(0, largest_chunk - burst):
 * sending S bytes takes at least (S - burst - max(0, chunk - burst)) / rate.
 *
 * Thread-safe: several Links (each driven by its own thread) may share one.
 * Time is passed in so that tests can drive the bucket with a fake clock.
 */
class RateLimiter {
 public:
  /**
   * The bucket depth of the limiters kvxfer makes: one chunk of
   * KVXFER_NET_CHUNK_BYTES plus 1 ms of the rate, so that a sender that wakes
   * up to 1 ms late (the progress thread's sleep, a loaded CPU) still finds
   * the tokens it missed and the emulated link runs at its rate.  With a
   * depth of one chunk each chunk waited for a full bucket plus the wake-up:
   * 64 MiB of BF16 at 10gbit ran at 0.84 of the rate.
   */
  static uint64_t burst_for(double bytes_per_sec, uint64_t chunk_bytes) {
    return chunk_bytes + static_cast<uint64_t>(bytes_per_sec * 1e-3);
  }

  RateLimiter(double bytes_per_sec, uint64_t burst_bytes);

  /** Takes `bytes` tokens if allowed now (see above); false = try later. */
  bool try_acquire(uint64_t bytes, Clock::time_point now);
  /** Returns tokens of an acquisition that could not be used (post failed). */
  void refund(uint64_t bytes);
  /** How long until try_acquire(bytes) would succeed (zero if it would now). */
  Clock::duration wait_hint(uint64_t bytes, Clock::time_point now);

  double bytes_per_sec() const { return rate_; }
  uint64_t burst_bytes() const { return burst_; }

  /**
   * The process-wide limiter from KVXFER_RATE_LIMIT (burst =
   * burst_for(KVXFER_NET_CHUNK_BYTES)), created on first use.  *out is null when the
   * variable is empty (no limit).  A malformed value (or any malformed
   * KVXFER_* variable) is KVXFER_ERR_INVALID_ARGUMENT naming it
   * (params::validate).
   */
  static kvxfer_result_t from_params(std::shared_ptr<RateLimiter>* out);

 private:
  void refill(Clock::time_point now);

  const double rate_;     // bytes per second, > 0
  const uint64_t burst_;  // bucket depth, > 0
  std::mutex mu_;
  double tokens_;  // may be negative (see class comment)
  Clock::time_point last_;
  bool started_ = false;
};

}  // namespace kvxfer::transport
