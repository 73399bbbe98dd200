package transfer

import (
	"fmt"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// Op is the direction of a request.
type Op uint8

const (
	// Read copies from the extent into the buffer.
	Read Op = iota
	// Write copies from the buffer into the extent.
	Write
)

func (o Op) String() string {
	if o == Read {
		return "read"
	}
	return "write"
}

// Kind says what memory a Buffer is.
type Kind uint8

const (
	// Host is ordinary memory of this process.
	Host Kind = iota
	// Registered is host memory shared with a client and registered once
	// (a memfd or shm mapping); it is copied like Host.
	Registered
)

func (k Kind) String() string {
	switch k {
	case Host:
		return "host"
	case Registered:
		return "registered"
	}
	return fmt.Sprintf("kind(%d)", k)
}

// Buffer is local memory taking part in a transfer. The engine borrows Mem
// for the duration of Submit and keeps no reference afterwards.
type Buffer struct {
	Kind Kind
	Mem  []byte
}

// HostBuffer wraps b as a Host buffer.
func HostBuffer(b []byte) Buffer { return Buffer{Kind: Host, Mem: b} }

// Request copies Extent.Len bytes between Buf[BufOff:] and Extent.
type Request struct {
	Op     Op
	Buf    Buffer
	BufOff uint64
	Extent segment.Extent
}

func (r Request) validate() error {
	if r.BufOff > uint64(len(r.Buf.Mem)) || r.Extent.Len > uint64(len(r.Buf.Mem))-r.BufOff {
		return fmt.Errorf("%v %d B at buffer offset %d of %d B: %w",
			r.Op, r.Extent.Len, r.BufOff, len(r.Buf.Mem), ErrBadRequest)
	}
	return nil
}
