// Communicator: one Link per peer, joined through the bootstrap (comm.h).
#include "transport/comm.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "common/error.h"
#include "common/log.h"

namespace kvxfer::transport {
namespace {

void put_u32(std::vector<uint8_t>* b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u16(std::vector<uint8_t>* b, uint16_t v) {
  for (int i = 0; i < 2; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

struct Reader {
  const std::vector<uint8_t>& b;
  size_t pos = 0;
  bool u32(uint32_t* v) {
    if (b.size() - pos < 4) return false;
    *v = 0;
    for (int i = 0; i < 4; ++i) *v |= uint32_t{b[pos + i]} << (8 * i);
    pos += 4;
    return true;
  }
  bool u16(uint16_t* v) {
    if (b.size() - pos < 2) return false;
    *v = static_cast<uint16_t>(b[pos] | (b[pos + 1] << 8));
    pos += 2;
    return true;
  }
};

/** Milliseconds left until `deadline`, at least `floor_ms`. */
int ms_left(Clock::time_point deadline, int floor_ms = 0) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < floor_ms ? floor_ms : static_cast<int>(left);
}

}  // namespace

std::vector<uint8_t> encode_comm_payload(int rank, const std::vector<std::vector<uint8_t>>& addrs) {
  std::vector<uint8_t> b;
  put_u32(&b, kCommPayloadMagic);
  put_u16(&b, kCommPayloadVersion);
  put_u16(&b, 0);
  put_u32(&b, static_cast<uint32_t>(rank));
  put_u32(&b, static_cast<uint32_t>(addrs.size()));
  for (const auto& a : addrs) {
    put_u32(&b, static_cast<uint32_t>(a.size()));
    b.insert(b.end(), a.begin(), a.end());
  }
  return b;
}

kvxfer_result_t decode_comm_payload(const std::vector<uint8_t>& payload, int rank, int nranks,
                                    std::vector<std::vector<uint8_t>>* addrs) {
  Reader r{payload};
  uint32_t magic = 0, prank = 0, pn = 0;
  uint16_t version = 0, zero = 0;
  if (!r.u32(&magic) || !r.u16(&version) || !r.u16(&zero) || !r.u32(&prank) || !r.u32(&pn))
    return set_error(KVXFER_ERR_CORRUPT, "comm payload of rank %d: truncated header (%zu bytes)",
                     rank, payload.size());
  if (magic != kCommPayloadMagic || version != kCommPayloadVersion)
    return set_error(KVXFER_ERR_CORRUPT, "comm payload of rank %d: bad magic 0x%08x or version %u",
                     rank, magic, version);
  if (prank != static_cast<uint32_t>(rank) || pn != static_cast<uint32_t>(nranks))
    return set_error(KVXFER_ERR_CORRUPT,
                     "comm payload of rank %d: says rank %u of %u, expected rank %d of %d", rank,
                     prank, pn, rank, nranks);
  addrs->assign(static_cast<size_t>(nranks), {});
  for (int p = 0; p < nranks; ++p) {
    uint32_t len = 0;
    if (!r.u32(&len) || payload.size() - r.pos < len)
      return set_error(KVXFER_ERR_CORRUPT, "comm payload of rank %d: entry %d truncated", rank, p);
    (*addrs)[p].assign(payload.begin() + static_cast<std::ptrdiff_t>(r.pos),
                       payload.begin() + static_cast<std::ptrdiff_t>(r.pos + len));
    r.pos += len;
  }
  if (r.pos != payload.size())
    return set_error(KVXFER_ERR_CORRUPT, "comm payload of rank %d: %zu trailing bytes", rank,
                     payload.size() - r.pos);
  if (!(*addrs)[rank].empty())
    return set_error(KVXFER_ERR_CORRUPT, "comm payload of rank %d: non-empty entry for itself",
                     rank);
  return KVXFER_SUCCESS;
}

kvxfer_result_t Communicator::create(const UniqueId& id, BootstrapRoot* root_or_null, int rank,
                                     int nranks, const LinkConfig& cfg, int timeout_ms,
                                     std::unique_ptr<Communicator>* out) {
  KVXFER_REQUIRE(out != nullptr, "Communicator::create: out is NULL");
  KVXFER_REQUIRE(nranks >= 2 && nranks <= kBootstrapMaxRanks,
                 "Communicator::create: nranks %d outside 2..%d", nranks, kBootstrapMaxRanks);
  KVXFER_REQUIRE(rank >= 0 && rank < nranks, "Communicator::create: rank %d outside 0..%d", rank,
                 nranks - 1);
  KVXFER_REQUIRE(timeout_ms > 0, "Communicator::create: timeout_ms %d must be > 0", timeout_ms);
  KVXFER_REQUIRE((rank == 0) == (root_or_null != nullptr),
                 "Communicator::create: rank %d %s a BootstrapRoot (rank 0 and only rank 0 "
                 "passes the root from create_unique_id)",
                 rank, rank == 0 ? "needs" : "must not pass");
  out->reset();
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);

  std::unique_ptr<Communicator> c(new Communicator());
  c->rank_ = rank;
  c->nranks_ = nranks;
  c->links_.resize(static_cast<size_t>(nranks));

  // 1. One Link per peer.
  std::vector<std::vector<uint8_t>> mine(static_cast<size_t>(nranks));
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    if (Link::create(cfg, &c->links_[p]) != KVXFER_SUCCESS) {
      const std::string e = last_error();
      return report_failure(
          id, root_or_null, rank, nranks, ms_left(deadline, 1),
          set_error(KVXFER_ERR_SYSTEM, "comm rank %d/%d: opening the link to rank %d: %s", rank,
                    nranks, p, e.c_str()));
    }
    mine[p] = c->links_[p]->local_address();
  }
  const std::vector<uint8_t> payload = encode_comm_payload(rank, mine);
  if (payload.size() > kBootstrapMaxPayload)
    return report_failure(id, root_or_null, rank, nranks, ms_left(deadline, 1),
                          set_error(KVXFER_ERR_UNSUPPORTED,
                                    "comm rank %d/%d: %zu bytes of link addresses exceed the "
                                    "bootstrap's %zu-byte payload limit",
                                    rank, nranks, payload.size(), kBootstrapMaxPayload));

  // 2. Bootstrap; rank 0 also serves as the root on a helper thread, which
  // runs until the final status round (step 4) ends.  `session` is declared
  // after the joiner, so it closes first on every return: the root reads a
  // closed session as this rank failing and ends its round at once.
  kvxfer_result_t root_r = KVXFER_SUCCESS;
  std::string root_err;
  std::thread root_thread;
  struct Joiner {
    std::thread* t;
    ~Joiner() {
      if (t->joinable()) t->join();  // accept_all is bounded by timeout_ms
    }
  } joiner{&root_thread};
  std::unique_ptr<BootstrapSession> session;
  if (root_or_null != nullptr) {
    root_thread = std::thread([&root_r, &root_err, root_or_null, nranks, timeout_ms] {
      root_r = root_or_null->accept_all(nranks, timeout_ms, /*final_round=*/true);
      if (root_r != KVXFER_SUCCESS) root_err = last_error();
    });
  }
  AddressTable table;
  const int boot_ms = ms_left(deadline, 1);
  kvxfer_result_t r = bootstrap_connect(id, rank, nranks, boot_ms, payload.data(), payload.size(),
                                        &table, &session);
  if (r != KVXFER_SUCCESS) {
    std::string boot_err = last_error();
    if (r == KVXFER_ERR_TIMEOUT && timeout_ms - boot_ms >= std::max(50, timeout_ms / 10))
      boot_err += strprintf(" (of the timeout of %d ms, opening the links took %d)", timeout_ms,
                            timeout_ms - boot_ms);
    if (root_thread.joinable()) root_thread.join();
    // A relayed failure: the root's error says the same as ours.
    if (root_r != KVXFER_SUCCESS && root_or_null->failed_rank() < 0)
      return set_error(r, "comm rank %d/%d: bootstrap failed: %s (root: %s)", rank, nranks,
                       boot_err.c_str(), root_err.c_str());
    return set_error(r, "comm rank %d/%d: bootstrap failed: %s", rank, nranks, boot_err.c_str());
  }
  // From here on a failure of this rank goes to the root as RANK_FAILED.
  auto fail = [&](kvxfer_result_t code) {
    const std::string why = last_error();
    if (session->report(why.c_str()) != KVXFER_SUCCESS)
      KVXFER_WARN(LOG_NET, "comm rank %d/%d: telling the root of this rank's failure: %s", rank,
                  nranks, last_error());
    return set_error(code, "%s", why.c_str());
  };
  if (table.size() != static_cast<size_t>(nranks))
    return fail(set_error(KVXFER_ERR_CORRUPT, "comm rank %d/%d: bootstrap table has %zu entries",
                          rank, nranks, table.size()));

  // 3. Connect each Link to the peer's entry for this rank.
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    std::vector<std::vector<uint8_t>> theirs;
    if (decode_comm_payload(table[p], p, nranks, &theirs) != KVXFER_SUCCESS) {
      const std::string e = last_error();
      return fail(set_error(KVXFER_ERR_CORRUPT, "comm rank %d/%d: %s", rank, nranks, e.c_str()));
    }
    const std::vector<uint8_t>& blob = theirs[rank];
    if (blob.empty())
      return fail(set_error(KVXFER_ERR_CORRUPT, "comm rank %d/%d: rank %d sent no address for us",
                            rank, nranks, p));
    if (c->links_[p]->connect(blob.data(), blob.size()) != KVXFER_SUCCESS) {
      const std::string e = last_error();
      return fail(set_error(KVXFER_ERR_SYSTEM, "comm rank %d/%d: connecting to rank %d: %s", rank,
                            nranks, p, e.c_str()));
    }
  }

  // 4. Drive every handshake to completion, then tell the root this rank is
  // ready and keep driving the Links until the root says every rank is (or
  // relays another rank's failure), all within the deadline.
  bool reported_ready = false;
  for (;;) {
    bool all_ready = true;
    for (int p = 0; p < nranks; ++p) {
      Link* l = c->links_[p].get();
      if (l == nullptr) continue;
      if (l->progress() != KVXFER_SUCCESS || l->failed()) {
        const std::string e = last_error();
        return fail(set_error(KVXFER_ERR_SYSTEM,
                              "comm rank %d/%d: handshake with rank %d failed: %s", rank, nranks, p,
                              e.c_str()));
      }
      all_ready = all_ready && l->ready();
    }
    if (all_ready && !reported_ready) {
      if (session->report(nullptr) != KVXFER_SUCCESS) {
        const std::string e = last_error();
        return set_error(KVXFER_ERR_SYSTEM, "comm rank %d/%d: %s", rank, nranks, e.c_str());
      }
      reported_ready = true;
    }
    bool everyone_ready = false;
    const kvxfer_result_t v = session->poll(&everyone_ready);
    if (v != KVXFER_SUCCESS) {
      const std::string e = last_error();
      return set_error(v, "comm rank %d/%d: %s", rank, nranks, e.c_str());
    }
    if (everyone_ready && reported_ready) break;
    if (everyone_ready)
      return fail(set_error(KVXFER_ERR_CORRUPT,
                            "comm rank %d/%d: the root said every rank is ready before this one",
                            rank, nranks));
    if (Clock::now() >= deadline) {
      if (reported_ready)
        return set_error(KVXFER_ERR_TIMEOUT,
                         "comm rank %d/%d: connected to every peer, but not every rank was ready "
                         "within %d ms",
                         rank, nranks, timeout_ms);
      std::string missing;
      for (int p = 0; p < nranks; ++p)
        if (c->links_[p] && !c->links_[p]->ready())
          missing += (missing.empty() ? "" : ", ") + std::to_string(p);
      return fail(set_error(KVXFER_ERR_TIMEOUT,
                            "comm rank %d/%d: handshake not done within %d ms (peers: %s)", rank,
                            nranks, timeout_ms, missing.c_str()));
    }
    std::this_thread::yield();
  }
  session.reset();
  if (root_thread.joinable()) root_thread.join();
  if (root_r != KVXFER_SUCCESS)  // every rank was told READY, so this is a late socket error
    KVXFER_WARN(LOG_NET, "comm rank 0/%d: the bootstrap root after READY: %s", nranks,
                root_err.c_str());
  *out = std::move(c);
  return KVXFER_SUCCESS;
}

kvxfer_result_t Communicator::report_failure(const UniqueId& id, BootstrapRoot* root_or_null,
                                             int rank, int nranks, int timeout_ms,
                                             kvxfer_result_t code) {
  const std::string why = last_error();
  const int budget = timeout_ms > 0 ? std::min(timeout_ms, kBootstrapFailGraceMs) : 1;
  const kvxfer_result_t r = root_or_null != nullptr
                                ? root_or_null->fail_all(nranks, rank, why.c_str(), budget)
                                : bootstrap_report_failure(id, rank, nranks, budget, why.c_str());
  if (r != KVXFER_SUCCESS)
    KVXFER_WARN(LOG_NET, "comm rank %d/%d: telling the other ranks of this rank's failure: %s",
                rank, nranks, last_error());
  return set_error(code, "%s", why.c_str());
}

Communicator::~Communicator() { abort("communicator destroyed"); }

Link* Communicator::link(int peer) const {
  if (peer < 0 || peer >= static_cast<int>(links_.size())) return nullptr;
  return links_[peer].get();
}

std::unique_ptr<Communicator> Communicator::create_open() {
  std::unique_ptr<Communicator> c(new Communicator());
  c->rank_ = -1;
  return c;
}

void Communicator::set_link(int peer, std::unique_ptr<Link> link) {
  if (peer < 0) return;
  if (peer >= static_cast<int>(links_.size())) links_.resize(static_cast<size_t>(peer) + 1);
  links_[peer] = std::move(link);
  if (aborted_ && links_[peer]) links_[peer]->abort("communicator aborted");
}

void Communicator::release_link(int peer, const char* why) {
  if (peer < 0 || peer >= static_cast<int>(links_.size()) || !links_[peer]) return;
  links_[peer]->abort(why);
  links_[peer].reset();
}

kvxfer_result_t Communicator::progress() {
  kvxfer_result_t first = KVXFER_SUCCESS;
  for (auto& l : links_) {
    if (!l) continue;
    const kvxfer_result_t r = l->progress();
    if (r != KVXFER_SUCCESS && first == KVXFER_SUCCESS) first = r;
  }
  return first;
}

void Communicator::abort(const char* why) {
  aborted_ = true;
  for (auto& l : links_)
    if (l) l->abort(why != nullptr ? why : "communicator aborted");
}

}  // namespace kvxfer::transport
