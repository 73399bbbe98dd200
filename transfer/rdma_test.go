package transfer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math/rand"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/rdma"
	"github.com/mooncake-fs/mooncake-fs/rdma/rdmafake"
	"github.com/mooncake-fs/mooncake-fs/segment"
)

// rdmaEpoch is node b's incarnation (a daemon's start time in ns).
const rdmaEpoch = 1_700_000_000_000_000_000

// rdmaPair is node "a" (an engine with RDMA and TCP) and node "b" (a TCP
// server with an RDMA path and its segments registered), on fake NICs.
type rdmaPair struct {
	fabric string
	pa, pb *rdmafake.Provider
	ra, rb *RDMA
	owner  *fakeOwner
	b      *tcpNode
	c      *TCPTransport
	eng    *Engine
}

func newRDMAPair(t *testing.T, o RDMAOptions) *rdmaPair {
	t.Helper()
	return newRDMAPairGPU(t, o, nil)
}

// newRDMAPairGPU is newRDMAPair whose node a's NIC reaches device memory
// gpu through dma-buf registrations.
func newRDMAPairGPU(t *testing.T, o RDMAOptions, gpu rdmafake.DeviceMemory) *rdmaPair {
	t.Helper()
	dir := t.TempDir()
	p := &rdmaPair{fabric: dir}
	var err error
	if p.pa, err = rdmafake.New(rdmafake.Options{Dir: dir, Devices: []string{"fa0"}, Jitter: 20 * time.Microsecond, DeviceMemory: gpu}); err != nil {
		t.Fatal(err)
	}
	if p.pb, err = rdmafake.New(rdmafake.Options{Dir: dir, Devices: []string{"fb0"}}); err != nil {
		t.Fatal(err)
	}
	da, err := p.pa.Open("fa0")
	if err != nil {
		t.Fatal(err)
	}
	db, err := p.pb.Open("fb0")
	if err != nil {
		t.Fatal(err)
	}
	p.owner = &fakeOwner{held: map[uint64][]segment.Extent{}, ttl: map[uint64]int64{}}
	p.b = newTCPNode(t, testToken, 4<<20, TCPServerOptions{Epoch: rdmaEpoch, Bodies: bodyRule{body: segment.Extent{Segment: 1, Len: 1 << 20}, version: 5}})
	p.owner.tab = p.b.tab
	// The owner's RDMA path needs a control transport of its own only
	// as a client; this one reaches no one.
	bc := newTCPClient(t, testToken, map[string]string{}, TCPOptions{})
	if p.rb, err = NewRDMA(RDMAOptions{Devices: []rdma.Device{db}, Control: bc, Self: "b"}); err != nil {
		t.Fatal(err)
	}
	for id := range 2 {
		mem, err := p.b.tab.Bytes(segment.Extent{Segment: segment.ID(id), Len: 4 << 20})
		if err != nil {
			t.Fatal(err)
		}
		if err := p.rb.RegisterSegment(segment.ID(id), mem); err != nil {
			t.Fatal(err)
		}
	}
	p.b.srv.opts.Control = p.owner
	p.b.srv.opts.RDMA = p.rb
	p.c = newTCPClient(t, testToken, map[string]string{"b": p.b.addr}, TCPOptions{})
	o.Devices, o.Control, o.Self = []rdma.Device{da}, p.c, "a"
	if o.Log == nil {
		o.Log = t.Logf
	}
	if p.ra, err = NewRDMA(o); err != nil {
		t.Fatal(err)
	}
	if p.eng, err = New(Options{Local: segment.NewTable(), Self: "a", Remote: p.c, RDMA: p.ra}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.eng.Close()
		if err := p.ra.Close(); err != nil {
			t.Errorf("close a: %v", err)
		}
		if err := p.rb.Close(); err != nil {
			t.Errorf("close b: %v", err)
		}
		if n := p.pa.MRs() + p.pb.MRs(); n != 0 {
			t.Errorf("%d MRs left registered after Close", n)
		}
		da.Close()
		db.Close()
	})
	return p
}

// reserve reserves n bytes on b and returns the reservation's extent.
func (p *rdmaPair) reserve(t *testing.T, n uint64, ttl time.Duration) Reservation {
	t.Helper()
	r, err := p.c.Reserve(context.Background(), "b", n, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Extents) != 1 {
		t.Fatalf("reservation of %d extents", len(r.Extents))
	}
	return r
}

func randBytes(n int, seed int64) []byte {
	b := make([]byte, n)
	rand.New(rand.NewSource(seed)).Read(b)
	return b
}

func (p *rdmaPair) path(name Path) PathStats { return p.eng.Stats().Paths[name] }

// TestRDMAPaths: registered memory moves NIC to NIC with no local copy;
// other host memory and process memory through the bounce pool with one;
// a write naming no reservation over TCP, where the owner checks it.
func TestRDMAPaths(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{ChunkBytes: 64 << 10})
	ctx := context.Background()
	const n = 300 << 10 // several work requests
	r := p.reserve(t, n, time.Minute)
	e := r.Extents[0]
	src := randBytes(n, 1)
	release, err := p.ra.Register(src)
	if err != nil {
		t.Fatal(err)
	}
	w := Request{Op: Write, Buf: HostBuffer(src), Extent: e, Node: "b", Epoch: r.Epoch, Resv: r.ID}
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p.b.mem(t, e), src) {
		t.Fatal("direct write did not land")
	}
	if s := p.path(pathRDMADirect); s.Written != n || s.Copied() != 0 || s.Requests != 1 {
		t.Fatalf("rdma-direct after a registered write: %+v", s)
	}
	back := make([]byte, n)
	release2, err := p.ra.Register(back)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.eng.Submit(ctx, []Request{{Op: Read, Buf: HostBuffer(back), Extent: e, Node: "b", Epoch: r.Epoch}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(back, src) {
		t.Fatal("direct read differs")
	}
	release()
	release2()
	if st := p.ra.Stats(); st.RegisteredBytes != 0 || st.Registrations != 2 {
		t.Fatalf("registrations after release: %+v", st)
	}

	// Released memory is no longer registered: staged, one copy per byte.
	src2 := randBytes(n, 2)
	copy(src, src2)
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p.b.mem(t, e), src2) {
		t.Fatal("staged write did not land")
	}
	if s := p.path(pathRDMAStaged); s.Written != n || s.CopiedWritten != n || s.Read != 0 {
		t.Fatalf("rdma-staged: %+v", s)
	}
	// Process memory, read through the pool.
	dst := make([]byte, n)
	vm := VMBuffer(os.Getpid(), uint64(uintptr(unsafe.Pointer(&dst[0]))), n)
	if err := p.eng.Submit(ctx, []Request{{Op: Read, Buf: vm, Extent: e, Node: "b", Epoch: r.Epoch}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src2) {
		t.Fatal("staged process-vm read differs")
	}
	if s := p.path(pathRDMAStaged); s.Bytes() != 2*n || s.CopiedRead != n || s.CopiedWritten != n {
		t.Fatalf("rdma-staged after the read: %+v", s)
	}
	// No reservation: TCP.
	e2 := segment.Extent{Segment: 0, Off: 0, Len: 4096}
	if err := p.eng.Submit(ctx, []Request{{Op: Write, Buf: HostBuffer(src[:4096]), Extent: e2, Node: "b"}}); err != nil {
		t.Fatal(err)
	}
	if s := p.path(pathTCP); s.Written != 4096 || s.CopiedWritten != 4096 {
		t.Fatalf("tcp: %+v", s)
	}
	if st := p.ra.Stats(); st.Exchanges != 1 || st.Sessions != 1 || st.Fallbacks != 1 || st.Broken != 0 {
		t.Fatalf("rdma stats %+v", st)
	}
	if st := p.rb.Stats(); st.Served != 1 || st.Segments != 2 {
		t.Fatalf("owner's rdma stats %+v", st)
	}
	if fs := p.pa.Stats(); fs.Failed != 0 || fs.Bytes != 4*n {
		t.Fatalf("fake NIC a: %+v", fs)
	}
}

// TestRDMAGPUDirect: GPU memory registered through its dma-buf moves NIC
// to GPU with no local copy, within what was registered; its release
// leaves nothing registered. (No GPU here: the fake NIC's device memory
// is host memory at device addresses; the GPU host runs the same path on
// a real GPU through tests/gpu/cluster.sh.)
func TestRDMAGPUDirect(t *testing.T) {
	const n = 200 << 10
	gpu := &rdmafake.HostMemory{Base: 0x7e0000000000, Mem: make([]byte, 1<<20), Dmabufs: map[int]uint64{99: 1 << 20}}
	p := newRDMAPairGPU(t, RDMAOptions{ChunkBytes: 64 << 10}, gpu)
	ctx := context.Background()
	if _, err := p.ra.RegisterDevice(98, gpu.Base, 1<<20); err == nil {
		t.Fatal("a descriptor that is no dma-buf registered")
	}
	release, err := p.ra.RegisterDevice(99, gpu.Base, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	src := randBytes(n, 7)
	copy(gpu.Mem[4096:], src)
	gctx := &cuda.Context{} // never called: the NIC reads the memory
	r := p.reserve(t, n, time.Minute)
	e := r.Extents[0]
	w := Request{Op: Write, Buf: CUDABuffer(gctx, cuda.DevicePtr(gpu.Base+4096), n), Extent: e, Node: "b", Epoch: r.Epoch, Resv: r.ID}
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p.b.mem(t, e), src) {
		t.Fatal("write from GPU memory did not land")
	}
	rd := Request{Op: Read, Buf: CUDAAllocBuffer(gctx, cuda.DevicePtr(gpu.Base), 512<<10, n), Extent: e, Node: "b", Epoch: r.Epoch}
	if err := p.eng.Submit(ctx, []Request{rd}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(gpu.Mem[512<<10:512<<10+n], src) {
		t.Fatal("read into GPU memory differs")
	}
	if s := p.path(pathRDMADirect); s.Written != n || s.Read != n || s.Copied() != 0 {
		t.Fatalf("rdma-direct after GPU transfers: %+v", s)
	}
	if s := p.path(pathRDMAStaged); s.Bytes() != 0 {
		t.Fatalf("GPU transfers staged: %+v", s)
	}
	release()
	if st := p.ra.Stats(); st.RegisteredBytes != 0 {
		t.Fatalf("registered after release: %+v", st)
	}
}

// TestRDMACheckedRead: a one-sided read of a body that was replaced
// fails after the owner's check.
func TestRDMACheckedRead(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{})
	ctx := context.Background()
	body := segment.Extent{Segment: 1, Len: 1 << 20}
	e := segment.Extent{Segment: 1, Off: 4096, Len: 64 << 10}
	dst := make([]byte, e.Len)
	release, err := p.ra.Register(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	rq := Request{Op: Read, Buf: HostBuffer(dst), Extent: e, Node: "b", Body: body, Version: 7}
	if err := p.eng.Submit(ctx, []Request{rq}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, p.b.mem(t, e)) {
		t.Fatal("checked read differs")
	}
	rq.Version = 4 // replaced since
	if err := p.eng.Submit(ctx, []Request{rq}); !errors.Is(err, ErrStaleBody) {
		t.Fatalf("checked read of a replaced body: %v", err)
	}
	rq.Buf = HostBuffer(make([]byte, e.Len)) // staged: checked too
	if err := p.eng.Submit(ctx, []Request{rq}); !errors.Is(err, ErrStaleBody) {
		t.Fatalf("staged checked read of a replaced body: %v", err)
	}
	if st := p.ra.Stats(); st.StaleChecks != 2 {
		t.Fatalf("stale checks %d", st.StaleChecks)
	}
}

// TestRDMAFence: a write the writer cannot vouch for (an unknown
// reservation, an extent outside it, a lease that ends within the
// margin, a reservation freed in part) goes over TCP, where the owner
// checks it; nothing of it is posted to the NIC.
func TestRDMAFence(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{LeaseMargin: 10 * time.Second})
	ctx := context.Background()
	short := p.reserve(t, 8192, 5*time.Second)
	e := short.Extents[0]
	src := randBytes(4096, 3)
	in := segment.Extent{Segment: e.Segment, Off: e.Off, Len: 4096}
	out := segment.Extent{Segment: e.Segment, Off: e.Off + 8192, Len: 4096}
	for i, w := range []Request{
		{Op: Write, Buf: HostBuffer(src), Extent: in, Node: "b", Epoch: short.Epoch, Resv: short.ID}, // lease too short
		{Op: Write, Buf: HostBuffer(src), Extent: in, Node: "b", Epoch: short.Epoch, Resv: 999},      // unknown
		{Op: Write, Buf: HostBuffer(src), Extent: in, Node: "b", Resv: short.ID},                     // no epoch
	} {
		if err := p.eng.Submit(ctx, []Request{w}); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
	}
	if fs := p.pa.Stats(); fs.Writes != 0 {
		t.Fatalf("unvouched writes posted: %+v", fs)
	}
	if s := p.path(pathTCP); s.Written != 3*4096 {
		t.Fatalf("tcp after three unvouched writes: %+v", s)
	}
	// Renewed, the lease is long enough: RDMA, inside the reservation only.
	if err := p.c.Renew(ctx, "b", short.Epoch, short.ID, time.Minute); err != nil {
		t.Fatal(err)
	}
	for _, x := range []segment.Extent{in, out} {
		w := Request{Op: Write, Buf: HostBuffer(src), Extent: x, Node: "b", Epoch: short.Epoch, Resv: short.ID}
		if err := p.eng.Submit(ctx, []Request{w}); err != nil {
			t.Fatal(err)
		}
	}
	if fs := p.pa.Stats(); fs.Writes != 1 {
		t.Fatalf("writes posted after the renewal: %+v (want the one inside the reservation)", fs)
	}
	if !bytes.Equal(p.b.mem(t, in), src) || !bytes.Equal(p.b.mem(t, out), src) {
		t.Fatal("writes did not land")
	}
	// Freed in part: forgotten.
	if err := p.c.Free(ctx, "b", short.Epoch, short.ID, []segment.Extent{{Segment: e.Segment, Off: e.Off + 4096, Len: 4096}}); err != nil {
		t.Fatal(err)
	}
	w := Request{Op: Write, Buf: HostBuffer(src), Extent: in, Node: "b", Epoch: short.Epoch, Resv: short.ID}
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatal(err)
	}
	if fs := p.pa.Stats(); fs.Writes != 1 {
		t.Fatalf("a write into a partly freed reservation was posted: %+v", fs)
	}
}

// TestRDMAFenceWhileWaiting: a write whose lease nears its end while it
// waits for a QP is not posted late: it goes over TCP.
func TestRDMAFenceWhileWaiting(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{QPsPerPeer: 1, LeaseMargin: time.Second, Timeout: 3 * time.Second})
	ctx := context.Background()
	dst := make([]byte, 4096)
	rd := Request{Op: Read, Buf: HostBuffer(dst), Extent: segment.Extent{Segment: 0, Len: 4096}, Node: "b"}
	if err := p.eng.Submit(ctx, []Request{rd}); err != nil {
		t.Fatal(err)
	}
	r := p.reserve(t, 4096, 2500*time.Millisecond)
	p.pa.Inject(rdmafake.FaultTimeout)
	hung := make(chan error, 1)
	go func() { hung <- p.eng.Submit(ctx, []Request{rd}) }() // holds the only QP
	time.Sleep(100 * time.Millisecond)
	src := randBytes(4096, 9)
	w := Request{Op: Write, Buf: HostBuffer(src), Extent: r.Extents[0], Node: "b", Epoch: r.Epoch, Resv: r.ID}
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatal(err)
	}
	// Fenced while it waited: the read still holds the QP.
	select {
	case err := <-hung:
		t.Fatalf("the hung read ended (%v) before the fenced write returned", err)
	default:
	}
	if st := p.ra.Stats(); st.FencedWrites != 1 || st.Exchanges != 1 {
		t.Fatalf("stats %+v", st)
	}
	if fs := p.pa.Stats(); fs.Writes != 0 {
		t.Fatalf("a write was posted after its fence: %+v", fs)
	}
	if !bytes.Equal(p.b.mem(t, r.Extents[0]), src) {
		t.Fatal("the write did not land over TCP")
	}
	if err := <-hung; !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the hung read: %v", err)
	}
}

// TestRDMAFenceMidWrite: a write whose lease reaches its margin between
// two posts loses its QP (and what it had posted) and is redone over TCP.
func TestRDMAFenceMidWrite(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{Depth: 1, ChunkBytes: 4096, LeaseMargin: time.Second})
	ctx := context.Background()
	const n = 256 << 10
	r := p.reserve(t, n, 3*time.Second)
	src := randBytes(n, 11)
	release, err := p.ra.Register(src)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	p.pa.SetJitter(100 * time.Millisecond) // 64 posts: about 3.2 s, the fence at 2 s
	w := Request{Op: Write, Buf: HostBuffer(src), Extent: r.Extents[0], Node: "b", Epoch: r.Epoch, Resv: r.ID}
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p.b.mem(t, r.Extents[0]), src) {
		t.Fatal("the write did not land")
	}
	st, fs := p.ra.Stats(), p.pa.Stats()
	if st.Discarded != 1 || st.FencedWrites != 1 || st.Broken != 0 || fs.Writes == 0 || fs.Writes >= n/4096 {
		t.Fatalf("stats %+v, NIC %+v (want some writes posted, then the fence)", st, fs)
	}
	if s := p.path(pathTCP); s.Written != n {
		t.Fatalf("tcp %+v", s)
	}
}

// TestRDMAGrantedTTL: the lease is the TTL the owner granted, not the
// one asked for.
func TestRDMAGrantedTTL(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{LeaseMargin: time.Second})
	p.owner.grant = 3000
	ctx := context.Background()
	r := p.reserve(t, 4096, time.Minute)
	src := randBytes(4096, 12)
	w := Request{Op: Write, Buf: HostBuffer(src), Extent: r.Extents[0], Node: "b", Epoch: r.Epoch, Resv: r.ID}
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatal(err)
	}
	if fs := p.pa.Stats(); fs.Writes != 1 {
		t.Fatalf("first write not over RDMA: %+v", fs)
	}
	time.Sleep(2100 * time.Millisecond) // past the granted TTL less the margin
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatal(err)
	}
	if fs := p.pa.Stats(); fs.Writes != 1 || p.path(pathTCP).Written != 4096 {
		t.Fatalf("a write past the granted lease went over RDMA: %+v", fs)
	}
}

// TestRDMABrokenSession: a failed completion ends the session; the
// request is retried once on a new one, and fails when that fails too.
func TestRDMABrokenSession(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{})
	ctx := context.Background()
	r := p.reserve(t, 8192, time.Minute)
	src := randBytes(8192, 4)
	w := Request{Op: Write, Buf: HostBuffer(src), Extent: r.Extents[0], Node: "b", Epoch: r.Epoch, Resv: r.ID}
	p.pa.Inject(rdmafake.FaultQPError)
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatalf("write after one QP error: %v", err)
	}
	if !bytes.Equal(p.b.mem(t, r.Extents[0]), src) {
		t.Fatal("retried write did not land")
	}
	if st := p.ra.Stats(); st.Broken != 1 || st.Retries != 1 || st.Exchanges != 2 {
		t.Fatalf("after one failure: %+v", st)
	}
	// Failing again on a fresh session: the rail goes to TCP for a while
	// and the write is redone there.
	p.pa.Inject(rdmafake.FaultRemoteAccess, rdmafake.FaultRemoteAccess)
	copy(src, randBytes(8192, 5))
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatalf("write after two failures: %v", err)
	}
	if !bytes.Equal(p.b.mem(t, r.Extents[0]), src) || p.path(pathTCP).Written != 8192 {
		t.Fatalf("the write was not redone over TCP: %+v", p.eng.Stats().Paths)
	}
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatalf("write once the faults passed: %v", err)
	}
	if st := p.rb.Stats(); st.Served != 1 {
		t.Fatalf("owner serves %d sessions of one peer", st.Served)
	}
}

// TestRDMACompletionTimeout: a completion that never comes fails the
// call at its deadline; that QP is dropped, the session and the other
// QPs stay.
func TestRDMACompletionTimeout(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{Timeout: 300 * time.Millisecond})
	ctx := context.Background()
	dst := make([]byte, 4096)
	rq := Request{Op: Read, Buf: HostBuffer(dst), Extent: segment.Extent{Segment: 0, Len: 4096}, Node: "b"}
	if err := p.eng.Submit(ctx, []Request{rq}); err != nil { // sets up the session
		t.Fatal(err)
	}
	p.pa.Inject(rdmafake.FaultTimeout)
	if err := p.eng.Submit(ctx, []Request{rq}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("read whose completion never comes: %v", err)
	}
	if err := p.eng.Submit(ctx, []Request{rq}); err != nil {
		t.Fatalf("read after the timeout: %v", err)
	}
	if st := p.ra.Stats(); st.Broken != 0 || st.Exchanges != 1 || st.Discarded != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestRDMACancelledCallers: callers that give up cost their QPs, not the
// peer's session; when every QP is gone, the next call sets up a new one.
func TestRDMACancelledCallers(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{QPsPerPeer: 2})
	dst := make([]byte, 4096)
	rq := Request{Op: Read, Buf: HostBuffer(dst), Extent: segment.Extent{Segment: 0, Len: 4096}, Node: "b"}
	if err := p.eng.Submit(context.Background(), []Request{rq}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		p.pa.Inject(rdmafake.FaultTimeout)
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		err := p.eng.Submit(ctx, []Request{rq})
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("cancelled read %d: %v", i, err)
		}
	}
	if st := p.ra.Stats(); st.Discarded != 2 || st.Broken != 0 || st.Fallbacks != 0 {
		t.Fatalf("after two cancelled reads: %+v", st)
	}
	if err := p.eng.Submit(context.Background(), []Request{rq}); err != nil {
		t.Fatal(err)
	}
	if st := p.ra.Stats(); st.Exchanges != 2 || st.Fallbacks != 0 || st.Sessions != 1 {
		t.Fatalf("after the next read: %+v", st)
	}
	if s := p.path(pathTCP); s.Requests != 0 {
		t.Fatalf("reads went over TCP: %+v", s)
	}
}

// TestRDMACloseWaits: Close waits for calls in flight, then releases
// every QP and registration (the cleanup checks the MRs).
func TestRDMACloseWaits(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{Timeout: 500 * time.Millisecond})
	dst := make([]byte, 4096)
	rq := Request{Op: Read, Buf: HostBuffer(dst), Extent: segment.Extent{Segment: 0, Len: 4096}, Node: "b"}
	if err := p.eng.Submit(context.Background(), []Request{rq}); err != nil {
		t.Fatal(err)
	}
	p.pa.Inject(rdmafake.FaultTimeout)
	hung := make(chan error, 1)
	go func() {
		hung <- p.ra.move(context.Background(), rq, rq.Extent, addrOf(p.ra.pool.mem), 0, p.ra.mu.poolReg.mrs[0].LKey())
	}()
	// Close once the call is in flight, its request stuck on the fault (a
	// fixed sleep let Close run first on a loaded machine).
	for deadline := time.Now().Add(20 * time.Second); p.pa.Pending() > 0 || p.ra.Stats().InFlight == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the call's request never ran")
		}
	}
	if err := p.ra.Close(); err != nil {
		t.Fatal(err)
	}
	// Close returned: the call is over (it ended before Close's wait did;
	// its result reaches the channel a moment later) and it failed.
	if n := p.ra.Stats().InFlight; n != 0 {
		t.Fatalf("Close returned with %d calls in flight", n)
	}
	select {
	case err := <-hung:
		if err == nil {
			t.Fatal("a call cut off by Close succeeded")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the call cut off by Close never returned")
	}
	if err := p.ra.move(context.Background(), rq, rq.Extent, 0, 0, 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("call after Close: %v", err)
	}
}

// TestRDMAManySegments: the hello of an owner with thousands of segments
// fits its answer.
func TestRDMAManySegments(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{})
	for id := 2; id < maxRDMASegments; id++ {
		if err := p.rb.RegisterSegment(segment.ID(id), make([]byte, 4096)); err != nil {
			t.Fatal(err)
		}
	}
	dst := make([]byte, 4096)
	rq := Request{Op: Read, Buf: HostBuffer(dst), Extent: segment.Extent{Segment: 1, Len: 4096}, Node: "b"}
	if err := p.eng.Submit(context.Background(), []Request{rq}); err != nil {
		t.Fatal(err)
	}
	if s := p.path(pathRDMAStaged); s.Read != 4096 {
		t.Fatalf("read with %d segments on the owner: %+v, rdma %+v", maxRDMASegments, p.eng.Stats().Paths, p.ra.Stats())
	}
}

// TestRDMAForget: a node that left is forgotten both ways.
func TestRDMAForget(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{})
	dst := make([]byte, 4096)
	rq := Request{Op: Read, Buf: HostBuffer(dst), Extent: segment.Extent{Segment: 0, Len: 4096}, Node: "b"}
	if err := p.eng.Submit(context.Background(), []Request{rq}); err != nil {
		t.Fatal(err)
	}
	p.ra.Forget("b")
	p.rb.Forget("a")
	if a, b := p.ra.Stats(), p.rb.Stats(); a.Sessions != 0 || b.Served != 0 {
		t.Fatalf("after Forget: %+v / %+v", a, b)
	}
	if err := p.eng.Submit(context.Background(), []Request{rq}); err != nil {
		t.Fatal(err)
	}
	if a, b := p.ra.Stats(), p.rb.Stats(); a.Exchanges != 2 || b.Served != 1 {
		t.Fatalf("after the next read: %+v / %+v", a, b)
	}
}

// TestRDMAPoolExhausted: staging waits for a pool buffer up to PoolWait
// and then fails; it never registers memory for the call.
func TestRDMAPoolExhausted(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{ChunkBytes: 64 << 10, PoolBytes: 64 << 10, PoolWait: 50 * time.Millisecond})
	ctx := context.Background()
	_, hold, err := p.ra.stage(ctx, 4096)
	if err != nil {
		t.Fatal(err)
	}
	mrs := p.pa.MRs()
	dst := make([]byte, 4096)
	rq := Request{Op: Read, Buf: HostBuffer(dst), Extent: segment.Extent{Segment: 0, Len: 4096}, Node: "b"}
	if err := p.eng.Submit(ctx, []Request{rq}); !errors.Is(err, ErrPoolExhausted) {
		t.Fatalf("staged read with the pool taken: %v", err)
	}
	if p.pa.MRs() != mrs {
		t.Fatal("a staged call registered memory")
	}
	hold()
	if err := p.eng.Submit(ctx, []Request{rq}); err != nil {
		t.Fatal(err)
	}
	if st := p.ra.Stats(); st.PoolTimeouts != 1 || st.PoolWaits != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestRDMABadExtents: unknown segments and ranges past a segment's end
// are refused by the client before anything is posted.
func TestRDMABadExtents(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{})
	ctx := context.Background()
	dst := make([]byte, 8192)
	for _, c := range []struct {
		e    segment.Extent
		want error
	}{
		{segment.Extent{Segment: 9, Len: 4096}, segment.ErrUnknownSegment},
		{segment.Extent{Segment: 1, Off: 4<<20 - 4096, Len: 8192}, segment.ErrBadRange},
	} {
		err := p.eng.Submit(ctx, []Request{{Op: Read, Buf: HostBuffer(dst[:c.e.Len]), Extent: c.e, Node: "b"}})
		if !errors.Is(err, c.want) {
			t.Fatalf("read of %v: %v, want %v", c.e, err, c.want)
		}
	}
	if fs := p.pa.Stats(); fs.Reads+fs.Failed != 0 {
		t.Fatalf("bad extents posted: %+v", fs)
	}
}

// TestRDMAStaleEpoch: extents of another incarnation fail after one
// fresh exchange, as over TCP.
func TestRDMAStaleEpoch(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{})
	ctx := context.Background()
	dst := make([]byte, 4096)
	rq := Request{Op: Read, Buf: HostBuffer(dst), Extent: segment.Extent{Segment: 0, Len: 4096}, Node: "b", Epoch: 12345}
	for range 3 {
		if err := p.eng.Submit(ctx, []Request{rq}); !errors.Is(err, ErrStaleEpoch) {
			t.Fatalf("read of a dead incarnation's extent: %v", err)
		}
	}
	// A request naming an older incarnation leaves the live session be;
	// nothing went over TCP.
	if st := p.ra.Stats(); st.Exchanges != 1 || st.Sessions != 1 || st.Fallbacks != 0 {
		t.Fatalf("stats %+v", st)
	}
	// One naming a newer one than the session's (the owner restarted
	// since) makes a fresh exchange, whose epoch settles it.
	rq.Epoch = ^uint64(0)
	if err := p.eng.Submit(ctx, []Request{rq}); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("read of a later incarnation's extent: %v", err)
	}
	if st := p.ra.Stats(); st.Exchanges != 2 || st.Fallbacks != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// TestRDMAPeerWithoutRDMA: a peer that has no RDMA path is reached over
// TCP, and asked again only after a while.
func TestRDMAPeerWithoutRDMA(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{})
	p.b.srv.opts.RDMA = nil
	ctx := context.Background()
	dst := make([]byte, 4096)
	rq := Request{Op: Read, Buf: HostBuffer(dst), Extent: segment.Extent{Segment: 0, Len: 4096}, Node: "b"}
	for range 3 {
		if err := p.eng.Submit(ctx, []Request{rq}); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(dst, p.b.mem(t, rq.Extent)) {
		t.Fatal("tcp read differs")
	}
	if st := p.ra.Stats(); st.Exchanges != 0 || st.Fallbacks != 3 {
		t.Fatalf("stats %+v", st)
	}
	if s := p.path(pathTCP); s.Requests != 3 {
		t.Fatalf("tcp %+v", s)
	}
}

// TestRDMAConcurrent: many calls on a few QPs, out of order.
func TestRDMAConcurrent(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{QPsPerPeer: 2, ChunkBytes: 16 << 10})
	ctx := context.Background()
	r := p.reserve(t, 1<<20, time.Minute)
	src := randBytes(1<<20, 5)
	release, err := p.ra.Register(src)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	var reqs []Request
	for i := range 64 {
		e := r.Extents[0]
		e.Off += uint64(i) * 16 << 10
		e.Len = 16 << 10
		reqs = append(reqs, Request{Op: Write, Buf: HostBuffer(src), BufOff: uint64(i) * 16 << 10, Extent: e, Node: "b", Epoch: r.Epoch, Resv: r.ID})
	}
	if err := p.eng.Submit(ctx, reqs); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p.b.mem(t, r.Extents[0]), src) {
		t.Fatal("bytes differ")
	}
	if s := p.path(pathRDMADirect); s.Written != 1<<20 || s.Requests != 64 {
		t.Fatalf("rdma-direct %+v", s)
	}
}

func TestRDMAHelloRejects(t *testing.T) {
	for _, h := range []*RDMAHello{
		nil,
		{GID: rdma.GID{1}},
		{GID: rdma.GID{1}, QPs: make([]RDMAQP, maxRDMAQPs+1)},
		{QPs: []RDMAQP{{QPN: 1}}},
		{GID: rdma.GID{1}, QPs: []RDMAQP{{QPN: 0}}},
		{GID: rdma.GID{1}, QPs: []RDMAQP{{QPN: 1 << 24}}},
	} {
		if _, err := decodeControl(mustJSON(t, ControlRequest{Op: CtlRDMA, RDMA: h})); !errors.Is(err, ErrBadRequest) {
			t.Fatalf("hello %+v: %v", h, err)
		}
	}
	if _, err := decodeControl(mustJSON(t, ControlRequest{Op: CtlSync, Rev: 1, RDMA: &RDMAHello{}})); !errors.Is(err, ErrBadRequest) {
		t.Fatalf("sync with a hello: %v", err)
	}
	if _, err := decodeControl(mustJSON(t, ControlRequest{Op: CtlCheck, Extents: []segment.Extent{{Len: 1}}})); !errors.Is(err, ErrBadRequest) {
		t.Fatalf("check at version 0: %v", err)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRDMARails: a node with two devices uses each for its own rail; the
// owner, with one, serves both rails on it; memory is registered on every
// device, and each rail's work requests go through its own device.
func TestRDMARails(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{})
	var provs []*rdmafake.Provider
	var devs []rdma.Device
	for _, n := range []string{"fx0", "fx1"} {
		pr, err := rdmafake.New(rdmafake.Options{Dir: p.fabric, Devices: []string{n}})
		if err != nil {
			t.Fatal(err)
		}
		d, err := pr.Open(n)
		if err != nil {
			t.Fatal(err)
		}
		provs, devs = append(provs, pr), append(devs, d)
	}
	x, err := NewRDMA(RDMAOptions{Devices: devs, NearGPU: map[int]int{0: 1}, Control: p.c, Self: "x", Log: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	// The owner gets a second device: it serves rail 1 on it.
	po1, err := rdmafake.New(rdmafake.Options{Dir: p.fabric, Devices: []string{"fb1"}})
	if err != nil {
		t.Fatal(err)
	}
	db1, err := po1.Open("fb1")
	if err != nil {
		t.Fatal(err)
	}
	old := p.b.srv.opts.RDMA
	owner2, err := NewRDMA(RDMAOptions{Devices: []rdma.Device{old.opts.Devices[0], db1}, Control: old.opts.Control, Self: "b"})
	if err != nil {
		t.Fatal(err)
	}
	for id := range 2 {
		mem, _ := p.b.tab.Bytes(segment.Extent{Segment: segment.ID(id), Len: 4 << 20})
		if err := owner2.RegisterSegment(segment.ID(id), mem); err != nil {
			t.Fatal(err)
		}
	}
	p.b.srv.opts.RDMA = owner2
	defer func() {
		p.b.srv.opts.RDMA = old
		if err := owner2.Close(); err != nil {
			t.Error(err)
		}
		db1.Close()
	}()
	ctx := context.Background()
	buf := make([]byte, 8192)
	release, err := x.Register(buf)
	if err != nil {
		t.Fatal(err)
	}
	e := segment.Extent{Segment: 1, Off: 8192, Len: 8192}
	for d := range 2 {
		lkey, ok := x.regs.lookup(addrOf(buf), 8192, d)
		if !ok {
			t.Fatalf("buffer not registered on device %d", d)
		}
		if err := x.move(ctx, Request{Op: Read, Node: "b", Extent: e}, e, addrOf(buf), d, lkey); err != nil {
			t.Fatalf("read on rail %d: %v", d, err)
		}
		if !bytes.Equal(buf, p.b.mem(t, e)) {
			t.Fatalf("read on rail %d differs", d)
		}
		for i, pr := range provs {
			want := uint64(0)
			if i <= d {
				want = 1
			}
			if got := pr.Stats().Reads; got != want {
				t.Fatalf("after the read on rail %d, device %d ran %d reads, want %d", d, i, got, want)
			}
		}
	}
	if st := owner2.Stats(); st.Served != 2 {
		t.Fatalf("owner serves %d sessions, want one per rail", st.Served)
	}
	// An engine staging host memory on rail 1 (as GPU memory near that
	// device would be): the pool's lkey on device 1, the owner's rkey on
	// its device 1.
	x.hostDevice = func(Buffer) int { return 1 }
	eng, err := New(Options{Local: segment.NewTable(), Self: "x", Remote: p.c, RDMA: x})
	if err != nil {
		t.Fatal(err)
	}
	reads1 := provs[1].Stats().Reads
	plain := make([]byte, 8192)
	if err := eng.Submit(ctx, []Request{{Op: Read, Buf: HostBuffer(plain), Extent: e, Node: "b"}}); err != nil {
		t.Fatal(err)
	}
	eng.Close()
	x.hostDevice = nil
	if !bytes.Equal(plain, p.b.mem(t, e)) || provs[1].Stats().Reads != reads1+1 || provs[0].Stats().Reads != 1 {
		t.Fatalf("staged read on rail 1: paths %+v, devices %+v %+v", eng.Stats().Paths, provs[0].Stats(), provs[1].Stats())
	}
	if s := eng.Stats().Paths[pathRDMAStaged]; s.Read != 8192 {
		t.Fatalf("staged read: %+v", eng.Stats().Paths)
	}
	// A mismatched lkey (device 0's on rail 1) is the NIC's error, not a copy.
	lkey0, _ := x.regs.lookup(addrOf(buf), 8192, 0)
	lkey1, _ := x.regs.lookup(addrOf(buf), 8192, 1)
	if lkey0 != lkey1 {
		before := x.Stats().CompletionErrors
		err := x.move(ctx, Request{Op: Read, Node: "b", Extent: e}, e, addrOf(buf), 1, lkey0)
		if !errors.Is(err, errNoCommonPath) || x.Stats().CompletionErrors != before+2 {
			t.Fatalf("read with another device's lkey: %v, %+v (want two local protection errors, then TCP)", err, x.Stats())
		}
	}
	if x.deviceFor(HostBuffer(buf)) != 0 {
		t.Fatal("host memory not on the first device")
	}
	release()
	if err := x.Close(); err != nil {
		t.Fatal(err)
	}
	for i, pr := range provs {
		if n := pr.MRs(); n != 0 {
			t.Fatalf("device %d keeps %d MRs after Close", i, n)
		}
		devs[i].Close()
	}
	if _, err := NewRDMA(RDMAOptions{Devices: devs, NearGPU: map[int]int{0: 2}, Control: p.c, Self: "x"}); err == nil {
		t.Fatal("NearGPU naming a device that is not there was accepted")
	}
}

// TestRDMASegmentToSegment: a copy between a local segment (registered
// at start) and another node's, as replicas and repairs make, goes NIC to
// NIC with no local copy.
func TestRDMASegmentToSegment(t *testing.T) {
	p := newRDMAPair(t, RDMAOptions{})
	ctx := context.Background()
	seg := make([]byte, 1<<20)
	copy(seg, randBytes(1<<20, 13))
	if err := p.ra.RegisterSegment(7, seg); err != nil {
		t.Fatal(err)
	}
	r := p.reserve(t, 64<<10, time.Minute)
	w := Request{Op: Write, Buf: HostBuffer(seg[4096 : 4096+64<<10]), Extent: r.Extents[0], Node: "b", Epoch: r.Epoch, Resv: r.ID}
	if err := p.eng.Submit(ctx, []Request{w}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p.b.mem(t, r.Extents[0]), seg[4096:4096+64<<10]) {
		t.Fatal("bytes differ")
	}
	if s := p.path(pathRDMADirect); s.Written != 64<<10 || s.Copied() != 0 {
		t.Fatalf("segment to segment: %+v", p.eng.Stats().Paths)
	}
}

// TestRegionsLookup: overlapping and nested registrations, removal, and
// ranges that straddle regions, against a brute-force model.
func TestRegionsLookup(t *testing.T) {
	var tab regions
	type reg struct{ start, end uint64 }
	var live []reg
	var lrs []*localRegion
	rng := rand.New(rand.NewSource(3))
	check := func() {
		for range 200 {
			a := uint64(rng.Intn(10000))
			n := uint64(1 + rng.Intn(300))
			want := false
			for _, r := range live {
				want = want || (r.start <= a && a+n <= r.end)
			}
			if _, got := tab.lookup(a, n, 0); got != want {
				t.Fatalf("lookup(%d, %d) = %v, want %v (regions %v)", a, n, got, want, live)
			}
		}
	}
	key := fakeMR{}
	for range 60 {
		s := uint64(rng.Intn(9000))
		r := reg{s, s + uint64(1+rng.Intn(2000))}
		lrs = append(lrs, tab.add(r.start, r.end-r.start, []rdma.MR{key}))
		live = append(live, r)
		check()
	}
	for len(lrs) > 0 {
		i := rng.Intn(len(lrs))
		tab.remove(lrs[i])
		lrs = append(lrs[:i], lrs[i+1:]...)
		live = append(live[:i], live[i+1:]...)
		check()
	}
}

type fakeMR struct{ rdma.MR }

func (fakeMR) LKey() uint32 { return 1 }
