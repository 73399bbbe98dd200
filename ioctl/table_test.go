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
