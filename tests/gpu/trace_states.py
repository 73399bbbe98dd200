#!/usr/bin/env python3
"""Where a daemon's goroutines spent their time, by state and by where
they entered it, from a Go runtime trace (check.sh's TRACE=CASE, or
`curl .../debug/pprof/trace?seconds=1` of a daemon run with --metrics):

    gunzip trace.bin.gz
    go tool trace -d=parsed trace.bin > trace.txt
    python3 tests/gpu/trace_states.py trace.txt [FRAME]

Each state a goroutine was in (running, runnable, waiting, in a system
call or cgo) is charged to the stack with which it left running, when
that stack passes through FRAME (default: the data-path ioctls,
fs.(*node).ioctlFixed). "Runnable from Waiting/sync" is the time from a
lock's release to the waiter running again: the scheduler's wake-up.
"""
import collections
import re
import sys

TRANSITION = re.compile(
    r'^M=\S+ P=\S+ G=\S+ StateTransition Time=(\d+) GoID=(\d+) (\w+)->(\w+) Reason="([^"]*)"')


def transition_stack(lines, i):
    """The frames of the TransitionStack block after line i."""
    frames, j = [], i + 1
    if j < len(lines) and lines[j].startswith("TransitionStack="):
        j += 1
        while j < len(lines) and lines[j].startswith("\t"):
            if not lines[j].startswith("\t\t"):
                frames.append(lines[j].strip().split(" @ ")[0])
            j += 1
    return frames


def short(frames):
    keep = [f for f in frames if "mooncake-fs/" in f or f.startswith(("runtime.", "sync."))][:7]
    return " < ".join(f.replace("github.com/mooncake-fs/mooncake-fs/", "") for f in keep)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    frame = sys.argv[2] if len(sys.argv) > 2 else "fs.(*node).ioctlFixed"
    lines = open(sys.argv[1]).read().split("\n")
    state = {}  # goroutine -> (state, since, stack or None, how it got there)
    total, count = collections.Counter(), collections.Counter()
    for i, line in enumerate(lines):
        m = TRANSITION.match(line)
        if not m:
            continue
        t, g, frm, to, reason = int(m.group(1)), m.group(2), m.group(3), m.group(4), m.group(5)
        prev = state.get(g)
        if prev and prev[2] is not None:
            key = (prev[0], prev[3], prev[2])
            total[key] += t - prev[1]
            count[key] += 1
        if frm == "Running":
            frames = transition_stack(lines, i)
            stack = short(frames) if any(frame in f for f in frames) else None
            state[g] = (to, t, stack, reason)
        elif to == "Running":
            state[g] = ("Running", t, prev[2] if prev else None, "after " + (prev[0] if prev else "?"))
        else:
            how = "from " + frm + ("/" + prev[3] if prev else "")
            state[g] = (to, t, prev[2] if prev else None, how)
    by_state = collections.Counter()
    for (st, _, _), v in total.items():
        by_state[st] += v
    print("ms by state:", {k: round(v / 1e6, 2) for k, v in by_state.items()})
    for key, v in total.most_common(40):
        st, how, stack = key
        print("%8.2f ms %7d  %-9s %-28s %s" % (v / 1e6, count[key], st, how[:28], stack[:230]))


if __name__ == "__main__":
    main()
