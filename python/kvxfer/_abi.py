"""ctypes mirrors of include/kvxfer/kvxfer.h (enums, structs, callback type).

Every struct lists every field of its C counterpart, in order, with the C
type; C enums are `int`.  EXPECTED_SIZES holds sizeof() of each struct as
the C compiler lays it out on LP64 (x86-64, aarch64); check_layout() compares
them at import.  python/tests/test_abi.py also compares every field's offset
with offsetof() from a C program compiled against the header (abi_dump.c).

HEADER_VERSION_CODE is KVXFER_VERSION_CODE of the header these mirrors were
written from; it goes into the `version` field of every config struct, as the
C _INITIALIZER macros put the version of the header the caller compiled with.
"""

import ctypes
import enum
import operator

from ._errors import Result  # noqa: F401  (re-exported)

# KVXFER_MAJOR * 10000 + KVXFER_MINOR * 100 + KVXFER_PATCH of the header
# mirrored here (include/kvxfer/version.h.in, project(kvxfer VERSION 0.1.0)).
HEADER_VERSION_CODE = 100
CONFIG_MAGIC = 0x6B767866  # KVXFER_CONFIG_MAGIC, 'kvxf'
UNIQUE_ID_BYTES = 128  # KVXFER_UNIQUE_ID_BYTES
ENDPOINT_SECRET_BYTES = 32  # KVXFER_ENDPOINT_SECRET_BYTES
ENDPOINT_ADDRESS_MAX = 128  # KVXFER_ENDPOINT_ADDRESS_MAX
ALPHA_AUTO = -1.0  # KVXFER_ALPHA_AUTO
ANY_PEER = -1  # KVXFER_ANY_PEER: a send by request_id to whichever peer asks for it


class Dtype(enum.IntEnum):
    """kvxfer_dtype_t."""

    BF16 = 0
    FP16 = 1
    FP32 = 2

    @property
    def itemsize(self):
        return 4 if self is Dtype.FP32 else 2


class KVKind(enum.IntEnum):
    """kvxfer_kv_kind_t."""

    KEY = 0
    VALUE = 1


class Codec(enum.IntEnum):
    """kvxfer_codec_t."""

    LYNX = 0
    INT8 = 1
    INT4 = 2
    BF16 = 3
    SPECTRUM = 4  # SpectrumKV: per-token tiers (Request.tiers(), docs/SPECTRUMKV.md)


class Tier(enum.IntEnum):
    """kvxfer_tier_t: the SpectrumKV precision of one token."""

    FP16 = 0
    INT8 = 1
    INT4 = 2
    DROP = 3  # not transferred; decodes to 0 (mask it out of attention)


class NonfinitePolicy(enum.IntEnum):
    """kvxfer_nonfinite_policy_t."""

    ERROR = 0
    RAW = 1


class ValueGroups(enum.IntEnum):
    """kvxfer_value_groups_t."""

    CHANNEL = 0
    TOKEN = 1
    AUTO = 2


class Stage(enum.IntEnum):
    """kvxfer_stage_t; ERROR is final and may follow any other."""

    POSTED = 0
    ANCHOR_READY = 1
    COMPLETE = 2
    ERROR = 3


class Mode(enum.IntEnum):
    """kvxfer_mode_t."""

    AUTO = 0
    PROGRESSIVE = 1
    MONOLITHIC = 2


_c_enum = ctypes.c_int
_size_t = ctypes.c_size_t

kvxfer_comm_t = ctypes.c_void_p  # struct kvxfer_comm*
kvxfer_request_t = ctypes.c_void_p  # struct kvxfer_request*
kvxfer_kv_pool_t = ctypes.c_void_p  # struct kvxfer_kv_pool*

# typedef void (*kvxfer_callback_t)(kvxfer_request_t, kvxfer_stage_t,
#                                   kvxfer_result_t, void* user_data);
CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, _c_enum, _c_enum, ctypes.c_void_p)


_INT_TYPES = (ctypes.c_int8, ctypes.c_uint8, ctypes.c_int16, ctypes.c_uint16, ctypes.c_int32,
              ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t)


def int_range(ctype):
    """(name, least, greatest) of a C integer type: ("int32", -2**31, 2**31 - 1)."""
    bits = 8 * ctypes.sizeof(ctype)
    if ctype(-1).value < 0:
        return "int%d" % bits, -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return "uint%d" % bits, 0, (1 << bits) - 1


def as_int(value, what):
    """`value` as a Python int (operator.index: ints, bools, NumPy integers);
    a float or a string is a TypeError naming `what`."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError("%s must be an integer, not %s" % (what, type(value).__name__)) from None


def check_int(value, ctype, what):
    """`value` as a Python int (as_int) that fits the C integer type `ctype`.
    ctypes itself would keep the low bits (2**32 becomes 0 in an int32).
    Raises ValueError naming `what` for a value out of the type's range."""
    v = as_int(value, what)
    name, lo, hi = int_range(ctype)
    if not lo <= v <= hi:
        raise ValueError("%s = %d does not fit its C type %s (%d..%d)" % (what, v, name, lo, hi))
    return v


class _Struct(ctypes.Structure):
    """A struct mirror whose integer fields refuse values their C type cannot
    hold (check_int) instead of truncating them."""

    _int_fields = None  # per class: {field name: ctype}

    def __setattr__(self, name, value):
        cls = type(self)
        if cls.__dict__.get("_int_fields") is None:
            cls._int_fields = {f[0]: f[1] for f in cls._fields_ if f[1] in _INT_TYPES}
        t = cls._int_fields.get(name)
        if t is not None and not isinstance(value, ctypes._SimpleCData):
            value = check_int(value, t, "%s.%s" % (_C_NAMES.get(cls, cls.__name__), name))
        super().__setattr__(name, value)


class CodecConfigStruct(_Struct):
    """kvxfer_codec_config_t."""

    _fields_ = [
        ("size", _size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("codec", _c_enum),
        ("alpha", ctypes.c_float),
        ("chunk_tokens", ctypes.c_int32),
        ("anchor_bits", ctypes.c_int32),
        ("nonfinite", _c_enum),
        ("sink_tokens", ctypes.c_int32),
        ("value_groups", _c_enum),
    ]


class PageLayoutStruct(_Struct):
    """kvxfer_page_layout_t."""

    _fields_ = [
        ("blocks", ctypes.POINTER(ctypes.c_void_p)),
        ("num_blocks", ctypes.c_int64),
        ("block_size", ctypes.c_int32),
        ("row_stride", ctypes.c_int64),
        ("first_token", ctypes.c_int64),
        ("num_tokens", ctypes.c_int64),
        ("num_channels", ctypes.c_int32),
        ("dtype", _c_enum),
    ]


class PageIdStruct(_Struct):
    """kvxfer_page_id_t."""

    _fields_ = [
        ("layer", ctypes.c_uint32),
        ("kind", _c_enum),
        ("token_begin", ctypes.c_int64),
        ("stream_id", ctypes.c_uint64),
    ]


class PageInfoStruct(_Struct):
    """kvxfer_page_info_t."""

    _fields_ = [
        ("is_residual", ctypes.c_int32),
        ("codec", _c_enum),
        ("raw_fallback", ctypes.c_int32),
        ("alpha", ctypes.c_float),
        ("chunk_tokens", ctypes.c_int32),
        ("anchor_bits", ctypes.c_int32),
        ("residual_bits", ctypes.c_int32),
        ("src_dtype", _c_enum),
        ("meta_fp32", ctypes.c_int32),
        ("id", PageIdStruct),
        ("num_tokens", ctypes.c_int64),
        ("num_channels", ctypes.c_int32),
        ("section_bytes", _size_t),
    ]


class UniqueIdStruct(_Struct):
    """kvxfer_unique_id_t (passed by value to kvxfer_comm_init)."""

    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class CommConfigStruct(_Struct):
    """kvxfer_comm_config_t."""

    _fields_ = [
        ("size", _size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_int32),
        ("bind_address", ctypes.c_char_p),
        ("rate_limit", ctypes.c_char_p),
    ]


class EndpointConfigStruct(_Struct):
    """kvxfer_endpoint_config_t."""

    _fields_ = [
        ("size", _size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_int32),
        ("port", ctypes.c_int32),
        ("bind_address", ctypes.c_char_p),
        ("rate_limit", ctypes.c_char_p),
        ("secret", ctypes.POINTER(ctypes.c_uint8)),
    ]


class KVDescStruct(_Struct):
    """kvxfer_kv_desc_t."""

    _fields_ = [
        ("size", _size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("num_layers", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("dtype", _c_enum),
        ("num_tokens", ctypes.c_int64),
        ("block_size", ctypes.c_int32),
        ("row_stride", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("k_blocks", ctypes.POINTER(ctypes.c_void_p)),
        ("v_blocks", ctypes.POINTER(ctypes.c_void_p)),
        ("device", ctypes.c_int32),  # -1 host memory; >= 0 CUDA ordinal
    ]


class RequestConfigStruct(_Struct):
    """kvxfer_request_config_t."""

    _fields_ = [
        ("size", _size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("tag", ctypes.c_uint64),
        ("mode", _c_enum),
        ("page_tokens", ctypes.c_int32),
        ("on_anchor_ready", CALLBACK),
        ("on_complete", CALLBACK),
        ("user_data", ctypes.c_void_p),
        ("stream_layers", ctypes.c_int32),  # sender only: 1 = kvxfer_send_layer_ready per layer
        ("match_by_id", ctypes.c_int32),  # 1: match the peer's request with the same request_id
        ("request_id", ctypes.c_uint64),
        ("claim_timeout_ms", ctypes.c_int32),  # sender to ANY_PEER: 0 = the communicator's
    ]


class KVPoolDescStruct(_Struct):
    """kvxfer_kv_pool_desc_t."""

    _fields_ = [
        ("size", _size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("num_layers", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("dtype", _c_enum),
        ("block_size", ctypes.c_int32),
        ("num_blocks", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),  # elements; 0 = kv_heads * head_dim
        ("block_stride", ctypes.c_int64),  # bytes; 0 = block_size * row_stride * element
        ("k_layers", ctypes.POINTER(ctypes.c_void_p)),  # void* const* [num_layers]
        ("v_layers", ctypes.POINTER(ctypes.c_void_p)),
        ("device", ctypes.c_int32),  # -1 host memory; >= 0 CUDA ordinal
    ]


class KVBlocksStruct(_Struct):
    """kvxfer_kv_blocks_t."""

    _fields_ = [
        ("size", _size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("num_tokens", ctypes.c_int64),
        ("block_ids", ctypes.POINTER(ctypes.c_int32)),  # const int32_t* [num_block_ids]
        ("num_block_ids", ctypes.c_int64),
        ("head_begin", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),  # 0 = every head from head_begin
    ]


class RequestInfoStruct(_Struct):
    """kvxfer_request_info_t."""

    _fields_ = [
        ("size", _size_t),
        ("magic", ctypes.c_uint32),
        ("version", ctypes.c_uint32),
        ("stage", _c_enum),
        ("result", _c_enum),
        ("is_send", ctypes.c_int32),
        ("peer", ctypes.c_int32),
        ("codec", _c_enum),
        ("mode", _c_enum),
        ("num_pages", ctypes.c_int64),
        ("pages_anchor_ready", ctypes.c_int64),
        ("pages_complete", ctypes.c_int64),
        ("kv_bytes", ctypes.c_uint64),
        ("anchor_wire_bytes", ctypes.c_uint64),
        ("residual_wire_bytes", ctypes.c_uint64),
        ("t_posted_ns", ctypes.c_int64),
        ("t_handshake_ns", ctypes.c_int64),
        ("t_anchor_ready_ns", ctypes.c_int64),
        ("t_complete_ns", ctypes.c_int64),
        ("t_error_ns", ctypes.c_int64),
        ("t_first_residual_ns", ctypes.c_int64),
    ]


class ArrivalStruct(_Struct):
    """kvxfer_arrival_t."""

    _fields_ = [
        ("t_ns", ctypes.c_int64),
        ("traffic_class", ctypes.c_int32),
        ("layer", ctypes.c_int32),
        ("bytes", ctypes.c_uint64),
    ]


# sizeof() of each struct with the C layout rules of LP64 (x86-64 System V):
# 8-byte size_t, pointers and int64, 4-byte enums, natural alignment.
EXPECTED_SIZES = {
    "kvxfer_codec_config_t": (CodecConfigStruct, 48),
    "kvxfer_page_layout_t": (PageLayoutStruct, 56),
    "kvxfer_page_id_t": (PageIdStruct, 24),
    "kvxfer_page_info_t": (PageInfoStruct, 88),
    "kvxfer_unique_id_t": (UniqueIdStruct, 128),
    "kvxfer_comm_config_t": (CommConfigStruct, 40),
    "kvxfer_endpoint_config_t": (EndpointConfigStruct, 48),
    "kvxfer_kv_desc_t": (KVDescStruct, 88),
    "kvxfer_request_config_t": (RequestConfigStruct, 80),
    "kvxfer_request_info_t": (RequestInfoStruct, 136),
    "kvxfer_arrival_t": (ArrivalStruct, 24),
    "kvxfer_kv_pool_desc_t": (KVPoolDescStruct, 88),
    "kvxfer_kv_blocks_t": (KVBlocksStruct, 48),
}


# The C name of each mirror, for _Struct's messages.
_C_NAMES = {struct: cname for cname, (struct, _) in EXPECTED_SIZES.items()}


def check_layout():
    """Raises ImportError unless every mirror has the size the C header gives it.

    Only LP64 platforms are checked (and supported): the sizes above assume
    8-byte pointers and size_t and 4-byte enums.
    """
    if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
        raise ImportError("kvxfer's Python binding supports 64-bit (LP64) platforms only")
    if ctypes.sizeof(ctypes.c_int) != 4:
        raise ImportError("kvxfer's Python binding assumes 4-byte C enums (int)")
    bad = []
    for cname, (struct, want) in EXPECTED_SIZES.items():
        got = ctypes.sizeof(struct)
        if got != want:
            bad.append("%s: ctypes %d bytes, C %d" % (cname, got, want))
    if bad:
        raise ImportError("kvxfer: ctypes struct mirrors do not match the C layout: " +
                          "; ".join(bad))


def init_config(struct_type):
    """A struct with every field set as its C _INITIALIZER macro sets it
    (size/magic/version, and the non-zero defaults)."""
    s = struct_type()
    s.size = ctypes.sizeof(struct_type)
    s.magic = CONFIG_MAGIC
    s.version = HEADER_VERSION_CODE
    if struct_type is CodecConfigStruct:
        s.codec, s.alpha, s.chunk_tokens, s.anchor_bits = Codec.LYNX, 0.0, 32, 4
        s.nonfinite = NonfinitePolicy.ERROR
        s.sink_tokens = 1
        s.value_groups = ValueGroups.CHANNEL
    elif struct_type is KVDescStruct or struct_type is KVPoolDescStruct:
        s.dtype, s.device = Dtype.BF16, -1
    elif struct_type is RequestConfigStruct:
        s.mode = Mode.AUTO
    elif struct_type is RequestInfoStruct:
        s.stage, s.result = Stage.POSTED, Result.IN_PROGRESS
    return s
