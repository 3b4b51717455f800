#include "common/params.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common/error.h"
#include "common/log.h"

namespace kvxfer::params {

bool parse_int(const char* text, int64_t lo, int64_t hi, int64_t* out, std::string* why) {
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text, &end, 0);
  // strtoll skips leading white space; sizes, rates and enums refuse it.
  if (end == text || std::isspace(static_cast<unsigned char>(*text)) || *end != '\0' ||
      errno == ERANGE) {
    *why = "is not an integer";
    return false;
  }
  if (v < lo || v > hi) {
    *why = "is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    return false;
  }
  *out = v;
  return true;
}

bool parse_size_in(const char* text, int64_t lo, int64_t hi, int64_t* out, std::string* why) {
  uint64_t v = 0;
  if (!parse_size(text, &v, why)) return false;
  if (v < static_cast<uint64_t>(lo) || v > static_cast<uint64_t>(hi)) {
    *why = "is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "] bytes";
    return false;
  }
  *out = static_cast<int64_t>(v);
  return true;
}

bool parse_float(const char* text, double lo, double hi, double* out, std::string* why) {
  if (*text == '\0') {
    *why = "is empty";
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  // ERANGE also flags an underflow (1e-310 reads as a subnormal), which is a
  // number; an overflow reads as an infinity.  strtod skips leading white
  // space, which the other types refuse.
  if (end == text || std::isspace(static_cast<unsigned char>(*text)) || *end != '\0' ||
      !std::isfinite(v)) {
    *why = "is not a number";
    return false;
  }
  if (v < lo || v > hi) {
    *why = strprintf("is outside [%g, %g]", lo, hi);
    return false;
  }
  *out = v;
  return true;
}

bool parse_enum(const char* text, const char* const* names, size_t n, size_t* index,
                std::string* why) {
  for (size_t i = 0; i < n; ++i) {
    if (strcasecmp(names[i], text) == 0) {
      *index = i;
      return true;
    }
  }
  *why = "is not one of ";
  for (size_t i = 0; i < n; ++i) (*why += i ? "|" : "") += names[i];
  return false;
}

namespace {

struct Bad {
  std::mutex mu;
  std::string first;  // "KVXFER_X='v' is not ..."
};
Bad& bad() {
  static Bad b;
  return b;
}
void record_bad(const char* env, const char* text, const std::string& why) {
  std::lock_guard<std::mutex> lk(bad().mu);
  if (bad().first.empty()) bad().first = std::string(env) + "='" + text + "' " + why;
}

}  // namespace

// Each accessor reads its variable exactly once (function-local static).  The
// ENV log line is written after the value is cached, so logging (which reads
// KVXFER_DEBUG through these same accessors) never recurses into itself.
#define KVXFER_PARAM_SECTION(title, doc)
// INT, SIZE and FLOAT: a number in [lo, hi] read by `parse`, logged with `fmt`.
#define KVXFER_RANGED_ACCESSOR(Type, Name, env, def, lo, hi, parse, fmt, shown)   \
  Type Name() {                                                                   \
    static bool bad = false; /* malformed: logged by record_bad, not as set */    \
    static const Type value = [] {                                                \
      const char* t = std::getenv(env);                                           \
      Type v = def;                                                               \
      std::string why;                                                            \
      if (t != nullptr && !parse(t, lo, hi, &v, &why)) {                          \
        record_bad(env, t, why);                                                  \
        bad = true;                                                               \
        v = def;                                                                  \
      }                                                                           \
      return v;                                                                   \
    }();                                                                          \
    static std::once_flag logged;                                                 \
    std::call_once(logged, [] {                                                   \
      if (std::getenv(env) != nullptr && !bad)                                    \
        KVXFER_INFO(LOG_ENV, "%s set by environment to " fmt, env, shown(value)); \
    });                                                                           \
    return value;                                                                 \
  }
#define KVXFER_PARAM_INT(Name, env, def, lo, hi, doc) \
  KVXFER_RANGED_ACCESSOR(int64_t, Name, env, def, lo, hi, parse_int, "%lld", (long long))
#define KVXFER_PARAM_SIZE(Name, env, def, lo, hi, doc) \
  KVXFER_RANGED_ACCESSOR(int64_t, Name, env, def, lo, hi, parse_size_in, "%lld bytes", (long long))
#define KVXFER_PARAM_FLOAT(Name, env, def, lo, hi, doc) \
  KVXFER_RANGED_ACCESSOR(double, Name, env, def, lo, hi, parse_float, "%g", (double))
#define KVXFER_PARAM_RATE(Name, env, def, doc)                                             \
  double Name() {                                                                          \
    static bool bad = false; /* malformed: logged by record_bad, not as set */             \
    static const double value = [] {                                                       \
      const char* t = std::getenv(env);                                                    \
      double v = 0;                                                                        \
      std::string why;                                                                     \
      if (!parse_rate(t != nullptr ? t : def, &v, &why)) {                                 \
        record_bad(env, t != nullptr ? t : def, why);                                      \
        bad = true;                                                                        \
        v = 0;                                                                             \
      }                                                                                    \
      return v;                                                                            \
    }();                                                                                   \
    static std::once_flag logged;                                                          \
    std::call_once(logged, [] {                                                            \
      if (const char* t = std::getenv(env); t != nullptr && !bad)                          \
        KVXFER_INFO(LOG_ENV, "%s set by environment to %s = %.0f bytes/s", env, t, value); \
    });                                                                                    \
    return value;                                                                          \
  }
#define KVXFER_PARAM_ENUM(Name, env, Type, def, choices, doc)                       \
  Type Name() {                                                                     \
    static bool bad = false; /* malformed: logged by record_bad, not as set */      \
    static const Type value = [] {                                                  \
      const char* t = std::getenv(env);                                             \
      Type v = Type::def;                                                           \
      std::string why;                                                              \
      if (t != nullptr && !parse_enum(t, &v, &why)) {                               \
        record_bad(env, t, why);                                                    \
        bad = true;                                                                 \
        v = Type::def;                                                              \
      }                                                                             \
      return v;                                                                     \
    }();                                                                            \
    static std::once_flag logged;                                                   \
    if (std::strcmp(env, "KVXFER_DEBUG") != 0)                                      \
      std::call_once(logged, [] {                                                   \
        if (std::getenv(env) != nullptr && !bad)                                    \
          KVXFER_INFO(LOG_ENV, "%s set by environment to %s", env, name_of(value)); \
      });                                                                           \
    return value;                                                                   \
  }
#define KVXFER_PARAM_STRING(Name, env, def, doc)  \
  const std::string& Name() {                     \
    static const std::string value = [] {         \
      const char* t = std::getenv(env);           \
      return std::string(t != nullptr ? t : def); \
    }();                                          \
    return value;                                 \
  }
#include "common/params.def"
#undef KVXFER_RANGED_ACCESSOR

kvxfer_result_t validate() {
  // Every value is read once, so the verdict is computed once too.
  static const std::string problem = [] {
#define KVXFER_PARAM_SECTION(title, doc)
#define KVXFER_PARAM_INT(Name, env, def, lo, hi, doc) (void)Name();
#define KVXFER_PARAM_SIZE(Name, env, def, lo, hi, doc) (void)Name();
#define KVXFER_PARAM_FLOAT(Name, env, def, lo, hi, doc) (void)Name();
#define KVXFER_PARAM_RATE(Name, env, def, doc) (void)Name();
#define KVXFER_PARAM_ENUM(Name, env, Type, def, choices, doc) (void)Name();
#define KVXFER_PARAM_STRING(Name, env, def, doc) (void)Name();
#include "common/params.def"
    uint32_t mask = 0;
    std::string why;
    if (!parse_log_subsys(DebugSubsys().c_str(), &mask, &why))
      record_bad("KVXFER_DEBUG_SUBSYS", DebugSubsys().c_str(), why);
    std::lock_guard<std::mutex> lk(bad().mu);
    return bad().first;
  }();
  if (!problem.empty())
    return set_error(KVXFER_ERR_INVALID_ARGUMENT, "malformed environment: %s", problem.c_str());
  return KVXFER_SUCCESS;
}

}  // namespace kvxfer::params
