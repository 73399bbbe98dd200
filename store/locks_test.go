package store_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// gatedGets is an index whose lookups of one key, once armed, wait for a
// gate: an etcd cache waiting for this node's own write to arrive.
type gatedGets struct {
	store.Index
	key     string
	armed   *atomic.Bool
	entered chan struct{}
	gate    chan struct{}
}

func (x gatedGets) Get(ctx context.Context, key string) (*store.Object, error) {
	if key == x.key && x.armed.Load() {
		select {
		case x.entered <- struct{}{}:
		default:
		}
		<-x.gate
	}
	return x.Index.Get(ctx, key)
}

// TestNoStoreLockAcrossIndexLookup: while one open waits in the index,
// opens, reads and closes of other files, stats and drafts' sizes go on.
func TestNoStoreLockAcrossIndexLookup(t *testing.T) {
	ctx := context.Background()
	g := gatedGets{Index: store.NewEmbedded(), key: "slow", armed: new(atomic.Bool),
		entered: make(chan struct{}, 1), gate: make(chan struct{})}
	t.Cleanup(func() { _ = g.Index.Close() })
	s := newTestStore(t, 4<<20, withIndex(g))
	s.put(t, "slow", pattern(1, 4096))
	s.put(t, "fast", pattern(2, 8192))
	held, err := s.OpenReader(ctx, "fast")
	if err != nil {
		t.Fatal(err)
	}
	g.armed.Store(true)
	slow := make(chan error, 1)
	go func() {
		r, err := s.OpenReader(ctx, "slow")
		if err == nil {
			r.Close()
		}
		slow <- err
	}()
	<-g.entered
	done := make(chan error, 1)
	go func() {
		r, err := s.OpenReader(ctx, "fast")
		if err != nil {
			done <- err
			return
		}
		buf := make([]byte, 8192)
		if _, err := r.ReadAt(ctx, buf, 0); err != nil {
			done <- err
			return
		}
		r.Close()
		held.Close()
		_ = s.Stats()
		d := s.NewDraft(store.NewIno(), nil, true)
		if _, err := d.WriteAt(ctx, pattern(3, 1000), 0); err != nil {
			done <- err
			return
		}
		_ = d.Size()
		d.Close()
		done <- nil
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("other files' opens and closes waited for one slow index lookup")
	}
	close(g.gate)
	if err := <-slow; err != nil {
		t.Fatal(err)
	}
}

// TestGrowNeverShrinks: fallocate (Grow) racing writes that extend the
// draft never cuts one of them off.
func TestGrowNeverShrinks(t *testing.T) {
	ctx := context.Background()
	s := newTestStore(t, 8<<20, noEvict())
	d := s.NewDraft(store.NewIno(), nil, true)
	defer d.Close()
	const chunk, n = 4096, 200
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range n {
			if _, err := d.WriteAt(ctx, pattern(byte(i), chunk), uint64(i*chunk)); err != nil {
				t.Error(err)
				return
			}
		}
	})
	wg.Go(func() {
		for i := range n {
			if err := d.Grow(ctx, uint64(i*chunk/2)); err != nil {
				t.Error(err)
				return
			}
		}
	})
	wg.Wait()
	if got := d.Size(); got != n*chunk {
		t.Fatalf("size %d after writes up to %d and smaller fallocates", got, n*chunk)
	}
	buf := make([]byte, chunk)
	for i := range n {
		if _, err := d.ReadAt(ctx, buf, uint64(i*chunk)); err != nil {
			t.Fatal(err)
		}
		equalBytes(t, "chunk", buf, pattern(byte(i), chunk))
	}
}
