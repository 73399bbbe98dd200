package store

import (
	"context"
	"errors"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// Touch makes each key, in turn, the most recently used (a key removed
// meanwhile leaves the order when eviction finds it gone, or with its
// entry in a keeper's).
func (s *Store) Touch(keys ...string) {
	if len(keys) == 0 {
		return
	}
	if s.keeper != nil {
		s.keeper.Touch(keys...)
		return
	}
	s.lru.Lock()
	for _, k := range keys {
		s.touchLocked(k)
	}
	s.lru.Unlock()
}

// TouchObjects is Touch of the keys of objs, objects this store returned
// (a reader's): the index that keeps the LRU finds their entries through
// them, without a lookup.
func (s *Store) TouchObjects(objs ...*Object) {
	if len(objs) == 0 {
		return
	}
	if s.keeper != nil {
		s.keeper.TouchObjects(objs...)
		return
	}
	s.lru.Lock()
	for _, o := range objs {
		s.touchLocked(o.Key)
	}
	s.lru.Unlock()
}

// touchLocked is Touch of one key for a caller holding s.lru (without a
// keeper).
func (s *Store) touchLocked(key string) {
	if e, ok := s.lru.elem[key]; ok {
		s.lru.list.MoveToFront(e)
	} else {
		s.lru.elem[key] = s.lru.list.PushFront(key)
	}
}

// forget drops key from the LRU.
func (s *Store) forget(key string) {
	if s.keeper != nil {
		s.keeper.Forget(key)
		return
	}
	s.lru.Lock()
	if e, ok := s.lru.elem[key]; ok {
		s.lru.list.Remove(e)
		delete(s.lru.elem, key)
	}
	s.lru.Unlock()
}

// forgetAt takes key out of the LRU as it was at version v: a commit
// since (bytes written, an unpin) put it back in, before or after the
// forget, and keeps it there.
func (s *Store) forgetAt(ctx context.Context, key string, v uint64) {
	s.forget(key)
	// A commit's own touch follows its swap: one that swapped before the
	// look below may have touched before the forget above, so it is
	// touched again; one after it touches after the forget.
	if cur, err := s.idx.Get(ctx, key); err == nil && cur.Version != v {
		s.Touch(key)
	}
}

// lruTail returns up to n keys, least recently used first.
func (s *Store) lruTail(n int) []string {
	if s.keeper != nil {
		return s.keeper.LRUTail(n)
	}
	s.lru.Lock()
	defer s.lru.Unlock()
	out := make([]string, 0, n)
	for e := s.lru.list.Back(); e != nil && len(out) < n; e = e.Prev() {
		out = append(out, e.Value.(string))
	}
	return out
}

// lruLen returns how many keys the LRU holds.
func (s *Store) lruLen() int {
	if s.keeper != nil {
		return s.keeper.LRULen()
	}
	s.lru.Lock()
	defer s.lru.Unlock()
	return s.lru.list.Len()
}

// evictOutcome is what evictOne did with a key.
type evictOutcome uint8

const (
	evictKept   evictOutcome = iota // not evicted, and where it was in the LRU
	evictMoved                      // not evicted, and off the LRU's end (out of it, or up as in use)
	evictWaited                     // another pass was evicting it, and has ended: worth another look
	evictDone                       // evicted
	// evictUnreachable: the index did not answer (ErrUnavailable), and
	// would keep every other key of the pass waiting as long.
	evictUnreachable
)

// evictOne removes key if it may be evicted: a file with local bytes,
// not pinned and not open. A file with replicas on other nodes only loses
// this node's copy (repair may place it elsewhere); the last copy takes
// the key with it (its bytes possibly later, once a racing reader lets
// go). It returns what it did, and with evictUnreachable the index's
// error.
func (s *Store) evictOne(ctx context.Context, key string) (evictOutcome, error) {
	o, err := s.idx.Get(ctx, key)
	if err != nil {
		if errors.Is(err, ErrNotFound) {
			if s.keeper == nil {
				s.forget(key) // (a keeper has no entry for a key that is gone)
			}
			return evictMoved, nil
		}
		return kept(err), err
	}
	if len(s.evictable(o)) == 0 {
		// Nothing here to evict until a commit writes bytes here, or
		// unpins the file, which puts it back: out of the LRU (empty
		// files cost metadata too; pinned ones left at its end would
		// use up every pass's look).
		s.forgetAt(ctx, key, o.Version)
		return evictMoved, nil
	}
	// Not open, and no open may start until the swap below has landed or
	// failed: an open that looked the key up meanwhile waits and looks
	// again, so it either holds the file before it can be evicted or sees
	// it gone.
	s.mu.Lock()
	if s.mu.opens[o.Ino] > 0 || o.leased() {
		// In use: as recently used as it gets (left at the LRU's end,
		// many open files would use up every pass's look).
		s.mu.Unlock()
		s.Touch(key)
		return evictMoved, nil
	}
	if other := s.mu.evicting[o.Ino]; other != nil {
		// Another pass (the evict loop, or a reservation short of room)
		// is evicting it: its bytes are on their way back. Wait for that
		// pass, so that the caller's next look at the free room counts
		// them; a reservation that went on at once found nothing else to
		// evict and failed with ENOSPC while the room it needed was being
		// freed.
		s.mu.Unlock()
		select {
		case <-other:
		case <-ctx.Done():
			return evictKept, nil
		}
		return evictWaited, nil
	}
	done := make(chan struct{})
	s.mu.evicting[o.Ino] = done
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.mu.evicting, o.Ino)
		s.mu.Unlock()
		close(done)
	}()
	var swaps []Swap
	others := s.otherReplicas(o)
	if len(others) > 0 {
		next := o.Clone()
		next.Replicas = others
		swaps = []Swap{{Key: key, Old: o.Version, New: next}}
	} else if swaps, err = s.removal(ctx, o); err != nil {
		return kept(err), err
	}
	if _, err := s.cas(ctx, swaps...); err != nil {
		return kept(err), err
	}
	s.committed([]*Object{o}, nil, []string{key})
	s.stats.evictions.Add(1)
	s.stats.evictedBytes.Add(o.Size)
	if f := s.onEvict.Load(); f != nil && len(others) == 0 {
		(*f)(key, o.Ino)
	}
	return evictDone, nil
}

// kept is evictOne's outcome for a key it kept through err.
func kept(err error) evictOutcome {
	if errors.Is(err, ErrUnavailable) {
		return evictUnreachable
	}
	return evictKept
}

// OnEvict has f told of each file that this store's eviction takes away
// with its key (not one whose copies on other nodes keep it), once it is
// gone: its key and inode. f runs on the evicting goroutine, which may be
// serving a request the kernel holds a directory's lock for, or hold the
// store's own lock of eviction for metadata (which such requests wait
// on): it must neither block nor call the store. One f at a time: a
// later call replaces it. stop ends the calls of this f (not of one set
// since).
func (s *Store) OnEvict(f func(key string, ino uint64)) (stop func()) {
	p := &f
	s.onEvict.Store(p)
	return func() { s.onEvict.CompareAndSwap(p, nil) }
}

// otherReplicas returns o's replicas on other nodes.
func (s *Store) otherReplicas(o *Object) []Replica {
	var out []Replica
	for _, r := range o.Replicas {
		if r.Node != s.opts.Node {
			out = append(out, r)
		}
	}
	return out
}

// evictFor evicts least recently used objects until need bytes are free
// (and use is below the low watermark), and none where no eviction can
// free need bytes (mayFree). It reports whether it freed any, and, when
// the index did not answer, its error.
func (s *Store) evictFor(need uint64) (bool, error) {
	ctx := context.Background()
	if !s.mayFree(ctx, need) {
		return false, nil
	}
	st := s.segs.Stats()
	target := max(need, st.Size-uint64(float64(st.Size)*s.opts.LowWater))
	return s.evictUntil(ctx, target)
}

// mayFree reports whether eviction could leave need bytes free: the free
// room, the bytes retired and on their way back, and the local bytes of
// the files eviction may take (closed, unpinned, with bytes here),
// counted from the LRU's end until they reach need. A reservation that
// no eviction can satisfy (a copy of a file that takes most of the
// store) fails at once rather than after evicting every file. The count
// is the pass's own work done ahead, and stops where the pass would:
// past maxEvictLooks keys, or when the index does not answer, it answers
// yes and the pass decides.
func (s *Store) mayFree(ctx context.Context, need uint64) bool {
	have := s.segs.Stats().Free + uint64(max(s.stats.delayed.Load(), 0))
	counted := 0
	for n := 64; have < need; n *= 4 {
		if n > maxEvictLooks {
			return true
		}
		keys := s.lruTail(n)
		if len(keys) < counted {
			return true // other passes took keys meanwhile: this one decides
		}
		for _, k := range keys[counted:] {
			o, err := s.idx.Get(ctx, k)
			if errors.Is(err, ErrNotFound) {
				continue
			}
			if err != nil {
				return true
			}
			ext := s.evictable(o)
			if len(ext) == 0 {
				continue
			}
			s.mu.Lock()
			open := s.mu.opens[o.Ino] > 0 || o.leased()
			s.mu.Unlock()
			if !open {
				if have += segment.TotalLen(ext); have >= need {
					return true
				}
			}
		}
		if len(keys) < n {
			return false // every key counted
		}
		counted = len(keys)
	}
	return true
}

// evictable returns the extents on this node that evicting o would free,
// whether or not it is open: none for a directory, an empty or pinned
// file, or one with no bytes here.
func (s *Store) evictable(o *Object) []segment.Extent {
	if o.Kind != KindFile || o.Size == 0 || o.Pinned {
		return nil
	}
	return s.localExtents(o)
}

// evictUntil evicts until target bytes are free or nothing evictable is
// left (evictWhile).
func (s *Store) evictUntil(ctx context.Context, target uint64) (bool, error) {
	return s.evictWhile(ctx, "",
		func() bool { return s.segs.Stats().Free+uint64(max(s.stats.delayed.Load(), 0)) < target },
		func() bool { return s.segs.Stats().Free >= target })
}

// evictMetaUntil evicts, keep aside, until the index's entries take at
// most target bytes (Options.MetaLimit's measure), upTo files have gone
// (0: no bound) or nothing evictable is left: a store of many small values
// runs out of room for their entries before it runs out of bytes, and a
// cache must make room for new keys then too. Only for an index of this
// node alone (metaEvicts).
func (s *Store) evictMetaUntil(ctx context.Context, target uint64, keep string, upTo int) (bool, error) {
	over := func() bool { return s.metaBytes() > target }
	n := 0
	return s.evictWhile(ctx, keep, over, func() bool { n++; return !over() || n == upTo })
}

// metaEvicts says whether eviction makes room for metadata: with an index
// that other nodes share, its entries are mostly theirs and this node's
// evictions could empty its cache without making room (and the index's
// figure follows its writes late).
func (s *Store) metaEvicts() bool { return s.opts.Evict && !s.opts.Follow }

// evictWhile evicts least recently used objects but keep ("": none)
// while more says so, stopping as soon as enough does or nothing
// evictable is left. It reports whether it evicted any. A key the index
// does not answer for (etcd away) ends the pass with the index's error:
// each key would wait RequestTimeout, and a reservation behind the pass
// would wait that long for every key it looks at.
func (s *Store) evictWhile(ctx context.Context, keep string, more, enough func() bool) (bool, error) {
	any := false
	tried := map[string]bool{}
	if keep != "" {
		tried[keep] = true
	}
	// misses: keys looked at, kept, and still at the LRU's end (with
	// keep, what each look at the end passes over); keys that left the
	// end (pinned or empty ones out of the LRU, open ones moved up) are
	// not in the way of the next look.
	misses, looked := 0, 0
	if keep != "" {
		misses++ // it stays, wherever it is
	}
	for more() && misses < maxEvictMisses && looked < maxEvictLooks {
		want := 64 + misses
		keys := s.lruTail(want)
		progress, fresh := false, false
		for _, k := range keys {
			if tried[k] {
				continue
			}
			tried[k], fresh = true, true
			looked++
			out, err := s.evictOne(ctx, k)
			switch out {
			case evictUnreachable:
				return any, err
			case evictKept:
				misses++
				continue
			case evictMoved:
				continue
			case evictWaited:
				// Gone with its room freed, or back for another look if
				// that pass gave it up.
				delete(tried, k)
				progress = true
				if enough() {
					return any, nil
				}
				continue
			}
			any, progress = true, true
			if enough() {
				return true, nil
			}
		}
		if !fresh || !progress && len(keys) < want {
			break // every key of the LRU tried
		}
	}
	return any, nil
}

// maxEvictMisses bounds the keys one eviction pass looks at that it can
// neither evict nor move off the LRU's end (being evicted or written
// already), and maxEvictLooks all the keys it looks at.
const (
	maxEvictMisses = 4096
	maxEvictLooks  = 1 << 16
)

// evictLoop keeps use under the high watermark in the background.
func (s *Store) evictLoop() {
	defer s.wg.Done()
	for {
		select {
		case <-s.done:
			return
		case <-s.kick:
		}
		if s.aboveHighWater() {
			st := s.segs.Stats()
			s.evictUntil(context.Background(), st.Size-uint64(s.opts.LowWater*float64(st.Size)))
		}
		if s.metaEvicts() && s.metaAboveHighWater() {
			// As a commit evicting for room does (metaRoom): commits short
			// of room wait for the pass, which makes theirs.
			s.metaEvicting.Lock()
			s.evictMetaUntil(context.Background(), uint64(s.opts.LowWater*float64(s.opts.MetaLimit)), "", 0)
			s.metaEvicting.Unlock()
		}
	}
}
