// Package indextest is the conformance suite for store.Index
// implementations. Every implementation (the embedded index, etcd) runs the
// same suite from its own test:
//
//	func TestEmbeddedConformance(t *testing.T) {
//		indextest.Run(t, func(t *testing.T) store.Index {
//			x := store.NewEmbedded()
//			t.Cleanup(func() { x.Close() })
//			return x
//		})
//	}
//
// newIndex must return a fresh, empty index for each subtest and arrange its
// own cleanup with t.Cleanup; that cleanup must tolerate an index the suite
// has already closed. The suite never waits on a clock: watch events are
// awaited with a generous deadline that only turns a hang into a failure.
package indextest

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
)

// hangLimit bounds a wait for a watch event or for a channel to close. It
// is not a latency assertion: reaching it means the event never came.
const hangLimit = 30 * time.Second

// Run runs the suite against the implementation newIndex makes.
func Run(t *testing.T, newIndex func(t *testing.T) store.Index) {
	tests := []struct {
		name string
		fn   func(t *testing.T, x store.Index)
	}{
		{"GetNotFound", testGetNotFound},
		{"CreateAndGet", testCreateAndGet},
		{"KeepsItsOwnCopy", testKeepsItsOwnCopy},
		{"VersionConflict", testVersionConflict},
		{"MultiKeyAtomic", testMultiKeyAtomic},
		{"DuplicateKeyInOneSwap", testDuplicateKey},
		{"Delete", testDelete},
		{"VersionsIncrease", testVersionsIncrease},
		{"Scan", testScan},
		{"ScanPaging", testScanPaging},
		{"Watch", testWatch},
		{"WatchPrefix", testWatchPrefix},
		{"WatchClosesOnCancel", testWatchClosesOnCancel},
		{"WatchOrderUnderConcurrency", testWatchConcurrent},
		{"ConcurrentIncrements", testConcurrentIncrements},
		{"DirChecks", testDirChecks},
		{"FindEntry", testFindEntry},
		{"Close", testClose},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.fn(t, newIndex(t))
		})
	}
}

// obj returns a file object with every field set, so that an index that
// loses a field on its way through storage fails Get.
func obj(key string, size uint64) *store.Object {
	return &store.Object{
		Key: key, Kind: store.KindFile, Ino: 1000 + size, Size: size,
		Mode: 0o640, Uid: 7, Gid: 8, Mtime: 1_700_000_000_000_000_001, Ctime: 1_700_000_000_000_000_002,
		Pinned: size%2 == 1,
		Xattrs: map[string][]byte{"tag": []byte(key)},
		Replicas: []store.Replica{
			{Node: "n1", Extents: []segment.Extent{{Segment: 1, Off: 4096, Len: 4096}, {Segment: 2, Off: 0, Len: 8192}}},
			{Node: "n2", Extents: []segment.Extent{{Segment: 3, Off: 12288, Len: 12288}}},
		},
	}
}

func put(t *testing.T, x store.Index, key string, old uint64, o *store.Object) uint64 {
	t.Helper()
	rev, err := x.CompareAndSwap(context.Background(), store.Swap{Key: key, Old: old, New: o})
	if err != nil {
		t.Fatalf("CompareAndSwap(%q, old %d): %v", key, old, err)
	}
	return rev
}

func mustGet(t *testing.T, x store.Index, key string) *store.Object {
	t.Helper()
	o, err := x.Get(context.Background(), key)
	if err != nil {
		t.Fatalf("Get(%q): %v", key, err)
	}
	return o
}

func wantAbsent(t *testing.T, x store.Index, key string) {
	t.Helper()
	if o, err := x.Get(context.Background(), key); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("Get(%q) = %+v, %v; want ErrNotFound", key, o, err)
	}
}

// same compares two objects field by field, treating nil and empty
// collections alike (an encoding may not tell them apart).
func same(a, b *store.Object) bool {
	ac, bc := a.Clone(), b.Clone()
	for _, c := range []*store.Object{ac, bc} {
		if len(c.Xattrs) == 0 {
			c.Xattrs = nil
		}
		if len(c.Replicas) == 0 {
			c.Replicas = nil
		}
		for i := range c.Replicas {
			if len(c.Replicas[i].Extents) == 0 {
				c.Replicas[i].Extents = nil
			}
		}
	}
	return reflect.DeepEqual(ac, bc)
}

func testGetNotFound(t *testing.T, x store.Index) {
	wantAbsent(t, x, "nothing")
	wantAbsent(t, x, "")
	put(t, x, "a/b", 0, obj("a/b", 1))
	wantAbsent(t, x, "a") // a prefix is not a key
	wantAbsent(t, x, "a/b/c")
}

func testCreateAndGet(t *testing.T, x store.Index) {
	o := obj("dir/file", 42)
	want := o.Clone()
	rev := put(t, x, "dir/file", 0, o)
	if rev == 0 {
		t.Fatal("CompareAndSwap returned version 0")
	}
	if o.Version != rev {
		t.Errorf("New.Version = %d after a swap at %d; the caller's object must carry the version", o.Version, rev)
	}
	want.Version = rev
	got := mustGet(t, x, "dir/file")
	if !same(got, want) {
		t.Errorf("Get = %+v\nwant  %+v", got, want)
	}
	// Old == 0 means "must be absent": creating twice conflicts.
	_, err := x.CompareAndSwap(context.Background(), store.Swap{Key: "dir/file", New: obj("dir/file", 43)})
	if !errors.Is(err, store.ErrConflict) {
		t.Fatalf("second create: %v, want ErrConflict", err)
	}
	if got := mustGet(t, x, "dir/file"); !same(got, want) {
		t.Errorf("failed create changed the object: %+v", got)
	}
	// A dir object round-trips too.
	d := &store.Object{Key: "dir", Kind: store.KindDir, Ino: 5, Mode: 0o755}
	rev = put(t, x, "dir", 0, d)
	if got := mustGet(t, x, "dir"); got.Kind != store.KindDir || got.Version != rev || got.Ino != 5 {
		t.Errorf("Get(dir) = %+v", got)
	}
}

func testKeepsItsOwnCopy(t *testing.T, x store.Index) {
	o := obj("k", 10)
	put(t, x, "k", 0, o)
	o.Size = 999
	o.Xattrs["tag"][0] = 'X'
	o.Replicas[0].Extents[0].Off = 1 << 40
	got := mustGet(t, x, "k")
	if got.Size != 10 || string(got.Xattrs["tag"]) != "k" || got.Replicas[0].Extents[0].Off != 4096 {
		t.Fatalf("changing the caller's object after the swap changed the index: %+v", got)
	}
}

func testVersionConflict(t *testing.T, x store.Index) {
	ctx := context.Background()
	v1 := put(t, x, "k", 0, obj("k", 1))
	before := mustGet(t, x, "k")
	for _, old := range []uint64{v1 + 1, v1 - 1, 0} {
		if old == v1 {
			continue
		}
		n := obj("k", 2)
		_, err := x.CompareAndSwap(ctx, store.Swap{Key: "k", Old: old, New: n})
		if !errors.Is(err, store.ErrConflict) {
			t.Fatalf("swap with old %d (current %d): %v, want ErrConflict", old, v1, err)
		}
		// Deleting with the wrong version conflicts too.
		_, err = x.CompareAndSwap(ctx, store.Swap{Key: "k", Old: old})
		if !errors.Is(err, store.ErrConflict) {
			t.Fatalf("delete with old %d (current %d): %v, want ErrConflict", old, v1, err)
		}
	}
	// Updating an absent key with a version conflicts.
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "absent", Old: v1, New: obj("absent", 1)}); !errors.Is(err, store.ErrConflict) {
		t.Fatalf("update absent key: %v, want ErrConflict", err)
	}
	wantAbsent(t, x, "absent")
	if got := mustGet(t, x, "k"); !same(got, before) {
		t.Fatalf("failed swaps changed the object: %+v, want %+v", got, before)
	}
	// The right version succeeds.
	v2 := put(t, x, "k", v1, obj("k", 2))
	if got := mustGet(t, x, "k"); got.Size != 2 || got.Version != v2 {
		t.Fatalf("Get after update = %+v", got)
	}
}

func testMultiKeyAtomic(t *testing.T, x store.Index) {
	ctx := context.Background()
	va := put(t, x, "a", 0, obj("a", 1))
	vb := put(t, x, "b", 0, obj("b", 1))
	before := map[string]*store.Object{"a": mustGet(t, x, "a"), "b": mustGet(t, x, "b")}

	// Each batch has one failing condition, in every position.
	for i, swaps := range [][]store.Swap{
		{{Key: "a", Old: va, New: obj("a", 2)}, {Key: "b", Old: vb + 100, New: obj("b", 2)}},
		{{Key: "b", Old: vb + 100, New: obj("b", 2)}, {Key: "a", Old: va, New: obj("a", 2)}},
		{{Key: "c", New: obj("c", 1)}, {Key: "a", Old: va}, {Key: "b", Old: 0, New: obj("b", 3)}},
		{{Key: "a", Old: va}, {Key: "b", Old: vb}, {Key: "d", Old: 1, New: obj("d", 1)}},
	} {
		if _, err := x.CompareAndSwap(ctx, swaps...); !errors.Is(err, store.ErrConflict) {
			t.Fatalf("batch %d: %v, want ErrConflict", i, err)
		}
		for k, o := range before {
			if got := mustGet(t, x, k); !same(got, o) {
				t.Fatalf("batch %d changed %q: %+v, want %+v", i, k, got, o)
			}
		}
		wantAbsent(t, x, "c")
		wantAbsent(t, x, "d")
	}

	// All conditions hold: everything applies at one version.
	na, nc := obj("a", 5), obj("c", 5)
	rev, err := x.CompareAndSwap(ctx,
		store.Swap{Key: "a", Old: va, New: na},
		store.Swap{Key: "b", Old: vb},
		store.Swap{Key: "c", Old: 0, New: nc})
	if err != nil {
		t.Fatal(err)
	}
	wantAbsent(t, x, "b")
	for _, k := range []string{"a", "c"} {
		if got := mustGet(t, x, k); got.Version != rev || got.Size != 5 {
			t.Fatalf("Get(%q) = %+v, want size 5 at version %d", k, got, rev)
		}
	}
	if na.Version != rev || nc.Version != rev {
		t.Fatalf("New versions %d, %d; want %d", na.Version, nc.Version, rev)
	}
}

func testDuplicateKey(t *testing.T, x store.Index) {
	v := put(t, x, "a", 0, obj("a", 1))
	before := mustGet(t, x, "a")
	_, err := x.CompareAndSwap(context.Background(),
		store.Swap{Key: "a", Old: v, New: obj("a", 2)},
		store.Swap{Key: "a", Old: v, New: obj("a", 3)})
	if err == nil {
		t.Fatal("a swap naming one key twice succeeded")
	}
	if got := mustGet(t, x, "a"); !same(got, before) {
		t.Fatalf("rejected swap changed the object: %+v", got)
	}
	// A new key twice, and a delete of a missing key twice: refused, and
	// nothing of them is left (the key can be made after).
	for _, swaps := range [][]store.Swap{
		{{Key: "n", New: obj("n", 1)}, {Key: "m", New: obj("m", 1)}, {Key: "n", New: obj("n", 2)}},
		{{Key: "n"}, {Key: "n"}},
	} {
		if _, err := x.CompareAndSwap(context.Background(), swaps...); err == nil {
			t.Fatalf("%d swaps naming n twice succeeded", len(swaps))
		}
		wantAbsent(t, x, "n")
		wantAbsent(t, x, "m")
	}
	put(t, x, "n", 0, obj("n", 3))
	if got := mustGet(t, x, "n"); got.Size != 3 {
		t.Fatalf("n after the refused swaps: %+v", got)
	}
}

func testDelete(t *testing.T, x store.Index) {
	ctx := context.Background()
	v := put(t, x, "k", 0, obj("k", 1))
	put(t, x, "k2", 0, obj("k2", 1))
	rev, err := x.CompareAndSwap(ctx, store.Swap{Key: "k", Old: v})
	if err != nil {
		t.Fatal(err)
	}
	if rev <= v {
		t.Fatalf("delete at version %d, not after %d", rev, v)
	}
	wantAbsent(t, x, "k")
	mustGet(t, x, "k2")
	// Deleting again with the old version conflicts.
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "k", Old: v}); !errors.Is(err, store.ErrConflict) {
		t.Fatalf("second delete: %v, want ErrConflict", err)
	}
	// The key can be created again.
	v3 := put(t, x, "k", 0, obj("k", 3))
	if got := mustGet(t, x, "k"); got.Version != v3 || got.Size != 3 {
		t.Fatalf("recreated = %+v", got)
	}
	objs, err := x.Scan(ctx, "", "", 0)
	if err != nil {
		t.Fatal(err)
	}
	if keys := keysOf(objs); !slices.Equal(keys, []string{"k", "k2"}) {
		t.Fatalf("Scan after delete = %q", keys)
	}
}

func testVersionsIncrease(t *testing.T, x store.Index) {
	var last uint64
	var lastK uint64
	for i := range 20 {
		key := fmt.Sprintf("k%d", i%3)
		var old uint64
		if o, err := x.Get(context.Background(), key); err == nil {
			old = o.Version
		}
		rev := put(t, x, key, old, obj(key, uint64(i)))
		if rev <= last {
			t.Fatalf("swap %d got version %d after %d", i, rev, last)
		}
		if key == "k0" {
			if got := mustGet(t, x, "k0"); got.Version != rev || got.Version <= lastK {
				t.Fatalf("k0 version %d, want %d (> %d)", got.Version, rev, lastK)
			}
			lastK = rev
		}
		last = rev
	}
}

func keysOf(objs []*store.Object) []string {
	var keys []string
	for _, o := range objs {
		keys = append(keys, o.Key)
	}
	return keys
}

// scanKeys sort around '/': "." (0x2e) < "/" (0x2f) < "0" (0x30).
var scanKeys = []string{"d", "d.x", "d/a", "d/a.b", "d/a/x", "d/a/y", "d/a0", "d/b", "d0", "e"}

func testScan(t *testing.T, x store.Index) {
	ctx := context.Background()
	// Insert out of order.
	for _, i := range []int{5, 2, 9, 0, 7, 3, 8, 1, 6, 4} {
		put(t, x, scanKeys[i], 0, obj(scanKeys[i], uint64(i)))
	}
	for _, tc := range []struct {
		prefix, from string
		limit        int
		want         []string
	}{
		{"", "", 0, scanKeys},
		{"", "", -1, scanKeys},
		{"", "", 3, scanKeys[:3]},
		{"d/", "", 0, []string{"d/a", "d/a.b", "d/a/x", "d/a/y", "d/a0", "d/b"}},
		{"d/", "", 2, []string{"d/a", "d/a.b"}},
		{"d/", "d/a/", 0, []string{"d/a/x", "d/a/y", "d/a0", "d/b"}},
		{"d/", "d/a/y", 0, []string{"d/a/y", "d/a0", "d/b"}},
		{"d/", "d/a/y\x00", 0, []string{"d/a0", "d/b"}},
		{"d/", "d/a0", 1, []string{"d/a0"}},
		{"d/", "a", 0, []string{"d/a", "d/a.b", "d/a/x", "d/a/y", "d/a0", "d/b"}}, // from before prefix
		{"d/", "e", 0, nil}, // from after prefix
		{"d/a/", "", 0, []string{"d/a/x", "d/a/y"}},
		{"d", "", 0, []string{"d", "d.x", "d/a", "d/a.b", "d/a/x", "d/a/y", "d/a0", "d/b", "d0"}},
		{"d/a", "", 0, []string{"d/a", "d/a.b", "d/a/x", "d/a/y", "d/a0"}},
		{"e", "", 0, []string{"e"}},
		{"f", "", 0, nil},
		{"", "d0", 0, []string{"d0", "e"}},
		{"", "zzz", 0, nil},
	} {
		objs, err := x.Scan(ctx, tc.prefix, tc.from, tc.limit)
		if err != nil {
			t.Fatalf("Scan(%q, %q, %d): %v", tc.prefix, tc.from, tc.limit, err)
		}
		if got := keysOf(objs); !slices.Equal(got, tc.want) {
			t.Errorf("Scan(%q, %q, %d) = %q, want %q", tc.prefix, tc.from, tc.limit, got, tc.want)
		}
		for _, o := range objs {
			if o.Version == 0 || o.Size != uint64(slices.Index(scanKeys, o.Key)) {
				t.Errorf("Scan returned %+v", o)
			}
		}
	}
}

// testScanPaging pages through many keys the way store.List does.
func testScanPaging(t *testing.T, x store.Index) {
	ctx := context.Background()
	var want []string
	for i := range 300 {
		k := fmt.Sprintf("p/%04d", i)
		want = append(want, k)
		put(t, x, k, 0, obj(k, 0))
	}
	put(t, x, "q", 0, obj("q", 0))
	var got []string
	from := ""
	for {
		objs, err := x.Scan(ctx, "p/", from, 64)
		if err != nil {
			t.Fatal(err)
		}
		if len(objs) == 0 {
			break
		}
		if len(objs) > 64 {
			t.Fatalf("Scan with limit 64 returned %d", len(objs))
		}
		got = append(got, keysOf(objs)...)
		from = objs[len(objs)-1].Key + "\x00"
	}
	if !slices.Equal(got, want) {
		t.Fatalf("paged scan returned %d keys, want %d (first difference near %v)", len(got), len(want), firstDiff(got, want))
	}
}

func firstDiff(a, b []string) string {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return fmt.Sprintf("%d: %q vs %q", i, a[i], b[i])
		}
	}
	return "the end"
}

// next receives one event, failing the test if the channel closes or
// nothing arrives within hangLimit.
func next(t *testing.T, ch <-chan store.Event) store.Event {
	t.Helper()
	select {
	case e, ok := <-ch:
		if !ok {
			t.Fatal("watch channel closed early")
		}
		return e
	case <-time.After(hangLimit):
		t.Fatal("no watch event")
	}
	panic("unreachable")
}

// waitClosed drains ch until it is closed.
func waitClosed(t *testing.T, ch <-chan store.Event) {
	t.Helper()
	deadline := time.After(hangLimit)
	for {
		select {
		case _, ok := <-ch:
			if !ok {
				return
			}
		case <-deadline:
			t.Fatal("watch channel not closed")
		}
	}
}

type wantEvent struct {
	typ     store.EventType
	key     string
	version uint64 // for deletes: the version that was removed
	size    uint64
}

func checkEvent(t *testing.T, i int, e store.Event, w wantEvent) {
	t.Helper()
	if e.Object == nil {
		t.Fatalf("event %d: nil object", i)
	}
	if e.Type != w.typ || e.Object.Key != w.key || e.Object.Version != w.version || e.Object.Size != w.size {
		t.Fatalf("event %d = {type %d key %q version %d size %d}, want %+v",
			i, e.Type, e.Object.Key, e.Object.Version, e.Object.Size, w)
	}
}

func testWatch(t *testing.T, x store.Index) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pre := put(t, x, "w/before", 0, obj("w/before", 1))
	ch, err := x.Watch(ctx, "w/")
	if err != nil {
		t.Fatal(err)
	}
	var want []wantEvent
	v1 := put(t, x, "w/a", 0, obj("w/a", 1))
	want = append(want, wantEvent{store.EventPut, "w/a", v1, 1})
	v2 := put(t, x, "w/a", v1, obj("w/a", 2))
	want = append(want, wantEvent{store.EventPut, "w/a", v2, 2})
	v3 := put(t, x, "w/b", 0, obj("w/b", 3))
	want = append(want, wantEvent{store.EventPut, "w/b", v3, 3})
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "w/a", Old: v2}); err != nil {
		t.Fatal(err)
	}
	want = append(want, wantEvent{store.EventDelete, "w/a", v2, 2})
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "w/before", Old: pre}); err != nil {
		t.Fatal(err)
	}
	want = append(want, wantEvent{store.EventDelete, "w/before", pre, 1})
	// A failed swap delivers nothing.
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "w/b", Old: v3 + 100, New: obj("w/b", 9)}); !errors.Is(err, store.ErrConflict) {
		t.Fatalf("bad swap: %v", err)
	}
	v6 := put(t, x, "w/c", 0, obj("w/c", 6))
	want = append(want, wantEvent{store.EventPut, "w/c", v6, 6})
	for i, w := range want {
		checkEvent(t, i, next(t, ch), w)
	}

	// One multi-key swap: both events, same version, nothing in between.
	v7, err := x.CompareAndSwap(ctx,
		store.Swap{Key: "w/b", Old: v3},
		store.Swap{Key: "w/d", New: obj("w/d", 7)})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]store.Event{}
	var seq []store.Event
	for range 2 {
		e := next(t, ch)
		got[e.Object.Key] = e
		seq = append(seq, e)
	}
	checkEvent(t, 0, got["w/b"], wantEvent{store.EventDelete, "w/b", v3, 3})
	checkEvent(t, 1, got["w/d"], wantEvent{store.EventPut, "w/d", v7, 7})
	// Both carry the commit's revision; only the second ends the commit.
	if seq[0].Rev != v7 || seq[1].Rev != v7 || seq[0].Last || !seq[1].Last {
		t.Errorf("multi-key commit events: rev %d/%d last %v/%v, want rev %d, last false/true",
			seq[0].Rev, seq[1].Rev, seq[0].Last, seq[1].Last, v7)
	}
	v8 := put(t, x, "w/e", 0, obj("w/e", 8))
	e := next(t, ch)
	checkEvent(t, 2, e, wantEvent{store.EventPut, "w/e", v8, 8})
	if e.Rev != v8 || !e.Last {
		t.Errorf("single-key commit event: rev %d last %v, want %d true", e.Rev, e.Last, v8)
	}
}

func testWatchPrefix(t *testing.T, x store.Index) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := x.Watch(ctx, "a/")
	if err != nil {
		t.Fatal(err)
	}
	all, err := x.Watch(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, k := range []string{"a", "a0", "b/x", "a/x", "a.b", "a/y/z"} {
		put(t, x, k, 0, obj(k, 0))
		keys = append(keys, k)
	}
	for i, k := range []string{"a/x", "a/y/z"} {
		if e := next(t, ch); e.Object.Key != k {
			t.Fatalf("prefix watch event %d: %q, want %q", i, e.Object.Key, k)
		}
	}
	for i, k := range keys {
		if e := next(t, all); e.Object.Key != k {
			t.Fatalf("watch of everything, event %d: %q, want %q", i, e.Object.Key, k)
		}
	}
	cancel()
	waitClosed(t, ch) // no stray events for other keys before the close
}

func testWatchClosesOnCancel(t *testing.T, x store.Index) {
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := x.Watch(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	v := put(t, x, "k", 0, obj("k", 1))
	checkEvent(t, 0, next(t, ch), wantEvent{store.EventPut, "k", v, 1})
	cancel()
	waitClosed(t, ch)
	// Changes after the cancel still work and do not block on the dead watch.
	for i := range 100 {
		k := fmt.Sprintf("after%d", i)
		put(t, x, k, 0, obj(k, 0))
	}
	// An unread watch does not block commits either; cancelling it closes it.
	ctx2, cancel2 := context.WithCancel(context.Background())
	ch2, err := x.Watch(ctx2, "")
	if err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		k := fmt.Sprintf("unread%d", i)
		put(t, x, k, 0, obj(k, 0))
	}
	cancel2()
	waitClosed(t, ch2)
}

// testWatchConcurrent: under concurrent writers a watcher sees every change
// exactly once, in version order.
func testWatchConcurrent(t *testing.T, x store.Index) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := x.Watch(ctx, "c/")
	if err != nil {
		t.Fatal(err)
	}
	const writers, perWriter = 8, 25
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Go(func() {
			key := fmt.Sprintf("c/%d", w%3) // writers share keys, so some swaps conflict
			done := 0
			for done < perWriter {
				var old uint64
				if o, err := x.Get(ctx, key); err == nil {
					old = o.Version
				} else if !errors.Is(err, store.ErrNotFound) {
					errs <- err
					return
				}
				_, err := x.CompareAndSwap(ctx, store.Swap{Key: key, Old: old, New: obj(key, uint64(w))})
				switch {
				case err == nil:
					done++
				case !errors.Is(err, store.ErrConflict):
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var last uint64
	for i := range writers * perWriter {
		e := next(t, ch)
		if e.Type != store.EventPut || e.Object.Version <= last {
			t.Fatalf("event %d: type %d version %d after version %d", i, e.Type, e.Object.Version, last)
		}
		last = e.Object.Version
	}
}

// testConcurrentIncrements: read-modify-write with CompareAndSwap is a
// correct counter under contention (no lost updates).
func testConcurrentIncrements(t *testing.T, x store.Index) {
	ctx := context.Background()
	const workers, each = 8, 50
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Go(func() {
			for range each {
				for {
					var old, n uint64
					if o, err := x.Get(ctx, "ctr"); err == nil {
						old, n = o.Version, o.Size
					} else if !errors.Is(err, store.ErrNotFound) {
						errs <- err
						return
					}
					_, err := x.CompareAndSwap(ctx, store.Swap{Key: "ctr", Old: old, New: &store.Object{Key: "ctr", Size: n + 1}})
					if err == nil {
						break
					}
					if !errors.Is(err, store.ErrConflict) {
						errs <- err
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got := mustGet(t, x, "ctr"); got.Size != workers*each {
		t.Fatalf("counter = %d, want %d", got.Size, workers*each)
	}
}

func testClose(t *testing.T, x store.Index) {
	ctx := context.Background()
	v := put(t, x, "k", 0, obj("k", 1))
	ch, err := x.Watch(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := x.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	waitClosed(t, ch) // Close ends every watch
	if _, err := x.Get(ctx, "k"); !errors.Is(err, store.ErrClosed) {
		t.Errorf("Get after Close: %v, want ErrClosed", err)
	}
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "k", Old: v, New: obj("k", 2)}); !errors.Is(err, store.ErrClosed) {
		t.Errorf("CompareAndSwap after Close: %v, want ErrClosed", err)
	}
	if _, err := x.Scan(ctx, "", "", 0); !errors.Is(err, store.ErrClosed) {
		t.Errorf("Scan after Close: %v, want ErrClosed", err)
	}
	if _, err := x.Watch(ctx, ""); !errors.Is(err, store.ErrClosed) {
		t.Errorf("Watch after Close: %v, want ErrClosed", err)
	}
}

// testDirChecks: the checks a swap carries for the file system's creates,
// renames and rmdirs (Swap.InDir, CheckKids) hold as the swap lands, and
// a failed one changes nothing.
func testDirChecks(t *testing.T, x store.Index) {
	ctx := context.Background()
	dir := func(k string) *store.Object { return &store.Object{Key: k, Kind: store.KindDir, Ino: 77, Mode: 0o755} }
	dv := put(t, x, "d", 0, dir("d"))
	put(t, x, "f", 0, obj("f", 1))
	put(t, x, "imp/x", 0, obj("imp/x", 2)) // imp: an implicit directory
	for _, c := range []struct {
		key  string
		want error
	}{
		{"top", nil},                    // the root
		{"d/new", nil},                  // a directory's object
		{"imp/new", nil},                // an implicit directory
		{"gone/new", store.ErrNotFound}, // none
		{"f/new", store.ErrNotFound},    // a file is no directory
	} {
		_, err := x.CompareAndSwap(ctx, store.Swap{Key: c.key, New: obj(c.key, 3), InDir: true})
		if c.want == nil && err != nil || !errors.Is(err, c.want) {
			t.Errorf("create %q with InDir: %v; want %v", c.key, err, c.want)
		}
		if _, gerr := x.Get(ctx, c.key); (gerr == nil) != (c.want == nil) {
			t.Errorf("%q after the create: %v", c.key, gerr)
		}
	}
	// d holds d/new: a removal that found it empty fails, one that found
	// one key passes; a check-only swap (no Old, no New) changes nothing.
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "d", Old: dv, CheckKids: true}); !errors.Is(err, store.ErrConflict) {
		t.Fatalf("removal of d, found empty, with d/new in it: %v; want ErrConflict", err)
	}
	mustGet(t, x, "d")
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "imp", CheckKids: true, Kids: 1}); !errors.Is(err, store.ErrConflict) {
		t.Fatalf("imp holds 2 keys, checked for 1: %v; want ErrConflict", err)
	}
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "imp", CheckKids: true, Kids: 2}, store.Swap{Key: "other", InDir: true}); err != nil {
		t.Fatalf("checks that hold: %v", err)
	}
	wantAbsent(t, x, "imp")
	wantAbsent(t, x, "other")
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "d/new", Old: mustGet(t, x, "d/new").Version}, store.Swap{Key: "d", Old: dv, CheckKids: true, Kids: 1}); err != nil {
		t.Fatalf("removing d/new and d, d checked for the one key: %v", err)
	}
	wantAbsent(t, x, "d")
	// A directory's object replaced by another between a look and the
	// swap: an index may read the parent at the swap (etcd: at its
	// transaction); either way the new key lands only in a directory.
	put(t, x, "e", 0, dir("e"))
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "e", Old: mustGet(t, x, "e").Version}); err != nil {
		t.Fatal(err)
	}
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "e/k", New: obj("e/k", 4), InDir: true}); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("create under a removed directory: %v; want ErrNotFound", err)
	}
}

// testFindEntry: an index that finds a key's entry in one read
// (store.EntryFinder) gives a key's own object, or whether keys lie under
// it, and never mixes two moments: while a directory and its key move to
// another name and back, each in one swap, the directory's name holds
// both or neither, never keys without their directory.
func testFindEntry(t *testing.T, x store.Index) {
	ef, ok := x.(store.EntryFinder)
	if !ok {
		t.Skip("no store.EntryFinder")
	}
	ctx := context.Background()
	dir := func(k string) *store.Object {
		return &store.Object{Key: k, Kind: store.KindDir, Ino: 78, Mode: 0o700, Uid: 7}
	}
	put(t, x, "f", 0, obj("f", 1))
	put(t, x, "imp/x", 0, obj("imp/x", 2))
	put(t, x, "d", 0, dir("d"))
	put(t, x, "d/k", 0, obj("d/k", 3))
	put(t, x, "impx", 0, obj("impx", 4)) // shares imp's prefix, not under it
	for _, c := range []struct {
		key      string
		own, has bool
	}{
		{"f", true, false}, {"d", true, false}, {"d/k", true, false},
		{"imp", false, true}, {"im", false, false}, {"gone", false, false}, {"impx/y", false, false},
	} {
		o, has, err := ef.FindEntry(ctx, c.key)
		if err != nil || (o != nil) != c.own || has != c.has || o != nil && o.Key != c.key {
			t.Errorf("FindEntry(%q) = %v, %v, %v; want own %v, keys under it %v", c.key, o, has, err, c.own, c.has)
		}
	}
	// d and d/k move to e and back, one swap each way.
	const moves = 100
	done := make(chan error, 1)
	go func() {
		from, to := "d", "e"
		var err error
		for i := 0; i < moves && err == nil; i++ {
			d, k := mustGetErr(ctx, x, from), mustGetErr(ctx, x, from+"/k")
			if d == nil || k == nil {
				err = fmt.Errorf("move %d: %q or %q missing", i, from, from+"/k")
				break
			}
			nd, nk := d.Clone(), k.Clone()
			nd.Key, nk.Key = to, to+"/k"
			_, err = x.CompareAndSwap(ctx,
				store.Swap{Key: from, Old: d.Version}, store.Swap{Key: from + "/k", Old: k.Version},
				store.Swap{Key: to, New: nd}, store.Swap{Key: to + "/k", New: nk})
			from, to = to, from
		}
		done <- err
	}()
	seen := map[string]int{}
	for running := true; running; {
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			running = false
		default:
		}
		o, has, err := ef.FindEntry(ctx, "d")
		switch {
		case err != nil:
			t.Fatal(err)
		case o == nil && has:
			t.Fatal("FindEntry(d): keys under d without d's object: a read across two swaps")
		case o != nil && (o.Kind != store.KindDir || o.Uid != 7):
			t.Fatalf("FindEntry(d) = %+v", o)
		case o != nil:
			seen["there"]++
		default:
			seen["away"]++
		}
	}
	t.Logf("d found %d times, away %d", seen["there"], seen["away"])
}

// mustGetErr is Get with nil for any error, for a goroutine that reports
// its own.
func mustGetErr(ctx context.Context, x store.Index, key string) *store.Object {
	o, err := x.Get(ctx, key)
	if err != nil {
		return nil
	}
	return o
}
