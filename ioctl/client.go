package ioctl

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Errors of the client.
var (
	// ErrNotMooncake is returned by Probe for files of other file systems.
	ErrNotMooncake = errors.New("ioctl: not a mooncake-fs file")
	// ErrBadKey is a batch key that is empty or cannot fit in one batch.
	ErrBadKey = errors.New("ioctl: bad batch key")
	// ErrBadItem is a batch item whose source does not match the call
	// (Data for the VM forms, BufOff/Len for the buffer forms).
	ErrBadItem = errors.New("ioctl: bad batch item")
)

// call issues cmd on f with arg as the in/out buffer, once: the daemon
// finishes every request it started, so a signal never leaves one half
// done to retry.
func call(f *os.File, cmd uint32, arg []byte) error {
	_, err := callResult(f, cmd, arg)
	return err
}

// callResult is call returning the ioctl's value (BATCH_PUTV's and
// BATCH_GETV's call number with VBatchAsync).
func callResult(f *os.File, cmd uint32, arg []byte) (int, error) {
	if uint32(len(arg)) != Size(cmd) {
		return 0, fmt.Errorf("ioctl %#x: buffer %d B, command wants %d: %w", cmd, len(arg), Size(cmd), ErrArgSize)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var r uintptr
	var errno unix.Errno
	cerr := rc.Control(func(fd uintptr) {
		r, _, errno = unix.Syscall(unix.SYS_IOCTL, fd, uintptr(cmd), uintptr(unsafe.Pointer(&arg[0])))
	})
	if cerr != nil {
		return 0, cerr
	}
	if errno != 0 {
		return 0, errno
	}
	return int(int32(r)), nil
}

// Probe checks that f is on mooncake-fs and returns the daemon's ABI
// version.
func Probe(f *os.File) (ABIVersionArg, error) {
	b := MagicArg{}.Marshal()
	if err := call(f, CmdGetMagic, b); err != nil {
		if errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
			return ABIVersionArg{}, fmt.Errorf("%s: %w", f.Name(), ErrNotMooncake)
		}
		return ABIVersionArg{}, err
	}
	var m MagicArg
	if err := m.Unmarshal(b); err != nil || m.Magic != MagicValue {
		return ABIVersionArg{}, fmt.Errorf("%s: magic %#x: %w", f.Name(), m.Magic, ErrNotMooncake)
	}
	v := ABIVersionArg{}.Marshal()
	if err := call(f, CmdGetABIVersion, v); err != nil {
		return ABIVersionArg{}, err
	}
	var a ABIVersionArg
	if err := a.Unmarshal(v); err != nil {
		return ABIVersionArg{}, err
	}
	return a, nil
}

// File is a file or directory on a mooncake-fs mount, open for the
// data-path commands. The methods on a file act on its key; the batch
// methods need a directory (OpenDir) and take keys relative to it.
//
// Registrations made on a File belong to its open file description: they
// serve only this File's commands and die with Close. A File is safe for
// concurrent use.
//
// Errors name the command and the path and wrap the daemon's errno, so
// errors.Is(err, unix.EEXIST) works.
type File struct {
	f    *os.File
	path string
	// oldABI is set once the daemon answered a table call with ENOTTY
	// (before ABI 1.8): batches go as BATCH_PUT/BATCH_GET calls.
	oldABI atomic.Bool
	// noInline is set once the daemon answered a KEY_INLINE call with
	// ENOTTY (before ABI 1.9): small keys go by address.
	noInline atomic.Bool
}

// Open opens path with flag (os.O_RDONLY, os.O_RDWR|os.O_CREATE, ...),
// creating it with mode 0644 if flag asks. Puts need a writable File; a
// File opened read-only reads the version current at open for as long as
// it stays open. Open does not probe: a file of another file system fails
// its first command with ENOTTY (use Probe to ask first).
func Open(path string, flag int) (*File, error) {
	f, err := os.OpenFile(path, flag, 0o644)
	if err != nil {
		return nil, err
	}
	return &File{f: f, path: path}, nil
}

// OpenDir opens the directory path for the batch commands.
func OpenDir(path string) (*File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, err
	}
	return &File{f: f, path: path}, nil
}

// NewFile wraps an open file; the File takes ownership of f.
func NewFile(f *os.File) *File { return &File{f: f, path: f.Name()} }

// Name returns the path the File was opened with.
func (f *File) Name() string { return f.path }

// OS returns the underlying *os.File, still owned by f.
func (f *File) OS() *os.File { return f.f }

// Close closes the file; its registrations die with it.
func (f *File) Close() error { return f.f.Close() }

// Probe checks that f is on mooncake-fs and returns the daemon's ABI
// version.
func (f *File) Probe() (ABIVersionArg, error) { return Probe(f.f) }

// err wraps a failed command with what it was asked to do.
func (f *File) err(op string, err error, detail string, args ...any) error {
	if detail != "" {
		return fmt.Errorf("ioctl: %s %s (%s): %w", op, f.path, fmt.Sprintf(detail, args...), err)
	}
	return fmt.Errorf("ioctl: %s %s: %w", op, f.path, err)
}

// Registration is caller memory registered with the daemon on one File.
type Registration struct {
	ID     uint64 // the buffer id of PUT_BUF, GET_BUF and batches
	Offset uint64 // where the registration starts in the memfd
	Len    uint64
}

// Register registers n bytes of mem (a memfd or /dev/shm file, opened
// read-write and at least off+n bytes long) from offset off, which must be
// page aligned. The daemon maps the same pages; mem may be closed after
// Register returns.
func (f *File) Register(mem *os.File, off, n uint64) (Registration, error) {
	rc, err := mem.SyscallConn()
	if err != nil {
		return Registration{}, f.err("register_buffer", err, "")
	}
	var reg Registration
	cerr := rc.Control(func(fd uintptr) { reg, err = f.RegisterFd(int(fd), off, n) })
	if cerr != nil {
		return Registration{}, f.err("register_buffer", cerr, "")
	}
	return reg, err
}

// RegisterFd is Register for a file descriptor number of this process.
func (f *File) RegisterFd(fd int, off, n uint64) (Registration, error) {
	return f.register(RegisterArg{Fd: int32(fd), Kind: KindHost, Len: n, Offset: off}, fmt.Sprintf("fd %d", fd))
}

// RegisterCUDA registers n bytes at off of the CUDA allocation whose IPC
// handle is h (cuIpcGetMemHandle) on f: PUT_BUF, GET_BUF and batches then
// copy between that GPU memory and the store.
func (f *File) RegisterCUDA(h [64]byte, off, n uint64) (Registration, error) {
	return f.register(RegisterArg{Fd: -1, Kind: KindCUDA, Len: n, Offset: off, Handle: h}, "cuda")
}

// RegisterCUDADmabuf is RegisterCUDA with dmabuf, a dma-buf descriptor of
// this process exporting the whole allocation (RegisterDmabuf, ABI 1.5):
// the daemon registers it with its RDMA devices, so that remote transfers
// of the buffer go NIC to GPU. f keeps no use of dmabuf once it returns.
func (f *File) RegisterCUDADmabuf(h [64]byte, dmabuf int, off, n uint64) (Registration, error) {
	a := RegisterArg{Fd: int32(dmabuf), Kind: KindCUDA, Len: n, Offset: off, Handle: h}
	a.Flags = RegisterDmabuf
	return f.register(a, fmt.Sprintf("cuda, dma-buf %d", dmabuf))
}

// RegisterAddr registers b, memory of this process that is not a memfd
// (KindVM): only this process may use the registration, and b must stay
// mapped while it does (EFAULT otherwise).
func (f *File) RegisterAddr(b []byte) (Registration, error) {
	keepOnHeap(b)
	return f.register(RegisterArg{Fd: -1, Kind: KindVM, Len: uint64(len(b)), Offset: addrOf(b)}, "address")
}

func (f *File) register(a RegisterArg, what string) (Registration, error) {
	b := a.Marshal()
	if err := call(f.f, CmdRegisterBuffer, b); err != nil {
		return Registration{}, f.err("register_buffer", err, "%s, %d B at %#x", what, a.Len, a.Offset)
	}
	off := a.Offset
	if err := a.Unmarshal(b); err != nil {
		return Registration{}, f.err("register_buffer", err, "reply")
	}
	return Registration{ID: a.ID, Offset: off, Len: a.Len}, nil
}

// Unregister releases registration id of f.
func (f *File) Unregister(id uint64) error {
	a := UnregisterArg{ID: id}
	if err := call(f.f, CmdUnregisterBuffer, a.Marshal()); err != nil {
		return f.err("unregister_buffer", err, "id %d", id)
	}
	return nil
}

// bufCall runs PUT_BUF or GET_BUF.
func (f *File) bufCall(op string, cmd uint32, a BufArg) (n, version uint64, err error) {
	b := a.Marshal()
	if err := call(f.f, cmd, b); err != nil {
		return 0, 0, f.err(op, err, "id %d, %d B at buf %d, obj %d, flags %#x", a.ID, a.Len, a.BufOff, a.ObjOff, a.Flags)
	}
	if err := a.Unmarshal(b); err != nil {
		return 0, 0, f.err(op, err, "reply")
	}
	return a.Result, a.Version, nil
}

// PutBuf stores n bytes of registration id, from bufOff, with one copy:
// as the whole new value of f's key (objOff 0), or with FlagUpdate at
// objOff into a copy of the current value. FlagExcl fails with EEXIST
// unless the key was empty and unchanged since f was opened. The new
// version becomes visible atomically. It returns the bytes stored and the
// version written.
func (f *File) PutBuf(id, bufOff, n, objOff uint64, flags uint32) (uint64, uint64, error) {
	return f.bufCall("put_buf", CmdPutBuf, BufArg{Header: Header{Flags: flags}, ID: id, BufOff: bufOff, Len: n, ObjOff: objOff})
}

// GetBuf reads up to n bytes of f's value from objOff into registration
// id at bufOff, with one copy, and returns the count (short at the end of
// the value) and the version read. flags is for future use and must be 0.
func (f *File) GetBuf(id, bufOff, n, objOff uint64, flags uint32) (uint64, uint64, error) {
	return f.bufCall("get_buf", CmdGetBuf, BufArg{Header: Header{Flags: flags}, ID: id, BufOff: bufOff, Len: n, ObjOff: objOff})
}

// alwaysFalse is never set; the compiler cannot prove it, so what
// keepOnHeap stores escapes.
var (
	alwaysFalse bool
	//lint:ignore U1000 only written: the store is what makes b escape
	heapSink unsafe.Pointer
)

// keepOnHeap makes b's array escape to the heap, where the Go runtime never
// moves memory: the daemon copies to and from its address while the
// goroutine waits in ioctl(2), and a goroutine stack may move.
func keepOnHeap(b []byte) {
	if alwaysFalse {
		heapSink = unsafe.Pointer(unsafe.SliceData(b))
	}
}

func addrOf(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
}

// vmCall runs PUT_VM or GET_VM on b.
func (f *File) vmCall(op string, cmd uint32, b []byte, objOff uint64, flags uint32) (uint64, uint64, error) {
	keepOnHeap(b)
	a := VMArg{Header: Header{Flags: flags}, Addr: addrOf(b), Len: uint64(len(b)), ObjOff: objOff}
	raw := a.Marshal()
	err := call(f.f, cmd, raw)
	// The daemon has copied; b may go now, not before.
	runtime.KeepAlive(b)
	if err != nil {
		return 0, 0, f.err(op, err, "%d B at obj %d, flags %#x", len(b), objOff, flags)
	}
	if err := a.Unmarshal(raw); err != nil {
		return 0, 0, f.err(op, err, "reply")
	}
	return a.Result, a.Version, nil
}

// PutVM stores b as the whole new value of f's key with one copy out of
// this process's memory (nothing to register). flags as PutBuf. b is
// only read, and only during the call.
func (f *File) PutVM(b []byte, flags uint32) (uint64, uint64, error) {
	return f.vmCall("put_vm", CmdPutVM, b, 0, flags)
}

// PutVMAt is PutVM at objOff, which must be 0 unless flags has
// FlagUpdate.
func (f *File) PutVMAt(b []byte, objOff uint64, flags uint32) (uint64, uint64, error) {
	return f.vmCall("put_vm", CmdPutVM, b, objOff, flags)
}

// GetVM reads up to len(b) bytes of f's value from objOff into b with one
// copy and returns the count (short at the end of the value) and the
// version read.
func (f *File) GetVM(b []byte, objOff uint64) (uint64, uint64, error) {
	return f.vmCall("get_vm", CmdGetVM, b, objOff, 0)
}

// ObjectStat is what STAT says about f's object.
type ObjectStat struct {
	Size     uint64
	Version  uint64
	Ino      uint64
	Mtime    time.Time
	Mode     os.FileMode // permission bits
	Pinned   bool
	Replicas int
	Extents  int    // of the first replica
	Location string // "node:seg[off+len],... node2:...", maybe truncated
}

// Stat describes f's object.
func (f *File) Stat() (ObjectStat, error) {
	var a StatArg
	b := a.Marshal()
	if err := call(f.f, CmdStat, b); err != nil {
		return ObjectStat{}, f.err("stat", err, "")
	}
	if err := a.Unmarshal(b); err != nil {
		return ObjectStat{}, f.err("stat", err, "reply")
	}
	return ObjectStat{
		Size: a.ObjSize, Version: a.Version, Ino: a.Ino,
		Mtime: time.Unix(0, a.MtimeNs), Mode: os.FileMode(a.Mode).Perm(),
		Pinned: a.Pinned != 0, Replicas: int(a.Replicas), Extents: int(a.Extents),
		Location: a.LocationString(),
	}, nil
}

// Put stores data as the whole value of path, creating it if needed, with
// one copy (PUT_VM), and returns the version written.
func Put(path string, data []byte) (uint64, error) {
	f, err := Open(path, os.O_RDWR|os.O_CREATE)
	if err != nil {
		return 0, err
	}
	_, v, err := f.PutVM(data, 0)
	if cerr := f.Close(); err == nil && cerr != nil {
		err = cerr
	}
	return v, err
}

// Get reads up to len(dst) bytes of the value of path into dst with one
// copy (GET_VM) and returns the count.
func Get(path string, dst []byte) (int, error) {
	f, err := Open(path, os.O_RDONLY)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n, _, err := f.GetVM(dst, 0)
	return int(n), err
}

// GetAll reads the whole value of path, as of its open, and returns it
// with its version. It reads until the value ends, so it does not depend
// on the size STAT reports.
func GetAll(path string) ([]byte, uint64, error) {
	f, err := Open(path, os.O_RDONLY)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, 0, err
	}
	// One byte more than STAT says, so that a value of the stated size
	// ends with a short read in one call.
	b := make([]byte, st.Size+1)
	var total, version uint64
	for {
		n, v, err := f.GetVM(b[total:], total)
		if err != nil {
			return nil, 0, err
		}
		if total > 0 && v != version {
			return nil, 0, fmt.Errorf("ioctl: get %s: version %d after %d through one read-only open", path, v, version)
		}
		version = v
		total += n
		if total < uint64(len(b)) {
			return b[:total], version, nil
		}
		b = append(b, make([]byte, len(b))...)
	}
}

// CUDAMem names GPU memory of this process for PutCUDA and GetCUDA: the
// IPC handle of its allocation (cuIpcGetMemHandle), the offset of the
// data in it, and the GPU's 16-byte UUID (zero: the first GPU).
type CUDAMem struct {
	Handle [64]byte
	Offset uint64
	Device [16]byte
}

func (f *File) cudaCall(op string, cmd uint32, m CUDAMem, n, objOff uint64, flags uint32) (uint64, uint64, error) {
	a := CUDAArg{Header: Header{Flags: flags}, Handle: m.Handle, DevOff: m.Offset, Len: n, ObjOff: objOff, Device: m.Device}
	raw := a.Marshal()
	if err := call(f.f, cmd, raw); err != nil {
		return 0, 0, f.err(op, err, "%d B at dev %d, obj %d, flags %#x", n, m.Offset, objOff, flags)
	}
	if err := a.Unmarshal(raw); err != nil {
		return 0, 0, f.err(op, err, "reply")
	}
	return a.Result, a.Version, nil
}

// PutCUDA stores n bytes of GPU memory as f's value (FlagUpdate: at
// objOff), copied once by the GPU into the pinned store.
func (f *File) PutCUDA(m CUDAMem, n, objOff uint64, flags uint32) (uint64, uint64, error) {
	return f.cudaCall("put_cuda", CmdPutCUDA, m, n, objOff, flags)
}

// GetCUDA reads up to n bytes of f's value at objOff into GPU memory.
func (f *File) GetCUDA(m CUDAMem, n, objOff uint64) (uint64, uint64, error) {
	return f.cudaCall("get_cuda", CmdGetCUDA, m, n, objOff, 0)
}

// Ping makes one GET_MAGIC call on f: a bare round trip through the
// mount, the floor under every other command.
func (f *File) Ping() error {
	var b [SizeMagicArg]byte
	putHeader(b[:], Header{Size: SizeMagicArg})
	if err := call(f.f, CmdGetMagic, b[:]); err != nil {
		return f.err("get_magic", err, "")
	}
	return nil
}
