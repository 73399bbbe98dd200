package store

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Options configures a Store.
type Options struct {
	// Node names this daemon in replica lists. Zero value: "local".
	Node string
	// Epoch is this daemon's incarnation (its start time in ns, say),
	// recorded with its replicas; 0 on one machine.
	Epoch uint64
	// Index holds the namespace. Required.
	Index Index
	// Segments are this node's memory. Required.
	Segments *segment.Table
	// Engine moves bytes. Required.
	Engine *transfer.Engine
	// Evict turns LRU eviction on. When off, a full store fails writes
	// with ErrNoSpace.
	Evict bool
	// HighWater and LowWater are fractions of capacity: when use passes
	// HighWater, objects are evicted until it is below LowWater. Zero
	// values: 0.95 and 0.85.
	HighWater, LowWater float64
	// Now is the clock; nil means time.Now.
	Now func() time.Time
	// Transport reads replicas held by other nodes. Nil: single node, and
	// an object with no replica here fails with ErrLost.
	Transport transfer.Transport
	// Cluster lists the live nodes for placement; nil with a Transport
	// means placement stays local (remote replicas are still read).
	Cluster Cluster
	// FreeDelay postpones the freeing of replaced or deleted local bodies
	// so that a read in flight from another node finishes before the
	// space is reused, and an open reader there has time to ask for a
	// hold (hold.go). 0: free at once.
	FreeDelay time.Duration
	// Logf receives one line per notable cluster event (a lost object);
	// nil logs nothing.
	Logf func(format string, args ...any)
	// MetaLimit bounds the memory index entries may take (Object.MetaBytes:
	// keys, xattrs, extent lists), when the Index is a MetaSizer: a create,
	// a commit of a new key or an xattr change past it fails with
	// ErrNoSpace. 0: DefaultMetaLimit of the segments' capacity.
	MetaLimit uint64
	// ReserveTTL is the lifetime of a reservation this node makes on
	// another node without renewal; it renews its writers' reservations
	// every third of it (lease.go). 0: DefaultReserveTTL.
	ReserveTTL time.Duration
	// Follow watches the Index for changes committed by other nodes and
	// frees this node's bodies of versions they replaced or deleted. Set
	// it when the Index is shared.
	Follow bool
}

// DefaultMetaLimit is the metadata bound for a capacity of size bytes: a
// sixteenth of it, at least 16 MiB.
func DefaultMetaLimit(size uint64) uint64 {
	return max(size/16, 16<<20)
}

// DefaultOptions returns the defaults for the optional fields.
func DefaultOptions() Options {
	return Options{Node: "local", Evict: true, HighWater: 0.95, LowWater: 0.85, Now: time.Now}
}

// Validate reports every bad field at once.
func (o Options) Validate() error {
	var errs []error
	if o.Index == nil {
		errs = append(errs, errors.New("store: Options.Index is required"))
	}
	if o.Segments == nil {
		errs = append(errs, errors.New("store: Options.Segments is required"))
	}
	if o.Engine == nil {
		errs = append(errs, errors.New("store: Options.Engine is required"))
	}
	if o.Transport != nil && o.Engine != nil && !o.Engine.Reaches(o.Node, o.Transport) {
		errs = append(errs, fmt.Errorf("store: Options.Engine must be built with Self %q and Remote = Options.Transport", o.Node))
	}
	if o.HighWater < 0 || o.HighWater > 1 {
		errs = append(errs, fmt.Errorf("store: HighWater %v not in [0,1]", o.HighWater))
	}
	if o.LowWater < 0 || o.LowWater > 1 {
		errs = append(errs, fmt.Errorf("store: LowWater %v not in [0,1]", o.LowWater))
	}
	if o.HighWater != 0 && o.LowWater > o.HighWater {
		errs = append(errs, fmt.Errorf("store: LowWater %v above HighWater %v", o.LowWater, o.HighWater))
	}
	return errors.Join(errs...)
}

// Store is the object layer: it turns an Index and local segments into
// objects with two-phase writes, reader leases and eviction.
type Store struct {
	opts    Options
	idx     Index
	segs    *segment.Table
	eng     *transfer.Engine
	kick    chan struct{}
	onEvict atomic.Pointer[func(key string, ino uint64)] // OnEvict
	dirs    dirTimes                                     // entry changes by directory (DirChanged)
	done    chan struct{}
	started int64 // Unix ns; the root directory's times
	wg      sync.WaitGroup
	cancel  context.CancelFunc // ends the follow watch
	// metaHeld is the metadata of new keys of batch commits that found
	// room (metaRoom) and are not yet in the index: room that other
	// commits must leave them, so that batches committing together do
	// not pass Options.MetaLimit by each other's keys.
	metaHeld atomic.Int64
	// metaEvicting is held by the commit evicting for metadata room.
	metaEvicting sync.Mutex
	stats        struct {
		evictions, evictedBytes atomic.Uint64
		commits, revokes        atomic.Uint64
		reserved, reaped        atomic.Uint64
		syncFails               atomic.Uint64 // peers that did not confirm a commit
		delayed                 atomic.Int64  // bytes waiting for FreeDelay
	}
	mu struct {
		sync.Mutex
		// bodies: every local body from its commit's registration to its
		// free, by first extent (bodyLocked).
		bodies bodyTable
		opens  map[uint64]int // Ino -> open readers and drafts
		// evicting: inodes whose eviction is between its open check and
		// its index swap; an open of one waits for the outcome (evict.go).
		evicting map[uint64]chan struct{}
		// resv holds reservations for writers on other nodes (reserve.go).
		resv     map[uint64]*reservation
		nextResv uint64
		// syncSkip: nodes not waited for until then (remote.go).
		syncSkip map[string]time.Time
		// holds other nodes' readers have on local bodies, by id; each
		// pins its body (hold.go).
		holds map[uint64]*bodyHold
		// remoteReaders: open readers of other nodes' bodies, by key.
		remoteReaders map[string]map[*Reader]struct{}
		// leases: this node's reservations on other nodes (lease.go).
		leases map[leaseKey]*resvLease
		// delayed: retired bodies waiting for FreeDelay, in the order
		// they started (so by when it ends), and the one timer that
		// frees them (body.go).
		delayed      []delayedBody
		delayedTimer *time.Timer
		// freeing, while set, collects the extents of the bodies that
		// tryFreeLocked frees, for the holder of s.mu to give back to
		// the segments once it has let go (Puts.Commit): the bodies are
		// gone from here already, their room a moment later.
		freeing *[]segment.Extent
	}
	follow struct {
		seen atomic.Uint64 // highest version the follow loop processed
		idle atomic.Bool   // no retirement waits in the follow loop
	}
	// keeper keeps the LRU in the index's entries where the index can
	// (one machine: LRUKeeper); else lru does, by key.
	keeper LRUKeeper
	lru    struct {
		sync.Mutex
		list *list.List // of string keys, most recent at front
		elem map[string]*list.Element
	}
}

// KeysFor is how many keys a store of capacity bytes makes room for in
// its tables up front: one per 64 KiB (a KV-cache block), at least 1024,
// at most 256k (tables of about 20 MiB).
func KeysFor(capacity uint64) int {
	return int(min(max(capacity/(64<<10), 1024), 256<<10))
}

// New returns a store over the given index and segments.
func New(o Options) (*Store, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	d := DefaultOptions()
	if o.Node == "" {
		o.Node = d.Node
	}
	if o.HighWater == 0 {
		o.HighWater = d.HighWater
	}
	if o.LowWater == 0 {
		o.LowWater = min(d.LowWater, o.HighWater)
	}
	if o.Now == nil {
		o.Now = d.Now
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	if o.ReserveTTL <= 0 {
		o.ReserveTTL = DefaultReserveTTL
	}
	if o.MetaLimit == 0 {
		o.MetaLimit = DefaultMetaLimit(o.Segments.Stats().Size)
	}
	idx := o.Index
	if o.Follow && o.Cluster != nil && o.Transport != nil {
		idx = &sharedIndex{Index: o.Index}
	}
	s := &Store{opts: o, idx: idx, segs: o.Segments, eng: o.Engine,
		kick: make(chan struct{}, 1), done: make(chan struct{}), started: o.Now().UnixNano()}
	if x, ok := idx.(*sharedIndex); ok {
		x.s = s
	}
	s.mu.opens = make(map[uint64]int)
	s.mu.evicting = make(map[uint64]chan struct{})
	s.mu.resv = make(map[uint64]*reservation)
	s.mu.syncSkip = make(map[string]time.Time)
	s.mu.holds = make(map[uint64]*bodyHold)
	s.mu.remoteReaders = make(map[string]map[*Reader]struct{})
	s.mu.leases = make(map[leaseKey]*resvLease)
	s.lru.list = list.New()
	s.lru.elem = make(map[string]*list.Element)
	if k, ok := idx.(LRUKeeper); ok && !o.Follow && !s.clustered() && k.ClaimLRU() {
		s.keeper = k
	}
	if o.Follow {
		if err := s.startFollow(); err != nil {
			return nil, fmt.Errorf("store: follow the index: %w", err)
		}
	}
	if o.Evict {
		s.wg.Add(1)
		go s.evictLoop()
	}
	if o.Follow || o.Transport != nil {
		s.wg.Add(1)
		go s.reapLoop()
	}
	if o.Transport != nil {
		s.wg.Add(1)
		go s.renewLoop()
	}
	return s, nil
}

// Close stops background work. Open readers and drafts stay valid until
// they are closed, but the index and segments belong to the caller.
func (s *Store) Close() {
	select {
	case <-s.done:
	default:
		close(s.done)
	}
	if s.cancel != nil {
		s.cancel()
	}
	s.wg.Wait()
}

// Node returns this store's node name.
func (s *Store) Node() string { return s.opts.Node }

// Transport returns the transport to other nodes (nil on one node).
func (s *Store) Transport() transfer.Transport { return s.opts.Transport }

// Index returns the index the store runs on.
func (s *Store) Index() Index { return s.idx }

// Engine returns the transfer engine the store moves bytes with.
func (s *Store) Engine() *transfer.Engine { return s.eng }

// Stats are the store's figures for status and metrics.
type Stats struct {
	Segments     segment.Stats
	Objects      int
	Evictions    uint64
	EvictedBytes uint64
	Commits      uint64
	Revokes      uint64
	OpenObjects  int
	// LiveBodies counts local bodies not freed yet: current, being
	// committed, or retired and waiting for their readers (body.go).
	LiveBodies int
	// Reservations are open reservations for writers on other nodes;
	// Reserved and Reaped count those made and those that expired.
	Reservations     int
	Reserved, Reaped uint64
	// DelayedFree is retired bytes waiting for FreeDelay.
	DelayedFree int64
	// SyncFails counts other nodes that did not confirm a commit in time.
	SyncFails uint64
	// Holds are other nodes' readers' holds on bodies here; Holding, this
	// node's readers' holds on bodies elsewhere (hold.go).
	Holds, Holding int
	// MetaBytes is the memory index entries take; MetaLimit its bound.
	MetaBytes, MetaLimit uint64
}

// Stats returns current figures. Objects counts keys known to the LRU:
// every file committed through this store and, in a cluster, every file
// with bytes on this node.
func (s *Store) Stats() Stats {
	st := Stats{
		Segments:     s.segs.Stats(),
		Evictions:    s.stats.evictions.Load(),
		EvictedBytes: s.stats.evictedBytes.Load(),
		Commits:      s.stats.commits.Load(),
		Revokes:      s.stats.revokes.Load(),
	}
	st.Objects = s.lruLen()
	s.mu.Lock()
	st.OpenObjects = len(s.mu.opens)
	st.LiveBodies = s.mu.bodies.n
	st.Reservations = len(s.mu.resv)
	st.Holds = len(s.mu.holds)
	for _, m := range s.mu.remoteReaders {
		for r := range m {
			st.Holding += len(r.holds)
		}
	}
	s.mu.Unlock()
	st.Reserved, st.Reaped = s.stats.reserved.Load(), s.stats.reaped.Load()
	st.DelayedFree = s.stats.delayed.Load()
	st.SyncFails = s.stats.syncFails.Load()
	st.MetaBytes, st.MetaLimit = s.metaBytes(), s.opts.MetaLimit
	return st
}

func (s *Store) metaBytes() uint64 {
	if m, ok := s.opts.Index.(MetaSizer); ok {
		return m.MetaBytes()
	}
	return 0
}

// maxMetaEvictions bounds the files one round of a new entry's eviction
// for its room evicts, and maxMetaEvictRounds the rounds.
const (
	maxMetaEvictions   = 64
	maxMetaEvictRounds = 4
)

// metaRoom fails with ErrNoSpace when grow more bytes of metadata would
// pass Options.MetaLimit, after evicting least recently used files to
// make room when the store evicts and its index is its own (metaEvicts;
// the background loop then takes use down to the low watermark).
// Concurrent callers may pass it by what they add between check and
// swap: a bound, not an exact quota.
func (s *Store) metaRoom(op, key string, grow uint64) error {
	if grow == 0 {
		return nil
	}
	limit := s.opts.MetaLimit
	held := uint64(max(s.metaHeld.Load(), 0))
	used := s.metaBytes() + held
	var evictErr error // the index's, when it did not answer a round
	if used+grow > limit && s.metaEvicts() {
		// One commit evicts for room at a time: commits evicting at once
		// took the same keys at the LRU's end from each other and each
		// found it had evicted nothing. The ones that waited may find
		// the room made already.
		s.metaEvicting.Lock()
		held = uint64(max(s.metaHeld.Load(), 0))
		used = s.metaBytes() + held
		for try := 0; used+grow > limit && grow+held <= limit && try < maxMetaEvictRounds; try++ {
			// Not the key that needs the room; a bounded number of files,
			// the loop (kicked) doing the rest. Commits filling at once
			// may take what a round freed: another round, while rounds
			// still evict.
			var evicted bool
			evicted, evictErr = s.evictMetaUntil(context.Background(), limit-grow-held, key, maxMetaEvictions)
			s.kickEvict()
			held = uint64(max(s.metaHeld.Load(), 0))
			used = s.metaBytes() + held
			if !evicted || evictErr != nil {
				break
			}
		}
		s.metaEvicting.Unlock()
	}
	if used+grow > limit && evictErr != nil {
		// As alloc says for bytes: what would make room cannot be
		// removed for now, a timeout (try again), not a full store.
		return fmt.Errorf("%s %q: metadata would take %d B of its %d B limit, and eviction needs the index: %w", op, key, used+grow, limit, evictErr)
	}
	if used+grow > limit {
		return fmt.Errorf("%s %q: metadata would take %d B of its %d B limit: %w", op, key, used+grow, limit, ErrNoSpace)
	}
	return nil
}

// NewIno returns a fresh inode number for a new object: 62 random bits
// (math/rand/v2 is seeded from the OS and needs no syscall per call), so
// daemons of a cluster need no coordination to stay unique.
func NewIno() uint64 {
	// Keep the top bit clear: implicit directories use it.
	return rand.Uint64()&(1<<63-1) | 2
}

func implicitIno(key string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(key))
	return h.Sum64() | 1<<63
}

func (s *Store) now() int64 { return s.opts.Now().UnixNano() }

// localExtents returns the extents of obj's replica on this node.
func (s *Store) localExtents(obj *Object) []segment.Extent {
	if r, ok := obj.replicaHere(s.opts.Node, s.opts.Epoch); ok {
		return r.Extents
	}
	return nil
}

// retireLocked retires the local body of a replaced or deleted object;
// it is freed once nothing holds it (body.go). Caller holds s.mu.
//
// A body whose own commit is still between its swap and its bookkeeping
// (registered: another committer replaced it that fast) is only marked:
// its committer retires it when it records the version
// (publishedBodyLocked), after taking its own reference, so the body is
// never freed under it.
func (s *Store) retireLocked(obj *Object) {
	ext := s.localExtents(obj)
	if len(ext) == 0 {
		return
	}
	b := s.bodyOfLocked(obj, ext[0])
	if b != nil && b.state == bodyRegistered {
		b.doomed = max(b.doomed, obj.Version)
		return
	}
	s.retireBodyLocked(b)
}

// acquireLocked takes a reference on the local body of obj. Caller holds
// s.mu and checked that the body may be leased (readableLocked), or
// publishes it (Commit).
func (s *Store) acquireLocked(obj *Object) *body {
	ext := s.localExtents(obj)
	if len(ext) == 0 {
		return nil
	}
	b := s.bodyOfLocked(obj, ext[0])
	if b == nil {
		// Every local body is registered by the commit that writes it
		// or taken over from a reservation, and OpenReader leases none
		// without a record; Commit and Dup hold one. Not reached.
		b = newBody(ext, bodyLive, obj.Version)
		s.addBodyLocked(b)
	}
	b.refs.Add(1)
	return b
}

func (s *Store) release(b *body) {
	if b != nil && b.unrefLast() {
		s.mu.Lock()
		s.tryFreeLocked(b)
		s.mu.Unlock()
	}
}

// unrefLast drops a lease on b and reports whether it was the last one
// of a retired body, which the caller must then try to free (under
// s.mu): a live body's last release needs no lock.
func (b *body) unrefLast() bool {
	n := b.refs.Add(-1)
	if n < 0 || n&refsCount == refsCount {
		panic("store: body released more often than acquired")
	}
	return n == refsRetired
}

func (s *Store) openIno(ino uint64) {
	s.mu.Lock()
	s.mu.opens[ino]++
	s.mu.Unlock()
}

func (s *Store) closeIno(ino uint64) {
	s.mu.Lock()
	s.closeInoLocked(ino)
	s.mu.Unlock()
}

// closeInoLocked is closeIno for a caller holding s.mu.
func (s *Store) closeInoLocked(ino uint64) {
	if s.mu.opens[ino] <= 1 {
		delete(s.mu.opens, ino)
	} else {
		s.mu.opens[ino]--
	}
}

// IsOpen reports whether any reader or draft holds the object with ino.
func (s *Store) IsOpen(ino uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mu.opens[ino] > 0
}

// committed does the local bookkeeping after a successful swap: retire the
// bodies of replaced objects and refresh the LRU.
func (s *Store) committed(replaced []*Object, put []*Object, deleted []string) {
	s.mu.Lock()
	for _, o := range replaced {
		if o != nil {
			s.retireLocked(o)
		}
	}
	s.mu.Unlock()
	if s.keeper == nil {
		// (A keeper's order lost the keys with their slots: a Forget now
		// could only take out a slot a concurrent put just made.)
		for _, k := range deleted {
			s.forget(k)
		}
	}
	for _, o := range put {
		if o.Kind == KindFile {
			s.Touch(o.Key)
		}
	}
	s.stats.commits.Add(1)
	s.kickEvict()
}

// committedMany is committed for files put by one batch, whose replaced
// versions were retired already, and whose swaps moved them up in a
// keeper's LRU (Swap.Touch).
func (s *Store) committedMany(put []*Object) {
	if s.keeper == nil {
		s.lru.Lock()
		for _, o := range put {
			s.touchLocked(o.Key)
		}
		s.lru.Unlock()
	}
	s.stats.commits.Add(uint64(len(put)))
	s.kickEvict()
}

// kickEvict wakes the eviction loop when use, of bytes or of metadata,
// passed the high watermark.
func (s *Store) kickEvict() {
	if s.opts.Evict && (s.aboveHighWater() || s.metaEvicts() && s.metaAboveHighWater()) {
		select {
		case s.kick <- struct{}{}:
		default:
		}
	}
}

// aboveHighWater reports whether use passed the high watermark.
func (s *Store) aboveHighWater() bool {
	return float64(s.segs.Used()) > s.opts.HighWater*float64(s.segs.Size())
}

// metaAboveHighWater reports whether the index's entries passed the high
// watermark of Options.MetaLimit.
func (s *Store) metaAboveHighWater() bool {
	return float64(s.metaBytes()) > s.opts.HighWater*float64(s.opts.MetaLimit)
}
