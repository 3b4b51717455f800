// libFuzzer target: what a peer sends on one request of kvxfer_send /
// kvxfer_recv (src/xfer/protocol.h): DESC, STATUS, ANCHOR and RESIDUAL
// messages with hostile bytes, and failed operations, fed to the real engine
// (Engine::testing_unlinked: no Links, no threads).  Every message lands in
// the receive the engine posted for it and goes through Impl::on_completion,
// the code a Link completion runs: decode_desc / compare_desc, the
// handshake, decode_status, the page decodes (Impl::run_job) and the progress
// round (Impl::step) that publishes stages.  The framing and the checks are in
// fuzz/peer_message_check.h (shared with the corpus replay in
// tests/wire_test.cc).  Build and run: fuzz/README.md.
#include <cstdio>
#include <cstdlib>

#include "peer_message_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const kvxfer::fuzz::peer::Outcome o = kvxfer::fuzz::peer::play(data, size);
  if (!o.violation.empty()) {
    std::fprintf(stderr, "peer_message_fuzz: property violated: %s\n", o.violation.c_str());
    std::abort();
  }
  return 0;
}
