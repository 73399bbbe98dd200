package fs

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/store"
)

// submitV starts a as a submitted call on dh and returns its number.
func submitV(fx *fuzzFixture, dh *dirHandle, put bool, a *ioctl.VBatchArg) (int32, syscall.Errno) {
	cmd := ioctl.CmdBatchGetV
	if put {
		cmd = ioctl.CmdBatchPutV
	}
	a.Flags = ioctl.VBatchAsync
	return fx.root.Ioctl(callerCtx(os.Getpid()), dh, cmd, 0, a.Marshal(), make([]byte, ioctl.SizeVBatchArg))
}

// waitV is BATCH_WAIT of call id on dh; it returns the results of the
// call's count keys.
func waitV(fx *fuzzFixture, dh *dirHandle, id uint32, count int) ([]int64, syscall.Errno) {
	in := make([]byte, ioctl.SizeVBatchArg)
	binary.LittleEndian.PutUint32(in[0:], ioctl.SizeVBatchArg)
	binary.LittleEndian.PutUint32(in[8:], id)
	out := make([]byte, ioctl.SizeVBatchArg)
	if _, errno := fx.root.Ioctl(callerCtx(os.Getpid()), dh, ioctl.CmdBatchWait, 0, in, out); errno != 0 {
		return nil, errno
	}
	var a ioctl.VBatchArg
	if err := a.Unmarshal(out); err != nil {
		panic(err)
	}
	if id != 0 && int(a.Count) != count {
		panic(fmt.Sprintf("call %d came back with %d keys, want %d", id, a.Count, count))
	}
	res := make([]int64, count)
	for i := range res {
		res[i] = a.Entries[i].Result
	}
	return res, 0
}

// vcallOf is a vector batch of one key whose value is s.
func vcallOf(key string, s ioctl.Seg) *ioctl.VBatchArg {
	var a ioctl.VBatchArg
	vbatchPackerFor(&a)(key, []ioctl.Seg{s})
	return &a
}

// memfdOn registers an n-byte memfd on dh and returns its id and memory
// (submitted calls take no process memory; newMemfdReg: the fixture's
// first).
func memfdOn(t testing.TB, fx *fuzzFixture, dh *dirHandle, n int) (uint64, []byte) {
	t.Helper()
	fd, err := unix.MemfdCreate("keyops", 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Ftruncate(fd, int64(n)); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(fd, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	a := ioctl.RegisterArg{Fd: int32(fd), Kind: ioctl.KindHost, Len: uint64(n)}
	out := make([]byte, ioctl.SizeRegisterArg)
	if _, errno := fx.root.Ioctl(callerCtx(os.Getpid()), dh, ioctl.CmdRegisterBuffer, 0, a.Marshal(), out); errno != 0 {
		t.Fatalf("register: %v", errno)
	}
	if err := a.Unmarshal(out); err != nil {
		t.Fatal(err)
	}
	return a.ID, mem
}

// TestAsyncVBatchModel: puts and gets submitted several at a time, some
// of their keys failing, each call waited for in a random order, give
// what the same calls made one after the other give, checked against a
// model of every key.
func TestAsyncVBatchModel(t *testing.T) {
	fx := newFuzzFixture(t)
	rng := rand.New(rand.NewPCG(7, 11))
	model := map[string][]byte{}
	id, mem := memfdOn(t, fx, fx.dh, 512<<10)
	src, dst := mem[:256<<10], mem[256<<10:]
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	for round := range 30 {
		// Up to 6 calls of up to 8 keys, distinct keys across the round
		// (the calls run at once, in no order).
		type call struct {
			id   int32
			keys []string
			want []int64
			at   []int // get: where each key's bytes land in dst
		}
		var calls []call
		put := round%3 != 2
		used := map[string]bool{}
		pos := 0
		for range 1 + rng.IntN(6) {
			var a ioctl.VBatchArg
			p := vbatchPackerFor(&a)
			c := call{}
			for range 1 + rng.IntN(8) {
				key := fmt.Sprintf("k%02d", rng.IntN(40))
				if used[key] {
					continue
				}
				used[key] = true
				n := 1 + rng.IntN(4096)
				seg := ioctl.Seg{ID: id, Off: uint64(len(src) + pos), Len: uint64(n)}
				want := int64(n)
				if put {
					off := rng.IntN(len(src) - n)
					seg.Off = uint64(off)
					if rng.IntN(8) == 0 {
						seg.Off = uint64(len(mem)) // past the registration: this key fails alone
						want = -int64(syscall.EFAULT)
					}
				} else if v, ok := model[key]; !ok {
					want = -int64(syscall.ENOENT)
				} else {
					want = int64(min(n, len(v)))
				}
				if !p(key, []ioctl.Seg{seg}) {
					break
				}
				c.keys, c.want, c.at = append(c.keys, key), append(c.want, want), append(c.at, pos)
				if put && want > 0 {
					model[key] = src[seg.Off : seg.Off+uint64(n)]
				}
				pos += n
			}
			if len(c.keys) == 0 {
				continue
			}
			id, errno := submitV(fx, fx.dh, put, &a)
			if errno != 0 || id <= 0 {
				t.Fatalf("round %d: submit: %d, %v", round, id, errno)
			}
			c.id = id
			calls = append(calls, c)
		}
		for _, i := range rng.Perm(len(calls)) {
			c := calls[i]
			res, errno := waitV(fx, fx.dh, uint32(c.id), len(c.keys))
			if errno != 0 {
				t.Fatalf("round %d: wait %d: %v", round, c.id, errno)
			}
			for k, key := range c.keys {
				if res[k] != c.want[k] {
					t.Fatalf("round %d, %s: %d, want %d", round, key, res[k], c.want[k])
				}
				if !put && res[k] > 0 && !bytes.Equal(dst[c.at[k]:c.at[k]+int(res[k])], model[key][:res[k]]) {
					t.Fatalf("round %d, %s: got other bytes", round, key)
				}
			}
			if _, errno := waitV(fx, fx.dh, uint32(c.id), len(c.keys)); errno != syscall.EINVAL {
				t.Fatalf("call %d waited for twice: %v", c.id, errno)
			}
		}
		for key, want := range model {
			if got := readKey(t, fx, key); !bytes.Equal(got, want) {
				t.Fatalf("round %d: %s holds other bytes", round, key)
			}
		}
	}
	if n := fx.root.fs.asyncHeld.count(); n != 0 {
		t.Fatalf("every call waited for, and the mount counts %d", n)
	}
}

// TestAsyncVBatchLimits: bad submissions and waits fail with EINVAL and
// change nothing; a handle holds MaxAsyncCalls calls (EBUSY beyond) until
// they are waited for; the barrier waits for all and consumes none; a
// released handle takes no more and drops what it held.
func TestAsyncVBatchLimits(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := callerCtx(os.Getpid())
	val := bytes.Repeat([]byte("v"), 100)
	id, mem := memfdOn(t, fx, fx.dh, 4096)
	copy(mem, val)
	seg := func(id uint64) ioctl.Seg { return ioctl.Seg{ID: id, Off: 0, Len: uint64(len(val))} }
	oneOf := vcallOf
	one := func(key string) *ioctl.VBatchArg { return oneOf(key, seg(id)) }
	batches := (&Mount{fs: fx.root.fs}).Batches
	before := batches()
	a := one("bad")
	a.Flags = ioctl.VBatchAsync | 2
	if _, errno := fx.root.Ioctl(ctx, fx.dh, ioctl.CmdBatchPutV, 0, a.Marshal(), make([]byte, ioctl.SizeVBatchArg)); errno != syscall.EINVAL {
		t.Fatalf("unknown flag: %v", errno)
	}
	// Process memory, named or registered by address, is not submitted:
	// the call would run when nothing keeps the thread id naming us.
	vmID := registerAddr(t, fx, fx.dh, val)
	for _, s := range []ioctl.Seg{{ID: ioctl.SegVM, Off: addr(val), Len: uint64(len(val))}, seg(vmID)} {
		if _, errno := submitV(fx, fx.dh, true, oneOf("bad", s)); errno != syscall.EINVAL {
			t.Fatalf("submitted process memory %+v: %v", s, errno)
		}
	}
	if _, err := fx.st.Stat(context.Background(), "bad"); err == nil {
		t.Fatal("a refused call stored its key")
	}
	for _, id := range []uint32{1, 12345} {
		if _, errno := waitV(fx, fx.dh, id, 0); errno != syscall.EINVAL {
			t.Fatalf("wait for call %d never made: %v", id, errno)
		}
	}
	bad := make([]byte, ioctl.SizeVBatchArg)
	binary.LittleEndian.PutUint32(bad[0:], ioctl.SizeVBatchArg)
	binary.LittleEndian.PutUint32(bad[4:], 1) // flags
	if _, errno := fx.root.Ioctl(ctx, fx.dh, ioctl.CmdBatchWait, 0, bad, make([]byte, ioctl.SizeVBatchArg)); errno != syscall.EINVAL {
		t.Fatalf("wait with flags: %v", errno)
	}
	if _, errno := fx.root.Ioctl(ctx, fx.fh, ioctl.CmdBatchWait, 0, bad, make([]byte, ioctl.SizeVBatchArg)); errno != syscall.ENOTDIR {
		t.Fatalf("wait on a file: %v", errno)
	}
	ids := map[int32]bool{}
	for i := range ioctl.MaxAsyncCalls {
		id, errno := submitV(fx, fx.dh, true, one(fmt.Sprintf("a%d", i)))
		if errno != 0 || ids[id] {
			t.Fatalf("submit %d: %d, %v", i, id, errno)
		}
		ids[id] = true
	}
	if _, errno := submitV(fx, fx.dh, true, one("over")); errno != syscall.EBUSY {
		t.Fatalf("call %d: %v, want EBUSY", ioctl.MaxAsyncCalls+1, errno)
	}
	if _, errno := waitV(fx, fx.dh, 0, 0); errno != 0 {
		t.Fatalf("barrier: %v", errno)
	}
	// The refused calls are not in the batch figures: they did no key's
	// work.
	if after := batches(); after.Keys-before.Keys != ioctl.MaxAsyncCalls || after.Submits-before.Submits != ioctl.MaxAsyncCalls {
		t.Errorf("%d keys and %d submits counted, want %d of each", after.Keys-before.Keys, after.Submits-before.Submits, ioctl.MaxAsyncCalls)
	}
	for i := range ioctl.MaxAsyncCalls {
		if got := readKey(t, fx, fmt.Sprintf("a%d", i)); !bytes.Equal(got, val) {
			t.Fatalf("a%d after the barrier: %q", i, got)
		}
	}
	if _, err := fx.st.Stat(context.Background(), "over"); err == nil {
		t.Fatal("the refused call stored its key")
	}
	for id := range ids {
		res, errno := waitV(fx, fx.dh, uint32(id), 1)
		if errno != 0 || res[0] != int64(len(val)) {
			t.Fatalf("wait %d after the barrier: %v, %v", id, res, errno)
		}
	}
	if id, errno := submitV(fx, fx.dh, true, one("again")); errno != 0 {
		t.Fatalf("submit once waited: %v", errno)
	} else if _, errno := waitV(fx, fx.dh, uint32(id), 1); errno != 0 {
		t.Fatal(errno)
	}
	// A handle released with calls not waited for.
	dh := testDirHandle(t, fx.root)
	rid, rmem := memfdOn(t, fx, dh, 4096)
	copy(rmem, val)
	for i := range 4 {
		if _, errno := submitV(fx, dh, true, oneOf(fmt.Sprintf("r%d", i), seg(rid))); errno != 0 {
			t.Fatal(errno)
		}
	}
	dh.Releasedir(ctx, 0)
	fx.root.fs.async.Wait()
	dh.async.mu.Lock()
	left := len(dh.async.calls)
	dh.async.mu.Unlock()
	if left != 0 {
		t.Fatalf("a released handle holds %d calls", left)
	}
	if _, errno := submitV(fx, dh, true, one("late")); errno != syscall.EBADF {
		t.Fatalf("submit on a released handle: %v", errno)
	}
	for i := range 4 {
		// Stopped at its next key, or done: whole or absent.
		if o, err := fx.st.Stat(context.Background(), fmt.Sprintf("r%d", i)); err == nil && !bytes.Equal(readKey(t, fx, o.Key), val) {
			t.Fatalf("r%d: a released handle's call left other bytes", i)
		}
	}
	// The mount's bound: many handles together hold at most
	// maxAsyncTotal calls.
	var many []*dirHandle
	var regIDs []uint64
	for len(many)*ioctl.MaxAsyncCalls < maxAsyncTotal+1 {
		h := testDirHandle(t, fx.root)
		hid, hmem := memfdOn(t, fx, h, 4096)
		copy(hmem, val)
		many, regIDs = append(many, h), append(regIDs, hid)
	}
	for k, h := range many[:len(many)-1] {
		for range ioctl.MaxAsyncCalls {
			if _, errno := submitV(fx, h, true, oneOf("m", seg(regIDs[k]))); errno != 0 {
				t.Fatalf("call %d of the mount: %v", fx.root.fs.asyncHeld.count(), errno)
			}
		}
	}
	extra, xid := many[len(many)-1], regIDs[len(regIDs)-1]
	if _, errno := submitV(fx, extra, true, oneOf("m", seg(xid))); errno != syscall.EBUSY {
		t.Fatalf("call %d of the mount: %v, want EBUSY", maxAsyncTotal+1, errno)
	}
	if _, errno := waitV(fx, many[0], 1, 1); errno != 0 {
		t.Fatal(errno)
	}
	if _, errno := submitV(fx, extra, true, oneOf("m", seg(xid))); errno != 0 {
		t.Fatalf("a call once another was waited for: %v", errno)
	}
	for _, h := range many {
		h.Releasedir(ctx, 0)
	}
	fx.root.fs.async.Wait()
	if n := fx.root.fs.asyncHeld.count(); n != 0 {
		t.Fatalf("the mount counts %d calls after every handle was released", n)
	}
	runtime.KeepAlive(val)
}

// registerAddr registers b by address on dh (KindVM) and returns its id.
func registerAddr(t *testing.T, fx *fuzzFixture, dh *dirHandle, b []byte) uint64 {
	t.Helper()
	a := ioctl.RegisterArg{Fd: -1, Kind: ioctl.KindVM, Offset: addr(b), Len: uint64(len(b))}
	out := make([]byte, ioctl.SizeRegisterArg)
	if _, errno := fx.root.Ioctl(callerCtx(os.Getpid()), dh, ioctl.CmdRegisterBuffer, 0, a.Marshal(), out); errno != 0 {
		t.Fatalf("register by address: %v", errno)
	}
	if err := a.Unmarshal(out); err != nil {
		t.Fatal(err)
	}
	return a.ID
}

// TestAsyncCloseRacesFinish: a handle released while its calls end drops
// each call once. Marked done outside the table's lock, a call could be
// dropped by both the release and its own end: the mount's count went
// one below the calls held (a bound of 1024 let 1025 in) and the call's
// arguments went back to the pool twice, two later calls sharing them.
func TestAsyncCloseRacesFinish(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := callerCtx(os.Getpid())
	val := bytes.Repeat([]byte("c"), 4096)
	for round := range 300 {
		dh := testDirHandle(t, fx.root)
		rid, rmem := memfdOn(t, fx, dh, len(val))
		copy(rmem, val)
		for i := range 4 {
			if _, errno := submitV(fx, dh, true, vcallOf(fmt.Sprintf("k%d", i), ioctl.Seg{ID: rid, Len: uint64(len(val))})); errno != 0 {
				t.Fatal(errno)
			}
		}
		dh.Releasedir(ctx, 0)
		fx.root.fs.async.Wait()
		if n := fx.root.fs.asyncHeld.count(); n != 0 {
			t.Fatalf("round %d: the mount counts %d calls once every handle was released", round, n)
		}
	}
}

// subdirOn makes directory name under the fixture's root, in the store
// and as a node, and returns its node and an open handle of it.
func subdirOn(t *testing.T, fx *fuzzFixture, name string) (*node, *dirHandle) {
	t.Helper()
	ctx := context.Background()
	o, err := fx.st.Mkdir(ctx, name, nil)
	if err != nil {
		t.Fatal(err)
	}
	sub := fx.root.fs.newNode()
	fx.root.AddChild(name, fx.root.NewPersistentInode(ctx, sub, gofs.StableAttr{Mode: syscall.S_IFDIR, Ino: o.Ino}), false)
	dh := testDirHandle(t, sub)
	t.Cleanup(func() { dh.async.close() })
	return sub, dh
}

// holdCalls keeps dh's submitted calls from running until the function
// it returns is called.
func holdCalls(t *testing.T, dh *dirHandle) (release func()) {
	ch := make(chan struct{})
	dh.async.beforeRun = func() { <-ch }
	var once sync.Once
	release = func() { once.Do(func() { close(ch) }) }
	t.Cleanup(release)
	return release
}

// TestAsyncQueueTime: a submitted call's wait to start (held here) goes
// to the mount's QueueNs, not to its handler time.
func TestAsyncQueueTime(t *testing.T) {
	fx := newFuzzFixture(t)
	_, dh := subdirOn(t, fx, "sub")
	release := holdCalls(t, dh)
	id, mem := memfdOn(t, fx, dh, 4096)
	copy(mem, "value")
	batches := (&Mount{fs: fx.root.fs}).Batches
	before := batches()
	call, errno := submitV(fx, dh, true, vcallOf("k", ioctl.Seg{ID: id, Off: 0, Len: 5}))
	if errno != 0 {
		t.Fatalf("submit: %v", errno)
	}
	// Long beside a one-key put's handler, so that the handler time's
	// bound below holds on a loaded machine too.
	const hold = 200 * time.Millisecond
	time.Sleep(hold)
	release()
	res, errno := waitV(fx, dh, uint32(call), 1)
	if errno != 0 || res[0] != 5 {
		t.Fatalf("wait: %v %v", res, errno)
	}
	after := batches()
	if q := time.Duration(after.QueueNs - before.QueueNs); q < hold {
		t.Errorf("queue time %v for a call held %v", q, hold)
	}
	if h := time.Duration(after.HandlerNs - before.HandlerNs); h >= hold {
		t.Errorf("handler time %v for a call held %v: the wait counted as work", h, hold)
	}
	if after.Keys-before.Keys != 1 || after.Submits-before.Submits != 1 {
		t.Errorf("%d keys and %d submits counted, want 1 and 1", after.Keys-before.Keys, after.Submits-before.Submits)
	}
}

// TestAsyncWaitAfterDirectoryRemoved: a call submitted on a directory's
// handle is collected by BATCH_WAIT on that handle after the directory is
// removed (its node has no path any more), its keys failed (ENOENT: the
// directory they were named in is gone, as openat(2) with its descriptor
// says); a new call there is refused (ENOENT).
func TestAsyncWaitAfterDirectoryRemoved(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := context.Background()
	sub, dh := subdirOn(t, fx, "sub")
	release := holdCalls(t, dh)
	id, mem := memfdOn(t, fx, dh, 4096)
	a := vcallOf("missing", ioctl.Seg{ID: id, Off: 0, Len: 100})
	a.Flags = ioctl.VBatchAsync
	call, errno := sub.Ioctl(callerCtx(os.Getpid()), dh, ioctl.CmdBatchGetV, 0, a.Marshal(), make([]byte, ioctl.SizeVBatchArg))
	if errno != 0 {
		t.Fatalf("submit: %v", errno)
	}
	if err := fx.st.Rmdir(ctx, "sub"); err != nil {
		t.Fatal(err)
	}
	fx.root.RmChild("sub")
	if k, ok := sub.key(); ok {
		t.Fatalf("the removed directory still has a path: %q", k)
	}
	release()
	in := make([]byte, ioctl.SizeVBatchArg)
	binary.LittleEndian.PutUint32(in[0:], ioctl.SizeVBatchArg)
	binary.LittleEndian.PutUint32(in[8:], uint32(call))
	out := make([]byte, ioctl.SizeVBatchArg)
	if _, errno := sub.Ioctl(callerCtx(os.Getpid()), dh, ioctl.CmdBatchWait, 0, in, out); errno != 0 {
		t.Fatalf("wait after the directory went: %v", errno)
	}
	var got ioctl.VBatchArg
	if err := got.Unmarshal(out); err != nil {
		t.Fatal(err)
	}
	if got.Count != 1 || got.Entries[0].Result != -int64(syscall.ENOENT) {
		t.Fatalf("results: %d keys, first %d", got.Count, got.Entries[0].Result)
	}
	if _, errno := sub.Ioctl(callerCtx(os.Getpid()), dh, ioctl.CmdBatchGetV, 0, a.Marshal(), make([]byte, ioctl.SizeVBatchArg)); errno != syscall.ENOENT {
		t.Fatalf("a new call on the removed directory: %v, want ENOENT", errno)
	}
	runtime.KeepAlive(mem)
}

// TestAsyncFollowsRenamedDirectory: a submitted call's keys are in the
// directory its handle names when the call runs: renamed since the
// submit, and another directory made at the old path, the call writes
// the renamed one's keys and not the newcomer's. While it runs, the call
// counts as a running request (Unmount's watch on stuck requests).
func TestAsyncFollowsRenamedDirectory(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := context.Background()
	sub, dh := subdirOn(t, fx, "ren")
	release := holdCalls(t, dh)
	id, mem := memfdOn(t, fx, dh, 4096)
	copy(mem, "moved")
	call, errno := submitV(fx, dh, true, vcallOf("k", ioctl.Seg{ID: id, Off: 0, Len: 5}))
	if errno != 0 {
		t.Fatalf("submit: %v", errno)
	}
	if n := fx.root.fs.ioctls.running.Load(); n != 1 {
		t.Fatalf("%d requests running while the submitted call waits, want 1", n)
	}
	if err := fx.st.Rename(ctx, "ren", "ren2", 0); err != nil {
		t.Fatal(err)
	}
	fx.root.MvChild("ren", &fx.root.Inode, "ren2", true)
	if _, err := fx.st.Mkdir(ctx, "ren", nil); err != nil {
		t.Fatal(err)
	}
	if k, _ := sub.key(); k != "ren2" {
		t.Fatalf("the renamed directory's node is at %q", k)
	}
	release()
	res, errno := waitV(fx, dh, uint32(call), 1)
	if errno != 0 || res[0] != 5 {
		t.Fatalf("wait: %v, %v", res, errno)
	}
	if got := readKey(t, fx, "ren2/k"); string(got) != "moved" {
		t.Fatalf("ren2/k: %q", got)
	}
	if _, err := fx.st.Stat(ctx, "ren/k"); err == nil {
		t.Fatal("the call wrote into the directory made at the old path")
	}
	fx.root.fs.async.Wait() // the call's goroutine past its accounting
	if n := fx.root.fs.ioctls.running.Load(); n != 0 {
		t.Fatalf("%d requests running once the call is done", n)
	}
}

// onThread runs fn on an OS thread of its own whose file-system uid and
// gid are uid and gid and whose groups are groups, passing fn its thread
// id; the thread ends with fn (and its credentials with it), and
// onThread returns once it is gone.
func onThread(t *testing.T, uid, gid uint32, groups []uint32, fn func(tid int)) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("changing a thread's credentials needs root")
	}
	tid, finished := make(chan int, 1), make(chan struct{})
	var run func()
	run = func() {
		// Never unlocked: the runtime ends the thread with the goroutine.
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// The main thread outlives its goroutine (the runtime keeps
			// it): work on another, holding this one meanwhile.
			done := make(chan struct{})
			go func() { defer close(done); run() }()
			<-done
			runtime.UnlockOSThread()
			return
		}
		defer close(finished)
		tid <- unix.Gettid()
		if len(groups) > 0 {
			// The raw call changes this thread only.
			if _, _, e := unix.RawSyscall(unix.SYS_SETGROUPS, uintptr(len(groups)), uintptr(unsafe.Pointer(&groups[0])), 0); e != 0 {
				t.Errorf("setgroups: %v", e)
				return
			}
		}
		unix.RawSyscall(unix.SYS_SETFSGID, uintptr(gid), 0, 0)
		unix.RawSyscall(unix.SYS_SETFSUID, uintptr(uid), 0, 0)
		fn(unix.Gettid())
	}
	go run()
	task := fmt.Sprintf("/proc/self/task/%d", <-tid)
	<-finished
	for {
		if _, err := os.Stat(task); os.IsNotExist(err) {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// callerAs is the context of a request from thread tid, running as uid
// and gid.
func callerAs(tid int, uid, gid uint32) context.Context {
	return fuse.NewContext(context.Background(), &fuse.Caller{Owner: fuse.Owner{Uid: uid, Gid: gid}, Pid: uint32(tid)})
}

// TestAsyncCallerGroupsAtSubmit: a submitted call's permission checks use
// the groups its caller had when it submitted, though the calling thread
// is gone when the call runs (its /proc entry with it).
func TestAsyncCallerGroupsAtSubmit(t *testing.T) {
	fx := newFuzzFixture(t)
	if _, err := fx.st.Mkdir(context.Background(), "grp", &store.Object{Mode: 0o770, Uid: 0, Gid: 1234}); err != nil {
		t.Fatal(err)
	}
	id, mem := memfdOn(t, fx, fx.dh, 4096)
	copy(mem, "group")
	release := holdCalls(t, fx.dh)
	var call int32
	var errno syscall.Errno
	onThread(t, 65534, 65534, []uint32{1234}, func(tid int) {
		a := vcallOf("grp/x", ioctl.Seg{ID: id, Off: 0, Len: 5})
		a.Flags = ioctl.VBatchAsync
		call, errno = fx.root.Ioctl(callerAs(tid, 65534, 65534), fx.dh, ioctl.CmdBatchPutV, 0, a.Marshal(), make([]byte, ioctl.SizeVBatchArg))
	})
	if errno != 0 {
		t.Fatalf("submit as a member of the directory's group: %v", errno)
	}
	release() // the submitting thread is gone
	res, errno := waitV(fx, fx.dh, uint32(call), 1)
	if errno != 0 || res[0] != 5 {
		t.Fatalf("a member of the directory's group put into it: %v, %v", res, errno)
	}
	if got := readKey(t, fx, "grp/x"); string(got) != "group" {
		t.Fatalf("grp/x: %q", got)
	}
	// A caller whose /proc entry has no answer (gone already, here; or
	// hidden) submits all the same, with its primary group alone, as a
	// call made at once checks it; root needs none.
	var gone int
	onThread(t, 0, 0, nil, func(tid int) { gone = tid })
	for _, c := range []struct {
		uid, gid uint32
		key      string
		want     int64
	}{
		{65534, 1234, "grp/primary", 5},
		{65534, 65534, "grp/other", -int64(syscall.EACCES)},
		{0, 0, "grp/root", 5},
	} {
		a := vcallOf(c.key, ioctl.Seg{ID: id, Off: 0, Len: 5})
		a.Flags = ioctl.VBatchAsync
		call, errno := fx.root.Ioctl(callerAs(gone, c.uid, c.gid), fx.dh, ioctl.CmdBatchPutV, 0, a.Marshal(), make([]byte, ioctl.SizeVBatchArg))
		if errno != 0 {
			t.Fatalf("submit as %d:%d from a thread that is gone: %v", c.uid, c.gid, errno)
		}
		if res, errno := waitV(fx, fx.dh, uint32(call), 1); errno != 0 || res[0] != c.want {
			t.Fatalf("put %s as %d:%d: %v, %v; want %d", c.key, c.uid, c.gid, res, errno, c.want)
		}
	}
}

// TestAsyncUserShare: one user, however many handles it opens, holds at
// most maxAsyncPerUser submitted calls; other users, and root, still
// submit theirs; waiting gives the user's share back.
func TestAsyncUserShare(t *testing.T) {
	fx := newFuzzFixture(t)
	get := func() *ioctl.VBatchArg {
		a := vcallOf("missing", ioctl.Seg{ID: ioctl.SegVM})
		a.Flags = ioctl.VBatchAsync
		return a
	}
	submitAs := func(uid uint32, dh *dirHandle) (int32, syscall.Errno) {
		var call int32
		var errno syscall.Errno
		onThread(t, uid, uid, nil, func(tid int) {
			call, errno = fx.root.Ioctl(callerAs(tid, uid, uid), dh, ioctl.CmdBatchGetV, 0, get().Marshal(), make([]byte, ioctl.SizeVBatchArg))
		})
		return call, errno
	}
	var handles []*dirHandle
	t.Cleanup(func() {
		for _, h := range handles {
			h.async.close()
		}
	})
	var errno syscall.Errno
	onThread(t, 65534, 65534, nil, func(tid int) {
		ctx := callerAs(tid, 65534, 65534)
		for held := 0; held <= maxAsyncPerUser; {
			h := testDirHandle(t, fx.root)
			handles = append(handles, h)
			for range ioctl.MaxAsyncCalls {
				if _, errno = fx.root.Ioctl(ctx, h, ioctl.CmdBatchGetV, 0, get().Marshal(), make([]byte, ioctl.SizeVBatchArg)); errno != 0 {
					if held != maxAsyncPerUser {
						t.Errorf("call %d of one user: %v", held+1, errno)
					}
					return
				}
				held++
			}
		}
	})
	if errno != syscall.EBUSY {
		t.Fatalf("the call past one user's share: %v, want EBUSY", errno)
	}
	other := testDirHandle(t, fx.root)
	handles = append(handles, other)
	if _, errno := submitAs(65533, other); errno != 0 {
		t.Fatalf("another user's call while the first holds its share: %v", errno)
	}
	// Root is held to the mount's bound alone.
	var h *dirHandle
	for i := range maxAsyncPerUser + 1 {
		if i%ioctl.MaxAsyncCalls == 0 {
			h = testDirHandle(t, fx.root)
			handles = append(handles, h)
		}
		if _, errno := submitV(fx, h, false, get()); errno != 0 {
			t.Fatalf("root's call %d: %v", i+1, errno)
		}
	}
	if _, errno := waitV(fx, handles[0], 0, 0); errno != 0 {
		t.Fatal(errno)
	}
	if _, errno := waitV(fx, handles[0], 1, 1); errno != 0 {
		t.Fatalf("collect the first user's first call: %v", errno)
	}
	if _, errno := submitAs(65534, handles[0]); errno != 0 {
		t.Fatalf("the user's call once one of its share was collected: %v", errno)
	}
	if n, want := fx.root.fs.asyncHeld.count(), 2*maxAsyncPerUser+2; n != want {
		t.Fatalf("the mount holds %d calls, want %d", n, want)
	}
	for _, h := range handles {
		h.async.close()
	}
	fx.root.fs.async.Wait()
	if n := fx.root.fs.asyncHeld.count(); n != 0 {
		t.Fatalf("the mount holds %d calls after every handle was released", n)
	}
}

// TestAsyncBadEntriesFailAlone: a submitted call's entries are decoded by
// the call, after the reply: one whose segments or meta do not decode
// fails alone at the wait (EINVAL) and the others are stored, as in a
// call made at once; process memory named in a malformed entry's
// segments is no reason to refuse the call (the entry fails anyway).
func TestAsyncBadEntriesFailAlone(t *testing.T) {
	fx := newFuzzFixture(t)
	val := bytes.Repeat([]byte("e"), 300)
	id, mem := memfdOn(t, fx, fx.dh, 4096)
	copy(mem, val)
	var a ioctl.VBatchArg
	p := vbatchPackerFor(&a)
	for _, k := range []string{"e0", "e1", "e2", "e3"} {
		if !p(k, []ioctl.Seg{{ID: id, Len: uint64(len(val))}}) {
			t.Fatal("area full")
		}
	}
	a.Entries[1].NSeg = 0                        // no segments
	a.Entries[2].MetaOff = ioctl.VBatchAreaBytes // a meta past the area
	a.Entries[2].MetaLen = 8
	// Entry 3 names process memory by address, after its count was made
	// 0: malformed, it is refused alone; the call still runs.
	vm := ioctl.Seg{ID: ioctl.SegVM, Off: addr(val), Len: uint64(len(val))}
	seg := a.Area[a.Entries[3].SegOff:]
	binary.LittleEndian.PutUint64(seg[0:], vm.ID)
	binary.LittleEndian.PutUint64(seg[8:], vm.Off)
	a.Entries[3].NSeg = 0
	cid, errno := submitV(fx, fx.dh, true, &a)
	if errno != 0 {
		t.Fatalf("submit: %v", errno)
	}
	res, errno := waitV(fx, fx.dh, uint32(cid), 4)
	if errno != 0 {
		t.Fatalf("wait: %v", errno)
	}
	want := []int64{int64(len(val)), -int64(syscall.EINVAL), -int64(syscall.EINVAL), -int64(syscall.EINVAL)}
	if !slices.Equal(res, want) {
		t.Fatalf("results %v, want %v", res, want)
	}
	if got := readKey(t, fx, "e0"); !bytes.Equal(got, val) {
		t.Fatalf("e0: %q", got)
	}
	for _, k := range []string{"e1", "e2", "e3"} {
		if _, err := fx.st.Stat(context.Background(), k); err == nil {
			t.Fatalf("%s was stored from a malformed entry", k)
		}
	}
	runtime.KeepAlive(val)
}

// BenchmarkVBatchAsync measures vector batch puts of 64 16 KiB keys from
// a memfd registration over the same 1024 keys, as batch_put_tensor
// sends an engine's blocks: each call returning with its results
// ("sync"), submitted and waited for one at a time ("async-1"), and
// four submitted at once, each waited for before the next goes
// ("async-4"). Between the sync and async figures of work-ns/key (the
// bench's key_work_us) is what a submitted call costs beyond the keys;
// queue-ns/call is a submitted call's wait for a thread to start it
// (here mostly the submitter's own time making the next call, while the
// new goroutine waits next in line on its processor), submit-ns/call its
// submit's time in the handler.
func BenchmarkVBatchAsync(b *testing.B) {
	const keys, size, per = 1024, 16 << 10, 64
	for _, mode := range []string{"sync", "async-1", "async-4"} {
		inFlight := map[string]int{"sync": 0, "async-1": 1, "async-4": 4}[mode]
		b.Run(mode, func(b *testing.B) {
			fx := newFixtureOf(b, 2*keys*size+(16<<20))
			id, mem := memfdOn(b, fx, fx.dh, keys*size)
			for i := range mem {
				mem[i] = byte(i * 7)
			}
			call := func(c int) *ioctl.VBatchArg {
				var a ioctl.VBatchArg
				pack := vbatchPackerFor(&a)
				for k := range per {
					at := (c*per + k) % keys
					if !pack(fmt.Sprintf("b%06d", at), []ioctl.Seg{{ID: id, Off: uint64(at * size), Len: size}}) {
						b.Fatal("area full")
					}
				}
				return &a
			}
			check := func(res []int64) {
				for k, r := range res {
					if r != size {
						b.Fatalf("key %d: %d", k, r)
					}
				}
			}
			ctx := callerCtx(os.Getpid())
			out := make([]byte, ioctl.SizeVBatchArg)
			var pending []uint32
			batches := (&Mount{fs: fx.root.fs}).Batches
			before := batches()
			defer func() {
				after := batches()
				if inFlight > 0 {
					b.ReportMetric(float64(after.QueueNs-before.QueueNs)/float64(b.N), "queue-ns/call")
					b.ReportMetric(float64(after.SubmitNs-before.SubmitNs)/float64(b.N), "submit-ns/call")
				}
			}()
			defer reportKeyWork(b, fx.root.fs)()
			for c := 0; b.Loop(); c++ {
				a := call(c)
				if inFlight == 0 {
					if _, errno := fx.root.Ioctl(ctx, fx.dh, ioctl.CmdBatchPutV, 0, a.Marshal(), out); errno != 0 {
						b.Fatal(errno)
					}
					if err := a.Unmarshal(out); err != nil {
						b.Fatal(err)
					}
					for k := range per {
						if a.Entries[k].Result != size {
							b.Fatalf("key %d: %d", k, a.Entries[k].Result)
						}
					}
					continue
				}
				if len(pending) == inFlight {
					res, errno := waitV(fx, fx.dh, pending[0], per)
					if errno != 0 {
						b.Fatal(errno)
					}
					check(res)
					pending = pending[1:]
				}
				n, errno := submitV(fx, fx.dh, true, a)
				if errno != 0 {
					b.Fatal(errno)
				}
				pending = append(pending, uint32(n))
			}
			for _, n := range pending {
				res, errno := waitV(fx, fx.dh, n, per)
				if errno != 0 {
					b.Fatal(errno)
				}
				check(res)
			}
		})
	}
}
