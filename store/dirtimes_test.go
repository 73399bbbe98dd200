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

// TestDirChanged: a directory's last entry change moves when a key is
// made in it or leaves it (create, mkdir, delete, rmdir, rename out and
// in, a batch put of new keys, an eviction), not when a key in it gets a
// new version, and follows the directory when it is renamed.
func TestDirChanged(t *testing.T) {
	var clock atomic.Int64
	clock.Store(1e18)
	tick := func() int64 { return clock.Add(1000) }
	s := newTestStore(t, 1<<20, withOptions(func(o *store.Options) { o.Now = func() time.Time { return time.Unix(0, clock.Load()) } }))
	ctx := context.Background()
	data := []byte("x")
	for _, d := range []string{"a", "b"} {
		if _, err := s.Mkdir(ctx, d, nil); err != nil {
			t.Fatal(err)
		}
	}
	step := func(what, dir string, changes bool, fn func() error) {
		t.Helper()
		before := s.DirChanged(dir)
		now := tick()
		if err := fn(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		got := s.DirChanged(dir)
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
	if _, err := s.Create(ctx, "b/h", nil, true); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Update(ctx, "b", 0, func(o *store.Object) error { o.Mtime = 5; return nil }); err != nil {
		t.Fatal(err)
	}
	if got := s.DirChanged("b"); got != 0 {
		t.Fatalf("b's mtime set: its last entry change still shows (%d)", got)
	}
	step("create after the mtime was set", "b", true, func() error { _, err := s.Create(ctx, "b/i", nil, true); return err })
	last := s.DirChanged("b")
	tick()
	if err := s.Rename(ctx, "b", "c", 0); err != nil {
		t.Fatal(err)
	}
	if got := s.DirChanged("c"); got < last {
		t.Fatalf("after b moved to c: c changed at %d, want at least b's %d", got, last)
	}
	if got := s.DirChanged("b"); got != 0 {
		t.Fatalf("b, moved away, still changed at %d", got)
	}
}

// TestDirChangedBounded: past MaxDirTimes directories the table starts
// again, and every directory, remembered or not, reads as changed then:
// never earlier than before.
func TestDirChangedBounded(t *testing.T) {
	s := newTestStore(t, 1<<20, withOptions(func(o *store.Options) { o.MetaLimit = 256 << 20 }))
	ctx := context.Background()
	for i := range store.MaxDirTimes + 1 {
		d := fmt.Sprintf("d%d", i)
		if _, err := s.Mkdir(ctx, d, nil); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Create(ctx, d+"/f", nil, true); err != nil {
			t.Fatal(err)
		}
	}
	if s.DirChanged("never-changed") == 0 {
		t.Fatal("no floor after the table filled")
	}
	if first, floor := s.DirChanged("d0"), s.DirChanged("never-changed"); first < floor {
		t.Fatalf("d0 changed at %d, before the floor %d", first, floor)
	}
}
