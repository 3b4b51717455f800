// A registered KV pool (kvxfer_kv_pool_register, include/kvxfer/kvxfer.h):
// validated once, then turned into the pointer-table descriptor of each
// request that names block ids (kvxfer_send_blocks / kvxfer_recv_blocks),
// whose memory is then not probed again.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::xfer {

class Request;

/** What a request names of a pool: its block ids, in order, and its heads. */
struct BlockSpan {
  std::vector<int32_t> ids;
  int32_t head_begin = 0, head_end = 0;  // [head_begin, head_end)
};

/** Immutable after create, but for the requests that name it (under mu_). */
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
   * `span`, when not null, receives the ids used and the heads.
   * Thread-safe.
   */
  kvxfer_result_t describe(const kvxfer_kv_blocks_t* blocks, bool writes, std::vector<void*>* k,
                           std::vector<void*>* v, kvxfer_kv_desc_t* out,
                           BlockSpan* span = nullptr) const;

  /**
   * Posts a request that names `span` of this pool with `post`, which
   * returns the request it made, and remembers it (until it is final).
   * `writes` (a receive): refused first, with KVXFER_ERR_INVALID_USAGE
   * naming the block and both head ranges, when a receive in flight on the
   * pool writes heads of one of its blocks that overlap its own; two
   * receives may share a block with disjoint heads (heterogeneous tensor
   * parallelism).  Posts on one pool are serialised.  Thread-safe.
   */
  kvxfer_result_t post(const BlockSpan& span, bool writes,
                       const std::function<kvxfer_result_t(std::shared_ptr<Request>*)>& post);
  /** Requests that name this pool and have not reached a final stage.  Thread-safe. */
  int64_t in_flight() const;

 private:
  KvPool() = default;
  kvxfer_kv_pool_desc_t d_{};
  int64_t row_stride_ = 0, block_stride_ = 0;
  std::vector<uint8_t*> k_layers_, v_layers_;
  mutable std::mutex mu_;
  mutable std::vector<std::weak_ptr<Request>> users_;
  // The receives in flight by block id, with their heads (under mu_); an
  // entry whose request is final is dropped when next met.
  struct Writer {
    std::weak_ptr<Request> req;
    int32_t head_begin, head_end;
  };
  std::unordered_map<int32_t, std::vector<Writer>> writers_;
};

}  // namespace kvxfer::xfer
