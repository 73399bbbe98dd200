package ioctl

import "fmt"

// Commands of ABI 1.3: one key by name in one small call, and batches
// whose keys gather from and scatter into several buffers each. All act
// on keys relative to the directory the ioctl is made on.
var (
	CmdPutKey    = ioc(dirRead|dirWrite, 0x1b, SizeKeyArg)
	CmdGetKey    = ioc(dirRead|dirWrite, 0x1c, SizeKeyArg)
	CmdBatchPutV = ioc(dirRead|dirWrite, 0x1d, SizeVBatchArg)
	CmdBatchGetV = ioc(dirRead|dirWrite, 0x1e, SizeVBatchArg)
)

// ABI 1.7: vector batches that run while the caller goes on.
//
// BATCH_PUTV or BATCH_GETV with VBatchAsync in the header's flags checks
// the call's shape, starts it and returns at once: the ioctl's value is
// the call's number on that directory handle (1 to 2^31-1), and the
// entries' results are not filled. A submitted call names only memory the
// daemon holds itself: registrations of memfds and CUDA allocations
// (SegGPU), not process memory (SegVM, KindVM registrations: EINVAL, as
// the call runs when nothing keeps the caller's thread id naming the
// caller). Its memory must stay as it is until BATCH_WAIT returns for
// it. BATCH_WAIT,
// with Count set to the call's number, blocks until that call is done and
// returns its VBatchArg with every result filled, as the synchronous call
// would have; each call is waited for once (EINVAL for a number that is
// not outstanding). With Count 0 it waits for every call submitted on the
// handle before it and consumes none (a barrier, for a caller that must
// know its memory is no longer used). A handle holds at most
// MaxAsyncCalls calls not waited for, and the mount 1024 of all handles
// together (EBUSY beyond); closing a handle waits for nothing and drops
// their results and stops the calls still running at their next key
// (EINTR for the keys not done), and unmounting stops and waits for them.
var CmdBatchWait = ioc(dirRead|dirWrite, 0x1f, SizeVBatchArg)

const (
	// VBatchAsync in a vector batch's header flags submits it (ABI 1.7).
	VBatchAsync uint32 = 1 << 0
	// MaxAsyncCalls is the most submitted calls a handle holds.
	MaxAsyncCalls = 16
)

// KindVM registers an address range of the caller's own memory
// (RegisterArg.Offset is the address, Fd is -1): memory that is not a
// memfd, such as a torch pinned tensor or a numpy array. Its bytes move
// with process_vm_readv/writev, and only the process that registered it
// may use the registration (EPERM for any other, a child that inherited
// the file included); memory it unmapped since fails with EFAULT.
const KindVM uint32 = 3

// Sources of a KEY command: where its one buffer is.
const (
	// SrcBuf: Addr is an offset in registration ID (any kind).
	SrcBuf uint32 = 0
	// SrcVM: Addr is an address of the caller.
	SrcVM uint32 = 1
	// SrcCUDA: Addr is an offset in the CUDA allocation GPU names by IPC
	// handle; the daemon keeps the handle open for the calling process.
	SrcCUDA uint32 = 2
	// SrcInline: the value is in the call itself (PUT_KEY_INLINE,
	// GET_KEY_INLINE; ABI 1.9); ID and Addr are unused and must be 0.
	SrcInline uint32 = 3
)

// ABI 1.9: one key whose value, of up to InlineBytes, travels in the
// call's argument: the KeyArg (Source SrcInline, its header's Size
// SizeKeyInlineArg) and then InlineBytes of data. PUT_KEY_INLINE stores
// the first Len bytes of the data; GET_KEY_INLINE returns up to Len bytes
// of the value from ObjOff in the data, the rest of it zeroed. Everything
// else is PUT_KEY's and GET_KEY's. The kernel copies the value with the
// call, which for a small value costs less than the daemon reaching into
// the caller's memory (process_vm_readv), the one copy the other sources
// make; larger values go by address.
var (
	CmdPutKeyInline = ioc(dirRead|dirWrite, 0x22, SizeKeyInlineArg)
	CmdGetKeyInline = ioc(dirRead|dirWrite, 0x23, SizeKeyInlineArg)
)

const (
	// InlineBytes is the largest value a KEY_INLINE call carries.
	InlineBytes = 4096
	// SizeKeyInlineArg is the wire size of a KEY_INLINE argument.
	SizeKeyInlineArg = SizeKeyArg + InlineBytes
)

// Limits of the KEY and vector batch commands.
const (
	// KeyArgKeyBytes is the longest key a KEY command carries; longer
	// keys go by batch.
	KeyArgKeyBytes = SizeKeyArg - keyArgKeyOff
	// MaxMeta is the longest meta of a key.
	MaxMeta = 128
	// MaxGPURefs is the most CUDA allocations one vector batch names.
	MaxGPURefs = 16
	// VBatchAreaBytes is the vector batch's area for keys, segment lists
	// and metas.
	VBatchAreaBytes = SizeVBatchArg - vbatchAreaOff
	// MaxSegs is the most segments one key of a vector batch has.
	MaxSegs = 256

	keyArgKeyOff  = 280
	vbatchAreaOff = 16 + MaxBatch*SizeVBatchEntry + MaxGPURefs*SizeGPURef
)

// GPURef names a CUDA allocation of the caller: its IPC handle
// (cuIpcGetMemHandle) and its GPU's 16-byte UUID (all zero: the first GPU).
type GPURef struct {
	Handle [64]byte
	Device [16]byte
}

// SizeGPURef is the wire size of GPURef.
const SizeGPURef = 80

// KeyArg is PUT_KEY / GET_KEY on a directory: one key, named by Key
// relative to it, and one buffer (Source, ID, Addr, Len). A put replaces
// the key's value (FlagExcl, FlagUpdate as BufArg; parents must exist)
// and stores Meta with it: a short description of the bytes (a tensor's
// dtype and shape, say), kept as the xattr user.mooncake.meta, that a put
// without meta removes. A get reads up to Len bytes from ObjOff, reports
// the value's Size and Meta, and, when the call carries a Meta, fails with
// EBADMSG and moves nothing unless the value's meta is exactly it. A get
// of Len 0 from SrcVM is a lookup by name: ObjSize, Version and Meta (a
// segment of a registration is checked even when empty).
type KeyArg struct {
	Header
	Source  uint32 // in: SrcBuf, SrcVM or SrcCUDA
	KeyLen  uint16 // in
	MetaLen uint16 // in, and out (get)
	ID      uint64 // in: SrcBuf's registration
	Addr    uint64 // in
	Len     uint64 // in
	ObjOff  uint64 // in
	Result  uint64 // out: bytes moved
	Version uint64 // out
	ObjSize uint64 // out (get): the value's size
	GPU     GPURef // in: SrcCUDA
	Meta    [MaxMeta]byte
	Key     [KeyArgKeyBytes]byte
}

// SizeKeyArg is the wire size of KeyArg.
const SizeKeyArg = 1024

// Marshal encodes a.
func (a *KeyArg) Marshal() []byte {
	b := make([]byte, SizeKeyArg)
	a.encode(b)
	return b
}

// MarshalInto encodes a into b, as Marshal does: b's first bytes only,
// when it holds fewer than SizeKeyArg.
func (a *KeyArg) MarshalInto(b []byte) { marshalInto(b, SizeKeyArg, a.encode) }

func (a *KeyArg) encode(b []byte) {
	putHeader(b, Header{Size: SizeKeyArg, Flags: a.Flags})
	le.PutUint32(b[8:], a.Source)
	le.PutUint16(b[12:], a.KeyLen)
	le.PutUint16(b[14:], a.MetaLen)
	putU64s(b[16:], a.ID, a.Addr, a.Len, a.ObjOff, a.Result, a.Version, a.ObjSize)
	copy(b[72:136], a.GPU.Handle[:])
	copy(b[136:152], a.GPU.Device[:])
	copy(b[152:280], a.Meta[:])
	copy(b[keyArgKeyOff:], a.Key[:])
}

// MarshalInlineInto encodes a as the head of a KEY_INLINE argument b
// (SizeKeyInlineArg bytes), leaving b's data area as it is.
func (a *KeyArg) MarshalInlineInto(b []byte) {
	marshalInto(b, SizeKeyArg, a.encode)
	putHeader(b, Header{Size: SizeKeyInlineArg, Flags: a.Flags})
}

// Unmarshal decodes a from b.
func (a *KeyArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeKeyArg)
	if err != nil {
		return err
	}
	a.decode(h, b)
	return nil
}

// UnmarshalInline decodes a from the KEY_INLINE argument b and returns
// b's data area.
func (a *KeyArg) UnmarshalInline(b []byte) ([]byte, error) {
	h, err := getHeader(b, SizeKeyInlineArg)
	if err != nil {
		return nil, err
	}
	a.decode(h, b)
	return b[SizeKeyArg:SizeKeyInlineArg], nil
}

func (a *KeyArg) decode(h Header, b []byte) {
	a.Header = h
	a.Source, a.KeyLen, a.MetaLen = le.Uint32(b[8:]), le.Uint16(b[12:]), le.Uint16(b[14:])
	getU64s(b[16:], &a.ID, &a.Addr, &a.Len, &a.ObjOff, &a.Result, &a.Version, &a.ObjSize)
	copy(a.GPU.Handle[:], b[72:136])
	copy(a.GPU.Device[:], b[136:152])
	copy(a.Meta[:], b[152:280])
	copy(a.Key[:], b[keyArgKeyOff:SizeKeyArg])
}

// KeyString returns the key, or an error if KeyLen is out of range.
func (a *KeyArg) KeyString() (string, error) {
	if a.KeyLen == 0 || int(a.KeyLen) > len(a.Key) {
		return "", fmt.Errorf("key of %d B (1 to %d): %w", a.KeyLen, len(a.Key), ErrShortArg)
	}
	return string(a.Key[:a.KeyLen]), nil
}

// MetaBytes returns the meta, or an error if MetaLen is out of range.
func (a *KeyArg) MetaBytes() ([]byte, error) {
	if int(a.MetaLen) > len(a.Meta) {
		return nil, fmt.Errorf("meta of %d B (at most %d): %w", a.MetaLen, len(a.Meta), ErrShortArg)
	}
	return a.Meta[:a.MetaLen], nil
}

// Segment ids of a vector batch: which memory a Seg's Off is in.
const (
	// SegVM: Off is an address of the caller.
	SegVM uint64 = 0
	// SegGPU | i: Off is an offset in the batch's CUDA allocation GPUs[i].
	SegGPU uint64 = 1 << 63
)

// Seg is one range of memory of a key of a vector batch: ID SegVM, a
// registration made on the directory (any kind), or SegGPU|i.
type Seg struct {
	ID  uint64
	Off uint64
	Len uint64
}

// SizeSeg is the wire size of Seg.
const SizeSeg = 24

// VBatchEntry is one key of a vector batch. Its key, segment list (NSeg
// Segs) and meta lie in the batch's Area at the offsets given; a put
// gathers the segments in order into one value, a get scatters the value
// from ObjOff into them in order. Meta as KeyArg's: stored by a put, and
// for a get, when not empty, the meta the value must have (EBADMSG).
type VBatchEntry struct {
	KeyOff  uint16 // in
	KeyLen  uint16 // in
	Flags   uint32 // in: FlagExcl, FlagUpdate (puts)
	SegOff  uint32 // in: 8-aligned
	NSeg    uint32 // in: 1 to MaxSegs
	MetaOff uint32 // in
	MetaLen uint32 // in
	ObjOff  uint64 // in
	Result  int64  // out: bytes moved, or a negative errno for this key alone
	Version uint64 // out
}

// SizeVBatchEntry is the wire size of VBatchEntry.
const SizeVBatchEntry = 48

// VBatchArg is BATCH_PUTV / BATCH_GETV on a directory.
type VBatchArg struct {
	Header
	Count   uint32 // in
	NGPU    uint32 // in: GPUs in use
	Entries [MaxBatch]VBatchEntry
	GPUs    [MaxGPURefs]GPURef
	Area    [VBatchAreaBytes]byte
}

// SizeVBatchArg is the wire size of VBatchArg, as BatchArg's.
const SizeVBatchArg = SizeBatchArg

// Marshal encodes a.
func (a *VBatchArg) Marshal() []byte {
	b := make([]byte, SizeVBatchArg)
	a.encode(b)
	return b
}

// MarshalInto encodes a into b, as much of it as b holds (a reply
// buffer), without an encoding of its own.
func (a *VBatchArg) MarshalInto(b []byte) { marshalInto(b, SizeVBatchArg, a.encode) }

func (a *VBatchArg) encode(b []byte) {
	putHeader(b, Header{Size: SizeVBatchArg, Flags: a.Flags})
	le.PutUint32(b[8:], a.Count)
	le.PutUint32(b[12:], a.NGPU)
	for i := range a.Entries {
		e := &a.Entries[i]
		o := b[16+i*SizeVBatchEntry:]
		le.PutUint16(o[0:], e.KeyOff)
		le.PutUint16(o[2:], e.KeyLen)
		le.PutUint32(o[4:], e.Flags)
		le.PutUint32(o[8:], e.SegOff)
		le.PutUint32(o[12:], e.NSeg)
		le.PutUint32(o[16:], e.MetaOff)
		le.PutUint32(o[20:], e.MetaLen)
		putU64s(o[24:], e.ObjOff, uint64(e.Result), e.Version)
	}
	g0 := 16 + MaxBatch*SizeVBatchEntry
	for i := range a.GPUs {
		o := b[g0+i*SizeGPURef:]
		copy(o[:64], a.GPUs[i].Handle[:])
		copy(o[64:80], a.GPUs[i].Device[:])
	}
	copy(b[vbatchAreaOff:], a.Area[:])
}

// Unmarshal decodes a from b.
func (a *VBatchArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeVBatchArg)
	if err != nil {
		return err
	}
	a.Header = h
	a.Count, a.NGPU = le.Uint32(b[8:]), le.Uint32(b[12:])
	for i := range a.Entries {
		e := &a.Entries[i]
		o := b[16+i*SizeVBatchEntry:]
		var res uint64
		e.KeyOff, e.KeyLen, e.Flags = le.Uint16(o[0:]), le.Uint16(o[2:]), le.Uint32(o[4:])
		e.SegOff, e.NSeg, e.MetaOff, e.MetaLen = le.Uint32(o[8:]), le.Uint32(o[12:]), le.Uint32(o[16:]), le.Uint32(o[20:])
		getU64s(o[24:], &e.ObjOff, &res, &e.Version)
		e.Result = int64(res)
	}
	g0 := 16 + MaxBatch*SizeVBatchEntry
	for i := range a.GPUs {
		o := b[g0+i*SizeGPURef:]
		copy(a.GPUs[i].Handle[:], o[:64])
		copy(a.GPUs[i].Device[:], o[64:80])
	}
	copy(a.Area[:], b[vbatchAreaOff:SizeVBatchArg])
	return nil
}

// area returns Area[off:off+n], or an error if it lies outside.
func (a *VBatchArg) area(what string, i int, off, n uint64) ([]byte, error) {
	if off > uint64(len(a.Area)) || n > uint64(len(a.Area))-off {
		return nil, fmt.Errorf("entry %d %s [%d+%d) outside %d B: %w", i, what, off, n, len(a.Area), ErrShortArg)
	}
	return a.Area[off : off+n], nil
}

// Key returns entry i's key.
func (a *VBatchArg) Key(i int) (string, error) {
	b, err := a.KeyBytes(i)
	return string(b), err
}

// KeyBytes is Key without a copy: the bytes are a's.
func (a *VBatchArg) KeyBytes(i int) ([]byte, error) {
	e := &a.Entries[i]
	if e.KeyLen == 0 {
		return nil, fmt.Errorf("entry %d: empty key: %w", i, ErrShortArg)
	}
	return a.area("key", i, uint64(e.KeyOff), uint64(e.KeyLen))
}

// Meta returns entry i's meta.
func (a *VBatchArg) Meta(i int) ([]byte, error) {
	e := &a.Entries[i]
	if e.MetaLen > MaxMeta {
		return nil, fmt.Errorf("entry %d: meta of %d B (at most %d): %w", i, e.MetaLen, MaxMeta, ErrShortArg)
	}
	return a.area("meta", i, uint64(e.MetaOff), uint64(e.MetaLen))
}

// Segs appends entry i's segments to dst.
func (a *VBatchArg) Segs(dst []Seg, i int) ([]Seg, error) {
	e := &a.Entries[i]
	if e.NSeg == 0 || e.NSeg > MaxSegs || e.SegOff%8 != 0 {
		return dst, fmt.Errorf("entry %d: %d segments at %d (1 to %d, 8-aligned): %w", i, e.NSeg, e.SegOff, MaxSegs, ErrShortArg)
	}
	b, err := a.area("segments", i, uint64(e.SegOff), uint64(e.NSeg)*SizeSeg)
	if err != nil {
		return dst, err
	}
	for k := range int(e.NSeg) {
		o := b[k*SizeSeg:]
		dst = append(dst, Seg{ID: le.Uint64(o[0:]), Off: le.Uint64(o[8:]), Len: le.Uint64(o[16:])})
	}
	return dst, nil
}

// vbatchPacker fills a VBatchArg: keys, metas and segment lists go into
// the area from its start, each segment list 8-aligned.
type vbatchPacker struct {
	a    *VBatchArg
	used int
}

// add appends one entry; false when it does not fit (the batch is full).
func (p *vbatchPacker) add(key string, meta []byte, segs []Seg, e VBatchEntry) bool {
	if p.a.Count >= MaxBatch {
		return false
	}
	segOff := (p.used + 7) &^ 7
	end := segOff + len(segs)*SizeSeg + len(key) + len(meta)
	if end > len(p.a.Area) {
		return false
	}
	for k, s := range segs {
		o := p.a.Area[segOff+k*SizeSeg:]
		putU64s(o, s.ID, s.Off, s.Len)
	}
	keyOff := segOff + len(segs)*SizeSeg
	copy(p.a.Area[keyOff:], key)
	metaOff := keyOff + len(key)
	copy(p.a.Area[metaOff:], meta)
	e.SegOff, e.NSeg = uint32(segOff), uint32(len(segs))
	e.KeyOff, e.KeyLen = uint16(keyOff), uint16(len(key))
	e.MetaOff, e.MetaLen = uint32(metaOff), uint32(len(meta))
	p.a.Entries[p.a.Count] = e
	p.a.Count++
	p.used = end
	return true
}
