package etcdindex

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
)

// Node is one daemon of the cluster as it registers itself under
// Prefix+"nodes/"+Name.
type Node struct {
	// Name identifies the node in the cluster and in object replicas. It is
	// 1 to MaxNodeName bytes of UTF-8 without '/' or control characters.
	Name string
	// Addr is the transport endpoint peers dial ("10.0.0.1:7070").
	Addr string
	// Capacity, Used and Free are bytes over all of the node's segments.
	// They are reported, not checked: Used+Free need not equal Capacity.
	Capacity, Used, Free uint64
	// Segments are the node's segments; at most MaxNodeSegments.
	Segments []SegmentInfo
	// Started is when the daemon started; Join sets it to now when zero.
	// It is kept to the nanosecond in UTC. The zero time and the Unix
	// epoch encode alike (as absent) and both decode as the zero time.
	Started time.Time
}

// SegmentInfo describes one segment of a node.
type SegmentInfo struct {
	ID   segment.ID
	Size uint64
}

// The value of a node key is a JSON document with a format version:
//
//	{"f":1,"n":name,"a":addr,"c":capacity,"u":used,"fr":free,
//	 "s":[[id,size],...],"t":started_unix_nanos}
//
// Fields at their zero value other than "f" and "n" are omitted; unknown
// fields and formats are refused, as for objects.
const nodeFormatV1 = 1

const (
	// MaxNodeBytes is the largest encoded node.
	MaxNodeBytes = 64 << 10
	// MaxNodeName is the longest node name, in bytes.
	MaxNodeName = 255
	// MaxNodeAddr is the longest transport address, in bytes.
	MaxNodeAddr = 1024
	// MaxNodeSegments is the most segments one node may register.
	MaxNodeSegments = 1024
)

type wireNode struct {
	Format   int         `json:"f"`
	Name     string      `json:"n"`
	Addr     string      `json:"a,omitempty"`
	Capacity uint64      `json:"c,omitempty"`
	Used     uint64      `json:"u,omitempty"`
	Free     uint64      `json:"fr,omitempty"`
	Segments [][2]uint64 `json:"s,omitempty"`
	Started  int64       `json:"t,omitempty"`
}

// checkNodeName returns why name cannot name a node, or "".
func checkNodeName(name string) string {
	switch {
	case name == "":
		return "empty node name"
	case len(name) > MaxNodeName:
		return fmt.Sprintf("node name of %d bytes (max %d)", len(name), MaxNodeName)
	case !utf8.ValidString(name):
		return fmt.Sprintf("node name %q is not UTF-8", name)
	case strings.ContainsFunc(name, func(r rune) bool { return r == '/' || r < 0x20 || r == 0x7f }):
		return fmt.Sprintf("node name %q contains '/' or a control character", name)
	}
	return ""
}

// checkNode returns why n cannot be encoded, or "".
func checkNode(n *Node) string {
	if why := checkNodeName(n.Name); why != "" {
		return why
	}
	switch {
	case len(n.Addr) > MaxNodeAddr:
		return fmt.Sprintf("address of %d bytes (max %d)", len(n.Addr), MaxNodeAddr)
	case !utf8.ValidString(n.Addr):
		return fmt.Sprintf("address %q is not UTF-8", n.Addr)
	case len(n.Segments) > MaxNodeSegments:
		return fmt.Sprintf("%d segments (max %d)", len(n.Segments), MaxNodeSegments)
	}
	if !n.Started.IsZero() {
		// UnixNano is defined for 1678 to 2262 only.
		if y := n.Started.Year(); y < 1678 || y > 2261 {
			return fmt.Sprintf("start time %v out of range", n.Started)
		}
	}
	return ""
}

// encodeNode returns the etcd value of n, or an error wrapping
// store.ErrInvalid for a node outside the bounds above.
func encodeNode(n *Node) ([]byte, error) {
	if why := checkNode(n); why != "" {
		return nil, fmt.Errorf("etcdindex: encode node %q: %s: %w", n.Name, why, store.ErrInvalid)
	}
	w := wireNode{Format: nodeFormatV1, Name: n.Name, Addr: n.Addr, Capacity: n.Capacity, Used: n.Used, Free: n.Free}
	if !n.Started.IsZero() {
		w.Started = n.Started.UnixNano()
	}
	if len(n.Segments) > 0 {
		w.Segments = make([][2]uint64, len(n.Segments))
		for i, s := range n.Segments {
			w.Segments[i] = [2]uint64{uint64(s.ID), s.Size}
		}
	}
	b, err := json.Marshal(&w)
	if err != nil {
		return nil, fmt.Errorf("etcdindex: encode node %q: %w", n.Name, err)
	}
	if len(b) > MaxNodeBytes {
		return nil, fmt.Errorf("etcdindex: encode node %q: %d bytes (max %d): %w", n.Name, len(b), MaxNodeBytes, store.ErrInvalid)
	}
	return b, nil
}

// decodeNode parses the etcd value of a node key. Every failure wraps
// ErrCorrupt. The caller checks that the name matches the key.
func decodeNode(b []byte) (Node, error) {
	corrupt := func(format string, args ...any) error {
		return fmt.Errorf("etcdindex: decode node: %s: %w", fmt.Sprintf(format, args...), ErrCorrupt)
	}
	if len(b) > MaxNodeBytes {
		return Node{}, corrupt("%d bytes (max %d)", len(b), MaxNodeBytes)
	}
	var head struct {
		Format int `json:"f"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return Node{}, corrupt("%v", err)
	}
	if head.Format != nodeFormatV1 {
		return Node{}, corrupt("unknown format %d", head.Format)
	}
	var w wireNode
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(&w); err != nil {
		return Node{}, corrupt("%v", err)
	}
	if _, err := d.Token(); err != io.EOF {
		return Node{}, corrupt("trailing data")
	}
	n := Node{Name: w.Name, Addr: w.Addr, Capacity: w.Capacity, Used: w.Used, Free: w.Free}
	if w.Started != 0 {
		n.Started = time.Unix(0, w.Started).UTC()
	}
	if len(w.Segments) > MaxNodeSegments {
		return Node{}, corrupt("%d segments (max %d)", len(w.Segments), MaxNodeSegments)
	}
	if len(w.Segments) > 0 {
		n.Segments = make([]SegmentInfo, len(w.Segments))
		for i, s := range w.Segments {
			if s[0] > uint64(^segment.ID(0)) {
				return Node{}, corrupt("segment id %d", s[0])
			}
			n.Segments[i] = SegmentInfo{ID: segment.ID(s[0]), Size: s[1]}
		}
	}
	if why := checkNode(&n); why != "" {
		return Node{}, corrupt("%s", why)
	}
	return n, nil
}
