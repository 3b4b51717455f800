// The one check of the public structs that carry `size`, `magic` and
// `version` (kvxfer.h, spec.h, spectrum.h, kvxfer_nccl.h).
//
// Fields are only ever appended to these structs, each new one at the
// previous sizeof (after any tail padding), so `size` tells exactly which
// fields the caller's header had.  A struct is accepted when
//   - magic is KVXFER_CONFIG_MAGIC;
//   - size is between the size of its first layout and sizeof here, and a
//     multiple of its alignment (every layout's sizeof is);
//   - version is of a kvxfer.h with this library's major, not newer in
//     major.minor.
// read_struct() copies an accepted struct over the INITIALIZER's values, so
// the fields an older, smaller struct lacks take their defaults, as NCCL does
// for ncclConfig_t.  A larger struct comes from a newer header and is
// refused.  Only the first 16 bytes (size, magic, version) are read before
// the size is checked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/error.h"
#include "kvxfer/kvxfer.h"
#include "kvxfer/spec.h"
#include "kvxfer/spectrum.h"

namespace kvxfer {

/** Per struct: its name in errors, its INITIALIZER, the size of its first layout. */
template <class T>
struct StructAbi;

#define KVXFER_STRUCT_ABI(T, NAME, INIT, FIRST_SIZE)                       \
  template <>                                                              \
  struct StructAbi<T> {                                                    \
    static constexpr const char* kName = NAME;                             \
    static constexpr const char* kInit = #INIT;                            \
    static constexpr size_t kFirstSize = FIRST_SIZE;                       \
    static T defaults() { return T INIT; }                                 \
    static_assert(kFirstSize <= sizeof(T) && kFirstSize % alignof(T) == 0, \
                  "the first layout of " #T " is not a prefix of it");     \
  }

/** KVXFER_VERSION_CODE of the first kvxfer.h (0.1.0). */
constexpr uint32_t kFirstVersionCode = 100;

/** Bytes of the common head: size, magic, version. */
constexpr size_t kStructHeadBytes = sizeof(size_t) + 2 * sizeof(uint32_t);

// The smallest layouts accepted: kvxfer_codec_config_t without value_groups,
// kvxfer_kv_desc_t without device, kvxfer_request_config_t without
// stream_layers.  The other structs have one layout.
KVXFER_STRUCT_ABI(kvxfer_codec_config_t, "codec config", KVXFER_CODEC_CONFIG_INITIALIZER,
                  offsetof(kvxfer_codec_config_t, value_groups));
KVXFER_STRUCT_ABI(kvxfer_kv_desc_t, "KV descriptor", KVXFER_KV_DESC_INITIALIZER,
                  offsetof(kvxfer_kv_desc_t, device));
KVXFER_STRUCT_ABI(kvxfer_comm_config_t, "communicator config", KVXFER_COMM_CONFIG_INITIALIZER,
                  sizeof(kvxfer_comm_config_t));
KVXFER_STRUCT_ABI(kvxfer_endpoint_config_t, "endpoint config", KVXFER_ENDPOINT_CONFIG_INITIALIZER,
                  sizeof(kvxfer_endpoint_config_t));
KVXFER_STRUCT_ABI(kvxfer_request_config_t, "request config", KVXFER_REQUEST_CONFIG_INITIALIZER,
                  offsetof(kvxfer_request_config_t, stream_layers));
KVXFER_STRUCT_ABI(kvxfer_kv_pool_desc_t, "KV pool descriptor", KVXFER_KV_POOL_DESC_INITIALIZER,
                  sizeof(kvxfer_kv_pool_desc_t));
KVXFER_STRUCT_ABI(kvxfer_kv_blocks_t, "blocks", KVXFER_KV_BLOCKS_INITIALIZER,
                  sizeof(kvxfer_kv_blocks_t));
KVXFER_STRUCT_ABI(kvxfer_request_info_t, "kvxfer_request_info_t", KVXFER_REQUEST_INFO_INITIALIZER,
                  sizeof(kvxfer_request_info_t));
KVXFER_STRUCT_ABI(kvxfer_spectrum_config_t, "spectrum config", KVXFER_SPECTRUM_CONFIG_INITIALIZER,
                  sizeof(kvxfer_spectrum_config_t));
KVXFER_STRUCT_ABI(kvxfer_spec_window_config_t, "window config",
                  KVXFER_SPEC_WINDOW_CONFIG_INITIALIZER, sizeof(kvxfer_spec_window_config_t));
KVXFER_STRUCT_ABI(kvxfer_spec_monitor_t, "monitor", KVXFER_SPEC_MONITOR_INITIALIZER,
                  sizeof(kvxfer_spec_monitor_t));
KVXFER_STRUCT_ABI(kvxfer_spec_model_input_t, "model input", KVXFER_SPEC_MODEL_INPUT_INITIALIZER,
                  sizeof(kvxfer_spec_model_input_t));
KVXFER_STRUCT_ABI(kvxfer_spec_model_output_t, "model output", KVXFER_SPEC_MODEL_OUTPUT_INITIALIZER,
                  sizeof(kvxfer_spec_model_output_t));

/**
 * Checks the head of `*p` (non-NULL) by the rule above; errors start with
 * `prefix`.  `min_size` is the smallest size accepted: the first layout's,
 * or sizeof(T) where the caller's struct is read in place.
 */
template <class T>
kvxfer_result_t check_struct(const T* p, const char* prefix = "",
                             size_t min_size = StructAbi<T>::kFirstSize) {
  using A = StructAbi<T>;
  KVXFER_REQUIRE(p != nullptr, "%s%s is NULL", prefix, A::kName);
  const size_t size = p->size;
  KVXFER_REQUIRE(p->magic == KVXFER_CONFIG_MAGIC,
                 "%s%s not initialised (size %zu, magic 0x%x): use %s", prefix, A::kName, size,
                 p->magic, A::kInit);
  KVXFER_REQUIRE(size <= sizeof(T),
                 "%s%s has size %zu, larger than the %zu bytes of this library's kvxfer.h (%d): "
                 "it comes from a newer header; link a kvxfer at least as new",
                 prefix, A::kName, size, sizeof(T), KVXFER_VERSION_CODE);
  KVXFER_REQUIRE(size >= min_size && size % alignof(T) == 0,
                 "%s%s not initialised (size %zu, magic 0x%x): the size must be %zu to %zu, a "
                 "multiple of %zu; use %s",
                 prefix, A::kName, size, p->magic, min_size, sizeof(T), alignof(T), A::kInit);
  KVXFER_REQUIRE(p->version / 10000 == KVXFER_MAJOR,
                 "%s%s from header version %u, library %d: the major version must match", prefix,
                 A::kName, p->version, KVXFER_VERSION_CODE);
  KVXFER_REQUIRE(p->version >= kFirstVersionCode,
                 "%s%s from header version %u is older than the first kvxfer.h (%u): no "
                 "header had it; use %s",
                 prefix, A::kName, p->version, kFirstVersionCode, A::kInit);
  KVXFER_REQUIRE(p->version / 100 <= KVXFER_VERSION_CODE / 100,
                 "%s%s from header version %u is newer than this library (%d)", prefix, A::kName,
                 p->version, KVXFER_VERSION_CODE);
  return KVXFER_SUCCESS;
}

/**
 * Checks `*p` (check_struct) and sets `*out` to the INITIALIZER's values with
 * the caller's first p->size bytes over them; out->size is then sizeof(T).
 */
template <class T>
kvxfer_result_t read_struct(const T* p, T* out, const char* prefix = "") {
  KVXFER_CHECK(check_struct(p, prefix));
  T t = StructAbi<T>::defaults();
  std::memcpy(static_cast<void*>(&t), static_cast<const void*>(p), p->size);
  t.size = sizeof(T);
  *out = t;
  return KVXFER_SUCCESS;
}

/**
 * read_struct for a pointer that may not point at readable memory: `copy(src,
 * len, dst)` copies without faulting and returns false when a byte is not
 * readable (codec::copy_in_checked), which is then an error.
 */
template <class T, class Copy>
kvxfer_result_t read_struct_probed(const T* p, T* out, Copy copy, const char* prefix = "") {
  using A = StructAbi<T>;
  KVXFER_REQUIRE(p != nullptr, "%s%s is NULL", prefix, A::kName);
  T t = A::defaults();
  KVXFER_REQUIRE(copy(p, kStructHeadBytes, &t), "%s%s at %p is not readable memory", prefix,
                 A::kName, static_cast<const void*>(p));
  KVXFER_CHECK(check_struct(&t, prefix));
  KVXFER_REQUIRE(copy(p, t.size, &t), "%s%s at %p is not readable memory", prefix, A::kName,
                 static_cast<const void*>(p));
  t.size = sizeof(T);
  *out = t;
  return KVXFER_SUCCESS;
}

/** check_struct for a struct read or written in place: it must have every field of T. */
template <class T>
kvxfer_result_t check_struct_in_place(const T* p, const char* prefix = "") {
  return check_struct(p, prefix, sizeof(T));
}

}  // namespace kvxfer
