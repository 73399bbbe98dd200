#!/usr/bin/env bash
# Runs on the GPU host, from the repository root: the bench CASES of two
# daemon builds taken in turn, ROUNDS times (default 2), so that the
# host's drift between runs falls on both alike:
#
#	bash tests/gpu/ab.sh OLD_BINARY NEW_BINARY [BENCH_ARGS...]
#
# e.g. `CASES=kv-put-gpu-16KiB bash tests/gpu/ab.sh .gpu/old .gpu/new
# --in-flight 1`. OLD_ENV and NEW_ENV add environment to each side's run
# (its daemon inherits it), so one build can be its own baseline:
# `NEW_ENV=GOMAXPROCS=8 bash tests/gpu/ab.sh .gpu/b .gpu/b`. Every JSON
# line gains "build":"old" or "new" and goes to $OUT/ab.json.
set -u -o pipefail
OUT=${OUT:-/tmp}
old=$1 new=$2
shift 2
for _ in $(seq 1 "${ROUNDS:-2}"); do
	for b in old new; do
		bin=$old envs=${OLD_ENV:-}
		[ $b = new ] && bin=$new envs=${NEW_ENV:-}
		# shellcheck disable=SC2086 # envs is a list of NAME=VALUE
		timeout "${CASE_TIMEOUT:-120}" env $envs "$bin" bench --json --keep-going --reps "${REPS:-3}" --case "${CASES:-kv-put-gpu-16KiB,kv-put-gpu-64KiB}" "$@" 2>&1 |
			grep '^{' | sed "s/^{/{\"build\":\"$b\",/" | tee -a "$OUT/ab.json" | cut -c1-300
	done
done
