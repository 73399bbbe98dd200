package transfer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// Guarded writes. A writer on another node writes only into extents the
// owner reserved for it (control.go). A reservation the writer stopped
// renewing is freed by the owner and its extents go to other objects, so
// the owner does not trust the writer's clock: each write names its
// reservation, the owner admits it only while that reservation is live
// and covers the extent, and keeps the reservation from being reaped or
// freed until the write's last byte landed.
//
//	write-resv  header{op 8, segment, offset, length n+8} + 8 bytes: the
//	            reservation id + n bytes of payload.
//	            Response: as write (op 5, length 0), with op 8.
//
// An owner with a WriteGuard refuses plain writes (op 5) with an error
// status: every write into its memory must name a reservation.

const (
	opWriteResv   frameOp = 8
	opLastFrame           = opWriteResv
	resvIDLen             = 8
	statusNotResv uint32  = 8
)

// ErrNotReserved means a write named no live reservation of the writer's
// that covers its extent: the reservation expired, was freed or taken by
// a commit, or never held the extent.
var ErrNotReserved = errors.New("transfer: write outside a live reservation")

// WriteGuard admits writes into this node's segments (the store).
type WriteGuard interface {
	// BeginWrite admits a write of e into reservation resv, or fails with
	// ErrNotReserved. The reservation stays (neither reaped nor freed)
	// until done is called, once, after the write.
	BeginWrite(resv uint64, e segment.Extent) (done func(), err error)
}

// serveWriteResv serves one guarded write whose header is h.
func (s *TCPServer) serveWriteResv(c net.Conn, h header, hb []byte) error {
	if h.len < resvIDLen {
		return fmt.Errorf("%w: write-resv of %d B", ErrProtocol, h.len)
	}
	var ib [resvIDLen]byte
	if _, err := io.ReadFull(c, ib[:]); err != nil {
		return err
	}
	h.len -= resvIDLen
	resv := binary.LittleEndian.Uint64(ib[:])
	done := func() {}
	var rerr error
	if s.opts.Writes != nil {
		done, rerr = s.opts.Writes.BeginWrite(resv, h.extent())
	}
	if rerr != nil {
		s.stats.requests.Add(1)
		s.stats.bad.Add(1)
		if _, err := io.CopyN(io.Discard, c, int64(h.len)); err != nil {
			return err
		}
		putHeader(hb, header{op: h.op, id: h.id, seg: h.seg, off: h.off, status: guardStatus(rerr)})
		_, err := c.Write(hb)
		return err
	}
	// Ended once the bytes landed, before the response goes out (a free
	// the writer sends on seeing it must not find the write in flight),
	// or when the connection fails first.
	var once sync.Once
	end := func() { once.Do(done) }
	defer end()
	return s.serveData(c, h, hb, end)
}

func guardStatus(err error) uint32 {
	if errors.Is(err, ErrNotReserved) {
		return statusNotResv
	}
	return statusOf(err)
}
