package transfer

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// TCPOptions configures a TCPTransport.
type TCPOptions struct {
	// Token is the cluster token; the peer must prove it holds the same.
	// Required, at least 16 bytes.
	Token []byte
	// Resolve maps a node name to the address of its TCPServer. Required;
	// it is called for every new connection, so a node that moved is
	// found again.
	Resolve func(node string) (addr string, err error)
	// ConnsPerPeer bounds the connections (and so the requests in flight)
	// to one node. 0 means 4.
	ConnsPerPeer int
	// Timeout bounds every ReadAt and WriteAt call, dialing included, on
	// top of the caller's context. 0 means 30s.
	Timeout time.Duration
	// ChunkBytes splits a call larger than this into frames sent in
	// parallel over the peer's connections. 0 means 4 MiB; otherwise at
	// least 4 KiB and at most 1 GiB.
	ChunkBytes uint64
}

// DefaultTCPOptions returns the values NewTCPTransport uses for zero
// fields.
func DefaultTCPOptions() TCPOptions {
	return TCPOptions{ConnsPerPeer: 4, Timeout: 30 * time.Second, ChunkBytes: 4 << 20}
}

// Validate reports every bad field at once.
func (o TCPOptions) Validate() error {
	var errs []error
	if len(o.Token) < 16 {
		errs = append(errs, fmt.Errorf("transfer: TCPOptions.Token of %d B < 16 B", len(o.Token)))
	}
	if o.Resolve == nil {
		errs = append(errs, errors.New("transfer: TCPOptions.Resolve is required"))
	}
	if o.ConnsPerPeer < 0 {
		errs = append(errs, fmt.Errorf("transfer: TCPOptions.ConnsPerPeer %d < 0", o.ConnsPerPeer))
	}
	if o.Timeout < 0 {
		errs = append(errs, fmt.Errorf("transfer: TCPOptions.Timeout %v < 0", o.Timeout))
	}
	if o.ChunkBytes != 0 && (o.ChunkBytes < 4096 || o.ChunkBytes > maxFrameLen) {
		errs = append(errs, fmt.Errorf("transfer: TCPOptions.ChunkBytes %d outside [4096, %d]", o.ChunkBytes, maxFrameLen))
	}
	return errors.Join(errs...)
}

// TCPStats are cumulative counters since the transport was made.
type TCPStats struct {
	// BytesRead and BytesWritten count payload bytes moved from and to
	// remote segments.
	BytesRead, BytesWritten uint64
	// Dials counts connections opened and authenticated.
	Dials uint64
	// Dropped counts connections closed after an error.
	Dropped uint64
}

// TCPTransport is the Transport over TCP; see Transport for the protocol.
// It keeps up to ConnsPerPeer authenticated connections per node and
// reuses them; a connection that fails is closed, and the next call dials
// a new one.
//
// Lock order: TCPTransport.mu, then tcpPeer.mu. Neither is held across
// network I/O.
type TCPTransport struct {
	opts TCPOptions
	mu   struct {
		sync.Mutex
		closed bool
		peers  map[string]*tcpPeer
	}
	stats struct {
		read, written, dials, dropped atomic.Uint64
	}
	leases leaseBook
}

type tcpPeer struct {
	node  string
	slots chan struct{} // one token per connection in use
	mu    struct {
		sync.Mutex
		idle []*tcpConn
		all  map[*tcpConn]struct{} // idle and in use, for Close
	}
}

type tcpConn struct {
	c      net.Conn
	nextID uint64
	epoch  uint64 // the server's, from the handshake
}

// checkEpoch fails when the caller's extents belong to another
// incarnation of the server than this connection reaches.
func (pc *tcpConn) checkEpoch(want uint64) error {
	if want != 0 && pc.epoch != 0 && want != pc.epoch {
		return fmt.Errorf("%w: extents of epoch %d, daemon at epoch %d", ErrStaleEpoch, want, pc.epoch)
	}
	return nil
}

// NewTCPTransport returns a transport; it dials lazily.
func NewTCPTransport(o TCPOptions) (*TCPTransport, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	d := DefaultTCPOptions()
	if o.ConnsPerPeer == 0 {
		o.ConnsPerPeer = d.ConnsPerPeer
	}
	if o.Timeout == 0 {
		o.Timeout = d.Timeout
	}
	if o.ChunkBytes == 0 {
		o.ChunkBytes = d.ChunkBytes
	}
	o.Token = append([]byte(nil), o.Token...)
	t := &TCPTransport{opts: o}
	t.mu.peers = map[string]*tcpPeer{}
	return t, nil
}

// Stats returns the counters.
func (t *TCPTransport) Stats() TCPStats {
	return TCPStats{
		BytesRead:    t.stats.read.Load(),
		BytesWritten: t.stats.written.Load(),
		Dials:        t.stats.dials.Load(),
		Dropped:      t.stats.dropped.Load(),
	}
}

// ReadAt implements Transport. dst is borrowed for the call.
func (t *TCPTransport) ReadAt(ctx context.Context, node string, epoch uint64, e segment.Extent, dst []byte) error {
	if uint64(len(dst)) != e.Len {
		return fmt.Errorf("transfer: tcp read %s %v into %d B: %w", node, e, len(dst), ErrBadRequest)
	}
	return t.call(ctx, opRead, node, epoch, e, dst)
}

// WriteAt implements Transport. src is borrowed for the call. A write
// that names a reservation goes as a write-resv frame (guard.go).
func (t *TCPTransport) WriteAt(ctx context.Context, node string, epoch, resv uint64, e segment.Extent, src []byte) error {
	if uint64(len(src)) != e.Len {
		return fmt.Errorf("transfer: tcp write %s %v from %d B: %w", node, e, len(src), ErrBadRequest)
	}
	if resv != 0 {
		return t.callChecked(ctx, opWriteResv, node, epoch, e, src, &frameArg{resv: resv})
	}
	return t.call(ctx, opWrite, node, epoch, e, src)
}

// Close closes every connection, failing calls in flight, and makes later
// calls fail with ErrClosed.
func (t *TCPTransport) Close() error {
	t.mu.Lock()
	t.mu.closed = true
	peers := t.mu.peers
	t.mu.peers = map[string]*tcpPeer{}
	for _, p := range peers {
		p.mu.Lock()
		for pc := range p.mu.all {
			pc.c.Close()
		}
		p.mu.idle = nil
		p.mu.Unlock()
	}
	t.mu.Unlock()
	return nil
}

// call splits e into chunks and runs them over up to ConnsPerPeer
// connections; it returns the first error.
func (t *TCPTransport) call(ctx context.Context, op frameOp, node string, epoch uint64, e segment.Extent, buf []byte) error {
	return t.callChecked(ctx, op, node, epoch, e, buf, nil)
}

// frameArg is what read-body and write-resv frames carry besides the
// extent: the body checked, or the reservation written into.
type frameArg struct {
	chk  bodyCheck
	resv uint64
}

// callChecked is call with the argument of a read-body or write-resv frame.
func (t *TCPTransport) callChecked(ctx context.Context, op frameOp, node string, epoch uint64, e segment.Extent, buf []byte, chk *frameArg) error {
	ctx, cancel := context.WithTimeout(ctx, t.opts.Timeout)
	defer cancel()
	p, err := t.peer(node)
	if err != nil {
		return err
	}
	cb := t.opts.ChunkBytes
	n := 1
	if e.Len > cb {
		n = int((e.Len + cb - 1) / cb)
	}
	if n == 1 {
		return t.chunk(ctx, p, op, epoch, e, buf, chk)
	}
	var (
		next  atomic.Int64
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	for range min(n, t.opts.ConnsPerPeer) {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(n) || ctx.Err() != nil {
					return
				}
				off := uint64(i) * cb
				end := min(off+cb, e.Len)
				ce := segment.Extent{Segment: e.Segment, Off: e.Off + off, Len: end - off}
				if err := t.chunk(ctx, p, op, epoch, ce, buf[off:end], chk); err != nil {
					once.Do(func() { first = err; cancel() })
					return
				}
			}
		})
	}
	wg.Wait()
	if first == nil && ctx.Err() != nil {
		return fmt.Errorf("transfer: tcp %v %s %v: %w", op, node, e, ctx.Err())
	}
	return first
}

func (t *TCPTransport) peer(node string) (*tcpPeer, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.closed {
		return nil, ErrClosed
	}
	p := t.mu.peers[node]
	if p == nil {
		p = &tcpPeer{node: node, slots: make(chan struct{}, t.opts.ConnsPerPeer)}
		p.mu.all = map[*tcpConn]struct{}{}
		t.mu.peers[node] = p
	}
	return p, nil
}

// chunk runs one frame's request on a pooled connection.
func (t *TCPTransport) chunk(ctx context.Context, p *tcpPeer, op frameOp, epoch uint64, e segment.Extent, buf []byte, chk *frameArg) error {
	wrap := func(err error) error {
		return fmt.Errorf("transfer: tcp %v %s %v: %w", op, p.node, e, err)
	}
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return wrap(ctx.Err())
	}
	defer func() { <-p.slots }()
	var err error
	for attempt := 0; ; attempt++ {
		var broken, reused bool
		broken, reused, err = t.try(ctx, p, op, epoch, e, buf, chk)
		// A pooled connection may have died with its peer (a restart):
		// both operations are idempotent, so go once more on a fresh one.
		if err != nil && broken && reused && attempt == 0 && ctx.Err() == nil {
			continue
		}
		break
	}
	if err != nil {
		return wrap(err)
	}
	if op == opWrite || op == opWriteResv {
		t.stats.written.Add(e.Len)
	} else {
		t.stats.read.Add(e.Len)
	}
	return nil
}

// try runs one request on a connection of p; broken says the connection
// was dropped, reused that it came from the idle pool.
func (t *TCPTransport) try(ctx context.Context, p *tcpPeer, op frameOp, epoch uint64, e segment.Extent, buf []byte, chk *frameArg) (broken, reused bool, err error) {
	_, reused, broken, err = t.onConn(ctx, p, epoch, func(pc *tcpConn) (bool, error) {
		return pc.roundTrip(op, e, buf, chk)
	})
	return broken, reused, err
}

// onConn runs fn on a connection of p under ctx's deadline (a cancelled
// ctx unblocks its I/O), after checking the peer's epoch, then returns the
// connection to the pool, or drops it when fn says it is broken or the
// deadline may be poisoned. It returns the peer's epoch.
//
// A pooled connection to an older incarnation than the caller's extents
// (the node restarted since it was dialed) is closed, and a fresh one
// dialed: only a caller whose extents are older than the daemon is stale.
func (t *TCPTransport) onConn(ctx context.Context, p *tcpPeer, epoch uint64, fn func(pc *tcpConn) (broken bool, err error)) (got uint64, reused, broken bool, err error) {
	var pc *tcpConn
	for {
		pc, reused, err = t.conn(ctx, p)
		if err != nil {
			return 0, false, false, unreachable(err)
		}
		if err := pc.checkEpoch(epoch); err != nil {
			if reused && epoch > pc.epoch {
				t.drop(p, pc)
				continue
			}
			t.release(p, pc)
			return pc.epoch, reused, false, err
		}
		break
	}
	dl, _ := ctx.Deadline() // the caller set one
	if err := pc.c.SetDeadline(dl); err != nil {
		t.drop(p, pc)
		return pc.epoch, reused, true, err
	}
	stop := context.AfterFunc(ctx, func() { pc.c.SetDeadline(time.Unix(1, 0)) })
	broken, err = fn(pc)
	if !stop() {
		// The deadline may be poisoned, or about to be: do not reuse.
		broken = true
		if err != nil {
			err = errors.Join(ctx.Err(), err)
		}
	}
	if broken {
		t.drop(p, pc)
		if ctx.Err() == nil {
			err = unreachable(err)
		}
	} else {
		t.release(p, pc)
	}
	return pc.epoch, reused, broken, err
}

// ErrUnreachable means the node could not be reached, or its connection
// broke mid-request: it is down, restarting or cut off. fs answers
// EHOSTUNREACH for it, whatever the socket said.
var ErrUnreachable = errors.New("transfer: node unreachable")

// unreachable wraps a dial or connection error as ErrUnreachable (its
// text kept, its errno not: one errno for every transport failure).
func unreachable(err error) error {
	if err == nil || errors.Is(err, ErrUnreachable) || errors.Is(err, ErrClosed) || errors.Is(err, ErrAuth) ||
		errors.Is(err, ErrProtocol) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		return err // a deadline: ETIMEDOUT, as the caller's own
	}
	return fmt.Errorf("%w: %v", ErrUnreachable, err)
}

// conn returns an idle connection of p (reused) or dials one. The caller
// holds one of p's slots.
func (t *TCPTransport) conn(ctx context.Context, p *tcpPeer) (*tcpConn, bool, error) {
	for {
		p.mu.Lock()
		n := len(p.mu.idle)
		if n == 0 {
			p.mu.Unlock()
			break
		}
		pc := p.mu.idle[n-1]
		p.mu.idle = p.mu.idle[:n-1]
		p.mu.Unlock()
		if pc.closedByPeer() {
			// The peer went away (a restart, a crash) while this sat
			// idle: a request on it would fail, or worse, a control call
			// would not know whether it was served.
			t.drop(p, pc)
			continue
		}
		return pc, true, nil
	}

	addr, err := t.opts.Resolve(p.node)
	if err != nil {
		return nil, false, fmt.Errorf("resolve: %w", err)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, false, err
	}
	dl, _ := ctx.Deadline()
	c.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	var epoch uint64
	epoch, err = clientHandshake(c, t.opts.Token)
	if !stop() && err == nil {
		err = ctx.Err()
	}
	if err != nil {
		c.Close()
		return nil, false, fmt.Errorf("handshake with %s: %w", addr, err)
	}
	pc := &tcpConn{c: c, epoch: epoch}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.closed {
		c.Close()
		return nil, false, ErrClosed
	}
	p.mu.Lock()
	p.mu.all[pc] = struct{}{}
	p.mu.Unlock()
	t.stats.dials.Add(1)
	return pc, false, nil
}

func (t *TCPTransport) release(p *tcpPeer, pc *tcpConn) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p.mu.Lock()
	defer p.mu.Unlock()
	if t.mu.closed {
		delete(p.mu.all, pc)
		pc.c.Close()
		return
	}
	p.mu.idle = append(p.mu.idle, pc)
}

func (t *TCPTransport) drop(p *tcpPeer, pc *tcpConn) {
	t.stats.dropped.Add(1)
	p.mu.Lock()
	delete(p.mu.all, pc)
	p.mu.Unlock()
	pc.c.Close()
}

// closedByPeer reports whether an idle connection was closed or reset by
// its peer: a non-blocking peek finds end of file or an error where an
// idle connection has nothing to read.
func (pc *tcpConn) closedByPeer() bool {
	sc, ok := pc.c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return true
	}
	dead := false
	var b [1]byte
	if err := rc.Read(func(fd uintptr) bool {
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		dead = n == 0 && err == nil || err != nil && err != syscall.EAGAIN && err != syscall.EINTR
		return true
	}); err != nil {
		return true
	}
	return dead
}

// roundTrip sends one request and reads its response. broken reports that
// the connection must not be reused; a remote error status leaves it
// usable.
func (pc *tcpConn) roundTrip(op frameOp, e segment.Extent, buf []byte, chk *frameArg) (broken bool, err error) {
	pc.nextID++
	req := header{op: op, id: pc.nextID, seg: e.Segment, off: e.Off, len: e.Len}
	var hb [headerSize + readBodyLen]byte
	msg := hb[:headerSize]
	switch op {
	case opReadBody:
		req.len = readBodyLen
		putReadBody(hb[headerSize:], e.Len, chk.chk)
		msg = hb[:]
	case opWriteResv:
		req.len = e.Len + resvIDLen
		binary.LittleEndian.PutUint64(hb[headerSize:], chk.resv)
		msg = hb[:headerSize+resvIDLen]
	}
	putHeader(hb[:], req)
	if _, err := pc.c.Write(msg); err != nil {
		return true, err
	}
	written := op == opWrite || op == opWriteResv
	if written {
		// Straight from the caller's buffer; see serveRequest on writev.
		if _, err := sendSegment(pc.c, buf); err != nil {
			return true, err
		}
	}
	if _, err := io.ReadFull(pc.c, hb[:headerSize]); err != nil {
		return true, err
	}
	h, err := decodeHeader(hb[:headerSize])
	if err != nil {
		return true, err
	}
	if h.op != op || h.id != req.id {
		return true, fmt.Errorf("%w: response %v #%d to %v #%d", ErrProtocol, h.op, h.id, op, req.id)
	}
	if h.status != statusOK {
		if h.len != 0 {
			return true, fmt.Errorf("%w: error status with %d B payload", ErrProtocol, h.len)
		}
		return false, statusErr(h.status)
	}
	want := uint64(0)
	if !written {
		want = e.Len
	}
	if h.len != want {
		return true, fmt.Errorf("%w: %v response of %d B, want %d", ErrProtocol, op, h.len, want)
	}
	if !written {
		if _, err := io.ReadFull(pc.c, buf); err != nil {
			return true, err
		}
	}
	return false, nil
}

// clientHandshake runs the client side of the challenge-response; see
// Transport. It returns the server's epoch. c's deadline is set by the
// caller.
func clientHandshake(c net.Conn, token []byte) (uint64, error) {
	var in [headerSize + authLen]byte
	if _, err := io.ReadFull(c, in[:]); err != nil {
		return 0, fmt.Errorf("read challenge: %w", err)
	}
	h, err := decodeHeader(in[:headerSize])
	if err != nil {
		return 0, err
	}
	if h.op != opChallenge || h.len != authLen {
		return 0, fmt.Errorf("%w: %v of %d B instead of a challenge", ErrProtocol, h.op, h.len)
	}
	var challenge [authLen]byte
	copy(challenge[:], in[headerSize:])

	var out [headerSize + 2*authLen]byte
	putHeader(out[:], header{op: opProof, len: 2 * authLen})
	nonce := out[headerSize+authLen:]
	rand.Read(nonce)
	copy(out[headerSize:], authMAC(token, challenge[:], nonce))
	if _, err := c.Write(out[:]); err != nil {
		return 0, fmt.Errorf("send proof: %w", err)
	}

	if _, err := io.ReadFull(c, in[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
			// How a server refuses a proof.
			return 0, fmt.Errorf("%w: peer closed the connection after our proof (%v)", ErrAuth, err)
		}
		return 0, fmt.Errorf("read accept: %w", err)
	}
	h, err = decodeHeader(in[:headerSize])
	if err != nil {
		return 0, err
	}
	if h.op != opAccept || h.len != authLen {
		return 0, fmt.Errorf("%w: %v of %d B instead of an accept", ErrProtocol, h.op, h.len)
	}
	if !hmac.Equal(in[headerSize:], authMAC(token, nonce, challenge[:])) {
		return 0, fmt.Errorf("%w: server's proof does not match", ErrAuth)
	}
	return h.off, nil
}
