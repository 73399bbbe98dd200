package ioctl

import (
	"errors"
	"fmt"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// keyArgs recycles KEY arguments and their wire buffers.
var keyArgs = sync.Pool{New: func() any { return new(keyScratch) }}

type keyScratch struct {
	arg KeyArg
	raw [SizeKeyArg]byte
}

// KeyCall runs PUT_KEY (put) or GET_KEY with a on directory f, setting
// a.Key and a.KeyLen from key, and leaves the daemon's answer in a. A key
// longer than KeyArgKeyBytes fails with ErrBadKey (use a batch). The
// daemon reads or fills the memory a.Addr names while the call runs: a
// Go slice behind it must stay reachable until KeyCall returns
// (runtime.KeepAlive after the call), or the collector may hand its
// memory to another allocation meanwhile; PutKey and GetKey do that.
func (f *File) KeyCall(put bool, key string, a *KeyArg) error {
	op, cmd := "get_key", CmdGetKey
	if put {
		op, cmd = "put_key", CmdPutKey
	}
	if err := f.setKey(op, key, a); err != nil {
		return err
	}
	sc := keyArgs.Get().(*keyScratch)
	defer keyArgs.Put(sc)
	a.encode(sc.raw[:])
	if err := call(f.f, cmd, sc.raw[:]); err != nil {
		return fmt.Errorf("ioctl: %s %s/%s: %w", op, f.path, key, err)
	}
	return a.Unmarshal(sc.raw[:])
}

// setKey checks key and a's meta for a KEY call (op) and sets a.Key and
// a.KeyLen.
func (f *File) setKey(op, key string, a *KeyArg) error {
	if len(key) == 0 || len(key) > KeyArgKeyBytes {
		return f.err(op, ErrBadKey, "key of %d B (1 to %d)", len(key), KeyArgKeyBytes)
	}
	if int(a.MetaLen) > MaxMeta {
		return f.err(op, ErrBadItem, "meta of %d B (at most %d)", a.MetaLen, MaxMeta)
	}
	a.KeyLen = uint16(len(key))
	copy(a.Key[:], key)
	clear(a.Key[len(key):])
	return nil
}

// inlineArgs recycles KEY_INLINE wire buffers.
var inlineArgs = sync.Pool{New: func() any { return new([SizeKeyInlineArg]byte) }}

// keyInline runs PUT_KEY_INLINE with data (at most InlineBytes) as the
// value (put) or GET_KEY_INLINE into data, for key, and leaves the daemon's answer in a
// (its Source, ID, Addr and Len set here). sent is false when the daemon
// predates ABI 1.9 (ENOTTY; f then sends no more): the caller goes by
// address instead.
func (f *File) keyInline(put bool, key string, a *KeyArg, data []byte) (sent bool, err error) {
	op, cmd := "get_key", CmdGetKeyInline
	if put {
		op, cmd = "put_key", CmdPutKeyInline
	}
	if err := f.setKey(op, key, a); err != nil {
		return true, err
	}
	a.Source, a.ID, a.Addr, a.Len = SrcInline, 0, 0, uint64(len(data))
	raw := inlineArgs.Get().(*[SizeKeyInlineArg]byte)
	defer inlineArgs.Put(raw)
	a.MarshalInlineInto(raw[:])
	area := raw[SizeKeyArg:]
	n := 0
	if put {
		n = copy(area, data)
	}
	clear(area[n:]) // none of this process's earlier calls goes along
	if err := call(f.f, cmd, raw[:]); err != nil {
		if errors.Is(err, unix.ENOTTY) {
			f.noInline.Store(true)
			return false, nil
		}
		return true, fmt.Errorf("ioctl: %s %s/%s: %w", op, f.path, key, err)
	}
	if area, err = a.UnmarshalInline(raw[:]); err != nil {
		return true, f.err(op, err, "reply")
	}
	if !put {
		if a.Result > uint64(len(data)) {
			return true, f.err(op, ErrShortArg, "reply of %d B into %d", a.Result, len(data))
		}
		copy(data, area[:a.Result])
	}
	return true, nil
}

// PutKey stores data as the value of key (relative to directory f, its
// parent existing) in one call, and returns the version written. Keys
// too long for one KEY call go as a batch of one.
func (f *File) PutKey(key string, data []byte, flags uint32) (uint64, error) {
	if len(key) > KeyArgKeyBytes {
		res, err := f.BatchPut([]BatchItem{{Key: key, Data: data, Flags: flags}})
		if err != nil {
			return 0, err
		}
		return res[0].Version, res[0].Err
	}
	sc := keyArgs.Get().(*keyScratch)
	defer keyArgs.Put(sc)
	a := &sc.arg
	if len(data) <= InlineBytes && !f.noInline.Load() {
		*a = KeyArg{Header: Header{Flags: flags}}
		if sent, err := f.keyInline(true, key, a, data); sent {
			return a.Version, err
		}
	}
	keepOnHeap(data)
	*a = KeyArg{Header: Header{Flags: flags}, Source: SrcVM, Addr: addrOf(data), Len: uint64(len(data))}
	err := f.KeyCall(true, key, a)
	runtime.KeepAlive(data)
	return a.Version, err
}

// GetKey reads key (relative to directory f) from objOff into dst in one
// call and returns the count read and the version.
func (f *File) GetKey(key string, dst []byte, objOff uint64) (uint64, uint64, error) {
	if len(key) > KeyArgKeyBytes {
		res, err := f.BatchGet([]BatchItem{{Key: key, Data: dst, ObjOff: objOff}})
		if err != nil {
			return 0, 0, err
		}
		return res[0].N, res[0].Version, res[0].Err
	}
	sc := keyArgs.Get().(*keyScratch)
	defer keyArgs.Put(sc)
	a := &sc.arg
	if len(dst) > 0 && len(dst) <= InlineBytes && !f.noInline.Load() {
		*a = KeyArg{ObjOff: objOff}
		if sent, err := f.keyInline(false, key, a, dst); sent {
			return a.Result, a.Version, err
		}
	}
	keepOnHeap(dst)
	*a = KeyArg{Source: SrcVM, Addr: addrOf(dst), Len: uint64(len(dst)), ObjOff: objOff}
	err := f.KeyCall(false, key, a)
	runtime.KeepAlive(dst)
	return a.Result, a.Version, err
}

// KeyInfo is what a lookup by name returns.
type KeyInfo struct {
	Size, Version uint64
	Meta          []byte
}

// LookupKey returns key's size, version and meta in one call.
func (f *File) LookupKey(key string) (KeyInfo, error) {
	a := KeyArg{Source: SrcVM}
	if err := f.KeyCall(false, key, &a); err != nil {
		return KeyInfo{}, err
	}
	m, err := a.MetaBytes()
	if err != nil {
		return KeyInfo{}, f.err("get_key", err, "reply")
	}
	return KeyInfo{Size: a.ObjSize, Version: a.Version, Meta: append([]byte(nil), m...)}, nil
}

// VItem is one key of a vector batch (BatchPutV, BatchGetV): its value
// is the concatenation of its segments, in order. Data pieces are memory
// of this process; Segs name registrations made on f or GPU tables
// entries (SegGPU|i) instead. An item has Data or Segs, not both.
type VItem struct {
	Key    string
	Flags  uint32 // puts: FlagExcl, FlagUpdate
	ObjOff uint64
	Meta   []byte // put: stored with the value; get: the meta it must have
	Data   [][]byte
	Segs   []Seg
}

// BatchPutV stores each item's segments, gathered, as its key's value, in
// calls of up to MaxBatch keys (fewer when their segments, keys and metas
// fill the area); gpus is the table SegGPU ids index (at most
// MaxGPURefs). Each key succeeds or fails alone.
func (f *File) BatchPutV(gpus []GPURef, items []VItem) ([]BatchResult, error) {
	return f.vbatch("batch_putv", CmdBatchPutV, gpus, items)
}

// BatchGetV reads each item's key from ObjOff, scattered into its
// segments in order; N is the count read.
func (f *File) BatchGetV(gpus []GPURef, items []VItem) ([]BatchResult, error) {
	return f.vbatch("batch_getv", CmdBatchGetV, gpus, items)
}

type vbatchScratch struct {
	arg VBatchArg
	raw [SizeVBatchArg]byte
}

var vbatchArgs = sync.Pool{New: func() any { return new(vbatchScratch) }}

func (f *File) vbatch(op string, cmd uint32, gpus []GPURef, items []VItem) ([]BatchResult, error) {
	segs, err := f.vsegs(op, gpus, items)
	if err != nil {
		return nil, err
	}
	res := make([]BatchResult, len(items))
	sc := vbatchArgs.Get().(*vbatchScratch)
	defer vbatchArgs.Put(sc)
	for start := 0; start < len(items); {
		end := sc.pack(gpus, items, segs, start)
		if err := call(f.f, cmd, sc.raw[:]); err != nil {
			err = f.err(op, err, "items %d..%d of %d (%q...)", start, len(items)-1, len(items), items[start].Key)
			for i := start; i < len(items); i++ {
				res[i].Err = err
			}
			return res, err
		}
		f.vresults(op, sc.raw[:], items[start:end], res[start:end])
		start = end
	}
	runtime.KeepAlive(items)
	return res, nil
}

// vsegs checks items and returns each one's segments.
func (f *File) vsegs(op string, gpus []GPURef, items []VItem) ([][]Seg, error) {
	if len(gpus) > MaxGPURefs {
		return nil, f.err(op, ErrBadItem, "%d GPU allocations (at most %d)", len(gpus), MaxGPURefs)
	}
	segs := make([][]Seg, len(items))
	for i, it := range items {
		n := len(it.Data) + len(it.Segs)
		switch {
		case len(it.Key) == 0 || len(it.Key) > VBatchAreaBytes:
			return nil, f.err(op, ErrBadKey, "item %d: key of %d B", i, len(it.Key))
		case len(it.Meta) > MaxMeta:
			return nil, f.err(op, ErrBadItem, "item %d (%s): meta of %d B (at most %d)", i, it.Key, len(it.Meta), MaxMeta)
		case len(it.Data) > 0 && len(it.Segs) > 0:
			return nil, f.err(op, ErrBadItem, "item %d (%s): both Data and Segs", i, it.Key)
		case n == 0 || n > MaxSegs:
			return nil, f.err(op, ErrBadItem, "item %d (%s): %d segments (1 to %d)", i, it.Key, n, MaxSegs)
		case n*SizeSeg+len(it.Key)+len(it.Meta)+7 > VBatchAreaBytes:
			return nil, f.err(op, ErrBadItem, "item %d (%s): too large for one batch", i, it.Key)
		}
		if len(it.Data) > 0 {
			s := make([]Seg, len(it.Data))
			for k, d := range it.Data {
				keepOnHeap(d)
				s[k] = Seg{ID: SegVM, Off: addrOf(d), Len: uint64(len(d))}
			}
			segs[i] = s
		} else {
			segs[i] = it.Segs
		}
	}
	return segs, nil
}

// pack encodes into sc.raw the items from start on that fit one call and
// returns the end of them.
func (sc *vbatchScratch) pack(gpus []GPURef, items []VItem, segs [][]Seg, start int) int {
	sc.arg = VBatchArg{NGPU: uint32(len(gpus))}
	copy(sc.arg.GPUs[:], gpus)
	p := vbatchPacker{a: &sc.arg}
	end := start
	for end < len(items) && p.add(items[end].Key, items[end].Meta, segs[end],
		VBatchEntry{Flags: items[end].Flags, ObjOff: items[end].ObjOff}) {
		end++
	}
	sc.arg.encode(sc.raw[:])
	return end
}

// vresults reads the results of one call's items from raw into res.
func (f *File) vresults(op string, raw []byte, items []VItem, res []BatchResult) {
	for j := range items {
		o := raw[16+j*SizeVBatchEntry:]
		r, v := int64(le.Uint64(o[32:])), le.Uint64(o[40:])
		if r < 0 {
			res[j] = BatchResult{Err: fmt.Errorf("ioctl: %s %s/%s: %w", op, f.path, items[j].Key, unix.Errno(-r))}
		} else {
			res[j] = BatchResult{N: uint64(r), Version: v}
		}
	}
}

// PendingV is a vector batch started with StartBatchPutV or
// StartBatchGetV and not yet waited for: its items' memory is in use by
// the daemon until Wait returns.
type PendingV struct {
	f     *File
	op    string
	items []VItem
	call  int
	sc    *vbatchScratch
}

// StartBatchPutV submits BatchPutV of items that fit one call (at most
// MaxBatch keys whose segments, keys and metas fit the area) and returns
// while the daemon runs it (ABI 1.7). Items name memory the daemon holds
// by Segs: memfd registrations and GPU memory, not Data or registrations
// by address (the daemon refuses process memory in a submitted call:
// EINVAL). That memory must stay as it is until Wait.
func (f *File) StartBatchPutV(gpus []GPURef, items []VItem) (*PendingV, error) {
	return f.startV("batch_putv", CmdBatchPutV, gpus, items)
}

// StartBatchGetV submits BatchGetV of items that fit one call, as
// StartBatchPutV.
func (f *File) StartBatchGetV(gpus []GPURef, items []VItem) (*PendingV, error) {
	return f.startV("batch_getv", CmdBatchGetV, gpus, items)
}

func (f *File) startV(op string, cmd uint32, gpus []GPURef, items []VItem) (*PendingV, error) {
	if len(items) == 0 {
		return nil, f.err(op, ErrBadItem, "no items")
	}
	for i, it := range items {
		if len(it.Data) > 0 {
			return nil, f.err(op, ErrBadItem, "item %d (%s): process memory (Data) cannot be submitted", i, it.Key)
		}
	}
	segs, err := f.vsegs(op, gpus, items)
	if err != nil {
		return nil, err
	}
	sc := vbatchArgs.Get().(*vbatchScratch)
	if end := sc.pack(gpus, items, segs, 0); end != len(items) {
		vbatchArgs.Put(sc)
		return nil, f.err(op, ErrBadItem, "%d items, of which %d fit one call", len(items), end)
	}
	le.PutUint32(sc.raw[4:], VBatchAsync)
	n, err := callResult(f.f, cmd, sc.raw[:])
	if err != nil {
		vbatchArgs.Put(sc)
		return nil, f.err(op, err, "start %d items (%q...)", len(items), items[0].Key)
	}
	return &PendingV{f: f, op: op, items: items, call: n, sc: sc}, nil
}

// Wait blocks until the call is done and returns each item's result, as
// BatchPutV or BatchGetV would have. Call it once.
func (p *PendingV) Wait() ([]BatchResult, error) {
	if p.sc == nil {
		return nil, p.f.err(p.op, ErrBadItem, "call %d waited for already", p.call)
	}
	sc := p.sc
	p.sc = nil
	defer vbatchArgs.Put(sc)
	putHeader(sc.raw[:], Header{Size: SizeVBatchArg})
	le.PutUint32(sc.raw[8:], uint32(p.call))
	if err := call(p.f.f, CmdBatchWait, sc.raw[:]); err != nil {
		return nil, p.f.err(p.op, err, "wait for call %d", p.call)
	}
	res := make([]BatchResult, len(p.items))
	p.f.vresults(p.op, sc.raw[:], p.items, res)
	runtime.KeepAlive(p.items)
	return res, nil
}

// WaitCalls blocks until every call started on f before it is done,
// consuming none of their results (BATCH_WAIT of call 0).
func (f *File) WaitCalls() error {
	sc := vbatchArgs.Get().(*vbatchScratch)
	defer vbatchArgs.Put(sc)
	putHeader(sc.raw[:], Header{Size: SizeVBatchArg})
	le.PutUint32(sc.raw[8:], 0)
	if err := call(f.f, CmdBatchWait, sc.raw[:]); err != nil {
		return f.err("batch_wait", err, "all calls")
	}
	return nil
}
