package fs

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// viaTable makes runBatchAs send its batches as table calls.
var viaTable bool

// tableCall is a table call's memory in this process, as a client lays
// it out: the entry table and the keys.
type tableCall struct {
	arg  ioctl.TableArg
	tab  []byte
	keys []byte
}

func newTableCall(source uint32, entries []batchEntry) *tableCall {
	c := &tableCall{arg: ioctl.TableArg{Count: uint32(len(entries)), Source: source}}
	es := make([]ioctl.BatchEntry, len(entries))
	for i, e := range entries {
		es[i] = ioctl.BatchEntry{KeyOff: uint16(len(c.keys)), KeyLen: uint16(len(e.key)), Flags: e.flags, ObjOff: e.off,
			Len: uint64(len(e.data)), Result: -12345, Version: 777}
		if len(e.data) > 0 {
			es[i].Addr = uint64(uintptr(unsafe.Pointer(&e.data[0])))
		}
		c.keys = append(c.keys, e.key...)
	}
	c.tab = make([]byte, ioctl.TableBytes(len(es)))
	ioctl.EncodeEntries(c.tab, es)
	c.keys = append(c.keys, 0) // never empty: its address is taken
	c.arg.Entries = uint64(uintptr(unsafe.Pointer(&c.tab[0])))
	c.arg.Keys = uint64(uintptr(unsafe.Pointer(&c.keys[0])))
	c.arg.KeysLen = uint32(len(c.keys) - 1)
	return c
}

// run sends c on the fixture's directory handle and returns the errno and
// the entries as the table holds them after.
func (c *tableCall) run(fx *fuzzFixture, ctx context.Context, put bool) (syscall.Errno, []ioctl.BatchEntry) {
	cmd := ioctl.CmdBatchGetTable
	if put {
		cmd = ioctl.CmdBatchPutTable
	}
	out := make([]byte, ioctl.SizeTableArg)
	_, errno := fx.root.Ioctl(ctx, fx.dh, cmd, 0, c.arg.Marshal(), out)
	es := make([]ioctl.BatchEntry, c.arg.Count)
	if len(c.tab) >= ioctl.TableBytes(len(es)) {
		ioctl.DecodeEntries(es, c.tab)
	}
	runtime.KeepAlive(c)
	return errno, es
}

// runTable is runBatchAs through one table call.
func runTable(t testing.TB, fx *fuzzFixture, ctx context.Context, put bool, entries []batchEntry) []int64 {
	t.Helper()
	c := newTableCall(ioctl.BatchVM, entries)
	errno, es := c.run(fx, ctx, put)
	if errno != 0 {
		t.Fatalf("table call: %v", errno)
	}
	res := make([]int64, len(es))
	for i, e := range es {
		res[i] = e.Result
		if !put && e.Len != uint64(max(e.Result, 0)) {
			t.Fatalf("entry %d: len %d, result %d", i, e.Len, e.Result)
		}
	}
	runtime.KeepAlive(entries)
	return res
}

// TestTableBatches runs the batch tests with every batch sent as a table
// call: the same results and the same store.
func TestTableBatches(t *testing.T) {
	viaTable = true
	t.Cleanup(func() { viaTable = false })
	t.Run("in-order", TestBatchEntriesInOrder)
	t.Run("overwrite", TestBatchOverwriteNeedsNoDoubleSpace)
	t.Run("chunked", TestChunkedBatches)
	t.Run("moves-lru", TestBatchMovesLRU)
	t.Run("implicit-dir", TestBatchPutOverImplicitDirectory)
}

// TestTableCall covers what only a table call has: more keys than a
// BATCH_PUT carries, in one call; the in fields written back as they
// were; every key's result and version; and a get's length.
func TestTableCall(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := callerCtx(os.Getpid())
	const n = ioctl.MaxTable
	entries := make([]batchEntry, n)
	for i := range entries {
		entries[i] = batchEntry{key: fmt.Sprintf("k%04d", i), data: bytes.Repeat([]byte{byte(i)}, 1+i%700)}
	}
	c := newTableCall(ioctl.BatchVM, entries)
	errno, es := c.run(fx, ctx, true)
	if errno != 0 {
		t.Fatal(errno)
	}
	for i, e := range es {
		if e.Result != int64(len(entries[i].data)) || e.Version == 0 || e.Version == 777 {
			t.Fatalf("entry %d: %+v", i, e)
		}
		if e.KeyLen != 5 || e.Len != uint64(len(entries[i].data)) {
			t.Fatalf("entry %d: in fields changed: %+v", i, e)
		}
		o, err := fx.st.Stat(ctx, entries[i].key)
		if err != nil || o.Version != e.Version || !bytes.Equal(readKey(t, fx, entries[i].key), entries[i].data) {
			t.Fatalf("%s: %v, version %d of %+v", entries[i].key, err, e.Version, o)
		}
	}
	// Back into buffers one byte longer, with a missing key among them.
	gets := make([]batchEntry, n)
	for i := range gets {
		gets[i] = batchEntry{key: entries[i].key, data: make([]byte, len(entries[i].data)+1)}
	}
	gets[17].key = "missing"
	c = newTableCall(ioctl.BatchVM, gets)
	errno, es = c.run(fx, ctx, false)
	if errno != 0 {
		t.Fatal(errno)
	}
	for i, e := range es {
		want := int64(len(entries[i].data))
		if i == 17 {
			want = -int64(syscall.ENOENT)
		}
		if e.Result != want || e.Len != uint64(max(want, 0)) {
			t.Fatalf("get %d: %+v, want %d", i, e, want)
		}
		if i != 17 && !bytes.Equal(gets[i].data[:want], entries[i].data) {
			t.Fatalf("get %d: bytes differ", i)
		}
	}
}

// TestTableBadMemory: a table or keys the daemon cannot read, or a table
// it cannot write, fail the call with EFAULT before any key runs; limits
// out of range fail it with EINVAL; a call with no caller, EPERM.
func TestTableBadMemory(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := callerCtx(os.Getpid())
	data := []byte("value")
	entries := []batchEntry{{key: "a", data: data}, {key: "b", data: data}}
	// Two pages: the second unmapped, the first holding one entry at its
	// end, so that a table of two runs into the hole.
	page := os.Getpagesize()
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(2*page), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANONYMOUS|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.MunmapPtr(p, uintptr(page))
	unmapped := unsafe.Slice((*byte)(p), page)
	gone := uint64(uintptr(p)) + uint64(page)
	if err := unix.MunmapPtr(unsafe.Add(p, page), uintptr(page)); err != nil {
		t.Fatal(err)
	}
	ro, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANONYMOUS|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(ro)
	for _, tc := range []struct {
		name  string
		edit  func(c *tableCall)
		errno syscall.Errno
	}{
		{"table unmapped", func(c *tableCall) { c.arg.Entries = gone }, syscall.EFAULT},
		{"keys unmapped", func(c *tableCall) { c.arg.Keys = gone }, syscall.EFAULT},
		{"table runs into a hole", func(c *tableCall) {
			copy(unmapped[page-ioctl.SizeBatchEntry:page], c.tab)
			c.arg.Entries = gone - ioctl.SizeBatchEntry
		}, syscall.EFAULT},
		{"table read-only", func(c *tableCall) {
			copy(ro, c.tab)
			if err := unix.Mprotect(ro, unix.PROT_READ); err != nil {
				t.Fatal(err)
			}
			c.arg.Entries = uint64(uintptr(unsafe.Pointer(&ro[0])))
		}, syscall.EFAULT},
		{"no entries", func(c *tableCall) { c.arg.Count = 0 }, syscall.EINVAL},
		{"too many", func(c *tableCall) { c.arg.Count = ioctl.MaxTable + 1 }, syscall.EINVAL},
		{"keys too long", func(c *tableCall) { c.arg.KeysLen = ioctl.MaxTableKeyBytes + 1 }, syscall.EINVAL},
		{"bad source", func(c *tableCall) { c.arg.Source = 2 }, syscall.EINVAL},
		{"flags", func(c *tableCall) { c.arg.Flags = 1 }, syscall.EINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newTableCall(ioctl.BatchVM, entries)
			tc.edit(c)
			before := append([]byte(nil), c.tab...)
			if errno, _ := c.run(fx, ctx, true); errno != tc.errno {
				t.Fatalf("errno %v, want %v", errno, tc.errno)
			}
			for _, k := range []string{"a", "b"} {
				if _, err := fx.st.Stat(ctx, k); err == nil {
					t.Fatalf("the refused call made %s", k)
				}
			}
			if !bytes.Equal(before, c.tab) {
				t.Fatal("the refused call wrote the table")
			}
		})
	}
	// A key outside the key bytes fails alone.
	c := newTableCall(ioctl.BatchVM, entries)
	c.arg.KeysLen = 1 // "a" only
	errno, es := c.run(fx, ctx, true)
	if errno != 0 || es[0].Result != int64(len(data)) || es[1].Result != -int64(syscall.EINVAL) {
		t.Fatalf("errno %v, entries %+v", errno, es)
	}
	// No caller to read the table from.
	c = newTableCall(ioctl.BatchVM, entries)
	if errno, _ := c.run(fx, context.Background(), false); errno != syscall.EPERM {
		t.Fatalf("without a caller: %v", errno)
	}
	// On a file, not a directory.
	out := make([]byte, ioctl.SizeTableArg)
	if _, errno := fx.file.Ioctl(ctx, fx.fh, ioctl.CmdBatchPutTable, 0, c.arg.Marshal(), out); errno != syscall.ENOTDIR {
		t.Fatalf("on a file: %v", errno)
	}
	runtime.KeepAlive(c)
}

// FuzzTable sends table calls of arbitrary entries and keys, from memory
// of this process: no panic, only the errnos bad input may get, every
// entry's result an allowed errno or a count, written back with its in
// fields as they were. The entries' addresses are folded into a scratch
// buffer (a get writes there).
func FuzzTable(f *testing.F) {
	f.Add(true, []byte("a\x00b"), bytes.Repeat([]byte{1}, 2*ioctl.SizeBatchEntry))
	f.Add(false, []byte("abc/def"), make([]byte, 3*ioctl.SizeBatchEntry))
	fx := newFuzzFixture(f)
	ctx := callerCtx(os.Getpid())
	scratch := make([]byte, 1<<16)
	base := uint64(uintptr(unsafe.Pointer(&scratch[0])))
	f.Fuzz(func(t *testing.T, put bool, keys, raw []byte) {
		n := min(len(raw)/ioctl.SizeBatchEntry, ioctl.MaxTable)
		if n == 0 || len(keys) == 0 || len(keys) > ioctl.MaxTableKeyBytes {
			return
		}
		es := make([]ioctl.BatchEntry, n)
		ioctl.DecodeEntries(es, raw)
		for i := range es {
			e := &es[i]
			e.Addr %= uint64(len(scratch))
			e.Len = min(e.Len, uint64(len(scratch))-e.Addr)
			e.Addr += base
		}
		c := &tableCall{arg: ioctl.TableArg{Count: uint32(n), Source: ioctl.BatchVM, KeysLen: uint32(len(keys))},
			tab: make([]byte, ioctl.TableBytes(n)), keys: bytes.Clone(keys)}
		ioctl.EncodeEntries(c.tab, es)
		c.arg.Entries = uint64(uintptr(unsafe.Pointer(&c.tab[0])))
		c.arg.Keys = uint64(uintptr(unsafe.Pointer(&c.keys[0])))
		errno, after := c.run(fx, ctx, put)
		if errno != 0 {
			t.Fatalf("table of %d entries: %v", n, errno)
		}
		for i, e := range after {
			in := es[i]
			if e.KeyOff != in.KeyOff || e.KeyLen != in.KeyLen || e.Flags != in.Flags || e.Addr != in.Addr || e.ObjOff != in.ObjOff ||
				put && e.Len != in.Len {
				t.Fatalf("entry %d: in fields %+v, were %+v", i, e, in)
			}
			if !allowedErrnos[syscall.Errno(-min(e.Result, 0))] {
				t.Fatalf("entry %d: result %d", i, e.Result)
			}
		}
	})
}

// TestTableCallerNotReadable: a daemon not allowed to read the caller's
// memory (here: a thread without CAP_SYS_PTRACE, the caller another
// user's process) refuses a table call whole with EPERM, before any key:
// what the clients take to fall back to BATCH_PUT and BATCH_GET.
func TestTableCallerNotReadable(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a child of another user, and capabilities to drop")
	}
	fx := newFuzzFixture(t)
	child := exec.Command("sleep", "60")
	child.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { child.Process.Kill(); child.Wait() })
	c := newTableCall(ioctl.BatchVM, []batchEntry{{key: "a", data: []byte("value")}})
	errno := make(chan syscall.Errno, 1)
	go func() {
		// Never unlocked: the thread, without its capability, ends with
		// the goroutine.
		runtime.LockOSThread()
		hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
		var data [2]unix.CapUserData
		if err := unix.Capget(&hdr, &data[0]); err != nil {
			t.Error(err)
			errno <- 0
			return
		}
		data[0].Effective &^= 1 << unix.CAP_SYS_PTRACE
		if err := unix.Capset(&hdr, &data[0]); err != nil { // this thread's only
			t.Error(err)
			errno <- 0
			return
		}
		e, _ := c.run(fx, callerCtx(child.Process.Pid), true)
		errno <- e
	}()
	if e := <-errno; e != syscall.EPERM {
		t.Fatalf("table call of a caller the daemon may not read: %v, want EPERM", e)
	}
	if _, err := fx.st.Stat(context.Background(), "a"); err == nil {
		t.Fatal("the refused call made a")
	}
	runtime.KeepAlive(c)
}

// TestTableLaterEntryWins: a key a table call puts more than once, its
// entries in different windows of lookups (lookupKeys) with some of the
// call's keys committed between them (before a FlagParents key's missing
// directory is made, or at a chunk boundary), ends with the last entry's
// value, which its result reports. Looked up before those commits, an
// earlier entry once failed its commit while the last one went through
// in the same chunk, and the earlier one, put again alone, overwrote it.
func TestTableLaterEntryWins(t *testing.T) {
	viaTable = true
	t.Cleanup(func() { viaTable, chunkAlways, chunkKeys = false, false, gpuChunkKeys })
	for _, tc := range []struct {
		name   string
		n      int
		chunks bool
		e      []int // the entries of key "e"
	}{
		// Entry 1 makes directory d: entry 0 commits first.
		{"parents", lookupKeys + 1, false, []int{0, 2, lookupKeys}},
		// Chunks of 32, shifted by a key that fails its check.
		{"chunks", 140, true, []int{40, 100, 128}},
	} {
		chunkAlways, chunkKeys = tc.chunks, 32
		fx := newFuzzFixture(t)
		var es []batchEntry
		for i := range tc.n {
			e := batchEntry{key: fmt.Sprintf("p%d", i), data: []byte("v")}
			switch {
			case slices.Contains(tc.e, i):
				e = batchEntry{key: "e", data: []byte(fmt.Sprintf("entry%03d", i))}
			case i == 1 && !tc.chunks:
				e = batchEntry{key: "d/k", data: []byte("v"), flags: ioctl.FlagParents}
			case i == 5 && tc.chunks:
				e.key = "../bad"
			}
			es = append(es, e)
		}
		res := runBatch(t, fx, true, es)
		last := tc.e[len(tc.e)-1]
		want := fmt.Sprintf("entry%03d", last)
		if got := string(readKey(t, fx, "e")); res[last] != int64(len(want)) || got != want {
			t.Fatalf("%s: the last entry's result %d, e holds %q, want %q", tc.name, res[last], got, want)
		}
	}
}
