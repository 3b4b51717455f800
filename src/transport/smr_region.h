// What kvxfer knows of libfabric 1.17's shm regions: the /dev/shm file of
// each shm endpoint, whose header is struct smr_region (include/ofi_shm.h,
// SMR_VERSION 4).  The one place for its layout (docs/TRANSPORT.md, "Paths").
#pragma once

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kvxfer::transport::smr {

// struct smr_region on x86-64 and aarch64: u8 version, u8 resv, u16 flags,
// i32 pid, u8 cma_cap_peer, u8 cma_cap_self, u32 max_sar_buf_per_peer,
// void* base_addr, pthread_spinlock_t lock, ofi_atomic32_t signal, void*
// map, size_t total_size, cmd_cnt, sar_cnt, then seven size_t offsets of
// which sock_name_offset is the last.
inline constexpr uint8_t kVersion = 4;
inline constexpr size_t kPidOffset = 4;
inline constexpr size_t kLockOffset = 24;
/** ofi_atomic32_t signal: set to 1 (smr_signal) by whoever queues a command
 *  or a response for the region's owner, or by the owner itself to retry;
 *  the owner's progress works only when it swaps it from 1 to 0
 *  (smr_ep_progress). */
inline constexpr size_t kSignalOffset = 28;
inline constexpr size_t kTotalSizeOffset = 40;
inline constexpr size_t kSockNameOffsetOffset = 112;
inline constexpr size_t kHeaderBytes = 120;
/** SMR_SOCK_NAME_MAX: sizeof(sockaddr_un::sun_path), the region's last field. */
inline constexpr size_t kSockNameMax = 108;

/** The /dev/shm file of a shm endpoint name ("fi_shm://<pid>:<uid>:<n>"). */
inline std::string region_file(const std::vector<uint8_t>& name) {
  const std::string n(reinterpret_cast<const char*>(name.data()),
                      strnlen(reinterpret_cast<const char*>(name.data()), name.size()));
  const size_t slash = n.rfind('/');
  return "/dev/shm/" + (slash == std::string::npos ? n : n.substr(slash + 1));
}

/**
 * Whether `path` (stat `st`) looks like the shm region of process `pid`: a
 * regular file of this user, not writable by others, of a power-of-two size
 * of at least 64 KiB, whose header names `pid` and its own size.  *why says
 * what is not.  Thread-safe.
 */
bool region_plausible(const std::string& path, const struct stat& st, uint32_t pid,
                      std::string* why);

/**
 * A read-only mapping of a region's first page, for its signal word: 1 while
 * the region's owner has work queued that its progress has not taken up.
 * Empty (signalled() false) when the file is not a version-4 region or
 * cannot be mapped.  Moveable; reads are thread-safe.
 */
class SignalView {
 public:
  SignalView() = default;
  SignalView(SignalView&& o) noexcept : base_(o.base_) { o.base_ = nullptr; }
  SignalView& operator=(SignalView&& o) noexcept;
  SignalView(const SignalView&) = delete;
  SignalView& operator=(const SignalView&) = delete;
  ~SignalView() { reset(); }
  /** Maps `path`; false (and empty) unless it is a version-4 region. */
  bool map(const std::string& path);
  void reset();
  bool mapped() const { return base_ != nullptr; }
  bool signalled() const {
    return base_ != nullptr &&
           __atomic_load_n(reinterpret_cast<const int32_t*>(base_ + kSignalOffset),
                           __ATOMIC_ACQUIRE) != 0;
  }

 private:
  const uint8_t* base_ = nullptr;
};

/**
 * Gives back the memory of the unused tail of this process's region `path`.
 * smr_create() (prov/util/src/util_shm.c) rounds a region up to a power of
 * two (16 MiB for any queue size: the 256 SAR buffers alone take 8 MiB) and
 * then writes its name with strncpy(name, ..., total_size - name_offset),
 * which zero-fills every page from the name to the end: 3.8 MiB of tmpfs
 * per endpoint with 1024 entries, more with fewer.  Nothing in libfabric
 * reads or writes past the socket name, the last field, so the pages after
 * it are punched out of the file (fallocate PUNCH_HOLE), which frees them
 * in every process that maps the region.  Returns the bytes punched; 0 when
 * the header is not version 4's or anything fails (logged at INFO: the
 * region keeps working, only larger).  Thread-safe.
 */
size_t trim_region(const std::string& path);

}  // namespace kvxfer::transport::smr
