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
#include "transport/bootstrap_wire.h"
#include "transport/tcp_io.h"

namespace kvxfer::transport {
namespace {

using namespace bootstrap_wire;  // NOLINT: the bootstrap's own frames

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

  // Refusals of connections that did not present the secret are throttled
  // (anyone can make them at will); a rank with the secret that is refused
  // (nranks, rank taken) is a misconfigured job, always logged.
  LogThrottle refuse_log;
  auto refuse = [&](const std::string& peer, const std::string& why, bool authenticated = false) {
    uint64_t n = 1;
    if (authenticated || refuse_log.tick(&n))
      KVXFER_WARN(LOG_NET, "bootstrap: root %s refused %s: %s%s", self.c_str(), peer.c_str(),
                  why.c_str(), LogThrottle::note(n).c_str());
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
      const bool authenticated = magic == kBootstrapMagic && version == kBootstrapVersion &&
                                 (flags & ~kBootstrapHelloFailed) == 0 &&
                                 secret_equal(secret, id_.secret, kBootstrapSecretBytes);
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
      // A rank with the secret that was started with another nranks: the
      // job is misconfigured, and no rank can complete.  When its rank is one
      // of the root's, every rank is failed at once, it too, with both
      // counts (as a failure report would); otherwise it is refused.
      if (their_n != nranks && why.rfind("nranks mismatch", 0) == 0 && rank >= 0 && rank < nranks &&
          failed_rank_ < 0) {
        refuse(p->peer, why, authenticated);
        start_failure(rank,
                      "it was started with nranks " + std::to_string(their_n) + ", the root with " +
                          std::to_string(nranks),
                      std::move(p->fd));
        pending.erase(pending.begin() + static_cast<long>(i));
        continue;
      }
      if (!why.empty()) {
        refuse(p->peer, why, authenticated);
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
      // A bounded batch a round: the hellos of the connections already held
      // are read between batches, so that a flood of silent connections
      // (which evicts the oldest, below) cannot push out a rank that has
      // sent its hello before it is read.
      for (int batch = 0; batch < kAcceptBatch; ++batch) {
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

}  // namespace kvxfer::transport
