package fs

import (
	"context"
	"encoding/binary"
	"syscall"
	"testing"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/pinned"
	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// fuzzFixture is an unmounted node tree over a real store: a root, a file
// "f" with a writable handle and a registered 64 KiB buffer, and a
// directory handle on the root.
type fuzzFixture struct {
	st   *store.Store
	idx  *store.Embedded // the store's index, and its LRU
	root *node
	file *node
	fh   *handle
	dh   *dirHandle
}

func newFuzzFixture(t testing.TB) *fuzzFixture {
	return newFixtureOf(t, 8<<20)
}

// newFixtureOf is newFuzzFixture with a store of size bytes.
func newFixtureOf(t testing.TB, size int) *fuzzFixture { return newFixtureWith(t, size, false) }

// newFixtureWith is newFixtureOf with eviction on or off: on, the store
// keeps its LRU in the index, as the daemon's does by default. opts
// change the store's options further.
func newFixtureWith(t testing.TB, size int, evict bool, opts ...func(*store.Options)) *fuzzFixture {
	tab := segment.NewTable()
	// Mapped and faulted in as a daemon's segments are, outside the Go
	// heap: a heap-allocated store of gigabytes put the collector's next
	// cycle gigabytes away, so every allocation of a benchmark's calls
	// landed on fresh pages and timed their faults.
	po := pinned.DefaultOptions()
	po.Size, po.Huge, po.Lock, po.Reserve = uint64(size), pinned.HugeOff, false, false
	reg, err := pinned.Map(po)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { reg.Close() })
	// In segments of at most 1 GiB, as the daemon's (--segment-size).
	for id, off := segment.ID(0), 0; off < size; id, off = id+1, off+1<<30 {
		if err := tab.Add(segment.NewSegment(id, reg.Bytes()[off:min(size, off+1<<30)])); err != nil {
			t.Fatal(err)
		}
	}
	eng, err := transfer.New(transfer.Options{Local: tab, Self: "local"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(eng.Close)
	so := store.DefaultOptions()
	idx := store.NewEmbeddedFor(store.KeysFor(uint64(size)))
	so.Index, so.Segments, so.Engine, so.Evict = idx, tab, eng, evict
	for _, o := range opts {
		o(&so)
	}
	st, err := store.New(so)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Close)
	fo := DefaultOptions()
	fo.Store = st
	f, err := newFS(fo)
	if err != nil {
		t.Fatal(err)
	}
	root := f.newNode()
	gofs.NewNodeFS(root, &gofs.Options{})
	ctx := context.Background()
	o, err := st.Create(ctx, "f", nil, false)
	if err != nil {
		t.Fatal(err)
	}
	fn := f.newNode()
	root.AddChild("f", root.NewPersistentInode(ctx, fn, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: o.Ino}), false)
	h, err := fn.open(ctx, "f", o, syscall.O_RDWR)
	if err != nil {
		t.Fatal(err)
	}
	mfd, err := unix.MemfdCreate("fuzz", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(mfd)
	if err := unix.Ftruncate(mfd, 64<<10); err != nil {
		t.Fatal(err)
	}
	sh, err := pinned.MapShared(mfd, 0, 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	h.regs.add(0, &registration{sh: sh, mem: sh.Bytes()})
	dh := testDirHandle(t, root)
	t.Cleanup(func() { h.regs.closeAll() })
	t.Cleanup(func() { dh.async.close(); f.async.Wait() }) // before the store closes
	return &fuzzFixture{st: st, idx: idx, root: root, file: fn, fh: h, dh: dh}
}

var fuzzCmds = []uint32{
	ioctl.CmdGetMagic, ioctl.CmdGetABIVersion, ioctl.CmdRegisterBuffer, ioctl.CmdUnregisterBuffer,
	ioctl.CmdPutBuf, ioctl.CmdGetBuf, ioctl.CmdPutVM, ioctl.CmdGetVM, ioctl.CmdStat,
	ioctl.CmdBatchPut, ioctl.CmdBatchGet, ioctl.CmdPutCUDA, ioctl.CmdGetCUDA,
	ioctl.CmdPutKey, ioctl.CmdGetKey, ioctl.CmdBatchPutV, ioctl.CmdBatchGetV, ioctl.CmdBatchWait,
	ioctl.CmdBatchPutTable, ioctl.CmdBatchGetTable, ioctl.CmdPutKeyInline, ioctl.CmdGetKeyInline,
}

// allowedErrnos are the answers bad input may get.
var allowedErrnos = map[syscall.Errno]bool{
	0: true, syscall.EINVAL: true, syscall.EFAULT: true, syscall.EBADF: true, syscall.ENOTTY: true,
	syscall.EPERM: true, syscall.ERANGE: true, syscall.ENOENT: true, syscall.EEXIST: true,
	syscall.ENOSPC: true, syscall.ENOTDIR: true, syscall.EISDIR: true, syscall.ESRCH: true,
	syscall.ENAMETOOLONG: true, syscall.EACCES: true, syscall.EFBIG: true,
	syscall.ENODEV: true, syscall.ENOMEM: true, syscall.EBADMSG: true, syscall.EOVERFLOW: true,
	syscall.EBUSY: true, syscall.EOPNOTSUPP: true,
}

// FuzzIoctl drives the ioctl dispatch with arbitrary commands and bytes:
// no panic, only the errnos bad input may get, and a rejected call leaves
// the file's committed version as it was.
func FuzzIoctl(f *testing.F) {
	buf := (&ioctl.BufArg{ID: 1, Len: 4096}).Marshal()
	f.Add(uint8(4), uint32(0), false, buf)
	f.Add(uint8(5), uint32(0), false, (&ioctl.BufArg{ID: 1, Len: 100, ObjOff: 3}).Marshal())
	f.Add(uint8(8), uint32(0), false, (&ioctl.StatArg{}).Marshal())
	f.Add(uint8(9), uint32(0), true, (&ioctl.BatchArg{Count: 1}).Marshal())
	f.Add(uint8(200), uint32(0xdeadbeef), false, []byte{1, 2, 3})
	f.Add(uint8(200), uint32(unix.FS_IOC_GETFLAGS), false, []byte{})
	f.Add(uint8(200), uint32(unix.FS_IOC_SETFLAGS), false, []byte{0x10, 0, 0, 0, 0, 0, 0, 0}) // immutable: not kept
	f.Add(uint8(200), uint32(fsIOCFSSetXattr), true, make([]byte, sizeFsxattr))
	f.Add(uint8(13), uint32(0), true, (&ioctl.KeyArg{KeyLen: 1, Len: 8}).Marshal())
	f.Add(uint8(15), uint32(0), true, (&ioctl.VBatchArg{Count: 1}).Marshal())
	f.Add(uint8(15), uint32(0), true, (&ioctl.VBatchArg{Header: ioctl.Header{Flags: ioctl.VBatchAsync}, Count: 1}).Marshal())
	f.Add(uint8(17), uint32(0), true, (&ioctl.VBatchArg{Count: 1}).Marshal()) // BATCH_WAIT of call 1
	whole := ioctl.KeyArg{Header: ioctl.Header{Flags: ioctl.FlagWhole}, Source: ioctl.SrcVM, KeyLen: 1, Len: 8}
	whole.Key[0] = 'f'
	f.Add(uint8(14), uint32(0), true, whole.Marshal()) // GET_KEY of f, FlagWhole
	for _, pick := range []uint8{20, 21} {             // PUT_KEY_INLINE of f, 8 B; GET_KEY_INLINE of it
		a := ioctl.KeyArg{Source: ioctl.SrcInline, KeyLen: 1, Len: 8}
		a.Key[0] = 'f'
		b := make([]byte, ioctl.SizeKeyInlineArg)
		a.MarshalInlineInto(b)
		f.Add(pick, uint32(0), true, b)
	}
	fx := newFuzzFixture(f)
	ctx := context.Background()
	f.Fuzz(func(t *testing.T, pick uint8, raw uint32, dir bool, in []byte) {
		cmd := raw
		if int(pick) < len(fuzzCmds) {
			cmd = fuzzCmds[pick]
		}
		// Usually send the size the command says, with a valid size
		// field, so the fuzzer gets past the header.
		size := int(ioctl.Size(cmd))
		if pick%3 != 0 && size >= 8 {
			in = append(in, make([]byte, max(0, size-len(in)))...)[:size]
			binary.LittleEndian.PutUint32(in, uint32(size))
		}
		out := make([]byte, size)
		before, _ := fx.st.Stat(ctx, "f")
		var fh gofs.FileHandle = fx.fh
		n := fx.file
		if dir {
			fh, n = fx.dh, fx.root
		}
		_, errno := n.Ioctl(ctx, fh, cmd, 0, in, out)
		fx.root.fs.async.Wait() // a submitted call's changes are in before the check
		if !allowedErrnos[errno] {
			t.Fatalf("cmd %#x: errno %v", cmd, errno)
		}
		after, err := fx.st.Stat(ctx, "f")
		if err != nil {
			t.Fatalf("file gone after cmd %#x (errno %v): %v", cmd, errno, err)
		}
		if errno != 0 && after.Version != before.Version {
			t.Fatalf("cmd %#x failed with %v but changed the file (version %d -> %d)", cmd, errno, before.Version, after.Version)
		}
	})
}
