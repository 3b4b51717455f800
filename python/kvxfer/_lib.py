"""Finding and loading libkvxfer.so, and its function table (as vLLM's
pynccl_wrapper.py does for NCCL).

Search order (the first that applies wins):
  1. $KVXFER_LIBRARY: the path of the library.  When set it is the only place
     looked at; a path that does not load is an error (no silent fallback).
  2. libkvxfer.so or libkvxfer.so.0 next to this package (kvxfer/).
  3. the dynamic loader: ctypes.util.find_library("kvxfer"), then
     "libkvxfer.so.0" and "libkvxfer.so" through dlopen's own search
     (LD_LIBRARY_PATH, the ld.so cache, the default directories).

Every function returning kvxfer_result_t gets an errcheck that turns a
negative result into KvxferError.  The errcheck runs on the calling thread
right after the call returns, before any other kvxfer call on that thread,
so kvxfer_get_last_error() still holds the failing call's text.
"""

import ctypes
import ctypes.util
import os
import threading

from . import _abi
from ._abi import (
    ArrivalStruct,
    CodecConfigStruct,
    CommConfigStruct,
    EndpointConfigStruct,
    KVBlocksStruct,
    KVDescStruct,
    KVPoolDescStruct,
    PageIdStruct,
    PageInfoStruct,
    PageLayoutStruct,
    RequestConfigStruct,
    RequestInfoStruct,
    UniqueIdStruct,
)
from ._errors import KvxferError, LibraryNotFoundError

ENV_VAR = "KVXFER_LIBRARY"

_c_int_p = ctypes.POINTER(ctypes.c_int)
_size_t_p = ctypes.POINTER(ctypes.c_size_t)
_float_p = ctypes.POINTER(ctypes.c_float)
_void_p = ctypes.c_void_p
_result = ctypes.c_int  # kvxfer_result_t

# (name, restype, argtypes); every restype None here means kvxfer_result_t.
_FUNCTIONS = [
    ("kvxfer_get_error_string", ctypes.c_char_p, [_result]),
    ("kvxfer_get_last_error", ctypes.c_char_p, []),
    ("kvxfer_get_version", None, [_c_int_p]),
    ("kvxfer_page_max_size", None,
     [ctypes.POINTER(CodecConfigStruct), ctypes.c_int64, ctypes.c_int32, _size_t_p, _size_t_p]),
    ("kvxfer_page_encode", None,
     [ctypes.POINTER(CodecConfigStruct), ctypes.POINTER(PageIdStruct),
      ctypes.POINTER(PageLayoutStruct), _void_p, ctypes.c_size_t, _size_t_p, _void_p,
      ctypes.c_size_t, _size_t_p]),
    ("kvxfer_page_encode_tiered", None,
     [ctypes.POINTER(CodecConfigStruct), ctypes.POINTER(PageIdStruct),
      ctypes.POINTER(PageLayoutStruct), ctypes.POINTER(ctypes.c_uint8), _void_p,
      ctypes.c_size_t, _size_t_p, _void_p, ctypes.c_size_t, _size_t_p]),
    ("kvxfer_page_decode", None,
     [_void_p, ctypes.c_size_t, _void_p, ctypes.c_size_t, ctypes.POINTER(PageIdStruct),
      ctypes.POINTER(PageLayoutStruct)]),
    ("kvxfer_codec_calibrate_alpha", None,
     [ctypes.POINTER(CodecConfigStruct), ctypes.POINTER(PageLayoutStruct), ctypes.c_int32,
      _float_p]),
    ("kvxfer_page_inspect", None, [_void_p, ctypes.c_size_t, ctypes.POINTER(PageInfoStruct)]),
    ("kvxfer_get_unique_id", None, [ctypes.POINTER(UniqueIdStruct)]),
    # kvxfer_unique_id_t is passed by value, as ncclUniqueId to ncclCommInitRank.
    ("kvxfer_comm_init", None,
     [ctypes.POINTER(_abi.kvxfer_comm_t), ctypes.c_int, UniqueIdStruct, ctypes.c_int,
      ctypes.POINTER(CommConfigStruct)]),
    ("kvxfer_endpoint_create", None,
     [ctypes.POINTER(_abi.kvxfer_comm_t), ctypes.POINTER(EndpointConfigStruct)]),
    ("kvxfer_endpoint_address", None, [_abi.kvxfer_comm_t, _void_p, _size_t_p]),
    ("kvxfer_endpoint_connect", None, [_abi.kvxfer_comm_t, _void_p, ctypes.c_size_t, _c_int_p]),
    ("kvxfer_endpoint_disconnect", None, [_abi.kvxfer_comm_t, ctypes.c_int]),
    ("kvxfer_comm_abort", None, [_abi.kvxfer_comm_t]),
    ("kvxfer_comm_destroy", None, [_abi.kvxfer_comm_t]),
    ("kvxfer_comm_count", None, [_abi.kvxfer_comm_t, _c_int_p]),
    ("kvxfer_comm_user_rank", None, [_abi.kvxfer_comm_t, _c_int_p]),
    ("kvxfer_send", None,
     [_abi.kvxfer_comm_t, ctypes.c_int, ctypes.POINTER(KVDescStruct),
      ctypes.POINTER(CodecConfigStruct), ctypes.POINTER(RequestConfigStruct),
      ctypes.POINTER(_abi.kvxfer_request_t)]),
    ("kvxfer_recv", None,
     [_abi.kvxfer_comm_t, ctypes.c_int, ctypes.POINTER(KVDescStruct),
      ctypes.POINTER(RequestConfigStruct), ctypes.POINTER(_abi.kvxfer_request_t)]),
    ("kvxfer_send_layer_ready", None, [_abi.kvxfer_request_t, ctypes.c_int32]),
    ("kvxfer_kv_pool_register", None,
     [ctypes.POINTER(KVPoolDescStruct), ctypes.POINTER(_abi.kvxfer_kv_pool_t)]),
    ("kvxfer_kv_pool_deregister", None, [_abi.kvxfer_kv_pool_t]),
    ("kvxfer_send_blocks", None,
     [_abi.kvxfer_comm_t, ctypes.c_int, _abi.kvxfer_kv_pool_t, ctypes.POINTER(KVBlocksStruct),
      ctypes.POINTER(CodecConfigStruct), ctypes.POINTER(RequestConfigStruct),
      ctypes.POINTER(_abi.kvxfer_request_t)]),
    ("kvxfer_recv_blocks", None,
     [_abi.kvxfer_comm_t, ctypes.c_int, _abi.kvxfer_kv_pool_t, ctypes.POINTER(KVBlocksStruct),
      ctypes.POINTER(RequestConfigStruct), ctypes.POINTER(_abi.kvxfer_request_t)]),
    ("kvxfer_test", None, [_abi.kvxfer_request_t, _c_int_p]),
    ("kvxfer_wait", None, [_abi.kvxfer_request_t, ctypes.c_int, ctypes.c_int]),
    ("kvxfer_test_layer", None, [_abi.kvxfer_request_t, ctypes.c_int32, _c_int_p]),
    ("kvxfer_wait_layer", None,
     [_abi.kvxfer_request_t, ctypes.c_int32, ctypes.c_int, ctypes.c_int]),
    ("kvxfer_request_get_info", None,
     [_abi.kvxfer_request_t, ctypes.POINTER(RequestInfoStruct)]),
    ("kvxfer_request_get_arrivals", None,
     [_abi.kvxfer_request_t, ctypes.POINTER(ArrivalStruct), ctypes.c_size_t, _size_t_p]),
    ("kvxfer_request_get_tiers", None,
     [_abi.kvxfer_request_t, ctypes.POINTER(ctypes.c_uint8), ctypes.c_int64]),
    ("kvxfer_request_free", None, [_abi.kvxfer_request_t]),
    ("kvxfer_request_cancel", None, [_abi.kvxfer_request_t]),
]


def _candidates():
    """(description, path-or-name) pairs in search order, and whether the env var decided."""
    env = os.environ.get(ENV_VAR)
    if env:
        return [("%s=%s" % (ENV_VAR, env), env)], True
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    for name in ("libkvxfer.so", "libkvxfer.so.0"):
        p = os.path.join(here, name)
        if os.path.exists(p):
            out.append(("next to the package", p))
    found = ctypes.util.find_library("kvxfer")
    if found:
        out.append(("ctypes.util.find_library('kvxfer')", found))
    out.append(("the loader path", "libkvxfer.so.0"))
    out.append(("the loader path", "libkvxfer.so"))
    return out, False


def find_library():
    """Loads libkvxfer and returns the ctypes.CDLL; raises LibraryNotFoundError."""
    cands, from_env = _candidates()
    errors = []
    for where, path in cands:
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append("%s (%s): %s" % (path, where, e))
            last = e
    here = os.path.dirname(os.path.abspath(__file__))
    if from_env:
        msg = ("kvxfer: cannot load the library named by %s=%s (%s).  Set %s to the path of "
               "libkvxfer.so (e.g. build/src/libkvxfer.so), or unset it to search next to the "
               "package and on the loader path." % (ENV_VAR, cands[0][1], last, ENV_VAR))
    else:
        msg = ("kvxfer: libkvxfer.so not found.  Set %s to its path (e.g. "
               "build/src/libkvxfer.so), put it next to the package (%s), or add its directory "
               "to LD_LIBRARY_PATH.  Tried: %s" % (ENV_VAR, here, "; ".join(errors)))
    raise LibraryNotFoundError(msg)


class Library:
    """The loaded library: one attribute per kvxfer_* function."""

    def __init__(self, cdll):
        self.cdll = cdll
        self.path = getattr(cdll, "_name", "")
        missing = []
        for name, restype, argtypes in _FUNCTIONS:
            try:
                fn = getattr(cdll, name)
            except AttributeError:
                missing.append(name)
                continue
            fn.argtypes = argtypes
            if restype is None:
                fn.restype = _result
                fn.errcheck = self._errcheck
            else:
                fn.restype = restype
            setattr(self, name, _checked_ints(fn, argtypes))
        if missing:
            raise LibraryNotFoundError("kvxfer: %s lacks %s: not a compatible libkvxfer" %
                                       (self.path, ", ".join(missing)))
        self.tls = threading.local()

    def _errcheck(self, result, func, args):
        """Negative result -> KvxferError with the thread's last error text."""
        if result < 0:
            # Read at once, on this thread: the text lives until the next call.
            message = self.cdll.kvxfer_get_last_error()
            desc = self.cdll.kvxfer_get_error_string(result)
            raise KvxferError(result, _text(message), _text(desc), func.__name__)
        return result

    def error_string(self, code):
        return _text(self.kvxfer_get_error_string(int(code)))

    def version(self):
        v = ctypes.c_int(0)
        self.kvxfer_get_version(ctypes.byref(v))
        return v.value


def _checked_ints(fn, argtypes):
    """`fn`, or a wrapper that first checks each Python int passed for a C
    integer parameter against its type (_abi.check_int: ValueError naming the
    function and argument), where ctypes would keep its low bits."""
    ints = [(i, t) for i, t in enumerate(argtypes) if t in _abi._INT_TYPES]
    if not ints:
        return fn

    def call(*args):
        for i, t in ints:
            if i < len(args) and isinstance(args[i], int):
                _abi.check_int(args[i], t, "%s argument %d" % (fn.__name__, i + 1))
        return fn(*args)

    call.__name__ = fn.__name__
    return call


def _text(b):
    return b.decode("utf-8", "replace") if b else ""


def load():
    """Finds, loads and checks the library (struct sizes, version)."""
    _abi.check_layout()
    # (ctypes.CDLL caches its function objects, so the restypes set here are
    # the ones _errcheck's self.cdll.kvxfer_get_last_error uses.)
    lib = Library(find_library())
    try:
        version = lib.version()
    except KvxferError as e:
        raise ImportError("kvxfer: kvxfer_get_version failed in %s: %s" % (lib.path, e)) from e
    if version // 100 != _abi.HEADER_VERSION_CODE // 100:
        raise ImportError(
            "kvxfer: %s is version %d.%d.%d; this binding mirrors the %d.%d header and needs the "
            "same major and minor version" %
            (lib.path, version // 10000, version // 100 % 100, version % 100,
             _abi.HEADER_VERSION_CODE // 10000, _abi.HEADER_VERSION_CODE // 100 % 100))
    lib.version_code = version
    return lib
