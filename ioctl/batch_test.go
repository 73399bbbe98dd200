package ioctl

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

func keys(n, size int) []BatchItem {
	items := make([]BatchItem, n)
	for i := range items {
		k := fmt.Sprintf("k%05d", i)
		k += strings.Repeat("x", max(0, size-len(k)))
		items[i] = BatchItem{Key: k, BufOff: uint64(i) * 4096, Len: 4096}
	}
	return items
}

// TestPackBatch checks that packing splits at MaxBatch entries and at a
// full key area, keeps item order, and encodes every entry so that the
// daemon's decoder finds each key and range.
func TestPackBatch(t *testing.T) {
	for _, c := range []struct {
		name    string
		items   []BatchItem
		want    []int // entries per chunk
		wantErr error
	}{
		{"none", nil, nil, nil},
		{"one", keys(1, 6), []int{1}, nil},
		{"max", keys(MaxBatch, 6), []int{MaxBatch}, nil},
		{"max+1", keys(MaxBatch+1, 6), []int{MaxBatch, 1}, nil},
		{"200", keys(200, 6), []int{64, 64, 64, 8}, nil},
		// 64 keys of 300 B need 19200 B; the key area holds BatchKeyBytes.
		{"keys full", keys(64, 300), []int{BatchKeyBytes / 300, 64 - BatchKeyBytes/300}, nil},
		{"one huge key", keys(3, BatchKeyBytes), []int{1, 1, 1}, nil},
		{"empty key", []BatchItem{{Key: "a"}, {Key: ""}}, nil, ErrBadKey},
		{"key too long", keys(1, BatchKeyBytes+1), nil, ErrBadKey},
		{"data in buf batch", []BatchItem{{Key: "a", Data: []byte{1}}}, nil, ErrBadItem},
	} {
		t.Run(c.name, func(t *testing.T) {
			chunks, err := packBatch(BatchBuf, 7, c.items)
			if !errors.Is(err, c.wantErr) {
				t.Fatalf("err %v, want %v", err, c.wantErr)
			}
			if err != nil {
				return
			}
			var got []int
			next := 0
			for ci, ch := range chunks {
				got = append(got, len(ch.items))
				// Each chunk goes through the wire format as the daemon
				// sees it.
				var a BatchArg
				raw := make([]byte, SizeBatchArg)
				encodeBatch(raw, &ch.sc.arg)
				if !bytes.Equal(raw, ch.sc.arg.Marshal()) {
					t.Fatalf("chunk %d: encodeBatch differs from Marshal", ci)
				}
				if err := a.Unmarshal(raw); err != nil {
					t.Fatal(err)
				}
				if a.Source != BatchBuf || a.ID != 7 || int(a.Count) != len(ch.items) {
					t.Fatalf("chunk %d: source %d id %d count %d", ci, a.Source, a.ID, a.Count)
				}
				for j, i := range ch.items {
					if i != next {
						t.Fatalf("chunk %d entry %d is item %d, want %d", ci, j, i, next)
					}
					next++
					k, err := a.Key(j)
					if err != nil || k != c.items[i].Key {
						t.Fatalf("chunk %d entry %d: key %q, %v; want %q", ci, j, k, err, c.items[i].Key)
					}
					if e := a.Entries[j]; e.Addr != c.items[i].BufOff || e.Len != c.items[i].Len {
						t.Fatalf("entry %d: %+v", i, e)
					}
				}
			}
			if next != len(c.items) {
				t.Fatalf("packed %d of %d items", next, len(c.items))
			}
			if fmt.Sprint(got) != fmt.Sprint(c.want) {
				t.Errorf("chunks %v, want %v", got, c.want)
			}
		})
	}
}

// TestPackBatchVM checks that a VM batch carries each item's address and
// length, and flags and offsets of every source.
func TestPackBatchVM(t *testing.T) {
	a, b := make([]byte, 10), make([]byte, 3)
	items := []BatchItem{{Key: "a", Data: a, Flags: FlagExcl}, {Key: "b", Data: b, ObjOff: 5, Flags: FlagUpdate}, {Key: "empty"}}
	chunks, err := packBatch(BatchVM, 0, items)
	if err != nil || len(chunks) != 1 {
		t.Fatalf("%d chunks, %v", len(chunks), err)
	}
	e := chunks[0].sc.arg.Entries
	if e[0].Addr != uint64(uintptr(unsafe.Pointer(&a[0]))) || e[0].Len != 10 || e[0].Flags != FlagExcl {
		t.Errorf("entry 0 %+v", e[0])
	}
	if e[1].Addr != uint64(uintptr(unsafe.Pointer(&b[0]))) || e[1].Len != 3 || e[1].ObjOff != 5 || e[1].Flags != FlagUpdate {
		t.Errorf("entry 1 %+v", e[1])
	}
	if e[2].Addr != 0 || e[2].Len != 0 {
		t.Errorf("entry 2 %+v", e[2])
	}
	if _, err := packBatch(BatchVM, 0, []BatchItem{{Key: "a", Len: 4}}); !errors.Is(err, ErrBadItem) {
		t.Errorf("Len in a VM batch: %v", err)
	}
}

// TestErrorsOnOtherFS runs commands on a file of another file system: the
// errno comes back wrapped with the command and path, nothing panics.
func TestErrorsOnOtherFS(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	f, err := Open(path, os.O_RDWR|os.O_CREATE)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, _, err := f.PutVM([]byte("x"), 0); !errors.Is(err, unix.ENOTTY) || !strings.Contains(err.Error(), "put_vm "+path) {
		t.Errorf("PutVM: %v", err)
	}
	if _, err := f.Stat(); !errors.Is(err, unix.ENOTTY) {
		t.Errorf("Stat: %v", err)
	}
	if _, err := f.Probe(); !errors.Is(err, ErrNotMooncake) {
		t.Errorf("Probe: %v", err)
	}
	d, err := OpenDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	res, err := d.BatchGet([]BatchItem{{Key: "f", Data: make([]byte, 4)}, {Key: "g"}})
	if !errors.Is(err, unix.ENOTTY) || len(res) != 2 || !errors.Is(res[1].Err, unix.ENOTTY) {
		t.Errorf("BatchGet: %v, results %v", err, res)
	}
	if !d.oldABI.Load() {
		t.Error("a table call refused with ENOTTY left the File on table calls")
	}
	if _, err := OpenDir(path); !errors.Is(err, unix.ENOTDIR) {
		t.Errorf("OpenDir of a file: %v", err)
	}
}

// TestBatchEntryOut reads the out fields where the daemon writes them.
func TestBatchEntryOut(t *testing.T) {
	var a BatchArg
	for i := range 3 {
		if _, err := a.AddKey(fmt.Sprint("k", i), BatchEntry{Result: int64(i) - 1, Version: uint64(100 + i)}); err != nil {
			t.Fatal(err)
		}
	}
	b := a.Marshal()
	for i := range 3 {
		if r, v := batchEntryOut(b, i); r != int64(i)-1 || v != uint64(100+i) {
			t.Errorf("entry %d: %d, %d", i, r, v)
		}
	}
}

// TestBatchAllocs: a batch of one key allocates little (no 16 KiB
// arguments per call).
func TestBatchAllocs(t *testing.T) {
	items := []BatchItem{{Key: "key", BufOff: 0, Len: 4096}}
	allocs := testing.AllocsPerRun(100, func() {
		chunks, err := packBatch(BatchBuf, 1, items)
		if err != nil {
			t.Fatal(err)
		}
		encodeBatch(chunks[0].sc.raw[:], &chunks[0].sc.arg)
		releaseChunks(chunks)
	})
	if allocs > 3 {
		t.Errorf("%.0f allocations per batch of one", allocs)
	}
}

// TestMarshalInto: a reply encoded into a used buffer is Marshal's bytes
// exactly (nothing of the buffer's past survives), and a short buffer
// gets Marshal's first bytes.
func TestMarshalInto(t *testing.T) {
	var a BatchArg
	if _, err := a.AddKey("k1", BatchEntry{Addr: 7, Len: 9}); err != nil {
		t.Fatal(err)
	}
	a.Entries[0].Result, a.Entries[0].Version = 9, 3
	var v VBatchArg
	v.Count, v.NGPU, v.Entries[0].Result, v.Area[5] = 1, 1, -2, 'x'
	k := KeyArg{Source: SrcVM, KeyLen: 2, MetaLen: 1, Addr: 7, Len: 9, Result: 9, Version: 3}
	copy(k.Key[:], "k1")
	k.Meta[0] = 'm'
	for _, c := range []struct {
		want []byte
		into func([]byte)
	}{{a.Marshal(), a.MarshalInto}, {v.Marshal(), v.MarshalInto}, {k.Marshal(), k.MarshalInto}} {
		buf := bytes.Repeat([]byte{0xa5}, len(c.want)+8)
		c.into(buf)
		if !bytes.Equal(buf[:len(c.want)], c.want) || !bytes.Equal(buf[len(c.want):], bytes.Repeat([]byte{0xa5}, 8)) {
			t.Fatalf("MarshalInto a used buffer differs from Marshal")
		}
		short := make([]byte, 100)
		c.into(short)
		if !bytes.Equal(short, c.want[:100]) {
			t.Fatalf("MarshalInto a short buffer differs from Marshal's start")
		}
	}
}

// TestIndependent: the calls of a batch overlap only when their order
// cannot show.
func TestIndependent(t *testing.T) {
	one := make([]byte, 8)
	items := func(keys string, flags ...uint32) []BatchItem {
		var its []BatchItem
		for i, k := range strings.Fields(keys) {
			it := BatchItem{Key: k}
			if i < len(flags) {
				it.Flags = flags[i]
			}
			its = append(its, it)
		}
		return its
	}
	for _, c := range []struct {
		name  string
		cmd   uint32
		items []BatchItem
		want  bool
	}{
		{"distinct puts", CmdBatchPut, items("a b c"), true},
		{"a put twice", CmdBatchPut, items("a b a"), false},
		{"gets of a key twice", CmdBatchGet, items("a b a"), true},
		{"gets into apart ranges", CmdBatchGet, []BatchItem{{Key: "a", BufOff: 0, Len: 10}, {Key: "b", BufOff: 10, Len: 5}}, true},
		{"gets into overlapping ranges", CmdBatchGet, []BatchItem{{Key: "a", BufOff: 20, Len: 10}, {Key: "b", BufOff: 5, Len: 16}}, false},
		{"gets into a range holding two", CmdBatchGet, []BatchItem{{Key: "a", BufOff: 0, Len: 100}, {Key: "b", BufOff: 10, Len: 5}, {Key: "c", BufOff: 50, Len: 5}}, false},
		{"gets into two slices", CmdBatchGet, []BatchItem{{Key: "a", Data: make([]byte, 8)}, {Key: "b", Data: make([]byte, 8)}}, true},
		{"gets into one slice twice", CmdBatchGet, []BatchItem{{Key: "a", Data: one}, {Key: "b", Data: one[4:]}}, false},
		{"a key and its directory", CmdBatchPut, items("b x/y x", FlagParents, FlagParents, FlagParents), false},
		{"keys below one directory", CmdBatchPut, items("x/a x/b xy"), true},
		{"parents on every key", CmdBatchPut, items("a b", FlagParents, FlagParents|FlagExcl), true},
		{"parents on some", CmdBatchPut, items("x/a y", FlagParents, 0), false},
		{"exclusive", CmdBatchPut, items("a b", FlagExcl), true},
	} {
		if got := independent(c.cmd, c.items); got != c.want {
			t.Errorf("%s: independent %v, want %v", c.name, got, c.want)
		}
	}
}

// TestMarshalIntoNoAlloc: a reply encoded into an output of its size
// allocates nothing (the daemon encodes every call's reply this way).
func TestMarshalIntoNoAlloc(t *testing.T) {
	out := make([]byte, SizeVBatchArg)
	var k KeyArg
	var b BatchArg
	var v VBatchArg
	if n := testing.AllocsPerRun(100, func() { k.MarshalInto(out); b.MarshalInto(out); v.MarshalInto(out) }); n != 0 {
		t.Fatalf("%v allocations encoding three replies", n)
	}
}
