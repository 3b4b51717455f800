// Host staging buffers of one engine, kept for the next request.
//
// A request's encoded sections (sender) and anchor sections (receiver) need
// one buffer of tens of MiB per request.  A fresh mapping of that size costs
// a page fault and a cleared page per 4 KiB on first touch: 64 MiB of BF16
// passthrough spent about a quarter of its samples in the kernel's fault path
// (docs/PERFORMANCE.md, "Where the engine's time goes").  A released buffer is
// kept, up to `keep_bytes` in all, and reused by a later request of about the
// same size; one left unused for `keep_ms` is unmapped (trim), so an idle
// communicator gives the memory back.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace kvxfer::xfer {

class StagingCache;

/** One staging buffer (RAII, movable); released to its cache. */
class Staging {
 public:
  Staging() = default;
  Staging(Staging&& o) noexcept { *this = std::move(o); }
  Staging& operator=(Staging&& o) noexcept;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging() { reset(); }

  uint8_t* get() const { return p_; }
  size_t capacity() const { return cap_; }
  explicit operator bool() const { return p_ != nullptr; }
  /** Hands the buffer back to its cache (which keeps or unmaps it). */
  void reset();

 private:
  friend class StagingCache;
  std::shared_ptr<StagingCache> owner_;
  uint8_t* p_ = nullptr;
  size_t cap_ = 0;
};

class StagingCache : public std::enable_shared_from_this<StagingCache> {
 public:
  using Clock = std::chrono::steady_clock;
  static std::shared_ptr<StagingCache> create(size_t keep_bytes, int64_t keep_ms);
  ~StagingCache();

  /**
   * A buffer of at least `n` bytes (n = 0 counts as 1): a kept one of n to
   * 2n bytes, else a new anonymous mapping (transparent huge pages asked for
   * from 2 MiB), and every kept buffer is unmapped first (they are of other
   * sizes than the requests in flight take).  Its contents are undefined.  False (and no buffer) if
   * the mapping fails.  Thread-safe.
   */
  bool get(size_t n, Staging* out);
  /** Unmaps kept buffers unused since `now - keep_ms`.  Thread-safe. */
  void trim(Clock::time_point now);
  /** Bytes kept for reuse now. */
  size_t kept_bytes() const;

 private:
  friend class Staging;
  StagingCache(size_t keep_bytes, int64_t keep_ms) : keep_bytes_(keep_bytes), keep_ms_(keep_ms) {}
  void put(uint8_t* p, size_t cap);
  /** munmap, after DeviceCodec::forget (a device request may have page-locked it). */
  static void unmap(uint8_t* p, size_t cap);
  struct Kept {
    uint8_t* p;
    Clock::time_point since;
  };
  const size_t keep_bytes_;
  const int64_t keep_ms_;
  mutable std::mutex mu_;
  std::multimap<size_t, Kept> kept_;  // capacity -> buffer
  size_t kept_total_ = 0;
};

}  // namespace kvxfer::xfer
