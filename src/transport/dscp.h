// DSCP marking of a provider's sockets from outside the provider.
//
// libfabric 1.17's socket providers (tcp, net, sockets, udp; rxm and rxd on
// top) never set IP_TOS from tx_attr.tclass (the tcp provider only uses
// FI_TC_BULK_DATA to leave TCP_NODELAY off).  Their sockets are ordinary file
// descriptors of this process, so the layer finds them itself: it walks
// /proc/self/fd, keeps the IPv4/IPv6 sockets whose local address is the
// endpoint's own address (its listener and the connections it accepted) or
// whose peer address is the peer endpoint's address (connections it made),
// and sets IP_TOS / IPV6_TCLASS to dscp << 2 (ECN bits preserved).
// Accepted sockets inherit the listener's TOS, so marking the listener early
// covers connections accepted later.
#pragma once

#include <sys/socket.h>

#include <vector>

namespace kvxfer::transport {

struct MarkedSocket {
  int fd = -1;
  int family = 0;  // AF_INET / AF_INET6
  int type = 0;    // SOCK_STREAM / SOCK_DGRAM
  int tos_before = -1;
  int tos_after = -1;
  int nodelay = -1;        // TCP_NODELAY as the provider left it (-1: not TCP)
  bool by_local = false;   // matched on the local address (else on the peer's)
  bool connected = false;  // has a peer (not a listener / unconnected datagram socket)
};

/**
 * Marks every socket of this process whose local address equals `local` (a
 * wildcard-bound socket with local's port matches too) or whose peer address
 * equals `peer`.  Either may be null.  `dscp` 0..63, or -1 to only inspect
 * (report the TOS the provider left, change nothing).  Returns the sockets
 * matched (marking can fail on one without failing the rest: tos_after then
 * shows what the kernel kept).
 */
std::vector<MarkedSocket> mark_matching_sockets(const sockaddr* local, const sockaddr* peer,
                                                int dscp);

/** True for an AF_INET / AF_INET6 sockaddr of a plausible length. */
bool is_inet_sockaddr(const void* addr, size_t len);

}  // namespace kvxfer::transport
