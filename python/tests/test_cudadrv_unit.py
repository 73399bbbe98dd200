"""Unit tests of mooncake_fs.cudadrv against a fake libcuda.

A small C library (compiled here with cc; skipped without one) exports
the driver entry points cudadrv uses with their real signatures and keeps
a table of fake allocations, so the ctypes prototypes, the context
push/pop, the offset and handle computations, the per-allocation handle
cache and the error paths run without a GPU.
"""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mooncake_fs import cudadrv  # noqa: E402

FAKE_C = r"""
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;

struct alloc { CUdeviceptr base; size_t size; int dev; unsigned long long id; unsigned mtype, managed, capable; };
static struct alloc allocs[64];
static int nallocs;
static __thread int depth, ctx_dev = -1, stack[16]; /* the current context is per thread */
int fake_init_result, fake_handles, fake_retains, fake_max_depth, fake_ndev = 2, fake_no_buffer_id, fake_queries;

void fake_reset(void) { nallocs = 0; depth = 0; ctx_dev = -1; fake_handles = fake_retains = fake_max_depth = fake_queries = 0; fake_no_buffer_id = 0; }
void fake_add(CUdeviceptr base, size_t size, int dev, unsigned long long id, unsigned mtype, unsigned managed, unsigned capable) {
	struct alloc a = {base, size, dev, id, mtype, managed, capable};
	allocs[nallocs++] = a;
}
void fake_free(CUdeviceptr base) {
	for (int i = 0; i < nallocs; i++)
		if (allocs[i].base == base) { allocs[i] = allocs[--nallocs]; return; }
}
int fake_depth(void) { return depth; }
void fake_reset_queries(void) { fake_queries = 0; }

static struct alloc *find(CUdeviceptr p) {
	for (int i = 0; i < nallocs; i++)
		if (p >= allocs[i].base && p < allocs[i].base + allocs[i].size) return &allocs[i];
	return 0;
}

CUresult cuInit(unsigned f) { return f ? 1 : fake_init_result; }
CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
CUresult cuGetErrorName(CUresult r, const char **s) {
	switch (r) {
	case 1: *s = "CUDA_ERROR_INVALID_VALUE"; return 0;
	case 100: *s = "CUDA_ERROR_NO_DEVICE"; return 0;
	case 101: *s = "CUDA_ERROR_INVALID_DEVICE"; return 0;
	case 201: *s = "CUDA_ERROR_INVALID_CONTEXT"; return 0;
	}
	return 1;
}
CUresult cuGetErrorString(CUresult r, const char **s) { *s = "fake error text"; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = fake_ndev; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) {
	if (ordinal < 0 || ordinal >= fake_ndev) return 101;
	*d = 100 + ordinal;
	return 0;
}
CUresult cuDeviceGetUuid_v2(CUuuid *u, int d) {
	if (d < 100 || d >= 100 + fake_ndev) return 101;
	for (int i = 0; i < 16; i++) u->bytes[i] = (char)(0xA0 + (d - 100) * 16 + i);
	return 0;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int d) {
	if (d < 100 || d >= 100 + fake_ndev) return 101;
	fake_retains++;
	*ctx = (void *)(uintptr_t)(0x1000 + d);
	return 0;
}
CUresult cuCtxGetCurrent(void **ctx) { *ctx = ctx_dev < 0 ? 0 : (void *)(uintptr_t)(0x1000 + 100 + ctx_dev); return 0; }
CUresult cuCtxPushCurrent_v2(void *ctx) {
	if (depth == 16) return 1;
	stack[depth++] = ctx_dev;
	ctx_dev = (int)((uintptr_t)ctx - 0x1000 - 100);
	if (depth > fake_max_depth) fake_max_depth = depth;
	return 0;
}
CUresult cuCtxPopCurrent_v2(void **ctx) {
	if (!depth) return 201;
	if (ctx) *ctx = (void *)(uintptr_t)(0x1000 + 100 + ctx_dev);
	ctx_dev = stack[--depth];
	return 0;
}
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
	fake_queries++;
	struct alloc *a = find(p);
	if (!a)
		return 1; /* as the real one answers for plain host memory */
	if (attr != 9 && ctx_dev < 0) return 201;
	switch (attr) {
	case 2: *(unsigned *)data = a->mtype; return 0;
	case 7: if (fake_no_buffer_id) return 1; *(unsigned long long *)data = a->id; return 0;
	case 8: *(unsigned *)data = a->managed; return 0;
	case 9: *(int *)data = a->dev; return 0;
	case 10: *(unsigned *)data = a->capable; return 0;
	}
	return 1;
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
	struct alloc *a = find(p);
	if (ctx_dev < 0) return 201;
	if (!a) return 1;
	*base = a->base; *size = a->size;
	return 0;
}
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
	struct alloc *a = find(p);
	if (ctx_dev < 0) return 201;
	if (!a || a->base != p) return 1; /* the real one wants the base too */
	if (!a->capable) return 1;
	fake_handles++;
	memset(h, 0, sizeof *h);
	memcpy(h->reserved, &a->base, 8);
	memcpy(h->reserved + 8, &a->id, 8);
	h->reserved[63] = (char)a->dev;
	return 0;
}
"""


def build_fake(tmp):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise unittest.SkipTest("no C compiler (cc)")
    src, so = os.path.join(tmp, "fakecuda.c"), os.path.join(tmp, "libcuda.so.1")
    with open(src, "w") as f:
        f.write(FAKE_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-o", so, src], check=True, capture_output=True, text=True)
    return so


MB = 1 << 20


class TestFakeDriver(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        cls.so = build_fake(cls.tmp)
        cls.drv = cudadrv.Driver([cls.so])
        cls.fake = cls.drv.lib

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        self.fake.fake_reset()
        self.saved = cudadrv._driver
        cudadrv._driver = self.drv
        self.cache = cudadrv.HandleCache(max_entries=4)

    def tearDown(self):
        cudadrv._driver = self.saved
        self.assertEqual(self.fake.fake_depth(), 0, "context stack left unbalanced")

    def var(self, name):
        return ctypes.c_int.in_dll(self.fake, name).value

    def add(self, base, size, dev=0, buf_id=None, mtype=cudadrv.MEMORYTYPE_DEVICE, managed=0, capable=1):
        self.fake.fake_add(ctypes.c_uint64(base), ctypes.c_size_t(size), dev, ctypes.c_uint64(buf_id or base >> 20),
                           mtype, managed, capable)

    def test_loaded(self):
        self.assertEqual(self.drv.version, 12040)
        self.assertEqual(self.drv.device_count(), 2)
        self.assertEqual(self.drv.uuid(1), bytes(range(0xB0, 0xC0)))

    def test_offset_inside_block(self):
        self.add(0x7F0000000000, 20 * MB, dev=1)
        loc = self.cache.locate(0x7F0000000000 + 4000, 16000, ordinal=1)
        self.assertEqual(loc.dev_off, 4000)
        self.assertEqual(loc.base, 0x7F0000000000)
        self.assertEqual(loc.size, 20 * MB)
        self.assertEqual(loc.ordinal, 1)
        self.assertEqual(loc.device, bytes(range(0xB0, 0xC0)))
        self.assertEqual(len(loc.handle), 64)
        self.assertEqual(int.from_bytes(loc.handle[:8], "little"), 0x7F0000000000)
        self.assertEqual(loc.handle[63], 1)

    def test_ordinal_found_from_pointer(self):
        self.add(0x7F0000000000, MB, dev=1)
        self.assertEqual(self.cache.locate(0x7F0000000010).ordinal, 1)

    def test_cache_per_allocation(self):
        self.add(0x7F0000000000, 20 * MB, buf_id=11)
        self.add(0x7F0002000000, 2 * MB, buf_id=12)
        a = self.cache.locate(0x7F0000000000, 1, 0)
        b = self.cache.locate(0x7F0000100000, 1, 0)
        c = self.cache.locate(0x7F0002000100, 1, 0)
        self.assertEqual(a.handle, b.handle)
        self.assertNotEqual(a.handle, c.handle)
        self.assertEqual(self.var("fake_handles"), 2)
        self.assertEqual((self.cache.hits, self.cache.misses), (1, 2))

    def test_reallocated_at_same_address(self):
        # Freed and allocated again at the same base and size: a new buffer
        # id, so a new handle, never the stale one.
        self.add(0x7F0000000000, 2 * MB, buf_id=21)
        h1 = self.cache.locate(0x7F0000000000, 1, 0).handle
        self.fake.fake_free(ctypes.c_uint64(0x7F0000000000))
        self.add(0x7F0000000000, 2 * MB, buf_id=22)
        h2 = self.cache.locate(0x7F0000000000, 1, 0).handle
        self.assertNotEqual(h1, h2)
        self.assertEqual(self.var("fake_handles"), 2)

    def test_locate_many_as_locate(self):
        # Hits and misses, a block freed and made again at its address, and
        # each error: what locate says, pointer by pointer, the context
        # stack balanced (tearDown) and a handle made once per allocation.
        self.add(0x7F0000000000, 20 * MB, buf_id=31)
        self.add(0x7F0002000000, 2 * MB, buf_id=32)
        ptrs = [0x7F0000000000, 0x7F0000100000, 0x7F0002000100, 0x7F0000000000 + 5]
        lens = [1, 4096, 100, 10]
        many = self.cache.locate_many(ptrs, lens, 0)
        one = [self.cache.locate(p, n, 0) for p, n in zip(ptrs, lens)]
        self.assertEqual(many, [(loc.handle, loc.device, loc.dev_off) for loc in one])
        self.assertEqual(self.var("fake_handles"), 2)
        self.fake.fake_free(ctypes.c_uint64(0x7F0002000000))
        self.add(0x7F0002000000, 2 * MB, buf_id=33)
        again = self.cache.locate_many(ptrs[2:3], lens[2:3], 0)
        self.assertNotEqual(again[0][0], many[2][0])
        self.assertEqual(self.var("fake_handles"), 3)
        with self.assertRaisesRegex(ValueError, "run past the end"):
            self.cache.locate_many([0x7F0000000000, 0x7F0000000000 + 19 * MB], [1, 2 * MB], 0)
        with self.assertRaisesRegex(ValueError, "is not device memory"):
            self.cache.locate_many([0x7F0000000000, 0x1234], [1, 1], 0)
        with self.assertRaisesRegex(ValueError, "null"):
            self.cache.locate_many([0], [1], 0)

    def test_locate_many_queries_each_allocation_once(self):
        # 64 tensors in 8 cached allocations, interleaved: one driver query
        # per allocation (the others fall inside a range the call checked),
        # the answers as locate's.
        self.cache = cudadrv.HandleCache(max_entries=16)
        for b in range(8):
            self.add(0x7F0000000000 + b * 2 * MB, 2 * MB, buf_id=40 + b)
        ptrs = [0x7F0000000000 + (i % 8) * 2 * MB + (i // 8) * 256 * 1024 for i in range(64)]
        lens = [256 * 1024] * 64
        want = [(loc.handle, loc.device, loc.dev_off) for loc in (self.cache.locate(p, n, 0) for p, n in zip(ptrs, lens))]
        self.fake.fake_reset_queries()
        self.assertEqual(self.cache.locate_many(ptrs, lens, 0), want)
        self.assertEqual(self.var("fake_queries"), 8)
        # An empty range right at a checked block's end is in the next one.
        got = self.cache.locate_many([0x7F0000000000, 0x7F0000000000 + 2 * MB], [1, 0], 0)
        self.assertEqual(got[1], want[1][:2] + (0,))
        # A pointer past a checked block's end is not taken for it.
        with self.assertRaisesRegex(ValueError, "run past the end"):
            self.cache.locate_many([0x7F0000000000, 0x7F0000000000 + MB], [1, 2 * MB], 0)

    def test_locate_columns_queries_each_allocation_once(self):
        # More allocations in one call than there is room to keep in a
        # short list, met in turn, and a large one (64 MiB, past what is
        # noted granule by granule) met between them: still one driver
        # query per allocation, the answers as locate's.
        self.cache = cudadrv.HandleCache(max_entries=32)
        for b in range(12):
            self.add(0x7F0000000000 + b * 2 * MB, 2 * MB, buf_id=60 + b)
        self.add(0x7F0040000000, 64 * MB, buf_id=80)
        ptrs = []
        for i in range(48):
            ptrs.append(0x7F0000000000 + (i % 12) * 2 * MB + (i // 12) * 256 * 1024)
            if i % 3 == 0:
                ptrs.append(0x7F0040000000 + (i * 7 % 64) * MB)
        lens = [256 * 1024] * len(ptrs)
        want = [self.cache.locate(p, n, 0) for p, n in zip(ptrs, lens)]
        self.fake.fake_reset_queries()
        refs, idx, offs = self.cache.locate_columns(ptrs, lens, 0)
        self.assertEqual(self.var("fake_queries"), 13)
        self.assertEqual([refs[i] + (o,) for i, o in zip(idx, offs)], [(w.handle, w.device, w.dev_off) for w in want])

    def test_locate_columns(self):
        # The columns say what locate says of each pointer: its
        # allocation's (handle, device) once in refs, in the order first
        # met, and its offset; an allocation met again after others is not
        # added twice; one query per allocation.
        self.cache = cudadrv.HandleCache(max_entries=16)
        for b in range(3):
            self.add(0x7F0000000000 + b * 2 * MB, 2 * MB, buf_id=50 + b)
        ptrs = [0x7F0000000000 + 2 * MB + 8, 0x7F0000000000 + 2 * MB + 4096, 0x7F0000000000,
                0x7F0000000000 + 4 * MB + MB, 0x7F0000000000 + 2 * MB + MB, 0x7F0000000000 + 100]
        lens = [8, 4096, 1, MB, MB, 0]
        want = [self.cache.locate(p, n, 0) for p, n in zip(ptrs, lens)]
        self.fake.fake_reset_queries()
        refs, idx, offs = self.cache.locate_columns(ptrs, lens, 0)
        self.assertEqual(self.var("fake_queries"), 3)
        self.assertEqual(len(refs), 3)
        self.assertEqual(idx, [0, 0, 1, 2, 0, 1])
        self.assertEqual([refs[i] + (o,) for i, o in zip(idx, offs)], [(w.handle, w.device, w.dev_off) for w in want])
        self.assertEqual(self.cache.locate_many(ptrs, lens, 0), [(w.handle, w.device, w.dev_off) for w in want])
        # The last pointer's block is not taken for a range past its end,
        # nor for an empty range at its end.
        with self.assertRaisesRegex(ValueError, "run past the end"):
            self.cache.locate_columns([0x7F0000000000, 0x7F0000000000 + MB], [1, 2 * MB], 0)
        refs, idx, offs = self.cache.locate_columns([0x7F0000000000, 0x7F0000000000 + 2 * MB], [1, 0], 0)
        self.assertEqual((len(refs), idx, offs), (2, [0, 1], [0, 0]))
        with self.assertRaisesRegex(ValueError, "null"):
            self.cache.locate_columns([0x7F0000000000, 0], [1, 0], 0)

    def test_without_buffer_ids(self):
        flag = ctypes.c_int.in_dll(self.fake, "fake_no_buffer_id")
        flag.value = 1
        try:
            self.add(0x7F0000000000, 2 * MB)
            self.cache.locate(0x7F0000000000, 1, 0)
            self.cache.locate(0x7F0000000800, 1, 0)
            self.assertEqual(self.var("fake_handles"), 1)
            # A different size at the same base is another allocation.
            self.fake.fake_free(ctypes.c_uint64(0x7F0000000000))
            self.add(0x7F0000000000, 4 * MB)
            self.cache.locate(0x7F0000000000, 1, 0)
            self.assertEqual(self.var("fake_handles"), 2)
        finally:
            flag.value = 0

    def test_bounded(self):
        for i in range(10):
            self.add(0x7F0000000000 + i * 4 * MB, 2 * MB, buf_id=100 + i)
            self.cache.locate(0x7F0000000000 + i * 4 * MB, 1, 0)
        self.assertEqual(len(self.cache), 4)
        self.cache.clear()
        self.assertEqual(len(self.cache), 0)

    def test_errors(self):
        self.add(0x7F0000000000, 2 * MB)
        self.add(0x7F0010000000, 2 * MB, managed=1, buf_id=2)
        self.add(0x7F0020000000, 2 * MB, capable=0, buf_id=3)
        self.add(0x7F0030000000, 2 * MB, dev=1, buf_id=4)
        with self.assertRaisesRegex(ValueError, "run past the end"):
            self.cache.locate(0x7F0000000000 + MB, 2 * MB, 0)
        with self.assertRaisesRegex(ValueError, "managed"):
            self.cache.locate(0x7F0010000000, 1, 0)
        with self.assertRaisesRegex(ValueError, "expandable_segments"):
            self.cache.locate(0x7F0020000000, 1, 0)
        with self.assertRaisesRegex(ValueError, "not device memory known"):
            self.cache.locate(0x1234, 1)
        with self.assertRaisesRegex(ValueError, "is not device memory"):
            self.cache.locate(0x1234, 1, 0)
        self.add(0x7F0040000000, 2 * MB, mtype=cudadrv.MEMORYTYPE_HOST, buf_id=5)  # cudaHostAlloc
        with self.assertRaisesRegex(ValueError, "CUmemorytype 1.*PUT_VM"):
            self.cache.locate(0x7F0040000000, 1, 0)
        with self.assertRaisesRegex(ValueError, "on CUDA device 1, not 0"):
            self.cache.locate(0x7F0030000000, 1, 0)
        with self.assertRaisesRegex(ValueError, "null"):
            self.cache.locate(0, 0, 0)
        with self.assertRaises(cudadrv.CudaError) as cm:
            self.cache.locate(0x7F0000000000, 1, 5)
        self.assertEqual(cm.exception.name, "CUDA_ERROR_INVALID_DEVICE")
        self.assertIn("fake error text", str(cm.exception))

    def test_context_restored(self):
        self.add(0x7F0000000000, 2 * MB, dev=1)
        cur = ctypes.c_void_p()
        self.drv.cuCtxGetCurrent(ctypes.byref(cur))
        self.assertIsNone(cur.value)
        self.cache.locate(0x7F0000000000, 1, 1)
        self.drv.cuCtxGetCurrent(ctypes.byref(cur))
        self.assertIsNone(cur.value)
        self.assertEqual(self.var("fake_max_depth"), 1)

    def test_threads(self):
        for i in range(4):
            self.add(0x7F0000000000 + i * 4 * MB, 2 * MB, buf_id=200 + i)
        errors = []

        def work(i):
            try:
                for j in range(200):
                    loc = self.cache.locate(0x7F0000000000 + (j % 4) * 4 * MB + i, 1, 0)
                    assert loc.dev_off == i
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.assertEqual(errors, [])
        self.assertLessEqual(self.var("fake_handles"), 16)


class TestFakeDriverInit(unittest.TestCase):
    def test_init_failure_is_unavailable(self):
        with tempfile.TemporaryDirectory() as tmp:
            so = build_fake(tmp)
            lib = ctypes.CDLL(so)
            ctypes.c_int.in_dll(lib, "fake_init_result").value = 100
            try:
                with self.assertRaisesRegex(cudadrv.CudaUnavailable, "cuInit: CUDA_ERROR_NO_DEVICE"):
                    cudadrv.Driver([so])
            finally:
                ctypes.c_int.in_dll(lib, "fake_init_result").value = 0

    def test_missing_symbol(self):
        with tempfile.TemporaryDirectory() as tmp:
            cc = shutil.which("cc")
            if not cc:
                self.skipTest("no cc")
            src, so = os.path.join(tmp, "x.c"), os.path.join(tmp, "libx.so")
            with open(src, "w") as f:
                f.write("int cuInit(unsigned f) { return 0; }\n")
            subprocess.run([cc, "-shared", "-fPIC", "-o", so, src], check=True)
            with self.assertRaisesRegex(cudadrv.CudaUnavailable, "has no cuDriverGetVersion"):
                cudadrv.Driver([so])


if __name__ == "__main__":
    unittest.main()
