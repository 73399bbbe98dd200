package store_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// putPlaced writes data to key with placement p, in pieces of chunk bytes.
func (s *testStore) putPlaced(key string, data []byte, p store.Placement, chunk int) (*store.Object, error) {
	ctx := context.Background()
	d := s.NewDraft(store.NewIno(), nil, true)
	defer d.Close()
	d.Place(p)
	for off := 0; off < len(data); off += chunk {
		end := min(off+chunk, len(data))
		if _, err := d.WriteAt(ctx, data[off:end], uint64(off)); err != nil {
			return nil, err
		}
	}
	return d.Commit(ctx, store.CommitOptions{Key: key})
}

// readVia reads key on s with ReadAt only (remote readers have no Slices).
func (s *testStore) readVia(t *testing.T, key string) []byte {
	t.Helper()
	r, err := s.OpenReader(context.Background(), key)
	if err != nil {
		t.Fatalf("open %q on %s: %v", key, s.Node(), err)
	}
	defer r.Close()
	b := make([]byte, r.Size())
	if n, err := r.ReadAt(context.Background(), b, 0); err != nil || n != len(b) {
		t.Fatalf("read %q on %s: %d of %d B, %v", key, s.Node(), n, len(b), err)
	}
	return b
}

func replicaNodes(o *store.Object) []string {
	var out []string
	for _, r := range o.Replicas {
		out = append(out, r.Node)
	}
	return out
}

// waitFor polls cond; the deadline only turns a hang into a failure.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestPlaceOnNode: node:b writes from a into b's segments; both read it;
// b takes the reservation over at the commit and frees the body when a
// deletes the key.
func TestPlaceOnNode(t *testing.T) {
	a, b := newCluster(t, true)
	data := pattern(3, 700<<10+5)
	o, err := a.putPlaced("f", data, store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1}, 100<<10)
	if err != nil {
		t.Fatal(err)
	}
	if got := replicaNodes(o); len(got) != 1 || got[0] != "b" {
		t.Fatalf("replicas on %v, want [b]", got)
	}
	if a.used() != 0 {
		t.Fatalf("a uses %d B for a file placed on b", a.used())
	}
	equalBytes(t, "read on a", a.readVia(t, "f"), data)
	equalBytes(t, "read on b", b.readVia(t, "f"), data)
	waitFor(t, "b to take the reservation over", func() bool { return b.Stats().Reservations == 0 })
	want := uint64(len(data)+segment.Granule-1) / segment.Granule * segment.Granule
	if b.used() != want {
		t.Fatalf("b uses %d B, want %d (trimmed to the size)", b.used(), want)
	}
	// Copy on write from a remote base onto b again, then delete.
	d := a.edit(t, "f")
	d.Place(store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1})
	if _, err := d.WriteAt(context.Background(), []byte("XY"), 10); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Commit(context.Background(), store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	d.Close()
	copy(data[10:], "XY")
	equalBytes(t, "after edit, on b", b.readVia(t, "f"), data)
	if err := a.Delete(context.Background(), "f", 0); err != nil {
		t.Fatal(err)
	}
	b.sync(t)
	b.waitUsed(t, 0)
	a.checkAlloc(t)
	b.checkAlloc(t)
}

// TestPlaceNowhere: an explicit node that is not alive fails with
// ErrNoSpace and leaves nothing behind.
func TestPlaceNowhere(t *testing.T) {
	a, b := newCluster(t, true)
	_, err := a.putPlaced("f", pattern(1, 5000), store.Placement{Policy: store.PolicyNode, Node: "zz", Replicas: 1}, 5000)
	wantErr(t, "node:zz", err, store.ErrNoSpace)
	// More than b holds, explicitly on b: no silent landing on a.
	_, err = a.putPlaced("g", pattern(1, 5<<20), store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1}, 1<<20)
	wantErr(t, "5 MiB on a 4 MiB node", err, store.ErrNoSpace)
	if a.used() != 0 || b.used() != 0 || b.Stats().Reservations != 0 {
		t.Fatalf("left behind: a %d B, b %d B, %d reservations", a.used(), b.used(), b.Stats().Reservations)
	}
	// Three replicas on a two-node cluster cannot be placed.
	_, err = a.putPlaced("h", pattern(1, 5000), store.Placement{Policy: store.PolicyLocal, Replicas: 3}, 5000)
	wantErr(t, "3 replicas on 2 nodes", err, store.ErrNoSpace)
	if _, err := a.Stat(context.Background(), "h"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("failed put is visible: %v", err)
	}
	waitFor(t, "b to free the failed replica", func() bool { return b.used() == 0 && b.Stats().Reservations == 0 })
}

// TestReplicas: two replicas land on distinct nodes with the same bytes;
// either alone serves reads; Reconcile after b dies drops b's copy.
func TestReplicas(t *testing.T) {
	a, b := newCluster(t, true)
	data := pattern(9, 1<<20+77)
	o, err := a.putPlaced("r", data, store.Placement{Policy: store.PolicyLocal, Replicas: 2}, 256<<10)
	if err != nil {
		t.Fatal(err)
	}
	if got := replicaNodes(o); len(got) != 2 || got[0] != "a" || got[1] != "b" {
		t.Fatalf("replicas on %v, want [a b]", got)
	}
	equalBytes(t, "b's local copy", b.read(t, "r"), data)
	equalBytes(t, "a's local copy", a.read(t, "r"), data)

	rep, err := a.Reconcile(context.Background(), func(n string) bool { return n == "a" })
	if err != nil || rep.Dropped != 1 || len(rep.Lost) != 0 || rep.Short != 1 {
		t.Fatalf("reconcile without b: %+v, %v", rep, err)
	}
	cur, err := a.Stat(context.Background(), "r")
	if err != nil || len(cur.Replicas) != 1 || cur.Replicas[0].Node != "a" {
		t.Fatalf("after reconcile: %+v, %v", cur, err)
	}
	b.sync(t)
	b.waitUsed(t, 0)
	// Back to two: b is alive again.
	rep, err = a.Reconcile(context.Background(), func(string) bool { return true })
	if err != nil || rep.Repaired != 1 {
		t.Fatalf("reconcile with b back: %+v, %v", rep, err)
	}
	equalBytes(t, "repaired copy on b", b.read(t, "r"), data)
	// Both gone: lost, and reads fail with ErrLost.
	rep, err = a.Reconcile(context.Background(), func(string) bool { return false })
	if err != nil || len(rep.Lost) != 1 || rep.Lost[0] != "r" {
		t.Fatalf("reconcile with nothing alive: %+v, %v", rep, err)
	}
	_, err = a.OpenReader(context.Background(), "r")
	wantErr(t, "read a lost object", err, store.ErrLost)
	lost, err := a.Lost(context.Background())
	if err != nil || len(lost) != 1 {
		t.Fatalf("Lost: %v, %v", lost, err)
	}
	a.sync(t)
	a.waitUsed(t, 0)
	b.waitUsed(t, 0)
}

// TestSpill: a full node moves a draft to the node with the most free
// space mid-write, and the bytes written before the move survive.
func TestSpill(t *testing.T) {
	a, b := newCluster(t, true)
	a.put(t, "filler", pattern(2, 3<<20))
	data := pattern(4, 2<<20+999)
	o, err := a.putPlaced("big", data, store.DefaultPlacement(), 300<<10)
	if err != nil {
		t.Fatal(err)
	}
	if got := replicaNodes(o); len(got) != 1 || got[0] != "b" {
		t.Fatalf("replicas on %v, want [b]", got)
	}
	equalBytes(t, "spilled file on a", a.readVia(t, "big"), data)
	equalBytes(t, "spilled file on b", b.read(t, "big"), data)
	if a.used() != 3<<20 {
		t.Fatalf("a uses %d B after the spill, want only the filler", a.used())
	}
	waitFor(t, "b to take the reservation over", func() bool { return b.Stats().Reservations == 0 })
}

// TestReservationExpires: a writer that reserves and vanishes leaks nothing.
func TestReservationExpires(t *testing.T) {
	a, b := newCluster(t, true)
	tr := a.Store.Transport()
	r, err := tr.Reserve(context.Background(), "b", 1<<20, 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if b.used() < 1<<20 || b.Stats().Reservations != 1 {
		t.Fatalf("b uses %d B with %d reservations", b.used(), b.Stats().Reservations)
	}
	waitFor(t, "the reaper", func() bool { return b.used() == 0 && b.Stats().Reservations == 0 })
	if st := b.Stats(); st.Reserved != 1 || st.Reaped != 1 {
		t.Fatalf("reservations made %d, reaped %d; want 1 and 1", st.Reserved, st.Reaped)
	}
	if err := tr.Renew(context.Background(), "b", r.Epoch, r.ID, time.Second); err == nil {
		t.Fatal("renewed an expired reservation")
	}
}

// TestStaleEpoch: a replica written by an earlier incarnation of its node
// (the daemon restarted: new memory) is never read, not even on that node.
func TestStaleEpoch(t *testing.T) {
	a, b := newCluster(t, true)
	data := pattern(5, 300<<10)
	o, err := a.putPlaced("f", data, store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1}, 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	if o.Replicas[0].Epoch == 0 {
		t.Fatalf("replica without epoch: %+v", o.Replicas[0])
	}
	old := o.Clone()
	old.Replicas[0].Epoch++ // as if b's previous life wrote it
	if _, err := a.Index.CompareAndSwap(context.Background(), store.Swap{Key: "f", Old: o.Version, New: old}); err != nil {
		t.Fatal(err)
	}
	r, err := a.OpenReader(context.Background(), "f")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	buf := make([]byte, len(data))
	if _, err := r.ReadAt(context.Background(), buf, 0); !errors.Is(err, transfer.ErrStaleEpoch) {
		t.Fatalf("read of a stale replica from a: %v", err)
	}
	_, err = b.OpenReader(context.Background(), "f")
	wantErr(t, "open of a stale replica on its own node", err, store.ErrLost)
}

// TestStaleBody: a reader on a holds no lease on b's memory; once b
// replaces the object and reuses the extents, a's reads fail instead of
// returning the new object's bytes.
func TestStaleBody(t *testing.T) {
	// Holds would keep the old body for a's reader (that is their job);
	// this test is about the check that protects a reader whose hold
	// never came, so no hold is granted here.
	a, b := newCluster(t, true, withOptions(func(o *store.Options) { o.Transport = noHolds{o.Transport} }))
	old := pattern(1, 200<<10)
	if _, err := b.putPlaced("f", old, store.DefaultPlacement(), 64<<10); err != nil {
		t.Fatal(err)
	}
	b.sync(t)
	r, err := a.OpenReader(context.Background(), "f")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	buf := make([]byte, len(old))
	if _, err := r.ReadAt(context.Background(), buf, 0); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "before the replace", buf, old)
	if err := b.Delete(context.Background(), "f", 0); err != nil {
		t.Fatal(err)
	}
	b.sync(t)
	b.waitUsed(t, 0)
	// The same extents now hold another object.
	b.put(t, "g", pattern(9, 200<<10))
	if _, err := r.ReadAt(context.Background(), buf, 0); !errors.Is(err, transfer.ErrStaleBody) {
		t.Fatalf("read of a replaced body: %v", err)
	}
}

// TestCommitWaitsForPeers: a commit returns only once the other node's
// view includes it, so a read there right after sees it from its cache.
func TestCommitWaitsForPeers(t *testing.T) {
	a, b := newCluster(t, true)
	for i := range 50 {
		o := a.put(t, fmt.Sprintf("k%d", i), pattern(byte(i), 5000))
		if seen, _ := store.FollowState(b.Store); seen < o.Version {
			t.Fatalf("commit %d at version %d returned while b had seen only %d", i, o.Version, seen)
		}
	}
	if st := a.Stats(); st.SyncFails != 0 {
		t.Fatalf("%d peers did not confirm", st.SyncFails)
	}
	// A member that cannot be reached fails once and is then left out
	// for a while: commits do not pay for it each time.
	v := testViews[a.Store]
	v.mu.Lock()
	v.phantom = append(v.phantom, "ghost")
	v.mu.Unlock()
	for i := range 5 {
		a.put(t, fmt.Sprintf("g%d", i), pattern(byte(i), 100))
	}
	if st := a.Stats(); st.SyncFails != 1 {
		t.Fatalf("%d failed confirmations from an unreachable member, want 1", st.SyncFails)
	}
}

// TestEvictKeepsOtherReplicas: evicting a file that has a copy on another
// node drops only this node's copy; the last copy takes the key.
func TestEvictKeepsOtherReplicas(t *testing.T) {
	a, b := newCluster(t, true)
	data := pattern(7, 300<<10)
	if _, err := a.putPlaced("two", data, store.Placement{Policy: store.PolicyLocal, Replicas: 2}, 64<<10); err != nil {
		t.Fatal(err)
	}
	a.put(t, "one", pattern(8, 5000))
	if !store.EvictKey(a.Store, "two") {
		t.Fatal("two not evicted")
	}
	o, err := a.Stat(context.Background(), "two")
	if err != nil || len(o.Replicas) != 1 || o.Replicas[0].Node != "b" {
		t.Fatalf("after evicting a's copy: %+v, %v", o, err)
	}
	equalBytes(t, "two, read on a from b", a.readVia(t, "two"), data)
	if !store.EvictKey(a.Store, "one") {
		t.Fatal("one not evicted")
	}
	if _, err := b.Stat(context.Background(), "one"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("the last copy evicted, key still there: %v", err)
	}
	a.sync(t)
	a.waitUsed(t, 0)
}

// TestEvictRemoteWritten: files that a wrote into b's segments (node:b)
// are in b's LRU like b's own, so a write that must land on a full b
// evicts the least recently written of them instead of failing with
// ErrNoSpace.
func TestEvictRemoteWritten(t *testing.T) {
	ctx := context.Background()
	a, b := newCluster(t, true, withOptions(func(o *store.Options) { o.Evict = true }))
	onB := store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1}
	for _, k := range []string{"r1", "r2", "r3"} {
		if _, err := a.putPlaced(k, pattern(4, 1<<20), onB, 256<<10); err != nil {
			t.Fatalf("put %s on b: %v", k, err)
		}
	}
	b.sync(t)
	if b.used() != 3<<20 {
		t.Fatalf("b uses %d B, want 3 MiB", b.used())
	}
	big := pattern(5, 2<<20)
	if _, err := b.putPlaced("big", big, onB, 1<<20); err != nil {
		t.Fatalf("put big on a full b: %v", err)
	}
	if _, err := b.Stat(ctx, "r1"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("r1, the least recently written, after b made room: %v, want ErrNotFound", err)
	}
	// The draft reserves ahead of its writes, so r2 may go as well; the
	// most recently written stays.
	equalBytes(t, "r3 read on a", a.readVia(t, "r3"), pattern(4, 1<<20))
	equalBytes(t, "big", a.readVia(t, "big"), big)
	if st := b.Stats(); st.Evictions < 1 || st.Evictions > 2 {
		t.Fatalf("b evicted %d objects, want 1 or 2", st.Evictions)
	}
	b.checkAlloc(t)
}

// TestRemoteReadsKeepLRU: a checked read from a counts as a use of b's copy,
// so b evicts the file nobody read since, not the one a keeps reading.
func TestRemoteReadsKeepLRU(t *testing.T) {
	ctx := context.Background()
	a, b := newCluster(t, true, withOptions(func(o *store.Options) { o.Evict = true }))
	onB := store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1}
	for _, k := range []string{"r1", "r2", "r3"} {
		if _, err := a.putPlaced(k, pattern(4, 1<<20), onB, 1<<20); err != nil {
			t.Fatalf("put %s on b: %v", k, err)
		}
	}
	b.sync(t)
	equalBytes(t, "r1 read on a", a.readVia(t, "r1"), pattern(4, 1<<20))
	// One more MiB on b: the least recently used is now r2.
	if _, err := b.putPlaced("more", pattern(6, 1<<20), onB, 1<<20); err != nil {
		t.Fatalf("put more on b: %v", err)
	}
	// The put fits whole; crossing the high watermark kicks b's evict
	// loop, which runs after it: wait for the room it makes (one MiB).
	b.waitUsed(t, 3<<20)
	if _, err := b.Stat(ctx, "r2"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("r2 after b made room: %v, want ErrNotFound (evicted)", err)
	}
	if _, err := b.Stat(ctx, "r1"); err != nil {
		t.Fatalf("r1, read from a since it was written, was evicted: %v", err)
	}
}

// noHolds is a transport whose owners never grant a hold, as when the hold
// request is lost.
type noHolds struct{ transfer.Transport }

func (noHolds) Hold(context.Context, string, uint64, segment.Extent, uint64, time.Duration) (uint64, error) {
	return 0, errors.New("test: holds refused")
}

// TestPlacementOf: an object's placement from its directory's is what
// PlacementFor of its key says, whichever attributes each has.
func TestPlacementOf(t *testing.T) {
	ctx := context.Background()
	s := newTestStore(t, 8<<20)
	dirX := map[string][]byte{store.XattrReplicas: []byte("2"), store.XattrPlacement: []byte("spread")}
	seen := map[store.Placement]bool{}
	for i, dx := range []map[string][]byte{nil, dirX, {store.XattrPlacement: []byte("node:b")}} {
		dir := fmt.Sprintf("d%d", i)
		if _, err := s.Mkdir(ctx, dir, &store.Object{Mode: 0o755, Xattrs: dx}); err != nil {
			t.Fatal(err)
		}
		for j, kx := range []map[string][]byte{nil, {store.XattrReplicas: []byte("3")}, {store.XattrPlacement: []byte("node:c")},
			{store.XattrReplicas: []byte("1"), store.XattrPlacement: []byte("local")}, {store.XattrReplicas: []byte("x")}} {
			key := fmt.Sprintf("%s/k%d", dir, j)
			d := s.NewDraft(store.NewIno(), nil, true)
			o, err := d.Commit(ctx, store.CommitOptions{Key: key, SetXattrs: kx})
			d.Close()
			if err != nil {
				t.Fatal(err)
			}
			want := s.PlacementFor(ctx, key)
			seen[want] = true
			if got := store.PlacementOf(o, s.PlacementFor(ctx, dir)); got != want {
				t.Errorf("%s (dir %v, own %v): %+v, PlacementFor says %+v", key, dx, kx, got, want)
			}
		}
	}
	if len(seen) < 6 {
		t.Fatalf("only %d placements among the keys: the attributes did not take", len(seen))
	}
}

// TestCheckPlacement: a store outside a cluster refuses the placement
// values it could never meet (more than one replica, another node), and
// takes the rest; a store in a cluster takes any well-formed value (its
// nodes come and go); malformed values fail on both, a number of
// replicas with anything but its digits (a space, a sign, a leading zero)
// included.
func TestCheckPlacement(t *testing.T) {
	alone := newTestStore(t, 1<<20)
	a, _ := newCluster(t, false)
	for _, c := range []struct {
		name, v        string
		alone, cluster error
	}{
		{store.XattrReplicas, "1", nil, nil},
		{store.XattrReplicas, "2", store.ErrInvalid, nil},
		{store.XattrReplicas, "0", store.ErrInvalid, store.ErrInvalid},
		{store.XattrReplicas, "9", store.ErrInvalid, store.ErrInvalid},
		{store.XattrReplicas, " 2", store.ErrInvalid, store.ErrInvalid},
		{store.XattrReplicas, "2\n", store.ErrInvalid, store.ErrInvalid},
		{store.XattrReplicas, "+1", store.ErrInvalid, store.ErrInvalid},
		{store.XattrReplicas, "02", store.ErrInvalid, store.ErrInvalid},
		{store.XattrReplicas, "", store.ErrInvalid, store.ErrInvalid},
		{store.XattrReplicas, "1e0", store.ErrInvalid, store.ErrInvalid},
		{store.XattrPlacement, "local", nil, nil},
		{store.XattrPlacement, "spread", nil, nil},
		{store.XattrPlacement, "node:" + alone.Node(), nil, nil},
		{store.XattrPlacement, "node:elsewhere", store.ErrInvalid, nil},
		{store.XattrPlacement, "node:", store.ErrInvalid, store.ErrInvalid},
		{store.XattrPlacement, "node:a ", store.ErrInvalid, store.ErrInvalid},
		{store.XattrPlacement, "node:a,b", store.ErrInvalid, store.ErrInvalid},
		{store.XattrPlacement, "node:host-1.example_2", store.ErrInvalid, nil},
		{store.XattrPlacement, "nearby", store.ErrInvalid, store.ErrInvalid},
		{"mooncake.meta", "1", store.ErrInvalid, store.ErrInvalid},
	} {
		for _, s := range []struct {
			st   *testStore
			want error
		}{{alone, c.alone}, {a, c.cluster}} {
			if err := s.st.CheckPlacement(c.name, c.v); !errors.Is(err, s.want) || (err == nil) != (s.want == nil) {
				t.Errorf("%s: CheckPlacement(%s, %q) = %v, want %v", s.st.Node(), c.name, c.v, err, s.want)
			}
		}
	}
}
