"""kvxfer.vllm.KvxferConnector in the real vLLM 0.33.0 (label vllm; run by
the venv of scripts/install-vllm.sh): this process is the decode instance,
vllm_harness.py prefill (a subprocess) the prefill; both are a real
Scheduler with the connector loaded by kv_connector_module_path, worker
connectors on CPU KV caches, and everything but the model forward
(docs/VLLM.md, "Tests")."""

import json
import math
import os
import random
import subprocess
import sys
import time

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402

import vllm_harness as H  # noqa: E402
from conftest import HERE, child_env  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

BLOCKS = 8192


class Prefill:
    def __init__(self, extra=None, tp=1):
        spec = {"blocks": BLOCKS, "extra": dict({"timeout_ms": 5000}, **(extra or {})), "tp": tp}
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_harness.py"),
                                      "prefill", json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=child_env())
        self.params, self.aborted, self.free, self.idle = {}, set(), None, False
        self._buf, self._lines = b"", []
        self.wait(lambda: self.ready, 120, "READY")

    ready = False

    def send(self, **cmd):
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def _read(self, timeout):
        """Takes in what the prefill printed within `timeout` s (the pipe's
        bytes, split into lines here: a buffered readline would hide lines
        from select)."""
        import select
        if not self._lines:
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                return
            data = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not data:
                raise AssertionError("the prefill exited (%s)" % self.proc.poll())
            self._buf += data
            *lines, self._buf = self._buf.split(b"\n")
            self._lines += [x.decode() for x in lines]
        while self._lines:
            self._take(self._lines.pop(0))

    def _take(self, line):
        word, _, rest = line.strip().partition(" ")
        if word == "READY":
            self.ready = True
        elif word == "PARAMS":
            rid, _, p = rest.partition(" ")
            self.params[rid] = json.loads(p)
        elif word == "ABORTED":
            self.aborted.add(rest)
        elif word == "FREE":
            free, idle = rest.split()
            self.free, self.idle = int(free), idle == "1"

    def wait(self, cond, timeout, what):
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError("the prefill did not reach: %s" % what)
            self._read(0.05)

    def poll(self):
        self._read(0)

    def close(self):
        if self.proc.poll() is None:
            self.send(op="quit")
        self.proc.communicate(timeout=60)


@pytest.fixture
def prefill():
    p = Prefill()
    yield p
    p.close()


def run_decode(dec, prefill, reqs, policy_check=None, timeout=300):
    """Steps the decode instance (and reads the prefill) until every request
    of `reqs` ({id: tokens}) finished; returns {id: finish reason}."""
    finished, checked = {}, {}

    def on_running(req):
        rid = req.request_id
        if rid in checked or rid not in reqs:
            return
        checked[rid] = torch.equal(dec.read(rid, reqs[rid]), H.request_kv(rid, reqs[rid]))

    deadline = time.monotonic() + timeout
    while len(finished) < len(reqs):
        assert time.monotonic() < deadline, "decode did not finish: %s" % sorted(
            set(reqs) - set(finished))
        for rid, o in dec.step(on_running).items():
            if o.finish_reason is not None:
                finished[rid] = str(o.finish_reason)
        if prefill is not None:
            prefill.poll()
    return finished, checked


def sizes(n, seed):
    """n request sizes from 16 to 4096 tokens, log-uniform, both ends included."""
    rng = random.Random(seed)
    return [16, 4096] + [int(math.exp(rng.uniform(math.log(16), math.log(4096))))
                         for _ in range(n - 2)]


def test_64_concurrent_requests_arrive_exactly_and_no_block_leaks(prefill):
    reqs = {"r%02d" % i: n for i, n in enumerate(sizes(64, 1))}
    prefill.send(op="add", reqs=sorted(reqs.items()))
    prefill.wait(lambda: len(prefill.params) == len(reqs), 300, "64 PARAMS")
    for rid, p in prefill.params.items():
        assert p["do_remote_prefill"] and p["remote_num_tokens"] == reqs[rid], (rid, p)
    dec = H.Instance("kv_both", BLOCKS)
    for rid in sorted(reqs):  # the proxy forwards each request with P's params
        dec.add(rid, reqs[rid], dict(prefill.params[rid]))
    finished, exact = run_decode(dec, prefill, reqs)
    assert set(finished) == set(reqs)
    assert all(why == "length" for why in finished.values()), finished
    assert exact == {rid: True for rid in reqs}
    assert dec.idle(), (dec.sched.requests.keys(), dec.free(), dec.free0)
    prefill.wait(lambda: prefill.idle, 60, "every prefill block freed")
    dec.worker.shutdown()


@pytest.mark.parametrize("codec", ["int8", "lynx"])
def test_int8_and_lynx_arrive_as_the_codecs_own_decode(codec):
    """Their COMPLETE stage is the decode of the exact 8-bit codes: each
    head's rows equal kvxfer's own encode and decode of the prefill's
    (kvdata.expected_decode, through kvxfer_page_encode/decode)."""
    import kvdata
    import kvxfer
    from kvxfer import vllm_core
    prefill = Prefill({"codec": codec})
    try:
        reqs = {"c0": 16, "c1": 300, "c2": 1500}
        prefill.send(op="add", reqs=sorted(reqs.items()))
        prefill.wait(lambda: len(prefill.params) == len(reqs), 120, "PARAMS")
        dec = H.Instance("kv_both", BLOCKS)
        for rid in sorted(reqs):
            dec.add(rid, reqs[rid], dict(prefill.params[rid]))
        got = {}

        def keep(req):
            got[req.request_id] = dec.read(req.request_id, reqs[req.request_id])

        while len(got) < len(reqs):
            dec.step(keep)
            prefill.poll()
        page_tokens = vllm_core.default_page_tokens(H.HEAD, 2)
        for rid, n in reqs.items():
            src, out = H.request_kv(rid, n), got[rid]
            for h in range(H.HEADS):
                one = kvdata.HostKV(H.LAYERS, 1, H.HEAD, n, 64)
                for layer in range(H.LAYERS):
                    for kind, half in ((kvxfer.KVKind.KEY, 0), (kvxfer.KVKind.VALUE, 1)):
                        for t in range(n):
                            row = src[layer, t, h, half * H.HEAD:(half + 1) * H.HEAD]
                            one.set_row(layer, kind, t,
                                        row.contiguous().view(torch.int16).numpy().tobytes())
                want = kvdata.expected_decode(one, kvxfer.CodecConfig(codec), page_tokens, 0)
                for layer in range(H.LAYERS):
                    for kind, half in ((kvxfer.KVKind.KEY, 0), (kvxfer.KVKind.VALUE, 1)):
                        rows = out[layer, :, h, half * H.HEAD:(half + 1) * H.HEAD]
                        assert rows.contiguous().view(torch.int16).numpy().tobytes() == \
                            want.rows(layer, kind), (rid, h, layer, kind)
            assert not torch.equal(out, src)  # lossy: the codec did run
        while not dec.idle():
            dec.step()
            prefill.poll()
        prefill.wait(lambda: prefill.idle, 60, "every prefill block freed")
        dec.worker.shutdown()
    finally:
        prefill.close()


def test_a_decode_abort_cancels_the_load_and_both_sides_free_their_blocks():
    # 50 Mbit/s: the 12.6 MB of this request would take 2 s; the abort comes first.
    slow = {"rate_limit": "50mbit"}
    prefill = Prefill(slow)
    try:
        prefill.send(op="add", reqs=[["a", 4096]])
        prefill.wait(lambda: "a" in prefill.params, 120, "PARAMS a")
        dec = H.Instance("kv_both", BLOCKS, extra=dict(slow, timeout_ms=5000))
        r = dec.add("a", 4096, dict(prefill.params["a"]))
        dec.step()
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        t0 = time.monotonic()
        dec.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        while not dec.idle():
            assert time.monotonic() - t0 < 30, "decode kept blocks"
            dec.step()
            prefill.poll()
        # The prefill was told: its send ended well before the transfer
        # could have, and long before its claim timeout of 480 s.
        prefill.wait(lambda: prefill.idle, 30, "the prefill's blocks freed")
        assert time.monotonic() - t0 < 1.5
        dec.worker.shutdown()
    finally:
        prefill.close()


@pytest.mark.parametrize("ptp,dtp", [(3, 1), (1, 3)])
def test_prefill_and_decode_of_different_tp_sizes_arrive_exactly(ptp, dtp):
    """SmolLM2's 3 KV heads over 3 TP ranks on one side and 1 on the other:
    each decode rank loads each of its heads from the prefill rank holding
    it; vLLM's KVOutputAggregator combines the ranks' results."""
    prefill = Prefill(tp=ptp)
    try:
        reqs = {"t0": 16, "t1": 300, "t2": 1500}
        prefill.send(op="add", reqs=sorted(reqs.items()))
        prefill.wait(lambda: len(prefill.params) == len(reqs), 120, "PARAMS")
        for p in prefill.params.values():
            assert len(p["remote_endpoints"]) == ptp and p["remote_total_kv_heads"] == H.HEADS
        dec = H.Instance("kv_both", BLOCKS, tp=dtp)
        for rid in sorted(reqs):
            dec.add(rid, reqs[rid], dict(prefill.params[rid]))
        finished, exact = run_decode(dec, prefill, reqs)
        assert finished == {rid: "length" for rid in reqs}
        assert exact == {rid: True for rid in reqs}
        assert dec.idle(), (dec.sched.requests.keys(), dec.free(), dec.free0)
        prefill.wait(lambda: prefill.idle, 60, "every prefill block freed")
        dec.shutdown()
    finally:
        prefill.close()


def test_a_decode_prefix_hit_releases_the_prefill_at_once(prefill):
    """The decode computes a request whose prompt it has cached instead of
    loading it; the prefill is told at once (its claim timeout is 480 s)."""
    prefill.send(op="add", reqs=[["x", 300]])
    prefill.wait(lambda: "x" in prefill.params, 120, "PARAMS x")
    dec = H.Instance("kv_both", BLOCKS)
    dec.add("x", 300, dict(prefill.params["x"]))
    finished, exact = run_decode(dec, prefill, {"x": 300})
    assert finished == {"x": "length"} and exact == {"x": True}
    prefill.wait(lambda: prefill.idle, 60, "x's blocks freed")
    # y has x's prompt: the decode finds 288 of its 300 tokens in its cache.
    prefill.send(op="add", reqs=[["y", 300]], prompt_of={"y": "x"})
    prefill.wait(lambda: "y" in prefill.params, 120, "PARAMS y")
    prefill.wait(lambda: not prefill.idle, 10, "y's blocks kept for the decode")
    core = dec.sched.connector._sched  # what vLLM asks the connector
    asked, matched = [], core.matched_tokens
    core.matched_tokens = lambda params, n, *a: asked.append(n) or matched(params, n, *a)
    t0 = time.monotonic()
    dec.add("y", 300, dict(prefill.params["y"]), prompt_of="x")
    finished, _ = run_decode(dec, prefill, {"y": 300})
    assert finished == {"y": "length"}
    assert asked[0] == 288  # the hit: y was computed locally, not loaded
    prefill.wait(lambda: prefill.idle, 10, "y's blocks freed by the release")
    assert time.monotonic() - t0 < 10
    assert dec.idle()
    dec.worker.shutdown()


def test_a_prefill_abort_frees_its_blocks_and_sends_nothing(prefill):
    prefill.send(op="add", reqs=[["b", 8000, 1]])  # aborted after 1 of its 4 steps
    prefill.wait(lambda: "b" in prefill.aborted, 60, "b aborted")
    prefill.wait(lambda: prefill.idle, 60, "b's blocks freed")
    assert "b" not in prefill.params


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_killed_prefill_is_a_load_error_under_either_policy(policy):
    p = Prefill()
    try:
        p.send(op="add", reqs=[["k", 1000]])
        p.wait(lambda: "k" in p.params, 120, "PARAMS k")
    finally:
        p.proc.kill()
        p.proc.communicate(timeout=60)
    dec = H.Instance("kv_both", BLOCKS, policy=policy, extra={"timeout_ms": 3000})
    dec.add("k", 1000, dict(p.params["k"]))
    finished, _ = run_decode(dec, None, {"k": 1000}, timeout=60)
    if policy == "fail":
        assert finished == {"k": "error"}
    else:  # recomputed locally, then it samples its token
        assert finished == {"k": "length"}
    assert dec.idle()
    dec.worker.shutdown()
