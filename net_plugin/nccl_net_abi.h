// The NCCL net plugin ABI, versions 10 and 11, declared by kvxfer.
//
// Written field for field from NCCL's public ext-net headers
// (ext-net/example/nccl/{err,common,net,net_device,net_v10,net_v11}.h) and
// checked against the debug information of the NCCL 2.28.9 library installed
// on the development machines (/usr/local/cuda/lib64/libnccl.so.2):
// ncclNet_v11_t is 176 bytes, ncclNetProperties_v11_t 112, ncclNet_v10_t 160
// and ncclNetProperties_v10_t 104.  The static_asserts at the end pin those
// layouts.
//
//   v11: NCCL 2.28.  init() runs once per communicator and receives that
//        communicator's traffic class; listen()/connect() take the context
//        that init() returned; finalize(ctx) ends it.
//   v10: NCCL 2.26 and 2.27.  init() runs once per process; the traffic class
//        arrives with each connect().
//
// Only what a plugin needs is declared: types, constants and the two function
// tables.  Comments state the contract as kvxfer implements it; NCCL's own
// headers are the authority.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------
// Results, logging and profiling (err.h, common.h)
// ---------------------------------------------------------------------------
/** NCCL's result codes.  A plugin returns only these (no ncclInvalidUsage). */
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclRemoteError = 6
} ncclResult_t;

typedef enum {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5
} ncclDebugLogLevel;

/** Subsystem flags of a log line (NCCL_DEBUG_SUBSYS). */
typedef enum {
  NCCL_INIT = 1,
  NCCL_COLL = 2,
  NCCL_P2P = 4,
  NCCL_SHM = 8,
  NCCL_NET = 16,
  NCCL_GRAPH = 32,
  NCCL_TUNING = 64,
  NCCL_ENV = 128,
  NCCL_ALLOC = 256,
  NCCL_CALL = 512,
  NCCL_PROXY = 1024,
  NCCL_NVLS = 2048,
  NCCL_BOOTSTRAP = 4096,
  NCCL_REG = 8192,
  NCCL_ALL = ~0
} ncclDebugLogSubSys;

/** NCCL's logger; it applies NCCL_DEBUG and NCCL_DEBUG_SUBSYS itself. */
typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file,
                                  int line, const char* fmt, ...);

/** The profiler's callback for network events (kvxfer does not emit any). */
typedef ncclResult_t (*ncclProfilerCallback_t)(void** eHandle, int type, void* pHandle,
                                               int64_t pluginId, void* extData);

// ---------------------------------------------------------------------------
// Constants (net.h, net_device.h)
// ---------------------------------------------------------------------------
#define NCCL_NET_HANDLE_MAXSIZE 128
#define NCCL_MAX_NET_SIZE_BYTES (1 * 1024 * 1024 * 1024 * 1024L)
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4
/** Requests a comm may have in flight. */
#define NCCL_NET_MAX_REQUESTS 32
#define NCCL_NET_MAX_DEVS_PER_NIC 4
#define NCCL_NET_TRAFFIC_CLASS_UNDEF -1
#define NCCL_NET_DEVICE_INVALID_VERSION 0x0

/** Network offload type; kvxfer is NCCL_NET_DEVICE_HOST (no device code). */
typedef enum {
  NCCL_NET_DEVICE_HOST = 0,
  NCCL_NET_DEVICE_UNPACK = 1,
  NCCL_NET_DEVICE_GIN_PROXY = 2,
  NCCL_NET_DEVICE_GIN_GDAKI = 3
} ncclNetDeviceType;

/** Device offload handle (the same layout since v7); kvxfer never fills one. */
typedef struct {
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  void* handle;
  size_t size;
  int needsProxyProgress;
} ncclNetDeviceHandle_v7_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v10_t;
typedef ncclNetDeviceHandle_v7_t ncclNetDeviceHandle_v11_t;

// ---------------------------------------------------------------------------
// Version 10 (NCCL 2.26, 2.27)
// ---------------------------------------------------------------------------
typedef struct {
  int ndevs;                            // physical devices behind this virtual one
  int devs[NCCL_NET_MAX_DEVS_PER_NIC];  // their indices
} ncclNetVDeviceProps_v10_t;

typedef struct {
  int trafficClass;  // plugin-defined; NCCL_NET_TRAFFIC_CLASS_UNDEF when unset
} ncclNetCommConfig_v10_t;

typedef struct {
  char* name;                       // device name, for logs
  char* pciPath;                    // sysfs path of the PCI function (NULL: none)
  uint64_t guid;                    // identifies the NIC chip across its PCI functions
  int ptrSupport;                   // NCCL_PTR_* the plugin can send from / receive into
  int regIsGlobal;                  // registrations usable by every comm
  int forceFlush;                   // NCCL must call iflush after receives
  int speed;                        // Mbit/s
  int port;                         // port number
  float latency;                    // microseconds, added to NCCL's model
  int maxComms;                     // comms the device supports
  int maxRecvs;                     // largest n of a grouped irecv
  ncclNetDeviceType netDeviceType;  // offload type
  int netDeviceVersion;             // offload version
  ncclNetVDeviceProps_v10_t vProps;
  size_t maxP2pBytes;   // largest point-to-point message
  size_t maxCollBytes;  // largest collective message
} ncclNetProperties_v10_t;

typedef struct {
  const char* name;
  // Once per process.
  ncclResult_t (*init)(ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v10_t* props);
  // Writes a handle of at most NCCL_NET_HANDLE_MAXSIZE bytes for the peer.
  ncclResult_t (*listen)(int dev, void* handle, void** listenComm);
  // Never blocks: *sendComm stays NULL until the connection is ready; NCCL
  // calls again with the same handle.
  ncclResult_t (*connect)(int dev, ncclNetCommConfig_v10_t* config, void* handle, void** sendComm,
                          ncclNetDeviceHandle_v10_t** sendDevComm);
  // Never blocks: *recvComm stays NULL until a peer has connected.
  ncclResult_t (*accept)(void* listenComm, void** recvComm,
                         ncclNetDeviceHandle_v10_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  // *request == NULL on success means "busy, call again".
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                        void* phandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                        void** mhandles, void** phandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  // *done = 1 when finished; sizes (if not NULL) receives the bytes moved.
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  // May be NULL: NCCL then uses the physical devices only.
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v10_t* props);
} ncclNet_v10_t;

// ---------------------------------------------------------------------------
// Version 11 (NCCL 2.28)
// ---------------------------------------------------------------------------
typedef ncclNetVDeviceProps_v10_t ncclNetVDeviceProps_v11_t;
typedef ncclNetCommConfig_v10_t ncclNetCommConfig_v11_t;

typedef struct {
  char* name;
  char* pciPath;
  uint64_t guid;
  int ptrSupport;
  int regIsGlobal;
  int forceFlush;
  int speed;
  int port;
  float latency;
  int maxComms;
  int maxRecvs;
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  ncclNetVDeviceProps_v11_t vProps;
  size_t maxP2pBytes;
  size_t maxCollBytes;
  int maxMultiRequestSize;  // requests NCCL may group into one (new in v11)
} ncclNetProperties_v11_t;

/** Hints NCCL may pass through setNetAttr (v11). */
typedef struct {
  int32_t maxConcurrentPeers;
  int32_t minConcurrentPeers;
  int32_t maxFlowsPerPeer;
  int32_t minFlowsPerPeer;
} ncclNetCommAttr_v11_t;

typedef struct {
  ncclNetCommAttr_v11_t sendCommAttr;
  ncclNetCommAttr_v11_t recvCommAttr;
  uint32_t op;
  uint32_t algo;
  uint32_t proto;
} ncclNetAttr_v11_t;

typedef struct {
  const char* name;
  // Once per communicator: *ctx receives a context that listen/connect/
  // finalize take back; config carries the communicator's traffic class.
  ncclResult_t (*init)(void** ctx, uint64_t commId, ncclNetCommConfig_v11_t* config,
                       ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v11_t* props);
  ncclResult_t (*listen)(void* ctx, int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(void* ctx, int dev, void* handle, void** sendComm,
                          ncclNetDeviceHandle_v11_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm,
                         ncclNetDeviceHandle_v11_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset,
                              int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle,
                        void* phandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags,
                        void** mhandles, void** phandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles,
                         void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v11_t* props);
  // Ends a context.  NCCL 2.28.9 may call it after a failed init (ctx NULL).
  ncclResult_t (*finalize)(void* ctx);
  ncclResult_t (*setNetAttr)(void* ctx, ncclNetAttr_v11_t* netAttr);
} ncclNet_v11_t;

#ifdef __cplusplus
}  // extern "C"

// Layouts as in NCCL 2.28.9 (x86-64 and aarch64, LP64).
static_assert(sizeof(ncclNetDeviceHandle_v7_t) == 32, "ncclNetDeviceHandle_v7_t");
static_assert(sizeof(ncclNetVDeviceProps_v10_t) == 20, "ncclNetVDeviceProps_v10_t");
static_assert(sizeof(ncclNetProperties_v10_t) == 104, "ncclNetProperties_v10_t");
static_assert(offsetof(ncclNetProperties_v10_t, maxP2pBytes) == 88, "v10 maxP2pBytes");
static_assert(sizeof(ncclNet_v10_t) == 160, "ncclNet_v10_t");
static_assert(sizeof(ncclNetProperties_v11_t) == 112, "ncclNetProperties_v11_t");
static_assert(offsetof(ncclNetProperties_v11_t, maxMultiRequestSize) == 104,
              "v11 maxMultiRequestSize");
static_assert(sizeof(ncclNetAttr_v11_t) == 44, "ncclNetAttr_v11_t");
static_assert(sizeof(ncclNet_v11_t) == 176, "ncclNet_v11_t");
static_assert(offsetof(ncclNet_v11_t, finalize) == 160, "v11 finalize");
#endif
