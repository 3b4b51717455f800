// Two-mask logging, as NCCL: KVXFER_DEBUG sets the level (NONE, VERSION, WARN,
// INFO, TRACE); KVXFER_DEBUG_SUBSYS picks subsystems (INIT,CODEC,NET,ENV,MODEL,
// ALL; a leading ^ inverts).  KVXFER_DEBUG_FILE redirects output; %h expands
// to the host name and %p to the pid.  Lines look like
//   host:pid:tid [kvxfer] CODEC INFO message
// TRACE compiles out unless KVXFER_ENABLE_TRACE is defined.
// A sink can replace the writer (the NCCL net plugin routes logs to NCCL's
// logger this way).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace kvxfer {

enum LogLevel : int { LOG_NONE = 0, LOG_VERSION = 1, LOG_WARN = 2, LOG_INFO = 3, LOG_TRACE = 5 };
enum LogSubsys : uint32_t {
  LOG_INIT = 1u << 0,
  LOG_CODEC = 1u << 1,
  LOG_NET = 1u << 2,
  LOG_ENV = 1u << 3,
  LOG_MODEL = 1u << 4,
  LOG_ALL = ~0u,
};

/** Replaces the writer: receives level, subsystem and the formatted message. */
using LogSink = void (*)(LogLevel level, uint32_t subsys, const char* msg);
void set_log_sink(LogSink sink);

/** Parses a KVXFER_DEBUG_SUBSYS list into a mask; false + reason if malformed. */
bool parse_log_subsys(const char* text, uint32_t* mask, std::string* why);

/** True when a message of this level and subsystem would be printed. */
bool log_enabled(LogLevel level, uint32_t subsys);

void log_message(LogLevel level, uint32_t subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));

/**
 * At most one log line per `period_ms` for an event that a peer can repeat
 * at will (a flood of refused connections must not flood the log): tick()
 * counts one event and returns true when it may be logged, setting *count
 * to the events since the last one logged, this one included.  Not
 * thread-safe: one owner thread.
 */
class LogThrottle {
 public:
  explicit LogThrottle(int64_t period_ms = 1000) : period_ms_(period_ms) {}
  /** The tail for a line logged with `count` from tick(): "" for 1, else
   *  " (<count> since the last such line)". */
  static std::string note(uint64_t count);
  bool tick(uint64_t* count) {
    ++events_;
    const auto now = std::chrono::steady_clock::now();
    if (logged_ && now - last_ < std::chrono::milliseconds(period_ms_)) return false;
    logged_ = true;
    last_ = now;
    *count = events_;
    events_ = 0;
    return true;
  }

 private:
  int64_t period_ms_;
  uint64_t events_ = 0;
  bool logged_ = false;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace kvxfer

#define KVXFER_LOG_AT_(lvl, subsys, ...)                                   \
  do {                                                                     \
    if (::kvxfer::log_enabled(lvl, subsys))                                \
      ::kvxfer::log_message(lvl, subsys, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
#define KVXFER_WARN(subsys, ...) KVXFER_LOG_AT_(::kvxfer::LOG_WARN, ::kvxfer::subsys, __VA_ARGS__)
#define KVXFER_INFO(subsys, ...) KVXFER_LOG_AT_(::kvxfer::LOG_INFO, ::kvxfer::subsys, __VA_ARGS__)
#ifdef KVXFER_ENABLE_TRACE
#define KVXFER_TRACE(subsys, ...) KVXFER_LOG_AT_(::kvxfer::LOG_TRACE, ::kvxfer::subsys, __VA_ARGS__)
#else
#define KVXFER_TRACE(subsys, ...) \
  do {                            \
  } while (0)
#endif
