package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Batches of whole-value puts without drafts (StartPuts): a batch
// reserves every key's extents, starts all their copies as one engine
// batch, and commits every key whose copy succeeded in one index
// transaction. A draft's machinery (growing reservations, copy on write,
// readers of the base, remote placement) has nothing to do for a value
// written once, whole, on this node: this is the KV-cache path.

// PutSpec is one key of StartPuts: its whole new value, Bufs gathered in
// order.
type PutSpec struct {
	Key  string
	Bufs []transfer.Buffer
	// Cur is the version the caller checked, nil for none: the put
	// commits only over that version, or only while the key is absent
	// (else ErrConflict, ErrExists), so that the caller's checks hold.
	Cur *Object
	// Template gives a new key's Mode, Uid, Gid and Ino, as
	// CommitOptions.Template.
	Template Object
	// SetXattrs are set with the value, as CommitOptions.SetXattrs, and
	// SharedXattrs says what CommitOptions.SharedXattrs does of them.
	SetXattrs    map[string][]byte
	SharedXattrs bool
	// Place is the key's placement; it must be one BatchPuts takes.
	Place Placement
	// KillSUID is CommitOptions.KillSUID.
	KillSUID bool
}

// BatchPuts reports whether StartPuts can put a key placed p: a store
// that is not part of a cluster, one replica, no other node named.
func (s *Store) BatchPuts(p Placement) bool {
	return !s.clustered() && p.Replicas <= 1 && (p.Policy != PolicyNode || s.isLocal(p.Node))
}

// Puts is a batch started by StartPuts.
type Puts struct {
	s      *Store
	ctx    context.Context
	specs  []PutSpec
	st     []putState
	flight *transfer.Flight
	copyNs int64
	done   bool
	// Scratch kept between batches (putsPool): a batch's own slices
	// are kilobytes of pointers, whose allocation and first touch cost
	// more than the keys' share of the index.
	reqs  []transfer.Request
	swaps []Swap
	at    []int
	objs  []*Object
	errs  []error
	put   []*Object
	free  []segment.Extent // the replaced versions' room, freed after s.mu
	// AllocMany's arguments.
	sizes     []uint64
	dsts      [][]segment.Extent
	allocErrs []error
	// Commit's new keys and whether each has children (knowKids).
	fresh []string
	kids  []bool
}

// putsPool holds released batches (Release).
var putsPool = sync.Pool{New: func() any { return new(Puts) }}

// Release gives p's memory back for later batches: the slices Commit
// returned are not to be used after it. Calling it is optional.
func (p *Puts) Release() {
	if !p.done {
		panic("store: Puts released before Commit")
	}
	clear(p.st)
	clear(p.reqs)
	clear(p.swaps)
	clear(p.objs)
	clear(p.errs)
	clear(p.put)
	*p = Puts{st: p.st[:0], reqs: p.reqs[:0], swaps: p.swaps[:0], at: p.at[:0], objs: p.objs[:0], errs: p.errs[:0], put: p.put[:0], free: p.free[:0],
		sizes: p.sizes[:0], dsts: p.dsts[:0], allocErrs: p.allocErrs[:0], fresh: p.fresh[:0], kids: p.kids[:0]}
	putsPool.Put(p)
}

// grown returns b with length n, its first n elements zero, reusing its
// array when it is large enough.
func grown[T any](b []T, n int) []T {
	if cap(b) < n {
		return make([]T, n)
	}
	b = b[:n]
	clear(b)
	return b
}

// putState is one key of Puts.
type putState struct {
	rec  *putRecord
	ext  []segment.Extent
	size uint64
	span [2]int // its requests in the flight
	err  error
	obj  *Object
	cur  *Object // the version it replaces, as committed
}

// putRecord holds what a committed key of Puts keeps, allocated at once:
// the new version, its one replica and its extent (when one holds the
// value), and the record of its bytes: one allocation where there were
// four, each a key's share of the collector's work too. The record lives
// as long as the longest of them.
type putRecord struct {
	obj  Object
	rep  [1]Replica
	ext  [1]segment.Extent
	body body
}

// StartPuts reserves room for every spec's value on this node, without
// evicting (a key that finds none fails with ErrNoSpace alone), and
// starts the copies; GPU copies may still run when it returns. The
// caller must call Commit.
func (s *Store) StartPuts(ctx context.Context, specs []PutSpec) *Puts {
	p := putsPool.Get().(*Puts)
	p.s, p.ctx, p.specs, p.st = s, ctx, specs, grown(p.st, len(specs))
	all := p.reqs[:0]
	for i := range specs {
		sp, st := &specs[i], &p.st[i]
		if err := ValidateKey(sp.Key); err != nil {
			st.err = fmt.Errorf("put %q: %w", sp.Key, err)
			continue
		}
		if !s.BatchPuts(sp.Place) {
			st.err = fmt.Errorf("put %q: placement %+v: %w", sp.Key, sp.Place, ErrInvalid)
			continue
		}
		for _, b := range sp.Bufs {
			if st.size+b.Size() < st.size {
				st.err = fmt.Errorf("put %q of %d pieces: %w", sp.Key, len(sp.Bufs), ErrTooLarge)
				break
			}
			st.size += b.Size()
		}
		if st.err != nil || st.size == 0 {
			continue
		}
		st.rec = new(putRecord)
	}
	// Every key's room at once: the segments' locks once per batch.
	sizes, dsts, errs := p.sizes[:0], p.dsts[:0], p.allocErrs[:0]
	for i := range p.st {
		if st := &p.st[i]; st.rec != nil {
			sizes, dsts, errs = append(sizes, st.size), append(dsts, st.rec.ext[:0]), append(errs, nil)
		}
	}
	s.segs.AllocMany(dsts, sizes, errs)
	k := 0
	for i := range specs {
		sp, st := &specs[i], &p.st[i]
		if st.rec == nil {
			continue
		}
		ext, err := dsts[k], errs[k]
		k++
		if err != nil {
			if errors.Is(err, segment.ErrNoSpace) {
				err = fmt.Errorf("store: reserve %d B without evicting: %w", st.size, errors.Join(ErrNoSpace, err))
			}
			st.err = err
			continue
		}
		st.ext = ext
		first := len(all)
		all = appendPieces(all, ext, sp.Bufs, s.opts.Node, s.opts.Epoch)
		st.span = [2]int{first, len(all)}
	}
	clear(dsts)
	clear(errs)
	p.sizes, p.dsts, p.allocErrs = sizes, dsts, errs
	p.reqs = all
	t0 := time.Now()
	p.flight = s.eng.Start(ctx, all)
	p.copyNs = int64(time.Since(t0))
	return p
}

// appendPieces appends the requests that write bufs, one after the other,
// into ext, which holds them.
func appendPieces(reqs []transfer.Request, ext []segment.Extent, bufs []transfer.Buffer, node string, epoch uint64) []transfer.Request {
	i, used := 0, uint64(0) // the extent being filled and its bytes used
	for _, b := range bufs {
		for off := uint64(0); off < b.Size(); {
			e := ext[i]
			n := min(b.Size()-off, e.Len-used)
			reqs = append(reqs, transfer.Request{Op: transfer.Write, Buf: b, BufOff: off,
				Extent: segment.Extent{Segment: e.Segment, Off: e.Off + used, Len: n}, Node: node, Epoch: epoch})
			off += n
			if used += n; used == e.Len {
				i, used = i+1, 0
			}
		}
	}
	return reqs
}

// CopyNs returns the time spent in the engine so far, as Writes.CopyNs.
// It may be called until Release.
func (p *Puts) CopyNs() int64 { return p.copyNs }

// Commit waits for the copies and commits every key whose copy
// succeeded: all in one index transaction, or, when that fails (a key
// changed since it was checked, or a key comes twice), one by one in
// order, where a key's puts after one that failed fail too, untried
// (ErrConflict). It returns each key's committed object and error; a key
// that fails leaves nothing (its room is freed). It may be called once.
func (p *Puts) Commit() ([]*Object, []error) {
	if p.done {
		panic("store: Puts.Commit called twice")
	}
	p.done = true
	s, ctx := p.s, p.ctx
	t0 := time.Now()
	each := p.flight.Wait()
	p.copyNs += int64(time.Since(t0))
	swaps, at := p.swaps[:0], p.at[:0] // at: the spec index of each swap
	memo := &commitMemo{}
	// The new keys' implicit-directory checks: in the swap, or one look
	// for all before it.
	guard, _ := s.idx.(ChildGuard)
	guarded := guard != nil && guard.GuardsChildren()
	if guarded {
		memo.kidsKnown = true // none: the swap checks
	} else {
		fresh := p.fresh[:0]
		for i := range p.specs {
			if p.st[i].err == nil && p.specs[i].Cur == nil {
				fresh = append(fresh, p.specs[i].Key)
			}
		}
		p.kids = grown(p.kids, len(fresh))
		memo.knowKids(ctx, s, fresh, p.kids)
		clear(fresh)
		p.fresh = fresh[:0]
	}
	defer func() { s.metaHeld.Add(-int64(memo.metaHeld)) }() // in the index now, or not put
	// The new keys' metadata room, all at once where it is plenty: what
	// nextVersion adds for each (MetaBytes, the new replica's part), but
	// for xattrs a directory passes on, which take room of their own.
	var room uint64
	for i := range p.specs {
		if sp, st := &p.specs[i], &p.st[i]; st.err == nil && sp.Cur == nil {
			room += entryMeta(sp.Key, sp.SetXattrs)
			if len(st.ext) > 0 {
				room += replicaMeta(s.opts.Node, len(st.ext))
			}
		}
	}
	memo.reserveMeta(s, room)
	for i := range p.specs {
		sp, st := &p.specs[i], &p.st[i]
		if st.err != nil {
			continue
		}
		if each != nil && st.span[1] > st.span[0] {
			if err := errors.Join(each[st.span[0]:st.span[1]]...); err != nil {
				st.err = err
				continue
			}
		}
		// Over the version the caller checked: the swap fails if the key
		// moved on since (ErrConflict), so it is not looked up again.
		cur := sp.Cur
		o := CommitOptions{Key: sp.Key, Template: &sp.Template, SetXattrs: sp.SetXattrs, SharedXattrs: sp.SharedXattrs, Exclusive: cur == nil, KillSUID: sp.KillSUID}
		if cur == nil && len(st.ext) > 0 {
			o.replicas = replicaMeta(s.opts.Node, len(st.ext)) // a new key's room counts it
		}
		if cur != nil {
			o.IfVersion = cur.Version
		}
		var into *Object
		if st.rec != nil {
			into = &st.rec.obj
		}
		next, old, err := s.nextVersion(ctx, o, cur, st.size, 0, sp.Place, memo, into)
		if err != nil {
			st.err = err
			continue
		}
		// The new bytes only: a replaced version's replicas go with it
		// (an empty value has none).
		next.Replicas = nil
		if len(st.ext) > 0 {
			st.rec.rep[0] = Replica{Node: s.opts.Node, Epoch: s.opts.Epoch, Extents: st.ext}
			next.Replicas = st.rec.rep[:]
		}
		st.obj, st.cur = next, cur
		// Read only from here on; an index that keeps the LRU moves the
		// key up with the swap (committedMany).
		swaps = append(swaps, Swap{Key: sp.Key, Old: old, New: next, Owned: true, Touch: s.keeper != nil, Cur: cur, NoKids: guarded && cur == nil, InDir: cur == nil})
		at = append(at, i)
	}
	mutexSpin(&s.mu.Mutex)
	for _, i := range at {
		if ext := p.st[i].ext; len(ext) > 0 {
			b := initBody(&p.st[i].rec.body, ext, bodyRegistered, 0)
			s.addBodyLocked(b)
			p.st[i].obj.body = b // not yet swapped in: no one else has it
		}
	}
	s.mu.Unlock()
	if len(swaps) > 0 {
		if _, err := s.cas(ctx, swaps...); err != nil {
			// One by one: each key fails or commits alone. A key that
			// failed fails at its later swaps too, untried (ErrConflict):
			// a later one committed before the caller put the earlier
			// again would end under the earlier value.
			var failed map[string]bool
			for k, sw := range swaps {
				err := fmt.Errorf("an earlier put of the key failed: %w", ErrConflict)
				if !failed[sw.Key] {
					_, err = s.cas(ctx, sw)
				}
				if errors.Is(err, ErrConflict) && sw.Old == 0 {
					// Absent when checked, there now: as an exclusive
					// commit says.
					err = errors.Join(ErrExists, err)
				}
				if err != nil {
					p.st[at[k]].err = fmt.Errorf("commit %q: %w", sw.Key, err)
					if failed == nil {
						failed = map[string]bool{}
					}
					failed[sw.Key] = true
				}
			}
		}
	}
	p.swaps, p.at = swaps, at
	objs, errs, put := grown(p.objs, len(p.specs)), grown(p.errs, len(p.specs)), p.put[:0]
	p.objs, p.errs = objs, errs
	// The replaced versions that nothing reads are freed here; their
	// room goes back to the segments after s.mu, which the segments'
	// locks would lengthen for every reader and writer.
	p.free = p.free[:0]
	mutexSpin(&s.mu.Mutex)
	s.mu.freeing = &p.free // p's own: a local's address would escape
	for i := range p.st {
		st := &p.st[i]
		if st.err != nil {
			if len(st.ext) > 0 {
				if b := s.bodyLocked(st.ext[0]); b != nil && b.state == bodyRegistered {
					s.dropBodyLocked(b)
				}
			}
			continue
		}
		if st.cur != nil {
			s.retireLocked(st.cur)
		}
		s.publishedBodyLocked(st.obj)
		objs[i] = st.obj
		put = append(put, st.obj)
	}
	s.mu.freeing = nil
	s.mu.Unlock()
	_ = s.segs.Free(p.free)
	var revoked uint64
	for i := range p.st {
		st := &p.st[i]
		if st.err == nil {
			continue
		}
		errs[i] = st.err
		if len(st.ext) > 0 {
			_ = s.segs.Free(st.ext)
			revoked++
		}
	}
	s.stats.revokes.Add(revoked)
	p.put = put
	if len(put) > 0 {
		s.committedMany(put)
	}
	return objs, errs
}
