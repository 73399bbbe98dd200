package fs

import (
	"sync"
	"time"
)

// Negative entries. A key a batch creates has no inode in the kernel yet,
// so the only thing the kernel may have cached about it is a negative
// dentry: a lookup this daemon answered ENOENT within NegativeTimeout.
// Telling the kernel to drop one costs a write to /dev/fuse (as much as
// the rest of a small put), so the daemon remembers the names it answered
// ENOENT for and notifies only those. The record is bounded; when it is
// full, every new key is notified until a whole timeout has passed.

// maxNegatives bounds the remembered negative answers.
const maxNegatives = 1 << 16

type negKey struct {
	dir  uint64 // the parent's inode
	name string
}

type negatives struct {
	mu struct {
		sync.Mutex
		until map[negKey]time.Time // when the kernel's entry expires
		// overflow: until then, some answers were not remembered.
		overflow time.Time
	}
}

// answered notes that the daemon answered ENOENT for name in dir, cached
// by the kernel for ttl.
func (g *negatives) answered(dir uint64, name string, ttl time.Duration) {
	if ttl <= 0 {
		return
	}
	now := time.Now()
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.mu.until == nil {
		g.mu.until = map[negKey]time.Time{}
	}
	if len(g.mu.until) >= maxNegatives {
		for k, t := range g.mu.until {
			if now.After(t) {
				delete(g.mu.until, k)
			}
		}
	}
	if len(g.mu.until) >= maxNegatives {
		g.mu.overflow = now.Add(ttl)
		return
	}
	g.mu.until[negKey{dir, name}] = now.Add(ttl)
}

// cached reports whether the kernel may hold a negative entry for name in
// dir, and forgets it.
func (g *negatives) cached(dir uint64, name string) bool {
	now := time.Now()
	g.mu.Lock()
	defer g.mu.Unlock()
	k := negKey{dir, name}
	t, ok := g.mu.until[k]
	delete(g.mu.until, k)
	return ok && now.Before(t) || now.Before(g.mu.overflow)
}
