package store

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// body is the local replica of one committed version's bytes, and the
// store's one record of it (Store.mu.bodies, by its first extent, unique
// among live allocations) from the commit that registers it to the free
// of its extents:
//
//	registered  a commit is about to swap it in (since 0, swapped once
//	            the index took it); a retirement meanwhile is remembered
//	            (doomed) and applied when the commit publishes
//	live        the current body of some key, published at since
//	retired     replaced or deleted; freed once no local reader holds it
//	            (refs), no other node's hold or checked read pins it
//	            (pins), and FreeDelay passed once, counted from the first
//	            moment it was retired and unheld (left for other nodes'
//	            readers to ask for holds)
//	freed       its extents are free again; it is out of the map
//
// Its extents are immutable while it is in the map.
//
// refs counts the local readers' leases (refsCount's bits), and has
// refsRetired added once the body is retired and refsDead stored once it
// is freed: one word, so that a reader may lease an object's own body
// without Store.mu (Object.body, Reader.bare). Such a reader adds its
// lease and backs off from a dead body; the free, under Store.mu, claims
// a retired body that nothing holds by swapping refsRetired for
// refsDead, which fails once a reader came first; and the release of
// the last lease of a retired body frees it (release).
type body struct {
	id      segment.Extent
	extents []segment.Extent
	starts  []uint64 // starts[i] = object offset of extents[i]
	refs    atomic.Int64
	// guarded by Store.mu (the small ones last: 128 bytes, not 144)
	since   uint64 // version that published it (live, retired)
	swapped uint64 // version of its swap while registered (sharedIndex)
	doomed  uint64 // a retirement seen at this version while registered
	key     string // the key the follow loop last saw it under (CheckBody's LRU touch)
	pins    int32
	state   bodyState
	delayed bool // the FreeDelay after its last reader ran (or runs)
	waiting bool // that delay is running
}

// The parts of body.refs.
const (
	refsRetired = 1 << 40         // added when the body is retired
	refsCount   = refsRetired - 1 // the leases
	// refsDead is a freed body's: negative however many readers add and
	// take back a lease on it meanwhile.
	refsDead = -1 << 62
)

type bodyState uint8

const (
	bodyRegistered bodyState = iota
	bodyLive
	bodyRetired
	bodyFreed
)

func newBody(ext []segment.Extent, state bodyState, since uint64) *body {
	return initBody(new(body), ext, state, since)
}

// initBody is newBody in b, a body no one else has yet.
func initBody(b *body, ext []segment.Extent, state bodyState, since uint64) *body {
	b.extents, b.state, b.since = ext, state, since
	if len(ext) > 0 {
		b.id = ext[0]
	}
	if len(ext) == 1 {
		b.starts = oneStart // the common case, without an allocation
	} else {
		b.starts = extentStarts(ext)
	}
	return b
}

// bodyLocked returns the body whose first extent is first, nil if none.
// Caller holds s.mu.
func (s *Store) bodyLocked(first segment.Extent) *body {
	if b := s.mu.bodies.get(first); b != nil && b.id == first {
		return b
	}
	return nil
}

// addBodyLocked records b, whose first extent no body in the table has.
// Caller holds s.mu.
func (s *Store) addBodyLocked(b *body) { s.mu.bodies.add(b) }

// dropBodyLocked forgets b, if the table has it. Caller holds s.mu.
func (s *Store) dropBodyLocked(b *body) { s.mu.bodies.drop(b) }

// bodyOfLocked is bodyLocked for the local bytes of obj, whose first
// extent is first: the record obj was committed with, while it is not
// freed (until then it is the one of its extents), else the map's.
// Caller holds s.mu.
func (s *Store) bodyOfLocked(obj *Object, first segment.Extent) *body {
	if b := obj.body; b != nil && b.id == first && b.state != bodyFreed {
		return b
	}
	return s.bodyLocked(first)
}

// readableLocked reports whether the body still holds what version held:
// not freed, and published at or before version (a later body in the
// same extents is another object's). A registered body counts from its
// swap on. Caller holds s.mu.
func (b *body) readableLocked(version uint64) bool {
	if b == nil {
		return false
	}
	switch b.state {
	case bodyRegistered:
		return b.swapped != 0 && b.swapped <= version
	case bodyLive, bodyRetired:
		return b.since <= version
	}
	return false
}

// retireBodyLocked retires a live body and frees it if nothing holds it.
// Caller holds s.mu.
func (s *Store) retireBodyLocked(b *body) {
	if b == nil || b.state != bodyLive {
		// Retired already: the follow loop saw the replacing commit
		// before the committer got here (or the other way round).
		return
	}
	b.state = bodyRetired
	b.refs.Add(refsRetired)
	s.tryFreeLocked(b)
}

// tryFreeLocked frees a retired body once nothing holds it, after one
// FreeDelay from the first time nothing did. Caller holds s.mu.
func (s *Store) tryFreeLocked(b *body) {
	if b.state != bodyRetired || b.leases() > 0 || b.pins > 0 || b.waiting {
		return
	}
	if !b.delayed && s.opts.FreeDelay > 0 {
		b.delayed, b.waiting = true, true
		n := int64(segment.TotalLen(b.extents))
		s.stats.delayed.Add(n)
		s.mu.delayed = append(s.mu.delayed, delayedBody{b: b, n: n, due: time.Now().Add(s.opts.FreeDelay)})
		if len(s.mu.delayed) == 1 {
			s.armDelayedLocked()
		}
		return
	}
	if !b.refs.CompareAndSwap(refsRetired, refsDead) {
		return // a reader took a lease without s.mu meanwhile: its release frees it
	}
	b.state = bodyFreed
	s.dropBodyLocked(b)
	if s.mu.freeing != nil {
		*s.mu.freeing = append(*s.mu.freeing, b.extents...)
		return
	}
	_ = s.segs.Free(b.extents)
}

// settledLocked returns the body whose first extent is first once it is
// not between its swap and the swap's return: a registered body is either
// the version a reader names (its swap is about to return) or a new
// object's in reused extents (its commit comes later); which one, only
// the swap tells. It waits with s.mu released; the caller holds s.mu
// (also on return, unless ctx ended).
func (s *Store) settledLocked(ctx context.Context, first segment.Extent) (*body, error) {
	for wait := 20 * time.Microsecond; ; wait = min(2*wait, 5*time.Millisecond) {
		b := s.bodyLocked(first)
		if b == nil || b.state != bodyRegistered || b.swapped != 0 {
			return b, nil
		}
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(wait):
		}
		s.mu.Lock()
	}
}

// leaseBare takes a lease on b without Store.mu (Reader.bare), for a
// reader of the object b is the body of; false if b was freed meanwhile.
func (b *body) leaseBare() bool {
	if b.refs.Add(1) > 0 {
		return true
	}
	b.refs.Add(-1) // dead: nothing else counts on it
	return false
}

// leased reports whether a reader holds a lease on the body o was
// committed with: a batch get's (bare, which the open count leaves out)
// or any other. Eviction passes over such a file as over an open one:
// its bytes would come back only when the lease ends, and a pass that
// took it would go on to take more (a write short of room emptied the
// store of the keys batch gets were reading, and still failed). A lease
// taken right after the look only delays the room the eviction frees.
func (o *Object) leased() bool { return o.body != nil && o.body.leases() > 0 }

// leases returns how many leases hold b (a freed body: 0, but for a
// lease backing off from it).
func (b *body) leases() int64 { return b.refs.Load() & refsCount }

// pinLocked keeps the body from being freed until unpinLocked.
func (b *body) pinLocked() { b.pins++ }

// unpinLocked drops a hold or checked read on the body whose first extent
// is first; the last one lets a retired body go. Caller holds s.mu.
func (s *Store) unpinLocked(first segment.Extent) {
	b := s.bodyLocked(first)
	if b == nil {
		return
	}
	if b.pins--; b.pins < 0 {
		panic("store: body unpinned more often than pinned")
	}
	s.tryFreeLocked(b)
}

// oneStart is the starts of every one-extent body, shared: bodies never
// change their starts.
var oneStart = []uint64{0}

func extentStarts(ext []segment.Extent) []uint64 {
	starts := make([]uint64, len(ext))
	var off uint64
	for i, e := range ext {
		starts[i] = off
		off += e.Len
	}
	return starts
}

// span calls fn for each piece of [off, off+n) of an extent list, with the
// sub-extent and the offset of the piece relative to off.
func span(ext []segment.Extent, starts []uint64, off, n uint64, fn func(e segment.Extent, rel uint64) bool) {
	spanIdx(ext, starts, off, n, func(_ int, e segment.Extent, rel uint64) bool { return fn(e, rel) })
}

// spanIdx is span that also passes the index in ext of each piece's extent.
func spanIdx(ext []segment.Extent, starts []uint64, off, n uint64, fn func(i int, e segment.Extent, rel uint64) bool) {
	if n == 0 || len(ext) == 0 {
		return
	}
	// Binary search for the extent holding off.
	lo, hi := 0, len(starts)
	for lo+1 < hi {
		mid := (lo + hi) / 2
		if starts[mid] <= off {
			lo = mid
		} else {
			hi = mid
		}
	}
	var rel uint64
	for i := lo; i < len(ext) && rel < n; i++ {
		e := ext[i]
		skip := uint64(0)
		if off+rel > starts[i] {
			skip = off + rel - starts[i]
		}
		if skip >= e.Len {
			continue
		}
		take := min(e.Len-skip, n-rel)
		if !fn(i, segment.Extent{Segment: e.Segment, Off: e.Off + skip, Len: take}, rel) {
			return
		}
		rel += take
	}
}

// delayedBody is a retired body waiting for FreeDelay: n bytes, until due.
type delayedBody struct {
	b   *body
	n   int64
	due time.Time
}

// armDelayedLocked sets the store's one delayed-free timer to fire when
// the first waiting body is due. One timer for all, not one a body: a
// store that replaces keys at a high rate would otherwise start a timer
// and, when it fires, a goroutine per key. Caller holds s.mu, and
// s.mu.delayed is not empty.
func (s *Store) armDelayedLocked() {
	d := time.Until(s.mu.delayed[0].due)
	if s.mu.delayedTimer == nil {
		s.mu.delayedTimer = time.AfterFunc(d, s.freeDelayed)
		return
	}
	s.mu.delayedTimer.Reset(d)
}

// freeDelayed ends the delay of every body due, freeing those nothing
// holds (tryFreeLocked), and sets the timer for the next.
func (s *Store) freeDelayed() {
	s.mu.Lock()
	defer s.mu.Unlock()
	now, q := time.Now(), s.mu.delayed
	i := 0
	for ; i < len(q) && !q[i].due.After(now); i++ {
		s.stats.delayed.Add(-q[i].n)
		q[i].b.waiting = false
		s.tryFreeLocked(q[i].b)
		q[i] = delayedBody{}
	}
	if i == len(q) {
		s.mu.delayed = q[:0]
		return
	}
	s.mu.delayed = q[i:] // appends move the rest to a new array in time
	s.armDelayedLocked()
}
