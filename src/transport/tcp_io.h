// Blocking-with-deadline TCP helpers shared by the bootstrap (bootstrap.h)
// and the endpoint's connection handshake (xfer/endpoint.h).
//
// Internal.  Every socket is non-blocking; every wait is bounded by a
// deadline (poll); EINTR is retried; sends use MSG_NOSIGNAL.  Errors go to
// the thread's last error as "<who>: <what>: <errno text>"; nothing throws.
// Stateless functions: any thread.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::transport::tcp {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_after(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }
/** Milliseconds left until `d`, rounded up; 0 once it passed. */
int remaining_ms(Deadline d);

std::string errno_text(int e);
/** KVXFER_ERR_SYSTEM "<who>: <what>: <errno text> (errno e)". */
kvxfer_result_t sys_error(const char* who, const char* what, int e);

/** Owns a file descriptor (closed on destruction). */
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);  // not retried on EINTR (Linux closes anyway)
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// Little-endian encoding of frames: a u32 length prefix counts the bytes after it.
void put_u16(std::vector<uint8_t>* b, uint16_t v);
void put_u32(std::vector<uint8_t>* b, uint32_t v);
void put_u64(std::vector<uint8_t>* b, uint64_t v);
uint16_t get_u16(const uint8_t* p);
uint32_t get_u32(const uint8_t* p);
uint64_t get_u64(const uint8_t* p);
/** Patches the length prefix (bytes after the first four) into b[0..3]. */
void finish_frame(std::vector<uint8_t>* b);

/** Constant-time equality (no early exit on the first differing byte). */
bool secret_equal(const uint8_t* a, const uint8_t* b, size_t n);
/** Fills `out` with `n` bytes from getrandom(2).  KVXFER_ERR_SYSTEM on failure. */
kvxfer_result_t random_bytes(uint8_t* out, size_t n, const char* who);

/** "127.0.0.1:4242" / "[::1]:4242"; "<unknown peer>" when it cannot be printed. */
std::string sockaddr_text(const sockaddr* sa, socklen_t len);

/** Waits until fd is ready for `events`; KVXFER_ERR_TIMEOUT "<who>: timed out <what>". */
kvxfer_result_t wait_fd(int fd, short events, Deadline d, const char* who, const char* what);
/** Sends all of buf; *closed = true when the peer has closed or reset. */
kvxfer_result_t send_all(int fd, const uint8_t* buf, size_t len, Deadline d, const char* who,
                         const char* what, bool* closed);
/** Receives exactly len bytes; *closed = true on EOF or reset. */
kvxfer_result_t recv_all(int fd, uint8_t* buf, size_t len, Deadline d, const char* who,
                         const char* what, bool* closed);
void set_nodelay(int fd);
/**
 * One non-blocking connect to `sa` bounded by the deadline.  *retry = true
 * when a later attempt may succeed (nobody listening yet, reset).  `what`
 * names the target in the error ("connect to <what>").
 */
kvxfer_result_t connect_once(const sockaddr_storage& sa, socklen_t len, Deadline d, Fd* out,
                             bool* retry, const char* who, const char* what);
/**
 * Checks `host` as an address to bind and hand to peers: it resolves to an
 * IPv4/IPv6 address that is not a wildcard.  Errors:
 * KVXFER_ERR_INVALID_ARGUMENT, "<who>: cannot resolve bind host '<host>': ..."
 * or "... is a wildcard address ...".
 */
kvxfer_result_t check_bind_host(const char* host, const char* who);

/**
 * A non-blocking listening socket bound to `host` (numeric IPv4/IPv6 or a
 * name; a wildcard is refused: the address is handed to peers) at `port`
 * (0 = ephemeral; SO_REUSEADDR, so a restarted process can take its port
 * again while the connections of its previous life are in TIME_WAIT).  *bound receives the address
 * it listens on. Errors: KVXFER_ERR_INVALID_ARGUMENT (unresolvable or wildcard host),
 * KVXFER_ERR_SYSTEM (socket, bind, listen: "<who>: bind: ...").
 */
kvxfer_result_t open_listener(const char* host, uint16_t port, const char* who, Fd* out,
                              sockaddr_storage* bound);

}  // namespace kvxfer::transport::tcp
