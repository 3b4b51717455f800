// ShmLockWatch (shm_reaper.h).
#include "transport/shm_reaper.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <thread>

#include "common/log.h"
#include "transport/smr_region.h"

namespace kvxfer::transport {
namespace {

constexpr size_t kMapBytes = 4096;
constexpr auto kLookEvery = std::chrono::milliseconds(20);
constexpr int kStuckLooks = 3;

struct Watched {
  int pidfd = -1;
  uint32_t peer_pid = 0;
  std::vector<std::string> files;
  std::vector<void*> pages;
  const std::atomic<uint64_t>* epoch = nullptr;
  uint64_t last_epoch = 0;
  std::vector<int> held;  // per page: consecutive looks that found its lock held
  std::chrono::milliseconds stall{0};
  std::chrono::steady_clock::time_point moved;  // when the epoch last changed
};

// Leaked on purpose: the watcher thread may outlive static destruction.
struct Registry {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Watched> links;
  uint64_t next_id = 1;
  pid_t thread_pid = 0;  // the process whose watcher runs (a fork has none)
  std::atomic<uint64_t> released{0};
};
Registry& registry() {
  static Registry* r = [] {
    auto* n = new Registry;
    // A fork while the watcher holds the mutex would leave it held in the
    // child for good: hold it across fork(), release it on both sides.  The
    // child also starts the condition variable afresh: the parent's watcher
    // may be waiting on it, and glibc's copy in the child counts that waiter
    // for good, so a notify_all there waited for it forever
    // (ofiPath.AChildForkedDuringAWatchEndsItsOwnWatch).  Not destroyed
    // first: destroying a variable with waiters is undefined.
    pthread_atfork([] { registry().mu.lock(); }, [] { registry().mu.unlock(); },
                   [] {
                     Registry& r = registry();
                     new (&r.cv) std::condition_variable;
                     r.mu.unlock();
                   });
    return n;
  }();
  return *r;
}

bool peer_exited(int pidfd) {
  pollfd f{pidfd, POLLIN, 0};
  return ::poll(&f, 1, 0) > 0;
}

void look(Watched* w, Registry* r) {
  const auto now = std::chrono::steady_clock::now();
  const uint64_t e = w->epoch->load(std::memory_order_relaxed);
  const bool moved = e != w->last_epoch;
  if (moved) {
    w->last_epoch = e;
    w->moved = now;
  }
  const bool exited = !moved && peer_exited(w->pidfd);
  // A live peer stopped inside its section (SIGSTOP, a debugger) holds the
  // lock as long as it likes; past the link's timeout it counts as dead.
  const bool stalled = !moved && !exited && now - w->moved >= w->stall;
  for (size_t i = 0; i < w->pages.size(); ++i) {
    auto* lock =
        reinterpret_cast<pthread_spinlock_t*>(static_cast<char*>(w->pages[i]) + smr::kLockOffset);
    const int v = __atomic_load_n(reinterpret_cast<volatile int*>(lock), __ATOMIC_ACQUIRE);
    // Held (glibc's unlocked value is 1) on every look for kStuckLooks: no
    // live section lasts that long.
    w->held[i] = (exited || stalled) && v != 1 ? w->held[i] + 1 : 0;
    if (w->held[i] < kStuckLooks) continue;
    w->held[i] = 0;
    pthread_spin_unlock(lock);
    r->released.fetch_add(1);
    KVXFER_WARN(LOG_NET,
                "OFI : released the shm region lock of %s, left held by the %s peer pid %u "
                "(libfabric 1.17 shm)",
                w->files[i].c_str(), exited ? "exited" : "stalled", w->peer_pid);
  }
}

void watcher_main() {
  pthread_setname_np(pthread_self(), "kvxfer-shm-watch");
  Registry& r = registry();
  std::unique_lock<std::mutex> lk(r.mu);
  while (!r.links.empty()) {
    for (auto& kv : r.links) look(&kv.second, &r);
    r.cv.wait_for(lk, kLookEvery);
  }
  r.thread_pid = 0;
}

}  // namespace

std::unique_ptr<ShmLockWatch> ShmLockWatch::start(int pidfd, uint32_t peer_pid,
                                                  const std::vector<std::string>& files,
                                                  const std::atomic<uint64_t>* epoch,
                                                  int64_t stall_ms) {
  if (pidfd < 0 || epoch == nullptr) return nullptr;
  Watched w;
  w.stall = std::chrono::milliseconds(stall_ms);
  w.moved = std::chrono::steady_clock::now();
  w.pidfd = pidfd;
  w.peer_pid = peer_pid;
  w.files = files;
  w.epoch = epoch;
  w.last_epoch = epoch->load();
  for (const std::string& f : files) {
    void* p = MAP_FAILED;
    const int fd = ::open(f.c_str(), O_RDWR | O_CLOEXEC);
    if (fd >= 0) {
      p = ::mmap(nullptr, kMapBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      ::close(fd);
    }
    if (p == MAP_FAILED || *static_cast<const uint8_t*>(p) != smr::kVersion) {
      KVXFER_INFO(LOG_NET, "OFI : shm region %s %s; no recovery of locks a killed peer holds",
                  f.c_str(), p == MAP_FAILED ? "cannot be mapped" : "has another layout");
      if (p != MAP_FAILED) ::munmap(p, kMapBytes);
      for (void* q : w.pages) ::munmap(q, kMapBytes);
      return nullptr;
    }
    w.pages.push_back(p);
  }
  w.held.assign(w.pages.size(), 0);
  std::unique_ptr<ShmLockWatch> h(new ShmLockWatch());
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  h->id_ = r.next_id++;
  if (r.thread_pid != getpid()) {  // none yet, or inherited from before a fork
    r.links.clear();               // a parent's entries; its pages are ours to leak
    r.thread_pid = getpid();
    r.links.emplace(h->id_, std::move(w));
    std::thread(watcher_main).detach();
  } else {
    r.links.emplace(h->id_, std::move(w));
  }
  return h;
}

ShmLockWatch::~ShmLockWatch() {
  Registry& r = registry();
  std::vector<void*> pages;
  {
    std::lock_guard<std::mutex> lk(r.mu);
    auto it = r.links.find(id_);
    if (it == r.links.end()) return;
    pages = std::move(it->second.pages);
    r.links.erase(it);
  }
  r.cv.notify_all();
  for (void* p : pages) ::munmap(p, kMapBytes);
}

uint64_t ShmLockWatch::released() { return registry().released.load(); }

}  // namespace kvxfer::transport
