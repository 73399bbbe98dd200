package transfer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// Checked reads. A reader on another node holds no lease on the owner's
// memory: the owner frees a body once it is replaced or deleted, and may
// reuse its extents for a new one. A checked read names the body it reads
// (its first extent) and the object version the reader holds; the owner
// serves it only while that body, published at that version or before, is
// still live, and otherwise answers ErrStaleBody. A read that passed the
// check holds the body until its last byte is sent: however long the
// stream takes, the memory is not freed (let alone reused) under it.
//
//	read-body  header{op 7, segment, offset, length 40} + payload:
//	             0  8 bytes to read
//	             8  4 body segment, 4 zero
//	            16  8 body offset
//	            24  8 body length
//	            32  8 version
//	           Response: as read (op 7).

const (
	opReadBody  frameOp = 7
	readBodyLen         = 40
	statusStale uint32  = 7
)

// ErrStaleBody means the body a checked read named was replaced or
// deleted (or never existed) on its node.
var ErrStaleBody = errors.New("transfer: the object was replaced or removed on its node")

// BodyChecker answers whether the body whose first extent is first, as
// published at version or before, is still live (the store), and if so
// keeps it from being freed until release is called (once).
type BodyChecker interface {
	CheckBody(ctx context.Context, first segment.Extent, version uint64) (release func(), err error)
}

type bodyCheck struct {
	body    segment.Extent
	version uint64
}

func putReadBody(b []byte, n uint64, c bodyCheck) {
	binary.LittleEndian.PutUint64(b[0:], n)
	binary.LittleEndian.PutUint32(b[8:], uint32(c.body.Segment))
	binary.LittleEndian.PutUint32(b[12:], 0)
	binary.LittleEndian.PutUint64(b[16:], c.body.Off)
	binary.LittleEndian.PutUint64(b[24:], c.body.Len)
	binary.LittleEndian.PutUint64(b[32:], c.version)
}

func decodeReadBody(b []byte) (uint64, bodyCheck, error) {
	if len(b) != readBodyLen || binary.LittleEndian.Uint32(b[12:]) != 0 {
		return 0, bodyCheck{}, fmt.Errorf("%w: read-body payload", ErrProtocol)
	}
	n := binary.LittleEndian.Uint64(b[0:])
	if n > maxFrameLen {
		return 0, bodyCheck{}, fmt.Errorf("%w: read-body of %d B", ErrProtocol, n)
	}
	return n, bodyCheck{
		body: segment.Extent{Segment: segment.ID(binary.LittleEndian.Uint32(b[8:])),
			Off: binary.LittleEndian.Uint64(b[16:]), Len: binary.LittleEndian.Uint64(b[24:])},
		version: binary.LittleEndian.Uint64(b[32:]),
	}, nil
}

// serveReadBody serves one checked read whose header is h.
func (s *TCPServer) serveReadBody(c net.Conn, h header, hb []byte) error {
	if h.len != readBodyLen {
		return fmt.Errorf("%w: read-body header length %d", ErrProtocol, h.len)
	}
	var pb [readBodyLen]byte
	if _, err := io.ReadFull(c, pb[:]); err != nil {
		return err
	}
	n, chk, err := decodeReadBody(pb[:])
	if err != nil {
		return err
	}
	s.stats.requests.Add(1)
	resp := header{op: opReadBody, id: h.id, seg: h.seg, off: h.off}
	e := segment.Extent{Segment: h.seg, Off: h.off, Len: n}
	mem, rerr := s.opts.Local.Bytes(e)
	if rerr == nil && uint64(len(mem)) != n {
		rerr = fmt.Errorf("resolver returned %d B for %d B", len(mem), n)
	}
	if rerr == nil {
		if s.opts.Bodies == nil {
			rerr = errors.New("this node checks no bodies")
		} else {
			ctx, cancel := context.WithTimeout(context.Background(), s.opts.RequestTimeout)
			var release func()
			release, rerr = s.opts.Bodies.CheckBody(ctx, chk.body, chk.version)
			cancel()
			if rerr == nil {
				defer release()
			}
		}
	}
	if rerr != nil {
		s.stats.bad.Add(1)
		resp.status = statusOf(rerr)
		if errors.Is(rerr, ErrStaleBody) {
			resp.status = statusStale
		}
	} else {
		resp.len = n
	}
	putHeader(hb, resp)
	if _, err := c.Write(hb); err != nil || rerr != nil {
		return err
	}
	if _, err := sendSegment(c, mem); err != nil {
		return err
	}
	s.stats.read.Add(n)
	return nil
}

// ReadBody implements Transport.
func (t *TCPTransport) ReadBody(ctx context.Context, node string, epoch uint64, body segment.Extent, version uint64, e segment.Extent, dst []byte) error {
	if uint64(len(dst)) != e.Len {
		return fmt.Errorf("transfer: tcp read %s %v into %d B: %w", node, e, len(dst), ErrBadRequest)
	}
	return t.callChecked(ctx, opReadBody, node, epoch, e, dst, &frameArg{chk: bodyCheck{body: body, version: version}})
}
