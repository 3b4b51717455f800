"""The ctypes mirrors against the C compiler's view of kvxfer.h.

$KVXFER_ABI_DUMP names the kvxfer_abi_dump program (abi_dump.c, built by
python/CMakeLists.txt); without it only the Python-side checks run.
"""

import ctypes
import json
import os
import subprocess

import pytest

import kvxfer
from kvxfer import _abi


@pytest.fixture(scope="module")
def dump():
    exe = os.environ.get("KVXFER_ABI_DUMP")
    if not exe:
        pytest.skip("KVXFER_ABI_DUMP not set (ctest sets it)")
    return json.loads(subprocess.run([exe], check=True, capture_output=True, text=True,
                                     timeout=30).stdout)


def test_sizes_match_the_lp64_layout():
    _abi.check_layout()  # what import does
    for cname, (struct, want) in _abi.EXPECTED_SIZES.items():
        assert ctypes.sizeof(struct) == want, cname


def test_every_field_offset_matches_c(dump):
    structs = dump["structs"]
    assert set(structs) == set(_abi.EXPECTED_SIZES)
    for cname, (struct, size) in _abi.EXPECTED_SIZES.items():
        c = structs[cname]
        assert c["sizeof"] == ctypes.sizeof(struct) == size, cname
        py_fields = [f[0] for f in struct._fields_]
        assert py_fields == list(c["fields"]), cname  # every field, in order
        for name, off in c["fields"].items():
            assert getattr(struct, name).offset == off, (cname, name)


def test_enums_and_constants_match_c(dump):
    enums = dump["enums"]
    groups = [("KVXFER_", kvxfer.Result), ("KVXFER_DTYPE_", kvxfer.Dtype),
              ("KVXFER_KV_", kvxfer.KVKind), ("KVXFER_CODEC_", kvxfer.Codec),
              ("KVXFER_NONFINITE_", kvxfer.NonfinitePolicy), ("KVXFER_STAGE_", kvxfer.Stage),
              ("KVXFER_MODE_", kvxfer.Mode), ("KVXFER_TIER_", kvxfer.Tier),
              ("KVXFER_VALUE_GROUPS_", kvxfer.ValueGroups)]
    seen = set()
    for prefix, enum_type in groups:
        for m in enum_type:
            cname = prefix + m.name
            assert enums[cname] == int(m), cname
            seen.add(cname)
    assert set(enums) - seen == {"KVXFER_RESULT_MIN"}
    assert min(kvxfer.Result) == enums["KVXFER_RESULT_MIN"]
    k = dump["constants"]
    assert k["KVXFER_CONFIG_MAGIC"] == kvxfer.CONFIG_MAGIC
    assert k["KVXFER_VERSION_CODE"] == kvxfer.HEADER_VERSION_CODE == kvxfer.get_version()
    assert k["KVXFER_UNIQUE_ID_BYTES"] == kvxfer.UNIQUE_ID_BYTES
    assert k["KVXFER_ALPHA_AUTO"] == kvxfer.ALPHA_AUTO
    assert k["enum_size"] == ctypes.sizeof(ctypes.c_int)
    assert k["KVXFER_ENDPOINT_SECRET_BYTES"] == _abi.ENDPOINT_SECRET_BYTES
    assert k["KVXFER_ENDPOINT_ADDRESS_MAX"] == _abi.ENDPOINT_ADDRESS_MAX


def test_initializers_match_the_c_macros(dump):
    init = dump["initializers"]
    c = kvxfer.CodecConfig()._struct()
    for f, v in init["kvxfer_codec_config_t"].items():
        assert getattr(c, f) == v, f
    comm = _abi.init_config(_abi.CommConfigStruct)
    ep = _abi.init_config(_abi.EndpointConfigStruct)
    kv = _abi.init_config(_abi.KVDescStruct)
    rc = _abi.init_config(_abi.RequestConfigStruct)
    pool = _abi.init_config(_abi.KVPoolDescStruct)
    blocks = _abi.init_config(_abi.KVBlocksStruct)
    for name, s in (("kvxfer_comm_config_t", comm), ("kvxfer_endpoint_config_t", ep),
                    ("kvxfer_kv_desc_t", kv),
                    ("kvxfer_request_config_t", rc), ("kvxfer_kv_pool_desc_t", pool),
                    ("kvxfer_kv_blocks_t", blocks)):
        # Every field of the struct is in the dump (the macro sets each one).
        assert list(init[name]) == [f[0] for f in type(s)._fields_], name
        for f, v in init[name].items():
            got = getattr(s, f)
            if f in ("bind_address", "rate_limit", "secret", "k_blocks", "v_blocks", "on_anchor_ready",
                     "on_complete", "user_data", "k_layers", "v_layers", "block_ids"):
                got = 1 if got else 0
            assert got == v, (name, f)
    assert init["kvxfer_kv_pool_desc_t"]["device"] == -1
    ri = _abi.init_config(_abi.RequestInfoStruct)
    for f, v in init["kvxfer_request_info_t"].items():
        assert getattr(ri, f) == v, ("kvxfer_request_info_t", f)


def test_version():
    v = kvxfer.get_version()
    assert v // 100 == kvxfer.HEADER_VERSION_CODE // 100
    assert kvxfer.__version__.split(".")[:2] == [str(v // 10000), str(v // 100 % 100)]
    assert kvxfer.library_path()
