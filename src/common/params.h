// Typed access to the KVXFER_* environment variables declared in params.def.
#pragma once

#include <cstdint>
#include <string>

#include "common/rate.h"
#include "kvxfer/kvxfer.h"

namespace kvxfer::params {

// One accessor per parameter: int64_t CodecThreads(), std::string CodecImpl(), ...
// Values are read on first use and cached.  A malformed value yields the
// default from the accessor and makes validate() fail.
#define KVXFER_PARAM_INT(Name, env, def, lo, hi, doc) int64_t Name();
#define KVXFER_PARAM_ENUM(Name, env, def, choices, doc) const std::string& Name();
#define KVXFER_PARAM_STRING(Name, env, def, doc) const std::string& Name();
#include "common/params.def"
#undef KVXFER_PARAM_INT
#undef KVXFER_PARAM_ENUM
#undef KVXFER_PARAM_STRING

/** Checks every parameter once; fails naming the first malformed variable. */
kvxfer_result_t validate();

// Parsers, exposed for tests/common_test.cc.  Return false (and a message)
// for malformed text; never throw.
bool parse_int(const char* text, int64_t lo, int64_t hi, int64_t* out, std::string* why);
bool parse_enum(const char* text, const char* choices, std::string* out, std::string* why);
// parse_rate (common/rate.h) is the grammar of KVXFER_RATE_LIMIT.
/** A number in [0, 1] (KVXFER_SPEC_MIN_ACCEPT).  False with *why if not. */
bool parse_unit_interval(const std::string& text, double* out, std::string* why);

}  // namespace kvxfer::params
