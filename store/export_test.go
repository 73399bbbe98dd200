package store

import "context"

// FollowState reports the highest version the follow loop processed and
// whether no retirement waits in it, for tests.
func FollowState(s *Store) (seen uint64, idle bool) {
	return s.follow.seen.Load(), s.follow.idle.Load()
}

// EvictKey runs one eviction attempt of key, for tests.
func EvictKey(s *Store, key string) bool {
	out, _ := s.evictOne(context.Background(), key)
	return out == evictDone
}

// HoldAsked reports whether the follow loop asked for holds on r's bytes,
// for tests.
func HoldAsked(s *Store, r *Reader) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return r.holding
}

// Leases counts this node's leased reservations on other nodes, for tests.
func Leases(s *Store) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.mu.leases)
}

// AddLease makes s lease reservation id of node's daemon epoch, as a
// Reserve would, for tests.
func AddLease(s *Store, node string, epoch, id uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := leaseKey{node, epoch, id}
	s.mu.leases[k] = &resvLease{leaseKey: k, renewed: s.opts.Now()}
}

// LRUTail returns up to n keys of s's LRU, least recently used first, for
// tests.
func LRUTail(s *Store, n int) []string { return s.lruTail(n) }

// SetMaxDirTimes bounds the directories s remembers to n, for tests
// (before s is used).
func SetMaxDirTimes(s *Store, n int) { s.dirs.limit = n }

// MarkEvicting marks the file of inode ino as being evicted by another
// pass, as evictOne does while it evicts, until the returned function
// runs, for tests.
func MarkEvicting(s *Store, ino uint64) (end func()) {
	done := make(chan struct{})
	s.mu.Lock()
	s.mu.evicting[ino] = done
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		delete(s.mu.evicting, ino)
		s.mu.Unlock()
		close(done)
	}
}

// ReserveError is reserveError, for tests.
func ReserveError(err error) error { return reserveError(err) }

// PendingTree counts x's tree changes not made yet, for tests.
func PendingTree(x *Embedded) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	x.tree.Lock()
	defer x.tree.Unlock()
	return len(x.mu.pend)
}

// TreeAsync and TreeInline are the pending tree changes that start an
// applier and that a swap makes itself, for tests.
const TreeAsync, TreeInline = treeAsync, treeInline

// MetaHeld is the metadata batch commits hold until their swaps, for
// tests: none once every batch committed.
func MetaHeld(s *Store) int64 { return s.metaHeld.Load() }

// Bare reports whether r leases its bytes without the store's lock, for
// tests.
func Bare(r *Reader) bool { return r.bare }

// LeaseBare takes a lease on the body o was committed with as a batch
// get does, for tests: false when o knows none or it was freed.
func LeaseBare(o *Object) bool { return o.body != nil && o.body.leaseBare() }
