#include "common/error.h"

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/log.h"

namespace kvxfer {
namespace {
thread_local std::string t_last_error;
}

kvxfer_result_t set_error(kvxfer_result_t r, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  t_last_error = buf;
  KVXFER_INFO(LOG_ALL, "%s: %s", kvxfer_get_error_string(r), buf);
  return r;
}

std::string strprintf(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  va_list ap2;
  va_copy(ap2, ap);
  const int n = vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) vsnprintf(out.data(), out.size() + 1, fmt, ap2);
  va_end(ap2);
  return out;
}

const char* last_error() { return t_last_error.c_str(); }
void clear_error() { t_last_error.clear(); }

void breadcrumb(const char* file, int line, kvxfer_result_t r) {
  // Relative to the source tree ("codec/page.cc:120 -> -6"), not the build host's path.
  const char* rel = std::strstr(file, "/src/");
  rel = rel != nullptr ? rel + 5 : file;
  KVXFER_INFO(LOG_ALL, "%s:%d -> %d", rel, line, static_cast<int>(r));
}

}  // namespace kvxfer

extern "C" const char* kvxfer_get_error_string(kvxfer_result_t r) {
  switch (kvxfer::c_enum_value(r)) {  // any int a C caller passes (c_enum_value)
    case KVXFER_SUCCESS: return "success";
    case KVXFER_IN_PROGRESS: return "in progress";
    case KVXFER_ERR_INVALID_ARGUMENT: return "invalid argument";
    case KVXFER_ERR_INVALID_USAGE: return "invalid usage";
    case KVXFER_ERR_BUFFER_TOO_SMALL: return "buffer too small";
    case KVXFER_ERR_NONFINITE: return "non-finite value in input";
    case KVXFER_ERR_TRUNCATED: return "truncated data";
    case KVXFER_ERR_CORRUPT: return "corrupted data";
    case KVXFER_ERR_MISMATCH: return "mismatched data or layout";
    case KVXFER_ERR_UNSUPPORTED: return "unsupported";
    case KVXFER_ERR_SYSTEM: return "system error";
    case KVXFER_ERR_INTERNAL: return "internal error";
    case KVXFER_ERR_OUT_OF_MEMORY: return "out of memory";
    case KVXFER_ERR_TIMEOUT: return "timed out";
    case KVXFER_ERR_CANCELLED: return "cancelled";
  }
  return "unknown result code";
}

extern "C" const char* kvxfer_get_last_error(void) { return kvxfer::last_error(); }
