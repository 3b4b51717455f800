#include "net_plugin/log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>

#include "common/log.h"

namespace kvxfer::netplugin {

namespace {

std::atomic<ncclDebugLogger_t> g_logger{nullptr};

// The transport's messages (common/log.h) to NCCL's logger.
void transport_sink(LogLevel level, uint32_t subsys, const char* msg) {
  ncclDebugLogger_t logger = g_logger.load();
  if (logger == nullptr) return;
  const ncclDebugLogLevel l = level <= LOG_WARN   ? NCCL_LOG_WARN
                              : level == LOG_INFO ? NCCL_LOG_INFO
                                                  : NCCL_LOG_TRACE;
  unsigned long flags = NCCL_NET;
  if (subsys == LOG_ENV) flags |= NCCL_ENV;
  if (subsys == LOG_INIT) flags |= NCCL_INIT;
  logger(l, flags, "transport", 0, "NET/kvxfer : %s", msg);
}

}  // namespace

void set_nccl_logger(ncclDebugLogger_t logger) {
  if (logger == nullptr) return;
  g_logger.store(logger);
  set_log_sink(&transport_sink);
}

void log_line(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
              const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (ncclDebugLogger_t logger = g_logger.load()) {
    logger(level, flags, file, line, "NET/kvxfer : %s", msg);
    return;
  }
  const LogLevel l = level <= NCCL_LOG_WARN   ? LOG_WARN
                     : level == NCCL_LOG_INFO ? LOG_INFO
                                              : LOG_TRACE;
  if (log_enabled(l, LOG_NET)) log_message(l, LOG_NET, file, line, "NET/kvxfer : %s", msg);
}

}  // namespace kvxfer::netplugin
