"""kvxfer: progressive KV-cache transfer for disaggregated LLM serving.

A pure-Python (ctypes) binding of libkvxfer.so: no compiled extension, no
dependency outside the standard library.  Importing it loads the library:
$KVXFER_LIBRARY, else libkvxfer.so next to this package, else the dynamic
loader's path (docs/PYTHON.md).

    import kvxfer
    uid = kvxfer.UniqueId.create()                 # rank 0; send bytes(uid) to rank 1
    with kvxfer.Communicator(uid, rank=0) as comm:
        kv = kvxfer.KVDescriptor(k_blocks, v_blocks, num_layers=L, kv_heads=H,
                                 head_dim=D, block_size=16, num_tokens=T)
        req = comm.recv(1, kv)
        req.wait(kvxfer.Stage.ANCHOR_READY)       # approximate KV is in place
        req.wait()                                 # exact KV is in place
        print(req.timestamps())

Errors raise KvxferError (code, name, message).  The serving-runtime adapter
is kvxfer.connector.
"""

from ._abi import (  # noqa: F401
    ALPHA_AUTO,
    ANY_PEER,
    CONFIG_MAGIC,
    HEADER_VERSION_CODE,
    UNIQUE_ID_BYTES,
    Codec,
    Dtype,
    KVKind,
    Mode,
    NonfinitePolicy,
    Stage,
    Tier,
    ValueGroups,
)
from ._errors import KvxferError, LibraryNotFoundError, Result, result_name  # noqa: F401
from .core import (  # noqa: F401
    Arrival,
    CodecConfig,
    Communicator,
    Endpoint,
    KVBlocks,
    KVDescriptor,
    KVPool,
    PageId,
    PageInfo,
    PageLayout,
    Request,
    RequestInfo,
    UniqueId,
    calibrate_alpha,
    decode_page,
    encode_page,
    encode_page_tiered,
    error_string,
    get_version,
    inspect_page,
    library_path,
    page_max_size,
)

__version__ = "%d.%d.%d" % (HEADER_VERSION_CODE // 10000, HEADER_VERSION_CODE // 100 % 100,
                            HEADER_VERSION_CODE % 100)
