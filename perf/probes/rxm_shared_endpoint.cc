// What one peer costs on a shared libfabric RDM endpoint (tcp;ofi_rxm), the
// design the serving-topology issue asks for (docs/TRANSPORT.md, "Endpoints").
// Not built by CMake: a probe of libfabric itself, run by hand.
//
//   g++ -O1 -o /tmp/rxm_shared_endpoint perf/probes/rxm_shared_endpoint.cc -lfabric
//   export FI_OFI_RXM_MSG_RX_SIZE=16 FI_OFI_RXM_BUFFER_SIZE=4096
//   export FI_OFI_RXM_EAGER_LIMIT=16384 FI_UNIVERSE_SIZE=16
//   /tmp/rxm_shared_endpoint 32
//
// (the values kvxfer set, when the user had not, when this was measured;
// it now sets FI_OFI_RXM_BUFFER_SIZE=1024: src/transport/ofi.cc,
// apply_provider_memory_defaults.)
//
// This process opens one RDM endpoint; N forked peers each open their own,
// insert its address, send it their name and wait for a reply.  It prints its
// VmRSS and open fds before the endpoint, with it, with the N peers
// connected, after fi_av_remove of every peer, and after the peers exit.
// fi_av_remove closes a peer's connection only with FI_AV_REMOVE_CLEANUP=1
// (rxm; net never does).
//
//   /tmp/rxm_shared_endpoint --stall N [BYTES [MSGS]]
//
// instead asks whether one stopped peer holds back the others on the shared
// endpoint.  Each peer posts MSGS (default 64, at most the provider's rx
// size) receives of BYTES (default 1 MiB); peer 0 is stopped (SIGSTOP)
// before any arrives.  This process then sends every peer its messages,
// round-robin, giving up on a peer after 2 s of -FI_EAGAIN, and prints per
// peer the sends posted and completed within 5 s, the time the live peers'
// last send completed, and, after SIGCONT, whether peer 0 got them all.
//
//   /tmp/rxm_shared_endpoint --depart N [BYTES [MSGS [discard]]]
//
// asks what a departed peer leaves behind: N peers each send MSGS messages
// of BYTES that this side never receives, and exit; with `discard`, each
// one's are then dropped (fi_trecvmsg FI_PEEK | FI_DISCARD on its address
// until FI_ENOMSG); all are removed from the address vector and a new peer
// joins.  It prints VmRSS, whether the new peer got a removed fi_addr_t, and
// how many departed messages a receive from the new peer's address, then
// from any address, still matches.
//
//   /tmp/rxm_shared_endpoint --cycle C
//
// asks what a live peer's removal and return cost: C times, both sides
// remove each other from their address vectors and insert each other again,
// and the peer sends one message to a receive directed at it.  It prints
// VmRSS, open fds and the peer's fi_addr_t after 1, 10, 100 and C cycles.
//
// PROBE_PROVIDER names another provider (default tcp;ofi_rxm), for example
// `net`; PROBE_DIRECTED=1 asks for FI_DIRECTED_RECV, without which `net`
// ignores a receive's source address.
#include <dirent.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#define CHECK(x)                                                                     \
  do {                                                                               \
    const int r_ = static_cast<int>(x);                                              \
    if (r_ != 0) {                                                                   \
      std::fprintf(stderr, "%s: %d (%s)\n", #x, r_, fi_strerror(r_ < 0 ? -r_ : r_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace {

long rss_kb() {
  FILE* f = std::fopen("/proc/self/status", "re");
  char line[256];
  long v = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::strncmp(line, "VmRSS:", 6) == 0) v = std::atol(line + 6);
  std::fclose(f);
  return v;
}

int open_fds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (readdir(d) != nullptr) ++n;
  closedir(d);
  return n - 3;  // ".", "..", the DIR's own fd
}

struct Rdm {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_av* av = nullptr;
  fid_cq* cq = nullptr;
  fid_ep* ep = nullptr;
  char name[256];
  size_t name_len = sizeof name;

  void open() {
    fi_info* hints = fi_allocinfo();
    const char* prov = std::getenv("PROBE_PROVIDER");
    const char* directed = std::getenv("PROBE_DIRECTED");
    hints->caps = FI_TAGGED | FI_MSG;
    if (directed != nullptr && std::strcmp(directed, "1") == 0) hints->caps |= FI_DIRECTED_RECV;
    hints->ep_attr->type = FI_EP_RDM;
    hints->fabric_attr->prov_name = strdup(prov != nullptr ? prov : "tcp;ofi_rxm");
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    CHECK(fi_getinfo(FI_VERSION(1, 17), "127.0.0.1", "0", FI_SOURCE, hints, &info));
    fi_freeinfo(hints);
    CHECK(fi_fabric(info->fabric_attr, &fabric, nullptr));
    CHECK(fi_domain(fabric, info, &domain, nullptr));
    fi_av_attr aa{};
    aa.type = FI_AV_TABLE;
    CHECK(fi_av_open(domain, &aa, &av, nullptr));
    fi_cq_attr ca{};
    ca.format = FI_CQ_FORMAT_TAGGED;
    ca.wait_obj = FI_WAIT_FD;  // as kvxfer's progress thread sleeps on it
    CHECK(fi_cq_open(domain, &ca, &cq, nullptr));
    CHECK(fi_endpoint(domain, info, &ep, nullptr));
    CHECK(fi_ep_bind(ep, &av->fid, 0));
    CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
    CHECK(fi_enable(ep));
    CHECK(fi_getname(&ep->fid, name, &name_len));
  }

  // Reads one completion; exits on an error completion.
  fi_cq_tagged_entry next() {
    fi_cq_tagged_entry e{};
    for (;;) {
      const ssize_t r = fi_cq_read(cq, &e, 1);
      if (r == 1) return e;
      if (r == -FI_EAVAIL) {
        fi_cq_err_entry err{};
        fi_cq_readerr(cq, &err, 0);
        std::fprintf(stderr, "completion error %d (%s)\n", err.err, fi_strerror(err.err));
        std::exit(1);
      }
    }
  }

  void progress(int rounds) {
    for (int i = 0; i < rounds; ++i) {
      fi_cq_tagged_entry e;
      fi_cq_read(cq, &e, 1);
      usleep(5000);
    }
  }
};

constexpr uint64_t kReplyTag = 7, kNameTag = 1000, kDataTag = 5000;
int g_msgs = 64;                   // --stall/--depart N BYTES MSGS
size_t g_bytes = size_t{1} << 20;  // 1 MiB: past the eager limit
bool g_discard = false;            // --depart N BYTES MSGS discard

double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// kIdle: waits; kReceive: takes g_msgs messages; kDepart: sends g_msgs
// messages of one byte value (its index + 1) that nobody receives, then exits;
// kCycle: for each byte the server writes, removes and inserts the server
// again and sends it one message.
enum class Mode { kIdle, kReceive, kDepart, kCycle };

[[noreturn]] void run_peer(int i, const std::string& server, int stay_fd, Mode mode) {
  Rdm c;
  c.open();
  fi_addr_t s;
  if (fi_av_insert(c.av, server.data(), 1, &s, 0, nullptr) != 1) std::exit(2);
  static fi_context2 send_ctx, recv_ctx;
  char reply[64];
  CHECK(fi_trecv(c.ep, reply, sizeof reply, nullptr, FI_ADDR_UNSPEC, kReplyTag, 0, &recv_ctx));
  static std::vector<char> buf;
  static std::vector<fi_context2> ctx(g_msgs);
  if (mode != Mode::kIdle)
    buf.assign(static_cast<size_t>(g_msgs) * g_bytes, static_cast<char>(i + 1));
  if (mode == Mode::kReceive)  // posted before the name, so before the server can stop us
    for (int k = 0; k < g_msgs; ++k)
      CHECK(fi_trecv(c.ep, buf.data() + k * g_bytes, g_bytes, nullptr, FI_ADDR_UNSPEC, kDataTag, 0,
                     &ctx[k]));
  while (fi_tsend(c.ep, c.name, c.name_len, nullptr, s, kNameTag + i, &send_ctx) == -FI_EAGAIN)
    fi_cq_read(c.cq, nullptr, 0);
  c.next();
  c.next();
  if (mode == Mode::kReceive) {
    int got = 0;
    while (got < g_msgs) got += (c.next().flags & FI_RECV) != 0;
    std::exit(0);
  }
  if (mode == Mode::kDepart) {  // a rendezvous send never completes: leave after 1 s
    for (int k = 0; k < g_msgs; ++k)
      while (fi_tsend(c.ep, buf.data() + k * g_bytes, g_bytes, nullptr, s, kDataTag, &ctx[k]) ==
             -FI_EAGAIN)
        fi_cq_read(c.cq, nullptr, 0);
    const double t = now_s();
    fi_cq_tagged_entry e;
    while (now_s() - t < 1.0) fi_cq_read(c.cq, &e, 1);
    std::exit(0);
  }
  char b;
  if (mode == Mode::kCycle) {
    uint64_t v = 0;
    while (read(stay_fd, &b, 1) == 1) {
      CHECK(fi_av_remove(c.av, &s, 1, 0));
      if (fi_av_insert(c.av, server.data(), 1, &s, 0, nullptr) != 1) std::exit(2);
      ++v;
      while (fi_tsend(c.ep, &v, sizeof v, nullptr, s, kDataTag, &send_ctx) == -FI_EAGAIN)
        fi_cq_read(c.cq, nullptr, 0);
      c.next();
    }
    std::exit(0);
  }
  if (read(stay_fd, &b, 1) < 0) std::exit(3);  // until the server closes the pipe
  std::exit(0);
}

// Forks n peers, receives their names, inserts them and answers each.
struct Started {
  std::vector<pid_t> pids;
  std::vector<fi_addr_t> addr;
  std::vector<std::vector<char>> names;  // by peer, as addr
  int stay = -1;                         // closing it lets idle peers exit
};
Started start_peers(Rdm& s, int n, Mode mode, int first_index = 0) {
  Started st;
  int stay[2];
  if (pipe(stay) != 0) std::exit(1);
  const std::string name(s.name, s.name_len);
  std::fflush(stdout);  // else the children print it again
  for (int i = 0; i < n; ++i) {
    const pid_t p = fork();
    if (p == 0) {
      close(stay[1]);
      run_peer(first_index + i, name, stay[0], mode);
    }
    st.pids.push_back(p);
  }
  close(stay[0]);
  st.stay = stay[1];
  std::vector<std::vector<char>>& names = st.names;  // kept: --cycle inserts them again
  names.assign(n, std::vector<char>(256));
  std::vector<fi_context2> recv_ctx(n), send_ctx(n);
  st.addr.resize(n);
  static char hi[8] = "hi";
  for (int i = 0; i < n; ++i)
    CHECK(fi_trecv(s.ep, names[i].data(), 256, nullptr, FI_ADDR_UNSPEC, kNameTag + first_index + i,
                   0, &recv_ctx[i]));
  for (int done = 0; done < 2 * n;) {
    const fi_cq_tagged_entry e = s.next();
    if (e.op_context == nullptr) continue;  // not one of these
    ++done;
    if ((e.flags & FI_RECV) == 0) continue;
    const int i = static_cast<int>(static_cast<fi_context2*>(e.op_context) - recv_ctx.data());
    if (fi_av_insert(s.av, names[i].data(), 1, &st.addr[i], 0, nullptr) != 1) std::exit(4);
    while (fi_tsend(s.ep, hi, sizeof hi, nullptr, st.addr[i], kReplyTag, &send_ctx[i]) ==
           -FI_EAGAIN)
      fi_cq_read(s.cq, nullptr, 0);
  }
  return st;
}

int wait_all(const std::vector<pid_t>& pids) {
  int ok = 0;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    ok += WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  return ok;
}

}  // namespace

// --stall N: see the header.
int stall_main(int n) {
  Rdm s;
  s.open();
  Started st = start_peers(s, n, Mode::kReceive);
  kill(st.pids[0], SIGSTOP);
  std::vector<char> data(g_bytes, 'x');
  std::vector<fi_context2> ctx(static_cast<size_t>(n) * g_msgs);
  std::vector<int> posted(n, 0), completed(n, 0);
  std::vector<long> eagain(n, 0);  // -FI_EAGAIN returns of fi_tsend
  std::vector<bool> gave_up(n, false);
  const double t0 = now_s();
  double live_done = 0;
  auto reap = [&] {
    fi_cq_tagged_entry e;
    while (fi_cq_read(s.cq, &e, 1) == 1) {
      const size_t k = static_cast<size_t>(static_cast<fi_context2*>(e.op_context) - ctx.data());
      if (k < ctx.size() && ++completed[k / g_msgs] == g_msgs && k / g_msgs != 0) {
        bool all = true;
        for (int i = 1; i < n; ++i) all = all && completed[i] == g_msgs;
        if (all) live_done = now_s() - t0;
      }
    }
  };
  for (int k = 0; k < g_msgs; ++k)
    for (int i = 0; i < n; ++i) {
      if (gave_up[i]) continue;
      const double since = now_s();
      fi_context2* c = &ctx[static_cast<size_t>(i) * g_msgs + k];
      ssize_t r;
      while ((r = fi_tsend(s.ep, data.data(), g_bytes, nullptr, st.addr[i], kDataTag, c)) ==
             -FI_EAGAIN) {
        ++eagain[i];
        reap();
        if (now_s() - since > 2.0) break;
      }
      if (r == 0)
        ++posted[i];
      else
        gave_up[i] = true;
    }
  while (now_s() - t0 < 5.0) reap();
  for (int i = 0; i < n; ++i)
    std::printf("peer %d%s: %d sends posted (%ld -FI_EAGAIN), %d completed within 5 s%s\n", i,
                i == 0 ? " (stopped)" : "", posted[i], eagain[i], completed[i],
                gave_up[i] ? " (gave up after 2 s of -FI_EAGAIN)" : "");
  std::printf("the live peers' %d messages of %zu bytes each: %s\n", g_msgs, g_bytes,
              live_done > 0 ? (std::to_string(live_done) + " s after the first send").c_str()
                            : "not all completed");
  kill(st.pids[0], SIGCONT);
  const double t1 = now_s();
  while (completed[0] < posted[0] && now_s() - t1 < 10.0) reap();
  // Peer 0's receives beyond what was posted never complete: release it.
  for (int k = posted[0]; k < g_msgs; ++k)
    while (fi_tsend(s.ep, data.data(), g_bytes, nullptr, st.addr[0], kDataTag, &ctx[k]) ==
           -FI_EAGAIN)
      reap();
  while (completed[0] < g_msgs && now_s() - t1 < 20.0) reap();
  close(st.stay);
  const int ok = wait_all(st.pids);
  std::printf("after SIGCONT: peer 0 completed %d of %d; %d of %d peers received all\n",
              completed[0], g_msgs, ok, n);
  return 0;
}

// --depart N: see the header.
int depart_main(int n) {
  Rdm s;
  s.open();
  const long rss0 = rss_kb();
  Started st = start_peers(s, n, Mode::kDepart);
  const double t0 = now_s();
  while (now_s() - t0 < 1.0) s.progress(1);  // their messages land, unexpected
  const int ok = wait_all(st.pids);
  s.progress(100);
  const long rss1 = rss_kb();
  int discarded = 0;
  // Each departed peer's unexpected messages, any tag.  A peek that finds
  // nothing is tried again after some progress, three times: net reads the
  // next message's header only after the discard of a large one.
  if (g_discard)
    for (fi_addr_t a : st.addr)
      for (int misses = 0; misses < 3;) {
        fi_context2 c{};
        fi_msg_tagged m{};
        m.addr = a;
        m.ignore = ~uint64_t{0};
        m.context = &c;
        CHECK(fi_trecvmsg(s.ep, &m, FI_PEEK | FI_DISCARD));
        fi_cq_tagged_entry e{};
        ssize_t r;
        while ((r = fi_cq_read(s.cq, &e, 1)) == -FI_EAGAIN) {
        }
        if (r != 1) {  // FI_ENOMSG: none found
          fi_cq_err_entry err{};
          fi_cq_readerr(s.cq, &err, 0);
          ++misses;
          s.progress(4);  // nothing of ours is posted: reads nothing of ours
          continue;
        }
        misses = 0;
        ++discarded;
      }
  for (fi_addr_t& a : st.addr) CHECK(fi_av_remove(s.av, &a, 1, 0));
  s.progress(100);
  const long rss2 = rss_kb();
  std::printf(
      "%d peers sent %d x %zu bytes unreceived and exited (%d exited 0): VmRSS %ld -> "
      "%ld kB; %d discarded (FI_PEEK | FI_DISCARD); after fi_av_remove of all: %ld kB, %d fds\n",
      n, g_msgs, g_bytes, ok, rss0, rss1, discarded, rss2, open_fds());
  Started late = start_peers(s, 1, Mode::kIdle, n);
  bool reused = false;
  for (fi_addr_t a : st.addr) reused = reused || a == late.addr[0];
  std::vector<char> buf(g_bytes);
  std::vector<fi_context2> ctx(2);
  int stale[2] = {0, 0}, errored[2] = {0, 0};
  const fi_addr_t from[2] = {late.addr[0], FI_ADDR_UNSPEC};
  for (int w = 0; w < 2; ++w) {
    std::printf("posting receives of the departed peers' tag from %s ...\n",
                w == 0 ? "the new peer's address" : "any address");
    std::fflush(stdout);
    // One receive at a time: a completion (or an error completion) is a
    // departed message matched; none within 0.5 s ends the count, and the
    // receive is cancelled and its FI_ECANCELED entry read.
    for (bool waiting = false;;) {
      if (!waiting)
        CHECK(fi_trecv(s.ep, buf.data(), g_bytes, nullptr, from[w], kDataTag, 0, &ctx[w]));
      fi_cq_tagged_entry e{};
      fi_cq_err_entry err{};
      const double t = now_s();
      ssize_t r = 0;
      while ((r = fi_cq_read(s.cq, &e, 1)) == -FI_EAGAIN && now_s() - t < 0.5) {
      }
      if (r == -FI_EAVAIL) fi_cq_readerr(s.cq, &err, 0);
      if (r == 1) ++stale[w];
      if (r == -FI_EAVAIL && err.err != FI_ECANCELED) ++errored[w];
      if (waiting && r != -FI_EAGAIN) break;  // the cancelled receive's end
      if (r == -FI_EAGAIN) {
        if (waiting) break;
        fi_cancel(&s.ep->fid, &ctx[w]);
        waiting = true;
      }
    }
    std::printf("  %d matched, %d more with an error completion\n", stale[w], errored[w]);
    std::fflush(stdout);
  }
  std::printf(
      "the new peer has fi_addr_t %llu (%s a removed peer's); departed peers' messages "
      "matched by a receive from it: %d, from any address: %d (of %d sent)\n",
      static_cast<unsigned long long>(late.addr[0]), reused ? "reusing" : "not", stale[0], stale[1],
      n * g_msgs);
  close(late.stay);
  wait_all(late.pids);
  return 0;
}

// --cycle C: see the header.
int cycle_main(int cycles) {
  Rdm s;
  s.open();
  Started st = start_peers(s, 1, Mode::kCycle);
  std::printf("one peer connected: VmRSS %ld kB, %d fds\n", rss_kb(), open_fds());
  for (int c = 1; c <= cycles; ++c) {
    CHECK(fi_av_remove(s.av, &st.addr[0], 1, 0));
    if (fi_av_insert(s.av, st.names[0].data(), 1, &st.addr[0], 0, nullptr) != 1) return 4;
    static fi_context2 ctx;
    uint64_t v = 0;
    CHECK(fi_trecv(s.ep, &v, sizeof v, nullptr, st.addr[0], kDataTag, 0, &ctx));
    if (write(st.stay, "c", 1) != 1) return 5;
    while (s.next().op_context != &ctx) {
    }
    if (v != static_cast<uint64_t>(c))
      std::printf("cycle %d: got message %llu\n", c, static_cast<unsigned long long>(v));
    if (c == 1 || c == 10 || c == 100 || c == cycles)
      std::printf("after %d remove/insert cycles: VmRSS %ld kB, %d fds, peer at fi_addr_t %llu\n",
                  c, rss_kb(), open_fds(), static_cast<unsigned long long>(st.addr[0]));
  }
  close(st.stay);
  wait_all(st.pids);
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 2 && std::strcmp(argv[1], "--cycle") == 0) return cycle_main(std::atoi(argv[2]));
  if (argc > 2 && (std::strcmp(argv[1], "--stall") == 0 || std::strcmp(argv[1], "--depart") == 0)) {
    if (argc > 3) g_bytes = std::strtoull(argv[3], nullptr, 10);
    if (argc > 4) g_msgs = std::atoi(argv[4]);
    g_discard = argc > 5 && std::strcmp(argv[5], "discard") == 0;
    return argv[1][2] == 's' ? stall_main(std::atoi(argv[2])) : depart_main(std::atoi(argv[2]));
  }
  const int n = argc > 1 ? std::atoi(argv[1]) : 32;
  const long rss0 = rss_kb();
  const int fds0 = open_fds();
  Rdm s;
  s.open();
  const long rss1 = rss_kb();
  const int fds1 = open_fds();
  std::printf("no endpoint: VmRSS %ld kB, %d fds; one endpoint: %ld kB, %d fds\n", rss0, fds0, rss1,
              fds1);
  std::fflush(stdout);
  Started st = start_peers(s, n, Mode::kIdle);
  const long rss2 = rss_kb();
  const int fds2 = open_fds();
  std::printf("%d peers connected: VmRSS %ld kB, %d fds: %.1f kB and %.2f fds per peer\n", n, rss2,
              fds2, static_cast<double>(rss2 - rss1) / n, static_cast<double>(fds2 - fds1) / n);

  for (int i = 0; i < n; ++i) CHECK(fi_av_remove(s.av, &st.addr[i], 1, 0));
  s.progress(200);
  std::printf("after fi_av_remove of every peer: VmRSS %ld kB, %d fds\n", rss_kb(), open_fds());

  close(st.stay);
  wait_all(st.pids);
  s.progress(200);
  std::printf("after the peers exit: VmRSS %ld kB, %d fds\n", rss_kb(), open_fds());
  return 0;
}
