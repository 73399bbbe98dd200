package store

import (
	"context"
	"sync"
)

// A directory's mtime and ctime change when an entry is made in it or
// leaves it, on any Linux file system, and programs rely on it: Python's
// import system, for one, lists a directory again only when its mtime
// moved, so a module written beside one imported before was not found.
// Updating the directory's own record in the index at every such change
// would make it a point every put in the directory contends on (a batch
// of new keys, several calls of it in flight), so the times live here,
// in memory, per directory key: changes this daemon made (a cluster's
// other nodes' are not seen), shown by DirChanged on top of the record's
// own times. Bounded: past maxDirTimes directories the table starts
// again, every directory taking the time of that moment (times never go
// back; a cache that keys on them looks once more).

// maxDirTimes bounds the directories whose last change is remembered.
const maxDirTimes = 1 << 16

type dirTimes struct {
	mu    sync.RWMutex
	at    map[string]int64 // directory key -> Unix ns of its last entry change
	floor int64            // every directory changed at least then (a restart of at)
}

// cas is the index's CompareAndSwap, noting the directories whose entries
// it changed: a key's parent when the key is made (Old 0) or removed.
func (s *Store) cas(ctx context.Context, swaps ...Swap) (uint64, error) {
	rev, err := s.idx.CompareAndSwap(ctx, swaps...)
	if err == nil {
		s.noteEntries(swaps)
	}
	return rev, err
}

// noteEntries records now as the last change of the parents of swaps'
// keys that were made or removed.
func (s *Store) noteEntries(swaps []Swap) {
	var now int64
	last := "\x00" // no key's parent
	for _, sw := range swaps {
		if sw.Old != 0 && sw.New != nil || isInternal(sw.Key) {
			continue // a new version of a key: its directory is as it was
		}
		dir := Parent(sw.Key)
		if dir == last {
			continue
		}
		if now == 0 {
			now = s.now()
			s.dirs.mu.Lock()
			if s.dirs.at == nil {
				s.dirs.at = make(map[string]int64)
			}
		}
		last = dir
		if len(s.dirs.at) >= maxDirTimes {
			clear(s.dirs.at)
			s.dirs.floor = now
		}
		s.dirs.at[dir] = now
	}
	if now != 0 {
		s.dirs.mu.Unlock()
	}
}

// forgetDir drops what is remembered of directory key (removed, or moved
// to another key).
func (s *Store) forgetDir(key string) {
	s.dirs.mu.Lock()
	delete(s.dirs.at, key)
	s.dirs.mu.Unlock()
}

// moveDir has directory to keep what was remembered of directory from,
// which a rename moved there (its entries went with it).
func (s *Store) moveDir(from, to string) {
	s.dirs.mu.Lock()
	if t, ok := s.dirs.at[from]; ok {
		delete(s.dirs.at, from)
		s.dirs.at[to] = t
	} else {
		delete(s.dirs.at, to)
	}
	s.dirs.mu.Unlock()
}

// DirChanged returns when an entry of directory key was last made or
// removed through this store (Unix ns; 0 if not since it started): its
// mtime and ctime are at least that.
func (s *Store) DirChanged(key string) int64 {
	s.dirs.mu.RLock()
	t := max(s.dirs.at[key], s.dirs.floor)
	s.dirs.mu.RUnlock()
	return t
}
