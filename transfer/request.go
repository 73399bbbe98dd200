package transfer

import (
	"fmt"

	"github.com/mooncake-fs/mooncake-fs/cuda"

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
	// ProcessVM is memory of another process, named by Pid and Addr: it is
	// copied with process_vm_readv/writev, straight between that process
	// and the segment (one copy, no staging).
	ProcessVM
	// CUDA is GPU memory, named by Ctx and Dev: copied by the GPU's copy
	// engine straight between it and the (pinned) segment.
	CUDA
)

func (k Kind) String() string {
	switch k {
	case Host:
		return "host"
	case Registered:
		return "registered"
	case ProcessVM:
		return "process-vm"
	case CUDA:
		return "cuda"
	}
	return fmt.Sprintf("kind(%d)", k)
}

// Buffer is local memory taking part in a transfer. The engine borrows Mem
// for the duration of Submit and keeps no reference afterwards.
type Buffer struct {
	Kind Kind
	Mem  []byte // Host and Registered
	// ProcessVM: the process and the address range [Addr, Addr+Len).
	Pid  int
	Addr uint64
	Len  uint64
	// CUDA: the device memory [Dev, Dev+Len) in the context of its GPU,
	// inside the allocation (or IPC mapping) at Alloc when Alloc is not 0:
	// copies of neighbouring ranges of one allocation may merge.
	Ctx   *cuda.Context
	Dev   cuda.DevicePtr
	Alloc cuda.DevicePtr
}

// Size returns the buffer's length.
func (b Buffer) Size() uint64 {
	if b.Kind == ProcessVM || b.Kind == CUDA {
		return b.Len
	}
	return uint64(len(b.Mem))
}

// CUDABuffer names n bytes of device memory at dev.
func CUDABuffer(ctx *cuda.Context, dev cuda.DevicePtr, n uint64) Buffer {
	return Buffer{Kind: CUDA, Ctx: ctx, Dev: dev, Len: n}
}

// CUDAAllocBuffer names n bytes at off in the allocation (or IPC
// mapping) that starts at base.
func CUDAAllocBuffer(ctx *cuda.Context, base cuda.DevicePtr, off, n uint64) Buffer {
	return Buffer{Kind: CUDA, Ctx: ctx, Dev: base + cuda.DevicePtr(off), Len: n, Alloc: base}
}

// VMBuffer names Len bytes at Addr in process pid.
func VMBuffer(pid int, addr, n uint64) Buffer {
	return Buffer{Kind: ProcessVM, Pid: pid, Addr: addr, Len: n}
}

// HostBuffer wraps b as a Host buffer.
func HostBuffer(b []byte) Buffer { return Buffer{Kind: Host, Mem: b} }

// Request copies Extent.Len bytes between Buf[BufOff:] and Extent.
type Request struct {
	Op     Op
	Buf    Buffer
	BufOff uint64
	Extent segment.Extent
	// Node owns Extent's segment: "" or the engine's own node for local
	// segments, any other name for a segment reached through the
	// engine's Transport.
	Node string
	// Epoch is the incarnation of Node's daemon the extent belongs to (0:
	// any); see Transport.
	Epoch uint64
	// Version, when not 0, makes a read of another node's extent a checked
	// read of the body whose first extent is Body, held at Version: it
	// fails with ErrStaleBody once the owner replaced or freed it.
	Body    segment.Extent
	Version uint64
	// Resv names the reservation on Node that a write of another node's
	// extent goes into; its owner refuses writes that no live
	// reservation of the writer covers (guard.go). 0: none (refused by
	// owners that guard writes).
	Resv uint64
}

func (r Request) validate() error {
	n := r.Buf.Size()
	if r.BufOff > n || r.Extent.Len > n-r.BufOff {
		return fmt.Errorf("%v %d B at buffer offset %d of %d B: %w",
			r.Op, r.Extent.Len, r.BufOff, n, ErrBadRequest)
	}
	if r.Buf.Kind == CUDA && (r.Buf.Ctx == nil || uint64(r.Buf.Dev)+n < uint64(r.Buf.Dev)) {
		return fmt.Errorf("device range %#x+%d: %w", r.Buf.Dev, n, ErrBadRequest)
	}
	if r.Buf.Kind == ProcessVM && r.Buf.Addr+n < r.Buf.Addr {
		return fmt.Errorf("address range %#x+%d wraps: %w", r.Buf.Addr, n, ErrBadRequest)
	}
	return nil
}
