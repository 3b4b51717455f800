#include "transport/crash_signals.h"

#include <dlfcn.h>
#include <signal.h>

#include <cstring>

namespace kvxfer::transport {
namespace {

/** True when `fn` lies in a library that installs crash handlers on load. */
bool foreign_crash_handler(void* fn) {
  Dl_info info{};
  if (fn == nullptr || dladdr(fn, &info) == 0 || info.dli_fname == nullptr) return false;
  const char* base = std::strrchr(info.dli_fname, '/');
  base = base != nullptr ? base + 1 : info.dli_fname;
  return std::strncmp(base, "libinfinipath.", 14) == 0 || std::strncmp(base, "libpsm", 6) == 0;
}

}  // namespace

namespace {
constexpr int kCrashSignals[] = {SIGINT, SIGILL, SIGABRT, SIGBUS, SIGFPE, SIGSEGV, SIGTERM};
static_assert(sizeof(kCrashSignals) / sizeof(kCrashSignals[0]) == kCrashSignalCount);

void* handler_of(const struct sigaction& sa) {
  return (sa.sa_flags & SA_SIGINFO) != 0 ? reinterpret_cast<void*>(sa.sa_sigaction)
                                         : reinterpret_cast<void*>(sa.sa_handler);
}

bool is_foreign(const struct sigaction& sa) {
  void* fn = handler_of(sa);
  return fn != reinterpret_cast<void*>(SIG_DFL) && fn != reinterpret_cast<void*>(SIG_IGN) &&
         foreign_crash_handler(fn);
}
}  // namespace

CrashSignalDispositions CrashSignalDispositions::now() {
  CrashSignalDispositions d{};
  for (int i = 0; i < kCrashSignalCount; ++i)
    d.have[i] = sigaction(kCrashSignals[i], nullptr, &d.action[i]) == 0;
  return d;
}

int restore_crash_signals(const CrashSignalDispositions* before) {
  int reset = 0;
  for (int i = 0; i < kCrashSignalCount; ++i) {
    struct sigaction sa {};
    if (sigaction(kCrashSignals[i], nullptr, &sa) != 0 || !is_foreign(sa)) continue;
    struct sigaction put {};
    if (before != nullptr && before->have[i] && !is_foreign(before->action[i])) {
      put = before->action[i];
    } else {
      put.sa_handler = SIG_DFL;
      sigemptyset(&put.sa_mask);
    }
    if (sigaction(kCrashSignals[i], &put, nullptr) == 0) ++reset;
  }
  return reset;
}

namespace {
constexpr int kKept[] = {SIGINT, SIGTERM};
}  // namespace

KeepSignalDispositions::KeepSignalDispositions() {
  static_assert(sizeof(kKept) / sizeof(kKept[0]) == kCount, "one slot per signal");
  for (int i = 0; i < kCount; ++i) have_[i] = sigaction(kKept[i], nullptr, &saved_[i]) == 0;
}

KeepSignalDispositions::~KeepSignalDispositions() {
  for (int i = 0; i < kCount; ++i) {
    struct sigaction now {};
    if (!have_[i] || sigaction(kKept[i], nullptr, &now) != 0) continue;
    const bool same = now.sa_flags == saved_[i].sa_flags &&
                      ((now.sa_flags & SA_SIGINFO) != 0 ? now.sa_sigaction == saved_[i].sa_sigaction
                                                        : now.sa_handler == saved_[i].sa_handler);
    if (!same) (void)sigaction(kKept[i], &saved_[i], nullptr);
  }
}

}  // namespace kvxfer::transport
