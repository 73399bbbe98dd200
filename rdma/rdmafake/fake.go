package rdmafake

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/mooncake-fs/mooncake-fs/rdma"
)

// Options configures a Provider.
type Options struct {
	// Dir is the fabric: a folder every fake device of every process
	// that should reach the others shares. Required.
	Dir string
	// Devices names this provider's devices; at least one.
	Devices []string
	// Jitter, when not 0, delays each work request by a random time up
	// to it, so that QPs complete out of order.
	Jitter time.Duration
	// MTU is the devices' active MTU; 0 means 4096.
	MTU int
	// DeviceMemory is the GPU memory the devices reach through dma-buf
	// registrations (GPUDirect RDMA); nil refuses them, as a NIC
	// without peer-memory support does.
	DeviceMemory DeviceMemory
}

// DeviceMemory is what a dma-buf registration reaches: device memory
// named by the address it is registered at (its iova).
type DeviceMemory interface {
	// Check verifies that fd is a dma-buf that holds offset+length
	// bytes, as the kernel does when a NIC's driver imports it.
	Check(fd int, offset, length uint64) error
	// Read copies len(dst) bytes at device address addr into dst; Write
	// copies src to addr.
	Read(dst []byte, addr uint64) error
	Write(addr uint64, src []byte) error
}

// Fault is a failure Inject makes happen.
type Fault uint8

const (
	// FaultQPError moves the QP of the next work request to the error
	// state before it runs: it and what follows are flushed.
	FaultQPError Fault = iota + 1
	// FaultRemoteAccess fails the next work request with a remote access
	// error, as a NIC does for a bad rkey.
	FaultRemoteAccess
	// FaultTimeout makes the next work request never complete.
	FaultTimeout
)

// Provider is the fake rdma.Provider.
type Provider struct {
	opts   Options
	jitter atomic.Int64 // ns; Options.Jitter, or SetJitter's
	mu     sync.Mutex
	devs   map[string]*device
	faults []Fault
	stats  struct{ writes, reads, bytes, failed atomic.Uint64 }
}

var _ rdma.Provider = (*Provider)(nil)

// New returns a provider; its devices start listening when opened.
func New(o Options) (*Provider, error) {
	if o.Dir == "" {
		return nil, errors.New("rdmafake: Options.Dir is required")
	}
	if len(o.Devices) == 0 {
		return nil, errors.New("rdmafake: Options.Devices is empty")
	}
	if o.MTU == 0 {
		o.MTU = 4096
	}
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("rdmafake: %w", err)
	}
	p := &Provider{opts: o, devs: map[string]*device{}}
	p.jitter.Store(int64(o.Jitter))
	return p, nil
}

// SetJitter changes Options.Jitter.
func (p *Provider) SetJitter(d time.Duration) { p.jitter.Store(int64(d)) }

// Name implements rdma.Provider.
func (p *Provider) Name() string { return "fake" }

// Devices implements rdma.Provider.
func (p *Provider) Devices() ([]rdma.DeviceInfo, error) {
	out := make([]rdma.DeviceInfo, 0, len(p.opts.Devices))
	for i, n := range p.opts.Devices {
		out = append(out, p.info(n, i))
	}
	return out, nil
}

func (p *Provider) info(name string, i int) rdma.DeviceInfo {
	sum := sha256.Sum256([]byte("rdmafake:" + name))
	var g rdma.GID
	copy(g[:], sum[:16])
	return rdma.DeviceInfo{Name: name, Port: 1, PortUp: true, LinkLayer: "Ethernet",
		LID: uint16(i + 1), GID: g, GIDIndex: 0, MTU: p.opts.MTU, NUMANode: -1}
}

// Inject queues faults; each hits the next work request of any QP of
// this provider, in order.
func (p *Provider) Inject(f ...Fault) {
	p.mu.Lock()
	p.faults = append(p.faults, f...)
	p.mu.Unlock()
}

// Pending returns how many injected faults no work request has taken
// yet: a test that injected one knows, once this is 0, that a request is
// running into it.
func (p *Provider) Pending() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.faults)
}

func (p *Provider) nextFault() Fault {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.faults) == 0 {
		return 0
	}
	f := p.faults[0]
	p.faults = p.faults[1:]
	return f
}

// Stats counts the work requests this provider's devices ran.
type Stats struct {
	Writes, Reads, Bytes, Failed uint64
}

// Stats returns the counters.
func (p *Provider) Stats() Stats {
	return Stats{Writes: p.stats.writes.Load(), Reads: p.stats.reads.Load(),
		Bytes: p.stats.bytes.Load(), Failed: p.stats.failed.Load()}
}

// MRs returns how many memory regions are registered on the provider's
// open devices (a leak check for tests).
func (p *Provider) MRs() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, d := range p.devs {
		d.mu.RLock()
		n += len(d.mrs)
		d.mu.RUnlock()
	}
	return n
}

// Open implements rdma.Provider.
func (p *Provider) Open(name string) (rdma.Device, error) {
	idx := -1
	for i, n := range p.opts.Devices {
		if n == name {
			idx = i
		}
	}
	if idx < 0 {
		return nil, fmt.Errorf("rdmafake: no device %q: %w", name, rdma.ErrUnavailable)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.devs[name]; ok {
		return nil, fmt.Errorf("rdmafake: device %q is already open", name)
	}
	d := &device{p: p, info: p.info(name, idx), mrs: map[uint32]*mr{}, byRKey: map[uint32]*mr{}, qps: map[uint32]*qp{}}
	d.sock = sockPath(p.opts.Dir, d.info.GID)
	os.Remove(d.sock)
	ln, err := net.Listen("unix", d.sock)
	if err != nil {
		return nil, fmt.Errorf("rdmafake: device %q: %w", name, err)
	}
	d.ln = ln
	d.wg.Go(d.serve)
	p.devs[name] = d
	return d, nil
}

func sockPath(dir string, g rdma.GID) string {
	return filepath.Join(dir, hex.EncodeToString(g[:8])+".sock")
}

type device struct {
	p    *Provider
	info rdma.DeviceInfo
	sock string
	ln   net.Listener
	wg   sync.WaitGroup
	// mu guards the tables. Memory is copied under the read lock, so a
	// deregistration (write lock) waits for the accesses in flight.
	mu     sync.RWMutex
	mrs    map[uint32]*mr // by lkey
	byRKey map[uint32]*mr
	qps    map[uint32]*qp
	conns  map[net.Conn]struct{}
	closed bool
}

func (d *device) Info() rdma.DeviceInfo { return d.info }

func (d *device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	busy := len(d.mrs) + len(d.qps)
	for c := range d.conns {
		c.Close()
	}
	d.mu.Unlock()
	d.ln.Close()
	os.Remove(d.sock)
	d.wg.Wait()
	d.p.mu.Lock()
	delete(d.p.devs, d.info.Name)
	d.p.mu.Unlock()
	if busy > 0 {
		return fmt.Errorf("rdmafake: device %q closed with %d MRs and QPs open (EBUSY)", d.info.Name, busy)
	}
	return nil
}

func randKey() uint32 {
	var b [4]byte
	rand.Read(b[:])
	return binary.LittleEndian.Uint32(b[:])
}

type mr struct {
	d      *device
	mem    []byte
	addr   uint64
	access rdma.Access
	// dev reaches a dma-buf registration's memory (mem is nil), of
	// devLen bytes.
	dev        DeviceMemory
	devLen     uint64
	lkey, rkey uint32
}

func (m *mr) Addr() uint64 { return m.addr }
func (m *mr) Len() uint64 {
	if m.dev != nil {
		return m.devLen
	}
	return uint64(len(m.mem))
}
func (m *mr) LKey() uint32 { return m.lkey }
func (m *mr) RKey() uint32 { return m.rkey }

func (m *mr) Close() error {
	d := m.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mrs[m.lkey] != m {
		return rdma.ErrClosed
	}
	delete(d.mrs, m.lkey)
	delete(d.byRKey, m.rkey)
	return nil
}

func (d *device) RegMR(mem []byte, access rdma.Access) (rdma.MR, error) {
	if len(mem) == 0 {
		return nil, errors.New("rdmafake: RegMR of 0 bytes (EINVAL)")
	}
	return d.add(&mr{d: d, mem: mem, addr: uint64(uintptr(unsafe.Pointer(&mem[0]))), access: access})
}

// add enters m with fresh keys.
func (d *device) add(m *mr) (rdma.MR, error) {
	if m.access&rdma.AccessRemoteWrite != 0 && m.access&rdma.AccessLocalWrite == 0 {
		return nil, errors.New("rdmafake: REMOTE_WRITE without LOCAL_WRITE (EINVAL)")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, rdma.ErrClosed
	}
	for m.lkey == 0 || d.mrs[m.lkey] != nil {
		m.lkey = randKey()
	}
	for m.rkey == 0 || d.byRKey[m.rkey] != nil {
		m.rkey = randKey()
	}
	d.mrs[m.lkey] = m
	d.byRKey[m.rkey] = m
	return m, nil
}

func (d *device) RegDmabufMR(fd int, offset, length, iova uint64, access rdma.Access) (rdma.MR, error) {
	dm := d.p.opts.DeviceMemory
	if dm == nil {
		return nil, fmt.Errorf("rdmafake: dma-buf registration: %w", rdma.ErrUnavailable)
	}
	if fd < 0 || length == 0 || iova+length < iova {
		return nil, fmt.Errorf("rdmafake: dma-buf registration of fd %d, %d B at %#x (EINVAL)", fd, length, iova)
	}
	if err := dm.Check(fd, offset, length); err != nil {
		return nil, fmt.Errorf("rdmafake: dma-buf registration: %w", err)
	}
	return d.add(&mr{d: d, addr: iova, access: access, dev: dm, devLen: length})
}

// offset returns where [addr, addr+n) starts in m, or false when m does
// not hold it.
func (m *mr) offset(addr, n uint64) (uint64, bool) {
	if addr < m.addr || n > m.Len() || addr-m.addr > m.Len()-n {
		return 0, false
	}
	return addr - m.addr, true
}

// read copies len(dst) bytes at off of m into dst (the NIC's DMA read).
func (m *mr) read(off uint64, dst []byte) error {
	if m.dev != nil {
		return m.dev.Read(dst, m.addr+off)
	}
	copy(dst, m.mem[off:])
	return nil
}

// write copies src to off of m (the NIC's DMA write).
func (m *mr) write(off uint64, src []byte) error {
	if m.dev != nil {
		return m.dev.Write(m.addr+off, src)
	}
	copy(m.mem[off:], src)
	return nil
}

func (d *device) CreateQP(depth int) (rdma.QP, error) {
	if depth < 1 || depth > 1<<14 {
		return nil, fmt.Errorf("rdmafake: QP depth %d outside [1, 16384] (EINVAL)", depth)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, rdma.ErrClosed
	}
	q := &qp{d: d, depth: depth, psn: randKey() & 0xffffff, wake: make(chan struct{}, 1), done: make(chan struct{})}
	for q.qpn == 0 || d.qps[q.qpn] != nil {
		q.qpn = randKey() & 0xffffff
	}
	d.qps[q.qpn] = q
	q.wg.Go(q.run)
	return q, nil
}

type qp struct {
	d     *device
	qpn   uint32
	psn   uint32
	depth int
	wake  chan struct{}
	done  chan struct{}
	wg    sync.WaitGroup
	mu    struct {
		sync.Mutex
		state   rdma.QPState
		remote  rdma.Endpoint
		queue   []rdma.WorkRequest
		cq      []rdma.Completion
		pending int // posted, not yet polled
		closed  bool
	}
	conn net.Conn // to the remote device; owned by run
}

func (q *qp) Endpoint() rdma.Endpoint {
	return rdma.Endpoint{LID: q.d.info.LID, GID: q.d.info.GID, QPN: q.qpn, PSN: q.psn, MTU: q.d.info.MTU, ReadDepth: 16}
}

func (q *qp) State() rdma.QPState {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.mu.state
}

func (q *qp) Connect(remote rdma.Endpoint) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.mu.closed:
		return rdma.ErrClosed
	case q.mu.state != rdma.QPReset:
		return fmt.Errorf("rdmafake: connect QP %#x in state %v (EINVAL)", q.qpn, q.mu.state)
	case remote.QPN == 0 || remote.QPN > 0xffffff || remote.GID == (rdma.GID{}):
		return fmt.Errorf("rdmafake: connect QP %#x to bad endpoint %+v (EINVAL)", q.qpn, remote)
	}
	q.mu.remote = remote
	q.mu.state = rdma.QPRTS
	return nil
}

func (q *qp) Post(wrs []rdma.WorkRequest) error {
	for i, w := range wrs {
		if len(w.Local) == 0 || len(w.Local) > rdma.MaxSGE {
			return fmt.Errorf("rdmafake: work request %d has %d SGEs (EINVAL)", i, len(w.Local))
		}
		if w.Op != rdma.OpWrite && w.Op != rdma.OpRead {
			return fmt.Errorf("rdmafake: work request %d opcode %d (EINVAL)", i, w.Op)
		}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	switch {
	case q.mu.closed:
		return rdma.ErrClosed
	case q.mu.state < rdma.QPRTS:
		return fmt.Errorf("rdmafake: post on QP %#x in state %v (EINVAL)", q.qpn, q.mu.state)
	}
	// As a NIC: the requests that fit are queued, the first that does
	// not fails the call.
	var err error
	for i, w := range wrs {
		if q.mu.pending >= q.depth {
			err = fmt.Errorf("rdmafake: work request %d of %d on QP %#x: %d of %d outstanding (ENOMEM)", i, len(wrs), q.qpn, q.mu.pending, q.depth)
			break
		}
		w.Local = append([]rdma.SGE(nil), w.Local...)
		q.mu.queue = append(q.mu.queue, w)
		q.mu.pending++
	}
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return err
}

func (q *qp) Poll(out []rdma.Completion) (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.mu.closed {
		return 0, rdma.ErrClosed
	}
	n := copy(out, q.mu.cq)
	q.mu.cq = q.mu.cq[n:]
	q.mu.pending -= n
	return n, nil
}

func (q *qp) Close() error {
	q.mu.Lock()
	if q.mu.closed {
		q.mu.Unlock()
		return nil
	}
	q.mu.closed = true
	q.mu.Unlock()
	close(q.done)
	q.wg.Wait()
	q.d.mu.Lock()
	delete(q.d.qps, q.qpn)
	q.d.mu.Unlock()
	return nil
}

// run is the QP's engine: it takes queued requests in order and
// completes each.
func (q *qp) run() {
	defer func() {
		if q.conn != nil {
			q.conn.Close()
		}
	}()
	for {
		q.mu.Lock()
		if len(q.mu.queue) == 0 {
			q.mu.Unlock()
			select {
			case <-q.wake:
				continue
			case <-q.done:
				return
			}
		}
		w := q.mu.queue[0]
		q.mu.queue = q.mu.queue[1:]
		state := q.mu.state
		remote := q.mu.remote
		q.mu.Unlock()
		var st rdma.Status
		if state == rdma.QPError {
			st = rdma.StatusFlushErr
		} else {
			switch q.d.p.nextFault() {
			case FaultQPError:
				st = rdma.StatusFlushErr
			case FaultRemoteAccess:
				st = rdma.StatusRemAccessErr
			case FaultTimeout:
				<-q.done
				return
			default:
				if j := q.d.p.jitter.Load(); j > 0 {
					time.Sleep(time.Duration(mrand.Int64N(j)))
				}
				st = q.exec(w, remote)
			}
		}
		q.complete(w, st)
	}
}

func (q *qp) complete(w rdma.WorkRequest, st rdma.Status) {
	p := q.d.p
	if st != rdma.StatusSuccess {
		p.stats.failed.Add(1)
	} else if w.Op == rdma.OpWrite {
		p.stats.writes.Add(1)
		p.stats.bytes.Add(w.Bytes())
	} else {
		p.stats.reads.Add(1)
		p.stats.bytes.Add(w.Bytes())
	}
	q.mu.Lock()
	if st != rdma.StatusSuccess {
		q.mu.state = rdma.QPError
	}
	c := rdma.Completion{ID: w.ID, Status: st, Op: w.Op}
	if st == rdma.StatusSuccess {
		c.Bytes = uint32(w.Bytes())
	}
	q.mu.cq = append(q.mu.cq, c)
	q.mu.Unlock()
}

// local walks the request's SGEs through the requester's MRs, as the NIC
// checks them (lkey, bounds, LOCAL_WRITE for memory a READ writes), and
// calls f with each SGE's MR, its offset there and its length under the
// table's lock; a failed check is the local protection error, and so is
// a failed copy of device memory.
func (q *qp) local(w rdma.WorkRequest, f func(m *mr, off uint64, n int) error) rdma.Status {
	d := q.d
	d.mu.RLock()
	defer d.mu.RUnlock()
	for _, s := range w.Local {
		m := d.mrs[s.LKey]
		if m == nil {
			return rdma.StatusLocProtErr
		}
		off, ok := m.offset(s.Addr, uint64(s.Len))
		if !ok || w.Op == rdma.OpRead && m.access&rdma.AccessLocalWrite == 0 {
			return rdma.StatusLocProtErr
		}
		if f != nil && f(m, off, int(s.Len)) != nil {
			return rdma.StatusLocProtErr
		}
	}
	return rdma.StatusSuccess
}

// gather copies a WRITE's local bytes into out (nil: checks only).
func (q *qp) gather(w rdma.WorkRequest, out []byte) rdma.Status {
	if out == nil {
		return q.local(w, nil)
	}
	pos := 0
	return q.local(w, func(m *mr, off uint64, n int) error {
		err := m.read(off, out[pos:pos+n])
		pos += n
		return err
	})
}

// scatter copies a READ's answer into its local SGEs.
func (q *qp) scatter(w rdma.WorkRequest, in []byte) rdma.Status {
	pos := 0
	return q.local(w, func(m *mr, off uint64, n int) error {
		err := m.write(off, in[pos:pos+n])
		pos += n
		return err
	})
}

// Wire frames between fake devices (little-endian):
//
//	request   0 op (1 write, 2 read), 1-3 zero, 4 dst QPN, 8 src QPN,
//	          12 rkey, 16 src GID (16), 32 remote address, 40 length;
//	          a write's payload follows
//	response  0 status, 4 zero; a successful read's payload follows
const (
	reqLen  = 48
	respLen = 8
	maxWire = 1 << 30
)

func (q *qp) exec(w rdma.WorkRequest, remote rdma.Endpoint) rdma.Status {
	n := w.Bytes()
	if n > maxWire {
		return rdma.StatusLocLenErr
	}
	var payload []byte
	if w.Op == rdma.OpWrite {
		payload = make([]byte, n)
		if st := q.gather(w, payload); st != rdma.StatusSuccess {
			return st
		}
	} else if st := q.gather(w, nil); st != rdma.StatusSuccess {
		return st
	}
	if q.conn == nil {
		c, err := net.Dial("unix", sockPath(q.d.p.opts.Dir, remote.GID))
		if err != nil {
			return rdma.StatusRetryExcErr // no such port on the fabric
		}
		q.conn = c
	}
	var h [reqLen]byte
	h[0] = 1
	if w.Op == rdma.OpRead {
		h[0] = 2
	}
	binary.LittleEndian.PutUint32(h[4:], remote.QPN)
	binary.LittleEndian.PutUint32(h[8:], q.qpn)
	binary.LittleEndian.PutUint32(h[12:], w.RKey)
	copy(h[16:32], q.d.info.GID[:])
	binary.LittleEndian.PutUint64(h[32:], w.Remote)
	binary.LittleEndian.PutUint64(h[40:], n)
	fail := func() rdma.Status {
		q.conn.Close()
		q.conn = nil
		return rdma.StatusRetryExcErr
	}
	if _, err := q.conn.Write(append(h[:], payload...)); err != nil {
		return fail()
	}
	var r [respLen]byte
	if _, err := io.ReadFull(q.conn, r[:]); err != nil {
		return fail()
	}
	st := rdma.Status(binary.LittleEndian.Uint32(r[:]))
	if st != rdma.StatusSuccess || w.Op == rdma.OpWrite {
		return st
	}
	in := make([]byte, n)
	if _, err := io.ReadFull(q.conn, in); err != nil {
		return fail()
	}
	return q.scatter(w, in)
}

// serve accepts the fabric connections of remote QPs.
func (d *device) serve() {
	for {
		c, err := d.ln.Accept()
		if err != nil {
			return
		}
		d.mu.Lock()
		if d.closed {
			d.mu.Unlock()
			c.Close()
			return
		}
		if d.conns == nil {
			d.conns = map[net.Conn]struct{}{}
		}
		d.conns[c] = struct{}{}
		d.mu.Unlock()
		d.wg.Go(func() {
			defer func() {
				c.Close()
				d.mu.Lock()
				delete(d.conns, c)
				d.mu.Unlock()
			}()
			for d.respond(c) == nil {
			}
		})
	}
}

// respond serves one request: the responder's checks a NIC makes.
func (d *device) respond(c net.Conn) error {
	var h [reqLen]byte
	if _, err := io.ReadFull(c, h[:]); err != nil {
		return err
	}
	op := h[0]
	dst := binary.LittleEndian.Uint32(h[4:])
	src := binary.LittleEndian.Uint32(h[8:])
	rkey := binary.LittleEndian.Uint32(h[12:])
	var sgid rdma.GID
	copy(sgid[:], h[16:32])
	addr := binary.LittleEndian.Uint64(h[32:])
	n := binary.LittleEndian.Uint64(h[40:])
	if (op != 1 && op != 2) || n > maxWire {
		return errors.New("rdmafake: bad frame")
	}
	var payload []byte
	if op == 1 {
		payload = make([]byte, n)
		if _, err := io.ReadFull(c, payload); err != nil {
			return err
		}
	}
	st, data := d.access(op, dst, src, sgid, rkey, addr, n, payload)
	var r [respLen]byte
	binary.LittleEndian.PutUint32(r[:], uint32(st))
	if _, err := c.Write(r[:]); err != nil {
		return err
	}
	if data != nil {
		_, err := c.Write(data)
		return err
	}
	return nil
}

func (d *device) access(op byte, dst, src uint32, sgid rdma.GID, rkey uint32, addr, n uint64, payload []byte) (rdma.Status, []byte) {
	d.mu.RLock()
	defer d.mu.RUnlock()
	q := d.qps[dst]
	if q == nil {
		return rdma.StatusRetryExcErr, nil // dropped: no such QP
	}
	q.mu.Lock()
	state, remote := q.mu.state, q.mu.remote
	q.mu.Unlock()
	if state != rdma.QPRTR && state != rdma.QPRTS || remote.QPN != src || remote.GID != sgid {
		return rdma.StatusRetryExcErr, nil // dropped: not connected to the sender
	}
	m := d.byRKey[rkey]
	if m == nil {
		return rdma.StatusRemAccessErr, nil
	}
	off, ok := m.offset(addr, n)
	if !ok {
		return rdma.StatusRemAccessErr, nil
	}
	if op == 1 {
		if m.access&rdma.AccessRemoteWrite == 0 || m.write(off, payload) != nil {
			return rdma.StatusRemAccessErr, nil
		}
		return rdma.StatusSuccess, nil
	}
	if m.access&rdma.AccessRemoteRead == 0 {
		return rdma.StatusRemAccessErr, nil
	}
	data := make([]byte, n)
	if m.read(off, data) != nil {
		return rdma.StatusRemAccessErr, nil
	}
	return rdma.StatusSuccess, data
}
