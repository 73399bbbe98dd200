package store

import (
	"bytes"
	"maps"
	"slices"
	"strings"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// Kind tells files from explicit directories (and the store's own
// hidden records from both).
type Kind uint8

const (
	KindFile Kind = iota
	KindDir
	// KindIntent is a rename under way (rename.go), at a key no file can
	// have; listings never show it.
	KindIntent
)

// Replica is one full copy of an object's bytes on one node.
type Replica struct {
	Node string
	// Epoch is the incarnation of the node's daemon that holds the bytes
	// (0 on one machine): a restarted daemon has new memory, and reads of
	// a replica of an earlier incarnation fail instead of returning what
	// the new one keeps there.
	Epoch   uint64
	Extents []segment.Extent
}

// Object is the index entry of one key. Objects handed out by an Index are
// shared: treat them as immutable and Clone before changing one.
type Object struct {
	Key     string
	Ino     uint64 // stable across renames and content replacement
	Size    uint64
	Version uint64 // assigned by the Index at every successful swap
	Mtime   int64  // Unix nanoseconds
	Ctime   int64
	Mode    uint32 // permission bits (07777)
	Uid     uint32
	Gid     uint32
	// (Kind and Pinned after the words: 120 bytes, not 136; a batch
	// put's record of a key, which holds one, fits 320, not 352.)
	Kind   Kind
	Pinned bool // never evicted
	// Xattrs holds user extended attributes (names without the "user." prefix).
	Xattrs   map[string][]byte
	Replicas []Replica
	// body is the record of the local bytes that this store made for the
	// version at its commit (a batch put's, or a draft's on a store of
	// one node), set before the swap and never changed: a lookup that has
	// the object then need not look the record up by extent
	// (bodyOfLocked), and a batch get leases it without the store's lock
	// (Reader.bare). Nil in clones (but the index's own copy of a version
	// it was given) and in objects read from elsewhere.
	body *body
	// slot is the embedded index's entry that took this object (Swap.Cur);
	// nil in clones and in objects no embedded index holds.
	slot *slot
}

// objectOverhead is what an index entry costs beyond its key, xattrs and
// extents: the struct, its tree slot, the encoded copy a cluster keeps.
const objectOverhead = 256

// MetaBytes is what o costs the daemon's memory as an index entry, the
// figure metadata limits count (Options.MetaLimit).
func (o *Object) MetaBytes() uint64 { return entryMeta(o.Key, o.Xattrs) + replicasMeta(o.Replicas) }

// entryMeta is the part of MetaBytes that an entry of key with xattrs
// takes without its replicas.
func entryMeta(key string, xattrs map[string][]byte) uint64 {
	n := uint64(objectOverhead + len(key))
	for k, v := range xattrs {
		n += uint64(len(k) + len(v) + 16)
	}
	return n
}

// replicasMeta is the part of MetaBytes that replicas rs take.
func replicasMeta(rs []Replica) uint64 {
	var n uint64
	for _, r := range rs {
		n += replicaMeta(r.Node, len(r.Extents))
	}
	return n
}

// replicaMeta is the part of MetaBytes that a replica on node of extents
// extents takes.
func replicaMeta(node string, extents int) uint64 { return uint64(len(node) + 24*extents + 16) }

// XattrBytes is the size of o's user xattrs, names and values.
func (o *Object) XattrBytes() int {
	n := 0
	for k, v := range o.Xattrs {
		n += len(k) + len(v)
	}
	return n
}

// Clone returns a deep copy of o, without its record of local bytes.
func (o *Object) Clone() *Object {
	c := new(Object)
	*c = *o
	c.body, c.slot = nil, nil // another version's bytes, not in the index
	// The values too: a caller may hand in a buffer it reuses (a FUSE
	// request), and the index keeps what it was given.
	c.Xattrs = maps.Clone(o.Xattrs)
	for k, v := range c.Xattrs {
		c.Xattrs[k] = slices.Clone(v)
	}
	c.Replicas = nil
	for _, r := range o.Replicas {
		c.Replicas = append(c.Replicas, Replica{Node: r.Node, Epoch: r.Epoch, Extents: slices.Clone(r.Extents)})
	}
	return c
}

// nextBareTo makes c the start of the next version of o, a committed
// object: o without its bytes (no replicas, no body), with set applied as
// setXattrs does. Committed objects never
// change, so o's attribute map is shared while set changes nothing in it
// (a put that sets the attributes the key has), and otherwise copied
// without copying its values.
func (o *Object) nextBareTo(c *Object, set map[string][]byte) *Object {
	*c = *o
	c.body, c.Replicas, c.slot = nil, nil, nil
	if xattrsChanged(o.Xattrs, set) {
		c.Xattrs = maps.Clone(o.Xattrs)
		setXattrs(c, set)
	}
	return c
}

// xattrsChanged reports whether setXattrs(set) would change attrs.
func xattrsChanged(attrs, set map[string][]byte) bool {
	for k, v := range set {
		have, ok := attrs[k]
		if v == nil && ok || v != nil && (!ok || !bytes.Equal(have, v)) {
			return true
		}
	}
	return false
}

// ReplicaOn returns the replica stored on node, if any.
func (o *Object) ReplicaOn(node string) (Replica, bool) {
	for _, r := range o.Replicas {
		if r.Node == node {
			return r, true
		}
	}
	return Replica{}, false
}

// replicaHere returns the replica on node written by its incarnation
// epoch (any, where either side is 0).
func (o *Object) replicaHere(node string, epoch uint64) (Replica, bool) {
	r, ok := o.ReplicaOn(node)
	if ok && r.Epoch != 0 && epoch != 0 && r.Epoch != epoch {
		return Replica{}, false
	}
	return r, ok
}

// Parent returns the key of the directory holding key ("" for the root).
func Parent(key string) string {
	if i := strings.LastIndexByte(key, '/'); i >= 0 {
		return key[:i]
	}
	return ""
}

// Base returns the last component of key.
func Base(key string) string {
	return key[strings.LastIndexByte(key, '/')+1:]
}

// Join appends name to the directory key dir.
func Join(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

// Limits on names, as on Linux file systems.
const (
	MaxNameLen = 255
	MaxKeyLen  = 4095
)

// ValidateName checks one path component.
func ValidateName(name string) error {
	switch {
	case len(name) > MaxNameLen:
		return ErrNameTooLong
	case name == "", name == ".", name == "..", strings.ContainsAny(name, "/\x00"):
		return ErrInvalidName
	}
	return nil
}

// ValidateKey checks a whole key: slash-separated valid names, no leading or
// trailing slash, at most MaxKeyLen bytes. It answers as ValidateName on
// the first bad name.
func ValidateKey(key string) error {
	if len(key) > MaxKeyLen {
		return ErrNameTooLong
	}
	if key == "" {
		return ErrInvalidName
	}
	// The bytes are scanned by strings.IndexByte, many at a time: a KV
	// block's key of 80 bytes took 82 ns one byte at a time, 16 so.
	nul := strings.IndexByte(key, 0)
	if nul < 0 {
		nul = len(key)
	}
	for start := 0; ; {
		end := len(key)
		if i := strings.IndexByte(key[start:], '/'); i >= 0 {
			end = start + i
		}
		// The names before this one hold no NUL: nul >= start.
		switch n := end - start; {
		case n > MaxNameLen:
			return ErrNameTooLong
		case n == 0, nul < end, n == 1 && key[start] == '.', n == 2 && key[start] == '.' && key[start+1] == '.':
			return ErrInvalidName
		}
		if end == len(key) {
			return nil
		}
		start = end + 1
	}
}
