package ioctl

import (
	"bytes"
	"errors"
	"testing"
)

// FuzzDecode feeds arbitrary bytes to every argument decoder: no panic, only
// the decoding errors, and whatever decodes re-encodes to the same bytes.
func FuzzDecode(f *testing.F) {
	f.Add(MagicArg{Magic: MagicValue}.Marshal())
	f.Add(ABIVersionArg{Major: 1}.Marshal())
	f.Add([]byte{})
	f.Add(make([]byte, 7))
	f.Add((&BufArg{ID: 1, Len: 4096}).Marshal())
	f.Add((&BatchArg{Count: 1}).Marshal())
	f.Add((&KeyArg{KeyLen: 3, MetaLen: 2}).Marshal())
	f.Add((&VBatchArg{Count: 2, NGPU: 1}).Marshal())
	f.Add((&TableArg{Count: 3, Source: BatchVM, Entries: 4096, Keys: 8192, KeysLen: 12}).Marshal())
	f.Fuzz(func(t *testing.T, b []byte) {
		decodeAll(t, b)
		var m MagicArg
		if err := m.Unmarshal(b); err == nil {
			if !bytes.Equal(m.Marshal(), b[:SizeMagicArg]) {
				t.Fatalf("MagicArg does not round-trip")
			}
		} else if !errors.Is(err, ErrShortArg) && !errors.Is(err, ErrArgSize) {
			t.Fatalf("unexpected error %v", err)
		}
		var v ABIVersionArg
		if err := v.Unmarshal(b); err == nil {
			if !bytes.Equal(v.Marshal(), b[:SizeABIVersionArg]) {
				t.Fatalf("ABIVersionArg does not round-trip")
			}
		} else if !errors.Is(err, ErrShortArg) && !errors.Is(err, ErrArgSize) {
			t.Fatalf("unexpected error %v", err)
		}
	})
}

// decodeAll runs the data-path decoders: they must not panic, must fail
// only with decoding errors, and batch keys must stay in bounds.
func decodeAll(t *testing.T, b []byte) {
	ok := func(err error) {
		if err != nil && !errors.Is(err, ErrShortArg) && !errors.Is(err, ErrArgSize) {
			t.Fatalf("unexpected error %v", err)
		}
	}
	var r RegisterArg
	ok(r.Unmarshal(b))
	var u UnregisterArg
	ok(u.Unmarshal(b))
	var ba BufArg
	ok(ba.Unmarshal(b))
	var v VMArg
	ok(v.Unmarshal(b))
	var s StatArg
	ok(s.Unmarshal(b))
	var ka KeyArg
	if err := ka.Unmarshal(b); err == nil {
		if k, err := ka.KeyString(); err == nil && len(k) > KeyArgKeyBytes {
			t.Fatalf("key longer than the key area")
		}
		if m, err := ka.MetaBytes(); err == nil && len(m) > MaxMeta {
			t.Fatalf("meta longer than MaxMeta")
		}
	} else {
		ok(err)
	}
	var ki KeyArg
	if data, err := ki.UnmarshalInline(b); err == nil {
		if len(data) != InlineBytes {
			t.Fatalf("inline data area of %d B", len(data))
		}
	} else {
		ok(err)
	}
	var vb VBatchArg
	if err := vb.Unmarshal(b); err == nil {
		for i := range min(int(vb.Count), MaxBatch) {
			_, kerr := vb.Key(i)
			_, merr := vb.Meta(i)
			segs, serr := vb.Segs(nil, i)
			for _, err := range []error{kerr, merr, serr} {
				ok(err)
			}
			if len(segs) > MaxSegs {
				t.Fatalf("entry %d: %d segments", i, len(segs))
			}
		}
	} else {
		ok(err)
	}
	var ta TableArg
	if err := ta.Unmarshal(b); err == nil {
		if ta.Count == 0 || ta.Count > MaxTable || ta.KeysLen > MaxTableKeyBytes {
			t.Fatalf("table out of its limits decoded: %+v", ta)
		}
		if !bytes.Equal(ta.Marshal(), b[:SizeTableArg]) {
			t.Fatalf("TableArg does not round-trip")
		}
	} else if !errors.Is(err, ErrBadTable) {
		ok(err)
	}
	// Any bytes are a table of entries: decoded, their keys stay inside
	// the key bytes, and they encode back to the same bytes.
	if n := len(b) / SizeBatchEntry; n > 0 {
		es := make([]BatchEntry, n)
		DecodeEntries(es, b)
		keys := b[:len(b)/2]
		for i := range es {
			if k, err := EntryKey(keys, &es[i]); err == nil && (len(k) == 0 || len(k) > len(keys)) {
				t.Fatalf("entry %d: key of %d B from %d", i, len(k), len(keys))
			} else if err != nil {
				ok(err)
			}
		}
		back := make([]byte, TableBytes(n))
		EncodeEntries(back, es)
		if !bytes.Equal(back, b[:TableBytes(n)]) {
			t.Fatalf("entries do not round-trip")
		}
	}
	var bt BatchArg
	if err := bt.Unmarshal(b); err == nil {
		for i := range min(int(bt.Count), MaxBatch) {
			if k, err := bt.Key(i); err == nil && len(k) > BatchKeyBytes {
				t.Fatalf("key %d longer than the key area", i)
			}
		}
	} else {
		ok(err)
	}
}
