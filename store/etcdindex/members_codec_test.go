package etcdindex

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/store"
)

func fullNode() Node {
	return Node{
		Name: "node-α", Addr: "10.0.0.1:7070", Capacity: 1<<64 - 1, Used: 3, Free: 1 << 40,
		Segments: []SegmentInfo{{ID: 1<<32 - 1, Size: 1 << 30}, {ID: 0, Size: 0}},
		Started:  time.Date(2026, 8, 1, 12, 0, 0, 123456789, time.UTC),
	}
}

func TestNodeCodecRoundTrip(t *testing.T) {
	for _, n := range []Node{fullNode(), {Name: "n"}} {
		b, err := encodeNode(&n)
		if err != nil {
			t.Fatal(err)
		}
		got, err := decodeNode(b)
		if err != nil {
			t.Fatalf("decode %s: %v", b, err)
		}
		if !nodeEqual(got, n) {
			t.Fatalf("round trip of %s:\n got %+v\nwant %+v", b, got, n)
		}
	}
}

func TestNodeEncodeRejects(t *testing.T) {
	for _, n := range []Node{
		{}, {Name: "a/b"}, {Name: "a\nb"}, {Name: strings.Repeat("x", MaxNodeName+1)}, {Name: "\xff"},
		{Name: "n", Addr: "\xff"}, {Name: "n", Segments: make([]SegmentInfo, MaxNodeSegments+1)},
		{Name: "n", Started: time.Date(3000, 1, 1, 0, 0, 0, 0, time.UTC)},
	} {
		if _, err := encodeNode(&n); !errors.Is(err, store.ErrInvalid) {
			t.Errorf("encode %+v: %v, want ErrInvalid", n, err)
		}
	}
}

func TestNodeDecodeRejects(t *testing.T) {
	for _, b := range []string{
		``, `null`, `{}`, `{"f":0,"n":"a"}`, `{"f":2,"n":"a"}`, `[1]`,
		`{"f":1}`,                              // no name
		`{"f":1,"n":"a/b"}`,                    // bad name
		`{"f":1,"n":"a","zz":1}`,               // unknown field
		`{"f":1,"n":"a"} {}`,                   // trailing data
		`{"f":1,"n":"a","s":[[4294967296,0]]}`, // segment id overflow
		`{"f":1,"n":"a","u":-1}`,
		`{"f":1,"n":"a","t":"now"}`,
	} {
		if n, err := decodeNode([]byte(b)); !errors.Is(err, ErrCorrupt) {
			t.Errorf("decodeNode(%s) = %+v, %v; want ErrCorrupt", b, n, err)
		}
	}
}

// FuzzDecodeNode: no input panics the decoder; every failure is
// ErrCorrupt; whatever decodes encodes again and decodes to the same node.
func FuzzDecodeNode(f *testing.F) {
	for _, n := range []Node{fullNode(), {Name: "n"}} {
		b, err := encodeNode(&n)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte(`{"f":1,"n":"a","s":[],"t":-1}`))
	f.Add([]byte(`{"f":2}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		n, err := decodeNode(b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("decode error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		b2, err := encodeNode(&n)
		if err != nil {
			t.Fatalf("re-encode of decoded %+v: %v", n, err)
		}
		n2, err := decodeNode(b2)
		if err != nil {
			t.Fatalf("decode of re-encoded %s: %v", b2, err)
		}
		if !nodeEqual(n, n2) {
			t.Fatalf("round trip changed the node:\n%+v\n%+v", n, n2)
		}
	})
}
