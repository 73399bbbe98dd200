package etcdindex

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/store/etcdindex/etcdtest"
	"github.com/mooncake-fs/mooncake-fs/store/indextest"
)

type etcdServer = etcdtest.Server

func startEtcd(t *testing.T) *etcdServer { return etcdtest.Start(t) }

var prefixes atomic.Int64

// freshPrefix gives each index in a test binary its own namespace.
func freshPrefix() string {
	return fmt.Sprintf("/test-%d/%d/", os.Getpid(), prefixes.Add(1))
}

func newIndex(t *testing.T, s *etcdServer, prefix string, timeout time.Duration) *Index {
	t.Helper()
	x, err := New(Options{Endpoints: []string{s.ClientURL}, Prefix: prefix, RequestTimeout: timeout, DialTimeout: timeout})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { x.Close() })
	return x
}

func TestConformance(t *testing.T) {
	s := startEtcd(t)
	indextest.Run(t, func(t *testing.T) store.Index {
		return newIndex(t, s, freshPrefix(), 10*time.Second)
	})
}

// eventually polls cond until it holds, failing after a generous bound
// that only turns a hang into a failure.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("never: %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func testObj(key string, size uint64) *store.Object {
	return &store.Object{Key: key, Kind: store.KindFile, Size: size, Mode: 0o644, Xattrs: map[string][]byte{"a": {1, 2}}}
}

// twoNodes starts etcd and two indexes over one fresh prefix, as two
// nodes of a cluster have.
func twoNodes(t *testing.T) (s *etcdServer, prefix string, a, b *Index) {
	s, prefix = startEtcd(t), freshPrefix()
	return s, prefix, newIndex(t, s, prefix, 10*time.Second), newIndex(t, s, prefix, 10*time.Second)
}

func TestTwoNodes(t *testing.T) {
	s, _, a, b := twoNodes(t)
	ctx := context.Background()

	bw, err := b.Watch(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	v1, err := a.CompareAndSwap(ctx, store.Swap{Key: "f", New: testObj("f", 1)})
	if err != nil {
		t.Fatal(err)
	}
	// B sees A's write through its watch.
	eventually(t, "B sees A's create", func() bool {
		o, err := b.Get(ctx, "f")
		return err == nil && o.Version == v1 && o.Size == 1
	})
	select {
	case e := <-bw:
		if e.Type != store.EventPut || e.Object.Key != "f" || e.Object.Version != v1 {
			t.Fatalf("B's watch: %+v", e)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("B's watch delivered nothing")
	}

	// Both update from version v1: exactly one wins.
	v2, err := b.CompareAndSwap(ctx, store.Swap{Key: "f", Old: v1, New: testObj("f", 2)})
	if err != nil {
		t.Fatal(err)
	}
	_, err = a.CompareAndSwap(ctx, store.Swap{Key: "f", Old: v1, New: testObj("f", 3)})
	if !errors.Is(err, store.ErrConflict) {
		t.Fatalf("A's stale swap: %v, want ErrConflict", err)
	}
	// After the conflict A reads at least the version that beat it.
	if o, err := a.Get(ctx, "f"); err != nil || o.Version != v2 || o.Size != 2 {
		t.Fatalf("A's Get after conflict = %+v, %v; want size 2 at %d", o, err, v2)
	}

	// A delete on A reaches B, and B's watch reports the removed object.
	if _, err := a.CompareAndSwap(ctx, store.Swap{Key: "f", Old: v2}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "B sees A's delete", func() bool {
		_, err := b.Get(ctx, "f")
		return errors.Is(err, store.ErrNotFound)
	})
	for {
		select {
		case e := <-bw:
			if e.Type == store.EventPut {
				continue // B's own update
			}
			if e.Type != store.EventDelete || e.Object.Version != v2 || e.Object.Size != 2 {
				t.Fatalf("B's watch: %+v, want delete of version %d", e, v2)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("B's watch delivered no delete")
		}
		break
	}

	// A different prefix is a different namespace.
	c := newIndex(t, s, freshPrefix(), 10*time.Second)
	if objs, err := c.Scan(ctx, "", "", 0); err != nil || len(objs) != 0 {
		t.Fatalf("other prefix Scan = %d objects, %v", len(objs), err)
	}
}

func TestArguments(t *testing.T) {
	s := startEtcd(t)
	x, err := New(Options{Endpoints: []string{s.ClientURL}, Prefix: freshPrefix(), MaxTxnOps: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer x.Close()
	ctx := context.Background()
	var swaps []store.Swap
	for i := range 5 {
		k := fmt.Sprintf("k%d", i)
		swaps = append(swaps, store.Swap{Key: k, New: testObj(k, 0)})
	}
	if _, err := x.CompareAndSwap(ctx, swaps...); !errors.Is(err, store.ErrTooLarge) {
		t.Fatalf("5 swaps with MaxTxnOps 4: %v, want ErrTooLarge", err)
	}
	if _, err := x.CompareAndSwap(ctx, swaps[:4]...); err != nil {
		t.Fatalf("4 swaps: %v", err)
	}
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "a", New: testObj("b", 0)}); !errors.Is(err, store.ErrInvalid) {
		t.Fatalf("key mismatch: %v, want ErrInvalid", err)
	}
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "a", New: &store.Object{Key: "a", Kind: 7}}); !errors.Is(err, store.ErrInvalid) {
		t.Fatalf("bad kind: %v, want ErrInvalid", err)
	}
	big := testObj("big", 0)
	big.Xattrs["v"] = make([]byte, MaxXattrValue+1)
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "big", New: big}); !errors.Is(err, store.ErrTooLarge) {
		t.Fatalf("big xattr: %v, want ErrTooLarge", err)
	}
	if err := (Options{}).Validate(); err == nil {
		t.Fatal("empty options validate")
	}
	if err := (Options{Endpoints: []string{""}, RequestTimeout: -1, MaxTxnOps: -1}).Validate(); err == nil ||
		!strings.Contains(err.Error(), "RequestTimeout") || !strings.Contains(err.Error(), "MaxTxnOps") || !strings.Contains(err.Error(), "Endpoints[0]") {
		t.Fatalf("Validate reports %v; want every bad field", err)
	}
}

// TestCorruptValue: a value this version cannot read fails Get with
// ErrCorrupt and is left out of Scan, for entries loaded at start and for
// entries arriving through the watch.
func TestCorruptValue(t *testing.T) {
	s := startEtcd(t)
	prefix := freshPrefix()
	x := newIndex(t, s, prefix, 10*time.Second)
	ctx := context.Background()
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "good", New: testObj("good", 1)}); err != nil {
		t.Fatal(err)
	}
	if _, err := x.cli.Put(ctx, prefix+"objects/bad", `{"f":99}`); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the watch delivers the bad value", func() bool {
		_, err := x.Get(ctx, "bad")
		return errors.Is(err, ErrCorrupt)
	})
	y := newIndex(t, s, prefix, 10*time.Second)
	for _, ix := range []*Index{x, y} {
		if _, err := ix.Get(ctx, "bad"); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Get(bad): %v, want ErrCorrupt", err)
		}
		objs, err := ix.Scan(ctx, "", "", 0)
		if err != nil || len(objs) != 1 || objs[0].Key != "good" {
			t.Fatalf("Scan = %v, %v; want only good", objs, err)
		}
	}
}

// TestEtcdOutage: with etcd stopped, swaps fail within the request timeout
// with a clear error and cached reads still answer; when etcd returns the
// index works again without being rebuilt.
func TestEtcdOutage(t *testing.T) {
	s := startEtcd(t)
	prefix := freshPrefix()
	const timeout = 2 * time.Second
	x := newIndex(t, s, prefix, timeout)
	ctx := context.Background()
	v, err := x.CompareAndSwap(ctx, store.Swap{Key: "k", New: testObj("k", 1)})
	if err != nil {
		t.Fatal(err)
	}
	mustGet := func() {
		t.Helper()
		if o, err := x.Get(ctx, "k"); err != nil || o.Version != v {
			t.Fatalf("Get = %+v, %v; want version %d", o, err, v)
		}
	}
	mustGet()

	s.Stop()
	start := time.Now()
	_, err = x.CompareAndSwap(ctx, store.Swap{Key: "k", Old: v, New: testObj("k", 2)})
	took := time.Since(start)
	if err == nil || errors.Is(err, store.ErrConflict) {
		t.Fatalf("swap with etcd stopped: %v", err)
	}
	if !strings.Contains(err.Error(), "etcd unavailable at "+s.ClientURL) || !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, store.ErrUnavailable) {
		t.Fatalf("swap with etcd stopped: %v; want etcd unavailable at %s wrapping DeadlineExceeded", err, s.ClientURL)
	}
	// A hang guard, not a latency assertion: the call must not block far
	// past its timeout.
	if took > 10*timeout {
		t.Fatalf("swap with etcd stopped took %v (timeout %v)", took, timeout)
	}
	t.Logf("swap with etcd stopped failed after %v: %v", took, err)
	mustGet()
	// A read that waits for this node's own write, which the watch had
	// not delivered when etcd went (as the swap above could have been):
	// unavailable too, unless its caller gave up first.
	x.mu.Lock()
	prevRead := x.mu.readRev
	x.mu.readRev = x.mu.rev + 1
	x.mu.Unlock()
	if _, err := x.Get(ctx, "k"); !errors.Is(err, store.ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Get waiting for an own write with etcd stopped: %v; want ErrUnavailable wrapping DeadlineExceeded", err)
	}
	gone, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := x.Get(gone, "k"); errors.Is(err, store.ErrUnavailable) || !errors.Is(err, context.Canceled) {
		t.Fatalf("Get of a caller that gave up, waiting for an own write: %v; want Canceled alone", err)
	}
	x.mu.Lock()
	x.mu.readRev = prevRead
	x.mu.Unlock()
	if objs, err := x.Scan(ctx, "", "", 0); err != nil || len(objs) != 1 {
		t.Fatalf("Scan with etcd stopped = %d, %v", len(objs), err)
	}
	// A new index cannot load.
	if _, err := New(Options{Endpoints: []string{s.ClientURL}, Prefix: prefix, RequestTimeout: timeout, DialTimeout: timeout}); err == nil ||
		!strings.Contains(err.Error(), "etcd unavailable") {
		t.Fatalf("New with etcd stopped: %v", err)
	}

	s.Start()
	var v2 uint64
	eventually(t, "a swap succeeds after etcd returns", func() bool {
		v2, err = x.CompareAndSwap(ctx, store.Swap{Key: "k", Old: v, New: testObj("k", 2)})
		return err == nil
	})
	if o, err := x.Get(ctx, "k"); err != nil || o.Version != v2 || o.Size != 2 {
		t.Fatalf("Get after recovery = %+v, %v; want size 2 at %d", o, err, v2)
	}
	// The watch resumed: another node's write reaches x.
	y := newIndex(t, s, prefix, timeout)
	v3, err := y.CompareAndSwap(ctx, store.Swap{Key: "k", Old: v2, New: testObj("k", 3)})
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "x sees y's write after recovery", func() bool {
		o, err := x.Get(ctx, "k")
		return err == nil && o.Version == v3
	})
}

// TestCompactedWatchReloads: when the revisions the watch needs were
// compacted away, the cache reloads and watchers get the difference.
func TestCompactedWatchReloads(t *testing.T) {
	s := startEtcd(t)
	prefix := freshPrefix()
	ctx := context.Background()
	y := newIndex(t, s, prefix, 10*time.Second)
	v, err := y.CompareAndSwap(ctx, store.Swap{Key: "gone", New: testObj("gone", 1)},
		store.Swap{Key: "same", New: testObj("same", 1)})
	if err != nil {
		t.Fatal(err)
	}
	// x loads now and starts watching only after the compaction below.
	x, err := open(Options{Endpoints: []string{s.ClientURL}, Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	started := false
	t.Cleanup(func() {
		if !started {
			go x.run()
		}
		x.Close()
	})
	ch, err := x.Watch(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	v2, err := y.CompareAndSwap(ctx, store.Swap{Key: "gone", Old: v}, store.Swap{Key: "new", New: testObj("new", 2)})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := x.cli.Put(ctx, "/unrelated", "x")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := x.cli.Compact(ctx, resp.Header.Revision); err != nil {
		t.Fatal(err)
	}
	started = true
	go x.run()
	want := []string{
		fmt.Sprintf("delete gone@%d", v),
		fmt.Sprintf("put new@%d", v2),
	}
	for i, w := range want {
		select {
		case e := <-ch:
			got := fmt.Sprintf("%s %s@%d", map[store.EventType]string{store.EventPut: "put", store.EventDelete: "delete"}[e.Type], e.Object.Key, e.Object.Version)
			if got != w {
				t.Fatalf("event %d after reload: %s, want %s", i, got, w)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("no event %d after reload", i)
		}
	}
	if _, err := x.Get(ctx, "gone"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("Get(gone) after reload: %v", err)
	}
	if o, err := x.Get(ctx, "same"); err != nil || o.Version != v {
		t.Fatalf("Get(same) after reload: %+v, %v", o, err)
	}
	// The watch runs again after the reload.
	v3, err := y.CompareAndSwap(ctx, store.Swap{Key: "later", New: testObj("later", 3)})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case e := <-ch:
		if e.Type != store.EventPut || e.Object.Key != "later" || e.Object.Version != v3 {
			t.Fatalf("event after reload: %+v", e)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("watch dead after reload")
	}
}

// TestFindIno: both nodes' caches find a file by its inode number
// through a create, a rename (one swap: the old key out, the new one in,
// in either order), a replacement by another inode and a delete, and
// after a reload; directories are not answered.
func TestFindIno(t *testing.T) {
	s, prefix, a, b := twoNodes(t)
	ctx := context.Background()
	file := func(key string, ino uint64) *store.Object {
		o := testObj(key, 1)
		o.Ino = ino
		return o
	}
	want := func(what string, ino uint64, key string) {
		t.Helper()
		for _, x := range []*Index{a, b} {
			eventually(t, what, func() bool {
				got, ok, err := x.FindIno(ctx, ino)
				return err == nil && ok == (key != "") && got == key
			})
		}
	}
	v, err := a.CompareAndSwap(ctx, store.Swap{Key: "d/f", New: file("d/f", 7)},
		store.Swap{Key: "dir", New: &store.Object{Key: "dir", Kind: store.KindDir, Ino: 8, Mode: 0o755}})
	if err != nil {
		t.Fatal(err)
	}
	want("a create", 7, "d/f")
	want("a directory", 8, "")
	v, err = a.CompareAndSwap(ctx, store.Swap{Key: "d/f", Old: v}, store.Swap{Key: "d/g", New: file("d/g", 7)})
	if err != nil {
		t.Fatal(err)
	}
	want("a rename, old key first", 7, "d/g")
	v, err = b.CompareAndSwap(ctx, store.Swap{Key: "e/h", New: file("e/h", 7)}, store.Swap{Key: "d/g", Old: v})
	if err != nil {
		t.Fatal(err)
	}
	want("a rename, new key first", 7, "e/h")
	v, err = a.CompareAndSwap(ctx, store.Swap{Key: "e/h", Old: v, New: file("e/h", 9)})
	if err != nil {
		t.Fatal(err)
	}
	want("replaced by another inode", 7, "")
	want("the new inode", 9, "e/h")
	c := newIndex(t, s, prefix, 10*time.Second) // loaded, not watched into
	if got, ok, err := c.FindIno(ctx, 9); err != nil || !ok || got != "e/h" {
		t.Fatalf("after a load: %q, %v, %v", got, ok, err)
	}
	if _, err := b.CompareAndSwap(ctx, store.Swap{Key: "e/h", Old: v}); err != nil {
		t.Fatal(err)
	}
	want("a delete", 9, "")
}
