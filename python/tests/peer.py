"""The other rank of the two-process tests: run as
    python peer.py '<json spec>'
and prints one line "RESULT <json>" before it exits.  Roles:
  send       join as rank 1, fill a HostKV from `seed`, kvxfer_send it to rank 0
  idle       join as rank 1, post nothing, exit when stdin closes or gets a line
  init       join as rank 1 and report how kvxfer_comm_init ended
  connector  rank 1 through kvxfer.connector.KVSender (pages of a pool)
  send_blocks  join as rank 1, put a HostKV from `seed` at shuffled block ids of a
             registered FlashPool (heads [send_h0, send_h0 + heads) of pool_heads),
             kvxfer_send_blocks it; with `stream`, post first, then write and mark
             layers 0 .. L-2, print MARKED, and write and mark the last layer only
             once stdin gets a line
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvxfer  # noqa: E402
from kvxfer import connector  # noqa: E402
from kvxfer.core import Communicator, UniqueId  # noqa: E402

import kvdata  # noqa: E402


def err_dict(e):
    return {"code": int(e.code), "name": e.name, "message": e.message}


def shape(spec, bs_key="block_size"):
    return kvdata.HostKV(spec["L"], spec["heads"], spec["hd"], spec["T"], spec[bs_key],
                         spec.get("dtype", 0), spec.get("pad", 0))


def role_send(spec, uid):
    with Communicator(uid, 1, 2, timeout_ms=spec.get("timeout_ms", 20000),
                      bind_address="127.0.0.1", rate_limit=spec.get("rate_limit")) as comm:
        kv = shape(spec).fill(spec["seed"])
        codec = kvxfer.CodecConfig(**spec.get("codec", {}))
        req = comm.send(0, kv.descriptor(), codec, tag=spec.get("tag", 0),
                        mode=spec.get("mode", 0), page_tokens=spec.get("page_tokens", 0))
        out = {}
        try:
            req.wait(timeout=60)
            out["ok"] = True
        except kvxfer.KvxferError as e:
            out["error"] = err_dict(e)
        i = req.info()
        out["info"] = {"anchor_wire_bytes": i.anchor_wire_bytes,
                       "residual_wire_bytes": i.residual_wire_bytes, "num_pages": i.num_pages,
                       "mode": int(i.mode), "stage": int(i.stage),
                       "timestamps": i.timestamps()}
        if i.codec == kvxfer.Codec.SPECTRUM:
            out["tiers"] = list(req.tiers())
        req.free()
    return out


def role_send_many(spec, uid):
    """`count` sends posted back to back (tags 0..count-1), then waited."""
    with Communicator(uid, 1, 2, timeout_ms=spec.get("timeout_ms", 20000),
                      bind_address="127.0.0.1") as comm:
        kvs = [shape(spec).fill(spec["seed"] + i) for i in range(spec["count"])]
        reqs = [comm.send(0, kv.descriptor(), kvxfer.CodecConfig(**spec.get("codec", {})),
                          tag=i, page_tokens=spec.get("page_tokens", 0))
                for i, kv in enumerate(kvs)]
        bad = []
        for i, r in enumerate(reqs):
            try:
                r.wait(timeout=60)
            except kvxfer.KvxferError as e:
                bad.append((i, str(e)))
        return {"ok": not bad, "bad": bad}


def role_send_by_id(spec, uid):
    """Sends, in the order given, one KV per id of `ids` (seed: seed + id), each
    matched by its request id; then waits for all of them."""
    with Communicator(uid, 1, 2, timeout_ms=spec.get("timeout_ms", 20000),
                      bind_address="127.0.0.1") as comm:
        kvs = {i: shape(spec).fill(spec["seed"] + i) for i in spec["ids"]}
        codec = kvxfer.CodecConfig(**spec.get("codec", {}))
        reqs = {i: comm.send(0, kvs[i].descriptor(), codec, tag=spec.get("tag", 0),
                             request_id=i) for i in spec["ids"]}
        bad = []
        for i, r in reqs.items():
            try:
                r.wait(timeout=60)
            except kvxfer.KvxferError as e:
                bad.append((i, str(e)))
            r.free()
        return {"ok": not bad, "bad": bad}


def role_send_blocks(spec, uid):
    with Communicator(uid, 1, 2, timeout_ms=spec.get("timeout_ms", 20000),
                      bind_address="127.0.0.1") as comm:
        src = shape(spec).fill(spec["seed"])
        h0 = spec.get("send_h0", 0)
        fp = kvdata.FlashPool(spec["L"], spec.get("pool_heads", spec["heads"]), spec["hd"],
                              spec["block_size"], spec["pool_blocks"], spec.get("dtype", 0))
        ids = kvdata.block_ids(spec["pool_blocks"], -(-spec["T"] // spec["block_size"]),
                               spec["seed"])
        stream = spec.get("stream", False)
        if not stream:
            for layer in range(spec["L"]):
                fp.put_layer(src, layer, ids, h0)
        out = {}
        with fp.register() as pool:
            req = comm.send_blocks(0, pool, ids, spec["T"], h0, spec["heads"],
                                   kvxfer.CodecConfig(**spec.get("codec", {})),
                                   tag=spec.get("tag", 0), page_tokens=spec.get("page_tokens", 0),
                                   stream_layers=stream)
            if stream:
                for layer in range(spec["L"] - 1):
                    fp.put_layer(src, layer, ids, h0)
                    req.layer_ready(layer)
                req.layer_ready(0)  # twice: no change
                print("MARKED", flush=True)
                sys.stdin.readline()
                fp.put_layer(src, spec["L"] - 1, ids, h0)
                req.layer_ready(spec["L"] - 1)
            try:
                req.wait(timeout=60)
                out["ok"] = True
            except kvxfer.KvxferError as e:
                out["error"] = err_dict(e)
            i = req.info()
            out["info"] = {"anchor_wire_bytes": i.anchor_wire_bytes,
                           "residual_wire_bytes": i.residual_wire_bytes,
                           "num_pages": i.num_pages, "kv_bytes": i.kv_bytes}
            req.free()
    return out


def role_idle(spec, uid):
    print("JOINING", flush=True)  # imported and about to join: rank 0 may start its clock
    with Communicator(uid, 1, 2, timeout_ms=spec.get("timeout_ms", 20000),
                      bind_address="127.0.0.1"):
        print("READY", flush=True)
        sys.stdin.readline()
    return {"ok": True}


def role_init(spec, uid):
    print("JOINING", flush=True)
    try:
        Communicator(uid, 1, 2, timeout_ms=spec.get("timeout_ms", 3000),
                     bind_address="127.0.0.1").destroy()
        return {"ok": True}
    except kvxfer.KvxferError as e:
        return {"error": err_dict(e)}


def role_connector(spec, uid):
    pool = kvdata.Pool(**spec["pool"])
    pool.fill_pages(spec["pages"], spec["seed"])
    mgr = connector.KVManager(pool.args(), connector.Role.PREFILL, uid, rank=1, peer=0,
                              timeout_ms=spec.get("timeout_ms", 20000),
                              bind_address="127.0.0.1",
                              codec=kvxfer.CodecConfig(**spec.get("codec", {})),
                              page_tokens=spec.get("page_tokens", 0))
    try:
        sender = connector.KVSender(mgr, bootstrap_room=spec["room"])
        seen = []
        sender.init(len(spec["pages"]))
        # Chunked prefill: the pages arrive in two calls.
        half = len(spec["pages"]) // 2
        sent = 0
        import time
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = sender.poll()
            if not seen or seen[-1] != st.name:
                seen.append(st.name)
            if st == connector.KVPoll.WaitingForInput and sent == 0:
                sender.send(spec["pages"][:half])
                sent = 1
            elif sent == 1:
                sender.send(spec["pages"][half:])
                sent = 2
            if st in (connector.KVPoll.Success, connector.KVPoll.Failed):
                break
            time.sleep(0.002)
        out = {"states": seen}
        if sender.poll() == connector.KVPoll.Failed:
            try:
                sender.failure_exception()
            except kvxfer.KvxferError as e:
                out["error"] = err_dict(e)
        return out
    finally:
        mgr.close()


def role_connector_cancel_first(spec, uid):
    """Room `room` is cancelled before its pages are given (nothing to post
    but the placeholder); room `room` + 1 is sent normally."""
    pool = kvdata.Pool(**spec["pool"])
    pool.fill_pages(spec["pages"], spec["seed"])
    mgr = connector.KVManager(pool.args(), connector.Role.PREFILL, uid, rank=1, peer=0,
                              timeout_ms=spec.get("timeout_ms", 20000),
                              bind_address="127.0.0.1",
                              codec=kvxfer.CodecConfig(codec="bf16"))
    import time
    try:
        first = connector.KVSender(mgr, bootstrap_room=spec["room"])
        first.init(len(spec["pages"]))
        first.cancel()  # before send(): nothing real to post
        second = connector.KVSender(mgr, bootstrap_room=spec["room"] + 1)
        second.init(len(spec["pages"]))
        second.send(spec["pages"])
        out = {}
        deadline = time.monotonic() + 60
        for name, t in (("first", first), ("second", second)):
            while t.poll() not in (connector.KVPoll.Success, connector.KVPoll.Failed):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.002)
            out[name] = t.poll().name
            if t.poll() == connector.KVPoll.Failed:
                try:
                    t.failure_exception()
                except kvxfer.KvxferError as e:
                    out[name + "_error"] = err_dict(e)
        return out
    finally:
        mgr.close()


def main():
    spec = json.loads(sys.argv[1])
    uid = UniqueId.from_hex(spec["uid"])
    out = {"send": role_send, "send_many": role_send_many, "idle": role_idle, "init": role_init,
           "connector": role_connector, "send_blocks": role_send_blocks,
           "send_by_id": role_send_by_id,
           "connector_cancel_first": role_connector_cancel_first}[spec["role"]](spec, uid)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
