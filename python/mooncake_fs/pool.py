"""A registered buffer pool: one memfd, mapped once, registered once.

``BufferPool(path, slot_size, slots)`` creates a memfd of ``slots`` slots,
maps it, and registers it with REGISTER_BUFFER exactly once, on ``path``:

- a directory: keys are relative to it and every call is a BATCH_PUT /
  BATCH_GET with source BATCH_BUF (one key or many per call);
- a file (created if missing): the pool serves that one key with
  PUT_BUF / GET_BUF (pass key=None).

Slots are handed out as leases. When none is free the policy is explicit:
``wait=False`` raises PoolExhausted at once; ``wait=True`` waits up to
``timeout`` seconds (None: forever) and then raises PoolExhausted. The
pool never registers more memory behind your back.

Zero-copy reads: ``get_view(key)`` reads the object into a leased slot with
one copy and returns a memoryview of the slot; ``get_array`` a numpy array
over it. The slot goes back to the pool when the last view of it
(memoryview slices, casts, numpy views, anything that keeps the buffer
exported) is gone, never before: the slot memory is a ctypes array whose
``weakref.finalize`` returns the slot, and every view holds it through the
buffer protocol.
"""

import collections
import ctypes
import errno
import gc
import mmap
import os
import threading
import weakref

from . import _abi
from ._buffer import pinned
from .client import BatchError, Directory, Entry, File, _contiguous, _numpy


class PoolExhausted(RuntimeError):
    """No slot was free (at once, or within the wait timeout)."""


class ObjectTooLarge(ValueError):
    """The object (from the offset) does not fit in one slot."""


class PoolClosed(ValueError):
    """The pool was closed."""


_DEFAULT = object()


class _Slots:
    """The memory side of a pool: a memfd of equal slots and their leases.

    Slot i covers [i*stride, i*stride+stride) of the memfd. stride leaves at
    least one byte after slot_size, so a read of slot_size+1 bytes tells a
    complete object of slot_size bytes from a larger one without spilling
    into the next slot.
    """

    def __init__(self, slot_size, slots, *, name="mooncake-pool", collect=True):
        if slot_size <= 0 or slots <= 0:
            raise ValueError(f"slot_size {slot_size} and slots {slots} must be positive")
        self.slot_size = int(slot_size)
        self.slots = int(slots)
        page = mmap.PAGESIZE
        self.stride = (self.slot_size + 1 + page - 1) // page * page
        self.nbytes = self.stride * self.slots
        self.collect = collect
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self.map = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self._close_fd = weakref.finalize(self, os.close, self.fd)  # if never closed
        self._close_fd.atexit = False
        probe = ctypes.c_char.from_buffer(self.map)
        self.base = ctypes.addressof(probe)
        del probe
        self._mem = ctypes.c_ubyte * self.stride
        self._free = collections.deque(range(self.slots))
        # Reentrant: a finalizer returning a slot may run (gc) in a thread
        # that already holds the lock.
        self._cond = threading.Condition(threading.RLock())
        self.closed = False
        self.leases = 0
        self.waits = 0
        self.exhausted = 0
        self.peak = 0

    def take(self, wait, timeout):
        """Lease a slot: return (slot index, owner), where owner is the ctypes
        array over the slot whose death returns the slot."""
        with self._cond:
            self._check()
            ok = bool(self._free)
        if not ok and self.collect:
            gc.collect()  # views caught in reference cycles
        with self._cond:
            self._check()
            if not self._free:
                if not wait:
                    self.exhausted += 1
                    raise PoolExhausted(f"all {self.slots} slots of {self.slot_size} B are leased")
                self.waits += 1
                if not self._cond.wait_for(lambda: self._free or self.closed, timeout):
                    self.exhausted += 1
                    raise PoolExhausted(f"no slot of {self.slots} freed within {timeout} s")
                self._check()
            return self._pop()

    def try_take(self):
        """Lease a free slot at once, or return None (no wait, no counting)."""
        with self._cond:
            self._check()
            return self._pop() if self._free else None

    def _pop(self):
        """Take the first free slot (lock held): (slot, owner)."""
        slot = self._free.popleft()
        try:
            owner = self._mem.from_buffer(self.map, slot * self.stride)
            fin = weakref.finalize(owner, self._give_back, slot)
        except BaseException:
            self._free.appendleft(slot)
            raise
        fin.atexit = False
        self.leases += 1
        self.peak = max(self.peak, self.slots - len(self._free))
        return slot, owner

    def _give_back(self, slot):
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def _check(self):
        if self.closed:
            raise PoolClosed("pool is closed")

    @property
    def free(self):
        return len(self._free)

    def close(self):
        """Close the memfd and unmap once no lease is left; live views keep
        the mapping (the mmap object) until they die."""
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._cond.notify_all()
        self._close_fd()
        try:
            self.map.close()
        except BufferError:
            pass  # views alive: the mapping goes when they do


class Lease:
    """One slot of a pool. ``buffer`` is a writable memoryview of its
    slot_size bytes. The slot returns to the pool after release() (or when
    the lease is garbage) and once no view of it is left."""

    __slots__ = ("pool", "slot", "offset", "capacity", "_owner", "__weakref__")

    def __init__(self, pool, slot, owner):
        self.pool = pool
        self.slot = slot
        self.offset = slot * pool._slots.stride  # in the registered buffer
        self.capacity = pool.slot_size
        self._owner = owner

    @property
    def address(self):
        return ctypes.addressof(self._mem())

    def _mem(self):
        if self._owner is None:
            raise ValueError("lease released")
        return self._owner

    @property
    def buffer(self):
        return memoryview(self._mem()).cast("B")[: self.capacity]

    def view(self, n, writable=False):
        """A memoryview of the first n bytes that keeps the slot leased."""
        mv = memoryview(self._mem()).cast("B")[:n]
        return mv if writable else mv.toreadonly()

    def release(self):
        self._owner = None

    @property
    def released(self):
        return self._owner is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class BufferPool:
    """A pool of slot_size-byte slots registered once on path (a directory
    of the mount, or a file there). See the module docstring."""

    def __init__(self, path, slot_size, slots, *, wait=False, timeout=None, collect=True):
        self.path = os.fspath(path)
        self.wait = wait
        self.timeout = timeout
        self._slots = _Slots(slot_size, slots, collect=collect)
        self.slot_size = self._slots.slot_size
        try:
            if os.path.isdir(self.path):
                self._h = Directory(self.path)
                self.is_dir = True
            else:
                self._h = File(self.path, "w")
                self.is_dir = False
            self.id = self._h.register(self._slots.fd, self._slots.nbytes, 0)
        except BaseException:
            if getattr(self, "_h", None) is not None:
                self._h.close()
            self._slots.close()
            raise
        self.registrations = 1
        self.registered_bytes = self._slots.nbytes

    # --- leases ---

    def lease(self, *, wait=_DEFAULT, timeout=_DEFAULT):
        """Lease a slot, by the pool's policy unless overridden."""
        wait = self.wait if wait is _DEFAULT else wait
        timeout = self.timeout if timeout is _DEFAULT else timeout
        slot, owner = self._slots.take(wait, timeout)
        return Lease(self, slot, owner)

    def stats(self):
        s = self._slots
        return {
            "slots": s.slots,
            "slot_size": s.slot_size,
            "free": s.free,
            "leased": s.slots - s.free,
            "peak": s.peak,
            "leases": s.leases,
            "waits": s.waits,
            "exhausted": s.exhausted,
            "registrations": self.registrations,
            "registered_bytes": self.registered_bytes,
        }

    @property
    def closed(self):
        return self._slots.closed

    def close(self):
        """Unregister and close. Views handed out stay valid (the memory is
        this process's), but nothing more moves through the pool."""
        if self._slots.closed:
            return
        try:
            self._h.unregister(self.id)
        except OSError:
            pass  # closing the file releases it anyway
        finally:
            self._h.close()
            self._slots.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        s = self.stats()
        return f"<BufferPool {self.path!r} {s['slots']}x{s['slot_size']} B, {s['leased']} leased>"

    # --- data path ---

    def _key(self, key):
        if self.is_dir:
            if key is None:
                raise ValueError(f"pool on directory {self.path}: pass a key relative to it")
        elif key is not None:
            raise ValueError(f"pool on file {self.path} serves that key only: pass key=None")
        return key

    def _one(self, cmd, key, lease, n, obj_off, flags):
        """Move n bytes between lease and key; return (result, version)."""
        if self._slots.closed:
            raise PoolClosed("pool is closed")
        if not self.is_dir:
            f = self._h.put_buf if cmd == _abi.BATCH_PUT else self._h.get_buf
            if cmd == _abi.BATCH_PUT:
                return f(self.id, lease.offset, n, offset=obj_off, exclusive=bool(flags & _abi.FLAG_EXCL),
                         update=bool(flags & _abi.FLAG_UPDATE))
            return f(self.id, lease.offset, n, obj_off)
        (r, v), = self._h.batch(cmd, _abi.BATCH_BUF, [Entry(key, lease.offset, n, obj_off, flags)], self.id)
        if r < 0:
            raise OSError(-r, os.strerror(-r), os.path.join(self.path, os.fsdecode(key)))
        return r, v

    def put_lease(self, key, lease, nbytes, *, exclusive=False, makedirs=True):
        """Store the first nbytes of lease.buffer under key (zero-copy write:
        fill the lease, then put it); return the version."""
        key = self._key(key)
        if lease.pool is not self or lease.released:
            raise ValueError("lease of another pool, or released")
        if not 0 <= nbytes <= self.slot_size:
            raise ValueError(f"{nbytes} bytes do not fit a slot of {self.slot_size}")
        flags = _abi.FLAG_EXCL if exclusive else 0
        try:
            r, v = self._one(_abi.BATCH_PUT, key, lease, nbytes, 0, flags)
        except FileNotFoundError:
            if not (makedirs and self.is_dir and os.path.dirname(os.fsdecode(key))):
                raise
            os.makedirs(os.path.join(self.path, os.path.dirname(os.fsdecode(key))), exist_ok=True)
            r, v = self._one(_abi.BATCH_PUT, key, lease, nbytes, 0, flags)
        if r != nbytes:
            raise OSError(errno.EIO, f"short put: {r} of {nbytes} bytes", key)
        return v

    def put(self, key, data, *, exclusive=False, makedirs=True):
        """Copy data into a leased slot and store it under key with one more
        copy (PUT_BUF); return the version. data must fit a slot."""
        data = _contiguous(data)
        with pinned(data) as (addr, n):
            if n > self.slot_size:
                raise ObjectTooLarge(f"{n} bytes do not fit a slot of {self.slot_size}")
            with self.lease() as lease:
                ctypes.memmove(lease.address, addr, n)
                return self.put_lease(key, lease, n, exclusive=exclusive, makedirs=makedirs)

    def get_view(self, key=None, *, offset=0, writable=False):
        """Read key (from offset to its end) into a leased slot and return a
        memoryview of it: zero-copy for the caller. The slot stays leased
        until the last view of it is gone. Raises ObjectTooLarge when the
        object does not fit a slot, FileNotFoundError when it is missing."""
        key = self._key(key)
        lease = self.lease()
        try:
            r, _ = self._one(_abi.BATCH_GET, key, lease, self.slot_size + 1, offset, 0)
            if r > self.slot_size:
                raise ObjectTooLarge(f"{key or self.path}: more than {self.slot_size} bytes from offset {offset}")
            return lease.view(r, writable)
        finally:
            lease.release()

    def get_array(self, key=None, dtype="uint8", shape=None, *, offset=0, writable=False):
        """get_view as a numpy array of dtype (and shape, if given); the
        array (and every view of it) keeps the slot leased."""
        np = _numpy()
        dtype = np.dtype(dtype)
        view = self.get_view(key, offset=offset, writable=writable)
        if view.nbytes % dtype.itemsize:
            raise ValueError(f"{key}: {view.nbytes} bytes is not a multiple of {dtype}")
        a = np.frombuffer(view, dtype=dtype)
        if shape is not None:
            if a.size != int(np.prod(shape)):
                raise ValueError(f"{key}: {a.size} elements of {dtype}, shape {shape} needs {int(np.prod(shape))}")
            a = a.reshape(shape)
        return a

    def get_views(self, keys, *, writable=False):
        """Batch form of get_view for a directory pool: {key: memoryview or
        None if missing}, one BATCH_GET per 64 keys. Needs a free slot per
        key (by the pool's policy); other errors raise BatchError."""
        if not self.is_dir:
            raise ValueError("get_views needs a pool on a directory")
        keys = list(dict.fromkeys(keys))
        out = {}
        for i in range(0, len(keys), _abi.MAX_BATCH):
            part = keys[i:i + _abi.MAX_BATCH]
            leases = []
            try:
                for _ in part:
                    leases.append(self.lease())
                if self._slots.closed:
                    raise PoolClosed("pool is closed")
                res = self._h.batch(_abi.BATCH_GET, _abi.BATCH_BUF,
                                    [Entry(k, ls.offset, self.slot_size + 1) for k, ls in zip(part, leases)], self.id)
                bad = {}
                for k, ls, (r, _) in zip(part, leases, res):
                    if r == -errno.ENOENT:
                        out[k] = None
                    elif r < 0:
                        bad[k] = r
                    elif r > self.slot_size:
                        raise ObjectTooLarge(f"{k}: more than {self.slot_size} bytes")
                    else:
                        out[k] = ls.view(r, writable)
                if bad:
                    raise BatchError({k: bad.get(k, 0) for k in part}, f"{self.path}: batch get")
            except BaseException:
                out.clear()
                raise
            finally:
                for ls in leases:
                    ls.release()
        return out

    def put_many(self, items, *, exclusive=False, check=True):
        """Batch form of put for a directory pool: {key: data} through the
        slots, one BATCH_PUT per call of up to 64 keys (fewer when fewer
        slots are free); returns key -> bytes or -errno (with check, raises
        BatchError if any failed). Parents must exist."""
        if not self.is_dir:
            raise ValueError("put_many needs a pool on a directory")
        items = {k: _contiguous(v) for k, v in dict(items).items()}
        flags = _abi.FLAG_EXCL if exclusive else 0
        todo = list(items)
        results = {}
        while todo:
            # One lease by the pool's policy, then as many more as are free
            # now (up to a batch): puts never wait on their own leases.
            leases = [self.lease()]
            try:
                while len(leases) < min(len(todo), _abi.MAX_BATCH):
                    got = self._slots.try_take()
                    if got is None:
                        break
                    leases.append(Lease(self, *got))
                part, todo = todo[:len(leases)], todo[len(leases):]
                entries = []
                for k, ls in zip(part, leases):
                    with pinned(items[k]) as (addr, n):
                        if n > self.slot_size:
                            raise ObjectTooLarge(f"{k}: {n} bytes do not fit a slot of {self.slot_size}")
                        ctypes.memmove(ls.address, addr, n)
                    entries.append(Entry(k, ls.offset, n, 0, flags))
                if self._slots.closed:
                    raise PoolClosed("pool is closed")
                res = self._h.batch(_abi.BATCH_PUT, _abi.BATCH_BUF, entries, self.id)
                results.update((k, r) for k, (r, _) in zip(part, res))
            finally:
                for ls in leases:
                    ls.release()
        if check and any(r < 0 for r in results.values()):
            raise BatchError(results, f"{self.path}: batch put")
        return results
