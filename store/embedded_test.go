package store_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/store/indextest"
)

func TestEmbeddedConformance(t *testing.T) {
	indextest.Run(t, func(t *testing.T) store.Index {
		x := store.NewEmbedded()
		t.Cleanup(func() { _ = x.Close() })
		return x
	})
}

// TestEmbeddedLRU: the order a store keeps in the embedded index follows
// its touches (by Touch, by TouchObjects of objects found now or before
// the key was replaced or deleted, and by swaps that ask) against a model list,
// keys that leave the index leave the order, and keys the index never had
// are not in it.
func TestEmbeddedLRU(t *testing.T) {
	ctx := context.Background()
	x := store.NewEmbedded()
	t.Cleanup(func() { _ = x.Close() })
	if !x.ClaimLRU() || x.ClaimLRU() {
		t.Fatal("ClaimLRU: want true once, then false")
	}
	ver := map[string]uint64{}
	var model []string // least recently used first, as LRUTail answers
	// Objects found before, for TouchObjects: gen counts each key's
	// deletes, and an object touches its key only while the key was not
	// deleted since it was found.
	type found struct {
		o   *store.Object
		gen int
	}
	var history []found
	gen := map[string]int{}
	r := rand.New(rand.NewPCG(3, 4))
	for step := range 3000 {
		k := fmt.Sprintf("k%d", r.IntN(40))
		if o, _ := x.Find(ctx, k); o != nil {
			history = append(history, found{o, gen[k]})
		}
		switch r.IntN(6) {
		case 5: // TouchObjects: found now or before, or never the index's
			var objs []*store.Object
			for range 1 + r.IntN(3) {
				if len(history) == 0 || r.IntN(4) == 0 {
					k := fmt.Sprintf("k%d", r.IntN(40))
					objs = append(objs, &store.Object{Key: k})
					if ver[k] != 0 {
						model = append(slices.DeleteFunc(model, func(m string) bool { return m == k }), k)
					}
					continue
				}
				h := history[r.IntN(len(history))]
				objs = append(objs, h.o)
				if k := h.o.Key; ver[k] != 0 && gen[k] == h.gen {
					model = append(slices.DeleteFunc(model, func(m string) bool { return m == k }), k)
				}
			}
			x.TouchObjects(objs...)
		case 0, 1: // put, moving the key up with the swap or not
			touch := r.IntN(2) == 0
			rev, err := x.CompareAndSwap(ctx, store.Swap{Key: k, Old: ver[k], New: &store.Object{Key: k}, Touch: touch})
			if err != nil {
				t.Fatal(err)
			}
			ver[k] = rev
			if touch {
				model = append(slices.DeleteFunc(model, func(m string) bool { return m == k }), k)
			}
		case 2: // delete
			if ver[k] == 0 {
				continue
			}
			if _, err := x.CompareAndSwap(ctx, store.Swap{Key: k, Old: ver[k]}); err != nil {
				t.Fatal(err)
			}
			delete(ver, k)
			gen[k]++
			model = slices.DeleteFunc(model, func(m string) bool { return m == k })
		case 3: // touch, one or two keys
			keys := []string{k}
			if r.IntN(2) == 0 {
				keys = append(keys, fmt.Sprintf("k%d", r.IntN(40)))
			}
			x.Touch(keys...)
			for _, k := range keys {
				if ver[k] == 0 {
					continue
				}
				model = append(slices.DeleteFunc(model, func(m string) bool { return m == k }), k)
			}
		case 4:
			x.Forget(k)
			model = slices.DeleteFunc(model, func(m string) bool { return m == k })
		}
		if got := x.LRUTail(100); !slices.Equal(got, model) {
			t.Fatalf("step %d: LRUTail = %q, want %q", step, got, model)
		}
		if x.LRULen() != len(model) {
			t.Fatalf("step %d: LRULen = %d, want %d", step, x.LRULen(), len(model))
		}
	}
	if got := x.LRUTail(2); len(model) >= 2 && !slices.Equal(got, model[:2]) {
		t.Fatalf("LRUTail(2) = %q, want %q", got, model[:2])
	}
}

// TestEmbeddedHasChildren: whether a directory has keys under it follows
// a model of the keys through puts, deletes and multi-key swaps, for
// directories, their prefixes that are not directories ("a/b" of
// "a/bc/x"), keys that are files, the root and odd names ("a//b",
// "/x"); once every key is gone the entries cost nothing again.
func TestEmbeddedHasChildren(t *testing.T) {
	ctx := context.Background()
	x := store.NewEmbedded()
	t.Cleanup(func() { _ = x.Close() })
	empty := x.MetaBytes()
	names := []string{"a", "a/b", "a/b/c", "a/bc/x", "a/b/c/d/e", "b/x", "a//b", "/x", "x/", "c/d/e/f", "c/d/e/g", "c/d/e/h", "a/b/y"}
	ver := map[string]uint64{}
	r := rand.New(rand.NewPCG(5, 6))
	hasUnder := func(dir string) bool {
		for k := range ver {
			if len(k) > len(dir) && k[:len(dir)] == dir && k[len(dir)] == '/' {
				return true
			}
		}
		return false
	}
	probes := []string{"", "a", "a/b", "a/bc", "a/b/c", "a/b/c/d", "a/", "b", "c", "c/d", "c/d/e", "x", "/", "a/bc/x"}
	for step := range 4000 {
		var swaps []store.Swap
		seen := map[string]bool{}
		for range 1 + r.IntN(6) { // runs of one parent too (Embedded's underCounts)
			k := names[r.IntN(len(names))]
			if seen[k] {
				continue
			}
			seen[k] = true
			if ver[k] != 0 && r.IntN(2) == 0 {
				swaps = append(swaps, store.Swap{Key: k, Old: ver[k]})
			} else {
				swaps = append(swaps, store.Swap{Key: k, Old: ver[k], New: &store.Object{Key: k}})
			}
		}
		if r.IntN(10) == 0 { // a failing swap changes nothing
			swaps = append(swaps, store.Swap{Key: "never", Old: 99, New: &store.Object{Key: "never"}})
			if _, err := x.CompareAndSwap(ctx, swaps...); err == nil {
				t.Fatal("a swap of a wrong version passed")
			}
		} else {
			rev, err := x.CompareAndSwap(ctx, swaps...)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range swaps {
				if s.New == nil {
					delete(ver, s.Key)
				} else {
					ver[s.Key] = rev
				}
			}
		}
		for _, d := range probes {
			got, err := x.HasChildren(ctx, d)
			if err != nil {
				t.Fatal(err)
			}
			if want := hasUnder(d); got != want {
				t.Fatalf("step %d: HasChildren(%q) = %v, want %v (keys %v)", step, d, got, want, ver)
			}
		}
	}
	for k, v := range ver {
		if _, err := x.CompareAndSwap(ctx, store.Swap{Key: k, Old: v}); err != nil {
			t.Fatal(err)
		}
	}
	if got := x.MetaBytes(); got != empty {
		t.Fatalf("MetaBytes with every key gone = %d, want %d", got, empty)
	}
}

// TestEmbeddedSwapCur: a swap's Cur (the object the caller found) is a
// hint only. Given the key's current object, a stale one of the same key
// (replaced, or deleted and the key made again), another key's, or none,
// every swap succeeds exactly when Old is the key's version, changes
// that key alone, and the index's MetaBytes stays the sum of its
// objects'; checked against a model after every step, multi-key swaps
// included.
func TestEmbeddedSwapCur(t *testing.T) {
	ctx := context.Background()
	x := store.NewEmbedded()
	t.Cleanup(func() { _ = x.Close() })
	r := rand.New(rand.NewPCG(5, 6))
	const n = 12
	key := func(i int) string { return fmt.Sprintf("k%d", i) }
	model := map[string]*store.Object{} // what Find must return
	var seen []*store.Object            // every object the index took, some stale
	for step := range 4000 {
		swaps := make([]store.Swap, 1+r.IntN(3))
		want := true // every swap's Old is the key's version
		used := map[string]bool{}
		for i := range swaps {
			k := key(r.IntN(n))
			for used[k] {
				k = key(r.IntN(n))
			}
			used[k] = true
			sw := store.Swap{Key: k, Owned: r.IntN(2) == 0}
			if cur := model[k]; cur != nil {
				sw.Old = cur.Version
			}
			if r.IntN(6) == 0 { // a stale version
				sw.Old += uint64(1 + r.IntN(3))
				want = false
			}
			switch c := r.IntN(4); {
			case c == 0:
				sw.Cur = model[k]
			case c == 1 && len(seen) > 0:
				sw.Cur = seen[r.IntN(len(seen))] // stale, or another key's
			}
			if r.IntN(4) != 0 {
				sw.New = &store.Object{Key: k, Size: uint64(r.IntN(100)), Replicas: []store.Replica{{Node: "n", Extents: make([]segment.Extent, r.IntN(3))}}}
			}
			swaps[i] = sw
		}
		_, err := x.CompareAndSwap(ctx, swaps...)
		if (err == nil) != want {
			t.Fatalf("step %d: swaps %+v: err %v, want success %v", step, swaps, err, want)
		}
		if err == nil {
			for _, sw := range swaps {
				delete(model, sw.Key)
				if sw.New != nil {
					o, err := x.Find(ctx, sw.Key)
					if err != nil || o == nil || o.Size != sw.New.Size || o.Version != sw.New.Version {
						t.Fatalf("step %d: %q after its put: %+v, %v", step, sw.Key, o, err)
					}
					model[sw.Key] = o
					seen = append(seen, o)
				}
			}
		}
		var meta uint64
		for i := range n {
			o, err := x.Find(ctx, key(i))
			if err != nil || o != model[key(i)] {
				t.Fatalf("step %d: %q is %+v (%v), want %+v", step, key(i), o, err, model[key(i)])
			}
			if o != nil {
				meta += o.MetaBytes()
			}
		}
		if got := x.MetaBytes(); got != meta {
			t.Fatalf("step %d: MetaBytes %d, want %d", step, got, meta)
		}
	}
}

// TestEmbeddedLRUConcurrent: puts that move their keys up (after the
// swap lets go of the table), deletes, Touch, TouchObjects and Forget from several
// goroutines at once leave an LRU that holds only keys in the index,
// each once, as many as LRULen says; run it with -race.
func TestEmbeddedLRUConcurrent(t *testing.T) {
	ctx := context.Background()
	x := store.NewEmbedded()
	t.Cleanup(func() { _ = x.Close() })
	x.ClaimLRU()
	const keys = 8
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(w), 7))
			for range 3000 {
				k := fmt.Sprintf("k%d", r.IntN(keys))
				switch r.IntN(4) {
				case 0: // put or delete, over whatever version is there
					o, err := x.Find(ctx, k)
					if err != nil {
						t.Error(err)
						return
					}
					sw := store.Swap{Key: k, Cur: o, Touch: true}
					if o != nil {
						sw.Old = o.Version
					}
					if o == nil || r.IntN(2) == 0 {
						sw.New = &store.Object{Key: k}
					}
					if _, err := x.CompareAndSwap(ctx, sw); err != nil && !errors.Is(err, store.ErrConflict) {
						t.Error(err)
						return
					}
				case 1:
					if o, _ := x.Find(ctx, k); o != nil && r.IntN(2) == 0 {
						x.TouchObjects(o)
						break
					}
					x.Touch(k, fmt.Sprintf("k%d", r.IntN(keys)))
				case 2:
					x.Forget(k)
				case 3:
					x.LRUTail(keys)
				}
			}
		})
	}
	wg.Wait()
	tail := x.LRUTail(2 * keys)
	if len(tail) != x.LRULen() {
		t.Fatalf("LRUTail has %d keys, LRULen says %d", len(tail), x.LRULen())
	}
	seen := map[string]bool{}
	for _, k := range tail {
		if o, _ := x.Find(ctx, k); o == nil || seen[k] {
			t.Fatalf("LRU %q: %q is not in the index, or twice", tail, k)
		}
		seen[k] = true
	}
}

// TestEmbeddedTreeLog: the tree's changes left for later stay bounded
// with no scan to make them (an applier makes them once there are
// enough, a swap past the bound makes them itself), and a scan then
// finds every key, in order.
func TestEmbeddedTreeLog(t *testing.T) {
	ctx := context.Background()
	x := store.NewEmbedded()
	t.Cleanup(func() { _ = x.Close() })
	name := func(i int) string { return fmt.Sprintf("d/k%07d", i) }
	put := func(from, n int) {
		t.Helper()
		swaps := make([]store.Swap, n)
		for i := range swaps {
			k := name(from + i)
			swaps[i] = store.Swap{Key: k, New: &store.Object{Key: k}}
		}
		if _, err := x.CompareAndSwap(ctx, swaps...); err != nil {
			t.Fatal(err)
		}
	}
	// One swap past the bound makes every change before it returns.
	put(0, store.TreeInline+1)
	if n := store.PendingTree(x); n != 0 {
		t.Fatalf("%d tree changes pending after a swap of %d keys", n, store.TreeInline+1)
	}
	// Batches, in an order that is not the keys', with no scan between.
	keys := store.TreeInline + 1
	const batches, per = 2000, 64
	for b := range batches {
		put(keys+(b*7919%batches)*per, per)
		if n := store.PendingTree(x); n > store.TreeInline+per {
			t.Fatalf("after %d batches %d tree changes pending, over %d", b+1, n, store.TreeInline+per)
		}
	}
	keys += batches * per
	// The applier leaves fewer than would start another (a liveness
	// bound, not a speed: it takes milliseconds).
	for deadline := time.Now().Add(time.Minute); store.PendingTree(x) >= store.TreeAsync; runtime.Gosched() {
		if time.Now().After(deadline) {
			t.Fatalf("%d tree changes still pending a minute after the last swap", store.PendingTree(x))
		}
	}
	objs, err := x.Scan(ctx, "d/", "", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(objs) != keys {
		t.Fatalf("scan found %d keys of %d", len(objs), keys)
	}
	for i, o := range objs {
		if o.Key != name(i) {
			t.Fatalf("scan's key %d is %q, want %q", i, o.Key, name(i))
		}
	}
	if n := store.PendingTree(x); n != 0 {
		t.Fatalf("%d tree changes pending after a scan", n)
	}
}

// TestEmbeddedScanSeesWholeSwaps: writers move tokens from name to name,
// each move one transaction (the old name out, the new one in), with the
// tree's changes made after the table's (Embedded's tree lock); readers
// scan the directory and find every token exactly once, never an emptied
// slot, and a move committed before a scan is in it.
func TestEmbeddedScanSeesWholeSwaps(t *testing.T) {
	ctx := context.Background()
	x := store.NewEmbedded()
	t.Cleanup(func() { _ = x.Close() })
	const tokens, moves = 6, 1500
	name := func(tok, gen int) string { return fmt.Sprintf("p/t%d-%06d", tok, gen) }
	for tok := range tokens {
		if _, err := x.CompareAndSwap(ctx, store.Swap{Key: name(tok, 0), New: &store.Object{Key: name(tok, 0), Size: uint64(tok)}}); err != nil {
			t.Fatal(err)
		}
	}
	var gens [tokens]atomic.Int64 // each token's last move committed
	var wg sync.WaitGroup
	var writers sync.WaitGroup
	for tok := range tokens {
		writers.Add(1)
		wg.Go(func() {
			defer writers.Done()
			cur, _ := x.Find(ctx, name(tok, 0))
			for gen := 1; gen <= moves; gen++ {
				next := &store.Object{Key: name(tok, gen), Size: uint64(tok)}
				if _, err := x.CompareAndSwap(ctx,
					store.Swap{Key: cur.Key, Old: cur.Version, Cur: cur},
					store.Swap{Key: next.Key, New: next}); err != nil {
					t.Error(err)
					return
				}
				gens[tok].Store(int64(gen))
				cur, _ = x.Find(ctx, next.Key)
			}
		})
	}
	done := make(chan struct{})
	go func() { writers.Wait(); close(done) }()
	for range 3 {
		wg.Go(func() {
			for scans := 0; ; scans++ {
				select {
				case <-done:
					if scans == 0 {
						t.Error("no scan ran")
					}
					return
				default:
				}
				// A move committed before the scan is in it: the
				// token is under that name or a later one.
				seenTok := rand.IntN(tokens)
				before := int(gens[seenTok].Load())
				objs, err := x.Scan(ctx, "p/", "", 0)
				if err != nil {
					t.Error(err)
					return
				}
				count := make([]int, tokens)
				for _, o := range objs {
					if o == nil {
						t.Error("scan returned an emptied slot")
						return
					}
					var tok, gen int
					if _, err := fmt.Sscanf(o.Key, "p/t%d-%d", &tok, &gen); err != nil || o.Size != uint64(tok) {
						t.Errorf("scan returned %+v", o)
						return
					}
					count[tok]++
					if tok == seenTok && gen < before {
						t.Errorf("scan has %s, after a lookup found generation %d", o.Key, before)
						return
					}
				}
				for tok, n := range count {
					if n != 1 {
						t.Errorf("token %d under %d names in one scan: %v", tok, n, objs)
						return
					}
				}
			}
		})
	}
	wg.Wait()
}
