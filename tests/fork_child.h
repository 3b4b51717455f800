// A forked peer process for two-process tests (tests/ofi_test.cc,
// tests/comm_test.cc): two pipes to talk to it, a bounded wait, and a kill in
// the destructor so a failing test never leaves a child behind.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include "transport/shm_reaper.h"

namespace kvxfer::test {

struct Child {
  pid_t pid = -1;
  int to_child = -1, from_child = -1;  // parent's ends of the two pipes
  int status = -1;

  /** Forks; the child runs fn(read_fd, write_fd) and _exit()s with its result. */
  bool start(const std::function<int(int, int)>& fn) {
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0) return false;
    std::fflush(nullptr);
    pid = fork();
    if (pid < 0) return false;
    if (pid == 0) {
      close(down[1]);
      close(up[0]);
      alarm(120);  // a child never outlives a hung parent for long
      _exit(fn(down[0], up[1]));
    }
    close(down[0]);
    close(up[1]);
    to_child = down[1];
    from_child = up[0];
    return true;
  }
  /** Waits for exit up to `seconds`; false (child killed) on timeout. */
  bool wait(double seconds) {
    using Clock = std::chrono::steady_clock;
    const auto end = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    while (Clock::now() < end) {
      if (waitpid(pid, &status, WNOHANG) == pid) {
        remove_shm_regions(pid);
        pid = -1;
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    remove_shm_regions(pid);
    pid = -1;
    return false;
  }
  /**
   * A killed child cannot remove its libfabric shm regions
   * (/dev/shm/<pid>:<uid>:<n>, 16 MiB of tmpfs each); without a surviving
   * peer that saw it die, they would pile up run after run.
   */
  static void remove_shm_regions(pid_t dead) { transport::remove_shm_regions_of(dead); }
  ~Child() {
    if (pid > 0) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      remove_shm_regions(pid);
    }
    if (to_child >= 0) close(to_child);
    if (from_child >= 0) close(from_child);
  }
};

/** True if `fd` has data (or EOF) to read now. */
inline bool readable(int fd) {
  pollfd pfd{fd, POLLIN, 0};
  return ::poll(&pfd, 1, 0) > 0;
}

}  // namespace kvxfer::test
