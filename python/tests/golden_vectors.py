"""Golden vectors of the page format (docs/FORMAT.md), made by the NumPy
oracle (format_oracle.py), never by the product.

    python3 python/tests/golden_vectors.py --write   # regenerate golden/
    python3 python/tests/golden_vectors.py           # check the oracle reproduces them

golden/manifest.json lists the cases (dtype, codec, keyword arguments of
format_oracle.encode, shape); per case NAME.input holds the source values
(little-endian bf16 bits, binary16 or binary32, T*H row-major), NAME.anchor
and NAME.residual the two sections.  The inputs come from make_input(seed)
below but are stored, so the files do not depend on NumPy's generators.
test_format_oracle.py::test_golden_vectors checks that both the oracle and
the product reproduce every file.
"""

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import format_oracle as O  # noqa: E402

GOLDEN = os.path.join(HERE, "golden")

# name: (dtype, codec, T, H, seed, encode kwargs, input tweak)
CASES = [
    ("lynx_a0_bf16", "bf16", "lynx", 300, 48, 1, dict(), None),
    ("lynx_a0_A3_sinks_fp16", "fp16", "lynx", 200, 40, 2,
     dict(A=3, chunk=64, sink_tokens=4), "outlier_sink"),
    ("lynx_a5_fp32", "fp32", "lynx", 257, 32, 3, dict(alpha=5.0, chunk=16), None),
    ("lynx_a100_A6_bf16", "bf16", "lynx", 300, 32, 4, dict(alpha=100.0, A=6, chunk=128), None),
    ("lynx_auto_fp16", "fp16", "lynx", 160, 32, 5, dict(alpha=-1.0), None),
    ("lynx_token_groups_v_bf16", "bf16", "lynx", 120, 40, 6,
     dict(kind=1, value_groups="token", sink_tokens=2), None),
    ("lynx_meta_fp32_fp32", "fp32", "lynx", 100, 24, 7, dict(A=5), "huge"),
    ("int8_A2_fp16", "fp16", "int8", 190, 32, 8,
     dict(A=2, sink_tokens=3, token_begin=1, layer=5, stream_id=99), "special"),
    ("int4_fp32", "fp32", "int4", 130, 32, 9, dict(chunk=32, kind=1), None),
    ("bf16_fp32", "fp32", "bf16", 100, 32, 10, dict(), None),
    ("int8_raw_nan_bf16", "bf16", "int8", 40, 16, 11, dict(nonfinite="raw"), "nan"),
    ("spectrum_A4_bf16", "bf16", "spectrum", 200, 32, 12, dict(A=4, chunk=32), "tiers"),
]


def make_input(dtype, T, H, seed, tweak):
    """KV-like values: per-channel offsets and scales (seeded PCG64)."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal((T, H)) * rng.uniform(0.05, 4.0, H) +
         rng.uniform(-2, 2, H)).astype(np.float32)
    if tweak == "outlier_sink":
        v[:4] *= 50
    elif tweak == "huge":
        v[10, 3], v[11, 3] = 1e6, -1e6
    elif tweak == "special":
        v[:, 0] = 1.5
        v[:, 1] = np.where(np.arange(T) % 3 == 0, -0.0, 0.0)
        v[:, 2] *= 1e-6
    elif tweak == "nan":
        v[7, 5] = np.nan
    return O.as_dtype(v, dtype)


def tiers_for(T, seed):
    rng = np.random.default_rng(seed + 1000)
    t = rng.choice(4, T, p=[0.2, 0.5, 0.2, 0.1])
    t[0] = 0  # the sink in FP16
    return t


def read_input(path, dtype, T, H):
    raw = open(path, "rb").read()
    if dtype == "bf16":
        return np.frombuffer(raw, dtype="<u2").reshape(T, H).astype(np.uint16)
    if dtype == "fp16":
        return np.frombuffer(raw, dtype="<f2").reshape(T, H).astype(np.float16)
    return np.frombuffer(raw, dtype="<f4").reshape(T, H).astype(np.float32)


def write():
    os.makedirs(GOLDEN, exist_ok=True)
    manifest = []
    for name, dtype, codec, T, H, seed, kw, tweak in CASES:
        x = make_input(dtype, T, H, seed, tweak)
        kw = dict(kw)
        if tweak == "tiers":
            kw["tiers"] = [int(t) for t in tiers_for(T, seed)]
        anchor, residual = O.encode(x, dtype, codec, **kw)
        with open(os.path.join(GOLDEN, name + ".input"), "wb") as f:
            f.write(O.src_bytes(x, dtype))
        with open(os.path.join(GOLDEN, name + ".anchor"), "wb") as f:
            f.write(anchor)
        with open(os.path.join(GOLDEN, name + ".residual"), "wb") as f:
            f.write(residual)
        manifest.append(dict(name=name, dtype=dtype, codec=codec, T=T, H=H, seed=seed,
                             tweak=tweak, kwargs=kw))
    with open(os.path.join(GOLDEN, "manifest.json"), "w") as f:
        json.dump(dict(format_version=O.VERSION, cases=manifest), f, indent=1)
        f.write("\n")


def load():
    """[(name, x, dtype, codec, kwargs, anchor, residual)] of golden/."""
    with open(os.path.join(GOLDEN, "manifest.json")) as f:
        m = json.load(f)
    assert m["format_version"] == O.VERSION, "golden/ is of format %s" % m["format_version"]
    out = []
    for c in m["cases"]:
        base = os.path.join(GOLDEN, c["name"])
        x = read_input(base + ".input", c["dtype"], c["T"], c["H"])
        with open(base + ".anchor", "rb") as f:
            anchor = f.read()
        with open(base + ".residual", "rb") as f:
            residual = f.read()
        out.append((c["name"], x, c["dtype"], c["codec"], c["kwargs"], anchor, residual))
    return out


def check():
    bad = 0
    for name, x, dtype, codec, kw, anchor, residual in load():
        a, r = O.encode(x, dtype, codec, **kw)
        ok = a == anchor and r == residual
        bad += not ok
        print("%-28s %s" % (name, "ok" if ok else "DIFFERS"))
    return bad


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
        print("wrote %s" % GOLDEN)
    sys.exit(1 if check() else 0)
