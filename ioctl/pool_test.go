package ioctl

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestPoolOptionsValidate(t *testing.T) {
	if err := (PoolOptions{}).Validate(); err != nil {
		t.Errorf("zero options: %v", err)
	}
	if err := DefaultPoolOptions().Validate(); err != nil {
		t.Errorf("defaults: %v", err)
	}
	err := PoolOptions{Exhausted: 7, MaxWait: -time.Second}.Validate()
	if err == nil {
		t.Fatal("bad options accepted")
	}
	for _, want := range []string{"Exhausted", "MaxWait"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%v does not mention %s", err, want)
		}
	}
	if err := (PoolOptions{MaxWait: time.Second}).Validate(); err == nil {
		t.Error("MaxWait with the fail policy accepted")
	}
}

// TestSlotsFail: with the fail policy a full pool answers
// ErrPoolExhausted at once, and a Return makes room again.
func TestSlotsFail(t *testing.T) {
	s := newSlots(2)
	ctx := context.Background()
	a, ga, err := s.take(ctx, PoolOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := s.take(ctx, PoolOptions{})
	if err != nil || a == b {
		t.Fatalf("second take: %d %v", b, err)
	}
	t0 := time.Now()
	if _, _, err := s.take(ctx, PoolOptions{}); !errors.Is(err, ErrPoolExhausted) {
		t.Fatalf("take of a full pool: %v", err)
	}
	if d := time.Since(t0); d > time.Second {
		t.Errorf("fail policy waited %v", d)
	}
	if err := s.give(a, ga); err != nil {
		t.Fatal(err)
	}
	c, _, err := s.take(ctx, PoolOptions{})
	if err != nil || c != a {
		t.Fatalf("take after return: %d, %v (want slot %d)", c, err, a)
	}
	st := s.stats()
	if st.Leases != 3 || st.Returns != 1 || st.Exhausted != 1 || st.Leased != 2 || st.Waits != 0 {
		t.Errorf("stats %+v", st)
	}
}

// TestSlotsWait: with the wait policy a full pool waits for a Return, and
// gives up at the context's deadline or at MaxWait, whichever is first.
func TestSlotsWait(t *testing.T) {
	wait := PoolOptions{Exhausted: WaitWhenExhausted}
	s := newSlots(1)
	i, g, err := s.take(context.Background(), wait)
	if err != nil {
		t.Fatal(err)
	}
	// Deadline from the context.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, _, err := s.take(ctx, wait); !errors.Is(err, ErrPoolExhausted) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("take past deadline: %v", err)
	}
	// Deadline from MaxWait.
	t0 := time.Now()
	if _, _, err := s.take(context.Background(), PoolOptions{Exhausted: WaitWhenExhausted, MaxWait: 20 * time.Millisecond}); !errors.Is(err, ErrPoolExhausted) {
		t.Fatalf("take past MaxWait: %v", err)
	}
	if d := time.Since(t0); d < 20*time.Millisecond {
		t.Errorf("gave up after %v, before MaxWait", d)
	}
	// A Return wakes a waiter.
	got := make(chan error, 1)
	go func() {
		_, _, err := s.take(context.Background(), wait)
		got <- err
	}()
	time.Sleep(10 * time.Millisecond) // let it block (it works either way)
	if err := s.give(i, g); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("waiter not woken by Return")
	}
	if st := s.stats(); st.Exhausted != 2 || st.Leases != 2 {
		t.Errorf("stats %+v", st)
	}
}

// TestSlotsConcurrent: many goroutines lease and return; no slot is ever
// held twice at once.
func TestSlotsConcurrent(t *testing.T) {
	const n, workers, rounds = 4, 16, 200
	s := newSlots(n)
	var mu sync.Mutex
	held := make([]bool, n)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range rounds {
				i, g, err := s.take(context.Background(), PoolOptions{Exhausted: WaitWhenExhausted, MaxWait: 10 * time.Second})
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if held[i] {
					t.Errorf("slot %d leased twice", i)
				}
				held[i] = true
				mu.Unlock()
				mu.Lock()
				held[i] = false
				mu.Unlock()
				if err := s.give(i, g); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if st := s.stats(); st.Leased != 0 || st.Leases != workers*rounds || st.Returns != workers*rounds {
		t.Errorf("stats %+v", st)
	}
}

// TestSlotsClose: close refuses while leases are out, then take fails.
func TestSlotsClose(t *testing.T) {
	s := newSlots(2)
	i, g, _ := s.take(context.Background(), PoolOptions{})
	if err := s.close(); !errors.Is(err, ErrPoolBusy) {
		t.Fatalf("close with a lease out: %v", err)
	}
	if err := s.give(i, g); err != nil {
		t.Fatal(err)
	}
	if err := s.close(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.take(context.Background(), PoolOptions{}); !errors.Is(err, ErrPoolClosed) {
		t.Fatalf("take after close: %v", err)
	}
	if err := s.close(); !errors.Is(err, ErrPoolClosed) {
		t.Fatalf("second close: %v", err)
	}
}

// doubleReturn leases slot 0, returns it, leases it again (a new
// generation) and returns the first lease a second time.
func doubleReturn(t *testing.T, s *slots) error {
	t.Helper()
	i, g, err := s.take(context.Background(), PoolOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.give(i, g); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.take(context.Background(), PoolOptions{}); err != nil {
		t.Fatal(err)
	}
	return s.give(i, g)
}

// TestNewPoolNotMooncake: a pool on a file of another file system fails
// at its one registration and leaves nothing mapped.
func TestNewPoolNotMooncake(t *testing.T) {
	f, err := Open(filepath.Join(t.TempDir(), "f"), os.O_RDWR|os.O_CREATE)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	p, err := NewPool(f, 4096, 4, PoolOptions{})
	if !errors.Is(err, unix.ENOTTY) || p != nil {
		t.Fatalf("NewPool: %v, %v", p, err)
	}
	if _, err := NewPool(f, 0, -1, PoolOptions{Exhausted: 9}); err == nil ||
		!strings.Contains(err.Error(), "slot size") || !strings.Contains(err.Error(), "count") || !strings.Contains(err.Error(), "Exhausted") {
		t.Errorf("bad arguments: %v", err)
	}
}
