package ioctl

import (
	"cmp"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// BatchItem is one key of a batch.
type BatchItem struct {
	Key    string // relative to the directory of the batch
	Flags  uint32 // puts: FlagExcl, FlagUpdate, FlagParents; gets: FlagWhole
	ObjOff uint64 // puts with FlagUpdate, and gets
	// Data is the value (BatchPut) or the destination (BatchGet) in this
	// process's memory; only the VM forms read it.
	Data []byte
	// BufOff and Len are the range of the registered buffer; only the
	// buffer forms (BatchPutBuf, BatchGetBuf) read them.
	BufOff, Len uint64
}

// BatchResult is the outcome of one BatchItem.
type BatchResult struct {
	N       uint64 // bytes moved
	Version uint64 // written or read
	// Err is this key's own failure, wrapping its errno
	// (errors.Is(r.Err, unix.ENOENT)); nil on success.
	Err error
}

// batchChunk is one BATCH ioctl: its argument and, for each entry, the
// index of its item. The argument comes from batchArgs; release gives it
// back.
type batchChunk struct {
	sc    *batchScratch
	items []int
}

// batchArgs recycles batch arguments and their wire buffers: a batch of
// one small key should not cost 48 KiB of garbage (and the garbage
// collector's preemption signals, each of which interrupts the FUSE
// request in flight).
var batchArgs = sync.Pool{New: func() any { return new(batchScratch) }}

type batchScratch struct {
	arg BatchArg
	raw [SizeBatchArg]byte
}

func newBatchScratch(source uint32, id uint64) *batchScratch {
	sc := batchArgs.Get().(*batchScratch)
	sc.arg = BatchArg{Source: source, ID: id}
	return sc
}

func releaseChunks(chunks []batchChunk) {
	for _, c := range chunks {
		batchArgs.Put(c.sc)
	}
}

// encodeBatch writes a in wire format into b (SizeBatchArg bytes): what
// a.Marshal returns, without allocating.
func encodeBatch(b []byte, a *BatchArg) {
	putHeader(b, Header{Size: SizeBatchArg, Flags: a.Flags})
	le.PutUint32(b[8:], a.Count)
	le.PutUint32(b[12:], a.Source)
	le.PutUint64(b[16:], a.ID)
	for i := range a.Entries {
		encodeEntry(b[24+i*SizeBatchEntry:], &a.Entries[i])
	}
	copy(b[batchKeysOff:], a.Keys[:])
}

// batchEntryOut reads the out fields of entry i of an encoded batch.
func batchEntryOut(b []byte, i int) (result int64, version uint64) {
	o := b[24+i*SizeBatchEntry:]
	return int64(le.Uint64(o[32:])), le.Uint64(o[40:])
}

// packBatch packs items into as few batch arguments as fit: at most
// MaxBatch entries each, and keys packed into the key area, a new chunk
// starting when either is full. Every key is checked first, so a bad item
// sends nothing.
func packBatch(source uint32, id uint64, items []BatchItem) ([]batchChunk, error) {
	if err := checkItems(source, items); err != nil {
		return nil, err
	}
	var chunks []batchChunk
	var cur *batchChunk
	used := 0 // bytes of cur's key area in use
	for i, it := range items {
		if cur == nil || cur.sc.arg.Count == MaxBatch || used+len(it.Key) > BatchKeyBytes {
			chunks = append(chunks, batchChunk{sc: newBatchScratch(source, id)})
			cur, used = &chunks[len(chunks)-1], 0
		}
		e := BatchEntry{Flags: it.Flags, ObjOff: it.ObjOff, Addr: it.BufOff, Len: it.Len}
		if source == BatchVM {
			e.Addr, e.Len = addrOf(it.Data), uint64(len(it.Data))
		}
		if _, err := cur.sc.arg.AddKey(it.Key, e); err != nil {
			panic(fmt.Sprintf("ioctl: item %d (%s), checked, does not fit: %v", i, it.Key, err))
		}
		used += len(it.Key)
		cur.items = append(cur.items, i)
	}
	return chunks, nil
}

// checkItems checks the items of a batch before any is sent, so that a
// bad one sends nothing: every key fits one call, and each item names
// memory the way its source does.
func checkItems(source uint32, items []BatchItem) error {
	for i, it := range items {
		if len(it.Key) == 0 || len(it.Key) > BatchKeyBytes {
			return fmt.Errorf("item %d: key of %d B (1 to %d): %w", i, len(it.Key), BatchKeyBytes, ErrBadKey)
		}
		if source == BatchVM && (it.BufOff != 0 || it.Len != 0) {
			return fmt.Errorf("item %d (%s): BufOff/Len set in a VM batch: %w", i, it.Key, ErrBadItem)
		}
		if source == BatchBuf && it.Data != nil {
			return fmt.Errorf("item %d (%s): Data set in a buffer batch: %w", i, it.Key, ErrBadItem)
		}
	}
	return nil
}

// batch runs the chunks of items in order. A failed ioctl (a malformed
// batch) stops it: the results of the keys already done stand, and every
// other key's Err is the ioctl's error, which is also returned. Nothing is
// retried: the daemon finishes every request it started (a signal does
// not cancel it), so no key comes back undone.
func (f *File) batch(op string, cmd uint32, source uint32, id uint64, items []BatchItem) ([]BatchResult, error) {
	if source == BatchVM {
		for i := range items {
			keepOnHeap(items[i].Data)
		}
	}
	res := make([]BatchResult, len(items))
	done := make([]bool, len(items))
	err := f.batchOnce(op, cmd, source, id, items, func(i int, r int64, v uint64) {
		if r < 0 {
			res[i] = BatchResult{Err: fmt.Errorf("ioctl: %s %s/%s: %w", op, f.path, items[i].Key, unix.Errno(-r))}
		} else {
			res[i] = BatchResult{N: uint64(r), Version: v}
		}
		done[i] = true
	})
	if err != nil {
		for i := range res {
			if !done[i] {
				res[i].Err = err
			}
		}
		return res, err
	}
	runtime.KeepAlive(items)
	return res, nil
}

// batchOnce packs items and sends them; done gets each entry's result.
// The calls of a batch of more than MaxBatch keys overlap, up to
// BatchInFlight at a time, when their order cannot show (independent);
// otherwise they go one after the other.
func (f *File) batchOnce(op string, cmd uint32, source uint32, id uint64, items []BatchItem, done func(j int, result int64, version uint64)) error {
	if err := checkItems(source, items); err != nil {
		return f.err(op, err, "%d items", len(items))
	}
	if BatchTables && !f.oldABI.Load() {
		var started atomic.Bool // some call of the batch was done
		err := f.batchTables(op, cmd, source, id, items, func(j int, result int64, version uint64) {
			started.Store(true)
			done(j, result, version)
		})
		if started.Load() || !errors.Is(err, unix.ENOTTY) && !errors.Is(err, unix.EPERM) {
			return err
		}
		// A daemon before ABI 1.8 knows no table call (ENOTTY), and one
		// not allowed to read this process's memory refuses it (EPERM):
		// before any key, so the calls refused did nothing.
		f.oldABI.Store(true)
	}
	chunks, err := packBatch(source, id, items)
	if err != nil {
		return f.err(op, err, "%d items", len(items))
	}
	defer releaseChunks(chunks)
	parallel := len(chunks) > 1 && BatchInFlight > 1 && independent(cmd, items)
	var mu sync.Mutex // serializes done
	return runCalls(len(chunks), parallel, func(ci int) error {
		c := &chunks[ci]
		b := c.sc.raw[:]
		encodeBatch(b, &c.sc.arg)
		if err := call(f.f, cmd, b); err != nil {
			first, last := c.items[0], c.items[len(c.items)-1]
			return f.err(op, err, "items %d..%d of %d (%q...)", first, last, len(items), items[first].Key)
		}
		mu.Lock()
		defer mu.Unlock()
		for j, i := range c.items {
			r, v := batchEntryOut(b, j)
			done(i, r, v)
		}
		return nil
	})
}

// runCalls runs call(0) to call(n-1): in order, or, when parallel, up to
// BatchInFlight at a time, taken in order. Once one fails no new one
// starts (those running finish: the daemon ends every request it
// began); the first failure is returned.
func runCalls(n int, parallel bool, call func(i int) error) error {
	if !parallel {
		for i := range n {
			if err := call(i); err != nil {
				return err
			}
		}
		return nil
	}
	var (
		mu    sync.Mutex
		next  int
		first error
		wg    sync.WaitGroup
	)
	for range min(BatchInFlight, n) {
		wg.Go(func() {
			for {
				mu.Lock()
				i := next
				if first != nil || i == n {
					mu.Unlock()
					return
				}
				next++
				mu.Unlock()
				if err := call(i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
					}
					mu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	return first
}

// BatchInFlight is how many calls of one batch may be in the daemon at
// once, each on its own daemon thread, when the batch is cut into more
// than one call. 1 sends them one after the other. The default is half
// the CPUs, at least 2 and at most 4: on the 2-CPU VM, two calls at once
// moved 4 KiB keys faster than one call of both (kv-put-host-4KiB 4.2 to
// 5.0 times tmpfs, kv-get-host-vm-4KiB 2.6 to 2.8, medians of four
// interleaved runs), since the daemon keeps a spare thread for its FUSE
// readers. Set it before any batch runs, not while one does.
var BatchInFlight = min(4, max(2, runtime.NumCPU()/2))

// BatchTables says whether batches go as table calls (ABI 1.8), their
// entries read from this process's memory. A File whose daemon refuses
// the first table call of a batch with ENOTTY (before ABI 1.8) or EPERM
// (not allowed to read this process's memory: no CAP_SYS_PTRACE, Yama)
// sends BATCH_PUT and BATCH_GET calls of MaxBatch keys from then on, as
// all do with BatchTables false. Set it before any batch runs, not while
// one does.
var BatchTables = true

// BatchCallKeys is the most keys one table call of a batch carries:
// MaxBatch to MaxTable. A batch whose calls may overlap is cut into calls
// of about len/BatchInFlight keys, at least MaxBatch and at most
// BatchCallKeys; any other batch into calls of BatchCallKeys, one after
// the other (a get whose destinations overlap also ends a call before an
// item that overlaps one in it). Set it before any batch runs, not while
// one does.
var BatchCallKeys = MaxTable

// independent says whether the calls of a batch may overlap: gets when
// no two items' destinations overlap (the later one's bytes must stay);
// puts when no key comes twice (a later entry of a key must land last),
// no key is a directory of another ("x" and "x/y": which one fails
// depends on which lands first) and FlagParents is on every key or on
// none (a key without it may need a directory that an earlier key's put
// makes).
func independent(cmd uint32, items []BatchItem) bool {
	if cmd != CmdBatchPut {
		type span struct{ lo, hi uint64 }
		spans := make([]span, 0, len(items))
		for _, it := range items {
			lo, n := it.BufOff, it.Len
			if it.Data != nil {
				lo, n = addrOf(it.Data), uint64(len(it.Data))
			}
			if n > 0 {
				spans = append(spans, span{lo, lo + n})
			}
		}
		slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.lo, b.lo) })
		var end uint64 // the furthest end of the spans before
		for i, s := range spans {
			if i > 0 && s.lo < end {
				return false
			}
			end = max(end, s.hi)
		}
		return true
	}
	seen := make(map[string]struct{}, len(items))
	parents, nested := 0, false
	for _, it := range items {
		if _, dup := seen[it.Key]; dup {
			return false
		}
		seen[it.Key] = struct{}{}
		if it.Flags&FlagParents != 0 {
			parents++
		}
		nested = nested || strings.IndexByte(it.Key, '/') >= 0
	}
	if nested {
		for _, it := range items {
			for i := range len(it.Key) {
				if it.Key[i] == '/' {
					if _, dir := seen[it.Key[:i]]; dir {
						return false
					}
				}
			}
		}
	}
	return parents == 0 || parents == len(items)
}

// BatchPut stores each item's Data as the value of its key (relative to
// directory f, parents existing) with one copy each, in calls of up to
// BatchCallKeys keys (see BatchTables). Each key succeeds or fails alone
// (BatchResult.Err); the error is for a batch the daemon refused whole.
func (f *File) BatchPut(items []BatchItem) ([]BatchResult, error) {
	return f.batch("batch_put", CmdBatchPut, BatchVM, 0, items)
}

// BatchGet reads each key into its item's Data from ObjOff; N is the count
// read (short at the end of the value).
func (f *File) BatchGet(items []BatchItem) ([]BatchResult, error) {
	return f.batch("batch_get", CmdBatchGet, BatchVM, 0, items)
}

// BatchPutBuf is BatchPut from registration id (made on f) at each item's
// BufOff, Len bytes.
func (f *File) BatchPutBuf(id uint64, items []BatchItem) ([]BatchResult, error) {
	return f.batch("batch_put", CmdBatchPut, BatchBuf, id, items)
}

// BatchGetBuf is BatchGet into registration id (made on f) at each item's
// BufOff, up to Len bytes.
func (f *File) BatchGetBuf(id uint64, items []BatchItem) ([]BatchResult, error) {
	return f.batch("batch_get", CmdBatchGet, BatchBuf, id, items)
}
