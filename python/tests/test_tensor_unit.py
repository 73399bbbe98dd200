"""Unit tests of the tensor helpers that need neither torch, a GPU nor a
daemon: dtype names, shape attributes, state-dict key escaping, size
checks, the ABI struct of the CUDA commands, and that the package imports
and the CUDA loader fails cleanly without torch or a driver. A few tests
use torch when it is importable (CPU only) and skip otherwise."""

import ctypes
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mooncake_fs import _abi, cudadrv  # noqa: E402
from mooncake_fs import tensor as mt  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover - the usual case on CI
    torch = None


class TestDtypeNames(unittest.TestCase):
    def test_canonical(self):
        for s in ["float32", "float16", "bfloat16", "int8", "int64", "uint8", "bool", "complex64", "float8_e4m3fn"]:
            with self.subTest(s=s):
                self.assertEqual(mt.dtype_name(s), s)
                self.assertEqual(mt.dtype_name("torch." + s), s)

    def test_aliases(self):
        for alias, name in [("float", "float32"), ("half", "float16"), ("double", "float64"), ("long", "int64"),
                            ("int", "int32"), ("short", "int16"), ("cfloat", "complex64"), ("torch.half", "float16")]:
            with self.subTest(alias=alias):
                self.assertEqual(mt.dtype_name(alias), name)

    def test_objects_by_str(self):
        class D:  # anything whose str() is torch's spelling
            def __str__(self):
                return "torch.bfloat16"

        self.assertEqual(mt.dtype_name(D()), "bfloat16")

    def test_rejected(self):
        for bad in ["", "Float32", "float 32", "torch.", "qint8", "quint8", "quint4x2", "qint32", "1x", "a/b"]:
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                mt.dtype_name(bad)

    def test_parse_dtype(self):
        self.assertEqual(mt.parse_dtype(b"float32"), "float32")
        self.assertEqual(mt.parse_dtype(b" half\n"), "float16")
        for bad in [b"", b"\xff", b"qint8", b"x y"]:
            with self.subTest(bad=bad), self.assertRaises(mt.TensorFormatError):
                mt.parse_dtype(bad)

    def test_itemsize_table(self):
        self.assertEqual(mt.ITEMSIZE["bfloat16"], 2)
        self.assertEqual(mt.expected_nbytes("float32", (2, 3, 4)), 96)
        self.assertEqual(mt.expected_nbytes("int64", ()), 8)
        self.assertEqual(mt.expected_nbytes("float16", (0, 7)), 0)
        self.assertEqual(mt.expected_nbytes("newtype", (3,), itemsize=2), 6)
        with self.assertRaises(ValueError):
            mt.expected_nbytes("newtype", (3,))
        for name in mt.ITEMSIZE:
            self.assertEqual(mt.dtype_name(name), name)
        for alias, name in mt.ALIASES.items():
            self.assertIn(name, mt.ITEMSIZE, alias)


class TestShapes(unittest.TestCase):
    def test_format(self):
        self.assertEqual(mt.format_shape((2, 3, 4)), "2,3,4")
        self.assertEqual(mt.format_shape(()), "")
        self.assertEqual(mt.format_shape([0]), "0")
        self.assertEqual(mt.format_shape((1 << 40, 1)), f"{1 << 40},1")

    def test_format_rejects(self):
        for bad in [(-1,), (1.5,), ("2",), (True,), (None,)]:
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                mt.format_shape(bad)

    def test_parse(self):
        for s, want in [("2,3,4", (2, 3, 4)), ("", ()), (b"", ()), (b"7", (7,)), ("0,5", (0, 5)), (" 2, 3 ", (2, 3))]:
            with self.subTest(s=s):
                self.assertEqual(mt.parse_shape(s), want)

    def test_round_trip(self):
        for shape in [(), (0,), (1,), (2, 3, 4), (5, 0, 2), (1, 1, 1, 1, 1, 1, 1, 1)]:
            self.assertEqual(mt.parse_shape(mt.format_shape(shape).encode()), shape)

    def test_parse_rejects(self):
        for bad in ["2,,3", "2,-3", "a", "2.0", ",", "2,", b"\xff", "1e3", "+2"]:
            with self.subTest(bad=bad), self.assertRaises(mt.TensorFormatError):
                mt.parse_shape(bad)

    def test_xattrs_for(self):
        self.assertEqual(mt.xattrs_for("torch.float32", (2, 3)),
                         {"user.mooncake.dtype": b"float32", "user.mooncake.shape": b"2,3"})
        self.assertEqual(mt.xattrs_for("bfloat16", ()), {mt.DTYPE_XATTR: b"bfloat16", mt.SHAPE_XATTR: b""})

    def test_meta(self):
        self.assertEqual(mt.format_meta("torch.float32", (2, 3)), b"dtype=float32 shape=2,3")
        self.assertEqual(mt.format_meta("bfloat16", ()), b"dtype=bfloat16 shape=")
        for dt, shape in [("float32", (2, 3)), ("int8", ()), ("bool", (0,)), ("float64", (1, 2, 3, 4, 5))]:
            self.assertEqual(mt.parse_meta(mt.format_meta(dt, shape)), (dt, shape))
        for bad in [b"", b"dtype=float32", b"shape=2", b"dtype=float32 shape=2 x=1", b"dtype=qint8 shape=2",
                    b"dtype=float32 shape=two", b"dtype=float32  shape=2", b"\xff"]:
            with self.assertRaises(mt.TensorFormatError, msg=bad):
                mt.parse_meta(bad)

    def test_numel(self):
        self.assertEqual(mt.numel(()), 1)
        self.assertEqual(mt.numel((2, 0, 3)), 0)
        self.assertEqual(mt.numel((2, 3, 4)), 24)


class TestMismatch(unittest.TestCase):
    def test_fits(self):
        self.assertIsNone(mt.mismatch("float32", (2, 3), "torch.float32", (2, 3), True, 24, 24))

    def test_each_problem(self):
        cases = [
            (("float32", (2, 3), "float16", (2, 3), True, 12, 24), ["dtype float16", "12 bytes"]),
            (("float32", (2, 3), "float32", (3, 2), True, 24, 24), ["shape (3, 2)"]),
            (("float32", (2, 3), "float32", (2, 3), False, 24, 24), ["not contiguous"]),
            (("int8", (), "int8", (1,), True, 1, 1), ["shape (1,)"]),
        ]
        for args, parts in cases:
            with self.subTest(args=args):
                why = mt.mismatch(*args)
                self.assertIsNotNone(why)
                for p in parts:
                    self.assertIn(p, why)


class TestKeyEscaping(unittest.TestCase):
    def test_kept(self):
        for name in ["layer.0.weight", "a", "model.embed_tokens.weight", "x-y_z", "...x", "a b", "ünï"]:
            with self.subTest(name=name):
                self.assertEqual(mt.escape_key(name), name)

    def test_escaped(self):
        for name, want in [("a/b", "a%2Fb"), ("/", "%2F"), ("100%", "100%25"), ("%2F", "%252F"), (".", "%2E"),
                           ("..", "%2E%2E"), ("a\0b", "a%00b"), ("./x", ".%2Fx")]:
            with self.subTest(name=name):
                self.assertEqual(mt.escape_key(name), want)
                self.assertNotIn("/", want)
                self.assertEqual(mt.unescape_key(want), name)

    def test_round_trip_distinct(self):
        names = ["a/b", "a%2Fb", "a%252Fb", "a.b", ".", "..", "%", "%%", "/a/", "a\0"]
        files = [mt.escape_key(n) for n in names]
        self.assertEqual(len(set(files)), len(names))
        for n, f in zip(names, files):
            self.assertEqual(mt.unescape_key(f), n)
            self.assertNotIn(f, (".", ".."))

    def test_bad(self):
        with self.assertRaises(ValueError):
            mt.escape_key("")
        with self.assertRaises(TypeError):
            mt.escape_key(3)
        for bad in ["%", "%2", "%zz", "a%4", "%41", "%2e", "%2F%"]:
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                mt.unescape_key(bad)


class TestCudaABI(unittest.TestCase):
    def test_struct(self):
        a = _abi.CUDA()
        self.assertEqual(ctypes.sizeof(a), 128)
        self.assertEqual(a.h.size, 128)
        offs = {f: _abi.offset_of(_abi.CUDA, f) for f in ["handle", "dev_off", "len", "obj_off", "result", "version", "device"]}
        self.assertEqual(offs, {"handle": 8, "dev_off": 72, "len": 80, "obj_off": 88, "result": 96, "version": 104, "device": 112})

    def test_commands(self):
        self.assertEqual(_abi.PUT_CUDA, 0xC0804D19)
        self.assertEqual(_abi.GET_CUDA, 0xC0804D1A)
        self.assertEqual(_abi.COMMANDS["MC_IOC_PUT_CUDA"], _abi.PUT_CUDA)
        self.assertEqual(_abi.KIND_CUDA, 2)
        self.assertEqual(_abi.layout()["kinds"], {"MC_KIND_HOST": 1, "MC_KIND_CUDA": 2, "MC_KIND_VM": 3})

    def test_cuda_arg(self):
        from mooncake_fs.client import _cuda_arg

        a = _cuda_arg(bytes(range(64)), 5, 6, 7, b"\x01" * 16)
        raw = bytes(a)
        self.assertEqual(raw[8:72], bytes(range(64)))
        self.assertEqual(int.from_bytes(raw[72:80], "little"), 5)
        self.assertEqual(int.from_bytes(raw[80:88], "little"), 6)
        self.assertEqual(int.from_bytes(raw[88:96], "little"), 7)
        self.assertEqual(raw[112:128], b"\x01" * 16)
        self.assertEqual(bytes(_cuda_arg(b"\0" * 64, 0, 0, 0, None))[112:], b"\0" * 16)
        with self.assertRaises(ValueError):
            _cuda_arg(b"short", 0, 0, 0, None)
        with self.assertRaises(ValueError):
            _cuda_arg(b"\0" * 64, 0, 0, 0, b"\0" * 15)


class TestWithoutTorchOrDriver(unittest.TestCase):
    def run_py(self, code, env=None):
        e = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
        e.update(env or {})
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)

    def test_package_imports_without_torch(self):
        # torch blocked: the package, tensor module and pure helpers still work.
        code = (
            "import sys; sys.modules['torch'] = None\n"
            "import mooncake_fs as mc, mooncake_fs.tensor as mt, mooncake_fs.cudadrv\n"
            "assert mt.format_shape((2, 3)) == '2,3'\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "try:\n"
            "    mt.put_tensor('/nonexistent/x', None)\n"
            "except ImportError as e:\n"
            "    print('ImportError', e)\n"
        )
        r = self.run_py(code)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("ImportError mooncake_fs.tensor needs PyTorch", r.stdout)

    def test_import_does_not_load_torch(self):
        r = self.run_py("import sys, mooncake_fs, mooncake_fs.tensor, mooncake_fs.cudadrv; print('torch' in sys.modules)")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "False")

    def test_no_driver(self):
        r = self.run_py(
            "import mooncake_fs.cudadrv as c\n"
            "print(c.available())\n"
            "try:\n"
            "    c.driver()\n"
            "except c.CudaUnavailable as e:\n"
            "    print('unavailable', e)\n",
            {"MOONCAKE_LIBCUDA": "/nonexistent/libcuda.so.1"},
        )
        self.assertEqual(r.returncode, 0, r.stderr)
        if r.stdout.startswith("True"):
            self.skipTest("a CUDA driver is installed here")
        self.assertIn("unavailable CUDA unavailable: cannot load libcuda", r.stdout)
        self.assertIn("/nonexistent/libcuda.so.1", r.stdout)

    def test_package_exports(self):
        import mooncake_fs as mc

        for name in ["put_tensor", "get_tensor", "get_tensor_range", "save_state_dict", "load_state_dict"]:
            self.assertIs(getattr(mc, name), getattr(mt, name))
        self.assertIs(mc.tensor, mt)

    def test_candidate_paths(self):
        self.assertEqual(cudadrv.candidate_paths({}), ["libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1"])
        self.assertEqual(cudadrv.candidate_paths({"MOONCAKE_LIBCUDA": "/x/l.so"})[0], "/x/l.so")


class TestBatchPaths(unittest.TestCase):
    """The paths a batch takes by name in one call."""

    def test_one_dir(self):
        self.assertEqual(mt._one_dir(["/a/b", "/a/c"]), ("/a", ["b", "c"]))
        self.assertEqual(mt._one_dir(["/b"]), ("/", ["b"]))
        for bad in (["/a/b", "/a/.c"], ["/a/b", "/a/c/d"], ["/a/b", "/b/c"], ["/a/b", b"/a/c"], ["/a/b", "/a/"],
                    ["rel/a"], ["/a//b"], ["/a/./b"], ["/a/b", "/ab/c"]):
            with self.subTest(paths=bad):
                self.assertIsNone(mt._one_dir(bad))


class TestTensorWork(unittest.TestCase):
    """The handle async_op returns: its outcome collected once, kept for
    later waits, errors raised at each wait, collected when dropped, never
    in another process."""

    def test_outcome_is_collected_once(self):
        calls = []
        w = mt.TensorWork(lambda: calls.append(1) or [7, 8], keep=["tensor"])
        self.assertFalse(w.is_completed())
        self.assertEqual(w.wait(), [7, 8])
        self.assertEqual(w.wait(), [7, 8])
        self.assertTrue(w.is_completed())
        self.assertEqual(calls, [1])

    def test_error_is_raised_at_each_wait(self):
        calls = []

        def fail():
            calls.append(1)
            raise OSError(5, "gone")

        w = mt.TensorWork(fail)
        for _ in range(2):
            with self.assertRaises(OSError):
                w.wait()
        self.assertEqual(calls, [1])
        self.assertTrue(w.is_completed())

    def test_interrupted_wait_loses_the_outcome(self):
        def interrupted():
            raise KeyboardInterrupt

        w = mt.TensorWork(interrupted)
        with self.assertRaises(KeyboardInterrupt):
            w.wait()
        with self.assertRaisesRegex(RuntimeError, "interrupted"):
            w.wait()

    def test_outcome_made_from_what_was_collected(self):
        w = mt.TensorWork(lambda: [1, 2], lambda raw: [x * 10 for x in raw])
        self.assertEqual(w.wait(), [10, 20])
        w = mt.TensorWork(lambda: [1], lambda raw: 1 / 0)
        for _ in range(2):
            with self.assertRaises(ZeroDivisionError):
                w.wait()
        self.assertTrue(w.is_completed())

    def test_dropped_work_is_collected(self):
        # Dropped: its calls are collected, its outcome (which may make
        # calls of its own) is not made.
        calls = []
        w = mt.TensorWork(lambda: calls.append("collect"), lambda raw: calls.append("outcome"))
        del w
        self.assertEqual(calls, ["collect"])
        # A failing one goes quietly.
        w = mt.TensorWork(lambda: 1 / 0)
        del w

    def test_threads_share_one_collection(self):
        import threading

        gate, calls = threading.Event(), []

        def collect():
            calls.append(1)
            gate.wait(10)
            return ["done"]

        w = mt.TensorWork(collect)
        got = []
        ths = [threading.Thread(target=lambda: got.append(w.wait())) for _ in range(4)]
        for t in ths:
            t.start()
        gate.set()
        for t in ths:
            t.join(30)
        self.assertEqual(got, [["done"]] * 4)
        self.assertEqual(calls, [1])

    def test_done_at_once(self):
        calls = []
        w = mt._done(True, lambda: calls.append(1) or "v")
        self.assertTrue(w.is_completed())
        self.assertEqual((w.wait(), calls), ("v", [1]))
        w = mt._done(True, lambda: 1 / 0)
        with self.assertRaises(ZeroDivisionError):
            w.wait()
        self.assertEqual(mt._done(False, lambda: "now"), "now")
        with self.assertRaises(ZeroDivisionError):
            mt._done(False, lambda: 1 / 0)

    @unittest.skipUnless(hasattr(os, "fork"), "no fork")
    def test_not_collected_in_a_forked_child(self):
        r, wfd = os.pipe()
        calls = []
        w = mt.TensorWork(lambda: calls.append(os.getpid()) or "parent's")
        pid = os.fork()
        if pid == 0:  # the child: wait refuses, dropping does nothing
            code = 0
            try:
                try:
                    w.wait()
                    code = 1
                except RuntimeError:
                    pass
                del w
                code = code or (2 if calls else 0)
            finally:
                os.write(wfd, bytes([code]))
                os._exit(0)
        os.close(wfd)
        got = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        self.assertEqual(got, bytes([0]))
        self.assertEqual(w.wait(), "parent's")
        self.assertEqual(calls, [os.getpid()])


@unittest.skipUnless(torch is not None, "torch is not installed")
class TestTorchCPUOnly(unittest.TestCase):
    """Argument checks that need torch but no mount and no GPU."""

    def test_dtype_names_match_torch(self):
        for name in mt.ITEMSIZE:
            dt = getattr(torch, name, None)
            if dt is None:
                continue  # newer dtype than this torch
            with self.subTest(name=name):
                self.assertEqual(mt.dtype_name(dt), name)
                self.assertIs(mt.torch_dtype(name), dt)
                self.assertEqual(torch.empty(0, dtype=dt).element_size(), mt.ITEMSIZE[name])
        self.assertIs(mt.torch_dtype("half"), torch.float16)
        with self.assertRaises(mt.TensorFormatError):
            mt.torch_dtype("float999")

    def test_source_rejects(self):
        with self.assertRaises(TypeError):
            mt._source([1, 2, 3])
        with self.assertRaises(ValueError):
            mt._source(torch.zeros(3, 3).to_sparse())
        with self.assertRaises(ValueError):
            mt._source(torch.quantize_per_tensor(torch.zeros(3), 0.1, 0, torch.qint8))
        with self.assertRaises(ValueError):
            mt._source(torch.empty(3, device="meta"))

    def test_source_copies_views(self):
        x = torch.arange(12.0).reshape(3, 4)
        self.assertEqual(mt._source(x).data_ptr(), x.data_ptr())  # no copy
        for v in [x.t(), x[:, ::2], x[0:1].expand(5, 4)]:
            s = mt._source(v)
            self.assertTrue(s.is_contiguous())
            self.assertTrue(torch.equal(s, v))
        c = torch.tensor([1 + 2j, 3 - 4j]).conj()
        self.assertTrue(torch.equal(mt._source(c), torch.tensor([1 - 2j, 3 + 4j])))
        self.assertFalse(mt._source(c).is_conj())

    def test_columns_at_once_as_each(self):
        # The whole-list questions answer what the tensor-by-tensor loop
        # does, or hand the list to it: plain lists, mixed dtypes and
        # shapes, empty and 0-d tensors, and every kind of tensor a batch
        # must not take as it is, alone or among plain ones.
        plain = [torch.randn(64) for _ in range(3)]
        odd = {"noncontiguous": torch.randn(4, 4).t(), "conj": torch.randn(3, dtype=torch.complex64).conj(),
               "neg": torch._neg_view(torch.randn(3, dtype=torch.complex64)),
               "parameter": torch.nn.Parameter(torch.randn(3)), "sparse": torch.randn(3).to_sparse(),
               "quantized": torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
               "meta": torch.empty(3, device="meta"), "long meta": torch.zeros([1] * 200)}
        lists = {"plain": plain, "mixed": [torch.randn(4), torch.zeros(3, dtype=torch.int8),
                                           torch.zeros(2, 2, dtype=torch.bfloat16), torch.randn(0), torch.tensor(1.0)]}
        for name, t in odd.items():
            lists[name] = [t]
            lists["plain+" + name] = plain + [t]
        for name, ts in lists.items():
            for _ in range(2):  # then with the shapes' metas made
                with self.subTest(name=name):
                    got = mt._columns_of(ts)
                    self.assertEqual(got, mt._columns_of_each(ts))
                    self.assertEqual(got is None, name not in ("plain", "mixed"))
        metas, sizes, ptrs, devs = mt._columns_of(lists["mixed"])
        self.assertEqual(sizes, [16, 3, 8, 0, 4])
        self.assertEqual(devs, [-1] * 5)
        self.assertEqual(metas[1], b"dtype=int8 shape=3")

    def test_check_target(self):
        mt._check_target(torch.empty(3))
        for bad in [torch.empty(4, 4).t(), torch.empty(8)[::2]]:
            with self.assertRaises(ValueError):
                mt._check_target(bad)
        with self.assertRaises(TypeError):
            mt._check_target(bytearray(3))

    def test_save_rejects_non_tensors_before_writing(self):
        with self.assertRaises(TypeError):
            mt.save_state_dict("/nonexistent/dir", {"a": torch.zeros(1), "b": 3})
        self.assertFalse(os.path.exists("/nonexistent/dir"))


if __name__ == "__main__":
    unittest.main()
