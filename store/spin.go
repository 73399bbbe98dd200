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
// spinFor, yielding the processor between tries, and only then waited
// on, on machines with CPUs to spare (mayPoll).
//
// A later build polled without yielding and queued swaps on a lock of
// their own before taking the index's lock outright; on the H100 it did
// half as well at four batch puts of 16 KiB GPU blocks in flight
// (2026-12-06: 4.9 us of daemon work a key and 540k keys a second,
// against 2.3-2.5 us and 910-970k for this scheme in two runs on the
// same kind of host; one call at a time both did 2.0). Its trace showed
// the outright lock at fault: a swap waiting in sync.RWMutex.Lock parks
// while readers are inside and turns away every new reader meanwhile;
// swaps parked there 1,200 times a second, each woken 46 us after the
// last reader let go, and the readers turned away polled and parked in
// turn. A polled TryLock turns no reader away while it waits. Yielding
// lets a holder queued on the poller's processor finish; a yielded
// goroutine may wait for a free processor, but only when none is free,
// when a parked one would wait as long.

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

// lockSpin locks mu for writing.
func lockSpin(mu *sync.RWMutex) { pollThen(mu.TryLock, mu.Lock) }

// rlockSpin locks mu for reading.
func rlockSpin(mu *sync.RWMutex) { pollThen(mu.TryRLock, mu.RLock) }

// mutexSpin locks mu.
func mutexSpin(mu *sync.Mutex) { pollThen(mu.TryLock, mu.Lock) }

// pollTriesPerClock is how many tries pollThen makes between readings of
// the clock: on the H100 host a reading after every try was 16% of the
// daemon's CPU at four batch puts in flight (2026-12-06, a build that
// polled without yielding); a yield and a try take longer than a
// reading, so a few tries between readings overshoot spinFor little.
const pollTriesPerClock = 8

// pollThen takes a lock through try, polling it for up to about spinFor
// where mayPoll, and else, or then, through wait.
func pollThen(try func() bool, wait func()) {
	if try() {
		return
	}
	if mayPoll() {
		start := time.Now()
		for time.Since(start) < spinFor {
			for range pollTriesPerClock {
				runtime.Gosched()
				if try() {
					lockPollNs.Add(uint64(time.Since(start)))
					return
				}
			}
		}
		lockPollNs.Add(uint64(time.Since(start)))
	}
	wait()
}

// lockPollNs is the time pollThen has polled contended locks, in all.
var lockPollNs atomic.Uint64

// LockPollNs returns the time the store's callers have spent polling its
// contended locks since the process started: CPU time (a poller yields
// its processor only to goroutines ready to run) that a handler's time
// counts as its own work, and that the runtime's lock waits, which count
// parked waiters, leave out.
func LockPollNs() uint64 { return lockPollNs.Load() }
