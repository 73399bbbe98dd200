package store_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// slowPeer is a transport whose next write, once armed, waits delay
// before it goes out: a slow link or a paused writer.
type slowPeer struct {
	transfer.Transport
	delay time.Duration
	armed *atomic.Bool
}

func (p slowPeer) WriteAt(ctx context.Context, node string, epoch, resv uint64, e segment.Extent, src []byte) error {
	if p.armed.CompareAndSwap(true, false) {
		time.Sleep(p.delay)
	}
	return p.Transport.WriteAt(ctx, node, epoch, resv, e, src)
}

// TestSlowRemoteWriteKeepsItsReservation: a write to another node that
// takes several reservation TTLs still lands in its reservation: the
// writer's node renews it meanwhile, so the owner never reaps it (and
// never gives its extents to another object).
func TestSlowRemoteWriteKeepsItsReservation(t *testing.T) {
	ctx := context.Background()
	const ttl = 300 * time.Millisecond
	armed := new(atomic.Bool)
	a, b := newCluster(t, true, withOptions(func(o *store.Options) {
		o.ReserveTTL = ttl
		o.Transport = slowPeer{Transport: o.Transport, delay: 6 * ttl, armed: armed}
	}))
	d := a.NewDraft(store.NewIno(), nil, true)
	defer d.Close()
	d.Place(store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1})
	head, tail := pattern(1, 64<<10), pattern(2, 200<<10)
	if _, err := d.WriteAt(ctx, head, 0); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	if _, err := d.WriteAt(ctx, tail, uint64(len(head))); err != nil {
		t.Fatalf("write that took %v (TTL %v): %v", 6*ttl, ttl, err)
	}
	// Seek back and rewrite the header after more TTLs went by.
	time.Sleep(3 * ttl)
	head = pattern(3, len(head))
	if _, err := d.WriteAt(ctx, head, 0); err != nil {
		t.Fatalf("rewrite of the header %v later: %v", 3*ttl, err)
	}
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatalf("commit: %v", err)
	}
	if n := b.Stats().Reaped; n != 0 {
		t.Fatalf("b reaped %d reservations of a live writer", n)
	}
	equalBytes(t, "f read on a", a.readVia(t, "f"), append(head, tail...))
	equalBytes(t, "f read on b", b.readVia(t, "f"), append(head, tail...))
	// Once committed, the lease is handed over and stops.
	waitFor(t, "a's leases to end", func() bool { return store.Leases(a.Store) == 0 })
	waitFor(t, "b's reservations to be taken over", func() bool { return b.Stats().Reservations == 0 })
}

// TestOwnerRefusesWritesOutsideReservations: the owner's write guard
// admits a write only into a live reservation that covers it.
func TestOwnerRefusesWritesOutsideReservations(t *testing.T) {
	ctx := context.Background()
	a, b := newCluster(t, true)
	tr := a.Transport()
	r, err := tr.Reserve(ctx, "b", 128<<10, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	e := r.Extents[0]
	in := segment.Extent{Segment: e.Segment, Off: e.Off, Len: 4096}
	buf := pattern(9, 4096)
	if err := tr.WriteAt(ctx, "b", r.Epoch, r.ID, in, buf); err != nil {
		t.Fatalf("write into the reservation: %v", err)
	}
	used := b.used()
	outside := segment.Extent{Segment: e.Segment, Off: e.Off + e.Len, Len: 4096}
	for _, c := range []struct {
		what string
		resv uint64
		e    segment.Extent
	}{
		{"no reservation named", 0, in},
		{"another reservation's id", r.ID + 1000, in},
		{"past the reservation's end", r.ID, outside},
		{"straddling its end", r.ID, segment.Extent{Segment: e.Segment, Off: e.Off + e.Len - 2048, Len: 4096}},
	} {
		if err := tr.WriteAt(ctx, "b", r.Epoch, c.resv, c.e, buf); !errors.Is(err, transfer.ErrNotReserved) {
			t.Errorf("%s: %v, want ErrNotReserved", c.what, err)
		}
	}
	if err := tr.Free(ctx, "b", r.Epoch, r.ID, nil); err != nil {
		t.Fatal(err)
	}
	if err := tr.WriteAt(ctx, "b", r.Epoch, r.ID, in, buf); !errors.Is(err, transfer.ErrNotReserved) {
		t.Errorf("write after the free: %v, want ErrNotReserved", err)
	}
	short, err := tr.Reserve(ctx, "b", 4096, 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	if err := tr.WriteAt(ctx, "b", short.Epoch, short.ID, short.Extents[0], buf); !errors.Is(err, transfer.ErrNotReserved) {
		t.Errorf("write after the deadline: %v, want ErrNotReserved", err)
	}
	if b.used() > used {
		t.Fatalf("b uses %d B after refused writes, %d before", b.used(), used)
	}
}

// stallChecker stalls the first checked read it admits, once armed,
// between the check and the stream: a slow reader on another node.
type stallChecker struct {
	transfer.BodyChecker
	armed   *atomic.Bool
	stalled chan struct{}
	resume  chan struct{}
}

func (c stallChecker) CheckBody(ctx context.Context, first segment.Extent, version uint64) (func(), error) {
	release, err := c.BodyChecker.CheckBody(ctx, first, version)
	if err == nil && c.armed.CompareAndSwap(true, false) {
		close(c.stalled)
		<-c.resume
	}
	return release, err
}

// TestStalledCheckedReadKeepsItsBody: a checked read from another node
// that stalls after its check, past the free delay, while the file is
// replaced and its old space offered to a new file, still gets the bytes
// it asked for: the body is referenced until the stream ends, not kept by
// a timer.
func TestStalledCheckedReadKeepsItsBody(t *testing.T) {
	ctx := context.Background()
	armed := new(atomic.Bool)
	stalled, resume := make(chan struct{}), make(chan struct{})
	serverHook = func(node string, o *transfer.TCPServerOptions) {
		if node == "b" {
			o.Bodies = stallChecker{BodyChecker: o.Bodies, armed: armed, stalled: stalled, resume: resume}
		}
	}
	t.Cleanup(func() { serverHook = nil })
	a, b := newCluster(t, true, withOptions(func(o *store.Options) {
		o.FreeDelay = testFreeDelay
		o.Transport = noHolds{o.Transport} // only the read's own reference keeps the body
	}))
	onB := store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1}
	old := pattern(4, 300<<10)
	if _, err := a.putPlaced("f", old, onB, 300<<10); err != nil {
		t.Fatal(err)
	}
	r, err := a.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	armed.Store(true)
	got := make([]byte, len(old))
	done := make(chan error, 1)
	go func() {
		_, err := r.ReadAt(ctx, got, 0)
		done <- err
	}()
	<-stalled
	b.put(t, "f", pattern(5, 100<<10))
	time.Sleep(3 * testFreeDelay)
	// A new file of the old one's size takes the first free space.
	b.put(t, "g", pattern(6, 300<<10))
	close(resume)
	if err := <-done; err != nil {
		t.Fatalf("stalled read: %v", err)
	}
	equalBytes(t, "stalled read of the replaced version", got, old)
	equalBytes(t, "g", b.readVia(t, "g"), pattern(6, 300<<10))
	b.checkAlloc(t)
}

// hungPeer is a transport whose calls to one node hang until their
// context ends: a host that went down without closing its sockets.
type hungPeer struct {
	transfer.Transport
	node string
}

func (p hungPeer) Renew(ctx context.Context, node string, epoch, id uint64, ttl time.Duration) error {
	if node == p.node {
		<-ctx.Done()
		return ctx.Err()
	}
	return p.Transport.Renew(ctx, node, epoch, id, ttl)
}

// TestHungPeerDelaysNoRenewal: leases on a node that hangs do not keep
// the leases on healthy nodes from being renewed, and end once the node
// is gone from the cluster.
func TestHungPeerDelaysNoRenewal(t *testing.T) {
	ctx := context.Background()
	const ttl = 300 * time.Millisecond
	a, b := newCluster(t, true, withOptions(func(o *store.Options) {
		o.ReserveTTL = ttl
		o.Transport = hungPeer{Transport: o.Transport, node: "c"}
	}))
	for id := range uint64(8) {
		store.AddLease(a.Store, "c", 7, id+1)
	}
	d := a.NewDraft(store.NewIno(), nil, true)
	defer d.Close()
	d.Place(store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1})
	data := pattern(5, 128<<10)
	if _, err := d.WriteAt(ctx, data[:4096], 0); err != nil {
		t.Fatal(err)
	}
	time.Sleep(6 * ttl)
	if _, err := d.WriteAt(ctx, data[4096:], 4096); err != nil {
		t.Fatalf("write %v after the first, with a hung node's leases about: %v", 6*ttl, err)
	}
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	if n := b.Stats().Reaped; n != 0 {
		t.Fatalf("b reaped %d reservations of a live writer", n)
	}
	equalBytes(t, "f", b.readVia(t, "f"), data)
	// c is no member of the cluster: its leases end.
	waitFor(t, "a's leases to end", func() bool { return store.Leases(a.Store) == 0 })
}

// TestReserveErrors: an owner's refusal of a reservation comes back with
// the store's sentinel: ErrNoSpace for no room, ErrUnavailable (never
// ErrNoSpace: ETIMEDOUT to the user, not ENOSPC) for no room while the
// owner's index does not answer; anything else as it was.
func TestReserveErrors(t *testing.T) {
	full := fmt.Errorf("reserve on b: %w", transfer.ErrNoSpace)
	if err := store.ReserveError(full); !errors.Is(err, store.ErrNoSpace) || errors.Is(err, store.ErrUnavailable) {
		t.Errorf("no room: %v", err)
	}
	down := fmt.Errorf("reserve on b: %w", transfer.ErrIndexUnavailable)
	if err := store.ReserveError(down); !errors.Is(err, store.ErrUnavailable) || errors.Is(err, store.ErrNoSpace) ||
		!errors.Is(err, transfer.ErrIndexUnavailable) {
		t.Errorf("no room, index down: %v", err)
	}
	other := fmt.Errorf("reserve on b: %w", transfer.ErrUnreachable)
	if err := store.ReserveError(other); err != other {
		t.Errorf("unreachable: %v, want it unchanged", err)
	}
}

// indexDownAbove is a transport whose owner refuses reservations of more
// than above bytes as a full owner whose index does not answer would
// (transfer.ErrIndexUnavailable), and counts those refusals.
type indexDownAbove struct {
	transfer.Transport
	above   uint64
	refused *atomic.Int64
}

func (p indexDownAbove) Reserve(ctx context.Context, node string, n uint64, ttl time.Duration) (transfer.Reservation, error) {
	if n > p.above {
		p.refused.Add(1)
		return transfer.Reservation{}, fmt.Errorf("reserve %d B on %s: full: %w", n, node, transfer.ErrIndexUnavailable)
	}
	return p.Transport.Reserve(ctx, node, n, ttl)
}

// TestRemoteGrowthFitsWithIndexDown: a remote draft whose speculative
// growth the owner refuses for want of its index (it would have to
// evict) asks again for what the write needs, which fits, and the write
// lands: etcd's absence fails only what cannot fit.
func TestRemoteGrowthFitsWithIndexDown(t *testing.T) {
	ctx := context.Background()
	var refused atomic.Int64
	a, b := newCluster(t, true, withOptions(func(o *store.Options) {
		o.Transport = indexDownAbove{Transport: o.Transport, above: 64 << 10, refused: &refused}
	}))
	d := a.NewDraft(store.NewIno(), nil, true)
	defer d.Close()
	d.Place(store.Placement{Policy: store.PolicyNode, Node: "b", Replicas: 1})
	data := pattern(9, 8<<10)
	if _, err := d.WriteAt(ctx, data, 0); err != nil {
		t.Fatalf("write of 8 KiB on b, its speculative 256 KiB refused: %v", err)
	}
	if refused.Load() == 0 {
		t.Fatal("no reservation above 64 KiB was asked for: the test does not reach the case")
	}
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "f", b.readVia(t, "f"), data)
}
