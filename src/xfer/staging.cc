#include "xfer/staging.h"

#include <sys/mman.h>

#include <vector>

#include "xfer/device.h"

namespace kvxfer::xfer {
namespace {

constexpr size_t kPage = 4096;
constexpr size_t kHuge = size_t{2} << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

Staging& Staging::operator=(Staging&& o) noexcept {
  if (this != &o) {
    reset();
    owner_ = std::move(o.owner_);
    p_ = o.p_;
    cap_ = o.cap_;
    o.p_ = nullptr;
    o.cap_ = 0;
  }
  return *this;
}

void Staging::reset() {
  if (p_ != nullptr) owner_->put(p_, cap_);
  owner_.reset();
  p_ = nullptr;
  cap_ = 0;
}

std::shared_ptr<StagingCache> StagingCache::create(size_t keep_bytes, int64_t keep_ms) {
  return std::shared_ptr<StagingCache>(new StagingCache(keep_bytes, keep_ms));
}

StagingCache::~StagingCache() {
  for (auto& [cap, k] : kept_) unmap(k.p, cap);
}

bool StagingCache::get(size_t n, Staging* out) {
  out->reset();
  const size_t want = round_up(n == 0 ? 1 : n, n >= kHuge ? kHuge : kPage);
  std::vector<std::pair<uint8_t*, size_t>> drop;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = kept_.lower_bound(want);
    if (it != kept_.end() && it->first <= 2 * want) {
      out->owner_ = shared_from_this();
      out->p_ = it->second.p;
      out->cap_ = it->first;
      kept_total_ -= it->first;
      kept_.erase(it);
      return true;
    }
    // A miss: what is kept is of other sizes than the requests now in
    // flight take.  It goes, so that a stream of requests of changing sizes
    // holds its working set and not that plus every size it passed through.
    for (auto& [cap, k] : kept_) drop.emplace_back(k.p, cap);
    kept_.clear();
    kept_total_ = 0;
  }
  for (auto& [q, cap] : drop) unmap(q, cap);
  void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  if (want >= kHuge) (void)madvise(p, want, MADV_HUGEPAGE);  // fewer faults; a hint only
  out->owner_ = shared_from_this();
  out->p_ = static_cast<uint8_t*>(p);
  out->cap_ = want;
  return true;
}

void StagingCache::put(uint8_t* p, size_t cap) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (kept_total_ + cap <= keep_bytes_) {
      kept_.emplace(cap, Kept{p, Clock::now()});
      kept_total_ += cap;
      return;
    }
  }
  unmap(p, cap);
}

void StagingCache::unmap(uint8_t* p, size_t cap) {
  // A device request page-locked it (DeviceCodec::pin keeps registrations
  // for the buffer's next request): unregister before the pages go.
  if (DeviceCodec* d = device_codec()) d->forget(p, cap);
  munmap(p, cap);
}

void StagingCache::trim(Clock::time_point now) {
  std::vector<std::pair<uint8_t*, size_t>> drop;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = kept_.begin(); it != kept_.end();) {
      if (now - it->second.since >= std::chrono::milliseconds(keep_ms_)) {
        drop.emplace_back(it->second.p, it->first);
        kept_total_ -= it->first;
        it = kept_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& [p, cap] : drop) unmap(p, cap);
}

size_t StagingCache::kept_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return kept_total_;
}

}  // namespace kvxfer::xfer
