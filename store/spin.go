package store

import (
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// The index's lock and Store.mu are held for microseconds (a swap of a
// batch's keys, a lookup), but a goroutine that parks on one waits for the
// scheduler to run it again once the holder lets go: on a virtual
// machine with idle CPUs that wake-up took 50 us on average (an H100
// trace of four batch puts in flight, 2026-12-05), ten times the
// lock's holding time, and calls that meet at a commit queued behind
// each other's wake-ups. So a contended lock is first polled, yielding
// the CPU between tries, for up to spinFor, and only then waited on, on
// machines with CPUs to spare (mayPoll).

// spinFor bounds the polling of a contended lock. A holder that keeps it
// longer (a large rename's swap) is waited for as before.
const spinFor = 40 * time.Microsecond

// minPollCPUs is the fewest CPUs on which a contended lock is polled: a
// poller keeps its CPU busy, and on a machine of two (where the daemon
// runs more Ps than CPUs) that is the CPU the holder needs to finish.
// (Atomic: a test lowers it.)
var minPollCPUs atomic.Int32

func init() { minPollCPUs.Store(4) }

// mayPoll is whether a contended lock is polled before its taker parks.
func mayPoll() bool {
	return runtime.NumCPU() >= int(minPollCPUs.Load()) && runtime.GOMAXPROCS(0) > 1
}

// lockSpin locks mu for writing.
func lockSpin(mu *sync.RWMutex) { pollThen(mu.TryLock, mu.Lock) }

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
			runtime.Gosched()
			if try() {
				return
			}
		}
	}
	wait()
}
