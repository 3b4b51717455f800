#include "common/heap.h"

#include <dlfcn.h>
#include <malloc.h>

#include <mutex>

namespace kvxfer {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// True when the process's malloc is glibc's own: the symbol every caller
// resolves is the one libc.so.6 defines.
bool glibc_malloc_in_use() {
  void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  if (libc == nullptr) return false;
  const bool same = dlsym(RTLD_DEFAULT, "malloc") == dlsym(libc, "malloc");
  dlclose(libc);
  return same;
}

}  // namespace

void trim_heap() {
  if (kSanitized) return;
  static const bool glibc = glibc_malloc_in_use();
  if (!glibc) return;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  malloc_trim(0);
}

}  // namespace kvxfer
