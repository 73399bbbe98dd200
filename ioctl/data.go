package ioctl

import (
	"encoding/binary"
	"fmt"
)

// Data-path commands (ABI 1.1). Every argument starts with Header; "out"
// fields are written by the daemon and ignored on input.
var (
	CmdRegisterBuffer   = ioc(dirRead|dirWrite, 0x10, SizeRegisterArg)
	CmdUnregisterBuffer = ioc(dirWrite, 0x11, SizeUnregisterArg)
	CmdPutBuf           = ioc(dirRead|dirWrite, 0x12, SizeBufArg)
	CmdGetBuf           = ioc(dirRead|dirWrite, 0x13, SizeBufArg)
	CmdPutVM            = ioc(dirRead|dirWrite, 0x14, SizeVMArg)
	CmdGetVM            = ioc(dirRead|dirWrite, 0x15, SizeVMArg)
	CmdStat             = ioc(dirRead|dirWrite, 0x16, SizeStatArg)
	CmdBatchPut         = ioc(dirRead|dirWrite, 0x17, SizeBatchArg)
	CmdBatchGet         = ioc(dirRead|dirWrite, 0x18, SizeBatchArg)
)

// Flags of PUT_BUF, PUT_VM and batch puts.
const (
	// FlagExcl fails with EEXIST if the key exists: first writer wins.
	FlagExcl uint32 = 1 << 0
	// FlagUpdate writes Len bytes at ObjOff into a copy of the current
	// version (growing it if needed) instead of replacing the whole
	// object; the result still becomes visible atomically.
	FlagUpdate uint32 = 1 << 1
	// FlagParents (ABI 1.4; batch and key puts on a directory, whose key
	// names a path below it) creates the key's missing parent directories
	// first, as mkdir -p would: mode 0755, owned by the caller, who needs
	// write and search permission where each goes. A put through an open
	// file takes no such flag (EINVAL).
	FlagParents uint32 = 1 << 2

	putFlags = FlagExcl | FlagUpdate | FlagParents
)

// Flags of batch gets (BATCH_GET, BATCH_GETV entries) and GET_KEY.
const (
	// FlagWhole (ABI 1.6) fails the key with EOVERFLOW, moving nothing,
	// when its value from ObjOff on is longer than the key's buffers: a
	// get that must have the whole value learns it did without reading a
	// byte past it. Other gets take no flags (EINVAL).
	FlagWhole uint32 = 1 << 3
)

// Buffer kinds of REGISTER_BUFFER.
const (
	// KindHost is a memfd or shm file descriptor of the caller.
	KindHost uint32 = 1
)

// RegisterArg registers caller memory once: a memfd or shm fd (Fd, an fd
// number in the calling process), mapped from Offset for Len bytes. The
// daemon returns ID, valid only on the open file description it was made
// on, until UNREGISTER_BUFFER or release of that file.
type RegisterArg struct {
	Header
	Fd     int32  // in
	Kind   uint32 // in: KindHost
	Len    uint64 // in
	Offset uint64 // in: page aligned
	ID     uint64 // out
	// Reserved for CUDA IPC handles (KindCUDA, a later ABI minor).
	Handle [64]byte
}

// SizeRegisterArg is the wire size of RegisterArg.
const SizeRegisterArg = 104

// Marshal encodes a.
func (a *RegisterArg) Marshal() []byte {
	b := make([]byte, SizeRegisterArg)
	putHeader(b, Header{Size: SizeRegisterArg, Flags: a.Flags})
	le.PutUint32(b[8:], uint32(a.Fd))
	le.PutUint32(b[12:], a.Kind)
	le.PutUint64(b[16:], a.Len)
	le.PutUint64(b[24:], a.Offset)
	le.PutUint64(b[32:], a.ID)
	copy(b[40:104], a.Handle[:])
	return b
}

// Unmarshal decodes a from b.
func (a *RegisterArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeRegisterArg)
	if err != nil {
		return err
	}
	*a = RegisterArg{Header: h, Fd: int32(le.Uint32(b[8:])), Kind: le.Uint32(b[12:]),
		Len: le.Uint64(b[16:]), Offset: le.Uint64(b[24:]), ID: le.Uint64(b[32:])}
	copy(a.Handle[:], b[40:104])
	return nil
}

// UnregisterArg releases a registration.
type UnregisterArg struct {
	Header
	ID uint64
}

// SizeUnregisterArg is the wire size of UnregisterArg.
const SizeUnregisterArg = 16

// Marshal encodes a.
func (a *UnregisterArg) Marshal() []byte {
	b := make([]byte, SizeUnregisterArg)
	putHeader(b, Header{Size: SizeUnregisterArg, Flags: a.Flags})
	le.PutUint64(b[8:], a.ID)
	return b
}

// Unmarshal decodes a from b.
func (a *UnregisterArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeUnregisterArg)
	if err != nil {
		return err
	}
	*a = UnregisterArg{Header: h, ID: le.Uint64(b[8:])}
	return nil
}

// BufArg moves Len bytes between a registered buffer (ID, at BufOff) and
// the open file's object (at ObjOff), one copy. PUT_BUF replaces the object
// with the Len bytes (ObjOff must be 0) unless FlagUpdate; GET_BUF reads
// up to Len bytes and reports the count in Result.
type BufArg struct {
	Header
	ID      uint64 // in
	BufOff  uint64 // in
	Len     uint64 // in
	ObjOff  uint64 // in
	Result  uint64 // out: bytes moved
	Version uint64 // out: version written or read
}

// SizeBufArg is the wire size of BufArg.
const SizeBufArg = 56

// Marshal encodes a.
func (a *BufArg) Marshal() []byte {
	b := make([]byte, SizeBufArg)
	putHeader(b, Header{Size: SizeBufArg, Flags: a.Flags})
	putU64s(b[8:], a.ID, a.BufOff, a.Len, a.ObjOff, a.Result, a.Version)
	return b
}

// Unmarshal decodes a from b.
func (a *BufArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeBufArg)
	if err != nil {
		return err
	}
	*a = BufArg{Header: h}
	getU64s(b[8:], &a.ID, &a.BufOff, &a.Len, &a.ObjOff, &a.Result, &a.Version)
	return nil
}

// VMArg moves Len bytes between the caller's own memory at Addr and the
// object at ObjOff, with process_vm_readv/writev: one copy, no staging,
// nothing to register. Semantics as BufArg.
type VMArg struct {
	Header
	Addr    uint64 // in
	Len     uint64 // in
	ObjOff  uint64 // in
	Result  uint64 // out
	Version uint64 // out
}

// SizeVMArg is the wire size of VMArg.
const SizeVMArg = 48

// Marshal encodes a.
func (a *VMArg) Marshal() []byte {
	b := make([]byte, SizeVMArg)
	putHeader(b, Header{Size: SizeVMArg, Flags: a.Flags})
	putU64s(b[8:], a.Addr, a.Len, a.ObjOff, a.Result, a.Version)
	return b
}

// Unmarshal decodes a from b.
func (a *VMArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeVMArg)
	if err != nil {
		return err
	}
	*a = VMArg{Header: h}
	getU64s(b[8:], &a.Addr, &a.Len, &a.ObjOff, &a.Result, &a.Version)
	return nil
}

// StatArg describes the open file's object.
type StatArg struct {
	Header
	ObjSize  uint64 // out
	Version  uint64 // out
	Ino      uint64 // out
	MtimeNs  int64  // out
	Mode     uint32 // out: permission bits
	Pinned   uint32 // out: 1 if pinned
	Replicas uint32 // out: number of replicas
	Extents  uint32 // out: extents of the first replica
	// Location is "node:seg0[off+len],... node2:..." NUL-terminated,
	// truncated to fit.
	Location [192]byte // out
}

// SizeStatArg is the wire size of StatArg.
const SizeStatArg = 248

// Marshal encodes a.
func (a *StatArg) Marshal() []byte {
	b := make([]byte, SizeStatArg)
	putHeader(b, Header{Size: SizeStatArg, Flags: a.Flags})
	putU64s(b[8:], a.ObjSize, a.Version, a.Ino, uint64(a.MtimeNs))
	le.PutUint32(b[40:], a.Mode)
	le.PutUint32(b[44:], a.Pinned)
	le.PutUint32(b[48:], a.Replicas)
	le.PutUint32(b[52:], a.Extents)
	copy(b[56:248], a.Location[:])
	return b
}

// Unmarshal decodes a from b.
func (a *StatArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeStatArg)
	if err != nil {
		return err
	}
	*a = StatArg{Header: h}
	var mt uint64
	getU64s(b[8:], &a.ObjSize, &a.Version, &a.Ino, &mt)
	a.MtimeNs = int64(mt)
	a.Mode, a.Pinned = le.Uint32(b[40:]), le.Uint32(b[44:])
	a.Replicas, a.Extents = le.Uint32(b[48:]), le.Uint32(b[52:])
	copy(a.Location[:], b[56:248])
	return nil
}

// LocationString returns Location up to its NUL.
func (a *StatArg) LocationString() string {
	for i, c := range a.Location {
		if c == 0 {
			return string(a.Location[:i])
		}
	}
	return string(a.Location[:])
}

// Batch limits.
const (
	MaxBatch      = 64
	BatchKeyBytes = SizeBatchArg - batchKeysOff
	batchKeysOff  = 24 + MaxBatch*SizeBatchEntry
)

// Batch sources: where the bytes of every entry live.
const (
	// BatchBuf: entry Addr is an offset in the registered buffer ID.
	BatchBuf uint32 = 0
	// BatchVM: entry Addr is an address in the caller's memory.
	BatchVM uint32 = 1
)

// BatchEntry is one key of a batch. The key is Keys[KeyOff:KeyOff+KeyLen]
// of the batch, relative to the directory the ioctl is made on.
type BatchEntry struct {
	KeyOff uint16 // in
	KeyLen uint16 // in
	Flags  uint32 // in: FlagExcl, FlagUpdate (puts)
	Addr   uint64 // in: buffer offset or address (see Batch sources)
	Len    uint64 // in
	ObjOff uint64 // in
	// Result is bytes moved, or a negative errno for this key alone.
	Result  int64  // out
	Version uint64 // out
}

// SizeBatchEntry is the wire size of BatchEntry.
const SizeBatchEntry = 48

// BatchArg is BATCH_PUT / BATCH_GET on a directory: up to MaxBatch keys in
// one call, each with its own result. Keys are packed into Keys.
type BatchArg struct {
	Header
	Count   uint32 // in
	Source  uint32 // in: BatchBuf or BatchVM
	ID      uint64 // in: registered buffer for BatchBuf
	Entries [MaxBatch]BatchEntry
	Keys    [BatchKeyBytes]byte
}

// SizeBatchArg is the wire size of BatchArg: the largest multiple of 8
// that a restricted ioctl can carry.
const SizeBatchArg = MaxArgSize &^ 7

// Marshal encodes a.
func (a *BatchArg) Marshal() []byte {
	b := make([]byte, SizeBatchArg)
	encodeBatch(b, a)
	return b
}

// MarshalInto encodes a into b, as much of it as b holds (a reply
// buffer), without an encoding of its own.
func (a *BatchArg) MarshalInto(b []byte) {
	marshalInto(b, SizeBatchArg, func(b []byte) { encodeBatch(b, a) })
}

// marshalInto encodes a reply of size bytes into b with encode: b's
// first bytes only when it holds fewer (what encode writes into a buffer
// of its own), and never a byte of b's past.
func marshalInto(b []byte, size int, encode func([]byte)) {
	if len(b) < size {
		full := make([]byte, size)
		encode(full)
		copy(b, full)
		return
	}
	clear(b[:size])
	encode(b[:size])
}

// Unmarshal decodes a from b.
func (a *BatchArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeBatchArg)
	if err != nil {
		return err
	}
	a.Header = h
	a.Count, a.Source, a.ID = le.Uint32(b[8:]), le.Uint32(b[12:]), le.Uint64(b[16:])
	for i := range a.Entries {
		decodeEntry(&a.Entries[i], b[24+i*SizeBatchEntry:])
	}
	copy(a.Keys[:], b[batchKeysOff:])
	return nil
}

// Key returns entry i's key, or an error if it lies outside Keys.
func (a *BatchArg) Key(i int) (string, error) {
	b, err := a.KeyBytes(i)
	return string(b), err
}

// KeyBytes is Key without a copy: the bytes are a's.
func (a *BatchArg) KeyBytes(i int) ([]byte, error) {
	k, err := EntryKey(a.Keys[:], &a.Entries[i])
	if err != nil {
		return nil, fmt.Errorf("entry %d: %w", i, err)
	}
	return k, nil
}

// AddKey appends key to Keys and entry Count, returning its index.
func (a *BatchArg) AddKey(key string, e BatchEntry) (int, error) {
	if a.Count >= MaxBatch {
		return 0, fmt.Errorf("batch full (%d keys): %w", MaxBatch, ErrBatchFull)
	}
	used := 0
	for i := range int(a.Count) {
		used = max(used, int(a.Entries[i].KeyOff)+int(a.Entries[i].KeyLen))
	}
	if len(key) == 0 || used+len(key) > len(a.Keys) || len(key) > 0xffff {
		return 0, fmt.Errorf("key of %d B does not fit (%d B used of %d): %w", len(key), used, len(a.Keys), ErrBatchFull)
	}
	copy(a.Keys[used:], key)
	e.KeyOff, e.KeyLen = uint16(used), uint16(len(key))
	a.Entries[a.Count] = e
	a.Count++
	return int(a.Count) - 1, nil
}

// ValidatePut checks the flags of a put.
func ValidatePut(flags uint32) error {
	if flags&^putFlags != 0 {
		return fmt.Errorf("put flags %#x: %w", flags, ErrFlags)
	}
	return nil
}

var le = binary.LittleEndian

func putU64s(b []byte, vs ...uint64) {
	for i, v := range vs {
		le.PutUint64(b[8*i:], v)
	}
}

func getU64s(b []byte, ps ...*uint64) {
	for i, p := range ps {
		*p = le.Uint64(b[8*i:])
	}
}

// GPU commands (ABI 1.2).
var (
	CmdPutCUDA = ioc(dirRead|dirWrite, 0x19, SizeCUDAArg)
	CmdGetCUDA = ioc(dirRead|dirWrite, 0x1a, SizeCUDAArg)
)

// KindCUDA registers a CUDA allocation by its IPC handle (RegisterArg.Handle,
// RegisterArg.Offset into the allocation, RegisterArg.Len): PUT_BUF and
// GET_BUF then copy between GPU memory and the store.
const KindCUDA uint32 = 2

// RegisterDmabuf (ABI 1.5; RegisterArg.Flags of KindCUDA) says that
// RegisterArg.Fd is a dma-buf of the caller exporting the whole
// allocation the handle names (cuMemGetHandleForAddressRange of its
// cuMemGetAddressRange), so that the daemon can register the allocation
// with its RDMA devices (GPUDirect RDMA): the driver exports no dma-buf
// of an allocation opened through an IPC handle. The daemon takes its
// own copy of the descriptor; the caller may close its own once the
// call returns. Without RDMA the daemon checks it and lets it go. The
// daemon checks that it is a dma-buf of the allocation's size; one of
// another allocation of this process of the same size cannot be told
// apart, and makes the NIC move that memory instead.
const RegisterDmabuf uint32 = 1 << 0

// CUDAArg moves Len bytes between GPU memory of the caller and the object
// at ObjOff, in one copy (GPU <-> pinned segment). Handle is the
// cuIpcGetMemHandle of the allocation, DevOff the data's offset in it, and
// Device the 16-byte UUID of its GPU (all zero: the first GPU). Semantics
// and flags as BufArg.
type CUDAArg struct {
	Header
	Handle  [64]byte // in
	DevOff  uint64   // in
	Len     uint64   // in
	ObjOff  uint64   // in
	Result  uint64   // out
	Version uint64   // out
	Device  [16]byte // in
}

// SizeCUDAArg is the wire size of CUDAArg.
const SizeCUDAArg = 128

// Marshal encodes a.
func (a *CUDAArg) Marshal() []byte {
	b := make([]byte, SizeCUDAArg)
	putHeader(b, Header{Size: SizeCUDAArg, Flags: a.Flags})
	copy(b[8:72], a.Handle[:])
	putU64s(b[72:], a.DevOff, a.Len, a.ObjOff, a.Result, a.Version)
	copy(b[112:128], a.Device[:])
	return b
}

// Unmarshal decodes a from b.
func (a *CUDAArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeCUDAArg)
	if err != nil {
		return err
	}
	*a = CUDAArg{Header: h}
	copy(a.Handle[:], b[8:72])
	getU64s(b[72:], &a.DevOff, &a.Len, &a.ObjOff, &a.Result, &a.Version)
	copy(a.Device[:], b[112:128])
	return nil
}
