// The bootstrap's frames and socket calls, shared by its root
// (bootstrap.cc) and its ranks (bootstrap_rank.cc).  Internal; the wire
// format is bootstrap.h's.
#pragma once

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "transport/bootstrap.h"
#include "transport/tcp_io.h"

namespace kvxfer::transport::bootstrap_wire {

using Clock = std::chrono::steady_clock;
using tcp::Deadline;
using tcp::deadline_after;
using tcp::errno_text;
using tcp::Fd;
using tcp::finish_frame;
using tcp::get_u16;
using tcp::get_u32;
using tcp::put_u16;
using tcp::put_u32;
using tcp::remaining_ms;
using tcp::secret_equal;
using tcp::set_nodelay;
using tcp::sockaddr_text;

inline constexpr size_t kHelloFixed = 4 + 2 + 2 + 4 + 4 + kBootstrapSecretBytes + 4;  // 52
inline constexpr size_t kTableFixed = 4 + 2 + 2 + 4;                                  // 12
inline constexpr size_t kMaxPending = 256;  // unauthenticated connections held at once
inline constexpr int kAcceptBatch = 32;     // connections accepted a round, between hello reads
inline constexpr uint16_t kStatusOk = 0;
inline constexpr uint16_t kStatusTimeout = 1;
inline constexpr uint16_t kStatusTooLarge = 2;
inline constexpr uint16_t kStatusRankFailed = kBootstrapStatusRankFailed;

inline constexpr const char* kWho = "bootstrap";

inline kvxfer_result_t sys_error(const char* what, int e) { return tcp::sys_error(kWho, what, e); }
inline kvxfer_result_t send_all(int fd, const uint8_t* buf, size_t len, Deadline d,
                                const char* what, bool* closed) {
  return tcp::send_all(fd, buf, len, d, kWho, what, closed);
}
inline kvxfer_result_t recv_all(int fd, uint8_t* buf, size_t len, Deadline d, const char* what,
                                bool* closed) {
  return tcp::recv_all(fd, buf, len, d, kWho, what, closed);
}

/** Fills sa from the id; false when the id is not a valid one. */
inline bool id_sockaddr(const UniqueId& id, sockaddr_storage* sa, socklen_t* len) {
  if (unique_id_defect(id) != nullptr) return false;
  std::memset(sa, 0, sizeof *sa);
  if (id.family == AF_INET) {
    auto* s = reinterpret_cast<sockaddr_in*>(sa);
    s->sin_family = AF_INET;
    s->sin_port = id.port;
    std::memcpy(&s->sin_addr, id.addr, 4);
    *len = sizeof(sockaddr_in);
  } else if (id.family == AF_INET6) {
    auto* s = reinterpret_cast<sockaddr_in6*>(sa);
    s->sin6_family = AF_INET6;
    s->sin6_port = id.port;
    std::memcpy(&s->sin6_addr, id.addr, 16);
    s->sin6_scope_id = id.scope_id;
    *len = sizeof(sockaddr_in6);
  } else {
    return false;
  }
  return id.port != 0;
}

/** One connect to the root; *retry when it may not be listening yet. */
inline kvxfer_result_t connect_once(const sockaddr_storage& sa, socklen_t len, Deadline d, Fd* out,
                                    bool* retry) {
  return tcp::connect_once(sa, len, d, out, retry, kWho, "the bootstrap root");
}

inline kvxfer_result_t refused_error(const std::string& root) {
  return set_error(KVXFER_ERR_SYSTEM,
                   "bootstrap refused by root: %s closed the connection without sending the "
                   "address table (its log says why: a wrong secret, a malformed hello, a "
                   "rank already taken or out of range, another nranks, or a flood of "
                   "unauthenticated connections that dropped this one before its hello was "
                   "read)",
                   root.c_str());
}

inline std::vector<uint8_t> status_frame(uint16_t status, int nranks) {
  std::vector<uint8_t> f(4, 0);
  put_u32(&f, kBootstrapMagic);
  put_u16(&f, kBootstrapVersion);
  put_u16(&f, status);
  put_u32(&f, static_cast<uint32_t>(nranks));
  finish_frame(&f);
  return f;
}

/** At most kBootstrapMaxReason bytes of `text`, control bytes shown as '?'. */
inline std::string clean_reason(const uint8_t* p, size_t n) {
  std::string out(reinterpret_cast<const char*>(p), std::min(n, kBootstrapMaxReason));
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return out;
}
inline std::string clean_reason(const std::string& s) {
  return clean_reason(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

/**
 * A status about one rank: the table header, then rank u32, reason_len u32,
 * reason.  RANK_FAILED from the root (the failed rank), and a rank's final
 * status (READY with no reason, or RANK_FAILED; its own rank).
 */
inline std::vector<uint8_t> rank_frame(uint16_t status, int nranks, int rank,
                                       const std::string& reason) {
  std::vector<uint8_t> f = status_frame(status, nranks);
  put_u32(&f, static_cast<uint32_t>(rank));
  put_u32(&f, static_cast<uint32_t>(reason.size()));
  f.insert(f.end(), reason.begin(), reason.end());
  finish_frame(&f);
  return f;
}
inline std::vector<uint8_t> failure_frame(int nranks, int failed_rank, const std::string& reason) {
  return rank_frame(kStatusRankFailed, nranks, failed_rank, reason);
}
inline constexpr uint16_t kStatusReady = kBootstrapStatusReady;

inline std::vector<uint8_t> hello_frame(const UniqueId& id, uint16_t flags, int rank, int nranks,
                                        const uint8_t* payload, size_t payload_len) {
  std::vector<uint8_t> hello(4, 0);
  hello.reserve(4 + kHelloFixed + payload_len);
  put_u32(&hello, kBootstrapMagic);
  put_u16(&hello, kBootstrapVersion);
  put_u16(&hello, flags);
  put_u32(&hello, static_cast<uint32_t>(rank));
  put_u32(&hello, static_cast<uint32_t>(nranks));
  hello.insert(hello.end(), id.secret, id.secret + kBootstrapSecretBytes);
  put_u32(&hello, static_cast<uint32_t>(payload_len));
  if (payload_len > 0) hello.insert(hello.end(), payload, payload + payload_len);
  finish_frame(&hello);
  return hello;
}

/**
 * Connects to the root, retrying while it is not listening (yet), until `d`.
 * KVXFER_ERR_TIMEOUT (naming `rank` and `budget_ms`) when it cannot.
 */
inline kvxfer_result_t connect_root(const sockaddr_storage& sa, socklen_t sl, Deadline d, int rank,
                                    const std::string& root, int budget_ms, Fd* fd) {
  auto backoff = std::chrono::milliseconds(5);
  for (;;) {
    bool retry = false;
    kvxfer_result_t r = connect_once(sa, sl, d, fd, &retry);
    if (r == KVXFER_SUCCESS) break;
    if (r == KVXFER_ERR_TIMEOUT || (retry && remaining_ms(d) == 0)) {
      std::string detail = last_error();
      return set_error(KVXFER_ERR_TIMEOUT,
                       "bootstrap: rank %d could not reach the root %s within %d ms (%s)", rank,
                       root.c_str(), budget_ms, detail.c_str());
    }
    if (!retry) return r;
    std::this_thread::sleep_for(
        std::min<std::chrono::milliseconds>(backoff, std::chrono::milliseconds(remaining_ms(d))));
    backoff = std::min<std::chrono::milliseconds>(backoff * 2, std::chrono::milliseconds(100));
  }
  set_nodelay(fd->get());
  return KVXFER_SUCCESS;
}

/**
 * Parses the body of a rank-failed status frame (`len` bytes at b, the table
 * header included) into KVXFER_ERR_SYSTEM "rank N failed: reason", or
 * KVXFER_ERR_CORRUPT when malformed.
 */
inline kvxfer_result_t rank_failed_error(const uint8_t* b, size_t len, int nranks, int rank,
                                         const std::string& root) {
  if (len < kTableFixed + 8)
    return set_error(KVXFER_ERR_CORRUPT, "bootstrap: rank-failed status from %s truncated",
                     root.c_str());
  const uint32_t failed = get_u32(b + kTableFixed);
  const uint32_t rlen = get_u32(b + kTableFixed + 4);
  if (failed >= static_cast<uint32_t>(nranks) || rlen != len - kTableFixed - 8)
    return set_error(KVXFER_ERR_CORRUPT,
                     "bootstrap: rank-failed status from %s: bad rank %u or reason length %u",
                     root.c_str(), failed, rlen);
  const std::string reason = clean_reason(b + kTableFixed + 8, rlen);
  return set_error(KVXFER_ERR_SYSTEM,
                   "bootstrap: rank %u failed: %s (relayed by the root %s to rank %d of %d)",
                   failed, reason.c_str(), root.c_str(), rank, nranks);
}

/** Upper bound on a rank_frame body. */
inline constexpr size_t kFinalMax = kTableFixed + 8 + kBootstrapMaxReason;

}  // namespace kvxfer::transport::bootstrap_wire
