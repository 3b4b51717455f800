/*
 * kvxfer NCCL backend: progressive KV-cache transfers of device-resident KV
 * over two NCCL communicators, one per traffic class (docs/NCCL.md).
 *
 * Library: libkvxfer_nccl.so (or the static kvxfer_nccl), separate from
 * libkvxfer.so so that the latter has no NCCL dependency.  It exports
 * only kvxfer_nccl_* symbols.  It carries its own copy of the codec, so its
 * error text is read with kvxfer_nccl_get_last_error(), not
 * kvxfer_get_last_error().
 *
 * Selecting the backend: link libkvxfer_nccl and call these functions.
 * KVXFER_BACKEND=nccl is not read by libkvxfer.so (docs/NCCL.md,
 * "Selecting the backend").
 *
 * Model (as NCCL): every call that moves data is *blocking and collective
 * over the ops it names*: kvxfer_nccl_xfer returns when every op is final
 * (COMPLETE or ERROR).  The i-th send op from rank A to rank B matches B's
 * i-th recv op from A, counting ops in array order across calls; both sides
 * must issue their matching ops at about the same time (within the timeout).
 * Progress is reported through per-op callbacks on the calling thread:
 * ANCHOR_READY (every page at anchor precision in the receiver's blocks, no
 * residual applied yet) and then COMPLETE.
 *
 * Stream order: kvxfer_nccl_xfer_on_stream takes the caller's CUDA stream;
 * kvxfer_nccl_xfer is the same call with the legacy default stream.  See
 * there.  Every call leaves the calling thread's current CUDA device as it
 * found it.
 *
 * Allocation: the device and pinned buffers of a call (block tables,
 * staging, scratch, descriptors) are kept by the communicator for later
 * calls and grown only when an op needs more, so a call whose ops' shapes
 * were seen before allocates nothing; they are freed by
 * kvxfer_nccl_comm_destroy.
 *
 * Thread-safety: a kvxfer_nccl_comm_t is used by one thread at a time (as an
 * ncclComm_t); different communicators are independent.
 */
#ifndef KVXFER_KVXFER_NCCL_H_
#define KVXFER_KVXFER_NCCL_H_

#include <nccl.h>
#include <stddef.h>
#include <stdint.h>

#include "kvxfer/kvxfer.h"

#ifdef __cplusplus
extern "C" {
#endif

/** A pair of NCCL communicators (anchor class, residual class) plus streams and staging. */
typedef struct kvxfer_nccl_comm_s* kvxfer_nccl_comm_t;

/**
 * Options of kvxfer_nccl_comm_init / _init_from_comms.  Start from
 * KVXFER_NCCL_CONFIG_INITIALIZER.  NULL = defaults.  `size`, `magic` and
 * `version` follow KVXFER_CONFIG_MAGIC's rule (kvxfer.h); it has one layout.
 */
typedef struct {
  size_t size;      /**< sizeof(kvxfer_nccl_config_t) */
  uint32_t magic;   /**< KVXFER_CONFIG_MAGIC */
  uint32_t version; /**< KVXFER_VERSION_CODE of the header used */
  /** ncclConfig_t.trafficClass of the anchor communicator (kvxfer_nccl_comm_init only).
   *  Its meaning belongs to the network: the IB/RoCE traffic class byte
   *  (NCCL_IB_TC semantics), or a class of the net plugin (the kvxfer plugin
   *  maps 0 to its anchor class by default, KVXFER_NET_TC_MAP).  -1 leaves it
   *  unset (NCCL's own default).  Default 0. */
  int32_t anchor_traffic_class;
  /** The same for the residual communicator.  Default 1. */
  int32_t residual_traffic_class;
  /** Deadline in ms of each phase of a transfer (descriptor exchange, lengths,
   *  anchors, residuals, final status) and of communicator creation;
   *  0 = KVXFER_TIMEOUT_MS (30 s).  Past it the call fails with
   *  KVXFER_ERR_TIMEOUT and the communicator is aborted (docs/NCCL.md). */
  int32_t timeout_ms;
} kvxfer_nccl_config_t;

#define KVXFER_NCCL_CONFIG_INITIALIZER \
  { sizeof(kvxfer_nccl_config_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0, 1, 0 }

/**
 * Creates rank `rank` of an `nranks`-rank kvxfer NCCL communicator on CUDA
 * device `device` (-1 = the calling thread's current device).  Collective, as
 * ncclCommInitRank: every rank calls it with the same two ids, each from
 * ncclGetUniqueId on one rank and passed out-of-band.
 *
 * Creates two communicators with ncclCommInitRankConfig, non-blocking
 * (config.blocking = 0), with config.trafficClass = anchor_traffic_class and
 * residual_traffic_class respectively.  Never with ncclCommSplit, whose
 * shared resources would ignore the second class.  Both are owned by the
 * kvxfer communicator and destroyed (or aborted) with it.
 *
 * nranks may be 1 (a rank that sends to itself; used by the tests).
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL, nranks < 1, rank out of range,
 * the two ids equal, a bad config); KVXFER_ERR_SYSTEM (CUDA or NCCL failed,
 * e.g. no device: the text names the call and NCCL's reason);
 * KVXFER_ERR_TIMEOUT (a rank missing past the timeout; both communicators
 * are aborted).  On failure *comm is NULL and nothing is left allocated.
 */
kvxfer_result_t kvxfer_nccl_comm_init(kvxfer_nccl_comm_t* comm, int nranks, ncclUniqueId anchor_id,
                                      ncclUniqueId residual_id, int rank, int device,
                                      const kvxfer_nccl_config_t* config);

/**
 * Adopts two communicators the caller already has (a runtime that runs NCCL
 * uses kvxfer as a drop-in).  The caller keeps ownership: kvxfer never
 * destroys nor aborts them; it only issues ncclSend/ncclRecv on them, on its
 * own streams.  Both must be fully initialised, span the same ranks in the
 * same order, on the same device, and be distinct.  Their traffic classes
 * are whatever the caller configured (NCCL has no getter); the config's
 * class fields are ignored.
 * For the no-hang guarantee they should be non-blocking (config.blocking = 0):
 * with blocking communicators, NCCL's own connection setup inside
 * ncclGroupEnd is not under kvxfer's timeout.  After a timeout the caller
 * must ncclCommAbort them itself before kvxfer_nccl_comm_destroy.
 * Errors: KVXFER_ERR_INVALID_ARGUMENT (NULL or equal communicators, ranks,
 * sizes or devices that differ, a bad config); KVXFER_ERR_SYSTEM (a query failed).
 */
kvxfer_result_t kvxfer_nccl_comm_init_from_comms(kvxfer_nccl_comm_t* comm, ncclComm_t anchor_comm,
                                                 ncclComm_t residual_comm,
                                                 const kvxfer_nccl_config_t* config);

/**
 * Aborts the owned NCCL communicators (ncclCommAbort), which ends any NCCL
 * operation still pending on kvxfer's streams; later transfers fail with
 * KVXFER_ERR_INVALID_USAGE.  User-provided communicators are not touched.
 * Idempotent.  Must not run concurrently with kvxfer_nccl_xfer on the same
 * communicator (a timeout inside the call aborts on its own).
 */
kvxfer_result_t kvxfer_nccl_comm_abort(kvxfer_nccl_comm_t comm);

/**
 * Waits for kvxfer's streams, frees its device and pinned staging, destroys
 * the owned communicators (ncclCommDestroy, or ncclCommAbort after a failure)
 * and frees the handle.  User-provided communicators stay valid.  NULL is a
 * no-op.  After a timeout with user-provided communicators, call it only
 * after aborting them (else the stream wait cannot end).
 */
kvxfer_result_t kvxfer_nccl_comm_destroy(kvxfer_nccl_comm_t comm);

/** Number of ranks and this rank's index (of the anchor communicator; both agree).
 *  Any thread.  Errors: KVXFER_ERR_INVALID_ARGUMENT (comm or the output NULL). */
kvxfer_result_t kvxfer_nccl_comm_count(kvxfer_nccl_comm_t comm, int* nranks);
kvxfer_result_t kvxfer_nccl_comm_user_rank(kvxfer_nccl_comm_t comm, int* rank);

/**
 * Stage callback of one op, on the thread that called kvxfer_nccl_xfer.
 * `op_index` is the op's index in the array.  Called once with ANCHOR_READY
 * (receiver: every page decoded at anchor precision into the blocks and the
 * device synchronised, no residual of the op applied yet, so the blocks may
 * be read or copied; sender: every anchor section sent), then once with
 * COMPLETE or ERROR through on_complete.  It must not call kvxfer_nccl_* on
 * the same communicator.
 */
typedef void (*kvxfer_nccl_callback_t)(int op_index, kvxfer_stage_t stage, kvxfer_result_t result,
                                       void* user_data);

/**
 * One send or receive of a paged KV cache in device memory.  Start from
 * KVXFER_NCCL_OP_INITIALIZER.  Inputs are read; outputs are written by
 * kvxfer_nccl_xfer.  The call reads the op, *kv and *codec in place, so each
 * must have every field of this header (KVXFER_CONFIG_MAGIC's rule, less
 * the older layouts); a smaller one is refused with
 * KVXFER_ERR_INVALID_ARGUMENT.
 */
typedef struct {
  size_t size;      /**< sizeof(kvxfer_nccl_op_t) */
  uint32_t magic;   /**< KVXFER_CONFIG_MAGIC */
  uint32_t version; /**< KVXFER_VERSION_CODE of the header used */
  /* ---- inputs ---- */
  int32_t is_send; /**< 1 send to `peer`, 0 receive from `peer` */
  int32_t peer;    /**< rank of the peer; may be this rank (a send to itself) */
  /** The KV (kvxfer.h semantics): `device` must be the communicator's device;
   *  k_blocks/v_blocks are host arrays of device block pointers.  The blocks
   *  must stay valid (receiver: untouched) until the call returns. */
  const kvxfer_kv_desc_t* kv;
  /** Sender only: the codec (NULL = Lynx 4+4).  alpha = KVXFER_ALPHA_AUTO is
   *  KVXFER_ERR_UNSUPPORTED on the device path: calibrate on the host and pass
   *  the chosen alpha. */
  const kvxfer_codec_config_t* codec;
  uint64_t tag;        /**< must be equal on both sides (checked); default 0 */
  kvxfer_mode_t mode;  /**< sender only; AUTO = PROGRESSIVE for LYNX/INT8 */
  int32_t page_tokens; /**< sender only; tokens per page, 0 = KVXFER_PAGE_TOKENS */
  kvxfer_nccl_callback_t on_anchor_ready; /**< optional */
  kvxfer_nccl_callback_t on_complete;     /**< optional: COMPLETE or ERROR */
  void* user_data;                        /**< passed to both callbacks */
  /* ---- outputs ---- */
  kvxfer_stage_t stage;   /**< final: COMPLETE or ERROR */
  kvxfer_result_t result; /**< KVXFER_SUCCESS or the op's error */
  char error[256];        /**< the op's error text ("" on success), NUL-terminated, truncated */
  int64_t num_pages;
  uint64_t anchor_wire_bytes;   /**< anchor sections (monolithic: both sections) */
  uint64_t residual_wire_bytes; /**< residual sections (progressive only) */
  int64_t t_anchor_ready_ns;    /**< CLOCK_MONOTONIC when ANCHOR_READY was reached; 0 if not */
  int64_t t_complete_ns;        /**< CLOCK_MONOTONIC when COMPLETE was reached; 0 if not */
} kvxfer_nccl_op_t;

#define KVXFER_NCCL_OP_INITIALIZER                                                                 \
  {                                                                                                \
    sizeof(kvxfer_nccl_op_t), KVXFER_CONFIG_MAGIC, KVXFER_VERSION_CODE, 0, -1, NULL, NULL, 0,      \
        KVXFER_MODE_AUTO, 0, NULL, NULL, NULL, KVXFER_STAGE_POSTED, KVXFER_IN_PROGRESS, {0}, 0, 0, \
        0, 0, 0                                                                                    \
  }

/**
 * Runs `num_ops` sends and receives to completion (docs/NCCL.md,
 * "Protocol"): in NCCL groups spanning every op, the two sides exchange
 * fixed-size descriptors (a mismatch fails the op on both sides, naming the
 * field), the sender encodes every page on the GPU and sends the per-page
 * section lengths, then the anchor sections on the anchor communicator and
 * the high-priority stream, then the residual sections on the residual
 * communicator; the receiver validates every checksum before it decodes a
 * page, and reports its result back, which completes the sender.
 *
 * Returns KVXFER_SUCCESS when every op is COMPLETE; otherwise the first
 * failing op's result (its text in op->error and kvxfer_nccl_get_last_error).
 * Invalid arguments fail before anything is sent, with nothing sent for any
 * op (KVXFER_ERR_INVALID_ARGUMENT; KVXFER_ERR_UNSUPPORTED for host KV or
 * alpha = auto; KVXFER_ERR_INVALID_USAGE on an aborted communicator).
 * Per-op failures (mismatch, NaN with the ERROR policy, a corrupt section)
 * leave the other ops running.  A timeout or an NCCL/CUDA failure fails every
 * op not yet final and aborts the owned communicators.
 */
kvxfer_result_t kvxfer_nccl_xfer(kvxfer_nccl_comm_t comm, kvxfer_nccl_op_t* ops, int num_ops);

/**
 * kvxfer_nccl_xfer, stream-ordered after the caller's work as NCCL's own
 * operations are: every kernel and copy kvxfer enqueues for the call (the
 * sender's encodes, which read the KV; the receiver's decodes, which write
 * it) runs after every operation enqueued on `stream` before this call, so
 * the call may follow the kernels that wrote the KV (or still read the
 * destination) without a synchronisation.  The call is still blocking: when
 * it returns, every op is final and kvxfer's work on the device is done, so
 * work enqueued on any stream afterwards sees the received values (no stream
 * wait is needed).  `stream` must belong to the communicator's device; NULL
 * is the legacy default stream (cudaStreamLegacy), which orders after work
 * on it and on blocking streams, NOT after work on non-blocking streams
 * (cudaStreamNonBlocking) or per-thread default streams: pass that stream.
 * kvxfer_nccl_xfer(comm, ops, n) is kvxfer_nccl_xfer_on_stream(comm, ops, n, NULL).
 * Errors: as kvxfer_nccl_xfer; KVXFER_ERR_INVALID_ARGUMENT also when
 * recording an event on `stream` fails (a stream of another device).
 */
kvxfer_result_t kvxfer_nccl_xfer_on_stream(kvxfer_nccl_comm_t comm, kvxfer_nccl_op_t* ops,
                                           int num_ops, cudaStream_t stream);

/** Text of the last error of this library on the calling thread ("" if none). */
const char* kvxfer_nccl_get_last_error(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVXFER_KVXFER_NCCL_H_ */
