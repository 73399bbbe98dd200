package store_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// BenchmarkSmallFile is the store's share of creating a 4 KiB file through
// the mount: create, write, commit, close.
func BenchmarkSmallFile(b *testing.B) {
	s := newTestStore(b, 256<<20)
	ctx := context.Background()
	buf := make([]byte, 4096)
	if _, err := s.Mkdir(ctx, "d", nil); err != nil {
		b.Fatal(err)
	}
	i := 0
	for b.Loop() {
		key := fmt.Sprintf("d/f%d", i)
		i++
		o, err := s.Create(ctx, key, nil, false)
		if err != nil {
			b.Fatal(err)
		}
		d := s.NewDraft(o.Ino, nil, true)
		if _, err := d.WriteAt(ctx, buf, 0); err != nil {
			b.Fatal(err)
		}
		if _, err := d.Commit(ctx, store.CommitOptions{Key: key, IfIno: o.Ino}); err != nil {
			b.Fatal(err)
		}
		d.Close()
	}
}

// BenchmarkReplaceDelayed replaces 4 KiB values of 1024 keys, 64 per
// batch, in a store whose replaced bodies wait FreeDelay (as a cluster
// node's do), short enough that they come back during the run: what a
// replaced key costs the store, its delayed free included (b.N batches).
func BenchmarkReplaceDelayed(b *testing.B) {
	s := newTestStore(b, 64<<20, noEvict(), withOptions(func(o *store.Options) { o.FreeDelay = 2 * time.Millisecond }))
	ctx := context.Background()
	data := make([]byte, 4096)
	specs := make([]store.PutSpec, 64)
	i := 0
	for b.Loop() {
		for k := range specs {
			key := fmt.Sprint("k", (i*64+k)%1024)
			cur, _ := s.Lookup(ctx, key)
			specs[k] = store.PutSpec{Key: key, Bufs: []transfer.Buffer{transfer.HostBuffer(data)}, Cur: cur,
				Template: store.Object{Mode: 0o644}}
		}
		i++
		p := s.StartPuts(ctx, specs)
		if _, errs := p.Commit(); errors.Join(errs...) != nil {
			b.Fatal(errs)
		}
		p.Release()
	}
}
