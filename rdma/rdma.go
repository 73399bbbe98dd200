package rdma

import (
	"errors"
	"fmt"
)

// ErrUnavailable means RDMA cannot be used here: no library, no device,
// no active port. The wrapping error says which.
var ErrUnavailable = errors.New("rdma: RDMA unavailable")

// ErrClosed is the error of calls on a closed device, MR or QP.
var ErrClosed = errors.New("rdma: closed")

// Access is a set of memory-region access rights (ibv_access_flags).
type Access uint32

// Access rights; the values are the verbs ABI's.
const (
	AccessLocalWrite  Access = 1
	AccessRemoteWrite Access = 2
	AccessRemoteRead  Access = 4
)

// GID is a port's global identifier (an IPv6 address on RoCE).
type GID [16]byte

func (g GID) String() string {
	return fmt.Sprintf("%x:%x:%x:%x:%x:%x:%x:%x",
		uint16(g[0])<<8|uint16(g[1]), uint16(g[2])<<8|uint16(g[3]),
		uint16(g[4])<<8|uint16(g[5]), uint16(g[6])<<8|uint16(g[7]),
		uint16(g[8])<<8|uint16(g[9]), uint16(g[10])<<8|uint16(g[11]),
		uint16(g[12])<<8|uint16(g[13]), uint16(g[14])<<8|uint16(g[15]))
}

// DeviceInfo describes one device and the port the transport uses.
type DeviceInfo struct {
	Name      string // "mlx5_0"
	Port      uint8  // 1-based
	PortUp    bool   // IBV_PORT_ACTIVE
	LinkLayer string // "InfiniBand" or "Ethernet"
	LID       uint16
	GID       GID
	GIDIndex  int
	MTU       int    // active MTU in bytes
	NUMANode  int    // from sysfs; -1 when unknown
	PCI       string // bus id from sysfs ("0000:3b:00.0"); "" when unknown
}

// Provider lists and opens devices.
type Provider interface {
	// Name says which implementation this is ("libibverbs", "fake").
	Name() string
	// Devices lists the devices; an empty list is not an error.
	Devices() ([]DeviceInfo, error)
	// Open opens the named device with one protection domain.
	Open(name string) (Device, error)
}

// Device is an opened device and its protection domain. Safe for
// concurrent use.
type Device interface {
	Info() DeviceInfo
	// RegMR registers mem (which must stay mapped until the MR is closed;
	// not Go-heap memory on a real device) with the given rights. The
	// MR's address space is the process's virtual addresses.
	RegMR(mem []byte, access Access) (MR, error)
	// RegDmabufMR registers length bytes at offset of the dma-buf fd
	// (GPU memory exported by its driver), addressed from iova in work
	// requests. ErrUnavailable where the library or driver lacks it.
	RegDmabufMR(fd int, offset, length, iova uint64, access Access) (MR, error)
	// CreateQP creates an RC queue pair in the RESET state with its own
	// completion queue, able to hold depth outstanding work requests.
	CreateQP(depth int) (QP, error)
	// Close releases the protection domain and the device; MRs and QPs
	// must be closed first.
	Close() error
}

// MR is a registered memory region.
type MR interface {
	Addr() uint64 // the first address work requests use for it
	Len() uint64
	LKey() uint32
	RKey() uint32
	// Close deregisters the region; it waits for nothing, so the caller
	// must have no work request using it in flight.
	Close() error
}

// Endpoint is what a peer needs to connect to one QP.
type Endpoint struct {
	LID uint16
	GID GID
	QPN uint32
	PSN uint32 // first packet sequence number, 24 bits
	MTU int    // bytes; the connection uses the smaller of both ends'
	// ReadDepth is how many RDMA READs this end serves in flight as the
	// responder (max_dest_rd_atomic); the requester keeps no more
	// outstanding. 0: not said (the requester uses its own limit).
	ReadDepth int
}

// QPState is a queue pair's state (ibv_qp_state).
type QPState uint8

// Queue pair states; the values are the verbs ABI's.
const (
	QPReset QPState = iota
	QPInit
	QPRTR
	QPRTS
	QPSQD
	QPSQE
	QPError
)

func (s QPState) String() string {
	switch s {
	case QPReset:
		return "RESET"
	case QPInit:
		return "INIT"
	case QPRTR:
		return "RTR"
	case QPRTS:
		return "RTS"
	case QPSQD:
		return "SQD"
	case QPSQE:
		return "SQE"
	case QPError:
		return "ERR"
	}
	return fmt.Sprintf("state(%d)", uint8(s))
}

// Opcode is a work request's operation.
type Opcode uint8

const (
	// OpWrite is a one-sided RDMA WRITE: local SGEs to remote memory.
	OpWrite Opcode = iota
	// OpRead is a one-sided RDMA READ: remote memory to local SGEs.
	OpRead
)

func (o Opcode) String() string {
	if o == OpRead {
		return "RDMA_READ"
	}
	return "RDMA_WRITE"
}

// SGE is one local piece of a work request, in a registered MR.
type SGE struct {
	Addr uint64
	Len  uint32
	LKey uint32
}

// MaxSGE is the most SGEs one work request carries here.
const MaxSGE = 4

// WorkRequest is one RDMA WRITE or READ, always signaled.
type WorkRequest struct {
	ID     uint64
	Op     Opcode
	Local  []SGE // 1..MaxSGE
	Remote uint64
	RKey   uint32
}

// Bytes is the request's length.
func (w WorkRequest) Bytes() uint64 {
	var n uint64
	for _, s := range w.Local {
		n += uint64(s.Len)
	}
	return n
}

// Status is a work completion's status (ibv_wc_status).
type Status uint32

// Completion statuses used here; the values are the verbs ABI's.
const (
	StatusSuccess      Status = 0
	StatusLocLenErr    Status = 1
	StatusLocQPOpErr   Status = 2
	StatusLocProtErr   Status = 4
	StatusFlushErr     Status = 5
	StatusLocAccessErr Status = 8
	StatusRemInvReqErr Status = 9
	StatusRemAccessErr Status = 10
	StatusRemOpErr     Status = 11
	StatusRetryExcErr  Status = 12
	StatusFatalErr     Status = 19
	StatusGeneralErr   Status = 21
)

var statusNames = map[Status]string{
	StatusSuccess: "success", StatusLocLenErr: "local length error",
	StatusLocQPOpErr: "local QP operation error", StatusLocProtErr: "local protection error",
	StatusFlushErr: "work request flushed", StatusLocAccessErr: "local access error",
	StatusRemInvReqErr: "remote invalid request", StatusRemAccessErr: "remote access error",
	StatusRemOpErr: "remote operation error", StatusRetryExcErr: "transport retry counter exceeded",
	StatusFatalErr: "fatal error", StatusGeneralErr: "general error",
}

func (s Status) String() string {
	if n, ok := statusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("status %d", uint32(s))
}

// Completion is one work completion.
type Completion struct {
	ID     uint64
	Status Status
	Op     Opcode
	Bytes  uint32
	Vendor uint32 // vendor error code; 0 when none
}

// CompletionError is a failed completion as a Go error.
type CompletionError struct {
	Completion
}

func (e *CompletionError) Error() string {
	return fmt.Sprintf("rdma: %v of work request %d: %v (vendor %#x)", e.Op, e.ID, e.Status, e.Vendor)
}

// QP is a reliable-connected queue pair with its completion queue. Post
// and Poll may be called from different goroutines; the transport uses a
// QP from one goroutine at a time.
type QP interface {
	// Endpoint is what the peer connects to.
	Endpoint() Endpoint
	// Connect moves the QP from RESET through INIT and RTR to RTS,
	// connected to remote, with local and remote access for RDMA READ
	// and WRITE.
	Connect(remote Endpoint) error
	// Post queues the work requests, in order, with one doorbell. A
	// request that cannot be queued fails the call; the ones before it
	// are queued.
	Post(wrs []WorkRequest) error
	// Poll copies up to len(out) completions into out without blocking
	// and returns how many.
	Poll(out []Completion) (int, error)
	State() QPState
	// Close destroys the QP and its CQ; work in flight is lost.
	Close() error
}
