"""Stand-ins for what vLLM hands a KV connector, for tests without vLLM:
KV-cache tensors of vLLM 0.33's layout and their contents."""

import ctypes
import random
import struct


class FakeTensor:
    """One attention layer's KV cache as vLLM 0.33 gives it on the CPU with
    the LBHNC layout: [num_blocks, kv_heads, block_size, 2 * head_size] bf16,
    contiguous (vllm/v1/kv_cache_interface.py); torch's accessors only."""

    dtype = "torch.bfloat16"

    def __init__(self, num_blocks, heads, block_size, head_size):
        self.shape = (num_blocks, heads, block_size, 2 * head_size)
        self.buf = bytearray(num_blocks * heads * block_size * 2 * head_size * 2)
        self._c = (ctypes.c_char * len(self.buf)).from_buffer(self.buf)

    def data_ptr(self):
        return ctypes.addressof(self._c)

    def stride(self):
        _, h, n, c = self.shape
        return (h * n * c, n * c, c, 1)

    @staticmethod
    def element_size():
        return 2

    def row(self, block, head, token, kind):
        """The bytes of K (kind 0) or V (kind 1) of one token of one head."""
        s0, s1, s2, _ = self.stride()
        hd = self.shape[3] // 2
        lo = 2 * (block * s0 + head * s1 + token * s2 + kind * hd)
        return bytes(self.buf[lo:lo + 2 * hd])

    def set_row(self, block, head, token, kind, data):
        s0, s1, s2, _ = self.stride()
        hd = self.shape[3] // 2
        lo = 2 * (block * s0 + head * s1 + token * s2 + kind * hd)
        self.buf[lo:lo + 2 * hd] = data


def caches(layers, num_blocks, heads, block_size, head_size):
    """{vLLM layer name: FakeTensor} of `layers` layers, named in a shuffled
    order as a dict may give them."""
    names = ["model.layers.%d.self_attn.attn" % i for i in range(layers)]
    random.Random(layers).shuffle(names)
    return {n: FakeTensor(num_blocks, heads, block_size, head_size) for n in names}


def by_layer(kv_caches):
    return [kv_caches["model.layers.%d.self_attn.attn" % i] for i in range(len(kv_caches))]


def bf16_row(rng, n):
    """n finite bf16 values (the high halves of float32s in [-4, 4))."""
    return b"".join(struct.pack("<f", rng.uniform(-4, 4))[2:] for _ in range(n))


def fill(kv_caches, block_ids, num_tokens, seed):
    """Writes a request's KV (seeded) at its block ids, every layer and head."""
    rng = random.Random(seed)
    for t in by_layer(kv_caches):
        nb, heads, bs, c = t.shape
        for tok in range(num_tokens):
            for h in range(heads):
                for kind in (0, 1):
                    t.set_row(block_ids[tok // bs], h, tok % bs, kind, bf16_row(rng, c // 2))


def rows(kv_caches, block_ids, num_tokens):
    """A request's KV read back from its block ids, in fill()'s order."""
    out = []
    for t in by_layer(kv_caches):
        _, heads, bs, _ = t.shape
        for tok in range(num_tokens):
            for h in range(heads):
                for kind in (0, 1):
                    out.append(t.row(block_ids[tok // bs], h, tok % bs, kind))
    return out
