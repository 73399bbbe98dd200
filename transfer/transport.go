package transfer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// Transport moves bytes between local memory and an extent of a segment
// owned by another node: a one-sided read or write, served by the owning
// daemon without its client code taking part. TCPTransport is the
// implementation for nodes without RDMA.
//
// # TCP wire protocol, version 1
//
// Every message starts with a fixed 40-byte header, little-endian:
//
//	off size field
//	  0    4 magic    "MCFT" (0x5446434d as a uint32)
//	  4    1 version  1
//	  5    1 op       1 challenge, 2 proof, 3 accept, 4 read, 5 write,
//	                  6 control (control.go), 7 read-body (body.go),
//	                  8 write-resv (guard.go)
//	  6    2 flags    0 (any other value closes the connection)
//	  8    8 id       request id, echoed in the response
//	 16    4 segment  segment.ID on the serving node
//	 20    4 status   0 in requests; in responses 0 ok, else a statusXxx code
//	 24    8 offset   byte offset in the segment
//	 32    8 length   bytes that follow this header (payload), at most 1 GiB
//
// Authentication comes first; nothing else is served until it succeeds:
//
//	server -> client  challenge, length 32: a random 32-byte challenge C
//	client -> server  proof, length 64: HMAC-SHA256(token, C || N) || N,
//	                  where N is a random 32-byte client nonce
//	server -> client  accept, length 32: HMAC-SHA256(token, N || C); the
//	                  header's offset field carries the server's epoch
//
// Both sides prove they hold the cluster token without sending it; the two
// MACs cover their inputs in opposite orders, so neither can be replayed as
// the other. A server that rejects the proof closes the connection without
// answering; a peer that has not authenticated within the server's
// AuthTimeout is dropped.
//
// After that the client sends requests one at a time on a connection:
//
//	read   header{op 4, segment, offset, length}; no payload.
//	       Response: header{op 4, same id, status, length}; if status is 0,
//	       length bytes of the extent follow, written straight from
//	       segment memory.
//	write  header{op 5, segment, offset, length} + length bytes of payload.
//	       The server reads the payload straight into segment memory (a
//	       request it cannot serve has its payload read and discarded).
//	       Response: header{op 5, same id, status, length 0}.
//
// A request for an unknown segment or a range outside its segment gets an
// error status and the connection stays usable. A bad magic, version, op,
// flags or an over-long length is a protocol violation: the connection is
// closed. A write cut short leaves its extent partly written: the extent
// is not committed until the caller's write returns without error.
//
// Parallelism comes from several connections per peer, not from pipelining
// on one.
//
// Implementations are safe for concurrent use and borrow the caller's
// buffer only for the duration of a call.
//
// Every call names the node and the epoch (incarnation) of its daemon that
// the caller's extents belong to: a call that would reach another
// incarnation (the daemon restarted: its memory is new) fails with
// ErrStaleEpoch and moves nothing. Epoch 0 matches any.
type Transport interface {
	// ReadAt copies the remote extent e of node into dst; len(dst) must be
	// e.Len.
	ReadAt(ctx context.Context, node string, epoch uint64, e segment.Extent, dst []byte) error
	// WriteAt copies src into the remote extent e of node, which must lie
	// in node's reservation resv (0: none; see guard.go); len(src) must be
	// e.Len. An error may leave the extent partly written.
	WriteAt(ctx context.Context, node string, epoch, resv uint64, e segment.Extent, src []byte) error
	// Reserve asks node for n bytes of its segments, kept for ttl unless
	// renewed or committed (see control.go). The reservation carries the
	// epoch of the daemon that made it.
	Reserve(ctx context.Context, node string, n uint64, ttl time.Duration) (Reservation, error)
	// Renew extends reservation or hold id on node by ttl from now.
	Renew(ctx context.Context, node string, epoch, id uint64, ttl time.Duration) error
	// Free returns extents of reservation id (all of it when ext is empty).
	Free(ctx context.Context, node string, epoch, id uint64, ext []segment.Extent) error
	// Sync returns once node's view of the index includes revision rev.
	Sync(ctx context.Context, node string, rev uint64) error
	// Hold keeps node's body whose first extent is body, published at or
	// before version, from being freed for ttl, and returns the hold's id
	// (Renew extends it). ErrStaleBody: that body is gone.
	Hold(ctx context.Context, node string, epoch uint64, body segment.Extent, version uint64, ttl time.Duration) (uint64, error)
	// Release ends hold id on node.
	Release(ctx context.Context, node string, epoch, id uint64) error
	// ReadBody is ReadAt of an extent of the body whose first extent is
	// body, held at version: the owner refuses with ErrStaleBody once that
	// body was replaced or deleted (body.go).
	ReadBody(ctx context.Context, node string, epoch uint64, body segment.Extent, version uint64, e segment.Extent, dst []byte) error
	// Close closes every connection; later calls fail with ErrClosed.
	Close() error
}

var _ Transport = (*TCPTransport)(nil)

// Transport errors. Remote status codes come back as these (or as the
// segment package's ErrUnknownSegment / ErrBadRange), wrapped with the
// node and extent.
var (
	// ErrAuth means the peer did not prove it holds the cluster token (or
	// closed the connection during the handshake, which is how a server
	// refuses a bad proof).
	ErrAuth = errors.New("transfer: peer authentication failed")
	// ErrProtocol means a frame broke the wire protocol; the connection
	// carrying it is closed.
	ErrProtocol = errors.New("transfer: protocol violation")
	// ErrRemote means the serving node failed a request for a reason that
	// has no better sentinel.
	ErrRemote = errors.New("transfer: remote error")
	// ErrStaleEpoch means the node's daemon is not the incarnation the
	// caller's extents belong to: it restarted since.
	ErrStaleEpoch = errors.New("transfer: node restarted since (stale epoch)")
)

const (
	frameMagic   uint32 = 0x5446434d // "MCFT" on the wire
	frameVersion uint8  = 1
	headerSize          = 40
	// maxFrameLen bounds one frame's payload; TCPTransport splits larger
	// calls.
	maxFrameLen = 1 << 30
	authLen     = 32 // challenge, nonce and MAC sizes
)

type frameOp uint8

const (
	opChallenge frameOp = 1
	opProof     frameOp = 2
	opAccept    frameOp = 3
	opRead      frameOp = 4
	opWrite     frameOp = 5
)

func (o frameOp) String() string {
	switch o {
	case opChallenge:
		return "challenge"
	case opProof:
		return "proof"
	case opAccept:
		return "accept"
	case opRead:
		return "read"
	case opWrite:
		return "write"
	case opControl:
		return "control"
	case opReadBody:
		return "read-body"
	case opWriteResv:
		return "write-resv"
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// Status codes of responses.
const (
	statusOK             uint32 = 0
	statusUnknownSegment uint32 = 1
	statusBadRange       uint32 = 2
	statusInternal       uint32 = 3
)

// header is one decoded frame header. Magic, version and flags are checked
// by decodeHeader and not kept.
type header struct {
	op     frameOp
	id     uint64
	seg    segment.ID
	status uint32
	off    uint64
	len    uint64
}

func (h header) extent() segment.Extent {
	return segment.Extent{Segment: h.seg, Off: h.off, Len: h.len}
}

// putHeader encodes h into b[:headerSize].
func putHeader(b []byte, h header) {
	_ = b[headerSize-1]
	binary.LittleEndian.PutUint32(b[0:], frameMagic)
	b[4] = frameVersion
	b[5] = byte(h.op)
	binary.LittleEndian.PutUint16(b[6:], 0)
	binary.LittleEndian.PutUint64(b[8:], h.id)
	binary.LittleEndian.PutUint32(b[16:], uint32(h.seg))
	binary.LittleEndian.PutUint32(b[20:], h.status)
	binary.LittleEndian.PutUint64(b[24:], h.off)
	binary.LittleEndian.PutUint64(b[32:], h.len)
}

// decodeHeader decodes a frame header from the first headerSize bytes of b.
// Every error wraps ErrProtocol; it never panics.
func decodeHeader(b []byte) (header, error) {
	if len(b) < headerSize {
		return header{}, fmt.Errorf("%w: header of %d B, want %d", ErrProtocol, len(b), headerSize)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != frameMagic {
		return header{}, fmt.Errorf("%w: magic %#x", ErrProtocol, m)
	}
	if v := b[4]; v != frameVersion {
		return header{}, fmt.Errorf("%w: version %d, want %d", ErrProtocol, v, frameVersion)
	}
	op := frameOp(b[5])
	if op < opChallenge || op > opLastFrame {
		return header{}, fmt.Errorf("%w: unknown %v", ErrProtocol, op)
	}
	if f := binary.LittleEndian.Uint16(b[6:]); f != 0 {
		return header{}, fmt.Errorf("%w: flags %#x", ErrProtocol, f)
	}
	h := header{
		op:     op,
		id:     binary.LittleEndian.Uint64(b[8:]),
		seg:    segment.ID(binary.LittleEndian.Uint32(b[16:])),
		status: binary.LittleEndian.Uint32(b[20:]),
		off:    binary.LittleEndian.Uint64(b[24:]),
		len:    binary.LittleEndian.Uint64(b[32:]),
	}
	if h.len > maxFrameLen && !(op == opWriteResv && h.len <= maxFrameLen+resvIDLen) {
		return header{}, fmt.Errorf("%w: %v length %d B > %d B", ErrProtocol, op, h.len, maxFrameLen)
	}
	return h, nil
}

// statusOf maps a Resolver error to a status code.
func statusOf(err error) uint32 {
	switch {
	case errors.Is(err, segment.ErrUnknownSegment):
		return statusUnknownSegment
	case errors.Is(err, segment.ErrBadRange):
		return statusBadRange
	}
	return statusInternal
}

// statusErr maps a status code back to a sentinel.
func statusErr(s uint32) error {
	switch s {
	case statusUnknownSegment:
		return segment.ErrUnknownSegment
	case statusBadRange:
		return segment.ErrBadRange
	case statusStale:
		return ErrStaleBody
	case statusNotResv:
		return ErrNotReserved
	}
	return fmt.Errorf("status %d: %w", s, ErrRemote)
}
