// The exported NCCL net plugin tables: ncclNetPlugin_v11 (NCCL 2.28) and
// ncclNetPlugin_v10 (NCCL 2.26, 2.27).  This file is the C boundary: every
// entry point catches every exception and turns it into an ncclResult_t, so
// nothing C++ ever unwinds into NCCL.  The work is in net.cc.
#include <exception>
#include <mutex>
#include <new>

#include "net_plugin/log.h"
#include "net_plugin/nccl_net_abi.h"
#include "net_plugin/net.h"

namespace kvxfer::netplugin {
namespace {

template <typename F>
ncclResult_t guarded(const char* what, F&& f) noexcept {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    NP_WARN("%s: out of memory", what);
    return ncclSystemError;
  } catch (const std::exception& e) {
    NP_WARN("%s: internal error: %s", what, e.what());
    return ncclInternalError;
  } catch (...) {
    NP_WARN("%s: internal error (unknown exception)", what);
    return ncclInternalError;
  }
}

// ---- v11 -----------------------------------------------------------------
ncclResult_t init_v11(void** ctx, uint64_t comm_id, ncclNetCommConfig_v11_t* config,
                      ncclDebugLogger_t logger, ncclProfilerCallback_t /*profiler*/) {
  return guarded("init", [&] {
    const int tc = config != nullptr ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
    return net_init(ctx, comm_id, tc, logger);
  });
}
ncclResult_t devices(int* ndev) {
  return guarded("devices", [&] { return net_devices(ndev); });
}
ncclResult_t get_properties_v11(int dev, ncclNetProperties_v11_t* props) {
  return guarded("getProperties", [&] { return net_get_properties(dev, props); });
}
ncclResult_t listen_v11(void* ctx, int dev, void* handle, void** listen_comm) {
  return guarded("listen", [&] { return net_listen(ctx, dev, handle, listen_comm); });
}
ncclResult_t connect_v11(void* ctx, int dev, void* handle, void** send_comm,
                         ncclNetDeviceHandle_v11_t** /*send_dev_comm*/) {
  const ncclResult_t r =
      guarded("connect", [&] { return net_connect(ctx, dev, handle, send_comm, nullptr); });
  if (r != ncclSuccess) {
    // Never leave the handle naming an attempt that is gone.
    try {
      net_connect_abandon(handle);
    } catch (...) {
    }
    if (send_comm != nullptr) *send_comm = nullptr;
  }
  return r;
}
ncclResult_t accept_any(void* listen_comm, void** recv_comm, ncclNetDeviceHandle_v11_t** /*dev*/) {
  const ncclResult_t r = guarded("accept", [&] { return net_accept(listen_comm, recv_comm); });
  if (r != ncclSuccess && recv_comm != nullptr) *recv_comm = nullptr;
  return r;
}
ncclResult_t reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  return guarded("regMr", [&] { return net_reg_mr(comm, data, size, type, mhandle); });
}
ncclResult_t reg_mr_dmabuf(void* /*comm*/, void* /*data*/, size_t /*size*/, int /*type*/,
                           uint64_t /*offset*/, int /*fd*/, void** mhandle) {
  if (mhandle != nullptr) *mhandle = nullptr;
  NP_WARN("regMrDmaBuf: DMA-BUF registration is not supported (ptrSupport has no DMABUF)");
  return ncclInternalError;
}
ncclResult_t dereg_mr(void* comm, void* mhandle) {
  return guarded("deregMr", [&] { return net_dereg_mr(comm, mhandle); });
}
ncclResult_t isend(void* send_comm, void* data, size_t size, int tag, void* mhandle,
                   void* /*phandle*/, void** request) {
  const ncclResult_t r =
      guarded("isend", [&] { return net_isend(send_comm, data, size, tag, mhandle, request); });
  if (r != ncclSuccess && request != nullptr) *request = nullptr;
  return r;
}
ncclResult_t irecv(void* recv_comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                   void** /*phandles*/, void** request) {
  const ncclResult_t r = guarded(
      "irecv", [&] { return net_irecv(recv_comm, n, data, sizes, tags, mhandles, request); });
  if (r != ncclSuccess && request != nullptr) *request = nullptr;
  return r;
}
ncclResult_t iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles,
                    void** request) {
  return guarded("iflush",
                 [&] { return net_iflush(recv_comm, n, data, sizes, mhandles, request); });
}
ncclResult_t test(void* request, int* done, int* sizes) {
  return guarded("test", [&] { return net_test(request, done, sizes); });
}
ncclResult_t close_send(void* send_comm) {
  return guarded("closeSend", [&] { return net_close_send(send_comm); });
}
ncclResult_t close_recv(void* recv_comm) {
  return guarded("closeRecv", [&] { return net_close_recv(recv_comm); });
}
ncclResult_t close_listen(void* listen_comm) {
  return guarded("closeListen", [&] { return net_close_listen(listen_comm); });
}
ncclResult_t finalize(void* ctx) {
  return guarded("finalize", [&] { return net_finalize(ctx); });
}
ncclResult_t set_net_attr(void* /*ctx*/, ncclNetAttr_v11_t* /*attr*/) {
  return ncclSuccess;  // hints only; one endpoint per comm needs none of them
}

// ---- v10 -----------------------------------------------------------------
// One process-wide context without a traffic class; each connect() brings
// its own class.
void* g_v10_ctx = nullptr;
std::mutex g_v10_mu;

ncclResult_t init_v10(ncclDebugLogger_t logger, ncclProfilerCallback_t /*profiler*/) {
  return guarded("init", [&] {
    std::lock_guard<std::mutex> lk(g_v10_mu);
    if (g_v10_ctx != nullptr) return ncclSuccess;
    return net_init(&g_v10_ctx, 0, NCCL_NET_TRAFFIC_CLASS_UNDEF, logger);
  });
}
ncclResult_t get_properties_v10(int dev, ncclNetProperties_v10_t* props) {
  return guarded("getProperties", [&] {
    ncclNetProperties_v11_t p11;
    const ncclResult_t r = net_get_properties(dev, &p11);
    if (r != ncclSuccess) return r;
    props->name = p11.name;
    props->pciPath = p11.pciPath;
    props->guid = p11.guid;
    props->ptrSupport = p11.ptrSupport;
    props->regIsGlobal = p11.regIsGlobal;
    props->forceFlush = p11.forceFlush;
    props->speed = p11.speed;
    props->port = p11.port;
    props->latency = p11.latency;
    props->maxComms = p11.maxComms;
    props->maxRecvs = p11.maxRecvs;
    props->netDeviceType = p11.netDeviceType;
    props->netDeviceVersion = p11.netDeviceVersion;
    props->vProps = p11.vProps;
    props->maxP2pBytes = p11.maxP2pBytes;
    props->maxCollBytes = p11.maxCollBytes;
    return ncclSuccess;
  });
}
ncclResult_t listen_v10(int dev, void* handle, void** listen_comm) {
  return guarded("listen", [&] { return net_listen(g_v10_ctx, dev, handle, listen_comm); });
}
ncclResult_t connect_v10(int dev, ncclNetCommConfig_v10_t* config, void* handle, void** send_comm,
                         ncclNetDeviceHandle_v10_t** /*send_dev_comm*/) {
  const ncclResult_t r = guarded("connect", [&] {
    const int* tc = config != nullptr ? &config->trafficClass : nullptr;
    return net_connect(g_v10_ctx, dev, handle, send_comm, tc);
  });
  if (r != ncclSuccess) {
    try {
      net_connect_abandon(handle);
    } catch (...) {
    }
    if (send_comm != nullptr) *send_comm = nullptr;
  }
  return r;
}

}  // namespace
}  // namespace kvxfer::netplugin

using namespace kvxfer::netplugin;  // NOLINT: the tables below name the wrappers

extern "C" {

// One slot per line, in the order of nccl_net_abi.h (NCCL's net_v11.h and
// net_v10.h), named as NCCL names them.
// clang-format off
__attribute__((visibility("default"))) ncclNet_v11_t ncclNetPlugin_v11 = {
    "kvxfer",            // name
    init_v11,            // init
    devices,             // devices
    get_properties_v11,  // getProperties
    listen_v11,          // listen
    connect_v11,         // connect
    accept_any,          // accept
    reg_mr,              // regMr
    reg_mr_dmabuf,       // regMrDmaBuf
    dereg_mr,            // deregMr
    isend,               // isend
    irecv,               // irecv
    iflush,              // iflush
    test,                // test
    close_send,          // closeSend
    close_recv,          // closeRecv
    close_listen,        // closeListen
    nullptr,             // getDeviceMr: no device offload
    nullptr,             // irecvConsumed: no device offload
    nullptr,             // makeVDevice: NCCL then uses the physical devices
    finalize,            // finalize
    set_net_attr,        // setNetAttr
};

__attribute__((visibility("default"))) ncclNet_v10_t ncclNetPlugin_v10 = {
    "kvxfer",            // name
    init_v10,            // init
    devices,             // devices
    get_properties_v10,  // getProperties
    listen_v10,          // listen
    connect_v10,         // connect
    accept_any,          // accept
    reg_mr,              // regMr
    reg_mr_dmabuf,       // regMrDmaBuf
    dereg_mr,            // deregMr
    isend,               // isend
    irecv,               // irecv
    iflush,              // iflush
    test,                // test
    close_send,          // closeSend
    close_recv,          // closeRecv
    close_listen,        // closeListen
    nullptr,             // getDeviceMr: no device offload
    nullptr,             // irecvConsumed: no device offload
    nullptr,             // makeVDevice: NCCL then uses the physical devices
};
// clang-format on

}  // extern "C"
