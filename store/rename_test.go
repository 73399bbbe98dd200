package store_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// limitedIndex bounds the swaps of one CompareAndSwap, as etcd does, and
// fails the CompareAndSwap numbered failAt (counting from 1; 0: none) as
// if its daemon died there.
type limitedIndex struct {
	store.Index
	max    int
	failAt int64
	calls  *atomic.Int64
}

func (x limitedIndex) MaxSwaps() int { return x.max }

func (x limitedIndex) CompareAndSwap(ctx context.Context, swaps ...store.Swap) (uint64, error) {
	if len(swaps) > x.max {
		return 0, fmt.Errorf("test: %d swaps > %d: %w", len(swaps), x.max, store.ErrTooLarge)
	}
	if n := x.calls.Add(1); n == x.failAt {
		return 0, fmt.Errorf("test: the mover died: %w", store.ErrUnavailable)
	}
	return x.Index.CompareAndSwap(ctx, swaps...)
}

// clock is a settable time for the store.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// renameRig is a store over an index of 8 swaps a transaction, on a
// settable clock, and makes movers over the same index that die.
type renameRig struct {
	idx   store.Index
	calls *atomic.Int64
	clk   *clock
	s     *testStore
}

func newRenameRig(t *testing.T) *renameRig {
	idx := store.NewEmbedded()
	t.Cleanup(func() { _ = idx.Close() })
	r := &renameRig{idx: idx, calls: new(atomic.Int64), clk: &clock{now: time.Unix(1_000_000, 0)}}
	r.s = newTestStore(t, 4<<20, withIndex(limitedIndex{Index: idx, max: 8, calls: r.calls}),
		withOptions(func(o *store.Options) { o.Now = r.clk.Now }))
	return r
}

// mover returns a store on the same index whose compare-and-swap number
// step from now fails, as if its daemon died there.
func (r *renameRig) mover(t *testing.T, step int64) *testStore {
	failing := limitedIndex{Index: r.idx, max: 8, calls: r.calls, failAt: r.calls.Load() + step}
	return newTestStore(t, 1<<20, withIndex(failing), withOptions(func(o *store.Options) { o.Now = r.clk.Now }))
}

// fillTree makes dir with files f0..f(n-1) and a subdirectory sub with
// three more, and returns their contents by key below dir.
func fillTree(t *testing.T, s *testStore, dir string, n int) map[string][]byte {
	t.Helper()
	s.mkdir(t, dir)
	s.mkdir(t, dir+"/sub")
	want := map[string][]byte{}
	for i := range n {
		k := fmt.Sprintf("f%d", i)
		want[k] = pattern(byte(i), 100+i)
	}
	for i := range 3 {
		want[fmt.Sprintf("sub/g%d", i)] = pattern(byte(200+i), 50)
	}
	for k, v := range want {
		s.put(t, dir+"/"+k, v)
	}
	return want
}

func checkTree(t *testing.T, s *testStore, dir string, want map[string][]byte, gone string) {
	t.Helper()
	for k, v := range want {
		equalBytes(t, dir+"/"+k, s.read(t, dir+"/"+k), v)
	}
	for _, k := range s.keys(t) {
		if strings.HasPrefix(k, gone+"/") || k == gone || store.IsInternal(k) {
			t.Errorf("key %q left after the rename", k)
		}
	}
	es, err := s.List(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		if store.IsInternal(e.Name) || strings.ContainsRune(e.Name, 0) {
			t.Errorf("root lists a hidden record %q", e.Name)
		}
	}
}

// TestRenameLargeTreeInSteps: a directory with many more descendants than
// one index transaction holds renames whole, in steps.
func TestRenameLargeTreeInSteps(t *testing.T) {
	ctx := context.Background()
	idx := store.NewEmbedded()
	t.Cleanup(func() { _ = idx.Close() })
	calls := new(atomic.Int64)
	s := newTestStore(t, 4<<20, withIndex(limitedIndex{Index: idx, max: 8, calls: calls}))
	want := fillTree(t, s, "d", 40)
	before := calls.Load()
	if err := s.Rename(ctx, "d", "e", 0); err != nil {
		t.Fatal(err)
	}
	if steps := calls.Load() - before; steps < 10 {
		t.Fatalf("the rename took %d transactions for 45 entries at 8 swaps each", steps)
	}
	checkTree(t, s, "e", want, "d")
	if _, err := s.Stat(ctx, "d"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("d after the rename: %v", err)
	}
	if o, err := s.Stat(ctx, "e"); err != nil || o.Kind != store.KindDir || o.Version == 0 {
		t.Fatalf("e after the rename: %+v, %v (want the explicit directory)", o, err)
	}
	s.checkAlloc(t)
}

// TestRenameInStepsFinishedAfterMoverDies: a mover that dies mid-way
// leaves every file at one of its names; once its intent is stale,
// Reconcile finishes the rename.
func TestRenameInStepsFinishedAfterMoverDies(t *testing.T) {
	ctx := context.Background()
	r := newRenameRig(t)
	s, clk := r.s, r.clk
	want := fillTree(t, s, "d", 40)
	other := fillTree(t, s, "x", 20)
	mover := r.mover(t, 4) // dies at the fourth step of the rename
	if err := mover.Rename(ctx, "d", "e", 0); err == nil {
		t.Fatal("the dying mover's rename succeeded")
	}
	// Every file is at exactly one of its names meanwhile.
	for k, v := range want {
		a, errA := s.tryRead("d/" + k)
		b, errB := s.tryRead("e/" + k)
		switch {
		case errA == nil && errB == nil:
			t.Fatalf("%s at both names", k)
		case errA != nil && errB != nil:
			t.Fatalf("%s at neither name: %v, %v", k, errA, errB)
		case errA == nil:
			equalBytes(t, "d/"+k, a, v)
		default:
			equalBytes(t, "e/"+k, b, v)
		}
	}
	// A rename into the tree waits for the move meanwhile, and so does
	// another rename in steps (one runs at a time).
	rctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	err := s.Rename(rctx, "e/f1", "e/other", 0)
	cancel()
	if err == nil {
		t.Fatal("a rename inside a tree being moved went ahead")
	}
	rctx, cancel = context.WithTimeout(ctx, 100*time.Millisecond)
	err = s.Rename(rctx, "x", "y", 0)
	cancel()
	if err == nil {
		t.Fatal("a second rename in steps ran beside the first")
	}
	// A file created in the old tree meanwhile moves too.
	s.put(t, "d/late", []byte("moves"))
	want["late"] = []byte("moves")
	if _, err := s.Reconcile(ctx, func(string) bool { return true }); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Stat(ctx, "d/f0"); err == nil {
		if _, err2 := s.Stat(ctx, "e/f0"); err2 == nil {
			t.Fatal("f0 at both names")
		}
	}
	clk.add(store.RenameStale)
	if _, err := s.Reconcile(ctx, func(string) bool { return true }); err != nil {
		t.Fatal(err)
	}
	for k, v := range want {
		equalBytes(t, "e/"+k, s.read(t, "e/"+k), v)
	}
	if keys := s.keys(t); len(keys) == 0 || store.IsInternal(keys[0]) {
		t.Fatalf("the intent is still there: %q", keys[0])
	}
	if err := s.Rename(ctx, "e/f1", "e/other", 0); err != nil {
		t.Fatalf("rename after the move was finished: %v", err)
	}
	if err := s.Rename(ctx, "x", "y", 0); err != nil {
		t.Fatalf("the second rename in steps after the first: %v", err)
	}
	checkTree(t, s, "y", other, "x")
}

// TestRenameInStepsLeavesTooLongNames: a file created in a tree being
// moved whose new name would be too long stays where it is; the rest of
// the move finishes and ends its intent.
func TestRenameInStepsLeavesTooLongNames(t *testing.T) {
	ctx := context.Background()
	r := newRenameRig(t)
	s, clk := r.s, r.clk
	want := fillTree(t, s, "d", 20)
	mover := r.mover(t, 2)
	if err := mover.Rename(ctx, "d", "dd", 0); err == nil {
		t.Fatal("the dying mover's rename succeeded")
	}
	// A path of exactly MaxKeyLen under d: one byte too long under dd.
	dir := "d"
	for len(dir)+1+200 < store.MaxKeyLen-10 {
		dir += "/" + strings.Repeat("p", 200)
	}
	long := dir + "/" + strings.Repeat("n", store.MaxKeyLen-len(dir)-1)
	s.mkdirAll(t, long)
	s.put(t, long, []byte("stays"))
	clk.add(store.RenameStale)
	if _, err := s.Reconcile(ctx, func(string) bool { return true }); err != nil {
		t.Fatal(err)
	}
	for k, v := range want {
		equalBytes(t, "dd/"+k, s.read(t, "dd/"+k), v)
	}
	equalBytes(t, "the entry left behind", s.read(t, long), []byte("stays"))
	for _, k := range s.keys(t) {
		if store.IsInternal(k) {
			t.Fatalf("the intent is still there")
		}
	}
}
