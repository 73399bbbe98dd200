"""The few CUDA driver API calls the tensor helpers need, over ctypes.

libcuda.so.1 is loaded with dlopen on first use (no toolkit, no headers, no
compiled extension): ``$MOONCAKE_LIBCUDA`` if set, else ``libcuda.so.1``
from the loader's path, else ``/usr/local/nvidia/lib64/libcuda.so.1``.
Importing this module loads nothing; without a driver every entry point
raises ``CudaUnavailable``.

The daemon copies between GPU memory and the store on its own, so a client
names device memory by a CUDA IPC handle of the allocation that holds it
(``cuIpcGetMemHandle``) and the offset of the data in that allocation.
``ipc_location(ptr)`` computes both (plus the GPU's UUID) for any device
pointer, e.g. a PyTorch tensor's ``data_ptr()`` inside a block of the
caching allocator, and caches the handle per allocation: creating one is
costly, and the allocator hands out the same blocks again and again.
"""

import ctypes
import os
import threading
from contextlib import contextmanager
from typing import NamedTuple

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_DEINITIALIZED = 4
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_VALUE = 1

# CUpointer_attribute
POINTER_ATTRIBUTE_CONTEXT = 1
POINTER_ATTRIBUTE_MEMORY_TYPE = 2
POINTER_ATTRIBUTE_BUFFER_ID = 7
POINTER_ATTRIBUTE_IS_MANAGED = 8
POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10

# CUmemorytype
MEMORYTYPE_HOST = 1
MEMORYTYPE_DEVICE = 2
MEMORYTYPE_ARRAY = 3
MEMORYTYPE_UNIFIED = 4

IPC_HANDLE_SIZE = 64
UUID_SIZE = 16

LIBCUDA_PATHS = ("libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1")

CUresult = ctypes.c_int
CUdevice = ctypes.c_int
CUdeviceptr = ctypes.c_uint64
CUcontext = ctypes.c_void_p


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * UUID_SIZE)]


class CudaUnavailable(OSError):
    """No usable CUDA driver (libcuda.so.1 missing, a symbol missing, or
    cuInit failed)."""


class CudaError(RuntimeError):
    """A CUDA driver call failed; ``code`` is its CUresult, ``name`` its
    CUDA_ERROR_* name."""

    def __init__(self, func, code, name, text, what=None):
        self.func, self.code, self.name = func, code, name
        msg = f"{func}: {name or 'CUDA error'} ({code}): {text or 'unknown error'}"
        super().__init__(f"{what}: {msg}" if what else msg)


# name -> (argtypes, the symbols that implement it, in order of preference).
# Where the driver ABI versioned a call (_v2), only the versioned symbol
# has 64-bit arguments; the old one is never used for those.
_PROTOS = {
    "cuInit": ((ctypes.c_uint,), ("cuInit",)),
    "cuDriverGetVersion": ((ctypes.POINTER(ctypes.c_int),), ("cuDriverGetVersion",)),
    "cuGetErrorName": ((CUresult, ctypes.POINTER(ctypes.c_char_p)), ("cuGetErrorName",)),
    "cuGetErrorString": ((CUresult, ctypes.POINTER(ctypes.c_char_p)), ("cuGetErrorString",)),
    "cuDeviceGetCount": ((ctypes.POINTER(ctypes.c_int),), ("cuDeviceGetCount",)),
    "cuDeviceGet": ((ctypes.POINTER(CUdevice), ctypes.c_int), ("cuDeviceGet",)),
    "cuDeviceGetUuid": ((ctypes.POINTER(CUuuid), CUdevice), ("cuDeviceGetUuid_v2", "cuDeviceGetUuid")),
    "cuDevicePrimaryCtxRetain": ((ctypes.POINTER(CUcontext), CUdevice), ("cuDevicePrimaryCtxRetain",)),
    "cuCtxGetCurrent": ((ctypes.POINTER(CUcontext),), ("cuCtxGetCurrent",)),
    "cuCtxPushCurrent": ((CUcontext,), ("cuCtxPushCurrent_v2",)),
    "cuCtxPopCurrent": ((ctypes.POINTER(CUcontext),), ("cuCtxPopCurrent_v2",)),
    "cuPointerGetAttribute": ((ctypes.c_void_p, ctypes.c_int, CUdeviceptr), ("cuPointerGetAttribute",)),
    "cuMemGetAddressRange": ((ctypes.POINTER(CUdeviceptr), ctypes.POINTER(ctypes.c_size_t), CUdeviceptr),
                             ("cuMemGetAddressRange_v2",)),
    "cuIpcGetMemHandle": ((ctypes.POINTER(CUipcMemHandle), CUdeviceptr), ("cuIpcGetMemHandle",)),
}

# Entry points a driver may lack (older than CUDA 11.7): None where it does.
_OPTIONAL = {
    "cuMemGetHandleForAddressRange": ((ctypes.POINTER(ctypes.c_int), CUdeviceptr, ctypes.c_size_t, ctypes.c_int,
                                       ctypes.c_ulonglong), ("cuMemGetHandleForAddressRange",)),
}

MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1


def candidate_paths(env=None):
    """Where libcuda is looked for, in order."""
    env = os.environ if env is None else env
    paths = []
    if env.get("MOONCAKE_LIBCUDA"):
        paths.append(env["MOONCAKE_LIBCUDA"])
    paths.extend(p for p in LIBCUDA_PATHS if p not in paths)
    return paths


class Driver:
    """libcuda, loaded and initialised (cuInit(0)) once."""

    def __init__(self, paths=None):
        errors = []
        self.lib = None
        for p in paths or candidate_paths():
            try:
                self.lib = ctypes.CDLL(p, mode=os.RTLD_NOW | os.RTLD_LOCAL)
                self.path = p
                break
            except OSError as e:
                errors.append(f"{p}: {e}")
        if self.lib is None:
            raise CudaUnavailable(f"CUDA unavailable: cannot load libcuda ({'; '.join(errors)}); "
                                  "set MOONCAKE_LIBCUDA to its path")
        for optional, table in ((False, _PROTOS), (True, _OPTIONAL)):
            for name, (argtypes, symbols) in table.items():
                f = None
                for sym in symbols:
                    try:
                        f = getattr(self.lib, sym)
                        break
                    except AttributeError:
                        continue
                if f is None and not optional:
                    raise CudaUnavailable(f"CUDA unavailable: {self.path} has no {symbols[0]}")
                if f is not None:
                    f.argtypes, f.restype = argtypes, CUresult
                setattr(self, name, f)
        r = self.cuInit(0)
        if r != CUDA_SUCCESS:
            raise CudaUnavailable(f"CUDA unavailable: cuInit: {self.error_text(r)}")
        v = ctypes.c_int()
        self.version = v.value if self.cuDriverGetVersion(ctypes.byref(v)) == CUDA_SUCCESS else 0
        self._ctx = {}  # ordinal -> retained primary context
        self._lock = threading.Lock()

    def error_name(self, r):
        s = ctypes.c_char_p()
        if self.cuGetErrorName(r, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode()
        return None

    def error_string(self, r):
        s = ctypes.c_char_p()
        if self.cuGetErrorString(r, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return s.value.decode()
        return None

    def error_text(self, r):
        return f"{self.error_name(r) or 'CUDA error'} ({r}): {self.error_string(r) or 'unknown error'}"

    def check(self, func, r, what=None):
        """Raise CudaError unless r is CUDA_SUCCESS."""
        if r != CUDA_SUCCESS:
            raise CudaError(func, r, self.error_name(r), self.error_string(r), what)

    def device(self, ordinal):
        d = CUdevice()
        self.check("cuDeviceGet", self.cuDeviceGet(ctypes.byref(d), ordinal), f"device {ordinal}")
        return d.value

    def device_count(self):
        n = ctypes.c_int()
        self.check("cuDeviceGetCount", self.cuDeviceGetCount(ctypes.byref(n)))
        return n.value

    def uuid(self, ordinal):
        """The 16 raw bytes of the UUID of the GPU with this ordinal (as
        cuDeviceGetUuid_v2 reports it: a MIG instance's own UUID)."""
        u = CUuuid()
        self.check("cuDeviceGetUuid", self.cuDeviceGetUuid(ctypes.byref(u), self.device(ordinal)), f"device {ordinal}")
        return bytes(bytearray(ctypes.string_at(ctypes.addressof(u), UUID_SIZE)))

    def primary_context(self, ordinal):
        """The primary context of the device (what the CUDA runtime and so
        PyTorch use), retained once for the life of the process."""
        with self._lock:
            ctx = self._ctx.get(ordinal)
            if ctx is None:
                c = CUcontext()
                self.check("cuDevicePrimaryCtxRetain",
                           self.cuDevicePrimaryCtxRetain(ctypes.byref(c), self.device(ordinal)), f"device {ordinal}")
                ctx = self._ctx[ordinal] = c.value
            return ctx

    @contextmanager
    def context(self, ordinal):
        """Make the device's primary context current for the block (pushed
        and popped: whatever was current before is current after)."""
        self.check("cuCtxPushCurrent", self.cuCtxPushCurrent(self.primary_context(ordinal)))
        try:
            yield
        finally:
            old = CUcontext()
            self.cuCtxPopCurrent(ctypes.byref(old))

    def _attribute(self, ptr, attr, ctype):
        # The driver writes a bool, an unsigned int, an int or an unsigned
        # long long depending on attr: read it from zeroed 8-byte storage.
        raw = ctypes.c_uint64(0)
        r = self.cuPointerGetAttribute(ctypes.byref(raw), attr, ptr)
        if r != CUDA_SUCCESS:
            return r, None
        return r, ctype.from_buffer(raw).value

    def attribute(self, ptr, attr, ctype):
        """Pointer attribute attr of ptr as ctype (c_int, c_uint, c_uint64)."""
        r, v = self._attribute(ptr, attr, ctype)
        self.check("cuPointerGetAttribute", r, f"pointer {ptr:#x} attribute {attr}")
        return v

    def try_attribute(self, ptr, attr, ctype):
        """The attribute, or None where the driver does not give it (an old
        driver, or memory it does not know)."""
        return self._attribute(ptr, attr, ctype)[1]

    def address_range(self, ptr):
        """(base, size) of the allocation that contains device pointer ptr."""
        base, size = CUdeviceptr(), ctypes.c_size_t()
        self.check("cuMemGetAddressRange_v2", self.cuMemGetAddressRange(ctypes.byref(base), ctypes.byref(size), ptr),
                   f"pointer {ptr:#x}")
        return base.value, size.value

    def ipc_handle(self, base):
        """cuIpcGetMemHandle of the allocation starting at base: 64 bytes."""
        h = CUipcMemHandle()
        self.check("cuIpcGetMemHandle", self.cuIpcGetMemHandle(ctypes.byref(h), base), f"allocation {base:#x}")
        return bytes(bytearray(ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_SIZE)))


    def dmabuf(self, base, size):
        """A dma-buf descriptor exporting size bytes of device memory at
        base (a whole allocation: cuMemGetHandleForAddressRange wants host
        page alignment), which the caller closes; None where the driver
        cannot export one."""
        if self.cuMemGetHandleForAddressRange is None:
            return None
        fd = ctypes.c_int(-1)
        r = self.cuMemGetHandleForAddressRange(ctypes.byref(fd), base, size, MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        if r != CUDA_SUCCESS or fd.value < 0:
            return None
        return fd.value


_driver = None
_driver_lock = threading.Lock()


def driver():
    """The process's Driver, loaded on first use; CudaUnavailable without one."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = Driver()
        return _driver


def available():
    """Whether a CUDA driver can be loaded and initialised."""
    try:
        driver()
        return True
    except CudaUnavailable:
        return False


class IPCLocation(NamedTuple):
    """Where device memory is, in the terms of PUT_CUDA/GET_CUDA."""

    handle: bytes   # cuIpcGetMemHandle of the allocation (64 bytes)
    dev_off: int    # offset of the pointer in the allocation
    device: bytes   # UUID of the GPU (16 bytes)
    base: int       # the allocation's base address in this process
    size: int       # the allocation's size
    ordinal: int    # the device's CUDA ordinal in this process


class _Block(NamedTuple):
    handle: bytes
    base: int
    size: int
    device: bytes
    ordinal: int


# locate_columns notes the blocks a call confirmed under the 2 MiB
# granules they cover (CUDA's allocation granularity), up to this many
# granules a block (larger ones it looks through).
_GRANULE_SHIFT = 21
_GRANULES_NOTED = 16


class HandleCache:
    """IPC handles per allocation, keyed by the allocation's process-wide
    unique buffer id (CU_POINTER_ATTRIBUTE_BUFFER_ID) where the driver has
    it, so that an allocation freed and made again at the same address
    never reuses a stale handle; else by (device, base, size). Bounded:
    the oldest entries go first (a dropped handle costs only its making)."""

    def __init__(self, max_entries=4096):
        self.max_entries = max_entries
        self._blocks = {}
        self._uuids = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def clear(self):
        with self._lock:
            self._blocks.clear()

    def __len__(self):
        return len(self._blocks)

    def _uuid(self, drv, ordinal):
        u = self._uuids.get(ordinal)
        if u is None:
            u = self._uuids[ordinal] = drv.uuid(ordinal)
        return u

    def locate(self, ptr, length=0, ordinal=None):
        """IPCLocation of device pointer ptr, whose length bytes must lie in
        one allocation. ordinal, when known (a tensor's device index), makes
        that device's primary context current for the queries; else it is
        found from the pointer."""
        drv = driver()
        if not ptr:
            raise ValueError("null device pointer")
        if ordinal is None:
            ordinal = drv.try_attribute(ptr, POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_int)
            if ordinal is None:
                raise ValueError(f"{ptr:#x} is not device memory known to CUDA in this process")
        with drv.context(ordinal):
            buf_id = drv.try_attribute(ptr, POINTER_ATTRIBUTE_BUFFER_ID, ctypes.c_uint64)
            if buf_id:
                # The id is unique to one allocation for the life of the
                # process: a block seen under it, holding ptr, is current.
                with self._lock:
                    blk = self._blocks.get((ordinal, buf_id))
                    if blk is not None and blk.base <= ptr and ptr + length <= blk.base + blk.size:
                        self.hits += 1
                        self._blocks[(ordinal, buf_id)] = self._blocks.pop((ordinal, buf_id))
                        return IPCLocation(blk.handle, ptr - blk.base, blk.device, blk.base, blk.size, blk.ordinal)
            mtype = drv.try_attribute(ptr, POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint)
            if mtype != MEMORYTYPE_DEVICE:
                kind = "unknown to CUDA" if mtype is None else f"CUmemorytype {mtype}"
                raise ValueError(f"{ptr:#x} is not device memory ({kind}); host memory goes through PUT_VM/GET_VM")
            if drv.try_attribute(ptr, POINTER_ATTRIBUTE_IS_MANAGED, ctypes.c_uint):
                raise ValueError(f"{ptr:#x} is managed (unified) memory, which has no CUDA IPC handle")
            dev = drv.try_attribute(ptr, POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_int)
            if dev is not None and dev != ordinal:
                raise ValueError(f"{ptr:#x} is on CUDA device {dev}, not {ordinal}")
            base, size = drv.address_range(ptr)
            key = (ordinal, buf_id) if buf_id else (ordinal, base, size)
            with self._lock:
                blk = self._blocks.get(key)
                if blk is not None and (blk.base, blk.size) == (base, size):
                    self.hits += 1
                    self._blocks[key] = self._blocks.pop(key)  # most recently used last
                else:
                    blk = None
                    self.misses += 1
            if blk is None:
                if drv.try_attribute(ptr, POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_uint) == 0:
                    raise ValueError(
                        f"{ptr:#x}: its allocation cannot be shared with cuIpcGetMemHandle (memory from "
                        "cuMemCreate/cudaMallocAsync, e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                        "or backend:cudaMallocAsync); use PyTorch's default allocator settings")
                blk = _Block(drv.ipc_handle(base), base, size, self._uuid(drv, ordinal), ordinal)
                with self._lock:
                    self._blocks[key] = blk
                    while len(self._blocks) > self.max_entries:
                        self._blocks.pop(next(iter(self._blocks)))
        off = ptr - blk.base
        if off + length > blk.size:
            raise ValueError(f"{length} bytes at {ptr:#x} run past the end of its allocation "
                             f"({blk.size} bytes at {blk.base:#x})")
        return IPCLocation(blk.handle, off, blk.device, blk.base, blk.size, blk.ordinal)

    def locate_many(self, ptrs, lengths, ordinal):
        """[(handle, device, offset)] of device pointers ptrs on device
        ordinal, each with its length in one allocation, as locate's (and
        raising as it does); see locate_columns."""
        refs, idx, offs = self.locate_columns(ptrs, lengths, ordinal)
        return [refs[i] + (off,) for i, off in zip(idx, offs)]

    def locate_columns(self, ptrs, lengths, ordinal):
        """(refs, idx, offs) of device pointers ptrs on device ordinal, each
        with its length in one allocation: refs the (handle, device) of
        each allocation they are in, in the order first met; idx[i] the
        index in refs of ptrs[i]'s allocation, offs[i] its offset there
        (locate's answers, and its errors). The device's context is made
        current once, and the driver asked once per allocation of the call
        where it is cached, the batch calls' common case. The caller holds
        the memory of every pointer for the call, so an allocation checked
        here (by its buffer id) stays where it is: a later pointer inside
        its range is in it, as allocations do not overlap, and needs no
        query of its own."""
        drv = driver()
        raw = ctypes.c_uint64(0)
        ref, get, buf_attr = ctypes.byref(raw), drv.cuPointerGetAttribute, POINTER_ATTRIBUTE_BUFFER_ID
        blocks = self._blocks
        # seen: the blocks this call confirmed, by the 2 MiB granules they
        # cover (each granule's list: (block, its refs index)), so that a
        # pointer outside the last one's block finds its own with one
        # lookup, whatever order the tensors' allocations come in (a
        # caching allocator's blocks rarely come in address order); big:
        # those too large to note granule by granule, looked through.
        seen, big, gran = {}, [], _GRANULE_SHIFT
        refs, idx, offs, at = [], [], [], {}
        add_idx, add_off = idx.append, offs.append
        lo, hi, cur = 1, 0, -1  # the range and refs index of the last pointer's block
        with drv.context(ordinal):
            for ptr, length in zip(ptrs, lengths):
                if lo <= ptr < hi and ptr + length <= hi:  # the common case: in the last one's block
                    add_idx(cur)
                    add_off(ptr - lo)
                    continue
                end = ptr + length
                for blk, cur in seen.get(ptr >> gran, ()):
                    if blk.base <= ptr < blk.base + blk.size and end <= blk.base + blk.size:
                        break
                else:
                    for blk, cur in big:
                        if blk.base <= ptr < blk.base + blk.size and end <= blk.base + blk.size:
                            break
                    else:
                        blk = None
                if blk is None:
                    raw.value = 0
                    if ptr and get(ref, buf_attr, ptr) == 0 and raw.value:
                        key = (ordinal, raw.value)
                        with self._lock:
                            blk = blocks.get(key)
                            if blk is not None and blk.base <= ptr and end <= blk.base + blk.size:
                                self.hits += 1
                                blocks[key] = blocks.pop(key)  # most recently used last
                            else:
                                blk = None
                    if blk is None:
                        loc = self.locate(ptr, length, ordinal)
                        blk = _Block(loc.handle, loc.base, loc.size, loc.device, loc.ordinal)
                    pair = (blk.handle, blk.device)
                    cur = at.get(pair)
                    if cur is None:
                        cur = at[pair] = len(refs)
                        refs.append(pair)
                    first, last = blk.base >> gran, (blk.base + blk.size - 1) >> gran
                    if last - first < _GRANULES_NOTED:
                        for g in range(first, last + 1):
                            seen.setdefault(g, []).append((blk, cur))
                    else:
                        big.append((blk, cur))
                lo, hi = blk.base, blk.base + blk.size
                add_idx(cur)
                add_off(ptr - lo)
        return refs, idx, offs


handles = HandleCache()


def ipc_location(ptr, length=0, ordinal=None):
    """IPCLocation of device pointer ptr (see HandleCache.locate), from the
    process-wide handle cache."""
    return handles.locate(ptr, length, ordinal)
