// Framed messages over a pipe; see pipe_msg.h.
#include "perf/common/pipe_msg.h"

#include <poll.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/fdio.h"

namespace kvxfer::perf {
namespace {
using kvxfer::fdio::write_all;  // common/fdio.h

/** Reads exactly n bytes before the deadline; false on EOF, error or time out. */
bool read_deadline(int fd, void* p, size_t n, int64_t deadline_ns, const char* peer,
                   std::string* err) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const int64_t left_ms = (deadline_ns - mono_ns()) / 1000000;
    if (left_ms <= 0) {
      *err = std::string("timed out waiting for ") + peer;
      return false;
    }
    pollfd pfd{fd, POLLIN, 0};
    const int pr = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000)));
    if (pr < 0 && errno == EINTR) continue;
    if (pr < 0) {
      *err = std::string("poll: ") + std::strerror(errno);
      return false;
    }
    if (pr == 0) continue;
    const ssize_t r = ::read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      *err = std::string(peer) + " exited";
      return false;
    }
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}
}  // namespace

int64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

bool send_msg(int fd, uint32_t type, const void* p, size_t n) {
  const uint32_t hdr[2] = {type, static_cast<uint32_t>(n)};
  return write_all(fd, hdr, sizeof(hdr)) && write_all(fd, p, n);
}

bool recv_msg(int fd, uint32_t* type, std::vector<uint8_t>* payload, int wait_ms, const char* peer,
              std::string* err) {
  const int64_t deadline = mono_ns() + int64_t{wait_ms} * 1000000;
  uint32_t hdr[2];
  if (!read_deadline(fd, hdr, sizeof(hdr), deadline, peer, err)) return false;
  *type = hdr[0];
  payload->resize(hdr[1]);
  return hdr[1] == 0 || read_deadline(fd, payload->data(), hdr[1], deadline, peer, err);
}

}  // namespace kvxfer::perf
