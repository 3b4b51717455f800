// Internal pieces of the NCCL backend (include/kvxfer/kvxfer_nccl.h), exposed
// for tests/nccl_test.cc: the argument checks run without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvxfer/kvxfer_nccl.h"

namespace kvxfer::nccl {

/** Effective options: defaults applied (timeout_ms 0 -> KVXFER_TIMEOUT_MS). */
struct Options {
  int32_t anchor_tc = 0, residual_tc = 1;
  int64_t timeout_ms = 30000;
};

/**
 * Checks a kvxfer_nccl_config_t (NULL = defaults) and fills *out.
 * KVXFER_ERR_INVALID_ARGUMENT naming the field: size/magic, a traffic class
 * below -1, a negative timeout.
 */
kvxfer_result_t check_config(const kvxfer_nccl_config_t* cfg, Options* out);

/**
 * Every host-side check of op `index` of a kvxfer_nccl_xfer call on a
 * communicator of `nranks` ranks on CUDA device `device`: the op struct, the
 * peer, the KV descriptor (shape, dtype, device, block tables; the block
 * pointers themselves are device memory and are not dereferenced) and, for a
 * sender, the codec, mode and page count.  Touches no device.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (text starts with "op <index>: ");
 * KVXFER_ERR_UNSUPPORTED (host KV, device -1; alpha = auto).
 */
kvxfer_result_t validate_op(const kvxfer_nccl_op_t* op, int index, int nranks, int device);

/** Bytes of the fixed status block of the protocol (result + text, padded): 1040. */
size_t status_block_bytes();

}  // namespace kvxfer::nccl
