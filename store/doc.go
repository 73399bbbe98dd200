// Package store is the object layer: it turns an Index (the consistent map
// key -> Object) and this node's segments into objects with atomic
// replacement, reader leases and eviction. It never sees a syscall.
//
// # Write protocol
//
// A Draft reserves extents (phase 1), the transfer engine moves bytes into
// them (phase 2), and Commit swaps the new Object into the Index with a
// compare-and-swap on the version (phase 3). A draft that is closed without
// committing frees its reservation (revoke). A draft starts from a base
// version without copying it; the first change copies the base (copy on
// write), except truncation to zero. OpenDraft starts one only while the
// key still holds the caller's inode (else ErrStale). A write or
// truncation that fails fails the draft: it can no longer commit
// (Draft.Err), so nothing around a refused write is ever published.
//
// Keys starting with NUL are the store's hidden records, which no path
// reaches and listings skip: rename intents, and the root's attributes
// once they are changed (key "" names no object; Stat("") reads the
// record).
//
// # Reader leases and freeing
//
// The local bytes of one committed version are a body, identified by its
// first extent (unique among live allocations), with one record from its
// commit to its free (body.go). A Reader holds its body; a replacing or
// deleting commit retires the old body, which is freed when its last
// holder lets go. Metadata-only updates keep the body.
//
// # Eviction
//
// With Options.Evict, allocation failures evict least recently used files
// that are neither open nor pinned, and a background loop keeps use between
// LowWater and HighWater. Without it, a full store fails with ErrNoSpace.
// An eviction marks the inode between its open check and its index swap;
// an open that meets the mark waits for the outcome, so a file is either
// open (and stays) or gone before anyone could open it. OnEvict tells the
// file system of each file evicted, for the kernel to forget its name.
// A pass ends at the first key whose removal the index does not answer
// (ErrUnavailable: etcd away), and the allocation or the metadata room
// behind it fails with that error: each further key would wait out the
// request timeout.
//
// # Metadata
//
// Index entries cost daemon memory (keys, xattrs, extent lists:
// Object.MetaBytes). With an Index that counts them (MetaSizer: both
// indexes do), creates, new keys and growing updates past
// Options.MetaLimit fail with ErrNoSpace; with eviction on and an index
// of this node alone (not Follow) they first evict least recently used
// files for room (never the key that needs it; rounds of at most 64, at
// most 4, one commit evicting at a time), and past the high watermark of
// the limit the eviction loop takes the entries down to the low one, as
// it does for bytes. The new keys of a batch put hold the room they
// found (their replicas counted) until the batch's swap, so that a batch
// does not pass the limit by its own keys nor by another's. Files with no bytes here to evict
// (empty ones) leave the LRU until a commit writes some, pinned ones until
// they are unpinned, and open ones move to its recent end when eviction
// meets them: a pass's look (at most 4096 files it can neither evict nor
// move, 65536 in all) goes to what it may take.
//
// # Indexes
//
// Embedded (this package) serves one machine; store/etcdindex serves a
// cluster through etcd. Both pass store/indextest and fan events out with
// one WatchHub.
//
// # Cluster
//
// With a shared index, a Transport and a Cluster view (remote.go,
// placement.go, reserve.go, repair.go): replicas on other nodes are read
// through the transfer engine; a draft is placed by its Placement (local
// first with spill, spread, node:NAME) and reserves extents on other nodes
// by control calls with a TTL, leased (renewed every third of
// Options.ReserveTTL while its writer lives, lease.go), taken over by the
// owner when its follow loop sees the commit and reaped otherwise; the
// owner admits writes only into live reservations that cover them
// (transfer.WriteGuard); further replicas are copied before the commit
// swaps in; Reconcile drops replicas of dead nodes and restores replica
// counts; objects left without a replica are lost (ErrLost). A checked
// read from another node pins its body until its stream ends
// (CheckBody); retired bodies also wait FreeDelay, which leaves an open
// reader on another node time to ask for a hold when its node sees the
// key change (hold.go).
//
// # Directories
//
// Keys are slash-separated paths. A directory is explicit (an Object of
// KindDir, from Mkdir) or implicit (the prefix of other keys). Removing the
// last child of an implicit directory makes it explicit in the same
// transaction, so "rm -r" finds the directory it expects. When entries
// were last made or removed in a directory is kept in memory, not in its
// record, which every put in it would contend on (dirtimes.go): DirChanged
// is at least its mtime and ctime.
//
// # Lock order
//
// Draft.appendMu -> Draft.rw -> Draft.mu -> Draft.meta -> Store.mu ->
// Index internals; Store.lru is a leaf (on one machine the LRU is the
// index's own, LRUKeeper, under a lock of its own). No store lock is held
// across an index lookup, a transfer or a control call: OpenReader looks
// the key up first and leases the body only if it still holds that
// version (not freed, not a later object's: readableLocked), else looks
// again.
// Draft.mu is held across the draft's own reservations, zero-fill and
// copies, which only its own writers wait for; Size, Dirty, Err, SetMtime
// and Place never wait for it. Freeing a body under Store.mu frees its
// extents in the segments under it too, except in a batch put's commit,
// which collects them (Store.mu.freeing) and frees them after Store.mu.
// The embedded index's lookups and scans share its lock and swaps take it
// alone; its B-tree of keys in order (for scans) has a lock of its own
// and follows the table through a log of changes: a swap appends to it
// under the table's lock, a goroutine makes them once the log is long
// (a third of a swap of new keys, off every call's path), and a scan
// takes the tree's lock after the table's and makes those still pending
// before it reads; its LRU has a third lock, taken after the first or
// alone: a
// swap moves its keys up the LRU after it lets go of the table, Touch
// finds its keys under the shared lock, then moves them, and TouchObjects
// (a batch get's) finds them through the objects read. A swap finds a
// replaced key's entry through the object it replaces (Swap.Cur).
// A batch put's commit takes the index's lock a fixed number of times,
// not once per key: one for each new directory with its ancestors
// (FindMany), the swap, which checks the new keys for keys under them
// (Swap.NoKids, in an index that says it does: ChildGuard; others get one
// look for all before, ManyChildChecker); the index's metadata bytes are
// an atomic. Local bodies are found by their first extent in a table of
// leaves per segment (bodyTable), where a batch's neighbouring extents
// share cache lines. Calls
// in flight together queued behind each other's swaps on per-key read
// locks (an H100 trace, 2026-12-05). The embedded index's lock and a
// batch commit's Store.mu are polled, yielding, for a few tens of
// microseconds before their takers park, on machines of four CPUs or
// more (spin.go): waking a parked goroutine took longer than the holders
// keep them.
//
// # Errors
//
// Sentinels in errors.go, wrapped with the key and sizes; fs/ maps them to
// errno.
package store
