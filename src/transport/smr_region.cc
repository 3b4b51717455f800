// libfabric 1.17 shm regions (smr_region.h).
#include "transport/smr_region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "common/error.h"
#include "common/log.h"

namespace kvxfer::transport::smr {

bool region_plausible(const std::string& path, const struct stat& st, uint32_t pid,
                      std::string* why) {
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    *why = "not a file of this user, writable by it alone";
    return false;
  }
  if (size < (uint64_t{64} << 10) || (size & (size - 1)) != 0) {
    *why = strprintf("%llu bytes, not a power of two of at least 64 KiB",
                     static_cast<unsigned long long>(size));
    return false;
  }
  uint8_t head[kTotalSizeOffset + 8];
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  const ssize_t n = fd >= 0 ? ::pread(fd, head, sizeof head, 0) : -1;
  if (fd >= 0) ::close(fd);
  if (n != static_cast<ssize_t>(sizeof head)) {
    *why = "its header cannot be read";
    return false;
  }
  int32_t region_pid = 0;
  uint64_t total = 0;
  std::memcpy(&region_pid, head + kPidOffset, 4);
  std::memcpy(&total, head + kTotalSizeOffset, 8);
  if (static_cast<uint32_t>(region_pid) != pid || total != size) {
    *why = strprintf("its header names pid %d and %llu bytes (expected pid %u and %llu)",
                     region_pid, static_cast<unsigned long long>(total), pid,
                     static_cast<unsigned long long>(size));
    return false;
  }
  return true;
}

SignalView& SignalView::operator=(SignalView&& o) noexcept {
  if (this != &o) {
    reset();
    base_ = o.base_;
    o.base_ = nullptr;
  }
  return *this;
}

bool SignalView::map(const std::string& path) {
  reset();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  void* p = ::mmap(nullptr, kHeaderBytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return false;
  base_ = static_cast<const uint8_t*>(p);
  if (base_[0] != kVersion) reset();
  return base_ != nullptr;
}

void SignalView::reset() {
  if (base_ != nullptr) ::munmap(const_cast<uint8_t*>(base_), kHeaderBytes);
  base_ = nullptr;
}

size_t trim_region(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    KVXFER_INFO(LOG_NET, "OFI : shm region %s not trimmed: %s", path.c_str(), std::strerror(errno));
    return 0;
  }
  uint8_t head[kHeaderBytes];
  struct stat st {};
  uint64_t total = 0, sock = 0;
  const bool read = ::pread(fd, head, sizeof head, 0) == static_cast<ssize_t>(sizeof head) &&
                    ::fstat(fd, &st) == 0;
  if (read) {
    std::memcpy(&total, head + kTotalSizeOffset, 8);
    std::memcpy(&sock, head + kSockNameOffsetOffset, 8);
  }
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t from = (sock + kSockNameMax + page - 1) / page * page;
  size_t punched = 0;
  if (!read || head[0] != kVersion || total != static_cast<uint64_t>(st.st_size) ||
      sock < kHeaderBytes || from > total) {
    KVXFER_INFO(LOG_NET, "OFI : shm region %s not trimmed: not libfabric 1.17's layout",
                path.c_str());
  } else if (from < total &&
             ::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(from),
                         static_cast<off_t>(total - from)) != 0) {
    KVXFER_INFO(LOG_NET, "OFI : shm region %s not trimmed: fallocate: %s", path.c_str(),
                std::strerror(errno));
  } else {
    punched = static_cast<size_t>(total - from);
  }
  ::close(fd);
  return punched;
}

}  // namespace kvxfer::transport::smr
