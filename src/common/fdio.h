// Whole-buffer reads and writes on pipes and sockets, for the two-process
// tests, benchmarks and examples (not part of the library): EINTR is retried,
// a short read or write continues, and a read can have a deadline.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>

namespace kvxfer::fdio {

/** Writes all n bytes; false on an error or a closed peer. */
inline bool write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

/** Reads exactly n bytes; false on EOF, an error, or (timeout_ms >= 0) no
 *  complete data within timeout_ms.  timeout_ms < 0 blocks. */
inline bool read_all(int fd, void* p, size_t n, int timeout_ms = -1) {
  using Clock = std::chrono::steady_clock;
  char* c = static_cast<char*>(p);
  const auto end = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  while (n > 0) {
    if (timeout_ms >= 0) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
      if (left <= 0) return false;
      pollfd pfd{fd, POLLIN, 0};
      const int pr = ::poll(&pfd, 1, static_cast<int>(left));
      if (pr < 0 && errno == EINTR) continue;
      if (pr <= 0) return false;
    }
    const ssize_t r = ::read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace kvxfer::fdio
