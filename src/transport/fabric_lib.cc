#include "transport/fabric_lib.h"

#include <dlfcn.h>
#include <rdma/fi_errno.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>

#include "common/error.h"
#include "transport/crash_signals.h"
#include "transport/ofi.h"

namespace kvxfer::transport::fabric_lib {
namespace {

// The symbol versions a program compiled with these headers links to.  A
// newer libfabric keeps them (its struct layouts change under a new version),
// so the functions resolved here agree with the structs compiled in.  Headers
// after 1.19 name versions this table does not know: those builds take the
// library's default version, which agrees when the run-time library is the
// release whose headers were used.
#if FI_MAJOR_VERSION == 1 && FI_MINOR_VERSION < 20
constexpr const char* kInfoVersion = "FABRIC_1.3";  // fi_getinfo, fi_freeinfo, fi_dupinfo
constexpr const char* kFabricVersion = "FABRIC_1.1";
constexpr const char* kStrerrorVersion = "FABRIC_1.0";
#else
constexpr const char* kInfoVersion = nullptr;
constexpr const char* kFabricVersion = nullptr;
constexpr const char* kStrerrorVersion = nullptr;
#endif

constexpr const char* kLibrary = "libfabric.so.1";

/** dlopen of kLibrary by name (LD_LIBRARY_PATH, the loader's cache and
 *  directories), else in the directory of the libfabric kvxfer was built
 *  against (KVXFER_LIBFABRIC_LIBDIR: a prefix outside the loader's path). */
void* open_library(std::string* why) {
  if (void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL)) return lib;
  const char* e = dlerror();
  *why = strprintf("cannot load %s: %s", kLibrary, e != nullptr ? e : "dlopen failed");
#ifdef KVXFER_LIBFABRIC_LIBDIR
  const std::string path = std::string(KVXFER_LIBFABRIC_LIBDIR) + "/" + kLibrary;
  if (void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) return lib;
  e = dlerror();
  *why += strprintf("; nor %s: %s", path.c_str(), e != nullptr ? e : "dlopen failed");
#endif
  return nullptr;
}

struct Api {
  int (*getinfo)(uint32_t, const char*, const char*, uint64_t, const fi_info*, fi_info**) = nullptr;
  void (*freeinfo)(fi_info*) = nullptr;
  fi_info* (*dupinfo)(const fi_info*) = nullptr;
  int (*fabric)(fi_fabric_attr*, fid_fabric**, void*) = nullptr;
  const char* (*strerror)(int) = nullptr;
};

// Written once under load()'s call_once; read after `g_loaded` is seen true.
Api g_api;
std::atomic<bool> g_loaded{false};

template <typename F>
bool resolve(void* lib, const char* name, const char* version, F* out, std::string* why) {
  void* p = version != nullptr ? dlvsym(lib, name, version) : dlsym(lib, name);
  if (p == nullptr) {
    const char* e = dlerror();
    *why = strprintf("%s lacks %s%s%s (%s)", kLibrary, name, version != nullptr ? "@" : "",
                     version != nullptr ? version : "", e != nullptr ? e : "not found");
    return false;
  }
  *out = reinterpret_cast<F>(p);
  return true;
}

}  // namespace

kvxfer_result_t load() {
  static std::once_flag once;
  static kvxfer_result_t result = KVXFER_SUCCESS;
  static std::string why;
  std::call_once(once, [] {
    (void)apply_provider_memory_defaults();
    const CrashSignalDispositions before = CrashSignalDispositions::now();
    void* lib = open_library(&why);
    (void)restore_crash_signals(&before);
    if (lib == nullptr) {
      result = KVXFER_ERR_UNSUPPORTED;
      return;
    }
    Api api;
    if (!resolve(lib, "fi_getinfo", kInfoVersion, &api.getinfo, &why) ||
        !resolve(lib, "fi_freeinfo", kInfoVersion, &api.freeinfo, &why) ||
        !resolve(lib, "fi_dupinfo", kInfoVersion, &api.dupinfo, &why) ||
        !resolve(lib, "fi_fabric", kFabricVersion, &api.fabric, &why) ||
        !resolve(lib, "fi_strerror", kStrerrorVersion, &api.strerror, &why)) {
      result = KVXFER_ERR_SYSTEM;
      return;  // the library stays loaded: its constructors have run
    }
    g_api = api;
    g_loaded.store(true, std::memory_order_release);
  });
  if (result != KVXFER_SUCCESS) return set_error(result, "%s", why.c_str());
  return KVXFER_SUCCESS;
}

bool loaded() { return g_loaded.load(std::memory_order_acquire); }

int getinfo(uint32_t version, const char* node, const char* service, uint64_t flags,
            const fi_info* hints, fi_info** info) {
  if (!loaded()) return -FI_ENOSYS;
  return g_api.getinfo(version, node, service, flags, hints, info);
}

void freeinfo(fi_info* info) {
  if (info != nullptr && loaded()) g_api.freeinfo(info);
}

fi_info* dupinfo(const fi_info* info) { return loaded() ? g_api.dupinfo(info) : nullptr; }

int fabric(fi_fabric_attr* attr, fid_fabric** fabric, void* context) {
  if (!loaded()) return -FI_ENOSYS;
  return g_api.fabric(attr, fabric, context);
}

const char* strerror(int errnum) {
  return loaded() ? g_api.strerror(errnum) : std::strerror(errnum);
}

}  // namespace kvxfer::transport::fabric_lib
