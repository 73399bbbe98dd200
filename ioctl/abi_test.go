package ioctl

import (
	"errors"
	"testing"
)

// These numbers are the ABI. Changing one breaks every client built before.
func TestCommandNumbers(t *testing.T) {
	for _, c := range []struct {
		name string
		cmd  uint32
		want uint32
	}{
		{"GET_MAGIC", CmdGetMagic, 0x80104d01},
		{"GET_ABI_VERSION", CmdGetABIVersion, 0x80104d02},
	} {
		if c.cmd != c.want {
			t.Errorf("%s = %#x, want %#x", c.name, c.cmd, c.want)
		}
		if TypeOf(c.cmd) != Type {
			t.Errorf("%s type %#x", c.name, TypeOf(c.cmd))
		}
		if s := Size(c.cmd); s%8 != 0 || s > MaxArgSize {
			t.Errorf("%s size %d not 8-aligned or too large", c.name, s)
		}
	}
}

func TestStructSizes(t *testing.T) {
	if n := len(MagicArg{}.Marshal()); n != 16 {
		t.Errorf("MagicArg %d B", n)
	}
	if n := len(ABIVersionArg{}.Marshal()); n != 16 {
		t.Errorf("ABIVersionArg %d B", n)
	}
}

func TestRoundTrip(t *testing.T) {
	a := ABIVersionArg{Major: 3, Minor: 7}
	var b ABIVersionArg
	if err := b.Unmarshal(a.Marshal()); err != nil || b.Major != 3 || b.Minor != 7 || b.Size != SizeABIVersionArg {
		t.Fatalf("got %+v, %v", b, err)
	}
	m := MagicArg{Magic: MagicValue}
	var m2 MagicArg
	if err := m2.Unmarshal(m.Marshal()); err != nil || m2.Magic != MagicValue {
		t.Fatalf("got %+v, %v", m2, err)
	}
}

func TestDecodeRejects(t *testing.T) {
	var a ABIVersionArg
	if err := a.Unmarshal(make([]byte, 8)); !errors.Is(err, ErrShortArg) {
		t.Errorf("short: %v", err)
	}
	b := ABIVersionArg{}.Marshal()
	b[0] = 99
	if err := a.Unmarshal(b); !errors.Is(err, ErrArgSize) {
		t.Errorf("bad size: %v", err)
	}
}

// TestDataCommandNumbers pins the data-path commands.
func TestDataCommandNumbers(t *testing.T) {
	for _, c := range []struct {
		name      string
		cmd, want uint32
	}{
		{"REGISTER_BUFFER", CmdRegisterBuffer, 0xc0684d10},
		{"UNREGISTER_BUFFER", CmdUnregisterBuffer, 0x40104d11},
		{"PUT_BUF", CmdPutBuf, 0xc0384d12},
		{"GET_BUF", CmdGetBuf, 0xc0384d13},
		{"PUT_VM", CmdPutVM, 0xc0304d14},
		{"GET_VM", CmdGetVM, 0xc0304d15},
		{"STAT", CmdStat, 0xc0f84d16},
		{"BATCH_PUT", CmdBatchPut, 0xfff84d17},
		{"BATCH_GET", CmdBatchGet, 0xfff84d18},
		{"PUT_CUDA", CmdPutCUDA, 0xc0804d19},
		{"GET_CUDA", CmdGetCUDA, 0xc0804d1a},
		{"PUT_KEY", CmdPutKey, 0xc4004d1b},
		{"GET_KEY", CmdGetKey, 0xc4004d1c},
		{"BATCH_PUTV", CmdBatchPutV, 0xfff84d1d},
		{"BATCH_GETV", CmdBatchGetV, 0xfff84d1e},
		{"BATCH_WAIT", CmdBatchWait, 0xfff84d1f},
	} {
		if c.cmd != c.want {
			t.Errorf("%s = %#x, want %#x", c.name, c.cmd, c.want)
		}
		if s := Size(c.cmd); s%8 != 0 || s > MaxArgSize {
			t.Errorf("%s size %d", c.name, s)
		}
	}
}

// TestFieldOffsets encodes each struct with distinct values and finds each
// at the offset the C header uses.
func TestFieldOffsets(t *testing.T) {
	u64 := func(b []byte, off uint64) uint64 { return le.Uint64(b[off:]) }
	u32 := func(b []byte, off uint64) uint32 { return le.Uint32(b[off:]) }
	r := (&RegisterArg{Fd: 7, Kind: KindHost, Len: 11, Offset: 13, ID: 17}).Marshal()
	if u32(r, fieldOffsets["mc_register.fd"]) != 7 || u32(r, fieldOffsets["mc_register.kind"]) != 1 ||
		u64(r, fieldOffsets["mc_register.len"]) != 11 || u64(r, fieldOffsets["mc_register.offset"]) != 13 ||
		u64(r, fieldOffsets["mc_register.id"]) != 17 {
		t.Error("RegisterArg offsets")
	}
	b := (&BufArg{ID: 1, BufOff: 2, Len: 3, ObjOff: 4, Result: 5, Version: 6}).Marshal()
	for i, f := range []string{"id", "buf_off", "len", "obj_off", "result", "version"} {
		if u64(b, fieldOffsets["mc_buf."+f]) != uint64(i+1) {
			t.Errorf("BufArg.%s offset", f)
		}
	}
	v := (&VMArg{Addr: 1, Len: 2, ObjOff: 3, Result: 4, Version: 5}).Marshal()
	for i, f := range []string{"addr", "len", "obj_off", "result", "version"} {
		if u64(v, fieldOffsets["mc_vm."+f]) != uint64(i+1) {
			t.Errorf("VMArg.%s offset", f)
		}
	}
	s := &StatArg{ObjSize: 1, Version: 2, Ino: 3, MtimeNs: 4, Mode: 5, Pinned: 6, Replicas: 7, Extents: 8}
	copy(s.Location[:], "n:x")
	sb := s.Marshal()
	if u64(sb, fieldOffsets["mc_stat.size"]) != 1 || u64(sb, fieldOffsets["mc_stat.mtime_ns"]) != 4 ||
		u32(sb, fieldOffsets["mc_stat.mode"]) != 5 || u32(sb, fieldOffsets["mc_stat.extents"]) != 8 ||
		string(sb[fieldOffsets["mc_stat.location"]:][:3]) != "n:x" {
		t.Error("StatArg offsets")
	}
	var ba BatchArg
	ba.Source = BatchVM
	ba.ID = 9
	if _, err := ba.AddKey("k1", BatchEntry{Addr: 1, Len: 2, ObjOff: 3, Result: -4, Version: 5, Flags: FlagExcl}); err != nil {
		t.Fatal(err)
	}
	if _, err := ba.AddKey("key2", BatchEntry{Len: 8}); err != nil {
		t.Fatal(err)
	}
	bb := ba.Marshal()
	e0 := fieldOffsets["mc_batch.entries"]
	if u32(bb, fieldOffsets["mc_batch.count"]) != 2 || u32(bb, fieldOffsets["mc_batch.source"]) != BatchVM ||
		u64(bb, fieldOffsets["mc_batch.id"]) != 9 || int64(u64(bb, e0+fieldOffsets["mc_batch_entry.result"])) != -4 ||
		u32(bb, e0+fieldOffsets["mc_batch_entry.flags"]) != FlagExcl {
		t.Error("BatchArg offsets")
	}
	var back BatchArg
	if err := back.Unmarshal(bb); err != nil {
		t.Fatal(err)
	}
	if k, err := back.Key(1); err != nil || k != "key2" || back.Entries[0].Result != -4 {
		t.Errorf("batch round trip: %q %v %+v", k, err, back.Entries[0])
	}
}

// TestKeyAndVBatchLayout encodes the 1.3 structs with distinct values,
// finds them at the C header's offsets, and decodes them back.
func TestKeyAndVBatchLayout(t *testing.T) {
	u64 := func(b []byte, off uint64) uint64 { return le.Uint64(b[off:]) }
	k := KeyArg{Source: SrcCUDA, MetaLen: 3, ID: 1, Addr: 2, Len: 3, ObjOff: 4, Result: 5, Version: 6, ObjSize: 7}
	k.Header.Size = SizeKeyArg
	k.GPU.Handle[0], k.GPU.Device[15] = 0xaa, 0xbb
	copy(k.Meta[:], "f32")
	k.KeyLen = uint16(copy(k.Key[:], "a/b"))
	kb := k.Marshal()
	for i, f := range []string{"id", "addr", "len", "obj_off", "result", "version", "size"} {
		if u64(kb, fieldOffsets["mc_key."+f]) != uint64(i+1) {
			t.Errorf("KeyArg.%s offset", f)
		}
	}
	if kb[fieldOffsets["mc_key.gpu"]] != 0xaa || kb[fieldOffsets["mc_key.gpu"]+79] != 0xbb ||
		string(kb[fieldOffsets["mc_key.meta"]:][:3]) != "f32" || string(kb[fieldOffsets["mc_key.key"]:][:3]) != "a/b" ||
		le.Uint16(kb[fieldOffsets["mc_key.key_len"]:]) != 3 || le.Uint32(kb[fieldOffsets["mc_key.source"]:]) != SrcCUDA {
		t.Error("KeyArg offsets")
	}
	var kk KeyArg
	if err := kk.Unmarshal(kb); err != nil || kk != k {
		t.Fatalf("KeyArg round trip: %v", err)
	}
	if key, err := kk.KeyString(); err != nil || key != "a/b" {
		t.Errorf("key %q %v", key, err)
	}
	kk.KeyLen = KeyArgKeyBytes + 1
	if _, err := kk.KeyString(); !errors.Is(err, ErrShortArg) {
		t.Errorf("long key: %v", err)
	}
	kk.MetaLen = MaxMeta + 1
	if _, err := kk.MetaBytes(); !errors.Is(err, ErrShortArg) {
		t.Errorf("long meta: %v", err)
	}

	var v VBatchArg
	v.NGPU = 1
	v.GPUs[0].Handle[1] = 0xcc
	p := vbatchPacker{a: &v}
	segs := []Seg{{ID: SegVM, Off: 0x1000, Len: 10}, {ID: SegGPU | 0, Off: 5, Len: 6}}
	if !p.add("key1", []byte("m"), segs, VBatchEntry{Flags: FlagExcl, ObjOff: 9}) || !p.add("k2", nil, segs[:1], VBatchEntry{}) {
		t.Fatal("add")
	}
	vb := v.Marshal()
	e0 := fieldOffsets["mc_vbatch.entries"]
	if le.Uint32(vb[fieldOffsets["mc_vbatch.count"]:]) != 2 || le.Uint32(vb[fieldOffsets["mc_vbatch.ngpu"]:]) != 1 ||
		vb[fieldOffsets["mc_vbatch.gpus"]+1] != 0xcc || le.Uint32(vb[e0+fieldOffsets["mc_vbatch_entry.flags"]:]) != FlagExcl ||
		u64(vb, e0+fieldOffsets["mc_vbatch_entry.obj_off"]) != 9 {
		t.Error("VBatchArg offsets")
	}
	var back VBatchArg
	if err := back.Unmarshal(vb); err != nil {
		t.Fatal(err)
	}
	if back.Entries[1].SegOff%8 != 0 {
		t.Errorf("segment list at %d, not 8-aligned", back.Entries[1].SegOff)
	}
	got, err := back.Segs(nil, 0)
	key, kerr := back.Key(0)
	meta, merr := back.Meta(0)
	if err != nil || kerr != nil || merr != nil || len(got) != 2 || got[1] != segs[1] || key != "key1" || string(meta) != "m" {
		t.Errorf("entry 0: %+v %q %q %v %v %v", got, key, meta, err, kerr, merr)
	}
	// Out of the area, misaligned, too many or no segments: refused.
	for _, e := range []VBatchEntry{
		{NSeg: 1, SegOff: VBatchAreaBytes}, {NSeg: 1, SegOff: 4}, {NSeg: MaxSegs + 1}, {NSeg: 0},
		{NSeg: 1, SegOff: VBatchAreaBytes - SizeSeg + 8},
	} {
		back.Entries[0] = e
		if _, err := back.Segs(nil, 0); !errors.Is(err, ErrShortArg) {
			t.Errorf("segments %+v: %v", e, err)
		}
	}
	back.Entries[0] = VBatchEntry{KeyOff: 0xffff, KeyLen: 0xffff, MetaOff: 1 << 31, MetaLen: 8}
	if _, err := back.Key(0); !errors.Is(err, ErrShortArg) {
		t.Errorf("key outside: %v", err)
	}
	if _, err := back.Meta(0); !errors.Is(err, ErrShortArg) {
		t.Errorf("meta outside: %v", err)
	}
}
