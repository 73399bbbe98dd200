package store

import (
	"runtime"
	"sync"
	"testing"
	"time"
)

// TestSpinLocksExclude: writers through lockSpin (as the index's swaps
// take it) exclude each other and readers through rlockSpin, which
// never see a write half done; a holder that keeps the lock past spinFor
// sends the others to the blocking path, which still gets it once it is
// let go. With one P for the runtime (no polling) the same holds.
func TestSpinLocksExclude(t *testing.T) {
	prevMin := minPollCPUs.Swap(2) // poll here too, whatever this machine has
	t.Cleanup(func() { minPollCPUs.Store(prevMin); pollCPUs.at.Store(0) })
	for _, procs := range []int{0, 1} {
		if procs > 0 {
			prev := runtime.GOMAXPROCS(procs)
			t.Cleanup(func() { runtime.GOMAXPROCS(prev) })
		}
		pollCPUs.at.Store(0) // read the Ps again
		if procs == 1 && mayPoll() {
			t.Fatal("polls with one P")
		}
		var rw sync.RWMutex
		var mu sync.Mutex
		var a, b, c int
		const writers, readers, rounds = 4, 4, 500
		var wg sync.WaitGroup
		for range writers {
			wg.Go(func() {
				for i := range rounds {
					lockSpin(&rw)
					a++
					if i%50 == 0 {
						time.Sleep(2 * spinFor) // past the polling
					} else {
						runtime.Gosched() // others poll meanwhile
					}
					b++
					rw.Unlock()
					mutexSpin(&mu)
					c++
					mu.Unlock()
				}
			})
		}
		bad := make(chan [2]int, 1)
		for range readers {
			wg.Go(func() {
				for range rounds {
					rlockSpin(&rw)
					if a != b {
						select {
						case bad <- [2]int{a, b}:
						default:
						}
					}
					rw.RUnlock()
				}
			})
		}
		wg.Wait()
		select {
		case v := <-bad:
			t.Fatalf("GOMAXPROCS %d: a reader saw a write half done: %d != %d", runtime.GOMAXPROCS(0), v[0], v[1])
		default:
		}
		if want := writers * rounds; a != want || b != want || c != want {
			t.Fatalf("GOMAXPROCS %d: counts %d %d %d, want %d each", runtime.GOMAXPROCS(0), a, b, c, want)
		}
	}
}

// TestLockPollCounted: a taker that finds a lock held polls it for
// spinFor and then parks; LockPollNs counts the polling, all of it.
func TestLockPollCounted(t *testing.T) {
	prevMin := minPollCPUs.Swap(2)
	t.Cleanup(func() { minPollCPUs.Store(prevMin); pollCPUs.at.Store(0) })
	if runtime.GOMAXPROCS(0) < 2 {
		t.Skip("one P: locks are not polled")
	}
	pollCPUs.at.Store(0)
	if !mayPoll() {
		t.Skip("this process may run on one CPU: locks are not polled")
	}
	var mu sync.Mutex
	mu.Lock()
	before := LockPollNs()
	done := make(chan struct{})
	go func() {
		mutexSpin(&mu)
		mu.Unlock()
		close(done)
	}()
	// Held until the taker has polled it through: its polling is counted
	// once it gives up and parks.
	deadline := time.Now().Add(10 * time.Second)
	for LockPollNs()-before < uint64(spinFor) {
		if time.Now().After(deadline) {
			mu.Unlock()
			t.Fatalf("a taker of a held lock polled %d ns in 10 s, want at least %d", LockPollNs()-before, spinFor)
		}
		time.Sleep(time.Millisecond)
	}
	mu.Unlock()
	<-done
}
