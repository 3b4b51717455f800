"""Endpoints (kvxfer.Endpoint): peers that connect and disconnect at run time,
in this process.  Bytes received are compared with the codec's own decode of
the sender's values."""

import pytest

import kvxfer
from kvxfer import KVKind, Result, Stage

import kvdata

L, HEADS, HD, BS, T, POOL_BLOCKS = 2, 2, 32, 16, 100, 16
PAGE_TOKENS = 64
TIMEOUT_MS = 10000


def endpoint(**kw):
    return kvxfer.Endpoint(timeout_ms=TIMEOUT_MS, bind_address="127.0.0.1", **kw)


@pytest.mark.parametrize("codec", ["lynx", "bf16"])
def test_endpoints_connect_and_move_blocks_by_id_exactly(codec):
    src = kvdata.HostKV(L, HEADS, HD, T, 32).fill(5)
    sp, dp = kvdata.FlashPool(L, HEADS, HD, BS, POOL_BLOCKS), kvdata.FlashPool(
        L, HEADS, HD, BS, POOL_BLOCKS)
    s_ids, d_ids = kvdata.block_ids(POOL_BLOCKS, 7, 1), kvdata.block_ids(POOL_BLOCKS, 7, 2)
    for layer in range(L):
        sp.put_layer(src, layer, s_ids)
    with endpoint() as a, endpoint() as b, sp.register() as spool, dp.register() as dpool:
        ab = a.connect(b.address)
        assert a.connect(b.address) == ab  # the same peer while connected
        ba = b.connect(a.address)
        r = b.recv_blocks(ba, dpool, d_ids, T, request_id=42)
        s = a.send_blocks(ab, spool, s_ids, T, codec=codec, request_id=42, page_tokens=PAGE_TOKENS)
        assert r.wait(Stage.COMPLETE, TIMEOUT_MS / 1000)
        assert s.wait(Stage.COMPLETE, TIMEOUT_MS / 1000)
        want = kvdata.expected_decode(src, kvxfer.CodecConfig(codec), PAGE_TOKENS, 0)
        for layer in range(L):
            for kind in (KVKind.KEY, KVKind.VALUE):
                assert dp.rows(layer, kind, d_ids, T) == want.rows(layer, kind), (layer, kind)
        r.free()
        s.free()


def test_bad_addresses_and_secrets_fail_at_the_call():
    with endpoint() as a, endpoint() as b:
        for bad, words in ((b"\x00" * 40, "not an endpoint address"),
                           (b.address[:-1], "truncated"), (a.address, "this endpoint's own")):
            with pytest.raises(kvxfer.KvxferError) as e:
                a.connect(bad)
            assert e.value.code == Result.ERR_INVALID_ARGUMENT
            assert words in e.value.message, e.value.message
        forged = bytearray(b.address)
        forged[-1] ^= 1
        with pytest.raises(kvxfer.KvxferError) as e:
            a.connect(bytes(forged))
        assert "wrong secret" in e.value.message
        with pytest.raises(kvxfer.KvxferError) as e:
            kvxfer.Endpoint(secret=b"short")
        assert e.value.code == Result.ERR_INVALID_ARGUMENT
    with endpoint(secret=b"\x01" * 32) as c, endpoint(secret=b"\x02" * 32) as d:
        assert len(c.address) < len(d.address) + 1  # no secret in either blob
        with pytest.raises(kvxfer.KvxferError) as e:
            d.connect(c.address)
        assert "wrong secret" in e.value.message


def test_a_disconnect_fails_the_peers_requests_and_a_reconnect_is_new():
    kv = kvdata.HostKV(L, HEADS, HD, T, 32)
    with endpoint() as a, endpoint() as b:
        ab, ba = a.connect(b.address), b.connect(a.address)
        r = b.recv(ba, kv.descriptor(), request_id=7)
        a.disconnect(ab)
        with pytest.raises(kvxfer.KvxferError) as e:
            r.wait(Stage.COMPLETE, TIMEOUT_MS / 1000)
        assert e.value.code == Result.ERR_CANCELLED
        assert "disconnected" in e.value.message
        r.free()
        with pytest.raises(kvxfer.KvxferError) as e:
            a.disconnect(ab)
        assert e.value.code == Result.ERR_INVALID_USAGE
        ab2 = a.connect(b.address)
        assert ab2 != ab


def test_a_send_to_any_peer_goes_to_whichever_peer_asks():
    """A prefill posts sends to ANY_PEER; two decodes each ask for one by id."""
    src1 = kvdata.HostKV(L, HEADS, HD, T, 32).fill(1)
    src2 = kvdata.HostKV(L, HEADS, HD, T, 32).fill(2)
    sp = kvdata.FlashPool(L, HEADS, HD, BS, POOL_BLOCKS)
    ids1, ids2 = list(range(0, 7)), list(range(8, 15))
    for layer in range(L):
        sp.put_layer(src1, layer, ids1)
        sp.put_layer(src2, layer, ids2)
    d1, d2 = kvdata.FlashPool(L, HEADS, HD, BS, POOL_BLOCKS), kvdata.FlashPool(
        L, HEADS, HD, BS, POOL_BLOCKS)
    d_ids = kvdata.block_ids(POOL_BLOCKS, 7, 3)
    with endpoint() as prefill, endpoint() as a, endpoint() as b, sp.register() as spool, \
            d1.register() as dpool1, d2.register() as dpool2:
        s1 = prefill.send_blocks(kvxfer.ANY_PEER, spool, ids1, T, codec="lynx", request_id=101,
                                 page_tokens=PAGE_TOKENS)
        s2 = prefill.send_blocks(kvxfer.ANY_PEER, spool, ids2, T, codec="lynx", request_id=102,
                                 page_tokens=PAGE_TOKENS)
        assert s1.peer == s1.info().peer == -1
        r2 = a.recv_blocks(a.connect(prefill.address), dpool2, d_ids, T, request_id=102)
        r1 = b.recv_blocks(b.connect(prefill.address), dpool1, d_ids, T, request_id=101)
        for r in (r1, r2, s1, s2):
            assert r.wait(Stage.COMPLETE, TIMEOUT_MS / 1000)
        assert s1.peer == s1.info().peer == prefill.connect(b.address)
        assert s2.peer == prefill.connect(a.address)
        for src, dp in ((src1, d1), (src2, d2)):
            want = kvdata.expected_decode(src, kvxfer.CodecConfig("lynx"), PAGE_TOKENS, 0)
            for layer in range(L):
                for kind in (KVKind.KEY, KVKind.VALUE):
                    assert dp.rows(layer, kind, d_ids, T) == want.rows(layer, kind), (layer, kind)
        # Nobody asks for 103: it fails on its own side after its claim timeout.
        s3 = prefill.send_blocks(kvxfer.ANY_PEER, spool, ids1, T, request_id=103,
                                 claim_timeout_ms=200)
        with pytest.raises(kvxfer.KvxferError) as e:
            s3.wait(Stage.COMPLETE, 5)
        assert e.value.code == Result.ERR_TIMEOUT
        assert "no peer asked" in e.value.message
        for r in (r1, r2, s1, s2, s3):
            r.free()


def test_integers_that_do_not_fit_their_c_type_are_refused():
    """ctypes keeps an int's low bits (2**32 in an int32 is 0): the binding
    refuses instead, and a layer, peer or id never reaches a different one."""
    import array
    sp, dp = kvdata.FlashPool(L, HEADS, HD, BS, POOL_BLOCKS), kvdata.FlashPool(
        L, HEADS, HD, BS, POOL_BLOCKS)
    ids = kvdata.block_ids(POOL_BLOCKS, 7, 1)
    with endpoint() as a, endpoint() as b, sp.register() as spool, dp.register() as dpool:
        ab, ba = a.connect(b.address), b.connect(a.address)
        for kw, words in (({"request_id": 2 ** 64 + 7}, "request_id = .* is not a 64-bit"),
                          ({"request_id": 1, "tag": 2 ** 64 + 1}, "tag = .* does not fit"),
                          ({"request_id": 1, "claim_timeout_ms": 2 ** 31}, "claim_timeout_ms")):
            with pytest.raises(ValueError, match=words):
                a.send_blocks(ab, spool, ids, T, **kw)
        with pytest.raises(ValueError, match="does not fit"):
            a.send_blocks(2 ** 32 + ab, spool, ids, T, request_id=1)
        with pytest.raises(TypeError, match="peer must be an integer"):
            a.send_blocks(float(ab), spool, ids, T, request_id=1)
        for args in ((2 ** 63, 0, 0), (T, 2 ** 32, 0), (T, 0, 2 ** 32 + 1)):
            with pytest.raises(ValueError, match="kvxfer_kv_blocks_t.* does not fit"):
                b.recv_blocks(ba, dpool, ids, *args, request_id=2)
        r = b.recv_blocks(ba, dpool, ids, T, request_id=3)
        s = a.send_blocks(ab, spool, ids, T, codec="bf16", request_id=3, stream_layers=True)
        with pytest.raises(ValueError, match="kvxfer_send_layer_ready argument 2"):
            s.layer_ready(2 ** 32)  # would have marked layer 0
        with pytest.raises(kvxfer.KvxferError) as e:
            r.wait_layer(-1, timeout=0)  # not the whole request
        assert e.value.code == Result.ERR_INVALID_ARGUMENT
        assert e.value.function == "kvxfer_wait_layer"
        with pytest.raises(ValueError, match="timeout"):
            r.wait(timeout=-1)
        assert r.test_layer(0) == Stage.POSTED
        for layer in range(L):
            s.layer_ready(layer)
        assert r.wait(Stage.COMPLETE, TIMEOUT_MS / 1000) and s.wait(Stage.COMPLETE, 10)
        r.free()
        s.free()
    for kw in ({"timeout_ms": 2 ** 32 + 5}, {"port": 2 ** 32 + 1}):
        with pytest.raises(ValueError, match="kvxfer_endpoint_config_t"):
            kvxfer.Endpoint(bind_address="127.0.0.1", **kw)
    # A float64 buffer for an fp32 pool would be read as twice its elements.
    doubles = [array.array("d", bytes(2 * 4 * BS * HEADS * HD * 4)) for _ in range(L)]
    with pytest.raises(ValueError, match="8-byte elements, but dtype fp32"):
        kvxfer.KVPool.from_layers(doubles, block_size=BS, kv_heads=HEADS, head_dim=HD,
                                  dtype="fp32")
    with pytest.raises(TypeError, match="num_blocks must be an integer"):
        kvxfer.KVPool.from_layers(sp.layers, block_size=BS, kv_heads=HEADS, head_dim=HD,
                                  num_blocks=3.5)


def test_values_of_the_wrong_kind_are_refused_at_the_call():
    """A str, float or int where the binding means something else raises
    TypeError or ValueError naming it: none is silently converted."""
    import numpy as np
    for n in (32, np.int64(32)):
        with pytest.raises(TypeError, match="secret must be 32 bytes, not"):
            kvxfer.Endpoint(secret=n)  # bytes(32) would be an all-zero secret
    with pytest.raises(TypeError, match="bind_address must be a str"):
        kvxfer.Endpoint(bind_address=b"127.0.0.1")
    with pytest.raises(TypeError, match="rate_limit must be a str"):
        kvxfer.Endpoint(bind_address="127.0.0.1", rate_limit=5)
    for kw, words in (({"chunk_tokens": 32.9}, "chunk_tokens must be an integer"),
                      ({"anchor_bits": "4"}, "anchor_bits must be an integer"),
                      ({"sink_tokens": 1.5}, "sink_tokens must be an integer"),
                      ({"alpha": "0.5"}, "alpha must be a number")):
        with pytest.raises(TypeError, match=words):
            kvxfer.CodecConfig("lynx", **kw)
    kv = kvdata.HostKV(L, HEADS, HD, T, 32)
    wide = [list(blocks) for blocks in kv.k]
    wide[0][0] = 2 ** 64 + 0x1000  # ctypes would keep 0x1000
    with pytest.raises(ValueError, match="wider than 64 bits"):
        kvxfer.KVDescriptor(wide, kv.v, num_layers=L, kv_heads=HEADS, head_dim=HD,
                            block_size=32, num_tokens=T)
    src = kvdata.HostKV(L, HEADS, HD, T, 32).fill(3)
    with endpoint() as a, endpoint() as b:
        ab, ba = a.connect(b.address), b.connect(a.address)
        r = b.recv(ba, kv.descriptor(), request_id=1)
        s = a.send(ab, src.descriptor(), codec="bf16", request_id=1)
        with pytest.raises(TypeError, match="timeout must be a number"):
            r.wait(timeout="0.1")
        assert r.wait(timeout=float("inf")) and s.wait(timeout=float("inf"))  # no limit
        r.free()
        s.free()


def test_two_threads_freeing_one_request_do_not_crash():
    """free() is idempotent from any thread: the loser finds it freed (it
    used to read the freed handle's stage first, and crashed)."""
    import threading
    src = kvdata.HostKV(L, HEADS, HD, 16, 16).fill(1)
    dst = kvdata.HostKV(L, HEADS, HD, 16, 16)
    with endpoint() as a, endpoint() as b:
        ab, ba = a.connect(b.address), b.connect(a.address)
        for i in range(300):
            r = b.recv(ba, dst.descriptor(), request_id=i)
            s = a.send(ab, src.descriptor(), codec="bf16", request_id=i)
            assert r.wait(timeout=10) and s.wait(timeout=10)
            threads = [threading.Thread(target=q.free) for q in (r, r, s, s)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()


def test_requests_dropped_in_flight_in_reference_cycles_do_not_deadlock():
    """A Request in a cycle, dropped in flight, is finalised by the cyclic
    GC, which may run while this thread parks or drains dropped requests:
    the finaliser parks it under the same lock (it used to wait for itself)."""
    import gc
    import threading

    class Holder:
        pass

    dst = kvdata.HostKV(L, HEADS, HD, 16, 16)
    done = threading.Event()
    with endpoint() as a, endpoint() as b:
        a.connect(b.address)
        ba = b.connect(a.address)

        def churn():
            live = b.recv(ba, dst.descriptor(), request_id=10 ** 9)
            parked = b.recv(ba, dst.descriptor(), request_id=10 ** 9 + 1)
            del parked  # in flight: parked, so every call drains
            old = gc.get_threshold()
            gc.set_threshold(7)
            try:
                for i in range(400):
                    h = Holder()
                    h.req = b.recv(ba, dst.descriptor(), request_id=i)
                    h.req.owner = h
                    del h  # cyclic garbage, in flight
                    live.test()  # drains the parked requests
            finally:
                gc.set_threshold(*old)
                live.cancel()
            done.set()

        t = threading.Thread(target=churn, daemon=True)
        t.start()
        t.join(60)
        assert done.is_set(), "the churning thread is stuck (a deadlock)"


def test_a_forked_child_exits_cleanly_without_touching_the_parents_objects():
    """The child has none of the library's threads: its exit hook and
    finalisers leave the parent's communicators, requests and pools alone
    (kvxfer_comm_destroy in the child crashed), and objects it makes work."""
    import os
    import subprocess
    import sys
    script = (
        "import os, kvxfer\n"
        "e = kvxfer.Endpoint(bind_address='127.0.0.1')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    c = kvxfer.Endpoint(bind_address='127.0.0.1')\n"
        "    c.close()\n"
        "    raise SystemExit(0)\n"
        "_, st = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(st))\n"
        "e.close()\n")
    from conftest import child_env
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env=child_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "child 0", (out.stdout, out.stderr)
