// An endpoint's membership: blob, listener, connect and disconnect (endpoint.h).
#include "xfer/endpoint.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstring>
#include <thread>
#include <utility>

#include "common/error.h"
#include "common/log.h"
#include "transport/ofi.h"
#include "transport/tcp_io.h"

namespace kvxfer::xfer {
namespace {

using transport::Link;
namespace tcp = transport::tcp;

constexpr const char* kWho = "endpoint";
constexpr uint16_t kKindConnect = 1;
constexpr uint16_t kKindBye = 2;
constexpr uint32_t kFlagForce = 1;
constexpr size_t kRequestFixed = 4 + 2 + 2 + 4 + kEndpointSecretBytes + 8 + 8;  // 60
constexpr size_t kReplyFixed = 4 + 2 + 2 + 8;                                   // 16

bool to_sockaddr(const EndpointAddress& a, sockaddr_storage* sa, socklen_t* len) {
  std::memset(sa, 0, sizeof *sa);
  if (a.family == AF_INET) {
    auto* s = reinterpret_cast<sockaddr_in*>(sa);
    s->sin_family = AF_INET;
    s->sin_port = a.port_be;
    std::memcpy(&s->sin_addr, a.addr.data(), 4);
    *len = sizeof(sockaddr_in);
    return true;
  }
  if (a.family == AF_INET6) {
    auto* s = reinterpret_cast<sockaddr_in6*>(sa);
    s->sin6_family = AF_INET6;
    s->sin6_port = a.port_be;
    std::memcpy(&s->sin6_addr, a.addr.data(), 16);
    s->sin6_scope_id = a.scope_id;
    *len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

/** Reads one length-prefixed frame (the bytes after the prefix). */
kvxfer_result_t read_frame(int fd, tcp::Deadline d, const char* what, std::vector<uint8_t>* out) {
  uint8_t pre[4];
  bool closed = false;
  KVXFER_CHECK(tcp::recv_all(fd, pre, 4, d, kWho, what, &closed));
  const uint32_t n = tcp::get_u32(pre);
  if (n > kHandshakeMaxBytes)
    return set_error(KVXFER_ERR_CORRUPT, "%s: %s: a frame of %u bytes (at most %zu)", kWho, what, n,
                     kHandshakeMaxBytes);
  out->resize(n);
  return tcp::recv_all(fd, out->data(), n, d, kWho, what, &closed);
}

void put_bytes(std::vector<uint8_t>* b, const std::vector<uint8_t>& v) {
  tcp::put_u32(b, static_cast<uint32_t>(v.size()));
  b->insert(b->end(), v.begin(), v.end());
}

/** Reads a u32-prefixed byte string at *pos; false when truncated. */
bool get_bytes(const std::vector<uint8_t>& b, size_t* pos, std::vector<uint8_t>* out) {
  if (b.size() - *pos < 4) return false;
  const uint32_t n = tcp::get_u32(b.data() + *pos);
  *pos += 4;
  if (b.size() - *pos < n) return false;
  out->assign(b.begin() + static_cast<std::ptrdiff_t>(*pos),
              b.begin() + static_cast<std::ptrdiff_t>(*pos + n));
  *pos += n;
  return true;
}

std::vector<uint8_t> reply_frame(HandshakeStatus st, uint64_t incarnation,
                                 const std::vector<uint8_t>& link, const std::string& reason) {
  std::vector<uint8_t> b(4);
  tcp::put_u32(&b, kHandshakeMagic);
  tcp::put_u16(&b, kHandshakeVersion);
  tcp::put_u16(&b, static_cast<uint16_t>(st));
  tcp::put_u64(&b, incarnation);
  put_bytes(&b, link);
  put_bytes(&b, std::vector<uint8_t>(reason.begin(), reason.end()));
  tcp::finish_frame(&b);
  return b;
}

const char* status_name(HandshakeStatus s) {
  switch (s) {
    case HandshakeStatus::kOk: return "OK";
    case HandshakeStatus::kRefused: return "REFUSED";
    case HandshakeStatus::kStale: return "STALE";
    case HandshakeStatus::kCrossed: return "CROSSED";
    case HandshakeStatus::kCrossedLive: return "CROSSED_LIVE";
    case HandshakeStatus::kError: return "ERROR";
    case HandshakeStatus::kBad: return "BAD";
  }
  return "?";
}

}  // namespace

// ---------------------------------------------------------------------------
// Address blob
// ---------------------------------------------------------------------------
std::string EndpointAddress::text() const {
  sockaddr_storage sa;
  socklen_t len = 0;
  if (!to_sockaddr(*this, &sa, &len)) return "<bad address>";
  return tcp::sockaddr_text(reinterpret_cast<const sockaddr*>(&sa), len);
}

bool EndpointAddress::same_place(const EndpointAddress& o) const {
  return family == o.family && port_be == o.port_be && addr == o.addr;
}

uint64_t host_hash() {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char c : transport::host_identity()) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

std::vector<uint8_t> encode_endpoint_address(const EndpointAddress& a) {
  std::vector<uint8_t> b;
  tcp::put_u32(&b, kEndpointBlobMagic);
  tcp::put_u16(&b, kEndpointBlobVersion);
  tcp::put_u16(&b, a.has_secret ? 1 : 0);
  tcp::put_u64(&b, a.incarnation);
  tcp::put_u16(&b, a.family);
  b.push_back(static_cast<uint8_t>(a.port_be & 0xff));  // network order, as stored
  b.push_back(static_cast<uint8_t>(a.port_be >> 8));
  tcp::put_u32(&b, a.scope_id);
  b.insert(b.end(), a.addr.begin(), a.addr.end());
  tcp::put_u64(&b, a.host);
  tcp::put_u32(&b, a.pid);
  tcp::put_u32(&b, 0);
  if (a.has_secret) b.insert(b.end(), a.secret.begin(), a.secret.end());
  return b;
}

kvxfer_result_t decode_endpoint_address(const void* blob, size_t len, EndpointAddress* out) {
  KVXFER_REQUIRE(blob != nullptr, "endpoint address is NULL");
  const auto* p = static_cast<const uint8_t*>(blob);
  KVXFER_REQUIRE(len >= 8, "endpoint address of %zu bytes is truncated (at least %zu)", len,
                 kEndpointBlobBytes);
  const uint32_t magic = tcp::get_u32(p);
  const uint16_t version = tcp::get_u16(p + 4), flags = tcp::get_u16(p + 6);
  KVXFER_REQUIRE(magic == kEndpointBlobMagic,
                 "not an endpoint address (magic 0x%08x): pass the bytes kvxfer_endpoint_address "
                 "gave, unchanged",
                 magic);
  KVXFER_REQUIRE(version == kEndpointBlobVersion,
                 "endpoint address of version %u; this library reads version %u", version,
                 kEndpointBlobVersion);
  KVXFER_REQUIRE((flags & ~1u) == 0, "endpoint address with unknown flags 0x%04x", flags);
  const size_t want = kEndpointBlobBytes + ((flags & 1u) != 0 ? kEndpointSecretBytes : 0);
  KVXFER_REQUIRE(len == want,
                 "endpoint address of %zu bytes; its header says %zu (truncated or "
                 "padded)",
                 len, want);
  EndpointAddress a;
  a.incarnation = tcp::get_u64(p + 8);
  a.family = tcp::get_u16(p + 16);
  a.port_be = static_cast<uint16_t>(p[18] | (p[19] << 8));
  a.scope_id = tcp::get_u32(p + 20);
  std::memcpy(a.addr.data(), p + 24, 16);
  a.host = tcp::get_u64(p + 40);
  a.pid = tcp::get_u32(p + 48);
  a.has_secret = (flags & 1u) != 0;
  if (a.has_secret) std::memcpy(a.secret.data(), p + kEndpointBlobBytes, kEndpointSecretBytes);
  KVXFER_REQUIRE(a.family == AF_INET || a.family == AF_INET6,
                 "endpoint address of family %u (not IPv4 or IPv6)", a.family);
  KVXFER_REQUIRE(a.port_be != 0 && a.incarnation != 0,
                 "endpoint address with port 0 or incarnation 0");
  *out = a;
  return KVXFER_SUCCESS;
}

// ---------------------------------------------------------------------------
// Lifetime
// ---------------------------------------------------------------------------
kvxfer_result_t Membership::create(Engine* engine, const Config& cfg,
                                   std::unique_ptr<Membership>* out) {
  std::unique_ptr<Membership> m(new Membership());
  m->engine_ = engine;
  m->cfg_ = cfg;
  tcp::Fd fd;
  sockaddr_storage ss{};
  KVXFER_CHECK(tcp::open_listener(cfg.host.c_str(), cfg.port, kWho, &fd, &ss));
  EndpointAddress& a = m->self_;
  a.family = static_cast<uint16_t>(ss.ss_family);
  if (ss.ss_family == AF_INET) {
    const auto* s = reinterpret_cast<const sockaddr_in*>(&ss);
    a.port_be = s->sin_port;
    std::memcpy(a.addr.data(), &s->sin_addr, 4);
  } else {
    const auto* s = reinterpret_cast<const sockaddr_in6*>(&ss);
    a.port_be = s->sin6_port;
    a.scope_id = s->sin6_scope_id;
    std::memcpy(a.addr.data(), &s->sin6_addr, 16);
  }
  a.host = host_hash();
  a.pid = static_cast<uint32_t>(getpid());
  while (a.incarnation == 0)
    KVXFER_CHECK(tcp::random_bytes(reinterpret_cast<uint8_t*>(&a.incarnation), 8, kWho));
  if (cfg.has_secret) {
    a.has_secret = false;  // shared out of band; not in the blob
  } else {
    a.has_secret = true;
    KVXFER_CHECK(tcp::random_bytes(a.secret.data(), a.secret.size(), kWho));
    m->cfg_.secret = a.secret;
  }
  m->blob_ = encode_endpoint_address(a);
  m->stop_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (m->stop_fd_ < 0) return tcp::sys_error(kWho, "eventfd", errno);
  m->listen_fd_ = fd.release();
  Membership* raw = m.get();
  engine->set_peer_failed(
      [raw](int peer, const std::string& why) { raw->on_link_failed(peer, why); });
  m->acceptor_ = std::thread([raw] { raw->accept_main(); });
  m->spare_maker_ = std::thread([raw] { raw->spare_main(); });
  KVXFER_INFO(LOG_INIT, "endpoint %016" PRIx64 " listening on %s", a.incarnation, a.text().c_str());
  *out = std::move(m);
  return KVXFER_SUCCESS;
}

Membership::~Membership() {
  stop();
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

void Membership::stop() {
  std::vector<EndpointAddress> live;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) return;
    stopped_ = true;
    for (auto& [inc, e] : entries_)
      if (e.state == State::kLive) live.push_back(e.addr);
    cv_.notify_all();
  }
  const uint64_t one = 1;
  (void)!::write(stop_fd_, &one, sizeof one);
  if (acceptor_.joinable()) acceptor_.join();
  stop_spares();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  const tcp::Deadline d = tcp::deadline_after(std::min(cfg_.timeout_ms, kByeMs));
  for (const EndpointAddress& a : live) {
    const int left = tcp::remaining_ms(d);
    if (left <= 0) break;
    tell_bye(a, left);
  }
}

transport::LinkConfig Membership::link_config(const EndpointAddress& peer) const {
  transport::LinkConfig lc = engine_->link_config();
  lc.shm_in_process = false;  // peers in this process close while we run (ofi.h)
  if (lc.provider.empty()) {
    if (peer.host == self_.host && peer.pid != self_.pid)
      lc.provider = transport::kShmProvider;
    else
      lc.offer_shm = false;
  }
  return lc;
}

int Membership::spare_slot(const transport::LinkConfig& lc) const {
  return lc.provider == transport::kShmProvider ? 0 : 1;
}

kvxfer_result_t Membership::new_link(const EndpointAddress& peer,
                                     std::unique_ptr<transport::Link>* out) {
  const transport::LinkConfig lc = link_config(peer);
  Spare& s = spares_[spare_slot(lc)];
  {
    std::unique_lock<std::mutex> lk(spare_mu_);
    if (!spares_stopped_) {
      if (!s.wanted) s.cfg = lc;
      s.wanted = true;
      last_take_ = std::chrono::steady_clock::now();
      spare_cv_.notify_all();
    }
    // A spare being made is ready sooner than a Link made now, which would
    // wait for it anyway (one Link made at a time).
    spare_cv_.wait(lk, [&] { return !s.making || spares_stopped_; });
    if (s.link) {
      *out = std::move(s.link);
      if (cfg_.hooks) ++cfg_.hooks->spare_links_taken;
      return KVXFER_SUCCESS;
    }
  }
  return Link::create(lc, out);
}

void Membership::spare_main() {
  std::unique_lock<std::mutex> lk(spare_mu_);
  for (;;) {
    Spare* empty = nullptr;
    spare_cv_.wait(lk, [&] {
      if (spares_stopped_) return true;
      for (Spare& s : spares_)
        if (s.wanted && !s.link) empty = &s;
      return empty != nullptr;
    });
    if (spares_stopped_) return;
    // Connects come in bursts, and the transfers after them want the CPU: a
    // spare is made once kSpareQuietMs have passed without a connect.
    const auto until = last_take_ + std::chrono::milliseconds(kSpareQuietMs);
    if (std::chrono::steady_clock::now() < until) {
      spare_cv_.wait_until(lk, until, [&] { return spares_stopped_; });
      continue;
    }
    const transport::LinkConfig cfg = empty->cfg;
    empty->making = true;
    lk.unlock();
    std::unique_ptr<Link> l;
    const kvxfer_result_t r = Link::create(cfg, &l);
    const std::string why = r != KVXFER_SUCCESS ? last_error() : "";
    lk.lock();
    empty->making = false;
    spare_cv_.notify_all();
    if (r != KVXFER_SUCCESS) {
      // Connects make their own Link again until one asks anew.
      KVXFER_INFO(LOG_NET, "endpoint: no spare link on %s: %s", cfg.provider.c_str(), why.c_str());
      empty->wanted = false;
    } else if (!spares_stopped_ && !empty->link) {
      empty->link = std::move(l);
      if (cfg_.hooks) ++cfg_.hooks->spare_links_made;
    }
    if (l) {  // not kept: closed outside the lock
      lk.unlock();
      l.reset();
      lk.lock();
    }
  }
}

void Membership::stop_spares() {
  std::array<std::unique_ptr<Link>, kSpareSlots> drop;
  {
    std::lock_guard<std::mutex> lk(spare_mu_);
    spares_stopped_ = true;
    for (int i = 0; i < kSpareSlots; ++i) drop[i] = std::move(spares_[i].link);
    spare_cv_.notify_all();
  }
  if (spare_maker_.joinable()) spare_maker_.join();
}

const uint8_t* Membership::secret_for(const EndpointAddress& to) const {
  return to.has_secret ? to.secret.data() : cfg_.secret.data();
}

// ---------------------------------------------------------------------------
// Outgoing
// ---------------------------------------------------------------------------
kvxfer_result_t Membership::exchange(const EndpointAddress& to, bool bye, bool force,
                                     const std::vector<uint8_t>& link_addr, int budget_ms,
                                     Reply* reply) {
  const tcp::Deadline d = tcp::deadline_after(budget_ms);
  sockaddr_storage sa;
  socklen_t sl = 0;
  KVXFER_REQUIRE(to_sockaddr(to, &sa, &sl), "endpoint address of family %u", to.family);
  const std::string where = "the endpoint at " + to.text();
  tcp::Fd fd;
  bool retry = false;
  KVXFER_CHECK(tcp::connect_once(sa, sl, d, &fd, &retry, kWho, where.c_str()));
  tcp::set_nodelay(fd.get());
  std::vector<uint8_t> b(4);
  tcp::put_u32(&b, kHandshakeMagic);
  tcp::put_u16(&b, kHandshakeVersion);
  tcp::put_u16(&b, bye ? kKindBye : kKindConnect);
  tcp::put_u32(&b, force ? kFlagForce : 0);
  const uint8_t* secret = secret_for(to);
  b.insert(b.end(), secret, secret + kEndpointSecretBytes);
  tcp::put_u64(&b, self_.incarnation);
  tcp::put_u64(&b, to.incarnation);
  put_bytes(&b, blob_);
  put_bytes(&b, link_addr);
  tcp::finish_frame(&b);
  bool closed = false;
  const std::string sending = "sending the handshake to " + where;
  KVXFER_CHECK(tcp::send_all(fd.get(), b.data(), b.size(), d, kWho, sending.c_str(), &closed));
  std::vector<uint8_t> f;
  const std::string reading = "reading the answer of " + where;
  KVXFER_CHECK(read_frame(fd.get(), d, reading.c_str(), &f));
  size_t pos = kReplyFixed;
  std::vector<uint8_t> reason;
  if (f.size() < kReplyFixed || tcp::get_u32(f.data()) != kHandshakeMagic ||
      tcp::get_u16(f.data() + 4) != kHandshakeVersion || !get_bytes(f, &pos, &reply->link) ||
      !get_bytes(f, &pos, &reason) || pos != f.size())
    return set_error(KVXFER_ERR_CORRUPT, "%s: %s answered with a malformed frame (%zu bytes)", kWho,
                     where.c_str(), f.size());
  const uint16_t status = tcp::get_u16(f.data() + 6);
  if (status > static_cast<uint16_t>(HandshakeStatus::kBad))
    return set_error(KVXFER_ERR_CORRUPT, "%s: %s answered with status %u, which no endpoint sends",
                     kWho, where.c_str(), static_cast<unsigned>(status));
  reply->status = static_cast<HandshakeStatus>(status);
  if (reply->status == HandshakeStatus::kOk && !bye && reply->link.empty())
    return set_error(KVXFER_ERR_CORRUPT, "%s: %s answered OK without a link address", kWho,
                     where.c_str());
  reply->incarnation = tcp::get_u64(f.data() + 8);
  reply->reason.assign(reason.begin(), reason.end());
  return KVXFER_SUCCESS;
}

kvxfer_result_t Membership::dial(const EndpointAddress& to, bool force, Reply* reply,
                                 std::unique_ptr<Link>* link) {
  std::unique_ptr<Link> l;
  KVXFER_CHECK(new_link(to, &l));
  // Not kept for another peer on failure: this peer has its address.
  KVXFER_CHECK(exchange(to, false, force, l->local_address(), cfg_.timeout_ms, reply));
  if (reply->status != HandshakeStatus::kOk) return KVXFER_SUCCESS;
  KVXFER_CHECK(l->connect(reply->link.data(), reply->link.size()));
  *link = std::move(l);
  return KVXFER_SUCCESS;
}

kvxfer_result_t Membership::connect(const void* blob, size_t len, int* peer) {
  KVXFER_REQUIRE(peer != nullptr, "peer is NULL");
  *peer = -1;
  EndpointAddress to;
  KVXFER_CHECK(decode_endpoint_address(blob, len, &to));
  KVXFER_REQUIRE(to.incarnation != self_.incarnation,
                 "the address is this endpoint's own: connect to another endpoint");
  if (engine_->aborted())
    return set_error(KVXFER_ERR_INVALID_USAGE,
                     "the endpoint was aborted (kvxfer_comm_abort): it takes no new peer");
  const tcp::Deadline deadline = tcp::deadline_after(cfg_.timeout_ms);
  // A round ends with a peer, an error, or (when a disconnect or another
  // thread's handshake ended the connection this one waited for) another
  // round, within the same deadline: both endpoints are alive, so the caller
  // wants the connection, however often a racing disconnect on either side
  // ends it.  Rounds after the second wait 1, 2, 4 .. 32 ms first.
  for (int round = 0;; ++round) {
    bool again = false;
    const kvxfer_result_t r = connect_round(to, blob, len, deadline, peer, &again);
    if (!again) return r;
    if (tcp::remaining_ms(deadline) == 0)
      return set_error(KVXFER_ERR_TIMEOUT,
                       "connecting to %s: the connection was ended by another call (a "
                       "disconnect) %d times while it was made, until the timeout (%d ms)",
                       to.text().c_str(), round + 1, cfg_.timeout_ms);
    if (round >= 1)
      std::this_thread::sleep_for(std::chrono::milliseconds(1 << std::min(round - 1, 5)));
  }
}

kvxfer_result_t Membership::connect_round(const EndpointAddress& to, const void* blob, size_t len,
                                          tcp::Deadline deadline, int* peer, bool* again) {
  std::unique_lock<std::mutex> lk(mu_);
  // Wait out another thread's or the listener's handshake with this peer.
  auto settled = [&] {
    auto it = entries_.find(to.incarnation);
    return stopped_ || it == entries_.end() ||
           (it->second.state != State::kOutgoing && it->second.state != State::kIncoming);
  };
  if (!cv_.wait_until(lk, deadline, settled))
    return set_error(KVXFER_ERR_TIMEOUT,
                     "connecting to %s: another handshake with it did not end within %d ms",
                     to.text().c_str(), cfg_.timeout_ms);
  if (stopped_) return set_error(KVXFER_ERR_INVALID_USAGE, "the endpoint is being destroyed");
  {
    auto it = entries_.find(to.incarnation);
    if (it != entries_.end() && it->second.state == State::kLive) {
      *peer = it->second.peer;
      return KVXFER_SUCCESS;
    }
  }
  Entry& fresh = entries_[to.incarnation];
  fresh = Entry{};
  fresh.addr = to;
  fresh.blob.assign(static_cast<const uint8_t*>(blob), static_cast<const uint8_t*>(blob) + len);
  fresh.state = State::kOutgoing;
  bool force = false;
  for (int attempt = 0;; ++attempt) {
    lk.unlock();
    Reply reply;
    std::unique_ptr<Link> link;
    const kvxfer_result_t r = dial(to, force, &reply, &link);
    const std::string err = r != KVXFER_SUCCESS ? last_error() : "";
    lk.lock();
    Entry& e = entries_[to.incarnation];  // entries_ may have rehashed
    auto give_up = [&](kvxfer_result_t code, std::string why) {
      if (e.state == State::kOutgoing) {
        e.state = State::kGone;
        e.why = why;
      }
      cv_.notify_all();
      return set_error(code, "%s", why.c_str());
    };
    if (r != KVXFER_SUCCESS)
      return give_up(r, strprintf("connecting to %s: %s", to.text().c_str(), err.c_str()));
    if (stopped_) return give_up(KVXFER_ERR_INVALID_USAGE, "the endpoint is being destroyed");
    switch (reply.status) {
      case HandshakeStatus::kOk:
        if (e.state == State::kOutgoing) {
          *peer = go_live(to.incarnation, e, std::move(link), true);
          return KVXFER_SUCCESS;
        }
        // The listener here took the peer's own connect meanwhile: use that
        // one (this Link closes unused), or go round again.
        if (e.state == State::kLive) {
          *peer = e.peer;
          return KVXFER_SUCCESS;
        }
        *again = true;
        return KVXFER_SUCCESS;
      case HandshakeStatus::kCrossed:
      case HandshakeStatus::kCrossedLive: {
        // The peer's own connection wins.  With CROSSED_LIVE it already
        // holds one we accepted; if we hold none, ours ended: send FORCE.
        if (reply.status == HandshakeStatus::kCrossedLive && e.state == State::kOutgoing &&
            attempt == 0) {
          force = true;
          continue;
        }
        const bool ended = cv_.wait_until(lk, deadline, [&] {
          const Entry& x = entries_[to.incarnation];
          return stopped_ || x.state == State::kLive || x.state == State::kGone;
        });
        if (!ended)
          return give_up(KVXFER_ERR_TIMEOUT,
                         strprintf("connecting to %s: both sides connected at once and the "
                                   "peer's connection did not arrive within %d ms",
                                   to.text().c_str(), cfg_.timeout_ms));
        if (entries_[to.incarnation].state == State::kLive) {
          *peer = entries_[to.incarnation].peer;
          return KVXFER_SUCCESS;
        }
        *again = true;  // it ended (a disconnect) before this call saw it
        return KVXFER_SUCCESS;
      }
      case HandshakeStatus::kRefused:
        return give_up(KVXFER_ERR_INVALID_ARGUMENT,
                       strprintf("the endpoint at %s refused the connection: wrong secret (%s)",
                                 to.text().c_str(), reply.reason.c_str()));
      case HandshakeStatus::kStale:
        return give_up(KVXFER_ERR_MISMATCH,
                       strprintf("the endpoint at %s is incarnation %016" PRIx64
                                 ", the address names %016" PRIx64
                                 ": it restarted; connect to its new address",
                                 to.text().c_str(), reply.incarnation, to.incarnation));
      default:
        return give_up(
            KVXFER_ERR_SYSTEM,
            strprintf("the endpoint at %s refused the connection (%s): %s", to.text().c_str(),
                      status_name(reply.status), reply.reason.c_str()));
    }
  }
}

int Membership::go_live(uint64_t incarnation, Entry& e, std::unique_ptr<Link> link,
                        bool initiated) {
  const int p = engine_->reserve_peer();
  if (static_cast<size_t>(p) >= peer_incarnation_.size())
    peer_incarnation_.resize(static_cast<size_t>(p) + 1, 0);
  peer_incarnation_[p] = incarnation;
  e.peer = p;
  e.state = State::kLive;
  e.initiated = initiated;
  e.why.clear();
  const bool shm = link->same_host();
  engine_->adopt_peer(p, std::move(link));
  // A Live peer at the same listener with another incarnation restarted,
  // when this side reached the new one at that listener.  An accepted
  // CONNECT's address is only a claim (any holder of our blob may send one):
  // the old incarnation is then ended by its own Link, when it dies.
  for (auto& [inc, other] : entries_)
    if (initiated && inc != incarnation && other.state == State::kLive &&
        other.addr.same_place(e.addr))
      end(other, KVXFER_ERR_SYSTEM,
          strprintf("the endpoint at %s restarted (incarnation %016" PRIx64 " is now %016" PRIx64
                    ")",
                    e.addr.text().c_str(), inc, incarnation));
  KVXFER_INFO(LOG_NET,
              "endpoint %016" PRIx64 ": peer %d is %s (incarnation %016" PRIx64 ", %s, %s)",
              self_.incarnation, p, e.addr.text().c_str(), incarnation,
              initiated ? "connected" : "accepted", shm ? "shared memory" : "network");
  cv_.notify_all();
  return p;
}

void Membership::end(Entry& e, kvxfer_result_t code, const std::string& why) {
  if (e.state != State::kLive) return;
  e.state = State::kGone;
  e.why = why;
  engine_->drop_peer(e.peer, code, why);
  cv_.notify_all();
}

kvxfer_result_t Membership::disconnect(int peer) {
  EndpointAddress to;
  {
    std::lock_guard<std::mutex> lk(mu_);
    KVXFER_REQUIRE(peer >= 0 && static_cast<size_t>(peer) < peer_incarnation_.size() &&
                       peer_incarnation_[peer] != 0,
                   "peer %d is not a peer of this endpoint", peer);
    auto it = entries_.find(peer_incarnation_[peer]);
    if (it == entries_.end() || it->second.peer != peer || it->second.state != State::kLive)
      return set_error(KVXFER_ERR_INVALID_USAGE, "peer %d is not connected: %s", peer,
                       it != entries_.end() && it->second.peer == peer
                           ? it->second.why.c_str()
                           : "a later connection to the same endpoint replaced it");
    to = it->second.addr;
    it->second.state = State::kGone;  // connect() now makes a new connection
    it->second.why = "disconnected (kvxfer_endpoint_disconnect on this side)";
  }
  // This side's requests fail as disconnected at once; the Link stays open
  // until the peer has heard it, so that its requests fail as disconnected
  // too, not by the reset of the connection.
  engine_->drop_peer(
      peer, KVXFER_ERR_CANCELLED,
      strprintf("peer %d was disconnected (kvxfer_endpoint_disconnect on this side)", peer),
      /*close_link=*/false);
  tell_bye(to, std::min(cfg_.timeout_ms, kByeMs));
  engine_->close_peer(peer);
  return KVXFER_SUCCESS;
}

void Membership::tell_bye(const EndpointAddress& to, int budget_ms) {
  Reply reply;
  if (exchange(to, true, false, {}, budget_ms, &reply) != KVXFER_SUCCESS)
    KVXFER_INFO(LOG_NET, "endpoint: telling %s of the disconnect: %s", to.text().c_str(),
                last_error());
}

void Membership::on_link_failed(int peer, const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopped_ || peer < 0 || static_cast<size_t>(peer) >= peer_incarnation_.size()) return;
  auto it = entries_.find(peer_incarnation_[peer]);
  if (it == entries_.end() || it->second.peer != peer) return;
  end(it->second, KVXFER_ERR_SYSTEM,
      strprintf("the connection to peer %d failed: %s", peer, why.c_str()));
}

// ---------------------------------------------------------------------------
// Incoming
// ---------------------------------------------------------------------------
// One thread serves the listener: it polls the listener and every pending
// connection, reads each connection's frame as its bytes come, and answers
// a frame once it is whole.  A connection that sends nothing or too little
// holds only its own slot, until min(timeout, kAcceptMs) drops it; at most
// kMaxPending wait at once (more are closed at accept).
void Membership::accept_main() {
  struct Pending {
    tcp::Fd fd;
    std::vector<uint8_t> buf;  // the length prefix, then the frame
    size_t want = 4;
    tcp::Deadline deadline;
    std::string who;
  };
  std::vector<Pending> pending;
  std::vector<pollfd> fds;
  LogThrottle full_log;  // a flood of connections past kMaxPending: one WARN a second
  for (;;) {
    fds.assign({{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}});
    int wait_ms = -1;
    for (const Pending& p : pending) {
      fds.push_back({p.fd.get(), POLLIN, 0});
      const int left = tcp::remaining_ms(p.deadline);
      wait_ms = wait_ms < 0 ? left : std::min(wait_ms, left);
    }
    const int n = ::poll(fds.data(), fds.size(), wait_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      KVXFER_WARN(LOG_NET, "endpoint: poll on the listener: %s", std::strerror(errno));
      return;
    }
    if ((fds[1].revents & POLLIN) != 0) return;
    // Read what came; a whole frame is answered, a dead or late one dropped.
    std::vector<Pending> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      bool drop = false;
      if ((fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        const size_t have = p.buf.size();
        p.buf.resize(p.want);
        const ssize_t r = ::recv(p.fd.get(), p.buf.data() + have, p.want - have, 0);
        p.buf.resize(have + (r > 0 ? static_cast<size_t>(r) : 0));
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) drop = true;
        if (!drop && p.buf.size() == 4 && p.want == 4) {
          const uint32_t len = tcp::get_u32(p.buf.data());
          if (len > kHandshakeMaxBytes) {
            if (uint64_t n = 0; refused_log_.tick(&n))
              KVXFER_WARN(LOG_NET, "endpoint: refused a frame of %u bytes from %s%s", len,
                          p.who.c_str(), LogThrottle::note(n).c_str());
            drop = true;
          }
          p.want = 4 + len;
        }
        if (!drop && p.buf.size() == p.want && p.want > 4) {
          serve(p.fd.get(), p.who, std::vector<uint8_t>(p.buf.begin() + 4, p.buf.end()));
          continue;  // answered: closed with p
        }
      }
      if (!drop && tcp::remaining_ms(p.deadline) == 0) {
        KVXFER_INFO(LOG_NET, "endpoint: dropped a connection from %s: no whole handshake in %d ms",
                    p.who.c_str(), std::min(cfg_.timeout_ms, kAcceptMs));
        drop = true;
      }
      if (!drop) still.push_back(std::move(p));
    }
    pending.swap(still);
    if ((fds[0].revents & POLLIN) == 0) continue;
    for (;;) {  // every connection waiting in the backlog
      sockaddr_storage from{};
      socklen_t fl = sizeof from;
      const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &fl,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        // Out of descriptors the backlog stays readable: pause, do not spin.
        if (errno == EMFILE || errno == ENFILE) {
          KVXFER_WARN(LOG_NET, "endpoint: accept: %s; pausing the listener 100 ms",
                      std::strerror(errno));
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        break;  // EAGAIN, ECONNABORTED: the next poll tries again
      }
      tcp::Fd owner(fd);
      const std::string who = tcp::sockaddr_text(reinterpret_cast<const sockaddr*>(&from), fl);
      if (pending.size() >= kMaxPending) {
        if (uint64_t n = 0; full_log.tick(&n))
          KVXFER_WARN(LOG_NET, "endpoint: %zu handshakes pending; closed the connection from %s%s",
                      pending.size(), who.c_str(), LogThrottle::note(n).c_str());
        continue;
      }
      tcp::set_nodelay(fd);
      Pending p;
      p.fd = std::move(owner);
      p.deadline = tcp::deadline_after(std::min(cfg_.timeout_ms, kAcceptMs));
      p.who = who;
      pending.push_back(std::move(p));
    }
  }
}

void Membership::serve(int fd, const std::string& who, const std::vector<uint8_t>& f) {
  const tcp::Deadline d = tcp::deadline_after(std::min(cfg_.timeout_ms, kAcceptMs));
  bool closed = false;
  auto answer = [&](HandshakeStatus st, const std::vector<uint8_t>& link, const std::string& why) {
    const std::vector<uint8_t> fr = reply_frame(st, self_.incarnation, link, why);
    return tcp::send_all(fd, fr.data(), fr.size(), d, kWho, "answering a handshake", &closed);
  };
  size_t pos = kRequestFixed;
  std::vector<uint8_t> blob, link_addr;
  if (f.size() < kRequestFixed || tcp::get_u32(f.data()) != kHandshakeMagic ||
      tcp::get_u16(f.data() + 4) != kHandshakeVersion || !get_bytes(f, &pos, &blob) ||
      !get_bytes(f, &pos, &link_addr) || pos != f.size()) {
    if (uint64_t n = 0; refused_log_.tick(&n))
      KVXFER_WARN(LOG_NET, "endpoint: refused a malformed handshake (%zu bytes) from %s%s",
                  f.size(), who.c_str(), LogThrottle::note(n).c_str());
    (void)answer(HandshakeStatus::kBad, {}, "malformed handshake");
    return;
  }
  const uint16_t kind = tcp::get_u16(f.data() + 6);
  const uint32_t flags = tcp::get_u32(f.data() + 8);
  const uint8_t* secret = f.data() + 12;
  const uint64_t from_inc = tcp::get_u64(f.data() + 12 + kEndpointSecretBytes);
  const uint64_t to_inc = tcp::get_u64(f.data() + 20 + kEndpointSecretBytes);
  // Another incarnation first: its blob's secret was that incarnation's.
  if (to_inc != self_.incarnation) {
    (void)answer(HandshakeStatus::kStale, {},
                 strprintf("this endpoint is incarnation %016" PRIx64, self_.incarnation));
    return;
  }
  if (!tcp::secret_equal(secret, cfg_.secret.data(), kEndpointSecretBytes)) {
    if (uint64_t n = 0; refused_log_.tick(&n))
      KVXFER_WARN(LOG_NET, "endpoint: refused %s from %s: wrong secret%s",
                  kind == kKindBye ? "a disconnect" : "a connection", who.c_str(),
                  LogThrottle::note(n).c_str());
    (void)answer(HandshakeStatus::kRefused, {}, "the secret presented is not this endpoint's");
    return;
  }
  EndpointAddress from_addr;
  if ((kind != kKindConnect && kind != kKindBye) ||
      decode_endpoint_address(blob.data(), blob.size(), &from_addr) != KVXFER_SUCCESS ||
      from_addr.incarnation != from_inc || from_inc == self_.incarnation ||
      (kind == kKindConnect && link_addr.empty())) {
    // It had the secret: a peer of this deployment with a defect, always logged.
    KVXFER_WARN(LOG_NET, "endpoint: refused a handshake of kind %u from %s: bad fields", kind,
                who.c_str());
    (void)answer(HandshakeStatus::kBad, {}, "bad kind, address or link address");
    return;
  }
  if (kind == kKindConnect && engine_->aborted()) {
    (void)answer(HandshakeStatus::kError, {}, "the endpoint was aborted (kvxfer_comm_abort)");
    return;
  }

  std::unique_lock<std::mutex> lk(mu_);
  if (stopped_) return;
  auto it = entries_.find(from_inc);
  if (kind == kKindBye) {
    if (it != entries_.end())
      end(it->second, KVXFER_ERR_CANCELLED,
          strprintf("peer %d disconnected (kvxfer_endpoint_disconnect or destroy on its side)",
                    it->second.peer));
    lk.unlock();
    (void)answer(HandshakeStatus::kOk, {}, "");
    return;
  }
  if (const int n = engine_->handshaking_peers(); n >= engine_->max_handshaking_peers()) {
    lk.unlock();
    if (uint64_t k = 0; refused_log_.tick(&k))
      KVXFER_WARN(LOG_NET, "endpoint: refused a connection from %s: %d peers handshaking%s",
                  who.c_str(), n, LogThrottle::note(k).c_str());
    (void)answer(HandshakeStatus::kError, {},
                 strprintf("busy: %d peers of this endpoint are still in their handshake (at most "
                           "%d); connect again later",
                           n, engine_->max_handshaking_peers()));
    return;
  }
  const bool force = (flags & kFlagForce) != 0;
  if (it != entries_.end()) {
    Entry& e = it->second;
    const bool peer_wins = from_inc < self_.incarnation;
    if (e.state == State::kOutgoing && !peer_wins) {
      lk.unlock();
      (void)answer(HandshakeStatus::kCrossed, {}, "crossed connects: this side's wins");
      return;
    }
    if (e.state == State::kLive && e.initiated && !peer_wins && !force) {
      lk.unlock();
      (void)answer(HandshakeStatus::kCrossedLive, {}, "crossed connects: this side's is live");
      return;
    }
    if (e.state == State::kLive)
      end(e, KVXFER_ERR_SYSTEM,
          strprintf("peer %d connected again (it had ended its side of the connection)", e.peer));
  }
  Entry& e = entries_[from_inc];
  e.addr = from_addr;
  e.blob = blob;
  e.state = State::kIncoming;
  lk.unlock();

  std::unique_ptr<Link> link;
  kvxfer_result_t r = new_link(from_addr, &link);
  if (r == KVXFER_SUCCESS) r = link->connect(link_addr.data(), link_addr.size());
  std::string why = r != KVXFER_SUCCESS ? last_error() : "";
  if (r == KVXFER_SUCCESS) {
    r = answer(HandshakeStatus::kOk, link->local_address(), "");
    if (r != KVXFER_SUCCESS) why = last_error();
  } else {
    (void)answer(HandshakeStatus::kError, {}, why);
  }
  lk.lock();
  Entry& done = entries_[from_inc];
  if (r != KVXFER_SUCCESS || stopped_) {
    KVXFER_WARN(LOG_NET, "endpoint: accepting %s: %s", from_addr.text().c_str(), why.c_str());
    done.state = State::kGone;
    done.why = "accepting its connection failed: " + why;
    cv_.notify_all();
    return;
  }
  go_live(from_inc, done, std::move(link), false);
}

}  // namespace kvxfer::xfer
