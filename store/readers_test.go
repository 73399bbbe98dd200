package store_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// TestOpenReaders: OpenReadersUntouched gives every key what OpenReader
// gives it (a reader of the current version, or the
// same error), with the index's batch lookup and without it; the readers
// hold their versions past a replace and a delete until CloseReaders, and
// closing them all leaves nothing open or held.
func TestOpenReaders(t *testing.T) {
	// plainIndex (puts_test.go) hides ManyFinder: each key alone.
	for _, plain := range []bool{false, true} {
		t.Run(fmt.Sprintf("plain=%v", plain), func(t *testing.T) {
			var opts []testOpt
			if plain {
				opts = append(opts, withIndex(plainIndex{store.NewEmbedded()}))
			}
			s := newTestStore(t, 4<<20, opts...)
			ctx := context.Background()
			va, vb := pattern(1, 30_000), pattern(2, 5000)
			s.put(t, "a", va)
			s.put(t, "b", vb)
			s.put(t, "empty", nil)
			if _, err := s.Mkdir(ctx, "d", &store.Object{Mode: 0o755}); err != nil {
				t.Fatal(err)
			}
			keys := []string{"a", "missing", "b", "d", "empty", "a"}
			// LookupMany finds what Lookup finds (a directory's own
			// object too), nil for none.
			objs := make([]*store.Object, len(keys))
			if err := s.LookupMany(ctx, keys, objs); err != nil {
				t.Fatal(err)
			}
			for i, k := range keys {
				o, err := s.Lookup(ctx, k)
				if o != objs[i] || (err != nil) != (o == nil) {
					t.Fatalf("%s: LookupMany %v, Lookup %v (%v)", k, objs[i], o, err)
				}
			}
			rs, errs := s.OpenReadersUntouched(ctx, keys)
			if len(rs) != len(keys) || len(errs) != len(keys) {
				t.Fatalf("%d readers, %d errors for %d keys", len(rs), len(errs), len(keys))
			}
			for i, k := range keys {
				r1, err1 := s.OpenReader(ctx, k)
				if (err1 == nil) != (errs[i] == nil) || err1 != nil && err1.Error() != errs[i].Error() {
					t.Fatalf("%s: batch error %v, alone %v", k, errs[i], err1)
				}
				if err1 != nil {
					if rs[i] != nil {
						t.Fatalf("%s: a reader and the error %v", k, errs[i])
					}
					continue
				}
				if rs[i].Object() != r1.Object() {
					t.Fatalf("%s: batch opened version %d, alone %d", k, rs[i].Object().Version, r1.Object().Version)
				}
				r1.Close()
			}
			if !errors.Is(errs[1], store.ErrNotFound) || !errors.Is(errs[3], store.ErrIsDir) {
				t.Fatalf("errors: %v", errs)
			}
			// The versions stay while their readers are open.
			s.put(t, "a", pattern(3, 70_000))
			if err := s.Delete(ctx, "b", 0); err != nil {
				t.Fatal(err)
			}
			for i, want := range map[int][]byte{0: va, 2: vb, 4: {}, 5: va} {
				got, err := readAll(rs[i])
				if err != nil {
					t.Fatal(err)
				}
				equalBytes(t, keys[i], got, want)
			}
			held := roundUp(uint64(len(va))) + roundUp(uint64(len(vb))) + roundUp(70_000)
			if u := s.used(); u != held {
				t.Fatalf("used %d B with the old versions open, want %d", u, held)
			}
			rs[4].Close() // closed before: CloseReaders skips it
			s.CloseReaders(rs)
			s.CloseReaders(rs) // twice: nothing more
			if u := s.used(); u != roundUp(70_000) {
				t.Fatalf("used %d B after CloseReaders, want %d", u, roundUp(70_000))
			}
			if st := s.Stats(); st.OpenObjects != 0 || st.LiveBodies != 1 {
				t.Fatalf("after CloseReaders: %d objects open, %d live bodies", st.OpenObjects, st.LiveBodies)
			}
			rs, errs = s.OpenReadersUntouched(ctx, nil)
			if len(rs) != 0 || errs != nil {
				t.Fatalf("no keys: %v %v", rs, errs)
			}
		})
	}
}

// TestOpenReadersBare: the versions batch puts committed are leased
// without the store's lock (bare) and hold their bytes past a replace and
// a delete, two leases of one body as long as either; eviction passes
// over a key being read, and takes it once it is not; closing them frees
// what they held and leaves nothing open, and a lease of a body freed
// since fails.
func TestOpenReadersBare(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	put := func(key string, cur *store.Object, v []byte) *store.Object {
		t.Helper()
		p := s.StartPuts(ctx, []store.PutSpec{{Key: key, Cur: cur, Bufs: []transfer.Buffer{transfer.HostBuffer(v)}, Place: store.DefaultPlacement()}})
		defer p.Release()
		objs, errs := p.Commit()
		if errs[0] != nil {
			t.Fatalf("put %s: %v", key, errs[0])
		}
		return objs[0]
	}
	va, vb, vc := pattern(1, 30_000), pattern(2, 5000), pattern(3, 9000)
	oa := put("a", nil, va)
	put("b", nil, vb)
	put("c", nil, vc)
	keys := []string{"a", "b", "a", "c"}
	rs, errs := s.OpenReadersUntouched(ctx, keys)
	if errs != nil {
		t.Fatal(errs)
	}
	for i, r := range rs {
		if !store.Bare(r) {
			t.Fatalf("%s: leased under the lock", keys[i])
		}
	}
	put("a", oa, pattern(4, 70_000))
	if err := s.Delete(ctx, "b", 0); err != nil {
		t.Fatal(err)
	}
	if store.EvictKey(s.Store, "c") {
		t.Fatal("c evicted while a batch get reads it")
	}
	for i, want := range [][]byte{va, vb, va, vc} {
		got, err := readAll(rs[i])
		if err != nil {
			t.Fatal(err)
		}
		equalBytes(t, keys[i], got, want)
	}
	all := roundUp(uint64(len(va))) + roundUp(uint64(len(vb))) + roundUp(uint64(len(vc))) + roundUp(70_000)
	if u := s.used(); u != all {
		t.Fatalf("used %d B with the old versions read, want %d", u, all)
	}
	rs[0].Close() // a's other lease (rs[2]) keeps its bytes
	if u := s.used(); u != all {
		t.Fatalf("used %d B with one of a's two leases closed, want %d", u, all)
	}
	s.CloseReaders(rs)
	if !store.EvictKey(s.Store, "c") {
		t.Fatal("c, read no longer, was not evicted")
	}
	if u := s.used(); u != roundUp(70_000) {
		t.Fatalf("used %d B after CloseReaders, want %d", u, roundUp(70_000))
	}
	if st := s.Stats(); st.OpenObjects != 0 {
		t.Fatalf("%d objects open", st.OpenObjects)
	}
	if store.LeaseBare(oa) {
		t.Fatal("leased the freed body of a's first version")
	}
}

// TestOpenReadersRace: batch opens against writers that replace and
// delete the same keys. Every reader reads whole the bytes of the version
// it holds (each put's value starts with a tag that the version maps
// to), never a freed or reused extent, and once all is closed only the
// live values hold memory. The writers put through drafts, or as batch
// puts with evictions of the same keys besides: versions the batch opens
// lease without the store's lock (bare); and they change the keys'
// modes, whose new versions (clones, which know no body) are leased
// under the lock.
func TestOpenReadersRace(t *testing.T) {
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) { testOpenReadersRace(t, batch) })
	}
}

func testOpenReadersRace(t *testing.T, batch bool) {
	s := newTestStore(t, 8<<20, noEvict())
	ctx := context.Background()
	const nkeys = 16
	keys := make([]string, nkeys)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%d", i)
	}
	var tags sync.Map // version -> the tag its value starts with
	value := func(tag uint64, n int) []byte {
		b := pattern(byte(tag), n)
		binary.LittleEndian.PutUint64(b, tag)
		return b
	}
	var stop atomic.Bool
	var next atomic.Uint64
	var wg sync.WaitGroup
	// put puts v at k and returns the version; 0 where a batch put lost
	// to another writer of k (the key changed since it was looked up).
	put := func(k string, v []byte) (uint64, error) {
		if !batch {
			o, err := s.tryPut(k, v)
			if err != nil {
				return 0, err
			}
			return o.Version, nil
		}
		cur, err := s.Lookup(ctx, k)
		if err != nil && !errors.Is(err, store.ErrNotFound) {
			return 0, err
		}
		p := s.StartPuts(ctx, []store.PutSpec{{Key: k, Cur: cur, Bufs: []transfer.Buffer{transfer.HostBuffer(v)}, Place: store.DefaultPlacement()}})
		defer p.Release()
		objs, errs := p.Commit()
		if errors.Is(errs[0], store.ErrConflict) || errors.Is(errs[0], store.ErrExists) {
			return 0, nil
		}
		if errs[0] != nil {
			return 0, errs[0]
		}
		return objs[0].Version, nil
	}
	for _, k := range keys {
		tag := next.Add(1)
		v, err := put(k, value(tag, 2000))
		if err != nil || v == 0 {
			t.Fatalf("put %s: version %d, %v", k, v, err)
		}
		tags.Store(v, tag)
	}
	defer func() { stop.Store(true); wg.Wait() }() // a failed check ends the test with them running
	for w := range 2 {
		wg.Go(func() {
			for i := 0; !stop.Load(); i++ {
				k := keys[(i*7+w)%nkeys]
				switch {
				case i%5 == 4:
					_ = s.Delete(ctx, k, 0)
					continue
				case batch && i%11 == 10:
					store.EvictKey(s.Store, k)
					continue
				case i%7 == 6:
					// A new version of the same bytes (a clone, which
					// knows no body: leased under the store's lock).
					var tag any
					o, err := s.Update(ctx, k, 0, func(o *store.Object) error {
						ok := false
						for tag, ok = tags.Load(o.Version); !ok; tag, ok = tags.Load(o.Version) {
							runtime.Gosched() // committed; its writer records it next
						}
						o.Mode ^= 0o1
						return nil
					})
					if err == nil {
						tags.Store(o.Version, tag)
					} else if !errors.Is(err, store.ErrNotFound) {
						t.Error(err)
						return
					}
					continue
				}
				tag := next.Add(1)
				v, err := put(k, value(tag, 1000+(i%37)*300))
				if err != nil {
					t.Error(err)
					return
				}
				if v != 0 {
					tags.Store(v, tag)
				}
			}
		})
	}
	// Rounds until the writers made their share of versions too (the
	// reader must not finish before they start).
	for round := 0; (round < 1500 || next.Load() < 3000) && !t.Failed(); round++ {
		rs, errs := s.OpenReadersUntouched(ctx, keys)
		for i, r := range rs {
			if r == nil {
				if !errors.Is(errs[i], store.ErrNotFound) {
					t.Errorf("%s: %v", keys[i], errs[i])
				}
				continue
			}
			got, err := readAll(r)
			if err != nil {
				t.Errorf("%s: %v", keys[i], err)
				continue
			}
			tag, ok := tags.Load(r.Object().Version)
			for !ok { // committed; its writer records it next
				runtime.Gosched()
				tag, ok = tags.Load(r.Object().Version)
			}
			equalBytes(t, fmt.Sprintf("%s version %d", keys[i], r.Object().Version), got, value(tag.(uint64), len(got)))
		}
		s.CloseReaders(rs)
	}
	stop.Store(true)
	wg.Wait()
	var live uint64
	for _, k := range keys {
		if o, err := s.Stat(ctx, k); err == nil {
			live += roundUp(o.Size)
		}
	}
	if st := s.Stats(); st.OpenObjects != 0 {
		t.Fatalf("%d objects open after every reader closed", st.OpenObjects)
	}
	if u := s.used(); u != live {
		t.Fatalf("used %d B, the live values %d", u, live)
	}
}
