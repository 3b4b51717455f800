"""Registered KV pools (KVPool), requests by block ids and KV head ranges
(Communicator.send_blocks / recv_blocks) and layer-streamed sends
(stream_layers, Request.layer_ready).  Two-process tests run this process as
rank 0, the receiver, and peer.py's send_blocks role as rank 1."""

import ctypes
import gc
import mmap
import time

import pytest

import kvxfer
from kvxfer import KVKind, Result, Stage

import kvdata

# vLLM FlashAttention pools of 3 layers; 100 tokens in 7 blocks of 16.
L, HD, BS, T, POOL_BLOCKS = 3, 32, 16, 100, 24
PAGE_TOKENS, TAG = 64, 7
TIMEOUT_MS = 10000


def comm0(uid, timeout_ms=TIMEOUT_MS):
    return kvxfer.Communicator(uid, rank=0, nranks=2, timeout_ms=timeout_ms,
                               bind_address="127.0.0.1")


def release(peer):
    peer.proc.stdin.write("bye\n")
    peer.proc.stdin.flush()


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------
def test_pool_registers_from_layers_and_from_k_and_v_bases():
    fp = kvdata.FlashPool(L, 2, HD, BS, POOL_BLOCKS)
    with fp.register() as pool:
        assert pool.handle and not pool.closed
        assert (pool.num_layers, pool.num_blocks, pool.block_size, pool.kv_heads,
                pool.head_dim, pool.dtype) == (L, POOL_BLOCKS, BS, 2, HD, kvxfer.Dtype.BF16)
    assert pool.closed and pool.handle is None
    pool.close()  # idempotent

    # The same pool as per-layer K and V bases: views into each layer's buffer
    # (vLLM's t[0] and t[1]), and raw addresses held through `keep`.
    half = POOL_BLOCKS * fp.block_bytes
    k = [memoryview(b)[:half] for b in fp.layers]
    v = [memoryview(b)[half:] for b in fp.layers]
    pool = kvxfer.KVPool(k, v, num_blocks=POOL_BLOCKS, block_size=BS, kv_heads=2, head_dim=HD,
                         dtype="bf16")
    assert pool.handle
    pool.close()
    arrs = [(ctypes.c_char * len(b)).from_buffer(b) for b in fp.layers]
    base = [ctypes.addressof(a) for a in arrs]
    pool = kvxfer.KVPool(base, [b + half for b in base], num_blocks=POOL_BLOCKS, block_size=BS,
                         kv_heads=2, head_dim=HD, block_stride=fp.block_bytes, keep=arrs)
    assert pool.handle
    pool.close()


def test_bad_fields_raise_the_librarys_message():
    fp = kvdata.FlashPool(2, 2, HD, BS, 8)
    half = 8 * fp.block_bytes
    k = [memoryview(b)[:half] for b in fp.layers]
    v = [memoryview(b)[half:] for b in fp.layers]
    good = dict(num_blocks=8, block_size=BS, kv_heads=2, head_dim=HD)

    def refused(words, kk=k, vv=v, **change):
        with pytest.raises(kvxfer.KvxferError) as e:
            kvxfer.KVPool(kk, vv, **dict(good, **change))
        assert e.value.code == Result.ERR_INVALID_ARGUMENT
        assert e.value.function == "kvxfer_kv_pool_register"
        assert words in e.value.message, e.value.message

    refused("KV pool: kv_heads 2 x head_dim 0 must be positive", head_dim=0)
    refused("KV pool: num_layers 0, num_blocks 8 and block_size 16 must be positive", kk=[],
            vv=[])
    refused("KV pool: block_stride 100 bytes is smaller than a block's 2048 bytes",
            block_stride=100)
    refused("KV pool: row_stride 10 is not in [64 channels", row_stride=10)
    # A layer whose blocks run past its memory: layer 1's K is 8 KiB followed
    # by an unmapped hole, given as an address (no size for the binding to
    # check).  The library probes each layer's region and names the layer.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    span = 1 << 20
    small = libc.mmap(None, span, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert small not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(small + 8192, span - 8192) == 0
    try:
        refused("KV pool: layer 1 K block", kk=[k[0], small], vv=v)
    finally:
        libc.munmap(small, 8192)
    # The binding's own checks: a buffer that cannot hold the blocks, read-only memory.
    with pytest.raises(ValueError, match=r"v_layers\[1\]: 2048 bytes, the pool's 8 blocks need "
                                         r"16384"):
        kvxfer.KVPool(k, [v[0], bytearray(2048)], **good)
    with pytest.raises(ValueError, match="read-only"):
        kvxfer.KVPool(k, [bytes(half)] * 2, **good)
    with pytest.raises(ValueError, match="2 layers"):
        kvxfer.KVPool(k, v[:1], **good)


# ---------------------------------------------------------------------------
# Errors at the post, and deregistration
# ---------------------------------------------------------------------------
def test_bad_block_ids_and_head_ranges_fail_at_the_call_naming_them(spawn_peer):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="idle", uid=uid, timeout_ms=TIMEOUT_MS)
    fp = kvdata.FlashPool(L, 2, HD, BS, POOL_BLOCKS)
    with comm0(uid) as comm, fp.register() as pool:
        ids = kvdata.block_ids(POOL_BLOCKS, 7, 1)

        def refused(words, post, *args, **kw):
            with pytest.raises(kvxfer.KvxferError) as e:
                post(1, pool, *args, **kw)
            assert e.value.code == Result.ERR_INVALID_ARGUMENT
            assert words in e.value.message, e.value.message

        bad = list(ids)
        bad[3] = POOL_BLOCKS
        refused("block_ids[3] = 24 is not a block of the pool [0, 24)", comm.recv_blocks, bad, T)
        refused("block_ids[3] = 24 is not a block of the pool [0, 24)", comm.send_blocks, bad, T,
                codec="bf16")
        bad[3] = -1
        refused("block_ids[3] = -1", comm.recv_blocks, bad, T)
        refused("num_block_ids 6 cannot hold 100 tokens", comm.recv_blocks, ids[:6], T)
        refused("heads [1, 1 + 2) are outside the pool's 2 KV heads", comm.recv_blocks, ids, T,
                head_begin=1, num_heads=2)
        with pytest.raises(ValueError, match=r"block_ids\[0\] = 2147483648 does not fit"):
            comm.recv_blocks(1, pool, [1 << 31], T)
        with pytest.raises(TypeError, match="KVPool"):
            comm.recv_blocks(1, object(), ids, T)
        assert pool.handle  # nothing above was posted: the pool closes at once
        release(peer)
    assert pool.closed
    assert peer.result().get("ok")


def test_deregister_is_refused_while_a_request_is_in_flight(spawn_peer):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="idle", uid=uid, timeout_ms=TIMEOUT_MS)
    fp = kvdata.FlashPool(L, 2, HD, BS, POOL_BLOCKS)
    with comm0(uid) as comm:
        pool = fp.register()
        req = comm.recv_blocks(1, pool, kvdata.block_ids(POOL_BLOCKS, 7, 1), T, tag=3)
        assert req.kv.pool is pool and req.kv.num_tokens == T and len(req.kv.block_ids) == 7
        with pytest.raises(kvxfer.KvxferError) as e:
            pool.close()
        assert e.value.code == Result.ERR_INVALID_USAGE
        assert e.value.function == "kvxfer_kv_pool_deregister"
        assert ("1 request(s) on the pool have not reached COMPLETE or ERROR"
                in e.value.message), e.value.message
        assert not pool.closed and pool.handle  # left as it was
        req.cancel()
        with pytest.raises(kvxfer.KvxferError) as e:
            req.wait(timeout=20)
        assert e.value.code == Result.ERR_CANCELLED
        pool.close()
        assert pool.closed
        with pytest.raises(RuntimeError, match="deregistered"):
            comm.recv_blocks(1, pool, [0], 1)
        req.free()

        # A pool dropped while a request on it is in flight stays registered
        # (the request holds it) until the request is final and freed.
        from kvxfer import core
        pool = fp.register()
        st = pool._state
        req = comm.recv_blocks(1, pool, [2, 5], 20, tag=4)
        del pool
        gc.collect()
        assert st.handle and st in core._live_pools
        req.cancel()
        with pytest.raises(kvxfer.KvxferError):
            req.wait(timeout=20)
        req.free()
        del req
        gc.collect()
        core._drain_deferred()
        assert st.handle is None and st not in core._live_pools
        release(peer)
    assert peer.result().get("ok")


def test_layer_ready_misuse_is_refused(spawn_peer):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="idle", uid=uid, timeout_ms=TIMEOUT_MS)
    fp = kvdata.FlashPool(L, 2, HD, BS, POOL_BLOCKS)
    ids = kvdata.block_ids(POOL_BLOCKS, 7, 1)
    with comm0(uid) as comm, fp.register() as pool:
        with pytest.raises(kvxfer.KvxferError) as e:
            comm.send_blocks(1, pool, ids, T, codec="spectrum", stream_layers=True)
        assert e.value.code == Result.ERR_UNSUPPORTED
        with pytest.raises(kvxfer.KvxferError) as e:
            comm.send_blocks(1, pool, ids, T, stream_layers=2)
        assert "stream_layers 2 is not 0 or 1" in e.value.message
        plain = comm.send_blocks(1, pool, ids, T, tag=1)
        recv = comm.recv_blocks(1, pool, ids, T, tag=2)
        streamed = comm.send_blocks(1, pool, ids, T, tag=3, stream_layers=True)
        for r in (plain, recv):
            with pytest.raises(kvxfer.KvxferError) as e:
                r.layer_ready(0)
            assert e.value.code == Result.ERR_INVALID_USAGE
            assert "stream_layers = 1" in e.value.message
        for layer in (-1, L):
            with pytest.raises(kvxfer.KvxferError) as e:
                streamed.layer_ready(layer)
            assert e.value.code == Result.ERR_INVALID_ARGUMENT
            assert "layer %d is outside [0, %d)" % (layer, L) in e.value.message
        streamed.layer_ready(0)
        streamed.layer_ready(0)  # twice: no change
        for r in (plain, recv, streamed):
            r.cancel()
            with pytest.raises(kvxfer.KvxferError):
                r.wait(timeout=20)
            r.free()
        release(peer)
    assert peer.result().get("ok")


# ---------------------------------------------------------------------------
# Transfers by block ids
# ---------------------------------------------------------------------------
def expected(codec, seed, heads=2):
    """What the receiver must hold: the sender's values (bf16) or the codec's
    own encode + decode of them (kvxfer_page_encode / kvxfer_page_decode)."""
    src = kvdata.HostKV(L, heads, HD, T, BS).fill(seed)
    if codec == "bf16":
        return src
    return kvdata.expected_decode(src, kvxfer.CodecConfig(codec=codec), PAGE_TOKENS, TAG)


@pytest.mark.parametrize("codec,pool_heads,head_begin", [("bf16", 4, 2), ("lynx", 2, 0)])
def test_transfer_by_block_ids_is_exact(spawn_peer, codec, pool_heads, head_begin):
    """The sender's heads [1, 3) of a 3-head pool, at shuffled ids, land in
    another set of ids of this side's pool, as heads [head_begin, +2); the
    other heads of those blocks and every other block stay untouched."""
    seed = 21
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send_blocks", uid=uid, L=L, heads=2, pool_heads=3, send_h0=1, hd=HD,
                      T=T, block_size=BS, pool_blocks=40, seed=seed, tag=TAG,
                      page_tokens=PAGE_TOKENS, codec={"codec": codec})
    fp = kvdata.FlashPool(L, pool_heads, HD, BS, POOL_BLOCKS)
    ids = kvdata.block_ids(POOL_BLOCKS, 7, seed + 1)
    with comm0(uid) as comm, fp.register() as pool:
        req = comm.recv_blocks(1, pool, ids + [0, 1], T, head_begin, 2, tag=TAG)  # extra ids
        assert req.wait(timeout=30)
        info = req.info()
        assert info.stage == Stage.COMPLETE
        assert info.codec == kvxfer.Codec[codec.upper()]
        assert info.kv_bytes == 2 * L * T * 2 * HD * 2
        req.free()
    rep = peer.result()
    assert rep.get("ok"), rep
    assert rep["info"]["anchor_wire_bytes"] == info.anchor_wire_bytes > 0
    assert rep["info"]["residual_wire_bytes"] == info.residual_wire_bytes
    assert (info.residual_wire_bytes > 0) == (codec == "lynx")
    want = expected(codec, seed)
    untouched = b"\xa5" * (T * head_begin * HD * 2)
    for layer in range(L):
        for kind in (KVKind.KEY, KVKind.VALUE):
            got = fp.rows(layer, kind, ids, T, head_begin, 2)
            assert got == want.rows(layer, kind), (layer, kind)
            assert fp.rows(layer, kind, ids, T, 0, head_begin) == untouched, (layer, kind)
    rest = [b for b in range(POOL_BLOCKS) if b not in ids]
    for layer in range(L):
        assert fp.rows(layer, KVKind.VALUE, rest, len(rest) * BS) == \
            b"\xa5" * (len(rest) * BS * fp.H * 2)


@pytest.mark.parametrize("codec", ["bf16", "lynx"])
def test_layer_streamed_send_arrives_as_layers_are_marked(spawn_peer, codec):
    """The sender posts before its KV exists, then writes and marks layers
    0 .. L-2; layer L-2 arrives here while L-1 is still unwritten (0xA5 in
    the sender's pool) and unsent.  Once released, the sender writes and
    marks it, and every byte here is exact."""
    seed = 33
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send_blocks", uid=uid, L=L, heads=2, hd=HD, T=T, block_size=BS,
                      pool_blocks=POOL_BLOCKS, seed=seed, tag=TAG, page_tokens=PAGE_TOKENS,
                      codec={"codec": codec}, stream=True)
    fp = kvdata.FlashPool(L, 2, HD, BS, POOL_BLOCKS)
    ids = kvdata.block_ids(POOL_BLOCKS, 7, seed + 1)
    with comm0(uid) as comm, fp.register() as pool:
        req = comm.recv_blocks(1, pool, ids, T, tag=TAG)
        assert req.wait_layer(L - 2, Stage.ANCHOR_READY, timeout=30)
        assert peer.readline().strip() == "MARKED"
        time.sleep(0.05)
        assert req.test_layer(L - 1) == Stage.POSTED
        assert req.stage == Stage.POSTED
        assert fp.rows(L - 1, KVKind.KEY, ids, T) == b"\xa5" * (T * fp.H * 2)
        release(peer)  # the sender writes and marks the last layer
        assert req.wait(timeout=30)
        req.free()
    rep = peer.result()
    assert rep.get("ok"), rep
    want = expected(codec, seed)
    for layer in range(L):
        for kind in (KVKind.KEY, KVKind.VALUE):
            assert fp.rows(layer, kind, ids, T) == want.rows(layer, kind), (layer, kind)
