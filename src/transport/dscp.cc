#include "transport/dscp.h"

#include <dirent.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace kvxfer::transport {
namespace {

bool same_port(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET)
    return reinterpret_cast<const sockaddr_in*>(a)->sin_port ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_port;
  return reinterpret_cast<const sockaddr_in6*>(a)->sin6_port ==
         reinterpret_cast<const sockaddr_in6*>(b)->sin6_port;
}

bool same_host(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET)
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                     &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
}

bool is_wildcard(const sockaddr* a) {
  if (a->sa_family == AF_INET)
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr == htonl(INADDR_ANY);
  if (a->sa_family == AF_INET6)
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr, &in6addr_any,
                       sizeof(in6_addr)) == 0;
  return false;
}

int get_int(int fd, int level, int opt) {
  int v = 0;
  socklen_t len = sizeof(v);
  if (getsockopt(fd, level, opt, &v, &len) != 0) return -1;
  return v;
}

int read_tos(int fd, int family) {
  return family == AF_INET ? get_int(fd, IPPROTO_IP, IP_TOS)
                           : get_int(fd, IPPROTO_IPV6, IPV6_TCLASS);
}

}  // namespace

bool is_inet_sockaddr(const void* addr, size_t len) {
  if (addr == nullptr || len < sizeof(sockaddr)) return false;
  const auto* sa = static_cast<const sockaddr*>(addr);
  if (sa->sa_family == AF_INET) return len >= sizeof(sockaddr_in);
  if (sa->sa_family == AF_INET6) return len >= sizeof(sockaddr_in6);
  return false;
}

std::vector<MarkedSocket> mark_matching_sockets(const sockaddr* local, const sockaddr* peer,
                                                int dscp) {
  std::vector<MarkedSocket> out;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return out;
  const int self = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long v = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || v < 0 || v == self) continue;
    const int fd = static_cast<int>(v);
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    const int family = get_int(fd, SOL_SOCKET, SO_DOMAIN);
    if (family != AF_INET && family != AF_INET6) continue;
    sockaddr_storage me{}, them{};
    socklen_t ml = sizeof(me), tl = sizeof(them);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&me), &ml) != 0) continue;
    const bool connected = getpeername(fd, reinterpret_cast<sockaddr*>(&them), &tl) == 0;
    const auto* mes = reinterpret_cast<const sockaddr*>(&me);
    const auto* ths = reinterpret_cast<const sockaddr*>(&them);
    bool by_local = false, match = false;
    if (local != nullptr && same_port(mes, local) && (same_host(mes, local) || is_wildcard(mes))) {
      match = by_local = true;
    } else if (peer != nullptr && connected && same_port(ths, peer) && same_host(ths, peer)) {
      match = true;
    }
    if (!match) continue;
    MarkedSocket m;
    m.fd = fd;
    m.family = family;
    m.type = get_int(fd, SOL_SOCKET, SO_TYPE);
    m.by_local = by_local;
    m.connected = connected;
    m.tos_before = read_tos(fd, family);
    if (m.type == SOCK_STREAM) m.nodelay = get_int(fd, IPPROTO_TCP, TCP_NODELAY);
    // dscp < 0 inspects only (and a negative value must not be shifted).
    const int tos = dscp < 0 ? 0 : (dscp << 2) | (m.tos_before > 0 ? (m.tos_before & 0x3) : 0);
    if (dscp < 0) {
      // Inspect only.
    } else if (family == AF_INET) {
      (void)setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof(tos));
    } else {
      (void)setsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tos, sizeof(tos));
      (void)setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof(tos));  // v4-mapped peers
    }
    m.tos_after = read_tos(fd, family);
    out.push_back(m);
  }
  closedir(dir);
  return out;
}

ConnState find_conn_socket(const std::vector<uint8_t>& me, const std::vector<uint8_t>& peer,
                           ConnSocket* out) {
  if (!is_inet_sockaddr(me.data(), me.size()) || !is_inet_sockaddr(peer.data(), peer.size()))
    return ConnState::kUnknown;
  const auto socks = mark_matching_sockets(reinterpret_cast<const sockaddr*>(me.data()),
                                           reinterpret_cast<const sockaddr*>(peer.data()), -1);
  bool any_tcp = false;
  for (const auto& m : socks) {
    if (m.type != SOCK_STREAM) continue;
    any_tcp = true;
    if (!m.connected) continue;
    ConnSocket c;
    c.fd = m.fd;
    c.local_len = sizeof(c.local);
    c.peer_len = sizeof(c.peer);
    if (getsockname(m.fd, reinterpret_cast<sockaddr*>(&c.local), &c.local_len) != 0 ||
        getpeername(m.fd, reinterpret_cast<sockaddr*>(&c.peer), &c.peer_len) != 0)
      continue;
    *out = c;
    return ConnState::kOpen;
  }
  return any_tcp ? ConnState::kGone : ConnState::kUnknown;
}

bool conn_socket_closed_by_peer(const ConnSocket& s) {
  pollfd p{s.fd, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) != 1 || (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0) return false;
  int unread = 0;
  return ioctl(s.fd, FIONREAD, &unread) == 0 && unread == 0;
}

bool conn_socket_open(const ConnSocket& s) {
  sockaddr_storage me{}, them{};
  socklen_t ml = sizeof(me), tl = sizeof(them);
  return getsockname(s.fd, reinterpret_cast<sockaddr*>(&me), &ml) == 0 &&
         getpeername(s.fd, reinterpret_cast<sockaddr*>(&them), &tl) == 0 && ml == s.local_len &&
         tl == s.peer_len && std::memcmp(&me, &s.local, ml) == 0 &&
         std::memcmp(&them, &s.peer, tl) == 0;
}

}  // namespace kvxfer::transport
