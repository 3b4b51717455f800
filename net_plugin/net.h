// The plugin's implementation behind the v11 and v10 function tables
// (plugin.cc).  Each function mirrors one NCCL call and returns its
// ncclResult_t, logging a WARN for every error.  They may throw (allocation
// failures, injected faults); plugin.cc catches everything at the C boundary.
//
// Design (docs/NET_PLUGIN.md):
//  * One context per init(): NCCL's communicator id and its traffic class,
//    resolved through KVXFER_NET_TC_MAP to a libfabric tclass and a DSCP.
//  * One transport::Domain + transport::Endpoint (src/transport/ofi.h) per
//    listen/send/recv comm, so that the comms NCCL drives from different
//    threads never share a libfabric domain (FI_THREAD_DOMAIN).
//  * Connection: the connecting endpoint sends a connect request (its address,
//    its class, the listen's nonce) to the listening endpoint, which answers
//    with an acknowledgement.  Both sides mark their sockets with the DSCP
//    before the first data message.
//  * Data: each message is one tagged libfabric message.  Its tag is the NCCL
//    tag and a per-tag sequence number, so the k-th isend with tag t matches
//    the k-th receive posted for tag t: receives match in posting order, and
//    the receives of a grouped irecv match by tag.
#pragma once

#include <cstddef>
#include <cstdint>

#include "net_plugin/nccl_net_abi.h"

namespace kvxfer::netplugin {

constexpr int kMaxRecvs = 8;          // largest n of a grouped irecv (props.maxRecvs)
constexpr int kRequestsPerComm = 64;  // NCCL keeps at most NCCL_NET_MAX_REQUESTS in flight
constexpr uint64_t kCtrlTagBit = 1ull << 62;
constexpr int kSeqBits = 30;

/** The libfabric tag of the message with NCCL tag `tag` and per-tag sequence `seq`. */
inline uint64_t data_tag(int tag, uint32_t seq) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(tag)) << kSeqBits) |
         (seq & ((1u << kSeqBits) - 1));
}

ncclResult_t net_init(void** ctx, uint64_t comm_id, int traffic_class, ncclDebugLogger_t logger);
ncclResult_t net_finalize(void* ctx);
ncclResult_t net_devices(int* ndev);
/** Fills the v11 properties; the v10 table copies the common fields. */
ncclResult_t net_get_properties(int dev, ncclNetProperties_v11_t* props);
ncclResult_t net_listen(void* ctx, int dev, void* handle, void** listen_comm);
/**
 * `class_override`: the v10 ABI passes the traffic class with each connect;
 * null = the context's class.
 */
ncclResult_t net_connect(void* ctx, int dev, void* handle, void** send_comm,
                         const int* class_override);
/** Drops the connection attempt recorded in `handle`, if any (after an exception). */
void net_connect_abandon(void* handle);
ncclResult_t net_accept(void* listen_comm, void** recv_comm);
ncclResult_t net_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle);
ncclResult_t net_dereg_mr(void* comm, void* mhandle);
ncclResult_t net_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                       void** request);
ncclResult_t net_irecv(void* recv_comm, int n, void** data, size_t* sizes, int* tags,
                       void** mhandles, void** request);
ncclResult_t net_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                        void** request);
ncclResult_t net_test(void* request, int* done, int* sizes);
ncclResult_t net_close_send(void* send_comm);
ncclResult_t net_close_recv(void* recv_comm);
ncclResult_t net_close_listen(void* listen_comm);

// Fault injection and inspection for tests/net_plugin (test_hooks.h).
namespace fault {
enum Point : int { kNone = 0, kConnectAfterStage = 1, kAcceptBadAlloc = 2, kIsendThrow = 3 };
void arm(int point);
/** Throws if `p` is armed (and disarms it). */
void hit(Point p);
}  // namespace fault
struct CommInfo {
  int kind = 0;
  int nccl_class = -1;
  uint32_t tclass = 0;
  int dscp = -1;
  const uint8_t* local = nullptr;
  size_t local_len = 0;
  const uint8_t* peer = nullptr;
  size_t peer_len = 0;
  int requests = 0;
};
bool comm_info(void* comm, CommInfo* out);
int pending_connects();
int live_contexts();

}  // namespace kvxfer::netplugin
