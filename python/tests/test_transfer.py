"""Two-process transfers through the binding: this process is rank 0 and
receives; peer.py (rank 1) sends."""

import threading
import time

import pytest

import kvxfer
from kvxfer import Stage

import kvdata

SHAPE = dict(L=2, heads=2, hd=32, T=200)
TIMEOUT_MS = 10000


def comm0(uid, timeout_ms=TIMEOUT_MS):
    return kvxfer.Communicator(uid, rank=0, nranks=2, timeout_ms=timeout_ms,
                               bind_address="127.0.0.1")


def test_bf16_monolithic_round_trip_is_byte_exact(spawn_peer):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send", uid=uid, block_size=16, seed=5, tag=3,
                      codec={"codec": "bf16"}, **SHAPE)
    with comm0(uid) as comm:
        dst = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 48, pad=3)
        req = comm.recv(1, dst.descriptor(), tag=3)
        assert req.wait(timeout=30)
        info = req.info()
        assert info.stage == Stage.COMPLETE
        assert info.mode == kvxfer.Mode.MONOLITHIC
        assert info.codec == kvxfer.Codec.BF16
        assert info.kv_bytes == 2 * 2 * 200 * 64 * 2
        req.free()
    rep = peer.result()
    assert rep.get("ok"), rep
    src = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 16).fill(5)
    for layer in range(SHAPE["L"]):
        for kind in (kvxfer.KVKind.KEY, kvxfer.KVKind.VALUE):
            assert dst.rows(layer, kind) == src.rows(layer, kind), (layer, kind)
    assert rep["info"]["anchor_wire_bytes"] == info.anchor_wire_bytes  # bytes sent == received
    assert rep["info"]["residual_wire_bytes"] == info.residual_wire_bytes == 0


def test_requests_by_id_match_whatever_the_order(spawn_peer):
    """The peer sends ids 7, 8, 9 in that order; this side receives 9, 7, 8,
    each by request_id: every KV lands in the receive of its id, byte for
    byte, and a second receive of an id in flight is refused."""
    uid = kvxfer.UniqueId.create()
    ids = [7, 8, 9]
    peer = spawn_peer(role="send_by_id", uid=uid, ids=ids, block_size=16, seed=40, tag=2,
                      codec={"codec": "bf16"}, **SHAPE)
    with comm0(uid) as comm:
        dst = {i: kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 32)
               for i in ids}
        reqs = {i: comm.recv(1, dst[i].descriptor(), tag=2, request_id=i) for i in (9, 7, 8)}
        with pytest.raises(kvxfer.KvxferError) as e:
            comm.recv(1, dst[9].descriptor(), tag=2, request_id=9)
        assert e.value.code == kvxfer.Result.ERR_INVALID_USAGE
        assert "request id 9 is already in flight" in str(e.value)
        for r in reqs.values():
            assert r.wait(timeout=30)
            r.free()
    rep = peer.result()
    assert rep.get("ok"), rep
    for i in ids:
        src = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 16).fill(40 + i)
        for layer in range(SHAPE["L"]):
            for kind in (kvxfer.KVKind.KEY, kvxfer.KVKind.VALUE):
                assert dst[i].rows(layer, kind) == src.rows(layer, kind), (i, layer, kind)


@pytest.mark.parametrize("dtype", [kvxfer.Dtype.BF16, kvxfer.Dtype.FP16, kvxfer.Dtype.FP32])
@pytest.mark.parametrize("codec,mode", [("lynx", kvxfer.Mode.PROGRESSIVE),
                                        ("bf16", kvxfer.Mode.MONOLITHIC)])
def test_every_dtype_arrives_as_the_codec_decodes_it(spawn_peer, dtype, codec, mode):
    """The KV in each dtype, on both sides: the receiver holds the codec's own
    decode of the sender's pages of that dtype, bit for bit; byte counts agree."""
    page_tokens, tag = 64, 6
    shape = dict(SHAPE, T=100)
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send", uid=uid, block_size=16, seed=8, tag=tag, dtype=int(dtype),
                      codec={"codec": codec}, mode=int(mode), page_tokens=page_tokens, **shape)
    with comm0(uid) as comm:
        dst = kvdata.HostKV(shape["L"], shape["heads"], shape["hd"], shape["T"], 24, dtype, pad=3)
        req = comm.recv(1, dst.descriptor(), tag=tag)
        assert req.wait(timeout=30)
        info = req.info()
        req.free()
    rep = peer.result()
    assert rep.get("ok"), rep
    assert info.mode == mode
    assert info.kv_bytes == 2 * shape["L"] * shape["T"] * 64 * kvdata.ITEMSIZE[dtype]
    assert rep["info"]["anchor_wire_bytes"] == info.anchor_wire_bytes > 0
    assert rep["info"]["residual_wire_bytes"] == info.residual_wire_bytes
    assert (info.residual_wire_bytes > 0) == (mode == kvxfer.Mode.PROGRESSIVE)
    src = kvdata.HostKV(shape["L"], shape["heads"], shape["hd"], shape["T"], 16, dtype).fill(8)
    want = kvdata.expected_decode(src, kvxfer.CodecConfig(codec=codec), page_tokens, tag)
    for layer in range(shape["L"]):
        for kind in (kvxfer.KVKind.KEY, kvxfer.KVKind.VALUE):
            assert dst.rows(layer, kind) == want.rows(layer, kind), (layer, kind)


def test_spectrum_tiers_agree_and_sinks_are_fp16(spawn_peer):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send", uid=uid, block_size=16, seed=9, tag=4,
                      codec={"codec": "spectrum"}, **SHAPE)
    with comm0(uid) as comm:
        dst = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 48, pad=3)
        req = comm.recv(1, dst.descriptor(), tag=4)
        assert req.wait(timeout=30)
        info = req.info()
        assert info.codec == kvxfer.Codec.SPECTRUM
        assert info.mode == kvxfer.Mode.PROGRESSIVE
        tiers = req.tiers()
        req.free()
    rep = peer.result()
    assert rep.get("ok"), rep
    assert list(tiers) == rep["tiers"]  # the receiver read what the sender's policy chose
    assert len(tiers) == SHAPE["T"]
    # The default policy (b = 0.55, no INT4) at T = 200: U = 440 quarter-token
    # units; 4 FP16 sinks, then 16 more FP16 and 180 INT8 (docs/SPECTRUMKV.md).
    assert list(tiers[:4]) == [kvxfer.Tier.FP16] * 4
    assert tiers.count(kvxfer.Tier.FP16) == 20
    assert tiers.count(kvxfer.Tier.INT8) == 180
    assert tiers.count(kvxfer.Tier.INT4) == tiers.count(kvxfer.Tier.DROP) == 0
    row_bytes = 2 * SHAPE["heads"] * SHAPE["hd"]  # bf16
    rows = dst.rows(0, kvxfer.KVKind.KEY)
    src = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 16).fill(9)
    for t in range(SHAPE["T"]):
        assert rows[t * row_bytes:(t + 1) * row_bytes] != bytes(row_bytes), t  # nothing dropped
    assert src.rows(0, kvxfer.KVKind.KEY) != rows  # not lossless: INT8 tokens


def test_lynx_progressive_stages_and_values(spawn_peer):
    page_tokens, tag = 64, 11
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send", uid=uid, block_size=16, seed=9, tag=tag,
                      page_tokens=page_tokens, **SHAPE)
    events = []
    lock = threading.Lock()
    done = threading.Event()

    def on_anchor(req, stage, result):
        with lock:
            events.append(("anchor", stage, result, req.info().t_anchor_ready_ns))

    def on_complete(req, stage, result):
        with lock:
            events.append(("complete", stage, result, req.info().t_complete_ns))
        done.set()

    with comm0(uid) as comm:
        dst = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 24, pad=5)
        req = comm.recv(1, dst.descriptor(), tag=tag, on_anchor_ready=on_anchor,
                        on_complete=on_complete)
        assert req.wait(Stage.ANCHOR_READY, timeout=30)
        assert req.stage in (Stage.ANCHOR_READY, Stage.COMPLETE)
        assert req.wait(Stage.COMPLETE, timeout=30)
        assert req.test() is True
        assert done.wait(10), "on_complete never ran"
        with pytest.raises(kvxfer.KvxferError) as e:
            req.tiers()  # only SPECTRUM requests have tiers
        assert e.value.code == kvxfer.Result.ERR_INVALID_USAGE
        info = req.info()
        arrivals = req.arrivals()
        for layer in range(SHAPE["L"]):
            assert req.test_layer(layer) == Stage.COMPLETE
            assert req.wait_layer(layer, timeout=1)
        req.free()
        req.free()  # idempotent

    # Stage order: ANCHOR_READY before COMPLETE, in the timestamps and the callbacks.
    assert info.mode == kvxfer.Mode.PROGRESSIVE and info.codec == kvxfer.Codec.LYNX
    assert 0 < info.t_posted_ns <= info.t_handshake_ns <= info.t_anchor_ready_ns
    assert info.t_anchor_ready_ns <= info.t_complete_ns
    assert info.t_error_ns == 0
    ts = info.timestamps()
    assert list(ts)[0] == "posted" and list(ts)[-1] == "complete"
    assert [e[0] for e in events] == ["anchor", "complete"]
    assert events[0][1] == Stage.ANCHOR_READY and events[1][1] == Stage.COMPLETE
    assert events[1][2] == kvxfer.Result.SUCCESS
    assert events[0][3] <= events[1][3]
    n = SHAPE["L"] * 2 * 4  # 200 tokens in pages of 64: 4 pages per layer and kind
    assert info.num_pages == info.pages_complete == n
    assert len(arrivals) == 2 * n  # one anchor and one residual per page
    assert {a.traffic_class for a in arrivals} == {0, 1}
    first_residual = min(a.t_ns for a in arrivals if a.traffic_class == 1)
    assert min(a.t_ns for a in arrivals if a.traffic_class == 0) <= first_residual

    rep = peer.result()
    assert rep.get("ok"), rep
    assert rep["info"]["anchor_wire_bytes"] == info.anchor_wire_bytes
    assert rep["info"]["residual_wire_bytes"] == info.residual_wire_bytes

    # Values: bit-exact with the codec's own encode + decode of the sender's
    # pages (kvxfer_page_encode / kvxfer_page_decode), and close to the input.
    src = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 16).fill(9)
    want = kvdata.expected_decode(src, kvxfer.CodecConfig(), page_tokens, tag)
    for layer in range(SHAPE["L"]):
        for kind in (kvxfer.KVKind.KEY, kvxfer.KVKind.VALUE):
            got = dst.rows(layer, kind)
            assert got == want.rows(layer, kind), (layer, kind)
            a = kvdata.decode_floats(got, kvxfer.Dtype.BF16)
            b = kvdata.decode_floats(src.rows(layer, kind), kvxfer.Dtype.BF16)
            # 8-bit codes of per-(chunk, channel) normalised values: the error
            # of each channel is a small fraction of that channel's range.
            H = SHAPE["heads"] * SHAPE["hd"]
            for c in range(H):
                col_a, col_b = a[c::H], b[c::H]
                span = max(col_b) - min(col_b)
                err = max(abs(x - y) for x, y in zip(col_a, col_b))
                assert err <= 0.02 * span + 1e-2, (layer, kind, c, err, span)


def test_callback_exceptions_are_logged_not_fatal(spawn_peer, caplog):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send", uid=uid, block_size=16, seed=1, tag=0,
                      codec={"codec": "int8"}, **dict(SHAPE, T=40))
    called = threading.Event()

    def bad(req, stage, result):
        called.set()
        raise ValueError("boom from a user callback")

    def waits(req, stage, result):
        req.wait()  # not allowed from a callback: RuntimeError, logged

    with caplog.at_level("ERROR", logger="kvxfer"):
        with comm0(uid) as comm:
            dst = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], 40, 16)
            req = comm.recv(1, dst.descriptor(), on_anchor_ready=waits, on_complete=bad)
            assert req.wait(timeout=30)
            assert called.wait(10)
            req.free()
    assert peer.result().get("ok")
    text = caplog.text
    assert "boom from a user callback" in text
    assert "progress thread" in text  # the RuntimeError of wait() inside a callback


def test_dropped_request_keeps_its_buffers_until_final(spawn_peer):
    """A Request dropped in flight is parked, not freed; its memory stays."""
    import gc
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send", uid=uid, block_size=16, seed=2, tag=0,
                      codec={"codec": "bf16"}, **SHAPE)
    with comm0(uid) as comm:
        dst = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 16)
        comm.recv(1, dst.descriptor())  # dropped at once, in flight
        gc.collect()
        # The sender completes only once the receiver confirmed every page.
        assert peer.result().get("ok")
    src = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], SHAPE["T"], 16).fill(2)
    assert dst.rows(1, kvxfer.KVKind.VALUE) == src.rows(1, kvxfer.KVKind.VALUE)


def test_abort_from_a_callback_fails_the_other_requests(spawn_peer):
    """The first receive fails its handshake (one token more than the sender);
    its on_complete aborts the communicator (allowed from a callback), which
    ends the other receives, never matched, in ERROR at once."""
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send", uid=uid, block_size=16, seed=4, tag=0,
                      codec={"codec": "bf16"}, **dict(SHAPE, T=20))
    finals = []

    def on_complete(req, stage, result):
        finals.append((req.tag, stage, result))
        req.comm.abort()

    with comm0(uid) as comm:
        reqs = []
        for i in range(3):
            dst = kvdata.HostKV(SHAPE["L"], SHAPE["heads"], SHAPE["hd"], 21, 16)
            try:
                reqs.append(comm.recv(1, dst.descriptor(), tag=0 if i == 0 else 100 + i,
                                      on_complete=on_complete))
            except kvxfer.KvxferError as e:
                # The first one's abort came before this post: refused, as
                # an aborted communicator refuses every post.
                assert i > 0 and e.code == kvxfer.Result.ERR_INVALID_USAGE, e
                assert "abort" in e.message
        with pytest.raises(kvxfer.KvxferError) as e:
            reqs[0].wait(timeout=30)
        assert e.value.code == kvxfer.Result.ERR_MISMATCH
        for r in reqs[1:]:
            with pytest.raises(kvxfer.KvxferError) as e:
                r.wait(timeout=10)
            assert e.value.code == kvxfer.Result.ERR_INVALID_USAGE
            assert "abort" in e.value.message
            assert r.stage == Stage.ERROR
        for r in reqs:
            r.free()
    # The peer is not waited for: the abort can cut the receiver's last status
    # message (the library runs callbacks before sending it), and the sender
    # then learns of the mismatch only seconds later.  Teardown kills it.
    del peer
    assert sorted(finals) == [(0, Stage.ERROR, kvxfer.Result.ERR_MISMATCH)] + [
        (r.tag, Stage.ERROR, kvxfer.Result.ERR_INVALID_USAGE) for r in reqs[1:]]


def test_many_requests_with_callbacks_dropped_in_flight(spawn_peer):
    """32 receives in flight with callbacks, the Request objects dropped at
    once and the garbage collector run from the callbacks' thread and this
    one: every callback runs once, nothing deadlocks, every KV is exact."""
    import gc
    n = 32
    shape = dict(L=2, heads=2, hd=32, T=40)
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send_many", uid=uid, count=n, block_size=16, seed=100,
                      codec={"codec": "bf16"}, page_tokens=16, **shape)
    finals = []
    lock = threading.Lock()
    all_done = threading.Event()

    def on_complete(req, stage, result):
        gc.collect()  # finalisers on the progress thread must only park their work
        with lock:
            finals.append((req.tag, stage))
            if len(finals) == n:
                all_done.set()

    dsts = []
    with comm0(uid) as comm:
        for i in range(n):
            dst = kvdata.HostKV(shape["L"], shape["heads"], shape["hd"], shape["T"], 8)
            dsts.append(dst)
            comm.recv(1, dst.descriptor(), tag=i, on_complete=on_complete,
                      on_anchor_ready=lambda r, s, res: None)
            gc.collect()
        assert all_done.wait(60), len(finals)
        rep = peer.result()
        assert rep["ok"], rep
        gc.collect()
    assert sorted(finals) == [(i, Stage.COMPLETE) for i in range(n)]
    for i, dst in enumerate(dsts):
        src = kvdata.HostKV(shape["L"], shape["heads"], shape["hd"], shape["T"], 16).fill(100 + i)
        assert dst.rows(1, kvxfer.KVKind.KEY) == src.rows(1, kvxfer.KVKind.KEY), i
    from kvxfer import core
    core._drain_deferred()
    assert not core._deferred_requests
    assert not any(st for st in core._live_requests if not st.freed)


def test_cancel_mid_anchor_fails_both_sides_promptly(spawn_peer):
    uid = kvxfer.UniqueId.create()
    big = dict(L=8, heads=2, hd=64, T=1024)  # seconds of Lynx sections at 8 mbit/s
    peer = spawn_peer(role="send", uid=uid, block_size=16, seed=3, tag=1, rate_limit="8mbit",
                      page_tokens=128, **big)
    with comm0(uid) as comm:
        dst = kvdata.HostKV(big["L"], big["heads"], big["hd"], big["T"], 16)
        req = comm.recv(1, dst.descriptor(), tag=1)
        deadline = time.monotonic() + 30
        while req.info().pages_anchor_ready < 2 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert req.stage == Stage.POSTED  # mid-anchor
        t0 = time.monotonic()
        req.cancel()
        with pytest.raises(kvxfer.KvxferError) as e:
            req.wait(timeout=30)
        assert time.monotonic() - t0 < 1.5
        assert e.value.code == kvxfer.Result.ERR_CANCELLED
        assert "cancelled on rank 0" in e.value.message
        req.cancel()  # final: no-op
        req.free()
        rep = peer.result()
        assert rep["error"]["code"] == kvxfer.Result.ERR_CANCELLED, rep
        assert "the peer cancelled the request" in rep["error"]["message"], rep
