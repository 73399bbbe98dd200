package store

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/google/btree"
)

// Embedded is the in-process Index for a single machine. Every key has a
// slot holding its current object: a hash map finds a key's slot (point
// lookups, the common case, cost one probe), and a B-tree orders the slots
// for scans (under a lock of its own: tree's comment); replacing an object
// changes its slot only. A second, small
// table counts the keys under each directory, so that asking whether a
// new key is an implicit directory costs a probe, not a walk down the
// tree. Every successful swap bumps one revision counter, which becomes
// the version of the objects it wrote. The store's LRU, when kept here,
// has a lock of its own: a put's swap moves its keys up after letting go
// of the table, so that the next call's swap need not wait for those
// moves, nor for a get's.
type Embedded struct {
	mu struct {
		// Lookups and scans share it; swaps take it alone.
		sync.RWMutex
		slots map[string]*slot
		// under counts, for every d such that some key starts with d+"/",
		// the keys that do (HasChildren).
		under  map[string]int
		rev    uint64
		closed bool
		// found is CompareAndSwap's scratch, reused under mu; txn counts
		// its calls (slot.txn).
		found []*slot
		txn   uint64
		// pend is the tree's changes not made yet (tree's comment).
		pend []treeOp
	}
	// tree orders the slots for scans, changed after the table: a swap
	// appends its changes to the table's (mu.pend, in the table's order)
	// and no call waits for the tree, which is a third of a swap of new
	// keys. Once pend holds treeAsync changes, a swap starts an applier
	// (applyPending), which makes them off every call's path; past
	// treeInline, the swap makes them itself before it returns, so pend
	// stays bounded when the applier falls behind. A scan holds mu for
	// reading and then this lock, and makes the changes still pending
	// first, so that it sees the tree as the table is. pend is appended
	// to under mu, written, and taken whole under mu, read, with this
	// lock (applier and scans take it one at a time).
	tree struct {
		sync.Mutex
		t *btree.BTreeG[treeItem]
		// spare is the applied log's array, for the next one.
		spare []treeOp
	}
	applying atomic.Bool // an applier runs or is about to
	// lru is the store's LRU (LRUKeeper), a ring of slots through head:
	// head.next the most recently used, n slots in it. Its lock guards
	// the ring and every slot's prev, next and gone; one who holds mu too
	// took mu first.
	lru struct {
		sync.Mutex
		head slot
		n    int
	}
	lruClaimed atomic.Bool // a store keeps its LRU here
	hub        WatchHub
	// bytes is MetaBytes of every entry and of under's entries: changed
	// under mu (written), read without it (every new key's commit asks,
	// and a read lock per key queued behind other calls' swaps).
	bytes atomic.Int64
}

// slot is a key's place in the index: the tree orders slots by key, the
// object in a slot changes with every version. A slot in the LRU is
// linked through prev and next (nil: not in it). A slot out of the table
// has no object, so that an object's slot (Object.slot) holding it again
// means the slot is the key's, and is gone, so that a move up the LRU
// decided before it left does not link it again.
type slot struct {
	key        string
	obj        *Object
	meta       uint64 // obj.MetaBytes(), kept: obj is cold when replaced
	prev, next *slot
	gone       bool
	txn        uint64 // the last CompareAndSwap that checked it
}

var (
	_ Index            = (*Embedded)(nil)
	_ ChildChecker     = (*Embedded)(nil)
	_ ManyChildChecker = (*Embedded)(nil)
	_ Finder           = (*Embedded)(nil)
	_ ManyFinder       = (*Embedded)(nil)
	_ LRUKeeper        = (*Embedded)(nil)
	_ ChildGuard       = (*Embedded)(nil)
	_ EntryFinder      = (*Embedded)(nil)
)

// treeItem is a slot in the tree, its key beside it: a comparison
// reads the key's bytes only, not the slot first.
type treeItem struct {
	key string
	sl  *slot
}

// NewEmbedded returns an empty embedded index.
func NewEmbedded() *Embedded { return NewEmbeddedFor(0) }

// NewEmbeddedFor returns an empty embedded index with room for keys keys
// before its table grows (KeysFor): growing a table of many keys costs a
// pause in the insert that makes it grow, and each key a rehash.
func NewEmbeddedFor(keys int) *Embedded {
	x := &Embedded{}
	x.mu.slots = make(map[string]*slot, keys)
	x.tree.t = btree.NewG(32, func(a, b treeItem) bool { return a.key < b.key })
	x.mu.under = make(map[string]int)
	x.lru.head.prev, x.lru.head.next = &x.lru.head, &x.lru.head
	return x
}

// Get implements Index.
func (x *Embedded) Get(_ context.Context, key string) (*Object, error) {
	rlockSpin(&x.mu.RWMutex)
	defer x.mu.RUnlock()
	if x.mu.closed {
		return nil, ErrClosed
	}
	sl := x.mu.slots[key]
	if sl == nil {
		return nil, &keyError{"get", key, ErrNotFound}
	}
	return sl.obj, nil
}

// Find implements Finder.
func (x *Embedded) Find(_ context.Context, key string) (*Object, error) {
	rlockSpin(&x.mu.RWMutex)
	defer x.mu.RUnlock()
	if x.mu.closed {
		return nil, ErrClosed
	}
	if sl := x.mu.slots[key]; sl != nil {
		return sl.obj, nil
	}
	return nil, nil
}

// FindMany implements ManyFinder.
func (x *Embedded) FindMany(_ context.Context, keys []string, objs []*Object) error {
	rlockSpin(&x.mu.RWMutex)
	defer x.mu.RUnlock()
	if x.mu.closed {
		return ErrClosed
	}
	for i, k := range keys {
		objs[i] = nil
		if sl := x.mu.slots[k]; sl != nil {
			objs[i] = sl.obj
		}
	}
	return nil
}

// CompareAndSwap implements Index.
func (x *Embedded) CompareAndSwap(_ context.Context, swaps ...Swap) (uint64, error) {
	var local [64]*slot
	var pre [64]swapPre
	rev, up, tree, apply, err := x.swap(swaps, local[:0], prepare(swaps, pre[:0]))
	if tree != nil {
		x.changeTree(tree) // mu is free, x.tree held
		x.tree.Unlock()
	}
	if apply {
		go x.applyPending()
	}
	x.toFront(up) // once mu is free
	return rev, err
}

// treeOp is a change of the tree that a swap leaves for after the
// table's: a new key's slot in (ReplaceOrInsert), or a removed one out.
type treeOp struct {
	it  treeItem
	del bool
}

// The pending tree changes that start an applier, and that a swap makes
// itself (tree's comment). treeAsync is sixteen 64-key batch puts'
// keys: an applier that runs for longer holds the tree fewer times, and
// a scan that finds them pending makes at most about that many changes.
const (
	treeAsync  = 1024
	treeInline = 64 << 10
)

// takePendLocked takes the pending tree changes, leaving x.mu.pend empty
// on the spare array. The caller holds x.tree and mu, for reading at
// least (tree's comment).
func (x *Embedded) takePendLocked() []treeOp {
	ops := x.mu.pend
	x.mu.pend, x.tree.spare = x.tree.spare[:0], nil
	return ops
}

// changeTree makes ops, holding x.tree, and keeps their array for the
// next log (x.tree.spare) unless it grew large.
func (x *Embedded) changeTree(ops []treeOp) {
	for _, op := range ops {
		if op.del {
			x.tree.t.Delete(op.it)
		} else {
			x.tree.t.ReplaceOrInsert(op.it)
		}
	}
	clear(ops) // the slots removed may go
	if cap(ops) <= 4*treeAsync && cap(ops) > cap(x.tree.spare) {
		x.tree.spare = ops[:0]
	}
}

// applyPending makes the pending tree changes until none are left, off
// the calls' paths; a swap started it (x.applying). It takes mu with a
// plain RLock, not rlockSpin: no call waits for it, and a poller would
// keep a CPU busy while swaps follow each other.
func (x *Embedded) applyPending() {
	for {
		x.mu.RLock()
		x.tree.Lock()
		if x.mu.closed || len(x.mu.pend) == 0 {
			// Cleared under mu: the swap that next finds enough pending
			// starts the next applier.
			x.applying.Store(false)
			x.tree.Unlock()
			x.mu.RUnlock()
			return
		}
		ops := x.takePendLocked()
		x.mu.RUnlock()
		x.changeTree(ops)
		x.tree.Unlock()
	}
}

// swapPre is what swap needs of a swap that can be had before the
// index's lock: the new object's MetaBytes, and a slot for a key that
// looks new (no Cur), made ahead (one a swap of a key found after all
// leaves is garbage).
type swapPre struct {
	meta uint64
	sl   *slot
}

// prepare returns pre with one swapPre per swap.
func prepare(swaps []Swap, pre []swapPre) []swapPre {
	for _, s := range swaps {
		var p swapPre
		if s.New != nil {
			p.meta = s.New.MetaBytes()
			if s.Cur == nil {
				p.sl = &slot{key: s.Key}
			}
		}
		pre = append(pre, p)
	}
	return pre
}

// swap is CompareAndSwap under mu; it returns up with the slots of the
// swaps that ask for a move up the LRU added, and what the caller is to
// do of the tree (tree's comment): make the changes in tree, holding
// x.tree (taken before swap let go of mu), and let go; or start an
// applier (apply). pre is prepare's.
func (x *Embedded) swap(swaps []Swap, up []*slot, pre []swapPre) (rev uint64, _ []*slot, tree []treeOp, apply bool, _ error) {
	lockSpin(&x.mu.RWMutex)
	defer x.mu.Unlock()
	if x.mu.closed {
		return 0, nil, nil, false, ErrClosed
	}
	found := x.mu.found[:0]
	defer func() {
		// Empty slots are filled or removed before a normal return; one
		// left here means a panic on the way (a broken invariant): no one
		// may find it.
		for _, sl := range found {
			if sl != nil && sl.obj == nil && x.mu.slots[sl.key] == sl {
				delete(x.mu.slots, sl.key)
			}
		}
		// Kept for the next commit only when small: one large commit (a
		// rename of a big directory) would hold its room for good.
		if len(swaps) > maxScratch {
			x.mu.found = nil
			return
		}
		clear(found)
		x.mu.found = found[:0]
	}()
	// The first pass checks every swap and marks each key's slot with the
	// transaction, so that a key that comes twice finds its mark. A key
	// with no slot gets one now, empty (obj nil), which the second pass
	// fills: one probe of the table for a new key, not two. A failed check
	// removes the empty slots made so far, and so does the deferred
	// cleanup on a panic; no one else sees them (mu).
	x.mu.txn++
	txn := x.mu.txn
	// Every key's slot first, in a loop of its own: a batch's commit
	// comes after its copies, which leave the table's lines cold, and
	// probes that depend on nothing but their key let the CPU overlap
	// their misses. A key with none is probed again below (warm now),
	// where an earlier swap of the transaction may have made it one.
	found = slices.Grow(found, len(swaps))[:len(swaps)]
	for i := range swaps {
		found[i] = x.slotLocked(&swaps[i])
	}
	for i, s := range swaps {
		var err error
		sl := found[i]
		if sl == nil && i > 0 {
			sl = x.mu.slots[s.Key]
		}
		switch {
		case s.New != nil && s.New.Key != s.Key:
			err = fmt.Errorf("swap %q carries object %q: %w", s.Key, s.New.Key, ErrInvalid)
		case sl != nil && sl.txn == txn:
			err = fmt.Errorf("swap %q twice in one transaction: %w", s.Key, ErrInvalid)
		case sl == nil && s.Old != 0 || sl != nil && sl.obj.Version != s.Old:
			var cur uint64
			if sl != nil {
				cur = sl.obj.Version
			}
			err = fmt.Errorf("swap %q: have version %d, want %d: %w", s.Key, cur, s.Old, ErrConflict)
		case sl == nil && s.NoKids && s.New != nil && x.mu.under[s.Key] > 0:
			err = fmt.Errorf("swap %q: keys under it: %w", s.Key, ErrIsDir)
		case s.InDir && !x.dirLocked(Parent(s.Key)):
			err = fmt.Errorf("swap %q: no directory %q: %w", s.Key, Parent(s.Key), ErrNotFound)
		case s.CheckKids && x.mu.under[s.Key] != s.Kids:
			err = fmt.Errorf("swap %q: %d keys under it, want %d: %w", s.Key, x.mu.under[s.Key], s.Kids, ErrConflict)
		}
		if err != nil {
			for _, made := range found[:i] {
				if made.obj == nil {
					delete(x.mu.slots, made.key)
				}
			}
			return 0, nil, nil, false, err
		}
		if sl == nil {
			if sl = pre[i].sl; sl == nil {
				sl = &slot{key: s.Key}
			}
			x.mu.slots[s.Key] = sl
		}
		sl.txn = txn
		found[i] = sl
	}
	x.mu.rev++
	rev = x.mu.rev
	var events []Event
	watched := x.hub.Watched()
	if watched {
		events = make([]Event, 0, len(swaps))
	}
	var under underCounts // the directories' counts, a run of one parent at a time
	var dbytes int64      // x.bytes' change, made once
	defer func() { x.bytes.Add(dbytes) }()
	ops := x.mu.pend
	for i, s := range swaps {
		sl := found[i]
		if s.New == nil {
			if sl.obj == nil {
				delete(x.mu.slots, s.Key) // a key that was not there
				continue
			}
			delete(x.mu.slots, s.Key)
			ops = append(ops, treeOp{it: treeItem{sl.key, sl}, del: true})
			under.add(x, sl.key, -1)
			x.lru.Lock()
			x.unlinkLocked(sl)
			sl.gone = true
			x.lru.Unlock()
			dbytes -= int64(sl.meta)
			if watched {
				events = append(events, Event{Type: EventDelete, Object: sl.obj, Rev: rev})
			}
			sl.obj = nil
			continue
		}
		s.New.Version = rev
		o := s.New
		if !s.Owned {
			o = s.New.Clone()
			o.body = s.New.body // the same version's bytes (a draft's commit)
		}
		if sl.obj != nil {
			dbytes -= int64(sl.meta)
			sl.obj = o
		} else {
			sl.key, sl.obj = o.Key, o
			ops = append(ops, treeOp{it: treeItem{sl.key, sl}})
			under.add(x, sl.key, 1)
		}
		o.slot, sl.meta = sl, pre[i].meta
		dbytes += int64(sl.meta)
		if s.Touch && x.lruClaimed.Load() {
			up = append(up, sl)
		}
		if watched {
			events = append(events, Event{Type: EventPut, Object: o, Rev: rev})
		}
	}
	under.flush(x)
	x.hub.Publish(events)
	x.mu.pend = ops
	switch {
	case len(ops) >= treeInline:
		// The last step under mu: nothing may fail between this and
		// the caller's changes.
		x.tree.Lock()
		return rev, up, x.takePendLocked(), false, nil
	case len(ops) >= treeAsync && x.applying.CompareAndSwap(false, true):
		return rev, up, nil, true, nil
	}
	return rev, up, nil, false, nil
}

// slotLocked returns the slot of s's key, nil if it has none: s.Cur's
// while s.Cur is the key's object there, without a probe of the table.
func (x *Embedded) slotLocked(s *Swap) *slot {
	if c := s.Cur; c != nil && c.slot != nil && c.slot.obj == c && c.Key == s.Key {
		return c.slot
	}
	return x.mu.slots[s.Key]
}

// maxScratch is the largest commit whose scratch CompareAndSwap keeps.
const maxScratch = 1024

// GuardsChildren implements ChildGuard.
func (x *Embedded) GuardsChildren() bool { return true }

// ClaimLRU implements LRUKeeper: the first caller keeps its LRU here.
func (x *Embedded) ClaimLRU() bool { return x.lruClaimed.CompareAndSwap(false, true) }

// Touch implements LRUKeeper.
func (x *Embedded) Touch(keys ...string) {
	var local [64]*slot
	up := local[:0]
	rlockSpin(&x.mu.RWMutex)
	for _, k := range keys {
		if sl := x.mu.slots[k]; sl != nil {
			up = append(up, sl)
		}
	}
	x.mu.RUnlock()
	x.toFront(up)
}

// TouchObjects implements LRUKeeper: an object this index took knows its
// slot, which is the key's until the key leaves the table (gone); an
// object it did not take is found by its key.
func (x *Embedded) TouchObjects(objs ...*Object) {
	var local [64]*slot
	up := local[:0]
	locked := false
	for _, o := range objs {
		sl := o.slot
		if sl == nil {
			if !locked {
				rlockSpin(&x.mu.RWMutex)
				locked = true
			}
			if sl = x.mu.slots[o.Key]; sl == nil {
				continue
			}
		}
		up = append(up, sl)
	}
	if locked {
		x.mu.RUnlock()
	}
	x.toFront(up)
}

// toFront makes the slots of up the most recently used, the last one
// most, skipping those that left the table since they were found.
func (x *Embedded) toFront(up []*slot) {
	if len(up) == 0 {
		return
	}
	x.lru.Lock()
	defer x.lru.Unlock()
	head := &x.lru.head
	for _, sl := range up {
		if sl.gone || head.next == sl {
			continue
		}
		x.unlinkLocked(sl)
		sl.prev, sl.next = head, head.next
		head.next.prev = sl
		head.next = sl
		x.lru.n++
	}
}

// Forget implements LRUKeeper.
func (x *Embedded) Forget(key string) {
	rlockSpin(&x.mu.RWMutex)
	defer x.mu.RUnlock()
	if sl := x.mu.slots[key]; sl != nil {
		x.lru.Lock()
		x.unlinkLocked(sl)
		x.lru.Unlock()
	}
}

// LRUTail implements LRUKeeper.
func (x *Embedded) LRUTail(n int) []string {
	x.lru.Lock()
	defer x.lru.Unlock()
	out := make([]string, 0, min(n, x.lru.n))
	for sl := x.lru.head.prev; sl != &x.lru.head && len(out) < n; sl = sl.prev {
		out = append(out, sl.key)
	}
	return out
}

// LRULen implements LRUKeeper.
func (x *Embedded) LRULen() int {
	x.lru.Lock()
	defer x.lru.Unlock()
	return x.lru.n
}

// unlinkLocked takes sl out of the LRU, if it is in it. Caller holds
// x.lru.
func (x *Embedded) unlinkLocked(sl *slot) {
	if sl.next == nil {
		return
	}
	sl.prev.next, sl.next.prev = sl.next, sl.prev
	sl.prev, sl.next = nil, nil
	x.lru.n--
}

// MetaBytes implements MetaSizer.
func (x *Embedded) MetaBytes() uint64 {
	return uint64(max(x.bytes.Load(), 0))
}

// Scan implements Index.
func (x *Embedded) Scan(_ context.Context, prefix, from string, limit int) ([]*Object, error) {
	rlockSpin(&x.mu.RWMutex)
	defer x.mu.RUnlock()
	if x.mu.closed {
		return nil, ErrClosed
	}
	if from < prefix {
		from = prefix
	}
	// After the tree changes of the swaps before (x.tree's comment).
	x.tree.Lock()
	defer x.tree.Unlock()
	if len(x.mu.pend) > 0 {
		x.changeTree(x.takePendLocked())
	}
	var out []*Object
	x.tree.t.AscendGreaterOrEqual(treeItem{key: from}, func(it treeItem) bool {
		if !strings.HasPrefix(it.key, prefix) {
			return false
		}
		out = append(out, it.sl.obj)
		return limit <= 0 || len(out) < limit
	})
	return out, nil
}

// HasChildren implements ChildChecker.
func (x *Embedded) HasChildren(_ context.Context, dir string) (bool, error) {
	rlockSpin(&x.mu.RWMutex)
	defer x.mu.RUnlock()
	if x.mu.closed {
		return false, ErrClosed
	}
	return x.mu.under[dir] > 0, nil
}

// FindEntry implements EntryFinder.
func (x *Embedded) FindEntry(_ context.Context, key string) (*Object, bool, error) {
	rlockSpin(&x.mu.RWMutex)
	defer x.mu.RUnlock()
	if x.mu.closed {
		return nil, false, ErrClosed
	}
	if sl := x.mu.slots[key]; sl != nil {
		return sl.obj, false, nil
	}
	return nil, x.mu.under[key] > 0, nil
}

// dirLocked reports whether dir is a directory: the root, a directory's
// object, or keys under it. The caller holds mu.
func (x *Embedded) dirLocked(dir string) bool {
	if dir == "" || x.mu.under[dir] > 0 {
		return true
	}
	sl := x.mu.slots[dir]
	return sl != nil && sl.obj != nil && sl.obj.Kind == KindDir
}

// HasChildrenMany implements ManyChildChecker.
func (x *Embedded) HasChildrenMany(_ context.Context, dirs []string, has []bool) error {
	rlockSpin(&x.mu.RWMutex)
	defer x.mu.RUnlock()
	if x.mu.closed {
		return ErrClosed
	}
	for i, d := range dirs {
		has[i] = x.mu.under[d] > 0
	}
	return nil
}

// underEntryBytes is what an entry of under costs beyond its name: the
// table's slot and its share of the room a table keeps free.
const underEntryBytes = 48

// underCounts gathers a transaction's changes to the directories' counts
// (Embedded.mu.under) while its keys share a parent, as a batch's keys
// mostly do: one change of each ancestor's count per run, not per key.
// The caller holds mu.
type underCounts struct {
	parent string
	delta  int
	any    bool
}

// add counts key (delta +1: made, -1: gone).
func (u *underCounts) add(x *Embedded, key string, delta int) {
	i := strings.LastIndexByte(key, '/')
	if i < 0 {
		return // in the root: no directory counts it
	}
	if p := key[:i]; !u.any || p != u.parent {
		u.flush(x)
		u.parent, u.any = p, true
	}
	u.delta += delta
}

// flush applies the run's change to its parent and every directory above.
func (u *underCounts) flush(x *Embedded) {
	if u.any && u.delta != 0 {
		x.countDirLocked(u.parent, u.delta)
	}
	u.parent, u.delta, u.any = "", 0, false
}

// countDirLocked adds delta to the count of directory dir and of every
// directory above it: each d such that a key of dir starts with d+"/".
func (x *Embedded) countDirLocked(dir string, delta int) {
	for i := 0; i <= len(dir); i++ {
		if i < len(dir) && dir[i] != '/' {
			continue
		}
		d := dir[:i]
		n, ok := x.mu.under[d]
		switch {
		case !ok && delta < 0:
			panic(fmt.Sprintf("index: %d keys leave directory %q, which counts none", -delta, d))
		case !ok:
			// Its own copy: a slice of a key would keep all of the key
			// (up to a path's length) for as long as the directory has
			// keys.
			x.mu.under[strings.Clone(d)] = delta
			x.bytes.Add(int64(underEntryBytes + len(d)))
		case n+delta == 0:
			delete(x.mu.under, d)
			x.bytes.Add(-int64(underEntryBytes + len(d)))
		default:
			x.mu.under[d] = n + delta
		}
	}
}

// Watch implements Index. Events are queued per watcher without bound, so
// a slow reader never blocks commits.
func (x *Embedded) Watch(ctx context.Context, prefix string) (<-chan Event, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.mu.closed {
		return nil, ErrClosed
	}
	return x.hub.Watch(ctx, prefix)
}

// Close implements Index.
func (x *Embedded) Close() error {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.mu.closed {
		return nil
	}
	x.mu.closed = true
	x.hub.Close()
	return nil
}
