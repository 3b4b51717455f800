"""kvxfer.vllm_core, the vLLM connector's core, driven in vLLM's call order
without vLLM: this process is the decode instance, vllm_prefill.py (a
subprocess) the prefill; real kvxfer transfers between fake KV caches of
vLLM 0.33's layout, compared byte for byte (docs/VLLM.md)."""

import json
import os
import pickle
import random
import subprocess
import sys
import time
import types

import pytest

import kvxfer
from kvxfer import vllm_core

import vllm_fakes
from conftest import HERE, child_env

LAYERS, BLOCKS, HEADS, BS, HD = 4, 64, 3, 16, 64
PREFILL = os.path.join(HERE, "vllm_prefill.py")


def spec(requests, **kw):
    s = {"layers": LAYERS, "blocks": BLOCKS, "heads": HEADS, "bs": BS, "hd": HD,
         "requests": requests, "extra": {"timeout_ms": 5000}}
    s.update(kw)
    return s


def shuffled_blocks(seed, n):
    ids = list(range(1, BLOCKS))  # block 0 is vLLM's null block
    random.Random(seed).shuffle(ids)
    return ids[:n]


def requests(sizes, seed=0):
    out, free = [], shuffled_blocks(seed, BLOCKS - 1)
    for i, tokens in enumerate(sizes):
        nb = (tokens + BS - 1) // BS
        out.append({"id": "p-%d" % i, "tokens": tokens, "seed": 100 + i, "blocks": free[:nb]})
        free = free[nb:]
    return out


class Prefill:
    def __init__(self, s):
        self.proc = subprocess.Popen([sys.executable, PREFILL, json.dumps(s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=child_env())

    def line(self, tag, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        raise AssertionError("prefill gave no %s (exit %s): %s" %
                             (tag, self.proc.poll(), self.proc.stderr.read()))

    def end(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        self.proc.communicate(timeout=30)
        return self.proc.returncode


@pytest.fixture
def decode():
    kv = vllm_fakes.caches(LAYERS, BLOCKS, HEADS, BS, HD)
    worker = vllm_core.WorkerCore({"timeout_ms": 5000})
    worker.register(kv)
    yield kv, worker, vllm_core.SchedulerCore(BS)
    worker.close()


def load(sched, worker, params, local_blocks, wait_s=60):
    """Scheduler then worker steps until every request is finished_recving:
    (received, failed) request ids."""
    for i, (rid, p) in enumerate(params.items()):
        n = p["remote_num_tokens"]
        assert sched.matched_tokens(p, 0) == (n, True)
        sched.after_alloc("d-" + rid, p, local_blocks[rid], n)
        assert sched.matched_tokens(p, 0) == (0, False)  # loaded once
    worker.start(pickle.loads(pickle.dumps(sched.build_meta())))
    got, failed, deadline = set(), set(), time.monotonic() + wait_s
    while len(got) < len(params) and time.monotonic() < deadline:
        s, r, f = worker.finished()
        assert not s
        sched.finished_recving(r)
        got |= r
        failed |= f
        time.sleep(0.005)
    return got, failed


def expected_rows(r):
    kv = vllm_fakes.caches(LAYERS, BLOCKS, HEADS, BS, HD)
    blocks = list(range(len(r["blocks"])))
    vllm_fakes.fill(kv, blocks, r["tokens"], r["seed"])
    return vllm_fakes.rows(kv, blocks, r["tokens"])


def test_a_decode_loads_every_request_of_a_prefill_exactly(decode):
    kv, worker, sched = decode
    reqs = requests([1, 15, 16, 17, 100, 250, 64, 33])
    prefill = Prefill(spec(reqs))
    try:
        params = prefill.line("PARAMS")
        assert set(params) == {r["id"] for r in reqs}
        for r in reqs:
            p = params[r["id"]]
            assert p["do_remote_prefill"] and not p["do_remote_decode"]
            assert p["remote_request_id"] == r["id"] and p["remote_num_tokens"] == r["tokens"]
        free = shuffled_blocks(7, BLOCKS - 1)
        local = {}
        for r in reqs:
            nb = (r["tokens"] + BS - 1) // BS
            local[r["id"]], free = free[:nb], free[nb:]
        got, failed = load(sched, worker, params, local)
        assert got == {"d-" + r["id"] for r in reqs} and not failed
        assert worker.load_errors() == set()
        for r in reqs:
            assert vllm_fakes.rows(kv, local[r["id"]], r["tokens"]) == expected_rows(r), r["id"]
        assert sorted(prefill.line("RESULT")["sent"]) == sorted(r["id"] for r in reqs)
    finally:
        assert prefill.end() == 0


def test_an_aborted_load_tells_the_prefill_and_is_not_a_load_error(decode):
    kv, worker, sched = decode
    reqs = requests([200])
    prefill = Prefill(spec(reqs))
    try:
        params = prefill.line("PARAMS")
        p = params["p-0"]
        sched.after_alloc("d-p-0", p, shuffled_blocks(3, 13), p["remote_num_tokens"])
        # vLLM aborts the request before the workers saw its load.
        assert sched.request_finished("d-p-0", p, [], 0, False) == (False, None)
        meta = sched.build_meta()
        assert [r.req_id for r in meta.recvs] == ["d-p-0"] and meta.cancels == ["d-p-0"]
        worker.start(meta)
        got, deadline = set(), time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            s, got, f = worker.finished()
            assert not f  # an abort is not a failure
        assert got == {"d-p-0"}
        assert worker.load_errors() == set()
        # The prefill heard of it: its send ended, well before its claim timeout.
        assert prefill.line("RESULT")["sent"] == ["p-0"]
    finally:
        assert prefill.end() == 0


def test_a_killed_prefill_fails_its_loads_with_their_blocks(decode):
    kv, worker, sched = decode
    reqs = requests([40, 90])
    prefill = Prefill(spec(reqs))
    params = prefill.line("PARAMS")
    prefill.proc.kill()
    prefill.proc.communicate(timeout=30)
    local = {"p-0": [5, 6, 7], "p-1": [8, 9, 10, 11, 12, 13]}
    got, failed = load(sched, worker, params, local, wait_s=30)
    assert got == failed == {"d-p-0", "d-p-1"}
    assert worker.load_errors() == set(local["p-0"] + local["p-1"])
    assert worker.load_errors() == set()  # reported once


def test_a_prefill_frees_blocks_no_decode_asks_for_after_its_claim_timeout():
    reqs = requests([30])
    t0 = time.monotonic()
    prefill = Prefill(spec(reqs, extra={"claim_timeout_ms": 300}, wait_s=20))
    try:
        prefill.line("PARAMS")
        assert prefill.line("RESULT")["sent"] == ["p-0"]
        assert time.monotonic() - t0 < 15
    finally:
        assert prefill.end() == 0


def test_requests_without_kvxfer_params_are_left_to_vllm():
    sched = vllm_core.SchedulerCore(BS)
    assert sched.matched_tokens(None, 0) == (0, False)
    assert sched.matched_tokens({"do_remote_prefill": True}, 0) == (0, False)  # another connector's
    p = {"do_remote_prefill": True, "remote_endpoints": ["00"], "remote_request_id": "x",
         "remote_num_tokens": 40}
    assert sched.matched_tokens(p, 16) == (0, False)  # a local prefix hit: computed locally
    # A prefill with no worker address yet, or an aborted one, keeps nothing.
    assert sched.request_finished("p", {"do_remote_decode": True}, [1, 2], 20, True) == (False,
                                                                                           None)
    with pytest.raises(ValueError, match="TP ranks 0..n-1"):
        sched.set_endpoints({0: b"\x01", 2: b"\x02"})  # context parallelism's offset ranks
    sched.set_endpoints({0: b"\x01\x02"})
    assert sched.request_finished("p", {"do_remote_decode": True}, [1, 2], 20, False) == (False,
                                                                                            None)
    keep, params = sched.request_finished("p", {"do_remote_decode": True}, [1, 2, 3], 20, True)
    assert keep and params["remote_endpoints"] == ["0102"]
    assert "remote_total_kv_heads" not in params  # not said: the decode assumes its own
    meta = sched.build_meta()
    assert [(s.req_id, s.block_ids, s.num_tokens) for s in meta.sends] == [("p", [1, 2], 20)]
    assert sched.build_meta().sends == []


_DROP = object()


@pytest.mark.parametrize("change, why, released", [
    ({"remote_num_tokens": _DROP}, "remote_num_tokens is None, not an integer", True),
    ({"remote_num_tokens": "abc"}, "remote_num_tokens is 'abc', not an integer", True),
    ({"remote_num_tokens": True}, "remote_num_tokens is True, not an integer", True),
    ({"remote_num_tokens": 0}, "remote_num_tokens 0 is outside [1, 64]", True),
    ({"remote_num_tokens": -5}, "remote_num_tokens -5 is outside [1, 64]", True),
    ({"remote_num_tokens": 10 ** 6}, "remote_num_tokens 1000000 is outside [1, 64]", True),
    ({"remote_total_kv_heads": "x"}, "remote_total_kv_heads is 'x', not an integer", True),
    ({"remote_total_kv_heads": 10 ** 8}, "remote_total_kv_heads 100000000 is outside [0, 1024]",
     True),
    ({"remote_request_id": _DROP}, "remote_request_id is None, not a request id", False),
    ({"remote_request_id": 7}, "remote_request_id is 7, not a request id", False),
    ({"remote_endpoints": 5}, "remote_endpoints is not a list of 1 to 256 address blobs", False),
    ({"remote_endpoints": ["01"] * 257}, "remote_endpoints is not a list of 1 to 256", False),
    ({"remote_endpoints": [5]}, "remote_endpoints[0] is int, not hex digits", False),
    ({"remote_endpoints": ["01", "zz"]}, "remote_endpoints[1] is not hex digits", False),
])
def test_kv_transfer_params_a_decode_cannot_use_are_computed_locally(change, why, released,
                                                                      caplog):
    # They come from the client (vLLM's server passes them through): each
    # one here used to raise out of vLLM's Scheduler.schedule(), killing the
    # engine.  The request is computed locally, and the prefill released
    # when the params still name it.
    good = {"do_remote_prefill": True, "remote_endpoints": ["0102"], "remote_request_id": "x",
            "remote_num_tokens": 40}
    sched = vllm_core.SchedulerCore(BS)
    assert sched.matched_tokens(dict(good), 0, 64) == (40, True)
    p = {k: v for k, v in dict(good, **change).items() if v is not _DROP}
    with caplog.at_level("WARNING", logger="kvxfer.vllm"):
        assert sched.matched_tokens(p, 0, 64) == (0, False)
    assert why in caplog.text and "computing the request locally" in caplog.text
    assert p["do_remote_prefill"] is False
    sched.after_alloc("d", p, [1, 2, 3], 0)
    assert sched.request_finished("d", p, [1, 2, 3], 0, False) == (False, None)
    meta = sched.build_meta()
    assert meta.recvs == [] and meta.sends == [] and meta.cancels == []
    assert [(r.remote_request_id, r.remote_endpoints) for r in meta.releases] == \
        ([("x", ["0102"])] if released else [])
    # Aborted before vLLM asked for its tokens: the same release, no raise.
    aborted = vllm_core.SchedulerCore(BS)
    p = {k: v for k, v in dict(good, **change).items() if v is not _DROP}
    assert aborted.request_finished("d", p, [], 0, False) == (False, None)
    assert [(r.remote_request_id, r.remote_endpoints) for r in aborted.build_meta().releases] == \
        ([("x", ["0102"])] if released else [])


def test_extra_config_values_out_of_range_fail_at_construction():
    for key, value in (("claim_timeout_ms", -5), ("claim_timeout_ms", 0),
                       ("claim_timeout_ms", 10 ** 13), ("max_loads", 0), ("max_loads", -3),
                       ("page_tokens", -16), ("page_tokens", 10 ** 9), ("timeout_ms", "5"),
                       ("timeout_ms", -1), ("port", 70000), ("max_loads", 2.5)):
        with pytest.raises(ValueError, match="kv_connector_extra_config %s %r: an integer in" %
                           (key, value)):
            vllm_core.WorkerCore({key: value})
    # The strings: a ValueError naming the key, not KvxferError or AttributeError.
    for extra, words in (({"secret": "ab" * 31}, "secret: 64 hex digits, not 62"),
                         ({"secret": "zz" * 32}, "secret is not hex digits"),
                         ({"bind_address": 5}, "bind_address 5: a string"),
                         ({"rate_limit": 5}, "rate_limit 5: a string"),
                         ({"rate_limit": "fast"}, "rate_limit 'fast': .*'fast'"),
                         ({"bind_address": "no-such-host.invalid"},
                          "bind_address 'no-such-host.invalid': .*no-such-host")):
        with pytest.raises(ValueError, match=words):
            vllm_core.WorkerCore(extra)


def test_a_second_save_of_a_request_id_still_sending_leaves_the_first_alone():
    """vLLM's request ids are unique; a second live request of one id must
    not report the first's blocks free while its sends still read them."""
    kv_p, kv_d = (vllm_fakes.caches(2, 16, 2, BS, 8) for _ in range(2))
    pre, dec = vllm_core.WorkerCore({}), vllm_core.WorkerCore({})
    try:
        pre.register(kv_p)
        dec.register(kv_d)
        vllm_fakes.fill(kv_p, [1, 2, 3], 40, 1)
        want = vllm_fakes.rows(kv_p, [1, 2, 3], 40)
        pre.start(vllm_core.Metadata(sends=[vllm_core.SendSpec("req", [1, 2, 3], 40)]))
        pre.start(vllm_core.Metadata(sends=[vllm_core.SendSpec("req", [10, 11, 12], 40)]))
        assert pre.finished()[0] == set()  # the first still waits for its decode
        dec.start(vllm_core.Metadata(recvs=[
            vllm_core.RecvSpec("d", "req", [pre.address.hex()], [5, 6, 7], 40)]))
        sent, got, failed = poll(dec, {"d"}, 1)
        assert got == {"d"} and not failed
        assert vllm_fakes.rows(kv_d, [5, 6, 7], 40) == want
        assert "req" in poll(pre, {"req"}, 0)[0]
    finally:
        dec.close()
        pre.close()


def test_unusable_kv_caches_fail_at_registration():
    worker = vllm_core.WorkerCore({})
    try:
        bad_last = vllm_fakes.caches(2, 4, 2, 16, 8)
        bad_last["model.layers.0.self_attn.attn"].shape = (4, 2, 16, 15)
        with pytest.raises(ValueError, match="2 \\* head_size"):
            worker.register(bad_last)
        mixed = vllm_fakes.caches(2, 4, 2, 16, 8)
        mixed["model.layers.1.self_attn.attn"] = vllm_fakes.FakeTensor(8, 2, 16, 8)
        with pytest.raises(ValueError, match="differ from layer"):
            worker.register(mixed)
        fp8 = vllm_fakes.caches(1, 4, 2, 16, 8)
        fp8["model.layers.0.self_attn.attn"].dtype = "torch.float8_e4m3fn"
        with pytest.raises(ValueError, match="dtype float8_e4m3fn"):
            worker.register(fp8)
        with pytest.raises(ValueError, match="no layer number"):
            worker.register({"lm_head": vllm_fakes.FakeTensor(4, 2, 16, 8)})
        with pytest.raises(ValueError, match="codec"):
            vllm_core.WorkerCore({"codec": "int4"})
        # TP rank 1 of 2 of a 2-head model holds 1 head, not 2.
        half = vllm_core.WorkerCore({}, tp_rank=1, tp_size=2, total_kv_heads=2)
        try:
            with pytest.raises(ValueError, match="holds 2 KV heads; TP rank 1 of 2 of a model "
                               "with 2 holds 1"):
                half.register(vllm_fakes.caches(1, 4, 2, 16, 8))
        finally:
            half.close()
    finally:
        worker.close()


def test_kv_heads_shard_over_tp_ranks_as_vllm_shards_them():
    of = vllm_core.TpHeads.of
    # Partitioned: rank r holds heads [r * n, (r + 1) * n).
    assert [of(8, 4, r) for r in range(4)] == [vllm_core.TpHeads(2 * r, 2, 0, 1) for r in range(4)]
    assert of(3, 1, 0) == vllm_core.TpHeads(0, 3, 0, 1)
    # Replicated (fewer heads than ranks): rank r holds head r // 4 as replica r % 4.
    assert [(h.first, h.count, h.replica, h.replicas) for h in (of(2, 8, r) for r in range(8))] == \
        [(r // 4, 1, r % 4, 4) for r in range(8)]
    for total, tp in ((3, 2), (2, 3), (0, 1), (2, 0)):
        with pytest.raises(ValueError):
            of(total, tp, 0)
    with pytest.raises(ValueError):
        of(4, 2, 2)  # no rank 2 in TP 2


def test_request_ids_are_stable_and_differ_per_head():
    a = vllm_core.request_id64("cmpl-1-abcdefgh", 0)
    assert a == vllm_core.request_id64("cmpl-1-abcdefgh", 0)
    assert a != vllm_core.request_id64("cmpl-1-abcdefgh", 1)
    # Replica ids do not collide with another request's head ("a/1/r2").
    assert vllm_core.request_id64("a", 1, 2) != vllm_core.request_id64("a/1", 2)
    assert vllm_core.request_id64("a", 1, 0) == vllm_core.request_id64("a", 1)
    assert 0 <= a < 2 ** 64
    assert kvxfer.ANY_PEER == -1


def poll(worker, want, table, timeout=20):
    """Polls worker.finished() until `want` ids are in its `table`-th set."""
    got, deadline = set(), time.monotonic() + timeout
    out = [set(), set(), set()]
    while not want <= got and time.monotonic() < deadline:
        for i, s in enumerate(worker.finished()):
            out[i] |= s
        got = out[table]
        time.sleep(0.005)
    return out


def test_sends_and_loads_that_cannot_be_posted_end_instead_of_leaking():
    kv_p, kv_d = (vllm_fakes.caches(2, 16, 2, BS, 8) for _ in range(2))
    pre = vllm_core.WorkerCore({"claim_timeout_ms": 400})
    dec = vllm_core.WorkerCore({"claim_timeout_ms": 400}, tp_rank=0, tp_size=1)
    try:
        pre.register(kv_p)
        dec.register(kv_d)
        # A send kvxfer refuses (a block id outside the pool): reported sent,
        # so vLLM frees the request's blocks.
        pre.start(vllm_core.Metadata(sends=[vllm_core.SendSpec("bad", [10 ** 6], 16)]))
        assert "bad" in poll(pre, {"bad"}, 0)[0]
        ep = [pre.address.hex()]
        # A load from a prefill whose TP cannot shard this model's 2 KV
        # heads, or whose model has other heads, fails at the call, saying so.
        dec.start(vllm_core.Metadata(recvs=[vllm_core.RecvSpec("tp", "x", ep * 3, [1], 16)]))
        assert dec._recving["tp"].error == "TP size 3 is not a multiple of 2 KV heads"
        sent, got, failed = poll(dec, {"tp"}, 1)
        assert got == failed == {"tp"} and dec.load_errors() == {1}
        dec.start(vllm_core.Metadata(recvs=[vllm_core.RecvSpec("kvh", "x", ep, [1], 16, 4)]))
        assert dec._recving["kvh"].error == "the prefill's model has 4 KV heads and this decode's 2"
        sent, got, failed = poll(dec, {"kvh"}, 1)
        assert got == failed == {"kvh"} and dec.load_errors() == {1}
        # A load whose send never comes fails at claim_timeout_ms.
        t0 = time.monotonic()
        dec.start(vllm_core.Metadata(recvs=[vllm_core.RecvSpec("late", "y", ep, [2], 16)]))
        sent, got, failed = poll(dec, {"late"}, 1)
        assert got == failed == {"late"} and dec.load_errors() == {2}
        assert 0.4 <= time.monotonic() - t0 < 5
    finally:
        dec.close()
        pre.close()


def test_an_aborted_load_still_queued_behind_max_loads_tells_the_prefill():
    kv_p, kv_d = (vllm_fakes.caches(2, 16, 2, BS, 8) for _ in range(2))
    pre = vllm_core.WorkerCore({"rate_limit": "20mbit"})  # the first load takes ~0.2 s
    dec = vllm_core.WorkerCore({"max_loads": 2, "rate_limit": "20mbit"})  # one load at a time
    try:
        pre.register(kv_p)
        dec.register(kv_d)
        sends = [vllm_core.SendSpec("a", [1, 2, 3, 4], 64), vllm_core.SendSpec("b", [5], 16)]
        pre.start(vllm_core.Metadata(sends=sends))
        ep = [pre.address.hex()]
        loads = [vllm_core.RecvSpec("d-a", "a", ep, [1, 2, 3, 4], 64),
                 vllm_core.RecvSpec("d-b", "b", ep, [5], 16)]
        dec.start(vllm_core.Metadata(recvs=loads))
        assert len(dec._waiting) == 1  # d-b waits for d-a's slot
        t0 = time.monotonic()
        dec.start(vllm_core.Metadata(cancels=["d-b"]))
        # The prefill's send of b ends now (the decode's cancel), long
        # before its claim timeout of 480 s.
        assert "b" in poll(pre, {"b"}, 0)[0]
        assert time.monotonic() - t0 < 5
        out = poll(dec, {"d-a", "d-b"}, 1)
        assert out[1] == {"d-a", "d-b"} and not out[2]  # an abort is not a failure
    finally:
        dec.close()
        pre.close()


def test_a_load_that_expires_still_queued_behind_max_loads_fails_alone():
    kv_p, kv_d = (vllm_fakes.caches(2, 16, 2, BS, 8) for _ in range(2))
    pre = vllm_core.WorkerCore({})  # registered, and never sends
    dec = vllm_core.WorkerCore({"max_loads": 2, "claim_timeout_ms": 300})  # one load at a time
    try:
        pre.register(kv_p)
        dec.register(kv_d)
        ep = [pre.address.hex()]
        dec.start(vllm_core.Metadata(recvs=[vllm_core.RecvSpec("a", "a", ep, [1], 16),
                                            vllm_core.RecvSpec("b", "b", ep, [2], 16)]))
        assert [r.req_id for r in dec._waiting] == ["b"]
        # Both outlive the claim timeout; b was never posted.  finished()
        # used to raise KeyError('b') out of vLLM's get_finished.
        sent, got, failed = poll(dec, {"a", "b"}, 1)
        assert got == failed == {"a", "b"} and dec.load_errors() == {1, 2}
        assert not dec._waiting and not dec._recving
        assert dec.finished() == (set(), set(), set())
    finally:
        dec.close()
        pre.close()


def test_a_load_stops_connecting_once_one_prefill_rank_does_not_answer():
    dec = vllm_core.WorkerCore({})
    try:
        dec.register(vllm_fakes.caches(2, 16, 2, BS, 8))
        tried = []

        def unreachable(address):
            tried.append(address)
            raise kvxfer.KvxferError(kvxfer.Result.ERR_TIMEOUT, "no answer")

        dec.ep.connect = unreachable
        # Two heads from two prefill ranks, and six more ranks to release:
        # one connect is tried, not one per address (each would block the
        # model runner for timeout_ms).
        eps = ["%02x" % i for i in range(1, 9)]
        for heads in (2, 8):  # this decode's model, and another one (releases every rank)
            tried.clear()
            dec.start(vllm_core.Metadata(recvs=[vllm_core.RecvSpec("d%d" % heads, "p",
                                                                   eps[:2] if heads == 2 else eps,
                                                                   [1], 16, heads)]))
            assert len(tried) == 1, (heads, tried)
        # Two loads from other unanswering prefills in one call: one connect
        # in all, not one per load.
        tried.clear()
        dec.start(vllm_core.Metadata(recvs=[vllm_core.RecvSpec("e1", "q", eps[2:4], [2], 16, 2),
                                            vllm_core.RecvSpec("e2", "r", eps[4:6], [3], 16, 2)]))
        assert len(tried) == 1, tried
        out = poll(dec, {"d2", "d8", "e1", "e2"}, 1)
        assert out[1] == out[2] == {"d2", "d8", "e1", "e2"}
    finally:
        dec.close()


def test_layers_become_ready_in_order_while_a_load_runs():
    L = 6
    kv_p, kv_d = (vllm_fakes.caches(L, 40, 2, BS, 32) for _ in range(2))
    pre = vllm_core.WorkerCore({"rate_limit": "100mbit"})  # ~0.25 s for the whole KV
    dec = vllm_core.WorkerCore({"rate_limit": "100mbit"})
    try:
        pre.register(kv_p)
        dec.register(kv_d)
        blocks = list(range(1, 33))
        vllm_fakes.fill(kv_p, blocks, 500, 9)
        pre.start(vllm_core.Metadata(sends=[vllm_core.SendSpec("r", blocks, 500)]))
        dec.start(vllm_core.Metadata(recvs=[
            vllm_core.RecvSpec("d", "r", [pre.address.hex()], blocks, 500)]))
        seen, got = [], set()
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            n = dec.layers_ready("d")
            if not seen or n != seen[-1]:
                seen.append(n)
            _, got, failed = dec.finished()
            assert not failed
            pre.finished()
            time.sleep(0.002)
        assert got == {"d"}  # reported once every head is COMPLETE
        assert seen == sorted(seen) and seen[-1] <= L, seen  # layer after layer
        assert len(seen) > 2, seen  # observed partway
        assert vllm_fakes.rows(kv_d, blocks, 500) == vllm_fakes.rows(kv_p, blocks, 500)
    finally:
        dec.close()
        pre.close()


@pytest.mark.parametrize("how", ["prefix_hit", "abort_before_alloc"])
def test_a_load_that_will_not_happen_releases_the_prefill_at_once(how):
    kv_p, kv_d = (vllm_fakes.caches(2, 16, 2, BS, 8) for _ in range(2))
    pre = vllm_core.WorkerCore({})  # claim_timeout_ms 480 s
    dec = vllm_core.WorkerCore({})
    try:
        pre.register(kv_p)
        dec.register(kv_d)
        blocks = [3, 4, 5]
        vllm_fakes.fill(kv_p, blocks, 40, 5)
        vllm_fakes.fill(kv_d, [0], 1, 6)  # the null block the release names
        null_before = vllm_fakes.rows(kv_d, [0], 1)
        sp = vllm_core.SchedulerCore(BS)
        sp.set_endpoints({0: pre.address})
        _, params = sp.request_finished("p", {"do_remote_decode": True}, blocks, 40, True)
        pre.start(sp.build_meta())
        sd = vllm_core.SchedulerCore(BS)
        if how == "prefix_hit":  # vLLM found 16 tokens in the decode's own cache
            assert sd.matched_tokens(params, 16) == (0, False)
        else:  # aborted while waiting for blocks
            assert sd.request_finished("d", params, [], 0, False) == (False, None)
        assert sd.matched_tokens(params, 0) == (0, False)  # released once, never loaded
        meta = sd.build_meta()
        assert len(meta.releases) == 1 and not meta.recvs
        t0 = time.monotonic()
        dec.start(meta)
        assert poll(pre, {"p"}, 0)[0] == {"p"}
        assert time.monotonic() - t0 < 5  # not the 480 s claim timeout
        assert poll(dec, set(), 1, timeout=0.5) == [set(), set(), set()]  # nothing for vLLM
        assert vllm_fakes.rows(kv_d, [0], 1) == null_before  # nothing written
    finally:
        dec.close()
        pre.close()


def test_a_load_refused_at_the_call_fails_and_releases_the_prefill():
    kv_p, kv_d = (vllm_fakes.caches(2, 16, 2, BS, 8) for _ in range(2))
    pre = vllm_core.WorkerCore({})  # claim_timeout_ms 480 s
    dec = vllm_core.WorkerCore({})
    bare = vllm_core.WorkerCore({})  # never registered
    try:
        pre.register(kv_p)
        dec.register(kv_d)
        with pytest.raises(ValueError, match="no KV cache layers"):
            bare.register({})
        pre.start(vllm_core.Metadata(sends=[vllm_core.SendSpec("p", [1, 2], 32)]))
        ep = [pre.address.hex()]
        t0 = time.monotonic()
        dec.start(vllm_core.Metadata(recvs=[vllm_core.RecvSpec("d", "p", ep, [999], 32)]))
        sent, got, failed = poll(dec, {"d"}, 1)
        assert got == failed == {"d"} and dec.load_errors() == {999}
        assert "p" in poll(pre, {"p"}, 0)[0]  # released, not held for 480 s
        assert time.monotonic() - t0 < 5
        # A worker with no KV caches fails its transfers at once, saying so.
        bare.start(vllm_core.Metadata(sends=[vllm_core.SendSpec("s", [1], 16)],
                                      recvs=[vllm_core.RecvSpec("r", "p", ep, [1], 16)]))
        out = poll(bare, {"r"}, 1)
        assert out[0] == {"s"} and out[1] == out[2] == {"r"}
        # Garbage in kv_transfer_params fails the load, naming the key.
        dec.start(vllm_core.Metadata(recvs=[vllm_core.RecvSpec("g", "p", ["zz"], [3], 16)]))
        assert dec._recving["g"].error.startswith("kv_transfer_params remote_endpoints is not hex")
        sent, got, failed = poll(dec, {"g"}, 1)
        assert got == failed == {"g"}
    finally:
        bare.close()
        dec.close()
        pre.close()


def tp_caches(full, tp, rank):
    """TP rank `rank` of `tp`'s shard (TpHeads) of the KV caches `full`."""
    L = len(full)
    nb, total, bs, c = vllm_fakes.by_layer(full)[0].shape
    h = vllm_core.TpHeads.of(total, tp, rank)
    out = vllm_fakes.caches(L, nb, h.count, bs, c // 2)
    for src, dst in zip(vllm_fakes.by_layer(full), vllm_fakes.by_layer(out)):
        for j in range(h.count):
            for b in range(nb):
                for tok in range(bs):
                    for kind in (0, 1):
                        dst.set_row(b, j, tok, kind, src.row(b, h.first + j, tok, kind))
    return out


def tp_workers(full, extra, ptp, dtp, d_total=None):
    """Prefill TP ptp workers holding their shards of `full`, decode TP dtp
    workers (d_total KV heads, default full's) with empty KV caches, and the
    prefill's scheduler: (pre, dec, the decode ranks' KV caches, scheduler).
    The caller closes the workers."""
    total = vllm_fakes.by_layer(full)[0].shape[1]
    d_total = d_total or total
    pre = [vllm_core.WorkerCore(extra, r, ptp, total) for r in range(ptp)]
    dec = [vllm_core.WorkerCore(extra, r, dtp, d_total) for r in range(dtp)]
    d_kv = []
    for r, w in enumerate(pre):
        w.register(tp_caches(full, ptp, r))
    for r, w in enumerate(dec):
        heads = vllm_core.TpHeads.of(d_total, dtp, r).count
        d_kv.append(vllm_fakes.caches(len(full), BLOCKS, heads, BS, HD))
        w.register(d_kv[-1])
    sp = vllm_core.SchedulerCore(BS, total_kv_heads=total)
    sp.set_endpoints({r: w.address for r, w in enumerate(pre)})
    return pre, dec, d_kv, sp


def transfer_tp(full, codec, ptp, dtp, blocks, tokens, d_blocks):
    """Prefill TP ptp sends a request of `tokens` in `blocks` of `full` to
    decode TP dtp (in-process workers), which loads it into `d_blocks`.
    Returns a namespace: d_kv (the decode ranks' KV caches), got and
    failed (each decode rank's received and failed loads), sent (each
    prefill rank's finished sends), t_sent (seconds until every prefill
    send was final) and errors (each decode rank's error at the call)."""
    total = vllm_fakes.by_layer(full)[0].shape[1]
    pre, dec, d_kv, sp = tp_workers(full, {"codec": codec, "timeout_ms": 5000}, ptp, dtp)
    try:
        _, params = sp.request_finished("p", {"do_remote_decode": True}, blocks, tokens, True)
        assert params["remote_total_kv_heads"] == total
        meta = pickle.loads(pickle.dumps(sp.build_meta()))
        t0 = time.monotonic()
        for w in pre:
            w.start(meta)
        sd = vllm_core.SchedulerCore(BS)
        assert sd.matched_tokens(params, 0) == (tokens, True)
        sd.after_alloc("d", params, d_blocks, tokens)
        meta = pickle.loads(pickle.dumps(sd.build_meta()))
        for w in dec:
            w.start(meta)
        errors = [w._recving["d"].error for w in dec]
        got, failed, sent, t_sent = [set()] * dtp, [set()] * dtp, [set()] * ptp, None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (t_sent is None or not all(got)):
            for r, w in enumerate(dec):
                _, g, f = w.finished()
                got[r], failed[r] = got[r] | g, failed[r] | f
            for r, w in enumerate(pre):
                sent[r] = sent[r] | w.finished()[0]
            if t_sent is None and all(sent):
                t_sent = time.monotonic() - t0
            time.sleep(0.005)
        return types.SimpleNamespace(d_kv=d_kv, got=got, failed=failed, sent=sent,
                                     t_sent=t_sent, errors=errors)
    finally:
        for w in dec + pre:
            w.close()


def head_rows(rows, total, head):
    """The rows of one head out of vllm_fakes.rows() of `total` heads
    (ordered layer, token, head, kind)."""
    return [row for i, row in enumerate(rows) if (i // 2) % total == head]


def merged_rows(d_kv, total, tokens, d_blocks):
    """vllm_fakes.rows() of the model's KV, from the decode ranks' shards
    (replicas: the first)."""
    dtp = len(d_kv)
    per = {}
    for r, kv in enumerate(d_kv):
        h = vllm_core.TpHeads.of(total, dtp, r)
        rows = vllm_fakes.rows(kv, d_blocks, tokens)
        for j in range(h.count):
            per.setdefault(h.first + j, head_rows(rows, h.count, j))
    n = len(per[0]) // 2
    return [per[g][2 * i + kind] for i in range(n) for g in range(total) for kind in (0, 1)]


@pytest.mark.parametrize("codec", ["bf16", "lynx"])
def test_prefill_and_decode_of_different_tp_sizes_load_every_head_exactly(codec):
    L, H, tokens = 2, 4, 40
    full = vllm_fakes.caches(L, BLOCKS, H, BS, HD)
    blocks, d_blocks = [5, 9, 2], [7, 1, 3]
    vllm_fakes.fill(full, blocks, tokens, 11)
    results = {}
    for ptp, dtp in ((1, 1), (2, 1), (1, 2), (4, 2), (2, 4)):
        x = transfer_tp(full, codec, ptp, dtp, blocks, tokens, d_blocks)
        assert x.got == [{"d"}] * dtp and x.failed == [set()] * dtp, (ptp, dtp, x.errors)
        assert x.sent == [{"p"}] * ptp and x.t_sent < 30, (ptp, dtp)
        results[(ptp, dtp)] = merged_rows(x.d_kv, H, tokens, d_blocks)
    want = vllm_fakes.rows(full, blocks, tokens)
    if codec == "bf16":
        assert results[(1, 1)] == want
    else:  # lossy: every pairing must equal the same-TP load, byte for byte
        assert results[(1, 1)] != want
    for k, v in results.items():
        assert v == results[(1, 1)], k


def test_replicated_kv_heads_load_from_their_replicas_and_release_the_rest():
    L, H, tokens = 1, 2, 20
    full = vllm_fakes.caches(L, BLOCKS, H, BS, HD)
    blocks, d_blocks = [4, 6], [8, 2]
    vllm_fakes.fill(full, blocks, tokens, 12)
    want = vllm_fakes.rows(full, blocks, tokens)
    # Prefill TP 4 holds each of the 2 heads twice.  Decode TP 2 loads
    # replica 0 of each head and releases replica 1, so every prefill
    # rank's send is final at once (claim_timeout_ms is 480 s); decode TP 4
    # loads both replicas; decode TP 1 loads replica 0 of both heads.
    for ptp, dtp in ((4, 2), (4, 4), (4, 1)):
        x = transfer_tp(full, "bf16", ptp, dtp, blocks, tokens, d_blocks)
        assert x.got == [{"d"}] * dtp and x.failed == [set()] * dtp, (ptp, dtp, x.errors)
        assert x.sent == [{"p"}] * ptp and x.t_sent < 30, (ptp, dtp)
        for r, kv in enumerate(x.d_kv):
            h = vllm_core.TpHeads.of(H, dtp, r)
            rows = vllm_fakes.rows(kv, d_blocks, tokens)
            for j in range(h.count):
                assert head_rows(rows, h.count, j) == head_rows(want, H, h.first + j), (ptp, dtp)
    # Decode TP 4 from prefill TP 2: replica 1 of a head on the decode has
    # no prefill replica to load; it fails at the call, saying so, and
    # replica 0 loads as usual.
    x = transfer_tp(full, "bf16", 2, 4, blocks, tokens, d_blocks)
    assert x.got == [{"d"}] * 4 and x.failed == [set(), {"d"}, set(), {"d"}]
    assert x.errors[0] == x.errors[2] == ""
    assert x.errors[1] == ("this decode rank holds replica 1 of KV head 0 (TP 4, 2 KV heads) "
                           "and the prefill (TP 2) holds 1: kvxfer sends each replica once")
    assert x.sent == [{"p"}] * 2
    for r in (0, 2):
        assert vllm_fakes.rows(x.d_kv[r], d_blocks, tokens) == head_rows(want, H, r // 2)


def released_tp(full, ptp, dtp, how, d_total=None):
    """Prefill TP ptp finishes request "p"; a decode of TP dtp (d_total KV
    heads, default the prefill's) does not load it (`how`: "prefix_hit",
    vLLM's hit of 16 tokens; "no_external", vLLM allocating with 0 external
    tokens after we reported a hit).  Returns seconds until every prefill
    rank's send was final, or None after 10 s."""
    pre, dec, _, sp = tp_workers(full, {}, ptp, dtp, d_total)  # claim timeout 480 s
    try:
        _, params = sp.request_finished("p", {"do_remote_decode": True}, [1, 2], 20, True)
        meta = sp.build_meta()
        t0 = time.monotonic()
        for w in pre:
            w.start(meta)
        sd = vllm_core.SchedulerCore(BS)
        if how == "prefix_hit":
            assert sd.matched_tokens(params, 16) == (0, False)
        else:
            assert sd.matched_tokens(params, 0) == (20, True)
            sd.after_alloc("d", params, [3, 4], 0)
        assert sd.matched_tokens(params, 0) == (0, False)  # released once, never loaded
        meta = sd.build_meta()
        assert len(meta.releases) == 1 and not meta.recvs
        for w in dec:
            w.start(meta)
        sent = [set()] * ptp
        while time.monotonic() - t0 < 10:
            for r, w in enumerate(pre):
                sent[r] = sent[r] | w.finished()[0]
            for w in dec:
                assert w.finished() == (set(), set(), set())  # nothing for vLLM
            if all(sent):
                return time.monotonic() - t0
            time.sleep(0.005)
        return None
    finally:
        for w in dec + pre:
            w.close()


@pytest.mark.parametrize("how", ["prefix_hit", "no_external"])
def test_a_decode_of_another_tp_size_that_will_not_load_releases_every_prefill_rank(how):
    full = vllm_fakes.caches(1, BLOCKS, 4, BS, HD)
    # 4 heads: TP 4 into 2 and 2 into 4; 2 heads: TP 4 (replicated) into 1.
    for ptp, dtp, heads in ((4, 2, 4), (2, 4, 4), (4, 1, 2)):
        kv = full if heads == 4 else vllm_fakes.caches(1, BLOCKS, 2, BS, HD)
        t = released_tp(kv, ptp, dtp, how)
        assert t is not None and t < 5, (ptp, dtp, heads)  # not the 480 s claim timeout
    # A decode whose model has 2 KV heads against the prefill's 4 cannot
    # load; its TP rank 0 releases every head of every prefill rank.
    t = released_tp(full, 4, 2, how, d_total=2)
    assert t is not None and t < 5
