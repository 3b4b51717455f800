// trim_heap (common/heap.h) called first from many threads at once, in a
// process whose glibc malloc nothing has initialised yet: the state of every
// ASan process, and of one that preloads tcmalloc or jemalloc. Bare
// malloc_trim there made glibc abort at thread exit or crash (CI's ASan run).
// No gtest: its start-up would initialise glibc malloc in this process. Each
// round runs in a forked child, so that each call is a first one.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <thread>
#include <vector>

#include "common/heap.h"

int main() {
  constexpr int kRounds = 16;
  constexpr int kThreads = 8;
  for (int round = 0; round < kRounds; ++round) {
    const pid_t pid = fork();
    if (pid < 0) return std::perror("fork"), 2;
    if (pid == 0) {
      std::vector<std::thread> threads;
      for (int i = 0; i < kThreads; ++i) threads.emplace_back([] { kvxfer::trim_heap(); });
      for (auto& t : threads) t.join();
      _exit(0);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return std::perror("waitpid"), 2;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "round %d: the child ended with status 0x%x, not exit 0\n", round,
                   status);
      return 1;
    }
  }
  std::printf("%d rounds of %d threads calling trim_heap first: every child exited 0\n", kRounds,
              kThreads);
  return 0;
}
