"""A paged KV cache in host memory (bytearray blocks), for the tests, the peer
script and the example.  Standard library only."""

import array
import random
import struct
import sys

import kvxfer

ITEMSIZE = {kvxfer.Dtype.BF16: 2, kvxfer.Dtype.FP16: 2, kvxfer.Dtype.FP32: 4}


def encode_floats(values, dtype):
    """Little-endian bytes of `values` in `dtype` (bf16: truncated fp32)."""
    dtype = kvxfer.Dtype(dtype)
    f = array.array("f", values)
    if sys.byteorder != "little":
        f.byteswap()
    if dtype == kvxfer.Dtype.FP32:
        return f.tobytes()
    if dtype == kvxfer.Dtype.FP16:
        return struct.pack("<%de" % len(values), *values)
    halves = memoryview(f).cast("B").cast("H")  # native = little-endian here
    return array.array("H", halves[1::2]).tobytes()


def decode_floats(raw, dtype):
    """Floats from little-endian `dtype` bytes."""
    dtype = kvxfer.Dtype(dtype)
    raw = bytes(raw)
    if dtype == kvxfer.Dtype.FP32:
        return list(array.array("f", raw))
    if dtype == kvxfer.Dtype.FP16:
        return list(struct.unpack("<%de" % (len(raw) // 2), raw))
    hi = array.array("H", raw)
    words = array.array("I", (h << 16 for h in hi))
    return list(array.array("f", words.tobytes()))


class HostKV:
    """num_layers x {K, V} block tables of bytearray blocks.

    Block b of layer l holds tokens [b*block_size, (b+1)*block_size); rows are
    row_stride elements apart (row_stride = H + pad).  Unused bytes are 0xA5.
    """

    def __init__(self, num_layers, kv_heads, head_dim, num_tokens, block_size,
                 dtype=kvxfer.Dtype.BF16, pad=0):
        self.L, self.heads, self.hd = num_layers, kv_heads, head_dim
        self.T, self.bs, self.dtype = num_tokens, block_size, kvxfer.Dtype(dtype)
        self.H = kv_heads * head_dim
        self.stride = self.H + pad
        self.es = ITEMSIZE[self.dtype]
        self.nblocks = max(1, -(-num_tokens // block_size))
        nbytes = block_size * self.stride * self.es
        self.k = [[bytearray(b"\xa5" * nbytes) for _ in range(self.nblocks)]
                  for _ in range(num_layers)]
        self.v = [[bytearray(b"\xa5" * nbytes) for _ in range(self.nblocks)]
                  for _ in range(num_layers)]

    def blocks(self, kind):
        return self.k if kvxfer.KVKind(kind) == kvxfer.KVKind.KEY else self.v

    def descriptor(self):
        return kvxfer.KVDescriptor(self.k, self.v, num_layers=self.L, kv_heads=self.heads,
                                   head_dim=self.hd, block_size=self.bs, dtype=self.dtype,
                                   num_tokens=self.T, row_stride=self.stride)

    def layout(self, layer, kind, first_token=0, num_tokens=None):
        return kvxfer.PageLayout(self.blocks(kind)[layer], block_size=self.bs,
                                 num_tokens=self.T if num_tokens is None else num_tokens,
                                 num_channels=self.H, dtype=self.dtype, row_stride=self.stride,
                                 first_token=first_token)

    def _row_slice(self, t):
        off = (t % self.bs) * self.stride * self.es
        return t // self.bs, off, off + self.H * self.es

    def set_row(self, layer, kind, t, raw):
        b, lo, hi = self._row_slice(t)
        self.blocks(kind)[layer][b][lo:hi] = raw

    def rows(self, layer, kind):
        """The T x H elements of one layer's K or V, contiguous (no padding)."""
        out = bytearray()
        for t in range(self.T):
            b, lo, hi = self._row_slice(t)
            out += self.blocks(kind)[layer][b][lo:hi]
        return bytes(out)

    def fill(self, seed):
        """KV-like values: per-channel offsets and scales, a few outliers."""
        rng = random.Random(seed)
        scale = [20.0 if c % 17 == 3 else 1.0 + 0.1 * (c % 5) for c in range(self.H)]
        off = [0.05 * (c % 7) for c in range(self.H)]
        for layer in range(self.L):
            for kind in (kvxfer.KVKind.KEY, kvxfer.KVKind.VALUE):
                for t in range(self.T):
                    vals = [scale[c] * rng.gauss(0.0, 1.0) + off[c] for c in range(self.H)]
                    self.set_row(layer, kind, t, encode_floats(vals, self.dtype))
        return self


def plan_pages(num_layers, num_tokens, page_tokens):
    """The pages kvxfer_send cuts, in its order: layer by layer, K then V."""
    out = []
    for layer in range(num_layers):
        for kind in (kvxfer.KVKind.KEY, kvxfer.KVKind.VALUE):
            for t0 in range(0, num_tokens, page_tokens):
                out.append((layer, kind, t0, min(page_tokens, num_tokens - t0)))
    return out


def expected_decode(src, codec, page_tokens, tag, full=True):
    """What a receiver must hold: the codec's own encode + decode of each of
    src's pages (through kvxfer_page_encode / kvxfer_page_decode)."""
    out = HostKV(src.L, src.heads, src.hd, src.T, 64, src.dtype)
    for layer, kind, t0, n in plan_pages(src.L, src.T, page_tokens):
        pid = kvxfer.PageId(layer, kind, t0, tag)
        anchor, residual = kvxfer.encode_page(src.layout(layer, kind, t0, n), pid, codec)
        kvxfer.decode_page(out.layout(layer, kind, t0, n), anchor, residual if full else None,
                           expect=pid)
    return out


class Pool:
    """A runtime-style KV pool in host memory: per layer one K and one V
    bytearray of num_pages pages; page i of a layer starts at i * page_stride
    bytes (page_stride = page bytes + gap)."""

    def __init__(self, L, heads, hd, num_pages, page_size, dtype=0, gap=0):
        import ctypes
        self.L, self.heads, self.hd, self.H = L, heads, hd, heads * hd
        self.num_pages, self.page_size = num_pages, page_size
        self.dtype = kvxfer.Dtype(dtype)
        self.es = ITEMSIZE[self.dtype]
        self.page_stride = page_size * self.H * self.es + gap
        size = num_pages * self.page_stride
        self.k = [bytearray(b"\xa5" * size) for _ in range(L)]
        self.v = [bytearray(b"\xa5" * size) for _ in range(L)]
        self._c = [(ctypes.c_char * size).from_buffer(b) for b in self.k + self.v]
        self.k_ptrs = [ctypes.addressof(c) for c in self._c[:L]]
        self.v_ptrs = [ctypes.addressof(c) for c in self._c[L:]]

    def args(self):
        from kvxfer.connector import KVArgs
        return KVArgs(self.k_ptrs, self.v_ptrs, self.page_stride, self.page_size, self.heads,
                      self.hd, self.dtype, keep=self)

    def _span(self, pages, t):
        p = pages[t // self.page_size]
        lo = p * self.page_stride + (t % self.page_size) * self.H * self.es
        return lo, lo + self.H * self.es

    def rows(self, pages, layer, kind):
        buf = self.k[layer] if kvxfer.KVKind(kind) == kvxfer.KVKind.KEY else self.v[layer]
        out = bytearray()
        for t in range(len(pages) * self.page_size):
            lo, hi = self._span(pages, t)
            out += buf[lo:hi]
        return bytes(out)

    def fill_pages(self, pages, seed):
        rng = random.Random(seed)
        for layer in range(self.L):
            for buf in (self.k[layer], self.v[layer]):
                for t in range(len(pages) * self.page_size):
                    lo, hi = self._span(pages, t)
                    buf[lo:hi] = encode_floats([rng.gauss(0.0, 1.0) for _ in range(self.H)],
                                               self.dtype)
        return self


def block_ids(num_blocks, n, seed):
    """`n` distinct ids of [0, num_blocks), shuffled (a runtime's free list)."""
    return random.Random(seed).sample(range(num_blocks), n)


class FlashPool:
    """A host KV pool as vLLM's FlashAttention backend holds it: per layer one
    bytearray [2][num_blocks][block_size][heads * head_dim], K then V.  Unused
    bytes are 0xA5.  register() makes the kvxfer.KVPool over it."""

    def __init__(self, L, heads, hd, block_size, num_blocks, dtype=0):
        self.L, self.heads, self.hd, self.H = L, heads, hd, heads * hd
        self.bs, self.nblocks = block_size, num_blocks
        self.dtype = kvxfer.Dtype(dtype)
        self.es = ITEMSIZE[self.dtype]
        self.block_bytes = block_size * self.H * self.es
        self.layers = [bytearray(b"\xa5" * (2 * num_blocks * self.block_bytes))
                       for _ in range(L)]

    def register(self):
        return kvxfer.KVPool.from_layers(self.layers, block_size=self.bs, kv_heads=self.heads,
                                         head_dim=self.hd, dtype=self.dtype)

    def _span(self, kind, ids, t, h0, nh):
        kind = kvxfer.KVKind(kind)
        lo = (int(kind) * self.nblocks + ids[t // self.bs]) * self.block_bytes
        lo += (t % self.bs) * self.H * self.es + h0 * self.hd * self.es
        return lo, lo + nh * self.hd * self.es

    def put_layer(self, src, layer, ids, h0=0):
        """Layer `layer` of HostKV `src` into blocks `ids`, as heads [h0, h0 + src.heads)."""
        n = src.H * src.es
        for kind in (kvxfer.KVKind.KEY, kvxfer.KVKind.VALUE):
            rows = src.rows(layer, kind)
            for t in range(src.T):
                lo, hi = self._span(kind, ids, t, h0, src.heads)
                self.layers[layer][lo:hi] = rows[t * n:(t + 1) * n]

    def rows(self, layer, kind, ids, num_tokens, h0=0, nh=None):
        """Tokens [0, num_tokens) on blocks `ids`, heads [h0, h0 + nh), contiguous."""
        nh = self.heads - h0 if nh is None else nh
        out = bytearray()
        for t in range(num_tokens):
            lo, hi = self._span(kind, ids, t, h0, nh)
            out += self.layers[layer][lo:hi]
        return bytes(out)
