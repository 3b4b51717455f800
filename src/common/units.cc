#include "common/units.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace kvxfer::params {

bool parse_rate(const std::string& text, double* bytes_per_sec, std::string* why) {
  *bytes_per_sec = 0;
  if (text.empty()) return true;  // no limit
  // Number: digits with at most one '.', at least one digit, no sign, no exponent.
  size_t i = 0;
  bool dot = false, digit = false;
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (c >= '0' && c <= '9') {
      digit = true;
    } else if (c == '.' && !dot) {
      dot = true;
    } else {
      break;
    }
  }
  if (!digit) {
    *why = "does not start with a number (expected e.g. 25gbit, 500mbit, 100mbps)";
    return false;
  }
  const std::string num = text.substr(0, i);
  std::string unit = text.substr(i);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  char* end = nullptr;
  const double v = std::strtod(num.c_str(), &end);
  if (end == nullptr || *end != '\0' || !std::isfinite(v)) {
    *why = "has a malformed number";
    return false;
  }
  double scale = 1;
  static const struct {
    const char* prefix;
    double scale;
  } kPrefixes[] = {{"ki", 1024.0},
                   {"mi", 1024.0 * 1024},
                   {"gi", 1024.0 * 1024 * 1024},
                   {"ti", 1024.0 * 1024 * 1024 * 1024},
                   {"k", 1e3},
                   {"m", 1e6},
                   {"g", 1e9},
                   {"t", 1e12}};
  for (const auto& p : kPrefixes) {
    const size_t n = std::strlen(p.prefix);
    if (unit.compare(0, n, p.prefix) == 0 && (unit.size() - n == 3)) {
      scale = p.scale;
      unit = unit.substr(n);
      break;
    }
  }
  double bytes;
  if (unit == "bit") {
    bytes = v * scale / 8.0;
  } else if (unit == "bps") {
    bytes = v * scale;
  } else if (unit.empty()) {
    *why = "has no unit (write e.g. 25gbit for bits/s or 100mbps for bytes/s)";
    return false;
  } else {
    *why = "has an unknown unit '" + text.substr(i) +
           "' (allowed: [k|m|g|t|ki|mi|gi|ti]bit or ...bps = bytes/s)";
    return false;
  }
  if (!(bytes >= 1.0) || !std::isfinite(bytes)) {
    *why = "is not a positive rate of at least 1 byte/s";
    return false;
  }
  *bytes_per_sec = bytes;
  return true;
}

bool parse_size(const std::string& text, uint64_t* bytes, std::string* why) {
  size_t i = 0;
  uint64_t v = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    const uint64_t d = static_cast<uint64_t>(text[i] - '0');
    if (v > (UINT64_MAX - d) / 10) {
      *why = "is more than 2^64 - 1 bytes";
      return false;
    }
    v = v * 10 + d;
  }
  if (i == 0) {
    *why = "does not start with a decimal number (expected e.g. 262144, 256k, 4MiB)";
    return false;
  }
  int shift = 0;
  if (i < text.size()) {
    switch (std::tolower(static_cast<unsigned char>(text[i]))) {
      case 'k': shift = 10; break;
      case 'm': shift = 20; break;
      case 'g': shift = 30; break;
      case 't': shift = 40; break;
      default: break;
    }
    if (shift != 0) ++i;
  }
  std::string rest = text.substr(i);
  for (char& c : rest) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (!(rest.empty() || rest == "b" || (shift != 0 && rest == "ib"))) {
    *why = "has an unknown unit '" + text.substr(i) + "' (expected k, m, g or t, then b or ib)";
    return false;
  }
  if (shift != 0 && v > (UINT64_MAX >> shift)) {
    *why = "is more than 2^64 - 1 bytes";
    return false;
  }
  *bytes = v << shift;
  return true;
}

}  // namespace kvxfer::params
