package transfer

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// TCPServerOptions configures a TCPServer.
type TCPServerOptions struct {
	// Local resolves extents of this node's segments. Required.
	Local Resolver
	// Token is the cluster token peers must prove they hold. Required,
	// at least 16 bytes.
	Token []byte
	// AuthTimeout bounds the handshake; a peer that has not authenticated
	// by then is dropped. 0 means 10s.
	AuthTimeout time.Duration
	// RequestTimeout bounds one request once its header has arrived
	// (payload in, response out). 0 means 5 minutes. Idle authenticated
	// connections are kept without a deadline.
	RequestTimeout time.Duration
	// Epoch is this daemon's incarnation, told to every client in the
	// handshake; 0 tells none.
	Epoch uint64
	// Bodies checks the bodies of checked reads; nil refuses them.
	Bodies BodyChecker
	// RDMA answers peers' RDMA endpoint exchanges (CtlRDMA); nil: this
	// node is reached over TCP only.
	RDMA *RDMA
	// Control serves control calls (remote reservations); nil refuses
	// them with an error status.
	Control Controller
	// Writes admits writes into reservations (guard.go); with it, plain
	// writes that name no reservation are refused. Nil admits every
	// in-range write.
	Writes WriteGuard
	// Log receives one line per refused or broken connection; nil logs
	// nothing.
	Log func(format string, args ...any)
}

// DefaultTCPServerOptions returns the values NewTCPServer uses for zero
// fields.
func DefaultTCPServerOptions() TCPServerOptions {
	return TCPServerOptions{AuthTimeout: 10 * time.Second, RequestTimeout: 5 * time.Minute}
}

// Validate reports every bad field at once.
func (o TCPServerOptions) Validate() error {
	var errs []error
	if o.Local == nil {
		errs = append(errs, errors.New("transfer: TCPServerOptions.Local is required"))
	}
	if len(o.Token) < 16 {
		errs = append(errs, fmt.Errorf("transfer: TCPServerOptions.Token of %d B < 16 B", len(o.Token)))
	}
	if o.AuthTimeout < 0 {
		errs = append(errs, fmt.Errorf("transfer: TCPServerOptions.AuthTimeout %v < 0", o.AuthTimeout))
	}
	if o.RequestTimeout < 0 {
		errs = append(errs, fmt.Errorf("transfer: TCPServerOptions.RequestTimeout %v < 0", o.RequestTimeout))
	}
	return errors.Join(errs...)
}

// TCPServerStats are cumulative counters since the server started.
type TCPServerStats struct {
	// BytesRead and BytesWritten count bytes served out of and into
	// segments (payload only).
	BytesRead, BytesWritten uint64
	// Requests counts read and write requests, served or refused.
	Requests uint64
	// BadRequests counts requests answered with an error status.
	BadRequests uint64
	// AuthFailures counts connections dropped before authenticating.
	AuthFailures uint64
	// ProtocolErrors counts authenticated connections closed for a
	// malformed frame.
	ProtocolErrors uint64
}

// TCPServer serves this node's segments to TCPTransport clients. See
// Transport for the wire protocol. It is safe for concurrent use.
type TCPServer struct {
	opts TCPServerOptions
	wg   sync.WaitGroup
	mu   struct {
		sync.Mutex
		closed bool
		lns    map[net.Listener]struct{}
		conns  map[net.Conn]struct{}
	}
	stats struct {
		read, written, requests, bad, authFail, protoErr atomic.Uint64
	}
}

// NewTCPServer returns a server; call Serve to start accepting.
func NewTCPServer(o TCPServerOptions) (*TCPServer, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	d := DefaultTCPServerOptions()
	if o.AuthTimeout == 0 {
		o.AuthTimeout = d.AuthTimeout
	}
	if o.RequestTimeout == 0 {
		o.RequestTimeout = d.RequestTimeout
	}
	if o.Log == nil {
		o.Log = func(string, ...any) {}
	}
	o.Token = append([]byte(nil), o.Token...)
	s := &TCPServer{opts: o}
	s.mu.lns = map[net.Listener]struct{}{}
	s.mu.conns = map[net.Conn]struct{}{}
	return s, nil
}

// Stats returns the counters.
func (s *TCPServer) Stats() TCPServerStats {
	return TCPServerStats{
		BytesRead:      s.stats.read.Load(),
		BytesWritten:   s.stats.written.Load(),
		Requests:       s.stats.requests.Load(),
		BadRequests:    s.stats.bad.Load(),
		AuthFailures:   s.stats.authFail.Load(),
		ProtocolErrors: s.stats.protoErr.Load(),
	}
}

// Serve accepts connections on ln until ln fails or the server is closed,
// and serves each on its own goroutine. It closes ln before returning. It
// returns nil after Close, ErrClosed if the server was already closed, and
// ln's error otherwise.
func (s *TCPServer) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.mu.closed {
		s.mu.Unlock()
		ln.Close()
		return ErrClosed
	}
	s.mu.lns[ln] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.mu.lns, ln)
		s.mu.Unlock()
		ln.Close()
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.mu.closed
			s.mu.Unlock()
			if closed {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("transfer: accept: %w", err)
		}
		if !s.track(c) {
			c.Close()
			return nil
		}
		go func() {
			defer s.wg.Done()
			defer s.untrack(c)
			s.serveConn(c)
		}()
	}
}

func (s *TCPServer) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.closed {
		return false
	}
	s.mu.conns[c] = struct{}{}
	s.wg.Add(1) // under mu, so never after Close's Wait began
	return true
}

func (s *TCPServer) untrack(c net.Conn) {
	s.mu.Lock()
	delete(s.mu.conns, c)
	s.mu.Unlock()
	c.Close()
}

// Close stops every Serve, closes every connection (requests in flight
// fail on both ends) and waits for the connection goroutines.
func (s *TCPServer) Close() error {
	s.mu.Lock()
	s.mu.closed = true
	for ln := range s.mu.lns {
		ln.Close()
	}
	for c := range s.mu.conns {
		c.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// serveConn authenticates c, then serves its requests until it fails or
// breaks the protocol. It does not close c.
func (s *TCPServer) serveConn(c net.Conn) {
	if err := s.handshake(c); err != nil {
		s.stats.authFail.Add(1)
		s.opts.Log("transfer: tcp: refused %v: %v", c.RemoteAddr(), err)
		return
	}
	var hb [headerSize]byte
	for {
		// An idle connection waits without a deadline; Close ends it.
		if err := c.SetDeadline(time.Time{}); err != nil {
			return
		}
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			return // the client went away; not an error worth a line
		}
		h, err := decodeHeader(hb[:])
		if err == nil && (h.op < opRead || h.op > opLastFrame) {
			err = fmt.Errorf("%w: %v after authentication", ErrProtocol, h.op)
		}
		if err != nil {
			s.stats.protoErr.Add(1)
			s.opts.Log("transfer: tcp: closing %v: %v", c.RemoteAddr(), err)
			return
		}
		if err := c.SetDeadline(time.Now().Add(s.opts.RequestTimeout)); err != nil {
			return
		}
		serve := s.serveRequest
		switch h.op {
		case opControl:
			serve = s.serveControl
		case opReadBody:
			serve = s.serveReadBody
		case opWriteResv:
			serve = s.serveWriteResv
		}
		if err := serve(c, h, hb[:]); err != nil {
			s.opts.Log("transfer: tcp: closing %v: %v %v: %v", c.RemoteAddr(), h.op, h.extent(), err)
			return
		}
	}
}

// serveRequest serves one read or write whose header is h, using hb as the
// response header's buffer. An error means the connection is unusable.
func (s *TCPServer) serveRequest(c net.Conn, h header, hb []byte) error {
	return s.serveData(c, h, hb, nil)
}

// serveData is serveRequest that calls landed (when not nil) once a
// write's payload is in memory (or discarded), before the response: the
// writer may act on the response at once (free part of its reservation,
// say), and the write must be over by then.
func (s *TCPServer) serveData(c net.Conn, h header, hb []byte, landed func()) error {
	s.stats.requests.Add(1)
	mem, rerr := s.opts.Local.Bytes(h.extent())
	if rerr == nil && uint64(len(mem)) != h.len {
		rerr = fmt.Errorf("resolver returned %d B for %d B", len(mem), h.len)
	}
	if rerr == nil && h.op == opWrite && s.opts.Writes != nil {
		rerr = fmt.Errorf("write of %v names no reservation: %w", h.extent(), ErrNotReserved)
	}
	resp := header{op: h.op, id: h.id, seg: h.seg, off: h.off}
	if rerr != nil {
		s.stats.bad.Add(1)
		resp.status = guardStatus(rerr)
	}
	switch h.op {
	case opRead:
		if rerr == nil {
			resp.len = h.len
		}
		putHeader(hb, resp)
		if _, err := c.Write(hb); err != nil || rerr != nil {
			return err
		}
		// Straight from segment memory: no staging copy. (Not writev with
		// the header: the race detector sees no happens-before edge
		// through writev, only through write.)
		if _, err := sendSegment(c, mem); err != nil {
			return err
		}
		s.stats.read.Add(h.len)
		return nil
	case opWrite, opWriteResv:
		if rerr != nil {
			// Keep the connection in step: the payload follows anyway.
			if _, err := io.CopyN(io.Discard, c, int64(h.len)); err != nil {
				return err
			}
		} else {
			if _, err := io.ReadFull(c, mem); err != nil {
				return err
			}
			s.stats.written.Add(h.len)
		}
		if landed != nil {
			landed()
		}
		putHeader(hb, resp)
		_, err := c.Write(hb)
		return err
	}
	return fmt.Errorf("%w: %v", ErrProtocol, h.op)
}

// handshake runs the server side of the challenge-response; see Transport.
func (s *TCPServer) handshake(c net.Conn) error {
	if err := c.SetDeadline(time.Now().Add(s.opts.AuthTimeout)); err != nil {
		return err
	}
	var msg [headerSize + 2*authLen]byte
	challenge := msg[headerSize : headerSize+authLen]
	rand.Read(challenge)
	putHeader(msg[:], header{op: opChallenge, len: authLen})
	if _, err := c.Write(msg[:headerSize+authLen]); err != nil {
		return err
	}
	var ch [authLen]byte
	copy(ch[:], challenge)

	if _, err := io.ReadFull(c, msg[:headerSize]); err != nil {
		return err
	}
	h, err := decodeHeader(msg[:headerSize])
	if err != nil {
		return err
	}
	if h.op != opProof || h.len != 2*authLen {
		return fmt.Errorf("%w: %v of %d B during handshake", ErrProtocol, h.op, h.len)
	}
	if _, err := io.ReadFull(c, msg[headerSize:]); err != nil {
		return err
	}
	proof, nonce := msg[headerSize:headerSize+authLen], msg[headerSize+authLen:]
	if !hmac.Equal(proof, authMAC(s.opts.Token, ch[:], nonce)) {
		return fmt.Errorf("%w: bad proof", ErrAuth)
	}
	var out [headerSize + authLen]byte
	putHeader(out[:], header{op: opAccept, id: h.id, off: s.opts.Epoch, len: authLen})
	copy(out[headerSize:], authMAC(s.opts.Token, nonce, ch[:]))
	_, err = c.Write(out[:])
	return err
}

// authMAC returns HMAC-SHA256(token, a || b).
func authMAC(token, a, b []byte) []byte {
	m := hmac.New(sha256.New, token)
	m.Write(a)
	m.Write(b)
	return m.Sum(nil)
}
