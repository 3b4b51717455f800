// TCP helpers with deadlines (tcp_io.h).
#include "transport/tcp_io.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>
#include <system_error>

#include "common/error.h"

namespace kvxfer::transport::tcp {

int remaining_ms(Deadline d) {
  auto left = std::chrono::ceil<std::chrono::milliseconds>(d - Clock::now()).count();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

std::string errno_text(int e) { return std::error_code(e, std::generic_category()).message(); }

kvxfer_result_t sys_error(const char* who, const char* what, int e) {
  return set_error(KVXFER_ERR_SYSTEM, "%s: %s: %s (errno %d)", who, what, errno_text(e).c_str(), e);
}

void put_u16(std::vector<uint8_t>* b, uint16_t v) {
  b->push_back(static_cast<uint8_t>(v));
  b->push_back(static_cast<uint8_t>(v >> 8));
}
void put_u32(std::vector<uint8_t>* b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u64(std::vector<uint8_t>* b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
uint16_t get_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t get_u32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}
uint64_t get_u64(const uint8_t* p) {
  return uint64_t{get_u32(p)} | (uint64_t{get_u32(p + 4)} << 32);
}
void finish_frame(std::vector<uint8_t>* b) {
  uint32_t len = static_cast<uint32_t>(b->size() - 4);
  for (int i = 0; i < 4; ++i) (*b)[i] = static_cast<uint8_t>(len >> (8 * i));
}

bool secret_equal(const uint8_t* a, const uint8_t* b, size_t n) {
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff = static_cast<uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

kvxfer_result_t random_bytes(uint8_t* out, size_t n, const char* who) {
  size_t filled = 0;
  while (filled < n) {
    ssize_t got = ::getrandom(out + filled, n - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return sys_error(who, "getrandom", errno);
    }
    filled += static_cast<size_t>(got);
  }
  return KVXFER_SUCCESS;
}

std::string sockaddr_text(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) !=
      0)
    return "<unknown peer>";
  return sa->sa_family == AF_INET6 ? std::string("[") + host + "]:" + serv
                                   : std::string(host) + ":" + serv;
}

kvxfer_result_t wait_fd(int fd, short events, Deadline d, const char* who, const char* what) {
  for (;;) {
    int left = remaining_ms(d);
    if (left == 0) return set_error(KVXFER_ERR_TIMEOUT, "%s: timed out %s", who, what);
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, left);
    if (r > 0) return KVXFER_SUCCESS;  // POLLERR/POLLHUP: the next call reports it
    if (r < 0 && errno != EINTR) return sys_error(who, "poll", errno);
  }
}

namespace {
bool is_closed_errno(int e) { return e == EPIPE || e == ECONNRESET || e == ENOTCONN; }
}  // namespace

kvxfer_result_t send_all(int fd, const uint8_t* buf, size_t len, Deadline d, const char* who,
                         const char* what, bool* closed) {
  *closed = false;
  size_t off = 0;
  while (off < len) {
    ssize_t n = ::send(fd, buf + off, len - off, MSG_NOSIGNAL);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      KVXFER_CHECK(wait_fd(fd, POLLOUT, d, who, what));
      continue;
    }
    int e = n < 0 ? errno : EPIPE;
    *closed = is_closed_errno(e);
    return sys_error(who, what, e);
  }
  return KVXFER_SUCCESS;
}

kvxfer_result_t recv_all(int fd, uint8_t* buf, size_t len, Deadline d, const char* who,
                         const char* what, bool* closed) {
  *closed = false;
  size_t off = 0;
  while (off < len) {
    ssize_t n = ::recv(fd, buf + off, len - off, 0);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) {
      *closed = true;
      return set_error(KVXFER_ERR_SYSTEM, "%s: %s: connection closed by peer", who, what);
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      KVXFER_CHECK(wait_fd(fd, POLLIN, d, who, what));
      continue;
    }
    int e = errno;
    *closed = is_closed_errno(e);
    return sys_error(who, what, e);
  }
  return KVXFER_SUCCESS;
}

void set_nodelay(int fd) {
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

kvxfer_result_t connect_once(const sockaddr_storage& sa, socklen_t len, Deadline d, Fd* out,
                             bool* retry, const char* who, const char* what) {
  *retry = false;
  Fd fd(::socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return sys_error(who, "socket", errno);
  const std::string doing = std::string("connect to ") + what;
  int e = 0;
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&sa), len) != 0) {
    e = errno;
    if (e == EINPROGRESS || e == EINTR) {
      KVXFER_CHECK(
          wait_fd(fd.get(), POLLOUT, d, who, ("connecting to " + std::string(what)).c_str()));
      socklen_t el = sizeof e;
      if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &e, &el) != 0) e = errno;
    }
  }
  if (e != 0) {
    *retry = e == ECONNREFUSED || e == ECONNRESET || e == ETIMEDOUT || e == EAGAIN;
    return sys_error(who, doing.c_str(), e);
  }
  *out = std::move(fd);
  return KVXFER_SUCCESS;
}

namespace {
using AddrInfo = std::unique_ptr<addrinfo, void (*)(addrinfo*)>;

// `host` at `port`: its first IPv4/IPv6 address, which must not be a wildcard.
kvxfer_result_t resolve_bind_host(const char* host, uint16_t port, const char* who, AddrInfo* owner,
                                  const addrinfo** out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  int g = ::getaddrinfo(host, service.c_str(), &hints, &res);
  if (g != 0)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "%s: cannot resolve bind host '%s': %s", who,
                     host, g == EAI_SYSTEM ? errno_text(errno).c_str() : gai_strerror(g));
  *owner = AddrInfo(res, ::freeaddrinfo);
  const addrinfo* ai = res;
  while (ai != nullptr && ai->ai_family != AF_INET && ai->ai_family != AF_INET6) ai = ai->ai_next;
  if (ai == nullptr)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "%s: bind host '%s' has no IPv4/IPv6 address",
                     who, host);
  bool wildcard =
      ai->ai_family == AF_INET
          ? reinterpret_cast<const sockaddr_in*>(ai->ai_addr)->sin_addr.s_addr == htonl(INADDR_ANY)
          : IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(ai->ai_addr)->sin6_addr);
  if (wildcard)
    return set_error(KVXFER_ERR_INVALID_ARGUMENT,
                     "%s: bind host '%s' is a wildcard address; give the address of one "
                     "interface (peers must be able to connect to the address handed to them)",
                     who, host);
  *out = ai;
  return KVXFER_SUCCESS;
}
}  // namespace

kvxfer_result_t check_bind_host(const char* host, const char* who) {
  AddrInfo owner(nullptr, ::freeaddrinfo);
  const addrinfo* ai = nullptr;
  return resolve_bind_host(host, 0, who, &owner, &ai);
}

kvxfer_result_t open_listener(const char* host, uint16_t port, const char* who, Fd* out,
                              sockaddr_storage* bound) {
  AddrInfo owner(nullptr, ::freeaddrinfo);
  const addrinfo* ai = nullptr;
  KVXFER_CHECK(resolve_bind_host(host, port, who, &owner, &ai));

  Fd fd(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return sys_error(who, "socket", errno);
  // A restarted process binds its old port again while connections of its
  // previous life are still in TIME_WAIT.
  int one = 1;
  (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) return sys_error(who, "bind", errno);
  if (::listen(fd.get(), SOMAXCONN) != 0) return sys_error(who, "listen", errno);
  socklen_t sl = sizeof *bound;
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(bound), &sl) != 0)
    return sys_error(who, "getsockname", errno);
  *out = std::move(fd);
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::transport::tcp
