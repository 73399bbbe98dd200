#!/usr/bin/env bash
# Runs on the GPU host, from the repository root: mounts a store of
# SIZE (default 64GiB: 2 s of puts at 1M keys a second of 16 KiB take
# 32 GiB) with metrics, drives batch puts of GPU blocks into
# it with kvprofile in PHASES (default "1:2 4:2": one call in flight
# for 2 s, then four for 2 s) and leaves the daemon's CPU profile and
# runtime trace of each phase, its metrics and the lines kvprofile
# printed in $OUT/profile.tgz. Build here first (as check.sh says), and
#
#	go build -o .gpu/kvprofile ./tests/internal/kvprofile
#
# Read a phase with `go tool pprof -top -cum -focus ioctlFixed
# .gpu/mooncake-fs cpu-1-if4.prof` and tests/gpu/trace_states.py.
set -u -o pipefail
OUT=${OUT:-/tmp}
BIN=${BIN:-.gpu/mooncake-fs}
MNT=/tmp/mcprofile
R=$OUT/profile
mkdir -p $MNT $R
$BIN mount --size "${SIZE:-64GiB}" --metrics 127.0.0.1:9479 $MNT > $R/daemon.log 2>&1 &
for _ in $(seq 1 900); do grep -q "^READY" $R/daemon.log && break; sleep 0.2; done
grep -q "^READY" $R/daemon.log || { echo "daemon did not start"; cat $R/daemon.log; exit 1; }
rc=0
# shellcheck disable=SC2086 # PHASES is a list
timeout 120 .gpu/kvprofile -block "${BLOCK:-16384}" -metrics 127.0.0.1:9479 -out $R $MNT ${PHASES:-1:2 4:2} 2>&1 | tee $R/kvprofile.txt || rc=1
curl -s -o $R/metrics.txt http://127.0.0.1:9479/metrics
kill -TERM %1
wait
tar czf $OUT/profile.tgz -C $OUT profile && rm -rf $R
exit $rc
