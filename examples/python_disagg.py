#!/usr/bin/env python3
"""Disaggregated prefill -> decode in two Python processes, through kvxfer's
ctypes binding (python/kvxfer; no compiled extension).

The decode process (this one) makes the unique id, so it is rank 0; it starts
the prefill process (rank 1, multiprocessing 'spawn') and hands it the id's
128 bytes.  Prefill fills a paged KV cache held in host memory (array.array
blocks) and sends it; decode receives it into its own block layout, waits for
ANCHOR_READY (approximate KV in place) and COMPLETE (exact KV), and prints
both sides' stage timestamps.

    python3 examples/python_disagg.py      # uses build/src/libkvxfer.so if there,
                                           # else $KVXFER_LIBRARY or the loader path
    ... --codec bf16            # lossless passthrough: bytes must match
    ... --rate-limit 200mbit    # slow link: ANCHOR_READY well before COMPLETE

Everything binds to 127.0.0.1.
"""

import argparse
import array
import multiprocessing as mp
import os
import random
import struct
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "python"))
if "KVXFER_LIBRARY" not in os.environ and os.path.exists(
        os.path.join(_REPO, "build", "src", "libkvxfer.so")):
    os.environ["KVXFER_LIBRARY"] = os.path.join(_REPO, "build", "src", "libkvxfer.so")
os.environ.setdefault("KVXFER_BOOTSTRAP_ADDR", "127.0.0.1")
os.environ.setdefault("KVXFER_BIND_ADDR", "127.0.0.1")

import kvxfer  # noqa: E402


def bf16_block(rng, n):
    """n bf16 values (truncated fp32 normals) as an array('H')."""
    raw = struct.pack("<%df" % n, *(rng.gauss(0.0, 1.0) for _ in range(n)))
    return array.array("H", struct.unpack("<%dH" % (2 * n), raw)[1::2])


def bf16_to_float(h):
    return struct.unpack("<f", struct.pack("<I", h << 16))[0]


def make_kv(a, block_size, fill_seed=None):
    """Per layer, K and V block tables of array('H') blocks (bf16)."""
    H = a.kv_heads * a.head_dim
    nblocks = -(-a.tokens // block_size)
    rng = random.Random(fill_seed)
    tables = []
    for _ in range(2):  # K, V
        layers = []
        for _ in range(a.layers):
            if fill_seed is None:
                layers.append([array.array("H", bytes(2 * block_size * H))
                               for _ in range(nblocks)])
            else:
                layers.append([bf16_block(rng, block_size * H) for _ in range(nblocks)])
        tables.append(layers)
    desc = kvxfer.KVDescriptor(tables[0], tables[1], num_layers=a.layers,
                               kv_heads=a.kv_heads, head_dim=a.head_dim,
                               block_size=block_size, num_tokens=a.tokens,
                               dtype=kvxfer.Dtype.BF16)
    return tables, desc


def tokens_of(tables, a, block_size):
    """[kind][layer] -> flat list of the T*H bf16 codes, in token order."""
    H = a.kv_heads * a.head_dim
    out = []
    for layers in tables:
        per = []
        for blocks in layers:
            flat = array.array("H")
            for b in blocks:
                flat.extend(b)
            per.append(flat[:a.tokens * H])
        out.append(per)
    return out


def prefill(uid_bytes, a, conn):
    """Rank 1: fill the KV and send it."""
    try:
        uid = kvxfer.UniqueId.from_bytes(uid_bytes)
        with kvxfer.Communicator(uid, rank=1, nranks=2, timeout_ms=a.timeout_ms,
                                 rate_limit=a.rate_limit) as comm:
            tables, desc = make_kv(a, a.send_block_size, fill_seed=a.seed)
            req = comm.send(0, desc, kvxfer.CodecConfig(codec=a.codec), tag=a.tag,
                            page_tokens=a.page_tokens)
            req.wait()  # COMPLETE: the receiver confirmed every page
            conn.send(("ok", req.info()))
            req.free()
    except kvxfer.KvxferError as e:
        conn.send(("error", str(e)))


def show(title, info, t0):
    print("%s (%s, %s): %d pages, %d anchor + %d residual wire bytes for %d KV bytes" %
          (title, info.codec.name, info.mode.name, info.num_pages, info.anchor_wire_bytes,
           info.residual_wire_bytes, info.kv_bytes))
    for name, t in info.timestamps().items():
        print("  %-15s %9.3f ms" % (name, (t - t0) / 1e6))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--send-block-size", type=int, default=16)
    p.add_argument("--recv-block-size", type=int, default=32)
    p.add_argument("--page-tokens", type=int, default=128)
    p.add_argument("--codec", default="lynx", choices=["lynx", "int8", "int4", "bf16"])
    p.add_argument("--rate-limit", default=None, help='link emulation, e.g. "200mbit"')
    p.add_argument("--timeout-ms", type=int, default=20000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tag", type=int, default=42)
    a = p.parse_args()

    uid = kvxfer.UniqueId.create()  # this process makes the id: it is rank 0
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=prefill, args=(bytes(uid), a, child_end), daemon=True)
    child.start()
    try:
        with kvxfer.Communicator(uid, rank=0, nranks=2, timeout_ms=a.timeout_ms,
                                 rate_limit=a.rate_limit) as comm:
            tables, desc = make_kv(a, a.recv_block_size)
            req = comm.recv(1, desc, tag=a.tag,
                            on_anchor_ready=lambda r, s, res: print("[callback] anchor ready"))
            req.wait(kvxfer.Stage.ANCHOR_READY)
            print("decode: ANCHOR_READY (approximate KV in place; decoding could start)")
            req.wait(kvxfer.Stage.COMPLETE)
            print("decode: COMPLETE (exact KV in place)")
            recv_info = req.info()
            req.free()
        status, send_info = parent_end.recv()
        if status != "ok":
            raise SystemExit("prefill failed: %s" % send_info)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
    # Both processes run on this host, so their CLOCK_MONOTONIC timestamps
    # share one time line: show both from the moment decode posted its recv.
    t0 = recv_info.t_posted_ns
    print("stage timestamps, ms after decode posted its receive:")
    show("prefill (send, rank 1)", send_info, t0)
    show("decode  (recv, rank 0)", recv_info, t0)

    # Check the values against the sender's (regenerated from the seed).
    src, _ = make_kv(a, a.send_block_size, fill_seed=a.seed)
    want = tokens_of(src, a, a.send_block_size)
    got = tokens_of(tables, a, a.recv_block_size)
    if a.codec == "bf16":
        ok = want == got
        print("bf16 passthrough: received bytes %s sent bytes" % ("==" if ok else "!="))
        return 0 if ok else 1
    err = max(abs(bf16_to_float(x) - bf16_to_float(y))
              for kind in range(2) for layer in range(a.layers)
              for x, y in zip(want[kind][layer], got[kind][layer]))
    print("%s: max |received - sent| = %.4f (values ~ N(0, 1))" % (a.codec, err))
    return 0 if err < (0.5 if a.codec == "int4" else 0.1) else 1


if __name__ == "__main__":
    sys.exit(main())
