package store

import (
	"context"
	"fmt"
	"testing"
)

// BenchmarkSwap64 measures one CompareAndSwap of 64 keys of a directory
// (of four, 1024 keys each),
// the index's share of a batch put's commit and the time it holds the
// index's lock: new keys (removed again, untimed, every 64 calls so the
// index stays small) and keys replaced by a new version.
func BenchmarkSwap64(b *testing.B) {
	ctx := context.Background()
	keys := make([]string, 64*64)
	for i := range keys {
		keys[i] = fmt.Sprintf("kv/layer%d/block%06d", i/1024, i)
	}
	obj := func(k string) *Object {
		return &Object{Key: k, Kind: KindFile, Mode: 0o644, Size: 4096, Ino: NewIno(),
			Replicas: []Replica{{Node: "n", Extents: nil}}}
	}
	b.Run("new", func(b *testing.B) {
		x := NewEmbedded()
		swaps := make([]Swap, 64)
		vers := make([]uint64, len(keys))
		b.ReportMetric(0, "ns/op")
		n := 0
		for i := 0; b.Loop(); i++ {
			c := i % 64
			if c == 0 && i > 0 {
				b.StopTimer()
				for j, k := range keys {
					if _, err := x.CompareAndSwap(ctx, Swap{Key: k, Old: vers[j]}); err != nil {
						b.Fatal(err)
					}
					vers[j] = 0
				}
				b.StartTimer()
			}
			for j := range swaps {
				k := keys[c*64+j]
				swaps[j] = Swap{Key: k, New: obj(k), Owned: true, Touch: true}
			}
			rev, err := x.CompareAndSwap(ctx, swaps...)
			if err != nil {
				b.Fatal(err)
			}
			for j := range swaps {
				vers[c*64+j] = rev
			}
			n += 64
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(n), "ns/key")
	})
	b.Run("replace", func(b *testing.B) {
		x := NewEmbedded()
		x.ClaimLRU()
		cur := make([]*Object, len(keys))
		for i, k := range keys {
			cur[i] = obj(k)
			rev, err := x.CompareAndSwap(ctx, Swap{Key: k, New: cur[i], Owned: true})
			if err != nil {
				b.Fatal(err)
			}
			cur[i].Version = rev
		}
		swaps := make([]Swap, 64)
		n := 0
		for i := 0; b.Loop(); i++ {
			c := i % 64
			for j := range swaps {
				k := keys[c*64+j]
				swaps[j] = Swap{Key: k, Old: cur[c*64+j].Version, New: obj(k), Owned: true, Touch: true, Cur: cur[c*64+j]}
			}
			rev, err := x.CompareAndSwap(ctx, swaps...)
			if err != nil {
				b.Fatal(err)
			}
			for j := range swaps {
				swaps[j].New.Version = rev
				cur[c*64+j] = swaps[j].New
			}
			n += 64
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(n), "ns/key")
	})
}
