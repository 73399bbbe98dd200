"""MooncakeDistributedStore with torch and CUDA (the GPU host; skipped
without them): vLLM's registered GPU KV cache, unregistered GPU memory,
a pinned host pool, and the tensor calls in Mooncake's stored layout.

    MOONCAKE_FS_MOUNT=/mnt/mooncake PYTHONPATH=python python3 -m unittest -v python/tests/test_store_gpu.py
"""

import os
import sys
import unittest
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mooncake_fs.mooncake_store import TENSOR_MAGIC, MooncakeDistributedStore, key_to_path  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

MOUNT = os.environ.get("MOONCAKE_FS_MOUNT") or os.environ.get("MOONCAKE_MOUNT")
CUDA = torch is not None and torch.cuda.is_available()


@unittest.skipUnless(MOUNT and torch is not None, "needs a mount and torch")
class Store(unittest.TestCase):
    def setUp(self):
        os.environ["MOONCAKE_FS_MOUNT"] = MOUNT
        self.tenant = "g-" + uuid.uuid4().hex[:8]
        self.s = MooncakeDistributedStore()
        self.assertEqual(self.s.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", "", tenant_id=self.tenant), 0)

    def tearDown(self):
        self.s.remove_all(force=True)
        self.s.close()

    @unittest.skipUnless(CUDA, "no CUDA")
    def test_vllm_gpu_kv_cache(self):
        layers, block, blocks = 3, 32 << 10, 40
        kv = [torch.randint(0, 255, (blocks * block,), dtype=torch.uint8, device="cuda") for _ in range(layers)]
        for t in kv:
            self.assertEqual(self.s.register_buffer(t.data_ptr(), t.numel()), 0)
        self.assertEqual(self.s.register_buffer(kv[0].data_ptr(), 10), -600)  # twice
        keys = [f"llm@tp0@{i:032x}" for i in range(blocks)]
        addrs = [[t.data_ptr() + i * block for t in kv] for i in range(blocks)]
        sizes = [[block] * layers] * blocks
        torch.cuda.synchronize()
        self.assertEqual(self.s.batch_put_from_multi_buffers(keys, addrs, sizes), [0] * blocks)
        self.assertEqual(self.s.batch_is_exist(keys), [1] * blocks)
        with open(os.path.join(MOUNT, self.tenant, keys[7]), "rb") as f:
            got = f.read()
        self.assertEqual(got, b"".join(bytes(t[7 * block:8 * block].cpu().numpy()) for t in kv))
        back = [torch.zeros_like(t) for t in kv]
        for t in back:
            self.assertEqual(self.s.register_buffer(t.data_ptr(), t.numel()), 0)
        res = self.s.batch_get_into_multi_buffers(keys, [[t.data_ptr() + i * block for t in back] for i in range(blocks)],
                                                  sizes)
        torch.cuda.synchronize()
        self.assertEqual(res, [layers * block] * blocks)
        for a, b in zip(kv, back):
            self.assertTrue(torch.equal(a, b))
        for t in kv + back:
            self.assertEqual(self.s.unregister_buffer(t.data_ptr()), 0)
        self.assertEqual(self.s.remove_all(force=True), blocks)

    @unittest.skipUnless(CUDA, "no CUDA")
    def test_unregistered_gpu_memory(self):
        src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        self.assertEqual(self.s.put_from("g", src.data_ptr() + 4096, 65536), 0)
        dst = torch.zeros(65536, dtype=torch.uint8, device="cuda")
        self.assertEqual(self.s.get_into("g", dst.data_ptr(), 65536), 65536)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(dst, src[4096:4096 + 65536]))
        self.assertEqual(self.s.get_into("g", dst.data_ptr(), 100), -600)

    def test_pinned_host_pool(self):
        if not CUDA:
            self.skipTest("no CUDA (pinned memory)")
        pool = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8).pin_memory()
        self.assertEqual(self.s.register_buffer(pool.data_ptr(), pool.numel()), 0)
        keys = [f"p_{i}_k" for i in range(16)]
        self.assertEqual(self.s.batch_put_from(keys, [pool.data_ptr() + i * 4096 for i in range(16)], [4096] * 16),
                         [0] * 16)
        got = self.s.batch_get_into(keys, [pool.data_ptr() + (1 << 19) + i * 4096 for i in range(16)], [4096] * 16)
        self.assertEqual(got, [4096] * 16)
        self.assertTrue(torch.equal(pool[:16 * 4096], pool[1 << 19:(1 << 19) + 16 * 4096]))

    def test_tensors(self):
        devices = ["cpu"] + (["cuda"] if CUDA else [])
        for dev in devices:
            ts = [torch.randn(3, 4, device=dev), torch.randn(5, device=dev).to(torch.bfloat16),
                  torch.arange(10, device=dev), torch.tensor([True, False], device=dev),
                  torch.randn(2, 3, device=dev).t()]  # not contiguous
            keys = [f"t-{dev}-{i}" for i in range(len(ts))]
            self.assertEqual(self.s.put_tensor(keys[0], ts[0]), 0)
            self.assertEqual(self.s.batch_put_tensor(keys[1:], ts[1:]), [0] * (len(ts) - 1))
            back = self.s.batch_get_tensor(keys + ["missing"])
            self.assertIsNone(back[-1])
            for t, b in zip(ts, back):
                self.assertEqual((b.dtype, tuple(b.shape), b.device.type), (t.dtype, tuple(t.shape), "cpu"))
                self.assertTrue(torch.equal(b, t.cpu()))
            self.assertTrue(torch.equal(self.s.get_tensor(keys[0]), ts[0].cpu()))
            with open(os.path.join(MOUNT, self.tenant, key_to_path(keys[0])), "rb") as f:
                head = f.read(304)
            self.assertEqual(int.from_bytes(head[:4], "little"), TENSOR_MAGIC)
        self.assertEqual(self.s.put_tensor("bad", [1, 2]), -600)
        self.assertEqual(self.s.put("plain", b"not a tensor"), 0)
        self.assertIsNone(self.s.get_tensor("plain"))


if __name__ == "__main__":
    unittest.main()
