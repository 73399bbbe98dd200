package etcdindex

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"unicode/utf8"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
)

// The value of an object key in etcd is a JSON document with a format
// version. The key is not stored (it is the etcd key less the prefix) and
// neither is the version (it is the etcd key's ModRevision).
//
// Format 1:
//
//	{"f":1,"k":kind,"i":ino,"s":size,"m":mode,"u":uid,"g":gid,
//	 "mt":mtime,"ct":ctime,"p":pinned,"x":{"name":"base64"},
//	 "r":[{"n":"node","e":[[segment,off,len],...]},...]}
//
// Fields at their zero value are omitted. A decoder refuses formats it does
// not know: a daemon that is older than the entry fails loudly instead of
// dropping fields.
const formatV1 = 1

// Bounds, checked on both encode and decode, so that whatever this index
// writes it can read back, and nothing in etcd can make a decoder allocate
// without limit.
const (
	// MaxValueBytes is the largest encoded object; etcd's default request
	// limit is 1.5 MiB.
	MaxValueBytes = 1 << 20
	// MaxXattrs is the most extended attributes on one object.
	MaxXattrs = 1024
	// MaxXattrValue is the largest attribute value (Linux XATTR_SIZE_MAX).
	MaxXattrValue = 64 << 10
	// MaxReplicas is the most replicas of one object.
	MaxReplicas = 256
)

type wireObject struct {
	Format   int               `json:"f"`
	Kind     store.Kind        `json:"k,omitempty"`
	Ino      uint64            `json:"i,omitempty"`
	Size     uint64            `json:"s,omitempty"`
	Mode     uint32            `json:"m,omitempty"`
	Uid      uint32            `json:"u,omitempty"`
	Gid      uint32            `json:"g,omitempty"`
	Mtime    int64             `json:"mt,omitempty"`
	Ctime    int64             `json:"ct,omitempty"`
	Pinned   bool              `json:"p,omitempty"`
	Xattrs   map[string][]byte `json:"x,omitempty"`
	Replicas []wireReplica     `json:"r,omitempty"`
}

type wireReplica struct {
	Node    string      `json:"n"`
	Epoch   uint64      `json:"p,omitempty"`
	Extents [][3]uint64 `json:"e,omitempty"`
}

// checkBounds returns a description of the first bound o breaks, or "".
func checkBounds(o *store.Object) string {
	if o.Kind > store.KindIntent || (o.Kind == store.KindIntent) != store.IsInternal(o.Key) {
		return fmt.Sprintf("kind %d at key %q", o.Kind, o.Key)
	}
	if len(o.Xattrs) > MaxXattrs {
		return fmt.Sprintf("%d xattrs (max %d)", len(o.Xattrs), MaxXattrs)
	}
	for name, v := range o.Xattrs {
		if len(name) == 0 || len(name) > store.MaxNameLen {
			return fmt.Sprintf("xattr name of %d bytes", len(name))
		}
		if len(v) > MaxXattrValue {
			return fmt.Sprintf("xattr %q of %d bytes (max %d)", name, len(v), MaxXattrValue)
		}
	}
	if len(o.Replicas) > MaxReplicas {
		return fmt.Sprintf("%d replicas (max %d)", len(o.Replicas), MaxReplicas)
	}
	return ""
}

// encode returns the etcd value of o. Objects outside the bounds fail with
// store.ErrTooLarge (sizes) or store.ErrInvalid (kind, names).
func encode(o *store.Object) ([]byte, error) {
	if o.Kind > store.KindIntent {
		return nil, fmt.Errorf("etcdindex: encode %q: kind %d: %w", o.Key, o.Kind, store.ErrInvalid)
	}
	// JSON strings carry UTF-8 only; anything else would come back changed.
	for name := range o.Xattrs {
		if len(name) == 0 || len(name) > store.MaxNameLen || !utf8.ValidString(name) {
			return nil, fmt.Errorf("etcdindex: encode %q: xattr name %q: %w", o.Key, name, store.ErrInvalid)
		}
	}
	for _, r := range o.Replicas {
		if !utf8.ValidString(r.Node) {
			return nil, fmt.Errorf("etcdindex: encode %q: node name %q: %w", o.Key, r.Node, store.ErrInvalid)
		}
	}
	if why := checkBounds(o); why != "" {
		return nil, fmt.Errorf("etcdindex: encode %q: %s: %w", o.Key, why, store.ErrTooLarge)
	}
	w := wireObject{
		Format: formatV1, Kind: o.Kind, Ino: o.Ino, Size: o.Size, Mode: o.Mode, Uid: o.Uid, Gid: o.Gid,
		Mtime: o.Mtime, Ctime: o.Ctime, Pinned: o.Pinned, Xattrs: o.Xattrs,
	}
	if len(o.Replicas) > 0 {
		w.Replicas = make([]wireReplica, len(o.Replicas))
		for i, r := range o.Replicas {
			w.Replicas[i].Node = r.Node
			w.Replicas[i].Epoch = r.Epoch
			if len(r.Extents) > 0 {
				es := make([][3]uint64, len(r.Extents))
				for j, e := range r.Extents {
					es[j] = [3]uint64{uint64(e.Segment), e.Off, e.Len}
				}
				w.Replicas[i].Extents = es
			}
		}
	}
	b, err := json.Marshal(&w)
	if err != nil {
		return nil, fmt.Errorf("etcdindex: encode %q: %w", o.Key, err)
	}
	if len(b) > MaxValueBytes {
		return nil, fmt.Errorf("etcdindex: encode %q: %d bytes (max %d): %w", o.Key, len(b), MaxValueBytes, store.ErrTooLarge)
	}
	return b, nil
}

// decode parses the etcd value of key at version. Every failure wraps
// ErrCorrupt.
func decode(key string, version uint64, b []byte) (*store.Object, error) {
	corrupt := func(format string, args ...any) error {
		return fmt.Errorf("etcdindex: decode %q at version %d: %s: %w", key, version, fmt.Sprintf(format, args...), ErrCorrupt)
	}
	if len(b) > MaxValueBytes {
		return nil, corrupt("%d bytes (max %d)", len(b), MaxValueBytes)
	}
	// Peek at the format first, so that a future format is reported as
	// such rather than as unknown fields.
	var head struct {
		Format int `json:"f"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return nil, corrupt("%v", err)
	}
	if head.Format != formatV1 {
		return nil, corrupt("unknown format %d", head.Format)
	}
	var w wireObject
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&w); err != nil {
		return nil, corrupt("%v", err)
	}
	if _, err := d.Token(); err != io.EOF {
		return nil, corrupt("trailing data")
	}
	o := &store.Object{
		Key: key, Kind: w.Kind, Ino: w.Ino, Size: w.Size, Version: version, Mode: w.Mode, Uid: w.Uid, Gid: w.Gid,
		Mtime: w.Mtime, Ctime: w.Ctime, Pinned: w.Pinned, Xattrs: w.Xattrs,
	}
	if len(w.Replicas) > MaxReplicas {
		return nil, corrupt("%d replicas (max %d)", len(w.Replicas), MaxReplicas)
	}
	if len(w.Replicas) > 0 {
		o.Replicas = make([]store.Replica, len(w.Replicas))
		for i, r := range w.Replicas {
			o.Replicas[i].Node = r.Node
			o.Replicas[i].Epoch = r.Epoch
			if len(r.Extents) > 0 {
				es := make([]segment.Extent, len(r.Extents))
				for j, e := range r.Extents {
					if e[0] > uint64(^segment.ID(0)) {
						return nil, corrupt("segment id %d", e[0])
					}
					es[j] = segment.Extent{Segment: segment.ID(e[0]), Off: e[1], Len: e[2]}
				}
				o.Replicas[i].Extents = es
			}
		}
	}
	if why := checkBounds(o); why != "" {
		return nil, corrupt("%s", why)
	}
	return o, nil
}
