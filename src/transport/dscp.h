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

#include <cstdint>
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

// ---------------------------------------------------------------------------
// Is the provider's connection to a peer still there?
//
// libfabric 1.17's ofi_rxm frees a connection when it reads the peer's
// shutdown (inside fi_cq_read) but leaves the messages that connection
// delivered on the endpoint's unexpected-message queue.  A later fi_trecv
// that matches such a rendezvous request looks the freed connection up and
// crashes (SIGSEGV in rxm_handle_rndv).  rxm closes the connection's socket in
// the same step, and only while it progresses, so a receive posted after the
// last poll while the socket is still open never meets a freed connection.
// Users (the Link, the NCCL plugin) check before posting receives and fail
// instead once the socket is gone.
// ---------------------------------------------------------------------------
/** The socket that carries the provider's connection to a peer. */
struct ConnSocket {
  int fd = -1;
  sockaddr_storage local{}, peer{};
  socklen_t local_len = 0, peer_len = 0;
};
enum class ConnState {
  kOpen,    // a connected TCP socket between the endpoint and the peer is open (any state)
  kGone,    // the endpoint has TCP sockets (its listener) but none connected to the peer
  kUnknown  // non-socket addresses, or no TCP socket at all (e.g. a UDP provider)
};
/** Finds the connection between endpoint address `me` and `peer` (fi_getname
 *  blobs); *out names it when kOpen. */
ConnState find_conn_socket(const std::vector<uint8_t>& me, const std::vector<uint8_t>& peer,
                           ConnSocket* out);
/** Whether `s` still names the same open, connected socket (two system calls;
 *  a descriptor the provider closed and the system reused fails the match). */
bool conn_socket_open(const ConnSocket& s);
/**
 * Whether the peer has closed or reset `s` and every byte it sent has been
 * read out of the socket (poll(2) POLLRDHUP/POLLHUP/POLLERR with FIONREAD
 * 0): after that the provider cannot complete anything more on it.  A
 * socket with unread bytes is not closed yet, whatever the peer did: its
 * last messages (a STATUS, say) are still to be read.  Two system calls.
 */
bool conn_socket_closed_by_peer(const ConnSocket& s);

}  // namespace kvxfer::transport
