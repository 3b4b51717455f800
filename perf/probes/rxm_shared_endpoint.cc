// What one peer costs on a shared libfabric RDM endpoint (tcp;ofi_rxm), the
// design the serving-topology issue asks for (docs/TRANSPORT.md, "Endpoints").
// Not built by CMake: a probe of libfabric itself, run by hand.
//
//   g++ -O1 -o /tmp/rxm_shared_endpoint perf/probes/rxm_shared_endpoint.cc -lfabric
//   export FI_OFI_RXM_MSG_RX_SIZE=16 FI_OFI_RXM_BUFFER_SIZE=4096
//   export FI_OFI_RXM_EAGER_LIMIT=16384 FI_UNIVERSE_SIZE=16
//   /tmp/rxm_shared_endpoint 32
//
// (the values kvxfer sets when the user has not: src/transport/ofi.cc,
// apply_provider_memory_defaults.)
//
// This process opens one RDM endpoint; N forked peers each open their own,
// insert its address, send it their name and wait for a reply.  It prints its
// VmRSS and open fds before the endpoint, with it, with the N peers
// connected, after fi_av_remove of every peer, and after the peers exit.
// fi_av_remove closes a peer's connection only with FI_AV_REMOVE_CLEANUP=1.
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
    hints->caps = FI_TAGGED | FI_MSG;
    hints->ep_attr->type = FI_EP_RDM;
    hints->fabric_attr->prov_name = strdup("tcp;ofi_rxm");
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
int kStallMsgs = 64;                   // --stall N BYTES MSGS
size_t kStallBytes = size_t{1} << 20;  // --stall N BYTES; 1 MiB: past the eager limit

double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

[[noreturn]] void run_peer(int i, const std::string& server, int stay_fd, bool stall) {
  Rdm c;
  c.open();
  fi_addr_t s;
  if (fi_av_insert(c.av, server.data(), 1, &s, 0, nullptr) != 1) std::exit(2);
  static fi_context2 send_ctx, recv_ctx;
  char reply[64];
  CHECK(fi_trecv(c.ep, reply, sizeof reply, nullptr, FI_ADDR_UNSPEC, kReplyTag, 0, &recv_ctx));
  while (fi_tsend(c.ep, c.name, c.name_len, nullptr, s, kNameTag + i, &send_ctx) == -FI_EAGAIN)
    fi_cq_read(c.cq, nullptr, 0);
  if (stall) {  // the data's receives first, then the handshake
    static std::vector<char> buf(static_cast<size_t>(kStallMsgs) * kStallBytes);
    static std::vector<fi_context2> ctx(kStallMsgs);
    for (int k = 0; k < kStallMsgs; ++k)
      CHECK(fi_trecv(c.ep, buf.data() + k * kStallBytes, kStallBytes, nullptr, FI_ADDR_UNSPEC,
                     kDataTag, 0, &ctx[k]));
  }
  c.next();
  c.next();
  if (stall) {
    int got = 0;
    while (got < kStallMsgs) got += (c.next().flags & FI_RECV) != 0;
    std::exit(got == kStallMsgs ? 0 : 4);
  }
  char b;
  if (read(stay_fd, &b, 1) < 0) std::exit(3);  // until the server closes the pipe
  std::exit(0);
}

}  // namespace

// --stall N: see the header.
int stall_main(int n) {
  Rdm s;
  s.open();
  const std::string name(s.name, s.name_len);
  int stay[2];
  if (pipe(stay) != 0) return 1;
  std::vector<pid_t> peers;
  for (int i = 0; i < n; ++i) {
    const pid_t p = fork();
    if (p == 0) {
      close(stay[1]);
      run_peer(i, name, stay[0], true);
    }
    peers.push_back(p);
  }
  std::vector<std::vector<char>> names(n, std::vector<char>(256));
  std::vector<fi_context2> recv_ctx(n), send_ctx(n);
  std::vector<fi_addr_t> addr(n);
  static char hi[8] = "hi";
  for (int i = 0; i < n; ++i)
    CHECK(fi_trecv(s.ep, names[i].data(), 256, nullptr, FI_ADDR_UNSPEC, kNameTag + i, 0,
                   &recv_ctx[i]));
  for (int done = 0; done < 2 * n;) {
    const fi_cq_tagged_entry e = s.next();
    ++done;
    if ((e.flags & FI_RECV) == 0) continue;
    const int i = static_cast<int>(static_cast<fi_context2*>(e.op_context) - recv_ctx.data());
    if (fi_av_insert(s.av, names[i].data(), 1, &addr[i], 0, nullptr) != 1) return 4;
    while (fi_tsend(s.ep, hi, sizeof hi, nullptr, addr[i], kReplyTag, &send_ctx[i]) == -FI_EAGAIN)
      fi_cq_read(s.cq, nullptr, 0);
  }
  kill(peers[0], SIGSTOP);
  std::vector<char> data(kStallBytes, 'x');
  std::vector<fi_context2> ctx(static_cast<size_t>(n) * kStallMsgs);
  std::vector<int> posted(n, 0), completed(n, 0);
  std::vector<bool> gave_up(n, false);
  const double t0 = now_s();
  double live_done = 0;
  auto reap = [&] {
    fi_cq_tagged_entry e;
    while (fi_cq_read(s.cq, &e, 1) == 1) {
      const size_t k = static_cast<size_t>(static_cast<fi_context2*>(e.op_context) - ctx.data());
      if (k < ctx.size() && ++completed[k / kStallMsgs] == kStallMsgs && k / kStallMsgs != 0) {
        bool all = true;
        for (int i = 1; i < n; ++i) all = all && completed[i] == kStallMsgs;
        if (all) live_done = now_s() - t0;
      }
    }
  };
  for (int k = 0; k < kStallMsgs; ++k)
    for (int i = 0; i < n; ++i) {
      if (gave_up[i]) continue;
      const double since = now_s();
      fi_context2* c = &ctx[static_cast<size_t>(i) * kStallMsgs + k];
      ssize_t r;
      while ((r = fi_tsend(s.ep, data.data(), kStallBytes, nullptr, addr[i], kDataTag, c)) ==
             -FI_EAGAIN) {
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
    std::printf("peer %d%s: %d sends posted, %d completed within 5 s%s\n", i,
                i == 0 ? " (stopped)" : "", posted[i], completed[i],
                gave_up[i] ? " (gave up after 2 s of -FI_EAGAIN)" : "");
  std::printf("the live peers' %d messages of %zu bytes each: %s\n", kStallMsgs, kStallBytes,
              live_done > 0 ? (std::to_string(live_done) + " s after the first send").c_str()
                            : "not all completed");
  kill(peers[0], SIGCONT);
  const double t1 = now_s();
  while (completed[0] < posted[0] && now_s() - t1 < 10.0) reap();
  // Peer 0's receives beyond what was posted never complete: release it.
  for (int k = posted[0]; k < kStallMsgs; ++k) {
    fi_context2* c = &ctx[static_cast<size_t>(k)];
    while (fi_tsend(s.ep, data.data(), kStallBytes, nullptr, addr[0], kDataTag, c) == -FI_EAGAIN)
      reap();
  }
  while (completed[0] < kStallMsgs && now_s() - t1 < 20.0) reap();
  close(stay[1]);
  int ok = 0;
  for (pid_t p : peers) {
    int st = 0;
    waitpid(p, &st, 0);
    ok += WIFEXITED(st) && WEXITSTATUS(st) == 0;
  }
  std::printf("after SIGCONT: peer 0 completed %d of %d; %d of %d peers received all\n",
              completed[0], kStallMsgs, ok, n);
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 2 && std::strcmp(argv[1], "--stall") == 0) {
    if (argc > 3) kStallBytes = std::strtoull(argv[3], nullptr, 10);
    if (argc > 4) kStallMsgs = std::atoi(argv[4]);
    return stall_main(std::atoi(argv[2]));
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

  int stay[2];
  if (pipe(stay) != 0) return 1;
  const std::string name(s.name, s.name_len);
  std::vector<pid_t> peers;
  for (int i = 0; i < n; ++i) {
    const pid_t p = fork();
    if (p == 0) {
      close(stay[1]);
      run_peer(i, name, stay[0], false);
    }
    peers.push_back(p);
  }
  close(stay[0]);

  std::vector<std::vector<char>> names(n, std::vector<char>(256));
  std::vector<fi_context2> recv_ctx(n), send_ctx(n);
  std::vector<fi_addr_t> addr(n);
  static char hi[8] = "hi";
  for (int i = 0; i < n; ++i)
    CHECK(fi_trecv(s.ep, names[i].data(), 256, nullptr, FI_ADDR_UNSPEC, kNameTag + i, 0,
                   &recv_ctx[i]));
  for (int done = 0; done < 2 * n;) {
    const fi_cq_tagged_entry e = s.next();
    ++done;
    if ((e.flags & FI_RECV) == 0) continue;
    const int i = static_cast<int>(static_cast<fi_context2*>(e.op_context) - recv_ctx.data());
    if (fi_av_insert(s.av, names[i].data(), 1, &addr[i], 0, nullptr) != 1) return 4;
    while (fi_tsend(s.ep, hi, sizeof hi, nullptr, addr[i], kReplyTag, &send_ctx[i]) == -FI_EAGAIN)
      fi_cq_read(s.cq, nullptr, 0);
  }
  const long rss2 = rss_kb();
  const int fds2 = open_fds();
  std::printf("%d peers connected: VmRSS %ld kB, %d fds: %.1f kB and %.2f fds per peer\n", n, rss2,
              fds2, static_cast<double>(rss2 - rss1) / n, static_cast<double>(fds2 - fds1) / n);

  for (int i = 0; i < n; ++i) CHECK(fi_av_remove(s.av, &addr[i], 1, 0));
  s.progress(200);
  std::printf("after fi_av_remove of every peer: VmRSS %ld kB, %d fds\n", rss_kb(), open_fds());

  close(stay[1]);
  for (pid_t p : peers) waitpid(p, nullptr, 0);
  s.progress(200);
  std::printf("after the peers exit: VmRSS %ld kB, %d fds\n", rss_kb(), open_fds());
  return 0;
}
