// A registered KV pool (kvxfer_kv_pool_register, include/kvxfer/kvxfer.h):
// validated once, then turned into the pointer-table descriptor of each
// request that names block ids (kvxfer_send_blocks / kvxfer_recv_blocks),
// whose memory is then not probed again.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::xfer {

class Request;

/** Immutable after create, but for the list of requests that name it (under mu_). */
class KvPool {
 public:
  /**
   * Validates `desc` (kvxfer_kv_pool_register's rules: its fields, then every
   * block through codec::validate_kv_desc with write access, host memory
   * only) and copies what it needs.  Errors: KVXFER_ERR_INVALID_ARGUMENT,
   * message prefixed "KV pool: ".  Thread-safe.
   */
  static kvxfer_result_t create(const kvxfer_kv_pool_desc_t* desc, std::unique_ptr<KvPool>* out);

  /**
   * The descriptor of `blocks` on this pool: *k and *v receive its block
   * tables (num_layers x blocks used), which `*out` points into, so they must
   * outlive its use.  `writes`: for a receive, which may not name a block
   * twice (two tokens' rows would land in one place).  Errors:
   * KVXFER_ERR_INVALID_ARGUMENT naming the field, the first out-of-range id
   * by index and value, or (writes) a repeated id by both indices.
   * Thread-safe.
   */
  kvxfer_result_t describe(const kvxfer_kv_blocks_t* blocks, bool writes, std::vector<void*>* k,
                           std::vector<void*>* v, kvxfer_kv_desc_t* out) const;

  /** Remembers that `r` names this pool (until it is final).  Thread-safe. */
  void track(const std::shared_ptr<Request>& r);
  /** Requests that name this pool and have not reached a final stage.  Thread-safe. */
  int64_t in_flight() const;

 private:
  KvPool() = default;
  kvxfer_kv_pool_desc_t d_{};
  int64_t row_stride_ = 0, block_stride_ = 0;
  std::vector<uint8_t*> k_layers_, v_layers_;
  mutable std::mutex mu_;
  mutable std::vector<std::weak_ptr<Request>> users_;
};

}  // namespace kvxfer::xfer
