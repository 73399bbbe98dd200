// Package etcdindex is the cluster store.Index: objects are etcd keys, and
// every daemon serves lookups from a local cache fed by an etcd watch.
//
// # Layout
//
// Object key k lives at etcd key Prefix+"objects/"+k (Prefix defaults to
// "/mooncake/"). Its value is a versioned JSON encoding of store.Object
// without Key and Version (codec.go); Version is the etcd key's
// ModRevision, so every object written by one CompareAndSwap carries the
// revision of that transaction. Values this version cannot decode
// (unknown format, out of bounds) make Get fail with an error wrapping
// ErrCorrupt; Scan and Watch leave them out.
//
// # Consistency
//
// CompareAndSwap is one etcd transaction and is linearizable: its
// conditions are checked against etcd itself, never against the cache.
// Get, Scan and Watch read the cache, which New fills with one read at
// revision R and an etcd watch from R+1 keeps current, applying whole
// transactions in revision order. Reads are therefore sequentially
// consistent per node, with two guarantees:
//
//   - read-your-writes: after a successful CompareAndSwap of this Index
//     returns, every later Get, Scan or Watch on it waits (at most
//     RequestTimeout) until the cache includes that revision;
//   - after a CompareAndSwap fails with store.ErrConflict, later reads
//     wait likewise for the newest version the transaction found, so a
//     read-modify-write retry loop does not spin on a stale cache.
//
// Writes of other nodes become visible when the watch delivers them
// (typically milliseconds; unbounded while etcd is unreachable). A caller
// that needs a remote write to be visible must rely on the conflict: its
// CompareAndSwap against a stale version fails, and the retry reads the
// newer one.
//
// When the watch fails (the revision it needs was compacted, the member
// lost its leader) the cache reloads the prefix and watchers receive the
// difference as events: deletes, then puts in version order. That is the
// only case where a watcher can miss intermediate versions of a key.
//
// # etcd outages
//
// Every etcd request is bounded by RequestTimeout and fails with an error
// that says "etcd unavailable at <endpoints>" and wraps store.ErrUnavailable
// (ETIMEDOUT at the mount) and the client's error
// (context.DeadlineExceeded when it timed out). Cached reads keep working
// while etcd is away, unless they wait for this node's own write: those
// fail after RequestTimeout with store.ErrUnavailable too. The watch
// reconnects and resumes by itself.
//
// # Locks
//
// Index.mu guards the cache and the revisions; the WatchHub
// (its queue) is taken under Index.mu, never the other way round. No lock
// is held across an etcd call.
//
// # Membership
//
// Join registers a node under Prefix+"nodes/" with a lease; keepalives
// keep it alive, Leave revokes it, and a node that dies simply stops
// renewing, so etcd deletes its entry after the TTL and every member sees
// Left. Membership.mu comes before the watcher queue lock; no lock is
// held across an etcd call.
package etcdindex
