"""Tests of the PyTorch helpers (mooncake_fs.tensor) against a running
daemon: CPU tensors wherever torch is installed, CUDA tensors where
torch.cuda.is_available().

Needs MOONCAKE_MOUNT (the mountpoint of a running daemon; the tests make
and leave keys under a unique directory there); MOONCAKE_BIN (the
mooncake-fs binary) adds the registration counts from `status --json`.
Skips cleanly without a mount, without torch, and (the CUDA classes)
without a GPU. tests/gpu/run.sh runs it on the GPU host:

    PYTHONPATH=python MOONCAKE_MOUNT=/tmp/mcgpu python3 -m unittest -v python/tests/test_tensor_gpu.py
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import unittest
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mooncake_fs as mc  # noqa: E402
from mooncake_fs import tensor as mt  # noqa: E402

MOUNT = os.environ.get("MOONCAKE_MOUNT")
BIN = os.environ.get("MOONCAKE_BIN")

try:
    import torch
except ImportError:  # pragma: no cover - CI and the dev machines
    torch = None

HAVE_CUDA = torch is not None and torch.cuda.is_available()

DTYPES = ["float32", "float16", "bfloat16", "int8", "int64", "uint8", "bool", "float64", "complex64", "int32"]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (0, 3), (1, 1, 1), (4097,), (1000, 1023)]


def random_tensor(dtype, shape, device="cpu", seed=0):
    """A tensor of random bits (NaN payloads, denormals and all), so that
    a round trip is checked bit for bit."""
    g = torch.Generator().manual_seed(seed)
    dtype = mt.torch_dtype(dtype) if isinstance(dtype, str) else dtype
    n = mt.numel(shape)
    size = torch.empty(0, dtype=dtype).element_size()
    if dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    else:
        t = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(dtype)
    return t.reshape(shape).to(device)


def bits(t):
    """The bytes of t in C order, as a CPU uint8 tensor."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def status():
    out = subprocess.run([BIN, "status", "--json", MOUNT], check=True, capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)


def wait_for(what, cond, timeout=30):
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


@unittest.skipUnless(MOUNT, "MOONCAKE_MOUNT is not set (no daemon)")
@unittest.skipUnless(torch is not None, "torch is not installed")
class Base(unittest.TestCase):
    device = "cpu"

    @classmethod
    def setUpClass(cls):
        cls.dir = os.path.join(MOUNT, f"tensor-{cls.__name__}-{uuid.uuid4().hex[:8]}")
        os.makedirs(cls.dir)

    def path(self, name):
        return os.path.join(self.dir, name)

    def assertBitsEqual(self, got, want, msg=None):
        self.assertEqual(got.dtype, want.dtype, msg)
        self.assertEqual(tuple(got.shape), tuple(want.shape), msg)
        self.assertTrue(torch.equal(bits(got), bits(want)), msg or "bytes differ")

    def sync(self):
        if self.device != "cpu":
            torch.cuda.synchronize()


class RoundTrips:
    """Tests that run for CPU and for CUDA tensors (self.device)."""

    def test_dtypes_and_shapes(self):
        for i, dtype in enumerate(DTYPES):
            for j, shape in enumerate(SHAPES):
                with self.subTest(dtype=dtype, shape=shape):
                    t = random_tensor(dtype, shape, self.device, seed=i * 100 + j)
                    p = self.path(f"rt-{dtype}-{j}")
                    v = mt.put_tensor(p, t)
                    self.assertGreater(v, 0)
                    self.assertEqual(os.stat(p).st_size, t.numel() * t.element_size())
                    self.assertEqual(mt.tensor_info(p), (dtype, shape))
                    got = mt.get_tensor(p, device=self.device)
                    self.assertEqual(got.device.type, self.device)
                    self.assertBitsEqual(got, t)
                    # The object's bytes are the tensor's, in C order.
                    if t.numel() and j < 6:
                        self.assertEqual(mc.get(p), bytes(bits(t).numpy()))

    def test_large(self):
        for name, dtype, shape in [("odd", "uint8", ((64 << 20) + 3,)), ("f32", "float32", (16384, 4096))]:
            with self.subTest(name=name):
                t = random_tensor(dtype, shape, self.device, seed=7)
                p = self.path(f"large-{name}")
                n = t.numel() * t.element_size()
                self.sync()
                t0 = time.perf_counter()
                mt.put_tensor(p, t)
                t1 = time.perf_counter()
                got = mt.get_tensor(p, device=self.device)
                t2 = time.perf_counter()
                print(f"\n  {self.device} {name} {n / 2**20:.0f} MiB: put {n / (t1 - t0) / 1e9:.2f} GB/s, "
                      f"get {n / (t2 - t1) / 1e9:.2f} GB/s (incl. allocation and attributes)", file=sys.stderr)
                self.assertBitsEqual(got, t)
                del got
                out = torch.empty_like(t)
                self.sync()
                t3 = time.perf_counter()
                mt.get_tensor(p, out=out)
                t4 = time.perf_counter()
                print(f"  {self.device} {name}: get into out {n / (t4 - t3) / 1e9:.2f} GB/s", file=sys.stderr)
                self.assertBitsEqual(out, t)

    def test_non_contiguous_input_is_copied(self):
        base = random_tensor("float32", (64, 48), self.device, seed=3)
        keep = base.clone()
        views = {
            "t": base.t(),
            "stride": base[:, ::3],
            "expand": base[0:1].expand(5, 48),
            "slice-rows": base[10:20],  # contiguous, at an offset
            "permute": base.reshape(4, 16, 48).permute(2, 0, 1),
        }
        for name, v in views.items():
            with self.subTest(view=name):
                p = self.path(f"nc-{name}")
                mt.put_tensor(p, v)
                got = mt.get_tensor(p, device=self.device)
                self.assertTrue(got.is_contiguous())
                self.assertBitsEqual(got, v.contiguous())
        self.assertBitsEqual(base, keep, "source changed by a put")

    def test_conj_view(self):
        c = random_tensor("complex64", (33,), self.device, seed=4)
        p = self.path("conj")
        mt.put_tensor(p, c.conj())
        self.assertBitsEqual(mt.get_tensor(p, device=self.device), c.conj().resolve_conj())

    def test_get_into_out(self):
        t = random_tensor("bfloat16", (17, 31), self.device, seed=5)
        p = self.path("out")
        mt.put_tensor(p, t)
        out = torch.full((17, 31), 7.0, dtype=torch.bfloat16, device=self.device)
        self.assertIs(mt.get_tensor(p, out=out), out)
        self.assertBitsEqual(out, t)
        bad = {
            "dtype": torch.empty(17, 31, dtype=torch.float16, device=self.device),
            "shape": torch.empty(31, 17, dtype=torch.bfloat16, device=self.device),
            "numel": torch.empty(17 * 31 + 1, dtype=torch.bfloat16, device=self.device),
            "non-contiguous": torch.empty(31, 17, dtype=torch.bfloat16, device=self.device).t(),
        }
        for name, o in bad.items():
            with self.subTest(bad=name):
                before = bits(o).clone()
                with self.assertRaises(ValueError):
                    mt.get_tensor(p, out=o)
                self.assertTrue(torch.equal(bits(o), before), "a rejected out was written")
        with self.assertRaises(ValueError):
            mt.get_tensor(p, out=out, device="meta")

    def test_partial_gets(self):
        t = random_tensor("int64", (1000,), self.device, seed=6)
        p = self.path("partial")
        mt.put_tensor(p, t)
        for start, n in [(0, 1), (0, 1000), (1, 10), (513, 487), (999, 1), (100, 0)]:
            with self.subTest(start=start, n=n):
                out = torch.zeros(n, dtype=torch.int64, device=self.device)
                self.assertEqual(mt.get_tensor_range(p, out, start * 8), n * 8)
                self.assertBitsEqual(out, t[start:start + n])
        # Past the end: a short read, then nothing.
        out = torch.zeros(10, dtype=torch.int64, device=self.device)
        self.assertEqual(mt.get_tensor_range(p, out, 995 * 8), 5 * 8)
        self.assertBitsEqual(out[:5], t[995:])
        self.assertTrue(torch.equal(out[5:].cpu(), torch.zeros(5, dtype=torch.int64)))
        self.assertEqual(mt.get_tensor_range(p, out, 8000), 0)
        with self.assertRaises(OSError) as cm:
            mt.get_tensor_range(p, out, 8001)
        self.assertEqual(cm.exception.errno, errno.ERANGE)
        # Unaligned byte offsets and another dtype: raw bytes.
        raw = torch.zeros(13, dtype=torch.uint8, device=self.device)
        self.assertEqual(mt.get_tensor_range(p, raw, 3), 13)
        self.assertBitsEqual(raw, bits(t)[3:16])
        # Rows of a matrix into a row block.
        m = random_tensor("float16", (64, 100), self.device, seed=8)
        mt.put_tensor(self.path("rows"), m)
        rows = torch.empty(10, 100, dtype=torch.float16, device=self.device)
        self.assertEqual(mt.get_tensor_range(self.path("rows"), rows, 20 * 100 * 2), rows.numel() * 2)
        self.assertBitsEqual(rows, m[20:30])

    def test_exclusive(self):
        p = self.path("excl")
        t = random_tensor("float32", (5,), self.device)
        mt.put_tensor(p, t, exclusive=True)
        with self.assertRaises(FileExistsError):
            mt.put_tensor(p, random_tensor("float32", (9,), self.device, seed=1), exclusive=True)
        self.assertBitsEqual(mt.get_tensor(p, device=self.device), t)

    def test_replace_changes_attributes(self):
        p = self.path("replace")
        mt.put_tensor(p, random_tensor("float32", (4, 4), self.device))
        t = random_tensor("int8", (3,), self.device, seed=2)
        mt.put_tensor(p, t)
        self.assertEqual(mt.tensor_info(p), ("int8", (3,)))
        self.assertBitsEqual(mt.get_tensor(p, device=self.device), t)

    def test_bad_objects(self):
        p = self.path("plain")
        mc.put(p, b"12345678")
        with self.assertRaisesRegex(mt.TensorFormatError, "no user.mooncake.dtype"):
            mt.get_tensor(p)
        # An older client's attributes are read too.
        os.setxattr(p, mt.DTYPE_XATTR, b"float32")
        os.setxattr(p, mt.SHAPE_XATTR, b"3")
        with self.assertRaisesRegex(mt.TensorFormatError, "8 bytes, but float32 \\(3,\\) is 12"):
            mt.get_tensor(p)
        os.setxattr(p, mt.SHAPE_XATTR, b"2")
        self.assertEqual(mt.get_tensor(p).tolist(), torch.frombuffer(bytearray(b"12345678"), dtype=torch.float32).tolist())
        self.assertEqual(mt.get_tensor(p, out=torch.empty(2)).tolist(), mt.get_tensor(p).tolist())
        os.setxattr(p, mt.SHAPE_XATTR, b"two")
        with self.assertRaises(mt.TensorFormatError):
            mt.get_tensor(p)
        # A meta that does not describe the bytes.
        os.setxattr(p, mt.META_XATTR, b"dtype=float32 shape=3")
        with self.assertRaisesRegex(mt.TensorFormatError, "8 bytes, but float32 \\(3,\\) is 12"):
            mt.get_tensor(p)
        os.setxattr(p, mt.META_XATTR, b"garbage")
        with self.assertRaises(mt.TensorFormatError):
            mt.get_tensor(p)
        with self.assertRaises(OSError):
            os.setxattr(p, mt.META_XATTR, b"x" * 129)  # longer than a meta may be
        with self.assertRaises(FileNotFoundError):
            mt.get_tensor(self.path("missing"))

    def test_meta_visible_to_getfattr(self):
        if not shutil.which("getfattr"):
            self.skipTest("no getfattr")
        p = self.path("fattr")
        mt.put_tensor(p, random_tensor("bfloat16", (2, 3, 4), self.device))
        one = lambda name: subprocess.run(["getfattr", "--only-values", "-n", name, p], check=True,  # noqa: E731
                                          capture_output=True, text=True).stdout
        self.assertEqual(one("user.mooncake.meta"), "dtype=bfloat16 shape=2,3,4")
        dump = subprocess.run(["getfattr", "-d", p], check=True, capture_output=True, text=True).stdout
        self.assertIn('user.mooncake.meta="dtype=bfloat16 shape=2,3,4"', dump)
        mt.put_tensor(p, random_tensor("float32", (), self.device))
        self.assertEqual(one("user.mooncake.meta"), "dtype=float32 shape=")
        self.assertEqual(mt.tensor_info(p), ("float32", ()))

    def test_out_of_another_shape_moves_nothing(self):
        p = self.path("shape")
        mt.put_tensor(p, random_tensor("float32", (4, 2), self.device))
        out = torch.full((2, 4), 7.0, device=self.device)
        with self.assertRaisesRegex(ValueError, "does not fit"):
            mt.get_tensor(p, out=out)
        self.assertTrue(bool((out == 7.0).all()), "a refused get wrote into out")

    def test_batches(self):
        ts = [random_tensor(DTYPES[i % len(DTYPES)], SHAPES[i % len(SHAPES)], self.device, seed=i) for i in range(150)]
        paths = [self.path(f"batch/{i}") for i in range(len(ts))]
        versions = mt.batch_put_tensor(paths, ts)
        self.assertEqual(len(versions), len(ts))
        self.assertTrue(all(v > 0 for v in versions))
        for p, t in zip(paths, ts):
            self.assertBitsEqual(mt.get_tensor(p, device=self.device), t, p)
        got = mt.batch_get_tensor(paths, device=self.device)
        for g, t in zip(got, ts):
            self.assertBitsEqual(g, t)
        outs = [torch.empty_like(t) for t in ts]
        self.assertIs(mt.batch_get_tensor(paths, out=outs)[3], outs[3])
        self.sync()
        for o, t in zip(outs, ts):
            self.assertBitsEqual(o, t)
        # Per-key failures: a missing key and an out of another dtype fail
        # alone; the others are read.
        outs = [torch.empty_like(t) for t in ts[:4]]
        outs[1] = torch.empty(ts[1].shape, dtype=torch.float64 if ts[1].dtype != torch.float64 else torch.float32,
                              device=self.device)
        res = mt.batch_get_tensor(paths[:3] + [self.path("batch/none")], out=outs, check=False)
        self.assertEqual(res[1], -errno.EBADMSG)
        self.assertEqual(res[3], -errno.ENOENT)
        self.assertBitsEqual(res[0], ts[0])
        self.assertBitsEqual(res[2], ts[2])
        with self.assertRaises(mc.BatchError):
            mt.batch_put_tensor([self.path("batch/0")], [ts[0]], exclusive=True)

    def test_batches_outside_the_plain_case(self):
        # A batch goes the quick way only when its paths share one
        # directory and its tensors are plain; any other batch (a view to
        # copy, a Parameter, a dot name, two directories) goes the general
        # way, with the same outcome.
        base = random_tensor("float32", (6, 4), self.device, seed=7)
        ts = [base.t(), torch.nn.Parameter(base.clone()), base[1], random_tensor("int16", (9,), self.device, seed=8)]
        for paths in ([self.path(f"gen1/{n}") for n in ("a", "b", ".c", "d")],
                      [self.path(n) for n in ("gen2/a", "gen3/b", "gen2/c", "gen3/d")],
                      [self.path(f"gen4/{n}") for n in ("a", "b", "c", "d")]):
            with self.subTest(paths=paths):
                mt.batch_put_tensor(paths, ts)
                for p, t in zip(paths, ts):
                    self.assertBitsEqual(mt.get_tensor(p, device=self.device), t.detach().contiguous(), p)
                outs = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in ts]
                mt.batch_get_tensor(paths, out=outs)
                self.sync()
                for o, t in zip(outs, ts):
                    self.assertBitsEqual(o, t.detach().contiguous())
        with self.assertRaisesRegex(ValueError, "not contiguous"):
            mt.batch_get_tensor([self.path("gen4/a")], out=[torch.empty(4, 6, device=self.device).t()])
        # What no batch moves is refused before anything is written.
        odd = [torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), torch.randn(3).to_sparse()]
        for t in odd:
            with self.subTest(layout=t.layout, dtype=t.dtype), self.assertRaises(ValueError):
                mt.batch_put_tensor([self.path("gen5/a"), self.path("gen5/b")], [ts[3], t])
        self.assertFalse(os.path.exists(self.path("gen5/a")))

    def test_batch_of_more_calls_with_a_name_twice(self):
        # 150 keys in one directory: three calls, in order, as a name put
        # twice needs (the later value stays).
        ts = [random_tensor("float32", (33,), self.device, seed=i) for i in range(150)]
        paths = [self.path(f"twice/{i % 120}") for i in range(150)]
        mt.batch_put_tensor(paths, ts)
        for i in range(120):
            want = ts[i + 120] if i < 30 else ts[i]
            self.assertBitsEqual(mt.get_tensor(paths[i], device=self.device), want, paths[i])

    def test_async_batches(self):
        # async_op: CUDA batches are submitted (several at once, waited for
        # in any order), anything else is done at once; the outcome is the
        # synchronous call's either way.
        submitted = self.device != "cpu"
        ts = [random_tensor("float16" if i % 3 else "int32", (64 + i % 5,), self.device, seed=400 + i)
              for i in range(300)]
        paths = [self.path(f"async/{i}") for i in range(len(ts))]
        works = [mt.batch_put_tensor(paths[lo:lo + 100], ts[lo:lo + 100], async_op=True) for lo in (0, 100, 200)]
        self.assertEqual([w.is_completed() for w in works], [not submitted] * 3)
        versions = [v for w in reversed(works) for v in w.wait()]
        self.assertEqual(len(versions), 300)
        self.assertTrue(all(v > 0 for v in versions))
        self.assertTrue(all(w.is_completed() for w in works))
        self.assertEqual(works[0].wait(), works[0].wait())
        outs = [torch.zeros_like(t) for t in ts]
        works = [mt.batch_get_tensor(paths[lo:lo + 64], out=outs[lo:lo + 64], async_op=True) for lo in range(0, 300, 64)]
        for k, w in enumerate(works):
            self.assertIs(w.wait()[0], outs[k * 64])
        for o, t in zip(outs, ts):
            self.assertBitsEqual(o, t)
        # More calls than a directory's fd holds (MAX_ASYNC_CALLS): the
        # ones past it go at once.
        outs = [torch.zeros_like(t) for t in ts]
        works = [mt.batch_get_tensor(paths[i:i + 10], out=outs[i:i + 10], async_op=True) for i in range(0, 300, 10)]
        for w in works[::-1]:
            w.wait()
        for o, t in zip(outs, ts):
            self.assertBitsEqual(o, t)
        # Per-key failures come with wait(): a missing key and an out of
        # another dtype; check raises (again at each wait).
        outs = [torch.zeros_like(t) for t in ts[:4]]
        outs[1] = torch.zeros(ts[1].shape, dtype=torch.float64, device=self.device)
        w = mt.batch_get_tensor(paths[:3] + [self.path("async/none")], out=outs, check=False, async_op=True)
        res = w.wait()
        self.assertEqual((res[1], res[3]), (-errno.EBADMSG, -errno.ENOENT))
        self.assertBitsEqual(res[0], ts[0])
        self.assertBitsEqual(res[2], ts[2])
        w = mt.batch_get_tensor(paths[:3] + [self.path("async/none")], out=outs, async_op=True)
        for _ in range(2):
            with self.assertRaises(mc.BatchError):
                w.wait()
        w = mt.batch_put_tensor(paths[:2], ts[:2], exclusive=True, async_op=True)
        with self.assertRaises(mc.BatchError) as cm:
            w.wait()
        self.assertEqual(set(cm.exception.results.values()), {-errno.EEXIST})
        # A work dropped unwaited waits as it goes: its keys are there.
        fresh = [random_tensor("int8", (33,), self.device, seed=900 + i) for i in range(70)]
        fpaths = [self.path(f"async-dropped/{i}") for i in range(70)]
        mt.batch_put_tensor(fpaths, fresh, async_op=True)
        for p, t in zip(fpaths, fresh):
            self.assertBitsEqual(mt.get_tensor(p, device=self.device), t, p)
        # A batch outside the plain case (two directories, a view) is done
        # at once, with the same outcome.
        mixed = [ts[0], ts[1][::2], ts[2]]
        mpaths = [self.path("async-a/x"), self.path("async-b/y"), self.path("async-a/z")]
        w = mt.batch_put_tensor(mpaths, mixed, async_op=True)
        self.assertTrue(w.is_completed())
        self.assertEqual(len(w.wait()), 3)
        for p, t in zip(mpaths, mixed):
            self.assertBitsEqual(mt.get_tensor(p, device=self.device), t.contiguous(), p)

    def test_batch_get_of_a_value_its_meta_does_not_size(self):
        # A value longer or shorter than its meta says fails alone (EIO),
        # whether the daemon checks the length (ABI 1.6) or a probe byte
        # does; the others are read.
        t = random_tensor(torch.float32, (10,), self.device, seed=3)
        paths = [self.path(f"sized/{i}") for i in range(3)]
        mt.batch_put_tensor(paths, [t, t, t])
        os.setxattr(paths[0], mt.META_XATTR, mt.format_meta(torch.float32, (8,)))   # 40 B stored, 32 said
        os.setxattr(paths[2], mt.META_XATTR, mt.format_meta(torch.float32, (12,)))  # 40 B stored, 48 said
        for whole in (True, False):
            outs = [torch.empty(8, device=self.device), torch.empty(10, device=self.device),
                    torch.empty(12, device=self.device)]
            d, _ = mt._dir_of(paths[0])
            abi = d.abi
            if not whole:
                d.abi = (1, 5)  # as an older daemon: the probe byte
            try:
                res = mt.batch_get_tensor(paths, out=outs, check=False)
            finally:
                d.abi = abi
            self.assertEqual(res[0], -errno.EIO, whole)
            self.assertEqual(res[2], -errno.EIO, whole)
            self.assertBitsEqual(res[1], t)

    def test_renamed_directory_is_not_written(self):
        a, b = self.path("dir-a"), self.path("dir-b")
        os.makedirs(a)
        t = random_tensor("int32", (5,), self.device)
        mt.put_tensor(os.path.join(a, "x"), t)
        os.rename(a, b)
        os.makedirs(a)
        mt.put_tensor(os.path.join(a, "y"), t)
        self.assertEqual(sorted(os.listdir(a)), ["y"])
        self.assertEqual(sorted(os.listdir(b)), ["x"])

    def test_state_dict(self):
        nn = torch.nn
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).to(self.device)
        model.train()
        model(torch.randn(8, 16, device=self.device))  # running stats and num_batches_tracked
        sd = dict(model.state_dict())
        sd["odd/name"] = torch.arange(3, device=self.device)
        sd["100%"] = torch.ones(2, dtype=torch.float16, device=self.device)
        sd["."] = torch.zeros((), device=self.device)
        sd["bf"] = random_tensor("bfloat16", (5, 5), self.device)
        d = self.path("sd")
        versions = mt.save_state_dict(d, sd)
        self.assertEqual(set(versions), set(sd))
        files = set(os.listdir(d))
        self.assertIn("0.weight", files)
        self.assertIn("odd%2Fname", files)
        self.assertIn("100%25", files)
        self.assertIn("%2E", files)
        for dev in [self.device, "cpu"]:
            with self.subTest(load_to=dev):
                got = mt.load_state_dict(d, device=dev)
                self.assertEqual(list(got), sorted(sd))
                for k, v in sd.items():
                    self.assertEqual(got[k].device.type, torch.device(dev).type, k)
                    self.assertBitsEqual(got[k], v, k)
        fresh = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).to(self.device)
        loaded = mt.load_state_dict(d, device=self.device)
        for k in ["odd/name", "100%", ".", "bf"]:
            del loaded[k]
        fresh.load_state_dict(loaded)
        x = torch.randn(3, 16, device=self.device)
        model.eval(), fresh.eval()
        with torch.no_grad():
            self.assertTrue(torch.allclose(model(x), fresh(x), rtol=1e-6, atol=1e-6))
        # A smaller save with prune leaves exactly its keys.
        mt.save_state_dict(d, {"only": torch.ones(1, device=self.device)}, prune=True)
        self.assertEqual(list(mt.load_state_dict(d)), ["only"])
        with self.assertRaises(TypeError):
            mt.save_state_dict(d, {"x": 1})

    def test_threads(self):
        errors = []

        def work(i):
            try:
                for j in range(10):
                    t = random_tensor("float32", (1000 + i, 33), self.device, seed=i * 1000 + j)
                    p = self.path(f"thr-{i}")
                    mt.put_tensor(p, t)
                    got = mt.get_tensor(p, device=self.device)
                    if not torch.equal(bits(got), bits(t)):
                        raise AssertionError(f"thread {i} round {j}: bytes differ")
            except Exception as e:  # reported below
                errors.append(e)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.assertEqual(errors, [])


class CPUTensors(RoundTrips, Base):
    device = "cpu"

    def test_pinned_host_memory(self):
        if not HAVE_CUDA:
            self.skipTest("pinned memory needs CUDA")
        t = random_tensor("float32", (1 << 20,), seed=9).pin_memory()
        mt.put_tensor(self.path("pinned"), t)
        out = torch.empty_like(t).pin_memory()
        mt.get_tensor(self.path("pinned"), out=out)
        self.assertBitsEqual(out, t)


@unittest.skipUnless(HAVE_CUDA, "no CUDA device (torch.cuda.is_available() is False)")
class CUDATensors(RoundTrips, Base):
    device = "cuda"

    def test_offset_inside_a_larger_allocation(self):
        x = torch.empty(1 << 20, device="cuda")  # 4 MiB: one block of the caching allocator
        x.copy_(random_tensor("float32", (1 << 20,), "cuda", seed=10))
        t = x[1000:5000]
        self.assertNotEqual(t.data_ptr(), x.data_ptr())
        p = self.path("inner")
        mt.put_tensor(p, t)
        self.assertBitsEqual(mt.get_tensor(p, device="cuda"), t)
        # Into a slice of another allocation: the bytes around it stay.
        z = torch.full((1 << 20,), -1.0, device="cuda")
        y = z[777:4777]
        mt.get_tensor(p, out=y)
        self.assertBitsEqual(y, t)
        self.assertTrue(bool((z[:777] == -1).all()) and bool((z[4777:] == -1).all()), "bytes outside out written")
        # Partial get into the middle of an allocation, at an object offset.
        w = torch.full((1 << 16,), -2.0, device="cuda")
        mt.get_tensor_range(p, w[5:105], 400 * 4)
        self.assertBitsEqual(w[5:105], t[400:500])
        self.assertTrue(bool((w[:5] == -2).all()) and bool((w[105:] == -2).all()))

    def test_big_batch_after_kernels_on_a_side_stream(self):
        # A batch of many tensors goes in parts from several threads; the
        # caller's current stream (a side stream here, its kernels still
        # queued) is waited for first, not the workers' default streams.
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            a = torch.randn(2048, 2048, device="cuda")
            for _ in range(6):
                a = torch.tanh(a @ a)  # queued on s
            ts = list(a.view(-1).split(4096))  # 1024 tensors of 16 KiB
            paths = [self.path(f"side/{i}") for i in range(len(ts))]
            mt.batch_put_tensor(paths, ts)
        torch.cuda.synchronize()
        outs = [torch.empty_like(t) for t in ts]
        mt.batch_get_tensor(paths, out=outs)
        self.sync()
        for o, t, p in zip(outs, ts, paths):
            self.assertBitsEqual(o, t, p)

    def test_submitted_calls_of_gpu_memory(self):
        # ABI 1.7: vector batches of GPU memory by IPC handle, submitted
        # and waited for; several at once, each key whole.
        import array

        from mooncake_fs import _abi, cudadrv

        d = mc.Directory(self.dir)
        self.addCleanup(d.close)
        ts = [random_tensor("float32", (4096,), "cuda", seed=300 + i) for i in range(24)]
        torch.cuda.synchronize()

        def columns(names, tensors):
            locs = [cudadrv.ipc_location(t.data_ptr(), t.nbytes, t.get_device()) for t in tensors]
            refs = list(dict.fromkeys((loc.handle, loc.device) for loc in locs))
            words = array.array("Q")
            for loc, t in zip(locs, tensors):
                words.extend((_abi.SEG_GPU | refs.index((loc.handle, loc.device)), loc.dev_off, t.nbytes))
            keys = [n.encode() for n in names]
            return b"".join(keys), [len(k) for k in keys], words, refs

        calls = []
        for lo in range(0, 24, 8):
            keys, lens, words, refs = columns([f"sub{i}" for i in range(lo, lo + 8)], ts[lo:lo + 8])
            calls.append(d.submit_columns(True, keys, lens, words, 1, 0, gpus=refs))
        for c in reversed(calls):
            self.assertEqual([r for r, _ in d.wait_columns(c)], [4096 * 4] * 8)
        outs = [torch.zeros_like(t) for t in ts]
        keys, lens, words, refs = columns([f"sub{i}" for i in range(24)], outs)
        c = d.submit_columns(False, keys, lens, words, 1, _abi.FLAG_WHOLE, gpus=refs)
        d.wait_calls()
        self.assertEqual([r for r, _ in d.wait_columns(c)], [4096 * 4] * 24)
        for o, t in zip(outs, ts):
            self.assertBitsEqual(o, t)

    def test_many_tensors_one_block(self):
        # Small tensors share blocks of the caching allocator: one handle each.
        from mooncake_fs import cudadrv

        ts = [random_tensor("float16", (257,), "cuda", seed=i) for i in range(50)]
        before = cudadrv.handles.misses
        for i, t in enumerate(ts):
            mt.put_tensor(self.path(f"many-{i}"), t)
        self.assertLess(cudadrv.handles.misses - before, 50)
        for i, t in enumerate(ts):
            self.assertBitsEqual(mt.get_tensor(self.path(f"many-{i}"), device="cuda"), t)

    def test_pending_kernels_finish_first(self):
        # A put right after kernels that write the tensor sees their result;
        # a get's data is visible to kernels queued right after it.
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(3):
            b = a @ a  # queued on the current stream, not waited for
            b.mul_(0.5).add_(1)
            p = self.path("pending")
            mt.put_tensor(p, b)
            got = mt.get_tensor(p, device="cuda")
            twice = got * 2  # a kernel on the data just read, queued at once
            self.assertBitsEqual(got, b)
            self.assertTrue(torch.equal(twice, b * 2))

    def test_cross_device_kinds(self):
        t = random_tensor("bfloat16", (300, 7), "cpu", seed=11)
        mt.put_tensor(self.path("from-cpu"), t)
        self.assertBitsEqual(mt.get_tensor(self.path("from-cpu"), device="cuda"), t)
        g = t.cuda()
        mt.put_tensor(self.path("from-gpu"), g)
        self.assertBitsEqual(mt.get_tensor(self.path("from-gpu"), device="cpu"), t)
        self.assertBitsEqual(mt.get_tensor(self.path("from-gpu"), device=0), t)
        self.assertBitsEqual(mt.get_tensor(self.path("from-gpu"), device=torch.device("cuda:0")), t)

    def test_other_gpu(self):
        if torch.cuda.device_count() < 2:
            self.skipTest("one GPU")
        t = random_tensor("float32", (1 << 20,), "cuda:1", seed=12)
        mt.put_tensor(self.path("gpu1"), t)
        self.assertEqual(mt.get_tensor(self.path("gpu1"), device="cuda:1").device.index, 1)
        self.assertBitsEqual(mt.get_tensor(self.path("gpu1"), device="cuda:0"), t)
        out = torch.empty_like(t)
        with torch.cuda.device(0):  # the current device is not the tensor's
            mt.get_tensor(self.path("gpu1"), out=out)
        self.assertBitsEqual(out, t)

    def test_device_pointer_to_vm_ioctls_fails_cleanly(self):
        t = random_tensor("float32", (1024,), "cuda", seed=13)
        p = self.path("vm-dev")
        keep = random_tensor("float32", (1024,), "cpu", seed=14)
        mt.put_tensor(p, keep)
        with mc.File(p, "w") as f:
            with self.assertRaises(OSError):
                f.put_vm(t.data_ptr(), 4096)
        out = torch.full((1024,), 3.0, device="cuda")
        with mc.File(p) as f:
            with self.assertRaises(OSError):
                f.get_vm(out.data_ptr(), 4096)
        self.assertBitsEqual(mt.get_tensor(p), keep)
        self.assertTrue(bool((out == 3.0).all()))

    def test_registered_tensor(self):
        t = random_tensor("uint8", (3 << 20,), "cuda", seed=15)
        p = self.path("registered")
        with mc.File(p, "w") as f:
            buf_id, n = mt.register_tensor(f, t[4096:])
            self.assertEqual(n, t.numel() - 4096)
            torch.cuda.synchronize()
            moved, _ = f.put_buf(buf_id, 100, 1 << 20)
            self.assertEqual(moved, 1 << 20)
            f.unregister(buf_id)
        self.assertEqual(mc.get(p), bytes(t[4196:4196 + (1 << 20)].cpu().numpy()))
        out = torch.zeros(2 << 20, dtype=torch.uint8, device="cuda")
        with mc.File(p) as f:
            buf_id, _ = mt.register_tensor(f, out)
            moved, _ = f.get_buf(buf_id, 1 << 20, 1 << 20, 0)
            self.assertEqual(moved, 1 << 20)
        self.assertBitsEqual(out[1 << 20:], t[4196:4196 + (1 << 20)])
        self.assertTrue(bool((out[:1 << 20] == 0).all()))

    def test_register_with_dmabuf(self):
        # The dma-buf of the tensor's allocation goes with the registration
        # (ABI 1.5); a descriptor that is no dma-buf is EINVAL.
        from mooncake_fs import cudadrv
        t = random_tensor("uint8", (1 << 20,), "cuda", seed=16)
        torch.cuda.synchronize()
        loc = cudadrv.ipc_location(t.data_ptr(), t.numel(), t.device.index)
        fd = cudadrv.driver().dmabuf(loc.base, loc.size)
        if fd is None:
            self.skipTest("the driver exports no dma-buf")
        p = self.path("dmabuf")
        try:
            with mc.File(p, "w") as f:
                buf_id = f.register_cuda(loc.handle, t.numel(), loc.dev_off, dmabuf=fd)
                moved, _ = f.put_buf(buf_id, 0, t.numel())
                self.assertEqual(moved, t.numel())
                with self.assertRaises(OSError) as cm:
                    f.register_cuda(loc.handle, t.numel(), loc.dev_off, dmabuf=f.fileno())
                self.assertEqual(cm.exception.errno, errno.EINVAL)
        finally:
            os.close(fd)
        self.assertEqual(mc.get(p), bytes(t.cpu().numpy()))

    def _child(self, code):
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                              timeout=300)

    def test_child_exits_with_handles_open(self):
        live0 = status()["registrations"]["live"] if BIN else None
        p = self.path("child")
        r = self._child(f"""
            import os, sys, torch
            sys.path[:0] = [{os.path.dirname(HERE)!r}, {HERE!r}]
            from mooncake_fs import tensor as mt, File
            from test_tensor_gpu import random_tensor
            t = random_tensor("float32", (1 << 22,), "cuda", seed=16)
            x = torch.empty(1 << 20, device="cuda")
            mt.put_tensor({p!r}, t)
            mt.put_tensor({p!r} + "-inner", x[5:1000].fill_(2.5))
            f = File({p!r} + "-reg", "w")  # a registration left open too
            mt.register_tensor(f, t)
            print("ok", flush=True)
            os._exit(0)  # no cleanup: IPC handles, CUDA context, files all open
        """)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("ok", r.stdout)
        want = random_tensor("float32", (1 << 22,), "cpu", seed=16)
        self.assertBitsEqual(mt.get_tensor(p, device="cuda"), want)
        self.assertBitsEqual(mt.get_tensor(p, device="cpu"), want)
        self.assertTrue(bool((mt.get_tensor(p + "-inner") == 2.5).all()))
        # A child killed mid-way, too.
        r = self._child(f"""
            import os, signal, sys, torch
            sys.path.insert(0, {os.path.dirname(HERE)!r})
            from mooncake_fs import tensor as mt
            t = torch.ones(1 << 20, device="cuda")
            mt.put_tensor({p!r} + "-killed", t)
            os.kill(os.getpid(), signal.SIGKILL)
        """)
        self.assertEqual(r.returncode, -9, r.stderr)
        self.assertTrue(bool((mt.get_tensor(p + "-killed", device="cuda") == 1).all()))
        # The daemon still serves new puts from this process.
        t = random_tensor("float32", (1 << 20,), "cuda", seed=17)
        mt.put_tensor(p + "-after", t)
        self.assertBitsEqual(mt.get_tensor(p + "-after", device="cuda"), t)
        if BIN:
            wait_for(f"registrations.live == {live0}",
                     lambda: ((reg := status()["registrations"])["live"] == live0, reg))


if __name__ == "__main__":
    unittest.main()
