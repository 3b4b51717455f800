#include "transport/bootstrap.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <system_error>
#include <thread>

#include "common/error.h"
#include "common/log.h"
#include "transport/tcp_io.h"

namespace kvxfer::transport {
namespace {

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

constexpr size_t kHelloFixed = 4 + 2 + 2 + 4 + 4 + kBootstrapSecretBytes + 4;  // 52
constexpr size_t kTableFixed = 4 + 2 + 2 + 4;                                  // 12
constexpr size_t kMaxPending = 256;  // unauthenticated connections held at once
constexpr uint16_t kStatusOk = 0;
constexpr uint16_t kStatusTimeout = 1;
constexpr uint16_t kStatusTooLarge = 2;
constexpr uint16_t kStatusRankFailed = kBootstrapStatusRankFailed;

constexpr const char* kWho = "bootstrap";

kvxfer_result_t sys_error(const char* what, int e) { return tcp::sys_error(kWho, what, e); }
kvxfer_result_t send_all(int fd, const uint8_t* buf, size_t len, Deadline d, const char* what,
                         bool* closed) {
  return tcp::send_all(fd, buf, len, d, kWho, what, closed);
}
kvxfer_result_t recv_all(int fd, uint8_t* buf, size_t len, Deadline d, const char* what,
                         bool* closed) {
  return tcp::recv_all(fd, buf, len, d, kWho, what, closed);
}

/** Fills sa from the id; false when the id is not a valid one. */
bool id_sockaddr(const UniqueId& id, sockaddr_storage* sa, socklen_t* len) {
  if (id.magic != kBootstrapMagic || id.version != kBootstrapVersion) return false;
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
kvxfer_result_t connect_once(const sockaddr_storage& sa, socklen_t len, Deadline d, Fd* out,
                             bool* retry) {
  return tcp::connect_once(sa, len, d, out, retry, kWho, "the bootstrap root");
}

kvxfer_result_t refused_error(const std::string& root) {
  return set_error(KVXFER_ERR_SYSTEM,
                   "bootstrap refused by root (wrong secret or bad hello): %s closed the "
                   "connection without sending the address table",
                   root.c_str());
}

std::vector<uint8_t> status_frame(uint16_t status, int nranks) {
  std::vector<uint8_t> f(4, 0);
  put_u32(&f, kBootstrapMagic);
  put_u16(&f, kBootstrapVersion);
  put_u16(&f, status);
  put_u32(&f, static_cast<uint32_t>(nranks));
  finish_frame(&f);
  return f;
}

/** At most kBootstrapMaxReason bytes of `text`, control bytes shown as '?'. */
std::string clean_reason(const uint8_t* p, size_t n) {
  std::string out(reinterpret_cast<const char*>(p), std::min(n, kBootstrapMaxReason));
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return out;
}
std::string clean_reason(const std::string& s) {
  return clean_reason(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

/**
 * A status about one rank: the table header, then rank u32, reason_len u32,
 * reason.  RANK_FAILED from the root (the failed rank), and a rank's final
 * status (READY with no reason, or RANK_FAILED; its own rank).
 */
std::vector<uint8_t> rank_frame(uint16_t status, int nranks, int rank, const std::string& reason) {
  std::vector<uint8_t> f = status_frame(status, nranks);
  put_u32(&f, static_cast<uint32_t>(rank));
  put_u32(&f, static_cast<uint32_t>(reason.size()));
  f.insert(f.end(), reason.begin(), reason.end());
  finish_frame(&f);
  return f;
}
std::vector<uint8_t> failure_frame(int nranks, int failed_rank, const std::string& reason) {
  return rank_frame(kStatusRankFailed, nranks, failed_rank, reason);
}
constexpr uint16_t kStatusReady = kBootstrapStatusReady;

std::vector<uint8_t> hello_frame(const UniqueId& id, uint16_t flags, int rank, int nranks,
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
kvxfer_result_t connect_root(const sockaddr_storage& sa, socklen_t sl, Deadline d, int rank,
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
kvxfer_result_t rank_failed_error(const uint8_t* b, size_t len, int nranks, int rank,
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

/** A connection whose hello has not been read completely yet. */
struct Pending {
  Fd fd;
  std::string peer;
  uint8_t hdr[4] = {0, 0, 0, 0};
  size_t got = 0;    // bytes received, prefix included
  uint32_t len = 0;  // body length, once the prefix is in
  std::vector<uint8_t> body;
};

enum class ReadState { kMore, kDone, kDrop };

/** Reads what is available; kDrop with *why set when the peer must go. */
ReadState read_frame(Pending* p, size_t min_len, size_t max_len, const char* what,
                     std::string* why) {
  for (;;) {
    ssize_t n;
    if (p->got < 4) {
      n = ::recv(p->fd.get(), p->hdr + p->got, 4 - p->got, 0);
    } else {
      n = ::recv(p->fd.get(), p->body.data() + (p->got - 4), p->len - (p->got - 4), 0);
    }
    if (n == 0) {
      *why = std::string("closed the connection before a complete ") + what;
      return ReadState::kDrop;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return ReadState::kMore;
      *why = "read failed: " + errno_text(errno);
      return ReadState::kDrop;
    }
    p->got += static_cast<size_t>(n);
    if (p->got == 4) {
      p->len = get_u32(p->hdr);
      if (p->len < min_len || p->len > max_len) {
        *why = std::string("bad ") + what + " (length " + std::to_string(p->len) + ")";
        return ReadState::kDrop;
      }
      p->body.resize(p->len);
    }
    if (p->got >= 4 && p->got == 4 + size_t{p->len}) return ReadState::kDone;
  }
}

ReadState read_hello(Pending* p, std::string* why) {
  return read_frame(p, kHelloFixed, kHelloFixed + kBootstrapMaxPayload, "hello", why);
}

/** Upper bound on a rank_frame body. */
constexpr size_t kFinalMax = kTableFixed + 8 + kBootstrapMaxReason;

/**
 * The final status round (accept_all with final_round): reads the final
 * status of every rank on its bootstrap connection.  The first RANK_FAILED,
 * hang-up or malformed status (from a rank already READY too) is relayed to
 * every other rank at once; when all are READY, every rank is sent READY.
 * Bounded by `d`.
 */
kvxfer_result_t run_final_round(std::vector<Fd>* ranks_in, int nranks, Deadline d, int timeout_ms,
                                const std::string& self, int* failed_rank) {
  std::vector<Fd>& ranks = *ranks_in;
  std::vector<std::unique_ptr<Pending>> in(static_cast<size_t>(nranks));
  for (int r = 0; r < nranks; ++r) {
    in[r] = std::make_unique<Pending>();
    in[r]->fd = std::move(ranks[r]);
  }
  std::vector<bool> ready(static_cast<size_t>(nranks), false);
  int nready = 0;
  auto send_every = [&](const std::vector<uint8_t>& f, int except) {
    for (int r = 0; r < nranks; ++r) {
      bool closed;
      if (r != except && in[r]->fd.valid())
        (void)send_all(in[r]->fd.get(), f.data(), f.size(), deadline_after(200),
                       "sending the final status", &closed);
    }
  };
  auto fail = [&](int r, const std::string& reason) {
    *failed_rank = r;
    const std::string why = clean_reason(reason);
    KVXFER_WARN(LOG_NET,
                "bootstrap: root %s: rank %d failed after the table (%s); telling every rank",
                self.c_str(), r, why.c_str());
    send_every(failure_frame(nranks, r, why), r);
    return set_error(KVXFER_ERR_SYSTEM, "bootstrap: rank %d failed: %s (root %s)", r, why.c_str(),
                     self.c_str());
  };
  std::vector<pollfd> fds;
  std::vector<int> who;
  while (nready < nranks) {
    const int left = remaining_ms(d);
    if (left == 0) {
      std::string missing;
      int shown = 0;
      for (int r = 0; r < nranks; ++r) {
        if (ready[r]) continue;
        if (shown < 8) missing += (shown ? ", " : "") + std::to_string(r);
        ++shown;
      }
      if (shown > 8) missing += ", ...";
      send_every(status_frame(kStatusTimeout, nranks), -1);
      return set_error(KVXFER_ERR_TIMEOUT,
                       "bootstrap: root %s: %d of %d ranks ready within %d ms (not ready: %s)",
                       self.c_str(), nready, nranks, timeout_ms, missing.c_str());
    }
    fds.clear();
    who.clear();
    for (int r = 0; r < nranks; ++r) {  // a READY rank may still fail or hang up
      fds.push_back({in[r]->fd.get(), POLLIN, 0});
      who.push_back(r);
    }
    const int pr = ::poll(fds.data(), fds.size(), left);
    if (pr < 0) {
      if (errno == EINTR) continue;
      return sys_error("poll", errno);
    }
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      const int r = who[k];
      Pending* p = in[r].get();
      std::string why;
      const ReadState st = read_frame(p, kTableFixed + 8, kFinalMax, "final status", &why);
      if (st == ReadState::kMore) continue;
      if (st == ReadState::kDrop) {
        p->fd.reset();
        return fail(r, "its bootstrap connection ended before it was ready: " + why);
      }
      const uint8_t* b = p->body.data();
      const uint16_t status = get_u16(b + 6);
      const uint32_t rlen = get_u32(b + kTableFixed + 4);
      if (get_u32(b) != kBootstrapMagic || get_u16(b + 4) != kBootstrapVersion ||
          get_u32(b + 8) != static_cast<uint32_t>(nranks) ||
          get_u32(b + kTableFixed) != static_cast<uint32_t>(r) ||
          rlen != p->len - kTableFixed - 8 ||
          (status != kStatusReady && status != kStatusRankFailed) ||
          (status == kStatusReady && (rlen != 0 || ready[r])))
        return fail(r, "it sent a malformed final status");
      if (status == kStatusRankFailed) return fail(r, clean_reason(b + kTableFixed + 8, rlen));
      ready[r] = true;
      ++nready;
      p->got = 0;  // read the next frame afresh
      p->len = 0;
    }
  }
  send_every(status_frame(kStatusReady, nranks), -1);
  KVXFER_INFO(LOG_NET, "bootstrap: root %s: every one of %d ranks is ready", self.c_str(), nranks);
  return KVXFER_SUCCESS;
}

}  // namespace

// ---------------------------------------------------------------------------
// Root
// ---------------------------------------------------------------------------
BootstrapRoot::~BootstrapRoot() { close_listener(); }

void BootstrapRoot::close_listener() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

kvxfer_result_t create_unique_id(const char* bind_host, UniqueId* id,
                                 std::unique_ptr<BootstrapRoot>* root) {
  KVXFER_REQUIRE(id != nullptr && root != nullptr,
                 "create_unique_id: id and root must not be NULL");
  const char* host = bind_host != nullptr ? bind_host : "127.0.0.1";

  Fd fd;
  sockaddr_storage ss{};
  KVXFER_CHECK(tcp::open_listener(host, 0, kWho, &fd, &ss));

  UniqueId out{};
  out.magic = kBootstrapMagic;
  out.version = kBootstrapVersion;
  out.family = static_cast<uint16_t>(ss.ss_family);
  if (ss.ss_family == AF_INET) {
    auto* s = reinterpret_cast<sockaddr_in*>(&ss);
    out.port = s->sin_port;
    std::memcpy(out.addr, &s->sin_addr, 4);
  } else {
    auto* s = reinterpret_cast<sockaddr_in6*>(&ss);
    out.port = s->sin6_port;
    out.scope_id = s->sin6_scope_id;
    std::memcpy(out.addr, &s->sin6_addr, 16);
  }
  KVXFER_CHECK(tcp::random_bytes(out.secret, sizeof out.secret, kWho));

  std::unique_ptr<BootstrapRoot> r(new BootstrapRoot());
  r->id_ = out;
  r->listen_fd_ = fd.release();
  *id = out;
  *root = std::move(r);
  KVXFER_INFO(LOG_NET, "bootstrap: root listening on %s", unique_id_address(out).c_str());
  return KVXFER_SUCCESS;
}

kvxfer_result_t BootstrapRoot::accept_all(int nranks, int timeout_ms, bool final_round) {
  KVXFER_REQUIRE(nranks > 0 && nranks <= kBootstrapMaxRanks,
                 "bootstrap accept_all: nranks %d out of range [1, %d]", nranks,
                 kBootstrapMaxRanks);
  KVXFER_REQUIRE(timeout_ms > 0, "bootstrap accept_all: timeout_ms must be > 0 (got %d)",
                 timeout_ms);
  if (listen_fd_ < 0)
    return set_error(KVXFER_ERR_INVALID_USAGE,
                     "bootstrap accept_all: the root has no listener (accept_all is one-shot)");
  return serve(nranks, timeout_ms, -1, std::string(), final_round);
}

kvxfer_result_t BootstrapRoot::fail_all(int nranks, int failed_rank, const char* reason,
                                        int timeout_ms) {
  KVXFER_REQUIRE(nranks > 0 && nranks <= kBootstrapMaxRanks,
                 "bootstrap fail_all: nranks %d out of range [1, %d]", nranks, kBootstrapMaxRanks);
  KVXFER_REQUIRE(failed_rank >= 0 && failed_rank < nranks,
                 "bootstrap fail_all: failed_rank %d out of range [0, %d)", failed_rank, nranks);
  KVXFER_REQUIRE(reason != nullptr, "bootstrap fail_all: reason is NULL");
  KVXFER_REQUIRE(timeout_ms > 0, "bootstrap fail_all: timeout_ms must be > 0 (got %d)", timeout_ms);
  if (listen_fd_ < 0)
    return set_error(KVXFER_ERR_INVALID_USAGE,
                     "bootstrap fail_all: the root has no listener (the root is one-shot)");
  return serve(nranks, timeout_ms, failed_rank, reason, false);
}

kvxfer_result_t BootstrapRoot::serve(int nranks, int timeout_ms, int own_failed_rank,
                                     const std::string& own_reason, bool final_round) {
  struct ListenerCloser {
    BootstrapRoot* r;
    ~ListenerCloser() { r->close_listener(); }
  } closer{this};

  const Deadline d = deadline_after(timeout_ms);
  const std::string self = unique_id_address(id_);
  std::vector<std::unique_ptr<Pending>> pending;
  std::vector<Fd> ranks(static_cast<size_t>(nranks));
  std::vector<std::string> peers(static_cast<size_t>(nranks));
  AddressTable blobs(static_cast<size_t>(nranks));
  int accepted = 0;
  std::vector<pollfd> fds;
  std::vector<int> accepted_idx;  // rank for each accepted-rank pollfd

  // Failure mode: once a rank has failed, every rank is answered with
  // failure_frame instead of the table, until all are told or the grace ends.
  std::string failed_reason;
  std::vector<uint8_t> failed_frame;
  Deadline grace_end = d;
  std::vector<bool> told(static_cast<size_t>(nranks), false);
  int ntold = 0;
  auto mark_told = [&](int r) {
    if (!told[r]) {
      told[r] = true;
      ++ntold;
    }
  };
  auto tell = [&](int r, Fd fd) {
    bool closed;
    if (send_all(fd.get(), failed_frame.data(), failed_frame.size(), deadline_after(200),
                 "sending the rank-failed status", &closed) == KVXFER_SUCCESS)
      KVXFER_INFO(LOG_NET, "bootstrap: root %s told rank %d that rank %d failed", self.c_str(), r,
                  failed_rank_);
    mark_told(r);
  };
  auto start_failure = [&](int r, const std::string& reason, Fd reporter) {
    failed_rank_ = r;
    failed_reason = clean_reason(reason);
    failed_frame = failure_frame(nranks, r, failed_reason);
    grace_end = std::min(d, deadline_after(kBootstrapFailGraceMs));
    KVXFER_WARN(LOG_NET, "bootstrap: root %s: rank %d failed (%s); telling every rank",
                self.c_str(), r, failed_reason.c_str());
    mark_told(r);
    if (reporter.valid()) tell(r, std::move(reporter));
    for (int k = 0; k < nranks; ++k)
      if (ranks[k].valid()) tell(k, std::move(ranks[k]));
    accepted = 0;
  };
  if (own_failed_rank >= 0) start_failure(own_failed_rank, own_reason, Fd());

  auto refuse = [&](const std::string& peer, const std::string& why) {
    KVXFER_WARN(LOG_NET, "bootstrap: root %s refused %s: %s", self.c_str(), peer.c_str(),
                why.c_str());
  };

  for (;;) {
    const bool failing = failed_rank_ >= 0;
    if (failing ? ntold == nranks : accepted == nranks) break;
    int left = remaining_ms(failing ? grace_end : d);
    if (left == 0) break;
    fds.clear();
    accepted_idx.clear();
    fds.push_back({listen_fd_, POLLIN, 0});
    for (auto& p : pending) fds.push_back({p->fd.get(), POLLIN, 0});
    for (int r = 0; r < nranks; ++r)
      if (ranks[r].valid()) {
        fds.push_back({ranks[r].get(), POLLIN, 0});
        accepted_idx.push_back(r);
      }
    int pr = ::poll(fds.data(), fds.size(), left);
    if (pr < 0) {
      if (errno == EINTR) continue;
      return sys_error("poll", errno);
    }
    if (pr == 0) continue;

    // An accepted rank that becomes readable has hung up (it sends nothing
    // else): free its slot so a restarted rank can take it.
    const size_t npend = pending.size();
    for (size_t k = 0; k < accepted_idx.size(); ++k) {
      const pollfd& f = fds[1 + npend + k];
      if (f.revents == 0) continue;
      int r = accepted_idx[k];
      if (!ranks[r].valid()) continue;  // told of a failure meanwhile
      KVXFER_WARN(LOG_NET, "bootstrap: root %s: rank %d (%s) hung up before the table; slot freed",
                  self.c_str(), r, peers[r].c_str());
      ranks[r].reset();
      blobs[r].clear();
      --accepted;
    }

    // Pending hellos, back to front so that erasing keeps indices valid.
    for (size_t i = npend; i-- > 0;) {
      if (fds[1 + i].revents == 0) continue;
      Pending* p = pending[i].get();
      std::string why;
      ReadState st = read_hello(p, &why);
      if (st == ReadState::kMore) continue;
      if (st == ReadState::kDrop) {
        refuse(p->peer, why);
        pending.erase(pending.begin() + static_cast<long>(i));
        continue;
      }
      const uint8_t* b = p->body.data();
      uint32_t magic = get_u32(b);
      uint16_t version = get_u16(b + 4);
      uint16_t flags = get_u16(b + 6);
      int32_t rank = static_cast<int32_t>(get_u32(b + 8));
      int32_t their_n = static_cast<int32_t>(get_u32(b + 12));
      const uint8_t* secret = b + 16;
      uint32_t plen = get_u32(b + 16 + kBootstrapSecretBytes);
      const bool failed_hello = (flags & kBootstrapHelloFailed) != 0;
      if (magic != kBootstrapMagic || version != kBootstrapVersion) {
        why = "bad hello (magic/version)";
      } else if ((flags & ~kBootstrapHelloFailed) != 0) {
        why = "bad hello (unknown flags " + std::to_string(flags) + ")";
      } else if (!secret_equal(secret, id_.secret, kBootstrapSecretBytes)) {
        why = "wrong secret";
      } else if (plen != p->len - kHelloFixed) {
        why = "bad hello (payload length)";
      } else if (their_n != nranks) {
        why = "nranks mismatch (hello says " + std::to_string(their_n) + ", root expects " +
              std::to_string(nranks) + ")";
      } else if (rank < 0 || rank >= nranks) {
        why = "rank " + std::to_string(rank) + " out of range";
      } else if (!failed_hello && failed_rank_ < 0 && ranks[rank].valid()) {
        why = "rank " + std::to_string(rank) + " already taken by " + peers[rank];
      }
      if (!why.empty()) {
        refuse(p->peer, why);
        pending.erase(pending.begin() + static_cast<long>(i));
        continue;
      }
      if (failed_hello) {
        const std::string reason = clean_reason(b + kHelloFixed, plen);
        if (failed_rank_ < 0) {
          start_failure(rank, reason, std::move(p->fd));
        } else {
          KVXFER_WARN(LOG_NET, "bootstrap: root %s: rank %d failed too (%s)", self.c_str(), rank,
                      reason.c_str());
          tell(rank, std::move(p->fd));
        }
      } else if (failed_rank_ >= 0) {
        tell(rank, std::move(p->fd));
      } else {
        blobs[rank].assign(b + kHelloFixed, b + p->len);
        peers[rank] = p->peer;
        ranks[rank] = std::move(p->fd);
        ++accepted;
        KVXFER_INFO(LOG_NET, "bootstrap: root %s accepted rank %d/%d from %s (%u-byte payload)",
                    self.c_str(), rank, nranks, peers[rank].c_str(), plen);
      }
      pending.erase(pending.begin() + static_cast<long>(i));
    }

    if (fds[0].revents != 0) {
      for (;;) {
        sockaddr_storage ss{};
        socklen_t sl = sizeof ss;
        int c = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &sl,
                          SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) {
          if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) break;
          return sys_error("accept", errno);
        }
        auto p = std::make_unique<Pending>();
        p->fd = Fd(c);
        p->peer = sockaddr_text(reinterpret_cast<sockaddr*>(&ss), sl);
        set_nodelay(c);
        if (pending.size() >= kMaxPending) {
          refuse(pending.front()->peer,
                 "too many unauthenticated connections; dropping the oldest");
          pending.erase(pending.begin());
        }
        pending.push_back(std::move(p));
      }
    }
  }

  if (failed_rank_ >= 0) {
    std::string untold;
    int shown = 0;
    for (int r = 0; r < nranks; ++r) {
      if (told[r]) continue;
      if (shown < 8) untold += (shown ? ", " : "") + std::to_string(r);
      ++shown;
    }
    if (shown > 8) untold += ", ...";
    if (own_failed_rank >= 0) {
      if (ntold == nranks) return KVXFER_SUCCESS;
      return set_error(KVXFER_ERR_TIMEOUT,
                       "bootstrap: root %s told %d of %d ranks of rank %d's failure (not told: "
                       "%s)",
                       self.c_str(), ntold, nranks, own_failed_rank, untold.c_str());
    }
    return set_error(KVXFER_ERR_SYSTEM,
                     "bootstrap: rank %d failed: %s (root %s told %d of %d ranks%s%s)",
                     failed_rank_, failed_reason.c_str(), self.c_str(), ntold, nranks,
                     ntold < nranks ? "; not told: " : "", untold.c_str());
  }

  if (accepted < nranks) {
    std::string missing;
    int shown = 0;
    for (int r = 0; r < nranks; ++r) {
      if (ranks[r].valid()) continue;
      if (shown < 8) missing += (shown ? ", " : "") + std::to_string(r);
      ++shown;
    }
    if (shown > 8) missing += ", ...";
    // Tell the ranks that did come, best effort, so they fail fast.
    std::vector<uint8_t> f = status_frame(kStatusTimeout, nranks);
    Deadline short_d = deadline_after(200);
    for (auto& fd : ranks) {
      bool closed;
      if (fd.valid())
        (void)send_all(fd.get(), f.data(), f.size(), short_d, "sending abort", &closed);
    }
    return set_error(KVXFER_ERR_TIMEOUT,
                     "bootstrap: root %s timed out after %d ms with %d of %d ranks (missing: %s)",
                     self.c_str(), timeout_ms, accepted, nranks, missing.c_str());
  }

  // Everyone is in: build and send the table.
  size_t total = 4 + kTableFixed;
  for (const auto& b : blobs) total += 4 + b.size();
  const Deadline send_d = std::max(d, deadline_after(1000));
  if (total - 4 > kBootstrapMaxMessage) {
    std::vector<uint8_t> f = status_frame(kStatusTooLarge, nranks);
    for (auto& fd : ranks) {
      bool closed;
      (void)send_all(fd.get(), f.data(), f.size(), send_d, "sending abort", &closed);
    }
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "bootstrap: address table of %zu bytes exceeds the %zu-byte message bound",
                     total - 4, kBootstrapMaxMessage);
  }
  std::vector<uint8_t> table(4, 0);
  table.reserve(total);
  put_u32(&table, kBootstrapMagic);
  put_u16(&table, kBootstrapVersion);
  put_u16(&table, kStatusOk);
  put_u32(&table, static_cast<uint32_t>(nranks));
  for (const auto& b : blobs) {
    put_u32(&table, static_cast<uint32_t>(b.size()));
    table.insert(table.end(), b.begin(), b.end());
  }
  finish_frame(&table);
  kvxfer_result_t result = KVXFER_SUCCESS;
  int unsent = -1;
  for (int r = 0; r < nranks; ++r) {
    bool closed;
    kvxfer_result_t s = send_all(ranks[r].get(), table.data(), table.size(), send_d,
                                 "sending the address table", &closed);
    if (s < 0 && result == KVXFER_SUCCESS) {
      std::string detail = last_error();
      result = set_error(s, "bootstrap: root %s could not send the table to rank %d (%s): %s",
                         self.c_str(), r, peers[r].c_str(), detail.c_str());
      unsent = r;
    }
  }
  if (result == KVXFER_SUCCESS)
    KVXFER_INFO(LOG_NET, "bootstrap: root %s sent the %zu-byte table to %d ranks", self.c_str(),
                table.size(), nranks);
  if (!final_round) return result;
  if (result != KVXFER_SUCCESS) {
    // The others hold the table and wait for the final status: fail them now.
    const std::string why = last_error();
    failed_rank_ = unsent;
    const std::vector<uint8_t> f = failure_frame(nranks, unsent, clean_reason(why));
    for (int r = 0; r < nranks; ++r) {
      bool closed;
      if (r != unsent)
        (void)send_all(ranks[r].get(), f.data(), f.size(), deadline_after(200),
                       "sending the rank-failed status", &closed);
    }
    return set_error(result, "%s", why.c_str());
  }
  close_listener();  // nobody else may join now
  return run_final_round(&ranks, nranks, d, timeout_ms, self, &failed_rank_);
}

// ---------------------------------------------------------------------------
// Rank
// ---------------------------------------------------------------------------
namespace {

kvxfer_result_t connect_impl(const UniqueId& id, int rank, int nranks, int timeout_ms,
                             const void* payload, size_t payload_len, AddressTable* table,
                             Fd* keep) {
  KVXFER_REQUIRE(table != nullptr, "bootstrap_connect: table must not be NULL");
  KVXFER_REQUIRE(nranks > 0 && nranks <= kBootstrapMaxRanks,
                 "bootstrap_connect: nranks %d out of range [1, %d]", nranks, kBootstrapMaxRanks);
  KVXFER_REQUIRE(rank >= 0 && rank < nranks, "bootstrap_connect: rank %d out of range [0, %d)",
                 rank, nranks);
  KVXFER_REQUIRE(timeout_ms > 0, "bootstrap_connect: timeout_ms must be > 0 (got %d)", timeout_ms);
  KVXFER_REQUIRE(payload_len <= kBootstrapMaxPayload,
                 "bootstrap_connect: payload of %zu bytes exceeds %zu", payload_len,
                 kBootstrapMaxPayload);
  KVXFER_REQUIRE(payload != nullptr || payload_len == 0, "bootstrap_connect: payload is NULL");
  sockaddr_storage sa;
  socklen_t sl = 0;
  KVXFER_REQUIRE(id_sockaddr(id, &sa, &sl), "bootstrap_connect: not a valid unique id");
  const std::string root = unique_id_address(id);
  const Deadline d = deadline_after(timeout_ms);

  Fd fd;
  kvxfer_result_t cr = connect_root(sa, sl, d, rank, root, timeout_ms, &fd);
  if (cr < 0) return cr;
  const std::vector<uint8_t> hello =
      hello_frame(id, 0, rank, nranks, static_cast<const uint8_t*>(payload), payload_len);

  bool closed = false;
  kvxfer_result_t r =
      send_all(fd.get(), hello.data(), hello.size(), d, "sending the hello", &closed);
  if (r < 0) return closed ? refused_error(root) : r;

  uint8_t hdr[4];
  r = recv_all(fd.get(), hdr, 4, d, "waiting for the address table", &closed);
  if (r == KVXFER_ERR_TIMEOUT)
    return set_error(KVXFER_ERR_TIMEOUT,
                     "bootstrap: rank %d timed out after %d ms waiting for the address table from "
                     "%s (other ranks missing?)",
                     rank, timeout_ms, root.c_str());
  if (r < 0) return closed ? refused_error(root) : r;
  uint32_t len = get_u32(hdr);
  if (len < kTableFixed || len > kBootstrapMaxMessage)
    return set_error(KVXFER_ERR_CORRUPT,
                     "bootstrap: table message of %u bytes from %s is out of bounds", len,
                     root.c_str());
  std::vector<uint8_t> body(len);
  r = recv_all(fd.get(), body.data(), len, d, "receiving the address table", &closed);
  if (r < 0)
    return closed
               ? set_error(KVXFER_ERR_SYSTEM, "bootstrap: root %s closed mid-table", root.c_str())
               : r;

  const uint8_t* b = body.data();
  if (get_u32(b) != kBootstrapMagic || get_u16(b + 4) != kBootstrapVersion)
    return set_error(KVXFER_ERR_CORRUPT, "bootstrap: table from %s has a bad magic/version",
                     root.c_str());
  uint16_t status = get_u16(b + 6);
  if (status == kStatusTimeout)
    return set_error(KVXFER_ERR_TIMEOUT,
                     "bootstrap: root %s timed out waiting for the other ranks (rank %d of %d)",
                     root.c_str(), rank, nranks);
  if (status == kStatusRankFailed) return rank_failed_error(b, len, nranks, rank, root);
  if (status == kStatusTooLarge)
    return set_error(KVXFER_ERR_UNSUPPORTED,
                     "bootstrap: root %s says the address table exceeds %zu bytes", root.c_str(),
                     kBootstrapMaxMessage);
  if (status != kStatusOk)
    return set_error(KVXFER_ERR_CORRUPT, "bootstrap: table from %s has unknown status %u",
                     root.c_str(), status);
  if (get_u32(b + 8) != static_cast<uint32_t>(nranks))
    return set_error(KVXFER_ERR_CORRUPT, "bootstrap: table from %s has %u ranks, expected %d",
                     root.c_str(), get_u32(b + 8), nranks);
  AddressTable out(static_cast<size_t>(nranks));
  size_t off = kTableFixed;
  for (int i = 0; i < nranks; ++i) {
    if (len - off < 4)
      return set_error(KVXFER_ERR_CORRUPT, "bootstrap: table from %s truncated at rank %d",
                       root.c_str(), i);
    uint32_t el = get_u32(b + off);
    off += 4;
    if (el > kBootstrapMaxPayload || len - off < el)
      return set_error(KVXFER_ERR_CORRUPT,
                       "bootstrap: table from %s: bad entry length %u for rank %d", root.c_str(),
                       el, i);
    out[i].assign(b + off, b + off + el);
    off += el;
  }
  if (off != len)
    return set_error(KVXFER_ERR_CORRUPT, "bootstrap: table from %s has %zu trailing bytes",
                     root.c_str(), len - off);
  if (out[rank].size() != payload_len ||
      (payload_len > 0 && std::memcmp(out[rank].data(), payload, payload_len) != 0))
    return set_error(KVXFER_ERR_CORRUPT,
                     "bootstrap: table from %s does not hold rank %d's own payload", root.c_str(),
                     rank);
  *table = std::move(out);
  KVXFER_INFO(LOG_NET, "bootstrap: rank %d/%d received the address table from %s", rank, nranks,
              root.c_str());
  if (keep != nullptr) *keep = std::move(fd);
  return KVXFER_SUCCESS;
}

}  // namespace

kvxfer_result_t bootstrap_connect(const UniqueId& id, int rank, int nranks, int timeout_ms,
                                  const void* payload, size_t payload_len, AddressTable* table) {
  return connect_impl(id, rank, nranks, timeout_ms, payload, payload_len, table, nullptr);
}

kvxfer_result_t bootstrap_connect(const UniqueId& id, int rank, int nranks, int timeout_ms,
                                  const void* payload, size_t payload_len, AddressTable* table,
                                  std::unique_ptr<BootstrapSession>* session) {
  KVXFER_REQUIRE(session != nullptr, "bootstrap_connect: session must not be NULL");
  session->reset();
  Fd fd;
  KVXFER_CHECK(connect_impl(id, rank, nranks, timeout_ms, payload, payload_len, table, &fd));
  session->reset(new BootstrapSession(fd.release(), rank, nranks, unique_id_address(id)));
  return KVXFER_SUCCESS;
}

BootstrapSession::BootstrapSession(int fd, int rank, int nranks, std::string root)
    : fd_(fd), rank_(rank), nranks_(nranks), root_(std::move(root)) {}

BootstrapSession::~BootstrapSession() {
  if (fd_ >= 0) ::close(fd_);
}

kvxfer_result_t BootstrapSession::report(const char* failure_reason) {
  const std::string why =
      failure_reason != nullptr ? clean_reason(std::string(failure_reason)) : "";
  const std::vector<uint8_t> f =
      rank_frame(failure_reason != nullptr ? kStatusRankFailed : kStatusReady, nranks_, rank_, why);
  bool closed = false;
  const kvxfer_result_t r = send_all(fd_, f.data(), f.size(), deadline_after(kBootstrapFailGraceMs),
                                     "sending the final status", &closed);
  if (r < 0 && closed)
    return set_error(KVXFER_ERR_SYSTEM,
                     "bootstrap: the root %s closed the connection before rank %d's final status",
                     root_.c_str(), rank_);
  return r;
}

kvxfer_result_t BootstrapSession::poll(bool* all_ready) {
  *all_ready = false;
  for (;;) {
    const size_t want = buf_.size() < 4 ? 4 : 4 + size_t{get_u32(buf_.data())};
    if (buf_.size() >= 4 && buf_.size() == want) break;
    uint8_t tmp[64];
    const ssize_t n = ::recv(fd_, tmp, std::min(sizeof tmp, want - buf_.size()), MSG_DONTWAIT);
    if (n == 0)
      return set_error(KVXFER_ERR_SYSTEM,
                       "bootstrap: the root %s closed the connection before every rank was ready "
                       "(rank 0 gone?)",
                       root_.c_str());
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return KVXFER_SUCCESS;
      return sys_error("waiting for the final status", errno);
    }
    buf_.insert(buf_.end(), tmp, tmp + n);
    if (buf_.size() == 4) {
      const uint32_t len = get_u32(buf_.data());
      if (len < kTableFixed || len > kFinalMax)
        return set_error(KVXFER_ERR_CORRUPT,
                         "bootstrap: final status of %u bytes from %s is out of bounds", len,
                         root_.c_str());
    }
  }
  const uint8_t* b = buf_.data() + 4;
  const size_t len = buf_.size() - 4;
  if (get_u32(b) != kBootstrapMagic || get_u16(b + 4) != kBootstrapVersion ||
      get_u32(b + 8) != static_cast<uint32_t>(nranks_))
    return set_error(KVXFER_ERR_CORRUPT, "bootstrap: final status from %s has a bad header",
                     root_.c_str());
  const uint16_t status = get_u16(b + 6);
  if (status == kStatusReady && len == kTableFixed) {
    *all_ready = true;
    return KVXFER_SUCCESS;
  }
  if (status == kStatusRankFailed) return rank_failed_error(b, len, nranks_, rank_, root_);
  if (status == kStatusTimeout && len == kTableFixed)
    return set_error(KVXFER_ERR_TIMEOUT,
                     "bootstrap: the root %s timed out waiting for every rank to be ready (rank "
                     "%d of %d)",
                     root_.c_str(), rank_, nranks_);
  return set_error(KVXFER_ERR_CORRUPT, "bootstrap: final status from %s has unknown status %u",
                   root_.c_str(), status);
}

kvxfer_result_t bootstrap_report_failure(const UniqueId& id, int rank, int nranks, int timeout_ms,
                                         const char* reason) {
  KVXFER_REQUIRE(reason != nullptr, "bootstrap_report_failure: reason is NULL");
  KVXFER_REQUIRE(nranks > 0 && nranks <= kBootstrapMaxRanks,
                 "bootstrap_report_failure: nranks %d out of range [1, %d]", nranks,
                 kBootstrapMaxRanks);
  KVXFER_REQUIRE(rank >= 0 && rank < nranks,
                 "bootstrap_report_failure: rank %d out of range [0, %d)", rank, nranks);
  KVXFER_REQUIRE(timeout_ms > 0, "bootstrap_report_failure: timeout_ms must be > 0 (got %d)",
                 timeout_ms);
  sockaddr_storage sa;
  socklen_t sl = 0;
  KVXFER_REQUIRE(id_sockaddr(id, &sa, &sl), "bootstrap_report_failure: not a valid unique id");
  const std::string root = unique_id_address(id);
  const int budget = std::min(timeout_ms, kBootstrapFailGraceMs);
  const Deadline d = deadline_after(budget);

  Fd fd;
  kvxfer_result_t cr = connect_root(sa, sl, d, rank, root, budget, &fd);
  if (cr < 0) return cr;
  const std::string text = clean_reason(std::string(reason));
  const std::vector<uint8_t> hello =
      hello_frame(id, kBootstrapHelloFailed, rank, nranks,
                  reinterpret_cast<const uint8_t*>(text.data()), text.size());
  bool closed = false;
  kvxfer_result_t r =
      send_all(fd.get(), hello.data(), hello.size(), d, "sending the failure report", &closed);
  if (r < 0) return closed ? refused_error(root) : r;

  // The root answers with the rank-failed status (ours, or an earlier
  // rank's).  If it is not serving yet, the report waits in its backlog.
  uint8_t hdr[4];
  r = recv_all(fd.get(), hdr, 4, d, "waiting for the root's answer", &closed);
  if (r == KVXFER_ERR_TIMEOUT)
    return set_error(KVXFER_ERR_TIMEOUT,
                     "bootstrap: rank %d sent its failure report to %s, no answer within %d ms "
                     "(the root reads it when it starts serving)",
                     rank, root.c_str(), budget);
  if (r < 0) return closed ? refused_error(root) : r;
  const uint32_t len = get_u32(hdr);
  if (len < kTableFixed || len > kBootstrapMaxMessage)
    return set_error(KVXFER_ERR_CORRUPT, "bootstrap: answer of %u bytes from %s is out of bounds",
                     len, root.c_str());
  std::vector<uint8_t> body(len);
  r = recv_all(fd.get(), body.data(), len, d, "receiving the root's answer", &closed);
  if (r < 0) return r;
  if (get_u32(body.data()) != kBootstrapMagic || get_u16(body.data() + 4) != kBootstrapVersion ||
      get_u16(body.data() + 6) != kStatusRankFailed)
    return set_error(KVXFER_ERR_CORRUPT,
                     "bootstrap: the root %s answered a failure report with something else than "
                     "the rank-failed status",
                     root.c_str());
  r = rank_failed_error(body.data(), len, nranks, rank, root);
  if (r == KVXFER_ERR_CORRUPT) return r;
  KVXFER_INFO(LOG_NET, "bootstrap: rank %d/%d: the root %s acknowledged the failure report (%s)",
              rank, nranks, root.c_str(), last_error());
  return KVXFER_SUCCESS;
}

std::string unique_id_address(const UniqueId& id) {
  sockaddr_storage sa;
  socklen_t sl = 0;
  if (!id_sockaddr(id, &sa, &sl)) return "<invalid id>";
  return sockaddr_text(reinterpret_cast<sockaddr*>(&sa), sl);
}

}  // namespace kvxfer::transport
