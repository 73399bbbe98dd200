#!/usr/bin/env bash
# Runs on the GPU host, from the repository root: two daemons (nodes a and
# b) sharing an etcd on loopback, and CUDA tensors moved between them with
# the Python helpers: a tensor put through a's mount into b's memory (GPU ->
# a's bounce buffers -> TCP -> b), read back into GPU memory through both
# mounts, bit-exact, plus the reverse. Needs .gpu/mooncake-fs (built with
# CGO_ENABLED=1) and an etcd binary (ETCD, default .gpu/etcd, else etcd on
# PATH). With RDMA=fake the daemons move remote bytes over the software
# NIC (--rdma-fake, which reaches GPU memory as a GPUDirect NIC would),
# and a tensor registered with its dma-buf must go GPU to remote segment
# and back with no local copy (rdma-direct). Output goes to stdout and
# $OUT. Exit status 0 when every check passed.
set -u -o pipefail
OUT=${OUT:-/tmp}
BIN=.gpu/mooncake-fs
ETCD=${ETCD:-.gpu/etcd}
[ -x "$ETCD" ] || ETCD=$(command -v etcd) || { echo "no etcd binary"; exit 2; }
W=$(mktemp -d)
cleanup() {
	kill -TERM $(jobs -p) 2>/dev/null
	wait 2>/dev/null
	for m in "$W"/mnt-*; do mountpoint -q "$m" 2>/dev/null && umount -l "$m"; done
	rm -rf "$W"
}
trap cleanup EXIT
"$ETCD" --data-dir "$W/etcd" --listen-client-urls http://127.0.0.1:23790 --advertise-client-urls http://127.0.0.1:23790 \
	--listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
	--initial-cluster default=http://127.0.0.1:23800 > "$OUT/etcd.log" 2>&1 &
head -c 32 /dev/urandom | base64 > "$W/token"
chmod 600 "$W/token"
port=7171
extra=()
if [ "${RDMA:-}" = fake ]; then
	mkdir -p "$W/fabric"
	extra=(--rdma-fake "$W/fabric")
fi
for n in a b; do
	mkdir -p "$W/mnt-$n"
	$BIN mount --etcd http://127.0.0.1:23790 --node $n --listen 127.0.0.1:$port --token-file "$W/token" \
		--size 3GiB "${extra[@]}" "$W/mnt-$n" > "$OUT/daemon-$n.log" 2>&1 &
	port=$((port + 1))
done
for n in a b; do
	for _ in $(seq 1 300); do grep -q "^READY" "$OUT/daemon-$n.log" && break; sleep 0.2; done
	grep -q "^READY" "$OUT/daemon-$n.log" || { echo "daemon $n did not start"; cat "$OUT/daemon-$n.log"; exit 1; }
done
PYTHONPATH=python python3 - "$W/mnt-a" "$W/mnt-b" "$BIN" "${RDMA:-}" <<'PY'
import json, os, subprocess, sys, time
import torch
import mooncake_fs as mc
from mooncake_fs import tensor as mt

a, b, binary, rdma = sys.argv[1:5]
ok = True
def check(what, cond):
    global ok
    print(("ok   " if cond else "FAIL ") + what)
    ok = ok and cond

for d, node in ((a, "b"), (b, "a")):
    os.makedirs(os.path.join(d, "on" + node), exist_ok=True)
    os.setxattr(os.path.join(d, "on" + node), "user.mooncake.placement", ("node:" + node).encode())

def rate(n, s):
    return "%.2f GB/s" % (n / s / 1e9)

for size_mib in (1, 64, 1024):
    n = size_mib << 20
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    for src, dst, node in ((a, b, "b"), (b, a, "a")):
        key = "on%s/t%d" % (node, size_mib)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mc.put_tensor(os.path.join(src, key), t)
        put_s = time.perf_counter() - t0
        loc = os.getxattr(os.path.join(dst, key), "user.mooncake.location").decode()
        check("%d MiB put through %s lands on node %s (%s)" % (size_mib, os.path.basename(src), node, loc.split(":")[0]),
              loc.startswith(node + ":"))
        for via in (src, dst):
            out = torch.empty_like(t)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            mc.get_tensor(os.path.join(via, key), out=out)
            torch.cuda.synchronize()
            get_s = time.perf_counter() - t0
            where = "remote" if via == src else "local"
            check("%d MiB on %s read into GPU memory through %s (%s, %s; put %s)" % (
                size_mib, node, os.path.basename(via), where, rate(n, get_s), rate(n, put_s)), torch.equal(out, t))
    # A partial get from the other node straight into a slice of GPU memory.
    out = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    got = mc.get_tensor_range(os.path.join(a, "onb/t%d" % size_mib), out, offset=n - 4096)
    check("%d MiB: last 4 KiB from b into GPU memory through a" % size_mib, got == 4096 and torch.equal(out, t[-4096:]))

def paths(mnt):
    st = json.loads(subprocess.run([binary, "status", "--json", mnt], capture_output=True, check=True).stdout)
    return st["transfer"]["Paths"], st.get("rdma", {})

if rdma == "fake":
    # A tensor registered with its dma-buf, put through a into b's memory
    # and read back into another registered tensor: the fake NIC reads and
    # writes the GPU's memory itself, nothing is staged.
    n = 64 << 20
    t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    back = torch.zeros(n, dtype=torch.uint8, device="cuda")
    before, st = paths(a)
    check("rdma on at a (%s)" % st.get("state"), st.get("state") == "on")
    key = os.path.join(a, "onb", "registered")
    torch.cuda.synchronize()
    with mc.File(key, "w") as f:
        rid, _ = mt.register_tensor(f, t)
        moved, _ = f.put_buf(rid, 0, n)
        f.unregister(rid)
    loc = os.getxattr(os.path.join(b, "onb", "registered"), "user.mooncake.location").decode()
    check("registered tensor put through a lands on b (%s)" % loc.split(":")[0], moved == n and loc.startswith("b:"))
    with mc.File(key) as f:
        rid, _ = mt.register_tensor(f, back)
        moved, _ = f.get_buf(rid, 0, n, 0)
        f.unregister(rid)
    torch.cuda.synchronize()
    check("read back from b into a registered tensor, bit-exact", moved == n and torch.equal(back, t))
    after, _ = paths(a)
    d0, d1 = before.get("rdma-direct", {}), after.get("rdma-direct", {})
    wr, rd = d1.get("written", 0) - d0.get("written", 0), d1.get("read", 0) - d0.get("read", 0)
    cp = d1.get("copied_written", 0) + d1.get("copied_read", 0) - d0.get("copied_written", 0) - d0.get("copied_read", 0)
    s0, s1 = before.get("rdma-staged", {}), after.get("rdma-staged", {})
    staged = s1.get("written", 0) + s1.get("read", 0) - s0.get("written", 0) - s0.get("read", 0)
    check("GPU bytes went NIC to GPU: rdma-direct %d B written, %d B read, %d copied; %d B staged" % (wr, rd, cp, staged),
          wr >= n and rd >= n and cp == 0 and staged == 0)
sys.exit(0 if ok else 1)
PY
rc=$?
for n in a b; do $BIN status "$W/mnt-$n" | sed -n '/^cluster/,$p'; done
grep -i -E "warn|error" "$OUT"/daemon-*.log | head -20
exit $rc
