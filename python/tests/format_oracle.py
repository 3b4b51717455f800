"""An independent oracle of the kvxfer page codec, written from docs/FORMAT.md
alone (NumPy, no code or constants shared with src/).

    encode(x, dtype, codec, ...) -> (anchor bytes, residual bytes)
    decode(anchor, residual=None) -> float32 array [T][H]

x is the page's source values: a [T][H] array of uint16 bf16 bits (dtype
"bf16"), float16 ("fp16") or float32 ("fp32").  Section numbers below are
docs/FORMAT.md's.  Exactness (section 3): float32 arithmetic is NumPy's
(IEEE, round to nearest even); a fused multiply-add RN(a*b + c) is emulated
exactly by fma32() (exact product in binary64, TwoSum, round to odd, then one
rounding to binary32).
"""

import struct
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import xxhash

F32 = np.float32
MAGIC = 0x5058564B
VERSION = 5
HEADER = 80
CODECS = {"lynx": 0, "int8": 1, "int4": 2, "bf16": 3, "spectrum": 4}
DTYPES = {"bf16": 0, "fp16": 1, "fp32": 2}
TIER_FP16, TIER_INT8, TIER_INT4, TIER_DROP = 0, 1, 2, 3
FLAG_RAW, FLAG_META_FP32, FLAG_TOKEN_GROUPS = 1, 2, 4
ALPHA_AUTO = -1.0
AUTO_CANDIDATES = (0, 1, 2, 5, 10, 20, 50, 100, 255)
FLT_MAX = np.finfo(np.float32).max


# ---------------------------------------------------------------------------
# binary32 helpers (section 3)
# ---------------------------------------------------------------------------
def f32(v):
    return np.asarray(v, dtype=np.float32)


def fma32(a, b, c):
    """RN(a*b + c) in binary32 with one rounding, elementwise."""
    a, b, c = np.broadcast_arrays(f32(a), f32(b), f32(c))
    p = a.astype(np.float64) * b.astype(np.float64)  # exact: 48 bits
    cc = c.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        s = p + cc
        bp = s - cc
        e = (p - bp) + (cc - (s - bp))  # TwoSum: p + c = s + e exactly
        bits = s.view(np.int64).copy()
        fix = (e != 0) & ((bits & 1) == 0) & np.isfinite(s)
        # round to odd: move one ulp of binary64 toward the exact sum
        up = (e > 0) == (s > 0)
        bits[fix & up] += 1
        bits[fix & ~up] -= 1
        out = bits.view(np.float64).astype(np.float32)
    return out


def round_exact_to_f32(v):
    """The binary32 nearest the exact rational v (ties to even), finite range."""
    v = Fraction(v)
    r = np.float32(float(v))
    cands = [np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - v),
                                     int(np.float32(c).view(np.uint32)) & 1))


def bf16_bits(x32):
    """float32 -> bf16 bits, round to nearest even (section 3.4)."""
    u = f32(x32).view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(f32(x32))
    r = np.where(nan, (u >> 16) | 0x40, r)
    return r.astype(np.uint16)


def as_dtype(v, dtype):
    """float32 values as a source page of `dtype`: bf16 bits (uint16), float16 or float32
    (section 3.4's rounding; beyond range becomes infinity)."""
    v = np.asarray(v, dtype=np.float32)
    with np.errstate(over="ignore"):
        if dtype == "bf16":
            return bf16_bits(v)
        if dtype == "fp16":
            return v.astype(np.float16)
    return v


def bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def to_f32(x, dtype):
    """Source values -> float32 (exact)."""
    if dtype == "bf16":
        return bf16_to_f32(np.asarray(x, dtype=np.uint16))
    if dtype == "fp16":
        return np.asarray(x, dtype=np.float16).astype(np.float32)
    return np.asarray(x, dtype=np.float32).copy()


def src_bytes(x, dtype):
    if dtype == "bf16":
        return np.ascontiguousarray(x, dtype="<u2").tobytes()
    if dtype == "fp16":
        return np.ascontiguousarray(x, dtype="<f2").tobytes()
    return np.ascontiguousarray(x, dtype="<f4").tobytes()


def fp16_round_up(v):
    """The least binary16 >= v (v >= 0 float32); +inf beyond 65504."""
    v = f32(v)
    with np.errstate(over="ignore"):
        h = v.astype(np.float16)
    lo = h.astype(np.float32) < v
    h = np.where(lo, np.nextafter(h, np.float16(np.inf)), h)
    return h.astype(np.float16)


# ---------------------------------------------------------------------------
# Section 2.2: the alpha-law threshold table (Appendix A's double arithmetic)
# ---------------------------------------------------------------------------
_LN2 = 0.6931471805599453094172321214581766


def det_log1p(x):
    """Appendix A log1p, IEEE binary64 (Python floats)."""
    x = float(x)
    if x < 1e-8:
        return x - 0.5 * x * x
    m, e = 1.0 + x, 0
    while m >= 1.4142135623730951:
        m = m * 0.5
        e += 1
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    term, acc = s, 0.0
    for k in range(1, 42, 2):
        acc = acc + term / k
        term = term * s2
    return 2.0 * acc + e * _LN2


def det_expm1(x):
    """Appendix A expm1, IEEE binary64."""
    halvings, y = 0, float(x)
    while y > 0.0009765625 or y < -0.0009765625:
        y = y * 0.5
        halvings += 1
    term, acc = y, 0.0
    for k in range(2, 13):
        acc = acc + term
        term = term * y / k
    for _ in range(halvings):
        acc = acc * (acc + 2.0)
    return acc


_T_CACHE = {}


def alpha_table(alpha):
    """T[k] = float(expm1((k + 1/2)/127 * log1p(alpha)) / alpha), k = 0..126."""
    alpha = float(np.float32(alpha))
    if alpha not in _T_CACHE:
        l1 = det_log1p(alpha)
        _T_CACHE[alpha] = np.array(
            [np.float32(det_expm1((k + 0.5) / 127.0 * l1) / alpha) for k in range(127)],
            dtype=np.float32)
    return _T_CACHE[alpha]


def alpha_table_exact(alpha):
    """The same table from the exact g(k + 1/2), correctly rounded (a cross-check:
    Appendix A is accurate enough that both agree for the alphas tested)."""
    alpha = float(np.float32(alpha))
    out = []
    with localcontext() as ctx:
        ctx.prec = 50
        a = Decimal(alpha)
        ln1a = (1 + a).ln()
        for k in range(127):
            out.append(round_exact_to_f32(((ln1a * (Decimal(2 * k + 1) / 254)).exp() - 1) / a))
    return np.array(out, dtype=np.float32)


# ---------------------------------------------------------------------------
# Sections 2.2-2.4: code books
# ---------------------------------------------------------------------------
class Book:
    """A quantizer (codec "lynx" with alpha, "int8", "int4") and split A:
    L, recon_full[code], code bins, anchor bins, centres and levels."""

    def __init__(self, codec, alpha=0.0, A=4):
        self.codec, self.alpha, self.A = codec, float(alpha), A
        self.nested = codec == "lynx" and self.alpha == 0
        self.sign_mag = codec == "lynx" and self.alpha != 0
        if codec in ("int8", "int4"):
            b = 8 if codec == "int8" else 4
            self.bits, n = b, 1 << b
            self.L = F32((n - 1) / 2)
            step = F32(2) / F32(n - 1)
            self.full = fma32(np.arange(n, dtype=np.float32), step, F32(-1))
            thr = np.array([np.float32(-1.0 + (2.0 * k + 1.0) / (n - 1)) for k in range(n - 1)],
                           dtype=np.float32)
        elif self.nested:
            self.bits, self.L = 8, F32(240)
            c = np.arange(256)
            n = np.where(c < 16, 2 * c - 479, np.where(c >= 240, 2 * c - 31, 4 * c - 510))
            n[0], n[255] = -480, 480
            self.full = n.astype(np.float32) * (F32(1) / F32(480))
            cc = np.arange(1, 256)
            y = np.where(cc < 16, 16 + cc, np.where(cc < 240, 2 * cc, cc + 240))
            thr = np.array([np.float32((int(v) - 256) / 240.0) for v in y], dtype=np.float32)
        else:
            self.bits, self.L = 8, F32(1)
            self.T = alpha_table(self.alpha)
            thr = self.T
        self.R = self.bits - A
        # code bins [lo, hi] (float32 values), section 2.4
        t = thr.astype(np.float64)
        ncodes = 1 << self.bits
        if self.sign_mag:
            q = np.arange(ncodes) & 0x7F
            mlo = np.where(q == 0, 0.0, np.concatenate([[0.0], t])[q])
            mhi = np.where(q == 127, 1.0, np.concatenate([t, [1.0]])[q])
            neg = np.arange(ncodes) >= 128
            lo, hi = np.where(neg, -mhi, mlo), np.where(neg, -mlo, mhi)
            self.full = (0.5 * (lo + hi)).astype(np.float32)
        else:
            lo = np.concatenate([[-1.0], t])
            hi = np.concatenate([t, [1.0]])
        run = 1 << self.R
        self.alo = lo.reshape(-1, run).min(axis=1).astype(np.float32)
        self.ahi = hi.reshape(-1, run).max(axis=1).astype(np.float32)
        self.table = self.R > 0 and not (self.nested and A == 4)
        if self.R == 0:
            self.centre = self.full.copy()
        elif not self.table:
            self.centre = int4_levels()
        else:
            self.centre = (0.5 * (self.alo.astype(np.float64) + self.ahi)).astype(np.float32)

    def quantize(self, u, s):
        """Codes (uint8) of u = RN(x - m) with code scale s (section 2.2)."""
        if self.codec in ("int8", "int4"):
            q = np.trunc(fma32(u, s, self.L + F32(0.5)))
            return np.clip(q, 0, (1 << self.bits) - 1).astype(np.uint8)
        if self.nested:
            g = np.trunc(fma32(u, s, F32(256))).astype(np.int64)
            a = np.minimum(g >> 5, 15)
            r = np.where(a == 15, np.minimum(g - 480, 15),
                         np.where(a == 0, np.maximum(g - 16, 0), (g >> 1) & 15))
            return (a << 4 | r).astype(np.uint8)
        z = f32(u) * f32(s)
        q = np.searchsorted(self.T, np.abs(z), side="right")
        return (((z < 0).astype(np.int64) << 7) | q).astype(np.uint8)

    def anchor_table(self, hist):
        """Section 2.4: per-anchor mean of recon_full over hist, double sums in
        ascending code order, one division, one rounding, clamped to the bin."""
        run = 1 << self.R
        out = np.empty(1 << self.A, dtype=np.float32)
        for a in range(1 << self.A):
            num = den = 0.0
            for c in range(a * run, (a + 1) * run):
                num = num + float(hist[c]) * float(self.full[c])
                den = den + float(hist[c])
            v = np.float32(num / den) if den > 0 else self.centre[a]
            v = max(v, self.alo[a])
            v = min(v, self.ahi[a])
            out[a] = v
        return out


def int4_levels():
    return fma32(np.arange(16, dtype=np.float32), F32(2) / F32(15), F32(-1))


_BOOKS = {}


def book(codec, alpha=0.0, A=4):
    key = (codec, float(np.float32(alpha)) if codec == "lynx" else 0.0, A)
    if key not in _BOOKS:
        _BOOKS[key] = Book(*key)
    return _BOOKS[key]


# ---------------------------------------------------------------------------
# Section 4.2: bit streams
# ---------------------------------------------------------------------------
def pack(codes, w):
    codes = np.asarray(codes, dtype=np.uint8).ravel()
    if w == 0 or codes.size == 0:
        return b""
    bits = np.unpackbits(codes[:, None], axis=1, bitorder="little")[:, :w]
    return np.packbits(bits.ravel(), bitorder="little").tobytes()


def unpack(buf, n, w):
    if w == 0 or n == 0:
        return np.zeros(n, dtype=np.uint8)
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")[:n * w]
    bits = bits.reshape(n, w).astype(np.uint32)
    return (bits << np.arange(w, dtype=np.uint32)).sum(axis=1).astype(np.uint8)


def plen(n, w):
    return (n * w + 7) // 8


# ---------------------------------------------------------------------------
# Section 2.1: metadata
# ---------------------------------------------------------------------------
def chunk_minmax(X, C, sink_rows=0, use=None):
    """Canonical (mn, mx) [chunks][H] of X [T][H]; rows before sink_rows are
    left out of a chunk that also holds other rows (2.7); use: a [T] bool mask
    of the rows that count (SpectrumKV), or None."""
    T, H = X.shape
    K = -(-T // C)
    lo = np.full((K * C, H), np.inf, dtype=np.float32)
    hi = np.full((K * C, H), -np.inf, dtype=np.float32)
    lo[:T], hi[:T] = X, X
    drop = np.zeros(K * C, dtype=bool)
    if use is not None:
        drop[:T] = ~use
        drop[T:] = True
    elif sink_rows > 0:
        for k in range(K):
            t0, t1 = k * C, min(T, k * C + C)
            if t0 < sink_rows < t1:
                drop[t0:sink_rows] = True
    lo[drop], hi[drop] = np.inf, -np.inf
    mn = lo.reshape(K, C, H).min(axis=1) + F32(0)
    mx = hi.reshape(K, C, H).max(axis=1) + F32(0)
    return mn, mx


def affine(mn, mx, fp32):
    """(m, d, ok) of section 2.1; ok False where binary16 does not hold it."""
    with np.errstate(over="ignore", invalid="ignore"):
        m = F32(0.5) * mn + F32(0.5) * mx
        ok = np.ones(m.shape, dtype=bool)
        if not fp32:
            m = m.astype(np.float16).astype(np.float32)
            ok &= np.isfinite(m)
        d = np.maximum(mx - m, m - mn) + F32(0)
        ok &= np.isfinite(d)
        if not fp32:
            d = fp16_round_up(np.where(np.isfinite(d), d, 0)).astype(np.float32)
            ok &= np.isfinite(d)
        else:
            d = np.where((d > 0) & (d < F32(2.0 ** -100)), F32(2.0 ** -100), d)
    return m.astype(np.float32), d.astype(np.float32), ok


def code_scale(d, L):
    with np.errstate(divide="ignore"):
        return np.where(d > 0, F32(L) / np.where(d > 0, d, F32(1)), F32(0)).astype(np.float32)


def denorm(r, m, d):
    x = fma32(d, r, m)
    return np.clip(x, -FLT_MAX, FLT_MAX).astype(np.float32)


def meta_bytes(m, d, fp32):
    pair = np.stack([m, d], axis=-1)
    return pair.astype("<f4" if fp32 else "<f2").tobytes()


def read_meta(buf, n, fp32):
    a = np.frombuffer(buf, dtype="<f4" if fp32 else "<f2", count=2 * n).astype(np.float32)
    return a[0::2], a[1::2]


# ---------------------------------------------------------------------------
# Quantizing a body (2.1-2.4): rows chunked by C
# ---------------------------------------------------------------------------
def quantize_body(X, bk, C, sink_rows, fp32):
    """codes [T][H], m, d [chunks][H], hist[256]; None if binary16 fails."""
    T, H = X.shape
    mn, mx = chunk_minmax(X, C, sink_rows)
    m, d, ok = affine(mn, mx, fp32)
    if not ok.all():
        return None
    s = code_scale(d, bk.L)
    rows = np.arange(T) // C
    Xq = X
    if sink_rows > 0:
        Xq = X.copy()
        for k in range(-(-T // C)):
            t0, t1 = k * C, min(T, k * C + C)
            if t0 < sink_rows < t1:
                blk = Xq[t0:sink_rows]
                lo, hi = mn[k], mx[k]
                Xq[t0:sink_rows] = np.where(blk < lo, lo, np.where(blk > hi, hi, blk))
    u = Xq - m[rows]
    codes = bk.quantize(u, s[rows]) if T else np.zeros((0, H), dtype=np.uint8)
    t = np.arange(T)
    sel = (t % 16 == 0) & (t >= sink_rows)
    hist = np.bincount(codes[sel].ravel(), minlength=256)
    return codes, m, d, hist


def reconstruct(codes_or_anchors, m, d, C, values):
    T, H = codes_or_anchors.shape
    rows = np.arange(T) // C
    r = values[codes_or_anchors]
    return denorm(r, m[rows], d[rows])


# ---------------------------------------------------------------------------
# Section 2.6: alpha = auto
# ---------------------------------------------------------------------------
def lane_sum(E):
    """8 lanes by channel % 8, each summed in row order (sequentially, binary64),
    then lanes 0..7 added in order."""
    total = 0.0
    for lane in range(8):
        v = E[:, lane::8].ravel()
        if v.size:
            total = total + float(np.cumsum(v)[-1])
    return total


def calibrate_alpha(X, C, A):
    T, H = X.shape
    K = -(-T // C)
    ns = min(K, 8)
    ks = [si * K // ns for si in range(ns)]
    rows, ms, ds, oks = [], [], [], []
    for k in ks:
        t0, t1 = k * C, min(T, k * C + C)
        blk = X[t0:t1]
        fin = np.isfinite(blk).all(axis=0)
        with np.errstate(invalid="ignore"):
            mn = np.where(fin, blk.min(axis=0), 0).astype(np.float32) + F32(0)
            mx = np.where(fin, blk.max(axis=0), 0).astype(np.float32) + F32(0)
        m, d, ok = affine(mn, mx, False)
        m32, d32, _ = affine(mn, mx, True)
        m, d = np.where(ok, m, m32), np.where(ok, d, d32)
        m, d = np.where(fin, m, 0).astype(np.float32), np.where(fin, d, 0).astype(np.float32)
        for t in range(t0, t1):
            if t % 16 == 0:
                rows.append(t)
                ms.append(m)
                ds.append(d)
                oks.append(fin)
    if not rows:
        return 0.0
    Xs = X[rows].astype(np.float32)
    M, D, OK = np.array(ms), np.array(ds), np.array(oks)
    errs = []
    for a in AUTO_CANDIDATES:
        bk = book("lynx", a, A)
        s = code_scale(D, bk.L)
        with np.errstate(invalid="ignore", over="ignore"):
            codes = bk.quantize(Xs - M, s)
        hist = np.bincount(codes[OK].ravel(), minlength=256)
        table = bk.anchor_table(hist) if bk.table else bk.centre
        with np.errstate(invalid="ignore", over="ignore"):
            x64 = Xs.astype(np.float64)
            ef = denorm(bk.full[codes], M, D).astype(np.float64) - x64
            ea = denorm(table[codes >> bk.R], M, D).astype(np.float64) - x64
            ef, ea = np.where(OK, ef * ef, 0.0), np.where(OK, ea * ea, 0.0)
        errs.append((lane_sum(ef), lane_sum(ea)))
    best = 0
    for i in range(1, len(errs)):
        if errs[i][0] <= errs[0][0] and errs[i][1] < errs[best][1]:
            best = i
    return float(AUTO_CANDIDATES[best])


# ---------------------------------------------------------------------------
# Section 4: sections
# ---------------------------------------------------------------------------
_HDR = struct.Struct("<IHHBBBBBBBBfIIIqQQQQQ")
assert _HDR.size == HEADER


def header_bytes(h, section, payload_len, link):
    return _HDR.pack(MAGIC, VERSION, HEADER, section, h["codec"], h["flags"], h["src_dtype"],
                     h["chunk"], h["code_bits"], h["anchor_bits"], h["kind"], h["alpha"],
                     h["layer"], h["H"], h["sink_rows"], h["token_begin"], h["T"],
                     h["stream_id"], payload_len, link, 0)


def seal(h, section, payload, link=0):
    hdr = header_bytes(h, section, len(payload), link)
    seed = xxhash.xxh3_64_intdigest(payload)
    ck = xxhash.xxh3_64_intdigest(hdr, seed=seed)
    return hdr[:72] + struct.pack("<Q", ck) + payload, ck


def seal_page(h, anchor_payload, residual_payload):
    a, ck = seal(h, 1, anchor_payload)
    r, _ = seal(h, 2, residual_payload, link=ck)
    return a, r


def parse_header(sec):
    f = _HDR.unpack_from(sec, 0)
    keys = ("magic version header_bytes section codec flags src_dtype chunk code_bits "
            "anchor_bits kind alpha layer H sink_rows token_begin T stream_id payload_bytes "
            "link checksum").split()
    return dict(zip(keys, f))


def checksum_ok(sec):
    h = parse_header(sec)
    payload = bytes(sec[HEADER:])
    hdr = bytes(sec[:72]) + b"\0" * 8
    return (len(payload) == h["payload_bytes"] and
            xxhash.xxh3_64_intdigest(hdr, seed=xxhash.xxh3_64_intdigest(payload)) == h["checksum"])


def sink_bits(x, dtype, n):
    """The sink rows' 16-bit values (2.7)."""
    if dtype == "bf16":
        return np.asarray(x[:n], dtype=np.uint16)
    if dtype == "fp16":
        return np.asarray(x[:n], dtype=np.float16).view(np.uint16)
    b = bf16_bits(np.asarray(x[:n], dtype=np.float32))
    inf = (b & 0x7FFF) == 0x7F80
    return np.where(inf, (b & 0x8000) | 0x7F7F, b).astype(np.uint16)


def _body(X, bk, C, sink_rows, tg):
    """(codes, m, d, hist, meta_fp32) of the page body (TOKEN groups: the transpose)."""
    B = np.ascontiguousarray(X.T) if tg else X
    sr = 0 if tg else sink_rows
    for fp32 in (False, True):
        q = quantize_body(B, bk, C, sr, fp32)
        if q is not None:
            return q + (fp32,)
    raise ValueError("range does not fit binary32 metadata")


def encode(x, dtype, codec="lynx", *, alpha=0.0, chunk=32, A=4, sink_tokens=1,
           value_groups="channel", nonfinite="error", layer=0, kind=0, token_begin=0,
           stream_id=0, tiers=None):
    """(anchor, residual) bytes of page x ([T][H] source values of dtype).

    codec: lynx, int8, int4, bf16, spectrum (tiers: T tier numbers); kind 0 K,
    1 V; alpha may be ALPHA_AUTO; value_groups channel, token or auto.
    Raises ValueError for non-finite input under nonfinite="error"."""
    x = np.asarray(x)
    T, H = x.shape
    X = to_f32(x, dtype)
    if codec == "spectrum":
        return _encode_spectrum(x, X, dtype, chunk, A, nonfinite, layer, kind, token_begin,
                                stream_id, tiers)
    h = dict(codec=CODECS[codec], flags=0, src_dtype=DTYPES[dtype], chunk=chunk, code_bits=0,
             anchor_bits=0, kind=kind, alpha=0.0, layer=layer, H=H, sink_rows=0,
             token_begin=token_begin, T=T, stream_id=stream_id)
    finite = bool(np.isfinite(X).all())
    if not finite and nonfinite == "error":
        raise ValueError("non-finite input")
    if codec == "bf16":
        if finite or dtype == "bf16":
            vals = x if dtype == "bf16" else bf16_bits(X)
            h["flags"] = 0 if finite else FLAG_RAW
            return seal_page(h, np.asarray(vals, dtype="<u2").tobytes(), b"")
        h["flags"] = FLAG_RAW
        return seal_page(h, src_bytes(x, dtype), b"")
    if codec == "lynx" and alpha == ALPHA_AUTO:
        alpha = calibrate_alpha(X, chunk, A)
    h["code_bits"] = 4 if codec == "int4" else 8
    h["anchor_bits"] = A
    if codec == "lynx":
        h["alpha"] = float(np.float32(alpha)) + 0.0
    if token_begin < sink_tokens:
        h["sink_rows"] = int(min(sink_tokens - token_begin, T))
    if not finite:
        h["flags"], h["sink_rows"] = FLAG_RAW, 0
        return seal_page(h, src_bytes(x, dtype), b"")
    bk = book(codec, h["alpha"], A)
    if kind == 1 and value_groups == "auto":
        value_groups = "channel"
        if T <= 1 << 20:
            cand = {}
            for g in ("channel", "token"):
                a, _ = encode(x, dtype, codec, alpha=h["alpha"], chunk=chunk, A=A,
                              sink_tokens=sink_tokens, value_groups=g, layer=layer, kind=kind,
                              token_begin=token_begin, stream_id=stream_id)
                e = (decode(a).astype(np.float64) - X.astype(np.float64)).ravel()
                cand[g] = float(np.cumsum(e * e)[-1]) if e.size else 0.0
            if cand["token"] < cand["channel"]:
                value_groups = "token"
    tg = kind == 1 and value_groups == "token"
    codes, m, d, hist, fp32 = _body(X, bk, chunk, h["sink_rows"], tg)
    h["flags"] = (FLAG_TOKEN_GROUPS if tg else 0) | (FLAG_META_FP32 if fp32 else 0)
    R = bk.R
    ap = meta_bytes(m, d, fp32) + pack(codes >> R, A)
    if bk.table:
        ap += bk.anchor_table(hist).astype("<f4").tobytes()
    if h["sink_rows"] > 0:
        ap += b"\0" * ((8 - len(ap) % 8) % 8)
        ap += sink_bits(x, dtype, h["sink_rows"]).astype("<u2").tobytes()
    rp = pack(codes & ((1 << R) - 1), R)
    return seal_page(h, ap, rp)


# ---------------------------------------------------------------------------
# Section 6: SpectrumKV
# ---------------------------------------------------------------------------
def fp16_tier_bits(X):
    with np.errstate(over="ignore"):
        b = X.astype(np.float16).view(np.uint16)
    inf = (b & 0x7C00) == 0x7C00
    return np.where(inf, (b & 0x8000) | 0x7BFF, b).astype(np.uint16)


def fp16_anchor_value(hi):
    base = np.asarray(hi, dtype=np.uint16) << 8
    a = base.view(np.float16).astype(np.float32)
    b = (base | 0xFF).view(np.float16).astype(np.float32)
    return (a + b) * F32(0.5)


def _encode_spectrum(x, X, dtype, C, A, nonfinite, layer, kind, token_begin, stream_id, tiers):
    T, H = X.shape
    tiers = np.asarray(tiers if tiers is not None else [], dtype=np.uint8).reshape(T)
    counts = [int((tiers == k).sum()) for k in range(4)]
    h = dict(codec=4, flags=0, src_dtype=DTYPES[dtype], chunk=C, code_bits=8, anchor_bits=A,
             kind=kind, alpha=0.0, layer=layer, H=H, sink_rows=0, token_begin=token_begin, T=T,
             stream_id=stream_id)
    cnt = struct.pack("<4Q", *counts)
    tmap = np.zeros((T + 3) // 4, dtype=np.uint8)
    for t in range(T):
        tmap[t >> 2] |= int(tiers[t]) << (2 * (t & 3))
    tmap = tmap.tobytes()
    sent = tiers != TIER_DROP
    if not np.isfinite(X[sent]).all():
        if nonfinite == "error":
            raise ValueError("non-finite input")
        h["flags"] = FLAG_RAW
        return seal_page(h, cnt + tmap + src_bytes(np.asarray(x)[sent], dtype), cnt)
    qt = (tiers == TIER_INT8) | (tiers == TIER_INT4)
    b8, b4 = book("int8", 0, A), book("int4", 0, 4)
    K = -(-T // C)
    for fp32 in (False, True):
        if T:
            mn, mx = chunk_minmax(np.where(qt[:, None], X, 0).astype(np.float32), C, use=qt)
            have = np.array([qt[k * C:k * C + C].any() for k in range(K)])
            mn = np.where(have[:, None], mn, 0).astype(np.float32)
            mx = np.where(have[:, None], mx, 0).astype(np.float32)
            m, d, ok = affine(mn, mx, fp32)
            m = np.where(have[:, None], m, 0).astype(np.float32)
            d = np.where(have[:, None], d, 0).astype(np.float32)
            if not (ok | ~have[:, None]).all():
                continue
        else:
            m = d = np.zeros((0, H), dtype=np.float32)
        break
    h["flags"] = FLAG_META_FP32 if fp32 else 0
    rows = np.arange(T) // C
    i8, i4, i16 = tiers == TIER_INT8, tiers == TIER_INT4, tiers == TIER_FP16
    M, D = m[rows], d[rows]
    c8 = b8.quantize(X[i8] - M[i8], code_scale(D[i8], b8.L)) if i8.any() else \
        np.zeros((0, H), np.uint8)
    c4 = b4.quantize(X[i4] - M[i4], code_scale(D[i4], b4.L)) if i4.any() else \
        np.zeros((0, H), np.uint8)
    f16 = fp16_tier_bits(X[i16]) if i16.any() else np.zeros((0, H), np.uint16)
    hsel = (np.arange(T)[i8] % 16) == 0
    hist = np.bincount(c8[hsel].ravel(), minlength=256)
    R = 8 - A
    ap = (cnt + tmap + meta_bytes(m, d, fp32) + (f16 >> 8).astype(np.uint8).tobytes() +
          pack(c8 >> R, A) + pack(c4, 4) + b8.anchor_table(hist).astype("<f4").tobytes())
    rp = cnt + (f16 & 0xFF).astype(np.uint8).tobytes() + pack(c8 & ((1 << R) - 1), R)
    return seal_page(h, ap, rp)


def _decode_spectrum(h, ap, rp):
    T, H, C, A = h["T"], h["H"], h["chunk"], h["anchor_bits"]
    R = 8 - A
    counts = struct.unpack_from("<4Q", ap, 0)
    mb = (T + 3) // 4
    mp = np.frombuffer(ap, dtype=np.uint8, count=mb, offset=32)
    tiers = ((mp[np.arange(T) >> 2] >> (2 * (np.arange(T) & 3))) & 3).astype(np.uint8)
    out = np.zeros((T, H), dtype=np.float32)
    off = 32 + mb
    if h["flags"] & FLAG_RAW:
        dt = {0: "bf16", 1: "fp16", 2: "fp32"}[h["src_dtype"]]
        sent = tiers != TIER_DROP
        n = int(sent.sum()) * H
        raw = np.frombuffer(ap, dtype="<f4" if dt == "fp32" else "<u2", count=n, offset=off)
        if dt == "fp16":
            raw = raw.view("<f2")
        out[sent] = to_f32(raw.reshape(-1, H), dt)
        return out
    fp32 = bool(h["flags"] & FLAG_META_FP32)
    K = -(-T // C)
    m, d = read_meta(ap[off:], K * H, fp32)
    m, d = m.reshape(K, H), d.reshape(K, H)
    off += K * H * (8 if fp32 else 4)
    n16, n8, n4 = counts[0] * H, counts[1] * H, counts[2] * H
    hi = np.frombuffer(ap, dtype=np.uint8, count=n16, offset=off).reshape(-1, H)
    off += n16
    a8 = unpack(ap[off:off + plen(n8, A)], n8, A).reshape(-1, H)
    off += plen(n8, A)
    c4 = unpack(ap[off:off + plen(n4, 4)], n4, 4).reshape(-1, H)
    off += plen(n4, 4)
    table = np.frombuffer(ap, dtype="<f4", count=1 << A, offset=off).astype(np.float32)
    b8, b4 = book("int8", 0, A), book("int4", 0, 4)
    rows = np.arange(T) // C
    M, D = m[rows], d[rows]
    i8, i4, i16 = tiers == TIER_INT8, tiers == TIER_INT4, tiers == TIER_FP16
    if rp is None:
        out[i16] = fp16_anchor_value(hi)
        out[i8] = denorm(table[a8], M[i8], D[i8])
    else:
        lo = np.frombuffer(rp, dtype=np.uint8, count=n16, offset=32).reshape(-1, H)
        out[i16] = ((hi.astype(np.uint16) << 8) | lo).view(np.float16).astype(np.float32)
        r8 = unpack(rp[32 + n16:], n8, R).reshape(-1, H)
        out[i8] = denorm(b8.full[(a8.astype(np.int64) << R) | r8], M[i8], D[i8])
    out[i4] = denorm(b4.full[c4], M[i4], D[i4])
    return out


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------
def decode(anchor, residual=None):
    """float32 [T][H] of a page (anchor only when residual is None or empty)."""
    anchor = bytes(anchor)
    h = parse_header(anchor)
    assert h["magic"] == MAGIC and h["version"] == VERSION and h["section"] == 1
    assert checksum_ok(anchor), "anchor checksum"
    ap = anchor[HEADER:]
    rp = None
    if residual is not None and len(residual) > 0:
        residual = bytes(residual)
        assert checksum_ok(residual), "residual checksum"
        assert parse_header(residual)["link"] == h["checksum"], "link"
        rp = residual[HEADER:]
    T, H, C, A = h["T"], h["H"], h["chunk"], h["anchor_bits"]
    dt = {0: "bf16", 1: "fp16", 2: "fp32"}[h["src_dtype"]]
    if h["codec"] == 4:
        return _decode_spectrum(h, ap, rp)
    if h["flags"] & FLAG_RAW:
        if dt == "fp32":
            return np.frombuffer(ap, dtype="<f4", count=T * H).astype(np.float32).reshape(T, H)
        raw = np.frombuffer(ap, dtype="<u2", count=T * H).reshape(T, H)
        return to_f32(raw if dt == "bf16" else raw.view("<f2"), dt)
    if h["codec"] == 3:
        return bf16_to_f32(np.frombuffer(ap, dtype="<u2", count=T * H).reshape(T, H))
    codec = {0: "lynx", 1: "int8", 2: "int4"}[h["codec"]]
    bk = book(codec, h["alpha"], A)
    R = bk.R
    tg = bool(h["flags"] & FLAG_TOKEN_GROUPS)
    fp32 = bool(h["flags"] & FLAG_META_FP32)
    BT, BH = (H, T) if tg else (T, H)
    K = -(-BT // C)
    m, d = read_meta(ap, K * BH, fp32)
    m, d = m.reshape(K, BH), d.reshape(K, BH)
    off = K * BH * (8 if fp32 else 4)
    n = T * H
    anchors = unpack(ap[off:off + plen(n, A)], n, A).reshape(BT, BH)
    off += plen(n, A)
    if bk.table:
        table = np.frombuffer(ap, dtype="<f4", count=1 << A, offset=off).astype(np.float32)
        off += 4 << A
    else:
        table = bk.centre
    if rp is not None and R > 0:
        res = unpack(rp, n, R).reshape(BT, BH)
        vals = reconstruct((anchors.astype(np.int64) << R) | res, m, d, C, bk.full)
    elif rp is not None:
        vals = reconstruct(anchors.astype(np.int64), m, d, C, bk.full)
    else:
        vals = reconstruct(anchors.astype(np.int64), m, d, C, table)
    out = np.ascontiguousarray(vals.T) if tg else vals
    ns = h["sink_rows"]
    if ns > 0:
        off += (8 - off % 8) % 8
        sb = np.frombuffer(ap, dtype="<u2", count=ns * H, offset=off).reshape(ns, H)
        out[:ns] = sb.view("<f2").astype(np.float32) if dt == "fp16" else bf16_to_f32(sb)
    return out


def describe_offset(sec, off):
    """The header field or payload region a byte offset of a section falls in."""
    fields = [(0, "magic"), (4, "version"), (6, "header_bytes"), (8, "section"), (9, "codec"),
              (10, "flags"), (11, "src_dtype"), (12, "chunk_tokens"), (13, "code_bits"),
              (14, "anchor_bits"), (15, "kind"), (16, "alpha"), (20, "layer"),
              (24, "num_channels"), (28, "sink_rows"), (32, "token_begin"), (40, "num_tokens"),
              (48, "stream_id"), (56, "payload_bytes"), (64, "link"), (72, "checksum")]
    if off < HEADER:
        return "header." + [n for o, n in fields if o <= off][-1]
    h = parse_header(sec)
    p = off - HEADER
    if h["section"] == 2:
        return "residual payload +%d" % p
    if h["codec"] == 4 or h["flags"] & FLAG_RAW or h["codec"] == 3:
        return "anchor payload +%d" % p
    tg = h["flags"] & FLAG_TOKEN_GROUPS
    BT, BH = (h["H"], h["T"]) if tg else (h["T"], h["H"])
    meta = -(-BT // h["chunk"]) * BH * (8 if h["flags"] & FLAG_META_FP32 else 4)
    codes = plen(h["T"] * h["H"], h["anchor_bits"])
    if p < meta:
        return "metadata pair %d" % (p // (8 if h["flags"] & FLAG_META_FP32 else 4))
    if p < meta + codes:
        return "anchor codes byte %d" % (p - meta)
    return "table/sink rows +%d" % (p - meta - codes)
