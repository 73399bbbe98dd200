"""The mooncake-fs ioctl ABI (1.8), mirrored from ioctl/mooncake_fs.h.

Every argument is a fixed-size, 8-byte-aligned, little-endian struct that
starts with {size, flags}; ``size`` must be ``sizeof(struct)``. The classes
below set it in ``__init__``. Sizes are asserted at import, and the tests
compare every offset with the C header (python/tests/test_abi.py) and with
the Go encoders (tests/python_test.go).
"""

import ctypes
import sys

if sys.byteorder != "little":  # pragma: no cover - the ABI is little-endian
    raise ImportError("mooncake_fs: the ioctl ABI is little-endian only")

_S = ctypes.LittleEndianStructure

# Linux asm-generic/ioctl.h
_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
_IOC_WRITE, _IOC_READ = 1, 2
MAX_ARG_SIZE = (1 << _IOC_SIZEBITS) - 1


def _IOC(d, nr, size):
    assert 0 < size <= MAX_ARG_SIZE
    return (d << _IOC_DIRSHIFT) | (size << _IOC_SIZESHIFT) | (IOC_TYPE << _IOC_TYPESHIFT) | (nr << _IOC_NRSHIFT)


IOC_TYPE = ord("M")
MAGIC = 0x454B41434E4F4F4D  # "MOONCAKE" little-endian
ABI_MAJOR = 1
ABI_MINOR = 9

KIND_HOST = 1  # REGISTER_BUFFER of a memfd/shm fd of the caller
KIND_CUDA = 2  # REGISTER_BUFFER of GPU memory: handle = cuIpcGetMemHandle, offset in it
KIND_VM = 3    # REGISTER_BUFFER of an address range of this process (fd -1, offset = address; 1.3)
REGISTER_DMABUF = 1 << 0  # KIND_CUDA flag (1.5): fd = dma-buf of the whole allocation, for GPUDirect RDMA

FLAG_EXCL = 1 << 0    # put: EEXIST if the key exists (first writer wins)
FLAG_UPDATE = 1 << 1  # put: write at obj_off into a copy of the current version
FLAG_PARENTS = 1 << 2  # batch/key put (ABI 1.4): create the key's missing parent directories
FLAG_WHOLE = 1 << 3  # batch/key get (ABI 1.6): EOVERFLOW, nothing moved, if the value is longer than the buffers

MAX_BATCH = 64
BATCH_BUF = 0  # entry addr is an offset in the registered buffer ``id``
BATCH_VM = 1   # entry addr is an address in the caller's memory


class Header(_S):
    _fields_ = [("size", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


class _Arg(_S):
    """Base of the argument structs: sets h.size on construction."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.h.size = ctypes.sizeof(self)


class Magic(_Arg):
    _fields_ = [("h", Header), ("magic", ctypes.c_uint64)]


class ABIVersion(_Arg):
    _fields_ = [("h", Header), ("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class Register(_Arg):
    _fields_ = [
        ("h", Header),
        ("fd", ctypes.c_int32),
        ("kind", ctypes.c_uint32),
        ("len", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("id", ctypes.c_uint64),
        ("handle", ctypes.c_uint8 * 64),
    ]


class Unregister(_Arg):
    _fields_ = [("h", Header), ("id", ctypes.c_uint64)]


class Buf(_Arg):
    _fields_ = [
        ("h", Header),
        ("id", ctypes.c_uint64),
        ("buf_off", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("obj_off", ctypes.c_uint64),
        ("result", ctypes.c_uint64),
        ("version", ctypes.c_uint64),
    ]


class VM(_Arg):
    _fields_ = [
        ("h", Header),
        ("addr", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("obj_off", ctypes.c_uint64),
        ("result", ctypes.c_uint64),
        ("version", ctypes.c_uint64),
    ]


class Stat(_Arg):
    _fields_ = [
        ("h", Header),
        ("size", ctypes.c_uint64),
        ("version", ctypes.c_uint64),
        ("ino", ctypes.c_uint64),
        ("mtime_ns", ctypes.c_int64),
        ("mode", ctypes.c_uint32),
        ("pinned", ctypes.c_uint32),
        ("replicas", ctypes.c_uint32),
        ("extents", ctypes.c_uint32),
        ("location", ctypes.c_char * 192),
    ]


class BatchEntry(_S):
    _fields_ = [
        ("key_off", ctypes.c_uint16),
        ("key_len", ctypes.c_uint16),
        ("flags", ctypes.c_uint32),
        ("addr", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("obj_off", ctypes.c_uint64),
        ("result", ctypes.c_int64),
        ("version", ctypes.c_uint64),
    ]


BATCH_HEAD = 24
BATCH_SIZE = MAX_ARG_SIZE & ~7  # 16376: the largest multiple of 8 an ioctl carries
BATCH_KEY_BYTES = BATCH_SIZE - BATCH_HEAD - MAX_BATCH * 48  # 13280


class Batch(_Arg):
    _fields_ = [
        ("h", Header),
        ("count", ctypes.c_uint32),
        ("source", ctypes.c_uint32),
        ("id", ctypes.c_uint64),
        ("entries", BatchEntry * MAX_BATCH),
        ("keys", ctypes.c_uint8 * BATCH_KEY_BYTES),
    ]


# ABI 1.8: a batch whose entries (BatchEntry, mc_batch's layout) and keys
# stay in the caller's memory; the daemon reads them when the call starts
# and writes the entries back with their results when it ends.
MAX_TABLE = 1024
MAX_TABLE_KEY_BYTES = 1 << 16


class Table(_Arg):
    _fields_ = [
        ("h", Header),
        ("count", ctypes.c_uint32),
        ("source", ctypes.c_uint32),
        ("id", ctypes.c_uint64),
        ("entries", ctypes.c_uint64),
        ("keys", ctypes.c_uint64),
        ("keys_len", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class CUDA(_Arg):
    """GPU memory of the caller (ABI 1.2): one copy between it and the store."""

    _fields_ = [
        ("h", Header),
        ("handle", ctypes.c_uint8 * 64),  # cuIpcGetMemHandle of the allocation
        ("dev_off", ctypes.c_uint64),     # offset of the data in the allocation
        ("len", ctypes.c_uint64),
        ("obj_off", ctypes.c_uint64),
        ("result", ctypes.c_uint64),      # out: bytes moved
        ("version", ctypes.c_uint64),     # out
        ("device", ctypes.c_uint8 * 16),  # GPU UUID; all zero: the first GPU
    ]


# ABI 1.3: one key by name (PUT_KEY/GET_KEY) and vector batches.
SRC_BUF, SRC_VM, SRC_CUDA = 0, 1, 2
MAX_META = 128
KEY_SIZE = 1024
KEY_KEY_BYTES = KEY_SIZE - 280
MAX_GPU_REFS = 16
MAX_SEGS = 256
SEG_VM = 0
SEG_GPU = 1 << 63
VBATCH_HEAD = 16 + MAX_BATCH * 48 + MAX_GPU_REFS * 80
VBATCH_AREA_BYTES = BATCH_SIZE - VBATCH_HEAD


class GPURef(_S):
    _fields_ = [("handle", ctypes.c_uint8 * 64), ("device", ctypes.c_uint8 * 16)]


class Key(_Arg):
    """PUT_KEY / GET_KEY on a directory: one key, one buffer, its meta."""

    _fields_ = [
        ("h", Header),
        ("source", ctypes.c_uint32),
        ("key_len", ctypes.c_uint16),
        ("meta_len", ctypes.c_uint16),
        ("id", ctypes.c_uint64),
        ("addr", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("obj_off", ctypes.c_uint64),
        ("result", ctypes.c_uint64),   # out: bytes moved
        ("version", ctypes.c_uint64),  # out
        ("size", ctypes.c_uint64),     # out (get): the value's size
        ("gpu", GPURef),
        ("meta", ctypes.c_uint8 * MAX_META),
        ("key", ctypes.c_uint8 * KEY_KEY_BYTES),
    ]


# ABI 1.9: a key whose value (at most INLINE_BYTES) travels in the call:
# k.h.size = sizeof(KeyInline), k.source = SRC_INLINE, k.len its length.
SRC_INLINE = 3
INLINE_BYTES = 4096


class KeyInline(_S):
    """PUT_KEY_INLINE / GET_KEY_INLINE: a Key and the value's bytes."""

    _fields_ = [("k", Key), ("data", ctypes.c_uint8 * INLINE_BYTES)]

    def __init__(self, **kw):
        super().__init__(**kw)
        self.k.h.size = ctypes.sizeof(self)


class Seg(_S):
    _fields_ = [("id", ctypes.c_uint64), ("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class VBatchEntry(_S):
    _fields_ = [
        ("key_off", ctypes.c_uint16),
        ("key_len", ctypes.c_uint16),
        ("flags", ctypes.c_uint32),
        ("seg_off", ctypes.c_uint32),
        ("nseg", ctypes.c_uint32),
        ("meta_off", ctypes.c_uint32),
        ("meta_len", ctypes.c_uint32),
        ("obj_off", ctypes.c_uint64),
        ("result", ctypes.c_int64),
        ("version", ctypes.c_uint64),
    ]


class VBatch(_Arg):
    _fields_ = [
        ("h", Header),
        ("count", ctypes.c_uint32),
        ("ngpu", ctypes.c_uint32),
        ("entries", VBatchEntry * MAX_BATCH),
        ("gpus", GPURef * MAX_GPU_REFS),
        ("area", ctypes.c_uint8 * VBATCH_AREA_BYTES),
    ]


SIZES = {
    "mc_header": (Header, 8),
    "mc_magic": (Magic, 16),
    "mc_abi_version": (ABIVersion, 16),
    "mc_register": (Register, 104),
    "mc_unregister": (Unregister, 16),
    "mc_buf": (Buf, 56),
    "mc_vm": (VM, 48),
    "mc_stat": (Stat, 248),
    "mc_batch_entry": (BatchEntry, 48),
    "mc_batch": (Batch, BATCH_SIZE),
    "mc_cuda": (CUDA, 128),
    "mc_gpu_ref": (GPURef, 80),
    "mc_key": (Key, KEY_SIZE),
    "mc_seg": (Seg, 24),
    "mc_vbatch_entry": (VBatchEntry, 48),
    "mc_vbatch": (VBatch, BATCH_SIZE),
    "mc_table": (Table, 48),
    "mc_key_inline": (KeyInline, KEY_SIZE + INLINE_BYTES),
}
for _name, (_cls, _size) in SIZES.items():
    if ctypes.sizeof(_cls) != _size or _size % 8:
        raise ImportError(f"mooncake_fs: struct {_name} is {ctypes.sizeof(_cls)} B, ABI says {_size}")
del _name, _cls, _size

_RW = _IOC_READ | _IOC_WRITE
GET_MAGIC = _IOC(_IOC_READ, 0x01, ctypes.sizeof(Magic))
GET_ABI_VERSION = _IOC(_IOC_READ, 0x02, ctypes.sizeof(ABIVersion))
REGISTER_BUFFER = _IOC(_RW, 0x10, ctypes.sizeof(Register))
UNREGISTER_BUFFER = _IOC(_IOC_WRITE, 0x11, ctypes.sizeof(Unregister))
PUT_BUF = _IOC(_RW, 0x12, ctypes.sizeof(Buf))
GET_BUF = _IOC(_RW, 0x13, ctypes.sizeof(Buf))
PUT_VM = _IOC(_RW, 0x14, ctypes.sizeof(VM))
GET_VM = _IOC(_RW, 0x15, ctypes.sizeof(VM))
STAT = _IOC(_RW, 0x16, ctypes.sizeof(Stat))
BATCH_PUT = _IOC(_RW, 0x17, ctypes.sizeof(Batch))
BATCH_GET = _IOC(_RW, 0x18, ctypes.sizeof(Batch))
PUT_CUDA = _IOC(_RW, 0x19, ctypes.sizeof(CUDA))  # 0xc0804d19
GET_CUDA = _IOC(_RW, 0x1A, ctypes.sizeof(CUDA))  # 0xc0804d1a
PUT_KEY = _IOC(_RW, 0x1B, ctypes.sizeof(Key))
GET_KEY = _IOC(_RW, 0x1C, ctypes.sizeof(Key))
BATCH_PUTV = _IOC(_RW, 0x1D, ctypes.sizeof(VBatch))
BATCH_GETV = _IOC(_RW, 0x1E, ctypes.sizeof(VBatch))
# ABI 1.7: VBATCH_ASYNC in a vector batch's header flags submits it (the
# ioctl's value is its number on the directory fd); BATCH_WAIT, count = the
# number, returns it with its results (count 0: waits for all, consumes none).
BATCH_WAIT = _IOC(_RW, 0x1F, ctypes.sizeof(VBatch))
VBATCH_ASYNC = 1 << 0
MAX_ASYNC_CALLS = 16
BATCH_PUT_TABLE = _IOC(_RW, 0x20, ctypes.sizeof(Table))
BATCH_GET_TABLE = _IOC(_RW, 0x21, ctypes.sizeof(Table))
PUT_KEY_INLINE = _IOC(_RW, 0x22, ctypes.sizeof(KeyInline))
GET_KEY_INLINE = _IOC(_RW, 0x23, ctypes.sizeof(KeyInline))

COMMANDS = {
    "MC_IOC_GET_MAGIC": GET_MAGIC,
    "MC_IOC_GET_ABI_VERSION": GET_ABI_VERSION,
    "MC_IOC_REGISTER_BUFFER": REGISTER_BUFFER,
    "MC_IOC_UNREGISTER_BUFFER": UNREGISTER_BUFFER,
    "MC_IOC_PUT_BUF": PUT_BUF,
    "MC_IOC_GET_BUF": GET_BUF,
    "MC_IOC_PUT_VM": PUT_VM,
    "MC_IOC_GET_VM": GET_VM,
    "MC_IOC_STAT": STAT,
    "MC_IOC_BATCH_PUT": BATCH_PUT,
    "MC_IOC_BATCH_GET": BATCH_GET,
    "MC_IOC_PUT_CUDA": PUT_CUDA,
    "MC_IOC_GET_CUDA": GET_CUDA,
    "MC_IOC_PUT_KEY": PUT_KEY,
    "MC_IOC_GET_KEY": GET_KEY,
    "MC_IOC_BATCH_PUTV": BATCH_PUTV,
    "MC_IOC_BATCH_GETV": BATCH_GETV,
    "MC_IOC_BATCH_WAIT": BATCH_WAIT,
    "MC_IOC_BATCH_PUT_TABLE": BATCH_PUT_TABLE,
    "MC_IOC_BATCH_GET_TABLE": BATCH_GET_TABLE,
    "MC_IOC_PUT_KEY_INLINE": PUT_KEY_INLINE,
    "MC_IOC_GET_KEY_INLINE": GET_KEY_INLINE,
}

# C struct name -> (class, {C field path: python attribute path}) for the
# offset checks; nested C fields use dots ("h.size").
STRUCTS = {
    "mc_header": (Header, ["size", "flags"]),
    "mc_magic": (Magic, ["h", "h.size", "h.flags", "magic"]),
    "mc_abi_version": (ABIVersion, ["h", "major", "minor"]),
    "mc_register": (Register, ["h", "fd", "kind", "len", "offset", "id", "handle"]),
    "mc_unregister": (Unregister, ["h", "id"]),
    "mc_buf": (Buf, ["h", "id", "buf_off", "len", "obj_off", "result", "version"]),
    "mc_vm": (VM, ["h", "addr", "len", "obj_off", "result", "version"]),
    "mc_stat": (Stat, ["h", "size", "version", "ino", "mtime_ns", "mode", "pinned", "replicas", "extents", "location"]),
    "mc_batch_entry": (BatchEntry, ["key_off", "key_len", "flags", "addr", "len", "obj_off", "result", "version"]),
    "mc_batch": (Batch, ["h", "count", "source", "id", "entries", "keys"]),
    "mc_cuda": (CUDA, ["h", "h.size", "h.flags", "handle", "dev_off", "len", "obj_off", "result", "version", "device"]),
    "mc_gpu_ref": (GPURef, ["handle", "device"]),
    "mc_key": (Key, ["h", "h.flags", "source", "key_len", "meta_len", "id", "addr", "len", "obj_off", "result", "version", "size",
                     "gpu", "meta", "key"]),
    "mc_seg": (Seg, ["id", "off", "len"]),
    "mc_vbatch_entry": (VBatchEntry, ["key_off", "key_len", "flags", "seg_off", "nseg", "meta_off", "meta_len", "obj_off",
                                      "result", "version"]),
    "mc_vbatch": (VBatch, ["h", "count", "ngpu", "entries", "gpus", "area"]),
    "mc_table": (Table, ["h", "count", "source", "id", "entries", "keys", "keys_len", "pad"]),
    "mc_key_inline": (KeyInline, ["k", "data"]),
}


def offset_of(cls, path):
    """Byte offset of a (dotted) field path in ctypes struct cls."""
    off = 0
    for part in path.split("."):
        f = getattr(cls, part)
        off += f.offset
        cls = dict((n, t) for n, t, *_ in cls._fields_)[part]
    return off


def field_size(cls, path):
    for part in path.split("."):
        cls = dict((n, t) for n, t, *_ in cls._fields_)[part]
    return ctypes.sizeof(cls)


def layout():
    """The ABI as a dict (for cross-checks from other languages)."""
    return {
        "magic": MAGIC,
        "abi": [ABI_MAJOR, ABI_MINOR],
        "commands": dict(COMMANDS),
        "structs": {
            name: {
                "size": ctypes.sizeof(cls),
                "fields": {p: [offset_of(cls, p), field_size(cls, p)] for p in fields},
            }
            for name, (cls, fields) in STRUCTS.items()
        },
        "flags": {"MC_FLAG_EXCL": FLAG_EXCL, "MC_FLAG_UPDATE": FLAG_UPDATE, "MC_FLAG_PARENTS": FLAG_PARENTS, "MC_FLAG_WHOLE": FLAG_WHOLE,
                  "MC_REGISTER_DMABUF": REGISTER_DMABUF},
        "batch": {"MC_MAX_BATCH": MAX_BATCH, "MC_BATCH_BUF": BATCH_BUF, "MC_BATCH_VM": BATCH_VM, "key_bytes": BATCH_KEY_BYTES},
        "kinds": {"MC_KIND_HOST": KIND_HOST, "MC_KIND_CUDA": KIND_CUDA, "MC_KIND_VM": KIND_VM},
        "key": {"MC_SRC_BUF": SRC_BUF, "MC_SRC_VM": SRC_VM, "MC_SRC_CUDA": SRC_CUDA, "MC_MAX_META": MAX_META,
                "MC_MAX_GPU_REFS": MAX_GPU_REFS, "MC_MAX_SEGS": MAX_SEGS, "MC_SEG_GPU": SEG_GPU,
                "MC_SRC_INLINE": SRC_INLINE, "MC_INLINE_BYTES": INLINE_BYTES},
    }


if __name__ == "__main__":
    import json

    json.dump(layout(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
