// The ranks' side of the bootstrap (bootstrap.h): join, the final status
// round, failure reports.
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
#include "transport/bootstrap.h"
#include "transport/bootstrap_wire.h"
#include "transport/tcp_io.h"

namespace kvxfer::transport {

using namespace bootstrap_wire;  // NOLINT: the bootstrap's own frames

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

const char* unique_id_defect(const UniqueId& id) {
  if (id.magic != kBootstrapMagic) return "bad magic";
  if (id.version != kBootstrapVersion) return "a version this library does not read";
  if (id.family != AF_INET && id.family != AF_INET6) return "an address family other than IPv4/6";
  if (id.port == 0) return "no port";
  auto zero = [](const uint8_t* p, size_t n) {
    for (size_t i = 0; i < n; ++i)
      if (p[i] != 0) return false;
    return true;
  };
  if (id.reserved0 != 0 || !zero(id.reserved, sizeof id.reserved)) return "reserved bytes set";
  if (id.family == AF_INET && (id.scope_id != 0 || !zero(id.addr + 4, sizeof id.addr - 4)))
    return "bytes an IPv4 address leaves unused set";
  return nullptr;
}

std::string unique_id_address(const UniqueId& id) {
  sockaddr_storage sa;
  socklen_t sl = 0;
  if (!id_sockaddr(id, &sa, &sl)) return "<invalid id>";
  return sockaddr_text(reinterpret_cast<sockaddr*>(&sa), sl);
}

}  // namespace kvxfer::transport
