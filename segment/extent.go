package segment

import "fmt"

// ID names one segment. IDs are unique within a node; in a cluster the pair
// (node, ID) is unique.
type ID uint32

// Extent is a byte range inside one segment. An object replica is an ordered
// list of extents whose lengths add up to the replica's allocated size.
type Extent struct {
	Segment ID
	Off     uint64
	Len     uint64
}

// End returns the offset one past the last byte of e.
func (e Extent) End() uint64 { return e.Off + e.Len }

func (e Extent) String() string {
	return fmt.Sprintf("seg%d[%d+%d)", e.Segment, e.Off, e.Len)
}

// TotalLen returns the sum of the lengths of es.
func TotalLen(es []Extent) uint64 {
	var n uint64
	for _, e := range es {
		n += e.Len
	}
	return n
}
