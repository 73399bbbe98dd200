package transfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// fakeOwner is a Controller over a real segment table: enough to test the
// wire, not the store's reservation rules.
type fakeOwner struct {
	grant int64 // when not 0, the most TTL (ms) a reserve or renew gets
	// indexDown: a reserve fails as a full owner's whose index does not
	// answer.
	indexDown bool
	tab       *segment.Table
	mu        sync.Mutex
	next      uint64
	held      map[uint64][]segment.Extent
	ttl       map[uint64]int64
}

func (f *fakeOwner) Control(_ context.Context, r ControlRequest) (ControlResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	switch r.Op {
	case CtlReserve:
		if f.indexDown {
			return ControlResponse{}, errors.Join(ErrIndexUnavailable, errors.New("full, and etcd did not answer"))
		}
		ext, err := f.tab.Alloc(r.Bytes)
		if err != nil {
			return ControlResponse{}, errors.Join(ErrNoSpace, err)
		}
		f.next++
		f.held[f.next] = ext
		f.ttl[f.next] = r.TTLMillis
		if f.grant > 0 {
			return ControlResponse{ID: f.next, Extents: ext, TTLMillis: min(f.grant, r.TTLMillis)}, nil
		}
		return ControlResponse{ID: f.next, Extents: ext}, nil
	case CtlRenew:
		if _, ok := f.held[r.ID]; !ok {
			return ControlResponse{}, ErrUnknownReservation
		}
		f.ttl[r.ID] = r.TTLMillis
		return ControlResponse{}, nil
	case CtlFree:
		ext, ok := f.held[r.ID]
		if !ok {
			return ControlResponse{}, ErrUnknownReservation
		}
		delete(f.held, r.ID)
		return ControlResponse{}, f.tab.Free(ext)
	case CtlHold:
		// Bodies of version 5 and later exist; earlier ones are gone.
		if r.Version < 5 {
			return ControlResponse{}, ErrStaleBody
		}
		f.next++
		f.held[f.next] = r.Extents
		f.ttl[f.next] = r.TTLMillis
		return ControlResponse{ID: f.next}, nil
	case CtlRelease:
		if _, ok := f.held[r.ID]; !ok {
			return ControlResponse{}, ErrUnknownReservation
		}
		delete(f.held, r.ID)
		return ControlResponse{}, nil
	}
	return ControlResponse{}, ErrBadRequest
}

// newControlPair serves a fakeOwner as node "b" and returns a client of it.
func newControlPair(t *testing.T) (*fakeOwner, *tcpNode, *TCPTransport) {
	t.Helper()
	owner := &fakeOwner{held: map[uint64][]segment.Extent{}, ttl: map[uint64]int64{}}
	n := newTCPNode(t, testToken, 1<<20, TCPServerOptions{})
	owner.tab = n.tab
	n.srv.opts.Control = owner
	return owner, n, newTCPClient(t, testToken, map[string]string{"b": n.addr}, TCPOptions{})
}

func TestControlReserveRenewFree(t *testing.T) {
	owner, n, c := newControlPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()

	r, err := c.Reserve(ctx, "b", 300<<10, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if r.Node != "b" || segment.TotalLen(r.Extents) < 300<<10 {
		t.Fatalf("reservation %+v", r)
	}
	if err := c.Renew(ctx, "b", r.Epoch, r.ID, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if owner.ttl[r.ID] != 2000 {
		t.Fatalf("ttl %d ms", owner.ttl[r.ID])
	}
	if err := c.Renew(ctx, "b", r.Epoch, r.ID+100, time.Second); !errors.Is(err, ErrUnknownReservation) {
		t.Fatalf("renew of an unknown id: %v", err)
	}
	// Too much: a clean ErrNoSpace, and the connection stays usable.
	if _, err := c.Reserve(ctx, "b", 1<<40, time.Second); !errors.Is(err, ErrNoSpace) || errors.Is(err, ErrIndexUnavailable) {
		t.Fatalf("reserve 1 TiB: %v", err)
	}
	// An owner that cannot make room for want of its index says so,
	// not that it is full; the connection stays usable.
	owner.mu.Lock()
	owner.indexDown = true
	owner.mu.Unlock()
	if _, err := c.Reserve(ctx, "b", 4<<10, time.Second); !errors.Is(err, ErrIndexUnavailable) || errors.Is(err, ErrNoSpace) {
		t.Fatalf("reserve with the owner's index down: %v", err)
	}
	owner.mu.Lock()
	owner.indexDown = false
	owner.mu.Unlock()
	if err := c.Free(ctx, "b", r.Epoch, r.ID, nil); err != nil {
		t.Fatal(err)
	}
	if st := n.tab.Stats(); st.Used != 0 {
		t.Fatalf("%d B still used after free", st.Used)
	}
	if c.Stats().Dials != 1 {
		t.Fatalf("%d dials; error statuses must keep the connection", c.Stats().Dials)
	}
}

// TestControlRenewUnknownQuiet: the owner logs a failed control call,
// except the renewal of a reservation it no longer has, which every
// remote put's writer makes once after its commit was taken over.
func TestControlRenewUnknownQuiet(t *testing.T) {
	var mu sync.Mutex
	var lines []string
	logf := func(format string, args ...any) {
		mu.Lock()
		lines = append(lines, fmt.Sprintf(format, args...))
		mu.Unlock()
	}
	owner := &fakeOwner{held: map[uint64][]segment.Extent{}, ttl: map[uint64]int64{}}
	n := newTCPNode(t, testToken, 1<<20, TCPServerOptions{Control: owner, Log: logf})
	owner.tab = n.tab
	c := newTCPClient(t, testToken, map[string]string{"b": n.addr}, TCPOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	if err := c.Renew(ctx, "b", 0, 77, time.Second); !errors.Is(err, ErrUnknownReservation) {
		t.Fatalf("renew of an unknown id: %v", err)
	}
	if err := c.Free(ctx, "b", 0, 77, nil); !errors.Is(err, ErrUnknownReservation) {
		t.Fatalf("free of an unknown id: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(lines) != 1 || !strings.Contains(lines[0], "control free") || !strings.Contains(lines[0], ErrUnknownReservation.Error()) {
		t.Fatalf("logged %q; want the free alone", lines)
	}
}

// TestControlHoldRelease: holds over the wire, and ErrStaleBody coming
// back as itself.
func TestControlHoldRelease(t *testing.T) {
	owner, _, c := newControlPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	body := segment.Extent{Segment: 1, Off: 8192, Len: 4096}
	if _, err := c.Hold(ctx, "b", 0, body, 4, time.Second); !errors.Is(err, ErrStaleBody) {
		t.Fatalf("hold of a gone body: %v, want ErrStaleBody", err)
	}
	id, err := c.Hold(ctx, "b", 0, body, 9, 3*time.Second)
	if err != nil || id == 0 {
		t.Fatalf("hold: %d, %v", id, err)
	}
	if got := owner.held[id]; len(got) != 1 || got[0] != body || owner.ttl[id] != 3000 {
		t.Fatalf("owner got %v for %d ms", got, owner.ttl[id])
	}
	if err := c.Release(ctx, "b", 0, id); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(ctx, "b", 0, id); !errors.Is(err, ErrUnknownReservation) {
		t.Fatalf("second release: %v, want ErrUnknownReservation", err)
	}
}

func TestDecodeControlRejects(t *testing.T) {
	for _, in := range []string{
		``, `{`, `[]`, `{"op":"reserve"}`, `{"op":"reserve","bytes":1}`, `{"op":"renew","id":1}`,
		`{"op":"explode"}`, `{"op":"free","extra":1}`, `{"op":"free"}{"op":"free"}`,
		`{"op":"hold","version":3,"ttl_ms":10}`, `{"op":"hold","extents":[{"Segment":1,"Off":0,"Len":4096}],"ttl_ms":10}`,
		`{"op":"hold","extents":[{"Segment":1,"Off":0,"Len":4096}],"version":3}`,
		`{"op":"hold","extents":[{"Segment":1,"Off":0,"Len":0}],"version":3,"ttl_ms":10}`,
		`{"op":"hold","extents":[{"Segment":1,"Off":0,"Len":1},{"Segment":1,"Off":1,"Len":1}],"version":3,"ttl_ms":10}`,
		`{"op":"release"}`,
	} {
		if _, err := decodeControl([]byte(in)); !errors.Is(err, ErrBadRequest) {
			t.Errorf("decodeControl(%q) = %v, want ErrBadRequest", in, err)
		}
	}
	if _, err := decodeControl([]byte(`{"op":"sync"}`)); !errors.Is(err, ErrBadRequest) {
		t.Errorf("sync without a revision: %v", err)
	}
	if _, err := decodeControl([]byte(`{"op":"sync","rev":9}`)); err != nil {
		t.Fatal(err)
	}
	for _, ok := range []string{
		`{"op":"free","id":3,"extents":[{"Segment":1,"Off":0,"Len":4096}]}`,
		`{"op":"hold","extents":[{"Segment":1,"Off":0,"Len":4096}],"version":3,"ttl_ms":10}`,
		`{"op":"release","id":7}`,
	} {
		if _, err := decodeControl([]byte(ok)); err != nil {
			t.Errorf("decodeControl(%q): %v", ok, err)
		}
	}
}

// FuzzControl: the control decoder never panics and accepts only known ops.
func FuzzControl(f *testing.F) {
	f.Add([]byte(`{"op":"reserve","bytes":4096,"ttl_ms":10}`))
	f.Add([]byte(`{"op":"free","id":1,"extents":[{"Segment":0,"Off":0,"Len":1}]}`))
	f.Add([]byte(`{"op":"hold","extents":[{"Segment":0,"Off":0,"Len":1}],"version":2,"ttl_ms":5}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeControl(b)
		if err == nil && r.Op != CtlReserve && r.Op != CtlRenew && r.Op != CtlFree && r.Op != CtlSync &&
			r.Op != CtlHold && r.Op != CtlRelease {
			t.Fatalf("accepted op %q", r.Op)
		}
	})
}

// TestEngineRemote: requests naming another node go through the transport,
// host buffers directly and another process's memory through the bounce
// buffer; bytes land bit-exact.
func TestEngineRemote(t *testing.T) {
	n := newTCPNode(t, testToken, 16<<20, TCPServerOptions{})
	c := newTCPClient(t, testToken, map[string]string{"b": n.addr}, TCPOptions{})
	local := segment.NewTable()
	eng, err := New(Options{Local: local, Self: "a", Remote: c})
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	ctx := context.Background()
	src := bytes.Repeat([]byte("remote!"), (9<<20)/7)
	e := segment.Extent{Segment: 1, Off: 4096, Len: uint64(len(src))}
	if err := eng.Submit(ctx, []Request{{Op: Write, Buf: HostBuffer(src), Extent: e, Node: "b"}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(n.mem(t, e), src) {
		t.Fatal("host write did not land")
	}
	// Read it back into this process's memory named as ProcessVM: the
	// bounce path, in several pieces.
	dst := make([]byte, len(src))
	buf := VMBuffer(os.Getpid(), uint64(uintptr(unsafe.Pointer(&dst[0]))), uint64(len(dst)))
	if err := eng.Submit(ctx, []Request{{Op: Read, Buf: buf, Extent: e, Node: "b"}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("process-vm read through the bounce buffer differs")
	}
	st := eng.Stats()
	if st.BytesRead != e.Len || st.BytesWritten != e.Len {
		t.Fatalf("stats %+v", st)
	}
	// No transport for a node it cannot resolve: a clean error.
	if err := eng.Submit(ctx, []Request{{Op: Read, Buf: HostBuffer(dst[:4096]), Extent: segment.Extent{Len: 4096}, Node: "nowhere"}}); err == nil {
		t.Fatal("read from an unknown node succeeded")
	}
}

// bodyRule accepts checked reads of one body up to one version.
type bodyRule struct {
	body    segment.Extent
	version uint64
}

func (b bodyRule) CheckBody(_ context.Context, first segment.Extent, version uint64) (func(), error) {
	if first != b.body || version < b.version {
		return nil, ErrStaleBody
	}
	return func() {}, nil
}

func TestReadBody(t *testing.T) {
	body := segment.Extent{Segment: 1, Off: 0, Len: 1 << 20}
	n := newTCPNode(t, testToken, 1<<20, TCPServerOptions{Bodies: bodyRule{body: body, version: 5}})
	c := newTCPClient(t, testToken, map[string]string{"b": n.addr}, TCPOptions{ChunkBytes: 64 << 10})
	ctx := context.Background()
	e := segment.Extent{Segment: 1, Off: 100, Len: 300 << 10} // several chunks
	dst := make([]byte, e.Len)
	if err := c.ReadBody(ctx, "b", 0, body, 7, e, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, n.mem(t, e)) {
		t.Fatal("checked read returned other bytes")
	}
	other := body
	other.Off = 4096
	small := segment.Extent{Segment: 1, Off: 100, Len: 1000}
	dials := c.Stats().Dials
	for _, bad := range []struct {
		body    segment.Extent
		version uint64
	}{{body, 4}, {other, 9}} {
		if err := c.ReadBody(ctx, "b", 0, bad.body, bad.version, small, dst[:small.Len]); !errors.Is(err, ErrStaleBody) {
			t.Fatalf("checked read of %v at %d: %v", bad.body, bad.version, err)
		}
	}
	// Refusals keep the connection.
	if err := c.ReadBody(ctx, "b", 0, body, 5, small, dst[:small.Len]); err != nil {
		t.Fatal(err)
	}
	if d := c.Stats().Dials; d != dials {
		t.Fatalf("%d dials after %d: refusals dropped the connection", d, dials)
	}
	// A server that checks nothing refuses checked reads.
	plain := newTCPNode(t, testToken, 1<<20, TCPServerOptions{})
	c2 := newTCPClient(t, testToken, map[string]string{"p": plain.addr}, TCPOptions{})
	if err := c2.ReadBody(ctx, "p", 0, body, 7, e, dst); err == nil {
		t.Fatal("checked read served by a server without a checker")
	}
}

// TestSplitBounced: bounce-buffered pieces are cut into bounceBytes pieces
// that tile the extent and the buffer range in order; others stay whole.
func TestSplitBounced(t *testing.T) {
	vm := Request{Op: Read, Buf: Buffer{Kind: ProcessVM}, BufOff: 100, Extent: segment.Extent{Segment: 2, Off: 4096, Len: 2*bounceBytes + 5}}
	host := Request{Op: Read, Buf: Buffer{Kind: Host}, Extent: segment.Extent{Segment: 2, Off: 0, Len: 3 * bounceBytes}}
	got := splitBounced([]remotePiece{{idx: 0, req: vm}, {idx: 1, req: host}})
	if len(got) != 4 {
		t.Fatalf("%d pieces, want 3 + 1", len(got))
	}
	off, bufOff := vm.Extent.Off, vm.BufOff
	for i, p := range got[:3] {
		want := min(uint64(bounceBytes), vm.Extent.Off+vm.Extent.Len-off)
		if p.idx != 0 || p.req.Extent.Segment != 2 || p.req.Extent.Off != off || p.req.Extent.Len != want || p.req.BufOff != bufOff {
			t.Fatalf("piece %d: %+v, want extent at %d of %d B, buffer at %d", i, p, off, want, bufOff)
		}
		off += want
		bufOff += want
	}
	if got[3].idx != 1 || got[3].req.Extent != host.Extent {
		t.Fatalf("host piece changed: %+v", got[3])
	}
}

// countingGuard admits every write and counts those in flight.
type countingGuard struct{ inflight atomic.Int64 }

func (g *countingGuard) BeginWrite(resv uint64, e segment.Extent) (func(), error) {
	g.inflight.Add(1)
	return func() { g.inflight.Add(-1) }, nil
}

// TestGuardEndsBeforeResponse: when a guarded write returns to the
// writer, the owner no longer counts it in flight (a partial free the
// writer sends right after must not be refused for it).
func TestGuardEndsBeforeResponse(t *testing.T) {
	g := &countingGuard{}
	n := newTCPNode(t, testToken, 1<<20, TCPServerOptions{Writes: g})
	c := newTCPClient(t, testToken, map[string]string{"b": n.addr}, TCPOptions{ChunkBytes: 64 << 10})
	src := bytes.Repeat([]byte("g"), 256<<10) // four frames in parallel
	for i := range 200 {
		if err := c.WriteAt(context.Background(), "b", 0, 7, segment.Extent{Segment: 1, Len: uint64(len(src))}, src); err != nil {
			t.Fatal(err)
		}
		if k := g.inflight.Load(); k != 0 {
			t.Fatalf("write %d returned with %d frames still in flight on the owner", i, k)
		}
	}
}
