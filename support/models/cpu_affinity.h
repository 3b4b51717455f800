// Pinning the model runner's OpenMP threads to CPUs.
#pragma once

#include <string>

namespace kvxfer::model {

// Pins the OpenMP threads of a team of n (the calling thread is thread 0) to
// n distinct CPUs, thread i to the i-th CPU of the calling thread's affinity
// mask, for the life of each thread.  Unpinned, Linux may wake an idle
// worker onto the CPU of the thread that woke it while another CPU is busy
// for a moment, and leave both there after that CPU goes idle until the next
// load balance: each parallel region's barrier then waits out scheduler
// ticks (docs/SPEC.md, "The first pass after COMPLETE").  vLLM's CPU worker
// and llama.cpp bind their threads the same way.  Call it from the thread
// that runs the model, after omp_set_num_threads(n), and again after a
// smaller team ran (libgomp keeps a shrunk team's threads, but a thread it
// creates inherits its creator's mask).  Returns false with *error set when
// the mask has fewer than n CPUs or a call fails; the threads are then as
// they were or partly pinned.  Not thread-safe against concurrent OpenMP
// use from other threads.
bool pin_openmp_threads(int n, std::string* error);

}  // namespace kvxfer::model
