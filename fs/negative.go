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
//
// A lookup records its name before it looks (and forgets it if it found
// the key): a batch that commits the key while the lookup is between its
// look and its ENOENT reply then notifies, and the kernel, which orders
// the notification after the lookup in flight, drops the entry. Records
// outlive the kernel's entries by negSlack.

// maxNegatives bounds the remembered negative answers.
const maxNegatives = 1 << 16

// negSlack covers the time between a record and the kernel's own clock
// start (the reply's delivery, rounding to a jiffy).
const negSlack = 50 * time.Millisecond

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
		swept    time.Time // the last sweep of expired records
	}
}

// looking notes that the daemon may answer ENOENT for name in dir, which
// the kernel would cache for ttl.
func (g *negatives) looking(dir uint64, name string, ttl time.Duration) {
	if ttl <= 0 {
		return
	}
	now := time.Now()
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.mu.until == nil {
		g.mu.until = map[negKey]time.Time{}
	}
	if len(g.mu.until) >= maxNegatives && now.Sub(g.mu.swept) >= ttl {
		g.mu.swept = now
		for k, t := range g.mu.until {
			if now.After(t) {
				delete(g.mu.until, k)
			}
		}
	}
	if len(g.mu.until) >= maxNegatives {
		g.mu.overflow = now.Add(ttl + negSlack)
		return
	}
	g.mu.until[negKey{dir, name}] = now.Add(ttl + negSlack)
}

// found forgets the record of a lookup that found its key.
func (g *negatives) found(dir uint64, name string) {
	g.mu.Lock()
	delete(g.mu.until, negKey{dir, name})
	g.mu.Unlock()
}

// cached reports whether the kernel may hold a negative entry for name in
// dir, and forgets it.
func (g *negatives) cached(dir uint64, name string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	var t time.Time
	ok := false
	if len(g.mu.until) > 0 {
		k := negKey{dir, name}
		if t, ok = g.mu.until[k]; ok {
			delete(g.mu.until, k)
		}
	}
	if !ok && g.mu.overflow.IsZero() {
		return false // the common answer, without reading the clock
	}
	now := time.Now()
	if !now.Before(g.mu.overflow) {
		g.mu.overflow = time.Time{} // over
	}
	return ok && now.Before(t) || now.Before(g.mu.overflow)
}
