"""A KV-connector adapter after SGLang's disaggregation interface
(sglang/srt/disaggregation/base/conn.py: KVArgs, KVPoll, BaseKVManager,
BaseKVSender, BaseKVReceiver), over kvxfer_send / kvxfer_recv.

Pages
-----
SGLang (and vLLM) keep the KV cache in a pool per layer: K and V buffers of
`num_pages * page_size` token slots, a *page* being `page_size` consecutive
slots.  A sequence owns a list of page indices.  kvxfer's block table is
exactly that list turned into addresses: with K pool base `k_base[l]` of layer
l and `page_stride` bytes from one page to the next,

    block j of layer l  =  k_base[l] + page_indices[j] * page_stride

(and V likewise), `block_size = page_size`.  Both sides may use different
page indices, page sizes and strides; they must agree on layers, kv_heads,
head_dim, dtype and the number of tokens (checked by kvxfer's handshake).

Matching
--------
kvxfer matches the i-th send to a peer with that peer's i-th recv (as NCCL
send/recv), and checks that their tags agree.  The adapter uses the
bootstrap_room as the tag, so a prefill side and a decode side that post rooms
in different orders fail fast (KvxferError ERR_MISMATCH naming the tag) rather
than exchange the wrong KV.  The runtime must therefore post, per pair of
ranks, the rooms in the same order on both sides (e.g. decode calls
KVReceiver.init in the order the prefill scheduler admits the requests, which
it learns over its own control channel, as SGLang does for bootstrap).

Polling
-------
poll() never blocks and returns a KVPoll.  The values keep SGLang's order
(Failed < Bootstrapping < WaitingForInput < Transferring < Success), so a MIN
all-reduce over tensor-parallel ranks still gives the least advanced state;
AnchorReady sits between Transferring and Success.

  sender:   Bootstrapping    the communicator is being built
            WaitingForInput  ready: waiting for init()/send() to give every page
            Transferring     posted; anchors being encoded and sent
            AnchorReady      every anchor section sent
            Success          the receiver confirmed every page at full precision
            Failed           see failure_exception()
  receiver: Bootstrapping    the communicator is being built
            WaitingForInput  ready for init(), or posted and the sender has not
                             posted its matching send yet
            Transferring     descriptors matched, pages arriving
            AnchorReady      every page is in the pool at anchor precision:
                             decode may start (approximate KV)
            Success          every page is at full precision
            Failed           see failure_exception()
"""

import atexit
import dataclasses
import enum
import threading
import weakref

from . import core
from ._abi import Dtype, Mode, Stage
from ._errors import KvxferError, Result

__all__ = ["KVArgs", "KVManager", "KVPoll", "KVReceiver", "KVSender", "Role"]


class KVPoll(enum.IntEnum):
    """Transfer state as SGLang's KVPoll, plus AnchorReady (see module doc)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    AnchorReady = 4
    Success = 5


class Role(enum.Enum):
    PREFILL = "prefill"  # sends (KVSender)
    DECODE = "decode"  # receives (KVReceiver)


@dataclasses.dataclass
class KVArgs:
    """The runtime's KV pool (host memory).

    k_data_ptrs, v_data_ptrs: per layer, the base address of its K (V) pool.
    page_stride: bytes from one page to the next in a layer's pool (SGLang's
      kv_item_len).
    page_size: tokens per page.
    row_stride: elements from one token to the next inside a page; 0 =
      kv_heads * head_dim (a dense [tokens, heads, head_dim] pool).
    keep: whatever owns the pool memory; held while transfers use it.
    """

    k_data_ptrs: list
    v_data_ptrs: list
    page_stride: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: Dtype = Dtype.BF16
    row_stride: int = 0
    keep: object = None

    @classmethod
    def from_sglang(cls, kv_data_ptrs, kv_item_lens, page_size, kv_heads, head_dim,
                    dtype=Dtype.BF16, keep=None):
        """From SGLang's MHA pool description (get_contiguous_buf_infos): the K
        buffers of every layer, then the V buffers; item_len = bytes of a page."""
        n = len(kv_data_ptrs)
        if n % 2 or len(kv_item_lens) != n or len(set(kv_item_lens)) != 1:
            raise ValueError("expected K then V pointers of every layer with one item length")
        return cls(list(kv_data_ptrs[:n // 2]), list(kv_data_ptrs[n // 2:]), kv_item_lens[0],
                   page_size, kv_heads, head_dim, dtype, 0, keep)

    def descriptor(self, page_indices, num_tokens=None):
        """KVDescriptor of the sequence holding `page_indices` (token order)."""
        return core.KVDescriptor.from_pool(
            self.k_data_ptrs, self.v_data_ptrs, page_indices, page_stride=self.page_stride,
            kv_heads=self.kv_heads, head_dim=self.head_dim, page_size=self.page_size,
            dtype=self.dtype, row_stride=self.row_stride, keep=self.keep,
            num_tokens=len(page_indices) * self.page_size if num_tokens is None
            else num_tokens)


class KVManager:
    """One per engine rank: the communicator with the peer rank and the pool.

    The communicator is built on a background thread (kvxfer_comm_init is
    collective and blocks), so the scheduler loop keeps running: until it is
    up, every poll() says Bootstrapping.  unique_id: made by rank 0's
    kvxfer.UniqueId.create() and shipped to the other rank out of band.
    codec, mode, page_tokens: what a sender uses (ignored when decoding).
    """

    def __init__(self, args, role, unique_id, rank, peer, nranks=2, *, timeout_ms=0,
                 bind_address=None, rate_limit=None, codec=None, mode=Mode.AUTO,
                 page_tokens=0, comm=None):
        self.args = args
        self.role = Role(role)
        self.peer = int(peer)
        self.codec = codec
        self.mode = mode
        self.page_tokens = page_tokens
        self._lock = threading.Lock()
        self._pending = []  # senders/receivers waiting for the communicator, in call order
        self._comm = comm
        self._error = None
        self._ready = threading.Event()
        self._closed = False
        _live_managers.add(self)
        if comm is not None:
            self._thread = None
            self._ready.set()
        else:
            self._thread = threading.Thread(
                target=self._bootstrap, name="kvxfer-bootstrap", daemon=True,
                args=(unique_id, rank, nranks,
                      dict(timeout_ms=timeout_ms, bind_address=bind_address,
                           rate_limit=rate_limit)))
            self._thread.start()

    def _bootstrap(self, unique_id, rank, nranks, kw):
        try:
            comm = core.Communicator(unique_id, rank, nranks, **kw)
        except BaseException as e:  # noqa: B902  (stored; poll() reports it)
            self._error = e
            self._ready.set()
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._comm = comm
        if closed:
            comm.destroy()
        self._ready.set()
        self.flush()

    @property
    def comm(self):
        return self._comm

    @property
    def bootstrap_error(self):
        return self._error

    def wait_ready(self, timeout=None):
        """Blocks until the communicator is up or failed; True when up."""
        self._ready.wait(timeout)
        return self._comm is not None

    def state(self):
        if self._error is not None:
            return KVPoll.Failed
        if self._comm is None:
            return KVPoll.Bootstrapping
        return KVPoll.WaitingForInput

    def _submit(self, item):
        with self._lock:
            self._pending.append(item)
        self.flush()

    def flush(self):
        """Posts what waits for the communicator, in the order it was asked."""
        with self._lock:
            if self._comm is None or self._closed:
                return
            items, self._pending = self._pending, []
            for it in items:
                it._post(self._comm)

    def close(self):
        """Destroys the communicator (requests in flight end in ERROR); waits
        for a bootstrap still in progress.  Idempotent."""
        _live_managers.discard(self)
        with self._lock:
            self._closed = True
            comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()
        elif self._thread is not None:
            self._thread.join()
            with self._lock:
                comm, self._comm = self._comm, None
            if comm is not None:
                comm.destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# Managers still open at exit are closed first (this hook runs before core's):
# that joins a bootstrap thread still inside kvxfer_comm_init (bounded by its
# timeout) instead of leaving it to a finalising interpreter.
_live_managers = weakref.WeakSet()


@atexit.register
def _close_managers_at_exit():
    for m in list(_live_managers):
        try:
            m.close()
        except Exception:  # noqa: BLE001  (exit: nothing left to report to)
            pass


class _Transfer:
    def __init__(self, mgr, bootstrap_room, peer):
        self.mgr = mgr
        self.room = int(bootstrap_room)
        self.peer = mgr.peer if peer is None else int(peer)
        self.request = None
        self._error = None
        self._info = None  # RequestInfo kept when the request is freed
        self._submitted = False
        self._cancelled = False
        self._placeholder = False

    @property
    def tag(self):
        return self.room & 0xFFFFFFFFFFFFFFFF

    def _fail(self, e):
        self._error = e

    def failure_exception(self):
        """Raises what made the transfer fail (SGLang's failure_exception)."""
        if self._error is not None:
            raise self._error
        if self.mgr.bootstrap_error is not None:
            raise self.mgr.bootstrap_error
        raise RuntimeError("the kvxfer transfer of room %d has not failed" % self.room)

    def _request_state(self, before_handshake):
        """KVPoll from the request (never raises)."""
        if self._error is not None:
            return KVPoll.Failed
        if self._info is not None:
            return KVPoll.Success
        req = self.request
        try:
            stage = req.stage
            if stage == Stage.ERROR:
                req.test()  # raises the request's KvxferError
            if stage == Stage.COMPLETE:
                self._info = req.info()
                req.free()
                self.request = None
                return KVPoll.Success
            if stage == Stage.ANCHOR_READY:
                return KVPoll.AnchorReady
            if req.info().t_handshake_ns == 0:
                return before_handshake
            return KVPoll.Transferring
        except KvxferError as e:
            if self._placeholder and e.code != Result.ERR_CANCELLED:
                # A placeholder exists only to be cancelled, and its descriptor
                # differs from the peer's by design: when the handshake
                # beats the cancel, the engine reports the mismatch.
                e = KvxferError(Result.ERR_CANCELLED,
                                "room %d was cancelled before its pages were given; its "
                                "placeholder request ended first with: %s" % (self.room, e),
                                core.error_string(Result.ERR_CANCELLED), e.function)
            self._fail(e)
            return KVPoll.Failed

    def poll(self):
        self.mgr.flush()
        if self._error is not None:
            return KVPoll.Failed
        s = self.mgr.state()
        if s != KVPoll.WaitingForInput:
            return s
        if self.request is None and self._info is None:
            return KVPoll.WaitingForInput
        return self._request_state(self._before_handshake)

    def info(self):
        """kvxfer RequestInfo (byte counts, stage timestamps), or None before posting."""
        if self._info is not None:
            return self._info
        return self.request.info() if self.request is not None else None

    def timestamps(self):
        i = self.info()
        return {} if i is None else i.timestamps()

    def cancel(self):
        """Drops this transfer (a client disconnected, the scheduler preempted
        it): poll() becomes Failed (ERR_CANCELLED) here, and on the peer.

        Requests of a pair match in the order they are posted, so every
        transfer (room) posts exactly one request, cancelled or not: one not
        posted yet (before init() or before send() gave every page) posts a
        placeholder of zero tokens and cancels it.  The peer must create and
        init() or cancel() the same room on its side."""
        self._cancelled = True
        req = self.request
        if req is not None:
            req.cancel()
        elif not self._submitted:
            self._submitted = True
            self._placeholder = True
            self.mgr._submit(self)

    def _post_placeholder(self, comm):
        """A zero-token request of this room, cancelled at once: keeps the
        pair's order when this side has nothing to post (cancel, or a post
        that failed here)."""
        desc = self.mgr.args.descriptor([], 0)
        if self._is_send:
            req = comm.send(self.peer, desc, self.mgr.codec, tag=self.tag, mode=self.mgr.mode,
                            page_tokens=self.mgr.page_tokens)
        else:
            req = comm.recv(self.peer, desc, tag=self.tag)
        req.cancel()
        return req

    def _post(self, comm):
        try:
            if self._placeholder:
                self.request = self._post_placeholder(comm)
                return
            self.request = self._post_real(comm)
            if self._cancelled:
                self.request.cancel()
        except (KvxferError, ValueError, TypeError, RuntimeError) as e:
            self._fail(e)
            try:  # the peer still expects this room (dropped: freed once final)
                self._post_placeholder(comm)
            except (KvxferError, ValueError, TypeError, RuntimeError):
                pass


class KVSender(_Transfer):
    """Prefill side of one request (bootstrap_room): init(num_pages), then
    send(page_indices) once or in chunks until every page is given."""

    _before_handshake = KVPoll.Transferring

    def __init__(self, mgr, bootstrap_room, peer=None):
        super().__init__(mgr, bootstrap_room, peer)
        self.num_pages = None
        self.num_tokens = None
        self.pages = []

    def init(self, num_pages, num_tokens=None):
        """num_pages: pages the sequence's KV spans; num_tokens: tokens in them
        (default num_pages * page_size; the receiver must say the same)."""
        self.num_pages = int(num_pages)
        self.num_tokens = None if num_tokens is None else int(num_tokens)

    def send(self, page_indices):
        """Adds pool page indices (token order); the transfer is posted once
        init()'s num_pages have been given."""
        if self.num_pages is None:
            raise RuntimeError("KVSender.send before init")
        self.pages.extend(int(i) for i in page_indices)
        if len(self.pages) > self.num_pages:
            raise ValueError("%d pages sent, init said %d" % (len(self.pages), self.num_pages))
        if len(self.pages) == self.num_pages and not self._submitted:
            self._submitted = True
            self.mgr._submit(self)

    _is_send = True

    def _post_real(self, comm):
        desc = self.mgr.args.descriptor(self.pages, self.num_tokens)
        return comm.send(self.peer, desc, self.mgr.codec, tag=self.tag, mode=self.mgr.mode,
                         page_tokens=self.mgr.page_tokens)


class KVReceiver(_Transfer):
    """Decode side of one request: init(page_indices) with the pages allocated
    for it; poll() until AnchorReady (decode may start) and Success."""

    _before_handshake = KVPoll.WaitingForInput

    def __init__(self, mgr, bootstrap_room, peer=None):
        super().__init__(mgr, bootstrap_room, peer)
        self.pages = None
        self.num_tokens = None

    def init(self, page_indices, num_tokens=None):
        if self._submitted:
            raise RuntimeError("KVReceiver.init called twice")
        self.pages = [int(i) for i in page_indices]
        self.num_tokens = None if num_tokens is None else int(num_tokens)
        self._submitted = True
        self.mgr._submit(self)

    _is_send = False

    def _post_real(self, comm):
        desc = self.mgr.args.descriptor(self.pages, self.num_tokens)
        return comm.recv(self.peer, desc, tag=self.tag)

    def layer_state(self, layer):
        """Stage of one layer (layer-pipelined decode): Stage.ANCHOR_READY once
        its pages are in the pool at anchor precision, COMPLETE at full."""
        if self._info is not None:
            return Stage.COMPLETE
        if self.request is None:
            return Stage.POSTED
        try:
            return self.request.test_layer(layer)
        except KvxferError as e:
            self._fail(e)
            return Stage.ERROR
