// The two unit grammars of kvxfer, each in one place: rates
// (KVXFER_RATE_LIMIT, kvxfer_comm_config_t.rate_limit, the demo's --rate) and
// sizes (the KVXFER_*_BYTES parameters, the benchmarks' -b/-e).  No dependencies (not even
// logging), so that programs that link only the public library (examples/disagg_demo.cc) can use it
// too.
#pragma once

#include <cstdint>
#include <string>

namespace kvxfer::params {

/**
 * Parses a rate in the dialect of tc(8): a decimal number, an optional SI
 * (k, m, g, t: powers of 1000) or IEC (ki, mi, gi, ti: powers of 1024) prefix
 * and a mandatory unit: "bit" (bits per second) or "bps" (BYTES per second, as
 * in tc).  Case-insensitive, no spaces: "25gbit", "500mbit", "1.5gbit",
 * "100mibps".  The empty string means "no limit" (*bytes_per_sec = 0).
 * Anything else (a bare number, an unknown unit, junk, zero, negative, NaN,
 * overflow) returns false with the reason in *why.  Never throws except
 * std::bad_alloc.
 */
bool parse_rate(const std::string& text, double* bytes_per_sec, std::string* why);

/**
 * Parses a size in bytes, as nccl-tests' -b/-e do: decimal digits, an
 * optional binary prefix k, m, g or t (powers of 1024) and an optional "b"
 * ("ib" after a prefix).  Case-insensitive, no spaces: "262144", "256k",
 * "256KiB", "4M", "16MB", "1g".  Anything else (empty, a sign, a fraction,
 * hex, junk, more than 2^64 - 1) returns false with the reason in *why and
 * leaves *bytes untouched.  Never throws except std::bad_alloc.
 */
bool parse_size(const std::string& text, uint64_t* bytes, std::string* why);

}  // namespace kvxfer::params
