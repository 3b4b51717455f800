// Framed messages between two processes over a pipe: (type, length, bytes).
// The rendezvous of perf/kvxfer_perf (rendezvous.h) and of examples/disagg_demo.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvxfer::perf {

/** CLOCK_MONOTONIC in ns (the clock of kvxfer's request timestamps). */
int64_t mono_ns();

/** Longest wait for a message of the other process (it may be generating a
 *  large KV, or computing the expected decode, meanwhile). */
constexpr int kPipeWaitMs = 600000;

/** False when the pipe fails. */
bool send_msg(int fd, uint32_t type, const void* p, size_t n);
/** One message within wait_ms; false with *err on EOF, error or time out
 *  (*err names the writer as `peer`, e.g. "the receiver process"). */
bool recv_msg(int fd, uint32_t* type, std::vector<uint8_t>* payload, int wait_ms, const char* peer,
              std::string* err);

}  // namespace kvxfer::perf
