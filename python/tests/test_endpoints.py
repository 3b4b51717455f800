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
