// Endpoints for the benchmarks that use them (perf/endpoint_perf,
// perf/mesh_perf): one on 127.0.0.1 with its address, and a request config
// matched by id.  Header-only: libkvxfer's C API and nothing of the harness.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::perf {

/**
 * kvxfer_endpoint_create on 127.0.0.1:`port` (0: any) with `timeout_ms`;
 * *addr receives its address blob.  nullptr on failure, after printing the
 * library's message prefixed by `tool` to stderr.
 */
inline kvxfer_comm_t make_endpoint(const char* tool, int timeout_ms, int port,
                                   std::vector<uint8_t>* addr) {
  kvxfer_endpoint_config_t cfg = KVXFER_ENDPOINT_CONFIG_INITIALIZER;
  cfg.timeout_ms = timeout_ms;
  cfg.bind_address = "127.0.0.1";
  cfg.port = port;
  kvxfer_comm_t ep = nullptr;
  if (kvxfer_endpoint_create(&ep, &cfg) != KVXFER_SUCCESS) {
    std::fprintf(stderr, "%s: kvxfer_endpoint_create: %s\n", tool, kvxfer_get_last_error());
    return nullptr;
  }
  addr->resize(KVXFER_ENDPOINT_ADDRESS_MAX);
  size_t n = addr->size();
  kvxfer_endpoint_address(ep, addr->data(), &n);
  addr->resize(n);
  return ep;
}

/** A request config matched by id `id`, `page_tokens` per page (0: the default). */
inline kvxfer_request_config_t by_id(uint64_t id, int32_t page_tokens = 0) {
  kvxfer_request_config_t rc = KVXFER_REQUEST_CONFIG_INITIALIZER;
  rc.page_tokens = page_tokens;
  rc.match_by_id = 1;
  rc.request_id = id;
  return rc;
}

}  // namespace kvxfer::perf
