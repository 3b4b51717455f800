// Internal error handling.  Every internal function returns kvxfer_result_t;
// detail text goes to a per-thread buffer that kvxfer_get_last_error() reads.
// KVXFER_CHECK propagates a failure and logs a one-line breadcrumb
// ("codec/page.cc:120 -> -6") at INFO, so a failure prints its own backtrace
// under KVXFER_DEBUG=INFO, as NCCL does.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "kvxfer/kvxfer.h"

namespace kvxfer {

/**
 * The integer a C caller stored in an enum field of a public struct.  C lets
 * any int be stored there; C++ must not load a value outside the enum's range
 * as the enum type (undefined behaviour, which UBSan reports), so validation
 * reads the field's bits.  Compare the result with the enumerators.
 */
template <class E>
inline int32_t c_enum_value(const E& field) {
  static_assert(std::is_enum<E>::value && sizeof(E) == sizeof(int32_t), "C enums are int-sized");
  int32_t v;
  std::memcpy(&v, &field, sizeof v);
  return v;
}

/** Records `fmt` as the calling thread's last error and returns `r`. */
kvxfer_result_t set_error(kvxfer_result_t r, const char* fmt, ...)
    __attribute__((format(printf, 2, 3)));
/** The calling thread's last error text ("" if none). */
const char* last_error();
/** Clears the calling thread's last error (called on entry to every API call). */
void clear_error();
/** printf into a std::string (no length limit). */
std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
/** Logs the breadcrumb for a propagated failure (used by KVXFER_CHECK). */
void breadcrumb(const char* file, int line, kvxfer_result_t r);

}  // namespace kvxfer

#define KVXFER_CHECK(call)                                 \
  do {                                                     \
    kvxfer_result_t kvxfer_r_ = (call);                    \
    if (kvxfer_r_ < 0) {                                   \
      ::kvxfer::breadcrumb(__FILE__, __LINE__, kvxfer_r_); \
      return kvxfer_r_;                                    \
    }                                                      \
  } while (0)

/** Returns KVXFER_ERR_INVALID_ARGUMENT with a message when `cond` is false. */
#define KVXFER_REQUIRE(cond, ...)                                                      \
  do {                                                                                 \
    if (!(cond)) return ::kvxfer::set_error(KVXFER_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)
