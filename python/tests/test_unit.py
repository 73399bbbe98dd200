"""Unit tests of the Python client that need no daemon: buffer addresses,
batch packing and chunking, and the pool's slots and lease lifetimes."""

import array
import ctypes
import errno
import gc
import mmap
import os
import signal
import struct
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mooncake_fs as mc  # noqa: E402
from mooncake_fs import _abi  # noqa: E402
from mooncake_fs._buffer import new_bytes, pinned, pinned_all  # noqa: E402
from mooncake_fs import client as mcc  # noqa: E402
from mooncake_fs.client import Entry, _chunks, overlapped, pack_batch  # noqa: E402
from mooncake_fs.pool import Lease, PoolClosed, PoolExhausted, _Slots  # noqa: E402

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


class TestBuffer(unittest.TestCase):
    def test_addresses(self):
        for obj in [b"abc", bytearray(b"xyz!"), memoryview(b"hello")[1:], array.array("d", [1.0, 2.0]),
                    mmap.mmap(-1, 4096), (ctypes.c_int * 3)()]:
            with self.subTest(type=type(obj).__name__):
                with pinned(obj) as (addr, n):
                    self.assertEqual(n, memoryview(obj).nbytes)
                    self.assertEqual(ctypes.string_at(addr, n), bytes(memoryview(obj)))

    def test_writable(self):
        b = bytearray(4)
        with pinned(b, writable=True) as (addr, n):
            ctypes.memmove(addr, b"WXYZ", n)
        self.assertEqual(b, b"WXYZ")
        with self.assertRaises(BufferError):
            with pinned(b"ro", writable=True):
                pass

    def test_export_blocks_resize(self):
        b = bytearray(8)
        with pinned(b):
            with self.assertRaises(BufferError):
                b.extend(b"more")
        b.extend(b"more")

    def test_pinned_all(self):
        a, b, c = bytearray(b"one"), bytearray(b"two!"), b"ro"
        with pinned_all([a, b]) as bufs:
            self.assertEqual([n for _, n in bufs], [3, 4])
            self.assertEqual([ctypes.string_at(p, n) for p, n in bufs], [b"one", b"two!"])
            for x in (a, b):
                with self.assertRaises(BufferError):
                    x.extend(b"more")
        a.extend(b"more")
        b.extend(b"more")
        # One that cannot be exported fails the whole, and the exports
        # taken before it are released.
        with self.assertRaises(BufferError):
            with pinned_all([a, c], writable=True):
                pass
        a.extend(b"again")
        with pinned_all([]) as bufs:
            self.assertEqual(bufs, [])

    @unittest.skipIf(np is None, "no numpy")
    def test_numpy(self):
        a = np.arange(12, dtype=np.int32).reshape(3, 4)
        with pinned(a) as (addr, n):
            self.assertEqual((addr, n), (a.ctypes.data, 48))
        with self.assertRaises((BufferError, ValueError)):
            with pinned(a.T):
                pass
        with self.assertRaises((BufferError, ValueError)):
            with pinned(a[:, ::2]):
                pass
        ro = np.zeros(3)
        ro.flags.writeable = False
        with self.assertRaises((BufferError, ValueError)):
            with pinned(ro, writable=True):
                pass

    def test_new_bytes(self):
        b, addr = new_bytes(6)
        ctypes.memmove(addr, b"filled", 6)
        self.assertEqual(b, b"filled")
        self.assertEqual(hash(b), hash(b"filled"))
        self.assertEqual(new_bytes(0), (b"", 0))


class TestOverlapped(unittest.TestCase):
    def test_results_in_order_and_all_done(self):
        done = []

        def call(i):
            time.sleep(0.01 * (5 - i))
            done.append(i)
            if i == 1:
                raise OSError(errno.EIO, "call 1")
            return i

        self.assertEqual(overlapped(lambda i=i: i * i for i in range(9)), [i * i for i in range(9)])
        with self.assertRaises(OSError):
            overlapped(lambda i=i: call(i) for i in range(5))
        self.assertEqual(sorted(done), list(range(5)))  # every call finished before the error came out

    def test_interrupt_waits_for_calls_in_flight(self):
        started, ended = [], []

        def call(i):
            started.append(i)
            time.sleep(0.2)
            ended.append(i)

        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        with self.assertRaises(KeyboardInterrupt):
            overlapped(lambda i=i: call(i) for i in range(12))
        self.assertEqual(sorted(started), sorted(ended))  # none still running
        seen = list(started)
        time.sleep(0.3)
        self.assertEqual(started, seen)  # and none started after

    def test_no_call_after_a_failure(self):
        ran = []

        def calls():
            yield lambda: (_ for _ in ()).throw(OSError(errno.EIO, "first"))
            for i in range(1, 6):
                time.sleep(0.05)  # building the next call
                yield lambda i=i: ran.append(i)

        with self.assertRaises(OSError):
            overlapped(calls())
        self.assertLess(len(ran), 3)

    def test_no_threads(self):
        real = mc.client._executor

        def refuse():
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

        mc.client._executor = refuse
        try:
            self.assertEqual(overlapped(lambda i=i: i for i in range(5)), list(range(5)))
            self.assertEqual(mc.client.in_parts(5, lambda i: i), list(range(5)))
        finally:
            mc.client._executor = real

    def test_in_parts(self):
        # Parts run by several threads, the caller's among them, results in
        # order; a part that raises or says None stops the later ones, and
        # every part that started has ended when in_parts returns or raises.
        from mooncake_fs.client import in_parts

        threads = set()

        def square(i):
            threads.add(threading.get_ident())
            time.sleep(0.01)
            return i * i

        self.assertEqual(in_parts(20, square), [i * i for i in range(20)])
        self.assertGreater(len(threads), 1)
        self.assertIn(threading.get_ident(), threads)
        for stop in ("raise", "none"):
            started, ended = [], []

            def part(i):
                started.append(i)
                time.sleep(0.02)
                ended.append(i)
                if i == 2:
                    if stop == "raise":
                        raise OSError(errno.EIO, "part 2")
                    return None
                return i

            if stop == "raise":
                with self.assertRaises(OSError):
                    in_parts(40, part)
            else:
                self.assertIsNone(in_parts(40, part))
            self.assertEqual(sorted(started), sorted(ended))
            self.assertLess(len(started), 12, started)  # no part started once the failure was seen
            seen = list(started)
            time.sleep(0.1)
            self.assertEqual(started, seen)

    def test_in_parts_interrupted(self):
        from mooncake_fs.client import in_parts

        started, ended = [], []

        def part(i):
            started.append(i)
            time.sleep(0.2)
            ended.append(i)
            return i

        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        with self.assertRaises(KeyboardInterrupt):
            in_parts(12, part)
        self.assertEqual(len(started) - len(ended), 1)  # only this thread's part, cut short; the others ended
        seen = list(started)
        time.sleep(0.3)
        self.assertEqual(started, seen)  # and none started after

    def test_interrupt_inside_submit_still_waits(self):
        # An interrupt inside submit, after the pool queued the work (its
        # future never returned), still waits for that work's part (call),
        # in in_parts and in overlapped.
        from concurrent.futures import thread as cft
        from mooncake_fs.client import in_parts

        busy = []

        def part(i):
            busy.append(i)
            time.sleep(0.1)
            busy.remove(i)
            return i

        mc.client._executor()
        orig = cft.ThreadPoolExecutor._adjust_thread_count

        def adjust(pool):
            orig(pool)
            cft.ThreadPoolExecutor._adjust_thread_count = orig
            time.sleep(0.02)  # a worker takes the work
            raise KeyboardInterrupt

        for run in (lambda: in_parts(6, part), lambda: overlapped(lambda i=i: part(i) for i in range(6))):
            cft.ThreadPoolExecutor._adjust_thread_count = adjust
            try:
                with self.assertRaises(KeyboardInterrupt):
                    run()
            finally:
                cft.ThreadPoolExecutor._adjust_thread_count = orig
            self.assertEqual(busy, [])  # no part still running

    def test_submit_withdraws_or_awaits_refused_work(self):
        # A pool that queues the work and then cannot start a thread for
        # it raises; a worker may take it later. submit withdraws it (it
        # never runs) or, when a worker took it already, waits for it.
        class Pool:
            def __init__(self, take):
                self.take, self.queued = take, []

            def submit(self, fn):
                self.queued.append(fn)
                if self.take:
                    threading.Thread(target=fn).start()
                    time.sleep(0.05)  # the worker is in fn
                raise RuntimeError("can't start new thread")

        ran = []

        def work():
            time.sleep(0.1)
            ran.append(1)
            return 7

        p = Pool(take=False)
        self.assertIsNone(mc.client.submit(p, work))
        p.queued[0]()  # the worker that takes it late
        self.assertEqual(ran, [])
        p = Pool(take=True)
        f = mc.client.submit(p, work)
        self.assertEqual(ran, [1])  # ended before submit returned
        self.assertEqual(f.result(timeout=0), 7)
        p.queued[0]()  # taken once only
        self.assertEqual(ran, [1])

    def test_forked_child(self):
        overlapped([lambda: 1, lambda: 2])  # the parent's pool exists
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if overlapped([lambda: 1, lambda: 2]) == [1, 2] else 1)
            finally:
                os._exit(2)
        _, st = os.waitpid(pid, 0)
        self.assertEqual(os.waitstatus_to_exitcode(st), 0)


class TestBatchPacking(unittest.TestCase):
    def test_layout(self):
        chunk = list(_chunks([Entry("a/b", 0x1000, 10, 5, _abi.FLAG_EXCL), Entry("ключ", 0x2000, 20)]))
        self.assertEqual(len(chunk), 1)
        b = bytes(pack_batch(_abi.BATCH_VM, 7, chunk[0]))
        self.assertEqual(len(b), 16376)
        self.assertEqual(struct.unpack_from("<IIIIQ", b, 0), (16376, 0, 2, _abi.BATCH_VM, 7))
        e0 = struct.unpack_from("<HHIQQQqQ", b, 24)
        self.assertEqual(e0, (0, 3, _abi.FLAG_EXCL, 0x1000, 10, 5, 0, 0))
        k1 = "ключ".encode()
        e1 = struct.unpack_from("<HHIQQQqQ", b, 24 + 48)
        self.assertEqual(e1, (3, len(k1), 0, 0x2000, 20, 0, 0, 0))
        keys = 24 + 64 * 48
        self.assertEqual(b[keys:keys + 3 + len(k1)], b"a/b" + k1)
        self.assertEqual(b[keys + 3 + len(k1):], bytes(16376 - keys - 3 - len(k1)))

    def test_results_are_signed(self):
        bt = _abi.Batch()
        struct.pack_into("<q", bt, 24 + 32, -errno.ENOENT)
        self.assertEqual(bt.entries[0].result, -errno.ENOENT)

    def test_chunks_by_count(self):
        chunks = list(_chunks(Entry(f"k{i}", 0, 1) for i in range(130)))
        self.assertEqual([len(c) for c in chunks], [64, 64, 2])

    def test_chunks_by_key_bytes(self):
        key = "x" * 1000
        chunks = list(_chunks(Entry(key + str(i), 0, 1) for i in range(30)))
        for c in chunks:
            self.assertLessEqual(sum(len(k) for _, k in c), _abi.BATCH_KEY_BYTES)
        self.assertEqual(sum(len(c) for c in chunks), 30)
        self.assertEqual(len(chunks), 3)  # 13 keys of 1001 B per call

    def test_bad_keys(self):
        for k in ["", "y" * (_abi.BATCH_KEY_BYTES + 1)]:
            with self.assertRaises(ValueError):
                list(_chunks([Entry(k, 0, 1)]))

    def test_structs(self):
        self.assertEqual(_abi.Buf().h.size, 56)
        self.assertEqual(_abi.Batch().h.size, 16376)
        self.assertEqual(_abi.Stat().h.size, 248)


class FakePool:
    """What Lease needs of a BufferPool."""

    def __init__(self, slots):
        self._slots = slots
        self.slot_size = slots.slot_size


def lease(slots, wait=False, timeout=None):
    return Lease(FakePool(slots), *slots.take(wait, timeout))


class TestSlots(unittest.TestCase):
    def setUp(self):
        self.s = _Slots(10000, 3, collect=True)
        self.addCleanup(self.s.close)

    def test_geometry(self):
        self.assertEqual(self.s.stride % mmap.PAGESIZE, 0)
        self.assertGreater(self.s.stride, 10000)
        self.assertEqual(os.fstat(self.s.fd).st_size, 3 * self.s.stride)
        ls = [lease(self.s) for _ in range(3)]
        self.assertEqual(sorted(x.offset for x in ls), [0, self.s.stride, 2 * self.s.stride])
        for x in ls:
            self.assertEqual(x.address, self.s.base + x.offset)
            self.assertEqual(len(x.buffer), 10000)

    def test_memory_is_the_memfd(self):
        with lease(self.s) as x:
            x.buffer[:5] = b"hello"
            self.assertEqual(os.pread(self.s.fd, 5, x.offset), b"hello")

    def test_exhaustion_raises(self):
        held = [lease(self.s) for _ in range(3)]
        t = time.monotonic()
        with self.assertRaises(PoolExhausted):
            lease(self.s)
        self.assertLess(time.monotonic() - t, 1.0)
        self.assertEqual(self.s.exhausted, 1)
        held[0].release()
        lease(self.s).release()

    def test_wait_timeout(self):
        held = [lease(self.s) for _ in range(3)]  # noqa: F841
        t = time.monotonic()
        with self.assertRaises(PoolExhausted):
            lease(self.s, wait=True, timeout=0.2)
        self.assertGreaterEqual(time.monotonic() - t, 0.2)
        self.assertEqual((self.s.waits, self.s.exhausted), (1, 1))

    def test_wait_until_released(self):
        held = [lease(self.s) for _ in range(3)]
        view = held[1].view(10)
        held[1].release()  # the view still holds the slot

        def drop():
            time.sleep(0.2)
            nonlocal view
            view = None

        th = threading.Thread(target=drop)
        th.start()
        t = time.monotonic()
        got = lease(self.s, wait=True, timeout=10)
        self.assertGreaterEqual(time.monotonic() - t, 0.15)
        self.assertEqual(got.slot, held[1].slot)
        th.join()

    def test_release_on_last_view(self):
        x = lease(self.s)
        x.buffer[:8] = b"abcdefgh"
        v = x.view(8)
        x.release()
        self.assertEqual(self.s.free, 2)
        sub = v[2:6]
        cast = v.cast("B", (2, 4))
        del v
        gc.collect()
        self.assertEqual(self.s.free, 2)
        self.assertEqual(bytes(sub), b"cdef")
        del sub
        self.assertEqual(self.s.free, 2)
        self.assertEqual(cast.tolist(), [list(b"abcd"), list(b"efgh")])
        del cast
        self.assertEqual(self.s.free, 3)

    def test_lease_dropped_without_release(self):
        x = lease(self.s)
        del x
        self.assertEqual(self.s.free, 3)

    def test_views_are_readonly_by_default(self):
        x = lease(self.s)
        v = x.view(4)
        with self.assertRaises(TypeError):
            v[0] = 1
        w = x.view(4, writable=True)
        w[0] = 1

    def test_cycle_collected_on_exhaustion(self):
        held = [lease(self.s) for _ in range(2)]  # noqa: F841
        x = lease(self.s)
        cyc = [x.view(4)]
        cyc.append(cyc)  # a cycle keeps the view alive until gc
        x.release()
        del x, cyc
        self.assertEqual(self.s.free, 0)
        lease(self.s).release()  # found by the collection before giving up

    @unittest.skipIf(np is None, "no numpy")
    def test_numpy_views(self):
        x = lease(self.s)
        x.buffer[:4 * 6] = np.arange(6, dtype=np.int32).tobytes()
        a = np.frombuffer(x.view(24), dtype=np.int32).reshape(2, 3)
        x.release()
        self.assertFalse(a.flags.writeable)
        col = a[:, 1]
        t = a.T
        del a
        gc.collect()
        self.assertEqual(self.s.free, 2)
        self.assertEqual(col.tolist(), [1, 4])
        del col
        self.assertEqual(self.s.free, 2)
        self.assertEqual(t.tolist(), [[0, 3], [1, 4], [2, 5]])
        del t
        self.assertEqual(self.s.free, 3)

    def test_slot_not_reused_while_viewed(self):
        x = lease(self.s)
        x.buffer[:4] = b"keep"
        v = x.view(4)
        x.release()
        for _ in range(10):
            others = [lease(self.s) for _ in range(2)]
            for o in others:
                self.assertNotEqual(o.slot, x.slot)
                o.buffer[:4] = b"XXXX"
            del others, o
        self.assertEqual(bytes(v), b"keep")

    def test_close_keeps_views(self):
        x = lease(self.s)
        x.buffer[:3] = b"abc"
        v = x.view(3)
        x.release()
        self.s.close()
        self.assertEqual(bytes(v), b"abc")
        with self.assertRaises(PoolClosed):
            lease(self.s)

    def test_close_wakes_waiters(self):
        held = [lease(self.s) for _ in range(3)]  # noqa: F841
        err = []

        def waiter():
            try:
                lease(self.s, wait=True, timeout=10)
            except Exception as e:
                err.append(e)

        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.1)
        self.s.close()
        th.join(5)
        self.assertFalse(th.is_alive())
        self.assertIsInstance(err[0], PoolClosed)

    def test_threads(self):
        s = _Slots(64, 4)
        self.addCleanup(s.close)
        errors = []

        def work(i):
            try:
                for _ in range(200):
                    x = lease(s, wait=True, timeout=10)
                    x.buffer[:8] = struct.pack("<Q", i)
                    v = x.view(8)
                    x.release()
                    if struct.unpack("<Q", v)[0] != i:
                        errors.append("slot shared between leases")
                    del v
            except Exception as e:
                errors.append(e)

        ths = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(s.free, 4)


class TestNotMooncake(unittest.TestCase):
    def test_probe_elsewhere(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(mc.NotMooncakeError):
                mc.Client(d)
            p = os.path.join(d, "f")
            with mc.File(p, "w") as f:
                with self.assertRaises(mc.NotMooncakeError):
                    f.probe()
                with self.assertRaises(OSError) as cm:
                    f.put(b"x")
                self.assertIn(cm.exception.errno, (errno.ENOTTY, errno.EINVAL))
                self.assertEqual(cm.exception.filename, p)

    def test_ioctl_clock(self):
        # Every call counts, failed ones too, with the time it took.
        clock = mcc.ioctl_clock
        calls, ns = clock.calls, clock.ns
        fd = os.open("/dev/null", os.O_RDONLY)
        try:
            with self.assertRaises(OSError) as cm:
                mcc.ioctl_released(fd, _abi.GET_MAGIC, bytearray(16), "/dev/null")
            self.assertEqual(cm.exception.errno, errno.ENOTTY)
        finally:
            os.close(fd)
        self.assertEqual(clock.calls, calls + 1)
        self.assertGreater(clock.ns, ns)

    def test_paths(self):
        c = mc.Client("/mnt/x", probe=False)
        self.assertEqual(c.path("a/b"), "/mnt/x/a/b")
        self.assertEqual(c.path("/a"), "/mnt/x/a")
        self.assertEqual(c.path(""), "/mnt/x")
        self.assertEqual(mc.Client(None).path("/abs/p"), "/abs/p")


if __name__ == "__main__":
    unittest.main()
