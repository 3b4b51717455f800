// libFuzzer target: kvxfer::codec::decode_page and inspect_section on hostile
// (anchor, residual) pairs.  The input framing is in fuzz/fuzz_input.h; the
// checks are in fuzz/page_decode_check.h (shared with the regression replay
// in tests/format_test.cc).  Build and run: fuzz/README.md.
#include <cstdio>
#include <cstdlib>

#include "page_decode_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string violation = kvxfer::fuzz::check_page_decode(data, size);
  if (!violation.empty()) {
    std::fprintf(stderr, "page_decode_fuzz: property violated: %s\n", violation.c_str());
    std::abort();
  }
  return 0;
}
