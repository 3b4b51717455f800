// Giving freed heap pages back to the kernel.
#pragma once

namespace kvxfer {

// Returns glibc malloc's free pages to the kernel (malloc_trim(0)) when glibc
// malloc is the process's allocator; does nothing under ASan or an allocator
// preloaded in its place (tcmalloc, jemalloc).
//
// Why the check: under ASan nothing initialises glibc malloc, and
// malloc_trim then initialises it on the calling thread, unlocked. Two
// threads doing so at once crash in mtrim, or make glibc abort at thread exit
// ("__malloc_arena_thread_freeres: a->attached_threads > 0"), which CI's ASan
// run hit (tests/heap_trim_first_calls.cc). Under another allocator the
// trim would free nothing anyway.
//
// Thread-safe; calls are serialised. Costs one call to dlsym, once.
void trim_heap();

}  // namespace kvxfer
