"""Files, directories and a mount-level client over the mooncake-fs ioctls.

Single-key commands act on the key of an open file (``File``); batch
commands act on a directory (``Directory``) with keys relative to it.
``Client`` ties both to a mount and resolves keys against it. Data moves
with PUT_VM/GET_VM by default: the daemon copies straight between this
process's memory (bytes, bytearray, memoryview, numpy arrays...) and the
store with process_vm_readv/writev, one copy and nothing to register. For
memory registered once and reused, see ``mooncake_fs.pool.BufferPool``.
"""

import ctypes
import errno
import fcntl
import itertools
import operator
import os
import struct
import threading
import time
import weakref
from contextlib import ExitStack
from typing import NamedTuple

from . import _abi
from ._buffer import new_bytes, pinned, pinned_all


class NotMooncakeError(OSError):
    """The path is not on a mooncake-fs mount (GET_MAGIC failed)."""


class BatchError(OSError):
    """Some keys of a batch failed. ``results`` maps every key of the call
    to bytes moved (>= 0) or a negative errno; errno is the first failure's."""

    def __init__(self, results, what="batch"):
        failed = {k: r for k, r in results.items() if r is not None and r < 0}
        first = next(iter(failed.values()))
        names = ", ".join(f"{k!r}: {errno.errorcode.get(-r, -r)}" for k, r in list(failed.items())[:8])
        super().__init__(-first, f"{what}: {len(failed)} of {len(results)} keys failed ({names})")
        self.results = results


class KeyInfo(NamedTuple):
    """What a lookup by name (GET_KEY of length 0) reports."""

    size: int
    version: int
    meta: bytes


class Stat(NamedTuple):
    """What STAT reports about an object."""

    size: int
    version: int
    ino: int
    mtime_ns: int
    mode: int
    pinned: bool
    replicas: int
    extents: int
    location: str


def ioctl(fd, cmd, arg, name=None):
    """Issue cmd on fd with the ctypes struct arg as in/out buffer; errors
    raise OSError with the errno (and name as the filename)."""
    try:
        fcntl.ioctl(fd, cmd, arg, True)
    except OSError as e:
        raise OSError(e.errno, os.strerror(e.errno), name) from None


# IN_FLIGHT is how many calls of one vector batch of more than MAX_BATCH
# keys may be in the daemon at once (environment MOONCAKE_FS_IN_FLIGHT,
# default 4): while one call's reply travels back and the next is being
# built, others are at work there. 1 sends them one after the other.
# (Plain batches go as table calls of up to MAX_TABLE keys, one after the
# other: Directory.batch.)
def _in_flight_env():
    try:
        return max(1, int(os.environ.get("MOONCAKE_FS_IN_FLIGHT") or 4))
    except ValueError:
        return 4


IN_FLIGHT = _in_flight_env()

_pool_lock = threading.Lock()
_pool = (0, 0, None)  # (pid, workers, executor): a forked child makes its own


def _new_pool_lock():
    global _pool_lock
    _pool_lock = threading.Lock()  # a fork while another thread held it


os.register_at_fork(after_in_child=_new_pool_lock)


def _executor():
    """The pool of IN_FLIGHT workers, made on first use (again after a fork
    or a change of IN_FLIGHT)."""
    global _pool
    from concurrent.futures import ThreadPoolExecutor

    with _pool_lock:
        pid, workers, ex = _pool
        if ex is None or pid != os.getpid() or workers != IN_FLIGHT:
            if ex is not None and pid == os.getpid():
                ex.shutdown(wait=False)  # its queued calls still run
            ex = ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="mooncake-fs-batch")
            _pool = (os.getpid(), IN_FLIGHT, ex)
        return ex


class _Running:
    """The threads running a batch's calls, counted, so that the caller can
    wait for every call that started whatever became of its future (an
    interrupt inside a pool's submit, after the work was queued, loses it)
    and keep any from starting once it closes."""

    def __init__(self):
        self.cv = threading.Condition()
        self.closed = False
        self._active = 0

    def enter(self):
        """Whether a call may start now (it then calls leave when it ends)."""
        with self.cv:
            if self.closed:
                return False
            self._active += 1
            return True

    def leave(self):
        with self.cv:
            self._active -= 1
            self.cv.notify_all()

    def close(self, futs=()):
        """Let no call start, withdraw the futures futs still queued, and
        wait, through interrupts, until every call that started has ended;
        the first interrupt, or None."""
        interrupted = None
        while True:
            try:
                with self.cv:
                    self.closed = True
                    for f in futs:
                        f.cancel()  # queued behind other callers' work: gone from the pool
                    while self._active:
                        self.cv.wait()
                return interrupted
            except BaseException as e:  # an interrupt: the calls running still end first
                interrupted = interrupted or e


def overlapped(calls):
    """Run the callables (each one ioctl, which releases the GIL), up to
    IN_FLIGHT at a time, and return their results in order. The callables
    are taken as the iterable yields them, so building the next call
    overlaps the ones in flight; a lone one runs in this thread, and so do
    all once the interpreter shuts down (no new threads then). Once one
    raises, no later one starts. Every one that started has finished when
    this returns or raises, an interrupt (Ctrl-C) included, even one inside
    a pool's submit (the threads running calls are counted, as in_parts
    does): their buffers may be freed then. The first exception is raised."""
    it = iter(calls)
    first = next(it, None)
    if first is None:
        return []
    second = next(it, None)
    if second is None or IN_FLIGHT < 2:
        return [first()] + ([] if second is None else [second()] + [c() for c in it])
    running = _Running()

    def counted(c):
        def run():
            if not running.enter():
                return None  # the batch failed or was interrupted: no one reads this
            try:
                return c()
            finally:
                running.leave()
        return run

    futs, inline = [], []
    todo = itertools.chain((first, second), it)
    try:
        try:
            ex = _executor()
        except RuntimeError:  # no new threads (the interpreter shuts down)
            ex = None
        for c in todo:
            if any(f.done() and f.exception() is not None for f in futs):
                break  # a call failed: send no more
            f = submit(ex, counted(c)) if ex is not None else None
            if f is None:
                # No new threads (the interpreter shuts down): the rest,
                # from this one, in this thread.
                inline = [g() for g in itertools.chain((c,), todo)]
                break
            futs.append(f)
    except BaseException as e:  # an interrupt while sending, or an inline call's error
        running.close(futs)
        raise e
    wait_all(futs)
    return [f.result() for f in futs] + inline


def in_parts(count, part):
    """[part(0), ..., part(count - 1)], each call one or more ioctls (which
    let go of the GIL), run by up to IN_FLIGHT threads, this one among
    them: each takes the next part as its last ends, so none waits on
    another between calls and the first part goes at once. Once a part
    returns None (it cannot go this way) or raises, no later part starts;
    every part that started has ended when this returns or raises (their
    buffers are the caller's then), whatever interrupts it: the threads
    that run parts are counted, not their futures (work a pool queued
    behind another caller's is withdrawn, not waited for, and work queued
    by a submit that an interrupt cut short is still counted if it runs).
    None where a part returned None; the first exception is raised. A
    part must not use the pool itself."""
    out, taken = [None] * count, itertools.count()
    running = _Running()
    cv = running.cv
    st = {"none": False, "error": None}

    def run():
        if not running.enter():
            return
        try:
            while True:
                with cv:
                    if running.closed or st["none"] or st["error"] is not None:
                        return
                    i = next(taken)
                if i >= count:
                    return
                r = part(i)
                if r is None:
                    with cv:
                        st["none"] = True
                    return
                out[i] = r
        except BaseException as e:
            with cv:
                st["error"] = st["error"] or e
        finally:
            running.leave()

    futs, interrupted = [], None
    try:
        try:
            ex = _executor()
        except RuntimeError:  # no new threads (the interpreter shuts down): all in this one
            ex = None
        for _ in range(IN_FLIGHT - 1 if ex is not None and count > 1 else 0):
            f = submit(ex, run)
            if f is None:
                break
            futs.append(f)
        run()
    except BaseException as e:
        interrupted = e
    late = running.close(futs)  # a thread that has not begun a part never will
    interrupted = interrupted or late
    if interrupted is not None:
        raise interrupted
    if st["error"] is not None:
        raise st["error"]
    return None if st["none"] else out


def submit(ex, fn):
    """ex.submit(fn), except that a pool that refuses it never runs fn
    behind the caller's back: submit raises RuntimeError once the pool is
    shut down, but also when the work was queued and no thread could be
    started for it, when a worker may still take it. The work is then
    withdrawn (None: fn did not run, the caller may run it), or, if a
    worker took it already, awaited (its future, done)."""
    from concurrent.futures import Future

    gate, state, done, box = threading.Lock(), ["queued"], threading.Event(), []

    def run():
        with gate:
            if state[0] == "withdrawn":
                return None
            state[0] = "running"
        try:
            box.append((True, fn()))
        except BaseException as e:
            box.append((False, e))
        finally:
            done.set()
        ok, v = box[0]
        if not ok:
            raise v
        return v

    try:
        return ex.submit(run)
    except RuntimeError:
        with gate:
            took, state[0] = state[0] == "running", "withdrawn"
        if not took:
            return None
        interrupted = None
        while True:
            try:
                done.wait()
                break
            except BaseException as e:  # an interrupt: the call still ends first
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted
        f = Future()
        ok, v = box[0]
        if ok:
            f.set_result(v)
        else:
            f.set_exception(v)
        return f


def spans_overlap(ptrs, sizes):
    """Whether any two of the ranges (ptrs[i], sizes[i]) (sizes of 0 or
    more) share a byte."""
    if all(map(operator.le, map(operator.add, ptrs, sizes), itertools.islice(ptrs, 1, None))):
        return False  # each ends before the next begins: blocks in order, the common case, with no sort
    size = sizes[0] if len(sizes) else 0
    if size > 0 and operator.countOf(sizes, size) == len(sizes):
        # One size (an engine's blocks, out of order): two ranges share a
        # byte when two starts, sorted, lie closer than it. A third of the
        # time of sorting the pairs.
        starts = sorted(ptrs)
        return any(map(operator.lt, map(operator.sub, itertools.islice(starts, 1, None), starts),
                       itertools.repeat(size)))
    spans = sorted((p, z) for p, z in zip(ptrs, sizes) if z)  # an empty range shares no byte
    if len(spans) < 2:
        return False
    ends = itertools.accumulate(map(operator.add, *zip(*spans)), max)  # the furthest end so far
    return any(map(operator.lt, [p for p, _ in spans[1:]], ends))


def wait_all(futs, failed=None):
    """Wait until every one of the futures futs has ended, through
    interrupts (Ctrl-C): their calls use the caller's buffers; on one,
    those not started are cancelled. Then raise failed, or the first
    interrupt, if any."""
    from concurrent.futures import wait

    while True:
        try:
            wait(futs)
            break
        except BaseException as e:  # an interrupt: the calls in flight still end first
            failed = failed or e
            # Those not started will not start: waiting for them would wait
            # until a worker takes them off the queue.
            futs = [f for f in futs if not f.cancel()]
    if failed is not None:
        raise failed


_libc_ioctl = ctypes.CDLL(None, use_errno=True).ioctl
_libc_ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
_libc_ioctl.restype = ctypes.c_int


class IoctlClock:
    """The time this process spent inside ioctl_released (ns) and its
    calls, all threads together: the benchmarks split a caller's time
    into its own work and its calls with it. Threads that add at once may
    lose an addition; it is a figure to look at, not a count to trust."""

    __slots__ = ("ns", "calls")

    def __init__(self):
        self.ns = self.calls = 0


ioctl_clock = IoctlClock()
_clock_ns = time.perf_counter_ns


def ioctl_released(fd, cmd, raw, name=None, started=None):
    """ioctl with the bytearray raw as in/out buffer, the GIL released for
    the call (fcntl.ioctl holds it for a buffer over 1 KiB: calls from
    several threads would go one at a time); returns the ioctl's value,
    errors as ioctl's. started, an Event, is set just before the call: a
    thread that waits on it gets the GIL back once this one is in the
    daemon. The call's time goes to ioctl_clock."""
    buf = (ctypes.c_char * len(raw)).from_buffer(raw)
    addr = ctypes.addressof(buf)
    if started is not None:
        started.set()
    t0 = _clock_ns()
    r = _libc_ioctl(fd, cmd, addr)
    clock = ioctl_clock
    clock.ns += _clock_ns() - t0
    clock.calls += 1
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), name)
    return r


def _put_flags(exclusive, update):
    return (_abi.FLAG_EXCL if exclusive else 0) | (_abi.FLAG_UPDATE if update else 0)


def _numpy():
    import numpy  # optional dependency, imported on first use

    return numpy


class _Handle:
    """An open file description on the mount; the base of File and Directory."""

    _oflags = os.O_RDONLY
    _old_abi = False  # set once the daemon refused a table call (ENOTTY)

    def __init__(self, path, flags, perm=0o644):
        self.name = os.fspath(path)
        self._fd = os.open(self.name, flags | os.O_CLOEXEC, perm)
        self._close = weakref.finalize(self, os.close, self._fd)
        self._close.atexit = False

    def fileno(self):
        if not self._close.alive:
            raise ValueError(f"{self.name}: closed")
        return self._fd

    @property
    def closed(self):
        return not self._close.alive

    def close(self):
        """Close the file; its registrations die with it."""
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"<{type(self).__name__} {self.name!r} {state}>"

    def _ioctl(self, cmd, arg):
        ioctl(self.fileno(), cmd, arg, self.name)
        return arg

    def probe(self):
        """Check that this is a mooncake-fs file; return the daemon's ABI
        version as (major, minor)."""
        try:
            m = self._ioctl(_abi.GET_MAGIC, _abi.Magic())
        except OSError as e:
            if e.errno in (errno.ENOTTY, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise NotMooncakeError(e.errno, "not a mooncake-fs file", self.name) from None
            raise
        if m.magic != _abi.MAGIC:
            raise NotMooncakeError(errno.ENOTTY, f"bad magic {m.magic:#x}", self.name)
        v = self._ioctl(_abi.GET_ABI_VERSION, _abi.ABIVersion())
        return v.major, v.minor

    def register(self, fd, length, offset=0):
        """Register length bytes at offset of memfd/shm fd (a descriptor of
        this process, readable and writable) on this open file; return the
        buffer id. It stays valid until unregister() or close()."""
        a = self._ioctl(_abi.REGISTER_BUFFER, _abi.Register(fd=fd, kind=_abi.KIND_HOST, len=length, offset=offset))
        return a.id

    def register_cuda(self, handle, length, offset=0, dmabuf=None):
        """Register length bytes at offset of a GPU allocation, given its
        64-byte cuIpcGetMemHandle (ABI 1.2, MC_KIND_CUDA), on this open
        file; return the buffer id for put_buf/get_buf. The allocation must
        stay allocated until unregister() or close(). dmabuf (ABI 1.5,
        MC_REGISTER_DMABUF): a dma-buf descriptor exporting the whole
        allocation, for the daemon's GPUDirect RDMA; the caller still
        closes it."""
        a = _abi.Register(kind=_abi.KIND_CUDA, len=length, offset=offset)
        a.fd = -1
        if dmabuf is not None:
            a.h.flags, a.fd = _abi.REGISTER_DMABUF, dmabuf
        _set_bytes(a.handle, handle, "IPC handle")
        return self._ioctl(_abi.REGISTER_BUFFER, a).id

    def register_gpu(self, loc, length):
        """register_cuda of length bytes at loc (a cudadrv.IPCLocation),
        with a dma-buf of its allocation where the driver exports one, so
        that the daemon's RDMA devices reach the memory directly. Where the
        daemon cannot take it (older than ABI 1.5, or not allowed to reach
        into this process) the plain registration follows."""
        from . import cudadrv

        drv = cudadrv.driver()
        with drv.context(loc.ordinal):
            fd = drv.dmabuf(loc.base, loc.size)
        if fd is None:
            return self.register_cuda(loc.handle, length, loc.dev_off)
        try:
            return self.register_cuda(loc.handle, length, loc.dev_off, dmabuf=fd)
        except OSError:
            pass
        finally:
            os.close(fd)
        return self.register_cuda(loc.handle, length, loc.dev_off)

    def unregister(self, buf_id):
        self._ioctl(_abi.UNREGISTER_BUFFER, _abi.Unregister(id=buf_id))


class File(_Handle):
    """An open key. mode "r" opens read-only (GET reads the version current
    at open); "w" opens read-write, creating the key if needed (PUT needs
    it)."""

    def __init__(self, path, mode="r", *, perm=0o644):
        if mode == "r":
            flags = os.O_RDONLY
        elif mode in ("w", "rw", "r+", "w+"):
            flags = os.O_RDWR | os.O_CREAT
        else:
            raise ValueError(f"mode {mode!r}: want 'r' or 'w'")
        self.mode = mode
        super().__init__(path, flags, perm)

    def stat(self):
        s = self._ioctl(_abi.STAT, _abi.Stat())
        return Stat(s.size, s.version, s.ino, s.mtime_ns, s.mode, bool(s.pinned), s.replicas, s.extents,
                    s.location.decode("utf-8", "replace"))

    # --- process memory (VM) ---

    def put_vm(self, addr, length, *, offset=0, exclusive=False, update=False):
        """PUT_VM of raw memory; return (bytes moved, version)."""
        a = _abi.VM(addr=addr, len=length, obj_off=offset)
        a.h.flags = _put_flags(exclusive, update)
        self._ioctl(_abi.PUT_VM, a)
        return a.result, a.version

    def get_vm(self, addr, length, offset=0):
        """GET_VM into raw memory; return (bytes moved, version)."""
        a = self._ioctl(_abi.GET_VM, _abi.VM(addr=addr, len=length, obj_off=offset))
        return a.result, a.version

    def put(self, data, *, offset=0, exclusive=False, update=False):
        """Replace the object with data (any C-contiguous buffer: bytes,
        bytearray, memoryview, numpy array; non-contiguous numpy arrays are
        copied first), atomically. exclusive: EEXIST unless the object is
        empty and unchanged since this file was opened. update: write data
        at offset into a copy of the current version instead. Returns the
        version written."""
        data = _contiguous(data)
        with pinned(data) as (addr, n):
            moved, version = self.put_vm(addr, n, offset=offset, exclusive=exclusive, update=update)
        if moved != n:
            raise OSError(errno.EIO, f"short put: {moved} of {n} bytes", self.name)
        return version

    def get_into(self, out, offset=0):
        """Read up to len(out) bytes at offset into out (a writable
        C-contiguous buffer: bytearray, memoryview, numpy array...); return
        the count."""
        with pinned(out, writable=True) as (addr, n):
            return self.get_vm(addr, n, offset)[0]

    def _read_whole(self, offset, alloc):
        """Read the object from offset to its end into alloc(n) -> (obj,
        addr); return (obj, count).

        STAT gives the size of the latest version, while a read-only file
        reads the version current at its open, and either may change in
        between. So a read that fills the buffer is followed by a one-byte
        probe past it: the read is complete when the probe finds the end of
        the same version."""
        probe = ctypes.c_ubyte()
        paddr = ctypes.addressof(probe)
        for _ in range(8):
            st = self.stat()
            n = max(st.size - offset, 0)
            obj, addr = alloc(n)
            count, version = self.get_vm(addr, n, offset) if n else (0, None)
            if count < n:
                return obj, count  # reached the end of the version read
            try:
                more, pversion = self.get_vm(paddr, 1, offset + n)
            except OSError as e:
                if e.errno != errno.ERANGE or not n:
                    raise  # offset beyond the object
                continue  # shrank in between
            if more == 0 and (version is None or pversion == version):
                return obj, n
        return self._read_growing(offset, alloc)

    def _read_growing(self, offset, alloc):
        """Slow path of _read_whole: read in doubling chunks until the end of
        one version, then copy into alloc(total)."""
        for _ in range(8):
            data, version, chunk = bytearray(), None, 1 << 20
            while True:
                part = bytearray(chunk)
                with pinned(part, writable=True) as (addr, n):
                    count, v = self.get_vm(addr, n, offset + len(data))
                if version is not None and v != version:
                    break  # another version: start over
                version = v
                data += part[:count]
                if count < chunk:
                    obj, addr = alloc(len(data))
                    if data:
                        with pinned(data) as (src, n):
                            ctypes.memmove(addr, src, n)
                    return obj, len(data)
                chunk *= 2
        raise OSError(errno.EAGAIN, "object kept changing during the read", self.name)

    def get(self, length=None, offset=0):
        """Return length bytes at offset (default: to the end) as bytes,
        read with one copy straight into the new bytes object."""
        if length is None:
            b, count = self._read_whole(offset, new_bytes)
        else:
            b, addr = new_bytes(length)
            count = self.get_vm(addr, length, offset)[0] if length else 0
        return b if count == len(b) else b[:count]

    def get_array(self, dtype="uint8", shape=None, offset=0):
        """Read into a new numpy array. With shape, exactly that many
        elements must be there (ValueError otherwise); without, the rest of
        the object from offset as a 1-D array."""
        np = _numpy()
        dtype = np.dtype(dtype)
        if shape is not None:
            out = np.empty(shape, dtype)
            count = self.get_into(out, offset) if out.nbytes else 0
            if count != out.nbytes:
                raise ValueError(f"{self.name}: {count} bytes at offset {offset}, array {shape} of {dtype} needs {out.nbytes}")
            return out

        def alloc(n):
            if n % dtype.itemsize:
                raise ValueError(f"{self.name}: {n} bytes is not a multiple of {dtype} ({dtype.itemsize} B)")
            a = np.empty(n // dtype.itemsize, dtype)
            return a, a.ctypes.data

        a, count = self._read_whole(offset, alloc)
        if count != a.nbytes:
            if count % dtype.itemsize:
                raise ValueError(f"{self.name}: {count} bytes is not a multiple of {dtype}")
            a = a[: count // dtype.itemsize].copy()
        return a

    # --- GPU memory (ABI 1.2) ---

    def put_cuda(self, handle, dev_off, length, *, device=None, offset=0, exclusive=False, update=False):
        """PUT_CUDA of length bytes at dev_off in the GPU allocation whose
        cuIpcGetMemHandle is handle (64 bytes), on the GPU with UUID device
        (16 bytes; None = the first GPU); return (bytes moved, version).
        Kernels writing the memory must have finished."""
        a = _cuda_arg(handle, dev_off, length, offset, device)
        a.h.flags = _put_flags(exclusive, update)
        self._ioctl(_abi.PUT_CUDA, a)
        return a.result, a.version

    def get_cuda(self, handle, dev_off, length, offset=0, *, device=None):
        """GET_CUDA of up to length bytes at offset of the object into GPU
        memory (see put_cuda); return (bytes moved, version). The data is in
        place when it returns."""
        a = self._ioctl(_abi.GET_CUDA, _cuda_arg(handle, dev_off, length, offset, device))
        return a.result, a.version

    # --- registered buffers ---

    def put_buf(self, buf_id, buf_off, length, *, offset=0, exclusive=False, update=False):
        """PUT_BUF from registered buffer buf_id; return (bytes moved, version)."""
        a = _abi.Buf(id=buf_id, buf_off=buf_off, len=length, obj_off=offset)
        a.h.flags = _put_flags(exclusive, update)
        self._ioctl(_abi.PUT_BUF, a)
        return a.result, a.version

    def get_buf(self, buf_id, buf_off, length, offset=0):
        """GET_BUF into registered buffer buf_id; return (bytes moved, version)."""
        a = self._ioctl(_abi.GET_BUF, _abi.Buf(id=buf_id, buf_off=buf_off, len=length, obj_off=offset))
        return a.result, a.version


def _set_bytes(field, value, what):
    """Copy value (bytes-like of exactly len(field) bytes) into a ctypes
    uint8 array field."""
    b = bytes(value)
    if len(b) != len(field):
        raise ValueError(f"{what}: {len(b)} bytes, want {len(field)}")
    ctypes.memmove(field, b, len(b))


def _cuda_arg(handle, dev_off, length, offset, device):
    a = _abi.CUDA(dev_off=dev_off, len=length, obj_off=offset)
    _set_bytes(a.handle, handle, "IPC handle")
    if device is not None:
        _set_bytes(a.device, device, "device UUID")
    return a


class Entry(NamedTuple):
    """One key of a batch: addr is an address (BATCH_VM) or an offset in
    the registered buffer (BATCH_BUF)."""

    key: object
    addr: int
    len: int
    obj_off: int = 0
    flags: int = 0


def _key_bytes(key):
    b = os.fsencode(key)
    if not b or len(b) > _abi.BATCH_KEY_BYTES:
        raise ValueError(f"batch key {key!r}: {len(b)} bytes, want 1..{_abi.BATCH_KEY_BYTES}")
    return b


def _chunks(entries):
    """Split entries into calls of at most MAX_BATCH keys and BATCH_KEY_BYTES
    of key text."""
    chunk, used = [], 0
    for e in entries:
        k = _key_bytes(e.key)
        if len(chunk) == _abi.MAX_BATCH or used + len(k) > _abi.BATCH_KEY_BYTES:
            yield chunk
            chunk, used = [], 0
        chunk.append((e, k))
        used += len(k)
    if chunk:
        yield chunk


class _NoTables(Exception):
    """The daemon refused the first table call of a batch (ENOTTY, EPERM)."""


# mc_batch_entry: key_off key_len flags addr len obj_off result version.
_BENTRY = struct.Struct("<HHIQQQqQ")


def _batch_tables(h, cmd, source, entries, buf_id):
    """Directory.batch as table calls (ABI 1.8) on handle h."""
    tcmd = _abi.BATCH_PUT_TABLE if cmd == _abi.BATCH_PUT else _abi.BATCH_GET_TABLE
    keys = [_key_bytes(e.key) for e in entries]  # all checked before any call
    for e in entries:
        if not (0 <= e.addr < 1 << 64 and 0 <= e.len < 1 << 64 and 0 <= e.obj_off < 1 << 64 and 0 <= e.flags < 1 << 32):
            raise ValueError(f"batch entry {e.key!r}: address, length, offset or flags out of range")
    out = []
    lo, size, pack = 0, _BENTRY.size, _BENTRY.pack_into
    while lo < len(entries):
        hi, used = lo, 0
        while hi < len(entries) and hi - lo < _abi.MAX_TABLE and used + len(keys[hi]) <= _abi.MAX_TABLE_KEY_BYTES:
            used += len(keys[hi])
            hi += 1
        raw = bytearray(size * (hi - lo))
        kbuf = ctypes.create_string_buffer(b"".join(keys[lo:hi]), used)
        off = 0
        for j, i in enumerate(range(lo, hi)):
            e, k = entries[i], len(keys[i])
            pack(raw, j * size, off, k, e.flags, e.addr, e.len, e.obj_off, 0, 0)
            off += k
        tab = (ctypes.c_char * len(raw)).from_buffer(raw)
        a = _abi.Table(count=hi - lo, source=source, id=buf_id, entries=ctypes.addressof(tab),
                       keys=ctypes.addressof(kbuf), keys_len=used)
        try:
            h._ioctl(tcmd, a)
        except OSError as e:
            if not out and e.errno in (errno.ENOTTY, errno.EPERM):
                raise _NoTables() from e
            raise
        out.extend((r[6], r[7]) for r in _BENTRY.iter_unpack(raw))
        lo = hi
    return out


def pack_batch(source, buf_id, chunk, flags=0):
    """Build a Batch argument from [(Entry, key bytes)] (one _chunks item)."""
    b = _abi.Batch(count=len(chunk), source=source, id=buf_id)
    b.h.flags = flags
    off = 0
    keys = ctypes.addressof(b.keys)
    for i, (e, k) in enumerate(chunk):
        ctypes.memmove(keys + off, k, len(k))
        ent = b.entries[i]
        ent.key_off, ent.key_len, ent.flags = off, len(k), e.flags
        ent.addr, ent.len, ent.obj_off = e.addr, e.len, e.obj_off
        off += len(k)
    return b


def _contiguous(data):
    """data, or a C-contiguous copy of a non-contiguous numpy array."""
    if type(data).__module__ == "numpy" and hasattr(data, "flags") and not data.flags.c_contiguous:
        return _numpy().ascontiguousarray(data)
    return data


def _fill_key(a, key, meta):
    """Set Key a's key (and meta, when not None) for a KEY call; return
    the key's bytes."""
    k = os.fsencode(key)
    if not k or len(k) > _abi.KEY_KEY_BYTES:
        raise ValueError(f"key {key!r}: {len(k)} bytes, want 1..{_abi.KEY_KEY_BYTES} (longer keys: batches)")
    ctypes.memmove(a.key, k, len(k))
    a.key_len = len(k)
    if meta is not None:
        m = _meta_bytes(meta)
        ctypes.memmove(a.meta, m, len(m))
        a.meta_len = len(m)
    return k


def _meta_bytes(meta):
    m = meta.encode() if isinstance(meta, str) else bytes(meta)
    if len(m) > _abi.MAX_META:
        raise ValueError(f"meta of {len(m)} bytes, at most {_abi.MAX_META}")
    return m


_SEG = struct.Struct("<QQQ")
# mc_vbatch_entry (key_off key_len flags seg_off nseg meta_off meta_len
# obj_off result version) and where the entries and the area sit.
_VENTRY = struct.Struct("<HHIIIIIQqQ")
_VENTRIES = _abi.VBatch.entries.offset
# An entry's outcome (result, version), at its end.
_VRESULT = struct.Struct("<qQ")
_VRESULT_AT = _VENTRY.size - _VRESULT.size
_VAREA = _abi.VBatch.area.offset
assert _VENTRY.size == ctypes.sizeof(_abi.VBatchEntry)
# mc_vbatch's head: header (size, flags), count, ngpu.
_VHEAD = struct.Struct("<IIII")
_VGPUS = _abi.VBatch.gpus.offset
_GPUREF = ctypes.sizeof(_abi.GPURef)
assert _VHEAD.size == _abi.VBatch.entries.offset and ctypes.sizeof(_abi.VBatch) == _abi.BATCH_SIZE

# Packed entries of send_columns batches whose keys (and metas) are all of
# one length, by (count, segments per key, flags, key length, meta length):
# a connector's keys are of one format, so a handful of shapes serve every
# call.
_column_cache = {}
_COLUMN_SHAPES = 256


def columns_fit(n, nseg, key_bytes):
    """Whether n keys of nseg segments each and key_bytes of names (and
    metas) in all fit one send_columns call."""
    return 0 < n <= _abi.MAX_BATCH and 0 < nseg <= _abi.MAX_SEGS and n * nseg * _SEG.size + key_bytes <= _abi.VBATCH_AREA_BYTES


class _Submitted:
    """A call of Directory.submit_columns: its number on the fd, its raw
    arguments (which the wait fills) and its count of keys."""

    __slots__ = ("number", "raw", "keys")

    def __init__(self, number, raw, keys):
        self.number, self.raw, self.keys = number, raw, keys


def _column_results(raw, n, versions):
    """The results of a vector batch's n keys in raw: a list, or with
    versions (result, version) pairs."""
    words, at = _VENTRY.size // 8, _VRESULT_AT // 8
    ents = memoryview(raw)[_VENTRIES:_VENTRIES + _VENTRY.size * n]
    res = ents.cast("q")[at::words].tolist()
    if versions:
        return list(zip(res, ents.cast("Q")[at + 1::words].tolist()))
    return res


def _column_entries(n, nseg, flags, lens, kbase, mlens, mbase):
    """The n entries of send_columns: segments from the area's start,
    nseg per key, the names after them end to end, then the metas."""
    klen, mlen = lens[0], mlens[0] if mlens else 0
    same = lens.count(klen) == n and (not mlens or mlens.count(mlen) == n)
    shape = (n, nseg, flags, klen, mlen)
    if same:
        b = _column_cache.get(shape)
        if b is not None:
            return b
    f = [0] * (10 * n)
    if same:
        f[0::10] = range(kbase, kbase + n * klen, klen)
    else:
        f[0::10] = list(itertools.accumulate(lens, initial=kbase))[:-1]
    f[1::10] = lens
    f[2::10] = [flags] * n
    f[3::10] = range(0, kbase, nseg * _SEG.size)
    f[4::10] = [nseg] * n
    if mlens:
        if same:
            f[5::10] = range(mbase, mbase + n * mlen, mlen) if mlen else [mbase] * n
        else:
            f[5::10] = list(itertools.accumulate(mlens, initial=mbase))[:-1]
        f[6::10] = mlens
    b = struct.pack("<" + "HHIIIIIQqQ" * n, *f)
    if same and len(_column_cache) < _COLUMN_SHAPES:
        _column_cache[shape] = b
    return b


def key_fits(key):
    """Whether key (relative to a directory) fits one PUT_KEY/GET_KEY."""
    return 0 < len(os.fsencode(key)) <= _abi.KEY_KEY_BYTES


class Directory(_Handle):
    """An open directory: keys relative to it, one per call (put_key,
    get_key_into, lookup: ABI 1.3) or in batches."""

    def __init__(self, path):
        super().__init__(path, os.O_RDONLY | os.O_DIRECTORY)

    # --- one key by name, one call (ABI 1.3) ---

    _no_inline = False  # set once the daemon refused a KEY_INLINE call (ENOTTY: before ABI 1.9)

    def key_call(self, put, key, a, meta=None):
        """Run PUT_KEY (put) or GET_KEY with the Key struct a for key;
        meta: stored by a put; for a get, the meta the value must have
        (OSError EBADMSG, nothing moved, otherwise). Returns a."""
        k = _fill_key(a, key, meta)
        try:
            fcntl.ioctl(self.fileno(), _abi.PUT_KEY if put else _abi.GET_KEY, a, True)
        except OSError as e:
            raise OSError(e.errno, os.strerror(e.errno), os.path.join(self.name, os.fsdecode(k))) from None
        return a

    def _key_inline(self, put, key, a, meta):
        """Run PUT_KEY_INLINE (put) or GET_KEY_INLINE with the KeyInline a
        for key, as key_call; False (nothing done) when the daemon
        predates them."""
        k = _fill_key(a.k, key, meta)
        try:
            fcntl.ioctl(self.fileno(), _abi.PUT_KEY_INLINE if put else _abi.GET_KEY_INLINE, a, True)
        except OSError as e:
            if e.errno == errno.ENOTTY:
                self._no_inline = True
                return False
            raise OSError(e.errno, os.strerror(e.errno), os.path.join(self.name, os.fsdecode(k))) from None
        return True

    def put_key(self, key, data, *, meta=None, exclusive=False, update=False, offset=0):
        """Store data (a C-contiguous buffer) as key's value in one call,
        with meta (str or bytes, at most MAX_META; none removes it);
        return the version. Parents must exist (FileNotFoundError). A
        value of up to INLINE_BYTES travels in the call (ABI 1.9)."""
        data = _contiguous(data)
        flags = _put_flags(exclusive, update)
        with pinned(data) as (addr, n):
            if n <= _abi.INLINE_BYTES and not self._no_inline:
                a = _abi.KeyInline()
                a.k.source, a.k.len, a.k.obj_off, a.k.h.flags = _abi.SRC_INLINE, n, offset, flags
                ctypes.memmove(a.data, addr, n)
                if self._key_inline(True, key, a, meta):
                    return a.k.version
            a = _abi.Key(source=_abi.SRC_VM, addr=addr, len=n, obj_off=offset)
            a.h.flags = flags
            self.key_call(True, key, a, meta)
        return a.version

    def get_key_into(self, key, out, *, offset=0, meta=None):
        """Read up to len(out) bytes of key at offset into out in one call;
        return (count, the value's size, version). Into up to INLINE_BYTES,
        the bytes come back in the call (ABI 1.9)."""
        with pinned(out, writable=True) as (addr, n):
            if 0 < n <= _abi.INLINE_BYTES and not self._no_inline:
                a = _abi.KeyInline()
                a.k.source, a.k.len, a.k.obj_off = _abi.SRC_INLINE, n, offset
                if self._key_inline(False, key, a, meta):
                    if a.k.result > n:
                        raise OSError(errno.EPROTO, f"reply of {a.k.result} bytes into {n}", os.path.join(self.name, os.fsdecode(key)))
                    ctypes.memmove(addr, a.data, a.k.result)
                    return a.k.result, a.k.size, a.k.version
            a = self.key_call(False, key, _abi.Key(source=_abi.SRC_VM, addr=addr, len=n, obj_off=offset), meta)
        return a.result, a.size, a.version

    def lookup(self, key):
        """KeyInfo(size, version, meta) of key, in one call."""
        a = self.key_call(False, key, _abi.Key(source=_abi.SRC_VM))
        return KeyInfo(a.size, a.version, bytes(a.meta[: a.meta_len]))

    def register_vm(self, addr, length):
        """Register length bytes at address addr of this process's own
        memory (MC_KIND_VM: a pinned torch tensor, a numpy array, any
        mapping) on this directory; return the id for segments and buffer
        sources. Only this process may use it; memory unmapped later fails
        with EFAULT."""
        a = _abi.Register(kind=_abi.KIND_VM, len=length, offset=addr)
        a.fd = -1
        return self._ioctl(_abi.REGISTER_BUFFER, a).id

    # --- vector batches: keys of several segments (ABI 1.3) ---

    def batchv(self, put, items, gpus=()):
        """Run BATCH_PUTV (put) or BATCH_GETV over items, each (key, segs,
        meta, flags, obj_off) with segs a list of (id, off, len): id SEG_VM
        (off an address), a registration id, or SEG_GPU | i (gpus[i], a
        (handle, device) pair). Returns [(result, version)] in order."""
        if len(gpus) > _abi.MAX_GPU_REFS:
            raise ValueError(f"{len(gpus)} GPU allocations in one batch, at most {_abi.MAX_GPU_REFS}")
        out = []
        cmd = _abi.BATCH_PUTV if put else _abi.BATCH_GETV
        # Checked and encoded before any call: a bad item sends nothing.
        todo = []
        for key, segs, meta, flags, obj_off in items:
            if not segs or len(segs) > _abi.MAX_SEGS:
                raise ValueError(f"key {key!r}: {len(segs)} segments, want 1..{_abi.MAX_SEGS}")
            try:
                packed = b"".join(_SEG.pack(*seg) for seg in segs)  # ints in 0..2**64-1, three each
            except (struct.error, TypeError):
                raise ValueError(f"key {key!r}: segments {segs!r}: want (id, off, len), each in 0..2**64-1") from None
            if isinstance(flags, bool) or not (isinstance(obj_off, int) and isinstance(flags, int)
                                               and 0 <= obj_off < 1 << 64 and 0 <= flags < 1 << 32):
                raise ValueError(f"key {key!r}: obj_off {obj_off}, flags {flags} out of range")
            k = os.fsencode(key)
            m = _meta_bytes(meta) if meta is not None else b""
            if not k or 7 + len(packed) + len(k) + len(m) > _abi.VBATCH_AREA_BYTES:
                raise ValueError(f"key {key!r}: empty, or too large for one batch")
            todo.append((packed + k + m, len(segs), len(k), len(m), flags, obj_off))
        return self.send_packed(put, todo, gpus)

    def send_packed(self, put, todo, gpus=()):
        """batchv of items already checked and encoded: each (segments,
        key and meta as bytes, segment count, key length, meta length,
        flags, obj_off)."""
        out = []
        cmd = _abi.BATCH_PUTV if put else _abi.BATCH_GETV
        while todo:
            b = _abi.VBatch(ngpu=len(gpus))
            for i, (handle, device) in enumerate(gpus):
                _set_bytes(b.gpus[i].handle, handle, "IPC handle")
                if device is not None:
                    _set_bytes(b.gpus[i].device, device, "device UUID")
            # Entries and area written as bytes: a ctypes field costs more
            # than the key's whole share of the call.
            raw = memoryview((ctypes.c_uint8 * ctypes.sizeof(b)).from_buffer(b)).cast("B")
            used, n = 0, 0
            for blob, nseg, klen, mlen, flags, obj_off in todo:
                seg_off = (used + 7) & ~7
                end = seg_off + len(blob)
                if n == _abi.MAX_BATCH or end > _abi.VBATCH_AREA_BYTES:
                    break
                raw[_VAREA + seg_off:_VAREA + end] = blob
                key_off = seg_off + 24 * nseg
                _VENTRY.pack_into(raw, _VENTRIES + _VENTRY.size * n, key_off, klen, flags, seg_off, nseg,
                                  key_off + klen, mlen, obj_off, 0, 0)
                used, n = end, n + 1
            b.count = n
            try:
                self._ioctl(cmd, b)
                res, at, step = _VRESULT.unpack_from, _VENTRIES + _VRESULT_AT, _VENTRY.size
                out.extend([res(raw, at + step * i) for i in range(n)])
            finally:
                raw.release()
            todo = todo[n:]
        return out

    def send_columns(self, put, keys, lens, segs, nseg, flags, metas=b"", mlens=None, gpus=(), versions=False,
                     started=None):
        """batchv of n = len(lens) keys of nseg segments each, in one call:
        keys is their names' bytes end to end, lens their lengths, segs the
        (id, offset, length) triples of all their segments in key order, as
        little-endian u64 words (array("Q") on this machine); metas and
        mlens the same for their metas (none without), gpus the (handle,
        device) pairs that SEG_GPU segments name; offset 0. The caller
        keeps n <= MAX_BATCH and columns_fit(...). Returns each key's
        result (bytes moved or a negative errno) as a list; with versions,
        (result, version) pairs. The entries of keys of one length (and
        meta length) are packed once per shape and reused: a batch costs a
        few calls into C, not a few per key. started: as ioctl_released's."""
        raw = self._pack_columns(keys, lens, segs, nseg, flags, metas, mlens, gpus)
        ioctl_released(self.fileno(), _abi.BATCH_PUTV if put else _abi.BATCH_GETV, raw, self.name, started)
        return _column_results(raw, len(lens), versions)

    def submit_columns(self, put, keys, lens, segs, nseg, flags, metas=b"", mlens=None, gpus=()):
        """send_columns submitted (ABI 1.7): the daemon starts the call and
        this returns at once, with the call for wait_columns. Its segments
        name registrations of memfds or GPU memory (SEG_GPU), never this
        process's own memory (SEG_VM, register_vm: OSError EINVAL); that
        memory must stay as it is until wait_columns (or wait_calls)
        returns. OSError EBUSY when the directory's fd holds
        MAX_ASYNC_CALLS calls not waited for (or the user 256, the mount
        1024)."""
        raw = self._pack_columns(keys, lens, segs, nseg, flags, metas, mlens, gpus)
        struct.pack_into("<I", raw, 4, _abi.VBATCH_ASYNC)
        number = ioctl_released(self.fileno(), _abi.BATCH_PUTV if put else _abi.BATCH_GETV, raw, self.name)
        return _Submitted(number, raw, len(lens))

    def wait_columns(self, call, versions=True):
        """Wait for a call of submit_columns and return its results, as
        send_columns would have. Once per call: OSError EINVAL after."""
        raw = call.raw
        struct.pack_into("<III", raw, 0, _abi.BATCH_SIZE, 0, call.number)
        struct.pack_into("<I", raw, 12, 0)
        ioctl_released(self.fileno(), _abi.BATCH_WAIT, raw, self.name)
        return _column_results(raw, call.keys, versions)

    def wait_calls(self):
        """Wait until every call submitted on this directory's fd before
        now is over, consuming none of their results (BATCH_WAIT of call
        0): after it, the daemon uses none of the memory they named."""
        raw = bytearray(_abi.BATCH_SIZE)
        _VHEAD.pack_into(raw, 0, _abi.BATCH_SIZE, 0, 0, 0)
        ioctl_released(self.fileno(), _abi.BATCH_WAIT, raw, self.name)

    def _pack_columns(self, keys, lens, segs, nseg, flags, metas, mlens, gpus):
        """The raw vector batch of send_columns' arguments."""
        n = len(lens)
        if not n or nseg < 1 or min(lens) < 1:
            raise ValueError(f"{n} keys of {nseg} segments, names of {min(lens, default=0)}+ B: "
                             "a call has at least one key, each a name and a segment")
        sb = memoryview(segs).cast("B")
        kbase = n * nseg * _SEG.size
        mbase = kbase + len(keys)
        if len(sb) != kbase or len(keys) != sum(lens) or (mlens is not None and (len(mlens) != n or len(metas) != sum(mlens))) \
                or (mlens is None and metas) or len(gpus) > _abi.MAX_GPU_REFS or not columns_fit(n, nseg, mbase - kbase + len(metas)):
            raise ValueError(f"{n} keys of {nseg} segments: {len(sb)} B of segments, {len(keys)} B of names "
                             f"and {len(metas)} of metas do not match")
        raw = bytearray(_abi.BATCH_SIZE)
        _VHEAD.pack_into(raw, 0, _abi.BATCH_SIZE, 0, n, len(gpus))
        raw[_VENTRIES:_VENTRIES + _VENTRY.size * n] = _column_entries(n, nseg, flags, lens, kbase, mlens, mbase)
        for i, (handle, device) in enumerate(gpus):
            at = _VGPUS + _GPUREF * i
            if len(handle) != 64 or (device is not None and len(device) != 16):
                raise ValueError("an IPC handle is 64 bytes and a device UUID 16")
            raw[at:at + 64] = handle
            if device is not None:
                raw[at + 64:at + _GPUREF] = device
        raw[_VAREA:_VAREA + kbase] = sb
        raw[_VAREA + kbase:_VAREA + mbase] = keys
        raw[_VAREA + mbase:_VAREA + mbase + len(metas)] = metas
        return raw

    def batch_putv(self, items, *, meta=None, exclusive=False, check=True):
        """Put keys whose values are gathered from several buffers: items
        maps key -> list of buffers (bytes-like), stored concatenated, in
        one call per batch. meta: key -> meta. Returns key -> bytes written
        or -errno; with check, BatchError if any key failed."""
        items = {k: [_contiguous(b) for b in v] for k, v in dict(items).items()}
        meta = meta or {}
        flags = _put_flags(exclusive, False)
        with ExitStack() as stack:
            entries = []
            for k, bufs in items.items():
                segs = []
                for b in bufs:
                    addr, n = stack.enter_context(pinned(b))
                    segs.append((_abi.SEG_VM, addr, n))
                entries.append((k, segs, meta.get(k), flags, 0))
            res = self.batchv(True, entries)
        results = {k: r for k, (r, _) in zip(items, res)}
        if check and any(r < 0 for r in results.values()):
            raise BatchError(results, f"{self.name}: batch putv")
        return results

    def batch_getv(self, items, *, offset=0, check=True):
        """Read keys scattered into several buffers each: items maps key ->
        list of writable buffers, filled in order from offset. Returns key
        -> bytes read or -errno; with check, BatchError if any key failed."""
        items = dict(items)
        with ExitStack() as stack:
            entries = []
            for k, bufs in items.items():
                segs = []
                for b in bufs:
                    addr, n = stack.enter_context(pinned(b, writable=True))
                    segs.append((_abi.SEG_VM, addr, n))
                entries.append((k, segs, None, 0, offset))
            res = self.batchv(False, entries)
        results = {k: r for k, (r, _) in zip(items, res)}
        if check and any(r < 0 for r in results.values()):
            raise BatchError(results, f"{self.name}: batch getv")
        return results

    def batch(self, cmd, source, entries, buf_id=0):
        """Run BATCH_PUT or BATCH_GET (cmd) over entries (Entry tuples), in
        as many calls as the limits need: table calls of up to MAX_TABLE
        keys (ABI 1.8), or, against an older daemon, calls of MAX_BATCH.
        Returns [(result, version)] in order: result is bytes moved or a
        negative errno for that key."""
        if not self._old_abi:
            try:
                return _batch_tables(self, cmd, source, entries, buf_id)
            except _NoTables:
                # A daemon before ABI 1.8 (ENOTTY), or one not allowed to
                # read this process's memory (EPERM): its first table call
                # refused, nothing done.
                self._old_abi = True
        out = []
        for chunk in _chunks(entries):
            b = self._ioctl(cmd, pack_batch(source, buf_id, chunk))
            out.extend((b.entries[i].result, b.entries[i].version) for i in range(len(chunk)))
        return out


    def _makedirs_for(self, keys):
        made = False
        for k in keys:
            parent = os.path.dirname(os.fsdecode(k))
            if parent:
                os.makedirs(os.path.join(self.name, parent), exist_ok=True)
                made = True
        return made

    def batch_put(self, items, *, exclusive=False, update=False, makedirs=True, check=True):
        """Put many keys in one call per 1024 keys (see batch). items maps key -> buffer
        (bytes, bytearray, numpy array...). Returns key -> bytes written or
        -errno; with check, raises BatchError if any key failed. makedirs
        creates missing parent directories of keys that failed with ENOENT
        and retries those keys once."""
        items = {k: _contiguous(v) for k, v in dict(items).items()}
        flags = _put_flags(exclusive, update)
        results = {}
        todo = list(items)
        for attempt in range(2):
            with pinned_all([items[k] for k in todo]) as bufs:
                entries = [Entry(k, addr, n, 0, flags) for k, (addr, n) in zip(todo, bufs)]
                res = self.batch(_abi.BATCH_PUT, _abi.BATCH_VM, entries)
            for k, (r, _) in zip(todo, res):
                results[k] = r
            todo = [k for k in todo if results[k] == -errno.ENOENT]
            if not (makedirs and todo and attempt == 0 and self._makedirs_for(todo)):
                break
        results = {k: results[k] for k in items}
        if check and any(r < 0 for r in results.values()):
            raise BatchError(results, f"{self.name}: batch put")
        return results

    def batch_get_into(self, items, *, offset=0, check=True):
        """Read many keys in one call per 1024 keys (see batch). items maps key -> writable
        buffer; each gets up to len(buffer) bytes from offset. Returns key ->
        bytes read or -errno (-ENOENT for a missing key); with check, raises
        BatchError if any key failed."""
        items = dict(items)
        with pinned_all(list(items.values()), writable=True) as bufs:
            entries = [Entry(k, addr, n, offset) for k, (addr, n) in zip(items, bufs)]
            res = self.batch(_abi.BATCH_GET, _abi.BATCH_VM, entries)
        results = {k: r for k, (r, _) in zip(items, res)}
        if check and any(r < 0 for r in results.values()):
            raise BatchError(results, f"{self.name}: batch get")
        return results

    def batch_get(self, keys):
        """Read whole objects: key -> bytes, or None for a missing key (other
        errors raise BatchError). Sizes come from stat(2); each key also
        reads one byte past that size in the same call, so an object that
        grew or was replaced in between is detected and read again on its
        own."""
        keys = list(dict.fromkeys(keys))
        values, sizes = {}, {}
        for k in keys:
            try:
                sizes[k] = os.stat(k, dir_fd=self.fileno()).st_size
            except FileNotFoundError:
                values[k] = None
        present = [k for k in keys if k in sizes]
        bufs = {k: new_bytes(sizes[k]) for k in present}
        probe = bytearray(max(len(present), 1))
        failed = {}
        with pinned(probe, writable=True) as (paddr, _):
            entries, owners = [], []
            for i, k in enumerate(present):
                b, addr = bufs[k]
                if sizes[k]:
                    entries.append(Entry(k, addr, sizes[k]))
                    owners.append((k, "data"))
                entries.append(Entry(k, paddr + i, 1, sizes[k]))
                owners.append((k, "probe"))
            res = self.batch(_abi.BATCH_GET, _abi.BATCH_VM, entries)
        got = {}
        for (k, part), rv in zip(owners, res):
            got.setdefault(k, {})[part] = rv
        retry = []
        for k in present:
            data = got[k].get("data", (0, None))
            probe_r, probe_v = got[k]["probe"]
            size = sizes[k]
            r, v = data
            if r < 0 or (probe_r < 0 and probe_r != -errno.ERANGE and not size):
                err = r if r < 0 else probe_r
                if err == -errno.ENOENT:
                    values[k] = None
                else:
                    failed[k] = err
                continue
            b = bufs[k][0]
            if size and r < size:
                values[k] = b[:r]  # reached the end of the version it read
            elif probe_r in (0, -errno.ERANGE) and (not size or probe_v == v):
                values[k] = b
            else:
                retry.append(k)  # grew, or replaced between the two entries
        for k in retry:
            try:
                with File(os.path.join(self.name, os.fsdecode(k))) as f:
                    values[k] = f.get()
            except FileNotFoundError:
                values[k] = None
        if failed:
            raise BatchError({k: failed.get(k, 0) for k in keys}, f"{self.name}: batch get")
        return {k: values[k] for k in keys}


class Client:
    """mooncake-fs operations on keys of one mount.

    Keys are paths relative to the mount ("a/b/c"; a leading "/" is
    ignored). With mount=None keys are plain paths. The constructor checks
    the mount with GET_MAGIC unless probe=False; ``abi`` is the daemon's
    (major, minor)."""

    def __init__(self, mount=None, *, probe=True):
        self.mount = os.path.abspath(os.fspath(mount)) if mount is not None else None
        self.abi = None
        self._root = None  # the mount's root, kept open for one-call puts and gets
        self._root_lock = threading.Lock()
        self._local = threading.local()
        if probe and self.mount is not None:
            with Directory(self.mount) as d:
                self.abi = d.probe()
            if self.abi[0] != _abi.ABI_MAJOR:
                raise NotMooncakeError(errno.EPROTO, f"daemon ABI {self.abi[0]}.{self.abi[1]}, client {_abi.ABI_MAJOR}.x", self.mount)

    def close(self):
        """Close the directory handle the client keeps."""
        with self._root_lock:
            if self._root is not None:
                self._root.close()
                self._root = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _by_name(self, key):
        """(root directory, key relative to it) when key can go in one
        PUT_KEY/GET_KEY call, else (None, None): no mount, a key too long,
        or a daemon older than ABI 1.3."""
        if self.mount is None or (self.abi is not None and self.abi < (1, 3)):
            return None, None
        rel = os.path.normpath(os.fsdecode(os.fspath(key)).lstrip("/"))
        if rel in (".", "") or rel.startswith("..") or not key_fits(rel):
            return None, None  # the kernel resolves such paths
        with self._root_lock:
            if self._root is None:
                self._root = Directory(self.mount)
            return self._root, rel

    def _scratch(self):
        """A per-thread buffer for gets of unknown size."""
        b = getattr(self._local, "buf", None)
        if b is None:
            b = self._local.buf = bytearray(64 << 10)
        return b

    def path(self, key=""):
        key = os.fspath(key)
        if self.mount is None:
            return key or "."
        key = os.fsdecode(key).lstrip("/")
        return os.path.join(self.mount, key) if key else self.mount

    def open(self, key, mode="r"):
        """Open key as a File ("r" or "w")."""
        return File(self.path(key), mode)

    def opendir(self, dir=""):
        return Directory(self.path(dir))

    def _old_daemon(self, e):
        """Whether e says the daemon predates ABI 1.3 (then remember it)."""
        if e.errno != errno.ENOTTY:
            return False
        self.abi = (_abi.ABI_MAJOR, 2)
        return True

    def put(self, key, data, *, exclusive=False, makedirs=True):
        """Store data (bytes-like or numpy array) under key, replacing it
        atomically, in one call; return the version. exclusive: EEXIST if
        the key exists. makedirs creates missing parent directories."""
        d, rel = self._by_name(key)
        if d is not None:
            try:
                try:
                    return d.put_key(rel, data, exclusive=exclusive)
                except FileNotFoundError:
                    parent = os.path.dirname(rel)
                    if not makedirs or not parent:
                        raise
                    os.makedirs(self.path(parent), exist_ok=True)
                    return d.put_key(rel, data, exclusive=exclusive)
            except OSError as e:
                if not self._old_daemon(e):
                    raise
        path = self.path(key)
        try:
            f = File(path, "w")
        except FileNotFoundError:
            if not makedirs or not os.path.dirname(path):
                raise
            os.makedirs(os.path.dirname(path), exist_ok=True)
            f = File(path, "w")
        with f:
            return f.put(data, exclusive=exclusive)

    def update(self, key, data, offset=0):
        """Write data at offset into a copy of key's object (growing it if
        needed), made visible atomically; return the version."""
        with File(self.path(key), "w") as f:
            return f.put(data, offset=offset, update=True)

    def get(self, key, offset=0, length=None):
        """The object's bytes from offset (to the end, or length bytes), in
        one call for values up to 64 KiB (two for larger ones)."""
        d, rel = self._by_name(key)
        if d is not None:
            try:
                return self._get_by_name(d, rel, offset, length)
            except OSError as e:
                if not self._old_daemon(e):
                    raise
        with File(self.path(key)) as f:
            return f.get(length, offset)

    def _get_by_name(self, d, rel, offset, length):
        if length is not None:
            if 0 < length <= _abi.INLINE_BYTES and not d._no_inline:
                # The bytes come back in the call (get_key_into).
                buf = bytearray(length)
                count, _, _ = d.get_key_into(rel, buf, offset=offset)
                return bytes(buf) if count == length else bytes(buf[:count])
            b, addr = new_bytes(length)
            if not length:
                d.lookup(rel)  # ENOENT for a missing key
                return b
            a = d.key_call(False, rel, _abi.Key(source=_abi.SRC_VM, addr=addr, len=length, obj_off=offset))
            return b if a.result == length else b[: a.result]
        scratch = self._scratch()
        count, size, _ = d.get_key_into(rel, scratch, offset=offset)
        if offset + count >= size:
            return bytes(scratch[:count])
        for _ in range(8):
            # Larger than the scratch: read it whole into its own bytes,
            # again if it grew meanwhile.
            b, addr = new_bytes(size - offset)
            a = d.key_call(False, rel, _abi.Key(source=_abi.SRC_VM, addr=addr, len=size - offset, obj_off=offset))
            if offset + a.result >= a.size:
                return b if a.result == len(b) else b[: a.result]
            size = a.size
        raise OSError(errno.EAGAIN, "the value kept growing during the get", self.path(rel))

    def get_into(self, key, out, offset=0):
        """Read up to len(out) bytes at offset into out; return the count."""
        d, rel = self._by_name(key)
        if d is not None:
            try:
                return d.get_key_into(rel, out, offset=offset)[0]
            except OSError as e:
                if not self._old_daemon(e):
                    raise
        with File(self.path(key)) as f:
            return f.get_into(out, offset)

    def lookup(self, key):
        """KeyInfo(size, version, meta) of key, in one call."""
        d, rel = self._by_name(key)
        if d is None:
            raise ValueError(f"key {key!r}: lookups need a mount of ABI 1.3 and a key of at most {_abi.KEY_KEY_BYTES} bytes")
        return d.lookup(rel)

    def get_array(self, key, dtype="uint8", shape=None, offset=0):
        """Read key into a new numpy array (see File.get_array)."""
        with File(self.path(key)) as f:
            return f.get_array(dtype, shape, offset)

    def stat(self, key):
        with File(self.path(key)) as f:
            return f.stat()

    def batch_put(self, items, *, dir="", exclusive=False, makedirs=True, check=True):
        """Put {key: data} with keys relative to dir; see Directory.batch_put."""
        with self.opendir(dir) as d:
            return d.batch_put(items, exclusive=exclusive, makedirs=makedirs, check=check)

    def batch_get(self, keys, *, dir=""):
        """{key: bytes or None}; see Directory.batch_get."""
        with self.opendir(dir) as d:
            return d.batch_get(keys)

    def batch_get_into(self, items, *, dir="", offset=0, check=True):
        """Read {key: out buffer}; see Directory.batch_get_into."""
        with self.opendir(dir) as d:
            return d.batch_get_into(items, offset=offset, check=check)

    def pool(self, slot_size, slots, *, dir="", wait=False, timeout=None):
        """A BufferPool registered once on dir (default: the mount root)."""
        from .pool import BufferPool

        return BufferPool(self.path(dir), slot_size, slots, wait=wait, timeout=timeout)
