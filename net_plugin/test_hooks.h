/* Test-only entry points of libnccl-net-kvxfer-test.so (the same plugin code,
 * built with these extra exports; libnccl-net-kvxfer.so does not have them).
 * tests/net_plugin uses them to inject faults and to read a comm's settings. */
#ifndef KVXFER_NET_PLUGIN_TEST_HOOKS_H_
#define KVXFER_NET_PLUGIN_TEST_HOOKS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** One-shot faults: the next call that reaches the point throws. */
enum kvxfer_net_fault {
  KVXFER_NET_FAULT_NONE = 0,
  /** connect(): after the attempt was recorded in the handle, before any message. */
  KVXFER_NET_FAULT_CONNECT_AFTER_STAGE = 1,
  /** accept(): on entry (std::bad_alloc). */
  KVXFER_NET_FAULT_ACCEPT_BAD_ALLOC = 2,
  /** isend(): on entry (a std::runtime_error). */
  KVXFER_NET_FAULT_ISEND_THROW = 3,
};

typedef struct {
  int kind;         /* 1 send, 2 recv, 3 listen */
  int nccl_class;   /* NCCL trafficClass the comm's settings came from */
  uint32_t tclass;  /* tx_attr.tclass of its endpoint */
  int dscp;         /* DSCP of its sockets, -1 = unmarked */
  size_t local_len; /* its endpoint's address (fi_getname) */
  uint8_t local[128];
  size_t peer_len; /* the peer endpoint's address (0 for a listen comm) */
  uint8_t peer[128];
  int requests; /* requests in use */
} kvxfer_net_test_info_t;

typedef void (*kvxfer_net_test_inject_fn)(int fault);
typedef int (*kvxfer_net_test_comm_info_fn)(void* comm, kvxfer_net_test_info_t* out);
typedef int (*kvxfer_net_test_count_fn)(void);

void kvxfer_net_test_inject(int fault);
/** 0 on success, -1 if `comm` is not a live comm of the plugin. */
int kvxfer_net_test_comm_info(void* comm, kvxfer_net_test_info_t* out);
/** Connection attempts recorded and not yet finished. */
int kvxfer_net_test_pending_connects(void);
/** Contexts (init() calls) not yet finalized. */
int kvxfer_net_test_live_contexts(void);

#ifdef __cplusplus
}
#endif
#endif
