package transfer

import (
	"testing"
	"time"
)

// TestGPUPace checks the waits' sleeps: none before a rate is known or
// below gpuSleepBytes, gpuSleepShare of the time at the best rate seen
// less the time already gone, a best rate that only rises, and only from
// flights that began with no other in progress.
func TestGPUPace(t *testing.T) {
	var p gpuPace
	if d := p.sleep(64<<20, time.Now()); d != 0 {
		t.Fatalf("sleep %v with no rate known", d)
	}
	// flight runs one flight of bytes, queued ago, alone or after another
	// flight that was in progress before it and ends during it (before).
	flight := func(bytes int, ago time.Duration, before, ok bool) {
		t.Helper()
		if before {
			p.begin()
		}
		alone := p.begin()
		if alone == before {
			t.Fatalf("flight alone %v with another in progress %v", alone, before)
		}
		if before {
			p.end(false, true, bytes, time.Now())
		}
		p.end(alone, ok, bytes, time.Now().Add(-ago))
	}
	// 8 MiB in 1 ms (and the time the call took): 8388 B/us at most.
	t0 := time.Now()
	flight(8<<20, time.Millisecond, false, true)
	lag := time.Since(t0)
	if got, least := p.best.Load(), uint64(float64(8<<20)/float64((time.Millisecond+lag+time.Microsecond).Microseconds())); got < least || got > 8<<20/1000 {
		t.Fatalf("best %d B/us after 8 MiB in 1 ms (+%v)", got, lag)
	}
	best := p.best.Load()
	// Too little to count, slower, failed, or faster but behind another:
	// the best stays.
	flight(gpuSleepBytes-1, time.Microsecond, false, true)
	flight(8<<20, 10*time.Millisecond, false, true)
	flight(64<<20, time.Millisecond, false, false)
	flight(64<<20, time.Millisecond, true, true)
	if p.best.Load() != best {
		t.Fatalf("best moved to %d from %d", p.best.Load(), best)
	}
	if v := p.active.Load(); v != 0 {
		t.Fatalf("%d flights in progress after all ended", v)
	}
	if d := p.sleep(gpuSleepBytes-1, time.Now()); d != 0 {
		t.Fatalf("sleep %v below gpuSleepBytes", d)
	}
	// 16 MiB queued just now: 2 ms at the best rate, of which it sleeps
	// gpuSleepShare.
	want := time.Duration(float64(16<<20) / float64(best) * gpuSleepShare * float64(time.Microsecond))
	t0 = time.Now()
	d := p.sleep(16<<20, t0)
	if lag := time.Since(t0); d > want || d < want-lag {
		t.Fatalf("sleep %v for 16 MiB queued now, want %v less at most %v", d, want, lag)
	}
	// Queued long ago: no sleep left.
	if d := p.sleep(16<<20, time.Now().Add(-time.Second)); d > 0 {
		t.Fatalf("sleep %v for 16 MiB queued a second ago", d)
	}
	// Faster and alone: the best rises.
	flight(16<<20, time.Millisecond, false, true)
	if p.best.Load() <= best {
		t.Fatalf("best %d after a faster flight, was %d", p.best.Load(), best)
	}
}
