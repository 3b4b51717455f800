// Internal entry points of the communicator API (xfer_api.cc) for tests and
// benchmarks.  Not installed; C++ names, so libkvxfer.map keeps them local.
#pragma once

#include <memory>

#include "kvxfer/kvxfer.h"
#include "xfer/test_hooks.h"

namespace kvxfer::api {

/**
 * kvxfer_comm_init, with `hooks` (test_hooks.h; may be null) handed to the
 * engine, which shares them with the caller for the communicator's life.
 * Same arguments, errors and threading as kvxfer_comm_init; its errors name
 * kvxfer_comm_init.
 */
kvxfer_result_t comm_init(kvxfer_comm_t* comm, int nranks, kvxfer_unique_id_t id, int rank,
                          const kvxfer_comm_config_t* config,
                          std::shared_ptr<xfer::TestHooks> hooks);

/** kvxfer_endpoint_create with `hooks` (as comm_init). */
kvxfer_result_t endpoint_create(kvxfer_comm_t* ep, const kvxfer_endpoint_config_t* config,
                                std::shared_ptr<xfer::TestHooks> hooks);

}  // namespace kvxfer::api
