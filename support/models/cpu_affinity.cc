#include "models/cpu_affinity.h"

#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

namespace kvxfer::model {

bool pin_openmp_threads(int n, std::string* error) {
  auto fail = [&](const std::string& why) {
    if (error != nullptr) *error = why;
    return false;
  };
  if (n < 1) return fail("pin_openmp_threads: n = " + std::to_string(n) + " is not >= 1");
  // The calling thread's mask once pinned is one CPU: remember the process's
  // CPUs (the mask this thread started with) the first time.
  static const std::vector<int> cpus = [] {
    std::vector<int> v;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0)
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) v.push_back(c);
    return v;
  }();
  if (static_cast<int>(cpus.size()) < n)
    return fail("pin_openmp_threads: " + std::to_string(n) +
                " threads, but the affinity mask has " + std::to_string(cpus.size()) + " CPU(s)");
  std::atomic<int> bad{0}, team{0};
#pragma omp parallel num_threads(n)
  {
    team.store(omp_get_num_threads());
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[static_cast<size_t>(omp_get_thread_num())], &one);
    const int rc = pthread_setaffinity_np(pthread_self(), sizeof one, &one);
    if (rc != 0) bad.store(rc);
  }
  if (team.load() != n)
    return fail("pin_openmp_threads: OpenMP gave a team of " + std::to_string(team.load()) +
                ", not " + std::to_string(n));
  if (bad.load() != 0)
    return fail(std::string("pin_openmp_threads: pthread_setaffinity_np: ") +
                std::strerror(bad.load()));
  return true;
}

}  // namespace kvxfer::model
