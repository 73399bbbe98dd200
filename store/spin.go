package store

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// The index's lock and Store.mu are held for microseconds (a swap of a
// batch's keys, a lookup), but a goroutine that parks on one waits for the
// scheduler to run it again once the holder lets go: on a virtual
// machine with idle CPUs that wake-up took 50 us on average (an H100
// trace of four batch puts in flight, 2026-12-05), ten times the
// lock's holding time, and calls that meet at a commit queued behind
// each other's wake-ups. So a contended lock is first polled for up to
// spinFor, the poller keeping its processor, and only then waited on, on
// machines with CPUs to spare (mayPoll). The poller does not yield
// between tries: a goroutine that yields goes to the scheduler's global
// queue, where with every processor busy it waited for the next
// preemption tick (10 ms and more).

// spinFor bounds the polling of a contended lock. A holder that keeps it
// longer (a large rename's swap) is waited for as before.
const spinFor = 40 * time.Microsecond

// minPollCPUs is the fewest CPUs (and Ps) with which a contended lock is
// polled: a poller keeps its CPU busy, and on a machine of two (where the
// daemon runs more Ps than CPUs) that is the CPU the holder needs to
// finish. Never fewer than two.
// (Atomic: a test lowers it.)
var minPollCPUs atomic.Int32

func init() { minPollCPUs.Store(4) }

// pollCPUs is the CPUs this process may run on and its Ps, read at most
// once a second: mount --cpus narrows the affinity from inside the
// process after it started, which runtime.NumCPU does not see.
var pollCPUs struct {
	n  atomic.Int32
	at atomic.Int64 // time.Now().UnixNano() of the reading; 0: none yet
}

// mayPoll is whether a contended lock is polled before its taker parks.
func mayPoll() bool {
	now := time.Now().UnixNano()
	n := pollCPUs.n.Load()
	if at := pollCPUs.at.Load(); at == 0 || now-at > int64(time.Second) {
		n = int32(runtime.NumCPU())
		var set unix.CPUSet
		if unix.SchedGetaffinity(0, &set) == nil {
			n = int32(set.Count())
		}
		n = min(n, int32(runtime.GOMAXPROCS(0)))
		pollCPUs.n.Store(n)
		pollCPUs.at.Store(now)
	}
	return n >= max(2, minPollCPUs.Load())
}

// rlockSpin locks mu for reading.
func rlockSpin(mu *sync.RWMutex) { pollThen(mu.TryRLock, mu.RLock) }

// mutexSpin locks mu.
func mutexSpin(mu *sync.Mutex) { pollThen(mu.TryLock, mu.Lock) }

// pollThen takes a lock through try, polling it for up to spinFor where
// mayPoll, and else, or then, through wait.
func pollThen(try func() bool, wait func()) {
	if try() {
		return
	}
	if mayPoll() {
		for start := time.Now(); time.Since(start) < spinFor; {
			if try() {
				return
			}
		}
	}
	wait()
}
