// Recovery from a same-host peer killed while it held a lock of libfabric
// 1.17's shm provider (docs/TRANSPORT.md, "Paths").
//
// shm keeps a pthread spinlock in the header of every endpoint's region.  A
// receiver holds its own region's lock while it works through its command
// queue, CMA copies included; a sender takes the receiver's lock to post a
// command.  A process killed inside such a section leaves the lock held for
// good, and its peer's next post or progress spins on it forever
// (XferDetect.Killed* hung that way).  A watcher thread (one per process,
// started on first use, "kvxfer-shm-watch") looks every 20 ms at each
// watched link: when the link's progress counter has not moved for 3 looks
// and the peer's process has exited (its pidfd is readable), or for the
// link's timeout while the peer lives (stopped, say, by SIGSTOP), it
// releases whichever of the four region locks (two of the peer's, two of
// this side's) is held.  The stuck thread then returns from libfabric and
// the link fails on its next liveness or timeout check.  A stalled peer that
// resumes may find its region's queue written during its section: it
// counted as failed already.
//
// Only regions with libfabric 1.17's header (version 4, the lock at byte
// 24, pthread's unlocked value 1) are watched.  Thread-safe.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace kvxfer::transport {

class ShmLockWatch {
 public:
  /**
   * Watches the regions at `files` (/dev/shm paths: the peer's and this
   * side's) of a link whose peer process is `pidfd` (borrowed; it must stay
   * open until the watch is destroyed) and whose progress() bumps `*epoch`
   * (borrowed likewise); `stall_ms` is the link's timeout.  nullptr when a
   * region cannot be mapped or has another layout: nothing is then watched
   * (logged at INFO).
   */
  static std::unique_ptr<ShmLockWatch> start(int pidfd, uint32_t peer_pid,
                                             const std::vector<std::string>& files,
                                             const std::atomic<uint64_t>* epoch, int64_t stall_ms);
  /** Stops watching (waits for a look in progress) and unmaps. */
  ~ShmLockWatch();
  ShmLockWatch(const ShmLockWatch&) = delete;
  ShmLockWatch& operator=(const ShmLockWatch&) = delete;

  /** Locks released by every watch of this process so far. */
  static uint64_t released();

 private:
  ShmLockWatch() = default;
  uint64_t id_ = 0;
};

/**
 * Removes the libfabric shm regions (/dev/shm/<pid>:<uid>:<n>, 16 MiB of
 * tmpfs each) of process `dead`, which a SIGKILL left behind.  A later
 * process that gets the same pid would otherwise fail fi_enable with EBUSY.
 * For the parent of a killed child (tests, benchmarks); errors are ignored.
 * Header-only: the net plugin's tests use it without libkvxfer's core.
 */
inline void remove_shm_regions_of(pid_t dead) {
  const std::string prefix = std::to_string(dead) + ":";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0) std::filesystem::remove(e.path(), ec);
}

}  // namespace kvxfer::transport
