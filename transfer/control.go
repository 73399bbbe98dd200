package transfer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// Control calls: the small requests a writer sends to the node whose
// segments it wants to write into. They ride the same authenticated
// connections as reads and writes, as op 6:
//
//	control  header{op 6, length n} + n bytes of a ControlRequest in JSON
//	         (n <= 64 KiB). Response: header{op 6, same id, status,
//	         length m} + m bytes (m <= 1 MiB) of a ControlResponse in JSON when status
//	         is 0; an error status has no payload.
//
// Reservations are how remote allocation stays safe: the owner allocates
// extents for a writer and keeps them for TTL; every Renew extends that.
// Extents the writer commits are taken over by the owner when it sees the
// commit in the index; what is left when the TTL runs out is freed, so a
// writer that dies mid-write leaks nothing.
//
// Holds keep a replaced body readable: a node whose open reader's version
// was replaced or deleted asks the owner to hold that body (named by its
// first extent and the reader's version) for TTL; renewals extend it, a
// release or the TTL's end lets the owner free it.

// Control operations.
const (
	// CtlReserve allocates Bytes in the owner's segments for TTLMillis.
	CtlReserve = "reserve"
	// CtlRenew extends reservation or hold ID by TTLMillis from now.
	CtlRenew = "renew"
	// CtlFree frees Extents of reservation ID (all of it when Extents is
	// empty). Each extent must lie within one reserved extent.
	CtlFree = "free"
	// CtlSync answers once the node's view of the index includes
	// revision Rev: a committer waits for it so that its commit is seen
	// everywhere when it returns.
	CtlSync = "sync"
	// CtlHold keeps the body whose first extent is Extents[0], published
	// at or before Version, from being freed for TTLMillis; the answer's
	// ID names the hold for CtlRenew and CtlRelease. A body no longer
	// there is ErrStaleBody.
	CtlHold = "hold"
	// CtlRelease ends hold ID.
	CtlRelease = "release"
	// CtlRDMA exchanges RDMA endpoints: RDMA carries the caller's QPs,
	// the answer's RDMA the owner's and its segments' rkeys (rdma.go).
	// Served by the TCP server itself, where it has an RDMA path.
	CtlRDMA = "rdma"
	// CtlCheck answers whether the body whose first extent is
	// Extents[0], published at or before Version, is still live
	// (ErrStaleBody if not): the check after a one-sided read.
	CtlCheck = "check"
)

// ControlRequest is one control call.
type ControlRequest struct {
	Op        string           `json:"op"`
	ID        uint64           `json:"id,omitempty"`
	Bytes     uint64           `json:"bytes,omitempty"`
	TTLMillis int64            `json:"ttl_ms,omitempty"`
	Extents   []segment.Extent `json:"extents,omitempty"`
	Rev       uint64           `json:"rev,omitempty"`
	Version   uint64           `json:"version,omitempty"`
	RDMA      *RDMAHello       `json:"rdma,omitempty"`
}

// ControlResponse is the answer to a successful control call.
type ControlResponse struct {
	ID      uint64           `json:"id,omitempty"`
	Extents []segment.Extent `json:"extents,omitempty"`
	// TTLMillis is the lifetime a reserve or renew granted (the owner may
	// cap the one asked for); 0: as asked.
	TTLMillis int64      `json:"ttl_ms,omitempty"`
	RDMA      *RDMAHello `json:"rdma,omitempty"`
}

// Controller serves control calls on the owning node (the store).
type Controller interface {
	Control(ctx context.Context, req ControlRequest) (ControlResponse, error)
}

// Reservation is space reserved on a remote node for a writer.
type Reservation struct {
	Node    string
	Epoch   uint64 // of the daemon that reserved
	ID      uint64
	Extents []segment.Extent
}

// Errors of control calls.
var (
	// ErrNoSpace: the owner has no room for the reservation.
	ErrNoSpace = errors.New("transfer: no space on the remote node")
	// ErrUnknownReservation: the reservation expired, was freed, or the
	// owner restarted.
	ErrUnknownReservation = errors.New("transfer: unknown reservation")
	// ErrIndexUnavailable: the owner is full and could not make room,
	// its shared index (etcd) not answering: worth another try later,
	// unlike ErrNoSpace.
	ErrIndexUnavailable = errors.New("transfer: the remote node's index is unavailable")
)

const (
	maxControlLen = 64 << 10
	// maxControlResp bounds an answer: an RDMA hello lists every segment.
	maxControlResp         = 1 << 20
	opControl      frameOp = 6
)

// More status codes, for control calls.
const (
	statusNoSpace            uint32 = 4
	statusUnknownReservation uint32 = 5
	statusBadControl         uint32 = 6
	// 7 and 8: statusStale (body.go), statusNotResv (guard.go).
	statusIndexUnavailable uint32 = 9
)

func controlStatus(err error) uint32 {
	switch {
	case errors.Is(err, ErrIndexUnavailable):
		return statusIndexUnavailable
	case errors.Is(err, ErrNoSpace):
		return statusNoSpace
	case errors.Is(err, ErrUnknownReservation):
		return statusUnknownReservation
	case errors.Is(err, ErrBadRequest):
		return statusBadControl
	case errors.Is(err, ErrStaleBody):
		return statusStale
	}
	return statusOf(err)
}

// decodeControl parses a control payload strictly: unknown fields, a
// trailing document or an unknown op are ErrBadRequest.
func decodeControl(b []byte) (ControlRequest, error) {
	var req ControlRequest
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return req, fmt.Errorf("%w: control payload: %v", ErrBadRequest, err)
	}
	if dec.More() {
		return req, fmt.Errorf("%w: control payload has trailing data", ErrBadRequest)
	}
	switch req.Op {
	case CtlReserve:
		if req.Bytes == 0 || req.TTLMillis <= 0 {
			return req, fmt.Errorf("%w: reserve of %d B for %d ms", ErrBadRequest, req.Bytes, req.TTLMillis)
		}
	case CtlRenew:
		if req.TTLMillis <= 0 {
			return req, fmt.Errorf("%w: renew for %d ms", ErrBadRequest, req.TTLMillis)
		}
	case CtlFree:
	case CtlHold:
		if len(req.Extents) != 1 || req.Extents[0].Len == 0 || req.Version == 0 || req.TTLMillis <= 0 {
			return req, fmt.Errorf("%w: hold of %d extents at version %d for %d ms", ErrBadRequest, len(req.Extents), req.Version, req.TTLMillis)
		}
	case CtlRelease:
		if req.ID == 0 {
			return req, fmt.Errorf("%w: release of hold 0", ErrBadRequest)
		}
	case CtlSync:
		if req.Rev == 0 {
			return req, fmt.Errorf("%w: sync to revision 0", ErrBadRequest)
		}
	case CtlRDMA:
		if err := req.RDMA.validate(); err != nil {
			return req, err
		}
	case CtlCheck:
		if len(req.Extents) != 1 || req.Extents[0].Len == 0 || req.Version == 0 {
			return req, fmt.Errorf("%w: check of %d extents at version %d", ErrBadRequest, len(req.Extents), req.Version)
		}
	default:
		return req, fmt.Errorf("%w: control op %q", ErrBadRequest, req.Op)
	}
	if req.Op != CtlRDMA && req.RDMA != nil {
		return req, fmt.Errorf("%w: %s call carries an rdma hello", ErrBadRequest, req.Op)
	}
	return req, nil
}

// serveControl answers one control call whose header is h.
func (s *TCPServer) serveControl(c net.Conn, h header, hb []byte) error {
	if h.len > maxControlLen {
		return fmt.Errorf("%w: control payload of %d B > %d B", ErrProtocol, h.len, maxControlLen)
	}
	payload := make([]byte, h.len)
	if _, err := io.ReadFull(c, payload); err != nil {
		return err
	}
	resp := header{op: opControl, id: h.id}
	var out []byte
	req, err := decodeControl(payload)
	if err == nil && (req.Op == CtlRDMA || req.Op == CtlCheck) {
		out, err = s.serveOwn(req)
	} else if err == nil && s.opts.Control == nil {
		err = fmt.Errorf("%w: this node takes no control calls", ErrBadRequest)
	} else if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), s.opts.RequestTimeout)
		var r ControlResponse
		r, err = s.opts.Control.Control(ctx, req)
		cancel()
		if err == nil {
			out, err = json.Marshal(r)
		}
	}
	if err != nil {
		s.stats.bad.Add(1)
		resp.status = controlStatus(err)
		// A renewal of a reservation this node no longer has is how a
		// writer learns that its commit was taken over (or that it was
		// cut off, which the writer reports): one a remote put, not news.
		if req.Op != CtlRenew || !errors.Is(err, ErrUnknownReservation) {
			s.opts.Log("transfer: tcp: control %s from %v: %v", req.Op, c.RemoteAddr(), err)
		}
	} else {
		resp.len = uint64(len(out))
	}
	putHeader(hb, resp)
	if _, err := c.Write(append(hb[:headerSize:headerSize], out...)); err != nil {
		return err
	}
	return nil
}

// serveOwn answers the control calls the server serves itself.
func (s *TCPServer) serveOwn(req ControlRequest) ([]byte, error) {
	var r ControlResponse
	switch {
	case req.Op == CtlRDMA && s.opts.RDMA == nil:
		return nil, fmt.Errorf("%w: this node has no RDMA", ErrBadRequest)
	case req.Op == CtlRDMA:
		h, err := s.opts.RDMA.accept(req.RDMA)
		if err != nil {
			return nil, err
		}
		r.RDMA = h
	case s.opts.Bodies == nil:
		return nil, fmt.Errorf("%w: this node checks no bodies", ErrBadRequest)
	default:
		ctx, cancel := context.WithTimeout(context.Background(), s.opts.RequestTimeout)
		release, err := s.opts.Bodies.CheckBody(ctx, req.Extents[0], req.Version)
		cancel()
		if err != nil {
			return nil, err
		}
		release()
	}
	return json.Marshal(r)
}

// Control sends one control call to node's daemon of the given epoch (0:
// any) and returns its answer and the daemon's epoch.
func (t *TCPTransport) Control(ctx context.Context, node string, epoch uint64, req ControlRequest) (ControlResponse, uint64, error) {
	var resp ControlResponse
	body, err := json.Marshal(req)
	if err != nil {
		return resp, 0, err
	}
	if len(body) > maxControlLen {
		return resp, 0, fmt.Errorf("transfer: control %s of %d B: %w", req.Op, len(body), ErrBadRequest)
	}
	ctx, cancel := context.WithTimeout(ctx, t.opts.Timeout)
	defer cancel()
	p, err := t.peer(node)
	if err != nil {
		return resp, 0, err
	}
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return resp, 0, fmt.Errorf("transfer: tcp control %s %s: %w", req.Op, node, ctx.Err())
	}
	defer func() { <-p.slots }()
	var out []byte
	var got uint64
	// Control calls are not idempotent (a reserve twice reserves twice),
	// so a dead pooled connection is retried only when the request
	// cannot have reached the peer: the write of the request failed.
	for attempt := 0; ; attempt++ {
		var reused, broken, sent bool
		got, reused, broken, err = t.onConn(ctx, p, epoch, func(pc *tcpConn) (bool, error) {
			var broken bool
			var err error
			out, sent, broken, err = pc.control(body)
			return broken, err
		})
		if err != nil && broken && reused && !sent && attempt == 0 && ctx.Err() == nil {
			continue
		}
		if err != nil {
			return resp, 0, fmt.Errorf("transfer: tcp control %s %s: %w", req.Op, node, err)
		}
		break
	}
	if err := json.Unmarshal(out, &resp); err != nil {
		return resp, 0, fmt.Errorf("transfer: tcp control %s %s: %w: response: %v", req.Op, node, ErrProtocol, err)
	}
	return resp, got, nil
}

// control runs one control round trip. sent reports that the request
// reached the socket.
func (pc *tcpConn) control(body []byte) (out []byte, sent, broken bool, err error) {
	pc.nextID++
	req := header{op: opControl, id: pc.nextID, len: uint64(len(body))}
	msg := make([]byte, headerSize, headerSize+len(body))
	putHeader(msg, req)
	msg = append(msg, body...)
	if _, err := pc.c.Write(msg); err != nil {
		return nil, false, true, err
	}
	var hb [headerSize]byte
	if _, err := io.ReadFull(pc.c, hb[:]); err != nil {
		return nil, true, true, err
	}
	h, err := decodeHeader(hb[:])
	if err != nil {
		return nil, true, true, err
	}
	if h.op != opControl || h.id != req.id {
		return nil, true, true, fmt.Errorf("%w: response %v #%d to control #%d", ErrProtocol, h.op, h.id, req.id)
	}
	if h.status != statusOK {
		if h.len != 0 {
			return nil, true, true, fmt.Errorf("%w: error status with %d B payload", ErrProtocol, h.len)
		}
		return nil, true, false, controlErr(h.status)
	}
	if h.len > maxControlResp {
		return nil, true, true, fmt.Errorf("%w: control response of %d B", ErrProtocol, h.len)
	}
	out = make([]byte, h.len)
	if _, err := io.ReadFull(pc.c, out); err != nil {
		return nil, true, true, err
	}
	return out, true, false, nil
}

func controlErr(s uint32) error {
	switch s {
	case statusNoSpace:
		return ErrNoSpace
	case statusUnknownReservation:
		return ErrUnknownReservation
	case statusBadControl:
		return ErrBadRequest
	case statusIndexUnavailable:
		return ErrIndexUnavailable
	}
	return statusErr(s)
}

// Reserve asks node for n bytes kept for ttl.
func (t *TCPTransport) Reserve(ctx context.Context, node string, n uint64, ttl time.Duration) (Reservation, error) {
	sent := time.Now()
	r, epoch, err := t.Control(ctx, node, 0, ControlRequest{Op: CtlReserve, Bytes: n, TTLMillis: max(ttl.Milliseconds(), 1)})
	if err != nil {
		return Reservation{}, err
	}
	if segment.TotalLen(r.Extents) < n {
		return Reservation{}, fmt.Errorf("transfer: reserve %d B on %s: got %d B: %w", n, node, segment.TotalLen(r.Extents), ErrProtocol)
	}
	t.leases.reserved(leaseKey{node, epoch, r.ID}, sent.Add(granted(ttl, r.TTLMillis)), r.Extents)
	return Reservation{Node: node, Epoch: epoch, ID: r.ID, Extents: r.Extents}, nil
}

// granted is the lifetime a reserve or renew got: what the owner said,
// else what was asked (truncated to milliseconds, as sent).
func granted(asked time.Duration, ms int64) time.Duration {
	if ms > 0 {
		return min(time.Duration(ms)*time.Millisecond, asked.Truncate(time.Millisecond))
	}
	return asked.Truncate(time.Millisecond)
}

// Renew extends reservation or hold id on node by ttl from now.
func (t *TCPTransport) Renew(ctx context.Context, node string, epoch, id uint64, ttl time.Duration) error {
	sent := time.Now()
	r, got, err := t.Control(ctx, node, epoch, ControlRequest{Op: CtlRenew, ID: id, TTLMillis: max(ttl.Milliseconds(), 1)})
	switch {
	case err == nil:
		t.leases.renewed(leaseKey{node, got, id}, sent.Add(granted(ttl, r.TTLMillis)))
	case errors.Is(err, ErrUnknownReservation):
		t.leases.forget(leaseKey{node, epoch, id}) // the owner no longer has it
	}
	return err
}

// Hold asks node to keep the body whose first extent is body, at version,
// for ttl (see CtlHold).
func (t *TCPTransport) Hold(ctx context.Context, node string, epoch uint64, body segment.Extent, version uint64, ttl time.Duration) (uint64, error) {
	r, _, err := t.Control(ctx, node, epoch, ControlRequest{Op: CtlHold, Extents: []segment.Extent{body}, Version: version,
		TTLMillis: max(ttl.Milliseconds(), 1)})
	if err == nil && r.ID == 0 {
		err = fmt.Errorf("transfer: hold on %s: no id: %w", node, ErrProtocol)
	}
	return r.ID, err
}

// Release ends hold id on node.
func (t *TCPTransport) Release(ctx context.Context, node string, epoch, id uint64) error {
	_, _, err := t.Control(ctx, node, epoch, ControlRequest{Op: CtlRelease, ID: id})
	return err
}

// Sync returns once node's view of the index includes revision rev.
func (t *TCPTransport) Sync(ctx context.Context, node string, rev uint64) error {
	_, _, err := t.Control(ctx, node, 0, ControlRequest{Op: CtlSync, Rev: rev})
	return err
}

// Free returns extents of reservation id on node (all of it when ext is
// empty).
func (t *TCPTransport) Free(ctx context.Context, node string, epoch, id uint64, ext []segment.Extent) error {
	// Freed in part or whole: this writer vouches for none of it now.
	t.leases.forget(leaseKey{node, epoch, id})
	_, _, err := t.Control(ctx, node, epoch, ControlRequest{Op: CtlFree, ID: id, Extents: ext})
	return err
}

// Lease ends of reservations, as the writer knows them: the time it sent
// the Reserve or the last Renew, plus the TTL granted, and the extents
// reserved. The owner counts the TTL from when it received the call, so
// its end is later; writes that the owner's CPU does not check (RDMA)
// are fenced by this one (rdma.go). A reservation freed in part is
// forgotten: its writes go where the owner checks them.

type leaseKey struct {
	node      string
	epoch, id uint64
}

type lease struct {
	end time.Time
	ext []segment.Extent
}

type leaseBook struct {
	mu    sync.Mutex
	m     map[leaseKey]*lease
	prune int // size at which expired entries are swept
}

func (b *leaseBook) reserved(k leaseKey, end time.Time, ext []segment.Extent) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.m == nil {
		b.m = map[leaseKey]*lease{}
	}
	b.m[k] = &lease{end: end, ext: append([]segment.Extent(nil), ext...)}
	if len(b.m) >= max(b.prune, 64) {
		now := time.Now()
		for k, l := range b.m {
			if l.end.Before(now) {
				delete(b.m, k)
			}
		}
		b.prune = 2 * len(b.m)
	}
}

// renewed records a renewal of k, if the book holds it (holds share the
// id space and are not in it). The owner's deadline is its receipt of
// the last renewal it processed plus the TTL: overwriting with this
// call's is never later than that.
func (b *leaseBook) renewed(k leaseKey, end time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if l := b.m[k]; l != nil {
		l.end = end
	}
}

func (b *leaseBook) forget(k leaseKey) {
	b.mu.Lock()
	delete(b.m, k)
	b.mu.Unlock()
}

// leaseEnd returns when reservation id of node's epoch ends, as far as
// this writer knows, if e lies in one of its extents.
func (t *TCPTransport) leaseEnd(node string, epoch, id uint64, e segment.Extent) (time.Time, bool) {
	t.leases.mu.Lock()
	defer t.leases.mu.Unlock()
	l := t.leases.m[leaseKey{node, epoch, id}]
	if l == nil {
		return time.Time{}, false
	}
	for _, x := range l.ext {
		if x.Segment == e.Segment && e.Off >= x.Off && e.Len <= x.Len && e.Off-x.Off <= x.Len-e.Len {
			return l.end, true
		}
	}
	return time.Time{}, false
}
