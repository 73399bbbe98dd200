"""MooncakeDistributedStore against a running mooncake-fs daemon, in the
call patterns of the serving engines' connectors (SGLang HiCache, vLLM v1,
LMCache) and with Mooncake's codes for what goes wrong.

MOONCAKE_FS_MOUNT is the mount (a daemon started with --evict off and a
small --size, for the no-space test); MOONCAKE_BIN the mooncake-fs binary
(for `status --json`). tests/python_test.go sets both.
"""

import ctypes
import json
import os
import random
import subprocess
import sys
import textwrap
import unittest
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mooncake_fs.mooncake_store import (  # noqa: E402
    MooncakeDistributedStore, ReplicateConfig, key_to_path, path_to_key)

MOUNT = os.environ.get("MOONCAKE_FS_MOUNT")
BIN = os.environ.get("MOONCAKE_BIN")


def status():
    out = subprocess.run([BIN, "status", "--json", MOUNT], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


class Pool:
    """A host memory pool at a fixed address (ctypes), as engines keep."""

    def __init__(self, n):
        self.mem = (ctypes.c_char * n)()
        self.addr = ctypes.addressof(self.mem)
        self.n = n

    def fill(self, off, data):
        ctypes.memmove(self.addr + off, data, len(data))

    def read(self, off, n):
        return ctypes.string_at(self.addr + off, n)


@unittest.skipUnless(MOUNT, "MOONCAKE_FS_MOUNT not set")
class Store(unittest.TestCase):
    def setUp(self):
        self.tenant = "t-" + uuid.uuid4().hex[:8]
        self.s = MooncakeDistributedStore()
        rc = self.s.setup("localhost", "P2PHANDSHAKE", 1 << 30, 16 << 20, "tcp", "", "127.0.0.1:50051",
                          tenant_id=self.tenant)
        self.assertEqual(rc, 0)
        self.dir = os.path.join(MOUNT, self.tenant)

    def tearDown(self):
        self.s.remove_all(force=True)
        self.assertEqual(self.s.close(), 0)

    def test_sglang_hicache(self):
        # Warm-up as HiCache does it.
        warm = "mooncake_warmup_" + uuid.uuid4().hex
        value = os.urandom(4096)
        self.assertEqual(self.s.put(warm, value), 0)
        self.assertEqual(self.s.is_exist(warm), 1)
        self.assertEqual(self.s.get(warm), value)
        # A host pool registered once; pages of K and V per hash and rank.
        page, pages = 16 << 10, 64
        pool = Pool(2 * pages * page)
        self.assertEqual(self.s.register_buffer(pool.addr, pool.n), 0)
        want = {}
        keys, ptrs, sizes = [], [], []
        for i in range(pages // 2):
            for j, kv in enumerate(("k", "v")):
                key = f"prefix_{i:08x}deadbeef_0_{kv}"
                off = (2 * i + j) * page
                data = os.urandom(page)
                pool.fill(off, data)
                want[key] = data
                keys.append(key)
                ptrs.append(pool.addr + off)
                sizes.append(page)
        # The first half exists already: only the missing ones are written.
        self.assertEqual(self.s.batch_put_from(keys[:16], ptrs[:16], sizes[:16]), [0] * 16)
        exist = self.s.batch_is_exist(keys)
        self.assertEqual(exist, [1] * 16 + [0] * (len(keys) - 16))
        todo = [i for i, e in enumerate(exist) if e != 1]
        res = self.s.batch_put_from([keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo])
        self.assertEqual(res, [0] * len(todo))
        # Read back into the other half of the pool.
        dst = [pool.addr + (pages + i) * page for i in range(len(keys))]
        got = self.s.batch_get_into(keys, dst, sizes)
        self.assertTrue(all(g > 0 for g in got), got)
        for i, k in enumerate(keys):
            self.assertEqual(pool.read((pages + i) * page, page), want[k], k)
        # Each key is a file under the tenant directory.
        self.assertEqual(sorted(os.listdir(self.dir)), sorted([warm] + keys))
        with open(os.path.join(self.dir, keys[3]), "rb") as f:
            self.assertEqual(f.read(), want[keys[3]])
        self.assertEqual(self.s.unregister_buffer(pool.addr), 0)

    def test_vllm_multi_buffers(self):
        s = MooncakeDistributedStore()
        self.assertEqual(s.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                                  "global_segment_size": "1GB", "local_buffer_size": "16MB", "protocol": "tcp",
                                  "rdma_devices": "", "master_server_addr": "127.0.0.1:50051",
                                  "tenant_id": self.tenant}), 0)
        # One buffer per layer; a block's key gathers its slice of each.
        layers, block, blocks = 4, 8 << 10, 24
        kv = [Pool(blocks * block) for _ in range(layers)]
        for p in kv:
            self.assertEqual(s.register_buffer(p.addr, p.n), 0)
            p.fill(0, os.urandom(p.n))
        keys = [f"model@tp0@{i:064x}" for i in range(blocks)]
        addrs = [[p.addr + i * block for p in kv] for i in range(blocks)]
        sizes = [[block] * layers for _ in range(blocks)]
        self.assertEqual(s.batch_put_from_multi_buffers(keys, addrs, sizes), [0] * blocks)
        self.assertEqual(s.batch_is_exist(keys), [1] * blocks)
        with open(os.path.join(self.dir, keys[5]), "rb") as f:
            self.assertEqual(f.read(), b"".join(p.read(5 * block, block) for p in kv))
        back = [Pool(blocks * block) for _ in range(layers)]
        for p in back:
            self.assertEqual(s.register_buffer(p.addr, p.n), 0)
        res = s.batch_get_into_multi_buffers(keys, [[p.addr + i * block for p in back] for i in range(blocks)], sizes)
        self.assertEqual(res, [layers * block] * blocks)
        for a, b in zip(kv, back):
            self.assertEqual(a.read(0, a.n), b.read(0, b.n))
        self.assertEqual(s.remove_all(force=True), blocks)
        self.assertEqual(s.batch_is_exist(keys), [0] * blocks)
        s.close()

    def test_lmcache(self):
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        cfg.preferred_segment = self.s.get_hostname()
        pool = Pool(1 << 20)
        self.assertEqual(self.s.register_buffer(pool.addr, pool.n), 0)
        chunk = os.urandom(64 << 10)
        pool.fill(0, chunk)
        self.assertEqual(self.s.put_from("fmt@model@1@0@c0", pool.addr, len(chunk), cfg), 0)
        meta = os.urandom(28)
        self.assertEqual(self.s.put_parts("fmt@model@1@0@c1", meta, chunk, config=cfg), 0)
        self.assertEqual(self.s.get_size("fmt@model@1@0@c1"), 28 + len(chunk))
        got = self.s.batch_get_into(["fmt@model@1@0@c0", "fmt@model@1@0@c1", "fmt@model@1@0@gone"],
                                    [pool.addr + (128 << 10), pool.addr + (256 << 10), pool.addr + (512 << 10)],
                                    [64 << 10, 128 << 10, 64 << 10])
        self.assertEqual(got, [64 << 10, 28 + (64 << 10), -704])
        self.assertEqual(pool.read(128 << 10, 64 << 10), chunk)
        self.assertEqual(pool.read(256 << 10, 28 + (64 << 10)), meta + chunk)
        bufs = self.s.batch_get_buffer(["fmt@model@1@0@c1", "fmt@model@1@0@gone"])
        self.assertIsNone(bufs[1])
        mv = memoryview(bufs[0])
        self.assertEqual((len(bufs[0]), bufs[0].size(), bytes(mv[:28])), (28 + len(chunk), 28 + len(chunk), meta))
        self.assertEqual(ctypes.string_at(bufs[0].ptr(), 28), meta)
        self.assertEqual(self.s.is_exist("fmt@model@1@0@c0"), 1)

    def test_codes(self):
        s = self.s
        pool = Pool(1 << 16)
        self.assertEqual(s.put("k", b"first"), 0)
        self.assertEqual(s.put("k", b"second"), 0)  # exists: Mooncake keeps the old value
        self.assertEqual(s.get("k"), b"first")
        self.assertEqual(s.upsert("k", b"second"), 0)
        self.assertEqual(s.get("k"), b"second")
        self.assertEqual(s.put_batch(["a", "b"], [b"1"]), -600)
        self.assertEqual(s.put_batch(["a", "b"], [b"1", b"22"]), 0)
        self.assertEqual(s.get_batch(["a", "b", "nope"]), [b"1", b"22", b""])
        self.assertEqual((s.get("nope"), s.get_size("nope"), s.is_exist("nope"), s.get_buffer("nope")),
                         (b"", -704, 0, None))
        self.assertEqual(s.get_into("nope", pool.addr, 10), -704)
        self.assertEqual(s.get_into("b", pool.addr, 1), -600)  # smaller than the value
        self.assertEqual(s.get_into("b", pool.addr, 100), 2)
        self.assertEqual(s.batch_put_from(["x", "y"], [pool.addr], [1, 2]), [-600, -600])
        self.assertEqual(s.batch_get_into(["x"], [pool.addr, pool.addr], [1]), [-600])
        self.assertEqual(s.batch_put_from([], [], []), [])
        self.assertEqual(s.batch_get_into([], [], []), [])
        self.assertEqual(s.batch_is_exist([]), [])
        self.assertEqual(s.put_from("empty", pool.addr, 0), 0)
        self.assertEqual(s.is_exist("empty"), 0)  # nothing stored
        self.assertEqual(s.put("", b"x"), -600)
        self.assertEqual(s.put("z", b""), -600)
        self.assertEqual(s.register_buffer(pool.addr, pool.n), 0)
        self.assertEqual(s.register_buffer(pool.addr, pool.n), -600)  # twice
        self.assertEqual(s.register_buffer(pool.addr + 100, 10), -600)  # inside one
        self.assertEqual(s.unregister_buffer(pool.addr + 1), -600)      # not registered
        self.assertEqual(s.unregister_buffer(pool.addr), 0)
        self.assertEqual(s.unregister_buffer(pool.addr), -600)
        # Memory never registered still works (this process's memory).
        pool.fill(0, b"unregistered")
        self.assertEqual(s.put_from("u", pool.addr, 12), 0)
        self.assertEqual(s.get("u"), b"unregistered")
        with self.assertRaises(RuntimeError):
            s.put_parts("p", [1, 2])
        self.assertEqual(s.remove("k"), 0)
        self.assertEqual(s.remove("k"), -704)
        self.assertEqual(s.batch_remove(["a", "nope"]), [0, -704])
        got = s.get_into_ranges([pool.addr], [["b", "nope"]], [[[0, 8], [16]]], [[[0, 1], [0]]], [[[1, 1], [1]]])
        self.assertEqual(got, [[[1, 1], [-704]]])
        self.assertEqual(pool.read(0, 1) + pool.read(8, 1), b"22")

    def test_key_names(self):
        keys = ["with/slash", ".leading", "nul\0inside", "x" * 300, "é" * 200, "%25"]
        for i, k in enumerate(keys):
            self.assertEqual(self.s.put(k, k.encode("utf-8", "surrogateescape") + bytes([i])), 0, k)
        for i, k in enumerate(keys):
            path = os.path.join(self.dir, key_to_path(k))
            with open(path, "rb") as f:
                self.assertEqual(f.read(), k.encode("utf-8", "surrogateescape") + bytes([i]))
            self.assertEqual(self.s.get(k), k.encode() + bytes([i]))
        listed = set()
        for top, _, files in os.walk(self.dir):
            for f in files:
                listed.add(path_to_key(os.path.relpath(os.path.join(top, f), self.dir)))
        self.assertEqual(listed, set(keys))
        self.assertEqual(self.s.remove_by_regex("^x+$"), 1)
        self.assertEqual(self.s.remove_by_regex("[.]l|%"), 2)
        self.assertEqual(self.s.remove_by_regex("("), -600)
        self.assertEqual(sorted(self.s.batch_is_exist(keys)), [0, 0, 0, 1, 1, 1])

    def test_replicate_config(self):
        cfg = ReplicateConfig()
        cfg.with_hard_pin = True
        self.assertEqual(self.s.put("pinned", b"p" * 100, cfg), 0)
        self.assertEqual(os.getxattr(os.path.join(self.dir, "pinned"), "user.mooncake.pin"), b"1")
        self.assertEqual(self.s.get("pinned"), b"p" * 100)
        self.assertEqual(self.s.put("pinned", b"q", cfg), 0)  # exists: kept
        self.assertEqual(self.s.get("pinned"), b"p" * 100)
        cfg = ReplicateConfig()
        cfg.preferred_segment = "no-such-node:12345"
        self.assertEqual(self.s.put("placed", b"x", cfg), -200)  # no such node on this store
        self.assertEqual(self.s.is_exist("placed"), 0)  # and nothing left of the attempt
        cfg = ReplicateConfig()
        cfg.replica_num = 2
        self.assertEqual(self.s.put("copied", b"x", cfg), -200)  # one node: one replica at most
        self.assertEqual(self.s.is_exist("copied"), 0)

    def test_no_space(self):
        # The daemon runs with --evict off: a batch that outgrows it gets
        # -200 for the keys that found no room and 0 for the others.
        big = Pool(8 << 20)
        keys = [f"big{i}" for i in range(64)]
        res = self.s.batch_put_from(keys, [big.addr] * 64, [big.n] * 64)
        self.assertIn(-200, res)
        self.assertIn(0, res)
        self.assertTrue(set(res) <= {0, -200}, res)
        self.assertEqual(self.s.batch_is_exist(keys), [1 if r == 0 else 0 for r in res])
        self.assertEqual(self.s.batch_remove([k for k, r in zip(keys, res) if r == 0]), [0] * res.count(0))

    @unittest.skipUnless(BIN, "MOONCAKE_BIN not set")
    def test_child_processes(self):
        # A child writes from its own registered pool and is killed with the
        # registration open; the parent reads what it committed, and the
        # daemon holds nothing of the child's afterwards.
        before = status()["registrations"]["live"]
        child = textwrap.dedent(f"""
            import ctypes, os, sys, time
            sys.path.insert(0, {os.path.dirname(HERE)!r})
            from mooncake_fs.mooncake_store import MooncakeDistributedStore
            s = MooncakeDistributedStore()
            assert s.setup("localhost", "x", 0, 0, "tcp", "", "", tenant_id={self.tenant!r}) == 0
            mem = (ctypes.c_char * (1 << 20))()
            a = ctypes.addressof(mem)
            ctypes.memmove(a, b"C" * (1 << 20), 1 << 20)
            assert s.register_buffer(a, 1 << 20) == 0
            print(s.batch_put_from(["c0", "c1"], [a, a + 4096], [4096, 8192]), flush=True)
            time.sleep(60)
        """)
        p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
        self.assertEqual(p.stdout.readline().strip(), "[0, 0]")
        self.assertEqual(status()["registrations"]["live"], before + 1)
        p.kill()
        p.wait()
        p.stdout.close()
        self.assertEqual(self.s.get("c0"), b"C" * 4096)
        self.assertEqual(self.s.get_size("c1"), 8192)
        for _ in range(100):
            if status()["registrations"]["live"] == before:
                break
            import time
            time.sleep(0.05)
        self.assertEqual(status()["registrations"]["live"], before)

    def test_many_keys_model(self):
        # Random batches of puts, upserts, removes and gets against a model.
        rng = random.Random(7)
        pool = Pool(1 << 20)
        self.assertEqual(self.s.register_buffer(pool.addr, pool.n), 0)
        pool.fill(0, bytes(rng.randrange(256) for _ in range(pool.n)))
        model = {}
        for _ in range(30):
            keys = [f"m{rng.randrange(80)}" for _ in range(rng.randrange(1, 40))]
            offs = [rng.randrange(pool.n - 9000) for _ in keys]
            lens = [rng.randrange(1, 9000) for _ in keys]
            op = rng.choice(["put", "upsert", "remove", "get"])
            if op in ("put", "upsert"):
                fn = self.s.batch_put_from if op == "put" else self.s.batch_upsert_from
                res = fn(keys, [pool.addr + o for o in offs], lens)
                self.assertEqual(res, [0] * len(keys))
                for k, o, n in zip(keys, offs, lens):
                    if op == "upsert" or k not in model:
                        model[k] = pool.read(o, n)
            elif op == "remove":
                res = self.s.batch_remove(keys)
                for k, r in zip(keys, res):
                    self.assertEqual(r, 0 if k in model else -704, k)
                    model.pop(k, None)
            for k in set(keys):
                self.assertEqual(self.s.get(k), model.get(k, b""), k)
        self.assertEqual(self.s.batch_is_exist(sorted(model)), [1] * len(model))

    def registered_pair(self, n):
        """Two pools of n bytes registered on the store: a source of
        random bytes and an empty destination."""
        src, dst = Pool(n), Pool(n)
        src.fill(0, os.urandom(src.n))
        for p in (src, dst):
            self.assertEqual(self.s.register_buffer(p.addr, p.n), 0)
        return src, dst

    def test_overlapped_calls(self):
        # A batch of more calls than one: distinct keys go in calls that
        # overlap, a key upserted twice in calls apart keeps the later
        # value (its calls go in order); every key reads back whole.
        rng = random.Random(13)
        src, dst = self.registered_pair(1 << 20)
        keys = [f"o{i}" for i in range(300)]
        offs = [rng.randrange(src.n - 3000) for _ in keys]
        lens = [rng.randrange(1, 3000) for _ in keys]
        self.assertEqual(self.s.batch_put_from(keys, [src.addr + o for o in offs], lens), [0] * len(keys))
        # o5 in the first call and again in the second (the key twice: its
        # calls go one after the other).
        twice, lens2 = keys[:70] + ["o5"] + keys[70:], lens[:70] + [777] + lens[70:]
        offs2 = [rng.randrange(src.n - 3000) for _ in twice]
        self.assertEqual(self.s.batch_upsert_from(twice, [src.addr + o for o in offs2], lens2), [0] * len(twice))
        want = {k: src.read(o, n) for k, o, n in zip(twice, offs2, lens2)}  # o5: the later
        at = [i * 3000 for i in range(len(keys))]
        got = self.s.batch_get_into(keys, [dst.addr + a for a in at], [3000] * len(keys))
        self.assertEqual(got, [len(want[k]) for k in keys])
        for k, a in zip(keys, at):
            self.assertEqual(dst.read(a, len(want[k])), want[k], k)

    def test_whole_as_probe(self):
        # Gets that ask the daemon for the whole value (ABI 1.6) answer as
        # those that read a probe byte past it (older daemons): the same
        # codes, on the fast path and the general one, values that fit and
        # values that do not.
        rng = random.Random(17)
        src, dst = self.registered_pair(1 << 18)
        keys = [f"w{i}" for i in range(100)]
        lens = [rng.randrange(1, 2000) for _ in keys]
        self.assertEqual(self.s.batch_put_from(keys, [src.addr + 2000 * i for i in range(100)], lens), [0] * 100)
        room = [n + rng.choice([-1, 0, 0, 5]) for n in lens]
        self.assertTrue(self.s._whole)
        codes = {}
        try:
            for whole in (True, False):
                self.s._whole = whole
                fast = self.s.batch_get_into(keys, [dst.addr + 2000 * i for i in range(100)], room)
                general = self.s._get_many(keys, [[(dst.addr + 2000 * i, z)] for i, z in enumerate(room)])
                self.assertEqual(fast, general)
                codes[whole] = fast
        finally:
            self.s._whole = True
        self.assertEqual(codes[True], codes[False])
        self.assertEqual(codes[True], [n if z >= n else -600 for n, z in zip(lens, room)])

    def test_fast_path_as_general(self):
        # The batch engine's fast path (whole columns for plain names in
        # one registration) against the general engine, key by key: the
        # same codes and the same bytes for random batches of every shape.
        rng = random.Random(11)
        general = MooncakeDistributedStore()
        self.assertEqual(general.setup("localhost", "x", 0, 0, "tcp", "", "", tenant_id=self.tenant + "-g"), 0)
        general._columns = lambda *a, **k: None
        fast = self.s
        src, other = Pool(1 << 20), Pool(1 << 16)
        src.fill(0, bytes(rng.randrange(256) for _ in range(src.n)))
        other.fill(0, os.urandom(other.n))
        outs = {}
        for st in (fast, general):
            outs[st] = Pool(1 << 20)
            self.assertEqual(st.register_buffer(src.addr, src.n), 0)
            self.assertEqual(st.register_buffer(outs[st].addr, outs[st].n), 0)
        plain = [f"k{i}" for i in range(300)] + ["L" * 250 + f"{i:05d}" for i in range(4)]
        odd_names = ["a/b", ".hidden", "x" * 300, "p%c", "\u00e9t\u00e9"]
        seen = set()
        try:
            for rnd in range(70):
                n = rng.choice([1, 3, 64, 65, 130, 300])
                odd = rng.random() < 0.2  # a name the fast path leaves to the general one
                m = rng.choice([1, 1, 2, 3])
                if n == 300:
                    # Distinct keys, buffers apart: calls that overlap, each
                    # sent as soon as its keys are checked (an odd name
                    # anywhere sends the whole batch the general way).
                    keys = rng.sample(plain, n)
                    sizes = [[rng.randrange(1, 1000) for _ in range(m)] for _ in keys]
                    offs = [[(i * m + t) * 1000 for t in range(m)] for i in range(n)]
                else:
                    keys = [rng.choice(plain[:94]) for _ in range(n)]
                    sizes = [[rng.randrange(1, 3000) for _ in range(m)] for _ in keys]
                    offs = [[rng.randrange(src.n - 3000) for _ in range(m)] for _ in keys]
                if odd:
                    keys[rng.randrange(n)] = rng.choice(odd_names)
                unreg = rng.random() < 0.1
                op = rng.choice(["put", "upsert", "get", "get"])
                by_ptr = m == 1 and rng.random() < 0.5  # batch_*_from, not *_multi_buffers
                codes = {}
                for st in (fast, general):
                    if op == "get":
                        out = outs[st]
                        ctypes.memset(out.addr, 0, out.n)
                        ptrs = [[out.addr + o for o in os_] for os_ in offs]
                        if m == 1:
                            codes[st] = st.batch_get_into(keys, [p[0] for p in ptrs], [z[0] for z in sizes])
                        else:
                            codes[st] = st.batch_get_into_multi_buffers(keys, ptrs, sizes)
                        continue
                    base = other.addr if unreg else src.addr
                    ptrs = [[base + (o % (other.n - 3000) if unreg else o) for o in os_] for os_ in offs]
                    if by_ptr:
                        fn = st.batch_put_from if op == "put" else st.batch_upsert_from
                        codes[st] = fn(keys, [p[0] for p in ptrs], [z[0] for z in sizes])
                    elif op == "put":
                        codes[st] = st.batch_put_from_multi_buffers(keys, ptrs, sizes)
                    else:
                        codes[st] = [st.upsert_parts(k, *[ctypes.string_at(p, z) for p, z in zip(ps, zs)])
                                     for k, ps, zs in zip(keys, ptrs, sizes)]
                if op != "get":
                    seen.update(keys)
                self.assertEqual(codes[fast], codes[general], f"round {rnd}: {op} of {n} keys, {m} buffers each")
                if op == "get":
                    self.assertEqual(outs[fast].read(0, outs[fast].n), outs[general].read(0, outs[general].n), f"round {rnd}")
            for k in sorted(seen):
                self.assertEqual(fast.get(k), general.get(k), k)
        finally:
            general.remove_all(force=True)
            general.close()


if __name__ == "__main__":
    unittest.main()


@unittest.skipUnless(MOUNT, "MOONCAKE_FS_MOUNT not set")
class Review(unittest.TestCase):
    """What a review found: torn reads, codes converted twice, directories
    made by reads."""

    def setUp(self):
        self.tenant = "r-" + uuid.uuid4().hex[:8]
        self.s = MooncakeDistributedStore()
        self.assertEqual(self.s.setup("localhost", "x", 0, 0, "tcp", "", "", tenant_id=self.tenant), 0)
        self.dir = os.path.join(MOUNT, self.tenant)

    def tearDown(self):
        self.s.remove_all()
        self.s.close()

    def test_reads_are_whole_versions(self):
        import threading

        small, large = b"a" * 1000, b"b" * 100000
        self.assertEqual(self.s.upsert("k", small), 0)
        stop = threading.Event()

        def writer():
            while not stop.is_set():
                self.s.upsert("k", large)
                self.s.upsert("k", small)

        w = threading.Thread(target=writer)
        w.start()
        try:
            for _ in range(200):
                self.assertIn(self.s.get("k"), (small, large))
                b = self.s.get_buffer("k")
                self.assertIn(bytes(b), (small, large))
        finally:
            stop.set()
            w.join()

    def test_codes_once(self):
        self.assertEqual(self.s.put("\ud800", b"x"), -600)           # not encodable
        self.assertEqual(self.s.put("x" * 5000, b"x"), -400)         # longer than a path may be
        self.assertEqual(self.s.is_exist("x" * 5000), -400)
        self.assertEqual(self.s.batch_get_into(["x" * 5000], [4096], [1]), [-400])
        self.s.remove_all()
        self.assertEqual(os.listdir(self.dir), [])  # the failed put's directories tidied

    def test_reads_make_no_directories(self):
        self.assertEqual(self.s.is_exist("q" * 600), 0)
        self.assertEqual(self.s.get_size("q" * 600), -704)
        self.assertEqual(self.s.remove("z" * 700), -704)
        self.assertEqual(os.listdir(self.dir), [])
        self.assertEqual(self.s.put("y" * 700, b"long"), 0)
        self.assertEqual(self.s.get("y" * 700), b"long")
        self.assertEqual(self.s.remove("y" * 700), 0)
        self.assertEqual(os.listdir(self.dir), [])  # its directories went with it

    def test_bad_ranges_and_keys(self):
        self.assertEqual(self.s.put("ra", b"hello"), 0)
        buf = ctypes.create_string_buffer(16)
        a = ctypes.addressof(buf)
        for src in (2 ** 64, 1.5, None, -1):
            self.assertEqual(self.s.get_into_ranges([a], [["ra"]], [[[0]]], [[[src]]], [[[5]]]), [[[-600]]], src)
        self.assertEqual(self.s.get_into_ranges([a], [["ra"]], [[[None]]], [[[0]]], [[[5]]]), [[[-600]]])
        self.assertEqual(self.s.put("\udcc3\udca9", b"x"), -600)  # a lone surrogate: not "é"'s name
        self.assertEqual(self.s.put("é", b"one"), 0)
        self.assertEqual(self.s.is_exist("\udcc3\udca9"), -600)
        # Pointers and sizes that are not numbers, with a buffer registered
        # (the batch engine's fast path looks them up there first).
        self.assertEqual(self.s.register_buffer(a, 16), 0)
        for bad in ("x", b"x", (1,), [1], None, 1.5):
            self.assertEqual(self.s.batch_put_from_multi_buffers(["rb"], [[bad]], [[bad]]), [-600], bad)
            self.assertEqual(self.s.batch_get_into_multi_buffers(["ra"], [[bad]], [[bad]]), [-600], bad)
            self.assertEqual(self.s.batch_put_from(["rb"], [bad], [bad]), [-600], bad)
            self.assertEqual(self.s.batch_get_into(["ra"], [bad], [bad]), [-600], bad)
        self.assertEqual(self.s.is_exist("rb"), 0)

    def test_failed_configured_put_leaves_nothing(self):
        cfg = ReplicateConfig()
        cfg.with_hard_pin = True
        self.assertEqual(self.s.put("pinned-k", bytearray(200 << 20), cfg), -200)
        self.assertEqual(self.s.is_exist("pinned-k"), 0)
        self.assertEqual(self.s.put("pinned-k", b"data"), 0)
        self.assertEqual(self.s.get("pinned-k"), b"data")

    def test_long_keys_sharing_directories(self):
        # One thread's puts of a long key keep failing (no room) while
        # another puts, reads and removes a long key in the same
        # directories: no write of the second is lost.
        import threading

        one, two = "p" * 260 + "one", "p" * 260 + "two"
        stop = threading.Event()

        too_big = bytearray(129 << 20)  # more than the store holds

        def failing():
            s = MooncakeDistributedStore()
            s.setup("localhost", "x", 0, 0, "tcp", "", "", tenant_id=self.tenant)
            while not stop.is_set():
                s.put(one, too_big)
                s.remove(one)
            s.close()

        t = threading.Thread(target=failing)
        t.start()
        try:
            for i in range(150):
                v = b"v%d" % i
                self.assertEqual(self.s.upsert(two, v), 0, i)
                self.assertEqual(self.s.get(two), v, i)
                self.assertEqual(self.s.remove(two), 0, i)
        finally:
            stop.set()
            t.join()

    def test_most_segments(self):
        pool = ctypes.create_string_buffer(256)
        a = ctypes.addressof(pool)
        ctypes.memmove(a, bytes(range(256)), 256)
        self.assertEqual(self.s.batch_put_from_multi_buffers(["d256"], [[a + i for i in range(256)]], [[1] * 256]), [0])
        back = ctypes.create_string_buffer(256)
        b = ctypes.addressof(back)
        self.assertEqual(self.s.batch_get_into_multi_buffers(["d256"], [[b + i for i in range(256)]], [[1] * 256]), [256])
        self.assertEqual(back.raw, bytes(range(256)))
        self.assertEqual(self.s.batch_get_into_multi_buffers(["d256"], [[b + i for i in range(256)]], [[1] * 255 + [0]]),
                         [-600])
