#include "transport/rate_limiter.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/error.h"
#include "common/log.h"
#include "common/params.h"

namespace kvxfer::transport {

RateLimiter::RateLimiter(double bytes_per_sec, uint64_t burst_bytes)
    : rate_(bytes_per_sec > 0 ? bytes_per_sec : 1.0),
      burst_(burst_bytes > 0 ? burst_bytes : 1),
      tokens_(static_cast<double>(burst_)) {}

void RateLimiter::refill(Clock::time_point now) {
  if (!started_) {
    started_ = true;
    last_ = now;
    return;
  }
  if (now <= last_) return;
  const double dt = std::chrono::duration<double>(now - last_).count();
  tokens_ = std::min(static_cast<double>(burst_), tokens_ + dt * rate_);
  last_ = now;
}

bool RateLimiter::try_acquire(uint64_t bytes, Clock::time_point now) {
  std::lock_guard<std::mutex> lk(mu_);
  refill(now);
  const double need = static_cast<double>(std::min<uint64_t>(bytes, burst_));
  if (tokens_ < need) return false;
  tokens_ -= static_cast<double>(bytes);
  return true;
}

void RateLimiter::refund(uint64_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  tokens_ = std::min(static_cast<double>(burst_), tokens_ + static_cast<double>(bytes));
}

Clock::duration RateLimiter::wait_hint(uint64_t bytes, Clock::time_point now) {
  std::lock_guard<std::mutex> lk(mu_);
  refill(now);
  const double need = static_cast<double>(std::min<uint64_t>(bytes, burst_));
  if (tokens_ >= need) return Clock::duration::zero();
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>((need - tokens_) / rate_));
}

kvxfer_result_t RateLimiter::from_params(std::shared_ptr<RateLimiter>* out) {
  // A malformed KVXFER_RATE_LIMIT fails here, as everywhere, through validate().
  KVXFER_CHECK(params::validate());
  static const std::shared_ptr<RateLimiter> limiter = []() -> std::shared_ptr<RateLimiter> {
    const double bps = params::RateLimit();
    if (bps <= 0) return nullptr;
    KVXFER_INFO(LOG_NET, "OFI : rate limit %.0f bytes/s shared by all links", bps);
    return std::make_shared<RateLimiter>(
        bps, burst_for(bps, static_cast<uint64_t>(params::NetChunkBytes())));
  }();
  *out = limiter;
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::transport
