package transfer

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/rdma"
	"github.com/mooncake-fs/mooncake-fs/segment"
)

// The RDMA path: one-sided RDMA WRITE and READ between local memory and
// another node's segments, through an rdma.Device (libibverbs, or the
// fake in tests).
//
// Setup, once per peer: the client creates QPsPerPeer RC queue pairs and
// sends a control call (CtlRDMA, on the authenticated TCP channel) with
// its device's LID, GID, MTU and the QPs' numbers; the owner creates as
// many QPs, connects them to the client's, and answers with theirs and
// with every segment's address, length and rkey. The answer comes with
// the owner's epoch: the session belongs to that incarnation, and a
// request for another one fails with ErrStaleEpoch (after one fresh
// exchange, which is how a restarted owner is found), so a restarted
// node's rkeys are never used.
//
// Memory is registered once: segments when the daemon maps them
// (RegisterSegment, remote read and write), client buffers when they are
// registered (Register, local access) and a pool of bounce buffers at
// start. A request whose local memory lies in a registered region goes
// NIC to NIC (path rdma-direct, no local copy); any other memory is
// staged through the pool (rdma-staged, one local copy, counted). An
// exhausted pool is waited for up to PoolWait and then reported; nothing
// is registered per call.
//
// A completion with an error status, or one that does not come within
// the call's deadline, ends the session: its QPs are destroyed once no
// call uses them, the next call exchanges again, and the failed request
// is retried once on the new session before it fails.
//
// What the owner's CPU checks on TCP, the one-sided path must keep
// without it:
//
//   - Checked reads (Request.Version != 0): the bytes are read, then one
//     control call (CtlCheck) asks the owner whether the body is still
//     live at that version. Bodies are immutable while live and never
//     come back once freed, so a body live after the read was live, and
//     unchanged, during it; a stale one fails the read with ErrStaleBody.
//   - Guarded writes (Request.Resv != 0) are fenced by the reservation's
//     lease: the TCP transport notes when each Reserve and Renew was
//     sent, the TTL the owner granted and the reservation's extents; a
//     write inside them is posted only while that time plus the TTL, less
//     LeaseMargin, is ahead, and must complete before it, or it fails
//     with ErrNotReserved and its QP is destroyed. The owner reaps no
//     sooner than TTL after it received the call, which is later. A write
//     the writer cannot vouch for (no reservation, an unknown or partly
//     freed one, a lease too near its end) goes over TCP, where the owner
//     decides.

// RDMAOptions configures an RDMA path.
type RDMAOptions struct {
	// Devices are the opened devices, one per rail, in an order every
	// node of the cluster shares (by name): the device of index i talks
	// to the peers' device i (or their default when they have fewer).
	// Required.
	Devices []rdma.Device
	// Default is the index of the device for host memory (the one
	// nearest the segments), and the one that serves rails this node
	// has no device for.
	Default int
	// NearGPU maps a CUDA device ordinal to the index in Devices of the
	// device nearest that GPU, which moves its memory (GPUDirect RDMA).
	// GPUs not in it use the default device.
	NearGPU map[int]int
	// Control carries the endpoint exchange and the checks. Required.
	Control *TCPTransport
	// Self names this node to the owners (one session per node).
	// Required.
	Self string
	// QPsPerPeer is the queue pairs (calls in flight) per peer; 0 means 4.
	QPsPerPeer int
	// Depth is the work requests one QP holds; 0 means 64.
	Depth int
	// ChunkBytes is the most one work request moves; 0 means 1 MiB.
	ChunkBytes uint64
	// PoolBytes is the registered bounce memory; 0 means 64 MiB.
	PoolBytes uint64
	// PoolWait bounds the wait for a bounce buffer; 0 means 5s.
	PoolWait time.Duration
	// Timeout bounds one call, exchange included; 0 means 30s.
	Timeout time.Duration
	// LeaseMargin is kept between a guarded write's completion and its
	// reservation's end; 0 means 5s.
	LeaseMargin time.Duration
	// Log reports what the path falls back from; nil discards.
	Log func(format string, args ...any)
}

// DefaultRDMAOptions returns the values NewRDMA uses for zero fields.
func DefaultRDMAOptions() RDMAOptions {
	return RDMAOptions{QPsPerPeer: 4, Depth: 64, ChunkBytes: 1 << 20, PoolBytes: 64 << 20,
		PoolWait: 5 * time.Second, Timeout: 30 * time.Second, LeaseMargin: 5 * time.Second}
}

// Validate reports every bad field at once.
func (o RDMAOptions) Validate() error {
	var errs []error
	if len(o.Devices) == 0 || slices.Contains(o.Devices, nil) {
		errs = append(errs, errors.New("transfer: RDMAOptions.Devices is required, without nil entries"))
	}
	if o.Default < 0 || o.Default >= max(len(o.Devices), 1) {
		errs = append(errs, fmt.Errorf("transfer: RDMAOptions.Default %d: no such device", o.Default))
	}
	for g, i := range o.NearGPU {
		if i < 0 || i >= len(o.Devices) {
			errs = append(errs, fmt.Errorf("transfer: RDMAOptions.NearGPU[%d] = %d: no such device", g, i))
		}
	}
	if o.Control == nil {
		errs = append(errs, errors.New("transfer: RDMAOptions.Control is required"))
	}
	if o.Self == "" {
		errs = append(errs, errors.New("transfer: RDMAOptions.Self is required (owners keep one session per node name)"))
	}
	if o.QPsPerPeer < 0 || o.QPsPerPeer > maxRDMAQPs {
		errs = append(errs, fmt.Errorf("transfer: RDMAOptions.QPsPerPeer %d outside [0, %d]", o.QPsPerPeer, maxRDMAQPs))
	}
	if o.Depth < 0 || o.Depth > 4096 {
		errs = append(errs, fmt.Errorf("transfer: RDMAOptions.Depth %d outside [0, 4096]", o.Depth))
	}
	if o.ChunkBytes != 0 && (o.ChunkBytes < 4096 || o.ChunkBytes > 1<<30) {
		errs = append(errs, fmt.Errorf("transfer: RDMAOptions.ChunkBytes %d outside [4096, 1 GiB]", o.ChunkBytes))
	}
	if o.PoolBytes != 0 && o.ChunkBytes != 0 && o.PoolBytes < o.ChunkBytes {
		errs = append(errs, fmt.Errorf("transfer: RDMAOptions.PoolBytes %d < ChunkBytes %d", o.PoolBytes, o.ChunkBytes))
	}
	if o.PoolWait < 0 || o.Timeout < 0 || o.LeaseMargin < 0 {
		errs = append(errs, errors.New("transfer: RDMAOptions durations must not be negative"))
	}
	return errors.Join(errs...)
}

const (
	maxRDMAQPs      = 16
	maxRDMASessions = 1024 // owner side: peers served at once
	maxRDMASegments = 4096 // in one hello; about 300 KiB of JSON
	maxRDMARails    = 64
	pathRDMADirect  = Path("rdma-direct")
	pathRDMAStaged  = Path("rdma-staged")
)

// ErrPoolExhausted means no bounce buffer freed up within PoolWait.
var ErrPoolExhausted = errors.New("transfer: rdma bounce pool exhausted")

// RDMAHello is the endpoint exchange of CtlRDMA, both ways.
type RDMAHello struct {
	From     string        `json:"from,omitempty"`
	Device   string        `json:"device"`
	LID      uint16        `json:"lid"`
	GID      rdma.GID      `json:"gid"`
	MTU      int           `json:"mtu"`
	Reads    int           `json:"reads,omitempty"` // RDMA READs served in flight per QP
	Rail     int           `json:"rail,omitempty"`  // the device index the caller uses
	QPs      []RDMAQP      `json:"qps"`
	Segments []RDMASegment `json:"segments,omitempty"`
}

// RDMAQP is one queue pair's number and first packet sequence number.
type RDMAQP struct {
	QPN uint32 `json:"qpn"`
	PSN uint32 `json:"psn"`
}

// RDMASegment is where a segment is and the rkey that reaches it.
type RDMASegment struct {
	ID   segment.ID `json:"id"`
	Addr uint64     `json:"addr"`
	Len  uint64     `json:"len"`
	RKey uint32     `json:"rkey"`
}

func (h *RDMAHello) validate() error {
	if h == nil || len(h.QPs) == 0 || len(h.QPs) > maxRDMAQPs || h.GID == (rdma.GID{}) || len(h.Segments) > maxRDMASegments ||
		h.Reads < 0 || h.Reads > 1<<16 || h.Rail < 0 || h.Rail >= maxRDMARails {
		return fmt.Errorf("%w: rdma hello", ErrBadRequest)
	}
	for _, q := range h.QPs {
		if q.QPN == 0 || q.QPN > 0xffffff || q.PSN > 0xffffff {
			return fmt.Errorf("%w: rdma hello QP %+v", ErrBadRequest, q)
		}
	}
	return nil
}

// RDMAStats are the RDMA path's counters.
type RDMAStats struct {
	Devices          []string `json:"devices"`
	Sessions         int      `json:"sessions"`       // peers connected as client
	Served           int      `json:"served"`         // peers connected to this node
	Exchanges        uint64   `json:"exchanges"`      // sessions set up as client
	Broken           uint64   `json:"broken"`         // sessions ended by a failure
	Retries          uint64   `json:"retries"`        // requests retried on a new session
	Fallbacks        uint64   `json:"fallbacks"`      // calls sent over TCP instead
	PoolWaits        uint64   `json:"pool_waits"`     // stagings that waited for a buffer
	PoolTimeouts     uint64   `json:"pool_timeouts"`  // and gave up
	RegisteredBytes  uint64   `json:"registered_b"`   // client buffers and GPU memory registered now
	Registrations    uint64   `json:"registrations"`  // client buffer MRs made
	Segments         int      `json:"segments"`       // segments registered
	PoolBytes        uint64   `json:"pool_bytes"`     // bounce pool
	FencedWrites     uint64   `json:"fenced_writes"`  // writes refused: reservation too close to its end
	StaleChecks      uint64   `json:"stale_checks"`   // checked reads whose body was gone
	WorkRequests     uint64   `json:"work_requests"`  // posted
	CompletionErrors uint64   `json:"completion_err"` // completions with an error status
	Discarded        uint64   `json:"discarded_qps"`  // QPs dropped after a cancelled call
	InFlight         int64    `json:"in_flight"`      // calls running now
}

// RDMA is the RDMA path of remote requests. Safe for concurrent use.
type RDMA struct {
	opts    RDMAOptions
	regs    regions // host memory
	gpuRegs regions // GPU memory, by device address
	pool    *stagePool
	mu      struct {
		sync.Mutex
		peers   map[railKey]*rdmaPeer
		segs    map[segment.ID]*rdmaSeg
		served  map[railKey]*servedSession
		closed  bool
		logged  map[string]bool
		regMRs  map[*localRegion]struct{}
		poolReg *localRegion
	}
	stats struct {
		exchanges, broken, retries, fallbacks, poolWaits, poolTimeouts atomic.Uint64
		regBytes, registrations, fenced, stale, wrs, compErrs          atomic.Uint64
		discarded                                                      atomic.Uint64
	}
	calls    sync.WaitGroup // calls in flight; Close waits for them
	inFlight atomic.Int64   // and their count, for Stats
	// hostDevice, when set (tests), picks the device of memory that is
	// not a GPU's.
	hostDevice func(Buffer) int
}

// railKey names a peer on one rail.
type railKey struct {
	node string
	rail int
}

// rdmaSeg is a segment registered on every device.
type rdmaSeg struct {
	id  segment.ID
	mrs []rdma.MR // by device
	lr  *localRegion
}

func (s *rdmaSeg) on(d int) RDMASegment {
	m := s.mrs[d]
	return RDMASegment{ID: s.id, Addr: m.Addr(), Len: m.Len(), RKey: m.RKey()}
}

// regAll registers with every device (reg gives one device's MR); on a
// failure what was registered is released.
func (r *RDMA) regAll(reg func(d rdma.Device) (rdma.MR, error)) ([]rdma.MR, error) {
	mrs := make([]rdma.MR, 0, len(r.opts.Devices))
	for _, d := range r.opts.Devices {
		m, err := reg(d)
		if err != nil {
			for _, m := range mrs {
				m.Close()
			}
			return nil, fmt.Errorf("%s: %w", d.Info().Name, err)
		}
		mrs = append(mrs, m)
	}
	return mrs, nil
}

// NewRDMA registers the bounce pool and returns the path.
func NewRDMA(o RDMAOptions) (*RDMA, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	d := DefaultRDMAOptions()
	if o.QPsPerPeer == 0 {
		o.QPsPerPeer = d.QPsPerPeer
	}
	if o.Depth == 0 {
		o.Depth = d.Depth
	}
	if o.ChunkBytes == 0 {
		o.ChunkBytes = d.ChunkBytes
	}
	if o.PoolBytes == 0 {
		o.PoolBytes = max(d.PoolBytes, o.ChunkBytes)
	}
	if o.PoolWait == 0 {
		o.PoolWait = d.PoolWait
	}
	if o.Timeout == 0 {
		o.Timeout = d.Timeout
	}
	if o.LeaseMargin == 0 {
		o.LeaseMargin = d.LeaseMargin
	}
	if o.Log == nil {
		o.Log = func(string, ...any) {}
	}
	r := &RDMA{opts: o}
	r.mu.peers = map[railKey]*rdmaPeer{}
	r.mu.segs = map[segment.ID]*rdmaSeg{}
	r.mu.served = map[railKey]*servedSession{}
	r.mu.logged = map[string]bool{}
	r.mu.regMRs = map[*localRegion]struct{}{}
	slots := int(o.PoolBytes / o.ChunkBytes)
	// Mapped, not Go memory: the NIC keeps using it between calls.
	mem, err := unix.Mmap(-1, 0, slots*int(o.ChunkBytes), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("transfer: map the rdma bounce pool of %d B: %w", slots*int(o.ChunkBytes), err)
	}
	mrs, err := r.regAll(func(d rdma.Device) (rdma.MR, error) { return d.RegMR(mem, rdma.AccessLocalWrite) })
	if err != nil {
		_ = unix.Munmap(mem)
		return nil, fmt.Errorf("transfer: register the rdma bounce pool of %d B: %w", len(mem), err)
	}
	r.mu.poolReg = r.regs.add(addrOf(mem), uint64(len(mem)), mrs)
	r.pool = newStagePool(mem, slots, int(o.ChunkBytes))
	return r, nil
}

// Devices names the devices the path uses, the default first.
func (r *RDMA) Devices() []string {
	var out []string
	for _, d := range r.opts.Devices {
		out = append(out, d.Info().Name)
	}
	return out
}

// deviceFor returns the index of the device that moves buf's memory.
func (r *RDMA) deviceFor(b Buffer) int {
	if b.Kind == CUDA && b.Ctx != nil {
		if i, ok := r.opts.NearGPU[b.Ctx.Ordinal()]; ok {
			return i
		}
	}
	if r.hostDevice != nil { // tests
		return r.hostDevice(b)
	}
	return r.opts.Default
}

// RegisterSegment registers segment id's memory for remote access; owners
// hand its rkey to the peers that connect.
func (r *RDMA) RegisterSegment(id segment.ID, mem []byte) error {
	r.mu.Lock()
	n := len(r.mu.segs)
	_, again := r.mu.segs[id]
	r.mu.Unlock()
	if n >= maxRDMASegments && !again {
		return fmt.Errorf("transfer: rdma: more than %d segments (use a larger --segment-size)", maxRDMASegments)
	}
	mrs, err := r.regAll(func(d rdma.Device) (rdma.MR, error) {
		return d.RegMR(mem, rdma.AccessLocalWrite|rdma.AccessRemoteRead|rdma.AccessRemoteWrite)
	})
	if err != nil {
		return fmt.Errorf("transfer: rdma register segment %d (%d B): %w", id, len(mem), err)
	}
	// The segment is local memory too: replica and repair copies between
	// it and another node's go NIC to NIC.
	lr := r.regs.add(addrOf(mem), uint64(len(mem)), mrs)
	r.mu.Lock()
	old := r.mu.segs[id]
	r.mu.segs[id] = &rdmaSeg{id: id, mrs: mrs, lr: lr}
	r.mu.Unlock()
	if old != nil {
		r.regs.remove(old.lr)
		for _, m := range old.mrs {
			m.Close()
		}
	}
	return nil
}

// Register registers client memory for local access by the NIC, once;
// release (call it once, after the last request using mem) deregisters.
func (r *RDMA) Register(mem []byte) (release func(), err error) {
	if len(mem) == 0 {
		return nil, fmt.Errorf("transfer: rdma register 0 B: %w", ErrBadRequest)
	}
	mrs, err := r.regAll(func(d rdma.Device) (rdma.MR, error) { return d.RegMR(mem, rdma.AccessLocalWrite) })
	if err != nil {
		return nil, fmt.Errorf("transfer: rdma register %d B: %w", len(mem), err)
	}
	return r.keep(&r.regs, addrOf(mem), uint64(len(mem)), mrs), nil
}

// RegisterDevice registers n bytes of GPU memory at device address dev,
// exported as the dma-buf fd (read at offset 0; the caller may close fd
// once this returns), for GPUDirect RDMA: the NIC then reads and writes
// the GPU's memory with no copy. release deregisters it, after the last
// request using it.
func (r *RDMA) RegisterDevice(fd int, dev, n uint64) (release func(), err error) {
	if n == 0 || dev+n < dev {
		return nil, fmt.Errorf("transfer: rdma register device range %#x+%d: %w", dev, n, ErrBadRequest)
	}
	mrs, err := r.regAll(func(d rdma.Device) (rdma.MR, error) { return d.RegDmabufMR(fd, 0, n, dev, rdma.AccessLocalWrite) })
	if err != nil {
		return nil, fmt.Errorf("transfer: rdma register %d B of GPU memory: %w", n, err)
	}
	return r.keep(&r.gpuRegs, dev, n, mrs), nil
}

// keep enters mrs into t and returns its release.
func (r *RDMA) keep(t *regions, start, n uint64, mrs []rdma.MR) func() {
	lr := t.add(start, n, mrs)
	r.mu.Lock()
	r.mu.regMRs[lr] = struct{}{}
	r.mu.Unlock()
	r.stats.regBytes.Add(n)
	r.stats.registrations.Add(1)
	var once sync.Once
	return func() {
		once.Do(func() {
			t.remove(lr)
			r.mu.Lock()
			delete(r.mu.regMRs, lr)
			r.mu.Unlock()
			r.stats.regBytes.Add(^(n - 1))
			for _, m := range mrs {
				if err := m.Close(); err != nil {
					r.opts.Log("transfer: rdma deregister %d B: %v", n, err)
				}
			}
		})
	}
}

// Stats returns the counters.
func (r *RDMA) Stats() RDMAStats {
	r.mu.Lock()
	sessions := 0
	for _, p := range r.mu.peers {
		if s := p.sess.Load(); s != nil && !s.isDead() {
			sessions++
		}
	}
	served, segs := len(r.mu.served), len(r.mu.segs)
	r.mu.Unlock()
	return RDMAStats{
		Devices: r.Devices(), Sessions: sessions, Served: served,
		Exchanges: r.stats.exchanges.Load(), Broken: r.stats.broken.Load(), Retries: r.stats.retries.Load(),
		Fallbacks: r.stats.fallbacks.Load(), PoolWaits: r.stats.poolWaits.Load(), PoolTimeouts: r.stats.poolTimeouts.Load(),
		RegisteredBytes: r.stats.regBytes.Load(), Registrations: r.stats.registrations.Load(),
		Segments: segs, PoolBytes: uint64(len(r.pool.mem)),
		FencedWrites: r.stats.fenced.Load(), StaleChecks: r.stats.stale.Load(),
		WorkRequests: r.stats.wrs.Load(), CompletionErrors: r.stats.compErrs.Load(),
		Discarded: r.stats.discarded.Load(), InFlight: r.inFlight.Load(),
	}
}

// Close ends every session, waits for the calls in flight, and
// deregisters what the path registered; client buffers must have been
// released.
func (r *RDMA) Close() error {
	r.mu.Lock()
	if r.mu.closed {
		r.mu.Unlock()
		return nil
	}
	r.mu.closed = true
	peers := r.mu.peers
	for _, p := range peers {
		if s := p.sess.Load(); s != nil {
			s.kill() // calls on it fail now; new ones see closed
		}
	}
	r.mu.Unlock()
	r.calls.Wait()
	r.mu.Lock()
	r.mu.peers = map[railKey]*rdmaPeer{}
	served := r.mu.served
	r.mu.served = map[railKey]*servedSession{}
	segs := r.mu.segs
	r.mu.segs = map[segment.ID]*rdmaSeg{}
	left := len(r.mu.regMRs)
	r.mu.Unlock()
	for _, s := range served {
		s.close()
	}
	var errs []error
	for _, s := range segs {
		r.regs.remove(s.lr)
		for _, m := range s.mrs {
			errs = append(errs, m.Close())
		}
	}
	if r.mu.poolReg != nil {
		r.regs.remove(r.mu.poolReg)
		held := false
		for _, m := range r.mu.poolReg.mrs {
			if err := m.Close(); err != nil {
				errs = append(errs, err)
				held = true // the NIC may still hold it: keep it mapped
			}
		}
		if !held {
			errs = append(errs, unix.Munmap(r.pool.mem))
		}
	}
	if left > 0 {
		errs = append(errs, fmt.Errorf("transfer: rdma closed with %d client buffers registered", left))
	}
	return errors.Join(errs...)
}

// regions is a table of local registered memory, by address: host
// virtual addresses, or device addresses for GPU memory.
type regions struct {
	mu   sync.RWMutex
	list []*localRegion // sorted by start
	// reach[i] is the largest end of list[:i+1]: a lookup walks back
	// only while an earlier region can still cover its address.
	reach []uint64
}

// reindex recomputes reach; caller holds mu.
func (t *regions) reindex() {
	t.reach = t.reach[:0]
	var m uint64
	for _, r := range t.list {
		m = max(m, r.end)
		t.reach = append(t.reach, m)
	}
}

type localRegion struct {
	start, end uint64
	mrs        []rdma.MR // by device
}

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

func (t *regions) add(start, n uint64, mrs []rdma.MR) *localRegion {
	lr := &localRegion{start: start, end: start + n, mrs: mrs}
	t.mu.Lock()
	i := sort.Search(len(t.list), func(i int) bool { return t.list[i].start >= lr.start })
	t.list = append(t.list, nil)
	copy(t.list[i+1:], t.list[i:])
	t.list[i] = lr
	t.reindex()
	t.mu.Unlock()
	return lr
}

func (t *regions) remove(lr *localRegion) {
	t.mu.Lock()
	for i, x := range t.list {
		if x == lr {
			t.list = append(t.list[:i], t.list[i+1:]...)
			break
		}
	}
	t.reindex()
	t.mu.Unlock()
}

// lookup returns device d's lkey of a region that holds all of [a, a+n).
func (t *regions) lookup(a, n uint64, d int) (uint32, bool) {
	if n == 0 || a+n < a {
		return 0, false
	}
	e := a + n
	t.mu.RLock()
	defer t.mu.RUnlock()
	i := sort.Search(len(t.list), func(i int) bool { return t.list[i].start > a })
	// Regions may overlap (one buffer registered twice): look back while
	// one can still reach a.
	for j := i - 1; j >= 0 && t.reach[j] > a; j-- {
		if r := t.list[j]; e <= r.end {
			return r.mrs[d].LKey(), true
		}
	}
	return 0, false
}

// stagePool is the registered bounce memory, in slots of ChunkBytes.
type stagePool struct {
	mem  []byte
	size int
	free chan int
}

func newStagePool(mem []byte, slots, size int) *stagePool {
	p := &stagePool{mem: mem, size: size, free: make(chan int, slots)}
	for i := range slots {
		p.free <- i
	}
	return p
}

// stage returns a registered bounce buffer of n <= ChunkBytes bytes,
// waiting up to PoolWait for one.
func (r *RDMA) stage(ctx context.Context, n int) ([]byte, func(), error) {
	p := r.pool
	var i int
	select {
	case i = <-p.free:
	default:
		r.stats.poolWaits.Add(1)
		t := time.NewTimer(r.opts.PoolWait)
		defer t.Stop()
		select {
		case i = <-p.free:
		case <-t.C:
			r.stats.poolTimeouts.Add(1)
			return nil, nil, fmt.Errorf("%w: %d buffers of %d B busy for %v", ErrPoolExhausted, cap(p.free), p.size, r.opts.PoolWait)
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
	return p.mem[i*p.size : i*p.size+n], func() { p.free <- i }, nil
}

// The client side: sessions with peers.

type rdmaPeer struct {
	key    railKey
	turn   chan struct{} // one token: held by the exchange in progress
	sess   atomic.Pointer[rdmaSession]
	noRDMA time.Time // until then, the peer is reached over TCP; under turn
}

// lock takes the peer's turn, or gives up with ctx.
func (p *rdmaPeer) lock(ctx context.Context) error {
	select {
	case p.turn <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *rdmaPeer) unlock() { <-p.turn }

type rdmaSession struct {
	epoch uint64
	born  time.Time
	segs  map[segment.ID]RDMASegment
	mu    sync.Mutex
	idle  []*rdmaQP
	avail chan struct{} // one token per idle QP
	dead  chan struct{} // closed by kill
	used  int           // QPs out of idle
	live  int           // QPs not destroyed
	log   func(format string, args ...any)
}

type rdmaQP struct {
	qp    rdma.QP
	next  uint64
	comps []rdma.Completion
}

func (s *rdmaSession) isDead() bool {
	select {
	case <-s.dead:
		return true
	default:
		return false
	}
}

// kill ends the session: idle QPs are destroyed now, busy ones when
// their call gives them back.
func (s *rdmaSession) kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.killLocked()
}

func (s *rdmaSession) killLocked() {
	select {
	case <-s.dead:
		return
	default:
	}
	close(s.dead)
	for _, q := range s.idle {
		s.closeQP(q)
		s.live--
	}
	s.idle = nil
}

// closeQP destroys q. One that cannot be destroyed may still move the
// bytes of its last call; nothing more can be done about it than say so.
func (s *rdmaSession) closeQP(q *rdmaQP) {
	if err := q.qp.Close(); err != nil {
		s.log("transfer: rdma: destroy a QP: %v (its last buffer may still be written)", err)
	}
}

// take returns an idle QP, waiting until deadline (when set) at most.
func (s *rdmaSession) take(ctx context.Context, deadline time.Time) (*rdmaQP, error) {
	var timeout <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-s.avail:
	case <-s.dead:
		return nil, errSessionDead
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-timeout:
		return nil, errFenced
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.idle) == 0 { // killed after the token was sent
		return nil, errSessionDead
	}
	q := s.idle[len(s.idle)-1]
	s.idle = s.idle[:len(s.idle)-1]
	s.used++
	return q, nil
}

// give returns q after a call: to the idle ones, or destroyed when the
// call broke it or the session ended. A session left without QPs ends.
func (s *rdmaSession) give(q *rdmaQP, broken bool) {
	s.mu.Lock()
	s.used--
	if !broken && !s.isDead() {
		s.idle = append(s.idle, q)
		s.mu.Unlock()
		s.avail <- struct{}{}
		return
	}
	s.closeQP(q)
	s.live--
	if s.live == 0 {
		s.killLocked()
	}
	s.mu.Unlock()
}

var (
	errSessionDead  = errors.New("transfer: rdma session ended")
	errStaleSession = errors.New("transfer: rdma session of an older incarnation")
	errNoCommonPath = errors.New("transfer: no common RDMA transport")
	// errFenced: the write could not start in time; TCP, where the owner
	// decides, takes it.
	errFenced = errors.New("transfer: rdma write too close to its reservation's end")
)

// session returns a live session with node, exchanging endpoints when
// there is none; nil and no error when node is reached over TCP.
func (r *RDMA) session(ctx context.Context, node string, d int) (*rdmaSession, error) {
	k := railKey{node, d}
	r.mu.Lock()
	if r.mu.closed {
		r.mu.Unlock()
		return nil, ErrClosed
	}
	p := r.mu.peers[k]
	if p == nil {
		p = &rdmaPeer{key: k, turn: make(chan struct{}, 1)}
		r.mu.peers[k] = p
	}
	r.mu.Unlock()
	if s := p.sess.Load(); s != nil && !s.isDead() {
		return s, nil
	}
	// Waiting for another caller's exchange, this one's context still
	// counts.
	if err := p.lock(ctx); err != nil {
		return nil, err
	}
	defer p.unlock()
	if s := p.sess.Load(); s != nil && !s.isDead() {
		return s, nil
	}
	if time.Now().Before(p.noRDMA) {
		return nil, nil
	}
	s, err := r.exchange(ctx, node, d)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err() // the caller gave up: no verdict on the peer
		}
		// TCP is always correct: a peer without RDMA (ErrBadRequest) is
		// asked again in a minute, any other failure in a few seconds.
		wait := 5 * time.Second
		if errors.Is(err, ErrBadRequest) || errors.Is(err, rdma.ErrUnavailable) {
			wait = time.Minute
		}
		p.noRDMA = time.Now().Add(wait)
		r.logOnce(node, "transfer: rdma to %s unavailable, using TCP: %v", node, err)
		return nil, nil
	}
	r.mu.Lock()
	closed := r.mu.closed || r.mu.peers[k] != p
	if !closed {
		p.sess.Store(s)
	}
	r.mu.Unlock()
	if closed { // Close or Forget ran meanwhile
		s.kill()
		return nil, ErrClosed
	}
	return s, nil
}

// Forget ends the sessions with node, both ways, on every rail: it left
// the cluster.
func (r *RDMA) Forget(node string) {
	var sessions []*rdmaSession
	var served []*servedSession
	r.mu.Lock()
	for k, p := range r.mu.peers {
		if k.node == node {
			delete(r.mu.peers, k)
			if s := p.sess.Load(); s != nil {
				sessions = append(sessions, s)
			}
		}
	}
	for k, s := range r.mu.served {
		if k.node == node {
			delete(r.mu.served, k)
			served = append(served, s)
		}
	}
	r.mu.Unlock()
	for _, s := range sessions {
		s.kill()
	}
	for _, s := range served {
		s.close()
	}
}

func (r *RDMA) logOnce(node, f string, a ...any) {
	r.mu.Lock()
	seen := r.mu.logged[node]
	r.mu.logged[node] = true
	r.mu.Unlock()
	if !seen {
		r.opts.Log(f, a...)
	}
}

func (r *RDMA) hello(d int, qps []*rdmaQP) *RDMAHello {
	info := r.opts.Devices[d].Info()
	h := &RDMAHello{From: r.opts.Self, Device: info.Name, LID: info.LID, GID: info.GID, MTU: info.MTU, Rail: d}
	for _, q := range qps {
		ep := q.qp.Endpoint()
		h.QPs = append(h.QPs, RDMAQP{QPN: ep.QPN, PSN: ep.PSN})
		h.Reads = ep.ReadDepth
	}
	return h
}

func (r *RDMA) exchange(ctx context.Context, node string, d int) (*rdmaSession, error) {
	dev := r.opts.Devices[d]
	var qps []*rdmaQP
	fail := func(err error) (*rdmaSession, error) {
		for _, q := range qps {
			(&rdmaSession{log: r.opts.Log}).closeQP(q)
		}
		return nil, err
	}
	for range r.opts.QPsPerPeer {
		q, err := dev.CreateQP(r.opts.Depth)
		if err != nil {
			return fail(fmt.Errorf("transfer: rdma QP for %s: %w", node, err))
		}
		qps = append(qps, &rdmaQP{qp: q, comps: make([]rdma.Completion, r.opts.Depth)})
	}
	ctx, cancel := context.WithTimeout(ctx, r.opts.Timeout)
	defer cancel()
	resp, epoch, err := r.opts.Control.Control(ctx, node, 0, ControlRequest{Op: CtlRDMA, RDMA: r.hello(d, qps)})
	if err != nil {
		return fail(err)
	}
	h := resp.RDMA
	if err := h.validate(); err != nil || len(h.QPs) != len(qps) {
		return fail(fmt.Errorf("transfer: rdma hello from %s: %w", node, ErrProtocol))
	}
	info := dev.Info()
	for i, q := range qps {
		ep := rdma.Endpoint{LID: h.LID, GID: h.GID, QPN: h.QPs[i].QPN, PSN: h.QPs[i].PSN, MTU: min(h.MTU, info.MTU), ReadDepth: h.Reads}
		if err := q.qp.Connect(ep); err != nil {
			return fail(fmt.Errorf("transfer: rdma connect to %s: %w", node, err))
		}
	}
	s := &rdmaSession{epoch: epoch, born: time.Now(), segs: map[segment.ID]RDMASegment{}, avail: make(chan struct{}, len(qps)),
		dead: make(chan struct{}), idle: qps, live: len(qps), log: r.opts.Log}
	for _, sg := range h.Segments {
		s.segs[sg.ID] = sg
	}
	for range qps {
		s.avail <- struct{}{}
	}
	r.stats.exchanges.Add(1)
	return s, nil
}

// The owner side.

type servedSession struct {
	qps []rdma.QP
	log func(format string, args ...any)
}

func (s *servedSession) close() {
	for _, q := range s.qps {
		if err := q.Close(); err != nil {
			s.log("transfer: rdma: destroy a served QP: %v", err)
		}
	}
}

// accept answers a peer's CtlRDMA: QPs connected to the peer's, and the
// segment table. A peer's new exchange replaces its previous session
// (the peer set it up again: its old QPs are gone or broken).
func (r *RDMA) accept(h *RDMAHello) (*RDMAHello, error) {
	if err := h.validate(); err != nil {
		return nil, err
	}
	if h.From == "" {
		return nil, fmt.Errorf("%w: rdma hello names no node", ErrBadRequest)
	}
	// The caller's rail, or this node's default device when it has fewer.
	d := h.Rail
	if d >= len(r.opts.Devices) {
		d = r.opts.Default
	}
	dev := r.opts.Devices[d]
	k := railKey{h.From, h.Rail}
	r.mu.Lock()
	full := r.mu.served[k] == nil && len(r.mu.served) >= r.maxServed()
	r.mu.Unlock()
	if full {
		return nil, fmt.Errorf("transfer: %d rdma peers connected: %w", maxRDMASessions, ErrNoSpace)
	}
	info := dev.Info()
	var qps []rdma.QP
	fail := func(err error) (*RDMAHello, error) {
		(&servedSession{qps: qps, log: r.opts.Log}).close()
		return nil, err
	}
	var reads int
	for _, rq := range h.QPs {
		q, err := dev.CreateQP(1)
		if err != nil {
			return fail(fmt.Errorf("transfer: rdma QP for %s: %w", h.From, err))
		}
		qps = append(qps, q)
		reads = q.Endpoint().ReadDepth
		ep := rdma.Endpoint{LID: h.LID, GID: h.GID, QPN: rq.QPN, PSN: rq.PSN, MTU: min(h.MTU, info.MTU), ReadDepth: h.Reads}
		if err := q.Connect(ep); err != nil {
			return fail(fmt.Errorf("transfer: rdma connect to %s: %w", h.From, err))
		}
	}
	out := &RDMAHello{Device: info.Name, LID: info.LID, GID: info.GID, MTU: info.MTU, Reads: reads}
	for _, q := range qps {
		ep := q.Endpoint()
		out.QPs = append(out.QPs, RDMAQP{QPN: ep.QPN, PSN: ep.PSN})
	}
	r.mu.Lock()
	if r.mu.closed {
		r.mu.Unlock()
		return fail(ErrClosed)
	}
	for _, s := range r.mu.segs {
		out.Segments = append(out.Segments, s.on(d))
	}
	old := r.mu.served[k]
	if old == nil && len(r.mu.served) >= r.maxServed() {
		r.mu.Unlock()
		return fail(fmt.Errorf("transfer: %d rdma peers connected: %w", maxRDMASessions, ErrNoSpace))
	}
	r.mu.served[k] = &servedSession{qps: qps, log: r.opts.Log}
	r.mu.Unlock()
	if old != nil {
		old.close()
	}
	sort.Slice(out.Segments, func(i, j int) bool { return out.Segments[i].ID < out.Segments[j].ID })
	return out, nil
}

// maxServed bounds the sessions served: maxRDMASessions peers on every
// rail.
func (r *RDMA) maxServed() int { return maxRDMASessions * len(r.opts.Devices) }

// Requests.

// begin counts a call in flight, unless the path is closed; end ends it.
func (r *RDMA) begin() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.mu.closed {
		return ErrClosed
	}
	r.calls.Add(1)
	r.inFlight.Add(1)
	return nil
}

func (r *RDMA) end() {
	r.inFlight.Add(-1)
	r.calls.Done()
}

// move runs one request's bytes between local memory at address local
// (registered under lkey on device d) and the extent ext of req's node,
// on a live session of d's rail; a failure of the session is retried
// once on a new one. errNoCommonPath (nothing moved): the caller sends
// it over TCP.
func (r *RDMA) move(ctx context.Context, req Request, ext segment.Extent, local uint64, d int, lkey uint32) error {
	_, err := r.moveEpoch(ctx, req, ext, local, d, lkey)
	return err
}

// moveEpoch is move that also returns the epoch of the owner it reached.
// A session that fails again after a fresh exchange sends the peer's
// rail to TCP for a while (errNoCommonPath: its QP is gone, so a write
// redone over TCP cannot be overtaken by the NIC).
func (r *RDMA) moveEpoch(ctx context.Context, req Request, ext segment.Extent, local uint64, d int, lkey uint32) (uint64, error) {
	if err := r.begin(); err != nil {
		return 0, err
	}
	defer r.end()
	ctx, cancel := context.WithTimeout(ctx, r.opts.Timeout)
	defer cancel()
	since := time.Now()
	for attempt := 0; ; attempt++ {
		s, err := r.session(ctx, req.Node, d)
		if err != nil {
			return 0, err
		}
		if s == nil {
			return 0, errNoCommonPath
		}
		err = r.moveOn(ctx, since, s, req, ext, local, lkey)
		switch {
		case err == nil:
			return s.epoch, nil
		case ctx.Err() != nil || !retryable(err):
			return 0, err
		case attempt > 0:
			r.benchRail(req.Node, d, err)
			return 0, errNoCommonPath
		}
		r.stats.retries.Add(1)
	}
}

// benchRail sends node's rail d to TCP for a while after RDMA failed on
// it twice in a row.
func (r *RDMA) benchRail(node string, d int, why error) {
	r.mu.Lock()
	p := r.mu.peers[railKey{node, d}]
	r.mu.Unlock()
	if p == nil {
		return
	}
	if p.lock(context.Background()) == nil {
		p.noRDMA = time.Now().Add(5 * time.Second)
		p.unlock()
	}
	r.opts.Log("transfer: rdma to %s (rail %d) failed twice (%v): TCP for 5s", node, d, why)
}

// retryable: the session failed, not the request.
func retryable(err error) bool {
	if errors.Is(err, errSessionDead) || errors.Is(err, errStaleSession) {
		return true
	}
	var ce *rdma.CompletionError
	return errors.As(err, &ce)
}

func (r *RDMA) moveOn(ctx context.Context, since time.Time, s *rdmaSession, req Request, ext segment.Extent, local uint64, lkey uint32) error {
	switch {
	case req.Epoch == 0 || req.Epoch == s.epoch:
	case req.Epoch < s.epoch:
		// Epochs are daemon start times: the request names an older
		// incarnation than the one this session reaches.
		return fmt.Errorf("%w: extents of epoch %d, daemon at epoch %d", ErrStaleEpoch, req.Epoch, s.epoch)
	case s.born.After(since):
		return fmt.Errorf("%w: extents of epoch %d, daemon at epoch %d", ErrStaleEpoch, req.Epoch, s.epoch)
	default:
		// The owner restarted after this session was set up: exchange
		// again.
		s.kill()
		return errStaleSession
	}
	sg, ok := s.segs[ext.Segment]
	if !ok {
		return fmt.Errorf("segment %d: %w", ext.Segment, segment.ErrUnknownSegment)
	}
	if ext.Off > sg.Len || ext.Len > sg.Len-ext.Off {
		return fmt.Errorf("%v in segment of %d B: %w", ext, sg.Len, segment.ErrBadRange)
	}
	op := rdma.OpRead
	var deadline time.Time
	if req.Op == Write {
		op = rdma.OpWrite
		// Fenced by the reservation's lease as this writer knows it;
		// what it cannot vouch for goes over TCP, where the owner checks.
		end, ok := r.opts.Control.leaseEnd(req.Node, req.Epoch, req.Resv, ext)
		if req.Resv == 0 || req.Epoch == 0 || !ok || time.Until(end) <= r.opts.LeaseMargin {
			r.stats.fenced.Add(1)
			return errNoCommonPath
		}
		deadline = end.Add(-r.opts.LeaseMargin)
	}
	q, err := s.take(ctx, deadline)
	if errors.Is(err, errFenced) {
		r.stats.fenced.Add(1)
		return errNoCommonPath // nothing was posted
	}
	if err != nil {
		return err
	}
	posted, broken, err := r.post(ctx, q, op, sg, ext, local, lkey, deadline)
	switch {
	case errors.Is(err, errFenced) && !posted: // counted by post
		s.give(q, false)
		return errNoCommonPath
	case errors.Is(err, errFenced):
		// Posted, not done by the fence: that QP goes (its work with it)
		// and the write is redone over TCP, where the owner checks it.
		r.stats.discarded.Add(1)
		s.give(q, true)
		return errNoCommonPath
	case broken && ctx.Err() != nil:
		// The caller gave up (or its time ran out) with work in flight:
		// that QP goes, the session stays.
		r.stats.discarded.Add(1)
		s.give(q, true)
	case broken:
		r.stats.broken.Add(1)
		s.give(q, true)
		s.kill()
		r.opts.Log("transfer: rdma session with %s ended (%v): the next call sets up a new one", req.Node, err)
	default:
		s.give(q, false)
	}
	if err != nil {
		return err
	}
	if req.Op == Read && req.Version != 0 {
		return r.check(ctx, req, s.epoch)
	}
	return nil
}

// post moves the bytes in work requests of at most ChunkBytes, up to
// Depth at a time, and waits for their completions. posted says whether
// any work request was posted; broken, that the QP must not be used
// again. A write is posted only before deadline (when set) and must
// complete by then.
func (r *RDMA) post(ctx context.Context, q *rdmaQP, op rdma.Opcode, sg RDMASegment, ext segment.Extent, base uint64, lkey uint32, deadline time.Time) (posted, broken bool, err error) {
	cb := r.opts.ChunkBytes
	wrs := make([]rdma.WorkRequest, 0, min(uint64(r.opts.Depth), (ext.Len+cb-1)/cb))
	sges := make([]rdma.SGE, cap(wrs))
	for off := uint64(0); off < ext.Len; {
		if !deadline.IsZero() && !time.Now().Before(deadline) {
			r.stats.fenced.Add(1)
			return posted, posted, errFenced
		}
		wrs = wrs[:0]
		for ; off < ext.Len && len(wrs) < cap(wrs); off += cb {
			n := min(cb, ext.Len-off)
			q.next++
			sges[len(wrs)] = rdma.SGE{Addr: base + off, Len: uint32(n), LKey: lkey}
			wrs = append(wrs, rdma.WorkRequest{ID: q.next, Op: op, Local: sges[len(wrs) : len(wrs)+1],
				Remote: sg.Addr + ext.Off + off, RKey: sg.RKey})
		}
		if err := q.qp.Post(wrs); err != nil {
			return true, true, fmt.Errorf("transfer: rdma post: %w", err)
		}
		posted = true
		r.stats.wrs.Add(uint64(len(wrs)))
		if broken, err := r.await(ctx, q, wrs, deadline); err != nil {
			return true, broken, err
		}
	}
	return posted, false, nil
}

// await polls until every work request of wrs completed, the deadline
// (when set) or the context ends.
func (r *RDMA) await(ctx context.Context, q *rdmaQP, wrs []rdma.WorkRequest, deadline time.Time) (bool, error) {
	left := len(wrs)
	var first error
	spin := 0
	for left > 0 {
		n, err := q.qp.Poll(q.comps)
		if err != nil {
			return true, fmt.Errorf("transfer: rdma poll: %w", err)
		}
		for _, c := range q.comps[:n] {
			left--
			if c.Status != rdma.StatusSuccess && first == nil {
				r.stats.compErrs.Add(1)
				first = &rdma.CompletionError{Completion: c}
			}
		}
		if left == 0 {
			break
		}
		if !deadline.IsZero() && !time.Now().Before(deadline) {
			r.stats.fenced.Add(1)
			return true, errFenced
		}
		if err := ctx.Err(); err != nil {
			return true, fmt.Errorf("transfer: rdma completion: %w", err)
		}
		if n > 0 {
			spin = 0
			continue
		}
		spin++
		switch {
		case spin < 64:
			runtime.Gosched()
		default:
			time.Sleep(time.Duration(min(spin-63, 100)) * 10 * time.Microsecond)
		}
	}
	if first != nil {
		return true, first
	}
	return false, nil
}

// check asks the owner whether the body a checked read named is still
// live at its version (see the package comment above).
func (r *RDMA) check(ctx context.Context, req Request, epoch uint64) error {
	_, _, err := r.opts.Control.Control(ctx, req.Node, epoch, ControlRequest{Op: CtlCheck,
		Extents: []segment.Extent{req.Body}, Version: req.Version})
	if errors.Is(err, ErrStaleBody) {
		r.stats.stale.Add(1)
	}
	return err
}
