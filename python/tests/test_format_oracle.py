"""The product's codec against format_oracle.py, the NumPy oracle written from
docs/FORMAT.md alone: every byte of both sections, and the decodes
(oracle decode of the product's bytes vs the product's decode, bit for bit).

Targeted cases for each kind of page, a random sweep (KVXFER_ORACLE_PAGES
pages, default 400), and the golden vectors (golden/, made by the oracle).
As a script, the sweep alone with a summary line:

    python3 python/tests/test_format_oracle.py --pages 10000 [--seed 1]
"""

import collections
import os
import sys
import time

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("xxhash")

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(HERE), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import kvxfer  # noqa: E402

import format_oracle as O  # noqa: E402

DTYPES = ("bf16", "fp16", "fp32")


# ---------------------------------------------------------------------------
# The product through the binding
# ---------------------------------------------------------------------------
def product_encode(x, dtype, codec="lynx", *, alpha=0.0, chunk=32, A=4, sink_tokens=1,
                   value_groups="channel", nonfinite="error", layer=0, kind=0, token_begin=0,
                   stream_id=0, tiers=None):
    T, H = x.shape
    raw = bytearray(O.src_bytes(x, dtype) or b"\0" * 4)
    lay = kvxfer.PageLayout([raw], block_size=max(T, 1), num_tokens=T, num_channels=H,
                            dtype=dtype)
    pid = kvxfer.PageId(layer, kind, token_begin, stream_id)
    cfg = kvxfer.CodecConfig(codec=codec, alpha=alpha, chunk_tokens=chunk, anchor_bits=A,
                             sink_tokens=sink_tokens, value_groups=value_groups,
                             nonfinite=nonfinite)
    if codec == "spectrum":
        return kvxfer.encode_page_tiered(lay, pid, [int(t) for t in tiers], cfg)
    return kvxfer.encode_page(lay, pid, cfg)


def product_decode(anchor, residual, T, H):
    out = bytearray(max(T * H * 4, 4))
    lay = kvxfer.PageLayout([out], block_size=max(T, 1), num_tokens=T, num_channels=H,
                            dtype="fp32")
    kvxfer.decode_page(lay, anchor, residual or None)
    return np.frombuffer(bytes(out[:T * H * 4]), dtype="<f4").reshape(T, H)


def first_difference(got, want, what):
    """None if equal, else a line naming the first differing byte."""
    if got == want:
        return None
    n = min(len(got), len(want))
    i = next((i for i in range(n) if got[i] != want[i]), n)
    where = O.describe_offset(want, i) if i < len(want) else "past the oracle's end"
    return ("%s: %d bytes (oracle %d), first difference at offset %d (%s): product %s, "
            "oracle %s" % (what, len(got), len(want), i, where,
                           "%02x" % got[i] if i < len(got) else "-",
                           "%02x" % want[i] if i < len(want) else "-"))


def compare(x, dtype, codec="lynx", **kw):
    """(product anchor, residual, problems): byte and decode comparisons."""
    pa, pr = product_encode(x, dtype, codec, **kw)
    oa, orr = O.encode(x, dtype, codec, **kw)
    problems = [p for p in (first_difference(pa, oa, "anchor"),
                            first_difference(pr, orr, "residual")) if p]
    T, H = x.shape
    for res, name in ((None, "anchor-only"), (pr, "full")):
        want = product_decode(pa, res, T, H).view(np.uint32)
        got = O.decode(pa, res).view(np.uint32)
        if not np.array_equal(want, got):
            t, c = np.argwhere(want != got)[0]
            problems.append("%s decode: [%d, %d] product %08x, oracle %08x" %
                            (name, t, c, want[t, c], got[t, c]))
    return pa, pr, problems


as_dtype = O.as_dtype


def kv_like(rng, T, H, dtype, scale=1.0):
    v = (rng.standard_normal((T, H)) * rng.uniform(0.05, 4.0, H) * scale +
         rng.uniform(-2, 2, H)).astype(np.float32)
    return as_dtype(v, dtype)


# ---------------------------------------------------------------------------
# Targeted cases
# ---------------------------------------------------------------------------
def special_values(dtype, T=70, H=12, seed=3):
    """Constant, zero, signed-zero and denormal channels and an outlier sink."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((T, H)).astype(np.float32)
    v[:, 0] = 3.0
    v[:, 1] = 0.0
    v[:, 2] = np.where(rng.random(T) < 0.5, -0.0, 0.0)
    tiny = {"bf16": 1e-39, "fp16": 3e-6, "fp32": 1e-40}[dtype]  # subnormal in dtype
    v[:, 3] = rng.standard_normal(T) * tiny
    v[:, 4] = tiny
    v[0] *= 100.0
    return as_dtype(v, dtype)


CODECS = [
    ("lynx", {}),
    ("lynx", dict(A=2, chunk=16)),
    ("lynx", dict(A=3)),
    ("lynx", dict(A=5, chunk=64)),
    ("lynx", dict(A=6, chunk=128)),
    ("lynx", dict(alpha=5.0)),
    ("lynx", dict(alpha=100.0, A=3)),
    ("lynx", dict(alpha=255.0, A=6, chunk=16)),
    ("lynx", dict(alpha=O.ALPHA_AUTO)),
    ("int8", {}),
    ("int8", dict(A=2, chunk=64)),
    ("int4", dict(chunk=16)),
    ("bf16", {}),
]


def check(x, dtype, codec, **kw):
    pa, pr, problems = compare(x, dtype, codec, **kw)
    assert not problems, "%s %s %s T=%d H=%d:\n  %s" % (dtype, codec, kw, x.shape[0],
                                                        x.shape[1], "\n  ".join(problems))
    return O.parse_header(pa), pa, pr


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec,kw", CODECS, ids=lambda v: str(v))
def test_codecs_with_tails_and_special_channels(dtype, codec, kw):
    rng = np.random.default_rng(11)
    for T, H in ((100, 24), (17, 5), (1, 3)):  # tails: not multiples of the chunk
        h, _, _ = check(kv_like(rng, T, H, dtype), dtype, codec, **kw)
        assert h["T"] == T and h["codec"] == O.CODECS[codec]
    h, pa, _ = check(special_values(dtype), dtype, codec, **kw)
    if codec != "bf16":
        assert h["sink_rows"] == 1
    if kw.get("alpha") == O.ALPHA_AUTO:
        assert h["alpha"] in O.AUTO_CANDIDATES


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_page(dtype):
    x = as_dtype(np.zeros((0, 9)), dtype)
    for codec, kw in CODECS[:1] + CODECS[9:]:
        h, pa, pr = check(x, dtype, codec, **kw)
        assert h["T"] == 0
    # T = 0 still carries the anchor table (4.2)
    assert len(O.encode(x, dtype, "int8")[0]) == 80 + 4 * 16


@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_rows(dtype):
    rng = np.random.default_rng(5)
    x = kv_like(rng, 150, 20, dtype)
    for sink_tokens, token_begin, chunk in ((1, 0, 32), (40, 0, 16), (40, 30, 32), (200, 0, 64),
                                            (40, 40, 32), (0, 0, 32), (1024, 100, 128)):
        for codec, kw in (("lynx", {}), ("lynx", dict(alpha=20.0, A=5)), ("int8", {}),
                          ("int4", {})):
            h, pa, _ = check(x, dtype, codec, sink_tokens=sink_tokens, token_begin=token_begin,
                             chunk=chunk, **kw)
            assert h["sink_rows"] == max(0, min(sink_tokens - token_begin, 150))


def test_fp32_sink_saturates_to_bf16_max():
    x = kv_like(np.random.default_rng(2), 40, 8, "fp32")
    x[0, 3], x[0, 4] = 3.4e38, -3.4e38
    h, pa, _ = check(x, "fp32", "lynx")
    off = len(pa) - 2 * 8
    sink = np.frombuffer(pa[off:], dtype="<u2")
    assert sink[3] == 0x7F7F and sink[4] == 0xFF7F


@pytest.mark.parametrize("dtype", ("bf16", "fp32"))
def test_fp16_overflow_forces_meta_fp32(dtype):
    x = np.asarray(O.to_f32(kv_like(np.random.default_rng(4), 90, 10, dtype), dtype))
    x[50, 6], x[51, 6] = 70000.0, -70000.0  # d = 70000: beyond binary16
    x = as_dtype(x, dtype)
    for codec, kw in CODECS[:1] + [CODECS[5], CODECS[9], CODECS[11]]:
        h, _, _ = check(x, dtype, codec, **kw)
        assert h["flags"] == O.FLAG_META_FP32


def test_fp32_extremes_and_tiny_ranges():
    rng = np.random.default_rng(9)
    x = kv_like(rng, 64, 6, "fp32")
    x[:, 0] = rng.standard_normal(64).astype(np.float32) * np.float32(1e-38)
    x[:, 1] = np.float32(1e-45) * rng.integers(-3, 4, 64)
    x[3, 2], x[4, 2] = 3.3e38, -3.3e38
    for codec, kw in CODECS[:-1]:
        h, _, _ = check(x, "fp32", codec, **kw)
        assert h["flags"] & O.FLAG_META_FP32


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_groups_token_and_auto(dtype):
    rng = np.random.default_rng(6)
    x = kv_like(rng, 77, 40, dtype)
    seen = set()
    for groups in ("token", "auto"):
        for codec, kw in (("lynx", {}), ("lynx", dict(alpha=O.ALPHA_AUTO)), ("int8", dict(A=3)),
                          ("int4", {})):
            for sink in (0, 3):
                h, _, _ = check(x, dtype, codec, kind=1, value_groups=groups, sink_tokens=sink,
                                **kw)
                seen.add(h["flags"] & O.FLAG_TOKEN_GROUPS)
                if groups == "token":
                    assert h["flags"] & O.FLAG_TOKEN_GROUPS
        h, _, _ = check(x, dtype, "lynx", kind=0, value_groups=groups)  # K: never grouped
        assert not h["flags"] & O.FLAG_TOKEN_GROUPS
    # KIVI's case: per-token scales favour TOKEN groups under AUTO
    v = O.to_f32(x, dtype) * np.float32(10) ** rng.uniform(-2, 2, (77, 1)).astype(np.float32)
    h, _, _ = check(as_dtype(v, dtype), dtype, "int8", kind=1, value_groups="auto")
    seen.add(h["flags"] & O.FLAG_TOKEN_GROUPS)
    assert seen == {0, O.FLAG_TOKEN_GROUPS}


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_goes_raw(dtype):
    x = O.to_f32(kv_like(np.random.default_rng(8), 50, 7, dtype), dtype)
    x[20, 3] = np.nan
    x[16, 5] = np.inf  # a row of alpha = auto's sample (t % 16 == 0)
    x[1, 1] = -np.inf  # in a sink row: still RAW
    x = as_dtype(x, dtype)
    for codec, kw in CODECS + [("lynx", dict(kind=1, value_groups="token"))]:
        h, pa, pr = check(x, dtype, codec, nonfinite="raw", sink_tokens=2, **kw)
        assert h["flags"] == O.FLAG_RAW and h["sink_rows"] == 0 and len(pr) == 80
        with pytest.raises(ValueError):
            O.encode(x, dtype, codec, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_spectrum_tiers(dtype):
    rng = np.random.default_rng(10)
    x = kv_like(rng, 150, 16, dtype)
    for A in (2, 4, 6):
        for chunk, tiers in ((32, rng.integers(0, 4, 150)),
                             (16, np.repeat([0, 1, 2, 3, 1], 30)),
                             (64, np.zeros(150, int)),  # all FP16: no metadata in use
                             (128, np.full(150, 3)),    # all DROP
                             (32, rng.integers(1, 3, 150))):
            h, pa, pr = check(x, dtype, "spectrum", A=A, chunk=chunk, tiers=tiers)
            assert h["codec"] == 4 and h["anchor_bits"] == A
    # H not a multiple of 8: the sequential path of the product
    check(kv_like(rng, 45, 5, dtype), dtype, "spectrum", A=3, tiers=rng.integers(0, 4, 45))
    check(kv_like(rng, 0, 5, dtype), dtype, "spectrum", tiers=[])


def test_spectrum_fp16_saturation_meta_fp32_and_raw():
    rng = np.random.default_rng(12)
    x = O.to_f32(kv_like(rng, 64, 8, "fp32"), "fp32")
    x[1, 2], x[2, 3] = 1e6, -70000.0  # FP16 tokens: saturate
    tiers = np.array([0, 0, 0] + [1, 2] * 30 + [3])
    h, pa, pr = check(x, "fp32", "spectrum", tiers=tiers)
    assert h["flags"] == 0
    x[10, 1] = 1e6  # an INT8 token beyond binary16: META_FP32
    h, _, _ = check(x, "fp32", "spectrum", tiers=tiers)
    assert h["flags"] == O.FLAG_META_FP32
    x[63, 0] = np.nan  # a DROP token: never read
    check(x, "fp32", "spectrum", tiers=tiers)
    x[5, 0] = np.inf
    h, _, pr = check(x, "fp32", "spectrum", tiers=tiers, nonfinite="raw")
    assert h["flags"] == O.FLAG_RAW and len(pr) == 80 + 32


_CRASH = """
import sys, numpy as np, kvxfer
x = np.ones((50, 7), np.float32)
x[16, 1] = np.nan
lay = kvxfer.PageLayout([bytearray(x.tobytes())], block_size=50, num_tokens=50,
                        num_channels=7, dtype="fp32")
cfg = kvxfer.CodecConfig(alpha=kvxfer.CodecConfig.ALPHA_AUTO, nonfinite=sys.argv[1])
try:
    kvxfer.encode_page(lay, (0, 0, 0, 0), cfg)
except kvxfer.KvxferError as e:
    print("error", e.code)
"""


@pytest.mark.parametrize("policy", ("raw", "error"))
def test_product_alpha_auto_survives_nonfinite_sample_rows(policy):
    """docs/FORMAT.md 2.6/5: such a page goes RAW (or fails with
    ERR_NONFINITE); the product must not crash."""
    import subprocess
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    p = subprocess.run([sys.executable, "-c", _CRASH, policy], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, "exit %d" % p.returncode
    if policy == "error":
        assert "error %d" % kvxfer.Result.ERR_NONFINITE in p.stdout


def test_fma32_rounds_once():
    """The oracle's RN(a*b + c) against the exact value rounded once: random
    triples over many scales (subnormal results included) and the case where
    binary64 lands on a binary32 midpoint (double rounding would give 1 + 2^-22)."""
    from fractions import Fraction
    rng = np.random.default_rng(15)
    n = 3000
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-70, 40, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-70, 40, n)).astype(np.float32)
    c = (rng.standard_normal(n) * 2.0 ** rng.integers(-149, 70, n)).astype(np.float32)
    c[: n // 3] = -(a[: n // 3].astype(np.float64) * b[: n // 3]).astype(np.float32)  # cancel
    a = np.append(a, np.float32(2.0 ** -12 * (1 + 2.0 ** -23)))
    b = np.append(b, np.float32(2.0 ** -12 * (1 - 2.0 ** -23)))
    c = np.append(c, np.float32(1 + 2.0 ** -23))
    got = O.fma32(a, b, c)
    assert got[-1] == np.float32(1 + 2.0 ** -23)
    for i in range(n + 1):
        want = O.round_exact_to_f32(Fraction(float(a[i])) * Fraction(float(b[i])) +
                                    Fraction(float(c[i])))
        assert got[i].view(np.uint32) == np.float32(want).view(np.uint32), (a[i], b[i], c[i])


def test_alpha_table_is_the_correctly_rounded_g():
    """Appendix A's double arithmetic gives g(k + 1/2) correctly rounded for
    the alphas docs/FORMAT.md 2.2 names."""
    for alpha in O.AUTO_CANDIDATES[1:] + (0.001, 0.5, 3.7, 777.25, 1000.0):
        assert np.array_equal(O.alpha_table(alpha), O.alpha_table_exact(alpha)), alpha


def test_alpha_values_through_the_product():
    rng = np.random.default_rng(13)
    x = kv_like(rng, 64, 16, "fp32")
    for alpha in (0.001, 0.5, 3.7, 777.25, 1000.0):
        for A in (2, 4, 6):
            h, _, _ = check(x, "fp32", "lynx", alpha=alpha, A=A)
            assert h["alpha"] == np.float32(alpha)


def test_header_fields_and_checksum_link():
    x = kv_like(np.random.default_rng(14), 33, 9, "bf16")
    kw = dict(layer=7, kind=1, token_begin=123456789012, stream_id=2 ** 63 + 5)
    h, pa, pr = check(x, "bf16", "int8", A=3, **kw)
    r = O.parse_header(pr)
    assert (h["layer"], h["kind"], h["token_begin"], h["stream_id"]) == (7, 1, 123456789012,
                                                                         2 ** 63 + 5)
    assert r["link"] == h["checksum"] and r["section"] == 2 and h["link"] == 0
    assert O.checksum_ok(pa) and O.checksum_ok(pr)
    bad = bytearray(pa)
    bad[100] ^= 1
    assert not O.checksum_ok(bytes(bad))


# ---------------------------------------------------------------------------
# The random sweep
# ---------------------------------------------------------------------------
def random_case(rng):
    """(x, dtype, codec, kwargs, label) of one random page."""
    dtype = DTYPES[rng.integers(3)]
    r = rng.random()
    if r < 0.30:
        codec, kw = "lynx", {}
    elif r < 0.45:
        codec = "lynx"
        kw = dict(alpha=float(rng.choice([1, 2, 5, 10, 20, 50, 100, 255, 1000,
                                          float(np.float32(rng.uniform(0.01, 1000)))])))
    elif r < 0.50:
        codec, kw = "lynx", dict(alpha=O.ALPHA_AUTO)
    elif r < 0.65:
        codec, kw = "int8", {}
    elif r < 0.75:
        codec, kw = "int4", {}
    elif r < 0.85:
        codec, kw = "bf16", {}
    else:
        codec, kw = "spectrum", {}
    kw["chunk"] = int(rng.choice([16, 32, 64, 128]))
    if codec in ("lynx", "int8", "spectrum"):
        kw["A"] = int(rng.integers(2, 7))
    T = int(rng.choice([0, 1, int(rng.integers(2, 64)), int(rng.integers(64, 400))],
                       p=[0.03, 0.04, 0.33, 0.6]))
    H = int(rng.choice([int(rng.integers(1, 16)), int(rng.integers(16, 96)), 64, 128]))
    kw["kind"] = int(rng.integers(2))
    kw["layer"] = int(rng.integers(0, 100))
    kw["stream_id"] = int(rng.integers(0, 2 ** 63))
    if codec != "spectrum":
        kw["token_begin"] = int(rng.choice([0, 0, int(rng.integers(0, 64)),
                                            int(rng.integers(0, 10 ** 6))]))
        kw["sink_tokens"] = int(rng.choice([0, 1, 1, int(rng.integers(0, 80))]))
    if codec in ("lynx", "int8", "int4") and kw["kind"] == 1:
        kw["value_groups"] = str(rng.choice(["channel", "token", "auto"]))
    scale = float(10.0 ** rng.uniform(-3, 3))
    v = O.to_f32(kv_like(rng, T, H, "fp32", scale), "fp32")
    s = rng.random()
    if T and s < 0.25:  # special channels and values
        c = rng.integers(0, H, 4)
        v[:, c[0]] = np.float32(rng.standard_normal())
        v[:, c[1]] = np.where(rng.random(T) < 0.5, -0.0, 0.0)
        v[:, c[2]] *= np.float32(1e-36 if dtype != "fp16" else 1e-5)
        v[rng.integers(T), c[3]] *= 1000
    elif T and s < 0.32 and dtype != "fp16":
        v[rng.integers(T), rng.integers(H)] = float(rng.choice([7e4, -1e6, 3e38]))
    elif T and s < 0.37:
        t = int(rng.integers(T))
        v[t, rng.integers(H)] = float(rng.choice([np.nan, np.inf, -np.inf]))
        kw["nonfinite"] = "raw"
    if dtype == "fp16":  # finite in binary16 (non-finite values only where placed above)
        v = np.clip(v, -65504, 65504)
    x = as_dtype(v, dtype)
    if codec == "spectrum":
        kw["tiers"] = rng.integers(0, 4, T) if rng.random() < 0.7 else \
            np.repeat(rng.integers(0, 4, -(-T // 8) or 1), 8)[:T]
    label = codec
    if codec == "lynx":
        a = kw.get("alpha", 0.0)
        label = "lynx/auto" if a == O.ALPHA_AUTO else ("lynx/a0" if a == 0 else "lynx/a>0")
    return x, dtype, codec, kw, label


def sweep(pages, seed=1, out=None):
    """(pages, byte mismatches, decode mismatches, per-(codec, dtype) counts, failures)."""
    rng = np.random.default_rng(seed)
    counts = collections.Counter()
    byte_bad = decode_bad = 0
    failures = []
    for i in range(pages):
        x, dtype, codec, kw, label = random_case(rng)
        counts[(label, dtype)] += 1
        pa, _, problems = compare(x, dtype, codec, **kw)
        h = O.parse_header(pa)
        for flag, name in ((O.FLAG_RAW, "raw"), (O.FLAG_META_FP32, "meta_fp32"),
                           (O.FLAG_TOKEN_GROUPS, "token_groups")):
            counts[("+", name)] += bool(h["flags"] & flag)
        counts[("+", "sink_rows")] += h["sink_rows"] > 0
        counts[("+", "T=0")] += h["T"] == 0
        counts[("+", "tail")] += h["T"] % h["chunk"] != 0
        b = any(p.startswith(("anchor:", "residual:")) for p in problems)
        d = any("decode:" in p for p in problems)
        byte_bad += b
        decode_bad += d
        if problems:
            failures.append("page %d (%s %s T=%d H=%d %s): %s" % (
                i, dtype, codec, x.shape[0], x.shape[1],
                {k: v for k, v in kw.items() if k != "tiers"}, "; ".join(problems)))
            if out:
                print(failures[-1], file=out)
    return pages, byte_bad, decode_bad, counts, failures


def summary(pages, byte_bad, decode_bad, counts):
    lines = ["oracle: %d pages, %d byte mismatches, %d decode mismatches" %
             (pages, byte_bad, decode_bad)]
    labels = sorted({k[0] for k in counts} - {"+"})
    for lab in labels:
        lines.append("  %-10s %s" % (lab, "  ".join("%s %d" % (dt, counts[(lab, dt)])
                                                      for dt in DTYPES)))
    lines.append("  pages with: " + ", ".join("%s %d" % (k[1], v) for k, v in sorted(counts.items())
                                              if k[0] == "+"))
    return lines


def test_random_sweep():
    pages = int(os.environ.get("KVXFER_ORACLE_PAGES", "400"))
    n, b, d, counts, failures = sweep(pages, seed=int(os.environ.get("KVXFER_ORACLE_SEED", "1")))
    print("\n".join(summary(n, b, d, counts)))
    assert not failures, "\n".join(failures[:10])
    assert sum(v for k, v in counts.items() if k[0] != "+") == pages


# ---------------------------------------------------------------------------
# Golden vectors (golden/, written by golden_vectors.py --write from the oracle)
# ---------------------------------------------------------------------------
def test_golden_vectors():
    import golden_vectors as G
    cases = G.load()
    assert len(cases) >= 10
    for name, x, dtype, codec, kw, anchor, residual in cases:
        oa, orr = O.encode(x, dtype, codec, **kw)
        assert oa == anchor and orr == residual, "oracle no longer makes golden/%s" % name
        pa, pr = product_encode(x, dtype, codec, **kw)
        p = [q for q in (first_difference(pa, anchor, "anchor"),
                         first_difference(pr, residual, "residual")) if q]
        assert not p, "product differs from golden/%s: %s" % (name, "; ".join(p))
        T, H = x.shape
        for res in (None, residual):
            want = product_decode(anchor, res, T, H)
            assert np.array_equal(want.view(np.uint32), O.decode(anchor, res).view(np.uint32))


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    os.environ.setdefault("KVXFER_CODEC_THREADS", "1")
    t0 = time.time()
    n, b, d, counts, failures = sweep(args.pages, args.seed, out=sys.stdout)
    for line in summary(n, b, d, counts):
        print(line)
    print("oracle: seed %d, %.1f s" % (args.seed, time.time() - t0))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
