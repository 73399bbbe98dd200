"""Mooncake Store's Python API (``MooncakeDistributedStore``) on a mooncake-fs
mount, so that serving engines' Mooncake connectors (SGLang HiCache, vLLM,
LMCache) run unchanged; every key they write is a file under the mount.

    from mooncake_fs.mooncake_store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    store.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", "")  # 0 once the mount answers
    store.put("k", b"value")                 # 0; an existing key keeps its value
    store.get("k")                           # b"value"; b"" for a missing key

``import mooncake.store`` gives the same class where the compatibility
package (python/compat) is on the path instead of Mooncake's own.

Conventions, as Mooncake's: statuses are ints, 0 or a negative ErrorCode
(OBJECT_NOT_FOUND -704, NO_AVAILABLE_HANDLE -200 for no space,
INVALID_PARAMS -600); reads return byte counts; no method raises for a
store error. The mount is ``$MOONCAKE_FS_MOUNT`` (default /mnt/mooncake);
keys live in the directory ``tenant_id`` under it (default "default"),
each as one file named by key_to_path.
"""

import bisect
import ctypes
import errno
import functools
import itertools
import logging
import operator
import os
import re
import socket
import struct
import sys
import threading
from array import array
from contextlib import ExitStack
from enum import IntEnum

from . import _abi
from ._buffer import new_bytes, pinned
from . import client as _client
from .client import _SEG, Directory, _contiguous, columns_fit, overlapped, spans_overlap as _overlap

__all__ = [
    "MooncakeDistributedStore", "MooncakeHostMemAllocator", "ReplicateConfig", "SoftPinAction", "ObjectDataType",
    "ErrorCode",
    "key_to_path", "path_to_key",
]

log = logging.getLogger("mooncake_fs.mooncake_store")


class ErrorCode(IntEnum):
    """Mooncake's error codes (the ones this store returns, and neighbours)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    NO_AVAILABLE_HANDLE = -200  # no space
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    OBJECT_REPLICA_BUSY = -714
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    NOT_SUPPORTED = -1012


class SoftPinAction(IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicateConfig:
    """Mooncake's ReplicateConfig. Here replica_num > 1 sets the file's
    user.mooncake.replicas (copies on other nodes of a cluster),
    with_hard_pin sets user.mooncake.pin (never evicted), and
    preferred_segment / preferred_segments[0] ("host:port" or a node name)
    sets user.mooncake.placement to node:HOST. The other fields are kept
    and mean nothing on this store."""

    def __init__(self):
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms = None
        self.with_soft_pin = False  # older Mooncake releases' name
        self.with_hard_pin = False
        self.preferred_segments = []
        self.preferred_segment = ""
        self.preferred_nof_segments = []
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids = None

    def __repr__(self):
        return (f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin}, "
                f"preferred_segment={self._preferred()!r})")

    __str__ = __repr__

    def _preferred(self):
        if self.preferred_segments:
            return self.preferred_segments[0]
        return self.preferred_segment or ""

    def _plain(self, store):
        """Whether a put with this config needs nothing but its bytes."""
        return self.replica_num <= 1 and not self.with_hard_pin and not store._foreign_node(self._preferred())


_DEFAULT = ReplicateConfig()

# --- keys as file names ---

_NAME_MAX = 255
_LITTLE = sys.byteorder == "little"  # array("Q") is the ABI's layout
_CONT = b"%+"  # ends a path component that the next one continues


def _tokens(key):
    """The key's bytes as file-name tokens: one UTF-8 character each (a
    byte of a broken one alone), "%", "/" and NUL escaped."""
    if isinstance(key, bytes):
        b = key
    elif isinstance(key, str):
        b = key.encode("utf-8")  # a lone surrogate: ValueError (it would share a name)
    else:
        raise TypeError(f"key {key!r}: want str")
    if not b:
        raise ValueError("empty key")
    out, i = [], 0
    while i < len(b):
        c, n = b[i], 1
        if c >= 0xC0:
            while i + n < len(b) and n < 4 and 0x80 <= b[i + n] < 0xC0:
                n += 1
        out.append(b"%%%02X" % c if c in (0x25, 0x2F, 0x00) else b[i:i + n])
        i += n
    return out


def _first(tok):
    """tok starting a path component: a "." there is written %2E."""
    return b"%2E" if tok == b"." else tok


def key_to_path(key):
    """The path, relative to the tenant directory, of key's file: the key's
    UTF-8 bytes with "%", "/" and NUL written %25, %2F, %00 and a "." that
    starts a name as %2E; a name longer than 255 bytes is cut, between
    characters, into directories of at most 255 bytes, each but the last
    ending in "%+" (so "a"*300 is "aaa...a%+/aaa..."). Every key has one
    path and path_to_key gives it back."""
    if isinstance(key, str) and key and key.isascii() and len(key) <= _NAME_MAX and key[0] != "." \
            and "%" not in key and "/" not in key and "\0" not in key:
        return key  # the common case: the name is the key
    toks = _tokens(key)
    whole = _first(toks[0]) + b"".join(toks[1:])
    if len(whole) <= _NAME_MAX:
        return os.fsdecode(whole)
    parts, cur = [], b""
    for t in toks:
        t = _first(t) if not cur else t
        if len(cur) + len(t) > _NAME_MAX - len(_CONT):
            parts.append(cur + _CONT)
            cur = _first(t)
        else:
            cur += t
    parts.append(cur)
    return os.fsdecode(b"/".join(parts))


_UNESC = re.compile(rb"%([0-9A-F]{2})")


def path_to_key(path):
    """The key whose file is at path (relative to the tenant directory), or
    None for a path key_to_path does not make."""
    b = os.fsencode(path)
    parts = b.split(b"/")
    for p in parts[:-1]:
        if not p.endswith(_CONT):
            return None
    name = b"".join(p[:-len(_CONT)] for p in parts[:-1]) + parts[-1]
    raw = _UNESC.sub(lambda m: bytes([int(m.group(1), 16)]), name)
    try:
        key = raw.decode("utf-8")
        if key_to_path(key) != os.fsdecode(b):
            return None
    except ValueError:
        return None
    return key


# --- sizes and errors ---

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_size(v):
    """Bytes in v: an int, or a string like "4GB", "512 MiB", "1024"."""
    if isinstance(v, int):
        return v
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(v))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {v!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_ERRNO = {
    errno.ENOENT: ErrorCode.OBJECT_NOT_FOUND,
    errno.ENOSPC: ErrorCode.NO_AVAILABLE_HANDLE,
    errno.EDQUOT: ErrorCode.NO_AVAILABLE_HANDLE,
    errno.EEXIST: ErrorCode.OBJECT_ALREADY_EXISTS,
    errno.EINVAL: ErrorCode.INVALID_PARAMS,
    errno.EFAULT: ErrorCode.INVALID_PARAMS,
    errno.E2BIG: ErrorCode.INVALID_PARAMS,
    errno.ERANGE: ErrorCode.INVALID_PARAMS,
    errno.EOVERFLOW: ErrorCode.INVALID_PARAMS,  # FLAG_WHOLE: the value does not fit the buffers
    errno.ENAMETOOLONG: ErrorCode.INVALID_KEY,
    errno.EISDIR: ErrorCode.INVALID_KEY,
    errno.ENOTDIR: ErrorCode.INVALID_KEY,
    errno.EACCES: ErrorCode.ILLEGAL_CLIENT,
    errno.EPERM: ErrorCode.ILLEGAL_CLIENT,
    errno.EBUSY: ErrorCode.OBJECT_REPLICA_BUSY,
    errno.EIO: ErrorCode.TRANSFER_FAIL,
    errno.ENOTCONN: ErrorCode.RPC_FAIL,
    errno.ECONNABORTED: ErrorCode.RPC_FAIL,
}


def error_code(err):
    """Mooncake's code for an errno (positive or negative) or an OSError."""
    e = err.errno if isinstance(err, OSError) else abs(err)
    return int(_ERRNO.get(e, ErrorCode.INTERNAL_ERROR))


# --- the stored tensor layout (Mooncake's TensorMetadata, 304 bytes) ---

TENSOR_MAGIC = 0x4D4F4F4E
TENSOR_HEADER = 304
_HEAD = struct.Struct("<IHHiiIIQQ")  # magic version header_size dtype ndim layout flags data_offset data_bytes
_SHAPES = struct.Struct("<8q8q")
_MAX_DIMS = 8
_DTYPES = ["float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]


def tensor_header(dtype_name, shape, nbytes):
    """Mooncake's 304-byte header for a full (unsharded) tensor."""
    if dtype_name not in _DTYPES:
        raise ValueError(f"dtype {dtype_name}: not one Mooncake stores")
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"{len(shape)} dimensions, at most {_MAX_DIMS}")
    dims = list(shape) + [-1] * (_MAX_DIMS - len(shape))
    h = bytearray(TENSOR_HEADER)
    _HEAD.pack_into(h, 0, TENSOR_MAGIC, 1, TENSOR_HEADER, _DTYPES.index(dtype_name), len(shape), 0, 0,
                    TENSOR_HEADER, nbytes)
    _SHAPES.pack_into(h, _HEAD.size, *dims, *dims)
    return bytes(h)


def parse_tensor_header(b):
    """(dtype name, shape, data bytes) from a stored header; ValueError if b
    does not start with one."""
    if len(b) < TENSOR_HEADER:
        raise ValueError("shorter than a tensor header")
    magic, version, hsize, dtype, ndim, _layout, _flags, off, nbytes = _HEAD.unpack_from(b, 0)
    if magic != TENSOR_MAGIC or version != 1 or hsize != TENSOR_HEADER or off != TENSOR_HEADER:
        raise ValueError("not a Mooncake tensor header")
    if not 0 <= dtype < len(_DTYPES) or not 0 <= ndim <= _MAX_DIMS:
        raise ValueError(f"dtype {dtype}, {ndim} dimensions")
    shape = tuple(_SHAPES.unpack_from(b, _HEAD.size)[:ndim])
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {shape}")
    return _DTYPES[dtype], shape, nbytes


class BufferHandle(bytearray):
    """A value read by get_buffer: its bytes (the buffer protocol, len), with
    Mooncake's ptr() and size()."""

    def ptr(self):
        if not len(self):
            return 0
        with pinned(self) as (addr, _):
            return addr

    def size(self):
        return len(self)


# --- the store ---

_IGNORED = ("metadata_server", "global_segment_size", "local_buffer_size", "protocol", "rdma_devices",
            "master_server_addr", "engine", "enable_ssd_offload", "ssd_offload_path",
            "enable_client_http_server", "client_http_port", "ipc_socket_path")
_warned = set()


def _once(what, value):
    if what not in _warned and value not in (None, "", 0, False):
        _warned.add(what)
        log.info("mooncake-fs store: %s=%r means nothing here, ignored", what, value)


class _Reg:
    __slots__ = ("base", "end", "id", "gpu")

    def __init__(self, base, end, id, gpu):
        self.base, self.end, self.id, self.gpu = base, end, id, gpu


class MooncakeDistributedStore:
    """Mooncake's MooncakeDistributedStore on a mooncake-fs mount."""

    def __init__(self):
        self._lock = threading.RLock()
        self._dir = None       # Directory of the tenant
        self._root = None      # its path
        self._host = ""
        self._regs = []        # _Reg sorted by base
        self._bases = []       # their bases, for bisect
        self._parents = False  # the daemon makes long keys' directories (ABI 1.4)
        self._probe = ctypes.create_string_buffer(1)  # the fast path's gets read a byte past each value here
        self._whole = False  # the daemon takes FLAG_WHOLE (ABI 1.6): no probe byte

    # --- lifecycle ---

    def setup(self, local_hostname=None, metadata_server=None, global_segment_size=0, local_buffer_size=0,
              protocol="tcp", rdma_devices="", master_server_addr="", engine=None, enable_ssd_offload=False,
              ssd_offload_path="", tenant_id="default", enable_client_http_server=False, client_http_port=9300,
              **more):
        """setup(local_hostname, metadata_server, global_segment_size,
        local_buffer_size, protocol, rdma_devices, master_server_addr, ...)
        or setup(config_dict): 0 once the mount answers, else a negative
        code. Arguments about Mooncake's master, transfer engine and
        segments are accepted and logged once."""
        if isinstance(local_hostname, dict):
            cfg = {k: v for k, v in local_hostname.items()}
            if "local_hostname" not in cfg or "metadata_server" not in cfg:
                return int(ErrorCode.INVALID_PARAMS)
            try:
                for k in ("global_segment_size", "local_buffer_size"):
                    if k in cfg:
                        cfg[k] = parse_size(cfg[k])
            except ValueError:
                return int(ErrorCode.INVALID_PARAMS)
            return self.setup(**cfg)
        if not local_hostname:
            return int(ErrorCode.INVALID_PARAMS)
        args = dict(metadata_server=metadata_server, global_segment_size=global_segment_size,
                    local_buffer_size=local_buffer_size, protocol=protocol, rdma_devices=rdma_devices,
                    master_server_addr=master_server_addr, engine=engine, enable_ssd_offload=enable_ssd_offload,
                    ssd_offload_path=ssd_offload_path, enable_client_http_server=enable_client_http_server,
                    **more)
        for k, v in args.items():
            if k != "client_http_port":
                _once(k, v)
        tenant = str(tenant_id or "default")
        if tenant in (".", "..") or "/" in tenant or "\0" in tenant:
            return int(ErrorCode.INVALID_PARAMS)
        mount = os.environ.get("MOONCAKE_FS_MOUNT") or "/mnt/mooncake"
        root = os.path.join(mount, tenant)
        with self._lock:
            self._close_locked()
            try:
                os.makedirs(root, exist_ok=True)
                d = Directory(root)
                try:
                    abi = d.probe()
                    if abi < (1, 3):
                        raise OSError(errno.ENOTSUP, "mooncake-fs daemon older than ABI 1.3", root)
                except BaseException:
                    d.close()
                    raise
            except OSError as e:
                log.warning("mooncake-fs store: setup on %s: %s", root, e)
                return int(ErrorCode.RPC_FAIL) if not isinstance(e, PermissionError) else int(ErrorCode.ILLEGAL_CLIENT)
            self._dir, self._root, self._host = d, root, str(local_hostname)
            # ABI 1.4: a long key's directories are made by its put, in the
            # daemon (FLAG_PARENTS): no other client's prune can come
            # between.
            self._parents = abi >= (1, 4)
            # ABI 1.6: a get that must have the whole value says so
            # (FLAG_WHOLE), instead of reading a probe byte past it.
            self._whole = abi >= (1, 6)
        return 0

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address):
        """Mooncake's client of a separate store process: here the mount is
        that process."""
        _once("server_address", server_address)
        return self.setup("localhost", "P2PHANDSHAKE", mem_pool_size, local_buffer_size, "tcp", "", "")

    def init_all(self, protocol, device_name, mount_segment_size):
        return self.setup("localhost:12345", "127.0.0.1:2379", mount_segment_size, 1 << 30, protocol,
                          device_name, "127.0.0.1:50051")

    def close(self):
        with self._lock:
            self._close_locked()
        return 0

    def _close_locked(self):
        if self._dir is not None:
            self._dir.close()  # its registrations die with it
        self._dir, self._regs, self._bases = None, [], []

    def get_hostname(self):
        return self._host

    def health_check(self):
        """0 healthy, 1 not set up or closed, 2 the mount does not answer."""
        d = self._dir
        if d is None:
            return 1
        try:
            d.probe()
        except OSError:
            return 2
        return 0

    # --- where a key goes ---

    def _target(self, key, create=False):
        """(Directory, name) of key's file; OSError/ValueError if none. The
        directories of a long key's name are made only with create (a put):
        otherwise a missing one is FileNotFoundError."""
        rel = key_to_path(key)
        d = self._dir
        if d is None:
            raise _NotSetUp()
        if "/" not in rel:
            return d, rel
        sub, name = rel.rsplit("/", 1)
        path = os.path.join(self._root, sub)
        if create:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOENT):
                    # A concurrent prune or put changed the path while it
                    # was made: worth a retry (never "the key exists").
                    raise OSError(errno.ESTALE, "directory changed while made", path) from None
                raise
        # Opened for the call: a cached handle could outlive its directory
        # (removed with the key's last file).
        return Directory(path), name

    def _groups(self, keys, create=False):
        """[(Directory, [(index, name)])] of keys; failed: {index: -errno}."""
        groups, failed = {}, {}
        top = self._dir
        if top is None:
            raise _NotSetUp()
        mine = []  # the tenant directory's own keys
        parents = self._parents
        for i, k in enumerate(keys):
            if k.__class__ is str and k.isascii() and 0 < len(k) <= _NAME_MAX and k[0] != "." \
                    and "%" not in k and "/" not in k and "\0" not in k:
                mine.append((i, k))  # key_to_path(k) is k
                continue
            if parents:
                # Through the tenant directory by its path below it: the
                # daemon resolves (and for puts makes) the directories.
                try:
                    mine.append((i, key_to_path(k)))
                except (ValueError, TypeError):
                    failed[i] = -errno.EINVAL
                continue
            try:
                d, name = self._target(k, create)
            except _NotSetUp:
                raise
            except (OSError, ValueError, TypeError) as e:
                # A negative errno, as the daemon's results: callers
                # convert once.
                failed[i] = -(e.errno or errno.EIO) if isinstance(e, OSError) else -errno.EINVAL
                continue
            g = groups.get(d.name)
            if g is None:
                groups[d.name] = (d, [(i, name)])
                continue
            if d is not g[0]:
                d.close()  # another handle of a directory the group has
            g[1].append((i, name))
        if mine:
            g = groups.get(top.name)
            if g is None:
                groups[top.name] = (top, mine)
            else:
                g[1].extend(mine)
                g[1].sort()  # in the keys' order
        return list(groups.values()), failed

    # --- memory ---

    def register_buffer(self, buffer_ptr, size):
        """Register size bytes at buffer_ptr (host memory of this process, or
        CUDA memory) for the *_from / *_into calls: 0, or a negative code
        (INVALID_PARAMS for a range that overlaps one registered already)."""
        if not isinstance(buffer_ptr, int) or not isinstance(size, int) or buffer_ptr <= 0 or size <= 0:
            return int(ErrorCode.INVALID_PARAMS)
        with self._lock:
            d = self._dir
            if d is None:
                return int(ErrorCode.INVALID_PARAMS)
            i = bisect.bisect_right(self._bases, buffer_ptr)
            if (i > 0 and self._regs[i - 1].end > buffer_ptr) or (i < len(self._regs) and self._regs[i].base < buffer_ptr + size):
                return int(ErrorCode.INVALID_PARAMS)
            try:
                loc = _device_location(buffer_ptr, size)
                if loc is not None:
                    rid = d.register_gpu(loc, size)
                else:
                    rid = d.register_vm(buffer_ptr, size)
            except OSError as e:
                return error_code(e)
            except ValueError:
                return int(ErrorCode.INVALID_PARAMS)
            self._regs.insert(i, _Reg(buffer_ptr, buffer_ptr + size, rid, loc is not None))
            self._bases.insert(i, buffer_ptr)
        return 0

    def unregister_buffer(self, buffer_ptr):
        with self._lock:
            for i, r in enumerate(self._regs):
                if r.base == buffer_ptr:
                    del self._regs[i], self._bases[i]
                    try:
                        self._dir.unregister(r.id)
                    except OSError as e:
                        return error_code(e)
                    return 0
        return int(ErrorCode.INVALID_PARAMS)

    def _seg(self, ptr, size, gpus):
        """The segment of [ptr, ptr+size): in a registration, CUDA memory by
        IPC handle (added to gpus), or this process's memory by address."""
        regs = self._regs
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0 and ptr + size <= regs[i].end:
            return (regs[i].id, ptr - regs[i].base, size)
        loc = _device_location(ptr, size) if size else None
        if loc is None:
            return (_abi.SEG_VM, ptr, size)
        ref = (loc.handle, loc.device)
        if ref not in gpus:
            gpus.append(ref)
        return (_abi.SEG_GPU | gpus.index(ref), loc.dev_off, size)

    # --- the batch engine of every call ---

    def _run(self, put, items, flags=0):
        """items: [(key, segs as (ptr, size) pairs or ready segments,
        obj_off)], put or get. Returns a list of (result, version): bytes
        moved or a negative errno."""
        out = [None] * len(items)
        groups, failed = self._groups([it[0] for it in items], create=put)
        for i, code in failed.items():
            out[i] = (code, 0)
        regs, bases, find = self._regs, self._bases, bisect.bisect_right
        max_gpus, max_segs, max_batch, area = _abi.MAX_GPU_REFS, _abi.MAX_SEGS, _abi.MAX_BATCH, _abi.VBATCH_AREA_BYTES
        for d, members in groups:
            todo = list(members)
            pack = _SEG.pack
            while todo:
                gpus, entries, idx, used = [], [], [], 0
                for i, name in todo:
                    _, segs, off = items[i]
                    try:
                        parts = []
                        for s in segs:
                            if len(s) == 3:
                                parts.append(pack(*s))
                                continue
                            # _seg, its common case inline: in a registration.
                            ptr, size = s
                            j = find(bases, ptr) - 1
                            if j >= 0 and ptr + size <= regs[j].end:
                                parts.append(pack(regs[j].id, ptr - regs[j].base, size))
                            else:
                                parts.append(pack(*self._seg(ptr, size, gpus)))
                        blob = parts[0] if len(parts) == 1 else b"".join(parts)
                        k = name.encode("utf-8", "surrogateescape")
                    except (struct.error, TypeError, ValueError, OverflowError):
                        out[i] = (-errno.EINVAL, 0)
                        continue
                    if len(gpus) > max_gpus:
                        break
                    nseg, klen = len(segs), len(k)
                    n = len(blob) + klen
                    if not nseg or nseg > max_segs or 7 + n > area or off.__class__ is not int or not 0 <= off < 1 << 64:
                        out[i] = (-errno.EINVAL, 0)
                        continue
                    end = ((used + 7) & ~7) + n
                    if end > area:
                        break  # one call's area: send_packed makes one ioctl of these
                    used = end
                    entries.append((blob + k, nseg, klen, 0, flags, off))
                    idx.append(i)
                    if len(entries) == max_batch:
                        break
                if not entries:
                    if todo and out[todo[0][0]] is None:  # one key names too many allocations
                        out[todo[0][0]] = (-errno.E2BIG, 0)
                    todo = [t for t in todo if out[t[0]] is None]
                    continue
                try:
                    res = d.send_packed(put, entries, gpus[:_abi.MAX_GPU_REFS])
                except OSError as e:
                    res = [(-(e.errno or errno.EIO), 0)] * len(entries)
                for i, r in zip(idx, res):
                    out[i] = r
                todo = [t for t in todo if out[t[0]] is None]
            if d is not self._dir:
                d.close()
        return out

    def _columns(self, put, keys, ptrs, sizes, m, flags, probe=0):
        """The batch engine's fast path: results (bytes moved or a negative
        errno) of keys of m segments each, ptrs and sizes flat in key
        order, when every key is its own file name, every size above 0 and
        every segment in one registration; a get with probe reads one byte
        more per key into the byte at probe (what it holds is never read:
        a result past the buffers says the value did not fit). Whole
        columns go to send_columns, a call's worth at a time, without a
        Python loop per key. None where that does not hold: the general
        engine then takes the call.

        A call of many keys is checked and sent a daemon call at a time by
        IN_FLIGHT threads (this one among them), each taking the next part
        of 64 keys as its last call ends: the first goes as soon as its
        keys are checked (checking 1024 keys took about a millisecond on
        the H200 host, in which the copy engines idled), and no thread
        waits on another between calls. If a later part must go the
        general way, the general engine does the whole call again, which
        stores or reads the same: a get read twice reads the same; a put's
        keys already stored are there (an existing key keeps its value, or
        an upsert writes the same bytes again)."""
        n, serial = len(keys), None
        if n > 2 * _abi.MAX_BATCH and _client.IN_FLIGHT > 1 and _all_positive(ptrs, sizes):
            # (The general engine refuses a call with a bad buffer whole:
            # nothing may go before every buffer is checked.) Puts of a key
            # twice and gets into buffers that share bytes go in order, the
            # later last.
            try:
                serial = len(set(keys)) != n if put else _overlap(ptrs, sizes)
            except TypeError:  # a key that is no str: the general engine says which
                return None
            if not serial:
                return self._streamed(put, keys, ptrs, sizes, m, flags, probe)
        plan = self._plan(put, keys, ptrs, sizes, m, flags, probe)
        if plan is None:
            return None
        call, bounds = plan
        if serial is None:
            serial = len(bounds) == 1 or (len(set(keys)) != n if put else _overlap(ptrs, sizes))
        return _send(call, bounds, serial)

    def _streamed(self, put, keys, ptrs, sizes, m, flags, probe):
        """_columns of many keys whose calls may overlap: parts of MAX_BATCH
        keys, each checked and sent by whichever of IN_FLIGHT threads is
        free (client.in_parts)."""
        n, per = len(keys), _abi.MAX_BATCH

        def part(i):
            lo, hi = i * per, min(n, (i + 1) * per)
            plan = self._plan(put, keys[lo:hi], ptrs[lo * m:hi * m], sizes[lo * m:hi * m], m, flags, probe)
            if plan is None:
                return None  # the general engine takes every key
            call, bounds = plan
            return [r for at, c in bounds for r in call(at, c)]

        out = _client.in_parts((n + per - 1) // per, part)
        return None if out is None else list(itertools.chain.from_iterable(out))

    def _plan(self, put, keys, ptrs, sizes, m, flags, probe):
        """(call, bounds) of _columns' fast path for keys, or None: bounds
        the (first key, count) of each call, call(at, count) the results
        of one."""
        n, d = len(keys), self._dir
        if d is None or not n or m < 1 or len(ptrs) != n * m or len(sizes) != n * m or not _LITTLE:
            return None
        regs = self._regs
        try:
            names = "/" + "/".join(keys)
            lo, small = min(ptrs), min(sizes)
            hi = max(map(operator.add, ptrs, sizes))
            i = bisect.bisect_right(self._bases, lo) - 1
            if i < 0 or small <= 0 or hi > regs[i].end:
                return None
        except TypeError:  # not numbers: the general engine says which
            return None
        if not names.isascii() or names.count("/") != n or "/." in names or "//" in names or names[-1] == "/" \
                or "%" in names or "\0" in names:
            return None
        lens = list(map(len, keys))
        if max(lens) > _NAME_MAX:
            return None
        reg = regs[i]
        try:
            offs = array("Q", map(operator.sub, ptrs, itertools.repeat(reg.base)))
            sz = array("Q", sizes)
        except (TypeError, OverflowError, ValueError):
            return None
        nseg = m + 1 if probe else m
        step = 3 * nseg
        # The calls' bounds first: nothing goes out unless every key fits.
        bounds, at = [], 0
        while at < n:
            c = min(n - at, _abi.MAX_BATCH)
            while c > 1 and not columns_fit(c, nseg, sum(lens[at:at + c])):
                c //= 2
            if not columns_fit(c, nseg, sum(lens[at:at + c])):
                return None
            bounds.append((at, c))
            at += c

        def call(at, c, started=None):
            segs = array("Q", bytes(8 * step * c))
            lo_seg, hi_seg = at * m, (at + c) * m
            for t in range(m):
                segs[3 * t::step] = array("Q", [reg.id]) * c
                segs[3 * t + 1::step] = offs[lo_seg + t:hi_seg:m]
                segs[3 * t + 2::step] = sz[lo_seg + t:hi_seg:m]
            if probe:
                # segs[3m::step] stays SEG_VM (0)
                segs[3 * m + 1::step] = array("Q", [probe]) * c
                segs[3 * m + 2::step] = array("Q", [1]) * c
            try:
                more = {} if started is None else {"started": started}
                return d.send_columns(put, "".join(keys[at:at + c]).encode("ascii"), lens[at:at + c], segs, nseg, flags,
                                      **more)
            except OSError as e:
                return [-(e.errno or errno.EIO)] * c

        return call, bounds

    def _put_columns(self, keys, ptrs, sizes, m, config, upsert):
        """Codes of a put on the fast path (_columns), None off it."""
        if not config._plain(self):
            return None
        flags = 0 if upsert else _abi.FLAG_EXCL
        if self._parents:
            flags |= _abi.FLAG_PARENTS
        res = self._columns(True, keys, ptrs, sizes, m, flags)
        if res is None:
            return None
        if min(res) >= 0:
            return [0] * len(res)
        ok = () if upsert else (-errno.EEXIST,)  # an existing key keeps its value
        return [0 if r >= 0 or r in ok else error_code(r) for r in res]

    def _get_columns(self, keys, ptrs, sizes, m):
        """Codes of a get on the fast path (_columns), None off it: a value
        that does not fit its buffers is INVALID_PARAMS, which the daemon
        says (FLAG_WHOLE, ABI 1.6) or, from an older one, a probe byte
        after each key's buffers tells."""
        if not keys or self._dir is None:
            return None
        if self._whole:
            res = self._columns(False, keys, ptrs, sizes, m, _abi.FLAG_WHOLE)
            if res is None or min(res) >= 0:
                return res
            return [error_code(r) if r < 0 else r for r in res]
        if m >= _abi.MAX_SEGS:
            return None
        res = self._columns(False, keys, ptrs, sizes, m, 0, probe=ctypes.addressof(self._probe))
        if res is None:
            return None
        room = sizes if m == 1 else list(map(sum, zip(*[iter(sizes)] * m)))
        if min(res) >= 0 and all(map(operator.le, res, room)):
            return res
        bad = int(ErrorCode.INVALID_PARAMS)
        return [error_code(r) if r < 0 else (r if r <= z else bad) for r, z in zip(res, room)]

    def _put_many(self, keys, segs_list, config, upsert):
        """Codes (0 or negative) of putting each key's segments."""
        if self._dir is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        config = config or _DEFAULT
        if config.prefer_alloc_in_same_node:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        codes = [0] * len(keys)
        items, at = [], []
        plain = config._plain(self)
        for i, (k, segs) in enumerate(zip(keys, segs_list)):
            if not k:
                codes[i] = int(ErrorCode.INVALID_PARAMS)
            elif not (segs[0][-1] if len(segs) == 1 else any(s[-1] for s in segs)):
                codes[i] = 0  # Mooncake stores nothing for an empty value
            elif not plain:
                codes[i] = self._put_configured(k, segs, config, upsert)
            else:
                items.append((k, segs, 0))
                at.append(i)
        flags = 0 if upsert else _abi.FLAG_EXCL
        if self._parents:
            flags |= _abi.FLAG_PARENTS
        res = self._run(True, items, flags)
        for _ in range(4):
            # Long keys whose directories another client removed between
            # their making and the put (daemons before ABI 1.4, where the
            # client makes them): again.
            again = [j for j, (r, _) in enumerate(res) if r in (-errno.ENOENT, -errno.ESTALE) and "/" in _path_or(items[j][0])]
            if not again:
                break
            for j, r in zip(again, self._run(True, [items[j] for j in again], flags)):
                res[j] = r
        for i, (r, _) in zip(at, res):
            if r >= 0 or (r == -errno.EEXIST and not upsert):
                codes[i] = 0  # an existing key keeps its value
                continue
            # The directories a failed long key's put made stay: removing
            # them could pull them from under another put of a key that
            # shares them (remove and remove_all tidy up).
            codes[i] = error_code(r)
        return codes

    def _put_configured(self, key, segs, config, upsert):
        """A put whose file gets attributes before its bytes (placement
        decides where they go), one key at a time."""
        try:
            d, name = self._target(key, create=True)
            path = os.path.join(d.name, name)
            if d is not self._dir:
                d.close()
            made = False
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if not upsert:
                    return 0
            else:
                made = True
                try:
                    if config.replica_num > 1:
                        os.setxattr(fd, "user.mooncake.replicas", str(config.replica_num).encode())
                    node = self._foreign_node(config._preferred())
                    if node:
                        os.setxattr(fd, "user.mooncake.placement", b"node:" + node.encode())
                except OSError as e:
                    # No empty value is left behind. A placement the store
                    # cannot meet (EINVAL: more than one replica, or
                    # another node, without a cluster) is Mooncake's "no
                    # segment can take it".
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                    if e.errno == errno.EINVAL:
                        return int(ErrorCode.NO_AVAILABLE_HANDLE)
                    raise
                finally:
                    os.close(fd)
            (r, _), = self._run(True, [(key, segs, 0)], 0)
            if r < 0:
                if made:
                    # Not left as an empty value that later puts would
                    # take for an existing key.
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                return error_code(r)
            if config.with_hard_pin:
                os.setxattr(path, "user.mooncake.pin", b"1")
            return 0
        except OSError as e:
            return error_code(e)
        except (ValueError, TypeError):
            return int(ErrorCode.INVALID_PARAMS)

    def _foreign_node(self, segment):
        """The node a preferred segment ("host:port") names, "" when it is
        this client's own host (the default placement: this node)."""
        host = segment.rsplit(":", 1)[0] if segment else ""
        if host in ("", self._host.rsplit(":", 1)[0], socket.gethostname(), "localhost", "127.0.0.1"):
            return ""
        return host

    # --- writes ---

    def put(self, key, value, config=None):
        return self._put_values([key], [value], config, False)[0]

    def upsert(self, key, value, config=None):
        return self._put_values([key], [value], config, True)[0]

    def put_batch(self, keys, values, config=None):
        return self._first_error(self._batch_values(keys, values, config, False))

    def upsert_batch(self, keys, values, config=None):
        return self._first_error(self._batch_values(keys, values, config, True))

    def put_parts(self, key, *parts, config=None):
        return self._parts(key, parts, config, False)

    def upsert_parts(self, key, *parts, config=None):
        return self._parts(key, parts, config, True)

    def put_from(self, key, buffer_ptr, size, config=None):
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def upsert_from(self, key, buffer_ptr, size, config=None):
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._from(keys, buffer_ptrs, sizes, config, False)

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._from(keys, buffer_ptrs, sizes, config, True)

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        """Each key's value is the concatenation of its buffers."""
        keys = list(keys)
        if self._dir is None:
            return []
        flat = _flat(all_buffer_ptrs, all_sizes, len(keys))
        if flat is not None:
            codes = self._put_columns(keys, *flat, config or _DEFAULT, False)
            if codes is not None:
                return codes
        if not _same_lengths(keys, all_buffer_ptrs, all_sizes) or _ragged(all_buffer_ptrs, all_sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        segs = [[(p, s) for p, s in zip(ps, ss)] for ps, ss in zip(all_buffer_ptrs, all_sizes)]
        if not _valid_segs(segs):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        cfg = config or _DEFAULT
        if cfg.prefer_alloc_in_same_node:
            cfg = _copy_config(cfg, prefer_alloc_in_same_node=False)  # this node is the only one
        return self._put_many(keys, segs, cfg, False)

    @staticmethod
    def _first_error(codes):
        return next((c for c in codes if c != 0), 0)

    def _put_values(self, keys, values, config, upsert):
        with ExitStack() as stack:
            segs = []
            for v in values:
                try:
                    addr, n = stack.enter_context(pinned(_contiguous(v)))
                except (BufferError, TypeError, ValueError):
                    return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
                if n == 0:
                    return [int(ErrorCode.INVALID_PARAMS)] * len(keys)  # Mooncake refuses an empty put
                segs.append([(_abi.SEG_VM, addr, n)])
            return self._put_many(list(keys), segs, config, upsert)

    def _batch_values(self, keys, values, config, upsert):
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            return [int(ErrorCode.INVALID_PARAMS)]
        return self._put_values(keys, values, config, upsert) if keys else []

    def _parts(self, key, parts, config, upsert):
        with ExitStack() as stack:
            segs = []
            for p in parts:
                try:
                    mv = memoryview(p)
                except TypeError:
                    raise RuntimeError("parts must be 1-D bytes-like") from None
                if mv.ndim != 1 or mv.itemsize != 1:
                    raise RuntimeError("parts must be 1-D bytes-like")
                addr, n = stack.enter_context(pinned(_contiguous(p)))
                if n:
                    segs.append((_abi.SEG_VM, addr, n))
            if not segs:
                return 0
            if len(segs) > _abi.MAX_SEGS:
                return int(ErrorCode.INVALID_PARAMS)
            return self._put_many([key], [segs], config, upsert)[0]

    def _from(self, keys, ptrs, sizes, config, upsert):
        keys = list(keys)
        if not _same_lengths(keys, ptrs, sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if not keys:
            return []
        cfg = config or _DEFAULT
        if not cfg.prefer_alloc_in_same_node:
            try:
                codes = self._put_columns(keys, list(ptrs), list(sizes), 1, cfg, upsert)
            except TypeError:
                codes = None
            if codes is not None:
                return codes
        segs = [[(p, s)] for p, s in zip(ptrs, sizes)]
        if not _valid_segs(segs):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        return self._put_many(keys, segs, config, upsert)

    # --- reads ---

    def _read_whole(self, key, alloc):
        """Read key's whole value into alloc(n)'s buffer: (buffer, count) or
        None. One GET_KEY reads one version and says its size: a value that
        grew since the buffer was sized is read again into one of its new
        size."""
        try:
            d, name = self._target(key)
        except (_NotSetUp, OSError, ValueError, TypeError):
            return None
        try:
            n = d.lookup(name).size
            for _ in range(64):
                buf, addr = alloc(n)
                a = _abi.Key(source=_abi.SRC_VM, addr=addr, len=n)
                d.key_call(False, name, a)
                if a.size <= n:
                    return buf, a.result
                n = a.size  # a writer made it larger meanwhile
            return None
        except (OSError, ValueError):
            return None
        finally:
            if d is not self._dir:
                d.close()

    def get(self, key):
        """The value's bytes; b"" for a missing key (or any failure)."""
        got = self._read_whole(key, new_bytes)
        if got is None:
            return b""
        b, r = got
        return b if r == len(b) else b[:r]

    def get_batch(self, keys):
        return [self.get(k) for k in keys]

    def get_buffer(self, key):
        """A BufferHandle of the value, None for a missing key."""
        held = []

        def alloc(n):
            buf = BufferHandle(n)
            if not n:
                return buf, 0
            held.append(buf)
            with pinned(buf, writable=True) as (addr, _):
                return buf, addr  # stays put: a bytearray not resized

        got = self._read_whole(key, alloc)
        if got is None:
            return None
        buf, r = got
        del buf[r:]
        return buf

    def batch_get_buffer(self, keys):
        return [self.get_buffer(k) for k in keys]

    def get_into(self, key, buffer_ptr, size):
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys, buffer_ptrs, sizes):
        """Per key: the value's size (read whole into its buffer), or a
        negative code (OBJECT_NOT_FOUND, INVALID_PARAMS for a buffer smaller
        than the value)."""
        keys = list(keys)
        if not _same_lengths(keys, buffer_ptrs, sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        try:
            codes = self._get_columns(keys, list(buffer_ptrs), list(sizes), 1)
        except TypeError:
            codes = None
        if codes is not None:
            return codes
        return self._get_many(keys, [[(p, s)] for p, s in zip(buffer_ptrs, sizes)])

    def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node=False):
        keys = list(keys)
        flat = _flat(all_buffer_ptrs, all_sizes, len(keys))
        if flat is not None:
            codes = self._get_columns(keys, *flat)
            if codes is not None:
                return codes
        if not _same_lengths(keys, all_buffer_ptrs, all_sizes) or _ragged(all_buffer_ptrs, all_sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        return self._get_many(keys, [[(p, s) for p, s in zip(ps, ss)] for ps, ss in zip(all_buffer_ptrs, all_sizes)])

    def _get_many(self, keys, segs):
        if self._dir is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if not keys:
            return []
        if not _valid_segs(segs):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if self._whole:
            # The daemon fails a value that does not fit (ABI 1.6).
            res = self._run(False, [(k, s, 0) for k, s in zip(keys, segs)], _abi.FLAG_WHOLE)
            return [r if r >= 0 else error_code(r) for r, _ in res]
        # From an older daemon, one byte past the buffers tells a value that does not fit (a key
        # with the most segments a call takes is asked for its size).
        probe = bytearray(len(keys))
        out = []
        with pinned(probe, writable=True) as (paddr, _):
            items = [(k, s + [(_abi.SEG_VM, paddr + i, 1)] if len(s) < _abi.MAX_SEGS else s, 0)
                     for i, (k, s) in enumerate(zip(keys, segs))]
            for i, (r, _) in enumerate(self._run(False, items)):
                sg = segs[i]
                room = sg[0][1] if len(sg) == 1 else sum(x[1] for x in sg)
                if r < 0:
                    out.append(error_code(r))
                elif r > room or (r == room and len(segs[i]) >= _abi.MAX_SEGS and self.get_size(keys[i]) > room):
                    out.append(int(ErrorCode.INVALID_PARAMS))
                else:
                    out.append(r)
        return out

    def get_into_ranges(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
        """For each buffer i, for each key j, fragments k: copy all_sizes
        [i][j][k] bytes at all_src_offsets[i][j][k] of the key to
        buffer_ptrs[i] + all_dst_offsets[i][j][k]. Bytes or a negative code
        per fragment."""
        out = []
        if not _same_lengths(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
            return [[[int(ErrorCode.INVALID_PARAMS)]]] * len(buffer_ptrs)
        items, where = [], []
        for i, base in enumerate(buffer_ptrs):
            row = []
            keys, dsts, srcs, sizes = all_keys[i], all_dst_offsets[i], all_src_offsets[i], all_sizes[i]
            if not _same_lengths(keys, dsts, srcs, sizes):
                out.append([[int(ErrorCode.INVALID_PARAMS)]] * len(keys))
                continue
            for j, key in enumerate(keys):
                if not _same_lengths(dsts[j], srcs[j], sizes[j]):
                    row.append([int(ErrorCode.INVALID_PARAMS)])
                    continue
                row.append([None] * len(sizes[j]))
                for k in range(len(sizes[j])):
                    if not all(v.__class__ is int and 0 <= v < 1 << 64 for v in (sizes[j][k], dsts[j][k], srcs[j][k])) \
                            or base.__class__ is not int:
                        row[-1][k] = int(ErrorCode.INVALID_PARAMS)
                        continue
                    items.append((key, [(base + dsts[j][k], sizes[j][k])], srcs[j][k]))
                    where.append((i, j, k))
            out.append(row)
        if self._dir is None:
            for i, j, k in where:
                out[i][j][k] = int(ErrorCode.INVALID_PARAMS)
            return out
        for (i, j, k), (r, _) in zip(where, self._run(False, items)):
            out[i][j][k] = r if r >= 0 else error_code(r)
        return out

    # --- existence, size, removal ---

    def _lookup(self, keys):
        """Per key: 0 when it exists, or a negative errno (a batch get of
        no bytes)."""
        return [r for r, _ in self._run(False, [(k, [(_abi.SEG_VM, 0, 0)], 0) for k in keys])]

    def is_exist(self, key):
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys):
        """Per key: 1 exists, 0 missing, or a negative code."""
        keys = list(keys)
        if self._dir is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        out = []
        for r in self._lookup(keys):
            out.append(1 if r >= 0 else 0 if r == -errno.ENOENT else error_code(r))
        return out

    def get_size(self, key):
        if self._dir is None:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            d, name = self._target(key)  # a name of at most 255 bytes: one call
            try:
                return d.lookup(name).size
            finally:
                if d is not self._dir:
                    d.close()
        except OSError as e:
            return error_code(e)
        except (ValueError, TypeError):
            return int(ErrorCode.INVALID_PARAMS)

    def remove(self, key, force=False):
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys, force=False):
        """Per key: 0, or OBJECT_NOT_FOUND. Nothing holds a lease here, so
        force changes nothing."""
        out = []
        for k in keys:
            try:
                d, name = self._target(k)
                try:
                    os.unlink(name, dir_fd=d.fileno())
                finally:
                    if d is not self._dir:
                        d.close()
                        self._prune(os.path.relpath(d.name, self._root))
                out.append(0)
            except _NotSetUp:
                out.append(int(ErrorCode.INVALID_PARAMS))
            except OSError as e:
                out.append(error_code(e))
            except (ValueError, TypeError):
                out.append(int(ErrorCode.INVALID_PARAMS))
        return out

    def _prune(self, sub):
        """Remove the continuation directories of sub that are empty now,
        deepest first."""
        while sub and sub != os.curdir:
            try:
                os.rmdir(os.path.join(self._root, sub))
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return  # another long key's
                # Never made (or a path too long to name): its parent may
                # have been.
            sub = os.path.dirname(sub)

    def _keys(self):
        """Every key in the tenant directory."""
        root = self._root
        for top, dirs, files in os.walk(root):
            rel = os.path.relpath(top, root)
            dirs[:] = [x for x in dirs if x.endswith("%+")]
            for f in files:
                key = path_to_key(f if rel == "." else os.path.join(rel, f))
                if key is not None:
                    yield key

    def remove_by_regex(self, regex_pattern, force=False):
        """The number of keys removed whose key the pattern matches
        anywhere (re.search), or a negative code."""
        if self._dir is None:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            rx = re.compile(regex_pattern)
        except (re.error, TypeError):
            return int(ErrorCode.INVALID_PARAMS)
        gone = [k for k in self._keys() if rx.search(k)]
        return sum(1 for c in self.batch_remove(gone, force) if c == 0)

    def remove_all(self, force=False):
        if self._dir is None:
            return int(ErrorCode.INVALID_PARAMS)
        n = sum(1 for c in self.batch_remove(list(self._keys()), force) if c == 0)
        # Continuation directories left empty (by failed puts of long keys).
        for top, dirs, files in os.walk(self._root, topdown=False):
            if top != self._root and top.endswith("%+") and not files:
                try:
                    os.rmdir(top)
                except OSError:
                    pass
        return n

    # --- tensors (Mooncake's stored layout: a 304-byte header, then the bytes) ---

    def put_tensor(self, key, tensor):
        return self.batch_put_tensor([key], [tensor])[0] if self._dir is not None else int(ErrorCode.INVALID_PARAMS)

    def batch_put_tensor(self, keys, tensors_list):
        keys, ts = list(keys), list(tensors_list)
        if len(keys) != len(ts):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if not keys:
            return []
        from .tensor import _source, dtype_name

        heads, segs, codes, at = [], [], [0] * len(keys), []
        for i, t in enumerate(ts):
            try:
                t = _source(t)
                head = tensor_header(dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
            except (TypeError, ValueError):
                codes[i] = int(ErrorCode.INVALID_PARAMS)
                continue
            heads.append(head)
            ts[i] = t
            at.append(i)
        with ExitStack() as stack:
            gpu_sync = {t.device for t in ts if hasattr(t, "device") and t.device.type == "cuda"}
            if gpu_sync:
                import torch

                for dev in gpu_sync:
                    torch.cuda.current_stream(dev).synchronize()
            for i, head in zip(at, heads):
                haddr, hn = stack.enter_context(pinned(head))
                t = ts[i]
                n = t.numel() * t.element_size()
                s = [(_abi.SEG_VM, haddr, hn)]
                if n:
                    s.append((t.data_ptr(), n))
                segs.append(s)
            done = self._put_many([keys[i] for i in at], segs, None, True)
        for i, c in zip(at, done):
            codes[i] = c
        return codes

    def get_tensor(self, key):
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys):
        """Per key: a CPU tensor, or None (missing, or not a stored tensor)."""
        import torch

        from .tensor import torch_dtype

        out = []
        for k in keys:
            b = self.get(k)
            try:
                dname, shape, nbytes = parse_tensor_header(b)
                if nbytes != len(b) - TENSOR_HEADER:
                    raise ValueError("size")
                t = torch.empty(shape, dtype=torch_dtype(dname))
                if t.numel() * t.element_size() != nbytes:
                    raise ValueError("size")
                if nbytes:
                    t.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(b[TENSOR_HEADER:]), dtype=torch.uint8))
                out.append(t)
            except (ValueError, TypeError, KeyError):
                out.append(None)
        return out


class MooncakeHostMemAllocator:
    """Mooncake's host memory allocator (SGLang allocates its host KV pool
    with it): alloc(size) maps size bytes of anonymous memory (huge pages
    advised) and returns its address, 0 on failure; free(ptr) unmaps it (0,
    or INVALID_PARAMS for an address alloc did not return)."""

    def __init__(self):
        self._maps = {}
        self._lock = threading.Lock()

    def alloc(self, size):
        import mmap

        if not isinstance(size, int) or size <= 0:
            return 0
        try:
            m = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, OverflowError):
            return 0
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        anchor = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(anchor)
        with self._lock:
            self._maps[addr] = (m, anchor)
        return addr

    def free(self, ptr):
        with self._lock:
            got = self._maps.pop(ptr, None)
        if got is None:
            return int(ErrorCode.INVALID_PARAMS)
        m = got[0]
        del got  # the last reference to the anchor: its export ends
        m.close()
        return 0


class _NotSetUp(Exception):
    pass


def _device_location(ptr, size):
    """IPCLocation of CUDA memory at ptr, None for host memory."""
    from . import cudadrv

    if not cudadrv.available():
        return None
    try:
        return cudadrv.ipc_location(ptr, size)
    except ValueError as e:
        if "not device memory" in str(e) or "unknown to CUDA" in str(e):
            return None
        raise


def _path_or(key):
    """key_to_path(key), or "" for a key that has none."""
    try:
        return key_to_path(key)
    except (ValueError, TypeError):
        return ""


def _send(call, bounds, serial):
    """The results of call(at, count) for each of bounds, in order: one
    after the other (serial), or overlapped."""
    if serial:
        return [r for at, c in bounds for r in call(at, c)]
    return [r for res in overlapped(functools.partial(call, at, c) for at, c in bounds) for r in res]


def _all_positive(ptrs, sizes):
    """Whether every pointer and size is an int above 0 (what the general
    engine's check, _valid_segs, takes and more)."""
    try:
        return min(sizes) > 0 and min(ptrs) > 0 and len(array("Q", ptrs)) == len(ptrs) and \
            len(array("Q", sizes)) == len(sizes)
    except (TypeError, ValueError, OverflowError):
        return False


def _flat(all_ptrs, all_sizes, n):
    """(pointers, sizes, m) of n keys of m buffers each, flat in key
    order; None where the keys' buffer counts differ or do not match."""
    try:
        if n == 0 or len(all_ptrs) != n or len(all_sizes) != n:
            return None
        m = len(all_ptrs[0])
        if m == 1:
            try:  # one buffer a key, the common case: a third of the work of the general check
                return [p for (p,) in all_ptrs], [z for (z,) in all_sizes], 1
            except ValueError:
                return None  # some key has another count
        if set(map(len, all_ptrs)) != {m} or set(map(len, all_sizes)) != {m}:
            return None
        return list(itertools.chain.from_iterable(all_ptrs)), list(itertools.chain.from_iterable(all_sizes)), m
    except TypeError:
        return None


def _ragged(all_ptrs, all_sizes):
    """Whether some key's pointers and sizes differ in number."""
    try:
        return any(len(p) != len(s) for p, s in zip(all_ptrs, all_sizes))
    except TypeError:
        return True


def _same_lengths(*seqs):
    try:
        return len({len(s) for s in seqs}) <= 1
    except TypeError:
        return False


def _valid_segs(segs):
    """Whether every (ptr, size) is two ints, size >= 0, ptr > 0 when
    size is not 0."""
    try:
        for s in segs:
            for ptr, size in s:
                if size < 0 or (size and ptr <= 0) or int(ptr) != ptr or int(size) != size:
                    return False
    except (TypeError, ValueError):
        return False
    return True


def _copy_config(c, **changes):
    n = ReplicateConfig()
    n.__dict__.update(c.__dict__)
    n.__dict__.update(changes)
    return n
