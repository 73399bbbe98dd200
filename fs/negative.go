package fs

import (
	"sync"
	"sync/atomic"
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
	// n is len(mu.until), plus one while mu.overflow is set: a commit's
	// keys skip mu while it is 0 (every key of a batch asks, and a lock
	// per key queued calls behind each other). A lookup's record (under
	// mu, n raised) comes before its look in the index, and a commit's
	// question after its swap there, so a commit that could have beaten
	// an ENOENT reply sees it.
	n  atomic.Int64
	mu struct {
		sync.Mutex
		until map[negKey]time.Time // when the kernel's entry expires
		// overflow: until then, some answers were not remembered.
		overflow time.Time
		swept    time.Time // the last sweep of expired records
		last     time.Time // no record outlives it (zero: none)
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
	defer g.countLocked()
	if len(g.mu.until) >= maxNegatives {
		g.mu.overflow = now.Add(ttl + negSlack)
		return
	}
	until := now.Add(ttl + negSlack)
	g.mu.until[negKey{dir, name}] = until
	if until.After(g.mu.last) {
		g.mu.last = until
	}
}

// countLocked sets n (and last, for no record) after a change. Caller
// holds mu.
func (g *negatives) countLocked() {
	if len(g.mu.until) == 0 {
		g.mu.last = time.Time{}
	}
	n := int64(len(g.mu.until))
	if !g.mu.overflow.IsZero() {
		n++
	}
	g.n.Store(n)
}

// found forgets the record of a lookup that found its key.
func (g *negatives) found(dir uint64, name string) {
	g.mu.Lock()
	delete(g.mu.until, negKey{dir, name})
	g.countLocked()
	g.mu.Unlock()
}

// cached reports whether the kernel may hold a negative entry for name in
// dir, and forgets it.
func (g *negatives) cached(dir uint64, name string) bool {
	if g.n.Load() == 0 {
		return false // nothing recorded: the common answer, without mu
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	now := time.Now()
	defer g.doneLocked(now)
	return g.takeLocked(negKey{dir, name}, now)
}

// cachedMany is cached for the names of invs (each an entry of its in)
// under one lock: it returns those the kernel may hold a negative entry
// for, in invs' array, and forgets them.
func (g *negatives) cachedMany(invs []invalidation) []invalidation {
	if g.n.Load() == 0 {
		return invs[:0]
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	now := time.Now()
	defer g.doneLocked(now)
	kept := invs[:0]
	for _, inv := range invs {
		if g.takeLocked(negKey{inv.in.StableAttr().Ino, inv.name}, now) {
			kept = append(kept, inv)
		}
	}
	return kept
}

// takeLocked forgets k's record and reports whether the kernel may
// still hold its negative entry at now (or some answer went unrecorded
// since). Caller holds mu.
func (g *negatives) takeLocked(k negKey, now time.Time) bool {
	var t time.Time
	ok := false
	if len(g.mu.until) > 0 {
		if t, ok = g.mu.until[k]; ok {
			delete(g.mu.until, k)
		}
	}
	return ok && now.Before(t) || now.Before(g.mu.overflow)
}

// doneLocked ends a look at the record made at now: every record expired
// goes (so that the next commits skip mu), and so does an overflow that
// passed. Caller holds mu.
func (g *negatives) doneLocked(now time.Time) {
	if len(g.mu.until) > 0 && now.After(g.mu.last) {
		clear(g.mu.until)
	}
	if !g.mu.overflow.IsZero() && !now.Before(g.mu.overflow) {
		g.mu.overflow = time.Time{}
	}
	g.countLocked()
}
