"""mooncake-fs: Python client of the mooncake-fs ioctls (pure Python).

    import mooncake_fs as mc
    c = mc.Client("/mnt/mooncake")
    c.put("model/w0", array)                  # one copy (PUT_VM)
    a = c.get_array("model/w0", "float32")    # one copy (GET_VM)
    with c.pool(64 << 20, 8) as pool:         # one registration
        v = pool.get_view("model/w0")         # zero-copy view of a lease
    mc.put_tensor("/mnt/mooncake/w", t)       # torch tensor, CPU or CUDA
    t = mc.get_tensor("/mnt/mooncake/w", device="cuda")

See README.md next to this package for the whole API.
"""

from . import _abi as abi
from .client import (
    BatchError,
    Client,
    Directory,
    Entry,
    File,
    KeyInfo,
    NotMooncakeError,
    Stat,
)
from .pool import BufferPool, Lease, ObjectTooLarge, PoolClosed, PoolExhausted
from . import tensor  # imports torch only when a tensor function runs
from .tensor import (
    TensorFormatError,
    get_tensor,
    get_tensor_range,
    load_state_dict,
    put_tensor,
    save_state_dict,
)

__version__ = "0.1.0"

__all__ = [
    "abi", "BatchError", "BufferPool", "Client", "Directory", "Entry", "File", "KeyInfo", "Lease",
    "NotMooncakeError", "ObjectTooLarge", "PoolClosed", "PoolExhausted", "Stat",
    "put", "get", "get_into", "get_array", "stat", "batch_put", "batch_get", "batch_get_into",
    "tensor", "TensorFormatError", "put_tensor", "get_tensor", "get_tensor_range", "save_state_dict",
    "load_state_dict",
]

_paths = Client(None, probe=False)


def put(path, data, *, exclusive=False, makedirs=True):
    """Store data (bytes-like or numpy array) at path on a mount; return the version."""
    return _paths.put(path, data, exclusive=exclusive, makedirs=makedirs)


def get(path, offset=0, length=None):
    """The bytes of the object at path."""
    return _paths.get(path, offset, length)


def get_into(path, out, offset=0):
    """Read up to len(out) bytes of path at offset into out; return the count."""
    return _paths.get_into(path, out, offset)


def get_array(path, dtype="uint8", shape=None, offset=0):
    """Read path into a new numpy array."""
    return _paths.get_array(path, dtype, shape, offset)


def stat(path):
    """STAT of the object at path."""
    return _paths.stat(path)


def batch_put(dir, items, **kw):
    """Put {key: data} with keys relative to directory dir."""
    return _paths.batch_put(items, dir=dir, **kw)


def batch_get(dir, keys):
    """{key: bytes or None} for keys relative to directory dir."""
    return _paths.batch_get(keys, dir=dir)


def batch_get_into(dir, items, **kw):
    """Read {key: out buffer} with keys relative to dir; {key: count or -errno}."""
    return _paths.batch_get_into(items, dir=dir, **kw)
