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
