"""Host addresses of the things a caller may pass as KV memory.

Accepted, in this order:
  - an int: a raw address (the caller guarantees size and lifetime);
  - a ctypes object (array, structure, c_void_p);
  - an object with data_ptr() (a PyTorch tensor; never imported here): it must
    be on the CPU and contiguous;
  - a buffer-protocol object (bytearray, array.array, mmap, memoryview,
    numpy arrays): C-contiguous; writable unless it is `bytes` (send only);
  - an object with __array_interface__ (a read-only numpy array, send only).
The object is returned as `keep`: the caller must hold it for as long as the
library may read or write the memory.
"""

import ctypes


class Memory:
    __slots__ = ("address", "nbytes", "readonly", "keep", "itemsize")

    def __init__(self, address, nbytes, readonly, keep, itemsize=None):
        self.address = address  # int, non-zero
        self.nbytes = nbytes  # int, or None when unknown (raw addresses)
        self.readonly = readonly
        self.keep = keep
        # Bytes per element of a typed array or tensor (NumPy float64: 8);
        # None for raw addresses, ctypes objects and 1-byte elements (bytes).
        self.itemsize = itemsize if itemsize != 1 else None


def _device_of(t):
    dev = getattr(t, "device", None)
    kind = getattr(dev, "type", None)
    if kind is None and dev is not None:
        kind = str(dev).split(":")[0]
    return kind


def memory_of(obj, what="buffer", device=-1):
    """Memory for `obj`; TypeError or ValueError when it cannot be used.

    device >= 0: `obj` must be a CUDA address of that device (an int, or a
    tensor on it); host buffers are refused.
    """
    if isinstance(obj, bool):
        raise TypeError("%s: a bool is not an address" % what)
    if isinstance(obj, int):
        if obj <= 0 or obj >= 1 << 64:  # ctypes would keep the low 64 bits
            raise ValueError("%s: address %#x is NULL, negative or wider than 64 bits" %
                             (what, obj))
        return Memory(obj, None, False, None)
    if isinstance(obj, ctypes.c_void_p):
        if not obj.value:
            raise ValueError("%s: NULL c_void_p" % what)
        return Memory(obj.value, None, False, None)
    data_ptr = getattr(obj, "data_ptr", None)
    if device >= 0 and not callable(data_ptr):
        raise TypeError("%s: device %d memory must be given as an int address or a tensor" %
                        (what, device))
    if isinstance(obj, (ctypes.Array, ctypes.Structure, ctypes.Union)):
        return Memory(ctypes.addressof(obj), ctypes.sizeof(obj), False, obj)
    if callable(data_ptr):  # torch.Tensor and look-alikes, duck-typed
        kind = _device_of(obj)
        if device < 0 and kind is not None and kind != "cpu":
            raise ValueError("%s: tensor on device '%s' but the descriptor is for host memory "
                             "(device=-1)" % (what, kind))
        if device >= 0:
            index = getattr(getattr(obj, "device", None), "index", None)
            if kind != "cuda" or (index is not None and index != device):
                raise ValueError("%s: tensor on '%s:%s', the descriptor says cuda:%d" %
                                 (what, kind, index, device))
        is_contig = getattr(obj, "is_contiguous", None)
        if callable(is_contig) and not is_contig():
            raise ValueError("%s: tensor is not contiguous" % what)
        addr = int(data_ptr())
        if addr == 0:
            raise ValueError("%s: tensor has no storage (data_ptr() is 0)" % what)
        nbytes = itemsize = None
        numel, esize = getattr(obj, "numel", None), getattr(obj, "element_size", None)
        if callable(numel) and callable(esize):
            itemsize = int(esize())
            nbytes = int(numel()) * itemsize
        return Memory(addr, nbytes, False, obj, itemsize)
    try:
        mv = memoryview(obj)
    except TypeError:
        mv = None
    if mv is not None:
        if not mv.c_contiguous:
            raise ValueError("%s: buffer is not C-contiguous" % what)
        nbytes = mv.nbytes
        if nbytes == 0:
            raise ValueError("%s: buffer is empty" % what)
        if not mv.readonly:
            arr = (ctypes.c_char * nbytes).from_buffer(obj)  # pins the exporter
            return Memory(ctypes.addressof(arr), nbytes, False, arr, mv.itemsize)
        if isinstance(obj, bytes):
            p = ctypes.c_char_p(obj)  # points into the bytes object itself
            return Memory(ctypes.cast(p, ctypes.c_void_p).value, nbytes, True, (obj, p))
    iface = getattr(obj, "__array_interface__", None)
    if isinstance(iface, dict) and iface.get("data") and iface.get("strides") is None:
        addr, readonly = iface["data"]
        if not addr:
            raise ValueError("%s: array has no data" % what)
        nbytes = mv.nbytes if mv is not None else None
        return Memory(int(addr), nbytes, bool(readonly), obj,
                      mv.itemsize if mv is not None else None)
    if mv is not None:
        raise TypeError("%s: read-only %s; pass a writable buffer, bytes, or an address" %
                        (what, type(obj).__name__))
    raise TypeError("%s: %s is neither an address, a buffer nor a tensor" %
                    (what, type(obj).__name__))
