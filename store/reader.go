package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Reader is a lease on one committed version of an object: its bytes stay
// in place, unchanged, until Close, even if the key is replaced, renamed or
// removed meanwhile.
type Reader struct {
	s      *Store
	obj    *Object
	b      *body
	remote *remoteBody // set when the bytes are on another node (b is nil)
	closed atomic.Bool
	// bare: leased without Store.mu (OpenReadersUntouched), so not
	// counted among its inode's open readers (eviction sees the lease on
	// the body instead, Object.leased): a reader for the length of one
	// call, whose lease keeps the bytes of its version however the key
	// changes meanwhile.
	bare bool
	// Guarded by Store.mu, remote readers only (hold.go): holding is set
	// once holds were asked for; holds are those granted.
	holding bool
	holds   []heldRef
}

// OpenReader returns a lease on the current version of key.
//
// The lookup runs without Store.mu (an index may wait for its cache
// there). A version replaced between the lookup and the lease may have
// had its body freed already: the lease is taken only on a body still
// current at that version, else the lookup is made again. The key
// becomes the most recently used.
func (s *Store) OpenReader(ctx context.Context, key string) (*Reader, error) {
	return s.openReader(ctx, key, true)
}

func (s *Store) openReader(ctx context.Context, key string, touch bool) (*Reader, error) {
	var noRecord uint64 // a version whose local bytes have no record here
	for wait := time.Duration(0); ; wait = min(max(2*wait, 20*time.Microsecond), 5*time.Millisecond) {
		if wait > 0 {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(wait):
			}
		}
		obj, err := s.idx.Get(ctx, key)
		if err != nil {
			return nil, err
		}
		if obj.Kind == KindDir {
			return nil, fmt.Errorf("open %q: %w", key, ErrIsDir)
		}
		s.mu.Lock()
		if ch := s.mu.evicting[obj.Ino]; ch != nil {
			// Being evicted: the outcome decides whether there is a file.
			s.mu.Unlock()
			select {
			case <-ch:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			wait = 0
			continue
		}
		local := s.localExtents(obj)
		var rec *body
		if len(local) > 0 {
			rec = s.bodyOfLocked(obj, local[0])
		}
		if len(local) > 0 && rec == nil && noRecord == obj.Version {
			local = nil
		}
		if len(local) > 0 && rec == nil {
			// No record of the bytes here: freed since the lookup (the
			// version moved on: look again), not yet taken over from
			// their reservation by the follow loop, or never (it was
			// reaped before the commit was seen: they are not this
			// object's; read elsewhere).
			s.mu.Unlock()
			if err := s.caughtUp(ctx, obj.Version); err != nil {
				return nil, fmt.Errorf("open %q: %w", key, err)
			}
			if cur, err := s.idx.Get(ctx, key); err != nil || cur.Version != obj.Version {
				wait = 0
				continue
			}
			// Look once more from the top (evictions included), this
			// version's local bytes aside if they still have no record.
			noRecord = obj.Version
			wait = 0
			continue
		}
		// Leasable: not freed (live, or retired and still waiting) and
		// published then or before (a later body in the same extents is
		// another object's); one between its swap and its bookkeeping once
		// its swap returned, else look again.
		if len(local) > 0 && !rec.readableLocked(obj.Version) {
			s.mu.Unlock()
			continue
		}
		var rb *remoteBody
		if obj.Size > 0 && len(local) == 0 {
			if rb = s.remoteReplicas(obj); rb == nil {
				s.mu.Unlock()
				return nil, fmt.Errorf("open %q: no replica on node %q: %w", key, s.opts.Node, ErrLost)
			}
		}
		r := s.readerOfLocked(obj, rb, len(local) > 0)
		s.mu.Unlock()
		if rb != nil && s.opts.Follow {
			// The follow loop asks holds for the open readers of a key it
			// sees replaced; it may have seen this one's replacement
			// between the lookup and the watch: ask now.
			if cur, err := s.idx.Get(ctx, key); err != nil || cur.Version != obj.Version {
				s.holdReadersOf(key, cur)
			}
		}
		if touch {
			s.Touch(key)
		}
		return r, nil
	}
}

// readerLocked opens a reader of obj: a reference on its local body, or
// its replicas on other nodes (rb), watched for holds. Caller holds s.mu.
func (s *Store) readerLocked(obj *Object, rb *remoteBody) *Reader {
	return s.readerOfLocked(obj, rb, true)
}

// readerOfLocked is readerLocked that leases the local body only with
// local (OpenReader found no record of it: its bytes are not obj's).
func (s *Store) readerOfLocked(obj *Object, rb *remoteBody, local bool) *Reader {
	r := &Reader{s: s, obj: obj, remote: rb}
	s.initReaderLocked(r, local)
	return r
}

// initReaderLocked leases what r, a reader of r.obj (and r.remote), holds.
// Caller holds s.mu.
func (s *Store) initReaderLocked(r *Reader, local bool) {
	if local {
		r.b = s.acquireLocked(r.obj)
	}
	s.mu.opens[r.obj.Ino]++
	if r.remote != nil && s.opts.Follow {
		s.watchRemoteReaderLocked(r)
	}
}

// OpenReadersUntouched opens a reader of each of keys, as OpenReader
// does one, but leaves the keys' places in the LRU (the caller moves
// those it reads up together, with one Touch): rs[i], or errs[i] (errs
// is nil when every key opened). The keys are looked up together where
// the index can (ManyFinder), and the versions whose bytes are here and
// need nothing more are leased under one lock of the store, their
// readers allocated together: a lock of each per call, not per key. Any
// other key (missing, a directory, being evicted, its bytes on another
// node or without a record here) is then opened alone, as OpenReader
// opens one.
func (s *Store) OpenReadersUntouched(ctx context.Context, keys []string) (rs []*Reader, errs []error) {
	rs = make([]*Reader, len(keys))
	if mf, _ := s.idx.(ManyFinder); mf != nil && len(keys) > 1 {
		s.openTogether(ctx, mf, keys, rs)
	}
	for i, k := range keys {
		if rs[i] != nil {
			continue
		}
		var err error
		if rs[i], err = s.openReader(ctx, k, false); err != nil {
			if errs == nil {
				errs = make([]error, len(keys))
			}
			errs[i] = err
		}
	}
	return rs, errs
}

// openTogether sets rs[i] to a reader of keys[i] where one lookup of all
// keys in mf can lease it, without Store.mu (bare) or under one lock of
// it (OpenReadersUntouched); it leaves the other keys' nil.
//
// A version committed here, by a batch put or a draft, knows its body
// (Object.body) and is leased bare, as is an empty file, which has no
// bytes to lease: with four calls in flight on the 2-CPU VM, the lock of
// every 64 keys' leases and of their release was where the calls'
// handlers waited for a CPU (1.7 us a key, 2026-12-07), the mutex handed
// from one to the other. The others (clones of a version made by a rename or a change of
// its metadata, versions in a cluster) are leased under s.mu, as
// OpenReader leases one.
func (s *Store) openTogether(ctx context.Context, mf ManyFinder, keys []string, rs []*Reader) {
	objs := make([]*Object, len(keys))
	if mf.FindMany(ctx, keys, objs) != nil {
		return // each alone: a failed lookup fails there again
	}
	var slab []Reader
	reader := func(most int) *Reader { // most: the readers still to come, at most
		if len(slab) == 0 {
			slab = make([]Reader, most)
		}
		r := &slab[0]
		slab = slab[1:]
		return r
	}
	locked := 0 // objects left for the lock
	for i, obj := range objs {
		if obj == nil || obj.Kind == KindDir {
			objs[i] = nil
			continue
		}
		b := obj.body
		switch {
		case b == nil && (obj.Size > 0 || len(obj.Replicas) > 0):
			locked++
			continue
		case b != nil && !b.leaseBare():
			// Freed since the lookup: the key moved on, which the key's
			// open alone finds.
		default:
			r := reader(len(keys) - i)
			r.s, r.obj, r.b, r.bare = s, obj, b, true
			rs[i] = r
		}
		objs[i] = nil
	}
	if locked == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, obj := range objs {
		if obj == nil || s.mu.evicting[obj.Ino] != nil {
			continue
		}
		local := s.localExtents(obj)
		if len(local) == 0 {
			if obj.Size > 0 {
				continue // on another node
			}
		} else if rec := s.bodyOfLocked(obj, local[0]); !rec.readableLocked(obj.Version) {
			continue // freed since, not yet recorded, or not this version's
		}
		r := reader(locked)
		locked--
		r.s, r.obj = s, obj
		s.initReaderLocked(r, len(local) > 0)
		rs[i] = r
	}
}

// CloseReaders closes every reader of rs (nil ones skipped), as Close
// does each: the bare ones without the store's lock (but to free a body
// retired meanwhile), the other local ones under one lock of it.
func (s *Store) CloseReaders(rs []*Reader) {
	var rest []*Reader // remote, or another store's
	func() {
		locked := false
		lock := func() {
			if !locked {
				s.mu.Lock()
				locked = true
			}
		}
		defer func() {
			if locked {
				s.mu.Unlock()
			}
		}()
		for _, r := range rs {
			switch {
			case r == nil:
			case r.s != s || r.remote != nil:
				rest = append(rest, r)
			case r.bare:
				if !r.closed.Swap(true) && r.b != nil && r.b.unrefLast() {
					lock()
					s.tryFreeLocked(r.b)
				}
			default:
				lock()
				if !r.closed.Swap(true) {
					r.dropLocked()
				}
			}
		}
	}()
	for _, r := range rest {
		r.Close()
	}
}

// Dup returns another lease on the version r holds, closed on its own;
// nil for a version whose bytes are on another node.
func (r *Reader) Dup() *Reader {
	if r.remote != nil {
		return nil
	}
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	if r.b != nil {
		r.b.refs.Add(1)
	}
	r.s.mu.opens[r.obj.Ino]++
	return &Reader{s: r.s, obj: r.obj, b: r.b}
}

// Object returns the version this reader holds.
func (r *Reader) Object() *Object { return r.obj }

// BytesID identifies the bytes of a version: two versions of a file that
// differ only in metadata (a chmod, a touch, a rename) have the same,
// two whose bytes were written apart never do, and every empty version
// has the zero BytesID. Bytes here are known by their record, which a
// reader's lease keeps; another node's by the version alone.
type BytesID struct {
	b *body
	v uint64
}

// BytesID identifies the bytes r holds.
func (r *Reader) BytesID() BytesID {
	switch {
	case r.b != nil:
		return BytesID{b: r.b}
	case r.obj.Size > 0:
		return BytesID{v: r.obj.Version}
	}
	return BytesID{}
}

// Size returns the size of the held version.
func (r *Reader) Size() uint64 { return r.obj.Size }

// Slices returns views of the held bytes [off, off+n), clipped to the size,
// straight into segment memory. They stay valid while the reader (or a
// Hold on it) is open; the caller must not write to them. Bytes held by
// another node cannot be mapped: Slices returns ErrRemote, and the caller
// falls back to ReadAt or ReadTo.
func (r *Reader) Slices(off, n uint64) ([][]byte, error) {
	if r.remote != nil {
		return nil, fmt.Errorf("slices of %q: %w", r.obj.Key, ErrRemote)
	}
	if r.b == nil || off >= r.obj.Size {
		return nil, nil
	}
	n = min(n, r.obj.Size-off)
	var out [][]byte
	var err error
	span(r.b.extents, r.b.starts, off, n, func(e segment.Extent, _ uint64) bool {
		var m []byte
		m, err = r.s.segs.Bytes(e)
		if err != nil {
			return false
		}
		out = append(out, m)
		return true
	})
	return out, err
}

// ReadAt copies the held bytes at off into p through the transfer engine
// and returns the count (short at the end of the object).
func (r *Reader) ReadAt(ctx context.Context, p []byte, off uint64) (int, error) {
	if off >= r.obj.Size {
		return 0, nil
	}
	n, err := r.ReadTo(ctx, transfer.HostBuffer(p), off)
	return int(n), err
}

// ReadTo copies the held bytes at off into buf (host, registered or
// another process's memory), one copy, and returns the count: the buffer's
// size, or less at the end of the object. An offset past the end is
// ErrRange. Bytes held by another node are fetched through
// Options.Transport extent by extent, straight into host and registered
// buffers, through the engine's bounce buffers into process and GPU
// memory.
func (r *Reader) ReadTo(ctx context.Context, buf transfer.Buffer, off uint64) (uint64, error) {
	if off > r.obj.Size {
		return 0, fmt.Errorf("read at %d of %d B: %w", off, r.obj.Size, ErrRange)
	}
	if off == r.obj.Size {
		return 0, nil
	}
	if r.remote != nil {
		return r.readRemote(ctx, buf, off)
	}
	if r.b == nil {
		return 0, nil
	}
	n := min(buf.Size(), r.obj.Size-off)
	reqs := r.requests(transfer.Read, buf, off, n)
	if err := r.s.eng.Submit(ctx, reqs); err != nil {
		return 0, err
	}
	return n, nil
}

func (r *Reader) requests(op transfer.Op, buf transfer.Buffer, off, n uint64) []transfer.Request {
	return r.appendRequests(nil, op, buf, off, n)
}

// appendRequests is requests appending to reqs.
func (r *Reader) appendRequests(reqs []transfer.Request, op transfer.Op, buf transfer.Buffer, off, n uint64) []transfer.Request {
	span(r.b.extents, r.b.starts, off, n, func(e segment.Extent, rel uint64) bool {
		reqs = append(reqs, transfer.Request{Op: op, Buf: buf, BufOff: rel, Extent: e})
		return true
	})
	return reqs
}

// Hold takes an extra reference on the held bytes, for replies that are
// sent after the call that produced them returns. The returned function
// drops it; call it exactly once.
func (r *Reader) Hold() func() {
	if r.b == nil {
		return func() {}
	}
	r.b.refs.Add(1)
	var once atomic.Bool
	return func() {
		if once.CompareAndSwap(false, true) {
			r.s.release(r.b)
		}
	}
}

// Close drops the lease. Closing twice is a no-op.
func (r *Reader) Close() {
	if r.closed.Swap(true) {
		return
	}
	if r.bare {
		r.s.release(r.b)
		return
	}
	r.s.mu.Lock()
	r.dropLocked()
	r.s.mu.Unlock()
	if r.remote != nil && r.s.opts.Follow {
		r.s.closeRemoteReader(r)
	}
}

// dropLocked drops r's lease on its body (freeing a retired one that
// nothing else holds) and its count of open readers of its inode, for
// Close and CloseReaders. Caller holds r.s.mu.
func (r *Reader) dropLocked() {
	if r.b != nil && r.b.unrefLast() {
		r.s.tryFreeLocked(r.b)
	}
	r.s.closeInoLocked(r.obj.Ino)
}

// ReaderRead is one read of a ReadMany: Reader's bytes at Off into Bufs,
// one after the other (the first filled first).
type ReaderRead struct {
	Reader *Reader
	Bufs   []transfer.Buffer
	Off    uint64
}

// ReadMany runs several reads as one transfer, as WriteMany does writes:
// the reads of local bodies go to the engine in one batch; those of
// bodies on other nodes run one by one. It returns each read's count and
// error (errs nil when all succeeded).
func (s *Store) ReadMany(ctx context.Context, rs []ReaderRead) (counts []uint64, errs []error) {
	return s.StartReads(ctx, rs).Wait()
}

// Reads is a ReadMany started by StartReads.
type Reads struct {
	counts []uint64
	errs   []error
	span   [][2]int // each read's requests in the flight
	reqs   []transfer.Request
	flight *transfer.Flight
	copyNs int64 // in the engine (Writes.CopyNs)
	failed bool
	done   bool
}

// readsPool holds released Reads (Release): a call's slices are
// kilobytes, whose allocation and clearing cost more per key than the
// key's share of the lookup.
var readsPool = sync.Pool{New: func() any { return new(Reads) }}

// Release gives m's memory back for later reads, once Wait returned: the
// slices Wait returned are not to be used after it. Calling it is
// optional.
func (m *Reads) Release() {
	if !m.done {
		panic("store: Reads released before Wait")
	}
	clear(m.errs)
	clear(m.reqs) // the buffers
	*m = Reads{counts: m.counts[:0], errs: m.errs[:0], span: m.span[:0], reqs: m.reqs[:0]}
	readsPool.Put(m)
}

// CopyNs returns the time spent in the engine so far, as Writes.CopyNs.
func (m *Reads) CopyNs() int64 { return m.copyNs }

// StartReads is ReadMany that returns once the copies are started (reads
// of remote bodies are done): GPU copies may still run until Wait, which
// the caller must call before it uses the buffers or closes the readers.
func (s *Store) StartReads(ctx context.Context, rs []ReaderRead) *Reads {
	m := readsPool.Get().(*Reads)
	m.counts, m.errs, m.span = grown(m.counts, len(rs)), grown(m.errs, len(rs)), grown(m.span, len(rs))
	set := func(i int, err error) {
		if err != nil {
			m.errs[i], m.failed = err, true
		}
	}
	all := m.reqs[:0]
	for i, rd := range rs {
		r := rd.Reader
		switch {
		case rd.Off > r.obj.Size:
			set(i, fmt.Errorf("read at %d of %d B: %w", rd.Off, r.obj.Size, ErrRange))
		case r.remote != nil:
			at := rd.Off
			for _, buf := range rd.Bufs {
				n, err := r.ReadTo(ctx, buf, at)
				if err != nil {
					m.counts[i] = 0
					set(i, err)
					break
				}
				m.counts[i] += n
				if at += n; n < buf.Size() {
					break
				}
			}
		case r.b == nil || rd.Off == r.obj.Size:
		default:
			first := len(all)
			at := rd.Off
			for _, buf := range rd.Bufs {
				n := min(buf.Size(), r.obj.Size-at)
				all = r.appendRequests(all, transfer.Read, buf, at, n)
				if at += n; at == r.obj.Size {
					break
				}
			}
			m.span[i] = [2]int{first, len(all)}
			m.counts[i] = at - rd.Off
		}
	}
	m.reqs = all
	t0 := time.Now()
	m.flight = s.eng.Start(ctx, all)
	m.copyNs = int64(time.Since(t0))
	return m
}

// Wait waits for the copies and returns each read's count and error as
// ReadMany does.
func (m *Reads) Wait() (counts []uint64, errs []error) {
	if !m.done {
		m.done = true
		t0 := time.Now()
		each := m.flight.Wait()
		m.copyNs += int64(time.Since(t0))
		if each != nil {
			for i := range m.counts {
				if sp := m.span[i]; sp[1] > sp[0] {
					if err := errors.Join(each[sp[0]:sp[1]]...); err != nil {
						m.counts[i] = 0
						m.errs[i], m.failed = err, true
					}
				}
			}
		}
	}
	if !m.failed {
		return m.counts, nil
	}
	return m.counts, m.errs
}
