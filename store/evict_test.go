package store_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/store/etcdindex"
	"github.com/mooncake-fs/mooncake-fs/store/etcdindex/etcdtest"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// present reports which of keys exist.
func (s *testStore) present(t testing.TB, keys []string) (in, out []string) {
	t.Helper()
	for _, k := range keys {
		_, err := s.Index.Get(context.Background(), k)
		switch {
		case err == nil:
			in = append(in, k)
		case errors.Is(err, store.ErrNotFound):
			out = append(out, k)
		default:
			t.Fatal(err)
		}
	}
	return in, out
}

func (s *testStore) pin(t testing.TB, key string) {
	t.Helper()
	if _, err := s.Update(context.Background(), key, 0, func(o *store.Object) error { o.Pinned = true; return nil }); err != nil {
		t.Fatal(err)
	}
}

// With the high watermark at 1 the background evictor never runs, so every
// eviction is made by a write that found the store full: deterministic.
func TestEvictLRU(t *testing.T) {
	const size, obj = 8 << 20, 512 << 10
	s := newTestStore(t, size, withOptions(func(o *store.Options) { o.HighWater = 1 }))
	ctx := context.Background()
	keys := s.putSeries(t, "o", 10, obj)
	s.pin(t, "o1")
	r, err := s.OpenReader(ctx, "o0") // used: moves to the front
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	open, err := s.OpenReader(ctx, "o2") // open: never evicted
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	draft := s.edit(t, "o3") // the base of an open draft: never evicted
	defer draft.Close()

	order := []string{"o4", "o5", "o6", "o7", "o8", "o9", "o0"} // least recently used first
	for i := range 30 {
		k := fmt.Sprintf("n%d", i)
		keys = append(keys, k)
		order = append(order, k)
		s.put(t, k, pattern(byte(100+i), obj))
		_, gone := s.present(t, keys)
		if !sameSet(gone, order[:len(gone)]) {
			t.Fatalf("after writing %s evicted %q; want the least recently used first: %q", k, gone, order[:len(gone)])
		}
		if st := s.Stats(); st.Evictions != uint64(len(gone)) || st.EvictedBytes != uint64(len(gone))*obj {
			t.Fatalf("Evictions %d (%d B) with %d keys evicted", st.Evictions, st.EvictedBytes, len(gone))
		}
	}
	if s.Stats().Evictions < 20 {
		t.Fatalf("only %d evictions", s.Stats().Evictions)
	}
	for i, k := range []string{"o1", "o2", "o3"} {
		equalBytes(t, k, s.read(t, k), pattern(byte(i+1), obj))
	}
	got, _ := readAll(open)
	equalBytes(t, "open reader", got, pattern(2, obj))
	equalBytes(t, "open draft", readDraft(t, draft), pattern(3, obj))
	// What is left is exactly what the index holds.
	in, _ := s.present(t, keys)
	if u := s.used(); u != uint64(len(in))*obj {
		t.Fatalf("Used = %d with %d objects of %d B", u, len(in), obj)
	}
	s.checkAlloc(t)
}

// The background evictor brings use from over the high watermark to just
// under the low one, oldest first.
func TestEvictBackground(t *testing.T) {
	const size, obj = 8 << 20, 256 << 10
	s := newTestStore(t, size) // watermarks 0.95 and 0.85
	ctx := context.Background()
	var keys []string
	put := func(i int) {
		k := fmt.Sprintf("o%02d", i)
		keys = append(keys, k)
		s.put(t, k, pattern(byte(i), obj))
	}
	put(0)
	put(1)
	s.pin(t, "o00")
	r, err := s.OpenReader(ctx, "o01")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fsize := float64(size)
	high, low := uint64(0.95*fsize), uint64(0.85*fsize)
	for i := 2; s.used()+obj <= high; i++ {
		put(i)
	}
	if e := s.Stats().Evictions; e != 0 {
		t.Fatalf("%d evictions below the high watermark", e)
	}
	put(len(keys)) // crosses the high watermark
	// Wait for the evictor: poll until the index, the counters and the
	// segments agree on a use below the low watermark.
	deadline := time.Now().Add(30 * time.Second)
	var gone []string
	for {
		var in []string
		in, gone = s.present(t, keys)
		st := s.Stats()
		if st.Segments.Used <= low && st.Evictions == uint64(len(gone)) && st.Segments.Used == uint64(len(in))*obj {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("evictor did not settle: %+v, %d of %d keys gone", st, len(gone), len(keys))
		}
		time.Sleep(time.Millisecond)
	}
	if want := keys[2 : 2+len(gone)]; !sameSet(gone, want) {
		t.Fatalf("evicted %q, want the oldest unpinned, unopened keys %q", gone, want)
	}
	// Not more than needed: one object fewer would have left use above low.
	if u := s.used(); u+obj <= low {
		t.Fatalf("Used = %d: evicted more than down to the low watermark %d", u, low)
	}
	if st := s.Stats(); st.EvictedBytes != uint64(len(gone))*obj {
		t.Fatalf("EvictedBytes = %d for %d objects", st.EvictedBytes, len(gone))
	}
	equalBytes(t, "pinned", s.read(t, "o00"), pattern(0, obj))
	got, _ := readAll(r)
	equalBytes(t, "open", got, pattern(1, obj))
}

// Without eviction a full store refuses writes with ErrNoSpace and
// everything committed stays as it was.
func TestNoSpace(t *testing.T) {
	const size, obj = 4 << 20, 512 << 10
	s := newTestStore(t, size, noEvict(), withSegments(2))
	ctx := context.Background()
	keys := s.putSeries(t, "o", size/obj, obj)
	if u := s.used(); u != size {
		t.Fatalf("Used = %d, want a full store", u)
	}
	check := func(what string) {
		t.Helper()
		for i, k := range keys {
			equalBytes(t, what+": "+k, s.read(t, k), pattern(byte(i), obj))
		}
		if u := s.used(); u != size {
			t.Fatalf("%s: Used = %d, want %d", what, u, size)
		}
		s.checkAlloc(t)
	}
	_, err := s.tryPut("new", pattern(9, 1000))
	wantErr(t, "put into a full store", err, store.ErrNoSpace)
	if !errors.Is(err, segment.ErrNoSpace) {
		t.Errorf("%v does not wrap the segment's cause", err)
	}
	check("after a refused put")

	d := s.edit(t, "o0") // copy on write needs space too
	_, err = d.WriteAt(ctx, []byte("x"), 0)
	wantErr(t, "copy on write in a full store", err, store.ErrNoSpace)
	err = d.Truncate(ctx, obj*2)
	wantErr(t, "truncate up in a full store", err, store.ErrNoSpace)
	d.Close()
	check("after a refused copy on write")

	// A draft that runs out of space part way is revoked cleanly.
	if err := s.Delete(ctx, keys[len(keys)-1], 0); err != nil {
		t.Fatal(err)
	}
	keys = keys[:len(keys)-1]
	d = s.NewDraft(store.NewIno(), nil, true)
	if _, err := d.WriteAt(ctx, pattern(7, obj), 0); err != nil {
		t.Fatal(err)
	}
	_, err = d.WriteAt(ctx, pattern(8, segment.Granule), obj)
	wantErr(t, "growing past the end", err, store.ErrNoSpace)
	equalBytes(t, "draft after a refused write", readDraft(t, d), pattern(7, obj))
	d.Close()
	if u := s.used(); u != size-obj {
		t.Fatalf("Used = %d after revoking, want %d", u, size-obj)
	}
	s.put(t, "last", pattern(byte(len(keys)), obj))
	keys = append(keys, "last")
	check("after refilling")
	if st := s.Stats(); st.Evictions != 0 {
		t.Fatalf("Evictions = %d with eviction off", st.Evictions)
	}
}

// With eviction on but nothing evictable, writes fail with ErrNoSpace too.
func TestEvictNothingEvictable(t *testing.T) {
	const size, obj = 2 << 20, 512 << 10
	s := newTestStore(t, size, withOptions(func(o *store.Options) { o.HighWater = 1 }))
	ctx := context.Background()
	for i := range size / obj {
		k := fmt.Sprintf("o%d", i)
		s.put(t, k, pattern(byte(i), obj))
		if i%2 == 0 {
			s.pin(t, k)
		} else {
			r, err := s.OpenReader(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
		}
	}
	_, err := s.tryPut("new", []byte("x"))
	wantErr(t, "put with nothing evictable", err, store.ErrNoSpace)
	if st := s.Stats(); st.Evictions != 0 || st.Segments.Used != size {
		t.Fatalf("stats %+v", st)
	}
}

// TestEvictNotInVain: a reservation that evicting every file could not
// satisfy (the copy of a file that takes most of the store, for a change
// in place) fails with ErrNoSpace and evicts nothing; one that eviction
// can satisfy still evicts, least recently used first.
func TestEvictNotInVain(t *testing.T) {
	const size, small, big = 4 << 20, 64 << 10, 5 << 19 // 2.5 MiB
	s := newTestStore(t, size, withOptions(func(o *store.Options) { o.HighWater = 1 }))
	ctx := context.Background()
	keys := s.putSeries(t, "s", 8, small)
	s.put(t, "log", pattern(9, big))
	d := s.edit(t, "log")
	defer d.Close()
	if _, err := d.WriteAt(ctx, []byte("x"), big); !errors.Is(err, store.ErrNoSpace) {
		t.Fatalf("append needing a copy of the whole file: %v, want ErrNoSpace", err)
	}
	if _, gone := s.present(t, keys); len(gone) > 0 || s.Stats().Evictions != 0 {
		t.Fatalf("evicted %q (%d evictions) for a reservation that could not fit", gone, s.Stats().Evictions)
	}
	// 1.5 MiB of new bytes fit once the small files are gone.
	s.put(t, "new", pattern(10, 3<<19))
	if _, gone := s.present(t, keys); len(gone) == 0 {
		t.Fatalf("nothing evicted for a put that needed it")
	}
	equalBytes(t, "log", s.read(t, "log"), pattern(9, big))
	s.checkAlloc(t)
}

func sameSet(a, b []string) bool {
	return slices.Equal(slices.Sorted(slices.Values(a)), slices.Sorted(slices.Values(b)))
}

// TestEvictNeverTakesAnOpenDraft races eviction of a file against opening
// it for writing: either the open fails with ErrStale (the file was gone
// first) or the draft it returns commits into the file, which eviction
// then leaves alone. A commit into nowhere would be a lost write.
func TestEvictNeverTakesAnOpenDraft(t *testing.T) {
	// Slow swaps hold eviction between its open check and its swap long
	// enough for the open to run in between.
	idx := store.NewEmbedded()
	t.Cleanup(func() { _ = idx.Close() })
	s := newTestStore(t, 4<<20, withIndex(slowSwaps{idx, time.Millisecond}))
	ctx := context.Background()
	opened, evicted := 0, 0
	for i := range 300 {
		key := fmt.Sprintf("f%d", i%4)
		o := s.put(t, key, pattern(byte(i), 64<<10))
		done := make(chan bool)
		go func() { done <- store.EvictKey(s.Store, key) }()
		// Give eviction a head start of 0, 0.5 or 1 ms: the open lands
		// before its check, during its swap, or after it.
		time.Sleep(time.Duration(i%3) * 500 * time.Microsecond)
		d, err := s.OpenDraft(ctx, key, o.Ino, false)
		if ev := <-done; ev {
			evicted++
		}
		if errors.Is(err, store.ErrStale) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		opened++
		if _, err := d.WriteAt(ctx, []byte("mine"), 0); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Commit(ctx, store.CommitOptions{Key: key, IfIno: o.Ino}); err != nil {
			t.Fatalf("round %d: an open draft could not commit (evicted under it?): %v", i, err)
		}
		d.Close()
		if got := s.read(t, key); string(got[:4]) != "mine" {
			t.Fatalf("round %d: committed %q, read %q", i, "mine", got[:4])
		}
	}
	t.Logf("%d opens won, %d evictions won", opened, evicted)
	if opened == 0 || evicted == 0 {
		t.Errorf("one side never won: the race was not exercised both ways")
	}
}

// slowSwaps delays every compare-and-swap of an index.
type slowSwaps struct {
	store.Index
	delay time.Duration
}

func (x slowSwaps) CompareAndSwap(ctx context.Context, swaps ...store.Swap) (uint64, error) {
	time.Sleep(x.delay)
	return x.Index.CompareAndSwap(ctx, swaps...)
}

// TestEvictForMetadata: a store of many small values runs out of room for
// their index entries first; with eviction on, a new key evicts the least
// recently used files (never a pinned or open one) and every put lands,
// the entries staying under the limit; with eviction off it fails with
// ErrNoSpace and changes nothing.
func TestEvictForMetadata(t *testing.T) {
	const limit = 32 << 10
	for _, evict := range []bool{true, false} {
		s := newTestStore(t, 4<<20, withOptions(func(o *store.Options) {
			o.MetaLimit, o.HighWater, o.Evict = limit, 1, evict // HighWater 1: no background eviction
		}))
		ctx := context.Background()
		s.put(t, "pinned", pattern(1, 100))
		s.pin(t, "pinned")
		s.put(t, "open", pattern(2, 100))
		r, err := s.OpenReader(ctx, "open")
		if err != nil {
			t.Fatal(err)
		}
		var keys []string
		var failed error
		for i := range 500 {
			k := fmt.Sprintf("k%03d", i)
			if _, err := s.tryPut(k, pattern(byte(i), 100)); err != nil {
				failed = err
				break
			}
			keys = append(keys, k)
		}
		st := s.Stats()
		if st.MetaBytes > limit {
			t.Errorf("evict %v: entries take %d B of a %d B limit", evict, st.MetaBytes, limit)
		}
		if !evict {
			if !errors.Is(failed, store.ErrNoSpace) || len(keys) >= 500 {
				t.Fatalf("no eviction: %d puts, then %v", len(keys), failed)
			}
			if in, _ := s.present(t, keys); len(in) != len(keys) {
				t.Fatalf("no eviction: %d of %d keys left", len(in), len(keys))
			}
			r.Close()
			continue
		}
		if failed != nil {
			t.Fatalf("after %d puts: %v", len(keys), failed)
		}
		in, out := s.present(t, keys)
		if len(out) == 0 || len(in) == 0 || in[len(in)-1] != "k499" || !slices.Contains(out, "k000") {
			t.Fatalf("evicted %v, kept %v: want the oldest gone and the newest there", out, in)
		}
		if got := s.read(t, "k499"); !bytes.Equal(got, pattern(byte(499%256), 100)) {
			t.Fatal("the newest key reads other bytes")
		}
		if kept, _ := s.present(t, []string{"pinned", "open"}); len(kept) != 2 {
			t.Fatalf("pinned and open files: kept %v", kept)
		}
		r.Close()
		s.checkAlloc(t)
	}
}

// TestEvictForMetadataInBackground: past the high watermark of the
// metadata limit the eviction loop takes the entries down to the low one.
func TestEvictForMetadataInBackground(t *testing.T) {
	const limit = 32 << 10
	s := newTestStore(t, 4<<20, withOptions(func(o *store.Options) { o.MetaLimit = limit }))
	d := store.DefaultOptions()
	high, low := uint64(d.HighWater*limit), uint64(d.LowWater*limit)
	last := ""
	for i := 0; s.Stats().MetaBytes <= high; i++ { // the put that passes it kicks the loop
		last = fmt.Sprintf("k%03d", i)
		s.put(t, last, pattern(byte(i), 100))
	}
	waitFor(t, "entries under the low watermark", func() bool { return s.Stats().MetaBytes <= low })
	if in, _ := s.present(t, []string{last}); len(in) != 1 {
		t.Fatal("the newest key was evicted")
	}
}

// TestEvictForMetadataPastEmptyFiles: empty files, which cost entries but
// hold no bytes to evict, at the old end of the LRU do not stop eviction
// from reaching the files behind them; a store whose index other nodes
// share (Follow) does not evict for metadata and says ErrNoSpace.
func TestEvictForMetadataPastEmptyFiles(t *testing.T) {
	const limit = 48 << 10
	for _, follow := range []bool{false, true} {
		s := newTestStore(t, 4<<20, withOptions(func(o *store.Options) {
			o.MetaLimit, o.HighWater, o.Follow = limit, 1, follow
		}))
		for i := range 100 {
			s.put(t, fmt.Sprintf("empty%03d", i), nil)
		}
		var err error
		n := 0
		for ; n < 300 && err == nil; n++ {
			_, err = s.tryPut(fmt.Sprintf("k%03d", n), pattern(byte(n), 100))
		}
		switch {
		case follow && !errors.Is(err, store.ErrNoSpace):
			t.Fatalf("shared index: %d puts, then %v", n, err)
		case !follow && err != nil:
			t.Fatalf("after %d puts past 100 empty files: %v", n-1, err)
		}
		if in, _ := s.present(t, []string{"empty000", "empty099"}); len(in) != 2 {
			t.Fatalf("empty files evicted: kept %v", in)
		}
	}
}

// TestEvictPastPinnedAndOpen: more pinned files, and more open ones, than
// one eviction pass may look at and keep (4096), all at the LRU's end, do
// not keep a write that needs room from evicting the files behind them;
// an unpinned file is evictable again.
func TestEvictPastPinnedAndOpen(t *testing.T) {
	const n, small, big = 4200, 4 << 10, 1 << 20
	s := newTestStore(t, 48<<20, withOptions(func(o *store.Options) { o.HighWater = 1 }))
	ctx := context.Background()
	for i := range n {
		k := fmt.Sprintf("p%d", i)
		s.put(t, k, pattern(1, small))
		s.pin(t, k)
	}
	var readers []*store.Reader
	t.Cleanup(func() {
		for _, r := range readers {
			r.Close()
		}
	})
	for i := range n {
		k := fmt.Sprintf("r%d", i)
		s.put(t, k, pattern(2, small))
		r, err := s.OpenReader(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		readers = append(readers, r)
	}
	var old []string
	for i := 0; s.used()+big <= 48<<20; i++ {
		k := fmt.Sprintf("u%d", i)
		old = append(old, k)
		s.put(t, k, pattern(3, big))
	}
	for i := range 4 {
		s.put(t, fmt.Sprintf("new%d", i), pattern(4, big)) // needs room: evicts
	}
	if _, gone := s.present(t, old); len(gone) < 4 {
		t.Fatalf("evicted %q of the unpinned closed files", gone)
	}
	for i := range n {
		for _, k := range []string{fmt.Sprintf("p%d", i), fmt.Sprintf("r%d", i)} {
			if _, err := s.Index.Get(ctx, k); err != nil {
				t.Fatalf("%s, pinned or open: %v", k, err)
			}
		}
	}
	// Unpinned, a file is evictable again (the unpin puts it back in the
	// LRU, now its most recent end).
	if _, err := s.Update(ctx, "p0", 0, func(o *store.Object) error { o.Pinned = false; return nil }); err != nil {
		t.Fatal(err)
	}
	if lru := store.LRUTail(s.Store, 3*n); len(lru) == 0 || lru[len(lru)-1] != "p0" || slices.Contains(lru, "p1") {
		t.Fatalf("the LRU after p0's unpin, most recent last: ...%q", lru[max(0, len(lru)-3):])
	}
	if !store.EvictKey(s.Store, "p0") {
		t.Fatal("p0, unpinned, cannot be evicted")
	}
	s.checkAlloc(t)
}

// TestEvictPastBatchReads: eviction passes over the files batch gets are
// reading (bare leases, which the open count leaves out) as over open
// ones: a write short of room evicts one file it can free, not the keys
// being read and then more in their stead; when every file is being
// read, it fails with ErrNoSpace and evicts none.
func TestEvictPastBatchReads(t *testing.T) {
	const keys, size = 16, 64 << 10
	s := newTestStore(t, keys*size, withOptions(func(o *store.Options) { o.HighWater, o.LowWater = 1, 1 }))
	ctx := context.Background()
	names := make([]string, keys)
	for i := range names {
		names[i] = fmt.Sprintf("k%02d", i)
		p := s.StartPuts(ctx, []store.PutSpec{{Key: names[i], Bufs: []transfer.Buffer{transfer.HostBuffer(pattern(byte(i), size))}, Place: store.DefaultPlacement()}})
		if _, errs := p.Commit(); errs[0] != nil {
			t.Fatal(errs[0])
		}
		p.Release()
	}
	read := func(n int) []*store.Reader {
		t.Helper()
		rs, errs := s.OpenReadersUntouched(ctx, names[:n]) // the least recently used
		if errs != nil {
			t.Fatal(errs)
		}
		for _, r := range rs {
			if !store.Bare(r) {
				t.Fatalf("%s leased under the store's lock", r.Object().Key)
			}
		}
		return rs
	}
	rs := read(4)
	before := s.Stats().Evictions
	if _, err := s.tryPut("w1", pattern(100, size)); err != nil {
		t.Fatal(err)
	}
	if n := s.Stats().Evictions - before; n != 1 {
		t.Fatalf("%d files evicted for one file's room, 4 of 16 being read", n)
	}
	if _, gone := s.present(t, names[:4]); len(gone) > 0 {
		t.Fatalf("evicted %q while batch gets read them", gone)
	}
	s.CloseReaders(rs)
	// Every file being read: nothing to evict.
	all, _ := s.present(t, append(slices.Clone(names), "w1"))
	rs, errs := s.OpenReadersUntouched(ctx, all)
	if errs != nil {
		t.Fatal(errs)
	}
	before = s.Stats().Evictions
	if _, err := s.tryPut("w2", pattern(101, size)); !errors.Is(err, store.ErrNoSpace) {
		t.Fatalf("a write with every file being read: %v, want ErrNoSpace", err)
	}
	if n := s.Stats().Evictions - before; n != 0 {
		t.Fatalf("%d files evicted with every file being read", n)
	}
	s.CloseReaders(rs)
	s.checkAlloc(t)
}

// TestMetaRoomOfBatches: batch puts of new keys into a store whose
// entries are at their limit: each key finds room by evicting older
// ones, counting the keys of its own batch not yet in the index, so no
// key fails for room and the entries never pass the limit. (Before,
// every key checked the limit against the index alone: a batch of 128
// passed it by its own keys, and keys of the next batch failed with
// ErrNoSpace while eviction caught up.)
func TestMetaRoomOfBatches(t *testing.T) {
	const limit = 1 << 20
	s := newTestStore(t, 64<<20, withOptions(func(o *store.Options) { o.MetaLimit = limit }))
	ctx := context.Background()
	data := []byte("v")
	specs := make([]store.PutSpec, 128)
	for round := range 200 {
		for k := range specs {
			specs[k] = store.PutSpec{Key: fmt.Sprintf("r%03d-k%03d-%s", round, k, strings.Repeat("x", 24)),
				Bufs: []transfer.Buffer{transfer.HostBuffer(data)}, Place: store.DefaultPlacement(),
				SetXattrs: map[string][]byte{"user.mooncake.meta": []byte("f16 (1, 2, 3)")}}
		}
		p := s.StartPuts(ctx, specs)
		_, errs := p.Commit()
		err := errors.Join(errs...) // before Release takes errs back
		p.Release()
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if m := s.Stats().MetaBytes; m > limit {
			t.Fatalf("round %d: entries take %d B, limit %d", round, m, limit)
		}
	}
	if st := s.Stats(); st.Evictions == 0 {
		t.Fatalf("nothing evicted: %+v", st)
	}
}

// TestMetaRoomOfBatchAtLimit: a batch of new keys that does not fit the
// metadata limit as a whole, eviction off: the keys that fit commit, in
// order, and the rest fail with ErrNoSpace alone; the entries stay under
// the limit and no room stays held. A batch that fits takes its room at
// once and holds none after either. In a directory whose placement its
// new keys inherit, the keys take more room than the batch reserved for
// them: the last ones find theirs alone.
func TestMetaRoomOfBatchAtLimit(t *testing.T) {
	const limit = 16 << 10
	for _, dir := range []string{"", "placed/"} {
		s := newTestStore(t, 16<<20, withOptions(func(o *store.Options) { o.MetaLimit, o.Evict = limit, false }))
		ctx := context.Background()
		if dir != "" {
			x := map[string][]byte{store.XattrPlacement: []byte(store.PolicyLocal)}
			if _, err := s.Mkdir(ctx, strings.TrimSuffix(dir, "/"), &store.Object{Mode: 0o755, Xattrs: x}); err != nil {
				t.Fatal(err)
			}
		}
		batch := func(round, n int) []error {
			specs := make([]store.PutSpec, n)
			for k := range specs {
				specs[k] = store.PutSpec{Key: fmt.Sprintf("%sr%d-k%03d", dir, round, k), Bufs: []transfer.Buffer{transfer.HostBuffer([]byte("v"))},
					Place: store.DefaultPlacement(), SetXattrs: map[string][]byte{"user.mooncake.meta": []byte("f16 (4,)")}}
			}
			p := s.StartPuts(ctx, specs)
			_, errs := p.Commit()
			errs = slices.Clone(errs) // Release takes them back
			p.Release()
			if held := store.MetaHeld(s.Store); held != 0 {
				t.Fatalf("%q round %d: %d B of metadata held after the commit", dir, round, held)
			}
			return errs
		}
		before := s.Stats().MetaBytes
		if err := errors.Join(batch(0, 8)...); err != nil {
			t.Fatalf("%q: a batch far from the limit: %v", dir, err)
		}
		if dir != "" {
			o, err := s.Lookup(ctx, dir+"r0-k000")
			if err != nil || o.Xattrs[store.XattrPlacement] == nil {
				t.Fatalf("%q: the directory's placement was not passed on: %v", dir, err)
			}
			if got := s.Stats().MetaBytes - before; got < 8*o.MetaBytes() {
				t.Fatalf("%q: 8 keys of %d B took %d B", dir, o.MetaBytes(), got)
			}
		}
		errs := batch(1, 128) // about 3 times what is left
		fit := 0
		for fit < len(errs) && errs[fit] == nil {
			fit++
		}
		if fit == 0 || fit == len(errs) {
			t.Fatalf("%q: %d of %d keys fit", dir, fit, len(errs))
		}
		for k, err := range errs[fit:] {
			if !errors.Is(err, store.ErrNoSpace) {
				t.Fatalf("%q: key %d, after the %d that fit: %v, want ErrNoSpace", dir, fit+k, fit, err)
			}
		}
		if st := s.Stats(); st.MetaBytes > limit || st.MetaBytes+400 < limit {
			t.Fatalf("%q: entries take %d B of a %d B limit", dir, st.MetaBytes, limit)
		}
	}
}

// TestOnEvict: the hook hears of each file eviction takes, with its
// inode, and of nothing else (a removal, a put, a file kept); a hook set
// later replaces it, and each one's stop ends its own calls only.
func TestOnEvict(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	data := []byte("x")
	type note struct {
		key string
		ino uint64
	}
	var heard []note
	stop := s.OnEvict(func(key string, ino uint64) { heard = append(heard, note{key, ino}) })
	first := s.put(t, "k0", data)
	if !store.EvictKey(s.Store, "k0") {
		t.Fatal("k0 not evicted")
	}
	if want := []note{{"k0", first.Ino}}; !slices.Equal(heard, want) {
		t.Fatalf("heard %v, want %v", heard, want)
	}
	if err := s.Delete(ctx, s.put(t, "gone", data).Key, 0); err != nil {
		t.Fatal(err)
	}
	s.put(t, "k0", data) // a new file under the evicted key
	s.put(t, "k0", data) // and its replacement
	if _, err := s.Create(ctx, "empty", nil, true); err != nil {
		t.Fatal(err)
	}
	if store.EvictKey(s.Store, "empty") { // nothing here to evict: kept
		t.Fatal("an empty file evicted")
	}
	if len(heard) != 1 {
		t.Fatalf("heard %v after a removal, puts and a file kept", heard)
	}
	second := 0
	stop2 := s.OnEvict(func(string, uint64) { second++ })
	stop() // the first one's: the second stays
	s.put(t, "k1", data)
	if !store.EvictKey(s.Store, "k1") || len(heard) != 1 || second != 1 {
		t.Fatalf("k1 evicted under the second hook: first heard %v, second %d times", heard, second)
	}
	stop2()
	s.put(t, "k2", data)
	if !store.EvictKey(s.Store, "k2") || second != 1 {
		t.Fatalf("k2 not evicted, or heard of after the stop: %d", second)
	}
}

// A write short of room while another pass (the evict loop) is evicting
// the one key it could evict waits for that pass instead of failing with
// ENOSPC: the room is on its way back. That pass may end with the key
// gone ("done": the write takes the room it freed) or give it up
// ("given-up": the write evicts it itself). (The race behind a rare
// failure of the end-to-end TestWriteAfterEviction under load: its write
// found the file it could evict already taken by the evict loop, and
// gave up.)
func TestEvictWaitsForAnotherPass(t *testing.T) {
	for _, ending := range []string{"done", "given-up"} {
		t.Run(ending, func(t *testing.T) {
			const size, obj = 8 << 20, 3 << 20
			s := newTestStore(t, size, withOptions(func(o *store.Options) { o.HighWater = 1 }))
			ctx := context.Background()
			s.put(t, "a", pattern(1, obj))
			b := s.put(t, "b", pattern(2, obj))
			open, err := s.OpenReader(ctx, "a") // open: not evictable
			if err != nil {
				t.Fatal(err)
			}
			defer open.Close()
			end := store.MarkEvicting(s.Store, b.Ino) // another pass is evicting b
			res := make(chan error, 1)
			go func() {
				_, err := s.tryPut("c", pattern(3, obj))
				res <- err
			}()
			select {
			case err := <-res:
				t.Fatalf("the put of c ended (%v) while b's eviction was under way", err)
			case <-time.After(100 * time.Millisecond):
			}
			if ending == "done" {
				if err := s.Delete(ctx, "b", 0); err != nil { // what that pass did
					t.Fatal(err)
				}
			}
			end()
			select {
			case err := <-res:
				if err != nil {
					t.Fatalf("put of c: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the put of c still waits")
			}
			if in, _ := s.present(t, []string{"a", "b", "c"}); !slices.Equal(in, []string{"a", "c"}) {
				t.Fatalf("present: %q, want a and c (b gone)", in)
			}
			equalBytes(t, "c", s.read(t, "c"), pattern(3, obj))
			s.checkAlloc(t)
		})
	}
}

// etcdIndexOf starts an etcd and returns it with an index on it under a
// fresh prefix (name), whose requests and dials time out after timeout:
// a test stops and starts the etcd to take the index away.
func etcdIndexOf(t *testing.T, name string, timeout time.Duration) (*etcdtest.Server, *etcdindex.Index) {
	t.Helper()
	srv := etcdtest.Start(t)
	x, err := etcdindex.New(etcdindex.Options{Endpoints: []string{srv.ClientURL}, Prefix: fmt.Sprintf("/%s-%d/", name, time.Now().UnixNano()),
		RequestTimeout: timeout, DialTimeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	return srv, x
}

// TestEvictStopsWhenIndexUnavailable: with etcd away, a write into a full
// store ends its eviction pass at the first key whose removal etcd does
// not answer, and fails with the index's error (ETIMEDOUT to a user), its
// keys all kept, and so does a peer's reservation; each of the pass's
// keys waited RequestTimeout before, a write behind it for minutes. The first key's removal or, when etcd
// went before its watch delivered the last put, its cached read waits out
// the timeout (both are ErrUnavailable). Once etcd is back the write
// evicts and lands.
func TestEvictStopsWhenIndexUnavailable(t *testing.T) {
	const timeout = time.Second
	srv, x := etcdIndexOf(t, "evict", timeout)
	const size, obj, keys = 8 << 20, 512 << 10, 16
	s := newTestStore(t, size, withIndex(x), withOptions(func(o *store.Options) { o.HighWater = 1 }))
	var names []string
	for i := range keys {
		names = append(names, fmt.Sprintf("k%02d", i))
		s.put(t, names[i], pattern(byte(i+1), obj))
	}
	if free := s.Table.Stats().Free; free != 0 {
		t.Fatalf("%d B free after filling the store", free)
	}
	// The index's cache caught up with the last put (a read waits for
	// it): with etcd gone before its watch delivered that put, every
	// read below would wait out the timeout instead of reading the cache
	// (a failure of this test, 2026-12-07: "cache at revision 16 has not
	// reached this node's write at 17").
	if in, _ := s.present(t, names); len(in) != keys {
		t.Fatalf("present before etcd went: %q, want all %d", in, keys)
	}

	srv.Stop()
	start := time.Now()
	_, err := s.tryPut("new", pattern(99, 2*obj))
	took := time.Since(start)
	if !errors.Is(err, store.ErrUnavailable) || errors.Is(err, store.ErrNoSpace) {
		t.Fatalf("put into a full store with etcd away: %v; want ErrUnavailable", err)
	}
	// A hang guard, not a latency assertion: one key's wait, not one for
	// each of the 16.
	if took > keys/2*timeout {
		t.Fatalf("put into a full store with etcd away took %v (request timeout %v, %d keys)", took, timeout, keys)
	}
	t.Logf("put into a full store with etcd away failed after %v: %v", took, err)
	// A peer's reservation here fails the same way, and says so on the
	// wire (transfer.ErrIndexUnavailable), not that this node is full.
	_, err = s.Control(context.Background(), transfer.ControlRequest{Op: transfer.CtlReserve, Bytes: 2 * obj, TTLMillis: 1000})
	if !errors.Is(err, transfer.ErrIndexUnavailable) || errors.Is(err, transfer.ErrNoSpace) {
		t.Fatalf("a peer's reservation in a full store with etcd away: %v; want transfer.ErrIndexUnavailable", err)
	}
	if in, _ := s.present(t, names); len(in) != keys {
		t.Fatalf("present with etcd away: %q, want all %d", in, keys)
	}
	s.checkAlloc(t)

	srv.Start()
	waitFor(t, "a put evicting once etcd is back", func() bool {
		_, err := s.tryPut("new", pattern(99, 2*obj))
		return err == nil
	})
	equalBytes(t, "new", s.read(t, "new"), pattern(99, 2*obj))
	if in, _ := s.present(t, names); len(in) >= keys {
		t.Fatalf("present after the put: %d keys, want some evicted", len(in))
	}
	s.checkAlloc(t)
}

// TestMetaRoomStopsWhenIndexUnavailable: with etcd away, a new key that
// needs metadata room the store's eviction cannot make (its removals go
// through the index) fails with the index's error, ETIMEDOUT to a user,
// as a write short of bytes does, not with ErrNoSpace; every key stays,
// and the put lands once etcd is back.
func TestMetaRoomStopsWhenIndexUnavailable(t *testing.T) {
	srv, x := etcdIndexOf(t, "meta", time.Second)
	const limit = 8 << 10
	s := newTestStore(t, 4<<20, withIndex(x), withOptions(func(o *store.Options) { o.MetaLimit, o.HighWater = limit, 1 }))
	// Twice as many keys as the entries' room holds: the later ones
	// evicted the first, and any new key needs room now.
	for i := range 2 * limit / 300 {
		s.put(t, fmt.Sprintf("k%03d", i), pattern(byte(i), 100))
	}
	names := s.keys(t)
	srv.Stop()
	_, put := s.tryPut("new", pattern(99, 100))
	if !errors.Is(put, store.ErrUnavailable) || errors.Is(put, store.ErrNoSpace) {
		t.Fatalf("a new key short of metadata room with etcd away: %v; want ErrUnavailable", put)
	}
	if in, _ := s.present(t, names); len(in) != len(names) {
		t.Fatalf("present with etcd away: %d of %d keys", len(in), len(names))
	}
	srv.Start()
	waitFor(t, "a new key once etcd is back", func() bool {
		_, err := s.tryPut("back", pattern(98, 100))
		return err == nil
	})
	equalBytes(t, "back", s.read(t, "back"), pattern(98, 100))
}
