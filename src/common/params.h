// Typed access to the KVXFER_* environment variables declared in params.def.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/log.h"
#include "common/units.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::params {

// ---------------------------------------------------------------------------
// Choice lists of the ENUM parameters, each choice listed once as
// X(enumerator, name): `name` is the spelling in the environment (matched
// case-insensitively) and in docs/ENV.md.
// ---------------------------------------------------------------------------

// clang-format off
/** KVXFER_DEBUG: kvxfer::LogLevel (common/log.h). */
#define KVXFER_LOG_LEVELS(X) \
  X(LOG_NONE, NONE)          \
  X(LOG_VERSION, VERSION)    \
  X(LOG_WARN, WARN)          \
  X(LOG_INFO, INFO)          \
  X(LOG_TRACE, TRACE)
/** KVXFER_CODEC_IMPL: the CPU codec path (resolve_impl in codec/fast.cc maps it to codec::Impl). */
#define KVXFER_CODEC_PATHS(X) \
  X(kAuto, auto)              \
  X(kAvx2, avx2)              \
  X(kAvx512, avx512)          \
  X(kScalar, scalar)          \
  X(kReference, reference)
/**
 * KVXFER_ANCHOR_TC, KVXFER_RESIDUAL_TC and the TC of KVXFER_NET_TC_MAP: the
 * libfabric traffic classes, FI_TC_<name> (transport/ofi.cc maps them).
 */
#define KVXFER_TRAFFIC_CLASSES(X)         \
  X(kUnspec, UNSPEC)                      \
  X(kDscp, DSCP)                          \
  X(kLabel, LABEL)                        \
  X(kBestEffort, BEST_EFFORT)             \
  X(kLowLatency, LOW_LATENCY)             \
  X(kDedicatedAccess, DEDICATED_ACCESS)   \
  X(kBulkData, BULK_DATA)                 \
  X(kScavenger, SCAVENGER)                \
  X(kNetworkCtrl, NETWORK_CTRL)
// clang-format on

#define KVXFER_CHOICE_ENUMERATOR_(e, name) e,
enum class CodecPath : int { KVXFER_CODEC_PATHS(KVXFER_CHOICE_ENUMERATOR_) };
enum class Tclass : int { KVXFER_TRAFFIC_CLASSES(KVXFER_CHOICE_ENUMERATOR_) };
#undef KVXFER_CHOICE_ENUMERATOR_

/** values[i] is spelt names[i]; `count` of each.  One specialisation per ENUM type. */
template <typename E>
struct Choices;
#define KVXFER_CHOICE_VALUE_(e, name) E::e,
#define KVXFER_CHOICE_NAME_(e, name) #name,
#define KVXFER_CHOICES_(Type, LIST)                                              \
  template <>                                                                    \
  struct Choices<Type> {                                                         \
    using E = Type;                                                              \
    static constexpr E values[] = {LIST(KVXFER_CHOICE_VALUE_)};                  \
    static constexpr const char* names[] = {LIST(KVXFER_CHOICE_NAME_)};          \
    static constexpr size_t count = sizeof(names) / sizeof(names[0]);            \
    static_assert(sizeof(values) / sizeof(values[0]) == count, "one name each"); \
  };
KVXFER_CHOICES_(LogLevel, KVXFER_LOG_LEVELS)
KVXFER_CHOICES_(CodecPath, KVXFER_CODEC_PATHS)
KVXFER_CHOICES_(Tclass, KVXFER_TRAFFIC_CLASSES)
#undef KVXFER_CHOICES_
#undef KVXFER_CHOICE_VALUE_
#undef KVXFER_CHOICE_NAME_

/** The index of `v` in Choices<E> (its position in the list); count if unlisted. */
template <typename E>
constexpr size_t choice_index(E v) {
  size_t i = 0;
  while (i < Choices<E>::count && Choices<E>::values[i] != v) ++i;
  return i;
}
/** The spelling of `v` ("LOW_LATENCY"); "" if `v` is not listed. */
template <typename E>
const char* name_of(E v) {
  const size_t i = choice_index(v);
  return i < Choices<E>::count ? Choices<E>::names[i] : "";
}
/** Every name of E, in list order, joined by `sep` ("auto|avx2|scalar|reference"). */
template <typename E>
std::string choices_text(const char* sep = "|") {
  std::string s;
  for (size_t i = 0; i < Choices<E>::count; ++i) (s += i ? sep : "") += Choices<E>::names[i];
  return s;
}

// ---------------------------------------------------------------------------
// Accessors
// ---------------------------------------------------------------------------

// One accessor per parameter, typed by its kind (params.def):
//   INT     int64_t Name()             the integer, inside [min, max]
//   SIZE    int64_t Name()             bytes, inside [min, max] (size grammar: common/units.h)
//   FLOAT   double Name()              the number, inside [min, max]
//   RATE    double Name()              bytes per second; 0 = no limit
//   ENUM    Type Name()                the choice (Type: LogLevel, CodecPath, Tclass)
//   STRING  const std::string& Name()  the text as set
// Values are read on first use and cached.  A malformed value yields the
// default from the accessor and makes validate() fail.
#define KVXFER_PARAM_SECTION(title, doc)
#define KVXFER_PARAM_INT(Name, env, def, lo, hi, doc) int64_t Name();
#define KVXFER_PARAM_SIZE(Name, env, def, lo, hi, doc) int64_t Name();
#define KVXFER_PARAM_FLOAT(Name, env, def, lo, hi, doc) double Name();
#define KVXFER_PARAM_RATE(Name, env, def, doc) double Name();
#define KVXFER_PARAM_ENUM(Name, env, Type, def, choices, doc) Type Name();
#define KVXFER_PARAM_STRING(Name, env, def, doc) const std::string& Name();
#include "common/params.def"

/**
 * Checks every parameter once; KVXFER_ERR_INVALID_ARGUMENT naming the first
 * malformed variable and its value ("malformed environment: KVXFER_X='v' ...").
 */
kvxfer_result_t validate();

// ---------------------------------------------------------------------------
// Parsers, one per kind (parse_rate and parse_size: common/units.h), exposed for
// tests/common_test.cc.  Return false (and the reason, e.g. "is not an
// integer") for malformed text, leaving *out untouched; never throw.
// ---------------------------------------------------------------------------

/** strtoll base 0 (decimal, 0x hex, leading 0 = octal), the whole text, in [lo, hi]. */
bool parse_int(const char* text, int64_t lo, int64_t hi, int64_t* out, std::string* why);
/** A size (parse_size: "262144", "256k", "4MiB"), in [lo, hi] bytes. */
bool parse_size_in(const char* text, int64_t lo, int64_t hi, int64_t* out, std::string* why);
/** strtod, the whole text, finite, in [lo, hi]. */
bool parse_float(const char* text, double lo, double hi, double* out, std::string* why);
/** One of names[0..n), case-insensitive; *index is its position. */
bool parse_enum(const char* text, const char* const* names, size_t n, size_t* index,
                std::string* why);
/** The choice of E that `text` names (case-insensitive). */
template <typename E>
bool parse_enum(const char* text, E* out, std::string* why) {
  size_t i = 0;
  if (!parse_enum(text, Choices<E>::names, Choices<E>::count, &i, why)) return false;
  *out = Choices<E>::values[i];
  return true;
}

}  // namespace kvxfer::params
