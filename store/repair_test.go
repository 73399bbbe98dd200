package store_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// heldSwaps is an index whose next compare-and-swap, once armed, is
// applied at once but returns only when the test lets it: its caller's
// bookkeeping comes after everything the test does meanwhile.
type heldSwaps struct {
	store.Index
	armed   *atomic.Bool
	swapped chan struct{}
	release chan struct{}
}

func (x heldSwaps) CompareAndSwap(ctx context.Context, swaps ...store.Swap) (uint64, error) {
	rev, err := x.Index.CompareAndSwap(ctx, swaps...)
	if x.armed.CompareAndSwap(true, false) {
		close(x.swapped)
		<-x.release
	}
	return rev, err
}

// TestRepairRacingRetirement: a repair copies a file to this node; the
// file is deleted on another node after the repair's swap and before the
// repair recorded its copy. The copy is freed like any retired body, not
// leaked.
func TestRepairRacingRetirement(t *testing.T) {
	ctx := context.Background()
	idx := store.NewEmbedded()
	t.Cleanup(func() { _ = idx.Close() })
	h := heldSwaps{Index: idx, armed: new(atomic.Bool), swapped: make(chan struct{}), release: make(chan struct{})}
	a, b := newCluster(t, true, withIndex(h))
	b.put(t, "f", pattern(3, 200<<10))
	if _, err := b.Update(ctx, "f", 0, func(o *store.Object) error {
		o.Xattrs = map[string][]byte{store.XattrReplicas: []byte("2")}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	a.sync(t)
	h.armed.Store(true)
	done := make(chan error, 1)
	go func() {
		rep, err := a.Reconcile(ctx, func(string) bool { return true })
		if err == nil && rep.Repaired != 1 {
			t.Errorf("repair report %+v, want one replica added", rep)
		}
		done <- err
	}()
	<-h.swapped
	if a.used() == 0 {
		t.Fatal("the repair made no copy on a")
	}
	if err := b.Delete(ctx, "f", 0); err != nil {
		t.Fatal(err)
	}
	// a's follow loop sees the delete while the repair has not returned.
	marker := b.put(t, "marker", nil)
	waitFor(t, "a's follow loop to see the delete", func() bool {
		seen, idle := store.FollowState(a.Store)
		return seen >= marker.Version && idle
	})
	close(h.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	a.waitUsed(t, 0)
	a.checkAlloc(t)
}
