package store_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/store"
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
