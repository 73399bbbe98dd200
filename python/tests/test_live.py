"""Tests of the Python client against a running mooncake-fs daemon.

Set MOONCAKE_MOUNT to the mountpoint of a fresh daemon (the tests make and
leave keys under a unique directory there) and, for the registration
counts, MOONCAKE_BIN to the mooncake-fs binary (for `status --json`).
tests/python_test.go does both:

    MOONCAKE_MOUNT=/mnt/mooncake MOONCAKE_BIN=bin/mooncake-fs PYTHONPATH=python \\
        /usr/bin/python3 -m unittest discover -s python/tests -p 'test_live.py' -v
"""

import array
import ctypes
import errno
import gc
import itertools
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import uuid
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mooncake_fs as mc  # noqa: E402
from mooncake_fs import _abi  # noqa: E402

MOUNT = os.environ.get("MOONCAKE_MOUNT")
BIN = os.environ.get("MOONCAKE_BIN")

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


def status():
    out = subprocess.run([BIN, "status", "--json", MOUNT], check=True, capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)


def registrations():
    return status()["registrations"]


def wait_for(what, cond, timeout=30):
    """Poll cond (the kernel releases files asynchronously after close)."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        ok, state = cond()
        if ok:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout} s for {what}; last: {state}")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def wait_live(n):
    return wait_for(f"registrations.live == {n}", lambda: ((r := registrations())["live"] == n, r))


def pattern(n, seed=0):
    """n deterministic, non-repeating-ish bytes."""
    import random

    return random.Random(seed).randbytes(n)


@unittest.skipUnless(MOUNT, "MOONCAKE_MOUNT is not set (no daemon)")
class Live(unittest.TestCase):
    needs_status = False

    @classmethod
    def setUpClass(cls):
        if cls.needs_status and not BIN:
            raise unittest.SkipTest("MOONCAKE_BIN is not set (needed for status)")
        cls.c = mc.Client(MOUNT)
        cls.base = f"{cls.__name__}-{uuid.uuid4().hex[:8]}"
        os.mkdir(cls.c.path(cls.base))

    def key(self, name):
        return f"{self.base}/{name}"

    def path(self, name):
        return self.c.path(self.key(name))

    def assertErrno(self, code, fn, *a, **kw):
        with self.assertRaises(OSError) as cm:
            fn(*a, **kw)
        self.assertEqual(cm.exception.errno, code, f"{cm.exception!r}")
        return cm.exception


class TestCommands(Live):
    def test_probe(self):
        self.assertEqual(self.c.abi, (_abi.ABI_MAJOR, _abi.ABI_MINOR))
        with self.c.open(self.key("probe"), "w") as f:
            self.assertEqual(f.probe(), (mc._abi.ABI_MAJOR, mc._abi.ABI_MINOR))

    def test_round_trips(self):
        for i, data in enumerate([b"x", b"hello world", pattern(4096, 1), pattern(1 << 20, 2), pattern(5_000_001, 3)]):
            for kind, obj in [("bytes", data), ("bytearray", bytearray(data)), ("memoryview", memoryview(data)[0:])]:
                with self.subTest(size=len(data), kind=kind):
                    k = self.key(f"rt{i}-{kind}")
                    v = self.c.put(k, obj)
                    self.assertGreater(v, 0)
                    got = self.c.get(k)
                    self.assertIs(type(got), bytes)
                    self.assertEqual(got, data)
                    out = bytearray(len(data))
                    self.assertEqual(self.c.get_into(k, out), len(data))
                    self.assertEqual(out, data)
                    with open(self.path(f"rt{i}-{kind}"), "rb") as f:  # and through read(2)
                        self.assertEqual(f.read(), data)

    def test_empty_object(self):
        k = self.key("empty")
        self.c.put(k, b"")
        self.assertEqual(self.c.get(k), b"")
        self.assertEqual(self.c.stat(k).size, 0)

    def test_put_replaces(self):
        k = self.key("replace")
        v1 = self.c.put(k, b"long first value")
        v2 = self.c.put(k, b"short")
        self.assertGreater(v2, v1)
        self.assertEqual(self.c.get(k), b"short")

    def test_stat(self):
        k = self.key("stat")
        t0 = time.time_ns()
        v = self.c.put(k, pattern(10000))
        st = self.c.stat(k)
        self.assertEqual(st.size, 10000)
        self.assertEqual(st.version, v)
        self.assertEqual(st.ino, os.stat(self.path("stat")).st_ino)
        self.assertEqual(st.mode & 0o777, 0o644)
        self.assertGreaterEqual(st.replicas, 1)
        self.assertGreaterEqual(st.extents, 1)
        self.assertTrue(st.location, st)
        self.assertLess(abs(st.mtime_ns - t0), 60 * 10**9)
        self.assertErrno(errno.ENOENT, self.c.stat, self.key("nope"))

    def test_partial_gets(self):
        k = self.key("partial")
        data = pattern(100_000, 7)
        self.c.put(k, data)
        self.assertEqual(self.c.get(k, 10), data[10:])
        self.assertEqual(self.c.get(k, 10, 100), data[10:110])
        self.assertEqual(self.c.get(k, 99_990, 100), data[99_990:])  # short at the end
        self.assertEqual(self.c.get(k, 100_000), b"")
        self.assertEqual(self.c.get(k, 100_000, 5), b"")
        self.assertErrno(errno.ERANGE, self.c.get, k, 100_001)
        self.assertErrno(errno.ERANGE, self.c.get, k, 100_001, 5)
        # Up to INLINE_BYTES the bytes come back in the call (ABI 1.9).
        self.assertEqual(self.c.get(k, 50_000, 4096), data[50_000:54_096])
        self.assertEqual(self.c.get(k, 0, 4097), data[:4097])
        self.assertErrno(errno.ENOENT, self.c.get, self.key("partial-nope"), 0, 16)
        out = bytearray(1000)
        self.assertEqual(self.c.get_into(k, out, 50_000), 1000)
        self.assertEqual(out, data[50_000:51_000])
        self.assertEqual(self.c.get_into(k, out, 99_500), 500)
        self.assertEqual(out[:500], data[99_500:])

    def test_update(self):
        k = self.key("update")
        self.c.put(k, b"0123456789")
        self.c.update(k, b"AB", 3)
        self.assertEqual(self.c.get(k), b"012AB56789")
        self.c.update(k, b"tail", 12)  # grows, the gap reads as zeros
        self.assertEqual(self.c.get(k), b"012AB56789\0\0tail")
        with self.c.open(k, "w") as f:
            self.assertErrno(errno.EINVAL, f.put, b"x", offset=1)  # offset needs update

    def test_errors(self):
        k = self.key("errors")
        self.c.put(k, b"data")
        with self.c.open(k, "r") as f:
            self.assertErrno(errno.EBADF, f.put, b"nope")  # read-only file
        with self.c.open(k, "w") as f:
            self.assertErrno(errno.EFAULT, f.get_vm, 8, 4)  # unmapped address
            self.assertErrno(errno.EFAULT, f.put_vm, 8, 4)
            self.assertErrno(errno.EINVAL, f.put_buf, 12345, 0, 4)  # no such registration
        self.assertEqual(self.c.get(k), b"data")  # rejected calls changed nothing
        with self.c.opendir(self.base) as d:
            self.assertErrno(errno.EISDIR, mc.File.put_vm, d, 0, 0)
        with self.c.open(k, "w") as f:
            self.assertErrno(errno.ENOTDIR, mc.Directory.batch, f, _abi.BATCH_GET, _abi.BATCH_VM, [mc.Entry("x", 0, 0)])
        self.assertErrno(errno.ENOENT, self.c.get, self.key("missing"))

    def test_read_only_file_reads_its_version(self):
        k = self.key("snapshot")
        self.c.put(k, b"old version")
        with self.c.open(k, "r") as f:
            self.c.put(k, b"a much longer new version of the object")
            self.assertEqual(f.get(), b"old version")  # STAT says 39 B, the fd reads 11
            self.assertEqual(f.get(length=3, offset=4), b"ver")
        self.c.put(k, b"x" * 100)
        with self.c.open(k, "r") as f:
            self.c.put(k, b"y" * 5)
            self.assertEqual(f.get(), b"x" * 100)  # STAT says 5 B, the fd reads 100
        self.assertEqual(self.c.get(k), b"y" * 5)

    def test_exclusive(self):
        k = self.key("excl")
        self.c.put(k, b"first", exclusive=True)
        self.assertErrno(errno.EEXIST, self.c.put, k, b"second", exclusive=True)
        self.assertEqual(self.c.get(k), b"first")
        # An empty object that nobody changed since this fd opened it is free.
        k2 = self.key("excl-empty")
        with self.c.open(k2, "w") as f:
            f.put(b"mine", exclusive=True)
        self.assertEqual(self.c.get(k2), b"mine")
        # First writer wins between two files open on a new key.
        k3 = self.key("excl-race")
        with self.c.open(k3, "w") as a, self.c.open(k3, "w") as b:
            a.put(b"A", exclusive=True)
            self.assertErrno(errno.EEXIST, b.put, b"B", exclusive=True)
        self.assertEqual(self.c.get(k3), b"A")
        # Changed by another writer after this fd opened it.
        k4 = self.key("excl-changed")
        with self.c.open(k4, "w") as a:
            self.c.put(k4, b"")
            self.assertErrno(errno.EEXIST, a.put, b"late", exclusive=True)
        # Many processes race on one key: exactly one wins.
        k5 = self.key("excl-procs")
        script = ("import sys, mooncake_fs as mc\n"
                  "try:\n    mc.put(sys.argv[1], sys.argv[2].encode(), exclusive=True); print('WON')\n"
                  "except FileExistsError:\n    print('LOST')\n")
        procs = [subprocess.Popen([sys.executable, "-c", script, self.path("excl-procs"), f"writer{i}"],
                                  stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)))
                 for i in range(8)]
        outs = [p.communicate(timeout=60)[0].strip() for p in procs]
        self.assertEqual(sorted(outs), ["LOST"] * 7 + ["WON"], outs)
        winner = outs.index("WON")
        self.assertEqual(self.c.get(k5), f"writer{winner}".encode())

    def test_makedirs(self):
        k = self.key("deep/er/key")
        self.c.put(k, b"v")
        self.assertEqual(self.c.get(k), b"v")
        self.assertErrno(errno.ENOENT, self.c.put, self.key("nodir/key"), b"v", makedirs=False)

    def test_module_functions(self):
        p = self.path("modfn")
        mc.put(p, b"module level")
        self.assertEqual(mc.get(p), b"module level")
        self.assertEqual(mc.stat(p).size, 12)
        d = self.c.path(self.base)
        self.assertEqual(mc.batch_put(d, {"mb1": b"1", "mb2": b"22"}), {"mb1": 1, "mb2": 2})
        self.assertEqual(mc.batch_get(d, ["mb1", "mb2", "nope"]), {"mb1": b"1", "mb2": b"22", "nope": None})

    def test_registered_buffer(self):
        import mmap

        fd = os.memfd_create("live-test")
        os.ftruncate(fd, 1 << 20)
        m = mmap.mmap(fd, 1 << 20)
        try:
            data = pattern(300_000, 9)
            m[4096:4096 + len(data)] = data
            k = self.key("regbuf")
            with self.c.open(k, "w") as f:
                bid = f.register(fd, 1 << 20)
                self.assertEqual(f.put_buf(bid, 4096, len(data))[0], len(data))
                self.assertEqual(self.c.get(k), data)
                r, v = f.get_buf(bid, 600_000, 400_000, 1000)
                self.assertEqual((r, v), (len(data) - 1000, self.c.stat(k).version))
                self.assertEqual(m[600_000:600_000 + r], data[1000:])
                self.assertErrno(errno.EFAULT, f.get_buf, bid, (1 << 20) - 10, 100)  # outside the buffer
                self.assertErrno(errno.EFAULT, f.put_buf, bid, 1 << 20, 1)
                self.assertErrno(errno.ERANGE, f.get_buf, bid, 0, 10, len(data) + 1)
                with self.c.open(k, "w") as g:  # ids belong to the file they were made on
                    self.assertErrno(errno.EINVAL, g.get_buf, bid, 0, 10)
            self.assertEqual(self.c.get(k), data)
        finally:
            m.close()
            os.close(fd)

    def test_unregister(self):
        before = registrations() if BIN else None
        fd = os.memfd_create("live-unregister")
        try:
            os.ftruncate(fd, 4096)
            with self.c.open(self.key("unreg"), "w") as f:
                bid = f.register(fd, 4096)
                if BIN:
                    self.assertEqual(registrations()["live"], before["live"] + 1)
                f.unregister(bid)
                if BIN:
                    self.assertEqual(registrations()["live"], before["live"])
                self.assertErrno(errno.EINVAL, f.get_buf, bid, 0, 10)
                self.assertErrno(errno.EINVAL, f.unregister, bid)
            with self.c.opendir(self.base) as d:
                bid = d.register(fd, 4096)
                d.unregister(bid)
        finally:
            os.close(fd)

    def test_register_bad(self):
        with self.c.open(self.key("regbad"), "w") as f:
            self.assertErrno(errno.EBADF, f.register, 9999, 4096)  # not an fd of ours
            fd = os.memfd_create("small")
            try:
                os.ftruncate(fd, 4096)
                self.assertErrno(errno.EINVAL, f.register, fd, 0)
                self.assertErrno(errno.EINVAL, f.register, fd, 4096, 100)  # unaligned offset
            finally:
                os.close(fd)


@unittest.skipIf(np is None, "no numpy")
class TestNumpy(Live):
    DTYPES = ["uint8", "int8", "int16", "uint16", "int32", "int64", "float16", "float32", "float64",
              "complex64", "complex128", "bool"]

    def test_dtypes(self):
        rng = np.random.default_rng(0)
        for dt in self.DTYPES:
            with self.subTest(dtype=dt):
                a = (rng.standard_normal((37, 53)) * 1000).astype(dt)
                k = self.key(f"np-{dt}")
                self.c.put(k, a)
                self.assertEqual(self.c.stat(k).size, a.nbytes)
                b = self.c.get_array(k, dt, a.shape)
                np.testing.assert_array_equal(a, b)
                flat = self.c.get_array(k, dt)
                self.assertEqual(flat.shape, (a.size,))
                np.testing.assert_array_equal(a.ravel(), flat)
                out = np.empty_like(a)
                self.assertEqual(self.c.get_into(k, out), a.nbytes)
                np.testing.assert_array_equal(a, out)

    def test_large_array(self):
        a = np.arange(16 << 20, dtype=np.float32)  # 64 MiB
        k = self.key("np-large")
        self.c.put(k, a)
        b = self.c.get_array(k, np.float32)
        np.testing.assert_array_equal(a, b)

    def test_non_contiguous(self):
        a = np.arange(100, dtype=np.int64).reshape(10, 10)
        for name, view in [("transposed", a.T), ("strided", a[:, ::3]), ("fortran", np.asfortranarray(a))]:
            with self.subTest(name):
                k = self.key(f"np-{name}")
                self.c.put(k, view)
                np.testing.assert_array_equal(self.c.get_array(k, np.int64, view.shape), view)

    def test_into_views(self):
        a = np.arange(1000, dtype=np.int32)
        k = self.key("np-into")
        self.c.put(k, a)
        out = np.zeros(2000, dtype=np.int32)
        self.assertEqual(self.c.get_into(k, out[500:1500]), 4000)
        np.testing.assert_array_equal(out[500:1500], a)
        self.assertFalse(out[:500].any() or out[1500:].any())
        with self.assertRaises((BufferError, ValueError)):
            self.c.get_into(k, out[::2])
        part = self.c.get_array(k, np.int32, (10,), offset=40)
        np.testing.assert_array_equal(part, a[10:20])
        with self.assertRaises(ValueError):
            self.c.get_array(k, np.int32, (2000,))
        with self.assertRaises(ValueError):
            self.c.get_array(k, np.float64, offset=4)  # 3996 B is no whole number of float64


class TestBatch(Live):
    def test_put_get_many(self):
        items = {f"b{i:03d}": pattern(i * 37 + 1, i) for i in range(150)}  # three calls
        with self.c.opendir(self.base) as d:
            res = d.batch_put(items)
            self.assertEqual(res, {k: len(v) for k, v in items.items()})
            got = d.batch_get(list(items))
            self.assertEqual(got, items)
            outs = {k: bytearray(len(v) + 10) for k, v in items.items()}
            self.assertEqual(d.batch_get_into(outs), {k: len(v) for k, v in items.items()})
            for k, v in items.items():
                self.assertEqual(outs[k][:len(v)], v)
        self.assertEqual(self.c.get(self.key("b042")), items["b042"])

    def test_table_calls(self):
        # More keys than one table call carries, and more key bytes than
        # one holds: several table calls (ABI 1.8), results in order.
        items = {f"t{i:05d}-" + "k" * 40: pattern(i, 1 + i % 300) for i in range(2500)}
        with self.c.opendir(self.base) as d:
            self.assertFalse(d._old_abi)
            self.assertEqual(d.batch_put(items), {k: len(v) for k, v in items.items()})
            outs = {k: bytearray(len(v)) for k, v in items.items()}
            self.assertEqual(d.batch_get_into(outs), {k: len(v) for k, v in items.items()})
            self.assertEqual(outs, items)
            self.assertFalse(d._old_abi)
        # Against a daemon before ABI 1.8 the same calls go as BATCH_PUT
        # and BATCH_GET.
        with self.c.opendir(self.base) as d:
            d._old_abi = True
            some = dict(list(items.items())[:100])
            self.assertEqual(d.batch_get(list(some)), some)
        # An entry out of range is refused before any call goes.
        with self.c.opendir(self.base) as d:
            with self.assertRaises(ValueError):
                d.batch_get_into({"t00000-" + "k" * 40: bytearray(8), "t00001-" + "k" * 40: bytearray(8)}, offset=-1)
        # A directory of another file system refuses the table call
        # (ENOTTY): the handle falls back, and the old call fails alike.
        with tempfile.TemporaryDirectory() as tmp, mc.client.Directory(tmp) as d:
            with self.assertRaises(OSError) as cm:
                d.batch(_abi.BATCH_GET, _abi.BATCH_VM, [mc.Entry("x", 0, 0)])
            self.assertEqual(cm.exception.errno, errno.ENOTTY)
            self.assertTrue(d._old_abi)

    def test_missing_keys(self):
        with self.c.opendir(self.base) as d:
            d.batch_put({"have1": b"one", "have2": b"two"})
            outs = {"have1": bytearray(8), "gone": bytearray(8), "have2": bytearray(8), "sub/gone": bytearray(8)}
            res = d.batch_get_into(outs, check=False)
            self.assertEqual(res, {"have1": 3, "gone": -errno.ENOENT, "have2": 3, "sub/gone": -errno.ENOENT})
            with self.assertRaises(mc.BatchError) as cm:
                d.batch_get_into(outs)
            self.assertEqual(cm.exception.errno, errno.ENOENT)
            self.assertEqual(cm.exception.results, res)
            self.assertEqual(d.batch_get(["have1", "gone", "have2"]), {"have1": b"one", "gone": None, "have2": b"two"})
            # Raw results through the low-level call too.
            with mc.client.pinned(outs["have1"], writable=True) as (addr, n):
                raw = d.batch(_abi.BATCH_GET, _abi.BATCH_VM, [mc.Entry("gone", addr, n), mc.Entry("have1", addr, n)])
            self.assertEqual(raw[0], (-errno.ENOENT, 0))
            self.assertEqual(raw[1][0], 3)

    def test_parents(self):
        with self.c.opendir(self.base) as d:
            res = d.batch_put({"p1/x": b"x", "top": b"t"}, makedirs=False, check=False)
            self.assertEqual(res, {"p1/x": -errno.ENOENT, "top": 1})
            res = d.batch_put({"p2/q/x": b"x", "top2": b"t"})
            self.assertEqual(res, {"p2/q/x": 1, "top2": 1})
            self.assertEqual(d.batch_get(["p2/q/x"]), {"p2/q/x": b"x"})

    def test_exclusive(self):
        with self.c.opendir(self.base) as d:
            d.batch_put({"bx1": b"old"})
            res = d.batch_put({"bx1": b"new", "bx2": b"new"}, exclusive=True, check=False)
            self.assertEqual(res, {"bx1": -errno.EEXIST, "bx2": 3})
            self.assertEqual(d.batch_get(["bx1", "bx2"]), {"bx1": b"old", "bx2": b"new"})

    def test_key_area_chunking(self):
        # 40 keys of ~400 B exceed one call's 13280 B of key text.
        sub = "k" * 180
        items = {f"{sub}/{'v' * 200}{i:03d}": bytes([i]) * (i + 1) for i in range(40)}
        with self.c.opendir(self.base) as d:
            self.assertEqual(d.batch_put(items), {k: len(v) for k, v in items.items()})
            self.assertEqual(d.batch_get(list(items)), items)

    def test_bad_keys(self):
        with self.c.opendir(self.base) as d:
            res = d.batch_get_into({"../escape": bytearray(1), "a//b": bytearray(1), "ok-missing": bytearray(1)},
                                   check=False)
            self.assertLess(res["../escape"], 0)
            self.assertLess(res["a//b"], 0)
            self.assertEqual(res["ok-missing"], -errno.ENOENT)

    def test_batch_sees_new_versions(self):
        with self.c.opendir(self.base) as d:
            d.batch_put({"grow": b"ab"})
            self.c.put(self.key("grow"), b"abcdef")
            self.assertEqual(d.batch_get(["grow"]), {"grow": b"abcdef"})

    @unittest.skipIf(np is None, "no numpy")
    def test_numpy(self):
        arrays = {f"arr{i}": np.arange(i * 100, dtype=np.float64).reshape(i, 100) for i in range(1, 5)}
        outs = {k: np.empty_like(a) for k, a in arrays.items()}
        with self.c.opendir(self.base) as d:
            d.batch_put(arrays)
            d.batch_get_into(outs)
        for k in arrays:
            np.testing.assert_array_equal(arrays[k], outs[k])

    def test_client_dir(self):
        self.c.batch_put({"cd1": b"1"}, dir=self.base)
        self.assertEqual(self.c.batch_get(["cd1"], dir=self.base), {"cd1": b"1"})


class TestPool(Live):
    needs_status = True

    def pool(self, slot_size=1 << 20, slots=4, **kw):
        p = mc.BufferPool(self.c.path(self.base), slot_size, slots, **kw)
        self.addCleanup(p.close)
        return p

    def test_one_registration_per_pool(self):
        before = registrations()
        p = self.pool(1 << 20, 8)
        r = registrations()
        self.assertEqual(r["live"], before["live"] + 1)
        self.assertEqual(r["total"], before["total"] + 1)
        self.assertGreaterEqual(r["bytes"] - before["bytes"], 8 << 20)
        for i in range(50):
            p.put(f"one{i}", pattern(1000 + i, i))
            self.assertEqual(bytes(p.get_view(f"one{i}")), pattern(1000 + i, i))
        views = p.get_views([f"one{i}" for i in range(8)])
        del views
        p.put_many({f"many{i}": b"m" * i for i in range(1, 20)})
        r = registrations()
        self.assertEqual((r["live"], r["total"]), (before["live"] + 1, before["total"] + 1))
        self.assertEqual(p.stats()["registrations"], 1)
        p2 = self.pool(4096, 2)
        p2.put("two", b"2")
        self.assertEqual(registrations()["total"], before["total"] + 2)
        p.close()
        p2.close()
        wait_live(before["live"])

    def test_round_trip(self):
        p = self.pool()
        data = pattern(1 << 20, 11)
        v = p.put("pool-rt", data)
        self.assertEqual(self.c.stat(self.key("pool-rt")).version, v)
        self.assertEqual(self.c.get(self.key("pool-rt")), data)
        view = p.get_view("pool-rt")
        self.assertEqual(view, data)  # exactly slot_size bytes fit
        self.assertTrue(view.readonly)
        self.assertEqual(bytes(p.get_view("pool-rt", offset=1000)), data[1000:])
        p.put("pool-rt", b"")
        self.assertEqual(bytes(p.get_view("pool-rt")), b"")
        with p.lease() as ls:  # zero-copy write
            ls.buffer[:5] = b"lease"
            p.put_lease("pool-lease", ls, 5)
        self.assertEqual(self.c.get(self.key("pool-lease")), b"lease")
        p.put("pdir/sub/k", b"made")
        self.assertEqual(self.c.get(self.key("pdir/sub/k")), b"made")

    def test_errors_return_leases(self):
        p = self.pool(4096, 2)
        self.c.put(self.key("big"), pattern(4097))
        with self.assertRaises(mc.ObjectTooLarge):
            p.get_view("big")
        with self.assertRaises(mc.ObjectTooLarge):
            p.put("big2", pattern(4097))
        with self.assertRaises(FileNotFoundError):
            p.get_view("missing")
        self.assertEqual(bytes(p.get_view("big", offset=1)), pattern(4097)[1:])
        gc.collect()
        self.assertEqual(p.stats()["leased"], 0)
        with self.assertRaises(FileExistsError):
            p.put("big", b"x", exclusive=True)
        self.assertEqual(p.stats()["leased"], 0)

    def test_view_lifetime(self):
        p = self.pool(4096, 2)
        p.put("life", b"0123456789")
        v = p.get_view("life")
        self.assertEqual(p.stats()["leased"], 1)
        sub = v[2:8]
        sub2 = sub[1:3]
        cast = v.cast("B", (2, 5))
        del v, sub
        gc.collect()
        self.assertEqual(p.stats()["leased"], 1)
        self.assertEqual(bytes(sub2), b"34")
        del sub2
        gc.collect()
        self.assertEqual(p.stats()["leased"], 1)
        self.assertEqual(cast.tolist(), [list(b"01234"), list(b"56789")])
        # The slot is not reused (overwritten) while the view lives.
        for i in range(20):
            p.put("other", bytes([i]) * 10)
            self.assertEqual(bytes(p.get_view("other")), bytes([i]) * 10)
        self.assertEqual(cast.tobytes(), b"0123456789")
        del cast
        self.assertEqual(p.stats()["leased"], 0)
        # A view in a reference cycle lives until the collector runs.
        v = p.get_view("life")
        cyc = [v, None]
        cyc[1] = cyc
        del v, cyc
        self.assertEqual(p.stats()["leased"], 1)
        gc.collect()
        self.assertEqual(p.stats()["leased"], 0)

    @unittest.skipIf(np is None, "no numpy")
    def test_array_lifetime(self):
        p = self.pool(1 << 16, 2)
        a = np.arange(1000, dtype=np.float32).reshape(10, 100)
        self.c.put(self.key("arr"), a)
        b = p.get_array("arr", np.float32, (10, 100))
        np.testing.assert_array_equal(a, b)
        self.assertFalse(b.flags.writeable)
        self.assertEqual(p.stats()["leased"], 1)
        row = b[3]
        t = b.T[::2]
        del b
        gc.collect()
        self.assertEqual(p.stats()["leased"], 1)
        np.testing.assert_array_equal(row, a[3])
        del row
        gc.collect()
        self.assertEqual(p.stats()["leased"], 1)
        np.testing.assert_array_equal(t, a.T[::2])
        del t
        self.assertEqual(p.stats()["leased"], 0)
        w = p.get_array("arr", np.float32, writable=True)
        w[0] = 42  # the caller's own copy in the slot; the store is unchanged
        self.assertEqual(self.c.get_array(self.key("arr"), np.float32)[0], 0)

    def test_exhaustion_error(self):
        p = self.pool(4096, 2, wait=False)
        p.put("ex", b"x")
        held = [p.get_view("ex"), p.get_view("ex")]
        before = registrations()["total"]
        t = time.monotonic()
        with self.assertRaises(mc.PoolExhausted):
            p.get_view("ex")
        with self.assertRaises(mc.PoolExhausted):
            p.put("ex2", b"y")
        self.assertLess(time.monotonic() - t, 5)
        self.assertEqual(p.stats()["exhausted"], 2)
        self.assertEqual(registrations()["total"], before)  # never a silent registration
        del held[0]
        self.assertEqual(bytes(p.get_view("ex")), b"x")

    def test_exhaustion_wait(self):
        p = self.pool(4096, 1, wait=True, timeout=0.3)
        p.put("w", b"wait")
        v = p.get_view("w")
        t = time.monotonic()
        with self.assertRaises(mc.PoolExhausted):
            p.get_view("w")
        self.assertGreaterEqual(time.monotonic() - t, 0.3)

        def drop_later():
            nonlocal v
            time.sleep(0.3)
            v = None

        th = threading.Thread(target=drop_later)
        th.start()
        t = time.monotonic()
        v2 = p.lease(timeout=10)  # waits for the view to go
        self.assertGreaterEqual(time.monotonic() - t, 0.2)
        th.join()
        v2.release()
        st = p.stats()
        self.assertEqual((st["waits"], st["exhausted"], st["leased"]), (2, 1, 0))

    def test_file_pool(self):
        before = registrations()
        fp = mc.BufferPool(self.path("filepool"), 1 << 16, 2)
        self.addCleanup(fp.close)
        self.assertFalse(fp.is_dir)
        data = pattern(50_000, 5)
        fp.put(None, data)
        self.assertEqual(self.c.get(self.key("filepool")), data)
        self.assertEqual(bytes(fp.get_view()), data)
        self.assertEqual(bytes(fp.get_view(offset=49_990)), data[49_990:])
        with self.assertRaises(ValueError):
            fp.get_view("other")
        self.assertEqual(registrations()["live"], before["live"] + 1)
        fp.close()
        wait_live(before["live"])

    def test_get_views_batch(self):
        p = self.pool(4096, 8)
        p.put_many({f"gv{i}": bytes([65 + i]) * (i + 1) for i in range(5)})
        views = p.get_views(["gv0", "gv3", "nope", "gv4"])
        self.assertEqual({k: (None if v is None else bytes(v)) for k, v in views.items()},
                         {"gv0": b"A", "gv3": b"DDDD", "nope": None, "gv4": b"EEEEE"})
        self.assertEqual(p.stats()["leased"], 3)
        del views
        self.assertEqual(p.stats()["leased"], 0)

    def test_close_with_live_views(self):
        before = registrations()
        p = mc.BufferPool(self.c.path(self.base), 4096, 2)
        p.put("cl", b"still here")
        v = p.get_view("cl")
        p.close()
        wait_live(before["live"])
        self.assertEqual(bytes(v), b"still here")  # our memory, still mapped
        with self.assertRaises(mc.PoolClosed):
            p.get_view("cl")

    def test_threads(self):
        p = self.pool(1 << 16, 4, wait=True, timeout=30)
        errors = []

        def work(i):
            try:
                for j in range(30):
                    k = f"t{i}-{j % 3}"
                    data = pattern(1000 + j, i * 100 + j)
                    p.put(k, data)
                    v = p.get_view(k)
                    if bytes(v) != data:
                        errors.append(f"{k}: wrong data")
                    del v  # a thread holding a view while it asks for more can starve the pool
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        ths = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        self.assertEqual(errors, [])
        gc.collect()
        self.assertEqual(p.stats()["leased"], 0)


KILLED_CHILD = r"""
import os, sys, time, mooncake_fs as mc
mount, base = sys.argv[1], sys.argv[2]
pools = [mc.BufferPool(os.path.join(mount, base), 1 << 20, 2) for _ in range(2)]
pools[0].put("killed", b"data")
view = pools[0].get_view("killed")         # a lease outstanding too
f = mc.File(os.path.join(mount, base, "killed-file"), "w")
fd = os.memfd_create("x"); os.ftruncate(fd, 4096)
f.register(fd, 4096)                       # and a bare registration
print("READY", flush=True)
time.sleep(600)
"""


class TestKilledClient(Live):
    needs_status = True

    def test_killed_client_leaks_nothing(self):
        before = registrations()
        p = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, MOUNT, self.base], stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)))
        try:
            self.assertEqual(p.stdout.readline().strip(), "READY")
            r = registrations()
            self.assertEqual(r["live"], before["live"] + 3)
            self.assertEqual(r["total"], before["total"] + 3)
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(30)
            p.stdout.close()
        r = wait_live(before["live"])
        self.assertEqual(r["bytes"], before["bytes"])
        self.assertEqual(self.c.get(self.key("killed")), b"data")


class TestSubmitted(Live):
    """Vector batches submitted and waited for (ABI 1.7): several in the
    daemon at once, checked against the same calls made one by one. They
    take memory the daemon holds (a memfd registration), never the
    caller's own."""

    def setUp(self):
        self.d = self.c.opendir(self.base)
        self.addCleanup(self.d.close)
        fd = os.memfd_create("submitted")
        self.addCleanup(os.close, fd)
        os.ftruncate(fd, 1 << 20)
        self.mem = mmap.mmap(fd, 1 << 20)
        self.addCleanup(self.mem.close)
        self.rid = self.d.register(fd, 1 << 20)

    def columns(self, names, spans, rid=None):
        keys = [n.encode() for n in names]
        rid = self.rid if rid is None else rid
        words = array.array("Q", itertools.chain.from_iterable((rid, off, n) for off, n in spans))
        return b"".join(keys), [len(k) for k in keys], words

    def test_parts_at_once(self):
        d = self.d
        vals = [pattern(1000 + 37 * i, i) for i in range(40)]
        spans, off = [], 0
        for v in vals:
            self.mem[off:off + len(v)] = v
            spans.append((off, len(v)))
            off += len(v)
        calls = []
        for lo in range(0, 40, 8):
            names = [f"s{i}" for i in range(lo, lo + 8)]
            calls.append(d.submit_columns(True, *self.columns(names, spans[lo:lo + 8]), 1, 0))
        self.assertEqual(len({c.number for c in calls}), 5)
        for k in reversed(range(len(calls))):
            self.assertEqual([r for r, _ in d.wait_columns(calls[k])], [len(v) for v in vals[k * 8:k * 8 + 8]])
        self.assertErrno(errno.EINVAL, d.wait_columns, calls[0])  # once each
        for i, v in enumerate(vals):
            self.assertEqual(self.c.get(self.key(f"s{i}")), v)
        # Gets into the second half, one key missing, one span too short
        # (FLAG_WHOLE).
        base = 512 << 10
        outs = [(base + i * 8192, len(v)) for i, v in enumerate(vals[:8])]
        outs[5] = (outs[5][0], 3)
        names = [f"s{i}" for i in range(8)]
        names[2] = "missing"
        c = d.submit_columns(False, *self.columns(names, outs), 1, _abi.FLAG_WHOLE)
        want = [len(v) for v in vals[:8]]
        want[2], want[5] = -errno.ENOENT, -errno.EOVERFLOW
        self.assertEqual([r for r, _ in d.wait_columns(c)], want)
        for i in (0, 1, 3, 4, 6, 7):
            self.assertEqual(self.mem[outs[i][0]:outs[i][0] + outs[i][1]], vals[i])

    def test_no_process_memory(self):
        buf = bytearray(b"p" * 4096)
        addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        vid = self.d.register_vm(addr, len(buf))
        for words in (array.array("Q", (_abi.SEG_VM, addr, 4096)), array.array("Q", (vid, 0, 4096))):
            self.assertErrno(errno.EINVAL, self.d.submit_columns, True, b"pm", [2], words, 1, 0)
        self.assertErrno(errno.ENOENT, self.c.get, self.key("pm"))
        for keys, lens in ((b"", [0]), (b"", [])):  # an empty name, no key: refused before any ioctl
            with self.assertRaises(ValueError):
                self.d.submit_columns(True, keys, lens, array.array("Q", (self.rid, 0, 1) * len(lens)), 1, 0)

    def test_bound_and_barrier(self):
        d = self.d
        self.mem[:4096] = b"q" * 4096
        calls = [d.submit_columns(True, *self.columns([f"b{i}"], [(0, 4096)]), 1, 0) for i in range(_abi.MAX_ASYNC_CALLS)]
        self.assertErrno(errno.EBUSY, d.submit_columns, True, *self.columns(["over"], [(0, 4096)]), 1, 0)
        d.wait_calls()  # all done, none consumed
        self.assertErrno(errno.ENOENT, self.c.get, self.key("over"))
        for c in calls:
            self.assertEqual(d.wait_columns(c), [(4096, mock.ANY)])
        self.assertEqual(self.c.get(self.key(f"b{_abi.MAX_ASYNC_CALLS - 1}")), b"q" * 4096)
        d.wait_calls()  # nothing outstanding: returns at once


class TestKeysByName(Live):
    """Client.put/get in one call (PUT_KEY/GET_KEY, ABI 1.3) and the vector
    batches of Directory."""

    def test_one_call_round_trips(self):
        for i, data in enumerate([b"", b"x", pattern(65536, 1), pattern(65537, 2), pattern(3 << 20, 3)]):
            with self.subTest(size=len(data)):
                k = self.key(f"one{i}")
                v = self.c.put(k, data)
                self.assertEqual(self.c.get(k), data)
                self.assertEqual(self.c.lookup(k), mc.KeyInfo(len(data), v, b""))
                if data:
                    self.assertEqual(self.c.get(k, offset=1), data[1:])
                    self.assertEqual(self.c.get(k, 0, 1), data[:1])
                    out = bytearray(len(data) + 5)
                    self.assertEqual(self.c.get_into(k, out), len(data))
                    self.assertEqual(bytes(out[: len(data)]), data)

    def test_paths_and_errors(self):
        self.c.put(self.key("deep/er/k"), b"made")  # parents made on the way
        self.assertEqual(self.c.get(self.key("deep/./er//k")), b"made")
        self.assertEqual(self.c.get("/" + self.key("deep/er/../er/k")), b"made")
        self.assertErrno(errno.ENOENT, self.c.get, self.key("none"))
        self.assertErrno(errno.ENOENT, self.c.put, self.key("nodir/k"), b"x", makedirs=False)
        self.assertErrno(errno.EEXIST, self.c.put, self.key("deep/er/k"), b"y", exclusive=True)
        self.assertEqual(self.c.get(self.key("deep/er/k")), b"made")
        self.assertErrno(errno.ERANGE, self.c.get, self.key("deep/er/k"), 10)
        long = "n" * 200 + "/" + "m" * 200 + "/" + "o" * 200 + "/" + "p" * 200
        self.c.put(self.key(long), b"long")  # longer than one call carries
        self.assertEqual(self.c.get(self.key(long)), b"long")

    def test_meta_and_vectors(self):
        d = self.c.opendir(self.base)
        self.addCleanup(d.close)
        v = d.put_key("m", b"abcdef", meta="dtype=uint8 shape=6")
        self.assertEqual(d.lookup("m"), mc.KeyInfo(6, v, b"dtype=uint8 shape=6"))
        out = bytearray(6)
        self.assertErrno(errno.EBADMSG, d.get_key_into, "m", out, meta="dtype=int8 shape=6")
        self.assertEqual(out, bytearray(6))
        self.assertEqual(d.get_key_into("m", out, meta="dtype=uint8 shape=6")[0], 6)
        d.put_key("m", b"XY", update=True, offset=1)  # an update keeps the meta
        self.assertEqual(d.lookup("m").meta, b"dtype=uint8 shape=6")
        self.c.put(self.key("m"), b"plain")  # a whole put without one drops it
        self.assertEqual(d.lookup("m").meta, b"")
        with self.assertRaises(ValueError):
            d.put_key("m", b"x", meta="z" * (_abi.MAX_META + 1))
        parts = {f"v{i}": [pattern(i * 1000 + 1, i), pattern(77, i + 50), pattern(i * 3, i + 90)] for i in range(100)}
        r = d.batch_putv(parts, meta={"v3": "three"})
        self.assertEqual(r, {k: sum(len(p) for p in v) for k, v in parts.items()})
        for k, v in parts.items():
            self.assertEqual(self.c.get(self.key(k)), b"".join(v))
        self.assertEqual(d.lookup("v3").meta, b"three")
        bufs = {k: [bytearray(50), bytearray(len(b"".join(v)))] for k, v in parts.items()}
        r = d.batch_getv(bufs)
        for k, v in parts.items():
            whole = b"".join(v)
            self.assertEqual(r[k], len(whole))
            self.assertEqual(bytes(bufs[k][0] + bufs[k][1])[: len(whole)], whole)
        r = d.batch_getv({"v5": [bytearray(10)], "nope": [bytearray(1)]}, check=False)
        self.assertEqual(r["nope"], -errno.ENOENT)

    def test_register_by_address(self):
        import mmap

        d = self.c.opendir(self.base)
        self.addCleanup(d.close)
        m = mmap.mmap(-1, 1 << 20)
        m.write(pattern(1 << 20, 7))
        view = (ctypes.c_char * len(m)).from_buffer(m)
        rid = d.register_vm(ctypes.addressof(view), len(m))
        r = d.batchv(True, [("reg", [(rid, 4096, 8192), (rid, 0, 10)], None, 0, 0)])
        self.assertEqual(r[0][0], 8202)
        self.assertEqual(self.c.get(self.key("reg")), m[4096:12288] + m[0:10])
        r = d.batchv(True, [("reg2", [(rid, (1 << 20) - 1, 2)], None, 0, 0)])
        self.assertEqual(r[0][0], -errno.EFAULT)  # past the registered range
        d.unregister(rid)
        del view


if __name__ == "__main__":
    unittest.main()
