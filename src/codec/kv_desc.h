// The one validation of a kvxfer_kv_desc_t (include/kvxfer/kvxfer.h), shared
// by kvxfer_send/recv (xfer/engine.cc) and the NCCL backend
// (nccl_backend/nccl_backend.cc), so that both accept exactly the same descriptors and
// name the same field in the same words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvxfer/kvxfer.h"

namespace kvxfer::codec {

/** Bounds of a descriptor, chosen so that every size computed from it fits
 *  in 63 bits (the 2^32 token bound is the page format's, format.h). */
constexpr int64_t kMaxDescTokens = int64_t{1} << 32;
constexpr int64_t kMaxDescBlocks = int64_t{1} << 32;  // num_layers * num_blocks
constexpr int32_t kMaxDescChannels = 65535;           // kv_heads * head_dim

/** What a valid descriptor describes. */
struct KvDesc {
  int64_t channels = 0;     // kv_heads * head_dim
  int64_t row_stride = 0;   // elements; the descriptor's 0 resolved to `channels`
  int64_t blocks_used = 0;  // ceil(num_tokens / block_size) per layer
  uint64_t kv_bytes = 0;    // num_layers * 2 * num_tokens * channels * element size
  // Copies of the two block tables ([num_layers * num_blocks] each), read
  // with a probe that cannot crash; empty when num_tokens is 0.
  std::vector<void*> k_blocks, v_blocks;
};

/** How the caller will use host blocks: what the memory probe checks. */
enum class KvAccess {
  kRead,   // the sender reads them
  kWrite,  // the receiver writes them
  kNone,   // not probed (a caller that refuses host memory itself)
};

/**
 * Checks `kv` and fills `*out`.  Every failure returns at once with a
 * message that starts with `prefix` ("" or "op 3: ") and names the field;
 * nothing is kept.
 *
 * Structure: size, magic and version (the header's major.minor); num_layers,
 * kv_heads, head_dim >= 1 with kv_heads * head_dim <= 65535; dtype; 0 <=
 * num_tokens <= 2^32; block_size >= 1; row_stride >= channels; num_blocks
 * holds num_tokens and num_layers * num_blocks <= 2^32; the byte size of one
 * block below 2^62.  INVALID_ARGUMENT.
 *
 * Memory, when num_tokens > 0: both tables must be readable (copied with
 * process_vm_readv, so a bad table pointer is an error, not a crash); every
 * block a token lives in is non-NULL and aligned to the element size.  For
 * host memory (device -1) the first and last used byte of every such block
 * must be readable (kRead) or writable (kWrite; no two blocks then share
 * a byte of their rows), probed with
 * process_vm_readv/writev in batches of 1024, and every page between them
 * mapped (mincore); a mapped but protected page between them is not caught.
 * The write probe writes back the bytes it read, so nothing may write those
 * blocks during the call (the descriptor's contract: they belong to the
 * request from the post on).  Device pointers are left to the CUDA checks.
 *
 * Thread-safe.
 */
kvxfer_result_t validate_kv_desc(const kvxfer_kv_desc_t* kv, KvAccess access,
                                 const std::string& prefix, KvDesc* out);

/**
 * True when two runs of rows share a byte: rows of `row` bytes every
 * `stride` bytes (stride >= row), the second run's base `gap` bytes after the
 * first's (gap may be negative), for row-index differences d (the second's
 * row minus the first's) in [lo, hi]: some such d has -row < gap + d * stride
 * < row.  Only the d nearest -gap / stride can, so three are tried.  Every
 * gap + d * stride must fit in int64.  The one test of KV blocks that
 * interleave (the pool's regions, a receive's blocks).
 */
inline bool strided_rows_meet(int64_t gap, int64_t lo, int64_t hi, int64_t stride, int64_t row) {
  const int64_t d0 = -gap / stride;
  for (int64_t d : {d0 - 1, d0, d0 + 1})
    if (d >= lo && d <= hi && gap + d * stride < row && gap + d * stride > -row) return true;
  return false;
}

/**
 * Copies `len` bytes at `src` into `dst` without trusting `src`: false (and
 * no fault) if any of them is not readable memory (the probe of
 * validate_kv_desc).  Thread-safe.
 */
bool copy_in_checked(const void* src, size_t len, void* dst);

/**
 * Copies the NUL-terminated string at `src` into `*out` without trusting
 * `src` (copy_in_checked, a page at a time): false when a byte before the
 * NUL is not readable memory or no NUL comes within `max` bytes.  Thread-safe.
 */
bool read_string_checked(const char* src, size_t max, std::string* out);

/**
 * Reads the caller's descriptor `kv` (struct_abi.h's rule: an older, smaller
 * one is accepted) into `*out`, the fields it lacks at their
 * KVXFER_KV_DESC_INITIALIZER values.  Reads it with process_vm_readv, as
 * validate_kv_desc (which calls it), so an unreadable `kv` is an error.
 */
kvxfer_result_t read_kv_desc(const kvxfer_kv_desc_t* kv, const std::string& prefix,
                             kvxfer_kv_desc_t* out);

}  // namespace kvxfer::codec
