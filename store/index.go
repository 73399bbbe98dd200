package store

import "context"

// Swap is one conditional change in an Index.CompareAndSwap: it applies only
// if the key's current version is Old (0: the key must be absent). New nil
// deletes the key.
type Swap struct {
	Key string
	Old uint64
	New *Object
	// Owned lets the index keep New itself rather than a copy: the caller
	// never changes it once swapped (it may read it).
	Owned bool
	// Touch, with New, makes the key the most recently used as part of
	// the swap, in an index that keeps the store's LRU (LRUKeeper, once
	// claimed): the commit of a put finds the key's entry anyway. Other
	// indexes ignore it.
	Touch bool
	// Cur, when set, is the key's object as the caller found it in this
	// index (Get, Find): the embedded index then finds the key's entry
	// through it, without a lookup, while it is still the key's current
	// object. Old alone decides the check.
	Cur *Object
	// NoKids, with New and Old 0, fails the swap (ErrIsDir) when some key
	// is under Key (it is an implicit directory), in an index that says
	// it checks (ChildGuard); others ignore it, and the caller asks
	// before (ChildChecker).
	NoKids bool
	// InDir fails the swap (ErrNotFound) unless the parent directory of
	// Key is there as the swap lands: its object, or keys under it (an
	// implicit directory), or the root. A file system's create or rename
	// checked before, and a rename of the directory since then would
	// leave the new key under a name that no longer holds a directory.
	// CheckKids fails it (ErrConflict) unless exactly Kids keys are under
	// Key then: a directory's rename moves the keys it found, and rmdir
	// removes one that had none, so a key made under it meanwhile makes
	// them look again. Every index checks both (etcd with a read before
	// its transaction and compares in it). A swap with neither New nor
	// Old carries only these checks.
	InDir     bool
	CheckKids bool
	Kids      int
}

// EventType says what happened to a key.
type EventType uint8

const (
	EventPut EventType = iota
	EventDelete
)

// Event reports one committed change. For deletes, Object holds the last
// version that was removed.
type Event struct {
	Type   EventType
	Object *Object
	// Rev is the index revision of the commit that made the change.
	Rev uint64
	// Last marks the last event of its commit that this watch receives:
	// a multi-key commit (a rename) is complete once Last arrives.
	Last bool
}

// Index is the consistent map key -> Object that every daemon shares.
// Implementations: the embedded index (one machine) and etcd (a cluster).
// MetaSizer is an Index that knows what its entries cost in memory
// (Object.MetaBytes, summed): the store then bounds metadata with
// Options.MetaLimit.
type MetaSizer interface {
	MetaBytes() uint64
}

type Index interface {
	// Get returns the current object of key, or ErrNotFound.
	Get(ctx context.Context, key string) (*Object, error)
	// CompareAndSwap applies all swaps atomically or none of them. On
	// success every New object carries the returned version; on a failed
	// condition it returns an error wrapping ErrConflict and changes nothing.
	CompareAndSwap(ctx context.Context, swaps ...Swap) (uint64, error)
	// Scan returns up to limit objects, in key order, whose keys start with
	// prefix and are >= from. limit <= 0 means no limit.
	Scan(ctx context.Context, prefix, from string, limit int) ([]*Object, error)
	// Watch delivers every committed change to keys starting with prefix,
	// in commit order, until ctx ends; then the channel is closed.
	Watch(ctx context.Context, prefix string) (<-chan Event, error)
	// Close releases the index. Later calls fail with ErrClosed.
	Close() error
}

// Finder is an Index that answers a miss without building an error:
// Find returns nil, nil for a key with no object (the store asks that of
// every new key a batch puts).
type Finder interface {
	Find(ctx context.Context, key string) (*Object, error)
}

// ManyFinder is an Index that looks up many keys at once, as Finder
// does one: objs[i] gets keys[i]'s object, nil for none (a batch's keys
// are looked up under one lock of the index, not one each).
type ManyFinder interface {
	FindMany(ctx context.Context, keys []string, objs []*Object) error
}

// ChildChecker is an Index that can tell whether any key is under a
// directory (starts with dir+"/") without listing one (the store asks on
// every new key: is it an implicit directory?). Indexes without it answer
// through Scan.
type ChildChecker interface {
	HasChildren(ctx context.Context, dir string) (bool, error)
}

// EntryFinder is an Index that finds a key's own object and, for a key
// with none, whether keys lie under it, in one read (Stat): asked one
// after the other, a directory renamed away and back between the two
// reads is found gone and then with keys under it, an implicit directory
// (root's, mode 0755) where its owner's stands.
type EntryFinder interface {
	FindEntry(ctx context.Context, key string) (o *Object, kids bool, err error)
}

// InoFinder is an Index that finds the key of the file with inode number
// ino without a walk of every key (a writer's commit whose file another
// node renamed asks where it went). Internal keys are not answered.
type InoFinder interface {
	FindIno(ctx context.Context, ino uint64) (key string, ok bool, err error)
}

// ChildGuard is an Index that checks Swap.NoKids in the swap itself,
// where the answer cannot change before the key is in: a batch put's
// commit then asks nothing before it (the embedded index, where the
// question took a lock of its own that queued behind other calls'
// swaps).
type ChildGuard interface {
	GuardsChildren() bool
}

// ManyChildChecker is an Index that answers ChildChecker's question for
// many directories at once: has[i] for dirs[i], under one lock of the
// index (a batch's new keys, whose checks one at a time queued behind
// other calls' commits).
type ManyChildChecker interface {
	HasChildrenMany(ctx context.Context, dirs []string, has []bool) error
}

// LRUKeeper is an Index that keeps the store's least recently used order
// of keys in its own entries (one machine's embedded index): a use then
// costs one lookup in a table the commit has just touched, not a second
// table of its own, and a removed key leaves the order with its entry.
// A key without an entry has no place in the order.
type LRUKeeper interface {
	// ClaimLRU reports whether the caller may keep its LRU here: true
	// once, for the first caller.
	ClaimLRU() bool
	// Touch makes each key, in turn, the most recently used.
	Touch(keys ...string)
	// TouchObjects is Touch of the keys of objs, objects this index
	// returned: it may find their entries through them. A key deleted
	// since its object was returned stays out of the order.
	TouchObjects(objs ...*Object)
	// Forget takes key out of the order (until its next Touch).
	Forget(key string)
	// LRUTail returns up to n keys, least recently used first.
	LRUTail(n int) []string
	// LRULen returns how many keys are in the order.
	LRULen() int
}
