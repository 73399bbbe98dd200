"""Time KV-cache blocks as separate CUDA tensors through mooncake-fs.

Run by `mooncake-fs bench` (cases kv-put-tensor-256KiB / kv-get-tensor-256KiB)
as a worker:
    python3 kv_bench.py --dir DIR --op put|get --block BYTES --bytes TOTAL
prints one JSON object: bytes, keys, mooncake_ns, cold_ns, the daemon's
figures per key (key_work_ns, transfer_ns, copies_per_key) and, for the
tensor calls, the split of a key's time between the caller (client_ns),
the kernel's FUSE path with the wake-ups (fuse_ns) and the daemon.
put: batch_put_tensor of 64 separate tensors per call; get: batch_get_tensor
into 64 separate tensors per call (after an untimed put); each timed after
an untimed first pass of the same calls (cold_ns). With --in-flight N > 1
the calls go with async_op, up to N of them in the daemon at once (the
caller builds and sends the next while the daemon copies), as an engine
that loads or saves many blocks would; with 1, one after the other, each
returning once its copies are done (the split into client_ns and fuse_ns
is reported for that one only: overlapped calls have no such split). The
bench measures the ceiling itself right after (cuMemcpyAsync of blocks of
the same size).
"""

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from mooncake_fs import client as mc  # noqa: E402
from mooncake_fs import tensor as mt  # noqa: E402

BATCH = 64
# Blocks per call of the Mooncake API's pattern: all the blocks of a long
# request, as many as the direct path's client calls (kvPass in
# bench_kv.go) carry, each sent as ioctls of 64 keys, several at once.
MOONCAKE_BATCH = 1024


def batches(mount):
    """The daemon's batch figures (status of the mount's root) with its GPU
    copy count, or None."""
    if not mount:
        return None
    st = json.loads(os.getxattr(mount, "user.mooncake.status"))
    return dict(st["batches"], gpu_copies=st.get("transfer", {}).get("GPUCopies", 0))


def daemon_figures(out, before, after, wall_ns=0, ioctl_ns=0):
    """Add the daemon's work (and the part of it after the copies),
    transfer time, waits, page faults and GPU copies per key of the timed
    pass to out; with the pass's wall time and
    the time its calls spent in ioctls (one call at a time), also the
    caller's own time per key (client_ns) and the ioctls' time beyond the
    daemon's handler (fuse_ns: the kernel's FUSE path, the wake-ups of both
    sides)."""
    keys = (after or {}).get("keys", 0) - (before or {}).get("keys", 0)
    if keys <= 0:
        return
    transfer = after["transfer_ns"] - before["transfer_ns"]
    handler = after["handler_ns"] - before["handler_ns"]
    if wall_ns and ioctl_ns:
        out["client_ns"] = max(wall_ns - ioctl_ns, 0) // keys
        out["fuse_ns"] = max(ioctl_ns - handler, 0) // keys
    out["key_work_ns"] = max(handler - transfer, 0) // keys
    out["transfer_ns"] = transfer // keys
    out["key_cpu_ns"] = (after.get("cpu_ns", 0) - before.get("cpu_ns", 0)) // keys
    for name, field in (("key_lock_wait_ns", "lock_wait_ns"), ("key_sched_wait_ns", "sched_wait_ns"), ("key_gc_ns", "gc_cpu_ns"),
                        ("key_commit_ns", "commit_ns"), ("key_queue_ns", "queue_ns")):
        out[name] = max(after.get(field, 0) - before.get(field, 0), 0) // keys
    out["key_faults"] = max(after.get("minor_faults", 0) - before.get("minor_faults", 0), 0) / keys
    out["copies_per_key"] = (after["gpu_copies"] - before["gpu_copies"]) / keys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--op", choices=["put", "get"], required=True)
    ap.add_argument("--block", type=int, default=256 << 10)
    ap.add_argument("--bytes", type=int, default=256 << 20)
    ap.add_argument("--mount", help="the mount's root: report the daemon's work per key of the timed pass")
    ap.add_argument("--in-flight", type=int, default=1,
                    help="tensor calls in the daemon at once (async_op when more than 1)")
    ap.add_argument("--api", choices=["tensor", "mooncake"], default="tensor",
                    help="mooncake: the vLLM pattern through MooncakeDistributedStore (--dir's name the tenant)")
    a = ap.parse_args()
    if a.api == "mooncake":
        return mooncake_api(a)
    n = max(a.bytes // a.block, BATCH)
    elems = a.block // 4
    # Separate allocations, as an engine's per-request blocks are.
    ts = [torch.randn(elems, device="cuda") for _ in range(n)]
    paths = [os.path.join(a.dir, f"b{i:06d}") for i in range(n)]
    torch.cuda.synchronize()

    def calls(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        if a.in_flight <= 1:
            for i in range(0, n, BATCH):
                fn(i, min(i + BATCH, n))
        else:
            works = collections.deque()
            for i in range(0, n, BATCH):
                if len(works) == a.in_flight:
                    works.popleft().wait()
                works.append(fn(i, min(i + BATCH, n), async_op=True))
            while works:
                works.popleft().wait()
        torch.cuda.synchronize()
        return time.perf_counter_ns() - t0

    # The first pass over fresh allocations also opens their IPC handles in
    # the daemon (once per caching-allocator segment and process, about
    # 0.1-0.3 ms each): reported as cold_ns; the timed pass is an engine's
    # steady state, blocks it reuses.
    try:
        if a.op == "put":
            put = lambda i, j, **kw: mt.batch_put_tensor(paths[i:j], ts[i:j], **kw)  # noqa: E731
            cold_ns = calls(put)
            before = batches(a.mount)
            in_ioctl = mc.ioctl_clock.ns
            mc_ns = calls(put)
            in_ioctl = mc.ioctl_clock.ns - in_ioctl
            after = batches(a.mount)
        else:
            for i in range(0, n, BATCH):
                mt.batch_put_tensor(paths[i:i + BATCH], ts[i:i + BATCH])
            outs = [torch.empty_like(t) for t in ts]
            get = lambda i, j, **kw: mt.batch_get_tensor(paths[i:j], out=outs[i:j], **kw)  # noqa: E731
            cold_ns = calls(get)
            for o in outs:
                o.zero_()
            before = batches(a.mount)
            in_ioctl = mc.ioctl_clock.ns
            mc_ns = calls(get)
            in_ioctl = mc.ioctl_clock.ns - in_ioctl
            after = batches(a.mount)
            for o, t in zip(outs, ts):
                if not torch.equal(o, t):
                    raise SystemExit("mooncake-fs returned a different tensor")
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    out = {"bytes": n * a.block, "keys": n, "mooncake_ns": mc_ns, "cold_ns": cold_ns}
    daemon_figures(out, before, after, mc_ns if a.in_flight <= 1 else 0, in_ioctl)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


def mooncake_api(a):
    """vLLM's pattern through Mooncake's API: one GPU KV tensor registered
    once, MOONCAKE_BATCH blocks per batch_put_from_multi_buffers /
    batch_get_into_multi_buffers call, timed after an untimed warm-up of
    256 other keys."""
    os.environ["MOONCAKE_FS_MOUNT"] = os.path.dirname(os.path.abspath(a.dir))
    from mooncake_fs.mooncake_store import MooncakeDistributedStore

    n = max(a.bytes // a.block, BATCH)
    kv = torch.randint(0, 255, (n * a.block,), dtype=torch.uint8, device="cuda")
    s = MooncakeDistributedStore()
    rc = s.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                  "tenant_id": os.path.basename(os.path.abspath(a.dir))})
    if rc != 0 or s.register_buffer(kv.data_ptr(), kv.numel()) != 0:
        raise SystemExit(f"setup/register: {rc}")
    keys = [f"model@tp0@{i:016x}" for i in range(n)]
    addrs = [[kv.data_ptr() + i * a.block] for i in range(n)]
    sizes = [[a.block]] * n
    torch.cuda.synchronize()

    def calls(fn):
        t0 = time.perf_counter_ns()
        for i in range(0, n, MOONCAKE_BATCH):
            res = fn(keys[i:i + MOONCAKE_BATCH], addrs[i:i + MOONCAKE_BATCH], sizes[i:i + MOONCAKE_BATCH])
            if any(r < 0 for r in res):
                raise SystemExit(f"mooncake call failed: {res}")
        torch.cuda.synchronize()
        return time.perf_counter_ns() - t0

    want = kv.clone()
    try:
        # An untimed warm-up under other keys, removed after: the client's
        # threads start and its code paths run once (a process's first call
        # took about a third longer on the VM), as in a serving engine's later
        # calls.
        warm = [f"warm@{i:016x}" for i in range(min(n, 4 * BATCH))]
        if any(r < 0 for r in s.batch_put_from_multi_buffers(warm, addrs[:len(warm)], sizes[:len(warm)])) or \
                any(r < 0 for r in s.batch_get_into_multi_buffers(warm, addrs[:len(warm)], sizes[:len(warm)])) or \
                any(r < 0 for r in s.batch_remove(warm)):
            raise SystemExit("mooncake warm-up failed")
        torch.cuda.synchronize()
        if a.op == "put":
            before = batches(a.mount)
            mc_ns = calls(s.batch_put_from_multi_buffers)
            after = batches(a.mount)
        else:
            calls(s.batch_put_from_multi_buffers)
            kv.zero_()
            before = batches(a.mount)
            mc_ns = calls(s.batch_get_into_multi_buffers)
            after = batches(a.mount)
            if not torch.equal(kv, want):
                raise SystemExit("mooncake-fs returned other bytes")
    finally:
        s.remove_all(force=True)
        s.close()
    out = {"bytes": n * a.block, "keys": n, "mooncake_ns": mc_ns}
    daemon_figures(out, before, after)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
