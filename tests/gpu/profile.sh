#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with mooncake-fs,
# gpucheck and kvprofile built on the development machine in .gpu/ (see
# check.sh for the build; add go build -o .gpu/kvprofile
# ./tests/internal/kvprofile): gpucheck once, then CPU profiles of a
# daemon taking batch puts of GPU blocks (kvprofile: 1 MiB blocks at 1 and
# 4 calls in flight, 16 KiB at 4, a fresh daemon each, profiles in
# $OUT/p1m and $OUT/p16k), then the put bench rows (CASES overrides them).
# Read a profile here with go tool pprof .gpu/mooncake-fs FILE.
set -u
OUT=${OUT:-/tmp}
BIN=.gpu/mooncake-fs
MNT=/tmp/mcgpu
mkdir -p $MNT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; uname -r
up() {
	$BIN mount --size 12GiB --metrics 127.0.0.1:9311 $MNT > $OUT/daemon-$1.log 2>&1 &
	for _ in $(seq 1 300); do grep -q "^READY" $OUT/daemon-$1.log && break; sleep 0.2; done
}
down() { kill -TERM %1; wait; }
up 1
mkdir -p $OUT/p1m $OUT/p16k $MNT/gpucheck
.gpu/gpucheck $MNT/gpucheck 2>&1 | tail -3
rm -rf $MNT/gpucheck
# kvprofile reads the daemon's figures from the mount's root: its
# directory argument must be the root.
.gpu/kvprofile -block 1048576 -keep 8 -metrics 127.0.0.1:9311 -out $OUT/p1m $MNT 1:3 4:3 2>&1 | tail -5
$BIN status --json $MNT > $OUT/status1.json
down
up 2
.gpu/kvprofile -block 16384 -keep 8 -metrics 127.0.0.1:9311 -out $OUT/p16k $MNT 4:3 2>&1 | tail -5
down
rm -f $OUT/p*/trace*
timeout 280 $BIN bench --json --keep-going --case "${CASES:-kv-put-gpu-16KiB,kv-put-gpu-64KiB,kv-put-gpu-1MiB,kv-put-tensor-256KiB,kv-get-tensor-256KiB}" 2>&1 | grep -v '"level"' | tee $OUT/bench.json
