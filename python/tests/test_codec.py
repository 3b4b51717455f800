"""The page codec through the binding (one process), and the kinds of memory
the binding accepts."""

import array
import ctypes
import math

import pytest

import kvxfer
from kvxfer import Dtype, KVKind, Result

import kvdata


def test_encode_decode_round_trip_and_inspect():
    src = kvdata.HostKV(1, 2, 32, 100, 16, Dtype.BF16, pad=4).fill(3)
    pid = kvxfer.PageId(0, KVKind.VALUE, 0, 77)
    anchor, residual = kvxfer.encode_page(src.layout(0, KVKind.VALUE), pid)
    amax, rmax = kvxfer.page_max_size(100, 64)
    assert 0 < len(anchor) <= amax and 0 < len(residual) <= rmax
    ai = kvxfer.inspect_page(anchor)
    ri = kvxfer.inspect_page(residual)
    assert not ai.is_residual and ri.is_residual
    assert ai.codec == kvxfer.Codec.LYNX and ai.anchor_bits == 4 and ai.residual_bits == 4
    assert ai.id == pid and ai.num_tokens == 100 and ai.num_channels == 64
    assert ai.section_bytes == len(anchor) and ai.src_dtype == Dtype.BF16

    full = kvdata.HostKV(1, 2, 32, 100, 7, Dtype.FP32)
    kvxfer.decode_page(full.layout(0, KVKind.VALUE), anchor, residual, expect=pid)
    approx = kvdata.HostKV(1, 2, 32, 100, 64, Dtype.FP32)
    kvxfer.decode_page(approx.layout(0, KVKind.VALUE), anchor)
    x = kvdata.decode_floats(src.rows(0, KVKind.VALUE), Dtype.BF16)
    y = kvdata.decode_floats(full.rows(0, KVKind.VALUE), Dtype.FP32)
    z = kvdata.decode_floats(approx.rows(0, KVKind.VALUE), Dtype.FP32)
    ef = math.sqrt(sum((a - b) ** 2 for a, b in zip(x, y)) / len(x))
    ea = math.sqrt(sum((a - b) ** 2 for a, b in zip(x, z)) / len(x))
    assert ef < ea  # the residual improves on the anchor
    assert ef < 0.05 and ea < 0.5

    with pytest.raises(kvxfer.KvxferError) as e:  # another page's identity
        kvxfer.decode_page(full.layout(0, KVKind.VALUE), anchor, residual,
                           expect=kvxfer.PageId(1, KVKind.VALUE, 0, 77))
    assert e.value.code == Result.ERR_MISMATCH
    bad = bytearray(anchor)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(kvxfer.KvxferError) as e:
        kvxfer.inspect_page(bad)
    assert e.value.code == Result.ERR_CORRUPT and "checksum" in e.value.message


def test_a_page_id_that_is_not_one_is_a_type_error_naming_it():
    src = kvdata.HostKV(1, 1, 16, 40, 16, Dtype.FP32).fill(1)
    for bad in (0, "0", None.__class__):
        with pytest.raises(TypeError, match="page_id: a PageId"):
            kvxfer.encode_page(src.layout(0, KVKind.KEY), bad)


def test_nonfinite_is_rejected_naming_the_element():
    src = kvdata.HostKV(1, 1, 16, 40, 16, Dtype.FP32).fill(1)
    row = kvdata.decode_floats(src.rows(0, KVKind.KEY)[17 * 64:18 * 64], Dtype.FP32)
    row[5] = float("nan")
    src.set_row(0, KVKind.KEY, 17, kvdata.encode_floats(row, Dtype.FP32))
    with pytest.raises(kvxfer.KvxferError) as e:
        kvxfer.encode_page(src.layout(0, KVKind.KEY), kvxfer.PageId(2, KVKind.KEY, 0, 0))
    assert e.value.code == Result.ERR_NONFINITE
    assert "NaN at layer 2 K, token 17, channel 5" in e.value.message
    # The RAW policy stores it losslessly instead.
    a, r = kvxfer.encode_page(src.layout(0, KVKind.KEY), (2, KVKind.KEY, 0, 0),
                              kvxfer.CodecConfig(nonfinite="raw"))
    assert kvxfer.inspect_page(a).raw_fallback


def test_value_groups_token_and_auto():
    """V pages grouped per token (docs/FORMAT.md 2.8) decode close to the
    input; a name or the enum both work, and an unknown name is refused."""
    src = kvdata.HostKV(1, 2, 32, 100, 16, Dtype.BF16, pad=4).fill(5)
    pid = kvxfer.PageId(0, KVKind.VALUE, 0, 1)
    x = kvdata.decode_floats(src.rows(0, KVKind.VALUE), Dtype.BF16)
    for groups in ("token", kvxfer.ValueGroups.AUTO):
        cfg = kvxfer.CodecConfig(value_groups=groups)
        anchor, residual = kvxfer.encode_page(src.layout(0, KVKind.VALUE), pid, cfg)
        amax, rmax = kvxfer.page_max_size(100, 64, cfg)
        assert len(anchor) <= amax and len(residual) <= rmax
        full = kvdata.HostKV(1, 2, 32, 100, 7, Dtype.FP32)
        kvxfer.decode_page(full.layout(0, KVKind.VALUE), anchor, residual, expect=pid)
        y = kvdata.decode_floats(full.rows(0, KVKind.VALUE), Dtype.FP32)
        assert math.sqrt(sum((a - b) ** 2 for a, b in zip(x, y)) / len(x)) < 0.05
    with pytest.raises(ValueError):
        kvxfer.CodecConfig(value_groups="rows")


def test_memory_kinds():
    """bytearray, array.array, ctypes arrays, raw int addresses and bytes
    (read-only: encode only) all work as blocks."""
    src = kvdata.HostKV(1, 1, 8, 16, 16, Dtype.FP32).fill(4)
    raw = bytes(src.k[0][0])
    n = len(raw)
    as_array = array.array("f", raw)
    as_ctypes = (ctypes.c_char * n).from_buffer_copy(raw)
    holder = ctypes.create_string_buffer(raw, n)
    as_int = ctypes.addressof(holder)
    results = []
    for blk in (bytearray(raw), as_array, as_ctypes, as_int, raw, memoryview(bytearray(raw))):
        lay = kvxfer.PageLayout([blk], block_size=16, num_tokens=16, num_channels=8,
                                dtype=Dtype.FP32)
        results.append(kvxfer.encode_page(lay, (0, KVKind.KEY, 0, 0)))
    assert all(r == results[0] for r in results)
    ro = kvxfer.PageLayout([raw], block_size=16, num_tokens=16, num_channels=8, dtype="fp32")
    with pytest.raises(ValueError):
        kvxfer.decode_page(ro, *results[0])
    with pytest.raises(ValueError):  # too small for 16 rows of 8 floats
        kvxfer.PageLayout([bytearray(100)], block_size=16, num_tokens=16, num_channels=8,
                          dtype="fp32")
    with pytest.raises(ValueError):  # not contiguous
        kvxfer.PageLayout([memoryview(bytearray(2 * n))[::2]], block_size=16, num_tokens=16,
                          num_channels=8, dtype="fp32")
    with pytest.raises(TypeError):
        kvxfer.PageLayout(["nope"], block_size=16, num_tokens=16, num_channels=8)


class FakeTensor:
    """Enough of torch.Tensor's surface (data_ptr, device, ...) for the binding."""

    def __init__(self, buf, device="cpu", contiguous=True):
        self._c = (ctypes.c_char * len(buf)).from_buffer(buf)
        self._n = len(buf)
        kind, _, index = device.partition(":")
        self.device = type("Device", (), {"type": kind, "index": int(index) if index else None})()
        self._contig = contiguous

    def data_ptr(self):
        return ctypes.addressof(self._c)

    def is_contiguous(self):
        return self._contig

    def numel(self):
        return self._n // 4

    def element_size(self):
        return 4


def test_tensor_like_objects():
    src = kvdata.HostKV(1, 1, 8, 16, 16, Dtype.FP32).fill(6)
    want = kvxfer.encode_page(src.layout(0, KVKind.KEY), (0, KVKind.KEY, 0, 0))
    t = FakeTensor(bytearray(src.k[0][0]))
    lay = kvxfer.PageLayout([t], block_size=16, num_tokens=16, num_channels=8, dtype="fp32")
    assert kvxfer.encode_page(lay, (0, KVKind.KEY, 0, 0)) == want
    with pytest.raises(ValueError, match="host memory"):
        kvxfer.PageLayout([FakeTensor(bytearray(512), device="cuda")], block_size=16,
                          num_tokens=16, num_channels=8, dtype="fp32")
    with pytest.raises(ValueError, match="contiguous"):
        kvxfer.PageLayout([FakeTensor(bytearray(512), contiguous=False)], block_size=16,
                          num_tokens=16, num_channels=8, dtype="fp32")


def test_descriptor_validation():
    kv = kvdata.HostKV(2, 1, 8, 40, 16)
    d = kv.descriptor()
    assert d.num_blocks == 3 and d.num_tokens == 40 and d.kv_bytes == 2 * 2 * 40 * 8 * 2
    with pytest.raises(ValueError, match="cannot hold"):
        kvxfer.KVDescriptor(kv.k, kv.v, num_layers=2, kv_heads=1, head_dim=8, block_size=16,
                            num_tokens=49)
    with pytest.raises(ValueError, match="row_stride"):
        kvxfer.KVDescriptor(kv.k, kv.v, num_layers=2, kv_heads=1, head_dim=8, block_size=16,
                            row_stride=4)
    with pytest.raises(ValueError, match="per-layer"):
        kvxfer.KVDescriptor(kv.k, kv.v, num_layers=3, kv_heads=1, head_dim=8, block_size=16)
    flat = kvxfer.KVDescriptor([b for layer in kv.k for b in layer],
                               [b for layer in kv.v for b in layer], num_layers=2, kv_heads=1,
                               head_dim=8, block_size=16, num_tokens=40)
    assert flat.num_blocks == 3
    pool = kvdata.Pool(2, 1, 8, num_pages=10, page_size=16, gap=32)
    p = kvxfer.KVDescriptor.from_pool(pool.k_ptrs, pool.v_ptrs, [9, 0, 4],
                                      page_stride=pool.page_stride, kv_heads=1, head_dim=8,
                                      page_size=16, keep=pool)
    blocks = ctypes.cast(p._desc.k_blocks, ctypes.POINTER(ctypes.c_void_p))
    assert blocks[0] == pool.k_ptrs[0] + 9 * pool.page_stride
    assert blocks[3 + 2] == pool.k_ptrs[1] + 4 * pool.page_stride
    assert p.num_tokens == 48


def test_calibrate_alpha():
    src = kvdata.HostKV(1, 2, 16, 64, 64, Dtype.FP32).fill(8)
    alpha = kvxfer.calibrate_alpha([src.layout(0, KVKind.KEY), src.layout(0, KVKind.VALUE)])
    assert alpha in (0, 1, 2, 5, 10, 20, 50, 100, 255)


def test_device_descriptor_takes_device_addresses_only():
    host = kvdata.HostKV(1, 1, 8, 16, 16)
    assert host.descriptor()._desc.device == -1
    d = kvxfer.KVDescriptor([[0x7f0000001000]], [[0x7f0000002000]], num_layers=1, kv_heads=1,
                            head_dim=8, block_size=16, num_tokens=16, device=0)
    assert d._desc.device == 0
    with pytest.raises(TypeError, match="device 0"):
        kvxfer.KVDescriptor(host.k, host.v, num_layers=1, kv_heads=1, head_dim=8, block_size=16,
                            device=0)
    with pytest.raises(ValueError, match="cuda:1"):
        kvxfer.KVDescriptor([[FakeTensor(bytearray(256), device="cuda:0")]],
                            [[FakeTensor(bytearray(256), device="cuda:0")]], num_layers=1,
                            kv_heads=1, head_dim=8, block_size=16, device=1)
