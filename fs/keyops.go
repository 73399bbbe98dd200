package fs

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Keys by name on a directory handle: BATCH_PUT/GET, their vector forms
// and the one-key PUT_KEY/GET_KEY all decode into keyOps and run through
// the same code (batchPut, batchGet, putOne), so every form checks,
// places, copies and commits a key the same way.

var errMetaMismatch = errors.New("fs: the value's meta is not the one asked for")

// errValueTooLong fails a get with FlagWhole whose value does not fit.
var errValueTooLong = errors.New("fs: the value is longer than the buffers")

// segKind says where a segment's bytes are.
type segKind uint8

const (
	segVM  segKind = iota // the caller's memory, by address
	segReg                // a registration of the directory handle
	segGPU                // an allocation of the call's GPU table
	segMem                // the daemon's own memory: a KEY_INLINE call's data
)

// wireKind is the kind of a vector batch segment that names id (the
// one rule: decodeVEntry and submittable both go by it).
func wireKind(id uint64) segKind {
	switch {
	case id == ioctl.SegVM:
		return segVM
	case id&ioctl.SegGPU != 0:
		return segGPU
	}
	return segReg
}

// seg is one range of a key's value, in order.
type seg struct {
	kind segKind
	id   uint64 // segReg: the registration
	gpu  int    // segGPU: index in batchCall.gpus
	mem  []byte // segMem: n bytes
	off  uint64
	n    uint64
}

// keyOp is one key of a call and its outcome.
type keyOp struct {
	rel    string
	key    string // rel under the call's directory, when decoded with it ("": Join)
	flags  uint32
	objOff uint64
	segs   []seg
	// setMeta: the put stores meta as user.mooncake.meta (nil: removes
	// it); see putMeta. For a get, a non-nil meta is the one the value
	// must have. meta is in the call's argument, which outlives the
	// call's ops: whatever keeps it past them copies it (metaXattrs).
	setMeta bool
	meta    []byte

	err     error  // out: this key's failure (or a decoding error, in)
	n       uint64 // out: bytes moved
	version uint64 // out
	size    uint64 // out (get): the value's size
	gotMeta []byte // out (get): the value's meta
}

// setKey sets op's key and rel from rel's wire bytes under directory dir:
// one allocation, rel a part of the key.
func (op *keyOp) setKey(dir string, rel []byte) {
	if dir == "" {
		op.key = string(rel)
		op.rel = op.key
		return
	}
	op.key = dir + "/" + string(rel)
	op.rel = op.key[len(dir)+1:]
}

// fullKey returns op's key under dir, joining dir and op.rel when op's
// key is not that yet (not decoded with the call's directory, or made
// under the directory's name before a rename: followDir).
func (op *keyOp) fullKey(dir string) string {
	if op.key == "" || !underDir(op.key, dir, op.rel) {
		op.key = store.Join(dir, op.rel)
	}
	return op.key
}

// underDir says whether key is rel under dir.
func underDir(key, dir, rel string) bool {
	if dir == "" {
		return len(key) == len(rel)
	}
	return len(key) == len(dir)+1+len(rel) && key[:len(dir)] == dir
}

func (op *keyOp) fail(err error) {
	op.err, op.n, op.version = err, 0, 0
}

// check refuses flags the command does not take (puts: FlagExcl and
// FlagUpdate, the latter for an offset; gets: FlagWhole) and takes meta
// (copied) as op's.
func (op *keyOp) check(put bool, meta []byte) error {
	if put {
		if err := checkPut(op.flags, op.objOff); err != nil {
			return err
		}
	} else if op.flags&^ioctl.FlagWhole != 0 {
		return fmt.Errorf("get flags %#x: %w", op.flags, ioctl.ErrFlags)
	}
	if len(meta) > 0 {
		op.meta = meta // the call's argument's: it outlives the call's ops
	}
	op.setMeta = put && putMeta(op.flags, op.meta)
	return nil
}

// result is op's outcome in the wire form: bytes or -errno, and the
// version.
func (op *keyOp) result() (int64, uint64) {
	if op.err != nil {
		return -int64(toErrno(op.err)), 0
	}
	return int64(op.n), op.version
}

// runOps runs the puts (put) or the gets of a call.
func (n *node) runOps(ctx context.Context, bc *batchCall, put bool, ops []*keyOp) {
	if put {
		n.runPuts(ctx, bc, ops)
	} else {
		n.batchGet(ctx, bc, ops)
	}
}

// batchCall is what every key of one call shares.
type batchCall struct {
	dh       *dirHandle
	p        *callerProc
	dir      string
	uid, gid uint32
	gpus     []ioctl.GPURef
	// mapped are the GPU table's allocations, opened on first use, each
	// held for the whole call (release drops them).
	mapped []*ipcMapping
	mapErr []error
	// held are the registrations the call's segments use, each held once
	// for the call; lastReg is the last one looked up, with its id (a
	// call's keys mostly name one: looked up, and held, once).
	held      []*registration
	lastReg   *registration
	lastRegID uint64
	// vmChecked is the last registration of process memory the call's
	// thread was found to belong to (regBuffer).
	vmChecked *registration
	// arena holds the keys' buffer lists (buffers): its first block is
	// the call's opSet's, where it has one.
	arena []transfer.Buffer
	// searched caches checkPath per parent directory for the call: the
	// keys of a batch mostly share one.
	searched store.DirMemo[searchedDir]
	// metaSets are the SetXattrs of the call's metas (metaXattrs).
	metaSets map[string]map[string][]byte
	// for the batch figures: the mount, the call's keys and its start.
	f     *FS
	keys  int
	start time.Time
	// submitted: the call runs after its ioctl returned (VBatchAsync),
	// so it may not touch process memory (errAsyncVM).
	submitted bool
}

// searchedDir is what checkPath found of a parent directory: the error,
// else the directory and the group its new entries take.
type searchedDir struct {
	err error
	dir *store.Object
	gid uint32
}

// checkPath is FS.checkPath for key, once per parent directory a call.
func (bc *batchCall) checkPath(ctx context.Context, f *FS, key string) error {
	parent := store.Parent(key)
	if d, ok := bc.searched.Get(parent); ok {
		return d.err
	}
	dir, err := f.checkPath(ctx, bc.p, bc.dir, key)
	d := searchedDir{err: err, dir: dir, gid: bc.gid}
	if err == nil && dir.Mode&syscall.S_ISGID != 0 {
		d.gid = dir.Gid // a setgid directory: its group (as node.template)
	}
	bc.searched.Put(parent, d)
	return err
}

// groupFor is the group of a new file at key, whose path the call has
// checked: the caller's, or its setgid directory's.
func (bc *batchCall) groupFor(key string) uint32 {
	if d, ok := bc.searched.Get(store.Parent(key)); ok && d.err == nil {
		return d.gid
	}
	return bc.gid
}

// buffers returns an empty slice with room for n buffers, cut from
// blocks shared by the call's keys (one allocation for many keys, sized
// for the call: a one-key call does not clear a block of 64).
func (bc *batchCall) buffers(n int) []transfer.Buffer {
	if cap(bc.arena)-len(bc.arena) < n {
		bc.arena = make([]transfer.Buffer, 0, max(n, min(bc.keys, 64)))
	}
	at := len(bc.arena)
	bc.arena = bc.arena[:at+n]
	return bc.arena[at : at : at+n]
}

// gpuBuffer resolves [off, off+n) of the call's GPU allocation i.
func (bc *batchCall) gpuBuffer(f *FS, i int, off, n uint64) (transfer.Buffer, error) {
	if i >= len(bc.gpus) {
		return transfer.Buffer{}, fmt.Errorf("GPU %d of %d: %w", i, len(bc.gpus), errBadBatch)
	}
	if bc.mapped == nil {
		bc.mapped, bc.mapErr = make([]*ipcMapping, len(bc.gpus)), make([]error, len(bc.gpus))
	}
	if bc.mapped[i] == nil && bc.mapErr[i] == nil {
		bc.mapped[i], bc.mapErr[i] = f.gpuMapping(bc.p, bc.gpus[i])
	}
	if err := bc.mapErr[i]; err != nil {
		return transfer.Buffer{}, err
	}
	return mappedRange(bc.mapped[i], off, n)
}

// release drops what the call held.
func (bc *batchCall) release(f *FS) {
	for _, r := range bc.held {
		r.inflight.Done()
	}
	bc.held, bc.vmChecked, bc.lastReg = nil, nil, nil
	for _, m := range bc.mapped {
		if m != nil {
			f.releaseMapping(m)
		}
	}
}

// newBatchCall starts a call of keys keys; the caller ends it with
// bc.end once the keys are done.
func (n *node) newBatchCall(ctx context.Context, dh *dirHandle, dir string, gpus []ioctl.GPURef, keys int) (*batchCall, error) {
	p, err := procOf(ctx)
	if err != nil {
		return nil, err
	}
	uid, gid := caller(ctx)
	return &batchCall{dh: dh, p: p, dir: dir, uid: uid, gid: gid, gpus: gpus, f: n.fs, keys: keys, start: time.Now()}, nil
}

// end releases what the call held and adds it to the batch figures.
func (bc *batchCall) end() {
	bc.release(bc.f)
	bc.f.batches.keys.Add(uint64(bc.keys))
	bc.f.batches.handlerNs.Add(uint64(time.Since(bc.start)))
}

// opSet is the keyOps of one call, kept between calls (opSets), with the
// blocks its keys' segments and buffer lists are cut from first (segBlock,
// bufBlock): nothing holds them past the call, and a call of 64 keys
// otherwise made and cleared about 10 KiB of them on the heap.
type opSet struct {
	ops  []keyOp
	ptrs []*keyOp
	// The call's blocks: their lengths are what it was handed, what
	// release clears.
	segs []seg
	bufs []transfer.Buffer
}

var opSets = sync.Pool{New: func() any { return new(opSet) }}

// newOps returns a set of count zero keyOps (ptrs); its release gives
// them back once the call's results are out.
func newOps(count uint32) *opSet {
	set := opSets.Get().(*opSet)
	if cap(set.ops) < int(count) {
		set.ops, set.ptrs = make([]keyOp, count), make([]*keyOp, count)
	}
	set.ops, set.ptrs = set.ops[:count], set.ptrs[:count]
	for i := range set.ops {
		set.ptrs[i] = &set.ops[i]
	}
	return set
}

// segBlock returns the set's block of n zero segments. Call it once.
func (set *opSet) segBlock(n int) []seg {
	if cap(set.segs) < n {
		set.segs = make([]seg, n)
	}
	set.segs = set.segs[:n]
	return set.segs[:n:n]
}

// bufBlock returns the set's block of buffers, empty with room for n, for
// batchCall.arena. Call it once.
func (set *opSet) bufBlock(n int) []transfer.Buffer {
	if cap(set.bufs) < n {
		set.bufs = make([]transfer.Buffer, n)
	}
	set.bufs = set.bufs[:n]
	return set.bufs[:0:n]
}

// release clears the set and keeps it for another call.
func (set *opSet) release() {
	clear(set.ops)
	clear(set.segs)
	clear(set.bufs)
	set.segs, set.bufs = set.segs[:0], set.bufs[:0]
	opSets.Put(set)
}

// runPuts runs the puts of a call in order: each run of plain puts (no
// flags but FlagExcl and FlagParents, at offset 0) is one transfer
// (batchPut), done before the next put with other flags, which goes
// alone (putOne).
func (n *node) runPuts(ctx context.Context, bc *batchCall, ops []*keyOp) {
	var run []*keyOp
	for _, op := range ops {
		if op.err != nil {
			continue
		}
		if op.flags&^(ioctl.FlagExcl|ioctl.FlagParents) == 0 && op.objOff == 0 {
			run = append(run, op)
			continue
		}
		if len(run) > 0 {
			n.batchPut(ctx, bc, run)
			run = run[:0]
		}
		n.putAlone(ctx, bc, op)
	}
	if len(run) > 0 {
		n.batchPut(ctx, bc, run)
	}
}

// putAlone runs op through putOne and records its outcome.
func (n *node) putAlone(ctx context.Context, bc *batchCall, op *keyOp) {
	size, ver, err := n.putOne(ctx, bc, op)
	if err != nil {
		op.fail(err)
		return
	}
	op.n, op.version = size, ver
}

// target checks op's key and resolves its segments into buffers, held
// until the call ends (bc.release).
func (n *node) target(ctx context.Context, bc *batchCall, op *keyOp) (key string, bufs []transfer.Buffer, size uint64, err error) {
	return n.targetAfter(ctx, bc, op, nil)
}

// targetAfter is target that runs beforeParents, when given, before it
// makes a key's missing directories (FlagParents), or looks again at a
// path it found missing: batchPut commits the keys it checked so far
// there, for the call's keys act in their order and an earlier one may
// be where a directory would go, or on the path (a file there makes it
// ENOTDIR, as a put of one key after the other says).
func (n *node) targetAfter(ctx context.Context, bc *batchCall, op *keyOp, beforeParents func()) (key string, bufs []transfer.Buffer, size uint64, err error) {
	if err = ctx.Err(); err != nil {
		return // a submitted call whose handle closed: its keys stop here
	}
	if err = store.ValidateKey(op.rel); err != nil {
		return
	}
	if key = op.fullKey(bc.dir); len(key) > store.MaxKeyLen {
		err = store.ErrNameTooLong
		return
	}
	err = bc.checkPath(ctx, n.fs, key)
	for try := 0; errors.Is(err, store.ErrNotFound) && try < maxPutRetries && n.followDir(ctx, bc, op); try++ {
		// The call's directory moved: its keys follow it (fullKey joins
		// the key again; batchPut looks it up again under the new name).
		if key = op.fullKey(bc.dir); len(key) > store.MaxKeyLen {
			err = store.ErrNameTooLong
			return
		}
		err = bc.checkPath(ctx, n.fs, key)
	}
	if errors.Is(err, store.ErrNotFound) && op.flags&ioctl.FlagParents == 0 && beforeParents != nil {
		beforeParents()
		bc.searched.Forget(store.Parent(key))
		err = bc.checkPath(ctx, n.fs, key)
	}
	for try := 0; errors.Is(err, store.ErrNotFound) && op.flags&ioctl.FlagParents != 0 && try < maxParentTries; try++ {
		if try == 0 && beforeParents != nil {
			beforeParents()
		}
		// Another client may remove a directory made here before the
		// path is checked again (an rmdir of what is still empty): make
		// it again. Once the path checks, the put lands.
		if err = n.fs.makeParents(ctx, bc.p, bc.uid, bc.gid, bc.dir, key); err == nil {
			bc.searched.Forget(store.Parent(key))
			err = bc.checkPath(ctx, n.fs, key)
		}
	}
	if err != nil {
		return
	}
	bufs = bc.buffers(len(op.segs))
	for _, s := range op.segs {
		if s.n == 0 && s.kind != segReg {
			continue // no bytes: nothing to resolve (a lookup by name)
		}
		var b transfer.Buffer
		switch s.kind {
		case segVM:
			if bc.submitted {
				return "", nil, 0, errAsyncVM
			}
			b = transfer.VMBuffer(bc.p.tid, s.off, s.n)
		case segReg:
			r := bc.lastReg
			if r == nil || bc.lastRegID != s.id {
				if r, err = bc.dh.regs.get(s.id); err != nil {
					return "", nil, 0, err
				}
				bc.held = append(bc.held, r)
				bc.lastReg, bc.lastRegID = r, s.id
			}
			if b, err = r.buffer(bc.p.tid, s.off, s.n, bc.vmChecked); err == nil {
				if r.vmTgid != 0 {
					if bc.submitted {
						return "", nil, 0, errAsyncVM
					}
					bc.vmChecked = r
				}
			}
		case segGPU:
			b, err = bc.gpuBuffer(n.fs, s.gpu, s.off, s.n)
		case segMem:
			b = transfer.HostBuffer(s.mem)
		}
		if err != nil {
			return "", nil, 0, err
		}
		if size+b.Size() < size {
			return "", nil, 0, fmt.Errorf("segments of %s: %w", op.rel, store.ErrTooLarge)
		}
		size += b.Size()
		bufs = append(bufs, b)
	}
	return key, bufs, size, nil
}

// putMeta says whether a put with flags and meta (nil: none) sets the
// value's meta: the meta describes the bytes, so a put that replaces them
// all sets it (none removes it), and an update keeps it unless it brings
// one.
func putMeta(flags uint32, meta []byte) bool {
	return flags&ioctl.FlagUpdate == 0 || len(meta) > 0
}

// metaXattrs is what a put of op over version cur (nil: none) sets with
// its commit (which acts only on cur). Keys of the call with the same
// meta share one map (a commit only reads it): a batch of tensors mostly
// has one shape, and a map a key was most of what its meta cost.
func (bc *batchCall) metaXattrs(op *keyOp, cur *store.Object) map[string][]byte {
	if !op.setMeta {
		return nil
	}
	if len(op.meta) > 0 {
		if set, ok := bc.metaSets[string(op.meta)]; ok {
			return set
		}
		// Its own copy of the meta (op.meta is in the call's argument,
		// which is reused): new keys take the set as it is
		// (store.PutSpec.SharedXattrs), and the set is never changed.
		set := map[string][]byte{xattrMeta: bytes.Clone(op.meta)}
		if bc.metaSets == nil {
			bc.metaSets = map[string]map[string][]byte{}
		}
		bc.metaSets[string(op.meta)] = set
		return set
	}
	if cur == nil || cur.Xattrs[xattrMeta] == nil {
		return nil // nothing to remove
	}
	return dropMeta
}

// gpuChunkKeys is how many keys of a call with GPU buffers go to the
// copy engines together: a call's chunks are pipelined, the next chunk's
// copies running while the keys of the one before commit (puts) or
// while the next chunk is looked up (gets). On the H200 host 32 did best
// of 8 to 64 (2026-12-01): smaller chunks pay their commit's fixed work
// more often, a whole call of 64 waits for its copies unhidden.
const gpuChunkKeys = 32

// openKeys is how many keys of a get batchGet opens at once: a GPU
// chunk's worth, so that a chunk's copies start once its keys are
// opened (a window's keys that fail their checks shift the chunks by as
// many keys).
const openKeys = gpuChunkKeys

// lookupKeys is how many keys of a put batchPut looks up at once.
const lookupKeys = 64

// chunkAlways chunks calls without GPU buffers too, and chunkKeys is the
// chunk size (tests: the chunked path without a GPU, more chunk
// boundaries than a call of MaxBatch keys has).
var (
	chunkAlways = false
	chunkKeys   = gpuChunkKeys
)

// putPending is a key of batchPut between its check and its commit.
type putPending struct {
	op   *keyOp
	key  string
	size uint64
	cur  *store.Object
	tmpl store.Object // the new key's attributes
	d    *store.Draft
}

// putChunk is the keys of batchPut whose bytes move as one transfer: most
// as one store batch (StartPuts), those it cannot place (in a cluster)
// through drafts.
type putChunk struct {
	fast   []*keyOp
	specs  []store.PutSpec
	puts   *store.Puts
	ps     []putPending
	writes []store.DraftWrite
	w      *store.Writes
	gpu    bool // some key's bytes come from GPU memory
	// negs is commitChunk's scratch: the entries of new names to look
	// up in the negative answers.
	negs []invalidation
}

// putChunks holds chunks of earlier calls (release): their slices of
// specs are kilobytes, cheaper reused than made.
var putChunks = sync.Pool{New: func() any { return new(putChunk) }}

// newPutChunk returns an empty chunk with room for keys keys.
func newPutChunk(keys int) *putChunk {
	c := putChunks.Get().(*putChunk)
	if cap(c.fast) < keys {
		c.fast, c.specs = make([]*keyOp, 0, keys), make([]store.PutSpec, 0, keys)
	}
	return c
}

// release gives c back for later calls once its keys are done.
func (c *putChunk) release() {
	clear(c.fast)
	clear(c.specs)
	*c = putChunk{fast: c.fast[:0], specs: c.specs[:0], negs: c.negs[:0]}
	putChunks.Put(c)
}

// keys returns how many keys c holds.
func (c *putChunk) keys() int { return len(c.fast) + len(c.ps) }

// batchPut runs a run of plain puts (no flags but FlagExcl and
// FlagParents, offset 0) as few transfers: every key is checked and gets its draft first, then the
// bytes of all the keys move in one engine batch (one process_vm_readv
// per run of keys of the caller's memory); from GPU memory, chunks of
// gpuChunkKeys keys, each chunk's copies running while the chunk before
// commits. Each key commits on its own; a key whose check, copy or commit
// fails gets its own error and leaves nothing, and never keeps the others
// from committing. A key that changed between its check and its commit
// goes the one-key way again (putOne), which checks it anew; so does one
// that found no room while the others held theirs.
func (n *node) batchPut(ctx context.Context, bc *batchCall, ops []*keyOp) {
	var chunks []*putChunk
	defer func() {
		for _, c := range chunks {
			if c.w != nil {
				c.w.Wait()
			}
			for _, pp := range c.ps {
				pp.d.Close()
			}
			if c.puts == nil {
				c.release() // committed (a chunk left uncommitted by a panic is garbage)
			}
		}
	}()
	var invs []invalidation
	defer func() { applyAll(ctx, invs) }()
	var again []*keyOp
	done := 0 // chunks committed
	start := func(c *putChunk) {
		if len(c.specs) > 0 {
			c.puts = n.fs.st.StartPuts(ctx, c.specs)
		}
		if len(c.writes) > 0 {
			c.w = n.fs.st.StartWrites(ctx, c.writes)
		}
	}
	// changes counts what the call did to the namespace so far (chunks
	// committed, keys put alone, directories made): the keys' objects
	// looked up before one are looked up again.
	changes := 0
	commitUpTo := func(k int) {
		for ; done < k; done++ {
			n.commitChunk(ctx, bc, chunks[done], &invs, &again)
			changes++
		}
	}
	// New keys of one directory share its placement and its permission
	// check: looked up once per call.
	type dirInfo struct {
		place store.Placement
		err   error
	}
	var dirs store.DirMemo[dirInfo]
	var dirPlaces store.DirMemo[store.Placement] // of the directories of replaced keys
	cur := newPutChunk(len(ops))
	chunks = append(chunks, cur)
	// flush commits every key checked so far (FlagParents: before a key's
	// directories are made, see targetAfter).
	flush := func() {
		changes++ // directories follow
		if cur.keys() == 0 {
			commitUpTo(len(chunks) - 1) // a chunk started, not committed
			return
		}
		start(cur)
		commitUpTo(len(chunks))
		cur = newPutChunk(len(ops))
		chunks = append(chunks, cur)
	}
	// The keys' own objects are looked up a window of lookupKeys at a
	// time (Store.LookupMany: one lock of the index, the table's misses
	// overlapping), before their keys are checked, and again from the
	// key at hand once the call changed anything (changes): each key
	// sees what the keys before it did, as when it was looked up alone.
	// Only another writer's change can come between a key's lookup and
	// its commit, whose version check then sends it alone.
	olds := make([]*store.Object, min(len(ops), lookupKeys))
	wkeys := make([]string, 0, len(olds))
	wstart, wend, wchanges := 0, 0, 0 // olds holds the objects of ops[wstart:wend], looked up at wchanges
	for i, op := range ops {
		if i >= wend || wchanges != changes {
			wstart, wend, wchanges, wkeys = i, min(len(ops), i+lookupKeys), changes, wkeys[:0]
			for _, w := range ops[wstart:wend] {
				wkeys = append(wkeys, w.fullKey(bc.dir))
			}
			if err := n.fs.st.LookupMany(ctx, wkeys, olds[:len(wkeys)]); err != nil {
				wend = i // each alone below
			}
		}
		key, bufs, size, err := n.targetAfter(ctx, bc, op, flush)
		if err != nil {
			op.fail(err)
			continue
		}
		// The key's own object: an implicit directory there fails at the
		// commit (or below, if the put may not go on anyway).
		var old *store.Object
		if i < wend && wchanges == changes && key == wkeys[i-wstart] { // (not followed elsewhere: followDir)
			old = olds[i-wstart]
		} else if old, err = n.fs.st.Lookup(ctx, key); err != nil && !errors.Is(err, store.ErrNotFound) {
			op.fail(err)
			continue
		}
		if old != nil && op.flags&ioctl.FlagExcl != 0 {
			op.fail(fmt.Errorf("put %q: %w", key, store.ErrExists)) // first writer wins
			continue
		}
		var place store.Placement
		if old == nil {
			parent := store.Parent(key)
			di, ok := dirs.Get(parent)
			if !ok {
				// Checked against the directory as the key's path check
				// (targetAfter, which succeeded) found it a moment ago.
				// One removed since fails at the commit (ErrNotFound),
				// where a FlagParents key goes again alone and makes it.
				sd, _ := bc.searched.Get(parent)
				di = dirInfo{err: mayCreate(bc.p, sd.dir)}
				if di.err == nil {
					// A key with no object is placed as its directory.
					di.place = n.fs.st.PlacementFor(ctx, parent)
				}
				dirs.Put(parent, di)
			}
			err, place = di.err, di.place
			if err != nil {
				if dir, _ := n.fs.st.HasChildren(ctx, key); dir {
					err = store.ErrIsDir // as a directory there would say first
				}
			}
		} else if err = n.mayPut(ctx, bc.p, key, old); err == nil {
			parent := store.Parent(key)
			dp, ok := dirPlaces.Get(parent)
			if !ok {
				dp = n.fs.st.PlacementFor(ctx, parent)
				dirPlaces.Put(parent, dp)
			}
			place = store.PlacementOf(old, dp)
		}
		if err != nil {
			op.fail(err)
			continue
		}
		ino := store.NewIno()
		if old != nil {
			ino = old.Ino
		}
		tmpl := store.Object{Mode: 0o644, Uid: bc.uid, Gid: bc.groupFor(key), Ino: ino}
		for _, b := range bufs {
			cur.gpu = cur.gpu || b.Kind == transfer.CUDA
		}
		if n.fs.st.BatchPuts(place) {
			cur.fast = append(cur.fast, op)
			set := bc.metaXattrs(op, old)
			cur.specs = append(cur.specs, store.PutSpec{Key: key, Bufs: bufs, Cur: old, Template: tmpl,
				SetXattrs: set, SharedXattrs: set != nil && len(op.meta) > 0, Place: place, KillSUID: bc.uid != 0})
		} else {
			cur.addDraft(n.fs.st, op, key, bufs, size, old, tmpl, place)
		}
		if (cur.gpu || chunkAlways) && cur.keys() >= chunkKeys {
			start(cur)
			// The copies of cur run while the chunk before commits.
			commitUpTo(len(chunks) - 1)
			cur = newPutChunk(chunkKeys)
			chunks = append(chunks, cur)
		}
	}
	if cur.keys() > 0 {
		start(cur)
	}
	commitUpTo(len(chunks))
	n.putAgain(ctx, bc, ops, again)
}

// putAgain puts alone, in order, the keys of ops that found no room while
// the call's other keys held theirs (now that the versions those replaced
// are freed, or with eviction). A key that a later entry of the call
// wrote keeps that entry's value: going again now would put an earlier
// value over it, so it stays failed for want of room.
func (n *node) putAgain(ctx context.Context, bc *batchCall, ops, again []*keyOp) {
	if len(again) == 0 {
		return
	}
	pos := make(map[*keyOp]int, len(ops))
	last := make(map[string]int, len(ops)) // the last entry that wrote each key
	for i, op := range ops {
		pos[op] = i
		if op.err == nil && op.version != 0 {
			last[op.rel] = i
		}
	}
	for _, op := range again {
		if j, ok := last[op.rel]; ok && j > pos[op] {
			op.fail(fmt.Errorf("%s: no room, and a later entry of the call wrote it: %w", op.rel, store.ErrNoSpace))
			continue
		}
		n.putAlone(ctx, bc, op)
	}
}

// addDraft adds a key that goes through a draft to c.
func (c *putChunk) addDraft(st *store.Store, op *keyOp, key string, bufs []transfer.Buffer, size uint64, old *store.Object, tmpl store.Object, place store.Placement) {
	d := st.NewDraft(tmpl.Ino, nil, true)
	d.Place(place)
	d.Expect(size)
	// Reserved before the keys of the call before it commit, so perhaps
	// before the versions they replace are freed: no eviction for that; a
	// key that finds no room goes again on its own after the commits.
	d.NoEvict()
	c.ps = append(c.ps, putPending{op: op, key: key, size: size, cur: old, d: d, tmpl: tmpl})
	c.writes = append(c.writes, store.DraftWrite{Draft: d, Bufs: bufs})
}

// commitChunk waits for c's copies and commits each of its keys.
func (n *node) commitChunk(ctx context.Context, bc *batchCall, c *putChunk, invs *[]invalidation, again *[]*keyOp) {
	// The time here less the waits is the chunk's commit (CommitNs).
	t0, waited := time.Now(), int64(0)
	defer func() { n.fs.batches.commitNs.Add(uint64(max(int64(time.Since(t0))-waited, 0))) }()
	if c.puts != nil {
		negs := c.negs[:0]
		started := c.puts.CopyNs()
		objs, errs := c.puts.Commit()
		waited += c.puts.CopyNs() - started
		n.fs.batches.transferNs.Add(uint64(c.puts.CopyNs()))
		for j, op := range c.fast {
			err := errs[j]
			switch {
			case errors.Is(err, store.ErrConflict) || errors.Is(err, store.ErrExists), errors.Is(err, store.ErrNotFound):
				// Changed since checked (or its directory is not where
				// the check found it: see putOne): check it again, one
				// key.
				n.putAlone(ctx, bc, op)
			case errors.Is(err, store.ErrNoSpace):
				*again = append(*again, op)
			case err != nil:
				op.fail(err)
			default:
				op.n, op.version = objs[j].Size, objs[j].Version
				switch inv, ok, neg := n.knownInvalidation(op.rel, objs[j].Ino); {
				case ok:
					*invs = append(*invs, inv)
				case neg:
					negs = append(negs, inv)
				}
			}
		}
		// The names the kernel knows no inode of: one look at the
		// negative answers for all.
		*invs = append(*invs, n.fs.neg.cachedMany(negs)...)
		clear(negs)
		c.negs = negs[:0]
		c.puts.Release()
		c.puts = nil
	}
	if c.w == nil {
		return // no drafts
	}
	started := c.w.CopyNs()
	errs := c.w.Wait()
	waited += c.w.CopyNs() - started
	n.fs.batches.transferNs.Add(uint64(c.w.CopyNs()))
	for j := range c.ps {
		pp := &c.ps[j]
		if errs != nil && errs[j] != nil {
			pp.d.Close()
			if errors.Is(errs[j], store.ErrNoSpace) {
				*again = append(*again, pp.op)
				continue
			}
			pp.op.fail(errs[j])
			continue
		}
		opts := store.CommitOptions{Key: pp.key, Template: &pp.tmpl, Exclusive: pp.cur == nil, SetXattrs: bc.metaXattrs(pp.op, pp.cur), Last: true,
			KillSUID: bc.uid != 0}
		if pp.cur != nil {
			opts.IfVersion = pp.cur.Version
		}
		o, err := pp.d.Commit(ctx, opts)
		pp.d.Close() // the replaced version's space comes back now
		if again := errors.Is(err, store.ErrConflict) || errors.Is(err, store.ErrExists) || errors.Is(err, store.ErrNotFound); again {
			// Changed since checked (or its directory is not where the
			// check found it: see putOne): check it again, one key.
			n.putAlone(ctx, bc, pp.op)
			continue
		}
		if err != nil {
			pp.op.fail(err)
			continue
		}
		pp.op.n, pp.op.version = pp.size, o.Version
		if inv, ok := n.invalidation(pp.op.rel, o.Ino); ok {
			*invs = append(*invs, inv)
		}
	}
}

// batchGet runs the gets of a call as one transfer: each key's version
// is opened and its mode (and meta, when asked) checked on it first, then
// every copy runs in one engine batch (StartReads), or, into GPU memory,
// one per chunk of gpuChunkKeys keys, started as soon as the chunk is
// looked up; each key gets its own result. Keys are opened openKeys at a
// time (Store.OpenReadersUntouched: one lock of the index for them all,
// and one of the store for those whose bytes are here), and their
// readers closed together at the end.
func (n *node) batchGet(ctx context.Context, bc *batchCall, ops []*keyOp) {
	type getChunk struct {
		at    []*keyOp
		reads []store.ReaderRead
		gpu   bool
		m     *store.Reads
	}
	type target struct {
		op   *keyOp
		bufs []transfer.Buffer
		room uint64
	}
	var chunks []*getChunk
	readers := make([]*store.Reader, 0, len(ops))
	read := make([]*store.Object, 0, len(ops)) // the versions of the reads started
	defer func() {
		for _, c := range chunks {
			if c.m != nil {
				c.m.Wait()
			}
		}
		n.fs.st.CloseReaders(readers)
	}()
	start := func(c *getChunk) { c.m = n.fs.st.StartReads(ctx, c.reads) }
	cur := &getChunk{at: make([]*keyOp, 0, len(ops)), reads: make([]store.ReaderRead, 0, len(ops))}
	chunks = append(chunks, cur)
	win := make([]target, 0, min(len(ops), openKeys))
	keys := make([]string, 0, min(len(ops), openKeys))
	for len(ops) > 0 {
		// The next window's keys, their paths and buffers checked.
		win, keys = win[:0], keys[:0]
		for len(ops) > 0 && len(win) < openKeys {
			op := ops[0]
			ops = ops[1:]
			if op.err != nil {
				continue
			}
			key, bufs, room, err := n.target(ctx, bc, op)
			if err != nil {
				op.fail(err)
				continue
			}
			win = append(win, target{op, bufs, room})
			keys = append(keys, key)
		}
		if len(win) == 0 {
			continue
		}
		rs, errs := n.fs.st.OpenReadersUntouched(ctx, keys) // moved up together once read
		for _, r := range rs {
			if r != nil {
				readers = append(readers, r) // closed at the end, whatever comes
			}
		}
		for i, t := range win {
			op, key, r := t.op, keys[i], rs[i]
			if errs != nil && errs[i] != nil {
				op.fail(errs[i])
				continue
			}
			o := r.Object()
			if !allowed(bc.p, o, mayRead) {
				op.fail(syscall.EACCES)
				continue
			}
			op.size, op.gotMeta = o.Size, o.Xattrs[xattrMeta]
			if op.meta != nil && !bytes.Equal(op.meta, op.gotMeta) {
				op.fail(fmt.Errorf("%s: meta %q, asked for %q: %w", key, op.gotMeta, op.meta, errMetaMismatch))
				continue
			}
			if op.flags&ioctl.FlagWhole != 0 && o.Size > op.objOff && o.Size-op.objOff > t.room {
				op.fail(fmt.Errorf("%s: %d B from %d, %d B of buffers: %w", key, o.Size, op.objOff, t.room, errValueTooLong))
				continue
			}
			cur.at = append(cur.at, op)
			cur.reads = append(cur.reads, store.ReaderRead{Reader: r, Bufs: t.bufs, Off: op.objOff})
			read = append(read, o)
			for _, b := range t.bufs {
				cur.gpu = cur.gpu || b.Kind == transfer.CUDA
			}
			if (cur.gpu || chunkAlways) && len(cur.at) >= chunkKeys {
				start(cur)
				cur = &getChunk{at: make([]*keyOp, 0, chunkKeys), reads: make([]store.ReaderRead, 0, chunkKeys)}
				chunks = append(chunks, cur)
			}
		}
	}
	if len(cur.at) > 0 {
		start(cur)
	}
	// The keys read move up together, before their copies are waited
	// for (eviction passes over keys being read): those whose checks
	// passed only, so a caller refused a key does not keep it cached.
	n.fs.st.TouchObjects(read...)
	for _, c := range chunks {
		if c.m == nil {
			continue
		}
		counts, errs := c.m.Wait()
		n.fs.batches.transferNs.Add(uint64(c.m.CopyNs()))
		for j, op := range c.at {
			if errs != nil && errs[j] != nil {
				op.fail(errs[j])
				continue
			}
			op.n, op.version = counts[j], c.reads[j].Reader.Object().Version
		}
		c.m.Release()
		c.m = nil
	}
}

// putOne runs one put on its own: a put with flags, or one whose key
// changed between batchPut's check and its commit. It returns the bytes
// written and the version.
func (n *node) putOne(ctx context.Context, bc *batchCall, op *keyOp) (uint64, uint64, error) {
	key, bufs, size, err := n.target(ctx, bc, op)
	if err != nil {
		return 0, 0, err
	}
	// Checked on a version, acted on only if the key still holds it: a
	// change in between (a rename over the key) is looked at again, and
	// so, with FlagParents, is a directory made for the key and removed
	// before the commit (an rmdir of it while still empty): made again.
	var o *store.Object
	for attempt := 0; ; attempt++ {
		cur, err := n.fs.st.Stat(ctx, key)
		if err != nil && !errors.Is(err, store.ErrNotFound) {
			return 0, 0, err
		}
		if err = n.mayPut(ctx, bc.p, key, cur); err == nil {
			tmpl := &store.Object{Mode: 0o644, Uid: bc.uid, Gid: bc.groupFor(key), Ino: store.NewIno()}
			o, err = n.fs.putObject(ctx, key, cur, tmpl, bufs, op.objOff, op.flags, bc.metaXattrs(op, cur))
		}
		if attempt < maxPutRetries {
			switch {
			case errors.Is(err, store.ErrConflict) && op.flags&ioctl.FlagExcl == 0:
				continue
			case errors.Is(err, store.ErrNotFound):
				// The key's directory, which the call's search found, is
				// not there now: the call's directory moved (followed,
				// as openat(2) follows its descriptor's), or went away
				// and came back, or a directory made for the key
				// (FlagParents) was removed (made again). Check the path
				// again; a put whose directory is gone fails there.
				bc.searched.Forget(store.Parent(key))
				if key, bufs, size, err = n.target(ctx, bc, op); err != nil {
					return 0, 0, err
				}
				continue
			}
		}
		if err != nil {
			return 0, 0, err
		}
		break
	}
	if inv, ok := n.invalidation(op.rel, o.Ino); ok {
		inv.apply(ctx) // before the reply, as applyAll
	}
	return size, o.Version, nil
}

// followDir points the call at its directory's name now, when a rename
// moved it since the call began, and says whether op's key was made
// under another name of it: the keys of a call through a directory's
// handle are in that directory wherever it goes, as the names given to
// openat(2) with its descriptor are. The call's path checks are redone
// at the new name.
func (n *node) followDir(ctx context.Context, bc *batchCall, op *keyOp) bool {
	now, ok := n.key()
	if ok && now == bc.dir && op.key != "" && underDir(op.key, bc.dir, op.rel) && bc.dir != "" {
		// Nothing at the directory's name: a rename of it may be on its
		// way to go-fuse's tree. (A key whose own directories are
		// missing waits for no rename.)
		if _, err := n.fs.st.Stat(ctx, bc.dir); errors.Is(err, store.ErrNotFound) {
			now, ok = n.settledKey()
		}
	}
	if ok && now != bc.dir {
		bc.dir = now
		bc.searched = store.DirMemo[searchedDir]{}
	}
	return op.key != "" && !underDir(op.key, bc.dir, op.rel)
}

// batch serves BATCH_PUT and BATCH_GET on directory dir. Each key gets its
// own result; only a malformed batch fails the whole call.
func (n *node) batch(ctx context.Context, dh *dirHandle, dir string, put bool, in, out []byte) error {
	var a ioctl.BatchArg
	if err := a.Unmarshal(in); err != nil {
		return err
	}
	if a.Count > ioctl.MaxBatch || (a.Source != ioctl.BatchBuf && a.Source != ioctl.BatchVM) || a.Flags != 0 {
		return fmt.Errorf("count %d, source %d, flags %#x: %w", a.Count, a.Source, a.Flags, errBadBatch)
	}
	if err := n.batchEntries(ctx, dh, dir, put, a.Source, a.ID, a.Entries[:a.Count], a.Keys[:]); err != nil {
		return err
	}
	a.MarshalInto(out)
	return nil
}

// batchEntries runs the entries of a BATCH_PUT or BATCH_GET (or of a
// table call) with keys from keys, and sets their out fields.
func (n *node) batchEntries(ctx context.Context, dh *dirHandle, dir string, put bool, source uint32, id uint64, entries []ioctl.BatchEntry, keys []byte) error {
	bc, err := n.newBatchCall(ctx, dh, dir, nil, len(entries))
	if err != nil {
		return err
	}
	defer bc.end()
	set := newOps(uint32(len(entries)))
	defer set.release()
	ptrs, segs := set.ptrs, set.segBlock(len(entries)) // a segment each
	bc.arena = set.bufBlock(len(entries))
	for i, op := range ptrs {
		e := &entries[i]
		op.flags, op.objOff, op.setMeta = e.Flags, e.ObjOff, put && putMeta(e.Flags, nil)
		segs[i] = seg{kind: segVM, off: e.Addr, n: e.Len}
		if source == ioctl.BatchBuf {
			segs[i] = seg{kind: segReg, id: id, off: e.Addr, n: e.Len}
		}
		op.segs = segs[i : i+1 : i+1]
		var rel []byte
		if rel, op.err = ioctl.EntryKey(keys, e); op.err == nil {
			op.setKey(dir, rel)
			op.err = op.check(put, nil) // a get takes no flags
		} else {
			op.err = fmt.Errorf("entry %d: %w", i, op.err)
		}
	}
	n.runOps(ctx, bc, put, ptrs)
	for i, op := range ptrs {
		e := &entries[i]
		e.Result, e.Version = op.result()
		if !put {
			e.Len = 0 // a failed get reports length 0
			if e.Result > 0 {
				e.Len = uint64(e.Result)
			}
		}
	}
	return nil
}

// tableScratch holds a table call's entries between calls: tens of
// kilobytes each, made and cleared on the heap otherwise.
type tableScratch struct {
	raw     [ioctl.MaxTable * ioctl.SizeBatchEntry]byte
	keys    [ioctl.MaxTableKeyBytes]byte
	entries [ioctl.MaxTable]ioctl.BatchEntry
}

var tableScratches = sync.Pool{New: func() any { return new(tableScratch) }}

// batchTable serves BATCH_PUT_TABLE and BATCH_GET_TABLE on directory dir:
// it reads the entry table and keys from the caller's memory, makes sure
// the table can take the results, runs the entries as batch does and
// writes the table back.
func (n *node) batchTable(ctx context.Context, dh *dirHandle, dir string, put bool, in, out []byte) error {
	var a ioctl.TableArg
	if err := a.Unmarshal(in); err != nil {
		return err
	}
	// The caller is blocked in this ioctl: its thread id names its
	// process for the whole call.
	p, err := procOf(ctx)
	if err != nil {
		return fmt.Errorf("table call: %w", err)
	}
	pid, eng := p.tid, n.fs.st.Engine()
	t := tableScratches.Get().(*tableScratch)
	defer tableScratches.Put(t)
	raw, keys, entries := t.raw[:ioctl.TableBytes(int(a.Count))], t.keys[:a.KeysLen], t.entries[:a.Count]
	if errRaw, errKeys := eng.ReadProcessPair(pid, a.Entries, raw, a.Keys, keys); errRaw != nil {
		return fmt.Errorf("table of %d entries at %#x: %w", a.Count, a.Entries, errRaw)
	} else if errKeys != nil {
		return fmt.Errorf("table keys of %d B at %#x: %w", a.KeysLen, a.Keys, errKeys)
	}
	// Written back as read, so that no key runs whose result could not
	// be reported.
	if err := eng.WriteProcess(pid, a.Entries, raw); err != nil {
		return fmt.Errorf("table of %d entries at %#x, not writable: %w", a.Count, a.Entries, err)
	}
	ioctl.DecodeEntries(entries, raw)
	if err := n.batchEntries(ctx, dh, dir, put, a.Source, a.ID, entries, keys); err != nil {
		return err
	}
	ioctl.EncodeEntries(raw, entries)
	if err := eng.WriteProcess(pid, a.Entries, raw); err != nil {
		return fmt.Errorf("results of %d entries to %#x: %w", a.Count, a.Entries, err)
	}
	a.MarshalInto(out)
	return nil
}

// vbatchArgs keeps decoded vector batches between calls: 16 KiB each,
// which would otherwise be made and cleared on the heap every call (the
// call's keys and GPU table point into it). Unmarshal sets every field.
var vbatchArgs = sync.Pool{New: func() any { return new(ioctl.VBatchArg) }}

// vbatch serves BATCH_PUTV and BATCH_GETV on directory dir: at once, or
// with ioctl.VBatchAsync started in its own goroutine, returning the
// call's number (see asyncTable).
func (n *node) vbatch(ctx context.Context, dh *dirHandle, dir string, put bool, in, out []byte) (int32, error) {
	t0 := time.Now()
	a := vbatchArgs.Get().(*ioctl.VBatchArg)
	if err := a.Unmarshal(in); err != nil {
		vbatchArgs.Put(a)
		return 0, err
	}
	async := a.Flags == ioctl.VBatchAsync
	if a.Count > ioctl.MaxBatch || a.NGPU > ioctl.MaxGPURefs || a.Flags != 0 && !async {
		vbatchArgs.Put(a)
		return 0, fmt.Errorf("count %d, %d GPUs, flags %#x: %w", a.Count, a.NGPU, a.Flags, errBadBatch)
	}
	bc, err := n.newBatchCall(ctx, dh, dir, a.GPUs[:a.NGPU], int(a.Count))
	if err != nil {
		vbatchArgs.Put(a)
		return 0, err
	}
	set := newOps(a.Count)
	ptrs, release := set.ptrs, set.release
	decode := func() {
		var wire []ioctl.Seg
		// The keys' segments, cut from blocks shared by the call's keys:
		// the set's first.
		arena := set.segBlock(4 * int(a.Count))[:0]
		segs := 0
		for i, op := range ptrs {
			e := &a.Entries[i]
			op.flags, op.objOff = e.Flags, e.ObjOff
			op.err = decodeVEntry(a, dir, i, op, &wire, &arena, put)
			segs += len(op.segs)
		}
		// A buffer a segment: room for the keys of several buffers too.
		bc.arena = set.bufBlock(segs)
	}
	run := func(ctx context.Context) {
		// The call's ops and batchCall use a (its keys, GPU table): it
		// goes back to the pool after them.
		n.runOps(ctx, bc, put, ptrs)
		for i, op := range ptrs {
			e := &a.Entries[i]
			e.Result, e.Version = op.result()
		}
		release()
		bc.end()
	}
	if !async {
		decode()
		run(ctx)
		a.MarshalInto(out)
		vbatchArgs.Put(a)
		return 0, nil
	}
	// Submitted: the entries are decoded by the call, after the reply
	// (the caller waits for what comes before it).
	bc.submitted = true
	err = submittable(n.fs, bc, dh, a)
	var id uint32
	if err == nil {
		c := &asyncCall{a: a, uid: bc.uid, done: make(chan struct{})}
		var actx context.Context
		if id, actx, err = dh.async.add(c, n.fs.asyncCtx); err == nil {
			n.fs.async.Add(1)
			n.fs.ioctls.running.Add(1) // for Unmount, as a request
			hook := dh.async.beforeRun
			// The call's handler time is the submit's up to here and its
			// goroutine's run: the wait between them, for a thread to
			// run it, is the mount's queueNs.
			goAt := time.Now()
			submitted := goAt.Sub(bc.start)
			go func() {
				defer func() {
					n.fs.ioctls.lastEnd.Store(time.Now().UnixNano())
					n.fs.ioctls.running.Add(-1)
					n.fs.async.Done()
				}()
				if hook != nil {
					hook()
				}
				now := time.Now()
				n.fs.batches.queueNs.Add(uint64(now.Sub(goAt)))
				bc.start = now.Add(-submitted)
				growStack()
				// The keys are the handle's directory's, wherever it is
				// now (a synchronous call's are while it runs): one
				// renamed since the submit is followed, not the path it
				// had; one removed fails them.
				if now, ok := dh.n.key(); ok {
					dir, bc.dir = now, now
					decode()
				} else {
					for _, op := range ptrs {
						op.fail(goneErr(true))
					}
				}
				run(actx)
				dh.async.finish(id, c)
			}()
		}
	}
	if err != nil {
		// Refused: no key's work, so not in the batch figures.
		release()
		bc.release(n.fs)
		vbatchArgs.Put(a)
		return 0, err
	}
	// The reply carries no results (nor any byte of an earlier request).
	clear(out[:ioctl.SizeVBatchArg])
	binary.LittleEndian.PutUint32(out[0:], ioctl.SizeVBatchArg)
	binary.LittleEndian.PutUint32(out[4:], ioctl.VBatchAsync)
	n.fs.batches.submits.Add(1)
	n.fs.batches.submitNs.Add(uint64(time.Since(t0)))
	return int32(id), nil
}

// decodeVEntry fills op from entry i of a vector batch, its segments cut
// from *arena (grown by blocks for many keys).
func decodeVEntry(a *ioctl.VBatchArg, dir string, i int, op *keyOp, wire *[]ioctl.Seg, arena *[]seg, put bool) error {
	rel, err := a.KeyBytes(i)
	if err != nil {
		return err
	}
	op.setKey(dir, rel)
	meta, err := a.Meta(i)
	if err != nil {
		return err
	}
	if err := op.check(put, meta); err != nil {
		return err
	}
	if *wire, err = a.Segs((*wire)[:0], i); err != nil {
		return err
	}
	k := len(*wire)
	if cap(*arena)-len(*arena) < k {
		*arena = make([]seg, 0, max(k, 4*int(a.Count)))
	}
	at := len(*arena)
	*arena = (*arena)[:at+k]
	op.segs = (*arena)[at : at+k : at+k]
	for k, w := range *wire {
		switch wireKind(w.ID) {
		case segVM:
			op.segs[k] = seg{kind: segVM, off: w.Off, n: w.Len}
		case segGPU:
			g := w.ID &^ ioctl.SegGPU
			if g >= uint64(a.NGPU) {
				return fmt.Errorf("segment %d: GPU %d of %d: %w", k, g, a.NGPU, errBadBatch)
			}
			op.segs[k] = seg{kind: segGPU, gpu: int(g), off: w.Off, n: w.Len}
		default:
			op.segs[k] = seg{kind: segReg, id: w.ID, off: w.Off, n: w.Len}
		}
	}
	return nil
}

// keyCmd serves PUT_KEY and GET_KEY on directory dir: one key, one call.
func (n *node) keyCmd(ctx context.Context, dh *dirHandle, dir string, put, inline bool, in, out []byte) error {
	var a ioctl.KeyArg
	var data []byte // a KEY_INLINE call's: the value of a put, a get's room
	var err error
	if inline {
		if data, err = a.UnmarshalInline(in); err != nil {
			return err
		}
		if a.Source != ioctl.SrcInline || a.ID != 0 || a.Addr != 0 || a.Len > ioctl.InlineBytes {
			return fmt.Errorf("inline key call: source %d, id %d, addr %#x, %d B (source %d, id and addr 0, at most %d B): %w",
				a.Source, a.ID, a.Addr, a.Len, ioctl.SrcInline, ioctl.InlineBytes, errBadBatch)
		}
		if !put {
			data = out[ioctl.SizeKeyArg:ioctl.SizeKeyInlineArg] // filled in place
		}
	} else if err = a.Unmarshal(in); err != nil {
		return err
	}
	rel, err := a.KeyString()
	if err != nil {
		return err
	}
	m, err := a.MetaBytes()
	if err != nil {
		return err
	}
	var meta []byte
	if len(m) > 0 {
		meta = bytes.Clone(m) // not a slice of a, which then stays on the stack
	}
	// The key, its segment and its buffer list from a pooled set, as a
	// batch call's: nothing of them outlives the call.
	set := newOps(1)
	defer set.release()
	op := set.ptrs[0]
	*op = keyOp{rel: rel, flags: a.Flags, objOff: a.ObjOff}
	if err := op.check(put, meta); err != nil {
		return err
	}
	var gpus []ioctl.GPURef
	op.segs = set.segBlock(1)
	switch a.Source {
	case ioctl.SrcBuf:
		op.segs[0] = seg{kind: segReg, id: a.ID, off: a.Addr, n: a.Len}
	case ioctl.SrcVM:
		op.segs[0] = seg{kind: segVM, off: a.Addr, n: a.Len}
	case ioctl.SrcCUDA:
		gpus = []ioctl.GPURef{a.GPU}
		op.segs[0] = seg{kind: segGPU, off: a.Addr, n: a.Len}
	case ioctl.SrcInline:
		if !inline {
			return fmt.Errorf("source %d outside a KEY_INLINE call: %w", a.Source, errBadBatch)
		}
		op.segs[0] = seg{kind: segMem, mem: data[:a.Len], n: a.Len}
	default:
		return fmt.Errorf("source %d: %w", a.Source, errBadBatch)
	}
	bc, err := n.newBatchCall(ctx, dh, dir, gpus, 1)
	if err != nil {
		return err
	}
	defer bc.end()
	bc.arena = set.bufBlock(1)
	n.runOps(ctx, bc, put, set.ptrs)
	if op.err != nil {
		return op.err
	}
	a.Result, a.Version, a.ObjSize = op.n, op.version, op.size
	if !put {
		// A value's meta is at most MaxMeta bytes (checkStored).
		a.MetaLen = uint16(copy(a.Meta[:], op.gotMeta))
		clear(a.Meta[a.MetaLen:])
	}
	if !inline {
		a.MarshalInto(out)
		return nil
	}
	a.MarshalInlineInto(out)
	// The reply's buffer is reused between requests: only this value's
	// bytes may go back (none for a put).
	done := uint64(0)
	if !put {
		done = op.n
	}
	clear(out[ioctl.SizeKeyArg+done : ioctl.SizeKeyInlineArg])
	return nil
}
