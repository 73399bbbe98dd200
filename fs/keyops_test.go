package fs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/store"
)

// callerCtx is a request of thread tid, as root.
func callerCtx(tid int) context.Context {
	return fuse.NewContext(context.Background(), &fuse.Caller{Owner: fuse.Owner{Uid: 0, Gid: 0}, Pid: uint32(tid)})
}

func addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

// keyCall runs PUT_KEY or GET_KEY a for key on the fixture's root.
func keyCall(t testing.TB, fx *fuzzFixture, put bool, key string, a *ioctl.KeyArg) syscall.Errno {
	t.Helper()
	a.KeyLen = uint16(copy(a.Key[:], key))
	cmd := ioctl.CmdGetKey
	if put {
		cmd = ioctl.CmdPutKey
	}
	out := make([]byte, ioctl.SizeKeyArg)
	_, errno := fx.root.Ioctl(callerCtx(os.Getpid()), fx.dh, cmd, 0, a.Marshal(), out)
	if errno == 0 {
		if err := a.Unmarshal(out); err != nil {
			t.Fatal(err)
		}
	}
	return errno
}

// TestKeyMeta: a put stores its meta with the value, a lookup returns
// size and meta, a get that asks for another meta moves nothing, and a
// put without meta removes it.
func TestKeyMeta(t *testing.T) {
	fx := newFuzzFixture(t)
	val := []byte("0123456789")
	put := ioctl.KeyArg{Source: ioctl.SrcVM, Addr: addr(val), Len: uint64(len(val)), MetaLen: 7}
	copy(put.Meta[:], "f32 2,5")
	if e := keyCall(t, fx, true, "t", &put); e != 0 || put.Result != 10 || put.Version == 0 {
		t.Fatalf("put: %v %+v", e, put)
	}
	look := ioctl.KeyArg{Source: ioctl.SrcVM}
	if e := keyCall(t, fx, false, "t", &look); e != 0 || look.ObjSize != 10 || look.Result != 0 ||
		string(look.Meta[:look.MetaLen]) != "f32 2,5" || look.Version != put.Version {
		t.Fatalf("lookup: %v size %d meta %q", e, look.ObjSize, look.Meta[:look.MetaLen])
	}
	dst := make([]byte, 10)
	get := ioctl.KeyArg{Source: ioctl.SrcVM, Addr: addr(dst), Len: 10, MetaLen: 7}
	copy(get.Meta[:], "f16 2,5")
	if e := keyCall(t, fx, false, "t", &get); e != syscall.EBADMSG || dst[0] != 0 {
		t.Fatalf("get with another meta: %v, %q", e, dst)
	}
	copy(get.Meta[:], "f32 2,5")
	if e := keyCall(t, fx, false, "t", &get); e != 0 || !bytes.Equal(dst, val) {
		t.Fatalf("get: %v %q", e, dst)
	}
	plain := ioctl.KeyArg{Source: ioctl.SrcVM, Addr: addr(val), Len: 4}
	if e := keyCall(t, fx, true, "t", &plain); e != 0 {
		t.Fatal(e)
	}
	look = ioctl.KeyArg{Source: ioctl.SrcVM}
	if e := keyCall(t, fx, false, "t", &look); e != 0 || look.MetaLen != 0 || look.ObjSize != 4 {
		t.Fatalf("after a put without meta: %v meta %d B, size %d", e, look.MetaLen, look.ObjSize)
	}
	// An update keeps the meta, unless it brings one; a whole put
	// through any other command drops it.
	withMeta := ioctl.KeyArg{Source: ioctl.SrcVM, Addr: addr(val), Len: 4, MetaLen: 2}
	copy(withMeta.Meta[:], "m1")
	upd := ioctl.KeyArg{Header: ioctl.Header{Flags: ioctl.FlagUpdate}, Source: ioctl.SrcVM, Addr: addr(val), Len: 2, ObjOff: 1}
	if e := errors.Join(errnoErr(keyCall(t, fx, true, "t", &withMeta)), errnoErr(keyCall(t, fx, true, "t", &upd))); e != nil {
		t.Fatal(e)
	}
	look = ioctl.KeyArg{Source: ioctl.SrcVM}
	if e := keyCall(t, fx, false, "t", &look); e != 0 || string(look.Meta[:look.MetaLen]) != "m1" || look.ObjSize != 4 {
		t.Fatalf("after an update: %v meta %q", e, look.Meta[:look.MetaLen])
	}
	if res := runBatch(t, fx, true, []batchEntry{{key: "t", data: []byte("plain")}}); res[0] != 5 {
		t.Fatalf("batch put: %v", res)
	}
	look = ioctl.KeyArg{Source: ioctl.SrcVM}
	if e := keyCall(t, fx, false, "t", &look); e != 0 || look.MetaLen != 0 {
		t.Fatalf("after a plain batch put: %v meta %q", e, look.Meta[:look.MetaLen])
	}
	runtime.KeepAlive(val)
	runtime.KeepAlive(dst)
	for _, c := range []struct {
		name string
		a    ioctl.KeyArg
		want syscall.Errno
	}{
		{"bad source", ioctl.KeyArg{Source: 9}, syscall.EINVAL},
		{"meta too long", ioctl.KeyArg{MetaLen: ioctl.MaxMeta + 1}, syscall.EINVAL},
		{"get flags", ioctl.KeyArg{Header: ioctl.Header{Flags: ioctl.FlagExcl}}, syscall.EINVAL},
		{"missing", ioctl.KeyArg{Source: ioctl.SrcVM}, syscall.ENOENT},
		{"unknown registration, no bytes", ioctl.KeyArg{Source: ioctl.SrcBuf, ID: 77}, syscall.EINVAL},
	} {
		key := "t"
		if c.name == "missing" {
			key = "nope"
		}
		a := c.a
		if e := keyCall(t, fx, false, key, &a); e != c.want {
			t.Errorf("%s: %v, want %v", c.name, e, c.want)
		}
	}
}

func errnoErr(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

// TestVBatchModel puts keys gathered from random splits of caller memory
// and a registered memfd, gets them scattered into other random splits,
// and checks every byte against the model; entries with a bad segment
// fail alone and leave nothing.
func TestVBatchModel(t *testing.T) {
	fx := newFuzzFixture(t)
	rng := rand.New(rand.NewPCG(7, 11))
	// Two memfds registered on the directory handle, 1 and 2: a call's
	// segments switch between them (each looked up and held once per
	// call while its keys keep to it).
	reg := newMemfdReg(t, fx, 1<<20)
	id2, reg2 := memfdOn(t, fx, fx.dh, 1<<20)
	vm := make([]byte, 1<<20)
	for i := range vm {
		vm[i] = byte(rng.Uint32())
	}
	for i := range reg {
		reg[i], reg2[i] = byte(rng.Uint32()), byte(rng.Uint32())
	}
	split := func(total int) []int {
		var parts []int
		for total > 0 {
			n := min(total, 1+rng.IntN(5000))
			parts = append(parts, n)
			total -= n
		}
		return parts
	}
	model := map[string][]byte{}
	for round := range 4 {
		var a ioctl.VBatchArg
		p := vbatchPackerFor(&a)
		var keys []string
		bad := map[int]syscall.Errno{}
		for k := range 12 {
			key := fmt.Sprintf("r%d-k%d", round, k)
			total := rng.IntN(20000)
			var segs []ioctl.Seg
			var want []byte
			for _, n := range split(total) {
				switch rng.IntN(3) {
				case 0:
					off := rng.IntN(len(vm) - n)
					segs = append(segs, ioctl.Seg{ID: ioctl.SegVM, Off: addr(vm) + uint64(off), Len: uint64(n)})
					want = append(want, vm[off:off+n]...)
				case 1:
					off := rng.IntN(len(reg) - n)
					segs = append(segs, ioctl.Seg{ID: 1, Off: uint64(off), Len: uint64(n)})
					want = append(want, reg[off:off+n]...)
				default:
					off := rng.IntN(len(reg2) - n)
					segs = append(segs, ioctl.Seg{ID: id2, Off: uint64(off), Len: uint64(n)})
					want = append(want, reg2[off:off+n]...)
				}
			}
			if len(segs) == 0 {
				segs = []ioctl.Seg{{ID: ioctl.SegVM, Off: addr(vm), Len: 0}}
			}
			switch k {
			case 3:
				segs = append(segs, ioctl.Seg{ID: 99, Len: 1}) // no such registration
				bad[k] = syscall.EINVAL
			case 6:
				segs = append(segs, ioctl.Seg{ID: ioctl.SegGPU | 0, Len: 1}) // no GPU table
				bad[k] = syscall.EINVAL
			case 9:
				segs = append(segs, ioctl.Seg{ID: 1, Off: 1 << 20, Len: 1}) // past the registration
				bad[k] = syscall.EFAULT
			default:
				model[key] = want
			}
			if !p(key, segs) {
				t.Fatal("batch full")
			}
			keys = append(keys, key)
		}
		res := vbatchCall(t, fx, true, &a)
		for k, key := range keys {
			if e, isBad := bad[k]; isBad {
				if res[k] != -int64(e) {
					t.Fatalf("%s: %d, want -%v", key, res[k], e)
				}
				if _, err := fx.st.Stat(context.Background(), key); err == nil {
					t.Fatalf("%s failed but exists", key)
				}
				continue
			}
			if res[k] != int64(len(model[key])) {
				t.Fatalf("%s: put %d, want %d", key, res[k], len(model[key]))
			}
		}
	}
	runtime.KeepAlive(vm)
	// The calls held their registrations only while they ran.
	for _, id := range []uint64{1, id2} {
		if r, err := fx.dh.regs.get(id); err != nil {
			t.Fatal(err)
		} else if r.inflight.Done(); !waitsNone(&r.inflight) {
			t.Fatalf("registration %d still held after the calls", id)
		}
	}
	// Read every key back, scattered into random splits of a fresh
	// buffer, from a random offset.
	dst := make([]byte, 1<<20)
	for key, want := range model {
		var a ioctl.VBatchArg
		p := vbatchPackerFor(&a)
		off := 0
		if len(want) > 0 {
			off = rng.IntN(len(want))
		}
		var segs []ioctl.Seg
		at := 0
		for _, n := range split(len(want) - off + 100) {
			segs = append(segs, ioctl.Seg{ID: ioctl.SegVM, Off: addr(dst) + uint64(at), Len: uint64(n)})
			at += n
		}
		if len(segs) == 0 {
			segs = []ioctl.Seg{{ID: ioctl.SegVM, Off: addr(dst), Len: 0}}
		}
		clear(dst)
		if !p(key, segs) {
			t.Fatal("batch full")
		}
		a.Entries[0].ObjOff = uint64(off)
		res := vbatchCall(t, fx, false, &a)
		if res[0] != int64(len(want)-off) || !bytes.Equal(dst[:len(want)-off], want[off:]) {
			t.Fatalf("%s from %d: %d B, want %d, equal %v", key, off, res[0], len(want)-off, bytes.Equal(dst[:len(want)-off], want[off:]))
		}
		if got := readKey(t, fx, key); !bytes.Equal(got, want) {
			t.Fatalf("%s stored differs", key)
		}
	}
	runtime.KeepAlive(dst)
}

// vbatchPackerFor returns a function adding one key to a, as the client
// packs it.
func vbatchPackerFor(a *ioctl.VBatchArg) func(key string, segs []ioctl.Seg) bool {
	used := 0
	return func(key string, segs []ioctl.Seg) bool {
		i := int(a.Count)
		off := (used + 7) &^ 7
		for k, s := range segs {
			o := a.Area[off+k*ioctl.SizeSeg:]
			*(*[3]uint64)(unsafe.Pointer(&o[0])) = [3]uint64{s.ID, s.Off, s.Len}
		}
		koff := off + len(segs)*ioctl.SizeSeg
		if koff+len(key) > len(a.Area) || i == ioctl.MaxBatch {
			return false
		}
		copy(a.Area[koff:], key)
		a.Entries[i] = ioctl.VBatchEntry{SegOff: uint32(off), NSeg: uint32(len(segs)), KeyOff: uint16(koff), KeyLen: uint16(len(key))}
		used = koff + len(key)
		a.Count++
		return true
	}
}

func vbatchCall(t *testing.T, fx *fuzzFixture, put bool, a *ioctl.VBatchArg) []int64 {
	t.Helper()
	cmd := ioctl.CmdBatchGetV
	if put {
		cmd = ioctl.CmdBatchPutV
	}
	out := make([]byte, ioctl.SizeVBatchArg)
	if _, errno := fx.root.Ioctl(callerCtx(os.Getpid()), fx.dh, cmd, 0, a.Marshal(), out); errno != 0 {
		t.Fatalf("vbatch: %v", errno)
	}
	if err := a.Unmarshal(out); err != nil {
		t.Fatal(err)
	}
	res := make([]int64, a.Count)
	for i := range res {
		res[i] = a.Entries[i].Result
	}
	return res
}

// newMemfdReg registers an n-byte memfd on the fixture's directory handle
// (the first registration: id 1) and returns its memory.
func newMemfdReg(t *testing.T, fx *fuzzFixture, n int) []byte {
	t.Helper()
	id, mem := memfdOn(t, fx, fx.dh, n)
	if id != 1 {
		t.Fatalf("registration %d, want the first", id)
	}
	t.Cleanup(func() { fx.dh.regs.closeAll() })
	return mem
}

// TestRegisterByAddress: memory registered by address moves like any
// registration for its own process, fails with EPERM for another, and
// with EFAULT once unmapped; the daemon maps none of it.
func TestRegisterByAddress(t *testing.T) {
	fx := newFuzzFixture(t)
	const n = 1 << 16
	mem, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	me := callerCtx(os.Getpid())
	reg := func(a ioctl.RegisterArg) (uint64, syscall.Errno) {
		out := make([]byte, ioctl.SizeRegisterArg)
		_, e := fx.root.Ioctl(me, fx.dh, ioctl.CmdRegisterBuffer, 0, a.Marshal(), out)
		_ = a.Unmarshal(out)
		return a.ID, e
	}
	for _, bad := range []ioctl.RegisterArg{
		{Fd: 3, Kind: ioctl.KindVM, Offset: addr(mem), Len: n},
		{Fd: -1, Kind: ioctl.KindVM, Offset: addr(mem), Len: 0},
		{Fd: -1, Kind: ioctl.KindVM, Offset: 0, Len: n},
		{Fd: -1, Kind: ioctl.KindVM, Offset: ^uint64(0) - 10, Len: n},
	} {
		if _, e := reg(bad); e != syscall.EINVAL {
			t.Errorf("register %+v: %v", bad, e)
		}
	}
	bytesBefore := fx.root.fs.regs.bytes.count()
	id, e := reg(ioctl.RegisterArg{Fd: -1, Kind: ioctl.KindVM, Offset: addr(mem), Len: n})
	if e != 0 {
		t.Fatal(e)
	}
	if b := fx.root.fs.regs.bytes.count(); b != bytesBefore {
		t.Errorf("mapped bytes %d -> %d for an address registration", bytesBefore, b)
	}
	put := ioctl.KeyArg{Source: ioctl.SrcBuf, ID: id, Addr: 100, Len: 1000}
	if e := keyCall(t, fx, true, "v", &put); e != 0 || put.Result != 1000 {
		t.Fatalf("put: %v %+v", e, put)
	}
	if got := readKey(t, fx, "v"); !bytes.Equal(got, mem[100:1100]) {
		t.Fatal("stored bytes differ")
	}
	get := ioctl.KeyArg{Source: ioctl.SrcBuf, ID: id, Addr: 5000, Len: 2000}
	if e := keyCall(t, fx, false, "v", &get); e != 0 || get.Result != 1000 || !bytes.Equal(mem[5000:6000], mem[100:1100]) {
		t.Fatalf("get: %v %+v", e, get)
	}
	past := ioctl.KeyArg{Source: ioctl.SrcBuf, ID: id, Addr: n - 10, Len: 11}
	if e := keyCall(t, fx, true, "w", &past); e != syscall.EFAULT {
		t.Fatalf("past the range: %v", e)
	}
	// Another process may not use it, even holding the file.
	other := exec.Command("sleep", "30")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { other.Process.Kill(); other.Wait() }()
	a := ioctl.KeyArg{Source: ioctl.SrcBuf, ID: id, Len: 10}
	a.KeyLen = uint16(copy(a.Key[:], "v"))
	out := make([]byte, ioctl.SizeKeyArg)
	if _, e := fx.root.Ioctl(callerCtx(other.Process.Pid), fx.dh, ioctl.CmdGetKey, 0, a.Marshal(), out); e != syscall.EPERM {
		t.Fatalf("another process: %v", e)
	}
	// A batch checks the caller once and holds the answer for its keys:
	// every key of the other process's batch is refused, every key of
	// this one's moves.
	batch := func(pid int) []int64 {
		ba := ioctl.BatchArg{Source: ioctl.BatchBuf, ID: id}
		for i := range 3 {
			if _, err := ba.AddKey(fmt.Sprintf("b%d", i), ioctl.BatchEntry{Addr: uint64(i) * 100, Len: 100}); err != nil {
				t.Fatal(err)
			}
		}
		out := make([]byte, ioctl.Size(ioctl.CmdBatchPut))
		if _, e := fx.root.Ioctl(callerCtx(pid), fx.dh, ioctl.CmdBatchPut, 0, ba.Marshal(), out); e != 0 {
			t.Fatalf("batch of %d: %v", pid, e)
		}
		if err := ba.Unmarshal(out); err != nil {
			t.Fatal(err)
		}
		return []int64{ba.Entries[0].Result, ba.Entries[1].Result, ba.Entries[2].Result}
	}
	eperm := -int64(syscall.EPERM)
	if got := batch(other.Process.Pid); !slices.Equal(got, []int64{eperm, eperm, eperm}) {
		t.Fatalf("another process's batch: %v", got)
	}
	if got := batch(os.Getpid()); !slices.Equal(got, []int64{100, 100, 100}) {
		t.Fatalf("own batch: %v", got)
	}
	if got := readKey(t, fx, "b2"); !bytes.Equal(got, mem[200:300]) {
		t.Fatal("batch stored other bytes")
	}
	if err := unix.Munmap(mem); err != nil {
		t.Fatal(err)
	}
	get = ioctl.KeyArg{Source: ioctl.SrcBuf, ID: id, Len: 100}
	if e := keyCall(t, fx, false, "v", &get); e != syscall.EFAULT {
		t.Fatalf("unmapped: %v", e)
	}
	before, _ := fx.st.Stat(context.Background(), "v")
	put = ioctl.KeyArg{Source: ioctl.SrcBuf, ID: id, Len: 100}
	if e := keyCall(t, fx, true, "v", &put); e != syscall.EFAULT {
		t.Fatalf("put from unmapped: %v", e)
	}
	if after, _ := fx.st.Stat(context.Background(), "v"); after.Version != before.Version {
		t.Fatal("a failed put changed the key")
	}
}

// TestGetWhole: a get with FlagWhole moves a value that fits its buffers
// (from its offset on) and fails one that does not with EOVERFLOW, moving
// nothing; other get flags stay refused.
func TestGetWhole(t *testing.T) {
	fx := newFuzzFixture(t)
	val := []byte("0123456789")
	put := ioctl.KeyArg{Source: ioctl.SrcVM, Addr: addr(val), Len: uint64(len(val))}
	if e := keyCall(t, fx, true, "w", &put); e != 0 {
		t.Fatal(e)
	}
	dst := make([]byte, 12)
	for _, c := range []struct {
		room, off uint64
		want      syscall.Errno
	}{{12, 0, 0}, {10, 0, 0}, {9, 0, syscall.EOVERFLOW}, {7, 3, 0}, {6, 3, syscall.EOVERFLOW}, {0, 10, 0}} {
		clear(dst)
		get := ioctl.KeyArg{Header: ioctl.Header{Flags: ioctl.FlagWhole}, Source: ioctl.SrcVM, Addr: addr(dst), Len: c.room, ObjOff: c.off}
		e := keyCall(t, fx, false, "w", &get)
		switch {
		case e != c.want:
			t.Errorf("%d B from %d: %v, want %v", c.room, c.off, e, c.want)
		case e != 0 && !bytes.Equal(dst, make([]byte, 12)):
			t.Errorf("%d B from %d: failed but moved %q", c.room, c.off, dst)
		case e == 0 && (get.Result != 10-c.off || !bytes.Equal(dst[:get.Result], val[c.off:])):
			t.Errorf("%d B from %d: %d B %q", c.room, c.off, get.Result, dst[:get.Result])
		}
	}
	// Another meta says so first, whatever the room.
	withMeta := ioctl.KeyArg{Source: ioctl.SrcVM, Addr: addr(val), Len: uint64(len(val)), MetaLen: 3}
	copy(withMeta.Meta[:], "f32")
	if e := keyCall(t, fx, true, "m", &withMeta); e != 0 {
		t.Fatal(e)
	}
	small := ioctl.KeyArg{Header: ioctl.Header{Flags: ioctl.FlagWhole}, Source: ioctl.SrcVM, Addr: addr(dst), Len: 4, MetaLen: 3}
	copy(small.Meta[:], "f16")
	if e := keyCall(t, fx, false, "m", &small); e != syscall.EBADMSG {
		t.Errorf("a get of another meta into too little room: %v, want EBADMSG", e)
	}
	other := ioctl.KeyArg{Header: ioctl.Header{Flags: ioctl.FlagWhole << 1}, Source: ioctl.SrcVM, Addr: addr(dst), Len: 12}
	if e := keyCall(t, fx, false, "w", &other); e != syscall.EINVAL {
		t.Errorf("a get with flag %#x: %v, want EINVAL", ioctl.FlagWhole<<1, e)
	}
}

// BenchmarkKeyCall measures one PUT_KEY (replacing a resident key) and
// one GET_KEY of 4 KiB from the caller's memory, with no kernel in the
// way: a one-key call's fixed cost in the daemon.
func BenchmarkKeyCall(b *testing.B) {
	data := bytes.Repeat([]byte{7}, 4096)
	for _, mode := range []string{"put", "put-new", "get"} {
		put, fresh := mode != "get", mode == "put-new"
		b.Run(mode, func(b *testing.B) {
			fx := newFixtureOf(b, 64<<20)
			var a ioctl.KeyArg
			for i := range 1024 {
				a = ioctl.KeyArg{Source: ioctl.SrcVM, Addr: addr(data), Len: 4096}
				if e := keyCall(b, fx, true, fmt.Sprintf("k%d", i), &a); e != 0 {
					b.Fatal(e)
				}
			}
			b.ReportAllocs()
			defer reportKeyWork(b, fx.root.fs)()
			for i := 0; b.Loop(); i++ {
				key := fmt.Sprintf("k%d", i%1024)
				if fresh {
					// New keys, as the bench's op-put writes them; the
					// store holds 2048 at most.
					key = fmt.Sprintf("n%d", i%1024)
					if i%1024 == 0 && i > 0 {
						b.StopTimer()
						for j := range 1024 {
							if err := fx.st.Delete(context.Background(), fmt.Sprintf("n%d", j), 0); err != nil {
								b.Fatal(err)
							}
						}
						b.StartTimer()
					}
				}
				a = ioctl.KeyArg{Source: ioctl.SrcVM, Addr: addr(data), Len: 4096}
				if e := keyCall(b, fx, put, key, &a); e != 0 {
					b.Fatal(e)
				}
			}
		})
	}
}

// BenchmarkVBatchPutMeta measures one BATCH_PUT_V of 64 new 4 KiB keys
// from the caller's memory, as batch_put_tensor sends CPU tensors: with a
// meta per key (its dtype and shape, kept as an xattr) and without, so
// the meta's share of the daemon's work per key shows. Keys are removed
// every 16 calls, outside the timer, so the index does not grow.
func BenchmarkVBatchPutMeta(b *testing.B) {
	data := bytes.Repeat([]byte{7}, 4096)
	meta := []byte("float16;8,16,16")
	for _, withMeta := range []bool{false, true} {
		b.Run(map[bool]string{false: "plain", true: "meta"}[withMeta], func(b *testing.B) {
			fx := newFixtureOf(b, 64*16*4096+(8<<20))
			ctx := callerCtx(os.Getpid())
			out := make([]byte, ioctl.SizeVBatchArg)
			b.ReportAllocs()
			defer reportKeyWork(b, fx.root.fs)()
			for i := 0; b.Loop(); i++ {
				var a ioctl.VBatchArg
				pack := vbatchPackerFor(&a)
				for k := range 64 {
					if !pack(fmt.Sprintf("n%d", i*64+k), []ioctl.Seg{{ID: ioctl.SegVM, Off: uint64(addr(data)), Len: 4096}}) {
						b.Fatal("area full")
					}
				}
				if withMeta {
					used := int(a.Entries[63].KeyOff) + int(a.Entries[63].KeyLen)
					for k := range 64 {
						at := used + k*len(meta)
						copy(a.Area[at:], meta)
						a.Entries[k].MetaOff, a.Entries[k].MetaLen = uint32(at), uint32(len(meta))
					}
				}
				if _, errno := fx.root.Ioctl(ctx, fx.dh, ioctl.CmdBatchPutV, 0, a.Marshal(), out); errno != 0 {
					b.Fatal(errno)
				}
				if err := a.Unmarshal(out); err != nil {
					b.Fatal(err)
				}
				for k := range 64 {
					if a.Entries[k].Result != 4096 {
						b.Fatalf("key %d: %d", k, a.Entries[k].Result)
					}
				}
				if i%16 == 15 {
					b.StopTimer()
					for j := (i - 15) * 64; j < (i+1)*64; j++ {
						if err := fx.st.Delete(context.Background(), fmt.Sprintf("n%d", j), 0); err != nil {
							b.Fatal(err)
						}
					}
					b.StartTimer()
				}
			}
			runtime.KeepAlive(data)
		})
	}
}

// TestVBatchMetasShared: keys of one call with the same meta, another meta
// and none each keep their own (the call shares one SetXattrs map per
// meta, the objects share nothing): changing one key's meta afterwards
// leaves the others as they were.
func TestVBatchMetasShared(t *testing.T) {
	fx := newFuzzFixture(t)
	val := []byte("value")
	metas := []string{"f16 2,2", "f32 4", "f16 2,2", "", "f16 2,2"}
	var a ioctl.VBatchArg
	pack := vbatchPackerFor(&a)
	for i := range metas {
		if !pack(fmt.Sprintf("m%d", i), []ioctl.Seg{{ID: ioctl.SegVM, Off: uint64(addr(val)), Len: uint64(len(val))}}) {
			t.Fatal("area full")
		}
	}
	used := int(a.Entries[len(metas)-1].KeyOff) + int(a.Entries[len(metas)-1].KeyLen)
	for i, m := range metas {
		copy(a.Area[used:], m)
		a.Entries[i].MetaOff, a.Entries[i].MetaLen = uint32(used), uint32(len(m))
		used += len(m)
	}
	for i, r := range vbatchCall(t, fx, true, &a) {
		if r != int64(len(val)) {
			t.Fatalf("m%d: %d", i, r)
		}
	}
	// One name twice in a call, with a meta each: the later entry's value
	// and meta win.
	var dup ioctl.VBatchArg
	pack = vbatchPackerFor(&dup)
	for range 2 {
		pack("d", []ioctl.Seg{{ID: ioctl.SegVM, Off: uint64(addr(val)), Len: uint64(len(val))}})
	}
	at := int(dup.Entries[1].KeyOff) + int(dup.Entries[1].KeyLen)
	for i, m := range []string{"f16 2,2", "f32 4"} {
		copy(dup.Area[at:], m)
		dup.Entries[i].MetaOff, dup.Entries[i].MetaLen = uint32(at), uint32(len(m))
		at += len(m)
	}
	for i, r := range vbatchCall(t, fx, true, &dup) {
		if r != int64(len(val)) {
			t.Fatalf("d, entry %d: %d", i, r)
		}
	}
	runtime.KeepAlive(val)
	if o, err := fx.st.Stat(context.Background(), "d"); err != nil {
		t.Fatal(err)
	} else if string(o.Xattrs[xattrMeta]) != "f32 4" {
		t.Fatalf("d: meta %q, want the later entry's", o.Xattrs[xattrMeta])
	}
	check := func(want []string) {
		t.Helper()
		for i, m := range want {
			o, err := fx.st.Stat(context.Background(), fmt.Sprintf("m%d", i))
			if err != nil {
				t.Fatal(err)
			}
			if got, ok := o.Xattrs[xattrMeta]; string(got) != m || ok != (m != "") {
				t.Errorf("m%d: meta %q (set %v), want %q", i, got, ok, m)
			}
		}
	}
	check(metas)
	if _, err := fx.st.Update(context.Background(), "m0", 0, func(o *store.Object) error {
		o.Xattrs[xattrMeta] = []byte("i8 1")
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	check([]string{"i8 1", "f32 4", "f16 2,2", "", "f16 2,2"})
}

// waitsNone reports whether wg has nothing outstanding: its Wait returns
// (within a minute, far beyond any call's end; false means it never will).
func waitsNone(wg *sync.WaitGroup) bool {
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		return true
	case <-time.After(time.Minute):
		return false
	}
}

// inlineCall runs PUT_KEY_INLINE (data the value) or GET_KEY_INLINE on key
// in fx's root, with a reply buffer full of stale bytes, as the server's
// reused buffers can be; it returns the reply's data area.
func inlineCall(t *testing.T, fx *fuzzFixture, put bool, key string, a *ioctl.KeyArg, data []byte) ([]byte, syscall.Errno) {
	t.Helper()
	a.KeyLen = uint16(copy(a.Key[:], key))
	cmd := ioctl.CmdGetKeyInline
	if put {
		cmd = ioctl.CmdPutKeyInline
	}
	in := make([]byte, ioctl.SizeKeyInlineArg)
	a.MarshalInlineInto(in)
	copy(in[ioctl.SizeKeyArg:], data)
	out := bytes.Repeat([]byte{0xa5}, ioctl.SizeKeyInlineArg)
	_, errno := fx.root.Ioctl(callerCtx(os.Getpid()), fx.dh, cmd, 0, in, out)
	if errno != 0 {
		return nil, errno
	}
	area, err := a.UnmarshalInline(out)
	if err != nil {
		t.Fatal(err)
	}
	return area, 0
}

// TestKeyInline: a value of up to InlineBytes goes and comes back in the
// call (ABI 1.9), bit-exact with what the other paths see, meta and
// offsets as PUT_KEY's and GET_KEY's; a reply's data area holds the
// value's bytes and zeros, never what the buffer held before; a call
// whose source, length or addresses do not fit fails with EINVAL and
// changes nothing, as does SrcInline in a plain KEY call.
func TestKeyInline(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := context.Background()
	val := make([]byte, ioctl.InlineBytes)
	for i := range val {
		val[i] = byte(i*7 + 1)
	}
	for _, n := range []int{0, 1, 100, ioctl.InlineBytes} {
		key := fmt.Sprintf("in%d", n)
		put := ioctl.KeyArg{Source: ioctl.SrcInline, Len: uint64(n), MetaLen: 3}
		copy(put.Meta[:], "u8 ")
		area, e := inlineCall(t, fx, true, key, &put, val[:n])
		if e != 0 || put.Result != uint64(n) || put.Version == 0 {
			t.Fatalf("put %d B: %v %+v", n, e, put)
		}
		if !bytes.Equal(area, make([]byte, ioctl.InlineBytes)) {
			t.Fatalf("put %d B: the reply's data area is not zeroed", n)
		}
		// Back inline, whole and from an offset.
		for _, off := range []int{0, n / 2} {
			get := ioctl.KeyArg{Source: ioctl.SrcInline, Len: ioctl.InlineBytes, ObjOff: uint64(off)}
			area, e := inlineCall(t, fx, false, key, &get, nil)
			want := append(append([]byte(nil), val[off:n]...), make([]byte, ioctl.InlineBytes-(n-off))...)
			if e != 0 || get.Result != uint64(n-off) || get.ObjSize != uint64(n) || get.Version != put.Version ||
				string(get.Meta[:get.MetaLen]) != "u8 " || !bytes.Equal(area, want) {
				t.Fatalf("get %d B from %d: %v %+v (data ok: %v)", n, off, e, get, bytes.Equal(area, want))
			}
		}
		// And by address: the same bytes.
		back := make([]byte, n+1)
		get := ioctl.KeyArg{Source: ioctl.SrcVM, Addr: addr(back), Len: uint64(len(back))}
		if e := keyCall(t, fx, false, key, &get); e != 0 || get.Result != uint64(n) || !bytes.Equal(back[:n], val[:n]) {
			t.Fatalf("get by address of %d B: %v %+v", n, e, get)
		}
	}
	// A get shorter than the value fills what it asks for.
	get := ioctl.KeyArg{Source: ioctl.SrcInline, Len: 10}
	if area, e := inlineCall(t, fx, false, "in100", &get, nil); e != 0 || get.Result != 10 ||
		!bytes.Equal(area[:10], val[:10]) || !bytes.Equal(area[10:], make([]byte, ioctl.InlineBytes-10)) {
		t.Fatalf("short get: %v %+v", e, get)
	}
	// Refusals change nothing.
	before, err := fx.st.Stat(ctx, "in100")
	if err != nil {
		t.Fatal(err)
	}
	for name, a := range map[string]ioctl.KeyArg{
		"too long":   {Source: ioctl.SrcInline, Len: ioctl.InlineBytes + 1},
		"source vm":  {Source: ioctl.SrcVM, Len: 8},
		"an address": {Source: ioctl.SrcInline, Addr: 4096, Len: 8},
		"an id":      {Source: ioctl.SrcInline, ID: 1, Len: 8},
	} {
		for _, key := range []string{"in100", "fresh"} {
			a := a
			if _, e := inlineCall(t, fx, true, key, &a, val[:8]); e != syscall.EINVAL {
				t.Errorf("%s, put %s: %v, want EINVAL", name, key, e)
			}
		}
	}
	plain := ioctl.KeyArg{Source: ioctl.SrcInline, Len: 8}
	if e := keyCall(t, fx, true, "in100", &plain); e != syscall.EINVAL {
		t.Errorf("SrcInline in PUT_KEY: %v, want EINVAL", e)
	}
	after, err := fx.st.Stat(ctx, "in100")
	if err != nil || after.Version != before.Version {
		t.Fatalf("a refused call changed in100: %v, version %d -> %d", err, before.Version, after.Version)
	}
	if _, err := fx.st.Stat(ctx, "fresh"); err == nil {
		t.Fatal("a refused call made fresh")
	}
	// A missing parent: ENOENT, nothing made.
	a := ioctl.KeyArg{Source: ioctl.SrcInline, Len: 8}
	if _, e := inlineCall(t, fx, true, "no/such", &a, val[:8]); e != syscall.ENOENT {
		t.Fatalf("put under a missing directory: %v, want ENOENT", e)
	}
}

// TestBatchStatsFaults: the batch figures count the process's minor page
// faults: first touches of fresh memory, in small pages, show in them.
func TestBatchStatsFaults(t *testing.T) {
	fx := newFuzzFixture(t)
	m := &Mount{fs: fx.root.fs}
	const pages = 2048
	size := pages * os.Getpagesize()
	mem, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	if err := unix.Madvise(mem, unix.MADV_NOHUGEPAGE); err != nil {
		t.Fatal(err)
	}
	before := m.Batches().MinorFaults
	for i := 0; i < size; i += os.Getpagesize() {
		mem[i] = 1
	}
	if got := m.Batches().MinorFaults - before; got < pages/16 {
		t.Fatalf("%d minor faults counted for %d fresh pages", got, pages)
	}
}

// TestBatchStatsCommit: the batch figures' commit time grows with put
// calls, one chunk or several, and is part of their work (handler less
// transfers); get calls commit nothing.
func TestBatchStatsCommit(t *testing.T) {
	for _, chunked := range []bool{false, true} {
		t.Run(fmt.Sprint("chunked=", chunked), func(t *testing.T) {
			if chunked {
				chunkAlways, chunkKeys = true, 8
				t.Cleanup(func() { chunkAlways, chunkKeys = false, gpuChunkKeys })
			}
			// Copies of the caller's memory run in the engine's start,
			// so the waits this leaves out are GPU ones: gpucheck's
			// check 10 sees those.
			fx := newFuzzFixture(t)
			m := &Mount{fs: fx.root.fs}
			val := bytes.Repeat([]byte{3}, 4096)
			entries := make([]batchEntry, 40)
			for i := range entries {
				entries[i] = batchEntry{key: fmt.Sprintf("c%d", i), data: val}
			}
			before := m.Batches()
			runBatch(t, fx, true, entries)
			after := m.Batches()
			commit, work := after.CommitNs-before.CommitNs, (after.HandlerNs-before.HandlerNs)-(after.TransferNs-before.TransferNs)
			if commit == 0 || commit > work {
				t.Fatalf("put of %d keys: %d ns committing, of %d ns of work", len(entries), commit, work)
			}
			for i := range entries {
				entries[i].data = make([]byte, len(val))
			}
			before = m.Batches()
			runBatch(t, fx, false, entries)
			if got := m.Batches().CommitNs - before.CommitNs; got != 0 {
				t.Fatalf("a get call added %d ns of commits", got)
			}
			for _, e := range entries {
				if !bytes.Equal(e.data, val) {
					t.Fatalf("%s read back wrong", e.key)
				}
			}
		})
	}
}
