// The connection handle: what listen() writes into NCCL's
// NCCL_NET_HANDLE_MAXSIZE-byte buffer and NCCL carries to the peer's
// connect().  The connecting side keeps the id of its connection attempt in
// `stage` between its non-blocking connect() calls; listen() writes 0 there.
// Fields are read and written with memcpy (NCCL's buffer has no alignment).
#pragma once

#include <cstddef>
#include <cstdint>

#include "net_plugin/nccl_net_abi.h"

namespace kvxfer::netplugin {

constexpr uint32_t kHandleMagic = 0x4E58564B;  // "KVXN"
constexpr uint8_t kHandleVersion = 1;
constexpr size_t kMaxProviderName = 24;
constexpr size_t kMaxEpName = 72;

struct Handle {
  uint32_t magic;
  uint8_t version;
  uint8_t name_len;      // bytes used in name
  uint8_t provider_len;  // bytes used in provider
  uint8_t reserved0;
  uint64_t listen_id;               // nonce of this listen; the connect request carries it back
  char provider[kMaxProviderName];  // the listener's libfabric provider ("tcp;ofi_rxm")
  uint8_t name[kMaxEpName];         // the listening endpoint's address (fi_getname)
  uint64_t stage;                   // connecting side: id of its attempt; 0 = none
  uint64_t reserved1;
};
static_assert(sizeof(Handle) == NCCL_NET_HANDLE_MAXSIZE, "the handle fills NCCL's buffer");
constexpr size_t kHandleStageOffset = offsetof(Handle, stage);

}  // namespace kvxfer::netplugin
