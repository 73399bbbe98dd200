package etcdindex

import (
	"errors"
	"reflect"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
)

func full() *store.Object {
	return &store.Object{
		Key: "d/f", Kind: store.KindFile, Ino: 9, Size: 1 << 40, Version: 77, Mode: 0o640, Uid: 1, Gid: 2,
		Mtime: -5, Ctime: 1 << 62, Pinned: true,
		Xattrs: map[string][]byte{"tag": []byte("v"), "empty": {}},
		Replicas: []store.Replica{
			{Node: "n1", Extents: []segment.Extent{{Segment: 1<<32 - 1, Off: 1<<64 - 1, Len: 4096}}},
			{Node: "n2"},
		},
	}
}

// normal makes nil and empty collections alike, as the encoding does.
func normal(o *store.Object) *store.Object {
	c := o.Clone()
	if len(c.Xattrs) == 0 {
		c.Xattrs = nil
	}
	for k, v := range c.Xattrs {
		if len(v) == 0 {
			c.Xattrs[k] = nil
		}
	}
	for i := range c.Replicas {
		if len(c.Replicas[i].Extents) == 0 {
			c.Replicas[i].Extents = nil
		}
	}
	return c
}

func TestCodecRoundTrip(t *testing.T) {
	for _, o := range []*store.Object{full(), {Key: "d", Kind: store.KindDir}} {
		b, err := encode(o)
		if err != nil {
			t.Fatal(err)
		}
		got, err := decode(o.Key, o.Version, b)
		if err != nil {
			t.Fatalf("decode %s: %v", b, err)
		}
		if !reflect.DeepEqual(normal(got), normal(o)) {
			t.Fatalf("round trip of %s:\n got %+v\nwant %+v", b, got, o)
		}
	}
}

func TestDecodeRejects(t *testing.T) {
	for _, b := range []string{
		``, `null`, `{}`, `{"f":0}`, `{"f":2}`, `{"f":"1"}`, `[1]`,
		`{"f":1,"k":3}`,   // bad kind
		`{"f":1,"k":2}`,   // an intent at a file's key
		`{"f":1,"zz":1}`,  // unknown field
		`{"f":1} {"f":1}`, // trailing data
		`{"f":1,"r":[{"n":"a","e":[[4294967296,0,0]]}]}`, // segment id overflow
		`{"f":1,"x":{"":"AA=="}}`,                        // empty xattr name
		`{"f":1,"s":-1}`,
	} {
		if o, err := decode("k", 1, []byte(b)); !errors.Is(err, ErrCorrupt) {
			t.Errorf("decode(%s) = %+v, %v; want ErrCorrupt", b, o, err)
		}
	}
}

// FuzzDecode: no input panics the decoder; every failure is ErrCorrupt;
// whatever decodes encodes again and decodes to the same object.
func FuzzDecode(f *testing.F) {
	for _, o := range []*store.Object{full(), {Key: "d", Kind: store.KindDir}} {
		b, err := encode(o)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte(`{"f":1,"x":{"a":null},"r":[{"n":"x","e":[]}]}`))
	f.Add([]byte(`{"f":2}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		o, err := decode("k", 3, b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("decode error %v does not wrap ErrCorrupt", err)
			}
			return
		}
		if o.Key != "k" || o.Version != 3 {
			t.Fatalf("decode set key %q version %d", o.Key, o.Version)
		}
		b2, err := encode(o)
		if err != nil {
			// Only names that are not UTF-8 are refused on the way out.
			if !errors.Is(err, store.ErrInvalid) {
				t.Fatalf("re-encode of a decoded object: %v", err)
			}
			return
		}
		o2, err := decode("k", 3, b2)
		if err != nil {
			t.Fatalf("decode of re-encoded %s: %v", b2, err)
		}
		if !reflect.DeepEqual(normal(o), normal(o2)) {
			t.Fatalf("round trip changed the object:\n%+v\n%+v", o, o2)
		}
	})
}
