// The test-only exports of libnccl-net-kvxfer-test.so (test_hooks.h).
#include "net_plugin/test_hooks.h"

#include <algorithm>
#include <cstring>

#include "net_plugin/net.h"

extern "C" {

__attribute__((visibility("default"))) void kvxfer_net_test_inject(int fault) {
  kvxfer::netplugin::fault::arm(fault);
}

__attribute__((visibility("default"))) int kvxfer_net_test_comm_info(void* comm,
                                                                     kvxfer_net_test_info_t* out) {
  kvxfer::netplugin::CommInfo info;
  if (out == nullptr || !kvxfer::netplugin::comm_info(comm, &info)) return -1;
  std::memset(out, 0, sizeof(*out));
  out->kind = info.kind;
  out->nccl_class = info.nccl_class;
  out->tclass = info.tclass;
  out->dscp = info.dscp;
  out->local_len = std::min(info.local_len, sizeof(out->local));
  if (info.local != nullptr) std::memcpy(out->local, info.local, out->local_len);
  out->peer_len = std::min(info.peer_len, sizeof(out->peer));
  if (info.peer != nullptr) std::memcpy(out->peer, info.peer, out->peer_len);
  out->requests = info.requests;
  return 0;
}

__attribute__((visibility("default"))) int kvxfer_net_test_pending_connects(void) {
  return kvxfer::netplugin::pending_connects();
}

__attribute__((visibility("default"))) int kvxfer_net_test_live_contexts(void) {
  return kvxfer::netplugin::live_contexts();
}

}  // extern "C"
