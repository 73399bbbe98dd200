"""Time one CUDA tensor through mooncake-fs against safetensors on /dev/shm.

Run by `mooncake-fs bench` (cases safetensors-shm-save / -load) as a worker:
    python3 tensor_bench.py --dir DIR --op save|load --size BYTES
prints one JSON object: bytes, mooncake_ns, shm_ns (best of --reps each).
save: put_tensor into DIR vs safetensors.torch.save_file to /dev/shm;
load: get_tensor onto the GPU vs safetensors.torch.load_file(device="cuda").
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import mooncake_fs as mc  # noqa: E402


def best(reps, fn):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter_ns() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--op", choices=["save", "load"], required=True)
    ap.add_argument("--size", type=int, default=1 << 30)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    t = torch.randn(a.size // 4, device="cuda")
    path = os.path.join(a.dir, "tensor-bench")
    shm = "/dev/shm/mooncake-tensor-bench.safetensors"
    try:
        if a.op == "save":
            mc_ns = best(a.reps, lambda: mc.put_tensor(path, t))
            shm_ns = best(a.reps, lambda: save_file({"t": t}, shm))
        else:
            mc.put_tensor(path, t)
            save_file({"t": t}, shm)
            mc_ns = best(a.reps, lambda: mc.get_tensor(path, device="cuda"))
            shm_ns = best(a.reps, lambda: load_file(shm, device="cuda"))
            if not torch.equal(mc.get_tensor(path, device="cuda"), t):
                raise SystemExit("mooncake-fs returned a different tensor")
    finally:
        for p in (path, shm):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
    print(json.dumps({"bytes": t.numel() * 4, "mooncake_ns": mc_ns, "shm_ns": shm_ns}))


if __name__ == "__main__":
    main()
