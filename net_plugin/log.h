// Logging of the NCCL net plugin: through the logger NCCL hands to init(), so
// that NCCL_DEBUG and NCCL_DEBUG_SUBSYS govern the plugin like the rest of
// NCCL.  Every line starts with "NET/kvxfer : ".  The libfabric layer's own
// messages (src/transport, which logs through common/log.h) are forwarded to
// the same logger by a log sink.  Before init() (or when NCCL passes no
// logger) lines go to kvxfer's own logger, under KVXFER_DEBUG.
#pragma once

#include "net_plugin/nccl_net_abi.h"

namespace kvxfer::netplugin {

/** Installs NCCL's logger (null keeps the current one) and the transport sink. */
void set_nccl_logger(ncclDebugLogger_t logger);

void log_line(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
              const char* fmt, ...) __attribute__((format(printf, 5, 6)));

}  // namespace kvxfer::netplugin

#define NP_WARN(...) \
  ::kvxfer::netplugin::log_line(NCCL_LOG_WARN, NCCL_NET, __FILE__, __LINE__, __VA_ARGS__)
#define NP_INFO(flags, ...) \
  ::kvxfer::netplugin::log_line(NCCL_LOG_INFO, flags, __FILE__, __LINE__, __VA_ARGS__)
