// mesh_perf: prefill and decode endpoints that meet at run time, with a
// prefill killed and restarted and a decode that disconnects and reconnects.
// docs/PERFORMANCE.md, "perf/mesh_perf", defines every line.
//
// This process only coordinates.  It forks -P prefill and -D decode
// processes, each with one endpoint (kvxfer_endpoint_create), and hands
// every process every address.  All of them derive the same list of -R
// requests from --seed: request i goes from prefill p_i to decode d_i, Lynx
// 4+4, 1 to 16 MiB, matched by id i.  Each process posts its own requests in
// list order, at most -W in flight, connecting to a peer at its first use.
// Midway (--kill_at completed requests) prefill 1 stops itself, with a send
// in flight if it has one (matched, under half of its anchors sent); the
// coordinator kills it with SIGKILL and starts it again on the same port;
// the decodes connect to the
// new incarnation for the requests from index K on (K: the first index
// no decode had posted, or counted as the killed incarnation's, when
// told), and those before K that no decode had posted yet are not posted.
// At --disconnect_at of its own completions, decode 0 waits until nothing
// is in flight with prefill 2, disconnects from it and reconnects at its
// next use; prefill 2 posts again the sends that the disconnect ended, and
// connects again when a post finds decode 0 gone.
// Received bytes are compared with the codec's own decode of the sender's
// values (-c 1).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"
#include "perf/common/endpoint_util.h"
#include "perf/common/harness.h"
#include "perf/common/pipe_msg.h"
#include "perf/common/whole_kv.h"

namespace {

namespace kp = kvxfer::perf;

constexpr const char* kTool = "mesh_perf";
constexpr int kLayers = 8, kHeads = 8, kHeadDim = 128;
constexpr int32_t kPageTokens = 256;
constexpr int kKilled = 1;        // the prefill killed and restarted
constexpr int kDisconnected = 2;  // the prefill decode 0 disconnects from

struct Options {
  kp::CommonOptions common;
  int prefill = 4, decode = 2, requests = 512, window = 4;
  int kill_at = 200, disconnect_at = 120;
  uint64_t seed = 1;
  int timeout_ms = 30000;
};

struct Req {
  int p, d;
  int64_t tokens;
};

/** ns as ms for the JSON, or null when `when` (the absolute time) is 0: not reached. */
nlohmann::json json_ms(int64_t ns, int64_t when = 1) {
  return when == 0 ? nlohmann::json(nullptr) : nlohmann::json(ns * 1e-6);
}

std::vector<Req> plan(const Options& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<Req> v;
  for (int i = 0; i < o.requests; ++i) {
    const uint64_t mib = 1 + rng() % 16;  // 1 MiB = 64 tokens of 8 layers x K,V x 8 x 128 bf16
    v.push_back({static_cast<int>(rng() % o.prefill), static_cast<int>(rng() % o.decode),
                 static_cast<int64_t>(mib * 64)});
  }
  return v;
}

/** KV-like bf16 values of request `id` (a cheap function of id and index). */
void fill(kp::WholeKv* kv, uint64_t id) {
  for (int l = 0; l < kv->L; ++l)
    for (auto* t : {&kv->k[l], &kv->v[l]}) {
      uint64_t x = id * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(l) * 7919 + t->size();
      for (size_t i = 0; i < t->size(); ++i) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const float u = static_cast<float>((x >> 40) & 0xFFFF) / 65536.0f - 0.5f;
        (*t)[i] = kp::bf16_of(u * (1.0f + static_cast<float>(i % 7)));
      }
    }
}

// ---- pipes: perf/common/pipe_msg, one char of type per message -----------
bool send_msg(int fd, char kind, const void* p, uint32_t n) {
  return kp::send_msg(fd, static_cast<uint8_t>(kind), p, n);
}
bool read_msg(int fd, char* kind, std::vector<uint8_t>* body, int timeout_ms) {
  uint32_t t = 0;
  std::string err;
  if (!kp::recv_msg(fd, &t, body, timeout_ms, "another process", &err)) return false;
  *kind = static_cast<char>(t);
  return true;
}
bool readable(int fd, int wait_ms = 0) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, wait_ms) > 0;
}

/**
 * A port for prefill 1, free now and below the kernel's ephemeral range
 * (ip_local_port_range), so that no other socket's connect takes it while
 * prefill 1 is down between its kill and its restart (one in the range
 * did: "bind: Address already in use").  0 if none of 64 tried is free.
 */
int restart_port() {
  int lo = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "re")) {
    if (std::fscanf(f, "%d", &lo) != 1) lo = 32768;
    std::fclose(f);
  }
  const int base = 10000, span = std::max(1000, lo - base);
  for (int k = 0; k < 64; ++k) {
    const int port = base + static_cast<int>((getpid() + 7919L * k) % span);
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = s >= 0 && ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    if (s >= 0) ::close(s);
    if (ok) return port;
  }
  return 0;
}

/** Every process's address: prefill 0..P-1, then decode 0..D-1. */
std::vector<std::vector<uint8_t>> split_blobs(const std::vector<uint8_t>& b) {
  std::vector<std::vector<uint8_t>> out;
  for (size_t i = 0; i + 4 <= b.size();) {
    uint32_t n;
    std::memcpy(&n, b.data() + i, 4);
    out.emplace_back(b.begin() + static_cast<std::ptrdiff_t>(i + 4),
                     b.begin() + static_cast<std::ptrdiff_t>(i + 4 + n));
    i += 4 + n;
  }
  return out;
}

/** A connection cache: a peer's index, connected at its first use. */
struct Peers {
  kvxfer_comm_t ep;
  std::vector<std::vector<uint8_t>> blobs;  // by process: prefill 0..P-1, decode 0..D-1
  std::map<int, int> idx;
  int get(int who) {
    auto it = idx.find(who);
    if (it != idx.end()) return it->second;
    int p = -1;
    if (kvxfer_endpoint_connect(ep, blobs[who].data(), blobs[who].size(), &p) != KVXFER_SUCCESS) {
      std::fprintf(stderr, "%s: connect to process %d: %s\n", kTool, who, kvxfer_get_last_error());
      return -1;
    }
    idx[who] = p;
    return p;
  }
};

/** A request of this process in flight: its index, handle and KV. */
struct Live {
  int i;
  kvxfer_request_t r;
  std::unique_ptr<kp::WholeKv> kv;
  bool reposted = false;            // prefill: posted again after a disconnect
  bool killed_incarnation = false;  // decode: posted to prefill 1 before its restart
};

// ---------------------------------------------------------------------------
// Prefill: sends its requests from index `from` on.
// ---------------------------------------------------------------------------
int prefill_main(const Options& o, int me, int port, bool restarted, int rd, int wr) {
  if (restarted) {  // wait for the coordinator's word
    char k;
    std::vector<uint8_t> b;
    if (!read_msg(rd, &k, &b, 600000) || k != 'S') return 2;
  }
  std::vector<uint8_t> mine;
  kvxfer_comm_t ep = kp::make_endpoint(kTool, o.timeout_ms, port, &mine);
  if (ep == nullptr || !send_msg(wr, 'B', mine.data(), static_cast<uint32_t>(mine.size())))
    return 2;
  char k;
  std::vector<uint8_t> body;
  if (!read_msg(rd, &k, &body, 60000) || k != 'A') return 3;
  Peers peers{ep, split_blobs(body), {}};
  int from = 0;
  if (restarted) {
    if (!read_msg(rd, &k, &body, 60000) || k != 'K' || body.size() != 4) return 3;
    std::memcpy(&from, body.data(), 4);
  }
  const std::vector<Req> reqs = plan(o);
  std::deque<Live> live;
  // A post to a decode that disconnected from us (decode 0, from prefill 2)
  // fails at the call (kvxfer_endpoint_connect: its index is dead); the
  // decode reconnects at its next use of us, and a connect from this side
  // gives the same new index whichever side connects first.
  auto post = [&](Live& l) {
    const kvxfer_request_config_t rc = kp::by_id(static_cast<uint64_t>(l.i), kPageTokens);
    const int who = o.prefill + reqs[l.i].d;
    for (int attempt = 0; attempt < 2; ++attempt) {
      const int peer = peers.get(who);
      if (peer < 0) return false;
      const kvxfer_result_t r = kvxfer_send(ep, peer, &l.kv->desc, nullptr, &rc, &l.r);
      if (r != KVXFER_ERR_INVALID_USAGE) return r == KVXFER_SUCCESS;
      peers.idx.erase(who);
    }
    return false;
  };
  int st = 0;
  auto finish_oldest = [&] {
    Live& l = live.front();
    const kvxfer_result_t w = kvxfer_wait(l.r, KVXFER_STAGE_COMPLETE, o.timeout_ms * 2);
    const std::string err = w == KVXFER_SUCCESS ? "" : kvxfer_get_last_error();
    kvxfer_request_free(l.r);
    // A decode that disconnected ended this send: post it again, once, on a
    // new connection (the decode reconnects at its next use of us).
    if (w == KVXFER_ERR_CANCELLED && !l.reposted) {
      peers.idx.erase(o.prefill + reqs[l.i].d);
      l.reposted = true;
      if (post(l)) {
        live.push_back(std::move(l));
        live.pop_front();
        return;
      }
    }
    if (w != KVXFER_SUCCESS) {
      std::fprintf(stderr, "%s: prefill %d: send %d: %s\n", kTool, me, l.i, err.c_str());
      st = 4;
    }
    live.pop_front();
  };
  // The first incarnation of prefill 1, asked ('W'): it waits for a send
  // whose receive is matched and fewer than half of whose anchor sections
  // are sent (the send completions it records), tells the coordinator ('F')
  // and stops itself (SIGSTOP) for the coordinator's SIGKILL, so that the
  // kill finds that send in flight.  'E': none came before it ran out of
  // sends.
  bool asked = false, told = false;
  auto tell_if_asked = [&](char what) {
    if (me != kKilled || restarted || told) return;
    while (!asked && readable(rd)) {
      if (!read_msg(rd, &k, &body, 60000)) return;
      asked = k == 'W';
    }
    if (!asked) return;
    if (what == 'E') {
      told = send_msg(wr, 'E', nullptr, 0);
      return;
    }
    // Until the oldest send ends (the caller then waits for it).
    for (kvxfer_stage_t stage; kvxfer_test(live.front().r, &stage) == KVXFER_IN_PROGRESS;) {
      for (const Live& l : live) {
        kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
        if (kvxfer_request_get_info(l.r, &info) != KVXFER_SUCCESS || info.t_handshake_ns == 0 ||
            info.stage != KVXFER_STAGE_POSTED)
          continue;
        // A send records a completion per section sent: count the anchors.
        std::vector<kvxfer_arrival_t> a(static_cast<size_t>(2 * info.num_pages));
        size_t n = 0, sent = 0;
        if (kvxfer_request_get_arrivals(l.r, a.data(), a.size(), &n) != KVXFER_SUCCESS) continue;
        for (size_t x = 0; x < std::min(n, a.size()); ++x) sent += a[x].traffic_class == 0;
        if (static_cast<int64_t>(sent) * 2 < info.num_pages) {
          told = send_msg(wr, 'F', nullptr, 0);
          ::raise(SIGSTOP);
          return;
        }
      }
      ::usleep(100);
    }
  };
  for (int i = from; i < o.requests; ++i) {
    if (reqs[i].p != me) continue;
    while (static_cast<int>(live.size()) >= o.window) {
      tell_if_asked('F');
      finish_oldest();
    }
    Live l{i, nullptr, std::make_unique<kp::WholeKv>(kLayers, reqs[i].tokens, kHeads, kHeadDim)};
    fill(l.kv.get(), static_cast<uint64_t>(i));
    if (!post(l)) {
      std::fprintf(stderr, "%s: prefill %d: posting %d: %s\n", kTool, me, i,
                   kvxfer_get_last_error());
      st = 5;
      continue;
    }
    live.push_back(std::move(l));
  }
  while (!live.empty()) {
    tell_if_asked('F');
    finish_oldest();
  }
  tell_if_asked('E');  // asked, and no send came that fitted
  // Serve until every decode is done (a reposted send may still be asked
  // for): the coordinator's end, or its ask.
  while (read_msg(rd, &k, &body, 600000) && k == 'W') {
    asked = true;
    tell_if_asked('E');
  }
  kvxfer_comm_destroy(ep);
  return st;
}

// ---------------------------------------------------------------------------
// Decode: receives its requests, checks them, reports.
// ---------------------------------------------------------------------------
struct DecodeReport {
  int ok = 0, killed_err = 0, killed_late = 0, skipped = 0, other_fail = 0;
  uint64_t wrong = 0, bytes = 0;
  double max_after_kill_s = 0;
};

/** One finished receive, for the JSON's per-request timeline: its
 *  kvxfer_request_info_t times (CLOCK_MONOTONIC ns; 0 = not reached). */
struct ReqTimes {
  int32_t i = 0, p = 0, d = 0;
  int32_t status = 0;  // 0 complete, 1 ended with the killed incarnation, 2 failed otherwise
  uint64_t kv_bytes = 0;
  int64_t t_posted = 0, t_handshake = 0, t_anchor = 0, t_complete = 0, t_error = 0;
};

int decode_main(const Options& o, int me, int rd, int wr) {
  std::vector<uint8_t> mine;
  kvxfer_comm_t ep = kp::make_endpoint(kTool, o.timeout_ms, 0, &mine);
  if (ep == nullptr || !send_msg(wr, 'B', mine.data(), static_cast<uint32_t>(mine.size())))
    return 2;
  char k;
  std::vector<uint8_t> body;
  if (!read_msg(rd, &k, &body, 60000) || k != 'A') return 3;
  Peers peers{ep, split_blobs(body), {}};
  const std::vector<Req> reqs = plan(o);
  const kvxfer_codec_config_t cfg = KVXFER_CODEC_CONFIG_INITIALIZER;
  DecodeReport rep;
  std::vector<ReqTimes> times;
  int64_t t_kill = 0;
  int cut = -1;        // K: P1's requests below it went with the killed incarnation
  bool old_p1 = true;  // P1's peer index is still the killed incarnation's
  int completions = 0;
  bool disconnected = false;
  std::deque<Live> live;
  int next = 0;
  // `unposted`: the first index this decode has neither posted nor counted
  // (next, or next + 1 once request `next` was counted as the killed
  // incarnation's): K must not be below it, or the restarted prefill would
  // send a request this decode no longer posts.
  auto check_coordinator = [&](int unposted) {
    while (readable(rd)) {
      if (!read_msg(rd, &k, &body, 60000)) return;
      if (k == 'R' && body.size() >= 8) {  // P1 killed at t (ns) and restarted at a new blob
        std::memcpy(&t_kill, body.data(), 8);
        peers.blobs[kKilled].assign(body.begin() + 8, body.end());
        peers.idx.erase(kKilled);
        old_p1 = false;
        const int32_t n = unposted;
        send_msg(wr, 'N', &n, 4);
        if (!read_msg(rd, &k, &body, 60000) || k != 'K' || body.size() != 4) return;
        std::memcpy(&cut, body.data(), 4);
      }
    }
  };
  auto finish_oldest = [&] {
    Live l = std::move(live.front());
    live.pop_front();
    // Answers the coordinator while it waits: the word on the kill waits for
    // every decode's 'N', and a decode blocked here on a request whose
    // prefill waits on the other decode (blocked in that word) held the
    // mesh until a request timed out.
    const int64_t end = kp::mono_ns() + int64_t{2} * o.timeout_ms * 1000000;
    kvxfer_result_t w;
    while ((w = kvxfer_wait(l.r, KVXFER_STAGE_COMPLETE, 20)) == KVXFER_IN_PROGRESS &&
           kp::mono_ns() < end)
      check_coordinator(next);
    const std::string err = w == KVXFER_SUCCESS ? "" : kvxfer_get_last_error();
    kvxfer_request_info_t info = KVXFER_REQUEST_INFO_INITIALIZER;
    kvxfer_request_get_info(l.r, &info);
    kvxfer_request_free(l.r);
    check_coordinator(next);  // t_kill may have come meanwhile
    // A request of the killed incarnation may fail before the coordinator
    // says so (the link saw the death first): its word comes soon.
    while (w != KVXFER_SUCCESS && l.killed_incarnation && t_kill == 0 && readable(rd, 60000))
      check_coordinator(next);
    times.push_back({l.i, reqs[l.i].p, me,
                     w == KVXFER_SUCCESS                  ? 0
                     : l.killed_incarnation && t_kill > 0 ? 1
                                                          : 2,
                     2ull * kLayers * l.kv->layer_bytes(), info.t_posted_ns, info.t_handshake_ns,
                     info.t_anchor_ready_ns, info.t_complete_ns, info.t_error_ns});
    if (w == KVXFER_SUCCESS) {
      ++rep.ok;
      ++completions;
      send_msg(wr, 'C', nullptr, 0);
      rep.bytes += 2ull * kLayers * l.kv->layer_bytes();
      if (o.common.check != 0) {
        kp::WholeKv src(kLayers, reqs[l.i].tokens, kHeads, kHeadDim),
            want(kLayers, reqs[l.i].tokens, kHeads, kHeadDim);
        fill(&src, static_cast<uint64_t>(l.i));
        std::string e;
        if (!kp::expected_decode(src, cfg, kPageTokens, 0, &want, &e)) return;
        rep.wrong += want.differing(*l.kv);
      }
    } else if (l.killed_incarnation && t_kill > 0) {
      ++rep.killed_err;
      const double s = (info.t_error_ns - t_kill) * 1e-9;
      rep.max_after_kill_s = std::max(rep.max_after_kill_s, s);
      if (s > 1.5) ++rep.killed_late;
    } else {
      std::fprintf(stderr, "%s: decode %d: request %d (prefill %d): %s\n", kTool, me, l.i,
                   reqs[l.i].p, err.c_str());
      ++rep.other_fail;
    }
  };
  for (next = 0; next < o.requests; ++next) {
    const int i = next;
    check_coordinator(next);
    if (reqs[i].d != me) continue;
    const int p = reqs[i].p;
    while (static_cast<int>(live.size()) >= o.window) finish_oldest();
    // Decode 0 leaves prefill 2 once, with nothing in flight with it, and
    // comes back at its next use.
    if (me == 0 && !disconnected && completions >= o.disconnect_at && p == kDisconnected) {
      while (!live.empty()) finish_oldest();
      auto it = peers.idx.find(kDisconnected);
      if (it != peers.idx.end()) {
        kvxfer_endpoint_disconnect(ep, it->second);
        peers.idx.erase(it);
      }
      disconnected = true;
    }
    // After the waits above, which may have read K.
    if (p == kKilled && !old_p1 && i < cut) {  // the killed incarnation's, never posted
      ++rep.skipped;
      continue;
    }
    Live l{i, nullptr, std::make_unique<kp::WholeKv>(kLayers, reqs[i].tokens, kHeads, kHeadDim)};
    l.killed_incarnation = p == kKilled && old_p1;
    const kvxfer_request_config_t rc = kp::by_id(static_cast<uint64_t>(i), kPageTokens);
    const int peer = peers.get(p);
    if (peer < 0 || kvxfer_recv(ep, peer, &l.kv->desc, &rc, &l.r) != KVXFER_SUCCESS) {
      // A post to the killed incarnation, after its death was seen.
      if (l.killed_incarnation) {
        check_coordinator(next + 1);  // this one is counted here, not posted
        const int64_t t = kp::mono_ns();
        ++rep.killed_err;
        if (t_kill > 0) rep.max_after_kill_s = std::max(rep.max_after_kill_s, (t - t_kill) * 1e-9);
        continue;
      }
      std::fprintf(stderr, "%s: decode %d: posting %d: %s\n", kTool, me, i,
                   kvxfer_get_last_error());
      ++rep.other_fail;
      continue;
    }
    live.push_back(std::move(l));
  }
  while (!live.empty()) finish_oldest();
  send_msg(wr, 'D', &rep, sizeof rep);
  send_msg(wr, 'T', times.data(), static_cast<uint32_t>(times.size() * sizeof(ReqTimes)));
  (void)read_msg(rd, &k, &body, 600000);  // the coordinator's end
  kvxfer_comm_destroy(ep);
  return 0;
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * v.size()))];
}

}  // namespace

static int run(int argc, char** argv) {
  // Its processes outnumber the CPUs (the defaults: 7 on any machine), and
  // each decode checks every request with kvxfer_page_encode/decode, whose
  // OpenMP teams spin after each call under libgomp's default wait policy:
  // with it, 41-61% of a run's CPU samples were that spinning, and the
  // aggregate halved (docs/PERFORMANCE.md, "mesh_perf").  libgomp reads the
  // policy once, at load, so it is set here and the program run again.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    ::execv("/proc/self/exe", argv);
    std::fprintf(stderr, "%s: running again with OMP_WAIT_POLICY=PASSIVE failed (%s)\n", kTool,
                 std::strerror(errno));
  }
  Options o;
  CLI::App app{
      "mesh_perf: prefill and decode endpoints meeting at run time, with a prefill "
      "killed and restarted and a decode reconnecting (docs/PERFORMANCE.md)"};
  kp::add_common_options(&app, &o.common);
  app.add_option("-P,--prefill", o.prefill, "prefill processes")
      ->check(CLI::Range(3, 16))
      ->capture_default_str();
  app.add_option("-D,--decode", o.decode, "decode processes")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  app.add_option("-R,--requests", o.requests, "requests (1 to 16 MiB each)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("-W,--window", o.window, "requests in flight per process")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--kill_at", o.kill_at, "completed requests before prefill 1 is killed")
      ->capture_default_str();
  app.add_option("--disconnect_at", o.disconnect_at,
                 "decode 0's completions before it disconnects from prefill 2")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "the request list's seed")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (o.common.quick) {  // smaller defaults; what the command line set stays
    if (app.count("--requests") == 0) o.requests = std::min(o.requests, 96);
    if (app.count("--kill_at") == 0) o.kill_at = std::min(o.kill_at, 30);
    if (app.count("--disconnect_at") == 0) o.disconnect_at = std::min(o.disconnect_at, 15);
  }
  if (o.kill_at < 0 || o.kill_at >= o.requests || o.disconnect_at < 0 ||
      o.disconnect_at >= o.requests) {
    std::fprintf(stderr, "%s: --kill_at %d and --disconnect_at %d must be in [0, -R %d)\n", kTool,
                 o.kill_at, o.disconnect_at, o.requests);
    return 2;
  }
  // A fixed port for prefill 1, so that its restart is at the same address.
  const int port = restart_port();
  if (port == 0) {
    std::fprintf(stderr, "%s: no free port below the ephemeral range for prefill 1\n", kTool);
    return 2;
  }

  const int nproc = o.prefill + o.decode;
  struct Proc {
    std::unique_ptr<kp::ForkedChild> child;
    int to = -1, from = -1;
  };
  std::vector<Proc> procs(static_cast<size_t>(nproc + 1));  // the last: prefill 1 restarted
  for (int i = 0; i <= nproc; ++i) {
    int down[2], up[2];
    if (::pipe(down) != 0 || ::pipe(up) != 0) return 2;
    procs[i].child = std::make_unique<kp::ForkedChild>();
    std::string err;
    const bool ok = procs[i].child->start(
        [&o, i, down, up, port, nproc]() -> int {
          ::close(down[1]);
          ::close(up[0]);
          if (i == nproc) return prefill_main(o, kKilled, port, true, down[0], up[1]);
          if (i < o.prefill)
            return prefill_main(o, i, i == kKilled ? port : 0, false, down[0], up[1]);
          return decode_main(o, i - o.prefill, down[0], up[1]);
        },
        &err);
    if (!ok) {
      std::fprintf(stderr, "%s: %s\n", kTool, err.c_str());
      return 2;
    }
    ::close(down[0]);
    ::close(up[1]);
    procs[i].to = down[1];
    procs[i].from = up[0];
  }
  kp::print_preamble(stdout, kTool, kp::machine_info(), kp::kvxfer_settings());
  std::printf("# Options: -P %d -D %d -R %d -W %d --kill_at %d --disconnect_at %d --seed %" PRIu64
              " | Lynx 4+4, 1-16 MiB per request, by id, lazy connects | OMP_WAIT_POLICY=%s\n",
              o.prefill, o.decode, o.requests, o.window, o.kill_at, o.disconnect_at, o.seed,
              std::getenv("OMP_WAIT_POLICY"));
  std::vector<uint8_t> all;
  char k;
  std::vector<uint8_t> body;
  for (int i = 0; i < nproc; ++i) {
    if (!read_msg(procs[i].from, &k, &body, 60000) || k != 'B') {
      std::fprintf(stderr, "%s: process %d did not start (%s)\n", kTool, i,
                   procs[i].child->describe().c_str());
      return 2;
    }
    const uint32_t n = static_cast<uint32_t>(body.size());
    all.insert(all.end(), reinterpret_cast<const uint8_t*>(&n),
               reinterpret_cast<const uint8_t*>(&n) + 4);
    all.insert(all.end(), body.begin(), body.end());
  }
  const int64_t t0 = kp::mono_ns();
  for (int i = 0; i < nproc; ++i) send_msg(procs[i].to, 'A', all.data(), all.size());

  // Count completions; at --kill_at, ask prefill 1 for a send in flight
  // ('W'), then kill and restart it.
  int done = 0, decodes_done = 0;
  bool asked = false, killed = false, killed_in_flight = false;
  int64_t t_kill = 0;
  std::vector<DecodeReport> reports;
  std::vector<ReqTimes> times;
  while (decodes_done < o.decode) {
    std::vector<pollfd> fds;
    for (int d = 0; d < o.decode; ++d) fds.push_back({procs[o.prefill + d].from, POLLIN, 0});
    if (asked && !killed) fds.push_back({procs[kKilled].from, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), 1000) <= 0) {
      for (int i = 0; i < nproc; ++i)
        if (!procs[i].child->alive() && !(killed && i == kKilled)) {
          std::fprintf(stderr, "%s: process %d ended early: %s\n", kTool, i,
                       procs[i].child->describe().c_str());
          return 1;
        }
      continue;
    }
    bool kill_now = false;
    for (size_t d = 0; d < fds.size(); ++d) {
      if ((fds[d].revents & (POLLIN | POLLHUP)) == 0) continue;
      if (!read_msg(fds[d].fd, &k, &body, 60000)) return 1;
      if (d == static_cast<size_t>(o.decode)) {  // prefill 1's answer
        kill_now = k == 'F' || k == 'E';
        killed_in_flight = k == 'F';
        continue;
      }
      if (k == 'C') ++done;
      if (k == 'D') {
        DecodeReport r;
        std::memcpy(&r, body.data(), sizeof r);
        reports.push_back(r);
      }
      if (k == 'T') {  // a decode's last message
        const size_t at = times.size();
        times.resize(at + body.size() / sizeof(ReqTimes));
        std::memcpy(times.data() + at, body.data(), (times.size() - at) * sizeof(ReqTimes));
        ++decodes_done;
      }
    }
    if (!asked && done >= o.kill_at) {
      asked = true;
      if (!send_msg(procs[kKilled].to, 'W', nullptr, 0)) return 1;
    }
    if (kill_now && !killed) {
      killed = true;
      procs[kKilled].child->kill();
      t_kill = kp::mono_ns();
      Proc& again = procs[nproc];
      send_msg(again.to, 'S', nullptr, 0);
      if (!read_msg(again.from, &k, &body, 60000) || k != 'B') return 1;
      std::vector<uint8_t> r(8);
      std::memcpy(r.data(), &t_kill, 8);
      r.insert(r.end(), body.begin(), body.end());
      // Each decode answers with the first index it has neither posted nor
      // counted as the killed incarnation's; K is the largest.  The
      // decodes' completions may come first on the same pipe.
      int32_t cut = 0;
      for (int d = 0; d < o.decode; ++d) {
        const int fd = procs[o.prefill + d].from;
        send_msg(procs[o.prefill + d].to, 'R', r.data(), static_cast<uint32_t>(r.size()));
        for (;;) {
          if (!read_msg(fd, &k, &body, 60000)) return 1;
          if (k == 'C') ++done;
          if (k == 'N') break;
        }
        int32_t n;
        std::memcpy(&n, body.data(), 4);
        cut = std::max(cut, n);
      }
      for (int d = 0; d < o.decode; ++d) send_msg(procs[o.prefill + d].to, 'K', &cut, 4);
      std::vector<uint8_t> a2 = all;  // the restarted one needs everyone's addresses
      send_msg(again.to, 'A', a2.data(), a2.size());
      send_msg(again.to, 'K', &cut, 4);
    }
  }
  const double wall_s = (kp::mono_ns() - t0) * 1e-9;
  for (int i = 0; i <= nproc; ++i)
    if (!(i == kKilled)) send_msg(procs[i].to, 'Q', nullptr, 0);
  bool children_ok = true;
  for (int i = 0; i <= nproc; ++i) {
    if (i == kKilled) continue;
    if (!procs[i].child->wait_for(120) || !procs[i].child->exited_ok()) {
      std::fprintf(stderr, "%s: process %d: %s\n", kTool, i, procs[i].child->describe().c_str());
      children_ok = false;
    }
  }
  std::vector<double> anchors, completes;  // of the completed requests, ms from the post
  for (const ReqTimes& q : times)
    if (q.status == 0) {
      anchors.push_back((q.t_anchor - q.t_posted) * 1e-6);
      completes.push_back((q.t_complete - q.t_posted) * 1e-6);
    }
  DecodeReport t;
  for (const DecodeReport& r : reports) {
    t.ok += r.ok;
    t.killed_err += r.killed_err;
    t.killed_late += r.killed_late;
    t.skipped += r.skipped;
    t.other_fail += r.other_fail;
    t.wrong += r.wrong;
    t.bytes += r.bytes;
    t.max_after_kill_s = std::max(t.max_after_kill_s, r.max_after_kill_s);
  }
  std::printf("#%8s  %8s  %9s  %10s  %9s  %9s  %9s  %9s  %9s  %9s  %7s  %6s\n", "requests",
              "complete", "killed_E", "max_kill_s", "not_post", "failed", "anc_p50", "anc_p99",
              "cmp_p50", "cmp_p99", "GB/s", "#wrong");
  std::printf(" %8d  %8d  %9d  %10.3f  %9d  %9d  %9.1f  %9.1f  %9.1f  %9.1f  %7.2f  %6" PRIu64 "\n",
              o.requests, t.ok, t.killed_err, t.max_after_kill_s, t.skipped, t.other_fail,
              pct(anchors, 50), pct(anchors, 99), pct(completes, 50), pct(completes, 99),
              t.bytes / wall_s * 1e-9, t.wrong);
  const bool pass = t.wrong == 0 && t.other_fail == 0 && t.killed_late == 0 && children_ok &&
                    t.ok + t.killed_err + t.skipped == o.requests;
  std::printf("# prefill 1 was %s\n",
              !killed            ? "never killed (fewer completions than --kill_at)"
              : killed_in_flight ? "killed while stopped with a matched send under half sent"
                                 : "killed with no send left to post");
  std::printf(
      "# anc/cmp: t_anchor / t_complete from the receive's post (ms).  killed_E: requests "
      "of the killed incarnation ended in ERROR (max_kill_s after the kill); not_post: "
      "its requests no decode had posted.  %s\n",
      pass ? "PASS" : "FAIL");
  nlohmann::json j = {{"tool", kTool},
                      {"complete", t.ok},
                      {"killed_error", t.killed_err},
                      {"killed_with_sends_in_flight", killed_in_flight},
                      {"max_after_kill_s", t.max_after_kill_s},
                      {"not_posted", t.skipped},
                      {"failed", t.other_fail},
                      {"anchor_p50_ms", pct(anchors, 50)},
                      {"anchor_p99_ms", pct(anchors, 99)},
                      {"complete_p50_ms", pct(completes, 50)},
                      {"complete_p99_ms", pct(completes, 99)},
                      {"gbps", t.bytes / wall_s * 1e-9},
                      {"wrong", t.wrong},
                      {"pass", pass},
                      {"t_kill_ms", killed ? json_ms(t_kill - t0) : nlohmann::json(nullptr)}};
  // Every finished receive, in start order: times in ms from the run's
  // start (the addresses' broadcast), null where not reached.
  std::sort(times.begin(), times.end(),
            [](const ReqTimes& a, const ReqTimes& b) { return a.t_posted < b.t_posted; });
  nlohmann::json rows = nlohmann::json::array();
  for (const ReqTimes& q : times)
    rows.push_back({{"index", q.i},
                    {"prefill", q.p},
                    {"decode", q.d},
                    {"result", q.status == 0   ? "complete"
                               : q.status == 1 ? "killed"
                                               : "failed"},
                    {"kv_bytes", q.kv_bytes},
                    {"t_posted_ms", json_ms(q.t_posted - t0, q.t_posted)},
                    {"t_handshake_ms", json_ms(q.t_handshake - t0, q.t_handshake)},
                    {"t_anchor_ms", json_ms(q.t_anchor - t0, q.t_anchor)},
                    {"t_complete_ms", json_ms(q.t_complete - t0, q.t_complete)},
                    {"t_error_ms", json_ms(q.t_error - t0, q.t_error)}});
  j["requests"] = rows;
  const int je = kp::emit_json(kTool, o.common.json_path, j);
  return pass ? je : 1;
}

int main(int argc, char** argv) {
  return kp::guarded_main(kTool, [&] { return run(argc, argv); });
}
