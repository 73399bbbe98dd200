package ioctl

import (
	"errors"
	"fmt"
	"testing"
)

// TestTableArg: the argument round-trips, and every limit is checked
// when it is decoded.
func TestTableArg(t *testing.T) {
	good := TableArg{Header: Header{Size: SizeTableArg}, Count: 7, Source: BatchBuf, ID: 3, Entries: 0x1000, Keys: 0x2000, KeysLen: 99}
	var back TableArg
	if err := back.Unmarshal(good.Marshal()); err != nil || back != good {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
	for _, bad := range []func(a *TableArg){
		func(a *TableArg) { a.Count = 0 },
		func(a *TableArg) { a.Count = MaxTable + 1 },
		func(a *TableArg) { a.Source = 2 },
		func(a *TableArg) { a.KeysLen = MaxTableKeyBytes + 1 },
		func(a *TableArg) { a.Flags = 1 },
	} {
		a := good
		bad(&a)
		if err := back.Unmarshal(a.Marshal()); !errors.Is(err, ErrBadTable) {
			t.Errorf("%+v: %v", a, err)
		}
	}
	b := good.Marshal()
	b[44] = 1 // the padding
	if err := back.Unmarshal(b); !errors.Is(err, ErrBadTable) {
		t.Errorf("padding set: %v", err)
	}
	if err := back.Unmarshal(b[:SizeTableArg-1]); !errors.Is(err, ErrShortArg) {
		t.Errorf("short: %v", err)
	}
}

// TestTableKeys: how a batch is cut into table calls.
func TestTableKeys(t *testing.T) {
	defer func(n, k int) { BatchInFlight, BatchCallKeys = n, k }(BatchInFlight, BatchCallKeys)
	for _, c := range []struct {
		inFlight, callKeys, n int
		parallel              bool
		want                  int
	}{
		{4, MaxTable, 5000, false, MaxTable},
		{4, MaxTable, 1024, true, 256},
		{4, MaxTable, 100, true, MaxBatch},
		{4, MaxTable, 5000, true, MaxTable},
		{2, MaxTable, 1024, true, 512},
		{4, MaxBatch, 1024, true, MaxBatch},
		{4, 1, 1024, false, MaxBatch},          // below MaxBatch: MaxBatch
		{4, 1 << 20, 1 << 20, false, MaxTable}, // above MaxTable: MaxTable
	} {
		BatchInFlight, BatchCallKeys = c.inFlight, c.callKeys
		if got := tableKeys(c.n, c.parallel); got != c.want {
			t.Errorf("%+v: %d", c, got)
		}
	}
}

// TestEntryCodec: entries encode as BatchArg's do, and a key is read
// only from inside the key bytes.
func TestEntryCodec(t *testing.T) {
	var a BatchArg
	for i := range 3 {
		if _, err := a.AddKey(fmt.Sprint("key", i), BatchEntry{Flags: uint32(i), Addr: 10 + uint64(i), Len: 5, ObjOff: 2, Result: -int64(i), Version: 9}); err != nil {
			t.Fatal(err)
		}
	}
	wire := a.Marshal()
	tab := make([]byte, TableBytes(3))
	EncodeEntries(tab, a.Entries[:3])
	if string(tab) != string(wire[24:24+TableBytes(3)]) {
		t.Fatal("a table's entries are not BATCH_PUT's")
	}
	es := make([]BatchEntry, 3)
	DecodeEntries(es, tab)
	for i := range es {
		if es[i] != a.Entries[i] {
			t.Fatalf("entry %d: %+v, want %+v", i, es[i], a.Entries[i])
		}
		if k, err := EntryKey(a.Keys[:12], &es[i]); err != nil || string(k) != fmt.Sprint("key", i) {
			t.Fatalf("key %d: %q, %v", i, k, err)
		}
	}
	if _, err := EntryKey(a.Keys[:11], &es[2]); !errors.Is(err, ErrShortArg) {
		t.Fatalf("key past the key bytes: %v", err)
	}
	if _, err := EntryKey(a.Keys[:], &BatchEntry{}); !errors.Is(err, ErrShortArg) {
		t.Fatalf("empty key: %v", err)
	}
}

// TestTableCalls: how a batch is cut into table calls, and which may
// overlap: a get whose destinations overlap goes in order, each call
// ending before an item that overlaps one already in it.
func TestTableCalls(t *testing.T) {
	defer func(n, k int) { BatchInFlight, BatchCallKeys = n, k }(BatchInFlight, BatchCallKeys)
	BatchInFlight, BatchCallKeys = 4, MaxTable
	gets := func(n int, dst func(i int) uint64) []BatchItem {
		items := make([]BatchItem, n)
		for i := range items {
			items[i] = BatchItem{Key: fmt.Sprint("k", i), BufOff: dst(i), Len: 4096}
		}
		return items
	}
	for _, c := range []struct {
		name     string
		cmd      uint32
		items    []BatchItem
		want     string
		parallel bool
	}{
		{"apart", CmdBatchGet, gets(1024, func(i int) uint64 { return uint64(i) * 4096 }), "[[0 256] [256 512] [512 768] [768 1024]]", true},
		{"few apart", CmdBatchGet, gets(10, func(i int) uint64 { return uint64(i) * 4096 }), "[[0 10]]", false},
		// Items 0 and 600 share a buffer, and 700 and 701.
		{"overlapping", CmdBatchGet, gets(1024, func(i int) uint64 {
			switch i {
			case 600:
				return 0
			case 701:
				return 700*4096 + 100
			}
			return uint64(i) * 4096
		}), "[[0 600] [600 701] [701 1024]]", false},
		{"puts", CmdBatchPut, gets(2000, func(int) uint64 { return 0 }), "[[0 500] [500 1000] [1000 1500] [1500 2000]]", true},
	} {
		calls, parallel := tableCalls(c.cmd, c.items)
		if fmt.Sprint(calls) != c.want || parallel != c.parallel {
			t.Errorf("%s: %v, parallel %v; want %s, %v", c.name, calls, parallel, c.want, c.parallel)
		}
	}
}
