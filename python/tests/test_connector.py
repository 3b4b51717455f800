"""kvxfer.connector: SGLang-style KVSender / KVReceiver over pool pages.
This process is the decode side (rank 0); peer.py role "connector" is the
prefill side (rank 1)."""

import time

import pytest

import kvxfer
from kvxfer import connector
from kvxfer.connector import KVPoll

import kvdata

POOL = dict(L=2, heads=2, hd=32, num_pages=12, page_size=16)


def poll_until_final(recv, timeout=60):
    states = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = recv.poll()
        if not states or states[-1] != s:
            states.append(s)
        if s in (KVPoll.Success, KVPoll.Failed):
            return states
        time.sleep(0.002)
    raise AssertionError("no final state; states so far: %s" % states)


def test_pages_move_between_pools(spawn_peer):
    send_pages = [7, 2, 5, 0, 11]
    recv_pages = [1, 6, 3, 4, 9]
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="connector", uid=uid, room=424242, seed=3, pages=send_pages,
                      pool=dict(POOL, gap=64), codec={"codec": "bf16"}, page_tokens=32)
    pool = kvdata.Pool(**POOL)
    mgr = connector.KVManager(pool.args(), connector.Role.DECODE, uid, rank=0, peer=1,
                              timeout_ms=10000, bind_address="127.0.0.1")
    try:
        recv = connector.KVReceiver(mgr, bootstrap_room=424242)
        first = recv.poll()
        assert first in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
        recv.init(recv_pages)  # may be before the communicator is up: queued
        states = [first] + poll_until_final(recv)
        assert states[-1] == KVPoll.Success, recv.failure_exception()
        # Monotonic, in SGLang's order (AnchorReady between Transferring and Success).
        assert states == sorted(states), states
        ts = recv.timestamps()
        assert ts["posted"] <= ts["anchor_ready"] <= ts["complete"]
        assert recv.layer_state(0) == kvxfer.Stage.COMPLETE
    finally:
        mgr.close()
    rep = peer.result()
    assert "error" not in rep, rep
    assert rep["states"][-1] == "Success"
    assert rep["states"].index("WaitingForInput") < rep["states"].index("Success")
    src = kvdata.Pool(**dict(POOL, gap=64)).fill_pages(send_pages, 3)
    for layer in range(POOL["L"]):
        for kind in (kvxfer.KVKind.KEY, kvxfer.KVKind.VALUE):
            assert pool.rows(recv_pages, layer, kind) == src.rows(send_pages, layer, kind)
    # Pages the transfer does not name are untouched.
    assert pool.k[0][:pool.page_stride] == b"\xa5" * pool.page_stride


def test_lynx_anchor_ready_then_success(spawn_peer):
    pages = list(range(8))
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="connector", uid=uid, room=7, seed=5, pages=pages, pool=POOL,
                      page_tokens=32)
    pool = kvdata.Pool(**POOL)
    with connector.KVManager(pool.args(), "decode", uid, rank=0, peer=1, timeout_ms=10000,
                             bind_address="127.0.0.1") as mgr:
        assert mgr.wait_ready(30)
        recv = connector.KVReceiver(mgr, bootstrap_room=7)
        assert recv.poll() == KVPoll.WaitingForInput  # up, before init
        recv.init(pages)
        states = poll_until_final(recv)
        assert states[-1] == KVPoll.Success, states
        info = recv.info()
        assert info.mode == kvxfer.Mode.PROGRESSIVE
        assert 0 < info.t_anchor_ready_ns <= info.t_complete_ns
    rep = peer.result()
    assert "error" not in rep, rep


def test_rooms_posted_out_of_order_fail_naming_the_tag(spawn_peer):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="connector", uid=uid, room=1, seed=5, pages=[0, 1], pool=POOL)
    pool = kvdata.Pool(**POOL)
    with connector.KVManager(pool.args(), "decode", uid, rank=0, peer=1, timeout_ms=10000,
                             bind_address="127.0.0.1") as mgr:
        recv = connector.KVReceiver(mgr, bootstrap_room=2)  # the sender's first room is 1
        recv.init([3, 4])
        states = poll_until_final(recv)
        assert states[-1] == KVPoll.Failed
        with pytest.raises(kvxfer.KvxferError) as e:
            recv.failure_exception()
        assert e.value.code == kvxfer.Result.ERR_MISMATCH and "tag" in e.value.message
    rep = peer.result()
    assert rep["states"][-1] == "Failed" and rep["error"]["code"] == kvxfer.Result.ERR_MISMATCH


def test_cancelled_receiver_fails_both_sides(spawn_peer):
    # The decode side drops the request (client gone) right after init: it is
    # still posted, so the prefill side's next transfer keeps matching, and
    # the prefill side fails saying the peer cancelled.
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="connector", uid=uid, room=5, seed=5, pages=[0, 1, 2], pool=POOL)
    pool = kvdata.Pool(**POOL)
    with connector.KVManager(pool.args(), "decode", uid, rank=0, peer=1, timeout_ms=10000,
                             bind_address="127.0.0.1") as mgr:
        recv = connector.KVReceiver(mgr, bootstrap_room=5)
        recv.init([3, 4, 5])
        recv.cancel()
        states = poll_until_final(recv)
        assert states[-1] == KVPoll.Failed
        with pytest.raises(kvxfer.KvxferError) as e:
            recv.failure_exception()
        assert e.value.code == kvxfer.Result.ERR_CANCELLED
    rep = peer.result()
    assert rep["states"][-1] == "Failed", rep
    assert rep["error"]["code"] == kvxfer.Result.ERR_CANCELLED, rep
    assert "the peer cancelled the request" in rep["error"]["message"], rep


def test_cancel_before_the_pages_keeps_the_pair_in_order(spawn_peer):
    # The prefill side cancels room 3 before send(): it posts a cancelled
    # zero-token placeholder, so the decode side's room 3 fails and room 4,
    # sent normally, is matched with room 4 and arrives exactly.
    pages = [0, 1, 2]
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="connector_cancel_first", uid=uid, room=3, seed=6, pages=pages,
                      pool=POOL)
    pool = kvdata.Pool(**POOL)
    with connector.KVManager(pool.args(), "decode", uid, rank=0, peer=1, timeout_ms=10000,
                             bind_address="127.0.0.1") as mgr:
        first = connector.KVReceiver(mgr, bootstrap_room=3)
        first.init([5, 6, 7])
        assert poll_until_final(first)[-1] == KVPoll.Failed
        with pytest.raises(kvxfer.KvxferError):
            first.failure_exception()
        second = connector.KVReceiver(mgr, bootstrap_room=4)
        second.init([8, 9, 10])
        assert poll_until_final(second)[-1] == KVPoll.Success, second.failure_exception()
    rep = peer.result()
    assert rep["first"] == "Failed" and rep["first_error"]["code"] == kvxfer.Result.ERR_CANCELLED
    assert rep["second"] == "Success", rep
    src = kvdata.Pool(**POOL).fill_pages(pages, 6)
    for layer in range(POOL["L"]):
        for kind in (kvxfer.KVKind.KEY, kvxfer.KVKind.VALUE):
            assert pool.rows([8, 9, 10], layer, kind) == src.rows(pages, layer, kind)


def test_kvargs_from_sglang_and_bootstrap_failure():
    args = connector.KVArgs.from_sglang([100, 200, 300, 400], [64] * 4, page_size=2,
                                        kv_heads=1, head_dim=16)
    assert args.k_data_ptrs == [100, 200] and args.v_data_ptrs == [300, 400]
    assert args.page_stride == 64
    d = args.descriptor([3, 1])
    assert d.num_layers == 2 and d.block_size == 2 and d.num_tokens == 4
    with pytest.raises(ValueError):
        connector.KVArgs.from_sglang([1, 2, 3], [64] * 3, 2, 1, 16)
    # A manager whose communicator cannot be built reports Failed.
    mgr = connector.KVManager(args, "prefill", kvxfer.UniqueId(bytes(128)), rank=1, peer=0)
    try:
        mgr.wait_ready(10)
        s = connector.KVSender(mgr, bootstrap_room=5)
        assert s.poll() == KVPoll.Failed
        with pytest.raises(kvxfer.KvxferError) as e:
            s.failure_exception()
        assert "malformed" in e.value.message
    finally:
        mgr.close()


class _FailedRequest:
    """A request that ended in ERROR with `code` (no engine needed)."""

    def __init__(self, code):
        self.code = code
        self.stage = kvxfer.Stage.ERROR

    def test(self):
        raise kvxfer.KvxferError(self.code, "descriptors differ", "mismatch", "kvxfer_test")


class _Mgr:
    peer = 1


@pytest.mark.parametrize("placeholder, want", [(True, kvxfer.Result.ERR_CANCELLED),
                                               (False, kvxfer.Result.ERR_MISMATCH)])
def test_a_placeholder_whose_handshake_beat_its_cancel_still_reports_cancelled(placeholder, want):
    # The zero-token placeholder's descriptor never matches the peer's, so a
    # handshake that runs before the cancel is processed ends it in
    # ERR_MISMATCH; the room was cancelled, and says so.  A real transfer
    # keeps its own error.
    t = connector.KVSender(_Mgr(), bootstrap_room=3)
    t._placeholder = placeholder
    t.request = _FailedRequest(kvxfer.Result.ERR_MISMATCH)
    assert t._request_state(KVPoll.Transferring) == KVPoll.Failed
    with pytest.raises(kvxfer.KvxferError) as e:
        t.failure_exception()
    assert e.value.code == want
    assert "descriptors differ" in str(e.value)
