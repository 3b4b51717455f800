"""Idiomatic classes over the C API: UniqueId, Communicator, KVDescriptor,
KVPool (registered pools; requests by block ids), CodecConfig, Request, and
the page codec functions.

Importing this module loads libkvxfer (see kvxfer._lib for where it looks).

Threads and callbacks
---------------------
Every method may be called from any Python thread; ctypes releases the GIL
during each C call, so a blocking kvxfer_comm_init or kvxfer_wait does not stop
other Python threads.

Request callbacks (on_anchor_ready, on_complete) run on the communicator's
progress thread, inside the library, holding the GIL while they run: keep them
short (set an Event, put on a queue).  From a callback you may call
Request.test(), .stage, .info(), .timestamps(), .arrivals(), but not
Request.wait()/wait_layer()/free() or Communicator.destroy(): those would wait
for the very thread the callback runs on, and raise RuntimeError instead.  An
exception raised by a callback is caught and logged on the "kvxfer" logger; it
never reaches the library.

Lifetimes
---------
A Request keeps its KVDescriptor (and so every buffer it was built from) or
its KVPool, its Communicator and its callbacks alive until it has reached a
final stage and has been freed.  Dropping a Request that is still in flight
does not free its memory early: the binding parks it and frees it once it is
final.  A KVPool is deregistered by close(), or once it is dropped and every
request on it is freed.  A Communicator dropped or left open is destroyed at
interpreter exit, before the interpreter shuts down, and open pools are
deregistered after it, so the progress thread never calls into a dying
interpreter.
"""

import atexit
import collections
import collections.abc
import ctypes
import dataclasses
import itertools
import logging
import math
import numbers
import os
import operator
import sys
import threading
import time
import weakref

from . import _abi
from ._abi import (
    ALPHA_AUTO,
    ANY_PEER,
    CALLBACK,
    ENDPOINT_ADDRESS_MAX,
    ENDPOINT_SECRET_BYTES,
    Codec,
    Dtype,
    KVKind,
    Mode,
    NonfinitePolicy,
    Stage,
    ValueGroups,
)
from ._errors import KvxferError, Result
from ._lib import load as _load
from ._memory import memory_of

log = logging.getLogger("kvxfer")

_L = _load()

__all__ = [
    "Arrival", "CodecConfig", "Communicator", "KVBlocks", "KVDescriptor", "KVPool", "PageId",
    "PageInfo", "PageLayout", "Request", "RequestInfo", "UniqueId", "calibrate_alpha",
    "decode_page", "encode_page", "error_string", "get_version", "inspect_page", "library_path",
    "page_max_size",
]


def get_version():
    """KVXFER_VERSION_CODE of the loaded library (major*10000 + minor*100 + patch)."""
    return _L.version()


def library_path():
    """Path (or name) the library was loaded from."""
    return _L.path


def error_string(code):
    """kvxfer_get_error_string(code)."""
    return _L.error_string(code)


# ---------------------------------------------------------------------------
# Callback-thread bookkeeping
# ---------------------------------------------------------------------------
_tls = threading.local()


def _in_callback():
    return getattr(_tls, "depth", 0) > 0


def _forbid_in_callback(what):
    if _in_callback():
        raise RuntimeError(
            "%s called from a kvxfer callback: callbacks run on the communicator's progress "
            "thread, which this call would wait for (deadlock).  Signal another thread instead."
            % what)


# Reentrant: any allocation under it may run the cyclic GC, whose finalisers
# (_release_request and the like) park what they drop here, on this thread.
_deferred_lock = threading.RLock()
_deferred_requests = []  # _RequestState: dropped while in flight, or during a callback
_deferred_comms = []  # _CommState: dropped during a callback
_deferred_pools = []  # _PoolState: dropped while a request on it was in flight


def _drain_deferred():
    """Frees parked requests that have become final, destroys parked comms,
    then deregisters parked pools whose requests are final."""
    if _in_callback() or not (_deferred_requests or _deferred_comms or _deferred_pools):
        return
    reqs, comms, pools = [], [], []
    with _deferred_lock:
        # Popped one by one: a finaliser that the appends run parks its
        # object in the list being emptied, and the loop takes it too.
        for src, dst in ((_deferred_requests, reqs), (_deferred_comms, comms),
                         (_deferred_pools, pools)):
            while src:
                dst.append(src.pop())
    for st in reqs:
        _release_request(st)
    for st in comms:
        _destroy_comm(st)
    for st in pools:
        _deregister_pool(st, True)


# ---------------------------------------------------------------------------
# UniqueId
# ---------------------------------------------------------------------------
class UniqueId:
    """kvxfer_unique_id_t: 128 bytes (root address + 32-byte secret).

    Make it with UniqueId.create() in the process that will be rank 0, ship
    bytes(uid) to the other ranks (a file, an RPC, a pipe), and rebuild it with
    UniqueId.from_bytes().  Picklable.  repr() never shows the bytes: they carry
    the secret.
    """

    __slots__ = ("_raw",)
    NBYTES = _abi.UNIQUE_ID_BYTES

    def __init__(self, raw):
        raw = bytes(raw)
        if len(raw) != self.NBYTES:
            raise ValueError("a kvxfer unique id is %d bytes, got %d" % (self.NBYTES, len(raw)))
        self._raw = raw

    @classmethod
    def create(cls):
        """kvxfer_get_unique_id: starts the bootstrap listener of this process
        (KVXFER_BOOTSTRAP_ADDR); this process must become rank 0."""
        _drain_deferred()
        s = _abi.UniqueIdStruct()
        _L.kvxfer_get_unique_id(ctypes.byref(s))
        # Not s.internal: ctypes cuts a c_char array at its first NUL byte.
        return cls(ctypes.string_at(ctypes.addressof(s), cls.NBYTES))

    @classmethod
    def from_bytes(cls, raw):
        return cls(raw)

    @classmethod
    def from_hex(cls, text):
        return cls(bytes.fromhex(text))

    def to_bytes(self):
        return self._raw

    def hex(self):
        return self._raw.hex()

    def __bytes__(self):
        return self._raw

    def __eq__(self, other):
        return isinstance(other, UniqueId) and other._raw == self._raw

    def __hash__(self):
        return hash(self._raw)

    def __reduce__(self):
        return (UniqueId, (self._raw,))

    def __repr__(self):
        return "UniqueId(<%d bytes>)" % self.NBYTES

    def _struct(self):
        s = _abi.UniqueIdStruct()
        ctypes.memmove(ctypes.addressof(s), self._raw, self.NBYTES)
        return s


# ---------------------------------------------------------------------------
# CodecConfig
# ---------------------------------------------------------------------------
# A user's integer argument (_abi.as_int); the C type's range is checked
# where the value meets it (_abi.check_int).
_index = _abi.as_int


def _real(value, what):
    """`value` as a float: ints, floats and NumPy scalars; a string (which
    float() would parse) or anything else is a TypeError naming `what`."""
    if isinstance(value, (str, bytes, bool)) or not isinstance(value, numbers.Real):
        raise TypeError("%s must be a number, not %s" % (what, type(value).__name__))
    return float(value)


def _text_arg(value, what):
    """`value`, a str, encoded for a C string; None stays None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError("%s must be a str, not %s" % (what, type(value).__name__))
    return value.encode()


def _check_itemsize(m, dtype, what):
    """A typed array or tensor (memory_of's itemsize) must have the elements
    of `dtype`: a float64 array for an fp32 pool would be read as twice the
    elements it holds.  Raw bytes and addresses carry no element type."""
    if m.itemsize is not None and m.itemsize != dtype.itemsize:
        raise ValueError("%s holds %d-byte elements, but dtype %s has %d-byte elements" %
                         (what, m.itemsize, dtype.name.lower(), dtype.itemsize))


def _enum(enum_type, value, what):
    if isinstance(value, str):
        try:
            return enum_type[value.upper()]
        except KeyError:
            raise ValueError("%s: unknown %s '%s' (one of %s)" %
                             (what, enum_type.__name__, value,
                              ", ".join(m.name.lower() for m in enum_type))) from None
    return enum_type(value)


@dataclasses.dataclass
class CodecConfig:
    """kvxfer_codec_config_t; the defaults are KVXFER_CODEC_CONFIG_INITIALIZER's
    (Lynx, alpha 0, 32-token chunks, 4 anchor bits, reject NaN/Inf, the first
    token pinned exactly as the attention sink).  Enum
    fields also accept their names ("int8", "raw")."""

    codec: Codec = Codec.LYNX
    alpha: float = 0.0  # 0..1000, or ALPHA_AUTO (-1); LYNX only
    chunk_tokens: int = 32  # 16, 32, 64 or 128
    anchor_bits: int = 4  # 2..6 for LYNX and INT8; 4 for INT4; ignored by BF16
    nonfinite: NonfinitePolicy = NonfinitePolicy.ERROR
    sink_tokens: int = 1  # 0..1024 leading tokens sent exactly; not SPECTRUM
    # V pages per (chunk, channel), per (token, channels) as KIVI, or the
    # better of the two per page (docs/FORMAT.md 2.8); not BF16 or SPECTRUM
    value_groups: ValueGroups = ValueGroups.CHANNEL

    ALPHA_AUTO = ALPHA_AUTO

    def __post_init__(self):
        self.codec = _enum(Codec, self.codec, "codec")
        self.nonfinite = _enum(NonfinitePolicy, self.nonfinite, "nonfinite")
        self.value_groups = _enum(ValueGroups, self.value_groups, "value_groups")
        self._struct()  # TypeError / ValueError at construction, naming the field

    def _struct(self):
        s = _abi.init_config(_abi.CodecConfigStruct)
        s.codec = int(_enum(Codec, self.codec, "codec"))
        s.alpha = _real(self.alpha, "alpha")
        s.chunk_tokens = _index(self.chunk_tokens, "chunk_tokens")
        s.anchor_bits = _index(self.anchor_bits, "anchor_bits")
        s.nonfinite = int(_enum(NonfinitePolicy, self.nonfinite, "nonfinite"))
        s.sink_tokens = _index(self.sink_tokens, "sink_tokens")
        s.value_groups = int(_enum(ValueGroups, self.value_groups, "value_groups"))
        return s


def _codec_struct(codec):
    if codec is None:
        return CodecConfig()._struct()
    if isinstance(codec, CodecConfig):
        return codec._struct()
    if isinstance(codec, (str, int)):
        return CodecConfig(codec=codec)._struct()
    raise TypeError("codec must be a CodecConfig, a codec name or None")


# ---------------------------------------------------------------------------
# Block tables
# ---------------------------------------------------------------------------
def _rows_in_block(b, block_size, num_tokens, first_token=0):
    """Rows of block b that tokens [first_token, first_token+num_tokens) use."""
    lo = max(b * block_size, first_token)
    hi = min((b + 1) * block_size, first_token + num_tokens)
    return hi - lo, (hi - 1) % block_size if hi > lo else -1


def _block_table(entries, n, check_bytes, what, writable_needed=False, device=-1):
    """(c_void_p array, keepalive list, readonly) for n blocks.

    check_bytes(i) -> bytes block i must hold (0: unused).  device >= 0: the
    entries are CUDA addresses (ints, or tensors on that device).
    """
    if len(entries) != n:
        raise ValueError("%s: %d block entries, expected %d" % (what, len(entries), n))
    arr = (ctypes.c_void_p * max(n, 1))()
    keep = []
    readonly = False
    for i, e in enumerate(entries):
        need = check_bytes(i)
        if e is None or (isinstance(e, int) and not isinstance(e, bool) and e == 0):
            if need > 0:
                raise ValueError("%s: block %d is NULL but holds tokens" % (what, i))
            continue
        m = memory_of(e, "%s block %d" % (what, i), device)
        if m.nbytes is not None and m.nbytes < need:
            raise ValueError("%s block %d: %d bytes, needs at least %d" %
                             (what, i, m.nbytes, need))
        if writable_needed and m.readonly:
            raise ValueError("%s block %d is read-only" % (what, i))
        readonly = readonly or m.readonly
        arr[i] = m.address
        if m.keep is not None:
            keep.append(m.keep)
    return arr, keep, readonly


def _flatten_layers(blocks, num_layers, what):
    """Accepts a flat list (layer-major) or a list of per-layer lists."""
    blocks = list(blocks)
    if blocks and all(isinstance(b, (list, tuple)) for b in blocks):
        if len(blocks) != num_layers:
            raise ValueError("%s: %d per-layer block lists, expected num_layers=%d" %
                             (what, len(blocks), num_layers))
        per = {len(b) for b in blocks}
        if len(per) != 1:
            raise ValueError("%s: layers have different block counts %s" % (what, sorted(per)))
        return [x for b in blocks for x in b], per.pop()
    if len(blocks) % num_layers:
        raise ValueError("%s: %d blocks is not a multiple of num_layers=%d" %
                         (what, len(blocks), num_layers))
    return blocks, len(blocks) // num_layers


class KVDescriptor:
    """kvxfer_kv_desc_t: a paged KV cache, one block table per layer.

    k_blocks, v_blocks: either a flat layer-major list of num_layers*num_blocks
      entries (entry l*num_blocks + b is block b of layer l), or a list of
      num_layers lists.  An entry is an int address, a buffer-protocol object,
      a ctypes object or a CPU tensor (data_ptr()); None or 0 for a block that
      holds no token.  Block b holds tokens [b*block_size, (b+1)*block_size);
      token t is row t % block_size, `row_stride` elements from the previous,
      each row kv_heads*head_dim elements of `dtype`, heads major.
    num_tokens: tokens to transfer (default: every row of every block).
    row_stride: elements between rows; 0 (default) = kv_heads*head_dim.
    device: -1 (default) host memory; >= 0 the CUDA ordinal the blocks live on
      (entries are then device addresses or tensors on that device; a build
      without the GPU transfer path refuses it with ERR_UNSUPPORTED).

    Buffers given as objects are size-checked and held by the descriptor (and
    by every Request posted with it) so they stay valid while the library uses
    them.  Raw addresses are the caller's responsibility.
    """

    def __init__(self, k_blocks, v_blocks, *, num_layers, kv_heads, head_dim, block_size,
                 dtype=Dtype.BF16, num_tokens=None, row_stride=0, device=-1):
        self.num_layers = _index(num_layers, "num_layers")
        self.kv_heads = _index(kv_heads, "kv_heads")
        self.head_dim = _index(head_dim, "head_dim")
        self.block_size = _index(block_size, "block_size")
        self.dtype = _enum(Dtype, dtype, "dtype")
        self.row_stride = _index(row_stride, "row_stride")
        self.device = _index(device, "device")
        if self.num_layers < 1 or self.kv_heads < 1 or self.head_dim < 1 or self.block_size < 1:
            raise ValueError("num_layers, kv_heads, head_dim and block_size must be positive")
        k, nk = _flatten_layers(k_blocks, self.num_layers, "k_blocks")
        v, nv = _flatten_layers(v_blocks, self.num_layers, "v_blocks")
        if nk != nv:
            raise ValueError("k_blocks has %d blocks per layer, v_blocks %d" % (nk, nv))
        self.num_blocks = nk
        self.num_tokens = (self.num_blocks * self.block_size if num_tokens is None
                           else _index(num_tokens, "num_tokens"))
        H = self.num_channels
        stride = self.row_stride or H
        if stride < H:
            raise ValueError("row_stride %d is smaller than kv_heads*head_dim = %d" % (stride, H))
        if self.num_tokens < 0:
            raise ValueError("num_tokens %d is negative" % self.num_tokens)
        if self.num_blocks * self.block_size < self.num_tokens:
            raise ValueError("%d blocks of %d tokens cannot hold num_tokens=%d" %
                             (self.num_blocks, self.block_size, self.num_tokens))
        esize = self.dtype.itemsize

        def need(i):
            rows, last = _rows_in_block(i % self.num_blocks, self.block_size, self.num_tokens)
            return 0 if rows <= 0 else (last * stride + H) * esize

        self._k, kk, kro = _block_table(k, len(k), need, "k_blocks", device=self.device)
        self._v, vk, vro = _block_table(v, len(v), need, "v_blocks", device=self.device)
        self._keep = kk + vk
        self.readonly = kro or vro
        s = _abi.init_config(_abi.KVDescStruct)
        s.num_layers = self.num_layers
        s.kv_heads = self.kv_heads
        s.head_dim = self.head_dim
        s.dtype = int(self.dtype)
        s.num_tokens = self.num_tokens
        s.block_size = self.block_size
        s.row_stride = self.row_stride
        s.num_blocks = self.num_blocks
        s.k_blocks = ctypes.cast(self._k, ctypes.POINTER(ctypes.c_void_p))
        s.v_blocks = ctypes.cast(self._v, ctypes.POINTER(ctypes.c_void_p))
        s.device = self.device
        self._desc = s

    @property
    def num_channels(self):
        return self.kv_heads * self.head_dim

    @property
    def kv_bytes(self):
        """Bytes of the KV in its dtype, K and V of every layer."""
        return 2 * self.num_layers * self.num_tokens * self.num_channels * self.dtype.itemsize

    @classmethod
    def from_pool(cls, k_bases, v_bases, page_indices, *, page_stride, kv_heads, head_dim,
                  page_size, dtype=Dtype.BF16, num_tokens=None, row_stride=0, keep=None):
        """A descriptor over a runtime's KV pool (vLLM/SGLang style).

        k_bases, v_bases: per layer, the base address (int) of that layer's K
        (V) pool; page_stride: bytes from one pool page to the next; page i of
        layer l is at k_bases[l] + i * page_stride.  page_indices: the pages
        of this sequence, in token order (page j holds tokens
        [j*page_size, (j+1)*page_size)).  `keep`: objects owning the pools,
        held by the descriptor.
        """
        if len(k_bases) != len(v_bases):
            raise ValueError("k_bases has %d layers, v_bases %d" % (len(k_bases), len(v_bases)))
        pages = [_index(i, "page_indices[]") for i in page_indices]
        if any(i < 0 for i in pages):
            raise ValueError("negative page index in %r" % (pages,))
        stride = _index(page_stride, "page_stride")
        k = [[int(b) + i * stride for i in pages] for b in k_bases]
        v = [[int(b) + i * stride for i in pages] for b in v_bases]
        d = cls(k, v, num_layers=len(k_bases), kv_heads=kv_heads, head_dim=head_dim,
                block_size=page_size, dtype=dtype, num_tokens=num_tokens, row_stride=row_stride)
        H = d.num_channels
        need = ((page_size - 1) * (row_stride or H) + H) * d.dtype.itemsize
        if pages and stride < need:
            raise ValueError("page_stride %d bytes is smaller than one page (%d bytes)" %
                             (stride, need))
        if keep is not None:
            d._keep.append(keep)
        return d

    def __repr__(self):
        return ("KVDescriptor(layers=%d, kv_heads=%d, head_dim=%d, dtype=%s, num_tokens=%d, "
                "block_size=%d, num_blocks=%d)" %
                (self.num_layers, self.kv_heads, self.head_dim, self.dtype.name, self.num_tokens,
                 self.block_size, self.num_blocks))


# ---------------------------------------------------------------------------
# Registered KV pools
# ---------------------------------------------------------------------------
class _PoolState:
    """The handle, and how many calls are using it: kvxfer_kv_pool_deregister
    must not overlap a kvxfer_send_blocks/recv_blocks naming the pool."""

    __slots__ = ("handle", "keep", "cond", "users", "__weakref__")

    def __init__(self, handle, keep):
        self.handle = handle
        self.keep = keep
        self.cond = threading.Condition(threading.Lock())
        self.users = 0


_live_pools = set()  # _PoolState still registered (for the exit hook)


def _deregister_pool(st, quiet):
    """kvxfer_kv_pool_deregister.  quiet (a dropped pool): a refusal parks the
    pool until _drain_deferred finds its requests final, instead of raising."""
    with st.cond:
        if st.handle is None:
            return
        while st.users:
            st.cond.wait()
        try:
            _L.kvxfer_kv_pool_deregister(st.handle)
        except KvxferError as e:
            if not quiet:
                raise
            log.debug("kvxfer: deferring a KV pool's deregistration: %s", e)
            with _deferred_lock:
                _deferred_pools.append(st)
            return
        st.handle = None
        st.keep = None
    _live_pools.discard(st)


class _PoolUse:
    """Context manager: the pool's handle, guarded against a concurrent close()."""

    __slots__ = ("st",)

    def __init__(self, st):
        self.st = st

    def __enter__(self):
        st = self.st
        with st.cond:
            if st.handle is None:
                raise RuntimeError("the kvxfer KV pool was deregistered (KVPool.close)")
            st.users += 1
            return st.handle

    def __exit__(self, *exc):
        st = self.st
        with st.cond:
            st.users -= 1
            if st.users == 0:
                st.cond.notify_all()
        return False


class KVPool:
    """kvxfer_kv_pool_register: a runtime's whole KV pool, registered once;
    requests then name block ids (Communicator.send_blocks/recv_blocks).

    Per layer l, block b of K starts at k_layers[l] + b * block_stride bytes
    and is block_size rows of kv_heads * head_dim elements of `dtype` (heads
    major), rows row_stride elements apart; V likewise from v_layers[l].

    k_layers, v_layers: num_layers entries each, the address of block 0 of
      each layer's K (V): an int address, a writable C-contiguous buffer
      (bytearray, mmap, a NumPy array), a ctypes object or a contiguous tensor
      (data_ptr(); on the CPU, or on CUDA device `device`).  Objects are
      size-checked (num_blocks blocks must fit) and held until close().
      vLLM's FlashAttention layout, one [2, num_blocks, block_size, heads,
      head_dim] tensor per layer, is k_layers[l] = t[0], v_layers[l] = t[1],
      or KVPool.from_layers(layers, ...).
    num_blocks: blocks per layer; block_size: tokens per block.
    dtype: Dtype or its name; row_stride: elements between rows (0 =
      kv_heads * head_dim); block_stride: bytes from block b to b + 1 (0 = one
      block's bytes, block_size * row_stride * element).
    device: -1 host memory; >= 0 the CUDA ordinal (a build without the GPU
      path refuses it with ERR_UNSUPPORTED).
    keep: objects owning memory given as raw addresses, held until close().

    Registration checks every field and, in host memory, probes each layer's
    region (its first and last byte are read and written back: nothing may
    write the pool during the call).  Errors: KvxferError ERR_INVALID_ARGUMENT
    with the library's message naming the field, layer and byte; ValueError
    or TypeError for a buffer the binding cannot use (too small, read-only).

    Ownership: the pool memory must stay valid and in place until close();
    every Request posted on the pool holds the KVPool until it is freed.
    close() (and leaving a `with` block) deregisters; it raises KvxferError
    ERR_INVALID_USAGE, leaving the pool registered, while a request on it has
    not reached COMPLETE or ERROR.  A KVPool dropped unclosed is deregistered
    once its requests are final.  Threads: any thread, concurrently with
    requests on the pool; close() waits for a send_blocks/recv_blocks call
    that is posting on it.
    """

    def __init__(self, k_layers, v_layers, *, num_blocks, block_size, kv_heads, head_dim,
                 dtype=Dtype.BF16, row_stride=0, block_stride=0, device=-1, keep=None):
        _drain_deferred()
        k_layers, v_layers = list(k_layers), list(v_layers)
        if len(k_layers) != len(v_layers):
            raise ValueError("k_layers has %d layers, v_layers %d" %
                             (len(k_layers), len(v_layers)))
        self.num_layers = len(k_layers)
        self.num_blocks = _index(num_blocks, "num_blocks")
        self.block_size = _index(block_size, "block_size")
        self.kv_heads = _index(kv_heads, "kv_heads")
        self.head_dim = _index(head_dim, "head_dim")
        self.dtype = _enum(Dtype, dtype, "dtype")
        self.row_stride = _index(row_stride, "row_stride")
        self.block_stride = _index(block_stride, "block_stride")
        self.device = _index(device, "device")
        need = self._region_bytes()
        n = max(self.num_layers, 1)
        k_arr, v_arr = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
        held = [] if keep is None else [keep]
        for name, entries, arr in (("k_layers", k_layers, k_arr), ("v_layers", v_layers, v_arr)):
            for i, e in enumerate(entries):
                m = memory_of(e, "%s[%d]" % (name, i), self.device)
                _check_itemsize(m, self.dtype, "%s[%d]" % (name, i))
                if m.readonly:
                    raise ValueError("%s[%d] is read-only; a pool is written by receives" %
                                     (name, i))
                if need is not None and m.nbytes is not None and m.nbytes < need:
                    raise ValueError("%s[%d]: %d bytes, the pool's %d blocks need %d" %
                                     (name, i, m.nbytes, self.num_blocks, need))
                arr[i] = m.address
                if m.keep is not None:
                    held.append(m.keep)
        d = _abi.init_config(_abi.KVPoolDescStruct)
        d.num_layers = self.num_layers
        d.kv_heads = self.kv_heads
        d.head_dim = self.head_dim
        d.dtype = int(self.dtype)
        d.block_size = self.block_size
        d.num_blocks = self.num_blocks
        d.row_stride = self.row_stride
        d.block_stride = self.block_stride
        d.k_layers = ctypes.cast(k_arr, ctypes.POINTER(ctypes.c_void_p))
        d.v_layers = ctypes.cast(v_arr, ctypes.POINTER(ctypes.c_void_p))
        d.device = self.device
        h = ctypes.c_void_p()
        _L.kvxfer_kv_pool_register(ctypes.byref(d), ctypes.byref(h))  # copies both arrays
        self._state = _PoolState(h.value, held)
        _live_pools.add(self._state)
        f = weakref.finalize(self, _deregister_pool, self._state, True)
        f.atexit = False  # the exit hook handles what is left

    def _region_bytes(self):
        """Bytes of num_blocks blocks from a layer's base, or None when a
        field is out of range (the library refuses it, naming it)."""
        H = self.kv_heads * self.head_dim
        if min(self.num_blocks, self.block_size, self.kv_heads, self.head_dim) < 1:
            return None
        rs = self.row_stride or H
        extent = ((self.block_size - 1) * rs + H) * self.dtype.itemsize
        stride = self.block_stride or self.block_size * rs * self.dtype.itemsize
        if rs < H or stride < extent:
            return None
        return (self.num_blocks - 1) * stride + extent

    @classmethod
    def from_layers(cls, layers, *, block_size, kv_heads, head_dim, dtype=Dtype.BF16,
                    num_blocks=None, device=-1):
        """A pool in vLLM's FlashAttention layout: one buffer per layer holding
        [2][num_blocks][block_size][kv_heads * head_dim] elements, K then V
        (contiguous rows, blocks back to back).

        layers: one entry per layer, as KVPool accepts memory; num_blocks is
        read from each buffer's size when not given (and required for int
        addresses).  The buffers are held until close().
        """
        dtype = _enum(Dtype, dtype, "dtype")
        block = (_index(block_size, "block_size") * _index(kv_heads, "kv_heads") *
                 _index(head_dim, "head_dim") * dtype.itemsize)
        if block < 1:
            raise ValueError("block_size, kv_heads and head_dim must be positive")
        k, v, keep = [], [], []
        for i, e in enumerate(layers):
            m = memory_of(e, "layers[%d]" % i, _index(device, "device"))
            _check_itemsize(m, dtype, "layers[%d]" % i)
            if num_blocks is None:
                if m.nbytes is None:
                    raise ValueError("layers[%d]: an address has no size; pass num_blocks" % i)
                if m.nbytes % (2 * block):
                    raise ValueError("layers[%d]: %d bytes is not K and V of whole %d-byte "
                                     "blocks" % (i, m.nbytes, block))
                num_blocks = m.nbytes // (2 * block)
            num_blocks = _index(num_blocks, "num_blocks")
            if m.nbytes is not None and m.nbytes < 2 * block * num_blocks:
                raise ValueError("layers[%d]: %d bytes, K and V of %d blocks need %d" %
                                 (i, m.nbytes, num_blocks, 2 * block * num_blocks))
            if m.readonly:
                raise ValueError("layers[%d] is read-only; a pool is written by receives" % i)
            k.append(m.address)
            v.append(m.address + block * num_blocks)
            keep.append(m.keep)
        return cls(k, v, num_blocks=0 if num_blocks is None else num_blocks,
                   block_size=block_size, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                   device=device, keep=keep)

    @property
    def handle(self):
        """The kvxfer_kv_pool_t as an int (None once deregistered)."""
        return self._state.handle

    @property
    def closed(self):
        return self._state.handle is None

    def _use(self):
        return _PoolUse(self._state)

    def close(self):
        """kvxfer_kv_pool_deregister.  Raises KvxferError (ERR_INVALID_USAGE,
        "<n> request(s) on the pool have not reached COMPLETE or ERROR") while
        requests on the pool are in flight; the pool then stays registered.
        Idempotent."""
        _deregister_pool(self._state, False)

    deregister = close

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return ("KVPool(layers=%d, num_blocks=%d, block_size=%d, kv_heads=%d, head_dim=%d, "
                "dtype=%s%s)" % (self.num_layers, self.num_blocks, self.block_size,
                                 self.kv_heads, self.head_dim, self.dtype.name,
                                 ", closed" if self.closed else ""))


_INT32 = _abi.int_range(ctypes.c_int32)[1:]  # (least, greatest)


def _block_id_array(block_ids):
    """(c_int32 array, count) from a sequence of ints or an int32 buffer."""
    try:
        mv = memoryview(block_ids)
    except TypeError:
        mv = None
    if mv is not None and mv.ndim == 1 and mv.itemsize == 4 and mv.format in ("i", "<i", "=i"):
        n = mv.shape[0]
        arr = (ctypes.c_int32 * max(n, 1))()
        if n:
            ctypes.memmove(arr, bytes(mv), 4 * n)
        return arr, n
    ids = []
    for i, b in enumerate(block_ids):
        try:
            if isinstance(b, bool):
                raise TypeError
            b = operator.index(b)  # ints, NumPy and tensor integer scalars
        except TypeError:
            raise TypeError("block_ids[%d] = %r is not an integer" % (i, b)) from None
        if not _INT32[0] <= b <= _INT32[1]:
            raise ValueError("block_ids[%d] = %d does not fit an int32" % (i, b))
        ids.append(b)
    arr = (ctypes.c_int32 * max(len(ids), 1))(*ids)
    return arr, len(ids)


class KVBlocks:
    """kvxfer_kv_blocks_t: one request's blocks of a KVPool (what a
    Request.kv of send_blocks/recv_blocks holds).

    Tokens [0, num_tokens) live in block block_ids[t // block_size] of every
    layer, at row t % block_size; heads [head_begin, head_begin + num_heads)
    of each row are transferred (num_heads 0: every head from head_begin).
    Both sides of a transfer must name as many heads.  The ids are copied;
    their range is checked by the library at the post.
    """

    def __init__(self, pool, block_ids, num_tokens, head_begin=0, num_heads=0):
        if not isinstance(pool, KVPool):
            raise TypeError("pool must be a KVPool, not %s" % type(pool).__name__)
        self.pool = pool
        self._ids, n = _block_id_array(block_ids)
        self.block_ids = tuple(self._ids[:n])
        self.num_tokens = _index(num_tokens, "num_tokens")
        self.head_begin = _index(head_begin, "head_begin")
        self.num_heads = _index(num_heads, "num_heads")
        s = _abi.init_config(_abi.KVBlocksStruct)
        s.num_tokens = self.num_tokens
        s.block_ids = ctypes.cast(self._ids, ctypes.POINTER(ctypes.c_int32))
        s.num_block_ids = n
        s.head_begin = self.head_begin
        s.num_heads = self.num_heads
        self._struct = s

    @property
    def heads(self):
        """KV heads the request names (num_heads, or those from head_begin)."""
        return self.num_heads or self.pool.kv_heads - self.head_begin

    def __repr__(self):
        return "KVBlocks(%d tokens, %d block ids, heads [%d, %d))" % (
            self.num_tokens, len(self.block_ids), self.head_begin, self.head_begin + self.heads)


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------
Arrival = collections.namedtuple("Arrival", "t_ns traffic_class layer bytes")


def _match_by_id(cfg, request_id, claim_timeout_ms=0):
    """Sets the request config's match_by_id and request_id (None: match by
    order), and a send's claim_timeout_ms (for ANY_PEER)."""
    if request_id is not None:
        v = _index(request_id, "request_id")
        if not -(1 << 63) <= v < (1 << 64):
            raise ValueError("request_id = %d is not a 64-bit integer" % v)
        cfg.match_by_id = 1
        cfg.request_id = v & 0xFFFFFFFFFFFFFFFF  # a negative one as two's complement
    cfg.claim_timeout_ms = _index(claim_timeout_ms, "claim_timeout_ms")


@dataclasses.dataclass(frozen=True)
class RequestInfo:
    """kvxfer_request_info_t.  Timestamps are CLOCK_MONOTONIC ns (the clock of
    time.monotonic_ns()); 0 = not reached."""

    stage: Stage
    result: int
    is_send: bool
    peer: int
    codec: Codec
    mode: Mode
    num_pages: int
    pages_anchor_ready: int
    pages_complete: int
    kv_bytes: int
    anchor_wire_bytes: int
    residual_wire_bytes: int
    t_posted_ns: int
    t_handshake_ns: int
    t_anchor_ready_ns: int
    t_complete_ns: int
    t_error_ns: int
    t_first_residual_ns: int

    @classmethod
    def _from(cls, s):
        def enum_or_int(e, v):
            try:
                return e(v)
            except ValueError:
                return v
        return cls(
            stage=enum_or_int(Stage, s.stage), result=enum_or_int(Result, s.result),
            is_send=bool(s.is_send), peer=s.peer, codec=enum_or_int(Codec, s.codec),
            mode=enum_or_int(Mode, s.mode), num_pages=s.num_pages,
            pages_anchor_ready=s.pages_anchor_ready, pages_complete=s.pages_complete,
            kv_bytes=s.kv_bytes, anchor_wire_bytes=s.anchor_wire_bytes,
            residual_wire_bytes=s.residual_wire_bytes, t_posted_ns=s.t_posted_ns,
            t_handshake_ns=s.t_handshake_ns, t_anchor_ready_ns=s.t_anchor_ready_ns,
            t_complete_ns=s.t_complete_ns, t_error_ns=s.t_error_ns,
            t_first_residual_ns=s.t_first_residual_ns)

    def timestamps(self):
        """{stage name: ns} of the stages reached (posted, handshake,
        anchor_ready, first_residual, complete, error)."""
        out = collections.OrderedDict()
        for name in ("posted", "handshake", "anchor_ready", "first_residual", "complete", "error"):
            t = getattr(self, "t_%s_ns" % name)
            if t:
                out[name] = t
        return out


_FINAL = (Stage.COMPLETE, Stage.ERROR)


class _RequestState:
    """What must outlive the Python Request object while the library holds the
    C request: the handle, the memory it reads or writes, the callbacks."""

    __slots__ = ("handle", "keep", "cond", "users", "freed", "final_cb", "posted", "__weakref__")

    def __init__(self, handle, keep, has_callbacks):
        self.handle = handle
        self.keep = keep
        self.cond = threading.Condition(threading.Lock())
        self.users = 0
        self.freed = False
        # Set once kvxfer_send/recv has returned and `handle` is known: a
        # callback may fire before the posting thread gets there.
        self.posted = threading.Event()
        # Set once the final callback has returned (or at once without callbacks).
        self.final_cb = threading.Event()
        if not has_callbacks:
            self.final_cb.set()


_live_requests = set()  # _RequestState not yet freed (for the exit hook)


def _raw_stage(handle):
    """Stage without raising (kvxfer_test's out parameter)."""
    st = ctypes.c_int(0)
    try:
        _L.kvxfer_test(handle, ctypes.byref(st))
    except KvxferError:
        pass  # stage ERROR: st is still written
    return st.value


def _release_request(st):
    """Frees the C request of a dropped Request, or parks it until it is final."""
    if st.freed:
        return
    if _in_callback() or sys.is_finalizing():
        with _deferred_lock:
            _deferred_requests.append(st)
        return
    with st.cond:
        if st.freed:
            return
        final = _raw_stage(st.handle) in _FINAL
        if final and st.final_cb.wait(0):
            try:
                _L.kvxfer_request_free(st.handle)
            except KvxferError as e:  # in flight after all: park it
                log.debug("kvxfer: deferring free: %s", e)
            else:
                st.freed = True
                st.keep = None
                _live_requests.discard(st)
                return
    with _deferred_lock:
        _deferred_requests.append(st)


# Callbacks: one trampoline for the whole process (it never goes away), the
# Python side found through user_data, a key into _callback_requests.
_callback_requests = {}
_callback_keys = itertools.count(1)


def _trampoline(handle, stage, result, user_data):
    """The C callback.  The flag "in a callback" stays set until every local of
    _dispatch is gone, so any finaliser that dropping them triggers sees it."""
    if sys.is_finalizing():
        return
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        _dispatch(stage, result, user_data)
    except BaseException:
        try:
            log.exception("kvxfer: error in the callback trampoline (ignored)")
        except BaseException:
            pass
    finally:
        _tls.depth -= 1


def _dispatch(stage, result, user_data):
    req = _callback_requests.get(user_data or 0)
    if req is None:
        return
    req._state.posted.wait(10.0)
    try:
        stage = Stage(stage)
    except ValueError:
        pass
    try:
        result = Result(result)
    except ValueError:
        pass
    fn = req._on_anchor_ready if stage == Stage.ANCHOR_READY else req._on_complete
    if fn is not None:
        try:
            fn(req, stage, result)
        except BaseException:  # never let it reach the library
            log.exception("kvxfer: exception in %s callback of %r (ignored)",
                          "on_anchor_ready" if stage == Stage.ANCHOR_READY else
                          "on_complete", req)
    if stage in _FINAL:
        req._state.final_cb.set()
        # Dropping what may be the last reference: any finaliser it
        # triggers runs here, on the progress thread, and parks its work.
        _callback_requests.pop(user_data, None)


_TRAMPOLINE = CALLBACK(_trampoline)


class Request:
    """A posted kvxfer_send, kvxfer_recv, kvxfer_send_blocks or
    kvxfer_recv_blocks (Communicator.send/recv/send_blocks/recv_blocks).
    `kv` is the KVDescriptor, or the KVBlocks of a block request.

    Stages run POSTED -> ANCHOR_READY -> COMPLETE, or end in ERROR.
    """

    def __init__(self, comm, is_send, peer, kv, tag, on_anchor_ready, on_complete, post):
        self.comm = comm
        self.kv = kv
        self.is_send = is_send
        self._peer = peer
        self.tag = tag
        self._on_anchor_ready = on_anchor_ready
        self._on_complete = on_complete
        has_cb = on_anchor_ready is not None or on_complete is not None
        cfg = _abi.init_config(_abi.RequestConfigStruct)
        cfg.tag = tag
        st = self._state = _RequestState(None, [kv, comm, cfg, _TRAMPOLINE], has_cb)
        key = 0
        if has_cb:
            key = next(_callback_keys)
            cfg.on_anchor_ready = _TRAMPOLINE
            cfg.on_complete = _TRAMPOLINE  # always: the binding must see the final stage
            cfg.user_data = key
            _callback_requests[key] = self
        handle = ctypes.c_void_p()
        try:
            post(cfg, handle)
        except BaseException:
            _callback_requests.pop(key, None)
            st.freed = True  # nothing was created
            st.posted.set()
            raise
        st.handle = handle.value
        st.posted.set()
        _live_requests.add(st)
        f = weakref.finalize(self, _release_request, st)
        f.atexit = False  # the exit hook handles what is left

    @property
    def peer(self):
        """The peer's index; for a send to ANY_PEER, the peer that took it
        (-1 until one has, or once the request is freed)."""
        if self._peer == ANY_PEER and not self._state.freed:
            return self.info().peer
        return self._peer

    # -- state -----------------------------------------------------------
    def _use(self):
        st = self._state
        return _Use(st)

    @property
    def handle(self):
        """The kvxfer_request_t as an int (for C code sharing the request)."""
        return self._state.handle

    def test(self):
        """True once COMPLETE, False before; raises KvxferError if it failed."""
        _drain_deferred()
        with self._use() as h:
            return _L.kvxfer_test(h, None) == Result.SUCCESS

    @property
    def stage(self):
        """The current Stage (never raises for a failed request: Stage.ERROR)."""
        with self._use() as h:
            return Stage(_raw_stage(h))

    @property
    def done(self):
        """True in a final stage (COMPLETE or ERROR)."""
        return self.stage in _FINAL

    def wait(self, stage=Stage.COMPLETE, timeout=None):
        """Waits until `stage` (ANCHOR_READY or COMPLETE) is reached.

        timeout: seconds, or None for no limit of its own (the communicator's
        timeout still ends a stalled transfer).  Returns True when reached,
        False when `timeout` passed first (the request goes on); raises
        KvxferError if the request failed.  Waits in slices so that Ctrl-C is
        seen.
        """
        return self._wait(None, stage, timeout)

    def test_layer(self, layer):
        """Stage of one layer (K and V) for layer-pipelined decode; raises
        KvxferError if the request failed."""
        with self._use() as h:
            st = ctypes.c_int(0)
            _L.kvxfer_test_layer(h, _index(layer, "layer"), ctypes.byref(st))
            return Stage(st.value)

    def wait_layer(self, layer, stage=Stage.COMPLETE, timeout=None):
        """wait() for one layer.  Raises KvxferError ERR_INVALID_ARGUMENT for a
        layer outside [0, num_layers), as kvxfer_wait_layer."""
        return self._wait(_index(layer, "layer"), stage, timeout)

    def _wait(self, layer, stage, timeout):
        _forbid_in_callback("Request.wait")
        _drain_deferred()
        stage = _enum(Stage, stage, "stage")
        if timeout is not None and not _real(timeout, "timeout") >= 0.0:  # NaN included
            raise ValueError("timeout must be seconds >= 0, or None (no limit), not %r" %
                             (timeout,))
        if timeout is not None and math.isinf(float(timeout)):
            timeout = None  # no limit of its own
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        while True:
            if deadline is None:
                ms = 200
            else:
                ms = max(0, min(200, int((deadline - time.monotonic()) * 1000 + 0.999)))
            with self._use() as h:
                if layer is None:
                    r = _L.kvxfer_wait(h, int(stage), ms)
                else:
                    r = _L.kvxfer_wait_layer(h, layer, int(stage), ms)
            if r == Result.SUCCESS:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def info(self):
        """RequestInfo: stage, byte counts and stage timestamps."""
        s = _abi.init_config(_abi.RequestInfoStruct)
        with self._use() as h:
            _L.kvxfer_request_get_info(h, ctypes.byref(s))
        return RequestInfo._from(s)

    def timestamps(self):
        """{stage: CLOCK_MONOTONIC ns} of the stages reached so far."""
        return self.info().timestamps()

    def arrivals(self):
        """Every page section's arrival (receiver) or send completion (sender)."""
        with self._use() as h:
            n = ctypes.c_size_t(0)
            _L.kvxfer_request_get_arrivals(h, None, 0, ctypes.byref(n))
            cap = n.value
            arr = (_abi.ArrivalStruct * max(cap, 1))()
            _L.kvxfer_request_get_arrivals(h, arr, cap, ctypes.byref(n))
            return [Arrival(a.t_ns, a.traffic_class, a.layer, a.bytes)
                    for a in arr[:min(cap, n.value)]]

    def tiers(self):
        """kvxfer_request_get_tiers: the SpectrumKV tier (Tier) of every token,
        as bytes of length num_tokens.  Sender: any time; receiver: once
        ANCHOR_READY.  Raises KvxferError (ERR_INVALID_USAGE) for another codec."""
        n = int(self.kv.num_tokens)
        buf = (ctypes.c_uint8 * max(n, 1))()
        with self._use() as h:
            _L.kvxfer_request_get_tiers(h, buf, n)
        return bytes(buf[:n])

    def layer_ready(self, layer):
        """kvxfer_send_layer_ready: layer `layer` of a send posted with
        stream_layers=True is written; its pages may now be read and sent.
        Layers leave in order, so one marked before an earlier one waits for
        it.  Marking a layer twice, or one of a final request, does nothing.
        A send whose next layer is not marked within the communicator's
        timeout of the post or of the last mark ends in ERROR (ERR_TIMEOUT,
        naming the layer), and its peer is told.
        Errors: KvxferError ERR_INVALID_ARGUMENT (layer outside
        [0, num_layers)), ERR_INVALID_USAGE (a receive, or a send posted
        without stream_layers).  Threads: any thread, callbacks included."""
        with self._use() as h:
            _L.kvxfer_send_layer_ready(h, _index(layer, "layer"))

    def cancel(self):
        """kvxfer_request_cancel: ends this request, at any stage, in ERROR with
        ERR_CANCELLED; the peer's matching request ends the same way, saying the
        peer cancelled it.  Returns at once (wait() then raises the KvxferError).
        Other requests of the communicator go on.  A final request is left as it
        is.  Idempotent."""
        with self._use() as h:
            _L.kvxfer_request_cancel(h)

    def free(self):
        """kvxfer_request_free.  Raises KvxferError (ERR_INVALID_USAGE) while the
        request is in flight.  Idempotent.  Optional: a dropped Request is
        freed for you once final."""
        _forbid_in_callback("Request.free")
        st = self._state
        with st.cond:  # another thread's free() may end the handle meanwhile
            if st.freed:
                return
            final = _raw_stage(st.handle) in _FINAL
        if final:
            # The library's free waits for a running callback; so does this,
            # first, so that the callback may still use this object.
            st.final_cb.wait(10.0)
        with st.cond:
            while st.users:
                st.cond.wait()
            if st.freed:
                return
            _L.kvxfer_request_free(st.handle)
            st.freed = True
            st.keep = None
            _live_requests.discard(st)

    def __repr__(self):
        return "Request(%s peer=%d tag=%d)" % ("send" if self.is_send else "recv", self.peer,
                                               self.tag)


class _Use:
    """Context manager: the handle, guarded against a concurrent free()."""

    __slots__ = ("st",)

    def __init__(self, st):
        self.st = st

    def __enter__(self):
        st = self.st
        with st.cond:
            if st.freed:
                raise RuntimeError("the kvxfer request was freed")
            st.users += 1
        return st.handle

    def __exit__(self, *exc):
        st = self.st
        with st.cond:
            st.users -= 1
            if st.users == 0:
                st.cond.notify_all()
        return False


# ---------------------------------------------------------------------------
# Communicator
# ---------------------------------------------------------------------------
class _CommState:
    """The handle, and how many calls are using it.  Calls run outside the
    lock (a callback may call abort() while another thread is in send());
    destroy waits for them, as kvxfer_comm_destroy must not overlap any call."""

    __slots__ = ("handle", "cond", "users", "destroyed", "__weakref__")

    def __init__(self, handle):
        self.handle = handle
        self.cond = threading.Condition(threading.Lock())
        self.users = 0
        self.destroyed = False


_live_comms = set()


def _destroy_comm(st):
    if st.destroyed:
        return
    if _in_callback():
        with _deferred_lock:
            _deferred_comms.append(st)
        return
    with st.cond:
        if st.destroyed:
            return
        st.destroyed = True  # no new call starts
        while st.users:
            st.cond.wait()
        h, st.handle = st.handle, None
    _live_comms.discard(st)
    try:
        _L.kvxfer_comm_destroy(h)
    except KvxferError as e:
        log.warning("kvxfer: kvxfer_comm_destroy: %s", e)


class Communicator:
    """kvxfer_comm_init: rank `rank` of an `nranks`-rank communicator.

    Collective and blocking: returns once every rank has joined, or raises
    KvxferError (ERR_TIMEOUT after timeout_ms; ERR_SYSTEM "bootstrap refused
    by root" for a wrong secret).  The process that made `unique_id` must be
    rank 0.  A context manager: leaving the block destroys it.

    timeout_ms: deadline of the init and inactivity timeout of every transfer
      (0 = KVXFER_TIMEOUT_MS); bind_address: numeric local address of the
      endpoints (None = KVXFER_BIND_ADDR); rate_limit: link emulation, tc
      syntax ("1gbit"; None = KVXFER_RATE_LIMIT).
    """

    def __init__(self, unique_id, rank, nranks=2, *, timeout_ms=0, bind_address=None,
                 rate_limit=None):
        _drain_deferred()
        if not isinstance(unique_id, UniqueId):
            unique_id = UniqueId(unique_id)
        cfg = _abi.init_config(_abi.CommConfigStruct)
        cfg.timeout_ms = _index(timeout_ms, "timeout_ms")
        cfg.bind_address = _text_arg(bind_address, "bind_address")
        cfg.rate_limit = _text_arg(rate_limit, "rate_limit")
        h = ctypes.c_void_p()
        rank, nranks = _index(rank, "rank"), _index(nranks, "nranks")
        _L.kvxfer_comm_init(ctypes.byref(h), nranks, unique_id._struct(), rank, ctypes.byref(cfg))
        self._adopt(h.value)
        self.rank = rank
        self.nranks = nranks

    def _adopt(self, handle):
        self._state = _CommState(handle)
        _live_comms.add(self._state)
        f = weakref.finalize(self, _destroy_comm, self._state)
        f.atexit = False

    @property
    def handle(self):
        """The kvxfer_comm_t as an int (None once destroyed)."""
        return self._state.handle

    def _call(self, fn, *args):
        st = self._state
        with st.cond:
            if st.destroyed:
                raise RuntimeError("the kvxfer communicator was destroyed")
            st.users += 1
        try:
            return fn(st.handle, *args)
        finally:
            with st.cond:
                st.users -= 1
                if st.users == 0:
                    st.cond.notify_all()

    def send(self, peer, kv, codec=None, *, tag=0, mode=Mode.AUTO, page_tokens=0,
             stream_layers=False, request_id=None, claim_timeout_ms=0, on_anchor_ready=None,
             on_complete=None):
        """kvxfer_send: sends the KV described by `kv` to rank `peer`.

        Non-blocking; returns a Request.  The i-th send to a peer matches that
        peer's i-th recv from this rank, and their tags must be equal; with
        request_id (a 64-bit int) it matches the peer's recv with the same
        request_id instead, whatever the order of the posts (a second one in
        flight with the same id: KvxferError ERR_INVALID_USAGE).  With
        request_id, peer may be ANY_PEER: the send goes to the first peer
        whose recv by that id asks for it (Request.peer then names
        it; -1 before), and fails with ERR_TIMEOUT if none asks within
        claim_timeout_ms (0: the communicator's timeout).
        codec: CodecConfig, a codec name ("lynx", "int8", "int4", "bf16",
        "spectrum": SpectrumKV with the default policy, Request.tiers()), or
        None (Lynx 4+4).  mode: Mode.AUTO/PROGRESSIVE/MONOLITHIC.  page_tokens:
        tokens per page (0 = KVXFER_PAGE_TOKENS).  stream_layers: True when
        the KV is still being produced (a prefill in progress): no page of
        layer l is read before Request.layer_ready(l), and layers leave in
        order as they are marked; host KV only, not with codec "spectrum" or
        alpha ALPHA_AUTO (ERR_UNSUPPORTED).  Callbacks: see the module doc;
        each is called as fn(request, stage, result).
        """
        _drain_deferred()
        peer, tag = _index(peer, "peer"), _index(tag, "tag")
        kv = _check_desc(kv)
        cstruct = _codec_struct(codec)
        mode = _enum(Mode, mode, "mode")

        def post(cfg, handle):
            _match_by_id(cfg, request_id, claim_timeout_ms)
            cfg.mode = int(mode)
            cfg.page_tokens = _index(page_tokens, "page_tokens")
            cfg.stream_layers = int(stream_layers)
            self._call(_L.kvxfer_send, peer, ctypes.byref(kv._desc), ctypes.byref(cstruct),
                       ctypes.byref(cfg), ctypes.byref(handle))

        return Request(self, True, peer, kv, tag, on_anchor_ready, on_complete, post)

    def send_blocks(self, peer, pool, block_ids, num_tokens, head_begin=0, num_heads=0,
                    codec=None, *, tag=0, mode=Mode.AUTO, page_tokens=0, stream_layers=False,
                    request_id=None, claim_timeout_ms=0, on_anchor_ready=None,
                    on_complete=None):
        """kvxfer_send_blocks: sends tokens [0, num_tokens) held in `block_ids`
        of a registered KVPool to rank `peer`.

        Token t is row t % block_size of block block_ids[t // block_size] of
        every layer, K and V; heads [head_begin, head_begin + num_heads) of
        each row are sent (num_heads 0: every head from head_begin).
        block_ids: ints (a list, range, array('i'), an int32 NumPy array),
        copied by the call; extra ids are ignored.  The peer sees a KV of the
        pool's layers, head_dim and dtype, num_heads heads and num_tokens
        tokens: it may receive with recv() or recv_blocks(), into another
        block size or layout.  codec, tag, mode, page_tokens, stream_layers,
        request_id (with ANY_PEER), claim_timeout_ms and the callbacks are
        send()'s.  Non-blocking; returns a Request
        (its .kv is the KVBlocks), which holds the pool until freed.
        Errors: KvxferError ERR_INVALID_ARGUMENT naming a block id out of
        range by its index and value ("block_ids[3] = 64 is not a block of
        the pool [0, 64)"), too few ids or a head range outside the pool;
        RuntimeError for a closed pool or communicator.
        """
        _drain_deferred()
        peer, tag = _index(peer, "peer"), _index(tag, "tag")
        blocks = KVBlocks(pool, block_ids, num_tokens, head_begin, num_heads)
        cstruct = _codec_struct(codec)
        mode = _enum(Mode, mode, "mode")

        def post(cfg, handle):
            _match_by_id(cfg, request_id, claim_timeout_ms)
            cfg.mode = int(mode)
            cfg.page_tokens = _index(page_tokens, "page_tokens")
            cfg.stream_layers = int(stream_layers)
            with blocks.pool._use() as ph:
                self._call(_L.kvxfer_send_blocks, peer, ph, ctypes.byref(blocks._struct),
                           ctypes.byref(cstruct), ctypes.byref(cfg), ctypes.byref(handle))

        return Request(self, True, peer, blocks, tag, on_anchor_ready, on_complete, post)

    def recv_blocks(self, peer, pool, block_ids, num_tokens, head_begin=0, num_heads=0, *,
                    tag=0, request_id=None, on_anchor_ready=None, on_complete=None):
        """kvxfer_recv_blocks: receives a KV from rank `peer` into `block_ids`
        of a registered KVPool (arguments and errors as send_blocks).  The
        blocks must stay untouched until the request is final.  A decode
        rank holding more heads than each prefill rank posts one receive per
        prefill rank, each naming that rank's heads (vLLM's heterogeneous
        tensor parallelism).  Codec and page size are the sender's."""
        _drain_deferred()
        peer, tag = _index(peer, "peer"), _index(tag, "tag")
        blocks = KVBlocks(pool, block_ids, num_tokens, head_begin, num_heads)

        def post(cfg, handle):
            _match_by_id(cfg, request_id)
            with blocks.pool._use() as ph:
                self._call(_L.kvxfer_recv_blocks, peer, ph, ctypes.byref(blocks._struct),
                           ctypes.byref(cfg), ctypes.byref(handle))

        return Request(self, False, peer, blocks, tag, on_anchor_ready, on_complete, post)

    def recv(self, peer, kv, *, tag=0, request_id=None, on_anchor_ready=None, on_complete=None):
        """kvxfer_recv: receives a KV cache from rank `peer` into `kv`'s blocks
        (which must be writable and stay untouched until the request is final).
        Codec and page size are the sender's; request_id as send()'s."""
        _drain_deferred()
        peer, tag = _index(peer, "peer"), _index(tag, "tag")
        kv = _check_desc(kv)
        if kv.readonly:
            raise ValueError("recv: the descriptor has read-only blocks")

        def post(cfg, handle):
            _match_by_id(cfg, request_id)
            self._call(_L.kvxfer_recv, peer, ctypes.byref(kv._desc), ctypes.byref(cfg),
                       ctypes.byref(handle))

        return Request(self, False, peer, kv, tag, on_anchor_ready, on_complete, post)

    def abort(self):
        """kvxfer_comm_abort: fails every request in flight (stage ERROR) and
        closes the connections; never blocks on a peer.  Idempotent.  Allowed
        from a callback."""
        if self._state.destroyed:
            return
        try:
            self._call(_L.kvxfer_comm_abort)
        except RuntimeError:  # destroyed meanwhile: nothing left to abort
            pass

    def destroy(self):
        """kvxfer_comm_destroy: aborts what is in flight, joins the threads,
        frees the communicator.  Requests stay usable (stage ERROR) until
        freed.  Idempotent."""
        _forbid_in_callback("Communicator.destroy")
        _destroy_comm(self._state)
        _drain_deferred()

    close = destroy

    @property
    def destroyed(self):
        return self._state.destroyed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
        return False

    def __repr__(self):
        return "Communicator(rank=%d, nranks=%d%s)" % (self.rank, self.nranks,
                                                      ", destroyed" if self.destroyed else "")


class Endpoint(Communicator):
    """kvxfer_endpoint_create: an endpoint whose peers connect and disconnect
    at run time (docs/TRANSPORT.md, "Endpoints").

    Every Communicator call works on it, with the peer index that connect()
    returns.  `address` (bytes) is what a peer passes to connect(): ship it
    out of band (vLLM's kv_transfer_params).  A context manager: leaving the
    block destroys it, and every connected peer is told.

    timeout_ms: inactivity timeout of every transfer and bound of a connect
      (0 = KVXFER_TIMEOUT_MS); port: TCP port of the listener (0 = any; a
      restarted process that passes its old port keeps its address);
      bind_address: local address (None = KVXFER_BIND_ADDR); rate_limit: as
      Communicator; secret: 32 bytes every endpoint of the deployment shares
      (None = a random one, carried in `address`).
    Errors: KvxferError (ERR_INVALID_ARGUMENT for a bad port, address or
    secret length; ERR_SYSTEM when the port is taken).
    """

    def __init__(self, *, timeout_ms=0, port=0, bind_address=None, rate_limit=None,
                 secret=None):
        _drain_deferred()
        cfg = _abi.init_config(_abi.EndpointConfigStruct)
        cfg.timeout_ms = _index(timeout_ms, "timeout_ms")
        cfg.port = _index(port, "port")
        cfg.bind_address = _text_arg(bind_address, "bind_address")
        cfg.rate_limit = _text_arg(rate_limit, "rate_limit")
        if secret is not None:
            if isinstance(secret, (str, numbers.Integral)):  # bytes(32): 32 zero bytes
                raise TypeError("secret must be %d bytes, not %s" %
                                (ENDPOINT_SECRET_BYTES, type(secret).__name__))
            secret = bytes(secret)
            if len(secret) != ENDPOINT_SECRET_BYTES:
                raise KvxferError(Result.ERR_INVALID_ARGUMENT,
                                  "secret is %d bytes; an endpoint secret is %d" %
                                  (len(secret), ENDPOINT_SECRET_BYTES),
                                  function="kvxfer_endpoint_create")
            buf = (ctypes.c_uint8 * ENDPOINT_SECRET_BYTES).from_buffer_copy(secret)
            cfg.secret = ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8))
        h = ctypes.c_void_p()
        _L.kvxfer_endpoint_create(ctypes.byref(h), ctypes.byref(cfg))
        self._adopt(h.value)
        self.rank = -1
        self.nranks = 0
        buf = ctypes.create_string_buffer(ENDPOINT_ADDRESS_MAX)
        n = ctypes.c_size_t(ENDPOINT_ADDRESS_MAX)
        self._call(_L.kvxfer_endpoint_address, buf, ctypes.byref(n))
        self.address = buf.raw[:n.value]

    def connect(self, address):
        """kvxfer_endpoint_connect: the peer index of the endpoint at
        `address` (bytes), connecting at the first call; the same index while
        connected, from either side.  Blocks for one handshake.  Errors:
        KvxferError ERR_INVALID_ARGUMENT (malformed address, our own, wrong
        secret), ERR_MISMATCH (the endpoint there restarted), ERR_SYSTEM
        (unreachable), ERR_TIMEOUT."""
        _drain_deferred()
        address = bytes(address)
        peer = ctypes.c_int(-1)
        self._call(_L.kvxfer_endpoint_connect, address, len(address), ctypes.byref(peer))
        return peer.value

    def disconnect(self, peer):
        """kvxfer_endpoint_disconnect: fails the peer's requests (ERR_CANCELLED)
        on both sides and frees its connection; a later connect() makes a new
        one.  Errors: KvxferError ERR_INVALID_USAGE when not connected."""
        self._call(_L.kvxfer_endpoint_disconnect, _index(peer, "peer"))

    def __repr__(self):
        return "Endpoint(%s%s)" % (self.address.hex()[:16], ", destroyed" if self.destroyed else "")


def _check_desc(kv):
    if not isinstance(kv, KVDescriptor):
        raise TypeError("kv must be a KVDescriptor, not %s" % type(kv).__name__)
    return kv


def _after_fork_in_child():
    """A fork()ed child has none of the library's threads: the parent's
    communicators, requests and pools are the parent's.  The child forgets
    them, so that neither its finalisers nor its exit hook call the library
    on them (kvxfer_comm_destroy there crashed); using them there fails as on
    destroyed objects."""
    global _deferred_lock
    _deferred_lock = threading.RLock()  # another thread may have held it at the fork
    for st in _live_comms:
        st.destroyed = True
    for st in _live_requests:
        st.freed = True
    for st in _live_pools:
        st.handle = None
    _live_comms.clear()
    _live_requests.clear()
    _live_pools.clear()
    del _deferred_requests[:], _deferred_comms[:], _deferred_pools[:]


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _at_exit():
    """Before the interpreter shuts down: stop every progress thread (so no
    callback runs into a dying interpreter), then free what is left."""
    for st in list(_live_comms):
        _destroy_comm(st)
    _drain_deferred()
    for st in list(_live_requests):
        _release_request(st)
    for st in list(_live_pools):  # after the requests: every one is final now
        try:
            _deregister_pool(st, False)
        except KvxferError as e:
            log.warning("kvxfer: kvxfer_kv_pool_deregister at exit: %s", e)


# ---------------------------------------------------------------------------
# Page codec
# ---------------------------------------------------------------------------
PageId = collections.namedtuple("PageId", "layer kind token_begin stream_id")
PageId.__new__.__defaults__ = (KVKind.KEY, 0, 0)


def _page_id_struct(pid):
    if pid is None:
        return None
    if not isinstance(pid, PageId):
        if isinstance(pid, (str, bytes)) or not isinstance(pid, collections.abc.Iterable):
            raise TypeError("page_id: a PageId(layer, kind, token_begin, stream_id) or a "
                            "sequence of those values, not %s" % type(pid).__name__)
        pid = PageId(*pid)
    s = _abi.PageIdStruct()
    s.layer = int(pid.layer)
    s.kind = int(_enum(KVKind, pid.kind, "kind"))
    s.token_begin = int(pid.token_begin)
    s.stream_id = int(pid.stream_id)
    return s


class PageLayout:
    """kvxfer_page_layout_t: one layer's K or V page in the runtime's blocks.

    Token t of the page is token first_token + t of the block list, in block
    (first_token + t) // block_size at row (first_token + t) % block_size.
    blocks: entries as in KVDescriptor.
    """

    def __init__(self, blocks, *, block_size, num_tokens, num_channels, dtype=Dtype.BF16,
                 row_stride=0, first_token=0):
        self.block_size = _index(block_size, "block_size")
        self.num_tokens = _index(num_tokens, "num_tokens")
        self.num_channels = _index(num_channels, "num_channels")
        self.dtype = _enum(Dtype, dtype, "dtype")
        self.row_stride = _index(row_stride, "row_stride") or self.num_channels
        self.first_token = _index(first_token, "first_token")
        if self.block_size < 1 or self.num_channels < 1:
            raise ValueError("block_size and num_channels must be positive")
        blocks = list(blocks)
        esize = self.dtype.itemsize

        def need(i):
            rows, last = _rows_in_block(i, self.block_size, self.num_tokens, self.first_token)
            return 0 if rows <= 0 else (last * self.row_stride + self.num_channels) * esize

        self._blocks, self._keep, self.readonly = _block_table(blocks, len(blocks), need,
                                                               "blocks")
        s = _abi.PageLayoutStruct()
        s.blocks = ctypes.cast(self._blocks, ctypes.POINTER(ctypes.c_void_p))
        s.num_blocks = len(blocks)
        s.block_size = self.block_size
        s.row_stride = self.row_stride
        s.first_token = self.first_token
        s.num_tokens = self.num_tokens
        s.num_channels = self.num_channels
        s.dtype = int(self.dtype)
        self._struct = s


def page_max_size(num_tokens, num_channels, codec=None):
    """kvxfer_page_max_size: (anchor_bytes, residual_bytes) upper bounds."""
    c = _codec_struct(codec)
    a, r = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _L.kvxfer_page_max_size(ctypes.byref(c), _index(num_tokens, "num_tokens"),
                            _index(num_channels, "num_channels"), ctypes.byref(a), ctypes.byref(r))
    return a.value, r.value


def encode_page(layout, page_id, codec=None):
    """kvxfer_page_encode: (anchor: bytes, residual: bytes) of one page.

    page_id: PageId(layer, kind, token_begin, stream_id) or a tuple of them.
    """
    c = _codec_struct(codec)
    acap, rcap = page_max_size(layout.num_tokens, layout.num_channels, codec)
    abuf = ctypes.create_string_buffer(max(acap, 1))
    rbuf = ctypes.create_string_buffer(max(rcap, 1))
    alen, rlen = ctypes.c_size_t(0), ctypes.c_size_t(0)
    pid = _page_id_struct(page_id) or _abi.PageIdStruct()
    _L.kvxfer_page_encode(ctypes.byref(c), ctypes.byref(pid), ctypes.byref(layout._struct), abuf,
                          acap, ctypes.byref(alen), rbuf, rcap, ctypes.byref(rlen))
    return abuf.raw[:alen.value], rbuf.raw[:rlen.value]


def encode_page_tiered(layout, page_id, tiers, codec=None):
    """kvxfer_page_encode_tiered: (anchor: bytes, residual: bytes) of one
    SpectrumKV page (docs/FORMAT.md section 6).

    tiers: layout.num_tokens Tier values (or ints 0..3), one per token, any
    sequence or bytes.  codec: a CodecConfig whose codec is SPECTRUM (None:
    the defaults with codec SPECTRUM); its anchor_bits splits the INT8 tier.
    Errors: ValueError when len(tiers) != num_tokens; KvxferError
    (ERR_INVALID_ARGUMENT for a tier out of range or a codec not SPECTRUM,
    ERR_NONFINITE) from the library.
    """
    if codec is None:
        codec = CodecConfig(codec=Codec.SPECTRUM)
    tiers = bytes(int(t) for t in tiers)
    if len(tiers) != layout.num_tokens:
        raise ValueError("encode_page_tiered: %d tiers for %d tokens" %
                         (len(tiers), layout.num_tokens))
    c = _codec_struct(codec)
    acap, rcap = page_max_size(layout.num_tokens, layout.num_channels, codec)
    abuf = ctypes.create_string_buffer(max(acap, 1))
    rbuf = ctypes.create_string_buffer(max(rcap, 1))
    alen, rlen = ctypes.c_size_t(0), ctypes.c_size_t(0)
    tbuf = (ctypes.c_uint8 * max(len(tiers), 1)).from_buffer_copy(tiers or b"\0")
    pid = _page_id_struct(page_id) or _abi.PageIdStruct()
    _L.kvxfer_page_encode_tiered(ctypes.byref(c), ctypes.byref(pid), ctypes.byref(layout._struct),
                                 tbuf if tiers else None, abuf, acap, ctypes.byref(alen), rbuf,
                                 rcap, ctypes.byref(rlen))
    return abuf.raw[:alen.value], rbuf.raw[:rlen.value]


def _section(obj, what):
    m = memory_of(obj, what)
    if m.nbytes is None:
        raise TypeError("%s: pass a bytes-like object (its length is needed)" % what)
    return m


def decode_page(layout, anchor, residual=None, expect=None):
    """kvxfer_page_decode into `layout`'s blocks (writable).  residual None
    decodes at anchor precision.  expect: the PageId the caller expects."""
    if layout.readonly:
        raise ValueError("decode_page: the destination layout has read-only blocks")
    a = _section(anchor, "anchor")
    if residual is None or (hasattr(residual, "__len__") and len(residual) == 0):
        raddr, rlen, r = None, 0, None
    else:
        r = _section(residual, "residual")
        raddr, rlen = r.address, r.nbytes
    e = _page_id_struct(expect)
    _L.kvxfer_page_decode(a.address, a.nbytes, raddr, rlen, None if e is None else ctypes.byref(e),
                          ctypes.byref(layout._struct))


@dataclasses.dataclass(frozen=True)
class PageInfo:
    """kvxfer_page_info_t."""

    is_residual: bool
    codec: Codec
    raw_fallback: bool
    alpha: float
    chunk_tokens: int
    anchor_bits: int
    residual_bits: int
    src_dtype: Dtype
    meta_fp32: bool
    id: PageId
    num_tokens: int
    num_channels: int
    section_bytes: int


def inspect_page(section):
    """kvxfer_page_inspect: validates one section and describes it."""
    m = _section(section, "section")
    s = _abi.PageInfoStruct()
    _L.kvxfer_page_inspect(m.address, m.nbytes, ctypes.byref(s))
    return PageInfo(bool(s.is_residual), Codec(s.codec), bool(s.raw_fallback), s.alpha,
                    s.chunk_tokens, s.anchor_bits, s.residual_bits, Dtype(s.src_dtype),
                    bool(s.meta_fp32),
                    PageId(s.id.layer, KVKind(s.id.kind), s.id.token_begin, s.id.stream_id),
                    s.num_tokens, s.num_channels, s.section_bytes)


def calibrate_alpha(layouts, codec=None):
    """kvxfer_codec_calibrate_alpha over PageLayouts; returns alpha."""
    layouts = list(layouts)
    if not layouts:
        raise ValueError("calibrate_alpha needs at least one page")
    c = _codec_struct(codec)
    arr = (_abi.PageLayoutStruct * len(layouts))(*[p._struct for p in layouts])
    alpha = ctypes.c_float(0.0)
    _L.kvxfer_codec_calibrate_alpha(ctypes.byref(c), arr, len(layouts), ctypes.byref(alpha))
    return alpha.value
