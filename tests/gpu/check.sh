#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with the binaries built
# on the development machine in .gpu/ (mooncake-fs, gpucheck): mounts the
# store, runs the GPU checks (Go, then Python with torch where present),
# the cuda and KV bench cases (CASES overrides them; with DAEMON_CPUS,
# again with the daemon on those CPUs; with IN_FLIGHT_1=1, the GPU put and
# get cases again one call at a time; with TRACE=CASE, CASE once more with
# a 1 s runtime trace and a 3 s CPU profile of its daemon, trace.bin.gz
# and cpu.prof, for tests/gpu/trace_states.py), and unmounts. Output goes
# to stdout and $OUT. Build the binaries here with
#
#	export CGO_ENABLED=1 CGO_CFLAGS="-O2 -g -Wno-deprecated-declarations"
#	go build -o .gpu/mooncake-fs ./cmd/mooncake-fs
#	go build -o .gpu/gpucheck ./tests/internal/gpucheck
#
# (gzip them if the carried tree would pass 64 MiB; gunzip there first).
set -u -o pipefail
OUT=${OUT:-/tmp}
BIN=.gpu/mooncake-fs
MNT=/tmp/mcgpu
nvidia-smi --query-gpu=name,uuid,pci.bus_id,driver_version --format=csv,noheader
ls -l /dev/fuse || { echo "no /dev/fuse: cannot mount here"; exit 1; }
mkdir -p $MNT
$BIN mount --size 6GiB $MNT > $OUT/daemon.log 2>&1 &
for i in $(seq 1 300); do grep -q "^READY" $OUT/daemon.log && break; sleep 0.2; done
grep -q "^READY" $OUT/daemon.log || { echo "daemon did not start"; cat $OUT/daemon.log; exit 1; }
$BIN status $MNT
rc=0
mkdir -p $MNT/gpucheck && .gpu/gpucheck $MNT/gpucheck || rc=1
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null && [ -f python/tests/test_tensor_gpu.py ]; then
	PYTHONPATH=python MOONCAKE_MOUNT=$MNT MOONCAKE_FS_MOUNT=$MNT timeout 300 python3 -m unittest -v python/tests/test_tensor_gpu.py python/tests/test_store_gpu.py > $OUT/py.log 2>&1 || rc=1; tail -45 $OUT/py.log
fi
$BIN status --json $MNT > $OUT/status.json
kill -TERM %1; wait
KV=kv-put-gpu-16KiB,kv-get-gpu-16KiB,kv-put-gpu-64KiB,kv-get-gpu-64KiB,kv-put-gpu-256KiB,kv-get-gpu-256KiB
KV=$KV,kv-put-gpu-1MiB,kv-get-gpu-1MiB,kv-put-gpu-scattered-16KiB,kv-get-gpu-scattered-16KiB,kv-put-tensor-256KiB,kv-get-tensor-256KiB
KV=$KV,kv-mooncake-put-gpu-256KiB,kv-mooncake-get-gpu-256KiB
KV=$KV,kv-put-host-4KiB,kv-get-host-4KiB,kv-put-host-vm-4KiB,kv-get-host-vm-4KiB,op-put-4KiB,op-get-4KiB
CASES=${CASES:-cuda-put-256MiB,cuda-get-256MiB,$KV}
echo "== bench"
timeout ${BENCH_TIMEOUT:-400} $BIN bench --json --keep-going --case $CASES 2>&1 | tee $OUT/bench.json
if [ -n "${DAEMON_CPUS:-}" ]; then
	# The daemon on a few CPUs (mount --cpus): its threads stay warm between calls.
	echo "== bench, daemon on CPUs $DAEMON_CPUS"
	timeout ${BENCH_TIMEOUT:-400} $BIN bench --json --keep-going --daemon-cpus $DAEMON_CPUS --case $CASES 2>&1 | tee $OUT/bench-cpus.json
fi
if [ -n "${IN_FLIGHT_1:-}" ]; then
	echo "== bench, one call at a time"
	timeout ${BENCH_TIMEOUT:-400} $BIN bench --json --keep-going --in-flight 1 \
		--case kv-put-gpu-16KiB,kv-get-gpu-16KiB,kv-put-gpu-64KiB,kv-get-gpu-64KiB 2>&1 | tee $OUT/bench-inflight1.json
fi
if [ -n "${TRACE:-}" ]; then
	# Enough repetitions that the trace falls inside the timed passes.
	echo "== $TRACE traced"
	$BIN bench --json --keep-going --reps 150 --daemon-metrics 127.0.0.1:9477 --case "$TRACE" > $OUT/bench-traced.json 2>&1 &
	bp=$!
	for _ in $(seq 1 300); do curl -s -o /dev/null http://127.0.0.1:9477/metrics && break; sleep 0.1; done
	sleep 3
	curl -s -o $OUT/trace.bin 'http://127.0.0.1:9477/debug/pprof/trace?seconds=1' && gzip -f $OUT/trace.bin
	curl -s -o $OUT/cpu.prof 'http://127.0.0.1:9477/debug/pprof/profile?seconds=3'
	timeout 300 tail --pid=$bp -f /dev/null
	cat $OUT/bench-traced.json
fi
tail -5 $OUT/daemon.log
exit $rc
