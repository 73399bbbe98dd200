"""Tests of mooncake_fs.mooncake_store that need no daemon: key names,
sizes, error codes, the tensor header, the config, and the calls' answers
before setup."""

import itertools
import os
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mooncake_fs import mooncake_store as ms  # noqa: E402


class KeyNames(unittest.TestCase):
    KEYS = ["k", "a/b", "/", "%", "%2F", ".", "..", ".hidden", "x\0y", "é" * 200, "a" * 255, "a" * 256,
            "%" * 300, "." * 600, "é/" * 700, "sglang_0a1b2c_0_k", "model@1@0@abc"]

    def test_round_trip(self):
        for k in self.KEYS:
            p = ms.key_to_path(k)
            self.assertEqual(ms.path_to_key(p), k, p)
            for c in p.split("/"):
                b = os.fsencode(c)
                self.assertTrue(0 < len(b) <= 255, c)
                self.assertNotIn(b, (b".", b".."))
                self.assertFalse(b.startswith(b"."), c)  # no hidden files
                self.assertNotIn(b"\0", b)
                b.decode("utf-8")  # never cut inside a character

    def test_distinct(self):
        paths = [ms.key_to_path(k) for k in self.KEYS]
        self.assertEqual(len(set(paths)), len(paths))

    def test_plain_keys_keep_their_names(self):
        for k in ("sglang_0a1b2c_0_k", "model@1@0@abc", "layer.0.weight"):
            self.assertEqual(ms.key_to_path(k), k)

    def test_not_made_by_key_to_path(self):
        for p in ("%2", "%zz", "a%+", "a/b", "%2e", ".x", "a%+/", "%25%", "a%+/b"):
            self.assertIsNone(ms.path_to_key(p), p)

    def test_bad_keys(self):
        with self.assertRaises(ValueError):
            ms.key_to_path("")
        with self.assertRaises(ValueError):  # would share "é"'s name
            ms.key_to_path("\udcc3\udca9")
        self.assertIsNone(ms.path_to_key(os.fsdecode(b"raw\xff")))
        with self.assertRaises(TypeError):
            ms.key_to_path(3)


class Sizes(unittest.TestCase):
    def test_parse(self):
        for v, n in [(5, 5), ("1024", 1024), ("4GB", 4 << 30), ("512 MiB", 512 << 20), ("1.5k", 1536), ("2t", 2 << 40)]:
            self.assertEqual(ms.parse_size(v), n, v)
        for v in ("", "GB", "4 XB", "-1", "1e3"):
            with self.assertRaises(ValueError):
                ms.parse_size(v)


class Codes(unittest.TestCase):
    def test_values(self):
        E = ms.ErrorCode
        self.assertEqual((E.OBJECT_NOT_FOUND, E.NO_AVAILABLE_HANDLE, E.INVALID_PARAMS, E.OBJECT_ALREADY_EXISTS),
                         (-704, -200, -600, -705))
        self.assertEqual(ms.error_code(2), -704)    # ENOENT
        self.assertEqual(ms.error_code(-28), -200)  # ENOSPC
        self.assertEqual(ms.error_code(OSError(22, "x")), -600)
        self.assertEqual(ms.error_code(9999), -1)
        self.assertEqual((ms.SoftPinAction.PRESERVE, ms.SoftPinAction.ENABLE, ms.SoftPinAction.DISABLE), (0, 1, 2))

    def test_config_defaults(self):
        c = ms.ReplicateConfig()
        self.assertEqual((c.replica_num, c.with_hard_pin, c.preferred_segment, c.preferred_segments,
                          c.prefer_alloc_in_same_node, c.soft_pin_action), (1, False, "", [], False, 0))
        self.assertIn("replica_num=1", str(c))


class TensorHeader(unittest.TestCase):
    def test_round_trip(self):
        h = ms.tensor_header("bfloat16", (2, 3, 4), 48)
        self.assertEqual(len(h), 304)
        self.assertEqual(h[:4], (0x4D4F4F4E).to_bytes(4, "little"))
        self.assertEqual(ms.parse_tensor_header(h + bytes(48)), ("bfloat16", (2, 3, 4), 48))
        self.assertEqual(ms.parse_tensor_header(ms.tensor_header("float32", (), 4)), ("float32", (), 4))

    def test_refused(self):
        for bad in (b"", bytes(304), b"x" * 400):
            with self.assertRaises(ValueError):
                ms.parse_tensor_header(bad)
        with self.assertRaises(ValueError):
            ms.tensor_header("complex64", (1,), 8)
        with self.assertRaises(ValueError):
            ms.tensor_header("float32", (1,) * 9, 4)


class BeforeSetup(unittest.TestCase):
    """Every call answers with a code before setup and after close (Mooncake
    crashes on some)."""

    def test_codes(self):
        s = ms.MooncakeDistributedStore()
        self.assertEqual(s.health_check(), 1)
        self.assertEqual(s.put("k", b"v"), -600)
        self.assertEqual(s.get("k"), b"")
        self.assertIsNone(s.get_buffer("k"))
        self.assertEqual(s.get_size("k"), -600)
        self.assertEqual(s.is_exist("k"), -600)
        self.assertEqual(s.batch_is_exist(["a", "b"]), [-600, -600])
        self.assertEqual(s.batch_put_from(["a"], [1], [1]), [-600])
        self.assertEqual(s.batch_put_from_multi_buffers(["a"], [[1]], [[1]]), [])
        self.assertEqual(s.batch_get_into(["a"], [1], [1]), [-600])
        self.assertEqual(s.register_buffer(4096, 4096), -600)
        self.assertEqual(s.remove("k"), -600)
        self.assertEqual(s.remove_all(), -600)
        self.assertEqual(s.close(), 0)

    def test_setup_arguments(self):
        s = ms.MooncakeDistributedStore()
        self.assertEqual(s.setup({"metadata_server": "x"}), -600)  # no local_hostname
        self.assertEqual(s.setup({"local_hostname": "h", "metadata_server": "x", "local_buffer_size": "lots"}), -600)
        self.assertEqual(s.setup("", "x", 0, 0, "tcp", "", ""), -600)
        self.assertEqual(s.setup("h", "x", 0, 0, "tcp", "", "", tenant_id="../up"), -600)


class HostAllocator(unittest.TestCase):
    def test_alloc_free(self):
        import ctypes

        a = ms.MooncakeHostMemAllocator()
        p = a.alloc(1 << 20)
        self.assertNotEqual(p, 0)
        ctypes.memmove(p + (1 << 20) - 5, b"hello", 5)  # the whole range is ours
        self.assertEqual(ctypes.string_at(p + (1 << 20) - 5, 5), b"hello")
        self.assertEqual(a.alloc(0), 0)
        self.assertEqual(a.alloc(-1), 0)
        self.assertEqual(a.free(p + 1), -600)
        self.assertEqual(a.free(p), 0)
        self.assertEqual(a.free(p), -600)


class OverlappedCalls(unittest.TestCase):
    """The fast path's calls of one batch, against a directory that records
    them: they overlap for distinct keys (and for gets), one after the
    other for a put of a key twice."""

    class Dir:
        def __init__(self):
            self.lock = threading.Lock()
            self.busy = self.most = 0
            self.calls = []

        def send_columns(self, put, keys, lens, segs, nseg, flags, started=None):
            with self.lock:
                self.busy += 1
                self.most = max(self.most, self.busy)
                self.calls.append(keys)
            if started is not None:
                self.started = True
                started.set()
            time.sleep(0.02)
            with self.lock:
                self.busy -= 1
            names = [keys[at:at + n] for at, n in zip(itertools.accumulate([0] + lens[:-1]), lens)]
            return [int(k[1:]) for k in names]  # each key's own result: their order shows

    def run_batch(self, put, keys, step=10):
        s = ms.MooncakeDistributedStore()
        s._dir, s._regs, s._bases = self.Dir(), [ms._Reg(1 << 20, 2 << 20, 9, False)], [1 << 20]
        res = s._columns(put, keys, [(1 << 20) + step * i for i in range(len(keys))], [10] * len(keys), 1, 0)
        self.assertEqual(res, [int(k[1:]) for k in keys])
        self.assertEqual(b"".join(s._dir.calls).decode().count("k"), len(keys))
        return s._dir

    def test_distinct_keys_overlap(self):
        d = self.run_batch(True, [f"k{i}" for i in range(200)])
        self.assertEqual(len(d.calls), 4)
        self.assertGreater(d.most, 1)

    def test_gets_overlap(self):
        self.assertGreater(self.run_batch(False, [f"k{i % 3}" for i in range(200)]).most, 1)

    def test_gets_into_shared_bytes_in_order(self):
        self.assertEqual(self.run_batch(False, [f"k{i}" for i in range(200)], step=9).most, 1)

    def test_calls_go_as_they_are_checked(self):
        # A batch of many keys sends each call of 64 as soon as its keys
        # are checked, the results in order, and waits for the calls it
        # sent whatever the rest does.
        for put in (False, True):
            d = self.run_batch(put, [f"k{i}" for i in range(1000)])
            self.assertEqual(len(d.calls), 16)
            self.assertGreater(d.most, 1)
        for put in (False, True):
            with self.subTest(put=put):
                s = ms.MooncakeDistributedStore()
                s._dir, s._regs, s._bases = self.Dir(), [ms._Reg(1 << 20, 2 << 20, 9, False)], [1 << 20]
                keys = [f"k{i}" for i in range(200)]
                keys[150] = "k%1"  # not a file name of its own: the general engine takes the batch
                self.assertIsNone(s._columns(put, keys, [(1 << 20) + 10 * i for i in range(200)], [10] * 200, 1, 0))
                # Parts of 64 keys went (never the one with key 150), and all had ended.
                self.assertLessEqual(len(s._dir.calls), 3)
                self.assertFalse(any(b"k%1" in c for c in s._dir.calls))
                self.assertEqual(s._dir.busy, 0)

    def test_a_key_that_is_no_str(self):
        # The general engine says which (INVALID_PARAMS for it), as for a
        # batch of few keys; the fast path sends nothing.
        for put in (True, False):
            s = ms.MooncakeDistributedStore()
            s._dir, s._regs, s._bases = self.Dir(), [ms._Reg(1 << 20, 2 << 20, 9, False)], [1 << 20]
            keys = [f"k{i}" for i in range(200)]
            keys[5] = bytearray(b"kb")
            self.assertIsNone(s._columns(put, keys, [(1 << 20) + 10 * i for i in range(200)], [10] * 200, 1, 0))
            self.assertEqual(s._dir.calls, [])

    def test_a_call_that_raises_stops_the_batch(self):
        class Failing(self.Dir):
            def send_columns(self, put, keys, lens, segs, nseg, flags, started=None):
                if keys.startswith(b"k64k"):
                    if started is not None:
                        started.set()
                    raise MemoryError("no room for the call")
                return super().send_columns(put, keys, lens, segs, nseg, flags, started)

        s = ms.MooncakeDistributedStore()
        s._dir, s._regs, s._bases = Failing(), [ms._Reg(1 << 20, 2 << 20, 9, False)], [1 << 20]
        keys = [f"k{i}" for i in range(1024)]
        with self.assertRaises(MemoryError):
            s._columns(True, keys, [(1 << 20) + 10 * i for i in range(1024)], [10] * 1024, 1, 0)
        self.assertLess(len(s._dir.calls), 15)  # it sent no more once it saw the failure
        self.assertEqual(s._dir.busy, 0)

    def test_overlap(self):
        for ptrs, sizes, want in [
            ([0, 10, 20], [10, 10, 10], False),   # in order, touching
            ([0, 10, 19], [10, 10, 10], True),    # in order, the last two share a byte
            ([20, 0, 10], [10, 10, 10], False),   # out of order, apart
            ([20, 0, 5], [10, 10, 10], True),     # out of order, sharing
            ([0, 100, 50], [200, 1, 1], True),    # one holds the others
            ([5, 5, 6], [0, 1, 1], False),        # an empty range shares nothing
            ([0, 5], [10, 0], False),             # not even inside another
            ([5, 0], [0, 0], False),              # all empty, out of order
            ([], [], False), ([7], [3], False),
            ([8, 0, 8], [4, 4, 4], True),          # one size, a start twice
            ([25, 0, 13, 52], [13, 13, 13, 13], True),   # one size, out of order: 0 and 13 touch, 13 and 25 share
            ([39, 0, 13, 26], [13, 13, 13, 13], False),  # one size, out of order, touching
        ]:
            self.assertEqual(ms._overlap(ptrs, sizes), want, (ptrs, sizes))

    def test_get_with_a_bad_buffer_sends_nothing(self):
        # The general engine refuses a call with a bad buffer whole, so the
        # first 64 keys do not go early either: no buffer is written.
        for bad in [(-1, "size"), (0, "ptr"), (1.5, "ptr")]:
            with self.subTest(bad=bad):
                s = ms.MooncakeDistributedStore()
                s._dir, s._regs, s._bases = self.Dir(), [ms._Reg(1 << 20, 2 << 20, 9, False)], [1 << 20]
                ptrs, sizes = [(1 << 20) + 10 * i for i in range(200)], [10] * 200
                (sizes if bad[1] == "size" else ptrs)[150] = bad[0]
                self.assertIsNone(s._columns(False, [f"k{i}" for i in range(200)], ptrs, sizes, 1, 0))
                self.assertEqual(s._dir.calls, [])

    def test_flat(self):
        self.assertEqual(ms._flat([[1], [2]], [[3], [4]], 2), ([1, 2], [3, 4], 1))
        self.assertEqual(ms._flat([(1, 5), (2, 6)], [[3, 7], [4, 8]], 2), ([1, 5, 2, 6], [3, 7, 4, 8], 2))
        for ptrs, sizes in [([[1], [2, 3]], [[3], [4, 5]]), ([[1], [2]], [[3], [4, 5]]), ([[1, 2], [3]], [[1, 2], [3]]),
                            ([[1], []], [[3], []]), ([[1], 2], [[3], [4]]), ([[1]], [[3], [4]])]:
            self.assertIsNone(ms._flat(ptrs, sizes, 2), (ptrs, sizes))

    def test_put_twice_in_order(self):
        keys = [f"k{i}" for i in range(200)]
        keys[150] = "k3"
        d = self.run_batch(True, keys)
        self.assertEqual(d.most, 1)
        self.assertTrue(d.calls[0].startswith(b"k0k1k2k3"))  # in order


class CompatPackage(unittest.TestCase):
    """python/compat's mooncake.store is mooncake_fs's class, and says so
    when it hides another mooncake package."""

    def run_import(self, extra):
        import subprocess
        import tempfile

        pkg_root = os.path.dirname(HERE)
        path = [os.path.join(pkg_root, "compat"), pkg_root] + extra
        code = ("import mooncake.store as s, mooncake_fs.mooncake_store as m; "
                "assert s.MooncakeDistributedStore is m.MooncakeDistributedStore")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                              cwd=tempfile.gettempdir()).stderr

    def test_alone(self):
        self.assertNotIn("hides", self.run_import([]))

    def test_hides_another(self):
        import tempfile

        with tempfile.TemporaryDirectory() as other:
            os.mkdir(os.path.join(other, "mooncake"))
            open(os.path.join(other, "mooncake", "__init__.py"), "w").close()
            err = self.run_import([other])
        self.assertIn("hides the mooncake package at " + other, err)


if __name__ == "__main__":
    unittest.main()
