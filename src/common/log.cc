#include "common/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "common/params.h"

namespace kvxfer {

bool parse_log_subsys(const char* text, uint32_t* mask, std::string* why) {
  bool invert = text[0] == '^';
  uint32_t m = 0;
  std::string s(text + (invert ? 1 : 0));
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    std::string name = s.substr(start, comma - start);
    if (strcasecmp(name.c_str(), "INIT") == 0)
      m |= LOG_INIT;
    else if (strcasecmp(name.c_str(), "CODEC") == 0)
      m |= LOG_CODEC;
    else if (strcasecmp(name.c_str(), "NET") == 0)
      m |= LOG_NET;
    else if (strcasecmp(name.c_str(), "ENV") == 0)
      m |= LOG_ENV;
    else if (strcasecmp(name.c_str(), "MODEL") == 0)
      m |= LOG_MODEL;
    else if (strcasecmp(name.c_str(), "ALL") == 0)
      m |= LOG_ALL;
    else {
      *why = "names an unknown subsystem '" + name + "'";
      return false;
    }
    start = comma + 1;
  }
  *mask = invert ? ~m : m;
  return true;
}

namespace {

struct LogState {
  int level = LOG_WARN;
  uint32_t mask = LOG_ALL;
  FILE* out = stderr;
  char host[64] = "?";
  std::mutex mu;
};

std::atomic<LogSink> g_sink{nullptr};

LogState& state() {
  static LogState* s = [] {
    auto* st = new LogState();  // intentionally leaked: usable during exit
    st->level = params::Debug();
    std::string why;
    if (!parse_log_subsys(params::DebugSubsys().c_str(), &st->mask, &why)) st->mask = LOG_ALL;
    gethostname(st->host, sizeof(st->host) - 1);
    if (char* dot = std::strchr(st->host, '.')) *dot = '\0';
    const std::string& file = params::DebugFile();
    if (!file.empty()) {
      std::string path;
      for (size_t i = 0; i < file.size(); ++i) {
        if (file[i] == '%' && i + 1 < file.size() && file[i + 1] == 'h') {
          path += st->host;
          ++i;
        } else if (file[i] == '%' && i + 1 < file.size() && file[i + 1] == 'p') {
          path += std::to_string(getpid());
          ++i;
        } else {
          path += file[i];
        }
      }
      if (FILE* f = std::fopen(path.c_str(), "w")) {
        std::setvbuf(f, nullptr, _IOLBF, 0);
        st->out = f;
      }
    }
    return st;
  }();
  return *s;
}

const char* subsys_name(uint32_t subsys) {
  switch (subsys) {
    case LOG_INIT: return "INIT";
    case LOG_CODEC: return "CODEC";
    case LOG_NET: return "NET";
    case LOG_ENV: return "ENV";
    case LOG_MODEL: return "MODEL";
    default: return "ALL";
  }
}

}  // namespace

void set_log_sink(LogSink sink) { g_sink.store(sink); }

bool log_enabled(LogLevel level, uint32_t subsys) {
  const LogState& s = state();
  return level <= s.level && (subsys & s.mask) != 0;
}

void log_message(LogLevel level, uint32_t subsys, const char* file, int line, const char* fmt,
                 ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (LogSink sink = g_sink.load()) {
    sink(level, subsys, msg);
    return;
  }
  LogState& s = state();
  static const char* names[] = {"NONE", "VERSION", "WARN", "INFO", "", "TRACE"};
  std::lock_guard<std::mutex> lk(s.mu);
  if (level == LOG_TRACE)
    std::fprintf(s.out, "%s:%d:%ld [kvxfer] %s %s %s:%d %s\n", s.host, getpid(),
                 (long)syscall(SYS_gettid), subsys_name(subsys), names[level], file, line, msg);
  else
    std::fprintf(s.out, "%s:%d:%ld [kvxfer] %s %s %s\n", s.host, getpid(),
                 (long)syscall(SYS_gettid), subsys_name(subsys), names[level], msg);
}

std::string LogThrottle::note(uint64_t count) {
  if (count <= 1) return std::string();
  char b[64];
  std::snprintf(b, sizeof b, " (%" PRIu64 " since the last such line)", count);
  return b;
}

}  // namespace kvxfer
