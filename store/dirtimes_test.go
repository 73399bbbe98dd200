package store_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// dirClock is a test store whose clock moves only by tick.
type dirClock struct {
	*testStore
	clock atomic.Int64
}

func newDirClock(t *testing.T, opts ...testOpt) *dirClock {
	d := &dirClock{}
	d.clock.Store(1e18)
	opts = append(opts, withOptions(func(o *store.Options) { o.Now = func() time.Time { return time.Unix(0, d.clock.Load()) } }))
	d.testStore = newTestStore(t, 1<<20, opts...)
	return d
}

func (d *dirClock) tick() int64 { return d.clock.Add(1000) }

// changed is DirChanged of directory key as it is now (0 for none).
func (d *dirClock) changed(t *testing.T, key string) int64 {
	t.Helper()
	o, err := d.Stat(context.Background(), key)
	if err != nil {
		return d.DirChanged(&store.Object{Key: key})
	}
	return d.DirChanged(o)
}

// TestDirChanged: a directory's last entry change moves when a key is
// made in it or leaves it (create, mkdir, delete, rmdir, rename out and
// in, a batch put of new keys, an eviction), not when a key in it gets a
// new version; a renamed directory keeps its own and its subdirectories'
// (their entries are as they were); times its owner sets show as set.
func TestDirChanged(t *testing.T) {
	s := newDirClock(t)
	ctx := context.Background()
	data := []byte("x")
	for _, d := range []string{"a", "b"} {
		if _, err := s.Mkdir(ctx, d, nil); err != nil {
			t.Fatal(err)
		}
	}
	step := func(what, dir string, changes bool, fn func() error) {
		t.Helper()
		before := s.changed(t, dir)
		now := s.tick()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		got := s.changed(t, dir)
		if changes && got != now || !changes && got != before {
			t.Fatalf("%s: %q changed at %d (before %d, now %d): want changed %v", what, dir, got, before, now, changes)
		}
	}
	step("create", "a", true, func() error { _, err := s.Create(ctx, "a/f", nil, true); return err })
	step("write", "a", false, func() error { s.put(t, "a/f", data); return nil })
	step("mkdir", "a", true, func() error { _, err := s.Mkdir(ctx, "a/sub", nil); return err })
	step("rmdir", "a", true, func() error { return s.Rmdir(ctx, "a/sub") })
	step("rename out", "a", true, func() error { return s.Rename(ctx, "a/f", "b/f", 0) })
	if _, err := s.Create(ctx, "a/g", nil, true); err != nil {
		t.Fatal(err)
	}
	step("rename in", "b", true, func() error { return s.Rename(ctx, "a/g", "b/g", 0) })
	step("delete", "b", true, func() error { return s.Delete(ctx, "b/f", 0) })
	step("batch put", "b", true, func() error {
		specs := make([]store.PutSpec, 3)
		for i := range specs {
			specs[i] = store.PutSpec{Key: fmt.Sprintf("b/k%d", i), Bufs: []transfer.Buffer{transfer.HostBuffer(data)}, Place: store.DefaultPlacement()}
		}
		p := s.StartPuts(ctx, specs)
		defer p.Release()
		_, errs := p.Commit()
		for _, err := range errs {
			if err != nil {
				return err
			}
		}
		return nil
	})
	step("evict", "b", true, func() error {
		if !store.EvictKey(s.Store, "b/k0") {
			return fmt.Errorf("b/k0 not evicted")
		}
		return nil
	})
	step("top-level create", "", true, func() error { _, err := s.Create(ctx, "top", nil, true); return err })
	setMtime := func(key string, v int64) {
		t.Helper()
		if _, err := s.Update(ctx, key, 0, func(o *store.Object) error { o.Mtime = v; return nil }); err != nil {
			t.Fatal(err)
		}
		s.DirTimesSet(key)
	}
	// Set to the value it had, as rsync and tar do after filling it.
	o, err := s.Stat(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	setMtime("b", o.Mtime)
	if got := s.changed(t, "b"); got != 0 {
		t.Fatalf("b's mtime set: its last entry change still shows (%d)", got)
	}
	step("create after the mtime was set", "b", true, func() error { _, err := s.Create(ctx, "b/i", nil, true); return err })
	// A directory moved with a subdirectory: each keeps its own.
	if _, err := s.Mkdir(ctx, "b/s", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Create(ctx, "b/s/f", nil, true); err != nil {
		t.Fatal(err)
	}
	sub := s.changed(t, "b/s")
	last := s.changed(t, "b")
	s.tick()
	if err := s.Rename(ctx, "b", "c", 0); err != nil {
		t.Fatal(err)
	}
	if got := s.changed(t, "c"); got != last {
		t.Fatalf("after b moved to c: c changed at %d, want b's %d", got, last)
	}
	if got := s.changed(t, "c/s"); got != sub {
		t.Fatalf("after b moved to c: c/s changed at %d, want b/s's %d", got, sub)
	}
	if got := s.changed(t, "b"); got != 0 {
		t.Fatalf("b, moved away, still changed at %d", got)
	}
}

// TestDirChangedBounded: past its bound the table starts again, and
// every directory whose record is older reads as changed then (never
// earlier than before); one whose times its owner set since shows them.
func TestDirChangedBounded(t *testing.T) {
	s := newDirClock(t)
	store.SetMaxDirTimes(s.Store, 10)
	ctx := context.Background()
	if _, err := s.Mkdir(ctx, "keep", nil); err != nil {
		t.Fatal(err)
	}
	for i := range 11 {
		s.tick()
		d := fmt.Sprintf("d%d", i)
		if _, err := s.Mkdir(ctx, d, nil); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Create(ctx, d+"/f", nil, true); err != nil {
			t.Fatal(err)
		}
	}
	floor := s.changed(t, "keep")
	if floor == 0 {
		t.Fatal("no floor after the table filled")
	}
	if first := s.changed(t, "d0"); first < floor {
		t.Fatalf("d0 changed at %d, before the floor %d", first, floor)
	}
	s.tick()
	if _, err := s.Update(ctx, "keep", 0, func(o *store.Object) error { o.Mtime = 5; return nil }); err != nil {
		t.Fatal(err)
	}
	s.DirTimesSet("keep")
	if got := s.changed(t, "keep"); got != 0 {
		t.Fatalf("keep's mtime set after the floor: still changed at %d", got)
	}
}
