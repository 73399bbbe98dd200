#!/usr/bin/env bash
# The PyTorch helpers' GPU tests, on the GPU host. Run as root from the
# repository root, with bin/mooncake-fs built on the development machine
# and carried along:
#
#   bash tests/gpu/run.sh
#
# Mounts a store at /tmp/mcgpu, runs python/tests/test_tensor_gpu.py
# against it (CPU and CUDA tensors), runs the cuda-put/cuda-get and
# safetensors-shm-save/-load bench cases where the binary has them, shows
# the daemon's log tail and status, and unmounts (SIGTERM). Logs and
# results also go to $OUT when it is set. Exit status: 0 when the tests
# passed (and ran with a GPU), else non-zero.
#
# Environment: PYTHON (default python3), MNT (/tmp/mcgpu), SIZE (4GiB),
# TEST_TIMEOUT (420 s), BENCH_TIMEOUT (300 s), NO_BENCH=1 to skip the
# bench, DAEMON_CPUS=LIST to run the bench's daemon with --cpus LIST,
# ALLOW_NO_GPU=1 to pass without torch.cuda (everything skips).
set -u -o pipefail

BIN=bin/mooncake-fs
MNT=${MNT:-/tmp/mcgpu}
SIZE=${SIZE:-4GiB}
LOG=/tmp/mc.log
PY=${PYTHON:-python3}
OUTDIR=${OUT:-}

say() { printf '\n== %s\n' "$*"; }
save() { [ -n "$OUTDIR" ] && cp -f "$@" "$OUTDIR"/ 2>/dev/null; true; }

if [ ! -x "$BIN" ]; then
	echo "run.sh: no executable $BIN (build it first: go build -o bin/mooncake-fs ./cmd/mooncake-fs)" >&2
	exit 2
fi
if [ "$(id -u)" != 0 ]; then
	echo "run.sh: must run as root (the daemon mounts with mount(2))" >&2
	exit 2
fi

say "host"
nvidia-smi --query-gpu=name,uuid,pci.bus_id,driver_version,memory.total --format=csv,noheader 2>&1 || true
"$PY" - <<'EOF' 2>&1
import sys
print("python", sys.version.split()[0])
try:
    import torch
except ImportError as e:
    print("torch: not importable:", e)
else:
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)
try:
    import safetensors
    print("safetensors", safetensors.__version__)
except ImportError:
    print("safetensors: not installed")
EOF
have_gpu=0
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && have_gpu=1

# A mount left behind by an earlier run on a warm machine.
if mountpoint -q "$MNT" 2>/dev/null; then
	echo "unmounting a stale mount at $MNT"
	umount "$MNT" 2>/dev/null || umount -l "$MNT" || true
fi
mkdir -p "$MNT"

say "mount $SIZE at $MNT"
"$BIN" mount --size "$SIZE" "$MNT" > "$LOG" 2>&1 &
DAEMON=$!
cleanup() {
	if kill -0 "$DAEMON" 2>/dev/null; then
		kill -TERM "$DAEMON" 2>/dev/null
		for _ in $(seq 1 150); do kill -0 "$DAEMON" 2>/dev/null || break; sleep 0.2; done
		if kill -0 "$DAEMON" 2>/dev/null; then
			echo "daemon $DAEMON still running 30 s after SIGTERM" >&2
		fi
	fi
	if mountpoint -q "$MNT" 2>/dev/null; then
		echo "still mounted after the daemon exited: umount -l $MNT" >&2
		umount -l "$MNT" || true
	fi
}
trap cleanup EXIT
ready=0
for _ in $(seq 1 300); do # 60 s: pinning the segments takes a while
	if grep -q "^READY $MNT" "$LOG"; then ready=1; break; fi
	kill -0 "$DAEMON" 2>/dev/null || break
	sleep 0.2
done
if [ "$ready" != 1 ]; then
	echo "daemon not READY:" >&2
	cat "$LOG" >&2
	save "$LOG"
	exit 1
fi
grep -i -E "pin|cuda|gpu|warn" "$LOG" | head -20

say "python/tests/test_tensor_gpu.py"
PYTHONPATH=python MOONCAKE_MOUNT="$MNT" MOONCAKE_BIN="$BIN" PYTHONUNBUFFERED=1 \
	timeout --signal=INT --kill-after=30 "${TEST_TIMEOUT:-420}" \
	"$PY" -m unittest -v python/tests/test_tensor_gpu.py 2>&1 | tee /tmp/test_tensor_gpu.log
test_rc=$?
save /tmp/test_tensor_gpu.log
echo "tests: exit $test_rc"

bench_rc=0
if [ -z "${NO_BENCH:-}" ]; then
	say "bench"
	# Cases whose names start with these, as this binary lists them
	# (cuda-put-64MiB, ..., safetensors-shm-save, ...).
	all=$("$BIN" bench -h 2>&1 | sed -n 's/.*default all: //p' | tr -d ' ' | tr ',' '\n')
	cases=$(printf '%s\n' "$all" | grep -E '^(cuda-put|cuda-get|safetensors-shm-save|safetensors-shm-load)' | paste -sd, -)
	if [ -z "$cases" ]; then
		echo "no cuda-put/cuda-get/safetensors-shm-* cases in $BIN (it has: $(printf '%s ' $all))"
	else
		echo "cases: $cases"
		timeout --kill-after=30 "${BENCH_TIMEOUT:-300}" "$BIN" bench --json --keep-going --case "$cases" \
			${DAEMON_CPUS:+--daemon-cpus "$DAEMON_CPUS"} \
			2>&1 | tee /tmp/bench.json
		bench_rc=$?
		save /tmp/bench.json
		echo "bench: exit $bench_rc"
	fi
fi

say "daemon log (tail)"
tail -n 30 "$LOG"
say "status"
"$BIN" status --json "$MNT" | tee /tmp/status.json
echo
save "$LOG" /tmp/status.json

say "unmount"
cleanup
trap - EXIT
mountpoint -q "$MNT" 2>/dev/null && echo "still mounted: $MNT" || echo "unmounted $MNT"

if [ "$test_rc" != 0 ]; then
	exit "$test_rc"
fi
if [ "$have_gpu" != 1 ] && [ -z "${ALLOW_NO_GPU:-}" ]; then
	echo "run.sh: torch.cuda is not available here: the CUDA tests skipped" >&2
	exit 3
fi
exit "$bench_rc"
