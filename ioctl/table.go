package ioctl

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sync"
)

// ABI 1.8: batches whose entries stay in the caller's memory.
//
// BATCH_PUT_TABLE and BATCH_GET_TABLE run a batch as BATCH_PUT and
// BATCH_GET do (the same entries, flags, sources and per-key results),
// but the ioctl's argument is a small TableArg naming the entry table and
// the key bytes in the caller's own memory, so one call carries up to
// MaxTable keys: a batch of a thousand keys is one FUSE round trip, not
// sixteen, and the kernel copies 48 bytes each way instead of 16 KiB.
// The daemon reads the table and keys once, when the call starts, and
// before running any key checks that it can write the table (EFAULT, and
// nothing is done, when either fails). When the call ends it writes every
// entry back with its out fields set (Result, Version, and a get's Len),
// the in fields as it read them. The memory must stay mapped, writable and
// unchanged until the ioctl returns; if the caller unmaps it meanwhile
// the ioctl fails with EFAULT after the keys were done. The calls are not
// submitted (TableArg has no async flag).
var (
	CmdBatchPutTable = ioc(dirRead|dirWrite, 0x20, SizeTableArg)
	CmdBatchGetTable = ioc(dirRead|dirWrite, 0x21, SizeTableArg)
)

// Limits of a table call.
const (
	// MaxTable is the most entries one table call carries.
	MaxTable = 1024
	// MaxTableKeyBytes is the most key bytes one table call carries
	// (BatchEntry.KeyOff is 16 bits).
	MaxTableKeyBytes = 1 << 16
)

// TableArg is BATCH_PUT_TABLE / BATCH_GET_TABLE on a directory.
type TableArg struct {
	Header
	Count   uint32 // in: entries, 1 to MaxTable
	Source  uint32 // in: BatchBuf or BatchVM
	ID      uint64 // in: registered buffer for BatchBuf
	Entries uint64 // in: address of Count entries, SizeBatchEntry bytes each
	Keys    uint64 // in: address of the key bytes the entries' KeyOff index
	KeysLen uint32 // in: at most MaxTableKeyBytes
	_       uint32 // zero
}

// SizeTableArg is the wire size of TableArg.
const SizeTableArg = 48

// ErrBadTable is a table call's argument out of its limits.
var ErrBadTable = errors.New("ioctl: bad table")

// Marshal encodes a.
func (a *TableArg) Marshal() []byte {
	b := make([]byte, SizeTableArg)
	a.MarshalInto(b)
	return b
}

// MarshalInto encodes a into b, which holds at least SizeTableArg bytes.
func (a *TableArg) MarshalInto(b []byte) {
	putHeader(b, Header{Size: SizeTableArg, Flags: a.Flags})
	le.PutUint32(b[8:], a.Count)
	le.PutUint32(b[12:], a.Source)
	putU64s(b[16:], a.ID, a.Entries, a.Keys)
	le.PutUint32(b[40:], a.KeysLen)
	le.PutUint32(b[44:], 0)
}

// Unmarshal decodes a from b and checks its limits (ErrBadTable): the
// count, the source, the key bytes, and flags and padding zero.
func (a *TableArg) Unmarshal(b []byte) error {
	h, err := getHeader(b, SizeTableArg)
	if err != nil {
		return err
	}
	*a = TableArg{Header: h, Count: le.Uint32(b[8:]), Source: le.Uint32(b[12:]), KeysLen: le.Uint32(b[40:])}
	getU64s(b[16:], &a.ID, &a.Entries, &a.Keys)
	if pad := le.Uint32(b[44:]); a.Count == 0 || a.Count > MaxTable || a.Source != BatchBuf && a.Source != BatchVM ||
		a.KeysLen > MaxTableKeyBytes || a.Flags != 0 || pad != 0 {
		return fmt.Errorf("count %d, source %d, %d key bytes, flags %#x, padding %#x: %w", a.Count, a.Source, a.KeysLen, a.Flags, pad, ErrBadTable)
	}
	return nil
}

// TableBytes is the size of a table of n entries.
func TableBytes(n int) int { return n * SizeBatchEntry }

// DecodeEntries decodes the entries of table b (TableBytes(len(es))
// bytes) into es.
func DecodeEntries(es []BatchEntry, b []byte) {
	for i := range es {
		decodeEntry(&es[i], b[i*SizeBatchEntry:])
	}
}

// EncodeEntries encodes es into table b, the inverse of DecodeEntries.
func EncodeEntries(b []byte, es []BatchEntry) {
	for i := range es {
		encodeEntry(b[i*SizeBatchEntry:], &es[i])
	}
}

func decodeEntry(e *BatchEntry, o []byte) {
	var res uint64
	e.KeyOff, e.KeyLen, e.Flags = le.Uint16(o[0:]), le.Uint16(o[2:]), le.Uint32(o[4:])
	getU64s(o[8:], &e.Addr, &e.Len, &e.ObjOff, &res, &e.Version)
	e.Result = int64(res)
}

func encodeEntry(o []byte, e *BatchEntry) {
	le.PutUint16(o[0:], e.KeyOff)
	le.PutUint16(o[2:], e.KeyLen)
	le.PutUint32(o[4:], e.Flags)
	putU64s(o[8:], e.Addr, e.Len, e.ObjOff, uint64(e.Result), e.Version)
}

// EntryKey returns e's key in keys, or an error if it is empty or lies
// outside them.
func EntryKey(keys []byte, e *BatchEntry) ([]byte, error) {
	end := int(e.KeyOff) + int(e.KeyLen)
	if e.KeyLen == 0 || end > len(keys) {
		return nil, fmt.Errorf("key [%d+%d) outside %d B: %w", e.KeyOff, e.KeyLen, len(keys), ErrShortArg)
	}
	return keys[e.KeyOff:end], nil
}

// tableBuf is the memory of one table call of a client: its entries, its
// keys and its argument, reused between calls (the daemon reads them
// where they are, so they stay on the heap while the call runs).
type tableBuf struct {
	tab  [MaxTable * SizeBatchEntry]byte
	keys [MaxTableKeyBytes]byte
	arg  [SizeTableArg]byte
}

var tableBufs = sync.Pool{New: func() any { return new(tableBuf) }}

// tableKeys is how many keys go in one table call of a batch of n keys
// whose calls may overlap (parallel) or not (see BatchCallKeys).
func tableKeys(n int, parallel bool) int {
	most := min(MaxTable, max(MaxBatch, BatchCallKeys))
	if !parallel {
		return most
	}
	return min(most, max(MaxBatch, (n+BatchInFlight-1)/BatchInFlight))
}

// batchTables runs checked items as table calls (see batchOnce).
func (f *File) batchTables(op string, cmd uint32, source uint32, id uint64, items []BatchItem, done func(j int, result int64, version uint64)) error {
	tcmd := CmdBatchPutTable
	if cmd == CmdBatchGet {
		tcmd = CmdBatchGetTable
	}
	calls, parallel := tableCalls(cmd, items)
	var mu sync.Mutex // serializes done
	return runCalls(len(calls), parallel, func(ci int) error {
		lo, hi := calls[ci][0], calls[ci][1]
		b := tableBufs.Get().(*tableBuf)
		defer tableBufs.Put(b)
		kb := 0
		for j := lo; j < hi; j++ {
			it := &items[j]
			e := BatchEntry{KeyOff: uint16(kb), KeyLen: uint16(len(it.Key)), Flags: it.Flags, ObjOff: it.ObjOff, Addr: it.BufOff, Len: it.Len}
			if source == BatchVM {
				e.Addr, e.Len = addrOf(it.Data), uint64(len(it.Data))
			}
			kb += copy(b.keys[kb:], it.Key)
			encodeEntry(b.tab[(j-lo)*SizeBatchEntry:], &e)
		}
		a := TableArg{Count: uint32(hi - lo), Source: source, ID: id, Entries: addrOf(b.tab[:]), Keys: addrOf(b.keys[:]), KeysLen: uint32(kb)}
		a.MarshalInto(b.arg[:])
		if err := call(f.f, tcmd, b.arg[:]); err != nil {
			return f.err(op, err, "items %d..%d of %d (%q...)", lo, hi-1, len(items), items[lo].Key)
		}
		mu.Lock()
		defer mu.Unlock()
		for j := lo; j < hi; j++ {
			o := b.tab[(j-lo)*SizeBatchEntry:]
			done(j, int64(le.Uint64(o[32:])), le.Uint64(o[40:]))
		}
		return nil
	})
}

// tableCalls cuts a batch into table calls, items [lo, hi) each, and
// says whether they may overlap.
func tableCalls(cmd uint32, items []BatchItem) (calls [][2]int, parallel bool) {
	// A get's destinations that overlap must be written in order, the
	// later last; inside one call the daemon may copy them at once. So
	// such a get goes as calls one after the other, each ending before an
	// item whose destination overlaps one already in it.
	var cut []bool
	if cmd == CmdBatchGet && len(items) > 1 {
		if !independent(cmd, items) {
			cut = overlapCuts(items)
		} else {
			parallel = len(items) > MaxBatch && BatchInFlight > 1
		}
	} else {
		parallel = len(items) > MaxBatch && BatchInFlight > 1 && independent(cmd, items)
	}
	per := tableKeys(len(items), parallel)
	parallel = parallel && len(items) > per
	lo, kb := 0, 0
	for i, it := range items {
		if i-lo == per || kb+len(it.Key) > MaxTableKeyBytes || cut != nil && cut[i] && i > lo {
			calls = append(calls, [2]int{lo, i})
			lo, kb = i, 0
		}
		kb += len(it.Key)
	}
	if lo < len(items) {
		calls = append(calls, [2]int{lo, len(items)})
	}
	return calls, parallel
}

// overlapCuts says, for each item of a get, whether its destination
// overlaps that of an item before it since the last cut: where a call
// must end so that no call holds two that overlap.
func overlapCuts(items []BatchItem) []bool {
	type span struct{ lo, hi uint64 }
	cut := make([]bool, len(items))
	var in []span // the current call's destinations, by start
	for i, it := range items {
		lo, n := it.BufOff, it.Len
		if it.Data != nil {
			lo, n = addrOf(it.Data), uint64(len(it.Data))
		}
		if n == 0 {
			continue
		}
		s := span{lo, lo + n}
		at, _ := slices.BinarySearchFunc(in, s, func(a, b span) int { return cmp.Compare(a.lo, b.lo) })
		if at > 0 && in[at-1].hi > s.lo || at < len(in) && in[at].lo < s.hi {
			cut[i], in = true, in[:0]
			at = 0
		}
		in = slices.Insert(in, at, s)
	}
	return cut
}
