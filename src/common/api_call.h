// The one wrapper every exported kvxfer_* function runs its body in: clears
// the thread's error text, logs the version once, checks the KVXFER_*
// environment, and turns every exception into a result (none is expected;
// std::bad_alloc is the realistic one).  Nothing is thrown across the C ABI.
#pragma once

#include <exception>
#include <mutex>
#include <new>

#include "common/error.h"
#include "common/log.h"
#include "common/params.h"

namespace kvxfer {

// The version line, once per process, as NCCL prints its own: at
// KVXFER_DEBUG=VERSION, and at INFO and above; not at the default WARN.
inline void log_version_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    const LogLevel lvl = params::Debug() == LOG_VERSION ? LOG_VERSION : LOG_INFO;
    KVXFER_LOG_AT_(lvl, LOG_INIT, "kvxfer %d.%d.%d", KVXFER_MAJOR, KVXFER_MINOR, KVXFER_PATCH);
  });
}

template <typename F>
kvxfer_result_t api_call(const char* name, F&& body) {
  clear_error();
  log_version_once();
  try {
    KVXFER_CHECK(params::validate());
    return body();
  } catch (const std::bad_alloc&) {
    return set_error(KVXFER_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
  } catch (const std::exception& e) {
    return set_error(KVXFER_ERR_INTERNAL, "%s: unexpected exception: %s", name, e.what());
  } catch (...) {
    return set_error(KVXFER_ERR_INTERNAL, "%s: unexpected exception", name);
  }
}

/**
 * Sets each non-NULL output to its empty value (nullptr, 0) before
 * api_call, so that an entry point whose contract says what its outputs read
 * on failure keeps it even when the environment check fails first.
 */
template <typename... T>
void reset_outputs(T*... out) {
  ((out != nullptr ? static_cast<void>(*out = T{}) : static_cast<void>(0)), ...);
}

}  // namespace kvxfer
