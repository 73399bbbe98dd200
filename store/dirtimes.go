package store

import (
	"context"
	"maps"
	"strings"
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
// own times. A time its owner sets (DirTimesSet) replaces what is noted.
// Bounded, at a directory per 256 bytes of the metadata limit (a
// directory's record takes more): past that the table starts again, and
// every directory whose record is older than that moment reads as changed
// then (a cache that keys on the times looks once more); a record changed
// since (a chmod, a time set) shows its own times again.

// minDirTimes is the least bound on the directories whose last change is
// remembered.
const minDirTimes = 1 << 16

type dirTimes struct {
	limit int // the bound, when not 0 (tests); else maxDirTimes
	mu    sync.RWMutex
	at    map[string]int64 // directory key -> Unix ns of its last entry change
	floor int64            // when at last started again: older records changed then, at most
}

// maxDirTimes is the bound on the directories remembered.
func (s *Store) maxDirTimes() int {
	if s.dirs.limit > 0 {
		return s.dirs.limit
	}
	return max(minDirTimes, int(s.opts.MetaLimit/256))
}

// cas is the index's CompareAndSwap, noting the directories whose entries
// it changed: a key's parent when the key is made (Old 0) or removed. (A
// rename notes its own: noteRename.)
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
		}
		last = dir
		s.noteLocked(dir, now)
	}
	if now != 0 {
		s.dirs.mu.Unlock()
	}
}

// noteLocked records now as dir's last change, starting the table again
// past its bound; s.dirs.mu held.
func (s *Store) noteLocked(dir string, now int64) {
	if s.dirs.at == nil {
		s.dirs.at = make(map[string]int64)
	}
	if _, ok := s.dirs.at[dir]; !ok && len(s.dirs.at) >= s.maxDirTimes() {
		clear(s.dirs.at)
		s.dirs.floor = now
	}
	s.dirs.at[dir] = now
}

// noteRename records a rename of oldKey to newKey: an entry left the one
// parent and came to the other. A directory's remembered times, and its
// subdirectories', move with it (their entries are as they were).
func (s *Store) noteRename(oldKey, newKey string, dir bool) {
	now := s.now()
	s.dirs.mu.Lock()
	defer s.dirs.mu.Unlock()
	if dir {
		moved := map[string]int64{}
		for k, t := range s.dirs.at {
			if k == oldKey || strings.HasPrefix(k, oldKey+"/") {
				moved[newKey+k[len(oldKey):]] = t
				delete(s.dirs.at, k)
			}
		}
		for k := range s.dirs.at {
			if k == newKey || strings.HasPrefix(k, newKey+"/") {
				delete(s.dirs.at, k) // (a directory replaced, if any)
			}
		}
		maps.Copy(s.dirs.at, moved)
	}
	s.noteLocked(Parent(oldKey), now)
	s.noteLocked(Parent(newKey), now)
}

// forgetDir drops what is remembered of directory key (removed).
func (s *Store) forgetDir(key string) {
	s.dirs.mu.Lock()
	delete(s.dirs.at, key)
	s.dirs.mu.Unlock()
}

// DirTimesSet tells the store that directory key's times were set by its
// owner (tar and rsync restore them, even to the value they had): they
// show as set, not as its last entry change, until the next one. The
// caller has set them in key's record, which also moved its ctime past
// any start again of the table.
func (s *Store) DirTimesSet(key string) { s.forgetDir(key) }

// DirChanged returns when an entry of directory o (an object this store
// returned) was last made or removed through this store, as far as it
// knows (Unix ns; 0 if not since its record was written): its mtime and
// ctime are at least that.
func (s *Store) DirChanged(o *Object) int64 {
	s.dirs.mu.RLock()
	t, ok := s.dirs.at[o.Key]
	if !ok && o.Ctime < s.dirs.floor {
		t = s.dirs.floor
	}
	s.dirs.mu.RUnlock()
	return t
}
